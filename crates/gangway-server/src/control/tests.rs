//! Tests of the coordinator's operations across its parts.

use super::*;
use crate::parts::ranking::PREDICTOR_SAVE_SECONDS;
use gangway_store::RedbStore;
use std::collections::BTreeSet;

/// A control on `store` with queue `q` and node `n` (4 GPUs) registered at `at`.
fn one_node<S: Store>(store: S, at: Time) -> Control<S> {
    let mut c =
        Control::open(store, &[gangway_core::QueueSpec::unlimited("q", None)]).expect("control");
    c.register_node(
        NodeSpec::uniform("n", "leaf0", "spine0", 4, "H100", 80),
        &crate::nodes::Registrant::Join,
        true,
        "join",
        at,
    )
    .expect("node");
    c
}

fn one_node_running_job(grace: u64) -> (tempfile::TempDir, Control<RedbStore>, JobId) {
    let dir = tempfile::tempdir().expect("tmp");
    let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
    let mut c = one_node(store, 0);
    let mut spec = JobSpec::new("j", "q", 2, 2);
    spec.checkpoint.grace_seconds = grace;
    let id = c.submit("alice", spec, 0).expect("submit");
    c.cycle(1).expect("cycle");
    c.report("n", id, Some(0), Report::Running, 2)
        .expect("running");
    assert_eq!(c.jobs[&id].0.state, JobState::Running);
    (dir, c, id)
}

/// A redb store with etcd's default limits whose deferred
/// transactions are counted and can be made to fail.
struct Flaky {
    inner: RedbStore,
    fail: std::sync::atomic::AtomicBool,
    sent: std::sync::atomic::AtomicUsize,
    seq_reads: std::sync::atomic::AtomicUsize,
}

impl Store for Flaky {
    fn get(&self, key: &str) -> Result<Option<gangway_store::KeyValue>, StoreError> {
        if key == JOB_SEQ {
            self.seq_reads
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        self.inner.get(key)
    }
    fn range(&self, prefix: &str) -> Result<Vec<gangway_store::KeyValue>, StoreError> {
        self.inner.range(prefix)
    }
    fn txn(
        &self,
        compares: &[Compare],
        ops: &[Op],
    ) -> Result<gangway_store::TxnResult, StoreError> {
        self.inner.txn(compares, ops)
    }
    fn txns_deferred(
        &self,
        txns: &[(Vec<Compare>, Vec<Op>)],
    ) -> Vec<Result<gangway_store::TxnResult, StoreError>> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.fail.load(SeqCst) {
            return txns
                .iter()
                .map(|_| Err(StoreError::Backend("down".into())))
                .collect();
        }
        let limits = gangway_store::TxnLimits::ETCD_DEFAULT;
        assert!(txns
            .iter()
            .all(|(c, o)| c.len() <= limits.max_compares && o.len() <= limits.max_ops));
        self.sent.fetch_add(txns.len(), SeqCst);
        self.inner.txns_deferred(txns)
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
    ) -> Result<std::sync::mpsc::Receiver<gangway_store::Event>, StoreError> {
        self.inner.watch(prefix, from)
    }
    fn compact(&self, revision: u64) -> Result<(), StoreError> {
        self.inner.compact(revision)
    }
    fn txn_limits(&self) -> gangway_store::TxnLimits {
        gangway_store::TxnLimits::ETCD_DEFAULT
    }
}

/// The job sequence counter is read from the store once, then known
/// (one round trip per submitted batch on etcd, not two); a counter
/// changed behind the leader's back fails the batch's compare, is read
/// again, and no id is reused.
#[test]
fn the_job_sequence_is_read_once_and_again_only_when_it_changed_elsewhere() {
    use std::sync::atomic::Ordering::SeqCst;
    let dir = tempfile::tempdir().expect("tmp");
    let store = std::sync::Arc::new(Flaky {
        inner: RedbStore::open(&dir.path().join("s.redb")).expect("store"),
        fail: false.into(),
        sent: 0.into(),
        seq_reads: 0.into(),
    });
    let mut c = one_node(store.clone(), 0);
    let submit = |c: &mut Control<_>, i: u32| {
        c.submit("alice", JobSpec::new(&format!("j{i}"), "q", 1, 1), 0)
            .expect("submit")
    };
    let ids: Vec<JobId> = (0..5).map(|i| submit(&mut c, i)).collect();
    assert_eq!(ids, (1..=5).map(JobId).collect::<Vec<_>>());
    assert!(store.seq_reads.load(SeqCst) <= 1);
    store.put(JOB_SEQ, &encode(&1000u64)).expect("put");
    let reads = store.seq_reads.load(SeqCst);
    assert_eq!(submit(&mut c, 5), JobId(1001));
    assert_eq!(store.seq_reads.load(SeqCst), reads + 1);
    assert_eq!(submit(&mut c, 6), JobId(1002));
    assert_eq!(store.seq_reads.load(SeqCst), reads + 1);
}

