//! Isolation between users with distinct Unix accounts (`unix_user` per
//! user), tried by a real rank of one user against a real running rank of
//! another: her environment, checkpoints, `TMPDIR`, log and process.

mod common;

use common::*;
use serde_json::{json, Value};
use std::path::Path;

const ALICE: &str = "alice-token-accounts";
const BOB: &str = "bob-token-accounts";

fn read(out: &Path, name: &str) -> String {
    std::fs::read_to_string(out.join(name))
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// Bob's rank: a secret in its environment, a checkpoint, a file in its
/// `TMPDIR` and a log line; it says where they are and runs until told to stop.
const BOB_RANK: &str = r#"echo "$GANGWAY_CHECKPOINT_DIR" > "$OUT/bob-ckpt"
echo "$TMPDIR" > "$OUT/bob-tmp"
echo ck-bob > "$GANGWAY_CHECKPOINT_DIR/state"
echo tmp-bob > "$TMPDIR/scratch"
echo "bob's log line"
echo $$ > "$OUT/bob-pid.tmp" && mv "$OUT/bob-pid.tmp" "$OUT/bob-pid"
while [ ! -e "$OUT/stop" ]; do sleep 0.2; done
echo "bob done""#;

/// Alice's rank: tries each of bob's things and writes what happened, one
/// `what yes|no` line each, to `$OUT/alice-saw`.
const ALICE_RANK: &str = r#"pid=$(cat "$OUT/bob-pid"); ck=$(cat "$OUT/bob-ckpt"); t=$(cat "$OUT/bob-tmp")
r() { if "$@" >/dev/null 2>&1; then echo yes; else echo no; fi; }
{
echo "bob-pid-known $([ -n "$pid" ] && echo yes || echo no)"
echo "self-environ $(r cat /proc/self/environ)"
echo "environ $(r cat /proc/$pid/environ)"
echo "environ-secret $(if tr '\0' '\n' < /proc/$pid/environ 2>/dev/null | grep -q BOB_SECRET; then echo yes; else echo no; fi)"
echo "ckpt-list $(r ls "$ck")"
echo "ckpt-read $(r cat "$ck/state")"
echo "ckpt-replace $(r sh -c "echo alice > '$ck/state'")"
echo "ckpt-plant $(r sh -c "echo alice > '$ck/planted'")"
echo "ckpt-remove $(r rm "$ck/state")"
echo "tmp-list $(r ls "$t")"
echo "tmp-read $(r cat "$t/scratch")"
echo "log-read $(r cat "$BOB_LOG")"
echo "kill-0 $(r kill -0 "$pid")"
echo "kill-9 $(r kill -9 "$pid")"
} > "$OUT/alice-saw"
kill -9 "$pid" 2> "$OUT/alice-kill-error"
true"#;

fn rank(name: &str, script: &str, out: &Path) -> Value {
    json!({
        "name": name,
        "queue": "default",
        "replicas": 1,
        "resources": { "gpus": 1 },
        "restart": { "max_restarts": 0 },
        "checkpoint": { "keep": true },
        "run": {
            "command": ["sh", "-c", script],
            "env": { "OUT": out.display().to_string() }
        }
    })
}

/// With an account per user, alice's rank cannot read bob's rank's
/// environment, read or replace his checkpoint, read his `TMPDIR` or his
/// log, or signal his rank (EPERM): bob's job keeps running and succeeds.
#[test]
fn distinct_accounts_keep_one_user_s_rank_out_of_another_s() {
    if skip_unless_root("needs root to create Unix accounts and run ranks as them") {
        return;
    }
    let (a, b) = (Account::create("ia"), Account::create("ib"));
    let extra = format!(
        "users:\n  - {{ name: alice, token: {ALICE}, queues: [default], unix_user: {} }}\n  - {{ name: bob, token: {BOB}, queues: [default], unix_user: {} }}\n",
        a.name, b.name
    );
    let mut c = Cluster::start_with("127.0.0.1", &server_config(&extra));
    c.agent("acct", 2, &[], &[]);
    c.wait_nodes(1);
    let mut bob = rank("bob-job", BOB_RANK, &c.out);
    bob["run"]["env"]["BOB_SECRET"] = json!("s3cret-of-bob");
    let bob_id = submit_as(&c, BOB, &bob);
    wait_for("bob's rank to be ready", 60, || {
        c.out.join("bob-pid").exists().then_some(())
    });
    let bob_pid: u32 = read(&c.out, "bob-pid").parse().expect("bob's pid");
    let log = c
        .dir
        .path()
        .join(format!("acct/logs/job-{bob_id}/attempt-0/rank-0.log"));
    let bob_log = || std::fs::read_to_string(&log).unwrap_or_default();
    wait_for("bob's log line", 30, || {
        bob_log().contains("bob's log line").then_some(())
    });
    let mut alice = rank("alice-job", ALICE_RANK, &c.out);
    alice["run"]["env"]["BOB_LOG"] = json!(log.display().to_string());
    let alice_id = submit_as(&c, ALICE, &alice);
    let j = c.wait_job(alice_id, "alice's job to end", 60, |j| {
        matches!(state(j), "succeeded" | "failed")
    });
    assert_eq!(state(&j), "succeeded", "{:?}", events(&j));
    let saw = read(&c.out, "alice-saw");
    let line = |what: &str| {
        saw.lines()
            .find_map(|l| l.strip_prefix(&format!("{what} ")))
            .unwrap_or("missing")
            .to_string()
    };
    // The probe works: it knows bob's pid and reads its own environment.
    assert_eq!(line("bob-pid-known"), "yes", "{saw}");
    assert_eq!(line("self-environ"), "yes", "{saw}");
    for what in [
        "environ",
        "environ-secret",
        "ckpt-list",
        "ckpt-read",
        "ckpt-replace",
        "ckpt-plant",
        "ckpt-remove",
        "tmp-list",
        "tmp-read",
        "log-read",
        "kill-0",
        "kill-9",
    ] {
        assert_eq!(line(what), "no", "alice could {what}:\n{saw}");
    }
    let kill_error = read(&c.out, "alice-kill-error");
    assert!(
        kill_error.to_lowercase().contains("not permitted"),
        "the signal is refused with EPERM, not missed: {kill_error:?}"
    );
    // Bob's things are untouched and his rank runs on.
    let ckpt = std::path::PathBuf::from(read(&c.out, "bob-ckpt"));
    assert_eq!(read(&ckpt, "state"), "ck-bob");
    assert!(!ckpt.join("planted").exists());
    let tmp = std::path::PathBuf::from(read(&c.out, "bob-tmp"));
    assert_eq!(read(&tmp, "scratch"), "tmp-bob");
    assert!(alive(bob_pid), "bob's rank was signalled");
    let j = c.job(bob_id);
    assert_eq!(state(&j), "running", "{:?}", events(&j));
    std::fs::write(c.out.join("stop"), "").expect("stop");
    let j = c.wait_job(bob_id, "bob's job to end", 60, |j| {
        matches!(state(j), "succeeded" | "failed")
    });
    assert_eq!(state(&j), "succeeded", "{:?}\n{}", events(&j), bob_log());
}
