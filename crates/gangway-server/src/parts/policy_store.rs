//! The policy store: the scheduler's knobs and the queues the scheduler's
//! state is built from, as the installed policy (or the configuration)
//! gives them.

use gangway_core::QueueSpec;
use gangway_sched::SchedulerConfig;

/// The scheduler's knobs and queues in force.
#[derive(Debug, Default)]
pub struct PolicyStore {
    /// Scheduler knobs.
    pub sched: SchedulerConfig,
    /// The queues of the configuration or the installed policy (the
    /// scheduler's state is rebuilt from them when a node is deleted).
    pub queues: Vec<QueueSpec>,
}

impl PolicyStore {
    /// The default knobs with these queues.
    pub fn new(queues: &[QueueSpec]) -> Self {
        PolicyStore {
            sched: SchedulerConfig::default(),
            queues: queues.to_vec(),
        }
    }
}
