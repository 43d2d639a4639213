//! What a node should run, in two steps: [`Control::node_work`] takes,
//! under the state lock, the live job attempts placed on the node (their
//! records shared, not copied) and what each needs from the rest of the
//! state (rendezvous address and port); [`NodeWork::build`] makes the
//! [`Assignment`]s from them after the lock is released. The build copies
//! each job's name, command, environment and paths: at 10,000 agents
//! syncing every second it was a third of a sync's time under the lock,
//! time in which no submission, cycle or other sync could run.
//! Records are immutable once shared, so the build sees exactly the state
//! the lock saw.

use super::contract::checkpoint_subdir_of;
use super::{Control, SHORT_GRACE_SECONDS};
use crate::records::JobRecord;
use gangway_core::agent::{
    Assignment, CheckpointCleanup, GangNode, PortRange, RankAssignment, SyncResponse,
};
use gangway_core::{signal_number, JobState};
use gangway_store::Store;
use std::sync::Arc;

/// One live attempt placed on the node, as the lock saw it.
struct Placed {
    rec: Arc<JobRecord>,
    /// The node's index among the gang's nodes.
    node_rank: u32,
    /// How many nodes the gang spans.
    nnodes: u32,
    /// Where rank 0 listens (its node's advertised address, else its name).
    master_addr: String,
    master_port: u16,
    stop_now: bool,
    /// The gang's nodes' addresses (else names) in node-rank order, when
    /// the agent reads them.
    hosts: Vec<String>,
}

/// A node's assignments as taken under the state lock, to be built after.
pub struct NodeWork {
    node: String,
    placed: Vec<Placed>,
    checkpoint_root: Option<String>,
    /// The cluster's rendezvous ports (each assignment carries them), for
    /// agents that read them.
    rendezvous_ports: Option<PortRange>,
}

/// A gang's nodes with their rank counts (the hostfiles' slots), in the
/// order of `hosts`, which lists the gang's nodes by node rank.
fn gang_nodes(rec: &JobRecord, hosts: Vec<String>) -> Vec<GangNode> {
    if hosts.is_empty() {
        return Vec::new();
    }
    let names = rec.nodes();
    let mut slots = vec![0u32; names.len()];
    for r in &rec.placement {
        if let Some(i) = names.iter().position(|n| *n == r.node.as_str()) {
            slots[i] = slots[i].saturating_add(1);
        }
    }
    hosts
        .into_iter()
        .zip(slots)
        .map(|(host, slots)| GangNode { host, slots })
        .collect()
}

/// A sync's answer before its assignments are built.
pub struct SyncAnswer {
    /// What should run on the node.
    pub work: NodeWork,
    /// Checkpoint directories to remove.
    pub cleanup: Vec<CheckpointCleanup>,
    /// The health check run to ask the node's agent for (probation).
    pub health_check: Option<u64>,
}

impl SyncAnswer {
    /// The answer of a node that has nothing to run (waiting for approval).
    pub fn idle(node: &str) -> Self {
        SyncAnswer {
            work: NodeWork {
                node: node.to_string(),
                placed: Vec::new(),
                checkpoint_root: None,
                rendezvous_ports: None,
            },
            cleanup: Vec::new(),
            health_check: None,
        }
    }

    /// The wire answer: builds the assignments (call it without the lock).
    pub fn into_response(self) -> SyncResponse {
        SyncResponse {
            assignments: self.work.build(),
            cleanup: self.cleanup,
            health_check: self.health_check,
        }
    }
}

