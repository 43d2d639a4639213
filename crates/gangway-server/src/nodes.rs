//! Node admission, after the kubelet's NodeRestriction model: the join token
//! registers only new node names, and such nodes wait for an admin's
//! approval unless the config says `node_approval: auto`; a node's own token
//! (stored only as a digest) is the one credential that re-registers it, and
//! it changes only that node's own endpoint; the register answer carries the
//! token only the first time. Admins approve, cordon, drain and delete nodes.

use crate::authz::{hash_from_hex, hash_token, to_hex, TokenHash};
use crate::control::{decode, encode, token_key, Control, ControlError, Ending};
use crate::records::{node_key, Stopping};
use gangway_core::{JobId, JobState, NodeSpec, Time};
use gangway_sched::{ClusterState, StateConfig};
use gangway_store::{Op, Store};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Store prefix of nodes waiting for approval.
pub const PENDING_PREFIX: &str = "/pending_nodes/";

fn pending_key(name: &str) -> String {
    format!("{PENDING_PREFIX}{name}")
}

/// A node's credential as stored: its token's SHA-256 digest (never the
/// token) and the nonce its log key is derived from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeCredential {
    /// Hex SHA-256 of the node token.
    pub token_sha256: String,
    /// Random nonce of the node's log key (see [`log_token`]).
    pub log_nonce: String,
}

impl NodeCredential {
    /// A credential for a fresh token.
    pub fn new(token: &str) -> Self {
        NodeCredential {
            token_sha256: to_hex(&hash_token(token)),
            log_nonce: crate::control::fresh_token(),
        }
    }

    /// The digest as bytes (all zeros, matching no token, if the stored hex is bad).
    pub fn digest(&self) -> TokenHash {
        hash_from_hex(&self.token_sha256).unwrap_or([0; 32])
    }

    /// Reads a stored credential; a record from before tokens were hashed (a
    /// plain JSON string) is hashed on the way in.
    pub fn decode(key: &str, bytes: &[u8]) -> Result<Self, ControlError> {
        if let Ok(c) = serde_json::from_slice::<NodeCredential>(bytes) {
            return Ok(c);
        }
        let plain: String = decode(key, bytes)?;
        Ok(NodeCredential::new(&plain))
    }
}

/// The key a node's agent accepts from the server when it relays that
/// node's logs: derived from the cluster's join token (which only the
/// server's configuration holds), the node's name and its nonce, so the
/// store holds nothing that reads logs and a node's key opens only its own.
pub fn log_token(join_token: &str, node: &str, nonce: &str) -> String {
    to_hex(&hash_token(&format!(
        "gangway-log\0{join_token}\0{node}\0{nonce}"
    )))
}

/// Who registers a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Registrant {
    /// The cluster's join token: new names only.
    Join,
    /// A node's own token: its own registration only.
    Node(String),
    /// The admin.
    Admin,
}

/// The answer to a registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registered {
    /// The node's token: only on first registration.
    pub token: Option<String>,
    /// The key the agent accepts from the server for log reads.
    pub log_token: String,
    /// Whether the node waits for an admin's approval.
    pub pending: bool,
}

/// Longest node name.
const MAX_NODE_NAME: usize = 253;

/// Rule: a node's name is a hostname-like word, its agent URL is plain
/// `http(s)://ADDRESS:PORT` on the node's own address (the server contacts
/// nothing else), and its lists are bounded.
pub fn check_node_spec(spec: &NodeSpec) -> Result<(), ControlError> {
    let bad = |m: String| Err(ControlError::BadNode(m));
    let n = &spec.name;
    if n.is_empty()
        || n.len() > MAX_NODE_NAME
        || !n
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return bad(format!(
            "name: {:?} must be 1 to {MAX_NODE_NAME} letters, digits, '-', '_' or '.'",
            n.chars().take(64).collect::<String>()
        ));
    }
    if spec.gpus.len() > 64 {
        return bad(format!(
            "gpus: at most 64 per node (got {})",
            spec.gpus.len()
        ));
    }
    if spec.labels.len() > 64
        || spec
            .labels
            .iter()
            .any(|(k, v)| k.len() > MAX_NODE_NAME || v.len() > MAX_NODE_NAME)
    {
        return bad("labels: at most 64, each key and value at most 253 bytes".into());
    }
    for (f, v) in [
        ("leaf", &spec.leaf),
        ("spine", &spec.spine),
        ("address", &spec.address),
    ] {
        if v.len() > MAX_NODE_NAME {
            return bad(format!("{f}: at most {MAX_NODE_NAME} bytes"));
        }
    }
    if spec.gpus.iter().any(|g| g.model.len() > MAX_NODE_NAME) {
        return bad("gpus.model: at most 253 bytes".into());
    }
    if let Some(url) = &spec.agent_url {
        check_agent_url(url, &spec.address)?;
    }
    Ok(())
}

