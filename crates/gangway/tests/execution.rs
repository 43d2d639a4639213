//! Execution truth with real processes: every process of a rank is the
//! rank's (escapees in their own sessions included), the grace period
//! belongs to the whole gang, the GPUs show free only when no process of a
//! job is left, and a restarted agent adopts its ranks instead of killing them.

mod common;

use common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// A launcher like torchrun: it starts two workers in sessions of their
/// own (`setsid`) that ignore SIGTERM and write a heartbeat every 0.1 s,
/// then waits. Killing the launcher's process group misses the workers.
const LAUNCHER: &str = r#"#!/bin/sh
key="$GANGWAY_ATTEMPT-$RANK"
echo $$ > "$OUT/pid-$key"
for w in 0 1; do
  setsid sh -c 'trap "" TERM; echo $$ > "$1.pid"; while :; do date +%s%N > "$1"; sleep 0.1; done' sh "$OUT/hb-$key-$w" &
done
wait
"#;

fn launcher_job(c: &Cluster, name: &str, replicas: u32, gpus: u32, grace: u64) -> Value {
    let script = c.dir.path().join("launcher.sh");
    std::fs::write(&script, LAUNCHER).expect("launcher");
    json!({
        "name": name,
        "queue": "default",
        "replicas": replicas,
        "resources": { "gpus": gpus },
        "restart": { "max_restarts": 3, "backoff_seconds": 0 },
        "checkpoint": { "grace_seconds": grace },
        "run": {
            "command": ["sh", script.display().to_string()],
            "env": { "OUT": c.out.display().to_string() }
        }
    })
}

/// The pids of the workers of one attempt (`hb-ATTEMPT-RANK-W.pid`).
fn workers(out: &Path, attempt: u32) -> Vec<u32> {
    let prefix = format!("hb-{attempt}-");
    let mut v = Vec::new();
    for e in std::fs::read_dir(out).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with(&prefix) && name.ends_with(".pid") {
            if let Ok(Ok(p)) = std::fs::read_to_string(e.path()).map(|s| s.trim().parse()) {
                v.push(p);
            }
        }
    }
    v.sort();
    v
}

/// Heartbeat contents of one attempt, by file.
fn heartbeats(out: &Path, attempt: u32) -> Vec<(String, String)> {
    let prefix = format!("hb-{attempt}-");
    let mut v: Vec<(String, String)> = std::fs::read_dir(out)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            (name.starts_with(&prefix) && !name.ends_with(".pid")).then(|| {
                let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                (name, text)
            })
        })
        .collect();
    v.sort();
    v
}

/// No heartbeat of the attempt changes any more (over a second, ten beats).
fn assert_no_heartbeat(out: &Path, attempt: u32) {
    let before = heartbeats(out, attempt);
    assert!(!before.is_empty(), "the workers wrote heartbeats");
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(heartbeats(out, attempt), before, "a worker still beats");
}

fn allocated(c: &Cluster, node: &str) -> usize {
    c.node(node)["gpus"].as_array().map_or(0, |g| {
        g.iter().filter(|g| g["allocated"] == json!(true)).count()
    })
}

/// `--proctrack cgroup-v2` where this host has a writable unified cgroup
/// hierarchy (the test then runs the agent with it), else the default.
fn cgroup_v2_flag() -> Vec<&'static str> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let Some(dir) = mounts
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.get(2) == Some(&"cgroup2"))
        .and_then(|f| f.get(1).map(|d| d.to_string()))
    else {
        eprintln!("no cgroup2 mount: the agent picks its process tracking");
        return vec![];
    };
    let probe = Path::new(&dir).join(format!("gangway-probe-{}", std::process::id()));
    if std::fs::create_dir(&probe).is_err() {
        eprintln!("cgroup2 at {dir} is not writable: the agent picks its process tracking");
        return vec![];
    }
    let _ = std::fs::remove_dir(&probe);
    vec!["--proctrack", "cgroup-v2"]
}