impl NodeWork {
    /// The assignments, in job order: one per live attempt, with the ranks
    /// it runs here.
    pub fn build(self) -> Vec<Assignment> {
        let node = self.node.as_str();
        self.placed
            .into_iter()
            .map(|p| {
                let rec = &*p.rec;
                let mut ranks = Vec::new();
                for (rank, r) in rec.placement.iter().enumerate() {
                    if r.node == node {
                        ranks.push(RankAssignment {
                            rank: rank as u32,
                            local_rank: ranks.len() as u32,
                            gpus: r.gpus.clone(),
                        });
                    }
                }
                Assignment {
                    job: rec.id,
                    attempt: rec.attempt,
                    name: rec.spec.name.clone(),
                    user: rec.user.clone(),
                    run: rec.spec.run.clone(),
                    ranks,
                    world_size: rec.placement.len() as u32,
                    node_rank: p.node_rank,
                    nnodes: p.nnodes,
                    master_addr: p.master_addr,
                    master_port: p.master_port,
                    cpu_millis: rec.spec.resources.cpu_millis,
                    memory_mib: rec.spec.resources.memory_mib,
                    checkpoint_signal: signal_number(&rec.spec.checkpoint.signal).unwrap_or(15),
                    grace_seconds: if rec.state == JobState::Preempting {
                        rec.spec.checkpoint.grace_seconds
                    } else {
                        rec.spec.checkpoint.grace_seconds.min(SHORT_GRACE_SECONDS)
                    },
                    stop: rec.state == JobState::Preempting || rec.stopping.is_some(),
                    // Who runs it and the queue's node policy: see `admission::stamp`.
                    rules: gangway_core::agent::RankRules {
                        queue: rec.spec.queue.clone(),
                        ..Default::default()
                    },
                    stop_now: p.stop_now,
                    checkpoint_root: self.checkpoint_root.clone(),
                    checkpoint_subdir: checkpoint_subdir_of(rec),
                    resume_from: rec.checkpoint.as_ref().map(|c| c.path.clone()),
                    max_restarts: rec.spec.restart.max_restarts,
                    array: rec.array.clone(),
                    restart_count: Some(rec.attempt.saturating_sub(rec.port_moves)),
                    rendezvous_ports: self.rendezvous_ports,
                    nodes: gang_nodes(rec, p.hosts),
                }
            })
            .collect()
    }
}

impl<S: Store> Control<S> {
    /// What should run on `node`, taken now and built by
    /// [`NodeWork::build`] (after the lock is released, where it matters):
    /// each live job attempt placed there whose ranks on it have not
    /// exited, with the gang's rendezvous.
    pub fn node_work(&self, node: &str) -> NodeWork {
        self.node_work_with(node, true)
    }

    /// [`Control::node_work`], with the gang's node list only when
    /// `with_nodes` (an older agent refuses the field).
    fn node_work_with(&self, node: &str, with_nodes: bool) -> NodeWork {
        let mut placed = Vec::new();
        if let Some(n) = self.cluster.node_index(node) {
            // A job is listed once per replica on the node.
            let mut ids = self.cluster.jobs_on(n).to_vec();
            ids.sort();
            ids.dedup();
            for id in ids {
                let Some((rec, _)) = self.jobs.get(&id) else {
                    continue;
                };
                let live = matches!(
                    rec.state,
                    JobState::Scheduled | JobState::Running | JobState::Preempting
                );
                if !live || rec.exited_on.contains_key(node) {
                    continue;
                }
                let nodes = rec.nodes();
                let Some(node_rank) = nodes.iter().position(|x| *x == node) else {
                    continue;
                };
                let address_of = |name: &str| {
                    self.cluster
                        .node_index(name)
                        .map(|i| self.cluster.nodes()[i as usize].spec.address.clone())
                        .filter(|a| !a.is_empty())
                        .unwrap_or_else(|| name.to_string())
                };
                let master_addr = address_of(&rec.placement[0].node);
                let hosts = if with_nodes {
                    nodes.iter().map(|n| address_of(n)).collect()
                } else {
                    Vec::new()
                };
                placed.push(Placed {
                    rec: rec.clone(),
                    node_rank: node_rank as u32,
                    nnodes: nodes.len() as u32,
                    master_addr,
                    master_port: self.port_of(rec),
                    stop_now: Self::stop_now(rec),
                    hosts,
                });
            }
        }
        NodeWork {
            node: node.to_string(),
            checkpoint_root: if placed.is_empty() {
                None
            } else {
                self.contract.config.checkpoint_root.clone()
            },
            rendezvous_ports: Some(self.contract.config.master_ports),
            placed,
        }
    }

    /// [`Control::node_work`] for an agent that does (`reads_range`) or does
    /// not read the rendezvous range, and does (`reads_nodes`) or does not
    /// read the gang's node list: an older agent refuses either field.
    pub fn node_work_for(&self, node: &str, reads_range: bool, reads_nodes: bool) -> NodeWork {
        let mut w = self.node_work_with(node, reads_nodes);
        if !reads_range {
            w.rendezvous_ports = None;
        }
        w
    }

    /// Everything that should run on `node`, built at once (tests, tools).
    pub fn assignments(&self, node: &str) -> Vec<Assignment> {
        self.node_work(node).build()
    }
}

#[cfg(test)]
mod tests {
    use gangway_core::{JobSpec, NodeSpec, QueueSpec};
    use gangway_store::RedbStore;

