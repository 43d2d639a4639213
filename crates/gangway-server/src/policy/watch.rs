//! Watching after a change: per-queue wait figures against their SLO
//! (`slo_p95_wait_seconds` in the configuration), the policy version in
//! force and when it changed, the p95 wait before that change, and how far
//! run times drift from their predictions, as Prometheus metrics; and the
//! alert rules (`gangway alerts`) that fire on them.

use crate::config::ServerConfig;
use crate::control::Control;
use gangway_core::{JobState, Time};
use gangway_store::Store;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Seconds of recent starts the live p95 wait is taken over.
pub const WINDOW_SECONDS: Time = 3600;
/// Seconds between two refreshes (each walks the job records).
const REFRESH_SECONDS: Time = 15;

/// The queue label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabel {
    /// Queue.
    pub queue: String,
}

/// What [`Watch::apply`] needs from the locked state ([`Watch::inputs`]).
pub struct WatchInputs {
    version: u64,
    changed: Time,
    predictor: gangway_sched::predict::RuntimePredictor,
}

/// The policy metrics.
pub struct Watch {
    registry: Registry,
    wait_p95: Family<QueueLabel, Gauge>,
    slo: Family<QueueLabel, Gauge>,
    before_change: Family<QueueLabel, Gauge>,
    version: Gauge,
    changed_at: Gauge,
    prediction_error: Gauge<f64, AtomicU64>,
    refreshed_at: AtomicU64,
}

impl Default for Watch {
    fn default() -> Self {
        Self::new()
    }
}

fn p95(v: &mut [u64]) -> i64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    let i = ((v.len() - 1) as f64 * 0.95).round() as usize;
    i64::try_from(v[i]).unwrap_or(i64::MAX)
}

