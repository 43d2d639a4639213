//! The online backup route: an admin takes a consistent backup of the store
//! while the server runs (see [`crate::backup`]).

use super::common::*;
use crate::backup::*;
use crate::control::ControlError;

/// `POST /v1/admin/backup` (admin): the whole store, read under the state
/// lock so no write of this server lands halfway.
pub fn routes() -> axum::Router<std::sync::Arc<crate::http::common::App>> {
    axum::Router::new().route("/v1/admin/backup", axum::routing::post(online))
}

#[utoipa::path(
    post, path = "/v1/admin/backup", tag = "admin",
    summary = "A backup of the whole store at one revision (admin)",
    responses(
        (status = 200, description = "The backup document", body = Object),
        Errors<{ UNAUTHENTICATED | FORBIDDEN | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn online(
    axum::extract::State(app): axum::extract::State<std::sync::Arc<crate::http::common::App>>,
    headers: axum::http::HeaderMap,
) -> Result<axum::Json<Backup>, crate::http::common::ApiError> {
    crate::http::common::authenticate_admin(&app, &headers, "take backups")?;
    let now = crate::clock::now();
    let app2 = app.clone();
    tokio::task::spawn_blocking(move || {
        let c = crate::http::common::lock(&app2)?;
        take(&c.store, now)
            .map(axum::Json)
            .map_err(|e| crate::http::common::ApiError::from(ControlError::from(e)))
    })
    .await
    .map_err(|e| {
        crate::http::common::ApiError::new(
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            e.to_string(),
        )
    })?
}
