//! The what-if: this cluster's own history (finished jobs as
//! [`HistoryEntry`] rows: submit times, requests, queues, users, observed run
//! times, failures) replayed through the simulator's engine, which runs the
//! same scheduling core, once under the policy in force and once under a
//! candidate, on the cluster's own nodes. Each side runs the scheduling
//! policy its version names (`scheduler.policy`, from the registry the live
//! server ranks by), so two policies compare as well as two settings of one. The server runs it off the state
//! lock, on a copy; `gangway policy what-if --history FILE` runs it offline.
//!
//! What is replayed of each job is what happened to it: it asks for its GPUs
//! for as long as they were bound over all its attempts. A job that failed
//! runs as long as it ran before failing; attempts that failed and were
//! restarted count with the GPU time they burned (run back to back with the
//! rest: the simulator has no restart backoff); attempts ended by a
//! preemption count with the work done before it (Gangway's preemption
//! signals a checkpoint), while the preemptions themselves are each
//! policy's own, decided by the core in the replay.

use super::{GateResult, Gates, Policy, PolicyError};
use crate::history::HistoryEntry;
use gangway_core::{NodeSpec, PriorityClass, Time};
use gangway_sim_engine::engine::{Engine, SimOptions};
use gangway_sim_engine::metrics::Stats;
use gangway_sim_engine::trace::{LoadReport, Trace, TraceJob};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most history rows one what-if replays (the newest are kept).
pub const MAX_JOBS: usize = 200_000;

/// A p95 wait that grows by less than this (seconds) never fails the gate:
/// percentages of near-zero waits mean nothing.
pub const WAIT_SLACK_SECONDS: f64 = 60.0;

/// One side's figures for a set of jobs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Figures {
    /// Jobs replayed.
    pub jobs: usize,
    /// Jobs the policy could not run at all (e.g. their queue is gone).
    pub rejected: usize,
    /// Average wait (time pending over all attempts), seconds.
    pub avg_wait: f64,
    /// 95th percentile wait, seconds.
    pub p95_wait: f64,
    /// Average job completion time (finish − submit), seconds.
    pub avg_jct: f64,
    /// Useful GPU-seconds of these jobs ÷ (cluster GPUs × makespan), percent.
    pub gpu_utilisation_pct: f64,
    /// Jain's index across queues (overall only).
    pub jain: Option<f64>,
    /// Preemptions.
    pub preemptions: u64,
    /// Jobs that waited more than 10× their run time (run time ≥ 1 minute).
    pub waited_over_10x: usize,
}

/// One policy's replay.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Side {
    /// Every queue together.
    pub overall: Figures,
    /// Per queue.
    pub queues: BTreeMap<String, Figures>,
}

/// The evidence: both replays of the same history.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WhatIf {
    /// History rows replayed.
    pub jobs: usize,
    /// Rows left out, by reason.
    pub skipped: BTreeMap<String, usize>,
    /// Earliest submission replayed (seconds since the epoch).
    pub from: Time,
    /// Latest submission replayed.
    pub to: Time,
    /// GPUs of the replayed cluster.
    pub gpus: u64,
    /// Replayed jobs that failed or timed out (they run as long as they did).
    #[serde(default)]
    pub failed_jobs: usize,
    /// Failed and restarted attempts whose run time is replayed with their job's.
    #[serde(default)]
    pub failed_attempts: u64,
    /// Preemptions the cluster saw in the replayed jobs (the work before
    /// each is replayed; each policy's replay preempts on its own).
    #[serde(default)]
    pub observed_preemptions: u64,
    /// The scheduling policy the version in force names (`scheduler.policy`).
    #[serde(default)]
    pub current_policy: String,
    /// The scheduling policy the candidate names.
    #[serde(default)]
    pub candidate_policy: String,
    /// The policy in force.
    pub current: Side,
    /// The candidate.
    pub candidate: Side,
}

