//! What the benchmarks share: a deterministic generator, the Philly job-size
//! mix, percentiles, the `gangway` binary the whole-server benchmarks start,
//! and the in-process server the client-loop benchmarks drive.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// SplitMix64: a tiny deterministic generator, enough for synthetic workloads.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// GPU counts of the Philly trace and how many jobs asked for each.
const PHILLY_SIZES: [(u32, u64); 10] = [
    (1, 76_627),
    (2, 1_818),
    (4, 1_870),
    (8, 1_643),
    (12, 7),
    (16, 199),
    (24, 7),
    (32, 67),
    (64, 6),
    (128, 3),
];

/// A GPU count drawn from the Philly trace's job-size mix.
pub(crate) fn philly_gpus(rng: &mut Rng) -> u32 {
    let total: u64 = PHILLY_SIZES.iter().map(|(_, n)| n).sum();
    let mut x = rng.next() % total;
    for (g, n) in PHILLY_SIZES {
        if x < n {
            return g;
        }
        x -= n;
    }
    1
}

/// The `p` quantile (0 to 1) of ascending `sorted` values, nearest rank; 0
/// when there are none. Every bench reports its percentiles with this.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// The `gangway` binary the benchmarks that need a real server start:
/// `$GANGWAY_BIN`, else the `gangway` beside this binary (cargo builds both
/// into the same target directory).
pub(crate) fn gangway_exe() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("GANGWAY_BIN") {
        return Ok(PathBuf::from(p));
    }
    let me = std::env::current_exe()?;
    let beside = me.with_file_name("gangway");
    if !beside.is_file() {
        bail!(
            "{} not found: build it first (`cargo build --release -p gangway`) or set GANGWAY_BIN",
            beside.display()
        );
    }
    Ok(beside)
}

/// A server in this process on a loopback port, on redb in its data
/// directory, with one 8-GPU node registered so that 1-GPU jobs are
/// admissible (no agent runs, so nothing starts): what the benchmarks that
/// time client loops against the API (`api`, `slurm`) start with.
pub(crate) struct LocalServer {
    /// The server's state, to fill or count what it stores directly.
    pub(crate) app: Arc<gangway_server::http::common::App>,
    /// Its address, `http://127.0.0.1:PORT`.
    pub(crate) base: String,
    /// The runtime serving it: the server stops when this is dropped.
    _rt: tokio::runtime::Runtime,
}

/// Starts a [`LocalServer`] with the server configuration `config` (YAML)
/// on `data_dir`, registering its node with `agent_token` (the config's).
pub(crate) fn local_server(
    config: &str,
    data_dir: &Path,
    agent_token: &str,
) -> Result<LocalServer> {
    let cfg = gangway_server::ServerConfig::from_yaml(config)?;
    let app = gangway_server::open(cfg, data_dir)?;
    let served = app.clone();
    let rt = tokio::runtime::Runtime::new()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let base = format!("http://{}", listener.local_addr()?);
    rt.spawn(async move {
        let _ = gangway_server::serve(served, listener).await;
    });
    let node = serde_json::to_string(&gangway_core::NodeSpec::uniform(
        "bench-node",
        "l0",
        "s0",
        8,
        "H100",
        80,
    ))?;
    ureq::post(&format!("{base}/v1/nodes"))
        .set("Authorization", &format!("Bearer {agent_token}"))
        .set("Content-Type", "application/json")
        .send_string(&node)
        .context("registering the node")?;
    Ok(LocalServer { app, base, _rt: rt })
}
