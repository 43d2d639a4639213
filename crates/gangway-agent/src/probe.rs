//! What a rank's account finds on its way to a path, asked with that
//! account's own credentials: a forked child drops to the account
//! (supplementary groups, gid, uid), then `stat`s and `access`es each step
//! of each path and writes fixed-size findings to a pipe. Root never looks
//! for a user: a message built from what root sees would tell the user what
//! exists inside directories they cannot search.
//!
//! Bounded (at most [`MAX_PATHS`] paths of at most [`MAX_PATH_BYTES`] bytes
//! and [`MAX_STEPS`] components) and timed ([`TIMEOUT`]: a path through a
//! hung mount cannot hold the caller); blocking, so async callers run it
//! with `spawn_blocking` ([`probe_async`]).

use crate::identity::Account;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Most paths one probe looks at (the rest are [`Found::Unchecked`]).
pub const MAX_PATHS: usize = 64;
/// Longest path probed, in bytes.
pub const MAX_PATH_BYTES: usize = 4096;
/// Most components of a probed path.
pub const MAX_STEPS: usize = 128;
/// How long the account's child may take before it is killed.
pub const TIMEOUT: Duration = Duration::from_millis(800);

/// What the account found on its way to one path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// Every step may be searched (the last executed or searched).
    Reachable,
    /// A step does not exist, as far as the account can see.
    Missing,
    /// The account may not take a step: `Some("/root is 0700")` where the
    /// account itself can see that step's mode, `None` where it cannot.
    Denied(Option<String>),
    /// Not looked at (beyond the bounds, or not absolute).
    Unchecked,
}

/// Why a probe told nothing.
#[derive(Debug, Error)]
pub enum ProbeError {
    /// A system call of the parent failed.
    #[error("cannot check paths as {who}: {err}")]
    Sys {
        /// The account, for messages.
        who: String,
        /// The error.
        err: std::io::Error,
    },
    /// The child did not answer within [`TIMEOUT`] (it is killed).
    #[error("checking paths as {0} took longer than {TIMEOUT:?}")]
    Timeout(String),
    /// The child could not become the account, or answered short.
    #[error("cannot check paths as {0}: the check could not run as that account")]
    Failed(String),
}

/// One step's finding as the child writes it: kind, step index, mode.
const RECORD: usize = 7;
const REACHABLE: u8 = 0;
const MISSING: u8 = 1;
const DENIED_MODE: u8 = 2;
const DENIED: u8 = 3;

/// The steps of an absolute path (`/`, `/a`, `/a/b`), as C strings; `None`
/// beyond the bounds or for a relative path or one holding NUL.
fn steps(path: &Path) -> Option<Vec<CString>> {
    if !path.is_absolute() || path.as_os_str().len() > MAX_PATH_BYTES {
        return None;
    }
    let mut at = PathBuf::from("/");
    let mut out = vec![CString::new("/").ok()?];
    for c in path.components().skip(1) {
        if out.len() >= MAX_STEPS {
            return None;
        }
        at.push(c);
        out.push(CString::new(at.as_os_str().as_bytes()).ok()?);
    }
    Some(out)
}

/// The child's side: as the account, the finding for one path's steps.
/// Only async-signal-safe calls (this runs between fork and `_exit`).
fn look(steps: &[CString]) -> [u8; RECORD] {
    let rec = |kind: u8, step: usize, mode: u32| {
        let s = (step.min(u16::MAX as usize) as u16).to_le_bytes();
        let m = mode.to_le_bytes();
        [kind, s[0], s[1], m[0], m[1], m[2], m[3]]
    };
    for (i, step) in steps.iter().enumerate() {
        // SAFETY: a zeroed stat is a valid out-parameter; the path is a C string.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::stat(step.as_ptr(), &mut st) } != 0 {
            // SAFETY: errno of this thread.
            let errno = unsafe { *libc::__errno_location() };
            return if errno == libc::ENOENT || errno == libc::ENOTDIR {
                rec(MISSING, i, 0)
            } else {
                rec(DENIED, i, 0)
            };
        }
        // SAFETY: as above; access(2) checks the real ids, the account's here.
        if unsafe { libc::access(step.as_ptr(), libc::X_OK) } != 0 {
            let errno = unsafe { *libc::__errno_location() };
            return if errno == libc::EACCES {
                rec(DENIED_MODE, i, st.st_mode & 0o7777)
            } else if errno == libc::ENOENT {
                rec(MISSING, i, 0)
            } else {
                rec(DENIED, i, 0)
            };
        }
    }
    rec(REACHABLE, 0, 0)
}

