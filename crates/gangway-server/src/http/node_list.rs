//! The body of `GET /v1/nodes`, serialized straight from the read view's
//! cluster snapshot: no `serde_json::Value` tree is built, so a
//! 10,000-node answer costs one pass over the rows instead of an
//! allocation per key and GPU.
//!
//! The shape is the one the OpenAPI document gives
//! ([`crate::http::nodes::NodeView`], [`crate::http::nodes::GpuView`]). Keys are
//! written in alphabetical order, as the `Value` map this replaced wrote
//! them, so the bytes are the same (a test below compares them); a node
//! waiting for approval has no `cordon_reason` key, as before.

use crate::view::{NodeRow, ReadView};
use gangway_core::{Gpu, JobId, NodeSpec, Time};
use serde::{Serialize, Serializer};
use std::sync::Arc;

/// Every node of a read view, registered ones first (in the scheduler's
/// order), then those waiting for approval.
pub struct NodeList(pub Arc<ReadView>);

impl Serialize for NodeList {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let v = &*self.0;
        let heartbeat = |name: &str| v.last_seen.get(name).copied();
        let registered = v.cluster.nodes.iter().map(|n: &Arc<NodeRow>| NodeOut {
            address: &n.spec.address,
            cordon_reason: Some(n.cordon_reason.as_deref()),
            cordoned: n.spec.cordoned,
            gpus: Gpus {
                gpus: &n.spec.gpus,
                alloc: n.alloc,
            },
            jobs: &n.jobs,
            last_heartbeat: heartbeat(&n.spec.name),
            leaf: &n.spec.leaf,
            name: &n.spec.name,
            pending_approval: false,
            ready: n.ready,
        });
        let waiting = v
            .cluster
            .waiting_approval
            .iter()
            .map(|n: &NodeSpec| NodeOut {
                address: &n.address,
                cordon_reason: None,
                cordoned: n.cordoned,
                gpus: Gpus {
                    gpus: &n.gpus,
                    alloc: 0,
                },
                jobs: &[],
                last_heartbeat: heartbeat(&n.name),
                leaf: &n.leaf,
                name: &n.name,
                pending_approval: true,
                ready: false,
            });
        s.collect_seq(registered.chain(waiting))
    }
}

/// One node (fields in key order: see the module's documentation).
#[derive(Serialize)]
struct NodeOut<'a> {
    address: &'a str,
    /// `None`: no key (a node waiting for approval); `Some(None)`: `null`.
    #[serde(skip_serializing_if = "Option::is_none")]
    cordon_reason: Option<Option<&'a str>>,
    cordoned: bool,
    gpus: Gpus<'a>,
    jobs: &'a [JobId],
    last_heartbeat: Option<Time>,
    leaf: &'a str,
    name: &'a str,
    pending_approval: bool,
    ready: bool,
}

/// A node's GPUs with the allocation mask (bit `k` is `gpus[k]`).
struct Gpus<'a> {
    gpus: &'a [Gpu],
    alloc: u64,
}

impl Serialize for Gpus<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.gpus.iter().enumerate().map(|(k, g)| GpuOut {
            allocated: k < 64 && self.alloc & (1u64 << k) != 0,
            healthy: g.healthy,
            index: g.index,
            memory_gib: g.memory_gib,
            memory_mib: g.memory_mib(),
            mig: g.mig,
            model: &g.model,
            reason: g.reason.as_deref(),
            uuid: g.uuid.as_deref(),
        }))
    }
}

/// One GPU (fields in key order).
#[derive(Serialize)]
struct GpuOut<'a> {
    allocated: bool,
    healthy: bool,
    index: u32,
    memory_gib: u32,
    memory_mib: u64,
    mig: bool,
    model: &'a str,
    reason: Option<&'a str>,
    uuid: Option<&'a str>,
}

