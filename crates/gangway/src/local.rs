//! `gangway agent` (one node) and `gangway up` (a server and N agents with
//! declared GPUs on this machine).

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use gangway_agent::{Agent, AgentConfig, ExecutorKind, Inventory};
use std::path::PathBuf;
use std::time::Duration;

/// Where the agent's GPUs come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum InventoryArg {
    /// NVML when a driver loads, else the declared `--gpus`.
    Auto,
    /// NVML only.
    Nvml,
    /// The declared `--gpus`, `--gpu-model`, `--gpu-memory`, `--nvlink`.
    Declared,
}

/// How ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExecutorArg {
    /// Process groups.
    Process,
    /// Docker containers for jobs with `run.image` (processes for the others).
    Docker,
}

impl From<ExecutorArg> for ExecutorKind {
    fn from(e: ExecutorArg) -> Self {
        match e {
            ExecutorArg::Process => ExecutorKind::Process,
            ExecutorArg::Docker => ExecutorKind::Docker,
        }
    }
}

/// The declared GPU inventory.
#[derive(Args, Clone, Debug)]
pub struct GpuArgs {
    /// Declared GPU count.
    #[arg(long, default_value_t = 8)]
    pub gpus: u32,
    /// Declared GPU model.
    #[arg(long, default_value = "H100")]
    pub gpu_model: String,
    /// Declared memory per GPU in GiB.
    #[arg(long, default_value_t = 80)]
    pub gpu_memory: u32,
    /// Declared NVLink: `all` (one NVSwitch island) or `none`.
    #[arg(long, default_value = "all", value_parser = ["all", "none"])]
    pub nvlink: String,
}

impl GpuArgs {
    fn declared(&self, gpus: u32) -> Inventory {
        Inventory::Declared {
            gpus,
            model: self.gpu_model.clone(),
            memory_gib: self.gpu_memory,
            nvlink_all: self.nvlink == "all",
        }
    }
}

/// `gangway agent`.
#[derive(Args, Clone, Debug)]
pub struct AgentArgs {
    /// Server URL; several replicas comma-separated.
    #[arg(long, default_value = "http://127.0.0.1:7070")]
    pub server: String,
    /// The cluster's join token (the server config's agent_token).
    #[arg(long, env = "GANGWAY_JOIN_TOKEN", hide_env_values = true)]
    pub join_token: String,
    /// Node name (default: the hostname).
    #[arg(long)]
    pub node: Option<String>,
    /// Address other nodes reach this one at (MASTER_ADDR for its gangs).
    #[arg(long, default_value = "127.0.0.1")]
    pub address: String,
    /// Where the agent serves rank logs (port 0 picks one).
    #[arg(long)]
    pub listen: Option<String>,
    /// Leaf switch / rack.
    #[arg(long, default_value = "leaf0")]
    pub leaf: String,
    /// Spine.
    #[arg(long, default_value = "spine0")]
    pub spine: String,
    /// Labels, `key=value`.
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Where GPUs come from.
    #[arg(long, value_enum, default_value_t = InventoryArg::Auto)]
    pub inventory: InventoryArg,
    #[command(flatten)]
    pub gpu: GpuArgs,
    /// How ranks run.
    #[arg(long, value_enum, default_value_t = ExecutorArg::Process)]
    pub executor: ExecutorArg,
    /// Give containers their GPUs through the NVIDIA runtime (real GPUs).
    #[arg(long)]
    pub gpu_runtime: bool,
    /// Logs and state.
    #[arg(long, default_value = "gangway-agent")]
    pub state_dir: PathBuf,
    /// Checkpoint root (shared storage in a real cluster).
    #[arg(long)]
    pub checkpoint_root: Option<PathBuf>,
    /// Milliseconds between syncs with the server.
    #[arg(long, default_value_t = 2000)]
    pub sync_ms: u64,
    /// Allocatable CPU in thousandths of a core (default: the machine's).
    #[arg(long, default_value_t = 0)]
    pub cpu_millis: u64,
    /// Allocatable memory in MiB (default: the machine's).
    #[arg(long, default_value_t = 0)]
    pub memory_mib: u64,
    /// How every process of a rank is tracked: auto, cgroup-v2, cgroup-v1
    /// or subreaper.
    #[arg(long, default_value = "auto")]
    pub proctrack: gangway_agent::proctrack::ProcTrackKind,
    /// Directory under the agent's own cgroup for the ranks' cgroups.
    #[arg(long, default_value = "gangway")]
    pub cgroup_parent: String,
    /// On SIGTERM or Ctrl-C, leave the ranks running for the next agent to
    /// adopt (upgrades, restarts) instead of killing them.
    #[arg(long)]
    pub leave_ranks_on_exit: bool,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("label {s:?}: expected key=value"))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "node".into())
}

