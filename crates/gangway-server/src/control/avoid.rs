//! A gang restarted or requeued after a node fault (see [`crate::blame`])
//! avoids the nodes blamed for it on its next attempt, as Slurm's
//! `--requeue=expedite` holds the old nodes back. The avoidance is kept on
//! the job's record (a server restart keeps it), given to the scheduler
//! whenever the job enters it, lapses after `avoid_node_seconds` (so a gang
//! only those nodes can host still runs, after that wait) and is cleared
//! once the next attempt runs.

use super::{AfterEnd, Control, ControlError, Ending};
use crate::records::{AvoidNodes, JobEvent, JobRecord};
use gangway_core::{JobId, JobState, Time};
use gangway_sched::Avoid;
use gangway_store::Store;

impl<S: Store> Control<S> {
    /// [`super::ended`], and when the job goes back in line (restart or
    /// requeue), the nodes its next attempt avoids, with an event saying so.
    pub(crate) fn ended_avoiding(
        &mut self,
        rec: JobRecord,
        ending: Ending,
        now: Time,
    ) -> (JobRecord, AfterEnd) {
        let (mut rec, after) = super::ended(rec, ending, now);
        if matches!(after, AfterEnd::Finish) {
            return (rec, after);
        }
        // It may be placed again once its backoff passes: the time counts from then.
        let from = rec.restart_at.unwrap_or(now);
        rec.avoid = self
            .nodes
            .blame
            .take_avoid(rec.id, from)
            .map(|(nodes, until)| AvoidNodes {
                because: None,
                nodes: nodes.into_iter().collect(),
                until,
            });
        if let Some(a) = &rec.avoid {
            let s = if a.nodes.len() == 1 { "" } else { "s" };
            rec.events.push(JobEvent::new(
                now,
                "avoiding",
                format!(
                    "its next attempt avoids node{s} {} (blamed for this failure) for {}s after it may start",
                    a.nodes.join(", "),
                    a.until.saturating_sub(from)
                ),
            ));
        }
        (rec, after)
    }

    /// Node `node` is back in service (it passed its health check, or an
    /// admin uncordoned it): jobs that avoided it for an earlier fault may
    /// use it again at once rather than wait for their avoidance to lapse.
    pub(crate) fn forgive_node(&mut self, node: &str, now: Time) -> Result<(), ControlError> {
        let avoiding: Vec<JobRecord> = self
            .jobs
            .in_states(&[JobState::Pending, JobState::Restarting])
            .into_iter()
            .filter(|r| {
                r.avoid
                    .as_ref()
                    .is_some_and(|a| a.nodes.iter().any(|n| n == node))
            })
            .map(|r| JobRecord::clone(r))
            .collect();
        for mut rec in avoiding {
            let id = rec.id;
            if let Some(a) = &mut rec.avoid {
                a.nodes.retain(|n| n != node);
            }
            if rec.avoid.as_ref().is_some_and(|a| a.nodes.is_empty()) {
                rec.avoid = None;
            }
            rec.events.push(JobEvent::new(
                now,
                "avoiding",
                format!("node {node} is back in service: no longer avoided"),
            ));
            self.write(rec)?;
            if self.cluster.job(id).is_some() {
                let _ = self.cluster.set_avoid(id, None);
                self.apply_avoid(id);
            }
        }
        Ok(())
    }

