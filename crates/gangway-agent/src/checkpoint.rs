//! The rank side of the job contract that the agent reads from disk: the
//! checkpoint handshake (`$GANGWAY_CHECKPOINT_DIR/LATEST`), the rendezvous
//! port check before rank 0 starts, what a failed rank left in its log, and
//! removing a succeeded job's checkpoints.
//!
//! The handshake is a file so that ranks need no library: a rank writes
//! `{"step": N, "path": "..."}` to a temporary file in the checkpoint
//! directory and renames it to `LATEST` (atomic on POSIX), after the
//! checkpoint itself is complete. The agent reads it at every sync, on a
//! thread of its own ([`LatestCache`]), by descriptor and without following
//! links ([`crate::safefs`]).

use crate::safefs::{self, FsError, Last};
use gangway_core::agent::{CheckpointReport, RankFailure};
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Name of the handshake file in the checkpoint directory.
pub const LATEST: &str = "LATEST";

/// Largest `LATEST` file read (it holds two fields).
const MAX_LATEST_BYTES: u64 = 64 * 1024;

/// Longest accepted checkpoint path.
const MAX_PATH_LEN: usize = 4096;

/// Lines of a failed rank's log sent to the server.
pub const LOG_TAIL_LINES: usize = 10;

/// A job's checkpoint directory: `rel` beneath the trusted `base` (the
/// checkpoint root, root's). Root reaches it only by descriptor from the
/// base ([`crate::safefs`]): every level above the job's own directory must
/// be root's, so a link or directory a user planted is never walked through.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CkptDir {
    /// The checkpoint root.
    pub base: PathBuf,
    /// The job's directory under it.
    pub rel: PathBuf,
}

impl CkptDir {
    /// Its full path (what the ranks are told).
    pub fn path(&self) -> PathBuf {
        self.base.join(&self.rel)
    }

    /// The directory of a path recorded earlier under `base`.
    pub fn under(base: &Path, path: &Path) -> Option<CkptDir> {
        let rel = path.strip_prefix(base).ok()?;
        safe_subdir(rel.to_str()?)?;
        Some(CkptDir {
            base: base.to_path_buf(),
            rel: rel.to_path_buf(),
        })
    }

    /// Opens the directory for root: made when missing (levels above it
    /// root's, mode [`LEVEL_MODE`]) and given to `account` (uid, gid) with
    /// mode 0700 when one is named; otherwise it must exist.
    pub fn open(&self, account: Option<(u32, u32)>) -> Result<OwnedFd, FsError> {
        let base = safefs::open_base(&self.base)?;
        match account {
            Some((uid, gid)) => safefs::open_dir(
                base.as_fd(),
                &self.rel,
                Some(LEVEL_MODE),
                Last::Own {
                    uid,
                    gid,
                    mode: 0o700,
                },
            ),
            None => safefs::open_dir(base.as_fd(), &self.rel, None, Last::Any),
        }
    }
}

/// Mode of the root-owned levels the agent makes above a job's directory
/// (`<user>/`, and the parents of a `checkpoint.dir` with several parts):
/// ranks may pass through to their own directory, no one may list them.
pub const LEVEL_MODE: u32 = 0o711;

/// What a job's `LATEST` announces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Latest {
    /// The checkpoint.
    pub report: CheckpointReport,
    /// `"final": true`: the job said it finished.
    pub last: bool,
}

