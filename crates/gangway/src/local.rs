//! `gangway agent` (one node) and `gangway up` (a server and N agents with
//! declared GPUs on this machine).

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use gangway_agent::{Agent, AgentConfig, ExecutorKind, Inventory};
use std::os::unix::fs::PermissionsExt;
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

/// The declared GPUs' kind (the count is `--gpus` of `agent`,
/// `--gpus-per-node` of `up`).
#[derive(Args, Clone, Debug)]
pub struct GpuArgs {
    /// Declared GPU model.
    #[arg(long, default_value = "H100")]
    pub gpu_model: String,
    /// Declared memory per GPU in GiB.
    #[arg(long, default_value_t = 80)]
    pub gpu_memory: u32,
    /// Declared NVLink: `all` (one NVSwitch island) or `none`.
    #[arg(long, default_value = "all", value_parser = ["all", "none"])]
    pub nvlink: String,
    /// A recorded machine (docs/GPU.md, `examples/machines/`): its GPUs,
    /// topology and scripted NVML events, read through the same discovery
    /// and health code as NVML; replaces the declared GPUs and NVML.
    #[arg(long)]
    pub machine: Option<PathBuf>,
}

impl GpuArgs {
    fn declared(&self, gpus: u32) -> Inventory {
        if let Some(m) = &self.machine {
            return Inventory::Machine(m.clone());
        }
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
    #[arg(
        long,
        env = "GANGWAY_JOIN_TOKEN",
        hide_env_values = true,
        required_unless_present = "check"
    )]
    pub join_token: Option<String>,
    /// Print what the agent finds (GPUs, islands, NUMA nodes, NICs, what a
    /// 1-, 2-, 4- and 8-GPU rank would get, warnings) and exit.
    #[arg(long)]
    pub check: bool,
    /// Node name (default: the hostname).
    #[arg(long)]
    pub node: Option<String>,
    /// Address other nodes reach this one at (MASTER_ADDR for its gangs).
    /// Default: this machine's address on the route to the server, so a
    /// loopback address only when the server is on this machine's loopback.
    #[arg(long)]
    pub address: Option<String>,
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
    /// Declared GPU count.
    #[arg(long, default_value_t = 8)]
    pub gpus: u32,
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
    /// Agent environment variables passed to process ranks over their
    /// minimal base (PATH, HOME, USER, LOGNAME, LANG), e.g. `PATH,LD_LIBRARY_PATH`.
    #[arg(long, value_delimiter = ',')]
    pub pass_env: Vec<String>,
    #[command(flatten)]
    pub tls: TlsArgs,
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
    /// Free space (percent) on the state or checkpoint filesystem below
    /// which the node reports DiskPressure, takes no new work and stops the
    /// job writing most (0: never).
    #[arg(long, default_value_t = gangway_agent::disk::DEFAULT_PRESSURE_PERCENT)]
    pub disk_pressure_percent: u32,
    /// Seconds a stopped rank's processes may survive SIGKILL before the
    /// agent reports "kill task failed" (a fault of the node, which the
    /// server cordons for) and lets the job end.
    #[arg(long, default_value_t = gangway_agent::config::DEFAULT_KILL_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub kill_timeout_seconds: u64,
    /// Each job's /tmp and /dev/shm: `private` (its own, by a mount
    /// namespace; where none can be made, the account's entries in the
    /// node's are removed after its last job here) or `shared` (the node's,
    /// shared by every job and never swept).
    #[arg(long, default_value = "private")]
    pub job_scratch: gangway_agent::scratch::JobScratch,
    #[command(flatten)]
    pub health: HealthCheckArgs,
}

/// The node's own health check (an agent's, or each of `up`'s agents').
#[derive(Args, Clone, Debug, Default)]
pub struct HealthCheckArgs {
    /// A command line (run with `/bin/sh -c` as the agent's account, with
    /// all of the node's GPUs) that the server may ask the agent to run to
    /// return an auto-cordoned node to service: exit 0 passes. Without it,
    /// such a node stays cordoned until an admin uncordons it.
    #[arg(long, value_name = "COMMAND")]
    pub health_check: Option<String>,
    /// Seconds a health check run may take before its processes are killed
    /// and it counts as failed.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub health_check_timeout: u64,
}

