//! First come, first served with head-of-line blocking per queue and no
//! preemption: Philly's YARN scheduler as Helios simulates it
//! (`HeliosArtifact/simulator`, policy `fifo`).

use crate::policy::{RankChanges, RankInput, SchedulingPolicy, Verdict};
use crate::{Backfill, SchedulerConfig};

/// FIFO.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fifo;

impl SchedulingPolicy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }

    fn about(&self) -> &'static str {
        "first come first served, head-of-line blocking per queue, no preemption"
    }

    fn configure(&self, site: &SchedulerConfig) -> SchedulerConfig {
        SchedulerConfig {
            backfill: Backfill::Off,
            preemption: false,
            fair_share: false,
            strict_order: true,
            ..site.clone()
        }
    }

    /// Priority class, then submission order.
    fn rank(&self, _job: &RankInput<'_>) -> Verdict {
        Verdict::Class
    }

    fn changes(&self) -> RankChanges {
        RankChanges::default()
    }
}
