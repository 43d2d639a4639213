//! Nodes, their GPUs and where they sit in the network topology.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One physical GPU: an indivisible device.
///
/// Every field after `island` is optional on the wire and omitted while
/// unset, so a peer one minor version older reads a declared GPU unchanged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// Device index on its node (NVML's index; ranks are given UUIDs or
    /// these in PCI bus order).
    pub index: u32,
    /// Model name: the full NVML name where the agent found one (`NVIDIA
    /// A100-SXM4-80GB`), else the declared model (`H100`). Requests match it
    /// by [`gpu_model_matches`].
    pub model: String,
    /// Device memory in whole GiB, rounded down (kept for older peers; the
    /// exact size is `memory_mib`).
    pub memory_gib: u32,
    /// Unhealthy GPUs (XID errors, failed checks) are never assigned.
    #[serde(default = "yes")]
    pub healthy: bool,
    /// NVLink/NVSwitch island within the node; GPUs of one island talk at NVLink speed.
    #[serde(default)]
    pub island: u32,
    /// Device memory in MiB as the driver reports it (81,559 for an H100
    /// 80GB); `None` for a declared GPU, whose size is `memory_gib` GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// The device's UUID (`GPU-…`), when discovered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// PCI bus id (`00000000:18:00.0`), when discovered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
    /// NUMA node of the GPU's PCI root, when the machine has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// MIG mode is enabled: the GPU is split into instances and is never
    /// handed out as a whole GPU.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mig: bool,
    /// Why the GPU is unhealthy (an XID, lost from the bus, ECC, row
    /// remapping, an operator's mark).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Default for Gpu {
    /// A healthy declared GPU with no facts beyond the defaults.
    fn default() -> Self {
        Gpu {
            index: 0,
            model: String::new(),
            memory_gib: 0,
            healthy: true,
            island: 0,
            memory_mib: None,
            uuid: None,
            pci_bus_id: None,
            numa_node: None,
            mig: false,
            reason: None,
        }
    }
}

impl Gpu {
    /// Memory in MiB: the reported size, else the declared GiB.
    pub fn memory_mib(&self) -> u64 {
        self.memory_mib
            .unwrap_or_else(|| u64::from(self.memory_gib) * 1024)
    }

    /// Whether this GPU may be handed out whole: healthy and not split by MIG.
    pub fn assignable(&self) -> bool {
        self.healthy && !self.mig
    }
}

/// The class of an unhealthy GPU's reason, as a metric label and for node
/// blame: `xid_N` (a critical XID other than an application one),
/// `xid_unknown`, `gpu_lost`, `ecc_uncorrected`, `row_remapping_failed`,
/// `row_remapping_pending`, or `other` (an operator's mark, a health check).
/// The agent writes the reasons these prefixes come from.
pub fn gpu_fault_cause(reason: &str) -> String {
    if let Some(rest) = reason.strip_prefix("XID ") {
        let n: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if !n.is_empty() && n.len() <= 5 {
            return format!("xid_{n}");
        }
    }
    let cause = if reason.starts_with("critical XID") {
        "xid_unknown"
    } else if reason.starts_with("GPU lost") {
        "gpu_lost"
    } else if reason.contains("uncorrected ECC") {
        "ecc_uncorrected"
    } else if reason.starts_with("row remapping failed") {
        "row_remapping_failed"
    } else if reason.starts_with("row remapping pending") {
        "row_remapping_pending"
    } else {
        "other"
    };
    cause.to_string()
}

fn yes() -> bool {
    true
}

/// Whether a GPU of `memory_mib` MiB satisfies `min_gpu_memory_gib: gb`.
///
/// The number is read as the card's marketed size (decimal gigabytes, as
/// NVIDIA labels them): a GPU fits when it reports at least `gb` × 10^9
/// bytes. Every card sold as N GB does (an H100 80GB reports 81,559 MiB,
/// 85.5 × 10^9 bytes; an L4 24GB 23,034 MiB, 24.2 × 10^9), while rounding
/// its MiB down to GiB (79) would refuse it.
pub fn gpu_memory_fits(memory_mib: u64, gb: u32) -> bool {
    u128::from(memory_mib) * (1 << 20) >= u128::from(gb) * 1_000_000_000
}

/// The words of a model name: lower case, split at spaces, `-` and `_`,
/// without a leading `nvidia` or `tesla`.
fn model_words(name: &str) -> Vec<String> {
    let mut words: Vec<String> = name
        .split(|c: char| c.is_whitespace() || c == '-' || c == '_')
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .collect();
    while words.first().is_some_and(|w| w == "nvidia" || w == "tesla") {
        words.remove(0);
    }
    words
}

