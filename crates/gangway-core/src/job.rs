//! Jobs: a job is a gang of replicas that starts whole or not at all.

use crate::resources::Resources;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use thiserror::Error;

/// Cluster-unique job id, assigned at submission.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobId(pub u64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Priority classes, as Kueue's WorkloadPriorityClass or Slurm's QOS.
/// Higher classes are scheduled first and may preempt lower, preemptible ones.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum PriorityClass {
    /// Scavenger work that runs only on otherwise idle GPUs.
    BestEffort,
    /// Experiments that can wait.
    Low,
    /// The default.
    #[default]
    Normal,
    /// Deadlines.
    High,
    /// Production training and retraining.
    Production,
    /// Reserved for the platform itself.
    Critical,
}

impl PriorityClass {
    /// Numeric value; larger runs first.
    pub fn value(self) -> i32 {
        match self {
            PriorityClass::BestEffort => 0,
            PriorityClass::Low => 100,
            PriorityClass::Normal => 1_000,
            PriorityClass::High => 10_000,
            PriorityClass::Production => 100_000,
            PriorityClass::Critical => 1_000_000,
        }
    }

    /// Whether jobs of this class are preemptible when the spec does not say.
    pub fn preemptible_by_default(self) -> bool {
        self <= PriorityClass::Normal
    }
}

impl fmt::Display for PriorityClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PriorityClass::BestEffort => "best-effort",
            PriorityClass::Low => "low",
            PriorityClass::Normal => "normal",
            PriorityClass::High => "high",
            PriorityClass::Production => "production",
            PriorityClass::Critical => "critical",
        })
    }
}

/// What one replica (rank group on one node) needs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicaResources {
    /// Whole GPUs per replica, all on the same node.
    pub gpus: u32,
    /// Required GPU model (e.g. `H100`); any model when absent.
    pub gpu_model: Option<String>,
    /// Minimum memory per GPU in GiB.
    pub min_gpu_memory_gib: Option<u32>,
    /// CPU per replica in thousandths of a core.
    pub cpu_millis: u64,
    /// Memory per replica in MiB.
    pub memory_mib: u64,
}

impl ReplicaResources {
    /// The resource vector of one replica.
    pub fn resources(&self) -> Resources {
        Resources {
            gpus: u64::from(self.gpus),
            cpu_millis: self.cpu_millis,
            memory_mib: self.memory_mib,
        }
    }
}

/// Where the replicas of a gang must sit relative to each other.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TopologyConstraint {
    /// One node when the gang fits in one node, otherwise the fewest leaf switches.
    #[default]
    Auto,
    /// Every replica on one node (one NVLink domain); impossible if no node is big enough.
    Node,
    /// Every replica under one leaf switch / rack.
    Leaf,
    /// Anywhere; packing is still preferred.
    Any,
}

/// How a preempted job saves its work.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointPolicy {
    /// Seconds between the checkpoint signal and the kill.
    pub grace_seconds: u64,
    /// How often the job checkpoints on its own; used to estimate lost work.
    pub interval_seconds: Option<u64>,
    /// Signal sent to ask for a checkpoint.
    pub signal: String,
}

impl Default for CheckpointPolicy {
    fn default() -> Self {
        CheckpointPolicy {
            grace_seconds: 30,
            interval_seconds: None,
            signal: "SIGTERM".to_string(),
        }
    }
}

/// What happens when a rank or its node fails.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RestartPolicy {
    /// Attempts after the first before the job is failed.
    pub max_restarts: u32,
    /// First backoff in seconds; doubles with each restart.
    pub backoff_seconds: u64,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            max_restarts: 3,
            backoff_seconds: 10,
        }
    }
}

/// A data volume mounted into every rank (Docker bind mount; for the process
/// executor the source path is simply visible at its own path).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mount {
    /// Path on the node.
    pub source: String,
    /// Path inside the container.
    pub target: String,
    /// Mount read-only (datasets).
    #[serde(default)]
    pub read_only: bool,
}

/// What each rank runs: a command, optionally inside a container image.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunSpec {
    /// Program and arguments of every rank (`["python", "train.py"]`).
    pub command: Vec<String>,
    /// Container image; ranks run as plain processes when absent.
    pub image: Option<String>,
    /// Extra environment variables (Gangway's own variables win on conflict).
    pub env: BTreeMap<String, String>,
    /// Working directory; `gangway submit` fills in the submission directory, as `sbatch` does.
    pub workdir: Option<String>,
    /// Data mounts.
    pub mounts: Vec<Mount>,
}