/// Deferred job writes stay in memory until the flush, which writes
/// each changed record once (its latest), in transactions within
/// etcd's limits; a failed flush writes nothing, keeps them for the
/// next, and the revisions kept in memory stay those the store holds
/// (a later compare-and-swap write succeeds).
#[test]
fn deferred_job_writes_land_once_each_at_the_flush_and_survive_a_failed_one() {
    use std::sync::atomic::Ordering::SeqCst;
    let dir = tempfile::tempdir().expect("tmp");
    let store = std::sync::Arc::new(Flaky {
        inner: RedbStore::open(&dir.path().join("s.redb")).expect("store"),
        fail: false.into(),
        sent: 0.into(),
        seq_reads: 0.into(),
    });
    let mut c = one_node(store.clone(), 0);
    let ids: Vec<JobId> = (0..300)
        .map(|i| {
            c.submit("alice", JobSpec::new(&format!("j{i}"), "q", 1, 1), 0)
                .expect("submit")
        })
        .collect();
    let events_stored = |id: JobId| {
        let kv = store.get(&job_key(id)).expect("get").expect("stored");
        let r: JobRecord = decode(&job_key(id), &kv.value).expect("decodes");
        (r.events.len(), kv.mod_revision)
    };
    let before: Vec<_> = ids.iter().map(|id| events_stored(*id)).collect();
    c.deferred(|c| {
        for round in 0..2 {
            for id in &ids {
                let mut r = JobRecord::clone(&c.jobs[id].0);
                // Two different notes (repeats of one would fold into one event).
                let what = ["one", "two"][round];
                r.events
                    .push(JobEvent::new(1, "note", format!("change {what}")));
                c.write(r).expect("deferred write");
            }
        }
    });
    let unchanged: Vec<_> = ids.iter().map(|id| events_stored(*id)).collect();
    assert_eq!(unchanged, before, "nothing written before the flush");
    assert_eq!(store.sent.load(SeqCst), 0);

    store.fail.store(true, SeqCst);
    assert!(c.flush_deferred().is_err());
    let unchanged: Vec<_> = ids.iter().map(|id| events_stored(*id)).collect();
    assert_eq!(unchanged, before, "a failed flush wrote nothing");

    store.fail.store(false, SeqCst);
    c.flush_deferred().expect("flush");
    // 300 records, one compare each, at most 63 compares per
    // transaction (etcd's 128 less room for the fence): 5 transactions.
    let chunks = 300usize.div_ceil(gangway_store::TxnLimits::ETCD_DEFAULT.max_compares);
    assert_eq!(store.sent.load(SeqCst), chunks);
    for (id, (n, _)) in ids.iter().zip(&before) {
        let (events, rev) = events_stored(*id);
        assert_eq!(events, n + 2, "job {id}: its latest record");
        assert_eq!(rev, c.jobs[id].1, "job {id}: memory knows its revision");
    }
    c.flush_deferred().expect("nothing left");
    assert_eq!(store.sent.load(SeqCst), chunks);
    // Compare-and-swap on the revisions now in memory succeeds.
    let mut r = JobRecord::clone(&c.jobs[&ids[0]].0);
    r.events.push(JobEvent::new(2, "note", "after".to_string()));
    c.write(r).expect("a durable write after the flush");
    assert_eq!(events_stored(ids[0]).0, before[0].0 + 3);
}

/// A redb store with etcd's default transaction limits, refusing (as
/// etcd does) a transaction over them, or any write of the predictor.
struct EtcdSized {
    inner: RedbStore,
    refuse_predictor: bool,
}

