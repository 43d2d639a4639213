//! The scheduler's model of the cluster: nodes, queues, jobs and where they
//! run, as plain data. [`crate::state::ClusterState`] keeps them and their
//! indexes; the free-capacity view ([`crate::capacity`]) and the victim
//! index read them. A leaf: it imports no other module of the core but the
//! run-time predictor's types.

use gangway_core::{
    JobId, JobSpec, NodeSpec, QueueSpec, Resource, Resources, Time, TopologyConstraint,
    TopologyLevel,
};
use serde::Serialize;

/// A node index into [`crate::ClusterState::nodes`].
pub type NodeIdx = u32;
/// A queue index into [`crate::ClusterState::queues`].
pub type QueueId = u32;

/// A GPU model and memory size; nodes are grouped by it in the free index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuClass {
    /// Model name.
    pub model: String,
    /// Memory per GPU in MiB.
    pub memory_mib: u64,
    /// Most GPUs any node of this class has.
    pub max_gpus: u32,
    /// GPUs of this class in the cluster (healthy or not).
    pub total_gpus: u64,
    /// Of those, GPUs with MIG enabled (never handed out whole).
    pub mig_gpus: u64,
}

/// A node plus what the scheduler derives from its spec.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    /// As registered.
    pub spec: NodeSpec,
    /// GPU class; `None` for a node without GPUs.
    pub class: Option<u16>,
    /// Leaf switch index.
    pub leaf: u32,
    /// Spine index.
    pub spine: u32,
    /// GPU masks of each NVLink island.
    pub islands: Vec<u64>,
    /// Mask of healthy GPUs.
    pub healthy: u64,
    /// NotReady nodes (missed heartbeats) get no new work.
    pub ready: bool,
    /// Changes whenever `spec` does, and is never shared by two nodes or two
    /// specs of one node, so a reader that copied the spec can tell it is
    /// unchanged without comparing it (the server's node snapshot).
    pub spec_version: u64,
}

impl NodeInfo {
    /// Whether new work may be placed here.
    pub fn schedulable(&self) -> bool {
        self.ready && !self.spec.cordoned
    }

    /// The device indices (`CUDA_VISIBLE_DEVICES`) of the GPUs in `mask`.
    pub fn device_indices(&self, mask: u64) -> Vec<u32> {
        self.spec
            .gpus
            .iter()
            .enumerate()
            .filter(|(i, _)| mask & (1 << i) != 0)
            .map(|(_, g)| g.index)
            .collect()
    }
}

/// A leaf switch (rack).
#[derive(Clone, Debug)]
pub struct Leaf {
    /// Name.
    pub name: String,
    /// Spine index.
    pub spine: u32,
    /// Its nodes, ascending.
    pub nodes: Vec<NodeIdx>,
}

/// A spine (pod).
#[derive(Clone, Debug)]
pub struct Spine {
    /// Name.
    pub name: String,
    /// Its leaves, ascending.
    pub leaves: Vec<u32>,
}

/// A queue plus its place in the tree.
#[derive(Clone, Debug)]
pub struct QueueInfo {
    /// As declared.
    pub spec: QueueSpec,
    /// Parent index; `None` under the cluster root.
    pub parent: Option<QueueId>,
    /// Itself, then its ancestors up to a top-level queue.
    pub path: Vec<QueueId>,
    /// Its children.
    pub children: Vec<QueueId>,
}

impl QueueInfo {
    /// The part of its nominal quota it never lends: siblings can not borrow it
    /// even while it is idle (nominal minus lending limit).
    pub fn floor(&self) -> Resources {
        let mut out = Resources::ZERO;
        for r in Resource::ALL {
            let (Some(nom), Some(lend)) = (
                self.spec.quota.nominal.get(r),
                self.spec.quota.lending_limit.get(r),
            ) else {
                continue;
            };
            *out.get_mut(r) = nom.saturating_sub(lend);
        }
        out
    }

    /// Whether `usage` is above nominal for some quota-managed resource.
    pub fn over_nominal(&self, usage: &Resources) -> bool {
        Resource::ALL.iter().any(|r| {
            self.spec
                .quota
                .nominal
                .get(*r)
                .is_some_and(|n| usage.get(*r) > n)
        })
    }

