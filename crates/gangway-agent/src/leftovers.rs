//! A record of the process ranks an agent started, so that after the agent
//! crashes and restarts it can find and kill what its predecessor left.
//! One file per rank, `<state_dir>/ranks/<job>-<attempt>-<rank>`, holding the
//! process group id and its start time (so a recycled pid is never killed).

use crate::executor::RankKey;
use gangway_core::JobId;
use std::path::{Path, PathBuf};

fn dir(state_dir: &Path) -> PathBuf {
    state_dir.join("ranks")
}

fn file(state_dir: &Path, k: RankKey) -> PathBuf {
    dir(state_dir).join(format!("{}-{}-{}", k.job, k.attempt, k.rank))
}

/// The kernel's start time of a process (field 22 of /proc/PID/stat).
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit(')').next()?;
    // Fields after the command: state is field 3, start time field 22.
    after.split_whitespace().nth(19)?.parse().ok()
}

/// Records a started rank.
pub fn record(state_dir: &Path, k: RankKey, pid: i32) {
    let _ = std::fs::create_dir_all(dir(state_dir));
    let start = start_time(pid).unwrap_or(0);
    if let Err(e) = std::fs::write(file(state_dir, k), format!("{pid} {start}\n")) {
        tracing::warn!("cannot record rank {k:?}: {e}");
    }
}

/// Forgets a rank that exited.
pub fn forget(state_dir: &Path, k: RankKey) {
    let _ = std::fs::remove_file(file(state_dir, k));
}

/// Kills every recorded rank that still runs and clears the records;
/// returns the ranks that were recorded.
pub fn kill_processes(state_dir: &Path) -> Vec<RankKey> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir(state_dir))
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().to_string();
        let parts: Vec<&str> = name.split('-').collect();
        let key = match parts.as_slice() {
            [j, a, r] => match (j.parse(), a.parse(), r.parse()) {
                (Ok(j), Ok(a), Ok(r)) => RankKey {
                    job: JobId(j),
                    attempt: a,
                    rank: r,
                },
                _ => continue,
            },
            _ => continue,
        };
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        let mut it = text.split_whitespace();
        let pid: Option<i32> = it.next().and_then(|p| p.parse().ok());
        let start: Option<u64> = it.next().and_then(|s| s.parse().ok());
        if let (Some(pid), Some(start)) = (pid, start) {
            if pid > 1 && start_time(pid) == Some(start) {
                // SAFETY: kill(2) on the process group this agent's predecessor created.
                unsafe {
                    libc::kill(-pid, libc::SIGKILL);
                }
            }
        }
        let _ = std::fs::remove_file(e.path());
        out.push(key);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_rank_is_killed_and_reported_once() {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().expect("tmp");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .expect("sleep");
        let k = RankKey {
            job: JobId(3),
            attempt: 1,
            rank: 2,
        };
        record(dir.path(), k, child.id() as i32);
        assert_eq!(kill_processes(dir.path()), vec![k]);
        let status = child.wait().expect("wait");
        assert!(!status.success(), "killed");
        assert!(kill_processes(dir.path()).is_empty(), "records cleared");
    }
}