/// Waits until `n` workers of the attempt run.
fn wait_workers(c: &Cluster, attempt: u32, n: usize) -> Vec<u32> {
    wait_for("workers running", 30, || {
        let w = workers(&c.out, attempt);
        (w.len() == n && w.iter().all(|p| alive(*p))).then_some(w)
    })
}

#[test]
fn cancel_kills_setsid_workers_and_frees_the_gpus_only_when_they_are_gone() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 4, &[], &[]);
    c.wait_nodes(1);
    let id = c.submit(&launcher_job(&c, "launcher", 2, 2, 3));
    c.wait_job(id, "run", 30, |j| state(j) == "running");
    let w = wait_workers(&c, 0, 4);
    assert_eq!(allocated(&c, "node-a"), 4);
    let cancelled_at = Instant::now();
    c.post(&format!("/v1/jobs/{id}/cancel"));
    // Until the job is cancelled, whenever the GPUs show free no worker may
    // be alive (read the GPUs first, then the workers).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut saw_busy_while_alive = false;
    loop {
        let free = allocated(&c, "node-a") == 0;
        let any_alive = w.iter().any(|p| alive(*p));
        assert!(!(free && any_alive), "GPUs shown free while a worker runs");
        saw_busy_while_alive |= !free && any_alive;
        if free && state(&c.job(id)) == "cancelled" {
            break;
        }
        assert!(Instant::now() < deadline, "job {id}: {:#}", c.job(id));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        saw_busy_while_alive,
        "the workers outlived the cancel request"
    );
    // They ignore SIGTERM: only the kill at the end of the 3 s grace ended them.
    assert!(cancelled_at.elapsed() >= Duration::from_secs(3));
    assert!(w.iter().all(|p| !alive(*p)));
    assert_no_heartbeat(&c.out, 0);
    let ev = events(&c.job(id));
    assert!(
        ev.iter()
            .any(|(k, m)| k == "cancelling" && m.contains("3s to stop")),
        "{ev:?}"
    );
}

