//! Process tracking, Slurm's `proctrack` shape: every process a rank starts
//! belongs to the rank's *container*, whatever it does with sessions, process
//! groups or double forks, so that stopping a rank stops all of it and the
//! agent reports the rank gone (and its GPUs free) only when nothing is left.
//!
//! Three implementations, picked at agent start ([`detect`]) or forced by the
//! agent's `--proctrack` flag:
//! - [`cgroup_v2::CgroupV2`]: one cgroup per rank under the agent's own
//!   cgroup (`cpu.max`/`memory.max` from the launch where those controllers
//!   are available; `cgroup.kill` to kill; `memory.events` for OOM kills);
//! - [`cgroup_v1::CgroupV1`]: one cgroup per rank in the freezer, pids,
//!   memory and cpu hierarchies (`memory.limit_in_bytes`, `cpu.cfs_quota_us`;
//!   frozen while it is killed, so nothing forks away);
//! - [`subreaper::Subreaper`]: where no cgroup is writable, the agent is the
//!   child subreaper of everything it starts and follows descendants in
//!   `/proc` (orphans come back to it), recognising re-parented processes by
//!   pid and start time, or by the `GANGWAY_RANK_ID` variable they inherit.
//!
//! A process joins its container between fork and exec ([`Join`]), so it
//! cannot fork before it is tracked.

pub mod cgroup_v1;
pub mod cgroup_v2;
pub mod subreaper;

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The environment variable every rank process inherits: its container name.
pub const RANK_ID_VAR: &str = "GANGWAY_RANK_ID";

/// Which implementation tracks ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProcTrackKind {
    /// The best one that works here: v2 with controllers, v1, v2 alone, subreaper.
    Auto,
    /// Unified cgroup hierarchy.
    CgroupV2,
    /// Legacy per-controller hierarchies.
    CgroupV1,
    /// `PR_SET_CHILD_SUBREAPER` and `/proc`.
    Subreaper,
}

impl std::str::FromStr for ProcTrackKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ProcTrackKind::Auto),
            "cgroup-v2" => Ok(ProcTrackKind::CgroupV2),
            "cgroup-v1" => Ok(ProcTrackKind::CgroupV1),
            "subreaper" => Ok(ProcTrackKind::Subreaper),
            _ => Err(format!(
                "proctrack {s:?}: expected auto, cgroup-v2, cgroup-v1 or subreaper"
            )),
        }
    }
}

/// Why a tracker or a container could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ProcTrackError {
    /// The mechanism is not available on this host.
    #[error("proctrack {0}: not available here: {1}")]
    Unavailable(&'static str, String),
    /// A cgroup file or directory could not be written.
    #[error("proctrack: {0}: {1}")]
    Io(String, std::io::Error),
}

/// Resource limits of one rank (0: none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// CPU in thousandths of a core.
    pub cpu_millis: u64,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// Processes and threads at once.
    pub pids: u64,
}

impl Limits {
    /// CPU shares (cgroup v1 `cpu.shares`, Docker `cpu_shares`) for the
    /// request: 1024 per core, 2 at least (the kernel's floor).
    pub fn cpu_shares(&self) -> u64 {
        (self.cpu_millis.saturating_mul(1024) / 1000).clamp(2, 262_144)
    }

    /// cgroup v2 `cpu.weight` (1..=10000, 100 for one core) for the request.
    pub fn cpu_weight(&self) -> u64 {
        (self.cpu_millis / 10).clamp(1, 10_000)
    }
}

/// One rank's container: its name and, for cgroup trackers, its cgroup
/// directories (the first one lists its processes).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Container {
    /// Unique name on the machine (also the value of [`RANK_ID_VAR`]).
    pub name: String,
    /// Cgroup directories; empty for the subreaper.
    #[serde(default)]
    pub cgroups: Vec<PathBuf>,
}

/// What a freshly forked child does before exec to join its container:
/// writes `0` into these `cgroup.procs` files. Built before fork, so the
/// child only calls `open`/`write`/`close`.
#[derive(Clone, Debug, Default)]
pub struct Join {
    procs_files: Vec<CString>,
}

