//! The job contract end to end, with a real server, real agents and real
//! rank processes: the checkpoint handshake (through the stdlib Python
//! helper in examples/), rendezvous ports, time limits and naming what failed.

mod common;

use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The Python interpreter, resolved to its real path (ranks get a plain PATH).
fn python() -> Option<String> {
    // Ranks run as an unprivileged account: the system interpreter, which it
    // can run, before one under a private home directory (pyenv).
    if Path::new("/usr/bin/python3").exists() {
        return Some("/usr/bin/python3".into());
    }
    let out = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .ok()?;
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !p.is_empty()).then_some(p)
}

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

/// A training rank using examples/gangway_checkpoint.py: records its
/// environment, resumes from `resume_from()`, counts steps of 0.1 s, saves
/// at step start+5 and on SIGTERM, and keeps running after the SIGTERM save
/// (so only a stop that follows the checkpoint report ends it early).
const TRAIN_PY: &str = r#"
import json, os, signal, sys, time
sys.path.insert(0, os.environ["EXAMPLES"])
import gangway_checkpoint as gc
out, attempt, rank = os.environ["OUT"], os.environ["GANGWAY_ATTEMPT"], os.environ["RANK"]
tag = os.environ.get("TAG", "a")
with open(f"{out}/env-{tag}-{attempt}-{rank}", "w") as f:
    json.dump(dict(os.environ), f)
start = 0
path = gc.resume_from()
if path:
    with open(path) as f:
        start = json.load(f)["step"]
    with open(f"{out}/resumed-{tag}-{attempt}", "w") as f:
        f.write(str(start))
step = start
def save(s):
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump({"step": s}, f)
    gc.save(s, write)
def on_term(*_):
    save(step)
    with open(f"{out}/saved-on-signal-{tag}-{attempt}", "w") as f:
        f.write(str(step))
signal.signal(signal.SIGTERM, on_term)
print(f"rank {rank} starting at step {start}", flush=True)
while not os.path.exists(f"{out}/stop-{tag}"):
    time.sleep(0.1)
    step += 1
    if step == start + 5:
        save(step)
print(f"rank {rank} done at step {step}", flush=True)
"#;

fn read_json(p: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(p).ok()?).ok()
}

