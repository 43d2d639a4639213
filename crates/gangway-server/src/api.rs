//! The HTTP+JSON API (axum) with bearer-token auth.
//!
//! Every handler authenticates before it reads a body (401 for a missing or
//! unknown token, 403 for a known one that may not do this), reads at most
//! `max_body_bytes`, and parses job specs on the blocking pool, so hostile
//! bodies never hold the async workers that serve heartbeats.

use crate::audit::{AuditEntry, AuditTarget};
use crate::authz::{hash_token, job_access, JobAccess, REDACTED};
use crate::config::ServerConfig;
use crate::control::{Control, ControlError, SyncAnswer};
use crate::limits::LimitError;
use crate::metrics::{ApiLabels, Metrics};
use crate::records::JobRecord;
use crate::view::Holder;
use crate::SharedStore;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use gangway_core::agent::{LogChunk, SyncRequest, SyncResponse};
use gangway_core::{JobId, JobSpec, JobState, NodeSpec};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::Notify;

pub use crate::authz::Principal;

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
    pub role: std::sync::RwLock<crate::ha::Role>,
    /// Set when a write was refused because another replica leads.
    pub fenced: std::sync::atomic::AtomicBool,
    /// Queue usage over the last hours (the dashboard's chart).
    pub history: Mutex<crate::dashboard::QueueHistory>,
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

/// Refuses the submissions whose owner already has `max_pending` waiting
/// jobs; the others go on, in order. Counts each owner's waiting jobs once.
fn over_pending_limit(
    c: &Control<SharedStore>,
    batch: &[(crate::control::NewJob, Option<u32>)],
) -> Vec<Option<ApiError>> {
    let limited: std::collections::HashSet<&str> = batch
        .iter()
        .filter(|(_, m)| m.is_some())
        .map(|(j, _)| j.user.as_str())
        .collect();
    let mut counts: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    if !limited.is_empty() {
        for r in c.jobs.in_states(&[JobState::Pending, JobState::Restarting]) {
            if let Some(u) = limited.get(r.user.as_str()) {
                *counts.entry(u).or_insert(0) += 1;
            }
        }
    }
    batch
        .iter()
        .map(|(j, m)| {
            let m = (*m)?;
            // A retry of an accepted submission gets its job, whatever the count now.
            let seen = |k: &str| matches!(c.store.get(&crate::control::idem_key(k)), Ok(Some(_)));
            if j.key.as_deref().is_some_and(seen) {
                return None;
            }
            let n = counts.entry(j.user.as_str()).or_insert(0);
            // An array counts as many jobs as it has tasks.
            let tasks = crate::workflow::task_count(&j.spec);
            if n.saturating_add(tasks) > u64::from(m) {
                return Some(ApiError(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!(
                        "user {} has {n} jobs waiting and submits {tasks}; the limit is {m} (max_pending_jobs)",
                        j.user
                    ),
                ));
            }
            *n += tasks;
            None
        })
        .collect()
}

/// Writes queued submissions in batches: one commit for everything that
/// arrived while the previous commit was in flight, made durable by one
/// store sync after the state lock is released and before any answer.
pub async fn group_commit(
    app: std::sync::Weak<App>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Submission>,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < 1024 {
            match rx.try_recv() {
                Ok(s) => batch.push(s),
                Err(_) => break,
            }
        }
        let Some(app) = app.upgrade() else { return };
        let (inputs, replies): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .map(|s| ((s.job, s.max_pending), s.reply))
            .unzip();
        let app2 = app.clone();
        let results =
            tokio::task::spawn_blocking(move || match app2.control.lock_as(Holder::Submissions) {
                Ok(mut c) => {
                    let refused = over_pending_limit(&c, &inputs);
                    let accepted: Vec<_> = inputs
                        .into_iter()
                        .zip(&refused)
                        .filter(|(_, r)| r.is_none())
                        .map(|((j, _), _)| j)
                        .collect();
                    let mut done = c.submit_batch_deferred(accepted, now()).into_iter();
                    let results: Vec<Result<JobId, ApiError>> = refused
                        .into_iter()
                        .map(|r| match r {
                            Some(e) => Err(e),
                            None => done
                                .next()
                                .unwrap_or_else(|| Err(ControlError::Conflict(JOB_SEQ_LOST.into())))
                                .map_err(ApiError::from),
                        })
                        .collect();
                    let store = c.store_handle();
                    // Publishes the read view and lets cycles and the agents'
                    // batches in while the disk syncs.
                    drop(c);
                    match store.sync() {
                        Ok(()) => results,
                        Err(e) => {
                            let e = ApiError::from(ControlError::Store(e));
                            results
                                .into_iter()
                                .map(|r| r.and_then(|_| Err(ApiError(e.0, e.1.clone()))))
                                .collect()
                        }
                    }
                }
                Err(_) => Vec::new(),
            })
            .await
            .unwrap_or_default();
        let mut results = results.into_iter();
        for reply in replies {
            let r = results.next().unwrap_or_else(|| Err(poisoned()));
            let _ = reply.send(r);
        }
        app.wake.notify_one();
    }
}

