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
    /// Trace: philly, philly-excerpt (embedded), chronus-mix1, chronus-mix2, chronus-slo, tiresias-60, openb;
    /// or a file of your own: `.swf` (Parallel Workloads Archive) or CSV with
    /// columns submit_time,run_time,gpus,user,queue[,name,time_limit] (needs --cluster).
    /// Without a traces folder, philly falls back to the embedded excerpt.
    #[arg(long, default_value = "philly")]
    trace: String,
    /// Policies to compare, comma-separated: gangway, fifo, priority, slurm, capacity, tiresias, qssf, srtf.
    /// Default: gangway,fifo,tiresias; for the scorecard, every scorecard policy.
    #[arg(long, value_delimiter = ',')]
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
    /// Run the scorecard: every trace of the traces folder at its published
    /// size and at a contended size (offered load about 90 %), every policy of
    /// the scorecard (or those given with --policy), one table; writes
    /// scorecard.md and scorecard.json to --out. --limit cuts every trace.
    #[arg(long)]
    scorecard: bool,
    /// Traces of the scorecard, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "tiresias-60,chronus-mix1,chronus-mix2,chronus-slo,philly,openb"
    )]
    scorecard_traces: Vec<String>,
    /// FGD's fragmentation protocol instead of a replay: whole-GPU pods of the
    /// trace arrive (sampled, never leaving) until they ask for every GPU;
    /// prints the GPU allocation ratio under gangway, best-fit and random-fit
    /// (10 seeds each).
    #[arg(long)]
    fgd: bool,
    /// For SWF traces: processors per GPU (processors ÷ this, rounded up, are GPUs).
    #[arg(long, default_value_t = 1)]
    procs_per_gpu: u32,
    /// Threads for the scorecard's runs (default: the machine's cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Backfill for every policy of the run: off, easy, conservative or
    /// reservations:N (default: each policy's own; see docs/BACKFILL.md).
    #[arg(long)]
    backfill: Option<gangway_sched::Backfill>,
    /// Pending jobs given a planned start per cycle (default 200).
    #[arg(long)]
    plan_depth: Option<usize>,
    /// Every job preemptible under every policy (Tiresias' and SRTF's
    /// published assumption). Default: each job's priority class decides,
    /// for every policy alike (high and above are not preemptible).
    #[arg(long)]
    all_preemptible: bool,
}

fn options(a: &SimArgs) -> SimOptions {
    SimOptions {
        checkpoint_interval: a.checkpoint_interval.max(1),
        grace_seconds: a.grace,
        restart_overhead_seconds: a.restart_overhead,
        las_thresholds: a.las_thresholds.clone(),
        partition: a.partition,
        declare_runtimes: a.declare_runtimes,
        node_mtbf_hours: a.node_mtbf_hours,
        limit: a.limit,
        backfill: a.backfill,
        plan_depth: a.plan_depth,
        all_preemptible: a.all_preemptible,
        ..SimOptions::default()
    }
}

fn scorecard(a: &SimArgs) -> Result<()> {
    use gangway_sim::scorecard::{self, Scorecard};
    let policies: Vec<Policy> = if a.policy.is_empty() {
        gangway_sim::policy::SCORECARD.to_vec()
    } else {
        a.policy.clone()
    };
    let opts = options(a);
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let t0 = Instant::now();
    let mut loads = Vec::new();
    // Every trace first, then every (trace, size, policy) run in one pool.
    let mut sized: Vec<(gangway_sim::Trace, Vec<(&str, ClusterSpec)>)> = Vec::new();
    for name in &a.scorecard_traces {
        let trace = match load(&a.traces, name) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("skipping {name}: {e}");
                continue;
            }
        };
        loads.push(trace.report.clone());
        let published = ClusterSpec::builtin(name, &a.traces)?;
        let contended = scorecard::contended(&published, &trace, a.limit);
        let mut groups = vec![("published", published.clone())];
        if contended != published {
            groups.insert(0, ("contended", contended));
        } else {
            groups[0].0 = "published (contended as is)";
        }
        sized.push((trace, groups));
    }
    let groups: Vec<scorecard::Group<'_>> = sized
        .iter()
        .flat_map(|(trace, gs)| {
            gs.iter().map(move |(size, cluster)| scorecard::Group {
                trace,
                cluster,
                size,
            })
        })
        .collect();
    if !a.quiet {
        eprintln!(
            "{} runs ({} groups × {} policies) on {threads} threads",
            groups.len() * policies.len(),
            groups.len(),
            policies.len()
        );
    }
    let by_group = scorecard::run_groups(&groups, &policies, &opts, threads)?;
    let mut rows = Vec::new();
    for (g, r) in groups.iter().zip(by_group) {
        if !a.quiet {
            eprintln!(
                "{} {} ({} GPUs): {} policies, {:.1}s of runs",
                g.trace.name,
                g.size,
                g.cluster.gpus(),
                r.len(),
                r.iter().map(|x| x.wall_seconds).sum::<f64>()
            );
        }
        rows.extend(r);
    }
    let s = Scorecard {
        settings: format!(
            "every policy on the same cluster and quotas (idle quota lent to all) and honouring the jobs' priority classes ({}); checkpoint every {} s, {} s grace, {} s restart overhead per preemption; Tiresias thresholds {:?} GPU-s, Gangway's {:?}; run times unknown to the scheduler (predicted from completed jobs) except for srtf (oracle){}{}",
            if opts.all_preemptible {
                "every job preemptible"
            } else {
                "high and above not preemptible, by every policy"
            },
            opts.checkpoint_interval,
            opts.grace_seconds,
            opts.restart_overhead_seconds,
            opts.las_thresholds,
            gangway_sched::rank::GANGWAY_THRESHOLDS,
            if opts.partition { "; node partitions per queue" } else { "" },
            a.limit.map_or(String::new(), |l| format!("; first {l} jobs of each trace")),
        ),
        loads,
        rows,
        wall_seconds: t0.elapsed().as_secs_f64(),
    };
    let md = scorecard::markdown(&s);
    print!("{md}");
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let p = a.out.join("scorecard.md");
    std::fs::write(&p, &md).with_context(|| format!("writing {}", p.display()))?;
    let j = a.out.join("scorecard.json");
    std::fs::write(&j, serde_json::to_string_pretty(&s)?)
        .with_context(|| format!("writing {}", j.display()))?;
    let svg = a.out.join("scorecard.svg");
    scorecard::plot(&svg, &s).map_err(|e| anyhow::anyhow!("plotting {}: {e}", svg.display()))?;
    println!("wrote {}, {}, {}", p.display(), j.display(), svg.display());
    Ok(())
}