    /// Whether the queue has a nominal quota for any resource.
    pub fn has_nominal(&self) -> bool {
        Resource::ALL
            .iter()
            .any(|r| self.spec.quota.nominal.get(*r).is_some())
    }
}

/// One replica's GPUs on one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ReplicaPlacement {
    /// Node index.
    pub node: NodeIdx,
    /// GPU mask on that node (bit i = `spec.gpus[i]`).
    pub gpus: u64,
}

/// Where every replica of a gang runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Placement {
    /// One entry per replica, in rank order.
    pub replicas: Vec<ReplicaPlacement>,
    /// The widest topology level the gang spans.
    pub level: TopologyLevel,
}

impl Placement {
    /// Distinct nodes used, ascending.
    pub fn nodes(&self) -> Vec<NodeIdx> {
        let mut v: Vec<NodeIdx> = self.replicas.iter().map(|r| r.node).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Communication cost of the placement under `costs`: the cost of the
    /// widest topology level it spans (one island is cheapest).
    pub fn cost(&self, costs: &gangway_core::TopologyCosts) -> u32 {
        costs.of(self.level)
    }

    /// Total GPUs.
    pub fn gpus(&self) -> u64 {
        self.replicas
            .iter()
            .map(|r| u64::from(r.gpus.count_ones()))
            .sum()
    }
}

/// A running job's bookkeeping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunInfo {
    /// When it started (this attempt).
    pub started: Time,
    /// Where it runs.
    pub placement: Placement,
    /// Estimated end, for reservations and backfill.
    pub est_end: Time,
    /// Set once the checkpoint signal has been sent.
    pub preempting: Option<Time>,
    /// Last checkpoint the job reported, if any.
    pub last_checkpoint: Option<Time>,
}

/// Where a job is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobStatus {
    /// Waiting.
    Pending,
    /// Holding GPUs.
    Running(RunInfo),
}

/// The part of a pending job a scheduling cycle reads, kept inline in the
/// pending index so a cycle scans plain data instead of chasing every job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gang {
    /// Job id.
    pub id: JobId,
    /// Queue index.
    pub queue: QueueId,
    /// Numeric priority.
    pub priority: i32,
    /// Resources of one replica.
    pub per: Resources,
    /// Replicas wanted.
    pub replicas: u32,
    /// Fewest replicas it may start with.
    pub min: u32,
    /// GPU classes it may use.
    pub class_mask: u64,
    /// Topology constraint.
    pub topology: TopologyConstraint,
    /// Whether it may be preempted.
    pub preemptible: bool,
    /// Run time for backfill decisions: the declared one, else the 90th
    /// percentile of the predicted one (a backfilled job must end in time).
    pub runtime: Option<u64>,
    /// Expected (median) run time: declared, else predicted from history.
    pub expected_runtime: Option<u64>,
    /// Whether it avoids some nodes ([`Job::avoid`]): a cycle looks the set
    /// up only then.
    pub avoids: bool,
}

/// Nodes a job's next attempt may not be placed on, until a time: those
/// blamed for its last attempt's failure (a GPU fault, an agent fault), as
/// Slurm's `--requeue=expedite` holds the old nodes back. The avoidance
/// lapses at `until`, so a job the avoided nodes alone can host never waits
/// forever.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Avoid {
    /// The nodes, ascending, without repeats.
    pub nodes: Vec<NodeIdx>,
    /// When the avoidance lapses.
    pub until: Time,
}

impl Avoid {
    /// Whether it still holds at `now`.
    pub fn holds(&self, now: Time) -> bool {
        now < self.until && !self.nodes.is_empty()
    }
}

