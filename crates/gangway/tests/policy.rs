//! The versioned scheduling policy end to end: a real server and agents, a
//! few hundred jobs of recorded history, a candidate that halves one queue's
//! quota refused by its gate with the what-if table, forced with a reason,
//! rolled back at the next cycle with nothing running or pending lost, and
//! the decision log showing it all.

mod common;

use common::{server_config, Cluster, ADMIN, BIN};
use gangway_core::{JobId, JobSpec, JobState};
use gangway_server::records::{job_key, JobEvent, JobRecord, JOB_SEQ};
use gangway_store::{RedbStore, Store};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

const HISTORY_JOBS: u64 = 300;

/// Quotas without borrowing, so a queue's quota is what it gets.
fn config() -> String {
    server_config(
        "  - name: research\n    quota: { nominal: { gpus: 8 }, borrowing_limit: { gpus: 0 } }\n  - name: vision\n    quota: { nominal: { gpus: 8 }, borrowing_limit: { gpus: 0 } }\nusers:\n  - { name: alice, token: alice-token, queues: [vision] }\n  - { name: bob, token: bob-token-1, queues: [research] }\ngates: { max_p95_wait_worse_pct: 10, max_utilisation_drop_points: 2, min_jain: 0.9 }\n",
    )
}

/// The test driver: finished jobs written into the store as the server
/// writes them (a job of 2 GPUs every minute, alternating queues, each
/// running 15 minutes), ending an hour ago. Every tenth job's first attempt
/// failed after 5 minutes and was restarted; every thirtieth job failed for
/// good after 2 minutes.
const FAILED_JOBS: u64 = HISTORY_JOBS / 30;
const RESTARTED_JOBS: u64 = HISTORY_JOBS / 10;
fn record_history(data: &Path) {
    std::fs::create_dir_all(data).expect("data dir");
    let store = RedbStore::open(&data.join("gangway.redb")).expect("store");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let t0 = now - 3600 - HISTORY_JOBS * 60 - 900;
    for i in 0..HISTORY_JOBS {
        let id = JobId(i + 1);
        let queue = if i % 2 == 0 { "research" } else { "vision" };
        let submitted = t0 + i * 60;
        let start = submitted + 30;
        let mut rec = JobRecord::submitted(
            id,
            "alice",
            JobSpec::new(&format!("train-{i}"), queue, 1, 2),
            submitted,
        );
        let events: Vec<(u64, &str)> = if i % 30 == 8 {
            rec.state = JobState::Failed;
            vec![(start, "scheduled"), (start + 120, "failed")]
        } else if i % 10 == 5 {
            rec.state = JobState::Succeeded;
            vec![
                (start, "scheduled"),
                (start + 300, "restarting"),
                (start + 330, "requeued"),
                (start + 340, "scheduled"),
                (start + 1240, "finished"),
            ]
        } else {
            rec.state = JobState::Succeeded;
            vec![(start, "scheduled"), (start + 900, "finished")]
        };
        for (at, kind) in events {
            rec.events.push(JobEvent {
                at,
                kind: kind.into(),
                message: String::new(),
                count: 1,
                last_at: None,
            });
        }
        store
            .put(&job_key(id), &serde_json::to_vec(&rec).expect("json"))
            .expect("put");
    }
    store
        .put(JOB_SEQ, HISTORY_JOBS.to_string().as_bytes())
        .expect("seq");
}

fn cli(c: &Cluster, token: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("GANGWAY_ADDR", &c.addr)
        .env("GANGWAY_TOKEN", token)
        .output()
        .expect("run cli")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn refused(o: &Output, code: &str, words: &[&str]) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "should be refused: {err}");
    assert!(err.contains(code), "{code}: {err}");
    for w in words {
        assert!(err.contains(w), "{w:?} not in: {err}");
    }
    err
}

fn post_json(c: &Cluster, token: &str, path: &str, body: &Value) -> (u16, String) {
    match ureq::post(&format!("{}{path}", c.addr))
        .set("Authorization", &format!("Bearer {token}"))
        .send_json(body.clone())
    {
        Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(s, r)) => (s, r.into_string().unwrap_or_default()),
        Err(e) => panic!("POST {path}: {e}"),
    }
}

