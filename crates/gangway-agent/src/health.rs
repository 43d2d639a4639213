//! The node's own health check (`--health-check`), as Slurm's
//! `HealthCheckProgram` or LBNL NHC: a command line the node's operator
//! configures on the agent (a short GPU burn, an NCCL loopback test). The
//! server cannot send a command; it can only ask for a run of this one, to
//! return an auto-cordoned node to service when it passes.
//!
//! A run is `/bin/sh -c COMMAND` as the agent's own account (root on a
//! production node, as Slurm runs its check), in its own process group,
//! with a minimal environment, all of the node's GPUs
//! (`CUDA_VISIBLE_DEVICES` with their UUIDs, `CUDA_DEVICE_ORDER=PCI_BUS_ID`)
//! and a timeout: at the timeout, and whenever the server stops asking, the
//! whole process group is killed. Runs happen on their own thread, never in
//! the sync loop; the last lines of their output (bounded) are kept for
//! the result.

use gangway_core::agent::{HealthCheckReport, HealthCheckResult};
use std::collections::VecDeque;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The timeout when none is given (`--health-check-timeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Lines of output kept for the result.
pub const TAIL_LINES: usize = 20;

/// Longest line kept (longer ones are cut).
pub const LINE_BYTES: usize = 512;

/// Exit code reported for a run killed at its timeout (as `timeout(1)`).
pub const TIMED_OUT: i32 = 124;

/// Exit code reported for a run that could not be started.
pub const NOT_STARTED: i32 = 127;

/// The configured check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheckConfig {
    /// A shell command line (`/bin/sh -c`).
    pub command: String,
    /// Longest a run may take before it is killed and counts as failed.
    pub timeout: Duration,
}

/// One run.
struct Run {
    id: u64,
    /// Its process group (its leader's pid), while it may still run.
    pgid: Option<i32>,
    result: Arc<Mutex<Option<HealthCheckResult>>>,
    /// Whether the result was already seen by [`HealthChecks::poll`].
    seen: bool,
}

/// The agent's health check and its current run.
pub struct HealthChecks {
    cfg: Option<HealthCheckConfig>,
    run: Option<Run>,
}

/// The last [`TAIL_LINES`] lines of a run's output.
#[derive(Default)]
struct Tail(VecDeque<String>);

impl Tail {
    fn push(&mut self, line: &[u8]) {
        let mut end = line.len().min(LINE_BYTES);
        let text = loop {
            // Cut at a character boundary.
            match std::str::from_utf8(&line[..end]) {
                Ok(t) => break t.to_string(),
                Err(e) if e.error_len().is_none() && end > 0 => end = e.valid_up_to(),
                Err(_) => break String::from_utf8_lossy(&line[..end]).into_owned(),
            }
        };
        if self.0.len() == TAIL_LINES {
            self.0.pop_front();
        }
        self.0.push_back(text.trim_end_matches('\r').to_string());
    }
}

/// Reads `from` to its end, adding each line to `tail` (a line is at most
/// [`LINE_BYTES`] in memory, however long it is).
fn pump(mut from: impl Read, tail: &Mutex<Tail>) {
    let mut buf = [0u8; 8192];
    let mut line: Vec<u8> = Vec::new();
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        for &b in &buf[..n] {
            if b == b'\n' {
                if let Ok(mut t) = tail.lock() {
                    t.push(&line);
                }
                line.clear();
            } else if line.len() < LINE_BYTES {
                line.push(b);
            }
        }
    }
    if !line.is_empty() {
        if let Ok(mut t) = tail.lock() {
            t.push(&line);
        }
    }
}

fn kill_group(pgid: i32) {
    // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

impl HealthChecks {
    /// The agent's check (`None`: not configured).
    pub fn new(cfg: Option<HealthCheckConfig>) -> Self {
        HealthChecks { cfg, run: None }
    }

    /// Whether a check is configured (the agent says so in its syncs).
    pub fn configured(&self) -> bool {
        self.cfg.is_some()
    }

    /// Whether a run is going.
    pub fn running(&self) -> bool {
        self.run
            .as_ref()
            .is_some_and(|r| r.result.lock().is_ok_and(|x| x.is_none()))
    }

    /// The server's wish from its sync answer: `Some(id)` runs the check as
    /// run `id` (once: a run already started or finished with that id is
    /// left as it is); `None` stops a run still going and forgets it. `env`
    /// is the run's whole environment.
    pub fn want(&mut self, run: Option<u64>, env: &[(String, String)]) {
        if self.run.as_ref().map(|r| r.id) == run {
            return;
        }
        self.stop();
        let (Some(id), Some(cfg)) = (run, self.cfg.clone()) else {
            return;
        };
        tracing::info!("health check run {id}: {}", cfg.command);
        self.run = Some(start(id, &cfg, env));
    }

    /// What the sync reports: the run asked for, going or ended.
    pub fn report(&self) -> Option<HealthCheckReport> {
        let r = self.run.as_ref()?;
        Some(HealthCheckReport {
            run: r.id,
            result: r.result.lock().ok().and_then(|x| x.clone()),
        })
    }

    /// Whether a run ended since the last call (the server should hear of
    /// it at once).
    pub fn poll(&mut self) -> bool {
        let Some(r) = self.run.as_mut() else {
            return false;
        };
        if r.seen || !r.result.lock().is_ok_and(|x| x.is_some()) {
            return false;
        }
        r.seen = true;
        r.pgid = None;
        if let Some(res) = r.result.lock().ok().and_then(|x| x.clone()) {
            tracing::info!(
                "health check run {} ended: exit {}: {}",
                r.id,
                res.exit_code,
                res.last_line()
            );
        }
        true
    }

    /// Kills a run still going and forgets it.
    fn stop(&mut self) {
        if let Some(r) = self.run.take() {
            let going = r.result.lock().is_ok_and(|x| x.is_none());
            if let (true, Some(pgid)) = (going, r.pgid) {
                tracing::info!("health check run {}: no longer wanted, killed", r.id);
                kill_group(pgid);
            }
        }
    }
}

impl Drop for HealthChecks {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts run `id` of the check: the process now, its waiting on a thread.
fn start(id: u64, cfg: &HealthCheckConfig, env: &[(String, String)]) -> Run {
    let result = Arc::new(Mutex::new(None));
    // stdout and stderr share one pipe (as `2>&1`), so the tail keeps the
    // order the check wrote its lines in.
    let spawned = std::io::pipe().and_then(|(reader, writer)| {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(&cfg.command)
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(writer.try_clone()?)
            .stderr(writer)
            .process_group(0);
        // `cmd` (and with it this side's write ends) is dropped on return,
        // so the reader sees the end of the output when the check's
        // processes close theirs.
        Ok((cmd.spawn()?, reader))
    });
    let (mut child, output) = match spawned {
        Ok(c) => c,
        Err(e) => {
            if let Ok(mut r) = result.lock() {
                *r = Some(HealthCheckResult {
                    exit_code: NOT_STARTED,
                    tail: vec![format!("cannot start the health check: {e}")],
                });
            }
            return Run {
                id,
                pgid: None,
                result,
                seen: false,
            };
        }
    };
    let pgid = i32::try_from(child.id()).ok();
    let tail = Arc::new(Mutex::new(Tail::default()));
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    {
        let t = tail.clone();
        std::thread::spawn(move || {
            pump(output, &t);
            let _ = done_tx.send(());
        });
    }
    let timeout = cfg.timeout;
    let out = result.clone();
    std::thread::spawn(move || {
        let started = Instant::now();
        let mut timed_out = false;
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) => {}
                Err(_) => break None,
            }
            if started.elapsed() >= timeout {
                timed_out = true;
                if let Some(g) = pgid {
                    kill_group(g);
                }
                break child.wait().ok();
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // Whatever the check left behind goes with it.
        if let Some(g) = pgid {
            kill_group(g);
        }
        // The output's end, or a second for what is still in the pipe.
        let _ = done_rx.recv_timeout(Duration::from_secs(1));
        let mut lines: Vec<String> = tail
            .lock()
            .map(|t| t.0.iter().cloned().collect())
            .unwrap_or_default();
        let exit_code = if timed_out {
            lines.push(format!(
                "timed out after {} s: killed",
                timeout.as_secs_f64()
            ));
            if lines.len() > TAIL_LINES {
                lines.remove(0);
            }
            TIMED_OUT
        } else {
            use std::os::unix::process::ExitStatusExt;
            match status {
                Some(s) => s
                    .code()
                    .or_else(|| s.signal().map(|n| 128 + n))
                    .unwrap_or(NOT_STARTED),
                None => NOT_STARTED,
            }
        };
        if let Ok(mut r) = out.lock() {
            *r = Some(HealthCheckResult {
                exit_code,
                tail: lines,
            });
        }
    });
    Run {
        id,
        pgid,
        result,
        seen: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checks(command: &str, timeout_ms: u64) -> HealthChecks {
        HealthChecks::new(Some(HealthCheckConfig {
            command: command.into(),
            timeout: Duration::from_millis(timeout_ms),
        }))
    }

    fn wait_result(h: &mut HealthChecks, secs: u64) -> HealthCheckResult {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < deadline {
            if h.poll() {
                return h.report().and_then(|r| r.result).expect("result");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("no result in {secs} s");
    }

    /// Processes of group `pgid` that still run (zombies, left to an init
    /// that may not reap them, run nothing).
    fn live_in_group(pgid: i32) -> Vec<String> {
        let mut out = Vec::new();
        for e in std::fs::read_dir("/proc").expect("proc").flatten() {
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            let rest: Vec<&str> = stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .collect();
            // state ppid pgrp ...
            if rest.get(2) == Some(&pgid.to_string().as_str()) && !rest[0].starts_with(['Z', 'X']) {
                out.push(stat);
            }
        }
        out
    }

    fn env() -> Vec<(String, String)> {
        vec![
            ("PATH".into(), "/usr/bin:/bin".into()),
            ("CUDA_VISIBLE_DEVICES".into(), "GPU-a,GPU-b".into()),
        ]
    }

    #[test]
    fn a_run_reports_its_exit_code_and_last_lines_once() {
        let mut h = checks(
            "echo checking; echo nccl loopback failed >&2; exit 3",
            10_000,
        );
        assert!(h.configured());
        assert_eq!(h.report(), None, "nothing asked");
        h.want(Some(7), &env());
        let r = wait_result(&mut h, 10);
        assert_eq!(r.exit_code, 3);
        assert_eq!(r.last_line(), "nccl loopback failed");
        assert!(r.tail.contains(&"checking".to_string()), "{:?}", r.tail);
        assert!(!h.poll(), "seen once");
        // The same run asked again is not run again.
        h.want(Some(7), &env());
        assert_eq!(h.report().map(|r| r.run), Some(7));
        assert!(!h.running());
        // Not asked any more: forgotten.
        h.want(None, &env());
        assert_eq!(h.report(), None);
    }

    #[test]
    fn the_run_sees_the_nodes_gpus_and_nothing_of_the_agents_environment() {
        std::env::set_var("GANGWAY_HEALTH_SECRET", "x");
        let mut h = checks(
            "test -z \"$GANGWAY_HEALTH_SECRET\" && echo \"$CUDA_VISIBLE_DEVICES\"",
            10_000,
        );
        h.want(Some(1), &env());
        let r = wait_result(&mut h, 10);
        assert_eq!((r.exit_code, r.last_line()), (0, "GPU-a,GPU-b"));
    }

    #[test]
    fn a_hanging_check_and_its_children_are_killed_at_the_timeout() {
        let dir = tempfile::tempdir().expect("tmp");
        let pid = dir.path().join("child");
        let mut h = checks(
            &format!("sleep 60 & echo $! > {}; echo started; wait", pid.display()),
            500,
        );
        let t = Instant::now();
        h.want(Some(2), &env());
        assert!(h.running());
        let r = wait_result(&mut h, 10);
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert_eq!(r.exit_code, TIMED_OUT);
        assert!(r.last_line().starts_with("timed out after 0.5 s"), "{r:?}");
        assert!(r.tail.contains(&"started".to_string()), "{r:?}");
        let child: u32 = std::fs::read_to_string(&pid)
            .expect("pid")
            .trim()
            .parse()
            .expect("pid");
        std::thread::sleep(Duration::from_millis(200));
        let state = std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default();
        let state = state.rsplit(')').next().unwrap_or("").trim_start();
        assert!(
            state.is_empty() || state.starts_with(['Z', 'X']),
            "the check's child {child} survived: {state}"
        );
    }

    #[test]
    fn a_run_no_longer_wanted_is_killed() {
        let mut h = checks("sleep 60", 60_000);
        h.want(Some(1), &env());
        assert!(h.running());
        let pgid = h.run.as_ref().and_then(|r| r.pgid).expect("pgid");
        h.want(None, &env());
        std::thread::sleep(Duration::from_millis(300));
        let left = live_in_group(pgid);
        assert!(left.is_empty(), "process group {pgid} still runs: {left:?}");
    }

    #[test]
    fn output_is_bounded_in_lines_and_line_length() {
        let mut h = checks(
            "i=0; while [ $i -lt 200 ]; do echo line $i; i=$((i+1)); done; head -c 100000 /dev/zero | tr '\\0' x; echo; exit 1",
            10_000,
        );
        h.want(Some(1), &env());
        let r = wait_result(&mut h, 10);
        assert_eq!(r.tail.len(), TAIL_LINES, "{:?}", r.tail);
        assert_eq!(r.tail.last().map(String::len), Some(LINE_BYTES));
        assert_eq!(r.tail[0], "line 181");
    }

    #[test]
    fn a_check_that_cannot_start_fails() {
        let mut h = checks("exec /nonexistent/check", 10_000);
        h.want(Some(1), &env());
        let r = wait_result(&mut h, 10);
        assert_eq!(r.exit_code, 127);
        assert!(!r.passed());
        let mut none = HealthChecks::new(None);
        none.want(Some(1), &env());
        assert_eq!(none.report(), None, "no check: nothing runs");
    }
}
