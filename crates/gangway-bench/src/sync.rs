//! `gangway-bench sync`: what one agent sync costs the server,
//! measured in process on a full cluster: every node runs eight one-GPU
//! jobs and reports them running, GPUs unchanged ("nothing new", the steady
//! heartbeat). Prints the time the state lock is held per sync (lock,
//! heartbeat, reports, assignments, release) and the whole server-side work
//! of one (request decoding, that, and the answer's encoding), no HTTP.

use crate::common::percentile;
use anyhow::{anyhow, bail, Result};
use clap::Args;
use gangway_core::agent::{GpuHealth, SyncRequest, TaskReport, TaskState};
use gangway_core::{JobSpec, NodeSpec};
use std::time::Instant;

/// Options of `gangway-bench sync`.
#[derive(Args, Clone)]
pub struct SyncArgs {
    /// Nodes of 8 GPUs, each running 8 one-GPU jobs.
    #[arg(long, default_value_t = 1_000)]
    nodes: usize,
    /// Syncs to measure (round robin over the nodes).
    #[arg(long, default_value_t = 20_000)]
    syncs: usize,
}

const CONFIG: &str = "admin_token: admin-secret\nagent_token: agent-secret\nnode_approval: auto\nqueues:\n  - name: q\n";

pub fn run(a: &SyncArgs) -> Result<()> {
    if a.nodes == 0 || a.syncs == 0 {
        bail!("--nodes and --syncs must be at least 1");
    }
    let dir = tempfile::tempdir()?;
    let cfg = gangway_server::ServerConfig::from_yaml(CONFIG)?;
    let app = gangway_server::open(cfg, dir.path())?;
    let now = gangway_server::clock::now();
    let names: Vec<String> = (0..a.nodes).map(|i| format!("n{i:05}")).collect();
    let mut bodies = Vec::with_capacity(a.nodes);
    {
        let mut c = app
            .control
            .lock()
            .map_err(|_| anyhow!("state lock poisoned"))?;
        for (i, name) in names.iter().enumerate() {
            let spec =
                NodeSpec::uniform(name, &format!("rack{:04}", i / 32), "spine0", 8, "H100", 80);
            c.register_node(
                spec,
                &gangway_server::nodes::Registrant::Admin,
                true,
                "agent-secret",
                now,
            )?;
        }
        for _ in 0..a.nodes * 8 {
            c.submit("alice", JobSpec::new("j", "q", 1, 1), now)?;
        }
        c.cycle(now)?;
        for name in &names {
            let req = SyncRequest {
                disk_pressure: None,
                gpus: (0..8)
                    .map(|index| GpuHealth {
                        index,
                        healthy: true,
                        reason: None,
                    })
                    .collect(),
                tasks: c
                    .assignments(name)
                    .iter()
                    .map(|x| TaskReport::new(x.job, x.attempt, TaskState::Running))
                    .collect(),
                ..Default::default()
            };
            // The first sync starts the jobs; the measured ones report nothing new.
            c.sync(name, &req, now)?;
            bodies.push(serde_json::to_vec(&req)?);
        }
    }
    let mut hold = Vec::with_capacity(a.syncs);
    let mut whole = Vec::with_capacity(a.syncs);
    let mut bytes = 0usize;
    for k in 0..a.syncs {
        let i = k % a.nodes;
        let t0 = Instant::now();
        let req: SyncRequest = serde_json::from_slice(&bodies[i])?;
        let t1 = Instant::now();
        let mut c = app
            .control
            .lock()
            .map_err(|_| anyhow!("state lock poisoned"))?;
        if c.pending_heartbeat(&names[i], now) {
            bail!("node {} waits for approval", names[i]);
        }
        let (answer, _changed) = c.sync(&names[i], &req, now)?;
        drop(c);
        let t2 = Instant::now();
        let mut out = answer.into_response();
        gangway_server::admission::stamp(&app.cfg, &mut out.assignments);
        bytes += serde_json::to_vec(&out)?.len();
        let t3 = Instant::now();
        hold.push((t2 - t1).as_secs_f64() * 1e6);
        whole.push((t3 - t0).as_secs_f64() * 1e6);
    }
    hold.sort_by(f64::total_cmp);
    whole.sort_by(f64::total_cmp);
    println!(
        "# gangway-bench sync: {} nodes × 8 one-GPU jobs running, {} syncs reporting nothing new",
        a.nodes, a.syncs
    );
    let p = |m: &str, v: f64, u: &str| println!("{m}: {v:.2} {u}");
    p("sync_lock_hold_p50", percentile(&hold, 0.5), "us");
    p("sync_lock_hold_p99", percentile(&hold, 0.99), "us");
    p("sync_server_p50", percentile(&whole, 0.5), "us");
    p("sync_server_p99", percentile(&whole, 0.99), "us");
    p("sync_answer_bytes", bytes as f64 / a.syncs as f64, "bytes");
    Ok(())
}
