//! Tiresias' discretised two-dimensional least-attained-service (2D-LAS):
//! fewer attained GPU-seconds first, preemptive, thresholds
//! [`crate::rank::LAS_THRESHOLDS`] (Gu et al., NSDI '19, §4, and the
//! `Tiresias` simulator's `dlas-gpu`).

use crate::policy::{class_tier, Bands, RankChanges, RankInput, SchedulingPolicy, Verdict};
use crate::SchedulerConfig;

/// Tiresias.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tiresias;

impl SchedulingPolicy for Tiresias {
    fn name(&self) -> &'static str {
        "tiresias"
    }

    fn about(&self) -> &'static str {
        "discretised 2D-LAS: fewer attained GPU-seconds first, preemptive"
    }

    fn configure(&self, site: &SchedulerConfig) -> SchedulerConfig {
        super::priority::preemptive(site)
    }

    /// Within its class's tier, one step lower per threshold of attained
    /// GPU-seconds reached; submission order within a band.
    fn rank(&self, job: &RankInput<'_>) -> Verdict {
        let f = job.facts;
        let attained = f.attained_gpu_seconds + f.gpus * f.running_for.unwrap_or(0);
        let band = crate::rank::band(&job.params.las_thresholds, attained);
        Verdict::Priority(class_tier(job.class) + 1000 - (band.min(1000) as i32))
    }

    fn changes(&self) -> RankChanges {
        RankChanges {
            with_time: false,
            while_running: true,
            queue_usage: false,
            bands: Bands::Las,
        }
    }
}