/// The checkpoint announced in the directory's `LATEST`, if it holds a valid
/// one: `step` a non-negative integer, `path` a non-empty string (relative
/// paths are taken from the directory). A missing, half-written or malformed
/// file is `Ok(None)`, so the previous report stands. A `LATEST` that is a
/// link, FIFO, device, hard link, too big or not its directory's owner's, and
/// a directory reached through anything but root's own levels, are an
/// `Err` saying why: never opened, never read.
pub fn read_latest(dir: &CkptDir) -> Result<Option<Latest>, String> {
    let fd = match dir.open(None) {
        Ok(fd) => fd,
        Err(e) if e.not_found() => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let owner = rustix::fs::fstat(&fd).map_err(|e| e.to_string())?.st_uid;
    let root = rustix::process::geteuid().as_raw();
    let (bytes, st) = match safefs::read_small(
        fd.as_fd(),
        std::ffi::OsStr::new(LATEST),
        &[owner, root],
        MAX_LATEST_BYTES,
    ) {
        Ok(r) => r,
        Err(e) if e.not_found() => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", dir.path().display())),
    };
    Ok(parse_latest(&dir.path(), &bytes, &st))
}

fn parse_latest(dir: &Path, bytes: &[u8], st: &rustix::fs::Stat) -> Option<Latest> {
    let v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let step = v.get("step")?.as_u64()?;
    let path = v.get("path")?.as_str()?;
    if path.is_empty() || path.len() > MAX_PATH_LEN || path.contains('\0') {
        return None;
    }
    let path = if Path::new(path).is_absolute() {
        PathBuf::from(path)
    } else {
        dir.join(path)
    };
    let secs = u64::try_from(st.st_mtime).unwrap_or(0);
    // 0..1e9, of a type that differs between architectures.
    #[allow(clippy::unnecessary_cast)]
    let nanos = st.st_mtime_nsec as u64;
    let written_ms = secs.saturating_mul(1000).saturating_add(nanos / 1_000_000);
    Some(Latest {
        report: CheckpointReport {
            step,
            path: path.display().to_string(),
            written_ms,
        },
        last: v.get("final").and_then(|f| f.as_bool()) == Some(true),
    })
}

/// The step and time (ms since the epoch) of a `LATEST` that marks the
/// job's final checkpoint (`"final": true`): the job said it finished.
pub fn read_final(dir: &CkptDir) -> Option<(u64, u64)> {
    final_of(read_latest(dir).ok().flatten().as_ref())
}

/// The step and time of `latest` when it marks the final checkpoint.
pub fn final_of(latest: Option<&Latest>) -> Option<(u64, u64)> {
    latest
        .filter(|l| l.last)
        .map(|l| (l.report.step, l.report.written_ms))
}

/// The last good `LATEST` of one task, read off the agent's loop: a read
/// runs on a thread of its own, at most one at a time per task (a read stuck
/// on a dead mount does not pile up threads), and its result is kept for the
/// reports. A refused `LATEST` is said once in the agent's log per reason,
/// at most once a minute per task.
#[derive(Clone, Default)]
pub struct LatestCache {
    inner: Arc<Mutex<CacheState>>,
}

#[derive(Default)]
struct CacheState {
    value: Option<Latest>,
    busy: bool,
    /// The refusal last said in the agent's log, and when.
    said: Option<(String, std::time::Instant)>,
}

/// Least time between two log lines about one task's refused `LATEST`.
const SAY_EVERY: Duration = Duration::from_secs(60);

impl LatestCache {
    fn state(&self) -> std::sync::MutexGuard<'_, CacheState> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The last good `LATEST` read.
    pub fn value(&self) -> Option<Latest> {
        self.state().value.clone()
    }

    /// Whether a read is under way.
    pub fn busy(&self) -> bool {
        self.state().busy
    }

    /// Starts reading `dir`'s `LATEST` unless a read is under way; returns
    /// whether one was started.
    pub fn start(&self, dir: &CkptDir) -> bool {
        {
            let mut s = self.state();
            if s.busy {
                return false;
            }
            s.busy = true;
        }
        let (me, dir) = (self.clone(), dir.clone());
        let spawned = std::thread::Builder::new()
            .name("gangway-latest".into())
            .spawn(move || {
                #[cfg(test)]
                let _held = tests::STALL.lock();
                let r = read_latest(&dir);
                let mut s = me.state();
                match r {
                    Ok(Some(l)) => s.value = Some(l),
                    Ok(None) => {}
                    Err(why) => {
                        // Once per reason, and at most once a minute.
                        let say = s
                            .said
                            .as_ref()
                            .is_none_or(|(said, at)| *said != why && at.elapsed() >= SAY_EVERY);
                        if say {
                            tracing::warn!("checkpoint handshake ignored: {why}");
                            s.said = Some((why, std::time::Instant::now()));
                        }
                    }
                }
                s.busy = false;
            });
        if spawned.is_err() {
            self.state().busy = false;
            return false;
        }
        true
    }

    /// Starts a read and waits up to `wait` for it (asynchronously); returns
    /// the last good value, fresh if the read ended in time.
    pub async fn refresh(&self, dir: &CkptDir, wait: Duration) -> Option<Latest> {
        self.start(dir);
        let until = std::time::Instant::now() + wait;
        while self.busy() && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        self.value()
    }

    /// [`LatestCache::refresh`] for code off the async runtime's futures
    /// (bounded by `wait`).
    pub fn refresh_blocking(&self, dir: &CkptDir, wait: Duration) -> Option<Latest> {
        self.start(dir);
        let until = std::time::Instant::now() + wait;
        while self.busy() && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(2));
        }
        self.value()
    }
}

