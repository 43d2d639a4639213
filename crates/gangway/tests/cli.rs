//! The CLI as a newcomer meets it: `gangway up --config` with the example
//! files, `submit --wait` exit codes and progress lines, shell completions.

mod common;

use common::{free_port, wait_for};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gangway");

/// The repository's `examples/` directory.
fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples")
        .join(name)
}

/// A `gangway up` process, stopped with SIGTERM (it stops its agents and
/// their ranks), then killed if it lingers.
struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = Command::new("kill").arg(self.0.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && matches!(self.0.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn up(data: &Path, port: u16, extra: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(["up", "--no-tls", "--listen", &format!("127.0.0.1:{port}")])
        // The host's own disk may be nearly full (see tests/availability.rs).
        .args(["--disk-pressure-percent", "0"])
        .arg("--data-dir")
        .arg(data)
        .args(extra)
        // Ranks run as another account: start them somewhere it may enter.
        .current_dir("/");
    c
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).to_string()
}

#[test]
fn up_with_the_example_config_runs_the_example_job_to_success() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = dir.path().join("up");
    // up's defaults (4 nodes x 8 GPUs): the example queues' quotas fit.
    // The example's users name no `unix_user`: under `up` they share
    // `--run-as`, which must be accepted in so many words.
    let mut child = Up(up(
        &data,
        free_port(),
        &[
            "--gpus",
            "8",
            "--sync-ms",
            "100",
            "--exit-when-done",
            "--allow-shared-account",
        ],
    )
    .arg("--config")
    .arg(example("server.yaml"))
    .arg("--submit")
    .arg(example("job.yaml"))
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .expect("gangway up"));
    let status = wait_for("up to finish the example job", 90, || {
        child.0.try_wait().expect("wait")
    });
    let mut stdout = String::new();
    child
        .0
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut stdout)
        .expect("read");
    let stderr = "";
    assert!(status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("submitted"), "{stdout}");
    assert!(stdout.contains("job 1: succeeded"), "{stdout}\n{stderr}");
    // The log of rank 1 shows the example's command ran with its gang env.
    let log = std::fs::read_dir(&data)
        .expect("data dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("node-"))
        .flat_map(|e| walk(&e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .map(|p| std::fs::read_to_string(p).unwrap_or_default())
        .find(|l| l.contains("rank 1 of 2"));
    assert!(log.is_some(), "no rank log says 'rank 1 of 2'");
}

/// Several users who run as one Unix account are one principal on a node:
/// `up --config` refuses to start so, saying what it means and how to fix
/// it, until `--allow-shared-account` accepts it.
#[test]
fn up_refuses_users_who_would_share_one_unix_account() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = dir.path().join("up");
    let out = up(&data, free_port(), &["--nodes", "1", "--run-as", "nobody"])
        .arg("--config")
        .arg(example("server.yaml"))
        .stdin(Stdio::null())
        .output()
        .expect("up");
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    for part in [
        "alice, bob run as Unix account \"nobody\"",
        "environment",
        "checkpoints",
        "TMPDIR",
        "signal",
        "unix_user:",
        "--allow-shared-account",
        "--run-as nobody",
    ] {
        assert!(err.contains(part), "{part}: {err}");
    }
    // Refused before anything was set up.
    assert!(!data.exists(), "{err}");
    // One account per user: no refusal (up starts; it is stopped at once).
    let cfg = dir.path().join("own.yaml");
    std::fs::write(
        &cfg,
        "admin_token: admin-secret-1\nagent_token: agent-secret-1\nusers:\n  - { name: alice, token: alice-token-1, queues: [default], unix_user: nobody }\n  - { name: bob, token: bob-token-11, queues: [default], unix_user: daemon }\nqueues:\n  - name: default\n",
    )
    .expect("config");
    let mut child = Up(up(&data, free_port(), &["--nodes", "1"])
        .arg("--config")
        .arg(&cfg)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("up"));
    let mut stdout = child.0.stdout.take().expect("stdout");
    let mut first = [0u8; 16];
    let n = stdout.read(&mut first).expect("read");
    assert_eq!(&first[..n.min(15)], b"Gangway is up: ", "up did not start");
}

/// The same rule for `gangway server`: users mapped to one account are
/// refused unless `--allow-shared-account`, which starts it.
#[test]
fn server_refuses_users_who_share_one_unix_account_unless_allowed() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = dir.path().join("server.yaml");
    std::fs::write(
        &cfg,
        "admin_token: admin-secret-1\nagent_token: agent-secret-1\nusers:\n  - { name: alice, token: alice-token-1, queues: [default], unix_user: lab }\n  - { name: bob, token: bob-token-11, queues: [default], unix_user: lab }\nqueues:\n  - name: default\n",
    )
    .expect("config");
    let server = |extra: &[&str], port: u16| {
        let mut c = Command::new(BIN);
        c.args(["server", "--config"])
            .arg(&cfg)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(extra);
        c
    };
    let out = server(&[], free_port()).output().expect("server");
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("alice, bob run as Unix account \"lab\"")
            && err.contains("signal")
            && err.contains("--allow-shared-account"),
        "{err}"
    );
    let port = free_port();
    let child = server(&["--allow-shared-account"], port)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("server");
    let _stop = Up(child);
    wait_for("the server to answer", 20, || {
        ureq::get(&format!("http://127.0.0.1:{port}/healthz"))
            .call()
            .ok()
    });
}

