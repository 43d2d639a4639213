//! `gangway queue`: the jobs that have not ended (like `squeue`), or with
//! `--all` every job, streamed page by page from the paged `GET /v1/jobs`.

use crate::client::{Conn, Output};
use crate::human;
use anyhow::{bail, Result};
use clap::Args;
use serde_json::Value;
use std::io::Write;

/// What `gangway queue` lists.
#[derive(Args, Clone, Debug, Default)]
pub struct QueueArgs {
    /// Every job, ended ones too (streams every page).
    #[arg(long, conflicts_with = "state")]
    pub all: bool,
    /// Only these states, comma-separated (e.g. `pending,running`).
    #[arg(long, short = 't')]
    pub state: Option<String>,
    /// Only this user's jobs.
    #[arg(long, short = 'u', conflicts_with = "me")]
    pub user: Option<String>,
    /// Only my jobs (the token's user).
    #[arg(long)]
    pub me: bool,
    /// Only this queue.
    #[arg(long, short = 'q')]
    pub queue: Option<String>,
    /// Pending jobs only, with their planned start (`squeue --start`);
    /// `--state` overrides which states.
    #[arg(long, conflicts_with = "all")]
    pub start: bool,
    /// Jobs per request (the server allows 1 to 5,000).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=5000))]
    pub page_size: u64,
}

/// Percent-encodes a query value (names may hold anything).
fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b',' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl QueueArgs {
    /// The query string of the first page.
    fn query(&self, me: Option<&str>) -> String {
        let mut q = vec![format!("limit={}", self.page_size)];
        match (&self.state, self.all) {
            (Some(s), _) => q.push(format!("state={}", enc(s))),
            (None, false) if self.start => q.push("state=pending".into()),
            (None, false) => q.push("active=true".into()),
            (None, true) => {}
        }
        if let Some(u) = self.user.as_deref().or(me) {
            q.push(format!("user={}", enc(u)));
        }
        if let Some(x) = &self.queue {
            q.push(format!("queue={}", enc(x)));
        }
        q.join("&")
    }
}

fn gpus(job: &Value) -> u64 {
    let r = job
        .pointer("/spec/replicas")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let g = job
        .pointer("/spec/resources/gpus")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    r.saturating_mul(g)
}

fn text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => "-".into(),
        Some(x) => x.to_string(),
    }
}

