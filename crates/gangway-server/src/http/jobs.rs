//! Jobs: submission (with its group commit), listing, describing,
//! cancelling and logs.

use super::common::*;
use crate::audit::AuditTarget;
use crate::authz::{job_access, JobAccess, REDACTED};
use crate::control::{Control, ControlError};
use crate::records::JobRecord;
use crate::view::Holder;
use crate::SharedStore;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use gangway_core::agent::LogChunk;
use gangway_core::{JobId, JobSpec, JobState};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::Arc;

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

/// Bodies up to this size are parsed on the async worker: a typical spec
/// (a few hundred bytes) parses in microseconds, less than a hop to the
/// blocking pool costs (the submission path).
const INLINE_PARSE_BYTES: usize = 16 * 1024;

/// Parses a job spec (JSON or budgeted YAML); large bodies on the blocking
/// pool.
pub async fn parse_spec(body: Bytes, json_body: bool) -> ApiResult<JobSpec> {
    if body.len() <= INLINE_PARSE_BYTES {
        return parse_spec_now(&body, json_body);
    }
    tokio::task::spawn_blocking(move || parse_spec_now(&body, json_body))
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
}

fn parse_spec_now(body: &[u8], json_body: bool) -> ApiResult<JobSpec> {
    let parsed = if json_body {
        crate::spec_parse::job_spec_from_json(body)
    } else {
        let text = std::str::from_utf8(body)
            .map_err(|_| ApiError(StatusCode::BAD_REQUEST, "job spec: not UTF-8".into()))?;
        crate::spec_parse::job_spec_from_yaml(text)
    };
    parsed.map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("job spec: {e}")))
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

/// A why-pending reason, with why the job avoids nodes when that is not a
/// node fault (busy rendezvous ports).
fn with_because(w: &gangway_sched::Explanation, rec: &JobRecord, text: String) -> String {
    match (
        &w.reason,
        rec.avoid.as_ref().and_then(|a| a.because.as_deref()),
    ) {
        (gangway_sched::WaitReason::Avoiding { .. }, Some(because)) => format!("{text}; {because}"),
        _ => text,
    }
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
            .or_else(|| why.map(|w| with_because(w, rec, w.render(&v.names, v.why_at)))),
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
        (status = 201, description = "Accepted and stored", body = crate::http::jobs::Submitted),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | TOO_LARGE | UNSATISFIABLE | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn submit(
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
    let live = app.policy.config();
    let allowed = match &p {
        Principal::User { queues, .. } => Some(queues.as_slice()),
        _ => None,
    };
    if spec.queue.trim().is_empty() {
        spec.queue = crate::admission::default_queue(&live, allowed)
            .map_err(|e| ApiError(StatusCode::UNPROCESSABLE_ENTITY, e))?;
    }
    if let Principal::User { name, queues } = &p {
        if !queues.contains(&spec.queue) {
            return Err(forbidden(format!(
                "queue: user {name} may not submit to queue {}; {}",
                spec.queue.chars().take(253).collect::<String>(),
                crate::admission::queue_hint(&live, allowed)
            )));
        }
        spec.user = name.clone();
    } else if spec.user.is_empty() {
        spec.user = "admin".into();
    }
    if !live.queues.iter().any(|q| q.name == spec.queue) {
        return Err(ApiError(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "queue: unknown queue {:?}; {}",
                spec.queue.chars().take(253).collect::<String>(),
                crate::admission::queue_hint(&live, allowed)
            ),
        ));
    }
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
    params(crate::http::listing::JobQuery),
    responses(
        (status = 200, description = "One page of jobs", body = Vec<JobView>,
            headers(("X-Next-Cursor" = String, description = "Cursor of the next page (absent on the last)"),
                    ("Link" = String, description = "URL of the next page, rel=next"))),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn list_jobs(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    axum::extract::RawQuery(raw): axum::extract::RawQuery,
    Query(q): Query<crate::http::listing::JobQuery>,
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
        let link = crate::http::listing::next_link(raw.as_deref().unwrap_or(""), &n);
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
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn get_job(
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
    summary = "Cancel a job, or every task of an array by its id (owner or admin)",
    params(("id" = u64, Path, description = "Job id"), crate::http::workflow::TaskQuery),
    responses(
        (status = 200, description = "Cancelled (running ranks get their checkpoint signal)", body = crate::http::jobs::Cancelled),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | CONFLICT | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn cancel_job(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(id): Path<u64>,
    Query(t): Query<crate::http::workflow::TaskQuery>,
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
    // An array's id cancels all of its tasks (`?task=true`: only the first).
    let tasks = c.cancel_in(JobId(id), t.scope(), &p.name(), now())?;
    drop(c);
    app.wake.notify_one();
    Ok(Json(
        json!({ "id": id, "state": "cancelled", "jobs": tasks }),
    ))
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
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | RATE_LIMITED | INTERNAL | AGENT_FAILED | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn job_logs(
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

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::{JobId, JobSpec};
    use gangway_sched::{Explanation, WaitReason};

    #[test]
    fn a_job_avoiding_a_node_for_busy_ports_says_which_in_its_reason() {
        let mut rec = JobRecord::submitted(JobId(1), "alice", JobSpec::new("j", "q", 1, 1), 10);
        let avoiding = Explanation {
            job: JobId(1),
            reason: WaitReason::Avoiding {
                nodes: Vec::new(),
                until: 100,
            },
            estimated_start: None,
        };
        assert_eq!(
            with_because(&avoiding, &rec, "avoiding node n".into()),
            "avoiding node n"
        );
        rec.avoid = Some(crate::records::AvoidNodes {
            nodes: vec!["n".into()],
            until: 100,
            because: Some(
                "its rendezvous ports 29400, 29401 there were held by other processes".into(),
            ),
        });
        assert_eq!(
            with_because(&avoiding, &rec, "avoiding node n".into()),
            "avoiding node n; its rendezvous ports 29400, 29401 there were held by other processes"
        );
        let other = Explanation {
            reason: WaitReason::InOrder { behind: JobId(0) },
            ..avoiding
        };
        assert_eq!(with_because(&other, &rec, "in order".into()), "in order");
    }
}
