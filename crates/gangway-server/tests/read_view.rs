//! Job reads off the state lock (issue 16): listing and describing jobs read
//! the published view, never the control state's mutex, and a client that
//! was acknowledged a submission or a cancel reads it at once.

mod common;

use gangway_server::ServerConfig;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

const CONFIG: &str = r#"
admin_token: admin-secret
agent_token: agent-secret
node_approval: auto
users:
  - { name: alice, token: alice-token, queues: [research] }
  - { name: bob, token: bob-token, queues: [research] }
queues:
  - name: research
    quota: { nominal: { gpus: 8 } }
"#;

struct Server {
    base: String,
    app: Arc<gangway_server::api::App>,
    _rt: tokio::runtime::Runtime,
}

fn start(dir: &std::path::Path) -> Server {
    let cfg = ServerConfig::from_yaml(CONFIG).expect("config");
    let common::Served { base, app, rt } = common::serve(cfg, dir);
    let s = Server { base, app, _rt: rt };
    // One cordoned node: jobs are accepted and stay pending, so nothing but
    // the client changes them.
    let node = gangway_core::NodeSpec::uniform("n0", "leaf0", "spine0", 8, "H100", 80);
    let node = serde_json::to_string(&node).expect("node");
    let (code, body) = s.post("/v1/nodes", "admin-secret", &node);
    assert!(code == 200 || code == 201, "register: {body}");
    let (code, body) = s.post("/v1/nodes/n0/cordon", "admin-secret", "");
    assert_eq!(code, 200, "cordon: {body}");
    s
}

/// A request that gives up after a minute: a read stuck behind the state
/// lock fails the test instead of hanging it.
fn call(req: ureq::Request, body: Option<&str>) -> (u16, Value) {
    let req = req.timeout(Duration::from_secs(60));
    let r = match body {
        Some(b) => req.set("Content-Type", "application/yaml").send_string(b),
        None => req.call(),
    };
    match r {
        Ok(resp) => (resp.status(), resp.into_json().unwrap_or(Value::Null)),
        Err(ureq::Error::Status(code, resp)) => (code, resp.into_json().unwrap_or(Value::Null)),
        Err(e) => panic!("transport error (blocked on the state lock?): {e}"),
    }
}

impl Server {
    fn get(&self, path: &str, token: &str) -> (u16, Value) {
        call(
            ureq::get(&format!("{}{path}", self.base))
                .set("Authorization", &format!("Bearer {token}")),
            None,
        )
    }
    fn post(&self, path: &str, token: &str, body: &str) -> (u16, Value) {
        call(
            ureq::post(&format!("{}{path}", self.base))
                .set("Authorization", &format!("Bearer {token}")),
            Some(body),
        )
    }
}

const JOB: &str = "name: j\nqueue: research\nreplicas: 1\nresources: { gpus: 1 }\nrun: { command: [sleep, '1'], env: { SECRET: hunter2 } }\n";

#[test]
fn an_acknowledged_submission_or_cancel_is_read_back_at_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    for i in 0..40 {
        let (code, body) = s.post("/v1/jobs", "alice-token", JOB);
        assert_eq!(code, 201, "{body}");
        let id = body["id"].as_u64().expect("id");
        let (code, job) = s.get(&format!("/v1/jobs/{id}"), "alice-token");
        assert_eq!(
            code, 200,
            "submission {i}: job {id} described right after: {job}"
        );
        assert_eq!(job["state"], "pending");
        assert_eq!(
            job["spec"]["run"]["env"]["SECRET"], "hunter2",
            "the owner sees it"
        );
        let (code, page) = s.get("/v1/jobs?desc=true&limit=1", "alice-token");
        assert_eq!(code, 200);
        assert_eq!(page[0]["id"].as_u64(), Some(id), "listed right after");
        if i % 2 == 0 {
            let (code, body) = s.post(&format!("/v1/jobs/{id}/cancel"), "alice-token", "");
            assert_eq!(code, 200, "{body}");
            let (_, job) = s.get(&format!("/v1/jobs/{id}"), "alice-token");
            assert_eq!(job["state"], "cancelled", "the cancel is read right after");
            let (_, page) = s.get("/v1/jobs?state=cancelled&desc=true&limit=1", "alice-token");
            assert_eq!(page[0]["id"].as_u64(), Some(id));
        }
    }
    // Visibility is the view's as it was the state's: another user's job is
    // shown with its environment redacted.
    let (_, page) = s.get("/v1/jobs?limit=1", "bob-token");
    assert_eq!(page[0]["user"], "alice");
    assert_ne!(page[0]["spec"]["run"]["env"]["SECRET"], "hunter2");
}