impl AgentArgs {
    fn config(&self) -> AgentConfig {
        let declared = self.gpu.declared(self.gpu.gpus);
        let inventory = match self.inventory {
            InventoryArg::Auto => Inventory::Auto(Box::new(declared)),
            InventoryArg::Nvml => Inventory::Nvml,
            InventoryArg::Declared => declared,
        };
        AgentConfig {
            server: self.server.clone(),
            join_token: self.join_token.clone(),
            node: self.node.clone().unwrap_or_else(hostname),
            address: self.address.clone(),
            listen: self
                .listen
                .clone()
                .unwrap_or_else(|| format!("{}:0", self.address)),
            leaf: self.leaf.clone(),
            spine: self.spine.clone(),
            labels: self.labels.iter().cloned().collect(),
            inventory,
            cpu_millis: self.cpu_millis,
            memory_mib: self.memory_mib,
            executor: self.executor.into(),
            gpu_runtime: self.gpu_runtime,
            checkpoint_root: self
                .checkpoint_root
                .clone()
                .unwrap_or_else(|| self.state_dir.join("checkpoints")),
            state_dir: self.state_dir.clone(),
            sync_interval: Duration::from_millis(self.sync_ms.max(50)),
            proctrack: self.proctrack,
            cgroup_parent: self.cgroup_parent.clone(),
            leave_ranks_on_exit: self.leave_ranks_on_exit,
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Runs one agent until Ctrl-C or SIGTERM (its ranks are killed then).
pub fn agent(a: &AgentArgs) -> Result<()> {
    init_tracing();
    let cfg = a.config();
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let h = Agent::start(cfg).await?;
        wait_for_signal().await;
        h.shutdown().await;
        Ok(())
    })
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// `gangway up`.
#[derive(Args, Clone, Debug)]
pub struct UpArgs {
    /// Agents (nodes) to start.
    #[arg(long, default_value_t = 4)]
    pub nodes: u32,
    /// Declared GPUs per node.
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: u32,
    /// Nodes under one leaf switch.
    #[arg(long, default_value_t = 2)]
    pub nodes_per_leaf: u32,
    #[command(flatten)]
    pub gpu: GpuArgs,
    /// Server address.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: String,
    /// Store, agent state and logs (default: a fresh directory under the temp dir).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// How ranks run.
    #[arg(long, value_enum, default_value_t = ExecutorArg::Process)]
    pub executor: ExecutorArg,
    /// Job files to submit once the cluster is up.
    #[arg(long)]
    pub submit: Vec<PathBuf>,
    /// Stop once every submitted job has ended (for scripts and demos).
    #[arg(long)]
    pub exit_when_done: bool,
    /// The admin token (default: a random one, printed).
    #[arg(long, env = "GANGWAY_UP_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
}

/// Starts a server and `--nodes` agents in this process and runs until Ctrl-C.
pub fn up(a: &UpArgs) -> Result<()> {
    init_tracing();
    let dir = a
        .data_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("gangway-up-{}", std::process::id())));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let admin = a
        .admin_token
        .clone()
        .unwrap_or_else(|| format!("admin-{}", gangway_server::control::fresh_token()));
    let join = format!("join-{}", gangway_server::control::fresh_token());
    let cfg = gangway_server::ServerConfig {
        admin_token: admin.clone(),
        agent_token: join.clone(),
        users: Vec::new(),
        queues: vec![gangway_core::QueueSpec::unlimited("default", None)],
        cycle_seconds: 1,
        node_not_ready_seconds: 5,
        node_lost_seconds: 15,
        auto_cordon_failures: 3,
    };
    let app = gangway_server::open(cfg, &dir.join("server"))?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&a.listen)
            .await
            .with_context(|| format!("listening on {}", a.listen))?;
        let addr = format!("http://{}", listener.local_addr()?);
        tokio::spawn(async move {
            if let Err(e) = gangway_server::serve(app, listener).await {
                tracing::error!("server: {e}");
            }
        });
        let mut agents = Vec::new();
        for i in 0..a.nodes {
            let name = format!("node-{i}");
            let mut c = AgentConfig::declared(&addr, &join, &name, a.gpus_per_node, dir.join(&name));
            c.inventory = a.gpu.declared(a.gpus_per_node);
            c.leaf = format!("leaf{}", i / a.nodes_per_leaf.max(1));
            c.executor = a.executor.into();
            // One checkpoint root for all: a resumed gang finds its checkpoint on any node.
            c.checkpoint_root = dir.join("checkpoints");
            c.sync_interval = Duration::from_secs(1);
            c.cpu_millis = 16_000 * u64::from(a.gpus_per_node.max(1));
            c.memory_mib = 128 * 1024 * u64::from(a.gpus_per_node.max(1));
            agents.push(Agent::start(c).await?);
        }
        let cli = dir.join("cli.yaml");
        std::fs::write(&cli, format!("addr: {addr}\ntoken: {admin}\n"))?;
        println!(
            "Gangway is up: {} nodes x {} {} GPUs, server {addr}, data in {}\n\n  dashboard: {addr}/ (sign in with the token in the file below)\n  export GANGWAY_CONFIG={}\n  gangway submit examples/train.yaml\n  gangway queue\n  gangway logs 1 --follow\n\nCtrl-C stops the cluster (and kills its ranks).",
            a.nodes,
            a.gpus_per_node,
            a.gpu.gpu_model,
            dir.display(),
            cli.display()
        );
        let conn = crate::client::Conn::local(&addr, &admin);
        let mut ids = Vec::new();
        for f in &a.submit {
            let (conn, file) = (conn.clone(), f.clone());
            let id = tokio::task::spawn_blocking(move || crate::client::submit_id(&conn, &file))
                .await??;
            println!("submitted {} as job {id}", f.display());
            ids.push(id);
        }
        if a.exit_when_done && !ids.is_empty() {
            let conn2 = conn.clone();
            let ids2 = ids.clone();
            let wait = tokio::task::spawn_blocking(move || crate::client::wait_all(&conn2, &ids2));
            tokio::select! {
                r = wait => { r??; }
                _ = wait_for_signal() => {}
            }
        } else {
            wait_for_signal().await;
        }
        for h in agents {
            h.shutdown().await;
        }
        Ok(())
    })
}
