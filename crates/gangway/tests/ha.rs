//! Several server replicas on one etcd: the leader is killed with SIGKILL
//! while clients keep submitting; no acknowledged job is lost, none is
//! duplicated, and no GPU is double-booked.

use gangway_store::testing::EtcdProcess;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gangway");
const ADMIN: &str = "admin-secret";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port")
}

struct Replica {
    port: u16,
    child: Option<Child>,
}

impl Replica {
    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

struct Replicas {
    dir: tempfile::TempDir,
    etcd: String,
    all: Vec<Replica>,
}

impl Drop for Replicas {
    fn drop(&mut self) {
        for r in &mut self.all {
            if let Some(mut c) = r.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

impl Replicas {
    fn start(&mut self, i: usize) {
        let cfg = self.dir.path().join("server.yaml");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("replica-{i}.log")))
            .expect("log");
        let r = &mut self.all[i];
        let child = Command::new(BIN)
            .args(["server", "--config"])
            .arg(&cfg)
            .args(["--etcd", &self.etcd, "--etcd-namespace", "/ha-test"])
            .args(["--listen", &format!("127.0.0.1:{}", r.port)])
            // Each replica's own audit log.
            .arg("--data-dir")
            .arg(self.dir.path().join(format!("replica-{i}")))
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn replica");
        r.child = Some(child);
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.all[i].child.take() {
            c.kill().expect("SIGKILL");
            let _ = c.wait();
        }
    }

    fn live(&self) -> Vec<String> {
        self.all
            .iter()
            .filter(|r| r.child.is_some())
            .map(Replica::url)
            .collect()
    }

    /// The index of the replica that says it leads.
    fn leader(&self) -> Option<usize> {
        self.all.iter().position(|r| {
            r.child.is_some()
                && ureq::get(&format!("{}/v1/leader", r.url()))
                    .timeout(Duration::from_millis(500))
                    .call()
                    .ok()
                    .and_then(|x| x.into_json::<Value>().ok())
                    .is_some_and(|v| v["leader"] == true)
        })
    }

    fn dump(&self) {
        for i in 0..self.all.len() {
            let p = self.dir.path().join(format!("replica-{i}.log"));
            eprintln!(
                "==== replica {i}\n{}",
                std::fs::read_to_string(p).unwrap_or_default()
            );
        }
    }
}

/// Submits `key` until some replica acknowledges it (the same idempotency
/// key every time); `None` if no replica did within the deadline.
fn submit(replicas: &[String], key: &str, start: usize) -> Option<u64> {
    let spec =
        json!({ "name": key, "queue": "default", "replicas": 1, "resources": { "gpus": 1 } });
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut i = start;
    while Instant::now() < deadline {
        let url = &replicas[i % replicas.len()];
        i += 1;
        let r = ureq::post(&format!("{url}/v1/jobs"))
            .set("Authorization", &format!("Bearer {ADMIN}"))
            .set("Idempotency-Key", key)
            .timeout(Duration::from_secs(5))
            .send_json(spec.clone());
        match r {
            Ok(resp) => return resp.into_json::<Value>().ok()?["id"].as_u64(),
            Err(ureq::Error::Status(code, resp)) if code < 500 => {
                panic!("{key}: {code} {}", resp.into_string().unwrap_or_default())
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    None
}

fn replicas(etcd: &EtcdProcess, n: usize) -> Replicas {
    replicas_with(etcd, n, "")
}

/// `n` replicas whose config also says `extra` (top-level YAML lines).
fn replicas_with(etcd: &EtcdProcess, n: usize, extra: &str) -> Replicas {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(
        dir.path().join("server.yaml"),
        format!("admin_token: {ADMIN}\nagent_token: agent-secret\nnode_approval: auto\n{extra}queues:\n  - name: default\n"),
    )
    .expect("config");
    let mut reps = Replicas {
        dir,
        etcd: etcd.endpoint.clone(),
        all: (0..n)
            .map(|_| Replica {
                port: free_port(),
                child: None,
            })
            .collect(),
    };
    for i in 0..n {
        reps.start(i);
    }
    reps
}

/// Every job the server lists: the list is paged (500 by default), so
/// follow the cursor to the end.
fn all_jobs(url: &str) -> Vec<Value> {
    let mut jobs = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!("{url}/v1/jobs?limit=5000");
        if let Some(c) = &cursor {
            path += &format!("&cursor={c}");
        }
        let resp = ureq::get(&path)
            .set("Authorization", &format!("Bearer {ADMIN}"))
            .call()
            .expect("list");
        cursor = resp.header("x-next-cursor").map(str::to_string);
        let page: Vec<Value> = resp.into_json().expect("json");
        jobs.extend(page);
        if cursor.is_none() {
            return jobs;
        }
    }
}

fn wait_leader(reps: &Replicas) -> usize {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(l) = reps.leader() {
            return l;
        }
        if Instant::now() > deadline {
            reps.dump();
            panic!("no leader elected");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A node with 8 GPUs, registered through any replica (a follower forwards to the leader).
fn register_node(reps: &Replicas) {
    let node = json!({
        "name": "n0", "cpu_millis": 64000, "memory_mib": 262144, "leaf": "l0",
        "gpus": (0..8).map(|i| json!({"index": i, "model": "H100", "memory_gib": 80})).collect::<Vec<_>>()
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while !reps.live().iter().any(|u| {
        ureq::post(&format!("{u}/v1/nodes"))
            .set("Authorization", "Bearer agent-secret")
            .send_json(node.clone())
            .is_ok()
    }) {
        assert!(Instant::now() < deadline, "node registered");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn replicas_carry_on_after_etcd_restarts() {
    let Some(mut etcd) = EtcdProcess::start() else {
        return;
    };
    let reps = replicas(&etcd, 2);
    wait_leader(&reps);
    register_node(&reps);
    let urls = reps.live();
    let first = submit(&urls, "before", 0).expect("acknowledged before the restart");
    etcd.restart();
    // No operator action: the replicas reconnect, elect, and accept work.
    let second = submit(&urls, "after", 1).expect("acknowledged after the restart");
    assert!(second > first);
    let leader = wait_leader(&reps);
    let jobs: Vec<Value> = ureq::get(&format!("{}/v1/jobs", reps.all[leader].url()))
        .set("Authorization", &format!("Bearer {ADMIN}"))
        .call()
        .expect("list")
        .into_json()
        .expect("json");
    let names: Vec<&str> = jobs
        .iter()
        .filter_map(|j| j["spec"]["name"].as_str())
        .collect();
    assert_eq!(names, vec!["before", "after"]);
}

#[test]
fn leader_kill_9_under_submissions_loses_and_duplicates_nothing() {
    let Some(etcd) = EtcdProcess::start() else {
        return;
    };
    let mut reps = replicas(&etcd, 3);
    wait_leader(&reps);
    register_node(&reps);

    let acked: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
    let tried: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let urls: Vec<String> = reps.all.iter().map(Replica::url).collect();
    let clients: Vec<_> = (0..4)
        .map(|t| {
            let (acked, tried, stop, urls) =
                (acked.clone(), tried.clone(), stop.clone(), urls.clone());
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("c{t}-{n}");
                    tried.lock().expect("lock").insert(key.clone());
                    if let Some(id) = submit(&urls, &key, t + n) {
                        acked.lock().expect("lock").insert(key, id);
                    }
                    n += 1;
                }
            })
        })
        .collect();

    let mut failovers = Vec::new();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(1500));
        let leader = wait_leader(&reps);
        let before = acked.lock().expect("lock").len();
        reps.kill(leader);
        let t0 = Instant::now();
        let new = wait_leader(&reps);
        failovers.push(t0.elapsed().as_secs_f64());
        assert_ne!(new, leader);
        reps.start(leader);
        // Submissions flow again after the failover.
        let deadline = Instant::now() + Duration::from_secs(20);
        while acked.lock().expect("lock").len() <= before + 5 {
            assert!(
                Instant::now() < deadline,
                "no submissions acknowledged after failover"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().expect("client");
    }
    eprintln!("failover seconds: {failovers:?}");

    let leader = wait_leader(&reps);
    let jobs = all_jobs(&reps.all[leader].url());
    let mut by_name: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for j in &jobs {
        by_name
            .entry(j["spec"]["name"].as_str().unwrap_or("").to_string())
            .or_default()
            .push(j["id"].as_u64().expect("id"));
    }
    let acked = acked.lock().expect("lock").clone();
    assert!(
        acked.len() > 50,
        "clients kept submitting ({} acknowledged)",
        acked.len()
    );
    for (key, id) in &acked {
        assert_eq!(
            by_name.get(key),
            Some(&vec![*id]),
            "acknowledged {key} is job {id}, exactly once"
        );
    }
    let tried = tried.lock().expect("lock").clone();
    for (name, ids) in &by_name {
        assert!(tried.contains(name), "a job nobody submitted: {name}");
        assert_eq!(ids.len(), 1, "{name} stored {} times", ids.len());
    }
    // No GPU is held by two live jobs.
    let mut held = BTreeSet::new();
    for j in &jobs {
        if matches!(
            j["state"].as_str(),
            Some("scheduled" | "running" | "preempting")
        ) {
            for r in j["placement"].as_array().into_iter().flatten() {
                for g in r["gpus"].as_array().into_iter().flatten() {
                    let slot = (r["node"].to_string(), g.as_u64());
                    assert!(held.insert(slot.clone()), "GPU {slot:?} double-booked");
                }
            }
        }
    }
    assert_eq!(held.len(), 8, "the node's 8 GPUs are in use by 8 jobs");
}

#[test]
fn a_frozen_leader_wakes_up_deposed_and_steps_down_without_writing() {
    let Some(etcd) = EtcdProcess::start() else {
        return;
    };
    let mut reps = replicas(&etcd, 2);
    let old = wait_leader(&reps);
    register_node(&reps);
    let urls = reps.live();
    for n in 0..4 {
        submit(&urls, &format!("early-{n}"), n).expect("acknowledged");
    }
    let pid = reps.all[old]
        .child
        .as_ref()
        .expect("running")
        .id()
        .to_string();
    // Freeze the leader past its lease (a long GC pause, a hung VM).
    Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .expect("SIGSTOP");
    let deadline = Instant::now() + Duration::from_secs(20);
    let new = loop {
        let other = 1 - old;
        let says = ureq::get(&format!("{}/v1/leader", reps.all[other].url()))
            .timeout(Duration::from_millis(500))
            .call()
            .ok()
            .and_then(|x| x.into_json::<Value>().ok());
        if says.is_some_and(|v| v["leader"] == true) {
            break other;
        }
        assert!(
            Instant::now() < deadline,
            "no new leader while the old one is frozen"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let new_url = reps.all[new].url();
    for n in 0..6 {
        submit(std::slice::from_ref(&new_url), &format!("late-{n}"), 0).expect("acknowledged");
    }
    Command::new("kill")
        .args(["-CONT", &pid])
        .status()
        .expect("SIGCONT");
    // It notices it lost the lease and follows; it never claims to lead beside the new one.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let v: Value = ureq::get(&format!("{}/v1/leader", reps.all[old].url()))
            .call()
            .expect("answers")
            .into_json()
            .expect("json");
        if v["leader"] == false {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the deposed leader did not step down"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(reps.leader(), Some(new));
    let jobs: Vec<Value> = ureq::get(&format!("{new_url}/v1/jobs"))
        .set("Authorization", &format!("Bearer {ADMIN}"))
        .call()
        .expect("list")
        .into_json()
        .expect("json");
    assert_eq!(jobs.len(), 10, "every acknowledged job once");
    let mut held = BTreeSet::new();
    for j in &jobs {
        for r in j["placement"].as_array().into_iter().flatten() {
            for g in r["gpus"].as_array().into_iter().flatten() {
                assert!(
                    held.insert((r["node"].to_string(), g.as_u64())),
                    "double-booked"
                );
            }
        }
        let scheduled = j["events"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["kind"] == "scheduled")
            .count();
        assert!(scheduled <= 1, "job {} scheduled twice", j["id"]);
    }
    // Through the old replica, requests now reach the new leader.
    let id = submit(std::slice::from_ref(&reps.all[old].url()), "via-old", 0).expect("forwarded");
    assert_eq!(id, 11);
    reps.kill(old);
}

/// Answer of an admin call to `url`, error statuses included.
fn call(url: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let r = ureq::request(
        if body.is_some() { "POST" } else { "GET" },
        &format!("{url}{path}"),
    )
    .set("Authorization", &format!("Bearer {ADMIN}"))
    .timeout(Duration::from_secs(10));
    let r = match body {
        Some(b) => r.send_json(b),
        None => r.call(),
    };
    match r {
        Ok(x) => (x.status(), x.into_json().unwrap_or(Value::Null)),
        Err(ureq::Error::Status(s, x)) => (s, x.into_json().unwrap_or(Value::Null)),
        Err(e) => (0, json!(e.to_string())),
    }
}

#[test]
fn a_new_leader_schedules_with_the_policy_version_in_force() {
    let Some(etcd) = EtcdProcess::start() else {
        return;
    };
    let mut reps = replicas(&etcd, 2);
    let leader = wait_leader(&reps);
    register_node(&reps);
    let url = reps.all[leader].url();
    // Version 2 caps the default queue at 2 GPUs (the file says unlimited).
    let (_, v1) = call(&url, "/v1/policy", None);
    let mut p = v1["policy"].clone();
    p["queues"][0]["quota"] = json!({ "nominal": { "gpus": 2 }, "borrowing_limit": { "gpus": 0 } });
    let (code, v2) = call(
        &url,
        "/v1/policy/apply",
        Some(json!({ "policy": p.to_string(), "reason": "cap default at 2 GPUs" })),
    );
    assert_eq!(code, 201, "{v2}");
    // The leader dies; the follower that takes over reads version 2 from etcd.
    reps.kill(leader);
    let next = wait_leader(&reps);
    assert_ne!(next, leader);
    let url = reps.all[next].url();
    let (_, cur) = call(&url, "/v1/policy", None);
    assert_eq!(cur["version"], 2, "{cur}");
    let job =
        || json!({ "name": "j", "queue": "default", "replicas": 1, "resources": { "gpus": 2 } });
    let (code, a) = call(&url, "/v1/jobs", Some(job()));
    assert_eq!(code, 201, "{a}");
    let (_, b) = call(&url, "/v1/jobs", Some(job()));
    let b = b["id"].as_u64().expect("id");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, j) = call(&url, &format!("/v1/jobs/{b}"), None);
        if j["reason"]
            .as_str()
            .is_some_and(|r| r.contains("queue default is at its limit 2/2 GPUs"))
        {
            break;
        }
        if Instant::now() > deadline {
            reps.dump();
            panic!("job {b} should wait on the cap of version 2: {j:#}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_new_leader_runs_the_job_contract_the_config_sets() {
    let Some(etcd) = EtcdProcess::start() else {
        return;
    };
    let mut reps = replicas_with(&etcd, 2, "master_ports: { first: 41000, last: 41009 }\n");
    let leader = wait_leader(&reps);
    reps.kill(leader);
    let next = wait_leader(&reps);
    assert_ne!(next, leader);
    let url = reps.all[next].url();
    let node = json!({
        "name": "n0", "cpu_millis": 64000, "memory_mib": 262144, "leaf": "l0",
        "gpus": (0..8).map(|i| json!({"index": i, "model": "H100", "memory_gib": 80})).collect::<Vec<_>>()
    });
    let reg: Value = ureq::post(&format!("{url}/v1/nodes"))
        .set("Authorization", "Bearer agent-secret")
        .send_json(node)
        .expect("register")
        .into_json()
        .expect("json");
    let token = reg["node_token"].as_str().expect("node token").to_string();
    let (code, job) = call(
        &url,
        "/v1/jobs",
        Some(json!({ "name": "j", "queue": "default", "replicas": 1, "resources": { "gpus": 1 } })),
    );
    assert_eq!(code, 201, "{job}");
    // The node is told to run the rank, with a rendezvous port from the
    // config's range (not the built-in default), by the leader that took over.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let a: Value = ureq::post(&format!("{url}/v1/agent/n0/sync"))
            .set("Authorization", &format!("Bearer {token}"))
            .send_json(json!({ "tasks": [] }))
            .expect("sync")
            .into_json()
            .expect("json");
        if let Some(port) = a["assignments"][0]["master_port"].as_u64() {
            assert!((41000..=41009).contains(&port), "{a:#}");
            break;
        }
        if Instant::now() > deadline {
            reps.dump();
            panic!("no assignment from the new leader: {a:#}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
