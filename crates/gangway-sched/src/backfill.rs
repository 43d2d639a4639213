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
//! when the counters say the gang fits. Earlier plans' holds are counted per
//! node as entries start and stop overlapping the gang's run ([`PlanHolds`]),
//! and the plan's entries are kept in start and end order for the whole cycle
//! ([`PlanOrder`]), so a walk costs what its events touch: on a small, busy
//! cluster with a deep plan every node carries most of the plan, and
//! recounting each node's entries at every event (and sorting every entry's
//! events for every walk) was most of a cycle.

use crate::bitset::Bitset;
use crate::placement;
use crate::state::{ClusterState, Gang, Placement};
use crate::{PlanEntry, Session};
use gangway_core::{JobId, Time, TopologyConstraint};

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
#[cfg(test)]
pub(crate) fn releases(state: &ClusterState, now: Time) -> Vec<(Time, JobId)> {
    let mut r = Releases::new(state, now);
    let mut i = 0;
    while r.get(i).is_some() {
        i += 1;
    }
    r.items
}

/// The release stream ([`releases`]), produced only as far as a walk reads
/// it: on a busy 50,000-node cluster the plan's walks reach a small part of
/// the 100,000 running jobs, and reading the whole running index every
/// cycle was a third of a steady cycle. Jobs past their estimate are
/// re-estimated and sorted up front (their new ends interleave with the
/// others'); the rest come in index order.
pub(crate) struct Releases<'a> {
    /// The stream so far.
    items: Vec<(Time, JobId)>,
    /// Jobs past their estimate, re-estimated at `now`, sorted; `oi` are taken.
    overdue: Vec<(Time, JobId)>,
    oi: usize,
    /// The running index after `now`, in order.
    rest: std::iter::Peekable<
        std::collections::btree_map::Range<'a, (Time, JobId), crate::state::EndBasis>,
    >,
}

impl<'a> Releases<'a> {
    /// Starts the stream of `state`'s running jobs at `now`.
    pub(crate) fn new(state: &'a ClusterState, now: Time) -> Self {
        let floor = state.config.unknown_runtime_floor_seconds;
        // The index carries what re-estimating needs: no job is looked up.
        let mut overdue: Vec<(Time, JobId)> = state
            .running_by_end
            .range(..=(now, JobId(u64::MAX)))
            .map(|(&(_, id), basis)| (basis.expected_end(now, floor), id))
            .collect();
        overdue.sort_unstable();
        Releases {
            items: Vec::new(),
            overdue,
            oi: 0,
            rest: state
                .running_by_end
                .range((now.saturating_add(1), JobId(0))..)
                .peekable(),
        }
    }

    /// Release `i` of the stream (earliest first), producing it if needed;
    /// `None` past the last running job.
    pub(crate) fn get(&mut self, i: usize) -> Option<(Time, JobId)> {
        while self.items.len() <= i {
            let a = self.overdue.get(self.oi).copied();
            let b = self.rest.peek().map(|(k, _)| **k);
            let next = match (a, b) {
                (Some(x), Some(y)) if x <= y => {
                    self.oi += 1;
                    x
                }
                (Some(x), None) => {
                    self.oi += 1;
                    x
                }
                (_, Some(y)) => {
                    self.rest.next();
                    y
                }
                (None, None) => return None,
            };
            self.items.push(next);
        }
        Some(self.items[i])
    }
}

