//! Finished jobs as accounting rows (`gangway history`, `sacct`'s job): one
//! shape for the API, the CLI's CSV/JSON, the export kept before retention
//! removes a record, and the policy what-if's replay of this cluster's past.

use crate::records::{JobMap, JobRecord};
use gangway_core::{JobId, JobState, Time};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One job's accounting row, derived from its record and events.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HistoryEntry {
    /// Id.
    pub id: JobId,
    /// Name.
    pub name: String,
    /// Owner.
    pub user: String,
    /// Queue.
    pub queue: String,
    /// Priority class, as submitted.
    pub priority: String,
    /// Final (or current) state.
    pub state: JobState,
    /// Submitted at.
    pub submitted_at: Time,
    /// When its first attempt's GPUs were bound (`None`: never ran).
    pub started_at: Option<Time>,
    /// When it ended (`None`: not finished).
    pub ended_at: Option<Time>,
    /// Replicas it ran with (its last placement), else as requested.
    pub replicas: u32,
    /// GPUs per replica.
    pub gpus_per_replica: u32,
    /// CPU per replica, thousandths of a core.
    pub cpu_millis: u64,
    /// Memory per replica, MiB.
    pub memory_mib: u64,
    /// Distinct nodes of its last placement, in rank order.
    pub nodes: Vec<String>,
    /// Exit code of the first failing rank of its last failed attempt, or 0
    /// when it succeeded; `None` otherwise.
    pub exit_code: Option<i32>,
    /// Attempts started (requeues and restarts each start one).
    pub attempts: u32,
    /// Times it was preempted.
    pub preemptions: u32,
    /// Attempts that failed and were restarted (its restart policy): the
    /// GPU time they burned is part of `run_seconds`. Absent (0) in exports
    /// written before it was recorded.
    #[serde(default)]
    pub failed_attempts: u32,
    /// Seconds its GPUs were bound, over all attempts.
    pub run_seconds: u64,
    /// Seconds of its last attempt (bound to end): the observed run time of a
    /// job that ran once to completion.
    pub last_attempt_seconds: u64,
    /// GPU-hours over all attempts (GPUs × bound time).
    pub gpu_hours: f64,
    /// Declared run time, seconds (as submitted).
    pub runtime_seconds: Option<u64>,
    /// Time limit, seconds (as submitted).
    pub time_limit_seconds: Option<u64>,
}

/// Events that end an attempt's binding.
const ENDS: [&str; 6] = [
    "cancelled",
    "finished",
    "failed",
    "requeued",
    "restarting",
    "timeout",
];

impl HistoryEntry {
    /// The row of a record, as of `now` (a running attempt counts up to `now`).
    pub fn from_record(rec: &JobRecord, now: Time) -> Self {
        let per = rec.spec.resources.gpus;
        let replicas = if rec.placement.is_empty() {
            rec.spec.replicas
        } else {
            u32::try_from(rec.placement.len()).unwrap_or(u32::MAX)
        };
        let mut started_at = None;
        let mut bound: Option<Time> = None;
        let mut run_seconds = 0u64;
        let mut last_attempt_seconds = 0u64;
        let mut attempts = 0u32;
        let mut preemptions = 0u32;
        let mut failed_attempts = 0u32;
        let mut ended_at = None;
        for e in &rec.events {
            match e.kind.as_str() {
                "scheduled" => {
                    started_at.get_or_insert(e.at);
                    if bound.is_none() {
                        attempts = attempts.saturating_add(1);
                        bound = Some(e.at);
                    }
                }
                "preempting" => preemptions = preemptions.saturating_add(1),
                k if ENDS.contains(&k) => {
                    if k == "restarting" && bound.is_some() {
                        failed_attempts = failed_attempts.saturating_add(1);
                    }
                    if let Some(s) = bound.take() {
                        last_attempt_seconds = e.at.saturating_sub(s);
                        run_seconds = run_seconds.saturating_add(last_attempt_seconds);
                    }
                    if rec.state.is_terminal() {
                        ended_at = Some(e.at);
                    }
                }
                _ => {}
            }
        }
        if let Some(s) = bound {
            last_attempt_seconds = now.saturating_sub(s);
            run_seconds = run_seconds.saturating_add(last_attempt_seconds);
        }
        let exit_code = match rec.state {
            JobState::Succeeded => Some(0),
            JobState::Failed | JobState::Timeout => rec.failure.as_ref().map(|f| f.exit_code),
            _ => None,
        };
        let gpu_hours = (f64::from(per) * f64::from(replicas) * run_seconds as f64) / 3600.0;
        HistoryEntry {
            id: rec.id,
            name: rec.spec.name.clone(),
            user: rec.user.clone(),
            queue: rec.spec.queue.clone(),
            priority: serde_json::to_value(rec.spec.priority)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default(),
            state: rec.state,
            submitted_at: rec.submitted_at,
            started_at,
            ended_at,
            replicas,
            gpus_per_replica: per,
            cpu_millis: rec.spec.resources.cpu_millis,
            memory_mib: rec.spec.resources.memory_mib,
            nodes: rec.nodes().into_iter().map(str::to_string).collect(),
            exit_code,
            attempts,
            preemptions,
            failed_attempts,
            run_seconds,
            last_attempt_seconds,
            gpu_hours,
            runtime_seconds: rec.spec.runtime_seconds,
            time_limit_seconds: rec.spec.time_limit.as_ref().and_then(|t| t.seconds().ok()),
        }
    }
}