#[test]
fn a_gated_policy_change_is_forced_logged_and_rolled_back_losing_nothing() {
    let dir = tempfile::tempdir().expect("tmp");
    record_history(&dir.path().join("data"));
    let mut c = Cluster::start_in(dir, "127.0.0.1", &config());
    c.agent("n0", 8, &[], &[]);
    c.agent("n1", 8, &[], &[]);
    c.wait_nodes(2);

    // Version 1 is the configuration file's.
    let shown = ok(&cli(&c, ADMIN, &["policy", "show", "-o", "json"]));
    let v1: Value = serde_json::from_str(&shown).expect("json");
    assert_eq!(v1["version"], 1);
    assert_eq!(v1["action"]["kind"], "seed");
    let mut candidate = v1["policy"].clone();
    let vision = candidate["queues"]
        .as_array_mut()
        .expect("queues")
        .iter_mut()
        .find(|q| q["name"] == "vision")
        .expect("vision");
    vision["quota"]["nominal"]["gpus"] = 4.into();
    let file = c.dir.path().join("halve-vision.yaml");
    std::fs::write(&file, candidate.to_string()).expect("candidate");
    let file = file.to_str().expect("path");

    // What `policy show` prints is a policy file `apply` reads; unchanged, it
    // is refused as nothing to apply.
    let same = c.dir.path().join("same.yaml");
    std::fs::write(&same, ok(&cli(&c, ADMIN, &["policy", "show"]))).expect("write");
    refused(
        &cli(
            &c,
            ADMIN,
            &[
                "policy",
                "apply",
                same.to_str().expect("path"),
                "--reason",
                "r",
            ],
        ),
        "422",
        &["the candidate is the policy in force (version 1); nothing to apply"],
    );

    // The gate refuses it, showing the what-if table.
    let reason = "vision moves half its work to the new cluster";
    let err = refused(
        &cli(&c, ADMIN, &["policy", "apply", file, "--reason", reason]),
        "409",
        &[
            "refused by its gates",
            &format!("what-if: {HISTORY_JOBS} jobs"),
            "p95 wait",
            "FAIL max_p95_wait_worse_pct queue vision",
        ],
    );
    assert!(
        !err.contains("FAIL max_p95_wait_worse_pct queue research"),
        "{err}"
    );
    // The what-if alone says the same, and changes nothing.
    let table = ok(&cli(&c, ADMIN, &["policy", "what-if", file]));
    assert!(
        table.contains("queues.vision.quota.nominal.gpus: 8 -> 4") && table.contains("vision"),
        "{table}"
    );
    // It replayed what happened, failures included.
    assert!(
        table.contains(&format!("replayed as they happened: {FAILED_JOBS} failed or timed-out jobs, {RESTARTED_JOBS} failed and restarted attempts")),
        "{table}"
    );
    assert_eq!(c.get("/v1/policy")["version"], 1);

    // Refusals, each naming the problem.
    refused(
        &cli(
            &c,
            "alice-token",
            &["policy", "apply", file, "--reason", "x"],
        ),
        "403",
        &["only admins"],
    );
    let (code, body) = post_json(
        &c,
        ADMIN,
        "/v1/policy/apply",
        &serde_json::json!({ "policy": candidate.to_string(), "reason": " " }),
    );
    assert!(code == 400 && body.contains("reason"), "{code} {body}");
    let mut unknown_class = candidate.clone();
    unknown_class["queues"][1]["allowed_priorities"] = serde_json::json!(["urgent"]);
    let mut over = v1["policy"].clone();
    over["queues"][1]["quota"]["nominal"]["gpus"] = 12.into();
    let mut dropped = v1["policy"].clone();
    dropped["queues"]
        .as_array_mut()
        .expect("queues")
        .retain(|q| q["name"] != "research");
    let mut bad_knob = v1["policy"].clone();
    bad_knob["scheduler"]["max_preemption_searches"] = 0.into();
    for (p, code, words) in [
        (unknown_class, 400, vec!["urgent"]),
        (
            over,
            422,
            vec!["top-level nominal quotas add up to 20 GPUs"],
        ),
        (bad_knob, 422, vec!["scheduler.max_preemption_searches"]),
    ] {
        let (got, body) = post_json(
            &c,
            ADMIN,
            "/v1/policy/apply",
            &serde_json::json!({ "policy": p.to_string(), "reason": "bad", "force": true }),
        );
        assert_eq!(got, code, "{body}");
        for w in words {
            assert!(body.contains(w), "{w}: {body}");
        }
    }
    // Who may do what: people read, only admins change or replay.
    for path in [
        "/v1/policy/apply",
        "/v1/policy/what-if",
        "/v1/policy/rollback",
        "/v1/policy/promote",
        "/v1/admin/backup",
    ] {
        let body = serde_json::json!({ "reason": "x" });
        let (code, _) = post_json(&c, "alice-token", path, &body);
        assert_eq!(code, 403, "alice on {path}");
        let (code, _) = post_json(&c, "wrong-token", path, &body);
        assert_eq!(code, 401, "unknown token on {path}");
    }
    for path in ["/v1/policy", "/v1/policy/log", "/v1/policy/versions/1"] {
        let code = match ureq::get(&format!("{}{path}", c.addr))
            .set("Authorization", "Bearer agent-secret")
            .call()
        {
            Err(ureq::Error::Status(s, _)) => s,
            other => panic!("{path}: {other:?}"),
        };
        assert_eq!(code, 403, "the join token on {path}");
    }
    for (body, field) in [
        (
            serde_json::json!({ "policy": "{}", "since_seconds": 0 }),
            "since_seconds",
        ),
        (
            serde_json::json!({ "policy": "{}", "since_seconds": 400 * 86_400 }),
            "since_seconds",
        ),
        (serde_json::json!({ "policy": "{}", "extra": 1 }), "extra"),
    ] {
        let (code, text) = post_json(&c, ADMIN, "/v1/policy/what-if", &body);
        assert!(code == 400 && text.contains(field), "{code} {text}");
    }
    let (code, text) = post_json(
        &c,
        ADMIN,
        "/v1/policy/apply",
        &serde_json::json!({ "policy": "{}", "reason": "r".repeat(3000) }),
    );
    assert!(code == 400 && text.contains("reason"), "{code} {text}");
    let (code, text) = post_json(
        &c,
        ADMIN,
        "/v1/policy/apply",
        &serde_json::json!({ "policy": candidate.to_string(), "reason": "r", "pilot": ["nope"] }),
    );
    assert!(
        code == 422 && text.contains("queue nope does not exist"),
        "{code} {text}"
    );
    // Dropping a queue is fine while it holds no live job (research has
    // only finished history)...
    let (code, body) = post_json(
        &c,
        ADMIN,
        "/v1/policy/what-if",
        &serde_json::json!({ "policy": dropped.to_string() }),
    );
    assert!(
        code == 200
            && body
                .contains("queue research: 150 of 150 jobs cannot run under the candidate policy"),
        "{code} {body}"
    );

    // --force with a reason applies it: version 2, forced, reason kept.
    let out = ok(&cli(
        &c,
        ADMIN,
        &["policy", "apply", file, "--reason", reason, "--force"],
    ));
    assert!(
        out.contains("policy version 2 in force") && out.contains("FORCED"),
        "{out}"
    );

    // Live work under version 2: vision may hold 4 GPUs.
    let job = |name: &str| {
        let mut j = c.rank_job(name, 1, 2);
        j["queue"] = "vision".into();
        c.submit(&j)
    };
    let (a, b) = (job("a"), job("b"));
    for id in [a, b] {
        c.wait_job(id, "running", 30, |j| j["state"] == "running");
    }
    let waiting = job("waiting");
    let w = c.wait_job(waiting, "a quota reason", 30, |j| {
        j["reason"]
            .as_str()
            .is_some_and(|r| r.contains("queue vision is at its limit 4/4 GPUs"))
    });
    assert_eq!(w["state"], "pending", "{w:#}");
    // ...but not while it holds one.
    let mut no_vision = v1["policy"].clone();
    no_vision["queues"]
        .as_array_mut()
        .expect("queues")
        .retain(|q| q["name"] != "vision");
    let (code, body) = post_json(
        &c,
        ADMIN,
        "/v1/policy/what-if",
        &serde_json::json!({ "policy": no_vision.to_string() }),
    );
    assert!(
        code == 422 && body.contains("queue vision cannot be removed: 3 of its jobs"),
        "{code} {body}"
    );
    let attempts: Vec<Value> = [a, b]
        .iter()
        .map(|id| c.job(*id)["attempt"].clone())
        .collect();

    // Rollback (to version 1, the one before) takes effect at the next cycle:
    // the waiting job starts, the running ones keep running, untouched.
    let out = ok(&cli(
        &c,
        ADMIN,
        &[
            "policy",
            "rollback",
            "--reason",
            "vision needs its GPUs back",
        ],
    ));
    assert!(
        out.contains("policy version 3 (rollback to 1) in force"),
        "{out}"
    );
    c.wait_job(waiting, "running after the rollback", 30, |j| {
        j["state"] == "running"
    });
    for (id, att) in [a, b].iter().zip(&attempts) {
        let j = c.job(*id);
        assert_eq!(j["state"], "running", "{j:#}");
        assert_eq!(&j["attempt"], att, "{j:#}");
    }
    assert_eq!(c.get("/v1/policy")["policy"], v1["policy"]);
    let diff = ok(&cli(&c, ADMIN, &["policy", "diff", "1", "2"]));
    assert_eq!(diff.trim(), "queues.vision.quota.nominal.gpus: 8 -> 4");
    let same = ok(&cli(&c, ADMIN, &["policy", "diff", "1", "3"]));
    assert!(same.contains("the same policy"), "{same}");

    // A pilot: non-preemptible jobs allowed in vision first, then everywhere.
    let mut both = v1["policy"].clone();
    for q in both["queues"].as_array_mut().expect("queues") {
        q["allow_non_preemptible"] = true.into();
    }
    let pilot_file = c.dir.path().join("non-preemptible.yaml");
    std::fs::write(&pilot_file, both.to_string()).expect("pilot file");
    let pilot_file = pilot_file.to_str().expect("path");
    // Quotas are not pilotable: they move GPUs between queues.
    refused(
        &cli(&c, ADMIN, &["policy", "apply", file, "--reason", "x", "--pilot", "vision"]),
        "422",
        &["queues[vision]: only allowed_priorities, allow_non_preemptible, time_limit, ordering, min_run_seconds and preemption_budget are pilotable"],
    );
    let out = ok(&cli(
        &c,
        ADMIN,
        &[
            "policy",
            "apply",
            pilot_file,
            "--pilot",
            "vision",
            "--reason",
            "checkpoint-free eval jobs",
        ],
    ));
    assert!(out.contains("policy version 4 in force"), "{out}");
    let pinned = |token: &str, queue: &str| {
        let spec = c.dir.path().join(format!("pinned-{queue}.yaml"));
        std::fs::write(
            &spec,
            format!("name: eval\nqueue: {queue}\nreplicas: 1\npreemptible: false\nresources: {{ gpus: 1 }}\nrun: {{ command: [\"true\"] }}\n"),
        )
        .expect("spec");
        cli(&c, token, &["submit", spec.to_str().expect("path")])
    };
    ok(&pinned("alice-token", "vision"));
    refused(&pinned("bob-token-1", "research"), "403", &["preemptible"]);
    let show = ok(&cli(&c, ADMIN, &["policy", "show"]));
    for w in [
        "(pilot on vision)",
        "# pilot queues (live):",
        "# other queues (live):",
    ] {
        assert!(show.contains(w), "{w:?} not in:\n{show}");
    }
    let out = ok(&cli(
        &c,
        ADMIN,
        &["policy", "promote", "--reason", "the pilot went well"],
    ));
    assert!(out.contains("policy version 5 in force"), "{out}");
    ok(&pinned("bob-token-1", "research"));

    // The decision log tells the whole story, to users too.
    let log = ok(&cli(&c, "alice-token", &["policy", "log"]));
    for w in [
        "version 1 (seed) by config",
        "version 2 (apply) by admin",
        "FORCED past failing gates",
        reason,
        "change: queues.vision.quota.nominal.gpus: 8 -> 4",
        "gate FAIL max_p95_wait_worse_pct queue vision",
        "version 3 (rollback to 1) by admin",
        "vision needs its GPUs back",
        "version 4 (pilot on vision) by admin",
        "version 5 (promote pilot 4) by admin",
        "the pilot went well",
        "after (so far)",
    ] {
        assert!(log.contains(w), "{w:?} not in the log:\n{log}");
    }
    // The watch metrics are exported with the server's, in one exposition
    // (OpenMetrics when asked: one `# EOF`).
    let metrics = ureq::get(&format!("{}/metrics", c.addr))
        .set("Authorization", &format!("Bearer {ADMIN}"))
        .set("Accept", "application/openmetrics-text; version=1.0.0")
        .call()
        .expect("metrics")
        .into_string()
        .expect("text");
    for m in [
        "gangway_policy_version ",
        "gangway_queue_wait_p95_seconds{queue=\"vision\"}",
        "gangway_runtime_prediction_error_ratio ",
    ] {
        assert!(metrics.contains(m), "{m:?} not in /metrics");
    }
    assert_eq!(metrics.matches("# EOF").count(), 1);
    let json: Value =
        serde_json::from_str(&ok(&cli(&c, ADMIN, &["policy", "log", "-o", "json"]))).expect("json");
    let v2 = &json[1];
    assert_eq!(v2["forced"], true);
    assert_eq!(v2["evidence"]["jobs"], HISTORY_JOBS);
    assert!(v2["gates"]
        .as_array()
        .expect("gates")
        .iter()
        .any(|g| g["passed"] == false));
}

