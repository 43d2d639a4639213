//! What a rank is bound to beyond its GPU indices: the same devices named the
//! way CUDA cannot misread (`CUDA_DEVICE_ORDER=PCI_BUS_ID`, UUIDs where
//! known), the CPUs of its GPUs' NUMA node when its CPU request fits there,
//! and the InfiniBand adapters nearest its GPUs (`NCCL_IB_HCA`), as Slurm's
//! `--gpu-bind=closest` and NCCL's topology search expect (docs/JOB_ENV.md).

use crate::discovery::Topology;
use gangway_core::Gpu;
use std::collections::{BTreeMap, BTreeSet};

/// A rank's binding.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Binding {
    /// Variables set on the rank (over what `rank_env` gave).
    pub env: BTreeMap<String, String>,
    /// Variables set only where the job did not set them itself.
    pub env_defaults: BTreeMap<String, String>,
    /// CPUs to pin the rank to (empty: no pinning).
    pub cpus: Vec<u32>,
    /// Device ids for the container runtime (UUIDs where known).
    pub device_ids: Vec<String>,
    /// Why there is no CPU pinning, when there is none.
    pub no_affinity: Option<String>,
}

/// Formats CPUs the way the kernel lists them (`0-3,8`).
pub fn cpu_list(cpus: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut sorted: Vec<u32> = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            sorted[i].to_string()
        } else {
            format!("{}-{}", sorted[i], sorted[j])
        });
        i = j + 1;
    }
    out.join(",")
}

fn common_prefix(a: &str, b: &str) -> usize {
    a.split('/')
        .zip(b.split('/'))
        .take_while(|(x, y)| x == y)
        .count()
}

/// The InfiniBand adapters nearest `gpu`: those sharing the longest part of
/// its PCI path (the same PCIe switch), else those on its NUMA node.
pub fn nearest_nics(gpu: &Gpu, path: Option<&str>, topo: &Topology) -> Vec<String> {
    let same_numa = |n: &crate::gpu_source::Nic| match (gpu.numa_node, n.numa_node) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    };
    if let Some(path) = path {
        let scored: Vec<(usize, &str)> = topo
            .nics
            .iter()
            .filter(|n| same_numa(n))
            .filter_map(|n| Some((common_prefix(path, n.pci_path.as_deref()?), n.name.as_str())))
            .collect();
        if let Some(best) = scored.iter().map(|(s, _)| *s).max() {
            return scored
                .iter()
                .filter(|(s, _)| *s == best)
                .map(|(_, n)| n.to_string())
                .collect();
        }
    }
    if gpu.numa_node.is_none() {
        return Vec::new();
    }
    topo.nics
        .iter()
        .filter(|n| n.numa_node.is_some() && same_numa(n))
        .map(|n| n.name.clone())
        .collect()
}

/// The binding of a rank given `assigned` (GPU indices) of the node's
/// `gpus`, asking `cpu_millis` CPU; `host_cpus` are the CPUs this agent may
/// run work on (a recorded machine's CPUs that this host lacks are not
/// pinned to).
pub fn bind(
    gpus: &[Gpu],
    topo: &Topology,
    assigned: &[u32],
    cpu_millis: u64,
    host_cpus: &[u32],
) -> Binding {
    let mut b = Binding::default();
    let mut mine: Vec<(usize, &Gpu)> = gpus
        .iter()
        .enumerate()
        .filter(|(_, g)| assigned.contains(&g.index))
        .collect();
    if mine.is_empty() {
        return b;
    }
    // PCI bus order, the order CUDA numbers them in with PCI_BUS_ID.
    mine.sort_by(|a, b| {
        let key = |g: &Gpu| g.pci_bus_id.as_deref().map(str::to_ascii_lowercase);
        key(a.1).cmp(&key(b.1)).then(a.1.index.cmp(&b.1.index))
    });
    b.env
        .insert("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into());
    let uuids: Option<Vec<String>> = mine.iter().map(|(_, g)| g.uuid.clone()).collect();
    let indices: Vec<String> = mine.iter().map(|(_, g)| g.index.to_string()).collect();
    let visible = uuids.clone().unwrap_or_else(|| indices.clone());
    b.env
        .insert("CUDA_VISIBLE_DEVICES".into(), visible.join(","));
    b.device_ids = uuids.unwrap_or(indices);

    let numa: BTreeSet<u32> = mine.iter().filter_map(|(_, g)| g.numa_node).collect();
    let all_known = mine.iter().all(|(_, g)| g.numa_node.is_some());
    let cpus: Vec<u32> = numa
        .iter()
        .flat_map(|n| topo.numa_cpus.get(n).cloned().unwrap_or_default())
        .collect();
    let need = cpu_millis.div_ceil(1000);
    b.no_affinity = if !all_known || numa.is_empty() {
        Some("the GPUs have no NUMA node".into())
    } else if cpus.is_empty() {
        Some("the NUMA nodes' CPUs are unknown".into())
    } else if need > cpus.len() as u64 {
        Some(format!(
            "{need} CPUs asked, NUMA node(s) {} have {}",
            cpu_list(&numa.iter().copied().collect::<Vec<_>>()),
            cpus.len()
        ))
    } else if !cpus.iter().all(|c| host_cpus.contains(c)) {
        Some(format!(
            "CPUs {} are not all this host's ({})",
            cpu_list(&cpus),
            cpu_list(host_cpus)
        ))
    } else {
        None
    };
    if b.no_affinity.is_none() {
        let nodes: Vec<u32> = numa.iter().copied().collect();
        b.env.insert("GANGWAY_NUMA_NODES".into(), cpu_list(&nodes));
        b.env.insert("GANGWAY_CPUS".into(), cpu_list(&cpus));
        b.cpus = cpus;
    }

    // In the GPUs' order, each adapter once.
    let mut hcas: Vec<String> = Vec::new();
    for (pos, g) in &mine {
        let path = topo.gpu_paths.get(*pos).and_then(|p| p.as_deref());
        for n in nearest_nics(g, path, topo) {
            if !hcas.contains(&n) {
                hcas.push(n);
            }
        }
    }
    if !hcas.is_empty() {
        // `=` asks NCCL for these names exactly (mlx5_1 would also match mlx5_10).
        b.env_defaults
            .insert("NCCL_IB_HCA".into(), format!("={}", hcas.join(",")));
    }
    b
}

/// The CPUs this process may run on.
pub fn host_cpus() -> Vec<u32> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it for this process.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as u32)
            .filter(|c| libc::CPU_ISSET(*c as usize, &set))
            .collect()
    }
}

/// A CPU set ready for `sched_setaffinity` in a forked child (built before
/// the fork: only the system call runs after it).
#[derive(Clone, Copy)]
pub struct CpuSet(libc::cpu_set_t);

impl CpuSet {
    /// The set of `cpus` (those beyond `CPU_SETSIZE` are left out); `None` when empty.
    pub fn new(cpus: &[u32]) -> Option<Self> {
        if cpus.is_empty() {
            return None;
        }
        // SAFETY: cpu_set_t is plain data, zero is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for c in cpus {
            if (*c as usize) < libc::CPU_SETSIZE as usize {
                // SAFETY: the index is within the set, checked above.
                unsafe { libc::CPU_SET(*c as usize, &mut set) };
            }
        }
        Some(CpuSet(set))
    }

    /// Pins the calling process (async-signal-safe: one system call).
    pub fn apply(&self) -> std::io::Result<()> {
        // SAFETY: a valid set of the size passed.
        let rc =
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.0) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

impl std::fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CpuSet")
    }
}
