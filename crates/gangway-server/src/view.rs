//! The read view: what listing and describing jobs read without taking the
//! control state's lock.
//!
//! The control state ([`Control`]) sits behind one mutex that every change
//! and the scheduling cycle take. Reads of jobs do not: every release of the
//! lock ([`StateGuard`]'s drop) publishes a [`ReadView`], a copy of what
//! those reads need that shares everything with the state (persistent maps
//! and `Arc`s, so a publication costs O(1) and the next write O(log n)).
//! Because the copy is published before the lock is released, whoever was
//! acknowledged a change (a submission's group commit, a cancel) reads it
//! afterwards: read-your-writes. Usage, history, reservations, the policy
//! pilot and what-if and the log relay read it too: no GET takes the lock.
//!
//! The nodes and queues (`/v1/nodes`, `/v1/queues`, `/v1/cluster`, the GPU
//! gauges of `/metrics`) are read from a [`ClusterSnapshot`] in the view. It
//! is not shared with the scheduler's state (that is mutated in place), so
//! it is rebuilt, node rows that did not change reused: only when the
//! scheduler's state was borrowed mutably since ([`Tracked`]), and then at
//! once after node changes people make (cordon, GPU health, registration,
//! approval, deletion) and after each cycle ([`ClusterMemo::urge`]), else
//! at most once per ten times its last build took, so it never costs the
//! lock more than about a tenth of its time.

use crate::records::{JobCounts, JobMap, JobRecord};
use gangway_core::{JobId, NodeSpec, QueueSpec, ReasonCode, Resources, Time};
use gangway_sched::{ClusterState, Explanation, NamesVersion, NodeIdx};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Gated pending jobs (held, begin time, dependency, array limit) with their
/// reason code and sentence: a persistent map, copied in O(1).
pub type GateMap = imbl::OrdMap<JobId, (ReasonCode, String)>;

/// Node names by their token's digest (authentication), copied in O(1).
pub type NodeTokens = imbl::HashMap<crate::authz::TokenHash, String>;

/// Last heartbeat per node, copied in O(1). Names are shared, so a
/// heartbeat after a view was published copies only reference counts
/// along its path, never strings (10,000 syncs a second).
pub type LastSeen = imbl::HashMap<std::sync::Arc<str>, Time>;

/// Per-node credentials (token digest, log-key nonce) by node name, copied
/// in O(1): the log relay derives a node's log key from the view.
pub type NodeCredentials = imbl::HashMap<String, crate::nodes::NodeCredential>;

/// Nodes the last cycle's backfill plan starts each pending job on.
pub type PlannedNodes = Arc<HashMap<JobId, Vec<NodeIdx>>>;

/// The latest explanation per waiting job, less those voided since (a job
/// cancelled, held, updated or removed between cycles shows none until a
/// cycle examines it again). A persistent map: copied into the read view in
/// O(1), and a capped cycle (one that examined only part of a deep queue,
/// `SchedulerConfig::max_pending_examined`) updates it in O(what it
/// examined), keeping the last explanation of the jobs it did not examine.
#[derive(Clone, Debug, Default)]
pub struct Why {
    by_job: imbl::HashMap<JobId, Explanation>,
}

impl Why {
    /// The explanations of one cycle.
    pub fn from_cycle(explanations: impl IntoIterator<Item = Explanation>) -> Self {
        Why {
            by_job: explanations.into_iter().map(|e| (e.job, e)).collect(),
        }
    }

    /// Folds in a cycle's decisions: the explanations of the jobs it
    /// examined replace theirs (only those that changed are written: most
    /// do not from one cycle to the next), those of the jobs it started go,
    /// and, when it examined every pending job, so do any left of jobs no
    /// longer waiting; a capped cycle keeps the others.
    pub fn update(&mut self, d: &gangway_sched::Decisions) {
        for b in &d.binds {
            self.by_job.remove(&b.job);
        }
        for e in &d.pending {
            if self.by_job.get(&e.job) != Some(e) {
                self.by_job.insert(e.job, e.clone());
            }
        }
        if d.stats.unexamined == 0 && self.by_job.len() != d.pending.len() {
            let waiting: std::collections::HashSet<JobId> =
                d.pending.iter().map(|e| e.job).collect();
            self.by_job.retain(|id, _| waiting.contains(id));
        }
    }

