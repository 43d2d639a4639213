//! What a PyTorch user meets in the first hour, with a real server, real
//! agents and real ranks: the environment a rank gets (as docs/JOB_ENV.md
//! lists it), its own HOME and TMPDIR, loader variables, and clear errors.

mod common;

use common::*;
use serde_json::json;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Ranks run as `nobody` where the tests run as root.
const ROOT_WHY: &str = "needs root (ranks as nobody)";

/// A test's cluster: one node named `{tag}-{pid}` with `gpus` GPUs; the
/// cluster and the node's name.
fn cluster(config: &str, tag: &str, gpus: u32) -> (Cluster, String) {
    let node = format!("{tag}-{}", std::process::id());
    (Cluster::one_node(config, &node, gpus, &[]), node)
}

/// The variables the tables of docs/JOB_ENV.md's "Environment" section
/// name (up to the array tasks), and those among them set only sometimes
/// (their value says "only when" or "unset where").
fn documented_env() -> (BTreeSet<String>, BTreeSet<String>) {
    let doc = std::fs::read_to_string(repo().join("docs/JOB_ENV.md")).expect("JOB_ENV.md");
    let start = doc.find("\n## Environment").expect("Environment section");
    let end = doc[start..]
        .find("\n### Array tasks")
        .map_or(doc.len(), |e| start + e);
    let (mut all, mut sometimes) = (BTreeSet::new(), BTreeSet::new());
    for line in doc[start..end].lines() {
        let Some(row) = line.strip_prefix("| `") else {
            continue;
        };
        let mut cells = row.split(" | ");
        let names = cells.next().unwrap_or("");
        let value = cells.next().unwrap_or("");
        for name in names.split('`').filter(|n| {
            !n.is_empty()
                && n.chars()
                    .all(|c| c.is_ascii_uppercase() || c == '_' || c.is_ascii_digit())
        }) {
            all.insert(name.to_string());
            // Set only sometimes: the value says when ("only when ...",
            // "..., only when pinned", "...; unset where none is found").
            if value.contains("only when") || value.contains("unset where") {
                sometimes.insert(name.to_string());
            }
        }
    }
    (all, sometimes)
}

#[test]
fn the_job_env_document_lists_exactly_what_a_rank_gets() {
    let (c, node) = cluster(&server_config(""), "envdoc", 1);
    let id = c.submit(&json!({
        "name": "env", "queue": "default", "replicas": 1,
        "resources": { "gpus": 1 },
        "restart": { "max_restarts": 0 },
        "run": { "command": ["/usr/bin/env"], "env": { "JOB_OWN": "1" } }
    }));
    let j = c.wait_end(id, "finish", 60);
    assert_eq!(state(&j), "succeeded", "{j:#}");
    let log = c.rank_log(&node, id, 0);
    let got: BTreeSet<String> = log
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, _)| k.to_string())
        .filter(|k| k != "JOB_OWN")
        .collect();
    assert!(log.contains("JOB_OWN=1"), "the job's run.env: {log}");
    let (documented, sometimes) = documented_env();
    let undocumented: Vec<_> = got.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "a rank gets {undocumented:?}, which docs/JOB_ENV.md does not list"
    );
    let missing: Vec<_> = documented
        .difference(&got)
        .filter(|k| !sometimes.contains(*k))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/JOB_ENV.md lists {missing:?}, which a rank does not get"
    );
}

/// Ranks as `nobody` (no home): HOME is a per-job directory in the
/// checkpoint directory, TMPDIR one per attempt, both the account's alone
/// and writable, both gone once the job succeeded. `LD_LIBRARY_PATH`
/// reaches a rank that cannot be root; a queue that allows root refuses it.
#[test]
fn a_rank_gets_a_home_and_tmpdir_of_its_own_removed_with_the_job() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let extra = "  - name: ops\n    node: { allow_root: true }\n";
    let (c, node) = cluster(&server_config(extra), "envdirs", 1);
    let script = r#"set -e