/// The plan's reusable working copy, kept for the whole cycle so that each
/// planned job costs what its own walk touches, not a copy of every node.
///
/// Outside a walk, `g`, `cpu`, `mem` and `trial` equal the session's
/// capacity (as of `synced` entries of its journal) and `h` is all zero; a
/// walk records every node it changes and puts them back before it returns.
pub(crate) struct Timeline {
    /// Released so far: free GPU masks, CPU and memory per node.
    g: Vec<u64>,
    cpu: Vec<u64>,
    mem: Vec<u64>,
    /// Hostable replicas per node for the gang being planned (multi-node gangs).
    h: Vec<u64>,
    /// A capacity brought up to date with the releases when the counters say
    /// the gang may fit; placement searches run on it.
    trial: crate::Capacity,
    /// Journal entries of the session capacity already copied in.
    synced: usize,
    /// Nodes changed by the current walk (to put back), duplicates allowed.
    dirty: Vec<usize>,
    /// Nodes changed since `trial` was last brought up to date.
    stale: Vec<usize>,
    /// The release stream flattened as far as any walk went: per release,
    /// the range of its parts in `parts` (empty when the job is gone).
    flat: Vec<(u32, u32)>,
    /// What each release frees on a schedulable node: node, healthy GPUs, CPU, memory.
    parts: Vec<(u32, u64, u64, u64)>,
    /// The plan's holds on the gang being planned, per node.
    holds: PlanHolds,
    /// The plan's entries in time order.
    order: PlanOrder,
}

impl Timeline {
    /// A copy of the session's capacity; the journal must be on.
    pub(crate) fn new(cap: &crate::Capacity) -> Self {
        let mut trial = cap.clone();
        trial.journal = None;
        Timeline {
            g: cap.free.clone(),
            cpu: cap.free_cpu.clone(),
            mem: cap.free_mem.clone(),
            h: vec![0; cap.free.len()],
            trial,
            synced: cap.journal.as_ref().map_or(0, Vec::len),
            dirty: Vec::new(),
            stale: Vec::new(),
            flat: Vec::new(),
            parts: Vec::new(),
            holds: PlanHolds::new(cap.free.len()),
            order: PlanOrder::default(),
        }
    }

    /// Copies node `n` of `cap` into the counters and the trial capacity.
    fn reset_node(&mut self, state: &ClusterState, cap: &crate::Capacity, n: usize) {
        self.g[n] = cap.free[n];
        self.cpu[n] = cap.free_cpu[n];
        self.mem[n] = cap.free_mem[n];
        self.h[n] = 0;
        let t = &mut self.trial;
        t.alloc[n] = cap.alloc[n];
        t.free_cpu[n] = cap.free_cpu[n];
        t.free_mem[n] = cap.free_mem[n];
        if t.free[n] != cap.free[n] {
            t.set_free(&state.nodes, n as u32, cap.free[n]);
        }
    }

    /// Follows the session capacity's changes since the last walk.
    fn sync(&mut self, state: &ClusterState, cap: &crate::Capacity) {
        let Some(j) = &cap.journal else { return };
        let from = self.synced.min(j.len());
        for &n in &j[from..] {
            self.reset_node(state, cap, n as usize);
        }
        self.synced = j.len();
    }

    /// Puts back every node the walk changed.
    fn restore(&mut self, state: &ClusterState, cap: &crate::Capacity) {
        let dirty = std::mem::take(&mut self.dirty);
        for &n in &dirty {
            self.reset_node(state, cap, n);
        }
        self.dirty = dirty;
        self.dirty.clear();
        self.stale.clear();
    }

    /// Flattens releases up to index `i` of `releases`.
    fn flatten_to(&mut self, state: &ClusterState, releases: &[(Time, JobId)], i: usize) {
        while self.flat.len() <= i {
            let id = releases[self.flat.len()].1;
            let from = self.parts.len() as u32;
            if let Some(v) = state.job(id) {
                if let crate::JobStatus::Running(run) = &v.status {
                    let vp = v.per_replica();
                    for rp in &run.placement.replicas {
                        let info = &state.nodes[rp.node as usize];
                        if info.schedulable() {
                            self.parts.push((
                                rp.node,
                                rp.gpus & info.healthy,
                                vp.cpu_millis,
                                vp.memory_mib,
                            ));
                        }
                    }
                }
            }
            self.flat.push((from, self.parts.len() as u32));
        }
    }

