//! A real cluster for end-to-end tests: a `gangway server` process and
//! `gangway agent` processes with declared GPUs, each on its own state dir.

#![allow(dead_code)]

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A registry-free test image (see [`busybox_image`]).
pub const IMAGE: &str = "gangway-test-busybox:1";
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_gangway");
pub const ADMIN: &str = "admin-secret";
pub const JOIN: &str = "agent-secret";

/// A rank for tests: records its environment and pid, checkpoints a step
/// counter, resumes from it, saves it on SIGTERM, and runs until `$OUT/stop`
/// exists or `STEPS` steps of 0.2 s are done (so nothing outlives a test long).
pub const RANK_SCRIPT: &str = r#"#!/bin/sh
key="$GANGWAY_ATTEMPT-$RANK"
env > "$OUT/env-$key.tmp" && mv "$OUT/env-$key.tmp" "$OUT/env-$key"
echo $$ > "$OUT/pid-$key"
echo "rank $RANK of $WORLD_SIZE starting on $GANGWAY_NODE"
ckpt="$GANGWAY_CHECKPOINT_DIR/rank-$RANK"
step=0
if [ -f "$ckpt" ]; then step=$(cat "$ckpt"); echo "$step" > "$OUT/resumed-$key"; fi
trap 'echo "$step" > "$ckpt"; echo "$step" > "$OUT/checkpointed-$key"; exit 0' TERM
while [ "$step" -lt "${STEPS:-600}" ] && [ ! -e "$OUT/stop" ]; do
  sleep 0.2
  step=$((step + 1))
  echo "$step" > "$ckpt"
done
echo "rank $RANK done at step $step"
"#;

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub addr: String,
    pub out: PathBuf,
    pub script: PathBuf,
    server: Child,
    /// Extra `gangway server` flags (kept for [`Cluster::replace_server`]).
    server_args: Vec<String>,
    pub agents: BTreeMap<String, Child>,
    /// Extra commands to run at teardown (network namespaces).
    pub teardown: Vec<Vec<String>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::write(self.out.join("stop"), "");
        for c in self.agents.values_mut() {
            // SIGTERM: the agent kills its ranks on the way out.
            let _ = Command::new("kill").arg(c.id().to_string()).status();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for c in self.agents.values_mut() {
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = self.server.kill();
        let _ = self.server.wait();
        kill_recorded_ranks(&self.out);
        for cmd in &self.teardown {
            let _ = Command::new(&cmd[0]).args(&cmd[1..]).output();
        }
    }
}

/// `gangway server` with `dir/server.yaml` on `data_dir`, logging to
/// `dir/server.log`, with `args` after the others.
fn spawn_server(dir: &Path, data_dir: &Path, listen: &str, args: &[String]) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("server.log"))
        .expect("log");
    Command::new(BIN)
        .args(["server", "--config"])
        .arg(dir.join("server.yaml"))
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--listen", listen])
        .args(args)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn server")
}

/// Kills every rank that recorded its pid (orphans of a killed agent).
pub fn kill_recorded_ranks(out: &Path) {
    for (_, pid) in pids(out, None) {
        let _ = Command::new("kill")
            .args(["-9", "--", &format!("-{pid}")])
            .output();
    }
}

/// `pid-ATTEMPT-RANK` files: (rank, pid) of one attempt, or of all.
pub fn pids(out: &Path, attempt: Option<u32>) -> Vec<(u32, u32)> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(out).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix("pid-") else {
            continue;
        };
        let Some((a, r)) = rest.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(r)) = (a.parse::<u32>(), r.parse::<u32>()) else {
            continue;
        };
        if attempt.is_some_and(|x| x != a) {
            continue;
        }
        if let Ok(Ok(p)) = std::fs::read_to_string(e.path()).map(|t| t.trim().parse::<u32>()) {
            v.push((r, p));
        }
    }
    v.sort();
    v
}

pub fn alive(pid: u32) -> bool {
    // A zombie (state Z) still has a /proc entry but runs nothing.
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat.rsplit(')').next().unwrap_or("").trim_start();
    !state.starts_with(['Z', 'X'])
}

