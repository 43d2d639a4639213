//! What the server's HTTP tests share: the real server, in process, on a
//! loopback port.

use gangway_server::api::App;
use gangway_server::ServerConfig;
use std::path::Path;
use std::sync::Arc;

/// A server serving on loopback from its own runtime (dropped with it).
pub struct Served {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The server's state, for tests that reach behind the API (each test
    /// crate compiles this module; not all of them read it).
    #[allow(dead_code)]
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
