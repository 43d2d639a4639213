//! The agent's small HTTP server: rank logs for the server to relay.

use crate::safefs::{self, Create, FsError, Last};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::routing::get;
use axum::{Json, Router};
use gangway_core::agent::LogChunk;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

/// Largest chunk returned at once.
const MAX_CHUNK: u64 = 1 << 20;

/// What the log server needs.
#[derive(Clone)]
pub struct LogServer {
    /// Root of the log files.
    pub dir: PathBuf,
    /// The node's log key (the server's, sent at registration); only its
    /// bearer may read.
    pub token: Arc<RwLock<String>>,
}

/// The logs directory, the rank's directory under it and the file's name of
/// a path [`log_path`] built.
fn log_parts(log: &std::path::Path) -> Option<(&std::path::Path, PathBuf, &std::ffi::OsStr)> {
    let name = log.file_name()?;
    let attempt = log.parent()?;
    let job = attempt.parent()?;
    let base = job.parent()?;
    Some((
        base,
        PathBuf::from(job.file_name()?).join(attempt.file_name()?),
        name,
    ))
}

/// Opens the directory of a rank's log by descriptor from the agent's logs
/// directory (root's, 0700): made root's with mode 0700 when missing; a link
/// or another owner's directory on the way is refused. Returns it with the
/// log's file name.
pub fn open_log_dir(
    log: &std::path::Path,
) -> Result<(std::os::fd::OwnedFd, std::ffi::OsString), FsError> {
    let (base, rel, name) = log_parts(log).ok_or_else(|| FsError::Refused {
        path: log.display().to_string(),
        why: "not a rank log's path".into(),
    })?;
    let base = safefs::open_base(base)?;
    let dir = safefs::open_dir(
        std::os::fd::AsFd::as_fd(&base),
        &rel,
        Some(0o700),
        Last::Root { mode: 0o700 },
    )?;
    Ok((dir, name.to_os_string()))
}

/// Opens a rank's log for appending (made root's, 0600, when missing), by
/// descriptor and never through a link.
pub fn open_append(log: &std::path::Path) -> Result<std::fs::File, FsError> {
    let (dir, name) = open_log_dir(log)?;
    safefs::create_file(std::os::fd::AsFd::as_fd(&dir), &name, 0o600, Create::Append)
}

/// Opens a log file for reading without following a link or waiting on a
/// FIFO (the logs' directories are root's; this holds even if one were not).
pub fn open_read(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok(f)
}

/// Path of a rank's log file.
pub fn log_path(dir: &std::path::Path, job: u64, attempt: u32, rank: u32) -> PathBuf {
    dir.join(format!("job-{job}"))
        .join(format!("attempt-{attempt}"))
        .join(format!("rank-{rank}.log"))
}

#[derive(serde::Deserialize)]
struct Offset {
    offset: Option<u64>,
}

async fn read_log(
    State(s): State<LogServer>,
    headers: HeaderMap,
    Path((job, attempt, rank)): Path<(u64, u32, u32)>,
    Query(q): Query<Offset>,
) -> Result<Json<LogChunk>, (StatusCode, String)> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let ok = s
        .token
        .read()
        .map(|t| !t.is_empty() && given.is_some_and(|g| same(g.as_bytes(), t.as_bytes())))
        .unwrap_or(false);
    if !ok {
        return Err((StatusCode::UNAUTHORIZED, "node token required".into()));
    }
    let path = log_path(&s.dir, job, attempt, rank);
    let offset = q.offset.unwrap_or(0);
    if !path.exists() {
        return Err((
            StatusCode::NOT_FOUND,
            format!("no log for job {job} attempt {attempt} rank {rank}"),
        ));
    }
    let (buf, next, skipped) = read_rotated(&path, offset, MAX_CHUNK)
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok(Json(LogChunk {
        data: String::from_utf8_lossy(&buf).into_owned(),
        next_offset: next,
        dropped: skipped,
    }))
}

/// Equal bytes, compared in time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// The router.
pub fn router(s: LogServer) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/v1/logs/{job}/{attempt}/{rank}", get(read_log))
        .with_state(s)
}

