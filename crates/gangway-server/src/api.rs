//! The HTTP+JSON API (axum) with bearer-token auth.

use crate::config::ServerConfig;
use crate::control::{Control, ControlError};
use crate::metrics::{ApiLabels, Metrics};
use crate::records::JobRecord;
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
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::Notify;

/// Shared server state.
pub struct App {
    /// Control state behind one lock: every change is short and ordered.
    pub control: Mutex<Control<SharedStore>>,
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
}

/// A submission handed to the group-commit writer.
pub struct Submission {
    /// Owner, spec and idempotency key.
    pub job: crate::control::NewJob,
    /// Where the answer goes.
    pub reply: tokio::sync::oneshot::Sender<Result<JobId, ControlError>>,
}

/// Writes queued submissions in batches: one durable commit for everything
/// that arrived while the previous commit was in flight.
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
        let (inputs, replies): (Vec<_>, Vec<_>) =
            batch.into_iter().map(|s| (s.job, s.reply)).unzip();
        let app2 = app.clone();
        let results = tokio::task::spawn_blocking(move || match app2.control.lock() {
            Ok(mut c) => c.submit_batch(inputs, now()),
            Err(_) => Vec::new(),
        })
        .await
        .unwrap_or_default();
        let mut results = results.into_iter();
        for reply in replies {
            let r = results
                .next()
                .unwrap_or_else(|| Err(ControlError::Conflict("state lock poisoned".into())));
            let _ = reply.send(r);
        }
        app.wake.notify_one();
    }
}

/// Seconds since the epoch.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Who is calling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Principal {
    /// The admin token.
    Admin,
    /// A user token.
    User {
        /// Name.
        name: String,
        /// Queues they may use.
        queues: Vec<String>,
    },
    /// The agent join token.
    Agent,
}

impl Principal {
    /// The user name (`admin`, `agent` for those tokens).
    pub fn name(&self) -> &str {
        match self {
            Principal::Admin => "admin",
            Principal::User { name, .. } => name,
            Principal::Agent => "agent",
        }
    }
}

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
            ControlError::NotOnNode(..) => StatusCode::FORBIDDEN,
            ControlError::Store(gangway_store::StoreError::NotLeader) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ControlError::Store(_) | ControlError::Corrupt(..) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(code, e.to_string())
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// The control state, or a 500 if a panic poisoned it.
pub fn lock(app: &App) -> ApiResult<std::sync::MutexGuard<'_, Control<SharedStore>>> {
    app.control.lock().map_err(|_| {
        ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            "state lock poisoned".into(),
        )
    })
}

/// The bearer token of a request.
fn bearer(headers: &HeaderMap) -> ApiResult<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| ApiError(StatusCode::UNAUTHORIZED, "missing bearer token".into()))
}

/// Who the bearer token belongs to.
pub fn authenticate(app: &App, headers: &HeaderMap) -> ApiResult<Principal> {
    let token = bearer(headers)?;
    if token == app.cfg.admin_token {
        return Ok(Principal::Admin);
    }
    if token == app.cfg.agent_token {
        return Ok(Principal::Agent);
    }
    app.cfg
        .users
        .iter()
        .find(|u| u.token == token)
        .map(|u| Principal::User {
            name: u.name.clone(),
            queues: u.queues.clone(),
        })
        .ok_or_else(|| ApiError(StatusCode::UNAUTHORIZED, "unknown token".into()))
}

fn forbidden(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::FORBIDDEN, msg.into())
}

fn not_agent(p: &Principal) -> ApiResult<()> {
    if *p == Principal::Agent {
        return Err(forbidden("agent tokens may only report for nodes"));
    }
    Ok(())
}

/// A job as the API shows it.
#[derive(Serialize)]
pub struct JobView {
    /// The stored record.
    #[serde(flatten)]
    pub record: JobRecord,
    /// Why it waits (pending jobs).
    pub reason: Option<String>,
    /// Estimated start.
    pub estimated_start: Option<u64>,
    /// The lifecycle's Admitted phase: pending, quota admits it, it waits for
    /// GPUs (derived from the last cycle, not a stored transition).
    pub admitted: bool,
}

