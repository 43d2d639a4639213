//! Time spans as written in specs and on the command line (Slurm's `--time` forms).

use serde::{Deserialize, Serialize};

/// A time span as written in a spec: whole seconds (`5400`) or text
/// (`"01:30:00"`, `"1h30m"`, `"2-00:00:00"`, `"90m"`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum TimeSpan {
    /// Seconds.
    Seconds(u64),
    /// Text, parsed by [`parse_time_span`].
    Text(String),
}

impl TimeSpan {
    /// The span in seconds, or why it is not one.
    pub fn seconds(&self) -> Result<u64, String> {
        match self {
            TimeSpan::Seconds(s) => Ok(*s),
            TimeSpan::Text(t) => parse_time_span(t),
        }
    }
}

/// Parses `"5400"`, `"HH:MM:SS"`, `"MM:SS"`, `"D-HH:MM:SS"` (Slurm's
/// `--time`) or unit form `"1d2h30m15s"` into seconds; checked arithmetic.
pub fn parse_time_span(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let bad = || format!("{text:?} is not a duration (use seconds, \"HH:MM:SS\" or \"1h30m\")");
    if t.is_empty() {
        return Err(bad());
    }
    let num = |s: &str| -> Result<u64, String> {
        if s.is_empty() || !s.chars().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        s.parse::<u64>().map_err(|_| bad())
    };
    let overflow = || format!("{text:?} is too long a duration");
    if t.chars().all(|c| c.is_ascii_digit()) {
        return num(t);
    }
    if t.contains(':') || t.contains('-') {
        let (days, rest) = match t.split_once('-') {
            Some((d, r)) => (num(d)?, r),
            None => (0, t),
        };
        let parts: Vec<&str> = rest.split(':').collect();
        let (h, m, s) = match parts.as_slice() {
            [h, m, s] => (num(h)?, num(m)?, num(s)?),
            [m, s] if days == 0 => (0, num(m)?, num(s)?),
            [h, m] => (num(h)?, num(m)?, 0),
            [h] if days > 0 => (num(h)?, 0, 0),
            _ => return Err(bad()),
        };
        if m >= 60 || s >= 60 || (days > 0 && h >= 24) {
            return Err(bad());
        }
        return days
            .checked_mul(86_400)
            .and_then(|d| h.checked_mul(3600).and_then(|h| d.checked_add(h)))
            .and_then(|x| x.checked_add(m * 60 + s))
            .ok_or_else(overflow);
    }
    let mut total: u64 = 0;
    let mut digits = String::new();
    let mut seen_unit = false;
    for c in t.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c.to_ascii_lowercase() {
            'd' => 86_400,
            'h' => 3600,
            'm' => 60,
            's' => 1,
            _ => return Err(bad()),
        };
        let n = num(&digits)?;
        digits.clear();
        seen_unit = true;
        total = n
            .checked_mul(unit)
            .and_then(|x| total.checked_add(x))
            .ok_or_else(overflow)?;
    }
    if !digits.is_empty() || !seen_unit {
        return Err(bad());
    }
    Ok(total)
}

/// `5400` → `"1:30:00"`, `93784` → `"1-02:03:04"` (Slurm's form).
pub fn format_time_span(secs: u64) -> String {
    let (d, rest) = (secs / 86_400, secs % 86_400);
    let (h, m, s) = (rest / 3600, rest % 3600 / 60, rest % 60);
    if d > 0 {
        format!("{d}-{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h}:{m:02}:{s:02}")
    }
}
