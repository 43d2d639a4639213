//! The agent protocol: what a node agent reports on each sync and the
//! assignments (desired state) the server answers with, kubelet-style.

use crate::job::{JobId, RunSpec};
use crate::node_policy::NodePolicy;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The HTTP header in which an agent states its version on every request
/// (`gangway-agent-version: 0.1.0`); the server answers a registration with
/// its own as `server_version`. Each side refuses the other when they are
/// further apart than [`check_skew`] allows (docs/RUNBOOK.md, "Version skew").
pub const VERSION_HEADER: &str = "gangway-agent-version";

/// This build's version: the protocol changes only with it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The version of a peer that does not state one: agents and servers from
/// before the header were 0.1.
pub const UNSTATED_VERSION: Version = Version {
    major: 0,
    minor: 1,
    patch: 0,
};

/// A `MAJOR.MINOR.PATCH` version (a `-pre` or `+build` suffix is ignored).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    /// Major: a change that may break the other side.
    pub major: u64,
    /// Minor: compatible additions only (one minor apart interoperate).
    pub minor: u64,
    /// Patch.
    pub patch: u64,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Why two versions do not interoperate, or a version that does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SkewError {
    /// Not `MAJOR.MINOR.PATCH`.
    #[error("version {0:?} is not MAJOR.MINOR.PATCH")]
    Malformed(String),
    /// Further apart than one minor version (or another major).
    #[error("agent version {agent} and server version {server} are too far apart: the version-skew policy lets a server and its agents be one minor version apart within a major version (docs/RUNBOOK.md, Version skew); upgrade servers first, then agents, one minor version at a time")]
    TooFar {
        /// The server's version.
        server: Version,
        /// The agent's version.
        agent: Version,
    },
}

impl std::str::FromStr for Version {
    type Err = SkewError;

    fn from_str(s: &str) -> Result<Self, SkewError> {
        let bad = || SkewError::Malformed(s.chars().take(64).collect());
        if s.len() > 64 {
            return Err(bad());
        }
        let core = s.split(['-', '+']).next().unwrap_or_default();
        let mut parts = core.split('.');
        let mut next = || -> Result<u64, SkewError> {
            let p = parts.next().ok_or_else(bad)?;
            if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            p.parse().map_err(|_| bad())
        };
        let v = Version {
            major: next()?,
            minor: next()?,
            patch: next()?,
        };
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(v)
    }
}

impl Version {
    /// This build's version ([`VERSION`]).
    pub fn current() -> Version {
        VERSION.parse().unwrap_or(UNSTATED_VERSION)
    }
}

/// The version-skew rule: a server and an agent interoperate when they have
/// the same major version and their minor versions differ by at most one
/// (either way round; patches never matter).
pub fn check_skew(server: Version, agent: Version) -> Result<(), SkewError> {
    if server.major == agent.major && server.minor.abs_diff(agent.minor) <= 1 {
        Ok(())
    } else {
        Err(SkewError::TooFar { server, agent })
    }
}

/// Health of one GPU as the agent sees it (NVML or its declared inventory).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GpuHealth {
    /// Device index.
    pub index: u32,
    /// Whether it may be assigned.
    pub healthy: bool,
    /// Why not (an XID error, an ECC count, an operator's mark).
    #[serde(default)]
    pub reason: Option<String>,
}

/// What the ranks of one job attempt on this node are doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum TaskState {
    /// Every rank of the attempt on this node has started.
    Running,
    /// A rank's main process exited non-zero (the code) while processes of
    /// the attempt still run here: the gang must be stopped, but its GPUs
    /// are not free yet.
    Failing {
        /// Exit code; 128+N for a rank killed by signal N.
        exit_code: i32,
    },
    /// No process of the attempt is left on this node: the first non-zero
    /// exit code of its ranks, or 0 when all exited 0.
    Exited {
        /// Exit code; 128+N for a rank killed by signal N.
        exit_code: i32,
    },
}

/// One job attempt's status on the reporting node (serde's `flatten` rules
/// out `deny_unknown_fields` here).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TaskReport {
    /// Job.
    pub job: JobId,
    /// Which attempt (restarts and requeues start a new one).
    pub attempt: u32,
    /// What its ranks here do.
    #[serde(flatten)]
    pub state: TaskState,
    /// The newest checkpoint the ranks announced in
    /// `$GANGWAY_CHECKPOINT_DIR/LATEST`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointReport>,
    /// The first rank on this node that failed, when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<RankFailure>,
    /// The rendezvous port could not be bound on rank 0's node: the ranks
    /// were not started and the server must choose another port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_busy: Option<u16>,
    /// Who holds that port, when the node could tell: `job 7 (alice) rank
    /// 0, pid 1234` or `process nc (uid 0), pid 1234`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_holder: Option<String>,
    /// What the node found wrong with the ranks' setup that does not stop
    /// them (a `PATH` entry their account cannot search): job events.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