impl Store for EtcdSized {
    fn get(&self, key: &str) -> Result<Option<gangway_store::KeyValue>, StoreError> {
        self.inner.get(key)
    }
    fn range(&self, prefix: &str) -> Result<Vec<gangway_store::KeyValue>, StoreError> {
        self.inner.range(prefix)
    }
    fn txn(
        &self,
        compares: &[Compare],
        ops: &[Op],
    ) -> Result<gangway_store::TxnResult, StoreError> {
        let bytes: usize = ops
            .iter()
            .map(|o| match o {
                Op::Put(k, v) => k.len() + v.len(),
                Op::Delete(k) => k.len(),
            })
            .sum();
        let predictor = ops
            .iter()
            .any(|o| matches!(o, Op::Put(k, _) if k == PREDICTOR_KEY));
        if bytes > gangway_store::TxnLimits::ETCD_DEFAULT.max_bytes
            || (predictor && self.refuse_predictor)
        {
            return Err(StoreError::Backend("request is too large".into()));
        }
        self.inner.txn(compares, ops)
    }
    fn revision(&self) -> Result<u64, StoreError> {
        self.inner.revision()
    }
    fn watch(
        &self,
        prefix: &str,
        from: u64,
    ) -> Result<std::sync::mpsc::Receiver<gangway_store::Event>, StoreError> {
        self.inner.watch(prefix, from)
    }
    fn compact(&self, revision: u64) -> Result<(), StoreError> {
        self.inner.compact(revision)
    }
    fn txn_limits(&self) -> gangway_store::TxnLimits {
        gangway_store::TxnLimits::ETCD_DEFAULT
    }
}

fn etcd_sized(dir: &std::path::Path, refuse_predictor: bool) -> Control<EtcdSized> {
    let store = EtcdSized {
        inner: RedbStore::open(&dir.join("s.redb")).expect("store"),
        refuse_predictor,
    };
    let mut c = one_node(store, PREDICTOR_SAVE_SECONDS);
    learn_many_names(&mut c);
    c
}

/// Teaches `c` 30,000 distinct job names: several MiB of predictor,
/// one of them ("often") with many samples.
fn learn_many_names<S: Store>(c: &mut Control<S>) {
    for i in 0..30_000u64 {
        let name = if i % 10 == 0 {
            "often".to_string()
        } else {
            format!("once-{i}")
        };
        c.cluster
            .learn_runtime(&JobSpec::new(&name, "q", 1, 1), 600 + i % 7);
    }
    c.ranks.predictor_learned();
}

/// The predictor stored in `c`: within `bound` bytes, decodable, and
/// still holding the group with the most history.
fn assert_stored_predictor_keeps_often<S: Store>(c: &Control<S>, bound: usize) {
    let stored = c.store.get(PREDICTOR_KEY).expect("get").expect("stored");
    assert!(stored.value.len() <= bound);
    let p: gangway_sched::predict::RuntimePredictor =
        serde_json::from_slice(&stored.value).expect("decodes");
    let often = JobSpec::new("often", "q", 1, 1);
    assert!(
        p.predict(&gangway_sched::state::key_of(&often)).is_some(),
        "the group with the most history is kept"
    );
}

/// Defect found with `bench cluster` on etcd: with many distinct job
/// names the stored predictor outgrew etcd's request limit and every
/// cycle failed on storing it, so nothing was scheduled again. Now what
/// is stored fits (the groups with the least history left out), and a
/// store that refuses it does not stop the cycle (it is stored apart
/// from it, after the state lock is released).
#[test]
fn a_predictor_larger_than_a_store_value_is_trimmed_and_never_stops_the_cycle() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut c = etcd_sized(dir.path(), false);
    assert!(
        encode(c.cluster.predictor()).len() > gangway_store::TxnLimits::ETCD_DEFAULT.max_bytes,
        "the test's predictor must not fit"
    );
    let id = c
        .submit("alice", JobSpec::new("often", "q", 1, 1), 0)
        .expect("submit");
    let d = c.cycle(PREDICTOR_SAVE_SECONDS + 1).expect("cycle");
    assert_ne!(c.jobs[&id].0.state, JobState::Pending, "placed: {d:?}");
    c.predictor_save(PREDICTOR_SAVE_SECONDS + 1)
        .expect("due")
        .write(&c.store);
    assert_stored_predictor_keeps_often(&c, gangway_store::TxnLimits::ETCD_DEFAULT.max_bytes);

    let dir = tempfile::tempdir().expect("tmp");
    let mut c = etcd_sized(dir.path(), true);
    let id = c
        .submit("alice", JobSpec::new("j", "q", 1, 1), 0)
        .expect("submit");
    c.cycle(PREDICTOR_SAVE_SECONDS + 1).expect("cycle");
    assert_ne!(c.jobs[&id].0.state, JobState::Pending, "placed");
    // A refused predictor is logged, not fatal.
    c.predictor_save(PREDICTOR_SAVE_SECONDS + 1)
        .expect("due")
        .write(&c.store);
    assert!(c.store.get(PREDICTOR_KEY).expect("get").is_none());
}

