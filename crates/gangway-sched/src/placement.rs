//! Gang placement: all replicas or none, topology- and fragmentation-aware.
//!
//! - A gang that fits in one node goes on one node, in one NVLink island when
//!   possible, on the node with the *fewest* free GPUs that still fit it
//!   (best fit), so whole free nodes stay whole for big gangs.
//! - A larger gang takes whole free nodes first, under the fewest leaf
//!   switches: the best-fitting single leaf, else the best-fitting spine, else
//!   the largest leaves first.
//!
//! Ties break by node index, so placement is deterministic.

use crate::bitset::Bitset;
use crate::capacity::{Capacity, NodeIdx};
use crate::state::{ClusterState, NodeInfo, Placement, ReplicaPlacement};
use gangway_core::{Resources, TopologyConstraint, TopologyLevel};
use serde::Serialize;

/// What to place.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    /// Replicas in the gang.
    pub replicas: u32,
    /// Per replica.
    pub per: Resources,
    /// GPU classes allowed (bit per class).
    pub class_mask: u64,
    /// Topology constraint.
    pub constraint: TopologyConstraint,
    /// Nodes that may not be used (reserved for another gang).
    pub exclude: Option<&'a Bitset>,
}

/// Why a gang could not be placed now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FitFailure {
    /// The gang must go on one node and no node has room.
    OneNode {
        /// GPUs needed on one node.
        need: u64,
        /// Largest free block among matching nodes.
        largest_free: u64,
        /// Where that block is.
        node: Option<NodeIdx>,
        /// When that block has GPUs enough: the CPU or memory its node
        /// lacks (else the reason would read as if GPUs were missing).
        #[serde(skip_serializing_if = "Option::is_none")]
        short: Option<Shortage>,
    },
    /// Not enough room across nodes.
    Spread {
        /// Replicas needed.
        replicas: u32,
        /// GPUs per replica.
        gpus_per_replica: u64,
        /// Replicas the free GPUs could host (anywhere, or in the best leaf when `one_leaf`).
        hostable: u64,
        /// Whether the gang must stay under one leaf switch.
        one_leaf: bool,
    },
}

/// What a node with GPUs enough lacks for a gang: CPU or memory, free
/// against needed for the whole gang on that node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "resource", rename_all = "snake_case")]
pub enum Shortage {
    /// Too few free CPUs (millicores).
    Cpu {
        /// Free on the node.
        free_millis: u64,
        /// Needed.
        need_millis: u64,
    },
    /// Too little free memory (MiB).
    Memory {
        /// Free on the node.
        free_mib: u64,
        /// Needed.
        need_mib: u64,
    },
}

/// What node `n` lacks besides GPUs to host `replicas` of `per`, if anything.
fn shortage(cap: &Capacity, n: usize, per: &Resources, replicas: u64) -> Option<Shortage> {
    let need_cpu = per.cpu_millis.saturating_mul(replicas);
    let need_mem = per.memory_mib.saturating_mul(replicas);
    if cap.free_cpu[n] < need_cpu {
        Some(Shortage::Cpu {
            free_millis: cap.free_cpu[n],
            need_millis: need_cpu,
        })
    } else if cap.free_mem[n] < need_mem {
        Some(Shortage::Memory {
            free_mib: cap.free_mem[n],
            need_mib: need_mem,
        })
    } else {
        None
    }
}

/// Places a gang on `cap`, or says why it cannot.
pub fn place(
    state: &ClusterState,
    cap: &Capacity,
    req: &Request<'_>,
) -> Result<Placement, FitFailure> {
    let g = req.per.gpus;
    let need = g * u64::from(req.replicas);
    let max_node = if g == 0 {
        u64::MAX
    } else {
        state.max_node_gpus(req.class_mask)
    };
    let single_only = match req.constraint {
        TopologyConstraint::Node => true,
        TopologyConstraint::Auto => need <= max_node,
        TopologyConstraint::Leaf | TopologyConstraint::Any => false,
    };
    let try_single = need <= max_node;
    if try_single {
        if let Some(p) = place_one_node(state, cap, req) {
            return Ok(p);
        }
        if single_only {
            let (largest_free, node) = largest_block(state, cap, req);
            let short = node
                .filter(|_| largest_free >= need)
                .and_then(|n| shortage(cap, n as usize, &req.per, u64::from(req.replicas)));
            return Err(FitFailure::OneNode {
                need,
                largest_free,
                node,
                short,
            });
        }
    }
    place_spread(state, cap, req)
}