#[test]
fn checkpoints_reported_through_latest_drive_events_early_stop_and_resume() {
    let Some(py) = python() else {
        return skip_or_fail("GANGWAY_REQUIRE_PYTHON3", "no python3");
    };
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 4, &[], &[]);
    c.wait_nodes(1);
    let script = c.dir.path().join("train.py");
    std::fs::write(&script, TRAIN_PY).expect("script");
    let spec = |tag: &str| {
        json!({
            "name": format!("train-{tag}"),
            "queue": "default",
            "replicas": 1,
            "resources": { "gpus": 4 },
            "priority": "low",
            "restart": { "max_restarts": 0, "backoff_seconds": 0 },
            // A long grace: only the checkpoint report can end it early.
            "checkpoint": { "grace_seconds": 120, "dir": "exp/run1" },
            "run": {
                "command": [py, script.display().to_string()],
                "env": {
                    "OUT": c.out.display().to_string(),
                    "EXAMPLES": examples().display().to_string(),
                    "PYTHONDONTWRITEBYTECODE": "1",
                    "TAG": tag,
                }
            }
        })
    };
    let a = c.submit(&spec("a"));
    // The periodic checkpoint at step 5 shows in the events with its step.
    let j = c.wait_job(a, "report a checkpoint", 60, |j| {
        events(j)
            .iter()
            .any(|(k, m)| k == "checkpoint" && m.starts_with("checkpoint at step 5 "))
    });
    let dir = c.dir.path().join("checkpoints/admin/exp/run1");
    assert_eq!(j["checkpoint"]["step"], 5);
    assert_eq!(
        j["checkpoint"]["path"],
        dir.join("step-5").display().to_string()
    );
    // A production job preempts it: the rank saves on SIGTERM and keeps
    // running; the gang is stopped as soon as that checkpoint is reported.
    let prod = c.submit(&json!({
        "name": "urgent", "queue": "default", "replicas": 1,
        "resources": { "gpus": 4 }, "priority": "production",
        "run": { "command": ["sh", "-c", "sleep 1"] }
    }));
    let signalled = Instant::now();
    let j = c.wait_job(a, "be requeued", 60, |j| {
        events(j).iter().any(|(k, _)| k == "requeued")
    });
    let stop_took = signalled.elapsed();
    eprintln!(
        "preempted gang requeued {stop_took:?} after the preemptor was submitted (grace 120 s)"
    );
    assert!(
        stop_took < Duration::from_secs(60),
        "stopped long before its 120 s grace"
    );
    let saved: u64 = std::fs::read_to_string(c.out.join("saved-on-signal-a-0"))
        .expect("saved on the signal")
        .parse()
        .expect("step");
    let ev = events(&j);
    let requeued = ev
        .iter()
        .find(|(k, _)| k == "requeued")
        .map(|e| e.1.clone())
        .unwrap_or_default();
    assert!(
        requeued.contains(&format!("checkpoint at step {saved} (")),
        "{ev:?}"
    );
    assert!(requeued.contains("after the signal"), "{ev:?}");
    let resume = dir.join(format!("step-{saved}")).display().to_string();
    assert!(
        requeued.ends_with(&format!("will resume from {resume}")),
        "{ev:?}"
    );
    c.wait_job(prod, "succeed", 60, |j| state(j) == "succeeded");
    // The resumed attempt is told where to resume, and does.
    c.wait_job(a, "run again", 60, |j| {
        state(j) == "running" && j["attempt"] == 1
    });
    let env = wait_for("attempt 1 env", 30, || read_json(&c.out.join("env-a-1-0")));
    assert_eq!(env["GANGWAY_RESUME_FROM"], resume.as_str());
    assert_eq!(
        env["GANGWAY_CHECKPOINT_DIR"],
        dir.display().to_string().as_str()
    );
    let resumed: u64 = wait_for("resumed", 30, || {
        std::fs::read_to_string(c.out.join("resumed-a-1"))
            .ok()?
            .parse()
            .ok()
    });
    assert_eq!(resumed, saved);
    let (ok, out, err) = c.gangway(&["describe", &a.to_string()]);
    assert!(ok, "{err}");
    assert!(
        out.contains("  last checkpoint: step ") && out.contains("rendezvous port "),
        "{out}"
    );
    // Cancelled, the job leaves its checkpoints; a new job naming the same
    // checkpoint.dir resumes from them, and its success removes them.
    c.post(&format!("/v1/jobs/{a}/cancel"));
    let b = c.submit(&spec("b"));
    c.wait_job(b, "run", 60, |j| state(j) == "running");
    let env = wait_for("job b env", 30, || read_json(&c.out.join("env-b-0-0")));
    let from = env["GANGWAY_RESUME_FROM"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(from.starts_with(&dir.display().to_string()), "{env}");
    let b_start: u64 = wait_for("b resumed", 30, || {
        std::fs::read_to_string(c.out.join("resumed-b-0"))
            .ok()?
            .parse()
            .ok()
    });
    assert!(b_start >= saved, "resumed at {b_start}, saved {saved}");
    std::fs::write(c.out.join("stop-b"), "").expect("stop");
    c.wait_job(b, "succeed", 60, |j| state(j) == "succeeded");
    wait_for("checkpoints removed after success", 30, || {
        (!dir.exists()).then_some(())
    });
}

/// Rank 0 listens on MASTER_PORT and checks that every peer is of its own
/// job; the others connect (retrying) and present their job id.
const RENDEZVOUS_PY: &str = r#"
import os, socket, sys, time
job, rank, world = os.environ["GANGWAY_JOB_ID"], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
port = int(os.environ["MASTER_PORT"])
with open(os.path.join(os.environ["OUT"], f"port-{job}-{os.environ['GANGWAY_ATTEMPT']}-{rank}"), "w") as f:
    f.write(str(port))
