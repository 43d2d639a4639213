//! The store's behaviour: reads, prefix ranges, compare-and-swap, revisions,
//! watch, durability across reopen and across `kill -9`.

use gangway_store::testing::EtcdProcess;
use gangway_store::{Compare, EtcdStore, Event, Op, RedbStore, Store, StoreError};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

fn open(dir: &tempfile::TempDir) -> RedbStore {
    RedbStore::open(&dir.path().join("gangway.redb")).expect("opens")
}

fn etcd_store(e: &EtcdProcess, ns: &str) -> EtcdStore {
    EtcdStore::connect(std::slice::from_ref(&e.endpoint), ns).expect("connects to etcd")
}

/// Runs one behaviour against both backends: the same suite, the same assertions.
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn redb() {
                let dir = tempfile::tempdir().expect("tmp");
                super::$name(&super::open(&dir));
            }

            #[test]
            fn etcd() {
                let Some(e) = gangway_store::testing::EtcdProcess::start() else { return };
                super::$name(&super::etcd_store(&e, "/gangway-test"));
            }
        }
    )*};
}

on_both_backends!(
    put_get_delete_and_prefix_range,
    compare_and_swap_applies_a_transition_exactly_once,
    watch_replays_history_then_streams_live_changes,
    several_deferred_transactions_are_answered_each_on_its_own,
    compaction_forgets_history_and_keeps_every_value,
);

/// After `compact(r)`: every key keeps its value and revision, a watch
/// from `r` on still replays, one from before `r` is refused as compacted
/// (not silently shortened), compacting again lower or past the head is
/// harmless, and writes go on.
fn compaction_forgets_history_and_keeps_every_value(s: &dyn Store) {
    let mut revs = Vec::new();
    for i in 0..20 {
        revs.push(s.put(&format!("/c/{}", i % 5), &[i]).expect("put"));
    }
    s.txn_deferred(&[], &[Op::Put("/c/late".into(), b"d".to_vec())])
        .expect("deferred");
    s.sync().expect("sync");
    let before = s.range("/c/").expect("range");
    let at = revs[12];
    s.compact(at).expect("compact");
    assert_eq!(s.range("/c/").expect("range"), before, "values kept");
    match s.watch("/c/", at - 1) {
        Err(StoreError::Compacted { requested, .. }) => assert_eq!(requested, at - 1),
        Err(e) => panic!("a watch before the compacted revision: {e}"),
        Ok(_) => panic!("a watch before the compacted revision was accepted"),
    }
    // From the compacted revision on, the history is whole: 7 puts and
    // the deferred one.
    let rx = s
        .watch("/c/", at)
        .expect("watch from the compacted revision");
    let seen: Vec<u64> = (0..8)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(5))
                .expect("event")
                .revision()
        })
        .collect();
    assert_eq!(seen[0], at);
    assert!(seen.windows(2).all(|w| w[0] < w[1]));
    s.compact(revs[3])
        .expect("compacting lower again is harmless");
    s.compact(u64::MAX)
        .expect("compacting past the head compacts what there is");
    let r = s.put("/c/after", b"x").expect("writes go on");
    assert_eq!(
        s.get("/c/after").expect("get").expect("kept").mod_revision,
        r
    );
    assert!(matches!(
        s.watch("/c/", at),
        Err(StoreError::Compacted { .. })
    ));
    let rx = s.watch("/c/", r).expect("watch from the head");
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(5))
            .expect("event")
            .revision(),
        r
    );
}

/// `txns_deferred` (etcd sends them all at once): each transaction is
/// atomic on its own, answered in order; a failed compare fails only its
/// own, and what landed carries the revision its keys were written at.
fn several_deferred_transactions_are_answered_each_on_its_own(s: &dyn Store) {
    let base = s.put("/d/taken", b"0").expect("put");
    let txn = |k: &str, v: &[u8]| {
        (
            vec![Compare::Absent(k.to_string())],
            vec![
                Op::Put(k.to_string(), v.to_vec()),
                Op::Put(format!("{k}/2"), v.to_vec()),
            ],
        )
    };
    let txns: Vec<_> = (0..40)
        .map(|i| txn(&format!("/d/{i:02}"), &[i as u8]))
        .chain([txn("/d/taken", b"x")])
        .collect();
    let answers = s.txns_deferred(&txns);
    assert_eq!(answers.len(), 41);
    s.sync().expect("sync");
    for (i, a) in answers.iter().take(40).enumerate() {
        let a = a.as_ref().expect("answered");
        assert!(a.succeeded, "transaction {i}");
        assert!(a.revision > base);
        for k in [format!("/d/{i:02}"), format!("/d/{i:02}/2")] {
            let kv = s.get(&k).expect("get").expect("written");
            assert_eq!(kv.value, vec![i as u8]);
            assert_eq!(kv.mod_revision, a.revision, "{k}");
        }
    }
    let refused = answers[40].as_ref().expect("answered");
    assert!(!refused.succeeded, "its compare failed");
    assert_eq!(s.get("/d/taken").expect("get").expect("kept").value, b"0");
    assert!(
        s.get("/d/taken/2").expect("get").is_none(),
        "all or nothing"
    );
}

