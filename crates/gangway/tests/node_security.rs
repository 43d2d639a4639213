//! Issue 12, the node side, tried as an attacker with a plain user's token
//! against a real server and real agents: ranks run as their Unix account
//! (never root), see a clean environment, and mount only what their queue
//! allows. Each test creates its own Unix accounts (unique names, removed
//! afterwards); the Docker test skips unless Docker is reachable (CI sets
//! `GANGWAY_REQUIRE_DOCKER`).

mod common;

use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// These tests create Unix accounts and drop privileges: they need root.
const ROOT_WHY: &str = "needs root to create Unix accounts";

const ALICE: &str = "alice-token-node-sec";
const GHOST: &str = "ghost-token-node-sec";
const ROOTY: &str = "rooty-token-node-sec";

/// A world-readable directory outside the cluster's: the allowed datasets.
struct Data {
    dir: tempfile::TempDir,
}

impl Data {
    fn new() -> Data {
        let dir = tempfile::tempdir().expect("tmp");
        let _ = Command::new("chmod").arg("0755").arg(dir.path()).status();
        for d in ["datasets", "scratch"] {
            std::fs::create_dir_all(dir.path().join(d)).expect("data dir");
        }
        std::fs::write(dir.path().join("datasets/input"), "tokens\n").expect("input");
        let _ = Command::new("chmod")
            .arg("0777")
            .arg(dir.path().join("scratch"))
            .status();
        Data { dir }
    }

    fn path(&self, p: &str) -> PathBuf {
        std::fs::canonicalize(self.dir.path())
            .expect("canonical")
            .join(p)
    }
}

/// A cluster whose users are alice (as `account`), ghost (an account that
/// does not exist) and rooty (root); queue `research` allows the datasets
/// (read-only) and the scratch directory (read-write).
fn cluster(account: &str, data: &Data) -> Cluster {
    let extra = format!(
        "  - name: research\n    node:\n      mounts: {{ allowed: [{ds}], read_write: [{sc}] }}\nusers:\n  - name: alice\n    token: {ALICE}\n    queues: [default, research]\n    unix_user: {account}\n  - name: ghost\n    token: {GHOST}\n    queues: [default]\n    unix_user: gw-no-such-{pid}\n  - name: rooty\n    token: {ROOTY}\n    queues: [default]\n    unix_user: root\n",
        ds = data.path("datasets").display(),
        sc = data.path("scratch").display(),
        pid = std::process::id(),
    );
    Cluster::start_with("127.0.0.1", &server_config(&extra))
}

fn job(queue: &str, command: &str, out: &Path) -> Value {
    json!({
        "name": "probe",
        "queue": queue,
        "replicas": 1,
        "resources": { "gpus": 1 },
        "restart": { "max_restarts": 0 },
        "run": {
            "command": ["sh", "-c", command],
            "env": { "OUT": out.display().to_string() }
        }
    })
}

fn finished(c: &Cluster, id: u64) -> Value {
    c.wait_job(id, "finish", 60, |j| {
        matches!(state(j), "succeeded" | "failed" | "cancelled")
    })
}