/// What `account` finds on its way to each of `paths`, in order, looked at
/// with its own credentials (the agent drops to it in a child; an agent
/// that already is the account looks itself, in a child all the same).
/// Blocking for at most [`TIMEOUT`].
pub fn probe(account: &Account, paths: &[PathBuf]) -> Result<Vec<Found>, ProbeError> {
    let who = crate::identity::who(account);
    let sys = |err| ProbeError::Sys {
        who: who.clone(),
        err,
    };
    let prepared: Vec<Option<Vec<CString>>> = paths
        .iter()
        .enumerate()
        .map(|(i, p)| if i < MAX_PATHS { steps(p) } else { None })
        .collect();
    let asked: Vec<usize> = (0..prepared.len())
        .filter(|&i| prepared[i].is_some())
        .collect();
    let mut found = vec![Found::Unchecked; paths.len()];
    if asked.is_empty() {
        return Ok(found);
    }
    let switch = nix::unistd::geteuid().as_raw() != account.uid;
    let groups: Vec<libc::gid_t> = account.groups.clone();
    let (uid, gid) = (account.uid, account.gid);
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(sys(std::io::Error::last_os_error()));
    }
    let (rfd, wfd) = (fds[0], fds[1]);
    // SAFETY: the child makes only async-signal-safe calls on memory built
    // before the fork (setgroups, setgid, setuid, stat, access, write, _exit).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        let e = std::io::Error::last_os_error();
        // SAFETY: our own descriptors.
        unsafe {
            libc::close(rfd);
            libc::close(wfd);
        }
        return Err(sys(e));
    }
    if pid == 0 {
        // SAFETY: see above; the child never returns.
        unsafe {
            libc::close(rfd);
            // Groups, gid, then uid; and root must not be taken back.
            if switch
                && (libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0
                    || (uid != 0 && libc::setuid(0) == 0))
            {
                libc::_exit(2);
            }
            for i in &asked {
                if let Some(Some(s)) = prepared.get(*i) {
                    let rec = look(s);
                    let mut off = 0;
                    while off < rec.len() {
                        let n = libc::write(wfd, rec[off..].as_ptr().cast(), rec.len() - off);
                        if n <= 0 {
                            libc::_exit(3);
                        }
                        off += n as usize;
                    }
                }
            }
            libc::_exit(0);
        }
    }
    // SAFETY: the parent's copy of the write end.
    unsafe { libc::close(wfd) };
    let want = asked.len() * RECORD;
    let mut buf = vec![0u8; want];
    let got = read_until(rfd, &mut buf, Instant::now() + TIMEOUT);
    // SAFETY: our read end.
    unsafe { libc::close(rfd) };
    let status = reap(pid, got.is_none());
    let Some(got) = got else {
        return Err(ProbeError::Timeout(who));
    };
    if got < want || status != Some(0) {
        return Err(ProbeError::Failed(who));
    }
    for (n, i) in asked.iter().enumerate() {
        let r = &buf[n * RECORD..(n + 1) * RECORD];
        let step = usize::from(u16::from_le_bytes([r[1], r[2]]));
        let mode = u32::from_le_bytes([r[3], r[4], r[5], r[6]]);
        let at = || {
            prepared[*i]
                .as_ref()
                .and_then(|s| s.get(step))
                .map(|c| String::from_utf8_lossy(c.as_bytes()).to_string())
        };
        found[*i] = match r[0] {
            REACHABLE => Found::Reachable,
            MISSING => Found::Missing,
            DENIED_MODE => Found::Denied(at().map(|s| format!("{s} is {mode:04o}"))),
            _ => Found::Denied(None),
        };
    }
    Ok(found)
}

/// Reads into `buf` until it is full or the writer is gone; `None` past
/// `deadline`. Returns the bytes read.
fn read_until(fd: i32, buf: &mut [u8], deadline: Instant) -> Option<usize> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
        // SAFETY: one pollfd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Some(got);
        }
        if r == 0 {
            continue;
        }
        // SAFETY: reads into the rest of `buf`.
        let n = unsafe { libc::read(fd, buf[got..].as_mut_ptr().cast(), buf.len() - got) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Some(got);
        }
        if n == 0 {
            break;
        }
        got += n as usize;
    }
    Some(got)
}