fn put_get_delete_and_prefix_range(s: &dyn Store) {
    let r1 = s.put("/jobs/1", b"a").expect("put");
    let r2 = s.put("/jobs/2", b"b").expect("put");
    s.put("/nodes/n1", b"c").expect("put");
    assert!(r2 > r1);
    let j1 = s.get("/jobs/1").expect("get").expect("present");
    assert_eq!((j1.value.as_slice(), j1.mod_revision), (&b"a"[..], r1));
    let jobs: Vec<String> = s
        .range("/jobs/")
        .expect("range")
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    assert_eq!(jobs, vec!["/jobs/1", "/jobs/2"]);
    assert!(s.delete("/jobs/1").expect("delete"));
    assert!(!s.delete("/jobs/1").expect("delete again"));
    assert!(s.get("/jobs/1").expect("get").is_none());
    assert_eq!(s.range("/jobs/").expect("range").len(), 1);
}

fn compare_and_swap_applies_a_transition_exactly_once(s: &dyn Store) {
    let create = |v: &[u8]| {
        s.txn(
            &[Compare::Absent("/jobs/7".into())],
            &[Op::Put("/jobs/7".into(), v.to_vec())],
        )
    };
    assert!(create(b"pending").expect("txn").succeeded);
    let again = create(b"pending").expect("txn");
    assert!(!again.succeeded, "a retried create does not duplicate");
    let rev = s
        .get("/jobs/7")
        .expect("get")
        .expect("present")
        .mod_revision;
    let transition = |from: u64, to: &[u8]| {
        s.txn(
            &[Compare::Revision("/jobs/7".into(), from)],
            &[Op::Put("/jobs/7".into(), to.to_vec())],
        )
    };
    let t = transition(rev, b"running").expect("txn");
    assert!(t.succeeded);
    // A second writer working from the old revision loses.
    assert!(!transition(rev, b"cancelled").expect("txn").succeeded);
    assert_eq!(
        s.get("/jobs/7").expect("get").expect("present").value,
        b"running"
    );
    // Several ops commit together or not at all.
    let both = s
        .txn(
            &[Compare::Revision("/jobs/7".into(), t.revision)],
            &[
                Op::Put("/jobs/7".into(), b"done".to_vec()),
                Op::Put("/events/7/1".into(), b"finished".to_vec()),
            ],
        )
        .expect("txn");
    assert!(both.succeeded);
    assert_eq!(
        s.get("/events/7/1")
            .expect("get")
            .expect("present")
            .mod_revision,
        both.revision
    );
    assert_eq!(s.revision().expect("rev"), both.revision);
}

fn watch_replays_history_then_streams_live_changes(s: &dyn Store) {
    let r1 = s.put("/jobs/1", b"a").expect("put");
    s.put("/nodes/x", b"n").expect("put");
    let rx = s.watch("/jobs/", r1).expect("watch");
    s.txn(
        &[],
        &[
            Op::Put("/jobs/2".into(), b"b".to_vec()),
            Op::Delete("/jobs/1".into()),
        ],
    )
    .expect("txn");
    let events: Vec<Event> = (0..3)
        .map(|_| rx.recv_timeout(Duration::from_secs(5)).expect("event"))
        .collect();
    assert!(matches!(&events[0], Event::Put(kv) if kv.key == "/jobs/1" && kv.mod_revision == r1));
    assert!(matches!(&events[1], Event::Put(kv) if kv.key == "/jobs/2"));
    assert!(matches!(&events[2], Event::Delete { key, .. } if key == "/jobs/1"));
    assert_eq!(
        events[1].revision(),
        events[2].revision(),
        "one transaction, one revision"
    );
    assert!(
        rx.recv_timeout(Duration::from_millis(50)).is_err(),
        "nothing outside the prefix"
    );
}

