//! The real server on a loopback port with a temporary data dir, driven over HTTP.

mod common;

use gangway_core::NodeSpec;
use gangway_server::ServerConfig;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const CONFIG: &str = r#"
admin_token: admin-secret
agent_token: agent-secret
node_approval: auto
users:
  - { name: alice, token: alice-token, queues: [research] }
  - { name: bob, token: bob-token, queues: [prod] }
queues:
  - name: lab
    quota: { nominal: { gpus: 16 } }
  - name: research
    parent: lab
    quota: { nominal: { gpus: 8 } }
  - name: prod
    parent: lab
    quota: { nominal: { gpus: 8 } }
"#;

use common::{call, Server};

fn start(dir: &std::path::Path) -> Server {
    common::start_in(CONFIG, dir)
}

fn start_with(cfg: ServerConfig, dir: &std::path::Path) -> Server {
    common::start_with(cfg, dir)
}

impl Server {
    fn register(&self, name: &str, gpus: u32) -> (u16, Value) {
        let spec = NodeSpec::uniform(name, "leaf0", "spine0", gpus, "H100", 80);
        self.register_as("agent-secret", &spec)
    }
    fn job_count(&self) -> usize {
        self.get("/v1/jobs", "admin-secret")
            .1
            .as_array()
            .map_or(0, Vec::len)
    }
}

fn job(name: &str, queue: &str, replicas: u32, gpus: u32) -> String {
    format!("name: {name}\nqueue: {queue}\nreplicas: {replicas}\nresources:\n  gpus: {gpus}\n")
}

#[test]
fn submit_schedule_explain_and_cancel() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    assert_eq!(s.register("node-a", 4).0, 201);
    assert_eq!(s.register("node-b", 4).0, 201);
    let (code, v) = s.submit("alice-token", &job("train", "research", 1, 4));
    assert_eq!(code, 201, "{v}");
    let first = v["id"].as_u64().expect("id");
    let v = s.wait_job(first, |j| j["state"] == "scheduled");
    assert_eq!(v["placement"][0]["gpus"], json!([0, 1, 2, 3]));
    assert_eq!(v["user"], "alice");
    assert!(v["events"]
        .as_array()
        .expect("events")
        .iter()
        .any(|e| e["kind"] == "scheduled"));
    // Two more 4-GPU jobs: one fits, one waits with a reason.
    let a = s.submit("alice-token", &job("a", "research", 1, 4)).1["id"]
        .as_u64()
        .expect("id");
    let b = s.submit("alice-token", &job("b", "research", 1, 4)).1["id"]
        .as_u64()
        .expect("id");
    let placed_or_waiting = |j: &Value| j["state"] == "scheduled" || j["reason"].is_string();
    let va = s.wait_job(a, placed_or_waiting);
    let vb = s.wait_job(b, placed_or_waiting);
    let waiting = if va["state"] == "pending" { &va } else { &vb };
    let reason = waiting["reason"].as_str().expect("reason");
    // All 8 GPUs are taken: it holds the reservation for when a running job ends.
    assert!(
        reason.starts_with("1 node reserved, estimated start at"),
        "{reason}"
    );
    assert!(waiting["estimated_start"].is_u64());
    let wid = waiting["id"].as_u64().expect("id");
    // Cancel it; cancelling again conflicts.
    let (code, _) = s.post(
        &format!("/v1/jobs/{wid}/cancel"),
        "alice-token",
        "application/json",
        "",
    );
    assert_eq!(code, 200);
    assert_eq!(
        s.get(&format!("/v1/jobs/{wid}"), "alice-token").1["state"],
        "cancelled"
    );
    let (code, v) = s.post(
        &format!("/v1/jobs/{wid}/cancel"),
        "alice-token",
        "application/json",
        "",
    );
    assert_eq!(code, 409, "{v}");
    // Filters.
    let (_, list) = s.get("/v1/jobs?state=scheduled", "bob-token");
    assert_eq!(list.as_array().expect("list").len(), 2);
    let (code, v) = s.get("/v1/jobs?state=bogus", "bob-token");
    assert_eq!(code, 400, "{v}");
    // Queues and nodes views.
    let (_, qs) = s.get("/v1/queues", "bob-token");
    let research = qs
        .as_array()
        .expect("queues")
        .iter()
        .find(|q| q["name"] == "research")
        .expect("research");
    assert_eq!(research["usage"]["gpus"], 8);
    let (code, u) = s.get("/v1/usage", "bob-token");
    assert_eq!(code, 200);
    assert!(
        u["gpu_hours_by_queue"]["research"]
            .as_f64()
            .is_some_and(|h| h >= 0.0),
        "{u}"
    );
    assert_eq!(s.get("/v1/usage?from=10&to=5", "bob-token").0, 400);
    let (_, page) = s.get("/v1/jobs?offset=1&limit=1", "bob-token");
    assert_eq!(page.as_array().expect("page").len(), 1);
    let (_, ns) = s.get("/v1/nodes", "bob-token");
    let used: usize = ns
        .as_array()
        .expect("nodes")
        .iter()
        .map(|n| {
            n["gpus"]
                .as_array()
                .expect("gpus")
                .iter()
                .filter(|g| g["allocated"] == true)
                .count()
        })
        .sum();
    assert_eq!(used, 8);
}

#[test]
fn every_pending_job_has_an_estimated_start_or_a_reason_code() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = ServerConfig::from_yaml(
        "admin_token: admin-secret\nagent_token: agent-secret\nnode_approval: auto\n\
         node_not_ready_seconds: 3600\nnode_lost_seconds: 7200\n\
         backfill: conservative\nqueues:\n  - name: open\n",
    )
    .expect("config");
    assert_eq!(
        cfg.scheduler.backfill,
        gangway_sched::Backfill::Conservative
    );
    let s = start_with(cfg, dir.path());
    assert_eq!(s.register("node-a", 4).0, 201);
    assert_eq!(s.register("node-b", 4).0, 201);
    let sizes = [1u32, 2, 1, 4, 1, 8];
    let mut last = 0;
    for i in 0..200u32 {
        let g = sizes[i as usize % sizes.len()];
        let (replicas, per) = if g > 4 { (2, 4) } else { (1, g) };
        let yaml = format!(
            "{}runtime_seconds: {}\n",
            job(&format!("j{i}"), "open", replicas, per),
            60 * (1 + i % 5)
        );
        let (code, v) = s.submit("admin-secret", &yaml);
        assert_eq!(code, 201, "{v}");
        last = v["id"].as_u64().expect("id");
    }
    // Wait for a cycle that has seen the last job.
    s.wait_job(last, |j| {
        j["reason_code"].is_string() || j["state"] != "pending"
    });
    let (code, list) = s.get("/v1/jobs?state=pending&limit=1000", "admin-secret");
    assert_eq!(code, 200);
    let pending = list.as_array().expect("list");
    assert!(pending.len() >= 190, "{} pending", pending.len());
    let mut estimated = 0;
    for j in pending {
        let has_estimate = j["estimated_start"].is_u64();
        assert!(
            has_estimate || j["reason_code"].is_string(),
            "job {} has neither an estimate nor a code: {j}",
            j["id"]
        );
        if has_estimate {
            estimated += 1;
            let nodes = j["planned_nodes"].as_array().expect("planned nodes");
            assert!(
                !nodes.is_empty() && nodes.iter().all(|n| n == "node-a" || n == "node-b"),
                "{j}"
            );
            let code = j["reason_code"].as_str().expect("code");
            assert!(code == "Resources" || code == "Priority", "{j}");
        }
    }
    // The default plan depth (200) covers every one of them.
    assert_eq!(estimated, pending.len());
    // A config asking for an unbounded plan or an unknown mode is refused.
    for (bad, field) in [
        ("plan_depth: 100001", "plan_depth"),
        ("backfill: eager", "backfill"),
    ] {
        let e = ServerConfig::from_yaml(&format!(
            "admin_token: admin-secret\nagent_token: agent-secret\n{bad}\n"
        ))
        .expect_err("refused")
        .to_string();
        assert!(e.contains(field), "{e}");
    }
}