fn fgd(a: &SimArgs) -> Result<()> {
    use gangway_sim::fgd::{fill, Fit};
    let trace = load(&a.traces, &a.trace).with_context(|| format!("loading trace {}", a.trace))?;
    let cluster = match &a.cluster {
        Some(c) if c.ends_with(".yaml") || c.ends_with(".yml") => {
            ClusterSpec::from_file(c.as_ref())?
        }
        Some(c) => ClusterSpec::builtin(c, &a.traces)?,
        None => ClusterSpec::builtin(&a.trace, &a.traces)?,
    };
    println!(
        "FGD fill on {} ({} GPUs), {} whole-GPU pods sampled from {} ({} rows skipped: {:?})",
        cluster.name,
        cluster.gpus(),
        trace.jobs.iter().filter(|j| j.gpus > 0).count(),
        trace.name,
        trace.report.skipped_total(),
        trace.report.skipped
    );
    println!(
        "| placement | GPU allocation ratio (mean of 10 seeds) | min | max | failed pods (mean) |"
    );
    println!("|---|---|---|---|---|");
    for fit in [Fit::Gangway, Fit::BestFit, Fit::RandomFit] {
        let rs: Vec<_> = (1..=10u64)
            .filter_map(|seed| fill(&trace, &cluster, fit, seed))
            .collect();
        anyhow::ensure!(!rs.is_empty(), "no whole-GPU pods to place");
        let v: Vec<f64> = rs.iter().map(|r| r.allocation_ratio).collect();
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let min = v.iter().copied().fold(f64::INFINITY, f64::min);
        let max = v.iter().copied().fold(0.0, f64::max);
        let failed = rs.iter().map(|r| r.failed as f64).sum::<f64>() / rs.len() as f64;
        println!(
            "| {} | {:.1} % | {:.1} % | {:.1} % | {failed:.0} |",
            serde_json::to_string(&fit)?.trim_matches('"'),
            mean * 100.0,
            min * 100.0,
            max * 100.0
        );
    }
    Ok(())
}

pub fn run(a: &SimArgs) -> Result<()> {
    if a.scorecard {
        return scorecard(a);
    }
    if a.fgd {
        return fgd(a);
    }
    let mut trace_name = a.trace.clone();
    if trace_name == "philly" && !a.traces.join("philly-pollux/philly_jobs.csv.gz").exists() {
        eprintln!(
            "note: {} has no Philly trace; using the embedded excerpt (first 3,000 jobs)",
            a.traces.display()
        );
        trace_name = "philly-excerpt".into();
    }
    let own_file = std::path::Path::new(&trace_name).is_file();
    let trace = if own_file {
        gangway_sim::trace::load_file(trace_name.as_ref(), a.procs_per_gpu)
    } else {
        load(&a.traces, &trace_name)
    }
    .with_context(|| format!("loading trace {trace_name}"))?;
    let cluster = match &a.cluster {
        Some(c) if c.ends_with(".yaml") || c.ends_with(".yml") => {
            ClusterSpec::from_file(c.as_ref())?
        }
        Some(c) => ClusterSpec::builtin(c, &a.traces)?,
        None if own_file => anyhow::bail!(
            "--cluster is required with a trace file (a YAML description or a built-in name)"
        ),
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
    let opts = options(a);
    let mut results = Vec::new();
    let mut walls = Vec::new();
    let policies = if a.policy.is_empty() {
        vec![Policy::Gangway, Policy::Fifo, Policy::Tiresias]
    } else {
        a.policy.clone()
    };
    for &p in &policies {
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