fn priority(p: &str) -> PriorityClass {
    serde_json::from_value(serde_json::Value::String(p.to_string())).unwrap_or_default()
}

/// The replayable jobs of `entries`: those that ran and ended, submitted at
/// or after `since` (the newest [`MAX_JOBS`]). Each runs for the seconds its
/// GPUs were bound over all its attempts (see the module's notes).
pub fn trace_of(entries: &[HistoryEntry], since: Time) -> (Trace, BTreeMap<String, usize>) {
    let mut skipped: BTreeMap<String, usize> = BTreeMap::new();
    let mut rows: Vec<&HistoryEntry> = Vec::new();
    for e in entries {
        let why = if e.submitted_at < since {
            Some("before --since")
        } else if e.started_at.is_none() {
            Some("never ran (cancelled or still pending)")
        } else if e.ended_at.is_none() {
            Some("not finished")
        } else {
            None
        };
        match why {
            Some(w) => *skipped.entry(w.into()).or_default() += 1,
            None => rows.push(e),
        }
    }
    rows.sort_by_key(|e| (e.submitted_at, e.id));
    if rows.len() > MAX_JOBS {
        let cut = rows.len() - MAX_JOBS;
        *skipped
            .entry("older than the newest 200,000".into())
            .or_default() += cut;
        rows.drain(..cut);
    }
    let t0 = rows.first().map_or(0, |e| e.submitted_at);
    let jobs = rows
        .iter()
        .map(|e| TraceJob {
            name: e.id.to_string(),
            submit: e.submitted_at - t0,
            duration: e.run_seconds.max(1),
            gpus: e.replicas.saturating_mul(e.gpus_per_replica),
            cpu_millis: e.cpu_millis.saturating_mul(u64::from(e.replicas)),
            memory_mib: e.memory_mib.saturating_mul(u64::from(e.replicas)),
            queue: e.queue.clone(),
            priority: priority(&e.priority),
            gpu_model: None,
            user: e.user.clone(),
            app: Some(e.name.clone()),
            time_limit: e.runtime_seconds.or(e.time_limit_seconds),
        })
        .collect();
    (
        Trace {
            name: "history".into(),
            jobs,
            report: LoadReport::default(),
        },
        skipped,
    )
}

fn replay(trace: &Trace, nodes: &[NodeSpec], policy: &Policy) -> Result<Side, PolicyError> {
    let mut state = gangway_sched::ClusterState::new(gangway_sched::StateConfig::default());
    for n in nodes {
        let mut n = n.clone();
        n.cordoned = false;
        for g in &mut n.gpus {
            g.healthy = true;
        }
        state
            .add_node(n)
            .map_err(|e| PolicyError::Invalid(format!("what-if cluster: {e}")))?;
    }
    for q in &policy.queues {
        state
            .add_queue(q.clone())
            .map_err(|e| PolicyError::Invalid(format!("queues: {e}")))?;
    }
    let capacity = state.total().gpus.max(1) as f64;
    // The scheduling policy the version names ranks the jobs, with its
    // switches on the version's settings: the live server's cycle.
    let engine = Engine::with_state(
        trace,
        state,
        gangway_sched::policies::of(&policy.scheduler),
        gangway_sched::policies::configure(&policy.scheduler),
        SimOptions::default(),
    );
    let (result, jobs) = engine
        .run_with_jobs(&mut |_, _| {})
        .map_err(|e| PolicyError::Invalid(format!("what-if: {e}")))?;
    let span = result.makespan.max(1) as f64;
    let mut per: BTreeMap<String, Vec<&gangway_sim_engine::engine::SimJob>> = BTreeMap::new();
    for j in &jobs {
        per.entry(j.trace.queue.clone()).or_default().push(j);
    }
    let figures = |js: &[&gangway_sim_engine::engine::SimJob]| -> Figures {
        let mut waits = Vec::new();
        let mut jcts = Vec::new();
        let mut f = Figures {
            jobs: js.len(),
            ..Figures::default()
        };
        let mut useful = 0f64;
        for j in js {
            if j.rejected.is_some() {
                f.rejected += 1;
                continue;
            }
            f.preemptions += u64::from(j.preemptions);
            waits.push(j.waited as f64);
            if let Some(end) = j.finish {
                jcts.push(end.saturating_sub(j.trace.submit) as f64);
                useful += f64::from(j.trace.gpus) * j.trace.duration as f64;
            }
            if j.trace.duration >= 60 && j.waited > j.trace.duration.saturating_mul(10) {
                f.waited_over_10x += 1;
            }
        }
        let w = Stats::of(&mut waits);
        f.avg_wait = w.mean;
        f.p95_wait = w.p95;
        f.avg_jct = Stats::of(&mut jcts).mean;
        f.gpu_utilisation_pct = 100.0 * useful / (capacity * span);
        f
    };
    let all: Vec<&gangway_sim_engine::engine::SimJob> = jobs.iter().collect();
    let mut overall = figures(&all);
    overall.jain = Some(result.jain_fairness);
    Ok(Side {
        overall,
        queues: per.iter().map(|(q, js)| (q.clone(), figures(js))).collect(),
    })
}

