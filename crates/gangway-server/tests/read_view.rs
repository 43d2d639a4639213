//! Reads off the state lock: listing and describing jobs, the
//! nodes, queues, usage, history, reservations, the policy pilot and the
//! log relay read the published view, never the control state's mutex, and
//! a client that was acknowledged a change reads it at once.

mod common;

use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

const CONFIG: &str = r#"
admin_token: admin-secret
agent_token: agent-secret
metrics_token: metrics-secret
node_approval: auto
users:
  - { name: alice, token: alice-token, queues: [research] }
  - { name: bob, token: bob-token, queues: [research] }
queues:
  - name: research
    quota: { nominal: { gpus: 8 } }
"#;

use common::Server;

fn start(dir: &std::path::Path) -> Server {
    let s = common::start_in(CONFIG, dir);
    // One cordoned node: jobs are accepted and stay pending, so nothing but
    // the client changes them.
    let node = gangway_core::NodeSpec::uniform("n0", "leaf0", "spine0", 8, "H100", 80);
    let node = serde_json::to_string(&node).expect("node");
    let (code, body) = s.post_yaml("/v1/nodes", "admin-secret", &node);
    assert!(code == 200 || code == 201, "register: {body}");
    let (code, body) = s.post_yaml("/v1/nodes/n0/cordon", "admin-secret", "");
    assert_eq!(code, 200, "cordon: {body}");
    s
}

impl Server {
    /// `POST path` with a body sent as YAML (the server reads JSON as YAML).
    fn post_yaml(&self, path: &str, token: &str, body: &str) -> (u16, Value) {
        self.post(path, token, "application/yaml", body)
    }
}

const JOB: &str = "name: j\nqueue: research\nreplicas: 1\nresources: { gpus: 1 }\nrun: { command: [sleep, '1'], env: { SECRET: hunter2 } }\n";

#[test]
fn an_acknowledged_submission_or_cancel_is_read_back_at_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    for i in 0..40 {
        let (code, body) = s.post_yaml("/v1/jobs", "alice-token", JOB);
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
            let (code, body) = s.post_yaml(&format!("/v1/jobs/{id}/cancel"), "alice-token", "");
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
    let (code, body) = s.post_yaml("/v1/jobs", "alice-token", JOB);
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
    let (code, body) = s.post_yaml("/v1/nodes/n0/uncordon", "admin-secret", "");
    assert_eq!(code, 200, "{body}");
    let (code, body) = s.post_yaml("/v1/jobs", "alice-token", JOB);
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
        let (code, body) = s.post_yaml(&format!("/v1/nodes/n0/{action}"), "admin-secret", "");
        assert_eq!(code, 200, "{body}");
        let nodes = get_json(&s, "/v1/nodes", "alice-token");
        assert_eq!(nodes[0]["cordoned"], i % 2 == 1, "after {action}: {nodes}");
    }
    // The node stays cordoned: submissions stay pending and are counted.
    let pending = "gangway_jobs{state=\"pending\",queue=\"research\"}";
    for n in 1..=20 {
        let (code, body) = s.post_yaml("/v1/jobs", "alice-token", JOB);
        assert_eq!(code, 201, "{body}");
        let (_, text) = get_text(&s, "/metrics", "admin-secret", Duration::from_secs(5));
        assert_eq!(series(&text, pending), Some(f64::from(n)), "{text}");
    }
}