/// Cuts `s` to `n` characters (tables stay aligned).
fn cut(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

/// Why a job waits, as a sentence (the code has its own column).
fn reason(j: &Value) -> String {
    j.get("reason")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

/// The reason code (Slurm's names), `-` when there is none.
fn code(j: &Value) -> String {
    text(j.get("reason_code"))
}

/// The job's id, or an array task's `ARRAYID_INDEX` (as Slurm prints it).
fn id_label(j: &Value) -> String {
    let label = crate::jobref::array_label(j);
    if label.is_empty() {
        text(j.get("id"))
    } else {
        label
    }
}

/// The table's header.
pub fn header(wide: bool) -> String {
    if wide {
        format!(
            "{:<7} {:<20} {:<12} {:<10} {:<10} {:>5}  {:<20} {:<20} {:<24} {:<17} {}\n",
            "ID",
            "NAME",
            "QUEUE",
            "USER",
            "STATE",
            "GPUS",
            "SUBMITTED",
            "START",
            "NODES",
            "CODE",
            "REASON"
        )
    } else {
        format!(
            "{:<7} {:<20} {:<12} {:<10} {:<10} {:>5}  {:<9} {:<9} {:<17} {}\n",
            "ID", "NAME", "QUEUE", "USER", "STATE", "GPUS", "AGE", "START", "CODE", "REASON"
        )
    }
}

/// An array's pending tasks in one row, as `squeue` shows them:
/// `5_[3-99%4]` (`%4`: at most 4 run at once). One task keeps its own id.
pub fn collapsed_label(array: u64, indexes: &[u64], limit: Option<u64>) -> String {
    match (indexes, limit) {
        ([one], _) => format!("{array}_{one}"),
        (_, Some(l)) => format!("{array}_[{}%{l}]", human::ranges(indexes)),
        (_, None) => format!("{array}_[{}]", human::ranges(indexes)),
    }
}

/// Pending tasks of one array waiting to be printed as one row: the first
/// task's record (its other columns) and every index seen.
struct Group {
    first: Value,
    array: u64,
    indexes: Vec<u64>,
    limit: Option<u64>,
}

impl Group {
    /// A group for `j` when it is a pending array task.
    fn of(j: &Value) -> Option<Group> {
        if human::shown_state(j) != "pending" {
            return None;
        }
        let a = j.get("array").filter(|a| !a.is_null())?;
        Some(Group {
            first: j.clone(),
            array: a.get("job")?.as_u64()?,
            indexes: vec![a.get("index")?.as_u64()?],
            limit: a.get("limit").and_then(Value::as_u64),
        })
    }

    fn row(&self, wide: bool, now: u64) -> String {
        let label = collapsed_label(self.array, &self.indexes, self.limit);
        row_as(&self.first, &label, wide, now)
    }
}

/// Rows in listing order, with each run of pending tasks of one array in
/// one row; running and ended tasks keep a row each.
#[derive(Default)]
pub struct Collapser {
    open: Option<Group>,
}

impl Collapser {
    /// The rows `j` completes (none while a group may still grow).
    pub fn push(&mut self, j: &Value, wide: bool, now: u64) -> String {
        let next = Group::of(j);
        if let (Some(g), Some(n)) = (self.open.as_mut(), next.as_ref()) {
            if g.array == n.array {
                g.indexes.extend_from_slice(&n.indexes);
                return String::new();
            }
        }
        let mut out = self.finish(wide, now);
        match next {
            Some(g) => self.open = Some(g),
            None => out += &row(j, wide, now),
        }
        out
    }

    /// The last group's row.
    pub fn finish(&mut self, wide: bool, now: u64) -> String {
        self.open
            .take()
            .map(|g| g.row(wide, now))
            .unwrap_or_default()
    }
}

/// One job's row: relative times in the table, ISO-8601 in the wide one.
pub fn row(j: &Value, wide: bool, now: u64) -> String {
    row_as(j, &id_label(j), wide, now)
}

/// [`row`] with `label` in the ID column.
fn row_as(j: &Value, label: &str, wide: bool, now: u64) -> String {
    let start = j.get("estimated_start").and_then(Value::as_u64);
    let common = format!(
        "{:<7} {:<20} {:<12} {:<10} {:<10} {:>5}  ",
        label,
        cut(&text(j.pointer("/spec/name")), 20),
        cut(&text(j.pointer("/spec/queue")), 12),
        cut(&text(j.get("user")), 10),
        crate::human::shown_state(j),
        gpus(j)
    );
    if wide {
        let submitted = j
            .get("submitted_at")
            .and_then(Value::as_u64)
            .map_or_else(|| "-".into(), human::iso);
        let nodes: Vec<String> = j
            .get("placement")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|p| p.get("node").and_then(Value::as_str).map(String::from))
            .fold(Vec::new(), |mut v, n| {
                if !v.contains(&n) {
                    v.push(n);
                }
                v
            });
        let nodes = if nodes.is_empty() {
            "-".to_string()
        } else {
            nodes.join(",")
        };
        format!(
            "{common}{:<20} {:<20} {:<24} {:<17} {}\n",
            submitted,
            start.map_or_else(|| "-".into(), human::iso),
            nodes,
            code(j),
            reason(j)
        )
    } else {
        let age = j.get("submitted_at").and_then(Value::as_u64).map_or_else(
            || "-".into(),
            |t| human::relative(t, now).replace(" ago", ""),
        );
        format!(
            "{common}{:<9} {:<9} {:<17} {}\n",
            age,
            start.map_or_else(|| "-".into(), |t| human::relative(t, now)),
            code(j),
            reason(j)
        )
    }
}

/// `gangway queue [--all] [--state a,b] [--user U | --me] [--queue Q]`:
/// prints each page as it arrives (a JSON array with `-o json`).
pub fn run(c: &Conn, a: &QueueArgs) -> Result<()> {
    let me = if a.me {
        let v = c.get("/v1/whoami")?;
        match v.get("name").and_then(Value::as_str) {
            Some(n) => Some(n.to_string()),
            None => bail!("the server did not say who this token belongs to"),
        }
    } else {
        None
    };
    let base = a.query(me.as_deref());
    let mut out = std::io::stdout().lock();
    let json = c.output == Output::Json;
    let wide = c.output == Output::Wide;
    let now = human::now();
    let mut cursor: Option<String> = None;
    let mut first = true;
    let mut rows = Collapser::default();
    loop {
        let path = match &cursor {
            Some(k) => format!("/v1/jobs?{base}&cursor={}", enc(k)),
            None => format!("/v1/jobs?{base}"),
        };
        let (page, next) = c.get_page(&path)?;
        // The header only once the server has answered: an error is then
        // the only output.
        if cursor.is_none() {
            if json {
                write!(out, "[")?;
            } else {
                write!(out, "{}", header(wide))?;
            }
        }
        for j in page.as_array().into_iter().flatten() {
            if json {
                let sep = if first { "\n" } else { ",\n" };
                write!(out, "{sep}{}", serde_json::to_string_pretty(j)?)?;
            } else {
                let text = rows.push(&crate::client::printable_value(j), wide, now);
                write!(out, "{text}")?;
            }
            first = false;
        }
        out.flush()?;
        match next {
            Some(n) => cursor = Some(n),
            None => break,
        }
    }
    if json {
        writeln!(out, "{}]", if first { "" } else { "\n" })?;
    } else {
        write!(out, "{}", rows.finish(wide, now))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_default_lists_active_jobs_and_flags_narrow_it() {
        let a = QueueArgs {
            page_size: 500,
            ..Default::default()
        };
        assert_eq!(a.query(None), "limit=500&active=true");
        let a = QueueArgs {
            all: true,
            queue: Some("re search".into()),
            page_size: 10,
            ..Default::default()
        };
        assert_eq!(
            a.query(Some("alice")),
            "limit=10&user=alice&queue=re%20search"
        );
        let a = QueueArgs {
            state: Some("pending,running".into()),
            page_size: 500,
            ..Default::default()
        };
        assert_eq!(a.query(None), "limit=500&state=pending,running");
    }

    #[test]
    fn pending_tasks_of_an_array_collapse_into_one_row_with_ranges() {
        assert_eq!(human::ranges(&[0, 1, 2, 7, 9, 10, 11]), "0-2,7,9-11");
        assert_eq!(human::ranges(&[4]), "4");
        assert_eq!(human::ranges(&[]), "");
        assert_eq!(collapsed_label(5, &[3], Some(4)), "5_3");
        assert_eq!(
            collapsed_label(5, &[0, 1, 2, 7, 9, 10, 11], None),
            "5_[0-2,7,9-11]"
        );
        let task = |id: u64, index: u64, state: &str| {
            json!({
                "id": id, "user": "alice", "state": state,
                "array": { "job": 5, "index": index, "count": 100, "limit": 4 },
                "spec": { "name": "sweep", "queue": "q", "replicas": 1, "resources": { "gpus": 1 } }
            })
        };
        let mut c = Collapser::default();
        let mut out = String::new();
        // Tasks 0..=2 run, 3..=99 wait: three rows and one for the rest.
        for i in 0..100u64 {
            let state = if i < 3 { "running" } else { "pending" };
            out += &c.push(&task(5 + i, i, state), false, 0);
        }
        out += &c.push(
            &json!({"id": 200, "state": "pending", "spec": {}}),
            false,
            0,
        );
        out += &c.finish(false, 0);
        let ids: Vec<&str> = out
            .lines()
            .map(|l| l.split_whitespace().next().unwrap_or(""))
            .collect();
        assert_eq!(ids, ["5_0", "5_1", "5_2", "5_[3-99%4]", "200"], "{out}");
        // Gaps (a task that ended or was cancelled) stay in the ranges.
        let mut c = Collapser::default();
        let mut out = String::new();
        for i in [0u64, 1, 2, 7, 9, 10, 11] {
            let mut t = task(5 + i, i, "pending");
            t["array"]["limit"] = Value::Null;
            out += &c.push(&t, false, 0);
        }
        out += &c.finish(false, 0);
        assert!(out.starts_with("5_[0-2,7,9-11] "), "{out}");
        assert_eq!(out.lines().count(), 1, "{out}");
    }

    #[test]
    fn rows_show_relative_times_never_epoch_seconds() {
        let j = json!({
            "id": 7, "user": "alice", "state": "pending", "submitted_at": 1_000_000,
            "estimated_start": 1_007_200, "reason": "waits for GPUs", "reason_code": "Resources",
            "spec": { "name": "train", "queue": "research", "replicas": 2, "resources": { "gpus": 8 } }
        });
        let r = row(&j, false, 1_000_180);
        assert!(
            r.contains(" 3m ") && r.contains("in 1h57m") && r.contains("Resources"),
            "{r}"
        );
        assert!(!r.contains("1000000") && !r.contains("1007200"), "{r}");
        let w = row(&j, true, 1_000_180);
        assert!(
            w.contains("1970-01-12T13:46:40Z")
                && w.contains("Resources")
                && w.contains("waits for GPUs"),
            "{w}"
        );
    }
}
