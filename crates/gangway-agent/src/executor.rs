//! Executors start one rank each: a process tree in its own container of
//! the [`crate::proctrack`] tracker (behind a small [`crate::supervisor`]),
//! or a Docker container running the job's image. A rank that cannot start "exits" with the shell's
//! code for it (127: no command; 125: the container could not be created)
//! and the reason goes to its log, so the gang's restart policy applies.

use crate::proctrack::{Container, Limits, SharedTrack, RANK_ID_VAR};
use bollard::models::{ContainerCreateBody, DeviceRequest};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, KillContainerOptionsBuilder, LogsOptionsBuilder,
    RemoveContainerOptionsBuilder,
};
use bollard::Docker;
use futures_util::StreamExt;
use gangway_core::{JobId, RunSpec};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use tokio::sync::mpsc::UnboundedSender;

/// One rank of one attempt of one job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RankKey {
    /// Job.
    pub job: JobId,
    /// Attempt.
    pub attempt: u32,
    /// Global rank.
    pub rank: u32,
}

/// Where exits are announced: the rank and its exit code (128+N for signal N).
pub type ExitSender = UnboundedSender<(RankKey, i32)>;

/// Everything needed to start one rank.
#[derive(Clone, Debug)]
pub struct Launch {
    /// Which rank.
    pub key: RankKey,
    /// What to run.
    pub run: RunSpec,
    /// Its whole environment beyond PATH/HOME: Gangway's variables and
    /// `CUDA_VISIBLE_DEVICES` with the host's device indices.
    pub env: BTreeMap<String, String>,
    /// Host GPU indices.
    pub gpus: Vec<u32>,
    /// Its limits (CPU, memory, processes; see [`crate::limits`]).
    pub limits: Limits,
    /// How its log is rotated.
    pub rotation: crate::logs::Rotation,
    /// Log file (stdout and stderr).
    pub log: PathBuf,
    /// The job's checkpoint directory (mounted read-write into containers).
    pub checkpoint_dir: crate::checkpoint::CkptDir,
    /// Its account, base environment and checked mounts.
    pub sandbox: crate::sandbox::RankSandbox,
    /// Where the rank's supervisor writes its exit code.
    pub exit_file: PathBuf,
    /// Its private `/tmp` and `/dev/shm` (process ranks), bound before it runs.
    pub scratch: Option<crate::scratch::Scratch>,
    /// The job's checkpoint signal (kept with the rank for re-adoption).
    pub signal: i32,
    /// Its grace period in seconds (likewise).
    pub grace_seconds: u64,
    /// Device ids for the container runtime and CPUs to pin to.
    pub binding: crate::binding::Binding,
    /// The TCP ports a process rank may bind (see [`crate::landlock`]);
    /// `None` where the kernel cannot enforce it.
    pub bind_rules: Option<std::sync::Arc<crate::landlock::PortRules>>,
}

/// A started rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rank {
    /// A process tree: its supervisor's pid and the container that holds
    /// every process of the rank.
    Process {
        /// The supervisor (the executor's child).
        pid: i32,
        /// Every process of the rank.
        container: Container,
    },
    /// A container by name.
    Container(String),
    /// Never started (its exit was already announced).
    NotStarted,
}

/// Starts and signals ranks.
#[derive(Clone)]
pub struct Executor {
    docker: Option<Docker>,
    gpu_runtime: bool,
    node: String,
    track: SharedTrack,
    /// Tells this agent's containers from those of another agent on the
    /// same machine (tests run several).
    tag: String,
    /// Ranks this agent could not start for a reason outside the job (the
    /// node's fault, reported to the server's node blame), with why.
    node_faults: std::sync::Arc<std::sync::Mutex<HashMap<RankKey, String>>>,
}

/// Why the executor could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    /// Docker is not reachable.
    #[error("docker: {0}")]
    Docker(#[from] bollard::errors::Error),
}