/// A stand-in for a node's agent serving logs: answers every request with
/// one log chunk and keeps the `Authorization` headers it was sent.
fn fake_log_agent() -> (u16, Arc<std::sync::Mutex<Vec<String>>>) {
    use std::io::{BufRead, BufReader, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = seen.clone();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            let mut r = BufReader::new(c.try_clone().expect("clone"));
            let mut line = String::new();
            while r.read_line(&mut line).is_ok_and(|n| n > 2) {
                if let Some(v) = line.strip_prefix("Authorization: ") {
                    kept.lock().expect("seen").push(v.trim().to_string());
                }
                line.clear();
            }
            let body = r#"{"data":"rank 0 says hi\n","next_offset":15}"#;
            let _ = write!(
                c,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (port, seen)
}

/// Registers `n1` (one GPU, its agent at `port`) with the join token; the
/// registration's answer (its node token and log key).
fn node_with_agent(s: &Server, port: u16) -> serde_json::Value {
    let mut n1 = gangway_core::NodeSpec::uniform("n1", "leaf0", "spine0", 1, "H100", 80);
    n1.address = "127.0.0.1".into();
    n1.agent_url = Some(format!("http://127.0.0.1:{port}"));
    let (code, body) = s.post_yaml(
        "/v1/nodes",
        "agent-secret",
        &serde_json::to_string(&n1).expect("node"),
    );
    assert_eq!(code, 201, "register n1: {body}");
    body
}

fn wait_state(s: &Server, id: u64, state: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, job) = s.get(&format!("/v1/jobs/{id}"), "admin-secret");
        if job["state"] == state {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "never {state}: {job}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn submit(s: &Server, token: &str) -> u64 {
    let (code, body) = s.post_yaml("/v1/jobs", token, JOB);
    assert_eq!(code, 201, "{body}");
    body["id"].as_u64().expect("id")
}

/// A pilot of `allow_non_preemptible` on research: policy version 2.
fn start_pilot(s: &Server) {
    let (code, current) = s.get("/v1/policy", "admin-secret");
    assert_eq!(code, 200, "{current}");
    let mut policy = current["policy"].clone();
    for q in policy["queues"].as_array_mut().expect("queues") {
        q["allow_non_preemptible"] = true.into();
    }
    let req = serde_json::json!({
        "policy": policy.to_string(), "reason": "pilot", "pilot": ["research"],
    });
    let (code, v) = s.post_yaml("/v1/policy/apply", "admin-secret", &req.to_string());
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["version"], 2, "{v}");
}

fn post_within(s: &Server, path: &str, token: &str, body: &str, within: Duration) -> (u16, Value) {
    let r = ureq::post(&format!("{}{path}", s.base))
        .set("Authorization", &format!("Bearer {token}"))
        .timeout(within)
        .send_string(body);
    match r {
        Ok(resp) => (resp.status(), resp.into_json().unwrap_or(Value::Null)),
        Err(ureq::Error::Status(code, resp)) => (code, resp.into_json().unwrap_or(Value::Null)),
        Err(e) => {
            panic!("POST {path}: no answer within {within:?} (blocked on the state lock?): {e}")
        }
    }
}

#[test]
fn usage_history_reservations_pilot_logs_and_what_if_answer_while_the_state_lock_is_held() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    let (port, seen) = fake_log_agent();
    let log_token = node_with_agent(&s, port)["log_token"]
        .as_str()
        .expect("log token")
        .to_string();
    // One job runs on n1; two more wait behind it and are cancelled: a
    // running job for usage and the log relay, finished ones for history.
    let running = submit(&s, "alice-token");
    wait_state(&s, running, "scheduled");
    let mine = submit(&s, "alice-token");
    let bobs = submit(&s, "bob-token");
    for (id, token) in [(mine, "alice-token"), (bobs, "bob-token")] {
        let (code, body) = s.post_yaml(&format!("/v1/jobs/{id}/cancel"), token, "");
        assert_eq!(code, 200, "{body}");
    }
    let start_at = gangway_server::clock::now() + 3600;
    let req = serde_json::json!({
        "name": "maint", "nodes": ["n0"], "start": start_at, "duration_seconds": 600,
    });
    let (code, body) = s.post_yaml("/v1/reservations", "admin-secret", &req.to_string());
    assert_eq!(code, 201, "{body}");
    start_pilot(&s);

    let to = gangway_server::clock::now();
    // Hold the state lock, as a long scheduling cycle does, while reading;
    // what the locked path would answer is computed on the held state.
    let held = s.app.control.lock().expect("lock");
    let now = gangway_server::clock::now();
    let within = Duration::from_secs(5);

    let usage = get_json(&s, &format!("/v1/usage?from=0&to={to}"), "bob-token");
    let (q, u) = gangway_server::history::usage(&held.jobs, 0, to, now);
    assert_eq!(usage["gpu_hours_by_queue"], serde_json::json!(q), "{usage}");
    assert_eq!(usage["gpu_hours_by_user"], serde_json::json!(u), "{usage}");
    assert!(
        usage["gpu_hours_by_queue"]["research"].is_number(),
        "{usage}"
    );

    let page = |user: Option<&str>| {
        let f = gangway_server::history::HistoryFilter {
            user: user.map(str::to_string),
            limit: gangway_server::history::DEFAULT_PAGE,
            ..Default::default()
        };
        serde_json::to_value(gangway_server::history::page(&held.jobs, &f, now)).expect("page")
    };
    let alices = get_json(&s, "/v1/history", "alice-token");
    assert_eq!(alices, page(Some("alice")), "a user's own history");
    assert_eq!(
        alices["entries"].as_array().map(Vec::len),
        Some(1),
        "{alices}"
    );
    assert_eq!(alices["entries"][0]["id"].as_u64(), Some(mine), "{alices}");
    let all = get_json(&s, "/v1/history", "admin-secret");
    assert_eq!(all, page(None));
    assert_eq!(all["entries"].as_array().map(Vec::len), Some(2), "{all}");

    let reservations = get_json(&s, "/v1/reservations", "bob-token");
    let locked: Vec<_> = held.reservations.0.values().cloned().collect();
    assert_eq!(reservations, serde_json::to_value(&locked).expect("json"));
    assert_eq!(reservations[0]["name"], "maint", "{reservations}");
    assert_eq!(reservations[0]["nodes"], serde_json::json!(["n0"]));

    let pilot = get_json(&s, "/v1/policy/pilot", "bob-token");
    assert_eq!(pilot["version"], 2, "{pilot}");
    assert_eq!(pilot["queues"], serde_json::json!(["research"]), "{pilot}");

    let (code, text) = get_text(
        &s,
        &format!("/v1/jobs/{running}/logs"),
        "alice-token",
        within,
    );
    assert_eq!(code, 200, "{text}");
    let chunk: Value = serde_json::from_str(&text).expect("chunk");
    assert_eq!(chunk["data"], "rank 0 says hi\n", "{chunk}");
    assert_eq!(
        seen.lock().expect("seen").as_slice(),
        [format!("Bearer {log_token}")],
        "the relay sends the node's own log key"
    );

    let current = get_json(&s, "/v1/policy", "admin-secret");
    let req = serde_json::json!({ "policy": current["policy"].to_string() });
    let (code, v) = post_within(
        &s,
        "/v1/policy/what-if",
        "admin-secret",
        &req.to_string(),
        within,
    );
    assert_eq!(code, 200, "{v}");
    assert!(v["table"].is_string(), "{v}");
    drop(held);
}