/// A job known to the scheduler.
#[derive(Clone, Debug)]
pub struct Job {
    /// Id.
    pub id: JobId,
    /// Spec as submitted.
    pub spec: JobSpec,
    /// Queue index.
    pub queue: QueueId,
    /// Numeric priority.
    pub priority: i32,
    /// Submission time; requeued jobs keep theirs so they do not lose their place.
    pub submitted: Time,
    /// Where it is.
    pub status: JobStatus,
    /// Times it was preempted or restarted.
    pub requeues: u32,
    /// Times the checkpoint signal was sent to it (its preemptions so far):
    /// the per-job preemption budget counts these.
    pub preemptions: u32,
    /// When it was last signalled to stop: a job evicted at an instant is not
    /// evicted again at that instant, so preemption always makes progress.
    pub last_preempted: Option<Time>,
    /// What the scheduler reads of it each cycle.
    pub gang: Gang,
    /// Its run time predicted from completed jobs, when it declares none.
    pub prediction: Option<crate::predict::Prediction>,
    /// Order inside its queue and priority level, lowest first (then submit
    /// time): 0 unless a policy ranks jobs within queues ([`crate::ClusterState::set_rank`]).
    pub rank: i64,
    /// Nodes its next placement avoids ([`crate::ClusterState::set_avoid`]);
    /// cleared when it is bound.
    pub avoid: Option<Avoid>,
}

impl Job {
    /// Resources of one replica.
    pub fn per_replica(&self) -> Resources {
        self.spec.resources.resources()
    }

    /// Resources the job holds (running) or would hold with `replicas`.
    pub fn usage(&self, replicas: u32) -> Resources {
        self.per_replica() * u64::from(replicas)
    }

    /// The key the run-time predictor knows it by.
    pub fn predict_key(&self) -> crate::predict::JobKey<'_> {
        key_of(&self.spec)
    }

    /// When the current run is expected to end, seen at `now`: the declared
    /// run time, else the predicted one (conditional on the time already run,
    /// so a job that outlives its estimate is not assumed to end now), else as
    /// long again as it has run (at least `floor`). `None` unless running.
    pub fn expected_end(&self, now: Time, floor: u64) -> Option<Time> {
        Some(self.end_basis()?.expected_end(now, floor))
    }

    /// What re-estimating its current run's end needs; `None` unless running.
    pub(crate) fn end_basis(&self) -> Option<EndBasis> {
        let JobStatus::Running(r) = &self.status else {
            return None;
        };
        Some(EndBasis {
            started: r.started,
            runtime: self.spec.runtime_seconds,
            prediction: self.prediction,
        })
    }

    /// GPU-seconds of work lost if preempted at `now`: work since the last checkpoint.
    pub fn lost_work_gpu_seconds(&self, now: Time) -> u64 {
        let JobStatus::Running(run) = &self.status else {
            return 0;
        };
        let gpus = run.placement.gpus();
        let since = match (run.last_checkpoint, self.spec.checkpoint.interval_seconds) {
            (Some(c), _) => now.saturating_sub(c.max(run.started)),
            (None, Some(i)) if i > 0 => now.saturating_sub(run.started) % i,
            _ => now.saturating_sub(run.started),
        };
        gpus * since
    }
}

/// What re-estimating a running job's end needs ([`Job::expected_end`]),
/// kept beside it in the running index so the plan re-estimates the jobs
/// that outlived their estimate without looking each one up: on a busy
/// 50,000-node cluster those lookups were a third of a steady cycle.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct EndBasis {
    /// When the current run started.
    pub(crate) started: Time,
    /// Its declared run time.
    pub(crate) runtime: Option<u64>,
    /// Its predicted run time, when it declares none.
    pub(crate) prediction: Option<crate::predict::Prediction>,
}

impl EndBasis {
    /// [`Job::expected_end`] of the job it was taken from.
    pub(crate) fn expected_end(&self, now: Time, floor: u64) -> Time {
        let elapsed = now.saturating_sub(self.started);
        let left = match (self.runtime, &self.prediction) {
            (Some(d), _) if self.started.saturating_add(d) > now => {
                self.started.saturating_add(d) - now
            }
            (Some(_), _) => elapsed.max(floor),
            (None, Some(p)) => p.remaining_median(elapsed),
            (None, None) => elapsed.max(floor),
        };
        now.saturating_add(left.max(1))
    }
}

/// The predictor's key of a job spec.
pub fn key_of(spec: &JobSpec) -> crate::predict::JobKey<'_> {
    crate::predict::JobKey {
        user: &spec.user,
        name: &spec.name,
        queue: &spec.queue,
        gpus: u64::from(spec.resources.gpus) * u64::from(spec.replicas),
    }
}
