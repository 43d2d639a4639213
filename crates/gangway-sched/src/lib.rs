//! Gangway's scheduling core: pure and deterministic.
//!
//! [`schedule`] reads a [`ClusterState`] and returns [`Decisions`]: gangs to
//! bind, jobs to preempt, the backfill reservation, and an explanation for
//! every job left pending. It does no I/O and mutates nothing; the caller (the
//! server or the simulator) applies the decisions through `ClusterState`'s
//! methods. The same state and `now` always give the same decisions.
//!
//! A cycle, in the spirit of Volcano's actions and the Kubernetes framework:
//! 1. **order**: priority class, then DRF fair share between queues, then submit time ([`order`]);
//! 2. **admit**: quota with borrowing and lending limits ([`quota`]);
//! 3. **allocate**: all-or-nothing, topology- and fragmentation-aware placement ([`placement`]);
//! 4. **preempt / reclaim**: victims that free one placeable shape at least lost work ([`preempt`]);
//! 5. **reserve and backfill**: the head-of-line gang that does not fit gets a
//!    reservation; later jobs may use its nodes only if they end before it
//!    starts or can be preempted by it ([`backfill`]).

pub mod backfill;
pub mod bitset;
pub mod capacity;
pub mod explain;
pub mod order;
pub mod placement;
pub mod predict;
pub mod preempt;
pub mod quota;
pub mod state;

pub use capacity::{Capacity, NodeIdx, QueueId};
pub use explain::{Explanation, WaitReason};
pub use placement::FitFailure;
pub use quota::{QuotaBlock, QuotaLimit};
pub use state::{
    ClusterState, Gang, Job, JobStatus, Placement, Rejection, ReplicaPlacement, RunInfo,
    StateConfig, StateError,
};

use bitset::Bitset;
use gangway_core::{JobId, Resources, Time, TopologyConstraint};
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use serde::Serialize;

/// Policy switches for a cycle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Reserve GPUs for the head-of-line gang and backfill around it.
    pub backfill: bool,
    /// Preempt lower-priority work and reclaim lent quota.
    pub preemption: bool,
    /// Use DRF fair share between queues (otherwise submit order within a priority).
    pub fair_share: bool,
    /// Most gangs that may hold a reservation at once.
    pub max_reservations: usize,
    /// Most preemption searches per cycle. Keeping preemption gradual matters:
    /// on the contended Chronus trace, 4 gives a 7.7 h average JCT and 6,500
    /// preemptions where 64 gives 27.5 h and 117,000 (victims churn).
    pub max_preemption_searches: usize,
    /// Strict order (classic FIFO): once a job cannot start, no later job of
    /// its queue may start this cycle. Off for Gangway's own policy.
    pub strict_order: bool,
    /// Most jobs signalled to stop in one cycle (victims of all preemptions).
    /// With the rule that a job evicted at an instant is not evicted again at
    /// that instant, this bounds the preemptions of any instant, even with a
    /// zero grace period.
    pub max_preemptions_per_cycle: usize,
    /// Per-job preemption budget: a job already preempted this many times is
    /// no longer a victim (`None`: no budget).
    pub preemption_budget: Option<u32>,
    /// A job that has run less than this many seconds in its current attempt is
    /// not a victim: preempting it would waste its start-up for nothing.
    pub min_run_seconds: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            backfill: true,
            preemption: true,
            fair_share: true,
            max_reservations: 1,
            max_preemption_searches: 4,
            strict_order: false,
            max_preemptions_per_cycle: 256,
            preemption_budget: None,
            min_run_seconds: 0,
        }
    }
}

/// Start a gang.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Bind {
    /// Job.
    pub job: JobId,
    /// Where.
    pub placement: Placement,
    /// Whether it started on GPUs reserved for another gang (it ends before that gang starts, or is preemptible by it).
    pub backfilled: bool,
}

/// Why a job is preempted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PreemptReason {
    /// A higher-priority job needs its GPUs.
    Priority,
    /// Its queue borrowed quota that the owner reclaims.
    Reclaim,
}