#[test]
fn a_created_or_deleted_reservation_is_read_back_at_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    let start_at = gangway_server::clock::now() + 3600;
    for i in 0..10u64 {
        let name = format!("m{i}");
        let req = serde_json::json!({
            "name": name, "nodes": ["n0"], "start": start_at + i, "duration_seconds": 60,
        });
        let (code, body) = s.post_yaml("/v1/reservations", "admin-secret", &req.to_string());
        assert_eq!(code, 201, "{body}");
        let list = get_json(&s, "/v1/reservations", "alice-token");
        let names: Vec<&str> = list
            .as_array()
            .expect("list")
            .iter()
            .filter_map(|r| r["name"].as_str())
            .collect();
        assert!(
            names.contains(&name.as_str()),
            "{name} after its creation: {list}"
        );
        assert_eq!(list[names.len() - 1], body, "as created");
        if i % 2 == 1 {
            let r = ureq::delete(&format!("{}/v1/reservations/{name}", s.base))
                .set("Authorization", "Bearer admin-secret")
                .call()
                .expect("delete");
            assert_eq!(r.status(), 200);
            let list = get_json(&s, "/v1/reservations", "alice-token");
            assert!(
                !list.to_string().contains(&format!("\"{name}\"")),
                "{name} after its deletion: {list}"
            );
        }
    }
    let list = get_json(&s, "/v1/reservations", "alice-token");
    assert_eq!(list.as_array().map(Vec::len), Some(5), "{list}");
}

#[test]
fn the_reads_off_the_lock_keep_their_authorisation() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    let (port, seen) = fake_log_agent();
    let body = node_with_agent(&s, port);
    let node_token = body["node_token"].as_str().expect("node token").to_string();
    let running = submit(&s, "alice-token");
    wait_state(&s, running, "scheduled");
    let waiting = submit(&s, "alice-token");
    let (code, body) = s.post_yaml(&format!("/v1/jobs/{waiting}/cancel"), "alice-token", "");
    assert_eq!(code, 200, "{body}");
    start_pilot(&s);
    let within = Duration::from_secs(5);
    let reads = [
        "/v1/usage".to_string(),
        "/v1/history".to_string(),
        "/v1/reservations".to_string(),
        "/v1/policy/pilot".to_string(),
        "/v1/nodes".to_string(),
        format!("/v1/jobs/{running}/logs"),
    ];
    // Machines' tokens read none of them; an unknown token is a 401.
    for path in &reads {
        for t in ["agent-secret", node_token.as_str(), "metrics-secret"] {
            let (code, body) = get_text(&s, path, t, within);
            assert_eq!(code, 403, "{path} with {t}: {body}");
        }
        assert_eq!(get_text(&s, path, "made-up", within).0, 401, "{path}");
    }
    // People: another user's logs and history are refused, one's own given.
    let (code, body) = get_text(&s, &format!("/v1/jobs/{running}/logs"), "bob-token", within);
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("owner and admins"), "{body}");
    assert!(
        seen.lock().expect("seen").is_empty(),
        "the agent was asked for bob"
    );
    let (code, body) = get_text(&s, "/v1/history?user=alice", "bob-token", within);
    assert_eq!(code, 403, "{body}");
    let bobs = get_json(&s, "/v1/history", "bob-token");
    assert_eq!(bobs["entries"], serde_json::json!([]), "{bobs}");
    let alices = get_json(&s, "/v1/history?user=alice", "alice-token");
    assert_eq!(
        alices["entries"][0]["id"].as_u64(),
        Some(waiting),
        "{alices}"
    );
    for t in ["alice-token", "bob-token"] {
        for path in [
            "/v1/usage",
            "/v1/reservations",
            "/v1/policy/pilot",
            "/v1/nodes",
        ] {
            assert_eq!(get_text(&s, path, t, within).0, 200, "{path} with {t}");
        }
    }
    // The what-if reads the view too, and stays the admin's.
    let current = get_json(&s, "/v1/policy", "admin-secret");
    let req = serde_json::json!({ "policy": current["policy"].to_string() }).to_string();
    let (code, body) = post_within(&s, "/v1/policy/what-if", "alice-token", &req, within);
    assert_eq!(code, 403, "{body}");
    let (code, body) = post_within(&s, "/v1/policy/what-if", "admin-secret", &req, within);
    assert_eq!(code, 200, "{body}");
}
