//! Building the read view and the cluster snapshot from the control state
//! (see [`crate::view`]).

use super::Control;
use crate::view::*;
use gangway_store::Store;
use std::sync::Arc;
use std::time::Instant;

impl<S: Store> Control<S> {
    /// The read view of this state (O(1): everything is shared; the
    /// cluster snapshot is the last one [`Control::refresh_cluster_view`]
    /// built).
    pub fn read_view(&self) -> ReadView {
        ReadView {
            jobs: self.jobs.snapshot(),
            gates: self.gates.waiting.clone(),
            why: self.view.why.clone(),
            why_at: self.view.why_at,
            planned_nodes: self.view.planned_nodes.clone(),
            names: self.view.names.state.clone(),
            node_by_token: self.nodes.by_token.clone(),
            job_counts: self.jobs.counts_shared(),
            cluster: self.view.cluster.snapshot.clone(),
            last_seen: self.nodes.heartbeats.for_view(),
            reservations: self.reservations.0.clone(),
            node_credentials: self.nodes.tokens.clone(),
        }
    }

    /// Rebuilds the cluster snapshot if the scheduler's state may have
    /// changed since the last one, and either it was urged or the last
    /// rebuild is long enough ago (see [`ClusterMemo`]). Whether it rebuilt.
    pub fn refresh_cluster_view(&mut self) -> bool {
        let from = (
            self.cluster.borrows(),
            self.nodes.pending.len(),
            self.nodes.cordon_reasons.len(),
        );
        let m = &self.view.cluster;
        if m.built_from == Some(from) {
            self.view.cluster.urgent = false;
            return false;
        }
        let due = m
            .built_at
            .is_none_or(|t| t.elapsed() >= m.cost.saturating_mul(REBUILD_SPACING));
        if !(m.urgent || due) {
            return false;
        }
        let start = Instant::now();
        // Pending nodes and cordon reasons live here, not in the scheduler:
        // when they changed, every row is revisited.
        let since = m
            .touched_mark
            .filter(|_| m.built_from.is_some_and(|b| (b.1, b.2) == (from.1, from.2)));
        let mark = self.cluster.node_touches();
        let fresh = ClusterSnapshot::build(
            &self.cluster,
            &self.nodes.pending,
            &self.nodes.cordon_reasons,
            &m.snapshot,
            since,
        );
        let m = &mut self.view.cluster;
        m.snapshot = Arc::new(fresh);
        m.built_from = Some(from);
        m.touched_mark = Some(mark);
        m.built_at = Some(Instant::now());
        m.cost = start.elapsed();
        m.urgent = false;
        true
    }
}