/// Whether `port` can be bound on every interface right now (rank 0's
/// rendezvous store binds it). Rust's listener sets `SO_REUSEADDR`, so
/// sockets of an earlier job in TIME_WAIT do not count as busy; a process
/// listening on it does.
pub fn port_free(port: u16) -> bool {
    std::net::TcpListener::bind(("0.0.0.0", port)).is_ok()
}

/// The last `n` lines of a log file (reads at most its last 16 KiB; long
/// lines are cut at 500 characters).
pub fn log_tail(path: &Path, n: usize) -> Vec<String> {
    const WINDOW: u64 = 16 * 1024;
    let Ok(mut f) = crate::logs::open_read(path) else {
        return Vec::new();
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let start = len.saturating_sub(WINDOW);
    if f.seek(SeekFrom::Start(start)).is_err() {
        return Vec::new();
    }
    let mut bytes = Vec::new();
    if f.take(WINDOW).read_to_end(&mut bytes).is_err() {
        return Vec::new();
    }
    let text = String::from_utf8_lossy(&bytes);
    let mut lines: Vec<&str> = text.lines().collect();
    if start > 0 && !lines.is_empty() {
        // The first line is probably cut.
        lines.remove(0);
    }
    let from = lines.len().saturating_sub(n);
    lines[from..]
        .iter()
        .map(|l| l.chars().take(500).collect())
        .collect()
}

/// What the server is told about a failed rank: its code, the signal that
/// killed it (codes above 128) and its log's last lines. `oom_killed` is
/// filled by whoever can tell (a memory cgroup); `false` here.
pub fn rank_failure(rank: u32, exit_code: i32, log: &Path) -> RankFailure {
    RankFailure {
        rank,
        exit_code,
        signal: (exit_code > 128 && exit_code < 128 + 65).then(|| exit_code - 128),
        oom_killed: false,
        log_tail: log_tail(log, LOG_TAIL_LINES),
        node_fault: None,
        limit: None,
        unknown_exit: false,
    }
}

/// The checkpoint directory of an assignment: `<root>/<subdir>`, where the
/// root is the cluster's (when the server sets one) or the agent's own, and
/// the subdir is checked again here (relative, no `..`): the agent does not
/// trust the answer to keep a job inside the root.
pub fn checkpoint_dir(
    agent_root: &Path,
    cluster_root: Option<&str>,
    subdir: &str,
) -> Option<CkptDir> {
    let root = cluster_root.map_or_else(|| agent_root.to_path_buf(), PathBuf::from);
    safe_subdir(subdir)?;
    Some(CkptDir {
        base: root,
        rel: PathBuf::from(subdir),
    })
}

fn safe_subdir(subdir: &str) -> Option<()> {
    if subdir.is_empty() || subdir.starts_with('/') {
        return None;
    }
    for part in subdir.split('/') {
        if part.is_empty() || part == "." || part == ".." {
            return None;
        }
    }
    Some(())
}

/// Removes a succeeded job's checkpoint directory (absent is fine): reached
/// by descriptor through root's levels only, and removed without leaving it.
pub fn remove_dir(agent_root: &Path, cluster_root: Option<&str>, subdir: &str) {
    let Some(dir) = checkpoint_dir(agent_root, cluster_root, subdir) else {
        tracing::warn!("refusing to remove checkpoint directory {subdir:?}");
        return;
    };
    match remove(&dir) {
        Ok(()) => tracing::info!("removed checkpoints {}", dir.path().display()),
        Err(e) if e.not_found() => {}
        Err(e) => tracing::warn!("cannot remove checkpoints {}: {e}", dir.path().display()),
    }
}

fn remove(dir: &CkptDir) -> Result<(), FsError> {
    let base = safefs::open_base(&dir.base)?;
    let name = dir.rel.file_name().ok_or_else(|| FsError::Refused {
        path: dir.rel.display().to_string(),
        why: "no last component".into(),
    })?;
    let parent = safefs::open_parent(&base, dir.rel.parent().unwrap_or(Path::new("")), None)?;
    safefs::remove_tree(parent.as_fd(), name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held by a test to stand for a read stuck on a dead mount.
    pub(super) static STALL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn a_stuck_read_is_never_joined_by_another_and_the_last_value_stands() {
        let (_d, c) = root_with_job();
        write_latest(&c.path(), r#"{"step": 1, "path": "a"}"#);
        let cache = LatestCache::default();
        assert_eq!(
            cache
                .refresh_blocking(&c, Duration::from_secs(5))
                .map(|l| l.report.step),
            Some(1)
        );
        write_latest(&c.path(), r#"{"step": 2, "path": "b"}"#);
        let stall = STALL.lock().unwrap_or_else(|e| e.into_inner());
        assert!(cache.start(&c), "a read starts");
        for _ in 0..5 {
            assert!(!cache.start(&c), "no second read while one is stuck");
        }
        let t = std::time::Instant::now();
        let v = cache.refresh_blocking(&c, Duration::from_millis(100));
        assert!(t.elapsed() < Duration::from_secs(1), "the wait is bounded");
        assert_eq!(v.map(|l| l.report.step), Some(1), "the last good value");
        drop(stall);
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while cache.busy() && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(cache.value().map(|l| l.report.step), Some(2));
    }

    fn write_latest(dir: &Path, text: &str) {
        let tmp = dir.join("LATEST.tmp");
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, dir.join(LATEST)).expect("rename");
    }

    /// A checkpoint root (mode 0755) with one job directory, `u/job-1`.
    fn root_with_job() -> (tempfile::TempDir, CkptDir) {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().expect("tmp");
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::create_dir_all(d.path().join("u/job-1")).expect("mk");
        let c = checkpoint_dir(d.path(), None, "u/job-1").expect("dir");
        (d, c)
    }

    fn latest(c: &CkptDir) -> Option<CheckpointReport> {
        read_latest(c).expect("not refused").map(|l| l.report)
    }

    #[test]
    fn latest_is_read_with_its_path_made_absolute() {
        let (_d, c) = root_with_job();
        let dir = c.path();
        assert_eq!(latest(&c), None, "no file, no checkpoint");
        write_latest(&dir, r#"{"step": 340, "path": "step-340.pt"}"#);
        let r = latest(&c).expect("checkpoint");
        assert_eq!(r.step, 340);
        assert_eq!(r.path, dir.join("step-340.pt").display().to_string());
        assert!(r.written_ms > 1_600_000_000_000, "mtime in ms");
        assert_eq!(read_final(&c), None);
        write_latest(
            &dir,
            r#"{"step": 341, "path": "/shared/ck/341", "extra": 1, "final": true}"#,
        );
        assert_eq!(latest(&c).expect("c").path, "/shared/ck/341");
        assert_eq!(read_final(&c).map(|f| f.0), Some(341));
    }

    #[test]
    fn malformed_latest_files_are_ignored() {
        let (_d, c) = root_with_job();
        let dir = c.path();
        for bad in [
            "",
            "{",
            r#"{"step": -1, "path": "a"}"#,
            r#"{"step": 1.5, "path": "a"}"#,
            r#"{"step": 1}"#,
            r#"{"step": 1, "path": ""}"#,
            r#"{"step": "1", "path": "a"}"#,
            r#"[1, "a"]"#,
        ] {
            write_latest(&dir, bad);
            assert_eq!(latest(&c), None, "{bad}");
        }
        let huge = format!(r#"{{"step": 1, "path": "{}"}}"#, "a".repeat(70_000));
        write_latest(&dir, &huge);
        assert!(read_latest(&c).is_err(), "too big");
    }

    #[test]
    fn a_latest_that_is_a_link_fifo_device_or_hard_link_is_refused_unread() {
        let (d, c) = root_with_job();
        let dir = c.path();
        std::fs::write(
            d.path().join("secret"),
            r#"{"step": 9, "path": "root-only"}"#,
        )
        .expect("secret");
        let secret = d.path().join("secret");
        let plant = |what: &str, p: &Path| match what {
            "link" => std::os::unix::fs::symlink(&secret, p).expect("ln"),
            "fifo" => rustix::fs::mknodat(
                rustix::fs::CWD,
                p,
                rustix::fs::FileType::Fifo,
                rustix::fs::Mode::from_raw_mode(0o666),
                0,
            )
            .expect("mkfifo"),
            // /dev/null's numbers, made here (root only).
            "device" => rustix::fs::mknodat(
                rustix::fs::CWD,
                p,
                rustix::fs::FileType::CharacterDevice,
                rustix::fs::Mode::from_raw_mode(0o666),
                rustix::fs::makedev(1, 3),
            )
            .expect("mknod"),
            _ => std::fs::hard_link(&secret, p).expect("ln"),
        };
        let mut kinds = vec!["link", "fifo", "hard link"];
        if rustix::process::geteuid().is_root() {
            kinds.push("device");
        }
        for what in kinds {
            let _ = std::fs::remove_file(dir.join(LATEST));
            plant(what, &dir.join(LATEST));
            let t = std::time::Instant::now();
            let e = read_latest(&c).expect_err(what);
            assert!(t.elapsed() < Duration::from_secs(1), "{what}: never blocks");
            assert!(e.contains("refused"), "{what}: {e}");
        }
        // The cache keeps the last good value and reads off the caller's thread.
        let _ = std::fs::remove_file(dir.join(LATEST));
        write_latest(&dir, r#"{"step": 5, "path": "p"}"#);
        let cache = LatestCache::default();
        let v = cache.refresh_blocking(&c, Duration::from_secs(5));
        assert_eq!(v.map(|l| l.report.step), Some(5));
        std::fs::remove_file(dir.join(LATEST)).expect("rm");
        std::os::unix::fs::symlink(d.path().join("secret"), dir.join(LATEST)).expect("ln");
        let v = cache.refresh_blocking(&c, Duration::from_secs(5));
        assert_eq!(v.map(|l| l.report.step), Some(5), "the link is not read");
    }

    #[test]
    fn a_job_directory_reached_through_a_users_link_or_directory_is_not_read() {
        let (d, _) = root_with_job();
        std::fs::create_dir(d.path().join("decoy")).expect("decoy");
        write_latest(&d.path().join("decoy"), r#"{"step": 7, "path": "x"}"#);
        std::os::unix::fs::symlink(d.path().join("decoy"), d.path().join("u/job-1/link"))
            .expect("ln");
        let via_link = checkpoint_dir(d.path(), None, "u/job-1/link").expect("dir");
        assert!(read_latest(&via_link).is_err(), "a final link");
        std::os::unix::fs::symlink(d.path().join("u"), d.path().join("u/job-1/up")).expect("ln");
        let on_the_way = checkpoint_dir(d.path(), None, "u/job-1/up/job-1").expect("dir");
        assert!(read_latest(&on_the_way).is_err(), "an intermediate link");
    }

    #[test]
    fn a_listening_port_is_busy_and_a_closed_one_free() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        assert!(
            !port_free(port),
            "held on loopback, so 0.0.0.0 cannot have it"
        );
        drop(l);
        assert!(port_free(port));
    }

    #[test]
    fn a_failure_carries_the_signal_and_the_last_log_lines() {
        let d = tempfile::tempdir().expect("tmp");
        let log = d.path().join("r.log");
        let text: String = (0..30).map(|i| format!("line {i}\n")).collect();
        std::fs::write(&log, text).expect("log");
        let f = rank_failure(5, 137, &log);
        assert_eq!(f.signal, Some(9));
        assert_eq!(f.log_tail.len(), LOG_TAIL_LINES);
        assert_eq!(f.log_tail.last().map(String::as_str), Some("line 29"));
        assert_eq!(rank_failure(5, 3, &log).signal, None);
        assert!(rank_failure(5, 1, &d.path().join("none"))
            .log_tail
            .is_empty());
    }

    #[test]
    fn checkpoint_dirs_stay_under_the_root() {
        let root = Path::new("/var/ck");
        let at = |c: Option<&str>, s: &str| checkpoint_dir(root, c, s).map(|d| d.path());
        assert_eq!(
            at(None, "alice/job-3"),
            Some(PathBuf::from("/var/ck/alice/job-3"))
        );
        assert_eq!(
            at(Some("/shared"), "alice/run"),
            Some(PathBuf::from("/shared/alice/run"))
        );
        for bad in ["", "/etc", "alice/../bob", "..", "a//b", "./a"] {
            assert_eq!(at(None, bad), None, "{bad}");
        }
        let (d, _) = root_with_job();
        std::fs::create_dir_all(d.path().join("u/job-1/x")).expect("mk");
        remove_dir(d.path(), None, "u/job-1");
        assert!(!d.path().join("u/job-1").exists());
        assert!(d.path().join("u").exists(), "only the job's directory");
        remove_dir(d.path(), None, "u/job-1");
    }

    #[test]
    fn removal_never_goes_through_a_link_on_the_way() {
        let (d, _) = root_with_job();
        std::fs::create_dir_all(d.path().join("decoy/sub")).expect("decoy");
        std::fs::write(d.path().join("decoy/sub/f"), "keep").expect("f");
        std::os::unix::fs::symlink(d.path().join("decoy"), d.path().join("u/link2")).expect("ln");
        remove_dir(d.path(), None, "u/link2/sub");
        assert_eq!(
            std::fs::read(d.path().join("decoy/sub/f")).expect("kept"),
            b"keep"
        );
    }
}