fn rank_log(c: &Cluster, id: u64) -> String {
    let out = Command::new(BIN)
        .args(["logs", &id.to_string(), "--rank", "0"])
        .env("GANGWAY_ADDR", &c.addr)
        .env("GANGWAY_TOKEN", ADMIN)
        .output()
        .expect("gangway logs");
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn read(out: &Path, name: &str) -> String {
    std::fs::read_to_string(out.join(name)).unwrap_or_default()
}

#[test]
fn attack_1_a_rank_runs_as_its_unix_account_and_cannot_read_shadow() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let acct = Account::create("a");
    let data = Data::new();
    let mut c = cluster(&acct.name, &data);
    c.agent("sec-a", 1, &[], &[]);
    c.wait_nodes(1);
    let script = r#"id -u > "$OUT/uid"; id -G > "$OUT/groups"
if cat /etc/shadow > "$OUT/shadow" 2>/dev/null; then echo read > "$OUT/shadow-rc"; else echo denied > "$OUT/shadow-rc"; fi
if (sudo -n true || su -c true root) </dev/null >/dev/null 2>&1; then echo yes > "$OUT/became-root"; fi
echo "$GANGWAY_CHECKPOINT_DIR" > "$OUT/ckpt"; echo saved > "$GANGWAY_CHECKPOINT_DIR/state"
if ls "$LOGS" > "$OUT/logs" 2>/dev/null; then echo listed > "$OUT/logs-rc"; else echo denied > "$OUT/logs-rc"; fi"#;
    let mut spec = job("default", script, &c.out);
    // Other jobs' logs live here: the rank must not get in.
    spec["run"]["env"]["LOGS"] = json!(c.dir.path().join("sec-a/logs").display().to_string());
    // Kept after success, so the test can look at its owner and mode.
    spec["checkpoint"] = json!({ "keep": true });
    let id = try_submit_as(&c, ALICE, &spec).expect("accepted");
    let j = finished(&c, id);
    assert_eq!(
        state(&j),
        "succeeded",
        "{:?}\n{}",
        events(&j),
        rank_log(&c, id)
    );
    assert_eq!(
        read(&c.out, "uid").trim(),
        acct.uid.to_string(),
        "runs as the account"
    );
    assert_ne!(read(&c.out, "uid").trim(), "0");
    assert_eq!(read(&c.out, "shadow-rc").trim(), "denied");
    assert_eq!(read(&c.out, "shadow"), "", "no line of /etc/shadow");
    assert!(!c.out.join("became-root").exists(), "no way back to root");
    assert_eq!(
        read(&c.out, "logs-rc").trim(),
        "denied",
        "the agent's logs directory"
    );
    // Its checkpoint directory is its own and others cannot look inside.
    let ckpt = PathBuf::from(read(&c.out, "ckpt").trim());
    let meta = std::fs::metadata(&ckpt).expect("checkpoint dir");
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    assert_eq!(meta.uid(), acct.uid);
    assert_eq!(meta.permissions().mode() & 0o777, 0o700);
    assert_eq!(read(&ckpt, "state").trim(), "saved");
    // Its log is its own and unreadable to others.
    let log = c
        .dir
        .path()
        .join(format!("sec-a/logs/job-{id}/attempt-0/rank-0.log"));
    let meta = std::fs::metadata(&log).expect("rank log");
    assert_eq!(meta.uid(), acct.uid);
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
}

#[test]
fn attack_2_a_rank_sees_a_clean_environment_and_not_the_agent_s() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let acct = Account::create("b");
    let data = Data::new();
    let mut c = cluster(&acct.name, &data);
    // The agent holds secrets in its environment, as a real deployment would.
    c.agent(
        "sec-b",
        1,
        &[
            "env",
            &format!("GANGWAY_JOIN_TOKEN={JOIN}"),
            "AGENT_ONLY_SECRET=s3cr3t",
            "LD_LIBRARY_PATH=/agent/lib",
        ],
        &["--pass-env", "LD_LIBRARY_PATH"],
    );
    c.wait_nodes(1);
    let script = r#"env > "$OUT/env"