#[test]
fn listing_and_describing_do_not_wait_for_the_state_lock() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    let (code, body) = s.post("/v1/jobs", "alice-token", JOB);
    assert_eq!(code, 201, "{body}");
    let id = body["id"].as_u64().expect("id");
    // Hold the state lock, as a long scheduling cycle does, while reading.
    let held = s.app.control.lock().expect("lock");
    let (code, job) = s.get(&format!("/v1/jobs/{id}"), "bob-token");
    assert_eq!(code, 200, "{job}");
    assert_eq!(job["id"].as_u64(), Some(id));
    for q in [
        "",
        "?state=pending",
        "?user=alice&active=true",
        "?desc=true&limit=1",
    ] {
        let (code, page) = s.get(&format!("/v1/jobs{q}"), "alice-token");
        assert_eq!(code, 200, "{q}: {page}");
        assert_eq!(page[0]["id"].as_u64(), Some(id), "{q}");
    }
    let (code, _) = s.get("/v1/jobs/999", "alice-token");
    assert_eq!(code, 404);
    drop(held);
}

/// A GET that must answer within `within`: one stuck behind the state lock
/// fails at once instead of after a minute. The status and the body as text.
fn get_text(s: &Server, path: &str, token: &str, within: Duration) -> (u16, String) {
    let r = ureq::get(&format!("{}{path}", s.base))
        .set("Authorization", &format!("Bearer {token}"))
        .timeout(within)
        .call();
    match r {
        Ok(resp) => (resp.status(), resp.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(code, resp)) => (code, resp.into_string().unwrap_or_default()),
        Err(e) => {
            panic!("GET {path}: no answer within {within:?} (blocked on the state lock?): {e}")
        }
    }
}