/// Rows per page of `GET /v1/history` unless `limit` says otherwise.
pub const DEFAULT_PAGE: usize = 500;
/// Most rows per page.
pub const MAX_PAGE: usize = 5_000;

/// Filters of `GET /v1/history` (all optional).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HistoryQuery {
    /// Only this user's jobs (plain users: only their own).
    pub user: Option<String>,
    /// Only this queue.
    pub queue: Option<String>,
    /// Only these final states, comma-separated (`failed,timeout`).
    pub state: Option<String>,
    /// Only jobs that ended at or after this time (epoch seconds).
    pub since: Option<Time>,
    /// Only jobs that ended before this time (epoch seconds).
    pub until: Option<Time>,
    /// Only jobs with a larger id (the previous page's `next_cursor`).
    pub cursor: Option<u64>,
    /// Rows per page (default 500, at most 5,000).
    pub limit: Option<usize>,
}

/// One page of finished jobs, oldest id first.
#[derive(Debug, Serialize, Deserialize)]
pub struct HistoryPage {
    /// The rows.
    pub entries: Vec<HistoryEntry>,
    /// Pass as `cursor` for the next page; absent on the last.
    pub next_cursor: Option<u64>,
}

/// GPU-hours per queue and per user over `[from, to)` (`GET /v1/usage`):
/// each job counts its GPUs from when it was scheduled until it ended (or
/// `now`). Reads a job map, the state's or the read view's.
pub fn usage(
    jobs: &JobMap,
    from: Time,
    to: Time,
    now: Time,
) -> (BTreeMap<String, f64>, BTreeMap<String, f64>) {
    let mut by_queue = BTreeMap::new();
    let mut by_user = BTreeMap::new();
    for (rec, _) in jobs.values() {
        let gpus: u64 = rec.placement.iter().map(|r| r.gpus.len() as u64).sum();
        let mut start: Option<Time> = None;
        let mut secs = 0u64;
        for e in &rec.events {
            match e.kind.as_str() {
                "scheduled" | "running" => {
                    start.get_or_insert(e.at);
                }
                "cancelled" | "finished" | "failed" | "requeued" | "restarting" | "timeout" => {
                    if let Some(s) = start.take() {
                        secs += e.at.min(to).saturating_sub(s.max(from));
                    }
                }
                _ => {}
            }
        }
        if let Some(s) = start {
            secs += now.min(to).saturating_sub(s.max(from));
        }
        let h = (gpus * secs) as f64 / 3600.0;
        let ran = gpus > 0 && rec.events.iter().any(|e| e.kind == "scheduled");
        if ran {
            *by_queue.entry(rec.spec.queue.clone()).or_insert(0.0) += h;
            *by_user.entry(rec.user.clone()).or_insert(0.0) += h;
        }
    }
    (by_queue, by_user)
}