    /// The explanation of `id`, unless there is none or it was voided.
    pub fn get(&self, id: &JobId) -> Option<&Explanation> {
        self.by_job.get(id)
    }

    /// Voids the explanation of `id` (it no longer holds).
    pub fn remove(&mut self, id: &JobId) {
        self.by_job.remove(id);
    }
}

/// A value that counts its mutable borrows, so that what is derived from it
/// is rebuilt only when the count moved. Every `&mut` access counts (one
/// that changed nothing only costs a needless rebuild), so no change of the
/// value can be missed.
#[derive(Debug)]
pub struct Tracked<T> {
    value: T,
    borrows: u64,
}

impl<T> Tracked<T> {
    /// Starts counting at 0.
    pub fn new(value: T) -> Self {
        Tracked { value, borrows: 0 }
    }

    /// How many times the value was borrowed mutably.
    pub fn borrows(&self) -> u64 {
        self.borrows
    }
}

impl<T> std::ops::Deref for Tracked<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> std::ops::DerefMut for Tracked<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.borrows = self.borrows.wrapping_add(1);
        &mut self.value
    }
}

/// One registered node as the node list and the cluster grid show it.
#[derive(Debug, PartialEq)]
pub struct NodeRow {
    /// As registered (cordoned, GPU health and all).
    pub spec: NodeSpec,
    /// The scheduler's version of `spec` when it was copied
    /// ([`gangway_sched::state::NodeInfo::spec_version`]).
    pub spec_version: u64,
    /// Whether its agent reports in time.
    pub ready: bool,
    /// Allocated GPUs: bit `k` is `spec.gpus[k]`.
    pub alloc: u64,
    /// The jobs placed on it (a job once per replica there).
    pub jobs: Vec<JobId>,
    /// Why it was cordoned automatically, if it was.
    pub cordon_reason: Option<String>,
    /// Its unhealthy GPUs (kept for the snapshot's running total).
    pub unhealthy: u32,
}

/// One queue as the queue list shows it.
#[derive(Debug, PartialEq)]
pub struct QueueRow {
    /// As configured (or as the policy in force made it).
    pub spec: QueueSpec,
    /// What its subtree's running jobs hold.
    pub usage: Resources,
}

/// The nodes and queues with what they hold, and the GPU totals: what
/// `/v1/nodes`, `/v1/queues`, `/v1/cluster` and the GPU gauges of
/// `/metrics` read (see the module's documentation for when it is rebuilt).
#[derive(Debug, Default)]
pub struct ClusterSnapshot {
    /// Registered nodes in the scheduler's order: a persistent vector,
    /// shared with the previous snapshot but for the rows that changed.
    pub nodes: imbl::Vector<Arc<NodeRow>>,
    /// Nodes that joined and wait for an admin's approval, by name.
    pub waiting_approval: Vec<NodeSpec>,
    /// Queues in the configuration's order.
    pub queues: Vec<QueueRow>,
    /// GPUs bound to jobs.
    pub gpus_allocated: u64,
    /// Healthy free GPUs on schedulable nodes.
    pub gpus_free: u64,
    /// Unhealthy GPUs.
    pub gpus_unhealthy: u64,
}