#[test]
fn data_survives_reopening() {
    let dir = tempfile::tempdir().expect("tmp");
    let rev = {
        let s = open(&dir);
        s.put("/jobs/1", b"a").expect("put");
        s.put("/jobs/2", b"b").expect("put")
    };
    let s = open(&dir);
    assert_eq!(s.revision().expect("rev"), rev);
    assert_eq!(s.range("/jobs/").expect("range").len(), 2);
    assert!(
        s.put("/jobs/3", b"c").expect("put") > rev,
        "revisions keep increasing"
    );
}

/// Child mode for the crash test: create keys with CAS and print each one after it is acknowledged.
#[test]
fn crash_child() {
    let Ok(path) = std::env::var("GANGWAY_STORE_CRASH_CHILD") else {
        return;
    };
    let start: u64 = std::env::var("GANGWAY_STORE_CRASH_START")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // "deferred": each write is a deferred commit acknowledged after a
    // sync, as the server acknowledges agents' reports; "unsynced": the
    // same without the sync (what the sync is for).
    let mode = std::env::var("GANGWAY_STORE_CRASH_MODE").unwrap_or_default();
    let s = RedbStore::open(std::path::Path::new(&path)).expect("opens");
    for i in start.. {
        let key = format!("/jobs/{i:08}");
        let cmp = [Compare::Absent(key.clone())];
        let ops = [Op::Put(key.clone(), format!("job {i}").into_bytes())];
        let r = match mode.as_str() {
            "deferred" | "unsynced" => s.txn_deferred(&cmp, &ops).expect("txn"),
            _ => s.txn(&cmp, &ops).expect("txn"),
        };
        if mode == "deferred" {
            s.sync().expect("sync");
        }
        println!("ack {i} {}", r.succeeded);
    }
}

#[test]
fn acknowledged_writes_survive_kill_9() {
    let lost = writes_lost_to_kill_9("durable");
    assert!(lost.is_empty(), "acknowledged jobs lost: {lost:?}");
}

#[test]
fn deferred_writes_acknowledged_after_a_sync_survive_kill_9() {
    let lost = writes_lost_to_kill_9("deferred");
    assert!(lost.is_empty(), "acknowledged jobs lost: {lost:?}");
}

/// Runs the crash child in `mode`, killing it five times mid-stream, and
/// returns the writes it acknowledged that the store does not hold.
fn writes_lost_to_kill_9(mode: &str) -> Vec<u64> {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("crash.redb");
    let exe = std::env::current_exe().expect("test binary");
    let mut acked: Vec<u64> = Vec::new();
    let mut next = 0u64;
    for round in 0..5u64 {
        let mut child = Command::new(&exe)
            .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
            .env("GANGWAY_STORE_CRASH_CHILD", &path)
            .env("GANGWAY_STORE_CRASH_START", next.to_string())
            .env("GANGWAY_STORE_CRASH_MODE", mode)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn child");
        let out = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(out).lines();
        // Let it acknowledge a varying number of writes, then kill it mid-stream.
        let want = 20 + round * 37;
        let mut seen = 0;
        while seen < want {
            let Some(Ok(line)) = lines.next() else { break };
            let mut f = line.split_whitespace();
            if f.next() == Some("ack") {
                let i: u64 = f.next().and_then(|x| x.parse().ok()).expect("index");
                acked.push(i);
                next = i + 1;
                seen += 1;
            }
        }
        child.kill().expect("SIGKILL");
        let _ = child.wait();
    }
    assert!(
        acked.len() >= 100,
        "the child acknowledged writes ({} seen)",
        acked.len()
    );
    let s = RedbStore::open(&path).expect("reopens after crashes");
    let stored = s.range("/jobs/").expect("range");
    let keys: Vec<u64> = stored
        .iter()
        .map(|kv| kv.key[6..].parse().expect("index"))
        .collect();
    let mut dedup = keys.clone();
    dedup.dedup();
    assert_eq!(dedup.len(), keys.len(), "no duplicates");
    for kv in &stored {
        let i: u64 = kv.key[6..].parse().expect("index");
        assert_eq!(kv.value, format!("job {i}").into_bytes());
    }
    acked
        .into_iter()
        .filter(|i| keys.binary_search(i).is_err())
        .collect()
}

