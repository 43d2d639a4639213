//! Gangway's control plane: a durable job lifecycle on `gangway-store`, a
//! scheduler loop that runs `gangway-sched` on change and at least every
//! second, an HTTP+JSON API with bearer-token auth, and Prometheus metrics.

pub mod admission;
pub mod attempt;
pub mod audit;
pub mod authz;
pub mod backup;
pub mod blame;
pub mod clock;
pub mod config;
pub mod control;
pub mod control_error;
pub mod counted_store;
pub mod ha;
pub mod heartbeats;
pub mod history;
pub mod http;
pub mod limits;
pub mod lock;
pub mod metrics;
pub mod nodes;
pub mod parts;
pub mod policy;
pub mod probation;
pub mod records;
pub mod reservations;
pub mod retention;
pub mod spec_parse;
pub mod view;
pub mod workflow;
pub mod yaml;

pub use config::ServerConfig;

use control::Control;
use gangway_store::{RedbStore, Store};
use http::common::App;
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
    /// The store's schema version, or a backup.
    #[error(transparent)]
    Backup(#[from] backup::BackupError),
    /// The stored scheduling policy.
    #[error(transparent)]
    Policy(#[from] policy::PolicyError),
}

/// The store behind the server: redb or etcd, chosen at start.
pub type SharedStore = Arc<dyn Store>;

/// Creates `dir` (and parents) readable by its owner only: the store and
/// the audit log hold what other local users must not read.
pub fn private_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// Opens the data dir (the embedded redb store, mode 0600, and the audit
/// log) and builds the shared state of a single server, which always leads.
pub fn open(cfg: ServerConfig, data_dir: &Path) -> Result<Arc<App>, ServeError> {
    private_dir(data_dir)?;
    let path = data_dir.join("gangway.redb");
    let store = RedbStore::open(&path)?;
    backup::prepare(&store, Some(data_dir), clock::now())?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    }
    let audit = audit::AuditLog::open(&data_dir.join("audit.log"))?;
    let app = open_with_audit(cfg, Arc::new(store), ha::Role::Leader, audit)?;
    let _ = app.export_dir.set(data_dir.join("history"));
    Ok(app)
}

/// Builds the shared state on `store`, starting in `role` (a replica on etcd
/// starts as a follower until the election says otherwise), with the audit
/// log kept in memory.
pub fn open_with(
    cfg: ServerConfig,
    store: SharedStore,
    role: ha::Role,
) -> Result<Arc<App>, ServeError> {
    open_with_audit(cfg, store, role, audit::AuditLog::memory())
}

/// [`open_with`] with an audit log of the caller's choosing.
pub fn open_with_audit(
    cfg: ServerConfig,
    store: SharedStore,
    role: ha::Role,
    audit: audit::AuditLog,
) -> Result<Arc<App>, ServeError> {
    backup::prepare(&*store, None, clock::now())?;
    let metrics = metrics::Metrics::new();
    let store: SharedStore = Arc::new(counted_store::CountedStore::new(
        store,
        metrics.store_txns.clone(),
        metrics.store_ops.clone(),
    ));
    let mut control = Control::open_configured(store.clone(), &cfg)?;
    let policy = policy::load_or_seed(&mut control, &cfg, clock::now())?;
    let live = policy::Live::new(&cfg);
    live.set(&policy);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    Ok(Arc::new(App {
        store,
        tokens: authz::ConfigTokens::new(&cfg),
        rate: limits::RateLimiter::default(),
        audit,
        metrics_at: std::sync::atomic::AtomicU64::new(0),
        control: lock::StateLock::new(control),
        cfg,
        metrics,
        wake: tokio::sync::Notify::new(),
        submissions: tx,
        submissions_rx: Mutex::new(Some(rx)),
        role: std::sync::RwLock::new(role),
        fenced: std::sync::atomic::AtomicBool::new(false),
        history: Mutex::new(http::dashboard::QueueHistory::default()),
        policy: live,
        watch: policy::watch::Watch::new(),
        export_dir: std::sync::OnceLock::new(),
    }))
}

