//! The web dashboard at `/`: one page of plain HTML, CSS and JavaScript
//! (no build step) that reads the same API as the CLI with the user's bearer
//! token, refreshing every two seconds. This module also holds the API views
//! only the dashboard needs: the cluster grid, the queue history and `whoami`.

pub mod samples;

use super::common::*;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use gangway_core::{JobId, Time};
pub use samples::{QueueHistory, HISTORY_EVERY, HISTORY_SAMPLES};
use serde::Serialize;
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// The page (served as is; everything else it needs comes from the API).
const PAGE: &str = include_str!("page.html");

/// `GET /v1/whoami`.
#[derive(Serialize, utoipa::ToSchema)]
pub struct WhoAmI {
    /// The token's principal (user name, `admin`...).
    pub name: String,
    /// Whether it is the admin token.
    pub admin: bool,
    /// The queues the token may submit to (every queue for admins): what
    /// `gangway run` picks its default queue from when there is one.
    pub queues: Vec<String>,
}

/// One node in the cluster grid: its GPUs' states as one letter each
/// (`f` free, `a` allocated, `u` unhealthy, `c` cordoned or NotReady, `m`
/// MIG enabled, never assigned whole) and the job holding each (0: none) —
/// compact, so 10,000 nodes stay a small answer. `reasons` says why each
/// unhealthy GPU is (by position), only where one is.
#[derive(Serialize)]
struct NodeCell {
    name: String,
    ready: bool,
    cordoned: bool,
    gpus: String,
    owners: Vec<u64>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    reasons: BTreeMap<usize, String>,
}

#[derive(Serialize)]
struct Rack {
    leaf: String,
    nodes: Vec<NodeCell>,
}

#[derive(Serialize)]
struct Totals {
    gpus: u64,
    allocated: u64,
    free: u64,
    unhealthy: u64,
    fragmented: u64,
}

/// The whole grid; `jobs` maps each job holding GPUs to its queue and user.
#[derive(Serialize)]
struct ClusterView {
    totals: Totals,
    jobs: BTreeMap<u64, (String, String)>,
    racks: Vec<Rack>,
}

/// Standard base64 (the CSP hash source needs it; nothing else here does).
fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The page's Content-Security-Policy: only its own inline script (by
/// hash), its inline styles, and API calls to this server; no framing.
pub fn page_csp() -> String {
    use sha2::Digest;
    let script = PAGE
        .split_once("<script>")
        .and_then(|(_, rest)| rest.split_once("</script>"))
        .map_or("", |(s, _)| s);
    let hash = base64(&sha2::Sha256::digest(script.as_bytes()));
    format!(
        "default-src 'none'; script-src 'sha256-{hash}'; style-src 'unsafe-inline'; \
         img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; \
         frame-ancestors 'none'"
    )
}

#[utoipa::path(
    get, path = "/", tag = "dashboard",
    summary = "The dashboard (one HTML page; it signs in with a token)",
    responses((status = 200, description = "The page", body = String, content_type = "text/html"))
)]
async fn page() -> Response {
    let csp = header::HeaderValue::from_str(&page_csp())
        .unwrap_or_else(|_| header::HeaderValue::from_static("frame-ancestors 'none'"));
    (
        [
            (
                header::CACHE_CONTROL,
                header::HeaderValue::from_static("no-cache"),
            ),
            (header::CONTENT_SECURITY_POLICY, csp),
        ],
        Html(PAGE),
    )
        .into_response()
}