/// Appends a `[gangway]` line to a rank's log.
pub(crate) fn note(log: &Path, msg: &str) {
    if let Ok(mut f) = crate::logs::open_append(log) {
        let _ = writeln!(f, "[gangway] {msg}");
    }
}

fn exit_code(s: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    s.code()
        .or_else(|| s.signal().map(|n| 128 + n))
        .unwrap_or(255)
}

impl Executor {
    /// Processes only, or Docker as well (connecting to the local engine);
    /// process ranks are tracked by `track`, in containers named after the
    /// node, `tag` and the rank.
    pub async fn new(
        docker: bool,
        gpu_runtime: bool,
        node: &str,
        track: SharedTrack,
        tag: &str,
    ) -> Result<Self, ExecutorError> {
        let docker = if docker {
            Some(
                Docker::connect_with_local_defaults()?
                    .negotiate_version()
                    .await?,
            )
        } else {
            None
        };
        Ok(Executor {
            docker,
            gpu_runtime,
            node: node.to_string(),
            track,
            tag: tag.to_string(),
            node_faults: Default::default(),
        })
    }

    /// Why the agent could not start rank `k`, when the node, not the job,
    /// was the cause.
    pub fn node_fault(&self, k: RankKey) -> Option<String> {
        self.node_faults.lock().ok()?.get(&k).cloned()
    }

    /// Forgets what was noted about the ranks of an attempt that is gone.
    pub fn forget_node_faults(&self, job: JobId, attempt: u32) {
        if let Ok(mut m) = self.node_faults.lock() {
            m.retain(|k, _| !(k.job == job && k.attempt == attempt));
        }
    }

    fn blame_node(&self, k: RankKey, why: String) {
        tracing::error!("rank {k:?} not started, the node's fault: {why}");
        self.note_node_fault(k, why);
    }

    /// Notes that rank `k` failed for a reason outside the job (reported to
    /// the server's node blame with the rank's failure).
    pub fn note_node_fault(&self, k: RankKey, why: String) {
        if let Ok(mut m) = self.node_faults.lock() {
            m.insert(k, why);
        }
    }

    /// How many processes of a process rank are left (0 for other ranks,
    /// whose end the container engine reports).
    pub fn processes_left(&self, rank: &Rank) -> usize {
        match rank {
            Rank::Process { container, .. } => self.track.pids(container).len(),
            _ => 0,
        }
    }

    /// The process tracker.
    pub fn track(&self) -> &SharedTrack {
        &self.track
    }