/// Which finished jobs a page of `GET /v1/history` shows, checked and
/// resolved by the caller (who may read whose jobs is the API's rule).
#[derive(Clone, Debug, Default)]
pub struct HistoryFilter {
    /// Only this user's jobs.
    pub user: Option<String>,
    /// Only this queue.
    pub queue: Option<String>,
    /// Only these final states.
    pub states: Option<Vec<JobState>>,
    /// Only jobs that ended at or after this time.
    pub since: Option<Time>,
    /// Only jobs that ended before this time.
    pub until: Option<Time>,
    /// Only jobs with a larger id.
    pub cursor: Option<u64>,
    /// Rows at most (at least 1).
    pub limit: usize,
}

/// One page of finished jobs of `jobs` (the state's or the read view's),
/// walking ids upwards from the filter's cursor, as of `now`.
pub fn page(jobs: &JobMap, f: &HistoryFilter, now: Time) -> HistoryPage {
    let from = JobId(f.cursor.map_or(0, |c| c.saturating_add(1)));
    let mut entries = Vec::new();
    let mut next_cursor = None;
    for (rec, _) in jobs.range(from..).map(|(_, v)| v) {
        if !rec.state.is_terminal()
            || f.user.as_ref().is_some_and(|u| &rec.user != u)
            || f.queue.as_ref().is_some_and(|x| &rec.spec.queue != x)
            || f.states.as_ref().is_some_and(|s| !s.contains(&rec.state))
        {
            continue;
        }
        let e = HistoryEntry::from_record(rec, now);
        let ended = e.ended_at.unwrap_or(rec.submitted_at);
        if f.since.is_some_and(|t| ended < t) || f.until.is_some_and(|t| ended >= t) {
            continue;
        }
        if entries.len() == f.limit {
            next_cursor = entries.last().map(|e: &HistoryEntry| e.id.0);
            break;
        }
        entries.push(e);
    }
    HistoryPage {
        entries,
        next_cursor,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{JobEvent, ReplicaOn};

    fn ev(at: Time, kind: &str) -> JobEvent {
        JobEvent {
            at,
            kind: kind.into(),
            message: String::new(),
            count: 1,
            last_at: None,
        }
    }

    #[test]
    fn a_preempted_then_finished_job_counts_both_attempts() {
        let spec: gangway_core::JobSpec = serde_json::from_value(serde_json::json!({
            "name": "t", "queue": "q", "replicas": 2,
            "resources": {"gpus": 4, "gpu_model": null, "min_gpu_memory_gib": null,
                          "cpu_millis": 1000, "memory_mib": 1024}
        }))
        .unwrap();
        let mut rec = JobRecord::submitted(JobId(7), "alice", spec, 100);
        rec.events.push(ev(110, "scheduled"));
        rec.events.push(ev(120, "running"));
        rec.events.push(ev(150, "preempting"));
        rec.events.push(ev(160, "requeued"));
        rec.events.push(ev(200, "scheduled"));
        rec.events.push(ev(560, "finished"));
        rec.state = JobState::Succeeded;
        rec.placement = vec![
            ReplicaOn {
                node: "a".into(),
                gpus: vec![0, 1, 2, 3],
            },
            ReplicaOn {
                node: "b".into(),
                gpus: vec![0, 1, 2, 3],
            },
        ];
        let h = HistoryEntry::from_record(&rec, 1000);
        assert_eq!(h.started_at, Some(110));
        assert_eq!(h.ended_at, Some(560));
        assert_eq!(h.attempts, 2);
        assert_eq!(h.preemptions, 1);
        assert_eq!(h.run_seconds, 50 + 360);
        assert_eq!(h.last_attempt_seconds, 360);
        assert_eq!(h.exit_code, Some(0));
        assert_eq!(h.nodes, vec!["a", "b"]);
        assert!((h.gpu_hours - 8.0 * 410.0 / 3600.0).abs() < 1e-9);
        assert_eq!(h.failed_attempts, 0);
    }

    #[test]
    fn failed_attempts_are_counted_and_old_exports_still_read() {
        let mut rec = JobRecord::submitted(
            JobId(3),
            "alice",
            gangway_core::JobSpec::new("t", "q", 1, 1),
            100,
        );
        for (at, kind) in [
            (110, "scheduled"),
            (400, "restarting"),
            (430, "requeued"),
            (440, "scheduled"),
            (700, "restarting"),
            (730, "requeued"),
            (735, "scheduled"),
            (800, "failed"),
        ] {
            rec.events.push(ev(at, kind));
        }
        rec.state = JobState::Failed;
        let h = HistoryEntry::from_record(&rec, 1000);
        assert_eq!((h.attempts, h.failed_attempts, h.preemptions), (3, 2, 0));
        assert_eq!(h.run_seconds, 290 + 260 + 65);
        assert_eq!(h.last_attempt_seconds, 65);
        // A row exported before `failed_attempts` existed.
        let mut old = serde_json::to_value(&h).expect("json");
        old.as_object_mut().expect("row").remove("failed_attempts");
        let back: HistoryEntry = serde_json::from_value(old).expect("old row");
        assert_eq!(back.failed_attempts, 0);
        assert_eq!(back.run_seconds, h.run_seconds);
    }

    #[test]
    fn usage_counts_gpu_hours_inside_the_range() {
        let mut rec = JobRecord::submitted(
            JobId(1),
            "alice",
            gangway_core::JobSpec::new("j", "q", 1, 2),
            0,
        );
        rec.state = JobState::Cancelled;
        rec.placement = vec![ReplicaOn {
            node: "n".into(),
            gpus: vec![0, 1],
        }];
        rec.events = vec![
            ev(0, "submitted"),
            ev(100, "scheduled"),
            ev(3700, "cancelled"),
        ];
        let mut jobs = JobMap::new();
        jobs.insert(JobId(1), (std::sync::Arc::new(rec), 1));
        let (q, u) = usage(&jobs, 0, 10_000, 20_000);
        assert!((q["q"] - 2.0).abs() < 1e-9, "2 GPUs for one hour");
        assert!((u["alice"] - 2.0).abs() < 1e-9);
        let (q, _) = usage(&jobs, 1900, 10_000, 20_000);
        assert!(
            (q["q"] - 1.0).abs() < 1e-9,
            "only the half hour inside the range"
        );
    }

    #[test]
    fn a_history_page_skips_live_jobs_filters_and_pages_by_id() {
        let mut jobs = JobMap::new();
        for (id, user, state) in [
            (1, "alice", JobState::Succeeded),
            (2, "bob", JobState::Failed),
            (3, "alice", JobState::Running),
            (4, "alice", JobState::Cancelled),
            (5, "alice", JobState::Succeeded),
        ] {
            let mut rec = JobRecord::submitted(
                JobId(id),
                user,
                gangway_core::JobSpec::new("j", "q", 1, 1),
                10,
            );
            rec.state = state;
            rec.events.push(ev(10 + id, "finished"));
            jobs.insert(JobId(id), (std::sync::Arc::new(rec), 1));
        }
        let ids = |p: &HistoryPage| p.entries.iter().map(|e| e.id.0).collect::<Vec<_>>();
        let mut f = HistoryFilter {
            user: Some("alice".into()),
            limit: 2,
            ..Default::default()
        };
        let first = page(&jobs, &f, 100);
        assert_eq!(ids(&first), vec![1, 4], "bob's and the running job skipped");
        assert_eq!(first.next_cursor, Some(4));
        f.cursor = first.next_cursor;
        let second = page(&jobs, &f, 100);
        assert_eq!(ids(&second), vec![5]);
        assert_eq!(second.next_cursor, None);
        let f = HistoryFilter {
            states: Some(vec![JobState::Failed, JobState::Cancelled]),
            since: Some(14),
            limit: 10,
            ..Default::default()
        };
        assert_eq!(ids(&page(&jobs, &f, 100)), vec![4], "job 2 ended at 12");
    }
}
