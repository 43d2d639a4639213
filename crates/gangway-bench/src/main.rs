//! `gangway-bench`: benchmarks that print figures (`metric: value unit`).
//! They live apart from the `gangway` binary so that what ships holds none of
//! their code; the whole-server ones start the `gangway` binary built beside this one.

mod api;
mod chaos;
mod cluster;
mod common;
mod dashboard;
mod run_trip;
mod sched;
mod slurm;
mod sync;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// The allocator `gangway` ships with, so in-process figures match the server's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Gangway's benchmarks: each prints `metric: value unit` lines.
#[derive(Parser)]
#[command(name = "gangway-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    which: Which,
}

/// Which benchmark to run.
#[derive(Subcommand)]
enum Which {
    /// The scheduling core on a synthetic cluster.
    Sched(sched::SchedArgs),
    /// The HTTP API: submissions per second and latency on loopback.
    Api(crate::api::ApiArgs),
    /// Server replicas on etcd with the leader killed again and again.
    Chaos(crate::chaos::ChaosArgs),
    /// What the dashboard's views cost the server on a large cluster.
    Dashboard(crate::dashboard::DashboardArgs),
    /// The whole server (real binary, HTTP and store) with hollow agents.
    Cluster(crate::cluster::ClusterArgs),
    /// `gangway run -- true` round trips on a `gangway up` cluster.
    Run(crate::run_trip::RunArgs),
    /// Submissions per second against Slurm's sbatch on this machine.
    Slurm(crate::slurm::SlurmArgs),
    /// What one agent sync costs the server, in process.
    Sync(crate::sync::SyncArgs),
}

fn main() -> std::process::ExitCode {
    match run(Cli::parse().which) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(which: Which) -> Result<()> {
    match which {
        Which::Sched(a) => sched::run(&a),
        Which::Api(a) => crate::api::run(&a),
        Which::Chaos(a) => crate::chaos::run(&a),
        Which::Dashboard(a) => crate::dashboard::run(&a),
        Which::Cluster(a) => crate::cluster::run(&a),
        Which::Run(a) => crate::run_trip::run(&a),
        Which::Slurm(a) => crate::slurm::run(&a),
        Which::Sync(a) => crate::sync::run(&a),
    }
}