impl ClusterSnapshot {
    /// Builds the snapshot of `cluster` from `old`. With `since` (the
    /// scheduler's node-change mark `old` was built at), only the rows of
    /// nodes touched after it are revisited and the GPU totals are moved by
    /// their difference: at 10,000 nodes, rebuilding every row after every
    /// cycle was 8 % of a busy server's samples. Without it, every row is
    /// revisited. Either way an unchanged row is the old one (compared
    /// field by field: no allocation).
    pub(crate) fn build(
        cluster: &ClusterState,
        pending: &std::collections::BTreeMap<String, NodeSpec>,
        reasons: &HashMap<String, String>,
        old: &ClusterSnapshot,
        since: Option<u64>,
    ) -> Self {
        let alloc = &cluster.capacity().alloc;
        let infos = cluster.nodes();
        let row = |i: usize, old: Option<&Arc<NodeRow>>| -> Arc<NodeRow> {
            let n = &infos[i];
            let mask = alloc.get(i).copied().unwrap_or(0);
            let jobs = cluster.jobs_on(i as NodeIdx);
            let reason = if reasons.is_empty() {
                None
            } else {
                reasons.get(&n.spec.name)
            };
            // The spec version stands for the spec (a node's versions
            // are never another's): no spec is compared.
            match old {
                Some(o)
                    if o.spec_version == n.spec_version
                        && o.ready == n.ready
                        && o.alloc == mask
                        && o.jobs == jobs
                        && o.cordon_reason.as_ref() == reason =>
                {
                    o.clone()
                }
                _ => Arc::new(NodeRow {
                    spec: n.spec.clone(),
                    spec_version: n.spec_version,
                    ready: n.ready,
                    alloc: mask,
                    jobs: jobs.to_vec(),
                    cordon_reason: reason.cloned(),
                    unhealthy: n.spec.gpus.iter().filter(|g| !g.healthy).count() as u32,
                }),
            }
        };
        let incremental = since.and_then(|mark| {
            let mut nodes = old.nodes.clone();
            let (mut allocated, mut unhealthy) = (old.gpus_allocated, old.gpus_unhealthy);
            for i in cluster.nodes_touched_since(mark) {
                let i = i as usize;
                let was = nodes.get(i).cloned();
                if was.is_none() && i != nodes.len() {
                    return None;
                }
                let now = row(i, was.as_ref());
                if let Some(w) = &was {
                    allocated = allocated.checked_sub(u64::from(w.alloc.count_ones()))?;
                    unhealthy = unhealthy.checked_sub(u64::from(w.unhealthy))?;
                }
                allocated += u64::from(now.alloc.count_ones());
                unhealthy += u64::from(now.unhealthy);
                if was.is_some() {
                    nodes.set(i, now);
                } else {
                    nodes.push_back(now);
                }
            }
            (nodes.len() == infos.len()).then_some((nodes, allocated, unhealthy))
        });
        let (nodes, allocated, unhealthy) = incremental.unwrap_or_else(|| {
            let nodes: imbl::Vector<Arc<NodeRow>> =
                (0..infos.len()).map(|i| row(i, old.nodes.get(i))).collect();
            let allocated = nodes.iter().map(|r| u64::from(r.alloc.count_ones())).sum();
            let unhealthy = nodes.iter().map(|r| u64::from(r.unhealthy)).sum();
            (nodes, allocated, unhealthy)
        });
        let queues = cluster
            .queues()
            .iter()
            .enumerate()
            .map(|(i, q)| QueueRow {
                spec: q.spec.clone(),
                usage: cluster.queue_usage(i as u32),
            })
            .collect();
        ClusterSnapshot {
            nodes,
            waiting_approval: pending.values().cloned().collect(),
            queues,
            gpus_allocated: allocated,
            gpus_free: cluster.free_gpus(),
            gpus_unhealthy: unhealthy,
        }
    }
}

/// What the state keeps to rebuild its [`ClusterSnapshot`] only when
/// needed: the last one, what it was built from, and how long it took.
#[derive(Debug, Default)]
pub struct ClusterMemo {
    pub(crate) snapshot: Arc<ClusterSnapshot>,
    /// The scheduler state's borrow count, and the number of nodes waiting
    /// for approval and of cordon reasons, when it was built.
    pub(crate) built_from: Option<(u64, usize, usize)>,
    /// The scheduler's node-change mark when it was built
    /// ([`ClusterState::node_touches`]); none: revisit every row next.
    pub(crate) touched_mark: Option<u64>,
    pub(crate) built_at: Option<Instant>,
    pub(crate) cost: Duration,
    pub(crate) urgent: bool,
}

