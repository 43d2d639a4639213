//! `gangway reservation create|list|delete`: maintenance windows (admins
//! create and delete them; anyone may list).

use crate::client::Conn;
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use serde_json::{json, Value};

/// What to do with reservations.
#[derive(Subcommand)]
pub enum Action {
    /// Reserves nodes for maintenance: nothing runs on them in the window,
    /// and no job that would run into it starts on them before (admin).
    Create {
        /// Name (a-z, 0-9, '.', '_', '-').
        #[arg(long)]
        name: String,
        /// Nodes, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        nodes: Vec<String>,
        /// Start: `now`, `+2h` (also s, m, d), or UTC `2026-12-03T14:00:00Z`.
        #[arg(long)]
        start: String,
        /// Length: `2h`, `90m`, `1h30m`, `3600s`, `1d`.
        #[arg(long)]
        duration: String,
    },
    /// Lists reservations.
    List,
    /// Deletes a reservation (admin).
    Delete {
        /// Name.
        name: String,
    },
}

/// Runs `gangway reservation ...`.
pub fn run(c: &Conn, a: Action) -> Result<()> {
    match a {
        Action::Create {
            name,
            nodes,
            start,
            duration,
        } => {
            let now = crate::client::unix_now();
            let start = parse_when(&start, now)?;
            let duration = parse_duration(&duration)?;
            let body = json!({
                "name": name, "nodes": nodes, "start": start, "duration_seconds": duration,
            });
            let v = c.post("/v1/reservations", "application/json", &body.to_string())?;
            c.print(&v, |v| {
                format!(
                    "reservation {} on {} from {} to {}\n",
                    crate::client::show(v.get("name")),
                    list_of(v.get("nodes")),
                    crate::client::show(v.get("start")),
                    crate::client::show(v.get("end")),
                )
            })
        }
        Action::List => {
            let v = c.get("/v1/reservations")?;
            c.print(&v, |v| {
                let now = crate::client::unix_now();
                let mut out = format!(
                    "{:<20} {:<12} {:<12} {:<12} {}\n",
                    "NAME", "START", "END", "STATE", "NODES"
                );
                for r in v.as_array().into_iter().flatten() {
                    let (s, e) = (
                        r.get("start").and_then(Value::as_u64).unwrap_or(0),
                        r.get("end").and_then(Value::as_u64).unwrap_or(0),
                    );
                    let state = if s > now { "upcoming" } else { "active" };
                    out += &format!(
                        "{:<20} {:<12} {:<12} {:<12} {}\n",
                        crate::client::show(r.get("name")),
                        s,
                        e,
                        state,
                        list_of(r.get("nodes"))
                    );
                }
                out
            })
        }
        Action::Delete { name } => {
            let v = c.delete(&format!("/v1/reservations/{name}"))?;
            c.print(&v, |_| format!("reservation {name} deleted\n"))
        }
    }
}

fn list_of(v: Option<&Value>) -> String {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default()
}

/// Seconds in `2h`, `90m`, `1h30m`, `45s`, `1d`, or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<u64> {
    let t = s.trim();
    if t.is_empty() {
        bail!("duration: empty (e.g. 2h, 90m, 1h30m)");
    }
    if let Ok(n) = t.parse::<u64>() {
        return Ok(n);
    }
    let mut total: u64 = 0;
    let mut num = String::new();
    for ch in t.chars() {
        if ch.is_ascii_digit() {
            num.push(ch);
            continue;
        }
        let unit = match ch {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            _ => bail!("duration: unknown unit {ch:?} in {t:?} (s, m, h, d)"),
        };
        let n: u64 = num
            .parse()
            .with_context(|| format!("duration: a number must come before {ch:?} in {t:?}"))?;
        total = n
            .checked_mul(unit)
            .and_then(|x| total.checked_add(x))
            .with_context(|| format!("duration: {t:?} is too long"))?;
        num.clear();
    }
    if !num.is_empty() {
        bail!("duration: {t:?} ends without a unit (s, m, h, d)");
    }
    Ok(total)
}

/// A start: `now`, `+DURATION` from `now`, or a UTC time
/// `YYYY-MM-DDTHH:MM[:SS]Z` (seconds since the epoch).
pub fn parse_when(s: &str, now: u64) -> Result<u64> {
    let t = s.trim();
    if t == "now" {
        return Ok(now);
    }
    if let Some(d) = t.strip_prefix('+') {
        return now
            .checked_add(parse_duration(d)?)
            .context("start: too far ahead");
    }
    parse_utc(t).with_context(|| {
        format!("start: expected now, +2h or a UTC time like 2026-12-03T14:00:00Z, got {t:?}")
    })
}

fn parse_utc(t: &str) -> Option<u64> {
    let t = t.strip_suffix('Z').unwrap_or(t);
    let (date, time) = t.split_once('T').or_else(|| t.split_once(' '))?;
    let mut d = date.split('-');
    let (y, mo, da): (i64, u32, u32) = (
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
    );
    if d.next().is_some() || !(1..=12).contains(&mo) || !(1..=31).contains(&da) {
        return None;
    }
    let mut hms = time.split(':');
    let h: u64 = hms.next()?.parse().ok()?;
    let mi: u64 = hms.next()?.parse().ok()?;
    let sec: u64 = hms.next().map_or(Some(0), |x| x.parse().ok())?;
    if hms.next().is_some() || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = i64::from((mo + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(da) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let days = u64::try_from(days).ok()?;
    Some(days * 86_400 + h * 3600 + mi * 60 + sec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_starts_parse() {
        assert_eq!(parse_duration("2h").unwrap(), 7200);
        assert_eq!(parse_duration("1h30m").unwrap(), 5400);
        assert_eq!(parse_duration("90").unwrap(), 90);
        assert_eq!(parse_duration("1d").unwrap(), 86_400);
        for bad in ["", "2x", "h", "5h3", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_when("now", 1000).unwrap(), 1000);
        assert_eq!(parse_when("+2h", 1000).unwrap(), 8200);
        assert_eq!(parse_when("1970-01-02T00:00:00Z", 0).unwrap(), 86_400);
        assert_eq!(
            parse_when("2026-12-03T14:00:00Z", 0).unwrap(),
            1_796_306_400
        );
        assert_eq!(parse_when("2000-03-01T00:00Z", 0).unwrap(), 951_868_800);
        for bad in [
            "tomorrow",
            "2026-13-01T00:00:00Z",
            "2026-12-03T25:00:00Z",
            "+",
        ] {
            assert!(parse_when(bad, 0).is_err(), "{bad}");
        }
    }
}