#[utoipa::path(
    get, path = "/v1/whoami", tag = "dashboard",
    summary = "Who the token belongs to",
    responses((status = 200, description = "name and admin", body = crate::http::dashboard::WhoAmI),
        Errors<{ UNAUTHENTICATED | FORBIDDEN_CLUSTER_READ | REQUEST_RATE | INTERNAL_READ | NO_LEADER }>),
    security(("bearer" = []))
)]
async fn whoami(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiError> {
    let p = crate::http::common::authenticate_person(&app, &headers)?;
    let queues: Vec<String> = match &p {
        crate::http::common::Principal::User { queues, .. } => queues.clone(),
        _ => app
            .control
            .view()
            .cluster
            .queues
            .iter()
            .map(|q| q.spec.name.clone())
            .collect(),
    };
    Ok(Json(json!({
        "name": p.name(),
        "admin": p == crate::http::common::Principal::Admin,
        "queues": queues,
    })))
}

/// Racks → nodes → GPUs with their state and job, and the totals.
#[utoipa::path(
    get, path = "/v1/cluster", tag = "dashboard",
    summary = "Racks, nodes and GPUs with their state and job, and the totals",
    responses((status = 200, description = "The cluster grid", body = Object),
        Errors<{ UNAUTHENTICATED | FORBIDDEN_CLUSTER_READ | REQUEST_RATE | INTERNAL_READ | NO_LEADER }>),
    security(("bearer" = []))
)]
async fn cluster(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> Result<Json<ClusterView>, ApiError> {
    crate::http::common::authenticate_person(&app, &headers)?;
    // The read view: the nodes' snapshot and the job records (for each GPU's
    // job, its queue and user). No state lock.
    let v = app.control.view();
    let mut racks: BTreeMap<&str, Vec<NodeCell>> = BTreeMap::new();
    let mut jobs = BTreeMap::new();
    let mut t = Totals {
        gpus: 0,
        allocated: 0,
        free: 0,
        unhealthy: 0,
        fragmented: 0,
    };
    for n in &v.cluster.nodes {
        let mut owner: HashMap<u32, JobId> = HashMap::new();
        for id in &n.jobs {
            if let Some(rec) = v.job(*id) {
                jobs.entry(id.0)
                    .or_insert_with(|| (rec.spec.queue.clone(), rec.user.clone()));
                for r in rec.placement.iter().filter(|r| r.node == n.spec.name) {
                    for g in &r.gpus {
                        owner.insert(*g, *id);
                    }
                }
            }
        }
        let unavailable = n.spec.cordoned || !n.ready;
        let (mut states, mut owners) = (String::with_capacity(8), Vec::with_capacity(8));
        let (mut free_here, mut healthy) = (0u64, 0u64);
        let mut reasons = BTreeMap::new();
        for (k, g) in n.spec.gpus.iter().enumerate() {
            if let (false, Some(r)) = (g.healthy, &g.reason) {
                reasons.insert(k, r.clone());
            }
            t.gpus += 1;
            healthy += u64::from(g.healthy);
            let o = owner.get(&g.index);
            let state = match (o, g.healthy, unavailable) {
                (Some(_), _, _) => {
                    t.allocated += 1;
                    'a'
                }
                (None, false, _) => {
                    t.unhealthy += 1;
                    'u'
                }
                (None, true, true) => 'c',
                (None, true, false) if g.mig => 'm',
                (None, true, false) => {
                    free_here += 1;
                    'f'
                }
            };
            states.push(state);
            owners.push(o.map_or(0, |j| j.0));
        }
        // Free GPUs on a node that is partly in use cannot serve a whole-node gang.
        if free_here > 0 && free_here < healthy {
            t.fragmented += free_here;
        }
        racks.entry(&n.spec.leaf).or_default().push(NodeCell {
            name: n.spec.name.clone(),
            ready: n.ready,
            cordoned: n.spec.cordoned,
            gpus: states,
            owners,
            reasons,
        });
    }
    t.free = t.gpus - t.allocated - t.unhealthy;
    let racks = racks
        .into_iter()
        .map(|(leaf, nodes)| Rack {
            leaf: leaf.to_string(),
            nodes,
        })
        .collect();
    Ok(Json(ClusterView {
        totals: t,
        jobs,
        racks,
    }))
}

/// Each queue's usage, quota and fair-share rank, and its GPU usage over the
/// last hours.
#[utoipa::path(
    get, path = "/v1/queues/history", tag = "dashboard",
    summary = "Queue usage over the last hours (the dashboard's chart)",
    responses((status = 200, description = "Samples per queue", body = Object),
        Errors<{ UNAUTHENTICATED | FORBIDDEN_CLUSTER_READ | REQUEST_RATE | INTERNAL_READ | NO_LEADER }>),
    security(("bearer" = []))
)]
async fn queue_history(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiError> {
    crate::http::common::authenticate_person(&app, &headers)?;
    let names: Vec<String> = (app.control.view().cluster.queues.iter())
        .map(|q| q.spec.name.clone())
        .collect();
    let h = app
        .history
        .lock()
        .map_err(|_| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "history lock poisoned"))?;
    let samples: Vec<_> = h
        .samples
        .iter()
        .map(|(t, u)| json!({ "at": t, "gpus": u }))
        .collect();
    Ok(Json(
        json!({ "queues": names, "every_seconds": HISTORY_EVERY, "samples": samples }),
    ))
}

