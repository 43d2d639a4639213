//! What every HTTP resource shares: the server's state ([`App`]), the
//! error answer ([`ApiError`]) and the documented error responses
//! ([`Errors`]), bearer-token authentication, and the lock and
//! blocking-pool helpers. It imports no resource module.

use crate::authz::hash_token;
pub use crate::authz::Principal;
use crate::config::ServerConfig;
use crate::control::{Control, ControlError};
use crate::limits::LimitError;
use crate::metrics::Metrics;
use crate::view::Holder;
use crate::SharedStore;
use axum::body::Bytes;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use gangway_core::JobId;
use serde::Serialize;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::Notify;

/// Shared server state.
pub struct App {
    /// The store the control state writes, for reads that need nothing else
    /// (stored policy versions): they see every committed write without
    /// taking the state lock. Writes go through the control state only.
    pub store: SharedStore,
    /// Digests of the configuration's tokens.
    pub tokens: crate::authz::ConfigTokens,
    /// Per-principal request rate limits.
    pub rate: crate::limits::RateLimiter,
    /// The audit log.
    pub audit: crate::audit::AuditLog,
    /// When the policy figures of `/metrics` were last considered for a refresh
    /// (seconds since the epoch).
    pub metrics_at: std::sync::atomic::AtomicU64,
    /// Control state behind one lock: every change is short and ordered.
    /// Job reads (list, describe) read its published view instead
    /// ([`crate::view`]).
    pub control: crate::lock::StateLock<SharedStore>,
    /// Configuration.
    pub cfg: ServerConfig,
    /// Metrics.
    pub metrics: Metrics,
    /// Wakes the scheduler loop.
    pub wake: Notify,
    /// Submissions waiting for the group-commit writer.
    pub submissions: tokio::sync::mpsc::UnboundedSender<Submission>,
    /// The writer's end, taken by [`crate::serve`].
    pub submissions_rx: Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<Submission>>>,
    /// Whether this replica leads (always, without etcd) or whom to forward to.
    pub role: std::sync::RwLock<Role>,
    /// Set when a write was refused because another replica leads.
    pub fenced: std::sync::atomic::AtomicBool,
    /// Queue usage over the last hours (the dashboard's chart).
    pub history: Mutex<crate::http::dashboard::samples::QueueHistory>,
    /// The configuration as the policy in force shapes it (submissions are checked against it).
    pub policy: crate::policy::Live,
    /// Policy and SLO metrics (rendered with `metrics`).
    pub watch: crate::policy::watch::Watch,
    /// Where retention appends finished jobs before removing them
    /// (`<data_dir>/history`); unset, finished jobs are kept.
    pub export_dir: std::sync::OnceLock<std::path::PathBuf>,
}

/// A submission handed to the group-commit writer.
pub struct Submission {
    /// Owner, spec and idempotency key.
    pub job: crate::control::NewJob,
    /// The owner's limit of waiting jobs (plain users), checked in the same
    /// lock as the write.
    pub max_pending: Option<u32>,
    /// Where the answer goes.
    pub reply: tokio::sync::oneshot::Sender<Result<JobId, ApiError>>,
}

/// Seconds since the epoch (kept here for the binary's callers; the state
/// layer uses [`crate::clock::now`]).
pub use crate::clock::now;

/// An API error: a status and a message naming the problem.
#[derive(Debug)]
pub struct ApiError(pub(crate) StatusCode, pub(crate) String);

impl ApiError {
    /// An error with this status and message.
    pub fn new(status: StatusCode, msg: impl Into<String>) -> Self {
        ApiError(status, msg.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(json!({ "error": self.1 }))).into_response()
    }
}

impl From<ControlError> for ApiError {
    fn from(e: ControlError) -> Self {
        let code = match &e {
            ControlError::Rejected(_) | ControlError::BadNode(_) => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            ControlError::NoSuchJob(_) | ControlError::NoSuchNode(_) => StatusCode::NOT_FOUND,
            ControlError::Finished(..)
            | ControlError::Conflict(_)
            | ControlError::BadReport(..)
            | ControlError::StaleAttempt(..) => StatusCode::CONFLICT,
            ControlError::NotOnNode(..) | ControlError::Forbidden(_) => StatusCode::FORBIDDEN,
            ControlError::Store(gangway_store::StoreError::NotLeader) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ControlError::Store(_) | ControlError::Corrupt(..) => StatusCode::INTERNAL_SERVER_ERROR,
            ControlError::Workflow(w) => workflow_status(w),
        };
        ApiError(code, e.to_string())
    }
}

/// The HTTP status of a limit's refusal.
pub(crate) fn limit_status(e: &LimitError) -> StatusCode {
    match e {
        LimitError::Field { .. } => StatusCode::BAD_REQUEST,
        LimitError::Policy { .. } => StatusCode::FORBIDDEN,
        LimitError::Rate { .. } => StatusCode::TOO_MANY_REQUESTS,
    }
}

