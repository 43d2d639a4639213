//! The control state's side of probation (see [`crate::probation`]): what
//! the node shows, and a passing health check returning it to service.

use super::Control;
use crate::control_error::{decode, encode, ControlError};
use crate::probation::{Outcome, Probation, ProbationConfig};
use crate::records::{
    auto_cordon_key, node_key, AutoCordon, AUTO_CORDON_PREFIX, PROBATION_RUN_KEY,
};
use gangway_core::agent::SyncRequest;
use gangway_core::Time;
use gangway_store::{Op, Store};

/// Probation run numbers reserved in the store at a time: one write per
/// this many runs (and one per leader).
const RUN_BLOCK: u64 = 1024;

impl<S: Store> Control<S> {
    /// Loads the automatic cordons' records with these probation knobs (at
    /// open, and again once the server config's knobs are known): each
    /// cordoned node's reason is shown again and its probation restarts,
    /// its first try `after_seconds` from `now`; run numbers go above every
    /// one an earlier leader may have handed out. A record of a node no
    /// longer cordoned is left alone (its next cordon replaces it).
    pub(crate) fn load_auto_cordons(
        &mut self,
        cfg: ProbationConfig,
        now: Time,
    ) -> Result<(), ControlError> {
        let mut probation = Probation::new(cfg);
        if let Some(kv) = self.store.get(PROBATION_RUN_KEY)? {
            probation.runs_above(decode(&kv.key, &kv.value)?);
        } else {
            probation.runs_above(0);
        }
        self.nodes.probation = probation;
        for kv in self.store.range(AUTO_CORDON_PREFIX)? {
            let auto: AutoCordon = decode(&kv.key, &kv.value)?;
            let name = &kv.key[AUTO_CORDON_PREFIX.len()..];
            let cordoned = self
                .cluster
                .node_index(name)
                .is_some_and(|n| self.cluster.nodes()[n as usize].spec.cordoned);
            if !cordoned {
                tracing::warn!("{}: node {name} is not cordoned; ignored", kv.key);
                continue;
            }
            self.start_probation(name, auto.reason, now);
        }
        Ok(())
    }