id -u > "$OUT/uid"
echo "$HOME" > "$OUT/home"; echo "$TMPDIR" > "$OUT/tmpdir"; echo "$LD_LIBRARY_PATH" > "$OUT/ldpath"
mkdir -p "$HOME/.cache/torch"; echo x > "$HOME/.cache/torch/kernel"; echo y > "$TMPDIR/scratch"
stat -c '%u %a' "$HOME" > "$OUT/home-stat"; stat -c '%u %a' "$TMPDIR" > "$OUT/tmp-stat""#;
    let spec = |queue: &str| {
        let mut j = shell_job("dirs", script);
        j["queue"] = json!(queue);
        j["run"]["env"] = json!({
            "OUT": c.out.display().to_string(), "LD_LIBRARY_PATH": "/opt/cuda/lib64"
        });
        j
    };
    let id = c.submit(&spec("default"));
    let j = c.wait_end(id, "finish", 60);
    let read = |n: &str| {
        std::fs::read_to_string(c.out.join(n))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    assert_eq!(
        state(&j),
        "succeeded",
        "{j:#}\n{}",
        c.rank_log(&node, id, 0)
    );
    let uid = read("uid");
    assert_ne!(uid, "0");
    let home = PathBuf::from(read("home"));
    let ckpt = c.dir.path().join(format!("checkpoints/admin/job-{id}"));
    assert_eq!(
        home,
        ckpt.join(".home"),
        "nobody's HOME is kept with its checkpoints"
    );
    let tmp = PathBuf::from(read("tmpdir"));
    assert_eq!(tmp, c.dir.path().join(format!("{node}/tmp/job-{id}-0")));
    assert_eq!(read("home-stat"), format!("{uid} 700"));
    assert_eq!(read("tmp-stat"), format!("{uid} 700"));
    assert_eq!(
        read("ldpath"),
        "/opt/cuda/lib64",
        "LD_LIBRARY_PATH as a user"
    );
    // Both go with the job: TMPDIR when the attempt ends on the node, HOME
    // with the checkpoint directory of the succeeded job.
    wait_for("TMPDIR and HOME removed", 20, || {
        (!tmp.exists() && !home.exists()).then_some(())
    });
    // Where root is allowed, loader variables are refused at submission.
    let r = ureq::post(&format!("{}/v1/jobs", c.addr))
        .set("Authorization", &format!("Bearer {ADMIN}"))
        .send_json(spec("ops"));
    match r {
        Err(ureq::Error::Status(422, resp)) => {
            let msg = resp.into_string().unwrap_or_default();
            assert!(
                msg.contains("run.env.LD_LIBRARY_PATH: loader variables are not allowed in queue ops: it allows root ranks"),
                "{msg}"
            );
        }
        other => panic!("expected a 422 refusal, got {other:?}"),
    }
}

/// Rank 0's rendezvous port is held by a process outside Gangway: the gang
/// moves to another port, and that is no restart: `restarts` and
/// `TORCHELASTIC_RESTART_COUNT` stay 0.
#[test]
fn a_rendezvous_port_move_is_not_a_restart() {
    // A port of ours, held on every interface, is the one the range of two
    // gives the cluster's first job (job 1, attempt 0: the second port);
    // the port below it, the one the job moves to, must be free.
    let (held, port) = (0..100)
        .find_map(|_| {
            let held = std::net::TcpListener::bind("0.0.0.0:0").ok()?;
            let port = held.local_addr().ok()?.port();
            let below = port.checked_sub(1).filter(|p| *p >= 1024)?;
            std::net::TcpListener::bind(("0.0.0.0", below)).ok()?;
            Some((held, port))
        })
        .expect("a port whose neighbour below is free");
    let config = format!(
        "{}master_ports: {{ first: {}, last: {port} }}\n",
        server_config(""),
        port - 1
    );
    let (c, _) = cluster(&config, "portmove", 1);
    let mut spec = shell_job(
        "moved",
        "echo \"$TORCHELASTIC_RESTART_COUNT $MASTER_PORT\" > \"$OUT/count\"",
    );
    spec["restart"] = json!({ "max_restarts": 2, "backoff_seconds": 0 });
    spec["run"]["env"] = json!({ "OUT": c.out.display().to_string() });
    let id = c.submit(&spec);
    let j = c.wait_end(id, "finish", 60);
    drop(held);
    assert_eq!(state(&j), "succeeded", "{j:#}");
    assert!(
        has_event(&j, Some("rendezvous"), &format!("port {port} is in use")),
        "{:?}",
        events(&j)
    );
    assert_eq!(j["restarts"], 0, "{j:#}");
    let count = std::fs::read_to_string(c.out.join("count")).unwrap_or_default();
    let mut it = count.split_whitespace();
    assert_eq!(it.next(), Some("0"), "TORCHELASTIC_RESTART_COUNT: {count}");
    assert_eq!(
        it.next(),
        Some((port - 1).to_string().as_str()),
        "moved off the held port"
    );
}

