//! `gangway-bench dashboard`: the time the server takes to answer what the
//! dashboard's views read, on a large cluster (10,000 nodes, 100,000 jobs).

use crate::common::percentile;
use anyhow::{Context, Result};
use clap::Args;
use gangway_store::{Op, RedbStore, Store};
use std::time::Instant;

/// Options of `gangway-bench dashboard`.
#[derive(Args, Clone)]
pub struct DashboardArgs {
    /// Nodes of 8 GPUs (racks of 32).
    #[arg(long, default_value_t = 10_000)]
    nodes: usize,
    /// Jobs stored (a mix of sizes; as many run as fit, the rest wait).
    #[arg(long, default_value_t = 100_000)]
    jobs: usize,
    /// Requests per view.
    #[arg(long, default_value_t = 20)]
    requests: usize,
    /// Hold the state lock (no cycle runs) while timing every view but the
    /// page: what each costs by itself when it reads the published view.
    /// Without reads off the lock this would block.
    #[arg(long)]
    hold_lock: bool,
    /// Requests per view while scheduling cycles run back to back (0: skip):
    /// whether `/metrics`, `/v1/nodes`, `/v1/queues` and `/v1/cluster` wait
    /// for a cycle's hold of the state lock.
    #[arg(long, default_value_t = 40)]
    during_cycles: usize,
}

// The nodes have no agents here: the node lifecycle must not declare them lost.
const CONFIG: &str = "admin_token: bench-admin-token\nagent_token: bench-agent-token\nnode_approval: auto\nnode_not_ready_seconds: 100000000\nnode_lost_seconds: 100000000\nqueues:\n  - name: research\n  - name: prod\n  - name: vision\n";