    /// Tells the scheduler the nodes job `id` avoids, from its record (after
    /// it entered the scheduler's state).
    pub(crate) fn apply_avoid(&mut self, id: JobId) {
        let Some(a) = self.jobs.get(&id).and_then(|(r, _)| r.avoid.clone()) else {
            return;
        };
        let nodes = a
            .nodes
            .iter()
            .filter_map(|n| self.cluster.node_index(n))
            .collect();
        let _ = self.cluster.set_avoid(
            id,
            Some(Avoid {
                nodes,
                until: a.until,
            }),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::Report;
    use super::*;
    use crate::blame::{Blame, BlameConfig};
    use gangway_core::agent::{GpuHealth, SyncRequest};
    use gangway_core::{JobSpec, JobState, NodeSpec, QueueSpec};
    use gangway_store::RedbStore;

    fn node(c: &mut Control<RedbStore>, name: &str, at: Time) {
        c.register_node(
            NodeSpec::uniform(name, "leaf0", "spine0", 4, "H100", 80),
            &crate::nodes::Registrant::Join,
            true,
            "join",
            at,
        )
        .expect("node");
    }

    fn open(path: &std::path::Path, at: Time) -> Control<RedbStore> {
        let store = RedbStore::open(path).expect("store");
        let mut c = Control::open_at(store, &[QueueSpec::unlimited("q", None)], at).expect("open");
        // Auto-cordon off: the node stays in service, so only the avoidance
        // keeps the job off it.
        c.nodes.blame = Blame::new(BlameConfig {
            enabled: false,
            avoid_seconds: 600,
            ..BlameConfig::default()
        });
        c
    }

    /// Node `a` and a one-GPU gang running on it (3 restarts, 5 s backoff):
    /// the job and its GPU.
    fn running_on_a(c: &mut Control<RedbStore>) -> (JobId, u32) {
        node(c, "a", 0);
        let mut spec = JobSpec::new("j", "q", 1, 1);
        spec.restart.max_restarts = 3;
        spec.restart.backoff_seconds = 5;
        let id = c.submit("alice", spec, 0).expect("submit");
        c.cycle(1).expect("cycle");
        c.report("a", id, Some(0), Report::Running, 2)
            .expect("running");
        (id, c.jobs[&id].0.placement[0].gpus[0])
    }

    /// A sync saying GPU `gpu` had a double-bit ECC error (XID 48).
    fn xid_48(gpu: u32) -> SyncRequest {
        SyncRequest {
            gpus: vec![GpuHealth {
                index: gpu,
                healthy: false,
                reason: Some("XID 48: double-bit ECC error".into()),
            }],
            ..Default::default()
        }
    }

    /// A one-GPU gang whose GPU faults (XID 48) restarts on the other node,
    /// although best fit would put it back beside its dead GPU; the
    /// avoidance is on the stored record (a server restart keeps it), lapses
    /// 600 s after the backoff, and is cleared once the attempt runs.
    #[test]
    fn a_gang_restarted_after_a_gpu_fault_avoids_its_node_across_a_server_restart() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("s.redb");
        let mut c = open(&path, 0);
        let (id, gpu) = running_on_a(&mut c);
        node(&mut c, "b", 3);
        let fault = xid_48(gpu);
        c.sync("a", &fault, 10).expect("sync");
        let rec = c.jobs[&id].0.clone();
        assert_eq!(rec.state, JobState::Restarting);
        let restart_at = rec.restart_at.expect("backoff");
        let avoid = rec.avoid.clone().expect("avoids its node");
        assert_eq!(avoid.nodes, vec!["a".to_string()]);
        assert_eq!(avoid.until, restart_at + 600);
        assert!(
            rec.events.iter().any(|e| e.kind == "avoiding"
                && e.message
                    .contains("avoids node a (blamed for this failure) for 600s")),
            "{:?}",
            rec.events
        );
        assert!(
            !c.cluster.nodes()[0].spec.cordoned,
            "auto-cordon is off here"
        );
        drop(c);
        // A server restart reads the avoidance back from the record.
        let mut c = open(&path, restart_at);
        let quiet = SyncRequest {
            gpus: Vec::new(),
            tasks: Vec::new(),
            disk_pressure: None,
            ..Default::default()
        };
        c.sync("a", &fault, restart_at).expect("sync");
        c.sync("b", &quiet, restart_at).expect("sync");
        assert_eq!(c.jobs[&id].0.avoid, Some(avoid));
        c.cycle(restart_at).expect("resume");
        c.cycle(restart_at + 1).expect("cycle");
        let rec = c.jobs[&id].0.clone();
        assert_eq!(rec.state, JobState::Scheduled, "{:?}", rec.events);
        assert_eq!(rec.placement[0].node, "b", "not the blamed node");
        c.report("b", id, Some(rec.attempt), Report::Running, restart_at + 2)
            .expect("running");
        assert_eq!(c.jobs[&id].0.avoid, None, "cleared once the attempt runs");
    }

    /// Where only the blamed node fits, the gang waits (saying so) and runs
    /// there once the avoidance lapses: never forever.
    #[test]
    fn a_gang_only_its_blamed_node_fits_runs_there_once_the_avoidance_lapses() {
        let dir = tempfile::tempdir().expect("tmp");
        let mut c = open(&dir.path().join("s.redb"), 0);
        let (id, gpu) = running_on_a(&mut c);
        let fault = xid_48(gpu);
        c.sync("a", &fault, 10).expect("sync");
        let until = c.jobs[&id].0.avoid.as_ref().expect("avoids").until;
        let at = c.jobs[&id].0.restart_at.expect("backoff");
        c.cycle(at).expect("resume");
        c.cycle(at + 1).expect("cycle");
        assert_eq!(c.jobs[&id].0.state, JobState::Pending);
        let why = c.view.why.get(&id).expect("explained");
        assert_eq!(why.code(), gangway_core::ReasonCode::ReqNodeNotAvail);
        assert!(
            why.render(&c.cluster, at + 1)
                .starts_with("avoiding node a after its fault until t+"),
            "{}",
            why.render(&c.cluster, at + 1)
        );
        c.sync("a", &fault, until - 1).expect("heartbeat");
        c.cycle(until - 1).expect("cycle");
        assert_eq!(c.jobs[&id].0.state, JobState::Pending);
        c.sync("a", &fault, until).expect("heartbeat");
        c.cycle(until).expect("cycle");
        let rec = &c.jobs[&id].0;
        assert_eq!(rec.state, JobState::Scheduled, "{:?}", rec.events);
        assert_eq!(rec.placement[0].node, "a");
        assert_ne!(rec.placement[0].gpus[0], gpu, "not the faulty GPU");
    }

    /// A node back in service (an admin's uncordon, or a passed health
    /// check, which uncordons the same way) is no longer avoided: the job
    /// runs there at once, not when its avoidance lapses.
    #[test]
    fn a_node_back_in_service_is_no_longer_avoided() {
        let dir = tempfile::tempdir().expect("tmp");
        let mut c = open(&dir.path().join("s.redb"), 0);
        let (id, gpu) = running_on_a(&mut c);
        let fault = xid_48(gpu);
        c.sync("a", &fault, 10).expect("sync");
        let at = c.jobs[&id].0.restart_at.expect("backoff");
        c.cycle(at).expect("resume");
        c.cycle(at + 1).expect("cycle");
        assert_eq!(c.jobs[&id].0.state, JobState::Pending);
        c.cordon("a", true).expect("cordon");
        c.cordon("a", false).expect("uncordon");
        assert!(c.jobs[&id].0.avoid.is_none(), "forgiven");
        c.sync("a", &fault, at + 2).expect("heartbeat");
        c.cycle(at + 2).expect("cycle");
        let rec = &c.jobs[&id].0;
        assert_eq!(rec.state, JobState::Scheduled, "{:?}", rec.events);
        assert_eq!(rec.placement[0].node, "a");
        assert!(
            rec.events
                .iter()
                .any(|e| e.message.contains("node a is back in service")),
            "{:?}",
            rec.events
        );
    }
}
