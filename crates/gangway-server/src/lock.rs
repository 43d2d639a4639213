//! The control state's lock ([`StateLock`]: who holds it and for how long,
//! the read view every release publishes) and the flat combining of the
//! agents' frequent state changes under it.
//!
//! Every agent sync and rank report is a short change to the control state
//! followed by a durable commit. Taken one by one, each paid a lock hold,
//! a read-view publish on release and a store sync: at 10,000 nodes syncing
//! every second that was most of the server's CPU. Here the first caller to
//! find no combiner running becomes it, on the blocking pool: it drains
//! every change queued so far, applies them in arrival order under one
//! lock hold (one view publish), releases the lock, makes them durable with
//! one sync, and only then answers each caller. Changes queued meanwhile
//! form the next batch. Nothing here knows HTTP: the state layer's errors
//! go back to the caller as they are.

use crate::control::{Control, ControlError};
use crate::view::{Holder, LockUse, ReadView};
use gangway_store::{Store, StoreError};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::{Duration, Instant};

/// At most this many changes per lock hold, so a scheduling cycle or a
/// group commit waiting for the lock is not held off for long.
const MAX_BATCH: usize = 256;

/// A queued change: applies itself to the state (writes deferred) and
/// returns what answers its caller once the batch's sync is known.
type Task<S> = Box<dyn FnOnce(&mut Control<S>) -> Reply + Send>;

/// Answers one caller with the batch's sync outcome.
type Reply = Box<dyn FnOnce(Result<(), &StoreError>) + Send>;

/// The queue of changes waiting for a combiner, and whether one runs.
pub struct Combiner<S: Store> {
    queue: Mutex<Vec<Task<S>>>,
    active: AtomicBool,
}

impl<S: Store> Default for Combiner<S> {
    fn default() -> Self {
        Combiner {
            queue: Mutex::new(Vec::new()),
            active: AtomicBool::new(false),
        }
    }
}

/// Why a combined change has no answer.
#[derive(Debug, thiserror::Error)]
pub enum CombineError {
    /// A panic poisoned the state lock, or lost the change's batch.
    #[error("state lock poisoned or the change's batch lost to a panic")]
    Lost,
    /// The change was applied but its sync failed.
    #[error("store: {0}")]
    Sync(String),
    /// The sync failed because another replica leads.
    #[error("not the leader")]
    NotLeader,
}

/// Queues `f` to run on the state behind `state(&owner)` with its writes
/// deferred ([`Control::deferred`]), and returns its answer once those
/// writes are durable. Neither the wait for the lock nor the disk holds an
/// async worker.
pub async fn run<O, S, T>(
    owner: Arc<O>,
    state: fn(&O) -> &StateLock<S>,
    f: impl FnOnce(&mut Control<S>) -> T + Send + 'static,
) -> Result<T, CombineError>
where
    O: Send + Sync + 'static,
    S: Store + Clone + Send + 'static,
    T: Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task: Task<S> = Box::new(move |c: &mut Control<S>| {
        let out = c.deferred(f);
        Box::new(move |synced: Result<(), &StoreError>| {
            let r = match synced {
                Ok(()) => Ok(out),
                Err(StoreError::NotLeader) => Err(CombineError::NotLeader),
                Err(e) => Err(CombineError::Sync(e.to_string())),
            };
            let _ = tx.send(r);
        })
    });
    let c = &state(&owner).combiner;
    c.queue.lock().unwrap_or_else(|p| p.into_inner()).push(task);
    if !c.active.swap(true, Ordering::SeqCst) {
        tokio::task::spawn_blocking(move || combine(state(&owner)));
    }
    rx.await.unwrap_or(Err(CombineError::Lost))
}

/// Drains and applies batches until the queue is empty, then steps down.
fn combine<S: Store + Clone>(lock: &StateLock<S>) {
    // Steps down however it leaves, so a later caller starts a new one.
    struct StepDown<'a>(&'a AtomicBool);
    impl Drop for StepDown<'_> {
        fn drop(&mut self) {
            self.0.store(false, Ordering::SeqCst);
        }
    }
    let c = &lock.combiner;
    loop {
        {
            let _down = StepDown(&c.active);
            // A change that panics poisons the state lock and loses its
            // batch's answers; the combiner goes on, so changes queued
            // meanwhile are answered (refused: the lock is poisoned)
            // instead of waiting for a caller that never comes.
            while std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| batch(lock)))
                .unwrap_or(true)
            {}
        }
        // A caller may have queued after the last drain but seen the flag
        // still set: take the role back if so, else leave.
        let queued = !c.queue.lock().unwrap_or_else(|p| p.into_inner()).is_empty();
        if !queued || c.active.swap(true, Ordering::SeqCst) {
            return;
        }
    }
}