impl TaskReport {
    /// A report with nothing but the state.
    pub fn new(job: JobId, attempt: u32, state: TaskState) -> Self {
        TaskReport {
            job,
            attempt,
            state,
            checkpoint: None,
            failure: None,
            port_busy: None,
            port_holder: None,
            warnings: Vec::new(),
        }
    }
}

/// A checkpoint as a rank announced it: the contents of
/// `$GANGWAY_CHECKPOINT_DIR/LATEST` (`{"step": N, "path": "..."}`), the path
/// made absolute, and when the file was written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointReport {
    /// Training step the checkpoint holds.
    pub step: u64,
    /// Where it is (absolute; a relative `path` is taken from the checkpoint dir).
    pub path: String,
    /// When `LATEST` was written, milliseconds since the epoch (its mtime).
    pub written_ms: u64,
}

/// Why a rank failed, as its node saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RankFailure {
    /// Global rank.
    pub rank: u32,
    /// Exit code; 128+N when killed by signal N.
    pub exit_code: i32,
    /// The signal that killed it, when one did.
    #[serde(default)]
    pub signal: Option<i32>,
    /// Whether the kernel's OOM killer ended it (when the agent can tell:
    /// a memory cgroup's `oom_kill` count; `false` when unknown).
    #[serde(default)]
    pub oom_killed: bool,
    /// The last lines of its log.
    #[serde(default)]
    pub log_tail: Vec<String>,
    /// The agent could not start or stop the rank for a reason outside the
    /// job (its container, log or cgroup could not be made; processes it
    /// could not kill): the node's fault, held against it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_fault: Option<String>,
    /// The limit that stopped it and the value reached, when one did
    /// (`memory limit 2.9 GiB reached (OOM-killed)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// Its exit code is unknown: its supervisor was lost (killed with the
    /// agent) before the rank ended, and `exit_code` is a stand-in.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unknown_exit: bool,
}

/// The body of `POST /v1/agent/{node}/sync`: heartbeat, GPU health and task states.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SyncRequest {
    /// Every GPU's health.
    pub gpus: Vec<GpuHealth>,
    /// Every job attempt the agent knows of.
    pub tasks: Vec<TaskReport>,
    /// Set while a filesystem of the node runs out of space: the node takes
    /// no new work (why, with the figures).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk_pressure: Option<String>,
    /// The agent has a health check configured (`--health-check`): the
    /// server may ask it to run it to return an auto-cordoned node to
    /// service. Sent only when true, so an agent without one sends what
    /// older agents sent.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub health_check: bool,
    /// The health check run the server asked for: running, or its result.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_check_run: Option<HealthCheckReport>,
    /// The agent reads [`Assignment::rendezvous_ports`] (and keeps ranks off
    /// the range): the server sends the range only to agents that say so, so
    /// an older agent, which refuses unknown fields, never receives it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reads_rendezvous_ports: bool,
    /// The agent reads [`Assignment::nodes`] (`GANGWAY_NODELIST` and the
    /// hostfiles): sent to such agents only, as with the rendezvous range.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reads_gang_nodes: bool,
}

/// One run of the node's own health check, as its agent reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HealthCheckReport {
    /// The run the server asked for ([`SyncResponse::health_check`]).
    pub run: u64,
    /// How it ended; absent while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<HealthCheckResult>,
}

/// How a health check run ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HealthCheckResult {
    /// Its exit code (0: passed); 128+N when killed by signal N, 124 when
    /// killed at its timeout, 127 when it could not be started.
    pub exit_code: i32,
    /// The last lines of its output (stdout and stderr), bounded; for a
    /// timeout or a failed start, the last says so.
    #[serde(default)]
    pub tail: Vec<String>,
}

impl HealthCheckResult {
    /// Whether the node passed.
    pub fn passed(&self) -> bool {
        self.exit_code == 0
    }

    /// The last non-empty line of its output ("" when there was none).
    pub fn last_line(&self) -> &str {
        self.tail
            .iter()
            .rev()
            .map(|l| l.trim())
            .find(|l| !l.is_empty())
            .unwrap_or("")
    }
}