    /// The container name of a process rank.
    pub fn container_name(&self, k: RankKey) -> String {
        format!(
            "{}-{}-j{}-a{}-r{}",
            self.node
                .replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "-"),
            self.tag,
            k.job,
            k.attempt,
            k.rank
        )
    }

    /// Whether any process of the rank is left (a container rank ends with
    /// its container, announced on the exit channel).
    pub fn alive(&self, rank: &Rank) -> bool {
        match rank {
            Rank::Process { container, .. } => !self.track.is_empty(container),
            Rank::Container(_) => true,
            Rank::NotStarted => false,
        }
    }

    /// Whether the kernel's OOM killer killed a process of a process rank
    /// (its cgroup's count; false where the tracker cannot tell).
    pub fn oom_killed(&self, rank: &Rank) -> bool {
        match rank {
            Rank::Process { container, .. } => self.track.oom_kills(container) > 0,
            _ => false,
        }
    }

    /// Removes a finished process rank's container (cgroup).
    pub fn release(&self, rank: &Rank) {
        if let Rank::Process { container, .. } = rank {
            self.track.destroy(container);
        }
    }

    /// Starts a rank; its exit (or failure to start) is sent on `exits`.
    pub async fn start(&self, l: Launch, exits: ExitSender) -> Rank {
        let (account, log, dir) = (
            l.sandbox.account.clone(),
            l.log.clone(),
            l.checkpoint_dir.clone(),
        );
        let prepared =
            crate::sandbox::off_loop(move || crate::sandbox::prepare_files(&account, &log, &dir))
                .await;
        if let Err(e) = prepared {
            note(
                &l.log,
                &format!(
                    "cannot prepare the log and checkpoint directory for Unix account {:?}: {e}",
                    l.sandbox.account.name
                ),
            );
            let _ = exits.send((l.key, 126));
            return Rank::NotStarted;
        }
        if l.run.command.is_empty() {
            note(&l.log, "the job spec has no run.command: nothing to run");
            let _ = exits.send((l.key, 127));
            return Rank::NotStarted;
        }
        match (&l.run.image, &self.docker) {
            (Some(_), Some(d)) => self.start_container(d.clone(), l, exits).await,
            (Some(image), None) => {
                note(&l.log, &format!("the job asks for image {image:?} but this agent runs processes only (start it with --executor docker)"));
                let _ = exits.send((l.key, 125));
                Rank::NotStarted
            }
            (None, _) => self.start_process(l, exits),
        }
    }

    /// Sends a signal (POSIX number) to every process of the rank.
    pub async fn signal(&self, rank: &Rank, sig: i32) {
        match rank {
            Rank::Process { container, .. } => self.track.signal(container, sig),
            Rank::Container(name) => {
                if let Some(d) = &self.docker {
                    // `docker kill` signals only the container's PID 1; a
                    // checkpoint signal goes to every process of the rank, as
                    // for process ranks (SIGKILL of PID 1 ends them all).
                    if sig != libc::SIGKILL {
                        let init = d
                            .inspect_container(name, None)
                            .await
                            .ok()
                            .and_then(|i| i.state?.pid)
                            .and_then(|p| i32::try_from(p).ok())
                            .filter(|p| *p > 1);
                        if let Some(init) = init {
                            signal_pid_namespace(init, sig);
                            return;
                        }
                    }
                    let opts = KillContainerOptionsBuilder::default()
                        .signal(&sig.to_string())
                        .build();
                    if let Err(e) = d.kill_container(name, Some(opts)).await {
                        tracing::debug!("signal {sig} to container {name}: {e}");
                    }
                }
            }
            Rank::NotStarted => {}
        }
    }

    async fn start_container(&self, d: Docker, l: Launch, exits: ExitSender) -> Rank {
        let k = l.key;
        let name = self.docker_name(k);
        // A leftover of an earlier agent run with the same name goes first.
        let rm = RemoveContainerOptionsBuilder::default().force(true).build();
        let _ = d.remove_container(&name, Some(rm)).await;
        let sb = &l.sandbox;
        let mut env = crate::sandbox::job_env(&l.env, sb.loader_env);
        let mut device_requests = None;
        if self.gpu_runtime && !l.gpus.is_empty() {
            // The NVIDIA runtime shows the container only its GPUs, renumbered from 0.
            let visible: Vec<String> = (0..l.gpus.len()).map(|i| i.to_string()).collect();
            env.insert("CUDA_VISIBLE_DEVICES".into(), visible.join(","));
            // UUIDs where discovered: an index could name another GPU if
            // the runtime's order differs from NVML's.
            let ids = if l.binding.device_ids.len() == l.gpus.len() {
                l.binding.device_ids.clone()
            } else {
                l.gpus.iter().map(u32::to_string).collect()
            };
            device_requests = Some(vec![DeviceRequest {
                driver: Some("nvidia".into()),
                device_ids: Some(ids),
                capabilities: Some(vec![vec!["gpu".into()]]),
                ..Default::default()
            }]);
        }
        let mut exposed_ports = None;
        if !sb.host_network {
            exposed_ports = bridge_rendezvous(&d, &self.node, k, &mut env).await;
        }
        let mut host = crate::sandbox::host_config(sb, &l.checkpoint_dir.path());
        if let Some(ports) = &exposed_ports {
            // Other nodes reach rank 0's rendezvous at this node's address.
            host.port_bindings = Some(
                ports
                    .iter()
                    .map(|p| {
                        let binding = bollard::models::PortBinding {
                            host_ip: None,
                            host_port: p.split('/').next().map(str::to_string),
                        };
                        (p.clone(), Some(vec![binding]))
                    })
                    .collect(),
            );
        }
        // User numbers: a limit too large for Docker's i64 is no limit at all.
        let lim = l.limits;
        host.memory = (lim.memory_mib > 0)
            .then(|| i64::try_from(lim.memory_mib.saturating_mul(1 << 20)).unwrap_or(i64::MAX));
        host.nano_cpus = (lim.cpu_millis > 0)
            .then(|| i64::try_from(lim.cpu_millis.saturating_mul(1_000_000)).unwrap_or(i64::MAX));
        host.cpu_shares = (lim.cpu_millis > 0).then(|| lim.cpu_shares() as i64);
        host.pids_limit = (lim.pids > 0).then(|| i64::try_from(lim.pids).unwrap_or(i64::MAX));
        // Docker's own copy of the output is bounded like the agent's.
        host.log_config = Some(bollard::models::HostConfigLogConfig {
            typ: Some("json-file".into()),
            config: Some(HashMap::from([
                ("max-size".to_string(), l.rotation.max_bytes.to_string()),
                ("max-file".to_string(), l.rotation.max_files.to_string()),
            ])),
        });
        host.device_requests = device_requests;
        if !l.binding.cpus.is_empty() {
            host.cpuset_cpus = Some(crate::binding::cpu_list(&l.binding.cpus));
        }
        let labels = [
            ("gangway.job", k.job.to_string()),
            ("gangway.attempt", k.attempt.to_string()),
            ("gangway.rank", k.rank.to_string()),
            ("gangway.node", self.node.clone()),
            ("gangway.signal", l.signal.to_string()),
            ("gangway.grace", l.grace_seconds.to_string()),
        ]
        .into_iter()
        .map(|(a, b)| (a.to_string(), b))
        .collect();
        let body = ContainerCreateBody {
            image: l.run.image.clone(),
            cmd: Some(l.run.command.clone()),
            env: Some(env.iter().map(|(a, b)| format!("{a}={b}")).collect()),
            working_dir: l.run.workdir.clone(),
            user: Some(crate::sandbox::container_user(sb)),
            exposed_ports,
            labels: Some(labels),
            host_config: Some(host),
            ..Default::default()
        };
        let opts = CreateContainerOptionsBuilder::default().name(&name).build();
        if let Err(e) = d.create_container(Some(opts), body).await {
            note(&l.log, &format!("cannot create the container: {e}"));
            let _ = exits.send((k, 125));
            return Rank::NotStarted;
        }
        if let Err(e) = d.start_container(&name, None).await {
            note(&l.log, &format!("cannot start the container: {e}"));
            let _ = d
                .remove_container(
                    &name,
                    Some(RemoveContainerOptionsBuilder::default().force(true).build()),
                )
                .await;
            let _ = exits.send((k, 125));
            return Rank::NotStarted;
        }
        watch_container(d, name.clone(), k, (l.log, l.rotation), exits, None);
        Rank::Container(name)
    }

    /// The container name of a Docker rank.
    pub fn docker_name(&self, k: RankKey) -> String {
        format!(
            "gangway-{}-j{}-a{}-r{}",
            self.node
                .replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "-"),
            k.job,
            k.attempt,
            k.rank
        )
    }
}