fn view(c: &Control<SharedStore>, rec: &JobRecord) -> JobView {
    let why = c.why.get(&rec.id);
    JobView {
        record: rec.clone(),
        reason: why.map(|w| w.render(&c.cluster, c.why_at)),
        admitted: rec.state == JobState::Pending
            && why.is_some_and(|w| !matches!(w.reason, gangway_sched::WaitReason::Quota(_))),
        estimated_start: why.and_then(|w| w.estimated_start),
    }
}

async fn submit(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<serde_json::Value>)> {
    let p = authenticate(&app, &headers)?;
    not_agent(&p)?;
    let json_body = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let spec: JobSpec = if json_body {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("job spec: {e}")))?
    } else {
        let text = std::str::from_utf8(&body)
            .map_err(|_| ApiError(StatusCode::BAD_REQUEST, "job spec: not UTF-8".into()))?;
        serde_yaml::from_str(text)
            .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("job spec: {e}")))?
    };
    let mut spec = spec;
    if let Principal::User { name, queues } = &p {
        if !queues.contains(&spec.queue) {
            return Err(forbidden(format!(
                "user {name} may not submit to queue {}",
                spec.queue
            )));
        }
        spec.user = name.clone();
    } else if spec.user.is_empty() {
        spec.user = "admin".into();
    }
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
            reply: tx,
        })
        .map_err(|_| ApiError(StatusCode::SERVICE_UNAVAILABLE, "shutting down".into()))?;
    let id = rx
        .await
        .map_err(|_| ApiError(StatusCode::SERVICE_UNAVAILABLE, "shutting down".into()))??;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "id": id, "state": "pending" })),
    ))
}

/// Filters of the job list.
#[derive(Deserialize)]
pub struct JobFilter {
    queue: Option<String>,
    state: Option<String>,
    user: Option<String>,
    /// Skip this many matching jobs.
    offset: Option<usize>,
    /// Return at most this many.
    limit: Option<usize>,
    /// Newest first.
    #[serde(default)]
    desc: bool,
}

async fn list_jobs(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Query(f): Query<JobFilter>,
) -> ApiResult<Json<Vec<JobView>>> {
    authenticate(&app, &headers)?;
    let c = lock(&app)?;
    let state = match &f.state {
        Some(s) => Some(serde_json::from_value::<JobState>(json!(s)).map_err(|_| {
            ApiError(
                StatusCode::BAD_REQUEST,
                format!("state: unknown state {s:?}"),
            )
        })?),
        None => None,
    };
    let all: Box<dyn Iterator<Item = &(JobRecord, u64)>> = if f.desc {
        Box::new(c.jobs.values().rev())
    } else {
        Box::new(c.jobs.values())
    };
    let out = all
        .map(|(r, _)| r)
        .filter(|r| f.queue.as_ref().is_none_or(|q| &r.spec.queue == q))
        .filter(|r| f.user.as_ref().is_none_or(|u| &r.user == u))
        .filter(|r| state.is_none_or(|s| r.state == s))
        .skip(f.offset.unwrap_or(0))
        .take(f.limit.unwrap_or(usize::MAX))
        .map(|r| view(&c, r))
        .collect();
    Ok(Json(out))
}

async fn get_job(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<u64>,
) -> ApiResult<Json<JobView>> {
    authenticate(&app, &headers)?;
    let c = lock(&app)?;
    let (rec, _) = c
        .jobs
        .get(&JobId(id))
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("job {id} does not exist")))?;
    Ok(Json(view(&c, rec)))
}

async fn cancel_job(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<u64>,
) -> ApiResult<Json<serde_json::Value>> {
    let p = authenticate(&app, &headers)?;
    not_agent(&p)?;
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
    c.cancel(JobId(id), p.name(), now())?;
    drop(c);
    app.wake.notify_one();
    Ok(Json(json!({ "id": id, "state": "cancelled" })))
}

