//! Issue 12's attacks on the control plane (4–14), each tried against the
//! real server over HTTP with the token an attacker would hold (a plain
//! user's, the agents' join token, a node's own token) and each refused with
//! an error that names the field or the rule.

mod common;

use gangway_core::NodeSpec;
use gangway_server::ServerConfig;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const CONFIG: &str = r#"
admin_token: admin-secret
agent_token: agent-secret
metrics_token: metrics-secret
node_approval: auto
max_grace_seconds: 60
grace_kill_margin_seconds: 1
users:
  - { name: alice, token: alice-token, queues: [research, prod] }
  - { name: bob, token: bob-token, queues: [research] }
  - name: carol
    token: carol-token
    queues: [research]
    limits: { max_pending_jobs: 2, max_gpus_per_job: 4, requests_per_second: 1000, burst: 1000 }
  - name: dave
    token: dave-token
    queues: [research]
    limits: { max_pending_jobs: 100, max_gpus_per_job: 64, requests_per_second: 1, burst: 3 }
queues:
  - name: research
  - name: prod
    allowed_priorities: [normal, high, production]
    allow_non_preemptible: true
"#;

use common::{answer, Server};

fn start_with(config: &str) -> Server {
    common::start(config)
}

fn start() -> Server {
    start_with(CONFIG)
}

impl Server {
    fn sync(&self, node: &str, token: &str) -> (u16, Value) {
        self.post(
            &format!("/v1/agent/{node}/sync"),
            token,
            "application/json",
            r#"{"gpus":[],"tasks":[]}"#,
        )
    }
    fn node(&self, name: &str) -> Value {
        self.get("/v1/nodes", "admin-secret")
            .1
            .as_array()
            .and_then(|a| a.iter().find(|n| n["name"] == name).cloned())
            .unwrap_or(Value::Null)
    }
}

fn node(name: &str, gpus: u32, addr: &str, port: u16) -> NodeSpec {
    let mut n = NodeSpec::uniform(name, "leaf0", "spine0", gpus, "H100", 80);
    n.address = addr.to_string();
    n.agent_url = Some(format!("http://{addr}:{port}"));
    n
}

fn error(v: &Value) -> String {
    v["error"].as_str().unwrap_or_default().to_string()
}

fn job(name: &str, queue: &str, gpus: u32) -> String {
    format!("name: {name}\nqueue: {queue}\nreplicas: 1\nresources:\n  gpus: {gpus}\n")
}

/// Attack 4: the join token takes over an existing node.
#[test]
fn the_join_token_cannot_take_over_a_registered_node() {
    let s = start();
    let (code, v) = s.register_as("agent-secret", &node("node-a", 8, "127.0.0.1", 9001));
    assert_eq!(code, 201, "{v}");
    let token_a = v["node_token"]
        .as_str()
        .expect("first registration returns the token");
    let (code, v) = s.register_as("agent-secret", &node("node-b", 8, "127.0.0.2", 9002));
    assert_eq!(code, 201, "{v}");
    let token_b = v["node_token"].as_str().expect("token").to_string();

    // The join token re-registering node-a: refused, nothing returned, nothing changed.
    let (code, v) = s.register_as("agent-secret", &node("node-a", 8, "10.6.6.6", 80));
    assert_eq!(code, 403, "{v}");
    assert!(error(&v).contains("already registered"), "{v}");
    assert!(v.get("node_token").is_none());
    assert_eq!(s.node("node-a")["address"], "127.0.0.1");
    // Another node's token cannot register node-a either.
    let (code, v) = s.register_as(&token_b, &node("node-a", 8, "127.0.0.2", 9002));
    assert_eq!(code, 403, "{v}");
    assert_eq!(s.node("node-a")["address"], "127.0.0.1");
    // Its own token may move it, and the token is never sent again.
    let (code, v) = s.register_as(token_a, &node("node-a", 8, "127.0.0.3", 9003));
    assert_eq!(code, 200, "{v}");
    assert!(v.get("node_token").is_none(), "{v}");
    assert_eq!(s.node("node-a")["address"], "127.0.0.3");
    // The log URL must be on the node's own address: no pointing it elsewhere.
    let mut evil = node("node-a", 8, "127.0.0.3", 9003);
    evil.agent_url = Some("http://169.254.169.254:80".into());
    let (code, v) = s.register_as(token_a, &evil);
    assert_eq!(code, 422, "{v}");
    assert!(error(&v).starts_with("agent_url:"), "{v}");
    evil.agent_url = Some("http://127.0.0.3:9003/redirect?to=x".into());
    assert_eq!(s.register_as(token_a, &evil).0, 422);
    // Assignments and reports: each node's own, never the join token's.
    assert_eq!(s.sync("node-a", token_a).0, 200);
    assert_eq!(s.sync("node-a", &token_b).0, 403);
    assert_eq!(s.sync("node-a", "agent-secret").0, 403);
    assert_eq!(s.sync("node-a", "alice-token").0, 403);
    assert_eq!(s.sync("node-a", "made-up-token").0, 401);
}

