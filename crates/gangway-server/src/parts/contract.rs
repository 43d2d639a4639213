//! The job contract's part of the control state: its knobs (rendezvous
//! ports, checkpoint root) and what it keeps in memory besides the
//! records: ports found busy, rank failures waiting for their exit, and
//! checkpoint directories to remove.

use crate::config::ContractConfig;
use gangway_core::agent::{CheckpointCleanup, RankFailure};
use gangway_core::{JobId, Time};
use std::collections::HashMap;

/// How long a port found busy on a node is avoided there: long enough for a
/// foreign listener to be noticed and for TIME_WAIT sockets (60 s on Linux)
/// to go.
pub const BLOCKED_PORT_SECONDS: u64 = 600;

/// Port moves of one job on one node before it is requeued to avoid that
/// node: each move waited out its backoff, so something Gangway cannot stop
/// holds port after port there.
pub const MAX_PORT_MOVES_PER_NODE: u32 = 8;

/// Longest wait between two port moves of a job (the wait doubles from 1 s).
pub const MAX_PORT_MOVE_BACKOFF_SECONDS: u64 = 60;

/// How long a job requeued for busy ports avoids the node.
pub const PORT_AVOID_SECONDS: u64 = 600;

/// Most busy ports named per job (the requeue event lists them).
const MAX_PORTS_NAMED: usize = MAX_PORT_MOVES_PER_NODE as usize;

/// A job's port moves on its rank-0 node (in memory: a server restart
/// starts the count again, still bounded).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PortMoves {
    /// The node.
    pub node: String,
    /// Moves there so far.
    pub moves: u32,
    /// No move before this time (the backoff).
    pub next_at: Time,
    /// The ports found busy there.
    pub ports: Vec<u16>,
}

impl PortMoves {
    /// Counts a move at `now` of a job off `port` and sets the wait
    /// before the next one: 1 s, doubling to a minute.
    pub fn moved(&mut self, port: u16, now: Time) {
        self.moves = self.moves.saturating_add(1);
        let wait = 1u64
            .checked_shl(self.moves.saturating_sub(1))
            .unwrap_or(u64::MAX)
            .min(MAX_PORT_MOVE_BACKOFF_SECONDS);
        self.next_at = now.saturating_add(wait);
        if self.ports.len() < MAX_PORTS_NAMED && !self.ports.contains(&port) {
            self.ports.push(port);
        }
    }
}

/// What the contract keeps in memory besides the records.
#[derive(Debug, Default)]
pub struct ContractState {
    /// Ports found held by other processes, per node, with when.
    pub blocked_ports: HashMap<String, HashMap<u16, Time>>,
    /// Rank failures reported with an exit, until the exit is applied.
    pub failures: HashMap<(JobId, u32, String), RankFailure>,
    /// Checkpoint directories to remove, per node (handed out once).
    pub cleanup: HashMap<String, Vec<CheckpointCleanup>>,
    /// Per job, its port moves on its rank-0 node.
    pub port_moves: HashMap<JobId, PortMoves>,
}

/// The job contract: its knobs and its in-memory state.
#[derive(Debug, Default)]
pub struct Contract {
    /// Job-contract knobs (ports, checkpoint root).
    pub config: ContractConfig,
    /// Job-contract state kept in memory.
    pub state: ContractState,
}