impl HealthCheckArgs {
    /// The agent's check, if one is configured.
    pub fn config(&self) -> Result<Option<gangway_agent::health::HealthCheckConfig>> {
        let Some(command) = &self.health_check else {
            return Ok(None);
        };
        if command.trim().is_empty() {
            anyhow::bail!("--health-check: the command is empty");
        }
        Ok(Some(gangway_agent::health::HealthCheckConfig {
            command: command.clone(),
            timeout: Duration::from_secs(self.health_check_timeout),
        }))
    }
}

/// TLS of a listener and the CA its peers' certificates are checked against.
#[derive(Args, Clone, Debug, Default)]
pub struct TlsArgs {
    /// PEM certificate chain to serve TLS with (needs --tls-key).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate(s) that `https://` peers must be signed by.
    #[arg(long)]
    pub ca: Option<PathBuf>,
}

impl TlsArgs {
    /// Trusts `--ca` for this process's outgoing calls; returns the server
    /// TLS configuration of `--tls-cert`/`--tls-key`, if given.
    pub fn apply(&self) -> Result<Option<std::sync::Arc<gangway_agent::tls::ServerConfig>>> {
        if let Some(ca) = &self.ca {
            gangway_agent::tls::trust_ca(ca)?;
            gangway_server::set_http_client(gangway_agent::tls::http());
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(c), Some(k)) => Ok(Some(gangway_agent::tls::server_config(c, k)?)),
            _ => Ok(None),
        }
    }
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("label {s:?}: expected key=value"))
}

/// This machine's address on the route to the first server URL (a UDP
/// "connect" sends nothing; it only picks the route); loopback when the
/// server cannot be resolved.
fn address_towards(server: &str) -> String {
    use std::net::ToSocketAddrs;
    let first = server.split(',').next().unwrap_or("").trim();
    let hostport = first
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .split('/')
        .next()
        .unwrap_or("");
    let target = hostport.to_socket_addrs().ok().and_then(|mut a| a.next());
    target
        .and_then(|t| {
            let bind = if t.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
            let s = std::net::UdpSocket::bind(bind).ok()?;
            s.connect(t).ok()?;
            s.local_addr().ok()
        })
        .map_or_else(|| "127.0.0.1".to_string(), |a| a.ip().to_string())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "node".into())
}

impl AgentArgs {
    fn config(&self) -> Result<AgentConfig> {
        let declared = self.gpu.declared(self.gpus);
        let inventory = match self.inventory {
            _ if self.gpu.machine.is_some() => declared,
            InventoryArg::Auto => Inventory::Auto(Box::new(declared)),
            InventoryArg::Nvml => Inventory::Nvml,
            InventoryArg::Declared => declared,
        };
        let address = self
            .address
            .clone()
            .unwrap_or_else(|| address_towards(&self.server));
        Ok(AgentConfig {
            server: self.server.clone(),
            join_token: self.join_token.clone().unwrap_or_default(),
            node: self.node.clone().unwrap_or_else(hostname),
            listen: self
                .listen
                .clone()
                .unwrap_or_else(|| format!("{address}:0")),
            address,
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
            disk_pressure_percent: self.disk_pressure_percent,
            kill_timeout: Duration::from_secs(self.kill_timeout_seconds),
            job_scratch: self.job_scratch,
            health_check: self.health.config()?,
            pass_env: self.pass_env.clone(),
            tls: self.tls.apply()?,
        })
    }
}

fn init_tracing() {
    init_tracing_at("info");
}