fn walk(p: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            let q = e.path();
            if q.is_dir() {
                out.extend(walk(&q));
            } else {
                out.push(q);
            }
        }
    }
    out
}

fn cli(cfg: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("GANGWAY_CONFIG", cfg)
        .env_remove("GANGWAY_ADDR")
        .env_remove("GANGWAY_TOKEN")
        .current_dir("/")
        .output()
        .expect("cli")
}

#[test]
fn submit_wait_follows_the_job_and_exits_with_its_outcome() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = dir.path().join("up");
    let _up = Up(up(
        &data,
        free_port(),
        &["--nodes", "1", "--gpus-per-node", "2"],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .expect("gangway up"));
    let cfg = data.join("cli.yaml");
    wait_for("up's CLI config", 60, || cfg.exists().then_some(()));
    // `--gpus-per-node 2`: a 2-GPU node (the flag is not ignored).
    let nodes = wait_for("the node", 30, || {
        let o = cli(&cfg, &["nodes", "-o", "json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).ok()?;
        (v.as_array()?.len() == 1).then_some(v)
    });
    assert_eq!(nodes[0]["gpus"].as_array().expect("gpus").len(), 2);
    let job = |name: &str, gpus: u32, cmd: &str| {
        let p = dir.path().join(format!("{name}.yaml"));
        std::fs::write(
            &p,
            format!("name: {name}\nqueue: default\nreplicas: 1\nresources: {{ gpus: {gpus} }}\nrestart: {{ max_restarts: 0 }}\nrun: {{ command: [sh, -c, \"{cmd}\"] }}\n"),
        )
        .expect("job file");
        p
    };
    // A 2-GPU job holds the node while the next one waits behind it.
    let hold = job("hold", 2, "sleep 3");
    let o = cli(&cfg, &["submit", hold.to_str().expect("path")]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let ok = job("ok", 1, "sleep 1");
    let o = cli(&cfg, &["submit", "--wait", ok.to_str().expect("path")]);
    let err = text(&o.stderr);
    assert!(o.status.success(), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert!(
        lines.iter().any(|l| l.starts_with("job 2: pending (")),
        "{err}"
    );
    assert!(
        lines
            .iter()
            .any(|l| *l == "job 2: running on node-0" || *l == "job 2: scheduled on node-0"),
        "{err}"
    );
    assert!(
        lines
            .last()
            .is_some_and(|l| l.starts_with("job 2: succeeded")),
        "{err}"
    );
    // A failing job: the exit status is its rank's exit code.
    let bad = job("bad", 1, "exit 3");
    let o = cli(
        &cfg,
        &[
            "submit",
            "--wait",
            "-o",
            "json",
            bad.to_str().expect("path"),
        ],
    );
    assert_eq!(o.status.code(), Some(3), "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("the final job as JSON");
    assert_eq!(v["state"], "failed");
    assert!(
        text(&o.stderr).contains("job 3: failed"),
        "{}",
        text(&o.stderr)
    );
}

/// `gangway submit` reports a spec error in the user's YAML: the field
/// path, plain words, `FILE:LINE:COLUMN` in the file they wrote, "did you
/// mean"; `queue:` may be left out on a one-queue cluster, and an unknown
/// queue's error lists the queues there are (issue 47's table, row by row).
#[test]
fn submit_errors_speak_the_users_yaml() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = dir.path().join("up");
    let _up = Up(up(
        &data,
        free_port(),
        &["--nodes", "1", "--gpus-per-node", "2"],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .expect("gangway up"));
    let cfg = data.join("cli.yaml");
    wait_for("up's CLI config", 60, || cfg.exists().then_some(()));
    wait_for("the node", 30, || {
        let o = cli(&cfg, &["nodes", "-o", "json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).ok()?;
        (v.as_array()?.len() == 1).then_some(())
    });
    let head = "name: t\nqueue: default\nreplicas: 1\nresources:\n  gpus: 1\n";
    let file = |name: &str, body: &str| {
        let p = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&p, body).expect("job file");
        p
    };
    let refused = |name: &str, body: &str| {
        let p = file(name, body);
        let o = cli(&cfg, &["submit", p.to_str().expect("path")]);
        assert!(!o.status.success(), "{name} was accepted");
        (text(&o.stderr), p.display().to_string())
    };
    let (err, p) = refused(
        "word",
        "name: t\nqueue: default\nreplicas: 1\nresources:\n  gpus: two\n",
    );
    assert!(
        err.contains(&format!(
            "resources.gpus: expected a whole number of GPUs, e.g. 2 (got the string \"two\") at {p}:5:9"
        )),
        "{err}"
    );
    let (err, p) = refused("negative", &format!("{head}runtime_seconds: -60\n"));
    assert!(
        err.contains(&format!(
            "runtime_seconds: expected a whole number of seconds, 0 or more, e.g. 3600 (got -60) at {p}:6:18"
        )),
        "{err}"
    );
    let (err, p) = refused(
        "string",
        &format!("{head}run:\n  command: python train.py\n"),
    );
    assert!(
        err.contains(&format!(
            r#"run.command: expected a list of words, e.g. ["python", "train.py"] (got the string "python train.py"); the command is not run by a shell: write its words as a list, or ["sh", "-c", "python train.py"] to run it through sh at {p}:7:12"#
        )),
        "{err}"
    );
    let (err, p) = refused(
        "typo",
        "name: t\nqueue: default\nreplica: 2\nresources:\n  gpus: 1\n",
    );
    assert!(
        err.contains(&format!(
            "unknown field `replica`; did you mean `replicas`? at {p}:3:1"
        )),
        "{err}"
    );
    let (err, _) = refused(
        "research",
        "name: t\nqueue: research\nreplicas: 1\nresources:\n  gpus: 1\n",
    );
    assert!(
        err.contains("queue: unknown queue \"research\"; you may submit to: default"),
        "{err}"
    );
    // A quoted number is a number to YAML, and so to the CLI and the server.
    let ok = |name: &str, body: &str| {
        let p = file(name, body);
        let o = cli(&cfg, &["submit", "-o", "json", p.to_str().expect("path")]);
        assert!(o.status.success(), "{name}: {}", text(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
        let id = v["id"].as_u64().expect("id").to_string();
        let o = cli(&cfg, &["describe", "-o", "json", &id]);
        serde_json::from_slice::<serde_json::Value>(&o.stdout).expect("job")
    };
    let job = ok(
        "quoted",
        "name: t\nqueue: default\nreplicas: 1\nresources:\n  gpus: \"2\"\nrun: { command: [\"true\"] }\n",
    );
    assert_eq!(job["spec"]["resources"]["gpus"], 2, "{job}");
    // One queue: it is the default.
    let job = ok(
        "no-queue",
        "name: t\nreplicas: 1\nresources:\n  gpus: 1\nrun: { command: [\"true\"] }\n",
    );
    assert_eq!(job["spec"]["queue"], "default", "{job}");
}

#[test]
fn completions_are_generated_for_each_shell() {
    for (shell, marker) in [
        ("bash", "_gangway()"),
        ("zsh", "#compdef gangway"),
        ("fish", "complete -c gangway"),
    ] {
        let o = Command::new(BIN)
            .args(["completions", shell])
            .output()
            .expect("run");
        assert!(o.status.success(), "{shell}: {}", text(&o.stderr));
        let s = text(&o.stdout);
        assert!(s.contains(marker), "{shell}: {}", &s[..s.len().min(300)]);
        assert!(s.contains("queue") && s.contains("page-size"), "{shell}");
    }
    let o = Command::new(BIN)
        .args(["completions", "tcsh"])
        .output()
        .expect("run");
    assert!(!o.status.success());
}

#[test]
fn the_first_gang_of_instant_ranks_on_a_fresh_cluster_ends_without_a_restart() {
    // Regression: the supervisor's exit-code directory was created only after
    // the first rank started, so a rank that ended at once left no exit code
    // and a fast sync reported it killed (137), restarting the gang.
    for round in 0..3 {
        let dir = tempfile::tempdir().expect("tmp");
        let data = dir.path().join("up");
        let _up = Up(up(
            &data,
            free_port(),
            &["--nodes", "2", "--gpus-per-node", "4", "--sync-ms", "50"],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("gangway up"));
        let cfg = data.join("cli.yaml");
        wait_for("up's CLI config", 60, || cfg.exists().then_some(()));
        let spec = dir.path().join("instant.yaml");
        std::fs::write(
            &spec,
            "name: instant\nqueue: default\nreplicas: 2\nresources: { gpus: 4 }\nrun: { command: [sh, -c, \"exit 0\"] }\n",
        )
        .expect("job file");
        let o = cli(
            &cfg,
            &[
                "submit",
                "--wait",
                "-o",
                "json",
                spec.to_str().expect("path"),
            ],
        );
        let err = text(&o.stderr);
        assert!(o.status.success(), "round {round}: {err}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("job json");
        assert_eq!(v["restarts"], 0, "round {round}: {err}\n{v}");
        assert!(v["failure"].is_null(), "round {round}: {}", v["failure"]);
    }
}

#[test]
fn up_warns_at_start_when_its_disk_is_already_under_pressure() {
    // Every filesystem has less than 100 % free: at that threshold the
    // nodes would take no work, and up must say so before anything waits.
    let dir = tempfile::tempdir().expect("tmp");
    let mut child = Up(Command::new(BIN)
        .args(["up", "--no-tls", "--listen", "127.0.0.1:0", "--nodes", "1"])
        .args(["--disk-pressure-percent", "100", "--data-dir"])
        .arg(dir.path().join("up"))
        .current_dir("/")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("gangway up"));
    let mut stderr = child.0.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let mut seen = Vec::new();
        while let Ok(n) = stderr.read(&mut buf) {
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&buf[..n]);
            let _ = tx.send(text(&seen));
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while Instant::now() < deadline && !last.contains("--disk-pressure-percent 0") {
        if let Ok(s) = rx.recv_timeout(Duration::from_millis(200)) {
            last = s;
        }
    }
    assert!(
        last.contains("warning: DiskPressure:")
            && last.contains("below 100 %")
            && last.contains("the nodes will take no new work")
            && last.contains("--disk-pressure-percent 0"),
        "{last}"
    );
}

#[test]
fn up_refuses_flags_it_would_ignore() {
    let o = Command::new(BIN)
        .args(["up", "-o", "json", "--no-tls", "--listen", "127.0.0.1:0"])
        .output()
        .expect("run");
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("--output is for the client commands"),
        "{}",
        text(&o.stderr)
    );
    // The client's connection flags are refused when typed to a daemon...
    for (args, flag) in [
        (
            vec!["server", "--config", "/nonexistent.yaml", "--token", "t"],
            "--token",
        ),
        (
            vec!["up", "--addr", "http://127.0.0.1:1", "--no-tls"],
            "--addr",
        ),
    ] {
        let o = Command::new(BIN).args(&args).output().expect("run");
        assert!(!o.status.success());
        assert!(
            text(&o.stderr).contains(&format!("{flag} is for the client commands")),
            "{args:?}: {}",
            text(&o.stderr)
        );
    }
    // ...but the environment the client commands use does not stop a daemon.
    let o = Command::new(BIN)
        .args(["server", "--config", "/nonexistent.yaml"])
        .env("GANGWAY_TOKEN", "t")
        .output()
        .expect("run");
    assert!(!o.status.success());
    assert!(
        !text(&o.stderr).contains("is for the client commands")
            && text(&o.stderr).contains("nonexistent"),
        "{}",
        text(&o.stderr)
    );
    // --gpus is --gpus-per-node (it used to be accepted and ignored).
    let help = text(
        &Command::new(BIN)
            .args(["up", "--help"])
            .output()
            .expect("help")
            .stdout,
    );
    assert!(
        help.contains("--gpus-per-node") && help.contains("[alias: --gpus]"),
        "{help}"
    );
    assert!(
        help.contains("--sync-ms") && help.contains("--config"),
        "{help}"
    );
}

#[test]
fn up_keeps_the_configs_checkpoint_root_or_refuses_a_relative_one() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tmp");
    // Ranks run as another account: let it reach the checkpoint root.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let root = dir.path().join("ckroot");
    std::fs::create_dir_all(&root).expect("root");
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let cfg = dir.path().join("server.yaml");
    let job = dir.path().join("job.yaml");
    std::fs::write(
        &job,
        "name: ck\nqueue: default\nreplicas: 1\nresources: { gpus: 1 }\ncheckpoint: { keep: true }\nrun:\n  command: [sh, -c, 'echo kept > $GANGWAY_CHECKPOINT_DIR/marker']\n",
    )
    .expect("job");
    // A relative root is refused with the reason.
    std::fs::write(
        &cfg,
        "admin_token: admin-secret-1\nagent_token: agent-secret-1\ncheckpoint_root: ckroot\nqueues:\n  - name: default\n",
    )
    .expect("config");
    let out = up(&dir.path().join("up1"), free_port(), &["--nodes", "1"])
        .arg("--config")
        .arg(&cfg)
        .output()
        .expect("up");
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("checkpoint_root: must be an absolute path"),
        "{}",
        text(&out.stderr)
    );
    // An absolute one is where the job's checkpoint directory is.
    std::fs::write(
        &cfg,
        format!(
            "admin_token: admin-secret-1\nagent_token: agent-secret-1\ncheckpoint_root: {}\nqueues:\n  - name: default\n",
            root.display()
        ),
    )
    .expect("config");
    let mut child = Up(up(
        &dir.path().join("up2"),
        free_port(),
        &["--nodes", "1", "--sync-ms", "100", "--exit-when-done"],
    )
    .arg("--config")
    .arg(&cfg)
    .arg("--submit")
    .arg(&job)
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .expect("gangway up"));
    let status = wait_for("up to finish the job", 90, || {
        child.0.try_wait().expect("wait")
    });
    assert!(status.success());
    let marker = walk(&root)
        .into_iter()
        .find(|p| p.file_name().is_some_and(|n| n == "marker"));
    let marker = marker.expect("the job's checkpoint dir is under the config's checkpoint_root");
    assert_eq!(
        std::fs::read_to_string(marker).expect("marker").trim(),
        "kept"
    );
}