/// A model step; the `bool` says whether the write is deferred
/// ([`Store::txn_deferred`]: in redb's overlay until a sync).
#[derive(Clone, Debug)]
enum ModelOp {
    Put(u8, u8, bool),
    Delete(u8, bool),
    Cas(u8, bool, u8, bool),
    Sync,
    /// Forgets the history before the current revision less this much
    /// (at most 3, never before the first revision).
    Compact(u8),
}

fn model_op() -> impl Strategy<Value = ModelOp> {
    prop_oneof![
        (0u8..6, any::<u8>(), any::<bool>()).prop_map(|(k, v, d)| ModelOp::Put(k, v, d)),
        (0u8..6, any::<bool>()).prop_map(|(k, d)| ModelOp::Delete(k, d)),
        (0u8..6, any::<bool>(), any::<u8>(), any::<bool>())
            .prop_map(|(k, absent, v, d)| ModelOp::Cas(k, absent, v, d)),
        Just(ModelOp::Sync),
        (0u8..4).prop_map(ModelOp::Compact),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_a_map_model(ops in prop::collection::vec(model_op(), 1..40)) {
        let dir = tempfile::tempdir().expect("tmp");
        let s = open(&dir);
        let model = check_model(&s, &ops)?;
        // What a sync acknowledged is in the file: reopened, the store
        // holds the model.
        s.sync().expect("sync");
        drop(s);
        let s = open(&dir);
        prop_assert_eq!(rows(&s), model);
    }

    #[test]
    fn etcd_matches_the_same_map_model(ops in prop::collection::vec(model_op(), 1..40)) {
        // One etcd for every case (the test thread's; killed when the
        // thread ends), a namespace of its own for each case.
        let store = ETCD.with(|e| {
            let e = e.get_or_init(EtcdProcess::start).as_ref()?;
            let n = CASE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(etcd_store(e, &format!("/model-{n}")))
        });
        if let Some(s) = store {
            check_model(&s, &ops)?;
        }
    }
}

thread_local! {
    static ETCD: std::cell::OnceCell<Option<EtcdProcess>> = const { std::cell::OnceCell::new() };
}
static CASE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The model: key -> (value, mod_revision).
type Model = BTreeMap<String, (Vec<u8>, u64)>;

/// The store's `/k/` keys as (key, value, mod_revision).
fn rows(s: &dyn Store) -> Vec<(String, Vec<u8>, u64)> {
    s.range("/k/")
        .expect("range")
        .into_iter()
        .map(|kv| (kv.key, kv.value, kv.mod_revision))
        .collect()
}

/// Runs `ops` on `s` and on a map, checking after each step that range,
/// get and revision agree, and at the end that a watcher replaying from the
/// first revision (or, after a compaction, from the last compacted one onto
/// the model as it was then), and one that watched live, rebuild the same
/// map. The final model's rows.
fn check_model(
    s: &dyn Store,
    ops: &[ModelOp],
) -> Result<Vec<(String, Vec<u8>, u64)>, TestCaseError> {
    let first = s.revision().expect("rev") + 1;
    let live = s.watch("/k/", first).expect("watch");
    let mut model: BTreeMap<String, (Vec<u8>, u64)> = BTreeMap::new();
    let mut last_rev = 0;
    // The highest revision a compaction asked for, and the model just
    // before it; the model after each step, by the revision then.
    let mut compacted: Option<(u64, Model)> = None;
    let mut past = vec![(first - 1, model.clone())];
    let write = |cmp: &[Compare], ops: &[Op], deferred: bool| {
        if deferred {
            s.txn_deferred(cmp, ops).expect("txn_deferred")
        } else {
            s.txn(cmp, ops).expect("txn")
        }
    };
    for op in ops.iter().cloned() {
        match op {
            ModelOp::Put(k, v, deferred) => {
                let key = format!("/k/{k}");
                let r = write(&[], &[Op::Put(key.clone(), vec![v])], deferred);
                prop_assert!(r.succeeded && r.revision > last_rev);
                last_rev = r.revision;
                model.insert(key, (vec![v], r.revision));
            }
            ModelOp::Delete(k, deferred) => {
                let key = format!("/k/{k}");
                let existed = s.get(&key).expect("get").is_some();
                prop_assert_eq!(existed, model.remove(&key).is_some());
                write(&[], &[Op::Delete(key)], deferred);
                last_rev = s.revision().expect("rev");
            }
            ModelOp::Cas(k, absent, v, deferred) => {
                let key = format!("/k/{k}");
                let cmp = if absent {
                    Compare::Absent(key.clone())
                } else {
                    Compare::Revision(key.clone(), model.get(&key).map_or(0, |e| e.1))
                };
                let expect = if absent {
                    !model.contains_key(&key)
                } else {
                    model.contains_key(&key)
                };
                let r = write(&[cmp], &[Op::Put(key.clone(), vec![v])], deferred);
                prop_assert_eq!(r.succeeded, expect);
                if r.succeeded {
                    model.insert(key, (vec![v], r.revision));
                    last_rev = r.revision;
                }
            }
            ModelOp::Sync => s.sync().expect("sync"),
            ModelOp::Compact(back) => {
                let head = s.revision().expect("rev");
                let to = (head + 1).saturating_sub(u64::from(back)).max(first);
                s.compact(to).expect("compact");
                let before = past
                    .iter()
                    .rev()
                    .find(|(r, _)| *r < to)
                    .map(|(_, m)| m.clone())
                    .unwrap_or_default();
                // Compacting lower than before forgets nothing more.
                if compacted.as_ref().is_none_or(|(c, _)| to > *c) {
                    compacted = Some((to, before));
                }
            }
        }
        past.push((s.revision().expect("rev"), model.clone()));
        let want: Vec<(String, Vec<u8>, u64)> = model
            .iter()
            .map(|(k, (v, r))| (k.clone(), v.clone(), *r))
            .collect();
        prop_assert_eq!(rows(s), want.clone());
        for k in 0..6 {
            let key = format!("/k/{k}");
            let got = s
                .get(&key)
                .expect("get")
                .map(|kv| (kv.value, kv.mod_revision));
            prop_assert_eq!(got, model.get(&key).cloned());
        }
        prop_assert!(s.revision().expect("rev") >= last_rev);
    }
    let want: Vec<(String, Vec<u8>, u64)> = model
        .iter()
        .map(|(k, (v, r))| (k.clone(), v.clone(), *r))
        .collect();
    // Replay: everything from the first revision, deferred changes
    // included; after a compaction, from the revision it asked for onto the
    // model then (a store may have compacted less, never more). From the
    // first revision a compacted store refuses, or replays it all.
    let (from, base) = compacted.clone().unwrap_or((first, BTreeMap::new()));
    let replayed = s.watch("/k/", from).expect("watch");
    let mut watchers = vec![(replayed, base), (live, BTreeMap::new())];
    if compacted.is_some() {
        match s.watch("/k/", first) {
            Ok(rx) => watchers.push((rx, BTreeMap::new())),
            Err(StoreError::Compacted { .. }) => {}
            Err(e) => prop_assert!(false, "watch from the first revision: {e}"),
        }
    }
    for (rx, base) in watchers {
        let mut seen: BTreeMap<String, (Vec<u8>, u64)> = base;
        let apply = |seen: &mut BTreeMap<String, (Vec<u8>, u64)>, e: Event| match e {
            Event::Put(kv) => {
                seen.insert(kv.key, (kv.value, kv.mod_revision));
            }
            Event::Delete { key, .. } => {
                seen.remove(&key);
            }
        };
        let flat = |seen: &BTreeMap<String, (Vec<u8>, u64)>| -> Vec<(String, Vec<u8>, u64)> {
            seen.iter()
                .map(|(k, (v, r))| (k.clone(), v.clone(), *r))
                .collect()
        };
        // etcd's watch is asynchronous: wait for the model, a while at most.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while flat(&seen) != want {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok(e) => apply(&mut seen, e),
                Err(_) => break,
            }
        }
        // Nothing more than the history.
        while let Ok(e) = rx.try_recv() {
            apply(&mut seen, e);
        }
        prop_assert_eq!(flat(&seen), want.clone());
    }
    Ok(want)
}