impl Watch {
    /// Registers the metrics.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gangway");
        let w = Watch {
            wait_p95: Family::default(),
            slo: Family::default(),
            before_change: Family::default(),
            version: Gauge::default(),
            changed_at: Gauge::default(),
            prediction_error: Gauge::default(),
            refreshed_at: AtomicU64::new(0),
            registry: Registry::default(),
        };
        registry.register(
            "queue_wait_p95_seconds",
            "p95 wait (start minus submit) of the jobs that started in the last hour, per queue",
            w.wait_p95.clone(),
        );
        registry.register(
            "queue_slo_p95_wait_seconds",
            "The p95 wait each queue promises (slo_p95_wait_seconds in the configuration)",
            w.slo.clone(),
        );
        registry.register(
            "queue_wait_p95_before_change_seconds",
            "p95 wait of the jobs that started in the day before the policy version in force",
            w.before_change.clone(),
        );
        registry.register(
            "policy_version",
            "The scheduling policy version in force",
            w.version.clone(),
        );
        registry.register(
            "policy_changed_timestamp_seconds",
            "When the policy version in force was made (seconds since the epoch)",
            w.changed_at.clone(),
        );
        registry.register(
            "runtime_prediction_error_ratio",
            "Median over the jobs that succeeded in the last hour of max(actual/predicted, predicted/actual) run time (1 is perfect)",
            w.prediction_error.clone(),
        );
        Watch { registry, ..w }
    }

    /// Recomputes the figures from the state, at most every 15 seconds
    /// (all under the caller's lock: [`Watch::due`], [`Watch::inputs`] and
    /// [`Watch::apply`] let the walk of the jobs run without it).
    pub fn refresh<S: Store>(&self, cfg: &ServerConfig, c: &Control<S>, now: Time) {
        if !self.due(now) {
            return;
        }
        let queues: Vec<&str> = c
            .cluster
            .queues()
            .iter()
            .map(|q| q.spec.name.as_str())
            .collect();
        self.apply(cfg, Self::inputs(c), &c.jobs, &queues, now);
    }

    /// Whether a refresh is due at `now` (every 15 seconds); if so, the
    /// next is due 15 seconds later.
    pub fn due(&self, now: Time) -> bool {
        let last = self.refreshed_at.load(Ordering::Relaxed);
        if last != 0 && now < last.saturating_add(REFRESH_SECONDS) {
            return false;
        }
        self.refreshed_at.store(now, Ordering::Relaxed);
        true
    }

    /// What a refresh needs from the locked state besides the read view:
    /// the policy version in force (one store read) and a copy of the
    /// run-time predictor (bounded by its key limit).
    pub fn inputs<S: Store>(c: &Control<S>) -> WatchInputs {
        let (version, changed) = match super::current(&c.store) {
            Ok(Some(v)) => (v.version, v.at),
            _ => (0, 0),
        };
        WatchInputs {
            version,
            changed,
            predictor: c.cluster.predictor().clone(),
        }
    }

    /// Recomputes the figures from `inputs` and a walk of `jobs` (the read
    /// view's, so without the state lock), for `queues`.
    pub fn apply(
        &self,
        cfg: &ServerConfig,
        inputs: WatchInputs,
        jobs: &crate::records::JobMap,
        queues: &[&str],
        now: Time,
    ) {
        let WatchInputs {
            version,
            changed,
            predictor,
        } = inputs;
        self.version.set(i64::try_from(version).unwrap_or(i64::MAX));
        self.changed_at
            .set(i64::try_from(changed).unwrap_or(i64::MAX));
        let mut recent: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
        let mut before: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
        let mut ratios = Vec::new();
        let from = now.saturating_sub(WINDOW_SECONDS);
        let day_before = changed.saturating_sub(super::AFTER_SECONDS);
        for (r, _) in jobs.values() {
            let started = r
                .events
                .iter()
                .find(|e| e.kind == "scheduled")
                .map(|e| e.at);
            if let Some(s) = started {
                let w = s.saturating_sub(r.submitted_at);
                if s >= from {
                    recent.entry(&r.spec.queue).or_default().push(w);
                }
                if changed > 0 && s >= day_before && s < changed {
                    before.entry(&r.spec.queue).or_default().push(w);
                }
            }
            if r.state == JobState::Succeeded {
                let e = crate::history::HistoryEntry::from_record(r, now);
                let recent_end = e.ended_at.is_some_and(|t| t >= from);
                let pred = predictor.predict(&gangway_sched::state::key_of(&r.spec));
                if let (true, Some(p)) = (recent_end && e.last_attempt_seconds > 0, pred) {
                    let (a, p) = (e.last_attempt_seconds as f64, p.median().max(1) as f64);
                    ratios.push((a / p).max(p / a));
                }
            }
        }
        self.wait_p95.clear();
        for &name in queues {
            let mut v = recent.remove(name).unwrap_or_default();
            self.wait_p95
                .get_or_create(&QueueLabel { queue: name.into() })
                .set(p95(&mut v));
        }
        self.before_change.clear();
        for (q, mut v) in before {
            self.before_change
                .get_or_create(&QueueLabel { queue: q.into() })
                .set(p95(&mut v));
        }
        self.slo.clear();
        for (q, t) in &cfg.slo_p95_wait_seconds {
            self.slo
                .get_or_create(&QueueLabel { queue: q.clone() })
                .set(i64::try_from(*t).unwrap_or(i64::MAX));
        }
        ratios.sort_by(f64::total_cmp);
        self.prediction_error
            .set(ratios.get(ratios.len() / 2).copied().unwrap_or(1.0));
    }

    /// These metrics in the text format, without the closing `# EOF`.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out.strip_suffix("# EOF\n")
            .map(str::to_string)
            .unwrap_or(out)
    }
}