    /// Adds what a release frees on node `n` to the counters.
    fn release(&mut self, n: usize, gpus: u64, cpu: u64, mem: u64) {
        self.g[n] |= gpus;
        self.cpu[n] = self.cpu[n].saturating_add(cpu);
        self.mem[n] = self.mem[n].saturating_add(mem);
        self.dirty.push(n);
        self.stale.push(n);
    }

    /// Brings the trial capacity up to date with the counters.
    fn refresh_trial(&mut self, state: &ClusterState, cap: &crate::Capacity) {
        for &n in &self.stale {
            let t = &mut self.trial;
            t.alloc[n] = cap.alloc[n] & !self.g[n];
            t.free_cpu[n] = self.cpu[n];
            t.free_mem[n] = self.mem[n];
            if t.free[n] != self.g[n] {
                t.set_free(&state.nodes, n as u32, self.g[n]);
            }
        }
        self.stale.clear();
    }
}

/// A plan entry's hold on one node, as the plan's hold rule counts it: the
/// union of its GPU masks there, and its CPU and memory there counted once
/// per hold it has on the node (an entry with `k` replicas on a node holds
/// `k` times their sum, as the per-node recount this replaces did).
#[derive(Clone, Copy)]
struct NodeHold {
    node: u32,
    gpus: u64,
    cpu: u128,
    mem: u128,
}

/// What the active plan entries hold on one node, kept as counts so that an
/// entry can be added and taken out again exactly (GPU masks are unions, so
/// each GPU counts the entries holding it).
#[derive(Clone)]
struct NodeHeld {
    /// Active entries holding the whole node (maintenance, or a reservation
    /// before its start against a job it may not be preempted by).
    whole: u32,
    /// Per GPU, active entries holding it; `gpus` has a bit where non-zero.
    per_gpu: [u32; 64],
    gpus: u64,
    cpu: u128,
    mem: u128,
}

impl NodeHeld {
    const EMPTY: NodeHeld = NodeHeld {
        whole: 0,
        per_gpu: [0; 64],
        gpus: 0,
        cpu: 0,
        mem: 0,
    };

    /// What is held: everything once one entry holds the whole node, else
    /// the union of GPUs and the (saturated) sums of CPU and memory.
    fn held(&self) -> Held {
        if self.whole > 0 {
            return Held {
                gpus: u64::MAX,
                cpu: u64::MAX,
                mem: u64::MAX,
            };
        }
        Held {
            gpus: self.gpus,
            cpu: u64::try_from(self.cpu).unwrap_or(u64::MAX),
            mem: u64::try_from(self.mem).unwrap_or(u64::MAX),
        }
    }

    /// Adds (or takes out) one entry's hold on this node.
    fn change(&mut self, h: &NodeHold, whole: bool, add: bool) {
        if whole {
            if add {
                self.whole += 1;
            } else {
                self.whole -= 1;
            }
            return;
        }
        let mut m = h.gpus;
        while m != 0 {
            let b = m.trailing_zeros() as usize;
            m &= m - 1;
            if add {
                self.per_gpu[b] += 1;
                self.gpus |= 1 << b;
            } else {
                self.per_gpu[b] -= 1;
                if self.per_gpu[b] == 0 {
                    self.gpus &= !(1 << b);
                }
            }
        }
        if add {
            self.cpu += h.cpu;
            self.mem += h.mem;
        } else {
            self.cpu -= h.cpu;
            self.mem -= h.mem;
        }
    }
}

/// The holds of the plan's entries active for the gang being planned, per
/// node: updated entry by entry as entries start or stop overlapping its run,
/// instead of recounting every entry on a node at each change (with a deep
/// plan on a small cluster every node carries most of the plan, and the
/// recount was most of the walk).
pub(crate) struct PlanHolds {
    /// Per plan entry (as of `entries` of the session's plan): its hold per node.
    per_entry: Vec<Vec<NodeHold>>,
    /// Per node: its slot in `held`, `u32::MAX` when it has none this walk.
    slot: Vec<u32>,
    /// Per slot: what active entries hold on its node.
    held: Vec<NodeHeld>,
    /// Per slot: its node.
    nodes: Vec<u32>,
    /// Per plan entry: whether it is active, and whether it counts as holding
    /// its nodes whole.
    active: Vec<bool>,
    whole: Vec<bool>,
}

