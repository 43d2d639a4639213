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
//! 5. **plan, reserve and backfill**: every pending job that does not fit
//!    (up to [`SchedulerConfig::plan_depth`] of them, in order) gets a planned
//!    start and nodes on a timeline of running jobs' estimated ends and the
//!    plans made before it; the first N of them (per [`Backfill`]) hold a
//!    reservation: later jobs may use its nodes only if they end before it
//!    starts or can be preempted by it ([`backfill`]).

pub mod backfill;
pub mod bitset;
pub mod capacity;
pub mod explain;
pub mod model;
pub mod order;
pub mod placement;
pub mod policies;
pub mod policy;
pub mod predict;
pub mod preempt;
pub mod quota;
pub mod rank;
pub mod state;
mod victims;

pub use capacity::{Capacity, NodeIdx, QueueId};
pub use explain::{plural, Explanation, WaitReason};
pub use placement::{FitFailure, Shortage};
pub use quota::{QuotaBlock, QuotaLimit};
pub use state::{
    Avoid, ClusterState, Gang, Job, JobStatus, Maintenance, NamesVersion, Placement, Rejection,
    ReplicaPlacement, RunInfo, StateConfig, StateError,
};

use bitset::Bitset;
use gangway_core::{JobId, Resources, Time, TopologyConstraint};
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use serde::Serialize;

/// How many planned jobs hold a reservation that backfill must respect.
///
/// Every planned job gets a start estimate; only reserved ones constrain
/// later jobs. Written `off`, `easy`, `conservative` or `reservations:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backfill {
    /// No reservations and no plan: any job that fits starts (greedy).
    Off,
    /// EASY: only the first job that does not fit holds a reservation.
    Easy,
    /// Every planned job holds a reservation: a later job starts early only
    /// where it delays none of them.
    Conservative,
    /// The first N jobs that do not fit hold reservations.
    Reservations(u32),
}

impl Backfill {
    /// Whether jobs get planned starts at all.
    pub fn enabled(self) -> bool {
        self != Backfill::Off
    }

    /// Most reservations in one cycle.
    pub fn reservations(self) -> usize {
        match self {
            Backfill::Off => 0,
            Backfill::Easy => 1,
            Backfill::Conservative => usize::MAX,
            Backfill::Reservations(n) => n as usize,
        }
    }
}

impl std::fmt::Display for Backfill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backfill::Off => f.write_str("off"),
            Backfill::Easy => f.write_str("easy"),
            Backfill::Conservative => f.write_str("conservative"),
            Backfill::Reservations(n) => write!(f, "reservations:{n}"),
        }
    }
}

/// A backfill mode that is none of `off`, `easy`, `conservative`, `reservations:N`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "backfill: expected off, easy, conservative or reservations:N (N from 0 to 100000), got {0:?}"
)]
pub struct BadBackfill(pub String);

/// Most reservations `reservations:N` may ask for.
pub const MAX_RESERVATIONS: u32 = 100_000;

impl std::str::FromStr for Backfill {
    type Err = BadBackfill;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        match t {
            "off" => return Ok(Backfill::Off),
            "easy" => return Ok(Backfill::Easy),
            "conservative" => return Ok(Backfill::Conservative),
            _ => {}
        }
        let n = t
            .strip_prefix("reservations:")
            .or_else(|| t.strip_prefix("reservations="))
            .and_then(|n| n.trim().parse::<u32>().ok())
            .filter(|n| *n <= MAX_RESERVATIONS)
            .ok_or_else(|| BadBackfill(s.chars().take(64).collect()))?;
        Ok(Backfill::Reservations(n))
    }
}

