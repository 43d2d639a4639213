//! Preemption and reclaim: choose victims that free enough GPUs *in one
//! placeable shape* for the preemptor, losing the least work (GPU-seconds since
//! each victim's last checkpoint), then the fewest victims. A preemption is
//! only decided after checking, on a trial copy of the capacity, that the
//! preemptor's quota and placement succeed once the victims are gone.

use crate::capacity::{Capacity, QueueId};
use crate::explain::WaitReason;
use crate::state::{ClusterState, Job, JobStatus, Placement};
use crate::{quota, Preempt, PreemptReason, Session};
use gangway_core::{JobId, TopologyConstraint};
use std::collections::BTreeMap;

/// Gives a running job's GPUs and quota back on `cap` (for trial computations).
pub fn release_into(state: &ClusterState, cap: &mut Capacity, job: &Job) {
    if let JobStatus::Running(r) = &job.status {
        release_placement(state, cap, job, &r.placement);
    }
}

/// Gives back the resources of `job` placed at `p` on `cap`.
pub fn release_placement(state: &ClusterState, cap: &mut Capacity, job: &Job, p: &Placement) {
    let per = job.per_replica();
    for rp in &p.replicas {
        cap.give(
            state.nodes(),
            rp.node,
            rp.gpus,
            per.cpu_millis,
            per.memory_mib,
        );
    }
    cap.charge(
        state.queues(),
        job.queue,
        per * p.replicas.len() as u64,
        false,
        !job.spec.is_preemptible(),
    );
}

fn related(state: &ClusterState, a: QueueId, b: QueueId) -> bool {
    let qs = state.queues();
    qs[a as usize].path.contains(&b) || qs[b as usize].path.contains(&a)
}

type Cost = (u64, i32, u64);

struct Candidate<'a> {
    cost: Cost,
    lost: u64,
    job: &'a Job,
}

fn feasible(s: &Session<'_>, job: &Job, min: u32, victims: &[&Job]) -> Option<Placement> {
    let mut trial = s.trial();
    for v in victims {
        release_into(s.state, &mut trial, v);
    }
    quota::check(
        s.state,
        &trial,
        job.queue,
        job.per_replica() * u64::from(min),
        job.spec.is_preemptible(),
    )
    .ok()?;
    s.place_elastic(&trial, job, min, min, None).ok()
}

/// Tries to make room for `job` (with `min` replicas) by preempting. On success
/// records the preemptions, holds the target nodes and returns the reason to show.
pub(crate) fn try_preempt(
    s: &mut Session<'_>,
    job: &Job,
    min: u32,
    reason: PreemptReason,
) -> Option<WaitReason> {
    if s.preempt_searches >= s.cfg.max_preemption_searches {
        return None;
    }
    let state = s.state;
    let now = s.now;
    let mut borrowing: BTreeMap<QueueId, bool> = BTreeMap::new();
    let mut cands: Vec<Candidate<'_>> = Vec::new();
    for (_, vid) in state.running_by_end() {
        let Some(v) = state.job(vid) else { continue };
        if !v.spec.is_preemptible()
            || s.victims.contains(&vid)
            || state.preempting.contains_key(&vid)
        {
            continue;
        }
        let b = *borrowing
            .entry(v.queue)
            .or_insert_with(|| quota::is_borrowing(state, &s.cap, v.queue));
        let eligible = match reason {
            PreemptReason::Priority => v.priority < job.priority && (v.queue == job.queue || b),
            PreemptReason::Reclaim => b && !related(state, v.queue, job.queue),
        };
        if !eligible {
            continue;
        }
        let lost = v.lost_work_gpu_seconds(now);
        let JobStatus::Running(r) = &v.status else {
            continue;
        };
        let tiebreak = u64::MAX - r.started; // newest first among equals
        let cost = match reason {
            PreemptReason::Priority => (lost, v.priority, tiebreak),
            PreemptReason::Reclaim => (u64::from(v.priority as u32 ^ 0x8000_0000), 0, lost),
        };
        cands.push(Candidate { cost, lost, job: v });
    }
    if cands.is_empty() {
        return None;
    }
    s.preempt_searches += 1;
    cands.sort_by_key(|c| (c.cost, c.job.id));
    let per = job.per_replica();
    let need = per.gpus * u64::from(min);
    let single = need <= state.max_node_gpus(state.class_mask(&job.spec))
        && matches!(
            job.spec.topology,
            TopologyConstraint::Auto | TopologyConstraint::Node
        );
    let chosen = if single && per.gpus > 0 {
        per_node_search(s, job, min, &cands)
    } else {
        greedy_search(s, job, min, &cands)
    }?;
    let (victims, placement) = chosen;
    let mut grace = 0;
    let mut ids = Vec::with_capacity(victims.len());
    for c in &victims {
        let v = c.job;
        grace = grace.max(v.spec.checkpoint.grace_seconds);
        s.victims.insert(v.id);
        ids.push(v.id);
        s.decisions.preemptions.push(Preempt {
            job: v.id,
            by: job.id,
            grace_seconds: v.spec.checkpoint.grace_seconds,
            reason,
            lost_work_gpu_seconds: c.lost,
        });
    }
    let vjobs: Vec<&Job> = victims.iter().map(|c| c.job).collect();
    s.claim(job, &vjobs, &placement);
    Some(WaitReason::Preempting {
        victims: ids,
        grace_seconds: grace,
    })
}

