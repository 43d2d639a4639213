//! One user's careless job never takes the node from the others: per-rank
//! limits on by default (processes, memory), with a real server, agents and
//! rank processes. Tests that need a cgroup controller skip (and say so)
//! where the host has none, unless `GANGWAY_REQUIRE_CGROUP` is set.

mod common;

use common::*;
use serde_json::json;

/// Whether this host has a cgroup hierarchy with `controller` the agent can use.
fn cgroup_controller(controller: &str) -> bool {
    std::path::Path::new(&format!("/sys/fs/cgroup/{controller}/cgroup.procs")).exists()
        || std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
            .is_ok_and(|c| c.split_whitespace().any(|x| x == controller))
}

/// One fork flood at a time: under the subreaper the limit is the Unix
/// account's (`RLIMIT_NPROC`), which every test's ranks share.
static FLOODS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs a fork flood (200 children, each noting itself in `$OUT/forks`) in
/// a queue limited to 64 processes per rank, beside a neighbour's job (which
/// must succeed when `neighbour_must_run`); returns how many children the
/// flood got.
fn fork_flood(agent_extra: &[&str], neighbour_must_run: bool) -> usize {
    let _one = FLOODS.lock().unwrap_or_else(|e| e.into_inner());
    let c = Cluster::one_node(
        &server_config("    node:\n      limits:\n        pids: 64\n"),
        "node-a",
        2,
        agent_extra,
    );
    let forks = c.out.join("forks");
    let flood = c.submit(&shell_job(
        "flood",
        &format!(
            "for i in $(seq 200); do (echo x >> {f}; exec sleep 3) & done 2>/dev/null; wait",
            f = forks.display()
        ),
    ));
    let mut neighbour = c.rank_job("neighbour", 1, 1);
    neighbour["run"]["env"]["STEPS"] = json!("2");
    let neighbour = c.submit(&neighbour);
    c.wait_end(flood, "end", 60);
    if neighbour_must_run {
        c.wait_job(neighbour, "succeed beside the flood", 60, |j| {
            state(j) == "succeeded"
        });
    }
    std::fs::read_to_string(&forks)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

#[test]
fn a_fork_flood_stops_at_the_pids_limit_while_a_neighbour_runs() {
    if !cgroup_controller("pids") {
        return skip_or_fail("GANGWAY_REQUIRE_CGROUP", "no pids cgroup controller here");
    }
    let got = fork_flood(&[], true);
    eprintln!("fork flood under the cgroup pids limit (64): {got} children");
    assert!(got < 64, "{got} children under a limit of 64");
    assert!(got >= 10, "the flood ran ({got} children)");
}

#[test]
fn a_fork_flood_under_the_subreaper_stops_at_its_rlimit() {
    // The neighbour runs as the same account here, so shares the rlimit.
    let got = fork_flood(&["--proctrack", "subreaper"], false);
    eprintln!("fork flood under RLIMIT_NPROC (64): {got} children");
    assert!(got < 64, "{got} children under a limit of 64");
}

#[test]
fn a_memory_hog_without_a_request_is_oom_killed_at_its_gpu_share() {
    if !cgroup_controller("memory") {
        return skip_or_fail("GANGWAY_REQUIRE_CGROUP", "no memory cgroup controller here");
    }
    // 512 MiB over 2 GPUs: a one-GPU rank's default share is 256 MiB.
    let c = Cluster::one_node(&server_config(""), "node-a", 2, &["--memory-mib", "512"]);
    let id = c.submit(&shell_job(
        "hog",
        "head -c 600000000 /dev/zero | tail > /dev/null",
    ));
    let j = c.wait_end(id, "fail", 60);
    assert_eq!(state(&j), "failed", "{j:#}");
    assert!(
        has_event(
            &j,
            Some("failed"),
            "memory limit 256 MiB reached (OOM-killed)"
        ),
        "{:?}",
        events(&j)
    );
    assert_eq!(
        c.node("node-a")["cordoned"],
        false,
        "the job's fault, not the node's"
    );
}

#[test]
fn a_log_flood_leaves_at_most_the_cap_on_disk_and_logs_say_what_was_dropped() {
    // 64 KiB x 3 files per rank for this queue.
    let c = Cluster::one_node(
        &server_config(
            "    node:\n      limits:\n        log_max_bytes: 65536\n        log_max_files: 3\n",
        ),
        "node-a",
        2,
        &[],
    );
    // About 20 MiB of output, then a last line.
    let id = c.submit(&shell_job(
        "flood",
        "head -c 20000000 /dev/zero | tr '\\0' x | fold -w 99; echo; echo the end",
    ));
    c.wait_job(id, "succeed", 120, |j| state(j) == "succeeded");
    let log = c.rank_log_path("node-a", id, 0);
    let on_disk: u64 = (0..10)
        .map(|n| {
            let p = if n == 0 {
                log.clone()
            } else {
                std::path::PathBuf::from(format!("{}.{n}", log.display()))
            };
            std::fs::metadata(p).map_or(0, |m| m.len())
        })
        .sum();
    eprintln!("log flood: 20,000,000+ bytes written, {on_disk} bytes on disk (cap 196,608)");
    assert!(on_disk <= 3 * 65536, "{on_disk} bytes on disk");
    assert!(on_disk > 65536, "rotated files kept ({on_disk} bytes)");
    let (ok, text, err) = c.gangway(&["logs", &id.to_string()]);
    assert!(ok, "{err}");
    assert!(
        text.ends_with("the end\n"),
        "{}",
        &text[text.len().saturating_sub(200)..]
    );
    assert!(err.contains("dropped by log rotation"), "{err}");
}

#[test]
fn a_job_over_its_checkpoint_quota_is_stopped_naming_it() {
    let c = Cluster::one_node(
        &server_config("    node:\n      limits:\n        checkpoint_quota_bytes: 1048576\n"),
        "node-a",
        2,
        &[],
    );
    let id = c.submit(&shell_job(
        "filler",
        "for i in 1 2 3 4 5; do head -c 1000000 /dev/zero > $GANGWAY_CHECKPOINT_DIR/part-$i; sleep 1; done; sleep 30",
    ));
    let j = c.wait_end(id, "stopped", 60);
    assert_eq!(state(&j), "failed", "{j:#}");
    assert!(
        has_event(&j, None, "checkpoint quota 1 MiB exceeded"),
        "{:?}",
        events(&j)
    );
}

/// A small tmpfs of our own, unmounted when dropped.
struct SmallFs(std::path::PathBuf);

impl SmallFs {
    fn mount(mib: u32) -> Option<SmallFs> {
        let dir = std::env::temp_dir().join(format!("gangway-avail-disk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let ok = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={mib}m,mode=0755"),
                "tmpfs",
            ])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        Some(SmallFs(dir))
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .args(["-l"])
            .arg(&self.0)
            .status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn a_job_filling_its_checkpoint_filesystem_is_stopped_and_the_node_shows_disk_pressure() {
    // The agent's state directory is on the host's disk: when that is
    // itself nearly full, its pressure would hide the tmpfs's.
    let host_free = std::process::Command::new("df")
        .args(["-P", "/tmp"])
        .output()
        .ok()
        .and_then(|o| {
            // Free as the agent counts it: available / size.
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
        .unwrap_or(100);
    if host_free < 6 {
        return skip_or_fail(
            "GANGWAY_REQUIRE_MOUNT",
            &format!("the host's disk has {host_free} % free, under the test's margin"),
        );
    }
    let Some(fs) = SmallFs::mount(16) else {
        return skip_or_fail(
            "GANGWAY_REQUIRE_MOUNT",
            "cannot mount a tmpfs here (not root?)",
        );
    };
    let root = fs.0.display().to_string();
    // Pressure below 3 % free: the tmpfs gets there, the host's disk (the
    // agent's state directory) should not.
    let c = Cluster::one_node(
        &server_config(""),
        "node-a",
        2,
        &["--checkpoint-root", &root, "--disk-pressure-percent", "3"],
    );
    let id = c.submit(&shell_job(
        "filler",
        "head -c 20000000 /dev/zero > $GANGWAY_CHECKPOINT_DIR/fill; sleep 60",
    ));
    let j = c.wait_end(id, "stopped", 60);
    assert_eq!(state(&j), "failed", "{j:#}");
    let ev = events(&j);
    assert!(
        has_event(
            &j,
            None,
            "stopped for the node's disk pressure, writing most"
        ),
        "{ev:?}"
    );
    let n = c.node("node-a");
    eprintln!("disk filler: {:?}; node: {}", ev.last(), n["cordon_reason"]);
    assert!(
        n["cordon_reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("DiskPressure: ")),
        "{n}"
    );
    assert_eq!(n["cordoned"], true, "no new work under pressure: {n}");
    // Space freed: the pressure and its cordon go.
    let _ = std::fs::remove_dir_all(fs.0.join("admin"));
    wait_for("pressure gone", 20, || {
        (c.node("node-a")["cordoned"] == false).then_some(())
    });
    drop(c);
}

/// A v1 freezer cgroup made inside a rank's own: a process frozen there is
/// not killed by SIGKILL until thawed. Thawed and removed on drop.
struct Frozen {
    dir: std::path::PathBuf,
    pid: i32,
}

impl Frozen {
    /// Moves `pid` into a new freezer cgroup under its own and freezes it.
    fn freeze(pid: i32) -> Frozen {
        let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroups");
        let own = cg
            .lines()
            .find_map(|l| {
                let mut it = l.splitn(3, ':');
                let (_, ctrl, path) = (it.next()?, it.next()?, it.next()?);
                ctrl.split(',')
                    .any(|c| c == "freezer")
                    .then(|| path.to_string())
            })
            .expect("the rank is in a freezer cgroup");
        let dir = std::path::Path::new("/sys/fs/cgroup/freezer")
            .join(own.trim_start_matches('/'))
            .join("stuck");
        std::fs::create_dir_all(&dir).expect("mkdir the freezer cgroup");
        let f = Frozen { dir, pid };
        std::fs::write(f.dir.join("cgroup.procs"), pid.to_string()).expect("move the rank");
        std::fs::write(f.dir.join("freezer.state"), "FROZEN").expect("freeze");
        wait_for("the rank frozen", 10, || {
            let s = std::fs::read_to_string(f.dir.join("freezer.state")).ok()?;
            (s.trim() == "FROZEN").then_some(())
        });
        f
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("freezer.state"), "THAWED");
        // The pending SIGKILL lands once thawed; then the cgroup is empty.
        for _ in 0..200 {
            if !alive(self.pid as u32) && std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// "Kill task failed" is the node's fault (Slurm drains for it): a rank
/// whose process cannot be killed (frozen in a v1 freezer cgroup) is given
/// up on after the agent's kill timeout, the cancelled job still ends, the
/// node is cordoned with the evidence and keeps reporting, and another node
/// is untouched and still runs work.
#[test]
fn an_unkillable_rank_is_a_node_fault_the_job_ends_and_only_its_node_is_cordoned() {
    if !std::path::Path::new("/sys/fs/cgroup/freezer/cgroup.procs").exists() {
        return skip_or_fail("GANGWAY_REQUIRE_FREEZER", "no cgroup v1 freezer here");
    }
    let mut c = Cluster::start("127.0.0.1");
    c.agent("node-a", 1, &[], &["--kill-timeout-seconds", "2"]);
    c.wait_nodes(1);
    let pidfile = c.out.join("stuck.pid");
    let id = c.submit(&json!({
        "name": "stuck", "queue": "default", "replicas": 1,
        "resources": { "gpus": 1 },
        "restart": { "max_restarts": 0 },
        "checkpoint": { "grace_seconds": 1 },
        "run": { "command": ["sh", "-c", format!("echo $$ > {}; exec sleep 600", pidfile.display())] }
    }));
    c.wait_job(id, "run", 60, |j| state(j) == "running");
    let pid: i32 = wait_for("the rank's pid", 30, || {
        std::fs::read_to_string(&pidfile).ok()?.trim().parse().ok()
    });
    let frozen = Frozen::freeze(pid);
    c.agent("node-b", 1, &[], &[]);
    c.wait_nodes(2);
    c.post(&format!("/v1/jobs/{id}/cancel"));
    let j = c.wait_job(id, "end although its process survives", 60, |j| {
        state(j) == "cancelled"
    });
    assert!(alive(pid as u32), "the frozen process outlived SIGKILL");
    let why = "kill task failed: 1 process of rank 0 survived SIGKILL for 2s";
    let a = wait_for("node-a cordoned for it", 30, || {
        let n = c.node("node-a");
        (n["cordoned"] == true).then_some(n)
    });
    let reason = a["cordon_reason"].as_str().unwrap_or("");
    assert!(
        reason.contains("cordoned automatically") && reason.contains(why),
        "{a:#}\n{j:#}"
    );
    // The node keeps reporting (Ready), and the other node is untouched.
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert_eq!(c.node("node-a")["ready"], true, "{:#}", c.node("node-a"));
    let b = c.node("node-b");
    assert_eq!(b["cordoned"], false, "{b:#}");
    let mut next = c.rank_job("next", 1, 1);
    next["run"]["env"]["STEPS"] = json!("1");
    let next = c.submit(&next);
    let j = c.wait_job(next, "succeed on node-b", 60, |j| state(j) == "succeeded");
    assert_eq!(j["placement"][0]["node"], "node-b", "{j:#}");
    drop(frozen);
    assert!(!alive(pid as u32), "thawed, the pending SIGKILL ends it");
}

/// A gang whose node gets a non-application XID (a recorded machine's
/// scripted NVML event) restarts on another node, never the blamed one,
/// although best fit would put it back beside the dead GPU: auto-cordon is
/// off here, so only the avoidance keeps it away.
#[test]
fn a_gang_hit_by_an_xid_restarts_on_another_node_never_the_blamed_one() {
    let machines = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/machines");
    let mut c = Cluster::start_with(
        "127.0.0.1",
        &server_config("").replace("queues:", "auto_cordon_failures: 0\nqueues:"),
    );
    // GPU 0 of node-a reports a double-bit ECC error (XID 48) 10 s in.
    let base =
        std::fs::read_to_string(machines.join("a100-pcie-nvlink-pairs.yaml")).expect("machine");
    let faulty = c.out.join("xid.yaml");
    std::fs::write(
        &faulty,
        format!("{base}events:\n  - {{ at_seconds: 10, gpu: 0, xid: 48 }}\n"),
    )
    .expect("write");
    let healthy = c.out.join("healthy.yaml");
    std::fs::write(&healthy, &base).expect("write");
    let faulty = faulty.display().to_string();
    c.agent("node-a", 0, &[], &["--machine", &faulty]);
    c.wait_nodes(1);
    let id = c.submit(&json!({
        "name": "victim", "queue": "default", "replicas": 1,
        "resources": { "gpus": 1 },
        "restart": { "max_restarts": 3, "backoff_seconds": 0 },
        "checkpoint": { "grace_seconds": 1 },
        "run": { "command": ["sleep", "600"] }
    }));
    let j = c.wait_job(id, "run on node-a", 8, |j| state(j) == "running");
    assert_eq!(j["placement"][0]["node"], "node-a");
    assert_eq!(j["placement"][0]["gpus"][0], 0, "{j:#}");
    let healthy = healthy.display().to_string();
    c.agent("node-b", 0, &[], &["--machine", &healthy]);
    c.wait_nodes(2);
    let j = c.wait_job(id, "restart elsewhere after the XID", 60, |j| {
        j["attempt"].as_u64().unwrap_or(0) >= 1 && state(j) == "running"
    });
    assert_eq!(j["placement"][0]["node"], "node-b", "{j:#}");
    let ev = events(&j);
    assert!(
        ev.iter()
            .any(|(k, m)| k == "avoiding" && m.contains("avoids node node-a")),
        "{ev:?}"
    );
    // It stays there, and node-a stays in service: only the gang avoids it.
    for _ in 0..10 {
        std::thread::sleep(std::time::Duration::from_millis(300));
        let j = c.job(id);
        assert_ne!(j["placement"][0]["node"], "node-a", "{j:#}");
    }
    let a = c.node("node-a");
    assert_eq!(a["cordoned"], false, "auto-cordon is off: {a:#}");
    assert_eq!(a["gpus"][0]["healthy"], false, "{a:#}");
}
