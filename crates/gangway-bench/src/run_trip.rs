//! `gangway-bench run`: the round trip of `gangway run -- true` on a
//! `gangway up` cluster: from starting the CLI to its exit, through submit,
//! scheduling, the agent starting the rank, the rank's exit and the CLI
//! seeing the job end. Prints p50, p99 and max over the rounds.

use crate::common::{gangway_exe, percentile};
use anyhow::{bail, Context, Result};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `gangway-bench run` flags.
#[derive(clap::Args)]
pub(crate) struct RunArgs {
    /// Timed rounds (after one warm-up round).
    #[arg(long, default_value_t = 30)]
    rounds: u32,
}

/// `gangway up`, stopped with SIGTERM (it stops its agents and ranks).
struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg(self.0.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && matches!(self.0.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn run(a: &RunArgs) -> Result<()> {
    let exe = gangway_exe()?;
    let dir = tempfile::tempdir()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr = format!("http://127.0.0.1:{port}");
    let token = format!("bench-{}", gangway_server::control::fresh_token());
    let up = Up(Command::new(&exe)
        .args(["up", "--no-tls", "--nodes", "1", "--gpus", "1"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--disk-pressure-percent", "0"])
        .arg("--data-dir")
        .arg(dir.path().join("up"))
        .env("GANGWAY_UP_ADMIN_TOKEN", &token)
        .current_dir("/")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting gangway up")?);
    let t0 = Instant::now();
    loop {
        let ready = ureq::get(&format!("{addr}/v1/nodes"))
            .set("Authorization", &format!("Bearer {token}"))
            .call()
            .ok()
            .and_then(|r| r.into_json::<serde_json::Value>().ok())
            .and_then(|v| v.as_array().cloned())
            .is_some_and(|n| n.iter().any(|n| n["ready"] == true));
        if ready {
            break;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            bail!("gangway up did not get a ready node within 60 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let once = || -> Result<f64> {
        let t = Instant::now();
        let out = Command::new(&exe)
            .args(["run", "--", "true"])
            .env("GANGWAY_ADDR", &addr)
            .env("GANGWAY_TOKEN", &token)
            .env_remove("GANGWAY_CONFIG")
            .current_dir("/")
            .output()?;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        if !out.status.success() {
            bail!(
                "gangway run -- true failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(ms)
    };
    once()?;
    let mut times = Vec::new();
    for _ in 0..a.rounds {
        times.push(once()?);
    }
    times.sort_by(f64::total_cmp);
    println!("run_rounds: {}", times.len());
    println!("run_true_p50: {:.0} ms", percentile(&times, 0.5));
    println!("run_true_p99: {:.0} ms", percentile(&times, 0.99));
    println!(
        "run_true_max: {:.0} ms",
        times.last().copied().unwrap_or(0.0)
    );
    drop(up);
    Ok(())
}