/// Runs the benchmark.
pub fn run(a: &DashboardArgs) -> Result<()> {
    let dir = tempfile::tempdir()?;
    {
        // Nodes straight into the store, as registrations would leave them.
        let store = RedbStore::open(&dir.path().join("gangway.redb"))?;
        let specs: Vec<_> = (0..a.nodes)
            .map(|i| {
                gangway_core::NodeSpec::uniform(
                    &format!("node-{i:05}"),
                    &format!("rack-{:03}", i / 32),
                    "spine-0",
                    8,
                    "H100",
                    80,
                )
            })
            .collect();
        for chunk in specs.chunks(1000) {
            let ops: Vec<Op> = chunk
                .iter()
                .map(|s| {
                    Op::Put(
                        gangway_server::records::node_key(&s.name),
                        serde_json::to_vec(s).unwrap_or_default(),
                    )
                })
                .collect();
            store.txn(&[], &ops)?;
        }
    }
    let cfg = gangway_server::ServerConfig::from_yaml(CONFIG)?;
    let app = gangway_server::open(cfg, dir.path())?;
    let sizes = [1u32, 1, 1, 2, 4, 8, 8, 16];
    {
        let mut c = app.control.lock().map_err(|_| anyhow::anyhow!("lock"))?;
        let queues = ["research", "prod", "vision"];
        let mut left = a.jobs;
        let mut n = 0usize;
        while left > 0 {
            let k = left.min(1000);
            let batch = (0..k)
                .map(|i| {
                    let g = sizes[(n + i) % sizes.len()];
                    let (replicas, gpus) = if g > 8 { (g / 8, 8) } else { (1, g) };
                    let mut spec = gangway_core::JobSpec::new(
                        &format!("job-{}", n + i),
                        queues[(n + i) % queues.len()],
                        replicas,
                        gpus,
                    );
                    spec.user = ["alice", "bob", "carol"][(n + i) % 3].into();
                    gangway_server::control::NewJob::new(&spec.user.clone(), spec)
                })
                .collect();
            c.submit_batch(batch, gangway_server::clock::now());
            left -= k;
            n += k;
        }
        c.cycle(gangway_server::clock::now())
            .context("scheduling the stored jobs")?;
    }
    let held = metrics_lock_holds(&app, a.requests)?;
    let rebuilds = cluster_view_rebuilds(&app, a.requests)?;
    let publish = view_publications(&app, a.requests)?;
    let nodes_json = nodes_serialization(&app, a.requests)?;
    let rt = tokio::runtime::Runtime::new()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let base = format!("http://{}", listener.local_addr()?);
    let served = app.clone();
    rt.spawn(async move {
        let _ = gangway_server::serve(served, listener).await;
    });
    let views = [
        ("page", "/"),
        ("cluster_grid", "/v1/cluster"),
        ("queues", "/v1/queues"),
        ("queue_history", "/v1/queues/history"),
        ("nodes", "/v1/nodes"),
        ("metrics", "/metrics"),
        ("jobs_newest_500", "/v1/jobs?desc=true&limit=500"),
        ("jobs_pending_500", "/v1/jobs?state=pending&limit=500"),
        ("job_page", "/v1/jobs/1"),
    ];
    let agent = ureq::AgentBuilder::new().build();
    println!(
        "# gangway-bench dashboard: {} nodes x 8 GPUs, {} jobs; server time per view over {} requests on loopback",
        a.nodes, a.jobs, a.requests
    );
    print_nodes_json(&nodes_json, &publish);
    let held_lock = if a.hold_lock {
        Some(app.control.lock().map_err(|_| anyhow::anyhow!("lock"))?)
    } else {
        None
    };
    for (name, path) in views {
        if held_lock.is_some() && path == "/" {
            continue;
        }
        let mut ms = Vec::with_capacity(a.requests);
        let mut bytes = 0usize;
        for _ in 0..a.requests {
            let t = Instant::now();
            let body = read_body(
                agent
                    .get(&format!("{base}{path}"))
                    .set("Authorization", "Bearer bench-admin-token")
                    .call()
                    .with_context(|| format!("GET {path}"))?,
            )?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            bytes = body.len();
        }
        ms.sort_by(f64::total_cmp);
        println!("{name}_p50: {:.1} ms", percentile(&ms, 0.5));
        println!("{name}_p99: {:.1} ms", percentile(&ms, 0.99));
        println!("{name}_bytes: {bytes} bytes");
    }
    if held_lock.is_some() {
        return Ok(());
    }
    print_metrics_figures(&base, a, &held)?;
    println!(
        "cluster_view_rebuild_full_p50: {:.2} ms (under the lock; every row built)",
        percentile(&rebuilds.0, 0.5)
    );
    println!(
        "cluster_view_rebuild_reuse_p50: {:.2} ms (under the lock; every row compared and reused)",
        percentile(&rebuilds.1, 0.5)
    );
    if a.during_cycles > 0 {
        print_during_cycles(&app, &base, a.during_cycles)?;
    }
    Ok(())
}

/// A response's whole body. `/v1/nodes` at 10,000 nodes is over 10 MB,
/// past what ureq's `into_string` reads.
fn read_body(r: ureq::Response) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    std::io::Read::read_to_end(&mut r.into_reader(), &mut body)?;
    Ok(body)
}