/// Sends `sig` to every process in the PID namespace of `init` (a
/// container's first process as the host sees it).
fn signal_pid_namespace(init: i32, sig: i32) {
    let ns = |pid: i32| std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok();
    let Some(want) = ns(init) else {
        return;
    };
    for p in crate::proctrack::all_procs() {
        if !p.zombie && ns(p.pid).as_ref() == Some(&want) {
            // SAFETY: kill(2) on a process of the rank's container.
            unsafe {
                libc::kill(p.pid, sig);
            }
        }
    }
}

/// Waits for a rank's container in the background: copies its log (from
/// `since`, Unix seconds, when re-adopted), removes it once it exited and
/// announces its exit code. The container's processes all end with it.
fn watch_container(
    d: Docker,
    name: String,
    k: RankKey,
    (log, rotation): (PathBuf, crate::logs::Rotation),
    exits: ExitSender,
    since: Option<i32>,
) {
    tokio::spawn(async move {
        let logs = tokio::spawn(copy_logs(d.clone(), name.clone(), log, rotation, since));
        let code = match d.wait_container(&name, None).next().await {
            Some(Ok(r)) => r.status_code as i32,
            Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => code as i32,
            _ => 255,
        };
        let _ = logs.await;
        let rm = RemoveContainerOptionsBuilder::default().force(true).build();
        let _ = d.remove_container(&name, Some(rm)).await;
        let _ = exits.send((k, code));
    });
}