async fn queues(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> ApiResult<Json<serde_json::Value>> {
    authenticate(&app, &headers)?;
    let c = lock(&app)?;
    let out: Vec<_> = c
        .cluster
        .queues()
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let u = c.cluster.queue_usage(i as u32);
            json!({
                "name": q.spec.name,
                "parent": q.spec.parent,
                "weight": q.spec.weight,
                "quota": q.spec.quota,
                "usage": u,
            })
        })
        .collect();
    Ok(Json(json!(out)))
}

async fn nodes(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> ApiResult<Json<serde_json::Value>> {
    authenticate(&app, &headers)?;
    let c = lock(&app)?;
    let out: Vec<_> = c
        .cluster
        .nodes()
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let alloc = c.cluster.capacity().alloc[i];
            json!({
                "name": n.spec.name,
                "leaf": n.spec.leaf,
                "address": n.spec.address,
                "cordoned": n.spec.cordoned,
                "cordon_reason": c.cordon_reasons.get(&n.spec.name),
                "ready": n.ready,
                "last_heartbeat": c.last_seen.get(&n.spec.name),
                "gpus": n.spec.gpus.iter().enumerate().map(|(k, g)| json!({
                    "index": g.index, "model": g.model, "memory_gib": g.memory_gib,
                    "healthy": g.healthy, "allocated": alloc & (1 << k) != 0,
                })).collect::<Vec<_>>(),
                "jobs": c.cluster.jobs_on(i as u32),
            })
        })
        .collect();
    Ok(Json(json!(out)))
}

async fn register_node(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<serde_json::Value>)> {
    let p = authenticate(&app, &headers)?;
    if !matches!(p, Principal::Admin | Principal::Agent) {
        return Err(forbidden("only agents and admins register nodes"));
    }
    let spec: NodeSpec = serde_json::from_slice(&body)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("node: {e}")))?;
    let name = spec.name.clone();
    let token = lock(&app)?.register_node(spec)?;
    app.wake.notify_one();
    Ok((
        StatusCode::CREATED,
        Json(json!({ "node": name, "node_token": token })),
    ))
}

/// An agent's report.
#[derive(Deserialize)]
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

/// Checks that the caller may act for `node`: its own node token, or the admin token.
fn node_auth(
    app: &App,
    c: &Control<SharedStore>,
    headers: &HeaderMap,
    node: &str,
) -> ApiResult<()> {
    let token = bearer(headers)?;
    let own = c.node_tokens.get(node).is_some_and(|t| t == token);
    if own || token == app.cfg.admin_token {
        return Ok(());
    }
    let known = token == app.cfg.agent_token
        || c.node_tokens.values().any(|t| t == token)
        || app.cfg.users.iter().any(|u| u.token == token);
    Err(if known {
        forbidden(format!("this token may not report for node {node}"))
    } else {
        ApiError(StatusCode::UNAUTHORIZED, "unknown token".into())
    })
}

async fn agent_report(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: Bytes,
) -> ApiResult<Json<serde_json::Value>> {
    let r: ReportBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("report: {e}")))?;
    let mut c = lock(&app)?;
    node_auth(&app, &c, &headers, &node)?;
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
    let state = c.report(&node, JobId(r.job), r.attempt, report, now())?;
    drop(c);
    app.wake.notify_one();
    Ok(Json(json!({ "job": r.job, "state": state })))
}

async fn agent_sync(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: Bytes,
) -> ApiResult<Json<SyncResponse>> {
    let req: SyncRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("sync: {e}")))?;
    let mut c = lock(&app)?;
    node_auth(&app, &c, &headers, &node)?;
    let (out, changed) = c.sync(&node, &req, now())?;
    drop(c);
    if changed {
        app.wake.notify_one();
    }
    Ok(Json(out))
}

/// Which log to read.
#[derive(Deserialize)]
pub struct LogQuery {
    /// Rank (default 0).
    rank: Option<u32>,
    /// Attempt (default: the latest that was placed).
    attempt: Option<u32>,
    /// Byte offset to start at.
    offset: Option<u64>,
}

