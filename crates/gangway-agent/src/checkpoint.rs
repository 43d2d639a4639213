//! The rank side of the job contract that the agent reads from disk: the
//! checkpoint handshake (`$GANGWAY_CHECKPOINT_DIR/LATEST`), the rendezvous
//! port check before rank 0 starts, what a failed rank left in its log, and
//! removing a succeeded job's checkpoints.
//!
//! The handshake is a file so that ranks need no library: a rank writes
//! `{"step": N, "path": "..."}` to a temporary file in the checkpoint
//! directory and renames it to `LATEST` (atomic on POSIX), after the
//! checkpoint itself is complete. The agent reads it on every sync.

use gangway_core::agent::{CheckpointReport, RankFailure};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Name of the handshake file in the checkpoint directory.
pub const LATEST: &str = "LATEST";

/// Largest `LATEST` file read (it holds two fields).
const MAX_LATEST_BYTES: u64 = 64 * 1024;

/// Longest accepted checkpoint path.
const MAX_PATH_LEN: usize = 4096;

/// Lines of a failed rank's log sent to the server.
pub const LOG_TAIL_LINES: usize = 10;

/// The checkpoint announced in `dir/LATEST`, if it holds a valid one:
/// `step` a non-negative integer, `path` a non-empty string (relative paths
/// are taken from `dir`). A half-written or malformed file is ignored, so
/// the previous report stands.
pub fn read_latest(dir: &Path) -> Option<CheckpointReport> {
    let file = dir.join(LATEST);
    let f = std::fs::File::open(&file).ok()?;
    let meta = f.metadata().ok()?;
    if !meta.is_file() || meta.len() > MAX_LATEST_BYTES {
        return None;
    }
    let mut text = String::new();
    f.take(MAX_LATEST_BYTES).read_to_string(&mut text).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
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
    let written_ms = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    Some(CheckpointReport {
        step,
        path: path.display().to_string(),
        written_ms,
    })
}

/// The step and time (ms since the epoch) of a `LATEST` that marks the
/// job's final checkpoint (`"final": true`): the job said it finished.
pub fn read_final(dir: &Path) -> Option<(u64, u64)> {
    let c = read_latest(dir)?;
    let text = std::fs::read_to_string(dir.join(LATEST)).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    (v.get("final")?.as_bool()? && v.get("step")?.as_u64()? == c.step)
        .then_some((c.step, c.written_ms))
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
    let Ok(mut f) = std::fs::File::open(path) else {
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
) -> Option<PathBuf> {
    let root = cluster_root.map_or_else(|| agent_root.to_path_buf(), PathBuf::from);
    safe_subdir(subdir)?;
    Some(root.join(subdir))
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

/// Removes a succeeded job's checkpoint directory (absent is fine).
pub fn remove_dir(agent_root: &Path, cluster_root: Option<&str>, subdir: &str) {
    let Some(dir) = checkpoint_dir(agent_root, cluster_root, subdir) else {
        tracing::warn!("refusing to remove checkpoint directory {subdir:?}");
        return;
    };
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => tracing::info!("removed checkpoints {}", dir.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("cannot remove checkpoints {}: {e}", dir.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_latest(dir: &Path, text: &str) {
        let tmp = dir.join("LATEST.tmp");
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, dir.join(LATEST)).expect("rename");
    }

    #[test]
    fn latest_is_read_with_its_path_made_absolute() {
        let d = tempfile::tempdir().expect("tmp");
        assert_eq!(read_latest(d.path()), None, "no file, no checkpoint");
        write_latest(d.path(), r#"{"step": 340, "path": "step-340.pt"}"#);
        let c = read_latest(d.path()).expect("checkpoint");
        assert_eq!(c.step, 340);
        assert_eq!(c.path, d.path().join("step-340.pt").display().to_string());
        assert!(c.written_ms > 1_600_000_000_000, "mtime in ms");
        write_latest(
            d.path(),
            r#"{"step": 341, "path": "/shared/ck/341", "extra": 1}"#,
        );
        assert_eq!(read_latest(d.path()).expect("c").path, "/shared/ck/341");
    }

    #[test]
    fn malformed_latest_files_are_ignored() {
        let d = tempfile::tempdir().expect("tmp");
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
            write_latest(d.path(), bad);
            assert_eq!(read_latest(d.path()), None, "{bad}");
        }
        let huge = format!(r#"{{"step": 1, "path": "{}"}}"#, "a".repeat(70_000));
        write_latest(d.path(), &huge);
        assert_eq!(read_latest(d.path()), None, "too big");
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
        assert_eq!(
            checkpoint_dir(root, None, "alice/job-3"),
            Some(PathBuf::from("/var/ck/alice/job-3"))
        );
        assert_eq!(
            checkpoint_dir(root, Some("/shared"), "alice/run"),
            Some(PathBuf::from("/shared/alice/run"))
        );
        for bad in ["", "/etc", "alice/../bob", "..", "a//b", "./a"] {
            assert_eq!(checkpoint_dir(root, None, bad), None, "{bad}");
        }
        let d = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(d.path().join("u/job-1/x")).expect("mk");
        remove_dir(d.path(), None, "u/job-1");
        assert!(!d.path().join("u/job-1").exists());
        assert!(d.path().join("u").exists(), "only the job's directory");
        remove_dir(d.path(), None, "u/job-1");
    }
}