/// Attack 5: fake nodes registered with the join token receive real jobs.
#[test]
fn nodes_that_join_wait_for_approval_and_admins_can_delete_them() {
    let s = start_with(&CONFIG.replace("node_approval: auto", "node_approval: manual"));
    // An admin's node is approved; cordoned, it takes no work.
    let (code, v) = s.register_as("admin-secret", &node("real", 8, "127.0.0.9", 9009));
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["pending_approval"], false);
    assert_eq!(
        s.post(
            "/v1/nodes/real/cordon",
            "admin-secret",
            "application/json",
            ""
        )
        .0,
        200
    );
    let (code, v) = s.register_as("agent-secret", &node("fake", 8, "127.0.0.1", 9001));
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["pending_approval"], true);
    let token = v["node_token"].as_str().expect("token").to_string();
    let (_, v) = s.submit("alice-token", &job("secret-work", "research", 8));
    let id = v["id"].as_u64().unwrap_or_else(|| panic!("{v}"));
    // The waiting node heartbeats but gets nothing to run; the job waits.
    for _ in 0..3 {
        let (code, v) = s.sync("fake", &token);
        assert_eq!(code, 200);
        assert_eq!(v["assignments"], json!([]));
        std::thread::sleep(Duration::from_millis(400));
    }
    assert_eq!(
        s.get(&format!("/v1/jobs/{id}"), "admin-secret").1["state"],
        "pending"
    );
    assert_eq!(s.node("fake")["pending_approval"], true);
    // Only admins approve.
    for t in ["alice-token", "agent-secret", token.as_str()] {
        let (code, _) = s.post("/v1/nodes/fake/approve", t, "application/json", "");
        assert_eq!(code, 403, "{t} approved a node");
    }
    assert_eq!(
        s.post(
            "/v1/nodes/fake/approve",
            "admin-secret",
            "application/json",
            ""
        )
        .0,
        200
    );
    s.wait_for(id, "be scheduled", |j| j["state"] == "scheduled");
    assert_eq!(s.sync("fake", &token).1["assignments"][0]["job"], id);
    // Delete: its gang goes back to wait, its token stops working, the name may join again.
    assert_eq!(
        s.post(
            "/v1/nodes/fake/delete",
            "alice-token",
            "application/json",
            ""
        )
        .0,
        403
    );
    assert_eq!(
        s.post(
            "/v1/nodes/fake/delete",
            "admin-secret",
            "application/json",
            ""
        )
        .0,
        200
    );
    let j = s.wait_for(id, "leave the deleted node", |j| {
        j["state"] != "scheduled" && j["state"] != "running"
    });
    assert!(
        j["events"]
            .as_array()
            .expect("events")
            .iter()
            .any(|e| e["message"]
                .as_str()
                .unwrap_or("")
                .contains("node fake deleted")),
        "{j}"
    );
    assert_eq!(s.node("fake"), Value::Null);
    assert_eq!(
        s.sync("fake", &token).0,
        401,
        "a deleted node's token is unknown"
    );
    let (code, v) = s.register_as("agent-secret", &node("fake", 8, "127.0.0.1", 9001));
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["pending_approval"], true);
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Attacks 6 and 7: deep YAML stalls the API, aliases exhaust memory.
#[test]
fn deep_and_aliased_yaml_is_refused_fast_while_heartbeats_go_on() {
    let s = start();
    let (_, v) = s.register_as("agent-secret", &node("n0", 8, "127.0.0.1", 9001));
    let token = v["node_token"].as_str().expect("token").to_string();
    let deep = format!("{}{}", "[".repeat(70_000), "]".repeat(70_000));
    let base = s.base.clone();
    let flood: Vec<_> = (0..4)
        .map(|_| {
            let (base, deep) = (base.clone(), deep.clone());
            std::thread::spawn(move || {
                let mut worst = Duration::ZERO;
                for _ in 0..5 {
                    let t = Instant::now();
                    let (code, v) = answer(
                        ureq::post(&format!("{base}/v1/jobs"))
                            .set("Authorization", "Bearer alice-token")
                            .set("Content-Type", "application/yaml")
                            .send_string(&deep),
                    );
                    assert_eq!(code, 400, "{v}");
                    assert!(error(&v).starts_with("job spec:"), "{v}");
                    worst = worst.max(t.elapsed());
                }
                worst
            })
        })
        .collect();
    let mut beat_worst = Duration::ZERO;
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        let t = Instant::now();
        assert_eq!(s.sync("n0", &token).0, 200);
        beat_worst = beat_worst.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(20));
    }
    for f in flood {
        let worst = f.join().expect("flood thread");
        eprintln!("deep body (70,000 levels, 140 KB) refused in at most {worst:?}");
        assert!(worst < Duration::from_secs(5), "a deep body took {worst:?}");
    }
    eprintln!("slowest heartbeat during the flood: {beat_worst:?}");
    // Before: 30-64 s. A loaded test machine gets generous slack.
    assert!(
        beat_worst < Duration::from_secs(3),
        "a heartbeat waited {beat_worst:?} behind hostile bodies"
    );
    // A billion-laughs document of about 117 KB: refused, and memory stays put.
    let mut bomb = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..9 {
        let p = i - 1;
        bomb.push_str(&format!(
            "a{i}: &a{i} [{}]\n",
            vec![format!("*a{p}"); 9].join(", ")
        ));
    }
    while bomb.len() < 117_000 {
        bomb.push_str("# padding to the size of the reported attack\n");
    }
    let before = rss_kib();
    for _ in 0..4 {
        let (code, v) = s.submit("alice-token", &bomb);
        assert_eq!(code, 400, "{v}");
    }
    let grew = rss_kib().saturating_sub(before);
    eprintln!(
        "RSS growth over 4 alias bombs of {} bytes: {grew} KiB",
        bomb.len()
    );
    assert!(grew < 64 * 1024, "RSS grew by {grew} KiB on an alias bomb");
    // Bodies past the size limit are refused before they are parsed (the
    // server may close the connection while the client still writes: then
    // the client sees a reset instead of the 413).
    let big = "#".repeat(2 << 20);
    match ureq::post(&format!("{}/v1/jobs", s.base))
        .set("Authorization", "Bearer alice-token")
        .set("Content-Type", "application/yaml")
        .send_string(&big)
    {
        Err(ureq::Error::Status(code, r)) => {
            assert_eq!(code, 413, "{}", r.into_string().unwrap_or_default())
        }
        Err(ureq::Error::Transport(_)) => {}
        Ok(r) => panic!("accepted a 2 MiB body: {}", r.status()),
    }
    assert_eq!(s.get("/healthz", "alice-token").0, 200);
}