/// Each view's latency while a thread runs scheduling cycles back to back
/// (5 ms apart, so changes could get in), and how long those cycles held
/// the state lock: a view that reads under the lock waits for the cycle.
fn print_during_cycles(
    app: &std::sync::Arc<gangway_server::http::common::App>,
    base: &str,
    n: usize,
) -> Result<()> {
    let views = [
        ("metrics", "/metrics"),
        ("nodes", "/v1/nodes"),
        ("queues", "/v1/queues"),
        ("cluster_grid", "/v1/cluster"),
    ];
    // The same cycles with no reader beside them (readers off the lock run
    // beside a cycle and share the CPU with it; readers on it wait).
    let mut alone = Vec::new();
    for _ in 0..8 {
        let t = Instant::now();
        {
            let mut c = app.control.lock().map_err(|_| anyhow::anyhow!("lock"))?;
            c.cycle(gangway_server::clock::now()).context("cycle")?;
        }
        alone.push(t.elapsed().as_secs_f64() * 1e3);
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    alone.sort_by(f64::total_cmp);
    println!(
        "cycle_lock_hold_alone_p50: {:.1} ms ({} cycles, no reader)",
        percentile(&alone, 0.5),
        alone.len()
    );
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (lat, holds) = std::thread::scope(|sc| -> Result<(Vec<Vec<f64>>, Vec<f64>)> {
        let cycler = sc.spawn(|| -> Result<Vec<f64>> {
            let mut holds = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                {
                    let mut c = app.control.lock().map_err(|_| anyhow::anyhow!("lock"))?;
                    c.cycle(gangway_server::clock::now()).context("cycle")?;
                }
                holds.push(t.elapsed().as_secs_f64() * 1e3);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Ok(holds)
        });
        let agent = ureq::AgentBuilder::new().build();
        let mut lat = Vec::new();
        let mut first_err = None;
        for (_, path) in views {
            let mut ms = Vec::with_capacity(n);
            for _ in 0..n {
                let t = Instant::now();
                let r = agent
                    .get(&format!("{base}{path}"))
                    .set("Authorization", "Bearer bench-admin-token")
                    .call()
                    .with_context(|| format!("GET {path}"))
                    .and_then(read_body);
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                    break;
                }
                ms.push(t.elapsed().as_secs_f64() * 1e3);
                // Spread the requests over the cycles.
                std::thread::sleep(std::time::Duration::from_millis(7));
            }
            ms.sort_by(f64::total_cmp);
            lat.push(ms);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let holds = cycler
            .join()
            .map_err(|_| anyhow::anyhow!("the cycler panicked"))??;
        if let Some(e) = first_err {
            return Err(e);
        }
        Ok((lat, holds))
    })?;
    let mut holds = holds;
    holds.sort_by(f64::total_cmp);
    println!(
        "cycle_lock_hold_p50: {:.1} ms ({} cycles while timing the views below)",
        percentile(&holds, 0.5),
        holds.len()
    );
    println!("cycle_lock_hold_max: {:.1} ms", percentile(&holds, 1.0));
    for ((name, _), ms) in views.iter().zip(&lat) {
        println!("{name}_during_cycles_p50: {:.2} ms", percentile(ms, 0.5));
        println!("{name}_during_cycles_p99: {:.2} ms", percentile(ms, 0.99));
    }
    Ok(())
}

/// How long the `/metrics` refresh holds the state lock, in ms over `n`
/// refreshes each: the baseline (labels built per job, set in the gauge
/// family under the lock) and the snapshot (one counting pass under the
/// lock, gauges set after).
struct LockHolds {
    baseline: Vec<f64>,
    snapshot: Vec<f64>,
    publish: Vec<f64>,
}

fn metrics_lock_holds(app: &gangway_server::http::common::App, n: usize) -> Result<LockHolds> {
    let mut h = LockHolds {
        baseline: Vec::new(),
        snapshot: Vec::new(),
        publish: Vec::new(),
    };
    for _ in 0..n.max(1) {
        {
            let c = app.control.lock().map_err(|_| anyhow::anyhow!("lock"))?;
            let t = Instant::now();
            app.metrics.refresh_walking_baseline(&c);
            h.baseline.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let snap = {
            let c = app.control.lock().map_err(|_| anyhow::anyhow!("lock"))?;
            let t = Instant::now();
            let s = gangway_server::metrics::Snapshot::gather(&c);
            h.snapshot.push(t.elapsed().as_secs_f64() * 1e3);
            s
        };
        let t = Instant::now();
        app.metrics.publish(snap);
        h.publish.push(t.elapsed().as_secs_f64() * 1e3);
    }
    for v in [&mut h.baseline, &mut h.snapshot, &mut h.publish] {
        v.sort_by(f64::total_cmp);
    }
    Ok(h)
}

/// How long rebuilding the read view's cluster snapshot holds the state lock,
/// in ms over `n` rebuilds each: from nothing (every node row built), and
/// after a change that left every row as it was (each compared, reused).
fn cluster_view_rebuilds(
    app: &gangway_server::http::common::App,
    n: usize,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (mut full, mut reuse) = (Vec::new(), Vec::new());
    for _ in 0..n.max(1) {
        let mut c = app.control.lock().map_err(|_| anyhow::anyhow!("lock"))?;
        c.view.cluster = Default::default();
        let t = Instant::now();
        c.refresh_cluster_view();
        full.push(t.elapsed().as_secs_f64() * 1e3);
        // A mutable borrow that changes nothing, then an urged rebuild.
        let _ = &mut *c.cluster;
        c.view.cluster.urge();
        let t = Instant::now();
        c.refresh_cluster_view();
        reuse.push(t.elapsed().as_secs_f64() * 1e3);
    }
    full.sort_by(f64::total_cmp);
    reuse.sort_by(f64::total_cmp);
    Ok((full, reuse))
}

/// How long publishing the read view takes (what every release of the
/// state lock pays), in ms over `n` publications.
fn view_publications(app: &gangway_server::http::common::App, n: usize) -> Result<Vec<f64>> {
    let c = app.control.lock().map_err(|_| anyhow::anyhow!("lock"))?;
    let mut out = Vec::with_capacity(n.max(1) * 100);
    for _ in 0..n.max(1) * 100 {
        let t = Instant::now();
        let v = std::hint::black_box(c.read_view());
        out.push(t.elapsed().as_secs_f64() * 1e3);
        drop(v);
    }
    out.sort_by(f64::total_cmp);
    Ok(out)
}

/// `GET /v1/nodes`'s body built two ways from the same read view, in ms
/// over `n` builds each, alternating: through a `serde_json::Value` tree
/// (how the server built it before) and typed (how it does now).
struct NodesJson {
    value: Vec<f64>,
    typed: Vec<f64>,
    bytes: usize,
}

fn nodes_serialization(app: &gangway_server::http::common::App, n: usize) -> Result<NodesJson> {
    let view = app.control.view();
    let mut out = NodesJson {
        value: Vec::new(),
        typed: Vec::new(),
        bytes: 0,
    };
    for _ in 0..n.max(1) {
        let t = Instant::now();
        let before = serde_json::to_vec(&gangway_server::http::node_list::as_value(&view))?;
        out.value.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        let typed = serde_json::to_vec(&gangway_server::http::node_list::NodeList(view.clone()))?;
        out.typed.push(t.elapsed().as_secs_f64() * 1e3);
        if typed != before {
            anyhow::bail!("the typed node list differs from the serde_json::Value one");
        }
        out.bytes = typed.len();
    }
    out.value.sort_by(f64::total_cmp);
    out.typed.sort_by(f64::total_cmp);
    Ok(out)
}

fn print_nodes_json(j: &NodesJson, publish: &[f64]) {
    let (v, t) = (percentile(&j.value, 0.5), percentile(&j.typed, 0.5));
    println!("nodes_json_value_p50: {v:.1} ms (serde_json::Value tree, the baseline)");
    println!("nodes_json_value_p99: {:.1} ms", percentile(&j.value, 0.99));
    println!("nodes_json_typed_p50: {t:.1} ms (the view's rows serialized directly)");
    println!("nodes_json_typed_p99: {:.1} ms", percentile(&j.typed, 0.99));
    println!(
        "nodes_json_speedup_p50: {:.1} x ({} identical bytes)",
        v / t.max(1e-9),
        j.bytes
    );
    println!(
        "view_publish_p50: {:.2} us (building the view: every release of the state lock)",
        percentile(publish, 0.5) * 1e3
    );
    println!(
        "view_publish_p99: {:.2} us",
        percentile(publish, 0.99) * 1e3
    );
}

/// The `/metrics` figures: the refresh's lock hold before and after, a
/// scrape's latency, and submissions' latency with and without a scraper
/// hammering `/metrics` beside them (a scrape must not block them).
fn print_metrics_figures(base: &str, a: &DashboardArgs, h: &LockHolds) -> Result<()> {
    println!(
        "metrics_refresh_lock_hold_baseline_p50: {:.2} ms",
        percentile(&h.baseline, 0.5)
    );
    println!(
        "metrics_refresh_lock_hold_baseline_p99: {:.2} ms",
        percentile(&h.baseline, 0.99)
    );
    println!(
        "metrics_refresh_lock_hold_snapshot_p50: {:.2} ms",
        percentile(&h.snapshot, 0.5)
    );
    println!(
        "metrics_refresh_lock_hold_snapshot_p99: {:.2} ms",
        percentile(&h.snapshot, 0.99)
    );
    println!(
        "metrics_refresh_lock_hold_ratio_p50: {:.1} x",
        percentile(&h.baseline, 0.5) / percentile(&h.snapshot, 0.5).max(1e-6)
    );
    println!(
        "metrics_publish_off_lock_p50: {:.2} ms",
        percentile(&h.publish, 0.5)
    );
    let agent = ureq::AgentBuilder::new().build();
    let scrape = |agent: &ureq::Agent| -> Result<f64> {
        let t = Instant::now();
        agent
            .get(&format!("{base}/metrics"))
            .set("Authorization", "Bearer bench-admin-token")
            .call()
            .context("GET /metrics")?
            .into_string()?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    let mut ms = (0..a.requests.max(100))
        .map(|_| scrape(&agent))
        .collect::<Result<Vec<_>>>()?;
    ms.sort_by(f64::total_cmp);
    println!("metrics_scrape_p50: {:.2} ms", percentile(&ms, 0.5));
    println!("metrics_scrape_p99: {:.2} ms", percentile(&ms, 0.99));
    let submits = |n: usize| -> Result<Vec<f64>> {
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let spec = serde_json::json!({
                "name": format!("m{i}"), "queue": "research", "replicas": 1,
                "resources": { "gpus": 1, "cpu_millis": 1000, "memory_mib": 1024 },
                "run": { "command": ["true"] }
            });
            let t = Instant::now();
            agent
                .post(&format!("{base}/v1/jobs"))
                .set("Authorization", "Bearer bench-admin-token")
                .send_json(spec)
                .context("POST /v1/jobs")?;
            out.push(t.elapsed().as_secs_f64() * 1e3);
        }
        out.sort_by(f64::total_cmp);
        Ok(out)
    };
    let n = a.requests.max(200);
    let alone = submits(n)?;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (during, scrapes) = std::thread::scope(|sc| -> Result<(Vec<f64>, usize)> {
        let scraper = sc.spawn(|| {
            let agent = ureq::AgentBuilder::new().build();
            let mut k = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if scrape(&agent).is_ok() {
                    k += 1;
                }
            }
            k
        });
        let during = submits(n);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let k = scraper
            .join()
            .map_err(|_| anyhow::anyhow!("scraper panicked"))?;
        Ok((during?, k))
    })?;
    println!("submit_alone_p50: {:.2} ms", percentile(&alone, 0.5));
    println!("submit_alone_p99: {:.2} ms", percentile(&alone, 0.99));
    println!(
        "submit_while_scraping_p50: {:.2} ms",
        percentile(&during, 0.5)
    );
    println!(
        "submit_while_scraping_p99: {:.2} ms",
        percentile(&during, 0.99)
    );
    println!("scrapes_during_submissions: {scrapes} scrapes");
    Ok(())
}