/// Logs to stderr at `level` unless RUST_LOG says otherwise.
fn init_tracing_at(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Runs one agent until Ctrl-C or SIGTERM (its ranks are killed then).
pub fn agent(a: &AgentArgs) -> Result<()> {
    init_tracing();
    let cfg = a.config()?;
    if a.check {
        return crate::gpu_check::print(&cfg.inventory, &cfg.state_dir);
    }
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
    #[arg(long, visible_alias = "gpus", default_value_t = 8)]
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
    /// Stop once every submitted job has ended (for scripts and demos),
    /// printing each job's outcome and the end of its failing rank's log.
    #[arg(long)]
    pub exit_when_done: bool,
    /// With --exit-when-done, print every rank's whole output.
    #[arg(long, requires = "exit_when_done")]
    pub show_output: bool,
    /// Keep the data directory `up` created under the temp dir when it
    /// exits (by default it is removed; a `--data-dir` is always kept).
    #[arg(long)]
    pub keep: bool,
    /// Log the server's and agents' INFO lines (to stderr); by default only
    /// warnings and errors. RUST_LOG, when set, decides instead.
    #[arg(long, short = 'v')]
    pub verbose: bool,
    /// The admin token (default: a random one, printed).
    #[arg(long, env = "GANGWAY_UP_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Unix account the ranks run as (default: the user running `gangway
    /// up`, or `nobody` when that is root).
    #[arg(long)]
    pub run_as: Option<String>,
    /// Plain HTTP instead of TLS with a throwaway CA.
    #[arg(long)]
    pub no_tls: bool,
    /// Server configuration (as for `gangway server`): its queues, users
    /// (with their tokens), limits and policies. `up` keeps its own admin
    /// and join tokens, approves its own nodes, checkpoints under the data
    /// directory and runs users' ranks as `--run-as` unless a user names a
    /// `unix_user`. Without it: one unlimited `default` queue.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Start even though `--config` maps several users to one Unix account
    /// (users without `unix_user` all run as `--run-as`): their ranks are
    /// then not isolated from each other (see docs/SECURITY.md).
    #[arg(long)]
    pub allow_shared_account: bool,
    /// Milliseconds between each agent's syncs with the server (how soon a
    /// placement starts and an exit is seen).
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(50..=60_000))]
    pub sync_ms: u64,
    /// Free space (percent) on the data or checkpoint filesystem below which
    /// a node reports DiskPressure and takes no new work (0: never).
    #[arg(long, default_value_t = gangway_agent::disk::DEFAULT_PRESSURE_PERCENT)]
    pub disk_pressure_percent: u32,
    /// Each job's /tmp and /dev/shm: `private` (its own) or `shared` (the
    /// machine's), as `gangway agent --job-scratch`.
    #[arg(long, default_value = "private")]
    pub job_scratch: gangway_agent::scratch::JobScratch,
    #[command(flatten)]
    pub health: HealthCheckArgs,
}