/// The node list as a `serde_json::Value` tree, the way `GET /v1/nodes`
/// was built before it serialized the rows directly: the reference the
/// typed form is checked against (same bytes) and measured against
/// (`bench dashboard`).
pub fn as_value(v: &ReadView) -> serde_json::Value {
    use serde_json::json;
    let mut out: Vec<_> = v
        .cluster
        .nodes
        .iter()
        .map(|n| {
            json!({
                "name": n.spec.name,
                "leaf": n.spec.leaf,
                "address": n.spec.address,
                "cordoned": n.spec.cordoned,
                "cordon_reason": n.cordon_reason,
                "ready": n.ready,
                "last_heartbeat": v.last_seen.get(n.spec.name.as_str()),
                "gpus": n.spec.gpus.iter().enumerate().map(|(k, g)| json!({
                    "index": g.index, "model": g.model, "memory_gib": g.memory_gib,
                    "memory_mib": g.memory_mib(), "mig": g.mig, "reason": g.reason,
                    "uuid": g.uuid,
                    "healthy": g.healthy, "allocated": n.alloc & (1 << k) != 0,
                })).collect::<Vec<_>>(),
                "jobs": n.jobs,
                "pending_approval": false,
            })
        })
        .collect();
    for n in &v.cluster.waiting_approval {
        out.push(json!({
            "name": n.name,
            "leaf": n.leaf,
            "address": n.address,
            "cordoned": n.cordoned,
            "ready": false,
            "last_heartbeat": v.last_seen.get(n.name.as_str()),
            "gpus": n.gpus.iter().map(|g| json!({
                "index": g.index, "model": g.model, "memory_gib": g.memory_gib,
                "memory_mib": g.memory_mib(), "mig": g.mig, "reason": g.reason,
                "uuid": g.uuid,
                "healthy": g.healthy, "allocated": false,
            })).collect::<Vec<_>>(),
            "jobs": [],
            "pending_approval": true,
        }));
    }
    json!(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::ClusterSnapshot;

    fn row(name: &str, alloc: u64, jobs: &[u64], reason: Option<&str>) -> Arc<NodeRow> {
        let mut spec = NodeSpec::uniform(name, "leaf-\"0\"", "spine0", 8, "H100", 80);
        spec.address = "10.0.0.1".into();
        spec.gpus[3].healthy = false;
        spec.cordoned = reason.is_some();
        Arc::new(NodeRow {
            spec,
            spec_version: 1,
            ready: alloc != 0,
            alloc,
            jobs: jobs.iter().copied().map(JobId).collect(),
            cordon_reason: reason.map(str::to_string),
            unhealthy: 1,
        })
    }

    #[test]
    fn the_typed_list_writes_the_same_bytes_as_the_value_it_replaced() {
        let mut waiting = NodeSpec::uniform("new", "leaf1", "spine0", 4, "A100", 40);
        waiting.cordoned = true;
        let mut view = ReadView {
            cluster: Arc::new(ClusterSnapshot {
                nodes: vec![
                    row("a", 0b1000_0101, &[7, 7, 12], None),
                    row("b", 0, &[], Some("GPU 3 failed: Xid 79")),
                    row("c\u{e9}", u64::MAX, &[u64::MAX], None),
                ]
                .into(),
                waiting_approval: vec![waiting],
                ..Default::default()
            }),
            ..Default::default()
        };
        view.last_seen.insert("a".into(), 1_700_000_000);
        view.last_seen.insert("new".into(), 5);
        let view = Arc::new(view);
        let typed = serde_json::to_string(&NodeList(view.clone())).expect("typed");
        let before = serde_json::to_string(&as_value(&view)).expect("value");
        assert_eq!(typed, before);
        // The cases the comparison is about are in it.
        assert!(typed.contains(r#""cordon_reason":null"#), "{typed}");
        assert!(
            typed.contains(r#""cordon_reason":"GPU 3 failed"#),
            "{typed}"
        );
        assert!(typed.contains(r#""last_heartbeat":null"#), "{typed}");
        assert!(typed.contains(r#""allocated":true"#), "{typed}");
        assert_eq!(
            typed.matches("cordon_reason").count(),
            3,
            "none when waiting"
        );
    }

    #[test]
    fn an_empty_cluster_is_an_empty_array() {
        let view = Arc::new(ReadView::default());
        assert_eq!(serde_json::to_string(&NodeList(view)).expect("typed"), "[]");
    }
}