/// Attack 8: integers the agent and the lifecycle cannot hold.
#[test]
fn out_of_range_integers_are_refused_with_the_field_named() {
    let s = start();
    let cases = [
        (
            "checkpoint:\n  grace_seconds: 18446744073709551615\n",
            "checkpoint.grace_seconds:",
        ),
        (
            "checkpoint:\n  grace_seconds: 61\n",
            "checkpoint.grace_seconds: at most 60",
        ),
        (
            "restart:\n  backoff_seconds: 18446744073709551615\n",
            "restart.backoff_seconds:",
        ),
        (
            "runtime_seconds: 18446744073709551615\n",
            "runtime_seconds:",
        ),
        (
            "checkpoint:\n  interval_seconds: 18446744073709551615\n",
            "checkpoint.interval_seconds:",
        ),
        (
            "restart:\n  max_restarts: 4000000000\n",
            "restart.max_restarts:",
        ),
    ];
    for (extra, needle) in cases {
        for token in ["alice-token", "admin-secret"] {
            let (code, v) = s.submit(token, &format!("{}{extra}", job("x", "research", 1)));
            assert_eq!(code, 400, "{extra}: {v}");
            assert!(error(&v).starts_with(needle), "{extra}: {v}");
        }
    }
    let (code, v) = s.submit(
        "alice-token",
        "name: x\nqueue: research\nreplicas: 4294967295\nresources:\n  gpus: 64\n",
    );
    assert_eq!(code, 400, "{v}");
    assert!(error(&v).starts_with("replicas:"), "{v}");
    assert_eq!(s.get("/v1/jobs", "admin-secret").1, json!([]));
}

/// Attack 9: a victim that ignores SIGTERM keeps borrowed GPUs forever.
#[test]
fn a_victim_past_its_grace_loses_its_gpus_whatever_its_ranks_do() {
    let s = start();
    let (_, v) = s.register_as("agent-secret", &node("n0", 8, "127.0.0.1", 9001));
    let token = v["node_token"].as_str().expect("token").to_string();
    let (code, v) = s.submit(
        "alice-token",
        "name: squatter\nqueue: research\nreplicas: 1\npriority: low\ncheckpoint: { grace_seconds: 2 }\nresources: { gpus: 8 }\n",
    );
    assert_eq!(code, 201, "{v}");
    let low = v["id"].as_u64().expect("id");
    s.wait_for(low, "be scheduled", |j| j["state"] == "scheduled");
    let running = format!("{{\"job\":{low},\"state\":\"running\"}}");
    assert_eq!(
        s.post("/v1/agent/n0/report", &token, "application/json", &running)
            .0,
        200
    );
    let (code, v) = s.submit(
        "admin-secret",
        "name: urgent\nqueue: research\nreplicas: 1\npriority: production\nresources: { gpus: 8 }\n",
    );
    assert_eq!(code, 201, "{v}");
    let high = v["id"].as_u64().expect("id");
    s.wait_for(low, "be preempted", |j| j["state"] == "preempting");
    let t = Instant::now();
    // The agent never reports the victim's exit (its ranks ignore SIGTERM).
    let j = s.wait_for(low, "lose its GPUs", |j| j["state"] == "pending");
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    let last = j["events"].as_array().and_then(|e| e.last()).cloned();
    assert!(
        last.as_ref()
            .and_then(|e| e["message"].as_str())
            .is_some_and(|m| m.contains("grace of 2s") && m.contains("ran out")),
        "{last:?}"
    );
    s.wait_for(high, "get the GPUs", |j| j["state"] == "scheduled");
    // The node is told to stop the old attempt: it is no longer assigned.
    let (_, v) = s.sync("n0", &token);
    let jobs: Vec<u64> = v["assignments"]
        .as_array()
        .expect("assignments")
        .iter()
        .filter_map(|a| a["job"].as_u64())
        .collect();
    assert_eq!(jobs, vec![high]);
}

