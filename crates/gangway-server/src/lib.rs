//! Gangway's control plane: a durable job lifecycle on `gangway-store`, a
//! scheduler loop that runs `gangway-sched` on change and at least every
//! second, an HTTP+JSON API with bearer-token auth, and Prometheus metrics.

pub mod api;
pub mod config;
pub mod control;
pub mod dashboard;
pub mod ha;
pub mod metrics;
pub mod openapi;
pub mod records;

pub use config::ServerConfig;

use api::App;
use control::Control;
use gangway_store::{RedbStore, Store};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Why the server could not start.
#[derive(Debug, Error)]
pub enum ServeError {
    /// Store.
    #[error(transparent)]
    Store(#[from] gangway_store::StoreError),
    /// Loading state.
    #[error(transparent)]
    Control(#[from] control::ControlError),
    /// Network.
    #[error("serving: {0}")]
    Io(#[from] std::io::Error),
}

/// The store behind the server: redb or etcd, chosen at start.
pub type SharedStore = Arc<dyn Store>;

/// Opens the data dir (the embedded redb store) and builds the shared state
/// of a single server, which always leads.
pub fn open(cfg: ServerConfig, data_dir: &Path) -> Result<Arc<App>, ServeError> {
    std::fs::create_dir_all(data_dir)?;
    let store = RedbStore::open(&data_dir.join("gangway.redb"))?;
    open_with(cfg, Arc::new(store), ha::Role::Leader)
}

/// Builds the shared state on `store`, starting in `role` (a replica on etcd
/// starts as a follower until the election says otherwise).
pub fn open_with(
    cfg: ServerConfig,
    store: SharedStore,
    role: ha::Role,
) -> Result<Arc<App>, ServeError> {
    let mut control = Control::open(store, &cfg.queues)?;
    control.lifecycle = cfg.lifecycle();
    control.contract = cfg.contract();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    Ok(Arc::new(App {
        control: Mutex::new(control),
        cfg,
        metrics: metrics::Metrics::new(),
        wake: tokio::sync::Notify::new(),
        submissions: tx,
        submissions_rx: Mutex::new(Some(rx)),
        role: std::sync::RwLock::new(role),
        fenced: std::sync::atomic::AtomicBool::new(false),
        history: Mutex::new(dashboard::QueueHistory::default()),
    }))
}

/// Whether this replica leads.
pub fn is_leader(app: &App) -> bool {
    app.role
        .read()
        .map(|r| *r == ha::Role::Leader)
        .unwrap_or(false)
}

/// Runs the scheduler loop forever: a cycle on every change and at least every `cycle_seconds`.
pub async fn scheduler_loop(app: Arc<App>) {
    let period = Duration::from_secs(app.cfg.cycle_seconds.max(1));
    loop {
        let _ = tokio::time::timeout(period, app.wake.notified()).await;
        if !is_leader(&app) {
            continue;
        }
        let start = Instant::now();
        let result = match app.control.lock() {
            Ok(mut c) => c.cycle(api::now()),
            Err(_) => return,
        };
        app.metrics
            .cycle_seconds
            .observe(start.elapsed().as_secs_f64());
        dashboard::record(&app, api::now());
        match result {
            Ok(d) => {
                use metrics::DecisionLabels;
                let m = &app.metrics.decisions;
                m.get_or_create(&DecisionLabels {
                    kind: "bind".into(),
                })
                .inc_by(d.binds.len() as u64);
                m.get_or_create(&DecisionLabels {
                    kind: "preempt".into(),
                })
                .inc_by(d.preemptions.len() as u64);
            }
            Err(control::ControlError::Store(gangway_store::StoreError::NotLeader)) => {
                // Fenced: another replica leads now. Stop at once.
                app.fenced.store(true, std::sync::atomic::Ordering::SeqCst);
                if let Ok(mut r) = app.role.write() {
                    *r = ha::Role::Follower(None);
                }
            }
            Err(e) => tracing::error!("scheduling cycle failed: {e}"),
        }
    }
}

/// Serves the API as one replica of several on etcd: the election decides
/// whether this one schedules; followers forward requests to the leader.
pub async fn serve_replica(
    app: Arc<App>,
    listener: tokio::net::TcpListener,
    etcd: gangway_store::EtcdStore,
    advertise: String,
) -> Result<(), ServeError> {
    ha::spawn_elector(app.clone(), etcd, advertise);
    serve(app, listener).await
}

/// Serves the API on `listener` and runs the scheduler loop until the process ends.
pub async fn serve(app: Arc<App>, listener: tokio::net::TcpListener) -> Result<(), ServeError> {
    tokio::spawn(scheduler_loop(app.clone()));
    let rx = app.submissions_rx.lock().ok().and_then(|mut g| g.take());
    if let Some(rx) = rx {
        tokio::spawn(api::group_commit(Arc::downgrade(&app), rx));
    }
    axum::serve(listener, api::router(app)).await?;
    Ok(())
}