impl Executor {
    /// Adopts the containers this node's agent started before it restarted:
    /// running ones are watched again (their exit announced on `exits`),
    /// exited ones are removed with their exit code. Returns each rank with
    /// its checkpoint signal, grace period and, if it already ended, its code.
    pub async fn adopt_containers(
        &self,
        logs: &Path,
        exits: ExitSender,
    ) -> Vec<(RankKey, i32, u64, Option<i32>)> {
        let Some(d) = &self.docker else {
            return Vec::new();
        };
        let mut filters = std::collections::HashMap::new();
        filters.insert(
            "label".to_string(),
            vec![format!("gangway.node={}", self.node)],
        );
        let opts = bollard::query_parameters::ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build();
        let Ok(list) = d.list_containers(Some(opts)).await else {
            return Vec::new();
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |t| i32::try_from(t.as_secs()).unwrap_or(i32::MAX));
        let mut out = Vec::new();
        for c in list {
            let labels = c.labels.unwrap_or_default();
            let num = |k: &str| labels.get(k).and_then(|v| v.parse::<u64>().ok());
            let (Some(job), Some(attempt), Some(rank), Some(id)) = (
                num("gangway.job"),
                num("gangway.attempt"),
                num("gangway.rank"),
                c.id,
            ) else {
                continue;
            };
            let (Ok(attempt), Ok(rank)) = (u32::try_from(attempt), u32::try_from(rank)) else {
                continue;
            };
            let k = RankKey {
                job: JobId(job),
                attempt,
                rank,
            };
            let signal = num("gangway.signal")
                .and_then(|s| i32::try_from(s).ok())
                .unwrap_or(libc::SIGTERM);
            let grace = num("gangway.grace").unwrap_or(0);
            let running = c.state == Some(bollard::models::ContainerSummaryStateEnum::RUNNING);
            if running {
                let log = crate::logs::log_path(logs, job, attempt, rank);
                watch_container(
                    d.clone(),
                    self.docker_name(k),
                    k,
                    // Re-adopted: its queue's rotation is not known here.
                    (log, crate::logs::Rotation::of(&Default::default())),
                    exits.clone(),
                    Some(now),
                );
                out.push((k, signal, grace, None));
            } else {
                let code = d
                    .inspect_container(&id, None)
                    .await
                    .ok()
                    .and_then(|i| i.state?.exit_code)
                    .map_or(255, |c| c as i32);
                let rm = RemoveContainerOptionsBuilder::default().force(true).build();
                let _ = d.remove_container(&id, Some(rm)).await;
                out.push((k, signal, grace, Some(code)));
            }
        }
        out
    }
}