const JOB_SEQ_LOST: &str = "submission lost in its batch; retry";

/// Seconds since the epoch (kept here for the binary's callers; the state
/// layer uses [`crate::clock::now`]).
pub use crate::clock::now;

/// An API error: a status and a message naming the problem.
#[derive(Debug)]
pub struct ApiError(StatusCode, String);

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
fn limit_status(e: &LimitError) -> StatusCode {
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
fn workflow_status(e: &crate::workflow::WorkflowError) -> StatusCode {
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

type ApiResult<T> = Result<T, ApiError>;

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
fn poisoned() -> ApiError {
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
fn bearer(headers: &HeaderMap) -> ApiResult<&str> {
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

fn forbidden(msg: impl Into<String>) -> ApiError {
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

/// Bodies up to this size are parsed on the async worker: a typical spec
/// (a few hundred bytes) parses in microseconds, less than a hop to the
/// blocking pool costs (the submission path).
const INLINE_PARSE_BYTES: usize = 16 * 1024;

/// Parses a job spec (JSON or budgeted YAML); large bodies on the blocking
/// pool.
async fn parse_spec(body: Bytes, json_body: bool) -> ApiResult<JobSpec> {
    if body.len() <= INLINE_PARSE_BYTES {
        return parse_spec_now(&body, json_body);
    }
    tokio::task::spawn_blocking(move || parse_spec_now(&body, json_body))
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
}

fn parse_spec_now(body: &[u8], json_body: bool) -> ApiResult<JobSpec> {
    if json_body {
        serde_json::from_slice(body)
            .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("job spec: {e}")))
    } else {
        let text = std::str::from_utf8(body)
            .map_err(|_| ApiError(StatusCode::BAD_REQUEST, "job spec: not UTF-8".into()))?;
        crate::yaml::from_str(text)
            .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("job spec: {e}")))
    }
}

/// A job as the API shows it. The record is borrowed from the read view
/// (copied only to redact it): copying every record's events and
/// placement was over half of a listing's CPU in a profile at 100,000 jobs.
#[derive(Serialize, utoipa::ToSchema)]
pub struct JobView<'a> {
    /// The stored record.
    #[serde(flatten)]
    pub record: std::borrow::Cow<'a, JobRecord>,
    /// Why it waits (pending jobs).
    pub reason: Option<String>,
    /// Stable reason code beside the sentence (Slurm's names), pending jobs.
    pub reason_code: Option<gangway_core::ReasonCode>,
    /// Estimated start from the backfill plan (pending jobs it could plan).
    pub estimated_start: Option<u64>,
    /// Nodes the backfill plan has it start on.
    pub planned_nodes: Vec<String>,
    /// The lifecycle's Admitted phase: pending, quota admits it, it waits for
    /// GPUs (derived from the last cycle, not a stored transition).
    pub admitted: bool,
}

/// A job as the API shows it, from the read view (no state lock).
fn view<'a>(v: &crate::view::ReadView, rec: &'a JobRecord, access: JobAccess) -> JobView<'a> {
    let why = v.why.get(&rec.id);
    let mut record = std::borrow::Cow::Borrowed(rec);
    if access == JobAccess::Redacted && !rec.spec.run.env.is_empty() {
        for v in record.to_mut().spec.run.env.values_mut() {
            *v = REDACTED.to_string();
        }
    }
    let gate = v.gate_reason(rec.id);
    JobView {
        record,
        reason: gate
            .map(|(_, m)| m.to_string())
            .or_else(|| why.map(|w| w.render(&v.names, v.why_at))),
        reason_code: gate
            .map(|(code, _)| code)
            .or(rec.end_reason)
            .or_else(|| why.map(|w| w.code())),
        admitted: rec.state == JobState::Pending
            && why.is_some_and(|w| !matches!(w.reason, gangway_sched::WaitReason::Quota(_))),
        estimated_start: why.and_then(|w| w.estimated_start),
        planned_nodes: v.planned_node_names(rec.id),
    }
}

