//! A newcomer's first day with the real binary: `gangway up` twice from one
//! shell, its banner, `--exit-when-done`'s report and data directory, the
//! quota warning, certificate errors that name the CA, and the README's
//! tour run block by block on the cluster its first command starts.

mod common;

use common::{free_port, wait_for};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_gangway");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn example(name: &str) -> PathBuf {
    repo().join("examples").join(name)
}

/// A process (and its process group) killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(Some(_))) {
            return;
        }
        let pgid = format!("-{}", self.0.id());
        let _ = Command::new("kill").args(["--", &pgid]).status();
        let _ = Command::new("kill").arg(self.0.id().to_string()).status();
        for _ in 0..200 {
            if !matches!(self.0.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `gangway up` on a free port, with TLS (its throwaway CA), from `/` (a
/// directory the ranks' account may enter).
fn up(extra: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(["up", "--listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--disk-pressure-percent", "0", "--sync-ms", "100"])
        .args(extra)
        .env_remove("RUST_LOG")
        .env_remove("GANGWAY_CONFIG")
        .env_remove("GANGWAY_CA")
        .current_dir("/");
    c
}

/// A job file in `dir` (readable by the CLI only; ranks get the spec).
fn job_file(dir: &Path, name: &str, yaml: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, yaml).expect("job file");
    p
}

fn two_ranks(dir: &Path, script: &str) -> PathBuf {
    job_file(
        dir,
        "job.yaml",
        &format!(
            "name: first-day\nqueue: default\nreplicas: 2\nresources: {{ gpus: 1 }}\nrestart: {{ max_restarts: 0 }}\nrun:\n  command: [\"sh\", \"-c\", {}]\n",
            serde_json::to_string(script).expect("json")
        ),
    )
}

/// Runs `c` to its end (at most `secs`): status, stdout, stderr.
fn finish(mut c: Command, secs: u64) -> (bool, String, String) {
    let mut child = Proc(
        c.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn"),
    );
    let mut out = child.0.stdout.take().expect("stdout");
    let mut err = child.0.stderr.take().expect("stderr");
    let o = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let e = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = wait_for("the command to finish", secs, || {
        child.0.try_wait().expect("wait")
    });
    (
        status.success(),
        o.join().expect("stdout"),
        e.join().expect("stderr"),
    )
}

/// The data directory a banner names (`data in DIR`).
fn banner_dir(stdout: &str) -> PathBuf {
    let after = stdout
        .split("data in ")
        .nth(1)
        .unwrap_or_else(|| panic!("no data dir in the banner: {stdout}"));
    let end = after.find([' ', ',']).unwrap_or(after.len());
    PathBuf::from(&after[..end])
}

/// A second `up`, run with the first one's `GANGWAY_CONFIG` still exported
/// (its cli.yaml names the first cluster's CA), trusts only the CA it made
/// itself: its agents register, its job succeeds, and its temp data dir is
/// removed as the banner says.
#[test]
fn up_twice_with_the_first_ones_config_exported_trusts_only_its_own_ca() {
    let tmp = tempfile::tempdir().expect("tmp");
    let job = two_ranks(tmp.path(), "echo hello from rank $RANK");
    let first = tmp.path().join("first");
    let mut c = up(&["--nodes", "2", "--gpus-per-node", "1", "--exit-when-done"]);
    c.arg("--data-dir").arg(&first).arg("--submit").arg(&job);
    let (ok, out, err) = finish(c, 90);
    assert!(ok, "first up: {out}\n{err}");
    assert!(out.contains("job 1: succeeded"), "{out}\n{err}");
    // A --data-dir is the user's: kept.
    assert!(first.join("cli.yaml").exists() && first.join("ca.pem").exists());

    let mut c = up(&["--nodes", "2", "--gpus-per-node", "1", "--exit-when-done"]);
    c.arg("--submit")
        .arg(&job)
        .env("GANGWAY_CONFIG", first.join("cli.yaml"));
    let (ok, out, err) = finish(c, 90);
    assert!(ok, "second up: {out}\n{err}");
    assert!(out.contains("job 1: succeeded"), "{out}\n{err}");
    assert!(!err.contains("BadSignature"), "{err}");
    let dir = banner_dir(&out);
    assert!(
        out.contains("(removed when `up` exits; --keep keeps it)"),
        "{out}"
    );
    assert!(!dir.exists(), "{} was left behind", dir.display());
    assert!(err.contains(&format!("removed {}", dir.display())), "{err}");
}

/// `--exit-when-done` reports each job: the outcome, the last lines of the
/// failing rank's log (not its earlier lines), and no INFO lines unless
/// asked; `--keep` keeps the temp data dir it created.
#[test]
fn exit_when_done_prints_the_failing_ranks_last_lines_and_keep_keeps_the_data() {
    let tmp = tempfile::tempdir().expect("tmp");
    let job = two_ranks(
        tmp.path(),
        "for i in $(seq 1 30); do echo \"line $i of rank $RANK\"; done; [ \"$RANK\" = 1 ] && exit 3; sleep 1",
    );
    let mut c = up(&[
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--exit-when-done",
        "--keep",
    ]);
    c.arg("--submit").arg(&job);
    let (ok, out, err) = finish(c, 90);
    assert!(!ok, "a failed job must fail `up`: {out}\n{err}");
    assert!(out.contains("job 1: failed"), "{out}\n{err}");
    assert!(
        out.contains("rank 1 (failed, exit code 3): last 20 lines"),
        "{out}"
    );
    assert!(out.contains("line 11 of rank 1\n"), "{out}");
    assert!(out.contains("line 30 of rank 1\n"), "{out}");
    assert!(!out.contains("line 10 of rank 1\n"), "{out}");
    // Only the failing rank's log.
    assert!(!out.contains("of rank 0"), "{out}");
    assert!(
        !err.contains(" INFO "),
        "INFO lines without --verbose: {err}"
    );
    let dir = banner_dir(&out);
    assert!(!out.contains("removed when"), "{out}");
    assert!(dir.join("cli.yaml").exists(), "--keep: {}", dir.display());
    assert!(
        err.contains(&format!("kept the data in {}", dir.display())),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).expect("clean up the kept dir");
}

/// `--show-output` prints every rank's output; `--verbose` brings the INFO
/// lines back (on stderr, never in stdout's banner).
#[test]
fn exit_when_done_with_show_output_prints_every_rank() {
    let tmp = tempfile::tempdir().expect("tmp");
    let job = two_ranks(tmp.path(), "echo \"output of rank $RANK\"");
    let mut c = up(&[
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--exit-when-done",
        "--show-output",
        "--verbose",
    ]);
    c.arg("--submit").arg(&job);
    let (ok, out, err) = finish(c, 90);
    assert!(ok, "{out}\n{err}");
    for rank in 0..2 {
        assert!(out.contains(&format!("==> job 1 rank {rank} <==")), "{out}");
        assert!(out.contains(&format!("output of rank {rank}\n")), "{out}");
    }
    assert!(err.contains(" INFO "), "--verbose: {err}");
    assert!(!out.contains(" INFO "), "{out}");
}

/// An `up` left running until its banner: the banner line, stderr so far,
/// and the process.
fn up_until_banner(mut c: Command) -> (Proc, String, mpsc::Receiver<String>) {
    use std::os::unix::process::CommandExt;
    c.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null())
        .process_group(0);
    let mut child = Proc(c.spawn().expect("up"));
    let out = child.0.stdout.take().expect("stdout");
    let err = child.0.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let (etx, erx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            if etx.send(l).is_err() {
                break;
            }
        }
    });
    let banner = wait_for("the banner", 60, || match rx.try_recv() {
        Ok(l) if l.starts_with("Gangway is up") => Some(Some(l)),
        Ok(_) => None,
        Err(mpsc::TryRecvError::Empty) => {
            std::thread::sleep(Duration::from_millis(50));
            None
        }
        Err(mpsc::TryRecvError::Disconnected) => Some(None),
    });
    let Some(banner) = banner else {
        let _ = child.0.wait();
        let err: Vec<String> = erx.try_iter().collect();
        panic!("up exited before its banner: {}", err.join("\n"));
    };
    (child, banner, erx)
}

