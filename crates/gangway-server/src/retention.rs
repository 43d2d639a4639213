//! Retention: the leader removes finished job records older than
//! `retention.finished_jobs` (default 7 days after they ended) and
//! idempotency keys older than `retention.idempotency_keys` (default 24
//! hours after their job was submitted), a bounded number per pass.
//!
//! Before a job record is removed, its [`HistoryEntry`] is appended (and
//! fsynced) to `<data_dir>/history/export-YYYY-MM.jsonl`, the month it
//! ended, so `gangway history --export` data survives. A crash between the
//! export and the delete exports the job again on the next pass: readers
//! keep the last line per job id.
//!
//! The store's change history (every write's value, kept for watches) is
//! compacted too, as kube-apiserver compacts etcd: each pass marks the
//! store's revision, and the history older than the newest mark at least
//! `retention.store_history` old (default 1 minute: no Gangway component
//! watches the store, and the history holds every version of every job
//! record) is forgotten. Without it the history grows with every write: a
//! redb file of 809 MB after 60,000 jobs, and an etcd that refuses writes at
//! its space quota. `store_history: 0` leaves compaction to the operator
//! (etcd's `--auto-compaction-retention`).
//!
//! ```yaml
//! retention: { finished_jobs: 7d, idempotency_keys: 24h, store_history: 1m }
//! ```

pub use crate::config::Retention;
use crate::control::{Control, ControlError};
use crate::history::HistoryEntry;
use crate::records::JobRecord;
use gangway_core::workflow::{parse_dependency, Dependency};
use gangway_core::{JobId, Time};
use gangway_store::{Compare, Op, Store};
use std::collections::{HashSet, VecDeque};
use std::io::Write;
use std::path::Path;

/// When to compact the store's history: each pass marks (time, revision),
/// and the store is compacted to the newest mark at least the history's
/// length old. Marks are taken by the leader alone; a new leader starts
/// with none, so it compacts one history length after it won.
#[derive(Debug, Default)]
pub struct Compactor {
    marks: VecDeque<(Time, u64)>,
}

impl Compactor {
    /// Marks `revision` at `now`; the revision to compact to, if one is due.
    pub fn due(&mut self, history: u64, now: Time, revision: u64) -> Option<u64> {
        self.marks.push_back((now, revision));
        let mut to = None;
        while let Some(&(t, r)) = self.marks.front() {
            if t.saturating_add(history) > now {
                break;
            }
            to = Some(r);
            self.marks.pop_front();
        }
        to
    }
}

/// Marks the store's revision and compacts its history if due (see
/// [`Compactor`]); the revision compacted to, if any.
pub fn compact_history(
    store: &dyn Store,
    retention: &Retention,
    compactor: &mut Compactor,
    now: Time,
) -> Result<Option<u64>, ControlError> {
    let Some(history) = retention
        .store_history_seconds()
        .map_err(ControlError::Conflict)?
    else {
        return Ok(None);
    };
    let revision = store.revision()?;
    let Some(to) = compactor.due(history, now, revision) else {
        return Ok(None);
    };
    store.compact(to)?;
    Ok(Some(to))
}

/// Records removed per pass at most (the rest wait for the next pass).
pub const PASS_LIMIT: usize = 5_000;

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// Finished job records exported and removed.
    pub jobs: usize,
    /// Idempotency keys removed.
    pub keys: usize,
}

/// When a finished record ended (its history row's end, else submission).
fn ended_at(rec: &JobRecord) -> Time {
    HistoryEntry::from_record(rec, rec.submitted_at)
        .ended_at
        .unwrap_or(rec.submitted_at)
}

/// `YYYY-MM` of seconds since the epoch (UTC; Howard Hinnant's
/// civil-from-days).
pub fn year_month(t: Time) -> String {
    let days = (t / 86_400) as i64 + 719_468;
    let era = days.div_euclid(146_097);
    let doe = days - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}")
}