impl PlanHolds {
    fn new(nodes: usize) -> Self {
        PlanHolds {
            per_entry: Vec::new(),
            slot: vec![u32::MAX; nodes],
            held: Vec::new(),
            nodes: Vec::new(),
            active: Vec::new(),
            whole: Vec::new(),
        }
    }

    /// Takes in the plan entries added since the last walk, and starts a
    /// walk with no entry active.
    fn start(&mut self, plan: &[PlanEntry]) {
        for e in &plan[self.per_entry.len()..] {
            let mut v: Vec<(NodeHold, u128)> = Vec::new();
            for &(node, m, c, me) in &e.holds {
                match v.iter_mut().find(|(h, _)| h.node == node) {
                    Some((h, k)) => {
                        h.gpus |= m;
                        h.cpu += u128::from(c);
                        h.mem += u128::from(me);
                        *k += 1;
                    }
                    None => v.push((
                        NodeHold {
                            node,
                            gpus: m,
                            cpu: u128::from(c),
                            mem: u128::from(me),
                        },
                        1,
                    )),
                }
            }
            self.per_entry.push(
                v.into_iter()
                    .map(|(h, k)| NodeHold {
                        cpu: h.cpu * k,
                        mem: h.mem * k,
                        ..h
                    })
                    .collect(),
            );
        }
        for &n in &self.nodes {
            self.slot[n as usize] = u32::MAX;
        }
        self.nodes.clear();
        self.held.clear();
        self.active.clear();
        self.active.resize(plan.len(), false);
        self.whole.clear();
        self.whole.resize(plan.len(), false);
    }

    /// What active entries hold on node `n`.
    fn get(&self, n: usize) -> Held {
        match self.slot[n] {
            u32::MAX => Held::default(),
            s => self.held[s as usize].held(),
        }
    }

    /// Adds entry `i`'s holds (counted whole or not) to its nodes, or takes
    /// them out.
    fn change(&mut self, i: usize, whole: bool, add: bool) {
        for h in &self.per_entry[i] {
            let n = h.node as usize;
            let s = match self.slot[n] {
                u32::MAX => {
                    let s = self.held.len() as u32;
                    self.slot[n] = s;
                    self.held.push(NodeHeld::EMPTY);
                    self.nodes.push(h.node);
                    s
                }
                s => s,
            };
            self.held[s as usize].change(h, whole, add);
        }
    }

    /// Entry `i` starts to overlap the run (no change if it already does).
    fn activate(&mut self, i: usize, whole: bool) {
        if !self.active[i] {
            self.active[i] = true;
            self.whole[i] = whole;
            self.change(i, whole, true);
        }
    }

    /// Entry `i` no longer overlaps the run (no change if it did not).
    fn deactivate(&mut self, i: usize) {
        if self.active[i] {
            self.active[i] = false;
            self.change(i, self.whole[i], false);
        }
    }

    /// Entry `i` now counts as holding its nodes whole or not.
    fn rewhole(&mut self, i: usize, whole: bool) {
        if self.active[i] && self.whole[i] != whole {
            self.change(i, self.whole[i], false);
            self.whole[i] = whole;
            self.change(i, whole, true);
        }
    }

    /// Nodes with something held, and what.
    fn nonzero(&self) -> impl Iterator<Item = (usize, Held)> + '_ {
        self.held.iter().zip(&self.nodes).filter_map(|(h, &n)| {
            let hd = h.held();
            (hd.gpus != 0 || hd.cpu != 0 || hd.mem != 0).then_some((n as usize, hd))
        })
    }
}