/// A cancel says `cancelling` while the ranks stop (here they ignore the
/// signal and get the 10 s cap of their 30 s grace, cut to 2 s by the
/// job), `--wait` returns once it is `cancelled`; a time-limit stop shows
/// `stopping (time limit)` until the job ends `timeout`.
#[test]
fn cancel_and_time_limit_stops_show_what_is_happening() {
    let (c, _) = cluster(&server_config(""), "states", 2);
    let stubborn = |name: &str, limit: Option<u64>| {
        let mut j = shell_job(name, "trap '' TERM; while :; do sleep 0.1; done");
        j["checkpoint"] = json!({ "grace_seconds": 2 });
        if let Some(l) = limit {
            j["time_limit"] = json!(l);
        }
        j
    };
    let id = c.submit(&stubborn("cancel-me", None));
    c.wait_job(id, "run", 30, |j| state(j) == "running");
    let (ok, out, err) = c.gangway(&["cancel", &id.to_string()]);
    assert!(ok, "{err}");
    assert!(
        out.starts_with(&format!("job {id} cancelling (cancel requested by")),
        "{out}"
    );
    let (ok, out, _) = c.gangway(&["describe", &id.to_string()]);
    assert!(ok && out.contains("state cancelling"), "{out}");
    let (ok, out, err) = c.gangway(&["cancel", &id.to_string(), "--wait"]);
    assert!(ok, "{err}");
    assert!(
        out.trim_end().ends_with(&format!("job {id} cancelled")),
        "{out}"
    );
    assert_eq!(state(&c.job(id)), "cancelled", "--wait returned at the end");

    let id = c.submit(&stubborn("limited", Some(1)));
    let seen = wait_for("stopping (time limit)", 30, || {
        let (_, out, _) = c.gangway(&["describe", &id.to_string()]);
        out.contains("state stopping (time limit)").then_some(out)
    });
    assert!(seen.contains("state stopping (time limit)"));
    let j = c.wait_job(id, "time out", 30, |j| state(j) == "timeout");
    assert_eq!(state(&j), "timeout");
}

/// `gangway up --submit ... --exit-when-done` exits with the jobs' outcome,
/// as `submit --wait` does: a job that failed with code 3 makes it exit 3.
#[test]
fn up_exit_when_done_fails_when_a_job_failed() {
    let dir = tempfile::tempdir().expect("tmp");
    let spec = dir.path().join("fails.yaml");
    std::fs::write(
        &spec,
        "name: fails\nqueue: default\nreplicas: 1\nresources: { gpus: 1 }\nrestart: { max_restarts: 0 }\nrun:\n  command: [\"sh\", \"-c\", \"echo broken; exit 3\"]\n",
    )
    .expect("spec");
    let mut child = Command::new(BIN)
        .args([
            "up",
            "--no-tls",
            "--disk-pressure-percent",
            "0",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
        ])
        .arg("--data-dir")
        .arg(dir.path().join("up"))
        .args([
            "--nodes",
            "1",
            "--gpus-per-node",
            "1",
            "--sync-ms",
            "100",
            "--exit-when-done",
            "--submit",
        ])
        .arg(&spec)
        .current_dir("/")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("gangway up");
    let status = wait_for("up to end", 90, || child.try_wait().expect("wait"));
    let out = child.wait_with_output().expect("output");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(stdout.contains("job 1: failed"), "{stdout}\n{stderr}");
    assert_eq!(status.code(), Some(3), "{stdout}\n{stderr}");
}

/// A gang that fails at start twice the same way (here a missing module)
/// is not restarted to exhaustion: it fails on its second attempt with
/// "same start failure twice". `restart.retry_start_failures` opts out.
#[test]
fn the_same_start_failure_twice_ends_the_job() {
    let (c, _) = cluster(&server_config(""), "startfail", 2);
    let spec = |retry: bool| {
        let mut j = shell_job(
            "no-torch",
            "echo 'ModuleNotFoundError: No module named torch_not_here' >&2; exit 1",
        );
        j["restart"] =
            json!({ "max_restarts": 5, "backoff_seconds": 0, "retry_start_failures": retry });
        j
    };
    let id = c.submit(&spec(false));
    let j = c.wait_job(id, "fail", 60, |j| state(j) == "failed");
    assert_eq!(
        (j["restarts"].as_u64(), j["attempt"].as_u64()),
        (Some(1), Some(1)),
        "{j:#}"
    );
    let failed = first_event(&j, "failed");
    assert!(
        failed.starts_with("same start failure twice: exited with code 1 on")
            && failed.contains("No module named torch_not_here"),
        "{failed}"
    );
    // Opted out: every restart is spent.
    let mut s = spec(true);
    s["restart"]["max_restarts"] = json!(2);
    let id = c.submit(&s);
    let j = c.wait_job(id, "fail", 60, |j| state(j) == "failed");
    assert_eq!(j["restarts"], 2, "{j:#}");
    assert!(
        !has_event(&j, None, "same start failure"),
        "{:?}",
        events(&j)
    );
}