/// Appends the records' history rows to `dir/export-YYYY-MM.jsonl` (by the
/// month each ended) and syncs the files: once this returns, the rows are
/// durable.
pub fn export(dir: &Path, recs: &[JobRecord], now: Time) -> std::io::Result<()> {
    crate::private_dir(dir)?;
    let mut by_month: std::collections::BTreeMap<String, Vec<u8>> = Default::default();
    for rec in recs {
        let line = by_month.entry(year_month(ended_at(rec))).or_default();
        serde_json::to_writer(&mut *line, &HistoryEntry::from_record(rec, now))
            .map_err(std::io::Error::other)?;
        line.push(b'\n');
    }
    for (month, lines) in by_month {
        let path = dir.join(format!("export-{month}.jsonl"));
        let mut opts = std::fs::OpenOptions::new();
        opts.create(true).append(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(0o600);
        }
        let mut f = opts.open(&path)?;
        f.write_all(&lines)?;
        f.sync_all()?;
    }
    Ok(())
}

impl<S: Store> Control<S> {
    /// Finished jobs that ended at least `horizon` seconds before `now`,
    /// oldest ids first, at most `max`.
    ///
    /// A finished job that an unfinished job's dependency names (by its id,
    /// or by its array's id) stays: removing it would turn `afterok:ID` into
    /// "no longer exists" and cancel the dependant.
    pub fn expired_jobs(&self, horizon: u64, now: Time, max: usize) -> Vec<JobRecord> {
        let named = self.named_by_dependencies();
        self.jobs
            .values()
            .filter(|(r, _)| r.state.is_terminal())
            .filter(|(r, _)| ended_at(r).saturating_add(horizon) <= now)
            .filter(|(r, _)| {
                !named.contains(&r.id) && !r.array.as_ref().is_some_and(|a| named.contains(&a.job))
            })
            .take(max)
            .map(|(r, _)| JobRecord::clone(r))
            .collect()
    }

    /// Job ids named by the `after*` dependencies of unfinished jobs.
    fn named_by_dependencies(&self) -> HashSet<JobId> {
        self.jobs
            .values()
            .filter(|(r, _)| !r.state.is_terminal())
            .filter_map(|(r, _)| r.spec.dependency.as_deref())
            .filter_map(|d| parse_dependency(d).ok())
            .flatten()
            .flat_map(|d| match d {
                Dependency::After(_, ids) => ids,
                Dependency::Singleton => Vec::new(),
            })
            .collect()
    }

    /// Removes finished job records (each compared on its revision, in
    /// transactions within the store's limits). A record that changed or
    /// is not finished stays. Returns how many were removed.
    pub fn remove_finished(&mut self, ids: &[JobId]) -> Result<usize, ControlError> {
        let ids: Vec<(JobId, u64)> = ids
            .iter()
            .filter_map(|id| {
                let (r, rev) = self.jobs.get(id)?;
                r.state.is_terminal().then_some((*id, *rev))
            })
            .collect();
        let keys: Vec<(String, u64)> = ids
            .iter()
            .map(|(id, rev)| (crate::records::job_key(*id), *rev))
            .collect();
        let removed = self.delete_keys(&keys)?;
        for (id, _) in &ids[..removed] {
            self.jobs.remove(id);
            self.view.why.remove(id);
        }
        Ok(removed)
    }

    /// Idempotency keys whose job was submitted at least `horizon` seconds
    /// before `now`, or whose job is gone; at most `max`, with revisions.
    pub fn expired_keys(
        &self,
        horizon: u64,
        now: Time,
        max: usize,
    ) -> Result<Vec<(String, u64)>, ControlError> {
        let mut out = Vec::new();
        for kv in self.store.range("/idempotency/")? {
            if out.len() >= max {
                break;
            }
            let id: Option<JobId> = serde_json::from_slice(&kv.value).ok();
            let old = match id.and_then(|id| self.jobs.get(&id)) {
                Some((r, _)) => r.submitted_at.saturating_add(horizon) <= now,
                None => true,
            };
            if old {
                out.push((kv.key, kv.mod_revision));
            }
        }
        Ok(out)
    }

    /// Deletes keys, each compared on its revision, in order and in
    /// transactions within the store's limits; stops at the first that
    /// fails. Returns how many (a prefix) were deleted.
    pub fn delete_keys(&mut self, keys: &[(String, u64)]) -> Result<usize, ControlError> {
        let limits = self.store.txn_limits();
        let ranges = limits.split((0, 0, 0), keys.iter().map(|(k, _)| (1, 1, 2 * k.len())));
        let mut done = 0;
        for range in ranges {
            let chunk = &keys[range.clone()];
            let compares: Vec<Compare> = chunk
                .iter()
                .map(|(k, rev)| Compare::Revision(k.clone(), *rev))
                .collect();
            let ops: Vec<Op> = chunk.iter().map(|(k, _)| Op::Delete(k.clone())).collect();
            if !self.store.txn(&compares, &ops)?.succeeded {
                return Err(ControlError::Conflict(format!(
                    "{} records changed while being removed",
                    chunk.len()
                )));
            }
            done = range.end;
        }
        Ok(done)
    }
}