fn get_json(s: &Server, path: &str, token: &str) -> Value {
    let (code, body) = get_text(s, path, token, Duration::from_secs(5));
    assert_eq!(code, 200, "{path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
}

/// The value of one series in a `/metrics` answer.
fn series(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn nodes_queues_cluster_and_metrics_answer_while_the_state_lock_is_held() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    let (code, body) = s.post("/v1/nodes/n0/uncordon", "admin-secret", "");
    assert_eq!(code, 200, "{body}");
    let (code, body) = s.post("/v1/jobs", "alice-token", JOB);
    assert_eq!(code, 201, "{body}");
    let id = body["id"].as_u64().expect("id");
    // The scheduler places it on n0's first GPU.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, job) = s.get(&format!("/v1/jobs/{id}"), "alice-token");
        if job["state"] != "pending" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never scheduled: {job}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Hold the state lock, as a long scheduling cycle does, while reading.
    let held = s.app.control.lock().expect("lock");
    let nodes = get_json(&s, "/v1/nodes", "bob-token");
    assert_eq!(nodes.as_array().map(Vec::len), Some(1), "{nodes}");
    let n0 = &nodes[0];
    assert_eq!(n0["name"], "n0");
    assert_eq!(n0["cordoned"], false, "{n0}");
    assert_eq!(n0["pending_approval"], false);
    assert_eq!(n0["jobs"], serde_json::json!([id]), "{n0}");
    let gpus = n0["gpus"].as_array().expect("gpus");
    assert_eq!(gpus.len(), 8);
    let allocated = gpus.iter().filter(|g| g["allocated"] == true).count();
    assert_eq!(allocated, 1, "{n0}");

    let queues = get_json(&s, "/v1/queues", "bob-token");
    assert_eq!(queues[0]["name"], "research", "{queues}");
    assert_eq!(queues[0]["usage"]["gpus"], 1, "{queues}");
    assert_eq!(queues[0]["quota"]["nominal"]["gpus"], 8, "{queues}");

    let grid = get_json(&s, "/v1/cluster", "bob-token");
    assert_eq!(grid["totals"]["gpus"], 8, "{grid}");
    assert_eq!(grid["totals"]["allocated"], 1, "{grid}");
    assert_eq!(grid["totals"]["free"], 7, "{grid}");
    let cell = &grid["racks"][0]["nodes"][0];
    assert_eq!(grid["racks"][0]["leaf"], "leaf0", "{grid}");
    assert_eq!(cell["gpus"], "afffffff", "{grid}");
    assert_eq!(cell["owners"][0], id, "{grid}");
    assert_eq!(grid["jobs"][id.to_string()][1], "alice", "{grid}");

    let (code, text) = get_text(&s, "/metrics", "admin-secret", Duration::from_secs(5));
    assert_eq!(code, 200, "{text}");
    assert_eq!(series(&text, "gangway_gpus_allocated"), Some(1.0), "{text}");
    assert_eq!(series(&text, "gangway_gpus_free"), Some(7.0), "{text}");
    assert_eq!(
        series(
            &text,
            "gangway_jobs{state=\"scheduled\",queue=\"research\"}"
        )
        .or_else(|| series(&text, "gangway_jobs{state=\"running\",queue=\"research\"}")),
        Some(1.0),
        "{text}"
    );

    let history = get_json(&s, "/v1/queues/history", "bob-token");
    assert_eq!(
        history["queues"],
        serde_json::json!(["research"]),
        "{history}"
    );

    // The policy views the dashboard reads: the store and the view's jobs.
    let current = get_json(&s, "/v1/policy", "bob-token");
    assert_eq!(current["version"], 1, "{current}");
    let first = get_json(&s, "/v1/policy/versions/1", "bob-token");
    assert_eq!(first["version"], 1, "{first}");
    // The log's figures count jobs started in [since the change, now), in
    // whole seconds: a job placed this very second shows from the next one.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let log = loop {
        let log = get_json(&s, "/v1/policy/log", "bob-token");
        assert_eq!(log[0]["version"], 1, "{log}");
        if log[0]["after"]["overall"]["jobs"] == 1 {
            break log;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the job started: {log}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(log[0]["after"]["overall"]["jobs"], 1, "{log}");
    drop(held);
}

#[test]
fn an_acknowledged_cordon_or_submission_shows_in_nodes_and_metrics_at_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    for i in 0..20u32 {
        let action = if i % 2 == 0 { "uncordon" } else { "cordon" };
        let (code, body) = s.post(&format!("/v1/nodes/n0/{action}"), "admin-secret", "");
        assert_eq!(code, 200, "{body}");
        let nodes = get_json(&s, "/v1/nodes", "alice-token");
        assert_eq!(nodes[0]["cordoned"], i % 2 == 1, "after {action}: {nodes}");
    }
    // The node stays cordoned: submissions stay pending and are counted.
    let pending = "gangway_jobs{state=\"pending\",queue=\"research\"}";
    for n in 1..=20 {
        let (code, body) = s.post("/v1/jobs", "alice-token", JOB);
        assert_eq!(code, 201, "{body}");
        let (_, text) = get_text(&s, "/metrics", "admin-secret", Duration::from_secs(5));
        assert_eq!(series(&text, pending), Some(f64::from(n)), "{text}");
    }
}
