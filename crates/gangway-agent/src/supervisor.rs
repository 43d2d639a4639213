//! The rank supervisor: between fork and exec the rank's child forks once
//! more; the grandchild becomes the rank's command, the child stays behind
//! as a tiny supervisor that ignores the rank's signals, waits for the
//! command and writes its exit code (128+N for signal N) to a file, then
//! exits with the same code. The agent waits for the supervisor as before;
//! an agent that restarted and cannot wait for it (it is not its child)
//! reads the file instead, so a re-adopted rank's exit code is still known
//! and a gang that finished while the agent was down is not restarted.
//!
//! Everything here runs in a forked child of a multi-threaded process:
//! only async-signal-safe calls, nothing allocated.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Precomputed paths for [`Supervisor::fork`].
#[derive(Clone, Debug)]
pub struct Supervisor {
    file: CString,
    tmp: CString,
}

impl Supervisor {
    /// A supervisor writing to `file` (through `file.tmp` and a rename).
    pub fn new(file: &Path) -> Option<Self> {
        let mut tmp = file.as_os_str().as_bytes().to_vec();
        tmp.extend_from_slice(b".tmp");
        Some(Supervisor {
            file: CString::new(file.as_os_str().as_bytes()).ok()?,
            tmp: CString::new(tmp).ok()?,
        })
    }

    /// Forks: returns `Ok(())` in the grandchild, which goes on to exec the
    /// rank; the supervisor never returns.
    ///
    /// # Safety
    /// Only for a `pre_exec` hook (a freshly forked child).
    pub unsafe fn fork(&self) -> std::io::Result<()> {
        let pid = libc::fork();
        if pid < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if pid == 0 {
            // The command leads its own process group, as it would without
            // a supervisor (`kill -- -PID` still reaches what it did not move).
            libc::setpgid(0, 0);
            return Ok(());
        }
        // The supervisor (named so in `ps -o comm`; its command line is the
        // agent's). Signals meant for the rank do not end it (SIGKILL
        // does; then the agent knows, or reports the rank killed).
        libc::prctl(libc::PR_SET_NAME, c"gangway-rank".as_ptr(), 0, 0, 0);
        for sig in 1..32 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP && sig != libc::SIGCHLD {
                libc::signal(sig, libc::SIG_IGN);
            }
        }
        // Close every inherited descriptor, the spawner's exec-status pipe
        // among them, so the spawn returns once the rank's exec succeeded.
        if libc::syscall(libc::SYS_close_range, 0u32, u32::MAX, 0u32) != 0 {
            for fd in 0..65536 {
                libc::close(fd);
            }
        }
        let mut status = 0;
        let code = loop {
            let r = libc::waitpid(pid, &mut status, 0);
            if r == pid {
                break if libc::WIFEXITED(status) {
                    libc::WEXITSTATUS(status)
                } else if libc::WIFSIGNALED(status) {
                    128 + libc::WTERMSIG(status)
                } else {
                    255
                };
            }
            if r < 0 && *libc::__errno_location() != libc::EINTR {
                break 255;
            }
        };
        let mut buf = [0u8; 8];
        let mut n = 0;
        let mut v = code;
        let mut digits = [0u8; 4];
        let mut d = 0;
        loop {
            digits[d] = b'0' + (v % 10) as u8;
            d += 1;
            v /= 10;
            if v == 0 || d == digits.len() {
                break;
            }
        }
        while d > 0 {
            d -= 1;
            buf[n] = digits[d];
            n += 1;
        }
        buf[n] = b'\n';
        n += 1;
        let fd = libc::open(
            self.tmp.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
            0o644,
        );
        if fd >= 0 {
            let ok = libc::write(fd, buf.as_ptr().cast(), n) == n as isize;
            libc::close(fd);
            if ok {
                libc::rename(self.tmp.as_ptr(), self.file.as_ptr());
            }
        }
        libc::_exit(code)
    }
}

/// The exit code a supervisor wrote, if any.
pub fn read_exit(file: &Path) -> Option<i32> {
    std::fs::read_to_string(file).ok()?.trim().parse().ok()
}
