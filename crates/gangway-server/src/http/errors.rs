//! Every error answer is JSON `{"error": "..."}`: the API's own errors
//! already are; this layer rewrites the rest (axum's path and query
//! rejections, unknown routes, wrong methods), which answer text/plain or
//! nothing, so a client always parses one shape.

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// Longest error text kept from a rejection.
const MAX_TEXT: usize = 4096;

/// The JSON error a non-JSON error answer becomes: its text (or, when it has
/// none, what went wrong with the request line), under `error`.
pub async fn json_errors(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let res = next.run(req).await;
    let status = res.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return res;
    }
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return res;
    }
    let (mut parts, body) = res.into_parts();
    let bytes = axum::body::to_bytes(body, MAX_TEXT)
        .await
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&bytes).trim().to_string();
    let path: String = path.chars().take(256).collect();
    let msg = match (status, text.is_empty()) {
        (_, false) => text,
        (StatusCode::NOT_FOUND, true) => format!("no such route: {method} {path}"),
        (StatusCode::METHOD_NOT_ALLOWED, true) => {
            format!("method {method} not allowed on {path}")
        }
        (s, true) => s
            .canonical_reason()
            .unwrap_or("request failed")
            .to_lowercase(),
    };
    let body = serde_json::json!({ "error": msg }).to_string();
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    (parts, Body::from(body)).into_response()
}
