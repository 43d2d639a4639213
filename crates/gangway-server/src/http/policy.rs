//! The policy API: people (admin and users) read the policy and its
//! decision log; only admins run a what-if, apply or roll back.
//!
//! - `GET  /v1/policy` — the version in force
//! - `GET  /v1/policy/versions/{n}` — one version
//! - `GET  /v1/policy/diff?a=N&b=M` — what changed from A to B
//! - `GET  /v1/policy/log` — every version with who, when, why, the diff,
//!   the evidence, the gates and the live figures after it
//! - `POST /v1/policy/what-if` — `{policy, since_seconds}`: the replay table
//! - `POST /v1/policy/apply` — `{policy, reason, force, since_seconds}`
//! - `POST /v1/policy/rollback` — `{version, reason}`
//!
//! `policy` is the policy file's text (YAML or JSON), parsed with the
//! configuration's budgets on the blocking pool.

use super::common::*;
use crate::history::HistoryEntry;
use crate::policy::whatif::{self, WhatIf};
use crate::policy::{Action, GateResult, Policy, PolicyError, PolicyVersion, MAX_REASON_BYTES};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use gangway_core::{NodeSpec, Time};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

type ApiResult<T> = Result<T, ApiError>;

/// Longest history window a what-if may ask for (366 days).
pub const MAX_SINCE_SECONDS: u64 = 366 * 86_400;
/// The what-if's window when none is given (14 days).
pub const DEFAULT_SINCE_SECONDS: u64 = 14 * 86_400;

impl From<PolicyError> for ApiError {
    fn from(e: PolicyError) -> Self {
        let e = match e {
            PolicyError::Control(c) => return ApiError::from(c),
            other => other,
        };
        let code = match &e {
            PolicyError::Parse(_) => StatusCode::BAD_REQUEST,
            PolicyError::Invalid(_) => StatusCode::UNPROCESSABLE_ENTITY,
            PolicyError::NoSuchVersion(_) => StatusCode::NOT_FOUND,
            PolicyError::GateFailed(_) | PolicyError::Conflict(_) => StatusCode::CONFLICT,
            PolicyError::Control(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(code, e.to_string())
    }
}

/// The routes (merged into [`crate::http::router`]).
pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route("/v1/policy", get(show_current))
        .route("/v1/policy/versions/{n}", get(show_version))
        .route("/v1/policy/diff", get(diff))
        .route("/v1/policy/log", get(log))
        .route("/v1/policy/what-if", post(what_if))
        .route("/v1/policy/apply", post(apply))
        .route("/v1/policy/rollback", post(rollback))
        .route("/v1/policy/promote", post(promote))
        .route("/v1/policy/pilot", get(pilot_status))
}

fn bad(field: &str, msg: &str) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, format!("{field}: {msg}"))
}

