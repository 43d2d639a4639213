//! The agent's ranks in Docker containers, and agents in their own network
//! namespaces so that node addresses are real. Both need root and tools that
//! a developer's machine may lack: they skip with a message unless
//! `GANGWAY_REQUIRE_DOCKER` / `GANGWAY_REQUIRE_NETNS` is set (CI sets both).

mod common;

use common::*;
use serde_json::json;
use std::process::Command;

#[test]
fn a_gang_runs_in_docker_containers_with_its_gpus_mounts_and_limits() {
    if let Err(why) = busybox_image() {
        return skip_or_fail("GANGWAY_REQUIRE_DOCKER", &why);
    }
    // Host paths may be mounted only where the queue allows (here, the temp
    // dir); a gang across nodes rendezvous on the host network, which the
    // queue must allow too.
    let mut c = Cluster::start_with(
        "127.0.0.1",
        &server_config(&tmp_mounts("      host_network: true\n")),
    );
    c.agent("dock-a", 2, &[], &["--executor", "docker"]);
    c.agent("dock-b", 2, &[], &["--executor", "docker"]);
    c.wait_nodes(2);
    // Not "data": that is the server's (private) data directory.
    let data = c.dir.path().join("dataset");
    std::fs::create_dir_all(&data).expect("data dir");
    std::fs::write(data.join("input"), "tokens\n").expect("input");
    let out = c.out.display().to_string();
    let script = r#"
key="$GANGWAY_ATTEMPT-$RANK"
env > "$OUT/env-$key"
cat /data/input > "$OUT/read-$RANK"
(echo x > /data/written) 2>/dev/null && touch "$OUT/wrote-$RANK"
cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null > "$OUT/memlimit-$RANK"
echo "$RANK" > "$GANGWAY_CHECKPOINT_DIR/rank-$RANK"
echo "rank $RANK in a container"
"#;
    let spec = json!({
        "name": "docker-gang",
        "queue": "default",
        "replicas": 4,
        "resources": { "gpus": 1, "cpu_millis": 500, "memory_mib": 64 },
        "restart": { "max_restarts": 0 },
        // Kept after success, so the test can look at it.
        "checkpoint": { "keep": true },
        "run": {
            "image": IMAGE,
            "command": ["sh", "-c", script],
            "env": { "OUT": out },
            "mounts": [
                { "source": out, "target": out },
                { "source": data.display().to_string(), "target": "/data", "read_only": true }
            ]
        }
    });
    let id = c.submit(&spec);
    let j = c.wait_job(id, "succeed", 90, |j| {
        matches!(state(j), "succeeded" | "failed")
    });
    assert_eq!(state(&j), "succeeded", "{:?}", events(&j));
    check_gang_env(&c.envs(0), 4, 2, 1);
    for r in 0..4 {
        let read =
            std::fs::read_to_string(c.out.join(format!("read-{r}"))).expect("read the data mount");
        assert_eq!(read, "tokens\n");
        assert!(
            !c.out.join(format!("wrote-{r}")).exists(),
            "the data mount is read-only"
        );
        let limit = std::fs::read_to_string(c.out.join(format!("memlimit-{r}"))).expect("limit");
        assert_eq!(
            limit.trim(),
            (64u64 << 20).to_string(),
            "memory limit of the container"
        );
        let ck = c
            .dir
            .path()
            .join(format!("checkpoints/admin/job-{id}/rank-{r}"));
        assert!(ck.exists(), "checkpoint written through the mount");
    }
    assert!(!data.join("written").exists());
    let out = Command::new(BIN)
        .args(["logs", &id.to_string(), "--rank", "3"])
        .env("GANGWAY_ADDR", &c.addr)
        .env("GANGWAY_TOKEN", ADMIN)
        .output()
        .expect("logs");
    assert!(String::from_utf8_lossy(&out.stdout).contains("rank 3 in a container"));
}

/// Network namespaces on a private bridge: the server on the host side,
/// each agent in its own namespace with its own address.
struct Net {
    bridge: String,
    namespaces: Vec<String>,
}