    /// Reserves the next run numbers in the store, before any of them is
    /// handed out; until it can, no health check starts.
    fn reserve_runs(&mut self) {
        let upto = self.nodes.probation.last_run().saturating_add(RUN_BLOCK);
        match self.store.put(PROBATION_RUN_KEY, &encode(&upto)) {
            Ok(_) => self.nodes.probation.reserve(upto),
            Err(e) => tracing::warn!(
                "cannot reserve probation run numbers: {e}; no health check starts until then"
            ),
        }
    }

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
        if idle && self.nodes.probation.runs_spent() {
            self.reserve_runs();
        }
        let (ask, started) = self.nodes.probation.ask(node, now, idle);
        if shown || started {
            self.show_probation(node);
        }
        Ok((ask, back))
    }

    /// A node passed its health check: uncordoned, its evidence forgotten;
    /// under DiskPressure (which began during the run) the pressure's
    /// cordon takes over, lifted when the pressure goes (and, as every
    /// pressure's cordon, not stored: the store has the node uncordoned).
    fn back_in_service(&mut self, node: &str) -> Result<(), ControlError> {
        let (Some(n), Some((why, _))) = (
            self.cluster.node_index(node),
            self.nodes.disk_pressure.get(node),
        ) else {
            return self.cordon(node, false);
        };
        let why = why.clone();
        let mut spec = self.cluster.nodes()[n as usize].spec.clone();
        spec.cordoned = false;
        self.store.txn(
            &[],
            &[
                Op::Put(node_key(node), encode(&spec)),
                Op::Delete(auto_cordon_key(node)),
            ],
        )?;
        if let Some(p) = self.nodes.disk_pressure.get_mut(node) {
            p.1 = true;
        }
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
    use gangway_core::agent::{HealthCheckReport, HealthCheckResult};
    use gangway_core::{NodeSpec, QueueSpec};
    use gangway_store::RedbStore;

    const KNOBS: ProbationConfig = ProbationConfig {
        after_seconds: 10,
        max_backoff_seconds: 3600,
    };

    /// The control state loaded from the store in `dir` at `now`, as a
    /// leader (the first, a restarted or a new one) loads it.
    fn open(dir: &std::path::Path, now: Time) -> Control<RedbStore> {
        let store = RedbStore::open(&dir.join("s.redb")).expect("store");
        let queues = [QueueSpec::unlimited("q", None)];
        let mut c = Control::open_at(store, &queues, now).expect("control");
        c.load_auto_cordons(KNOBS, now).expect("auto cordons");
        c
    }

    fn control(dir: &std::path::Path) -> Control<RedbStore> {
        let mut c = open(dir, 0);
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

    fn cordoned(c: &Control<RedbStore>) -> bool {
        c.cluster.nodes()[0].spec.cordoned
    }

    /// The node's automatic cordon as stored, and its spec's `cordoned`.
    fn stored(c: &Control<RedbStore>) -> (Option<AutoCordon>, bool) {
        let auto = c
            .store
            .get(&auto_cordon_key("n"))
            .expect("get")
            .map(|kv| serde_json::from_slice(&kv.value).expect("record"));
        let spec = c.store.get(&node_key("n")).expect("get").expect("node");
        let spec: NodeSpec = serde_json::from_slice(&spec.value).expect("spec");
        (auto, spec.cordoned)
    }

    #[test]
    fn an_auto_cordon_and_its_probation_survive_a_restart() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path());
        let (auto, spec_cordoned) = stored(&c);
        let auto = auto.expect("the auto-cordon is recorded");
        assert!(spec_cordoned);
        assert_eq!((auto.by.as_str(), auto.at), ("blame", 0));
        assert!(auto.reason.starts_with("cordoned automatically at 0: "));
        // This leader asks for run 1, and stops before its result comes.
        assert_eq!(sync(&mut c, 10, None, false), Some(1));
        drop(c);
        let mut c = open(d.path(), 100);
        assert!(cordoned(&c));
        assert!(reason(&c).starts_with(&auto.reason), "{}", reason(&c));
        // The earlier leader's run passing lifts nothing, nor is it due yet.
        assert_eq!(sync(&mut c, 105, Some((1, 0)), false), None);
        assert!(cordoned(&c));
        let due = format!("{}; probation: health check due at 110", auto.reason);
        assert!(reason(&c).starts_with(&due), "{}", reason(&c));
        // The new leader's runs go above every number the old one reserved.
        assert_eq!(sync(&mut c, 110, None, false), Some(1025));
        assert_eq!(sync(&mut c, 111, Some((1025, 0)), false), None);
        assert!(!cordoned(&c));
        assert_eq!(stored(&c), (None, false), "no record left");
        drop(c);
        let c = open(d.path(), 200);
        assert!(!cordoned(&c));
        assert_eq!(reason(&c), "");
        assert_eq!(c.nodes.probation.phase("n"), None);
    }

    #[test]
    fn an_admins_cordon_or_uncordon_leaves_no_record_and_stays_the_admins() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path());
        c.cordon("n", true).expect("admin cordon");
        assert_eq!(stored(&c), (None, true));
        drop(c);
        // Reopened: an admin's cordon, as a store from before records shows.
        let mut c = open(d.path(), 100);
        assert!(cordoned(&c));
        assert_eq!(reason(&c), "");
        assert_eq!(sync(&mut c, 100_000, None, false), None);
        assert!(cordoned(&c), "never lifted by probation");
        c.cordon("n", false).expect("admin uncordon");
        drop(c);
        let c = open(d.path(), 200);
        assert!(!cordoned(&c));
        assert_eq!(c.nodes.probation.phase("n"), None);
    }

    #[test]
    fn a_deleted_nodes_record_goes_with_it() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path());
        c.delete_node("n", 1).expect("delete");
        assert_eq!(
            c.store
                .range(crate::records::AUTO_CORDON_PREFIX)
                .expect("range"),
            vec![]
        );
    }

    #[test]
    fn with_probation_off_a_restart_keeps_the_reason_and_asks_nothing() {
        let d = tempfile::tempdir().expect("tmp");
        let c = control(d.path());
        drop(c);
        let mut c = open(d.path(), 100);
        let off = ProbationConfig {
            after_seconds: 0,
            ..KNOBS
        };
        c.load_auto_cordons(off, 100).expect("reload");
        assert!(reason(&c).starts_with("cordoned automatically at 0: "));
        assert!(!reason(&c).contains("probation"), "{}", reason(&c));
        assert_eq!(sync(&mut c, 100_000, None, false), None);
        assert!(cordoned(&c));
    }

    #[test]
    fn disk_pressures_cordon_is_never_stored_and_comes_back_with_the_pressure() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path());
        assert_eq!(sync(&mut c, 11, None, false), Some(1));
        // Passes under pressure: the pressure's cordon takes over, unstored.
        assert_eq!(sync(&mut c, 12, Some((1, 0)), true), None);
        assert!(cordoned(&c));
        assert_eq!(stored(&c), (None, false));
        // A GPU health change stores the spec: still not cordoned there.
        c.set_gpu_health("n", 0, false).expect("gpu");
        assert_eq!(stored(&c), (None, false));
        drop(c);
        let mut c = open(d.path(), 100);
        assert!(!cordoned(&c), "until the agent reports again");
        sync(&mut c, 101, None, true);
        assert!(cordoned(&c));
        assert_eq!(reason(&c), "DiskPressure: 3 % free");
        sync(&mut c, 102, None, false);
        assert!(!cordoned(&c));
    }

    #[test]
    fn an_admins_cordon_under_disk_pressure_outlasts_the_pressure() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path());
        c.cordon("n", false).expect("admin uncordon");
        sync(&mut c, 1, None, true);
        assert!(cordoned(&c));
        c.cordon("n", true).expect("admin cordon");
        sync(&mut c, 2, None, false);
        assert!(cordoned(&c), "the admin's cordon stays");
        assert_eq!(stored(&c), (None, true));
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
