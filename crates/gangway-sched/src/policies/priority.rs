//! Strict priority classes with preemption, FIFO within a class:
//! Kubernetes `PriorityClass` preemption.

use crate::policy::{RankChanges, RankInput, SchedulingPolicy, Verdict};
use crate::{Backfill, SchedulerConfig};

/// Preemption searches per cycle of the preemptive baselines (priority,
/// Tiresias, the simulator's SRTF): they preempt as a matter of course.
pub const BASELINE_SEARCHES: usize = 16;

/// Strict priority.
#[derive(Clone, Copy, Debug, Default)]
pub struct Priority;

impl SchedulingPolicy for Priority {
    fn name(&self) -> &'static str {
        "priority"
    }

    fn about(&self) -> &'static str {
        "strict priority classes with preemption, FIFO within a class"
    }

    fn configure(&self, site: &SchedulerConfig) -> SchedulerConfig {
        preemptive(site)
    }

    fn rank(&self, _job: &RankInput<'_>) -> Verdict {
        Verdict::Class
    }

    fn changes(&self) -> RankChanges {
        RankChanges::default()
    }
}

/// The switches of the preemptive baselines: no backfill, preemption with
/// [`BASELINE_SEARCHES`] searches per cycle, no fair share.
pub fn preemptive(site: &SchedulerConfig) -> SchedulerConfig {
    SchedulerConfig {
        backfill: Backfill::Off,
        preemption: true,
        fair_share: false,
        max_preemption_searches: BASELINE_SEARCHES,
        ..site.clone()
    }
}