/// Found with `bench cluster` at 100,000 jobs of distinct names: the
/// predictor encoded to 10 MB and was stored whole every minute on
/// redb. What is stored is bounded on every store, the busiest groups
/// kept.
#[test]
fn the_stored_predictor_is_bounded_on_redb_too_and_keeps_the_busiest_groups() {
    let dir = tempfile::tempdir().expect("tmp");
    let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
    let mut c = one_node(store, 0);
    learn_many_names(&mut c);
    assert!(encode(c.cluster.predictor()).len() > PREDICTOR_MAX_BYTES);
    assert!(
        c.predictor_save(1).is_none(),
        "not a minute since the start"
    );
    c.predictor_save(PREDICTOR_SAVE_SECONDS)
        .expect("due")
        .write(&c.store);
    assert_stored_predictor_keeps_often(&c, PREDICTOR_MAX_BYTES);
    assert!(
        c.predictor_save(PREDICTOR_SAVE_SECONDS + 1).is_none(),
        "nothing new"
    );
}

#[test]
fn run_times_of_succeeded_jobs_are_learned_and_survive_a_restart() {
    let (dir, mut c, id) = one_node_running_job(30);
    let spec = c.jobs[&id].0.spec.clone();
    let key = gangway_sched::state::key_of(&spec);
    assert!(
        c.cluster.predictor().predict(&key).is_none(),
        "nothing learned yet"
    );
    // Running since t=2; its only node reports success at t=302.
    c.report("n", id, Some(0), Report::Exited(0), 302)
        .expect("exited");
    assert_eq!(c.jobs[&id].0.state, JobState::Succeeded);
    let p = c.cluster.predictor().predict(&key).expect("learned");
    assert_eq!(p.median(), 300);
    c.cycle(303).expect("cycle");
    c.predictor_save(303)
        .expect("due: learned, never stored")
        .write(&c.store);
    assert!(c.predictor_save(304).is_none(), "stored a second ago");
    drop(c);
    let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
    let c = Control::open(store, &[gangway_core::QueueSpec::unlimited("q", None)]).expect("reopen");
    let p = c.cluster.predictor().predict(&key).expect("kept");
    assert_eq!(p.median(), 300, "a restarted server keeps what it learned");
}

#[test]
fn a_deleted_node_ends_a_gang_being_cancelled_as_cancelled() {
    let (_dir, mut c, id) = one_node_running_job(30);
    c.cancel(id, "alice", 3).expect("cancel");
    assert!(
        c.jobs[&id].0.stopping.is_some(),
        "stopping, GPUs still held"
    );
    c.delete_node("n", 4).expect("delete");
    assert_eq!(c.jobs[&id].0.state, JobState::Cancelled);
}

/// GPUs the scheduler sees free on node n.
fn free_gpus(c: &Control<RedbStore>) -> u32 {
    let n = c.cluster.node_index("n").expect("node");
    4 - c.cluster.capacity().alloc[n as usize].count_ones()
}

#[test]
fn a_cancelled_gang_keeps_its_gpus_until_its_node_reports_nothing_left() {
    let (_d, mut c, id) = one_node_running_job(60);
    c.cancel(id, "alice", 3).expect("cancel");
    // Told to stop with a short grace; its GPUs stay booked.
    let a = c.assignments("n");
    assert_eq!(
        (a.len(), a[0].stop, a[0].grace_seconds),
        (1, true, SHORT_GRACE_SECONDS)
    );
    assert_eq!(free_gpus(&c), 0);
    assert_eq!(c.cycle(4).expect("cycle").binds.len(), 0);
    // A rank exiting early changes nothing; only "nothing left" does.
    c.report("n", id, Some(0), Report::Failing(143), 5)
        .expect("failing");
    assert_eq!(free_gpus(&c), 0);
    assert_eq!(c.cancel(id, "alice", 6).ok(), Some(()), "idempotent");
    c.report("n", id, Some(0), Report::Exited(143), 7)
        .expect("exited");
    let rec = &c.jobs[&id].0;
    assert_eq!(rec.state, JobState::Cancelled);
    assert!(rec
        .events
        .iter()
        .any(|e| e.kind == "cancelled" && e.message.starts_with("cancelled by alice")));
    assert_eq!(free_gpus(&c), 4);
}