/// `--config`'s server configuration with every user that names no
/// `unix_user` run as `run_as`; refused when that (or the file) maps
/// several users to one account, unless `--allow-shared-account`.
fn config_file(a: &UpArgs, run_as: &str) -> Result<Option<gangway_server::ServerConfig>> {
    let Some(path) = &a.config else {
        return Ok(None);
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut cfg = gangway_server::ServerConfig::from_yaml(&text)
        .with_context(|| format!("in {}", path.display()))?;
    let mut defaulted = false;
    for u in &mut cfg.users {
        if u.unix_user.is_none() {
            u.unix_user = Some(run_as.to_string());
            defaulted = true;
        }
    }
    if let Some(why) =
        gangway_server::config::shared_account_refusal(&cfg, "--allow-shared-account")
    {
        let how = if defaulted {
            format!(" (`up` runs each user without `unix_user` as --run-as {run_as})")
        } else {
            String::new()
        };
        if !a.allow_shared_account {
            anyhow::bail!("in {}: {why}{how}", path.display());
        }
        eprintln!("warning: {why}{how} (accepted with --allow-shared-account)");
    }
    Ok(Some(cfg))
}

/// `up`'s server configuration: `--config`'s (read by [`config_file`]),
/// adapted to one machine, or a single unlimited `default` queue.
fn up_config(
    file: Option<gangway_server::ServerConfig>,
    admin: &str,
    join: &str,
    run_as: &str,
    dir: &std::path::Path,
) -> Result<gangway_server::ServerConfig> {
    let mut cfg = match file {
        Some(mut cfg) => {
            cfg.admin_token = admin.to_string();
            cfg.agent_token = join.to_string();
            cfg
        }
        None => {
            let default_queue = gangway_core::QueueSpec::unlimited("default", None);
            let mut cfg = gangway_server::ServerConfig::new(admin, join, vec![default_queue]);
            cfg.node_not_ready_seconds = 5;
            cfg.node_lost_seconds = 15;
            cfg
        }
    };
    // `--run-as root` is a deliberate choice; the queues must allow it then.
    if run_as == "root" {
        for q in &mut cfg.queues {
            q.node.allow_root = true;
        }
    }
    cfg.default_unix_user = run_as.to_string();
    // Its own agents, started right here: nothing to approve.
    cfg.node_approval = gangway_server::config::NodeApproval::Auto;
    // One machine: one checkpoint root for every agent, the config's when
    // it names a directory that exists here (the config's own check refuses
    // a relative one), else in `dir`, saying so.
    let local = dir.join("checkpoints").display().to_string();
    match &cfg.checkpoint_root {
        Some(root) if std::path::Path::new(root).is_dir() => {}
        Some(root) => {
            eprintln!(
                "checkpoint_root {root:?} is not a directory on this machine: checkpoints go to {local}"
            );
            cfg.checkpoint_root = Some(local);
        }
        None => cfg.checkpoint_root = Some(local),
    }
    Ok(cfg)
}

/// A throwaway CA and a certificate it signs for this machine's loopback
/// names, written as `ca.pem`, `cert.pem` and `key.pem` (0600) into `dir`.
fn throwaway_ca(dir: &std::path::Path, listen_host: &str) -> Result<TlsFiles> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
        KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "gangway up throwaway CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key)?;
    let mut names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    if !listen_host.is_empty() && !names.iter().any(|n| n == listen_host) {
        names.push(listen_host.to_string());
    }
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(names)?;
    params
        .distinguished_name
        .push(DnType::CommonName, "gangway up");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &ca_cert, &ca_key)?;
    let files = TlsFiles {
        ca: dir.join("ca.pem"),
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
    };
    crate::client::write_private(&files.key, &key.serialize_pem())?;
    std::fs::write(&files.cert, cert.pem())?;
    std::fs::write(&files.ca, ca_cert.pem())?;
    Ok(files)
}

