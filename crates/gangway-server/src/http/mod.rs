//! The HTTP+JSON API (axum) with bearer-token auth: the router over one
//! module per resource, the shared pieces in [`common`] below them.
//!
//! Every handler authenticates before it reads a body (401 for a missing or
//! unknown token, 403 for a known one that may not do this), reads at most
//! `max_body_bytes`, and parses job specs on the blocking pool, so hostile
//! bodies never hold the async workers that serve heartbeats.

pub mod audit;
pub mod backup;
pub mod common;
pub mod dashboard;
pub mod errors;
pub mod history;
pub mod jobs;
pub mod listing;
pub mod node_list;
pub mod nodes;
pub mod openapi;
pub mod ops;
pub mod policy;
pub mod queues;
pub mod reservations;
pub mod workflow;

use crate::metrics::ApiLabels;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use common::*;
use std::sync::Arc;
use std::time::Instant;

/// Headers every answer carries: no sniffing, no framing, a strict content
/// security policy unless the handler set its own (the dashboard page).
async fn security_headers(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::X_FRAME_OPTIONS,
        header::HeaderValue::from_static("DENY"),
    );
    h.insert(
        header::REFERRER_POLICY,
        header::HeaderValue::from_static("no-referrer"),
    );
    if !h.contains_key(header::CONTENT_SECURITY_POLICY) {
        h.insert(
            header::CONTENT_SECURITY_POLICY,
            header::HeaderValue::from_static("default-src 'none'; frame-ancestors 'none'"),
        );
    }
    res
}

async fn track(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |m| m.as_str().to_string());
    let start = Instant::now();
    let res = next.run(req).await;
    app.metrics
        .api_requests
        .get_or_create(&ApiLabels {
            route,
            status: res.status().as_u16(),
        })
        .inc();
    app.metrics
        .api_seconds
        .observe(start.elapsed().as_secs_f64());
    res
}

/// On a follower, every API request goes to the leader; without a leader
/// the answer is 503 (clients retry).
async fn forward(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = req.uri().path().to_string();
    let role = app
        .role
        .read()
        .map(|r| r.clone())
        .unwrap_or(Role::Follower(None));
    let local =
        path == "/" || path == "/healthz" || path == "/v1/leader" || path == "/openapi.json";
    let leader = match role {
        Role::Leader => return next.run(req).await,
        _ if local => return next.run(req).await,
        Role::Follower(None) => {
            return ApiError(
                StatusCode::SERVICE_UNAVAILABLE,
                "no leader elected yet; retry".into(),
            )
            .into_response()
        }
        Role::Follower(Some(l)) => l,
    };
    let method = req.method().as_str().to_string();
    let target = format!(
        "{}{}",
        leader.trim_end_matches('/'),
        req.uri().path_and_query().map_or("/", |p| p.as_str())
    );
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .filter(|(k, _)| {
            matches!(
                k.as_str(),
                "authorization" | "content-type" | "idempotency-key" | "accept"
            )
        })
        .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect();
    let body = match axum::body::to_bytes(req.into_body(), app.cfg.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => {
            return ApiError(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("body: at most {} bytes", app.cfg.max_body_bytes),
            )
            .into_response()
        }
    };
    let answer = tokio::task::spawn_blocking(move || {
        let mut r = crate::http()
            .request(&method, &target)
            .timeout(std::time::Duration::from_secs(30));
        for (k, v) in &headers {
            r = r.set(k, v);
        }
        let resp = if body.is_empty() {
            r.call()
        } else {
            r.send_bytes(&body)
        };
        let resp = match resp {
            Ok(x) | Err(ureq::Error::Status(_, x)) => x,
            Err(e) => return Err(e.to_string()),
        };
        let status = resp.status();
        let ct = resp.content_type().to_string();
        let mut bytes = Vec::new();
        use std::io::Read;
        resp.into_reader()
            .take(256 << 20)
            .read_to_end(&mut bytes)
            .map_err(|e| e.to_string())?;
        Ok((status, ct, bytes))
    })
    .await;
    match answer {
        Ok(Ok((status, ct, bytes))) => (
            StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
            [(header::CONTENT_TYPE, ct)],
            bytes,
        )
            .into_response(),
        Ok(Err(e)) => ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the leader at {leader} did not answer ({e}); retry"),
        )
        .into_response(),
        Err(e) => ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The router.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/healthz", get(ops::healthz))
        .route("/v1/leader", get(ops::leader))
        .route("/openapi.json", get(openapi::openapi))
        .route("/metrics", get(ops::metrics))
        .route("/v1/jobs", post(jobs::submit).get(jobs::list_jobs))
        .route("/v1/jobs/{id}", get(jobs::get_job))
        .route("/v1/jobs/{id}/cancel", post(jobs::cancel_job))
        .route("/v1/queues", get(queues::queues))
        .route("/v1/usage", get(queues::usage))
        .route("/v1/nodes", get(nodes::nodes).post(nodes::register_node))
        .route("/v1/nodes/{name}/{action}", post(nodes::cordon))
        .route("/v1/agent/{name}/report", post(nodes::agent_report))
        .route("/v1/agent/{name}/sync", post(nodes::agent_sync))
        .route("/v1/jobs/{id}/logs", get(jobs::job_logs))
        .route(
            "/v1/nodes/{name}/gpus/{index}/{action}",
            post(nodes::gpu_health),
        )
        .route("/v1/audit", get(audit::audit_log))
        .route("/v1/jobs/{id}/hold", post(workflow::hold))
        .route("/v1/jobs/{id}/release", post(workflow::release))
        .route("/v1/jobs/{id}/update", post(workflow::update))
        .route("/v1/history", get(history::list))
        .route(
            "/v1/reservations",
            post(reservations::create).get(reservations::list),
        )
        .route(
            "/v1/reservations/{name}",
            axum::routing::delete(reservations::delete),
        )
        .merge(dashboard::routes())
        .merge(policy::routes())
        .merge(backup::routes())
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            audit::audit,
        ))
        .route_layer(axum::middleware::from_fn_with_state(app.clone(), track))
        .layer(axum::middleware::from_fn_with_state(app.clone(), forward))
        .layer(axum::middleware::from_fn(errors::json_errors))
        .layer(axum::middleware::from_fn(security_headers))
        .with_state(app)
}
