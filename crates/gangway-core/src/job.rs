//! Jobs: a job is a gang of replicas that starts whole or not at all.

pub use crate::id::JobId;
use crate::resources::Resources;
pub use crate::span::{format_time_span, parse_time_span, TimeSpan};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use thiserror::Error;

/// Priority classes, as Kueue's WorkloadPriorityClass or Slurm's QOS.
/// Higher classes are scheduled first and may preempt lower, preemptible ones.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
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
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
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
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema,
)]
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
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointPolicy {
    /// Seconds between the checkpoint signal and the kill.
    pub grace_seconds: u64,
    /// How often the job checkpoints on its own; used to estimate lost work.
    pub interval_seconds: Option<u64>,
    /// Signal sent to ask for a checkpoint.
    pub signal: String,
    /// The checkpoint directory, relative to the cluster's checkpoint root
    /// inside the owner's namespace (`<root>/<user>/<dir>`): a job resubmitted
    /// with the same `dir` (or `key`) resumes from it. Default: `job-<id>`.
    #[serde(alias = "key")]
    pub dir: Option<String>,
    /// Keep the directory after the job succeeds (it is removed otherwise).
    pub keep: bool,
}

impl Default for CheckpointPolicy {
    fn default() -> Self {
        CheckpointPolicy {
            grace_seconds: 30,
            interval_seconds: None,
            signal: "SIGTERM".to_string(),
            dir: None,
            keep: false,
        }
    }
}

/// Longest accepted `checkpoint.dir`, in bytes.
pub const MAX_CHECKPOINT_DIR_LEN: usize = 200;

/// Checks a user-chosen checkpoint directory: relative, no `..` or `.`
/// components, no empty components, at most [`MAX_CHECKPOINT_DIR_LEN`]
/// bytes of `[A-Za-z0-9._-]` and `/`. Returns why it is refused.
pub fn check_checkpoint_dir(dir: &str) -> Result<(), &'static str> {
    if dir.is_empty() {
        return Err("must not be empty when given");
    }
    if dir.len() > MAX_CHECKPOINT_DIR_LEN {
        return Err("longer than 200 characters");
    }
    if dir.starts_with('/') {
        return Err("must be relative to the cluster's checkpoint root");
    }
    let ok_chars = dir
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'));
    if !ok_chars {
        return Err("may contain only letters, digits, '.', '_', '-' and '/'");
    }
    for part in dir.split('/') {
        match part {
            "" => return Err("must not contain empty path components"),
            "." | ".." => return Err("must not contain '.' or '..' components"),
            _ => {}
        }
    }
    Ok(())
}

/// Longest accepted time limit: one year.
pub const MAX_TIME_LIMIT_SECONDS: u64 = 366 * 24 * 3600;

/// What happens when a rank or its node fails.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RestartPolicy {
    /// Attempts after the first before the job is failed.
    pub max_restarts: u32,
    /// First backoff in seconds; doubles with each restart.
    pub backoff_seconds: u64,
    /// Restart even when the attempt failed at start exactly as the one
    /// before (see [`START_FAILURE_SECONDS`]); by default such a job fails
    /// at once instead of spending its restarts on a missing import.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retry_start_failures: bool,
    /// Exit codes that fail the job at once, without a restart (a rank's
    /// way of saying "retrying cannot help", e.g. a missing dependency).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fail_on_exit_codes: Vec<i32>,
}

/// An attempt whose gang failed within this many seconds of its placement
/// failed "at start". When two attempts in a row fail at start with the
/// same exit code and the same last line of output, the job fails ("same
/// start failure twice") instead of restarting again, unless its restart
/// policy says `retry_start_failures: true`.
pub const START_FAILURE_SECONDS: u64 = 10;

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            max_restarts: 3,
            backoff_seconds: 10,
            retry_start_failures: false,
            fail_on_exit_codes: Vec::new(),
        }
    }
}

/// A data volume mounted into every rank (Docker bind mount; for the process
/// executor the source path is simply visible at its own path).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
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
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
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
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Human name; not required to be unique.
    pub name: String,
    /// Queue the job is charged to. Left out (empty), the server fills in
    /// the cluster's default queue at admission: the one marked default, or
    /// the only queue the user may submit to.
    #[serde(default)]
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
    /// Hard limit on one attempt's run time (Slurm's `--time`): seconds or
    /// `"HH:MM:SS"` / `"1h30m"`. At the limit the gang gets its checkpoint
    /// signal and grace, then ends as `timeout`. The queue's default applies
    /// when absent; its maximum bounds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_limit: Option<TimeSpan>,
    /// What the ranks run.
    #[serde(default)]
    pub run: RunSpec,
    /// Submit held (Slurm's `--hold`): it waits until `gangway release`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hold: bool,
    /// Earliest start (Slurm's `--begin`): epoch seconds, or `now+10m`,
    /// `+1h`, ISO 8601 UTC; stored as epoch seconds once submitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub begin: Option<crate::workflow::BeginAt>,
    /// Jobs it waits for (Slurm's `--dependency`): `afterok:ID[:ID..]`,
    /// `afterany:..`, `afternotok:..`, `singleton`, joined by `,`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dependency: Option<String>,
    /// A job array (Slurm's `--array`): `0-15%4`, `1,3,5-9`; the server
    /// submits one job per index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub array: Option<String>,
}