/// A rebuild waits at least this many times as long as the last one took
/// (unless urged): at most about a tenth of the lock's time goes to it.
pub(crate) const REBUILD_SPACING: u32 = 10;

impl ClusterMemo {
    /// Asks for the snapshot to be rebuilt when the lock is next released,
    /// however recently it was: a change someone was acknowledged (a
    /// cordon) or a cycle's binds must be read back at once.
    pub fn urge(&mut self) {
        self.urgent = true;
    }

    /// Builds the next snapshot without reusing any row: the scheduler's
    /// state was replaced (a node deleted), so its spec versions start
    /// again and no longer identify the rows'.
    pub fn forget_rows(&mut self) {
        self.snapshot = Arc::new(ClusterSnapshot::default());
        self.built_from = None;
        self.touched_mark = None;
        self.urgent = true;
    }

    /// The last snapshot built.
    pub fn snapshot(&self) -> &Arc<ClusterSnapshot> {
        &self.snapshot
    }
}

/// What reads see: the records, the gates, the last cycle's explanations
/// and plan with the node and queue names they refer to, the cluster
/// snapshot, the reservations and the node credentials.
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
    /// The jobs by queue and state (what `/metrics` counts).
    pub job_counts: JobCounts,
    /// The nodes and queues with what they hold.
    pub cluster: Arc<ClusterSnapshot>,
    /// Last heartbeat per node.
    pub last_seen: LastSeen,
    /// Maintenance reservations by name (`GET /v1/reservations`).
    pub reservations: crate::reservations::ReservationMap,
    /// Per-node credentials by name (the log relay's keys).
    pub node_credentials: NodeCredentials,
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

    /// The log key of `node`, derived with the join token `secret` (as
    /// [`Control::log_token_of`] derives it).
    pub fn log_token_of(&self, node: &str, secret: &str) -> Option<String> {
        self.node_credentials
            .get(node)
            .map(|c| crate::nodes::log_token(secret, node, &c.log_nonce))
    }

    /// A registered node's row in the cluster snapshot, by name (a walk of
    /// the nodes: for rare reads such as the log relay's).
    pub fn node_row(&self, name: &str) -> Option<&Arc<NodeRow>> {
        self.cluster.nodes.iter().find(|n| n.spec.name == name)
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

/// The queues and nodes of the scheduler's state without its jobs (what
/// explanations are rendered against), with the names version
/// ([`NamesVersion`]) of the state they were copied from.
#[derive(Clone, Debug, Default)]
pub(crate) struct Names {
    /// The copy.
    pub(crate) state: Arc<ClusterState>,
    /// The names version of the state it was copied from (`None`: never
    /// copied).
    from: Option<NamesVersion>,
}

impl Names {
    /// Brings the copy up to `cluster`'s names: kept when `cluster`'s names
    /// version is the one it was copied from (an O(1) test: a queue or node
    /// added, the queues replaced, or the state rebuilt all move the
    /// version), else copied again, so a cycle only pays for it when the
    /// nodes or queues changed.
    pub(crate) fn refresh(&mut self, cluster: &ClusterState) {
        let version = cluster.names_version();
        if self.from == Some(version) {
            return;
        }
        self.state = Arc::new(names_only(cluster));
        self.from = Some(version);
    }
}

/// `cluster`'s queues and nodes without its jobs.
fn names_only(cluster: &ClusterState) -> ClusterState {
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
    s
}

/// Who takes the control state's lock. `/metrics` shows, per holder, how
/// often it took the lock, how long it waited and how long it held it (the
/// read view's publication included): the first thing to read when agents'
/// syncs or submissions slow down. Timing the holds by hand is how a 10 MB
/// predictor store and redb's commit were found under the lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Holder {
    /// The scheduling cycle (with grace expiry and the policy's tick).
    Cycle,
    /// Combined batches: agents' syncs and reports, and the API's changes.
    Combined,
    /// The submissions' group commit.
    Submissions,
    /// Handlers that lock the state directly.
    Requests,
    /// Retention: removing finished jobs and idempotency keys.
    Retention,
    /// Anything else (taking the lead, tests).
    Other,
}