impl Join {
    /// Joins the calling process to the container.
    ///
    /// # Safety
    /// Only async-signal-safe calls: meant for the child between fork and exec.
    pub unsafe fn join(&self) -> std::io::Result<()> {
        for f in &self.procs_files {
            let fd = libc::open(f.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let n = libc::write(fd, b"0".as_ptr().cast(), 1);
            let err = std::io::Error::last_os_error();
            libc::close(fd);
            if n != 1 {
                return Err(err);
            }
        }
        Ok(())
    }

    fn for_cgroups(dirs: &[PathBuf]) -> Self {
        use std::os::unix::ffi::OsStrExt;
        Join {
            procs_files: dirs
                .iter()
                .filter_map(|d| CString::new(d.join("cgroup.procs").as_os_str().as_bytes()).ok())
                .collect(),
        }
    }
}

/// Tracks the processes of ranks.
pub trait ProcTrack: Send + Sync {
    /// Which implementation this is.
    fn kind(&self) -> ProcTrackKind;
    /// Creates the container of a rank, with its limits where enforceable.
    fn create(&self, name: &str, limits: Limits) -> Result<Container, ProcTrackError>;
    /// What a child runs before exec to join `c`.
    fn join(&self, c: &Container) -> Join;
    /// Tells the tracker the pid of the rank's first process (after spawn,
    /// or when re-adopting after an agent restart).
    fn adopt(&self, c: &Container, pid: i32);
    /// The live processes of the container (zombies excluded).
    fn pids(&self, c: &Container) -> Vec<i32>;
    /// Sends `sig` to every process of the container.
    fn signal(&self, c: &Container, sig: i32) {
        for pid in self.pids(c) {
            // SAFETY: kill(2) on a process of the rank; no memory is shared.
            unsafe {
                libc::kill(pid, sig);
            }
        }
    }
    /// Whether no process of the container is left.
    fn is_empty(&self, c: &Container) -> bool {
        self.pids(c).is_empty()
    }
    /// OOM kills counted by the kernel for the container (0 where unknown).
    fn oom_kills(&self, _c: &Container) -> u64 {
        0
    }
    /// Removes the (empty) container.
    fn destroy(&self, c: &Container);
    /// Removes empty rank containers left by agents that died before they
    /// could (not `keep`, untouched for a minute, so a container another
    /// agent has just created is never taken).
    fn sweep(&self, _keep: &[Container]) {}
}

/// A tracker shared by the executor and the agent.
pub type SharedTrack = Arc<dyn ProcTrack>;

/// Picks the implementation: the one asked for (an error if it does not
/// work here), or with `Auto` the best that does. `parent` names the
/// directory under the agent's own cgroup that holds rank cgroups.
pub fn detect(kind: ProcTrackKind, parent: &str) -> Result<SharedTrack, ProcTrackError> {
    match kind {
        ProcTrackKind::CgroupV2 => Ok(Arc::new(cgroup_v2::CgroupV2::new(parent)?)),
        ProcTrackKind::CgroupV1 => Ok(Arc::new(cgroup_v1::CgroupV1::new(parent)?)),
        ProcTrackKind::Subreaper => Ok(Arc::new(subreaper::Subreaper::new()?)),
        ProcTrackKind::Auto => {
            if let Ok(t) = cgroup_v2::CgroupV2::new(parent) {
                if t.has_limits() {
                    return Ok(Arc::new(t));
                }
            }
            if let Ok(t) = cgroup_v1::CgroupV1::new(parent) {
                // The v2 parent made while probing is not used (empty: removable).
                if let Some(dir) = mount_point(None)
                    .map(|m| m.join(own_cgroup(None).unwrap_or_default().trim_start_matches('/')))
                {
                    let _ = std::fs::remove_dir(dir.join(parent));
                }
                return Ok(Arc::new(t));
            }
            if let Ok(t) = cgroup_v2::CgroupV2::new(parent) {
                return Ok(Arc::new(t));
            }
            Ok(Arc::new(subreaper::Subreaper::new()?))
        }
    }
}

/// One process as `/proc/PID/stat` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcInfo {
    /// Pid.
    pub pid: i32,
    /// Parent pid.
    pub ppid: i32,
    /// Start time in clock ticks since boot (tells a recycled pid apart).
    pub start: u64,
    /// Exited but not reaped yet.
    pub zombie: bool,
}

/// Reads `/proc/PID/stat`.
pub fn proc_info(pid: i32) -> Option<ProcInfo> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    // After the command: state (3), ppid (4), ..., starttime (22).
    Some(ProcInfo {
        pid,
        ppid: f.get(1)?.parse().ok()?,
        start: f.get(19)?.parse().ok()?,
        zombie: matches!(*f.first()?, "Z" | "X"),
    })
}

/// Every process on the machine.
pub fn all_procs() -> Vec<ProcInfo> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(proc_info)
        .collect()
}

/// Whether a process is alive and not a zombie.
pub fn alive(pid: i32) -> bool {
    proc_info(pid).is_some_and(|p| !p.zombie)
}

/// Where the cgroup hierarchy with `controller` is mounted (v1), or the
/// unified hierarchy (`controller == None`), from `/proc/self/mountinfo`.
pub(crate) fn mount_point(controller: Option<&str>) -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mounts").ok()?;
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(dir), Some(fs), Some(opts)) = (f.get(1), f.get(2), f.get(3)) else {
            continue;
        };
        match controller {
            None if *fs == "cgroup2" => return Some(PathBuf::from(dir)),
            Some(c) if *fs == "cgroup" && opts.split(',').any(|o| o == c) => {
                return Some(PathBuf::from(dir))
            }
            _ => {}
        }
    }
    None
}

/// The agent's own cgroup in a hierarchy (`/proc/self/cgroup`): the v1 line
/// naming `controller`, or the v2 line `0::`.
pub(crate) fn own_cgroup(controller: Option<&str>) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in text.lines() {
        let mut it = line.splitn(3, ':');
        let (_, ctrls, path) = (it.next()?, it.next()?, it.next()?);
        let hit = match controller {
            None => ctrls.is_empty(),
            Some(c) => ctrls.split(',').any(|x| x == c),
        };
        if hit {
            return Some(path.to_string());
        }
    }
    None
}

