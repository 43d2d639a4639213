//! Gangway's job ranking: pure, shared by the live server and the simulator.
//!
//! The scheduling core orders pending jobs by numeric priority, then fair
//! share between queues, then by each job's rank inside its queue. Gangway's
//! policy sets the priority and the rank of every live job from what it has
//! received and what it is predicted to need:
//!
//! * **priority** = the job's priority class plus a band of attained service
//!   (a discretised LAS as Tiresias', with more, doubling bands:
//!   [`GANGWAY_THRESHOLDS`]): a job that has received fewer GPU-seconds
//!   than the first threshold sits `thresholds.len()` above its class, one
//!   past the first threshold one less, and so on. Classes are 10× apart
//!   ([`gangway_core::PriorityClass::value`]), so bands never cross classes.
//!   Jobs of a lower band may preempt those of a higher band in their own
//!   queue or in a queue that borrows, within the core's preemption rules.
//! * **rank** inside the queue = predicted remaining GPU-seconds (least first,
//!   as Helios' QSSF with the elapsed time taken into account), and a pending
//!   job that has waited more than `aging_factor` times its expected run time
//!   goes first, oldest first, so nobody starves behind shorter jobs.
//!
//! Callers compute [`RankFacts`] from their own records (the simulator from
//! its job table, the server from its stored job records), call [`rank`] and
//! apply the result with [`apply`]. Ranks that depend on time alone (aging,
//! predictions learned since) are refreshed every [`REFRESH_SECONDS`]; a
//! running job's band is refreshed every cycle (the simulator also wakes up
//! when a job crosses a threshold: [`next_threshold`]).

use crate::predict::{Prediction, RuntimePredictor};
use crate::state::{ClusterState, Job, StateError};
use gangway_core::{JobId, QueueOrdering, Time};

/// A pending job that has waited this many times its expected (median
/// predicted or declared) run time goes first in its queue. Measured on
/// Chronus MIX1: 1, 2, 3 and 5 give average JCTs within 2 % of each other;
/// 3 had the lowest.
pub const AGING_FACTOR: u64 = 3;

/// Tiresias' thresholds of attained GPU-seconds (NSDI '19, §4): the
/// Tiresias baseline's bands.
pub const LAS_THRESHOLDS: [u64; 2] = [3250, 7200];

/// Gangway's band boundaries, GPU-seconds: doubling from half a GPU-hour to
/// 16 GPU-hours, a multi-level feedback queue, so a job is demoted step by
/// step as it receives service instead of in Tiresias' two steps (tuned on
/// one trace of ~60-minute jobs). Measured against Tiresias' two bands, same
/// build, same settings otherwise: Chronus SLO 23,688 → 22,720 s average JCT,
/// Philly's first 20,000 jobs at 224 GPUs 19.3 → 18.1 h (with a preemption
/// budget of 5).
pub const GANGWAY_THRESHOLDS: [u64; 6] = [1800, 3600, 7200, 14_400, 28_800, 57_600];

/// Seconds between refreshes of pending jobs' ranks (aging, predictions), as
/// Slurm's PriorityCalcPeriod.
pub const REFRESH_SECONDS: u64 = 300;

/// The knobs of the ranking.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankParams {
    /// Attained-service band boundaries, GPU-seconds, ascending.
    pub thresholds: Vec<u64>,
    /// Aging bound as a multiple of the expected run time.
    pub aging_factor: u64,
    /// Tiresias' band boundaries, GPU-seconds, ascending (the `tiresias`
    /// policy's bands: [`crate::policies::tiresias`]).
    pub las_thresholds: Vec<u64>,
}

impl Default for RankParams {
    fn default() -> Self {
        RankParams {
            thresholds: GANGWAY_THRESHOLDS.to_vec(),
            aging_factor: AGING_FACTOR,
            las_thresholds: LAS_THRESHOLDS.to_vec(),
        }
    }
}

