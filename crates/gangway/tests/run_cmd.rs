//! `gangway run` against a real server and agents: labelled output, the
//! job's exit code, `--env`, refused flags, Ctrl-C, and the gang's node
//! list and hostfile every rank gets.

mod common;

use common::*;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `gangway run ARGS` as admin against `c`, from `/` (a directory the
/// ranks' account may enter).
fn run_cmd(c: &Cluster, args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.arg("run")
        .args(args)
        .env("GANGWAY_ADDR", &c.addr)
        .env("GANGWAY_TOKEN", ADMIN)
        .env_remove("GANGWAY_CONFIG")
        .current_dir("/");
    cmd
}

fn run(c: &Cluster, args: &[&str]) -> Output {
    run_cmd(c, args).output().expect("gangway run")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).to_string()
}

fn two_nodes(tag: &str) -> (Cluster, [String; 2]) {
    let mut c = Cluster::start_with("127.0.0.1", &server_config(""));
    let n = [
        format!("{tag}a-{}", std::process::id()),
        format!("{tag}b-{}", std::process::id()),
    ];
    c.agent(&n[0], 1, &[], &[]);
    c.agent(&n[1], 1, &[], &[]);
    c.wait_nodes(2);
    (c, n)
}

#[test]
fn run_prints_the_rank_labelled_and_exits_with_its_code() {
    let node = format!("runexit-{}", std::process::id());
    let c = Cluster::one_node(&server_config(""), &node, 1, &[]);
    let out = run(&c, &["--gpus", "1", "--", "sh", "-c", "echo hi; exit 3"]);
    assert_eq!(text(&out.stdout), "0: hi\n", "{}", text(&out.stderr));
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("failed"),
        "{}",
        text(&out.stderr)
    );
    // Success is 0, and --no-label prints the lines as they are.
    let out = run(&c, &["--no-label", "--", "sh", "-c", "printf 'a\\nb'"]);
    assert_eq!(text(&out.stdout), "a\nb\n", "{}", text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
}