#[utoipa::path(
    post, path = "/v1/jobs", tag = "jobs",
    summary = "Submit a job",
    description = "A job spec as JSON (`Content-Type: application/json`) or YAML (anything else). Plain users submit to their queues only; the owner is the token's user. With `Idempotency-Key` (1-128 of `[A-Za-z0-9-_.:]`), a retry returns the first submission's job.",
    params(("Idempotency-Key" = Option<String>, Header, description = "Makes retries safe: the same key (per user) never creates a second job")),
    request_body(content((JobSpec = "application/json"), (String = "application/yaml")), description = "The job spec"),
    responses(
        (status = 201, description = "Accepted and stored", body = crate::openapi::Submitted),
        (status = 400, description = "malformed request: the message names the field or parameter", body = crate::openapi::ErrorBody),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 413, description = "body larger than max_body_bytes", body = crate::openapi::ErrorBody),
        (status = 422, description = "valid, but the cluster or queue can never satisfy it", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn submit(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> ApiResult<Response> {
    let p = authenticate_person(&app, &headers)?;
    let json_body = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let body = read_body(&app, body).await?;
    let mut spec = parse_spec(body, json_body).await?;
    if let Principal::User { name, queues } = &p {
        if !queues.contains(&spec.queue) {
            return Err(forbidden(format!(
                "queue: user {name} may not submit to queue {}",
                spec.queue.chars().take(253).collect::<String>()
            )));
        }
        spec.user = name.clone();
    } else if spec.user.is_empty() {
        spec.user = "admin".into();
    }
    let live = app.policy.config();
    crate::limits::check_submission(&live, &p, &spec)?;
    let max_pending = match &p {
        Principal::User { name, .. } => Some(app.cfg.limits_of(name).max_pending_jobs),
        _ => None,
    };
    crate::admission::admit(&live, &spec)
        .map_err(|e| ApiError(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?;
    let key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => {
            let k = v.to_str().unwrap_or("");
            let ok = !k.is_empty()
                && k.len() <= 128
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c));
            if !ok {
                return Err(ApiError(
                    StatusCode::BAD_REQUEST,
                    "Idempotency-Key: 1 to 128 characters of letters, digits and -_.:".into(),
                ));
            }
            // Keys are per user: one user cannot learn another's jobs by guessing.
            Some(format!("{}:{k}", spec.user))
        }
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    app.submissions
        .send(Submission {
            job: crate::control::NewJob {
                user: spec.user.clone(),
                spec,
                key,
            },
            max_pending,
            reply: tx,
        })
        .map_err(|_| ApiError(StatusCode::SERVICE_UNAVAILABLE, "shutting down".into()))?;
    let id = rx
        .await
        .map_err(|_| ApiError(StatusCode::SERVICE_UNAVAILABLE, "shutting down".into()))??;
    let mut res = (
        StatusCode::CREATED,
        Json(json!({ "id": id, "state": "pending" })),
    )
        .into_response();
    res.extensions_mut()
        .insert(AuditTarget(format!("job {id}")));
    Ok(res)
}

#[utoipa::path(
    get, path = "/v1/jobs", tag = "jobs",
    summary = "List jobs, a page at a time",
    description = "Filters combine. The answer is one page (an array); when more may follow, the `X-Next-Cursor` header holds the next page's cursor and `Link` its URL (`rel=next`). Other users' jobs show with environment values redacted.",
    params(crate::listing::JobQuery),
    responses(
        (status = 200, description = "One page of jobs", body = Vec<JobView>,
            headers(("X-Next-Cursor" = String, description = "Cursor of the next page (absent on the last)"),
                    ("Link" = String, description = "URL of the next page, rel=next"))),
        (status = 400, description = "malformed request: the message names the field or parameter", body = crate::openapi::ErrorBody),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn list_jobs(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    axum::extract::RawQuery(raw): axum::extract::RawQuery,
    Query(q): Query<crate::listing::JobQuery>,
) -> ApiResult<Response> {
    let p = authenticate_person(&app, &headers)?;
    let page = q
        .check()
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))?;
    // The published view: a listing never waits for the state lock.
    let v = app.control.view();
    let (jobs, next) = page.select(&v.jobs);
    let out: Vec<JobView> = jobs
        .into_iter()
        .map(|r| {
            view(
                &v,
                r,
                job_access(&p, &r.user).unwrap_or(JobAccess::Redacted),
            )
        })
        .collect();
    let mut res = Json(out).into_response();
    drop(v);
    if let Some(n) = next {
        let h = res.headers_mut();
        if let Ok(v) = header::HeaderValue::from_str(&n) {
            h.insert("x-next-cursor", v);
        }
        let link = crate::listing::next_link(raw.as_deref().unwrap_or(""), &n);
        if let Ok(v) = header::HeaderValue::from_str(&link) {
            h.insert(header::LINK, v);
        }
    }
    Ok(res)
}

#[utoipa::path(
    get, path = "/v1/jobs/{id}", tag = "jobs",
    summary = "A job with its events, placement, why it waits and its estimated start",
    params(("id" = u64, Path, description = "Job id")),
    responses(
        (status = 200, description = "The job (env values redacted unless owner or admin)", body = JobView),
        (status = 400, description = "malformed request: the message names the field or parameter", body = crate::openapi::ErrorBody),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 404, description = "no such object", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn get_job(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<u64>,
) -> ApiResult<Response> {
    let p = authenticate_person(&app, &headers)?;
    // The published view: describing a job never waits for the state lock.
    let v = app.control.view();
    let rec = v
        .job(JobId(id))
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("job {id} does not exist")))?;
    let access = job_access(&p, &rec.user).unwrap_or(JobAccess::Redacted);
    Ok(Json(view(&v, rec, access)).into_response())
}