/// A job as a user submits it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Human name; not required to be unique.
    pub name: String,
    /// Queue the job is charged to.
    pub queue: String,
    /// Submitting user.
    #[serde(default)]
    pub user: String,
    /// Number of replicas in the gang.
    pub replicas: u32,
    /// Elastic gangs may start with fewer replicas, never fewer than this.
    #[serde(default)]
    pub min_replicas: Option<u32>,
    /// What each replica needs.
    pub resources: ReplicaResources,
    /// Priority class.
    #[serde(default)]
    pub priority: PriorityClass,
    /// Whether the job may be preempted; the class decides when absent.
    #[serde(default)]
    pub preemptible: Option<bool>,
    /// Checkpoint signal, grace and interval.
    #[serde(default)]
    pub checkpoint: CheckpointPolicy,
    /// Restarts after failures.
    #[serde(default)]
    pub restart: RestartPolicy,
    /// Declared or estimated runtime in seconds; enables backfill around reservations.
    #[serde(default)]
    pub runtime_seconds: Option<u64>,
    /// Placement constraint across the topology.
    #[serde(default)]
    pub topology: TopologyConstraint,
    /// What the ranks run.
    #[serde(default)]
    pub run: RunSpec,
}

/// A structural problem with a job spec, found before looking at the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SpecError {
    /// The name field is empty.
    #[error("name: must not be empty")]
    EmptyName,
    /// The queue field is empty.
    #[error("queue: must not be empty")]
    EmptyQueue,
    /// Zero replicas.
    #[error("replicas: must be at least 1")]
    NoReplicas,
    /// min_replicas outside 1..=replicas.
    #[error("min_replicas: {min} must be between 1 and replicas ({replicas})")]
    BadMinReplicas {
        /// Given minimum.
        min: u32,
        /// Given replicas.
        replicas: u32,
    },
    /// A replica that asks for nothing.
    #[error("resources: a replica must request at least one GPU or some CPU")]
    EmptyReplica,
    /// Unreasonably large numbers.
    #[error("{field}: {value} exceeds the limit of {limit}")]
    TooLarge {
        /// Field path.
        field: &'static str,
        /// Given value.
        value: u64,
        /// Largest accepted value.
        limit: u64,
    },
    /// Empty model string.
    #[error("resources.gpu_model: must not be empty when given")]
    EmptyModel,
    /// A checkpoint signal Gangway does not know.
    #[error("checkpoint.signal: unknown signal {0:?} (use e.g. SIGTERM, SIGINT, SIGUSR1)")]
    BadSignal(String),
    /// A mount without an absolute path.
    #[error("run.mounts[{0}]: source and target must be absolute paths")]
    BadMount(usize),
    /// An environment variable name that is not one.
    #[error("run.env: {0:?} is not a valid variable name")]
    BadEnvName(String),
}

impl JobSpec {
    /// A minimal spec: `replicas` × `gpus` in `queue`, everything else default.
    pub fn new(name: &str, queue: &str, replicas: u32, gpus: u32) -> Self {
        JobSpec {
            name: name.to_string(),
            queue: queue.to_string(),
            user: String::new(),
            replicas,
            min_replicas: None,
            resources: ReplicaResources {
                gpus,
                ..Default::default()
            },
            priority: PriorityClass::Normal,
            preemptible: None,
            checkpoint: CheckpointPolicy::default(),
            restart: RestartPolicy::default(),
            runtime_seconds: None,
            topology: TopologyConstraint::Auto,
            run: RunSpec::default(),
        }
    }

    /// Whether the job may be preempted.
    pub fn is_preemptible(&self) -> bool {
        self.preemptible
            .unwrap_or_else(|| self.priority.preemptible_by_default())
    }

    /// The smallest gang the job may start with.
    pub fn min_gang(&self) -> u32 {
        self.min_replicas.unwrap_or(self.replicas)
    }

    /// Total GPUs of the full gang.
    pub fn total_gpus(&self) -> u64 {
        u64::from(self.replicas) * u64::from(self.resources.gpus)
    }

