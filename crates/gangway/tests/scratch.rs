//! Disk and memory counted per job wherever it writes, with a real server,
//! agents and rank processes: the quota walk (deep paths, hard links,
//! `TMPDIR`), disk pressure's victim, measurement off the agent's loop, and
//! each job's private `/tmp` and `/dev/shm`. Tests that need root or mounts
//! skip (and say so) without them, unless `GANGWAY_REQUIRE_ROOT` or
//! `GANGWAY_REQUIRE_MOUNT` is set.

mod common;

use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const ROOT_WHY: &str = "mount namespaces and tmpfs mounts need root";

/// A job of `replicas` one-GPU ranks running `sh -c script` once, with
/// `$OUT` and `$TAG` (unique to this test run) in its environment.
fn job(c: &Cluster, name: &str, replicas: u32, script: &str) -> Value {
    json!({
        "name": name, "queue": "default", "replicas": replicas,
        "resources": { "gpus": 1 },
        "restart": { "max_restarts": 0 },
        "run": {
            "command": ["sh", "-c", script],
            "env": { "OUT": c.out.display().to_string(), "TAG": tag() }
        }
    })
}

fn tag() -> String {
    format!("gw-scratch-{}", std::process::id())
}

/// A cluster whose directories (state, checkpoints, results) lie outside
/// `/tmp`, so its agent gives ranks a private `/tmp` as well as `/dev/shm`.
fn cluster_outside_tmp(agent_extra: &[&str]) -> Cluster {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let dir = tempfile::tempdir_in(base).expect("tmp");
    let mut c = Cluster::start_in(dir, "127.0.0.1", &server_config(""));
    c.agent("node-a", 2, &[], agent_extra);
    c.wait_nodes(1);
    c
}

/// The mount points under `dir` in this process's mount namespace.
fn mounts_under(dir: &Path) -> Vec<String> {
    let dir = dir.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .filter(|m| m.starts_with(&dir))
        .collect()
}

fn wait_file(p: &Path, secs: u64) {
    wait_for(&format!("{}", p.display()), secs, || {
        p.exists().then_some(())
    });
}

#[test]
fn a_jobs_tmp_and_shm_are_its_own_shared_by_its_ranks_and_gone_after_it() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let c = cluster_outside_tmp(&["--job-scratch", "private"]);
    let t = tag();
    let script = r#"
if [ "$RANK" = 0 ]; then
  echo x > /dev/shm/$TAG-x; echo y > /tmp/$TAG-y
  head -c 33554432 /dev/zero > /dev/shm/$TAG-big
  touch $OUT/written
else
  i=0; while [ ! -e /dev/shm/$TAG-x ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
  [ -e /dev/shm/$TAG-x ] && touch $OUT/rank1-saw-shm
  [ -e /tmp/$TAG-y ] && touch $OUT/rank1-saw-tmp
fi
i=0; while [ ! -e $OUT/checked ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
"#;
    let id = c.submit(&job(&c, "writer", 2, script));
    wait_file(&c.out.join("written"), 60);
    wait_file(&c.out.join("rank1-saw-shm"), 60);
    assert!(
        c.out.join("rank1-saw-tmp").exists(),
        "the ranks of one job share /tmp"
    );
    for p in [
        format!("/dev/shm/{t}-x"),
        format!("/dev/shm/{t}-big"),
        format!("/tmp/{t}-y"),
    ] {
        assert!(!Path::new(&p).exists(), "{p} is on the node's own");
    }
    let node_dir = c.dir.path().join("node-a");
    let shm = mounts_under(&node_dir.join("shm"));
    assert_eq!(shm.len(), 1, "one tmpfs for the attempt: {shm:?}");
    let used = std::process::Command::new("df")
        .args(["-P", "-k", &shm[0]])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    let used_k: u64 = used
        .lines()
        .nth(1)
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|u| u.parse().ok())
        .unwrap_or(0);
    eprintln!("the attempt's tmpfs {shm:?}: {used}");
    assert!(
        used_k >= 32 * 1024,
        "the job's 32 MiB are in its tmpfs: {used}"
    );
    std::fs::write(c.out.join("checked"), "").expect("checked");
    let j = c.wait_end(id, "end", 60);
    assert_eq!(state(&j), "succeeded", "{j:#}");
    // The tmpfs goes with the attempt: its memory is freed.
    wait_for("the attempt's tmpfs detached", 20, || {
        mounts_under(&node_dir.join("shm")).is_empty().then_some(())
    });
    wait_for("its mount point removed", 20, || {
        std::fs::read_dir(node_dir.join("shm"))
            .map(|d| d.count() == 0)
            .unwrap_or(true)
            .then_some(())
    });
    // The next job of the same account sees nothing of it.
    let next = c.submit(&job(
        &c,
        "next",
        1,
        "ls -a /dev/shm /tmp > $OUT/next-list; \
         if [ -e /dev/shm/$TAG-x ] || [ -e /dev/shm/$TAG-big ] || [ -e /tmp/$TAG-y ]; then touch $OUT/leak; fi",
    ));
    let j = c.wait_end(next, "end", 60);
    assert_eq!(state(&j), "succeeded", "{j:#}");
    let list = std::fs::read_to_string(c.out.join("next-list")).unwrap_or_default();
    assert!(!c.out.join("leak").exists(), "the next job saw: {list}");
}

