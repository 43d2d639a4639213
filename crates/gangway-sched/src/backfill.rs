//! Reservation for the head-of-line gang (EASY backfill).
//!
//! When the first gang in order does not fit, running jobs are released on a
//! trial copy of the capacity in order of estimated end until the gang fits;
//! that time is its estimated start and those nodes are reserved. Later jobs
//! may use reserved nodes only if they are expected to end before the
//! reservation starts, or are preemptible by the gang. So a 64-GPU gang is not
//! starved by a stream of 1-GPU jobs.

use crate::placement::{self, hostable};
use crate::preempt::{release_into, release_placement};
use crate::state::{ClusterState, Gang};
use crate::{Reservation, Session};
use gangway_core::TopologyConstraint;

/// Computes the reservation for `job` with `replicas` replicas, if the gang can
/// fit at all once running jobs end.
pub(crate) fn reserve(s: &Session<'_>, job: &Gang, replicas: u32) -> Option<Reservation> {
    let state: &ClusterState = s.state;
    let mut trial = s.cap.clone();
    let req = s.request(job, replicas, None);
    let per = req.per;
    let need = per.gpus * u64::from(replicas);
    let single = per.gpus > 0
        && need <= state.max_node_gpus(req.class_mask)
        && job.topology != TopologyConstraint::Any;
    let leaf_only = job.topology == TopologyConstraint::Leaf;
    let nodes = state.nodes();
    // Hostable replicas per node and per leaf, kept up to date as jobs are released.
    let class_ok = |n: usize| {
        nodes[n]
            .class
            .map_or(per.gpus == 0, |c| req.class_mask & (1 << c) != 0)
    };
    let mut h: Vec<u64> = (0..nodes.len())
        .map(|n| {
            if class_ok(n) {
                hostable(&nodes[n], &trial, n, &per)
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
    let mut running = state.running_by_end().peekable();
    let mut bound_it = bound.into_iter().peekable();
    loop {
        // Merge the two end-ordered streams.
        let take_running = match (running.peek(), bound_it.peek()) {
            (Some((t1, _)), Some((t2, _))) => t1 <= t2,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => return None,
        };
        let (t, touched) = if take_running {
            let (t, id) = running.next()?;
            let Some(v) = state.job(id) else { continue };
            if s.victims.contains(&id) {
                // Victims leave soon anyway; their GPUs are for their preemptor.
                continue;
            }
            release_into(state, &mut trial, v);
            let nodes_of = match &v.status {
                crate::JobStatus::Running(run) => run.placement.nodes(),
                crate::JobStatus::Pending => Vec::new(),
            };
            (t, nodes_of)
        } else {
            let (t, bi) = bound_it.next()?;
            let b = &s.decisions.binds[bi];
            let Some(v) = state.job(b.job) else { continue };
            release_placement(state, &mut trial, v, &b.placement);
            (t, b.placement.nodes())
        };
        let mut ready = false;
        for n in touched {
            let ni = n as usize;
            if !class_ok(ni) {
                continue;
            }
            let nh = hostable(&nodes[ni], &trial, ni, &per);
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
        if ready {
            if let Ok(p) = placement::place(state, &trial, &req) {
                return Some(Reservation {
                    job: job.id,
                    start_at: t.max(s.now),
                    nodes: p.nodes(),
                });
            }
        }
    }
}