/// One rank to run on this node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RankAssignment {
    /// Global rank (`RANK`).
    pub rank: u32,
    /// Rank among this job's ranks on this node (`LOCAL_RANK`).
    pub local_rank: u32,
    /// Device indices on this node (`CUDA_VISIBLE_DEVICES`).
    pub gpus: Vec<u32>,
}

/// One job attempt the node should run (or, with `stop`, checkpoint and stop).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Assignment {
    /// Job.
    pub job: JobId,
    /// Attempt; ranks of any other attempt of this job must not run.
    pub attempt: u32,
    /// Job name (for people).
    pub name: String,
    /// Owner.
    pub user: String,
    /// What to run.
    pub run: RunSpec,
    /// This node's ranks.
    pub ranks: Vec<RankAssignment>,
    /// Ranks in the whole gang (`WORLD_SIZE`).
    pub world_size: u32,
    /// Index of this node among the gang's nodes (`NODE_RANK`).
    pub node_rank: u32,
    /// Nodes in the gang (`NNODES`).
    pub nnodes: u32,
    /// Address of rank 0's node (`MASTER_ADDR`).
    pub master_addr: String,
    /// Rendezvous port on it (`MASTER_PORT`).
    pub master_port: u16,
    /// CPU per rank in thousandths of a core (a limit for containers).
    pub cpu_millis: u64,
    /// Memory per rank in MiB (a limit for containers).
    pub memory_mib: u64,
    /// Signal that asks a rank to checkpoint (POSIX number).
    pub checkpoint_signal: i32,
    /// Seconds between that signal and the kill.
    pub grace_seconds: u64,
    /// Checkpoint now and stop: the job is being preempted.
    pub stop: bool,
    /// Who the ranks run as and what they may do on the node.
    #[serde(default)]
    pub rules: RankRules,
    /// A checkpoint was reported after the signal: kill the ranks now
    /// instead of waiting out the grace.
    #[serde(default)]
    pub stop_now: bool,
    /// The cluster-wide checkpoint root, when the server configures one;
    /// else the agent's own `--checkpoint-root`.
    #[serde(default)]
    pub checkpoint_root: Option<String>,
    /// The job's checkpoint directory under the root: `<user>/<dir>` or
    /// `<user>/job-<id>` (`GANGWAY_CHECKPOINT_DIR`).
    #[serde(default)]
    pub checkpoint_subdir: String,
    /// The last checkpoint the job reported (`GANGWAY_RESUME_FROM`).
    #[serde(default)]
    pub resume_from: Option<String>,
    /// Restarts the job is allowed (`TORCHELASTIC_MAX_RESTARTS`).
    #[serde(default)]
    pub max_restarts: u32,
    /// The array task this job is, if it is one (`GANGWAY_ARRAY_TASK_ID`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub array: Option<crate::workflow::ArrayTask>,
    /// Restarts and requeues so far (`TORCHELASTIC_RESTART_COUNT`): the
    /// attempt less the rendezvous port moves, which start a new attempt
    /// without anything having run. `None` (an older server): the attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_count: Option<u32>,
    /// The cluster's rendezvous port range: the node lets no rank bind a
    /// port of it but its own job's `master_port` (rank 0). `None` (an
    /// older server): the node only detects a port held by someone else.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rendezvous_ports: Option<PortRange>,
    /// The gang's nodes in node-rank order, each with how many of the
    /// job's ranks it runs (`GANGWAY_NODELIST`, the hostfiles). Empty (an
    /// older server, or an agent that does not read it): not set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<GangNode>,
}

/// One node of a gang, as its ranks' launchers see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GangNode {
    /// Its address (the node's advertised address, else its name).
    pub host: String,
    /// The job's ranks on it (a hostfile's `slots`).
    pub slots: u32,
}

/// The longest `GANGWAY_NODELIST` set: one environment string may be at
/// most 128 KiB on Linux (`MAX_ARG_STRLEN`); past this bound only the
/// hostfiles list the nodes.
pub const MAX_NODELIST_BYTES: usize = 64 * 1024;

/// The largest hostfile the agent writes (about 10,000 nodes of 100-byte
/// addresses); past it no hostfile is written.
pub const MAX_HOSTFILE_BYTES: usize = 1024 * 1024;

/// Whether `host` may go into a node list or hostfile as it is: letters,
/// digits, `.`, `-`, `_` and `:` (IPv6), at most 253 bytes. Anything else
/// (a space or newline would add a line to every hostfile of the gang)
/// leaves the whole list out.
pub fn is_plain_host(host: &str) -> bool {
    !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':'))
}

