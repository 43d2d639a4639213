//! Queue ordering within one priority level: dominant-resource fair share (DRF)
//! between queues, weighted, then submit time. The queue with the smallest
//! weighted dominant share goes next; its share is recomputed after each of its
//! jobs is considered, so a queue that just got GPUs yields to the others.

use crate::capacity::{Capacity, QueueId};
use crate::state::Gang;
use crate::state::{ClusterState, PendingLevel};
use gangway_core::{JobId, Time};
use std::cmp::Reverse;
use std::collections::{btree_map, BinaryHeap};
use std::iter::Peekable;

/// Weighted dominant share of queue `q` as a fixed-point integer (deterministic ordering).
pub fn weighted_share(state: &ClusterState, cap: &Capacity, q: QueueId) -> u64 {
    let info = &state.queues()[q as usize];
    let share = cap.usage[q as usize].dominant_share(&state.total());
    (share / f64::from(info.spec.weight.max(1)) * (1u64 << 40) as f64) as u64
}

type Key = (u64, Time, usize);
type QueueCursor<'a> = (
    QueueId,
    Peekable<btree_map::Iter<'a, (i64, Time, JobId), Gang>>,
);

/// Walks one priority level's pending jobs in fair-share order.
pub struct LevelWalk<'a> {
    state: &'a ClusterState,
    fair: bool,
    queues: Vec<QueueCursor<'a>>,
    heap: BinaryHeap<Reverse<Key>>,
    repush: Option<usize>,
}

impl<'a> LevelWalk<'a> {
    /// Starts a walk over `level`.
    pub fn new(state: &'a ClusterState, level: &'a PendingLevel, fair: bool) -> Self {
        let queues: Vec<_> = level
            .iter()
            .map(|(q, set)| (*q, set.iter().peekable()))
            .collect();
        LevelWalk {
            state,
            fair,
            queues,
            heap: BinaryHeap::new(),
            repush: None,
        }
        .init()
    }

    fn init(mut self) -> Self {
        let cap = &self.state.capacity;
        for i in 0..self.queues.len() {
            if let Some(k) = self.key(cap, i) {
                self.heap.push(Reverse(k));
            }
        }
        self
    }

    fn key(&mut self, cap: &Capacity, i: usize) -> Option<Key> {
        let (q, it) = &mut self.queues[i];
        let ((_, t, _), _) = it.peek()?;
        let share = if self.fair {
            weighted_share(self.state, cap, *q)
        } else {
            0
        };
        Some((share, *t, i))
    }

    /// The next job to consider, given usage so far in this cycle.
    pub fn next(&mut self, cap: &Capacity) -> Option<&'a Gang> {
        if let Some(i) = self.repush.take() {
            if let Some(k) = self.key(cap, i) {
                self.heap.push(Reverse(k));
            }
        }
        let Reverse((_, _, i)) = self.heap.pop()?;
        let (_, g) = self.queues[i].1.next()?;
        self.repush = Some(i);
        Some(g)
    }
}