/// Replays `entries` submitted at or after `since` on `nodes`, under
/// `current` and under `candidate`.
pub fn run(
    entries: &[HistoryEntry],
    since: Time,
    nodes: &[NodeSpec],
    current: &Policy,
    candidate: &Policy,
) -> Result<WhatIf, PolicyError> {
    if nodes.is_empty() {
        return Err(PolicyError::Invalid(
            "what-if: the cluster has no nodes to replay on".into(),
        ));
    }
    let (trace, skipped) = trace_of(entries, since);
    let t0 = entries
        .iter()
        .filter(|e| e.submitted_at >= since && e.started_at.is_some() && e.ended_at.is_some())
        .map(|e| e.submitted_at)
        .min()
        .unwrap_or(0);
    let gpus = nodes.iter().map(|n| n.gpus.len() as u64).sum();
    let replayed: std::collections::BTreeSet<String> =
        trace.jobs.iter().map(|j| j.name.clone()).collect();
    let (mut failed_jobs, mut failed_attempts, mut observed_preemptions) = (0, 0u64, 0u64);
    for e in entries {
        if !replayed.contains(&e.id.to_string()) {
            continue;
        }
        if matches!(
            e.state,
            gangway_core::JobState::Failed | gangway_core::JobState::Timeout
        ) {
            failed_jobs += 1;
        }
        failed_attempts += u64::from(e.failed_attempts);
        observed_preemptions += u64::from(e.preemptions);
    }
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| replay(&trace, nodes, current));
        let b = replay(&trace, nodes, candidate);
        (a.join(), b)
    });
    let a = a.map_err(|_| PolicyError::Invalid("what-if: the replay panicked".into()))??;
    Ok(WhatIf {
        jobs: trace.jobs.len(),
        skipped,
        from: t0,
        to: t0 + trace.jobs.last().map_or(0, |j| j.submit),
        gpus,
        failed_jobs,
        failed_attempts,
        observed_preemptions,
        current_policy: gangway_sched::policies::of(&current.scheduler)
            .name()
            .to_string(),
        candidate_policy: gangway_sched::policies::of(&candidate.scheduler)
            .name()
            .to_string(),
        current: a,
        candidate: b?,
    })
}

