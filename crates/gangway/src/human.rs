//! Output for people: relative times ("3m ago", "in 2h"), ISO-8601 times
//! and rank groups ("node-a: ranks 0-7 GPUs 0-7"). Human output never
//! shows raw epoch seconds; `-o json` keeps the numbers.

use serde_json::Value;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A job's state as people should read it: a gang being stopped says so
/// and why (`cancelling`, `stopping (time limit)`, `stopping (rank
/// failed)`), although its record stays live until no process is left.
pub fn shown_state(j: &Value) -> String {
    let state = j.get("state").and_then(Value::as_str).unwrap_or("-");
    let live = matches!(state, "scheduled" | "running" | "preempting");
    let cause = j.pointer("/stopping/cause").and_then(Value::as_str);
    match (live, cause) {
        (true, Some("cancelled")) => "cancelling".into(),
        (true, Some("failed")) => "stopping (rank failed)".into(),
        _ if state == "preempting" && j.get("time_limit_hit").is_some_and(|t| !t.is_null()) => {
            "stopping (time limit)".into()
        }
        _ => state.to_string(),
    }
}

/// Seconds since the epoch, now.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A span in its largest unit, rounded down: `42s`, `3m`, `2h`, `5d`.
fn span(secs: u64) -> String {
    gangway_core::format_span(secs, gangway_core::SpanForm::Relative)
}

/// `t` relative to `now`: `just now`, `3m ago`, `in 2h`.
pub fn relative(t: u64, now: u64) -> String {
    if t.abs_diff(now) < 2 {
        "just now".into()
    } else if t < now {
        format!("{} ago", span(now - t))
    } else {
        format!("in {}", span(t - now))
    }
}

/// The last second ISO-8601 with a four-digit year can write.
const LAST_ISO: u64 = 253_402_300_799;

/// `t` as ISO-8601 in UTC, to the second: `2026-12-03T10:12:57Z`. A time
/// past the year 9999 (a server's value is not checked here) is shown as
/// its epoch seconds instead of failing.
pub fn iso(t: u64) -> String {
    if t > LAST_ISO {
        return format!("@{t}");
    }
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(t)).to_string()
}

/// `t` in UTC to the minute, for tables: `2026-12-03 10:12Z`.
pub fn iso_minute(t: u64) -> String {
    let s = iso(t);
    match (s.get(..10), s.get(11..16)) {
        (Some(day), Some(hm)) if t <= LAST_ISO => format!("{day} {hm}Z"),
        _ => s,
    }
}

/// Both: `2026-12-03T10:12:57Z (3m ago)`.
pub fn both(t: u64, now: u64) -> String {
    format!("{} ({})", iso(t), relative(t, now))
}

/// A time given on the command line: epoch seconds (`1796292777`),
/// ISO-8601 / RFC 3339 (`2026-12-03T10:00:00Z`, `2026-12-03 10:00:00`, UTC),
/// or a span before now (`90m`, `2h`, `1d 6h`, as "ago").
pub fn parse_when(s: &str) -> Result<u64, String> {
    parse_when_at(s, now())
}

fn parse_when_at(s: &str, now: u64) -> Result<u64, String> {
    let s = s.trim();
    if let Ok(n) = s.parse::<u64>() {
        return Ok(n);
    }
    if let Ok(t) = humantime::parse_rfc3339_weak(s) {
        return t
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .map_err(|_| format!("{s:?} is before 1970"));
    }
    let span = s.strip_suffix(" ago").unwrap_or(s);
    match humantime::parse_duration(span) {
        Ok(d) => Ok(now.saturating_sub(d.as_secs())),
        Err(_) => Err(format!(
            "{s:?}: expected an ISO-8601 time (2026-12-03T10:00:00Z), a span before now (2h, 30m) or epoch seconds"
        )),
    }
}

