//! `gangway sim`: replay a trace under several policies and write a report.

use anyhow::{Context, Result};
use clap::Args;
use gangway_sim::report::{self, Summary};
use gangway_sim::{load, ClusterSpec, Engine, Policy, SimOptions};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::time::Instant;

/// Options of `gangway sim`.
#[derive(Args, Clone)]
pub struct SimArgs {
    /// Trace: philly, philly-excerpt (embedded), chronus-mix1, chronus-mix2, chronus-slo, tiresias-60, openb.
    /// Without a traces folder, philly falls back to the embedded excerpt.
    #[arg(long, default_value = "philly")]
    trace: String,
    /// Policies to compare, comma-separated: gangway, fifo, priority, slurm, capacity, tiresias, qssf, srtf.
    #[arg(long, value_delimiter = ',', default_value = "gangway,fifo,tiresias")]
    policy: Vec<Policy>,
    /// Folder of the shared traces.
    #[arg(long, env = "GANGWAY_TRACES", default_value = "../shared/traces")]
    traces: PathBuf,
    /// Cluster description (YAML file, or a built-in name: philly, chronus, tiresias, openb, pai).
    /// Default: the trace's published cluster.
    #[arg(long)]
    cluster: Option<String>,
    /// Where to write summary.json, summary.csv and the SVG plots.
    #[arg(long, default_value = "report")]
    out: PathBuf,
    /// Seconds between a job's checkpoints (work since the last is lost when
    /// preempted); the same for every policy of the run.
    #[arg(long, default_value_t = 300)]
    checkpoint_interval: u64,
    /// Grace period after the checkpoint signal (GPU time lost per preemption).
    #[arg(long, default_value_t = 30)]
    grace: u64,
    /// Seconds a preempted job spends restoring its checkpoint on restart.
    #[arg(long, default_value_t = 0)]
    restart_overhead: u64,
    /// Tiresias' attained-service thresholds in GPU-seconds, comma-separated
    /// (default: the paper's 3250,7200).
    #[arg(long, value_delimiter = ',', default_value = "3250,7200")]
    las_thresholds: Vec<u64>,
    /// Node-partition mode: each queue runs on its own nodes (in proportion to
    /// its nominal quota), for every policy.
    #[arg(long)]
    partition: bool,
    /// Scale the cluster's node counts (node shape and quotas kept, quotas
    /// scaled), e.g. 0.5 for a contended replay.
    #[arg(long)]
    scale: Option<f64>,
    /// Jobs declare their run time to the scheduler (an oracle estimate).
    #[arg(long)]
    declare_runtimes: bool,
    /// Inject node failures with this mean time between failures per node (hours).
    #[arg(long)]
    node_mtbf_hours: Option<f64>,
    /// Only the first N jobs.
    #[arg(long)]
    limit: Option<usize>,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
}

pub fn run(a: &SimArgs) -> Result<()> {
    let mut trace_name = a.trace.clone();
    if trace_name == "philly" && !a.traces.join("philly-pollux/philly_jobs.csv.gz").exists() {
        eprintln!(
            "note: {} has no Philly trace; using the embedded excerpt (first 3,000 jobs)",
            a.traces.display()
        );
        trace_name = "philly-excerpt".into();
    }
    let trace =
        load(&a.traces, &trace_name).with_context(|| format!("loading trace {trace_name}"))?;
    let cluster = match &a.cluster {
        Some(c) if c.ends_with(".yaml") || c.ends_with(".yml") => {
            ClusterSpec::from_file(c.as_ref())?
        }
        Some(c) => ClusterSpec::builtin(c, &a.traces)?,
        None => ClusterSpec::builtin(&trace_name, &a.traces)?,
    };
    let mut cluster = cluster;
    if let Some(f) = a.scale {
        anyhow::ensure!(
            f > 0.0 && f.is_finite(),
            "--scale must be a positive number"
        );
        cluster = cluster.scaled(f);
    }
    if a.partition {
        let mut queues: Vec<String> = trace.jobs.iter().map(|j| j.queue.clone()).collect();
        queues.sort();
        queues.dedup();
        cluster = cluster.partitioned(&queues);
    }
    let opts = SimOptions {
        checkpoint_interval: a.checkpoint_interval.max(1),
        grace_seconds: a.grace,
        restart_overhead_seconds: a.restart_overhead,
        las_thresholds: a.las_thresholds.clone(),
        partition: a.partition,
        declare_runtimes: a.declare_runtimes,
        node_mtbf_hours: a.node_mtbf_hours,
        limit: a.limit,
        ..SimOptions::default()
    };
    let mut results = Vec::new();
    let mut walls = Vec::new();
    for &p in &a.policy {
        let engine = Engine::new(&trace, &cluster, p, opts.clone())?;
        let bar = if a.quiet {
            ProgressBar::hidden()
        } else {
            let b = ProgressBar::new(trace.jobs.len() as u64);
            b.set_style(
                ProgressStyle::with_template("{prefix:>9} [{bar:40}] {pos}/{len} jobs {elapsed}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            b.set_prefix(p.to_string());
            b
        };
        let start = Instant::now();
        let r = engine.run(&mut |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        })?;
        let wall = start.elapsed().as_secs_f64();
        bar.finish_and_clear();
        if !a.quiet {
            eprintln!(
                "{p}: {} events in {wall:.2}s ({:.0} events/s)",
                r.events,
                r.events as f64 / wall.max(1e-9)
            );
        }
        results.push(r);
        walls.push(wall);
    }
    let summary = Summary {
        trace: trace.name.clone(),
        cluster: cluster.name.clone(),
        cluster_gpus: cluster.gpus(),
        load: trace.report.clone(),
        results,
        wall_seconds: walls,
    };
    print!("{}", report::table(&summary));
    let files = report::write(&a.out, &summary)?;
    println!("wrote {}", files.join(", "));
    Ok(())
}
