//! A private `/tmp` and `/dev/shm` for each job attempt on a node (as
//! Slurm's `job_container/tmpfs`), for process ranks (containers have their
//! own). When an attempt starts here the agent mounts a size-limited tmpfs
//! for it (`<state_dir>/shm/job-ID-ATTEMPT`, root's, its pages charged to
//! the memory cgroup of the rank that writes them); each rank, before it
//! runs, enters a mount namespace of its own (mounts propagate into it from
//! the host, never out) and binds its attempt's `TMPDIR` on `/tmp` and that
//! tmpfs on `/dev/shm`, so all ranks of the attempt share one `/dev/shm`
//! (NCCL's shared-memory transport) and no other job sees it. When the
//! attempt ends here the tmpfs is detached and its memory freed.
//!
//! Where no mount namespace can be made (the agent is not root, or lacks
//! the privilege), the node's `/tmp` and `/dev/shm` are shared, and the
//! account's top-level entries there are removed when its last such attempt
//! on the node ends ([`sweep_account`]).

use crate::disk::open_dir_at;
use std::collections::BTreeSet;
use std::ffi::CString;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

/// How the node gives jobs their scratch space (`--job-scratch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum JobScratch {
    /// A private `/tmp` and `/dev/shm` per job attempt where the agent can
    /// make mount namespaces; otherwise the account's files there are swept
    /// when its last attempt on the node ends.
    #[default]
    Private,
    /// The node's `/tmp` and `/dev/shm` as they are, shared by every job
    /// and never swept (a site that stages data there; test harnesses).
    Shared,
}

impl std::str::FromStr for JobScratch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "private" => Ok(JobScratch::Private),
            "shared" => Ok(JobScratch::Shared),
            _ => Err(format!("{s:?}: expected private or shared")),
        }
    }
}

/// What this agent does, decided once at its start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Mount namespaces: a private `/tmp` and `/dev/shm` per attempt.
    Namespace,
    /// The node's shared `/tmp` and `/dev/shm`, the account's entries swept
    /// after its last attempt here.
    Sweep,
    /// The node's, untouched.
    Shared,
}

/// The mode for `wanted` on this machine (a mount namespace is tried once).
pub fn mode(wanted: JobScratch) -> Mode {
    match wanted {
        JobScratch::Shared => Mode::Shared,
        JobScratch::Private if namespaces_work() => Mode::Namespace,
        JobScratch::Private => Mode::Sweep,
    }
}

/// Whether a child can make a mount namespace and bind over `/tmp` and
/// `/dev/shm` (both must be directories): tried in a forked child.
fn namespaces_work() -> bool {
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return false;
    }
    let dirs = ["/tmp", "/dev/shm"];
    if !dirs
        .iter()
        .all(|d| std::fs::symlink_metadata(d).is_ok_and(|m| m.is_dir()))
    {
        return false;
    }
    // SAFETY: the child makes only async-signal-safe calls (unshare, mount,
    // _exit); the parent waits for it.
    unsafe {
        let pid = libc::fork();
        if pid == 0 {
            let ok = libc::unshare(libc::CLONE_NEWNS) == 0
                && libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_SLAVE,
                    std::ptr::null(),
                ) == 0
                && libc::mount(
                    c"/tmp".as_ptr(),
                    c"/tmp".as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND,
                    std::ptr::null(),
                ) == 0;
            libc::_exit(if ok { 0 } else { 1 });
        }
        if pid < 0 {
            return false;
        }
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0) == pid
            && libc::WIFEXITED(status)
            && libc::WEXITSTATUS(status) == 0
    }
}

/// Whether any of `paths` (the agent's state and checkpoint roots) lies
/// under `/tmp`: a rank then keeps the node's `/tmp` (it must reach them by
/// name: its exit file, log rotation, checkpoint directory), with its own
/// `TMPDIR` and `/dev/shm`, and its account's entries in `/tmp` are swept.
pub fn under_tmp(paths: &[&Path]) -> bool {
    paths.iter().any(|p| {
        let p = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        p.starts_with("/tmp")
    })
}

/// Where an attempt's `/dev/shm` tmpfs is mounted on the host.
pub fn shm_dir(state_dir: &Path, job: u64, attempt: u32) -> PathBuf {
    state_dir.join("shm").join(format!("job-{job}-{attempt}"))
}

/// What a rank binds before it runs (paths built before the fork).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scratch {
    /// Bound on `/tmp` unless a path the rank needs lies under `/tmp`.
    tmp: Option<CString>,
    shm: CString,
}

impl Scratch {
    /// Whether the rank sees its attempt's `TMPDIR` on `/tmp` (then the
    /// files in it are reached there, not by the host path).
    pub fn binds_tmp(&self) -> bool {
        self.tmp.is_some()
    }

