//! Cluster descriptions: node shapes, racks and queues with quotas, as YAML,
//! and the defaults that mirror each trace's published cluster.
//!
//! ```yaml
//! name: philly
//! node_groups:
//!   - count: 352          # nodes of this shape
//!     gpus: 8
//!     gpu_model: P40
//!     gpu_memory_gib: 24
//!     cpu_millis: 48000
//!     memory_mib: 393216
//!     nodes_per_leaf: 16  # nodes under one leaf switch
//!     leaves_per_spine: 8
//! queues:                  # gangway_core::QueueSpec
//!   - name: philly
//!     quota: { nominal: { gpus: 2816 } }
//!   - name: vc_6214e9
//!     parent: philly
//!     quota: { nominal: { gpus: 512 } }
//! ```

use crate::trace::{self, TraceError};
use gangway_core::{Gpu, NodeSpec, QueueSpec, ResourceLimits};
use gangway_sched::{ClusterState, StateConfig, StateError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use thiserror::Error;

/// A group of identical nodes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeGroup {
    /// How many nodes.
    pub count: usize,
    /// GPUs per node.
    pub gpus: u32,
    /// GPU model.
    #[serde(default = "default_model")]
    pub gpu_model: String,
    /// GPU memory in GiB.
    #[serde(default = "default_mem")]
    pub gpu_memory_gib: u32,
    /// NVLink islands per node (GPUs split evenly).
    #[serde(default = "one")]
    pub islands: u32,
    /// CPU per node, thousandths of a core.
    #[serde(default = "default_cpu")]
    pub cpu_millis: u64,
    /// Memory per node, MiB.
    #[serde(default = "default_ram")]
    pub memory_mib: u64,
    /// Nodes under one leaf switch.
    #[serde(default = "default_leaf")]
    pub nodes_per_leaf: usize,
    /// Leaf switches under one spine.
    #[serde(default = "default_spine")]
    pub leaves_per_spine: usize,
}

fn default_model() -> String {
    "GPU".into()
}
fn default_mem() -> u32 {
    32
}
fn one() -> u32 {
    1
}
fn default_cpu() -> u64 {
    64_000
}
fn default_ram() -> u64 {
    512 * 1024
}
fn default_leaf() -> usize {
    16
}
fn default_spine() -> usize {
    8
}

/// A whole cluster description.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// Name for reports.
    pub name: String,
    /// Node shapes.
    pub node_groups: Vec<NodeGroup>,
    /// Queues (parents first).
    #[serde(default)]
    pub queues: Vec<QueueSpec>,
    /// Queue for jobs whose queue is not declared; created without quota.
    #[serde(default = "default_queue")]
    pub default_parent: Option<String>,
}

fn default_queue() -> Option<String> {
    None
}

/// Why a cluster could not be built.
#[derive(Debug, Error)]
pub enum ClusterError {
    /// YAML.
    #[error("cluster file {path}: {source}")]
    Yaml {
        /// File.
        path: String,
        /// Cause.
        source: Box<serde_saphyr::Error>,
    },
    /// I/O.
    #[error("cluster file {path}: {source}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// Bad node or queue.
    #[error("cluster {0}: {1}")]
    State(String, StateError),
    /// Empty cluster.
    #[error("cluster {0} has no nodes")]
    Empty(String),
    /// Trace folder problem.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// Unknown default.
    #[error("no built-in cluster named {0:?} (known: philly, chronus, tiresias, openb, pai)")]
    Unknown(String),
}

/// The GPU model name that stands for queue `q`'s partition in node-partition
/// mode: jobs of `q` ask for it, and only `q`'s nodes have it.
pub fn partition_model(q: &str) -> String {
    format!("partition:{q}")
}

/// Philly's virtual clusters and their 8-GPU node counts (HeliosArtifact's
/// `philly_vc.csv`, see `shared/traces/philly-cluster/PROVENANCE.md`).
pub const PHILLY_VC_NODES: [(&str, u64); 11] = [
    ("6214e9", 64),
    ("7f04ca", 32),
    ("11cb48", 16),
    ("b436b2", 64),
    ("ee9e8c", 64),
    ("6c71a0", 32),
    ("0e4a51", 32),
    ("e13805", 16),
    ("2869ce", 16),
    ("ed69ec", 8),
    ("103959", 8),
];

