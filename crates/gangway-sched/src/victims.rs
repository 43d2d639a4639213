//! The victim index: every running preemptible job not already signalled to
//! stop, kept by [`ClusterState`](crate::ClusterState) as jobs bind, end,
//! checkpoint or change priority, so a preemption search never walks or sorts
//! every running job.
//!
//! A search wants victims by lost work (GPU-seconds since the last
//! checkpoint), which depends on the time. Jobs are grouped in *classes*
//! (queue, priority, GPUs, preemptions so far, and how their lost work moves
//! with time) inside which one order of the members is the order of lost work
//! at every instant at or after their anchors:
//!
//! - a job that reported a checkpoint (or has no checkpoint interval) loses
//!   `gpus × (now − anchor)`, the anchor being its last checkpoint or its
//!   start: in a class of equal GPUs, the latest anchor loses least, always;
//! - a job with a checkpoint interval `i` and no reported checkpoint loses
//!   `gpus × ((now − start) mod i)`: ordered by `start mod i`, the order at
//!   `now` is that list rotated at `now mod i`.
//!
//! A search merges the classes it may take victims from with a heap keyed by
//! the same sort key as a full sort would use, so it yields exactly the order
//! of sorting every candidate, one candidate at a time, and its cost follows
//! the candidates it examines rather than the jobs running. When `now` is
//! before some member's anchor (a caller going back in time, or a checkpoint
//! reported from the future) the classes' orders do not hold, and the stream
//! falls back to computing and sorting every candidate of the allowed classes.

use crate::model::{Job, JobStatus, QueueId};
use crate::PreemptReason;
use gangway_core::{JobId, Time};
use std::cmp::Reverse;
use std::collections::{btree_set, BTreeMap, BTreeSet, BinaryHeap};
use std::iter::{Chain, Rev};
use std::ops::Bound;

/// How a class's lost work moves with time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Clock {
    /// Holds no GPUs: it loses nothing.
    Zero,
    /// Loses `gpus × (now − anchor)`; a member's first key is its anchor
    /// (last reported checkpoint, else start).
    Anchor,
    /// Periodic checkpoints every `i` seconds and none reported: loses
    /// `gpus × ((now − start) mod i)`; a member's first key is `start mod i`.
    Phase(u64),
}

/// Jobs whose members keep one order of lost work over time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Class {
    pub(crate) queue: QueueId,
    pub(crate) priority: i32,
    /// GPUs the job holds (its placement's, as lost work counts them).
    pub(crate) gpus: u64,
    /// Times it was preempted (the per-job preemption budget's count).
    pub(crate) preemptions: u32,
    pub(crate) clock: Clock,
}

/// A member of a class: (anchor or phase, start, id reversed). Walked from
/// the greatest key down, this is least lost work first, then newest first,
/// then lowest id: the tie-breaks of the full sort.
pub(crate) type Member = (Time, Time, Reverse<JobId>);

/// A candidate's position in a search: (first criterion, second criterion,
/// newest first, id). Priority preemption sorts by (lost work, priority),
/// reclaim by (priority, lost work).
pub(crate) type SortKey = (u64, u64, Reverse<Time>, JobId);

/// The sort key of a candidate for a search of `reason`.
pub(crate) fn sort_key(
    reason: PreemptReason,
    lost: u64,
    priority: i32,
    started: Time,
    id: JobId,
) -> SortKey {
    let prio = u64::from((priority as u32) ^ 0x8000_0000);
    match reason {
        PreemptReason::Priority => (lost, prio, Reverse(started), id),
        PreemptReason::Reclaim => (prio, lost, Reverse(started), id),
    }
}

/// Where a job sits in the index, and the latest instant its order needs
/// (`now` at or after it keeps its class's order): `None` when it is no
/// victim candidate (not running, not preemptible, or already stopping).
pub(crate) fn slot_of(job: &Job) -> Option<(Class, Member, Time)> {
    if !job.spec.is_preemptible() {
        return None;
    }
    let JobStatus::Running(r) = &job.status else {
        return None;
    };
    if r.preempting.is_some() {
        return None;
    }
    let gpus = r.placement.gpus();
    let (clock, first, latest) = if gpus == 0 {
        (Clock::Zero, 0, 0)
    } else {
        match (r.last_checkpoint, job.spec.checkpoint.interval_seconds) {
            (Some(c), _) => {
                let a = c.max(r.started);
                (Clock::Anchor, a, a)
            }
            (None, Some(i)) if i > 0 => (Clock::Phase(i), r.started % i, r.started),
            _ => (Clock::Anchor, r.started, r.started),
        }
    };
    let class = Class {
        queue: job.queue,
        priority: job.priority,
        gpus,
        preemptions: job.preemptions,
        clock,
    };
    Some((class, (first, r.started, Reverse(job.id)), latest))
}

/// Lost work of a member of `class` at `now`, as
/// [`Job::lost_work_gpu_seconds`] computes it.
fn lost(class: &Class, m: &Member, now: Time) -> u64 {
    match class.clock {
        Clock::Zero => 0,
        Clock::Anchor => class.gpus * now.saturating_sub(m.0),
        Clock::Phase(i) => class.gpus * (now.saturating_sub(m.1) % i),
    }
}

