//! Slurm's everyday workflow from the CLI: `submit --hold/--begin/
//! --dependency/--array`, `hold`, `release`, `update` and `history`.

use crate::client::{Conn, Output};
use anyhow::{bail, Context, Result};
use clap::Args;
use gangway_core::workflow::{format_utc, parse_begin};
use gangway_server::history::{HistoryEntry, HistoryPage};
use serde_json::{json, Map, Value};
use std::io::Write;

/// Workflow flags of `gangway submit`; each overrides the spec's field.
#[derive(Args, Clone, Debug, Default)]
pub struct SubmitFlags {
    /// Submit held: it waits until `gangway release ID`.
    #[arg(long)]
    pub hold: bool,
    /// Earliest start: `now+10m`, `+1h`, epoch seconds or `2026-12-03T12:00:00Z` (UTC).
    #[arg(long)]
    pub begin: Option<String>,
    /// Jobs to wait for: `afterok:ID[:ID..]`, `afterany:..`, `afternotok:..`, `singleton`, joined by `,`.
    #[arg(long, short = 'd')]
    pub dependency: Option<String>,
    /// A job array: `0-15%4` (at most 4 at once), `1,3,5-9`, `0-30:10`.
    #[arg(long, short = 'a')]
    pub array: Option<String>,
}

impl SubmitFlags {
    /// The spec fields these flags set.
    pub fn fields(&self) -> Map<String, Value> {
        let mut m = Map::new();
        if self.hold {
            m.insert("hold".into(), json!(true));
        }
        if let Some(b) = &self.begin {
            m.insert("begin".into(), json!(b));
        }
        if let Some(d) = &self.dependency {
            m.insert("dependency".into(), json!(d));
        }
        if let Some(a) = &self.array {
            m.insert("array".into(), json!(a));
        }
        m
    }
}

/// `gangway hold ID`.
pub fn hold(c: &Conn, t: crate::jobref::Target) -> Result<()> {
    let id = t.id;
    let v = c.post(
        &format!("/v1/jobs/{id}/hold{}", t.query()),
        "application/json",
        "",
    )?;
    c.print(&v, |v| {
        format!(
            "job {id} held ({})\n",
            v["reason_code"].as_str().unwrap_or("held")
        )
    })
}

/// `gangway release ID`.
pub fn release(c: &Conn, t: crate::jobref::Target) -> Result<()> {
    let id = t.id;
    let v = c.post(
        &format!("/v1/jobs/{id}/release{}", t.query()),
        "application/json",
        "",
    )?;
    c.print(&v, |_| format!("job {id} released\n"))
}

/// What `gangway update` changes.
#[derive(Args, Clone, Debug)]
pub struct UpdateArgs {
    /// Job id, or an array task's `ID_INDEX` (`5_7`).
    pub id: crate::jobref::JobRef,
    /// New priority class (within what the queue allows).
    #[arg(long)]
    pub priority: Option<String>,
    /// New time limit (`1:30:00`, `90m`); users may only lower it.
    #[arg(long)]
    pub time_limit: Option<String>,
    /// New queue (one you may submit to).
    #[arg(long)]
    pub queue: Option<String>,
    /// New name.
    #[arg(long)]
    pub name: Option<String>,
}

/// `gangway update ID [--priority P] [--time-limit T] [--queue Q] [--name N]`.
pub fn update(c: &Conn, a: &UpdateArgs) -> Result<()> {
    let mut body = Map::new();
    for (k, v) in [
        ("priority", &a.priority),
        ("time_limit", &a.time_limit),
        ("queue", &a.queue),
        ("name", &a.name),
    ] {
        if let Some(v) = v {
            body.insert(k.into(), json!(v));
        }
    }
    if body.is_empty() {
        bail!("nothing to update: give --priority, --time-limit, --queue or --name");
    }
    let id = c.job(a.id)?.id;
    let v = c.post(
        &format!("/v1/jobs/{id}/update"),
        "application/json",
        &Value::Object(body).to_string(),
    )?;
    c.print(&v, |v| {
        format!(
            "job {} updated: {}\n",
            a.id,
            v["updated"].as_str().unwrap_or("")
        )
    })
}

/// Filters of `gangway history`.
#[derive(Args, Clone, Debug, Default)]
pub struct HistoryArgs {
    /// Only this user's jobs (users see only their own).
    #[arg(long)]
    pub user: Option<String>,
    /// Only this queue.
    #[arg(long)]
    pub queue: Option<String>,
    /// Only these final states: succeeded, failed, cancelled, timeout (comma-separated).
    #[arg(long)]
    pub state: Option<String>,
    /// Only jobs that ended at or after this time: `now-1d`, `-2h`, epoch seconds or ISO 8601 UTC.
    #[arg(long)]
    pub since: Option<String>,
    /// Only jobs that ended before this time (same forms as --since).
    #[arg(long)]
    pub until: Option<String>,
    /// Also write every row to FILE as JSON lines (one HistoryEntry per line).
    #[arg(long)]
    pub export: Option<std::path::PathBuf>,
}

