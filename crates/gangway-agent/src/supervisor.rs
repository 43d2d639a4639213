//! The rank supervisor: between fork and exec the rank's child forks once
//! more; the grandchild becomes the rank's command, the child stays behind
//! as a tiny supervisor that ignores the rank's signals, waits for the
//! command and writes its exit code (128+N for signal N) to a file, then
//! exits with the same code. The agent waits for the supervisor as before;
//! an agent that restarted and cannot wait for it (it is not its child)
//! reads the file instead, so a re-adopted rank's exit code is still known
//! and a gang that finished while the agent was down is not restarted.
//!
//! The supervisor is not an agent: it rewrites its command line to
//! `gangway-rank JOB/ATTEMPT/RANK` (in place, over the agent's argv, as
//! setproctitle does), so `pkill -f "gangway agent.*node-1"` ends the agent
//! and leaves the supervisors, which then keep the rank's exit code for the
//! next agent.
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
    /// The supervisor's command line (`gangway-rank JOB/ATTEMPT/RANK`).
    title: Vec<u8>,
    /// The process's argv area (`arg_start`, `arg_end` of /proc/self/stat),
    /// inherited by the fork: the title is written over it.
    args: Option<(usize, usize)>,
}

/// Where this process's argv strings lie (fields 48 and 49 of
/// /proc/self/stat), read before the fork.
fn argv_area() -> Option<(usize, usize)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) start at 3.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let start: usize = fields.get(48 - 3)?.parse().ok()?;
    let end: usize = fields.get(49 - 3)?.parse().ok()?;
    (start > 0 && end > start).then_some((start, end))
}

/// A command line for a process forked from the agent without an exec
/// (a rank's supervisor, its log pump), so `pkill -f` for the agent does
/// not match it. Built before the fork.
#[derive(Clone, Debug)]
pub struct Title {
    text: Vec<u8>,
    area: Option<(usize, usize)>,
}

impl Title {
    /// The title `text` (words split at spaces, as `ps` shows them).
    pub fn new(text: &str) -> Self {
        Title {
            text: text.as_bytes().to_vec(),
            area: argv_area(),
        }
    }

    /// Writes the title over the inherited argv area, padded with NULs (cut
    /// to the area's size). No allocation: for a forked child.
    ///
    /// # Safety
    /// Only in a forked child, whose argv area is its own copy.
    pub unsafe fn apply(&self) {
        let Some((start, end)) = self.area else {
            return;
        };
        let len = end - start;
        let area = start as *mut u8;
        std::ptr::write_bytes(area, 0, len);
        // Keep the last byte NUL: the kernel then reads the area alone.
        let n = self.text.len().min(len.saturating_sub(1));
        for (i, b) in self.text[..n].iter().enumerate() {
            *area.add(i) = if *b == b' ' { 0 } else { *b };
        }
    }
}

/// The command line of a rank's supervisor.
pub fn title(job: u64, attempt: u32, rank: u32) -> String {
    format!("gangway-rank {job}/{attempt}/{rank}")
}

impl Supervisor {
    /// A supervisor writing to `file` (through `file.tmp` and a rename),
    /// its command line `title` (see [`title`]).
    pub fn new(file: &Path, title: &str) -> Option<Self> {
        let mut tmp = file.as_os_str().as_bytes().to_vec();
        tmp.extend_from_slice(b".tmp");
        Some(Supervisor {
            file: CString::new(file.as_os_str().as_bytes()).ok()?,
            tmp: CString::new(tmp).ok()?,
            title: title.as_bytes().to_vec(),
            args: argv_area(),
        })
    }

    /// Writes the title over the inherited argv area.
    ///
    /// # Safety
    /// Only in the forked supervisor, whose argv area is its own copy.
    unsafe fn set_title(&self) {
        Title {
            text: self.title.clone(),
            area: self.args,
        }
        .apply()
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
        // The supervisor (named so in `ps -o comm`, and its command line
        // `gangway-rank JOB/ATTEMPT/RANK`, no longer the agent's). Signals
        // meant for the rank do not end it (SIGKILL does; then the agent
        // reads what the rank left, see `crate::agent`).
        libc::prctl(libc::PR_SET_NAME, c"gangway-rank".as_ptr(), 0, 0, 0);
        self.set_title();
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
