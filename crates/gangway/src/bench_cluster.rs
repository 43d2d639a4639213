//! `gangway bench cluster`: the whole server (this binary's `gangway server`,
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
//! steady state with the same clients listing (a page of 100) and
//! describing jobs, a scraper reading `/metrics`, and the probe. Figures are
//! printed as `metric: value unit`.

use crate::bench::{percentile, philly_gpus, Rng};
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use gangway_core::agent::{GpuHealth, SyncRequest, SyncResponse, TaskReport, TaskState};
use serde_json::{json, Value};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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

/// Options of `bench cluster`.
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
    /// Threads driving the hollow agents.
    #[arg(long, default_value_t = 32)]
    agent_threads: usize,
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
    // Hollow agents on a loaded 2-core machine may sync late: generous
    // heartbeat horizons keep the bench measuring latency, not node loss.
    // Thousands of nodes join with one join token: its request rate is
    // raised (agents also wait and retry on 429, as real ones do).
    format!(
        "admin_token: {ADMIN}\nagent_token: {JOIN}\nnode_approval: auto\n\
         node_not_ready_seconds: 60\nnode_lost_seconds: 300\n\
         limits: {{ requests_per_second: 100000, burst: 100000 }}\n\
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
    let mut cmd = Command::new(std::env::current_exe()?);
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

/// One hollow node.
struct Hollow {
    name: String,
    token: String,
    tasks: HashMap<(u64, u32), Task>,
}

/// When each gang's nodes first reported it running: (nodes seen, last time).
type RunningAt = Arc<Mutex<HashMap<(u64, u32), (u32, u32, Instant)>>>;

/// What the agent threads measure.
#[derive(Default)]
struct AgentStats {
    sync_ms: Vec<f64>,
    sync_errors: usize,
    /// Syncs that started later than a period after the previous one.
    late: usize,
}

fn sleep_secs(run: &gangway_core::RunSpec) -> u64 {
    match run.command.as_slice() {
        [s, n] if s == "sleep" => n.parse().unwrap_or(10),
        _ => 10,
    }
}

fn register(http: &ureq::Agent, base: &str, name: &str, gpus: u32, rack: usize) -> Result<String> {
    let node = json!({
        "name": name,
        "cpu_millis": 128_000,
        "memory_mib": 2_097_152,
        "leaf": format!("rack{rack:04}"),
        "spine": format!("spine{:03}", rack / 16),
        "gpus": (0..gpus).map(|i| json!({"index": i, "model": "H100", "memory_gib": 80})).collect::<Vec<_>>()
    });
    let mut tries = 0;
    let r: Value = loop {
        match http
            .post(&format!("{base}/v1/nodes"))
            .set("Authorization", &format!("Bearer {JOIN}"))
            .send_json(node.clone())
        {
            Err(ureq::Error::Status(429, _)) if tries < 100 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
            r => {
                break r
                    .with_context(|| format!("registering {name}"))?
                    .into_json()?
            }
        }
    };
    r["node_token"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("no node token for {name}: {r}"))
}

/// Syncs one hollow node; returns whether it should sync again at once.
fn sync_one(
    http: &ureq::Agent,
    base: &str,
    n: &mut Hollow,
    gpus: &[GpuHealth],
    running: &RunningAt,
    stats: &mut AgentStats,
) -> bool {
    let now = Instant::now();
    let tasks: Vec<TaskReport> = n
        .tasks
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
    let req = SyncRequest {
        gpus: gpus.to_vec(),
        tasks,
    };
    let t = Instant::now();
    let r = http
        .post(&format!("{base}/v1/agent/{}/sync", n.name))
        .set("Authorization", &format!("Bearer {}", n.token))
        .send_json(&req)
        .map_err(|e| e.to_string())
        .and_then(|r| r.into_json::<SyncResponse>().map_err(|e| e.to_string()));
    let resp = match r {
        Ok(resp) => resp,
        Err(_) => {
            stats.sync_errors += 1;
            return false;
        }
    };
    let done = Instant::now();
    stats.sync_ms.push((done - t).as_secs_f64() * 1e3);
    // The server now knows these ranks run.
    for (k, task) in n.tasks.iter_mut() {
        if !task.reported_running {
            task.reported_running = true;
            if let Ok(mut m) = running.lock() {
                let e = m.entry(*k).or_insert((0, task.nnodes, done));
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
        match n.tasks.get_mut(&k) {
            None if !a.stop => {
                n.tasks.insert(
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
    n.tasks.retain(|k, _| keep.contains(k));
    changed
}

/// Drives `nodes` hollow agents on one thread: registers them, then syncs
/// each at its period (sooner after a change or when a task ends).
#[allow(clippy::too_many_arguments)]
fn agent_thread(
    base: String,
    names: Vec<(String, usize)>,
    gpus: u32,
    period: Duration,
    running: RunningAt,
    registered: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
) -> Result<AgentStats> {
    let http = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(30))
        .build();
    let mut nodes = Vec::with_capacity(names.len());
    for (name, rack) in names {
        let token = register(&http, &base, &name, gpus, rack)?;
        nodes.push(Hollow {
            name,
            token,
            tasks: HashMap::new(),
        });
        registered.fetch_add(1, Ordering::Relaxed);
    }
    let health: Vec<GpuHealth> = (0..gpus)
        .map(|i| GpuHealth {
            index: i,
            healthy: true,
            reason: None,
        })
        .collect();
    let mut stats = AgentStats::default();
    let start = Instant::now();
    let count = nodes.len().max(1) as u32;
    // Spread the first syncs over one period.
    let mut due: BinaryHeap<Reverse<(Instant, usize)>> = (0..nodes.len())
        .map(|i| Reverse((start + period * i as u32 / count, i)))
        .collect();
    let mut last: Vec<Option<Instant>> = vec![None; nodes.len()];
    while !stop.load(Ordering::Relaxed) {
        let Some(Reverse((at, i))) = due.pop() else {
            break;
        };
        let now = Instant::now();
        if at > now {
            std::thread::sleep((at - now).min(Duration::from_millis(20)));
            due.push(Reverse((at, i)));
            continue;
        }
        if let Some(l) = last[i] {
            if now - l > period + period / 2 {
                stats.late += 1;
            }
        }
        last[i] = Some(now);
        let again = sync_one(&http, &base, &mut nodes[i], &health, &running, &mut stats);
        let now = Instant::now();
        let next = if again {
            now
        } else {
            let end = nodes[i]
                .tasks
                .values()
                .map(|t| t.ends)
                .filter(|e| *e > now)
                .min();
            end.map_or(now + period, |e| e.min(now + period))
        };
        due.push(Reverse((next, i)));
    }
    Ok(stats)
}

fn submit(http: &ureq::Agent, base: &str, spec: &Value) -> Result<u64, String> {
    let r = http
        .post(&format!("{base}/v1/jobs"))
        .set("Authorization", &format!("Bearer {ADMIN}"))
        .send_json(spec.clone())
        .map_err(|e| e.to_string())?;
    let v: Value = r.into_json().map_err(|e| e.to_string())?;
    v["id"].as_u64().ok_or_else(|| format!("no id in {v}"))
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

/// Counters and histogram buckets of a `/metrics` text (name{labels} → value).
fn scrape(http: &ureq::Agent, base: &str) -> HashMap<String, f64> {
    let text = http
        .get(&format!("{base}/metrics"))
        .set("Authorization", &format!("Bearer {ADMIN}"))
        .call()
        .ok()
        .and_then(|r| r.into_string().ok())
        .unwrap_or_default();
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
    if a.nodes == 0 || a.gpus_per_node == 0 || a.clients == 0 || a.agent_threads == 0 {
        bail!("--nodes, --gpus-per-node, --clients and --agent-threads must be at least 1");
    }
    if a.min_runtime > a.max_runtime {
        bail!("--min-runtime must not exceed --max-runtime");
    }
    let etcd = match a.store {
        StoreKind::Etcd => Some(
            gangway_store::testing::EtcdProcess::start()
                .context("bench cluster --store etcd needs etcd (apt-get install etcd-server)")?,
        ),
        StoreKind::Redb => None,
    };
    let dir = tempfile::tempdir()?;
    let server = start_server(a, dir.path(), etcd.as_ref().map(|e| e.endpoint.as_str()))?;
    let r = measure(a, &server);
    if r.is_err() {
        eprintln!("server log:\n{}", server.log_tail());
    }
    r
}

fn measure(a: &ClusterArgs, server: &Server) -> Result<()> {
    let base = server.base.clone();
    let period = Duration::from_millis(a.sync_ms.max(1));
    let running: RunningAt = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let registered = Arc::new(AtomicUsize::new(0));
    let threads = a.agent_threads.min(a.nodes);
    let t_reg = Instant::now();
    let agents: Vec<_> = (0..threads)
        .map(|t| {
            let names: Vec<(String, usize)> = (t..a.nodes)
                .step_by(threads)
                .map(|i| (format!("h{i:05}"), i / 32))
                .collect();
            let (base, running, registered, stop) = (
                base.clone(),
                running.clone(),
                registered.clone(),
                stop.clone(),
            );
            let gpus = a.gpus_per_node;
            std::thread::spawn(move || {
                agent_thread(base, names, gpus, period, running, registered, stop)
            })
        })
        .collect();
    while registered.load(Ordering::Relaxed) < a.nodes {
        if agents.iter().any(|h| h.is_finished()) {
            stop.store(true, Ordering::Relaxed);
            for h in agents {
                h.join()
                    .map_err(|_| anyhow::anyhow!("an agent thread panicked"))??;
            }
            bail!("agents stopped before all registered");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let reg_secs = t_reg.elapsed().as_secs_f64();
    eprintln!("registered {} hollow agents in {reg_secs:.1} s", a.nodes);

    // Phase 1: the backlog, as fast as the clients can submit it.
    let http = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(30))
        .build();
    let m0 = scrape(&http, &base);
    let t_sub = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let submitters: Vec<_> = (0..a.clients)
        .map(|c| {
            let (base, next, a) = (base.clone(), next.clone(), a.clone());
            std::thread::spawn(move || {
                let http = ureq::AgentBuilder::new()
                    .timeout(Duration::from_secs(30))
                    .build();
                let mut rng = Rng(a.seed ^ (c as u64).wrapping_mul(0x9E37_79B9));
                let (mut lat, mut errors) = (Vec::new(), 0usize);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= a.pending {
                        break;
                    }
                    let spec = backlog_job(&mut rng, i, &a);
                    let t = Instant::now();
                    match submit(&http, &base, &spec) {
                        Ok(_) => lat.push(ms(t)),
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
    let sub_lat = sorted(sub_lat);
    let m1 = scrape(&http, &base);

    // Phase 2: steady state: readers, a metrics scraper and the probe.
    let t_steady = Instant::now();
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
                        let off = rng.next() % n;
                        get(&http, &format!("{base}/v1/jobs?limit=100&offset={off}"))
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
            let mut v = Vec::new();
            while Instant::now() < until {
                if let Some(t) = get(&http, &format!("{base}/metrics")) {
                    v.push(t);
                }
                std::thread::sleep(Duration::from_millis(1000));
            }
            v
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
        let spec = json!({
            "name": format!("probe{k}"), "queue": "probe", "replicas": replicas,
            "resources": { "gpus": per, "cpu_millis": 1000, "memory_mib": 1024 },
            "run": { "command": ["sleep", "1"] }
        });
        let t = Instant::now();
        let Ok(id) = submit(&http, &base, &spec) else {
            probe_missed += 1;
            continue;
        };
        max_id.fetch_max(id as usize, Ordering::Relaxed);
        let deadline = t + Duration::from_secs(30);
        loop {
            let done = running.lock().ok().and_then(|m| {
                m.iter()
                    .find(|((j, _), (seen, nnodes, _))| *j == id && seen >= nnodes)
                    .map(|(_, (_, _, at))| *at)
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
                    .map(|m| {
                        m.iter()
                            .filter(|((j, _), _)| *j == id)
                            .map(|((_, att), (s, n, _))| format!("attempt {att}: {s}/{n} nodes"))
                            .collect::<Vec<_>>()
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
    let scrapes = sorted(
        scraper
            .join()
            .map_err(|_| anyhow::anyhow!("the scraper panicked"))?,
    );
    let steady_secs = t_steady.elapsed().as_secs_f64();
    let m2 = scrape(&http, &base);
    let rss = server.peak_rss_mib();
    stop.store(true, Ordering::Relaxed);
    let mut stats = AgentStats::default();
    for h in agents {
        let s = h
            .join()
            .map_err(|_| anyhow::anyhow!("an agent thread panicked"))??;
        stats.sync_ms.extend(s.sync_ms);
        stats.sync_errors += s.sync_errors;
        stats.late += s.late;
    }
    let sync = sorted(std::mem::take(&mut stats.sync_ms));
    let (list, describe) = (sorted(list), sorted(describe));

    let store = match a.store {
        StoreKind::Redb => "redb",
        StoreKind::Etcd => "etcd",
    };
    println!(
        "# gangway bench cluster: {} hollow nodes x {} GPUs, {} backlog jobs, {} clients, {store}, agents sync every {} ms",
        a.nodes, a.gpus_per_node, a.pending, a.clients, a.sync_ms
    );
    println!("registration_secs: {reg_secs:.2} s ({} nodes)", a.nodes);
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
        "list_latency_p99: {:.2} ms ({} pages of 100, {read_errors} failed reads)",
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
    println!("agent_sync_p50: {:.2} ms", percentile(&sync, 0.5));
    println!(
        "agent_sync_p99: {:.2} ms ({} syncs, {} failed, {} late by over half a period)",
        percentile(&sync, 0.99),
        sync.len(),
        stats.sync_errors,
        stats.late
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
    // The figures are printed either way; a run that lost work fails.
    if sub_errors > 0 || probe_missed > 0 || probed == 0 {
        bail!(
            "{sub_errors} submissions failed, {probe_missed} probe gangs did not run within 30 s, {probed} ran"
        );
    }
    Ok(())
}