/// Log size per file at which a rank's log is rotated, when its queue says
/// nothing (the kubelet's `containerLogMaxSize`).
pub const DEFAULT_LOG_MAX_BYTES: u64 = 10 << 20;
/// Log files kept per rank, the current one included (`containerLogMaxFiles`).
pub const DEFAULT_LOG_MAX_FILES: u32 = 5;

/// How a rank's log is bounded: rotated at `max_bytes`, `max_files` kept
/// (`rank-R.log`, then `rank-R.log.1` … the oldest); what falls off the end
/// is counted in `rank-R.log.dropped`, so readers can say so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rotation {
    /// Bytes per file.
    pub max_bytes: u64,
    /// Files kept, the current one included (at least 1).
    pub max_files: u32,
}

impl Rotation {
    /// The queue's rotation, or the defaults.
    pub fn of(p: &gangway_core::node_policy::RankLimitPolicy) -> Self {
        Rotation {
            max_bytes: p.log_max_bytes.unwrap_or(DEFAULT_LOG_MAX_BYTES).max(4096),
            max_files: p
                .log_max_files
                .unwrap_or(DEFAULT_LOG_MAX_FILES)
                .clamp(1, 100),
        }
    }

    /// The most a rank's log takes on disk.
    pub fn cap(&self) -> u64 {
        self.max_bytes.saturating_mul(u64::from(self.max_files))
    }
}

/// `rank-R.log.N`: the Nth older file of a rotated log (0: the current one).
pub fn rotated_path(log: &std::path::Path, n: u32) -> PathBuf {
    if n == 0 {
        return log.to_path_buf();
    }
    let mut s = log.as_os_str().to_os_string();
    s.push(format!(".{n}"));
    PathBuf::from(s)
}

/// `rank-R.log.dropped`: bytes of the log rotated away for good.
pub fn dropped_path(log: &std::path::Path) -> PathBuf {
    let mut s = log.as_os_str().to_os_string();
    s.push(".dropped");
    PathBuf::from(s)
}

