//! The cluster as the scheduler sees it: nodes, topology, queues, jobs, and the
//! incrementally maintained indexes (free capacity, pending order, running jobs
//! by estimated end). Callers (server, simulator) mutate it through the methods
//! here; [`crate::schedule`] only reads it.

use crate::bitset::Bitset;
use crate::capacity::Capacity;
pub(crate) use crate::model::EndBasis;
pub use crate::model::{
    key_of, Avoid, Gang, GpuClass, Job, JobStatus, Leaf, NodeIdx, NodeInfo, Placement, QueueId,
    QueueInfo, ReplicaPlacement, RunInfo, Spine,
};
use gangway_core::{
    gpu_memory_fits, gpu_model_matches, JobId, JobSpec, NodeSpec, QueueSpec, Resource, Resources,
    SpecError, Time, TopologyConstraint,
};
use rustc_hash::FxHashMap as HashMap;
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};
use thiserror::Error;

#[path = "state_policy.rs"]
mod policy;

/// Most GPUs one node may have (free masks are `u64`).
pub const MAX_GPUS_PER_NODE: usize = 64;
/// Most distinct (model, memory) GPU classes in one cluster.
pub const MAX_GPU_CLASSES: usize = 64;

/// Identifies the queue and node names (and their indices) of a
/// [`ClusterState`]: a new value is drawn, from a counter shared by every
/// state in the process, whenever a queue or node is added, the queues are
/// replaced, or a state is created. Two states with equal versions therefore
/// have the same names under the same indices (one is a copy of the other
/// with no name changed since), so a view of the names only needs rebuilding
/// when the version moved: an O(1) test instead of a walk of every name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NamesVersion(u64);

impl NamesVersion {
    /// A version no state had before.
    fn fresh() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        NamesVersion(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }
}

impl Default for NamesVersion {
    fn default() -> Self {
        Self::fresh()
    }
}

/// Where a pending job sits in the pending index (and the gang kept there):
/// copied out of the job so the index can change without copying the job.
#[derive(Clone, Copy)]
struct PendingKey {
    priority: i32,
    queue: QueueId,
    rank: i64,
    submitted: Time,
    id: JobId,
    gang: Gang,
}

impl PendingKey {
    fn of(job: &Job) -> Self {
        PendingKey {
            priority: job.priority,
            queue: job.queue,
            rank: job.rank,
            submitted: job.submitted,
            id: job.id,
            gang: job.gang,
        }
    }
}

/// A request that can never be satisfied by this cluster, or a bad call.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Rejection {
    /// Structural spec problem.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// Queue does not exist.
    #[error("queue: unknown queue {0:?}")]
    UnknownQueue(String),
    /// Id reused.
    #[error("job {0} already exists")]
    DuplicateJob(JobId),
    /// Model not present.
    #[error("resources.gpu_model: no node has {model} GPUs (cluster has: {available})")]
    NoSuchModel {
        /// Asked for.
        model: String,
        /// What exists.
        available: String,
    },
    /// The cluster has no GPUs at all (no node has joined yet).
    #[error("resources.gpus: {need} GPUs per replica requested but no node with GPUs has joined the cluster")]
    NoGpuNodes {
        /// Asked for.
        need: u32,
    },
    /// No GPU has enough memory.
    #[error("resources.min_gpu_memory_gib: {need} GiB requested but the largest matching GPU has {max_mib} MiB (a GPU fits N when it reports at least N x 10^9 bytes, its marketed size)")]
    GpuMemory {
        /// Asked for (the card's marketed size).
        need: u32,
        /// Largest available, in MiB.
        max_mib: u64,
    },
    /// Every matching GPU has MIG enabled.
    #[error("resources.gpus: every matching GPU ({model}) has MIG enabled; MIG GPUs are split into instances and never handed out as whole GPUs")]
    MigOnly {
        /// The matching models.
        model: String,
    },
    /// A replica larger than any node.
    #[error("resources.gpus: {need} GPUs per replica but no matching node has more than {max}")]
    ReplicaTooLarge {
        /// Asked for.
        need: u64,
        /// Largest node.
        max: u64,
    },
    /// CPU or memory per replica larger than any node.
    #[error(
        "resources.{resource}: {need} {unit} per replica but no matching node has more than {max}"
    )]
    ReplicaResourceTooLarge {
        /// Which resource.
        resource: Resource,
        /// Unit.
        unit: &'static str,
        /// Asked for.
        need: u64,
        /// Largest node.
        max: u64,
    },
    /// `topology: node` for a gang larger than any node.
    #[error(
        "topology: the gang needs {need} GPUs on one node but no matching node has more than {max}"
    )]
    GangTooLargeForNode {
        /// Asked for.
        need: u64,
        /// Largest node.
        max: u64,
    },
    /// `topology: leaf` for a gang larger than any leaf.
    #[error("topology: the gang needs {need} GPUs under one leaf switch but no leaf has more than {max}")]
    GangTooLargeForLeaf {
        /// Asked for.
        need: u64,
        /// Largest leaf.
        max: u64,
    },
    /// More than the whole cluster.
    #[error("the gang needs {need} GPUs but the cluster has only {have} matching GPUs")]
    ExceedsCluster {
        /// Asked for.
        need: u64,
        /// Matching GPUs in the cluster.
        have: u64,
    },
    /// More than the queue could ever get.
    #[error(
        "queue {queue}: the gang needs {need} {resource} but {limit_kind} allows at most {limit}"
    )]
    ExceedsQueueLimit {
        /// Queue whose limit is hit.
        queue: String,
        /// Which resource.
        resource: Resource,
        /// Asked for.
        need: u64,
        /// The limit.
        limit: u64,
        /// "nominal + borrowing limit" or "nominal (non-preemptible jobs cannot borrow)".
        limit_kind: &'static str,
    },
}

/// A problem with a call that changes the cluster state.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StateError {
    /// Node name reused.
    #[error("node {0:?} already exists")]
    DuplicateNode(String),
    /// Bad node spec.
    #[error("node {node:?}: {problem}")]
    BadNode {
        /// Node name.
        node: String,
        /// What is wrong.
        problem: String,
    },
    /// Bad queue spec.
    #[error("queue {queue:?}: {problem}")]
    BadQueue {
        /// Queue name.
        queue: String,
        /// What is wrong.
        problem: String,
    },
    /// Unknown job.
    #[error("job {0} is not known")]
    UnknownJob(JobId),
    /// Unknown node.
    #[error("node {0} is not known")]
    UnknownNode(String),
    /// A maintenance window that cannot be.
    #[error("maintenance window {0}")]
    BadMaintenance(String),
    /// Wrong state for the call.
    #[error("job {job} is {actual}, expected {expected}")]
    WrongStatus {
        /// Job.
        job: JobId,
        /// What it is.
        actual: &'static str,
        /// What the call needs.
        expected: &'static str,
    },
    /// A bind that would double-book or overcommit.
    #[error("job {job}: node {node} cannot take the placement ({why})")]
    Conflict {
        /// Job.
        job: JobId,
        /// Node name.
        node: String,
        /// Which check failed.
        why: &'static str,
    },
}

