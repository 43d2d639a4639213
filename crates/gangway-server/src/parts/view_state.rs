//! What the read view publishes besides the records: the last cycle's
//! explanations and backfill plan, the names they refer to, and the
//! cluster snapshot's memo (see [`crate::view`]).

use crate::view::{ClusterMemo, Names, PlannedNodes, Why};
use gangway_core::Time;
use gangway_sched::{ClusterState, Decisions};
use std::sync::Arc;

/// The read view's parts that the control state keeps up to date.
#[derive(Debug, Default)]
pub struct ViewState {
    /// Last explanation per pending job (shared with the read view).
    pub why: Why,
    /// When they were computed.
    pub why_at: Time,
    /// Planned nodes per pending job in the last cycle's backfill plan.
    pub planned_nodes: PlannedNodes,
    /// The queues and nodes, without jobs, that the last cycle's
    /// explanations refer to (see [`crate::view::ReadView::names`]).
    pub(crate) names: Names,
    /// The read view's cluster snapshot and when to rebuild it.
    pub cluster: ClusterMemo,
}

impl ViewState {
    /// Publishes a cycle's explanations and plan, made at `now` from
    /// `cluster` (explanations are kept structured and rendered when
    /// someone asks; jobs a capped cycle did not examine keep their last
    /// one).
    pub fn publish(&mut self, d: &Decisions, now: Time, cluster: &ClusterState) {
        self.why.update(d);
        self.why_at = now;
        self.planned_nodes = Arc::new(d.plan.iter().map(|r| (r.job, r.nodes.clone())).collect());
        self.names.refresh(cluster);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::JobId;
    use gangway_sched::{Reservation, StateConfig};

    #[test]
    fn a_published_cycle_gives_its_plan_time_and_names() {
        let mut cluster = ClusterState::new(StateConfig::default());
        cluster
            .add_queue(gangway_core::QueueSpec::unlimited("q", None))
            .expect("queue");
        let mut v = ViewState::default();
        let d = Decisions {
            plan: vec![Reservation {
                job: JobId(4),
                start_at: 10,
                end_at: 20,
                nodes: vec![0, 2],
            }],
            ..Decisions::default()
        };
        v.publish(&d, 9, &cluster);
        assert_eq!(v.why_at, 9);
        assert_eq!(v.planned_nodes.get(&JobId(4)), Some(&vec![0, 2]));
        assert_eq!(v.names.state.queues().len(), 1);
        v.publish(&Decisions::default(), 10, &cluster);
        assert!(v.planned_nodes.is_empty(), "the plan is the last cycle's");
    }
}