/// The plan's entries by start and by end, kept sorted as the plan grows,
/// so a walk reads its hold, narrow and unhold events in time order as far
/// as it goes instead of sorting every entry's events each time.
#[derive(Default)]
pub(crate) struct PlanOrder {
    /// (start, entry), ascending.
    by_start: Vec<(Time, usize)>,
    /// (start, entry) of reservations, ascending.
    reserved_by_start: Vec<(Time, usize)>,
    /// (end, entry), ascending.
    by_end: Vec<(Time, usize)>,
    /// Entries of the session's plan taken in.
    entries: usize,
}

impl PlanOrder {
    /// Takes in the plan entries added since the last walk.
    fn sync(&mut self, plan: &[PlanEntry]) {
        fn insert(v: &mut Vec<(Time, usize)>, x: (Time, usize)) {
            let at = v.partition_point(|y| *y < x);
            v.insert(at, x);
        }
        for (i, e) in plan.iter().enumerate().skip(self.entries) {
            insert(&mut self.by_start, (e.start, i));
            if e.reserved {
                insert(&mut self.reserved_by_start, (e.start, i));
            }
            insert(&mut self.by_end, (e.end, i));
        }
        self.entries = plan.len();
    }
}

/// Holds of plans active on one node: GPUs, CPU, memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Held {
    gpus: u64,
    cpu: u64,
    mem: u64,
}

/// What a walk of the timeline found.
pub(crate) enum Walk {
    /// The earliest start and where.
    Found(Time, Placement),
    /// It cannot fit even once everything running has ended.
    Never,
    /// It walked `limit` running jobs' ends without finding a start.
    OutOfBudget,
}

/// The earliest start and placement of `job` with `replicas` replicas on the
/// timeline, if it can fit at all once running jobs end, walking at most
/// `limit` running jobs' ends; also how many it walked. Call
/// [`Session::prepare_timeline`] first; `tl` is the session's timeline copy
/// (taken out of the session for the walk).
pub(crate) fn earliest(
    s: &Session<'_>,
    tl: &mut Timeline,
    rel: &mut Releases<'_>,
    job: &Gang,
    replicas: u32,
    limit: usize,
    exclude: Option<&Bitset>,
) -> (Walk, usize) {
    tl.sync(s.state, &s.cap);
    tl.order.sync(&s.plan);
    let order = std::mem::take(&mut tl.order);
    let mut walked = 0;
    let r = walk(
        s,
        tl,
        &order,
        rel,
        job,
        replicas,
        limit,
        exclude,
        &mut walked,
    );
    tl.order = order;
    tl.restore(s.state, &s.cap);
    (r, walked)
}

