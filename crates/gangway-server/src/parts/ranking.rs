//! The ranking memo: what the server last applied per job when it ranked
//! the live jobs (so a cycle ranks only what changed), the queues' decayed
//! usage, and when the run-time predictor that informs the ranking was
//! last stored. The ranking itself runs in `Control`, which reads the job
//! table and the scheduler's state.

use gangway_core::{JobId, Time};
use gangway_sched::policy::QueueUsage;
use gangway_sched::rank::{RankParams, Ranked};
use std::collections::{BTreeSet, HashMap};

/// Seconds between two stores of a changed predictor: it only ever feeds
/// estimates, so losing the last minute of learning costs little.
pub const PREDICTOR_SAVE_SECONDS: Time = 60;

/// What the server last applied per job, to rank pending jobs only when
/// something changed, and the predictor's store bookkeeping.
#[derive(Debug, Default)]
pub struct RankMemo {
    /// Per job: the attempt and verdict last applied.
    pub(crate) applied: HashMap<JobId, (u32, Ranked)>,
    /// When every pending job was last re-ranked (`None`: at the next cycle).
    pub(crate) refreshed_at: Option<Time>,
    /// The ranking's knobs.
    pub(crate) params: RankParams,
    /// Each queue's decayed usage, for a policy with a fair-share factor
    /// (accrued at each refresh).
    pub(crate) usage: QueueUsage,
    /// Jobs that entered the scheduler since the last ranking without a
    /// write of their records (a gated job released): ranked at the next
    /// cycle with the jobs whose records changed.
    pub(crate) entered: Vec<JobId>,
    /// Running jobs by the time their verdict next moves (their band):
    /// ranked again at the first ranking at or after it. An entry whose
    /// time is not the job's in [`RankMemo::due_of`] is stale and skipped.
    pub(crate) due: BTreeSet<(Time, JobId)>,
    /// Each running job's current entry in [`RankMemo::due`].
    pub(crate) due_of: HashMap<JobId, Time>,
    /// The time of the last ranking: a clock that went back ranks every
    /// running job again (a band moves only forwards in time).
    pub(crate) last_at: Option<Time>,
    /// Tests only: rank every running job at every ranking, as the server
    /// did before running jobs were ranked only when their band moves (the
    /// reference the property test compares decisions with).
    #[cfg(test)]
    pub(crate) every_running: bool,
    /// Run times learned since the predictor was last stored.
    predictor_dirty: bool,
    /// When the predictor was last stored.
    predictor_saved_at: Time,
}

impl RankMemo {
    /// The predictor learned a run time: it is stored again in time.
    pub fn predictor_learned(&mut self) {
        self.predictor_dirty = true;
    }

    /// Whether the predictor is to be stored at `now`: it changed and the
    /// last store is at least [`PREDICTOR_SAVE_SECONDS`] old. When it is,
    /// it counts as stored now.
    pub fn predictor_due(&mut self, now: Time) -> bool {
        if !self.predictor_dirty
            || now
                < self
                    .predictor_saved_at
                    .saturating_add(PREDICTOR_SAVE_SECONDS)
        {
            return false;
        }
        self.predictor_dirty = false;
        self.predictor_saved_at = now;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_predictor_is_stored_only_when_it_changed_and_at_most_once_a_minute() {
        let mut m = RankMemo::default();
        assert!(!m.predictor_due(1000), "nothing learned");
        m.predictor_learned();
        assert!(m.predictor_due(1000));
        assert!(!m.predictor_due(1000), "stored already");
        m.predictor_learned();
        assert!(!m.predictor_due(1000 + PREDICTOR_SAVE_SECONDS - 1));
        assert!(m.predictor_due(1000 + PREDICTOR_SAVE_SECONDS));
    }
}
