//! The policies the simulator compares. Every policy but the SRTF oracle is a
//! plugin of the scheduling core ([`gangway_sched::policies`], the registry
//! the live server and the what-if use too); this enum names them for the
//! command line and the reports. Every policy runs the same scheduling core
//! on the same cluster, with the same quotas (idle quota is lent to every
//! policy alike), the same preemption-cost model and the same run-time
//! predictor; they differ only in the core's switches and in how jobs are
//! ranked between cycles (the plugin's extension points).
//!
//! | policy | what it models | source |
//! |---|---|---|
//! | `gangway` | priority classes, then bands of attained GPU-time (as Tiresias); quotas and DRF between queues as guarantees; inside a queue, least predicted remaining work first with aging; preemption only in the job's own queue or a borrowing one, with a minimum run time that grows with each preemption | this project |
//! | `fifo` | first come first served, head-of-line blocking per queue | Philly's YARN scheduler as simulated by Helios (`HeliosArtifact/simulator`, policy `fifo`) |
//! | `priority` | strict priority classes with preemption, FIFO within a class | Kubernetes `PriorityClass` preemption |
//! | `slurm` | multifactor priority (age + fair share + job size, PriorityWeight* 1000 each, PriorityMaxAge 7 days, PriorityFavorSmall) with EASY backfill on time limits (else the run-time prediction) | Slurm `priority/multifactor` and `sched/backfill` documentation |
//! | `capacity` | DRF between queues with borrowing of idle quota, FIFO within a queue, no preemption | Kueue ClusterQueues in a cohort / YuniKorn DRF queue sorting |
//! | `tiresias` | discretised 2D-LAS: fewer attained GPU-seconds first, preemptive; thresholds \[3250, 7200\] GPU-s | Gu et al., NSDI '19, §4 and the `Tiresias` simulator's `dlas-gpu` |
//! | `qssf` | quasi-shortest-service first: least predicted GPU-time first, predicted from completed jobs; non-preemptive | Hu et al., SC '21 (Helios), §5 |
//! | `srtf` | shortest remaining time first, preemptive, knowing every run time (an oracle, not a deployable policy) | textbook SRTF |

use crate::cluster::ClusterSpec;
use gangway_sched::policies;
use gangway_sched::policy::SchedulingPolicy;
use gangway_sched::SchedulerConfig;
use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// A scheduling policy under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Gangway: priority classes, then attained-service bands; quotas and
    /// fair share between queues; least predicted remaining work first inside
    /// a queue, with aging; preemption within quota guarantees, when it pays.
    Gangway,
    /// First come, first served with head-of-line blocking per queue; no preemption.
    Fifo,
    /// Strict priority classes with preemption; FIFO within a class.
    Priority,
    /// Slurm-like multifactor priority with EASY backfill.
    Slurm,
    /// DRF capacity queues (Kueue/YuniKorn-like): fair share between queues, FIFO within.
    Capacity,
    /// Tiresias' discretised two-dimensional least-attained-service (2D-LAS).
    Tiresias,
    /// Helios' quasi-shortest-service-first on predicted run times.
    Qssf,
    /// Shortest remaining time first, preemptive, with an oracle for run times.
    Srtf,
}

/// Every policy, in report order.
pub const ALL: [Policy; 8] = [
    Policy::Gangway,
    Policy::Fifo,
    Policy::Priority,
    Policy::Slurm,
    Policy::Capacity,
    Policy::Tiresias,
    Policy::Qssf,
    Policy::Srtf,
];

/// The policies of the scorecard: Gangway, the baselines users would pick
/// instead, and the SRTF oracle.
pub const SCORECARD: [Policy; 7] = [
    Policy::Gangway,
    Policy::Fifo,
    Policy::Slurm,
    Policy::Capacity,
    Policy::Tiresias,
    Policy::Qssf,
    Policy::Srtf,
];

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::Gangway => "gangway",
            Policy::Fifo => "fifo",
            Policy::Priority => "priority",
            Policy::Slurm => "slurm",
            Policy::Capacity => "capacity",
            Policy::Tiresias => "tiresias",
            Policy::Qssf => "qssf",
            Policy::Srtf => "srtf",
        })
    }
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        ALL.into_iter()
            .find(|p| p.to_string() == s.trim())
            .ok_or_else(|| {
                format!("unknown policy {s:?}; known: gangway, fifo, priority, slurm, capacity, tiresias, qssf, srtf")
            })
    }
}

impl Policy {
    /// The plugin of this policy in the scheduling core's registry
    /// ([`gangway_sched::policies`]); `None` for the SRTF oracle, which
    /// ranks by true remaining run times no live scheduler knows, so it
    /// lives here in the simulator and nowhere else.
    pub fn plugin(self) -> Option<&'static dyn SchedulingPolicy> {
        match self {
            Policy::Srtf => None,
            p => policies::lookup(&p.to_string()).ok(),
        }
    }

    /// The scheduling core's configuration for this policy: the plugin's
    /// simulated configuration (SRTF: the preemptive baselines' switches).
    pub fn config(self) -> SchedulerConfig {
        let mut c = match self.plugin() {
            Some(p) => p.simulated(),
            None => policies::priority::preemptive(&SchedulerConfig::default()),
        };
        if matches!(self, Policy::Priority | Policy::Tiresias | Policy::Srtf) {
            c.max_preemption_searches = baseline_searches();
        }
        c
    }

    /// The cluster as this policy sees it: the same for every policy (one
    /// cluster, one quota semantics per run).
    pub fn cluster(self, c: &ClusterSpec) -> ClusterSpec {
        c.clone()
    }

    /// Whether this policy knows every job's run time (not deployable).
    pub fn is_oracle(self) -> bool {
        self == Policy::Srtf
    }
}

/// Preemption searches per cycle for the preemptive baselines (default
/// [`policies::priority::BASELINE_SEARCHES`], the setting they were measured
/// with; `GANGWAY_BASELINE_SEARCHES` overrides it in the simulator).
fn baseline_searches() -> usize {
    std::env::var("GANGWAY_BASELINE_SEARCHES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(policies::priority::BASELINE_SEARCHES)
}