impl Net {
    fn teardown(&self) -> Vec<Vec<String>> {
        let mut t: Vec<Vec<String>> = self
            .namespaces
            .iter()
            .map(|ns| vec!["ip".into(), "netns".into(), "del".into(), ns.clone()])
            .collect();
        t.push(vec![
            "ip".into(),
            "link".into(),
            "del".into(),
            self.bridge.clone(),
        ]);
        t.push(
            [
                "iptables",
                "-D",
                "FORWARD",
                "-i",
                &self.bridge,
                "-o",
                &self.bridge,
                "-j",
                "ACCEPT",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        );
        t
    }
}

fn sh(cmd: &str) -> Result<(), String> {
    let o = Command::new("sh")
        .args(["-c", cmd])
        .output()
        .map_err(|e| e.to_string())?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd}: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ))
    }
}

fn make_net(tag: &str, subnet: &str, n: usize) -> Result<Net, String> {
    let bridge = format!("gwbr{tag}");
    let net = Net {
        bridge: bridge.clone(),
        namespaces: (0..n).map(|i| format!("gw{tag}ns{i}")).collect(),
    };
    // Leftovers of an interrupted run go first.
    for cmd in net.teardown() {
        let _ = Command::new(&cmd[0]).args(&cmd[1..]).output();
    }
    sh(&format!("ip link add {bridge} type bridge && ip addr add {subnet}.1/24 dev {bridge} && ip link set {bridge} up"))?;
    // Docker's FORWARD policy would drop bridged traffic where br_netfilter is loaded.
    let _ = sh(&format!(
        "iptables -I FORWARD -i {bridge} -o {bridge} -j ACCEPT"
    ));
    for (i, ns) in net.namespaces.iter().enumerate() {
        let (h, p) = (format!("gw{tag}h{i}"), format!("gw{tag}p{i}"));
        sh(&format!(
            "ip netns add {ns} && ip link add {h} type veth peer name {p} && ip link set {p} netns {ns} \
             && ip link set {h} master {bridge} up && ip netns exec {ns} ip addr add {subnet}.{}/24 dev {p} \
             && ip netns exec {ns} ip link set {p} up && ip netns exec {ns} ip link set lo up",
            10 + i
        ))?;
    }
    Ok(net)
}

/// A server on the bridge at `<subnet>.1` and `n` agents named `<prefix>-<i>`,
/// each in a namespace of its own at `<subnet>.<10+i>`, 2 GPUs each; `None`
/// (after saying why) where namespaces cannot be made.
fn namespaced_cluster(tag: &str, subnet: &str, n: usize, prefix: &str) -> Option<Cluster> {
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0"));
    if !is_root || !std::path::Path::new("/bin/busybox").exists() {
        skip_or_fail(
            "GANGWAY_REQUIRE_NETNS",
            "needs root and /bin/busybox (busybox-static)",
        );
        return None;
    }
    let net = match make_net(tag, subnet, n) {
        Ok(net) => net,
        Err(e) => {
            skip_or_fail(
                "GANGWAY_REQUIRE_NETNS",
                &format!("cannot make network namespaces: {e}"),
            );
            return None;
        }
    };
    let mut c = Cluster::start(&format!("{subnet}.1"));
    c.teardown = net.teardown();
    for (i, ns) in net.namespaces.iter().enumerate() {
        let addr = format!("{subnet}.{}", 10 + i);
        c.agent(
            &format!("{prefix}-{i}"),
            2,
            &["ip", "netns", "exec", ns],
            &["--address", &addr],
        );
    }
    c.wait_nodes(n);
    Some(c)
}

