//! Gangway end to end on one machine: a real server and several agents
//! (separate processes) with declared GPUs running real rank processes.

mod common;

use common::*;
use serde_json::json;
use std::process::Command;

#[test]
fn a_two_node_gang_starts_together_with_disjoint_gpus_and_consistent_ranks() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 4, &[], &[]);
    c.agent("node-b", 4, &[], &[]);
    c.wait_nodes(2);
    let mut spec = c.rank_job("gang", 8, 1);
    spec["run"]["env"]["STEPS"] = json!("15");
    let id = c.submit(&spec);
    let j = c.wait_job(id, "succeed", 60, |j| state(j) == "succeeded");
    let ev = events(&j);
    assert!(
        ev.iter()
            .any(|(k, m)| k == "running" && m == "all ranks started on 2 nodes"),
        "{ev:?}"
    );
    assert_eq!(
        ev.last().map(|e| e.1.as_str()),
        Some("all ranks exited with code 0 on 2 nodes")
    );
    let envs = c.envs(0);
    check_gang_env(&envs, 8, 2, 1);
    // MASTER_ADDR is where rank 0 runs; every rank found the same checkpoint dir.
    assert_eq!(envs[&0]["MASTER_ADDR"], "127.0.0.1");
    assert!(envs[&0]["GANGWAY_CHECKPOINT_DIR"].ends_with(&format!("job-{id}")));
    assert_eq!(envs[&0]["GANGWAY_JOB_ID"], id.to_string());
    // The logs of a rank on either node come back through the server.
    for rank in ["0", "7"] {
        let out = Command::new(BIN)
            .args(["logs", &id.to_string(), "--rank", rank])
            .env("GANGWAY_ADDR", &c.addr)
            .env("GANGWAY_TOKEN", ADMIN)
            .output()
            .expect("gangway logs");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains(&format!("rank {rank} of 8 starting on")),
            "{text}"
        );
        assert!(
            text.contains(&format!("rank {rank} done at step 15")),
            "{text}"
        );
    }
}

#[test]
fn a_preempted_job_checkpoints_within_its_grace_and_resumes() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 4, &[], &[]);
    c.wait_nodes(1);
    let mut low = c.rank_job("experiment", 1, 4);
    low["priority"] = json!("low");
    let low_id = c.submit(&low);
    c.wait_job(low_id, "run", 30, |j| state(j) == "running");
    // Let it make progress it would hate to lose.
    let ckpt = c
        .dir
        .path()
        .join(format!("checkpoints/admin/job-{low_id}/rank-0"));
    wait_for("progress", 20, || {
        std::fs::read_to_string(&ckpt)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .filter(|s| *s >= 5)
    });
    let mut prod = c.rank_job("retrain", 1, 4);
    prod["priority"] = json!("production");
    prod["run"]["env"]["STEPS"] = json!("5");
    let prod_id = c.submit(&prod);
    let j = c.wait_job(low_id, "be requeued", 30, |j| {
        events(j).iter().any(|(k, _)| k == "requeued")
    });
    let ev = events(&j);
    let requeued = ev
        .iter()
        .find(|(k, _)| k == "requeued")
        .map(|e| e.1.clone())
        .unwrap_or_default();
    // It exited by itself (code 0) inside the grace period, not by SIGKILL.
    assert!(requeued.contains("exit code 0"), "{ev:?}");
    let saved: u32 = std::fs::read_to_string(c.out.join("checkpointed-0-0"))
        .expect("the victim saved a checkpoint on SIGTERM")
        .trim()
        .parse()
        .expect("step");
    assert!(saved >= 5);
    c.wait_job(prod_id, "succeed", 30, |j| state(j) == "succeeded");
    // The victim runs again as attempt 1 and starts from its checkpoint.
    c.wait_job(low_id, "run again", 30, |j| {
        state(j) == "running" && j["attempt"] == 1
    });
    let resumed: u32 = wait_for("resume", 20, || {
        std::fs::read_to_string(c.out.join("resumed-1-0"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    });
    assert_eq!(resumed, saved, "resumed exactly where it checkpointed");
    std::fs::write(c.out.join("stop"), "").expect("stop");
    c.wait_job(low_id, "succeed", 30, |j| state(j) == "succeeded");
}

#[test]
fn killing_one_rank_restarts_the_whole_gang_from_its_checkpoint() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 4, &[], &[]);
    c.agent("node-b", 4, &[], &[]);
    c.wait_nodes(2);
    let id = c.submit(&c.rank_job("fragile", 8, 1));
    c.wait_job(id, "run", 30, |j| state(j) == "running");
    let first = wait_for("8 ranks", 20, || {
        let p = pids(&c.out, Some(0));
        (p.len() == 8).then_some(p)
    });
    std::thread::sleep(std::time::Duration::from_millis(600));
    let victim = first[5].1;
    Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .expect("kill");
    let j = c.wait_job(id, "run attempt 1", 30, |j| {
        j["attempt"] == 1 && state(j) == "running"
    });
    let ev = events(&j);
    assert!(
        ev.iter()
            .any(|(k, m)| k == "restarting" && m.starts_with("exited with code 137 on ")),
        "{ev:?}"
    );
    let second = wait_for("8 new ranks", 20, || {
        let p = pids(&c.out, Some(1));
        (p.len() == 8).then_some(p)
    });
    // No rank of the first attempt survives beside the second.
    wait_for("old ranks gone", 10, || {
        first.iter().all(|(_, p)| !alive(*p)).then_some(())
    });
    assert!(second.iter().all(|(_, p)| alive(*p)));
    check_gang_env(&c.envs(1), 8, 2, 1);
    // Every rank of the new attempt resumed from the checkpoint.
    wait_for("resumed", 10, || {
        (0..8)
            .all(|r| c.out.join(format!("resumed-1-{r}")).exists())
            .then_some(())
    });
    std::fs::write(c.out.join("stop"), "").expect("stop");
    let j = c.wait_job(id, "succeed", 30, |j| state(j) == "succeeded");
    assert_eq!(j["restarts"], 1);
}

