//! The one server fixture of the server's HTTP tests: the real server, in
//! process, on a loopback port, with the requests every test makes. Each
//! test crate compiles this module and uses part of it.
#![allow(dead_code)]

use gangway_core::NodeSpec;
use gangway_server::http::common::App;
use gangway_server::ServerConfig;
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The smallest cluster configuration: the admin and join tokens, nodes
/// admitted at once, and one user (alice) on one queue (`research`).
pub const ONE_QUEUE: &str = r#"
admin_token: admin-secret
agent_token: agent-secret
node_approval: auto
users:
  - { name: alice, token: alice-token, queues: [research] }
queues:
  - name: research
"#;

/// A server serving on loopback from its own runtime (dropped with it).
pub struct Served {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The server's state, for tests that reach behind the API.
    pub app: Arc<App>,
    /// The runtime the server runs on.
    pub rt: tokio::runtime::Runtime,
}

/// Opens a server on `dir` with `cfg` and serves it on a free loopback port.
pub fn serve(cfg: ServerConfig, dir: &Path) -> Served {
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
    Served { base, app, rt }
}

/// A served server with its data directory (a temporary one unless the test
/// chose its own), and the requests the tests make of it.
pub struct Server {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The server's state.
    pub app: Arc<App>,
    /// The temporary directory the data lives under, when the fixture made it.
    pub dir: Option<tempfile::TempDir>,
    /// The runtime the server runs on (the server stops with it).
    pub rt: tokio::runtime::Runtime,
}

/// Serves `config` (YAML) with its data in `dir`.
pub fn start_in(config: &str, dir: &Path) -> Server {
    let cfg = ServerConfig::from_yaml(config).expect("config");
    start_with(cfg, dir)
}

/// Serves `cfg` with its data in `dir`.
pub fn start_with(cfg: ServerConfig, dir: &Path) -> Server {
    let Served { base, app, rt } = serve(cfg, dir);
    Server {
        base,
        app,
        dir: None,
        rt,
    }
}

/// Serves `config` (YAML) with its data in a fresh temporary directory
/// (`<tmp>/data`), removed with the server.
pub fn start(config: &str) -> Server {
    let dir = tempfile::tempdir().expect("tmp");
    let mut s = start_in(config, &dir.path().join("data"));
    s.dir = Some(dir);
    s
}

/// The status and JSON body (null when not JSON) of a request, sent with
/// `body` as `(content type, text)` if any; a transport error fails the test,
/// and so does a request unanswered for a minute (a read stuck behind the
/// state lock, say) instead of hanging it.
pub fn call(req: ureq::Request, body: Option<(&str, &str)>) -> (u16, Value) {
    let req = req.timeout(Duration::from_secs(60));
    let r = match body {
        Some((ct, b)) => req.set("Content-Type", ct).send_string(b),
        None => req.call(),
    };
    answer(r)
}

/// The status and JSON body (null when not JSON) of an answer.
pub fn answer(r: Result<ureq::Response, ureq::Error>) -> (u16, Value) {
    match r {
        Ok(resp) => (resp.status(), resp.into_json().unwrap_or(Value::Null)),
        Err(ureq::Error::Status(code, resp)) => (code, resp.into_json().unwrap_or(Value::Null)),
        Err(e) => panic!("transport error (blocked on the state lock?): {e}"),
    }
}

impl Server {
    /// The temporary directory [`start`] made (its data is `<tmp>/data`).
    pub fn tmp(&self) -> &Path {
        self.dir.as_ref().expect("a temporary directory").path()
    }

    /// `GET path` with `token`.
    pub fn get(&self, path: &str, token: &str) -> (u16, Value) {
        call(
            ureq::get(&format!("{}{path}", self.base))
                .set("Authorization", &format!("Bearer {token}")),
            None,
        )
    }

    /// `POST path` with `token` and a `ct` body.
    pub fn post(&self, path: &str, token: &str, ct: &str, body: &str) -> (u16, Value) {
        call(
            ureq::post(&format!("{}{path}", self.base))
                .set("Authorization", &format!("Bearer {token}")),
            Some((ct, body)),
        )
    }

    /// Any request with raw bytes; the status and the body as text.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        token: &str,
        ct: &str,
        body: &[u8],
    ) -> (u16, String) {
        let r = ureq::request(method, &format!("{}{path}", self.base))
            .set("Authorization", &format!("Bearer {token}"))
            .set("Content-Type", ct)
            .send_bytes(body);
        match r {
            Ok(resp) => (resp.status(), resp.into_string().unwrap_or_default()),
            Err(ureq::Error::Status(code, resp)) => (code, resp.into_string().unwrap_or_default()),
            Err(e) => panic!("the server did not answer (crashed?): {e}"),
        }
    }

    /// Submits a YAML job spec with `token`.
    pub fn submit(&self, token: &str, yaml: &str) -> (u16, Value) {
        self.post("/v1/jobs", token, "application/yaml", yaml)
    }

    /// Registers `spec` with `token` (the join token, a node's or admin's).
    pub fn register_as(&self, token: &str, spec: &NodeSpec) -> (u16, Value) {
        self.post(
            "/v1/nodes",
            token,
            "application/json",
            &serde_json::to_string(spec).expect("json"),
        )
    }

    /// Waits (with a deadline, no fixed sleeps) until `f` holds for job
    /// `id`, read with `token`; `what` names the wait when it times out.
    pub fn wait_job_as(
        &self,
        token: &str,
        id: u64,
        what: &str,
        f: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (code, v) = self.get(&format!("/v1/jobs/{id}"), token);
            assert_eq!(code, 200, "GET job {id}: {v}");
            if f(&v) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for job {id} to {what}: {v}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// [`Server::wait_for`] without a name for the wait.
    pub fn wait_job(&self, id: u64, f: impl Fn(&Value) -> bool) -> Value {
        self.wait_for(id, "change", f)
    }

    /// Waits until `f` holds for job `id`, read as admin (`admin-secret`).
    pub fn wait_for(&self, id: u64, what: &str, f: impl Fn(&Value) -> bool) -> Value {
        self.wait_job_as("admin-secret", id, what, f)
    }
}
