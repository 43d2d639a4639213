//! Probation, with a real server, agents and health check processes: a node
//! that node blame cordoned runs its agent's `--health-check` when the
//! server asks and returns to service when it passes; a failing or hanging
//! check keeps it cordoned and is retried; an admin's cordon is never lifted
//! by a check.

mod common;

use common::*;
use serde_json::json;

fn config(after_seconds: u64) -> String {
    format!(
        "probation_after_seconds: {after_seconds}\n{}",
        server_config("")
    )
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn metrics(c: &Cluster) -> String {
    ureq::get(&format!("{}/metrics", c.addr))
        .set("Authorization", &format!("Bearer {ADMIN}"))
        .call()
        .ok()
        .and_then(|r| r.into_string().ok())
        .unwrap_or_default()
}

fn audit(c: &Cluster) -> String {
    c.get("/v1/audit").to_string()
}

fn reason(c: &Cluster, node: &str) -> String {
    c.node(node)["cordon_reason"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Runs a one-GPU job (no restarts) and breaks its GPU under it (the
/// stand-in for NVML's XID 79): node blame cordons its node. Returns the
/// node.
fn blame_a_node(c: &Cluster) -> String {
    let mut spec = c.rank_job("victim", 1, 1);
    spec["restart"]["max_restarts"] = json!(0);
    let id = c.submit(&spec);
    let j = c.wait_job(id, "run", 30, |j| state(j) == "running");
    let node = c.lose_gpu_under(&j);
    wait_for("auto-cordon", 20, || {
        (c.node(&node)["cordoned"] == true).then_some(())
    });
    assert!(
        reason(c, &node).contains("cordoned automatically"),
        "{}",
        c.node(&node)
    );
    node
}

#[test]
fn a_blamed_node_whose_health_check_passes_is_back_in_service_and_takes_a_job() {
    let mut c = Cluster::start_with("127.0.0.1", &config(1));
    let seen = c.out.join("check-env");
    let check = format!(
        "env > {}; test -n \"$CUDA_VISIBLE_DEVICES\" && echo all GPUs ok",
        seen.display()
    );
    c.agent("node-a", 2, &[], &["--health-check", &check]);
    c.wait_nodes(1);
    let node = blame_a_node(&c);
    let cordoned_at = now_secs();
    // The GPU is repaired (the fault file goes); the check then passes.
    std::fs::remove_file(c.gpu_health_file(&node)).expect("repair");
    wait_for("back in service", 30, || {
        (c.node(&node)["cordoned"] == false).then_some(())
    });
    assert!(
        c.node(&node)["cordon_reason"].is_null(),
        "{}",
        c.node(&node)
    );
    let a = audit(&c);
    eprintln!(
        "back in service {} s after the auto-cordon",
        now_secs().saturating_sub(cordoned_at)
    );
    assert!(
        a.contains("returned to service after passing its health check: all GPUs ok"),
        "{a}"
    );
    assert!(
        metrics(&c)
            .lines()
            .any(|l| l == r#"gangway_probations_total{result="passed"} 1"#),
        "{}",
        metrics(&c)
    );
    // The check saw all of the node's GPUs, in PCI bus order, and nothing
    // of the agent's own environment.
    let env = std::fs::read_to_string(&seen).expect("the check ran");
    assert!(
        env.lines().any(|l| l == "CUDA_VISIBLE_DEVICES=0,1"),
        "{env}"
    );
    assert!(
        env.lines().any(|l| l == "CUDA_DEVICE_ORDER=PCI_BUS_ID"),
        "{env}"
    );
    assert!(
        env.lines().any(|l| l == format!("GANGWAY_NODE={node}")),
        "{env}"
    );
    assert!(!env.contains("RUST_LOG"), "{env}");
    // Both GPUs take a job again.
    let mut job = c.rank_job("after", 1, 2);
    job["run"]["env"]["STEPS"] = json!("1");
    let id = c.submit(&job);
    let j = c.wait_job(id, "succeed on the node", 30, |j| state(j) == "succeeded");
    assert_eq!(j["placement"][0]["node"], json!(node));
}

#[test]
fn an_auto_cordon_survives_a_server_restart_and_its_probation_resumes() {
    let mut c = Cluster::start_with("127.0.0.1", &config(1));
    let ok = c.out.join("repaired");
    let check = format!("test -e {} && echo all GPUs ok", ok.display());
    c.agent("node-a", 1, &[], &["--health-check", &check]);
    c.wait_nodes(1);
    let node = blame_a_node(&c);
    std::fs::remove_file(c.gpu_health_file(&node)).expect("repair");
    // The first leader's checks fail (not repaired yet); then it stops.
    wait_for("a failed check", 30, || {
        reason(&c, &node)
            .contains("health check failed: exit 1")
            .then_some(())
    });
    let data = c.dir.path().join("data");
    c.replace_server(&data);
    // The restarted server knows the cordon is automatic, and why.
    let why = wait_for("the probation resumed", 30, || {
        let r = reason(&c, &node);
        r.contains("probation: health check").then_some(r)
    });
    assert!(why.starts_with("cordoned automatically"), "{why}");
    assert_eq!(c.node(&node)["cordoned"], true);
    std::fs::write(&ok, "").expect("repaired");
    wait_for("back in service after the restart", 30, || {
        (c.node(&node)["cordoned"] == false).then_some(())
    });
    assert!(c.node(&node)["cordon_reason"].is_null());
    // And it stays so across another restart.
    c.replace_server(&data);
    c.wait_nodes(1);
    assert_eq!(c.node(&node)["cordoned"], false, "{}", c.node(&node));
    std::fs::write(c.out.join("stop"), "").expect("stop");
}

#[test]
fn a_failing_health_check_keeps_the_node_cordoned_saying_why_and_is_retried() {
    let mut c = Cluster::start_with("127.0.0.1", &config(1));
    c.agent(
        "node-a",
        1,
        &[],
        &[
            "--health-check",
            "echo checking; echo nccl loopback failed; exit 1",
        ],
    );
    c.wait_nodes(1);
    let node = blame_a_node(&c);
    let why = wait_for("the check's failure in the reason", 30, || {
        let r = reason(&c, &node);
        r.contains("health check failed: exit 1: nccl loopback failed")
            .then_some(r)
    });
    eprintln!("failing check: {why}");
    assert!(why.starts_with("cordoned automatically"), "{why}");
    assert!(
        why.contains("next try at") || why.contains("running since"),
        "{why}"
    );
    // The backoff after one failure is 2 s here: a second try fails too.
    wait_for("a retry", 30, || {
        metrics(&c)
            .lines()
            .any(|l| l == r#"gangway_probations_total{result="failed"} 2"#)
            .then_some(())
    });
    assert_eq!(c.node(&node)["cordoned"], true);
    let a = audit(&c);
    assert_eq!(
        a.matches("health check failed: exit 1: nccl loopback failed; stays cordoned")
            .count(),
        2,
        "{a}"
    );
    // An admin's uncordon ends the probation at once.
    c.post(&format!("/v1/nodes/{node}/uncordon"));
    assert_eq!(c.node(&node)["cordoned"], false);
    assert!(c.node(&node)["cordon_reason"].is_null());
    std::fs::write(c.out.join("stop"), "").expect("stop");
}

#[test]
fn an_admin_cordon_is_never_lifted_by_a_passing_health_check() {
    let mut c = Cluster::start_with("127.0.0.1", &config(2));
    let runs = c.out.join("check-runs");
    let check = format!("echo run >> {}; echo fine", runs.display());
    c.agent("node-a", 1, &[], &["--health-check", &check]);
    c.agent("node-b", 1, &[], &["--health-check", &check]);
    c.wait_nodes(2);
    let blamed = blame_a_node(&c);
    let other = if blamed == "node-a" {
        "node-b"
    } else {
        "node-a"
    };
    // An admin cordons the blamed node during its probation, and another.
    c.post(&format!("/v1/nodes/{blamed}/cordon"));
    c.post(&format!("/v1/nodes/{other}/cordon"));
    // Well past the probation delay, both stay cordoned and no check ran.
    std::thread::sleep(std::time::Duration::from_secs(6));
    for n in [blamed.as_str(), other] {
        assert_eq!(c.node(n)["cordoned"], true, "{}", c.node(n));
    }
    assert!(!runs.exists(), "a check ran for an admin's cordon");
    assert!(!audit(&c).contains("returned to service"));
    let why = reason(&c, &blamed);
    assert!(
        why.starts_with("cordoned by an admin after: cordoned automatically"),
        "{why}"
    );
    std::fs::write(c.out.join("stop"), "").expect("stop");
}

#[test]
fn a_hanging_health_check_is_killed_at_its_timeout_and_counts_as_failed() {
    let mut c = Cluster::start_with("127.0.0.1", &config(1));
    let pid = c.out.join("check-pid");
    let check = format!("echo $$ > {}; echo burning; sleep 600", pid.display());
    c.agent(
        "node-a",
        1,
        &[],
        &["--health-check", &check, "--health-check-timeout", "1"],
    );
    c.wait_nodes(1);
    let node = blame_a_node(&c);
    let why = wait_for("the timeout in the reason", 30, || {
        let r = reason(&c, &node);
        r.contains("health check failed: exit 124: timed out after 1 s: killed")
            .then_some(r)
    });
    eprintln!("hanging check: {why}");
    assert_eq!(c.node(&node)["cordoned"], true, "{why}");
    let check_pid = std::fs::read_to_string(&pid).expect("the check ran");
    let stat =
        std::fs::read_to_string(format!("/proc/{}/stat", check_pid.trim())).unwrap_or_default();
    let st = stat.rsplit(')').next().unwrap_or("").trim_start();
    assert!(
        st.is_empty() || st.starts_with(['Z', 'X']),
        "the hung check still runs: {stat}"
    );
    std::fs::write(c.out.join("stop"), "").expect("stop");
}

#[test]
fn without_a_health_check_a_blamed_node_stays_cordoned_and_says_so() {
    let mut c = Cluster::start_with("127.0.0.1", &config(1));
    c.agent("node-a", 1, &[], &[]);
    c.wait_nodes(1);
    let node = blame_a_node(&c);
    wait_for("the reason", 20, || {
        reason(&c, &node)
            .contains("no health check configured on its agent: stays cordoned until an admin uncordons it")
            .then_some(())
    });
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert_eq!(c.node(&node)["cordoned"], true);
    std::fs::write(c.out.join("stop"), "").expect("stop");
}

#[test]
fn an_empty_health_check_or_a_timeout_out_of_range_is_refused() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(BIN)
            .args(args)
            .output()
            .expect("run gangway");
        assert!(!out.status.success(), "{args:?} accepted");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let e = run(&[
        "agent",
        "--server",
        "http://127.0.0.1:9",
        "--join-token",
        JOIN,
        "--health-check",
        "  ",
    ]);
    assert!(e.contains("--health-check: the command is empty"), "{e}");
    for cmd in ["agent", "up"] {
        for t in ["0", "86401"] {
            let e = run(&[cmd, "--health-check", "true", "--health-check-timeout", t]);
            assert!(e.contains("--health-check-timeout"), "{cmd} {t}: {e}");
        }
    }
}
