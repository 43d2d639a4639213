//! The `gangway` binary end to end: a real server process on loopback, driven
//! through the CLI, and killed with SIGKILL while jobs are being submitted.

use std::io::Write;
use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gangway");

const CONFIG: &str = r#"
admin_token: admin-secret
agent_token: agent-secret
node_approval: auto
users:
  - { name: alice, token: alice-token, queues: [research] }
queues:
  - name: research
    quota: { nominal: { gpus: 64 } }
"#;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

struct Srv {
    child: Child,
    addr: String,
}

impl Drop for Srv {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &std::path::Path, port: u16) -> Srv {
    let cfg = dir.join("server.yaml");
    std::fs::write(&cfg, CONFIG).expect("config");
    let child = Command::new(BIN)
        .args(["server", "--config"])
        .arg(&cfg)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn server");
    let addr = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while ureq::get(&format!("{addr}/healthz")).call().is_err() {
        assert!(Instant::now() < deadline, "server did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    Srv { child, addr }
}

fn cli(addr: &str, token: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("GANGWAY_ADDR", addr)
        .env("GANGWAY_TOKEN", token)
        .output()
        .expect("run cli")
}

fn register(addr: &str, name: &str, gpus: u32) {
    let spec = gangway_core_node(name, gpus);
    ureq::post(&format!("{addr}/v1/nodes"))
        .set("Authorization", "Bearer agent-secret")
        .set("Content-Type", "application/json")
        .send_string(&spec)
        .expect("register node");
}

fn gangway_core_node(name: &str, gpus: u32) -> String {
    let g: Vec<String> = (0..gpus)
        .map(|i| format!("{{\"index\":{i},\"model\":\"H100\",\"memory_gib\":80}}"))
        .collect();
    format!(
        "{{\"name\":\"{name}\",\"gpus\":[{}],\"cpu_millis\":128000,\"memory_mib\":1048576,\"leaf\":\"leaf0\",\"spine\":\"s0\"}}",
        g.join(",")
    )
}

#[test]
fn cli_submits_lists_explains_and_cancels() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path(), free_port());
    register(&s.addr, "node-a", 8);
    let spec = dir.path().join("job.yaml");
    let mut f = std::fs::File::create(&spec).expect("job file");
    writeln!(
        f,
        "name: big\nqueue: research\nreplicas: 2\nresources:\n  gpus: 8"
    )
    .expect("write");
    let out = cli(
        &s.addr,
        "alice-token",
        &["submit", spec.to_str().expect("path")],
    );
    // 16 GPUs in a cluster of 8: rejected with the reason, nothing stored.
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("422") && err.contains("the cluster has only 8 matching GPUs"),
        "{err}"
    );
    std::fs::write(
        &spec,
        "name: small\nqueue: research\nreplicas: 1\nresources:\n  gpus: 8\n",
    )
    .expect("write");
    let out = cli(
        &s.addr,
        "alice-token",
        &["submit", spec.to_str().expect("path")],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "job 1 submitted"
    );
    let out = cli(
        &s.addr,
        "alice-token",
        &["submit", spec.to_str().expect("path")],
    );
    assert!(out.status.success());
    // Wait until job 2 has a reason.
    let deadline = Instant::now() + Duration::from_secs(10);
    let why = loop {
        let out = cli(&s.addr, "alice-token", &["why", "2"]);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if text.contains(':') {
            break text;
        }
        assert!(Instant::now() < deadline, "no reason for job 2");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(why.contains("job 2 (pending)"), "{why}");
    let out = cli(&s.addr, "alice-token", &["queue", "--output", "json"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(list.as_array().expect("array").len(), 2);
    let table =
        String::from_utf8_lossy(&cli(&s.addr, "alice-token", &["queue"]).stdout).to_string();
    assert!(table.lines().next().expect("header").starts_with("ID"));
    assert!(table.contains("scheduled"));
    let out = cli(&s.addr, "alice-token", &["cancel", "2"]);
    assert!(out.status.success());
    let desc = String::from_utf8_lossy(&cli(&s.addr, "alice-token", &["describe", "2"]).stdout)
        .to_string();
    assert!(
        desc.contains("state cancelled") && desc.contains("cancelled by alice"),
        "{desc}"
    );
    let nodes =
        String::from_utf8_lossy(&cli(&s.addr, "alice-token", &["nodes"]).stdout).to_string();
    assert!(
        nodes.contains("node-a") && nodes.contains("Ready"),
        "{nodes}"
    );
    let out = cli(&s.addr, "wrong", &["queue"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));
    // Address and token from a config file when neither flag nor env gives them.
    let conf = dir.path().join("cli.yaml");
    std::fs::write(&conf, format!("addr: {}\ntoken: alice-token\n", s.addr)).expect("cli config");
    let out = Command::new(BIN)
        .args(["queues", "--cli-config"])
        .arg(&conf)
        .env_remove("GANGWAY_ADDR")
        .env_remove("GANGWAY_TOKEN")
        .output()
        .expect("cli");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && text.contains("research"),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn killed_server_loses_no_acknowledged_job_and_duplicates_none() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let mut acked: Vec<(u64, String)> = Vec::new();
    let mut n = 0;
    for round in 0..5 {
        let s = start(dir.path(), port);
        if round == 0 {
            register(&s.addr, "node-a", 8);
            register(&s.addr, "node-b", 8);
        }
        // A client submits as fast as it can while the server is SIGKILLed at a
        // varying moment, most likely in the middle of a request.
        let addr = s.addr.clone();
        let start_n = n;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let submitter = std::thread::spawn(move || {
            let mut acked = Vec::new();
            let mut k = start_n;
            while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                let name = format!("crash-{k}");
                k += 1;
                let body =
                    format!("name: {name}\nqueue: research\nreplicas: 1\nresources:\n  gpus: 1\n");
                match ureq::post(&format!("{addr}/v1/jobs"))
                    .set("Authorization", "Bearer alice-token")
                    .set("Content-Type", "application/yaml")
                    .send_string(&body)
                {
                    Ok(r) => {
                        let v: serde_json::Value = r.into_json().expect("json");
                        acked.push((v["id"].as_u64().expect("id"), name));
                    }
                    Err(_) => break, // the server is gone
                }
            }
            (acked, k)
        });
        std::thread::sleep(Duration::from_millis(40 + 37 * round as u64));
        let mut s = s;
        let _ = s.child.kill(); // SIGKILL, wherever it is
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (mine, next) = submitter.join().expect("submitter");
        assert!(!mine.is_empty(), "round {round} acknowledged nothing");
        acked.extend(mine);
        n = next;
        drop(s);
    }
    let s = start(dir.path(), port);
    let fetch = || -> Vec<serde_json::Value> {
        let list: serde_json::Value = ureq::get(&format!("{}/v1/jobs", s.addr))
            .set("Authorization", "Bearer admin-secret")
            .call()
            .expect("list")
            .into_json()
            .expect("json");
        list.as_array().expect("array").clone()
    };
    let booked = |jobs: &[serde_json::Value]| {
        // No GPU double-booked across restarts.
        let mut seen = std::collections::BTreeSet::new();
        for j in jobs {
            for r in j["placement"].as_array().into_iter().flatten() {
                for g in r["gpus"].as_array().into_iter().flatten() {
                    assert!(
                        seen.insert((r["node"].to_string(), g.as_u64())),
                        "GPU booked twice: {r}"
                    );
                }
            }
        }
        seen.len()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let jobs = loop {
        let jobs = fetch();
        if booked(&jobs) == 16 {
            break jobs;
        }
        assert!(Instant::now() < deadline, "both nodes should fill up");
        std::thread::sleep(Duration::from_millis(50));
    };
    for (id, name) in &acked {
        let matches: Vec<_> = jobs
            .iter()
            .filter(|j| j["spec"]["name"] == name.as_str())
            .collect();
        assert_eq!(
            matches.len(),
            1,
            "acknowledged {name} must exist exactly once"
        );
        assert_eq!(matches[0]["id"].as_u64(), Some(*id));
    }
    let mut ids: Vec<u64> = jobs.iter().map(|j| j["id"].as_u64().expect("id")).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), jobs.len(), "no id used twice");
    let mut names: Vec<&str> = jobs
        .iter()
        .filter_map(|j| j["spec"]["name"].as_str())
        .collect();
    names.sort_unstable();
    let all = names.len();
    names.dedup();
    assert_eq!(names.len(), all, "no submission stored twice");
}