#[utoipa::path(
    post, path = "/v1/jobs/{id}/cancel", tag = "jobs",
    summary = "Cancel a job (owner or admin)",
    params(("id" = u64, Path, description = "Job id")),
    responses(
        (status = 200, description = "Cancelled (running ranks get their checkpoint signal)", body = crate::openapi::Cancelled),
        (status = 400, description = "malformed request: the message names the field or parameter", body = crate::openapi::ErrorBody),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 404, description = "no such object", body = crate::openapi::ErrorBody),
        (status = 409, description = "conflicts with the object's state", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn cancel_job(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<u64>,
) -> ApiResult<Json<serde_json::Value>> {
    let p = authenticate_person(&app, &headers)?;
    let mut c = lock(&app)?;
    let owner = c
        .jobs
        .get(&JobId(id))
        .map(|(r, _)| r.user.clone())
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("job {id} does not exist")))?;
    if let Principal::User { name, .. } = &p {
        if *name != owner {
            return Err(forbidden(format!("job {id} belongs to {owner}")));
        }
    }
    // An array's id cancels all of its tasks.
    let tasks = c.cancel_job_or_array(JobId(id), &p.name(), now())?;
    drop(c);
    app.wake.notify_one();
    Ok(Json(
        json!({ "id": id, "state": "cancelled", "jobs": tasks }),
    ))
}