/// Bytes of `log` rotated away for good.
pub fn dropped_bytes(log: &std::path::Path) -> u64 {
    open_read(&dropped_path(log))
        .and_then(|f| std::io::read_to_string(f.take(64)))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Bytes of a rotated log on disk, every kept file together.
pub fn bytes_on_disk(log: &std::path::Path) -> u64 {
    (0..=100)
        .map(|n| rotated_path(log, n))
        .take_while(|p| p.exists())
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}

/// Reads a rotated log as one stream: byte `offset` counts from the start of
/// everything the rank ever wrote; what was rotated away is skipped (the
/// returned `skipped` says how many bytes). Returns the data, the offset to
/// ask for next and the bytes skipped.
pub fn read_rotated(
    log: &std::path::Path,
    offset: u64,
    max: u64,
) -> std::io::Result<(Vec<u8>, u64, u64)> {
    let dropped = dropped_bytes(log);
    // Oldest first: `.K` … `.1`, then the current file.
    let mut files: Vec<(PathBuf, u64)> = Vec::new();
    let mut n = 1;
    while let Ok(m) = std::fs::metadata(rotated_path(log, n)) {
        files.push((rotated_path(log, n), m.len()));
        n += 1;
        if n > 100 {
            break;
        }
    }
    files.reverse();
    let current = std::fs::metadata(log)?.len();
    files.push((log.to_path_buf(), current));
    let start = offset.max(dropped);
    let skipped = start - offset;
    let mut buf = Vec::new();
    let mut base = dropped;
    for (path, len) in files {
        let end = base + len;
        if start < end && (buf.len() as u64) < max {
            let from = start.max(base) - base;
            let mut f = open_read(&path)?;
            f.seek(SeekFrom::Start(from))?;
            f.take(max - buf.len() as u64).read_to_end(&mut buf)?;
        }
        base = end;
    }
    let next = start + buf.len() as u64;
    Ok((buf, next, skipped))
}

/// A log file rotated as it is written (Docker ranks, whose output the
/// agent copies; process ranks have the same rotation in their log pump).
/// Its directory is held open: every file is created, renamed and replaced
/// relative to it, never through a link.
pub struct RotatingLog {
    dir: std::os::fd::OwnedFd,
    name: std::ffi::OsString,
    path: PathBuf,
    rotation: Rotation,
    file: std::fs::File,
    size: u64,
}

fn io_err(e: FsError) -> std::io::Error {
    match e {
        FsError::Io { source, .. } => source,
        e => std::io::Error::other(e.to_string()),
    }
}

impl RotatingLog {
    /// Opens (appending to) `path`, in a directory that must be root's.
    pub fn open(path: &std::path::Path, rotation: Rotation) -> std::io::Result<Self> {
        let parent = path
            .parent()
            .ok_or_else(|| std::io::Error::other("a log path without a directory"))?;
        let name = path
            .file_name()
            .ok_or_else(|| std::io::Error::other("a log path without a name"))?
            .to_os_string();
        let dir = safefs::open_base(parent).map_err(io_err)?;
        let file =
            safefs::create_file(std::os::fd::AsFd::as_fd(&dir), &name, 0o600, Create::Append)
                .map_err(io_err)?;
        let size = file.metadata()?.len();
        Ok(RotatingLog {
            dir,
            name,
            path: path.to_path_buf(),
            rotation,
            file,
            size,
        })
    }

    /// The name of the `n`th older file (0: the current one).
    fn nth(&self, n: u32) -> std::ffi::OsString {
        let mut s = self.name.clone();
        if n > 0 {
            s.push(format!(".{n}"));
        }
        s
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        use std::os::fd::AsFd;
        let last = self.rotation.max_files.saturating_sub(1);
        let gone = if last == 0 {
            self.size
        } else {
            rustix::fs::statat(
                self.dir.as_fd(),
                self.nth(last).as_os_str(),
                rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_or(0, |st| u64::try_from(st.st_size).unwrap_or(0))
        };
        if gone > 0 {
            let total = dropped_bytes(&self.path) + gone;
            let mut dropped = self.name.clone();
            dropped.push(".dropped");
            let mut f = safefs::create_file(self.dir.as_fd(), &dropped, 0o600, Create::Truncate)
                .map_err(io_err)?;
            std::io::Write::write_all(&mut f, format!("{total}\n").as_bytes())?;
        }
        for n in (1..last).rev() {
            let _ = rustix::fs::renameat(
                self.dir.as_fd(),
                self.nth(n).as_os_str(),
                self.dir.as_fd(),
                self.nth(n + 1).as_os_str(),
            );
        }
        if last > 0 {
            rustix::fs::renameat(
                self.dir.as_fd(),
                self.nth(0).as_os_str(),
                self.dir.as_fd(),
                self.nth(1).as_os_str(),
            )?;
        }
        self.file = safefs::create_file(self.dir.as_fd(), &self.name, 0o600, Create::Truncate)
            .map_err(io_err)?;
        self.size = 0;
        Ok(())
    }
}

impl std::io::Write for RotatingLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.size >= self.rotation.max_bytes {
            self.rotate()?;
        }
        let room = (self.rotation.max_bytes - self.size).min(buf.len() as u64) as usize;
        let n = self.file.write(&buf[..room])?;
        self.size += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_rotated_log_keeps_its_cap_and_reads_as_one_stream() {
        let d = tempfile::tempdir().expect("tmp");
        let log = d.path().join("rank-0.log");
        let r = Rotation {
            max_bytes: 4096,
            max_files: 3,
        };
        let mut w = RotatingLog::open(&log, r).expect("open");
        for i in 0..5000u32 {
            writeln!(w, "line {i:08}").expect("write");
        }
        // 5000 lines of 14 bytes: 70,000 bytes written, 3 x 4 KiB kept.
        let total = 5000 * 14;
        assert!(bytes_on_disk(&log) <= r.cap(), "{}", bytes_on_disk(&log));
        let dropped = dropped_bytes(&log);
        assert_eq!(dropped + bytes_on_disk(&log), total);
        let (data, next, skipped) = read_rotated(&log, 0, u64::MAX).expect("read");
        assert_eq!(skipped, dropped);
        assert_eq!(next, total);
        let text = String::from_utf8(data).expect("utf8");
        assert!(
            text.ends_with("line 00004999\n"),
            "{}",
            &text[text.len() - 30..]
        );
        // Reading on from an offset in the kept part skips nothing.
        let (_, next2, skipped2) = read_rotated(&log, total - 14, u64::MAX).expect("read");
        assert_eq!((next2, skipped2), (total, 0));
    }
}