/// One retention pass of the leader: exports and removes up to
/// [`PASS_LIMIT`] expired finished jobs (only with an export directory) and
/// as many expired idempotency keys. The state lock is held to pick and to
/// delete, not while the export is written.
pub fn pass(
    control: &crate::lock::StateLock<crate::SharedStore>,
    retention: &Retention,
    export_dir: Option<&Path>,
    now: Time,
) -> Result<Removed, ControlError> {
    let (jobs_h, keys_h) = retention.seconds().map_err(ControlError::Conflict)?;
    let poisoned = || ControlError::Conflict("state lock poisoned".into());
    let mut removed = Removed::default();
    if let Some(dir) = export_dir {
        let recs = control
            .lock()
            .map_err(|_| poisoned())?
            .expired_jobs(jobs_h, now, PASS_LIMIT);
        if !recs.is_empty() {
            export(dir, &recs, now).map_err(|e| {
                ControlError::Conflict(format!("history export in {}: {e}", dir.display()))
            })?;
            let ids: Vec<JobId> = recs.iter().map(|r| r.id).collect();
            removed.jobs = control
                .lock()
                .map_err(|_| poisoned())?
                .remove_finished(&ids)?;
        }
    }
    let mut c = control
        .lock_as(crate::view::Holder::Retention)
        .map_err(|_| poisoned())?;
    let keys = c.expired_keys(keys_h, now, PASS_LIMIT)?;
    removed.keys = c.delete_keys(&keys)?;
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::TimeSpan;

    #[test]
    fn months_of_known_dates() {
        assert_eq!(year_month(0), "1970-01");
        // 2024-02-29 12:00 UTC, 2026-12-31 23:59:59 UTC, 2027-01-01 00:00 UTC.
        assert_eq!(year_month(1_709_208_000), "2024-02");
        assert_eq!(year_month(1_798_761_599), "2026-12");
        assert_eq!(year_month(1_798_761_600), "2027-01");
    }

    #[test]
    fn the_store_is_compacted_to_the_newest_mark_a_history_old() {
        let mut c = Compactor::default();
        assert_eq!(c.due(300, 1000, 10), None);
        assert_eq!(c.due(300, 1060, 20), None);
        assert_eq!(c.due(300, 1299, 30), None);
        // 1000's mark is 300 s old: its revision.
        assert_eq!(c.due(300, 1300, 40), Some(10));
        // 1060's, 1299's and 1300's are all old by 1600: the newest.
        assert_eq!(c.due(300, 1600, 50), Some(40));
        // None until 1600's is old.
        assert_eq!(c.due(300, 1899, 60), None);
        assert_eq!(c.marks.len(), 2);
        assert_eq!(c.due(300, 1900, 70), Some(50));
    }

    #[test]
    fn store_history_is_checked() {
        let with = |t: TimeSpan| Retention {
            store_history: t,
            ..Retention::default()
        };
        assert_eq!(Retention::default().store_history_seconds(), Ok(Some(60)));
        assert_eq!(with(TimeSpan::Seconds(0)).store_history_seconds(), Ok(None));
        for bad in [
            TimeSpan::Seconds(59),
            TimeSpan::Text("31d".into()),
            TimeSpan::Text("x".into()),
        ] {
            assert!(with(bad)
                .store_history_seconds()
                .unwrap_err()
                .contains("retention.store_history"));
        }
    }

    #[test]
    fn horizons_are_checked_by_field() {
        let r = Retention::default();
        assert_eq!(r.seconds(), Ok((7 * 86_400, 86_400)));
        let bad = Retention {
            finished_jobs: TimeSpan::Seconds(5),
            ..Retention::default()
        };
        assert!(bad
            .seconds()
            .unwrap_err()
            .contains("retention.finished_jobs"));
        let bad = Retention {
            idempotency_keys: TimeSpan::Text("soon".into()),
            ..Retention::default()
        };
        assert!(bad
            .seconds()
            .unwrap_err()
            .contains("retention.idempotency_keys"));
    }
}