#[utoipa::path(
    get, path = "/v1/queues", tag = "queues",
    summary = "Queues with quota, weight, allowed priorities and current usage",
    responses(
        (status = 200, description = "Every queue", body = Vec<crate::openapi::QueueView>),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn queues(
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

#[utoipa::path(
    get, path = "/v1/nodes", tag = "nodes",
    summary = "Nodes, their GPUs (allocated, healthy), readiness and jobs",
    responses(
        (status = 200, description = "Every node, registered or waiting for approval", body = Vec<crate::openapi::NodeView>),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn nodes(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> ApiResult<Json<crate::node_list::NodeList>> {
    authenticate_person(&app, &headers)?;
    // The read view's snapshot, serialized as it is: no state lock, no
    // `serde_json::Value` tree.
    Ok(Json(crate::node_list::NodeList(app.control.view())))
}

#[utoipa::path(
    post, path = "/v1/nodes", tag = "nodes",
    summary = "Register a node",
    description = "The join token registers new names only (they wait for approval unless node_approval is auto) and gets the node token once (201); a node's own token re-registers it (200, no token). The agent states its version in the gangway-agent-version header (none: 0.1); an agent more than one minor version from the server's, or of another major, is refused (409, naming both), and the answer's server_version lets the agent check the same.",
    request_body(content = NodeSpec, content_type = "application/json"),
    responses(
        (status = 200, description = "Re-registered", body = Object),
        (status = 201, description = "Registered: node_token and log_token", body = Object),
        (status = 400, description = "malformed request: the message names the field or parameter", body = crate::openapi::ErrorBody),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 409, description = "conflicts with the object's state", body = crate::openapi::ErrorBody),
        (status = 413, description = "body larger than max_body_bytes", body = crate::openapi::ErrorBody),
        (status = 422, description = "valid, but the cluster or queue can never satisfy it", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn register_node(
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
        (status = 400, description = "malformed request: the message names the field or parameter", body = crate::openapi::ErrorBody),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 404, description = "no such object", body = crate::openapi::ErrorBody),
        (status = 409, description = "conflicts with the object's state", body = crate::openapi::ErrorBody),
        (status = 413, description = "body larger than max_body_bytes", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn agent_report(
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
        (status = 400, description = "malformed request: the message names the field or parameter", body = crate::openapi::ErrorBody),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 404, description = "no such object", body = crate::openapi::ErrorBody),
        (status = 409, description = "conflicts with the object's state", body = crate::openapi::ErrorBody),
        (status = 413, description = "body larger than max_body_bytes", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn agent_sync(
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
    let (answer, changed, blamed, halted) = with_control(&app, move |c| {
        if c.pending_heartbeat(&node, now()) {
            // Waiting for approval: alive, nothing to run.
            return Ok((SyncAnswer::idle(&node), false, Vec::new(), c.blame.halted()));
        }
        let (answer, changed) = c.sync(&node, &req, now())?;
        Ok((
            answer,
            changed,
            std::mem::take(&mut c.blame_log),
            c.blame.halted(),
        ))
    })
    .await?;
    record_blame(&app, blamed, halted);
    // Built here, not under the state lock.
    let mut out = answer.into_response();
    crate::admission::stamp(&app.cfg, &mut out.assignments);
    if changed {
        app.wake.notify_one();
    }
    Ok(Json(out))
}

/// Node blame's decisions go to the audit log (with their evidence) and
/// the metrics (`gangway_node_auto_cordons_total`, `gangway_auto_cordon_halted`).
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
        app.audit.record(AuditEntry {
            at: now(),
            who: "gangway".into(),
            action,
            target,
            status: 200,
            result: "ok".into(),
        });
    }
}

/// Which log to read.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LogQuery {
    /// Rank (default 0).
    rank: Option<u32>,
    /// Attempt (default: the latest that was placed).
    attempt: Option<u32>,
    /// Byte offset to start at.
    offset: Option<u64>,
}

#[utoipa::path(
    get, path = "/v1/jobs/{id}/logs", tag = "jobs",
    summary = "A rank's log, relayed from its agent (owner or admin)",
    params(("id" = u64, Path, description = "Job id"), LogQuery),
    responses(
        (status = 200, description = "A chunk of the log and the offset to ask for next", body = LogChunk),
        (status = 400, description = "malformed request: the message names the field or parameter", body = crate::openapi::ErrorBody),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 404, description = "no such object", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 502, description = "the node's agent did not answer as expected", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn job_logs(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<u64>,
    Query(q): Query<LogQuery>,
) -> ApiResult<Json<LogChunk>> {
    let p = authenticate_person(&app, &headers)?;
    let rank = q.rank.unwrap_or(0);
    let (url, token, attempt) = {
        // The read view: the record, the node's registered address and its
        // log key; no state lock.
        let v = app.control.view();
        let rec = v
            .job(JobId(id))
            .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("job {id} does not exist")))?;
        if job_access(&p, &rec.user) != Some(JobAccess::Full) {
            return Err(forbidden(format!(
                "job {id}'s logs are readable by its owner and admins only"
            )));
        }
        if rec.ran_on.is_empty() {
            return Err(ApiError(
                StatusCode::NOT_FOUND,
                format!("job {id} has not been placed yet: no logs"),
            ));
        }
        let node = rec.ran_on.get(rank as usize).ok_or_else(|| {
            ApiError(
                StatusCode::NOT_FOUND,
                format!("rank: job {id} has ranks 0..{}", rec.ran_on.len()),
            )
        })?;
        // A failed rank of an earlier attempt may have run elsewhere.
        let node = match &rec.failure {
            Some(f) if q.attempt == Some(f.attempt) && f.rank == Some(rank) => &f.node,
            _ => node,
        };
        let spec = v.node_row(node).map(|n| &n.spec);
        let url = spec.and_then(|s| s.agent_url.clone()).ok_or_else(|| {
            ApiError(
                StatusCode::NOT_FOUND,
                format!("node {node} has no agent serving logs"),
            )
        })?;
        // Only ever the node's own registered address.
        crate::nodes::check_agent_url(&url, spec.map_or("", |s| s.address.as_str()))
            .map_err(|e| ApiError(StatusCode::BAD_GATEWAY, format!("node {node}: {e}")))?;
        let token = v
            .log_token_of(node, &app.cfg.agent_token)
            .unwrap_or_default();
        (url, token, q.attempt.unwrap_or(rec.ran_attempt))
    };
    let target = format!(
        "{}/v1/logs/{id}/{attempt}/{rank}?offset={}",
        url.trim_end_matches('/'),
        q.offset.unwrap_or(0)
    );
    let r = tokio::task::spawn_blocking(move || {
        // The shared client never follows redirects: the answer comes from the
        // node or not at all.
        match crate::http()
            .get(&target)
            .set("Authorization", &format!("Bearer {token}"))
            .timeout(std::time::Duration::from_secs(10))
            .call()
        {
            Ok(resp) if resp.status() != 200 => Err(ApiError(
                StatusCode::BAD_GATEWAY,
                format!("agent answered {} instead of a log", resp.status()),
            )),
            Ok(resp) => {
                use std::io::Read;
                let mut bytes = Vec::new();
                resp.into_reader()
                    .take(4 << 20)
                    .read_to_end(&mut bytes)
                    .map_err(|e| ApiError(StatusCode::BAD_GATEWAY, e.to_string()))?;
                serde_json::from_slice::<LogChunk>(&bytes).map_err(|e| {
                    ApiError(
                        StatusCode::BAD_GATEWAY,
                        format!("agent answered badly: {e}"),
                    )
                })
            }
            Err(ureq::Error::Status(404, _)) => Err(ApiError(
                StatusCode::NOT_FOUND,
                format!("no log for job {id} attempt {attempt} rank {rank}"),
            )),
            Err(e) => Err(ApiError(
                StatusCode::BAD_GATEWAY,
                format!("cannot reach the agent: {e}"),
            )),
        }
    })
    .await
    .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    r.map(Json)
}

#[utoipa::path(
    post, path = "/v1/nodes/{name}/gpus/{index}/{action}", tag = "nodes",
    summary = "Mark a GPU healthy (`healthy`, `clear`) or `unhealthy` (admin)",
    params(("name" = String, Path, description = "Node name"), ("index" = u32, Path, description = "GPU index"),
           ("action" = String, Path, description = "healthy, clear or unhealthy")),
    responses(
        (status = 200, description = "The GPU's health now", body = Object),
        (status = 400, description = "malformed request: the message names the field or parameter", body = crate::openapi::ErrorBody),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 404, description = "no such object", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn gpu_health(
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
        (status = 400, description = "malformed request: the message names the field or parameter", body = crate::openapi::ErrorBody),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 404, description = "no such object", body = crate::openapi::ErrorBody),
        (status = 409, description = "conflicts with the object's state", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn cordon(
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
        (status = 200, description = "GPU-hours by queue and by user", body = crate::openapi::UsageView),
        (status = 400, description = "malformed request: the message names the field or parameter", body = crate::openapi::ErrorBody),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn usage(
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

#[utoipa::path(
    get, path = "/metrics", tag = "operations",
    summary = "Prometheus metrics (admin or metrics token)",
    description = "Prometheus text format 0.0.4 by default; OpenMetrics 1.0.0 when the Accept header prefers `application/openmetrics-text`.",
    params(("Accept" = Option<String>, Header, description = "Content negotiation")),
    responses(
        (status = 200, description = "The metrics", content(
            (String = "text/plain; version=0.0.4"),
            (String = "application/openmetrics-text; version=1.0.0"))),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn metrics(State(app): State<Arc<App>>, headers: HeaderMap) -> ApiResult<Response> {
    let p = authenticate(&app, &headers)?;
    if !matches!(p, Principal::Admin | Principal::Metrics) {
        return Err(forbidden("only the admin and metrics tokens read /metrics"));
    }
    // From the read view (job counts and GPU totals): no state lock, no
    // walk of the jobs.
    let format = crate::metrics::Format::negotiate(
        headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()),
    );
    let text = crate::policy::watch::render(&app, format);
    Ok(([(header::CONTENT_TYPE, format.content_type())], text).into_response())
}

/// Which audit entries to read.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AuditQuery {
    /// Only entries at or after this time (seconds since the epoch).
    since: Option<u64>,
    /// At most this many, the latest (default 1000).
    limit: Option<usize>,
}

#[utoipa::path(
    get, path = "/v1/audit", tag = "operations",
    summary = "The audit log: every state-changing call with who, what, target and result (admin)",
    params(AuditQuery),
    responses(
        (status = 200, description = "Entries, oldest first", body = Vec<AuditEntry>),
        (status = 400, description = "malformed request: the message names the field or parameter", body = crate::openapi::ErrorBody),
        (status = 401, description = "missing or unknown bearer token", body = crate::openapi::ErrorBody),
        (status = 403, description = "this token may not do this (names the rule)", body = crate::openapi::ErrorBody),
        (status = 429, description = "request rate or waiting-job limit reached; retry later", body = crate::openapi::ErrorBody),
        (status = 500, description = "internal error (store, poisoned state)", body = crate::openapi::ErrorBody),
        (status = 503, description = "no leader to forward to, or shutting down; retry", body = crate::openapi::ErrorBody)
    ),
    security(("bearer" = []))
)]
async fn audit_log(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Query(q): Query<AuditQuery>,
) -> ApiResult<Json<Vec<AuditEntry>>> {
    authenticate_admin(&app, &headers, "read the audit log")?;
    let app2 = app.clone();
    let (since, limit) = (q.since.unwrap_or(0), q.limit.unwrap_or(1000).min(100_000));
    let entries = tokio::task::spawn_blocking(move || app2.audit.read(since, limit))
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("audit log: {e}")))?;
    Ok(Json(entries))
}

/// Records every state-changing call (not agents' heartbeats) in the audit log.
async fn audit(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let heartbeat = path.starts_with("/v1/agent/") && path.ends_with("/sync");
    if method == axum::http::Method::GET || method == axum::http::Method::HEAD || heartbeat {
        return next.run(req).await;
    }
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| path.clone(), |m| m.as_str().to_string());
    let who = match bearer(req.headers()) {
        Err(_) => "no token".to_string(),
        Ok(_) => identify(&app, req.headers()).map_or_else(|| "unknown token".into(), |p| p.name()),
    };
    let res = next.run(req).await;
    let target = res
        .extensions()
        .get::<AuditTarget>()
        .map(|t| t.0.clone())
        .or_else(|| target_of(&path));
    let status = res.status().as_u16();
    app.audit.record(AuditEntry {
        at: now(),
        who,
        action: format!("{method} {route}"),
        target,
        status,
        result: match status {
            200..=399 => "ok",
            400..=499 => "refused",
            _ => "error",
        }
        .into(),
    });
    res
}

/// The job or node a path names (`/v1/jobs/7/cancel` → `job 7`).
fn target_of(path: &str) -> Option<String> {
    let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    match parts.as_slice() {
        ["v1", "jobs", id, ..] => Some(format!("job {id}")),
        ["v1", "nodes", name, ..] | ["v1", "agent", name, ..] => Some(format!(
            "node {}",
            name.chars().take(253).collect::<String>()
        )),
        _ => None,
    }
}

/// Headers every answer carries: no sniffing, no framing, a strict content
/// security policy unless the handler set its own (the dashboard page).
async fn security_headers(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::X_FRAME_OPTIONS,
        header::HeaderValue::from_static("DENY"),
    );
    h.insert(
        header::REFERRER_POLICY,
        header::HeaderValue::from_static("no-referrer"),
    );
    if !h.contains_key(header::CONTENT_SECURITY_POLICY) {
        h.insert(
            header::CONTENT_SECURITY_POLICY,
            header::HeaderValue::from_static("default-src 'none'; frame-ancestors 'none'"),
        );
    }
    res
}