/// Attack 10: any token reads every job's env values and logs.
#[test]
fn env_values_and_logs_belong_to_the_owner_and_admins() {
    let s = start();
    let (_, v) = s.register_as("agent-secret", &node("n0", 8, "127.0.0.1", 9001));
    let node_token = v["node_token"].as_str().expect("token").to_string();
    let (code, v) = s.submit(
        "alice-token",
        "name: private\nqueue: research\nreplicas: 1\nresources: { gpus: 1 }\nrun:\n  command: [sleep, '1']\n  env: { WANDB_API_KEY: hunter2 }\n",
    );
    assert_eq!(code, 201, "{v}");
    let id = v["id"].as_u64().expect("id");
    let path = format!("/v1/jobs/{id}");
    assert_eq!(
        s.get(&path, "alice-token").1["spec"]["run"]["env"]["WANDB_API_KEY"],
        "hunter2"
    );
    assert_eq!(
        s.get(&path, "admin-secret").1["spec"]["run"]["env"]["WANDB_API_KEY"],
        "hunter2"
    );
    let (code, v) = s.get(&path, "bob-token");
    assert_eq!(code, 200);
    assert_eq!(
        v["spec"]["run"]["env"]["WANDB_API_KEY"], "<redacted>",
        "{v}"
    );
    let listed = s.get("/v1/jobs", "bob-token").1;
    assert!(!listed.to_string().contains("hunter2"), "{listed}");
    // Logs: the owner's (here the agent is not running, so not 403) and nobody else's.
    let (code, v) = s.get(&format!("{path}/logs"), "bob-token");
    assert_eq!(code, 403, "{v}");
    assert!(error(&v).contains("owner and admins"), "{v}");
    // Machines' tokens read nothing of jobs.
    for t in ["agent-secret", node_token.as_str(), "metrics-secret"] {
        assert_eq!(s.get(&path, t).0, 403, "{t} read a job");
        assert_eq!(s.get("/v1/jobs", t).0, 403, "{t} listed jobs");
        assert_eq!(s.get(&format!("{path}/logs"), t).0, 403, "{t} read logs");
        assert_eq!(s.get("/v1/cluster", t).0, 403, "{t} read the cluster view");
    }
    assert_eq!(s.get(&path, "made-up").0, 401);
}

/// Attack 11: any user submits `priority: critical` and `preemptible: false`.
#[test]
fn users_get_only_the_classes_and_preemption_their_queue_allows() {
    let s = start();
    s.register_as("agent-secret", &node("n0", 8, "127.0.0.1", 9001));
    let with = |extra: &str, q: &str| format!("{}{extra}", job("x", q, 1));
    let refused = [
        (
            "priority: critical\n",
            "research",
            "priority: class critical is not allowed",
        ),
        (
            "preemptible: false\n",
            "research",
            "preemptible: preemptible: false",
        ),
        (
            "priority: production\n",
            "research",
            "preemptible: class production is not preemptible",
        ),
        (
            "priority: low\n",
            "prod",
            "priority: class low is not allowed in queue prod",
        ),
        ("priority: critical\n", "prod", "priority:"),
    ];
    for (extra, q, needle) in refused {
        let (code, v) = s.submit("alice-token", &with(extra, q));
        assert_eq!(code, 403, "{extra}{q}: {v}");
        assert!(error(&v).starts_with(needle), "{extra}: {v}");
    }
    let allowed = [
        ("priority: production\npreemptible: true\n", "research"),
        ("priority: production\n", "prod"),
        ("preemptible: false\n", "prod"),
    ];
    for (extra, q) in allowed {
        let (code, v) = s.submit("alice-token", &with(extra, q));
        assert_eq!(code, 201, "{extra}{q}: {v}");
    }
    // Admins are not bound by the queue's classes.
    let (code, v) = s.submit(
        "admin-secret",
        &with("priority: critical\npreemptible: false\n", "research"),
    );
    assert_eq!(code, 201, "{v}");
}

