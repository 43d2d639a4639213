//! Gangway's control plane: a durable job lifecycle on `gangway-store`, a
//! scheduler loop that runs `gangway-sched` on change and at least every
//! second, an HTTP+JSON API with bearer-token auth, and Prometheus metrics.

pub mod api;
pub mod config;
pub mod control;
pub mod metrics;
pub mod openapi;
pub mod records;

pub use config::ServerConfig;

use api::App;
use control::Control;
use gangway_store::RedbStore;
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

/// Opens the data dir and builds the shared state.
pub fn open(cfg: ServerConfig, data_dir: &Path) -> Result<Arc<App>, ServeError> {
    std::fs::create_dir_all(data_dir)?;
    let store = RedbStore::open(&data_dir.join("gangway.redb"))?;
    let mut control = Control::open(store, &cfg.queues)?;
    control.lifecycle = cfg.lifecycle();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    Ok(Arc::new(App {
        control: Mutex::new(control),
        cfg,
        metrics: metrics::Metrics::new(),
        wake: tokio::sync::Notify::new(),
        submissions: tx,
        submissions_rx: Mutex::new(Some(rx)),
    }))
}

/// Runs the scheduler loop forever: a cycle on every change and at least every `cycle_seconds`.
pub async fn scheduler_loop(app: Arc<App>) {
    let period = Duration::from_secs(app.cfg.cycle_seconds.max(1));
    loop {
        let _ = tokio::time::timeout(period, app.wake.notified()).await;
        let start = Instant::now();
        let result = match app.control.lock() {
            Ok(mut c) => c.cycle(api::now()),
            Err(_) => return,
        };
        app.metrics
            .cycle_seconds
            .observe(start.elapsed().as_secs_f64());
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
            Err(e) => tracing::error!("scheduling cycle failed: {e}"),
        }
    }
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
