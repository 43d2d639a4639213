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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Inventory;
    use crate::discovery::{discover, islands};
    use std::path::Path;

    fn shipped(name: &str) -> crate::discovery::Discovery {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/machines")
            .join(name);
        discover(&Inventory::Machine(p)).expect(name)
    }

    #[test]
    fn cpu_lists_round_trip() {
        assert_eq!(cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(cpu_list(&[5]), "5");
        assert_eq!(cpu_list(&[]), "");
        let parsed = crate::gpu_source::parse_cpu_list("0-55,112-167").expect("parse");
        assert_eq!(cpu_list(&parsed), "0-55,112-167");
    }

    #[test]
    fn islands_follow_the_peers_links_reach() {
        let bus: Vec<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
        let direct = vec![
            vec!["b".into()],
            vec!["a".into()],
            vec!["D".into()],
            vec!["c".into()],
        ];
        assert_eq!(islands(&bus, &direct), vec![0, 0, 2, 2]);
        let switched = vec![vec!["sw".into()]; 4];
        assert_eq!(islands(&bus, &switched), vec![0, 0, 0, 0]);
        let none: Vec<Vec<String>> = vec![Vec::new(); 4];
        assert_eq!(islands(&bus, &none), vec![0, 1, 2, 3]);
        // A chain is one island; "has any link" alone is not.
        let chain = vec![
            vec!["b".into()],
            vec!["c".into()],
            Vec::new(),
            vec!["x".into()],
        ];
        assert_eq!(islands(&bus, &chain), vec![0, 0, 0, 3]);
    }

    #[test]
    fn dgx_h100_ranks_get_their_uuids_numa_cpus_and_own_hcas() {
        let d = shipped("dgx-h100.yaml");
        let all: Vec<u32> = (0..224).collect();
        let b = bind(&d.gpus, &d.topology, &[1], 4000, &all);
        assert_eq!(b.env["CUDA_DEVICE_ORDER"], "PCI_BUS_ID");
        assert_eq!(
            b.env["CUDA_VISIBLE_DEVICES"],
            "GPU-h100-0000-4000-8000-000000000001"
        );
        assert_eq!(b.env_defaults["NCCL_IB_HCA"], "=mlx5_3");
        assert_eq!(b.env["GANGWAY_CPUS"], "0-55,112-167");
        assert_eq!(b.cpus.len(), 112);
        assert_eq!(b.device_ids, vec!["GPU-h100-0000-4000-8000-000000000001"]);
        // Across both sockets: both NUMA nodes, each GPU's own HCA, in PCI order.
        let b = bind(&d.gpus, &d.topology, &[5, 2], 8000, &all);
        assert_eq!(b.env["GANGWAY_NUMA_NODES"], "0-1");
        assert_eq!(b.env_defaults["NCCL_IB_HCA"], "=mlx5_4,mlx5_9");
        assert!(b.env["CUDA_VISIBLE_DEVICES"].starts_with("GPU-h100-0000-4000-8000-000000000002,"));
        // A CPU request larger than the node: no pinning, with the reason.
        let b = bind(&d.gpus, &d.topology, &[0], 200_000, &all);
        assert!(b.cpus.is_empty());
        assert!(b
            .no_affinity
            .as_deref()
            .is_some_and(|w| w.contains("200 CPUs asked")));
        // This host lacks the recorded CPUs: no pinning either.
        let b = bind(&d.gpus, &d.topology, &[0], 1000, &[0, 1]);
        assert!(b.cpus.is_empty() && !b.env.contains_key("GANGWAY_CPUS"));
        assert!(b
            .no_affinity
            .as_deref()
            .is_some_and(|w| w.contains("not all this host's")));
        // No GPUs: nothing to bind.
        assert_eq!(
            bind(&d.gpus, &d.topology, &[], 1000, &all),
            Binding::default()
        );
    }

    #[test]
    fn nics_by_numa_when_paths_are_unknown_and_none_without_hcas() {
        let d = shipped("a100-pcie-nvlink-pairs.yaml");
        let b = bind(&d.gpus, &d.topology, &[2, 3], 1000, &[]);
        assert_eq!(b.env_defaults["NCCL_IB_HCA"], "=mlx5_1");
        let d = shipped("hgx-a100-80gb.yaml");
        let b = bind(&d.gpus, &d.topology, &[6, 7], 1000, &[]);
        assert_eq!(b.env_defaults["NCCL_IB_HCA"], "=mlx5_8,mlx5_9");
        let d = shipped("l4x8-pcie.yaml");
        let b = bind(&d.gpus, &d.topology, &[0], 1000, &[]);
        assert!(!b.env_defaults.contains_key("NCCL_IB_HCA"));
    }

    #[test]
    fn declared_gpus_keep_indices_in_order() {
        let d = discover(&Inventory::Declared {
            gpus: 4,
            model: "H100".into(),
            memory_gib: 80,
            nvlink_all: true,
        })
        .expect("declared");
        let b = bind(&d.gpus, &d.topology, &[3, 2], 1000, &[0, 1]);
        assert_eq!(b.env["CUDA_VISIBLE_DEVICES"], "2,3");
        assert_eq!(b.env["CUDA_DEVICE_ORDER"], "PCI_BUS_ID");
        assert!(b.cpus.is_empty());
    }

    #[test]
    fn a_cpu_set_pins_a_child() {
        let host = host_cpus();
        let Some(&first) = host.first() else {
            panic!("no CPU to run on");
        };
        let set = CpuSet::new(&[first]).expect("set");
        let mut cmd = std::process::Command::new("grep");
        cmd.args(["Cpus_allowed_list", "/proc/self/status"]);
        // SAFETY: apply makes one system call.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || set.apply());
        }
        let out = cmd.output().expect("grep");
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            text.split_whitespace().nth(1),
            Some(first.to_string().as_str()),
            "{text}"
        );
        assert!(CpuSet::new(&[]).is_none());
    }
}
