//! Rendezvous ports, tried as a plain user against a real server and agent:
//! a rank cannot bind a port of the cluster's rendezvous range that is not
//! its job's (Landlock), so it cannot keep another job's rank 0 from
//! starting; a port held by a process Gangway does not run is named in the
//! job's events, the job moves, and the store stays small.

mod common;

use common::*;
use serde_json::{json, Value};
use std::process::{Command, Stdio};

const ALICE: &str = "alice-token-rdzv";
const BOB: &str = "bob-token-rdzv";

/// These tests create Unix accounts and drop privileges: they need root.
const ROOT_WHY: &str = "needs root to create Unix accounts";

/// A range of `n` ports from `base` up that nothing on this machine
/// listens on now (each test its own base: tests run at once).
fn free_range(base: u16, n: u16) -> (u16, u16) {
    (0..50u16)
        .map(|k| base + k * 20)
        .find(|first| {
            (*first..*first + n).all(|p| std::net::TcpListener::bind(("0.0.0.0", p)).is_ok())
        })
        .map(|first| (first, first + n - 1))
        .expect("a free range")
}

/// A cluster with the range and users alice and bob, each their own account.
fn cluster(range: (u16, u16), alice: &Account, bob: &Account) -> Cluster {
    let extra = format!(
        "users:\n  - name: alice\n    token: {ALICE}\n    queues: [default]\n    unix_user: {}\n  - name: bob\n    token: {BOB}\n    queues: [default]\n    unix_user: {}\n",
        alice.name, bob.name
    );
    let config = format!(
        "master_ports: {{ first: {}, last: {} }}\n{}",
        range.0,
        range.1,
        server_config(&extra)
    );
    Cluster::start_with("127.0.0.1", &config)
}

/// Binds (as rank `$RANK` of its job) every port of the range, its own
/// `MASTER_PORT` last, then port 0 and a port outside the range (`$OUTSIDE`
/// plus its rank: ranks share a node); writes
/// `PORT ERRNO` lines (0: bound) to `$OUT/binds-JOB-RANK`, then holds what
/// it got for `$HOLD` seconds.
const BINDS_PY: &str = r#"
import os, socket, time
first, last = int(os.environ["FIRST"]), int(os.environ["LAST"])
own = int(os.environ["MASTER_PORT"])
out = os.path.join(os.environ["OUT"], f"binds-{os.environ['GANGWAY_JOB_ID']}-{os.environ['RANK']}")
held, lines = [], []
def try_bind(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("0.0.0.0", port))
        s.listen(8)
        held.append(s)
        return 0
    except OSError as e:
        s.close()
        return e.errno
for p in [p for p in range(first, last + 1) if p != own] + [own, 0, int(os.environ["OUTSIDE"]) + int(os.environ["RANK"])]:
    lines.append(f"{p} {try_bind(p)}")
with open(out + ".tmp", "w") as f:
    f.write("\n".join(lines) + "\n")
os.rename(out + ".tmp", out)
time.sleep(float(os.environ.get("HOLD", "0")))
"#;

fn bind_job(c: &Cluster, range: (u16, u16), replicas: u32, hold: u64) -> Value {
    let outside = (range.1 + 100..range.1 + 200)
        .find(|p| {
            (*p..*p + replicas as u16).all(|p| std::net::TcpListener::bind(("0.0.0.0", p)).is_ok())
        })
        .expect("free ports outside the range");
    json!({
        "name": "binds",
        "queue": "default",
        "replicas": replicas,
        "resources": { "gpus": 1, "cpu_millis": 100 },
        "restart": { "max_restarts": 0 },
        "run": {
            "command": ["/usr/bin/python3", c.dir.path().join("binds.py").display().to_string()],
            "env": {
                "OUT": c.out.display().to_string(),
                "FIRST": range.0.to_string(),
                "LAST": range.1.to_string(),
                "OUTSIDE": outside.to_string(),
                "HOLD": hold.to_string(),
            }
        }
    })
}

/// The `PORT ERRNO` lines a rank wrote, waited for.
fn binds(c: &Cluster, job: u64, rank: u32) -> Vec<(u16, i32)> {
    let path = c.out.join(format!("binds-{job}-{rank}"));
    let text = wait_for(
        &format!("rank {rank} of job {job} tried its binds"),
        60,
        || std::fs::read_to_string(&path).ok(),
    );
    text.lines()
        .filter_map(|l| {
            let (p, e) = l.split_once(' ')?;
            Some((p.parse().ok()?, e.parse().ok()?))
        })
        .collect()
}

fn python_or_skip() -> bool {
    if std::path::Path::new("/usr/bin/python3").exists() {
        return false;
    }
    skip_or_fail("GANGWAY_REQUIRE_PYTHON3", "no /usr/bin/python3");
    true
}