/// Applies one batch; whether there was one.
fn batch<S: Store + Clone>(lock: &StateLock<S>) -> bool {
    let tasks: Vec<Task<S>> = {
        let mut q = lock
            .combiner
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let n = q.len().min(MAX_BATCH);
        q.drain(..n).collect()
    };
    if tasks.is_empty() {
        return false;
    }
    let Ok(mut c) = lock.lock_as(crate::view::Holder::Combined) else {
        // Dropping the tasks drops their senders: each caller hears the
        // change was lost.
        return true;
    };
    let replies: Vec<Reply> = tasks.into_iter().map(|t| t(&mut c)).collect();
    // The batch's job writes go out together, before anyone else holds
    // the lock (their records in memory are already the new ones).
    let flushed = c.flush_deferred().map_err(|e| match e {
        ControlError::Store(e) => e,
        other => StoreError::Backend(other.to_string()),
    });
    let store = c.store_handle();
    // Publishes the read view once for the whole batch.
    drop(c);
    // Even a refusal may follow writes made before it.
    let synced = flushed.and_then(|()| store.sync());
    for r in replies {
        r(synced.as_ref().map(|_| ()));
    }
    true
}

/// The counts behind one holder's [`LockUse`].
#[derive(Default)]
struct Tally {
    taken: AtomicU64,
    wait_ns: AtomicU64,
    held_ns: AtomicU64,
}

/// Nanoseconds as a counter adds them (saturating: ~584 years).
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The control state behind its lock, with the read view its every release
/// publishes.
pub struct StateLock<S: Store> {
    state: Mutex<Control<S>>,
    view: RwLock<Arc<ReadView>>,
    /// Per [`Holder`], in [`Holder::ALL`]'s order.
    tallies: [Tally; Holder::ALL.len()],
    /// The agents' changes waiting to be applied in batches
    /// (below).
    pub(crate) combiner: Combiner<S>,
}

/// Why the state could not be locked: a panic poisoned it.
pub type LockError<'a, S> = PoisonError<MutexGuard<'a, Control<S>>>;

impl<S: Store> StateLock<S> {
    /// Puts `control` behind the lock and publishes its first view.
    pub fn new(mut control: Control<S>) -> Self {
        control.view.cluster.urge();
        control.refresh_cluster_view();
        let view = RwLock::new(Arc::new(control.read_view()));
        StateLock {
            state: Mutex::new(control),
            view,
            tallies: Default::default(),
            combiner: Combiner::default(),
        }
    }

    /// Takes the lock as [`Holder::Other`].
    pub fn lock(&self) -> Result<StateGuard<'_, S>, LockError<'_, S>> {
        self.lock_as(Holder::Other)
    }

    /// Takes the lock; the view is published again when the guard drops.
    /// The wait and the hold are counted for `holder`.
    pub fn lock_as(&self, holder: Holder) -> Result<StateGuard<'_, S>, LockError<'_, S>> {
        // `ALL` lists the holders in their declared order.
        let tally = &self.tallies[holder as usize];
        let asked = Instant::now();
        let guard = self.state.lock()?;
        let at = Instant::now();
        tally.taken.fetch_add(1, Ordering::Relaxed);
        tally
            .wait_ns
            .fetch_add(nanos(at - asked), Ordering::Relaxed);
        Ok(StateGuard {
            guard,
            view: &self.view,
            tally,
            at,
        })
    }

    /// Each holder's use of the lock so far (no lock taken).
    pub fn lock_use(&self) -> Vec<LockUse> {
        Holder::ALL
            .iter()
            .zip(&self.tallies)
            .map(|(h, t)| LockUse {
                holder: *h,
                taken: t.taken.load(Ordering::Relaxed),
                waited: t.wait_ns.load(Ordering::Relaxed) as f64 / 1e9,
                held: t.held_ns.load(Ordering::Relaxed) as f64 / 1e9,
            })
            .collect()
    }