pub fn server_config(extra: &str) -> String {
    format!(
        "admin_token: {ADMIN}\nagent_token: {JOIN}\nnode_approval: auto\ncycle_seconds: 1\nnode_not_ready_seconds: 2\nnode_lost_seconds: 4\nqueues:\n  - name: default\n{extra}"
    )
}

impl Cluster {
    /// Where node `node`'s declared agent reads its GPUs' health (a line
    /// `INDEX REASON` per unhealthy GPU): the stand-in for NVML's events.
    pub fn gpu_health_file(&self, node: &str) -> PathBuf {
        self.dir.path().join(format!("{node}/unhealthy-gpus"))
    }

    /// GPU `gpu` of `node` falls off the bus (the stand-in for XID 79).
    pub fn lose_gpu(&self, node: &str, gpu: u64) {
        std::fs::write(
            self.gpu_health_file(node),
            format!("{gpu} XID 79: GPU has fallen off the bus\n"),
        )
        .expect("health file");
    }

    /// The first GPU of running job `j` (its JSON) falls off the bus;
    /// returns its node.
    pub fn lose_gpu_under(&self, j: &Value) -> String {
        let node = j["placement"][0]["node"]
            .as_str()
            .expect("node")
            .to_string();
        let gpu = j["placement"][0]["gpus"][0].as_u64().expect("gpu");
        self.lose_gpu(&node, gpu);
        node
    }

    /// A server on `listen_ip` with the test config.
    pub fn start(listen_ip: &str) -> Cluster {
        Self::start_with(listen_ip, &server_config(""))
    }

    pub fn start_with(listen_ip: &str, config: &str) -> Cluster {
        Self::start_in(tempfile::tempdir().expect("tmp"), listen_ip, config)
    }

    /// [`Cluster::start_with`] for a config whose users share one Unix
    /// account (`gangway server --allow-shared-account`).
    pub fn start_shared(listen_ip: &str, config: &str) -> Cluster {
        Self::start_args(
            tempfile::tempdir().expect("tmp"),
            listen_ip,
            config,
            &["--allow-shared-account"],
        )
    }

    /// [`Cluster::start_with`] in `dir`, whose `data/` may already hold a store.
    pub fn start_in(dir: tempfile::TempDir, listen_ip: &str, config: &str) -> Cluster {
        Self::start_args(dir, listen_ip, config, &[])
    }

    /// [`Cluster::start_in`] with extra `gangway server` flags.
    pub fn start_args(
        dir: tempfile::TempDir,
        listen_ip: &str,
        config: &str,
        args: &[&str],
    ) -> Cluster {
        let server_args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        // Ranks run as an unprivileged account: let them reach the rank
        // script and the checkpoint root in here.
        let _ = Command::new("chmod")
            .args(["0755"])
            .arg(dir.path())
            .status();
        let out = dir.path().join("out");
        std::fs::create_dir_all(&out).expect("out dir");
        // Containers may run as another user: let anyone write results.
        let _ = Command::new("chmod").args(["0777"]).arg(&out).status();
        let script = dir.path().join("rank.sh");
        std::fs::write(&script, RANK_SCRIPT).expect("script");
        let cfg = dir.path().join("server.yaml");
        std::fs::write(&cfg, config).expect("config");
        let listen = format!("{listen_ip}:{}", free_port());
        let server = spawn_server(dir.path(), &dir.path().join("data"), &listen, &server_args);
        let addr = format!("http://{listen}");
        let c = Cluster {
            dir,
            addr,
            out,
            script,
            server,
            server_args,
            agents: BTreeMap::new(),
            teardown: Vec::new(),
        };
        wait_for("server up", 20, || {
            ureq::get(&format!("{}/healthz", c.addr)).call().ok()
        });
        c
    }