#[test]
fn a_gang_restart_kills_every_worker_of_the_old_attempt_first() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 4, &[], &cgroup_v2_flag());
    c.wait_nodes(1);
    let id = c.submit(&launcher_job(&c, "restart", 2, 2, 2));
    c.wait_job(id, "run", 30, |j| state(j) == "running");
    let w = wait_workers(&c, 0, 4);
    // Kill rank 1's launcher only: its workers live on, orphaned.
    let launcher1 = wait_for("launcher pid", 10, || {
        pids(&c.out, Some(0)).into_iter().find(|(r, _)| *r == 1)
    })
    .1;
    let _ = std::process::Command::new("kill")
        .args(["-9", &launcher1.to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let j = c.job(id);
        if j["attempt"] == 1 {
            // The new attempt exists only once nothing of the old one runs.
            assert!(
                w.iter().all(|p| !alive(*p)),
                "attempt 1 started beside attempt 0's workers"
            );
            break;
        }
        assert!(Instant::now() < deadline, "no restart: {j:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let j = c.wait_job(id, "run again", 30, |j| state(j) == "running");
    assert!(
        events(&j)
            .iter()
            .any(|(k, m)| k == "stopping" && m.starts_with("exited with code 137 on node-a")),
        "{:?}",
        events(&j)
    );
    assert_no_heartbeat(&c.out, 0);
    wait_workers(&c, 1, 4);
}

#[test]
fn grace_expiry_kills_the_escapees_of_a_preempted_gang() {
    let mut c = Cluster::start("127.0.0.1");
    // The fallback: the agent as child subreaper, following /proc.
    c.agent("node-a", 4, &[], &["--proctrack", "subreaper"]);
    c.wait_nodes(1);
    let mut low = launcher_job(&c, "victim", 1, 4, 2);
    low["priority"] = json!("low");
    let low_id = c.submit(&low);
    c.wait_job(low_id, "run", 30, |j| state(j) == "running");
    let w = wait_workers(&c, 0, 2);
    let mut prod = c.rank_job("urgent", 1, 4);
    prod["priority"] = json!("production");
    prod["run"]["env"]["STEPS"] = json!("5");
    let prod_id = c.submit(&prod);
    c.wait_job(low_id, "be requeued", 40, |j| {
        events(j).iter().any(|(k, _)| k == "requeued")
    });
    // Requeued means nothing of it is left, and only then does the preemptor run.
    assert!(w.iter().all(|p| !alive(*p)), "an escapee survived");
    assert_no_heartbeat(&c.out, 0);
    c.wait_job(prod_id, "succeed", 30, |j| state(j) == "succeeded");
}

/// Rank 0 saves for 5 s on SIGTERM; rank 1 dies at once. Both share a node,
/// so a node that reported "exited" at rank 1's exit would cut rank 0's save.
const SLOW_SAVER: &str = r#"#!/bin/sh
key="$GANGWAY_ATTEMPT-$RANK"
ck="$GANGWAY_CHECKPOINT_DIR/ckpt"
if [ -f "$ck" ]; then cp "$ck" "$OUT/resumed-$key"; fi
echo $$ > "$OUT/pid-$key"
if [ "$RANK" = 0 ]; then
  trap 'sleep 5; echo "saved by attempt $GANGWAY_ATTEMPT" > "$ck.tmp"; mv "$ck.tmp" "$ck"; exit 0' TERM
fi
while [ ! -e "$OUT/stop" ]; do sleep 0.1; done
"#;

#[test]
fn one_slow_saver_keeps_its_gangs_grace_while_the_others_die_at_once() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 4, &[], &[]);
    c.wait_nodes(1);
    let script = c.dir.path().join("saver.sh");
    std::fs::write(&script, SLOW_SAVER).expect("script");
    let low = json!({
        "name": "saver",
        "queue": "default",
        "priority": "low",
        "replicas": 2,
        "resources": { "gpus": 2 },
        "checkpoint": { "grace_seconds": 30 },
        "run": {
            "command": ["sh", script.display().to_string()],
            "env": { "OUT": c.out.display().to_string() }
        }
    });
    let low_id = c.submit(&low);
    c.wait_job(low_id, "run", 30, |j| state(j) == "running");
    wait_for("both ranks", 20, || {
        (pids(&c.out, Some(0)).len() == 2).then_some(())
    });
    let mut prod = c.rank_job("urgent", 1, 4);
    prod["priority"] = json!("production");
    prod["run"]["env"]["STEPS"] = json!("5");
    let prod_id = c.submit(&prod);
    let j = c.wait_job(low_id, "be requeued", 40, |j| {
        events(j).iter().any(|(k, _)| k == "requeued")
    });
    let ckpt = c
        .dir
        .path()
        .join(format!("checkpoints/admin/job-{low_id}/ckpt"));
    let saved = std::fs::read_to_string(&ckpt).expect("rank 0 finished its 5 s save");
    assert_eq!(saved.trim(), "saved by attempt 0");
    let ev = events(&j);
    let at = |kind: &str| {
        j["events"]
            .as_array()
            .and_then(|e| e.iter().find(|e| e["kind"] == kind))
            .and_then(|e| e["at"].as_u64())
            .unwrap_or(0)
    };
    assert!(at("requeued") >= at("preempting") + 5, "{ev:?}");
    c.wait_job(prod_id, "succeed", 30, |j| state(j) == "succeeded");
    c.wait_job(low_id, "run again", 30, |j| {
        state(j) == "running" && j["attempt"] == 1
    });
    // Read once the rank's copy is whole: `cp` creates the file before it
    // writes it (read empty under load, once, in CI).
    let resumed = wait_for("resume", 20, || {
        std::fs::read_to_string(c.out.join("resumed-1-0"))
            .ok()
            .filter(|s| s.ends_with('\n'))
    });
    assert_eq!(
        resumed.trim(),
        "saved by attempt 0",
        "resumed from the checkpoint"
    );
    std::fs::write(c.out.join("stop"), "").expect("stop");
    c.wait_job(low_id, "succeed", 30, |j| state(j) == "succeeded");
}