/// Knobs of the state itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateConfig {
    /// A job with neither a declared nor a predicted run time (before any job
    /// has completed) is expected to run as long again as it has run so far
    /// (the Lindy estimate), and at least this many seconds. No fixed guess:
    /// once jobs complete, [`crate::predict::RuntimePredictor`] answers.
    pub unknown_runtime_floor_seconds: u64,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            unknown_runtime_floor_seconds: 600,
        }
    }
}

/// Pending jobs of one priority level, per queue, by rank within the queue
/// (0 unless the caller sets one), then oldest first.
pub type PendingLevel = BTreeMap<QueueId, BTreeMap<(i64, Time, JobId), Gang>>;

/// The scheduler's whole view of the cluster.
#[derive(Clone, Debug, Default)]
pub struct ClusterState {
    pub(crate) config: StateConfig,
    pub(crate) nodes: Vec<NodeInfo>,
    node_by_name: HashMap<String, NodeIdx>,
    pub(crate) leaves: Vec<Leaf>,
    leaf_by_name: HashMap<String, u32>,
    pub(crate) spines: Vec<Spine>,
    spine_by_name: HashMap<String, u32>,
    pub(crate) classes: Vec<GpuClass>,
    pub(crate) queues: Vec<QueueInfo>,
    queue_by_name: HashMap<String, QueueId>,
    pub(crate) capacity: Capacity,
    /// Healthy GPUs, CPU and memory of schedulable nodes.
    pub(crate) total: Resources,
    pub(crate) jobs: HashMap<JobId, Job>,
    pub(crate) pending: BTreeMap<Reverse<i32>, PendingLevel>,
    pending_count: usize,
    /// Running jobs by estimated end (as estimated at their start), with
    /// what re-estimating their end needs.
    pub(crate) running_by_end: BTreeMap<(Time, JobId), EndBasis>,
    pub(crate) node_jobs: Vec<Vec<JobId>>,
    /// Victims in their grace period, with the job they were preempted for.
    pub(crate) preempting: BTreeMap<JobId, JobId>,
    /// Pending jobs that preempted others, with where they will start: the
    /// GPUs their victims free are held for them until they bind.
    pub(crate) claims: BTreeMap<JobId, Placement>,
    /// Running preemptible jobs per queue (victim candidates).
    pub(crate) preemptible_by_queue: Vec<BTreeSet<JobId>>,
    /// Running preemptible jobs per priority value (fast "any victim?" test).
    pub(crate) preemptible_prios: BTreeMap<i32, usize>,
    /// Running preemptible jobs not yet stopping, in classes that keep the
    /// order of lost work between cycles (what preemption searches draw from).
    pub(crate) victims: crate::victims::VictimClasses,
    multi_island: bool,
    max_node_cpu: u64,
    max_node_mem: u64,
    /// Run times learned from completed jobs.
    /// Shared so a copy to persist costs nothing to take (copied on the
    /// next learning only while that copy is still held).
    pub(crate) predictor: std::sync::Arc<crate::predict::RuntimePredictor>,
    /// Maintenance windows, by name.
    pub(crate) maintenance: BTreeMap<String, Maintenance>,
    /// Where the next capped cycle's window of pending jobs past the head
    /// starts ([`crate::SchedulerConfig::max_pending_examined`]).
    pub(crate) rotation: u64,
    /// Node spec versions handed out ([`NodeInfo::spec_version`]).
    spec_versions: u64,
    /// Per node, the value of `touches` when anything a reader shows of it
    /// last changed (spec, readiness, health, allocation, jobs on it): the
    /// server's read view rebuilds only the rows of nodes touched since its
    /// last build ([`ClusterState::nodes_touched_since`]).
    node_touched: Vec<u64>,
    /// Node changes counted so far.
    touches: u64,
    /// The version of the queue and node names ([`NamesVersion`]).
    names_version: NamesVersion,
}

/// A maintenance window: from `start` to `end` its nodes run nothing, and no
/// job is placed on them whose estimated end (time limit, else prediction)
/// runs into the window.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Maintenance {
    /// Its name.
    pub name: String,
    /// Nodes it takes.
    pub nodes: Vec<NodeIdx>,
    /// First second of the window.
    pub start: Time,
    /// First second after it.
    pub end: Time,
}

impl ClusterState {
    /// Sets (or replaces) the maintenance window `name` on the named nodes
    /// for `[start, end)`. Refuses unknown nodes and an empty window.
    pub fn set_maintenance(
        &mut self,
        name: &str,
        nodes: &[String],
        start: Time,
        end: Time,
    ) -> Result<(), StateError> {
        if end <= start {
            return Err(StateError::BadMaintenance(format!(
                "{name}: the window ends ({end}) before it starts ({start})"
            )));
        }
        let mut idx = Vec::with_capacity(nodes.len());
        for n in nodes {
            idx.push(
                self.node_index(n)
                    .ok_or_else(|| StateError::UnknownNode(n.clone()))?,
            );
        }
        idx.sort_unstable();
        idx.dedup();
        self.maintenance.insert(
            name.to_string(),
            Maintenance {
                name: name.to_string(),
                nodes: idx,
                start,
                end,
            },
        );
        Ok(())
    }

    /// Removes the maintenance window `name`; whether it existed.
    pub fn remove_maintenance(&mut self, name: &str) -> bool {
        self.maintenance.remove(name).is_some()
    }

    /// Drops the windows that have ended by `now`; their names.
    pub fn drop_expired_maintenance(&mut self, now: Time) -> Vec<String> {
        let gone: Vec<String> = self
            .maintenance
            .values()
            .filter(|m| m.end <= now)
            .map(|m| m.name.clone())
            .collect();
        for g in &gone {
            self.maintenance.remove(g);
        }
        gone
    }

    /// Maintenance windows by name.
    pub fn maintenance(&self) -> impl Iterator<Item = &Maintenance> {
        self.maintenance.values()
    }

    /// An empty cluster.
    pub fn new(config: StateConfig) -> Self {
        ClusterState {
            config,
            capacity: Capacity::default(),
            ..Default::default()
        }
    }

    // ---------- read access ----------

