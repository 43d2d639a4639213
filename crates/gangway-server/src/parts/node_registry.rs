//! The node registry: who the nodes are and what the server knows of them
//! besides their specs (which the scheduler's state holds): credentials,
//! nodes waiting for approval, heartbeats and the lifecycle knobs, lost
//! nodes, blame and its decisions, disk pressure, why a node was cordoned
//! automatically, and the agents' last GPU verdicts.

use crate::authz::TokenHash;
use crate::blame::{Blame, Decision};
use crate::config::NodeLifecycle;
use crate::heartbeats::Heartbeats;
use crate::nodes::NodeCredential;
use crate::view::{NodeCredentials, NodeTokens};
use gangway_core::{NodeSpec, Time};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Everything the server keeps per node outside the scheduler's state.
#[derive(Debug)]
pub struct NodeRegistry {
    /// Per-node credentials (token digests) handed out at registration.
    /// (A persistent map, shared with the read view: the log relay reads it.)
    pub tokens: NodeCredentials,
    /// Node names by their token's digest (authentication).
    /// (A persistent map: the read view shares it, so authenticating a node
    /// takes no lock.)
    pub by_token: NodeTokens,
    /// Nodes that joined with the join token and wait for an admin's approval.
    pub pending: BTreeMap<String, NodeSpec>,
    /// Node lifecycle knobs.
    pub lifecycle: NodeLifecycle,
    /// Last heartbeat per node, indexed by time (in memory: a restarted
    /// server gives every node a fresh grace period from when it loaded
    /// the state, [`Heartbeats::opened_at`]).
    pub heartbeats: Heartbeats,
    /// Nodes whose gangs were already treated as lost.
    pub lost: HashSet<String>,
    /// Which failures count against which node, and when a node is
    /// cordoned for them (see [`crate::blame`]).
    pub blame: Blame,
    /// What blame did since the API last took it: (node or `cluster`,
    /// what), for the audit log and metrics.
    pub blame_log: Vec<Decision>,
    /// Nodes under DiskPressure as their agents report it: why, and whether
    /// the pressure cordoned the node (in memory only: lifted with it).
    pub disk_pressure: HashMap<String, (String, bool)>,
    /// Why a node was cordoned automatically.
    pub cordon_reasons: HashMap<String, String>,
    /// Auto-cordoned nodes' way back to service (see [`crate::probation`]).
    pub probation: crate::probation::Probation,
    /// The agents' last verdict per GPU.
    pub(crate) reported_health: HashMap<String, BTreeMap<u32, bool>>,
    /// Seconds between cycles when nothing changes (the stall detector's period).
    pub cycle_seconds: u64,
    /// When the last cycle ran: a longer gap is the server's own stall, not
    /// the nodes' silence.
    pub(crate) last_cycle_at: Option<Time>,
}

impl NodeRegistry {
    /// An empty registry whose nodes, never heard from, count their silence
    /// from `opened_at`.
    pub fn new(opened_at: Time) -> Self {
        NodeRegistry {
            tokens: NodeCredentials::new(),
            by_token: NodeTokens::new(),
            pending: BTreeMap::new(),
            lifecycle: NodeLifecycle::default(),
            heartbeats: Heartbeats::new(opened_at),
            lost: HashSet::new(),
            blame: Blame::default(),
            blame_log: Vec::new(),
            disk_pressure: HashMap::new(),
            cordon_reasons: HashMap::new(),
            probation: Default::default(),
            reported_health: HashMap::new(),
            cycle_seconds: 1,
            last_cycle_at: None,
        }
    }

    /// The node whose token has digest `h`.
    pub fn node_of_token(&self, h: &TokenHash) -> Option<&str> {
        self.by_token.get(h).map(String::as_str)
    }

    /// Keeps `cred` as `name`'s credential (found by its digest too).
    pub fn add_credential(&mut self, name: &str, cred: NodeCredential) {
        self.by_token.insert(cred.digest(), name.to_string());
        self.tokens.insert(name.to_string(), cred);
    }

    /// A node is gone (deleted): its credential stops working and what was
    /// known of it is dropped, so its name may join afresh.
    pub fn forget(&mut self, name: &str) {
        if let Some(c) = self.tokens.remove(name) {
            self.by_token.remove(&c.digest());
        }
        self.heartbeats.forget(name);
        self.lost.remove(name);
        self.blame.forget_node(name);
        self.probation.end(name);
        self.cordon_reasons.remove(name);
        self.reported_health.remove(name);
    }

    /// An approved node's agent was heard from at `now`: its silence ends,
    /// and a node treated as lost is no longer.
    pub fn heard(&mut self, name: &str, now: Time) {
        self.heartbeats.heard(name, now);
        self.lost.remove(name);
    }

    /// What blame decided since this was last called (for the audit log
    /// and metrics), taken.
    pub fn take_blame_log(&mut self) -> Vec<Decision> {
        std::mem::take(&mut self.blame_log)
    }

    /// `name`'s agent reports DiskPressure (`why`); `cordoned_by_it`: the
    /// pressure cordoned the node (it was not cordoned before), which then
    /// shows `why` as its cordon reason.
    pub fn disk_pressure_on(&mut self, name: &str, why: &str, cordoned_by_it: bool) {
        if cordoned_by_it {
            self.cordon_reasons
                .insert(name.to_string(), why.to_string());
        }
        self.disk_pressure
            .insert(name.to_string(), (why.to_string(), cordoned_by_it));
    }