#[test]
fn a_cancelled_or_failing_gang_whose_node_never_reports_is_ended_after_its_grace() {
    // Cancelled at t=3 with the short grace; the node never reports.
    let (_d, mut c, id) = one_node_running_job(60);
    c.cancel(id, "alice", 3).expect("cancel");
    let deadline = 3 + SHORT_GRACE_SECONDS + 5;
    assert!(c
        .expire_grace(deadline - 1, 300, 5)
        .expect("expire")
        .is_empty());
    assert_eq!(free_gpus(&c), 0);
    assert_eq!(c.expire_grace(deadline, 300, 5).expect("expire"), vec![id]);
    let rec = &c.jobs[&id].0;
    assert_eq!(rec.state, JobState::Cancelled);
    assert!(rec.events.iter().any(|e| e.message.contains("ran out")));
    assert_eq!(free_gpus(&c), 4);
    assert!(
        c.assignments("n").is_empty(),
        "the attempt is no longer assigned"
    );

    // A rank failed at t=3; the other never exits: the gang restarts.
    let (_d, mut c, id) = one_node_running_job(60);
    let (rec, rev) = c.jobs[&id].clone();
    let mut rec = JobRecord::clone(&rec);
    rec.spec.restart.max_restarts = 1;
    c.jobs.insert(id, (rec, rev));
    c.report("n", id, Some(0), Report::Failing(1), 3)
        .expect("failing");
    assert!(c
        .expire_grace(deadline - 1, 300, 5)
        .expect("expire")
        .is_empty());
    assert_eq!(c.expire_grace(deadline, 300, 5).expect("expire"), vec![id]);
    assert_eq!(c.jobs[&id].0.state, JobState::Restarting);
    assert_eq!(free_gpus(&c), 4);
}

#[test]
fn a_failing_rank_stops_the_gang_and_the_restart_waits_for_it() {
    let (_d, mut c, id) = one_node_running_job(3);
    c.report("n", id, Some(0), Report::Failing(1), 3)
        .expect("failing");
    let rec = &c.jobs[&id].0;
    assert_eq!((rec.state, rec.attempt), (JobState::Running, 0));
    let a = c.assignments("n");
    assert_eq!((a[0].stop, a[0].grace_seconds), (true, 3));
    assert_eq!(free_gpus(&c), 0);
    c.report("n", id, Some(0), Report::Exited(1), 6)
        .expect("exited");
    let rec = &c.jobs[&id].0;
    assert_eq!((rec.state, rec.attempt), (JobState::Restarting, 1));
    assert!(rec
        .events
        .iter()
        .any(|e| e.kind == "restarting" && e.message.starts_with("exited with code 1 on n")));
    // Numbered as `describe` and `logs --attempt` number attempts.
    assert!(
        rec.events
            .iter()
            .any(|e| e.kind == "restarting"
                && e.message.ends_with("(attempt 0 failed; attempt 1 next)")),
        "{:?}",
        rec.events
    );
    assert_eq!(free_gpus(&c), 4);
}

/// One step of the lifecycle property test below; nodes are `n0`..`n3`.
#[derive(Clone, Debug)]
enum Life {
    /// Node `n` registers (approved at once or left waiting); a known
    /// node re-registers (a heartbeat).
    Register(u8, bool),
    /// Node `n` is approved.
    Approve(u8),
    /// Node `n`'s agent syncs (or heartbeats while waiting).
    Sync(u8),
    /// Node `n` is deleted.
    Delete(u8),
    /// A job of `replicas` replicas of `gpus` GPUs.
    Submit(u32, u32),
    /// Time passes (a long wait is the server's own stall if cycles
    /// did not run in it).
    Advance(u64),
    /// The clock goes back (a wall-clock correction).
    Back(u64),
    /// A scheduling cycle.
    Cycle,
    /// The server restarts on the same store: its nodes count their
    /// silence from then.
    Reopen,
}

