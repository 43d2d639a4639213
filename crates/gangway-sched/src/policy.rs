//! The extension points of a scheduling cycle, and the trait a scheduling
//! policy implements to fill them.
//!
//! A cycle ([`crate::schedule`]) walks the pending jobs and, for each,
//! decides through the same points, in the spirit of the Kubernetes
//! scheduling framework and Volcano's actions:
//!
//! | point | what it decides | where the policy says it |
//! |---|---|---|
//! | queue order | which queue's job comes next within a priority: DRF fair share or submission order | [`SchedulingPolicy::configure`] (`fair_share`) |
//! | in-queue rank | a job's priority and its rank inside its queue | [`SchedulingPolicy::rank`] |
//! | admit | quota with borrowing and lending limits, and whether a job that cannot start blocks its queue (strict order) | [`SchedulingPolicy::configure`] (`strict_order`) |
//! | place | all-or-nothing, topology-aware placement | the core's ([`crate::placement`]), the same for every policy |
//! | victim selection | whether and how often lower-priority work is preempted or lent quota reclaimed | [`SchedulingPolicy::configure`] (`preemption`, searches, minimum run) |
//! | plan / backfill | planned starts, reservations and backfill around them | [`SchedulingPolicy::configure`] (`backfill`) |
//!
//! The points the core decides per job read the switches the policy set
//! in the [`SchedulerConfig`] it returns; the ranking is applied by the
//! caller (the server's ranking pass, the simulator's engine) through
//! [`crate::rank::apply`] before the cycle. Every policy is pure and
//! deterministic: the same inputs give the same verdicts. The policies
//! themselves and the registry that names them are in [`crate::policies`].

use crate::rank::{self, RankFacts, RankParams, Ranked};
use crate::state::ClusterState;
use crate::SchedulerConfig;
use gangway_core::{PriorityClass, QueueOrdering, Time};
use std::collections::BTreeMap;

/// What a policy reads to rank one job.
#[derive(Clone, Copy, Debug)]
pub struct RankInput<'a> {
    /// The job as the ranking sees it.
    pub facts: &'a RankFacts,
    /// Its priority class.
    pub class: PriorityClass,
    /// Its queue's name.
    pub queue: &'a str,
    /// Its queue's ordering (`ranked` or `fifo`).
    pub ordering: QueueOrdering,
    /// The time of the ranking.
    pub now: Time,
    /// The ranking's knobs (Gangway's bands, Tiresias' thresholds, aging).
    pub params: &'a RankParams,
    /// The cluster (queues and their quotas, total GPUs).
    pub state: &'a ClusterState,
    /// Each queue's decayed usage, for policies with a fair-share factor.
    pub usage: &'a QueueUsage,
}

/// A policy's verdict on one job's place in line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Keep the priority the job was submitted with (its class) and rank 0.
    Class,
    /// This numeric priority, rank 0.
    Priority(i32),
    /// This priority and rank inside the queue.
    Ranked(Ranked),
}

impl Verdict {
    /// The priority and rank a job of class value `class` gets.
    pub fn ranked(self, class: i32) -> Ranked {
        match self {
            Verdict::Class => Ranked {
                priority: class,
                rank: 0,
            },
            Verdict::Priority(priority) => Ranked { priority, rank: 0 },
            Verdict::Ranked(r) => r,
        }
    }
}

/// What makes a policy's verdicts change, so callers rank again only then.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RankChanges {
    /// Verdicts change with time alone (age, aging, predictions learned
    /// since): pending jobs are ranked again every
    /// [`crate::rank::REFRESH_SECONDS`].
    pub with_time: bool,
    /// A running job's verdict changes as it runs (attained service): running
    /// jobs are ranked again before each cycle, or when their band moves.
    pub while_running: bool,
    /// The policy reads [`QueueUsage`]: callers accrue it at each refresh.
    pub queue_usage: bool,
    /// Which attained-service thresholds move a running job's band.
    pub bands: Bands,
}

/// The attained-service thresholds a policy's bands use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bands {
    /// No bands: running on changes nothing.
    #[default]
    None,
    /// Gangway's ([`RankParams::thresholds`]).
    Gangway,
    /// Tiresias' ([`RankParams::las_thresholds`]).
    Las,
}