tr '\0' '\n' < /proc/self/environ > "$OUT/self-environ"
if tr '\0' '\n' < /proc/$PPID/environ > "$OUT/parent-environ" 2>/dev/null; then echo read > "$OUT/parent-rc"; else echo denied > "$OUT/parent-rc"; fi"#;
    let mut spec = job("default", script, &c.out);
    spec["run"]["env"]["DATA"] = json!("/datasets");
    let id = try_submit_as(&c, ALICE, &spec).expect("accepted");
    let j = finished(&c, id);
    assert_eq!(
        state(&j),
        "succeeded",
        "{:?}\n{}",
        events(&j),
        rank_log(&c, id)
    );
    let env = read(&c.out, "env");
    for text in [&env, &read(&c.out, "self-environ")] {
        assert!(!text.contains(JOIN), "join token leaked: {text}");
        assert!(
            !text.contains("AGENT_ONLY_SECRET"),
            "agent variable leaked: {text}"
        );
    }
    assert_eq!(
        read(&c.out, "parent-rc").trim(),
        "denied",
        "/proc/$PPID/environ"
    );
    assert!(!read(&c.out, "parent-environ").contains(JOIN));
    let vars: std::collections::BTreeMap<&str, &str> =
        env.lines().filter_map(|l| l.split_once('=')).collect();
    assert_eq!(vars.get("USER"), Some(&acct.name.as_str()));
    assert_eq!(vars.get("LOGNAME"), Some(&acct.name.as_str()));
    // The account was made without a home: HOME is the job's own.
    let ckpt = vars.get("GANGWAY_CHECKPOINT_DIR").copied().unwrap_or("");
    assert_eq!(
        vars.get("HOME").copied(),
        Some(format!("{ckpt}/.home").as_str())
    );
    assert_eq!(vars.get("DATA"), Some(&"/datasets"), "the job's env");
    assert_eq!(vars.get("RANK"), Some(&"0"), "Gangway's variables");
    assert_eq!(
        vars.get("LD_LIBRARY_PATH"),
        Some(&"/agent/lib"),
        "--pass-env"
    );
    let allowed = [
        "PATH",
        "HOME",
        "TMPDIR",
        "USER",
        "LOGNAME",
        "LANG",
        "LD_LIBRARY_PATH",
        "OUT",
        "DATA",
        "PWD",
        "SHLVL",
        "_",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "NCCL_IB_HCA",
    ];
    for k in vars.keys() {
        let contract = k.starts_with("GANGWAY_")
            || [
                "MASTER_ADDR",
                "MASTER_PORT",
                "WORLD_SIZE",
                "RANK",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "NODE_RANK",
                "GROUP_RANK",
                "GROUP_WORLD_SIZE",
                "ROLE_RANK",
                "ROLE_WORLD_SIZE",
                "ROLE_NAME",
                "NNODES",
            ]
            .contains(k)
            || k.starts_with("TORCHELASTIC_")
            || k.starts_with("OMP_");
        assert!(
            contract || allowed.contains(k),
            "unexpected variable {k} in a rank"
        );
    }

    // Loader variables reach the user's own (never root) ranks: a queue
    // that allows root refuses them (tests/job_env.rs). Escaping working
    // directories are refused at submission.
    let mut loader = job("default", "true", &c.out);
    loader["run"]["env"]["LD_PRELOAD"] = json!("/tmp/own.so");
    assert!(
        try_submit_as(&c, ALICE, &loader).is_ok(),
        "LD_PRELOAD as a user"
    );
    let mut bad = job("default", "true", &c.out);
    bad["run"]["workdir"] = json!("/home/../root");
    let (code, msg) = try_submit_as(&c, ALICE, &bad).expect_err("workdir");
    assert_eq!(code, 422, "{msg}");
    assert!(msg.contains("run.workdir"), "{msg}");
}