    /// Stops the server and starts another with the same configuration on
    /// the same address, on the store in `data_dir` (a restored backup, an
    /// upgrade); agents keep running and reconnect.
    pub fn replace_server(&mut self, data_dir: &Path) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let listen = self.addr.trim_start_matches("http://").to_string();
        self.server = spawn_server(self.dir.path(), data_dir, &listen, &self.server_args);
        wait_for("server up", 20, || {
            ureq::get(&format!("{}/healthz", self.addr)).call().ok()
        });
    }

    /// Starts `gangway agent` for `node` with `gpus` declared GPUs; `prefix`
    /// runs it elsewhere (e.g. `ip netns exec NS`).
    pub fn agent(&mut self, node: &str, gpus: u32, prefix: &[&str], extra: &[&str]) {
        let state = self.dir.path().join(node);
        std::fs::create_dir_all(&state).expect("state dir");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{node}.log")))
            .expect("log");
        let mut argv: Vec<String> = prefix.iter().map(|s| s.to_string()).collect();
        argv.push(BIN.into());
        for a in [
            "agent",
            "--server",
            &self.addr,
            "--join-token",
            JOIN,
            "--node",
            node,
            "--inventory",
            "declared",
            "--gpus",
            &gpus.to_string(),
            "--sync-ms",
            "300",
            "--cpu-millis",
            "64000",
        ] {
            argv.push(a.to_string());
        }
        // The host's own disk may be nearly full: only tests of the
        // free-space watch turn it on (on a filesystem of their own).
        if !extra.contains(&"--disk-pressure-percent") {
            argv.extend(["--disk-pressure-percent".to_string(), "0".to_string()]);
        }
        // Rank scripts and results live in this test's directory under
        // /tmp: only tests of per-job scratch give ranks their own /tmp.
        if !extra.contains(&"--job-scratch") {
            argv.extend(["--job-scratch".to_string(), "shared".to_string()]);
        }
        if !extra.contains(&"--memory-mib") {
            argv.extend(["--memory-mib".to_string(), "262144".to_string()]);
        }
        argv.push("--state-dir".into());
        argv.push(state.display().to_string());
        if !extra.contains(&"--checkpoint-root") {
            argv.push("--checkpoint-root".into());
            argv.push(self.dir.path().join("checkpoints").display().to_string());
        }
        argv.extend(extra.iter().map(|s| s.to_string()));
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn agent");
        self.agents.insert(node.to_string(), child);
    }

    /// Waits until `n` nodes are registered and Ready.
    pub fn wait_nodes(&self, n: usize) {
        wait_for("nodes ready", 30, || {
            let v = self.get("/v1/nodes");
            let ready = v
                .as_array()?
                .iter()
                .filter(|x| x["ready"] == Value::Bool(true))
                .count();
            (ready >= n).then_some(())
        });
    }

    pub fn get(&self, path: &str) -> Value {
        match ureq::get(&format!("{}{path}", self.addr))
            .set("Authorization", &format!("Bearer {ADMIN}"))
            .call()
        {
            Ok(r) => r.into_json().expect("json"),
            Err(e) => panic!("GET {path}: {e}"),
        }
    }

    pub fn submit(&self, spec: &Value) -> u64 {
        let r = ureq::post(&format!("{}/v1/jobs", self.addr))
            .set("Authorization", &format!("Bearer {ADMIN}"))
            .send_json(spec.clone());
        match r {
            Ok(r) => r.into_json::<Value>().expect("json")["id"]
                .as_u64()
                .expect("id"),
            Err(ureq::Error::Status(c, r)) => {
                panic!("submit: {c} {}", r.into_string().unwrap_or_default())
            }
            Err(e) => panic!("submit: {e}"),
        }
    }

    pub fn post(&self, path: &str) -> Value {
        match ureq::post(&format!("{}{path}", self.addr))
            .set("Authorization", &format!("Bearer {ADMIN}"))
            .call()
        {
            Ok(r) => r.into_json().expect("json"),
            Err(e) => panic!("POST {path}: {e}"),
        }
    }

    pub fn node(&self, name: &str) -> Value {
        self.get("/v1/nodes")
            .as_array()
            .and_then(|v| v.iter().find(|n| n["name"] == name).cloned())
            .unwrap_or(Value::Null)
    }

    pub fn job(&self, id: u64) -> Value {
        self.get(&format!("/v1/jobs/{id}"))
    }

    /// Waits until the job satisfies `f`; the job's JSON on failure.
    pub fn wait_job(&self, id: u64, what: &str, secs: u64, f: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let j = self.job(id);
            if f(&j) {
                return j;
            }
            if Instant::now() > deadline {
                self.dump();
                panic!("job {id}: {what} within {secs}s; job is {j:#}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Prints the server's and agents' logs (on failure).
    pub fn dump(&self) {
        for e in std::fs::read_dir(self.dir.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "log") {
                eprintln!(
                    "==== {}\n{}",
                    p.display(),
                    std::fs::read_to_string(&p).unwrap_or_default()
                );
            }
        }
    }

    /// A server on loopback with `config` (see [`server_config`]) and one
    /// agent, `node` with `gpus` declared GPUs and `agent_extra` flags,
    /// waited for until Ready: the set-up most single-node cases share.
    pub fn one_node(config: &str, node: &str, gpus: u32, agent_extra: &[&str]) -> Cluster {
        let mut c = Self::start_with("127.0.0.1", config);
        c.agent(node, gpus, &[], agent_extra);
        c.wait_nodes(1);
        c
    }

    /// Waits until the job has ended (succeeded, failed, cancelled or
    /// timed out); its JSON.
    pub fn wait_end(&self, id: u64, what: &str, secs: u64) -> Value {
        self.wait_job(id, what, secs, |j| {
            matches!(state(j), "succeeded" | "failed" | "cancelled" | "timeout")
        })
    }

    /// The path of rank 0's log of a job's attempt on `node`, in the
    /// agent's state directory.
    pub fn rank_log_path(&self, node: &str, id: u64, attempt: u32) -> PathBuf {
        self.dir
            .path()
            .join(format!("{node}/logs/job-{id}/attempt-{attempt}/rank-0.log"))
    }

    /// Rank 0's log of a job's attempt on `node` (empty when there is none).
    pub fn rank_log(&self, node: &str, id: u64, attempt: u32) -> String {
        std::fs::read_to_string(self.rank_log_path(node, id, attempt)).unwrap_or_default()
    }

    /// `gangway ARGS` against the cluster as admin, with no client config
    /// file: (success, stdout, stderr).
    pub fn gangway(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(BIN)
            .args(args)
            .env("GANGWAY_ADDR", &self.addr)
            .env("GANGWAY_TOKEN", ADMIN)
            .env_remove("GANGWAY_CONFIG")
            .output()
            .expect("gangway");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    }

    /// A job spec running the test rank script.
    pub fn rank_job(&self, name: &str, replicas: u32, gpus: u32) -> Value {
        serde_json::json!({
            "name": name,
            "queue": "default",
            "replicas": replicas,
            "resources": { "gpus": gpus },
            "restart": { "max_restarts": 3, "backoff_seconds": 0 },
            "checkpoint": { "grace_seconds": 10 },
            "run": {
                "command": ["sh", self.script.display().to_string()],
                "env": { "OUT": self.out.display().to_string() }
            }
        })
    }

    /// Environments recorded by the ranks of one attempt, by rank.
    pub fn envs(&self, attempt: u32) -> BTreeMap<u32, BTreeMap<String, String>> {
        read_envs(&self.out, attempt)
    }
}

pub fn read_envs(out: &Path, attempt: u32) -> BTreeMap<u32, BTreeMap<String, String>> {
    let mut m = BTreeMap::new();
    for e in std::fs::read_dir(out).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(rest) = name.strip_prefix(&format!("env-{attempt}-")) else {
            continue;
        };
        let Ok(rank) = rest.parse::<u32>() else {
            continue;
        };
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        let env = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        m.insert(rank, env);
    }
    m
}