#[test]
fn etcd_store_reconnects_after_etcd_is_killed_and_restarted() {
    let Some(mut e) = EtcdProcess::start() else {
        return;
    };
    let s = etcd_store(&e, "/gangway");
    let rev = s.put("/jobs/1", b"a").expect("put");
    e.restart();
    // The same handle works again once etcd is back, and nothing was lost.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let r2 = loop {
        match s.put("/jobs/2", b"b") {
            Ok(r) => break r,
            Err(err) => {
                assert!(std::time::Instant::now() < deadline, "no reconnect: {err}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    assert!(r2 > rev);
    assert_eq!(s.range("/jobs/").expect("range").len(), 2);
    // Another namespace on the same etcd sees none of it.
    assert!(etcd_store(&e, "/other")
        .range("/jobs/")
        .expect("range")
        .is_empty());
}

#[test]
fn a_fenced_writer_that_lost_its_leader_key_writes_nothing() {
    let Some(e) = EtcdProcess::start() else {
        return;
    };
    let s = etcd_store(&e, "/gangway");
    let won = s
        .txn(
            &[Compare::Absent("/leader".into())],
            &[Op::Put("/leader".into(), b"replica-a".to_vec())],
        )
        .expect("campaign");
    assert!(won.succeeded);
    // The leader key's create revision is the revision of the winning write.
    s.fence(Some(("/leader", won.revision as i64)));
    s.put("/jobs/1", b"a").expect("the leader writes");
    // A conflict is still a conflict, not a lost leadership.
    let conflict = s
        .txn(
            &[Compare::Absent("/jobs/1".into())],
            &[Op::Put("/jobs/1".into(), b"x".to_vec())],
        )
        .expect("txn");
    assert!(!conflict.succeeded);
    // Leadership passes to another replica (the key is re-created).
    let other = etcd_store(&e, "/gangway");
    other.delete("/leader").expect("expire");
    other.put("/leader", b"replica-b").expect("new leader");
    let r = s.put("/jobs/2", b"stale");
    assert!(matches!(r, Err(StoreError::NotLeader)), "{r:?}");
    // So are deferred ones sent together.
    let rs = s.txns_deferred(&[
        (vec![], vec![Op::Put("/jobs/3".into(), b"stale".to_vec())]),
        (vec![], vec![Op::Put("/jobs/4".into(), b"stale".to_vec())]),
    ]);
    assert!(
        rs.iter().all(|r| matches!(r, Err(StoreError::NotLeader))),
        "{rs:?}"
    );
    for k in ["/jobs/3", "/jobs/4"] {
        assert!(
            s.get(k).expect("get").is_none(),
            "the deposed leader wrote {k}"
        );
    }
    assert!(
        s.get("/jobs/2").expect("get").is_none(),
        "the deposed leader wrote nothing"
    );
}

#[test]
fn etcd_with_default_flags_takes_a_transaction_at_the_advertised_limits_and_refuses_more() {
    let Some(e) = EtcdProcess::start() else {
        return;
    };
    let s = etcd_store(&e, "/gangway");
    // Fenced, as a leader's writes are: the fence is one more compare.
    let leader = s.put("/leader", b"me").expect("leader key");
    s.fence(Some(("/leader", leader as i64)));
    let l = s.txn_limits();
    assert_eq!(l, gangway_store::TxnLimits::ETCD_DEFAULT);
    // The worst case: revision-0 compares are two etcd compares each. etcd
    // takes the request (the compares fail, nothing is written).
    let worst: Vec<Compare> = (0..l.max_compares)
        .map(|i| Compare::Revision(format!("/none/{i:05}"), 0))
        .collect();
    let r = s
        .txn(&worst, &[Op::Put("/none/x".into(), b"x".to_vec())])
        .expect("within etcd's compare limit");
    assert!(!r.succeeded);
    let compares: Vec<Compare> = (0..l.max_compares)
        .map(|i| Compare::Absent(format!("/jobs/{i:05}")))
        .collect();
    let value = vec![b'x'; l.max_bytes / l.max_ops - 16];
    let ops: Vec<Op> = (0..l.max_ops)
        .map(|i| Op::Put(format!("/jobs/{i:05}"), value.clone()))
        .collect();
    let r = s.txn(&compares, &ops).expect("a transaction at the limits");
    assert!(r.succeeded);
    let all = s.range("/jobs/").expect("range (paged)");
    assert_eq!(all.len(), l.max_ops);
    assert!(
        all.iter().all(|kv| kv.mod_revision == r.revision),
        "one revision"
    );
    // One beyond etcd's default: refused, with a message naming the limits.
    let ops: Vec<Op> = (0..2000)
        .map(|i| Op::Put(format!("/big/{i:05}"), b"x".to_vec()))
        .collect();
    let err = s.txn(&[], &ops).expect_err("etcd's default limit");
    assert!(err.to_string().contains("128 operations"), "{err}");
    assert!(s.range("/big/").expect("range").is_empty());
}