/// The venv trap: an interpreter under a directory the rank's account
/// cannot enter. By absolute path the rank fails naming the account and
/// the directory; through `PATH` the job's events warn before the shell
/// falls back to the next entry.
#[test]
fn a_venv_the_rank_cannot_enter_is_named_with_the_account() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let (c, node) = cluster(&server_config(""), "venvtrap", 1);
    use std::os::unix::fs::PermissionsExt;
    let private = c.dir.path().join("private");
    std::fs::create_dir_all(private.join("venv/bin")).expect("venv");
    let python = private.join("venv/bin/python");
    std::fs::copy("/bin/true", &python).expect("python");
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let nobody = Command::new("id")
        .args(["-u", "nobody"])
        .output()
        .expect("id");
    let uid = String::from_utf8_lossy(&nobody.stdout).trim().to_string();
    let id = c.submit(&json!({
        "name": "venv", "queue": "default", "replicas": 1,
        "resources": { "gpus": 1 },
        "restart": { "max_restarts": 0 },
        "run": { "command": [python.display().to_string(), "train.py"] }
    }));
    let j = c.wait_end(id, "finish", 60);
    assert_eq!(state(&j), "failed", "{j:#}");
    let want = format!(
        "cannot start {:?}: permission denied for user nobody (uid {uid}): {} is 0700",
        python.display().to_string(),
        private.display()
    );
    assert!(
        c.rank_log(&node, id, 0).contains(&want),
        "{}",
        c.rank_log(&node, id, 0)
    );
    assert!(
        has_event(&j, Some("failed"), &want.replace('"', "\\\"")),
        "{:?}",
        events(&j)
    );
    let mut spec = shell_job("venv-path", "true");
    spec["run"]["env"] = json!({ "PATH": format!("{}/venv/bin:/usr/bin:/bin", private.display()) });
    let id = c.submit(&spec);
    let j = c.wait_end(id, "finish", 60);
    assert_eq!(state(&j), "succeeded", "{j:#}");
    let want = format!(
        "PATH entry {}/venv/bin cannot be searched by user nobody (uid {uid}): {} is 0700",
        private.display(),
        private.display()
    );
    assert!(has_event(&j, Some("warning"), &want), "{:?}", events(&j));
}

/// The shipped PyTorch examples, submitted as documented where the nodes'
/// python has no torch (this machine; torch stays out of CI): they fail on
/// their first attempt, saying what is missing and where to read how to
/// point them at a venv.
#[test]
fn the_pytorch_examples_fail_at_once_and_clearly_without_torch() {
    let has_torch = Command::new("/usr/bin/python3")
        .args(["-c", "import torch"])
        .output()
        .is_ok_and(|o| o.status.success());
    if has_torch {
        eprintln!("skipped: /usr/bin/python3 has torch here");
        return;
    }
    let (c, _) = cluster(&server_config(""), "notorch", 4);
    for (file, says) in [
        (
            "examples/ddp.yaml",
            "ddp_train.py: PyTorch is not installed for",
        ),
        ("examples/ddp_torchrun.yaml", "torchrun is not on PATH="),
    ] {
        let out = Command::new(BIN)
            .args(["submit", file])
            .current_dir(repo())
            .env("GANGWAY_ADDR", &c.addr)
            .env("GANGWAY_TOKEN", ADMIN)
            .env_remove("GANGWAY_CONFIG")
            .output()
            .expect("submit");
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let id: u64 = stdout
            .split_whitespace()
            .find_map(|w| {
                w.trim_end_matches(|c: char| !c.is_ascii_digit())
                    .parse()
                    .ok()
            })
            .expect("job id");
        let j = c.wait_end(id, "fail", 60);
        assert_eq!(state(&j), "failed", "{j:#}");
        assert_eq!(
            (j["attempt"].as_u64(), j["restarts"].as_u64()),
            (Some(0), Some(0)),
            "{file}"
        );
        let failed = first_event(&j, "failed");
        assert!(
            failed.contains("exited with code 3")
                && failed.contains(says)
                && failed.contains("fail_on_exit_codes"),
            "{file}: {failed}"
        );
    }
}
