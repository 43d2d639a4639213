//! What is free right now: per-node free GPU masks, CPU and memory, an index of
//! nodes by free-GPU count per GPU class, free GPUs per leaf switch, and queue
//! usage. The cluster state keeps one live copy, updated incrementally; each
//! scheduling session clones it and works on its private copy.

use crate::bitset::Bitset;
use crate::model::{NodeInfo, QueueInfo};
use gangway_core::{Resource, Resources};

pub use crate::model::{NodeIdx, QueueId};

/// Mutable view of free resources and queue usage.
#[derive(Clone, Debug, Default)]
pub struct Capacity {
    /// Per node: GPUs that are healthy, unallocated and on a schedulable node.
    pub free: Vec<u64>,
    /// Per node: GPUs bound to jobs (healthy or not).
    pub alloc: Vec<u64>,
    /// Per node: unallocated CPU.
    pub free_cpu: Vec<u64>,
    /// Per node: unallocated memory.
    pub free_mem: Vec<u64>,
    /// `index[class][k]`: schedulable nodes of that GPU class with exactly `k` free GPUs.
    pub index: Vec<Vec<Bitset>>,
    /// Free GPUs under each leaf switch.
    pub leaf_free: Vec<u64>,
    /// Free GPUs in the cluster.
    pub free_total: u64,
    /// Per queue: usage of its whole subtree.
    pub usage: Vec<Resources>,
    /// Per queue: its subtree's *demand* on its parent: own jobs' usage plus,
    /// for each child, the larger of the child's demand and the part of its
    /// nominal quota it does not lend. Quota limits are checked against it, so
    /// nobody borrows what a sibling keeps for itself.
    pub demand: Vec<Resources>,
    /// Per queue: usage of its subtree by non-preemptible jobs, which must stay
    /// within nominal at every level (they cannot be reclaimed).
    pub fixed: Vec<Resources>,
    /// Usage charged to the cluster root (all queues).
    pub root_usage: Resources,
    /// Demand on the whole cluster.
    pub root_demand: Resources,
    /// When on: every node whose free GPUs, CPU or memory changed, in order
    /// (duplicates kept). A scheduling session turns it on so the plan's
    /// reusable timeline copy can follow the session's binds node by node
    /// instead of copying the whole capacity for every planned job.
    pub(crate) journal: Option<Vec<NodeIdx>>,
}

impl Capacity {
    /// Sets node `n`'s free mask and keeps the index, leaf sums and totals in step.
    pub fn set_free(&mut self, nodes: &[NodeInfo], n: NodeIdx, mask: u64) {
        let i = n as usize;
        let old = self.free[i];
        let info = &nodes[i];
        let (oc, nc) = (u64::from(old.count_ones()), u64::from(mask.count_ones()));
        if let Some(class) = info.class {
            let b = &mut self.index[class as usize];
            b[oc as usize].remove(i);
            if info.schedulable() {
                b[nc as usize].insert(i);
            }
        }
        let leaf = &mut self.leaf_free[info.leaf as usize];
        *leaf = *leaf + nc - oc;
        self.free_total = self.free_total + nc - oc;
        self.free[i] = mask;
        if let Some(j) = &mut self.journal {
            j.push(n);
        }
    }

    /// Recomputes node `n`'s free mask from its allocation, health and schedulability.
    pub fn refresh_node(&mut self, nodes: &[NodeInfo], n: NodeIdx) {
        let info = &nodes[n as usize];
        let mask = if info.schedulable() {
            info.healthy & !self.alloc[n as usize]
        } else {
            0
        };
        self.set_free(nodes, n, mask);
    }

    /// Takes GPUs `mask`, `cpu` and `mem` on node `n`. The caller has checked they are free.
    pub fn take(&mut self, nodes: &[NodeInfo], n: NodeIdx, mask: u64, cpu: u64, mem: u64) {
        let i = n as usize;
        debug_assert_eq!(self.alloc[i] & mask, 0, "GPU double-booked");
        self.alloc[i] |= mask;
        self.free_cpu[i] -= cpu;
        self.free_mem[i] -= mem;
        let m = self.free[i] & !mask;
        self.set_free(nodes, n, m);
    }

    /// Gives back GPUs `mask`, `cpu` and `mem` on node `n`.
    pub fn give(&mut self, nodes: &[NodeInfo], n: NodeIdx, mask: u64, cpu: u64, mem: u64) {
        let i = n as usize;
        self.alloc[i] &= !mask;
        self.free_cpu[i] += cpu;
        self.free_mem[i] += mem;
        let info = &nodes[i];
        let m = if info.schedulable() {
            self.free[i] | (mask & info.healthy)
        } else {
            0
        };
        self.set_free(nodes, n, m);
    }

    /// Adds `r` (or removes it, when `add` is false) to queue `q` and all its
    /// ancestors; `fixed` for non-preemptible jobs.
    pub fn charge(
        &mut self,
        queues: &[QueueInfo],
        q: QueueId,
        r: Resources,
        add: bool,
        fixed: bool,
    ) {
        let sign = if add { 1i128 } else { -1 };
        let mut delta = Resource::ALL.map(|res| sign * i128::from(r.get(res)));
        for &n in &queues[q as usize].path {
            let n = n as usize;
            let u = &mut self.usage[n];
            *u = if add { *u + r } else { *u - r };
            if fixed {
                let f = &mut self.fixed[n];
                *f = if add { *f + r } else { *f - r };
            }
            let floor = queues[n].floor();
            let d = &mut self.demand[n];
            for (i, res) in Resource::ALL.iter().enumerate() {
                let old = i128::from(d.get(*res));
                let new = (old + delta[i]).max(0);
                *d.get_mut(*res) = new as u64;
                let f = i128::from(floor.get(*res));
                delta[i] = new.max(f) - old.max(f);
            }
        }
        self.root_usage = if add {
            self.root_usage + r
        } else {
            self.root_usage - r
        };
        for (i, res) in Resource::ALL.iter().enumerate() {
            let v = self.root_demand.get_mut(*res);
            *v = (i128::from(*v) + delta[i]).max(0) as u64;
        }
    }

    /// Recomputes every queue's demand from usage (after the queue tree changed).
    /// Queues are stored parents-first, so a reverse walk sees children first.
    pub fn recompute_demand(&mut self, queues: &[QueueInfo]) {
        self.demand = self.usage.clone();
        for n in (0..queues.len()).rev() {
            let mut d = self.usage[n];
            for &c in &queues[n].children {
                d = d - self.usage[c as usize];
                let dc = self.demand[c as usize];
                let fc = queues[c as usize].floor();
                d += Resources {
                    gpus: dc.gpus.max(fc.gpus),
                    cpu_millis: dc.cpu_millis.max(fc.cpu_millis),
                    memory_mib: dc.memory_mib.max(fc.memory_mib),
                };
            }
            self.demand[n] = d;
        }
        let mut root = Resources::ZERO;
        for (n, q) in queues.iter().enumerate() {
            if q.parent.is_none() {
                let dn = self.demand[n];
                let f = q.floor();
                root += Resources {
                    gpus: dn.gpus.max(f.gpus),
                    cpu_millis: dn.cpu_millis.max(f.cpu_millis),
                    memory_mib: dn.memory_mib.max(f.memory_mib),
                };
            }
        }
        self.root_demand = root;
    }
}