if rank == 0:
    s = socket.socket()
    # As torch's TCPStore does: the TIME_WAIT sockets of an earlier job on
    # this port do not keep it busy.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("0.0.0.0", port))
    except OSError as e:
        print(f"cannot bind {port}: {e}", flush=True)
        sys.exit(4)
    s.listen(64)
    s.settimeout(90)
    for _ in range(world - 1):
        conn, _ = s.accept()
        peer = conn.recv(64).decode()
        if peer != job:
            print(f"job {peer} reached job {job}'s rendezvous on {port}", flush=True)
            sys.exit(3)
        conn.sendall(b"ok")
        conn.close()
    print(f"rendezvous of job {job} on {port} complete", flush=True)
else:
    deadline = time.time() + 90
    while True:
        try:
            c = socket.create_connection((os.environ["MASTER_ADDR"], port), timeout=5)
            c.sendall(job.encode())
            if c.recv(8) != b"ok":
                sys.exit(5)
            break
        except OSError:
            if time.time() > deadline:
                sys.exit(6)
            time.sleep(0.2)
"#;

#[test]
fn fifty_gangs_rendezvous_on_one_node_without_port_collisions() {
    let Some(py) = python() else {
        return skip_or_fail("GANGWAY_REQUIRE_PYTHON3", "no python3");
    };
    // A small range (below the ephemeral one), so collisions would show.
    let (first, last) = (28_100u16, 28_199u16);
    let mut c = Cluster::start_with(
        "127.0.0.1",
        &format!(
            "master_ports: {{ first: {first}, last: {last} }}\n{}",
            server_config("")
        ),
    );
    // A foreign process holds ports at the start of the range (where the
    // first jobs' ports fall), and Gangway is not told.
    let held: Vec<std::net::TcpListener> = (first..first + 15)
        .filter_map(|p| std::net::TcpListener::bind(("0.0.0.0", p)).ok())
        .collect();
    let held_ports: Vec<u16> = held
        .iter()
        .filter_map(|l| l.local_addr().ok().map(|a| a.port()))
        .collect();
    assert!(!held_ports.is_empty());
    // 64 GPUs: 32 gangs of 2 run at once, the rest as GPUs free up.
    c.agent("node-a", 64, &[], &[]);
    c.wait_nodes(1);
    let script = c.dir.path().join("rdzv.py");
    std::fs::write(&script, RENDEZVOUS_PY).expect("script");
    let ids: Vec<u64> = (0..50)
        .map(|i| {
            c.submit(&json!({
                "name": format!("rdzv-{i}"),
                "queue": "default",
                "replicas": 2,
                "resources": { "gpus": 1, "cpu_millis": 100 },
                "restart": { "max_restarts": 0, "backoff_seconds": 0 },
                "run": {
                    "command": [py, script.display().to_string()],
                    "env": { "OUT": c.out.display().to_string() }
                }
            }))
        })
        .collect();
    let started = Instant::now();
    let mut moved = 0;
    for id in &ids {
        let j = c.wait_job(*id, "succeed", 180, |j| {
            matches!(state(j), "succeeded" | "failed")
        });
        assert_eq!(state(&j), "succeeded", "{j:#}");
        if events(&j)
            .iter()
            .any(|(k, m)| k == "rendezvous" && m.contains("is in use on node-a"))
        {
            moved += 1;
        }
    }
    eprintln!(
        "50 gangs of 2 rendezvoused in {:?}; {moved} moved off a foreign port",
        started.elapsed()
    );
    assert!(moved >= 1, "some job met a foreign port and moved");
    // Every attempt that ran used a port of the range that nobody else held.
    let mut final_ports = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(&c.out).expect("out").flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix("port-") else {
            continue;
        };
        let parts: Vec<u64> = rest.split('-').filter_map(|x| x.parse().ok()).collect();
        let port: u16 = std::fs::read_to_string(e.path())
            .expect("port")
            .parse()
            .expect("number");
        assert!((first..=last).contains(&port), "{port} outside the range");
        assert!(
            !held_ports.contains(&port),
            "{port} is held by another process"
        );
        if let [job, attempt, _rank] = parts[..] {
            let prev = final_ports.insert((job, attempt), port);
            assert!(prev.is_none_or(|p| p == port), "one port per attempt");
        }
    }
    // (Two gangs given one port at once would have failed above: rank 0
    // cannot bind, or a stranger reaches its rendezvous.)
    assert_eq!(
        final_ports.len(),
        50,
        "one attempt ran per job: {final_ports:?}"
    );
    drop(held);
}