async fn job_logs(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<u64>,
    Query(q): Query<LogQuery>,
) -> ApiResult<Json<LogChunk>> {
    authenticate(&app, &headers)?;
    let rank = q.rank.unwrap_or(0);
    let (url, token, attempt) = {
        let c = lock(&app)?;
        let (rec, _) = c
            .jobs
            .get(&JobId(id))
            .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("job {id} does not exist")))?;
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
        let url = c
            .cluster
            .node_index(node)
            .and_then(|n| c.cluster.nodes()[n as usize].spec.agent_url.clone())
            .ok_or_else(|| {
                ApiError(
                    StatusCode::NOT_FOUND,
                    format!("node {node} has no agent serving logs"),
                )
            })?;
        let token = c.node_tokens.get(node).cloned().unwrap_or_default();
        (url, token, q.attempt.unwrap_or(rec.ran_attempt))
    };
    let target = format!(
        "{}/v1/logs/{id}/{attempt}/{rank}?offset={}",
        url.trim_end_matches('/'),
        q.offset.unwrap_or(0)
    );
    let r = tokio::task::spawn_blocking(move || {
        match ureq::get(&target)
            .set("Authorization", &format!("Bearer {token}"))
            .timeout(std::time::Duration::from_secs(10))
            .call()
        {
            Ok(resp) => resp.into_json::<LogChunk>().map_err(|e| {
                ApiError(
                    StatusCode::BAD_GATEWAY,
                    format!("agent answered badly: {e}"),
                )
            }),
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

async fn gpu_health(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path((name, index, action)): Path<(String, u32, String)>,
) -> ApiResult<Json<serde_json::Value>> {
    if authenticate(&app, &headers)? != Principal::Admin {
        return Err(forbidden("only admins change GPU health"));
    }
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

async fn cordon(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path((name, action)): Path<(String, String)>,
) -> ApiResult<Json<serde_json::Value>> {
    let p = authenticate(&app, &headers)?;
    if p != Principal::Admin {
        return Err(forbidden("only admins cordon nodes"));
    }
    let on = match action.as_str() {
        "cordon" | "drain" => true,
        "uncordon" => false,
        other => {
            return Err(ApiError(
                StatusCode::NOT_FOUND,
                format!("unknown node action {other:?}"),
            ))
        }
    };
    lock(&app)?.cordon(&name, on)?;
    app.wake.notify_one();
    Ok(Json(json!({ "node": name, "cordoned": on })))
}

/// Range of the usage report (seconds since the epoch).
#[derive(Deserialize)]
pub struct UsageRange {
    from: Option<u64>,
    to: Option<u64>,
}

async fn usage(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Query(r): Query<UsageRange>,
) -> ApiResult<Json<serde_json::Value>> {
    authenticate(&app, &headers)?;
    let t = now();
    let (from, to) = (r.from.unwrap_or(0), r.to.unwrap_or(t));
    if from > to {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            "from: must not be after to".into(),
        ));
    }
    let (q, u) = lock(&app)?.usage(from, to, t);
    Ok(Json(
        json!({ "from": from, "to": to, "gpu_hours_by_queue": q, "gpu_hours_by_user": u }),
    ))
}

async fn metrics(State(app): State<Arc<App>>) -> ApiResult<Response> {
    let c = lock(&app)?;
    let text = app.metrics.render(&c);
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

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
    let body = match axum::body::to_bytes(req.into_body(), 64 << 20).await {
        Ok(b) => b,
        Err(e) => return ApiError(StatusCode::BAD_REQUEST, format!("body: {e}")).into_response(),
    };
    let answer = tokio::task::spawn_blocking(move || {
        let mut r = ureq::request(&method, &target).timeout(std::time::Duration::from_secs(30));
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
        .route("/healthz", get(|| async { "ok" }))
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
        .merge(crate::dashboard::routes())
        .route_layer(axum::middleware::from_fn_with_state(app.clone(), track))
        .layer(axum::middleware::from_fn_with_state(app.clone(), forward))
        .with_state(app)
}