/// The Prometheus alert rules for these metrics (`gangway alerts`).
pub fn alert_rules() -> String {
    r#"# Gangway's alert rules (`gangway alerts > gangway-rules.yaml`; load with
# rule_files: in prometheus.yml). Thresholds are defaults: edit to taste.
groups:
  - name: gangway-policy
    rules:
      - alert: GangwayQueueWaitSLOBreach
        # A queue's p95 wait over the last hour is above the SLO it promises.
        expr: gangway_queue_wait_p95_seconds > on(queue) gangway_queue_slo_p95_wait_seconds
        for: 15m
        labels:
          severity: page
        annotations:
          summary: "Queue {{ $labels.queue }} p95 wait {{ $value | humanizeDuration }} is above its SLO"
          runbook: "docs/RUNBOOK.md#a-bad-policy"
      - alert: GangwayWaitDriftAfterPolicyChange
        # In the day after a policy change, a queue's p95 wait is over 1.5x
        # (and 5 minutes more than) what it was the day before the change.
        expr: |
          (gangway_queue_wait_p95_seconds > on(queue) (1.5 * gangway_queue_wait_p95_before_change_seconds + 300))
          and on() ((time() - gangway_policy_changed_timestamp_seconds) < 86400)
        for: 30m
        labels:
          severity: warning
        annotations:
          summary: "Queue {{ $labels.queue }} waits longer since policy version change; consider `gangway policy rollback`"
          runbook: "docs/RUNBOOK.md#a-bad-policy"
      - alert: GangwayRuntimePredictionDrift
        # Run times are more than 2x off their predictions (median of the
        # last hour): backfill and reservations rest on these.
        expr: gangway_runtime_prediction_error_ratio > 2
        for: 1h
        labels:
          severity: warning
        annotations:
          summary: "Run-time predictions are {{ $value }}x off (median of the last hour)"
          runbook: "docs/RUNBOOK.md#run-time-prediction-drift"
  - name: gangway-nodes
    rules:
      - alert: GangwayAutoCordonHalted
        # More than half the nodes qualified for auto-cordon at once: the
        # cause is likely not the nodes (a bad image, a shared filesystem,
        # one user's jobs), so Gangway stopped cordoning and waits for you.
        expr: gangway_auto_cordon_halted == 1
        for: 0m
        labels:
          severity: page
        annotations:
          summary: "Auto-cordon stopped: too many nodes failing at once; see `gangway audit` and `gangway nodes`"
          runbook: "docs/RUNBOOK.md#auto-cordon-halted"
"#
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{JobEvent, JobRecord};
    use gangway_core::{JobId, JobSpec};
    use gangway_store::RedbStore;

    #[test]
    fn queue_waits_slos_and_the_policy_version_are_exported() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let cfg = ServerConfig::from_yaml(
            "admin_token: admin-secret\nagent_token: agent-secret\nqueues: [{ name: a }, { name: b }]\nslo_p95_wait_seconds: { a: 600 }\n",
        )
        .expect("config");
        let mut c = Control::open(store, &cfg.queues).expect("control");
        super::super::load_or_seed(&mut c, &cfg, 10_000).expect("seed");
        for (id, q, submit, start) in [
            (1, "a", 19_000, 19_900),
            (2, "a", 19_500, 19_600),
            (3, "b", 9_000, 9_500),
        ] {
            let mut r =
                JobRecord::submitted(JobId(id), "alice", JobSpec::new("j", q, 1, 1), submit);
            r.events.push(JobEvent {
                at: start,
                kind: "scheduled".into(),
                message: String::new(),
                count: 1,
                last_at: None,
            });
            c.jobs.insert(r.id, (r, 0));
        }
        let w = Watch::new();
        w.refresh(&cfg, &c, 20_000);
        let text = w.render();
        for line in [
            "gangway_queue_wait_p95_seconds{queue=\"a\"} 900",
            "gangway_queue_wait_p95_seconds{queue=\"b\"} 0",
            "gangway_queue_slo_p95_wait_seconds{queue=\"a\"} 600",
            "gangway_queue_wait_p95_before_change_seconds{queue=\"b\"} 500",
            "gangway_policy_version 1",
            "gangway_policy_changed_timestamp_seconds 10000",
        ] {
            assert!(text.contains(line), "{line:?} not in\n{text}");
        }
        assert!(!text.contains("# EOF"));
    }
}