/// Whether a job's `gpu_model` request matches a GPU's model name.
///
/// Case and the `NVIDIA`/`Tesla` prefixes are ignored. The first word is the
/// family and must be equal (`A100` never matches `A10`); every further word
/// of the request must be one of the GPU's words, so `A100` matches every
/// A100 and `A100-80GB`, `A100 PCIe` or the full NVML name narrow it. The
/// form factor also counts as a word: `sxm` for names with `SXM4`/`SXM5` and
/// for HBM parts that are neither `PCIe` nor `NVL` (`NVIDIA H100 80GB HBM3`
/// is the SXM5 H100), `pcie` and `nvl` from the name.
pub fn gpu_model_matches(request: &str, model: &str) -> bool {
    let want = model_words(request);
    let have = model_words(model);
    let (Some(family), Some(their_family)) = (want.first(), have.first()) else {
        return false;
    };
    if family != their_family {
        return false;
    }
    let has = |w: &str| have.iter().any(|h| h == w);
    let sxm = have.iter().any(|h| h.starts_with("sxm"))
        || (have.iter().any(|h| h.starts_with("hbm")) && !has("pcie") && !has("nvl"));
    want[1..].iter().all(|w| has(w) || (w == "sxm" && sxm))
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
                    ..Gpu::default()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_requests_match_families_and_narrow_by_words() {
        let a100_sxm = "NVIDIA A100-SXM4-80GB";
        let a100_pcie = "NVIDIA A100 80GB PCIe";
        let a100_40 = "NVIDIA A100-SXM4-40GB";
        let h100 = "NVIDIA H100 80GB HBM3";
        let h100_pcie = "NVIDIA H100 PCIe";
        let l4 = "NVIDIA L4";
        for m in [a100_sxm, a100_pcie, a100_40] {
            assert!(gpu_model_matches("A100", m), "{m}");
            assert!(gpu_model_matches("a100", m), "{m}");
        }
        assert!(gpu_model_matches("A100-80GB", a100_sxm));
        assert!(gpu_model_matches("A100-80GB", a100_pcie));
        assert!(!gpu_model_matches("A100-80GB", a100_40));
        assert!(gpu_model_matches("A100-SXM", a100_sxm));
        assert!(!gpu_model_matches("A100-SXM", a100_pcie));
        assert!(gpu_model_matches("A100 PCIe", a100_pcie));
        assert!(gpu_model_matches(a100_sxm, a100_sxm));
        assert!(gpu_model_matches("nvidia a100-sxm4-80gb", a100_sxm));
        assert!(gpu_model_matches("Tesla A100-SXM4-80GB", a100_sxm));
        assert!(gpu_model_matches("H100", h100));
        assert!(gpu_model_matches("H100-SXM", h100));
        assert!(!gpu_model_matches("H100-SXM", h100_pcie));
        assert!(gpu_model_matches("H100-PCIe", h100_pcie));
        assert!(gpu_model_matches("L4", l4));
        // A family is a whole word: A10 is not A100, L4 is not L40.
        assert!(!gpu_model_matches("A10", a100_sxm));
        assert!(!gpu_model_matches("L40", l4));
        assert!(!gpu_model_matches("A100", h100));
        assert!(
            !gpu_model_matches("NVIDIA", h100),
            "the prefix alone names nothing"
        );
        // Declared models match themselves.
        assert!(gpu_model_matches("h100", "H100"));
        assert!(!gpu_model_matches("H100-80GB", "H100"));
    }

    #[test]
    fn marketed_sizes_fit_what_the_cards_report() {
        // (reported MiB, marketed GB): from NVIDIA's specifications and nvidia-smi.
        for (mib, gb) in [
            (81_559, 80),   // H100 80GB HBM3
            (81_920, 80),   // A100-SXM4-80GB
            (40_960, 40),   // A100 40GB
            (23_034, 24),   // L4
            (143_771, 141), // H200
            (16_160, 16),   // V100 16GB
        ] {
            assert!(gpu_memory_fits(mib, gb), "{mib} MiB is a {gb} GB card");
            assert!(
                !gpu_memory_fits(mib, gb + 10),
                "{mib} MiB is not {} GB",
                gb + 10
            );
        }
        assert!(!gpu_memory_fits(40_960, 80));
        assert!(gpu_memory_fits(0, 0));
        assert!(!gpu_memory_fits(0, u32::MAX));
        assert!(gpu_memory_fits(u64::MAX, u32::MAX), "no overflow");
    }

    #[test]
    fn fault_causes_name_the_class_of_a_reason() {
        for (reason, cause) in [
            ("XID 79: GPU has fallen off the bus", "xid_79"),
            ("XID 48: double-bit ECC error", "xid_48"),
            ("critical XID error (no number reported)", "xid_unknown"),
            ("GPU lost: GPU 2 has fallen off the bus", "gpu_lost"),
            ("3 uncorrected ECC errors", "ecc_uncorrected"),
            (
                "row remapping failed: the GPU's memory cannot be repaired",
                "row_remapping_failed",
            ),
            (
                "row remapping pending: the GPU needs a reset",
                "row_remapping_pending",
            ),
            ("marked unhealthy in the health file", "other"),
            ("XID 999999999: made up", "other"),
        ] {
            assert_eq!(gpu_fault_cause(reason), cause, "{reason}");
        }
    }

    #[test]
    fn declared_gpus_keep_their_old_wire_form() {
        let g = Gpu {
            index: 1,
            model: "H100".into(),
            memory_gib: 80,
            ..Gpu::default()
        };
        let text = serde_json::to_string(&g).expect("json");
        assert_eq!(
            text,
            r#"{"index":1,"model":"H100","memory_gib":80,"healthy":true,"island":0}"#
        );
        assert_eq!(g.memory_mib(), 80 * 1024);
        let old: Gpu = serde_json::from_str(r#"{"index":1,"model":"H100","memory_gib":80}"#)
            .expect("an old record loads");
        assert_eq!(old, g);
    }
}
