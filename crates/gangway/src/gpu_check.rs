//! `gangway agent --check`: what the agent finds on this machine (or a
//! recorded one), as a human reads `nvidia-smi topo -m`: GPUs, islands,
//! NUMA nodes and NICs, what a 1-, 2-, 4- and 8-GPU rank would be given
//! (the scheduler's own GPU choice on an empty node, and the agent's
//! binding), and warnings.

use anyhow::Result;
use gangway_agent::binding::{bind, cpu_list};
use gangway_agent::discovery::{discover, Discovery};
use gangway_agent::Inventory;
use gangway_core::NodeSpec;
use gangway_sched::{ClusterState, StateConfig};
use std::collections::BTreeSet;
use std::fmt::Write;
use std::path::Path;

/// Discovers and prints the report.
pub fn print(inv: &Inventory, state_dir: &Path) -> Result<()> {
    let d = discover(inv)?;
    // Scripted events at time 0 land before the report is read.
    std::thread::sleep(std::time::Duration::from_millis(200));
    print!("{}", report(&d, state_dir)?);
    Ok(())
}

fn list(xs: impl IntoIterator<Item = u32>) -> String {
    cpu_list(&xs.into_iter().collect::<Vec<_>>())
}

/// The report's text.
pub fn report(d: &Discovery, state_dir: &Path) -> Result<String> {
    let mut o = String::new();
    let gpus = &d.gpus;
    let topo = &d.topology;
    writeln!(o, "Source: {}", d.source)?;
    let health = d.health(state_dir);
    writeln!(o, "\nGPUs ({}):", gpus.len())?;
    writeln!(
        o,
        "  {:<4} {:<28} {:>11}  {:<42} {:<18} {:>4} {:>6}  HEALTH",
        "IDX", "NAME", "MEMORY", "UUID", "PCI BUS ID", "NUMA", "ISLAND"
    )?;
    for (g, h) in gpus.iter().zip(&health) {
        let state = match (&h.reason, g.mig) {
            (Some(r), _) => format!("unhealthy: {r}"),
            (None, true) => "healthy, MIG enabled".to_string(),
            (None, false) => "healthy".to_string(),
        };
        writeln!(
            o,
            "  {:<4} {:<28} {:>7} MiB  {:<42} {:<18} {:>4} {:>6}  {state}",
            g.index,
            g.model,
            g.memory_mib(),
            g.uuid.as_deref().unwrap_or("-"),
            g.pci_bus_id.as_deref().unwrap_or("-"),
            g.numa_node.map_or("-".to_string(), |n| n.to_string()),
            g.island,
        )?;
    }
    let islands: BTreeSet<u32> = gpus.iter().map(|g| g.island).collect();
    writeln!(o, "\nNVLink islands:")?;
    for i in &islands {
        let members: Vec<u32> = gpus
            .iter()
            .filter(|g| g.island == *i)
            .map(|g| g.index)
            .collect();
        let kind = if members.len() > 1 {
            "NVLink"
        } else {
            "no NVLink peer (PCIe)"
        };
        writeln!(o, "  island {i}: GPUs {} ({kind})", list(members))?;
    }
    writeln!(o, "\nNUMA nodes:")?;
    if topo.numa_cpus.is_empty() {
        writeln!(o, "  none known")?;
    }
    for (n, cpus) in &topo.numa_cpus {
        let on = |x: Option<u32>| x == Some(*n);
        let g: Vec<u32> = gpus
            .iter()
            .filter(|g| on(g.numa_node))
            .map(|g| g.index)
            .collect();
        let nics: Vec<&str> = topo
            .nics
            .iter()
            .filter(|x| on(x.numa_node))
            .map(|x| x.name.as_str())
            .collect();
        writeln!(
            o,
            "  node {n}: CPUs {} ({}), GPUs {}, NICs {}",
            cpu_list(cpus),
            cpus.len(),
            if g.is_empty() { "-".into() } else { list(g) },
            if nics.is_empty() {
                "-".into()
            } else {
                nics.join(",")
            }
        )?;
    }
    writeln!(o, "\nNICs:")?;
    if topo.nics.is_empty() {
        writeln!(o, "  none found")?;
    }
    for n in &topo.nics {
        writeln!(
            o,
            "  {}: NUMA {}, PCI {}",
            n.name,
            n.numa_node.map_or("-".to_string(), |x| x.to_string()),
            n.pci_path.as_deref().unwrap_or("-")
        )?;
    }

    // The scheduler's choice on this node, empty.
    let mut state = ClusterState::new(StateConfig::default());
    let mut spec = NodeSpec::uniform("check", "leaf0", "spine0", 0, "", 0);
    spec.gpus = gpus.clone();
    for (g, h) in spec.gpus.iter_mut().zip(&health) {
        g.healthy = h.healthy;
    }
    let machine_cpus: Vec<u32> = topo.numa_cpus.values().flatten().copied().collect();
    writeln!(o, "\nA rank of N GPUs (1 CPU per GPU) would get:")?;
    match state.add_node(spec) {
        Err(e) => writeln!(o, "  nothing: the scheduler refuses this node: {e}")?,
        Ok(_) => {
            let info = &state.nodes()[0];
            let usable = info.healthy.count_ones();
            for n in [1u64, 2, 4, 8] {
                if n > u64::from(usable) {
                    writeln!(
                        o,
                        "  {n} GPU(s): cannot run here ({usable} assignable GPUs)"
                    )?;
                    continue;
                }
                let Some((masks, one_island)) =
                    gangway_sched::placement::pick_gpus(info, info.healthy, n, 1)
                else {
                    writeln!(o, "  {n} GPU(s): no placement")?;
                    continue;
                };
                let mask = masks.first().copied().unwrap_or(0);
                let chosen: Vec<u32> = (0..gpus.len())
                    .filter(|k| mask & (1 << k) != 0)
                    .map(|k| gpus[k].index)
                    .collect();
                let host = if machine_cpus.is_empty() {
                    gangway_agent::binding::host_cpus()
                } else {
                    machine_cpus.clone()
                };
                let b = bind(gpus, topo, &chosen, n * 1000, &host);
                let get = |k: &str| {
                    b.env
                        .get(k)
                        .or_else(|| b.env_defaults.get(k))
                        .cloned()
                        .unwrap_or_else(|| "-".into())
                };
                writeln!(
                    o,
                    "  {n} GPU(s): GPUs {} ({})\n      CUDA_VISIBLE_DEVICES={}\n      CPUs: {}\n      NCCL_IB_HCA={}",
                    list(chosen),
                    if one_island { "one NVLink island" } else { "across islands, over PCIe" },
                    get("CUDA_VISIBLE_DEVICES"),
                    match &b.no_affinity {
                        None => format!("{} (NUMA {})", get("GANGWAY_CPUS"), get("GANGWAY_NUMA_NODES")),
                        Some(why) => format!("not pinned: {why}"),
                    },
                    get("NCCL_IB_HCA"),
                )?;
            }
        }
    }

    let mut warnings = Vec::new();
    let kinds: BTreeSet<(String, u64)> = gpus
        .iter()
        .map(|g| (g.model.clone(), g.memory_mib()))
        .collect();
    if kinds.len() > 1 {
        warnings.push(format!(
            "mixed GPU models on one node ({}): Gangway requires one model and memory size per node",
            kinds
                .iter()
                .map(|(m, mib)| format!("{m} {mib} MiB"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let no_numa: Vec<u32> = gpus
        .iter()
        .filter(|g| g.numa_node.is_none())
        .map(|g| g.index)
        .collect();
    if !no_numa.is_empty() && d.source != "declared" {
        warnings.push(format!(
            "GPUs {} have no NUMA node: ranks on them are not pinned to CPUs",
            list(no_numa)
        ));
    }
    for (g, inst) in gpus.iter().zip(&topo.mig_instances) {
        if g.mig {
            warnings.push(format!(
                "GPU {} has MIG enabled (instances: {}): it is never handed out as a whole GPU",
                g.index,
                if inst.is_empty() {
                    "none".into()
                } else {
                    inst.join(", ")
                }
            ));
        }
    }
    for (i, e) in d.watch_errors() {
        warnings.push(format!("GPU {i}: XID events not watched: {e}"));
    }
    if topo.nics.is_empty() && d.source != "declared" {
        warnings.push("no InfiniBand/RoCE adapter found: NCCL_IB_HCA is not set".into());
    }
    writeln!(o, "\nWarnings:")?;
    if warnings.is_empty() {
        writeln!(o, "  none")?;
    }
    for w in warnings {
        writeln!(o, "  - {w}")?;
    }
    Ok(o)
}
