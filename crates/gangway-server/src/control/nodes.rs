//! The node registry's operations on the control state: registration
//! (join token, approval, a node's own token), heartbeats' lifecycle
//! (NotReady, lost), cordon, drain and deletion (see [`crate::nodes`] for
//! the records and rules).

use super::{encode, token_key, Control, ControlError, Ending};
use crate::authz::TokenHash;
use crate::nodes::*;
use crate::records::{node_key, Stopping};
use gangway_core::{JobId, JobState, NodeSpec, Time};
use gangway_sched::{ClusterState, StateConfig};
use gangway_store::{Op, Store};
use std::collections::BTreeMap;

impl<S: Store> Control<S> {
    /// The node whose token has digest `h`.
    pub fn node_of_token(&self, h: &TokenHash) -> Option<&str> {
        self.nodes.node_of_token(h)
    }

    /// Whether `name` is registered (approved or waiting).
    pub fn node_known(&self, name: &str) -> bool {
        self.cluster.node_index(name).is_some() || self.nodes.pending.contains_key(name)
    }

    /// The log key of `node`, derived with the join token `secret`.
    pub fn log_token_of(&self, node: &str, secret: &str) -> Option<String> {
        self.nodes
            .tokens
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
        self.view.cluster.urge();
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
                pending: self.nodes.pending.contains_key(&name),
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
            self.nodes.pending.insert(name.clone(), spec);
        }
        self.nodes.heartbeats.heard(&name, now);
        let log_token = log_token(secret, &name, &cred.log_nonce);
        self.nodes.add_credential(&name, cred);
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
        if let Some(p) = self.nodes.pending.get_mut(name) {
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
        self.nodes.heartbeats.heard(name, now);
        Ok(())
    }

    /// Approves a waiting node: it becomes schedulable. Approving an
    /// approved node does nothing.
    pub fn approve_node(&mut self, name: &str, now: Time) -> Result<(), ControlError> {
        self.view.cluster.urge();
        if self.cluster.node_index(name).is_some() {
            return Ok(());
        }
        let spec = self
            .nodes
            .pending
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
        self.nodes.pending.remove(name);
        self.nodes.heartbeats.heard_unless_known(name, now);
        tracing::info!("node {name} approved");
        Ok(())
    }

    /// Deletes a node: its gangs end as if it were lost (restart elsewhere
    /// per their policy; preempted ones are requeued), its token stops
    /// working, and its name may join again.
    pub fn delete_node(&mut self, name: &str, now: Time) -> Result<(), ControlError> {
        self.view.cluster.urge();
        if self.nodes.pending.contains_key(name) {
            self.store.txn(
                &[],
                &[Op::Delete(pending_key(name)), Op::Delete(token_key(name))],
            )?;
            self.nodes.pending.remove(name);
            self.nodes.forget(name);
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
            &[
                Op::Delete(node_key(name)),
                Op::Delete(token_key(name)),
                Op::Delete(crate::records::auto_cordon_key(name)),
            ],
        )?;
        self.nodes.forget(name);
        // The scheduler's state has no removal: rebuild it as a restart would.
        self.view.cluster.forget_rows();
        let old = std::mem::replace(
            &mut *self.cluster,
            ClusterState::new(StateConfig::default()),
        );
        for q in self.policy.queues.clone() {
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

    /// Nodes waiting for approval, by name.
    pub fn pending(&self) -> &BTreeMap<String, NodeSpec> {
        &self.nodes.pending
    }

    /// A heartbeat from a node that waits for approval: recorded, nothing to run.
    pub fn pending_heartbeat(&mut self, name: &str, now: Time) -> bool {
        if self.nodes.pending.contains_key(name) {
            self.nodes.heartbeats.heard(name, now);
            return true;
        }
        false
    }

    /// A node is never declared lost for silence the server caused: when the
    /// cycles themselves stalled (a blocked lock, a starved runtime), the
    /// stall is added to every node's last heartbeat.
    pub(crate) fn credit_own_stall(&mut self, now: Time) {
        if let Some(stall) = self.nodes.credit_own_stall(now) {
            tracing::warn!(
                "the control loop stalled for {stall}s; node silence in that time is not counted"
            );
        }
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