#[test]
fn a_lost_node_goes_not_ready_and_its_gang_moves_to_the_remaining_nodes() {
    let mut c = Cluster::start("127.0.0.1");
    for n in ["node-a", "node-b", "node-c"] {
        c.agent(n, 4, &[], &[]);
    }
    c.wait_nodes(3);
    let id = c.submit(&c.rank_job("survivor", 2, 4));
    let j = c.wait_job(id, "run", 30, |j| state(j) == "running");
    let placed: Vec<String> = j["placement"]
        .as_array()
        .expect("placement")
        .iter()
        .map(|r| r["node"].as_str().unwrap_or("").to_string())
        .collect();
    wait_for("2 ranks", 20, || {
        (pids(&c.out, Some(0)).len() == 2).then_some(())
    });
    let lost = placed[1].clone();
    let kept = placed[0].clone();
    let mut agent = c.agents.remove(&lost).expect("agent");
    agent.kill().expect("SIGKILL the agent");
    let _ = agent.wait();
    wait_for("NotReady", 20, || {
        c.get("/v1/nodes")
            .as_array()?
            .iter()
            .find(|n| n["name"] == lost.as_str())
            .filter(|n| n["ready"] == false)
            .map(|_| ())
    });
    let j = c.wait_job(id, "run elsewhere", 40, |j| {
        j["attempt"] == 1 && state(j) == "running"
    });
    let now_on: Vec<&str> = j["placement"]
        .as_array()
        .expect("placement")
        .iter()
        .map(|r| r["node"].as_str().unwrap_or(""))
        .collect();
    assert!(
        !now_on.contains(&lost.as_str()),
        "rescheduled onto live nodes: {now_on:?}"
    );
    assert!(events(&j)
        .iter()
        .any(|(k, m)| k == "restarting" && m.contains(&format!("node {lost} lost"))));
    // The surviving node's rank of the lost attempt was stopped.
    let old = pids(&c.out, Some(0));
    let env0 = c.envs(0);
    for (rank, pid) in old {
        if env0.get(&rank).is_some_and(|e| e["GANGWAY_NODE"] == kept) {
            wait_for("old rank stopped", 10, || (!alive(pid)).then_some(()));
        }
    }
    // Running means started; a loaded machine may take a moment to run the script.
    wait_for(
        "both ranks of attempt 1 wrote their environment",
        20,
        || (c.envs(1).len() == 2).then_some(()),
    );
    check_gang_env(&c.envs(1), 2, 2, 4);
}