fn stdout(o: &Output) -> String {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).to_string()
}

fn ids_of(json: &str) -> Vec<u64> {
    let v: serde_json::Value = serde_json::from_str(json).expect("json");
    v.as_array()
        .expect("array")
        .iter()
        .map(|j| j["id"].as_u64().expect("id"))
        .collect()
}

#[test]
fn queue_shows_active_jobs_pages_through_all_and_describe_groups_ranks() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path(), free_port());
    register(&s.addr, "node-a", 8);
    register(&s.addr, "node-b", 8);
    let spec = dir.path().join("job.yaml");
    // A 16-rank gang of 1 GPU each: two nodes, 8 ranks on each.
    std::fs::write(
        &spec,
        "name: gang\nqueue: research\nreplicas: 16\nresources:\n  gpus: 1\n",
    )
    .expect("write");
    let p = spec.to_str().expect("path");
    for _ in 0..4 {
        stdout(&cli(&s.addr, "alice-token", &["submit", p]));
    }
    stdout(&cli(&s.addr, "alice-token", &["cancel", "4"]));
    let deadline = Instant::now() + Duration::from_secs(10);
    let desc = loop {
        let d = stdout(&cli(&s.addr, "alice-token", &["describe", "1"]));
        if d.contains("placement:") || Instant::now() > deadline {
            break d;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // One line per node, not per rank; times as ISO-8601 with "ago".
    assert!(desc.contains("node-a: ranks 0-7 GPUs 0-7"), "{desc}");
    assert!(desc.contains("node-b: ranks 8-15 GPUs 0-7"), "{desc}");
    assert!(!desc.contains("rank group on"), "{desc}");
    assert!(
        desc.contains("submitted 20") && (desc.contains("ago)") || desc.contains("(just now)")),
        "{desc}"
    );
    let epoch = format!(
        "{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("now")
            .as_secs()
            / 100_000
    );
    assert!(!desc.contains(&epoch), "raw epoch seconds in {desc}");
    // Default: the jobs that have not ended (4 was cancelled).
    assert_eq!(
        ids_of(&stdout(&cli(
            &s.addr,
            "alice-token",
            &["queue", "-o", "json"]
        ))),
        vec![1, 2, 3]
    );
    // --all, one job per page: every job, streamed across pages.
    assert_eq!(
        ids_of(&stdout(&cli(
            &s.addr,
            "alice-token",
            &["queue", "--all", "--page-size", "1", "-o", "json"]
        ))),
        vec![1, 2, 3, 4]
    );
    let all = stdout(&cli(
        &s.addr,
        "alice-token",
        &["queue", "--all", "--page-size", "1"],
    ));
    assert_eq!(
        all.lines().filter(|l| l.starts_with("ID")).count(),
        1,
        "{all}"
    );
    assert_eq!(all.lines().count(), 5, "{all}");
    // A comma list of states.
    assert_eq!(
        ids_of(&stdout(&cli(
            &s.addr,
            "alice-token",
            &["queue", "--state", "scheduled,cancelled", "-o", "json"]
        ))),
        vec![1, 4]
    );
    // --me is the token's user; another user's name matches nothing here.
    assert_eq!(
        ids_of(&stdout(&cli(
            &s.addr,
            "alice-token",
            &["queue", "--me", "-o", "json"]
        ))),
        vec![1, 2, 3]
    );
    assert_eq!(
        ids_of(&stdout(&cli(
            &s.addr,
            "admin-secret",
            &["queue", "--me", "-o", "json"]
        ))),
        Vec::<u64>::new()
    );
    // The wide table has ISO times, the narrow one relative ages.
    let wide = stdout(&cli(&s.addr, "alice-token", &["queue", "-o", "wide"]));
    assert!(
        wide.contains("SUBMITTED") && wide.contains("T") && wide.contains("Z "),
        "{wide}"
    );
    assert!(wide.contains("node-a,node-b"), "{wide}");
    // Nodes say when they were last heard from, in words.
    let nodes = stdout(&cli(&s.addr, "alice-token", &["nodes"]));
    assert!(
        nodes.contains("LAST SEEN") && !nodes.contains(&epoch),
        "{nodes}"
    );
    // A bad state is refused by the server, naming the field.
    let out = cli(
        &s.addr,
        "alice-token",
        &["queue", "--state", "pending,asleep"],
    );
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("400: state:"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Agents' reports are committed without an fsync of their own and made
/// durable, together, before the answer goes out: a report the server
/// acknowledged is still there after a SIGKILL right after the answer.
#[test]
fn an_acknowledged_agent_report_survives_a_sigkill() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let s = start(dir.path(), port);
    register(&s.addr, "node-a", 8);
    let mut ids = Vec::new();
    for k in 0..8 {
        let body = format!("name: r{k}\nqueue: research\nreplicas: 1\nresources:\n  gpus: 1\n");
        let v: serde_json::Value = ureq::post(&format!("{}/v1/jobs", s.addr))
            .set("Authorization", "Bearer alice-token")
            .set("Content-Type", "application/yaml")
            .send_string(&body)
            .expect("submit")
            .into_json()
            .expect("json");
        ids.push(v["id"].as_u64().expect("id"));
    }
    let state = |addr: &str, id: u64| -> String {
        let v: serde_json::Value = ureq::get(&format!("{addr}/v1/jobs/{id}"))
            .set("Authorization", "Bearer admin-secret")
            .call()
            .expect("describe")
            .into_json()
            .expect("json");
        v["state"].as_str().unwrap_or("").to_string()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while ids.iter().any(|id| state(&s.addr, *id) != "scheduled") {
        assert!(Instant::now() < deadline, "the 8 jobs should be placed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let report = |id: u64, body: &str| {
        ureq::post(&format!("{}/v1/agent/node-a/report", s.addr))
            .set("Authorization", "Bearer admin-secret")
            .set("Content-Type", "application/json")
            .send_string(&format!("{{\"job\":{id},{body}}}"))
            .expect("report acknowledged");
    };
    for id in &ids {
        report(*id, "\"state\":\"running\"");
        report(*id, "\"state\":\"exited\",\"exit_code\":0");
    }
    let mut s = s;
    let _ = s.child.kill(); // SIGKILL right after the last answer
    let _ = s.child.wait();
    drop(s);
    let s = start(dir.path(), port);
    for id in &ids {
        assert_eq!(state(&s.addr, *id), "succeeded", "job {id}");
    }
}
