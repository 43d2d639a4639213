//! The queue usage samples behind the dashboard's chart, kept in [`crate::http::common::App`].

use gangway_core::Time;
use std::collections::VecDeque;

/// Samples kept of each queue's GPU usage: 6 hours at one per 30 s.
pub const HISTORY_SAMPLES: usize = 720;

/// Seconds between samples.
pub const HISTORY_EVERY: Time = 30;

/// Each queue's GPUs in use over time, oldest first.
#[derive(Default)]
pub struct QueueHistory {
    /// (time, GPUs in use per queue in the config's order).
    pub samples: VecDeque<(Time, Vec<u64>)>,
}

impl QueueHistory {
    /// Records a sample if the last one is older than [`HISTORY_EVERY`].
    pub fn sample(&mut self, now: Time, usage: Vec<u64>) {
        if self
            .samples
            .back()
            .is_some_and(|(t, _)| now < t + HISTORY_EVERY)
        {
            return;
        }
        if self.samples.len() == HISTORY_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((now, usage));
    }
}