#[test]
fn the_alert_rules_pass_promtool() {
    let out = Command::new(BIN).arg("alerts").output().expect("alerts");
    let rules = ok(&out);
    for name in [
        "GangwayQueueWaitSLOBreach",
        "GangwayWaitDriftAfterPolicyChange",
        "GangwayRuntimePredictionDrift",
    ] {
        assert!(rules.contains(name), "{name}");
    }
    if Command::new("promtool").arg("--version").output().is_err() {
        common::skip_or_fail("GANGWAY_REQUIRE_PROMTOOL", "promtool is not installed");
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("rules.yaml");
    std::fs::write(&file, &rules).expect("write");
    let check = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .expect("promtool");
    assert!(
        check.status.success(),
        "{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    // promtool checks more than YAML: a broken expression fails it.
    std::fs::write(&file, rules.replace("> 2", "> > 2")).expect("write");
    let bad = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .expect("promtool");
    assert!(!bad.status.success());
}

#[test]
fn the_what_if_runs_offline_from_an_exported_history() {
    use gangway_server::history::HistoryEntry;
    let dir = tempfile::tempdir().expect("tmp");
    let mut lines = String::new();
    for i in 0..200u64 {
        let queue = if i % 2 == 0 { "research" } else { "vision" };
        let mut rec = JobRecord::submitted(
            JobId(i + 1),
            "alice",
            JobSpec::new("train", queue, 1, 2),
            10_000 + i * 60,
        );
        rec.state = JobState::Succeeded;
        for (at, kind) in [
            (10_030 + i * 60, "scheduled"),
            (10_930 + i * 60, "finished"),
        ] {
            rec.events.push(JobEvent {
                at,
                kind: kind.into(),
                message: String::new(),
                count: 1,
                last_at: None,
            });
        }
        lines.push_str(
            &serde_json::to_string(&HistoryEntry::from_record(&rec, 99_999)).expect("row"),
        );
        lines.push('\n');
    }
    let history = dir.path().join("history.jsonl");
    std::fs::write(&history, lines).expect("history");
    let current = dir.path().join("server.yaml");
    std::fs::write(&current, config()).expect("config");
    let cluster = dir.path().join("cluster.yaml");
    std::fs::write(
        &cluster,
        "name: lab\nnode_groups:\n  - { count: 2, gpus: 8 }\n",
    )
    .expect("cluster");
    let candidate = dir.path().join("candidate.yaml");
    std::fs::write(
        &candidate,
        "queues:\n  - name: default\n  - name: research\n    quota: { nominal: { gpus: 8 }, borrowing_limit: { gpus: 0 } }\n  - name: vision\n    quota: { nominal: { gpus: 4 }, borrowing_limit: { gpus: 0 } }\ngates: { max_p95_wait_worse_pct: 10, max_utilisation_drop_points: 2, min_jain: 0.9 }\n",
    )
    .expect("candidate");
    let p = |x: &std::path::Path| x.to_str().expect("path").to_string();
    let out = Command::new(BIN)
        .args([
            "policy",
            "what-if",
            &p(&candidate),
            "--history",
            &p(&history),
        ])
        .args(["--current", &p(&current), "--cluster", &p(&cluster)])
        .env_remove("GANGWAY_ADDR")
        .output()
        .expect("what-if");
    let text = ok(&out);
    for w in [
        "change: queues.vision.quota.nominal.gpus: 8 -> 4",
        "what-if: 200 jobs of this cluster's history on 16 GPUs",
        "FAIL max_p95_wait_worse_pct queue vision",
        "pass max_p95_wait_worse_pct queue research",
    ] {
        assert!(text.contains(w), "{w:?} not in:\n{text}");
    }
    // --history needs the policy in force and the nodes.
    let out = Command::new(BIN)
        .args([
            "policy",
            "what-if",
            &p(&candidate),
            "--history",
            &p(&history),
        ])
        .output()
        .expect("what-if");
    assert!(!out.status.success());
}

/// A job of one GPU that sleeps, declaring `runtime` seconds.
fn sleeper(name: &str, runtime: u64) -> Value {
    serde_json::json!({
        "name": name,
        "queue": "default",
        "replicas": 1,
        "resources": { "gpus": 1 },
        "runtime_seconds": runtime,
        "run": { "command": ["sh", "-c", "sleep 3600"] }
    })
}

#[test]
fn a_policy_naming_tiresias_ranks_the_next_cycle_by_it() {
    // One GPU. Under the default policy (gangway) the job with less
    // declared work goes first; under Tiresias both have received nothing
    // (the same band), so the one submitted first goes first.
    let mut c = Cluster::start("127.0.0.1");
    c.agent("tiresias-n0", 1, &[], &[]);
    c.wait_nodes(1);
    let started = |id: u64| c.job(id)["state"] != "pending";
    let first_of = |c: &Cluster, blocker: u64, long: u64, short: u64| -> u64 {
        c.wait_job(blocker, "running", 60, |j| j["state"] == "running");
        c.post(&format!("/v1/jobs/{blocker}/cancel"));
        wait_for_start(c, long, short)
    };
    let blocker = c.submit(&sleeper("blocker", 3600));
    c.wait_job(blocker, "running", 60, |j| j["state"] == "running");
    let long = c.submit(&sleeper("long", 36_000));
    let short = c.submit(&sleeper("short", 60));
    assert!(!started(long) && !started(short));
    assert_eq!(
        first_of(&c, blocker, long, short),
        short,
        "gangway: less work first"
    );
    c.post(&format!("/v1/jobs/{long}/cancel"));
    let running = short;

    // `policy apply` of `scheduler.policy: tiresias`: an unknown name is
    // refused with the known ones listed.
    let mut p: Value = c.get("/v1/policy")["policy"].clone();
    p["scheduler"]["policy"] = "lottery".into();
    let bad = c.dir.path().join("lottery.yaml");
    std::fs::write(&bad, p.to_string()).expect("write");
    refused(
        &cli(
            &c,
            ADMIN,
            &[
                "policy",
                "apply",
                bad.to_str().expect("path"),
                "--reason",
                "r",
            ],
        ),
        "422",
        &[
            "scheduler.policy",
            "unknown scheduling policy \"lottery\"",
            "known: gangway, fifo, priority, slurm, capacity, tiresias, qssf",
        ],
    );
    p["scheduler"]["policy"] = "tiresias".into();
    let file = c.dir.path().join("tiresias.yaml");
    std::fs::write(&file, p.to_string()).expect("write");
    let out = ok(&cli(
        &c,
        ADMIN,
        &[
            "policy",
            "apply",
            file.to_str().expect("path"),
            "--reason",
            "try tiresias",
        ],
    ));
    assert!(out.contains("scheduler.policy"), "{out}");
    assert_eq!(
        c.get("/v1/policy")["policy"]["scheduler"]["policy"],
        "tiresias"
    );
    let long = c.submit(&sleeper("long-2", 36_000));
    let short = c.submit(&sleeper("short-2", 60));
    assert_eq!(
        first_of(&c, running, long, short),
        long,
        "tiresias: first come first"
    );
}

/// Which of `a` and `b` leaves `pending` first (the other must still be pending).
fn wait_for_start(c: &Cluster, a: u64, b: u64) -> u64 {
    common::wait_for("one of two jobs scheduled", 60, || {
        let (sa, sb) = (c.job(a)["state"].clone(), c.job(b)["state"].clone());
        match (sa != "pending", sb != "pending") {
            (true, false) => Some(a),
            (false, true) => Some(b),
            (true, true) => panic!("both started: {sa} {sb}"),
            _ => None,
        }
    })
}