#[test]
fn an_unhealthy_gpu_is_never_assigned_until_it_recovers_or_is_cleared() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 4, &[], &[]);
    c.wait_nodes(1);
    let health = c.gpu_health_file("node-a");
    std::fs::write(&health, "2 XID 79: GPU has fallen off the bus\n").expect("health file");
    wait_for("GPU 2 unhealthy", 10, || {
        (c.node("node-a")["gpus"][2]["healthy"] == false).then_some(())
    });
    let mut spec = c.rank_job("whole-node", 1, 4);
    spec["run"]["env"]["STEPS"] = json!("1");
    let id = c.submit(&spec);
    let j = c.wait_job(id, "wait with a reason", 10, |j| j["reason"].is_string());
    assert_eq!(state(&j), "pending", "3 healthy GPUs cannot hold 4: {j}");
    // A 3-GPU job fits beside the bad GPU and never gets it.
    let mut small = c.rank_job("three", 1, 3);
    small["run"]["env"]["STEPS"] = json!("1");
    let small_id = c.submit(&small);
    let j = c.wait_job(small_id, "succeed", 30, |j| state(j) == "succeeded");
    let gpus = &j["placement"][0]["gpus"];
    assert!(
        !gpus.as_array().expect("gpus").contains(&json!(2)),
        "{gpus}"
    );
    // An admin clears it (the agent still says unhealthy, but has not changed its mind).
    c.post("/v1/nodes/node-a/gpus/2/clear");
    c.wait_job(id, "succeed after the clear", 30, |j| {
        state(j) == "succeeded"
    });
    // A new verdict from the agent counts again; recovery counts too.
    std::fs::write(&health, "").expect("recover");
    std::fs::write(&health, "1 ECC\n").expect("health");
    wait_for("GPU 1 unhealthy", 10, || {
        (c.node("node-a")["gpus"][1]["healthy"] == false).then_some(())
    });
    std::fs::remove_file(&health).expect("recover");
    wait_for("GPU 1 recovered", 10, || {
        (c.node("node-a")["gpus"][1]["healthy"] == true).then_some(())
    });
}

#[test]
fn one_users_failing_jobs_leave_every_node_in_service() {
    let mut c = Cluster::start("127.0.0.1");
    for n in ["node-a", "node-b", "node-c", "node-d"] {
        c.agent(n, 2, &[], &[]);
    }
    c.wait_nodes(4);
    // Twelve buggy one-GPU jobs, failing on every node they land on: the
    // job's bug, never the nodes'.
    let ids: Vec<u64> = (0..12)
        .map(|i| {
            c.submit(&json!({
                "name": format!("buggy-{i}"),
                "queue": "default",
                "replicas": 1,
                "resources": { "gpus": 1 },
                "restart": { "max_restarts": 1, "backoff_seconds": 0 },
                "run": { "command": ["sh", "-c", "echo my bug; exit 1"] }
            }))
        })
        .collect();
    for id in ids {
        c.wait_job(id, "fail", 60, |j| state(j) == "failed");
    }
    for n in ["node-a", "node-b", "node-c", "node-d"] {
        assert_eq!(c.node(n)["cordoned"], false, "{}", c.node(n));
    }
    // A healthy job still starts at once.
    let mut ok = c.rank_job("fine", 1, 1);
    ok["run"]["env"]["STEPS"] = json!("1");
    let id = c.submit(&ok);
    c.wait_job(id, "succeed", 30, |j| state(j) == "succeeded");
}

#[test]
fn a_gpu_lost_under_a_job_cordons_only_its_node_with_the_evidence() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 2, &[], &[]);
    c.agent("node-b", 2, &[], &[]);
    c.agent("node-c", 2, &[], &[]);
    c.wait_nodes(3);
    let spec = c.rank_job("victim", 1, 1);
    let id = c.submit(&spec);
    let j = c.wait_job(id, "run", 30, |j| state(j) == "running");
    let gpu = j["placement"][0]["gpus"][0].as_u64().expect("gpu");
    let node = c.lose_gpu_under(&j);
    wait_for("cordoned", 20, || {
        (c.node(&node)["cordoned"] == true).then_some(())
    });
    let n = c.node(&node);
    let why = n["cordon_reason"].as_str().unwrap_or_default();
    assert!(why.contains(&format!("GPU {gpu} lost")), "{n}");
    assert!(why.contains(&format!("jobs: {id}")), "{n}");
    assert!(why.contains("users: admin"), "{n}");
    for other in ["node-a", "node-b", "node-c"]
        .iter()
        .filter(|o| **o != node)
    {
        assert_eq!(c.node(other)["cordoned"], false, "only {node} is blamed");
    }
    // The audit log carries the evidence too.
    let audit = c.get("/v1/audit");
    assert!(
        audit.to_string().contains("auto-cordon: causes: GPU"),
        "{audit}"
    );
    // An admin uncordons it at once; the evidence is spent.
    c.post(&format!("/v1/nodes/{node}/uncordon"));
    assert_eq!(c.node(&node)["cordoned"], false);
    assert!(c.node(&node)["cordon_reason"].is_null());
    std::fs::write(c.out.join("stop"), "").expect("stop");
}