/// Whether this replica leads.
pub fn is_leader(app: &App) -> bool {
    app.role
        .read()
        .map(|r| *r == ha::Role::Leader)
        .unwrap_or(false)
}

/// Shortest time between the end of one cycle and the start of the next:
/// changes arriving meanwhile (group commits, syncs) share one cycle instead
/// of each taking the state lock for a cycle of its own (`bench cluster`
/// saw ~95 cycles a second at 1,000 nodes without it).
const MIN_CYCLE_GAP: Duration = Duration::from_millis(20);

/// Seconds between two retention passes of the leader.
const RETENTION_EVERY: u64 = 60;

/// Runs the scheduler loop forever: a cycle on every change and at least every `cycle_seconds`.
pub async fn scheduler_loop(app: Arc<App>) {
    let period = Duration::from_secs(app.cfg.cycle_seconds.max(1));
    let mut retained_at = clock::now();
    let mut compactor = retention::Compactor::default();
    loop {
        let _ = tokio::time::timeout(period, app.wake.notified()).await;
        // Let a burst of changes gather (a wake during the gap is kept).
        tokio::time::sleep(MIN_CYCLE_GAP).await;
        if !is_leader(&app) {
            continue;
        }
        if clock::now() >= retained_at.saturating_add(RETENTION_EVERY) {
            retained_at = clock::now();
            let app2 = app.clone();
            let mut comp = std::mem::take(&mut compactor);
            let r = tokio::task::spawn_blocking(move || {
                let now = clock::now();
                let removed = retention::pass(
                    &app2.control,
                    &app2.cfg.retention,
                    app2.export_dir.get().map(|p| p.as_path()),
                    now,
                );
                let started = Instant::now();
                match retention::compact_history(&*app2.store, &app2.cfg.retention, &mut comp, now)
                {
                    Ok(Some(rev)) => {
                        app2.metrics.store_compactions.inc();
                        app2.metrics
                            .store_compacted_revision
                            .set(i64::try_from(rev).unwrap_or(i64::MAX));
                        tracing::info!(
                            "store history compacted to revision {rev} in {} ms",
                            started.elapsed().as_millis()
                        )
                    }
                    Ok(None) => {}
                    Err(e) => tracing::warn!("store compaction failed: {e}"),
                }
                (removed, comp)
            })
            .await;
            let r = r.map(|(removed, comp)| {
                compactor = comp;
                removed
            });
            match r {
                Ok(Ok(n)) if n.jobs + n.keys > 0 => tracing::info!(
                    "retention: removed {} finished jobs (exported first) and {} idempotency keys",
                    n.jobs,
                    n.keys
                ),
                Ok(Err(e)) => tracing::warn!("retention pass failed: {e}"),
                _ => {}
            }
        }
        let start = Instant::now();
        let now = clock::now();
        // The cycle runs on the blocking pool: the async workers stay free
        // for heartbeats and requests while it computes.
        let app2 = app.clone();
        let result = tokio::task::spawn_blocking(move || {
            let app = app2;
            let mut c = app.control.lock_as(view::Holder::Cycle).ok()?;
            let expired = c.expire_grace(
                now,
                app.cfg.max_grace_seconds,
                app.cfg.grace_kill_margin_seconds,
            );
            let r = expired.and_then(|_| c.cycle_deferred(now));
            let decided = c.store_handle();
            // Taken here, encoded and written once the lock is released.
            let predictor = c.predictor_save(now).map(|p| (p, c.store_handle()));
            policy::tick(&c, now);
            // The policy figures every 15 s: the policy version and the
            // predictor read under the lock, the jobs walked in the view
            // after it is released. The job and GPU gauges are read from the
            // view by each scrape.
            let at = &app.metrics_at;
            let mut watch = None;
            if at.load(std::sync::atomic::Ordering::Relaxed) < now {
                at.store(now, std::sync::atomic::Ordering::Relaxed);
                if app.watch.due(now) {
                    watch = Some(policy::watch::Watch::inputs(&c));
                }
            }
            drop(c);
            // The cycle's decisions were committed deferred: durable now,
            // with the lock released (see `Control::cycle_deferred`), even
            // after a failure (what landed before it is applied).
            let synced = decided.sync();
            let r = r.and_then(|d| synced.map(|()| d).map_err(Into::into));
            if let Some((save, store)) = predictor {
                // Its own thread: the next cycle does not wait for it.
                std::thread::spawn(move || save.write(&store));
            }
            if let Some(inputs) = watch {
                let v = app.control.view();
                let queues: Vec<&str> = v
                    .cluster
                    .queues
                    .iter()
                    .map(|q| q.spec.name.as_str())
                    .collect();
                app.watch.apply(&app.cfg, inputs, &v.jobs, &queues, now);
            }
            Some(r)
        })
        .await;
        let Ok(Some(result)) = result else { return };
        app.metrics
            .cycle_seconds
            .observe(start.elapsed().as_secs_f64());
        http::dashboard::record(&app, clock::now());
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
pub async fn serve_replica<L>(
    app: Arc<App>,
    listener: L,
    etcd: gangway_store::EtcdStore,
    advertise: String,
) -> Result<(), ServeError>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    ha::spawn_elector(app.clone(), etcd, advertise);
    serve_on(app, listener).await
}

/// `/metrics` alone, without a token, for a separate listen address that
/// only the monitoring network reaches (`gangway server --metrics-listen`).
pub fn metrics_router(app: Arc<App>) -> axum::Router {
    axum::Router::new().route(
        "/metrics",
        axum::routing::get(move |headers: axum::http::HeaderMap| {
            let app = app.clone();
            async move {
                let format = metrics::Format::negotiate(
                    headers
                        .get(axum::http::header::ACCEPT)
                        .and_then(|v| v.to_str().ok()),
                );
                (
                    [(axum::http::header::CONTENT_TYPE, format.content_type())],
                    http::ops::render(&app, format),
                )
            }
        }),
    )
}

/// Serves [`metrics_router`] on `listener` until the process ends.
pub async fn serve_metrics(
    app: Arc<App>,
    listener: tokio::net::TcpListener,
) -> Result<(), ServeError> {
    axum::serve(listener, metrics_router(app)).await?;
    Ok(())
}

/// Serves the API on `listener` and runs the scheduler loop until the process ends.
pub async fn serve(app: Arc<App>, listener: tokio::net::TcpListener) -> Result<(), ServeError> {
    serve_on(app, listener).await
}

static HTTP: std::sync::OnceLock<ureq::Agent> = std::sync::OnceLock::new();

/// Sets the client the server uses to reach agents' log endpoints and other
/// replicas (one that trusts the cluster's CA when they serve TLS); once per
/// process.
pub fn set_http_client(agent: ureq::Agent) {
    let _ = HTTP.set(agent);
}

/// The client for agents and replicas: the one given to [`set_http_client`],
/// else a plain one. Neither follows redirects: the server only talks to the
/// registered addresses of its nodes and replicas.
pub fn http() -> ureq::Agent {
    HTTP.get()
        .cloned()
        .unwrap_or_else(|| ureq::AgentBuilder::new().redirects(0).build())
}

/// [`serve`] on any listener, such as a TLS one.
pub async fn serve_on<L>(app: Arc<App>, listener: L) -> Result<(), ServeError>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    tokio::spawn(scheduler_loop(app.clone()));
    let rx = app.submissions_rx.lock().ok().and_then(|mut g| g.take());
    if let Some(rx) = rx {
        tokio::spawn(http::jobs::group_commit(Arc::downgrade(&app), rx));
    }
    axum::serve(listener, http::router(app)).await?;
    Ok(())
}
