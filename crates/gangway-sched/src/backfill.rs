//! The backfill plan: a start estimate and nodes for pending gangs that do
//! not fit now, in scheduling order.
//!
//! The timeline is the free capacity now, plus the GPUs each running job (and
//! each job bound earlier in the cycle) gives back at its estimated end, less
//! what earlier plans hold from their start to their end. For a gang with
//! planning run time `rt`, the earliest instant `t` at which it fits on what
//! has been released by `t`, minus the holds of plans overlapping
//! `[t, t + rt)`, is its estimated start; those nodes are its plan. Plans
//! that are reservations ([`crate::Backfill`]) also keep later jobs off their
//! nodes unless those end before the reservation starts or are preemptible by
//! its holder, so a 64-GPU gang is not starved by a stream of 1-GPU jobs. The
//! plan applies the same rule (a reservation holds its whole nodes against a
//! job that would overlap it), so what the plan promises, binding keeps.
//!
//! Estimated ends come from time limits and the run-time predictor, never a
//! fixed guess. A running job that has outlived its estimate is re-estimated
//! each cycle ([`crate::Job::expected_end`]): past its declared limit, or with
//! no history, it is expected to run as long again as it has run (at least
//! `unknown_runtime_floor_seconds`); with a prediction, the predicted
//! remaining time given how long it has already run.
//!
//! Releases are tracked as per-node counters; a real capacity is built only
//! when the counters say the gang fits.

use crate::placement;
use crate::preempt::{release_into, release_placement};
use crate::state::{ClusterState, Gang, Placement};
use crate::Session;
use gangway_core::{JobId, Time, TopologyConstraint};
use rustc_hash::FxHashMap as HashMap;

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

/// The seconds a plan holds a gang's GPUs: its run-time bound (time limit,
/// else the predictor's upper estimate), else its expected run time, else the
/// unknown-run-time floor.
pub(crate) fn plan_runtime(state: &ClusterState, job: &Gang) -> u64 {
    job.runtime
        .or(job.expected_runtime)
        .unwrap_or(state.config.unknown_runtime_floor_seconds)
        .max(1)
}

/// Running jobs by estimated end: those past their estimate re-estimated at
/// `now`, the others as estimated at their start.
pub(crate) fn releases(state: &ClusterState, now: Time) -> Vec<(Time, JobId)> {
    let floor = state.config.unknown_runtime_floor_seconds;
    let mut overdue: Vec<(Time, JobId)> = state
        .running_by_end
        .range(..=(now, JobId(u64::MAX)))
        .filter_map(|&(_, id)| Some((state.job(id)?.expected_end(now, floor)?, id)))
        .collect();
    overdue.sort_unstable();
    merge(
        overdue.into_iter(),
        state
            .running_by_end
            .range((now.saturating_add(1), JobId(0))..)
            .copied(),
    )
    .collect()
}

/// A released job: either running in the state or bound earlier in this cycle.
enum Released<'a> {
    Running(&'a crate::state::Job),
    Bound(&'a crate::state::Job, &'a Placement),
}

/// One change on the timeline of a gang being planned.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A running job ends (index into the release stream).
    Running(usize),
    /// A job bound this cycle ends (index into `decisions.binds`).
    Bound(usize),
    /// A plan starts to overlap the gang's run (index into the plan).
    Hold(usize),
    /// A reservation's start: from then on it holds only its own GPUs.
    Narrow(usize),
    /// A plan ends (index into the plan).
    Unhold(usize),
}

/// Holds of plans active on one node: GPUs, CPU, memory.
#[derive(Clone, Copy, Default)]
struct Held {
    gpus: u64,
    cpu: u64,
    mem: u64,
}

