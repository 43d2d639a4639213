//! `gangway-bench chaos`: server replicas on a throwaway etcd, clients
//! submitting all the while, and the leader killed with SIGKILL again and
//! again. Prints failover times and what happened to every submission.

use crate::common::percentile;
use anyhow::{bail, Context, Result};
use clap::Args;
use gangway_store::testing::EtcdProcess;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const ADMIN: &str = "chaos-admin-token";
const JOIN: &str = "chaos-join-token";

/// Options of `gangway-bench chaos`.
#[derive(Args, Clone, Debug)]
pub struct ChaosArgs {
    /// Leader kills.
    #[arg(long, default_value_t = 50)]
    kills: usize,
    /// Server replicas.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// Concurrent submitting clients.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Milliseconds of steady submissions between kills.
    #[arg(long, default_value_t = 1500)]
    between_ms: u64,
}

struct Replica {
    port: u16,
    child: Option<Child>,
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn url(port: u16) -> String {
    format!("http://127.0.0.1:{port}")
}

fn is_leader(port: u16) -> bool {
    ureq::get(&format!("{}/v1/leader", url(port)))
        .timeout(Duration::from_millis(500))
        .call()
        .ok()
        .and_then(|r| r.into_json::<Value>().ok())
        .is_some_and(|v| v["leader"] == true)
}

fn wait_leader(reps: &[Replica], limit: Duration) -> Result<usize> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(i) = reps
            .iter()
            .position(|r| r.child.is_some() && is_leader(r.port))
        {
            return Ok(i);
        }
        if Instant::now() > deadline {
            bail!("no leader elected within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Submits until a replica acknowledges, always with the same idempotency key.
fn submit(urls: &[String], key: &str, start: usize) -> Option<u64> {
    let spec =
        json!({ "name": key, "queue": "default", "replicas": 1, "resources": { "gpus": 1 } });
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut i = start;
    while Instant::now() < deadline {
        let u = &urls[i % urls.len()];
        i += 1;
        match ureq::post(&format!("{u}/v1/jobs"))
            .set("Authorization", &format!("Bearer {ADMIN}"))
            .set("Idempotency-Key", key)
            .timeout(Duration::from_secs(5))
            .send_json(spec.clone())
        {
            Ok(r) => return r.into_json::<Value>().ok()?["id"].as_u64(),
            Err(ureq::Error::Status(code, _)) if code < 500 => return None,
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    None
}

/// Runs the benchmark.
pub fn run(a: &ChaosArgs) -> Result<()> {
    let etcd = EtcdProcess::start()
        .context("gangway-bench chaos needs etcd (apt-get install etcd-server)")?;
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("server.yaml");
    std::fs::write(
        &cfg,
        format!("admin_token: {ADMIN}\nagent_token: {JOIN}\nnode_approval: auto\nqueues:\n  - name: default\n"),
    )?;
    let exe = crate::common::gangway_exe()?;
    let spawn = |port: u16| -> Result<Child> {
        Ok(Command::new(&exe)
            .args(["server", "--config"])
            .arg(&cfg)
            .args(["--etcd", &etcd.endpoint, "--etcd-namespace", "/chaos"])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            // Each replica's own audit log.
            .arg("--data-dir")
            .arg(dir.path().join(format!("replica-{port}")))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?)
    };
    let mut reps = Vec::new();
    for _ in 0..a.replicas.max(2) {
        let port = free_port()?;
        reps.push(Replica {
            port,
            child: Some(spawn(port)?),
        });
    }
    let result = chaos(a, &mut reps, &spawn);
    for r in &mut reps {
        if let Some(mut c) = r.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    result
}

fn chaos(a: &ChaosArgs, reps: &mut [Replica], spawn: &dyn Fn(u16) -> Result<Child>) -> Result<()> {
    wait_leader(reps, Duration::from_secs(30))?;
    let urls: Vec<String> = reps.iter().map(|r| url(r.port)).collect();
    let node = json!({
        "name": "n0", "cpu_millis": 512000, "memory_mib": 4194304, "leaf": "l0",
        "gpus": (0..8).map(|i| json!({"index": i, "model": "H100", "memory_gib": 80})).collect::<Vec<_>>()
    });
    let registered = urls.iter().any(|u| {
        ureq::post(&format!("{u}/v1/nodes"))
            .set("Authorization", &format!("Bearer {JOIN}"))
            .send_json(node.clone())
            .is_ok()
    });
    if !registered {
        bail!("could not register the node");
    }
    let acked: Arc<Mutex<Vec<(String, u64, Instant)>>> = Arc::default();
    let tried: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..a.clients.max(1))
        .map(|t| {
            let (acked, tried, stop, urls) =
                (acked.clone(), tried.clone(), stop.clone(), urls.clone());
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("c{t}-{n}");
                    if let Ok(mut g) = tried.lock() {
                        g.insert(key.clone());
                    }
                    if let Some(id) = submit(&urls, &key, t + n) {
                        if let Ok(mut g) = acked.lock() {
                            g.push((key, id, Instant::now()));
                        }
                    }
                    n += 1;
                }
            })
        })
        .collect();
    let started = Instant::now();
    let mut failovers = Vec::new();
    let mut windows = Vec::new();
    for k in 0..a.kills {
        std::thread::sleep(Duration::from_millis(a.between_ms));
        let leader = wait_leader(reps, Duration::from_secs(30))?;
        if let Some(mut c) = reps[leader].child.take() {
            c.kill()?;
            let _ = c.wait();
        }
        let t0 = Instant::now();
        wait_leader(reps, Duration::from_secs(60))?;
        let t1 = Instant::now();
        failovers.push((t1 - t0).as_secs_f64());
        windows.push((t0, t1));
        reps[leader].child = Some(spawn(reps[leader].port)?);
        eprint!("\rkills: {}/{}", k + 1, a.kills);
    }
    eprintln!();
    std::thread::sleep(Duration::from_millis(a.between_ms));
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.join();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let leader = wait_leader(reps, Duration::from_secs(30))?;
    // Every job: the list is paged, so follow the cursor to the end.
    let mut jobs: Vec<Value> = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!("{}/v1/jobs?limit=5000", url(reps[leader].port));
        if let Some(c) = &cursor {
            path += &format!("&cursor={c}");
        }
        let resp = ureq::get(&path)
            .set("Authorization", &format!("Bearer {ADMIN}"))
            .call()?;
        cursor = resp.header("x-next-cursor").map(str::to_string);
        let page: Vec<Value> = resp.into_json()?;
        jobs.extend(page);
        if cursor.is_none() {
            break;
        }
    }
    let mut by_name: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for j in &jobs {
        by_name
            .entry(j["spec"]["name"].as_str().unwrap_or("").to_string())
            .or_default()
            .push(j["id"].as_u64().unwrap_or(0));
    }
    let acked = acked.lock().map(|g| g.clone()).unwrap_or_default();
    let tried = tried.lock().map(|g| g.clone()).unwrap_or_default();
    let lost = acked
        .iter()
        .filter(|(k, id, _)| by_name.get(k) != Some(&vec![*id]))
        .count();
    let duplicated = by_name.values().filter(|ids| ids.len() > 1).count();
    let unknown = by_name.keys().filter(|k| !tried.contains(*k)).count();
    let mut held = BTreeSet::new();
    let mut double_booked = 0;
    for j in &jobs {
        if matches!(
            j["state"].as_str(),
            Some("scheduled" | "running" | "preempting")
        ) {
            for r in j["placement"].as_array().into_iter().flatten() {
                for g in r["gpus"].as_array().into_iter().flatten() {
                    if !held.insert((r["node"].to_string(), g.as_u64())) {
                        double_booked += 1;
                    }
                }
            }
        }
    }
    let in_failover = acked
        .iter()
        .filter(|(_, _, at)| windows.iter().any(|(a, b)| at >= a && at <= b))
        .count();
    let failover_secs: f64 = failovers.iter().sum();
    let mut sorted = failovers.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "# gangway-bench chaos: {} replicas on etcd, {} clients, {} leader kills (SIGKILL)",
        reps.len(),
        a.clients,
        a.kills
    );
    println!("failover_p50: {:.2} s", percentile(&sorted, 0.5));
    println!(
        "failover_max: {:.2} s",
        sorted.last().copied().unwrap_or(0.0)
    );
    println!("acknowledged: {} jobs", acked.len());
    println!("lost: {lost} jobs");
    println!("duplicated: {duplicated} jobs");
    println!("unknown: {unknown} jobs");
    println!("double_booked: {double_booked} gpus");
    println!(
        "submissions_per_sec: {:.1} jobs/s",
        acked.len() as f64 / elapsed
    );
    println!(
        "submissions_per_sec_during_failover: {:.1} jobs/s",
        if failover_secs > 0.0 {
            in_failover as f64 / failover_secs
        } else {
            0.0
        }
    );
    if lost + duplicated + unknown + double_booked > 0 {
        bail!("chaos found lost, duplicated or double-booked work");
    }
    Ok(())
}