/// Whether a replica of `g` GPUs of the classes in `mask` may use this node.
/// CPU-only replicas (`g == 0`) may use any node.
fn class_ok(info: &NodeInfo, mask: u64, g: u64) -> bool {
    match info.class {
        Some(c) => g == 0 || mask & (1 << c) != 0,
        None => g == 0,
    }
}

/// How many replicas of `per` fit in what node `n` has free.
pub(crate) fn hostable(info: &NodeInfo, cap: &Capacity, n: usize, per: &Resources) -> u64 {
    let mut h = u64::MAX;
    for (have, per) in [
        (u64::from(cap.free[n].count_ones()), per.gpus),
        (cap.free_cpu[n], per.cpu_millis),
        (cap.free_mem[n], per.memory_mib),
    ] {
        if let Some(k) = have.checked_div(per) {
            h = h.min(k);
        }
    }
    if !info.schedulable() || h == u64::MAX {
        0
    } else {
        h
    }
}

fn place_one_node(state: &ClusterState, cap: &Capacity, req: &Request<'_>) -> Option<Placement> {
    let g = req.per.gpus;
    let r = u64::from(req.replicas);
    let need = g * r;
    // First pass: the whole group inside one NVLink island; second: anywhere on the node.
    let multi_island = state.has_multi_island_nodes();
    let mut one_island = multi_island;
    let fits = |n: usize, one_island: bool| {
        let info = &state.nodes()[n];
        hostable(info, cap, n, &req.per) >= r
            && (!one_island
                || info
                    .islands
                    .iter()
                    .any(|m| u64::from((cap.free[n] & m).count_ones()) >= need))
    };
    let chosen = if g == 0 {
        // CPU-only: nodes without GPUs first, so GPU nodes keep their CPU and
        // memory for GPU work; then any node with room.
        let ok = |n: usize| req.exclude.is_none_or(|e| !e.contains(n)) && fits(n, false);
        let nodes = state.nodes();
        (0..nodes.len())
            .find(|&n| nodes[n].class.is_none() && ok(n))
            .or_else(|| (0..nodes.len()).find(|&n| ok(n)))
    } else {
        let mut found = None;
        let top = state.max_node_gpus(req.class_mask) as usize;
        loop {
            for f in need as usize..=top {
                let mut best: Option<usize> = None;
                for (c, buckets) in cap.index.iter().enumerate() {
                    if req.class_mask & (1 << c) == 0 {
                        continue;
                    }
                    if let Some(n) = buckets[f]
                        .iter_excluding(req.exclude)
                        .find(|&n| fits(n, one_island))
                    {
                        best = Some(best.map_or(n, |b: usize| b.min(n)));
                    }
                }
                if best.is_some() {
                    found = best;
                    break;
                }
            }
            if found.is_some() || !one_island {
                break;
            }
            one_island = false;
        }
        found
    }?;
    let info = &state.nodes()[chosen];
    let (masks, one_island) = pick_gpus(info, cap.free[chosen], g, req.replicas)?;
    Some(Placement {
        replicas: masks
            .into_iter()
            .map(|gpus| ReplicaPlacement {
                node: chosen as NodeIdx,
                gpus,
            })
            .collect(),
        level: if one_island {
            TopologyLevel::Island
        } else {
            TopologyLevel::Node
        },
    })
}

fn lowest_bits(mut m: u64, k: u64) -> u64 {
    let mut out = 0;
    for _ in 0..k {
        let b = m & m.wrapping_neg();
        out |= b;
        m &= !b;
    }
    out
}