/// Where `gangway up`'s TLS files are.
struct TlsFiles {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

/// Who `gangway up`'s ranks run as: `--run-as`, else the invoking user,
/// else (root) `nobody`, so a local cluster never runs ranks as root.
fn up_run_as(flag: Option<&str>) -> Result<String> {
    if let Some(name) = flag {
        return Ok(name.to_string());
    }
    match gangway_agent::identity::current_account()? {
        Some(a) if a.uid != 0 => Ok(a.name),
        _ => Ok("nobody".into()),
    }
}

/// Starts a server and `--nodes` agents in this process and runs until Ctrl-C.
pub fn up(a: &UpArgs) -> Result<()> {
    init_tracing_at(if a.verbose { "info" } else { "warn" });
    let run_as = up_run_as(a.run_as.as_deref())?;
    let file = config_file(a, &run_as)?;
    let (gpus_per_node, model) = node_gpus(a)?;
    let cluster_gpus = u64::from(gpus_per_node).saturating_mul(u64::from(a.nodes));
    if let Some(cfg) = &file {
        for why in gangway_server::config::quota_overcommit(cfg, cluster_gpus) {
            eprintln!(
                "warning: {why} ({} node{} x {gpus_per_node} GPUs); guarantees past the cluster's size cannot all be met",
                a.nodes,
                if a.nodes == 1 { "" } else { "s" }
            );
        }
    }
    // The admin token lands in this directory: private (0700) and, by
    // default, at an unpredictable path.
    // A temp dir `up` made is removed when it exits, unless --keep.
    let remove_at_exit = a.data_dir.is_none() && !a.keep;
    let dir = match &a.data_dir {
        Some(d) => {
            gangway_server::private_dir(d).with_context(|| format!("creating {}", d.display()))?;
            d.clone()
        }
        None => {
            let d = tempfile::Builder::new()
                .prefix("gangway-up-")
                .tempdir()
                .context("creating a private data directory")?
                .keep();
            gangway_server::private_dir(&d)?;
            d
        }
    };
    let data = DataDir {
        dir: dir.clone(),
        remove: remove_at_exit,
    };
    // Ranks run as another account: they may reach their checkpoints
    // (traverse) but not list the directory; the store and the CLI file in
    // it stay private (0700 / 0600).
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))?;
    let admin = a
        .admin_token
        .clone()
        .unwrap_or_else(|| format!("admin-{}", gangway_server::control::fresh_token()));
    let join = format!("join-{}", gangway_server::control::fresh_token());
    let cfg = up_config(file, &admin, &join, &run_as, &dir)?;
    let checkpoint_root = cfg
        .checkpoint_root
        .as_ref()
        .map_or_else(|| dir.join("checkpoints"), PathBuf::from);
    // A nearly full disk would leave every node under DiskPressure, taking
    // no work: say so now rather than let the first job wait unexplained.
    let under = [&dir, &checkpoint_root]
        .into_iter()
        .find_map(|p| gangway_agent::disk::pressure(p, a.disk_pressure_percent));
    if let Some(why) = under {
        eprintln!(
            "warning: {why}: the nodes will take no new work until space is freed \
             (or start with --disk-pressure-percent 0 to turn the check off)"
        );
    }
    let app = gangway_server::open(cfg, &dir.join("server"))?;
    let listen_host = a
        .listen
        .rsplit_once(':')
        .map_or("", |(h, _)| h)
        .trim_matches(['[', ']']);
    let tls = if a.no_tls {
        None
    } else {
        let files = throwaway_ca(&dir, listen_host)?;
        let args = TlsArgs {
            tls_cert: Some(files.cert.clone()),
            tls_key: Some(files.key.clone()),
            ca: Some(files.ca.clone()),
        };
        Some((args.apply()?, files.ca))
    };
    let server_tls = tls.as_ref().and_then(|(c, _)| c.clone());
    std::fs::set_permissions(dir.join("server"), std::fs::Permissions::from_mode(0o700))?;
    let rt = tokio::runtime::Runtime::new()?;
    let result = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&a.listen)
            .await
            .with_context(|| format!("listening on {}", a.listen))?;
        let scheme = if server_tls.is_some() { "https" } else { "http" };
        let local = listener.local_addr()?;
        // The certificate names 127.0.0.1, not the wildcard address.
        let host = if local.ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else {
            local.ip().to_string()
        };
        let addr = format!("{scheme}://{host}:{}", local.port());
        let served = server_tls.clone();
        tokio::spawn(async move {
            let r = match served {
                Some(cfg) => match gangway_agent::tls::TlsListener::new(listener, cfg) {
                    Ok(l) => gangway_server::serve_on(app, l).await,
                    Err(e) => Err(e.into()),
                },
                None => gangway_server::serve(app, listener).await,
            };
            if let Err(e) = r {
                tracing::error!("server: {e}");
            }
        });
        let mut agents = Vec::new();
        let host_memory_mib = gangway_agent::discovery::machine_size().1;
        let health_check = a.health.config()?;
        for i in 0..a.nodes {
            let name = format!("node-{i}");
            let mut c = AgentConfig::declared(&addr, &join, &name, a.gpus_per_node, dir.join(&name));
            c.inventory = a.gpu.declared(a.gpus_per_node);
            c.leaf = format!("leaf{}", i / a.nodes_per_leaf.max(1));
            c.executor = a.executor.into();
            // One checkpoint root for all: a resumed gang finds its checkpoint on any node.
            c.checkpoint_root = checkpoint_root.clone();
            c.sync_interval = Duration::from_millis(a.sync_ms);
            c.disk_pressure_percent = a.disk_pressure_percent;
            c.job_scratch = a.job_scratch;
            c.health_check = health_check.clone();
            c.cpu_millis = 16_000 * u64::from(a.gpus_per_node.max(1));
            // The host's real memory, shared by the nodes it plays: each
            // rank's default memory limit is its GPUs' share of it.
            c.memory_mib = (host_memory_mib / u64::from(a.nodes.max(1))).max(1024);
            c.tls = server_tls.clone();
            agents.push(Agent::start(c).await?);
        }
        let cli = dir.join("cli.yaml");
        let ca = match &tls {
            Some((_, ca)) => format!("ca: {}\n", ca.display()),
            None => String::new(),
        };
        // Whole or not at all: a script may wait for this file to appear.
        let part = dir.join("cli.yaml.part");
        crate::client::write_private(&part, &format!("addr: {addr}\ntoken: {admin}\n{ca}"))?;
        std::fs::rename(&part, &cli).with_context(|| format!("writing {}", cli.display()))?;
        // The example that fits the queues: train.yaml uses `default`.
        let example = if a.config.is_some() {
            "examples/job.yaml"
        } else {
            "examples/train.yaml"
        };
        let kept = if remove_at_exit {
            " (removed when `up` exits; --keep keeps it)"
        } else {
            ""
        };
        println!(
            "Gangway is up: {} node{} x {gpus_per_node} {model} GPUs{}, server {addr}, data in {}{kept}, ranks run as {run_as}\n\n  dashboard: {addr}/ (sign in with the token in the file below)\n  export GANGWAY_CONFIG={}\n  gangway submit {example}\n  gangway queue\n  gangway logs 1 --follow\n\nCtrl-C stops the cluster (and kills its ranks).",
            a.nodes,
            if a.nodes == 1 { "" } else { "s" },
            a.gpu
                .machine
                .as_ref()
                .map(|m| format!(" (recorded machine {})", m.display()))
                .unwrap_or_default(),
            dir.display(),
            cli.display()
        );
        let conn = crate::client::Conn::local(&addr, &admin);
        let mut ids = Vec::new();
        for f in &a.submit {
            let (conn, file) = (conn.clone(), f.clone());
            let id = tokio::task::spawn_blocking(move || crate::client::submit_id(&conn, &file, &serde_json::Map::new()))
                .await??;
            println!("submitted {} as job {id}", f.display());
            ids.push(id);
        }
        // With --exit-when-done the cluster exits with the jobs' outcome
        // (0 only if every submitted job succeeded), after stopping its agents.
        let mut outcome = Ok(());
        if a.exit_when_done && !ids.is_empty() {
            let conn2 = conn.clone();
            let ids2 = ids.clone();
            let all = a.show_output;
            let wait = tokio::task::spawn_blocking(move || {
                let r = crate::wait::wait_all(&conn2, &ids2);
                for id in &ids2 {
                    if let Err(e) = print_output(&conn2, *id, all) {
                        println!("job {id}: no output ({e:#})");
                    }
                }
                r
            });
            tokio::select! {
                r = wait => { outcome = r.map_err(anyhow::Error::from).and_then(|r| r); }
                _ = wait_for_signal() => {}
            }
        } else {
            wait_for_signal().await;
        }
        for h in agents {
            h.shutdown().await;
        }
        outcome
    });
    drop(rt);
    drop(data);
    result
}