    #[test]
    fn work_taken_under_the_lock_builds_the_state_it_saw_not_a_later_one() {
        let d = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&d.path().join("s.redb")).expect("store");
        let mut c =
            super::Control::open(store, &[QueueSpec::unlimited("q", None)]).expect("control");
        let mut n = NodeSpec::uniform("n", "l", "s", 8, "H100", 80);
        n.address = "10.0.0.1".into();
        c.register_node(n, &crate::nodes::Registrant::Join, true, "join", 10)
            .expect("node");
        let id = c
            .submit("alice", JobSpec::new("j", "q", 2, 1), 10)
            .expect("submit");
        c.cycle(11).expect("cycle");
        let taken = c.node_work("n");
        let before = c.assignments("n");
        // Changed after the work was taken: a cancel stops the gang.
        c.cancel(id, "alice", 12).expect("cancel");
        let built = taken.build();
        assert_eq!(built, before, "built from the records as the lock saw them");
        assert_eq!(built.len(), 1);
        let a = &built[0];
        assert_eq!((a.job, a.world_size, a.ranks.len()), (id, 2, 2));
        assert_eq!((a.master_addr.as_str(), a.node_rank), ("10.0.0.1", 0));
        assert!(!a.stop, "not yet cancelled when taken");
        let now = c.assignments("n");
        assert!(now[0].stop, "a fresh take sees the cancel");
        assert!(c.node_work("missing").build().is_empty());
    }

    #[test]
    fn the_rendezvous_range_goes_only_to_agents_that_read_it() {
        let d = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&d.path().join("s.redb")).expect("store");
        let mut c =
            super::Control::open(store, &[QueueSpec::unlimited("q", None)]).expect("control");
        let n = NodeSpec::uniform("n", "l", "s", 8, "H100", 80);
        c.register_node(n, &crate::nodes::Registrant::Join, true, "join", 10)
            .expect("node");
        c.submit("alice", JobSpec::new("j", "q", 1, 1), 10)
            .expect("submit");
        c.cycle(11).expect("cycle");
        let old = gangway_core::agent::SyncRequest::default();
        let (answer, _) = c.sync("n", &old, 12).expect("sync");
        let built = answer.work.build();
        assert_eq!(built.len(), 1);
        assert_eq!(
            built[0].rendezvous_ports, None,
            "an older agent refuses the field"
        );
        let json = serde_json::to_string(&built[0]).expect("json");
        assert!(!json.contains("rendezvous_ports"), "{json}");
        let new = gangway_core::agent::SyncRequest {
            reads_rendezvous_ports: true,
            ..Default::default()
        };
        let (answer, _) = c.sync("n", &new, 13).expect("sync");
        assert_eq!(
            answer.work.build()[0].rendezvous_ports,
            Some(gangway_core::agent::PortRange::default())
        );
    }

    #[test]
    fn the_gangs_node_list_goes_only_to_agents_that_read_it_in_node_rank_order() {
        let d = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&d.path().join("s.redb")).expect("store");
        let mut c =
            super::Control::open(store, &[QueueSpec::unlimited("q", None)]).expect("control");
        for (name, addr) in [("a", "10.0.0.1"), ("b", "")] {
            let mut n = NodeSpec::uniform(name, "l", "s", 2, "H100", 80);
            n.address = addr.into();
            c.register_node(n, &crate::nodes::Registrant::Join, true, "join", 10)
                .expect("node");
        }
        c.submit("alice", JobSpec::new("j", "q", 4, 1), 10)
            .expect("submit");
        c.cycle(11).expect("cycle");
        let new = gangway_core::agent::SyncRequest {
            reads_gang_nodes: true,
            ..Default::default()
        };
        let mut seen = Vec::new();
        for node in ["a", "b"] {
            let (answer, _) = c.sync(node, &new, 12).expect("sync");
            let built = answer.work.build();
            assert_eq!(built.len(), 1, "{node}");
            let a = &built[0];
            let hosts: Vec<(String, u32)> =
                a.nodes.iter().map(|n| (n.host.clone(), n.slots)).collect();
            // Node-rank order: this node is at its NODE_RANK; a node with no
            // address is listed by name.
            let me = if node == "a" { "10.0.0.1" } else { "b" };
            assert_eq!(hosts.len(), 2, "{hosts:?}");
            assert_eq!(
                hosts[a.node_rank as usize],
                (me.to_string(), 2),
                "{hosts:?}"
            );
            seen.push(hosts);
            let old = gangway_core::agent::SyncRequest::default();
            let (answer, _) = c.sync(node, &old, 13).expect("sync");
            let json = serde_json::to_string(&answer.work.build()[0]).expect("json");
            assert!(
                !json.contains("\"nodes\""),
                "an older agent refuses it: {json}"
            );
        }
        assert_eq!(seen[0], seen[1], "every node gets the same list");
    }
}