    /// `name`'s agent reports the pressure gone: whether the pressure had
    /// cordoned it (its reason is dropped; the caller uncordons it), or
    /// `None` when it was not under pressure.
    pub fn disk_pressure_off(&mut self, name: &str) -> Option<bool> {
        let (_, ours) = self.disk_pressure.remove(name)?;
        if ours {
            self.cordon_reasons.remove(name);
        }
        Some(ours)
    }

    /// A node is back in service (uncordoned): the evidence that cordoned
    /// it is spent, and so is the reason.
    pub fn uncordoned(&mut self, name: &str) {
        self.blame.forget_node(name);
        self.cordon_reasons.remove(name);
    }

    /// A cycle runs at `now`: when the gap since the last one is longer
    /// than the period allows (a blocked lock, a starved runtime), the
    /// stall is added to every node's last heartbeat, so no node is
    /// declared lost for silence the server caused. Returns the stall
    /// credited.
    pub fn credit_own_stall(&mut self, now: Time) -> Option<Time> {
        let period = self.cycle_seconds.max(1);
        let prev = self.last_cycle_at.replace(now)?;
        let gap = now.saturating_sub(prev);
        if gap <= period.saturating_add(2) {
            return None;
        }
        let stall = gap - period;
        self.heartbeats.credit_stall(stall, now);
        Some(stall)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authz::hash_token;

    #[test]
    fn a_forgotten_node_leaves_nothing_behind() {
        let mut r = NodeRegistry::new(0);
        let cred = NodeCredential::new("secret-a");
        let digest = cred.digest();
        r.add_credential("a", cred);
        r.add_credential("b", NodeCredential::new("secret-b"));
        assert_eq!(r.node_of_token(&digest), Some("a"));
        assert_eq!(r.node_of_token(&hash_token("secret-a")), Some("a"));
        r.heartbeats.heard("a", 5);
        r.lost.insert("a".into());
        r.cordon_reasons.insert("a".into(), "bad".into());
        r.reported_health
            .entry("a".into())
            .or_default()
            .insert(0, false);
        r.forget("a");
        assert_eq!(r.node_of_token(&digest), None);
        assert!(!r.tokens.contains_key("a"));
        assert_eq!(r.heartbeats.get("a"), None);
        assert!(r.lost.is_empty() && r.cordon_reasons.is_empty());
        assert!(r.reported_health.is_empty());
        assert!(r.tokens.contains_key("b"), "other nodes are kept");
    }

    #[test]
    fn disk_pressure_gives_a_cordon_reason_only_when_it_cordoned_the_node() {
        let mut r = NodeRegistry::new(0);
        r.disk_pressure_on("a", "disk 97% full", true);
        r.disk_pressure_on("b", "disk 98% full", false);
        assert_eq!(
            r.cordon_reasons.get("a").map(String::as_str),
            Some("disk 97% full")
        );
        assert!(!r.cordon_reasons.contains_key("b"));
        assert_eq!(r.disk_pressure_off("a"), Some(true));
        assert!(r.cordon_reasons.is_empty());
        // An admin's cordon of b stays: the pressure did not make it.
        assert_eq!(r.disk_pressure_off("b"), Some(false));
        assert_eq!(r.disk_pressure_off("b"), None);
        assert!(r.disk_pressure.is_empty());
    }

    #[test]
    fn a_heartbeat_ends_a_nodes_loss_and_the_blame_log_is_taken_once() {
        let mut r = NodeRegistry::new(0);
        r.lost.insert("a".into());
        r.heard("a", 9);
        assert!(r.lost.is_empty());
        assert_eq!(r.heartbeats.get("a"), Some(9));
        r.blame_log.push(Decision::Resume);
        assert_eq!(r.take_blame_log().len(), 1);
        assert!(r.take_blame_log().is_empty());
    }

    #[test]
    fn uncordoning_drops_the_reason() {
        let mut r = NodeRegistry::new(0);
        r.cordon_reasons
            .insert("a".into(), "cordoned automatically".into());
        r.cordon_reasons.insert("b".into(), "disk".into());
        r.uncordoned("a");
        assert_eq!(r.cordon_reasons.len(), 1);
        assert!(r.cordon_reasons.contains_key("b"));
    }

    #[test]
    fn only_a_gap_longer_than_the_period_and_its_slack_is_credited() {
        let mut r = NodeRegistry::new(0);
        r.cycle_seconds = 5;
        r.heartbeats.heard("a", 100);
        // The first cycle has nothing to compare with.
        assert_eq!(r.credit_own_stall(100), None);
        // Period plus two seconds of slack: not a stall.
        assert_eq!(r.credit_own_stall(107), None);
        assert_eq!(r.heartbeats.get("a"), Some(100));
        // 20 s later: 15 s beyond the period are the server's own.
        assert_eq!(r.credit_own_stall(127), Some(15));
        assert_eq!(r.heartbeats.get("a"), Some(115));
        assert_eq!(r.last_cycle_at, Some(127));
    }
}