/// `up`'s data directory: when `up` returns (on error too), removed if `up`
/// made it under the temp dir and `--keep` was not given, else kept;
/// either is said on stderr.
struct DataDir {
    dir: PathBuf,
    remove: bool,
}

impl Drop for DataDir {
    fn drop(&mut self) {
        if !self.remove {
            eprintln!("kept the data in {}", self.dir.display());
            return;
        }
        // std's remove_dir_all never follows a link a rank left in the
        // tree: it opens each directory beneath its parent's descriptor.
        match std::fs::remove_dir_all(&self.dir) {
            Ok(()) => eprintln!("removed {} (--keep keeps it)", self.dir.display()),
            Err(e) => eprintln!("warning: could not remove {}: {e}", self.dir.display()),
        }
    }
}

/// Each node's GPU count and model as the banner states them: a recorded
/// machine's own (`--machine`), else the declared `--gpus-per-node` of
/// `--gpu-model`.
fn node_gpus(a: &UpArgs) -> Result<(u32, String)> {
    let Some(m) = &a.gpu.machine else {
        return Ok((a.gpus_per_node, a.gpu.gpu_model.clone()));
    };
    let found = gangway_agent::discovery::discover(&Inventory::Machine(m.clone()))
        .with_context(|| format!("reading the machine {}", m.display()))?;
    let mut models: Vec<&str> = Vec::new();
    for g in &found.gpus {
        if !models.contains(&g.model.as_str()) {
            models.push(&g.model);
        }
    }
    let count = u32::try_from(found.gpus.len()).context("too many GPUs in the machine file")?;
    Ok((count, models.join("+")))
}