fn life() -> impl proptest::strategy::Strategy<Value = Life> {
    use proptest::prelude::*;
    prop_oneof![
        3 => (0u8..4, prop_oneof![4 => Just(true), 1 => Just(false)])
            .prop_map(|(n, a)| Life::Register(n, a)),
        1 => (0u8..4).prop_map(Life::Approve),
        3 => (0u8..4).prop_map(Life::Sync),
        2 => (0u8..4).prop_map(Life::Delete),
        2 => (1u32..=3, 1u32..=4).prop_map(|(r, g)| Life::Submit(r, g)),
        4 => prop_oneof![8 => 0u64..4, 1 => 4u64..80].prop_map(Life::Advance),
        1 => (1u64..6).prop_map(Life::Back),
        5 => Just(Life::Cycle),
        1 => Just(Life::Reopen),
    ]
}

/// The check as it was before the heartbeat index: a walk of
/// every node of the scheduler.
fn silent_nodes_by_walk<S: Store>(c: &Control<S>, now: Time) -> Vec<SilentNode> {
    let lc = c.nodes.lifecycle;
    let mut out = Vec::new();
    for (n, info) in c.cluster.nodes().iter().enumerate() {
        let name = &info.spec.name;
        let seen = c.nodes.heartbeats.since(name);
        let silent = now.saturating_sub(seen);
        if let Some(ready) = lc.acts_on(silent, info.ready, c.nodes.lost.contains(name)) {
            out.push(SilentNode {
                node: n as gangway_sched::NodeIdx,
                name: name.clone(),
                silent,
                ready,
            });
        }
    }
    out
}

/// The scheduler's nodes that are not Ready.
fn not_ready_names<S: Store>(c: &Control<S>) -> BTreeSet<String> {
    c.cluster
        .nodes()
        .iter()
        .filter(|n| !n.ready)
        .map(|n| n.spec.name.clone())
        .collect()
}

