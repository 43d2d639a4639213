//! Per-rank limits, on by default so one careless rank cannot take the node
//! from its neighbours: processes (a pids limit), memory (the request, else
//! the node's memory divided by its GPUs times the rank's GPUs, like Slurm's
//! `DefMemPerGPU`) and CPU (a share by request). A queue may change them
//! (`node_policy.limits`). Enforced by the rank's cgroup (v1 or v2), by
//! rlimits under the subreaper fallback, and by Docker's host config.

use crate::proctrack::Limits;
use gangway_core::node_policy::RankLimitPolicy;

/// Processes a rank may have at once when its queue says nothing.
pub const DEFAULT_PIDS: u64 = 4096;

/// The memory a node offers: what was declared, capped at what the machine
/// really has (a declared size above it would let ranks' default shares add
/// up past the real memory).
pub fn node_memory_mib(declared: u64, real: u64) -> u64 {
    match (declared, real) {
        (0, r) => r,
        (d, 0) => d,
        (d, r) => d.min(r),
    }
}

/// A rank's memory limit in MiB: its request, else the queue's
/// per-GPU default times its GPUs, else the node's memory divided by its
/// GPUs times the rank's GPUs (the whole node's memory for a rank on a node
/// without GPUs, or a rank without any).
pub fn rank_memory_mib(
    request_mib: u64,
    policy: &RankLimitPolicy,
    node_memory_mib: u64,
    node_gpus: u32,
    rank_gpus: u32,
) -> u64 {
    if request_mib > 0 {
        return request_mib;
    }
    if node_gpus == 0 || rank_gpus == 0 {
        return node_memory_mib;
    }
    let per_gpu = policy
        .memory_mib_per_gpu
        .unwrap_or(node_memory_mib / u64::from(node_gpus));
    per_gpu
        .saturating_mul(u64::from(rank_gpus))
        .min(node_memory_mib)
        .max(1)
}

/// The limits of one rank on this node.
pub fn rank_limits(
    cpu_millis: u64,
    memory_request_mib: u64,
    policy: &RankLimitPolicy,
    node_memory_mib: u64,
    node_gpus: u32,
    rank_gpus: u32,
) -> Limits {
    Limits {
        cpu_millis,
        memory_mib: rank_memory_mib(
            memory_request_mib,
            policy,
            node_memory_mib,
            node_gpus,
            rank_gpus,
        ),
        pids: policy.pids.unwrap_or(DEFAULT_PIDS),
    }
}

/// The rlimits the subreaper fallback sets before exec, where no cgroup
/// holds the rank: address space for memory, and `RLIMIT_NPROC` for
/// processes (counted per Unix account by the kernel, the closest it has).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rlimits {
    /// `RLIMIT_AS` in bytes (0: none).
    pub address_space: u64,
    /// `RLIMIT_NPROC` (0: none).
    pub processes: u64,
}

impl Rlimits {
    /// From a rank's limits.
    pub fn of(l: Limits) -> Self {
        Rlimits {
            address_space: l.memory_mib.saturating_mul(1 << 20),
            processes: l.pids,
        }
    }

    /// Sets them on the calling process.
    ///
    /// # Safety
    /// Only `setrlimit`: meant for the child between fork and exec.
    pub unsafe fn apply(&self) -> std::io::Result<()> {
        for (resource, value) in [
            (libc::RLIMIT_AS, self.address_space),
            (libc::RLIMIT_NPROC, self.processes),
        ] {
            if value == 0 {
                continue;
            }
            let r = libc::rlimit {
                rlim_cur: value,
                rlim_max: value,
            };
            if libc::setrlimit(resource, &r) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// How a limit stop reads in the job's events: `memory limit 2.9 GiB
/// reached (OOM-killed)`.
pub fn memory_limit_text(memory_mib: u64) -> String {
    format!("memory limit {} reached (OOM-killed)", gib(memory_mib))
}

/// MiB as GiB with one decimal (`2.9 GiB`), or MiB below one GiB.
pub fn gib(mib: u64) -> String {
    if mib < 1024 {
        format!("{mib} MiB")
    } else {
        format!("{:.1} GiB", mib as f64 / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_defaults_to_the_per_gpu_share_of_real_memory() {
        let none = RankLimitPolicy::default();
        // 8 GPUs and 23.5 GiB: a 1-GPU rank gets 2.9 GiB.
        assert_eq!(rank_memory_mib(0, &none, 24_064, 8, 1), 3_008);
        assert_eq!(gib(3_008), "2.9 GiB");
        // A request wins; a queue's per-GPU default replaces the share.
        assert_eq!(rank_memory_mib(512, &none, 24_064, 8, 1), 512);
        let q = RankLimitPolicy {
            memory_mib_per_gpu: Some(1000),
            ..RankLimitPolicy::default()
        };
        assert_eq!(rank_memory_mib(0, &q, 24_064, 8, 2), 2000);
        // Never above the node.
        assert_eq!(rank_memory_mib(0, &q, 1500, 8, 2), 1500);
        // Declared memory is capped at the real one.
        assert_eq!(node_memory_mib(128 * 1024 * 8, 24_064), 24_064);
        assert_eq!(node_memory_mib(0, 24_064), 24_064);
    }

    #[test]
    fn pids_and_cpu_defaults() {
        let l = rank_limits(1500, 0, &RankLimitPolicy::default(), 8192, 2, 1);
        assert_eq!(l.pids, DEFAULT_PIDS);
        assert_eq!(l.memory_mib, 4096);
        assert_eq!(l.cpu_shares(), 1536);
        assert_eq!(Limits::default().cpu_shares(), 2);
        assert_eq!(
            Limits {
                cpu_millis: 1000,
                ..l
            }
            .cpu_weight(),
            100
        );
        let q = RankLimitPolicy {
            pids: Some(64),
            ..RankLimitPolicy::default()
        };
        assert_eq!(rank_limits(0, 0, &q, 8192, 2, 1).pids, 64);
    }
}
