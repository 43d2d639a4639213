//! The control state's side of probation (see [`crate::probation`]): what
//! the node shows, and a passing health check returning it to service.

use super::Control;
use crate::control_error::ControlError;
use crate::probation::Outcome;
use gangway_core::agent::SyncRequest;
use gangway_core::Time;
use gangway_store::Store;

impl<S: Store> Control<S> {
    /// Node blame cordoned `node` for `why`: its reason is shown and its
    /// probation starts.
    pub(crate) fn start_probation(&mut self, node: &str, why: String, now: Time) {
        self.probation.start(node, &why, now);
        self.cordon_reasons.insert(node.to_string(), why);
        self.show_probation(node);
    }

    /// An admin cordoned (`cordoned`) or uncordoned the node: its probation,
    /// if any, ends; an admin's cordon of a node on probation is the
    /// admin's from now on, and says so.
    pub(crate) fn end_probation(&mut self, node: &str, cordoned: bool) {
        if let Some(was) = self.probation.end(node) {
            if cordoned {
                self.cordon_reasons.insert(
                    node.to_string(),
                    format!("cordoned by an admin after: {was}"),
                );
            }
        }
    }

    /// The probation part of a sync: whether the agent has a health check,
    /// the result of the run it was asked for (a pass uncordons the node),
    /// and the run to ask for now (a try is due and no job is left on the
    /// node). Returns that run and whether the node was returned to service.
    pub(crate) fn probation_sync(
        &mut self,
        node: &str,
        req: &SyncRequest,
        now: Time,
    ) -> Result<(Option<u64>, bool), ControlError> {
        let mut shown = self.probation.agent_check(node, req.health_check);
        let mut back = false;
        if let Some(r) = &req.health_check_run {
            match self.probation.report(node, r, now) {
                Some(Outcome::Passed { last_line, .. }) => {
                    tracing::info!("node {node} returned to service after passing its health check: {last_line}");
                    self.cordon(node, false)?;
                    back = true;
                }
                Some(Outcome::Failed { why, next_at, .. }) => {
                    tracing::warn!("node {node}: health check failed: {why}; next try at {next_at}; output: {:?}",
                        r.result.as_ref().map(|x| &x.tail));
                    shown = true;
                }
                None => {}
            }
        }
        let idle = self
            .cluster
            .node_index(node)
            .is_some_and(|n| self.cluster.jobs_on(n).is_empty());
        let (ask, started) = self.probation.ask(node, now, idle);
        if shown || started {
            self.show_probation(node);
        }
        Ok((ask, back))
    }

    /// Puts the node's probation state into its cordon reason, and marks
    /// the node changed so the node list shows it.
    fn show_probation(&mut self, node: &str) {
        let Some(reason) = self.probation.reason(node) else {
            return;
        };
        self.cordon_reasons.insert(node.to_string(), reason);
        // A node on probation is cordoned: this only marks its row changed.
        if self.cluster.set_cordoned(node, true).is_ok() {
            self.cluster_view.urge();
        }
    }
}
