//! `gangway bench dashboard`: the time the server takes to answer what the
//! dashboard's views read, on a large cluster (10,000 nodes, 100,000 jobs).

use anyhow::{Context, Result};
use clap::Args;
use gangway_store::{Op, RedbStore, Store};
use std::time::Instant;

/// Options of `bench dashboard`.
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
}

// The nodes have no agents here: the node lifecycle must not declare them lost.
const CONFIG: &str = "admin_token: bench-admin-token\nagent_token: bench-agent-token\nnode_approval: auto\nnode_not_ready_seconds: 100000000\nnode_lost_seconds: 100000000\nqueues:\n  - name: research\n  - name: prod\n  - name: vision\n";

fn pct(v: &[f64], p: f64) -> f64 {
    v.get(((v.len().max(1) - 1) as f64 * p).round() as usize)
        .copied()
        .unwrap_or(0.0)
}

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
            c.submit_batch(batch, gangway_server::api::now());
            left -= k;
            n += k;
        }
        c.cycle(gangway_server::api::now())
            .context("scheduling the stored jobs")?;
    }
    let rt = tokio::runtime::Runtime::new()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let base = format!("http://{}", listener.local_addr()?);
    rt.spawn(async move {
        let _ = gangway_server::serve(app, listener).await;
    });
    let views = [
        ("page", "/"),
        ("cluster_grid", "/v1/cluster"),
        ("queues", "/v1/queues"),
        ("queue_history", "/v1/queues/history"),
        ("jobs_newest_500", "/v1/jobs?desc=true&limit=500"),
        ("jobs_pending_500", "/v1/jobs?state=pending&limit=500"),
        ("job_page", "/v1/jobs/1"),
    ];
    let agent = ureq::AgentBuilder::new().build();
    println!(
        "# gangway bench dashboard: {} nodes x 8 GPUs, {} jobs; server time per view over {} requests on loopback",
        a.nodes, a.jobs, a.requests
    );
    for (name, path) in views {
        let mut ms = Vec::with_capacity(a.requests);
        let mut bytes = 0usize;
        for _ in 0..a.requests {
            let t = Instant::now();
            let body = agent
                .get(&format!("{base}{path}"))
                .set("Authorization", "Bearer bench-admin-token")
                .call()
                .with_context(|| format!("GET {path}"))?
                .into_string()?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            bytes = body.len();
        }
        ms.sort_by(f64::total_cmp);
        println!("{name}_p50: {:.1} ms", pct(&ms, 0.5));
        println!("{name}_p99: {:.1} ms", pct(&ms, 0.99));
        println!("{name}_bytes: {bytes} bytes");
    }
    Ok(())
}
