//! Queues and quotas: a tree of queues (organisation → team → sub-team), each
//! with a nominal quota, a borrowing limit and a lending limit, as Kueue's
//! ClusterQueues in cohorts and Volcano's hierarchical queues.

use crate::job::PriorityClass;
use crate::job::TimeSpan;
use crate::node_policy::NodePolicy;
use crate::resources::{Resource, Resources};
use serde::{Deserialize, Serialize};

/// Per-resource limits; `None` for a resource means "not limited here".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResourceLimits {
    /// Whole GPUs.
    pub gpus: Option<u64>,
    /// CPU in thousandths of a core.
    pub cpu_millis: Option<u64>,
    /// Memory in MiB.
    pub memory_mib: Option<u64>,
}

impl ResourceLimits {
    /// Only GPUs limited.
    pub fn gpus(n: u64) -> Self {
        ResourceLimits {
            gpus: Some(n),
            ..Default::default()
        }
    }

    /// The limit for one resource.
    pub fn get(&self, r: Resource) -> Option<u64> {
        match r {
            Resource::Gpus => self.gpus,
            Resource::CpuMillis => self.cpu_millis,
            Resource::MemoryMib => self.memory_mib,
        }
    }

    /// Every resource limited to the amounts in `r`.
    pub fn all(r: Resources) -> Self {
        ResourceLimits {
            gpus: Some(r.gpus),
            cpu_millis: Some(r.cpu_millis),
            memory_mib: Some(r.memory_mib),
        }
    }
}

/// A queue's share of the cluster.
///
/// - `nominal`: guaranteed; when others borrow it, it is reclaimed on demand.
///   A resource without a nominal value is not quota-managed at this queue.
/// - `borrowing_limit`: how far above nominal the queue may go by borrowing
///   idle quota of its siblings (`None`: no limit beyond what is idle).
/// - `lending_limit`: how much of its unused nominal others may borrow
///   (`None`: all of it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Quota {
    /// Guaranteed amounts.
    pub nominal: ResourceLimits,
    /// Most that may be borrowed above nominal.
    pub borrowing_limit: ResourceLimits,
    /// Most of the unused nominal that may be lent.
    pub lending_limit: ResourceLimits,
}

/// A queue as an admin declares it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueSpec {
    /// Unique name.
    pub name: String,
    /// Parent queue (cohort); top-level queues share the whole cluster.
    #[serde(default)]
    pub parent: Option<String>,
    /// Fair-share weight (DRF shares are divided by it).
    #[serde(default = "one")]
    pub weight: u32,
    /// Jobs whose spec names no queue go here (at most one queue is marked).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub default: bool,
    /// Quota.
    #[serde(default)]
    pub quota: Quota,
    /// Priority classes plain users may submit here; empty means every class
    /// but `critical` (admins may use any class anywhere).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_priorities: Vec<PriorityClass>,
    /// Whether plain users may submit jobs that are not preemptible here
    /// (`preemptible: false`, or a class that is not preemptible by default).
    #[serde(default)]
    pub allow_non_preemptible: bool,
    /// What its ranks may do on the nodes (root, host network, mounts, loader variables).
    #[serde(default)]
    pub node: NodePolicy,
    /// Time limits of the queue's jobs.
    #[serde(default)]
    pub time_limit: QueueTimeLimits,
    /// How its jobs are ordered inside it (`ranked`, the default, or `fifo`).
    #[serde(default, skip_serializing_if = "QueueOrdering::is_ranked")]
    pub ordering: QueueOrdering,
    /// A job of this queue that has run less than this in its attempt is not
    /// a preemption victim (seconds, at most [`MAX_MIN_RUN_SECONDS`]);
    /// `None`: the scheduler's `min_run_seconds`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_run_seconds: Option<u64>,
    /// A job of this queue preempted this many times is no longer a victim
    /// (at most [`MAX_PREEMPTION_BUDGET`]); `None`: the scheduler's
    /// `preemption_budget`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preemption_budget: Option<u32>,
}

/// Longest minimum run time before a job may be preempted: 7 days.
pub const MAX_MIN_RUN_SECONDS: u64 = 7 * 86_400;

/// Largest preemption budget.
pub const MAX_PREEMPTION_BUDGET: u32 = 1000;

/// How a queue orders its own pending jobs (between queues, priority and
/// fair share decide as always).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueOrdering {
    /// Gangway's ranking: attained-service band, predicted remaining work,
    /// aging (`gangway_sched::rank`).
    #[default]
    Ranked,
    /// Priority class, then submission order: no band, no prediction.
    Fifo,
}

impl QueueOrdering {
    /// Whether it is the default (`ranked`): left out when written.
    pub fn is_ranked(&self) -> bool {
        *self == QueueOrdering::Ranked
    }
}

