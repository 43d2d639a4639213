//! `gangway-bench api`: sustained job submissions per second with latency
//! percentiles against a real server on loopback, and the time to list jobs
//! with many stored.

use crate::common::{local_server, percentile};
use anyhow::Result;
use clap::Args;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Options of `gangway-bench api`.
#[derive(Args, Clone)]
pub struct ApiArgs {
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Submissions per client.
    #[arg(long, default_value_t = 250)]
    per_client: usize,
    /// Jobs stored before measuring the listing time.
    #[arg(long, default_value_t = 100_000)]
    stored: usize,
}

const CONFIG: &str =
    "admin_token: bench-admin-token\nagent_token: bench-agent-token\nnode_approval: auto\nqueues:\n  - name: bench\n";

/// Runs the API benchmark.
pub fn run(a: &ApiArgs) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("gangway-bench-api-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let server = local_server(CONFIG, &dir, "bench-agent-token")?;
    let (app_ref, base) = (&server.app, &server.base);
    let lat = Arc::new(Mutex::new(Vec::with_capacity(a.clients * a.per_client)));
    let start = Instant::now();
    let handles: Vec<_> = (0..a.clients)
        .map(|c| {
            let base = base.clone();
            let lat = lat.clone();
            let n = a.per_client;
            std::thread::spawn(move || {
                let agent = ureq::AgentBuilder::new().build();
                let mut mine = Vec::with_capacity(n);
                for i in 0..n {
                    let body = format!(
                        "name: b{c}-{i}\nqueue: bench\nreplicas: 1\nresources:\n  gpus: 1\n"
                    );
                    let t = Instant::now();
                    let ok = agent
                        .post(&format!("{base}/v1/jobs"))
                        .set("Authorization", "Bearer bench-admin-token")
                        .set("Content-Type", "application/yaml")
                        .send_string(&body)
                        .is_ok();
                    if ok {
                        mine.push(t.elapsed().as_secs_f64() * 1e3);
                    }
                }
                if let Ok(mut l) = lat.lock() {
                    l.extend(mine);
                }
            })
        })
        .collect();
    for h in handles {
        let _ = h.join();
    }
    let secs = start.elapsed().as_secs_f64();
    let mut l = lat.lock().map(|l| l.clone()).unwrap_or_default();
    l.sort_by(f64::total_cmp);
    println!(
        "# gangway-bench api: {} clients on loopback, durable (fsync) submissions",
        a.clients
    );
    println!("submissions: {} jobs", l.len());
    println!("submissions_per_sec: {:.1} jobs/s", l.len() as f64 / secs);
    println!("submit_latency_p50: {:.2} ms", percentile(&l, 0.5));
    println!("submit_latency_p99: {:.2} ms", percentile(&l, 0.99));
    // Fill the store up to `stored` jobs (in batches, as group commit would).
    let have = l.len();
    {
        let mut c = app_ref
            .control
            .lock()
            .map_err(|_| anyhow::anyhow!("lock poisoned"))?;
        let mut left = a.stored.saturating_sub(have);
        while left > 0 {
            let k = left.min(1000);
            let batch = (0..k)
                .map(|i| {
                    let mut spec =
                        gangway_core::JobSpec::new(&format!("fill-{left}-{i}"), "bench", 1, 1);
                    spec.user = "admin".into();
                    gangway_server::control::NewJob::new("admin", spec)
                })
                .collect();
            c.submit_batch(batch, 0);
            left -= k;
        }
    }
    let total = a.stored.max(have);
    let get = |path: &str| -> Result<(f64, usize)> {
        let t = Instant::now();
        let mut body = Vec::new();
        std::io::Read::read_to_end(
            &mut ureq::get(&format!("{base}{path}"))
                .set("Authorization", "Bearer bench-admin-token")
                .call()?
                .into_reader(),
            &mut body,
        )?;
        Ok((t.elapsed().as_secs_f64() * 1e3, body.len()))
    };
    let mut pages = Vec::new();
    for _ in 0..9 {
        pages.push(get("/v1/jobs?limit=100")?.0);
    }
    pages.sort_by(f64::total_cmp);
    println!(
        "list_jobs_page_latency_p50: {:.2} ms (100 of {total} jobs)",
        percentile(&pages, 0.5)
    );
    let (ms, bytes) = get("/v1/jobs")?;
    println!(
        "list_jobs_default_page_latency: {ms:.2} ms (the first page of {total} jobs, {} KiB)",
        bytes / 1024
    );
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
