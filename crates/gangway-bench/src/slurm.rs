//! `gangway-bench slurm`: job submissions per second through Gangway and
//! through Slurm on the same machine, in one run, so the ratio holds on a
//! noisy machine.
//!
//! Both sides get the same treatment: a private controller started for the
//! run (Slurm's `slurmctld` with a generated `slurm.conf` and its default
//! settings; this binary's server on redb), the same number of concurrent
//! clients, the same number of jobs, each submitted held so that nothing
//! runs, and each submission a new process of the system's own CLI (`sbatch`
//! against `gangway submit`). Rounds alternate between the two systems so a
//! burst of noise does not favour one. Gangway's HTTP API with keep-alive
//! clients is measured as well, since that is how tools submit to it; Slurm's
//! REST daemon is not measured. Every job is counted in each controller
//! afterwards: a submission that was not stored fails the benchmark.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Options of `gangway-bench slurm`.
#[derive(Args, Clone)]
pub struct SlurmArgs {
    /// Concurrent submitting clients for each system.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Jobs each system receives through its CLI (split over the rounds).
    #[arg(long, default_value_t = 2000)]
    jobs: usize,
    /// Alternating rounds per system.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
}

const TOKEN: &str = "bench-slurm-admin-token";
const CONFIG: &str = "admin_token: bench-slurm-admin-token\nagent_token: bench-slurm-agent-token\n\
                      node_approval: auto\nqueues:\n  - name: bench\n";
const JOB: &str = "name: bench\nqueue: bench\nhold: true\nreplicas: 1\nresources:\n  gpus: 1\n\
                   run:\n  command: [\"true\"]\n";