    /// In the rank's child, as root, before the identity drop: a mount
    /// namespace of its own (host mounts still propagate in, none out),
    /// the attempt's `TMPDIR` on `/tmp` and its tmpfs on `/dev/shm`. Only
    /// async-signal-safe calls.
    pub fn enter(&self) -> std::io::Result<()> {
        let err = std::io::Error::last_os_error;
        // SAFETY: unshare(2) and mount(2) on NUL-terminated strings made
        // before the fork.
        unsafe {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return Err(err());
            }
            let null = std::ptr::null();
            if libc::mount(
                null,
                c"/".as_ptr(),
                null,
                libc::MS_REC | libc::MS_SLAVE,
                null as _,
            ) != 0
            {
                return Err(err());
            }
            // /dev/shm first: its source may be under /tmp.
            for (src, dst) in [(Some(&self.shm), c"/dev/shm"), (self.tmp.as_ref(), c"/tmp")] {
                let Some(src) = src else { continue };
                if libc::mount(src.as_ptr(), dst.as_ptr(), null, libc::MS_BIND, null as _) != 0 {
                    return Err(err());
                }
            }
        }
        Ok(())
    }
}

fn cstring(p: &Path) -> std::io::Result<CString> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::other("a path with a NUL byte"))
}

/// Mounts attempt `job`/`attempt`'s tmpfs (at most `size_bytes`, the
/// account's alone, mode 0700, no setuid or devices) and returns what its
/// ranks bind: `tmp` (its `TMPDIR`, made by the caller) on `/tmp` where
/// given, the tmpfs on `/dev/shm`.
pub fn prepare(
    state_dir: &Path,
    job: u64,
    attempt: u32,
    tmp: Option<&Path>,
    uid: u32,
    gid: u32,
    size_bytes: u64,
) -> std::io::Result<Scratch> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = shm_dir(state_dir, job, attempt);
    if let Some(parent) = dir.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)?;
    }
    // A mount left by an agent that died is replaced.
    remove(state_dir, job, attempt);
    std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
    let target = cstring(&dir)?;
    let size_k = (size_bytes / 1024).max(1024);
    let opts = CString::new(format!("size={size_k}k,mode=0700,uid={uid},gid={gid}"))
        .map_err(std::io::Error::other)?;
    // SAFETY: mount(2) with NUL-terminated strings.
    let r = unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            target.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            opts.as_ptr().cast(),
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        let _ = std::fs::remove_dir(&dir);
        return Err(e);
    }
    Ok(Scratch {
        tmp: tmp.map(cstring).transpose()?,
        shm: target,
    })
}

/// Detaches attempt `job`/`attempt`'s tmpfs (its memory is freed once its
/// last rank is gone) and removes its mount point; absent is fine.
pub fn remove(state_dir: &Path, job: u64, attempt: u32) {
    let dir = shm_dir(state_dir, job, attempt);
    let Ok(c) = cstring(&dir) else { return };
    // SAFETY: umount2(2) on a NUL-terminated path of root's directories,
    // not following a final link.
    unsafe {
        libc::umount2(c.as_ptr(), libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW);
    }
    match std::fs::remove_dir(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("cannot remove {}: {e}", dir.display()),
    }
}

