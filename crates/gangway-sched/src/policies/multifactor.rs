//! Slurm's multifactor priority (age + fair share + job size,
//! PriorityWeight* 1000 each, PriorityMaxAge 7 days, PriorityFavorSmall)
//! with EASY backfill on time limits, else the run-time prediction (Slurm's
//! `priority/multifactor` and `sched/backfill` documentation). Registered
//! as `slurm`.

use crate::policy::{class_tier, RankChanges, RankInput, SchedulingPolicy, Verdict};
use crate::{Backfill, SchedulerConfig};

/// PriorityMaxAge, seconds.
pub const MAX_AGE_SECONDS: f64 = 7.0 * 86_400.0;

/// Slurm's multifactor priority.
#[derive(Clone, Copy, Debug, Default)]
pub struct Multifactor;

impl SchedulingPolicy for Multifactor {
    fn name(&self) -> &'static str {
        "slurm"
    }

    fn about(&self) -> &'static str {
        "Slurm multifactor priority (age, fair share, size) with EASY backfill"
    }

    fn configure(&self, site: &SchedulerConfig) -> SchedulerConfig {
        SchedulerConfig {
            backfill: Backfill::Easy,
            preemption: false,
            fair_share: false,
            ..site.clone()
        }
    }

    /// PriorityWeightAge, PriorityWeightFairshare and PriorityWeightJobSize
    /// of 1000 each; age saturates at PriorityMaxAge; fair share
    /// 2^(-usage/share) over the decayed usage ([`crate::policy::QueueUsage`]);
    /// fewer GPUs, higher.
    fn rank(&self, job: &RankInput<'_>) -> Verdict {
        let f = job.facts;
        let state = job.state;
        let age = (job.now.saturating_sub(f.submitted) as f64 / MAX_AGE_SECONDS).min(1.0);
        let total_gpus = state.total().gpus.max(1) as f64;
        let size = 1.0 - (f.gpus as f64 / total_gpus).min(1.0);
        let all = job.usage.total();
        let queues = state.queues();
        let nominal_total: u64 = queues
            .iter()
            .filter(|q| q.children.is_empty())
            .filter_map(|q| q.spec.quota.nominal.gpus)
            .sum();
        let leaves = queues
            .iter()
            .filter(|q| q.children.is_empty())
            .count()
            .max(1);
        let share = match state
            .queue_index(job.queue)
            .and_then(|q| queues[q as usize].spec.quota.nominal.gpus)
        {
            Some(n) if nominal_total > 0 => n as f64 / nominal_total as f64,
            _ => 1.0 / leaves as f64,
        };
        let used = if all > 0.0 {
            job.usage.of(job.queue) / all
        } else {
            0.0
        };
        let fs = 2f64.powf(-used / share.max(1e-9));
        Verdict::Priority(class_tier(job.class) + (1000.0 * (age + fs + size)).round() as i32)
    }

    fn changes(&self) -> RankChanges {
        RankChanges {
            with_time: true,
            queue_usage: true,
            ..RankChanges::default()
        }
    }
}