async fn copy_logs(
    d: Docker,
    name: String,
    log: PathBuf,
    rotation: crate::logs::Rotation,
    since: Option<i32>,
) {
    let Ok(mut f) = crate::logs::RotatingLog::open(&log, rotation) else {
        return;
    };
    let opts = LogsOptionsBuilder::default()
        .follow(true)
        .stdout(true)
        .stderr(true)
        .since(since.unwrap_or(0))
        .build();
    let mut s = d.logs(&name, Some(opts));
    while let Some(Ok(chunk)) = s.next().await {
        let _ = f.write_all(chunk.as_ref());
    }
}

impl Executor {
    fn start_process(&self, l: Launch, exits: ExitSender) -> Rank {
        let k = l.key;
        let log = match crate::logs::open_append(&l.log) {
            Ok(f) => f,
            Err(e) => {
                tracing::error!("rank log {}: {e}", l.log.display());
                self.blame_node(k, format!("cannot open the rank's log: {e}"));
                let _ = exits.send((k, 125));
                return Rank::NotStarted;
            }
        };
        let (out, err) = match log.try_clone() {
            Ok(e) => (log, e),
            Err(e) => {
                self.blame_node(k, format!("cannot duplicate the rank's log: {e}"));
                let _ = exits.send((k, 125));
                return Rank::NotStarted;
            }
        };
        let name = self.container_name(k);
        let limits = l.limits;
        let container = match self.track.create(&name, limits) {
            Ok(c) => c,
            Err(e) => {
                note(&l.log, &format!("cannot create the rank's container: {e}"));
                self.blame_node(k, format!("cannot create the rank's container: {e}"));
                let _ = exits.send((k, 125));
                return Rank::NotStarted;
            }
        };
        let join = self.track.join(&container);
        // No cgroup holds the rank under the subreaper: rlimits stand in.
        let rlimits = (self.track.kind() == crate::proctrack::ProcTrackKind::Subreaper)
            .then(|| crate::limits::Rlimits::of(limits));
        let Some(pump) = crate::logpump::LogPump::new(
            &l.log,
            l.rotation,
            &format!("gangway-logs {}/{}/{}", k.job, k.attempt, k.rank),
        ) else {
            note(&l.log, "bad log file path");
            let _ = exits.send((k, 125));
            return Rank::NotStarted;
        };
        let exit_file = l.exit_file.clone();
        let _ = std::fs::remove_file(&exit_file);
        // The supervisor writes the exit code there: on a fresh state dir the
        // directory must exist before the rank starts (it used to be created
        // after, when the rank was recorded, so an instant first rank left no
        // exit file and could be reported killed, 137).
        if let Some(dir) = exit_file.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let title = crate::supervisor::title(k.job.0, k.attempt, k.rank);
        let Some(sup) = crate::supervisor::Supervisor::new(&exit_file, &title) else {
            note(&l.log, "bad exit file path");
            let _ = exits.send((k, 125));
            return Rank::NotStarted;
        };
        let mut cmd = tokio::process::Command::new(&l.run.command[0]);
        cmd.args(&l.run.command[1..])
            .env_clear()
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        // Never the agent's environment: the minimal base, then the job's and Gangway's.
        cmd.envs(&l.sandbox.base_env);
        cmd.envs(crate::sandbox::job_env(&l.env, l.sandbox.loader_env));
        cmd.env(RANK_ID_VAR, &container.name);
        // SAFETY: both hooks only make async-signal-safe calls (open, write,
        // fork, waitpid, _exit, unshare, mount); the paths were built before
        // the fork. They run first, as root: joining the cgroup, the private
        // /tmp and /dev/shm and the supervisor's exit file need it; the
        // identity hook below then drops to the account.
        let pin = crate::binding::CpuSet::new(&l.binding.cpus);
        let scratch = l.scratch.clone();
        unsafe {
            cmd.pre_exec(move || {
                join.join()?;
                if let Some(s) = &scratch {
                    s.enter()?;
                }
                if let Some(p) = &pin {
                    p.apply()?;
                }
                if let Some(r) = &rlimits {
                    r.apply()?;
                }
                pump.start()?;
                sup.fork()
            });
        }
        let workdir = l.run.workdir.as_deref().map(Path::new);
        if let Err(e) = crate::identity::drop_privileges(
            &mut cmd,
            &l.sandbox.account,
            workdir,
            l.bind_rules.clone(),
        ) {
            note(&l.log, &format!("cannot prepare the rank's identity: {e}"));
            self.track.destroy(&container);
            let _ = exits.send((k, 126));
            return Rank::NotStarted;
        }
        match cmd.spawn() {
            Ok(mut child) => {
                let pid = child.id().map_or(0, |p| p as i32);
                self.track.adopt(&container, pid);
                tokio::spawn(async move {
                    let code = child.wait().await.map_or(255, exit_code);
                    let _ = exits.send((k, code));
                });
                Rank::Process { pid, container }
            }
            Err(e) => {
                self.track.destroy(&container);
                // The account's own look at the path blocks: off the loop,
                // the exit reported once the log says why.
                tokio::task::spawn_blocking(move || {
                    note(&l.log, &cannot_start(&l, &e));
                    let _ = exits.send((k, 127));
                });
                Rank::NotStarted
            }
        }
    }
}

