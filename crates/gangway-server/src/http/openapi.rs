//! The OpenAPI document served at `/openapi.json` (and printed by
//! `gangway openapi`), generated with `utoipa` from the handlers'
//! `#[utoipa::path]` annotations and the API types' `ToSchema` derives, so
//! it follows the code. A new route is added to [`ApiDoc`]'s `paths(...)`;
//! the completeness test (crates/gangway-server/tests/openapi.rs) names any
//! route of the router the document lacks.

use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::OpenApi;

/// Adds the bearer-token scheme the operations name.
struct Bearer;

impl utoipa::Modify for Bearer {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let c = doc.components.get_or_insert_with(Default::default);
        c.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "A token from the server configuration: admin, a user's, the agents' join token, a node's own token or the metrics token",
                    ))
                    .build(),
            ),
        );
    }
}

/// The document's paths and schemas.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Gangway",
        description = "A GPU cluster scheduler for gangs of ranks. Every error answers JSON `{\"error\": \"...\"}`."
    ),
    paths(
        crate::http::workflow::hold,
        crate::http::workflow::release,
        crate::http::workflow::update,
        crate::http::history::list,
        crate::http::reservations::create,
        crate::http::reservations::list,
        crate::http::reservations::delete,
        crate::http::policy::show_current,
        crate::http::policy::show_version,
        crate::http::policy::diff,
        crate::http::policy::log,
        crate::http::policy::what_if,
        crate::http::policy::apply,
        crate::http::policy::rollback,
        crate::http::policy::promote,
        crate::http::policy::pilot_status,
        crate::http::backup::online,
        crate::http::ops::healthz,
        crate::http::ops::leader,
        crate::http::openapi::openapi,
        crate::http::ops::metrics,
        crate::http::jobs::submit,
        crate::http::jobs::list_jobs,
        crate::http::jobs::get_job,
        crate::http::jobs::cancel_job,
        crate::http::jobs::job_logs,
        crate::http::queues::queues,
        crate::http::queues::usage,
        crate::http::nodes::nodes,
        crate::http::nodes::register_node,
        crate::http::nodes::cordon,
        crate::http::nodes::gpu_health,
        crate::http::nodes::agent_report,
        crate::http::nodes::agent_sync,
        crate::http::audit::audit_log,
        crate::http::dashboard::page,
        crate::http::dashboard::whoami,
        crate::http::dashboard::cluster,
        crate::http::dashboard::queue_history,
    ),
    components(schemas(super::common::ErrorBody, super::jobs::Submitted, super::jobs::Cancelled, gangway_core::ReasonCode)),
    modifiers(&Bearer)
)]
pub struct ApiDoc;

/// The document as JSON.
pub fn document() -> serde_json::Value {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    serde_json::to_value(&doc).unwrap_or_default()
}

#[utoipa::path(
    get, path = "/openapi.json", tag = "operations",
    summary = "This document",
    responses((status = 200, description = "OpenAPI document", body = Object))
)]
pub async fn openapi() -> Json<serde_json::Value> {
    Json(crate::http::openapi::document())
}