/// Attack 12: no limit on pending jobs, GPUs, request rate or sizes.
#[test]
fn floods_of_jobs_gpus_requests_and_bytes_are_bounded() {
    let s = start();
    s.register_as("agent-secret", &node("n0", 1, "127.0.0.1", 9001));
    // Cordoned: every job waits, so carol's waiting jobs pile up.
    s.post(
        "/v1/nodes/n0/cordon",
        "admin-secret",
        "application/json",
        "",
    );
    let keyed = |key: &str, name: &str| {
        answer(
            ureq::post(&format!("{}/v1/jobs", s.base))
                .set("Authorization", "Bearer carol-token")
                .set("Content-Type", "application/yaml")
                .set("Idempotency-Key", key)
                .send_string(&job(name, "research", 1)),
        )
    };
    let mut ids = Vec::new();
    for i in 0..2 {
        let (code, v) = keyed(&format!("k{i}"), &format!("j{i}"));
        assert_eq!(code, 201, "{v}");
        ids.push(v["id"].clone());
    }
    let (code, v) = s.submit("carol-token", &job("j2", "research", 1));
    assert_eq!(code, 429, "{v}");
    assert!(error(&v).contains("max_pending_jobs"), "{v}");
    // A retry of an accepted submission still gets its job back.
    let (code, v) = keyed("k0", "j0");
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["id"], ids[0]);
    let (code, v) = s.submit(
        "carol-token",
        "name: big\nqueue: research\nreplicas: 2\nresources: { gpus: 4 }\n",
    );
    assert_eq!(code, 403, "{v}");
    assert!(
        error(&v).contains("asks for 8 GPUs; your limit is 4"),
        "{v}"
    );
    let long = format!(
        "name: {}\nqueue: research\nreplicas: 1\nresources: {{ gpus: 1 }}\n",
        "n".repeat(300)
    );
    let (code, v) = s.submit("alice-token", &long);
    assert_eq!(code, 400, "{v}");
    assert!(error(&v).starts_with("name: at most 253 bytes"), "{v}");
    let mut many = json!({"name": "env", "queue": "research", "replicas": 1, "resources": {"gpus": 1}, "run": {"env": {}}});
    for i in 0..1100 {
        many["run"]["env"][format!("K{i}")] = json!("v");
    }
    let (code, v) = s.post(
        "/v1/jobs",
        "alice-token",
        "application/json",
        &many.to_string(),
    );
    assert_eq!(code, 400, "{v}");
    assert!(
        error(&v).starts_with("run.env: at most 1024 variables"),
        "{v}"
    );
    let args = json!({"name": "args", "queue": "research", "replicas": 1, "resources": {"gpus": 1},
        "run": {"command": vec!["x".repeat(60_000); 5]}});
    let (code, v) = s.post(
        "/v1/jobs",
        "alice-token",
        "application/json",
        &args.to_string(),
    );
    assert_eq!(code, 400, "{v}");
    assert!(error(&v).starts_with("run.command: at most"), "{v}");
    // dave: 1 request/s with a burst of 3.
    let codes: Vec<u16> = (0..6)
        .map(|_| s.get("/v1/queues", "dave-token").0)
        .collect();
    assert_eq!(&codes[..3], &[200, 200, 200], "{codes:?}");
    assert!(codes[3..].contains(&429), "{codes:?}");
    let (code, v) = s.get("/v1/queues", "dave-token");
    if code == 429 {
        assert!(error(&v).contains("too many requests from dave"), "{v}");
    }
    // Others are not slowed by dave.
    assert_eq!(s.get("/v1/queues", "alice-token").0, 200);
}

/// Attack 13: nothing is written anywhere.
#[test]
fn state_changing_calls_are_audited_and_only_admins_read_the_log() {
    let s = start();
    let (_, v) = s.register_as("agent-secret", &node("n0", 8, "127.0.0.1", 9001));
    assert!(v["node_token"].is_string());
    assert_eq!(
        s.register_as("agent-secret", &node("n0", 8, "10.0.0.1", 1))
            .0,
        403
    );
    let id = s.submit("alice-token", &job("a", "research", 1)).1["id"]
        .as_u64()
        .expect("id");
    assert_eq!(
        s.post(
            &format!("/v1/jobs/{id}/cancel"),
            "bob-token",
            "application/json",
            ""
        )
        .0,
        403
    );
    assert_eq!(
        s.post(
            &format!("/v1/jobs/{id}/cancel"),
            "alice-token",
            "application/json",
            ""
        )
        .0,
        200
    );
    assert_eq!(s.submit("forged-token", &job("b", "research", 1)).0, 401);
    assert_eq!(s.get("/v1/audit", "alice-token").0, 403);
    assert_eq!(s.get("/v1/audit", "agent-secret").0, 403);
    let (code, log) = s.get("/v1/audit", "admin-secret");
    assert_eq!(code, 200);
    let entries = log.as_array().expect("entries");
    let has = |who: &str, action: &str, target: Option<&str>, status: u16| {
        entries.iter().any(|e| {
            e["who"] == who
                && e["action"] == action
                && target.is_none_or(|t| e["target"] == t)
                && e["status"] == status
        })
    };
    assert!(
        has("agent", "POST /v1/nodes", Some("node n0"), 201),
        "{log}"
    );
    assert!(has("agent", "POST /v1/nodes", None, 403), "{log}");
    assert!(
        has("alice", "POST /v1/jobs", Some(&format!("job {id}")), 201),
        "{log}"
    );
    assert!(
        has(
            "bob",
            "POST /v1/jobs/{id}/cancel",
            Some(&format!("job {id}")),
            403
        ),
        "{log}"
    );
    assert!(
        has(
            "alice",
            "POST /v1/jobs/{id}/cancel",
            Some(&format!("job {id}")),
            200
        ),
        "{log}"
    );
    assert!(has("unknown token", "POST /v1/jobs", None, 401), "{log}");
    // It is a file in the data dir, private, one JSON object per line.
    let path = s.tmp().join("data/audit.log");
    let text = std::fs::read_to_string(&path).expect("audit file");
    assert_eq!(text.lines().count(), entries.len());
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
}