/// Rule: the agent URL is `http://HOST:PORT` or `https://HOST:PORT` where
/// HOST is the node's own address: no credentials, path, query or fragment.
pub fn check_agent_url(url: &str, address: &str) -> Result<(), ControlError> {
    let bad = |why: &str| {
        Err(ControlError::BadNode(format!(
            "agent_url: {why} (got {:?})",
            url.chars().take(128).collect::<String>()
        )))
    };
    let rest = match url.split_once("://") {
        Some(("http" | "https", rest)) => rest.trim_end_matches('/'),
        _ => return bad("must start with http:// or https://"),
    };
    if rest.contains(['/', '?', '#', '@', '\\']) || rest.chars().any(char::is_whitespace) {
        return bad("must be scheme://host:port with nothing else");
    }
    let (host, port) = match rest.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()) => (h, p),
        _ => return bad("must name a port"),
    };
    if port.parse::<u16>().is_err() {
        return bad("port out of range");
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if address.is_empty() || host != address.trim_start_matches('[').trim_end_matches(']') {
        return bad(&format!(
            "must be on the node's own address {address:?}; the server contacts nodes only there"
        ));
    }
    Ok(())
}

impl<S: Store> Control<S> {
    /// The node whose token has digest `h`.
    pub fn node_of_token(&self, h: &TokenHash) -> Option<&str> {
        self.node_by_token.get(h).map(String::as_str)
    }

    /// Whether `name` is registered (approved or waiting).
    pub fn node_known(&self, name: &str) -> bool {
        self.cluster.node_index(name).is_some() || self.pending_nodes.contains_key(name)
    }

    /// The log key of `node`, derived with the join token `secret`.
    pub fn log_token_of(&self, node: &str, secret: &str) -> Option<String> {
        self.node_tokens
            .get(node)
            .map(|c| log_token(secret, node, &c.log_nonce))
    }

    /// Registers a node (see the module doc for the rules). `auto`: whether
    /// nodes joining with the join token are approved at once; `secret`: the
    /// join token, from which log keys derive.
    pub fn register_node(
        &mut self,
        spec: NodeSpec,
        by: &Registrant,
        auto: bool,
        secret: &str,
        now: Time,
    ) -> Result<Registered, ControlError> {
        // The node list shows a registration at once (see ClusterMemo).
        self.cluster_view.urge();
        check_node_spec(&spec)?;
        let name = spec.name.clone();
        if let Registrant::Node(own) = by {
            if *own != name {
                return Err(ControlError::Forbidden(format!(
                    "the token of node {own} may not register node {name}"
                )));
            }
        }
        let known = self.node_known(&name);
        match by {
            Registrant::Join if known => {
                return Err(ControlError::Forbidden(format!(
                    "node {name} is already registered: re-registering it needs its own node token (or an admin deletes it first)"
                )));
            }
            Registrant::Node(_) if !known => {
                return Err(ControlError::Forbidden(format!(
                    "node {name} is not registered"
                )));
            }
            _ => {}
        }
        // Only once the caller may register the name: its address is checked.
        self.check_address(&name, &spec.address)?;
        if known {
            self.update_endpoint(&spec, now)?;
            let log_token = self.log_token_of(&name, secret).unwrap_or_default();
            return Ok(Registered {
                token: None,
                log_token,
                pending: self.pending_nodes.contains_key(&name),
            });
        }
        let approved = auto || *by == Registrant::Admin;
        if approved {
            // Checked before it is stored, added after: no copy of the state.
            self.cluster
                .check_new_node(&spec)
                .map_err(|e| ControlError::BadNode(e.to_string()))?;
        }
        let token = crate::control::fresh_token();
        let cred = NodeCredential::new(&token);
        let spec_key = if approved {
            node_key(&name)
        } else {
            pending_key(&name)
        };
        self.store.txn(
            &[],
            &[
                Op::Put(spec_key, encode(&spec)),
                Op::Put(token_key(&name), encode(&cred)),
            ],
        )?;
        if approved {
            self.cluster
                .add_node(spec)
                .map_err(|e| ControlError::BadNode(e.to_string()))?;
        } else {
            self.pending_nodes.insert(name.clone(), spec);
        }
        self.heartbeats.heard(&name, now);
        self.node_by_token.insert(cred.digest(), name.clone());
        let log_token = log_token(secret, &name, &cred.log_nonce);
        self.node_tokens.insert(name.clone(), cred);
        if approved {
            tracing::info!("node {name} registered");
        } else {
            tracing::warn!(
                "node {name} registered and waits for approval (gangway nodes approve {name})"
            );
        }
        Ok(Registered {
            token: Some(token),
            log_token,
            pending: !approved,
        })
    }