fn kill_agent(c: &mut Cluster, node: &str) {
    let mut agent = c.agents.remove(node).expect("agent");
    agent.kill().expect("SIGKILL the agent");
    let _ = agent.wait();
}

/// Node-a tracks with cgroups (auto) and is stopped cleanly with
/// `--leave-ranks-on-exit`; node-b tracks as child subreaper and is killed:
/// both adopt.
#[test]
fn a_restarted_agent_adopts_its_running_ranks_and_the_job_finishes_normally() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 4, &[], &["--leave-ranks-on-exit"]);
    c.agent("node-b", 4, &[], &["--proctrack", "subreaper"]);
    c.wait_nodes(2);
    let id = c.submit(&c.rank_job("steady", 8, 1));
    c.wait_job(id, "run", 30, |j| state(j) == "running");
    let first = wait_for("8 ranks", 20, || {
        let p = pids(&c.out, Some(0));
        (p.len() == 8).then_some(p)
    });
    // Both agents go and come back while the gang runs: node-a stopped
    // cleanly for an upgrade (SIGTERM with --leave-ranks-on-exit), node-b killed.
    let mut a = c.agents.remove("node-a").expect("agent");
    let _ = std::process::Command::new("kill")
        .arg(a.id().to_string())
        .status();
    let _ = a.wait();
    kill_agent(&mut c, "node-b");
    assert!(
        first.iter().all(|(_, p)| alive(*p)),
        "ranks run on, orphaned"
    );
    c.agent("node-a", 4, &[], &["--leave-ranks-on-exit"]);
    c.agent("node-b", 4, &[], &["--proctrack", "subreaper"]);
    c.wait_nodes(2);
    // Several syncs later the same processes run, still attempt 0.
    let seen = |n: &str| c.node(n)["last_heartbeat"].as_u64().unwrap_or(0);
    let t0 = (seen("node-a"), seen("node-b"));
    wait_for("fresh heartbeats", 20, || {
        (seen("node-a") > t0.0 + 1 && seen("node-b") > t0.1 + 1).then_some(())
    });
    assert!(first.iter().all(|(_, p)| alive(*p)), "adopted, not killed");
    let j = c.job(id);
    assert_eq!(
        (state(&j), j["attempt"].as_u64()),
        ("running", Some(0)),
        "{j:#}"
    );
    // node-b's agent dies again and its ranks finish while it is down: the
    // restarted agent learns their exit codes from their supervisors' files.
    kill_agent(&mut c, "node-b");
    std::fs::write(c.out.join("stop"), "").expect("stop");
    wait_for("every rank finished", 20, || {
        first.iter().all(|(_, p)| !alive(*p)).then_some(())
    });
    c.agent("node-b", 4, &[], &["--proctrack", "subreaper"]);
    let j = c.wait_job(id, "succeed", 30, |j| state(j) == "succeeded");
    assert_eq!(j["attempt"], 0, "never restarted");
    assert_eq!(j["restarts"], 0);
    assert_eq!(pids(&c.out, Some(1)), vec![], "no second attempt ran");
}

