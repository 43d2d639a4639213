//! The OpenAPI document served at `/openapi.json`.

use serde_json::{json, Value};

fn op(summary: &str, ok: &str) -> Value {
    json!({
        "summary": summary,
        "security": [{ "bearer": [] }],
        "responses": {
            ok: { "description": "success" },
            "400": { "description": "malformed request (names the field)" },
            "401": { "description": "missing or unknown token" },
            "403": { "description": "token not allowed to do this, or a queue or user rule refuses it (names the rule)" },
            "404": { "description": "no such object" },
            "413": { "description": "body larger than max_body_bytes" },
            "422": { "description": "valid request the cluster or queue can never satisfy" },
            "429": { "description": "request rate or waiting-job limit reached; retry later" }
        }
    })
}

/// The document.
pub fn document() -> Value {
    json!({
        "openapi": "3.0.3",
        "info": { "title": "Gangway", "version": env!("CARGO_PKG_VERSION") },
        "components": { "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } } },
        "paths": {
            "/v1/jobs": {
                "post": op("Submit a job (YAML or JSON job spec)", "201"),
                "get": op("List jobs; filter with ?queue=, ?state=, ?user=; page with ?offset=&limit=", "200")
            },
            "/v1/jobs/{id}": { "get": op("A job with its events and why it waits (env values redacted unless owner or admin)", "200") },
            "/v1/jobs/{id}/cancel": { "post": op("Cancel a job, or every unfinished task of an array by its id (owner or admin)", "200") },
            "/v1/jobs/{id}/hold": { "post": op("Hold a pending job or an array's pending tasks (owner: JobHeldUser; admin: JobHeldAdmin); 409 unless pending", "200") },
            "/v1/jobs/{id}/release": { "post": op("Release a held job or array (an admin's hold by an admin only); 409 unless pending and held", "200") },
            "/v1/jobs/{id}/update": { "post": op("Change a pending job: JSON {priority?, time_limit?, queue?, name?} (owner within the queue's rules, time limit only down; admin any); 409 unless pending", "200") },
            "/v1/history": { "get": op("Finished jobs as accounting rows (HistoryEntry: start, end, nodes, exit code, GPU-hours); ?user=&queue=&state=a,b&since=&until=&cursor=&limit= (users: their own)", "200") },
            "/v1/queues": { "get": op("Queues with quota and usage", "200") },
            "/v1/usage": { "get": op("GPU-hours per queue and user over ?from=&to= (epoch seconds)", "200") },
            "/v1/nodes": {
                "get": op("Nodes and their GPUs", "200"),
                "post": op("Register a node: the join token registers new names only (they wait for approval unless node_approval is auto) and gets the node token once (201); a node's own token re-registers it (200, no token)", "201")
            },
            "/v1/jobs/{id}/logs": { "get": op("A rank's log, relayed from its agent: ?rank=&attempt=&offset= (returns data and next_offset)", "200") },
            "/v1/agent/{name}/report": { "post": op("An agent reports a job on its node: running, or exited with a code; optional attempt (node token)", "200") },
            "/v1/agent/{name}/sync": { "post": op("An agent's heartbeat: GPU health and task states in, the node's desired assignments out (node token)", "200") },
            "/v1/nodes/{name}/gpus/{index}/{action}": { "post": op("Mark a GPU healthy (clear) or unhealthy (admin)", "200") },
            "/v1/nodes/{name}/{action}": { "post": op("approve, cordon, drain, uncordon or delete a node (admin)", "200") },
            "/v1/audit": { "get": op("The audit log: every state-changing call with who, what, target and result; ?since=&limit= (admin)", "200") },
            "/metrics": { "get": op("Prometheus metrics (admin or metrics token)", "200") },
            "/healthz": { "get": { "summary": "Liveness", "responses": { "200": { "description": "ok" } } } }
        }
    })
}
