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
}

impl QueueSpec {
    /// A queue with a GPU quota and no other limits.
    pub fn gpus(name: &str, parent: Option<&str>, nominal: u64) -> Self {
        QueueSpec {
            name: name.to_string(),
            parent: parent.map(str::to_string),
            weight: 1,
            quota: Quota {
                nominal: ResourceLimits::gpus(nominal),
                ..Default::default()
            },
            allowed_priorities: Vec::new(),
            allow_non_preemptible: false,
            node: NodePolicy::default(),
            time_limit: QueueTimeLimits::default(),
        }
    }

    /// A queue with no quota of its own: it may use whatever its parent allows.
    pub fn unlimited(name: &str, parent: Option<&str>) -> Self {
        QueueSpec {
            name: name.to_string(),
            parent: parent.map(str::to_string),
            weight: 1,
            quota: Quota::default(),
            allowed_priorities: Vec::new(),
            allow_non_preemptible: false,
            node: NodePolicy::default(),
            time_limit: QueueTimeLimits::default(),
        }
    }
}
