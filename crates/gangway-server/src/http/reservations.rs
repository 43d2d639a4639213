//! The HTTP half of [`crate::reservations`]: `POST /v1/reservations`
//! (admin), `GET /v1/reservations` (any person) and
//! `DELETE /v1/reservations/{name}` (admin).

use super::common::*;
use crate::reservations::{
    check_name, CreateReservation, MaintenanceReservation, ReservationError,
};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::Arc;

impl From<ReservationError> for ApiError {
    fn from(e: ReservationError) -> Self {
        let code = match e {
            ReservationError::Malformed(_) => StatusCode::BAD_REQUEST,
            ReservationError::NoSuchNode(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ReservationError::Exists(_) => StatusCode::CONFLICT,
            ReservationError::TooMany(_) => StatusCode::TOO_MANY_REQUESTS,
            ReservationError::Control(c) => return ApiError::from(c),
        };
        ApiError::new(code, e.to_string())
    }
}

/// `POST /v1/reservations` (admins).
#[utoipa::path(
    post, path = "/v1/reservations", tag = "reservations", operation_id = "create_reservation",
    summary = "Create a maintenance reservation: its nodes take no job that would run into the window (admin)",
    request_body(content = Object, content_type = "application/json", description = "{name, nodes, start, duration_seconds}"),
    responses(
        (status = 201, description = "{name, nodes, start, end, created_by}", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | CONFLICT | TOO_LARGE | UNSATISFIABLE | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn create(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let p = authenticate_admin(&app, &headers, "create reservations")?;
    let body = crate::http::common::read_body(&app, body).await?;
    let req: CreateReservation = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, format!("reservation: {e}")))?;
    let r = lock(&app)?.create_reservation(req, &p.name(), now())?;
    app.wake.notify_one();
    let mut res = (StatusCode::CREATED, Json(r.clone())).into_response();
    res.extensions_mut()
        .insert(crate::audit::AuditTarget(format!("reservation {}", r.name)));
    Ok(res)
}

/// `GET /v1/reservations` (any person).
#[utoipa::path(
    get, path = "/v1/reservations", tag = "reservations", operation_id = "list_reservations",
    summary = "Maintenance reservations",
    responses(
        (status = 200, description = "Every reservation", body = Object),
        Errors<{ UNAUTHENTICATED | FORBIDDEN | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn list(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> Result<Json<Vec<MaintenanceReservation>>, ApiError> {
    authenticate_person(&app, &headers)?;
    // The read view's (shared) map: no state lock.
    let view = app.control.view();
    Ok(Json(view.reservations.values().cloned().collect()))
}

/// `DELETE /v1/reservations/{name}` (admins).
#[utoipa::path(
    delete, path = "/v1/reservations/{name}", tag = "reservations", operation_id = "delete_reservation",
    summary = "Delete a maintenance reservation (admin)",
    params(("name" = String, Path, description = "Reservation name")),
    responses(
        (status = 200, description = "Deleted", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn delete(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    authenticate_admin(&app, &headers, "delete reservations")?;
    check_name(&name)?;
    if !lock(&app)?.delete_reservation(&name, now())? {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no reservation named {name}"),
        ));
    }
    app.wake.notify_one();
    let mut res = Json(serde_json::json!({ "name": name, "deleted": true })).into_response();
    res.extensions_mut()
        .insert(crate::audit::AuditTarget(format!("reservation {name}")));
    Ok(res)
}
