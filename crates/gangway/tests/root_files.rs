//! What the agent does as root on files a user's ranks control, tried as
//! that user against a real server and agent: a `LATEST` that is a FIFO or
//! a link to a root-only file never delays the agent nor is read, and a
//! checkpoint directory named through a link a rank left (in its own
//! checkpoint directory, or in a directory the user owns above another's)
//! leads nowhere: the root-owned decoy the links aim at stays byte-identical.
//! Each test makes its own Unix account (removed afterwards).

mod common;

use common::*;
use serde_json::{json, Value};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;

use std::time::{Duration, Instant};

const ALICE: &str = "alice-token-root-files";
const ROOT_WHY: &str = "needs root to create Unix accounts";

/// A cluster whose user alice runs as `account`, with one agent `n1` of
/// two GPUs syncing every 300 ms.
fn cluster(account: &Account) -> Cluster {
    let extra = format!(
        "users:\n  - name: alice\n    token: {ALICE}\n    queues: [default]\n    unix_user: {}\n",
        account.name
    );
    Cluster::one_node(&server_config(&extra), "n1", 2, &[])
}

/// The agent's sync interval in these tests (the harness's `--sync-ms`).
const SYNC: Duration = Duration::from_millis(300);

/// Alice's one-rank job running `script` with `$OUT` set.
fn job(c: &Cluster, script: &str, dir: Option<&str>) -> Value {
    let mut j = shell_job("probe", script);
    j["run"]["env"] = json!({ "OUT": c.out.display().to_string() });
    if let Some(d) = dir {
        j["checkpoint"] = json!({ "dir": d });
    }
    j
}