fn vc_queues(root: &str, total_gpus: u64, scale_nodes: f64) -> Vec<QueueSpec> {
    let mut qs = vec![QueueSpec::gpus(root, None, total_gpus)];
    for (vc, nodes) in PHILLY_VC_NODES {
        // Rounded down, so the VCs never guarantee more than the cluster has.
        let gpus = ((nodes as f64) * 8.0 * scale_nodes).floor() as u64;
        qs.push(QueueSpec::gpus(&format!("vc_{vc}"), Some(root), gpus));
    }
    qs
}

impl ClusterSpec {
    /// Parses a YAML description.
    pub fn from_yaml(path: &str, text: &str) -> Result<Self, ClusterError> {
        serde_saphyr::from_str(text).map_err(|source| ClusterError::Yaml {
            path: path.into(),
            source: Box::new(source),
        })
    }

    /// Reads a YAML file.
    pub fn from_file(path: &Path) -> Result<Self, ClusterError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ClusterError::Io {
            path: p.clone(),
            source,
        })?;
        Self::from_yaml(&p, &text)
    }

    /// Philly at its published size: 352 nodes × 8 GPUs, queues per VC at their node counts.
    pub fn philly() -> Self {
        ClusterSpec {
            name: "philly".into(),
            node_groups: vec![NodeGroup {
                count: 352,
                gpus: 8,
                gpu_model: "P40".into(),
                gpu_memory_gib: 24,
                islands: 1,
                cpu_millis: 48_000,
                memory_mib: 384 * 1024,
                nodes_per_leaf: 16,
                leaves_per_spine: 8,
            }],
            queues: vc_queues("philly", 352 * 8, 1.0),
            default_parent: Some("philly".into()),
        }
    }

    /// The cluster the Chronus paper simulates for its Philly traces: 120 × 8 GPUs,
    /// VC quotas scaled from Philly's.
    pub fn chronus() -> Self {
        ClusterSpec {
            name: "chronus".into(),
            node_groups: vec![NodeGroup {
                count: 120,
                gpus: 8,
                gpu_model: "P40".into(),
                gpu_memory_gib: 24,
                islands: 1,
                cpu_millis: 48_000,
                memory_mib: 384 * 1024,
                nodes_per_leaf: 120,
                leaves_per_spine: 1,
            }],
            queues: vc_queues("philly", 960, 120.0 / 352.0),
            default_parent: Some("philly".into()),
        }
    }

    /// Tiresias' `n32g4`: 32 nodes × 4 GPUs under one switch.
    pub fn tiresias() -> Self {
        ClusterSpec {
            name: "tiresias-n32g4".into(),
            node_groups: vec![NodeGroup {
                count: 32,
                gpus: 4,
                gpu_model: "GPU".into(),
                gpu_memory_gib: 16,
                islands: 1,
                cpu_millis: 40_000,
                memory_mib: 256 * 1024,
                nodes_per_leaf: 32,
                leaves_per_spine: 1,
            }],
            queues: vec![QueueSpec::unlimited("default", None)],
            default_parent: None,
        }
    }

    /// Reads a node table (`sn,cpu_milli,memory_mib,gpu,model` for openb;
    /// `machine,gpu_type,cap_cpu,cap_mem,cap_gpu` without header for PAI).
    pub fn from_node_table(name: &str, text: &str, pai: bool) -> Self {
        let mut shapes: BTreeMap<(u32, String, u64, u64), usize> = BTreeMap::new();
        for (i, line) in text.lines().enumerate() {
            if (!pai && i == 0) || line.trim().is_empty() {
                continue;
            }
            let f: Vec<&str> = line.split(',').map(str::trim).collect();
            let parsed = if pai {
                (|| {
                    Some((
                        f.get(4)?.parse().ok()?,
                        f.get(1)?.to_string(),
                        f.get(2)?.parse::<u64>().ok()? * 1000,
                        f.get(3)?.parse::<u64>().ok()? * 1024,
                    ))
                })()
            } else {
                (|| {
                    Some((
                        f.get(3)?.parse().ok()?,
                        f.get(4)?.to_string(),
                        f.get(1)?.parse().ok()?,
                        f.get(2)?.parse().ok()?,
                    ))
                })()
            };
            if let Some(k) = parsed {
                *shapes.entry(k).or_default() += 1;
            }
        }
        let mem_of = |m: &str| match m {
            "P100" | "T4" | "V100M16" | "V100" => 16,
            "A10" => 24,
            _ => 32,
        };
        ClusterSpec {
            name: name.into(),
            node_groups: shapes
                .into_iter()
                .map(|((gpus, model, cpu, mem), count)| NodeGroup {
                    count,
                    gpus,
                    gpu_memory_gib: mem_of(&model),
                    gpu_model: if gpus == 0 { "none".into() } else { model },
                    islands: 1,
                    cpu_millis: cpu,
                    memory_mib: mem,
                    nodes_per_leaf: 32,
                    leaves_per_spine: 8,
                })
                .collect(),
            queues: Vec::new(),
            default_parent: None,
        }
    }

    /// The built-in cluster for a trace or a cluster name.
    pub fn builtin(name: &str, traces: &Path) -> Result<Self, ClusterError> {
        match name {
            "philly" | "philly-excerpt" => Ok(Self::philly()),
            n if n.starts_with("chronus") => Ok(Self::chronus()),
            "tiresias" | "tiresias-60" => Ok(Self::tiresias()),
            "openb" => {
                let p = traces.join("alibaba-openb-2023/openb_node_list_all_node.csv");
                Ok(Self::from_node_table(
                    "openb",
                    &trace::read_plain(&p)?,
                    false,
                ))
            }
            "pai" => {
                let p = traces.join("alibaba-pai-2020/pai_machine_spec.csv");
                Ok(Self::from_node_table("pai", &trace::read_plain(&p)?, true))
            }
            _ => Err(ClusterError::Unknown(name.into())),
        }
    }

    /// Total GPUs.
    pub fn gpus(&self) -> u64 {
        self.node_groups
            .iter()
            .map(|g| g.count as u64 * u64::from(g.gpus))
            .sum()
    }

    /// Builds the scheduler's state; queues named in `extra_queues` but not
    /// declared are created without quota under `default_parent`.
    pub fn build(
        &self,
        extra_queues: &[String],
        config: StateConfig,
    ) -> Result<ClusterState, ClusterError> {
        let err = |e| ClusterError::State(self.name.clone(), e);
        let mut s = ClusterState::new(config);
        let mut i = 0usize;
        for (gi, g) in self.node_groups.iter().enumerate() {
            for k in 0..g.count {
                let leaf = i / g.nodes_per_leaf.max(1);
                let spine = leaf / g.leaves_per_spine.max(1);
                let per_island = (g.gpus / g.islands.max(1)).max(1);
                let node = NodeSpec {
                    name: format!("{}-g{gi}-{k:05}", self.name),
                    gpus: (0..g.gpus)
                        .map(|index| Gpu {
                            index,
                            model: g.gpu_model.clone(),
                            memory_gib: g.gpu_memory_gib,
                            healthy: true,
                            island: index / per_island,
                            ..Gpu::default()
                        })
                        .collect(),
                    cpu_millis: g.cpu_millis,
                    memory_mib: g.memory_mib,
                    leaf: format!("leaf{leaf:04}"),
                    spine: format!("spine{spine:03}"),
                    labels: BTreeMap::new(),
                    cordoned: false,
                    address: String::new(),
                    agent_url: None,
                };
                s.add_node(node).map_err(err)?;
                i += 1;
            }
        }
        if i == 0 {
            return Err(ClusterError::Empty(self.name.clone()));
        }
        for q in &self.queues {
            s.add_queue(q.clone()).map_err(err)?;
        }
        for q in extra_queues {
            if s.queue_index(q).is_none() {
                s.add_queue(QueueSpec::unlimited(q, self.default_parent.as_deref()))
                    .map_err(err)?;
            }
        }
        s.check_quota_tree().map_err(err)?;
        Ok(s)
    }

    /// The same cluster with node counts scaled by `factor` (at least one node
    /// per group; node shape kept) and every nominal quota scaled by the real
    /// change in GPUs, rounded down so the tree stays valid.
    pub fn scaled(&self, factor: f64) -> Self {
        let mut c = self.clone();
        let before = self.gpus().max(1) as f64;
        for g in &mut c.node_groups {
            g.count = ((g.count as f64 * factor).round() as usize).max(1);
        }
        let f = c.gpus() as f64 / before;
        for q in &mut c.queues {
            if let Some(n) = q.quota.nominal.gpus.as_mut() {
                *n = (*n as f64 * f).floor() as u64;
            }
        }
        c.name = format!("{}-x{:.2}", self.name, f);
        c
    }

    /// Node-partition mode: each queue of `queues` gets its own nodes (in
    /// proportion to its nominal GPU quota, equal shares for queues without
    /// one; at least one node each while nodes last), marked with the queue's
    /// partition model so only its jobs land there; queues keep no quota (the
    /// partition is the quota). Philly's per-VC clusters worked this way.
    pub fn partitioned(&self, queues: &[String]) -> Self {
        let weight = |q: &str| -> f64 {
            self.queues
                .iter()
                .find(|s| s.name == q)
                .and_then(|s| s.quota.nominal.gpus)
                .map_or(0.0, |n| n as f64)
        };
        let leaves: Vec<&String> = queues.iter().collect();
        let known: Vec<f64> = leaves.iter().map(|q| weight(q)).collect();
        let mean = {
            let k: Vec<f64> = known.iter().copied().filter(|w| *w > 0.0).collect();
            if k.is_empty() {
                1.0
            } else {
                k.iter().sum::<f64>() / k.len() as f64
            }
        };
        let w: Vec<f64> = known
            .iter()
            .map(|x| if *x > 0.0 { *x } else { mean })
            .collect();
        let wsum: f64 = w.iter().sum::<f64>().max(1e-9);
        let mut groups = Vec::new();
        for g in &self.node_groups {
            // Largest-remainder split of this group's nodes.
            let exact: Vec<f64> = w.iter().map(|x| x / wsum * g.count as f64).collect();
            let mut n: Vec<usize> = exact.iter().map(|e| e.floor() as usize).collect();
            let mut left = g.count.saturating_sub(n.iter().sum());
            let mut order: Vec<usize> = (0..n.len()).collect();
            order.sort_by(|a, b| {
                (exact[*b] - exact[*b].floor()).total_cmp(&(exact[*a] - exact[*a].floor()))
            });
            for &i in order.iter().cycle().take(order.len() * 2) {
                if left == 0 {
                    break;
                }
                n[i] += 1;
                left -= 1;
            }
            for (i, q) in leaves.iter().enumerate() {
                if n[i] > 0 {
                    groups.push(NodeGroup {
                        count: n[i],
                        gpu_model: partition_model(q),
                        ..g.clone()
                    });
                }
            }
        }
        ClusterSpec {
            name: format!("{}-partitioned", self.name),
            node_groups: groups,
            queues: Vec::new(),
            default_parent: None,
        }
    }

    /// A copy with every queue's borrowing limit set to zero (capacity scheduling).
    pub fn without_borrowing(&self) -> Self {
        let mut c = self.clone();
        for q in &mut c.queues {
            if q.quota.nominal.gpus.is_some() && q.parent.is_some() {
                q.quota.borrowing_limit = ResourceLimits::gpus(0);
            }
        }
        c
    }

    /// A copy without quotas (policies that ignore them).
    pub fn without_quotas(&self) -> Self {
        let mut c = self.clone();
        for q in &mut c.queues {
            q.quota = Default::default();
        }
        c
    }
}
