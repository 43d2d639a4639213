//! FGD's fragmentation protocol (Weng et al., "Beware of Fragmentation:
//! Scheduling GPU-Sharing Workloads with Fragmentation Gradient Descent",
//! USENIX ATC '23, §6.1) for whole-GPU pods: pods sampled from the trace
//! arrive one by one and never leave, until the GPUs they asked for add up to
//! the cluster's; each is placed on arrival or fails. The figure is the GPU
//! allocation ratio (allocated ÷ total GPUs) at the end: the less a placement
//! policy fragments nodes, the higher it gets.
//!
//! Shared-GPU (fractional) pods are not part of this protocol here: Gangway
//! allocates whole GPUs, and the loader skips them with a count.

use crate::cluster::ClusterSpec;
use crate::trace::Trace;
use gangway_core::{JobId, JobSpec};
use gangway_sched::{apply, schedule, ClusterState, SchedulerConfig, StateConfig};
use serde::Serialize;

/// How pods are placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fit {
    /// Gangway's scheduling core (best fit on free GPUs, islands, topology).
    Gangway,
    /// The feasible node with the fewest free GPUs (ties: lowest index).
    BestFit,
    /// A uniformly random feasible node.
    RandomFit,
}

/// The outcome of one fill.
#[derive(Clone, Debug, Serialize)]
pub struct FillResult {
    /// Placement policy.
    pub fit: Fit,
    /// Pods that arrived.
    pub arrived: usize,
    /// Pods that could not be placed.
    pub failed: usize,
    /// GPUs requested by arrived pods ÷ cluster GPUs.
    pub arrived_ratio: f64,
    /// Allocated GPUs ÷ cluster GPUs at the end.
    pub allocation_ratio: f64,
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Fills `cluster` with whole-GPU pods sampled from `trace` under `fit`.
pub fn fill(trace: &Trace, cluster: &ClusterSpec, fit: Fit, seed: u64) -> Option<FillResult> {
    let pods: Vec<_> = trace.jobs.iter().filter(|j| j.gpus > 0).collect();
    if pods.is_empty() {
        return None;
    }
    let mut state: ClusterState = cluster
        .build(&["fill".into()], StateConfig::default())
        .ok()?;
    let total = state.total().gpus.max(1);
    let cfg = SchedulerConfig {
        backfill: gangway_sched::Backfill::Off,
        preemption: false,
        ..SchedulerConfig::default()
    };
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let (mut arrived, mut failed, mut asked) = (0usize, 0usize, 0u64);
    let mut id = 0u64;
    while asked < total {
        let p = pods[rng.below(pods.len())];
        arrived += 1;
        asked += u64::from(p.gpus);
        let max_node = state
            .classes()
            .iter()
            .map(|c| c.max_gpus)
            .max()
            .unwrap_or(1);
        let (replicas, per) = crate::engine::gang_shape(p.gpus, max_node);
        let mut spec = JobSpec::new("pod", "fill", replicas, per);
        spec.resources.cpu_millis = p.cpu_millis / u64::from(replicas);
        spec.resources.memory_mib = p.memory_mib / u64::from(replicas);
        spec.resources.gpu_model = p.gpu_model.clone();
        id += 1;
        let jid = JobId(id);
        if state.submit(jid, spec, 0).is_err() {
            failed += 1;
            continue;
        }
        let placed = match fit {
            Fit::Gangway => {
                let d = schedule(&state, 0, &cfg);
                apply(&mut state, &d, 0).is_ok() && !d.binds.is_empty()
            }
            Fit::BestFit | Fit::RandomFit => place_simple(&mut state, jid, fit, &mut rng),
        };
        if !placed {
            failed += 1;
            let _ = state.cancel(jid);
        }
    }
    Some(FillResult {
        fit,
        arrived,
        failed,
        arrived_ratio: asked as f64 / total as f64,
        allocation_ratio: (total - state.free_gpus()) as f64 / total as f64,
    })
}

/// Best fit or random fit for a single-node pod (multi-node pods use the core).
fn place_simple(state: &mut ClusterState, id: JobId, fit: Fit, rng: &mut Rng) -> bool {
    let Some(job) = state.job(id) else {
        return false;
    };
    let per = job.per_replica();
    let replicas = job.spec.replicas;
    let mask = job.gang.class_mask;
    if replicas > 1 {
        let d = schedule(state, 0, &SchedulerConfig::default());
        return apply(state, &d, 0).is_ok() && d.binds.iter().any(|b| b.job == id);
    }
    let cap = state.capacity();
    let feasible: Vec<usize> = state
        .nodes()
        .iter()
        .enumerate()
        .filter(|(n, info)| {
            info.schedulable()
                && info.class.is_some_and(|c| mask & (1 << c) != 0)
                && u64::from(cap.free[*n].count_ones()) >= per.gpus
                && cap.free_cpu[*n] >= per.cpu_millis
                && cap.free_mem[*n] >= per.memory_mib
        })
        .map(|(n, _)| n)
        .collect();
    let node = match fit {
        Fit::BestFit => feasible
            .iter()
            .copied()
            .min_by_key(|&n| (cap.free[n].count_ones(), n)),
        _ if feasible.is_empty() => None,
        _ => Some(feasible[rng.below(feasible.len())]),
    };
    let Some(n) = node else { return false };
    let mut m = cap.free[n];
    let mut gpus = 0u64;
    for _ in 0..per.gpus {
        let b = m & m.wrapping_neg();
        gpus |= b;
        m &= !b;
    }
    let p = gangway_sched::Placement {
        replicas: vec![gangway_sched::ReplicaPlacement {
            node: n as u32,
            gpus,
        }],
        level: gangway_core::TopologyLevel::Node,
    };
    state.bind(id, p, 0).is_ok()
}