/// A queue's time limits (Slurm partitions' `DefaultTime` and `MaxTime`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueTimeLimits {
    /// Given to jobs that set no `time_limit`.
    pub default: Option<TimeSpan>,
    /// Largest `time_limit` a job may ask for (also bounds the default).
    pub max: Option<TimeSpan>,
}

fn one() -> u32 {
    1
}

impl QueueSpec {
    /// Whether a plain user may submit a job of class `p` to this queue.
    pub fn allows_priority(&self, p: PriorityClass) -> bool {
        if self.allowed_priorities.is_empty() {
            p != PriorityClass::Critical
        } else {
            self.allowed_priorities.contains(&p)
        }
    }

    /// Range checks of its preemption rules, naming the field
    /// (`min_run_seconds: ...`), for callers to prefix with the queue.
    pub fn check_preemption_rules(&self) -> Result<(), String> {
        if let Some(m) = self.min_run_seconds {
            if m > MAX_MIN_RUN_SECONDS {
                return Err(format!(
                    "min_run_seconds: {m} is out of range (0 to {MAX_MIN_RUN_SECONDS})"
                ));
            }
        }
        if let Some(b) = self.preemption_budget {
            if b > MAX_PREEMPTION_BUDGET {
                return Err(format!(
                    "preemption_budget: {b} is out of range (0 to {MAX_PREEMPTION_BUDGET})"
                ));
            }
        }
        Ok(())
    }
}

impl QueueSpec {
    /// A queue with a GPU quota and no other limits.
    pub fn gpus(name: &str, parent: Option<&str>, nominal: u64) -> Self {
        QueueSpec {
            name: name.to_string(),
            parent: parent.map(str::to_string),
            weight: 1,
            default: false,
            quota: Quota {
                nominal: ResourceLimits::gpus(nominal),
                ..Default::default()
            },
            allowed_priorities: Vec::new(),
            allow_non_preemptible: false,
            node: NodePolicy::default(),
            time_limit: QueueTimeLimits::default(),
            ordering: QueueOrdering::Ranked,
            min_run_seconds: None,
            preemption_budget: None,
        }
    }

    /// A queue with no quota of its own: it may use whatever its parent allows.
    pub fn unlimited(name: &str, parent: Option<&str>) -> Self {
        QueueSpec {
            name: name.to_string(),
            parent: parent.map(str::to_string),
            weight: 1,
            default: false,
            quota: Quota::default(),
            allowed_priorities: Vec::new(),
            allow_non_preemptible: false,
            node: NodePolicy::default(),
            time_limit: QueueTimeLimits::default(),
            ordering: QueueOrdering::Ranked,
            min_run_seconds: None,
            preemption_budget: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_queues_read_ranked_with_the_schedulers_preemption_rules_and_write_unchanged() {
        let old = r#"{"name":"q","weight":1}"#;
        let q: QueueSpec = serde_json::from_str(old).expect("old spec");
        assert_eq!(q.ordering, QueueOrdering::Ranked);
        assert_eq!((q.min_run_seconds, q.preemption_budget), (None, None));
        let v = serde_json::to_value(&q).expect("json");
        for k in ["ordering", "min_run_seconds", "preemption_budget"] {
            assert!(v.get(k).is_none(), "{k} written for a default");
        }
        let new = r#"{"name":"q","ordering":"fifo","min_run_seconds":600,"preemption_budget":2}"#;
        let q: QueueSpec = serde_json::from_str(new).expect("new spec");
        assert_eq!(q.ordering, QueueOrdering::Fifo);
        assert_eq!(
            (q.min_run_seconds, q.preemption_budget),
            (Some(600), Some(2))
        );
        assert!(serde_json::from_str::<QueueSpec>(r#"{"name":"q","ordering":"lifo"}"#).is_err());
    }

    #[test]
    fn preemption_rules_out_of_range_are_refused_with_the_field_named() {
        let mut q = QueueSpec::unlimited("q", None);
        q.min_run_seconds = Some(MAX_MIN_RUN_SECONDS);
        q.preemption_budget = Some(MAX_PREEMPTION_BUDGET);
        assert_eq!(q.check_preemption_rules(), Ok(()));
        q.min_run_seconds = Some(MAX_MIN_RUN_SECONDS + 1);
        let e = q.check_preemption_rules().expect_err("min run");
        assert!(e.starts_with("min_run_seconds: 604801"), "{e}");
        q.min_run_seconds = None;
        q.preemption_budget = Some(MAX_PREEMPTION_BUDGET + 1);
        let e = q.check_preemption_rules().expect_err("budget");
        assert!(e.starts_with("preemption_budget: 1001"), "{e}");
    }
}