#[utoipa::path(
    get, path = "/v1/policy", tag = "policy",
    summary = "The scheduling policy in force, with its version",
    responses(
        (status = 200, description = "The current version", body = Object),
        Errors<{ UNAUTHENTICATED | FORBIDDEN | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn show_current(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> ApiResult<Json<PolicyVersion>> {
    authenticate_person(&app, &headers)?;
    // Stored versions are read from the store: no state lock.
    let v = crate::policy::current(&app.store)?
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "no policy version stored yet"))?;
    Ok(Json(v))
}

#[utoipa::path(
    get, path = "/v1/policy/versions/{n}", tag = "policy",
    summary = "One policy version with its decision record",
    params(("n" = u64, Path, description = "Version number")),
    responses(
        (status = 200, description = "The version", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn show_version(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Path(n): Path<String>,
) -> ApiResult<Json<PolicyVersion>> {
    authenticate_person(&app, &headers)?;
    let n: u64 = n
        .parse()
        .map_err(|_| bad("version", "must be a positive whole number"))?;
    Ok(Json(crate::policy::load_version(&app.store, n)?))
}

/// `?a=N&b=M`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
/// `?a=&b=`: the two versions to compare.
pub struct DiffQuery {
    /// First version.
    a: u64,
    /// Second version.
    b: u64,
}

#[utoipa::path(
    get, path = "/v1/policy/diff", tag = "policy",
    summary = "What changed between two policy versions",
    params(("a" = u64, Query, description = "First version"), ("b" = u64, Query, description = "Second version")),
    responses(
        (status = 200, description = "The differences", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn diff(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Query(q): Query<DiffQuery>,
) -> ApiResult<Json<Vec<String>>> {
    authenticate_person(&app, &headers)?;
    let a = crate::policy::load_version(&app.store, q.a)?;
    let b = crate::policy::load_version(&app.store, q.b)?;
    Ok(Json(crate::policy::diff(&a.policy, &b.policy)))
}

#[utoipa::path(
    get, path = "/v1/policy/log", tag = "policy",
    summary = "The decision log: every version with who, when, why, diff, evidence, gates and the day after",
    responses(
        (status = 200, description = "Every version, newest first", body = Object),
        Errors<{ UNAUTHENTICATED | FORBIDDEN | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn log(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> ApiResult<Json<Vec<PolicyVersion>>> {
    authenticate_person(&app, &headers)?;
    let t = now();
    let app2 = app.clone();
    blocking(move || {
        // The store and the read view's jobs: no state lock.
        let mut all = crate::policy::all_versions(&app2.store)?;
        let view = app2.control.view();
        // Days still running: their figures so far.
        for v in &mut all {
            if v.after.as_ref().is_none_or(|a| !a.complete) && v.at <= t {
                let end = v.at.saturating_add(crate::policy::AFTER_SECONDS).min(t);
                v.after = Some(crate::policy::live_figures_of(&view.jobs, v.at, end));
            }
        }
        Ok(Json(all))
    })
    .await
}

/// Body of `POST /v1/policy/what-if`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WhatIfRequest {
    /// The candidate policy file's text.
    pub policy: String,
    /// Replay the jobs submitted in the last this many seconds (default 14 days).
    #[serde(default)]
    pub since_seconds: Option<u64>,
}

/// Body of `POST /v1/policy/apply`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplyRequest {
    /// The candidate policy file's text.
    pub policy: String,
    /// Why (required; the decision log keeps it).
    pub reason: String,
    /// Apply even if a gate fails.
    #[serde(default)]
    pub force: bool,
    /// The what-if's history window, seconds (default 14 days).
    #[serde(default)]
    pub since_seconds: Option<u64>,
    /// Pilot: apply the candidate to these queues only.
    #[serde(default)]
    pub pilot: Option<Vec<String>>,
}

/// Body of `POST /v1/policy/promote`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromoteRequest {
    /// Why (required).
    pub reason: String,
    /// Promote even if a gate fails.
    #[serde(default)]
    pub force: bool,
    /// The what-if's history window, seconds (default 14 days).
    #[serde(default)]
    pub since_seconds: Option<u64>,
}

/// Body of `POST /v1/policy/rollback`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollbackRequest {
    /// The version to restore (default: the one before the version in force).
    #[serde(default)]
    pub version: Option<u64>,
    /// Why (required).
    pub reason: String,
}

/// Answer of a what-if.
#[derive(Serialize)]
pub struct WhatIfAnswer {
    /// The figures (absent when there is no history to replay).
    pub what_if: Option<WhatIf>,
    /// The gates of the version in force, judged on them.
    pub gates: Vec<GateResult>,
    /// The table and gate lines, for people.
    pub table: String,
    /// What would change.
    pub diff: Vec<String>,
}

fn json_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> ApiResult<T> {
    serde_json::from_slice(body).map_err(|e| bad("body", &e.to_string()))
}

fn check_reason(reason: &str) -> ApiResult<()> {
    if reason.trim().is_empty() {
        return Err(bad(
            "reason",
            "required: say why (the decision log keeps it)",
        ));
    }
    if reason.len() > MAX_REASON_BYTES {
        return Err(bad("reason", &format!("at most {MAX_REASON_BYTES} bytes")));
    }
    Ok(())
}

fn since_of(s: Option<u64>) -> ApiResult<u64> {
    let s = s.unwrap_or(DEFAULT_SINCE_SECONDS);
    if s == 0 || s > MAX_SINCE_SECONDS {
        return Err(bad(
            "since_seconds",
            &format!("must be between 1 and {MAX_SINCE_SECONDS}"),
        ));
    }
    Ok(s)
}

/// What a what-if needs, read from the read view (no state lock).
struct Snapshot {
    current: PolicyVersion,
    entries: Vec<HistoryEntry>,
    nodes: Vec<NodeSpec>,
}

fn snapshot(app: &App, candidate: &Policy, t: Time) -> ApiResult<Snapshot> {
    let view = app.control.view();
    crate::policy::check_view(candidate, &app.cfg, &view)?;
    let current = crate::policy::current(&app.store)?
        .ok_or_else(|| ApiError::new(StatusCode::CONFLICT, "no policy version stored yet"))?;
    let entries = view
        .jobs
        .values()
        .filter(|(r, _)| r.state.is_terminal())
        .map(|(r, _)| HistoryEntry::from_record(r, t))
        .collect();
    let nodes = view.cluster.nodes.iter().map(|n| n.spec.clone()).collect();
    Ok(Snapshot {
        current,
        entries,
        nodes,
    })
}

/// Runs the what-if of `candidate` against the version in force, off the
/// state lock, and judges it by the version in force's gates.
fn evaluate(app: &App, candidate: &Policy, since: u64) -> ApiResult<(PolicyVersion, WhatIfAnswer)> {
    let t = now();
    let snap = snapshot(app, candidate, t)?;
    let diff = crate::policy::diff(&snap.current.policy, candidate);
    let (what_if, gates, mut table) = if snap.nodes.is_empty() {
        (
            None,
            Vec::new(),
            "what-if: no nodes yet; gates not evaluated\n".to_string(),
        )
    } else {
        let w = whatif::run(
            &snap.entries,
            t.saturating_sub(since),
            &snap.nodes,
            &snap.current.policy,
            candidate,
        )?;
        if w.jobs == 0 {
            (
                None,
                Vec::new(),
                "what-if: no finished jobs in the window to replay; gates not evaluated\n"
                    .to_string(),
            )
        } else {
            let g = whatif::judge(&snap.current.policy.gates, &w);
            let t = whatif::table(&w);
            (Some(w), g, t)
        }
    };
    table.push_str(&whatif::gate_lines(&gates));
    Ok((
        snap.current,
        WhatIfAnswer {
            what_if,
            gates,
            table,
            diff,
        },
    ))
}

async fn parse_policy(text: String) -> ApiResult<Policy> {
    blocking(move || Ok(Policy::from_yaml(&text)?)).await
}

#[utoipa::path(
    post, path = "/v1/policy/what-if", tag = "policy",
    summary = "Replay this cluster's history under the current and a candidate policy (admin)",
    request_body(content = Object, content_type = "application/json", description = "{policy, since_seconds}"),
    responses(
        (status = 200, description = "The what-if table and gate results", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | TOO_LARGE | UNSATISFIABLE | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn what_if(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> ApiResult<Json<WhatIfAnswer>> {
    authenticate_admin(&app, &headers, "run a policy what-if")?;
    let req: WhatIfRequest = json_body(&crate::http::common::read_body(&app, body).await?)?;
    let since = since_of(req.since_seconds)?;
    let candidate = parse_policy(req.policy).await?;
    let app2 = app.clone();
    blocking(move || evaluate(&app2, &candidate, since).map(|(_, a)| Json(a))).await
}

/// Installs `v` (already checked) and stores it as the next version after
/// `base`; on a store failure the previous policy goes back in.
fn install_and_commit(app: &App, v: &PolicyVersion, base: &PolicyVersion) -> ApiResult<()> {
    let mut c = lock(app)?;
    crate::policy::check(&v.policy, &app.cfg, &c)?;
    let now_cur = crate::policy::current_number(&c.store)?;
    if now_cur.map(|(n, _)| n) != Some(base.version) {
        return Err(PolicyError::Conflict(now_cur.map_or(0, |(n, _)| n)).into());
    }
    crate::policy::install(&mut c, &v.policy)?;
    if let Err(e) = crate::policy::commit(&c.store, v, now_cur) {
        if let Err(back) = crate::policy::install(&mut c, &base.policy) {
            tracing::error!("policy: cannot put version {} back: {back}", base.version);
        }
        return Err(e.into());
    }
    drop(c);
    app.policy.set(&v.policy);
    app.wake.notify_one();
    tracing::warn!(
        "policy version {} in force ({:?} by {}): {}",
        v.version,
        v.action,
        v.author,
        v.reason
    );
    Ok(())
}

/// A change to propose: the policy to put in force and what makes it.
struct Proposal {
    policy: Policy,
    action: Action,
    reason: String,
    force: bool,
    since: u64,
    author: String,
}

/// Runs the what-if of the proposal against the version in force, refuses
/// it when a gate fails (unless forced), else installs and stores it.
fn propose(app: &App, p: Proposal) -> ApiResult<PolicyVersion> {
    let (base, answer) = evaluate(app, &p.policy, p.since)?;
    if answer.diff.is_empty() && p.action == Action::Apply {
        return Err(PolicyError::Invalid(format!(
            "the candidate is the policy in force (version {}); nothing to apply",
            base.version
        ))
        .into());
    }
    if let Action::Promote { pilot } = &p.action {
        if base.version != *pilot {
            return Err(PolicyError::Conflict(base.version).into());
        }
    }
    let failed = answer.gates.iter().any(|g| !g.passed);
    if failed && !p.force {
        return Err(PolicyError::GateFailed(answer.table).into());
    }
    let v = PolicyVersion {
        version: base.version + 1,
        policy: p.policy,
        author: p.author,
        at: now(),
        reason: p.reason,
        action: p.action,
        previous: Some(base.version),
        diff: answer.diff,
        evidence: answer.what_if,
        gates: answer.gates,
        forced: failed,
        after: None,
    };
    install_and_commit(app, &v, &base)?;
    Ok(v)
}

#[utoipa::path(
    post, path = "/v1/policy/apply", tag = "policy",
    summary = "Apply a candidate policy after its what-if and gates (admin; --force with a reason overrides a failed gate)",
    request_body(content = Object, content_type = "application/json", description = "{policy, reason, force, since_seconds, pilot}"),
    responses(
        (status = 200, description = "The new version", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | CONFLICT | TOO_LARGE | UNSATISFIABLE | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn apply(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> ApiResult<(StatusCode, Json<PolicyVersion>)> {
    let who = authenticate_admin(&app, &headers, "change the scheduling policy")?;
    let req: ApplyRequest = json_body(&crate::http::common::read_body(&app, body).await?)?;
    check_reason(&req.reason)?;
    let since = since_of(req.since_seconds)?;
    let candidate = parse_policy(req.policy).await?;
    let app2 = app.clone();
    let v = blocking(move || {
        let (policy, action) = match req.pilot {
            None => (candidate, Action::Apply),
            Some(queues) => {
                let base = {
                    let c = lock(&app2)?;
                    crate::policy::check(&candidate, &app2.cfg, &c)?;
                    crate::policy::current(&c.store)?.ok_or_else(|| {
                        ApiError::new(StatusCode::CONFLICT, "no policy version stored yet")
                    })?
                };
                let eff = crate::policy::pilot_policy(&base.policy, &candidate, &queues)?;
                (
                    eff,
                    Action::Pilot {
                        queues,
                        candidate: Box::new(candidate),
                    },
                )
            }
        };
        propose(
            &app2,
            Proposal {
                policy,
                action,
                reason: req.reason,
                force: req.force,
                since,
                author: who.name(),
            },
        )
    })
    .await?;
    Ok((StatusCode::CREATED, Json(v)))
}

#[utoipa::path(
    post, path = "/v1/policy/promote", tag = "policy",
    summary = "End a pilot by applying its candidate to every queue (admin)",
    request_body(content = Object, content_type = "application/json", description = "{reason, force, since_seconds}"),
    responses(
        (status = 200, description = "The new version", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | CONFLICT | TOO_LARGE | UNSATISFIABLE | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn promote(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> ApiResult<(StatusCode, Json<PolicyVersion>)> {
    let who = authenticate_admin(&app, &headers, "promote a policy pilot")?;
    let req: PromoteRequest = json_body(&crate::http::common::read_body(&app, body).await?)?;
    check_reason(&req.reason)?;
    let since = since_of(req.since_seconds)?;
    let app2 = app.clone();
    let v = blocking(move || {
        let base = {
            let c = lock(&app2)?;
            crate::policy::current(&c.store)?.ok_or_else(|| {
                ApiError::new(StatusCode::CONFLICT, "no policy version stored yet")
            })?
        };
        let Action::Pilot { candidate, .. } = base.action else {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!(
                    "version {} is not a pilot: nothing to promote",
                    base.version
                ),
            ));
        };
        propose(
            &app2,
            Proposal {
                policy: *candidate,
                action: Action::Promote {
                    pilot: base.version,
                },
                reason: req.reason,
                force: req.force,
                since,
                author: who.name(),
            },
        )
    })
    .await?;
    Ok((StatusCode::CREATED, Json(v)))
}

/// A pilot's live figures against its prediction and the other queues.
#[derive(Serialize)]
pub struct PilotStatus {
    /// The pilot version.
    pub version: u64,
    /// Its queues.
    pub queues: Vec<String>,
    /// Since when.
    pub since: Time,
    /// Live figures of jobs started since, pilot queues together.
    pub pilot: crate::policy::LiveFigures,
    /// Live figures of jobs started since in every other queue.
    pub others: crate::policy::LiveFigures,
    /// Per queue (all queues), live.
    pub live: std::collections::BTreeMap<String, crate::policy::LiveFigures>,
    /// The what-if's prediction for the pilot queues (candidate side).
    pub predicted: std::collections::BTreeMap<String, whatif::Figures>,
}

#[utoipa::path(
    get, path = "/v1/policy/pilot", tag = "policy",
    summary = "The running pilot: its queues' live figures against the prediction and the other queues",
    responses(
        (status = 200, description = "The pilot, or none", body = Object),
        Errors<{ UNAUTHENTICATED | FORBIDDEN | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn pilot_status(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> ApiResult<Json<PilotStatus>> {
    authenticate_person(&app, &headers)?;
    let t = now();
    let app2 = app.clone();
    blocking(move || {
        // The store and the read view's jobs: no state lock.
        let view = app2.control.view();
        let v = crate::policy::current(&app2.store)?
            .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "no policy version stored yet"))?;
        let Action::Pilot { queues, .. } = &v.action else {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("version {} is not a pilot", v.version),
            ));
        };
        let live = crate::policy::live_figures_of(&view.jobs, v.at, t.saturating_add(1));
        let (mut pw, mut ow) = (Vec::new(), Vec::new());
        for (r, _) in view.jobs.values() {
            let Some(s) = r
                .events
                .iter()
                .find(|e| e.kind == "scheduled")
                .map(|e| e.at)
            else {
                continue;
            };
            if s < v.at {
                continue;
            }
            let w = s.saturating_sub(r.submitted_at) as f64;
            if queues.contains(&r.spec.queue) {
                pw.push(w);
            } else {
                ow.push(w);
            }
        }
        let fig = |v: &mut Vec<f64>| {
            let s = gangway_sim_engine::metrics::Stats::of(v);
            crate::policy::LiveFigures {
                jobs: s.n,
                avg_wait: s.mean,
                p95_wait: s.p95,
            }
        };
        let predicted = v
            .evidence
            .as_ref()
            .map(|w| {
                w.candidate
                    .queues
                    .iter()
                    .filter(|(q, _)| queues.contains(q))
                    .map(|(q, f)| (q.clone(), f.clone()))
                    .collect()
            })
            .unwrap_or_default();
        Ok(Json(PilotStatus {
            version: v.version,
            queues: queues.clone(),
            since: v.at,
            pilot: fig(&mut pw),
            others: fig(&mut ow),
            live: live.queues,
            predicted,
        }))
    })
    .await
}

#[utoipa::path(
    post, path = "/v1/policy/rollback", tag = "policy",
    summary = "Go back to an earlier policy version (admin)",
    request_body(content = Object, content_type = "application/json", description = "{version, reason}"),
    responses(
        (status = 200, description = "The new version", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | NOT_FOUND | CONFLICT | TOO_LARGE | UNSATISFIABLE | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn rollback(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> ApiResult<(StatusCode, Json<PolicyVersion>)> {
    let p = authenticate_admin(&app, &headers, "roll back the scheduling policy")?;
    let req: RollbackRequest = json_body(&crate::http::common::read_body(&app, body).await?)?;
    check_reason(&req.reason)?;
    let app2 = app.clone();
    let v = blocking(move || {
        let (base, target) = {
            let c = lock(&app2)?;
            let base = crate::policy::current(&c.store)?.ok_or_else(|| {
                ApiError::new(StatusCode::CONFLICT, "no policy version stored yet")
            })?;
            let to = match req.version {
                Some(n) => n,
                None => base.previous.ok_or_else(|| {
                    ApiError::new(
                        StatusCode::CONFLICT,
                        format!(
                            "version {} is the first: nothing to roll back to",
                            base.version
                        ),
                    )
                })?,
            };
            if to == base.version {
                return Err(bad("version", &format!("{to} is already in force")));
            }
            (base, crate::policy::load_version(&c.store, to)?)
        };
        let v = PolicyVersion {
            version: base.version + 1,
            policy: target.policy.clone(),
            author: p.name(),
            at: now(),
            reason: req.reason,
            action: Action::Rollback { to: target.version },
            previous: Some(base.version),
            diff: crate::policy::diff(&base.policy, &target.policy),
            evidence: None,
            gates: Vec::new(),
            forced: false,
            after: None,
        };
        install_and_commit(&app2, &v, &base)?;
        Ok(v)
    })
    .await?;
    Ok((StatusCode::CREATED, Json(v)))
}