/// Running preemptible jobs that are not stopping, by class (see the module
/// documentation). Maintained by `ClusterState`'s mutating methods.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct VictimClasses {
    classes: BTreeMap<Class, BTreeSet<Member>>,
    /// How many members need `now` at or after each instant (a multiset):
    /// the last key is the earliest `now` at which every class's order holds.
    latest: BTreeMap<Time, u32>,
}

impl VictimClasses {
    /// Adds `job` if it is a candidate.
    pub(crate) fn insert(&mut self, job: &Job) {
        let Some((class, m, latest)) = slot_of(job) else {
            return;
        };
        if self.classes.entry(class).or_default().insert(m) {
            *self.latest.entry(latest).or_default() += 1;
        }
    }

    /// Removes `job` as it was added (call before changing what
    /// [`slot_of`] reads).
    pub(crate) fn remove(&mut self, job: &Job) {
        let Some((class, m, latest)) = slot_of(job) else {
            return;
        };
        let Some(set) = self.classes.get_mut(&class) else {
            return;
        };
        if !set.remove(&m) {
            return;
        }
        if set.is_empty() {
            self.classes.remove(&class);
        }
        if let Some(c) = self.latest.get_mut(&latest) {
            *c -= 1;
            if *c == 0 {
                self.latest.remove(&latest);
            }
        }
    }

    /// The index of exactly these jobs' candidates (a rebuild, for queue
    /// renumbering and for checking the incremental one).
    pub(crate) fn of<'j>(jobs: impl Iterator<Item = &'j Job>) -> Self {
        let mut v = VictimClasses::default();
        for j in jobs {
            v.insert(j);
        }
        v
    }

    /// The candidates of the classes `allow` accepts, in the order of
    /// [`sort_key`] for `reason` at `now`, one at a time.
    pub(crate) fn stream(
        &self,
        now: Time,
        reason: PreemptReason,
        mut allow: impl FnMut(&Class) -> bool,
    ) -> Stream<'_> {
        let classes: Vec<(&Class, &BTreeSet<Member>)> =
            self.classes.iter().filter(|(c, _)| allow(c)).collect();
        let in_order = self.latest.keys().next_back().is_none_or(|&t| t <= now);
        if !in_order {
            let mut all: Vec<(SortKey, JobId)> = classes
                .iter()
                .flat_map(|(c, set)| {
                    set.iter().map(move |m| {
                        let id = m.2 .0;
                        (sort_key(reason, lost(c, m, now), c.priority, m.1, id), id)
                    })
                })
                .collect();
            all.sort_unstable();
            return Stream {
                now,
                reason,
                cursors: Vec::new(),
                heap: BinaryHeap::new(),
                sorted: Some(all.into_iter()),
            };
        }
        let mut cursors = Vec::with_capacity(classes.len());
        let mut heap = BinaryHeap::with_capacity(classes.len());
        for (c, set) in classes {
            let mut cur = match c.clock {
                // The members whose phase is at most `now mod i` lose least
                // (latest phase first), then the rest (latest first).
                Clock::Phase(i) => {
                    let cut: Member = (now % i + 1, 0, Reverse(JobId(u64::MAX)));
                    set.range(..cut).rev().chain(set.range(cut..).rev())
                }
                Clock::Zero | Clock::Anchor => {
                    // Every member, latest anchor first; nothing after.
                    let top: Member = (Time::MAX, Time::MAX, Reverse(JobId(0)));
                    let none = set.range((Bound::Excluded(top), Bound::Unbounded));
                    set.range(..).rev().chain(none.rev())
                }
            };
            if let Some(m) = cur.next() {
                heap.push(Reverse((
                    sort_key(reason, lost(c, m, now), c.priority, m.1, m.2 .0),
                    cursors.len(),
                )));
            }
            cursors.push((c, cur));
        }
        Stream {
            now,
            reason,
            cursors,
            heap,
            sorted: None,
        }
    }
}

type Cursor<'v> = Chain<Rev<btree_set::Range<'v, Member>>, Rev<btree_set::Range<'v, Member>>>;

/// Candidates in sort-key order: a merge of the allowed classes, or (when
/// `now` is before some anchor) a full sort of them.
pub(crate) struct Stream<'v> {
    now: Time,
    reason: PreemptReason,
    cursors: Vec<(&'v Class, Cursor<'v>)>,
    heap: BinaryHeap<Reverse<(SortKey, usize)>>,
    sorted: Option<std::vec::IntoIter<(SortKey, JobId)>>,
}