impl Serialize for Backfill {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Backfill {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Default of [`SchedulerConfig::plan_depth`].
pub const DEFAULT_PLAN_DEPTH: usize = 200;

/// Default of [`SchedulerConfig::plan_budget`].
pub const DEFAULT_PLAN_BUDGET: usize = 100_000;

/// Default of [`SchedulerConfig::max_victims_examined`].
pub const DEFAULT_MAX_VICTIMS_EXAMINED: usize = 16_384;

/// Default of [`SchedulerConfig::max_pending_examined`].
pub const DEFAULT_MAX_PENDING_EXAMINED: usize = 20_000;

/// The scheduler's settings: the scheduling policy by name and the core's
/// switches and bounds for a cycle. Its serialised form is a versioned
/// policy's `scheduler` section (and the configuration file's): every field
/// may be left out (the default is kept); `strict_order`, `plan_budget` and
/// `max_victims_examined` are not written or read there (the policy named
/// sets the first, the core's defaults the others).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerConfig {
    /// The scheduling policy, a name in [`policies`]' registry (`gangway`
    /// by default): it ranks the jobs and sets the switches it defines on
    /// top of these ([`policy::SchedulingPolicy::configure`]). The core's
    /// cycle itself does not read it.
    pub policy: String,
    /// Plan starts for pending jobs, reserve GPUs for the first of them and
    /// backfill around the reservations.
    pub backfill: Backfill,
    /// Preempt lower-priority work and reclaim lent quota.
    pub preemption: bool,
    /// Use DRF fair share between queues (otherwise submit order within a priority).
    pub fair_share: bool,
    /// Most pending jobs given a planned start per cycle, in scheduling
    /// order; later ones that do not fit wait with reason `Priority` and no
    /// estimate. Bounds the plan's cost on huge queues.
    pub plan_depth: usize,
    /// Most running jobs' estimated ends the plan may walk per cycle for
    /// plans that hold no reservation (reservations are always planned: they
    /// decide what may start). Once spent, later jobs wait with reason
    /// `Priority` and no estimate, as beyond `plan_depth`. On a busy
    /// 50,000-node cluster one plan may walk hundreds of thousands of ends;
    /// this keeps the cycle short whatever the queue holds.
    #[serde(skip)]
    pub plan_budget: usize,
    /// Most preemption searches per cycle. Keeping preemption gradual matters:
    /// on the contended Chronus trace, 4 gives a 7.7 h average JCT and 6,500
    /// preemptions where 64 gives 27.5 h and 117,000 (victims churn).
    pub max_preemption_searches: usize,
    /// Strict order (classic FIFO): once a job cannot start, no later job of
    /// its queue may start this cycle. Off for Gangway's own policy.
    #[serde(skip)]
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
    /// With it, the minimum run time grows with each preemption: a job
    /// preempted `k` times is a victim only after running `(k + 1) ×`
    /// the minimum in its current attempt ([`preempt::min_run_of`]). Work
    /// lost per preemption (since the last checkpoint, plus the grace) is
    /// then a shrinking share of the run, however often a job is chosen,
    /// and, unlike a fixed [`Self::preemption_budget`], no job becomes
    /// immune and holds its GPUs for days against jobs that are owed them.
    pub min_run_grows: bool,
    /// Most victim candidates one preemption search examines, in its order
    /// (least lost work first; lowest priority first for reclaim). A search
    /// that needs more gives up, so a preemptor that no set of cheap victims
    /// can make room for costs a bounded time however many jobs run. A
    /// search that finishes within the bound chooses what an unbounded one
    /// would.
    #[serde(skip)]
    pub max_victims_examined: usize,
    /// Most pending jobs examined per cycle (Slurm's `default_queue_depth`
    /// and `bf_max_job_test` play this part). Below it every pending job is
    /// examined in order, as without a cap. Above it the first half of the
    /// budget goes to the head of the order, and the other half to a window
    /// of the rest that moves on by its width each cycle: each later job is
    /// examined once every `ceil(rest / half)` cycles on a steady queue, so
    /// deep jobs still get to backfill and their explanations are
    /// refreshed. Jobs not examined in a cycle get no explanation in its
    /// decisions (`CycleStats::unexamined` counts them): callers keep the
    /// last one. Preemptors holding GPUs for their start are always
    /// examined, beyond the budget if need be. Bounds the cycle's cost on a
    /// huge queue.
    pub max_pending_examined: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            policy: policies::DEFAULT.to_string(),
            backfill: Backfill::Easy,
            preemption: true,
            fair_share: true,
            plan_depth: DEFAULT_PLAN_DEPTH,
            plan_budget: DEFAULT_PLAN_BUDGET,
            max_preemption_searches: 4,
            strict_order: false,
            max_preemptions_per_cycle: 256,
            preemption_budget: None,
            min_run_seconds: 0,
            min_run_grows: false,
            max_victims_examined: DEFAULT_MAX_VICTIMS_EXAMINED,
            max_pending_examined: DEFAULT_MAX_PENDING_EXAMINED,
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

/// GPUs set aside for a pending gang that does not fit yet, or its planned
/// start when it holds no reservation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Reservation {
    /// The gang.
    pub job: JobId,
    /// Estimated start (when enough running jobs are expected to end).
    pub start_at: Time,
    /// Estimated end (start plus its planning run time).
    pub end_at: Time,
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
    /// Running jobs' estimated ends the plan walked, over all planned jobs
    /// (its main cost on a large, busy cluster).
    pub plan_releases: usize,
    /// Running jobs the preemption searches drew from the victim index, over
    /// all searches (their main cost: each search draws candidates cheapest
    /// first and stops once it has its victims).
    pub victims_examined: usize,
    /// Pending jobs this cycle did not examine
    /// ([`SchedulerConfig::max_pending_examined`]): they keep their last
    /// explanation.
    pub unexamined: usize,
}

/// The outcome of a cycle.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Decisions {
    /// Gangs to start, in decision order.
    pub binds: Vec<Bind>,
    /// Jobs to preempt.
    pub preemptions: Vec<Preempt>,
    /// Reservations: planned starts that backfill must respect.
    pub reservations: Vec<Reservation>,
    /// The whole plan in scheduling order: every planned pending job
    /// (reserved or not) with its estimated start and nodes.
    pub plan: Vec<Reservation>,
    /// Where preemptors will start when their victims exit.
    pub planned: Vec<PlannedStart>,
    /// Claims dropped: the preemptor's victims are gone but it still cannot start.
    pub dropped_claims: Vec<JobId>,
    /// Every pending job examined and not bound, with why.
    pub pending: Vec<Explanation>,
    /// Where the next capped cycle's window of pending jobs past the head
    /// starts ([`SchedulerConfig::max_pending_examined`]); `apply` keeps it
    /// in the state.
    pub next_rotation: u64,
    /// Figures.
    pub stats: CycleStats,
}