/// Chooses GPUs for `replicas` replicas of `g` GPUs from `free` on one node:
/// one best-fitting NVLink island for the whole group when possible, else a
/// best-fitting island per replica, else the largest islands first.
/// Returns the masks and whether all sit in one island.
pub fn pick_gpus(info: &NodeInfo, free: u64, g: u64, replicas: u32) -> Option<(Vec<u64>, bool)> {
    let r = u64::from(replicas);
    if g == 0 {
        return Some((vec![0; replicas as usize], true));
    }
    if u64::from(free.count_ones()) < g * r {
        return None;
    }
    let island_free = |free: u64| -> Vec<(u64, u64)> {
        info.islands
            .iter()
            .map(|m| (u64::from((free & m).count_ones()), *m))
            .collect()
    };
    let best_island = |free: u64, k: u64| {
        island_free(free)
            .into_iter()
            .filter(|(c, _)| *c >= k)
            .min_by_key(|(c, _)| *c)
            .map(|(_, m)| m)
    };
    let split = |mut m: u64| {
        (0..replicas)
            .map(|_| {
                let part = lowest_bits(m, g);
                m &= !part;
                part
            })
            .collect::<Vec<_>>()
    };
    if let Some(island) = best_island(free, g * r) {
        return Some((split(lowest_bits(free & island, g * r)), true));
    }
    let mut left = free;
    let mut out = Vec::with_capacity(replicas as usize);
    for _ in 0..replicas {
        let m = if let Some(island) = best_island(left, g) {
            lowest_bits(left & island, g)
        } else {
            let mut isl = island_free(left);
            isl.sort_by_key(|(c, _)| std::cmp::Reverse(*c));
            let mut m = 0;
            let mut k = g;
            for (c, island) in isl {
                let take = c.min(k);
                m |= lowest_bits(left & island, take);
                k -= take;
                if k == 0 {
                    break;
                }
            }
            m
        };
        left &= !m;
        out.push(m);
    }
    Some((out, false))
}

fn largest_block(
    state: &ClusterState,
    cap: &Capacity,
    req: &Request<'_>,
) -> (u64, Option<NodeIdx>) {
    let top = state.max_node_gpus(req.class_mask) as usize;
    for f in (1..=top).rev() {
        let mut best: Option<usize> = None;
        for (c, buckets) in cap.index.iter().enumerate() {
            if req.class_mask & (1 << c) == 0 {
                continue;
            }
            if let Some(n) = buckets[f].iter_excluding(req.exclude).next() {
                best = Some(best.map_or(n, |b: usize| b.min(n)));
            }
        }
        if let Some(n) = best {
            return (f as u64, Some(n as NodeIdx));
        }
    }
    (0, None)
}