#[test]
fn attack_3_host_mounts_outside_the_queue_s_allow_list_are_refused() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let acct = Account::create("c");
    let data = Data::new();
    // A symlink under an allowed prefix that leads to /etc.
    std::os::unix::fs::symlink("/etc", data.path("datasets/etc-link")).expect("symlink");
    let mut c = cluster(&acct.name, &data);
    let out = c.out.clone();
    let with_mount = |source: &str, read_only: bool| {
        let mut s = job("research", "true", &out);
        s["run"]["image"] = json!("busybox");
        s["run"]["mounts"] =
            json!([{ "source": source, "target": "/data", "read_only": read_only }]);
        s
    };
    for (source, read_only) in [
        ("/", true),
        ("/etc", false),
        ("/var/run/docker.sock", true),
        ("/data/../root", true),
        ("/home", true),
    ] {
        let (code, msg) =
            try_submit_as(&c, ALICE, &with_mount(source, read_only)).expect_err(source);
        assert_eq!(code, 422, "{source}: {msg}");
        assert!(msg.contains("run.mounts[0].source"), "{source}: {msg}");
    }
    // Read-write only where the queue says so.
    let ds = data.path("datasets").display().to_string();
    let (code, msg) = try_submit_as(&c, ALICE, &with_mount(&ds, false)).expect_err("rw dataset");
    assert_eq!(code, 422);
    assert!(msg.contains("run.mounts[0].read_only"), "{msg}");
    // The default queue allows no host path at all.
    let mut s = with_mount(&ds, true);
    s["queue"] = json!("default");
    let (code, msg) = try_submit_as(&c, ALICE, &s).expect_err("default queue");
    assert_eq!(code, 422);
    assert!(msg.contains("queue default"), "{msg}");

    // The symlink passes the server's lexical check; the agent resolves it
    // and refuses, naming the field and the real path.
    c.agent("sec-c", 1, &[], &[]);
    c.wait_nodes(1);
    let link = data.path("datasets/etc-link").display().to_string();
    let id = try_submit_as(&c, ALICE, &with_mount(&link, true)).expect("lexically fine");
    let j = finished(&c, id);
    assert_eq!(state(&j), "failed", "{:?}", events(&j));
    let log = rank_log(&c, id);
    assert!(
        log.contains("run.mounts[0].source") && log.contains("\"/etc\""),
        "{log}"
    );
}

#[test]
fn a_missing_account_fails_the_rank_naming_it_and_root_needs_an_allowing_queue() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let acct = Account::create("d");
    let data = Data::new();
    let mut c = cluster(&acct.name, &data);
    // Root accounts are refused at submission unless the queue allows root.
    let (code, msg) = try_submit_as(&c, ROOTY, &job("default", "id -u", &c.out)).expect_err("root");
    assert_eq!(code, 422, "{msg}");
    assert!(msg.contains("allow_root"), "{msg}");
    c.agent("sec-d", 1, &[], &[]);
    c.wait_nodes(1);
    let id =
        try_submit_as(&c, GHOST, &job("default", "touch \"$OUT/ran\"", &c.out)).expect("accepted");
    let j = finished(&c, id);
    assert_eq!(state(&j), "failed", "{:?}", events(&j));
    assert!(!c.out.join("ran").exists(), "nothing ran");
    let log = rank_log(&c, id);
    let missing = format!("gw-no-such-{}", std::process::id());
    assert!(log.contains(&missing) && log.contains("sec-d"), "{log}");
}

#[test]
fn a_real_user_s_job_with_an_allowed_dataset_runs_end_to_end() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let acct = Account::create("e");
    let data = Data::new();
    let mut c = cluster(&acct.name, &data);
    c.agent("sec-e1", 2, &[], &[]);
    c.agent("sec-e2", 2, &[], &[]);
    c.wait_nodes(2);
    let ds = data.path("datasets");
    let scratch = data.path("scratch");
    let script = format!(
        r#"cat {ds}/input > "$OUT/read-$RANK" && id -u > "$OUT/uid-$RANK" && echo "$RANK" > "$GANGWAY_CHECKPOINT_DIR/rank-$RANK" && echo "rank $RANK trained" > {sc}/rank-$RANK"#,
        ds = ds.display(),
        sc = scratch.display()
    );
    let spec = json!({
        "name": "train",
        "queue": "research",
        "replicas": 4,
        "resources": { "gpus": 1 },
        "restart": { "max_restarts": 0 },
        "run": {
            "command": ["sh", "-c", script],
            "env": { "OUT": c.out.display().to_string() },
            "mounts": [
                { "source": ds.display().to_string(), "target": "/data", "read_only": true },
                { "source": scratch.display().to_string(), "target": "/scratch" }
            ]
        }
    });
    let id = try_submit_as(&c, ALICE, &spec).expect("accepted");
    let j = finished(&c, id);
    assert_eq!(
        state(&j),
        "succeeded",
        "{:?}\n{}",
        events(&j),
        rank_log(&c, id)
    );
    for r in 0..4 {
        assert_eq!(read(&c.out, &format!("read-{r}")), "tokens\n");
        assert_eq!(
            read(&c.out, &format!("uid-{r}")).trim(),
            acct.uid.to_string()
        );
        assert_eq!(
            read(&scratch, &format!("rank-{r}")),
            format!("rank {r} trained\n")
        );
        let owner = std::os::unix::fs::MetadataExt::uid(
            &std::fs::metadata(scratch.join(format!("rank-{r}"))).expect("written"),
        );
        assert_eq!(owner, acct.uid, "files are the user's, not root's");
    }
}

