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
        self.nodes.probation.start(node, &why, now);
        self.nodes.cordon_reasons.insert(node.to_string(), why);
        self.show_probation(node);
    }

    /// An admin cordoned (`cordoned`) or uncordoned the node: its probation,
    /// if any, ends; an admin's cordon of a node on probation is the
    /// admin's from now on, and says so.
    pub(crate) fn end_probation(&mut self, node: &str, cordoned: bool) {
        if let Some(was) = self.nodes.probation.end(node) {
            if cordoned {
                self.nodes.cordon_reasons.insert(
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
        let mut shown = self.nodes.probation.agent_check(node, req.health_check);
        let mut back = false;
        if let Some(r) = &req.health_check_run {
            match self.nodes.probation.report(node, r, now) {
                Some(Outcome::Passed { last_line, .. }) => {
                    tracing::info!(
                        "node {node} returned to service after passing its health check: {last_line}"
                    );
                    self.back_in_service(node)?;
                    back = true;
                }
                Some(Outcome::Failed { why, next_at, .. }) => {
                    let tail = r.result.as_ref().map(|x| &x.tail);
                    tracing::warn!(
                        "node {node}: health check failed: {why}; next try at {next_at}; output: {tail:?}"
                    );
                    shown = true;
                }
                None => {}
            }
        }
        // No job left, and disk enough: a check needs the node to itself.
        // (Looked at only for a node on probation: most syncs pay nothing.)
        let idle = self.nodes.probation.phase(node).is_some()
            && !self.nodes.disk_pressure.contains_key(node)
            && self
                .cluster
                .node_index(node)
                .is_some_and(|n| self.cluster.jobs_on(n).is_empty());
        let (ask, started) = self.nodes.probation.ask(node, now, idle);
        if shown || started {
            self.show_probation(node);
        }
        Ok((ask, back))
    }

    /// A node passed its health check: uncordoned, its evidence forgotten;
    /// under DiskPressure (which began during the run) the pressure's
    /// cordon takes over, lifted when the pressure goes.
    fn back_in_service(&mut self, node: &str) -> Result<(), ControlError> {
        let Some((why, ours)) = self.nodes.disk_pressure.get_mut(node) else {
            return self.cordon(node, false);
        };
        *ours = true;
        let why = why.clone();
        self.nodes.blame.forget_node(node);
        self.nodes.cordon_reasons.insert(node.to_string(), why);
        if self.cluster.set_cordoned(node, true).is_ok() {
            self.view.cluster.urge();
        }
        Ok(())
    }

    /// Puts the node's probation state into its cordon reason, and marks
    /// the node changed so the node list shows it.
    fn show_probation(&mut self, node: &str) {
        let Some(reason) = self.nodes.probation.reason(node) else {
            return;
        };
        self.nodes.cordon_reasons.insert(node.to_string(), reason);
        // A node on probation is cordoned: this only marks its row changed.
        if self.cluster.set_cordoned(node, true).is_ok() {
            self.view.cluster.urge();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blame::Cause;
    use crate::probation::{Probation, ProbationConfig};
    use gangway_core::agent::{HealthCheckReport, HealthCheckResult};
    use gangway_core::{NodeSpec, QueueSpec};
    use gangway_store::RedbStore;

    fn control(dir: &std::path::Path) -> Control<RedbStore> {
        let store = RedbStore::open(&dir.join("s.redb")).expect("store");
        let mut c = Control::open(store, &[QueueSpec::unlimited("q", None)]).expect("control");
        c.nodes.probation = Probation::new(ProbationConfig {
            after_seconds: 10,
            max_backoff_seconds: 3600,
        });
        let mut n = NodeSpec::uniform("n", "l", "s", 1, "H100", 80);
        n.address = "10.0.0.1".into();
        c.register_node(n, &crate::nodes::Registrant::Join, true, "join", 0)
            .expect("node");
        // Blamed for an agent fault at 0.
        c.nodes
            .blame
            .node_fault("n", None, Cause::AgentFault("cgroup".into()), 0);
        c.apply_blame(0).expect("blame");
        assert!(c.cluster.nodes()[0].spec.cordoned);
        c
    }

    fn sync(
        c: &mut Control<RedbStore>,
        now: Time,
        run: Option<(u64, i32)>,
        pressure: bool,
    ) -> Option<u64> {
        let req = SyncRequest {
            health_check: true,
            health_check_run: run.map(|(run, exit_code)| HealthCheckReport {
                run,
                result: Some(HealthCheckResult {
                    exit_code,
                    tail: vec!["checked".into()],
                }),
            }),
            disk_pressure: pressure.then(|| "DiskPressure: 3 % free".to_string()),
            ..Default::default()
        };
        c.sync("n", &req, now).expect("sync").0.health_check
    }

    fn reason(c: &Control<RedbStore>) -> String {
        c.nodes.cordon_reasons.get("n").cloned().unwrap_or_default()
    }

    #[test]
    fn a_pass_uncordons_and_forgets_the_evidence() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path());
        assert_eq!(sync(&mut c, 5, None, false), None);
        assert!(
            reason(&c).contains("health check due at 10"),
            "{}",
            reason(&c)
        );
        assert_eq!(sync(&mut c, 10, None, false), Some(1));
        assert!(reason(&c).contains("running since 10"), "{}", reason(&c));
        assert_eq!(sync(&mut c, 11, Some((1, 0)), false), None);
        assert!(!c.cluster.nodes()[0].spec.cordoned);
        assert!(!c.nodes.cordon_reasons.contains_key("n"));
        assert!(c.nodes.blame.evidence("n").is_empty());
        assert_eq!(c.nodes.probation.take_log().len(), 1);
    }

    #[test]
    fn an_admin_cordon_during_probation_is_the_admins_and_stays() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path());
        assert_eq!(sync(&mut c, 10, None, false), Some(1));
        c.cordon("n", true).expect("admin cordon");
        assert!(
            reason(&c).starts_with("cordoned by an admin after: cordoned automatically"),
            "{}",
            reason(&c)
        );
        // The run's pass comes late: nothing is lifted, nothing asked.
        assert_eq!(sync(&mut c, 11, Some((1, 0)), false), None);
        assert_eq!(sync(&mut c, 100_000, None, false), None);
        assert!(c.cluster.nodes()[0].spec.cordoned);
    }

    #[test]
    fn under_disk_pressure_no_check_runs_and_a_pass_leaves_the_pressures_cordon() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path());
        assert_eq!(
            sync(&mut c, 10, None, true),
            None,
            "no check under pressure"
        );
        assert_eq!(sync(&mut c, 11, None, false), Some(1));
        // The pressure begins while the check runs, and it passes.
        assert_eq!(sync(&mut c, 12, Some((1, 0)), true), None);
        assert!(c.cluster.nodes()[0].spec.cordoned, "still short of disk");
        assert_eq!(reason(&c), "DiskPressure: 3 % free");
        // The pressure goes: so does its cordon.
        sync(&mut c, 13, None, false);
        assert!(!c.cluster.nodes()[0].spec.cordoned);
    }
}