/// `GANGWAY_NODELIST`: the gang's hosts, comma-separated in node-rank order;
/// `None` when there are none, one is not [`is_plain_host`], or the list
/// is longer than [`MAX_NODELIST_BYTES`].
pub fn nodelist(nodes: &[GangNode]) -> Option<String> {
    if nodes.is_empty() || !nodes.iter().all(|n| is_plain_host(&n.host)) {
        return None;
    }
    let list = nodes
        .iter()
        .map(|n| n.host.as_str())
        .collect::<Vec<_>>()
        .join(",");
    (list.len() <= MAX_NODELIST_BYTES).then_some(list)
}

/// A hostfile's text in one of the formats launchers read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostfileFormat {
    /// `host slots=N` (Open MPI's `--hostfile`, DeepSpeed's `--hostfile`).
    OpenMpi,
    /// `host:N` (MPICH/Hydra's `-f`, Intel MPI's `-machinefile`).
    Mpich,
}

/// The hostfile for `nodes` in `format`, a line per node in node-rank
/// order; `None` as for [`nodelist`] or past [`MAX_HOSTFILE_BYTES`].
pub fn hostfile(nodes: &[GangNode], format: HostfileFormat) -> Option<String> {
    if nodes.is_empty() || !nodes.iter().all(|n| is_plain_host(&n.host)) {
        return None;
    }
    let mut out = String::new();
    for n in nodes {
        match format {
            HostfileFormat::OpenMpi => out.push_str(&format!("{} slots={}\n", n.host, n.slots)),
            HostfileFormat::Mpich => out.push_str(&format!("{}:{}\n", n.host, n.slots)),
        }
        if out.len() > MAX_HOSTFILE_BYTES {
            return None;
        }
    }
    Some(out)
}

/// Who a job's ranks run as and what its queue lets them do on the node; the
/// server fills it in and the agent enforces it again before starting a rank.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RankRules {
    /// Unix account the ranks run as (the owner's `unix_user`); the owner's
    /// name when absent.
    pub run_as: Option<String>,
    /// The job's queue (named in refusals).
    pub queue: String,
    /// The queue's node policy.
    pub policy: NodePolicy,
}

/// The answer to a sync: the whole desired state of the node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SyncResponse {
    /// Everything that should run here; anything else must not.
    pub assignments: Vec<Assignment>,
    /// Checkpoint directories of succeeded jobs to remove (no `keep`).
    pub cleanup: Vec<CheckpointCleanup>,
    /// Run the node's own health check (the agent's `--health-check`) once
    /// as this run, and report it in later syncs while this stays set; when
    /// it is no longer set, stop a run still going. Only sent to agents that
    /// say they have a check.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_check: Option<u64>,
}

/// A checkpoint directory to remove from this node's view of the root.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointCleanup {
    /// Job whose directory it was.
    pub job: JobId,
    /// Root (`None`: the agent's own).
    #[serde(default)]
    pub root: Option<String>,
    /// Directory under the root (validated: relative, no `..`).
    pub subdir: String,
}

/// A page of a rank's log, as the agent serves it and the server relays it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LogChunk {
    /// Text (invalid UTF-8 replaced).
    pub data: String,
    /// Byte offset to ask for next.
    pub next_offset: u64,
    /// Bytes between the offset asked for and this chunk's start that log
    /// rotation dropped (older lines no longer kept).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dropped: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Name of the role every rank has (torchrun's default role).
pub const ROLE_NAME: &str = "default";