/// Lines of a failing rank's log printed when `--exit-when-done` ends.
const TAIL_LINES: usize = 20;

/// After `--exit-when-done`: every rank's output (`all`), else the last
/// [`TAIL_LINES`] lines of the first failing rank's, if the job failed.
fn print_output(c: &crate::client::Conn, id: u64, all: bool) -> Result<()> {
    use serde_json::Value;
    let job = c.get(&format!("/v1/jobs/{id}"))?;
    let attempt = job
        .get("ran_attempt")
        .and_then(Value::as_u64)
        .and_then(|a| u32::try_from(a).ok());
    if all {
        let ranks = job
            .get("ran_on")
            .and_then(Value::as_array)
            .map_or(0, Vec::len);
        for rank in 0..ranks {
            let rank = u32::try_from(rank)?;
            println!("==> job {id} rank {rank} <==");
            print!("{}", log_text(c, id, rank, attempt)?);
        }
        return Ok(());
    }
    let Some(f) = job.get("failure").filter(|f| !f.is_null()) else {
        return Ok(());
    };
    let Some(rank) = f
        .get("rank")
        .and_then(Value::as_u64)
        .and_then(|r| u32::try_from(r).ok())
    else {
        return Ok(());
    };
    let at = f
        .get("attempt")
        .and_then(Value::as_u64)
        .and_then(|a| u32::try_from(a).ok());
    let text = log_text(c, id, rank, at)?;
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(TAIL_LINES);
    println!(
        "==> job {id} rank {rank} (failed, exit code {}): last {} lines <==",
        f.get("exit_code")
            .map_or_else(String::new, Value::to_string),
        lines.len() - from
    );
    for l in &lines[from..] {
        println!("{}", gangway_core::text::printable(l));
    }
    Ok(())
}

/// A rank's whole log (of `attempt`, else the latest).
fn log_text(c: &crate::client::Conn, id: u64, rank: u32, attempt: Option<u32>) -> Result<String> {
    let mut out = String::new();
    let mut offset = 0u64;
    loop {
        let mut path = format!("/v1/jobs/{id}/logs?rank={rank}&offset={offset}");
        if let Some(a) = attempt {
            path += &format!("&attempt={a}");
        }
        let chunk = c.get(&path)?;
        let data = chunk
            .get("data")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("");
        let next = chunk
            .get("next_offset")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(offset);
        out.push_str(data);
        if data.is_empty() || next <= offset {
            return Ok(out);
        }
        offset = next;
    }
}
