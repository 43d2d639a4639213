//! Several server replicas on one etcd: every replica serves the API, and
//! exactly one — the holder of the leader key, bound to an etcd lease — runs
//! the scheduler loop, the node lifecycle and every write. Followers forward
//! requests to the leader. A leader that loses its lease stops at once, and
//! its store is fenced (see [`gangway_store::EtcdStore::fence`]): even a write
//! already under way when the lease ran out fails with `NotLeader` instead of
//! landing beside the new leader's.

use crate::control::Control;
use crate::http::common::App;
pub use crate::http::common::Role;
use crate::SharedStore;
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
use gangway_store::EtcdStore;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The store key of the leader record (its value is the leader's URL).
pub const LEADER_KEY: &str = "/leader";

/// Seconds a leader's lease lives without a keep-alive: failover takes about this long.
pub const LEASE_TTL: i64 = 2;

fn set_role(app: &App, role: Role) {
    if let Ok(mut r) = app.role.write() {
        if *r != role {
            tracing::info!("role: {role:?}");
            *r = role;
        }
    }
}

/// Runs the election forever on a thread of its own.
pub fn spawn_elector(app: Arc<App>, etcd: EtcdStore, advertise: String) {
    let spawned = std::thread::Builder::new()
        .name("gangway-elector".into())
        .spawn(move || loop {
            match campaign(&app, &etcd, &advertise) {
                Ok(()) => {}
                Err(e) => {
                    tracing::warn!("election: {e}");
                    set_role(&app, Role::Follower(None));
                    std::thread::sleep(Duration::from_millis(300));
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start the elector: {e}");
    }
}

/// One round: try to become leader; lead until the lease is lost, or follow
/// until the leader key disappears.
fn campaign(app: &Arc<App>, etcd: &EtcdStore, advertise: &str) -> Result<(), String> {
    let key = etcd.full_key(LEADER_KEY);
    let mut client = etcd.client();
    let lease = etcd
        .block_on(async move { client.lease_grant(LEASE_TTL, None).await })
        .map_err(|e| e.to_string())?
        .id();
    let txn = Txn::new()
        .when(vec![Compare::create_revision(
            key.clone(),
            CompareOp::Equal,
            0,
        )])
        .and_then(vec![TxnOp::put(
            key.clone(),
            advertise.as_bytes().to_vec(),
            Some(PutOptions::new().with_lease(lease)),
        )])
        .or_else(vec![TxnOp::get(key.clone(), None)]);
    let mut client = etcd.client();
    let r = etcd
        .block_on(async move { client.txn(txn).await })
        .map_err(|e| e.to_string())?;
    if !r.succeeded() {
        let mut client = etcd.client();
        let _ = etcd.block_on(async move { client.lease_revoke(lease).await });
        let leader = r.op_responses().into_iter().find_map(|op| match op {
            TxnOpResponse::Get(g) => g
                .kvs()
                .first()
                .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
            _ => None,
        });
        set_role(app, Role::Follower(leader.filter(|l| l != advertise)));
        std::thread::sleep(Duration::from_millis(200));
        return Ok(());
    }
    let created = r.header().map_or(0, |h| h.revision());
    etcd.fence(Some((LEADER_KEY, created)));
    // Load everything the previous leader wrote; only then act.
    let store: SharedStore = Arc::new(crate::counted_store::CountedStore::new(
        etcd.clone(),
        app.metrics.store_txns.clone(),
        app.metrics.store_ops.clone(),
    ));
    let mut control = Control::open(store, &app.cfg.queues).map_err(|e| e.to_string())?;
    control.lifecycle = app.cfg.lifecycle();
    control.blame = crate::blame::Blame::new(app.cfg.blame());
    control.probation = crate::probation::Probation::new(app.cfg.probation());
    control.cycle_seconds = app.cfg.cycle_seconds;
    let policy = crate::policy::load_or_seed(&mut control, &app.cfg, crate::clock::now())
        .map_err(|e| e.to_string())?;
    app.policy.set(&policy);
    match app.control.lock() {
        Ok(mut c) => *c = control,
        Err(_) => return Err("state lock poisoned".into()),
    }
    set_role(app, Role::Leader);
    app.wake.notify_one();
    tracing::info!("leading (leader key created at revision {created})");
    let ok = keep_alive(app, etcd, lease);
    set_role(app, Role::Follower(None));
    tracing::warn!("lost leadership ({ok})");
    let mut client = etcd.client();
    let _ = etcd.block_on(async move { client.lease_revoke(lease).await });
    Ok(())
}

/// Keeps the lease alive until it cannot be, or the scheduler saw that this
/// replica was fenced. Returns why it stopped.
fn keep_alive(app: &App, etcd: &EtcdStore, lease: i64) -> String {
    let mut client = etcd.client();
    let Ok((mut keeper, mut stream)) =
        etcd.block_on(async move { client.lease_keep_alive(lease).await })
    else {
        return "no keep-alive stream".into();
    };
    let mut last_ok = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(400));
        if app.fenced.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return "a write was fenced".into();
        }
        let r = etcd.block_on(async move {
            let r = tokio::time::timeout(Duration::from_millis(800), async {
                keeper.keep_alive().await?;
                stream.message().await
            })
            .await;
            (keeper, stream, r)
        });
        keeper = r.0;
        stream = r.1;
        match r.2 {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => last_ok = Instant::now(),
            Ok(Ok(Some(_))) => return "lease expired".into(),
            _ => {
                // etcd briefly unreachable: the lease may still hold; give up
                // only when it surely expired.
                if last_ok.elapsed() >= Duration::from_secs(LEASE_TTL as u64) {
                    return "etcd unreachable for a whole lease".into();
                }
            }
        }
    }
}
