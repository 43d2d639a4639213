//! The wall clock in whole seconds since the Unix epoch: the one time source
//! of the state layer and the HTTP layer alike (the scheduling core itself is
//! given times, never reads a clock).

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