    /// All nodes, by index.
    pub fn nodes(&self) -> &[NodeInfo] {
        &self.nodes
    }
    /// The version of the queue and node names: it moves whenever a queue
    /// or node is added or the queues are replaced (see [`NamesVersion`]).
    pub fn names_version(&self) -> NamesVersion {
        self.names_version
    }
    /// Node index by name.
    pub fn node_index(&self, name: &str) -> Option<NodeIdx> {
        self.node_by_name.get(name).copied()
    }
    /// Leaf switches.
    pub fn leaves(&self) -> &[Leaf] {
        &self.leaves
    }
    /// Spines.
    pub fn spines(&self) -> &[Spine] {
        &self.spines
    }
    /// GPU classes.
    pub fn classes(&self) -> &[GpuClass] {
        &self.classes
    }
    /// Queues, by index.
    pub fn queues(&self) -> &[QueueInfo] {
        &self.queues
    }
    /// Queue index by name.
    pub fn queue_index(&self, name: &str) -> Option<QueueId> {
        self.queue_by_name.get(name).copied()
    }
    /// Live free capacity and queue usage.
    pub fn capacity(&self) -> &Capacity {
        &self.capacity
    }
    /// Usage of a queue's subtree.
    pub fn queue_usage(&self, q: QueueId) -> Resources {
        self.capacity.usage[q as usize]
    }
    /// Healthy schedulable capacity.
    pub fn total(&self) -> Resources {
        self.total
    }
    /// A job by id.
    pub fn job(&self, id: JobId) -> Option<&Job> {
        self.jobs.get(&id)
    }
    /// Every job, in id order.
    pub fn jobs_sorted(&self) -> Vec<&Job> {
        let mut v: Vec<&Job> = self.jobs.values().collect();
        v.sort_by_key(|j| j.id);
        v
    }
    /// Number of pending jobs.
    pub fn pending_count(&self) -> usize {
        self.pending_count
    }
    /// Number of running jobs.
    pub fn running_count(&self) -> usize {
        self.running_by_end.len()
    }
    /// Running jobs by estimated end, earliest first.
    pub fn running_by_end(&self) -> impl Iterator<Item = (Time, JobId)> + '_ {
        self.running_by_end.keys().copied()
    }
    /// Jobs running on a node.
    pub fn jobs_on(&self, n: NodeIdx) -> &[JobId] {
        &self.node_jobs[n as usize]
    }
    /// Free GPUs that cannot host a job of `k` GPUs on one node: the
    /// fragmentation that keeps big jobs waiting although GPUs are idle.
    pub fn fragmented_gpus(&self, k: u32) -> u64 {
        let k = u64::from(k.max(1));
        self.capacity
            .free
            .iter()
            .map(|m| u64::from(m.count_ones()) % k)
            .sum()
    }
    /// Whether some node has more than one NVLink island.
    pub fn has_multi_island_nodes(&self) -> bool {
        self.multi_island
    }
    /// Free GPUs.
    pub fn free_gpus(&self) -> u64 {
        self.capacity.free_total
    }
    /// The state's knobs.
    pub fn config(&self) -> &StateConfig {
        &self.config
    }
    /// Run times learned from completed jobs.
    pub fn predictor(&self) -> &crate::predict::RuntimePredictor {
        &self.predictor
    }
    /// The predictor as it is now, shared: to persist it without holding
    /// the state.
    pub fn predictor_shared(&self) -> std::sync::Arc<crate::predict::RuntimePredictor> {
        self.predictor.clone()
    }
    /// Replaces the predictor (e.g. one the server persisted).
    pub fn set_predictor(&mut self, p: crate::predict::RuntimePredictor) {
        self.predictor = std::sync::Arc::new(p);
    }
    /// Learns that a job like `spec` completed after running `seconds`
    /// uninterrupted. Jobs submitted or requeued afterwards use it.
    pub fn learn_runtime(&mut self, spec: &JobSpec, seconds: u64) {
        std::sync::Arc::make_mut(&mut self.predictor).observe(&key_of(spec), seconds);
    }

    // ---------- topology and queues ----------

    /// Declares a queue; its parent must already exist.
    pub fn add_queue(&mut self, spec: QueueSpec) -> Result<QueueId, StateError> {
        let bad = |problem: &str| StateError::BadQueue {
            queue: spec.name.clone(),
            problem: problem.to_string(),
        };
        if spec.name.trim().is_empty() {
            return Err(bad("name must not be empty"));
        }
        if self.queue_by_name.contains_key(&spec.name) {
            return Err(bad("already exists"));
        }
        if spec.weight == 0 {
            return Err(bad("weight must be at least 1"));
        }
        let parent = match &spec.parent {
            Some(p) => Some(
                self.queue_index(p)
                    .ok_or_else(|| bad(&format!("parent {p:?} does not exist")))?,
            ),
            None => None,
        };
        let id = self.queues.len() as QueueId;
        let mut path = vec![id];
        if let Some(p) = parent {
            path.extend(self.queues[p as usize].path.iter().copied());
        }
        let info = QueueInfo {
            spec,
            parent,
            path,
            children: Vec::new(),
        };
        self.queue_by_name.insert(info.spec.name.clone(), id);
        self.queues.push(info);
        self.names_version = NamesVersion::fresh();
        if let Some(p) = parent {
            self.queues[p as usize].children.push(id);
        }
        self.preemptible_by_queue.push(BTreeSet::new());
        self.capacity.usage.push(Resources::ZERO);
        self.capacity.fixed.push(Resources::ZERO);
        self.capacity.demand.push(Resources::ZERO);
        self.capacity.recompute_demand(&self.queues);
        Ok(id)
    }

    /// Checks that the queue tree promises no more than it has: at every
    /// queue, the children's nominal quotas add up to at most its own, and the
    /// top-level queues' add up to at most the cluster (healthy, schedulable
    /// capacity). A tree that guarantees more than exists breaks guarantees
    /// silently; callers that know the whole cluster (the simulator, a config
    /// check) call this once nodes and queues are in.
    pub fn check_quota_tree(&self) -> Result<(), StateError> {
        for res in Resource::ALL {
            let sum = |kids: &mut dyn Iterator<Item = &QueueInfo>| -> u64 {
                kids.filter_map(|q| q.spec.quota.nominal.get(res)).sum()
            };
            for q in &self.queues {
                let Some(nom) = q.spec.quota.nominal.get(res) else {
                    continue;
                };
                let kids = sum(&mut q.children.iter().map(|c| &self.queues[*c as usize]));
                if kids > nom {
                    return Err(StateError::BadQueue {
                        queue: q.spec.name.clone(),
                        problem: format!(
                            "its children's nominal quotas add up to {kids} {res} but its own nominal is {nom}"
                        ),
                    });
                }
            }
            let top = sum(&mut self.queues.iter().filter(|q| q.parent.is_none()));
            let have = self.total.get(res);
            if top > have {
                return Err(StateError::BadQueue {
                    queue: self
                        .queues
                        .iter()
                        .filter(|q| q.parent.is_none() && q.spec.quota.nominal.get(res).is_some())
                        .map(|q| q.spec.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    problem: format!(
                        "top-level nominal quotas add up to {top} {res} but the cluster has {have}"
                    ),
                });
            }
        }
        Ok(())
    }

    /// Whether [`ClusterState::add_node`] would accept `spec`, without
    /// changing anything: the server checks a registration, stores it, then
    /// adds it, instead of adding it to a copy of the whole state.
    pub fn check_new_node(&self, spec: &NodeSpec) -> Result<(), StateError> {
        let bad = |problem: String| StateError::BadNode {
            node: spec.name.clone(),
            problem,
        };
        if self.node_by_name.contains_key(&spec.name) {
            return Err(StateError::DuplicateNode(spec.name.clone()));
        }
        if spec.gpus.len() > MAX_GPUS_PER_NODE {
            return Err(bad(format!(
                "{} GPUs; at most {MAX_GPUS_PER_NODE} per node are supported",
                spec.gpus.len()
            )));
        }
        if let Some(first) = spec.gpus.first() {
            if spec
                .gpus
                .iter()
                .any(|g| g.model != first.model || g.memory_mib() != first.memory_mib())
            {
                return Err(bad(
                    "all GPUs of a node must have the same model and memory".into(),
                ));
            }
            let mut seen = BTreeSet::new();
            if !spec.gpus.iter().all(|g| seen.insert(g.index)) {
                return Err(bad("GPU indices must be unique".into()));
            }
            let known = self
                .classes
                .iter()
                .any(|c| c.model == first.model && c.memory_mib == first.memory_mib());
            if !known && self.classes.len() == MAX_GPU_CLASSES {
                return Err(bad("too many distinct GPU models".into()));
            }
        }
        if let Some(l) = self.leaf_by_name.get(&spec.leaf) {
            // A known leaf stays under its spine (a new spine name is another spine).
            let leaf_spine = self.leaves[*l as usize].spine;
            if self.spine_by_name.get(&spec.spine) != Some(&leaf_spine) {
                return Err(bad(format!(
                    "leaf {:?} is already under spine {:?}",
                    spec.leaf, self.spines[leaf_spine as usize].name
                )));
            }
        }
        Ok(())
    }

    /// Registers a node.
    pub fn add_node(&mut self, spec: NodeSpec) -> Result<NodeIdx, StateError> {
        // Every refusal is decided here, before anything changes: what
        // follows only adds the node.
        self.check_new_node(&spec)?;
        let mut class = None;
        let mut new_class = false;
        if let Some(first) = spec.gpus.first() {
            let n = spec.gpus.len() as u32;
            let mig = spec.gpus.iter().filter(|g| g.mig).count() as u64;
            let pos = self
                .classes
                .iter()
                .position(|c| c.model == first.model && c.memory_mib == first.memory_mib());
            let c = match pos {
                Some(c) => {
                    let cl = &mut self.classes[c];
                    cl.max_gpus = cl.max_gpus.max(n);
                    cl.total_gpus += u64::from(n);
                    cl.mig_gpus += mig;
                    c
                }
                None => {
                    self.classes.push(GpuClass {
                        model: first.model.clone(),
                        memory_mib: first.memory_mib(),
                        max_gpus: n,
                        total_gpus: u64::from(n),
                        mig_gpus: mig,
                    });
                    self.capacity
                        .index
                        .push(vec![Bitset::default(); MAX_GPUS_PER_NODE + 1]);
                    new_class = true;
                    self.classes.len() - 1
                }
            };
            class = Some(c as u16);
        }
        let spine = match self.spine_by_name.get(&spec.spine) {
            Some(s) => *s,
            None => {
                let s = self.spines.len() as u32;
                self.spines.push(Spine {
                    name: spec.spine.clone(),
                    leaves: Vec::new(),
                });
                self.spine_by_name.insert(spec.spine.clone(), s);
                s
            }
        };
        let leaf = match self.leaf_by_name.get(&spec.leaf) {
            // Under `spine`: checked above.
            Some(l) => *l,
            None => {
                let l = self.leaves.len() as u32;
                self.leaves.push(Leaf {
                    name: spec.leaf.clone(),
                    spine,
                    nodes: Vec::new(),
                });
                self.leaf_by_name.insert(spec.leaf.clone(), l);
                self.spines[spine as usize].leaves.push(l);
                self.capacity.leaf_free.push(0);
                l
            }
        };
        let mut islands: BTreeMap<u32, u64> = BTreeMap::new();
        let mut healthy = 0u64;
        for (i, g) in spec.gpus.iter().enumerate() {
            *islands.entry(g.island).or_default() |= 1 << i;
            if g.assignable() {
                healthy |= 1 << i;
            }
        }
        let idx = self.nodes.len() as NodeIdx;
        self.multi_island |= islands.len() > 1;
        self.max_node_cpu = self.max_node_cpu.max(spec.cpu_millis);
        self.max_node_mem = self.max_node_mem.max(spec.memory_mib);
        self.node_by_name.insert(spec.name.clone(), idx);
        self.leaves[leaf as usize].nodes.push(idx);
        let info = NodeInfo {
            class,
            leaf,
            spine,
            islands: islands.into_values().collect(),
            healthy,
            ready: true,
            spec,
            spec_version: self.next_spec_version(),
        };
        let cap = &mut self.capacity;
        cap.free.push(0);
        cap.alloc.push(0);
        cap.free_cpu.push(info.spec.cpu_millis);
        cap.free_mem.push(info.spec.memory_mib);
        for per_class in &mut cap.index {
            for b in per_class.iter_mut() {
                b.grow(self.nodes.len() + 1);
            }
        }
        if new_class {
            self.refresh_class_masks();
        }
        self.total += Self::contribution(&info);
        self.nodes.push(info);
        self.names_version = NamesVersion::fresh();
        self.node_jobs.push(Vec::new());
        self.node_touched.push(0);
        self.capacity.refresh_node(&self.nodes, idx);
        self.touch(idx);
        Ok(idx)
    }

    /// A new GPU class appeared: jobs may now match it.
    fn refresh_class_masks(&mut self) {
        let masks: Vec<(JobId, u64)> = self
            .jobs
            .values()
            .map(|j| (j.id, self.class_mask(&j.spec)))
            .collect();
        for (id, m) in masks {
            if let Some(j) = self.jobs.get_mut(&id) {
                j.gang.class_mask = m;
            }
        }
        for level in self.pending.values_mut() {
            for set in level.values_mut() {
                for g in set.values_mut() {
                    if let Some(j) = self.jobs.get(&g.id) {
                        g.class_mask = j.gang.class_mask;
                    }
                }
            }
        }
    }

    /// What a node adds to the schedulable total.
    fn contribution(n: &NodeInfo) -> Resources {
        if !n.schedulable() {
            return Resources::ZERO;
        }
        Resources {
            gpus: u64::from(n.healthy.count_ones()),
            cpu_millis: n.spec.cpu_millis,
            memory_mib: n.spec.memory_mib,
        }
    }

    /// Changes node `n` with `f`, keeping the free index and the total in step.
    fn update_node(&mut self, n: NodeIdx, f: impl FnOnce(&mut NodeInfo)) {
        let before = Self::contribution(&self.nodes[n as usize]);
        f(&mut self.nodes[n as usize]);
        let after = Self::contribution(&self.nodes[n as usize]);
        self.total = self.total - before + after;
        self.capacity.refresh_node(&self.nodes, n);
        self.touch(n);
    }

    /// A spec version no node has had ([`NodeInfo::spec_version`]).
    fn next_spec_version(&mut self) -> u64 {
        self.spec_versions += 1;
        self.spec_versions
    }

    /// Gives node `n` a new spec version: its spec is about to change.
    fn touch_spec(&mut self, n: NodeIdx) {
        let version = self.next_spec_version();
        self.nodes[n as usize].spec_version = version;
        self.touch(n);
    }

    /// Records that something shown of node `n` changed.
    fn touch(&mut self, n: NodeIdx) {
        self.touches += 1;
        if let Some(t) = self.node_touched.get_mut(n as usize) {
            *t = self.touches;
        }
    }

    /// How many node changes were recorded so far: a mark to pass to
    /// [`ClusterState::nodes_touched_since`] later.
    pub fn node_touches(&self) -> u64 {
        self.touches
    }

    /// The nodes whose spec, readiness, health, allocation or jobs changed
    /// after mark `since` ([`ClusterState::node_touches`]), in index order.
    /// A walk of one integer per node, no node data read.
    pub fn nodes_touched_since(&self, since: u64) -> impl Iterator<Item = NodeIdx> + '_ {
        self.node_touched
            .iter()
            .enumerate()
            .filter(move |(_, t)| **t > since)
            .map(|(i, _)| i as NodeIdx)
    }

    fn node_mut(&mut self, node: &str) -> Result<NodeIdx, StateError> {
        self.node_index(node)
            .ok_or_else(|| StateError::UnknownNode(node.to_string()))
    }

    /// Marks one GPU (by position in the node's list) healthy or not.
    /// An unhealthy GPU is never assigned again until it is marked healthy.
    pub fn set_gpu_health(
        &mut self,
        node: &str,
        gpu: usize,
        healthy: bool,
    ) -> Result<(), StateError> {
        let n = self.node_mut(node)?;
        if gpu >= self.nodes[n as usize].spec.gpus.len() {
            return Err(StateError::BadNode {
                node: node.to_string(),
                problem: format!("has no GPU at position {gpu}"),
            });
        }
        self.touch_spec(n);
        self.update_node(n, |info| {
            info.spec.gpus[gpu].healthy = healthy;
            if healthy {
                info.spec.gpus[gpu].reason = None;
            }
            if info.spec.gpus[gpu].assignable() {
                info.healthy |= 1 << gpu;
            } else {
                info.healthy &= !(1 << gpu);
            }
        });
        Ok(())
    }

    /// Records why a GPU (by position in the node's list) is unhealthy, as
    /// its agent or an admin said; `None` forgets it.
    pub fn set_gpu_reason(
        &mut self,
        node: &str,
        gpu: usize,
        reason: Option<String>,
    ) -> Result<(), StateError> {
        let n = self.node_mut(node)?;
        if gpu >= self.nodes[n as usize].spec.gpus.len() {
            return Err(StateError::BadNode {
                node: node.to_string(),
                problem: format!("has no GPU at position {gpu}"),
            });
        }
        self.touch_spec(n);
        self.update_node(n, |info| info.spec.gpus[gpu].reason = reason);
        Ok(())
    }

    /// Cordons (no new work) or uncordons a node.
    pub fn set_cordoned(&mut self, node: &str, cordoned: bool) -> Result<(), StateError> {
        let n = self.node_mut(node)?;
        self.touch_spec(n);
        self.update_node(n, |info| info.spec.cordoned = cordoned);
        Ok(())
    }

    /// Records where a node and its agent are reached (they may change when
    /// the agent restarts); scheduling does not depend on them.
    pub fn set_endpoint(
        &mut self,
        node: &str,
        address: &str,
        agent_url: Option<String>,
    ) -> Result<(), StateError> {
        let n = self.node_mut(node)?;
        self.touch_spec(n);
        let spec = &mut self.nodes[n as usize].spec;
        spec.address = address.to_string();
        spec.agent_url = agent_url;
        Ok(())
    }

    /// Marks a node Ready or NotReady (missed heartbeats).
    pub fn set_ready(&mut self, node: &str, ready: bool) -> Result<(), StateError> {
        let n = self.node_mut(node)?;
        self.update_node(n, |info| info.ready = ready);
        Ok(())
    }

    // ---------- validation ----------

    /// Class mask of GPU classes a replica may use.
    pub fn class_mask(&self, spec: &JobSpec) -> u64 {
        let r = &spec.resources;
        let mut m = 0u64;
        for (i, c) in self.classes.iter().enumerate() {
            let model_ok = r
                .gpu_model
                .as_ref()
                .is_none_or(|x| gpu_model_matches(x, &c.model));
            let mem_ok = r
                .min_gpu_memory_gib
                .is_none_or(|x| gpu_memory_fits(c.memory_mib, x));
            if model_ok && mem_ok {
                m |= 1 << i;
            }
        }
        m
    }

    /// Rejects requests this cluster and its queues could never satisfy, naming the field.
    pub fn validate(&self, spec: &JobSpec) -> Result<QueueId, Rejection> {
        spec.validate()?;
        let q = self
            .queue_index(&spec.queue)
            .ok_or_else(|| Rejection::UnknownQueue(spec.queue.clone()))?;
        let r = &spec.resources;
        let per = r.resources();
        let min_gang = u64::from(spec.min_gang());
        if r.gpus > 0 {
            if self.classes.is_empty() {
                return Err(Rejection::NoGpuNodes { need: r.gpus });
            }
            if let Some(model) = &r.gpu_model {
                if !self
                    .classes
                    .iter()
                    .any(|c| gpu_model_matches(model, &c.model))
                {
                    let mut names: Vec<&str> =
                        self.classes.iter().map(|c| c.model.as_str()).collect();
                    names.sort_unstable();
                    names.dedup();
                    return Err(Rejection::NoSuchModel {
                        model: model.clone(),
                        available: if names.is_empty() {
                            "none".into()
                        } else {
                            names.join(", ")
                        },
                    });
                }
            }
            let mask = self.class_mask(spec);
            if mask == 0 {
                let max = self
                    .classes
                    .iter()
                    .filter(|c| {
                        r.gpu_model
                            .as_ref()
                            .is_none_or(|x| gpu_model_matches(x, &c.model))
                    })
                    .map(|c| c.memory_mib)
                    .max()
                    .unwrap_or(0);
                return Err(Rejection::GpuMemory {
                    need: r.min_gpu_memory_gib.unwrap_or(0),
                    max_mib: max,
                });
            }
            let whole = self
                .classes
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .any(|(_, c)| c.mig_gpus < c.total_gpus);
            if !whole {
                let mut names: Vec<&str> = self
                    .classes
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, c)| c.model.as_str())
                    .collect();
                names.dedup();
                return Err(Rejection::MigOnly {
                    model: names.join(", "),
                });
            }
            let max_node = self.max_node_gpus(mask);
            if u64::from(r.gpus) > max_node {
                return Err(Rejection::ReplicaTooLarge {
                    need: r.gpus.into(),
                    max: max_node,
                });
            }
            let need = min_gang * u64::from(r.gpus);
            if spec.topology == TopologyConstraint::Node && need > max_node {
                return Err(Rejection::GangTooLargeForNode {
                    need,
                    max: max_node,
                });
            }
            if spec.topology == TopologyConstraint::Leaf {
                let max_leaf = self.max_leaf_gpus(mask);
                if need > max_leaf {
                    return Err(Rejection::GangTooLargeForLeaf {
                        need,
                        max: max_leaf,
                    });
                }
            }
            let have: u64 = self
                .classes
                .iter()
                .enumerate()
                .filter(|(c, _)| mask & (1 << c) != 0)
                .map(|(_, c)| c.total_gpus)
                .sum();
            if need > have {
                return Err(Rejection::ExceedsCluster { need, have });
            }
        }
        for (res, need, max) in [
            (Resource::CpuMillis, per.cpu_millis, self.max_node_cpu),
            (Resource::MemoryMib, per.memory_mib, self.max_node_mem),
        ] {
            if need > max {
                return Err(Rejection::ReplicaResourceTooLarge {
                    resource: res,
                    unit: res.unit(),
                    need,
                    max,
                });
            }
        }
        let gang = per * min_gang;
        for &n in &self.queues[q as usize].path {
            let quota = &self.queues[n as usize].spec.quota;
            for res in Resource::ALL {
                let Some(nom) = quota.nominal.get(res) else {
                    continue;
                };
                let (limit, kind) = if !spec.is_preemptible() {
                    (nom, "nominal (non-preemptible jobs cannot borrow)")
                } else if let Some(b) = quota.borrowing_limit.get(res) {
                    (nom + b, "nominal + borrowing limit")
                } else {
                    continue;
                };
                if gang.get(res) > limit {
                    return Err(Rejection::ExceedsQueueLimit {
                        queue: self.queues[n as usize].spec.name.clone(),
                        resource: res,
                        need: gang.get(res),
                        limit,
                        limit_kind: kind,
                    });
                }
            }
        }
        Ok(q)
    }

    /// Largest GPU count of a node in the classes of `mask`.
    pub fn max_node_gpus(&self, mask: u64) -> u64 {
        self.classes
            .iter()
            .enumerate()
            .filter(|(i, _)| mask & (1 << i) != 0)
            .map(|(_, c)| u64::from(c.max_gpus))
            .max()
            .unwrap_or(0)
    }

    fn max_leaf_gpus(&self, mask: u64) -> u64 {
        self.leaves
            .iter()
            .map(|l| {
                l.nodes
                    .iter()
                    .map(|&n| &self.nodes[n as usize])
                    .filter(|n| n.class.is_some_and(|c| mask & (1 << c) != 0))
                    .map(|n| n.spec.gpus.len() as u64)
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0)
    }

    // ---------- job lifecycle ----------

    /// Accepts a job as pending after validating it.
    pub fn submit(&mut self, id: JobId, spec: JobSpec, now: Time) -> Result<(), Rejection> {
        if self.jobs.contains_key(&id) {
            return Err(Rejection::DuplicateJob(id));
        }
        let queue = self.validate(&spec)?;
        let prediction = match spec.runtime_seconds {
            Some(_) => None,
            None => self.predictor.predict(&key_of(&spec)),
        };
        let limit = spec.time_limit_seconds();
        let cap = |s: u64| limit.map_or(s, |l| s.min(l));
        let gang = Gang {
            id,
            queue,
            priority: spec.priority.value(),
            per: spec.resources.resources(),
            replicas: spec.replicas,
            min: spec.min_gang(),
            class_mask: self.class_mask(&spec),
            topology: spec.topology,
            preemptible: spec.is_preemptible(),
            // An enforced time limit bounds both the planning bound and the
            // expectation; without a stated run time the learned prediction.
            runtime: spec
                .runtime_bound()
                .or(prediction.map(|p| cap(p.quantile(0.9)))),
            expected_runtime: spec
                .runtime_seconds
                .or(prediction.map(|p| p.median()))
                .map(cap)
                .or(limit),
            avoids: false,
        };
        let job = Job {
            id,
            gang,
            priority: spec.priority.value(),
            spec,
            queue,
            submitted: now,
            status: JobStatus::Pending,
            requeues: 0,
            preemptions: 0,
            last_preempted: None,
            prediction,
            rank: 0,
            avoid: None,
        };
        self.push_pending(&job);
        self.jobs.insert(id, job);
        Ok(())
    }

    fn push_pending(&mut self, job: &Job) {
        self.push_pending_key(PendingKey::of(job));
    }

    fn push_pending_key(&mut self, k: PendingKey) {
        self.pending
            .entry(Reverse(k.priority))
            .or_default()
            .entry(k.queue)
            .or_default()
            .insert((k.rank, k.submitted, k.id), k.gang);
        self.pending_count += 1;
    }

    fn pop_pending(&mut self, job: &Job) {
        self.pop_pending_key(PendingKey::of(job));
    }

    fn pop_pending_key(&mut self, k: PendingKey) {
        let key = Reverse(k.priority);
        if let Some(level) = self.pending.get_mut(&key) {
            if let Some(set) = level.get_mut(&k.queue) {
                if set.remove(&(k.rank, k.submitted, k.id)).is_some() {
                    self.pending_count -= 1;
                }
                if set.is_empty() {
                    level.remove(&k.queue);
                }
            }
            if level.is_empty() {
                self.pending.remove(&key);
            }
        }
    }

    fn status_name(s: &JobStatus) -> &'static str {
        match s {
            JobStatus::Pending => "pending",
            JobStatus::Running(r) if r.preempting.is_some() => "preempting",
            JobStatus::Running(_) => "running",
        }
    }

    /// Binds a pending job to `placement`. Fails, changing nothing, if any GPU
    /// is not free or a node lacks CPU/memory: a GPU is never double-booked.
    pub fn bind(&mut self, id: JobId, placement: Placement, now: Time) -> Result<(), StateError> {
        let job = self.jobs.get(&id).ok_or(StateError::UnknownJob(id))?;
        if job.status != JobStatus::Pending {
            return Err(StateError::WrongStatus {
                job: id,
                actual: Self::status_name(&job.status),
                expected: "pending",
            });
        }
        let per = job.per_replica();
        let n_rep = placement.replicas.len() as u32;
        if n_rep < job.spec.min_gang() || n_rep > job.spec.replicas {
            return Err(StateError::Conflict {
                job: id,
                node: String::new(),
                why: "replica count outside min_replicas..=replicas",
            });
        }
        // Check the whole gang before touching anything: all or nothing.
        let mut need: BTreeMap<NodeIdx, (u64, u64, u64)> = BTreeMap::new();
        for rp in &placement.replicas {
            let Some(info) = self.nodes.get(rp.node as usize) else {
                return Err(StateError::UnknownNode(rp.node.to_string()));
            };
            let conflict = |why| StateError::Conflict {
                job: id,
                node: info.spec.name.clone(),
                why,
            };
            if u64::from(rp.gpus.count_ones()) != per.gpus {
                return Err(conflict("replica GPU count differs from the spec"));
            }
            let e = need.entry(rp.node).or_default();
            if e.0 & rp.gpus != 0 {
                return Err(conflict("two replicas share a GPU"));
            }
            e.0 |= rp.gpus;
            e.1 += per.cpu_millis;
            e.2 += per.memory_mib;
        }
        for (&n, &(mask, cpu, mem)) in &need {
            let info = &self.nodes[n as usize];
            let conflict = |why| StateError::Conflict {
                job: id,
                node: info.spec.name.clone(),
                why,
            };
            if self.capacity.free[n as usize] & mask != mask {
                return Err(conflict("GPU not free"));
            }
            if self.capacity.free_cpu[n as usize] < cpu {
                return Err(conflict("not enough CPU"));
            }
            if self.capacity.free_mem[n as usize] < mem {
                return Err(conflict("not enough memory"));
            }
        }
        for (&n, &(mask, cpu, mem)) in &need {
            self.capacity.take(&self.nodes, n, mask, cpu, mem);
            self.node_jobs[n as usize].push(id);
            self.touch(n);
        }
        let job = self
            .jobs
            .get(&id)
            .ok_or(StateError::UnknownJob(id))?
            .clone();
        self.pop_pending(&job);
        self.capacity.charge(
            &self.queues,
            job.queue,
            per * u64::from(n_rep),
            true,
            !job.spec.is_preemptible(),
        );
        let est_end = now
            + job
                .gang
                .expected_runtime
                .unwrap_or(self.config.unknown_runtime_floor_seconds)
                .max(1);
        self.running_by_end.insert(
            (est_end, id),
            EndBasis {
                started: now,
                runtime: job.spec.runtime_seconds,
                prediction: job.prediction,
            },
        );
        self.claims.remove(&id);
        if job.spec.is_preemptible() {
            self.preemptible_by_queue[job.queue as usize].insert(id);
            *self.preemptible_prios.entry(job.priority).or_default() += 1;
        }
        if let Some(j) = self.jobs.get_mut(&id) {
            j.status = JobStatus::Running(RunInfo {
                started: now,
                placement,
                est_end,
                preempting: None,
                last_checkpoint: None,
            });
            // The avoidance was for this placement only.
            j.avoid = None;
            j.gang.avoids = false;
            self.victims.insert(j);
        }
        Ok(())
    }

    /// Sets (or, with `None` or no nodes, clears) the nodes a pending job's
    /// next placement avoids, until `avoid.until`: every way the job can be
    /// placed (a cycle's pass, the plan and start estimates, a preemption's
    /// what-if) keeps off them. Binding the job clears it. Nodes that do not
    /// exist are dropped.
    pub fn set_avoid(&mut self, id: JobId, avoid: Option<Avoid>) -> Result<(), StateError> {
        let n = self.nodes.len() as NodeIdx;
        let avoid = avoid
            .map(|mut a| {
                a.nodes.retain(|x| *x < n);
                a.nodes.sort_unstable();
                a.nodes.dedup();
                a
            })
            .filter(|a| !a.nodes.is_empty());
        let job = self.jobs.get(&id).ok_or(StateError::UnknownJob(id))?;
        let pending = (job.status == JobStatus::Pending).then(|| PendingKey::of(job));
        if let Some(key) = pending {
            self.pop_pending_key(key);
        }
        let j = self.jobs.get_mut(&id).ok_or(StateError::UnknownJob(id))?;
        j.gang.avoids = avoid.is_some();
        j.avoid = avoid;
        if pending.is_some() {
            let key = PendingKey::of(j);
            self.push_pending_key(key);
        }
        Ok(())
    }

    fn running_mut(&mut self, id: JobId) -> Result<&mut RunInfo, StateError> {
        let job = self.jobs.get_mut(&id).ok_or(StateError::UnknownJob(id))?;
        let actual = Self::status_name(&job.status);
        match &mut job.status {
            JobStatus::Running(r) => Ok(r),
            JobStatus::Pending => Err(StateError::WrongStatus {
                job: id,
                actual,
                expected: "running",
            }),
        }
    }

    /// Changes a job's numeric priority (pending or running). Policies that
    /// rank by attained service or remaining time (Tiresias, SRTF baselines)
    /// use this between cycles.
    pub fn set_priority(&mut self, id: JobId, priority: i32) -> Result<(), StateError> {
        // Policies call this for every job every cycle, mostly with the
        // priority it already has: no copy of the job unless it changes.
        let job = self.jobs.get(&id).ok_or(StateError::UnknownJob(id))?;
        if job.priority == priority {
            return Ok(());
        }
        let (old, queue) = (job.priority, job.queue);
        if job.status == JobStatus::Pending {
            let key = PendingKey::of(job);
            self.pop_pending_key(key);
            let j = self.jobs.get_mut(&id).ok_or(StateError::UnknownJob(id))?;
            j.priority = priority;
            j.gang.priority = priority;
            let key = PendingKey::of(j);
            self.push_pending_key(key);
        } else {
            if self.preemptible_by_queue[queue as usize].contains(&id) {
                if let Some(c) = self.preemptible_prios.get_mut(&old) {
                    *c -= 1;
                    if *c == 0 {
                        self.preemptible_prios.remove(&old);
                    }
                }
                *self.preemptible_prios.entry(priority).or_default() += 1;
            }
            let j = self.jobs.get_mut(&id).ok_or(StateError::UnknownJob(id))?;
            self.victims.remove(j);
            j.priority = priority;
            j.gang.priority = priority;
            self.victims.insert(j);
        }
        Ok(())
    }

    /// Changes a job's rank inside its queue (lower goes first). Fair share
    /// and quotas between queues are unaffected: a policy may order a queue's
    /// own jobs (by attained service, predicted remaining work, aging) without
    /// taking anything from other queues.
    pub fn set_rank(&mut self, id: JobId, rank: i64) -> Result<(), StateError> {
        let job = self.jobs.get(&id).ok_or(StateError::UnknownJob(id))?;
        if job.rank == rank {
            return Ok(());
        }
        let pending = (job.status == JobStatus::Pending).then(|| PendingKey::of(job));
        if let Some(key) = pending {
            self.pop_pending_key(key);
        }
        let j = self.jobs.get_mut(&id).ok_or(StateError::UnknownJob(id))?;
        j.rank = rank;
        if pending.is_some() {
            let key = PendingKey::of(j);
            self.push_pending_key(key);
        }
        Ok(())
    }

    /// Records that the checkpoint signal was sent to `id` on behalf of `by`;
    /// the job keeps its GPUs until it exits (then call [`Self::requeue`]).
    pub fn mark_preempting(&mut self, id: JobId, by: JobId, now: Time) -> Result<(), StateError> {
        self.running_mut(id)?;
        if let Some(j) = self.jobs.get(&id) {
            // Stopping: no longer a victim candidate.
            self.victims.remove(j);
        }
        let r = self.running_mut(id)?;
        let first = r.preempting.is_none();
        r.preempting.get_or_insert(now);
        self.preempting.insert(id, by);
        if let Some(j) = self.jobs.get_mut(&id) {
            if first {
                j.preemptions = j.preemptions.saturating_add(1);
            }
            j.last_preempted = Some(now);
        }
        Ok(())
    }

    /// Records where a preemptor will start; its victims' GPUs are held for it.
    pub fn record_claim(&mut self, job: JobId, placement: Placement) -> Result<(), StateError> {
        let j = self.jobs.get(&job).ok_or(StateError::UnknownJob(job))?;
        if j.status != JobStatus::Pending {
            return Err(StateError::WrongStatus {
                job,
                actual: "running",
                expected: "pending",
            });
        }
        self.claims.insert(job, placement);
        Ok(())
    }

    /// Drops a claim (the preemptor could not use it).
    pub fn drop_claim(&mut self, job: JobId) {
        self.claims.remove(&job);
    }

    /// Held placements of preemptors that have not started.
    pub fn claims(&self) -> impl Iterator<Item = (JobId, &Placement)> + '_ {
        self.claims.iter().map(|(j, p)| (*j, p))
    }

    /// Victims in their grace period and who they were preempted for.
    pub fn preempting(&self) -> impl Iterator<Item = (JobId, JobId)> + '_ {
        self.preempting.iter().map(|(v, b)| (*v, *b))
    }

    /// Records a checkpoint the job reported (reduces the work a preemption loses).
    pub fn record_checkpoint(&mut self, id: JobId, at: Time) -> Result<(), StateError> {
        self.running_mut(id)?;
        if let Some(j) = self.jobs.get_mut(&id) {
            self.victims.remove(j);
            if let JobStatus::Running(r) = &mut j.status {
                r.last_checkpoint = Some(at);
            }
            self.victims.insert(j);
        }
        Ok(())
    }

    fn release(&mut self, id: JobId) -> Result<Job, StateError> {
        let job = self.jobs.get(&id).ok_or(StateError::UnknownJob(id))?;
        let JobStatus::Running(run) = &job.status else {
            return Err(StateError::WrongStatus {
                job: id,
                actual: "pending",
                expected: "running",
            });
        };
        self.victims.remove(job);
        let run = run.clone();
        let queue = job.queue;
        let per = job.per_replica();
        for rp in &run.placement.replicas {
            self.capacity.give(
                &self.nodes,
                rp.node,
                rp.gpus,
                per.cpu_millis,
                per.memory_mib,
            );
            let v = &mut self.node_jobs[rp.node as usize];
            if let Some(p) = v.iter().position(|j| *j == id) {
                v.swap_remove(p);
            }
            self.touches += 1;
            if let Some(t) = self.node_touched.get_mut(rp.node as usize) {
                *t = self.touches;
            }
        }
        let fixed = !job.spec.is_preemptible();
        self.capacity.charge(
            &self.queues,
            queue,
            per * run.placement.replicas.len() as u64,
            false,
            fixed,
        );
        self.running_by_end.remove(&(run.est_end, id));
        self.preempting.remove(&id);
        if !fixed && self.preemptible_by_queue[queue as usize].remove(&id) {
            let prio = self.jobs.get(&id).map_or(0, |j| j.priority);
            if let Some(c) = self.preemptible_prios.get_mut(&prio) {
                *c -= 1;
                if *c == 0 {
                    self.preemptible_prios.remove(&prio);
                }
            }
        }
        let job = self.jobs.get_mut(&id).ok_or(StateError::UnknownJob(id))?;
        job.status = JobStatus::Pending;
        Ok(job.clone())
    }

    /// A running job ended (success, failure or kill): frees its GPUs and forgets it.
    pub fn finish(&mut self, id: JobId) -> Result<Job, StateError> {
        let job = self.release(id)?;
        self.jobs.remove(&id);
        Ok(job)
    }

    /// A running job was stopped (preempted, or its gang failed): frees its GPUs
    /// and puts it back in line, keeping its submission time.
    pub fn requeue(&mut self, id: JobId) -> Result<(), StateError> {
        let job = self.release(id)?;
        self.push_pending(&job);
        if let Some(j) = self.jobs.get_mut(&id) {
            j.requeues += 1;
        }
        Ok(())
    }

    /// Removes a job in any state (cancellation).
    pub fn cancel(&mut self, id: JobId) -> Result<Job, StateError> {
        let job = self.jobs.get(&id).ok_or(StateError::UnknownJob(id))?;
        if matches!(job.status, JobStatus::Running(_)) {
            return self.finish(id);
        }
        let job = job.clone();
        self.pop_pending(&job);
        self.claims.remove(&id);
        self.jobs.remove(&id);
        Ok(job)
    }

    /// Checks the internal indexes against a recount from scratch; used by
    /// tests and debug assertions. Returns a description of the first mismatch.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut alloc = vec![0u64; self.nodes.len()];
        let mut cpu = vec![0u64; self.nodes.len()];
        let mut mem = vec![0u64; self.nodes.len()];
        let mut usage = vec![Resources::ZERO; self.queues.len()];
        for j in self.jobs.values() {
            if let JobStatus::Running(r) = &j.status {
                for rp in &r.placement.replicas {
                    let n = rp.node as usize;
                    if alloc[n] & rp.gpus != 0 {
                        return Err(format!("GPU double-booked on node {n} by job {}", j.id));
                    }
                    alloc[n] |= rp.gpus;
                    cpu[n] += j.spec.resources.cpu_millis;
                    mem[n] += j.spec.resources.memory_mib;
                }
                for &q in &self.queues[j.queue as usize].path {
                    usage[q as usize] += j.usage(r.placement.replicas.len() as u32);
                }
            }
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if alloc[i] != self.capacity.alloc[i] {
                return Err(format!("alloc mask mismatch on node {i}"));
            }
            if cpu[i] > n.spec.cpu_millis || mem[i] > n.spec.memory_mib {
                return Err(format!("node {i} overcommitted"));
            }
            let want = if n.schedulable() {
                n.healthy & !alloc[i]
            } else {
                0
            };
            if want != self.capacity.free[i] {
                return Err(format!("free mask mismatch on node {i}"));
            }
            if let Some(c) = n.class {
                for (k, b) in self.capacity.index[c as usize].iter().enumerate() {
                    let expect = n.schedulable() && k == want.count_ones() as usize;
                    if b.contains(i) != expect {
                        return Err(format!("index mismatch on node {i} bucket {k}"));
                    }
                }
            }
        }
        if usage != self.capacity.usage {
            return Err("queue usage mismatch".into());
        }
        let mut running = 0;
        for j in self.jobs.values() {
            if let JobStatus::Running(r) = &j.status {
                running += 1;
                if self.running_by_end.get(&(r.est_end, j.id)) != j.end_basis().as_ref() {
                    return Err(format!("running index mismatch for job {}", j.id));
                }
            }
        }
        if running != self.running_by_end.len() {
            return Err("running index holds jobs that are not running".into());
        }
        if self.victims != crate::victims::VictimClasses::of(self.jobs.values()) {
            return Err("victim index mismatch".into());
        }
        Ok(())
    }
}