/// A root-owned directory (0755) in its own tempdir, with a root-only
/// `secret` holding a checkpoint handshake and a readable `data` file.
struct Decoy {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Decoy {
    fn new() -> Decoy {
        let dir = tempfile::tempdir().expect("tmp");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let path = dir.path().join("decoy");
        std::fs::create_dir(&path).expect("decoy");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::write(
            path.join("secret"),
            r#"{"step": 4242, "path": "/root-only-secret-path"}"#,
        )
        .expect("secret");
        std::fs::set_permissions(path.join("secret"), std::fs::Permissions::from_mode(0o600))
            .expect("chmod");
        std::fs::write(path.join("LATEST"), r#"{"step": 99, "path": "decoy-step"}"#)
            .expect("latest");
        std::fs::write(path.join("data"), "keep me\n").expect("data");
        Decoy { _dir: dir, path }
    }

    /// Every entry with its kind and permission bits, owner, group and
    /// contents: what must not change.
    fn state(&self) -> Vec<(String, u32, u32, u32, Vec<u8>)> {
        let mut out = Vec::new();
        let m = std::fs::symlink_metadata(&self.path).expect("decoy");
        out.push((".".into(), m.mode(), m.uid(), m.gid(), Vec::new()));
        let mut names: Vec<_> = std::fs::read_dir(&self.path)
            .expect("ls")
            .flatten()
            .map(|e| e.file_name())
            .collect();
        names.sort();
        for n in names {
            let p = self.path.join(&n);
            let m = std::fs::symlink_metadata(&p).expect("meta");
            out.push((
                n.to_string_lossy().into(),
                m.mode(),
                m.uid(),
                m.gid(),
                std::fs::read(&p).unwrap_or_default(),
            ));
        }
        out
    }
}

/// Samples the node every 100 ms for `secs`: it must stay Ready and its
/// heartbeat must keep coming. The server keeps the heartbeat in whole
/// seconds, so the longest time between two advances seen may exceed the
/// agent's gap by up to a second: the bound is `SYNC` + 1 s + that second.
fn watch_heartbeats(c: &Cluster, secs: u64) -> Duration {
    let bound = SYNC + Duration::from_secs(2);
    let start = Instant::now();
    let mut last = c.node("n1")["last_heartbeat"].as_u64().unwrap_or(0);
    let mut advanced = Instant::now();
    let mut worst = Duration::ZERO;
    while start.elapsed() < Duration::from_secs(secs) {
        let n = c.node("n1");
        assert_eq!(n["ready"], true, "the node stays Ready: {n:#}");
        let hb = n["last_heartbeat"].as_u64().unwrap_or(0);
        if hb != last {
            last = hb;
            advanced = Instant::now();
        }
        worst = worst.max(advanced.elapsed());
        assert!(
            advanced.elapsed() <= bound,
            "no heartbeat for {:?} (bound {bound:?})",
            advanced.elapsed()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    worst
}

fn agent_log(c: &Cluster) -> String {
    std::fs::read_to_string(c.dir.path().join("n1.log")).unwrap_or_default()
}

#[test]
fn a_latest_fifo_never_delays_the_agent_and_another_job_still_starts() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let acct = Account::create("fifo");
    let c = cluster(&acct);
    let hostile = job(
        &c,
        r#"mkfifo "$GANGWAY_CHECKPOINT_DIR/LATEST" && echo made > "$OUT/fifo"; sleep 60"#,
        None,
    );
    let id = try_submit_as(&c, ALICE, &hostile).expect("hostile job");
    wait_for("the FIFO", 30, || c.out.join("fifo").exists().then_some(()));
    let worst = watch_heartbeats(&c, 10);
    eprintln!("longest time between heartbeats seen: {worst:?}");
    // The other GPU's job still starts and finishes.
    let other =
        try_submit_as(&c, ALICE, &job(&c, r#"echo ran > "$OUT/other""#, None)).expect("other");
    let j = c.wait_end(other, "the other job", 30);
    assert_eq!(state(&j), "succeeded", "{j:#}");
    assert_eq!(state(&c.job(id)), "running", "the hostile rank runs on");
    // Said once in the agent's log, not at every sync.
    let said = agent_log(&c)
        .lines()
        .filter(|l| l.contains("checkpoint handshake ignored") && l.contains("FIFO"))
        .count();
    assert_eq!(said, 1, "{}", agent_log(&c));
    c.post(&format!("/v1/jobs/{id}/cancel"));
}

#[test]
fn a_latest_linked_to_a_root_only_file_is_never_read() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let acct = Account::create("lnk");
    let decoy = Decoy::new();
    let before = decoy.state();
    let c = cluster(&acct);
    let script = format!(
        r#"echo '{{"step": 3, "path": "mine"}}' > "$GANGWAY_CHECKPOINT_DIR/LATEST.tmp"
mv "$GANGWAY_CHECKPOINT_DIR/LATEST.tmp" "$GANGWAY_CHECKPOINT_DIR/LATEST"
while [ ! -e "$OUT/go" ]; do sleep 0.1; done
ln -sf {secret} "$GANGWAY_CHECKPOINT_DIR/LATEST" && echo linked > "$OUT/linked"
sleep 60"#,
        secret = decoy.path.join("secret").display()
    );
    let id = try_submit_as(&c, ALICE, &job(&c, &script, None)).expect("job");
    // Its own handshake is read...
    let j = c.wait_job(id, "its own checkpoint", 30, |j| {
        j.to_string().contains("\"step\":3")
    });
    assert!(j.to_string().contains("mine"), "{j:#}");
    std::fs::write(c.out.join("go"), "").expect("go");
    wait_for("the link", 30, || {
        c.out.join("linked").exists().then_some(())
    });
    // Newer than the rank's own handshake, so the server would take it.
    std::fs::File::options()
        .write(true)
        .open(decoy.path.join("secret"))
        .and_then(|f| f.set_modified(std::time::SystemTime::now()))
        .expect("touch");
    let worst = watch_heartbeats(&c, 3);
    eprintln!("longest time between heartbeats seen: {worst:?}");
    // ... the linked one never: describe shows the last good checkpoint.
    let (ok, text, err) = c.gangway(&["describe", &id.to_string()]);
    assert!(ok, "{err}");
    let j = c.job(id);
    for shown in [&text, &j.to_string()] {
        assert!(!shown.contains("root-only-secret-path"), "{shown}");
        assert!(!shown.contains("4242"), "{shown}");
    }
    assert!(j.to_string().contains("mine"), "{j:#}");
    assert!(
        agent_log(&c).contains("symbolic link"),
        "the refusal is logged: {}",
        agent_log(&c)
    );
    assert_eq!(decoy.state(), before);
    c.post(&format!("/v1/jobs/{id}/cancel"));
}

#[test]
fn checkpoint_dirs_named_through_a_ranks_links_are_refused_and_the_decoy_is_untouched() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let acct = Account::create("nest");
    let decoy = Decoy::new();
    let before = decoy.state();
    let c = cluster(&acct);
    let plant = format!(
        r#"ln -s {d} "$GANGWAY_CHECKPOINT_DIR/link"; ln -s {d} "$GANGWAY_CHECKPOINT_DIR/link2"; echo planted > "$OUT/planted-$GANGWAY_JOB_ID"; exit 1"#,
        d = decoy.path.display()
    );
    // Job 1 (its default directory) and job 2 (a named one) leave links and fail.
    let first = try_submit_as(&c, ALICE, &job(&c, &plant, None)).expect("first");
    let named = try_submit_as(&c, ALICE, &job(&c, &plant, Some("exp"))).expect("named");
    for id in [first, named] {
        let j = c.wait_end(id, "the planting job", 30);
        assert_eq!(state(&j), "failed", "{j:#}");
        assert!(c.out.join(format!("planted-{id}")).exists());
    }
    let ok = r#"echo ran > "$OUT/ran-$GANGWAY_JOB_ID""#;
    for (dir, other) in [
        (format!("job-{first}/link"), first),
        (format!("job-{first}/link2/sub"), first),
        ("exp/link".to_string(), named),
        ("exp/link2/sub".to_string(), named),
    ] {
        let (code, body) = try_submit_as(&c, ALICE, &job(&c, ok, Some(&dir))).expect_err(&dir);
        assert!((400..500).contains(&code), "{code} {body}");
        let msg = serde_json::from_str::<Value>(&body).expect("json")["error"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            msg.contains(&format!("checkpoint.dir: \"{dir}\" is inside"))
                && msg.contains(&format!("job {other}")),
            "{dir}: {msg}"
        );
    }
    // Once more after the cleanup of a success would have run.
    std::thread::sleep(SYNC * 4);
    assert_eq!(decoy.state(), before, "the decoy is byte-identical");
    assert!(!decoy.path.join(".home").exists());
}

#[test]
fn an_agent_refuses_a_directory_above_a_job_that_the_user_owns_even_if_the_server_allowed_it() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let acct = Account::create("byp");
    let decoy = Decoy::new();
    let before = decoy.state();
    let c = cluster(&acct);
    // What the server cannot see: a directory of the user's under its
    // checkpoint namespace (left by an older version, or a restored store),
    // with links in it.
    let user_level = c.dir.path().join("checkpoints/alice");
    std::fs::create_dir_all(&user_level).expect("user level");
    std::fs::set_permissions(&user_level, std::fs::Permissions::from_mode(0o711)).expect("chmod");
    let owned = user_level.join("made");
    std::fs::create_dir(&owned).expect("made");
    std::os::unix::fs::chown(&owned, Some(acct.uid), Some(acct.uid)).expect("chown");
    std::os::unix::fs::symlink(&decoy.path, owned.join("link")).expect("ln");
    std::os::unix::fs::symlink(&decoy.path, owned.join("link2")).expect("ln");
    let ok = r#"echo ran > "$OUT/ran-$GANGWAY_JOB_ID""#;
    for dir in ["made/link", "made/link2/sub", "made/x"] {
        let id = try_submit_as(&c, ALICE, &job(&c, ok, Some(dir))).expect(dir);
        let j = c.wait_end(id, "refused", 30);
        assert_eq!(state(&j), "failed", "{dir}: {j:#}");
        assert!(
            !c.out.join(format!("ran-{id}")).exists(),
            "{dir}: never ran"
        );
        let log = c.rank_log("n1", id, 0);
        assert!(
            log.contains("refused") && log.contains("made"),
            "{dir}: the reason is in the rank's log: {log}"
        );
        assert!(log.contains("root's"), "{dir}: {log}");
    }
    assert_eq!(decoy.state(), before, "the decoy is byte-identical");
    assert!(!decoy.path.join(".home").exists());
    assert!(!decoy.path.join("sub").exists());
    let m = std::fs::metadata(&owned).expect("made");
    assert_eq!(m.uid(), acct.uid, "nothing chowned");
}
