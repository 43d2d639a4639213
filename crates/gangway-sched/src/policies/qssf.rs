//! Quasi-shortest-service first: least predicted GPU-time first, predicted
//! from completed jobs; non-preemptive (Hu et al., SC '21 (Helios), §5).

use crate::policy::{class_tier, RankChanges, RankInput, SchedulingPolicy, Verdict, TIER_SPAN};
use crate::rank::KnownRuntime;
use crate::{Backfill, SchedulerConfig};

/// QSSF.
#[derive(Clone, Copy, Debug, Default)]
pub struct Qssf;

impl SchedulingPolicy for Qssf {
    fn name(&self) -> &'static str {
        "qssf"
    }

    fn about(&self) -> &'static str {
        "quasi-shortest-service first: least predicted GPU-time first, non-preemptive"
    }

    fn configure(&self, site: &SchedulerConfig) -> SchedulerConfig {
        SchedulerConfig {
            backfill: Backfill::Off,
            preemption: false,
            fair_share: false,
            ..site.clone()
        }
    }

    /// Within its class's tier, higher for less predicted (or declared)
    /// GPU-minutes; an unknown run time counts as none.
    fn rank(&self, job: &RankInput<'_>) -> Verdict {
        let f = job.facts;
        let runtime = match f.runtime {
            KnownRuntime::Declared(d) => d,
            KnownRuntime::Predicted(p) => p.median(),
            KnownRuntime::Unknown => 0,
        };
        let work = runtime.saturating_mul(f.gpus.max(1)) / 60;
        Verdict::Priority(
            class_tier(job.class) + TIER_SPAN - 1 - work.min(TIER_SPAN as u64 - 1) as i32,
        )
    }

    fn changes(&self) -> RankChanges {
        RankChanges {
            with_time: true,
            ..RankChanges::default()
        }
    }
}
