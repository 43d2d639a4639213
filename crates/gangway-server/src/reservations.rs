//! Maintenance reservations: admin-made windows during which named nodes run
//! nothing, and before which they take no job that would run into them.
//!
//! Each is stored at `/reservations/<name>` (JSON [`MaintenanceReservation`])
//! and loaded at start; the scheduler loop copies them into the scheduling
//! core's state ([`gangway_sched::ClusterState::set_maintenance`]) every cycle
//! and drops the ones that have ended. Routes:
//! `POST /v1/reservations` (admin), `GET /v1/reservations` (any person),
//! `DELETE /v1/reservations/{name}` (admin), served by
//! [`crate::reservations_api`].

use crate::control_error::{decode, ControlError};
use gangway_store::Store;
use serde::{Deserialize, Serialize};

/// Store prefix of reservations.
pub const PREFIX: &str = "/reservations/";
/// Longest reservation name.
pub const MAX_NAME: usize = 63;
/// Longest window: 30 days.
pub const MAX_DURATION_SECONDS: u64 = 30 * 86_400;
/// Latest start: a year ahead.
pub const MAX_START_AHEAD_SECONDS: u64 = 366 * 86_400;
/// How far in the past a start may be (clock skew, typing time).
pub const PAST_TOLERANCE_SECONDS: u64 = 60;
/// Most nodes in one reservation.
pub const MAX_NODES: usize = 10_000;
/// Most reservations at once.
pub const MAX_RESERVATIONS: usize = 1_000;

/// A stored maintenance reservation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MaintenanceReservation {
    /// Its name (`[a-z0-9][a-z0-9._-]*`, at most [`MAX_NAME`]).
    pub name: String,
    /// Nodes it takes.
    pub nodes: Vec<String>,
    /// Start, seconds since the epoch.
    pub start: u64,
    /// End (first second after it), seconds since the epoch.
    pub end: u64,
    /// Who made it.
    pub created_by: String,
}

/// The body of `POST /v1/reservations`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateReservation {
    /// Name.
    pub name: String,
    /// Node names.
    pub nodes: Vec<String>,
    /// Start, seconds since the epoch.
    pub start: u64,
    /// Length in seconds.
    pub duration_seconds: u64,
}

/// Reservations by name: a persistent map, so the read view shares it
/// (`GET /v1/reservations` takes no lock) and a publication copies nothing.
pub type ReservationMap = imbl::OrdMap<String, MaintenanceReservation>;

/// The reservations the control state knows, by name.
#[derive(Clone, Debug, Default)]
pub struct Reservations(pub ReservationMap);

impl Reservations {
    /// Loads every stored reservation.
    pub fn load<S: Store>(store: &S) -> Result<Self, ControlError> {
        let mut out = ReservationMap::new();
        for kv in store.range(PREFIX)? {
            let r: MaintenanceReservation = decode(&kv.key, &kv.value)?;
            out.insert(r.name.clone(), r);
        }
        Ok(Reservations(out))
    }
}

/// Why a reservation was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReservationError {
    /// A malformed field, named in the message (400).
    #[error("{0}")]
    Malformed(String),
    /// A node the cluster does not have (422).
    #[error("{0}")]
    NoSuchNode(String),
    /// The name is taken (409).
    #[error("{0}")]
    Exists(String),
    /// [`MAX_RESERVATIONS`] reached (429).
    #[error("{0}")]
    TooMany(String),
    /// The store or the control state.
    #[error(transparent)]
    Control(#[from] ControlError),
}

pub(crate) fn bad(msg: impl Into<String>) -> ReservationError {
    ReservationError::Malformed(msg.into())
}

/// Checks a name: lowercase letters, digits, `.`, `_`, `-`, starting with a
/// letter or digit, 1 to [`MAX_NAME`] characters.
pub fn check_name(name: &str) -> Result<(), ReservationError> {
    let ok_first = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let ok_rest = name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-'));
    if name.is_empty() || name.len() > MAX_NAME || !ok_first || !ok_rest {
        return Err(bad(format!(
            "name: 1 to {MAX_NAME} characters of a-z, 0-9, '.', '_', '-', starting with a letter or digit"
        )));
    }
    Ok(())
}
