//! `GET /v1/history`: the HTTP half of [`crate::history`] (the rows and
//! their query live there, free of HTTP).

use super::common::*;
use crate::history::{page, HistoryFilter, HistoryPage, HistoryQuery, DEFAULT_PAGE, MAX_PAGE};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use gangway_core::JobState;
use std::sync::Arc;

/// The final states `state` names, or which name is not one (400).
fn final_states(list: &str) -> Result<Vec<JobState>, ApiError> {
    list.split(',')
        .map(|s| {
            let st: JobState = serde_json::from_value(serde_json::json!(s.trim()))
                .ok()
                .filter(|st: &JobState| st.is_terminal())
                .ok_or_else(|| {
                    ApiError::new(
                        StatusCode::BAD_REQUEST,
                        format!(
                            "state: {:?} is not a final state (succeeded, failed, cancelled, timeout)",
                            s.chars().take(64).collect::<String>()
                        ),
                    )
                })?;
            Ok(st)
        })
        .collect()
}

/// `GET /v1/history`: finished jobs as [`HistoryEntry`] rows, paginated by
/// id. Users see their own jobs, admins everyone's.
#[utoipa::path(
    get, path = "/v1/history", tag = "history", operation_id = "list_history",
    summary = "Finished jobs as accounting rows (HistoryEntry: start, end, nodes, exit code, GPU-hours); users see their own",
    params(("user" = Option<String>, Query, description = "Only this user"), ("queue" = Option<String>, Query, description = "Only this queue"), ("state" = Option<String>, Query, description = "Final states, comma-separated"), ("since" = Option<u64>, Query, description = "Ended at or after (epoch seconds)"), ("until" = Option<u64>, Query, description = "Ended before (epoch seconds)"), ("cursor" = Option<u64>, Query, description = "From the previous page"), ("limit" = Option<u64>, Query, description = "Rows per page (1 to 5,000; 500 by default)")),
    responses(
        (status = 200, description = "{entries: [HistoryEntry], next_cursor}", body = Object),
        Errors<{ MALFORMED | UNAUTHENTICATED | FORBIDDEN | RATE_LIMITED | INTERNAL | UNAVAILABLE }>
    ),
    security(("bearer" = []))
)]
pub async fn list(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    Query(q): Query<HistoryQuery>,
) -> Result<Json<HistoryPage>, ApiError> {
    let p = authenticate_person(&app, &headers)?;
    let user = match (&p, &q.user) {
        (Principal::User { name, .. }, Some(u)) if u != name => {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                format!("user: {name} may read only their own history"),
            ))
        }
        (Principal::User { name, .. }, _) => Some(name.clone()),
        (_, u) => u.clone(),
    };
    let limit = q.limit.unwrap_or(DEFAULT_PAGE);
    if limit == 0 || limit > MAX_PAGE {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("limit: between 1 and {MAX_PAGE} (got {limit})"),
        ));
    }
    let states = q.state.as_deref().map(final_states).transpose()?;
    let filter = HistoryFilter {
        user,
        queue: q.queue,
        states,
        since: q.since,
        until: q.until,
        cursor: q.cursor,
        limit,
    };
    // The read view's jobs: no state lock.
    let view = app.control.view();
    let now = crate::clock::now();
    blocking(move || Ok(Json(page(&view.jobs, &filter, now)))).await
}