/// Docker ranks: a restarted agent adopts its containers by label (the same
/// containers keep running) and the job still finishes as attempt 0.
#[test]
fn a_restarted_agent_adopts_its_containers() {
    if let Err(why) = busybox_image() {
        return skip_or_fail("GANGWAY_REQUIRE_DOCKER", &why);
    }
    let node = format!("dock-adopt-{}", std::process::id());
    // The rank writes to the test's output directory: a mount the queue must allow.
    let mut c = Cluster::start_with("127.0.0.1", &server_config(&tmp_mounts("")));
    c.agent(&node, 2, &[], &["--executor", "docker"]);
    c.wait_nodes(1);
    let out = c.out.display().to_string();
    let spec = json!({
        "name": "docker-steady",
        "queue": "default",
        "replicas": 2,
        "resources": { "gpus": 1 },
        "run": {
            "image": IMAGE,
            "command": ["sh", "-c", "touch \"$OUT/up-$RANK\"; while [ ! -e \"$OUT/stop\" ]; do sleep 0.2; done; echo done"],
            "env": { "OUT": out },
            "mounts": [{ "source": out, "target": out }]
        }
    });
    let id = c.submit(&spec);
    c.wait_job(id, "run", 60, |j| state(j) == "running");
    let containers = || {
        let o = std::process::Command::new("docker")
            .args(["ps", "-q", "--no-trunc", "--filter"])
            .arg(format!("label=gangway.node={node}"))
            .output()
            .expect("docker ps");
        let mut ids: Vec<String> = String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(str::to_string)
            .collect();
        ids.sort();
        ids
    };
    let first = wait_for("two containers", 30, || {
        let ids = containers();
        (ids.len() == 2).then_some(ids)
    });
    kill_agent(&mut c, &node);
    c.agent(&node, 2, &[], &["--executor", "docker"]);
    c.wait_nodes(1);
    let seen = || c.node(&node)["last_heartbeat"].as_u64().unwrap_or(0);
    let t0 = seen();
    wait_for("fresh heartbeats", 20, || (seen() > t0 + 1).then_some(()));
    assert_eq!(containers(), first, "the same containers run on");
    assert_eq!(c.job(id)["attempt"], 0);
    std::fs::write(c.out.join("stop"), "").expect("stop");
    let j = c.wait_job(id, "succeed", 60, |j| state(j) == "succeeded");
    assert_eq!(j["attempt"], 0, "never restarted: {:?}", events(&j));
    assert!(containers().is_empty(), "removed once exited");
}

/// Docker ranks: the checkpoint signal reaches every process of the
/// container, not only its PID 1 (which, as a namespace's init without a
/// handler, ignores it); the rest is killed at the end of the grace.
#[test]
fn a_cancelled_container_rank_signals_every_process_in_it() {
    if let Err(why) = busybox_image() {
        return skip_or_fail("GANGWAY_REQUIRE_DOCKER", &why);
    }
    let node = format!("dock-signal-{}", std::process::id());
    // The rank writes to the test's output directory: a mount the queue must allow.
    let mut c = Cluster::start_with("127.0.0.1", &server_config(&tmp_mounts("")));
    c.agent(&node, 1, &[], &["--executor", "docker"]);
    c.wait_nodes(1);
    let out = c.out.display().to_string();
    let worker = r#"trap 'touch "$OUT/worker-got-term"; exit 0' TERM; touch "$OUT/worker-up"; while :; do sleep 0.1; done"#;
    let spec = json!({
        "name": "docker-signal",
        "queue": "default",
        "replicas": 1,
        "resources": { "gpus": 1 },
        "checkpoint": { "grace_seconds": 3 },
        "run": {
            "image": IMAGE,
            "command": ["sh", "-c", format!("sh -c '{}' & while :; do sleep 1; done", worker.replace('\'', "'\\''"))],
            "env": { "OUT": out },
            "mounts": [{ "source": out, "target": out }]
        }
    });
    let id = c.submit(&spec);
    c.wait_job(id, "run", 60, |j| state(j) == "running");
    wait_for("worker up", 30, || {
        c.out.join("worker-up").exists().then_some(())
    });
    c.post(&format!("/v1/jobs/{id}/cancel"));
    c.wait_job(id, "cancelled", 40, |j| state(j) == "cancelled");
    assert!(
        c.out.join("worker-got-term").exists(),
        "the worker got the checkpoint signal"
    );
}

