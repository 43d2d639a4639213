//! The read view: what listing and describing jobs read without taking the
//! control state's lock (issue 16).
//!
//! The control state ([`Control`]) sits behind one mutex that every change
//! and the scheduling cycle take. Reads of jobs do not: every release of the
//! lock ([`StateGuard`]'s drop) publishes a [`ReadView`], a copy of what
//! those reads need that shares everything with the state (persistent maps
//! and `Arc`s, so a publication costs O(1) and the next write O(log n)).
//! Because the copy is published before the lock is released, whoever was
//! acknowledged a change (a submission's group commit, a cancel) reads it
//! afterwards: read-your-writes.

use crate::control::Control;
use crate::records::{JobMap, JobRecord};
use gangway_core::{JobId, ReasonCode, Time};
use gangway_sched::{ClusterState, Explanation, NodeIdx};
use gangway_store::Store;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

/// Gated pending jobs (held, begin time, dependency, array limit) with their
/// reason code and sentence: a persistent map, copied in O(1).
pub type GateMap = imbl::OrdMap<JobId, (ReasonCode, String)>;

/// Node names by their token's digest (authentication), copied in O(1).
pub type NodeTokens = imbl::HashMap<crate::authz::TokenHash, String>;

/// Nodes the last cycle's backfill plan starts each pending job on.
pub type PlannedNodes = Arc<HashMap<JobId, Vec<NodeIdx>>>;

/// The last cycle's explanation per waiting job, less those voided since
/// (a job cancelled, held, updated or removed between cycles shows none
/// until the next cycle). Copied in O(1): the cycle's map is shared and the
/// voided ids are a persistent set.
#[derive(Clone, Debug, Default)]
pub struct Why {
    by_job: Arc<HashMap<JobId, Explanation>>,
    voided: imbl::OrdSet<JobId>,
}

impl Why {
    /// The explanations of one cycle.
    pub fn from_cycle(explanations: impl IntoIterator<Item = Explanation>) -> Self {
        Why {
            by_job: Arc::new(explanations.into_iter().map(|e| (e.job, e)).collect()),
            voided: imbl::OrdSet::new(),
        }
    }

    /// The explanation of `id`, unless there is none or it was voided.
    pub fn get(&self, id: &JobId) -> Option<&Explanation> {
        if self.voided.contains(id) {
            return None;
        }
        self.by_job.get(id)
    }

    /// Voids the explanation of `id` (it no longer holds).
    pub fn remove(&mut self, id: &JobId) {
        if self.by_job.contains_key(id) {
            self.voided.insert(*id);
        }
    }
}

/// What job reads see: the records, the gates, and the last cycle's
/// explanations and plan with the node and queue names they refer to.
#[derive(Clone, Debug, Default)]
pub struct ReadView {
    /// Every job record with its store revision.
    pub jobs: JobMap,
    /// Why gated pending jobs wait.
    pub gates: GateMap,
    /// The last cycle's explanations.
    pub why: Why,
    /// When the last cycle ran (explanations render times relative to it).
    pub why_at: Time,
    /// The last cycle's planned nodes per pending job.
    pub planned_nodes: PlannedNodes,
    /// The queues and nodes (names only: no jobs) as the last cycle saw
    /// them: explanations and planned nodes refer to them by index.
    pub names: Arc<ClusterState>,
    /// Node names by token digest: who a node token belongs to.
    pub node_by_token: NodeTokens,
}

impl ReadView {
    /// A job's record, if it exists.
    pub fn job(&self, id: JobId) -> Option<&Arc<JobRecord>> {
        self.jobs.get(&id).map(|(r, _)| r)
    }

    /// Why a gated job waits: its reason code and sentence.
    pub fn gate_reason(&self, id: JobId) -> Option<(ReasonCode, &str)> {
        self.gates.get(&id).map(|(c, m)| (*c, m.as_str()))
    }

    /// The node a node token's digest belongs to.
    pub fn node_of_token(&self, h: &crate::authz::TokenHash) -> Option<&str> {
        self.node_by_token.get(h).map(String::as_str)
    }

    /// The names of the nodes the last plan starts `id` on.
    pub fn planned_node_names(&self, id: JobId) -> Vec<String> {
        self.planned_nodes
            .get(&id)
            .into_iter()
            .flatten()
            .filter_map(|n| self.names.nodes().get(*n as usize))
            .map(|n| n.spec.name.clone())
            .collect()
    }
}

/// Whether `names` has `cluster`'s queues and nodes under the same indices.
fn same_names(names: &ClusterState, cluster: &ClusterState) -> bool {
    names.nodes().len() == cluster.nodes().len()
        && names.queues().len() == cluster.queues().len()
        && names
            .nodes()
            .iter()
            .zip(cluster.nodes())
            .all(|(a, b)| a.spec.name == b.spec.name)
        && names
            .queues()
            .iter()
            .zip(cluster.queues())
            .all(|(a, b)| a.spec.name == b.spec.name)
}