impl Iterator for Stream<'_> {
    /// A candidate and its lost work at `now`.
    type Item = (JobId, u64);

    fn next(&mut self) -> Option<(JobId, u64)> {
        let lost_of = |reason: PreemptReason, k: &SortKey| match reason {
            PreemptReason::Priority => k.0,
            PreemptReason::Reclaim => k.1,
        };
        if let Some(sorted) = &mut self.sorted {
            return sorted.next().map(|(k, id)| (id, lost_of(self.reason, &k)));
        }
        let Reverse((key, c)) = self.heap.pop()?;
        let (class, cur) = &mut self.cursors[c];
        if let Some(m) = cur.next() {
            let k = sort_key(
                self.reason,
                lost(class, m, self.now),
                class.priority,
                m.1,
                m.2 .0,
            );
            self.heap.push(Reverse((k, c)));
        }
        Some((key.3, lost_of(self.reason, &key)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{ClusterState, StateConfig};
    use crate::{apply, schedule, SchedulerConfig};
    use gangway_core::{JobSpec, NodeSpec, QueueSpec};
    use proptest::prelude::*;

    /// What a job does in [`world`]: GPUs (mod 3), checkpoint interval (one of three),
    /// preemptible, then one change to a running job (kind, pick, amount).
    type Op = (u32, u64, bool, u8, u16, u16);

    /// Jobs start over time (one per step, 7 s apart) on 32 nodes of 8
    /// GPUs; each step also checkpoints (sometimes ahead of the clock),
    /// re-prioritises, signals or finishes a running job.
    fn world(ops: &[Op]) -> (ClusterState, Time) {
        let mut s = ClusterState::new(StateConfig::default());
        for i in 0..32 {
            s.add_node(NodeSpec::uniform(
                &format!("n{i:02}"),
                &format!("leaf{}", i / 4),
                "spine0",
                8,
                "H100",
                80,
            ))
            .expect("node");
        }
        for q in 0..3 {
            s.add_queue(QueueSpec::gpus(&format!("q{q}"), None, 1_000))
                .expect("queue");
        }
        let cfg = SchedulerConfig {
            preemption: false,
            ..SchedulerConfig::default()
        };
        let mut now = 0;
        for (k, &(gpus, interval, preemptible, kind, pick, amount)) in ops.iter().enumerate() {
            now = k as Time * 7;
            let mut spec = JobSpec::new("j", &format!("q{}", k % 3), 1, gpus % 3);
            spec.preemptible = Some(preemptible);
            // Few distinct intervals, so classes hold many members.
            spec.checkpoint.interval_seconds = [None, Some(10), Some(25)][interval as usize % 3];
            // A job the cluster refuses (none here) would just be left out.
            let _ = s.submit(JobId(k as u64 + 1), spec, now);
            let d = schedule(&s, now, &cfg);
            apply(&mut s, &d, now).expect("apply");
            let running: Vec<JobId> = s
                .jobs_sorted()
                .iter()
                .filter(|j| matches!(j.status, JobStatus::Running(_)))
                .map(|j| j.id)
                .collect();
            if running.is_empty() {
                continue;
            }
            let id = running[pick as usize % running.len()];
            let a = Time::from(amount % 50);
            match kind % 6 {
                0 => s
                    .record_checkpoint(id, now.saturating_sub(a))
                    .expect("running"),
                1 => s.record_checkpoint(id, now + a).expect("running"),
                2 => s
                    .set_priority(id, 998 + i32::from(amount % 5))
                    .expect("known"),
                3 => s.mark_preempting(id, JobId(0), now).expect("running"),
                4 => {
                    s.finish(id).expect("running");
                }
                _ => {}
            }
        }
        s.check_invariants().expect("indexes consistent");
        (s, now)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256), ..ProptestConfig::default() })]

        /// The stream yields exactly what sorting every candidate by its
        /// lost work at `now` would, in that order, at any `now`: after
        /// every anchor (the merge, across checkpoint-interval wraps) and
        /// before some (the full-sort fallback).
        #[test]
        fn stream_is_the_full_sort_of_the_allowed_candidates(
            ops in prop::collection::vec((0u32..3, 0u64..3, prop::bool::weighted(0.8), any::<u8>(), any::<u16>(), any::<u16>()), 1..150),
            offset in 0u64..2_000,
            back in any::<bool>(),
            reclaim in any::<bool>(),
            queues in 0u32..8,
            below in 998i32..1_004,
        ) {
            let (s, last) = world(&ops);
            let now = if back { last.saturating_sub(offset % 60) } else { last + offset };
            let reason = if reclaim { PreemptReason::Reclaim } else { PreemptReason::Priority };
            let allowed = |q: QueueId, p: i32| queues & (1 << q) != 0 && p < below;
            let got: Vec<(JobId, u64)> =
                s.victims.stream(now, reason, |c| allowed(c.queue, c.priority)).collect();
            let mut want: Vec<(SortKey, (JobId, u64))> = s
                .jobs_sorted()
                .into_iter()
                .filter_map(|j| {
                    let JobStatus::Running(r) = &j.status else { return None };
                    if !j.spec.is_preemptible() || r.preempting.is_some() || !allowed(j.queue, j.priority) {
                        return None;
                    }
                    let lost = j.lost_work_gpu_seconds(now);
                    Some((sort_key(reason, lost, j.priority, r.started, j.id), (j.id, lost)))
                })
                .collect();
            want.sort_unstable();
            let want: Vec<(JobId, u64)> = want.into_iter().map(|(_, v)| v).collect();
            prop_assert_eq!(got, want);
        }
    }
}