/// The launcher contract of one rank: the variables torchrun gives its
/// workers (docs/JOB_ENV.md lists each with its torchrun meaning), Gangway's
/// own `GANGWAY_*` and `CUDA_VISIBLE_DEVICES`. Gangway's variables win over
/// the job's `run.env`, except `OMP_NUM_THREADS`, which the job may set (as
/// with torchrun). The node-local `GANGWAY_CHECKPOINT_DIR`, `GANGWAY_NODE`
/// and `GANGWAY_RESUME_FROM` come from [`node_env`].
pub fn rank_env(a: &Assignment, r: &RankAssignment) -> BTreeMap<String, String> {
    let mut env = a.run.env.clone();
    let local_world = a.ranks.len();
    let omp = (a.cpu_millis / 1000).max(1);
    env.entry("OMP_NUM_THREADS".to_string())
        .or_insert_with(|| omp.to_string());
    let devices = r
        .gpus
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    for (k, v) in [
        ("MASTER_ADDR", a.master_addr.clone()),
        ("MASTER_PORT", a.master_port.to_string()),
        ("WORLD_SIZE", a.world_size.to_string()),
        ("RANK", r.rank.to_string()),
        ("LOCAL_RANK", r.local_rank.to_string()),
        ("LOCAL_WORLD_SIZE", local_world.to_string()),
        ("NODE_RANK", a.node_rank.to_string()),
        ("GROUP_RANK", a.node_rank.to_string()),
        ("GROUP_WORLD_SIZE", a.nnodes.to_string()),
        ("NNODES", a.nnodes.to_string()),
        ("ROLE_NAME", ROLE_NAME.to_string()),
        ("ROLE_RANK", r.rank.to_string()),
        ("ROLE_WORLD_SIZE", a.world_size.to_string()),
        (
            "TORCHELASTIC_RESTART_COUNT",
            a.restart_count.unwrap_or(a.attempt).to_string(),
        ),
        ("TORCHELASTIC_MAX_RESTARTS", a.max_restarts.to_string()),
        ("TORCHELASTIC_RUN_ID", format!("gangway-job-{}", a.job)),
        ("CUDA_VISIBLE_DEVICES", devices),
        ("GANGWAY_JOB_ID", a.job.to_string()),
        ("GANGWAY_JOB_NAME", a.name.clone()),
        ("GANGWAY_ATTEMPT", a.attempt.to_string()),
    ] {
        env.insert(k.to_string(), v);
    }
    if let Some(t) = &a.array {
        // Slurm's names too, so array scripts written for sbatch keep working.
        for k in ["GANGWAY_ARRAY_JOB_ID", "SLURM_ARRAY_JOB_ID"] {
            env.insert(k.to_string(), t.job.to_string());
        }
        for k in [
            "GANGWAY_ARRAY_TASK_ID",
            "GANGWAY_ARRAY_INDEX",
            "SLURM_ARRAY_TASK_ID",
        ] {
            env.insert(k.to_string(), t.index.to_string());
        }
        env.insert("GANGWAY_ARRAY_TASK_COUNT".into(), t.count.to_string());
        env.insert("SLURM_ARRAY_TASK_COUNT".into(), t.count.to_string());
    }
    if let Some(list) = nodelist(&a.nodes) {
        env.insert("GANGWAY_NODELIST".into(), list);
    }
    env
}

/// Adds the node-local part of the contract: the node's name, the job's
/// checkpoint directory on it and, when there is one, the checkpoint to
/// resume from.
pub fn node_env(
    env: &mut BTreeMap<String, String>,
    node: &str,
    checkpoint_dir: &str,
    resume_from: Option<&str>,
) {
    env.insert("GANGWAY_NODE".into(), node.to_string());
    env.insert("GANGWAY_CHECKPOINT_DIR".into(), checkpoint_dir.to_string());
    match resume_from {
        Some(p) => env.insert("GANGWAY_RESUME_FROM".into(), p.to_string()),
        None => env.remove("GANGWAY_RESUME_FROM"),
    };
}

/// One path component for a user name: letters, digits, `.`, `_` and `-`
/// kept, anything else as `%XX`, so distinct names stay distinct and none
/// is `.`, `..` or contains `/`.
pub fn user_dir(user: &str) -> String {
    let mut out = String::new();
    for b in user.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (b == b'.' && !out.is_empty()) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    if out.is_empty() {
        out.push_str("%00");
    }
    out
}

/// A job's checkpoint directory under the root: `<user>/<checkpoint.dir>`,
/// or `<user>/job-<id>` when the spec names none. Only the owner's jobs can
/// name a directory in the owner's namespace.
pub fn checkpoint_subdir(user: &str, job: JobId, dir: Option<&str>) -> String {
    match dir {
        Some(d) => format!("{}/{d}", user_dir(user)),
        None => format!("{}/job-{job}", user_dir(user)),
    }
}

/// A range of rendezvous ports, inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PortRange {
    /// First port.
    pub first: u16,
    /// Last port.
    pub last: u16,
}

impl Default for PortRange {
    /// 29400–32767: below Linux's default ephemeral range (32768–60999),
    /// starting at torchrun's customary 29400.
    fn default() -> Self {
        PortRange {
            first: 29_400,
            last: 32_767,
        }
    }
}

impl PortRange {
    /// Number of ports.
    pub fn len(&self) -> u32 {
        if self.is_empty() {
            return 0;
        }
        u32::from(self.last) - u32::from(self.first) + 1
    }

