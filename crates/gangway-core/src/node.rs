//! Nodes, their GPUs and where they sit in the network topology.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One physical GPU: an indivisible device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// Device index on its node (what `CUDA_VISIBLE_DEVICES` names).
    pub index: u32,
    /// Model name, e.g. `H100`, `A100`, `V100`.
    pub model: String,
    /// Device memory in GiB.
    pub memory_gib: u32,
    /// Unhealthy GPUs (XID errors, failed checks) are never assigned.
    #[serde(default = "yes")]
    pub healthy: bool,
    /// NVLink/NVSwitch island within the node; GPUs of one island talk at NVLink speed.
    #[serde(default)]
    pub island: u32,
}

fn yes() -> bool {
    true
}

/// A machine offered to the scheduler.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    /// Unique node name (hostname).
    pub name: String,
    /// Its GPUs. All GPUs of a node have the same model and memory.
    #[serde(default)]
    pub gpus: Vec<Gpu>,
    /// Allocatable CPU in thousandths of a core.
    pub cpu_millis: u64,
    /// Allocatable memory in MiB.
    pub memory_mib: u64,
    /// Leaf switch or rack the node is cabled to.
    pub leaf: String,
    /// Spine (or pod) above the leaf switch.
    #[serde(default)]
    pub spine: String,
    /// Free-form labels (`zone`, `pool`, ...).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// A cordoned node keeps what runs on it but receives no new work.
    #[serde(default)]
    pub cordoned: bool,
    /// Address other nodes reach this one at (`MASTER_ADDR` when it hosts rank 0).
    #[serde(default)]
    pub address: String,
    /// Where its agent serves rank logs (`http://addr:port`), when it has one.
    #[serde(default)]
    pub agent_url: Option<String>,
}

impl NodeSpec {
    /// A node of `n` identical, healthy GPUs in one NVLink island: the common DGX/HGX shape.
    pub fn uniform(name: &str, leaf: &str, spine: &str, n: u32, model: &str, mem_gib: u32) -> Self {
        NodeSpec {
            name: name.to_string(),
            gpus: (0..n)
                .map(|index| Gpu {
                    index,
                    model: model.to_string(),
                    memory_gib: mem_gib,
                    healthy: true,
                    island: 0,
                })
                .collect(),
            cpu_millis: 16_000 * u64::from(n.max(1)),
            memory_mib: 128 * 1024 * u64::from(n.max(1)),
            leaf: leaf.to_string(),
            spine: spine.to_string(),
            labels: BTreeMap::new(),
            cordoned: false,
            address: String::new(),
            agent_url: None,
        }
    }
}

/// A level of the topology tree, from the closest to the farthest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TopologyLevel {
    /// All GPUs in one NVLink/NVSwitch island.
    Island,
    /// All GPUs on one node (may cross islands over PCIe).
    Node,
    /// All nodes under one leaf switch / rack.
    Leaf,
    /// All nodes under one spine.
    Spine,
    /// Across spines.
    Cluster,
}

/// Relative communication cost of spanning each topology level; used to score
/// placements (lower is better) and reported with each placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopologyCosts {
    /// Within one NVLink island.
    pub island: u32,
    /// Within one node across islands.
    pub node: u32,
    /// Within one leaf switch.
    pub leaf: u32,
    /// Within one spine.
    pub spine: u32,
    /// Across spines.
    pub cluster: u32,
}

impl Default for TopologyCosts {
    fn default() -> Self {
        TopologyCosts {
            island: 1,
            node: 2,
            leaf: 10,
            spine: 40,
            cluster: 100,
        }
    }
}

impl TopologyCosts {
    /// Cost of spanning `level`.
    pub fn of(&self, level: TopologyLevel) -> u32 {
        match level {
            TopologyLevel::Island => self.island,
            TopologyLevel::Node => self.node,
            TopologyLevel::Leaf => self.leaf,
            TopologyLevel::Spine => self.spine,
            TopologyLevel::Cluster => self.cluster,
        }
    }
}