/// What the scheduler may know of a job's run time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KnownRuntime {
    /// Declared by the user (seconds).
    Declared(u64),
    /// Predicted from completed jobs.
    Predicted(Prediction),
    /// Neither: no history yet.
    Unknown,
}

impl KnownRuntime {
    /// The declared run time of `job`, else its prediction by `predictor`
    /// (as learned by now), else unknown.
    pub fn of(job: &Job, predictor: &RuntimePredictor) -> Self {
        if let Some(d) = job.spec.runtime_seconds {
            return KnownRuntime::Declared(d);
        }
        match predictor.predict(&job.predict_key()) {
            Some(p) => KnownRuntime::Predicted(p),
            None => KnownRuntime::Unknown,
        }
    }
}

/// What the ranking reads of one job.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankFacts {
    /// Its priority class value ([`gangway_core::PriorityClass::value`]).
    pub class: i32,
    /// GPUs of the whole gang.
    pub gpus: u64,
    /// GPU-seconds received in attempts that have ended.
    pub attained_gpu_seconds: u64,
    /// Seconds the current attempt has run; `None` when pending.
    pub running_for: Option<u64>,
    /// Seconds spent pending so far, all attempts.
    pub waited: u64,
    /// Submission time (ties among aged jobs: oldest first).
    pub submitted: Time,
    /// Its run time as the scheduler may know it.
    pub runtime: KnownRuntime,
}

/// The ranking's verdict for one job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ranked {
    /// Numeric priority: class plus attained-service band.
    pub priority: i32,
    /// Rank inside its queue and priority, lowest first.
    pub rank: i64,
}

/// Band of attained service: how many thresholds `attained` has reached.
pub fn band(thresholds: &[u64], attained: u64) -> usize {
    thresholds.iter().filter(|t| attained >= **t).count()
}

/// The first threshold above `attained`, if any: a running job with `gpus`
/// GPUs crosses it after `(t - attained).div_ceil(gpus)` seconds.
pub fn next_threshold(thresholds: &[u64], attained: u64) -> Option<u64> {
    thresholds.iter().copied().find(|t| *t > attained)
}

/// How many more seconds a running job described by `f` runs before its
/// verdict from [`rank_in`] can change: the seconds until its attained
/// service (`attained_gpu_seconds` plus `gpus` × `running_for`) reaches the
/// next band threshold. `None` when it never changes by running on: a
/// pending job (`running_for` is `None`), a job without GPUs, one past the
/// last threshold, or a `fifo` queue's job. A running job's rank does not
/// depend on time (see [`rank`]), so until then [`rank_in`] gives the same
/// verdict for the same facts a few seconds on; callers use it to rank a
/// running job again only when its band moves ([`next_threshold`] is the
/// same bound for one threshold list).
pub fn verdict_moves_after(ordering: QueueOrdering, p: &RankParams, f: &RankFacts) -> Option<u64> {
    let running_for = f.running_for?;
    if ordering == QueueOrdering::Fifo || f.gpus == 0 {
        return None;
    }
    let attained = f
        .attained_gpu_seconds
        .saturating_add(f.gpus.saturating_mul(running_for));
    // The lowest threshold not yet reached, in whatever order they are given.
    let next = p
        .thresholds
        .iter()
        .copied()
        .filter(|t| *t > attained)
        .min()?;
    Some((next - attained).div_ceil(f.gpus))
}

/// Ranks one job (see the module doc).
pub fn rank(p: &RankParams, f: &RankFacts) -> Ranked {
    let running_for = f.running_for.unwrap_or(0);
    let attained = f
        .attained_gpu_seconds
        .saturating_add(f.gpus.saturating_mul(running_for));
    let bands = i32::try_from(p.thresholds.len()).unwrap_or(i32::MAX);
    let b = i32::try_from(band(&p.thresholds, attained)).unwrap_or(i32::MAX);
    let priority = f.class.saturating_add(bands).saturating_sub(b);
    Ranked {
        priority,
        rank: within_queue(p, f),
    }
}

