//! Queues and GPU-hour usage.

use super::common::*;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::Arc;

#[utoipa::path(
    get, path = "/v1/queues", tag = "queues",
    summary = "Queues with quota, weight, allowed priorities and current usage",
    responses(
        (status = 200, description = "Every queue", body = Vec<crate::http::queues::QueueView>),
        Errors<{ UNAUTHENTICATED | FORBIDDEN | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn queues(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> ApiResult<Json<serde_json::Value>> {
    authenticate_person(&app, &headers)?;
    // The read view's snapshot: no state lock.
    let v = app.control.view();
    let out: Vec<_> = v
        .cluster
        .queues
        .iter()
        .map(|q| {
            json!({
                "name": q.spec.name,
                "parent": q.spec.parent,
                "weight": q.spec.weight,
                "quota": q.spec.quota,
                "allowed_priorities": q.spec.allowed_priorities,
                "allow_non_preemptible": q.spec.allow_non_preemptible,
                "usage": q.usage,
            })
        })
        .collect();
    Ok(Json(json!(out)))
}

/// Range of the usage report (seconds since the epoch).
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct UsageRange {
    from: Option<u64>,
    to: Option<u64>,
}

#[utoipa::path(
    get, path = "/v1/usage", tag = "queues",
    summary = "GPU-hours per queue and per user over a time range",
    params(UsageRange),
    responses(
        (status = 200, description = "GPU-hours by queue and by user", body = crate::http::queues::UsageView),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn usage(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Query(r): Query<UsageRange>,
) -> ApiResult<Json<serde_json::Value>> {
    authenticate_person(&app, &headers)?;
    let t = now();
    let (from, to) = (r.from.unwrap_or(0), r.to.unwrap_or(t));
    if from > to {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "from: must not be after to".into(),
        ));
    }
    // The read view's jobs: no state lock.
    let view = app.control.view();
    let (q, u) = blocking(move || Ok(crate::history::usage(&view.jobs, from, to, t))).await?;
    Ok(Json(
        json!({ "from": from, "to": to, "gpu_hours_by_queue": q, "gpu_hours_by_user": u }),
    ))
}

/// One queue in `GET /v1/queues` (the handler builds it as JSON; the
/// contract test checks the served keys against this schema).
#[derive(Serialize, utoipa::ToSchema)]
pub struct QueueView {
    /// Queue name.
    pub name: String,
    /// Parent queue (cohort), if any.
    pub parent: Option<String>,
    /// Fair-share weight.
    pub weight: u32,
    /// Nominal quota, borrowing and lending limits.
    #[schema(value_type = Object)]
    pub quota: serde_json::Value,
    /// Priority classes plain users may use here (empty: all but critical).
    pub allowed_priorities: Vec<gangway_core::PriorityClass>,
    /// Whether plain users may submit non-preemptible jobs here.
    pub allow_non_preemptible: bool,
    /// Resources its running jobs use now (gpus, cpu_millis, memory_mib).
    #[schema(value_type = Object)]
    pub usage: serde_json::Value,
}

/// `GET /v1/usage`: GPU-hours over a range.
#[derive(Serialize, utoipa::ToSchema)]
pub struct UsageView {
    /// Start, seconds since the epoch.
    pub from: u64,
    /// End, seconds since the epoch.
    pub to: u64,
    /// GPU-hours per queue.
    pub gpu_hours_by_queue: std::collections::BTreeMap<String, f64>,
    /// GPU-hours per user.
    pub gpu_hours_by_user: std::collections::BTreeMap<String, f64>,
}
