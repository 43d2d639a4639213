//! Large batches written in transactions within the store's limits (etcd's
//! defaults: 128 operations, 1.5 MiB): a group commit and a scheduling cycle
//! split into chunks, and a cycle cut between two chunks (a crash, a lost
//! leadership) leaves a store that recovers without double-booking or a
//! lost job.

use gangway_core::{JobId, JobSpec, JobState, NodeSpec, QueueSpec};
use gangway_server::control::{Control, NewJob};
use gangway_server::nodes::Registrant;
use gangway_store::testing::EtcdProcess;
use gangway_store::{
    Compare, EtcdStore, Event, KeyValue, Op, RedbStore, Store, StoreError, TxnLimits, TxnResult,
};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

const NOW: u64 = 1_000;

/// A store with small transaction limits that fails every write after
/// `allow` more transactions (as a leader killed between two chunks).
/// Deferred transactions are counted and cut alike, and stay deferred in
/// the store beneath until a sync.
struct Cut<S> {
    inner: S,
    limits: TxnLimits,
    txns: AtomicUsize,
    allow: AtomicUsize,
}

impl<S> Cut<S> {
    /// Checks a transaction against the limits and the cut, and counts it.
    fn admit(&self, compares: &[Compare], ops: &[Op]) -> Result<(), StoreError> {
        assert!(
            compares.len() <= self.limits.max_compares,
            "too many compares"
        );
        assert!(ops.len() <= self.limits.max_ops, "too many operations");
        if self.allow.load(Ordering::SeqCst) == 0 {
            return Err(StoreError::Backend("cut".into()));
        }
        self.allow.fetch_sub(1, Ordering::SeqCst);
        self.txns.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl<S: Store> Store for Cut<S> {
    fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        self.inner.get(key)
    }
    fn range(&self, prefix: &str) -> Result<Vec<KeyValue>, StoreError> {
        self.inner.range(prefix)
    }
    fn txn(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError> {
        self.admit(compares, ops)?;
        self.inner.txn(compares, ops)
    }
    fn txn_deferred(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError> {
        self.admit(compares, ops)?;
        self.inner.txn_deferred(compares, ops)
    }
    fn sync(&self) -> Result<(), StoreError> {
        self.inner.sync()
    }
    fn revision(&self) -> Result<u64, StoreError> {
        self.inner.revision()
    }
    fn watch(
        &self,
        prefix: &str,
        from: u64,
    ) -> Result<std::sync::mpsc::Receiver<Event>, StoreError> {
        self.inner.watch(prefix, from)
    }
    fn compact(&self, revision: u64) -> Result<(), StoreError> {
        self.inner.compact(revision)
    }
    fn txn_limits(&self) -> TxnLimits {
        self.limits
    }
}

fn setup<S: Store>(store: S, nodes: usize) -> Control<S> {
    let gpus = nodes as u64 * 8;
    let mut c = Control::open(store, &[QueueSpec::gpus("q", None, gpus)]).expect("open");
    for i in 0..nodes {
        let spec = NodeSpec::uniform(&format!("n{i:03}"), "l0", "s0", 8, "H100", 80);
        c.register_node(spec, &Registrant::Admin, true, "join-secret", NOW)
            .expect("register");
    }
    c
}

fn jobs(n: usize, prefix: &str) -> Vec<NewJob> {
    (0..n)
        .map(|i| {
            let mut spec = JobSpec::new(&format!("{prefix}{i}"), "q", 1, 1);
            spec.user = "alice".into();
            let mut j = NewJob::new("alice", spec);
            j.key = Some(format!("alice:{prefix}{i}"));
            j
        })
        .collect()
}

/// Scheduled jobs, and a check that no GPU is held twice.
fn scheduled<S: Store>(c: &Control<S>) -> BTreeSet<JobId> {
    let mut held = BTreeSet::new();
    let mut out = BTreeSet::new();
    for (rec, _) in c.jobs.values() {
        if rec.state == JobState::Scheduled {
            out.insert(rec.id);
            for r in &rec.placement {
                for g in &r.gpus {
                    assert!(
                        held.insert((r.node.clone(), *g)),
                        "GPU {}:{g} double-booked",
                        r.node
                    );
                }
            }
        }
    }
    out
}

#[test]
fn a_cycle_cut_between_chunks_recovers_without_double_booking_or_loss() {
    let dir = tempfile::tempdir().expect("tmp");
    let redb = Arc::new(RedbStore::open(&dir.path().join("s.redb")).expect("redb"));
    let cut = Arc::new(Cut {
        inner: redb.clone(),
        limits: TxnLimits {
            max_compares: 7,
            max_ops: 8,
            max_bytes: usize::MAX,
        },
        txns: AtomicUsize::new(0),
        allow: AtomicUsize::new(usize::MAX),
    });
    let mut c = setup(cut.clone(), 10);
    // A group commit of 60 keyed jobs: 3 per transaction (1 + 2×3 compares).
    let before = cut.txns.load(Ordering::SeqCst);
    let ids: Vec<JobId> = c
        .submit_batch(jobs(60, "j"), NOW)
        .into_iter()
        .map(|r| r.expect("accepted"))
        .collect();
    assert_eq!(cut.txns.load(Ordering::SeqCst) - before, 20, "chunks of 3");
    assert_eq!(
        ids.iter().collect::<BTreeSet<_>>().len(),
        60,
        "distinct ids"
    );
    assert_eq!(ids.first(), Some(&JobId(1)));
    assert_eq!(ids.last(), Some(&JobId(60)));
    // The cycle binds 60 jobs, 7 per transaction; the leader dies after 4.
    cut.allow.store(4, Ordering::SeqCst);
    c.cycle(NOW).expect_err("cut between chunks");
    let landed = scheduled(&c);
    let n = landed.len() as u64;
    assert!(
        n > 0 && n < 60 && n.is_multiple_of(7),
        "whole chunks of 7 landed: {n}"
    );
    assert_eq!(
        c.cluster.free_gpus(),
        80 - n,
        "what landed is applied in memory"
    );
    // A new leader loads what landed from the file (the cycle committed
    // deferred and synced what landed before failing): the same jobs
    // bound, none lost.
    drop((c, cut, redb));
    let redb = Arc::new(RedbStore::open(&dir.path().join("s.redb")).expect("reopen redb"));
    let mut d = Control::open(redb.clone(), &[QueueSpec::gpus("q", None, 80)]).expect("reopen");
    assert_eq!(scheduled(&d), landed);
    assert_eq!(d.jobs.len(), 60);
    assert_eq!(d.cluster.free_gpus(), 80 - n);
    // Its next cycle binds the rest, on other GPUs.
    d.cycle(NOW + 1).expect("cycle");
    assert_eq!(scheduled(&d).len(), 60);
    // A retried submission finds its job again.
    let again = d.submit_batch(jobs(1, "j"), NOW + 2);
    assert_eq!(again[0].as_ref().ok(), Some(&JobId(1)));
}

#[test]
fn a_group_commit_cut_between_chunks_keeps_whole_jobs_and_their_keys() {
    let dir = tempfile::tempdir().expect("tmp");
    let redb = Arc::new(RedbStore::open(&dir.path().join("s.redb")).expect("redb"));
    let cut = Arc::new(Cut {
        inner: redb.clone(),
        limits: TxnLimits {
            max_compares: 7,
            max_ops: 8,
            max_bytes: usize::MAX,
        },
        txns: AtomicUsize::new(0),
        allow: AtomicUsize::new(usize::MAX),
    });
    let mut c = setup(cut.clone(), 1);
    cut.allow.store(2, Ordering::SeqCst);
    let r = c.submit_batch(jobs(10, "k"), NOW);
    // Two chunks of 3 landed and are acknowledged; the rest are refused.
    assert_eq!(r.iter().filter(|r| r.is_ok()).count(), 6);
    assert!(r[..6].iter().all(Result::is_ok) && r[6..].iter().all(Result::is_err));
    cut.allow.store(usize::MAX, Ordering::SeqCst);
    let mut d = Control::open(redb.clone(), &[QueueSpec::gpus("q", None, 8)]).expect("reopen");
    assert_eq!(d.jobs.len(), 6);
    // The client retries all ten with their keys: six found, four new.
    let r = d.submit_batch(jobs(10, "k"), NOW + 1);
    let ids: Vec<u64> = r.into_iter().map(|r| r.expect("accepted").0).collect();
    assert_eq!(ids, (1..=10).collect::<Vec<_>>());
    assert_eq!(d.jobs.len(), 10);
}

#[test]
fn etcd_with_default_flags_takes_a_large_group_commit_and_cycle() {
    let Some(e) = EtcdProcess::start() else {
        return;
    };
    let etcd = EtcdStore::connect(std::slice::from_ref(&e.endpoint), "/chunks").expect("etcd");
    // Fenced, as a leader's writes are.
    let rev = etcd.put("/leader", b"me").expect("leader");
    etcd.fence(Some(("/leader", rev as i64)));
    let mut c = setup(etcd.clone(), 50);
    let r = c.submit_batch(jobs(1000, "e"), NOW);
    assert!(
        r.iter().all(Result::is_ok),
        "{:?}",
        r.iter().find(|r| r.is_err())
    );
    let d = c.cycle(NOW).expect("cycle on default etcd");
    assert_eq!(d.binds.len(), 400, "every GPU bound");
    let again = Control::open(etcd.clone(), &[QueueSpec::gpus("q", None, 400)]).expect("reopen");
    assert_eq!(again.jobs.len(), 1000);
    assert_eq!(scheduled(&again).len(), 400);
}
