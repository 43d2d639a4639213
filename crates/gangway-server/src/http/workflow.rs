//! HTTP routes of the pending-job workflow: `POST /v1/jobs/{id}/hold`,
//! `/release` (an array's id: all of its pending tasks) and `/update` (owner
//! or admin; see `workflow.rs` for the rules).

use super::common::*;
use crate::workflow::{updated_spec, Hold, JobUpdate};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use gangway_core::JobId;
use serde_json::{json, Value};
use std::sync::Arc;

type ApiResult<T> = Result<T, ApiError>;

/// The owner of job `id` (404 when unknown); 403 unless `p` is it or an admin.
fn owned(c: &crate::control::Control<crate::SharedStore>, p: &Principal, id: u64) -> ApiResult<()> {
    let owner = c
        .jobs
        .get(&JobId(id))
        .map(|(r, _)| r.user.clone())
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("job {id} does not exist")))?;
    match p {
        Principal::Admin => Ok(()),
        Principal::User { name, .. } if *name == owner => Ok(()),
        _ => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!("job {id} belongs to {owner}"),
        )),
    }
}

/// `?task=true`: an array's id names only its first task, not the array.
#[derive(serde::Deserialize, utoipa::IntoParams, Default)]
#[into_params(parameter_in = Query)]
pub struct TaskQuery {
    /// Only this task when the id is an array's (Slurm's `5_0` against `5`).
    #[serde(default)]
    task: bool,
}

impl TaskQuery {
    /// What the id names.
    pub fn scope(&self) -> crate::workflow::Scope {
        if self.task {
            crate::workflow::Scope::Task
        } else {
            crate::workflow::Scope::Array
        }
    }
}

/// `POST /v1/jobs/{id}/hold`: the owner's hold (`JobHeldUser`), or an
/// admin's (`JobHeldAdmin`), which only an admin can release.
#[utoipa::path(
    post, path = "/v1/jobs/{id}/hold", tag = "jobs",
    summary = "Hold a pending job, or every pending task of an array by its id (owner: JobHeldUser; admin: JobHeldAdmin)",
    params(("id" = u64, Path, description = "Job id"), TaskQuery),
    responses(
        (status = 200, description = "Held: {id, held, reason_code, jobs}", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | CONFLICT | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn hold(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<u64>,
    Query(t): Query<TaskQuery>,
) -> ApiResult<Json<Value>> {
    let p = authenticate_person(&app, &headers)?;
    let mut c = lock(&app)?;
    owned(&c, &p, id)?;
    let kind = if p.is_admin() {
        Hold::Admin
    } else {
        Hold::User
    };
    // An array's id holds every pending task.
    let n = c.hold_in(JobId(id), t.scope(), kind, &p.name(), now())?;
    let code = kind.code();
    drop(c);
    app.wake.notify_one();
    Ok(Json(
        json!({ "id": id, "held": kind, "reason_code": code, "jobs": n }),
    ))
}

/// `POST /v1/jobs/{id}/release`.
#[utoipa::path(
    post, path = "/v1/jobs/{id}/release", tag = "jobs",
    summary = "Release a held job or array (an admin hold by an admin only)",
    params(("id" = u64, Path, description = "Job id"), TaskQuery),
    responses(
        (status = 200, description = "Released: {id, released, jobs}", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | CONFLICT | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn release(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<u64>,
    Query(t): Query<TaskQuery>,
) -> ApiResult<Json<Value>> {
    let p = authenticate_person(&app, &headers)?;
    let mut c = lock(&app)?;
    owned(&c, &p, id)?;
    let n = c.release_in(JobId(id), t.scope(), p.is_admin(), &p.name(), now())?;
    drop(c);
    app.wake.notify_one();
    Ok(Json(json!({ "id": id, "released": true, "jobs": n })))
}

/// `POST /v1/jobs/{id}/update` with a JSON body of
/// `{priority?, time_limit?, queue?, name?}`.
#[utoipa::path(
    post, path = "/v1/jobs/{id}/update", tag = "jobs",
    summary = "Change a pending job: priority (within the queue), time limit (users: only down), queue, name",
    params(("id" = u64, Path, description = "Job id")),
    request_body(content = Object, content_type = "application/json", description = "{priority?, time_limit?, queue?, name?}"),
    responses(
        (status = 200, description = "The updated job", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | CONFLICT | TOO_LARGE | UNSATISFIABLE | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn update(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<u64>,
    body: axum::body::Body,
) -> ApiResult<Json<Value>> {
    let p = authenticate_person(&app, &headers)?;
    let body = read_body(&app, body).await?;
    let u: JobUpdate = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("update: {e}")))?;
    let mut c = lock(&app)?;
    owned(&c, &p, id)?;
    let (rec, _) = c
        .jobs
        .get(&JobId(id))
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("job {id} does not exist")))?;
    if rec.state != gangway_core::JobState::Pending || !rec.placement.is_empty() {
        // The state first: an update of a running job is refused as such.
        return Err(crate::control::ControlError::from(
            crate::workflow::WorkflowError::NotPending(
                JobId(id),
                crate::workflow::state_name(rec.state),
                "updated",
            ),
        )
        .into());
    }
    let (spec, what) = updated_spec(&app.cfg, &p, rec, &u)?;
    c.update(JobId(id), spec, &p.name(), &what, now())?;
    drop(c);
    app.wake.notify_one();
    Ok(Json(json!({ "id": id, "updated": what })))
}
