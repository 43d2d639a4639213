//! Versions over real HTTP: the backfill settings as versioned policy
//! (applied, diffed and rolled back at the next cycle, without a restart),
//! and the agent version-skew policy at registration.

mod common;

use gangway_core::agent::{check_skew, Version, UNSTATED_VERSION, VERSION, VERSION_HEADER};
use gangway_core::NodeSpec;
use serde_json::{json, Value};

const CONFIG: &str = common::ONE_QUEUE;

use common::{call, Server};

fn start(dir: &std::path::Path) -> Server {
    common::start_in(CONFIG, dir)
}

impl Server {
    /// `GET path` as admin, which must answer 200.
    fn get_ok(&self, path: &str) -> Value {
        let (code, v) = self.get(path, "admin-secret");
        assert_eq!(code, 200, "GET {path}: {v}");
        v
    }
    fn post_json(&self, path: &str, token: &str, body: &Value) -> (u16, Value) {
        self.post(path, token, "application/json", &body.to_string())
    }
    /// Registers `name` as an agent stating `version` (none: no header).
    fn register_version(&self, name: &str, version: Option<&str>) -> (u16, Value) {
        let spec = NodeSpec::uniform(name, "leaf0", "spine0", 4, "H100", 80);
        let mut req = ureq::post(&format!("{}/v1/nodes", self.base))
            .set("Authorization", "Bearer agent-secret");
        if let Some(v) = version {
            req = req.set(VERSION_HEADER, v);
        }
        call(
            req,
            Some((
                "application/json",
                &serde_json::to_string(&spec).expect("json"),
            )),
        )
    }
    fn submit_job(&self, name: &str) -> u64 {
        let (code, v) = call(
            ureq::post(&format!("{}/v1/jobs", self.base))
                .set("Authorization", "Bearer alice-token"),
            Some((
                "application/yaml",
                &format!("name: {name}\nqueue: research\nreplicas: 1\nresources:\n  gpus: 4\n"),
            )),
        );
        assert_eq!(code, 201, "{v}");
        v["id"].as_u64().expect("id")
    }
    fn apply(&self, policy: &Value, reason: &str) -> (u16, Value) {
        self.post_json(
            "/v1/policy/apply",
            "admin-secret",
            &json!({ "policy": policy.to_string(), "reason": reason }),
        )
    }
}

#[test]
fn a_backfill_mode_applied_as_policy_takes_effect_at_the_next_cycle_and_rolls_back() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    for n in ["n0", "n1"] {
        assert_eq!(s.register_version(n, Some(VERSION)).0, 201);
    }
    let running = s.submit_job("first");
    s.wait_for(running, "scheduled", |j| j["state"] == "scheduled");
    let second = s.submit_job("second");
    s.wait_for(second, "scheduled", |j| j["state"] == "scheduled");
    let waiting = s.submit_job("third");
    // Easy backfill (the default): it holds the reservation, with an estimate.
    let planned = |j: &Value| j["estimated_start"].is_u64();
    s.wait_for(waiting, "planned", planned);

    let v1 = s.get_ok("/v1/policy");
    assert_eq!(v1["policy"]["scheduler"]["backfill"], "easy");
    assert_eq!(v1["policy"]["scheduler"]["plan_depth"], 200);
    let mut off = v1["policy"].clone();
    off["scheduler"]["backfill"] = "off".into();
    let (code, v2) = s.apply(&off, "greedy starts while we measure");
    assert_eq!(code, 201, "{v2}");
    assert_eq!(v2["version"], 2);
    assert_eq!(
        v2["diff"],
        json!(["scheduler.backfill: \"easy\" -> \"off\""])
    );
    assert_eq!(
        s.get_ok("/v1/policy/diff?a=1&b=2"),
        json!(["scheduler.backfill: \"easy\" -> \"off\""])
    );
    // The next cycle plans nothing: no estimate, a reason code instead.
    let w = s.wait_for(waiting, "unplanned", |j| {
        j["estimated_start"].is_null() && j["reason_code"].is_string()
    });
    assert_eq!(w["state"], "pending");
    assert_eq!(
        s.get_ok(&format!("/v1/jobs/{running}"))["state"],
        "scheduled"
    );

    // Rollback restores easy backfill, again at the next cycle.
    let (code, v3) = s.post_json(
        "/v1/policy/rollback",
        "admin-secret",
        &json!({ "reason": "estimates back" }),
    );
    assert_eq!(code, 201, "{v3}");
    assert_eq!(v3["version"], 3);
    assert_eq!(s.get_ok("/v1/policy")["policy"], v1["policy"]);
    s.wait_for(waiting, "planned again", planned);

    // Invalid settings are refused, naming the field; nothing changes.
    let mut bad = v1["policy"].clone();
    bad["scheduler"]["backfill"] = "sometimes".into();
    let (code, e) = s.apply(&bad, "bad mode");
    assert_eq!(code, 400, "{e}");
    assert!(
        e["error"]
            .as_str()
            .is_some_and(|m| m.contains("backfill: expected off, easy, conservative")),
        "{e}"
    );
    let mut deep = v1["policy"].clone();
    deep["scheduler"]["plan_depth"] = 1_000_000.into();
    let (code, e) = s.apply(&deep, "too deep");
    assert_eq!(code, 422, "{e}");
    assert!(
        e["error"]
            .as_str()
            .is_some_and(|m| m.contains("scheduler.plan_depth: 1000000 is out of range")),
        "{e}"
    );
    assert_eq!(s.get_ok("/v1/policy")["version"], 3);
}