#[test]
fn maintenance_reservations_are_admin_made_validated_and_respected() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = ServerConfig::from_yaml(&format!(
        "{CONFIG}node_not_ready_seconds: 3600\nnode_lost_seconds: 7200\n"
    ))
    .expect("config");
    let s = start_with(cfg, dir.path());
    assert_eq!(s.register("node-a", 4).0, 201);
    assert_eq!(s.register("node-b", 4).0, 201);
    let t = gangway_server::clock::now();
    let body = |name: &str, nodes: &str, start: u64, dur: u64| {
        format!(r#"{{"name":"{name}","nodes":[{nodes}],"start":{start},"duration_seconds":{dur}}}"#)
    };
    let post = |token: &str, b: &str| s.post("/v1/reservations", token, "application/json", b);
    // Users may not create; unknown tokens are not known.
    let ok = body("maint1", r#""node-b""#, t, 3600);
    assert_eq!(post("alice-token", &ok).0, 403);
    assert_eq!(post("nobody-token", &ok).0, 401);
    // Every bad field is refused, naming it.
    for (b, code, field) in [
        (body("Bad Name", r#""node-b""#, t, 60), 400, "name"),
        (body(&"x".repeat(64), r#""node-b""#, t, 60), 400, "name"),
        (body("m", "", t, 60), 400, "nodes"),
        (body("m", r#""node-z""#, t, 60), 422, "nodes"),
        (body("m", r#""node-b""#, t, 0), 400, "duration_seconds"),
        (
            body("m", r#""node-b""#, t, 31 * 86_400),
            400,
            "duration_seconds",
        ),
        (body("m", r#""node-b""#, t - 3600, 60), 400, "start"),
        (body("m", r#""node-b""#, t + 400 * 86_400, 60), 400, "start"),
        (r#"{"name":"m"}"#.to_string(), 400, "reservation"),
    ] {
        let (c, v) = post("admin-secret", &b);
        assert_eq!(c, code, "{b}: {v}");
        assert!(
            v["error"].as_str().is_some_and(|e| e.contains(field)),
            "{b}: {v}"
        );
    }
    let (c, v) = post("admin-secret", &ok);
    assert_eq!(c, 201, "{v}");
    assert_eq!(
        v["end"].as_u64(),
        Some(v["start"].as_u64().expect("start") + 3600)
    );
    assert_eq!(post("admin-secret", &ok).0, 409, "names are unique");
    // Anyone may list.
    let (c, list) = s.get("/v1/reservations", "bob-token");
    assert_eq!(c, 200);
    assert_eq!(list[0]["name"], "maint1");
    assert_eq!(list[0]["nodes"], json!(["node-b"]));
    // The window is under way: jobs go to node-a only, the rest wait with ReqNodeNotAvail.
    let ids: Vec<u64> = (0..2)
        .map(|i| {
            s.submit("alice-token", &job(&format!("m{i}"), "research", 1, 4))
                .1["id"]
                .as_u64()
                .expect("id")
        })
        .collect();
    let first = s.wait_job(ids[0], |j| j["state"] == "scheduled");
    assert_eq!(first["placement"][0]["node"], "node-a", "{first}");
    let second = s.wait_job(ids[1], |j| j["reason_code"].is_string());
    assert_eq!(second["reason_code"], "ReqNodeNotAvail", "{second}");
    assert!(
        second["reason"]
            .as_str()
            .expect("reason")
            .contains("maint1"),
        "{second}"
    );
    // Users may not delete; admins may, then the waiting job takes node-b.
    let del = |token: &str, name: &str| {
        call(
            ureq::delete(&format!("{}/v1/reservations/{name}", s.base))
                .set("Authorization", &format!("Bearer {token}")),
            None,
        )
    };
    assert_eq!(del("alice-token", "maint1").0, 403);
    assert_eq!(del("admin-secret", "Bad Name").0, 400);
    assert_eq!(del("admin-secret", "nope").0, 404);
    assert_eq!(del("admin-secret", "maint1").0, 200);
    let second = s.wait_job(ids[1], |j| j["state"] == "scheduled");
    assert_eq!(second["placement"][0]["node"], "node-b", "{second}");
    assert_eq!(s.get("/v1/reservations", "bob-token").1, json!([]));
}

#[test]
fn auth_is_enforced() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    s.register("node-a", 8);
    let y = job("x", "research", 1, 1);
    let (code, _) = call(
        ureq::post(&format!("{}/v1/jobs", s.base)),
        Some(("application/yaml", &y)),
    );
    assert_eq!(code, 401, "no token");
    assert_eq!(s.submit("wrong-token", &y).0, 401);
    let (code, v) = s.submit("bob-token", &y);
    assert_eq!(code, 403, "bob may not use research: {v}");
    assert!(v["error"]
        .as_str()
        .expect("msg")
        .contains("may not submit to queue research; you may submit to: prod"));
    assert_eq!(
        s.submit("agent-secret", &y).0,
        403,
        "agents do not submit jobs"
    );
    let id = s.submit("alice-token", &y).1["id"].as_u64().expect("id");
    let (code, _) = s.post(
        &format!("/v1/jobs/{id}/cancel"),
        "bob-token",
        "application/json",
        "",
    );
    assert_eq!(code, 403, "bob cannot cancel alice's job");
    let (code, _) = s.post(
        &format!("/v1/jobs/{id}/cancel"),
        "admin-secret",
        "application/json",
        "",
    );
    assert_eq!(code, 200, "an admin can");
    let spec = serde_json::to_string(&NodeSpec::uniform(
        "node-z", "leaf0", "spine0", 8, "H100", 80,
    ))
    .expect("json");
    assert_eq!(
        s.post("/v1/nodes", "alice-token", "application/json", &spec)
            .0,
        403
    );
    assert_eq!(
        s.post(
            "/v1/nodes/node-a/cordon",
            "alice-token",
            "application/json",
            ""
        )
        .0,
        403
    );
    assert_eq!(
        s.post(
            "/v1/nodes/node-a/cordon",
            "admin-secret",
            "application/json",
            ""
        )
        .0,
        200
    );
    assert_eq!(s.get("/v1/jobs", "").0, 401);
}

#[test]
fn malformed_specs_get_precise_errors_and_change_nothing() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    s.register("node-a", 8);
    let before = s.job_count();
    let cases: [(&str, u16, &str); 7] = [
        ("name: [unclosed\n", 400, "job spec"),
        (
            "name: x\nqueue: research\nreplicas: 1\nresources:\n  gpus: -1\n",
            400,
            "gpus",
        ),
        (
            "name: x\nqueue: research\nreplicas: 1\nresources:\n  gpus: 1\ngpuz: 2\n",
            400,
            "gpuz",
        ),
        (
            "name: x\nqueue: research\nreplicas: 0\nresources:\n  gpus: 1\n",
            422,
            "replicas: must be at least 1",
        ),
        (
            "name: x\nqueue: nowhere\nreplicas: 1\nresources:\n  gpus: 1\n",
            403,
            "may not submit to queue nowhere",
        ),
        (
            "name: x\nqueue: research\nreplicas: 1\nresources:\n  gpus: 16\n",
            422,
            "16 GPUs per replica but no matching node has more than 8",
        ),
        (
            "name: x\nqueue: research\nreplicas: 1\nresources:\n  gpus: 1\n  gpu_model: V100\n",
            422,
            "no node has V100 GPUs",
        ),
    ];
    for (body, code, needle) in cases {
        let (got, v) = s.submit("alice-token", body);
        assert_eq!(got, code, "{body:?} → {v}");
        let msg = v["error"].as_str().expect("error message");
        assert!(msg.contains(needle), "{body:?}: {msg}");
    }
    // An admin may use any queue, so the unknown queue itself is reported.
    let (code, v) = s.submit(
        "admin-secret",
        "name: x\nqueue: nowhere\nreplicas: 1\nresources:\n  gpus: 1\n",
    );
    assert_eq!(code, 422);
    assert!(v["error"]
        .as_str()
        .expect("msg")
        .contains("queue: unknown queue \"nowhere\"; you may submit to: lab, research, prod"));
    let (code, v) = s.post(
        "/v1/jobs",
        "alice-token",
        "application/json",
        "{\"name\": 5}",
    );
    assert_eq!(code, 400, "{v}");
    assert_eq!(s.job_count(), before, "nothing accepted");
}

/// JSON sent to the API directly gets the field path and plain words, as
/// the CLI's YAML does; one test per case of issue 47's table.
#[test]
fn spec_errors_name_the_field_in_plain_words() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    s.register("node-a", 8);
    let before = s.job_count();
    let base = r#""name":"x","queue":"research","replicas":1"#;
    let cases = [
        (
            format!(r#"{{{base},"resources":{{"gpus":"2"}}}}"#),
            "job spec: resources.gpus: expected a whole number of GPUs, e.g. 2 (got the string \"2\") at line 1, column",
        ),
        (
            format!(r#"{{{base},"resources":{{"gpus":1}},"runtime_seconds":-60}}"#),
            "job spec: runtime_seconds: expected a whole number of seconds, 0 or more, e.g. 3600 (got -60)",
        ),
        (
            format!(r#"{{{base},"resources":{{"gpus":1}},"run":{{"command":"python train.py"}}}}"#),
            r#"run.command: expected a list of words, e.g. ["python", "train.py"] (got the string "python train.py"); the command is not run by a shell: write its words as a list, or ["sh", "-c", "python train.py"] to run it through sh"#,
        ),
        (
            r#"{"name":"x","queue":"research","replica":2,"resources":{"gpus":1}}"#.to_string(),
            "job spec: unknown field `replica`; did you mean `replicas`? at line 1, column",
        ),
    ];
    for (body, needle) in &cases {
        let (code, v) = s.post("/v1/jobs", "alice-token", "application/json", body);
        assert_eq!(code, 400, "{body} → {v}");
        let msg = v["error"].as_str().expect("error message");
        assert!(msg.contains(needle), "{body}:\n{msg}\nwanted: {needle}");
    }
    // The same through YAML: the position is the YAML's.
    let (code, v) = s.submit(
        "alice-token",
        "name: x\nqueue: research\nreplicas: 1\nresources:\n  gpus: two\n",
    );
    assert_eq!(code, 400, "{v}");
    assert_eq!(
        v["error"],
        "job spec: resources.gpus: expected a whole number of GPUs, e.g. 2 (got the string \"two\") at line 5, column 9"
    );
    assert_eq!(s.job_count(), before, "nothing accepted");
}

/// A spec without `queue:` goes to the submitter's only queue, or to the
/// queue marked `default: true`; otherwise the error lists the queues.
#[test]
fn a_missing_queue_is_the_default_or_the_only_one() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    s.register("node-a", 8);
    let no_queue = "name: x\nreplicas: 1\nresources:\n  gpus: 1\n";
    let (code, v) = s.submit("alice-token", no_queue);
    assert_eq!(code, 201, "alice has one queue: {v}");
    let id = v["id"].as_u64().expect("id");
    assert_eq!(
        s.get(&format!("/v1/jobs/{id}"), "alice-token").1["spec"]["queue"],
        "research"
    );
    let (code, v) = s.submit("admin-secret", no_queue);
    assert_eq!(code, 422, "{v}");
    assert_eq!(
        v["error"],
        "queue: missing, and there is no default queue; you may submit to: lab, research, prod"
    );
    drop(s);

    let dir = tempfile::tempdir().expect("tmp");
    let marked = CONFIG.replace("  - name: prod\n", "  - name: prod\n    default: true\n");
    assert_ne!(marked, CONFIG);
    let s = common::start_in(&marked, dir.path());
    s.register("node-a", 8);
    let (code, v) = s.submit("admin-secret", no_queue);
    assert_eq!(code, 201, "{v}");
    let id = v["id"].as_u64().expect("id");
    assert_eq!(
        s.get(&format!("/v1/jobs/{id}"), "admin-secret").1["spec"]["queue"],
        "prod"
    );
    // The default is only for those who may use it: alice keeps her own.
    let (code, v) = s.submit("alice-token", no_queue);
    assert_eq!(code, 201, "{v}");
    let id = v["id"].as_u64().expect("id");
    assert_eq!(
        s.get(&format!("/v1/jobs/{id}"), "alice-token").1["spec"]["queue"],
        "research"
    );

    let two = marked.replace(
        "  - name: research\n",
        "  - name: research\n    default: true\n",
    );
    let e = ServerConfig::from_yaml(&two).expect_err("two defaults");
    assert!(
        e.to_string()
            .contains("at most one queue may be `default: true` (marked: research, prod)"),
        "{e}"
    );
}

#[test]
fn state_survives_a_restart_without_duplicates() {
    let dir = tempfile::tempdir().expect("tmp");
    let ids: Vec<u64> = {
        let s = start(dir.path());
        s.register("node-a", 8);
        let ids: Vec<u64> = (0..5)
            .map(|i| {
                s.submit("alice-token", &job(&format!("j{i}"), "research", 1, 4))
                    .1["id"]
                    .as_u64()
                    .expect("id")
            })
            .collect();
        s.wait_job(ids[0], |j| j["state"] == "scheduled");
        s.wait_job(ids[1], |j| j["state"] == "scheduled");
        ids
    };
    std::thread::sleep(Duration::from_millis(100));
    let s = start(dir.path());
    let (_, list) = s.get("/v1/jobs", "admin-secret");
    let list = list.as_array().expect("list").clone();
    assert_eq!(list.len(), 5);
    let scheduled: Vec<u64> = list
        .iter()
        .filter(|j| j["state"] == "scheduled")
        .map(|j| j["id"].as_u64().expect("id"))
        .collect();
    assert_eq!(scheduled, ids[..2].to_vec(), "placements restored");
    let next = s.submit("alice-token", &job("after", "research", 1, 1)).1["id"]
        .as_u64()
        .expect("id");
    assert_eq!(next, ids[4] + 1, "ids continue, never reused");
    // The restored placements hold their GPUs: nothing else fits on the node.
    let v = s.wait_job(next, |j| j["reason"].is_string());
    assert_eq!(v["state"], "pending");
}

#[test]
fn metrics_and_openapi_are_served() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    s.register("node-a", 8);
    let id = s.submit("alice-token", &job("m", "research", 1, 2)).1["id"]
        .as_u64()
        .expect("id");
    s.wait_job(id, |j| j["state"] == "scheduled");
    // No token, or a token that is not allowed: no metrics.
    assert!(matches!(
        ureq::get(&format!("{}/metrics", s.base)).call(),
        Err(ureq::Error::Status(401, _))
    ));
    assert_eq!(s.get("/metrics", "alice-token").0, 403);
    // The snapshot is refreshed by the scheduler loop: wait for it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = ureq::get(&format!("{}/metrics", s.base))
            .set("Authorization", "Bearer admin-secret")
            .call()
            .expect("metrics")
            .into_string()
            .expect("text");
        if text.contains("gangway_jobs{state=\"scheduled\",queue=\"research\"} 1")
            || Instant::now() > deadline
        {
            break text;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        text.contains("gangway_jobs{state=\"scheduled\",queue=\"research\"} 1"),
        "{text}"
    );
    assert!(text.contains("gangway_gpus_allocated 2"), "{text}");
    assert!(text.contains("gangway_scheduling_cycle_seconds_count"));
    assert!(
        text.contains("gangway_api_requests_total{route=\"/v1/jobs\",status=\"201\"} 1"),
        "{text}"
    );
    // The state lock's use, by holder: the submission's group commit and
    // the cycle that placed it took it, and held it for some time.
    let lock = |text: &str, family: &str, holder: &str| -> f64 {
        let series = format!("gangway_state_lock_{family}_total{{holder=\"{holder}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {series} in {text}"))
    };
    assert!(lock(&text, "acquisitions", "submissions") >= 1.0, "{text}");
    assert!(lock(&text, "acquisitions", "cycle") >= 1.0, "{text}");
    assert!(lock(&text, "held_seconds", "cycle") > 0.0, "{text}");
    assert!(lock(&text, "wait_seconds", "cycle") >= 0.0, "{text}");
    // Counters: a second submission adds to them, nothing goes back.
    s.submit("alice-token", &job("m2", "research", 1, 1));
    let again = ureq::get(&format!("{}/metrics", s.base))
        .set("Authorization", "Bearer admin-secret")
        .call()
        .expect("metrics")
        .into_string()
        .expect("text");
    assert!(
        lock(&again, "acquisitions", "submissions") > lock(&text, "acquisitions", "submissions"),
        "{again}"
    );
    for holder in [
        "cycle",
        "combined",
        "submissions",
        "requests",
        "retention",
        "other",
    ] {
        for family in ["acquisitions", "wait_seconds", "held_seconds"] {
            assert!(lock(&again, family, holder) >= lock(&text, family, holder));
        }
    }
    let doc: Value = ureq::get(&format!("{}/openapi.json", s.base))
        .call()
        .expect("openapi")
        .into_json()
        .expect("json");
    assert!(doc["paths"]["/v1/jobs"]["post"].is_object());
}

#[test]
fn agents_report_only_for_their_own_node_and_drive_the_lifecycle() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    let token_a = s.register("node-a", 8).1["node_token"]
        .as_str()
        .expect("token")
        .to_string();
    let token_b = s.register("node-b", 8).1["node_token"]
        .as_str()
        .expect("token")
        .to_string();
    assert_ne!(token_a, token_b);
    // Re-registering needs the node's own token and never returns it again.
    let (code, v) = s.register("node-a", 8);
    assert_eq!(code, 403, "the join token cannot re-register node-a: {v}");
    let spec = NodeSpec::uniform("node-a", "leaf0", "spine0", 8, "H100", 80);
    let (code, v) = s.post(
        "/v1/nodes",
        &token_a,
        "application/json",
        &serde_json::to_string(&spec).expect("json"),
    );
    assert_eq!(code, 200, "{v}");
    assert!(v.get("node_token").is_none(), "token returned again: {v}");
    let id = s.submit("alice-token", &job("run", "research", 1, 8)).1["id"]
        .as_u64()
        .expect("id");
    let v = s.wait_job(id, |j| j["state"] == "scheduled");
    let node = v["placement"][0]["node"]
        .as_str()
        .expect("node")
        .to_string();
    let (mine, other) = if node == "node-a" {
        (&token_a, &token_b)
    } else {
        (&token_b, &token_a)
    };
    let other_node = if node == "node-a" { "node-b" } else { "node-a" };
    let report = |n: &str, t: &str, body: &str| {
        s.post(
            &format!("/v1/agent/{n}/report"),
            t,
            "application/json",
            body,
        )
    };
    let running = format!("{{\"job\":{id},\"state\":\"running\"}}");
    assert_eq!(
        report(&node, other, &running).0,
        403,
        "another node's token"
    );
    assert_eq!(
        report(&node, "agent-secret", &running).0,
        403,
        "the shared join token"
    );
    assert_eq!(report(&node, "nope", &running).0, 401);
    assert_eq!(
        report(other_node, other, &running).0,
        403,
        "the job is not on that node"
    );
    assert_eq!(
        report(&node, mine, "{\"job\":1,\"state\":\"flying\"}").0,
        400
    );
    let (code, v) = report(&node, mine, &running);
    assert_eq!((code, v["state"].as_str()), (200, Some("running")));
    let (code, v) = report(
        &node,
        mine,
        &format!("{{\"job\":{id},\"state\":\"exited\",\"exit_code\":0}}"),
    );
    assert_eq!((code, v["state"].as_str()), (200, Some("succeeded")));
    let v = s.get(&format!("/v1/jobs/{id}"), "alice-token").1;
    let kinds: Vec<&str> = v["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    assert_eq!(kinds, vec!["submitted", "scheduled", "running", "finished"]);
    let (code, _) = report(
        &node,
        mine,
        &format!("{{\"job\":{id},\"state\":\"exited\",\"exit_code\":0}}"),
    );
    assert_eq!(code, 409, "a finished job cannot exit twice");
}

#[test]
fn a_preempted_job_is_requeued_when_its_agent_reports_the_exit() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    let token = s.register("node-a", 8).1["node_token"]
        .as_str()
        .expect("token")
        .to_string();
    let low = s
        .submit(
            "alice-token",
            "name: exp\nqueue: research\nreplicas: 1\npriority: low\nresources:\n  gpus: 8\n",
        )
        .1["id"]
        .as_u64()
        .expect("id");
    s.wait_job(low, |j| j["state"] == "scheduled");
    let report =
        |body: String| s.post("/v1/agent/node-a/report", &token, "application/json", &body);
    assert_eq!(
        report(format!("{{\"job\":{low},\"state\":\"running\"}}")).0,
        200
    );
    let prod = s
        .submit("admin-secret", "name: retrain\nqueue: research\nreplicas: 1\npriority: production\nresources:\n  gpus: 8\n")
        .1["id"]
        .as_u64()
        .expect("id");
    let v = s.wait_job(low, |j| j["state"] == "preempting");
    let last = v["events"]
        .as_array()
        .expect("events")
        .last()
        .expect("event")
        .clone();
    assert!(
        last["message"]
            .as_str()
            .expect("msg")
            .contains(&format!("preempted by job {prod}")),
        "{last}"
    );
    // The server restarts during the grace period: the victim is still preempting
    // and nobody else is preempted for the same job.
    drop(s);
    let s = start(dir.path());
    let v = s.wait_job(prod, |j| j["reason"].is_string());
    assert_eq!(
        v["reason"],
        "waiting for 1 preempted job to checkpoint and exit"
    );
    assert_eq!(
        s.get(&format!("/v1/jobs/{low}"), "alice-token").1["state"],
        "preempting"
    );
    let report =
        |body: String| s.post("/v1/agent/node-a/report", &token, "application/json", &body);
    // The agent delivered SIGTERM; the job checkpointed and exited.
    let (code, v) = report(format!(
        "{{\"job\":{low},\"state\":\"exited\",\"exit_code\":143}}"
    ));
    assert_eq!((code, v["state"].as_str()), (200, Some("pending")));
    s.wait_job(prod, |j| j["state"] == "scheduled");
    let v = s.wait_job(low, |j| j["reason"].is_string());
    assert!(v["events"]
        .as_array()
        .expect("events")
        .iter()
        .any(|e| e["kind"] == "requeued"));
}

#[test]
fn a_failed_gang_restarts_with_backoff_then_fails_for_good() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    let token = s.register("node-a", 8).1["node_token"]
        .as_str()
        .expect("token")
        .to_string();
    let spec = "name: flaky\nqueue: research\nreplicas: 1\nresources:\n  gpus: 4\nrestart:\n  max_restarts: 1\n  backoff_seconds: 0\n  retry_start_failures: true\n";
    let id = s.submit("alice-token", spec).1["id"].as_u64().expect("id");
    let report =
        |body: String| s.post("/v1/agent/node-a/report", &token, "application/json", &body);
    s.wait_job(id, |j| j["state"] == "scheduled");
    assert_eq!(
        report(format!("{{\"job\":{id},\"state\":\"running\"}}")).0,
        200
    );
    let (code, v) = report(format!(
        "{{\"job\":{id},\"state\":\"exited\",\"exit_code\":1}}"
    ));
    assert_eq!((code, v["state"].as_str()), (200, Some("restarting")));
    // Backoff 0: the next cycle puts it back in line and schedules it again.
    s.wait_job(id, |j| j["state"] == "scheduled");
    assert_eq!(
        report(format!("{{\"job\":{id},\"state\":\"running\"}}")).0,
        200
    );
    let (_, v) = report(format!(
        "{{\"job\":{id},\"state\":\"exited\",\"exit_code\":1}}"
    ));
    assert_eq!(v["state"], "failed", "out of restarts");
    let v = s.get(&format!("/v1/jobs/{id}"), "alice-token").1;
    let last = v["events"]
        .as_array()
        .expect("events")
        .last()
        .expect("event")
        .clone();
    assert_eq!(
        last["message"],
        "exited with code 1 on node-a after 1 restarts"
    );
    assert_eq!(v["restarts"], 1);
}

#[test]
fn sync_answers_assignments_and_refuses_reports_about_an_old_attempt() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    let ta = s.register("node-a", 4).1["node_token"]
        .as_str()
        .expect("token")
        .to_string();
    let tb = s.register("node-b", 4).1["node_token"]
        .as_str()
        .expect("token")
        .to_string();
    let spec = "name: gang\nqueue: research\nreplicas: 2\nresources:\n  gpus: 4\nrestart:\n  max_restarts: 2\n  backoff_seconds: 0\nrun:\n  command: [train]\n";
    let id = s.submit("alice-token", spec).1["id"].as_u64().expect("id");
    s.wait_job(id, |j| j["state"] == "scheduled");
    let sync = |node: &str, token: &str, tasks: &str| {
        s.post(
            &format!("/v1/agent/{node}/sync"),
            token,
            "application/json",
            &format!("{{\"tasks\":[{tasks}]}}"),
        )
    };
    // Each node is told to run its rank, with one rendezvous for the gang.
    let (code, a) = sync("node-a", &ta, "");
    assert_eq!(code, 200, "{a}");
    let (_, b) = sync("node-b", &tb, "");
    let (aa, bb) = (&a["assignments"][0], &b["assignments"][0]);
    assert_eq!(aa["world_size"], 2);
    assert_eq!(aa["master_port"], bb["master_port"]);
    assert_eq!(aa["master_addr"], bb["master_addr"]);
    let mut ranks = vec![
        aa["ranks"][0]["rank"].clone(),
        bb["ranks"][0]["rank"].clone(),
    ];
    ranks.sort_by_key(|r| r.as_u64());
    assert_eq!(ranks, vec![json!(0), json!(1)]);
    assert_ne!(aa["node_rank"], bb["node_rank"]);
    // A node token speaks only for its node.
    assert_eq!(sync("node-b", &ta, "").0, 403);
    // Running on one node is not yet running.
    let running = format!("{{\"job\":{id},\"attempt\":0,\"state\":\"running\"}}");
    sync("node-a", &ta, &running);
    assert_eq!(
        s.get(&format!("/v1/jobs/{id}"), "alice-token").1["state"],
        "scheduled"
    );
    sync("node-b", &tb, &running);
    assert_eq!(
        s.get(&format!("/v1/jobs/{id}"), "alice-token").1["state"],
        "running"
    );
    // One rank fails: the whole gang is stopped first (node-b's rank gets
    // the checkpoint signal with a short grace; the GPUs stay booked) ...
    let failed = format!("{{\"job\":{id},\"attempt\":0,\"state\":\"exited\",\"exit_code\":2}}");
    sync("node-a", &ta, &failed);
    let (_, b) = sync("node-b", &tb, &running);
    assert_eq!(b["assignments"][0]["stop"], json!(true), "{b}");
    assert_eq!(b["assignments"][0]["attempt"], json!(0));
    assert!(b["assignments"][0]["grace_seconds"].as_u64() <= Some(10));
    let v = s.get(&format!("/v1/jobs/{id}"), "alice-token").1;
    assert_eq!(
        (v["state"].as_str(), v["attempt"].as_u64()),
        (Some("running"), Some(0))
    );
    // ... and restarts as attempt 1 once node-b reports no process left ...
    let stopped = format!("{{\"job\":{id},\"attempt\":0,\"state\":\"exited\",\"exit_code\":143}}");
    sync("node-b", &tb, &stopped);
    let v = s.wait_job(id, |j| j["state"] == "scheduled" && j["attempt"] == 1);
    assert_eq!(v["restarts"], 1);
    // ... and node-b's late report about attempt 0 changes nothing, while
    // its answer lists only attempt 1 (so the agent kills attempt 0).
    let (code, v) = s.post(
        "/v1/agent/node-b/report",
        &tb,
        "application/json",
        &format!("{{\"job\":{id},\"attempt\":0,\"state\":\"exited\",\"exit_code\":137}}"),
    );
    assert_eq!(code, 409, "{v}");
    assert!(v["error"]
        .as_str()
        .is_some_and(|e| e.contains("attempt 0 is over")));
    let (_, b) = sync("node-b", &tb, &failed);
    let attempts: Vec<&Value> = b["assignments"]
        .as_array()
        .expect("list")
        .iter()
        .map(|a| &a["attempt"])
        .collect();
    assert_eq!(attempts, vec![&json!(1)]);
    let v = s.get(&format!("/v1/jobs/{id}"), "alice-token").1;
    assert_eq!(
        (v["state"].as_str(), v["restarts"].as_u64()),
        (Some("scheduled"), Some(1))
    );
}

/// The reason code of job `id` as the admin sees it.
fn reason_code(s: &Server, id: u64) -> Value {
    s.get(&format!("/v1/jobs/{id}"), "admin-secret").1["reason_code"].clone()
}

fn id_of(r: (u16, Value)) -> u64 {
    assert_eq!(r.0, 201, "{}", r.1);
    r.1["id"].as_u64().expect("id")
}

/// An agent's report on node-a, sent with the admin token.
fn exited(s: &Server, id: u64, code: i32) {
    let body = json!({ "job": id, "state": "exited", "exit_code": code }).to_string();
    let (c, v) = s.post(
        "/v1/agent/node-a/report",
        "admin-secret",
        "application/json",
        &body,
    );
    assert_eq!(c, 200, "{v}");
}

#[test]
fn hold_release_and_update_pending_jobs_with_owner_and_admin_rules() {
    let dir = tempfile::tempdir().expect("tmp");
    let (running, held, dep, arr) = {
        let s = start(dir.path());
        assert_eq!(s.register("node-a", 4).0, 201);
        let running = id_of(s.submit("alice-token", &job("run", "research", 1, 4)));
        s.wait_job(running, |j| j["state"] == "scheduled");
        let held = id_of(s.submit(
            "alice-token",
            &format!("{}hold: true\n", job("wait", "research", 1, 4)),
        ));
        assert_eq!(reason_code(&s, held), "JobHeldUser");
        let post =
            |path: &str, token: &str, body: &str| s.post(path, token, "application/json", body);
        // Running jobs: 409 naming the state.
        for action in ["hold", "release", "update"] {
            let (c, v) = post(
                &format!("/v1/jobs/{running}/{action}"),
                "alice-token",
                r#"{"name":"x"}"#,
            );
            assert_eq!(c, 409, "{action}: {v}");
            assert!(
                v["error"].as_str().expect("error").contains("is scheduled"),
                "{v}"
            );
        }
        // Another user may not touch it.
        for action in ["hold", "release", "update"] {
            let (c, _) = post(
                &format!("/v1/jobs/{held}/{action}"),
                "bob-token",
                r#"{"name":"x"}"#,
            );
            assert_eq!(c, 403, "{action} by bob");
        }
        assert_eq!(post("/v1/jobs/9999/hold", "alice-token", "").0, 404);
        // An admin's hold is released by an admin only.
        assert_eq!(
            post(&format!("/v1/jobs/{held}/hold"), "admin-secret", "").0,
            200
        );
        assert_eq!(reason_code(&s, held), "JobHeldAdmin");
        let (c, v) = post(&format!("/v1/jobs/{held}/release"), "alice-token", "");
        assert_eq!(c, 403, "{v}");
        assert!(v["error"].as_str().expect("error").contains("JobHeldAdmin"));
        assert_eq!(
            post(&format!("/v1/jobs/{held}/release"), "admin-secret", "").0,
            200
        );
        assert_ne!(reason_code(&s, held), "JobHeldAdmin");
        assert_eq!(
            post(&format!("/v1/jobs/{held}/release"), "alice-token", "").0,
            409
        );
        // Updates: within the queue's priorities and the user's queues; time limit only down.
        let upd = |body: &str| post(&format!("/v1/jobs/{held}/update"), "alice-token", body);
        let (c, v) = upd(r#"{"priority":"critical"}"#);
        assert_eq!(c, 403, "{v}");
        assert!(v["error"].as_str().expect("error").starts_with("priority:"));
        let (c, v) = upd(r#"{"queue":"prod"}"#);
        assert_eq!(c, 403, "{v}");
        assert!(v["error"].as_str().expect("error").starts_with("queue:"));
        assert_eq!(upd(r#"{"nme":"x"}"#).0, 400);
        assert_eq!(upd("{}").0, 400);
        assert_eq!(
            upd(r#"{"time_limit":"1h","priority":"low","name":"renamed"}"#).0,
            200
        );
        let (c, v) = upd(r#"{"time_limit":"2h"}"#);
        assert_eq!(c, 403, "{v}");
        assert!(v["error"]
            .as_str()
            .expect("error")
            .starts_with("time_limit:"));
        assert_eq!(upd(r#"{"time_limit":"30m"}"#).0, 200);
        let v = s.get(&format!("/v1/jobs/{held}"), "alice-token").1;
        assert_eq!(
            (
                &v["spec"]["name"],
                &v["spec"]["priority"],
                &v["spec"]["time_limit"]
            ),
            (&json!("renamed"), &json!("low"), &json!(1800))
        );
        assert!(v["events"]
            .as_array()
            .expect("events")
            .iter()
            .any(|e| e["kind"] == "updated"));
        // The admin may raise it again.
        let (c, _) = post(
            &format!("/v1/jobs/{held}/update"),
            "admin-secret",
            r#"{"time_limit":"3h"}"#,
        );
        assert_eq!(c, 200);
        // The owner holds it again: it stays held across a restart, as do a
        // dependant and an array's tasks past its limit.
        assert_eq!(
            post(&format!("/v1/jobs/{held}/hold"), "alice-token", "").0,
            200
        );
        let dep = id_of(s.submit(
            "alice-token",
            &format!(
                "{}dependency: \"afterok:{running}\"\n",
                job("dep", "research", 1, 1)
            ),
        ));
        let arr = id_of(s.submit(
            "alice-token",
            &format!("{}array: \"0-2%1\"\n", job("arr", "research", 1, 1)),
        ));
        (running, held, dep, arr)
    };
    std::thread::sleep(Duration::from_millis(100));
    let s = start(dir.path());
    assert_eq!(reason_code(&s, held), "JobHeldUser");
    assert_eq!(reason_code(&s, dep), "Dependency");
    for task in [arr + 1, arr + 2] {
        assert_eq!(reason_code(&s, task), "JobArrayTaskLimit");
    }
    exited(&s, running, 0);
    s.wait_job(dep, |j| j["reason_code"] != "Dependency");
    s.wait_job(running, |j| j["state"] == "succeeded");
    // The GPUs are free, but a held job does not start.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        s.get(&format!("/v1/jobs/{held}"), "admin-secret").1["state"],
        "pending"
    );
    let (c, _) = s.post(
        &format!("/v1/jobs/{held}/release"),
        "alice-token",
        "application/json",
        "",
    );
    assert_eq!(c, 200);
    // Released: in the scheduler, waiting for GPUs like any job.
    s.wait_job(held, |j| {
        j["reason_code"] != "JobHeldUser" && (j["state"] == "scheduled" || j["reason"].is_string())
    });
}

/// GET with the answer's headers (`X-Next-Cursor`, `Link`, `Content-Type`).
fn get_with_headers(s: &Server, path: &str, token: &str) -> (u16, Value, Vec<(String, String)>) {
    let r = ureq::get(&format!("{}{path}", s.base))
        .set("Authorization", &format!("Bearer {token}"))
        .call();
    let resp = match r {
        Ok(x) | Err(ureq::Error::Status(_, x)) => x,
        Err(e) => panic!("transport error: {e}"),
    };
    let headers = resp
        .headers_names()
        .into_iter()
        .filter_map(|n| Some((n.clone(), resp.header(&n)?.to_string())))
        .collect();
    (
        resp.status(),
        resp.into_json().unwrap_or(Value::Null),
        headers,
    )
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
    h.iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

#[test]
fn job_lists_are_paged_with_a_cursor_and_filter_by_state_lists_and_activity() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    assert_eq!(s.register("node-a", 4).0, 201);
    let mut ids = Vec::new();
    for i in 0..7 {
        let (code, v) = s.submit("alice-token", &job(&format!("j{i}"), "research", 1, 4));
        assert_eq!(code, 201, "{v}");
        ids.push(v["id"].as_u64().expect("id"));
    }
    // One runs (scheduled), one is cancelled, five wait.
    s.wait_job(ids[0], |j| j["state"] == "scheduled");
    let (code, _) = s.post(
        &format!("/v1/jobs/{}/cancel", ids[6]),
        "alice-token",
        "application/json",
        "",
    );
    assert_eq!(code, 200);
    // Pages of 3 walk every job once, in order, then stop.
    for desc in [false, true] {
        let mut seen = Vec::new();
        let mut path = format!("/v1/jobs?limit=3&desc={desc}");
        let mut pages = 0;
        loop {
            let (code, page, h) = get_with_headers(&s, &path, "alice-token");
            assert_eq!(code, 200, "{page}");
            let page = page.as_array().expect("a page is an array").clone();
            assert!(page.len() <= 3);
            seen.extend(page.iter().map(|j| j["id"].as_u64().expect("id")));
            pages += 1;
            match header(&h, "x-next-cursor") {
                Some(c) => {
                    let link = header(&h, "link").expect("a Link header beside the cursor");
                    assert!(
                        link.contains(&format!("cursor={c}")) && link.contains("limit=3"),
                        "{link}"
                    );
                    path = format!("/v1/jobs?limit=3&desc={desc}&cursor={c}");
                }
                None => break,
            }
        }
        let mut want = ids.clone();
        if desc {
            want.reverse();
        }
        assert_eq!(seen, want, "desc={desc}");
        assert_eq!(pages, 3);
    }
    // Comma lists of states, and active=true (everything not ended).
    let (_, l, _) = get_with_headers(&s, "/v1/jobs?state=scheduled,cancelled", "alice-token");
    let got: Vec<u64> = l
        .as_array()
        .expect("list")
        .iter()
        .map(|j| j["id"].as_u64().expect("id"))
        .collect();
    assert_eq!(got, vec![ids[0], ids[6]]);
    let (_, l, _) = get_with_headers(&s, "/v1/jobs?active=true", "alice-token");
    assert_eq!(l.as_array().expect("list").len(), 6);
    let (_, l, _) = get_with_headers(&s, "/v1/jobs?active=true&user=bob", "alice-token");
    assert_eq!(l.as_array().expect("list").len(), 0);
    // Refusals name the parameter, as JSON.
    for (q, field) in [
        ("limit=5001", "limit"),
        ("limit=0", "limit"),
        ("state=pending,sleeping", "state"),
        ("cursor=nonsense", "cursor"),
    ] {
        let (code, v, _) = get_with_headers(&s, &format!("/v1/jobs?{q}"), "alice-token");
        assert_eq!(code, 400, "{q}: {v}");
        let msg = v["error"].as_str().unwrap_or_default();
        assert!(msg.starts_with(&format!("{field}:")), "{q}: {v}");
    }
}

#[test]
fn dependencies_wait_start_and_cancel_when_they_can_never_be_met() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    assert_eq!(s.register("node-a", 4).0, 201);
    let dep_job =
        |name: &str, dep: &str| format!("{}dependency: \"{dep}\"\n", job(name, "research", 1, 1));
    let a = id_of(s.submit("alice-token", &job("a", "research", 1, 1)));
    let ok = id_of(s.submit("alice-token", &dep_job("ok", &format!("afterok:{a}"))));
    let notok = id_of(s.submit("alice-token", &dep_job("notok", &format!("afternotok:{a}"))));
    let any = id_of(s.submit("alice-token", &dep_job("any", &format!("afterany:{a}"))));
    for id in [ok, notok, any] {
        assert_eq!(reason_code(&s, id), "Dependency");
    }
    // Unknown ids are refused at submission, naming the field.
    let (c, v) = s.submit("alice-token", &dep_job("x", "afterok:99999"));
    assert_eq!(c, 422, "{v}");
    assert!(v["error"]
        .as_str()
        .expect("error")
        .starts_with("dependency:"));
    let (c, _) = s.submit("alice-token", &dep_job("x", "afterwards:1"));
    assert_eq!(c, 422);
    s.wait_job(a, |j| j["state"] == "scheduled");
    exited(&s, a, 0);
    s.wait_job(ok, |j| j["state"] == "scheduled");
    s.wait_job(any, |j| j["state"] == "scheduled");
    let v = s.wait_job(notok, |j| j["state"] == "cancelled");
    assert_eq!(v["reason_code"], "DependencyNeverSatisfied");
    let last = v["events"]
        .as_array()
        .expect("events")
        .last()
        .expect("event")
        .clone();
    assert!(
        last["message"]
            .as_str()
            .expect("message")
            .contains(&format!("job {a} ended succeeded")),
        "{last}"
    );
    // A cancelled dependency cancels its afterok dependant.
    let b = id_of(s.submit("alice-token", &job("b", "research", 1, 4)));
    let after_b = id_of(s.submit("alice-token", &dep_job("after-b", &format!("afterok:{b}"))));
    s.post(
        &format!("/v1/jobs/{b}/cancel"),
        "alice-token",
        "application/json",
        "",
    );
    let v = s.wait_job(after_b, |j| j["state"] == "cancelled");
    assert_eq!(v["reason_code"], "DependencyNeverSatisfied");
    // singleton: one of alice's "nightly" jobs at a time.
    let n1 = id_of(s.submit("alice-token", &dep_job("nightly", "singleton")));
    let n2 = id_of(s.submit("alice-token", &dep_job("nightly", "singleton")));
    assert_eq!(reason_code(&s, n2), "Dependency");
    s.wait_job(n1, |j| j["state"] == "scheduled");
    exited(&s, n1, 0);
    s.wait_job(n2, |j| j["state"] == "scheduled");
}

#[test]
fn begin_in_the_future_waits_with_begin_time() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    assert_eq!(s.register("node-a", 4).0, 201);
    let later = id_of(s.submit(
        "alice-token",
        &format!("{}begin: \"now+1h\"\n", job("later", "research", 1, 1)),
    ));
    let v = s.get(&format!("/v1/jobs/{later}"), "alice-token").1;
    assert_eq!(v["reason_code"], "BeginTime");
    assert!(v["reason"]
        .as_str()
        .expect("reason")
        .starts_with("begins at "));
    let begin = v["spec"]["begin"]
        .as_u64()
        .expect("stored as epoch seconds");
    assert!(begin > gangway_server::clock::now() + 3500);
    let soon = id_of(s.submit(
        "alice-token",
        &format!("{}begin: \"+2s\"\n", job("soon", "research", 1, 1)),
    ));
    assert_eq!(reason_code(&s, soon), "BeginTime");
    s.wait_job(soon, |j| j["state"] == "scheduled");
    let (c, v) = s.submit(
        "alice-token",
        &format!("{}begin: \"tomorrowish\"\n", job("bad", "research", 1, 1)),
    );
    assert_eq!(c, 422, "{v}");
    assert!(v["error"].as_str().expect("error").starts_with("begin:"));
    let (c, v) = s.submit(
        "alice-token",
        &format!("{}begin: 99999999999999\n", job("far", "research", 1, 1)),
    );
    assert_eq!(c, 422, "{v}");
    assert!(
        v["error"].as_str().expect("error").contains("days away"),
        "{v}"
    );
}

#[test]
fn an_array_runs_at_most_its_limit_at_once_and_cancels_as_one() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    assert_eq!(s.register("node-a", 4).0, 201);
    let first = id_of(s.submit(
        "alice-token",
        &format!("{}array: \"0-7%2\"\n", job("arr", "research", 1, 1)),
    ));
    let tasks: Vec<u64> = (first..first + 8).collect();
    let v = s.get(&format!("/v1/jobs/{}", tasks[7]), "alice-token").1;
    assert_eq!(v["array"]["job"], first);
    assert_eq!(v["array"]["index"], 7);
    let mut done = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while done.len() < 8 {
        assert!(Instant::now() < deadline, "array did not finish");
        let jobs = s.get("/v1/jobs", "admin-secret").1;
        let live: Vec<u64> = jobs
            .as_array()
            .expect("list")
            .iter()
            .filter(|j| tasks.contains(&j["id"].as_u64().unwrap_or(0)))
            .filter(|j| j["state"] == "scheduled" || j["state"] == "running")
            .map(|j| j["id"].as_u64().expect("id"))
            .collect();
        assert!(live.len() <= 2, "more than %2 at once: {live:?}");
        for j in jobs.as_array().expect("list") {
            let id = j["id"].as_u64().unwrap_or(0);
            if tasks.contains(&id) && j["state"] == "pending" && !live.is_empty() {
                assert_eq!(j["reason_code"], "JobArrayTaskLimit", "{j}");
            }
        }
        for id in live {
            exited(&s, id, 0);
            done.insert(id);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Cancelling an array's id cancels every task left.
    let second = id_of(s.submit(
        "alice-token",
        &format!("{}array: \"1,3,5-6%1\"\n", job("arr2", "research", 1, 1)),
    ));
    let (c, v) = s.post(
        &format!("/v1/jobs/{second}/cancel"),
        "alice-token",
        "application/json",
        "",
    );
    assert_eq!(c, 200, "{v}");
    assert_eq!(v["jobs"].as_array().expect("jobs").len(), 4);
    // The task that was placed stops when its node reports nothing left.
    let placed = s.get(&format!("/v1/jobs/{second}"), "admin-secret").1;
    if !placed["placement"]
        .as_array()
        .expect("placement")
        .is_empty()
    {
        exited(&s, second, 143);
    }
    for id in second..second + 4 {
        s.wait_job(id, |j| j["state"] == "cancelled");
    }
    // Size limits: at most 10,000 tasks.
    let (c, v) = s.submit(
        "alice-token",
        &format!("{}array: \"0-10000\"\n", job("big", "research", 1, 1)),
    );
    assert_eq!(c, 422, "{v}");
    assert!(v["error"].as_str().expect("error").starts_with("array:"));
}

#[test]
fn history_lists_finished_jobs_to_their_owners_with_filters_and_pages() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    assert_eq!(s.register("node-a", 4).0, 201);
    let ok = id_of(s.submit("alice-token", &job("ok", "research", 1, 2)));
    let gone = id_of(s.submit("alice-token", &job("gone", "research", 1, 1)));
    let bobs = id_of(s.submit("bob-token", &job("bobs", "prod", 1, 1)));
    for id in [ok, gone, bobs] {
        s.wait_job(id, |j| j["state"] == "scheduled");
    }
    std::thread::sleep(Duration::from_millis(1100));
    exited(&s, ok, 0);
    exited(&s, bobs, 0);
    s.post(
        &format!("/v1/jobs/{gone}/cancel"),
        "alice-token",
        "application/json",
        "",
    );
    exited(&s, gone, 143);
    s.wait_job(gone, |j| j["state"] == "cancelled");
    let running = id_of(s.submit("alice-token", &job("live", "research", 1, 1)));
    let ids = |v: &Value| -> Vec<u64> {
        v["entries"]
            .as_array()
            .expect("entries")
            .iter()
            .map(|e| e["id"].as_u64().expect("id"))
            .collect()
    };
    let (c, v) = s.get("/v1/history", "alice-token");
    assert_eq!(c, 200, "{v}");
    assert_eq!(ids(&v), vec![ok, gone], "own finished jobs only");
    let row = &v["entries"][0];
    assert_eq!(
        (row["exit_code"].as_i64(), row["state"].as_str()),
        (Some(0), Some("succeeded"))
    );
    assert!(row["gpu_hours"].as_f64().expect("gpu_hours") > 0.0);
    assert_eq!(row["nodes"], json!(["node-a"]));
    assert_eq!(s.get("/v1/history?user=bob", "alice-token").0, 403);
    let (_, v) = s.get("/v1/history", "admin-secret");
    assert_eq!(ids(&v), vec![ok, gone, bobs]);
    assert!(!ids(&v).contains(&running));
    let (_, v) = s.get("/v1/history?state=cancelled", "admin-secret");
    assert_eq!(ids(&v), vec![gone]);
    let (_, v) = s.get("/v1/history?queue=prod&user=bob", "admin-secret");
    assert_eq!(ids(&v), vec![bobs]);
    let (_, v) = s.get("/v1/history?since=4000000000", "admin-secret");
    assert_eq!(ids(&v), Vec::<u64>::new());
    let (_, v) = s.get("/v1/history?limit=2", "admin-secret");
    assert_eq!(ids(&v), vec![ok, gone]);
    let cursor = v["next_cursor"].as_u64().expect("more");
    let (_, v) = s.get(
        &format!("/v1/history?limit=2&cursor={cursor}"),
        "admin-secret",
    );
    assert_eq!(ids(&v), vec![bobs]);
    assert!(v["next_cursor"].is_null());
    assert_eq!(s.get("/v1/history?state=running", "admin-secret").0, 400);
    assert_eq!(s.get("/v1/history?limit=0", "admin-secret").0, 400);
    assert_eq!(s.get("/v1/history", "agent-secret").0, 403);
    assert_eq!(s.get("/v1/history", "nobody").0, 401);
}

#[test]
fn every_error_is_json_including_path_query_route_and_method_rejections() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    let send = |method: &str, path: &str| {
        let r = ureq::request(method, &format!("{}{path}", s.base))
            .set("Authorization", "Bearer admin-secret")
            .call();
        match r {
            Ok(x) => panic!("{method} {path} answered {}", x.status()),
            Err(ureq::Error::Status(code, x)) => {
                let ct = x.content_type().to_string();
                let body = x.into_string().expect("body");
                (code, ct, body)
            }
            Err(e) => panic!("transport error: {e}"),
        }
    };
    for (method, path, code, says) in [
        // Path extraction: a job id that is not a number.
        ("GET", "/v1/jobs/seven", 400, "seven"),
        ("POST", "/v1/jobs/-1/cancel", 400, "-1"),
        ("POST", "/v1/nodes/n0/gpus/x/clear", 400, "x"),
        // Query extraction: a number or boolean that is not one.
        ("GET", "/v1/jobs?limit=many", 400, "limit"),
        ("GET", "/v1/jobs?active=maybe", 400, "active"),
        ("GET", "/v1/usage?from=yesterday", 400, "from"),
        ("GET", "/v1/audit?since=-5", 400, "since"),
        // Our own refusals stay as they were.
        ("GET", "/v1/jobs?limit=0", 400, "limit:"),
        ("GET", "/v1/jobs/999", 404, "job 999 does not exist"),
        // No such route, and a route without this method.
        ("GET", "/v1/nope", 404, "no such route: GET /v1/nope"),
        (
            "DELETE",
            "/v1/jobs",
            405,
            "method DELETE not allowed on /v1/jobs",
        ),
    ] {
        let (got, ct, body) = send(method, path);
        assert_eq!(got, code, "{method} {path}: {body}");
        assert_eq!(ct, "application/json", "{method} {path}: {body}");
        let v: Value = serde_json::from_str(&body).expect("a JSON body");
        let msg = v["error"].as_str().expect("an error field");
        assert!(msg.contains(says), "{method} {path}: {msg}");
    }
}

/// `promtool check metrics` on `text`: `None` when promtool is not
/// installed (a failure instead when GANGWAY_REQUIRE_PROMTOOL is set).
fn promtool(text: &str) -> Option<(bool, String)> {
    use std::io::Write;
    let child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            gangway_store::testing::skip_or_fail(
                "GANGWAY_REQUIRE_PROMTOOL",
                &format!("promtool cannot run: {e}"),
            );
            return None;
        }
    };
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("promtool");
    Some((
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

#[test]
fn metrics_speak_prometheus_text_by_default_and_openmetrics_when_asked() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    s.register("node-a", 8);
    let id = s.submit("alice-token", &job("m", "research", 1, 2)).1["id"]
        .as_u64()
        .expect("id");
    s.wait_job(id, |j| j["state"] == "scheduled");
    let scrape = |accept: Option<&str>| {
        let mut r =
            ureq::get(&format!("{}/metrics", s.base)).set("Authorization", "Bearer admin-secret");
        if let Some(a) = accept {
            r = r.set("Accept", a);
        }
        let resp = r.call().expect("metrics");
        let ct = resp.content_type().to_string();
        let full_ct = resp.header("content-type").unwrap_or("").to_string();
        (ct, full_ct, resp.into_string().expect("text"))
    };
    // No Accept header (curl, promtool): text format 0.0.4.
    let (ct, full, text) = scrape(None);
    assert_eq!(ct, "text/plain", "{full}");
    assert!(full.contains("version=0.0.4"), "{full}");
    assert!(!text.contains("# EOF"), "{text}");
    assert!(
        text.contains("# HELP gangway_api_requests_total "),
        "{text}"
    );
    assert!(
        text.contains("# TYPE gangway_decisions_total counter"),
        "{text}"
    );
    assert!(
        text.contains("gangway_api_requests_total{route=\"/v1/jobs\",status=\"201\"} 1"),
        "{text}"
    );
    if let Some((ok, said)) = promtool(&text) {
        assert!(ok, "promtool check metrics: {said}\n{text}");
    }
    // What Prometheus sends: OpenMetrics preferred.
    let (ct, full, om) = scrape(Some(
        "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    ));
    assert_eq!(ct, "application/openmetrics-text", "{full}");
    assert!(om.trim_end().ends_with("# EOF"), "{om}");
    assert!(om.contains("# TYPE gangway_decisions counter"), "{om}");
    // Preferring text gets text.
    let (ct, _, _) = scrape(Some("application/openmetrics-text;q=0.1, text/plain;q=0.9"));
    assert_eq!(ct, "text/plain");
}

/// Every `.route("PATH", get(..).post(..))` in the server's sources, as
/// (METHOD, PATH): the router's route list, read where it is written, so a
/// route added anywhere under src/ is seen.
fn routes_in_sources() -> Vec<(String, String)> {
    fn files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).expect("src dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut paths = Vec::new();
    files(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut paths,
    );
    let mut out = Vec::new();
    for f in paths {
        let src = std::fs::read_to_string(&f).expect("source");
        let mut rest = src.as_str();
        while let Some(i) = rest.find(".route(") {
            rest = rest[i + 7..].trim_start();
            let Some(r) = rest.strip_prefix('"') else {
                continue;
            };
            rest = r;
            let Some(end) = rest.find('"') else { break };
            let path = rest[..end].to_string();
            // The method router: up to the parenthesis closing `.route(`.
            let (mut depth, mut stop) = (1i32, rest.len());
            for (k, ch) in rest.char_indices().skip(end + 1) {
                match ch {
                    '(' => depth += 1,
                    ')' => {
                        depth -= 1;
                        if depth == 0 {
                            stop = k;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let expr = &rest[end + 1..stop];
            for m in ["get", "post", "put", "delete", "patch"] {
                let mut e = expr;
                while let Some(j) = e.find(&format!("{m}(")) {
                    let before = e[..j].chars().next_back();
                    if !before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                        out.push((m.to_uppercase(), path.clone()));
                    }
                    e = &e[j + m.len() + 1..];
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

#[test]
fn the_openapi_document_covers_every_route_and_every_documented_route_exists() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    let doc: Value = ureq::get(&format!("{}/openapi.json", s.base))
        .call()
        .expect("openapi")
        .into_json()
        .expect("json");
    assert_eq!(
        doc,
        gangway_server::http::openapi::document(),
        "served = generated"
    );
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")));
    let routes = routes_in_sources();
    assert!(
        routes.len() >= 20,
        "the route scan found too few: {routes:?}"
    );
    let missing: Vec<String> = routes
        .iter()
        .filter(|(m, p)| !doc["paths"][p][m.to_lowercase()].is_object())
        .map(|(m, p)| format!("{m} {p}"))
        .collect();
    assert!(
        missing.is_empty(),
        "routes missing from the OpenAPI document (add #[utoipa::path] to the handler and list it in gangway_server::http::openapi::ApiDoc): {missing:?}"
    );
    // The other way: every documented operation is routed, and documents
    // its parameters and JSON errors.
    let public = ["/", "/healthz", "/openapi.json", "/v1/leader"];
    for (path, ops) in doc["paths"].as_object().expect("paths") {
        for (method, op) in ops.as_object().expect("operations") {
            let concrete = path
                .replace("{id}", "1")
                .replace("{name}", "n0")
                .replace("{index}", "0")
                .replace("{action}", "cordon");
            let r = ureq::request(&method.to_uppercase(), &format!("{}{concrete}", s.base))
                .set("Authorization", "Bearer admin-secret")
                .call();
            if let Err(ureq::Error::Status(code, resp)) = r {
                let body = resp.into_string().unwrap_or_default();
                assert!(
                    code != 405 && !body.contains("no such route"),
                    "{method} {path} is documented but not routed: {code} {body}"
                );
            }
            for (i, seg) in path
                .split('/')
                .enumerate()
                .filter(|(_, s)| s.starts_with('{'))
            {
                let name = seg.trim_matches(['{', '}']);
                assert!(
                    op["parameters"].as_array().is_some_and(|ps| ps
                        .iter()
                        .any(|p| p["name"] == name && p["in"] == "path")),
                    "{method} {path}: path parameter {name} (segment {i}) undocumented"
                );
            }
            if !public.contains(&path.as_str()) {
                assert!(op["security"].is_array(), "{method} {path}: no security");
                let e401 = &op["responses"]["401"]["content"]["application/json"]["schema"]["$ref"];
                assert_eq!(
                    e401, "#/components/schemas/ErrorBody",
                    "{method} {path}: 401 is not the JSON error"
                );
            }
        }
    }
    // The job list documents its filters and the spec its fields.
    let params: Vec<&str> = doc["paths"]["/v1/jobs"]["get"]["parameters"]
        .as_array()
        .expect("list parameters")
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    for p in ["state", "active", "user", "queue", "cursor", "limit"] {
        assert!(params.contains(&p), "GET /v1/jobs lacks {p}: {params:?}");
    }
    assert!(doc["components"]["schemas"]["JobSpec"]["properties"]["replicas"].is_object());
    assert!(doc["components"]["schemas"]["JobView"].is_object());
}

#[test]
fn answers_built_as_json_match_their_documented_schemas() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    assert_eq!(s.register("node-a", 4).0, 201);
    let id = s.submit("alice-token", &job("x", "research", 1, 2)).1["id"]
        .as_u64()
        .expect("id");
    s.wait_job(id, |j| j["state"] == "scheduled");
    let doc = gangway_server::http::openapi::document();
    let schemas = &doc["components"]["schemas"];
    // Every key served is documented, and every required one is served.
    let check = |what: &str, v: &Value, schema: &str| {
        let sch = &schemas[schema];
        let props = sch["properties"]
            .as_object()
            .unwrap_or_else(|| panic!("{schema} has no properties"));
        let obj = v
            .as_object()
            .unwrap_or_else(|| panic!("{what}: not an object: {v}"));
        for k in obj.keys() {
            assert!(
                props.contains_key(k),
                "{what}: key {k} is not in schema {schema}"
            );
        }
        for r in sch["required"].as_array().into_iter().flatten() {
            let r = r.as_str().expect("name");
            assert!(
                obj.contains_key(r),
                "{what}: required {r} of {schema} missing: {v}"
            );
        }
    };
    let (_, qs) = s.get("/v1/queues", "alice-token");
    for q in qs.as_array().expect("queues") {
        check("GET /v1/queues", q, "QueueView");
    }
    let (_, ns) = s.get("/v1/nodes", "alice-token");
    for n in ns.as_array().expect("nodes") {
        check("GET /v1/nodes", n, "NodeView");
        for g in n["gpus"].as_array().expect("gpus") {
            check("GET /v1/nodes gpus", g, "GpuView");
        }
    }
    check(
        "GET /v1/usage",
        &s.get("/v1/usage", "alice-token").1,
        "UsageView",
    );
    let (_, me) = s.get("/v1/whoami", "alice-token");
    check("GET /v1/whoami", &me, "WhoAmI");
    // The queues the token may use: what `gangway run` defaults to.
    assert_eq!(me["queues"], serde_json::json!(["research"]), "{me}");
    check(
        "GET /v1/leader",
        &s.get("/v1/leader", "alice-token").1,
        "LeaderView",
    );
    let (_, j) = s.get(&format!("/v1/jobs/{id}"), "alice-token");
    // JobView flattens JobRecord: its own keys plus the record's.
    let view = &schemas["JobView"];
    let mut keys: Vec<String> = Vec::new();
    let mut collect = |sch: &Value| {
        keys.extend(
            sch["properties"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, _)| k.clone()),
        );
    };
    collect(view);
    for part in view["allOf"].as_array().into_iter().flatten() {
        match part["$ref"].as_str() {
            Some(r) => collect(&schemas[r.trim_start_matches("#/components/schemas/")]),
            None => collect(part),
        }
    }
    for k in j.as_object().expect("job").keys() {
        assert!(
            keys.contains(k),
            "GET /v1/jobs/{{id}}: key {k} undocumented ({keys:?})"
        );
    }
}

#[test]
fn the_join_token_cannot_hold_update_reserve_or_read_history() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    assert_eq!(s.register("node-a", 4).0, 201);
    let id = s.submit("alice-token", &job("j", "research", 1, 1)).1["id"]
        .as_u64()
        .expect("id");
    for path in [
        format!("/v1/jobs/{id}/hold"),
        format!("/v1/jobs/{id}/release"),
        format!("/v1/jobs/{id}/update"),
        "/v1/reservations".to_string(),
    ] {
        let body = if path.ends_with("update") {
            r#"{"name":"x"}"#
        } else if path.ends_with("reservations") {
            r#"{"name":"m","nodes":["node-a"],"start":"now","duration_seconds":60}"#
        } else {
            ""
        };
        let (code, v) = s.post(&path, "agent-secret", "application/json", body);
        assert_eq!(code, 403, "{path}: {v}");
    }
    assert_eq!(s.get("/v1/history", "agent-secret").0, 403);
    assert_eq!(
        s.get(&format!("/v1/jobs/{id}"), "admin-secret").1["spec"]["name"],
        "j"
    );
}