/// Percent-encodes a query value.
fn enc(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~,".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Every row the filters select, all pages.
pub fn fetch_history(c: &Conn, a: &HistoryArgs) -> Result<Vec<HistoryEntry>> {
    let now = gangway_server::clock::now();
    let mut q = Vec::new();
    for (k, v) in [("user", &a.user), ("queue", &a.queue), ("state", &a.state)] {
        if let Some(v) = v {
            q.push(format!("{k}={}", enc(v)));
        }
    }
    for (k, v) in [("since", &a.since), ("until", &a.until)] {
        if let Some(v) = v {
            let t = parse_begin(v, now).map_err(|e| anyhow::anyhow!("--{k}: {e}"))?;
            q.push(format!("{k}={t}"));
        }
    }
    let mut out = Vec::new();
    let mut cursor: Option<u64> = None;
    loop {
        let mut qs = q.clone();
        if let Some(cur) = cursor {
            qs.push(format!("cursor={cur}"));
        }
        let v = c.get(&format!("/v1/history?{}", qs.join("&")))?;
        let page: HistoryPage =
            serde_json::from_value(v).context("decoding the server's history page")?;
        out.extend(page.entries);
        match page.next_cursor {
            Some(n) if Some(n) != cursor => cursor = Some(n),
            _ => break,
        }
    }
    Ok(out)
}

fn when(t: Option<u64>) -> String {
    t.map_or_else(|| "-".into(), format_utc)
}

/// One CSV field, quoted when it must be (RFC 4180).
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The rows as CSV with a header line.
pub fn to_csv(rows: &[HistoryEntry]) -> String {
    let mut out = String::from(
        "id,name,user,queue,state,submitted,start,end,nodes,replicas,gpus_per_replica,exit_code,attempts,preemptions,run_seconds,gpu_hours\n",
    );
    for e in rows {
        let state = gangway_server::workflow::state_name(e.state);
        let fields = [
            e.id.to_string(),
            e.name.clone(),
            e.user.clone(),
            e.queue.clone(),
            state,
            format_utc(e.submitted_at),
            e.started_at.map(format_utc).unwrap_or_default(),
            e.ended_at.map(format_utc).unwrap_or_default(),
            e.nodes.join(" "),
            e.replicas.to_string(),
            e.gpus_per_replica.to_string(),
            e.exit_code.map(|c| c.to_string()).unwrap_or_default(),
            e.attempts.to_string(),
            e.preemptions.to_string(),
            e.run_seconds.to_string(),
            format!("{:.4}", e.gpu_hours),
        ];
        let line: Vec<String> = fields.iter().map(|f| csv_field(f)).collect();
        out += &line.join(",");
        out.push('\n');
    }
    out
}

/// The history table: columns as wide as their content (names, nodes and
/// queues vary a lot), numbers right-aligned.
fn table(rows: &[HistoryEntry]) -> String {
    use gangway_core::text::printable;
    let mut cells: Vec<Vec<String>> = vec![[
        "ID",
        "NAME",
        "USER",
        "QUEUE",
        "STATE",
        "START",
        "END",
        "NODES",
        "EXIT",
        "GPU-HOURS",
    ]
    .iter()
    .map(|h| h.to_string())
    .collect()];
    let mut total = 0.0;
    for e in rows {
        total += e.gpu_hours;
        let name: String = printable(&e.name).chars().take(18).collect();
        cells.push(vec![
            e.id.to_string(),
            name,
            printable(&e.user).into_owned(),
            printable(&e.queue).into_owned(),
            gangway_server::workflow::state_name(e.state),
            when(e.started_at),
            when(e.ended_at),
            if e.nodes.is_empty() {
                "-".to_string()
            } else {
                printable(&e.nodes.join(",")).into_owned()
            },
            e.exit_code.map_or("-".into(), |c| c.to_string()),
            format!("{:.2}", e.gpu_hours),
        ]);
    }
    let mut out = crate::human::align(&cells, &[0, 8, 9]);
    out += &format!("{} jobs, {total:.2} GPU-hours in all\n", rows.len());
    out
}

/// `gangway history [filters] [-o table|json|csv] [--export FILE]`.
pub fn history(c: &Conn, a: &HistoryArgs) -> Result<()> {
    let rows = fetch_history(c, a)?;
    if let Some(path) = &a.export {
        let mut f = std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        );
        for e in &rows {
            serde_json::to_writer(&mut f, e)?;
            f.write_all(b"\n")?;
        }
        f.flush()
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {} jobs to {}", rows.len(), path.display());
    }
    match c.output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
        Output::Csv => print!("{}", to_csv(&rows)),
        Output::Table | Output::Wide => print!("{}", table(&rows)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::with_fields;

    #[test]
    fn csv_quotes_what_needs_quoting_and_flags_become_fields() {
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(csv_field("plain"), "plain");
        let f = SubmitFlags {
            hold: true,
            array: Some("0-3%2".into()),
            ..Default::default()
        };
        let (ct, body) = with_fields(
            "application/yaml",
            "name: a\nqueue: q\n".into(),
            &f.fields(),
        )
        .expect("merged");
        assert_eq!(ct, "application/json");
        let v: Value = serde_json::from_str(&body).expect("json");
        assert_eq!(
            (v["hold"].clone(), v["array"].clone()),
            (json!(true), json!("0-3%2"))
        );
        assert_eq!(v["name"], "a");
        assert_eq!(enc("a b&c"), "a%20b%26c");
    }
}