#[test]
fn agents_in_their_own_network_namespaces_rendezvous_at_real_addresses() {
    let subnet = "10.213.7";
    let Some(c) = namespaced_cluster("t7", subnet, 2, "ns-node") else {
        return;
    };
    // Rank 0 listens on MASTER_PORT in its namespace; rank 1 connects to
    // MASTER_ADDR from the other namespace: only real addresses get through.
    let script = r#"
env > "$OUT/env-$GANGWAY_ATTEMPT-$RANK"
if [ "$RANK" = 0 ]; then
  i=0
  until grep -q hello "$OUT/received" 2>/dev/null; do
    # Keep nc's stdin open a while: busybox nc exits at its end, and could
    # otherwise send "ack" and leave before rank 1's hello arrives.
    { echo ack; sleep 3; } | busybox nc -l -p "$MASTER_PORT" > "$OUT/received" || true
    i=$((i + 1)); [ "$i" -lt 50 ] || exit 4
  done
else
  i=0
  until grep -q ack "$OUT/ack" 2>/dev/null; do
    echo "hello from rank $RANK on $GANGWAY_NODE" | busybox nc -w 2 "$MASTER_ADDR" "$MASTER_PORT" > "$OUT/ack" || true
    i=$((i + 1)); [ "$i" -lt 100 ] || exit 3; sleep 0.2
  done
fi
echo "rank $RANK finished"
"#;
    let spec = json!({
        "name": "rendezvous",
        "queue": "default",
        "replicas": 2,
        "resources": { "gpus": 2 },
        "restart": { "max_restarts": 0 },
        "run": {
            "command": ["sh", "-c", script],
            "env": { "OUT": c.out.display().to_string() }
        }
    });
    let id = c.submit(&spec);
    let j = c.wait_job(id, "end", 60, |j| {
        matches!(state(j), "succeeded" | "failed")
    });
    assert_eq!(state(&j), "succeeded", "{:?}", events(&j));
    let envs = c.envs(0);
    check_gang_env(&envs, 2, 2, 2);
    let rank0_node = &envs[&0]["GANGWAY_NODE"];
    let idx: usize = rank0_node
        .trim_start_matches("ns-node-")
        .parse()
        .expect("node index");
    assert_eq!(
        envs[&1]["MASTER_ADDR"],
        format!("{subnet}.{}", 10 + idx),
        "MASTER_ADDR is rank 0's namespace address"
    );
    let got = std::fs::read_to_string(c.out.join("received")).expect("rank 0 received");
    assert!(got.starts_with("hello from rank 1 on ns-node-"), "{got}");
    // Logs travel from the agent's namespace through the server.
    let out = Command::new(BIN)
        .args(["logs", &id.to_string(), "--rank", "1"])
        .env("GANGWAY_ADDR", &c.addr)
        .env("GANGWAY_TOKEN", ADMIN)
        .output()
        .expect("logs");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("rank 1 finished"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_partitioned_agent_s_stale_ranks_are_stopped_when_the_partition_heals() {
    let subnet = "10.213.8";
    let Some(c) = namespaced_cluster("t8", subnet, 3, "part") else {
        return;
    };
    let id = c.submit(&c.rank_job("partitioned", 2, 2));
    let j = c.wait_job(id, "run", 30, |j| state(j) == "running");
    let cut = j["placement"][1]["node"]
        .as_str()
        .expect("node")
        .to_string();
    let cut_idx: usize = cut.trim_start_matches("part-").parse().expect("index");
    wait_for("2 ranks", 20, || {
        (pids(&c.out, Some(0)).len() == 2).then_some(())
    });
    let stale: Vec<u32> = pids(&c.out, Some(0))
        .into_iter()
        .filter(|(r, _)| c.envs(0).get(r).is_some_and(|e| e["GANGWAY_NODE"] == cut))
        .map(|(_, p)| p)
        .collect();
    assert_eq!(stale.len(), 1, "one rank on the node to cut off");
    // Cut the node's link: it cannot reach the server, nor the server it.
    sh(&format!("ip link set gwt8h{cut_idx} down")).expect("partition");
    wait_for("NotReady", 20, || {
        (c.node(&cut)["ready"] == false).then_some(())
    });
    let j = c.wait_job(id, "run elsewhere", 40, |j| {
        j["attempt"] == 1 && state(j) == "running"
    });
    let on: Vec<&str> = j["placement"]
        .as_array()
        .expect("placement")
        .iter()
        .map(|r| r["node"].as_str().unwrap_or(""))
        .collect();
    assert!(!on.contains(&cut.as_str()), "{on:?}");
    // Cut off, the stale rank still runs: nobody could tell it otherwise.
    assert!(stale.iter().all(|p| alive(*p)));
    // Heal: the agent syncs, learns attempt 0 is over, and stops its rank.
    sh(&format!("ip link set gwt8h{cut_idx} up")).expect("heal");
    wait_for("the stale rank stopped after the heal", 20, || {
        stale.iter().all(|p| !alive(*p)).then_some(())
    });
    wait_for("Ready again", 20, || {
        (c.node(&cut)["ready"] == true).then_some(())
    });
    // The new attempt was not disturbed.
    let j = c.job(id);
    assert_eq!((state(&j), j["attempt"].as_u64()), ("running", Some(1)));
}