/// The banner of `up --machine` states the recorded machine's GPUs, not
/// the declared defaults (8 H100).
#[test]
fn the_banner_states_a_recorded_machines_own_gpus() {
    let mut c = up(&["--nodes", "2"]);
    c.arg("--machine")
        .arg(example("machines/hgx-a100-80gb.yaml"));
    let (_up, banner, _err) = up_until_banner(c);
    assert!(
        banner.contains("2 nodes x 8 NVIDIA A100-SXM4-80GB GPUs (recorded machine"),
        "{banner}"
    );
    assert!(!banner.contains("H100"), "{banner}");
    let mut c = up(&["--nodes", "1"]);
    c.arg("--machine").arg(example("machines/l4x8-pcie.yaml"));
    let (_up, banner, _err) = up_until_banner(c);
    assert!(banner.contains("1 node x 8 NVIDIA L4 GPUs"), "{banner}");
}

/// A throwaway CA certificate that signed nothing the server serves.
fn other_ca(dir: &Path) -> PathBuf {
    let key = rcgen::KeyPair::generate().expect("key");
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let cert = p.self_signed(&key).expect("ca");
    let path = dir.join("other-ca.pem");
    std::fs::write(&path, cert.pem()).expect("write");
    path
}

/// The CLI and an agent whose TLS handshake fails for the server's
/// certificate say so, naming the CA they trusted (or that none was
/// given) and how to pass the cluster's.
#[test]
fn certificate_errors_name_the_ca_and_how_to_pass_it() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("up");
    let mut c = up(&["--nodes", "1", "--gpus-per-node", "1"]);
    c.arg("--data-dir").arg(&data);
    let (_up, banner, _err) = up_until_banner(c);
    let addr = banner
        .split("server ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .expect("server address")
        .to_string();
    let cli = |env: &[(&str, &Path)]| {
        let mut c = Command::new(BIN);
        c.args(["queue", "--addr", &addr, "--token", "t"])
            .env_remove("GANGWAY_CONFIG")
            .env_remove("GANGWAY_CA")
            .env_remove("XDG_CONFIG_HOME")
            .env("HOME", tmp.path());
        for (k, v) in env {
            c.env(k, v);
        }
        c.output().expect("cli")
    };
    let o = cli(&[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("no CA was given"), "{err}");
    assert!(err.contains("--server-ca FILE or GANGWAY_CA=FILE"), "{err}");
    let other = other_ca(tmp.path());
    let o = cli(&[("GANGWAY_CA", &other)]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains(&format!("not signed by the CA in {}", other.display())),
        "{err}"
    );
    // With the cluster's own CA, the handshake passes (the token is wrong).
    let o = cli(&[("GANGWAY_CA", &data.join("ca.pem"))]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("401") && !err.contains("CA"), "{err}");

    // An agent given the wrong CA says which, instead of retrying silently.
    use std::os::unix::process::CommandExt;
    let mut agent = Proc(
        Command::new(BIN)
            .args(["agent", "--server", &addr, "--node", "wrong-ca"])
            .args(["--inventory", "declared", "--gpus", "1"])
            .args(["--disk-pressure-percent", "0"])
            .arg("--ca")
            .arg(&other)
            .arg("--state-dir")
            .arg(tmp.path().join("agent"))
            .env("GANGWAY_JOIN_TOKEN", "join-wrong")
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .expect("agent"),
    );
    let err = agent.0.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let want = format!("not signed by the CA in {}", other.display());
    let line = wait_for("the agent's certificate error", 30, || {
        rx.recv_timeout(Duration::from_millis(200))
            .ok()
            .filter(|l| l.contains(&want))
    });
    assert!(line.contains("--ca FILE"), "{line}");
    assert!(line.contains("ERROR"), "{line}");
}

/// `up --config` warns, before its banner, when the nominal quotas promise
/// more GPUs than the cluster it starts, naming the queues and the sums;
/// the example config fits the default `up` (4 nodes x 8 GPUs) and is not
/// warned about.
#[test]
fn up_config_warns_when_nominal_quotas_exceed_the_cluster() {
    let mut c = up(&[
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "--allow-shared-account",
    ]);
    c.arg("--config").arg(example("server.yaml"));
    let (_up, _banner, err) = up_until_banner(c);
    let err: Vec<String> = err.try_iter().collect();
    let err = err.join("\n");
    assert!(
        err.contains("warning: the nominal GPU quotas of the top-level queues (lab 32) add up to 32 GPUs, but the cluster has 8 (1 node x 8 GPUs)"),
        "{err}"
    );
    let mut c = up(&["--allow-shared-account"]);
    c.arg("--config").arg(example("server.yaml"));
    let (_up, _banner, err) = up_until_banner(c);
    let err: Vec<String> = err.try_iter().collect();
    assert!(
        !err.iter().any(|l| l.contains("nominal GPU quotas")),
        "{err:?}"
    );
}

/// The README's tour blocks: each fenced block after a `<!-- tour -->`
/// line, in order.
fn tour_blocks(readme: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut lines = readme.lines();
    while let Some(l) = lines.next() {
        if l.trim() != "<!-- tour -->" {
            continue;
        }
        let fence = lines.next().unwrap_or_default();
        assert!(
            fence.starts_with("```"),
            "a tour marker is followed by a code block: {fence}"
        );
        let mut block = String::new();
        for l in lines.by_ref() {
            if l.starts_with("```") {
                break;
            }
            block.push_str(l);
            block.push('\n');
        }
        blocks.push(block);
    }
    blocks
}

/// The README's tour, run as written (in one bash, `set -e`, from the
/// repository root, with the debug `gangway` first on PATH and `up` on a
/// free port): every command works on the cluster its first block starts.
#[test]
fn the_readme_tour_runs_on_the_readmes_own_cluster() {
    let readme = std::fs::read_to_string(repo().join("README.md")).expect("README");
    let blocks = tour_blocks(&readme);
    assert!(blocks.len() >= 2, "the README marks its tour: {blocks:?}");
    assert!(blocks[0].contains("gangway up "), "{}", blocks[0]);
    let port = free_port();
    let script = blocks.join("\n").replacen(
        "gangway up ",
        &format!("gangway up --listen 127.0.0.1:{port} "),
        1,
    );
    let bin = Path::new(BIN).parent().expect("bin dir");
    let mut c = Command::new("bash");
    c.args(["-euo", "pipefail", "-c", &format!("set -x\n{script}")])
        .current_dir(repo())
        .env(
            "PATH",
            format!(
                "{}:{}",
                bin.display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .env_remove("GANGWAY_CONFIG")
        .env_remove("GANGWAY_CA")
        .env_remove("GANGWAY_ADDR")
        .env_remove("GANGWAY_TOKEN")
        .env_remove("RUST_LOG");
    {
        use std::os::unix::process::CommandExt;
        c.process_group(0);
    }
    let (ok, out, err) = finish(c, 240);
    assert!(ok, "the tour failed:\n{out}\n{err}");
    // It ran to its end, through the job's own output.
    assert!(out.contains("rank 1 of 2"), "{out}\n{err}");
    assert!(err.contains("+ rm -r "), "{err}");
    if std::env::var_os("GANGWAY_SHOW_TOUR").is_some() {
        println!("{out}\n{err}");
    }
}

/// `server --config` warns once its nodes have registered (and their GPU
/// count has settled) when the nominal quotas promise more GPUs than they
/// have, naming the queue and the sums.
#[test]
fn server_config_warns_when_nominal_quotas_exceed_the_registered_nodes() {
    let mut c = common::Cluster::start_with(
        "127.0.0.1",
        &common::server_config("    quota: { nominal: { gpus: 16 } }\n"),
    );
    c.agent("n1", 8, &[], &[]);
    c.wait_nodes(1);
    let log = c.dir.path().join("server.log");
    let want = "the nominal GPU quotas of the top-level queues (default 16) add up to 16 GPUs, but the cluster has 8 (the 8 GPUs of the 1 nodes registered so far)";
    wait_for("the server's quota warning", 40, || {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|l| l.contains(want))
    });
}