/// Ranks one job of a queue ordered `ordering`: [`rank`] for `ranked`;
/// for `fifo` the job's class at the top band (as a job that has received
/// nothing, so it meets other queues' jobs as a fresh one does) and rank 0,
/// so its queue keeps submission order within a class.
pub fn rank_in(ordering: QueueOrdering, p: &RankParams, f: &RankFacts) -> Ranked {
    match ordering {
        QueueOrdering::Ranked => rank(p, f),
        QueueOrdering::Fifo => Ranked {
            priority: f
                .class
                .saturating_add(i32::try_from(p.thresholds.len()).unwrap_or(i32::MAX)),
            rank: 0,
        },
    }
}

/// The rank inside the queue: predicted remaining GPU-seconds, or an aged
/// pending job first. Attained service counts through the seconds already
/// received in ended attempts (a running job's current attempt does not
/// change its rank, only its band).
fn within_queue(p: &RankParams, f: &RankFacts) -> i64 {
    let gpus = f.gpus.max(1);
    let ran = f.attained_gpu_seconds / gpus;
    let (remaining, expected) = match f.runtime {
        KnownRuntime::Predicted(pr) => (pr.remaining_median(ran), pr.median()),
        KnownRuntime::Declared(d) => (d.saturating_sub(ran).max(1), d),
        KnownRuntime::Unknown => return 0,
    };
    if f.running_for.is_none() && f.waited > p.aging_factor.saturating_mul(expected.max(60)) {
        return i64::MIN / 2 + i64::try_from(f.submitted).unwrap_or(i64::MAX / 4);
    }
    i64::try_from(remaining.saturating_mul(gpus).min(i64::MAX as u64 / 4)).unwrap_or(0)
}