/// Signal a job to checkpoint and stop; it is requeued.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Preempt {
    /// The victim.
    pub job: JobId,
    /// Who needs the GPUs.
    pub by: JobId,
    /// Seconds between the checkpoint signal and the kill.
    pub grace_seconds: u64,
    /// Why.
    pub reason: PreemptReason,
    /// GPU-seconds since the victim's last checkpoint.
    pub lost_work_gpu_seconds: u64,
}

/// Where a preemptor will start once its victims have exited.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlannedStart {
    /// The preemptor.
    pub job: JobId,
    /// The GPUs its victims free, plus free ones.
    pub placement: Placement,
    /// The victims it waits for.
    pub after: Vec<JobId>,
}

/// GPUs set aside for the head-of-line gang.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Reservation {
    /// The gang.
    pub job: JobId,
    /// Estimated start (when enough running jobs are expected to end).
    pub start_at: Time,
    /// Nodes it will use.
    pub nodes: Vec<NodeIdx>,
}

/// Figures about one cycle.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CycleStats {
    /// Pending jobs looked at.
    pub considered: usize,
    /// Placement searches run (cache misses).
    pub placement_searches: usize,
    /// Jobs answered from the per-shape failure cache.
    pub cache_hits: usize,
    /// Free GPUs after the binds.
    pub free_gpus: u64,
    /// Of those, GPUs on nodes that are not wholly free: they cannot host a
    /// whole-node gang (the job big gangs wait for).
    pub fragmented_gpus: u64,
}

/// The outcome of a cycle.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Decisions {
    /// Gangs to start, in decision order.
    pub binds: Vec<Bind>,
    /// Jobs to preempt.
    pub preemptions: Vec<Preempt>,
    /// Reservations for head-of-line gangs.
    pub reservations: Vec<Reservation>,
    /// Where preemptors will start when their victims exit.
    pub planned: Vec<PlannedStart>,
    /// Claims dropped: the preemptor's victims are gone but it still cannot start.
    pub dropped_claims: Vec<JobId>,
    /// Every pending job that was not bound, with why.
    pub pending: Vec<Explanation>,
    /// Figures.
    pub stats: CycleStats,
}

/// Runs one scheduling cycle. Pure: reads `state`, returns decisions.
pub fn schedule(state: &ClusterState, now: Time, cfg: &SchedulerConfig) -> Decisions {
    let mut s = Session::new(state, now, cfg);
    s.hold_claims();
    for (std::cmp::Reverse(prio), level) in &state.pending {
        // Jobs that preempted others go first in their level and get back the
        // GPUs held for them, so what their victims freed is theirs.
        let mut claimed: HashSet<JobId> = HashSet::default();
        for id in state.claims.keys() {
            let Some(job) = state.job(*id) else { continue };
            if job.priority == *prio && job.status == JobStatus::Pending {
                claimed.insert(*id);
                s.release_hold(*id);
                let before = s.decisions.binds.len();
                s.consider(&job.gang);
                let waiting_victims = state.preempting.values().any(|by| by == id);
                if s.decisions.binds.len() == before && !waiting_victims && !s.claimed_again(*id) {
                    // Its victims are gone and it still cannot start: let the GPUs go.
                    s.decisions.dropped_claims.push(*id);
                }
            }
        }
        let mut walk = order::LevelWalk::new(state, level, cfg.fair_share);
        while let Some(g) = walk.next(&s.cap) {
            if claimed.contains(&g.id) {
                continue;
            }
            if let Some(&head) = s.blocked_by.get(&g.queue) {
                s.explain(g.id, WaitReason::InOrder { behind: head }, None);
                s.decisions.stats.considered += 1;
                continue;
            }
            let before = s.decisions.binds.len();
            s.consider(g);
            if cfg.strict_order && s.decisions.binds.len() == before {
                s.blocked_by.insert(g.queue, g.id);
            }
        }
    }
    s.decisions.stats.free_gpus = s.cap.free_total;
    s.decisions.stats.fragmented_gpus = state
        .nodes()
        .iter()
        .enumerate()
        .filter(|(_, n)| n.schedulable())
        .map(|(i, n)| {
            let free = u64::from(s.cap.free[i].count_ones());
            if free == u64::from(n.healthy.count_ones()) {
                0
            } else {
                free
            }
        })
        .sum();
    s.decisions
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ShapeKey {
    per: Resources,
    mask: u64,
    constraint: TopologyConstraint,
    replicas: u32,
    min: u32,
    all_reserved_excluded: bool,
}

/// One cycle's private working state.
pub(crate) struct Session<'a> {
    pub(crate) state: &'a ClusterState,
    pub(crate) now: Time,
    pub(crate) cfg: &'a SchedulerConfig,
    /// Free capacity as this cycle's binds consume it.
    pub(crate) cap: Capacity,
    /// Nodes reserved for head-of-line gangs.
    pub(crate) reserved: Bitset,
    fail_cache: HashMap<ShapeKey, FitFailure>,
    fits_cache: HashMap<ShapeKey, bool>,
    /// Preemption searches that failed this cycle (shape, reason, priority, queue).
    pub(crate) preempt_fail: HashSet<(ShapeKey, PreemptReason, i32, QueueId)>,
    /// Running preemptible jobs with their costs, built on the first search.
    pub(crate) victim_index: Option<preempt::VictimIndex<'a>>,
    /// Victims chosen this cycle.
    pub(crate) victims: HashSet<JobId>,
    /// Quota still charged to this cycle's victims (queue, amount): normal
    /// admission keeps counting it, preemptors' feasibility checks do not.
    pub(crate) victim_quota: Vec<(QueueId, Resources, bool)>,
    /// Jobs bound this cycle: estimated end, id, index into `decisions.binds`.
    pub(crate) bound: Vec<(Time, JobId, usize)>,
    pub(crate) preempt_searches: usize,
    /// GPUs held for claimants at the start of the cycle (job → node, mask).
    pub(crate) holds: HashMap<JobId, Vec<(NodeIdx, u64)>>,
    /// Preemptors whose victims are still in their grace period.
    pub(crate) waiting_preemptors: HashSet<JobId>,
    /// Under strict order: per queue, the first job that could not start.
    pub(crate) blocked_by: HashMap<QueueId, JobId>,
    pub(crate) decisions: Decisions,
}

