//! The agent's small HTTP server: rank logs for the server to relay.

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
    let mut f = std::fs::File::open(&path).map_err(|_| {
        (
            StatusCode::NOT_FOUND,
            format!("no log for job {job} attempt {attempt} rank {rank}"),
        )
    })?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = offset.min(len);
    let mut buf = Vec::new();
    f.seek(SeekFrom::Start(start))
        .and_then(|_| f.take(MAX_CHUNK).read_to_end(&mut buf))
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok(Json(LogChunk {
        data: String::from_utf8_lossy(&buf).into_owned(),
        next_offset: start + buf.len() as u64,
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