/// Judges `w` by `gates`: every gate on the overall figures, the p95 wait
/// gate on each queue too.
pub fn judge(gates: &Gates, w: &WhatIf) -> Vec<GateResult> {
    let mut out = Vec::new();
    if let Some(limit) = gates.max_p95_wait_worse_pct {
        let mut scopes = vec![(
            "overall".to_string(),
            &w.current.overall,
            &w.candidate.overall,
        )];
        for (q, cur) in &w.current.queues {
            if let Some(cand) = w.candidate.queues.get(q) {
                scopes.push((format!("queue {q}"), cur, cand));
            }
        }
        for (scope, cur, cand) in scopes {
            let grew = cand.p95_wait - cur.p95_wait;
            let pct = 100.0 * grew / cur.p95_wait.max(1.0);
            out.push(GateResult {
                gate: "max_p95_wait_worse_pct".into(),
                scope,
                limit,
                value: (pct * 10.0).round() / 10.0,
                passed: grew <= WAIT_SLACK_SECONDS || pct <= limit,
            });
        }
    }
    if let Some(limit) = gates.max_utilisation_drop_points {
        let drop = w.current.overall.gpu_utilisation_pct - w.candidate.overall.gpu_utilisation_pct;
        out.push(GateResult {
            gate: "max_utilisation_drop_points".into(),
            scope: "overall".into(),
            limit,
            value: (drop * 100.0).round() / 100.0,
            passed: drop <= limit,
        });
    }
    if let Some(limit) = gates.min_jain {
        let cur = w.current.overall.jain.unwrap_or(1.0);
        let cand = w.candidate.overall.jain.unwrap_or(1.0);
        out.push(GateResult {
            gate: "min_jain".into(),
            scope: "overall".into(),
            limit,
            value: (cand * 1000.0).round() / 1000.0,
            passed: cand >= limit || cand >= cur,
        });
    }
    out
}

/// Seconds for people: `45s`, `12m`, `3.5h`, `2.1d`.
pub fn human(secs: f64) -> String {
    if secs < 120.0 {
        format!("{secs:.0}s")
    } else if secs < 7200.0 {
        format!("{:.0}m", secs / 60.0)
    } else if secs < 172_800.0 {
        format!("{:.1}h", secs / 3600.0)
    } else {
        format!("{:.1}d", secs / 86_400.0)
    }
}

/// The what-if as a table: one row per queue and one overall, each figure
/// as `current -> candidate`.
pub fn table(w: &WhatIf) -> String {
    let policies = if w.current_policy == w.candidate_policy {
        w.current_policy.clone()
    } else {
        format!("{} -> {}", w.current_policy, w.candidate_policy)
    };
    let mut rows = vec![[
        "scope".to_string(),
        "jobs".into(),
        "avg wait".into(),
        "p95 wait".into(),
        "avg JCT".into(),
        "GPU util".into(),
        "Jain".into(),
        "preemptions".into(),
        "wait>10x run".into(),
    ]];
    let pair = |a: String, b: String| {
        if a == b {
            a
        } else {
            format!("{a} -> {b}")
        }
    };
    let row = |scope: &str, a: &Figures, b: &Figures| {
        [
            scope.to_string(),
            a.jobs.to_string(),
            pair(human(a.avg_wait), human(b.avg_wait)),
            pair(human(a.p95_wait), human(b.p95_wait)),
            pair(human(a.avg_jct), human(b.avg_jct)),
            pair(
                format!("{:.1}%", a.gpu_utilisation_pct),
                format!("{:.1}%", b.gpu_utilisation_pct),
            ),
            match (a.jain, b.jain) {
                (Some(x), Some(y)) => pair(format!("{x:.3}"), format!("{y:.3}")),
                _ => "-".into(),
            },
            pair(a.preemptions.to_string(), b.preemptions.to_string()),
            pair(a.waited_over_10x.to_string(), b.waited_over_10x.to_string()),
        ]
    };
    let empty = Figures::default();
    for (q, a) in &w.current.queues {
        let b = w.candidate.queues.get(q).unwrap_or(&empty);
        rows.push(row(q, a, b));
    }
    rows.push(row("overall", &w.current.overall, &w.candidate.overall));
    let mut width = [0usize; 9];
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let mut out = format!(
        "what-if: {} jobs of this cluster's history on {} GPUs (current -> candidate)\n",
        w.jobs, w.gpus
    );
    // Evidence stored before versions named their policy has no names.
    if !policies.is_empty() {
        out.push_str(&format!("scheduling policy: {policies}\n"));
    }
    for r in &rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = width[i]))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    if w.failed_jobs + w.failed_attempts as usize + w.observed_preemptions as usize > 0 {
        out.push_str(&format!(
            "replayed as they happened: {} failed or timed-out jobs, {} failed and restarted attempts, the work before {} preemptions\n",
            w.failed_jobs, w.failed_attempts, w.observed_preemptions
        ));
    }
    for (side, s) in [("current", &w.current), ("candidate", &w.candidate)] {
        for (q, f) in &s.queues {
            if f.rejected > 0 {
                out.push_str(&format!(
                    "queue {q}: {} of {} jobs cannot run under the {side} policy (rejected, e.g. the queue is gone)\n",
                    f.rejected, f.jobs
                ));
            }
        }
    }
    for (why, n) in &w.skipped {
        out.push_str(&format!("left out: {n} ({why})\n"));
    }
    out
}