impl<'a> Session<'a> {
    fn new(state: &'a ClusterState, now: Time, cfg: &'a SchedulerConfig) -> Self {
        let n = state.nodes().len();
        Session {
            state,
            now,
            cfg,
            cap: state.capacity.clone(),
            reserved: Bitset::new(n),
            fail_cache: HashMap::default(),
            fits_cache: HashMap::default(),
            preempt_fail: HashSet::default(),
            victim_index: None,
            victims: HashSet::default(),
            victim_quota: Vec::new(),
            bound: Vec::new(),
            preempt_searches: 0,
            blocked_by: HashMap::default(),
            waiting_preemptors: state.preempting.values().copied().collect(),
            holds: HashMap::default(),
            decisions: Decisions::default(),
        }
    }

    /// Takes the free GPUs of every pending claimant's planned placement out
    /// of the session's capacity, so only that claimant may use them.
    fn hold_claims(&mut self) {
        let state = self.state;
        for (id, p) in &state.claims {
            if state
                .job(*id)
                .is_none_or(|j| j.status != JobStatus::Pending)
            {
                continue;
            }
            let mut held = Vec::new();
            for rp in &p.replicas {
                let m = rp.gpus & self.cap.free[rp.node as usize];
                if m != 0 {
                    self.cap.take(&state.nodes, rp.node, m, 0, 0);
                    held.push((rp.node, m));
                }
            }
            self.holds.insert(*id, held);
        }
    }

    /// Gives a claimant back the GPUs held for it.
    fn release_hold(&mut self, id: JobId) {
        if let Some(held) = self.holds.remove(&id) {
            for (n, m) in held {
                self.cap.give(&self.state.nodes, n, m, 0, 0);
            }
            // Capacity grew: cached "does not fit" answers no longer hold.
            self.fail_cache.clear();
            self.fits_cache.clear();
        }
    }

    /// Whether the claimant chose new victims this cycle (its claim is renewed).
    fn claimed_again(&self, id: JobId) -> bool {
        self.decisions.planned.iter().any(|p| p.job == id)
    }