/// Why a process rank could not start, naming the account that was
/// refused and, for a permission error, the step it may not take as the
/// account sees it (see [`crate::probe::cannot_start`]).
fn cannot_start(l: &Launch, e: &std::io::Error) -> String {
    let cmd = &l.run.command[0];
    if e.kind() != std::io::ErrorKind::PermissionDenied {
        let who = crate::identity::who(&l.sandbox.account);
        return format!("cannot start {cmd:?} as {who}: {e}");
    }
    let path_var = l
        .env
        .get("PATH")
        .or_else(|| l.sandbox.base_env.get("PATH"))
        .cloned()
        .unwrap_or_default();
    crate::probe::cannot_start(&l.sandbox.account, cmd, l.run.workdir.as_deref(), &path_var)
}

/// Rendezvous of a container rank on the bridge network, where the node's
/// address is not the container's: rank 0 reaches itself at 127.0.0.1 and,
/// when the gang spans nodes, publishes `MASTER_PORT` on the node's address
/// (returned as the ports to expose); other ranks on rank 0's node reach it
/// at its container's bridge address. Only the rendezvous port is
/// published: multi-node gangs whose ranks open more connections (NCCL) need
/// a queue with `host_network: true`.
async fn bridge_rendezvous(
    d: &Docker,
    node: &str,
    k: RankKey,
    env: &mut BTreeMap<String, String>,
) -> Option<Vec<String>> {
    let get =
        |env: &BTreeMap<String, String>, name: &str| env.get(name).cloned().unwrap_or_default();
    if k.rank == 0 {
        env.insert("MASTER_ADDR".into(), "127.0.0.1".into());
        let port = get(env, "MASTER_PORT");
        return (get(env, "NNODES") != "1" && !port.is_empty())
            .then(|| vec![format!("{port}/tcp")]);
    }
    if get(env, "NODE_RANK") == "0" {
        let rank0 = container_name(node, RankKey { rank: 0, ..k });
        if let Ok(info) = d.inspect_container(&rank0, None).await {
            let ip = info
                .network_settings
                .and_then(|n| n.networks)
                .and_then(|n| n.get("bridge").and_then(|e| e.ip_address.clone()))
                .filter(|ip| !ip.is_empty());
            if let Some(ip) = ip {
                env.insert("MASTER_ADDR".into(), ip);
            }
        }
    }
    None
}

/// The Docker name of a rank's container.
fn container_name(node: &str, k: RankKey) -> String {
    format!(
        "gangway-{}-j{}-a{}-r{}",
        node.replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "-"),
        k.job,
        k.attempt,
        k.rank
    )
}