    /// A registered node's agent came back, possibly on another address or port.
    fn update_endpoint(&mut self, spec: &NodeSpec, now: Time) -> Result<(), ControlError> {
        let name = &spec.name;
        if let Some(p) = self.pending_nodes.get_mut(name) {
            p.address = spec.address.clone();
            p.agent_url = spec.agent_url.clone();
            let p = p.clone();
            self.store.put(&pending_key(name), &encode(&p))?;
        } else if let Some(n) = self.cluster.node_index(name) {
            let old = &self.cluster.nodes()[n as usize].spec;
            if old.address != spec.address || old.agent_url != spec.agent_url {
                tracing::warn!(
                    "node {name} re-registered at {} (was {})",
                    spec.address,
                    old.address
                );
                self.cluster
                    .set_endpoint(name, &spec.address, spec.agent_url.clone())
                    .map_err(|e| ControlError::BadNode(e.to_string()))?;
                self.store_node(n)?;
            } else {
                tracing::info!("node {name} re-registered");
            }
        }
        self.heartbeats.heard(name, now);
        Ok(())
    }

    /// Approves a waiting node: it becomes schedulable. Approving an
    /// approved node does nothing.
    pub fn approve_node(&mut self, name: &str, now: Time) -> Result<(), ControlError> {
        self.cluster_view.urge();
        if self.cluster.node_index(name).is_some() {
            return Ok(());
        }
        let spec = self
            .pending_nodes
            .get(name)
            .cloned()
            .ok_or_else(|| ControlError::NoSuchNode(name.into()))?;
        self.cluster
            .check_new_node(&spec)
            .map_err(|e| ControlError::BadNode(e.to_string()))?;
        self.store.txn(
            &[],
            &[
                Op::Delete(pending_key(name)),
                Op::Put(node_key(name), encode(&spec)),
            ],
        )?;
        self.cluster
            .add_node(spec)
            .map_err(|e| ControlError::BadNode(e.to_string()))?;
        self.pending_nodes.remove(name);
        self.heartbeats.heard_unless_known(name, now);
        tracing::info!("node {name} approved");
        Ok(())
    }

    /// Deletes a node: its gangs end as if it were lost (restart elsewhere
    /// per their policy; preempted ones are requeued), its token stops
    /// working, and its name may join again.
    pub fn delete_node(&mut self, name: &str, now: Time) -> Result<(), ControlError> {
        self.cluster_view.urge();
        if self.pending_nodes.contains_key(name) {
            self.store.txn(
                &[],
                &[Op::Delete(pending_key(name)), Op::Delete(token_key(name))],
            )?;
            self.pending_nodes.remove(name);
            self.forget_node(name);
            return Ok(());
        }
        let n = self
            .cluster
            .node_index(name)
            .ok_or_else(|| ControlError::NoSuchNode(name.into()))?;
        let msg = format!("node {name} deleted by an admin");
        // A job with several replicas here is ended once.
        let gone = self
            .cluster
            .jobs_on(n)
            .iter()
            .map(|id| (*id, msg.clone()))
            .collect();
        self.end_gangs_of_gone_nodes(gone, now)?;
        self.store.txn(
            &[],
            &[Op::Delete(node_key(name)), Op::Delete(token_key(name))],
        )?;
        self.forget_node(name);
        // The scheduler's state has no removal: rebuild it as a restart would.
        self.cluster_view.forget_rows();
        let old = std::mem::replace(
            &mut *self.cluster,
            ClusterState::new(StateConfig::default()),
        );
        for q in self.queue_specs.clone() {
            self.cluster
                .add_queue(q)
                .map_err(|e| ControlError::BadNode(e.to_string()))?;
        }
        let mut not_ready = Vec::new();
        for info in old.nodes() {
            if info.spec.name == name {
                continue;
            }
            self.cluster
                .add_node(info.spec.clone())
                .map_err(|e| ControlError::BadNode(e.to_string()))?;
            if !info.ready {
                not_ready.push(info.spec.name.clone());
            }
        }
        for n in not_ready {
            let _ = self.cluster.set_ready(&n, false);
        }
        self.rebuild()?;
        tracing::warn!("node {name} deleted");
        Ok(())
    }

