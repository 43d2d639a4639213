//! Recorded GPU servers (`examples/machines/`) through `gangway up
//! --machine`: what users ask for matches what NVML would report, ranks get
//! exactly their devices and neighbourhood, health follows NVIDIA's XID
//! classes, and a GPU lost mid-job sends its gang elsewhere.

mod common;

use common::{free_port, wait_for};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gangway");

fn machine(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/machines")
        .join(name)
}

/// A `gangway up` process, stopped with SIGTERM, then killed if it lingers.
struct Up {
    child: Child,
    cfg: PathBuf,
    dir: tempfile::TempDir,
}

impl Drop for Up {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `gangway up --machine FILE --nodes N`, waiting for every node.
fn up(machine: &Path, nodes: u32) -> Up {
    up_with(machine, nodes, tempfile::tempdir().expect("tmp"), &[])
}

/// [`up`] in `dir`, with more of `up`'s flags.
fn up_with(machine: &Path, nodes: u32, dir: tempfile::TempDir, extra: &[&str]) -> Up {
    let data = dir.path().join("up");
    let child = Command::new(BIN)
        .args(["up", "--no-tls", "--sync-ms", "100"])
        // The host's own disk may be nearly full (see tests/availability.rs).
        .args(["--disk-pressure-percent", "0"])
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--nodes", &nodes.to_string()])
        .arg("--machine")
        .arg(machine)
        .arg("--data-dir")
        .arg(&data)
        .args(extra)
        .current_dir("/")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("gangway up");
    let cfg = data.join("cli.yaml");
    let u = Up { child, cfg, dir };
    wait_for("up's CLI config", 60, || u.cfg.exists().then_some(()));
    wait_for("the nodes", 60, || {
        let v = u.json(&["nodes"])?;
        (v.as_array()?.len() == nodes as usize).then_some(())
    });
    u
}

impl Up {
    fn cli(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .args(args)
            .env("GANGWAY_CONFIG", &self.cfg)
            .env_remove("GANGWAY_ADDR")
            .env_remove("GANGWAY_TOKEN")
            .current_dir("/")
            .output()
            .expect("cli")
    }

    fn json(&self, args: &[&str]) -> Option<Value> {
        let mut a = args.to_vec();
        a.extend(["-o", "json"]);
        serde_json::from_slice(&self.cli(&a).stdout).ok()
    }

    /// Submits a job file with `resources` and `command`; the id, or the refusal.
    fn submit(&self, name: &str, resources: &str, command: &str) -> Result<u64, String> {
        let p = self.dir.path().join(format!("{name}.yaml"));
        std::fs::write(
            &p,
            format!(
                "name: {name}\nqueue: default\nreplicas: 1\nresources: {{ {resources} }}\nrestart: {{ max_restarts: 2, backoff_seconds: 1 }}\nrun: {{ command: [sh, -c, {command:?}] }}\n"
            ),
        )
        .expect("job file");
        let o = self.cli(&["submit", "-o", "json", p.to_str().expect("path")]);
        if !o.status.success() {
            return Err(String::from_utf8_lossy(&o.stderr).to_string());
        }
        let v: Value = serde_json::from_slice(&o.stdout).map_err(|e| e.to_string())?;
        v["id"].as_u64().ok_or_else(|| format!("no id in {v}"))
    }

    fn job(&self, id: u64) -> Value {
        self.json(&["describe", &id.to_string()])
            .unwrap_or(Value::Null)
    }

    fn wait_state(&self, id: u64, state: &str, secs: u64) -> Value {
        wait_for(&format!("job {id} {state}"), secs, || {
            let j = self.job(id);
            let s = j["state"].as_str().or_else(|| j["job"]["state"].as_str())?;
            (s == state).then_some(j)
        })
    }

    fn log(&self, id: u64) -> String {
        String::from_utf8_lossy(&self.cli(&["logs", &id.to_string()]).stdout).to_string()
    }
}

/// A job's placement: (node, GPUs) per replica.
fn placement(j: &Value) -> Vec<(String, Vec<u64>)> {
    let p = if j["placement"].is_array() {
        &j["placement"]
    } else {
        &j["job"]["placement"]
    };
    p.as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            (
                r["node"].as_str().unwrap_or("").to_string(),
                r["gpus"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_u64)
                    .collect(),
            )
        })
        .collect()
}