/// A structural problem with a job spec, found before looking at the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SpecError {
    /// The name field is empty.
    #[error("name: must not be empty")]
    EmptyName,
    /// A name or other short field holds a control character (see
    /// [`crate::text::is_unsafe`]): `name: control character U+001B is not allowed`.
    #[error("{0}")]
    ControlCharacter(String),
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
    /// A checkpoint directory that could escape its namespace.
    #[error("checkpoint.dir: {0:?} {1}")]
    BadCheckpointDir(String, &'static str),
    /// A time limit that is not a duration or is out of range.
    #[error("time_limit: {0}")]
    BadTimeLimit(String),
    /// A begin time that is not one.
    #[error("begin: {0}")]
    BadBegin(String),
    /// A dependency that does not parse.
    #[error("dependency: {0}")]
    BadDependency(String),
    /// An array specification that does not parse or is too large.
    #[error("array: {0}")]
    BadArray(String),
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
            time_limit: None,
            run: RunSpec::default(),
            hold: false,
            begin: None,
            dependency: None,
            array: None,
        }
    }

    /// The time limit in seconds (`None` when absent or invalid; `validate`
    /// refuses invalid ones).
    pub fn time_limit_seconds(&self) -> Option<u64> {
        self.time_limit.as_ref().and_then(|t| t.seconds().ok())
    }

    /// The run-time bound the scheduler plans with (backfill, reservations):
    /// the declared runtime, never more than the enforced time limit.
    pub fn runtime_bound(&self) -> Option<u64> {
        match (self.runtime_seconds, self.time_limit_seconds()) {
            (Some(r), Some(l)) => Some(r.min(l)),
            (r, l) => r.or(l),
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

    /// Refuses control characters in the fields shown as they are in
    /// tables and `describe` (names, queue, user, model, image, paths,
    /// array, dependency, begin, signal). `run.command` and `run.env` may
    /// hold any text (a shell script has newlines): they are escaped where
    /// shown. Checked where a spec comes in (submission, update), not in
    /// [`JobSpec::validate`]: a job stored before the rule must still load.
    pub fn check_printable(&self) -> Result<(), SpecError> {
        let mut fields: Vec<(String, &str)> = vec![
            ("name".into(), &self.name),
            ("queue".into(), &self.queue),
            ("user".into(), &self.user),
            ("checkpoint.signal".into(), &self.checkpoint.signal),
        ];
        for (f, v) in [
            ("resources.gpu_model", &self.resources.gpu_model),
            ("run.image", &self.run.image),
            ("run.workdir", &self.run.workdir),
            ("checkpoint.dir", &self.checkpoint.dir),
            ("dependency", &self.dependency),
            ("array", &self.array),
        ] {
            if let Some(v) = v {
                fields.push((f.into(), v));
            }
        }
        for (i, m) in self.run.mounts.iter().enumerate() {
            fields.push((format!("run.mounts[{i}].source"), &m.source));
            fields.push((format!("run.mounts[{i}].target"), &m.target));
        }
        for (f, v) in fields {
            crate::text::check_printable(&f, v).map_err(SpecError::ControlCharacter)?;
        }
        Ok(())
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
        if let Some(dir) = &self.checkpoint.dir {
            check_checkpoint_dir(dir)
                .map_err(|why| SpecError::BadCheckpointDir(dir.clone(), why))?;
        }
        if let Some(t) = &self.time_limit {
            let secs = t.seconds().map_err(SpecError::BadTimeLimit)?;
            if secs == 0 || secs > MAX_TIME_LIMIT_SECONDS {
                return Err(SpecError::BadTimeLimit(format!(
                    "{} must be between 1 second and 366 days",
                    format_time_span(secs)
                )));
            }
        }
        if let Some(b) = &self.begin {
            b.resolve(0).map_err(SpecError::BadBegin)?;
        }
        if let Some(d) = &self.dependency {
            crate::workflow::parse_dependency(d).map_err(SpecError::BadDependency)?;
        }
        if let Some(a) = &self.array {
            crate::workflow::parse_array(a).map_err(SpecError::BadArray)?;
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
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
    /// Reached its time limit and was stopped (after its checkpoint grace).
    Timeout,
}

impl JobState {
    /// Whether the job will never run again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::Failed | JobState::Cancelled | JobState::Timeout
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
    fn time_spans_parse_in_every_accepted_form_and_refuse_the_rest() {
        for (text, secs) in [
            ("90", 90),
            ("01:30:00", 5400),
            ("1:30:00", 5400),
            ("05:30", 330),
            ("2-00:00:00", 172_800),
            ("1-02:03:04", 93_784),
            ("1h30m", 5400),
            ("45m", 2700),
            ("2d", 172_800),
            ("1H15s", 3615),
        ] {
            assert_eq!(parse_time_span(text), Ok(secs), "{text}");
        }
        for text in [
            "",
            "abc",
            "1x",
            "h",
            "1:60:00",
            "1:00:60",
            "-1",
            "1.5h",
            "1-24:00:00",
        ] {
            assert!(parse_time_span(text).is_err(), "{text} accepted");
        }
        assert!(parse_time_span("99999999999999999999d").is_err());
        assert!(parse_time_span("999999999999999999d").is_err(), "overflow");
        assert_eq!(format_time_span(5400), "1:30:00");
        assert_eq!(format_time_span(93_784), "1-02:03:04");
    }

    #[test]
    fn time_limits_are_range_checked_and_bound_the_runtime_estimate() {
        let mut s = JobSpec::new("t", "q", 1, 1);
        s.time_limit = Some(TimeSpan::Text("1h".into()));
        assert_eq!(s.validate(), Ok(()));
        assert_eq!(s.runtime_bound(), Some(3600));
        s.runtime_seconds = Some(600);
        assert_eq!(s.runtime_bound(), Some(600));
        s.runtime_seconds = Some(7200);
        assert_eq!(s.runtime_bound(), Some(3600), "never past the limit");
        s.time_limit = Some(TimeSpan::Seconds(0));
        assert!(matches!(s.validate(), Err(SpecError::BadTimeLimit(_))));
        s.time_limit = Some(TimeSpan::Text("400d".into()));
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("time_limit:"));
        s.time_limit = Some(TimeSpan::Text("soon".into()));
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("time_limit:"));
        let json = r#"{"name":"a","queue":"q","replicas":1,"resources":{"gpus":1},"time_limit":"00:10:00"}"#;
        let s: JobSpec = serde_json::from_str(json).expect("spec");
        assert_eq!(s.time_limit_seconds(), Some(600));
        let json =
            r#"{"name":"a","queue":"q","replicas":1,"resources":{"gpus":1},"time_limit":75}"#;
        let s: JobSpec = serde_json::from_str(json).expect("spec");
        assert_eq!(s.time_limit_seconds(), Some(75));
    }

    #[test]
    fn control_characters_in_names_are_refused_naming_the_field() {
        for (name, code) in [
            ("evil\x1b]52;c;SGVsbG8=\x07", "001B"),
            ("a\rb", "000D"),
            ("a\nb", "000A"),
            ("a\tb", "0009"),
            ("a\u{7f}", "007F"),
            ("a\u{9b}31m", "009B"),
            ("abc\u{202e}fdp.exe", "202E"),
            ("a\u{2066}b", "2066"),
        ] {
            let s = JobSpec::new(name, "q", 1, 1);
            assert_eq!(
                s.check_printable().map_err(|e| e.to_string()),
                Err(format!("name: control character U+{code} is not allowed")),
                "{name:?}"
            );
        }
        let mut s = JobSpec::new("ok", "q\x1b", 1, 1);
        assert!(s
            .check_printable()
            .unwrap_err()
            .to_string()
            .starts_with("queue: control character"));
        s.queue = "q".into();
        s.run.image = Some("img\n".into());
        assert!(s
            .check_printable()
            .unwrap_err()
            .to_string()
            .starts_with("run.image: control"));
        s.run.image = None;
        s.run.mounts.push(Mount {
            source: "/d\x1b".into(),
            target: "/d".into(),
            read_only: true,
        });
        assert!(s
            .check_printable()
            .unwrap_err()
            .to_string()
            .starts_with("run.mounts[0].source: control"));
        // A shell script keeps its newlines, and names their Unicode.
        let mut s = JobSpec::new("résumé-训练", "q", 1, 1);
        s.run.command = vec!["sh".into(), "-c".into(), "a\nb\tc".into()];
        s.check_printable().expect("accepted");
    }

    #[test]
    fn checkpoint_dirs_cannot_leave_the_users_namespace() {
        for ok in ["run-1", "exp/a.b_c", "x"] {
            assert_eq!(check_checkpoint_dir(ok), Ok(()), "{ok}");
        }
        let long = "a".repeat(MAX_CHECKPOINT_DIR_LEN + 1);
        for bad in [
            "",
            "/abs",
            "../bob/run",
            "a/../../b",
            "a//b",
            "./a",
            "a/.",
            "a b",
            "a\\b",
            long.as_str(),
        ] {
            assert!(check_checkpoint_dir(bad).is_err(), "{bad:?} accepted");
        }
        let mut s = JobSpec::new("t", "q", 1, 1);
        s.checkpoint.dir = Some("../bob".into());
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .starts_with("checkpoint.dir:"));
        let json = r#"{"name":"a","queue":"q","replicas":1,"resources":{"gpus":1},"checkpoint":{"key":"llm/run7","keep":true}}"#;
        let s: JobSpec = serde_json::from_str(json).expect("spec");
        assert_eq!(s.checkpoint.dir.as_deref(), Some("llm/run7"));
        assert!(s.checkpoint.keep);
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
