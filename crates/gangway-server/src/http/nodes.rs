//! Nodes and agents: the node list, registration, cordon and drain, GPU
//! health, and the agents' reports and syncs.

use super::common::*;
use crate::audit::AuditTarget;
use crate::control::SyncAnswer;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use gangway_core::agent::{SyncRequest, SyncResponse};
use gangway_core::{JobId, NodeSpec};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::Arc;

#[utoipa::path(
    get, path = "/v1/nodes", tag = "nodes",
    summary = "Nodes, their GPUs (allocated, healthy), readiness and jobs",
    responses(
        (status = 200, description = "Every node, registered or waiting for approval", body = Vec<crate::http::nodes::NodeView>),
        Errors<{ UNAUTHENTICATED | FORBIDDEN | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn nodes(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> ApiResult<Json<crate::http::node_list::NodeList>> {
    authenticate_person(&app, &headers)?;
    // The read view's snapshot, serialized as it is: no state lock, no
    // `serde_json::Value` tree.
    Ok(Json(crate::http::node_list::NodeList(app.control.view())))
}

#[utoipa::path(
    post, path = "/v1/nodes", tag = "nodes",
    summary = "Register a node",
    description = "The join token registers new names only (they wait for approval unless node_approval is auto) and gets the node token once (201); a node's own token re-registers it (200, no token). The agent states its version in the gangway-agent-version header (none: 0.1); an agent more than one minor version from the server's, or of another major, is refused (409, naming both), and the answer's server_version lets the agent check the same.",
    request_body(content = NodeSpec, content_type = "application/json"),
    responses(
        (status = 200, description = "Re-registered", body = Object),
        (status = 201, description = "Registered: node_token and log_token", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | CONFLICT | TOO_LARGE | UNSATISFIABLE | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn register_node(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> ApiResult<Response> {
    use crate::nodes::Registrant;
    let p = authenticate(&app, &headers)?;
    let by = match &p {
        Principal::Admin => Registrant::Admin,
        Principal::Agent => Registrant::Join,
        Principal::Node(n) => Registrant::Node(n.clone()),
        _ => {
            return Err(forbidden(
                "only the join token, a node's own token and admins register nodes",
            ))
        }
    };
    check_agent_version(headers.get(gangway_core::agent::VERSION_HEADER))?;
    let body = read_body(&app, body).await?;
    let spec: NodeSpec = serde_json::from_slice(&body)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("node: {e}")))?;
    let name = spec.name.clone();
    let auto = app.cfg.node_approval == crate::config::NodeApproval::Auto;
    let r = lock(&app)?.register_node(spec, &by, auto, &app.cfg.agent_token, now())?;
    app.wake.notify_one();
    let code = if r.token.is_some() {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let mut body = json!({ "node": name, "log_token": r.log_token, "pending_approval": r.pending, "server_version": gangway_core::agent::VERSION });
    if let Some(t) = r.token {
        body["node_token"] = json!(t);
    }
    let mut res = (code, Json(body)).into_response();
    res.extensions_mut()
        .insert(AuditTarget(format!("node {name}")));
    Ok(res)
}

/// An agent's report.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReportBody {
    job: u64,
    /// The attempt the report is about (the current one when absent).
    #[serde(default)]
    attempt: Option<u32>,
    /// `running` or `exited`.
    state: String,
    #[serde(default)]
    exit_code: Option<i32>,
}

/// Checks that the caller may act for `node`: its own node token, or the
/// admin token (401 for unknown tokens, 403 for any other known one).
fn node_auth(app: &App, headers: &HeaderMap, node: &str) -> ApiResult<()> {
    match authenticate(app, headers)? {
        Principal::Admin => Ok(()),
        Principal::Node(n) if n == node => Ok(()),
        _ => Err(forbidden(format!(
            "this token may not report for node {node}"
        ))),
    }
}

#[utoipa::path(
    post, path = "/v1/agent/{name}/report", tag = "agent",
    summary = "An agent reports a job on its node (node token)",
    params(("name" = String, Path, description = "Node name")),
    request_body(content = ReportBody, content_type = "application/json", description = "`state` is running, failing or exited; `exit_code` is required with failing and exited"),
    responses(
        (status = 200, description = "The job's state after the report", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | CONFLICT | TOO_LARGE | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn agent_report(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: axum::body::Body,
) -> ApiResult<Json<serde_json::Value>> {
    node_auth(&app, &headers, &node)?;
    let body = read_body(&app, body).await?;
    let r: ReportBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("report: {e}")))?;
    let report = match (r.state.as_str(), r.exit_code) {
        ("running", _) => crate::control::Report::Running,
        ("exited", Some(code)) => crate::control::Report::Exited(code),
        ("failing", Some(code)) => crate::control::Report::Failing(code),
        (s @ ("exited" | "failing"), None) => {
            return Err(ApiError(
                StatusCode::BAD_REQUEST,
                format!("exit_code: required when state is {s}"),
            ))
        }
        (other, _) => {
            return Err(ApiError(
                StatusCode::BAD_REQUEST,
                format!("state: expected running, failing or exited, got {other:?}"),
            ))
        }
    };
    let (job, attempt) = (JobId(r.job), r.attempt);
    let state = with_control(&app, move |c| {
        Ok(c.report(&node, job, attempt, report, now())?)
    })
    .await?;
    app.wake.notify_one();
    Ok(Json(json!({ "job": r.job, "state": state })))
}

#[utoipa::path(
    post, path = "/v1/agent/{name}/sync", tag = "agent",
    summary = "An agent's heartbeat: GPU health and task states in, the node's assignments out (node token)",
    params(("name" = String, Path, description = "Node name")),
    request_body(content = SyncRequest, content_type = "application/json"),
    responses(
        (status = 200, description = "The node's desired assignments and checkpoint cleanups", body = SyncResponse),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | CONFLICT | TOO_LARGE | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn agent_sync(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: axum::body::Body,
) -> ApiResult<Json<SyncResponse>> {
    node_auth(&app, &headers, &node)?;
    // An agent left running while servers were upgraded past the skew policy.
    check_agent_version(headers.get(gangway_core::agent::VERSION_HEADER))?;
    let body = read_body(&app, body).await?;
    let req: SyncRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("sync: {e}")))?;
    let (answer, changed, blamed, halted, probation) = with_control(&app, move |c| {
        if c.pending_heartbeat(&node, now()) {
            // Waiting for approval: alive, nothing to run.
            let halted = c.nodes.blame.halted();
            return Ok((
                SyncAnswer::idle(&node),
                false,
                Vec::new(),
                halted,
                Vec::new(),
            ));
        }
        let (answer, changed) = c.sync(&node, &req, now())?;
        Ok((
            answer,
            changed,
            c.nodes.take_blame_log(),
            c.nodes.blame.halted(),
            c.nodes.probation.take_log(),
        ))
    })
    .await?;
    record_blame(&app, blamed, halted);
    record_probation(&app, probation);
    // Built here, not under the state lock.
    let mut out = answer.into_response();
    crate::admission::stamp(&app.cfg, &mut out.assignments);
    if changed {
        app.wake.notify_one();
    }
    Ok(Json(out))
}

#[utoipa::path(
    post, path = "/v1/nodes/{name}/gpus/{index}/{action}", tag = "nodes",
    summary = "Mark a GPU healthy (`healthy`, `clear`) or `unhealthy` (admin)",
    params(("name" = String, Path, description = "Node name"), ("index" = u32, Path, description = "GPU index"),
           ("action" = String, Path, description = "healthy, clear or unhealthy")),
    responses(
        (status = 200, description = "The GPU's health now", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn gpu_health(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path((name, index, action)): Path<(String, u32, String)>,
) -> ApiResult<Json<serde_json::Value>> {
    authenticate_admin(&app, &headers, "change GPU health")?;
    let healthy = match action.as_str() {
        "healthy" | "clear" => true,
        "unhealthy" => false,
        other => {
            return Err(ApiError(
                StatusCode::NOT_FOUND,
                format!("unknown GPU action {other:?} (healthy, clear or unhealthy)"),
            ))
        }
    };
    lock(&app)?.set_gpu_health(&name, index, healthy)?;
    app.wake.notify_one();
    Ok(Json(
        json!({ "node": name, "gpu": index, "healthy": healthy }),
    ))
}

#[utoipa::path(
    post, path = "/v1/nodes/{name}/{action}", tag = "nodes",
    summary = "approve, cordon, drain, uncordon or delete a node (admin)",
    params(("name" = String, Path, description = "Node name"),
           ("action" = String, Path, description = "approve, cordon, drain, uncordon or delete")),
    responses(
        (status = 200, description = "What changed", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | CONFLICT | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn cordon(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path((name, action)): Path<(String, String)>,
) -> ApiResult<Json<serde_json::Value>> {
    authenticate_admin(&app, &headers, "approve, cordon, drain or delete nodes")?;
    let out = match action.as_str() {
        "cordon" | "drain" | "uncordon" => {
            let on = action != "uncordon";
            lock(&app)?.cordon(&name, on)?;
            json!({ "node": name, "cordoned": on })
        }
        "approve" => {
            lock(&app)?.approve_node(&name, now())?;
            json!({ "node": name, "approved": true })
        }
        "delete" => {
            lock(&app)?.delete_node(&name, now())?;
            json!({ "node": name, "deleted": true })
        }
        other => {
            return Err(ApiError(
                StatusCode::NOT_FOUND,
                format!(
                    "unknown node action {:?} (approve, cordon, drain, uncordon or delete)",
                    other.chars().take(64).collect::<String>()
                ),
            ))
        }
    };
    app.wake.notify_one();
    Ok(Json(out))
}

/// The registering agent's version, from its
/// [`gangway_core::agent::VERSION_HEADER`] header (an agent that states
/// none predates it: 0.1), refused when the version-skew policy does not let
/// it work with this server (400 for a malformed version, 409 for one too
/// far apart, naming both versions).
pub fn check_agent_version(
    header: Option<&axum::http::HeaderValue>,
) -> Result<gangway_core::agent::Version, crate::http::common::ApiError> {
    use axum::http::StatusCode;
    use gangway_core::agent::{check_skew, Version, UNSTATED_VERSION, VERSION_HEADER};
    let agent = match header {
        None => UNSTATED_VERSION,
        Some(h) => h
            .to_str()
            .map_err(|_| gangway_core::agent::SkewError::Malformed("(not text)".into()))
            .and_then(str::parse::<Version>)
            .map_err(|e| {
                crate::http::common::ApiError::new(
                    StatusCode::BAD_REQUEST,
                    format!("{VERSION_HEADER}: {e}"),
                )
            })?,
    };
    check_skew(Version::current(), agent)
        .map_err(|e| crate::http::common::ApiError::new(StatusCode::CONFLICT, e.to_string()))?;
    Ok(agent)
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

/// Node blame's decisions go to the audit log (with their evidence) and
/// the metrics (`gangway_node_auto_cordons_total`, `gangway_auto_cordon_halted`).
/// Probation's outcomes go to the audit log and the metrics
/// (`gangway_probations_total{result}`).
fn record_probation(app: &App, outcomes: Vec<crate::probation::Outcome>) {
    use crate::probation::Outcome;
    for o in outcomes {
        let (result, action, node) = match o {
            Outcome::Passed { node, last_line } => (
                "passed",
                format!("returned to service after passing its health check: {last_line}"),
                node,
            ),
            Outcome::Failed { node, why, next_at } => (
                "failed",
                format!("health check failed: {why}; stays cordoned, next try at {next_at}"),
                node,
            ),
        };
        app.metrics.probation(result);
        app.audit.record(crate::audit::AuditEntry {
            at: now(),
            who: "gangway".into(),
            action,
            target: Some(node),
            status: 200,
            result: "ok".into(),
        });
    }
}

fn record_blame(app: &App, decisions: Vec<crate::blame::Decision>, halted: bool) {
    app.metrics.auto_cordon_halted.set(i64::from(halted));
    for d in decisions {
        let (action, target) = match d {
            crate::blame::Decision::Cordon { node, why } => {
                app.metrics.node_auto_cordons.inc();
                (format!("auto-cordon: {why}"), Some(node))
            }
            crate::blame::Decision::Halt { nodes } => (
                format!(
                    "auto-cordon stopped, alert raised: {} nodes qualify at once ({})",
                    nodes.len(),
                    nodes.join(", ")
                ),
                None,
            ),
            crate::blame::Decision::Resume => ("auto-cordon resumed".to_string(), None),
        };
        app.audit.record(crate::audit::AuditEntry {
            at: now(),
            who: "gangway".into(),
            action,
            target,
            status: 200,
            result: "ok".into(),
        });
    }
}