#[test]
fn run_labels_every_rank_and_passes_env() {
    let (c, _) = two_nodes("runtwo");
    let out = run(
        &c,
        &[
            "--replicas",
            "2",
            "--gpus",
            "1",
            "--env",
            "GREETING=hello there",
            "--",
            "sh",
            "-c",
            "echo \"$GREETING from $RANK\"",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let mut lines: Vec<String> = text(&out.stdout).lines().map(str::to_string).collect();
    lines.sort();
    assert_eq!(
        lines,
        ["0: hello there from 0", "1: hello there from 1"],
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn run_refuses_a_bad_time_naming_the_flag() {
    let node = format!("runtime-{}", std::process::id());
    let c = Cluster::one_node(&server_config(""), &node, 1, &[]);
    let out = run(&c, &["--time", "soon", "--", "true"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("--time") && err.contains("soon"), "{err}");
    // Nothing was submitted.
    let jobs = c.get("/v1/jobs");
    assert_eq!(jobs.as_array().map_or(0, |a| a.len()), 0, "{jobs:#}");
    // A job the server refuses (a queue that does not exist) exits 125.
    let out = run(&c, &["--gpus", "9", "--queue", "nosuch", "--", "true"]);
    assert_eq!(out.status.code(), Some(125), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("refused"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn ctrl_c_cancels_the_job_and_a_second_stops_waiting() {
    let node = format!("runint-{}", std::process::id());
    let c = Cluster::one_node(&server_config(""), &node, 1, &[]);
    let mut child = run_cmd(
        &c,
        &[
            "--gpus",
            "1",
            "--",
            "sh",
            "-c",
            "echo started; exec sleep 120",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("spawn");
    // The rank is up once a job is running and its line came out.
    let id = wait_for("the job to run", 30, || {
        let jobs = c.get("/v1/jobs");
        let j = jobs.as_array()?.first()?.clone();
        (j["state"] == "running").then(|| j["id"].as_u64())?
    });
    wait_for("the rank's output", 30, || {
        let log = c.get(&format!("/v1/jobs/{id}/logs?rank=0"));
        log["data"]
            .as_str()
            .is_some_and(|d| d.contains("started"))
            .then_some(())
    });
    let sigint = |pid: u32| {
        let _ = Command::new("kill")
            .args(["-INT", &pid.to_string()])
            .status();
    };
    sigint(child.id());
    let j = c.wait_end(id, "cancel", 60);
    assert_eq!(state(&j), "cancelled", "{j:#}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "gangway run did not exit");
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = child.wait_with_output().expect("output");
    assert_eq!(status.code(), Some(130), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "0: started\n");
    assert!(
        text(&out.stderr).contains("cancelling job"),
        "{}",
        text(&out.stderr)
    );

    // A second Ctrl-C exits at once, while the job is still in its grace.
    let mut child = run_cmd(
        &c,
        &[
            "--gpus",
            "1",
            "--",
            "sh",
            "-c",
            "trap '' TERM; echo started; while :; do sleep 1; done",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("spawn");
    let id2 = wait_for("the second job to run", 30, || {
        let jobs = c.get("/v1/jobs");
        let j = jobs
            .as_array()?
            .iter()
            .find(|j| j["id"].as_u64() != Some(id))?
            .clone();
        (j["state"] == "running").then(|| j["id"].as_u64())?
    });
    wait_for("the second rank's output", 30, || {
        let log = c.get(&format!("/v1/jobs/{id2}/logs?rank=0"));
        log["data"]
            .as_str()
            .is_some_and(|d| d.contains("started"))
            .then_some(())
    });
    sigint(child.id());
    wait_for("cancelling", 20, || {
        (c.job(id2)["state"] != "running" || has_event(&c.job(id2), Some("cancelling"), ""))
            .then_some(())
    });
    sigint(child.id());
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "a second Ctrl-C did not exit"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(130));
    let j = c.wait_end(id2, "cancel after the grace", 60);
    assert_eq!(state(&j), "cancelled", "{j:#}");
}

#[test]
fn every_rank_of_a_two_node_gang_gets_the_node_list_and_hostfiles() {
    let (c, names) = two_nodes("runhosts");
    let out = run(
        &c,
        &[
            "--nodes",
            "2",
            "--gpus",
            "1",
            "--",
            "sh",
            "-c",
            "echo \"list $NODE_RANK $GANGWAY_NODELIST\"; sed 's/^/ompi /' \"$GANGWAY_HOSTFILE\"; \
             sed 's/^/mpich /' \"$GANGWAY_HOSTFILE_MPICH\"; stat -c 'mode %a' \"$GANGWAY_HOSTFILE\"; \
             (echo x >> \"$GANGWAY_HOSTFILE\") 2>/dev/null && echo writable || echo read-only",
        ],
    );
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    let jobs = c.get("/v1/jobs");
    let job = jobs
        .as_array()
        .and_then(|a| a.first())
        .expect("the job")
        .clone();
    // Rank 0's node is node rank 0: the list is the nodes in rank order.
    let ran_on: Vec<String> = job["ran_on"]
        .as_array()
        .expect("ran_on")
        .iter()
        .map(|n| n.as_str().expect("node").to_string())
        .collect();
    assert_eq!(ran_on.len(), 2);
    assert_ne!(ran_on[0], ran_on[1], "one rank per node");
    for n in &ran_on {
        assert!(names.contains(n), "{n}");
    }
    let host = |n: &str| {
        let a = c.node(n)["address"].as_str().unwrap_or("").to_string();
        if a.is_empty() {
            n.to_string()
        } else {
            a
        }
    };
    let hosts: Vec<String> = ran_on.iter().map(|n| host(n)).collect();
    for rank in 0..2 {
        let mine: Vec<&str> = stdout
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("{rank}: ")))
            .collect();
        let expect = vec![
            format!("list {rank} {}", hosts.join(",")),
            format!("ompi {} slots=1", hosts[0]),
            format!("ompi {} slots=1", hosts[1]),
            format!("mpich {}:1", hosts[0]),
            format!("mpich {}:1", hosts[1]),
            "mode 444".to_string(),
            "read-only".to_string(),
        ];
        assert_eq!(mine, expect, "rank {rank}: {stdout}");
    }
}

#[test]
fn a_rank_with_a_private_tmp_reads_its_tmpdir_and_hostfiles_there() {
    if skip_unless_root("needs root (private /tmp per job)") {
        return;
    }
    // Outside /tmp, so the agent binds each attempt's TMPDIR on /tmp; the
    // cluster's directory is root's 0700, as `gangway up`'s data directory:
    // the host path of TMPDIR is out of the rank's reach.
    let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let dir = tempfile::tempdir_in(base).expect("tmp");
    let mut c = Cluster::start_in(dir, "127.0.0.1", &server_config(""));
    c.agent("node-p", 1, &[], &["--job-scratch", "private"]);
    c.wait_nodes(1);
    let _ = Command::new("chmod").arg("0700").arg(c.dir.path()).status();
    let out = run(
        &c,
        &[
            "--gpus",
            "1",
            "--",
            "sh",
            "-c",
            "echo \"$GANGWAY_HOSTFILE\"; cat \"$GANGWAY_HOSTFILE\" \"$GANGWAY_HOSTFILE_MPICH\"; \
             echo \"$TMPDIR\"; echo mine > \"$TMPDIR/own\" && cat \"$TMPDIR/own\"",
        ],
    );
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    let host = c.node("node-p")["address"]
        .as_str()
        .filter(|a| !a.is_empty())
        .unwrap_or("node-p")
        .to_string();
    assert_eq!(
        stdout,
        format!("0: /tmp/gangway-hostfile\n0: {host} slots=1\n0: {host}:1\n0: /tmp\n0: mine\n")
    );
}

#[test]
fn run_picks_the_only_queue_and_asks_when_there_are_several() {
    let config = server_config(
        "  - name: other\nusers:\n  - { name: bob, token: bob-token, queues: [default, other] }\n",
    );
    let node = format!("runq-{}", std::process::id());
    let c = Cluster::one_node(&config, &node, 1, &[]);
    let out = run_cmd(&c, &["--", "true"])
        .env("GANGWAY_TOKEN", "bob-token")
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("--queue") && err.contains("default, other"),
        "{err}"
    );
    assert_eq!(c.get("/v1/jobs").as_array().map_or(0, |a| a.len()), 0);
}
