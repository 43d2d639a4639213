//! Slurm's everyday workflow vocabulary, parsed without I/O: deferred start
//! (`--begin`), dependencies (`afterok:ID`, `singleton`, ...) and job arrays
//! (`0-15%4`). The server decides with these when a job may enter the
//! scheduler; the CLI uses the same parsers for its flags.

use crate::id::JobId;
use crate::span::parse_time_span;
use crate::Time;
use serde::{Deserialize, Serialize};

/// When a job may start at the earliest (Slurm's `--begin`): epoch seconds,
/// or text resolved at submission by [`parse_begin`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum BeginAt {
    /// Seconds since the epoch (what the server stores).
    Seconds(u64),
    /// `now`, `now+10m`, `+1h`, `2026-12-03T12:00:00Z`, `2026-12-03`.
    Text(String),
}

impl BeginAt {
    /// Epoch seconds, with relative forms counted from `now`.
    pub fn resolve(&self, now: Time) -> Result<u64, String> {
        match self {
            BeginAt::Seconds(s) => Ok(*s),
            BeginAt::Text(t) => parse_begin(t, now),
        }
    }
}

/// Parses a point in time: `now`, `now+DURATION`, `+DURATION`, `now-DURATION`,
/// `-DURATION` (durations as [`parse_time_span`]), epoch seconds, or ISO 8601 UTC
/// `YYYY-MM-DD[THH:MM[:SS]][Z]`.
pub fn parse_begin(text: &str, now: Time) -> Result<u64, String> {
    let t = text.trim();
    let bad = || {
        format!(
            "{text:?} is not a time (use now, now+10m, +1h, epoch seconds or 2026-12-03T12:00:00Z)"
        )
    };
    if t.eq_ignore_ascii_case("now") {
        return Ok(now);
    }
    let lower = t.to_ascii_lowercase();
    let rel = lower.strip_prefix("now").unwrap_or(&lower);
    if let Some(d) = rel.strip_prefix('+') {
        let secs = parse_time_span(d)?;
        return now
            .checked_add(secs)
            .ok_or_else(|| format!("{text:?} is too far away"));
    }
    if let Some(d) = rel.strip_prefix('-') {
        return Ok(now.saturating_sub(parse_time_span(d)?));
    }
    if !t.is_empty() && t.chars().all(|c| c.is_ascii_digit()) {
        return t.parse().map_err(|_| bad());
    }
    parse_iso_utc(t).ok_or_else(bad)
}

/// `YYYY-MM-DD[THH:MM[:SS]][Z]` (a space may replace `T`) as UTC epoch seconds.
fn parse_iso_utc(t: &str) -> Option<u64> {
    let t = t.strip_suffix('Z').unwrap_or(t);
    let (date, time) = match t.split_once(['T', ' ']) {
        Some((d, tm)) => (d, Some(tm)),
        None => (t, None),
    };
    let num = |s: &str, len: usize| -> Option<u64> {
        (s.len() == len && s.chars().all(|c| c.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    let mut d = date.split('-');
    let (y, m, day) = (num(d.next()?, 4)?, num(d.next()?, 2)?, num(d.next()?, 2)?);
    if d.next().is_some() || !(1..=12).contains(&m) || !(1..=31).contains(&day) || y < 1970 {
        return None;
    }
    let (hh, mm, ss) = match time {
        None => (0, 0, 0),
        Some(tm) => {
            let mut p = tm.split(':');
            let h = num(p.next()?, 2)?;
            let mi = num(p.next()?, 2)?;
            let s = match p.next() {
                Some(s) => num(s, 2)?,
                None => 0,
            };
            if p.next().is_some() || h > 23 || mi > 59 || s > 59 {
                return None;
            }
            (h, mi, s)
        }
    };
    // Days from the civil date (Howard Hinnant's algorithm), 1970-01-01 = 0.
    let (y, m) = (y as i64, m as i64);
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let days = u64::try_from(days).ok()?;
    Some(days * 86_400 + hh * 3600 + mm * 60 + ss)
}

/// Epoch seconds as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn format_utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// How a job waits for another (Slurm's dependency types).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AfterKind {
    /// Starts after the job succeeded; never if it failed or was cancelled.
    AfterOk,
    /// Starts after the job ended, however it ended.
    AfterAny,
    /// Starts after the job failed, was cancelled or timed out; never if it succeeded.
    AfterNotOk,
}

impl AfterKind {
    /// Slurm's name (`afterok`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            AfterKind::AfterOk => "afterok",
            AfterKind::AfterAny => "afterany",
            AfterKind::AfterNotOk => "afternotok",
        }
    }
}

