//! `gangway`: one binary for Gangway's subcommands.

mod bench;
mod sim;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Gangway: a GPU cluster scheduler for gangs of ranks.
#[derive(Parser)]
#[command(name = "gangway", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replays a real cluster trace through the scheduling core and compares policies.
    Sim(sim::SimArgs),
    /// Benchmarks that print figures (`metric: value unit`).
    Bench {
        #[command(subcommand)]
        which: bench::Which,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Bench { which } => bench::run(which),
        Command::Sim(a) => sim::run(&a),
    }
}
