//! One cgroup v2 per rank under `<agent's cgroup>/<parent>`.

use super::{
    cgroup_pids, parent_dir, remove_cgroup, write_file, Container, Join, Limits, ProcTrack,
    ProcTrackError, ProcTrackKind,
};
use std::path::PathBuf;

/// cgroup v2 tracking.
pub struct CgroupV2 {
    parent: PathBuf,
    cpu: bool,
    memory: bool,
    pids: bool,
}

impl CgroupV2 {
    /// Uses (creating it) `<unified mount>/<own cgroup>/<parent>`, enabling
    /// the cpu and memory controllers for its children where the host allows.
    pub fn new(parent: &str) -> Result<Self, ProcTrackError> {
        let dir = parent_dir(None, parent).ok_or_else(|| {
            ProcTrackError::Unavailable("cgroup-v2", "no writable unified hierarchy".into())
        })?;
        let available = std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
        let has = |c: &str| available.split_whitespace().any(|x| x == c);
        for c in ["cpu", "memory", "pids"] {
            if has(c) {
                let _ = std::fs::write(dir.join("cgroup.subtree_control"), format!("+{c}"));
            }
        }
        let enabled =
            std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
        let on = |c: &str| enabled.split_whitespace().any(|x| x == c);
        Ok(CgroupV2 {
            cpu: on("cpu"),
            memory: on("memory"),
            pids: on("pids"),
            parent: dir,
        })
    }

    /// Whether both CPU and memory limits can be enforced.
    pub fn has_limits(&self) -> bool {
        self.cpu && self.memory
    }
}

impl ProcTrack for CgroupV2 {
    fn kind(&self) -> ProcTrackKind {
        ProcTrackKind::CgroupV2
    }

    fn create(&self, name: &str, limits: Limits) -> Result<Container, ProcTrackError> {
        let dir = self.parent.join(name);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ProcTrackError::Io(dir.display().to_string(), e))?;
        if limits.cpu_millis > 0 && self.cpu {
            // cpu.max: quota and period in microseconds; 1000 millis = one period.
            let quota = limits.cpu_millis.saturating_mul(100);
            write_file(&dir.join("cpu.max"), &format!("{quota} 100000"))?;
            let weight = limits.cpu_weight();
            write_file(&dir.join("cpu.weight"), &weight.to_string())?;
        }
        if limits.pids > 0 && self.pids {
            write_file(&dir.join("pids.max"), &limits.pids.to_string())?;
        }
        if limits.memory_mib > 0 && self.memory {
            let bytes = limits.memory_mib.saturating_mul(1024 * 1024);
            write_file(&dir.join("memory.max"), &bytes.to_string())?;
        }
        if (limits.cpu_millis > 0 && !self.cpu)
            || (limits.memory_mib > 0 && !self.memory)
            || (limits.pids > 0 && !self.pids)
        {
            tracing::debug!(
                "{name}: cgroup v2 without cpu/memory/pids controllers; limits not enforced"
            );
        }
        Ok(Container {
            name: name.to_string(),
            cgroups: vec![dir],
        })
    }

    fn join(&self, c: &Container) -> Join {
        Join::for_cgroups(&c.cgroups)
    }

    fn adopt(&self, _c: &Container, _pid: i32) {}

    fn pids(&self, c: &Container) -> Vec<i32> {
        c.cgroups
            .first()
            .map(|d| cgroup_pids(d))
            .unwrap_or_default()
    }

    fn signal(&self, c: &Container, sig: i32) {
        if sig == libc::SIGKILL {
            // Atomic: nothing forks away between listing and killing.
            if let Some(d) = c.cgroups.first() {
                if std::fs::write(d.join("cgroup.kill"), "1").is_ok() {
                    return;
                }
            }
        }
        for pid in self.pids(c) {
            // SAFETY: kill(2) on a process of the rank's cgroup.
            unsafe {
                libc::kill(pid, sig);
            }
        }
    }

    fn oom_kills(&self, c: &Container) -> u64 {
        let Some(d) = c.cgroups.first() else {
            return 0;
        };
        std::fs::read_to_string(d.join("memory.events"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
            .unwrap_or(0)
    }

    fn sweep(&self, keep: &[Container]) {
        super::sweep_dir(&self.parent, keep);
    }

    fn destroy(&self, c: &Container) {
        for d in &c.cgroups {
            remove_cgroup(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_setsid_double_fork_escapee_is_tracked_and_killed() {
        let parent = format!("gangway-test-{}", std::process::id());
        let t = match CgroupV2::new(&parent) {
            Ok(t) => t,
            Err(e) => {
                return gangway_store::testing::skip_or_fail(
                    "GANGWAY_REQUIRE_CGROUP_V2",
                    &format!("cgroup v2 is not usable here: {e}"),
                );
            }
        };
        super::super::testing::check(&t, "v2-escapee");
        remove_cgroup(&t.parent);
    }
}
