//! DRF capacity queues with borrowing of idle quota, FIFO within a queue,
//! no preemption: Kueue ClusterQueues in a cohort, YuniKorn's DRF queue
//! sorting.

use crate::policy::{RankChanges, RankInput, SchedulingPolicy, Verdict};
use crate::{Backfill, SchedulerConfig};

/// Capacity queues.
#[derive(Clone, Copy, Debug, Default)]
pub struct Capacity;

impl SchedulingPolicy for Capacity {
    fn name(&self) -> &'static str {
        "capacity"
    }

    fn about(&self) -> &'static str {
        "DRF between queues with borrowing of idle quota, FIFO within a queue, no preemption"
    }

    fn configure(&self, site: &SchedulerConfig) -> SchedulerConfig {
        SchedulerConfig {
            backfill: Backfill::Off,
            preemption: false,
            fair_share: true,
            ..site.clone()
        }
    }

    fn rank(&self, _job: &RankInput<'_>) -> Verdict {
        Verdict::Class
    }

    fn changes(&self) -> RankChanges {
        RankChanges::default()
    }
}