/// A shipped machine with scripted events appended.
fn with_events(dir: &Path, base: &str, events: &str) -> PathBuf {
    let text = std::fs::read_to_string(machine(base)).expect("machine");
    let p = dir.join(format!("events-{base}"));
    std::fs::write(&p, format!("{text}events:\n{events}")).expect("write");
    p
}

const ENV_CMD: &str = "env | grep -E '^(CUDA_|NCCL_IB_HCA|GANGWAY_CPUS|GANGWAY_NUMA)' | sort";

#[test]
fn dgx_h100_runs_h100_80gb_eight_gpus_with_exactly_its_devices() {
    let u = up(&machine("dgx-h100.yaml"), 1);
    // What `nodes` shows: the full NVML name and the exact memory.
    let table = String::from_utf8_lossy(&u.cli(&["nodes"]).stdout).to_string();
    assert!(
        table.contains("GPUs: NVIDIA H100 80GB HBM3 81559 MiB"),
        "{table}"
    );
    let nodes = u.json(&["nodes"]).expect("nodes json");
    let g = &nodes[0]["gpus"];
    assert_eq!(g.as_array().map(Vec::len), Some(8));
    assert_eq!(g[0]["model"], "NVIDIA H100 80GB HBM3");
    assert_eq!(g[0]["memory_mib"], 81559);
    assert_eq!(g[3]["uuid"], "GPU-h100-0000-4000-8000-000000000003");

    let id = u
        .submit(
            "h100x8",
            "gpus: 8, gpu_model: H100, min_gpu_memory_gib: 80",
            ENV_CMD,
        )
        .expect("an 80 GB H100 job is accepted");
    u.wait_state(id, "succeeded", 90);
    let log = u.log(id);
    assert!(log.contains("CUDA_DEVICE_ORDER=PCI_BUS_ID"), "{log}");
    let uuids: Vec<String> = (0..8)
        .map(|i| format!("GPU-h100-0000-4000-8000-{i:012x}"))
        .collect();
    assert!(
        log.contains(&format!("CUDA_VISIBLE_DEVICES={}", uuids.join(","))),
        "{log}"
    );
    // Every GPU's own HCA, exactly (the `=` prefix).
    assert!(
        log.contains("NCCL_IB_HCA==mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11"),
        "{log}"
    );
    // The recorded machine's CPUs are not this host's: no pinning.
    assert!(!log.contains("GANGWAY_CPUS="), "{log}");

    // Narrower names fit, other families and sizes are refused by name.
    for ok in ["H100-SXM", "nvidia h100 80gb hbm3", "H100-80GB"] {
        u.submit("narrow", &format!("gpus: 1, gpu_model: {ok:?}"), "true")
            .unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
    let e = u
        .submit("pcie", "gpus: 1, gpu_model: H100-PCIe", "true")
        .expect_err("no PCIe H100 here");
    assert!(
        e.contains("no node has H100-PCIe GPUs (cluster has: NVIDIA H100 80GB HBM3)"),
        "{e}"
    );
    let e = u
        .submit("big", "gpus: 1, min_gpu_memory_gib: 94", "true")
        .expect_err("no 94 GB card here");
    assert!(e.contains("largest matching GPU has 81559 MiB"), "{e}");
}

#[test]
fn hgx_a100_runs_a_job_asking_for_a100() {
    let u = up(&machine("hgx-a100-80gb.yaml"), 1);
    let id = u
        .submit(
            "a100",
            "gpus: 2, gpu_model: A100, min_gpu_memory_gib: 80",
            ENV_CMD,
        )
        .expect("A100 matches NVIDIA A100-SXM4-80GB");
    u.wait_state(id, "succeeded", 90);
    let log = u.log(id);
    assert!(log.contains("CUDA_DEVICE_ORDER=PCI_BUS_ID"), "{log}");
    // GPUs 0 and 1 share NUMA node 3 and HCAs mlx5_0 and mlx5_1.
    assert!(log.contains("NCCL_IB_HCA==mlx5_0,mlx5_1"), "{log}");
    let e = u
        .submit("v100", "gpus: 1, gpu_model: V100", "true")
        .expect_err("no V100");
    assert!(e.contains("cluster has: NVIDIA A100-SXM4-80GB"), "{e}");
    assert!(u.submit("a10", "gpus: 1, gpu_model: A10", "true").is_err());
}

#[test]
fn pairs_machine_gives_a_two_gpu_job_the_other_bridged_pair() {
    let u = up(&machine("a100-pcie-nvlink-pairs.yaml"), 1);
    let one = u
        .submit("one", "gpus: 1, gpu_model: A100-80GB", "sleep 300")
        .expect("submit");
    let j = u.wait_state(one, "running", 60);
    assert_eq!(placement(&j), vec![("node-0".to_string(), vec![0])]);
    let two = u
        .submit("two", "gpus: 2, gpu_model: A100 PCIe", ENV_CMD)
        .expect("submit");
    let j = u.wait_state(two, "succeeded", 90);
    assert_eq!(
        placement(&j),
        vec![("node-0".to_string(), vec![2, 3])],
        "GPUs 2 and 3 share a bridge; 1 and 2 do not"
    );
    let log = u.log(two);
    assert!(
        log.contains(
            "CUDA_VISIBLE_DEVICES=GPU-a1pc-0000-4000-8000-000000000002,GPU-a1pc-0000-4000-8000-000000000003"
        ),
        "{log}"
    );
    assert!(log.contains("NCCL_IB_HCA==mlx5_1"), "NUMA 1's HCA: {log}");
}

#[test]
fn application_xids_leave_gpus_healthy_and_the_others_do_not() {
    let dir = tempfile::tempdir().expect("tmp");
    let m = with_events(
        dir.path(),
        "hgx-a100-80gb.yaml",
        // After discovery: a GPU lost before it would not be registered at all.
        "  - { at_seconds: 2, gpu: 0, xid: 13 }
  - { at_seconds: 2, gpu: 0, xid: 31 }
  - { at_seconds: 2, gpu: 0, xid: 43 }
  - { at_seconds: 2, gpu: 0, xid: 45 }
  - { at_seconds: 2, gpu: 0, xid: 68 }
  - { at_seconds: 2, gpu: 1, xid: 79 }
  - { at_seconds: 2, gpu: 2, lost: true }
  - { at_seconds: 2, gpu: 3, ecc_uncorrected: 2 }
  - { at_seconds: 2, gpu: 4, remap_failed: true }
  - { at_seconds: 2.5, gpu: 6, xid: 48 }
",
    );
    // GPU 5 refuses event registration: the others stay watched (GPU 6's XID 48 is seen).
    let text = std::fs::read_to_string(&m).expect("read");
    let text = text.replacen(
        "uuid: GPU-a100-0000-4000-8000-000000000005\n",
        "uuid: GPU-a100-0000-4000-8000-000000000005\n    watch_fails: true\n",
        1,
    );
    std::fs::write(&m, text).expect("write");
    let u = up(&m, 1);
    let gpus = wait_for("the scripted faults on the server", 60, || {
        let v = u.json(&["nodes"])?;
        let g = v[0]["gpus"].as_array()?.clone();
        (g.iter().filter(|x| x["healthy"] == false).count() == 5).then_some(g)
    });
    let reason = |i: usize| gpus[i]["reason"].as_str().unwrap_or("").to_string();
    assert_eq!(gpus[0]["healthy"], true, "application XIDs: {}", reason(0));
    assert_eq!(reason(1), "XID 79: GPU has fallen off the bus");
    assert!(reason(2).starts_with("GPU lost"), "{}", reason(2));
    assert_eq!(reason(3), "2 uncorrected ECC errors");
    assert!(
        reason(4).starts_with("row remapping failed"),
        "{}",
        reason(4)
    );
    assert_eq!(gpus[5]["healthy"], true);
    assert_eq!(reason(6), "XID 48: double-bit ECC error");
    assert_eq!(gpus[7]["healthy"], true);
    let table = String::from_utf8_lossy(&u.cli(&["nodes"]).stdout).to_string();
    assert!(
        table.contains("GPU 1 unhealthy: XID 79: GPU has fallen off the bus"),
        "{table}"
    );
    // Healthy GPUs still run work; an 8-GPU job no longer fits this node.
    let id = u.submit("three", "gpus: 3", "true").expect("submit");
    let j = u.wait_state(id, "succeeded", 60);
    assert_eq!(placement(&j)[0].1, vec![0, 5, 7]);
}

#[test]
fn a_gpu_lost_mid_job_stops_its_gang_and_it_restarts_elsewhere() {
    let dir = tempfile::tempdir().expect("tmp");
    // On every node GPU 0 falls off the bus 20 s after its agent starts.
    let m = with_events(
        dir.path(),
        "a100-pcie-nvlink-pairs.yaml",
        "  - { at_seconds: 20, gpu: 0, lost: true }\n",
    );
    let u = up(&m, 1);
    let id = u.submit("victim", "gpus: 1", "sleep 600").expect("submit");
    let j = u.wait_state(id, "running", 15);
    assert_eq!(
        placement(&j)[0].1,
        vec![0],
        "the first GPU of the first pair"
    );
    // The gang is stopped with the reason; it leaves GPU 0.
    let j = wait_for("the gang stopped off GPU 0", 90, || {
        let j = u.job(id);
        let off = placement(&j).first().is_none_or(|r| r.1 != vec![0]);
        (off && j
            .to_string()
            .contains("GPU 0 on node node-0 unhealthy: GPU lost"))
        .then_some(j)
    });
    let text = j.to_string();
    assert!(text.contains("GPU lost"), "the job says why: {text}");
    // Unless node blame cordoned the node for the fault, it restarts on another GPU.
    let cordoned = u.json(&["nodes"]).is_some_and(|v| v[0]["cordoned"] == true);
    if !cordoned {
        wait_for("the gang restarted on another GPU", 90, || {
            let j = u.job(id);
            let p = placement(&j);
            let state = j["state"].as_str().or_else(|| j["job"]["state"].as_str())?;
            (state == "running" && p.first().is_some_and(|r| r.1 != vec![0])).then_some(())
        });
    }
    let nodes = u.json(&["nodes"]).expect("nodes");
    assert_eq!(nodes[0]["gpus"][0]["healthy"], false);
    assert!(nodes[0]["gpus"][0]["reason"]
        .as_str()
        .is_some_and(|r| r.starts_with("GPU lost")));
}

#[test]
fn mig_gpus_are_refused_as_whole_gpus_with_the_reason() {
    let u = up(&machine("a100-mig.yaml"), 1);
    let e = u
        .submit("whole", "gpus: 1, gpu_model: A100", "true")
        .expect_err("MIG GPUs are not whole GPUs");
    assert!(e.contains("has MIG enabled"), "{e}");
    let table = String::from_utf8_lossy(&u.cli(&["nodes"]).stdout).to_string();
    assert!(
        table.contains("MIG enabled (never assigned whole): GPUs 0,1,2,3,4,5,6,7"),
        "{table}"
    );
    // A CPU-only job still runs on the node.
    let id = u
        .submit("cpu", "gpus: 0, cpu_millis: 1000", "true")
        .expect("submit");
    u.wait_state(id, "succeeded", 60);
}

#[test]
fn a_rank_is_pinned_to_its_gpus_numa_node_when_its_cpus_fit() {
    let host = std::thread::available_parallelism().map_or(1, |n| n.get());
    if host < 2 {
        println!("skipped: needs 2 CPUs to tell NUMA nodes apart");
        return;
    }
    let dir = tempfile::tempdir().expect("tmp");
    // Two NUMA nodes of one CPU each (this host's CPUs 0 and 1), a GPU on each.
    let m = dir.path().join("two-numa.yaml");
    std::fs::write(
        &m,
        "numa_nodes:
  - { id: 0, cpus: \"0\" }
  - { id: 1, cpus: \"1\" }
gpus:
  - { name: NVIDIA L4, uuid: GPU-l4-a, pci_bus_id: \"00000000:01:00.0\", memory_bytes: 24152899584, numa_node: 0 }
  - { name: NVIDIA L4, uuid: GPU-l4-b, pci_bus_id: \"00000000:81:00.0\", memory_bytes: 24152899584, numa_node: 1 }
",
    )
    .expect("write");
    let u = up(&m, 1);
    let hold = u.submit("hold", "gpus: 1", "sleep 300").expect("submit");
    u.wait_state(hold, "running", 60);
    let id = u
        .submit(
            "pinned",
            "gpus: 1, cpu_millis: 1000",
            "grep Cpus_allowed_list /proc/self/status; env | grep GANGWAY_CPUS",
        )
        .expect("submit");
    u.wait_state(id, "succeeded", 60);
    let log = u.log(id);
    assert!(log.contains("GANGWAY_CPUS=1"), "{log}");
    assert!(
        log.lines().any(|l| l.starts_with("Cpus_allowed_list:")
            && l.trim_end().ends_with('1')
            && !l.contains(',')
            && !l.contains('-')),
        "pinned to CPU 1 only: {log}"
    );
    // Two CPUs do not fit one NUMA node of one CPU: no pinning.
    let _ = u.cli(&["cancel", &hold.to_string()]);
    let id = u
        .submit("wide", "gpus: 1, cpu_millis: 2000", ENV_CMD)
        .expect("submit");
    u.wait_state(id, "succeeded", 60);
    let log = u.log(id);
    assert!(!log.contains("GANGWAY_CPUS="), "{log}");
    assert!(log.contains("CUDA_DEVICE_ORDER=PCI_BUS_ID"), "{log}");
}

#[test]
fn agent_check_prints_what_a_rank_would_get() {
    let o = Command::new(BIN)
        .args(["agent", "--check", "--state-dir"])
        .arg(tempfile::tempdir().expect("tmp").path())
        .arg("--machine")
        .arg(machine("a100-pcie-nvlink-pairs.yaml"))
        .env_remove("GANGWAY_JOIN_TOKEN")
        .output()
        .expect("agent --check");
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for want in [
        "NVIDIA A100 80GB PCIe",
        "81920 MiB",
        "island 0: GPUs 0-1 (NVLink)",
        "island 2: GPUs 2-3 (NVLink)",
        "node 1: CPUs 32-63,96-127 (64), GPUs 2-3, NICs mlx5_1",
        "2 GPU(s): GPUs 0-1 (one NVLink island)",
        "4 GPU(s): GPUs 0-3 (across islands, over PCIe)",
        "8 GPU(s): cannot run here (4 assignable GPUs)",
    ] {
        assert!(out.contains(want), "{want:?} in:\n{out}");
    }
    let o = Command::new(BIN)
        .args(["agent", "--check", "--machine"])
        .arg(machine("a100-mig.yaml"))
        .output()
        .expect("agent --check");
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        out.contains("GPU 0 has MIG enabled (instances: 1g.5gb"),
        "{out}"
    );
}

#[test]
fn a_node_cordoned_for_a_lost_gpu_returns_to_service_when_its_health_check_passes() {
    let dir = tempfile::tempdir().expect("tmp");
    // GPU 0 falls off the bus 12 s after the agent starts, under a job.
    let m = with_events(
        dir.path(),
        "dgx-h100.yaml",
        "  - { at_seconds: 12, gpu: 0, lost: true }\n",
    );
    let cfg = dir.path().join("server.yaml");
    std::fs::write(
        &cfg,
        "admin_token: probation-admin\nagent_token: probation-join\nprobation_after_seconds: 1\nqueues:\n  - name: default\n",
    )
    .expect("config");
    let seen = dir.path().join("check-env");
    let check = format!("env > {}; echo GPUs fine", seen.display());
    let cfg_arg = cfg.display().to_string();
    let u = up_with(
        &m,
        1,
        dir,
        &["--config", &cfg_arg, "--health-check", &check],
    );
    let id = u.submit("victim", "gpus: 1", "sleep 600").expect("submit");
    let j = u.wait_state(id, "running", 15);
    assert_eq!(placement(&j)[0].1, vec![0]);
    // Blamed for the lost GPU, cordoned, checked, and back in service: the
    // job restarts on another of its GPUs.
    let audit = wait_for("back in service", 90, || {
        let a = String::from_utf8_lossy(&u.cli(&["audit"]).stdout).to_string();
        a.contains("returned to service after passing its health check: GPUs fine")
            .then_some(a)
    });
    assert!(audit.contains("auto-cordon: causes: GPU 0 lost"), "{audit}");
    let nodes = u.json(&["nodes"]).expect("nodes");
    assert_eq!(nodes[0]["cordoned"], false, "{nodes}");
    assert_eq!(nodes[0]["gpus"][0]["healthy"], false, "GPU 0 stays out");
    wait_for("the job on another GPU", 60, || {
        let j = u.job(id);
        let state = j["state"].as_str().or_else(|| j["job"]["state"].as_str())?;
        (state == "running" && placement(&j).first().is_some_and(|r| r.1 != vec![0])).then_some(())
    });
    // The check had every GPU of the node, by UUID, in PCI bus order.
    let env = std::fs::read_to_string(&seen).expect("the check ran");
    let uuids: Vec<String> = (0..8)
        .map(|i| format!("GPU-h100-0000-4000-8000-00000000000{i}"))
        .collect();
    let want = format!("CUDA_VISIBLE_DEVICES={}", uuids.join(","));
    assert!(env.lines().any(|l| l == want), "{env}");
    assert!(
        env.lines().any(|l| l == "CUDA_DEVICE_ORDER=PCI_BUS_ID"),
        "{env}"
    );
}