/// Checks a gang's recorded environments: ranks 0..world, one WORLD_SIZE and
/// rendezvous, per node distinct local ranks and disjoint GPUs.
pub fn check_gang_env(
    envs: &BTreeMap<u32, BTreeMap<String, String>>,
    world: u32,
    nodes: usize,
    gpus_per_rank: usize,
) {
    assert_eq!(
        envs.keys().copied().collect::<Vec<_>>(),
        (0..world).collect::<Vec<_>>(),
        "every rank ran once"
    );
    let one = |k: &str| {
        let vals: std::collections::BTreeSet<&String> = envs.values().map(|e| &e[k]).collect();
        assert_eq!(vals.len(), 1, "{k} differs between ranks: {vals:?}");
        vals.into_iter().next().cloned().unwrap_or_default()
    };
    assert_eq!(one("WORLD_SIZE"), world.to_string());
    one("MASTER_ADDR");
    one("MASTER_PORT");
    one("GANGWAY_CHECKPOINT_DIR");
    assert_eq!(one("NNODES"), nodes.to_string());
    let mut by_node: BTreeMap<String, Vec<&BTreeMap<String, String>>> = BTreeMap::new();
    for e in envs.values() {
        by_node
            .entry(e["GANGWAY_NODE"].clone())
            .or_default()
            .push(e);
    }
    assert_eq!(by_node.len(), nodes, "ranks spread over {nodes} nodes");
    let mut node_ranks = std::collections::BTreeSet::new();
    for (node, es) in &by_node {
        let nr: std::collections::BTreeSet<&String> = es.iter().map(|e| &e["NODE_RANK"]).collect();
        assert_eq!(nr.len(), 1, "one NODE_RANK on {node}");
        node_ranks.insert(nr.into_iter().next().cloned().unwrap_or_default());
        let mut local: Vec<u32> = es
            .iter()
            .map(|e| e["LOCAL_RANK"].parse().expect("LOCAL_RANK"))
            .collect();
        local.sort();
        assert_eq!(
            local,
            (0..es.len() as u32).collect::<Vec<_>>(),
            "local ranks on {node}"
        );
        let mut seen = std::collections::BTreeSet::new();
        for e in es {
            let devs: Vec<&str> = e["CUDA_VISIBLE_DEVICES"].split(',').collect();
            assert_eq!(
                devs.len(),
                gpus_per_rank,
                "rank {} GPUs {devs:?}",
                e["RANK"]
            );
            for d in devs {
                assert!(
                    seen.insert(d.to_string()),
                    "GPU {d} on {node} given to two ranks"
                );
            }
            assert_eq!(e["LOCAL_WORLD_SIZE"], es.len().to_string());
        }
    }
    let expect: std::collections::BTreeSet<String> = (0..nodes).map(|i| i.to_string()).collect();
    assert_eq!(node_ranks, expect, "NODE_RANKs are 0..{nodes}");
    // Rank 0's node is the rendezvous.
    let r0 = &envs[&0];
    assert_eq!(r0["NODE_RANK"], "0");
}

