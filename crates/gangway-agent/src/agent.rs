//! The agent's life: discover, register, then sync and reconcile until stopped.

use crate::config::{AgentConfig, ExecutorKind};
use crate::discovery::{discover, machine_size, Discovery, DiscoveryError};
use crate::executor::{Executor, ExecutorError, Launch, Rank, RankKey};
use crate::logs::{log_path, LogServer};
use crate::reconcile::{plan, Action, TaskKey, TaskView};
use gangway_core::agent::{node_env, rank_env, Assignment, SyncRequest, SyncResponse, TaskReport};
use gangway_core::NodeSpec;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::watch;

/// Why an agent could not start.
#[derive(Debug, Error)]
pub enum AgentError {
    /// No GPUs could be found.
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    /// The executor could not be set up.
    #[error(transparent)]
    Executor(#[from] ExecutorError),
    /// Process tracking could not be set up (`--proctrack`).
    #[error(transparent)]
    ProcTrack(#[from] crate::proctrack::ProcTrackError),
    /// Local I/O (state dir, log listener).
    #[error("agent: {0}")]
    Io(#[from] std::io::Error),
    /// The server refused the node for good.
    #[error("the server refused to register node {node}: {msg}")]
    Refused {
        /// Node.
        node: String,
        /// Server's message.
        msg: String,
    },
}

/// One rank as the agent tracks it.
struct RankRun {
    handle: Rank,
    /// Exit code of its main process (the supervisor's), when known.
    main_exit: Option<i32>,
    /// Its exit code once no process of it is left.
    done: Option<i32>,
    /// Where its supervisor writes the command's exit code.
    exit_file: PathBuf,
    /// The kernel's OOM killer killed a process of it (read from its cgroup
    /// before the cgroup is removed).
    oom_killed: bool,
    /// Its supervisor was lost and its exit code could not be learned.
    unknown_exit: bool,
}

/// One job attempt on this node.
struct Task {
    ranks: BTreeMap<u32, RankRun>,
    stop_sent: bool,
    kill_at: Option<Instant>,
    /// The job's checkpoint directory (the handshake's `LATEST` is read there).
    ckpt: Option<std::path::PathBuf>,
    /// The same under its root, as root reaches it (by descriptor).
    ckpt_at: Option<crate::checkpoint::CkptDir>,
    /// Its last good `LATEST`, read off the loop.
    latest: crate::checkpoint::LatestCache,
    /// The first rank here that exited non-zero.
    first_failure: Option<u32>,
    /// Rank 0's rendezvous port was taken: nothing was started.
    port_busy: Option<u16>,
    /// Who holds it, when that could be told.
    port_holder: Option<String>,
    /// The job's owner (empty for a task adopted after a restart).
    user: String,
    /// Each rank's memory limit in MiB (named when the kernel OOM-kills one).
    memory_mib: u64,
    /// The job's checkpoint quota on this node in bytes (0: none).
    quota: u64,
    /// Its `TMPDIR` (process ranks), measured with its checkpoint directory.
    tmp: Option<std::path::PathBuf>,
    /// Each of its directories' bytes at the last measurement.
    disk_bytes: BTreeMap<crate::disk::DirKind, u64>,
    /// It was stopped to relieve the node's disk pressure.
    pressure_victim: bool,
    /// A walk of its directories hung: it is no longer measured.
    unmeasurable: bool,
    /// The account whose entries in the node's shared `/tmp` and
    /// `/dev/shm` are swept after its last such task here (no private ones).
    sweep_uid: Option<u32>,
    /// The limit this agent stopped it for, with the value reached.
    limit: Option<String>,
    /// What is wrong with the ranks' setup without stopping them (for the
    /// job's events); filled off the loop once the account has looked.
    warnings: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Task {
    fn view(&self) -> TaskView {
        TaskView {
            exits: self.ranks.values().map(|r| r.done).collect(),
            failed: self
                .ranks
                .values()
                .filter_map(|r| r.main_exit.or(r.done))
                .find(|c| *c != 0),
            stop_sent: self.stop_sent,
        }
    }

    fn new(stop_sent: bool) -> Self {
        Task {
            ranks: BTreeMap::new(),
            stop_sent,
            kill_at: None,
            ckpt: None,
            ckpt_at: None,
            latest: Default::default(),
            first_failure: None,
            port_busy: None,
            port_holder: None,
            user: String::new(),
            memory_mib: 0,
            quota: 0,
            tmp: None,
            disk_bytes: BTreeMap::new(),
            pressure_victim: false,
            unmeasurable: false,
            sweep_uid: None,
            limit: None,
            warnings: Default::default(),
        }
    }
}

/// A short stable tag of the state directory: two agents on one machine
/// (tests, `gangway up`) never share a rank container name.
fn state_tag(dir: &std::path::Path) -> String {
    let path = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mut h: u32 = 0x811c_9dc5;
    for b in path.as_os_str().as_encoded_bytes() {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    format!("{h:08x}")
}

/// How long a stopping rank's processes get between two looks.
const POLL: Duration = Duration::from_millis(100);

/// How long a sync waits for the tasks' `LATEST` reads (on their own
/// threads) before reporting the last good values.
const LATEST_WAIT: Duration = Duration::from_millis(200);

/// How long a lost supervisor's rank waits for its job's `LATEST`, and a
/// job for the removal of its directory (then it starts at a later sync).
const FINAL_WAIT: Duration = Duration::from_millis(500);
/// How long one reconciliation pass may spend starting tasks before the
/// rest wait for the next pass (right after a sync).
const START_BUDGET: Duration = Duration::from_secs(1);

/// The node label an agent adds where the kernel has no Landlock network
/// rules (`detected-only`): ranks there can hold rendezvous ports, which
/// are only detected when rank 0 starts (docs/SECURITY.md).
pub const RENDEZVOUS_LABEL: &str = "gangway/rendezvous-ports";

/// How often checkpoint directories and free space are measured.
const DISK_CHECK: Duration = Duration::from_secs(1);

/// How long one measurement batch may run before the directory it is
/// walking is given up as unmeasurable (a filesystem that never answers,
/// such as a user's FUSE mount; the entry cap's million entries take
/// seconds on a local disk).
const MEASURE_TIMEOUT: Duration = Duration::from_secs(300);

/// A running agent.
pub struct Agent {
    cfg: AgentConfig,
    discovery: Discovery,
    executor: Executor,
    token: Arc<RwLock<String>>,
    log_token: Arc<RwLock<String>>,
    tasks: BTreeMap<TaskKey, Task>,
    exits_tx: UnboundedSender<(RankKey, i32)>,
    exits_rx: UnboundedReceiver<(RankKey, i32)>,
    agent_url: String,
    server_index: std::sync::atomic::AtomicUsize,
    /// Why the node is under disk pressure, while it is.
    disk_pressure: Option<String>,
    /// When the disk was last looked at.
    disk_checked: Option<Instant>,
    /// Measures job directories and free space off the loop (and keeps
    /// the agent's reserve).
    meter: crate::disk::Meter<TaskKey>,
    /// The node's health check and the run the server asked for.
    health: crate::health::HealthChecks,
    /// How jobs get their `/tmp` and `/dev/shm` here.
    scratch: crate::scratch::Mode,
    /// Checkpoint directories being removed (off the loop): a job that
    /// names one waits until it is gone.
    removing: Arc<std::sync::Mutex<std::collections::HashSet<PathBuf>>>,
    /// What starts need from the rendezvous side, made off the loop: the
    /// rank rulesets that keep ranks off the rendezvous range (one per
    /// range seen; rank 0's, with its own port, per start) and the names
    /// of busy ports' holders.
    rendezvous: crate::rendezvous::Prepared,
}

/// Controls an agent started with [`Agent::start`].
pub struct AgentHandle {
    /// Node name.
    pub node: String,
    /// Where the agent serves logs.
    pub log_addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl AgentHandle {
    /// Stops the agent: its ranks are killed (unless the agent was
    /// configured to leave them for its successor), then it returns.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// How an agent is given the cluster's CA (for certificate errors).
const CA_HOW: &str = "start the agent with --ca FILE, the CA certificate that signed the server's (`gangway up` writes it as ca.pem in its data directory)";

enum SyncError {
    /// The server does not know the node or its token: register again.
    Unregistered(String),
    Other(String),
}

fn post_json<T: serde::de::DeserializeOwned>(
    url: &str,
    token: &str,
    body: &impl serde::Serialize,
) -> Result<T, (Option<u16>, String)> {
    let r = crate::tls::http()
        .post(url)
        .set("Authorization", &format!("Bearer {token}"))
        .set(
            gangway_core::agent::VERSION_HEADER,
            gangway_core::agent::VERSION,
        )
        .timeout(Duration::from_secs(5))
        .send_json(body);
    match r {
        Ok(resp) => resp.into_json::<T>().map_err(|e| (None, e.to_string())),
        Err(ureq::Error::Status(code, resp)) => {
            let text = resp.into_string().unwrap_or_default();
            Err((Some(code), text))
        }
        Err(e) => Err((None, e.to_string())),
    }
}

/// Whether the server that answered a registration (its `server_version`;
/// none: 0.1) may be worked with under the version-skew policy.
fn server_version_ok(answer: &serde_json::Value) -> Result<(), gangway_core::agent::SkewError> {
    use gangway_core::agent::{check_skew, Version, UNSTATED_VERSION};
    let server = match answer["server_version"].as_str() {
        Some(s) => s.parse::<Version>()?,
        None => UNSTATED_VERSION,
    };
    check_skew(server, Version::current())
}

impl Agent {
    /// Discovers the GPUs, starts the log server, registers with the server
    /// (retrying until it answers) and starts syncing.
    pub async fn start(cfg: AgentConfig) -> Result<AgentHandle, AgentError> {
        std::fs::create_dir_all(&cfg.state_dir)?;
        std::fs::create_dir_all(&cfg.checkpoint_root)?;
        crate::sandbox::protect_state_dir(&cfg.state_dir)?;
        // Jobs under it would all be refused: say so at once.
        if let Err(e) = crate::safefs::open_base(&cfg.checkpoint_root) {
            tracing::error!("checkpoint root: {e}; jobs using it will be refused");
        }
        let discovery = discover(&cfg.inventory)?;
        let track = crate::proctrack::detect(cfg.proctrack, &cfg.cgroup_parent)?;
        let executor = Executor::new(
            cfg.executor == ExecutorKind::Docker,
            cfg.gpu_runtime,
            &cfg.node,
            track,
            &state_tag(&cfg.state_dir),
        )
        .await?;
        let listener = tokio::net::TcpListener::bind(&cfg.listen).await?;
        let log_addr = listener.local_addr()?;
        let host = if log_addr.ip().is_unspecified() {
            cfg.address.clone()
        } else {
            log_addr.ip().to_string()
        };
        let scheme = if cfg.tls.is_some() { "https" } else { "http" };
        let agent_url = format!("{scheme}://{host}:{}", log_addr.port());
        let token = Arc::new(RwLock::new(String::new()));
        let log_token = Arc::new(RwLock::new(String::new()));
        let logs = LogServer {
            dir: cfg.state_dir.join("logs"),
            token: log_token.clone(),
        };
        let tls = cfg.tls.clone();
        tokio::spawn(async move {
            if let Err(e) = crate::tls::serve(listener, tls, crate::logs::router(logs)).await {
                tracing::error!("log server: {e}");
            }
        });
        tracing::info!(
            "agent {}: {} GPUs ({}), {:?} executor, {:?} process tracking, logs on {agent_url}",
            cfg.node,
            discovery.gpus.len(),
            discovery.source,
            cfg.executor,
            executor.track().kind()
        );
        match crate::landlock::support() {
            Ok(abi) => tracing::info!(
                "agent {}: Landlock ABI {abi}: process ranks may bind no rendezvous port but their job's own",
                cfg.node
            ),
            Err(why) => tracing::warn!(
                "agent {}: {why}; process ranks are not kept off rendezvous ports, a port another process holds is only detected when rank 0 starts",
                cfg.node
            ),
        }
        let (exits_tx, exits_rx) = unbounded_channel();
        let (stop, stop_rx) = watch::channel(false);
        let node = cfg.node.clone();
        let reserve = crate::disk::Reserve::new(&cfg.state_dir);
        let health_check = cfg.health_check.clone();
        let scratch = crate::scratch::mode(cfg.job_scratch);
        if scratch == crate::scratch::Mode::Sweep {
            tracing::warn!(
                "node {}: no mount namespaces here (not root?): jobs share the node's /tmp and /dev/shm; \
                 each account's entries there are removed when its last job on the node ends",
                cfg.node
            );
        }
        let mut agent = Agent {
            cfg,
            discovery,
            executor,
            token,
            log_token,
            tasks: BTreeMap::new(),
            exits_tx,
            exits_rx,
            agent_url,
            server_index: Default::default(),
            disk_pressure: None,
            disk_checked: None,
            meter: crate::disk::Meter::new(reserve),
            health: crate::health::HealthChecks::new(health_check),
            scratch,
            removing: Default::default(),
            rendezvous: crate::rendezvous::Prepared::default(),
        };
        agent.adopt_leftovers().await;
        agent.sweep_tmp();
        agent.register(stop_rx.clone()).await?;
        let task = tokio::spawn(agent.run(stop_rx));
        Ok(AgentHandle {
            node,
            log_addr,
            stop,
            task,
        })
    }

    /// Ranks left by an earlier run of this agent (it crashed, was killed or
    /// upgraded) are adopted, not killed: found again through their
    /// container (cgroup, or the subreaper's marker) and supervisor identity,
    /// they stay in the task table and are reported as before; ranks that
    /// ended meanwhile are reported with the code their supervisor wrote.
    /// Only what the server no longer wants is then stopped by the plan.
    async fn adopt_leftovers(&mut self) {
        let track = self.executor.track().clone();
        let records = crate::leftovers::recorded(&self.cfg.state_dir);
        let keep: Vec<_> = records.iter().map(|r| r.container.clone()).collect();
        track.sweep(&keep);
        for r in records {
            let k = r.key();
            if r.supervisor_alive() {
                track.adopt(&r.container, r.pid);
            }
            let exit_file = crate::leftovers::exit_file(&self.cfg.state_dir, k);
            let handle = Rank::Process {
                pid: r.pid,
                container: r.container.clone(),
            };
            let left = !track.is_empty(&r.container);
            tracing::info!(
                "job {} attempt {} rank {}: left by an earlier agent; {}",
                k.job,
                k.attempt,
                k.rank,
                if left {
                    "still running, adopted"
                } else {
                    "ended meanwhile"
                }
            );
            let t = self
                .tasks
                .entry((k.job, k.attempt))
                .or_insert_with(|| Task::new(false));
            if t.ckpt.is_none() {
                t.ckpt = r.checkpoint_dir.clone();
                t.ckpt_at = r.checkpoint(&self.cfg.checkpoint_root);
            }
            t.ranks.insert(
                k.rank,
                RankRun {
                    handle,
                    main_exit: None,
                    done: None,
                    exit_file,
                    oom_killed: false,
                    unknown_exit: false,
                },
            );
        }
        for (k, _signal, _grace, exit) in self
            .executor
            .adopt_containers(&self.cfg.state_dir.join("logs"), self.exits_tx.clone())
            .await
        {
            let t = self
                .tasks
                .entry((k.job, k.attempt))
                .or_insert_with(|| Task::new(false));
            t.ranks.insert(
                k.rank,
                RankRun {
                    handle: exit.map_or_else(
                        || Rank::Container(self.executor.docker_name(k)),
                        |_| Rank::NotStarted,
                    ),
                    main_exit: exit,
                    done: exit,
                    exit_file: PathBuf::new(),
                    oom_killed: false,
                    unknown_exit: false,
                },
            );
        }
        self.poll_ranks();
    }

    /// The server replica in use: `--server` may list several, comma-separated.
    fn server(&self) -> String {
        let all: Vec<&str> = self
            .cfg
            .server
            .split(',')
            .map(|s| s.trim().trim_end_matches('/'))
            .filter(|s| !s.is_empty())
            .collect();
        let i = self.server_index.load(std::sync::atomic::Ordering::Relaxed);
        all.get(i % all.len().max(1)).unwrap_or(&"").to_string()
    }

    fn next_server(&self) {
        self.server_index
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The memory this node offers: the declared size, capped at the real one.
    fn node_memory_mib(&self) -> u64 {
        crate::limits::node_memory_mib(self.cfg.memory_mib, machine_size().1)
    }

    fn node_spec(&self) -> NodeSpec {
        let (cpu, _) = machine_size();
        let labels = node_labels(&self.cfg.labels, crate::landlock::support().is_ok());
        NodeSpec {
            name: self.cfg.node.clone(),
            gpus: self.discovery.gpus.clone(),
            cpu_millis: if self.cfg.cpu_millis > 0 {
                self.cfg.cpu_millis
            } else {
                cpu
            },
            memory_mib: self.node_memory_mib(),
            leaf: self.cfg.leaf.clone(),
            spine: self.cfg.spine.clone(),
            labels,
            cordoned: false,
            address: self.cfg.address.clone(),
            agent_url: Some(self.agent_url.clone()),
        }
    }

    /// Registers until the server answers; a 4xx other than auth is final.
    async fn register(&mut self, mut stop: watch::Receiver<bool>) -> Result<(), AgentError> {
        let spec = self.node_spec();
        let mut warned = false;
        let mut cert_failures = 0u32;
        loop {
            let url = format!("{}/v1/nodes", self.server());
            // A registered node comes back with its own token; a new one joins.
            let own = crate::credentials::load(&self.cfg.state_dir);
            let bearer = own.clone().unwrap_or_else(|| self.cfg.join_token.clone());
            let (u, t, s) = (url, bearer, spec.clone());
            let r = tokio::task::spawn_blocking(move || post_json::<serde_json::Value>(&u, &t, &s))
                .await
                .unwrap_or_else(|e| Err((None, e.to_string())));
            match r {
                Ok(v) => {
                    if let Err(e) = server_version_ok(&v) {
                        return Err(AgentError::Refused {
                            node: self.cfg.node.clone(),
                            msg: e.to_string(),
                        });
                    }
                    let tok = match v["node_token"].as_str() {
                        Some(t) => {
                            crate::credentials::save(&self.cfg.state_dir, t)?;
                            t.to_string()
                        }
                        None => own.unwrap_or_default(),
                    };
                    if let Ok(mut g) = self.token.write() {
                        *g = tok;
                    }
                    // The server reads logs with the node's log key.
                    let log = v["log_token"].as_str().unwrap_or_default().to_string();
                    if let Ok(mut g) = self.log_token.write() {
                        *g = log;
                    }
                    if v["pending_approval"] == serde_json::Value::Bool(true) {
                        tracing::warn!(
                            "node {} waits for an admin's approval (gangway nodes approve {})",
                            self.cfg.node,
                            self.cfg.node
                        );
                    }
                    tracing::info!("node {} registered with {}", self.cfg.node, self.server());
                    return Ok(());
                }
                Err((Some(401), _)) if own.is_some() => {
                    tracing::warn!(
                        "node {}: the server no longer knows this node's token; joining again",
                        self.cfg.node
                    );
                    crate::credentials::forget(&self.cfg.state_dir);
                    continue;
                }
                Err((Some(code), msg))
                    if (400..500).contains(&code) && code != 401 && code != 429 =>
                {
                    return Err(AgentError::Refused {
                        node: self.cfg.node.clone(),
                        msg: format!("{code} {msg}"),
                    });
                }
                Err((_, msg)) => {
                    // A certificate that does not verify will not verify on
                    // the next try either: say so, and which CA, at once and
                    // then every 30 s or so (60 tries).
                    if let Some(hint) = crate::tls::certificate_hint(&msg, CA_HOW) {
                        if cert_failures.is_multiple_of(60) {
                            tracing::error!(
                                "cannot register with {}: {msg}: {hint}; retrying",
                                self.server()
                            );
                        }
                        cert_failures = cert_failures.wrapping_add(1);
                    } else if !warned {
                        tracing::warn!("cannot register with {}: {msg}; retrying", self.server());
                        warned = true;
                    }
                    self.next_server();
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = stop.changed() => return Ok(()),
            }
        }
    }

    /// The main process of a rank exited (or a container or an unstarted
    /// rank ended, which leaves nothing behind).
    fn record_exit(&mut self, k: RankKey, code: i32) {
        if let Some(r) = self
            .tasks
            .get_mut(&(k.job, k.attempt))
            .and_then(|t| t.ranks.get_mut(&k.rank))
        {
            r.main_exit.get_or_insert(code);
            if !matches!(r.handle, Rank::Process { .. }) {
                r.done.get_or_insert(code);
            }
        }
        if code != 0 {
            if let Some(t) = self.tasks.get_mut(&(k.job, k.attempt)) {
                t.first_failure.get_or_insert(k.rank);
            }
        }
        self.poll_ranks();
    }

    /// Marks done every process rank none of whose processes is left: its
    /// code is the one its supervisor wrote (the command's), else its main
    /// process's, else (supervisor lost) what [`lost_supervisor_exit`] decides.
    /// Returns whether any rank became done.
    fn poll_ranks(&mut self) -> bool {
        let mut changed = false;
        let mut finished = Vec::new();
        for ((job, attempt), t) in &mut self.tasks {
            let (ckpt, stop_sent) = (t.ckpt_at.as_ref(), t.stop_sent);
            for (rank, r) in &mut t.ranks {
                if r.done.is_some() || !matches!(r.handle, Rank::Process { .. }) {
                    continue;
                }
                if self.executor.alive(&r.handle) {
                    continue;
                }
                let k = RankKey {
                    job: *job,
                    attempt: *attempt,
                    rank: *rank,
                };
                let code = match crate::supervisor::read_exit(&r.exit_file).or(r.main_exit) {
                    Some(code) => code,
                    None => {
                        let (code, unknown) = lost_supervisor_exit(
                            &self.cfg.state_dir,
                            k,
                            ckpt.map(|d| (d, &t.latest)),
                            stop_sent,
                        );
                        r.unknown_exit = unknown;
                        code
                    }
                };
                r.main_exit.get_or_insert(code);
                r.done = Some(code);
                r.oom_killed |= self.executor.oom_killed(&r.handle);
                if code != 0 {
                    // Found here before its exit came through the channel.
                    t.first_failure.get_or_insert(*rank);
                }
                self.executor.release(&r.handle);
                finished.push(k);
                changed = true;
            }
        }
        for k in finished {
            crate::leftovers::forget(&self.cfg.state_dir, k);
        }
        changed
    }

    /// Whether a rank's processes must be watched closely: its main process
    /// ended but others remain, it was adopted, or a stop is under way.
    fn watching(&self) -> bool {
        self.tasks.values().any(|t| {
            t.view().alive()
                && (t.stop_sent
                    || t.ranks.values().any(|r| {
                        r.done.is_none() && (r.main_exit.is_some() || r.exit_file.exists())
                    }))
        })
    }

    /// What the agent tells the server about one task: its state, the
    /// checkpoint its ranks announced, its first failed rank, a busy port.
    fn task_report(&self, (job, attempt): TaskKey, t: &Task) -> TaskReport {
        let failure = t.first_failure.and_then(|rank| {
            let r = t.ranks.get(&rank)?;
            let code = r.main_exit.or(r.done)?;
            let log = log_path(&self.cfg.state_dir.join("logs"), job.0, attempt, rank);
            let mut f = crate::checkpoint::rank_failure(rank, code, &log);
            f.oom_killed = r.oom_killed || self.executor.oom_killed(&r.handle);
            if f.oom_killed && t.memory_mib > 0 {
                f.limit = Some(crate::limits::memory_limit_text(t.memory_mib));
            }
            if t.limit.is_some() {
                f.limit = t.limit.clone();
            }
            // The failed rank's node fault, else another rank's (processes
            // that survived SIGKILL after a peer's failure).
            let fault = |rank| {
                self.executor
                    .node_fault(crate::executor::RankKey { job, attempt, rank })
            };
            f.node_fault = fault(rank).or_else(|| t.ranks.keys().find_map(|r| fault(*r)));
            f.unknown_exit = r.unknown_exit;
            Some(f)
        });
        TaskReport {
            checkpoint: t.latest.value().map(|l| l.report),
            failure,
            port_busy: t.port_busy,
            port_holder: t.port_holder.clone(),
            warnings: t.warnings.lock().map(|w| w.clone()).unwrap_or_default(),
            ..TaskReport::new(job, attempt, t.view().state())
        }
    }

    fn drain_exits(&mut self) {
        while let Ok((k, code)) = self.exits_rx.try_recv() {
            self.record_exit(k, code);
        }
    }

    async fn sync(&self) -> Result<SyncResponse, SyncError> {
        // Each task's `LATEST` is read on a thread of its own (one at a time
        // per task); what has not come back in time is reported as before.
        let reading: Vec<&crate::checkpoint::LatestCache> = self
            .tasks
            .values()
            .filter_map(|t| {
                let dir = t.ckpt_at.as_ref()?;
                t.latest.start(dir);
                Some(&t.latest)
            })
            .collect();
        let until = Instant::now() + LATEST_WAIT;
        while reading.iter().any(|c| c.busy()) && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let req = SyncRequest {
            disk_pressure: self.disk_pressure.clone(),
            health_check: self.health.configured(),
            health_check_run: self.health.report(),
            reads_rendezvous_ports: true,
            reads_gang_nodes: true,
            gpus: self.discovery.health(&self.cfg.state_dir),
            tasks: self
                .tasks
                .iter()
                .map(|(k, t)| self.task_report(*k, t))
                .collect(),
        };
        let url = format!("{}/v1/agent/{}/sync", self.server(), self.cfg.node);
        let token = self.token.read().map(|t| t.clone()).unwrap_or_default();
        let r = tokio::task::spawn_blocking(move || post_json::<SyncResponse>(&url, &token, &req))
            .await
            .unwrap_or_else(|e| Err((None, e.to_string())));
        r.map_err(|(code, msg)| match code {
            Some(401 | 403 | 404) => SyncError::Unregistered(msg),
            _ => SyncError::Other(msg),
        })
    }

    async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut failing_since: Option<Instant> = None;
        let mut last_sync: Option<Instant> = None;
        let mut changed = true;
        loop {
            if *stop.borrow() {
                break;
            }
            self.drain_exits();
            changed |= self.poll_ranks();
            while let Ok(r) = self.meter.results.try_recv() {
                changed |= self.apply_disk(r);
            }
            self.watch_disk();
            changed |= self.health.poll();
            // A start put off for its rendezvous side may go ahead.
            changed |= self.rendezvous.poll();
            self.enforce_grace().await;
            changed |= self.give_up_unkillable();
            let due = match last_sync {
                None => true,
                Some(t) => t.elapsed() >= self.cfg.sync_interval,
            };
            if changed || due {
                changed = false;
                last_sync = Some(Instant::now());
                match self.sync().await {
                    Ok(resp) => {
                        if failing_since.take().is_some() {
                            tracing::info!("node {}: server reachable again", self.cfg.node);
                        }
                        for c in resp.cleanup {
                            self.remove_checkpoints(c);
                        }
                        let env = self.health_env();
                        self.health.want(resp.health_check, &env);
                        // Report what was just started or stopped without waiting a period.
                        changed = self.reconcile(resp.assignments).await;
                    }
                    Err(SyncError::Unregistered(msg)) => {
                        tracing::warn!("node {}: {msg}; registering again", self.cfg.node);
                        if self.register(stop.clone()).await.is_err() {
                            break;
                        }
                        changed = true;
                        continue;
                    }
                    Err(SyncError::Other(msg)) => {
                        // Unreachable server: ranks keep running (a partition may
                        // heal); the server decides what happens to them. Another
                        // replica, if there are several, is tried next.
                        self.next_server();
                        if failing_since.is_none() {
                            match crate::tls::certificate_hint(&msg, CA_HOW) {
                                Some(hint) => tracing::error!(
                                    "node {}: sync failed: {msg}: {hint}",
                                    self.cfg.node
                                ),
                                None => {
                                    tracing::warn!("node {}: sync failed: {msg}", self.cfg.node)
                                }
                            }
                            failing_since = Some(Instant::now());
                        }
                    }
                }
            }
            if changed {
                continue;
            }
            let mut wait = last_sync.map_or(Duration::ZERO, |t| {
                self.cfg.sync_interval.saturating_sub(t.elapsed())
            });
            if let Some(d) = self.next_deadline() {
                wait = wait.min(d.saturating_duration_since(Instant::now()));
            }
            if self.watching() || self.health.running() || self.rendezvous.making() {
                wait = wait.min(POLL);
            }
            if !self.meter.busy() && self.tasks.values().any(|t| t.view().alive()) {
                let next = self
                    .disk_checked
                    .map_or(Duration::ZERO, |t| DISK_CHECK.saturating_sub(t.elapsed()));
                wait = wait.min(next);
            }
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                Some((k, code)) = self.exits_rx.recv() => {
                    self.record_exit(k, code);
                    changed = true;
                }
                Some(r) = self.meter.results.recv() => {
                    changed |= self.apply_disk(r);
                }
                _ = stop.changed() => {}
            }
        }
        if self.cfg.leave_ranks_on_exit {
            tracing::info!(
                "node {}: leaving {} tasks running for the next agent to adopt",
                self.cfg.node,
                self.tasks.len()
            );
        } else {
            self.kill_all().await;
        }
    }

    /// The health check's whole environment: a minimal base, the agent's
    /// `--pass-env` variables, the node's name and all of its GPUs (by
    /// UUID where known, in PCI bus order as `nvidia-smi` counts them).
    fn health_env(&self) -> Vec<(String, String)> {
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        env.insert(
            "PATH".into(),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
        );
        for k in &self.cfg.pass_env {
            if let Ok(v) = std::env::var(k) {
                env.insert(k.clone(), v);
            }
        }
        let gpus = &self.discovery.gpus;
        let uuids: Option<Vec<String>> = gpus.iter().map(|g| g.uuid.clone()).collect();
        let devices = uuids.unwrap_or_else(|| gpus.iter().map(|g| g.index.to_string()).collect());
        env.insert("CUDA_VISIBLE_DEVICES".into(), devices.join(","));
        env.insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
        env.insert("GANGWAY_NODE".into(), self.cfg.node.clone());
        env.into_iter().collect()
    }

    /// Every [`DISK_CHECK`] (and never while one runs): hands the meter a
    /// batch with each running job's checkpoint directory and `TMPDIR` and
    /// the agent's filesystems; [`Agent::apply_disk`] acts on its report.
    fn watch_disk(&mut self) {
        if let Some(at) = self.meter.stuck(MEASURE_TIMEOUT) {
            // A directory whose walk hangs (a filesystem that never answers)
            // fails closed; it is never measured again, so the others are.
            let e = crate::disk::WalkError::TooSlow(MEASURE_TIMEOUT.as_secs());
            match at.and_then(|(k, kind)| self.tasks.get_mut(&k).map(|t| (k, kind, t))) {
                Some((k, kind, t)) => {
                    let why = crate::disk::unmeasured_text(kind, &e);
                    tracing::warn!("job {} attempt {}: {why}", k.0, k.1);
                    t.unmeasurable = true;
                    if t.quota > 0 && t.limit.is_none() && t.view().alive() {
                        t.limit = Some(why);
                        t.kill_at = Some(Instant::now());
                    }
                }
                None => tracing::warn!("node {}: free space could not be read: {e}", self.cfg.node),
            }
        }
        if self.meter.busy() || self.disk_checked.is_some_and(|t| t.elapsed() < DISK_CHECK) {
            return;
        }
        self.disk_checked = Some(Instant::now());
        use crate::disk::DirKind;
        let jobs = self
            .tasks
            .iter()
            .filter(|(_, t)| t.view().alive() && t.limit.is_none() && !t.unmeasurable)
            .map(|(k, t)| {
                let dirs = [
                    t.ckpt.clone().map(|d| (DirKind::Checkpoint, d)),
                    t.tmp.clone().map(|d| (DirKind::Tmpdir, d)),
                ];
                (*k, dirs.into_iter().flatten().collect())
            })
            .collect();
        let percent = self.cfg.disk_pressure_percent;
        self.meter.start(crate::disk::Batch {
            jobs,
            roots: vec![self.cfg.state_dir.clone(), self.cfg.checkpoint_root.clone()],
            percent,
        });
    }

    /// Acts on a measurement: a job whose directories together (checkpoint
    /// directory with its home, and `TMPDIR`) are over its checkpoint quota,
    /// or could not be measured while it has a quota, is stopped. Under
    /// pressure the node says so (and takes no new work), and, unless an
    /// earlier victim is still here, the job writing most to a filesystem
    /// under pressure is stopped: an unmeasurable one first, then the most
    /// growth since the last look, then the most bytes there, then the
    /// lowest job and attempt. Returns whether the server must hear.
    fn apply_disk(&mut self, r: crate::disk::Report<TaskKey>) -> bool {
        use crate::disk::Usage;
        if !self.meter.take(&r) {
            return false;
        }
        let mut changed = false;
        let pressured = r
            .pressure
            .as_ref()
            .map(|(_, d)| d.clone())
            .unwrap_or_default();
        type Rank = (bool, u64, u64, std::cmp::Reverse<TaskKey>);
        let mut top: Option<Rank> = None;
        for (k, dirs) in r.jobs {
            let Some(t) = self.tasks.get_mut(&k) else {
                continue;
            };
            if !t.view().alive() || t.limit.is_some() {
                continue;
            }
            let mut parts = Vec::new();
            let mut failed = None;
            let (mut grew, mut there, mut writes_there) = (0u64, 0u64, false);
            for d in &dirs {
                match &d.usage {
                    Usage::Measured(b) => {
                        let before = t.disk_bytes.insert(d.kind, *b).unwrap_or(0);
                        parts.push((d.kind, *b));
                        if pressured.contains(&d.dev) {
                            writes_there = true;
                            grew = grew.saturating_add(b.saturating_sub(before));
                            there = there.saturating_add(*b);
                        }
                    }
                    Usage::Failed(e) => {
                        failed.get_or_insert((d.kind, e.clone()));
                    }
                }
            }
            let used = parts.iter().fold(0u64, |a, (_, b)| a.saturating_add(*b));
            let over = match &failed {
                Some((kind, e)) => (t.quota > 0).then(|| crate::disk::unmeasured_text(*kind, e)),
                None => (t.quota > 0 && used > t.quota)
                    .then(|| crate::disk::quota_text(t.quota, &parts)),
            };
            if let Some(why) = over {
                tracing::warn!("job {} attempt {}: {why}; stopping it", k.0, k.1);
                t.limit = Some(why);
                t.kill_at = Some(Instant::now());
                changed = true;
                continue;
            }
            if writes_there || failed.is_some() {
                let rank = (failed.is_some(), grew, there, std::cmp::Reverse(k));
                if top.as_ref().is_none_or(|t| rank > *t) {
                    top = Some(rank);
                }
            }
        }
        // Jobs whose walk hung are never measured again: under pressure they
        // come first (fail closed).
        for (k, t) in &self.tasks {
            if t.unmeasurable && t.view().alive() && t.limit.is_none() {
                let rank = (true, u64::MAX, u64::MAX, std::cmp::Reverse(*k));
                if top.as_ref().is_none_or(|t| rank > *t) {
                    top = Some(rank);
                }
            }
        }
        let pressure = r.pressure.map(|(why, _)| why);
        if let Some(why) = &pressure {
            if self.disk_pressure.is_none() {
                tracing::error!("node {}: {why}", self.cfg.node);
            }
            let earlier = self.tasks.values().any(|t| t.pressure_victim);
            if let (false, Some((_, _, _, std::cmp::Reverse(k)))) = (earlier, top) {
                if let Some(t) = self.tasks.get_mut(&k) {
                    let why = format!("stopped for the node's disk pressure, writing most ({why})");
                    tracing::warn!("job {} attempt {}: {why}", k.0, k.1);
                    t.limit = Some(why);
                    t.kill_at = Some(Instant::now());
                    t.pressure_victim = true;
                    changed = true;
                }
            }
        }
        if pressure != self.disk_pressure {
            self.disk_pressure = pressure;
            changed = true;
        }
        changed
    }

    /// The next grace deadline still ahead (past ones are re-killed at
    /// each look, every [`POLL`], not in a busy loop).
    fn next_deadline(&self) -> Option<Instant> {
        let now = Instant::now();
        self.tasks
            .values()
            .filter(|t| t.view().alive())
            .filter_map(|t| t.kill_at)
            .filter(|d| *d > now)
            .min()
    }

    /// Every process still left of a task whose grace period is over is
    /// killed (again at each look, until none is left).
    async fn enforce_grace(&mut self) {
        let now = Instant::now();
        let due: Vec<TaskKey> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.kill_at.is_some_and(|d| d <= now) && t.view().alive())
            .map(|(k, _)| *k)
            .collect();
        for k in due {
            tracing::info!(
                "job {} attempt {}: grace period over; killing what is left",
                k.0,
                k.1
            );
            self.signal_task(k, libc::SIGKILL).await;
        }
    }

    /// "Kill task failed": ranks whose processes survived SIGKILL for the
    /// kill timeout after their grace (unkillable: D state, a frozen
    /// cgroup) are given up on. Each is a fault of the node, reported with
    /// the rank's failure so the server blames (and cordons) the node; the
    /// rank counts as ended (killed), so its job ends and the node goes on
    /// reporting. The processes are left where they are, in the rank's
    /// cgroup, for an operator. Returns whether any rank was given up.
    fn give_up_unkillable(&mut self) -> bool {
        let now = Instant::now();
        let timeout = self.cfg.kill_timeout;
        let logs = self.cfg.state_dir.join("logs");
        let mut gone = Vec::new();
        for (k, t) in self.tasks.iter_mut() {
            let Some(kill_at) = t.kill_at else { continue };
            if now.saturating_duration_since(kill_at) < timeout {
                continue;
            }
            for (rank, r) in t.ranks.iter_mut().filter(|(_, r)| r.done.is_none()) {
                let left = self.executor.processes_left(&r.handle);
                if left == 0 {
                    continue;
                }
                let why = format!(
                    "kill task failed: {} of rank {rank} survived SIGKILL for {}s",
                    if left == 1 {
                        "1 process".to_string()
                    } else {
                        format!("{left} processes")
                    },
                    timeout.as_secs()
                );
                tracing::error!("job {} attempt {}: {why}", k.0, k.1);
                let key = crate::executor::RankKey {
                    job: k.0,
                    attempt: k.1,
                    rank: *rank,
                };
                crate::executor::note(&log_path(&logs, k.0 .0, k.1, *rank), &why);
                self.executor.note_node_fault(key, why);
                r.done = Some(r.main_exit.unwrap_or(128 + libc::SIGKILL));
                t.first_failure.get_or_insert(*rank);
                gone.push(key);
            }
        }
        for k in &gone {
            // A restarted agent does not wait for them either.
            crate::leftovers::forget(&self.cfg.state_dir, *k);
        }
        !gone.is_empty()
    }

    /// Signals every process of every rank of a task that has any left,
    /// including ranks whose main process already exited.
    async fn signal_task(&self, k: TaskKey, sig: i32) {
        if let Some(t) = self.tasks.get(&k) {
            for r in t.ranks.values().filter(|r| r.done.is_none()) {
                self.executor.signal(&r.handle, sig).await;
            }
        }
    }

    /// Kills every process of a task and waits (bounded) until none is
    /// left, so its GPUs are free before anything else starts on them.
    async fn kill_and_reap(&mut self, k: TaskKey) {
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.tasks.get(&k).is_some_and(|t| t.view().alive()) {
            if Instant::now() >= deadline {
                tracing::error!(
                    "job {} attempt {}: processes survived SIGKILL for 15s",
                    k.0,
                    k.1
                );
                break;
            }
            self.signal_task(k, libc::SIGKILL).await;
            if let Ok(Some((rk, code))) =
                tokio::time::timeout(Duration::from_millis(20), self.exits_rx.recv()).await
            {
                self.record_exit(rk, code);
            }
            self.drain_exits();
            self.poll_ranks();
        }
    }

    async fn kill_all(&mut self) {
        let keys: Vec<TaskKey> = self.tasks.keys().copied().collect();
        for k in keys {
            self.kill_and_reap(k).await;
            crate::scratch::remove(&self.cfg.state_dir, k.0 .0, k.1);
        }
    }

    /// Applies the plan; returns whether anything changed.
    async fn reconcile(&mut self, desired: Vec<Assignment>) -> bool {
        // A checkpoint reported after the signal ends the grace early.
        for a in desired.iter().filter(|a| a.stop_now) {
            if let Some(t) = self.tasks.get_mut(&(a.job, a.attempt)) {
                if t.stop_sent && t.view().alive() {
                    let now = Instant::now();
                    let later = match t.kill_at {
                        Some(d) => d > now,
                        None => true,
                    };
                    if later {
                        tracing::info!(
                            "job {} attempt {}: checkpoint reported; stopping without the rest of the grace",
                            a.job,
                            a.attempt
                        );
                        t.kill_at = Some(now);
                    }
                }
            }
        }
        let local: BTreeMap<TaskKey, TaskView> =
            self.tasks.iter().map(|(k, t)| (*k, t.view())).collect();
        let actions = plan(&desired, &local);
        let began = Instant::now();
        // A start put off (its rendezvous side is being made) is no change.
        let mut acted = actions.iter().any(|a| !matches!(a, Action::Start(_)));
        for a in actions {
            match a {
                Action::Kill(k) => {
                    tracing::info!(
                        "job {} attempt {}: no longer wanted here; killing",
                        k.0,
                        k.1
                    );
                    self.kill_and_reap(k).await;
                    self.forget_task(k);
                }
                Action::Forget(k) => self.forget_task(k),
                Action::Checkpoint {
                    key: k,
                    signal: sig,
                    grace_seconds,
                } => {
                    let grace = Duration::from_secs(grace_seconds);
                    tracing::info!(
                        "job {} attempt {}: stopping; signal {sig} to every process, {}s to checkpoint",
                        k.0,
                        k.1,
                        grace.as_secs()
                    );
                    // The whole gang on this node gets the signal at once and
                    // shares one deadline, however early some ranks exit.
                    self.signal_task(k, sig).await;
                    if let Some(t) = self.tasks.get_mut(&k) {
                        t.stop_sent = true;
                        t.kill_at = Some(deadline_after(grace));
                    }
                }
                Action::Start(a) => {
                    // Many starts at once (each rank's Landlock domain costs
                    // the kernel ~15 ms): the rest wait for the next pass, so
                    // the node still reports to the server in between.
                    if began.elapsed() >= START_BUDGET {
                        acted = true;
                        continue;
                    }
                    acted |= self.start_task(*a).await
                }
            }
        }
        acted
    }

    /// Removes a succeeded job's checkpoint directory on a thread of its own
    /// (a tree of any size); until it is gone, no job starts in it.
    fn remove_checkpoints(&self, c: gangway_core::agent::CheckpointCleanup) {
        let root = self.cfg.checkpoint_root.clone();
        let Some(path) = crate::checkpoint::checkpoint_dir(&root, c.root.as_deref(), &c.subdir)
            .map(|d| d.path())
        else {
            tracing::warn!("refusing to remove checkpoint directory {:?}", c.subdir);
            return;
        };
        let set = self.removing.clone();
        if let Ok(mut s) = set.lock() {
            s.insert(path.clone());
        }
        let (done, at) = (set.clone(), path.clone());
        let spawned = std::thread::Builder::new()
            .name("gangway-cleanup".into())
            .spawn(move || {
                crate::checkpoint::remove_dir(&root, c.root.as_deref(), &c.subdir);
                if let Ok(mut s) = done.lock() {
                    s.remove(&at);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot remove checkpoints {}: {e}", path.display());
            if let Ok(mut s) = set.lock() {
                s.remove(&path);
            }
        }
    }

    /// Drops a task none of whose processes is left, with its `TMPDIR`.
    fn forget_task(&mut self, k: TaskKey) {
        let gone = self.tasks.remove(&k);
        crate::scratch::remove(&self.cfg.state_dir, k.0 .0, k.1);
        if let Some(uid) = gone.and_then(|t| t.sweep_uid) {
            if crate::scratch::release_shared(uid) {
                // The account's last job here: its files in the node's /tmp
                // and /dev/shm go (off the loop: they are the user's).
                let _ = std::thread::Builder::new()
                    .name("gangway-sweep".into())
                    .spawn(move || {
                        let n = crate::scratch::sweep_account(uid);
                        if n > 0 {
                            tracing::info!(
                                "removed {n} entries of uid {uid} from /tmp and /dev/shm"
                            );
                        }
                    });
            }
        }
        self.executor.forget_node_faults(k.0, k.1);
        // A rank's tree of any size is removed off the loop.
        let tmp = crate::sandbox::tmp_dir(&self.cfg.state_dir, k.0 .0, k.1);
        let spawned = std::thread::Builder::new()
            .name("gangway-tmp".into())
            .spawn(move || crate::sandbox::remove_tmp(&tmp));
        if let Err(e) = spawned {
            tracing::warn!("cannot remove a TMPDIR: {e}");
        }
    }

    /// Removes the `TMPDIR`s of tasks this agent does not know (left by an
    /// agent that was killed after they ended).
    fn sweep_tmp(&self) {
        let root = self.cfg.state_dir.join("tmp");
        let keep: std::collections::BTreeSet<PathBuf> = self
            .tasks
            .keys()
            .map(|k| crate::sandbox::tmp_dir(&self.cfg.state_dir, k.0 .0, k.1))
            .collect();
        // Listed by descriptor (the directory must be root's); each entry is
        // removed without following anything in it.
        let names = crate::safefs::open_base(&root)
            .and_then(|fd| crate::safefs::list(&fd))
            .unwrap_or_default();
        let stale: Vec<PathBuf> = names
            .iter()
            .map(|name| root.join(name))
            .filter(|path| !keep.contains(path))
            .collect();
        // The trees are the users' and of any size: removed off the runtime
        // (under `gangway up` it also runs the server and the other agents).
        if !stale.is_empty() {
            let _ = std::thread::Builder::new()
                .name("gangway-sweep".into())
                .spawn(move || stale.iter().for_each(|p| crate::sandbox::remove_tmp(p)));
        }
        let keys = self.tasks.keys().map(|k| (k.0 .0, k.1)).collect();
        crate::scratch::sweep(&self.cfg.state_dir, &keys);
    }

    /// A process rank's per-job `HOME` (when its account has none) and
    /// `TMPDIR`, made and added to its base environment.
    async fn with_job_dirs(
        &self,
        mut sb: crate::sandbox::RankSandbox,
        a: &Assignment,
        ckpt: &crate::checkpoint::CkptDir,
    ) -> Result<crate::sandbox::RankSandbox, crate::sandbox::SandboxError> {
        if a.run.image.is_some() {
            return Ok(sb);
        }
        let tmp = crate::sandbox::tmp_dir(&self.cfg.state_dir, a.job.0, a.attempt);
        let (account, dir) = (sb.account.clone(), ckpt.clone());
        let nodes = a.nodes.clone();
        let env = crate::sandbox::off_loop(move || {
            let mut env = crate::sandbox::job_dirs(&account, &dir, &tmp)?;
            env.extend(crate::sandbox::write_hostfiles(&account, &tmp, &nodes)?);
            Ok(env)
        })
        .await
        .map_err(|e| crate::sandbox::SandboxError::JobDirs {
            account: sb.account.name.clone(),
            msg: e.to_string(),
        })?;
        sb.base_env.extend(env);
        Ok(sb)
    }

    /// A process rank's private `/tmp` and `/dev/shm` (its `TMPDIR` and a
    /// tmpfs as large as its ranks' memory limits here together), or, where
    /// none can be made, its account marked for the sweep of the node's.
    fn scratch_for(
        &self,
        a: &Assignment,
        sb: &crate::sandbox::RankSandbox,
        task: &mut Task,
    ) -> Option<crate::scratch::Scratch> {
        use crate::scratch::Mode;
        let sweep = |task: &mut Task| {
            if task.sweep_uid.is_none() {
                crate::scratch::hold_shared(sb.account.uid);
                task.sweep_uid = Some(sb.account.uid);
            }
        };
        match self.scratch {
            Mode::Shared => None,
            Mode::Sweep => {
                sweep(task);
                None
            }
            Mode::Namespace => {
                let mib = a.ranks.iter().fold(0u64, |sum, r| {
                    let l = crate::limits::rank_limits(
                        a.cpu_millis,
                        a.memory_mib,
                        &a.rules.policy.limits,
                        self.node_memory_mib(),
                        self.discovery.gpus.len() as u32,
                        r.gpus.len() as u32,
                    );
                    sum.saturating_add(l.memory_mib)
                });
                let mib = mib.min(self.node_memory_mib().max(1));
                let tmp = crate::sandbox::tmp_dir(&self.cfg.state_dir, a.job.0, a.attempt);
                let roots = [
                    Some(self.cfg.state_dir.as_path()),
                    Some(self.cfg.checkpoint_root.as_path()),
                    a.checkpoint_root.as_deref().map(std::path::Path::new),
                ];
                let roots: Vec<&std::path::Path> = roots.into_iter().flatten().collect();
                let keep_tmp = crate::scratch::under_tmp(&roots);
                if keep_tmp {
                    sweep(task);
                }
                match crate::scratch::prepare(
                    &self.cfg.state_dir,
                    a.job.0,
                    a.attempt,
                    (!keep_tmp).then_some(tmp.as_path()),
                    sb.account.uid,
                    sb.account.gid,
                    mib.saturating_mul(1 << 20),
                ) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        tracing::warn!(
                            "job {} attempt {}: no private /dev/shm ({e}); the node's /tmp and /dev/shm are swept after it",
                            a.job,
                            a.attempt
                        );
                        sweep(task);
                        None
                    }
                }
            }
        }
    }

    /// Starts an assignment's ranks here; `false` when the start is put
    /// off (what it needs from the rendezvous side is being made, see
    /// [`crate::rendezvous::Prepared`]) and nothing was done.
    async fn start_task(&mut self, a: Assignment) -> bool {
        let key = (a.job, a.attempt);
        let mut task = Task::new(a.stop);
        task.user = a.user.clone();
        if a.stop {
            // Preempted before it started here: nothing to checkpoint.
            self.tasks.insert(key, task);
            return true;
        }
        let ckpt = if a.checkpoint_subdir.is_empty() {
            Some(crate::checkpoint::CkptDir {
                base: self.cfg.checkpoint_root.clone(),
                rel: format!("job-{}", a.job).into(),
            })
        } else {
            crate::checkpoint::checkpoint_dir(
                &self.cfg.checkpoint_root,
                a.checkpoint_root.as_deref(),
                &a.checkpoint_subdir,
            )
        };
        let Some(ckpt) = ckpt else {
            // Never started, and reported as failed (not as done).
            tracing::error!(
                "job {}: refusing checkpoint directory {:?}",
                a.job,
                a.checkpoint_subdir
            );
            for r in &a.ranks {
                task.ranks.insert(
                    r.rank,
                    RankRun {
                        handle: Rank::NotStarted,
                        main_exit: Some(125),
                        done: Some(125),
                        exit_file: PathBuf::new(),
                        oom_killed: false,
                        unknown_exit: false,
                    },
                );
                task.first_failure.get_or_insert(r.rank);
            }
            self.tasks.insert(key, task);
            return true;
        };
        let removing = || self.removing.lock().is_ok_and(|s| s.contains(&ckpt.path()));
        let until = Instant::now() + FINAL_WAIT;
        while removing() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if removing() {
            // Started at a later sync, once the directory is gone.
            tracing::info!(
                "job {} attempt {}: waiting for the removal of {}",
                a.job,
                a.attempt,
                ckpt.path().display()
            );
            return false;
        }
        task.ckpt = Some(ckpt.path());
        task.ckpt_at = Some(ckpt.clone());
        if a.run.image.is_none() {
            task.tmp = Some(crate::sandbox::tmp_dir(
                &self.cfg.state_dir,
                a.job.0,
                a.attempt,
            ));
        }
        // Rank 0 hosts the rendezvous: a port someone else holds would make
        // the gang hang, so the server is told to pick another.
        let hosts_rendezvous = a.ranks.iter().any(|r| r.rank == 0);
        if hosts_rendezvous && !crate::checkpoint::port_free(a.master_port) {
            let ranks = self.rank_list();
            let track = self.executor.track().clone();
            let Some(holder) = self.rendezvous.holder(a.master_port, ranks, &track) else {
                return false;
            };
            tracing::warn!(
                "job {} attempt {}: rendezvous port {} is in use{}; asking for another",
                a.job,
                a.attempt,
                a.master_port,
                holder
                    .as_deref()
                    .map(|h| format!(" (held by {h})"))
                    .unwrap_or_default()
            );
            task.port_busy = Some(a.master_port);
            task.port_holder = holder;
            self.tasks.insert(key, task);
            return true;
        }
        // Process ranks may bind no rendezvous port but rank 0's own.
        let (base_rules, own_rules) = match (&a.run.image, a.rendezvous_ports) {
            (None, Some(range)) => {
                let own = hosts_rendezvous.then_some(a.master_port);
                match self.rendezvous.rules(range, own) {
                    Some(rules) => rules,
                    None => return false,
                }
            }
            _ => (None, None),
        };
        // The server's record of the last checkpoint; for a job resubmitted
        // with the same checkpoint.dir, what the directory announces.
        let resume_from = match a.resume_from.clone() {
            Some(r) => Some(r),
            None => task
                .latest
                .refresh(&ckpt, LATEST_WAIT)
                .await
                .map(|l| l.report.path),
        };
        let logs = self.cfg.state_dir.join("logs");
        let sandbox = match crate::sandbox::prepare_off_loop(&self.cfg, &a).await {
            Ok(sb) => self.with_job_dirs(sb, &a, &ckpt).await,
            Err(e) => Err(e),
        };
        if let Err(e) = &sandbox {
            tracing::warn!(
                "job {} attempt {}: refused on node {}: {e}",
                a.job,
                a.attempt,
                self.cfg.node
            );
        }
        let scratch = match &sandbox {
            Ok(sb) if a.run.image.is_none() => self.scratch_for(&a, sb, &mut task),
            _ => None,
        };
        if let Ok(sb) = &sandbox {
            path_warnings(sb, &a, &task.warnings).await;
        }
        tracing::info!(
            "job {} attempt {}: starting ranks {:?}",
            a.job,
            a.attempt,
            a.ranks.iter().map(|r| r.rank).collect::<Vec<_>>()
        );
        for r in &a.ranks {
            let mut env = rank_env(&a, r);
            node_env(
                &mut env,
                &self.cfg.node,
                &ckpt.path().display().to_string(),
                resume_from.as_deref(),
            );
            // A rank whose TMPDIR is bound on /tmp reaches it (and the
            // hostfiles in it) there: the host path may lie under a
            // directory it cannot enter (`gangway up`'s data directory).
            if let (Ok(sb), Some(s)) = (&sandbox, &scratch) {
                if s.binds_tmp() {
                    env.insert("TMPDIR".into(), "/tmp".into());
                    for (name, var, _) in crate::sandbox::HOSTFILES {
                        if sb.base_env.contains_key(var) {
                            env.insert(var.to_string(), format!("/tmp/{name}"));
                        }
                    }
                }
            }
            let rk = RankKey {
                job: a.job,
                attempt: a.attempt,
                rank: r.rank,
            };
            let log = log_path(&logs, a.job.0, a.attempt, r.rank);
            let sandbox = match &sandbox {
                Ok(sb) => sb.clone(),
                Err(e) => {
                    // The rank fails with the reason in its log (`gangway logs`).
                    crate::sandbox::refuse(&log, e);
                    let _ = self.exits_tx.send((rk, crate::sandbox::REFUSED_EXIT));
                    task.ranks.insert(
                        r.rank,
                        RankRun {
                            handle: Rank::NotStarted,
                            main_exit: None,
                            done: None,
                            exit_file: PathBuf::new(),
                            oom_killed: false,
                            unknown_exit: false,
                        },
                    );
                    continue;
                }
            };
            let exit_file = crate::leftovers::exit_file(&self.cfg.state_dir, rk);
            let limits = crate::limits::rank_limits(
                a.cpu_millis,
                a.memory_mib,
                &a.rules.policy.limits,
                self.node_memory_mib(),
                self.discovery.gpus.len() as u32,
                r.gpus.len() as u32,
            );
            task.memory_mib = limits.memory_mib;
            task.quota = a.rules.policy.limits.checkpoint_quota_bytes.unwrap_or(0);
            let binding = self.bind_rank(&r.gpus, a.cpu_millis, &mut env);
            let bind_rules = if r.rank == 0 {
                own_rules.clone()
            } else {
                base_rules.clone()
            };
            let launch = Launch {
                bind_rules,
                binding,
                key: rk,
                exit_file: exit_file.clone(),
                run: a.run.clone(),
                env,
                gpus: r.gpus.clone(),
                limits,
                rotation: crate::logs::Rotation::of(&a.rules.policy.limits),
                log,
                signal: a.checkpoint_signal,
                grace_seconds: a.grace_seconds,
                checkpoint_dir: ckpt.clone(),
                sandbox,
                scratch: scratch.clone(),
            };
            let handle = self.executor.start(launch, self.exits_tx.clone()).await;
            if let Rank::Process { pid, container } = &handle {
                crate::leftovers::record(
                    &self.cfg.state_dir,
                    rk,
                    *pid,
                    container,
                    a.checkpoint_signal,
                    a.grace_seconds,
                    &ckpt,
                );
            }
            task.ranks.insert(
                r.rank,
                RankRun {
                    handle,
                    main_exit: None,
                    done: None,
                    exit_file,
                    oom_killed: false,
                    unknown_exit: false,
                },
            );
        }
        self.tasks.insert(key, task);
        true
    }

    /// The process ranks this agent runs, for naming a busy port's holder.
    fn rank_list(&self) -> Vec<crate::rendezvous::RankOf> {
        self.tasks
            .iter()
            .flat_map(|((job, _), t)| {
                t.ranks.iter().filter_map(move |(rank, r)| match &r.handle {
                    Rank::Process { container, .. } => Some(crate::rendezvous::RankOf {
                        job: *job,
                        user: t.user.clone(),
                        rank: *rank,
                        container: container.clone(),
                    }),
                    _ => None,
                })
            })
            .collect()
    }

    /// The rank's device names, CPU pinning and nearest NICs (docs/JOB_ENV.md).
    fn bind_rank(
        &self,
        gpus: &[u32],
        cpu_millis: u64,
        env: &mut BTreeMap<String, String>,
    ) -> crate::binding::Binding {
        let b = crate::binding::bind(
            &self.discovery.gpus,
            &self.discovery.topology,
            gpus,
            cpu_millis,
            &crate::binding::host_cpus(),
        );
        env.extend(b.env.clone());
        for (k, v) in &b.env_defaults {
            env.entry(k.clone()).or_insert_with(|| v.clone());
        }
        b
    }
}

/// The node's labels as registered: the configured ones, plus
/// [`RENDEZVOUS_LABEL`] where ranks cannot be kept off rendezvous ports
/// (`landlock` false), when there is room (the server takes 64).
fn node_labels(configured: &BTreeMap<String, String>, landlock: bool) -> BTreeMap<String, String> {
    let mut labels = configured.clone();
    if !landlock && labels.len() < 64 {
        labels
            .entry(RENDEZVOUS_LABEL.to_string())
            .or_insert_with(|| "detected-only".to_string());
    }
    labels
}

/// `PATH` entries of a process rank that its account cannot search, as the
/// account finds them (see [`crate::probe::path_warnings`]), put in `into`
/// by a task of their own. The caller waits [`PATH_LOOK_WAIT`] at most (a
/// look takes a millisecond: the warnings are then in the task's first
/// report, even of a rank that ends at once); a slower look (a hung mount on
/// the user's `PATH`) fills them in at a later sync.
async fn path_warnings(
    sb: &crate::sandbox::RankSandbox,
    a: &Assignment,
    into: &std::sync::Arc<std::sync::Mutex<Vec<String>>>,
) {
    if a.run.image.is_some() {
        return;
    }
    let path = a
        .run
        .env
        .get("PATH")
        .or_else(|| sb.base_env.get("PATH"))
        .cloned()
        .unwrap_or_default();
    let (account, into, job, attempt) = (sb.account.clone(), into.clone(), a.job, a.attempt);
    let mut look = tokio::spawn(async move {
        let found = crate::probe::path_warnings(&account, &path).await;
        for w in &found {
            tracing::warn!("job {job} attempt {attempt}: {w}");
        }
        if let Ok(mut w) = into.lock() {
            *w = found;
        }
    });
    let _ = tokio::time::timeout(PATH_LOOK_WAIT, &mut look).await;
}

/// How long starting a task waits for its `PATH` warnings.
const PATH_LOOK_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// The exit code of a rank whose supervisor is gone without writing one
/// (SIGKILLed with the agent): nobody can wait for the rank any more, so its
/// code is unknown. It counts as finished (0) when the job said so: its
/// checkpoint directory's `LATEST` marks a final checkpoint (`"final":
/// true`) written after this rank started and before any stop was asked.
/// Otherwise it fails as "exit code unknown: supervisor lost" (code 255).
/// Returns the code and whether it was unknown; the rank's log says which.
/// `LATEST` is read through the task's cache (on a thread, waited for at
/// most [`FINAL_WAIT`]).
fn lost_supervisor_exit(
    state_dir: &std::path::Path,
    k: RankKey,
    ckpt: Option<(&crate::checkpoint::CkptDir, &crate::checkpoint::LatestCache)>,
    stop_sent: bool,
) -> (i32, bool) {
    let started = crate::leftovers::recorded_ms(state_dir, k).unwrap_or(u64::MAX);
    let done = ckpt
        .and_then(|(dir, cache)| {
            crate::checkpoint::final_of(cache.refresh_blocking(dir, FINAL_WAIT).as_ref())
        })
        .filter(|(_, at)| *at >= started && !stop_sent);
    let log = log_path(&state_dir.join("logs"), k.job.0, k.attempt, k.rank);
    let (code, note) = match done {
        Some((step, _)) => (
            0,
            format!("exit code unknown: supervisor lost; counted as finished: the job announced its final checkpoint (step {step})"),
        ),
        None => (UNKNOWN_EXIT, "exit code unknown: supervisor lost".to_string()),
    };
    tracing::warn!(
        "job {} attempt {} rank {}: {note}",
        k.job,
        k.attempt,
        k.rank
    );
    crate::executor::note(&log, &note);
    (code, done.is_none())
}

/// The code reported for a rank whose exit code is unknown.
const UNKNOWN_EXIT: i32 = 255;

/// When a grace period that starts now ends; a period too long for the
/// clock (any user number, up to `u64::MAX` seconds) ends in a century.
fn deadline_after(grace: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(grace)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_without_landlock_says_so_in_a_label_when_there_is_room() {
        let mut labels = BTreeMap::from([("zone".to_string(), "a".to_string())]);
        assert_eq!(
            node_labels(&labels, true),
            labels,
            "nothing added with Landlock"
        );
        let without = node_labels(&labels, false);
        assert_eq!(
            without.get(RENDEZVOUS_LABEL).map(String::as_str),
            Some("detected-only")
        );
        assert_eq!(without.get("zone").map(String::as_str), Some("a"));
        for i in 0..63 {
            labels.insert(format!("l{i}"), "x".into());
        }
        assert_eq!(labels.len(), 64);
        assert_eq!(node_labels(&labels, false), labels, "the server takes 64");
    }

    #[test]
    fn the_agent_refuses_a_server_too_many_versions_away() {
        use gangway_core::agent::Version;
        let me = Version::current();
        let at = |major: u64, minor: u64| serde_json::json!({ "server_version": format!("{major}.{minor}.0") });
        assert!(server_version_ok(&at(me.major, me.minor)).is_ok());
        assert!(server_version_ok(&at(me.major, me.minor + 1)).is_ok());
        let e = server_version_ok(&at(me.major, me.minor + 2))
            .expect_err("two minors")
            .to_string();
        assert!(
            e.contains(&format!("server version {}.{}.0", me.major, me.minor + 2)),
            "{e}"
        );
        assert!(server_version_ok(&at(me.major + 1, me.minor)).is_err());
        assert!(server_version_ok(&serde_json::json!({ "server_version": "x" })).is_err());
        // A server from before the field is 0.1.
        assert_eq!(
            server_version_ok(&serde_json::json!({})).is_ok(),
            gangway_core::agent::check_skew(gangway_core::agent::UNSTATED_VERSION, me).is_ok()
        );
    }

    #[test]
    fn any_grace_period_gives_a_deadline_without_overflow() {
        let now = Instant::now();
        for secs in [0, 30, u64::MAX / 2, u64::MAX] {
            assert!(deadline_after(Duration::from_secs(secs)) >= now, "{secs}");
        }
        assert!(deadline_after(Duration::from_secs(u64::MAX)) > now + Duration::from_secs(3600));
    }
}