#[test]
fn agents_one_minor_version_apart_register_and_further_ones_are_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = start(dir.path());
    let me = Version::current();
    let at = |major: u64, minor: u64| format!("{major}.{minor}.3");
    // Accepted: the same version, one minor either way, and the server says its own.
    let mut accepted = vec![at(me.major, me.minor), at(me.major, me.minor + 1)];
    if me.minor > 0 {
        accepted.push(at(me.major, me.minor - 1));
    }
    for (i, v) in accepted.iter().enumerate() {
        let (code, body) = s.register_version(&format!("ok-{i}"), Some(v));
        assert_eq!(code, 201, "agent {v}: {body}");
        assert_eq!(body["server_version"], VERSION);
    }
    // Refused: two minors away, or another major, naming both versions.
    let mut refused = vec![at(me.major, me.minor + 2), at(me.major + 1, me.minor)];
    if me.minor > 1 {
        refused.push(at(me.major, me.minor - 2));
    }
    for (i, v) in refused.iter().enumerate() {
        let (code, body) = s.register_version(&format!("far-{i}"), Some(v));
        assert_eq!(code, 409, "agent {v}: {body}");
        let msg = body["error"].as_str().unwrap_or_default();
        assert!(
            msg.contains(&format!("agent version {v} and server version {me}"))
                && msg.contains("one minor version apart"),
            "{msg}"
        );
    }
    let (code, body) = s.register_version("garbled", Some("banana"));
    assert_eq!(code, 400, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|m| m.starts_with("gangway-agent-version: version \"banana\"")),
        "{body}"
    );
    // An agent that states no version predates the header: 0.1.
    let (code, body) = s.register_version("silent", None);
    let expect = if check_skew(me, UNSTATED_VERSION).is_ok() {
        201
    } else {
        409
    };
    assert_eq!(code, expect, "{body}");
    // A registered agent that falls outside the policy (servers upgraded
    // past it while it ran) is refused on sync too.
    let (code, body) = s.register_version("syncer", Some(VERSION));
    assert_eq!(code, 201, "{body}");
    let token = body["node_token"].as_str().expect("node token").to_string();
    let sync = |v: &str| {
        call(
            ureq::post(&format!("{}/v1/agent/syncer/sync", s.base))
                .set("Authorization", &format!("Bearer {token}"))
                .set(VERSION_HEADER, v),
            Some(("application/json", "{}")),
        )
    };
    assert_eq!(sync(VERSION).0, 200);
    let far = at(me.major, me.minor + 2);
    let (code, body) = sync(&far);
    assert_eq!(code, 409, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|m| m.contains(&format!("agent version {far} and server version {me}"))),
        "{body}"
    );
    // The refused ones were not registered.
    let nodes = s.get_ok("/v1/nodes").to_string();
    assert!(
        nodes.contains("\"ok-0\"") && nodes.contains("\"ok-1\""),
        "{nodes}"
    );
    for name in ["far-0", "far-1", "garbled"] {
        assert!(!nodes.contains(&format!("\"{name}\"")), "{name} in {nodes}");
    }
}
