//! The OpenAPI document served at `/openapi.json` (and printed by
//! `gangway openapi`), generated with `utoipa` from the handlers'
//! `#[utoipa::path]` annotations and the API types' `ToSchema` derives, so
//! it follows the code. A new route is added to [`ApiDoc`]'s `paths(...)`;
//! the completeness test (crates/gangway-server/tests/openapi.rs) names any
//! route of the router the document lacks.

use serde::Serialize;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::OpenApi;

/// Every error answer: `{"error": "..."}`, the message naming the field or rule.
#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: String,
}

/// The answer to an accepted submission.
#[derive(Serialize, utoipa::ToSchema)]
pub struct Submitted {
    /// The new job's id.
    pub id: u64,
    /// Always `pending`.
    pub state: String,
}

/// The answer to a cancellation.
#[derive(Serialize, utoipa::ToSchema)]
pub struct Cancelled {
    /// The job.
    pub id: u64,
    /// Always `cancelled`.
    pub state: String,
}

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
        crate::api::healthz,
        crate::api::leader,
        crate::api::openapi,
        crate::api::metrics,
        crate::api::submit,
        crate::api::list_jobs,
        crate::api::get_job,
        crate::api::cancel_job,
        crate::api::job_logs,
        crate::api::queues,
        crate::api::usage,
        crate::api::nodes,
        crate::api::register_node,
        crate::api::cordon,
        crate::api::gpu_health,
        crate::api::agent_report,
        crate::api::agent_sync,
        crate::api::audit_log,
        crate::dashboard::page,
        crate::dashboard::whoami,
        crate::dashboard::cluster,
        crate::dashboard::queue_history,
    ),
    components(schemas(ErrorBody, Submitted, Cancelled, gangway_core::ReasonCode)),
    modifiers(&Bearer)
)]
pub struct ApiDoc;

/// The document as JSON.
pub fn document() -> serde_json::Value {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    serde_json::to_value(&doc).unwrap_or_default()
}