/// Attack 14: the minor ones on the server side.
#[test]
fn metrics_auth_order_status_codes_headers_and_files_are_hardened() {
    let s = start();
    let (_, v) = s.register_as("agent-secret", &node("n0", 8, "127.0.0.1", 9001));
    let node_token = v["node_token"].as_str().expect("token").to_string();
    // /metrics: a token, and only the admin's or the metrics token.
    assert!(matches!(
        ureq::get(&format!("{}/metrics", s.base)).call(),
        Err(ureq::Error::Status(401, _))
    ));
    assert_eq!(s.get("/metrics", "alice-token").0, 403);
    assert_eq!(s.get("/metrics", "agent-secret").0, 403);
    let text = ureq::get(&format!("{}/metrics", s.base))
        .set("Authorization", "Bearer metrics-secret")
        .call()
        .expect("metrics token")
        .into_string()
        .expect("text");
    assert!(text.contains("gangway_gpus_free"), "{text}");
    // Authentication comes before the body: garbage with a bad token is a 401, not a 400.
    for path in [
        "/v1/agent/n0/report",
        "/v1/agent/n0/sync",
        "/v1/jobs",
        "/v1/nodes",
    ] {
        assert_eq!(
            s.post(path, "nope", "application/json", "{{{").0,
            401,
            "{path}"
        );
        let (code, _) = answer(
            ureq::post(&format!("{}{path}", s.base))
                .set("Content-Type", "application/json")
                .send_string("{{{"),
        );
        assert_eq!(code, 401, "{path} without a token");
    }
    // 401 only for unknown tokens; every known token that may not is a 403.
    for (t, path) in [
        ("alice-token", "/v1/agent/n0/sync"),
        ("agent-secret", "/v1/agent/n0/sync"),
        (node_token.as_str(), "/v1/jobs"),
        ("metrics-secret", "/v1/nodes"),
    ] {
        assert_eq!(
            s.post(path, t, "application/json", "{}").0,
            403,
            "{t} {path}"
        );
    }
    // The dashboard: CSP with no framing, no sniffing.
    let r = ureq::get(&format!("{}/", s.base)).call().expect("page");
    let csp = r
        .header("content-security-policy")
        .unwrap_or("")
        .to_string();
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert!(csp.contains("script-src 'sha256-"), "{csp}");
    assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
    let r = ureq::get(&format!("{}/healthz", s.base))
        .call()
        .expect("healthz");
    assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
    // Secrets at rest: a private data dir, a private store, node tokens hashed.
    use std::os::unix::fs::PermissionsExt;
    let mode =
        |p: &std::path::Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode(&s.tmp().join("data")), 0o700);
    assert_eq!(mode(&s.tmp().join("data/gangway.redb")), 0o600);
    let store = std::fs::read(s.tmp().join("data/gangway.redb")).expect("store");
    let needle = node_token.as_bytes();
    assert!(
        !store.windows(needle.len()).any(|w| w == needle),
        "the node token is stored in plain text"
    );
}

