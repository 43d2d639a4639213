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

/// One GPU of a node in `GET /v1/nodes`.
#[derive(Serialize, utoipa::ToSchema)]
pub struct GpuView {
    /// Device index.
    pub index: u32,
    /// Model.
    pub model: String,
    /// Memory in whole GiB, rounded down.
    pub memory_gib: u32,
    /// Memory in MiB as the driver reports it (declared GPUs: GiB x 1024).
    pub memory_mib: u64,
    /// MIG enabled: never assigned whole.
    pub mig: bool,
    /// Why it is unhealthy.
    pub reason: Option<String>,
    /// UUID, when discovered.
    pub uuid: Option<String>,
    /// Healthy.
    pub healthy: bool,
    /// Bound to a job.
    pub allocated: bool,
}

/// One node in `GET /v1/nodes`.
#[derive(Serialize, utoipa::ToSchema)]
pub struct NodeView {
    /// Node name.
    pub name: String,
    /// Leaf switch / rack.
    pub leaf: String,
    /// Address other nodes reach it at.
    pub address: String,
    /// Takes no new work.
    pub cordoned: bool,
    /// Why it was cordoned (automatic cordons say so).
    pub cordon_reason: Option<String>,
    /// Heard from recently.
    pub ready: bool,
    /// Last heartbeat, seconds since the epoch.
    pub last_heartbeat: Option<u64>,
    /// Its GPUs.
    pub gpus: Vec<GpuView>,
    /// Jobs with ranks on it.
    pub jobs: Vec<u64>,
    /// Joined with the join token, waiting for an admin's approval.
    pub pending_approval: bool,
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

/// `GET /v1/whoami`.
#[derive(Serialize, utoipa::ToSchema)]
pub struct WhoAmI {
    /// The token's principal (user name, `admin`...).
    pub name: String,
    /// Whether it is the admin token.
    pub admin: bool,
}

/// `GET /v1/leader`.
#[derive(Serialize, utoipa::ToSchema)]
pub struct LeaderView {
    /// Whether this replica leads.
    pub leader: bool,
    /// Where a follower forwards to (absent on the leader).
    pub leader_url: Option<String>,
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
        crate::workflow_api::hold,
        crate::workflow_api::release,
        crate::workflow_api::update,
        crate::history_api::list,
        crate::reservations_api::create,
        crate::reservations_api::list,
        crate::reservations_api::delete,
        crate::policy::api::show_current,
        crate::policy::api::show_version,
        crate::policy::api::diff,
        crate::policy::api::log,
        crate::policy::api::what_if,
        crate::policy::api::apply,
        crate::policy::api::rollback,
        crate::policy::api::promote,
        crate::policy::api::pilot_status,
        crate::backup::online,
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
