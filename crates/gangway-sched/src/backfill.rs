//! Reservation for the head-of-line gang (EASY backfill).
//!
//! When the first gang in order does not fit, running jobs are released on a
//! trial copy of the capacity in order of estimated end until the gang fits;
//! that time is its estimated start and those nodes are reserved. Later jobs
//! may use reserved nodes only if they are expected to end before the
//! reservation starts, or are preemptible by the gang. So a 64-GPU gang is not
//! starved by a stream of 1-GPU jobs.

use crate::placement;
use crate::preempt::{release_into, release_placement};
use crate::state::{ClusterState, Gang};
use crate::{Reservation, Session};
use gangway_core::{JobId, Time, TopologyConstraint};

/// Merges two ascending sequences into one.
fn merge<T: Ord + Copy>(
    a: impl Iterator<Item = T>,
    b: impl Iterator<Item = T>,
) -> impl Iterator<Item = T> {
    let (mut a, mut b) = (a.peekable(), b.peekable());
    std::iter::from_fn(move || match (a.peek(), b.peek()) {
        (Some(x), Some(y)) if x <= y => a.next(),
        (Some(_), None) => a.next(),
        _ => b.next(),
    })
}

/// A released job: either running in the state or bound earlier in this cycle.
enum Released<'a> {
    Running(&'a crate::state::Job),
    Bound(&'a crate::state::Job, &'a crate::state::Placement),
}

/// Computes the reservation for `job` with `replicas` replicas, if the gang can
/// fit at all once running jobs end. Releases are tracked as plain per-node
/// counters; the full capacity is rebuilt only when the counters say the gang fits.
pub(crate) fn reserve(s: &Session<'_>, job: &Gang, replicas: u32) -> Option<Reservation> {
    let state: &ClusterState = s.state;
    let req = s.request(job, replicas, None);
    let per = req.per;
    let need = per.gpus * u64::from(replicas);
    let single = per.gpus > 0
        && need <= state.max_node_gpus(req.class_mask)
        && job.topology != TopologyConstraint::Any;
    let leaf_only = job.topology == TopologyConstraint::Leaf;
    let nodes = state.nodes();
    let class_ok = |n: usize| {
        nodes[n].class.map_or(per.gpus == 0, |c| {
            per.gpus == 0 || req.class_mask & (1 << c) != 0
        }) && nodes[n].schedulable()
    };
    // Light counters: free GPUs, CPU and memory per node.
    let mut g: Vec<u64> = s
        .cap
        .free
        .iter()
        .map(|m| u64::from(m.count_ones()))
        .collect();
    let mut cpu = s.cap.free_cpu.clone();
    let mut mem = s.cap.free_mem.clone();
    let host = |g: u64, c: u64, m: u64| -> u64 {
        let mut h = u64::MAX;
        for (have, p) in [(g, per.gpus), (c, per.cpu_millis), (m, per.memory_mib)] {
            if let Some(k) = have.checked_div(p) {
                h = h.min(k);
            }
        }
        if h == u64::MAX {
            0
        } else {
            h
        }
    };
    let mut h: Vec<u64> = (0..nodes.len())
        .map(|n| {
            if class_ok(n) {
                host(g[n], cpu[n], mem[n])
            } else {
                0
            }
        })
        .collect();
    let mut leaf_h = vec![0u64; state.leaves().len()];
    for (n, v) in h.iter().enumerate() {
        leaf_h[nodes[n].leaf as usize] += v;
    }
    let mut total_h: u64 = h.iter().sum();
    let r = u64::from(replicas);
    let mut bound: Vec<(u64, usize)> = s.bound.iter().map(|(t, _, i)| (*t, *i)).collect();
    bound.sort_unstable();
    // Jobs past their estimated end are re-estimated from the time they have
    // run; the others end when estimated at their start.
    let floor = state.config.unknown_runtime_floor_seconds;
    let mut overdue: Vec<(Time, JobId)> = state
        .running_by_end
        .range(..=(s.now, JobId(u64::MAX)))
        .filter_map(|&(_, id)| Some((state.job(id)?.expected_end(s.now, floor)?, id)))
        .collect();
    overdue.sort_unstable();
    let mut running = merge(
        overdue.into_iter(),
        state
            .running_by_end
            .range((s.now.saturating_add(1), JobId(0))..)
            .copied(),
    )
    .peekable();
    let mut bound_it = bound.into_iter().peekable();
    let mut released: Vec<Released<'_>> = Vec::new();
    let mut trial: Option<(crate::Capacity, usize)> = None;
    loop {
        let take_running = match (running.peek(), bound_it.peek()) {
            (Some((t1, _)), Some((t2, _))) => t1 <= t2,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => return None,
        };
        let (t, rel) = if take_running {
            let (t, id) = running.next()?;
            let Some(v) = state.job(id) else { continue };
            if s.victims.contains(&id) {
                // Victims leave soon anyway; their GPUs are for their preemptor.
                continue;
            }
            (t, Released::Running(v))
        } else {
            let (t, bi) = bound_it.next()?;
            let b = &s.decisions.binds[bi];
            let Some(v) = state.job(b.job) else { continue };
            (t, Released::Bound(v, &b.placement))
        };
        let (v, p) = match &rel {
            Released::Running(v) => match &v.status {
                crate::JobStatus::Running(run) => (*v, &run.placement),
                crate::JobStatus::Pending => continue,
            },
            Released::Bound(v, p) => (*v, *p),
        };
        let vp = v.per_replica();
        let mut ready = false;
        for rp in &p.replicas {
            let ni = rp.node as usize;
            if !nodes[ni].schedulable() {
                continue;
            }
            g[ni] += u64::from((rp.gpus & nodes[ni].healthy).count_ones());
            cpu[ni] += vp.cpu_millis;
            mem[ni] += vp.memory_mib;
            if !class_ok(ni) {
                continue;
            }
            let nh = host(g[ni], cpu[ni], mem[ni]);
            let l = nodes[ni].leaf as usize;
            leaf_h[l] = leaf_h[l] + nh - h[ni];
            total_h = total_h + nh - h[ni];
            h[ni] = nh;
            ready |= if single {
                nh >= r
            } else if leaf_only {
                leaf_h[l] >= r
            } else {
                total_h >= r
            };
        }
        released.push(rel);
        if ready {
            // Bring a real capacity up to date with everything released so far.
            let (cap, done) = trial.get_or_insert_with(|| (s.cap.clone(), 0));
            for rel in &released[*done..] {
                match rel {
                    Released::Running(v) => release_into(state, cap, v),
                    Released::Bound(v, p) => release_placement(state, cap, v, p),
                }
            }
            *done = released.len();
            if let Ok(p) = placement::place(state, cap, &req) {
                return Some(Reservation {
                    job: job.id,
                    start_at: t.max(s.now),
                    nodes: p.nodes(),
                });
            }
        }
    }
}
