//! `gangway policy ...`: the versioned scheduling policy (show, diff, apply,
//! rollback, log) and the what-if, on the server or offline from an
//! exported history.

use crate::client::{Conn, Output};
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use gangway_server::history::HistoryEntry;
use gangway_server::policy::whatif;
use gangway_server::policy::Policy;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// `gangway policy` subcommands.
#[derive(Subcommand)]
pub enum PolicyCmd {
    /// Shows a policy version (default: the one in force) as a file `apply` accepts.
    Show {
        /// Version number.
        version: Option<u64>,
    },
    /// What changed from version A to version B.
    Diff {
        /// From.
        a: u64,
        /// To.
        b: u64,
    },
    /// Replays this cluster's history under the policy in force and under FILE.
    WhatIf {
        /// Candidate policy file (YAML: queues, scheduler, gates).
        file: PathBuf,
        /// History window (`14d`, `36h`, seconds).
        #[arg(long, default_value = "14d")]
        since: String,
        /// Offline: an exported history (`gangway history --export`, JSON lines).
        #[arg(long, requires_all = ["current", "cluster"])]
        history: Option<PathBuf>,
        /// Offline: the policy in force (a policy file or the server's configuration).
        #[arg(long, requires = "history")]
        current: Option<PathBuf>,
        /// Offline: the cluster's nodes (a simulator cluster file, as `gangway sim --cluster`).
        #[arg(long, requires = "history")]
        cluster: Option<PathBuf>,
    },
    /// Applies FILE as the next version, if the gates of the version in force pass.
    Apply {
        /// Policy file.
        file: PathBuf,
        /// Why (kept in the decision log).
        #[arg(long)]
        reason: String,
        /// Apply even though a gate fails.
        #[arg(long)]
        force: bool,
        /// The what-if's history window.
        #[arg(long, default_value = "14d")]
        since: String,
        /// Pilot: apply the candidate's changes to these queues only
        /// (allowed_priorities, allow_non_preemptible, time_limit); end it
        /// with `promote` or `rollback`.
        #[arg(long, value_delimiter = ',')]
        pilot: Option<Vec<String>>,
    },
    /// Ends a pilot by applying its whole candidate (gates judged again).
    Promote {
        /// Why (kept in the decision log).
        #[arg(long)]
        reason: String,
        /// Promote even though a gate fails.
        #[arg(long)]
        force: bool,
        /// The what-if's history window.
        #[arg(long, default_value = "14d")]
        since: String,
    },
    /// Puts an earlier version back in force (default: the one before the current).
    Rollback {
        /// Version to restore.
        version: Option<u64>,
        /// Why (kept in the decision log).
        #[arg(long)]
        reason: String,
    },
    /// The decision log: every version with who, when, why, the diff, the
    /// evidence, the gates and the live figures of the day after.
    Log,
}