impl From<LimitError> for ApiError {
    fn from(e: LimitError) -> Self {
        ApiError(limit_status(&e), e.to_string())
    }
}

/// The HTTP status of a hold, release or update's refusal.
pub(crate) fn workflow_status(e: &crate::workflow::WorkflowError) -> StatusCode {
    use crate::workflow::WorkflowError as W;
    match e {
        W::NotPending(..) | W::NotHeld(_) => StatusCode::CONFLICT,
        W::Forbidden(_) => StatusCode::FORBIDDEN,
        W::Field(_) => StatusCode::UNPROCESSABLE_ENTITY,
        W::Malformed(_) => StatusCode::BAD_REQUEST,
        W::Limit(l) => limit_status(l),
    }
}

impl From<crate::workflow::WorkflowError> for ApiError {
    fn from(e: crate::workflow::WorkflowError) -> Self {
        ApiError(workflow_status(&e), e.to_string())
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// The control state, or a 500 if a panic poisoned it.
///
/// On the server's multi-threaded runtime the wait is announced to tokio
/// (`block_in_place`): a scheduling cycle holds the lock for up to 100s of
/// ms on a large cluster, and a few handlers parked on it must not take
/// every async worker with them, stalling requests that never need the lock.
pub fn lock(app: &App) -> ApiResult<crate::lock::StateGuard<'_, SharedStore>> {
    let acquire = || app.control.lock_as(Holder::Requests);
    let on_workers = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    let guard = if on_workers {
        tokio::task::block_in_place(acquire)
    } else {
        acquire()
    };
    guard.map_err(|_| poisoned())
}

/// The answer when a panic poisoned the state lock.
pub(crate) fn poisoned() -> ApiError {
    ApiError(
        StatusCode::INTERNAL_SERVER_ERROR,
        "state lock poisoned".into(),
    )
}

/// Runs `f` on the control state with its job writes deferred
/// ([`Control::deferred`]) and returns its answer once they are durable.
/// For the agents' syncs and reports: frequent, each a few writes,
/// acknowledged only once durable. They are combined ([`crate::lock`]):
/// many per lock hold, one read-view publish and one store sync per batch,
/// and neither the wait for the lock nor the disk holds an async worker.
pub async fn with_control<T: Send + 'static>(
    app: &Arc<App>,
    f: impl FnOnce(&mut Control<SharedStore>) -> ApiResult<T> + Send + 'static,
) -> ApiResult<T> {
    use crate::lock::CombineError as E;
    crate::lock::run(app.clone(), |a: &App| &a.control, f)
        .await
        .map_err(|e| match e {
            E::NotLeader => {
                ApiError::from(ControlError::Store(gangway_store::StoreError::NotLeader))
            }
            E::Sync(m) => ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("store: {m}")),
            E::Lost => poisoned(),
        })?
}

/// Runs `f` on the blocking pool: reads that walk every job (usage,
/// history, the policy's figures) keep the async workers free for
/// heartbeats and requests.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> ApiResult<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("read task failed: {e}"),
        )
    })?
}

/// The bearer token of a request.
pub(crate) fn bearer(headers: &HeaderMap) -> ApiResult<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| ApiError(StatusCode::UNAUTHORIZED, "missing bearer token".into()))
}

/// Who the bearer token belongs to, without spending a request of its rate
/// (the audit log's view); `None` for a missing or unknown token.
pub fn identify(app: &App, headers: &HeaderMap) -> Option<Principal> {
    let h = hash_token(bearer(headers).ok()?);
    if let Some(p) = app.tokens.find(&h) {
        return Some(p);
    }
    // Node tokens from the published view: authenticating takes no lock.
    let v = app.control.view();
    v.node_of_token(&h).map(|n| Principal::Node(n.to_string()))
}

/// Who the bearer token belongs to (401 when missing or unknown); users and
/// the join token spend one request of their rate (429 past it).
pub fn authenticate(app: &App, headers: &HeaderMap) -> ApiResult<Principal> {
    bearer(headers)?;
    let p = identify(app, headers)
        .ok_or_else(|| ApiError(StatusCode::UNAUTHORIZED, "unknown token".into()))?;
    let limits = match &p {
        Principal::User { name, .. } => Some(app.cfg.limits_of(name)),
        Principal::Agent => Some(app.cfg.limits),
        _ => None,
    };
    if let Some(l) = limits {
        app.rate.take(&p.name(), &l, Instant::now())?;
    }
    Ok(p)
}

/// An admin's or a user's token: the join, node and metrics tokens read
/// nothing of jobs, queues or nodes (403).
pub fn authenticate_person(app: &App, headers: &HeaderMap) -> ApiResult<Principal> {
    let p = authenticate(app, headers)?;
    if !crate::authz::is_person(&p) {
        return Err(forbidden(format!(
            "the {} token may not read or change jobs",
            p.name()
        )));
    }
    Ok(p)
}