#[test]
fn a_job_past_its_time_limit_ends_as_timeout_and_queues_bound_limits() {
    let queue = "  - name: limited\n    time_limit: { default: \"0:00:03\", max: 60 }\n";
    let mut c = Cluster::start_with("127.0.0.1", &server_config(queue));
    c.agent("node-a", 2, &[], &[]);
    c.wait_nodes(1);
    let body = |queue: &str, limit: Option<Value>| {
        let mut v = json!({
            "name": "hang", "queue": queue, "replicas": 1, "resources": { "gpus": 1 },
            "checkpoint": { "grace_seconds": 30 },
            "run": { "command": ["sh", "-c",
                "trap 'echo saving; exit 0' TERM; echo started; while :; do sleep 0.1; done"] }
        });
        if let Some(l) = limit {
            v["time_limit"] = l;
        }
        v
    };
    // Above the queue's maximum: refused, naming the field.
    let r = ureq::post(&format!("{}/v1/jobs", c.addr))
        .set("Authorization", &format!("Bearer {ADMIN}"))
        .send_json(body("limited", Some(json!("2h"))));
    match r {
        Err(ureq::Error::Status(422, resp)) => {
            let text = resp.into_string().unwrap_or_default();
            assert!(
                text.contains("time_limit: 2:00:00 exceeds the maximum of queue limited"),
                "{text}"
            );
        }
        other => panic!("expected 422, got {other:?}"),
    }
    // Malformed: refused.
    let r = ureq::post(&format!("{}/v1/jobs", c.addr))
        .set("Authorization", &format!("Bearer {ADMIN}"))
        .send_json(body("default", Some(json!("soon"))));
    assert!(matches!(r, Err(ureq::Error::Status(422, _))), "{r:?}");
    // A checkpoint directory that would leave the owner's namespace: refused.
    let mut escape = body("default", None);
    escape["checkpoint"]["dir"] = json!("../bob/run");
    match ureq::post(&format!("{}/v1/jobs", c.addr))
        .set("Authorization", &format!("Bearer {ADMIN}"))
        .send_json(escape)
    {
        Err(ureq::Error::Status(422, resp)) => {
            let v: Value = resp.into_json().expect("json");
            assert_eq!(
                v["error"],
                "checkpoint.dir: \"../bob/run\" must not contain '.' or '..' components"
            );
        }
        other => panic!("expected 422, got {other:?}"),
    }
    // One with its own limit, one with the queue's default.
    let own = c.submit(&body("default", Some(json!("0:00:02"))));
    let dflt = c.submit(&body("limited", None));
    for (id, limit) in [(own, "0:00:02"), (dflt, "0:00:03")] {
        let j = c.wait_job(id, "time out", 60, |j| state(j) == "timeout");
        let ev = events(&j);
        assert!(
            ev.iter().any(|(k, m)| k == "time_limit"
                && m.starts_with(&format!(
                    "time limit {limit} reached; checkpoint signal sent"
                ))),
            "{ev:?}"
        );
        let last = ev.last().cloned().unwrap_or_default();
        assert_eq!(last.0, "timeout", "{ev:?}");
        // It exited on the signal by itself, well inside its 30 s grace.
        assert!(last.1.contains("(exit code 0)"), "{ev:?}");
        assert!(last.1.contains("no checkpoint reported"), "{ev:?}");
    }
    assert_eq!(c.job(dflt)["spec"]["time_limit"], 3);
    let (ok, out, err) = c.gangway(&["describe", &dflt.to_string()]);
    assert!(ok, "{err}");
    assert!(out.contains("state timeout"), "{out}");
    assert!(out.contains("  time limit 0:00:03\n"), "{out}");
    // The GPUs are free again: a new job runs.
    let after = c.submit(&json!({
        "name": "after", "queue": "default", "replicas": 1, "resources": { "gpus": 2 },
        "run": { "command": ["true"] }
    }));
    c.wait_job(after, "succeed", 60, |j| state(j) == "succeeded");
}