/// One term of a dependency.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dependency {
    /// `afterok:ID[:ID..]` and the like.
    After(AfterKind, Vec<JobId>),
    /// At most one job per (user, name) in the scheduler at a time.
    Singleton,
}

/// Longest dependency string, in bytes.
pub const MAX_DEPENDENCY_LEN: usize = 1024;
/// Most job ids in one dependency.
pub const MAX_DEPENDENCY_IDS: usize = 100;

/// Parses Slurm's dependency syntax: terms joined by `,`, each `singleton`
/// or `afterok|afterany|afternotok:ID[:ID..]`; every term must hold.
pub fn parse_dependency(text: &str) -> Result<Vec<Dependency>, String> {
    if text.len() > MAX_DEPENDENCY_LEN {
        return Err(format!("at most {MAX_DEPENDENCY_LEN} bytes"));
    }
    let mut out = Vec::new();
    let mut ids_total = 0usize;
    for term in text.split(',') {
        let term = term.trim();
        if term.eq_ignore_ascii_case("singleton") {
            if !out.contains(&Dependency::Singleton) {
                out.push(Dependency::Singleton);
            }
            continue;
        }
        let mut parts = term.split(':');
        let kind = match parts.next().map(str::to_ascii_lowercase).as_deref() {
            Some("afterok") => AfterKind::AfterOk,
            Some("afterany") => AfterKind::AfterAny,
            Some("afternotok") => AfterKind::AfterNotOk,
            _ => {
                return Err(format!(
                    "{term:?}: expected afterok:ID, afterany:ID, afternotok:ID or singleton"
                ))
            }
        };
        let mut ids = Vec::new();
        for p in parts {
            let id: u64 = p
                .trim()
                .parse()
                .map_err(|_| format!("{term:?}: {p:?} is not a job id"))?;
            ids.push(JobId(id));
        }
        if ids.is_empty() {
            return Err(format!("{term:?}: names no job id"));
        }
        ids_total += ids.len();
        if ids_total > MAX_DEPENDENCY_IDS {
            return Err(format!("at most {MAX_DEPENDENCY_IDS} job ids"));
        }
        out.push(Dependency::After(kind, ids));
    }
    Ok(out)
}

/// The largest array index.
pub const MAX_ARRAY_INDEX: u32 = 1_000_000;
/// Most tasks in one array.
pub const MAX_ARRAY_TASKS: usize = 10_000;

/// A parsed `--array`: the task indexes in order, and the concurrency limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArraySpec {
    /// Task indexes, ascending, distinct.
    pub indexes: Vec<u32>,
    /// At most this many tasks in the scheduler at once (`%N`).
    pub limit: Option<u32>,
}

/// Parses Slurm's array syntax: `0-15`, `1,3,5-9`, `0-15:4` (step), with an
/// optional `%N` concurrency limit; at most [`MAX_ARRAY_TASKS`] tasks,
/// indexes up to [`MAX_ARRAY_INDEX`].
pub fn parse_array(text: &str) -> Result<ArraySpec, String> {
    let t = text.trim();
    if t.len() > 1024 {
        return Err("at most 1024 bytes".into());
    }
    let (ranges, limit) = match t.split_once('%') {
        Some((r, l)) => {
            let n: u32 = l
                .trim()
                .parse()
                .map_err(|_| format!("%{l}: the limit must be a whole number"))?;
            if n == 0 {
                return Err("%0: the limit must be at least 1".into());
            }
            (r, Some(n))
        }
        None => (t, None),
    };
    let num = |s: &str| -> Result<u32, String> {
        let n: u32 = s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not an index"))?;
        if n > MAX_ARRAY_INDEX {
            return Err(format!("index {n} exceeds {MAX_ARRAY_INDEX}"));
        }
        Ok(n)
    };
    let mut set = std::collections::BTreeSet::new();
    for part in ranges.split(',') {
        let (range, step) = match part.split_once(':') {
            Some((r, s)) => (r, num(s)?),
            None => (part, 1),
        };
        if step == 0 {
            return Err(format!("{part:?}: the step must be at least 1"));
        }
        let (lo, hi) = match range.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => {
                let n = num(range)?;
                (n, n)
            }
        };
        if lo > hi {
            return Err(format!("{part:?}: the range is empty"));
        }
        let count = ((hi - lo) / step) as usize + 1;
        if set.len().saturating_add(count) > MAX_ARRAY_TASKS {
            return Err(format!("at most {MAX_ARRAY_TASKS} tasks"));
        }
        let mut i = lo;
        while i <= hi {
            set.insert(i);
            match i.checked_add(step) {
                Some(n) => i = n,
                None => break,
            }
        }
    }
    Ok(ArraySpec {
        indexes: set.into_iter().collect(),
        limit,
    })
}

