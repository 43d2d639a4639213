//! The audit log: the middleware that records every change and the
//! route that reads it.

use super::common::*;
use crate::audit::{AuditEntry, AuditTarget};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;
use serde::Deserialize;
use std::sync::Arc;

/// Which audit entries to read.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AuditQuery {
    /// Only entries at or after this time (seconds since the epoch).
    since: Option<u64>,
    /// At most this many, the latest (default 1000).
    limit: Option<usize>,
}

#[utoipa::path(
    get, path = "/v1/audit", tag = "operations",
    summary = "The audit log: every state-changing call with who, what, target and result (admin)",
    params(AuditQuery),
    responses(
        (status = 200, description = "Entries, oldest first", body = Vec<AuditEntry>),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn audit_log(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Query(q): Query<AuditQuery>,
) -> ApiResult<Json<Vec<AuditEntry>>> {
    authenticate_admin(&app, &headers, "read the audit log")?;
    let app2 = app.clone();
    let (since, limit) = (q.since.unwrap_or(0), q.limit.unwrap_or(1000).min(100_000));
    let entries = tokio::task::spawn_blocking(move || app2.audit.read(since, limit))
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("audit log: {e}")))?;
    Ok(Json(entries))
}

/// Records every state-changing call (not agents' heartbeats) in the audit log.
pub async fn audit(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let heartbeat = path.starts_with("/v1/agent/") && path.ends_with("/sync");
    if method == axum::http::Method::GET || method == axum::http::Method::HEAD || heartbeat {
        return next.run(req).await;
    }
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| path.clone(), |m| m.as_str().to_string());
    let who = match bearer(req.headers()) {
        Err(_) => "no token".to_string(),
        Ok(_) => identify(&app, req.headers()).map_or_else(|| "unknown token".into(), |p| p.name()),
    };
    let res = next.run(req).await;
    let target = res
        .extensions()
        .get::<AuditTarget>()
        .map(|t| t.0.clone())
        .or_else(|| target_of(&path));
    let status = res.status().as_u16();
    app.audit.record(AuditEntry {
        at: now(),
        who,
        action: format!("{method} {route}"),
        target,
        status,
        result: match status {
            200..=399 => "ok",
            400..=499 => "refused",
            _ => "error",
        }
        .into(),
    });
    res
}

/// The job or node a path names (`/v1/jobs/7/cancel` → `job 7`).
fn target_of(path: &str) -> Option<String> {
    let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    match parts.as_slice() {
        ["v1", "jobs", id, ..] => Some(format!("job {id}")),
        ["v1", "nodes", name, ..] | ["v1", "agent", name, ..] => Some(format!(
            "node {}",
            name.chars().take(253).collect::<String>()
        )),
        _ => None,
    }
}