fn since_seconds(s: &str) -> Result<u64> {
    gangway_core::job::parse_time_span(s)
        .map_err(|e| anyhow::anyhow!("--since: {e}"))
        .and_then(|v| {
            if v == 0 {
                bail!("--since: must be more than 0 seconds")
            }
            Ok(v)
        })
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn action(v: &Value) -> String {
    match v.pointer("/action/kind").and_then(Value::as_str) {
        Some("rollback") => format!(
            "rollback to {}",
            v.pointer("/action/to").map_or("-".into(), Value::to_string)
        ),
        Some("pilot") => format!(
            "pilot on {}",
            v.pointer("/action/queues")
                .and_then(Value::as_array)
                .map(|q| q
                    .iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(","))
                .unwrap_or_default()
        ),
        Some("promote") => format!(
            "promote pilot {}",
            v.pointer("/action/pilot")
                .map_or("-".into(), Value::to_string)
        ),
        Some(k) => k.to_string(),
        None => "-".into(),
    }
}

fn print_version(v: &Value, out: &mut String) {
    use std::fmt::Write;
    let _ = writeln!(
        out,
        "version {} ({}) by {} at {}{}",
        v["version"],
        action(v),
        v["author"].as_str().unwrap_or("-"),
        crate::human::iso_minute(v["at"].as_u64().unwrap_or(0)),
        if v["forced"].as_bool() == Some(true) {
            " FORCED past failing gates"
        } else {
            ""
        }
    );
    let _ = writeln!(out, "  reason: {}", v["reason"].as_str().unwrap_or("-"));
    for d in v["diff"].as_array().into_iter().flatten() {
        let _ = writeln!(out, "  change: {}", d.as_str().unwrap_or("-"));
    }
    let judged = matches!(
        v.pointer("/action/kind").and_then(Value::as_str),
        Some("apply" | "pilot" | "promote")
    );
    if judged && v["evidence"].is_null() {
        let _ = writeln!(
            out,
            "  evidence: none (no nodes or no finished jobs to replay; gates not evaluated)"
        );
    }
    if let Some(w) = v.get("evidence").filter(|w| !w.is_null()) {
        if let Ok(w) = serde_json::from_value::<whatif::WhatIf>(w.clone()) {
            for line in whatif::table(&w).lines() {
                let _ = writeln!(out, "  {line}");
            }
        }
    }
    if let Ok(g) =
        serde_json::from_value::<Vec<gangway_server::policy::GateResult>>(v["gates"].clone())
    {
        for line in whatif::gate_lines(&g).lines() {
            let _ = writeln!(out, "  gate {line}");
        }
    }
    if let Some(a) = v.get("after").filter(|a| !a.is_null()) {
        let done = a["complete"].as_bool() == Some(true);
        let _ = writeln!(
            out,
            "  after ({}): {} jobs started, avg wait {}, p95 wait {}",
            if done { "the day after" } else { "so far" },
            a.pointer("/overall/jobs").unwrap_or(&Value::Null),
            whatif::human(
                a.pointer("/overall/avg_wait")
                    .and_then(Value::as_f64)
                    .unwrap_or(0.0)
            ),
            whatif::human(
                a.pointer("/overall/p95_wait")
                    .and_then(Value::as_f64)
                    .unwrap_or(0.0)
            ),
        );
        for (q, f) in a["queues"].as_object().into_iter().flatten() {
            let _ = writeln!(
                out,
                "    queue {q}: {} jobs, avg wait {}, p95 wait {}",
                f["jobs"],
                whatif::human(f["avg_wait"].as_f64().unwrap_or(0.0)),
                whatif::human(f["p95_wait"].as_f64().unwrap_or(0.0)),
            );
        }
    }
}

/// A pilot's live figures against its prediction and the other queues.
fn pilot_text(p: &Value) -> String {
    let f = |x: &Value| {
        format!(
            "{} jobs started, avg wait {}, p95 wait {}",
            x["jobs"],
            whatif::human(x["avg_wait"].as_f64().unwrap_or(0.0)),
            whatif::human(x["p95_wait"].as_f64().unwrap_or(0.0))
        )
    };
    let mut out = format!(
        "# pilot since {}\n# pilot queues (live): {}\n# other queues (live): {}\n",
        crate::human::iso_minute(p["since"].as_u64().unwrap_or(0)),
        f(&p["pilot"]),
        f(&p["others"])
    );
    for (q, x) in p["predicted"].as_object().into_iter().flatten() {
        out.push_str(&format!(
            "# queue {q}: predicted avg wait {}, p95 wait {}; live: {}\n",
            whatif::human(x["avg_wait"].as_f64().unwrap_or(0.0)),
            whatif::human(x["p95_wait"].as_f64().unwrap_or(0.0)),
            p["live"].get(q).map_or("no job started yet".into(), f)
        ));
    }
    out
}

fn emit(c: &Conn, v: &Value, text: String) -> Result<()> {
    match c.output {
        Output::Json => println!("{}", serde_json::to_string_pretty(v)?),
        // Built from the answer: each line escaped as a whole.
        Output::Table | Output::Wide => {
            for line in text.lines() {
                println!("{}", gangway_core::text::printable(line));
            }
        }
        Output::Csv => bail!("-o csv is available for `gangway history` only"),
    }
    Ok(())
}

/// Runs a `gangway policy` subcommand.
pub fn run(c: &Conn, cmd: PolicyCmd) -> Result<()> {
    match cmd {
        PolicyCmd::Show { version } => {
            let v = match version {
                Some(n) => c.get(&format!("/v1/policy/versions/{n}"))?,
                None => c.get("/v1/policy")?,
            };
            let mut text = format!(
                "# policy version {} ({}) by {} at {}: {}\n{}\n",
                v["version"],
                action(&v),
                v["author"].as_str().unwrap_or("-"),
                crate::human::iso_minute(v["at"].as_u64().unwrap_or(0)),
                v["reason"].as_str().unwrap_or("-"),
                serde_json::to_string_pretty(&v["policy"])?
            );
            if version.is_none() && v.pointer("/action/kind") == Some(&json!("pilot")) {
                let p = c.get("/v1/policy/pilot")?;
                text.push_str(&pilot_text(&p));
            }
            emit(c, &v, text)
        }
        PolicyCmd::Diff { a, b } => {
            let v = c.get(&format!("/v1/policy/diff?a={a}&b={b}"))?;
            let mut text = String::new();
            for l in v.as_array().into_iter().flatten() {
                text.push_str(l.as_str().unwrap_or("-"));
                text.push('\n');
            }
            if text.is_empty() {
                text = format!("versions {a} and {b} are the same policy\n");
            }
            emit(c, &v, text)
        }
        PolicyCmd::WhatIf {
            file,
            since,
            history: Some(history),
            current,
            cluster,
        } => offline(c, &file, &since, &history, current, cluster),
        PolicyCmd::WhatIf { file, since, .. } => {
            let body = json!({ "policy": read(&file)?, "since_seconds": since_seconds(&since)? });
            let v = c.post("/v1/policy/what-if", "application/json", &body.to_string())?;
            let mut text = String::new();
            for d in v["diff"].as_array().into_iter().flatten() {
                text.push_str(&format!("change: {}\n", d.as_str().unwrap_or("-")));
            }
            text.push_str(v["table"].as_str().unwrap_or(""));
            emit(c, &v, text)
        }
        PolicyCmd::Apply {
            file,
            reason,
            force,
            since,
            pilot,
        } => {
            let body = json!({
                "policy": read(&file)?,
                "reason": reason,
                "force": force,
                "since_seconds": since_seconds(&since)?,
                "pilot": pilot,
            });
            let v = c.post("/v1/policy/apply", "application/json", &body.to_string())?;
            let mut text = format!("applied: policy version {} in force\n", v["version"]);
            print_version(&v, &mut text);
            emit(c, &v, text)
        }
        PolicyCmd::Promote {
            reason,
            force,
            since,
        } => {
            let body = json!({
                "reason": reason,
                "force": force,
                "since_seconds": since_seconds(&since)?,
            });
            let v = c.post("/v1/policy/promote", "application/json", &body.to_string())?;
            let mut text = format!("promoted: policy version {} in force\n", v["version"]);
            print_version(&v, &mut text);
            emit(c, &v, text)
        }
        PolicyCmd::Rollback { version, reason } => {
            let body = json!({ "version": version, "reason": reason });
            let v = c.post("/v1/policy/rollback", "application/json", &body.to_string())?;
            let mut text = format!(
                "rolled back: policy version {} ({}) in force\n",
                v["version"],
                action(&v)
            );
            print_version(&v, &mut text);
            emit(c, &v, text)
        }
        PolicyCmd::Log => {
            let v = c.get("/v1/policy/log")?;
            let mut text = String::new();
            for x in v.as_array().into_iter().flatten() {
                print_version(x, &mut text);
                text.push('\n');
            }
            emit(c, &v, text)
        }
    }
}

/// The what-if on a laptop: an exported history, the policy in force and the
/// cluster's nodes from files; no server.
fn offline(
    c: &Conn,
    file: &Path,
    since: &str,
    history: &Path,
    current: Option<PathBuf>,
    cluster: Option<PathBuf>,
) -> Result<()> {
    let (Some(current), Some(cluster)) = (current, cluster) else {
        bail!("--history needs --current FILE and --cluster FILE");
    };
    let candidate = Policy::from_yaml(&read(file)?)?;
    let cur_text = read(&current)?;
    let current = match Policy::from_yaml(&cur_text) {
        Ok(p) => p,
        Err(policy_err) => match gangway_server::ServerConfig::from_yaml(&cur_text) {
            Ok(cfg) => Policy::from_config(&cfg),
            Err(_) => {
                bail!("--current: neither a policy file nor a server configuration: {policy_err}")
            }
        },
    };
    let mut spec = gangway_sim::cluster::ClusterSpec::from_file(&cluster)?;
    spec.queues.clear();
    spec.default_parent = None;
    let state = spec.build(&[], gangway_sched::StateConfig::default())?;
    let nodes: Vec<_> = state.nodes().iter().map(|n| n.spec.clone()).collect();
    let mut entries = Vec::new();
    for (i, line) in read(history)?.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let e: HistoryEntry = serde_json::from_str(line)
            .with_context(|| format!("{} line {}", history.display(), i + 1))?;
        entries.push(e);
    }
    // The window ends at the last submission of the export.
    let end = entries.iter().map(|e| e.submitted_at).max().unwrap_or(0);
    let from = end.saturating_sub(since_seconds(since)?);
    let w = whatif::run(&entries, from, &nodes, &current, &candidate)?;
    let gates = whatif::judge(&current.gates, &w);
    let v = json!({ "what_if": w, "gates": gates });
    let mut text = String::new();
    for d in gangway_server::policy::diff(&current, &candidate) {
        text.push_str(&format!("change: {d}\n"));
    }
    text.push_str(&whatif::table(&w));
    text.push_str(&whatif::gate_lines(&gates));
    emit(c, &v, text)
}
