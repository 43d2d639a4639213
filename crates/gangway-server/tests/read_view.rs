//! Job reads off the state lock (issue 16): listing and describing jobs read
//! the published view, never the control state's mutex, and a client that
//! was acknowledged a submission or a cancel reads it at once.

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
    let app = gangway_server::open(cfg, dir).expect("opens");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let served = app.clone();
    rt.spawn(async move {
        let _ = gangway_server::serve(served, listener).await;
    });
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