    /// Checks that do not need the cluster: counts, ranges, empty fields.
    pub fn validate(&self) -> Result<(), SpecError> {
        const MAX_REPLICAS: u64 = 100_000;
        const MAX_GPUS_PER_REPLICA: u64 = 64;
        if self.name.trim().is_empty() {
            return Err(SpecError::EmptyName);
        }
        if self.queue.trim().is_empty() {
            return Err(SpecError::EmptyQueue);
        }
        if self.replicas == 0 {
            return Err(SpecError::NoReplicas);
        }
        if u64::from(self.replicas) > MAX_REPLICAS {
            return Err(SpecError::TooLarge {
                field: "replicas",
                value: self.replicas.into(),
                limit: MAX_REPLICAS,
            });
        }
        if let Some(min) = self.min_replicas {
            if min == 0 || min > self.replicas {
                return Err(SpecError::BadMinReplicas {
                    min,
                    replicas: self.replicas,
                });
            }
        }
        let r = &self.resources;
        if u64::from(r.gpus) > MAX_GPUS_PER_REPLICA {
            return Err(SpecError::TooLarge {
                field: "resources.gpus",
                value: r.gpus.into(),
                limit: MAX_GPUS_PER_REPLICA,
            });
        }
        if r.gpus == 0 && r.cpu_millis == 0 {
            return Err(SpecError::EmptyReplica);
        }
        if r.gpu_model.as_deref().is_some_and(|m| m.trim().is_empty()) {
            return Err(SpecError::EmptyModel);
        }
        if signal_number(&self.checkpoint.signal).is_none() {
            return Err(SpecError::BadSignal(self.checkpoint.signal.clone()));
        }
        for (i, m) in self.run.mounts.iter().enumerate() {
            if !m.source.starts_with('/') || !m.target.starts_with('/') {
                return Err(SpecError::BadMount(i));
            }
        }
        for k in self.run.env.keys() {
            let ok = !k.is_empty()
                && !k.starts_with(|c: char| c.is_ascii_digit())
                && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !ok {
                return Err(SpecError::BadEnvName(k.clone()));
            }
        }
        Ok(())
    }
}

/// The POSIX number of a signal named like `SIGTERM`, `TERM` or `15`;
/// `None` for names Gangway does not deliver.
pub fn signal_number(name: &str) -> Option<i32> {
    let n = name.trim().to_ascii_uppercase();
    let n = n.strip_prefix("SIG").unwrap_or(&n);
    Some(match n {
        "HUP" | "1" => 1,
        "INT" | "2" => 2,
        "QUIT" | "3" => 3,
        "KILL" | "9" => 9,
        "USR1" | "10" => 10,
        "USR2" | "12" => 12,
        "TERM" | "15" => 15,
        _ => return None,
    })
}

/// The lifecycle of a job (see docs/ARCHITECTURE.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting for quota or GPUs.
    Pending,
    /// Quota admitted, waiting for placement.
    Admitted,
    /// GPUs bound; ranks being launched.
    Scheduled,
    /// All ranks running.
    Running,
    /// Checkpoint signal sent; grace period running.
    Preempting,
    /// Stopped by preemption; will run again from its checkpoint.
    Requeued,
    /// A rank or node failed; the whole gang restarts.
    Restarting,
    /// Every rank exited 0.
    Succeeded,
    /// Out of restarts, or rejected.
    Failed,
    /// Cancelled by a user or admin.
    Cancelled,
}

impl JobState {
    /// Whether the job will never run again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_field() {
        let mut s = JobSpec::new("train", "research", 0, 8);
        assert_eq!(s.validate(), Err(SpecError::NoReplicas));
        s.replicas = 4;
        s.min_replicas = Some(5);
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("min_replicas"));
        s.min_replicas = Some(2);
        assert_eq!(s.validate(), Ok(()));
        s.resources.gpus = 1000;
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("resources.gpus"));
    }

    #[test]
    fn spec_rejects_unknown_fields_and_defaults_the_rest() {
        let json = r#"{"name":"a","queue":"q","replicas":2,"resources":{"gpus":4}}"#;
        let s: JobSpec = serde_json::from_str(json).expect("valid spec");
        assert_eq!(s.priority, PriorityClass::Normal);
        assert!(s.is_preemptible());
        assert_eq!(s.min_gang(), 2);
        let bad = r#"{"name":"a","queue":"q","replicas":2,"resources":{"gpus":4},"gpuz":1}"#;
        assert!(serde_json::from_str::<JobSpec>(bad).is_err());
    }

    #[test]
    fn production_is_not_preemptible_by_default() {
        let mut s = JobSpec::new("retrain", "prod", 1, 8);
        s.priority = PriorityClass::Production;
        assert!(!s.is_preemptible());
        s.preemptible = Some(true);
        assert!(s.is_preemptible());
    }
}
