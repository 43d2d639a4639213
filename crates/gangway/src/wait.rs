//! `gangway submit --wait`: follows a job until it ends, printing a line
//! each time what matters changes (why it waits, where it runs, how it
//! ended), and exits with the job's outcome.

use crate::client::{Conn, Output};
use anyhow::Result;
use serde_json::Value;
use std::time::Duration;

/// A job that ended without succeeding: the process exits with this code.
#[derive(Debug, thiserror::Error)]
#[error("job {id} ended {state}")]
pub struct JobOutcome {
    /// The job.
    pub id: u64,
    /// Its final state.
    pub state: String,
    /// The exit status for the shell (never 0).
    pub code: u8,
}

/// The exit status for a job's final state: 0 when it succeeded; when it
/// failed, its first failing rank's exit code (1 when unknown or out of
/// range); 1 when cancelled or timed out.
pub fn exit_code(job: &Value) -> u8 {
    match job.get("state").and_then(Value::as_str) {
        Some("succeeded") => 0,
        Some("failed") => job
            .pointer("/failure/exit_code")
            .and_then(Value::as_i64)
            .and_then(|c| u8::try_from(c).ok())
            .filter(|c| *c != 0)
            .unwrap_or(1),
        _ => 1,
    }
}

fn ended(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "cancelled" | "timeout")
}

/// What the progress line says about the job now (`None`: nothing to say).
pub fn progress(j: &Value) -> String {
    let id = j.get("id").and_then(Value::as_u64).unwrap_or(0);
    let state = j.get("state").and_then(Value::as_str).unwrap_or("?");
    match state {
        "pending" | "admitted" => {
            let code = j.get("reason_code").and_then(Value::as_str);
            let why = j.get("reason").and_then(Value::as_str);
            match (code, why) {
                (Some(c), Some(w)) => format!("job {id}: pending ({c}: {w})"),
                (None, Some(w)) => format!("job {id}: pending ({w})"),
                (Some(c), None) => format!("job {id}: pending ({c})"),
                (None, None) => format!("job {id}: pending"),
            }
        }
        "scheduled" | "running" | "preempting" => {
            let mut nodes: Vec<&str> = Vec::new();
            for p in j
                .get("placement")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(n) = p.get("node").and_then(Value::as_str) {
                    if !nodes.contains(&n) {
                        nodes.push(n);
                    }
                }
            }
            let state = crate::human::shown_state(j);
            if nodes.is_empty() {
                format!("job {id}: {state}")
            } else {
                format!("job {id}: {state} on {}", nodes.join(","))
            }
        }
        s if ended(s) => {
            let last = j
                .get("events")
                .and_then(Value::as_array)
                .and_then(|e| e.last())
                .and_then(|e| e.get("message"))
                .and_then(Value::as_str)
                .unwrap_or("");
            if last.is_empty() {
                format!("job {id}: {s}")
            } else {
                format!("job {id}: {s} ({last})")
            }
        }
        other => format!("job {id}: {other}"),
    }
}

/// Polls job `id` until it ends; a progress line goes to stderr at each
/// change. Returns the final job, or a [`JobOutcome`] error when it did not
/// succeed.
pub fn wait(c: &Conn, id: u64, every: Duration) -> Result<()> {
    let mut last = String::new();
    loop {
        let j = c.get(&format!("/v1/jobs/{id}"))?;
        let line = progress(&crate::client::printable_value(&j));
        if line != last {
            eprintln!("{line}");
            last = line;
        }
        let state = j
            .get("state")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if ended(&state) {
            if c.output == Output::Json {
                println!("{}", serde_json::to_string_pretty(&j)?);
            }
            return match exit_code(&j) {
                0 => Ok(()),
                code => Err(JobOutcome { id, state, code }.into()),
            };
        }
        std::thread::sleep(every);
    }
}

/// Waits until every job has ended, printing each one's final state; the
/// outcome is that of `submit --wait`: `Ok` only when every job succeeded,
/// else a [`JobOutcome`] for the first job that did not.
pub fn wait_all(c: &Conn, ids: &[u64]) -> Result<()> {
    let mut left: Vec<u64> = ids.to_vec();
    // The first job (in submission order) that did not succeed.
    let mut outcome: Option<JobOutcome> = None;
    while !left.is_empty() {
        let mut still = Vec::new();
        for id in left {
            let job = c.get(&format!("/v1/jobs/{id}"))?;
            let state = crate::client::show(job.get("state"));
            if matches!(
                state.as_str(),
                "succeeded" | "failed" | "cancelled" | "timeout"
            ) {
                let last = job
                    .get("events")
                    .and_then(Value::as_array)
                    .and_then(|e| e.last())
                    .map(|e| crate::client::show(e.get("message")))
                    .unwrap_or_default();
                let last = gangway_core::text::printable(&last);
                println!("job {id}: {state} ({last})");
                let code = exit_code(&job);
                if code != 0 && outcome.as_ref().is_none_or(|o| o.id > id) {
                    outcome = Some(JobOutcome { id, state, code });
                }
            } else {
                still.push(id);
            }
        }
        left = still;
        if !left.is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
    }
    match outcome {
        Some(o) => Err(o.into()),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn exit_codes_follow_the_outcome() {
        assert_eq!(exit_code(&json!({"state": "succeeded"})), 0);
        assert_eq!(
            exit_code(&json!({"state": "failed", "failure": {"exit_code": 3}})),
            3
        );
        assert_eq!(
            exit_code(&json!({"state": "failed", "failure": {"exit_code": -9}})),
            1
        );
        assert_eq!(exit_code(&json!({"state": "failed"})), 1);
        assert_eq!(exit_code(&json!({"state": "cancelled"})), 1);
        assert_eq!(exit_code(&json!({"state": "timeout"})), 1);
    }

    #[test]
    fn progress_lines_say_why_where_and_how() {
        let p = json!({"id": 4, "state": "pending", "reason_code": "Resources", "reason": "no node has 8 free GPUs"});
        assert_eq!(
            progress(&p),
            "job 4: pending (Resources: no node has 8 free GPUs)"
        );
        let r = json!({"id": 4, "state": "running", "placement": [{"node": "a"}, {"node": "a"}, {"node": "b"}]});
        assert_eq!(progress(&r), "job 4: running on a,b");
        let e =
            json!({"id": 4, "state": "succeeded", "events": [{"message": "every rank exited 0"}]});
        assert_eq!(progress(&e), "job 4: succeeded (every rank exited 0)");
    }
}