/// Sorted numbers as ranges: `[0,1,2,3,6]` → `0-3,6`.
pub fn ranges(xs: &[u64]) -> String {
    let mut v = xs.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let start = v[i];
        let mut end = start;
        while i + 1 < v.len() && end.checked_add(1) == Some(v[i + 1]) {
            i += 1;
            end = v[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    out.join(",")
}

/// Rows as a table whose columns are as wide as their widest cell (in
/// characters), one space apart; the columns in `right` are right-aligned
/// (numbers). The first row is the header.
pub fn align(rows: &[Vec<String>], right: &[usize]) -> String {
    let n = rows.iter().map(Vec::len).max().unwrap_or(0);
    let width: Vec<usize> = (0..n)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|x| x.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            if c > 0 {
                line.push(' ');
            }
            let pad = width[c].saturating_sub(cell.chars().count());
            if right.contains(&c) {
                line.extend(std::iter::repeat_n(' ', pad));
                line += cell;
            } else {
                line += cell;
                if c + 1 < r.len() {
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
        }
        out += line.trim_end();
        out.push('\n');
    }
    out
}

/// A job's placement grouped by node, in first-rank order: one line per
/// node, `node-a: ranks 0-7 GPUs 0-7` (rank `r` is the `r`th replica).
pub fn rank_groups(placement: &[Value]) -> Vec<String> {
    let mut order: Vec<String> = Vec::new();
    let mut by: std::collections::HashMap<String, (Vec<u64>, Vec<u64>)> =
        std::collections::HashMap::new();
    for (rank, p) in placement.iter().enumerate() {
        let node = p
            .get("node")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string();
        let e = by.entry(node.clone()).or_insert_with(|| {
            order.push(node.clone());
            (Vec::new(), Vec::new())
        });
        e.0.push(rank as u64);
        e.1.extend(
            p.get("gpus")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_u64),
        );
    }
    order
        .into_iter()
        .map(|n| {
            let (ranks, gpus) = &by[&n];
            let r = if ranks.len() == 1 { "rank" } else { "ranks" };
            let g = if gpus.is_empty() {
                "no GPUs".to_string()
            } else {
                format!("GPUs {}", ranges(gpus))
            };
            format!("{n}: {r} {} {g}", ranges(ranks))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn aligned_columns_are_as_wide_as_their_widest_cell() {
        let rows: Vec<Vec<String>> = [
            ["ID", "USER", "QUEUE", "GPU-HOURS"],
            ["7", "a-very-long-user", "q", "1.50"],
            ["1234567", "bob", "research-queue", "123.25"],
        ]
        .iter()
        .map(|r| r.iter().map(|c| c.to_string()).collect())
        .collect();
        let t = super::align(&rows, &[0, 3]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "     ID USER             QUEUE          GPU-HOURS"
        );
        assert_eq!(
            lines[1],
            "      7 a-very-long-user q                   1.50"
        );
        assert_eq!(
            lines[2],
            "1234567 bob              research-queue    123.25"
        );
    }

    use super::*;
    use serde_json::json;

    #[test]
    fn relative_times_read_like_people_speak() {
        assert_eq!(relative(1000, 1000), "just now");
        assert_eq!(relative(1000, 1042), "42s ago");
        assert_eq!(relative(1000, 1000 + 180), "3m ago");
        assert_eq!(relative(1000 + 7200, 1000), "in 2h");
        assert_eq!(relative(1000, 1000 + 5400), "1h30m ago");
        assert_eq!(relative(1000, 1000 + 3 * 86_400 + 5), "3d ago");
    }

    #[test]
    fn iso_times_are_utc_seconds() {
        assert_eq!(iso(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso(1_796_292_777), "2026-12-03T10:12:57Z");
        assert_eq!(iso(LAST_ISO), "9999-12-31T23:59:59Z");
        assert_eq!(iso(LAST_ISO + 1), "@253402300800");
        assert_eq!(iso(u64::MAX), format!("@{}", u64::MAX));
        assert_eq!(iso_minute(0), "1970-01-01 00:00Z");
        assert_eq!(iso_minute(1_796_292_777), "2026-12-03 10:12Z");
        assert_eq!(iso_minute(951_868_800 - 60), "2000-02-29 23:59Z");
        assert_eq!(iso_minute(LAST_ISO), "9999-12-31 23:59Z");
        assert_eq!(iso_minute(u64::MAX), format!("@{}", u64::MAX));
    }

    #[test]
    fn command_line_times_accept_iso_spans_and_epochs() {
        assert_eq!(parse_when_at("2026-12-03T10:12:57Z", 0), Ok(1_796_292_777));
        assert_eq!(parse_when_at("2026-12-03 10:12:57", 0), Ok(1_796_292_777));
        assert_eq!(parse_when_at("2h", 10_000), Ok(10_000 - 7_200));
        assert_eq!(parse_when_at("30m ago", 10_000), Ok(10_000 - 1_800));
        assert_eq!(parse_when_at("1796292777", 0), Ok(1_796_292_777));
        assert!(parse_when_at("yesterday-ish", 0).is_err());
    }

    #[test]
    fn ranks_group_by_node_with_ranges() {
        let p: Vec<Value> = (0..16)
            .map(|r| json!({ "node": if r < 8 { "node-a" } else { "node-b" }, "gpus": [r % 8] }))
            .collect();
        assert_eq!(
            rank_groups(&p),
            vec!["node-a: ranks 0-7 GPUs 0-7", "node-b: ranks 8-15 GPUs 0-7"]
        );
        let p = vec![json!({ "node": "n", "gpus": [4, 5, 6, 7] })];
        assert_eq!(rank_groups(&p), vec!["n: rank 0 GPUs 4-7"]);
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }

    #[test]
    fn a_gang_being_stopped_says_why() {
        use serde_json::json;
        let shown = |j: Value| shown_state(&j);
        assert_eq!(shown(json!({"state": "running"})), "running");
        assert_eq!(
            shown(json!({"state": "running", "stopping": {"cause": "cancelled", "by": "a"}})),
            "cancelling"
        );
        assert_eq!(
            shown(json!({"state": "preempting", "time_limit_hit": 100})),
            "stopping (time limit)"
        );
        assert_eq!(shown(json!({"state": "preempting"})), "preempting");
        assert_eq!(
            shown(json!({"state": "running", "stopping": {"cause": "failed", "message": "x"}})),
            "stopping (rank failed)"
        );
        assert_eq!(
            shown(json!({"state": "cancelled", "stopping": {"cause": "cancelled", "by": "a"}})),
            "cancelled"
        );
    }
}