/// A job cancelled while its node's agent is down: the restarted agent
/// (child subreaper, so the workers' re-parenting to init is the hard case)
/// adopts the launcher and its `setsid` workers, then stops all of them.
#[test]
fn a_job_cancelled_while_its_agent_was_down_is_stopped_whole_after_adoption() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 4, &[], &["--proctrack", "subreaper"]);
    c.wait_nodes(1);
    let id = c.submit(&launcher_job(&c, "orphaned", 1, 4, 2));
    c.wait_job(id, "run", 30, |j| state(j) == "running");
    let w = wait_workers(&c, 0, 2);
    kill_agent(&mut c, "node-a");
    c.post(&format!("/v1/jobs/{id}/cancel"));
    assert_eq!(allocated(&c, "node-a"), 4, "booked while its workers run");
    c.agent("node-a", 4, &[], &["--proctrack", "subreaper"]);
    let j = c.wait_job(id, "cancelled", 40, |j| state(j) == "cancelled");
    assert!(w.iter().all(|p| !alive(*p)), "an adopted worker survived");
    assert_no_heartbeat(&c.out, 0);
    assert_eq!(allocated(&c, "node-a"), 0);
    assert!(
        !events(&j).iter().any(|(_, m)| m.contains("lost")),
        "the node came back in time: {:?}",
        events(&j)
    );
}

/// Whether this host lets the agent limit a rank's memory with a cgroup.
fn memory_cgroup() -> bool {
    std::path::Path::new("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists()
        || std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
            .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"))
}

#[test]
fn a_rank_killed_by_the_oom_killer_is_named_so() {
    if !memory_cgroup() {
        return skip_or_fail(
            "GANGWAY_REQUIRE_OOM",
            "no writable memory cgroup controller on this host",
        );
    }
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 2, &[], &[]);
    c.wait_nodes(1);
    // `tail` keeps a line with no end in memory: far past the 32 MiB limit.
    let id = c.submit(&json!({
        "name": "hungry", "queue": "default", "replicas": 1,
        "resources": { "gpus": 1, "memory_mib": 32 },
        "restart": { "max_restarts": 0 },
        "run": { "command": ["sh", "-c", "head -c 500000000 /dev/zero | tail > /dev/null"] }
    }));
    let j = c.wait_job(id, "fail", 60, |j| {
        matches!(state(j), "failed" | "succeeded")
    });
    assert_eq!(state(&j), "failed", "{j:#}");
    assert_eq!(j["failure"]["oom_killed"], true, "{j:#}");
    assert!(
        events(&j)
            .iter()
            .any(|(k, m)| k == "failed" && m.contains("OOM-killed")),
        "{:?}",
        events(&j)
    );
}

/// A rank that runs until `$OUT/stop`, then (with `FINAL` set) announces
/// the job's final checkpoint, and exits 0.
const FINISHING: &str = r#"#!/bin/sh
echo $$ > "$OUT/rank-$GANGWAY_JOB_ID"
while [ ! -e "$OUT/stop" ]; do sleep 0.1; done
if [ -n "$FINAL" ]; then
  echo '{"step": 60, "path": "step-60", "final": true}' > "$GANGWAY_CHECKPOINT_DIR/LATEST.tmp"
  mv "$GANGWAY_CHECKPOINT_DIR/LATEST.tmp" "$GANGWAY_CHECKPOINT_DIR/LATEST"
fi
echo "DONE 60 steps"
"#;

/// Pids of the processes whose command line starts with `prefix` (words
/// joined by spaces, as `pgrep -f` reads them).
fn cmdline_pids(prefix: &str) -> Vec<u32> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(raw) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let line = String::from_utf8_lossy(&raw).replace('\0', " ");
        if line.starts_with(prefix) {
            v.push(pid);
        }
    }
    v
}