#[test]
fn the_first_failing_rank_is_named_in_events_describe_and_logs() {
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 2, &[], &[]);
    c.agent("node-b", 2, &[], &[]);
    c.wait_nodes(2);
    let rank = "echo \"rank $RANK up\"; if [ \"$RANK\" = 3 ]; then echo 'loading shard 3'; \
                echo 'RuntimeError: CUDA out of memory' >&2; exit 7; fi; \
                while [ ! -e \"$OUT/stop\" ]; do sleep 0.1; done";
    let id = c.submit(&json!({
        "name": "fragile", "queue": "default", "replicas": 4, "resources": { "gpus": 1 },
        "topology": "any",
        "restart": { "max_restarts": 0, "backoff_seconds": 0 },
        "checkpoint": { "grace_seconds": 5 },
        "run": { "command": ["sh", "-c", rank], "env": { "OUT": c.out.display().to_string() } }
    }));
    let j = c.wait_job(id, "fail", 60, |j| state(j) == "failed");
    let node = j["failure"]["node"]
        .as_str()
        .expect("failure node")
        .to_string();
    let ran_on: Vec<String> = j["ran_on"]
        .as_array()
        .expect("ran_on")
        .iter()
        .map(|n| n.as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(node, ran_on[3], "rank 3's node");
    assert_eq!(j["failure"]["rank"], 3, "{j:#}");
    assert_eq!(j["failure"]["exit_code"], 7);
    let ev = events(&j);
    let failed = ev.last().cloned().unwrap_or_default();
    assert_eq!(failed.0, "failed");
    assert!(
        failed
            .1
            .starts_with(&format!("exited with code 7 on {node} (rank 3)")),
        "{ev:?}"
    );
    assert!(failed.1.contains("CUDA out of memory"), "{ev:?}");
    let (ok, out, err) = c.gangway(&["describe", &id.to_string()]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!(
            "failed in attempt 0: rank 3 on {node} failed first (exit code 7)"
        )),
        "{out}"
    );
    assert!(out.contains("| RuntimeError: CUDA out of memory"), "{out}");
    let (ok, out, err) = c.gangway(&["logs", &id.to_string(), "--failed"]);
    assert!(ok, "{err}");
    assert!(out.contains("rank 3 on"), "{out}");
    assert!(out.contains("loading shard 3"), "{out}");
    assert!(out.contains("rank 3 up"), "{out}");
    assert!(!out.contains("rank 0 up"), "{out}");
    let (ok, out, err) = c.gangway(&["logs", &id.to_string(), "--all"]);
    assert!(ok, "{err}");
    for r in 0..4 {
        assert!(out.contains(&format!("==> rank {r} on ")), "{out}");
        assert!(out.contains(&format!("rank {r} up")), "{out}");
    }
    let (ok, out, _) = c.gangway(&["logs", &id.to_string(), "--rank", "1"]);
    assert!(
        ok && out.contains("rank 1 up") && !out.contains("rank 3 up"),
        "{out}"
    );
    // --rank and --failed together make no sense.
    let (ok, _, _) = c.gangway(&["logs", &id.to_string(), "--rank", "1", "--failed"]);
    assert!(!ok);
}