/// Attack 4, the log relay: a node's log URL that redirects elsewhere is
/// not followed; the server contacts only the node's own address.
#[test]
fn log_relay_never_follows_a_redirect() {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let s = start();
    let secret = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let secret_port = secret.local_addr().expect("addr").port();
    let stolen = Arc::new(AtomicUsize::new(0));
    let st = stolen.clone();
    std::thread::spawn(move || {
        for c in secret.incoming().flatten() {
            st.fetch_add(1, Ordering::SeqCst);
            drop(c);
        }
    });
    let evil = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let evil_port = evil.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for mut c in evil.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = c.read(&mut buf);
            let _ = write!(
                c,
                "HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:{secret_port}/steal\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
        }
    });
    let (code, v) = s.register_as("agent-secret", &node("evil", 8, "127.0.0.1", evil_port));
    assert_eq!(code, 201, "{v}");
    let (_, v) = s.submit("alice-token", &job("victim", "research", 1));
    let id = v["id"].as_u64().expect("id");
    s.wait_for(id, "be scheduled", |j| j["state"] == "scheduled");
    let (code, v) = s.get(&format!("/v1/jobs/{id}/logs"), "alice-token");
    assert_eq!(code, 502, "{v}");
    assert!(error(&v).contains("302"), "{v}");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        stolen.load(Ordering::SeqCst),
        0,
        "the redirect was followed"
    );
}

/// Attack 14, status codes: on every authenticated route, a missing or
/// unknown token is a 401 and nothing else, whatever the body; a known
/// token that may not is a 403, never a 401 (which would say "no such token").
#[test]
fn every_route_answers_401_for_unknown_tokens_and_403_for_known_ones_not_allowed() {
    let s = start();
    let (_, v) = s.register_as("agent-secret", &node("n0", 8, "127.0.0.1", 9001));
    let node_token = v["node_token"].as_str().expect("token").to_string();
    let routes = [
        ("GET", "/v1/jobs"),
        ("POST", "/v1/jobs"),
        ("GET", "/v1/jobs/1"),
        ("POST", "/v1/jobs/1/cancel"),
        ("GET", "/v1/jobs/1/logs"),
        ("GET", "/v1/queues"),
        ("GET", "/v1/queues/history"),
        ("GET", "/v1/usage"),
        ("GET", "/v1/nodes"),
        ("POST", "/v1/nodes"),
        ("POST", "/v1/nodes/n0/approve"),
        ("POST", "/v1/nodes/n0/delete"),
        ("POST", "/v1/nodes/n0/gpus/0/unhealthy"),
        ("POST", "/v1/agent/n0/report"),
        ("POST", "/v1/agent/n0/sync"),
        ("GET", "/v1/audit"),
        ("GET", "/v1/cluster"),
        ("GET", "/v1/whoami"),
        ("GET", "/metrics"),
    ];
    let send = |m: &str, p: &str, auth: Option<&str>| {
        let mut r = ureq::request(m, &format!("{}{p}", s.base));
        if let Some(a) = auth {
            r = r.set("Authorization", a);
        }
        match r
            .set("Content-Type", "application/json")
            .send_string("{not json")
        {
            Ok(x) => x.status(),
            Err(ureq::Error::Status(c, _)) => c,
            Err(e) => panic!("{m} {p}: {e}"),
        }
    };
    for (m, p) in routes {
        for auth in [
            None,
            Some("Bearer nope-nope-nope"),
            Some("Basic YWRtaW4="),
            Some("Bearer "),
        ] {
            assert_eq!(send(m, p, auth), 401, "{m} {p} with {auth:?}");
        }
    }
    // Known tokens that may not: 403.
    let refused = [
        ("agent-secret", "GET", "/v1/jobs"),
        ("agent-secret", "POST", "/v1/agent/n0/sync"),
        ("agent-secret", "GET", "/metrics"),
        ("agent-secret", "GET", "/v1/audit"),
        ("metrics-secret", "GET", "/v1/jobs"),
        ("metrics-secret", "POST", "/v1/nodes"),
        (node_token.as_str(), "GET", "/v1/nodes"),
        (node_token.as_str(), "POST", "/v1/jobs"),
        (node_token.as_str(), "POST", "/v1/nodes/n0/approve"),
        ("alice-token", "POST", "/v1/nodes"),
        ("alice-token", "POST", "/v1/nodes/n0/delete"),
        ("alice-token", "POST", "/v1/nodes/n0/gpus/0/unhealthy"),
        ("alice-token", "POST", "/v1/agent/n0/report"),
        ("alice-token", "GET", "/v1/audit"),
        ("alice-token", "GET", "/metrics"),
    ];
    for (t, m, p) in refused {
        assert_eq!(send(m, p, Some(&format!("Bearer {t}"))), 403, "{t} {m} {p}");
    }
}

/// Attack 14, the other way to protect /metrics: a separate listen address
/// (for the monitoring network) serves it without a token, and only it.
#[test]
fn metrics_on_a_separate_address_need_no_token_and_serve_nothing_else() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = ServerConfig::from_yaml(CONFIG).expect("config");
    let app = gangway_server::open(cfg, dir.path()).expect("opens");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (api, metrics) = rt.block_on(async {
        (
            tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind"),
            tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind"),
        )
    });
    let (api_url, metrics_url) = (
        format!("http://{}", api.local_addr().expect("addr")),
        format!("http://{}", metrics.local_addr().expect("addr")),
    );
    rt.spawn(gangway_server::serve_metrics(app.clone(), metrics));
    rt.spawn(gangway_server::serve(app, api));
    let text = ureq::get(&format!("{metrics_url}/metrics"))
        .call()
        .expect("metrics without a token")
        .into_string()
        .expect("text");
    assert!(text.contains("gangway_api_requests"), "{text}");
    for p in ["/v1/jobs", "/v1/audit", "/"] {
        assert!(
            matches!(
                ureq::get(&format!("{metrics_url}{p}")).call(),
                Err(ureq::Error::Status(404, _))
            ),
            "{p} served on the metrics address"
        );
    }
    assert!(matches!(
        ureq::get(&format!("{api_url}/metrics")).call(),
        Err(ureq::Error::Status(401, _))
    ));
}