/// The usual way to kill an agent, `pkill -9 -f "gangway agent.*NODE"`,
/// matches the agent only: each supervisor's command line is
/// `gangway-rank JOB/ATTEMPT/RANK`. Then the supervisors are SIGKILLed as
/// well, so nobody can learn the ranks' exit codes: the job that announced
/// its final checkpoint succeeds on attempt 0 with no restart spent; the
/// one that did not fails as "exit code unknown: supervisor lost".
#[test]
fn ranks_that_finish_after_their_agent_and_supervisors_were_killed_are_judged_by_what_they_left() {
    let mut c = Cluster::start("127.0.0.1");
    let node = format!("suplost-{}", std::process::id());
    c.agent(&node, 2, &[], &[]);
    c.wait_nodes(1);
    let script = c.dir.path().join("finishing.sh");
    std::fs::write(&script, FINISHING).expect("script");
    let job = |name: &str, fin: bool| {
        let mut env = json!({ "OUT": c.out.display().to_string() });
        if fin {
            env["FINAL"] = json!("1");
        }
        json!({
            "name": name, "queue": "default", "replicas": 1,
            "resources": { "gpus": 1 },
            "restart": { "max_restarts": 0 },
            "run": { "command": ["sh", script.display().to_string()], "env": env }
        })
    };
    let done = c.submit(&job("finishes", true));
    let silent = c.submit(&job("silent", false));
    for id in [done, silent] {
        c.wait_job(id, "run", 30, |j| state(j) == "running");
    }
    let rank_pid = |id: u64| {
        wait_for("rank pid", 10, || {
            std::fs::read_to_string(c.out.join(format!("rank-{id}")))
                .ok()
                .and_then(|t| t.trim().parse::<u32>().ok())
        })
    };
    let ranks = [rank_pid(done), rank_pid(silent)];
    // This agent's children (other tests' clusters have jobs 1 and 2 too).
    let agent_pid = c.agents[&node].id();
    let parent = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit(')')
                    .next()?
                    .split_whitespace()
                    .nth(1)?
                    .parse::<u32>()
                    .ok()
            })
    };
    let sups: Vec<u32> = [done, silent]
        .iter()
        .flat_map(|id| cmdline_pids(&format!("gangway-rank {id}/0/0")))
        .filter(|p| parent(*p) == Some(agent_pid))
        .collect();
    assert_eq!(sups.len(), 2, "one supervisor per rank, named gangway-rank");
    // pkill -f's pattern for the agent names the agent alone.
    let matched = Command::new("pgrep")
        .args(["-f", &format!("gangway agent.*{node}")])
        .output()
        .expect("pgrep");
    let matched: Vec<u32> = String::from_utf8_lossy(&matched.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert_eq!(matched, vec![agent_pid], "only the agent matches");
    // Agent and supervisors die together; the ranks run on and finish.
    kill_agent(&mut c, &node);
    for s in &sups {
        let _ = Command::new("kill").args(["-9", &s.to_string()]).status();
    }
    std::fs::write(c.out.join("stop"), "").expect("stop");
    wait_for("ranks finished", 10, || {
        ranks.iter().all(|p| !alive(*p)).then_some(())
    });
    c.agent(&node, 2, &[], &[]);
    let j = c.wait_job(done, "succeed", 30, |j| {
        matches!(state(j), "succeeded" | "failed" | "restarting")
    });
    assert_eq!(state(&j), "succeeded", "{j:#}");
    assert_eq!(
        (j["attempt"].as_u64(), j["restarts"].as_u64()),
        (Some(0), Some(0))
    );
    let j = c.wait_job(silent, "fail", 30, |j| {
        matches!(state(j), "succeeded" | "failed")
    });
    assert_eq!(state(&j), "failed", "{j:#}");
    assert!(
        events(&j)
            .iter()
            .any(|(k, m)| k == "failed" && m.starts_with("exit code unknown: supervisor lost on")),
        "{:?}",
        events(&j)
    );
}