    fn forget_node(&mut self, name: &str) {
        if let Some(c) = self.node_tokens.remove(name) {
            self.node_by_token.remove(&c.digest());
        }
        self.heartbeats.forget(name);
        self.lost.remove(name);
        self.blame.forget_node(name);
        self.cordon_reasons.remove(name);
        self.reported_health.remove(name);
    }

    /// Nodes waiting for approval, by name.
    pub fn pending(&self) -> &BTreeMap<String, NodeSpec> {
        &self.pending_nodes
    }

    /// A heartbeat from a node that waits for approval: recorded, nothing to run.
    pub fn pending_heartbeat(&mut self, name: &str, now: Time) -> bool {
        if self.pending_nodes.contains_key(name) {
            self.heartbeats.heard(name, now);
            return true;
        }
        false
    }

    /// A node is never declared lost for silence the server caused: when the
    /// cycles themselves stalled (a blocked lock, a starved runtime), the
    /// stall is added to every node's last heartbeat.
    pub(crate) fn credit_own_stall(&mut self, now: Time) {
        let period = self.cycle_seconds.max(1);
        if let Some(prev) = self.last_cycle_at {
            let gap = now.saturating_sub(prev);
            if gap > period.saturating_add(2) {
                let stall = gap - period;
                tracing::warn!(
                    "the control loop stalled for {stall}s; node silence in that time is not counted"
                );
                self.heartbeats.credit_stall(stall, now);
            }
        }
        self.last_cycle_at = Some(now);
    }