/// Waits for the child (killed first when `kill`); its exit code when it
/// exited. A killed child that does not go at once (stuck in a hung mount)
/// is left to a thread that reaps it whenever it goes.
fn reap(pid: libc::pid_t, kill: bool) -> Option<i32> {
    if kill {
        // SAFETY: our own child.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let deadline = Instant::now() + Duration::from_millis(200);
    loop {
        let mut status = 0;
        // SAFETY: our own child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
        }
        if r < 0 {
            return None;
        }
        if Instant::now() >= deadline {
            if !kill {
                // SAFETY: our own child; it answered but lingers.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::spawn(move || {
                let mut status = 0;
                // SAFETY: our own child, reaped once.
                unsafe { libc::waitpid(pid, &mut status, 0) };
            });
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// [`probe`] on a blocking thread, for the agent's async loop.
pub async fn probe_async(account: Account, paths: Vec<PathBuf>) -> Result<Vec<Found>, ProbeError> {
    let who = crate::identity::who(&account);
    match tokio::task::spawn_blocking(move || probe(&account, &paths)).await {
        Ok(r) => r,
        Err(_) => Err(ProbeError::Failed(who)),
    }
}

/// The warning for each `PATH` entry of `path_var` that `account` cannot
/// search (`PATH entry /root/venv/bin cannot be searched by user nobody
/// (uid 65534): /root is 0700; ...`), as the account finds it: a command
/// there is silently not found and the shell falls back to a later entry.
/// Relative entries are skipped; a probe that told nothing gives one
/// warning saying so.
pub async fn path_warnings(account: &Account, path_var: &str) -> Vec<String> {
    let entries: Vec<&str> = path_var.split(':').filter(|d| d.starts_with('/')).collect();
    if entries.is_empty() {
        return Vec::new();
    }
    let who = crate::identity::who(account);
    let paths = entries.iter().map(PathBuf::from).collect();
    match probe_async(account.clone(), paths).await {
        Ok(found) => entries
            .iter()
            .zip(found)
            .filter_map(|(d, f)| match f {
                Found::Denied(why) => Some(format!(
                    "PATH entry {} cannot be searched by {who}{}; commands there are not found and the shell falls back to later entries",
                    gangway_core::text::printable(d),
                    why.map(|w| format!(": {}", gangway_core::text::printable(&w)))
                        .unwrap_or_default()
                )),
                _ => None,
            })
            .collect(),
        Err(e) => vec![format!("PATH entries not checked: {e}")],
    }
}

/// Why `cmd` could not be started by `account` for a permission error, as
/// the account finds it: the path (`cmd` itself when it holds a `/`, joined
/// to `workdir` when relative; else the first `PATH` entry where it is or
/// that the account may not search) and the step denied, where the account
/// may see it: `cannot start "/root/venv/bin/python": permission denied for
/// user nobody (uid 65534): /root is 0700`.
pub fn cannot_start(account: &Account, cmd: &str, workdir: Option<&str>, path_var: &str) -> String {
    let who = crate::identity::who(account);
    let candidates: Vec<PathBuf> = if cmd.contains('/') {
        let p = Path::new(cmd);
        vec![match workdir {
            Some(w) if p.is_relative() => Path::new(w).join(p),
            _ => p.to_path_buf(),
        }]
    } else {
        path_var
            .split(':')
            .filter(|d| d.starts_with('/'))
            .map(|d| Path::new(d).join(cmd))
            .collect()
    };
    let why = probe(account, &candidates).ok().and_then(|found| {
        found.into_iter().find_map(|f| match f {
            Found::Denied(why) => Some(why),
            Found::Reachable => Some(None),
            _ => None,
        })
    });
    match why.flatten() {
        Some(why) => format!("cannot start {cmd:?}: permission denied for {who}: {why}"),
        None => format!("cannot start {cmd:?}: permission denied for {who}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// `nobody`, when this test runs as root (only root drops to another
    /// account); else the test is skipped (a failure under CI's
    /// `GANGWAY_REQUIRE_ROOT`).
    fn nobody() -> Option<Account> {
        let a = crate::identity::resolve("nobody", "test").ok();
        match a {
            Some(a) if nix::unistd::geteuid().is_root() && a.uid != 0 => Some(a),
            _ => {
                gangway_store::testing::skip_or_fail(
                    "GANGWAY_REQUIRE_ROOT",
                    "probing as another account needs root and a nobody account",
                );
                None
            }
        }
    }

    #[test]
    fn the_account_finds_what_it_may_see_and_nothing_behind_a_closed_door() {
        let Some(nobody) = nobody() else {
            return;
        };
        let dir = tempfile::tempdir().expect("tmp");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        // A root-only directory holding `secret/bin`.
        let x = dir.path().join("X");
        std::fs::create_dir_all(x.join("secret/bin")).expect("mkdir");
        std::fs::set_permissions(&x, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let open = dir.path().join("open/bin");
        std::fs::create_dir_all(&open).expect("mkdir");
        let paths = vec![
            x.join("secret/bin"),
            x.join("nothere/bin"),
            open.clone(),
            dir.path().join("gone/bin"),
            PathBuf::from("relative/bin"),
        ];
        let found = probe(&nobody, &paths).expect("probe");
        let closed = Found::Denied(Some(format!("{} is 0700", x.display())));
        // What exists behind X is not told: both entries read the same.
        assert_eq!(found[0], closed);
        assert_eq!(found[1], closed);
        assert_eq!(found[2], Found::Reachable);
        assert_eq!(found[3], Found::Missing);
        assert_eq!(found[4], Found::Unchecked);
    }

    #[tokio::test]
    async fn path_warnings_are_identical_for_what_exists_and_what_does_not() {
        let Some(nobody) = nobody() else {
            return;
        };
        let dir = tempfile::tempdir().expect("tmp");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let x = dir.path().join("X");
        std::fs::create_dir_all(x.join("secret/bin")).expect("mkdir");
        std::fs::set_permissions(&x, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        let (secret, nothere) = (x.join("secret/bin"), x.join("nothere/bin"));
        let w = path_warnings(
            &nobody,
            &format!("{}:{}:/usr/bin", secret.display(), nothere.display()),
        )
        .await;
        assert_eq!(w.len(), 2, "{w:?}");
        let tail = |s: &str, entry: &Path| s.replacen(&entry.display().to_string(), "ENTRY", 1);
        assert_eq!(tail(&w[0], &secret), tail(&w[1], &nothere));
        assert_eq!(
            w[0],
            format!(
                "PATH entry {} cannot be searched by user nobody (uid {}): {} is 0700; commands there are not found and the shell falls back to later entries",
                secret.display(),
                nobody.uid,
                x.display()
            )
        );
        // Root would have seen inside X: no step below it is ever named.
        assert!(
            !w.iter()
                .any(|s| s.contains("secret/bin is") || s.contains("nothere/bin is")),
            "{w:?}"
        );
        // Through the user's own links into X (root would follow them and
        // see `secret`, 0700, but not `nothere`): the account cannot even
        // see why, and both read the same.
        std::fs::set_permissions(x.join("secret"), std::fs::Permissions::from_mode(0o700))
            .expect("chmod");
        let (l1, l2) = (dir.path().join("l1"), dir.path().join("l2"));
        std::os::unix::fs::symlink(x.join("secret"), &l1).expect("link");
        std::os::unix::fs::symlink(x.join("nothere"), &l2).expect("link");
        let (e1, e2) = (l1.join("bin"), l2.join("bin"));
        let w = path_warnings(&nobody, &format!("{}:{}", e1.display(), e2.display())).await;
        assert_eq!(w.len(), 2, "{w:?}");
        assert_eq!(tail(&w[0], &e1), tail(&w[1], &e2));
        assert_eq!(
            w[0],
            format!(
                "PATH entry {} cannot be searched by user nobody (uid {}); commands there are not found and the shell falls back to later entries",
                e1.display(),
                nobody.uid
            )
        );
        let start = cannot_start(
            &nobody,
            "python",
            None,
            &format!("{}:{}", nothere.display(), secret.display()),
        );
        assert_eq!(
            start,
            format!(
                "cannot start \"python\": permission denied for user nobody (uid {}): {} is 0700",
                nobody.uid,
                x.display()
            )
        );
    }

    /// A child that never answers (a step on a hung mount) is given up on
    /// at the deadline and killed; the caller is not held.
    #[test]
    fn a_child_that_does_not_answer_is_killed_at_the_deadline() {
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 fills two descriptors.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: the child only sleeps and exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            unsafe {
                libc::sleep(30);
                libc::_exit(0);
            }
        }
        // SAFETY: the parent's write end; the child keeps its own open.
        unsafe { libc::close(fds[1]) };
        let t = Instant::now();
        let mut buf = [0u8; RECORD];
        let got = read_until(
            fds[0],
            &mut buf,
            Instant::now() + Duration::from_millis(150),
        );
        assert_eq!(got, None, "no answer past the deadline");
        assert_eq!(reap(pid, true), None, "killed, not exited");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        // SAFETY: our read end.
        unsafe { libc::close(fds[0]) };
        // Gone: signal 0 finds no such process.
        assert_ne!(unsafe { libc::kill(pid, 0) }, 0);
    }

    #[test]
    fn paths_beyond_the_bounds_are_not_probed() {
        let me = crate::identity::current_account()
            .ok()
            .flatten()
            .expect("this process has an account");
        let long = PathBuf::from(format!("/{}", "a/".repeat(MAX_STEPS + 1)));
        let huge = PathBuf::from(format!("/{}", "b".repeat(MAX_PATH_BYTES + 1)));
        let mut paths = vec![long, huge];
        paths.extend((0..MAX_PATHS).map(|_| PathBuf::from("/")));
        let found = probe(&me, &paths).expect("probe");
        assert_eq!(found[0], Found::Unchecked);
        assert_eq!(found[1], Found::Unchecked);
        assert_eq!(found[2], Found::Reachable);
        // Only the first MAX_PATHS are looked at.
        assert_eq!(found[MAX_PATHS - 1], Found::Reachable);
        assert_eq!(found[MAX_PATHS], Found::Unchecked);
        assert_eq!(found.len(), MAX_PATHS + 2);
    }
}