/// Runs one scheduling cycle. Pure: reads `state`, returns decisions.
pub fn schedule(state: &ClusterState, now: Time, cfg: &SchedulerConfig) -> Decisions {
    let mut s = Session::new(state, now, cfg);
    s.hold_claims();
    let mut budget = Examine::new(state, cfg);
    let mut walking = true;
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
        if !walking {
            // The budget is spent; preemptors holding GPUs are still
            // examined (above), so what their victims free is used.
            continue;
        }
        let mut walk = order::LevelWalk::new(state, level, cfg.fair_share);
        while let Some(g) = walk.next(&s.cap) {
            if claimed.contains(&g.id) {
                continue;
            }
            match budget.admit(s.decisions.stats.considered) {
                Turn::Examine => {}
                Turn::Skip => continue,
                Turn::Done => {
                    walking = false;
                    break;
                }
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
    s.decisions.stats.unexamined = state
        .pending_count()
        .saturating_sub(s.decisions.stats.considered);
    s.decisions.next_rotation = budget.next_rotation(state);
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

/// Whether the walk examines a pending job ([`Examine::admit`]).
enum Turn {
    Examine,
    Skip,
    Done,
}

/// The cycle's budget of pending jobs examined
/// ([`SchedulerConfig::max_pending_examined`]): the head of the order, then
/// a window of the positions after it that moves on by its width each cycle
/// (wrapping round), so every later job is examined once per rotation.
struct Examine {
    /// Examined in order while fewer than this were (`usize::MAX`: no cap).
    head: usize,
    /// The most examined in all.
    limit: usize,
    /// Positions past the head (as counted at the start of the cycle).
    tail: u64,
    /// The window: positions `start`, `start + 1`, … (mod `tail`), `width` of them.
    start: u64,
    width: u64,
    /// Positions past the head walked so far.
    walked: u64,
}

impl Examine {
    fn new(state: &ClusterState, cfg: &SchedulerConfig) -> Self {
        let pending = state.pending_count();
        let limit = cfg.max_pending_examined.max(2);
        if pending <= limit {
            return Examine {
                head: usize::MAX,
                limit: usize::MAX,
                tail: 1,
                start: 0,
                width: 0,
                walked: 0,
            };
        }
        let head = limit / 2;
        let tail = (pending - head) as u64;
        Examine {
            head,
            limit,
            tail,
            start: state.rotation % tail,
            width: (limit - head) as u64,
            walked: 0,
        }
    }

    /// Whether the next job of the walk is examined, given `examined` so far.
    fn admit(&mut self, examined: usize) -> Turn {
        if examined < self.head {
            return Turn::Examine;
        }
        if examined >= self.limit {
            return Turn::Done;
        }
        let pos = self.walked;
        self.walked += 1;
        if (pos % self.tail + self.tail - self.start) % self.tail < self.width {
            Turn::Examine
        } else {
            Turn::Skip
        }
    }

    /// Where the next cycle's window starts.
    fn next_rotation(&self, state: &ClusterState) -> u64 {
        if self.head == usize::MAX {
            state.rotation
        } else {
            (self.start + self.width) % self.tail
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ShapeKey {
    per: Resources,
    mask: u64,
    constraint: TopologyConstraint,
    replicas: u32,
    min: u32,
    excluded: Option<ExclKey>,
}

/// Which nodes a job may not use: those of the first `prefix` reservations
/// in start order (those starting before the job would end), less those a
/// preemptible job of priority below `exempt_below` may use, those of the
/// first `maint` maintenance windows in start order, and those job `avoid`
/// avoids ([`state::Avoid`]). `generation` is the number of reservations
/// when the set was made.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct ExclKey {
    generation: u32,
    prefix: u32,
    exempt_below: i32,
    maint: u32,
    avoid: Option<JobId>,
}

/// A planned job's hold on the timeline: its GPUs, CPU and memory per node
/// from `start` to `end`.
pub(crate) struct PlanEntry {
    pub(crate) start: Time,
    pub(crate) end: Time,
    /// Whether it is a reservation (later jobs must respect it).
    pub(crate) reserved: bool,
    /// Whether it is a maintenance window (its nodes run nothing then).
    pub(crate) maintenance: bool,
    /// Its job's priority.
    pub(crate) priority: i32,
    /// (node, GPU mask, CPU, memory).
    pub(crate) holds: Vec<(NodeIdx, u64, u64, u64)>,
}

/// One cycle's private working state.
pub(crate) struct Session<'a> {
    pub(crate) state: &'a ClusterState,
    pub(crate) now: Time,
    pub(crate) cfg: &'a SchedulerConfig,
    /// Free capacity as this cycle's binds consume it.
    pub(crate) cap: Capacity,
    /// Nodes of any reservation.
    pub(crate) reserved: Bitset,
    /// Reservations by start: (start, index into `decisions.reservations`).
    pub(crate) res_by_start: Vec<(Time, usize)>,
    /// Maintenance windows not yet over, by start.
    pub(crate) maint_by_start: Vec<&'a state::Maintenance>,
    /// Node sets excluded for jobs that may not use some reservations.
    pub(crate) excl_sets: HashMap<ExclKey, Bitset>,
    /// The maintenance nodes the current preemption search must avoid.
    pub(crate) preempt_maint: Option<ExclKey>,
    /// The plan's holds, in plan order.
    pub(crate) plan: Vec<PlanEntry>,
    /// Running jobs' releases by estimated end (overrunning ones
    /// re-estimated), started on the first plan of the cycle and produced
    /// only as far as the walks read.
    pub(crate) releases: Option<backfill::Releases<'a>>,
    /// `bound` sorted by estimated end, as of `bound_sorted_len` binds.
    pub(crate) bound_sorted: Vec<(Time, usize)>,
    /// The plan's working copy of the capacity, made on the first plan and
    /// reused by the others (each walk puts back what it changed).
    timeline: Option<backfill::Timeline>,
    /// The plan's walk budget ([`SchedulerConfig::plan_budget`]) is spent.
    plan_spent: bool,
    fail_cache: HashMap<ShapeKey, FitFailure>,
    fits_cache: HashMap<ShapeKey, bool>,
    /// Preemption searches that failed this cycle (shape, reason, priority, queue).
    pub(crate) preempt_fail: HashSet<(ShapeKey, PreemptReason, i32, QueueId)>,
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
        let mut s = Session::bare(state, now, cfg, n);
        let mut maint: Vec<&state::Maintenance> =
            state.maintenance().filter(|m| m.end > now).collect();
        maint.sort_by_key(|m| (m.start, m.end));
        for m in &maint {
            // The plan holds its nodes whole for the window.
            s.plan.push(PlanEntry {
                start: m.start.max(now),
                end: m.end,
                reserved: false,
                maintenance: true,
                priority: i32::MAX,
                holds: m
                    .nodes
                    .iter()
                    .map(|n| (*n, u64::MAX, u64::MAX, u64::MAX))
                    .collect(),
            });
        }
        s.maint_by_start = maint;
        s
    }

    fn bare(state: &'a ClusterState, now: Time, cfg: &'a SchedulerConfig, n: usize) -> Self {
        Session {
            state,
            now,
            cfg,
            cap: {
                // Journaled, so the plan's timeline copy follows the binds.
                let mut c = state.capacity.clone();
                c.journal = Some(Vec::new());
                c
            },
            reserved: Bitset::new(n),
            res_by_start: Vec::new(),
            maint_by_start: Vec::new(),
            excl_sets: HashMap::default(),
            preempt_maint: None,
            plan: Vec::new(),
            releases: None,
            bound_sorted: Vec::new(),
            timeline: None,
            plan_spent: false,
            fail_cache: HashMap::default(),
            fits_cache: HashMap::default(),
            preempt_fail: HashSet::default(),
            victims: HashSet::default(),
            victim_quota: Vec::new(),
            bound: Vec::new(),
            preempt_searches: 0,
            blocked_by: HashMap::default(),
            waiting_preemptors: state.preempting.values().copied().collect(),
            holds: HashMap::default(),
            decisions: Decisions {
                // Every pending job not bound gets an explanation: one
                // allocation instead of a dozen doublings of a large vector.
                pending: Vec::with_capacity(state.pending_count()),
                ..Decisions::default()
            },
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

    /// The reservations whose nodes `job` may not use: those starting before
    /// it would end (all, when its run time is unknown), unless it is
    /// preemptible and of lower priority than their holder. `None`: it may
    /// use every node. The node set is built once per distinct answer.
    fn exclusion(&mut self, job: &Gang) -> Option<ExclKey> {
        if self.res_by_start.is_empty() && self.maint_by_start.is_empty() && !job.avoids {
            return None;
        }
        let prefix = match job.runtime {
            Some(rt) => {
                let end = self.now.saturating_add(rt);
                self.res_by_start.partition_point(|(start, _)| *start < end)
            }
            None => self.res_by_start.len(),
        };
        let maint = self.maint_prefix(job);
        self.exclusion_key(job, prefix, maint)
    }

    /// How many maintenance windows (in start order) `job` would run into if
    /// it started now: its estimated end is its time limit, else its
    /// predicted run time, else the unknown-run-time floor.
    pub(crate) fn maint_prefix(&self, job: &Gang) -> usize {
        let end = self
            .now
            .saturating_add(backfill::plan_runtime(self.state, job));
        self.maint_by_start.partition_point(|m| m.start < end)
    }

    /// The nodes `job` avoids now ([`ClusterState::set_avoid`]), if any.
    pub(crate) fn avoided(&self, job: &Gang) -> Option<&'a state::Avoid> {
        if !job.avoids {
            return None;
        }
        let state: &'a ClusterState = self.state;
        state
            .job(job.id)?
            .avoid
            .as_ref()
            .filter(|a| a.holds(self.now))
    }

    /// The key excluding only the nodes `job` avoids (`None` when it avoids
    /// none now): for placements that respect no reservation or window
    /// (a claimant's, the plan's own walk).
    pub(crate) fn avoid_key(&mut self, job: &Gang) -> Option<ExclKey> {
        if !job.avoids {
            return None;
        }
        self.exclusion_key(job, 0, 0)
    }

    /// The key (and node set, built once) for reservation prefix `prefix`
    /// and maintenance prefix `maint`, with the nodes the job avoids;
    /// `None` when nothing is excluded.
    pub(crate) fn exclusion_key(
        &mut self,
        job: &Gang,
        prefix: usize,
        maint: usize,
    ) -> Option<ExclKey> {
        self.exclusion_key_with(job, prefix, maint, true)
    }

    /// [`Self::exclusion_key`], leaving the avoided nodes out unless `avoid`.
    pub(crate) fn exclusion_key_with(
        &mut self,
        job: &Gang,
        prefix: usize,
        maint: usize,
        avoid: bool,
    ) -> Option<ExclKey> {
        let avoided = if avoid { self.avoided(job) } else { None };
        if prefix == 0 && maint == 0 && avoided.is_none() {
            return None;
        }
        let key = ExclKey {
            generation: self.decisions.reservations.len() as u32,
            prefix: prefix as u32,
            exempt_below: if job.preemptible {
                job.priority
            } else {
                i32::MIN
            },
            maint: maint as u32,
            avoid: avoided.map(|_| job.id),
        };
        if !self.excl_sets.contains_key(&key) {
            if self
                .excl_sets
                .keys()
                .any(|k| k.generation != key.generation)
            {
                self.excl_sets.clear();
            }
            let mut set = Bitset::new(self.state.nodes().len());
            let mut any = false;
            for &(_, i) in &self.res_by_start[..prefix] {
                let r = &self.decisions.reservations[i];
                let holder_prio = self.state.job(r.job).map_or(i32::MIN, |h| h.priority);
                if job.preemptible && job.priority < holder_prio {
                    continue;
                }
                for n in &r.nodes {
                    set.insert(*n as usize);
                    any = true;
                }
            }
            for m in &self.maint_by_start[..maint] {
                for n in &m.nodes {
                    set.insert(*n as usize);
                    any = true;
                }
            }
            for n in avoided.iter().flat_map(|a| &a.nodes) {
                set.insert(*n as usize);
                any = true;
            }
            if !any {
                return None;
            }
            self.excl_sets.insert(key, set);
        }
        Some(key)
    }

    /// The first reservation (by start) among those `key` excludes.
    fn first_excluding(&self, job: &Gang, key: ExclKey) -> Option<&Reservation> {
        self.res_by_start[..key.prefix as usize]
            .iter()
            .map(|&(_, i)| &self.decisions.reservations[i])
            .find(|r| {
                let holder_prio = self.state.job(r.job).map_or(i32::MIN, |h| h.priority);
                !(job.preemptible && job.priority < holder_prio)
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

    pub(crate) fn shape(
        &self,
        job: &Gang,
        kq: u32,
        min: u32,
        excluded: Option<ExclKey>,
    ) -> ShapeKey {
        ShapeKey {
            per: job.per,
            mask: job.class_mask,
            constraint: job.topology,
            replicas: kq,
            min,
            excluded,
        }
    }

    fn cached_place(
        &mut self,
        job: &Gang,
        kq: u32,
        min: u32,
        excluded: Option<ExclKey>,
    ) -> Result<Placement, FitFailure> {
        let key = self.shape(job, kq, min, excluded);
        if let Some(f) = self.fail_cache.get(&key) {
            self.decisions.stats.cache_hits += 1;
            return Err(*f);
        }
        self.decisions.stats.placement_searches += 1;
        let exclude = excluded.and_then(|k| self.excl_sets.get(&k));
        let r = self.place_elastic(&self.cap, job, min, kq, exclude);
        if let Err(f) = r {
            self.fail_cache.insert(key, f);
        }
        r
    }

    /// Whether the job would fit if the reservation did not exist (cached per
    /// shape for the cycle; only used to explain the wait).
    fn fits_unreserved(&mut self, job: &Gang, kq: u32, min: u32) -> bool {
        // Nodes the job avoids stay off: they are not what it waits for.
        let avoid = self.avoid_key(job);
        let key = self.shape(job, kq, min, avoid);
        if let Some(f) = self.fits_cache.get(&key) {
            return *f;
        }
        let fits = self.cached_place(job, kq, min, avoid).is_ok();
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
        t.journal = None;
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

    /// Why a job that does not fit gets no plan this cycle: the plan is as
    /// deep as it may go, or its walk budget is spent.
    fn beyond_plan(&self) -> WaitReason {
        WaitReason::BeyondPlan {
            depth: self.decisions.plan.len().min(self.cfg.plan_depth) as u32,
        }
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
        let excluded = self.exclusion(job);
        let has_reservation = !self.decisions.reservations.is_empty();
        match self.cached_place(job, kq, min, excluded) {
            Ok(p) => {
                let backfilled = has_reservation
                    && p.nodes()
                        .iter()
                        .any(|n| self.reserved.contains(*n as usize));
                self.bind(job, p, backfilled);
            }
            Err(fail) => {
                if let Some(reason) = self.avoiding(job, kq, min, excluded) {
                    let eta = match &reason {
                        WaitReason::Avoiding { until, .. } => Some(*until),
                        _ => None,
                    };
                    return self.explain(id, reason, eta);
                }
                if let Some(key) = excluded {
                    if key.maint > 0 && self.fits_unreserved(job, kq, min) {
                        // Does it fit once only reservations are kept off?
                        let res_only = self.exclusion_key(job, key.prefix as usize, 0);
                        if self.cached_place(job, kq, min, res_only).is_ok() {
                            let m = self.maint_by_start[0];
                            let reason = WaitReason::Maintenance {
                                name: m.name.clone(),
                                start_at: m.start,
                                end_at: m.end,
                            };
                            let eta = self.plan_start(job, kq.max(min), false).map(|(t, _)| t);
                            return self.explain(id, reason, eta);
                        }
                    }
                    if self.fits_unreserved(job, kq, min) {
                        let (holder, start_at) = self
                            .first_excluding(job, key)
                            .map_or((id, self.now), |r| (r.job, r.start_at));
                        let reason = WaitReason::BehindReservation { holder, start_at };
                        let reserve =
                            self.decisions.reservations.len() < self.cfg.backfill.reservations();
                        let eta = self.plan_start(job, kq.max(min), reserve).map(|(t, _)| t);
                        return self.explain(id, reason, eta);
                    }
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
                if !self.cfg.backfill.enabled() {
                    return self.explain(id, WaitReason::NoFit(fail), None);
                }
                let reserve = self.decisions.reservations.len() < self.cfg.backfill.reservations();
                if self.decisions.plan.len() >= self.cfg.plan_depth || (self.plan_spent && !reserve)
                {
                    return self.explain(id, self.beyond_plan(), None);
                }
                match self.plan_start(job, kq.max(min), reserve) {
                    Some((start_at, nodes)) => {
                        let reason = if reserve {
                            WaitReason::Reserved { start_at, nodes }
                        } else {
                            WaitReason::Planned { start_at, nodes }
                        };
                        self.explain(id, reason, Some(start_at));
                    }
                    None if self.plan_spent && !reserve => {
                        self.explain(id, self.beyond_plan(), None)
                    }
                    None => self.explain(id, WaitReason::NeverFits(fail), None),
                }
            }
        }
    }

    /// When `job` does not fit only because of the nodes it avoids (it would
    /// fit on them now, keeping off every reservation and maintenance window
    /// `excluded` names), why it waits: it avoids them until its avoidance
    /// lapses, then it may run there again.
    fn avoiding(
        &mut self,
        job: &Gang,
        kq: u32,
        min: u32,
        excluded: Option<ExclKey>,
    ) -> Option<WaitReason> {
        let a = self.avoided(job)?;
        let key = excluded?;
        let without = self.exclusion_key_with(job, key.prefix as usize, key.maint as usize, false);
        self.cached_place(job, kq, min, without).ok()?;
        Some(WaitReason::Avoiding {
            nodes: a.nodes.clone(),
            until: a.until,
        })
    }

    /// Plans `job`'s start with `replicas` on the timeline (running jobs'
    /// estimated ends, this cycle's binds, earlier plans) and records it in
    /// the plan; with `reserve` it also holds a reservation that later jobs
    /// must respect. Returns the start and the number of nodes, or `None`
    /// when the gang cannot fit even once everything running has ended, or
    /// when the plan is full.
    fn plan_start(&mut self, job: &Gang, replicas: u32, reserve: bool) -> Option<(Time, u32)> {
        if !self.cfg.backfill.enabled()
            || self.decisions.plan.len() >= self.cfg.plan_depth
            || (self.plan_spent && !reserve)
        {
            return None;
        }
        self.prepare_timeline();
        let mut tl = self
            .timeline
            .take()
            .unwrap_or_else(|| backfill::Timeline::new(&self.cap));
        let limit = if reserve {
            usize::MAX
        } else {
            self.cfg
                .plan_budget
                .saturating_sub(self.decisions.stats.plan_releases)
        };
        let mut rel = self
            .releases
            .take()
            .unwrap_or_else(|| backfill::Releases::new(self.state, self.now));
        let avoid = self.avoid_key(job);
        let until = self.avoided(job).map(|a| a.until);
        let exclude = avoid.and_then(|k| self.excl_sets.get(&k));
        let (mut found, mut walked) =
            backfill::earliest(self, &mut tl, &mut rel, job, replicas, limit, exclude);
        if let (backfill::Walk::Never, Some(until)) = (&found, until) {
            // Only nodes it avoids can ever host it: it may start there once
            // the avoidance lapses.
            let left = limit.saturating_sub(walked);
            let (f, w) = backfill::earliest(self, &mut tl, &mut rel, job, replicas, left, None);
            walked += w;
            found = match f {
                backfill::Walk::Found(t, p) => backfill::Walk::Found(t.max(until), p),
                other => other,
            };
        }
        self.timeline = Some(tl);
        self.releases = Some(rel);
        self.decisions.stats.plan_releases += walked;
        let (start, placement) = match found {
            backfill::Walk::Found(t, p) => (t, p),
            backfill::Walk::Never => return None,
            backfill::Walk::OutOfBudget => {
                self.plan_spent = true;
                return None;
            }
        };
        let end = start.saturating_add(backfill::plan_runtime(self.state, job));
        let per = job.per;
        let nodes = placement.nodes();
        self.plan.push(PlanEntry {
            start,
            end,
            reserved: reserve,
            maintenance: false,
            priority: job.priority,
            holds: placement
                .replicas
                .iter()
                .map(|rp| (rp.node, rp.gpus, per.cpu_millis, per.memory_mib))
                .collect(),
        });
        let r = Reservation {
            job: job.id,
            start_at: start,
            end_at: end,
            nodes,
        };
        let n = r.nodes.len() as u32;
        if reserve {
            for node in &r.nodes {
                self.reserved.insert(*node as usize);
            }
            let i = self.decisions.reservations.len();
            let at = self.res_by_start.partition_point(|(s, _)| *s <= start);
            self.res_by_start.insert(at, (start, i));
            self.decisions.reservations.push(r.clone());
        }
        self.decisions.plan.push(r);
        Some((start, n))
    }

    /// Builds the release stream once per cycle and brings the sorted binds
    /// up to date.
    fn prepare_timeline(&mut self) {
        if self.releases.is_none() {
            self.releases = Some(backfill::Releases::new(self.state, self.now));
        }
        if self.bound_sorted.len() < self.bound.len() {
            let from = self.bound_sorted.len();
            self.bound_sorted
                .extend(self.bound[from..].iter().map(|(t, _, i)| (*t, *i)));
            // Mostly sorted already: a stable sort merges the new run cheaply.
            self.bound_sorted.sort();
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
        let avoid = self.avoid_key(job);
        let exclude = avoid.and_then(|k| self.excl_sets.get(&k));
        let p = self.place_elastic(&trial, job, min, min, exclude).ok()?;
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
    state.rotation = d.next_rotation;
    Ok(())
}