/// The admin token only (403 for any other known token).
pub fn authenticate_admin(app: &App, headers: &HeaderMap, what: &str) -> ApiResult<Principal> {
    let p = authenticate(app, headers)?;
    if !p.is_admin() {
        return Err(forbidden(format!("only admins {what}")));
    }
    Ok(p)
}

pub(crate) fn forbidden(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::FORBIDDEN, msg.into())
}

/// The request body, at most `max_body_bytes` (413 past it); read only
/// after the caller is authenticated.
pub(crate) async fn read_body(app: &App, body: axum::body::Body) -> ApiResult<Bytes> {
    let max = app.cfg.max_body_bytes;
    axum::body::to_bytes(body, max).await.map_err(|_| {
        ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("body: at most {max} bytes"),
        )
    })
}

/// This replica's part (the election that sets it is [`crate::ha`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// It schedules and writes.
    Leader,
    /// It forwards to the leader at this URL (`None`: none elected yet).
    Follower(Option<String>),
}

/// Every error answer: `{"error": "..."}`, the message naming the field or rule.
#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: String,
}

/// The error answers an operation documents, as one `responses(...)` entry
/// of its `#[utoipa::path]`: `Errors<{ MALFORMED | UNAUTHENTICATED }>`.
/// Each bit is one status with its one description (below), so every
/// operation describes the same failure in the same words; each answers
/// [`ErrorBody`] as JSON.
pub struct Errors<const SET: u32>;

/// 400: a malformed request.
pub const MALFORMED: u32 = 1;
/// 401: no token, or an unknown one.
pub const UNAUTHENTICATED: u32 = 1 << 1;
/// 403: a known token that may not do this.
pub const FORBIDDEN: u32 = 1 << 2;
/// 403, the dashboard's reads: a token that may not read the cluster.
pub const FORBIDDEN_CLUSTER_READ: u32 = 1 << 3;
/// 404: no such object.
pub const NOT_FOUND: u32 = 1 << 4;
/// 409: conflicts with the object's state.
pub const CONFLICT: u32 = 1 << 5;
/// 413: the body is over `max_body_bytes`.
pub const TOO_LARGE: u32 = 1 << 6;
/// 422: valid, but never satisfiable here.
pub const UNSATISFIABLE: u32 = 1 << 7;
/// 429: a rate or waiting-job limit.
pub const RATE_LIMITED: u32 = 1 << 8;
/// 429, the dashboard's reads: the request rate alone.
pub const REQUEST_RATE: u32 = 1 << 9;
/// 500: the store or a poisoned state.
pub const INTERNAL: u32 = 1 << 10;
/// 500, the dashboard's reads.
pub const INTERNAL_READ: u32 = 1 << 11;
/// 502: a node's agent did not answer as expected.
pub const AGENT_FAILED: u32 = 1 << 12;
/// 503: no leader, or shutting down.
pub const UNAVAILABLE: u32 = 1 << 13;
/// 503, the dashboard's reads: no leader yet.
pub const NO_LEADER: u32 = 1 << 14;

/// Each error bit's status and description, in bit order.
const ERROR_CASES: [(u32, u16, &str); 15] = [
    (
        MALFORMED,
        400,
        "malformed request: the message names the field or parameter",
    ),
    (UNAUTHENTICATED, 401, "missing or unknown bearer token"),
    (
        FORBIDDEN,
        403,
        "this token may not do this (names the rule)",
    ),
    (
        FORBIDDEN_CLUSTER_READ,
        403,
        "this token may not read the cluster",
    ),
    (NOT_FOUND, 404, "no such object"),
    (CONFLICT, 409, "conflicts with the object's state"),
    (TOO_LARGE, 413, "body larger than max_body_bytes"),
    (
        UNSATISFIABLE,
        422,
        "valid, but the cluster or queue can never satisfy it",
    ),
    (
        RATE_LIMITED,
        429,
        "request rate or waiting-job limit reached; retry later",
    ),
    (REQUEST_RATE, 429, "request rate reached; retry later"),
    (INTERNAL, 500, "internal error (store, poisoned state)"),
    (INTERNAL_READ, 500, "internal error"),
    (
        AGENT_FAILED,
        502,
        "the node's agent did not answer as expected",
    ),
    (
        UNAVAILABLE,
        503,
        "no leader to forward to, or shutting down; retry",
    ),
    (NO_LEADER, 503, "no leader to forward to; retry"),
];

impl<const SET: u32> utoipa::IntoResponses for Errors<SET> {
    fn responses() -> std::collections::BTreeMap<
        String,
        utoipa::openapi::RefOr<utoipa::openapi::response::Response>,
    > {
        use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
        ERROR_CASES
            .iter()
            .filter(|(bit, _, _)| SET & bit != 0)
            .map(|(_, status, description)| {
                let body = ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ErrorBody")))
                    .build();
                let response = ResponseBuilder::new()
                    .description(*description)
                    .content("application/json", body)
                    .build();
                (status.to_string(), response.into())
            })
            .collect()
    }
}