type Choice<'a, 'b> = (Vec<&'b Candidate<'a>>, Placement);

/// For gangs that fit on one node: per node, the cheapest victims on it that
/// make room; then the node whose victims lose the least work.
fn per_node_search<'a, 'b>(
    s: &Session<'_>,
    job: &Job,
    min: u32,
    cands: &'b [Candidate<'a>],
) -> Option<Choice<'a, 'b>> {
    let state = s.state;
    let per = job.per_replica();
    let mask = state.class_mask(&job.spec);
    let r = u64::from(min);
    let mut on_node: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, c) in cands.iter().enumerate() {
        if let JobStatus::Running(run) = &c.job.status {
            for n in run.placement.nodes() {
                on_node.entry(n).or_default().push(i);
            }
        }
    }
    let mut options: Vec<((u64, usize, u32), Vec<usize>)> = Vec::new();
    for (&n, idxs) in &on_node {
        let info = &state.nodes()[n as usize];
        if !info.schedulable() || info.class.is_none_or(|c| mask & (1 << c) == 0) {
            continue;
        }
        let ni = n as usize;
        let (mut g, mut cpu, mut mem) = (
            u64::from(s.cap.free[ni].count_ones()),
            s.cap.free_cpu[ni],
            s.cap.free_mem[ni],
        );
        let mut set = Vec::new();
        let mut lost = 0;
        for &i in idxs {
            let v = cands[i].job;
            let JobStatus::Running(run) = &v.status else {
                continue;
            };
            let vp = v.per_replica();
            for rp in run.placement.replicas.iter().filter(|rp| rp.node == n) {
                g += u64::from((rp.gpus & info.healthy).count_ones());
                cpu += vp.cpu_millis;
                mem += vp.memory_mib;
            }
            set.push(i);
            lost += cands[i].lost;
            if g >= per.gpus * r && cpu >= per.cpu_millis * r && mem >= per.memory_mib * r {
                options.push(((lost, set.len(), n), set.clone()));
                break;
            }
        }
    }
    options.sort();
    for (_, set) in options.into_iter().take(8) {
        let victims: Vec<&Job> = set.iter().map(|&i| cands[i].job).collect();
        if let Some(p) = feasible(s, job, min, &victims) {
            return Some((set.iter().map(|&i| &cands[i]).collect(), p));
        }
    }
    None
}

/// For multi-node gangs: add victims cheapest first until the gang fits, then
/// drop every victim (most expensive first) whose removal is not needed.
fn greedy_search<'a, 'b>(
    s: &Session<'_>,
    job: &Job,
    min: u32,
    cands: &'b [Candidate<'a>],
) -> Option<Choice<'a, 'b>> {
    let need = job.per_replica().gpus * u64::from(min);
    let mut chosen: Vec<&Candidate<'a>> = Vec::new();
    let mut freed = 0u64;
    let mut next_try = need.saturating_sub(s.cap.free_total);
    let mut tries = 0;
    let mut found = None;
    for c in cands {
        chosen.push(c);
        if let JobStatus::Running(r) = &c.job.status {
            freed += r.placement.gpus();
        }
        if freed >= next_try {
            tries += 1;
            let victims: Vec<&Job> = chosen.iter().map(|c| c.job).collect();
            if let Some(p) = feasible(s, job, min, &victims) {
                found = Some(p);
                break;
            }
            if tries >= 32 {
                return None;
            }
            next_try = freed + (need / 4).max(1);
        }
    }
    let mut placement = found?;
    let mut i = chosen.len();
    let mut prunes = 0;
    while i > 0 && prunes < 64 {
        i -= 1;
        prunes += 1;
        let without: Vec<&Job> = chosen
            .iter()
            .enumerate()
            .filter(|(k, _)| *k != i)
            .map(|(_, c)| c.job)
            .collect();
        if let Some(p) = feasible(s, job, min, &without) {
            chosen.remove(i);
            placement = p;
        }
    }
    Some((chosen, placement))
}

/// Ids of the victims in a list of preemptions (helper for callers).
pub fn victims(p: &[Preempt]) -> Vec<JobId> {
    p.iter().map(|p| p.job).collect()
}