pub fn wait_for<T>(what: &str, secs: u64, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A one-rank, one-GPU job in the default queue that runs `sh -c script`
/// once (no restarts).
pub fn shell_job(name: &str, script: &str) -> Value {
    serde_json::json!({
        "name": name, "queue": "default", "replicas": 1,
        "resources": { "gpus": 1 },
        "restart": { "max_restarts": 0 },
        "run": { "command": ["sh", "-c", script] }
    })
}

/// Whether an event of the job's JSON says `needle` (of `kind` when given).
pub fn has_event(j: &Value, kind: Option<&str>, needle: &str) -> bool {
    events(j)
        .iter()
        .any(|(k, m)| kind.is_none_or(|want| k == want) && m.contains(needle))
}

/// The message of the job's first event of `kind` (empty when none).
pub fn first_event(j: &Value, kind: &str) -> String {
    events(j)
        .into_iter()
        .find(|(k, _)| k == kind)
        .map(|(_, m)| m)
        .unwrap_or_default()
}

/// Whether the tests run as root; without root the caller skips (true is
/// returned), or fails when GANGWAY_REQUIRE_ROOT is set. `why` says what
/// root is needed for.
pub fn skip_unless_root(why: &str) -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !root {
        skip_or_fail("GANGWAY_REQUIRE_ROOT", why);
    }
    !root
}