#[utoipa::path(
    get, path = "/healthz", tag = "operations",
    summary = "Liveness",
    responses((status = 200, description = "ok", body = String, content_type = "text/plain"))
)]
async fn healthz() -> &'static str {
    "ok"
}

#[utoipa::path(
    get, path = "/openapi.json", tag = "operations",
    summary = "This document",
    responses((status = 200, description = "OpenAPI document", body = Object))
)]
async fn openapi() -> Json<serde_json::Value> {
    Json(crate::openapi::document())
}

async fn track(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |m| m.as_str().to_string());
    let start = Instant::now();
    let res = next.run(req).await;
    app.metrics
        .api_requests
        .get_or_create(&ApiLabels {
            route,
            status: res.status().as_u16(),
        })
        .inc();
    app.metrics
        .api_seconds
        .observe(start.elapsed().as_secs_f64());
    res
}

/// On a follower, every API request goes to the leader; without a leader
/// the answer is 503 (clients retry).
async fn forward(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = req.uri().path().to_string();
    let role = app
        .role
        .read()
        .map(|r| r.clone())
        .unwrap_or(crate::ha::Role::Follower(None));
    let local =
        path == "/" || path == "/healthz" || path == "/v1/leader" || path == "/openapi.json";
    let leader = match role {
        crate::ha::Role::Leader => return next.run(req).await,
        _ if local => return next.run(req).await,
        crate::ha::Role::Follower(None) => {
            return ApiError(
                StatusCode::SERVICE_UNAVAILABLE,
                "no leader elected yet; retry".into(),
            )
            .into_response()
        }
        crate::ha::Role::Follower(Some(l)) => l,
    };
    let method = req.method().as_str().to_string();
    let target = format!(
        "{}{}",
        leader.trim_end_matches('/'),
        req.uri().path_and_query().map_or("/", |p| p.as_str())
    );
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .filter(|(k, _)| {
            matches!(
                k.as_str(),
                "authorization" | "content-type" | "idempotency-key" | "accept"
            )
        })
        .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
        .collect();
    let body = match axum::body::to_bytes(req.into_body(), app.cfg.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => {
            return ApiError(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("body: at most {} bytes", app.cfg.max_body_bytes),
            )
            .into_response()
        }
    };
    let answer = tokio::task::spawn_blocking(move || {
        let mut r = crate::http()
            .request(&method, &target)
            .timeout(std::time::Duration::from_secs(30));
        for (k, v) in &headers {
            r = r.set(k, v);
        }
        let resp = if body.is_empty() {
            r.call()
        } else {
            r.send_bytes(&body)
        };
        let resp = match resp {
            Ok(x) | Err(ureq::Error::Status(_, x)) => x,
            Err(e) => return Err(e.to_string()),
        };
        let status = resp.status();
        let ct = resp.content_type().to_string();
        let mut bytes = Vec::new();
        use std::io::Read;
        resp.into_reader()
            .take(256 << 20)
            .read_to_end(&mut bytes)
            .map_err(|e| e.to_string())?;
        Ok((status, ct, bytes))
    })
    .await;
    match answer {
        Ok(Ok((status, ct, bytes))) => (
            StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
            [(header::CONTENT_TYPE, ct)],
            bytes,
        )
            .into_response(),
        Ok(Err(e)) => ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the leader at {leader} did not answer ({e}); retry"),
        )
        .into_response(),
        Err(e) => ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

#[utoipa::path(
    get, path = "/v1/leader", tag = "operations",
    summary = "Whether this replica leads, and whom it forwards to",
    responses((status = 200, description = "leader, and leader_url on a follower", body = crate::openapi::LeaderView))
)]
async fn leader(State(app): State<Arc<App>>) -> Json<serde_json::Value> {
    let role = app
        .role
        .read()
        .map(|r| r.clone())
        .unwrap_or(crate::ha::Role::Follower(None));
    Json(match role {
        crate::ha::Role::Leader => json!({ "leader": true }),
        crate::ha::Role::Follower(l) => json!({ "leader": false, "leader_url": l }),
    })
}