#[test]
fn a_rank_binds_only_its_own_rendezvous_port_of_the_range_and_any_other_port() {
    if skip_unless_root(ROOT_WHY) || python_or_skip() {
        return;
    }
    let (alice, bob) = (Account::create("la"), Account::create("lb"));
    let range = free_range(27_300, 10);
    let mut c = cluster(range, &alice, &bob);
    std::fs::write(c.dir.path().join("binds.py"), BINDS_PY).expect("script");
    c.agent("node-l", 2, &[], &[]);
    c.wait_nodes(1);
    let id = submit_as(&c, ALICE, &bind_job(&c, range, 2, 0));
    let j = c.wait_end(id, "finish", 60);
    assert_eq!(state(&j), "succeeded", "{:?}", events(&j));
    let eacces = 13;
    for rank in [0u32, 1] {
        let tried = binds(&c, id, rank);
        assert_eq!(tried.len(), 10 + 2, "rank {rank}: {tried:?}");
        // Tried after the rest of the range: the job's MASTER_PORT.
        let own = tried[9].0;
        assert!((range.0..=range.1).contains(&own), "{own}");
        for (port, errno) in &tried {
            let want = if *port == 0 || *port > range.1 || (*port == own && rank == 0) {
                0
            } else {
                eacces
            };
            assert_eq!(*errno, want, "rank {rank} binding port {port}: {tried:?}");
        }
    }
}

#[test]
fn a_squatter_cannot_keep_bob_from_starting_and_a_held_port_names_its_holder() {
    if skip_unless_root(ROOT_WHY) || python_or_skip() {
        return;
    }
    let (alice, bob) = (Account::create("qa"), Account::create("qb"));
    let range = free_range(26_300, 10);
    let mut c = cluster(range, &alice, &bob);
    std::fs::write(c.dir.path().join("binds.py"), BINDS_PY).expect("script");
    c.agent("node-q", 2, &[], &[]);
    c.wait_nodes(1);
    // Alice's rank tries every port of the range, and would hold what it got.
    let squat = submit_as(&c, ALICE, &bind_job(&c, range, 1, 40));
    let sj = c.wait_job(squat, "run", 30, |j| state(j) == "running");
    let alice_port = sj["master_port"].as_u64().expect("port") as u16;
    let tried = binds(&c, squat, 0);
    let squatted: Vec<u16> = tried
        .iter()
        .filter(|(p, e)| *e == 0 && (range.0..=range.1).contains(p) && *p != alice_port)
        .map(|(p, _)| *p)
        .collect();
    assert!(squatted.is_empty(), "alice holds {squatted:?}: {tried:?}");
    // A root process the test starts holds the port bob's job is given
    // first (as the server picks it: from job and attempt, past alice's).
    let n = u64::from(range.1 - range.0 + 1);
    let bob_id = squat + 1;
    let bob_port = (0..n)
        .map(|i| range.0 + ((bob_id * 7 + i) % n) as u16)
        .find(|p| *p != alice_port)
        .expect("a port");
    let mut holder = Command::new("/usr/bin/python3")
        .args([
            "-c",
            &format!("import socket,time\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('0.0.0.0',{bob_port}))\ns.listen(1)\nprint('ok',flush=True)\ntime.sleep(120)"),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("holder");
    {
        use std::io::BufRead;
        let mut line = String::new();
        let stdout = holder.stdout.as_mut().expect("stdout");
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .expect("holder ready");
        assert_eq!(line.trim(), "ok");
    }
    let spec = shell_job(
        "bob",
        "/usr/bin/python3 -c 'import os,socket; s=socket.socket(); s.bind((\"0.0.0.0\", int(os.environ[\"MASTER_PORT\"]))); print(\"bound\", s.getsockname()[1])'",
    );
    let id = submit_as(&c, BOB, &spec);
    assert_eq!(id, bob_id);
    let j = c.wait_end(id, "finish", 60);
    let held = format!(
        "rendezvous port {bob_port} is in use on node-q, held by process python3 (uid 0), pid {}",
        holder.id()
    );
    let _ = holder.kill();
    let _ = holder.wait();
    assert_eq!(state(&j), "succeeded", "{:?}", events(&j));
    assert!(
        has_event(&j, Some("rendezvous"), &held),
        "{held}: {:?}",
        events(&j)
    );
    assert_ne!(j["master_port"].as_u64(), Some(u64::from(bob_port)));
    // Alice's squatter went on for its 40 s; the store stays small.
    let sj = c.wait_end(squat, "finish", 60);
    assert_eq!(state(&sj), "succeeded", "{:?}", events(&sj));
    for j in [&sj, &j] {
        let bytes = j.to_string().len();
        assert!(bytes < 32 * 1024, "job record of {bytes} bytes: {j:#}");
    }
    let data: u64 = std::fs::read_dir(c.dir.path().join("data"))
        .expect("data dir")
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum();
    assert!(data < 64 << 20, "the store is {data} bytes");
}