/// The value of a `/proc/self/status` line.
fn status_field<'a>(status: &'a str, key: &str) -> &'a str {
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(str::trim)
        .unwrap_or("")
}

#[test]
fn a_docker_rank_runs_as_the_account_without_capabilities_or_host_network() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    if let Err(why) = busybox_image() {
        return skip_or_fail("GANGWAY_REQUIRE_DOCKER", &why);
    }
    let acct = Account::create("f");
    let data = Data::new();
    let mut c = cluster(&acct.name, &data);
    c.agent("sec-f", 2, &[], &["--executor", "docker"]);
    c.wait_nodes(1);
    let out = c.out.display().to_string();
    let script = r#"id -u > "$OUT/uid-$RANK"
cat /proc/self/status > "$OUT/status-$RANK"
cat /data/input > "$OUT/read-$RANK"
ls /sys/class/net > "$OUT/net-$RANK"
echo "$MASTER_ADDR" > "$OUT/master-$RANK"
echo "$RANK" > "$GANGWAY_CHECKPOINT_DIR/rank-$RANK"
(echo x > /data/written) 2>/dev/null && touch "$OUT/wrote-$RANK"
sleep 2"#;
    let spec = json!({
        "name": "contained",
        "queue": "research",
        "replicas": 2,
        "resources": { "gpus": 1 },
        "restart": { "max_restarts": 0 },
        "run": {
            "image": IMAGE,
            "command": ["sh", "-c", script],
            "env": { "OUT": out },
            "mounts": [
                { "source": data.path("datasets").display().to_string(), "target": "/data", "read_only": true },
                { "source": c.out.display().to_string(), "target": out }
            ]
        }
    });
    // $OUT is not under an allowed prefix: refused, then allowed via scratch.
    let (code, msg) = try_submit_as(&c, ALICE, &spec).expect_err("out not allowed");
    assert_eq!(code, 422, "{msg}");
    let scratch_out = data.path("scratch");
    let mut spec = spec;
    spec["run"]["env"]["OUT"] = json!(scratch_out.display().to_string());
    spec["run"]["mounts"][1] = json!({
        "source": scratch_out.display().to_string(),
        "target": scratch_out.display().to_string()
    });
    let id = try_submit_as(&c, ALICE, &spec).expect("accepted");
    let j = finished(&c, id);
    assert_eq!(
        state(&j),
        "succeeded",
        "{:?}\n{}",
        events(&j),
        rank_log(&c, id)
    );
    for r in 0..2 {
        assert_eq!(
            read(&scratch_out, &format!("uid-{r}")).trim(),
            acct.uid.to_string()
        );
        let status = read(&scratch_out, &format!("status-{r}"));
        for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            assert_eq!(
                status_field(&status, cap).trim_start_matches('0'),
                "",
                "{cap} in {status}"
            );
        }
        assert_eq!(status_field(&status, "NoNewPrivs"), "1", "{status}");
        assert_eq!(read(&scratch_out, &format!("read-{r}")), "tokens\n");
        assert!(
            !scratch_out.join(format!("wrote-{r}")).exists(),
            "dataset is read-only"
        );
        // A bridge network: the container sees its own interfaces, not the host's.
        let net = read(&scratch_out, &format!("net-{r}"));
        assert!(net.lines().any(|l| l == "eth0"), "bridge interface: {net}");
        assert!(
            !net.lines().any(|l| l.starts_with("docker")),
            "host interfaces: {net}"
        );
    }
    // One node: rank 0 rendezvous on its own loopback, rank 1 at rank 0's container.
    assert_eq!(read(&scratch_out, "master-0").trim(), "127.0.0.1");
    let m1 = read(&scratch_out, "master-1");
    assert!(!m1.trim().is_empty() && m1.trim() != "127.0.0.1", "{m1}");
}

