//! The policies the simulator compares. Gangway's is the scheduling core with
//! its defaults; the baselines are the same core configured the way those
//! schedulers behave, plus, for Tiresias and SRTF, a priority per job that the
//! engine recomputes between cycles (attained service, remaining time).

use crate::cluster::ClusterSpec;
use gangway_sched::SchedulerConfig;
use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// A scheduling policy under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Gangway: quotas with borrowing and reclaim, DRF, gang placement,
    /// backfill with a reservation, preemption by priority class.
    Gangway,
    /// First come, first served with head-of-line blocking per queue; no preemption.
    Fifo,
    /// Strict priority classes with preemption; FIFO within a class.
    Priority,
    /// YARN capacity scheduler: queues get their quota and never borrow; FIFO within a queue.
    Capacity,
    /// Tiresias' discretised two-dimensional least-attained-service (2D-LAS):
    /// jobs that received less GPU-time run first and preempt the others.
    Tiresias,
    /// Shortest remaining time first, preemptive, with an oracle for run times.
    Srtf,
}

/// Every policy, in report order.
pub const ALL: [Policy; 6] = [
    Policy::Gangway,
    Policy::Fifo,
    Policy::Priority,
    Policy::Capacity,
    Policy::Tiresias,
    Policy::Srtf,
];

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::Gangway => "gangway",
            Policy::Fifo => "fifo",
            Policy::Priority => "priority",
            Policy::Capacity => "capacity",
            Policy::Tiresias => "tiresias",
            Policy::Srtf => "srtf",
        })
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        ALL.into_iter()
            .find(|p| p.to_string() == s.trim())
            .ok_or_else(|| format!("unknown policy {s:?}; known: gangway, fifo, priority, capacity, tiresias, srtf"))
    }
}

/// How a policy ranks jobs besides the core's own order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ranking {
    /// Priority classes as submitted.
    Classes,
    /// Bands of attained GPU-seconds (fewer first).
    AttainedService,
    /// Remaining run time (shorter first).
    RemainingTime,
}

impl Policy {
    /// The scheduling core's configuration for this policy.
    pub fn config(self) -> SchedulerConfig {
        let base = SchedulerConfig::default();
        match self {
            Policy::Gangway => base,
            Policy::Fifo => SchedulerConfig {
                backfill: false,
                preemption: false,
                fair_share: false,
                strict_order: true,
                ..base
            },
            Policy::Priority | Policy::Tiresias | Policy::Srtf => SchedulerConfig {
                backfill: false,
                preemption: true,
                fair_share: false,
                // These policies preempt as a matter of course (LAS, SRTF).
                max_preemption_searches: baseline_searches(),
                ..base
            },
            Policy::Capacity => SchedulerConfig {
                backfill: false,
                preemption: false,
                fair_share: true,
                ..base
            },
        }
    }

    /// The cluster as this policy sees it. Gangway lends idle quota between
    /// queues; the baselines run each queue inside its own quota, as the
    /// per-virtual-cluster schedulers they model do (Philly's YARN and the
    /// Helios/Tiresias simulations). Without quotas all share one pool.
    pub fn cluster(self, c: &ClusterSpec) -> ClusterSpec {
        match self {
            Policy::Gangway => c.clone(),
            _ => c.without_borrowing(),
        }
    }

    /// How jobs are ranked.
    pub fn ranking(self) -> Ranking {
        match self {
            Policy::Tiresias => Ranking::AttainedService,
            Policy::Srtf => Ranking::RemainingTime,
            _ => Ranking::Classes,
        }
    }

    /// Whether every job is preemptible under this policy.
    pub fn all_preemptible(self) -> bool {
        matches!(self, Policy::Tiresias | Policy::Srtf)
    }
}

/// Preemption searches per cycle for the preemptive baselines (default 16, the
/// setting they were measured with; `GANGWAY_BASELINE_SEARCHES` overrides it).
fn baseline_searches() -> usize {
    std::env::var("GANGWAY_BASELINE_SEARCHES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16)
}