/// The router.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/v1/leader", get(leader))
        .route("/openapi.json", get(openapi))
        .route("/metrics", get(metrics))
        .route("/v1/jobs", post(submit).get(list_jobs))
        .route("/v1/jobs/{id}", get(get_job))
        .route("/v1/jobs/{id}/cancel", post(cancel_job))
        .route("/v1/queues", get(queues))
        .route("/v1/usage", get(usage))
        .route("/v1/nodes", get(nodes).post(register_node))
        .route("/v1/nodes/{name}/{action}", post(cordon))
        .route("/v1/agent/{name}/report", post(agent_report))
        .route("/v1/agent/{name}/sync", post(agent_sync))
        .route("/v1/jobs/{id}/logs", get(job_logs))
        .route("/v1/nodes/{name}/gpus/{index}/{action}", post(gpu_health))
        .route("/v1/audit", get(audit_log))
        .route("/v1/jobs/{id}/hold", post(crate::workflow_api::hold))
        .route("/v1/jobs/{id}/release", post(crate::workflow_api::release))
        .route("/v1/jobs/{id}/update", post(crate::workflow_api::update))
        .route("/v1/history", get(crate::history_api::list))
        .route(
            "/v1/reservations",
            post(crate::reservations_api::create).get(crate::reservations_api::list),
        )
        .route(
            "/v1/reservations/{name}",
            axum::routing::delete(crate::reservations_api::delete),
        )
        .merge(crate::dashboard::routes())
        .merge(crate::policy::api::routes())
        .merge(crate::backup::routes())
        .route_layer(axum::middleware::from_fn_with_state(app.clone(), audit))
        .route_layer(axum::middleware::from_fn_with_state(app.clone(), track))
        .layer(axum::middleware::from_fn_with_state(app.clone(), forward))
        .layer(axum::middleware::from_fn(crate::errors::json_errors))
        .layer(axum::middleware::from_fn(security_headers))
        .with_state(app)
}

/// The registering agent's version, from its
/// [`gangway_core::agent::VERSION_HEADER`] header (an agent that states
/// none predates it: 0.1), refused when the version-skew policy does not let
/// it work with this server (400 for a malformed version, 409 for one too
/// far apart, naming both versions).
pub fn check_agent_version(
    header: Option<&axum::http::HeaderValue>,
) -> Result<gangway_core::agent::Version, crate::api::ApiError> {
    use axum::http::StatusCode;
    use gangway_core::agent::{check_skew, Version, UNSTATED_VERSION, VERSION_HEADER};
    let agent = match header {
        None => UNSTATED_VERSION,
        Some(h) => h
            .to_str()
            .map_err(|_| gangway_core::agent::SkewError::Malformed("(not text)".into()))
            .and_then(str::parse::<Version>)
            .map_err(|e| {
                crate::api::ApiError::new(StatusCode::BAD_REQUEST, format!("{VERSION_HEADER}: {e}"))
            })?,
    };
    check_skew(Version::current(), agent)
        .map_err(|e| crate::api::ApiError::new(StatusCode::CONFLICT, e.to_string()))?;
    Ok(agent)
}