fn life_queues() -> Vec<gangway_core::QueueSpec> {
    vec![gangway_core::QueueSpec::unlimited("q", None)]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Whatever happens between cycles (nodes registering, waiting for
    /// approval, approved, syncing, deleted, the server restarting or
    /// stalling, jobs placed on nodes), the lifecycle check read from
    /// the heartbeat index finds the nodes a walk of every node would,
    /// in the same order, and each cycle leaves the NotReady and lost
    /// nodes and ends the jobs (with the same reasons) that the walk
    /// says it should.
    #[test]
    fn the_lifecycle_check_reads_what_a_walk_of_every_node_would(
        not_ready in 0u64..12,
        lost in 0u64..24,
        period in 1u64..4,
        steps in proptest::collection::vec(life(), 1..80)
    ) {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("s.redb");
        let mut now: Time = 1_000;
        let open = |now: Time| {
            let store = RedbStore::open(&path).expect("store");
            let mut c = Control::open_at(store, &life_queues(), now).expect("control");
            c.nodes.lifecycle.node_not_ready_seconds = not_ready;
            c.nodes.lifecycle.node_lost_seconds = lost;
            c.nodes.cycle_seconds = period;
            c
        };
        let mut c = Some(open(now));
        for (i, s) in steps.iter().enumerate() {
            let name = |n: &u8| format!("n{n}");
            let Some(cc) = c.as_mut() else { break };
            match s {
                Life::Register(n, auto) => {
                    let spec = NodeSpec::uniform(&name(n), "leaf0", "spine0", 4, "H100", 80);
                    let _ = cc.register_node(
                        spec,
                        &crate::nodes::Registrant::Join,
                        *auto,
                        "join",
                        now,
                    );
                }
                Life::Approve(n) => {
                    let _ = cc.approve_node(&name(n), now);
                }
                Life::Sync(n) => {
                    if !cc.pending_heartbeat(&name(n), now) {
                        let _ = cc.sync(&name(n), &gangway_core::agent::SyncRequest::default(), now);
                    }
                }
                Life::Delete(n) => {
                    let _ = cc.delete_node(&name(n), now);
                }
                Life::Submit(r, g) => {
                    let _ = cc.submit("alice", JobSpec::new(&format!("j{i}"), "q", *r, *g), now);
                }
                Life::Advance(dt) => now += dt,
                Life::Back(dt) => now -= dt,
                Life::Reopen => {
                    drop(c.take());
                    c = Some(open(now));
                }
                Life::Cycle => {
                    // The cycle credits the server's own stall first;
                    // done here so the walk sees the same heartbeats
                    // (the cycle's own credit then finds no gap).
                    cc.credit_own_stall(now);
                    let nodes: Vec<String> =
                        cc.cluster.nodes().iter().map(|n| n.spec.name.clone()).collect();
                    proptest::prop_assert!(
                        cc.nodes.heartbeats.index_matches(nodes.iter().map(String::as_str)),
                        "step {i}: the index is not the heartbeats"
                    );
                    let walk = silent_nodes_by_walk(cc, now);
                    proptest::prop_assert_eq!(&cc.silent_nodes(now), &walk, "step {}", i);
                    // What the cycle must leave, by the walk.
                    let mut want_not_ready = not_ready_names(cc);
                    let mut want_lost: BTreeSet<String> = cc.nodes.lost.iter().cloned().collect();
                    let mut ended: BTreeMap<JobId, String> = BTreeMap::new();
                    for sn in &walk {
                        want_not_ready.insert(sn.name.clone());
                        if sn.silent < lost {
                            continue;
                        }
                        want_lost.insert(sn.name.clone());
                        for id in cc.cluster.jobs_on(sn.node) {
                            ended.entry(*id).or_insert_with(|| {
                                format!("node {} lost (no heartbeat for {}s)", sn.name, sn.silent)
                            });
                        }
                    }
                    ended.retain(|id, _| {
                        cc.jobs.get(id).is_some_and(|(r, _)| {
                            matches!(
                                r.state,
                                JobState::Scheduled | JobState::Running | JobState::Preempting
                            )
                        })
                    });
                    let events: BTreeMap<JobId, usize> = cc
                        .jobs
                        .iter()
                        .map(|(id, (r, _))| (*id, r.events.len()))
                        .collect();
                    cc.cycle(now).expect("cycle");
                    proptest::prop_assert_eq!(not_ready_names(cc), want_not_ready, "step {}", i);
                    let now_lost: BTreeSet<String> = cc.nodes.lost.iter().cloned().collect();
                    proptest::prop_assert_eq!(now_lost, want_lost, "step {}", i);
                    let mut got: BTreeMap<JobId, String> = BTreeMap::new();
                    for (id, (r, _)) in cc.jobs.iter() {
                        let from = events.get(id).copied().unwrap_or(0);
                        for e in r.events.iter().skip(from) {
                            if e.message.contains("(no heartbeat for") {
                                got.insert(*id, e.message.clone());
                            }
                        }
                    }
                    proptest::prop_assert_eq!(
                        got.keys().collect::<Vec<_>>(),
                        ended.keys().collect::<Vec<_>>(),
                        "step {}", i
                    );
                    for (id, msg) in &ended {
                        proptest::prop_assert!(
                            got[id].contains(msg.as_str()),
                            "step {}: job {} ended with {:?}, not {:?}", i, id, got[id], msg
                        );
                    }
                }
            }
        }
    }
}

/// A running job stored before control characters were refused in names
/// still enters the scheduler at the next open, holding its GPUs; new
/// submissions with such a name are refused.
#[test]
fn a_stored_job_whose_name_predates_the_control_character_rule_keeps_its_gpus() {
    let (dir, c, id) = one_node_running_job(30);
    let mut rec = (*c.jobs[&id].0).clone();
    rec.spec.name = "old\tname\x1b".into();
    c.store
        .put(
            &crate::records::job_key(id),
            &serde_json::to_vec(&rec).expect("json"),
        )
        .expect("put");
    drop(c);
    let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
    let mut c =
        Control::open(store, &[gangway_core::QueueSpec::unlimited("q", None)]).expect("control");
    let other = c
        .submit("bob", JobSpec::new("other", "q", 1, 4), 4)
        .expect("submit");
    c.cycle(5).expect("cycle");
    assert_eq!(
        c.jobs[&other].0.state,
        JobState::Pending,
        "the old job still holds the node's 4 GPUs"
    );
    let refused = c.submit("alice", JobSpec::new("new\x1bname", "q", 1, 1), 6);
    assert!(refused
        .unwrap_err()
        .to_string()
        .contains("name: control character U+001B is not allowed"));
}