#[test]
fn a_loopback_node_cannot_join_a_cluster_of_routable_ones() {
    let c = Cluster::start("127.0.0.1");
    let register = |name: &str, address: &str| -> Result<ureq::Response, Box<ureq::Error>> {
        ureq::post(&format!("{}/v1/nodes", c.addr))
            .set("Authorization", &format!("Bearer {JOIN}"))
            .send_json(json!({
                "name": name,
                "gpus": [],
                "cpu_millis": 1000,
                "memory_mib": 1024,
                "leaf": "l", "spine": "s",
                "address": address,
            }))
            .map_err(Box::new)
    };
    assert!(register("real-a", "10.20.30.1").is_ok());
    match register("laptop", "127.0.0.1").map_err(|e| *e) {
        Err(ureq::Error::Status(422, r)) => {
            let v: Value = r.into_json().expect("json");
            let t = v["error"].as_str().unwrap_or("");
            assert!(
                t.starts_with("address: node laptop advertises \"127.0.0.1\" but node real-a"),
                "{t}"
            );
        }
        other => panic!("expected 422, got {other:?}"),
    }
    assert!(register("real-b", "10.20.30.2").is_ok());
    assert_eq!(c.get("/v1/nodes").as_array().map(Vec::len), Some(2));
}

#[test]
fn the_shipped_examples_parse_and_validate() {
    let dir = examples();
    let server = std::fs::read_to_string(dir.join("server.yaml")).expect("server.yaml");
    let cfg = gangway_server::ServerConfig::from_yaml(&server).expect("server.yaml is valid");
    assert_eq!(cfg.master_ports.first, 29_400);
    assert!(cfg.checkpoint_root.is_some());
    for f in ["job.yaml", "train.yaml", "ddp.yaml", "ddp_torchrun.yaml"] {
        let text = std::fs::read_to_string(dir.join(f)).expect("example");
        let spec: gangway_core::JobSpec =
            gangway_server::yaml::from_str(&text).unwrap_or_else(|e| panic!("{f}: {e}"));
        spec.validate().unwrap_or_else(|e| panic!("{f}: {e}"));
    }
    // The torchrun example starts torchrun with the replica as its node.
    let torchrun = std::fs::read_to_string(dir.join("ddp_torchrun.yaml")).expect("yaml");
    for flag in [
        "--nnodes=\"$WORLD_SIZE\"",
        "--node_rank=\"$RANK\"",
        "--master_addr=\"$MASTER_ADDR\"",
        "--master_port=\"$MASTER_PORT\"",
    ] {
        assert!(torchrun.contains(flag), "{flag}");
    }
}

#[test]
fn the_python_helper_round_trips_through_latest_atomically() {
    let Some(py) = python() else {
        return skip_or_fail("GANGWAY_REQUIRE_PYTHON3", "no python3");
    };
    let d = tempfile::tempdir().expect("tmp");
    let ck = d.path().join("ck");
    let script = r#"
import json, os, sys
sys.path.insert(0, os.environ["EXAMPLES"])
import gangway_checkpoint as gc
assert gc.latest() is None and gc.resume_from() is None
def write(s):
    return lambda tmp: open(tmp, "w").write(json.dumps({"step": s}))
p1 = gc.save(10, write(10))
p2 = gc.save(20, write(20), name="best")
assert gc.latest() == {"step": 20, "path": p2}, gc.latest()
assert gc.resume_from() == p2
# A failing writer leaves the previous checkpoint announced, and no litter.
try:
    gc.save(30, lambda tmp: 1 / 0)
except ZeroDivisionError:
    pass
assert gc.latest()["step"] == 20
assert sorted(os.listdir(gc.checkpoint_dir())) == ["LATEST", "best", "step-10"], os.listdir(gc.checkpoint_dir())
try:
    gc.announce(-1, "x")
    sys.exit("negative step accepted")
except ValueError:
    pass
os.environ["GANGWAY_RESUME_FROM"] = "/from/server"
assert gc.resume_from() == "/from/server"
print(p1)
"#;
    let out = Command::new(&py)
        .args(["-c", script])
        .env("GANGWAY_CHECKPOINT_DIR", &ck)
        .env("EXAMPLES", examples())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("GANGWAY_RESUME_FROM")
        .output()
        .expect("python");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // What the helper wrote is what the agent reads.
    let dir = gangway_agent::checkpoint::CkptDir::under(d.path(), &ck).expect("under");
    let c = gangway_agent::checkpoint::read_latest(&dir)
        .expect("not refused")
        .expect("LATEST")
        .report;
    assert_eq!(c.step, 20);
    assert_eq!(c.path, ck.join("best").display().to_string());
}