#[allow(clippy::too_many_arguments)]
fn walk(
    s: &Session<'_>,
    tl: &mut Timeline,
    order: &PlanOrder,
    rel: &mut Releases<'_>,
    job: &Gang,
    replicas: u32,
    limit: usize,
    exclude: Option<&Bitset>,
    walked: &mut usize,
) -> Walk {
    let state: &ClusterState = s.state;
    // Nodes the job avoids host nothing of it.
    let req = s.request(job, replicas, exclude);
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
            && exclude.is_none_or(|e| !e.contains(n))
    };
    let rt = plan_runtime(state, job);
    // Until it starts, a reservation keeps its whole nodes from a job that
    // would overlap it, as binding does (unless the job is preemptible by its
    // holder); once started, and for other plans, only its own GPUs are held.
    let whole = |e: &PlanEntry, t: Time| {
        e.maintenance
            || (e.reserved && t < e.start && !(job.preemptible && job.priority < e.priority))
    };
    // Plans overlapping the gang's run, per node.
    tl.holds.start(&s.plan);
    // It overlaps a run starting at t iff t < e.end and t + rt > e.start:
    // those starting before `now + rt` from the outset, the others from
    // `start - rt + 1`.
    let first_later = order
        .by_start
        .partition_point(|&(start, _)| start < s.now.saturating_add(rt));
    for &(_, i) in &order.by_start[..first_later] {
        tl.holds.activate(i, whole(&s.plan[i], s.now));
    }
    // The other events, each list in time order with a cursor: entries
    // starting to overlap (at `start - rt + 1`), reservations starting (from
    // then on they hold only their own GPUs), entries ending, and this
    // cycle's binds ending. Events at one instant all apply before the gang
    // is tried there, so their order within the instant does not matter.
    let later = &order.by_start[first_later..];
    let narrows = &order.reserved_by_start[order
        .reserved_by_start
        .partition_point(|&(start, _)| start <= s.now)..];
    let ends = &order.by_end;
    let bound = &s.bound_sorted;
    let (mut hi, mut ni, mut ui, mut bi) = (0, 0, 0, 0);
    let host = |n: usize, g: &[u64], cpu: &[u64], mem: &[u64], held: &PlanHolds| {
        if !class_ok(n) {
            return 0;
        }
        let hd = held.get(n);
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
    // keep per-node, per-leaf and total counts of hostable replicas. Only
    // nodes with at least one replica's GPUs free can host one, and the free
    // index names them.
    let mut leaf_h = vec![0u64; if single { 0 } else { state.leaves().len() }];
    let mut total_h: u64 = 0;
    if !single {
        let mut seed = |n: usize, tl: &mut Timeline| {
            let v = host(n, &tl.g, &tl.cpu, &tl.mem, &tl.holds);
            if v > 0 {
                tl.h[n] = v;
                tl.dirty.push(n);
                leaf_h[nodes[n].leaf as usize] += v;
                total_h += v;
            }
        };
        if per.gpus == 0 {
            for n in 0..nodes.len() {
                seed(n, tl);
            }
        } else {
            let cap = &s.cap;
            for (c, buckets) in cap.index.iter().enumerate() {
                if c >= 64 || req.class_mask & (1 << c) == 0 {
                    continue;
                }
                for b in buckets.iter().skip(per.gpus as usize) {
                    for n in b.iter_excluding(None) {
                        seed(n, tl);
                    }
                }
            }
        }
    }
    let r = u64::from(replicas);
    // Running jobs' ends come from the lazy release stream (index `ri`).
    let mut ri = 0;
    let mut touched: Vec<usize> = Vec::new();
    let check_victims = !s.victims.is_empty();
    loop {
        // The next instant anything happens (this loop runs once per instant).
        let mut next: Option<Time> = rel.get(ri).map(|(t, _)| t);
        let mut sooner = |x: Option<Time>| {
            if let Some(x) = x {
                next = Some(next.map_or(x, |n| n.min(x)));
            }
        };
        sooner(later.get(hi).map(|&(start, _)| start - rt + 1));
        sooner(narrows.get(ni).map(|&(start, _)| start));
        sooner(ends.get(ui).map(|&(end, _)| end));
        sooner(bound.get(bi).map(|&(end, _)| end));
        let Some(t) = next else {
            break;
        };
        touched.clear();
        // Everything that happens at `t`: running jobs' ends first.
        while let Some((te, id)) = rel.get(ri) {
            if te != t {
                break;
            }
            let i = ri;
            ri += 1;
            if *walked >= limit {
                return Walk::OutOfBudget;
            }
            *walked += 1;
            if check_victims && s.victims.contains(&id) {
                // Victims leave soon anyway; their GPUs are for their preemptor.
                continue;
            }
            tl.flatten_to(state, &rel.items, i);
            let (a, b) = tl.flat[i];
            for k in a as usize..b as usize {
                let (n, m, c, me) = tl.parts[k];
                tl.release(n as usize, m, c, me);
                touched.push(n as usize);
            }
        }
        while let Some(&(start, i)) = later.get(hi) {
            if start - rt + 1 != t {
                break;
            }
            hi += 1;
            tl.holds.activate(i, whole(&s.plan[i], t));
            touched.extend(s.plan[i].holds.iter().map(|h| h.0 as usize));
        }
        while let Some(&(start, i)) = narrows.get(ni) {
            if start != t {
                break;
            }
            ni += 1;
            tl.holds.rewhole(i, whole(&s.plan[i], t));
            touched.extend(s.plan[i].holds.iter().map(|h| h.0 as usize));
        }
        while let Some(&(end, i)) = ends.get(ui) {
            if end != t {
                break;
            }
            ui += 1;
            tl.holds.deactivate(i);
            touched.extend(s.plan[i].holds.iter().map(|h| h.0 as usize));
        }
        while let Some(&(end, k)) = bound.get(bi) {
            if end != t {
                break;
            }
            bi += 1;
            let b = &s.decisions.binds[k];
            let Some(v) = state.job(b.job) else { continue };
            let vp = v.per_replica();
            for rp in &b.placement.replicas {
                let info = &nodes[rp.node as usize];
                if info.schedulable() {
                    tl.release(
                        rp.node as usize,
                        rp.gpus & info.healthy,
                        vp.cpu_millis,
                        vp.memory_mib,
                    );
                }
                touched.push(rp.node as usize);
            }
        }
        let mut ready = false;
        touched.sort_unstable();
        touched.dedup();
        for &n in &touched {
            let nh = host(n, &tl.g, &tl.cpu, &tl.mem, &tl.holds);
            if single {
                ready |= nh >= r;
                continue;
            }
            let l = nodes[n].leaf as usize;
            let old = tl.h[n];
            leaf_h[l] = leaf_h[l] + nh - old;
            total_h = total_h + nh - old;
            tl.h[n] = nh;
            tl.dirty.push(n);
            ready |= if leaf_only {
                leaf_h[l] >= r
            } else {
                total_h >= r
            };
        }
        if !ready {
            continue;
        }
        // Bring the trial capacity up to date with everything released so far.
        tl.refresh_trial(state, &s.cap);
        let cap = &mut tl.trial;
        // Take the holds out for the search and give them back after: take
        // and give of free GPUs are exact inverses, so no copy is needed.
        let mut taken: Vec<(u32, u64, u64, u64)> = Vec::new();
        for (n, hd) in tl.holds.nonzero() {
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
            return Walk::Found(t.max(s.now), p);
        }
    }
    Walk::Never
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{JobStatus, StateConfig};
    use crate::{apply, schedule, SchedulerConfig};
    use gangway_core::{JobSpec, NodeSpec, QueueSpec};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(128), ..ProptestConfig::default() })]

        /// The per-node hold counts equal a recount of every active entry on
        /// the node (the rule they replace: an entry holding a node whole
        /// holds everything; otherwise GPU masks are united and CPU and
        /// memory summed, once per hold the entry has on the node), whatever
        /// the order in which entries start, stop and narrow, with entries
        /// holding a node several times and maintenance-like whole holds.
        #[test]
        fn plan_holds_match_a_recount_of_active_entries(
            entries in prop::collection::vec(
                prop::collection::vec((0u32..5, any::<u8>(), 0u64..4_000, 0u64..9_000, any::<bool>()), 1..4),
                1..12,
            ),
            ops in prop::collection::vec((0usize..12, 0u8..3, any::<bool>()), 0..60),
        ) {
            let plan: Vec<PlanEntry> = entries
                .iter()
                .map(|holds| PlanEntry {
                    start: 0,
                    end: 1,
                    reserved: false,
                    maintenance: false,
                    priority: 0,
                    holds: holds
                        .iter()
                        .map(|&(n, m, c, me, max)| {
                            if max {
                                (n, u64::MAX, u64::MAX, u64::MAX)
                            } else {
                                (n, u64::from(m), c, me)
                            }
                        })
                        .collect(),
                })
                .collect();
            let mut h = PlanHolds::new(5);
            // Entries arrive in two batches, as the plan grows during a cycle.
            let half = plan.len() / 2;
            h.start(&plan[..half]);
            h.start(&plan);
            let mut active = vec![false; plan.len()];
            let mut whole = vec![false; plan.len()];
            for &(i, op, w) in &ops {
                let i = i % plan.len();
                match op {
                    0 => {
                        if !active[i] {
                            active[i] = true;
                            whole[i] = w;
                        }
                        h.activate(i, w);
                    }
                    1 => {
                        active[i] = false;
                        h.deactivate(i);
                    }
                    _ => {
                        if active[i] {
                            whole[i] = w;
                        }
                        h.rewhole(i, w);
                    }
                }
                for n in 0..5u32 {
                    let mut want = Held::default();
                    for (k, e) in plan.iter().enumerate() {
                        if !active[k] {
                            continue;
                        }
                        for _ in e.holds.iter().filter(|x| x.0 == n) {
                            for &(node, m, c, me) in &e.holds {
                                if node == n {
                                    if whole[k] {
                                        want = Held { gpus: u64::MAX, cpu: u64::MAX, mem: u64::MAX };
                                    }
                                    want.gpus |= m;
                                    want.cpu = want.cpu.saturating_add(c);
                                    want.mem = want.mem.saturating_add(me);
                                }
                            }
                        }
                    }
                    prop_assert_eq!(h.get(n as usize), want);
                    let listed = h.nonzero().find(|(m, _)| *m == n as usize).map(|(_, x)| x);
                    let zero = want == Held::default();
                    prop_assert_eq!(listed, (!zero).then_some(want));
                }
            }
        }

        /// The release stream read from the running index (which carries what
        /// re-estimating needs) is exactly the one made by looking every
        /// running job up and re-estimating it: jobs with a declared run
        /// time, a learned prediction or neither, started at various
        /// instants, some finished, at any later `now`.
        #[test]
        fn releases_match_a_lookup_of_every_running_job(
            jobs in prop::collection::vec((1u32..5, prop::option::of(1u64..400), any::<bool>(), any::<bool>()), 1..60),
            later in 0u64..3_000,
        ) {
            let mut s = ClusterState::new(StateConfig::default());
            for i in 0..8 {
                s.add_node(NodeSpec::uniform(&format!("n{i}"), &format!("leaf{}", i / 4), "spine0", 8, "H100", 80))
                    .expect("node");
            }
            s.add_queue(QueueSpec::gpus("q", None, 1_000)).expect("queue");
            let learned = JobSpec::new("u", "q", 1, 1);
            for secs in [30, 90, 200] {
                s.learn_runtime(&learned, secs);
            }
            let cfg = SchedulerConfig::default();
            let mut now = 0;
            for (k, &(gpus, runtime, predicted, finish)) in jobs.iter().enumerate() {
                now = k as Time * 13;
                // The learned spec's key gets a prediction; others none.
                let mut spec = if predicted { learned.clone() } else { JobSpec::new("v", "q", 1, gpus) };
                spec.runtime_seconds = runtime;
                let _ = s.submit(JobId(k as u64 + 1), spec, now);
                let d = schedule(&s, now, &cfg);
                apply(&mut s, &d, now).expect("apply");
                if finish {
                    let first = s.running_by_end().next().map(|(_, id)| id);
                    if let Some(id) = first {
                        s.finish(id).expect("running");
                    }
                }
            }
            s.check_invariants().expect("indexes consistent");
            let at = now + later;
            let floor = s.config.unknown_runtime_floor_seconds;
            let mut want: Vec<(Time, JobId)> = s
                .jobs_sorted()
                .into_iter()
                .filter_map(|j| {
                    let JobStatus::Running(r) = &j.status else { return None };
                    let end = if r.est_end <= at { j.expected_end(at, floor)? } else { r.est_end };
                    Some((end, j.id))
                })
                .collect();
            want.sort_unstable();
            prop_assert_eq!(releases(&s, at), want);
        }
    }
}