    /// The last published view, without taking the state's lock.
    pub fn view(&self) -> Arc<ReadView> {
        match self.view.read() {
            Ok(v) => v.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }
}

/// The control state, locked. Dropping it publishes the read view (before
/// the lock is released, so views are published in the order of changes).
pub struct StateGuard<'a, S: Store> {
    guard: MutexGuard<'a, Control<S>>,
    view: &'a RwLock<Arc<ReadView>>,
    /// Where the hold is counted, and since when it is held.
    tally: &'a Tally,
    at: Instant,
}

impl<S: Store> std::ops::Deref for StateGuard<'_, S> {
    type Target = Control<S>;
    fn deref(&self) -> &Control<S> {
        &self.guard
    }
}

impl<S: Store> std::ops::DerefMut for StateGuard<'_, S> {
    fn deref_mut(&mut self) -> &mut Control<S> {
        &mut self.guard
    }
}

impl<S: Store> Drop for StateGuard<'_, S> {
    fn drop(&mut self) {
        self.guard.refresh_cluster_view();
        let fresh = Arc::new(self.guard.read_view());
        let old = match self.view.write() {
            Ok(mut v) => std::mem::replace(&mut *v, fresh),
            Err(p) => std::mem::replace(&mut *p.into_inner(), fresh),
        };
        // The old view's unshared nodes are freed outside the view's lock.
        drop(old);
        self.tally
            .held_ns
            .fetch_add(nanos(self.at.elapsed()), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::QueueSpec;
    use gangway_store::RedbStore;
    use std::time::Duration;

    type S = Arc<RedbStore>;

    fn state() -> (tempfile::TempDir, Arc<StateLock<S>>) {
        let dir = tempfile::tempdir().expect("tmp");
        let store = Arc::new(RedbStore::open(&dir.path().join("s.redb")).expect("store"));
        let c = Control::open(store, &[QueueSpec::unlimited("q", None)]).expect("control");
        (dir, Arc::new(StateLock::new(c)))
    }

    fn me(l: &StateLock<S>) -> &StateLock<S> {
        l
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_caller_gets_its_own_answer_and_its_writes_are_in_the_store() {
        let (_dir, lock) = state();
        // Each change appends to a key the store holds; every caller's
        // answer is its own index, and its writes are durable (synced)
        // before it hears back.
        let calls = (0..400u64).map(|i| {
            let lock = lock.clone();
            tokio::spawn(async move {
                run(lock, me, move |c: &mut Control<S>| {
                    let s = c.store_handle();
                    s.txn_deferred(&[], &[gangway_store::Op::Put(format!("/t/{i}"), vec![1])])
                        .expect("write");
                    i
                })
                .await
            })
        });
        let answers = futures_join(calls.collect()).await;
        for (i, a) in answers.into_iter().enumerate() {
            assert_eq!(a.expect("answered"), i as u64);
        }
        let l = lock.lock().expect("lock");
        assert_eq!(l.store_handle().range("/t/").expect("range").len(), 400);
        drop(l);
        // Answers go out before the combiner finds the queue empty and
        // steps down: it must do so promptly, not necessarily before them.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while lock.combiner.active.load(Ordering::SeqCst) {
            assert!(
                std::time::Instant::now() < deadline,
                "the combiner never stepped down"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn futures_join<T>(hs: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
        let mut out = Vec::new();
        for h in hs {
            out.push(h.await.expect("task"));
        }
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_change_loses_its_answer_and_later_callers_hear_so_without_hanging() {
        let (_dir, lock) = state();
        let r = run(lock.clone(), me, |_c: &mut Control<S>| -> u32 {
            panic!("a bug in a change")
        })
        .await;
        assert!(matches!(r, Err(CombineError::Lost)));
        // The lock is poisoned now: a later change is refused, promptly.
        let later = tokio::time::timeout(
            Duration::from_secs(10),
            run(lock.clone(), me, |_c: &mut Control<S>| 7u32),
        )
        .await
        .expect("answered, not hung");
        assert!(matches!(later, Err(CombineError::Lost)));
    }
}