    /// Rule (max grace): a gang being stopped whose grace plus `margin` has
    /// passed ends and its GPUs are freed, whatever its ranks do; their
    /// agents kill what still runs, since the attempt is no longer assigned.
    /// A preempted gang has its grace capped at `max_grace` and is requeued;
    /// a cancelled gang, or one stopping because a rank failed, has the short
    /// grace and ends as it would have (cancelled; restarted or failed).
    /// Without this a node that never reports the exit (a process stuck in
    /// the kernel, a faulty agent) would hold the GPUs for ever.
    /// Returns the jobs ended.
    pub fn expire_grace(
        &mut self,
        now: Time,
        max_grace: u64,
        margin: u64,
    ) -> Result<Vec<JobId>, ControlError> {
        let since = |r: &crate::records::JobRecord, kind: &str| {
            r.events.iter().rev().find(|e| e.kind == kind).map(|e| e.at)
        };
        // Only gangs on GPUs can be stopping, and only those stopping or
        // preempting have a grace: the index of those under a deadline, not
        // a walk of every job on GPUs.
        let due: Vec<_> = self
            .jobs
            .deadline_candidates()
            .into_iter()
            .filter(|r| {
                matches!(
                    r.state,
                    JobState::Scheduled | JobState::Running | JobState::Preempting
                )
            })
            .filter(|r| r.stopping.is_some() || r.state == JobState::Preempting)
            .filter_map(|r| {
                let full = r.spec.checkpoint.grace_seconds.min(max_grace);
                let short = r
                    .spec
                    .checkpoint
                    .grace_seconds
                    .min(crate::control::SHORT_GRACE_SECONDS);
                let stop = match &r.stopping {
                    Some(Stopping::Cancelled { .. }) => since(r, "cancelling").map(|t| (t, short)),
                    Some(Stopping::Failed { .. }) => since(r, "stopping").map(|t| (t, short)),
                    None => None,
                };
                let preempt = (r.state == JobState::Preempting)
                    .then(|| since(r, "preempting").map(|t| (t, full)))
                    .flatten();
                // The earlier of the deadlines that apply.
                let (deadline, grace) = [stop, preempt]
                    .into_iter()
                    .flatten()
                    .map(|(t, g)| (t.saturating_add(g).saturating_add(margin), g))
                    .min()?;
                (now >= deadline).then(|| (crate::records::JobRecord::clone(r), grace))
            })
            .collect();
        let mut ended_ids = Vec::new();
        for (rec, grace) in due {
            let id = rec.id;
            let msg = format!(
                "grace of {grace}s (+{margin}s) ran out before its ranks stopped; the server took its GPUs back and its agents kill what still runs"
            );
            tracing::warn!("job {id}: {msg}");
            // Only gangs being stopped are due: a cancel, a failed rank or
            // a preemption.
            let ending = Ending::forced(&rec, msg);
            self.end_attempt(rec, ending, now)?;
            ended_ids.push(id);
        }
        Ok(ended_ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_store::RedbStore;

    fn control() -> (tempfile::TempDir, Control<RedbStore>) {
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let c = Control::open(store, &[gangway_core::QueueSpec::unlimited("q", None)])
            .expect("control");
        (dir, c)
    }

    #[test]
    fn a_stall_of_the_server_is_not_counted_against_nodes() {
        let (_d, mut c) = control();
        let mut spec = NodeSpec::uniform("n", "l", "s", 1, "H100", 80);
        spec.address = "127.0.0.1".into();
        c.register_node(spec, &Registrant::Join, true, "join", 1000)
            .expect("register");
        c.cycle(1000).expect("cycle");
        // The server itself was stuck for 100 s: the node is not lost.
        c.cycle(1100).expect("cycle");
        assert!(c.lost.is_empty(), "{:?}", c.lost);
        assert!(c.cluster.nodes()[0].ready);
        // Real silence, with the loop running, still counts.
        for t in 1101..1140 {
            c.cycle(t).expect("cycle");
        }
        assert!(c.lost.contains("n"));
    }

    #[test]
    fn agent_urls_must_be_plain_and_on_the_nodes_own_address() {
        assert!(check_agent_url("http://10.0.0.1:8080", "10.0.0.1").is_ok());
        assert!(check_agent_url("https://[::1]:8080/", "::1").is_ok());
        for bad in [
            "http://10.0.0.2:8080",
            "http://10.0.0.1",
            "http://10.0.0.1:8080/x",
            "http://user@10.0.0.1:8080",
            "file://10.0.0.1:1",
            "http://10.0.0.1:99999",
            "http://10.0.0.1:80?x",
        ] {
            assert!(check_agent_url(bad, "10.0.0.1").is_err(), "{bad}");
        }
        assert!(check_agent_url("http://10.0.0.1:1", "").is_err());
    }

    #[test]
    fn a_store_from_before_hashing_is_migrated_on_open() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("s.redb");
        {
            let store = RedbStore::open(&path).expect("store");
            let spec = NodeSpec::uniform("old", "l", "s", 1, "H100", 80);
            store.put(&node_key("old"), &encode(&spec)).expect("node");
            store
                .put(&token_key("old"), b"\"plain-old-token\"")
                .expect("token");
        }
        let store = RedbStore::open(&path).expect("store");
        let c = Control::open(store, &[gangway_core::QueueSpec::unlimited("q", None)])
            .expect("control");
        assert_eq!(c.node_of_token(&hash_token("plain-old-token")), Some("old"));
        let kv = c
            .store
            .get(&token_key("old"))
            .expect("get")
            .expect("present");
        let text = String::from_utf8_lossy(&kv.value).to_string();
        assert!(!text.contains("plain-old-token"), "{text}");
        assert!(text.contains("token_sha256"), "{text}");
    }

    #[test]
    fn legacy_plain_tokens_are_read_as_digests() {
        let c = NodeCredential::decode("k", b"\"abc\"").expect("legacy");
        assert_eq!(c.digest(), hash_token("abc"));
        let fresh = NodeCredential::new("t");
        let back = NodeCredential::decode("k", &serde_json::to_vec(&fresh).expect("json"))
            .expect("decode");
        assert_eq!(back, fresh);
    }
}