fn place_spread(
    state: &ClusterState,
    cap: &Capacity,
    req: &Request<'_>,
) -> Result<Placement, FitFailure> {
    let g = req.per.gpus;
    let want = u64::from(req.replicas);
    let nodes = state.nodes();
    let leaves = state.leaves();
    // Hostable replicas per node, grouped per leaf.
    let mut per_leaf: Vec<(u64, Vec<(u64, NodeIdx)>)> = Vec::with_capacity(leaves.len());
    for (li, leaf) in leaves.iter().enumerate() {
        let mut v = Vec::new();
        let mut total = 0;
        if g == 0 || cap.leaf_free[li] >= g {
            for &n in &leaf.nodes {
                let ni = n as usize;
                if req.exclude.is_some_and(|e| e.contains(ni))
                    || !class_ok(&nodes[ni], req.class_mask, g)
                {
                    continue;
                }
                let h = hostable(&nodes[ni], cap, ni, &req.per);
                if h > 0 {
                    total += h;
                    v.push((h, n));
                }
            }
        }
        per_leaf.push((total, v));
    }
    let one_leaf = req.constraint == TopologyConstraint::Leaf;
    let fail = |hostable| FitFailure::Spread {
        replicas: req.replicas,
        gpus_per_replica: g,
        hostable,
        one_leaf,
    };
    // Fewest leaves: the best-fitting leaf that holds the whole gang.
    let best_leaf = per_leaf
        .iter()
        .enumerate()
        .filter(|(_, (t, _))| *t >= want)
        .min_by_key(|(i, (t, _))| (*t, *i))
        .map(|(i, _)| i);
    let chosen_leaves: Vec<usize> = if let Some(l) = best_leaf {
        vec![l]
    } else if one_leaf {
        let best = per_leaf.iter().map(|(t, _)| *t).max().unwrap_or(0);
        return Err(fail(best));
    } else {
        let by_size = |ls: &mut Vec<usize>| {
            ls.sort_by_key(|&l| (std::cmp::Reverse(per_leaf[l].0), l));
        };
        let spines = state.spines();
        let spine_total = |s: usize| -> u64 {
            spines[s]
                .leaves
                .iter()
                .map(|&l| per_leaf[l as usize].0)
                .sum()
        };
        let best_spine = (0..spines.len())
            .filter(|&s| spine_total(s) >= want)
            .min_by_key(|&s| (spine_total(s), s));
        let mut ls: Vec<usize> = match best_spine {
            Some(s) => spines[s].leaves.iter().map(|&l| l as usize).collect(),
            None => (0..leaves.len()).collect(),
        };
        ls.retain(|&l| per_leaf[l].0 > 0);
        by_size(&mut ls);
        let total: u64 = ls.iter().map(|&l| per_leaf[l].0).sum();
        if total < want {
            return Err(fail(total));
        }
        // Keep only as many leaves as needed (largest first).
        let mut acc = 0;
        let mut keep = Vec::new();
        for l in ls {
            if acc >= want {
                break;
            }
            acc += per_leaf[l].0;
            keep.push(l);
        }
        keep
    };
    let mut left = want;
    let mut replicas = Vec::with_capacity(req.replicas as usize);
    for l in &chosen_leaves {
        let mut cands = per_leaf[*l].1.clone();
        cands.sort_by_key(|(h, n)| (std::cmp::Reverse(*h), *n));
        let mut used = vec![false; cands.len()];
        while left > 0 {
            // Finish on the smallest node that covers the rest; otherwise take the largest.
            let finisher = cands
                .iter()
                .enumerate()
                .filter(|(i, (h, _))| !used[*i] && *h >= left)
                .min_by_key(|(i, (h, _))| (*h, *i))
                .map(|(i, _)| i);
            let pick = finisher.or_else(|| (0..cands.len()).find(|i| !used[*i]));
            let Some(i) = pick else { break };
            used[i] = true;
            let (h, n) = cands[i];
            let k = h.min(left);
            let info = &nodes[n as usize];
            let (masks, _) = pick_gpus(info, cap.free[n as usize], g, k as u32).ok_or(fail(0))?;
            replicas.extend(
                masks
                    .into_iter()
                    .map(|gpus| ReplicaPlacement { node: n, gpus }),
            );
            left -= k;
        }
        if left == 0 {
            break;
        }
    }
    if left > 0 {
        return Err(fail(want - left));
    }
    let level = span_level(state, &replicas);
    Ok(Placement { replicas, level })
}

/// The widest topology level a set of replicas spans.
pub fn span_level(state: &ClusterState, replicas: &[ReplicaPlacement]) -> TopologyLevel {
    let nodes = state.nodes();
    let Some(first) = replicas.first() else {
        return TopologyLevel::Island;
    };
    let f = &nodes[first.node as usize];
    if replicas.iter().all(|r| r.node == first.node) {
        let all: u64 = replicas.iter().fold(0, |a, r| a | r.gpus);
        return if f.islands.iter().any(|i| all & !i == 0) {
            TopologyLevel::Island
        } else {
            TopologyLevel::Node
        };
    }
    if replicas
        .iter()
        .all(|r| nodes[r.node as usize].leaf == f.leaf)
    {
        TopologyLevel::Leaf
    } else if replicas
        .iter()
        .all(|r| nodes[r.node as usize].spine == f.spine)
    {
        TopologyLevel::Spine
    } else {
        TopologyLevel::Cluster
    }
}
