//! A job's life in the simulation, as the engine moves it and the metrics
//! read it.

use crate::trace::TraceJob;
use gangway_core::Time;

/// A job's life in the simulation.
#[derive(Clone, Debug)]
pub struct SimJob {
    /// From the trace.
    pub trace: TraceJob,
    /// Work saved in checkpoints, seconds.
    pub done: u64,
    /// Current run's start.
    pub run_start: Option<Time>,
    /// Attempt counter (stale events are ignored).
    pub attempt: u32,
    /// First start.
    pub first_start: Option<Time>,
    /// Completion.
    pub finish: Option<Time>,
    /// Time spent pending so far.
    pub waited: u64,
    /// Since when it is pending.
    pub pending_since: Time,
    /// Times preempted.
    pub preemptions: u32,
    /// GPU-seconds lost (work since the last checkpoint, and the grace period).
    pub lost_gpu_seconds: u64,
    /// GPU-seconds received in finished runs.
    pub attained: u64,
    /// When the checkpoint signal was sent in this run.
    pub signalled: Option<Time>,
    /// Rejected by validation.
    pub rejected: Option<String>,
    /// Seconds without progress at the start of the current run (restoring a checkpoint).
    pub overhead: u64,
}

impl SimJob {
    /// Seconds of work left (the trace's run time less what is saved).
    pub fn remaining(&self) -> u64 {
        self.trace.duration.saturating_sub(self.done)
    }
}