#[test]
fn an_array_counts_each_task_against_the_pending_limit() {
    let s = start();
    s.register_as("agent-secret", &node("n0", 1, "127.0.0.1", 9001));
    // Cordoned: every task waits.
    s.post(
        "/v1/nodes/n0/cordon",
        "admin-secret",
        "application/json",
        "",
    );
    let array = |spec: &str| format!("{}array: \"{spec}\"\n", job("arr", "research", 1));
    // carol may have 2 jobs waiting: an array of 3 is refused whole.
    let (code, v) = s.submit("carol-token", &array("0-2"));
    assert_eq!(code, 429, "{v}");
    assert!(error(&v).contains("submits 3"), "{v}");
    let (code, v) = s.submit("carol-token", &array("0-1%1"));
    assert_eq!(code, 201, "{v}");
    let (code, v) = s.submit("carol-token", &job("one-more", "research", 1));
    assert_eq!(code, 429, "{v}");
    // Bounds of the array itself, for everyone.
    let (code, v) = s.submit("admin-secret", &array("0-20000"));
    assert_eq!(code, 422, "{v}");
    assert!(error(&v).starts_with("array:"), "{v}");
    let (code, v) = s.submit("admin-secret", &array("0-3%0"));
    assert_eq!(code, 422, "{v}");
}

/// Names that would drive a terminal (ESC, CR, LF, bidi overrides) are
/// refused at submission, as YAML or JSON, and at an update, naming the
/// field and the character; nothing is stored.
#[test]
fn control_characters_in_names_are_refused_at_submit_and_update() {
    let s = start();
    for (name, code) in [
        ("\"evil\\e]52;c;SGVsbG8=\\a\"", "001B"),
        ("\"a\\rjob 1: succeeded\"", "000D"),
        ("\"a\\nb\"", "000A"),
        ("\"a\\tb\"", "0009"),
        ("\"txt\\u202Egpj\"", "202E"),
        ("\"a\\x9Bb\"", "009B"),
    ] {
        let (status, v) = s.submit("alice-token", &job(name, "research", 1));
        assert_eq!(status, 422, "{name}: {v}");
        assert_eq!(
            error(&v),
            format!("name: control character U+{code} is not allowed"),
            "{name}"
        );
    }
    let (status, v) = s.post(
        "/v1/jobs",
        "alice-token",
        "application/json",
        &json!({ "name": "x\u{1b}[2J", "queue": "research", "replicas": 1, "resources": { "gpus": 1 } })
            .to_string(),
    );
    assert_eq!(status, 422, "{v}");
    assert_eq!(error(&v), "name: control character U+001B is not allowed");
    assert_eq!(s.get("/v1/jobs", "admin-secret").1, json!([]));
    // A node registering a label that would do the same: refused too.
    let mut n = node("node-c", 1, "127.0.0.1", 9003);
    n.labels
        .insert("zone".into(), "eu\u{1b}]0;owned\u{7}".into());
    let (status, v) = s.register_as("agent-secret", &n);
    assert!(
        (400..500).contains(&status) && error(&v).contains("labels: control character U+001B"),
        "{status} {v}"
    );
    // A held job stays pending: it may be renamed, but not so.
    s.register_as("agent-secret", &node("node-a", 1, "127.0.0.1", 9001));
    let (status, v) = s.submit(
        "alice-token",
        &format!("{}hold: true\n", job("plain", "research", 1)),
    );
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_u64().expect("id");
    for token in ["alice-token", "admin-secret"] {
        let (status, v) = s.post(
            &format!("/v1/jobs/{id}/update"),
            token,
            "application/json",
            &json!({ "name": "renamed\r\n\u{1b}[31m" }).to_string(),
        );
        assert_eq!(status, 422, "{v}");
        assert_eq!(error(&v), "name: control character U+000D is not allowed");
    }
    let (_, j) = s.get(&format!("/v1/jobs/{id}"), "admin-secret");
    assert_eq!(j["spec"]["name"], "plain");
    let (status, v) = s.post(
        &format!("/v1/jobs/{id}/update"),
        "alice-token",
        "application/json",
        &json!({ "name": "renamed" }).to_string(),
    );
    assert_eq!(status, 200, "{v}");
}