/// Records the queues' usage (called by the scheduler loop after a cycle,
/// whose release of the state lock published the usage it left).
pub fn record(app: &App, now: Time) {
    let usage: Vec<u64> = (app.control.view().cluster.queues.iter())
        .map(|q| q.usage.gpus)
        .collect();
    if let Ok(mut h) = app.history.lock() {
        h.sample(now, usage);
    }
}

/// The dashboard's routes.
pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route("/", get(page))
        .route("/v1/whoami", get(whoami))
        .route("/v1/cluster", get(cluster))
        .route("/v1/queues/history", get(queue_history))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert!(page_csp().contains("script-src 'sha256-"));
    }

    /// The page's `UNSAFE` class, as `gangway_core::text::is_unsafe` has it.
    fn unsafe_class() -> String {
        let mut class = String::new();
        let mut run: Option<(u32, u32)> = None;
        let flush = |r: (u32, u32), class: &mut String| {
            class.push_str(&format!("\\u{:04x}", r.0));
            if r.1 != r.0 {
                class.push_str(&format!("-\\u{:04x}", r.1));
            }
        };
        for n in 0..=0xffffu32 {
            let bad = char::from_u32(n).is_some_and(gangway_core::text::is_unsafe);
            run = match (run, bad) {
                (Some((a, b)), true) if b + 1 == n => Some((a, n)),
                (Some(r), true) => {
                    flush(r, &mut class);
                    Some((n, n))
                }
                (None, true) => Some((n, n)),
                (Some(r), false) => {
                    flush(r, &mut class);
                    None
                }
                (None, false) => None,
            };
        }
        if let Some(r) = run {
            flush(r, &mut class);
        }
        class
    }

    /// The page escapes what it puts into HTML (`esc`) and first shows every
    /// character the CLI escapes the way the CLI does: the same class of
    /// characters, and (where node.js is installed to run the page's
    /// functions) the same text.
    #[test]
    fn the_page_escapes_control_characters_as_the_cli_does() {
        let class = unsafe_class();
        let decl = format!("const UNSAFE = /[{class}]/g;");
        assert!(PAGE.contains(&decl), "page.html lacks {decl}");
        // No user string reaches innerHTML but through esc (spot checks).
        for must in ["${esc(j.spec.name)}", "${esc(e.message)}", "${esc(j.user)}"] {
            assert!(PAGE.contains(must), "{must}");
        }
        let node = std::path::Path::new("/usr/bin/node");
        if !node.exists() {
            return;
        }
        let start = PAGE.find("const UNSAFE").expect("UNSAFE");
        let end = start + PAGE[start..].find("const esc").expect("esc");
        let end = end + PAGE[end..].find('\n').expect("line");
        let input = "job\u{1b}]52;c;SGk=\u{7}\r\n<b>&\u{9b}\u{202e}\u{2066}\t\u{7f}x";
        let script = format!(
            "{}\nprocess.stdout.write(esc({}));",
            &PAGE[start..end],
            serde_json::to_string(input).expect("json")
        );
        let out = std::process::Command::new(node)
            .args(["-e", &script])
            .output()
            .expect("node");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let want = gangway_core::text::printable(input)
            .replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;");
        assert_eq!(String::from_utf8_lossy(&out.stdout), want);
    }

    #[test]
    fn history_keeps_one_sample_per_period_and_six_hours() {
        let mut h = QueueHistory::default();
        h.sample(0, vec![1]);
        h.sample(10, vec![2]);
        assert_eq!(h.samples.len(), 1, "one sample per 30 s");
        for i in 1..=(HISTORY_SAMPLES as u64 + 5) {
            h.sample(i * HISTORY_EVERY, vec![i]);
        }
        assert_eq!(h.samples.len(), HISTORY_SAMPLES);
        assert_eq!(h.samples.front().map(|s| s.1[0]), Some(6), "oldest dropped");
    }
}