/// `cluster`'s queues and nodes without its jobs (what explanations are
/// rendered against): `old` when its names still match, else rebuilt, so a
/// cycle only pays for it when the nodes or queues changed.
pub(crate) fn names_of(cluster: &ClusterState, old: &Arc<ClusterState>) -> Arc<ClusterState> {
    if same_names(old, cluster) {
        return old.clone();
    }
    let mut s = ClusterState::new(cluster.config().clone());
    for q in cluster.queues() {
        if let Err(e) = s.add_queue(q.spec.clone()) {
            tracing::warn!("read view: queue {}: {e}", q.spec.name);
        }
    }
    for n in cluster.nodes() {
        if let Err(e) = s.add_node(n.spec.clone()) {
            tracing::warn!("read view: node {}: {e}", n.spec.name);
        }
    }
    Arc::new(s)
}

impl<S: Store> Control<S> {
    /// The read view of this state (O(1): everything is shared).
    pub fn read_view(&self) -> ReadView {
        ReadView {
            jobs: self.jobs.snapshot(),
            gates: self.gates.waiting.clone(),
            why: self.why.clone(),
            why_at: self.why_at,
            planned_nodes: self.planned_nodes.clone(),
            names: self.names.clone(),
            node_by_token: self.node_by_token.clone(),
        }
    }
}

/// The control state behind its lock, with the read view its every release
/// publishes.
pub struct StateLock<S: Store> {
    state: Mutex<Control<S>>,
    view: RwLock<Arc<ReadView>>,
}

/// Why the state could not be locked: a panic poisoned it.
pub type LockError<'a, S> = PoisonError<MutexGuard<'a, Control<S>>>;

impl<S: Store> StateLock<S> {
    /// Puts `control` behind the lock and publishes its first view.
    pub fn new(control: Control<S>) -> Self {
        let view = RwLock::new(Arc::new(control.read_view()));
        StateLock {
            state: Mutex::new(control),
            view,
        }
    }

    /// Takes the lock; the view is published again when the guard drops.
    pub fn lock(&self) -> Result<StateGuard<'_, S>, LockError<'_, S>> {
        let guard = self.state.lock()?;
        Ok(StateGuard {
            guard,
            view: &self.view,
        })
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
        let fresh = Arc::new(self.guard.read_view());
        let old = match self.view.write() {
            Ok(mut v) => std::mem::replace(&mut *v, fresh),
            Err(p) => std::mem::replace(&mut *p.into_inner(), fresh),
        };
        // The old view's unshared nodes are freed outside the view's lock.
        drop(old);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::{JobSpec, QueueSpec};
    use gangway_store::RedbStore;

    #[test]
    fn a_voided_explanation_is_gone_and_others_stay() {
        let e = |id| Explanation {
            job: JobId(id),
            reason: gangway_sched::WaitReason::InOrder { behind: JobId(0) },
            estimated_start: None,
        };
        let mut w = Why::from_cycle([e(1), e(2)]);
        let before = w.clone();
        w.remove(&JobId(1));
        w.remove(&JobId(9));
        assert!(w.get(&JobId(1)).is_none());
        assert!(w.get(&JobId(2)).is_some());
        assert!(
            before.get(&JobId(1)).is_some(),
            "a published copy keeps its own"
        );
    }

    #[test]
    fn every_release_of_the_lock_publishes_and_older_views_keep_their_state() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let mut c = Control::open(store, &[QueueSpec::unlimited("q", None)]).expect("control");
        c.register_node(
            gangway_core::NodeSpec::uniform("n", "leaf0", "spine0", 4, "H100", 80),
            &crate::nodes::Registrant::Join,
            true,
            "join",
            0,
        )
        .expect("node");
        let lock = StateLock::new(c);
        let empty = lock.view();
        assert!(empty.jobs.is_empty());
        let id = {
            let mut c = lock.lock().expect("lock");
            let id = c
                .submit("alice", JobSpec::new("j", "q", 1, 1), 5)
                .expect("submit");
            // Not published while the lock is held.
            assert!(lock.view().job(id).is_none());
            id
        };
        let v = lock.view();
        assert_eq!(v.job(id).map(|r| r.user.as_str()), Some("alice"));
        assert!(empty.jobs.is_empty(), "an older view is a snapshot");
        lock.lock()
            .expect("lock")
            .cancel(id, "alice", 6)
            .expect("cancel");
        assert_eq!(
            lock.view().job(id).map(|r| r.state),
            Some(gangway_core::JobState::Cancelled)
        );
        assert_eq!(
            v.job(id).map(|r| r.state),
            Some(gangway_core::JobState::Pending)
        );
    }
}