#[test]
fn without_a_private_tmp_the_accounts_files_there_are_swept_after_its_job() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    // This cluster's state directory is under /tmp: ranks must reach it by
    // name, so they keep the node's /tmp (a private TMPDIR and /dev/shm).
    let c = Cluster::one_node(
        &server_config(""),
        "node-a",
        2,
        &["--job-scratch", "private"],
    );
    let t = tag();
    let roots = PathBuf::from(format!("/tmp/{t}-root"));
    std::fs::write(&roots, "root's").expect("write");
    let id = c.submit(&job(
        &c,
        "sweep",
        1,
        "echo y > /tmp/$TAG-sweep; mkdir -p /tmp/$TAG-dir/a; echo z > /tmp/$TAG-dir/a/f; \
         ln -s /tmp/$TAG-root /tmp/$TAG-dir/link; echo x > /dev/shm/$TAG-shm; touch $OUT/written",
    ));
    let j = c.wait_end(id, "end", 60);
    assert_eq!(state(&j), "succeeded", "{j:#}");
    assert!(c.out.join("written").exists());
    assert!(
        !Path::new(&format!("/dev/shm/{t}-shm")).exists(),
        "/dev/shm was the job's own"
    );
    wait_for("the account's /tmp entries swept", 20, || {
        (!Path::new(&format!("/tmp/{t}-sweep")).exists()
            && !Path::new(&format!("/tmp/{t}-dir")).exists())
        .then_some(())
    });
    assert_eq!(
        std::fs::read_to_string(&roots).ok().as_deref(),
        Some("root's"),
        "another account's file and a link's target stay"
    );
    let _ = std::fs::remove_file(&roots);
}

#[test]
fn the_quota_counts_deep_trees_tmpdir_and_hard_links_once() {
    let c = Cluster::one_node(
        &server_config("    node:\n      limits:\n        checkpoint_quota_bytes: 1048576\n"),
        "node-a",
        2,
        &[],
    );
    // Two chains of 15 names of 200 bytes, one moved to the bottom of the
    // other: the file lies past PATH_MAX.
    let deep = c.submit(&shell_job(
        "deep",
        "cd $GANGWAY_CHECKPOINT_DIR; n=$(printf 'd%.0s' $(seq 200)); a=a; b=b; \
         for i in $(seq 15); do a=$a/$n; b=$b/$n; done; mkdir -p $a $b || exit 9; \
         head -c 3000000 /dev/zero > $b/f && mv b $a/ || exit 9; sleep 60",
    ));
    let tmp = c.submit(&shell_job(
        "tmpdir",
        "head -c 3000000 /dev/zero > $TMPDIR/f; sleep 60",
    ));
    let links = c.submit(&shell_job(
        "links",
        "head -c 600000 /dev/zero > $GANGWAY_CHECKPOINT_DIR/f; \
         for i in $(seq 10); do ln $GANGWAY_CHECKPOINT_DIR/f $GANGWAY_CHECKPOINT_DIR/l$i; done; sleep 4",
    ));
    let j = c.wait_end(deep, "stopped", 60);
    assert_eq!(state(&j), "failed", "{j:#}");
    assert!(
        has_event(&j, None, "checkpoint quota 1 MiB exceeded"),
        "{:?}",
        events(&j)
    );
    let j = c.wait_end(tmp, "stopped", 60);
    assert_eq!(state(&j), "failed", "{j:#}");
    let ev = events(&j);
    let stop = ev
        .iter()
        .map(|(_, m)| m)
        .find(|m| m.contains("checkpoint quota 1 MiB exceeded"))
        .unwrap_or_else(|| panic!("{ev:?}"));
    assert!(
        stop.contains(", TMPDIR ") && !stop.contains("TMPDIR 0 KiB"),
        "the stop names TMPDIR's bytes: {stop}"
    );
    let j = c.wait_end(links, "end", 60);
    assert_eq!(
        state(&j),
        "succeeded",
        "eleven names of 600 kB are 600 kB: {j:#}"
    );
}

/// A small tmpfs mounted at `dir`, unmounted when dropped.
struct SmallFs(PathBuf);

impl SmallFs {
    fn mount(dir: &Path, mib: u32) -> Option<SmallFs> {
        std::fs::create_dir_all(dir).ok()?;
        let ok = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={mib}m,mode=0755"),
                "tmpfs",
            ])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| SmallFs(dir.to_path_buf()))
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Free percent of the filesystem holding `p`, as the agent counts it.
fn free_percent(p: &Path) -> u32 {
    std::process::Command::new("df")
        .args(["-P"])
        .arg(p)
        .output()
        .ok()
        .and_then(|o| {
            let t = String::from_utf8_lossy(&o.stdout).to_string();
            let cols: Vec<u64> = t
                .lines()
                .nth(1)?
                .split_whitespace()
                .skip(1)
                .take(3)
                .filter_map(|c| c.parse().ok())
                .collect();
            let (size, avail) = (*cols.first()?, *cols.get(2)?);
            (size > 0).then(|| (avail * 100 / size) as u32)
        })
        .unwrap_or(100)
}

