//! How job records are written: which writes are deferred (kept in memory
//! or committed without waiting for the disk, and synced after the state
//! lock is released), the jobs changed in memory and not yet stored, and
//! the job sequence counter as this replica last wrote it.

use gangway_core::JobId;
use gangway_store::Compare;
use std::collections::BTreeSet;

/// The bookkeeping of deferred job writes and of the job sequence.
#[derive(Debug, Default)]
pub struct JobWrites {
    /// Job writes stay in memory (`unflushed`) while set (the agents'
    /// batches).
    pub(crate) defer_writes: bool,
    /// A cycle's decisions are committed deferred while set.
    pub(crate) defer_decisions: bool,
    /// New jobs are deferred commits while set.
    pub(crate) defer_submissions: bool,
    /// Jobs changed in memory by deferred writes and not yet in the store
    /// (their revision in the job table is still the stored one).
    unflushed: BTreeSet<JobId>,
    /// The job sequence counter and its revision as this replica last
    /// wrote it: a submission's batch then costs one store round trip, not
    /// two (etcd). Checked by the batch's compare, so never trusted blindly.
    job_seq: Option<(u64, Compare)>,
}

impl JobWrites {
    /// `id` was changed in memory only: the next flush writes it.
    pub fn changed(&mut self, id: JobId) {
        self.unflushed.insert(id);
    }

    /// `id` was written to the store: no flush owes it anything.
    pub fn stored(&mut self, id: JobId) {
        self.unflushed.remove(&id);
    }

    /// Whether any job waits for a flush.
    pub fn nothing_to_flush(&self) -> bool {
        self.unflushed.is_empty()
    }

    /// The jobs a flush writes, in id order (each once, however often it
    /// changed); none is owed any more until [`JobWrites::retry`].
    pub fn take_unflushed(&mut self) -> BTreeSet<JobId> {
        std::mem::take(&mut self.unflushed)
    }

    /// Jobs whose flush failed: the next flush writes them again.
    pub fn retry(&mut self, ids: impl IntoIterator<Item = JobId>) {
        self.unflushed.extend(ids);
    }

    /// The job sequence as this replica last wrote it (taken: a batch that
    /// fails its compare reads the store again).
    pub fn take_job_seq(&mut self) -> Option<(u64, Compare)> {
        self.job_seq.take()
    }

    /// The job sequence this replica just wrote: `last`, at `revision` of
    /// its key.
    pub fn wrote_job_seq(&mut self, last: u64, compare: Compare) {
        self.job_seq = Some((last, compare));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flush_takes_each_changed_job_once_and_a_failed_one_is_owed_again() {
        let mut w = JobWrites::default();
        assert!(w.nothing_to_flush());
        w.changed(JobId(3));
        w.changed(JobId(1));
        w.changed(JobId(3));
        w.changed(JobId(2));
        w.stored(JobId(2));
        let ids: Vec<_> = w.take_unflushed().into_iter().collect();
        assert_eq!(ids, vec![JobId(1), JobId(3)]);
        assert!(w.nothing_to_flush());
        w.retry([JobId(3)]);
        assert_eq!(w.take_unflushed().len(), 1);
    }

    #[test]
    fn the_job_sequence_is_handed_out_once() {
        let mut w = JobWrites::default();
        assert!(w.take_job_seq().is_none());
        w.wrote_job_seq(7, Compare::Revision("/seq".into(), 9));
        assert_eq!(w.take_job_seq().map(|(n, _)| n), Some(7));
        assert!(w.take_job_seq().is_none());
    }
}