/// Applies a verdict to the scheduler's state (rank first, then priority).
pub fn apply(state: &mut ClusterState, id: JobId, r: Ranked) -> Result<(), StateError> {
    state.set_rank(id, r.rank)?;
    state.set_priority(id, r.priority)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(runtime: KnownRuntime) -> RankFacts {
        RankFacts {
            class: 1000,
            gpus: 2,
            attained_gpu_seconds: 0,
            running_for: None,
            waited: 0,
            submitted: 100,
            runtime,
        }
    }

    #[test]
    fn less_attained_service_is_a_higher_band_within_the_class() {
        let p = RankParams {
            thresholds: LAS_THRESHOLDS.to_vec(),
            ..RankParams::default()
        };
        let mut f = facts(KnownRuntime::Declared(10_000));
        assert_eq!(rank(&p, &f).priority, 1002);
        f.attained_gpu_seconds = 3250;
        assert_eq!(rank(&p, &f).priority, 1001);
        f.attained_gpu_seconds = 3000;
        f.running_for = Some(2100); // 4200 more GPU-seconds in this attempt
        assert_eq!(rank(&p, &f).priority, 1000);
    }

    #[test]
    fn less_predicted_remaining_work_ranks_first() {
        let p = RankParams::default();
        let short = rank(&p, &facts(KnownRuntime::Declared(600)));
        let long = rank(&p, &facts(KnownRuntime::Declared(6000)));
        assert!(short.rank < long.rank);
        assert_eq!(short.rank, 1200);
        let mut resumed = facts(KnownRuntime::Declared(6000));
        resumed.attained_gpu_seconds = 2 * 5800; // 200 s left
        assert_eq!(rank(&p, &resumed).rank, 400);
    }

    #[test]
    fn a_job_past_the_aging_bound_goes_first_oldest_first() {
        let p = RankParams::default();
        let short = rank(&p, &facts(KnownRuntime::Declared(60)));
        let mut aged = facts(KnownRuntime::Declared(100_000));
        aged.waited = 300_001;
        let aged_rank = rank(&p, &aged).rank;
        assert!(aged_rank < short.rank);
        aged.waited = 300_000; // not past the bound yet
        assert!(rank(&p, &aged).rank > short.rank);
        // Running jobs do not age.
        aged.waited = 10_000_000;
        aged.running_for = Some(1);
        assert!(rank(&p, &aged).rank > short.rank);
        // Among aged jobs the older goes first.
        let mut older = facts(KnownRuntime::Declared(100_000));
        older.waited = 400_000;
        older.submitted = 50;
        assert!(rank(&p, &older).rank < aged_rank);
    }

    #[test]
    fn a_fifo_queue_keeps_the_top_band_and_rank_zero() {
        let p = RankParams {
            thresholds: LAS_THRESHOLDS.to_vec(),
            ..RankParams::default()
        };
        let mut f = facts(KnownRuntime::Declared(60));
        f.attained_gpu_seconds = 10_000;
        f.running_for = Some(100);
        let ranked = rank_in(QueueOrdering::Ranked, &p, &f);
        assert_eq!(ranked, rank(&p, &f));
        assert_eq!(ranked.priority, 1000);
        assert_eq!(
            rank_in(QueueOrdering::Fifo, &p, &f),
            Ranked {
                priority: 1002,
                rank: 0
            }
        );
    }

    #[test]
    fn unknown_run_times_rank_level() {
        let p = RankParams::default();
        assert_eq!(rank(&p, &facts(KnownRuntime::Unknown)).rank, 0);
    }

    #[test]
    fn a_running_verdict_moves_exactly_when_its_band_does() {
        let p = RankParams::default();
        for ordering in [QueueOrdering::Ranked, QueueOrdering::Fifo] {
            for gpus in [0, 1, 3, 8, 64] {
                for attained in [0, 1799, 1800, 5000, 57_599, 57_600] {
                    let mut f = facts(KnownRuntime::Declared(600));
                    f.gpus = gpus;
                    f.attained_gpu_seconds = attained;
                    for ran in [0, 1, 29, 599] {
                        f.running_for = Some(ran);
                        let now = rank_in(ordering, &p, &f);
                        let moves = verdict_moves_after(ordering, &p, &f);
                        // Walk on second by second: the first change is
                        // where the bound says, and there is none before.
                        let mut first = None;
                        for dt in 1..=3_000u64 {
                            f.running_for = Some(ran + dt);
                            if rank_in(ordering, &p, &f) != now {
                                first = Some(dt);
                                break;
                            }
                        }
                        f.running_for = Some(ran);
                        match moves {
                            Some(m) if m <= 3_000 => assert_eq!(first, Some(m), "{f:?}"),
                            Some(_) => assert_eq!(first, None, "{f:?}"),
                            None => assert_eq!(first, None, "{f:?}"),
                        }
                    }
                }
            }
        }
        let mut pending = facts(KnownRuntime::Declared(600));
        pending.running_for = None;
        assert_eq!(
            verdict_moves_after(QueueOrdering::Ranked, &p, &pending),
            None
        );
    }

    #[test]
    fn thresholds_are_found_in_order() {
        assert_eq!(next_threshold(&LAS_THRESHOLDS, 0), Some(3250));
        assert_eq!(next_threshold(&LAS_THRESHOLDS, 3250), Some(7200));
        assert_eq!(next_threshold(&LAS_THRESHOLDS, 7200), None);
        assert_eq!(band(&LAS_THRESHOLDS, 7199), 1);
    }

    #[test]
    fn gangways_bands_double_and_stay_inside_a_class() {
        let t = RankParams::default().thresholds;
        assert_eq!(t, GANGWAY_THRESHOLDS.to_vec());
        assert!(t.windows(2).all(|w| w[1] == 2 * w[0]));
        // Classes are 100 apart at the closest (best-effort 0, low 100): the
        // bands of one class never reach the next.
        assert!(t.len() < 100);
        let p = RankParams::default();
        let mut f = facts(KnownRuntime::Unknown);
        f.attained_gpu_seconds = 0;
        assert_eq!(rank(&p, &f).priority, 1006);
        f.attained_gpu_seconds = 1_000_000;
        assert_eq!(rank(&p, &f).priority, 1000);
        f.attained_gpu_seconds = 3600;
        assert_eq!(rank(&p, &f).priority, 1004);
    }
}
