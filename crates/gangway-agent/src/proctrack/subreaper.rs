//! The fallback where no cgroup is writable: the agent is the child
//! subreaper (`PR_SET_CHILD_SUBREAPER`) of everything it starts, so a
//! process that daemonises (setsid, double fork) is re-parented to the agent
//! instead of init. A rank's processes are its known members (pid and start
//! time, so a recycled pid is never taken for one), their descendants, and
//! processes re-parented to the agent or init that carry the rank's
//! `GANGWAY_RANK_ID` in their environment. A process that both escapes
//! between two looks and clears its environment is not found: cgroups have
//! no such hole, which is why they are preferred.

use super::{
    all_procs, proc_info, Container, Join, Limits, ProcInfo, ProcTrack, ProcTrackError,
    ProcTrackKind, RANK_ID_VAR,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

/// Subreaper + `/proc` tracking.
pub struct Subreaper {
    /// Per container: members as (pid, start time).
    members: Mutex<BTreeMap<String, BTreeSet<(i32, u64)>>>,
    /// First processes handed to `adopt`: the executor waits for those.
    leaders: Mutex<BTreeMap<String, i32>>,
    me: i32,
}

impl Subreaper {
    /// Makes this process the child subreaper of its descendants.
    pub fn new() -> Result<Self, ProcTrackError> {
        // SAFETY: prctl(2) with integer arguments.
        let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        if r != 0 {
            return Err(ProcTrackError::Unavailable(
                "subreaper",
                std::io::Error::last_os_error().to_string(),
            ));
        }
        Ok(Subreaper {
            members: Mutex::new(BTreeMap::new()),
            leaders: Mutex::new(BTreeMap::new()),
            me: std::process::id() as i32,
        })
    }

    fn has_marker(pid: i32, name: &str) -> bool {
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            return false;
        };
        let want = format!("{RANK_ID_VAR}={name}");
        env.split(|b| *b == 0).any(|v| v == want.as_bytes())
    }

    /// Brings the member set up to date and returns the live members.
    fn refresh(&self, c: &Container) -> Vec<i32> {
        let procs = all_procs();
        let by_pid: BTreeMap<i32, ProcInfo> = procs.iter().map(|p| (p.pid, *p)).collect();
        let Ok(mut all) = self.members.lock() else {
            return Vec::new();
        };
        let set = all.entry(c.name.clone()).or_default();
        // Still the same processes (a recycled pid has another start time).
        set.retain(|(pid, start)| by_pid.get(pid).is_some_and(|p| p.start == *start));
        // Re-parented orphans that inherited the rank's marker.
        for p in &procs {
            if (p.ppid == self.me || p.ppid == 1)
                && !set.contains(&(p.pid, p.start))
                && Self::has_marker(p.pid, &c.name)
            {
                set.insert((p.pid, p.start));
            }
        }
        // Descendants, to a fixed point.
        loop {
            let pids: BTreeSet<i32> = set.iter().map(|(p, _)| *p).collect();
            let before = set.len();
            for p in &procs {
                if pids.contains(&p.ppid) {
                    set.insert((p.pid, p.start));
                }
            }
            if set.len() == before {
                break;
            }
        }
        // Zombies re-parented to the agent are reaped here; the rank's first
        // process is the executor's child and reaped by its waiter.
        let leaders: BTreeSet<i32> = self
            .leaders
            .lock()
            .map(|l| l.values().copied().collect())
            .unwrap_or_default();
        let mut live = Vec::new();
        for (pid, _) in set.iter() {
            match by_pid.get(pid) {
                Some(p) if p.zombie && p.ppid == self.me && !leaders.contains(pid) => {
                    let mut status = 0;
                    // SAFETY: waitpid(2) on one zombie child we know.
                    unsafe {
                        libc::waitpid(*pid, &mut status, libc::WNOHANG);
                    }
                }
                Some(p) if p.zombie => {}
                Some(_) => live.push(*pid),
                None => {}
            }
        }
        live
    }
}

impl ProcTrack for Subreaper {
    fn kind(&self) -> ProcTrackKind {
        ProcTrackKind::Subreaper
    }

    fn create(&self, name: &str, _limits: Limits) -> Result<Container, ProcTrackError> {
        if let Ok(mut m) = self.members.lock() {
            m.entry(name.to_string()).or_default();
        }
        Ok(Container {
            name: name.to_string(),
            cgroups: Vec::new(),
        })
    }

    fn join(&self, _c: &Container) -> Join {
        Join::default()
    }

    fn adopt(&self, c: &Container, pid: i32) {
        if let Ok(mut l) = self.leaders.lock() {
            l.insert(c.name.clone(), pid);
        }
        if let (Some(p), Ok(mut m)) = (proc_info(pid), self.members.lock()) {
            m.entry(c.name.clone()).or_default().insert((pid, p.start));
        }
        let _ = self.refresh(c);
    }

    fn pids(&self, c: &Container) -> Vec<i32> {
        self.refresh(c)
    }

    fn signal(&self, c: &Container, sig: i32) {
        // Stop first so that nothing forks between the listing and the
        // signal, then signal, then let the survivors go on.
        let pids = self.refresh(c);
        if sig == libc::SIGKILL {
            for &p in &pids {
                // SAFETY: kill(2) on a tracked process.
                unsafe {
                    libc::kill(p, libc::SIGSTOP);
                }
            }
            let pids = self.refresh(c);
            for p in pids {
                // SAFETY: as above.
                unsafe {
                    libc::kill(p, libc::SIGKILL);
                }
            }
            return;
        }
        for p in pids {
            // SAFETY: as above.
            unsafe {
                libc::kill(p, sig);
            }
        }
    }

    fn destroy(&self, c: &Container) {
        if let Ok(mut m) = self.members.lock() {
            m.remove(&c.name);
        }
        if let Ok(mut l) = self.leaders.lock() {
            l.remove(&c.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_setsid_double_fork_escapee_is_tracked_and_killed() {
        let t = Subreaper::new().expect("subreaper");
        super::super::testing::check(&t, &format!("subreaper-escapee-{}", std::process::id()));
    }
}
