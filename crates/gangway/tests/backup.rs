//! Rollback paths for Gangway itself, end to end: a backup taken with jobs
//! running restores into a fresh server whose agents re-adopt the running
//! jobs, and a server refuses a store written by a newer one.

mod common;

use common::{alive, pids, server_config, wait_for, Cluster, ADMIN, BIN};
use gangway_store::{RedbStore, Store};
use serde_json::Value;
use std::process::{Command, Output};

fn admin(c: &Cluster, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("GANGWAY_ADDR", &c.addr)
        .env("GANGWAY_TOKEN", ADMIN)
        .output()
        .expect("run cli")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn a_backup_taken_with_jobs_running_restores_into_a_fresh_server_that_re_adopts_them() {
    let mut c = Cluster::start_with("127.0.0.1", &server_config(""));
    c.agent("n0", 4, &[], &[]);
    c.agent("n1", 4, &[], &[]);
    c.wait_nodes(2);
    // Each job records its ranks' pids in its own directory.
    let job = |name: &str, replicas: u32, gpus: u32| {
        let out = c.out.join(name);
        std::fs::create_dir_all(&out).expect("out");
        let _ = Command::new("chmod").arg("0777").arg(&out).status();
        let mut j = c.rank_job(name, replicas, gpus);
        j["run"]["env"]["OUT"] = out.display().to_string().into();
        (c.submit(&j), out)
    };
    let (a, out_a) = job("a", 1, 4);
    let (b, out_b) = job("b", 1, 2);
    let ranks = wait_for("ranks started", 30, || {
        let (pa, pb) = (pids(&out_a, None), pids(&out_b, None));
        (!pa.is_empty() && !pb.is_empty()).then_some((pa, pb))
    });
    for id in [a, b] {
        c.wait_job(id, "running", 30, |j| j["state"] == "running");
    }
    let (p, _) = job("pending", 2, 4);
    c.wait_job(p, "a reason", 30, |j| j["reason"].is_string());
    let before: Vec<Value> = [a, b, p].iter().map(|id| c.job(*id)).collect();

    // Online backup through the API, then restored into a fresh data dir.
    let file = c.dir.path().join("backup.json");
    let f = file.to_str().expect("path");
    let o = admin(&c, &["admin", "backup", f]);
    assert!(
        o.status.success() && text(&o).contains("backup of"),
        "{}",
        text(&o)
    );
    let o = admin(&c, &["admin", "backup", f]);
    assert!(
        !o.status.success() && text(&o).contains("exists"),
        "{}",
        text(&o)
    );
    let o = Command::new(BIN)
        .args(["admin", "backup", "other.json"])
        .env("GANGWAY_ADDR", &c.addr)
        .env("GANGWAY_TOKEN", "agent-secret")
        .current_dir(c.dir.path())
        .output()
        .expect("cli");
    assert!(text(&o).contains("403"), "{}", text(&o));
    let fresh = c.dir.path().join("restored");
    let fr = fresh.to_str().expect("path");
    let o = admin(&c, &["admin", "restore", f, "--data-dir", fr]);
    assert!(o.status.success(), "{}", text(&o));
    let o = admin(&c, &["admin", "restore", f, "--data-dir", fr]);
    assert!(
        !o.status.success() && text(&o).contains("not empty"),
        "{}",
        text(&o)
    );

    // A fresh server on the restored store: the agents reconnect with their
    // node tokens and re-adopt the running ranks; every job is accounted for.
    c.replace_server(&fresh);
    c.wait_nodes(2);
    std::thread::sleep(std::time::Duration::from_secs(2));
    for (id, old) in [a, b].iter().zip(&before) {
        let j = c.wait_job(*id, "running", 30, |j| j["state"] == "running");
        assert_eq!(j["attempt"], old["attempt"], "job {id} restarted: {j:#}");
    }
    assert_eq!(pids(&out_a, None), ranks.0, "job a's ranks were restarted");
    assert_eq!(pids(&out_b, None), ranks.1, "job b's ranks were restarted");
    for (_, pid) in ranks.0.iter().chain(&ranks.1) {
        assert!(alive(*pid), "rank {pid} is gone");
    }
    let j = c.job(p);
    assert_eq!(j["state"], "pending", "{j:#}");
    let all = c.get("/v1/jobs");
    assert_eq!(all.as_array().map(Vec::len), Some(3), "{all:#}");
    let next = c.submit(&c.rank_job("next", 1, 1));
    assert_eq!(next, 4, "job ids continue after the restored ones");
}

#[test]
fn a_server_refuses_a_store_written_by_a_newer_one() {
    let dir = tempfile::tempdir().expect("tmp");
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).expect("data");
    {
        let store = RedbStore::open(&data.join("gangway.redb")).expect("store");
        store.put("/meta/schema", b"99").expect("put");
    }
    let cfg = dir.path().join("server.yaml");
    std::fs::write(&cfg, server_config("")).expect("config");
    let o = Command::new(BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--config"])
        .arg(&cfg)
        .arg("--data-dir")
        .arg(&data)
        .output()
        .expect("server");
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("schema version 99, newer than this server's 1"),
        "{t}"
    );
}
