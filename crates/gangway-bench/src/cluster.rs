//! `gangway-bench cluster`: the whole server (the `gangway server` binary,
//! real HTTP, a real store: redb, or etcd on loopback) with N hollow agents,
//! like Kubernetes' kubemark/KWOK.
//!
//! A hollow agent speaks the real agent protocol (register with the join
//! token, sync every `--sync-ms` with its GPUs' health and `TaskReport`s)
//! but starts no process: an assignment's ranks are reported running at
//! once and exited 0 after the job's run time (the `N` of its `sleep N`
//! command). Like the real agent, it syncs again at once after a change.
//!
//! Two queues split the cluster: `backlog` (7/8 of the GPUs, no borrowing)
//! holds the `--pending` jobs of the Philly size mix, so the cluster is full
//! and churning; `probe` (the rest, lending nothing) receives one 1-, 8- or
//! 64-GPU gang at a time, whose submit-to-all-ranks-running time is the
//! control plane's latency (cycle, store writes, agent syncs), not queueing.
//!
//! Phases: register the agents; submit the backlog with `--clients`
//! concurrent clients (submission rate and latency); then `--seconds` of
//! steady state with the same clients listing (a page of 100 from a random
//! cursor) and describing jobs, a scraper reading `/metrics`, and the
//! probe. Figures are printed as `metric: value unit`.

use crate::common::{percentile, philly_gpus, Rng};
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::{Args, ValueEnum};
use gangway_core::agent::{
    GpuHealth, SyncRequest, SyncResponse, TaskReport, TaskState, VERSION, VERSION_HEADER,
};
use http_body_util::{BodyExt, Full};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const ADMIN: &str = "bench-admin-token";
const JOIN: &str = "bench-join-token";

/// Which store the server runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// The embedded store (one server).
    Redb,
    /// A local etcd on loopback, started by the bench (one replica).
    Etcd,
}

/// Options of `gangway-bench cluster`.
#[derive(Args, Clone, Debug)]
pub struct ClusterArgs {
    /// Hollow agents (nodes).
    #[arg(long, default_value_t = 10_000)]
    nodes: usize,
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    gpus_per_node: u32,
    /// Backlog jobs submitted before the steady state.
    #[arg(long, default_value_t = 100_000)]
    pending: usize,
    /// Seconds of steady state (listing, describing, probing).
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Concurrent API clients.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Milliseconds between an agent's syncs.
    #[arg(long, default_value_t = 1000)]
    sync_ms: u64,
    /// Worker threads of the hollow agents' async runtime (each agent is a
    /// task on it, not a thread).
    #[arg(long, default_value_t = 2)]
    agent_threads: usize,
    /// Keep-alive connections the hollow agents share (requests in flight
    /// at most).
    #[arg(long, default_value_t = 256)]
    agent_connections: usize,
    /// Seconds with only the agents syncing, after registration, to measure
    /// the server's CPU per sync alone.
    #[arg(long, default_value_t = 5)]
    idle_seconds: u64,
    /// Shortest run time of a backlog job, in seconds.
    #[arg(long, default_value_t = 5)]
    min_runtime: u64,
    /// Longest run time of a backlog job, in seconds.
    #[arg(long, default_value_t = 30)]
    max_runtime: u64,
    /// The server's store.
    #[arg(long, value_enum, default_value_t = StoreKind::Redb)]
    store: StoreKind,
    /// Seed of the synthetic workload.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// The server's `retention.store_history` (the default, 1m, compacts
    /// about two minutes into a run: its cost is in the figures).
    #[arg(long, default_value = "1m")]
    store_history: String,
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// The server process; killed on drop.
struct Server {
    child: Child,
    base: String,
    log: std::path::PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// The server's peak resident memory in MiB (Linux `VmHWM`).
    fn peak_rss_mib(&self) -> Option<f64> {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let kb: f64 = s
            .lines()
            .find(|l| l.starts_with("VmHWM:"))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        Some(kb / 1024.0)
    }

    fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

fn config(a: &ClusterArgs) -> String {
    let gpus = a.nodes as u64 * u64::from(a.gpus_per_node);
    let probe = (gpus / 8).max(gpus.min(128));
    let backlog = gpus.saturating_sub(probe);
    let history = &a.store_history;
    // Hollow agents on a loaded 2-core machine may sync late: generous
    // heartbeat horizons keep the bench measuring latency, not node loss.
    // Thousands of nodes join with one join token: its request rate is
    // raised (agents also wait and retry on 429, as real ones do).
    format!(
        "admin_token: {ADMIN}\nagent_token: {JOIN}\nnode_approval: auto\n\
         node_not_ready_seconds: 60\nnode_lost_seconds: 300\n\
         limits: {{ requests_per_second: 100000, burst: 100000 }}\n\
         retention: {{ store_history: {history:?} }}\n\
         queues:\n\
         \x20 - name: backlog\n    quota: {{ nominal: {{ gpus: {backlog} }}, borrowing_limit: {{ gpus: 0 }} }}\n\
         \x20 - name: probe\n    quota: {{ nominal: {{ gpus: {probe} }}, lending_limit: {{ gpus: 0 }} }}\n"
    )
}

fn start_server(a: &ClusterArgs, dir: &std::path::Path, etcd: Option<&str>) -> Result<Server> {
    let cfg = dir.join("server.yaml");
    std::fs::write(&cfg, config(a))?;
    let port = free_port()?;
    let log = dir.join("server.log");
    let mut cmd = Command::new(crate::common::gangway_exe()?);
    cmd.args(["server", "--config"])
        .arg(&cfg)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?);
    if let Some(ep) = etcd {
        cmd.args(["--etcd", ep, "--etcd-namespace", "/bench"]);
    }
    let mut server = Server {
        child: cmd.spawn().context("starting gangway server")?,
        base: format!("http://127.0.0.1:{port}"),
        log,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let leads = ureq::get(&format!("{}/v1/leader", server.base))
            .timeout(Duration::from_secs(2))
            .call()
            .ok()
            .and_then(|r| r.into_json::<Value>().ok())
            .is_some_and(|v| v["leader"] == true);
        if leads {
            return Ok(server);
        }
        if let Ok(Some(st)) = server.child.try_wait() {
            bail!("the server exited ({st}):\n{}", server.log_tail());
        }
        if Instant::now() > deadline {
            bail!(
                "the server did not lead within 60 s:\n{}",
                server.log_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One job attempt a hollow agent runs.
struct Task {
    ends: Instant,
    reported_running: bool,
    nnodes: u32,
}

/// When each gang's nodes first reported it running, by job then attempt:
/// (nodes seen, nodes in the gang, when the last of them was seen).
type RunningAt = Arc<Mutex<HashMap<u64, HashMap<u32, (u32, u32, Instant)>>>>;

/// The HTTP client every hollow agent shares: keep-alive connections to the
/// server, pooled.
type Http = Client<HttpConnector, Full<Bytes>>;

/// What the hollow agents share: one async HTTP client with pooled
/// keep-alive connections (so an agent costs a task, not a thread or a TCP
/// handshake per sync), the constant part of every sync body, and the
/// counters the phases read.
struct Fleet {
    http: Http,
    base: String,
    /// Requests in flight at most (and so connections open).
    permits: tokio::sync::Semaphore,
    /// Registrations in flight at most: the server registers a node under
    /// its state lock, so thousands at once would hold every connection
    /// and starve the registered nodes' syncs (they would turn NotReady).
    registrations: tokio::sync::Semaphore,
    /// `{"gpus":[...],"tasks":[`: every sync body starts so.
    sync_prefix: Vec<u8>,
    gpus: u32,
    period: Duration,
    nodes: usize,
    running: RunningAt,
    registered: AtomicUsize,
    /// Syncs answered (the phases' CPU per sync divides by it).
    syncs: AtomicU64,
    /// Registrations refused with 429 and retried.
    retries: AtomicUsize,
    /// The phase the bench is in ([`PHASES`]), 0 until every agent has
    /// registered: sync latencies and lateness are recorded from then on
    /// (registrations, slow and many at once, would otherwise be measured
    /// through the syncs queued behind them), each with its phase.
    phase: AtomicU8,
    stop: AtomicBool,
}

/// The measured phases, in order (the agents' phase 1, 2, 3): syncs alone,
/// the backlog's submission, the steady state of reads.
const PHASES: [&str; 3] = ["idle", "submit", "steady"];

/// What one hollow agent measured.
#[derive(Default)]
struct AgentStats {
    /// Each sync's latency (ms), from asking for a connection to the whole
    /// answer, with the phase it was sent in.
    sync_ms: Vec<(u8, f64)>,
    sync_errors: usize,
    /// Syncs that started over one and a half periods after the previous one.
    late: usize,
}

/// The start of every sync body: a [`SyncRequest`] with these GPUs and no
/// tasks, less the closing `]}` (the tasks are its last field).
fn sync_prefix(gpus: &[GpuHealth]) -> Result<Vec<u8>> {
    let mut b = serde_json::to_vec(&SyncRequest {
        disk_pressure: None,
        gpus: gpus.to_vec(),
        tasks: Vec::new(),
        ..Default::default()
    })?;
    if !b.ends_with(b"\"tasks\":[]}") {
        bail!(
            "a sync request no longer ends with its tasks: {}",
            String::from_utf8_lossy(&b)
        );
    }
    b.truncate(b.len() - 2);
    Ok(b)
}

/// A whole sync body: the prefix, then the task reports.
fn sync_body(prefix: &[u8], tasks: &[TaskReport]) -> Result<Vec<u8>, serde_json::Error> {
    let mut b = Vec::with_capacity(prefix.len() + 2 + 96 * tasks.len());
    b.extend_from_slice(prefix);
    for (i, t) in tasks.iter().enumerate() {
        if i > 0 {
            b.push(b',');
        }
        serde_json::to_writer(&mut b, t)?;
    }
    b.extend_from_slice(b"]}");
    Ok(b)
}

fn sleep_secs(run: &gangway_core::RunSpec) -> u64 {
    match run.command.as_slice() {
        [s, n] if s == "sleep" => n.parse().unwrap_or(10),
        _ => 10,
    }
}

impl Fleet {
    /// POSTs a JSON body as an agent (bearer token and version header);
    /// the answer's status and body, and the latency in ms (waiting for a
    /// free connection included).
    async fn post(
        &self,
        uri: hyper::Uri,
        auth: HeaderValue,
        body: Vec<u8>,
        limit: Duration,
    ) -> Result<(StatusCode, Bytes, f64), String> {
        let t = Instant::now();
        let _permit = self.permits.acquire().await.map_err(|e| e.to_string())?;
        let req = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(header::AUTHORIZATION, auth)
            .header(header::CONTENT_TYPE, "application/json")
            .header(VERSION_HEADER, VERSION)
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let exchange = async {
            let resp = self.http.request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok::<_, String>((status, body))
        };
        let (status, body) = tokio::time::timeout(limit, exchange)
            .await
            .map_err(|_| format!("no answer within {} s", limit.as_secs()))??;
        Ok((status, body, ms(t)))
    }

    /// Registers a node with the join token (waiting and retrying on 429, as
    /// a real agent does); its node token.
    async fn register(&self, name: &str, rack: usize) -> Result<String> {
        let node = json!({
            "name": name,
            "cpu_millis": 128_000,
            "memory_mib": 2_097_152,
            "leaf": format!("rack{rack:04}"),
            "spine": format!("spine{:03}", rack / 16),
            "gpus": (0..self.gpus).map(|i| json!({"index": i, "model": "H100", "memory_gib": 80})).collect::<Vec<_>>()
        });
        let body = serde_json::to_vec(&node)?;
        let uri: hyper::Uri = format!("{}/v1/nodes", self.base).parse()?;
        let auth = HeaderValue::from_str(&format!("Bearer {JOIN}"))?;
        let _one_of_few = self.registrations.acquire().await?;
        let mut tries = 0;
        loop {
            // A registration is not retried on a timeout (the server may have
            // taken it, and the join token registers a name once): wait long.
            let (status, answer, _) = self
                .post(
                    uri.clone(),
                    auth.clone(),
                    body.clone(),
                    Duration::from_secs(300),
                )
                .await
                .map_err(|e| anyhow::anyhow!("registering {name}: {e}"))?;
            if status == StatusCode::TOO_MANY_REQUESTS && tries < 100 {
                tries += 1;
                self.retries.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            if !status.is_success() {
                bail!(
                    "registering {name}: {status}: {}",
                    String::from_utf8_lossy(&answer)
                );
            }
            let v: Value = serde_json::from_slice(&answer)
                .with_context(|| format!("registering {name}: the answer"))?;
            return v["node_token"]
                .as_str()
                .map(str::to_string)
                .with_context(|| format!("no node token for {name}: {v}"));
        }
    }

    /// Syncs one hollow node; returns whether it should sync again at once.
    async fn sync_one(
        &self,
        uri: &hyper::Uri,
        auth: &HeaderValue,
        tasks: &mut HashMap<(u64, u32), Task>,
        stats: &mut AgentStats,
    ) -> bool {
        let now = Instant::now();
        let reports: Vec<TaskReport> = tasks
            .iter()
            .map(|(&(job, attempt), t)| {
                // As a real agent, it says the ranks run before it says they
                // exited, even when its syncs lag behind a short job.
                let state = if now >= t.ends && t.reported_running {
                    TaskState::Exited { exit_code: 0 }
                } else {
                    TaskState::Running
                };
                TaskReport::new(gangway_core::JobId(job), attempt, state)
            })
            .collect();
        let Ok(body) = sync_body(&self.sync_prefix, &reports) else {
            stats.sync_errors += 1;
            return false;
        };
        let resp = match self
            .post(uri.clone(), auth.clone(), body, Duration::from_secs(30))
            .await
        {
            Ok((status, answer, t)) if status == StatusCode::OK => {
                match serde_json::from_slice::<SyncResponse>(&answer) {
                    Ok(resp) => {
                        let phase = self.phase.load(Ordering::Relaxed);
                        if phase > 0 {
                            stats.sync_ms.push((phase, t));
                        }
                        resp
                    }
                    Err(_) => {
                        stats.sync_errors += 1;
                        return false;
                    }
                }
            }
            _ => {
                stats.sync_errors += 1;
                return false;
            }
        };
        self.syncs.fetch_add(1, Ordering::Relaxed);
        let done = Instant::now();
        // The server now knows these ranks run.
        for (&(job, attempt), task) in tasks.iter_mut() {
            if !task.reported_running {
                task.reported_running = true;
                if let Ok(mut m) = self.running.lock() {
                    let e =
                        m.entry(job)
                            .or_default()
                            .entry(attempt)
                            .or_insert((0, task.nnodes, done));
                    e.0 += 1;
                    e.2 = done;
                }
            }
        }
        let mut changed = false;
        let mut keep = std::collections::HashSet::new();
        for a in resp.assignments {
            let k = (a.job.0, a.attempt);
            keep.insert(k);
            match tasks.get_mut(&k) {
                None if !a.stop => {
                    tasks.insert(
                        k,
                        Task {
                            ends: done + Duration::from_secs(sleep_secs(&a.run)),
                            reported_running: false,
                            nnodes: a.nnodes,
                        },
                    );
                    changed = true;
                }
                Some(t) if a.stop && t.ends > done => {
                    // Checkpoint-and-stop: the ranks exit at once.
                    t.ends = done;
                    changed = true;
                }
                _ => {}
            }
        }
        // What the server no longer assigns is gone (killed or forgotten).
        tasks.retain(|k, _| keep.contains(k));
        changed
    }
}

/// One hollow agent, a task on the bench's runtime: registers, then syncs
/// at its period (its first sync spread over one period by its index;
/// again at once after a change, and when a task ends) until told to stop.
async fn hollow_agent(fleet: Arc<Fleet>, i: usize) -> Result<AgentStats> {
    let name = format!("h{i:05}");
    let token = fleet.register(&name, i / 32).await?;
    fleet.registered.fetch_add(1, Ordering::Relaxed);
    let uri: hyper::Uri = format!("{}/v1/agent/{name}/sync", fleet.base).parse()?;
    let auth = HeaderValue::from_str(&format!("Bearer {token}"))?;
    let period = fleet.period;
    let mut tasks = HashMap::new();
    let mut stats = AgentStats::default();
    let mut due = Instant::now() + period.mul_f64(i as f64 / fleet.nodes.max(1) as f64);
    let mut last: Option<Instant> = None;
    while !fleet.stop.load(Ordering::Relaxed) {
        tokio::time::sleep_until(due.into()).await;
        if fleet.stop.load(Ordering::Relaxed) {
            break;
        }
        let now = Instant::now();
        if last.is_some_and(|l| now - l > period + period / 2)
            && fleet.phase.load(Ordering::Relaxed) > 0
        {
            stats.late += 1;
        }
        last = Some(now);
        let again = fleet.sync_one(&uri, &auth, &mut tasks, &mut stats).await;
        let now = Instant::now();
        due = if again {
            now
        } else {
            let end = tasks.values().map(|t| t.ends).filter(|e| *e > now).min();
            end.map_or(now + period, |e| e.min(now + period))
        };
    }
    Ok(stats)
}

/// The hollow agents: their runtime (its own worker threads, named so their
/// CPU time can be read apart) and tasks.
struct Agents {
    rt: tokio::runtime::Runtime,
    fleet: Arc<Fleet>,
    tasks: Vec<tokio::task::JoinHandle<Result<AgentStats>>>,
}

/// The name of the hollow agents' threads (`/proc/self/task/*/comm`).
const AGENT_THREAD: &str = "hollow-agents";

impl Agents {
    fn start(a: &ClusterArgs, base: &str, running: RunningAt) -> Result<Agents> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(a.agent_threads)
            .thread_name(AGENT_THREAD)
            .enable_all()
            .build()?;
        let health: Vec<GpuHealth> = (0..a.gpus_per_node)
            .map(|i| GpuHealth {
                index: i,
                healthy: true,
                reason: None,
            })
            .collect();
        let http = {
            let _in_rt = rt.enter();
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            Client::builder(TokioExecutor::new())
                .pool_timer(TokioTimer::new())
                .pool_idle_timeout(Duration::from_secs(60))
                .pool_max_idle_per_host(a.agent_connections)
                .build(connector)
        };
        let fleet = Arc::new(Fleet {
            http,
            base: base.to_string(),
            permits: tokio::sync::Semaphore::new(a.agent_connections),
            registrations: tokio::sync::Semaphore::new(a.agent_connections.div_ceil(8)),
            sync_prefix: sync_prefix(&health)?,
            gpus: a.gpus_per_node,
            period: Duration::from_millis(a.sync_ms.max(1)),
            nodes: a.nodes,
            running,
            registered: AtomicUsize::new(0),
            syncs: AtomicU64::new(0),
            retries: AtomicUsize::new(0),
            phase: AtomicU8::new(0),
            stop: AtomicBool::new(false),
        });
        let tasks = (0..a.nodes)
            .map(|i| rt.spawn(hollow_agent(fleet.clone(), i)))
            .collect();
        Ok(Agents { rt, fleet, tasks })
    }

    /// Stops the agents; what they measured, together.
    fn stop(self) -> Result<AgentStats> {
        self.fleet.stop.store(true, Ordering::Relaxed);
        let mut all = AgentStats::default();
        let mut first_err = None;
        self.rt.block_on(async {
            for t in self.tasks {
                match t.await {
                    Ok(Ok(s)) => {
                        all.sync_ms.extend(s.sync_ms);
                        all.sync_errors += s.sync_errors;
                        all.late += s.late;
                    }
                    Ok(Err(e)) => {
                        first_err.get_or_insert(e);
                    }
                    Err(e) => {
                        first_err.get_or_insert(anyhow::anyhow!("a hollow agent panicked: {e}"));
                    }
                }
            }
        });
        match first_err {
            Some(e) => Err(e),
            None => Ok(all),
        }
    }
}

/// A line on stderr every ten seconds (agents registered, jobs submitted,
/// syncs and CPU since the last line), so a run too big for the machine
/// shows how far it got and why.
struct Progress {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Progress {
    fn start(fleet: Arc<Fleet>, submitted: Arc<AtomicUsize>, server: u32) -> Progress {
        let stop = Arc::new(AtomicBool::new(false));
        let done = stop.clone();
        let thread = std::thread::spawn(move || {
            let t0 = Instant::now();
            let mut last = (Instant::now(), Cpu::now(server, None), 0u64);
            while !done.load(Ordering::Relaxed) {
                let tick = Instant::now() + Duration::from_secs(10);
                while Instant::now() < tick && !done.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                }
                let (now, cpu, syncs) = (
                    Instant::now(),
                    Cpu::now(server, None),
                    fleet.syncs.load(Ordering::Relaxed),
                );
                let secs = (now - last.0).as_secs_f64().max(1e-9);
                let cores = |a: Option<f64>, b: Option<f64>| match (a, b) {
                    (Some(a), Some(b)) => format!("{:.2}", (b - a) / secs),
                    _ => "n/a".into(),
                };
                eprintln!(
                    "[{:.0} s] {} agents registered, {} jobs submitted, {:.0} syncs/s; cores: server {}, bench {} (agents {:.2})",
                    t0.elapsed().as_secs_f64(),
                    fleet.registered.load(Ordering::Relaxed),
                    submitted.load(Ordering::Relaxed),
                    (syncs - last.2) as f64 / secs,
                    cores(last.1.server, cpu.server),
                    cores(last.1.bench, cpu.bench),
                    (cpu.agents - last.1.agents) / secs,
                );
                last = (now, cpu, syncs);
            }
        });
        Progress { stop, thread }
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
    }
}

/// CPU seconds (user + system) in a `/proc/.../stat` file: a process's
/// (its threads, live and ended, together) or one thread's.
fn stat_cpu_secs(path: &std::path::Path) -> Option<f64> {
    let s = std::fs::read_to_string(path).ok()?;
    // The name (field 2) may hold spaces: count from its closing parenthesis.
    let fields: Vec<&str> = s[s.rfind(')')? + 1..].split_whitespace().collect();
    // Fields 14 and 15 (utime, stime) are the 12th and 13th after the name.
    let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / clock_ticks())
}

/// Clock ticks per second (`_SC_CLK_TCK`), the unit of `/proc` CPU times.
fn clock_ticks() -> f64 {
    // SAFETY: sysconf reads a constant of the system; it touches no memory of ours.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// CPU seconds of this process's threads named `name`.
fn threads_cpu_secs(name: &str) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    dir.flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .filter_map(|t| stat_cpu_secs(&t.path().join("stat")))
        .sum()
}

/// The etcd process serving `endpoint` (the bench started it; its pid is
/// found by its command line).
fn etcd_pid(endpoint: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|p| {
        let pid: u32 = p.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(p.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
        args.windows(2)
            .any(|w| w[0] == b"--listen-client-urls" && w[1] == endpoint.as_bytes())
            .then_some(pid)
    })
}

/// CPU seconds used so far by the server, etcd (if any), this whole bench
/// process, and its hollow agents' threads.
#[derive(Clone, Copy)]
struct Cpu {
    server: Option<f64>,
    etcd: Option<f64>,
    bench: Option<f64>,
    agents: f64,
}

impl Cpu {
    fn now(server: u32, etcd: Option<u32>) -> Cpu {
        let stat = |pid: u32| stat_cpu_secs(std::path::Path::new(&format!("/proc/{pid}/stat")));
        Cpu {
            server: stat(server),
            etcd: etcd.and_then(stat),
            bench: stat_cpu_secs(std::path::Path::new("/proc/self/stat")),
            agents: threads_cpu_secs(AGENT_THREAD),
        }
    }
}

/// One phase of the run: its wall time, CPU at both ends, syncs answered.
struct Phase {
    name: &'static str,
    secs: f64,
    from: Cpu,
    to: Cpu,
    syncs: u64,
}

impl Phase {
    fn server(&self) -> Option<f64> {
        Some(self.to.server? - self.from.server?)
    }

    fn etcd(&self) -> Option<f64> {
        Some(self.to.etcd? - self.from.etcd?)
    }

    fn bench(&self) -> Option<f64> {
        Some(self.to.bench? - self.from.bench?)
    }

    fn agents(&self) -> f64 {
        self.to.agents - self.from.agents
    }

    fn print(&self) {
        let n = self.name;
        let secs = self.secs.max(1e-9);
        match self.server() {
            Some(s) => println!(
                "server_cpu_seconds_{n}: {s:.2} s ({:.2} cores over {secs:.1} s, {} syncs)",
                s / secs,
                self.syncs
            ),
            None => println!("server_cpu_seconds_{n}: n/a"),
        }
        if let Some(e) = self.etcd() {
            println!("etcd_cpu_seconds_{n}: {e:.2} s ({:.2} cores)", e / secs);
        }
        match self.bench() {
            Some(b) => println!(
                "bench_cpu_seconds_{n}: {b:.2} s ({:.2} cores; {:.2} s of it in the hollow agents' threads)",
                b / secs,
                self.agents()
            ),
            None => println!("bench_cpu_seconds_{n}: n/a"),
        }
    }
}
/// Submits a job (a JSON body serialised beforehand); its id.
fn submit(http: &ureq::Agent, base: &str, body: &[u8]) -> Result<u64, String> {
    #[derive(serde::Deserialize)]
    struct Created {
        id: u64,
    }
    let r = http
        .post(&format!("{base}/v1/jobs"))
        .set("Authorization", &format!("Bearer {ADMIN}"))
        .set("Content-Type", "application/json")
        .send_bytes(body)
        .map_err(|e| e.to_string())?;
    let c: Created = r.into_json().map_err(|e| e.to_string())?;
    Ok(c.id)
}

/// The backlog's job bodies, serialised before the submission phase so the
/// clients spend their time on the server, not on JSON.
fn backlog_bodies(a: &ClusterArgs) -> Result<Vec<Vec<u8>>> {
    let mut rng = Rng(a.seed);
    (0..a.pending)
        .map(|i| Ok(serde_json::to_vec(&backlog_job(&mut rng, i, a))?))
        .collect()
}

fn backlog_job(rng: &mut Rng, i: usize, a: &ClusterArgs) -> Value {
    let g = philly_gpus(rng).min(a.gpus_per_node.saturating_mul(16));
    let per_node = a.gpus_per_node.max(1);
    let (replicas, per) = if g <= per_node {
        (1, g)
    } else {
        (g.div_ceil(per_node), per_node)
    };
    let span = a.max_runtime.saturating_sub(a.min_runtime) + 1;
    let runtime = a.min_runtime + rng.next() % span;
    json!({
        "name": format!("b{i}"), "queue": "backlog", "replicas": replicas,
        "resources": { "gpus": per, "cpu_millis": 1000, "memory_mib": 1024 },
        "run": { "command": ["sleep", runtime.to_string()] }
    })
}

/// A GET's latency in ms, or `None` when it failed.
fn get(http: &ureq::Agent, url: &str) -> Option<f64> {
    let t = Instant::now();
    let r = http
        .get(url)
        .set("Authorization", &format!("Bearer {ADMIN}"))
        .call()
        .ok()?;
    let mut sink = Vec::new();
    std::io::Read::read_to_end(&mut r.into_reader(), &mut sink).ok()?;
    Some(ms(t))
}

/// The store's size on disk and the part of it in use: the redb file (all
/// of it counted as in use), or etcd's database (its own `/metrics`).
fn store_bytes(server: &Server, etcd: Option<&str>) -> Option<(u64, u64)> {
    match etcd {
        None => {
            let data = server.log.parent()?.join("data").join("gangway.redb");
            let n = std::fs::metadata(data).ok()?.len();
            Some((n, n))
        }
        Some(ep) => {
            let text = ureq::get(&format!("{ep}/metrics"))
                .timeout(Duration::from_secs(5))
                .call()
                .ok()?
                .into_string()
                .ok()?;
            let m = parse_metrics(&text);
            let find = |name: &str| m.get(name).map(|v| *v as u64);
            Some((
                find("etcd_mvcc_db_total_size_in_bytes")?,
                find("etcd_mvcc_db_total_size_in_use_in_bytes")?,
            ))
        }
    }
}

/// Counters and histogram buckets of a `/metrics` text (name{labels} → value).
fn scrape(http: &ureq::Agent, base: &str) -> HashMap<String, f64> {
    let text = http
        .get(&format!("{base}/metrics"))
        .set("Authorization", &format!("Bearer {ADMIN}"))
        .call()
        .ok()
        .and_then(|r| r.into_string().ok())
        .unwrap_or_default();
    parse_metrics(&text)
}

/// The samples of a Prometheus text exposition (name{labels} → value).
fn parse_metrics(text: &str) -> HashMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// The smallest histogram bound below which `p` of the observations made
/// between two scrapes fall (Prometheus' buckets, so an upper bound).
fn bucket_quantile(
    before: &HashMap<String, f64>,
    after: &HashMap<String, f64>,
    name: &str,
    p: f64,
) -> Option<f64> {
    let prefix = format!("{name}_bucket{{le=\"");
    let mut buckets: Vec<(f64, f64)> = after
        .iter()
        .filter_map(|(k, v)| {
            let le = k.strip_prefix(&prefix)?.strip_suffix("\"}")?;
            let le: f64 = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, v - before.get(k).copied().unwrap_or(0.0)))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    buckets
        .iter()
        .find(|(_, c)| *c >= total * p)
        .map(|(le, _)| *le)
}

fn delta(before: &HashMap<String, f64>, after: &HashMap<String, f64>, k: &str) -> f64 {
    after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0)
}

/// Runs the benchmark.
pub fn run(a: &ClusterArgs) -> Result<()> {
    if a.nodes == 0
        || a.gpus_per_node == 0
        || a.clients == 0
        || a.agent_threads == 0
        || a.agent_connections == 0
    {
        bail!("--nodes, --gpus-per-node, --clients, --agent-threads and --agent-connections must be at least 1");
    }
    if (a.nodes as u64)
        .checked_mul(u64::from(a.gpus_per_node))
        .is_none()
    {
        bail!("--nodes times --gpus-per-node is too large");
    }
    if a.min_runtime > a.max_runtime {
        bail!("--min-runtime must not exceed --max-runtime");
    }
    let etcd = match a.store {
        StoreKind::Etcd => Some(gangway_store::testing::EtcdProcess::start().context(
            "gangway-bench cluster --store etcd needs etcd (apt-get install etcd-server)",
        )?),
        StoreKind::Redb => None,
    };
    let dir = tempfile::tempdir()?;
    let server = start_server(a, dir.path(), etcd.as_ref().map(|e| e.endpoint.as_str()))?;
    let r = measure(a, &server, etcd.as_ref().map(|e| e.endpoint.as_str()));
    if r.is_err() {
        eprintln!("server log:\n{}", server.log_tail());
    }
    r
}

fn measure(a: &ClusterArgs, server: &Server, etcd: Option<&str>) -> Result<()> {
    let base = server.base.clone();
    let server_pid = server.child.id();
    let etcd_pid = etcd.and_then(etcd_pid);
    let cpu = || Cpu::now(server_pid, etcd_pid);
    let running: RunningAt = Arc::default();
    let bodies = Arc::new(backlog_bodies(a)?);
    let cpu_start = cpu();
    let t_reg = Instant::now();
    let agents = Agents::start(a, &base, running.clone())?;
    let fleet = agents.fleet.clone();
    let syncs = || fleet.syncs.load(Ordering::Relaxed);
    let submitted = Arc::new(AtomicUsize::new(0));
    let progress = Progress::start(fleet.clone(), submitted.clone(), server_pid);
    while fleet.registered.load(Ordering::Relaxed) < a.nodes {
        if agents.tasks.iter().any(|t| t.is_finished()) {
            // Agents end only when told to: this one failed to register.
            return Err(agents.stop().err().unwrap_or_else(|| {
                anyhow::anyhow!("a hollow agent stopped before all registered")
            }));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let reg_secs = t_reg.elapsed().as_secs_f64();
    fleet.phase.store(1, Ordering::Relaxed);
    eprintln!("registered {} hollow agents in {reg_secs:.1} s", a.nodes);

    // Phase 0: idle: only the agents' syncs (and cycles with nothing to
    // place), so the server's CPU per sync can be read alone.
    let (from, s0, t0) = (cpu(), syncs(), Instant::now());
    std::thread::sleep(Duration::from_secs(a.idle_seconds));
    let idle = Phase {
        name: "idle",
        secs: t0.elapsed().as_secs_f64(),
        from,
        to: cpu(),
        syncs: syncs() - s0,
    };

    // Phase 1: the backlog, as fast as the clients can submit it.
    let http = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(30))
        .build();
    let m0 = scrape(&http, &base);
    let (from, s0) = (cpu(), syncs());
    let t_sub = Instant::now();
    fleet.phase.store(2, Ordering::Relaxed);
    let next = Arc::new(AtomicUsize::new(0));
    let submitters: Vec<_> = (0..a.clients)
        .map(|_| {
            let (base, next, bodies, submitted) = (
                base.clone(),
                next.clone(),
                bodies.clone(),
                submitted.clone(),
            );
            std::thread::spawn(move || {
                let http = ureq::AgentBuilder::new()
                    .timeout(Duration::from_secs(30))
                    .build();
                let (mut lat, mut errors) = (Vec::new(), 0usize);
                while let Some(body) = bodies.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let t = Instant::now();
                    match submit(&http, &base, body) {
                        Ok(_) => {
                            lat.push(ms(t));
                            submitted.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => errors += 1,
                    }
                }
                (lat, errors)
            })
        })
        .collect();
    let mut sub_lat = Vec::new();
    let mut sub_errors = 0;
    for h in submitters {
        let (l, e) = h
            .join()
            .map_err(|_| anyhow::anyhow!("a submitter panicked"))?;
        sub_lat.extend(l);
        sub_errors += e;
    }
    let sub_secs = t_sub.elapsed().as_secs_f64();
    let submitting = Phase {
        name: "submit",
        secs: sub_secs,
        from,
        to: cpu(),
        syncs: syncs() - s0,
    };
    let sub_lat = sorted(sub_lat);
    let m1 = scrape(&http, &base);

    // Phase 2: steady state: readers, a metrics scraper and the probe.
    let (from, s0) = (cpu(), syncs());
    let t_steady = Instant::now();
    fleet.phase.store(3, Ordering::Relaxed);
    let until = t_steady + Duration::from_secs(a.seconds);
    let max_id = Arc::new(AtomicUsize::new(a.pending.max(1)));
    let readers: Vec<_> = (0..a.clients)
        .map(|c| {
            let (base, max_id) = (base.clone(), max_id.clone());
            let seed = a.seed.wrapping_add(c as u64);
            std::thread::spawn(move || {
                let http = ureq::AgentBuilder::new()
                    .timeout(Duration::from_secs(30))
                    .build();
                let mut rng = Rng(seed);
                let (mut list, mut describe, mut errors) = (Vec::new(), Vec::new(), 0usize);
                let mut k = 0u64;
                while Instant::now() < until {
                    let n = max_id.load(Ordering::Relaxed) as u64;
                    let r = if k.is_multiple_of(2) {
                        // A page from a random point, reached by its cursor
                        // as the CLI pages (an `offset` walks every job
                        // before it: O(offset), as in any keyset-less list).
                        let after = rng.next() % n;
                        let cursor = gangway_server::http::listing::cursor_after(
                            gangway_core::JobId(after),
                            false,
                        );
                        get(&http, &format!("{base}/v1/jobs?limit=100&cursor={cursor}"))
                            .map(|t| list.push(t))
                    } else {
                        let id = 1 + rng.next() % n;
                        get(&http, &format!("{base}/v1/jobs/{id}")).map(|t| describe.push(t))
                    };
                    if r.is_none() {
                        errors += 1;
                    }
                    k += 1;
                    // A client thinks between requests; the server is not a tight loop's.
                    std::thread::sleep(Duration::from_millis(10));
                }
                (list, describe, errors)
            })
        })
        .collect();
    let scraper = {
        let base = base.clone();
        std::thread::spawn(move || {
            let http = ureq::AgentBuilder::new().build();
            // Each scrape is followed by a `/healthz` (no work at all) on
            // the same connection: the floor any request meets on this
            // machine at this moment, to read the scrape's p99 against.
            let (mut v, mut floor) = (Vec::new(), Vec::new());
            while Instant::now() < until {
                if let Some(t) = get(&http, &format!("{base}/metrics")) {
                    v.push(t);
                }
                if let Some(t) = get(&http, &format!("{base}/healthz")) {
                    floor.push(t);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            (v, floor)
        })
    };
    // The probe: one gang at a time, 1, 8 and 64 GPUs in turn.
    let mut probe: HashMap<u32, Vec<f64>> = HashMap::new();
    let mut probe_missed = 0usize;
    let sizes = [1u32, 8, 64];
    let mut k = 0usize;
    while Instant::now() < until {
        let g = sizes[k % sizes.len()];
        k += 1;
        let per = a.gpus_per_node.min(g);
        let replicas = g.div_ceil(per);
        let spec = serde_json::to_vec(&json!({
            "name": format!("probe{k}"), "queue": "probe", "replicas": replicas,
            "resources": { "gpus": per, "cpu_millis": 1000, "memory_mib": 1024 },
            "run": { "command": ["sleep", "1"] }
        }))?;
        let t = Instant::now();
        let Ok(id) = submit(&http, &base, &spec) else {
            probe_missed += 1;
            continue;
        };
        max_id.fetch_max(usize::try_from(id).unwrap_or(usize::MAX), Ordering::Relaxed);
        let deadline = t + Duration::from_secs(30);
        loop {
            let done = running.lock().ok().and_then(|m| {
                m.get(&id)?
                    .values()
                    .find(|(seen, nnodes, _)| seen >= nnodes)
                    .map(|(_, _, at)| *at)
            });
            if let Some(at) = done {
                probe
                    .entry(g)
                    .or_default()
                    .push((at - t).as_secs_f64() * 1e3);
                break;
            }
            if Instant::now() > deadline {
                probe_missed += 1;
                // Say what the server thinks, so a miss can be diagnosed.
                let seen = running
                    .lock()
                    .ok()
                    .and_then(|m| {
                        m.get(&id).map(|atts| {
                            atts.iter()
                                .map(|(att, (s, n, _))| format!("attempt {att}: {s}/{n} nodes"))
                                .collect::<Vec<_>>()
                        })
                    })
                    .unwrap_or_default();
                let job = http
                    .get(&format!("{base}/v1/jobs/{id}"))
                    .set("Authorization", &format!("Bearer {ADMIN}"))
                    .call()
                    .map_err(|e| e.to_string())
                    .and_then(|r| r.into_string().map_err(|e| e.to_string()));
                eprintln!(
                    "probe job {id} ({g} GPUs) not running after 30 s; agents saw {seen:?}; server: {}",
                    job.unwrap_or_else(|e| e)
                        .chars()
                        .take(4000)
                        .collect::<String>()
                );
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut list = Vec::new();
    let mut describe = Vec::new();
    let mut read_errors = 0;
    for h in readers {
        let (l, d, e) = h.join().map_err(|_| anyhow::anyhow!("a reader panicked"))?;
        list.extend(l);
        describe.extend(d);
        read_errors += e;
    }
    let (scrapes, floor) = scraper
        .join()
        .map_err(|_| anyhow::anyhow!("the scraper panicked"))?;
    let (scrapes, floor) = (sorted(scrapes), sorted(floor));
    let steady_secs = t_steady.elapsed().as_secs_f64();
    let steady = Phase {
        name: "steady",
        secs: steady_secs,
        from,
        to: cpu(),
        syncs: syncs() - s0,
    };
    let m2 = scrape(&http, &base);
    let rss = server.peak_rss_mib();
    let cpu_end = cpu();
    progress.stop();
    let stats = agents.stop()?;
    let by_phase: Vec<Vec<f64>> = (1..=PHASES.len() as u8)
        .map(|p| {
            sorted(
                stats
                    .sync_ms
                    .iter()
                    .filter(|(q, _)| *q == p)
                    .map(|(_, t)| *t)
                    .collect(),
            )
        })
        .collect();
    let sync = sorted(stats.sync_ms.iter().map(|(_, t)| *t).collect());
    let (list, describe) = (sorted(list), sorted(describe));
    // Every request the server answered in the steady state.
    let steady_requests = steady.syncs as usize
        + list.len()
        + describe.len()
        + read_errors
        + scrapes.len()
        + floor.len()
        + k;

    let store = match a.store {
        StoreKind::Redb => "redb",
        StoreKind::Etcd => "etcd",
    };
    println!(
        "# gangway-bench cluster: {} hollow nodes x {} GPUs, {} backlog jobs, {} clients, {store}, agents sync every {} ms",
        a.nodes, a.gpus_per_node, a.pending, a.clients, a.sync_ms
    );
    println!(
        "registration_secs: {reg_secs:.2} s ({} nodes, {} retries after 429)",
        a.nodes,
        fleet.retries.load(Ordering::Relaxed)
    );
    println!(
        "submissions: {} jobs ({sub_errors} refused or failed)",
        sub_lat.len()
    );
    println!(
        "submissions_per_sec: {:.1} jobs/s",
        sub_lat.len() as f64 / sub_secs.max(1e-9)
    );
    println!("submit_latency_p50: {:.2} ms", percentile(&sub_lat, 0.5));
    println!("submit_latency_p99: {:.2} ms", percentile(&sub_lat, 0.99));
    println!(
        "list_latency_p99: {:.2} ms ({} pages of 100 from random cursors, {read_errors} failed reads)",
        percentile(&list, 0.99),
        list.len()
    );
    println!(
        "describe_latency_p99: {:.2} ms ({} requests)",
        percentile(&describe, 0.99),
        describe.len()
    );
    println!(
        "metrics_scrape_p99: {:.2} ms ({} scrapes)",
        percentile(&scrapes, 0.99),
        scrapes.len()
    );
    println!(
        "healthz_p99: {:.2} ms ({} requests, each right after a scrape: the floor of any request here then)",
        percentile(&floor, 0.99),
        floor.len()
    );
    println!(
        "agent_syncs_per_sec_steady: {:.1} syncs/s ({} nodes every {} ms would be {:.0})",
        steady.syncs as f64 / steady_secs.max(1e-9),
        a.nodes,
        a.sync_ms,
        a.nodes as f64 * 1000.0 / a.sync_ms.max(1) as f64
    );
    println!("agent_sync_p50: {:.2} ms", percentile(&sync, 0.5));
    println!(
        "agent_sync_p99: {:.2} ms ({} syncs after registration, {} failed, {} late by over half a period)",
        percentile(&sync, 0.99),
        sync.len(),
        stats.sync_errors,
        stats.late
    );
    println!(
        "agent_sync_p99_by_phase: {} ms",
        PHASES
            .iter()
            .zip(&by_phase)
            .map(|(name, v)| format!("{name} {:.2}", percentile(v, 0.99)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let probed: usize = probe.values().map(Vec::len).sum();
    for g in sizes {
        let v = sorted(probe.remove(&g).unwrap_or_default());
        println!(
            "submit_to_running_{g}gpu_p50: {:.0} ms ({} gangs)",
            percentile(&v, 0.5),
            v.len()
        );
        println!(
            "submit_to_running_{g}gpu_p99: {:.0} ms",
            percentile(&v, 0.99)
        );
    }
    println!("probe_gangs_not_running_within_30s: {probe_missed}");
    let cycles = delta(&m0, &m2, "gangway_scheduling_cycle_seconds_count");
    match bucket_quantile(&m0, &m2, "gangway_scheduling_cycle_seconds", 0.99) {
        Some(le) => println!(
            "scheduling_cycle_p99: <= {:.1} ms ({cycles} cycles, histogram bucket bound)",
            le * 1e3
        ),
        None => println!("scheduling_cycle_p99: n/a (no cycle observed)"),
    }
    let binds = delta(&m1, &m2, "gangway_decisions_total{kind=\"bind\"}");
    println!(
        "binds_per_sec_steady: {:.1} jobs/s",
        binds / steady_secs.max(1e-9)
    );
    let total_secs = sub_secs + steady_secs;
    println!(
        "store_txns_per_sec: {:.1} txn/s",
        delta(&m0, &m2, "gangway_store_txns_total") / total_secs.max(1e-9)
    );
    println!(
        "store_ops_per_sec: {:.1} op/s",
        delta(&m0, &m2, "gangway_store_ops_total") / total_secs.max(1e-9)
    );
    println!(
        "store_compactions: {:.0} (history kept {}; compacted to revision {:.0})",
        delta(&m0, &m2, "gangway_store_compactions_total"),
        a.store_history,
        m2.get("gangway_store_compacted_revision")
            .copied()
            .unwrap_or(0.0)
    );
    match store_bytes(server, etcd) {
        Some((size, in_use)) => println!(
            "store_size: {:.1} MiB ({:.1} MiB in use)",
            size as f64 / 1048576.0,
            in_use as f64 / 1048576.0
        ),
        None => println!("store_size: n/a"),
    }
    // The state lock: the share of each phase's wall time each holder
    // held it, and waited for it (waits overlap: several may wait at once).
    for (phase, from, to, secs) in [
        ("submit", &m0, &m1, sub_secs),
        ("steady", &m1, &m2, steady_secs),
    ] {
        let share = |family: &str| -> String {
            gangway_server::view::Holder::ALL
                .iter()
                .map(|h| {
                    let h = h.name();
                    let k = format!("gangway_state_lock_{family}_total{{holder=\"{h}\"}}");
                    format!("{h} {:.2}", delta(from, to, &k) / secs.max(1e-9))
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!(
            "state_lock_held_share_{phase}: {} (of the phase's wall time)",
            share("held_seconds")
        );
        println!(
            "state_lock_wait_share_{phase}: {} (summed over waiters)",
            share("wait_seconds")
        );
    }
    // Where the jobs are at the end (the /metrics snapshot, by state).
    let mut states: std::collections::BTreeMap<String, f64> = Default::default();
    for (k, v) in &m2 {
        if let Some(rest) = k.strip_prefix("gangway_jobs{") {
            if let Some(st) = rest
                .split("state=\"")
                .nth(1)
                .and_then(|x| x.split('"').next())
            {
                *states.entry(st.to_string()).or_default() += v;
            }
        }
    }
    let states: Vec<String> = states.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!("jobs_at_end: {}", states.join(" "));
    match rss {
        Some(r) => println!("server_peak_rss: {r:.0} MiB"),
        None => println!("server_peak_rss: n/a"),
    }
    print_cpu(
        a,
        &[&idle, &submitting, &steady],
        sub_lat.len(),
        delta(&m0, &m1, "gangway_scheduling_cycle_seconds_sum"),
        steady_requests,
        (cpu_start, cpu_end),
    );
    // The figures are printed either way; a run that lost work fails.
    if sub_errors > 0 || probe_missed > 0 || probed == 0 {
        bail!(
            "{sub_errors} submissions failed, {probe_missed} probe gangs did not run within 30 s, {probed} ran"
        );
    }
    Ok(())
}

/// The CPU figures: each phase's, then the server's cost per sync (idle
/// phase), per submission (submission phase, less its syncs at the idle
/// cost) and per request (steady phase), and the cores those costs imply
/// for the targets (every node syncing each period, 5,000
/// submissions/s).
fn print_cpu(
    a: &ClusterArgs,
    phases: &[&Phase; 3],
    submissions: usize,
    cycle_secs: f64,
    steady_requests: usize,
    (start, end): (Cpu, Cpu),
) {
    let [idle, submitting, steady] = *phases;
    for p in phases {
        p.print();
    }
    let per = |cpu: Option<f64>, n: usize| cpu.filter(|_| n > 0).map(|c| c * 1e3 / n as f64);
    let show = |name: &str, v: Option<f64>, what: &str| match v {
        Some(v) => println!("{name}: {v:.3} ms ({what})"),
        None => println!("{name}: n/a ({what})"),
    };
    let per_sync = per(idle.server(), idle.syncs as usize);
    show(
        "server_cpu_ms_per_sync",
        per_sync,
        "idle phase: server CPU / syncs",
    );
    show(
        "bench_cpu_ms_per_sync",
        per(Some(idle.agents()), idle.syncs as usize),
        "idle phase: hollow agents' CPU / syncs",
    );
    let syncs_cpu = per_sync.map(|p| p * submitting.syncs as f64 / 1e3);
    let per_submission = per(
        submitting
            .server()
            .zip(syncs_cpu)
            .map(|(s, y)| (s - y).max(0.0)),
        submissions,
    );
    show(
        "server_cpu_ms_per_submission",
        per_submission,
        &format!(
            "submission phase: server CPU less its syncs at the idle cost, / jobs submitted; \
             it includes placing them ({cycle_secs:.2} s in scheduling cycles) and the reports \
             of those that ran and ended meanwhile"
        ),
    );
    if let (Some(e), Some(i)) = (submitting.etcd(), idle.etcd()) {
        let idle_rate = i / idle.secs.max(1e-9);
        show(
            "etcd_cpu_ms_per_submission",
            per(
                Some((e - idle_rate * submitting.secs).max(0.0)),
                submissions,
            ),
            "submission phase: etcd CPU less its idle rate, / submissions",
        );
    }
    show(
        "server_cpu_ms_per_request",
        per(steady.server(), steady_requests),
        &format!("steady phase: server CPU / {steady_requests} requests of all kinds"),
    );
    let whole = |f: fn(&Cpu) -> Option<f64>| Some(f(&end)? - f(&start)?);
    match whole(|c| c.server) {
        Some(s) => println!("server_cpu_seconds: {s:.2} s (registration to the end)"),
        None => println!("server_cpu_seconds: n/a"),
    }
    match whole(|c| c.bench) {
        Some(b) => println!(
            "bench_cpu_seconds: {b:.2} s (registration to the end; {:.2} s in the hollow agents' threads)",
            end.agents - start.agents
        ),
        None => println!("bench_cpu_seconds: n/a"),
    }
    if let Some(e) = whole(|c| c.etcd) {
        println!("etcd_cpu_seconds: {e:.2} s (registration to the end)");
    }
    if let (Some(sync), Some(sub)) = (per_sync, per_submission) {
        let syncs_per_sec = a.nodes as f64 * 1000.0 / a.sync_ms.max(1) as f64;
        println!(
            "server_cores_for_targets: {:.2} cores ({syncs_per_sec:.0} syncs/s at {sync:.3} ms + 5000 submissions/s at {sub:.3} ms; an estimate from this run's costs)",
            (syncs_per_sec * sync + 5000.0 * sub) / 1e3
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_bodies_are_the_protocols_sync_requests() {
        let gpus: Vec<GpuHealth> = (0..3)
            .map(|i| GpuHealth {
                index: i,
                healthy: i != 1,
                reason: (i == 1).then(|| "xid 79".to_string()),
            })
            .collect();
        let prefix = sync_prefix(&gpus).expect("prefix");
        let reports = [
            TaskReport::new(gangway_core::JobId(7), 0, TaskState::Running),
            TaskReport::new(
                gangway_core::JobId(9),
                2,
                TaskState::Exited { exit_code: 0 },
            ),
        ];
        for n in 0..=reports.len() {
            let body = sync_body(&prefix, &reports[..n]).expect("body");
            let want = SyncRequest {
                disk_pressure: None,
                gpus: gpus.clone(),
                tasks: reports[..n].to_vec(),
                ..Default::default()
            };
            let got: SyncRequest = serde_json::from_slice(&body).expect("a sync request");
            assert_eq!(got, want, "{}", String::from_utf8_lossy(&body));
            assert_eq!(body, serde_json::to_vec(&want).expect("json"));
        }
    }

    #[test]
    fn cpu_seconds_are_read_after_the_name() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("stat");
        // A name with a space and a parenthesis; utime 250 and stime 50 ticks.
        let fields = "S 1 1 1 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 4 0 1 1 1";
        std::fs::write(&path, format!("4242 (odd) name) {fields}\n")).expect("write");
        let secs = stat_cpu_secs(&path).expect("parsed");
        assert!((secs - 300.0 / clock_ticks()).abs() < 1e-9, "{secs}");
        std::fs::write(&path, "4242 (short) S 1 2\n").expect("write");
        assert_eq!(stat_cpu_secs(&path), None);
    }

    #[test]
    fn this_process_and_its_named_threads_have_cpu_times() {
        // A named thread spins until it is charged CPU time (a tick), or
        // gives up after a minute of wall time.
        let t = std::thread::Builder::new()
            .name("h16-spin-test".into())
            .spawn(|| {
                let start = Instant::now();
                let mut x = 0u64;
                loop {
                    for _ in 0..100_000 {
                        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
                    }
                    let secs = threads_cpu_secs("h16-spin-test");
                    if secs > 0.0 || start.elapsed() > Duration::from_secs(60) {
                        return (x, secs);
                    }
                }
            })
            .expect("spawn");
        let (_, secs) = t.join().expect("join");
        assert!(secs > 0.0, "{secs}");
        assert!(stat_cpu_secs(std::path::Path::new("/proc/self/stat")).is_some());
        assert_eq!(threads_cpu_secs("no-such-thread"), 0.0);
    }
}
