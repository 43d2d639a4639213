//! Slurm's everyday workflow end to end on a local cluster (a server and
//! agent processes running real rank processes), driven through the CLI
//! where users drive it: arrays, dependencies, begin, hold/release, update,
//! history.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::process::Command;
use std::time::{Duration, Instant};

/// A one-rank job of one GPU running `sh -c SCRIPT` with `$OUT` set.
fn sh_job(c: &Cluster, name: &str, script: &str) -> Value {
    let mut spec = c.rank_job(name, 1, 1);
    spec["run"]["command"] = json!(["sh", "-c", script]);
    spec["restart"]["max_restarts"] = json!(0);
    spec
}

/// Runs the CLI as the admin; its stdout, or a panic with its stderr.
fn cli(c: &Cluster, args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(args)
        .env("GANGWAY_ADDR", &c.addr)
        .env("GANGWAY_TOKEN", ADMIN)
        .env("GANGWAY_CONFIG", "/nonexistent")
        .output()
        .expect("gangway");
    assert!(
        out.status.success(),
        "gangway {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `gangway submit FILE FLAGS -o json`: the job id.
fn submit_cli(c: &Cluster, spec: &Value, flags: &[&str]) -> u64 {
    let file = c
        .dir
        .path()
        .join(format!("job-{}.json", spec["name"].as_str().unwrap_or("x")));
    std::fs::write(&file, spec.to_string()).expect("spec file");
    let path = file.display().to_string();
    let mut args = vec!["submit", path.as_str(), "-o", "json"];
    args.extend_from_slice(flags);
    let v: Value = serde_json::from_str(&cli(c, &args)).expect("json answer");
    v["id"].as_u64().expect("id")
}

#[test]
fn a_sixteen_task_array_runs_at_most_four_at_once_and_each_rank_sees_its_index() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 4, &[], &[]);
    c.agent("node-b", 4, &[], &[]);
    c.wait_nodes(2);
    // Eight GPUs free: without the limit eight tasks would run at once.
    let spec = sh_job(
        &c,
        "arr",
        r#"env > "$OUT/arr-$GANGWAY_ARRAY_TASK_ID.tmp" && mv "$OUT/arr-$GANGWAY_ARRAY_TASK_ID.tmp" "$OUT/arr-$GANGWAY_ARRAY_TASK_ID"; sleep 1"#,
    );
    let first = submit_cli(&c, &spec, &["--array", "0-15%4"]);
    let tasks: Vec<u64> = (first..first + 16).collect();
    let queue = cli(&c, &["queue"]);
    // Pending tasks share one row, squeue's `ID_[4-15%4]`.
    assert!(
        queue.contains(&format!("{first}_[")) && queue.contains("-15%4] "),
        "{queue}"
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut most = 0;
    loop {
        let jobs = c.get("/v1/jobs");
        let mine: Vec<&Value> = jobs
            .as_array()
            .expect("jobs")
            .iter()
            .filter(|j| tasks.contains(&j["id"].as_u64().unwrap_or(0)))
            .collect();
        let live = mine
            .iter()
            .filter(|j| matches!(state(j), "scheduled" | "running"))
            .count();
        assert!(live <= 4, "{live} tasks of a %4 array at once");
        most = most.max(live);
        let done = mine.iter().filter(|j| state(j) == "succeeded").count();
        if done == 16 {
            break;
        }
        if Instant::now() > deadline {
            c.dump();
            panic!("array not done: {done} of 16 succeeded");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(most, 4, "the limit, not the GPUs, bounds the array");
    let mut seen = BTreeSet::new();
    for i in 0..16u32 {
        let text = std::fs::read_to_string(c.out.join(format!("arr-{i}"))).expect("task env");
        let env: std::collections::BTreeMap<&str, &str> =
            text.lines().filter_map(|l| l.split_once('=')).collect();
        assert_eq!(env["GANGWAY_ARRAY_TASK_ID"], i.to_string());
        assert_eq!(env["GANGWAY_ARRAY_INDEX"], i.to_string());
        assert_eq!(env["SLURM_ARRAY_TASK_ID"], i.to_string());
        assert_eq!(env["GANGWAY_ARRAY_JOB_ID"], first.to_string());
        seen.insert(env["GANGWAY_JOB_ID"].parse::<u64>().expect("job id"));
    }
    assert_eq!(seen.len(), 16, "one job per task");
}

/// Runs the CLI as the admin: (success, stdout, stderr).
fn try_cli(c: &Cluster, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .args(args)
        .env("GANGWAY_ADDR", &c.addr)
        .env("GANGWAY_TOKEN", ADMIN)
        .env("GANGWAY_CONFIG", "/nonexistent")
        .output()
        .expect("gangway");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn array_tasks_are_addressed_as_id_index_by_logs_describe_why_cancel_and_queue() {
    let c = Cluster::one_node(&server_config(""), "node-a", 1, &[]);
    let spec = sh_job(&c, "sweep", "echo task $GANGWAY_ARRAY_TASK_ID; sleep 120");
    // Sparse indexes: 7 is the fifth task, found by search, not arithmetic.
    let a = submit_cli(&c, &spec, &["--array", "0-2,5,7-9%2"]);
    c.wait_job(a, "task 0 running", 60, |j| state(j) == "running");
    let log = wait_for("task 0's log", 30, || {
        let l = cli(&c, &["logs", &format!("{a}_0")]);
        l.contains("task 0").then_some(l)
    });
    assert_eq!(log.trim(), "task 0");
    // One GPU: task 0 runs, the other six wait in one row.
    let queue = cli(&c, &["queue"]);
    let ids: Vec<&str> = queue
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(
        ids,
        [format!("{a}_0"), format!("{a}_[1-2,5,7-9%2]")],
        "{queue}"
    );
    let d = cli(&c, &["describe", &format!("{a}_7")]);
    assert!(
        d.starts_with(&format!("job {}: sweep (array task {a}_7)\n", a + 4)),
        "{d}"
    );
    let w = cli(&c, &["why", &format!("{a}_9")]);
    assert!(w.starts_with(&format!("job {} ", a + 6)), "{w}");
    // A task's own id works too.
    let d = cli(&c, &["describe", &(a + 3).to_string()]);
    assert!(d.starts_with(&format!("job {}:", a + 3)), "{d}");
    for (arg, want) in [
        (format!("{a}_3"), format!("array {a} has no task 3")),
        (format!("{a}_10"), format!("array {a} has no task 10")),
        (
            format!("{}_0", a + 1),
            format!("job {} is task {a}_1, not an array", a + 1),
        ),
        (
            format!("{a}_x"),
            format!("job id \"{a}_x\": expected ID or ID_INDEX"),
        ),
    ] {
        let (ok, out, err) = try_cli(&c, &["describe", &arg]);
        assert!(
            !ok && out.is_empty() && err.contains(&want),
            "{arg}: {out}{err}"
        );
    }
    // `hold`/`release ID_INDEX` take that task only (an admin hold: the CLI runs as admin).
    cli(&c, &["hold", &format!("{a}_1")]);
    assert_eq!(c.job(a + 1)["held"], "admin", "{:#}", c.job(a + 1));
    assert!(c.job(a + 2)["held"].is_null(), "{:#}", c.job(a + 2));
    cli(&c, &["release", &format!("{a}_1")]);
    assert!(c.job(a + 1)["held"].is_null(), "{:#}", c.job(a + 1));
    // `cancel ID_INDEX` cancels that task only, the first one included.
    cli(&c, &["cancel", &format!("{a}_5")]);
    assert_eq!(state(&c.job(a + 3)), "cancelled");
    cli(&c, &["cancel", &format!("{a}_0")]);
    c.wait_job(a, "task 0 cancelled", 30, |j| state(j) == "cancelled");
    for t in [a + 1, a + 2, a + 4, a + 5, a + 6] {
        assert_ne!(state(&c.job(t)), "cancelled", "task {t} was cancelled too");
    }
    // The array's id cancels every task left (`scancel 5`).
    cli(&c, &["cancel", &a.to_string()]);
    for t in a..a + 7 {
        c.wait_job(t, "cancelled", 30, |j| state(j) == "cancelled");
    }
}

#[test]
fn dependencies_begin_hold_update_and_history_through_the_cli() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 4, &[], &[]);
    c.wait_nodes(1);
    let ok = submit_cli(&c, &sh_job(&c, "first", "sleep 2"), &[]);
    let after = submit_cli(
        &c,
        &sh_job(&c, "after", "exit 0"),
        &["--dependency", &format!("afterok:{ok}")],
    );
    let why = cli(&c, &["queue"]);
    assert!(why.contains("waits for job"), "{why}");
    assert_eq!(c.job(after)["reason_code"], "Dependency");
    let j = c.wait_job(after, "start after its dependency", 30, |j| {
        state(j) == "succeeded"
    });
    let at = |j: &Value, kind: &str| {
        j["events"]
            .as_array()
            .and_then(|e| e.iter().find(|e| e["kind"] == kind))
            .and_then(|e| e["at"].as_u64())
            .expect(kind)
    };
    assert!(
        at(&j, "scheduled") >= at(&c.job(ok), "finished"),
        "started only after its dependency succeeded"
    );
    // A failed dependency cancels its dependant, saying which and why.
    let bad = submit_cli(&c, &sh_job(&c, "bad", "exit 3"), &[]);
    let never = submit_cli(
        &c,
        &sh_job(&c, "never", "exit 0"),
        &["-d", &format!("afterok:{bad}")],
    );
    let j = c.wait_job(never, "be cancelled", 30, |j| state(j) == "cancelled");
    assert_eq!(j["reason_code"], "DependencyNeverSatisfied");
    let (_, msg) = events(&j).last().cloned().expect("event");
    assert!(msg.contains(&format!("job {bad} ended failed")), "{msg}");
    // --begin: waits with BeginTime, then starts.
    let later = submit_cli(&c, &sh_job(&c, "later", "exit 0"), &["--begin", "now+3s"]);
    assert_eq!(c.job(later)["reason_code"], "BeginTime");
    c.wait_job(later, "start at its begin time", 30, |j| {
        state(j) == "succeeded"
    });
    // --hold, then release; update while pending.
    let held = submit_cli(&c, &sh_job(&c, "held", "exit 0"), &["--hold"]);
    assert_eq!(c.job(held)["reason_code"], "JobHeldUser");
    cli(
        &c,
        &[
            "update",
            &held.to_string(),
            "--name",
            "renamed",
            "--time-limit",
            "10m",
        ],
    );
    assert_eq!(c.job(held)["spec"]["name"], "renamed");
    cli(&c, &["hold", &held.to_string()]);
    assert_eq!(c.job(held)["reason_code"], "JobHeldAdmin");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(state(&c.job(held)), "pending", "held jobs do not start");
    cli(&c, &["release", &held.to_string()]);
    c.wait_job(held, "run once released", 30, |j| state(j) == "succeeded");
    // History: finished jobs with GPU-hours; CSV parses; export is JSON lines.
    let csv = cli(&c, &["history", "-o", "csv"]);
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("header").split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).expect(name);
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 6, "{csv}");
    for r in &rows {
        assert_eq!(r.len(), header.len(), "{r:?}");
        let h: f64 = r[col("gpu_hours")].parse().expect("gpu_hours");
        assert!(h >= 0.0);
    }
    let row = |id: u64| {
        rows.iter()
            .find(|r| r[col("id")] == id.to_string())
            .expect("row")
    };
    assert_eq!(row(ok)[col("state")], "succeeded");
    assert_eq!(row(ok)[col("nodes")], "node-a");
    assert!(row(ok)[col("gpu_hours")].parse::<f64>().expect("h") > 0.0);
    assert_eq!(row(bad)[col("exit_code")], "3");
    assert_eq!(row(never)[col("state")], "cancelled");
    let failed = cli(&c, &["history", "--state", "failed", "-o", "json"]);
    let v: Value = serde_json::from_str(&failed).expect("json");
    assert_eq!(v.as_array().map(Vec::len), Some(1));
    let table = cli(&c, &["history", "--since", "now-1h"]);
    assert!(
        table.contains("GPU-HOURS") && table.contains("6 jobs"),
        "{table}"
    );
    let export = c.dir.path().join("history.jsonl");
    cli(&c, &["history", "--export", &export.display().to_string()]);
    let text = std::fs::read_to_string(&export).expect("export");
    let entries: Vec<gangway_server::history::HistoryEntry> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a HistoryEntry per line"))
        .collect();
    assert_eq!(entries.len(), 6);
}