/// The earliest start and placement of `job` with `replicas` replicas on the
/// timeline, if it can fit at all once running jobs end. Call
/// [`Session::prepare_timeline`] first.
pub(crate) fn earliest(s: &Session<'_>, job: &Gang, replicas: u32) -> Option<(Time, Placement)> {
    let state: &ClusterState = s.state;
    let releases = s.releases.as_deref().unwrap_or(&[]);
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
    let rt = plan_runtime(state, job);
    // Released so far: free GPU masks, CPU and memory per node.
    let mut g: Vec<u64> = s.cap.free.clone();
    let mut cpu = s.cap.free_cpu.clone();
    let mut mem = s.cap.free_mem.clone();
    // Plans overlapping the gang's run, per node, and which are active.
    let mut held: HashMap<usize, Held> = HashMap::default();
    let mut active = vec![false; s.plan.len()];
    let mut by_node: HashMap<usize, Vec<usize>> = HashMap::default();
    let mut events: Vec<(Time, Event)> = Vec::with_capacity(2 * s.plan.len());
    for (i, e) in s.plan.iter().enumerate() {
        for h in &e.holds {
            by_node.entry(h.0 as usize).or_default().push(i);
        }
        // It overlaps a run starting at t iff t < e.end and t + rt > e.start.
        if e.start < s.now.saturating_add(rt) {
            active[i] = true;
        } else {
            events.push((e.start - rt + 1, Event::Hold(i)));
        }
        if e.reserved && e.start > s.now {
            events.push((e.start, Event::Narrow(i)));
        }
        events.push((e.end, Event::Unhold(i)));
    }
    events.sort_unstable();
    let recompute_held = |n: usize, t: Time, active: &[bool], held: &mut HashMap<usize, Held>| {
        let mut h = Held::default();
        for &i in by_node.get(&n).map_or(&[][..], |v| v.as_slice()) {
            if !active[i] {
                continue;
            }
            let e = &s.plan[i];
            // Until it starts, a reservation keeps its whole nodes from a job
            // that would overlap it, as binding does (unless the job is
            // preemptible by its holder); once started, and for other plans,
            // only its own GPUs are held.
            let whole = e.maintenance
                || (e.reserved && t < e.start && !(job.preemptible && job.priority < e.priority));
            for &(node, m, c, me) in &e.holds {
                if node as usize == n {
                    if whole {
                        h.gpus = u64::MAX;
                        h.cpu = u64::MAX;
                        h.mem = u64::MAX;
                    }
                    h.gpus |= m;
                    h.cpu = h.cpu.saturating_add(c);
                    h.mem = h.mem.saturating_add(me);
                }
            }
        }
        if h.gpus == 0 && h.cpu == 0 && h.mem == 0 {
            held.remove(&n);
        } else {
            held.insert(n, h);
        }
    };
    for n in by_node.keys() {
        recompute_held(*n, s.now, &active, &mut held);
    }
    let host = |n: usize, g: &[u64], cpu: &[u64], mem: &[u64], held: &HashMap<usize, Held>| {
        if !class_ok(n) {
            return 0;
        }
        let hd = held.get(&n).copied().unwrap_or_default();
        let have = [
            u64::from((g[n] & !hd.gpus).count_ones()),
            cpu[n].saturating_sub(hd.cpu),
            mem[n].saturating_sub(hd.mem),
        ];
        let mut k = u64::MAX;
        for (have, p) in have
            .into_iter()
            .zip([per.gpus, per.cpu_millis, per.memory_mib])
        {
            if let Some(q) = have.checked_div(p) {
                k = k.min(q);
            }
        }
        if k == u64::MAX {
            0
        } else {
            k
        }
    };
    // A gang on one node only needs the touched nodes' counts; the others
    // keep per-node, per-leaf and total counts of hostable replicas.
    let mut h: Vec<u64> = if single {
        Vec::new()
    } else {
        (0..nodes.len())
            .map(|n| host(n, &g, &cpu, &mem, &held))
            .collect()
    };
    let mut leaf_h = vec![0u64; if single { 0 } else { state.leaves().len() }];
    for (n, v) in h.iter().enumerate() {
        leaf_h[nodes[n].leaf as usize] += v;
    }
    let mut total_h: u64 = h.iter().sum();
    let r = u64::from(replicas);
    let mut stream = merge(
        merge(
            releases
                .iter()
                .enumerate()
                .map(|(i, (t, _))| (*t, Event::Running(i))),
            s.bound_sorted.iter().map(|(t, i)| (*t, Event::Bound(*i))),
        ),
        events.into_iter(),
    )
    .peekable();
    let mut released: Vec<Released<'_>> = Vec::new();
    let mut trial: Option<(crate::Capacity, usize)> = None;
    let mut touched: Vec<usize> = Vec::new();
    while let Some(&(t, _)) = stream.peek() {
        touched.clear();
        // Everything that happens at `t`.
        while let Some((_, ev)) = stream.next_if(|(te, _)| *te == t) {
            match ev {
                Event::Hold(i) | Event::Unhold(i) | Event::Narrow(i) => {
                    match ev {
                        Event::Hold(_) => active[i] = true,
                        Event::Unhold(_) => active[i] = false,
                        _ => {}
                    }
                    for &(node, ..) in &s.plan[i].holds {
                        recompute_held(node as usize, t, &active, &mut held);
                        touched.push(node as usize);
                    }
                }
                Event::Running(i) => {
                    let id = releases[i].1;
                    if s.victims.contains(&id) {
                        // Victims leave soon anyway; their GPUs are for their preemptor.
                        continue;
                    }
                    let Some(v) = state.job(id) else { continue };
                    let crate::JobStatus::Running(run) = &v.status else {
                        continue;
                    };
                    release_counters(state, v, &run.placement, &mut g, &mut cpu, &mut mem);
                    touched.extend(run.placement.replicas.iter().map(|rp| rp.node as usize));
                    released.push(Released::Running(v));
                }
                Event::Bound(bi) => {
                    let b = &s.decisions.binds[bi];
                    let Some(v) = state.job(b.job) else { continue };
                    release_counters(state, v, &b.placement, &mut g, &mut cpu, &mut mem);
                    touched.extend(b.placement.replicas.iter().map(|rp| rp.node as usize));
                    released.push(Released::Bound(v, &b.placement));
                }
            }
        }
        let mut ready = false;
        touched.sort_unstable();
        touched.dedup();
        for &n in &touched {
            let nh = host(n, &g, &cpu, &mem, &held);
            if single {
                ready |= nh >= r;
                continue;
            }
            let l = nodes[n].leaf as usize;
            leaf_h[l] = leaf_h[l] + nh - h[n];
            total_h = total_h + nh - h[n];
            h[n] = nh;
            ready |= if leaf_only {
                leaf_h[l] >= r
            } else {
                total_h >= r
            };
        }
        if !ready {
            continue;
        }
        // Bring a real capacity up to date with everything released so far.
        let (cap, done) = trial.get_or_insert_with(|| (s.cap.clone(), 0));
        for rel in &released[*done..] {
            match rel {
                Released::Running(v) => release_into(state, cap, v),
                Released::Bound(v, p) => release_placement(state, cap, v, p),
            }
        }
        *done = released.len();
        // Take the holds out for the search and give them back after: take
        // and give of free GPUs are exact inverses, so no copy is needed.
        let mut taken: Vec<(u32, u64, u64, u64)> = Vec::with_capacity(held.len());
        for (&n, hd) in &held {
            let m = hd.gpus & cap.free[n];
            let hc = hd.cpu.min(cap.free_cpu[n]);
            let hm = hd.mem.min(cap.free_mem[n]);
            cap.take(&state.nodes, n as u32, m, hc, hm);
            taken.push((n as u32, m, hc, hm));
        }
        let found = placement::place(state, cap, &req);
        for (n, m, hc, hm) in taken {
            cap.give(&state.nodes, n, m, hc, hm);
        }
        if let Ok(p) = found {
            return Some((t.max(s.now), p));
        }
    }
    None
}

/// Adds what `v` frees on `p` to the per-node counters.
fn release_counters(
    state: &ClusterState,
    v: &crate::state::Job,
    p: &Placement,
    g: &mut [u64],
    cpu: &mut [u64],
    mem: &mut [u64],
) {
    let nodes = state.nodes();
    let vp = v.per_replica();
    for rp in &p.replicas {
        let ni = rp.node as usize;
        if !nodes[ni].schedulable() {
            continue;
        }
        g[ni] |= rp.gpus & nodes[ni].healthy;
        cpu[ni] = cpu[ni].saturating_add(vp.cpu_millis);
        mem[ni] = mem[ni].saturating_add(vp.memory_mib);
    }
}
