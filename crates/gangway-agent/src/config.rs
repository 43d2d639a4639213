//! How an agent is configured: where the server is, what the node has, how ranks run.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Where the node's GPUs come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Inventory {
    /// Ask NVML (a driver must be present).
    Nvml,
    /// Declared by the operator: for machines without GPUs (tests, `gangway up`)
    /// or without a driver the agent can load.
    Declared {
        /// GPU count.
        gpus: u32,
        /// Model name.
        model: String,
        /// Memory per GPU in GiB.
        memory_gib: u32,
        /// Whether all GPUs share one NVLink island (else each is its own).
        nvlink_all: bool,
    },
    /// NVML when it loads, else the declared inventory.
    Auto(Box<Inventory>),
    /// A recorded machine (docs/GPU.md), read through the same discovery,
    /// health and topology code as NVML.
    Machine(PathBuf),
}

/// How ranks are started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecutorKind {
    /// A process group per rank.
    Process,
    /// A Docker container per rank (the job's `run.image`); jobs without an
    /// image still run as processes.
    Docker,
}

/// Everything an agent needs to run.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// Server base URL, e.g. `http://10.0.0.1:7070`; several replicas
    /// comma-separated (the agent moves to the next when one fails).
    pub server: String,
    /// The cluster's join token.
    pub join_token: String,
    /// Node name (unique in the cluster).
    pub node: String,
    /// Address other nodes reach this node at (`MASTER_ADDR`).
    pub address: String,
    /// Where the agent serves logs (`ip:port`; port 0 picks one).
    pub listen: String,
    /// Leaf switch / rack.
    pub leaf: String,
    /// Spine.
    pub spine: String,
    /// Free-form labels.
    pub labels: BTreeMap<String, String>,
    /// GPUs.
    pub inventory: Inventory,
    /// Allocatable CPU (thousandths of a core); 0 means what the machine has.
    pub cpu_millis: u64,
    /// Allocatable memory in MiB; 0 means what the machine has.
    pub memory_mib: u64,
    /// How ranks run.
    pub executor: ExecutorKind,
    /// Pass GPUs into containers through the NVIDIA runtime (real GPUs only).
    pub gpu_runtime: bool,
    /// Logs, the health file and run state.
    pub state_dir: PathBuf,
    /// Checkpoints live in `<checkpoint_root>/job-<id>`; shared storage in a
    /// real cluster, so a gang resumes wherever it is placed next.
    pub checkpoint_root: PathBuf,
    /// Time between syncs.
    pub sync_interval: Duration,
    /// Agent environment variables passed to process ranks (`--pass-env`),
    /// over the minimal base; nothing else of the agent's environment is.
    pub pass_env: Vec<String>,
    /// Serve the log endpoint over TLS with this configuration (`--tls-cert`,
    /// `--tls-key`); the server then reaches it at `https://`.
    pub tls: Option<std::sync::Arc<rustls::ServerConfig>>,
    /// How the processes of a rank are tracked (`--proctrack`).
    pub proctrack: crate::proctrack::ProcTrackKind,
    /// The directory under the agent's own cgroup that holds rank cgroups.
    pub cgroup_parent: String,
    /// On a clean stop, leave the ranks running for the next agent to adopt
    /// (an upgrade or restart) instead of killing them.
    pub leave_ranks_on_exit: bool,
    /// Free space (percent) below which a data or checkpoint filesystem is
    /// under pressure (0: never).
    pub disk_pressure_percent: u32,
    /// How long a stopped rank's processes may survive SIGKILL (after its
    /// grace period) before the agent gives up on them: "kill task failed",
    /// a fault of the node (unkillable processes: D state, a frozen cgroup).
    /// The rank then counts as ended, so its job can end.
    pub kill_timeout: Duration,
    /// The node's own health check (`--health-check`), run when the server
    /// asks, to return an auto-cordoned node to service.
    pub health_check: Option<crate::health::HealthCheckConfig>,
    /// Each job's `/tmp` and `/dev/shm`: private (the default) or the
    /// node's (`--job-scratch`, see [`crate::scratch`]).
    pub job_scratch: crate::scratch::JobScratch,
}

/// How long processes may survive SIGKILL before "kill task failed" (as
/// Slurm's `UnkillableStepTimeout`).
pub const DEFAULT_KILL_TIMEOUT: Duration = Duration::from_secs(60);

impl AgentConfig {
    /// A declared-inventory agent with defaults, for tests and `gangway up`.
    pub fn declared(
        server: &str,
        join_token: &str,
        node: &str,
        gpus: u32,
        state_dir: PathBuf,
    ) -> Self {
        AgentConfig {
            server: server.to_string(),
            join_token: join_token.to_string(),
            node: node.to_string(),
            address: "127.0.0.1".into(),
            listen: "127.0.0.1:0".into(),
            leaf: "leaf0".into(),
            spine: "spine0".into(),
            labels: BTreeMap::new(),
            inventory: Inventory::Declared {
                gpus,
                model: "H100".into(),
                memory_gib: 80,
                nvlink_all: true,
            },
            cpu_millis: 0,
            memory_mib: 0,
            executor: ExecutorKind::Process,
            gpu_runtime: false,
            checkpoint_root: state_dir.join("checkpoints"),
            state_dir,
            sync_interval: Duration::from_secs(2),
            pass_env: Vec::new(),
            tls: None,
            proctrack: crate::proctrack::ProcTrackKind::Auto,
            cgroup_parent: "gangway".into(),
            leave_ranks_on_exit: false,
            disk_pressure_percent: crate::disk::DEFAULT_PRESSURE_PERCENT,
            kill_timeout: DEFAULT_KILL_TIMEOUT,
            health_check: None,
            job_scratch: crate::scratch::JobScratch::Private,
        }
    }
}