    fn explain(&mut self, job: JobId, reason: WaitReason, estimated_start: Option<Time>) {
        self.decisions.pending.push(Explanation {
            job,
            reason,
            estimated_start,
        });
    }

    /// Whether `job` may use nodes reserved for the head-of-line gangs.
    fn may_use_reserved(&self, job: &Gang) -> bool {
        self.decisions.reservations.iter().all(|r| {
            let ends_before = job.runtime.is_some_and(|rt| self.now + rt <= r.start_at);
            let holder_prio = self.state.job(r.job).map_or(i32::MIN, |h| h.priority);
            ends_before || (job.preemptible && job.priority < holder_prio)
        })
    }

    pub(crate) fn request<'b>(
        &self,
        job: &Gang,
        replicas: u32,
        exclude: Option<&'b Bitset>,
    ) -> placement::Request<'b> {
        placement::Request {
            replicas,
            per: job.per,
            class_mask: job.class_mask,
            constraint: job.topology,
            exclude,
        }
    }

    /// Places `job` with between `min` and `max` replicas on `cap`, largest first.
    pub(crate) fn place_elastic(
        &self,
        cap: &Capacity,
        job: &Gang,
        min: u32,
        max: u32,
        exclude: Option<&Bitset>,
    ) -> Result<Placement, FitFailure> {
        let first = placement::place(self.state, cap, &self.request(job, max, exclude));
        let Err(fail) = first else { return first };
        if min >= max
            || placement::place(self.state, cap, &self.request(job, min, exclude)).is_err()
        {
            return Err(fail);
        }
        let (mut lo, mut hi) = (min, max - 1);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if placement::place(self.state, cap, &self.request(job, mid, exclude)).is_ok() {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        placement::place(self.state, cap, &self.request(job, lo, exclude))
    }

    pub(crate) fn shape(&self, job: &Gang, kq: u32, min: u32, all_reserved: bool) -> ShapeKey {
        ShapeKey {
            per: job.per,
            mask: job.class_mask,
            constraint: job.topology,
            replicas: kq,
            min,
            all_reserved_excluded: all_reserved,
        }
    }

    fn cached_place(
        &mut self,
        job: &Gang,
        kq: u32,
        min: u32,
        all_reserved: bool,
    ) -> Result<Placement, FitFailure> {
        let key = self.shape(job, kq, min, all_reserved);
        if let Some(f) = self.fail_cache.get(&key) {
            self.decisions.stats.cache_hits += 1;
            return Err(*f);
        }
        self.decisions.stats.placement_searches += 1;
        let exclude = if all_reserved {
            Some(&self.reserved)
        } else {
            None
        };
        let r = self.place_elastic(&self.cap, job, min, kq, exclude);
        if let Err(f) = r {
            self.fail_cache.insert(key, f);
        }
        r
    }

    /// Whether the job would fit if the reservation did not exist (cached per
    /// shape for the cycle; only used to explain the wait).
    fn fits_unreserved(&mut self, job: &Gang, kq: u32, min: u32) -> bool {
        let key = self.shape(job, kq, min, false);
        if let Some(f) = self.fits_cache.get(&key) {
            return *f;
        }
        let fits = self.cached_place(job, kq, min, false).is_ok();
        self.fits_cache.insert(key, fits);
        fits
    }

    fn bind(&mut self, job: &Gang, placement: Placement, backfilled: bool) {
        let per = job.per;
        for rp in &placement.replicas {
            self.cap.take(
                &self.state.nodes,
                rp.node,
                rp.gpus,
                per.cpu_millis,
                per.memory_mib,
            );
        }
        self.cap.charge(
            &self.state.queues,
            job.queue,
            per * placement.replicas.len() as u64,
            true,
            !job.preemptible,
        );
        let est = self.now
            + job
                .expected_runtime
                .unwrap_or(self.state.config.unknown_runtime_floor_seconds)
                .max(1);
        self.bound.push((est, job.id, self.decisions.binds.len()));
        self.decisions.binds.push(Bind {
            job: job.id,
            placement,
            backfilled,
        });
    }

    /// Gives the victims' GPUs to a preemptor for the rest of the cycle: on the
    /// session's capacity the preemptor holds `p`, so no later job in this
    /// cycle takes what the preemptor waits for.
    /// A copy of the session capacity for a preemptor's what-if: the quota of
    /// victims already chosen this cycle counts as gone (it went to their preemptors).
    pub(crate) fn trial(&self) -> Capacity {
        let mut t = self.cap.clone();
        for (q, r, fixed) in &self.victim_quota {
            t.charge(&self.state.queues, *q, *r, false, *fixed);
        }
        t
    }

    /// Whatever of the victims' GPUs, CPU and memory the preemptor does not use
    /// stays unavailable: the victims hold it until they exit.
    pub(crate) fn claim(&mut self, job: &Gang, victims: &[&Job], p: &Placement) {
        let mut held: std::collections::BTreeMap<NodeIdx, (u64, u64, u64)> = Default::default();
        // Quota stays charged to the victims until they exit, so nobody else in
        // their queue takes it in between; the preemptor is charged on top.
        for v in victims {
            if let JobStatus::Running(r) = &v.status {
                let vp = v.per_replica();
                self.victim_quota.push((
                    v.queue,
                    vp * r.placement.replicas.len() as u64,
                    !v.spec.is_preemptible(),
                ));
                for rp in &r.placement.replicas {
                    self.cap.give(
                        &self.state.nodes,
                        rp.node,
                        rp.gpus,
                        vp.cpu_millis,
                        vp.memory_mib,
                    );
                }
                for rp in &r.placement.replicas {
                    let e = held.entry(rp.node).or_default();
                    e.0 |= rp.gpus;
                    e.1 += vp.cpu_millis;
                    e.2 += vp.memory_mib;
                }
            }
        }
        let per = job.per;
        for rp in &p.replicas {
            self.cap.take(
                &self.state.nodes,
                rp.node,
                rp.gpus,
                per.cpu_millis,
                per.memory_mib,
            );
            if let Some(e) = held.get_mut(&rp.node) {
                e.0 &= !rp.gpus;
                e.1 = e.1.saturating_sub(per.cpu_millis);
                e.2 = e.2.saturating_sub(per.memory_mib);
            }
        }
        for (n, (mask, cpu, mem)) in held {
            let i = n as usize;
            let mask = mask & self.cap.free[i];
            let cpu = cpu.min(self.cap.free_cpu[i]);
            let mem = mem.min(self.cap.free_mem[i]);
            self.cap.take(&self.state.nodes, n, mask, cpu, mem);
        }
        self.cap.charge(
            &self.state.queues,
            job.queue,
            per * p.replicas.len() as u64,
            true,
            !job.preemptible,
        );
        self.decisions.planned.push(PlannedStart {
            job: job.id,
            placement: p.clone(),
            after: victims.iter().map(|v| v.id).collect(),
        });
    }

    fn eta(&self, reason: &WaitReason) -> Option<Time> {
        match reason {
            WaitReason::Preempting { grace_seconds, .. } => Some(self.now + grace_seconds),
            _ => None,
        }
    }

    fn consider(&mut self, job: &Gang) {
        let state = self.state;
        let id = job.id;
        self.decisions.stats.considered += 1;
        let per = job.per;
        let min = job.min;
        let preemptible = job.preemptible;
        let kq = match quota::max_admissible(
            state,
            &self.cap,
            job.queue,
            per,
            min,
            job.replicas,
            preemptible,
        ) {
            Ok(k) => k,
            Err(block) => {
                if self.cfg.preemption {
                    if let Some(reason) = self.awaiting_victims(job, min) {
                        return self.explain(id, reason, None);
                    }
                }
                if self.cfg.preemption && self.preempt_searches < self.cfg.max_preemption_searches {
                    // Lower-priority work in its own queue (or borrowers) gives way
                    // to it, quota included; borrowers give back lent quota.
                    let mut tries = vec![PreemptReason::Priority];
                    if block.can_reclaim {
                        tries.push(PreemptReason::Reclaim);
                    }
                    for r in tries {
                        if let Some(reason) = preempt::try_preempt(self, job, min, r) {
                            let eta = self.eta(&reason);
                            return self.explain(id, reason, eta);
                        }
                    }
                }
                return self.explain(id, WaitReason::Quota(block), None);
            }
        };
        let use_reserved = self.may_use_reserved(job);
        let has_reservation = !self.decisions.reservations.is_empty();
        match self.cached_place(job, kq, min, !use_reserved) {
            Ok(p) => {
                let backfilled = has_reservation
                    && p.nodes()
                        .iter()
                        .any(|n| self.reserved.contains(*n as usize));
                self.bind(job, p, backfilled);
            }
            Err(fail) => {
                if !use_reserved && self.fits_unreserved(job, kq, min) {
                    let r = &self.decisions.reservations[0];
                    let reason = WaitReason::BehindReservation {
                        holder: r.job,
                        start_at: r.start_at,
                    };
                    return self.explain(id, reason, None);
                }
                if self.cfg.preemption {
                    if let Some(reason) = self.awaiting_victims(job, min) {
                        return self.explain(id, reason, None);
                    }
                }
                if self.cfg.preemption && self.preempt_searches < self.cfg.max_preemption_searches {
                    if let Some(reason) =
                        preempt::try_preempt(self, job, min, PreemptReason::Priority)
                    {
                        let eta = self.eta(&reason);
                        return self.explain(id, reason, eta);
                    }
                    if quota::within_nominal(state, &self.cap, job.queue, per * u64::from(min)) {
                        if let Some(reason) =
                            preempt::try_preempt(self, job, min, PreemptReason::Reclaim)
                        {
                            let eta = self.eta(&reason);
                            return self.explain(id, reason, eta);
                        }
                    }
                }
                if let Some(block) =
                    quota::borrow_block(state, &self.cap, job.queue, per * u64::from(min))
                {
                    return self.explain(id, WaitReason::Quota(block), None);
                }
                if self.cfg.backfill
                    && self.decisions.reservations.len() < self.cfg.max_reservations
                {
                    if let Some(r) = backfill::reserve(self, job, kq.max(min)) {
                        let reason = WaitReason::Reserved {
                            start_at: r.start_at,
                            nodes: r.nodes.len() as u32,
                        };
                        let eta = r.start_at;
                        for n in &r.nodes {
                            self.reserved.insert(*n as usize);
                        }
                        self.decisions.reservations.push(r);
                        return self.explain(id, reason, Some(eta));
                    }
                }
                self.explain(id, WaitReason::NoFit(fail), None);
            }
        }
    }

    /// If victims signalled earlier for `job` are still in their grace period
    /// and their exit lets it start, it just waits for them (holding the nodes)
    /// instead of preempting more.
    fn awaiting_victims(&mut self, job: &Gang, min: u32) -> Option<WaitReason> {
        let state = self.state;
        if !self.waiting_preemptors.contains(&job.id) {
            return None;
        }
        let mine: Vec<&Job> = state
            .preempting
            .iter()
            .filter(|(_, by)| **by == job.id)
            .filter_map(|(v, _)| state.job(*v))
            .collect();
        if mine.is_empty() {
            return None;
        }
        let mut trial = self.trial();
        for v in &mine {
            preempt::release_into(state, &mut trial, v);
        }
        let per = job.per;
        quota::check(
            state,
            &trial,
            job.queue,
            per * u64::from(min),
            job.preemptible,
        )
        .ok()?;
        let p = self.place_elastic(&trial, job, min, min, None).ok()?;
        self.claim(job, &mine, &p);
        Some(WaitReason::AwaitingPreemption {
            victims: mine.len() as u32,
        })
    }
}

/// Applies a cycle's decisions to `state`: binds start, victims are marked as
/// preempting (the caller requeues them when they exit). Stops at the first
/// decision the state refuses, which a correct cycle never produces.
pub fn apply(state: &mut ClusterState, d: &Decisions, now: Time) -> Result<(), StateError> {
    for b in &d.binds {
        state.bind(b.job, b.placement.clone(), now)?;
    }
    for p in &d.preemptions {
        state.mark_preempting(p.job, p.by, now)?;
    }
    for p in &d.planned {
        state.record_claim(p.job, p.placement.clone())?;
    }
    for j in &d.dropped_claims {
        state.drop_claim(*j);
    }
    Ok(())
}