#[test]
fn gpus_lost_on_most_nodes_at_once_stop_auto_cordon_and_raise_the_alert() {
    let mut c = Cluster::start("127.0.0.1");
    let nodes = ["node-a", "node-b", "node-c", "node-d"];
    for n in nodes {
        c.agent(n, 1, &[], &[]);
    }
    c.wait_nodes(4);
    let ids: Vec<u64> = (0..4)
        .map(|i| c.submit(&c.rank_job(&format!("j{i}"), 1, 1)))
        .collect();
    for id in &ids {
        c.wait_job(*id, "run", 30, |j| state(j) == "running");
    }
    for n in nodes {
        c.lose_gpu(n, 0);
    }
    let metrics = || {
        ureq::get(&format!("{}/metrics", c.addr))
            .set("Authorization", &format!("Bearer {ADMIN}"))
            .call()
            .ok()
            .and_then(|r| r.into_string().ok())
            .unwrap_or_default()
    };
    wait_for("the alert", 20, || {
        metrics()
            .lines()
            .any(|l| l == "gangway_auto_cordon_halted 1")
            .then_some(())
    });
    // At most one node (the rate limit on 4 nodes) was cordoned before the halt.
    let cordoned = nodes
        .iter()
        .filter(|n| c.node(n)["cordoned"] == true)
        .count();
    assert!(cordoned <= 1, "{cordoned} nodes cordoned");
    let audit = c.get("/v1/audit").to_string();
    assert!(
        audit.contains("auto-cordon stopped, alert raised"),
        "{audit}"
    );
    std::fs::write(c.out.join("stop"), "").expect("stop");
}

#[test]
fn a_maintenance_reservation_keeps_its_node_empty_while_jobs_run_elsewhere() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 2, &[], &[]);
    c.agent("node-b", 2, &[], &[]);
    c.wait_nodes(2);
    let cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_gangway"))
            .args(args)
            .env("GANGWAY_ADDR", &c.addr)
            .env("GANGWAY_TOKEN", ADMIN)
            .output()
            .expect("run cli");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    cli(&[
        "reservation",
        "create",
        "--name",
        "maint1",
        "--nodes",
        "node-b",
        "--start",
        "now",
        "--duration",
        "1h",
    ]);
    let listed = cli(&["reservation", "list"]);
    assert!(
        listed.contains("maint1") && listed.contains("active") && listed.contains("node-b"),
        "{listed}"
    );
    // Three 2-GPU jobs: they run one after another on node-a; node-b stays empty.
    let ids: Vec<u64> = (0..3)
        .map(|i| {
            let mut spec = c.rank_job(&format!("m{i}"), 1, 2);
            spec["run"]["env"]["STEPS"] = json!("1");
            c.submit(&spec)
        })
        .collect();
    let waiting = c.wait_job(ids[2], "wait with a code", 20, |j| {
        j["reason_code"].is_string() || state(j) != "pending"
    });
    if state(&waiting) == "pending" {
        assert_eq!(waiting["reason_code"], "ReqNodeNotAvail", "{waiting}");
    }
    let queue = cli(&["queue", "--start"]);
    assert!(
        queue
            .lines()
            .next()
            .is_some_and(|h| h.contains("START") && h.contains("CODE")),
        "{queue}"
    );
    for id in &ids {
        let j = c.wait_job(*id, "succeed", 60, |j| state(j) == "succeeded");
        assert_eq!(j["ran_on"], json!(["node-a"]), "{j}");
    }
    let b = c.node("node-b");
    assert!(b["jobs"].as_array().is_some_and(Vec::is_empty), "{b}");
    cli(&["reservation", "delete", "maint1"]);
    assert!(!cli(&["reservation", "list"]).contains("maint1"));
}