impl Bands {
    /// The thresholds in `p`, if any.
    pub fn of(self, p: &RankParams) -> Option<&[u64]> {
        match self {
            Bands::None => None,
            Bands::Gangway => Some(&p.thresholds),
            Bands::Las => Some(&p.las_thresholds),
        }
    }
}

/// A scheduling policy: one plugin per policy, named in the registry
/// ([`crate::policies::lookup`]). The simulator, the live server and the
/// what-if all take their policy from there.
pub trait SchedulingPolicy: Send + Sync + std::fmt::Debug {
    /// The name a cluster's policy and `gangway sim --policy` use.
    fn name(&self) -> &'static str;

    /// One line: what it models.
    fn about(&self) -> &'static str;

    /// Queue order, admit, victim selection and plan/backfill: the core's
    /// switches this policy sets on top of a site's configuration `site`
    /// (limits and budgets the policy does not define are the site's).
    fn configure(&self, site: &SchedulerConfig) -> SchedulerConfig;

    /// The configuration the simulator runs this policy with: by default
    /// the policy's switches on the core's defaults.
    fn simulated(&self) -> SchedulerConfig {
        self.configure(&SchedulerConfig::default())
    }

    /// In-queue rank: the job's priority and rank inside its queue.
    fn rank(&self, job: &RankInput<'_>) -> Verdict;

    /// What makes this policy's verdicts change.
    fn changes(&self) -> RankChanges;

    /// How many more seconds a running job runs before its verdict can
    /// change by running on (`None`: never): the time to its next band.
    fn moves_after(&self, job: &RankInput<'_>) -> Option<u64> {
        let thresholds = self.changes().bands.of(job.params)?;
        let f = job.facts;
        let running_for = f.running_for?;
        if f.gpus == 0 {
            return None;
        }
        let attained = f
            .attained_gpu_seconds
            .saturating_add(f.gpus.saturating_mul(running_for));
        let next = thresholds.iter().copied().filter(|t| *t > attained).min()?;
        Some((next - attained).div_ceil(f.gpus))
    }
}

/// Priorities one class spans in the policies that set their own priority
/// (Tiresias, QSSF, SRTF, multifactor): their orders fit inside it, so
/// classes never cross.
pub const TIER_SPAN: i32 = 100_000_000;

/// The base priority of a class's tier for those policies.
pub fn class_tier(c: PriorityClass) -> i32 {
    let ordinal = match c {
        PriorityClass::BestEffort => 0,
        PriorityClass::Low => 1,
        PriorityClass::Normal => 2,
        PriorityClass::High => 3,
        PriorityClass::Production => 4,
        PriorityClass::Critical => 5,
    };
    // At most 5 × 10^8 + 10^8 - 1 < i32::MAX.
    ordinal * TIER_SPAN
}

/// Each leaf queue's GPU-seconds used, decayed with a 7-day half-life
/// (Slurm's PriorityDecayHalfLife), for fair-share factors.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QueueUsage {
    used: BTreeMap<String, f64>,
}

/// Half-life of [`QueueUsage`], seconds.
pub const USAGE_HALF_LIFE_SECONDS: f64 = 7.0 * 86_400.0;

impl QueueUsage {
    /// Decays the usage by `dt` seconds, then adds each leaf queue's GPUs in
    /// use over those seconds.
    pub fn accrue(&mut self, state: &ClusterState, dt: u64) {
        let decay = 0.5f64.powf(dt as f64 / USAGE_HALF_LIFE_SECONDS);
        for v in self.used.values_mut() {
            *v *= decay;
        }
        for (q, info) in state.queues().iter().enumerate() {
            if info.children.is_empty() {
                let used = state.queue_usage(q as u32).gpus as f64 * dt as f64;
                *self.used.entry(info.spec.name.clone()).or_default() += used;
            }
        }
    }

    /// Every queue's usage together.
    pub fn total(&self) -> f64 {
        self.used.values().sum()
    }

    /// `queue`'s usage.
    pub fn of(&self, queue: &str) -> f64 {
        self.used.get(queue).copied().unwrap_or(0.0)
    }
}

/// Gangway's own verdict for a queue ordered `ordering` (see [`crate::rank`]).
pub fn gangway_verdict(job: &RankInput<'_>) -> Verdict {
    Verdict::Ranked(rank::rank_in(job.ordering, job.params, job.facts))
}