pub fn events(j: &Value) -> Vec<(String, String)> {
    j["events"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            (
                e["kind"].as_str().unwrap_or("").to_string(),
                e["message"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

pub fn state(j: &Value) -> &str {
    j["state"].as_str().unwrap_or("")
}

/// Builds a registry-free image from Debian's static busybox: `docker import`
/// of a root filesystem with /bin/busybox and its applets as links.
pub fn busybox_image() -> Result<(), String> {
    let ok = |c: &mut Command| {
        c.stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !ok(Command::new("docker").arg("version")) {
        return Err("docker is not reachable".into());
    }
    if ok(Command::new("docker").args(["image", "inspect", IMAGE])) {
        return Ok(());
    }
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .ok_or("no static busybox (apt-get install busybox-static)")?;
    let root = tempfile::tempdir().map_err(|e| e.to_string())?;
    let bin = root.path().join("bin");
    std::fs::create_dir_all(&bin).map_err(|e| e.to_string())?;
    std::fs::copy(busybox, bin.join("busybox")).map_err(|e| e.to_string())?;
    for applet in [
        "sh", "env", "cat", "echo", "sleep", "mv", "touch", "ls", "nc", "id", "true",
    ] {
        std::os::unix::fs::symlink("busybox", bin.join(applet)).map_err(|e| e.to_string())?;
    }
    for d in ["tmp", "proc", "sys", "dev", "etc"] {
        std::fs::create_dir_all(root.path().join(d)).map_err(|e| e.to_string())?;
    }
    let cmd = format!(
        "tar -C {} -c . | docker import - {IMAGE}",
        root.path().display()
    );
    if ok(Command::new("sh").args(["-c", &cmd])) {
        Ok(())
    } else {
        Err("docker import of the busybox rootfs failed".into())
    }
}

#[allow(unused_imports)]
pub use gangway_store::testing::{required, skip_or_fail};

/// A queue's `node:` lines letting its ranks mount the temp dir read-write
/// (tests' output directories live there; named by its real path, as the
/// agent resolves symlinks); `extra` adds lines before it.
pub fn tmp_mounts(extra: &str) -> String {
    let tmp = std::fs::canonicalize(std::env::temp_dir()).expect("temp dir");
    format!(
        "    node:\n{extra}      mounts: {{ allowed: [{0}], read_write: [{0}] }}\n",
        tmp.display()
    )
}

/// A Unix account made for one test and removed when dropped.
pub struct Account {
    pub name: String,
    pub uid: u32,
}

impl Account {
    /// `gw<pid><tag>`, with a group of its own and no home directory.
    pub fn create(tag: &str) -> Account {
        let name = format!("gw{}{tag}", std::process::id());
        // Other tests (and worktrees) add accounts at the same time: retry the lock.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = Command::new("useradd")
                .args(["-M", "-U", "-s", "/bin/sh", &name])
                .output()
                .expect("useradd");
            let exists = String::from_utf8_lossy(&out.stderr).contains("already exists");
            if out.status.success() || exists {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "useradd {name}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        let uid = Command::new("id")
            .args(["-u", &name])
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .expect("uid of the new account");
        Account { name, uid }
    }
}

impl Drop for Account {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let ok = Command::new("userdel")
                .arg(&self.name)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok
                || Command::new("id")
                    .arg(&self.name)
                    .output()
                    .is_ok_and(|o| !o.status.success())
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Submits `spec` as the holder of `token`: the job id, or the status and
/// the server's message.
pub fn try_submit_as(c: &Cluster, token: &str, spec: &Value) -> Result<u64, (u16, String)> {
    match ureq::post(&format!("{}/v1/jobs", c.addr))
        .set("Authorization", &format!("Bearer {token}"))
        .send_json(spec.clone())
    {
        Ok(r) => Ok(r.into_json::<Value>().expect("json")["id"]
            .as_u64()
            .expect("id")),
        Err(ureq::Error::Status(code, r)) => Err((code, r.into_string().unwrap_or_default())),
        Err(e) => panic!("submit: {e}"),
    }
}

/// Submits `spec` as the holder of `token`, which must be accepted: the job id.
pub fn submit_as(c: &Cluster, token: &str, spec: &Value) -> u64 {
    try_submit_as(c, token, spec).unwrap_or_else(|(code, msg)| panic!("submit: {code} {msg}"))
}