/// The gate results as lines (`FAIL max_p95_wait_worse_pct queue vision: 85.2 (limit 10)`).
pub fn gate_lines(g: &[GateResult]) -> String {
    g.iter()
        .map(|r| {
            format!(
                "{} {} {}: {} (limit {})\n",
                if r.passed { "pass" } else { "FAIL" },
                r.gate,
                r.scope,
                r.value,
                r.limit
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::{JobId, JobState, QueueSpec};

    fn entry(id: u64, queue: &str, submit: Time, run: u64, gpus: u32) -> HistoryEntry {
        HistoryEntry {
            id: JobId(id),
            name: "train".into(),
            user: "alice".into(),
            queue: queue.into(),
            priority: "normal".into(),
            state: JobState::Succeeded,
            submitted_at: submit,
            started_at: Some(submit),
            ended_at: Some(submit + run),
            replicas: 1,
            gpus_per_replica: gpus,
            cpu_millis: 0,
            memory_mib: 0,
            nodes: vec!["n0".into()],
            exit_code: Some(0),
            attempts: 1,
            preemptions: 0,
            failed_attempts: 0,
            run_seconds: run,
            last_attempt_seconds: run,
            gpu_hours: 0.0,
            runtime_seconds: None,
            time_limit_seconds: None,
        }
    }

    fn policy(a: u64, b: u64) -> Policy {
        let mut qa = QueueSpec::gpus("a", None, a);
        qa.quota.borrowing_limit.gpus = Some(0);
        let mut qb = QueueSpec::gpus("b", None, b);
        qb.quota.borrowing_limit.gpus = Some(0);
        let mut p = Policy {
            queues: vec![qa, qb],
            ..Policy::default()
        };
        // The replay ranks as the live server does, so with preemption on a
        // newcomer would preempt a job past an attained-service band; these
        // tests look at one effect at a time.
        p.scheduler.preemption = false;
        p
    }

    #[test]
    fn the_candidates_backfill_mode_is_what_its_replay_runs() {
        let nodes = vec![NodeSpec::uniform("n0", "l", "s", 8, "H100", 80)];
        // Half the node busy, a whole-node job behind it, then a stream of
        // half-node jobs: with a reservation the big job starts when the
        // first ends; greedy (backfill off) lets the stream take its place.
        let mut h = vec![entry(1, "a", 0, 1_000, 4), entry(2, "a", 1, 100, 8)];
        for i in 0..6u64 {
            h.push(entry(3 + i, "a", 2 + i * 300, 1_000, 4));
        }
        for e in &mut h {
            e.time_limit_seconds = Some(e.run_seconds);
        }
        // A quota above the node's GPUs: what holds the big job back is
        // GPUs, not its queue's quota.
        let cur = policy(64, 8);
        let mut greedy = cur.clone();
        greedy.scheduler.backfill = gangway_sched::Backfill::Off;
        let w = run(&h, 0, &nodes, &cur, &greedy).expect("what-if");
        let (easy, off) = (&w.current.queues["a"], &w.candidate.queues["a"]);
        assert!(off.p95_wait > easy.p95_wait + 600.0, "{easy:?} {off:?}");
    }

    #[test]
    fn two_scheduling_policies_compare_on_the_same_history() {
        let nodes = vec![NodeSpec::uniform("n0", "l", "s", 8, "H100", 80)];
        // A whole-node job holds the node; then a long job and a short one,
        // both declaring their run times, wait for it. Gangway's policy runs
        // the short one first (less remaining work), FIFO the one submitted
        // first, and Tiresias preempts the job that has run.
        let mut h = vec![
            entry(1, "a", 0, 10_000, 8),
            entry(2, "a", 10, 5_000, 8),
            entry(3, "a", 20, 60, 8),
        ];
        for e in &mut h {
            e.runtime_seconds = Some(e.run_seconds);
        }
        let gangway = policy(8, 8);
        for other in ["fifo", "tiresias"] {
            let mut cand = gangway.clone();
            cand.scheduler.policy = other.into();
            let w = run(&h, 0, &nodes, &gangway, &cand).expect("what-if");
            assert_eq!(
                (w.current_policy.as_str(), w.candidate_policy.as_str()),
                ("gangway", other)
            );
            let (g, o) = (&w.current.overall, &w.candidate.overall);
            if other == "fifo" {
                // Gangway: the short job waits ~10,000 s and the long ~10,060
                // s; first come first: the long ~9,990 s, the short ~14,980 s.
                assert!(o.avg_wait > g.avg_wait + 1_000.0, "{other}: {g:?} {o:?}");
            } else {
                // Tiresias preempts whatever the site's settings say (its
                // switches win): the newcomers, in a higher band than the
                // whole-node job that has run, take its GPUs.
                assert_eq!(g.preemptions, 0, "{g:?}");
                assert!(o.preemptions > 0 && o.avg_wait < g.avg_wait, "{o:?}");
            }
            assert!(
                table(&w).contains(&format!("scheduling policy: gangway -> {other}")),
                "{}",
                table(&w)
            );
        }
    }

    #[test]
    fn failed_and_preempted_attempts_are_replayed_with_the_gpu_time_they_took() {
        let nodes = vec![NodeSpec::uniform("n0", "l", "s", 8, "H100", 80)];
        // Job 1 holds the whole node: two attempts failed after 1,000 s
        // each, then one preempted after 500 s, then it finished in 100 s.
        let mut flaky = entry(1, "a", 1_000, 100, 8);
        flaky.state = JobState::Succeeded;
        flaky.attempts = 4;
        flaky.failed_attempts = 2;
        flaky.preemptions = 1;
        flaky.run_seconds = 2_600;
        flaky.ended_at = Some(1_000 + 3_000);
        // Job 2, submitted 10 s later, needs the whole node too.
        let mut after = entry(2, "a", 1_010, 60, 8);
        after.state = JobState::Failed;
        let cur = policy(8, 8);
        let w = run(&[flaky, after], 0, &nodes, &cur, &cur).expect("what-if");
        assert_eq!((w.jobs, w.failed_jobs), (2, 1));
        assert_eq!((w.failed_attempts, w.observed_preemptions), (2, 1));
        // Job 2 waits for all of job 1's GPU time, not only its last 100 s.
        let a = &w.current.queues["a"];
        assert!(a.avg_wait >= (2_600.0 - 10.0) / 2.0, "{a:?}");
        assert!(a.avg_jct >= (2_600.0 + 2_650.0) / 2.0 - 1.0, "{a:?}");
        let t = table(&w);
        assert!(
            t.contains("1 failed or timed-out jobs, 2 failed and restarted attempts, the work before 1 preemptions"),
            "{t}"
        );
        // Evidence stored before these fields existed still reads.
        let mut old = serde_json::to_value(&w).expect("json");
        for k in ["failed_jobs", "failed_attempts", "observed_preemptions"] {
            old.as_object_mut().expect("obj").remove(k);
        }
        let back: WhatIf = serde_json::from_value(old).expect("old evidence");
        assert_eq!(back.failed_attempts, 0);
    }

    #[test]
    fn an_ordering_change_is_judged_by_its_replay() {
        let nodes = vec![NodeSpec::uniform("n0", "l", "s", 8, "H100", 80)];
        // The node is busy for 1,000 s; then a long and a short whole-node
        // job wait, the long one submitted first, both with estimates.
        let mut h = vec![
            entry(1, "a", 0, 1_000, 8),
            entry(2, "a", 10, 3_000, 8),
            entry(3, "a", 20, 100, 8),
        ];
        for e in &mut h {
            e.runtime_seconds = Some(e.run_seconds);
        }
        let cur = policy(8, 8);
        let mut fifo = cur.clone();
        fifo.queues[0].ordering = gangway_core::QueueOrdering::Fifo;
        let w = run(&h, 0, &nodes, &cur, &fifo).expect("what-if");
        let (ranked, plain) = (&w.current.queues["a"], &w.candidate.queues["a"]);
        // Ranked: the short job goes first; in submit order it waits for
        // the long one (about 3,000 s more for one job of three).
        assert!(
            plain.avg_wait > ranked.avg_wait + 900.0,
            "{ranked:?} {plain:?}"
        );
    }

    #[test]
    fn halving_a_queue_quota_makes_its_waits_longer_and_fails_the_gate() {
        let nodes: Vec<NodeSpec> = (0..2)
            .map(|i| NodeSpec::uniform(&format!("n{i}"), "l", "s", 8, "H100", 80))
            .collect();
        let mut h = Vec::new();
        for i in 0..120u64 {
            let q = if i % 2 == 0 { "a" } else { "b" };
            h.push(entry(i + 1, q, 1_000 + i * 60, 900, 2));
        }
        // A cancelled job that never ran is left out, and said so.
        let mut never = entry(500, "a", 2_000, 0, 1);
        never.started_at = None;
        never.state = JobState::Cancelled;
        h.push(never);
        let cur = policy(8, 8);
        let cand = policy(4, 8);
        let w = run(&h, 0, &nodes, &cur, &cand).expect("what-if");
        assert_eq!(w.jobs, 120);
        assert_eq!(w.gpus, 16);
        assert_eq!(w.skipped.values().sum::<usize>(), 1);
        let (ca, na) = (&w.current.queues["a"], &w.candidate.queues["a"]);
        assert!(na.p95_wait > ca.p95_wait + 60.0, "{ca:?} {na:?}");
        assert_eq!(
            w.current.queues["b"].p95_wait,
            w.candidate.queues["b"].p95_wait
        );
        let gates = Gates {
            max_p95_wait_worse_pct: Some(10.0),
            max_utilisation_drop_points: Some(50.0),
            min_jain: None,
        };
        let r = judge(&gates, &w);
        let failed: Vec<&str> = r
            .iter()
            .filter(|g| !g.passed)
            .map(|g| g.scope.as_str())
            .collect();
        assert!(failed.contains(&"queue a"), "{r:?}");
        assert!(!failed.contains(&"queue b"), "{r:?}");
        let t = table(&w);
        assert!(t.contains("overall") && t.contains(" -> "), "{t}");
        // The same policy on both sides passes every gate.
        let same = run(&h, 0, &nodes, &cur, &cur).expect("what-if");
        assert!(judge(&gates, &same).iter().all(|g| g.passed));
    }
}