fn cli(config: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN)
        .args(args)
        .env("GANGWAY_CONFIG", config)
        .env_remove("GANGWAY_ADDR")
        .env_remove("GANGWAY_TOKEN")
        .env_remove("GANGWAY_CA")
        .output()
        .expect("gangway");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn gangway_up_serves_tls_with_a_throwaway_ca_and_agents_logs_too() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let data = dir.path().join("up");
    let up = Kill(
        Command::new(BIN)
            .args(["up", "--nodes", "1", "--gpus-per-node", "2"])
            .args(["--disk-pressure-percent", "0"])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .arg("--data-dir")
            .arg(&data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("gangway up"),
    );
    let config = data.join("cli.yaml");
    wait_for("cli.yaml", 60, || {
        std::fs::read_to_string(&config)
            .ok()
            .filter(|t| t.contains("ca:"))
    });
    let text = std::fs::read_to_string(&config).expect("cli.yaml");
    let addr = format!("https://127.0.0.1:{port}");
    assert!(text.contains(&format!("addr: {addr}")), "{text}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&config)
        .expect("cli.yaml")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the admin token is the owner's alone");
    wait_for("the node", 60, || {
        let (ok, out) = cli(&config, &["nodes", "-o", "json"]);
        (ok && out.contains("node-0")).then_some(out)
    });
    let job = dir.path().join("job.yaml");
    std::fs::write(
        &job,
        "name: hello\nqueue: default\nreplicas: 1\nresources: { gpus: 1 }\nrun:\n  command: [sh, -c, \"echo hello over tls; id -u\"]\n  workdir: /\n",
    )
    .expect("job");
    let (ok, out) = cli(&config, &["submit", job.to_str().expect("utf-8")]);
    assert!(ok, "{out}");
    // Logs come from the agent's endpoint, which serves TLS too: the server
    // relays them only after checking the agent's certificate against the CA.
    // Started by root: ranks run as nobody. The two lines may arrive in
    // separate log chunks, so wait for both rather than the first.
    let nobody = Command::new("id")
        .args(["-u", "nobody"])
        .output()
        .expect("id");
    let nobody = String::from_utf8_lossy(&nobody.stdout).trim().to_string();
    let log = wait_for("the rank's log through the server", 60, || {
        let (ok, out) = cli(&config, &["logs", "1"]);
        (ok && out.contains("hello over tls") && out.lines().count() >= 2).then_some(out)
    });
    assert!(
        log.lines().any(|l| l.trim() == nobody),
        "the rank did not run as nobody ({nobody}): {log}"
    );

    // Without the CA the certificate is not trusted; plain HTTP gets nowhere.
    let untrusted = ureq::get(&format!("{addr}/healthz")).call();
    assert!(untrusted.is_err(), "a client without the CA connected");
    let plain = ureq::get(&format!("http://127.0.0.1:{port}/healthz"))
        .timeout(Duration::from_secs(5))
        .call();
    assert!(plain.is_err(), "plain HTTP answered");
    drop(up);
}

/// A CA and a certificate for 127.0.0.1 signed by it, as PEM files in `dir`
/// (`ca.pem`, `cert.pem`, `key.pem`).
fn make_ca(dir: &Path) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
    std::fs::create_dir_all(dir).expect("ca dir");
    let ca_key = KeyPair::generate().expect("key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).expect("ca");
    let key = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .expect("params")
        .signed_by(&key, &ca_cert, &ca_key)
        .expect("cert");
    std::fs::write(dir.join("ca.pem"), ca_cert.pem()).expect("write");
    std::fs::write(dir.join("cert.pem"), cert.pem()).expect("write");
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).expect("write");
}