/// Which task of which array a job is (set by the server when it expands an
/// array; the ranks get it as `GANGWAY_ARRAY_JOB_ID`/`GANGWAY_ARRAY_TASK_ID`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ArrayTask {
    /// The array's id: the id of its first task. Its tasks have the
    /// consecutive ids `job .. job + count`.
    pub job: JobId,
    /// This task's index (`SLURM_ARRAY_TASK_ID`).
    pub index: u32,
    /// Tasks in the array.
    pub count: u32,
    /// At most this many tasks in the scheduler at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn begin_times_parse_relative_absolute_and_iso() {
        assert_eq!(parse_begin("now", 100), Ok(100));
        assert_eq!(parse_begin("now+10m", 100), Ok(700));
        assert_eq!(parse_begin("+1h", 100), Ok(3700));
        assert_eq!(parse_begin("now-1m", 100), Ok(40));
        assert_eq!(parse_begin("-1d", 100), Ok(0));
        assert_eq!(parse_begin("1700000000", 0), Ok(1_700_000_000));
        assert_eq!(parse_begin("1970-01-02", 0), Ok(86_400));
        assert_eq!(parse_begin("2026-12-03T12:00:00Z", 0), Ok(1_796_299_200));
        assert_eq!(parse_begin("2024-02-29T00:00", 0), Ok(1_709_164_800));
        assert_eq!(format_utc(1_796_299_200), "2026-12-03T12:00:00Z");
        assert_eq!(format_utc(1_709_164_800), "2024-02-29T00:00:00Z");
        for bad in ["", "soon", "now+x", "2026-13-01", "2026-12-03T25:00", "+"] {
            assert!(parse_begin(bad, 0).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn dependencies_parse_slurms_syntax_and_name_the_bad_term() {
        assert_eq!(
            parse_dependency("afterok:3:4,singleton"),
            Ok(vec![
                Dependency::After(AfterKind::AfterOk, vec![JobId(3), JobId(4)]),
                Dependency::Singleton
            ])
        );
        assert_eq!(
            parse_dependency("afternotok:9"),
            Ok(vec![Dependency::After(
                AfterKind::AfterNotOk,
                vec![JobId(9)]
            )])
        );
        for bad in ["afterok", "after:3", "afterok:x", "", "afterok:3,"] {
            assert!(parse_dependency(bad).is_err(), "{bad:?} accepted");
        }
        let many = format!("afterok:{}", vec!["1"; 101].join(":"));
        assert!(parse_dependency(&many).is_err());
    }

    #[test]
    fn arrays_parse_ranges_lists_steps_and_limits_within_bounds() {
        let a = parse_array("0-15%4").expect("array");
        assert_eq!(a.indexes, (0..16).collect::<Vec<_>>());
        assert_eq!(a.limit, Some(4));
        let a = parse_array("1,3,5-9").expect("list");
        assert_eq!(a.indexes, vec![1, 3, 5, 6, 7, 8, 9]);
        assert_eq!(a.limit, None);
        assert_eq!(parse_array("0-8:4").expect("step").indexes, vec![0, 4, 8]);
        for bad in ["", "5-1", "0-3%0", "x", "0-10000", "0-2000000", "1:0"] {
            assert!(parse_array(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(parse_array("0-9999").expect("max").indexes.len(), 10_000);
    }
}
