//! A process rank's log pump: the rank's stdout and stderr go into a pipe,
//! and a small process forked before the rank (in its container, so it is
//! tracked and stopped with it, and independent of the agent, so a rank
//! outlives an agent restart) copies the pipe into the rank's log, rotating
//! it at the size cap ([`crate::logs::Rotation`]). A flooding rank is held
//! back by the pipe and costs only its own log, never the node's disk.
//!
//! Runs between fork and exec: only async-signal-safe calls (pipe, fork,
//! dup2, read, write, open, rename, close), paths built before the fork.

use crate::logs::{dropped_path, rotated_path, Rotation};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Everything the pump needs, built before the fork.
#[derive(Clone, Debug)]
pub struct LogPump {
    /// The current log, then `.1`, `.2` … the oldest kept.
    files: Vec<CString>,
    /// Where the bytes rotated away for good are counted.
    dropped: CString,
    /// Bytes per file.
    max_bytes: u64,
    /// Its command line (`gangway-logs JOB/ATTEMPT/RANK`), not the agent's.
    title: crate::supervisor::Title,
}

impl LogPump {
    /// The pump of the rank logging to `log`.
    pub fn new(log: &Path, r: Rotation, title: &str) -> Option<Self> {
        let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).ok();
        Some(LogPump {
            files: (0..r.max_files.max(1))
                .map(|n| c(&rotated_path(log, n)))
                .collect::<Option<Vec<_>>>()?,
            dropped: c(&dropped_path(log))?,
            max_bytes: r.max_bytes.max(1),
            title: crate::supervisor::Title::new(title),
        })
    }

    /// Starts the pump and points the caller's stdout and stderr at it.
    ///
    /// # Safety
    /// Only async-signal-safe calls: meant for the child between fork and exec.
    pub unsafe fn start(&self) -> std::io::Result<()> {
        let mut fds = [0i32; 2];
        if libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let (r, w) = (fds[0], fds[1]);
        let pid = libc::fork();
        if pid < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if pid == 0 {
            self.pump(r)
        }
        // The rank: its output goes into the pipe (dup2 clears CLOEXEC).
        if libc::dup2(w, 1) < 0 || libc::dup2(w, 2) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        libc::close(r);
        libc::close(w);
        Ok(())
    }

    /// The pump's loop: never returns.
    unsafe fn pump(&self, r: i32) -> ! {
        libc::prctl(libc::PR_SET_NAME, c"gangway-logs".as_ptr(), 0, 0, 0);
        self.title.apply();
        // Drains to the end whatever signal the rank's stop sends (SIGKILL aside).
        for sig in 1..32 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP && sig != libc::SIGCHLD {
                libc::signal(sig, libc::SIG_IGN);
            }
        }
        libc::dup2(r, 0);
        if libc::syscall(libc::SYS_close_range, 1u32, u32::MAX, 0u32) != 0 {
            for fd in 1..65536 {
                libc::close(fd);
            }
        }
        let mut fd = self.open(false);
        let mut size = file_size(fd);
        let mut dropped = read_number(self.dropped.as_ptr());
        let mut buf = [0u8; 65536];
        loop {
            let n = libc::read(0, buf.as_mut_ptr().cast(), buf.len());
            if n < 0 && *libc::__errno_location() == libc::EINTR {
                continue;
            }
            if n <= 0 {
                break;
            }
            let mut data = &buf[..n as usize];
            while !data.is_empty() {
                if size >= self.max_bytes {
                    libc::close(fd);
                    dropped = dropped.saturating_add(self.rotate(size));
                    write_number(self.dropped.as_ptr(), dropped);
                    fd = self.open(true);
                    size = 0;
                }
                let room = (self.max_bytes - size).min(data.len() as u64) as usize;
                let written = if fd >= 0 {
                    libc::write(fd, data.as_ptr().cast(), room)
                } else {
                    room as isize // No log file: the bytes are lost, the rank goes on.
                };
                if written < 0 && *libc::__errno_location() == libc::EINTR {
                    continue;
                }
                // A full disk: drop the rest of this read rather than block the rank.
                let written = if written <= 0 { room } else { written as usize };
                size += written as u64;
                data = &data[written..];
            }
        }
        libc::_exit(0)
    }

    /// Opens the current file (truncated after a rotation).
    unsafe fn open(&self, truncate: bool) -> i32 {
        let mut flags =
            libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND | libc::O_CLOEXEC | libc::O_NOFOLLOW;
        if truncate {
            flags |= libc::O_TRUNC;
        }
        libc::open(self.files[0].as_ptr(), flags, 0o640)
    }

    /// Shifts the files by one (the oldest falls off); returns the bytes lost.
    unsafe fn rotate(&self, current: u64) -> u64 {
        let last = self.files.len() - 1;
        if last == 0 {
            return current;
        }
        let gone = path_size(self.files[last].as_ptr());
        for n in (1..last).rev() {
            libc::rename(self.files[n].as_ptr(), self.files[n + 1].as_ptr());
        }
        libc::rename(self.files[0].as_ptr(), self.files[1].as_ptr());
        gone
    }
}

unsafe fn file_size(fd: i32) -> u64 {
    let mut st: libc::stat = std::mem::zeroed();
    if fd >= 0 && libc::fstat(fd, &mut st) == 0 {
        st.st_size.max(0) as u64
    } else {
        0
    }
}

unsafe fn path_size(p: *const libc::c_char) -> u64 {
    let mut st: libc::stat = std::mem::zeroed();
    if libc::stat(p, &mut st) == 0 {
        st.st_size.max(0) as u64
    } else {
        0
    }
}

unsafe fn read_number(p: *const libc::c_char) -> u64 {
    let fd = libc::open(p, libc::O_RDONLY | libc::O_CLOEXEC);
    if fd < 0 {
        return 0;
    }
    let mut buf = [0u8; 24];
    let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
    libc::close(fd);
    let mut v: u64 = 0;
    for b in buf.iter().take(n.max(0) as usize) {
        if !b.is_ascii_digit() {
            break;
        }
        v = v.saturating_mul(10).saturating_add(u64::from(b - b'0'));
    }
    v
}

unsafe fn write_number(p: *const libc::c_char, mut v: u64) {
    let mut digits = [0u8; 21];
    let mut i = digits.len() - 1;
    digits[i] = b'\n';
    loop {
        i -= 1;
        digits[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    let fd = libc::open(
        p,
        libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
        0o640,
    );
    if fd >= 0 {
        libc::write(fd, digits[i..].as_ptr().cast(), digits.len() - i);
        libc::close(fd);
    }
}