/// `<mount>/<own cgroup>/<parent>`, created.
pub(crate) fn parent_dir(controller: Option<&str>, parent: &str) -> Option<PathBuf> {
    let mount = mount_point(controller)?;
    let own = own_cgroup(controller).unwrap_or_default();
    let dir = mount.join(own.trim_start_matches('/')).join(parent);
    std::fs::create_dir_all(&dir).ok()?;
    dir.join("cgroup.procs").exists().then_some(dir)
}

/// Pids listed in a cgroup's `cgroup.procs` and in those of the cgroups
/// below it (a rank may make its own), zombies excluded.
pub(crate) fn cgroup_pids(dir: &Path) -> Vec<i32> {
    let mut out: Vec<i32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .filter(|p| alive(*p))
        .collect();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(cgroup_pids(&e.path()));
        }
    }
    out
}

/// Writes a control file, naming it in the error.
pub(crate) fn write_file(path: &Path, value: &str) -> Result<(), ProcTrackError> {
    std::fs::write(path, value).map_err(|e| ProcTrackError::Io(path.display().to_string(), e))
}

/// Removes the empty, idle children of `parent` that are not in `keep`.
pub(crate) fn sweep_dir(parent: &Path, keep: &[Container]) {
    let kept: Vec<&PathBuf> = keep.iter().flat_map(|c| c.cgroups.iter()).collect();
    for e in std::fs::read_dir(parent).into_iter().flatten().flatten() {
        let dir = e.path();
        let idle = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > std::time::Duration::from_secs(60));
        let empty =
            std::fs::read_to_string(dir.join("cgroup.procs")).is_ok_and(|p| p.trim().is_empty());
        if idle && empty && e.path().is_dir() && !kept.contains(&&dir) {
            let _ = std::fs::remove_dir(&dir);
        }
    }
}

/// Removes a cgroup directory, retrying briefly while the kernel finishes
/// tearing down its last processes.
pub(crate) fn remove_cgroup(dir: &Path) {
    for _ in 0..20 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
        }
    }
    tracing::warn!("cannot remove cgroup {}", dir.display());
}

#[cfg(test)]
pub(crate) mod testing {
    //! A `setsid` + double-fork escapee, tracked or not.
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::time::{Duration, Instant};

    /// Starts `sh` in container `c` that puts a `setsid` double-forked
    /// `sleep` in the background and exits; returns the escapee's pid.
    pub fn escapee(t: &dyn ProcTrack, c: &Container, dir: &Path) -> i32 {
        let pidfile = dir.join(format!("escapee-{}", c.name));
        let join = t.join(c);
        let mut cmd = std::process::Command::new("sh");
        cmd.arg("-c")
            .arg(format!(
                "setsid sh -c 'sleep 300 & echo $! > {}' &",
                pidfile.display()
            ))
            .env(RANK_ID_VAR, &c.name)
            .process_group(0);
        // SAFETY: Join::join only calls async-signal-safe functions.
        unsafe {
            cmd.pre_exec(move || join.join());
        }
        let mut child = cmd.spawn().expect("spawn sh");
        t.adopt(c, child.id() as i32);
        let deadline = Instant::now() + Duration::from_secs(20);
        let pid = loop {
            if let Ok(Ok(p)) = std::fs::read_to_string(&pidfile).map(|s| s.trim().parse::<i32>()) {
                break p;
            }
            assert!(Instant::now() < deadline, "escapee never started");
            // Keep the tracker's view fresh while the tree changes.
            let _ = t.pids(c);
            std::thread::sleep(Duration::from_millis(5));
        };
        let _ = child.wait();
        pid
    }

    /// The shared check: the escapee is tracked, killed with the container,
    /// and the container is empty afterwards.
    pub fn check(t: &dyn ProcTrack, name: &str) {
        let dir = tempfile::tempdir().expect("tmp");
        let c = t
            .create(
                name,
                Limits {
                    cpu_millis: 500,
                    memory_mib: 256,
                    pids: 4096,
                },
            )
            .expect("container");
        let pid = escapee(t, &c, dir.path());
        assert!(alive(pid), "the escapee runs");
        // SAFETY: getsid(2) on pids.
        let (theirs, ours) = unsafe { (libc::getsid(pid), libc::getsid(0)) };
        assert_ne!(theirs, ours, "it left our session");
        assert!(t.pids(&c).contains(&pid), "tracked: {:?}", t.pids(&c));
        assert!(!t.is_empty(&c));
        t.signal(&c, libc::SIGKILL);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !t.is_empty(&c) {
            assert!(Instant::now() < deadline, "still there: {:?}", t.pids(&c));
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!alive(pid), "the escapee is gone");
        t.destroy(&c);
        for d in &c.cgroups {
            assert!(!d.exists(), "{} removed", d.display());
        }
    }
}
