//! One cgroup per rank in each cgroup v1 hierarchy: freezer (to kill without
//! races) and pids (to list), memory and cpu (limits).

use super::{
    cgroup_pids, mount_point, parent_dir, remove_cgroup, write_file, Container, Join, Limits,
    ProcTrack, ProcTrackError, ProcTrackKind,
};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const CONTROLLERS: [&str; 4] = ["freezer", "pids", "memory", "cpu"];

/// cgroup v1 tracking.
pub struct CgroupV1 {
    /// (controller, parent directory) for each mounted, writable controller;
    /// the first tracks processes.
    parents: Vec<(&'static str, PathBuf)>,
}

impl CgroupV1 {
    /// Uses `<mount>/<own cgroup>/<parent>` in each hierarchy; needs freezer or pids.
    pub fn new(parent: &str) -> Result<Self, ProcTrackError> {
        let parents: Vec<(&'static str, PathBuf)> = CONTROLLERS
            .iter()
            .filter(|c| mount_point(Some(c)).is_some())
            .filter_map(|c| Some((*c, parent_dir(Some(c), parent)?)))
            .collect();
        if !parents.iter().any(|(c, _)| *c == "freezer" || *c == "pids") {
            return Err(ProcTrackError::Unavailable(
                "cgroup-v1",
                "no writable freezer or pids hierarchy".into(),
            ));
        }
        Ok(CgroupV1 { parents })
    }

    /// The container's directory in a controller's hierarchy, told by a
    /// file only that controller has (mount names vary: `cpu,cpuacct`).
    fn dir(c: &Container, controller: &str) -> Option<PathBuf> {
        let marker = match controller {
            "freezer" => "freezer.state",
            "pids" => "pids.max",
            "memory" => "memory.limit_in_bytes",
            _ => "cpu.cfs_quota_us",
        };
        c.cgroups.iter().find(|d| d.join(marker).exists()).cloned()
    }

    fn set_frozen(c: &Container, frozen: bool) -> bool {
        let Some(d) = Self::dir(c, "freezer") else {
            return false;
        };
        let state = if frozen { "FROZEN" } else { "THAWED" };
        if std::fs::write(d.join("freezer.state"), state).is_err() {
            return false;
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            let now = std::fs::read_to_string(d.join("freezer.state")).unwrap_or_default();
            if now.trim() == state {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }
}

impl ProcTrack for CgroupV1 {
    fn kind(&self) -> ProcTrackKind {
        ProcTrackKind::CgroupV1
    }

    fn create(&self, name: &str, limits: Limits) -> Result<Container, ProcTrackError> {
        let mut cgroups = Vec::new();
        for (ctrl, parent) in &self.parents {
            let dir = parent.join(name);
            std::fs::create_dir_all(&dir)
                .map_err(|e| ProcTrackError::Io(dir.display().to_string(), e))?;
            match *ctrl {
                "memory" if limits.memory_mib > 0 => {
                    let bytes = limits.memory_mib.saturating_mul(1024 * 1024);
                    write_file(&dir.join("memory.limit_in_bytes"), &bytes.to_string())?;
                }
                "cpu" if limits.cpu_millis > 0 => {
                    write_file(&dir.join("cpu.cfs_period_us"), "100000")?;
                    let quota = limits.cpu_millis.saturating_mul(100);
                    write_file(&dir.join("cpu.cfs_quota_us"), &quota.to_string())?;
                    let shares = limits.cpu_shares();
                    write_file(&dir.join("cpu.shares"), &shares.to_string())?;
                }
                "pids" if limits.pids > 0 => {
                    write_file(&dir.join("pids.max"), &limits.pids.to_string())?;
                }
                _ => {}
            }
            cgroups.push(dir);
        }
        Ok(Container {
            name: name.to_string(),
            cgroups,
        })
    }

    fn join(&self, c: &Container) -> Join {
        Join::for_cgroups(&c.cgroups)
    }

    fn adopt(&self, _c: &Container, _pid: i32) {}

    fn pids(&self, c: &Container) -> Vec<i32> {
        Self::dir(c, "freezer")
            .or_else(|| Self::dir(c, "pids"))
            .map(|d| cgroup_pids(&d))
            .unwrap_or_default()
    }

    fn signal(&self, c: &Container, sig: i32) {
        // A frozen cgroup cannot fork: every process of it gets the kill.
        let frozen = sig == libc::SIGKILL && Self::set_frozen(c, true);
        for pid in self.pids(c) {
            // SAFETY: kill(2) on a process of the rank's cgroup.
            unsafe {
                libc::kill(pid, sig);
            }
        }
        if frozen {
            Self::set_frozen(c, false);
        }
    }

    fn oom_kills(&self, c: &Container) -> u64 {
        let Some(d) = Self::dir(c, "memory") else {
            return 0;
        };
        std::fs::read_to_string(d.join("memory.oom_control"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
            .unwrap_or(0)
    }

    fn sweep(&self, keep: &[Container]) {
        for (_, p) in &self.parents {
            super::sweep_dir(p, keep);
        }
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
        let t = match CgroupV1::new(&parent) {
            Ok(t) => t,
            Err(e) => {
                return gangway_store::testing::skip_or_fail(
                    "GANGWAY_REQUIRE_CGROUP_V1",
                    &format!("cgroup v1 is not usable here: {e}"),
                );
            }
        };
        super::super::testing::check(&t, "v1-escapee");
        let c = t
            .create(
                "v1-limits",
                Limits {
                    cpu_millis: 1500,
                    memory_mib: 64,
                    pids: 100,
                },
            )
            .expect("container");
        if let Some(d) = CgroupV1::dir(&c, "memory") {
            let v = std::fs::read_to_string(d.join("memory.limit_in_bytes")).expect("read");
            assert_eq!(v.trim(), (64u64 << 20).to_string());
        }
        if let Some(d) = CgroupV1::dir(&c, "cpu") {
            let v = std::fs::read_to_string(d.join("cpu.cfs_quota_us")).expect("read");
            assert_eq!(v.trim(), "150000");
            let v = std::fs::read_to_string(d.join("cpu.shares")).expect("read");
            assert_eq!(v.trim(), "1536");
        }
        if let Some(d) = CgroupV1::dir(&c, "pids") {
            let v = std::fs::read_to_string(d.join("pids.max")).expect("read");
            assert_eq!(v.trim(), "100");
        }
        t.destroy(&c);
        for (_, p) in &t.parents {
            remove_cgroup(p);
        }
    }
}