    /// Whether the range is empty (`last < first`).
    pub fn is_empty(&self) -> bool {
        self.last < self.first
    }

    /// A rendezvous port for a job attempt that `used` does not hold:
    /// starts at a spot derived from job and attempt (so a restart does not
    /// meet the previous attempt's lingering sockets) and walks the range.
    /// `None` when every port is taken.
    pub fn pick(&self, job: JobId, attempt: u32, used: &dyn Fn(u16) -> bool) -> Option<u16> {
        if self.is_empty() {
            return None;
        }
        let n = u64::from(self.len());
        let start = job
            .0
            .wrapping_mul(7)
            .wrapping_add(u64::from(attempt).wrapping_mul(13))
            % n;
        (0..n)
            .map(|i| u32::from(self.first) + ((start + i) % n) as u32)
            .filter_map(|p| u16::try_from(p).ok())
            .find(|p| !used(*p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_one_minor_apart_interoperate_and_no_further() {
        let v = |s: &str| s.parse::<Version>().expect(s);
        assert_eq!(v("1.4.2-rc.1+abc"), v("1.4.2"));
        assert!(Version::current() >= UNSTATED_VERSION);
        for (server, agent) in [("1.4.0", "1.4.9"), ("1.4.0", "1.3.7"), ("1.4.0", "1.5.0")] {
            assert_eq!(check_skew(v(server), v(agent)), Ok(()), "{server} {agent}");
        }
        for (server, agent) in [
            ("1.4.0", "1.2.0"),
            ("1.4.0", "1.6.1"),
            ("1.0.0", "2.0.0"),
            ("1.0.0", "0.9.0"),
        ] {
            let e = check_skew(v(server), v(agent))
                .expect_err(agent)
                .to_string();
            assert!(
                e.contains(&format!(
                    "agent version {agent} and server version {server}"
                )),
                "{e}"
            );
        }
        for bad in [
            "", "1", "1.2", "1.2.x", "1.2.3.4", "-1.2.3", "v1.2.3", "1..3",
        ] {
            assert!(
                matches!(bad.parse::<Version>(), Err(SkewError::Malformed(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn sync_bodies_round_trip_with_flattened_states() {
        let r = SyncRequest {
            disk_pressure: None,
            health_check: true,
            reads_rendezvous_ports: true,
            reads_gang_nodes: true,
            health_check_run: Some(HealthCheckReport {
                run: 3,
                result: Some(HealthCheckResult {
                    exit_code: 1,
                    tail: vec!["nccl loopback failed".into(), "".into()],
                }),
            }),
            gpus: vec![GpuHealth {
                index: 0,
                healthy: false,
                reason: Some("XID 79".into()),
            }],
            tasks: vec![TaskReport {
                failure: Some(RankFailure {
                    rank: 3,
                    exit_code: 137,
                    signal: Some(9),
                    oom_killed: false,
                    log_tail: vec!["boom".into()],
                    node_fault: None,
                    limit: None,
                    unknown_exit: false,
                }),
                ..TaskReport::new(JobId(4), 1, TaskState::Exited { exit_code: 137 })
            }],
        };
        let text = serde_json::to_string(&r).expect("encode");
        assert!(
            text.contains(r#""state":"exited","exit_code":137"#),
            "{text}"
        );
        assert_eq!(
            serde_json::from_str::<SyncRequest>(&text).expect("decode"),
            r
        );
        let check = r.health_check_run.and_then(|c| c.result).expect("result");
        assert!(!check.passed());
        assert_eq!(check.last_line(), "nccl loopback failed");
        // Without a check nothing new is sent.
        let plain = serde_json::to_string(&SyncRequest::default()).expect("encode");
        assert!(!plain.contains("health"), "{plain}");
    }

    #[test]
    fn gangway_variables_override_user_environment() {
        let mut run = RunSpec::default();
        run.env.insert("RANK".into(), "99".into());
        run.env.insert("DATA".into(), "/data".into());
        let a = Assignment {
            run,
            ..two_node_assignment()
        };
        let env = rank_env(&a, &a.ranks[1]);
        assert_eq!(env["RANK"], "5");
        assert_eq!(env["LOCAL_RANK"], "1");
        assert_eq!(env["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(env["WORLD_SIZE"], "8");
        assert_eq!(env["NODE_RANK"], "1");
        assert_eq!(env["DATA"], "/data");
        assert_eq!(env["MASTER_ADDR"], "10.0.0.1");
    }

    #[test]
    fn array_tasks_see_their_index_under_gangways_and_slurms_names() {
        let plain = two_node_assignment();
        assert!(!rank_env(&plain, &plain.ranks[0]).contains_key("GANGWAY_ARRAY_TASK_ID"));
        let a = Assignment {
            array: Some(crate::workflow::ArrayTask {
                job: JobId(40),
                index: 7,
                count: 16,
                limit: Some(4),
            }),
            ..two_node_assignment()
        };
        let env = rank_env(&a, &a.ranks[0]);
        assert_eq!(env["GANGWAY_ARRAY_JOB_ID"], "40");
        assert_eq!(env["SLURM_ARRAY_JOB_ID"], "40");
        for k in [
            "GANGWAY_ARRAY_TASK_ID",
            "GANGWAY_ARRAY_INDEX",
            "SLURM_ARRAY_TASK_ID",
        ] {
            assert_eq!(env[k], "7", "{k}");
        }
        assert_eq!(env["SLURM_ARRAY_TASK_COUNT"], "16");
    }

    fn two_node_assignment() -> Assignment {
        let mut run = RunSpec::default();
        run.env.insert("OMP_NUM_THREADS".into(), "2".into());
        run.env.insert("TORCHELASTIC_RUN_ID".into(), "mine".into());
        Assignment {
            job: JobId(7),
            attempt: 2,
            name: "train".into(),
            user: "alice".into(),
            run,
            ranks: vec![
                RankAssignment {
                    rank: 4,
                    local_rank: 0,
                    gpus: vec![0, 1],
                },
                RankAssignment {
                    rank: 5,
                    local_rank: 1,
                    gpus: vec![2, 3],
                },
            ],
            world_size: 8,
            node_rank: 1,
            nnodes: 2,
            master_addr: "10.0.0.1".into(),
            master_port: 29_411,
            cpu_millis: 4_500,
            memory_mib: 0,
            checkpoint_signal: 15,
            grace_seconds: 30,
            stop: false,
            stop_now: false,
            rules: RankRules::default(),
            checkpoint_root: None,
            checkpoint_subdir: "alice/job-7".into(),
            resume_from: None,
            max_restarts: 3,
            array: None,
            restart_count: None,
            rendezvous_ports: None,
            nodes: Vec::new(),
        }
    }

    #[test]
    fn node_lists_and_hostfiles_in_node_rank_order_and_bounded() {
        let n = |h: &str, slots| GangNode {
            host: h.into(),
            slots,
        };
        let nodes = vec![n("10.0.0.2", 2), n("gpu-b", 1)];
        assert_eq!(nodelist(&nodes).as_deref(), Some("10.0.0.2,gpu-b"));
        assert_eq!(
            hostfile(&nodes, HostfileFormat::OpenMpi).as_deref(),
            Some("10.0.0.2 slots=2\ngpu-b slots=1\n")
        );
        assert_eq!(
            hostfile(&nodes, HostfileFormat::Mpich).as_deref(),
            Some("10.0.0.2:2\ngpu-b:1\n")
        );
        let mut a = two_node_assignment();
        assert!(!rank_env(&a, &a.ranks[0]).contains_key("GANGWAY_NODELIST"));
        a.nodes = nodes;
        assert_eq!(
            rank_env(&a, &a.ranks[0])["GANGWAY_NODELIST"],
            "10.0.0.2,gpu-b"
        );
        // A host that would add a line or a field leaves the lists out.
        for bad in ["a b", "a\nevil slots=99", "", "a,b", &"x".repeat(254)] {
            let nodes = vec![n("ok", 1), n(bad, 1)];
            assert_eq!(nodelist(&nodes), None, "{bad:?}");
            assert_eq!(hostfile(&nodes, HostfileFormat::OpenMpi), None, "{bad:?}");
        }
        // Past the bounds: no variable, no file.
        let many: Vec<GangNode> = (0..6000).map(|i| n(&format!("{i:0>200}"), 1)).collect();
        assert!(nodelist(&many).is_none());
        assert!(hostfile(&many, HostfileFormat::Mpich).is_none());
        let some: Vec<GangNode> = (0..300).map(|i| n(&format!("{i:0>200}"), 1)).collect();
        assert!(nodelist(&some).is_some());
        assert!(hostfile(&some, HostfileFormat::Mpich).is_some());
    }

    #[test]
    fn every_variable_of_the_launcher_contract() {
        let mut a = two_node_assignment();
        let env = rank_env(&a, &a.ranks[1]);
        let expect = [
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29411"),
            ("WORLD_SIZE", "8"),
            ("RANK", "5"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("NODE_RANK", "1"),
            ("GROUP_RANK", "1"),
            ("GROUP_WORLD_SIZE", "2"),
            ("NNODES", "2"),
            ("ROLE_NAME", "default"),
            ("ROLE_RANK", "5"),
            ("ROLE_WORLD_SIZE", "8"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_MAX_RESTARTS", "3"),
            ("TORCHELASTIC_RUN_ID", "gangway-job-7"),
            ("CUDA_VISIBLE_DEVICES", "2,3"),
            ("GANGWAY_JOB_ID", "7"),
            ("GANGWAY_JOB_NAME", "train"),
            ("GANGWAY_ATTEMPT", "2"),
            // The job's own choice stands.
            ("OMP_NUM_THREADS", "2"),
        ];
        for (k, v) in expect {
            assert_eq!(env.get(k).map(String::as_str), Some(v), "{k}");
        }
        // Without the job's choice: the CPU share, whole cores, at least 1.
        a.run.env.clear();
        assert_eq!(rank_env(&a, &a.ranks[0])["OMP_NUM_THREADS"], "4");
        a.cpu_millis = 0;
        assert_eq!(rank_env(&a, &a.ranks[0])["OMP_NUM_THREADS"], "1");
        assert_eq!(rank_env(&a, &a.ranks[0])["CUDA_VISIBLE_DEVICES"], "0,1");
        // The node-local part.
        let mut env = rank_env(&a, &a.ranks[0]);
        node_env(&mut env, "node-b", "/ckpt/alice/job-7", None);
        assert_eq!(env["GANGWAY_NODE"], "node-b");
        assert_eq!(env["GANGWAY_CHECKPOINT_DIR"], "/ckpt/alice/job-7");
        assert!(!env.contains_key("GANGWAY_RESUME_FROM"));
        node_env(
            &mut env,
            "node-b",
            "/ckpt/alice/job-7",
            Some("/ckpt/alice/job-7/s340"),
        );
        assert_eq!(env["GANGWAY_RESUME_FROM"], "/ckpt/alice/job-7/s340");
    }

    #[test]
    fn a_job_cannot_smuggle_a_resume_path_through_its_environment() {
        let mut a = two_node_assignment();
        a.run
            .env
            .insert("GANGWAY_RESUME_FROM".into(), "/etc/shadow".into());
        let mut env = rank_env(&a, &a.ranks[0]);
        node_env(&mut env, "n", "/ckpt/alice/job-7", None);
        assert!(!env.contains_key("GANGWAY_RESUME_FROM"));
    }

    #[test]
    fn checkpoint_dirs_are_namespaced_by_user() {
        assert_eq!(checkpoint_subdir("alice", JobId(7), None), "alice/job-7");
        assert_eq!(
            checkpoint_subdir("alice", JobId(7), Some("llm/run")),
            "alice/llm/run"
        );
        assert_eq!(user_dir(".."), "%2E.");
        assert_eq!(user_dir("."), "%2E");
        assert_eq!(user_dir("a/b"), "a%2Fb");
        assert_ne!(user_dir("a/b"), user_dir("a_b"));
        assert_eq!(user_dir(""), "%00");
    }

    #[test]
    fn ports_come_from_the_range_and_skip_used_ones() {
        let r = PortRange::default();
        assert!(
            r.first > 1024 && u32::from(r.last) < 32_768,
            "below the ephemeral range"
        );
        let p = r.pick(JobId(7), 0, &|_| false).expect("a port");
        assert!((r.first..=r.last).contains(&p));
        assert_ne!(Some(p), r.pick(JobId(7), 1, &|_| false), "attempts differ");
        let taken = p;
        let q = r.pick(JobId(7), 0, &|x| x == taken).expect("another port");
        assert_ne!(q, taken);
        let small = PortRange {
            first: 30_000,
            last: 30_002,
        };
        assert_eq!(small.len(), 3);
        let all: Vec<u16> = (0..3)
            .scan(Vec::new(), |used: &mut Vec<u16>, _| {
                let p = small.pick(JobId(1), 0, &|x| used.contains(&x))?;
                used.push(p);
                Some(p)
            })
            .collect();
        assert_eq!(all.len(), 3);
        assert_eq!(small.pick(JobId(1), 0, &|_| true), None, "all taken");
        assert_eq!(
            PortRange { first: 5, last: 4 }.pick(JobId(1), 0, &|_| false),
            None
        );
    }
}