impl Holder {
    /// Every holder, in the order of [`StateLock::lock_use`].
    pub const ALL: [Holder; 6] = [
        Holder::Cycle,
        Holder::Combined,
        Holder::Submissions,
        Holder::Requests,
        Holder::Retention,
        Holder::Other,
    ];

    /// The `holder` label.
    pub fn name(self) -> &'static str {
        match self {
            Holder::Cycle => "cycle",
            Holder::Combined => "combined",
            Holder::Submissions => "submissions",
            Holder::Requests => "requests",
            Holder::Retention => "retention",
            Holder::Other => "other",
        }
    }
}

/// One holder's use of the lock since the server started.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LockUse {
    /// Who.
    pub holder: Holder,
    /// Times taken.
    pub taken: u64,
    /// Seconds spent waiting for it.
    pub waited: f64,
    /// Seconds held.
    pub held: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::Control;
    use crate::lock::StateLock;
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
    fn a_capped_cycle_keeps_the_explanations_of_jobs_it_did_not_examine() {
        let e = |id, behind| Explanation {
            job: JobId(id),
            reason: gangway_sched::WaitReason::InOrder {
                behind: JobId(behind),
            },
            estimated_start: None,
        };
        let behind = |w: &Why, id| match w.get(&JobId(id)).map(|e| &e.reason) {
            Some(gangway_sched::WaitReason::InOrder { behind }) => Some(behind.0),
            _ => None,
        };
        let mut w = Why::from_cycle([e(1, 0), e(2, 0), e(3, 0)]);
        // Examined 1 (new reason) and started 2; 3 was not examined.
        let mut d = gangway_sched::Decisions {
            pending: vec![e(1, 7)],
            ..Default::default()
        };
        d.binds.push(gangway_sched::Bind {
            job: JobId(2),
            placement: gangway_sched::Placement {
                replicas: Vec::new(),
                level: gangway_core::TopologyLevel::Node,
            },
            backfilled: false,
        });
        d.stats.unexamined = 1;
        let before = w.clone();
        w.update(&d);
        assert_eq!(behind(&w, 1), Some(7), "replaced");
        assert_eq!(behind(&w, 2), None, "started: no reason left");
        assert_eq!(behind(&w, 3), Some(0), "not examined: kept");
        assert_eq!(
            behind(&before, 2),
            Some(0),
            "a published copy keeps its own"
        );
        // A cycle that examined every pending job replaces them all.
        d.stats.unexamined = 0;
        w.update(&d);
        assert_eq!((behind(&w, 1), behind(&w, 3)), (Some(7), None));
    }

    fn two_nodes() -> (tempfile::TempDir, Control<RedbStore>) {
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let mut c = Control::open(store, &[QueueSpec::unlimited("q", None)]).expect("control");
        for name in ["a", "b"] {
            c.register_node(
                gangway_core::NodeSpec::uniform(name, "leaf0", "spine0", 4, "H100", 80),
                &crate::nodes::Registrant::Join,
                true,
                "join",
                0,
            )
            .expect("node");
        }
        (dir, c)
    }

    /// The published rows, and the rows a build from nothing gives now.
    fn rows_and_fresh(lock: &StateLock<RedbStore>) -> (Vec<String>, Vec<String>) {
        let show = |r: &NodeRow| {
            format!(
                "{:?} {} {} {:?} {:?} {}",
                r.spec, r.ready, r.alloc, r.jobs, r.cordon_reason, r.unhealthy
            )
        };
        let totals = |s: &ClusterSnapshot| {
            format!(
                "allocated {} free {} unhealthy {}",
                s.gpus_allocated, s.gpus_free, s.gpus_unhealthy
            )
        };
        let v = lock.view();
        let published = v
            .cluster
            .nodes
            .iter()
            .map(|r| show(r))
            .chain([totals(&v.cluster)])
            .collect();
        let c = lock.lock().expect("lock");
        let fresh = ClusterSnapshot::build(
            &c.cluster,
            &c.nodes.pending,
            &c.nodes.cordon_reasons,
            &ClusterSnapshot::default(),
            None,
        );
        let fresh = fresh
            .nodes
            .iter()
            .map(|r| show(r))
            .chain([totals(&fresh)])
            .collect();
        (published, fresh)
    }

    /// Rows are reused by spec version, not by comparing specs, and only
    /// the rows of nodes the scheduler marked touched are revisited: after
    /// every kind of node change the published rows and GPU totals are
    /// what a build from nothing gives (a GPU's health, a cordon, a node
    /// deleted so that the others' versions start again and the first
    /// row's version is the deleted node's, a job placed, running, ended,
    /// a node registered after the deletion).
    #[test]
    fn reused_rows_always_equal_a_fresh_build() {
        let (_dir, mut c) = two_nodes();
        c.register_node(
            gangway_core::NodeSpec::uniform("c", "leaf0", "spine0", 4, "H100", 80),
            &crate::nodes::Registrant::Join,
            true,
            "join",
            0,
        )
        .expect("node");
        let lock = StateLock::new(c);
        let check = |what: &str| {
            let (published, fresh) = rows_and_fresh(&lock);
            assert_eq!(published, fresh, "after {what}");
        };
        check("start");
        lock.lock()
            .expect("lock")
            .set_gpu_health("b", 2, false)
            .expect("health");
        check("a GPU marked unhealthy");
        lock.lock()
            .expect("lock")
            .cordon("c", true)
            .expect("cordon");
        check("a cordon");
        lock.lock()
            .expect("lock")
            .delete_node("a", 7)
            .expect("delete");
        check("a node deleted");
        {
            let mut c = lock.lock().expect("lock");
            c.submit("alice", JobSpec::new("j", "q", 1, 2), 5)
                .expect("submit");
            c.cycle(6).expect("cycle");
        }
        check("a job placed");
        lock.lock()
            .expect("lock")
            .set_gpu_health("c", 0, false)
            .expect("health");
        check("a GPU marked unhealthy after the deletion");
        let placed: Vec<(String, JobId)> = {
            let c = lock.lock().expect("lock");
            c.jobs
                .values()
                .flat_map(|(r, _)| r.placement.iter().map(|p| (p.node.clone(), r.id)))
                .collect()
        };
        assert!(!placed.is_empty());
        for (node, id) in &placed {
            lock.lock()
                .expect("lock")
                .report(node, *id, None, crate::control::Report::Running, 7)
                .expect("running");
        }
        check("a job running");
        for (node, id) in &placed {
            lock.lock()
                .expect("lock")
                .report(node, *id, None, crate::control::Report::Exited(0), 8)
                .expect("exited");
        }
        check("a job ended");
        lock.lock()
            .expect("lock")
            .register_node(
                gangway_core::NodeSpec::uniform("d", "leaf0", "spine0", 8, "H100", 80),
                &crate::nodes::Registrant::Join,
                true,
                "join",
                9,
            )
            .expect("node");
        check("a node registered after the deletion");
        lock.lock().expect("lock").cycle(10).expect("cycle");
        check("a cycle");
    }

    /// The queue and node names of a names-only copy, in index order.
    fn names_in(s: &ClusterState) -> (Vec<String>, Vec<String>) {
        (
            s.queues().iter().map(|q| q.spec.name.clone()).collect(),
            s.nodes().iter().map(|n| n.spec.name.clone()).collect(),
        )
    }

    /// The names copy is reused by names version, not by comparing names:
    /// after every kind of node or queue change the published names are
    /// what a copy from nothing gives (a node registered, one waiting for
    /// approval then approved, one deleted and another registered so that
    /// the counts are as before, the queues replaced), and it
    /// is shared, not copied, across cycles that changed no name.
    #[test]
    fn reused_names_always_equal_a_fresh_copy() {
        let (_dir, c) = two_nodes();
        let lock = StateLock::new(c);
        let mut now = 1;
        let mut check = |what: &str, change: &dyn Fn(&mut Control<RedbStore>, Time)| {
            let before = lock.view().names.clone();
            let mut c = lock.lock().expect("lock");
            change(&mut c, now);
            c.cycle(now + 1).expect("cycle");
            now += 2;
            let kept = Arc::ptr_eq(&c.view.names.state, &before);
            let fresh = names_only(&c.cluster);
            assert_eq!(
                names_in(&c.view.names.state),
                names_in(&fresh),
                "after {what}"
            );
            kept
        };
        assert!(!check("the first cycle", &|_, _| {}), "copied once");
        assert!(check("a cycle with no change", &|_, _| {}), "shared");
        let node =
            |name: &str| gangway_core::NodeSpec::uniform(name, "leaf0", "spine0", 4, "H100", 80);
        let join = |c: &mut Control<RedbStore>, name: &str, auto: bool, now: Time| {
            c.register_node(
                node(name),
                &crate::nodes::Registrant::Join,
                auto,
                "join",
                now,
            )
            .expect("node");
        };
        assert!(!check("a node registered", &|c, t| join(c, "c", true, t)));
        assert!(
            check("a node waiting for approval", &|c, t| join(
                c, "d", false, t
            )),
            "a waiting node is not the scheduler's"
        );
        assert!(!check("a node approved", &|c, t| {
            c.approve_node("d", t).expect("approve")
        }));
        assert!(check("a cordon, a job", &|c, t| {
            c.cordon("a", true).expect("cordon");
            c.submit("alice", JobSpec::new("j", "q", 1, 2), t)
                .expect("submit");
        }));
        assert!(!check("a node deleted and another registered", &|c, t| {
            c.delete_node("b", t).expect("delete");
            join(c, "e", true, t);
        }));
        assert!(!check("the queues replaced", &|c, _| {
            c.cluster
                .replace_queues(&[QueueSpec::unlimited("q", None)])
                .expect("replace");
        }));
    }

    fn cordoned(v: &ReadView, i: usize) -> bool {
        v.cluster.nodes[i].spec.cordoned
    }

    #[test]
    fn the_cluster_snapshot_is_rebuilt_after_a_change_when_urged_or_due() {
        let (_dir, c) = two_nodes();
        let lock = StateLock::new(c);
        assert_eq!(lock.view().cluster.nodes.len(), 2);
        let first = lock.view();
        {
            let mut c = lock.lock().expect("lock");
            // As if the last build had taken an hour: not due for ten.
            c.view.cluster.cost = Duration::from_secs(3600);
            // A change nobody urged (as an agent's report would make).
            c.cluster.set_cordoned("a", true).expect("cordon");
        }
        assert!(
            !cordoned(&lock.view(), 0),
            "not rebuilt: not due, not urged"
        );
        lock.lock()
            .expect("lock")
            .cordon("b", true)
            .expect("cordon");
        let v = lock.view();
        assert!(cordoned(&v, 0) && cordoned(&v, 1), "a cordon is urged");
        {
            let mut c = lock.lock().expect("lock");
            assert!(!c.refresh_cluster_view(), "nothing changed since");
            c.view.cluster.urge();
            assert!(!c.refresh_cluster_view(), "urged, but nothing changed");
        }
        // Rows of nodes that did not change are shared with the last build.
        lock.lock()
            .expect("lock")
            .cordon("a", false)
            .expect("uncordon");
        let w = lock.view();
        assert!(!cordoned(&w, 0));
        assert!(Arc::ptr_eq(&v.cluster.nodes[1], &w.cluster.nodes[1]));
        assert!(!Arc::ptr_eq(&v.cluster.nodes[0], &w.cluster.nodes[0]));
        assert!(!cordoned(&first, 0), "an older view keeps its snapshot");
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
