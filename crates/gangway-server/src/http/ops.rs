//! Operations: liveness, the leader, and the metrics scrape.

use super::common::*;
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::json;
use std::sync::Arc;

#[utoipa::path(
    get, path = "/metrics", tag = "operations",
    summary = "Prometheus metrics (admin or metrics token)",
    description = "Prometheus text format 0.0.4 by default; OpenMetrics 1.0.0 when the Accept header prefers `application/openmetrics-text`.",
    params(("Accept" = Option<String>, Header, description = "Content negotiation")),
    responses(
        (status = 200, description = "The metrics", content(
            (String = "text/plain; version=0.0.4"),
            (String = "application/openmetrics-text; version=1.0.0"))),
        Errors<{ UNAUTHENTICATED | FORBIDDEN | RATE_LIMITED | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn metrics(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult<Response> {
    let p = authenticate(&app, &headers)?;
    if !matches!(p, Principal::Admin | Principal::Metrics) {
        return Err(forbidden("only the admin and metrics tokens read /metrics"));
    }
    // From the read view (job counts and GPU totals): no state lock, no
    // walk of the jobs.
    let format = crate::metrics::Format::negotiate(
        headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()),
    );
    let text = render(&app, format);
    Ok(([(header::CONTENT_TYPE, format.content_type())], text).into_response())
}

#[utoipa::path(
    get, path = "/healthz", tag = "operations",
    summary = "Liveness",
    responses((status = 200, description = "ok", body = String, content_type = "text/plain"))
)]
pub async fn healthz() -> &'static str {
    "ok"
}

#[utoipa::path(
    get, path = "/v1/leader", tag = "operations",
    summary = "Whether this replica leads, and whom it forwards to",
    responses((status = 200, description = "leader, and leader_url on a follower", body = crate::http::ops::LeaderView))
)]
pub async fn leader(State(app): State<Arc<App>>) -> Json<serde_json::Value> {
    let role = app
        .role
        .read()
        .map(|r| r.clone())
        .unwrap_or(Role::Follower(None));
    Json(match role {
        Role::Leader => json!({ "leader": true }),
        Role::Follower(l) => json!({ "leader": false, "leader_url": l }),
    })
}

/// `GET /v1/leader`.
#[derive(Serialize, utoipa::ToSchema)]
pub struct LeaderView {
    /// Whether this replica leads.
    pub leader: bool,
    /// Where a follower forwards to (absent on the leader).
    pub leader_url: Option<String>,
}

/// The server's metrics and the policy watch's figures, as one exposition (one `# EOF` in
/// OpenMetrics), in the format the scrape asked for. The job and GPU gauges
/// are set from the read view first: no state lock.
pub fn render(app: &App, format: crate::metrics::Format) -> String {
    app.metrics
        .publish(crate::metrics::Snapshot::of_view(&app.control.view()));
    app.metrics.publish_lock(&app.control.lock_use());
    let om = format!("{}{}", app.watch.render(), app.metrics.render());
    match format {
        crate::metrics::Format::OpenMetrics => om,
        crate::metrics::Format::Text => crate::metrics::openmetrics_to_text(&om),
    }
}