impl Contract {
    /// The ports of `node` found busy less than [`BLOCKED_PORT_SECONDS`]
    /// before `now`.
    pub fn blocked_on(&self, node: &str, now: Time) -> impl Iterator<Item = u16> + '_ {
        self.state
            .blocked_ports
            .get(node)
            .into_iter()
            .flatten()
            .filter(move |(_, at)| now.saturating_sub(**at) < BLOCKED_PORT_SECONDS)
            .map(|(p, _)| *p)
    }

    /// `port` of `node` was found held by another process at `now`: it is
    /// avoided there for a while. Ports blocked long ago are forgotten.
    pub fn block_port(&mut self, node: &str, port: u16, now: Time) {
        self.state
            .blocked_ports
            .entry(node.to_string())
            .or_default()
            .insert(port, now);
        for ports in self.state.blocked_ports.values_mut() {
            ports.retain(|_, at| now.saturating_sub(*at) < BLOCKED_PORT_SECONDS);
        }
    }

    /// The port moves of `id` on `node` (a fresh count when it moved on
    /// another node before).
    pub fn port_moves(&mut self, id: JobId, node: &str) -> &mut PortMoves {
        let m = self.state.port_moves.entry(id).or_default();
        if m.node != node {
            *m = PortMoves {
                node: node.to_string(),
                ..PortMoves::default()
            };
        }
        m
    }

    /// Forgets a job's port moves (it ran, or ended).
    pub fn forget_port_moves(&mut self, id: JobId) {
        self.state.port_moves.remove(&id);
    }

    /// The port an attempt of `id` gets when its record names none (records
    /// from before ports were recorded): derived from the range.
    pub fn derived_port(&self, id: JobId, attempt: u32) -> u16 {
        let ports = &self.config.master_ports;
        ports.pick(id, attempt, &|_| false).unwrap_or(ports.first)
    }

    /// Keeps a node's report of its first failed rank until the exit it
    /// comes with is applied.
    pub fn stash_failure(&mut self, node: &str, id: JobId, attempt: u32, f: &RankFailure) {
        self.state
            .failures
            .insert((id, attempt, node.to_string()), f.clone());
    }

    /// The failure `node` reported for this attempt of `id`, taken.
    pub fn take_failure(&mut self, id: JobId, attempt: u32, node: &str) -> Option<RankFailure> {
        self.state.failures.remove(&(id, attempt, node.to_string()))
    }

    /// Drops what nodes reported about failures of a job whose attempt ended.
    pub fn forget_failures(&mut self, id: JobId) {
        self.state.failures.retain(|(j, _, _), _| *j != id);
    }

    /// Queues the removal of a succeeded job's checkpoint directory
    /// `subdir`: by the first node it ran on when the root is shared, by
    /// every node it ran on (`ran_on`, once each) otherwise.
    pub fn queue_cleanup(&mut self, job: JobId, subdir: String, ran_on: &[String]) {
        let item = CheckpointCleanup {
            job,
            root: self.config.checkpoint_root.clone(),
            subdir,
        };
        let mut nodes: Vec<&String> = Vec::new();
        for n in ran_on {
            if !nodes.contains(&n) {
                nodes.push(n);
            }
        }
        if self.config.checkpoint_root.is_some() {
            nodes.truncate(1);
        }
        for n in nodes {
            self.state
                .cleanup
                .entry(n.clone())
                .or_default()
                .push(item.clone());
        }
    }

    /// The cleanups queued for `node`, handed out once.
    pub fn take_cleanup(&mut self, node: &str) -> Vec<CheckpointCleanup> {
        self.state.cleanup.remove(node).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::agent::PortRange;

    fn failure(rank: u32) -> RankFailure {
        RankFailure {
            rank,
            exit_code: 1,
            signal: None,
            oom_killed: false,
            log_tail: vec![],
            node_fault: None,
            limit: None,
            unknown_exit: false,
        }
    }

    #[test]
    fn a_busy_port_is_avoided_for_a_while_then_forgotten() {
        let mut c = Contract::default();
        c.block_port("a", 29500, 100);
        c.block_port("b", 29501, 100);
        assert_eq!(c.blocked_on("a", 100).collect::<Vec<_>>(), vec![29500]);
        assert_eq!(c.blocked_on("c", 100).count(), 0);
        let later = 100 + BLOCKED_PORT_SECONDS;
        assert_eq!(c.blocked_on("a", later - 1).count(), 1);
        assert_eq!(c.blocked_on("a", later).count(), 0);
        // Blocking another port later forgets the old ones everywhere.
        c.block_port("a", 29502, later);
        assert_eq!(c.state.blocked_ports["a"].len(), 1);
        assert!(c.state.blocked_ports["b"].is_empty());
    }

    #[test]
    fn a_derived_port_is_in_the_range_and_an_empty_range_gives_its_first() {
        let mut c = Contract::default();
        c.config.master_ports = PortRange {
            first: 40000,
            last: 40009,
        };
        let p = c.derived_port(JobId(7), 0);
        assert!((40000..=40009).contains(&p), "{p}");
        assert_eq!(p, c.derived_port(JobId(7), 0));
        c.config.master_ports = PortRange {
            first: 40001,
            last: 40000,
        };
        assert_eq!(c.derived_port(JobId(7), 0), 40001);
    }

    #[test]
    fn failures_are_kept_per_attempt_and_node_until_taken_or_forgotten() {
        let mut c = Contract::default();
        c.stash_failure("a", JobId(1), 0, &failure(3));
        c.stash_failure("b", JobId(1), 0, &failure(4));
        c.stash_failure("a", JobId(2), 1, &failure(5));
        assert_eq!(c.take_failure(JobId(1), 1, "a"), None);
        assert_eq!(c.take_failure(JobId(1), 0, "a").map(|f| f.rank), Some(3));
        assert_eq!(c.take_failure(JobId(1), 0, "a"), None);
        c.forget_failures(JobId(1));
        assert_eq!(c.take_failure(JobId(1), 0, "b"), None);
        assert_eq!(c.take_failure(JobId(2), 1, "a").map(|f| f.rank), Some(5));
    }

    #[test]
    fn cleanup_goes_to_each_node_once_or_to_the_first_with_a_shared_root() {
        let mut c = Contract::default();
        let ran = ["a".to_string(), "b".to_string(), "a".to_string()];
        c.queue_cleanup(JobId(1), "u/1".into(), &ran);
        assert_eq!(c.take_cleanup("a").len(), 1);
        assert_eq!(c.take_cleanup("a").len(), 0, "handed out once");
        assert_eq!(c.take_cleanup("b")[0].subdir, "u/1");
        c.config.checkpoint_root = Some("/ckpt".into());
        c.queue_cleanup(JobId(2), "u/2".into(), &ran);
        let a = c.take_cleanup("a");
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].root.as_deref(), Some("/ckpt"));
        assert!(c.take_cleanup("b").is_empty());
    }
}
