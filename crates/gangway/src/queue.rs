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
    let label = crate::workflow::array_label(j);
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

/// One job's row: relative times in the table, ISO-8601 in the wide one.
pub fn row(j: &Value, wide: bool, now: u64) -> String {
    let start = j.get("estimated_start").and_then(Value::as_u64);
    let common = format!(
        "{:<7} {:<20} {:<12} {:<10} {:<10} {:>5}  ",
        id_label(j),
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
    if json {
        write!(out, "[")?;
    } else {
        write!(out, "{}", header(wide))?;
    }
    loop {
        let path = match &cursor {
            Some(k) => format!("/v1/jobs?{base}&cursor={}", enc(k)),
            None => format!("/v1/jobs?{base}"),
        };
        let (page, next) = c.get_page(&path)?;
        for j in page.as_array().into_iter().flatten() {
            if json {
                let sep = if first { "\n" } else { ",\n" };
                write!(out, "{sep}{}", serde_json::to_string_pretty(j)?)?;
            } else {
                write!(
                    out,
                    "{}",
                    row(&crate::client::printable_value(j), wide, now)
                )?;
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