/// A child process killed when dropped.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| {
        std::env::split_paths(&p).any(|d| d.join(bin).is_file())
            || Path::new("/usr/sbin").join(bin).is_file()
    })
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn ok(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Munge authenticates Slurm's clients; its daemon must run.
fn ensure_munge() -> Result<()> {
    let works = || {
        Command::new("sh")
            .args(["-c", "munge -n | unmunge"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if works() {
        return Ok(());
    }
    // Start it as its own account, as the Debian service does.
    let _ = std::fs::create_dir_all("/run/munge");
    let _ = ok(Command::new("chown").args(["munge:munge", "/run/munge"]));
    let _ = ok(Command::new("runuser").args(["-u", "munge", "--", "/usr/sbin/munged"]));
    for _ in 0..50 {
        if works() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("munged is not running and could not be started (as root: runuser -u munge -- /usr/sbin/munged)")
}

/// Starts a private `slurmctld` with Slurm's default settings (one partition
/// of two 8-CPU nodes that never start; `MaxJobCount` raised so the run fits).
fn start_slurm(dir: &Path, jobs: usize) -> Result<(Guard, PathBuf)> {
    let user = String::from_utf8(Command::new("id").arg("-un").output()?.stdout)?
        .trim()
        .to_string();
    let (ctl, slurmd) = (free_port()?, free_port()?);
    let state = dir.join("state");
    std::fs::create_dir_all(&state)?;
    let d = dir.display();
    let conf = format!(
        "ClusterName=gangwaybench\nSlurmctldHost=localhost\nSlurmUser={user}\n\
         SlurmctldPort={ctl}\nSlurmdPort={slurmd}\nAuthType=auth/munge\n\
         StateSaveLocation={}\nSlurmdSpoolDir={d}/spool\nSlurmctldPidFile={d}/slurmctld.pid\n\
         SlurmctldLogFile={d}/slurmctld.log\nSchedulerType=sched/backfill\n\
         SelectType=select/cons_tres\nProctrackType=proctrack/linuxproc\n\
         MaxJobCount={}\nNodeName=bench[1-2] NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN\n\
         PartitionName=bench Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n",
        state.display(),
        jobs.saturating_mul(2).max(10_000),
    );
    let path = dir.join("slurm.conf");
    std::fs::write(&path, conf)?;
    let child = Command::new("slurmctld")
        .args(["-D", "-i", "-f"])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting slurmctld")?;
    let guard = Guard(child);
    for _ in 0..100 {
        if ok(Command::new("scontrol")
            .env("SLURM_CONF", &path)
            .arg("ping"))
        {
            return Ok((guard, path));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    bail!(
        "slurmctld did not answer within 20 s; see {}",
        dir.join("slurmctld.log").display()
    )
}

/// Runs `n` submissions over `clients` threads; `client()` makes each
/// thread's submitter (a new process per call, or one keep-alive HTTP
/// client). Returns the seconds taken and each submission's latency in ms.
/// Any failure fails the run.
fn drive<F>(clients: usize, n: usize, client: impl Fn() -> F) -> Result<(f64, Vec<f64>)>
where
    F: FnMut() -> Result<(), String> + Send + 'static,
{
    let start = Instant::now();
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let mut submit = client();
            let mine = n / clients + usize::from(c < n % clients);
            std::thread::spawn(move || -> Result<Vec<f64>, String> {
                let mut lat = Vec::with_capacity(mine);
                for _ in 0..mine {
                    let t = Instant::now();
                    submit()?;
                    lat.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                Ok(lat)
            })
        })
        .collect();
    let mut lat = Vec::with_capacity(n);
    for h in handles {
        let mine = h
            .join()
            .map_err(|_| anyhow::anyhow!("a client panicked"))?
            .map_err(|why| anyhow::anyhow!("a submission failed: {}", why.trim()))?;
        lat.extend(mine);
    }
    Ok((start.elapsed().as_secs_f64(), lat))
}

/// A submitter that runs `cmd()` as a new process per submission.
fn by_process(
    cmd: impl Fn() -> Command + Send + 'static,
) -> impl FnMut() -> Result<(), String> + Send + 'static {
    move || match cmd().stdout(Stdio::null()).output() {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).into_owned()),
        Err(e) => Err(e.to_string()),
    }
}

/// Percentile of unsorted latencies.
fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    crate::common::percentile(v, p)
}

/// Runs the comparison.
pub fn run(a: &SlurmArgs) -> Result<()> {
    if a.clients == 0 || a.jobs == 0 || a.rounds == 0 {
        bail!("--clients, --jobs and --rounds must be at least 1");
    }
    for bin in [
        "slurmctld",
        "sbatch",
        "squeue",
        "scontrol",
        "munge",
        "munged",
    ] {
        if !on_path(bin) {
            bail!("{bin} is not installed; on Debian or Ubuntu: apt-get install slurmctld slurm-client munge");
        }
    }
    ensure_munge()?;
    let dir = tempfile::Builder::new()
        .prefix("gangway-bench-slurm")
        .tempdir()?;
    let (_slurm, conf) = start_slurm(dir.path(), a.jobs)?;

    // Held jobs on one 8-GPU node: admissible, none placed, no agent needed.
    let server = crate::common::local_server(
        CONFIG,
        &dir.path().join("gangway"),
        "bench-slurm-agent-token",
    )?;
    let (app_ref, base) = (&server.app, &server.base);
    let job_file = dir.path().join("job.yaml");
    std::fs::write(&job_file, JOB)?;
    let exe = crate::common::gangway_exe()?;
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home)?;

    let sbatch = || {
        let conf = conf.clone();
        by_process(move || {
            let mut c = Command::new("sbatch");
            c.env("SLURM_CONF", &conf).args([
                "--hold",
                "--job-name=bench",
                "--output=/dev/null",
                "--wrap=true",
            ]);
            c
        })
    };
    let gangway = || {
        let (exe, base, job_file, home) =
            (exe.clone(), base.clone(), job_file.clone(), home.clone());
        by_process(move || {
            let mut c = Command::new(&exe);
            c.env("HOME", &home)
                .env_remove("GANGWAY_CA")
                .args(["submit", "--addr", &base, "--token", TOKEN])
                .arg(&job_file);
            c
        })
    };
    // Keep-alive HTTP clients, one per thread, as tools submit.
    let api = || {
        let (agent, url) = (ureq::AgentBuilder::new().build(), format!("{base}/v1/jobs"));
        move || {
            agent
                .post(&url)
                .set("Authorization", &format!("Bearer {TOKEN}"))
                .set("Content-Type", "application/yaml")
                .send_string(JOB)
                .map(drop)
                .map_err(|e| format!("submitting through the API: {e}"))
        }
    };

    println!(
        "# gangway-bench slurm: {} jobs per system through its CLI, {} clients, {} alternating rounds",
        a.jobs, a.clients, a.rounds
    );
    let (mut s_secs, mut g_secs) = (0.0, 0.0);
    let (mut s_lat, mut g_lat) = (Vec::new(), Vec::new());
    for r in 0..a.rounds {
        let n = a.jobs / a.rounds + usize::from(r < a.jobs % a.rounds);
        let (s, mut l) = drive(a.clients, n, sbatch)?;
        s_secs += s;
        s_lat.append(&mut l);
        let (s, mut l) = drive(a.clients, n, gangway)?;
        g_secs += s;
        g_lat.append(&mut l);
    }
    let (api_secs, mut api_lat) = drive(a.clients, a.jobs, api)?;

    // Every acknowledged job is stored.
    let out = Command::new("squeue")
        .env("SLURM_CONF", &conf)
        .args(["-h", "-r", "-o", "%i"])
        .output()?;
    let in_slurm = String::from_utf8_lossy(&out.stdout).lines().count();
    let in_gangway = app_ref
        .control
        .lock()
        .map_err(|_| anyhow::anyhow!("the server's state lock is poisoned"))?
        .jobs
        .len();
    if in_slurm != a.jobs {
        bail!("Slurm acknowledged {} jobs but holds {in_slurm}", a.jobs);
    }
    if in_gangway != a.jobs * 2 {
        bail!(
            "Gangway acknowledged {} jobs but holds {in_gangway}",
            a.jobs * 2
        );
    }
    let s_rate = a.jobs as f64 / s_secs;
    let g_rate = a.jobs as f64 / g_secs;
    let api_rate = a.jobs as f64 / api_secs;
    println!("slurm_sbatch_submissions_per_second: {s_rate:.0} jobs/s");
    println!("slurm_sbatch_latency_p50: {:.1} ms", pct(&mut s_lat, 0.5));
    println!("slurm_sbatch_latency_p99: {:.1} ms", pct(&mut s_lat, 0.99));
    println!("gangway_cli_submissions_per_second: {g_rate:.0} jobs/s");
    println!("gangway_cli_latency_p50: {:.1} ms", pct(&mut g_lat, 0.5));
    println!("gangway_cli_latency_p99: {:.1} ms", pct(&mut g_lat, 0.99));
    println!("gangway_api_submissions_per_second: {api_rate:.0} jobs/s");
    println!("gangway_api_latency_p99: {:.1} ms", pct(&mut api_lat, 0.99));
    println!("ratio_gangway_cli_to_sbatch: {:.2} x", g_rate / s_rate);
    println!("ratio_gangway_api_to_sbatch: {:.2} x", api_rate / s_rate);
    println!("jobs_stored: slurm {in_slurm}, gangway {in_gangway}");
    Ok(())
}