/// Removes every attempt's tmpfs but those of `keep` (left by an agent
/// that was killed before their attempts ended).
pub fn sweep(state_dir: &Path, keep: &BTreeSet<(u64, u32)>) {
    for e in std::fs::read_dir(state_dir.join("shm"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name();
        let Some(key) = name
            .to_str()
            .and_then(|n| n.strip_prefix("job-"))
            .and_then(|n| n.split_once('-'))
            .and_then(|(j, a)| Some((j.parse::<u64>().ok()?, a.parse::<u32>().ok()?)))
        else {
            continue;
        };
        if !keep.contains(&key) {
            remove(state_dir, key.0, key.1);
        }
    }
}

/// Accounts with jobs on the node's shared `/tmp` and `/dev/shm`, and how
/// many, over every agent of this process (`gangway up` runs several on one
/// machine: one's last job of an account must not sweep under another's).
static SHARED_USERS: std::sync::Mutex<std::collections::BTreeMap<u32, usize>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Notes a job of `uid` using the node's `/tmp` and `/dev/shm`.
pub fn hold_shared(uid: u32) {
    let mut m = SHARED_USERS.lock().unwrap_or_else(|e| e.into_inner());
    let n = m.entry(uid).or_insert(0);
    *n = n.saturating_add(1);
}

/// Notes the end of such a job; whether it was the account's last.
pub fn release_shared(uid: u32) -> bool {
    let mut m = SHARED_USERS.lock().unwrap_or_else(|e| e.into_inner());
    match m.get_mut(&uid) {
        Some(n) if *n > 1 => {
            *n -= 1;
            false
        }
        _ => {
            m.remove(&uid);
            true
        }
    }
}

/// Removes the entries `uid` owns at the top of the node's `/tmp` and
/// `/dev/shm`, each by descriptor (never following a link, never leaving
/// the tree or its filesystem). Blocking: run it off the agent's loop.
/// Never for root or the agent's own account.
pub fn sweep_account(uid: u32) -> usize {
    // SAFETY: geteuid(2) has no preconditions.
    if uid == 0 || uid == unsafe { libc::geteuid() } {
        return 0;
    }
    let mut removed = 0;
    for dir in ["/tmp", "/dev/shm"] {
        removed += sweep_owned(Path::new(dir), uid);
    }
    removed
}

/// [`sweep_account`] in `dir`: each entry `uid` owns is removed with
/// [`crate::safefs::remove_tree`] (by descriptor, links removed and never
/// followed, no mount crossed, bounded in depth).
pub fn sweep_owned(dir: &Path, uid: u32) -> usize {
    use rustix::fs::{statat, AtFlags};
    let Ok(fd) = open_dir_at(rustix::fs::CWD, dir) else {
        return 0;
    };
    let Ok(names) = crate::safefs::list(&fd) else {
        return 0;
    };
    names
        .iter()
        .filter(|n| {
            statat(&fd, n.as_os_str(), AtFlags::SYMLINK_NOFOLLOW).is_ok_and(|st| st.st_uid == uid)
        })
        .filter(|n| crate::safefs::remove_tree(fd.as_fd(), n).is_ok())
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_job_of_an_account_over_all_agents_sweeps() {
        hold_shared(777_001);
        hold_shared(777_001);
        assert!(!release_shared(777_001));
        assert!(release_shared(777_001));
    }

    #[test]
    fn the_flag_reads_private_or_shared() {
        assert_eq!("private".parse(), Ok(JobScratch::Private));
        assert_eq!("shared".parse(), Ok(JobScratch::Shared));
        assert!("host".parse::<JobScratch>().is_err());
        assert_eq!(mode(JobScratch::Shared), Mode::Shared);
    }

    #[test]
    fn the_sweep_removes_only_the_accounts_entries_and_follows_no_link() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().expect("tmp");
        let decoy = tempfile::tempdir().expect("tmp");
        std::fs::write(decoy.path().join("keep"), b"k").expect("write");
        let uid = 4242u32;
        let own = |p: &Path| std::os::unix::fs::lchown(p, Some(uid), Some(uid)).expect("chown");
        std::fs::create_dir_all(d.path().join("mine/deep/er")).expect("dirs");
        std::fs::write(d.path().join("mine/deep/er/f"), b"x").expect("write");
        std::os::unix::fs::symlink(decoy.path(), d.path().join("mine/link")).expect("symlink");
        own(&d.path().join("mine"));
        std::os::unix::fs::symlink(decoy.path(), d.path().join("link")).expect("symlink");
        own(&d.path().join("link"));
        std::fs::write(d.path().join("file"), b"y").expect("write");
        own(&d.path().join("file"));
        nix::unistd::mkfifo(&d.path().join("fifo"), nix::sys::stat::Mode::S_IRWXU).expect("fifo");
        own(&d.path().join("fifo"));
        std::fs::write(d.path().join("theirs"), b"z").expect("write");
        if std::fs::symlink_metadata(d.path().join("mine"))
            .map(|m| m.uid())
            .ok()
            != Some(uid)
        {
            eprintln!("skipped: cannot chown here (not root?)");
            return;
        }
        assert_eq!(sweep_owned(d.path(), uid), 4);
        let left: Vec<String> = std::fs::read_dir(d.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, ["theirs"]);
        assert!(decoy.path().join("keep").exists(), "no link was followed");
        assert_eq!(sweep_account(0), 0, "never root's");
    }

    #[test]
    fn an_attempts_tmpfs_is_mounted_sized_and_removed() {
        let d = tempfile::tempdir().expect("tmp");
        let tmp = d.path().join("tmp");
        std::fs::create_dir(&tmp).expect("dir");
        let s = match prepare(d.path(), 7, 1, Some(&tmp), 4242, 4242, 8 << 20) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("skipped: cannot mount a tmpfs here: {e}");
                return;
            }
        };
        let shm = shm_dir(d.path(), 7, 1);
        let (_, total) = crate::disk::space(&shm).expect("statvfs");
        assert_eq!(total, 8 << 20);
        assert_eq!(s.shm.as_bytes(), shm.as_os_str().as_encoded_bytes());
        sweep(d.path(), &[(7, 1)].into());
        assert!(shm.exists(), "kept");
        sweep(d.path(), &BTreeSet::new());
        assert!(!shm.exists(), "swept");
    }
}