/// Stops a `gangway` process with SIGTERM (it kills its ranks) when dropped.
struct Kill(std::process::Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg(self.0.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline && matches!(self.0.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn server_and_agents_speak_tls_and_refuse_a_peer_signed_by_another_ca() {
    if skip_unless_root(ROOT_WHY) {
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    let _ = Command::new("chmod").arg("0755").arg(dir.path()).status();
    let (good, other) = (dir.path().join("pki"), dir.path().join("other"));
    make_ca(&good);
    make_ca(&other);
    let pem = |d: &Path, f: &str| d.join(f).display().to_string();
    let config = dir.path().join("server.yaml");
    std::fs::write(&config, server_config("")).expect("config");
    let port = free_port();
    let addr = format!("https://127.0.0.1:{port}");
    let log = |name: &str| std::fs::File::create(dir.path().join(name)).expect("log");
    let _server = Kill(
        Command::new(BIN)
            .args(["server", "--config", &config.display().to_string()])
            .args(["--data-dir", &dir.path().join("data").display().to_string()])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--tls-cert", &pem(&good, "cert.pem")])
            .args(["--tls-key", &pem(&good, "key.pem")])
            .args(["--ca", &pem(&good, "ca.pem")])
            .stdout(Stdio::null())
            .stderr(log("server.log"))
            .spawn()
            .expect("server"),
    );
    let agent = |node: &str, ca: &Path| {
        Kill(
            Command::new(BIN)
                .args(["agent", "--server", &addr, "--node", node])
                .args(["--inventory", "declared", "--gpus", "1", "--sync-ms", "300"])
                .args(["--state-dir", &dir.path().join(node).display().to_string()])
                .args(["--tls-cert", &pem(&good, "cert.pem")])
                .args(["--tls-key", &pem(&good, "key.pem")])
                .args(["--ca", &pem(ca, "ca.pem")])
                .env("GANGWAY_JOIN_TOKEN", JOIN)
                .stdout(Stdio::null())
                .stderr(log(&format!("{node}.log")))
                .spawn()
                .expect("agent"),
        )
    };
    let _a = agent("tls-good", &good);
    let _b = agent("tls-wrong-ca", &other);
    let gw = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(args)
            .env("GANGWAY_ADDR", &addr)
            .env("GANGWAY_TOKEN", ADMIN)
            .env("GANGWAY_CA", pem(&good, "ca.pem"))
            .env_remove("GANGWAY_CONFIG")
            .output()
            .expect("gangway");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    wait_for("the good node", 60, || {
        let (ok, out) = gw(&["nodes", "-o", "json"]);
        (ok && out.contains("tls-good")).then_some(())
    });
    let job = dir.path().join("job.yaml");
    std::fs::write(
        &job,
        "name: t\nqueue: default\nreplicas: 1\nresources: { gpus: 1 }\nrun:\n  command: [sh, -c, \"echo secret-free log line\"]\n  workdir: /\n",
    )
    .expect("job");
    let (ok, out) = gw(&["submit", &job.display().to_string()]);
    assert!(ok, "{out}");
    wait_for("the log relayed over TLS", 60, || {
        let (ok, out) = gw(&["logs", "1"]);
        (ok && out.contains("secret-free log line")).then_some(())
    });
    // The agent that trusts another CA never joined.
    let (_, nodes) = gw(&["nodes", "-o", "json"]);
    assert!(!nodes.contains("tls-wrong-ca"), "{nodes}");
    // The CLI with the wrong CA is refused too.
    let out = Command::new(BIN)
        .args(["queue"])
        .env("GANGWAY_ADDR", &addr)
        .env("GANGWAY_TOKEN", ADMIN)
        .env("GANGWAY_CA", pem(&other, "ca.pem"))
        .env_remove("GANGWAY_CONFIG")
        .output()
        .expect("gangway");
    assert!(!out.status.success(), "a CLI trusting another CA connected");
}