const ALICE: &str = "alice-token-scratch";
const BOB: &str = "bob-token-scratch";

#[test]
fn under_disk_pressure_the_job_filling_tmpdir_is_stopped_not_the_one_checkpointing() {
    if skip_unless_root("needs root to create Unix accounts and mount a tmpfs") {
        return;
    }
    // Alice and Bob, each with a Unix account of their own.
    let (alice, bob) = (Account::create("pa"), Account::create("pb"));
    let users = format!(
        "users:\n  - name: alice\n    token: {ALICE}\n    queues: [default]\n    unix_user: {}\n  - name: bob\n    token: {BOB}\n    queues: [default]\n    unix_user: {}\n",
        alice.name, bob.name
    );
    let mut c = Cluster::start_with("127.0.0.1", &server_config(&users));
    if free_percent(c.dir.path()) < 6 {
        return skip_or_fail(
            "GANGWAY_REQUIRE_MOUNT",
            "the host's disk is nearly full, under the test's margin",
        );
    }
    // The agent's state directory (so every TMPDIR) on a 48 MiB tmpfs; its
    // checkpoint root on the host's disk.
    let Some(_fs) = SmallFs::mount(&c.dir.path().join("node-a"), 48) else {
        return skip_or_fail(
            "GANGWAY_REQUIRE_MOUNT",
            "cannot mount a tmpfs here (not root?)",
        );
    };
    c.agent("node-a", 2, &[], &["--disk-pressure-percent", "3"]);
    c.wait_nodes(1);
    // Bob checkpoints a megabyte a second (on the host's disk, not under pressure).
    let b = submit_as(&c, BOB, &shell_job(
        "checkpointer",
        "for i in $(seq 60); do head -c 1000000 /dev/zero > $GANGWAY_CHECKPOINT_DIR/part-$i; sleep 1; done",
    ));
    c.wait_job(b, "B running", 30, |j| state(j) == "running");
    std::thread::sleep(Duration::from_secs(2));
    // Alice fills the state filesystem through TMPDIR, then waits.
    let a = submit_as(
        &c,
        ALICE,
        &shell_job(
            "tmp-filler",
            "head -c 60000000 /dev/zero > $TMPDIR/fill; sleep 60",
        ),
    );
    let j = c.wait_end(a, "A stopped", 60);
    assert_eq!(state(&j), "failed", "{j:#}");
    assert!(
        has_event(
            &j,
            None,
            "stopped for the node's disk pressure, writing most"
        ),
        "{:?}",
        events(&j)
    );
    let since = Instant::now();
    while since.elapsed() < Duration::from_secs(4) {
        let jb = c.job(b);
        assert_eq!(state(&jb), "running", "B was stopped: {:?}", events(&jb));
        std::thread::sleep(Duration::from_millis(250));
    }
    let _ = c.post(&format!("/v1/jobs/{b}/cancel"));
}

#[test]
fn heartbeats_go_on_while_a_huge_tree_is_measured() {
    let c = Cluster::one_node(&server_config(""), "node-a", 2, &[]);
    // 300,000 entries in the checkpoint directory and TMPDIR, measured every second.
    let id = c.submit(&shell_job(
        "tree",
        "cd $GANGWAY_CHECKPOINT_DIR && mkdir a && cd a && seq 1 150000 | xargs touch && \
         cd $TMPDIR && seq 1 150000 | xargs touch && touch $GANGWAY_CHECKPOINT_DIR/made; sleep 60",
    ));
    let made = c
        .dir
        .path()
        .join(format!("checkpoints/admin/job-{id}/made"));
    wait_for("the tree", 180, || {
        let j = c.job(id);
        assert_ne!(state(&j), "failed", "{j:#}");
        made.exists().then_some(())
    });
    // The server's clock has seconds: a heartbeat every 300 ms moves it
    // each second; a loop stalled by a walk would leave it still longer.
    let seen = || c.node("node-a")["last_heartbeat"].as_u64().unwrap_or(0);
    let mut last = (seen(), Instant::now());
    let mut worst = Duration::ZERO;
    let until = Instant::now() + Duration::from_secs(12);
    while Instant::now() < until {
        let s = seen();
        if s != last.0 {
            worst = worst.max(last.1.elapsed());
            last = (s, Instant::now());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    worst = worst.max(last.1.elapsed());
    eprintln!("longest time without a new heartbeat second: {worst:?}");
    assert!(
        worst < Duration::from_millis(300 + 1000 + 1000),
        "heartbeats stalled for {worst:?}"
    );
    let _ = c.post(&format!("/v1/jobs/{id}/cancel"));
}
