//! `gangway-bench sched`: scheduling-core throughput, cycle latency and memory
//! on a synthetic cluster with a Philly-like job-size mix.
//!
//! Figures are printed as `metric: value unit`. Because the machine may be
//! shared and noisy, the same run also measures a naive baseline (a full scan
//! of every node per job, as a filter-everything scheduler does) on the same
//! jobs and prints Gangway's speed as a ratio against it.

use crate::common::{percentile, philly_gpus, Rng};
use anyhow::{bail, Result};
use clap::Args;
use gangway_core::{JobId, JobSpec, NodeSpec, QueueSpec, Time};
use gangway_sched::{apply, schedule, ClusterState, SchedulerConfig, StateConfig};
use std::collections::BTreeMap;
use std::time::Instant;

/// Options of `gangway-bench sched`.
#[derive(Args, Clone)]
pub struct SchedArgs {
    /// Cluster sizes to measure (nodes of 8 GPUs, racks of 32 nodes).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1_000usize, 10_000])]
    nodes: Vec<usize>,
    /// Pending jobs kept in the queue.
    #[arg(long, default_value_t = 100_000)]
    pending: usize,
    /// Steady-state cycles to measure after the initial fill.
    #[arg(long, default_value_t = 60)]
    cycles: usize,
    /// Simulated seconds between cycles.
    #[arg(long, default_value_t = 10)]
    interval: u64,
    /// Seed of the synthetic workload.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Backfill mode: off, easy, conservative or reservations:N.
    #[arg(long, default_value = "easy")]
    backfill: gangway_sched::Backfill,
    /// Pending jobs given a planned start per cycle.
    #[arg(long, default_value_t = gangway_sched::DEFAULT_PLAN_DEPTH)]
    plan_depth: usize,
    /// Running jobs' ends the plan may walk per cycle (unreserved plans).
    #[arg(long, default_value_t = gangway_sched::DEFAULT_PLAN_BUDGET)]
    plan_budget: usize,
    /// Most pending jobs examined per cycle (the head in order, then a
    /// rotating share of the rest); a value above `--pending` examines all.
    #[arg(long, default_value_t = gangway_sched::DEFAULT_MAX_PENDING_EXAMINED)]
    max_pending_examined: usize,
    /// Most victim candidates one preemption search examines.
    #[arg(long, default_value_t = gangway_sched::DEFAULT_MAX_VICTIMS_EXAMINED)]
    max_victims_examined: usize,
    /// Also time a full copy of the scheduler's state after each steady
    /// cycle (`state_clone_*`). Off by default: the copy doubles the peak
    /// RSS the bench reports.
    #[arg(long)]
    time_state_copy: bool,
}

/// Philly's 15 virtual clusters, by job count (the bench's queues).
const QUEUES: usize = 15;

fn synthetic_job(rng: &mut Rng) -> (JobSpec, u64) {
    let g = philly_gpus(rng);
    let (replicas, per) = if g <= 8 {
        (1, g)
    } else if g.is_multiple_of(8) {
        (g / 8, 8)
    } else {
        (g / 4, 4)
    };
    let q = (rng.next() % QUEUES as u64) as usize;
    let mut spec = JobSpec::new("bench", &format!("vc{q:02}"), replicas, per);
    spec.resources.cpu_millis = 4_000 * u64::from(per);
    spec.resources.memory_mib = 32 * 1024 * u64::from(per);
    // Log-uniform runtimes between 1 minute and ~1 day; half declare them.
    let runtime = (60.0 * (1440f64).powf(rng.unit())) as u64;
    if rng.next().is_multiple_of(2) {
        spec.runtime_seconds = Some(runtime);
    }
    (spec, runtime)
}

fn build_cluster(nodes: usize) -> Result<ClusterState> {
    let mut s = ClusterState::new(StateConfig::default());
    for i in 0..nodes {
        let rack = i / 32;
        let spine = rack / 16;
        s.add_node(NodeSpec::uniform(
            &format!("n{i:05}"),
            &format!("rack{rack:04}"),
            &format!("spine{spine:03}"),
            8,
            "H100",
            80,
        ))?;
    }
    // An organisation with one queue per Philly VC, each guaranteed an equal share.
    let gpus = (nodes * 8) as u64;
    s.add_queue(QueueSpec::gpus("org", None, gpus))?;
    for q in 0..QUEUES {
        s.add_queue(QueueSpec::gpus(
            &format!("vc{q:02}"),
            Some("org"),
            gpus / QUEUES as u64,
        ))?;
    }
    Ok(s)
}

fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// The naive baseline: for each job in submit order, scan every node and take
/// the best-fitting one (single-node jobs) or the first nodes with room (gangs).
fn naive_fill(nodes: usize, jobs: &[(JobSpec, u64)]) -> (usize, f64) {
    let mut free = vec![8u32; nodes];
    let start = Instant::now();
    let mut placed = 0;
    for (spec, _) in jobs {
        let need = spec.resources.gpus;
        if spec.replicas == 1 {
            let mut best: Option<usize> = None;
            for (n, f) in free.iter().enumerate() {
                if *f >= need && best.is_none_or(|b| free[b] > *f) {
                    best = Some(n);
                }
            }
            if let Some(b) = best {
                free[b] -= need;
                placed += 1;
            }
        } else {
            let fits: Vec<usize> = (0..nodes)
                .filter(|n| free[*n] >= need)
                .take(spec.replicas as usize)
                .collect();
            if fits.len() == spec.replicas as usize {
                for n in fits {
                    free[n] -= need;
                }
                placed += 1;
            }
        }
    }
    (placed, start.elapsed().as_secs_f64())
}

struct Workload {
    rng: Rng,
    next: u64,
    actual: BTreeMap<JobId, u64>,
}

impl Workload {
    fn submit(
        &mut self,
        state: &mut ClusterState,
        now: Time,
        keep: Option<&mut Vec<(JobSpec, u64)>>,
    ) -> Result<()> {
        let (spec, rt) = synthetic_job(&mut self.rng);
        let id = JobId(self.next);
        self.next += 1;
        if let Some(k) = keep {
            k.push((spec.clone(), rt));
        }
        state.submit(id, spec, now)?;
        self.actual.insert(id, rt);
        Ok(())
    }
}

/// Most cycles counted as filling the cluster before steady state is measured.
const MAX_FILL_CYCLES: usize = 20;

struct Figures {
    fill_placements: usize,
    fill_seconds: f64,
    /// Cycles until one left a job pending (the first included; the
    /// placement rate and the naive comparison are of the first alone).
    fill_cycles: usize,
    /// Slowest of them.
    fill_max_ms: f64,
    steady_placements: usize,
    steady_seconds: f64,
    cycle_ms: Vec<f64>,
    apply_ms: Vec<f64>,
    /// A full copy of the scheduler's state (what computing a cycle off the
    /// server's lock would copy under it).
    clone_ms: Vec<f64>,
    preemptions: usize,
    /// Pending jobs examined, over the steady cycles.
    examined: usize,
}

fn measure(nodes: usize, a: &SchedArgs) -> Result<(Figures, Vec<(JobSpec, u64)>)> {
    let mut w = Workload {
        rng: Rng(a.seed),
        next: 1,
        actual: BTreeMap::new(),
    };
    let mut state = build_cluster(nodes)?;
    let cfg = SchedulerConfig {
        backfill: a.backfill,
        plan_depth: a.plan_depth,
        plan_budget: a.plan_budget,
        max_pending_examined: a.max_pending_examined,
        max_victims_examined: a.max_victims_examined,
        ..SchedulerConfig::default()
    };
    let mut ends: BTreeMap<(Time, JobId), ()> = BTreeMap::new();
    let mut first_jobs = Vec::with_capacity(a.pending);
    let mut now: Time = 0;
    for _ in 0..a.pending {
        w.submit(&mut state, now, Some(&mut first_jobs))?;
    }
    let t = Instant::now();
    let d = schedule(&state, now, &cfg);
    let fill_seconds = t.elapsed().as_secs_f64();
    apply(&mut state, &d, now)?;
    let fill_placements = d.binds.len();
    for b in &d.binds {
        ends.insert((now + w.actual[&b.job], b.job), ());
    }
    let mut f = Figures {
        fill_placements,
        fill_seconds,
        fill_cycles: 1,
        fill_max_ms: fill_seconds * 1e3,
        steady_placements: 0,
        steady_seconds: 0.0,
        cycle_ms: Vec::new(),
        apply_ms: Vec::new(),
        clone_ms: Vec::new(),
        preemptions: 0,
        examined: 0,
    };
    let mut exiting: Vec<(Time, JobId)> = Vec::new();
    // The cluster is full once a cycle leaves under 1 % of its GPUs free;
    // until then (a cluster with more GPUs than the queue asks for, or a
    // queue deeper than a cycle examines, takes several cycles) the cycles
    // are fill cycles, reported apart from steady state.
    let total_gpus = state.total().gpus;
    let still_filling = |d: &gangway_sched::Decisions| d.stats.free_gpus * 100 > total_gpus;
    let mut filling = still_filling(&d);
    let mut steady = 0;
    while steady < a.cycles {
        now += a.interval;
        // Jobs end; preempted ones exit after their grace period and are requeued.
        while let Some((&(end, id), _)) = ends.iter().next() {
            if end > now {
                break;
            }
            ends.remove(&(end, id));
            if state.job(id).is_some() {
                state.finish(id)?;
            }
        }
        exiting.retain(|(t, id)| {
            if *t <= now {
                let _ = state.requeue(*id);
                false
            } else {
                true
            }
        });
        while state.pending_count() < a.pending {
            w.submit(&mut state, now, None)?;
        }
        let t = Instant::now();
        let d = schedule(&state, now, &cfg);
        let dt = t.elapsed().as_secs_f64();
        let t2 = Instant::now();
        apply(&mut state, &d, now)?;
        for b in &d.binds {
            ends.insert((now + w.actual[&b.job], b.job), ());
        }
        for p in &d.preemptions {
            ends.retain(|(_, id), _| *id != p.job);
            exiting.push((now + p.grace_seconds, p.job));
        }
        let fill = filling && f.fill_cycles < MAX_FILL_CYCLES;
        if fill {
            f.fill_cycles += 1;
            f.fill_max_ms = f.fill_max_ms.max(dt * 1e3);
            filling = still_filling(&d);
        } else {
            steady += 1;
            f.apply_ms.push(t2.elapsed().as_secs_f64() * 1e3);
            if a.time_state_copy {
                let t3 = Instant::now();
                let copy = state.clone();
                f.clone_ms.push(t3.elapsed().as_secs_f64() * 1e3);
                drop(copy);
            }
            f.preemptions += d.preemptions.len();
            f.examined += d.stats.considered;
            f.steady_placements += d.binds.len();
            f.steady_seconds += dt;
            f.cycle_ms.push(dt * 1e3);
        }
        if std::env::var_os("GANGWAY_BENCH_VERBOSE").is_some() {
            eprintln!(
                "{} cycle t={now} {:.1} ms: binds {} preemptions {} reservations {} stats {:?}",
                if fill { "fill" } else { "steady" },
                dt * 1e3,
                d.binds.len(),
                d.preemptions.len(),
                d.reservations.len(),
                d.stats
            );
        }
    }
    if let Err(e) = state.check_invariants() {
        bail!("state inconsistent after the benchmark: {e}");
    }
    Ok((f, first_jobs))
}

pub fn run(a: &SchedArgs) -> Result<()> {
    println!(
        "# gangway-bench sched: {} pending jobs (Philly size mix), 8-GPU nodes in racks of 32",
        a.pending
    );
    for &nodes in &a.nodes {
        let (f, jobs) = measure(nodes, a)?;
        let (naive_placed, naive_s) = naive_fill(nodes, &jobs);
        let mut c = f.cycle_ms.clone();
        c.sort_by(f64::total_cmp);
        let mut ap = f.apply_ms.clone();
        ap.sort_by(f64::total_cmp);
        let fill_rate = f.fill_placements as f64 / f.fill_seconds;
        let naive_rate = naive_placed as f64 / naive_s;
        let p = |m: &str, v: f64, u: &str| println!("{m}: {v:.2} {u}");
        println!("## {nodes} nodes × 8 GPUs = {} GPUs", nodes * 8);
        p("fill_placements", f.fill_placements as f64, "gangs");
        p("fill_cycles", f.fill_cycles as f64, "cycles");
        p("fill_cycle_latency", f.fill_seconds * 1e3, "ms");
        p("fill_cycle_latency_max", f.fill_max_ms, "ms");
        p("fill_placements_per_sec", fill_rate, "gangs/s");
        p("naive_scan_placements_per_sec", naive_rate, "gangs/s");
        p("speedup_vs_naive_scan", fill_rate / naive_rate, "x");
        p(
            "steady_placements_per_sec",
            f.steady_placements as f64 / f.steady_seconds.max(1e-9),
            "gangs/s",
        );
        p("steady_placements", f.steady_placements as f64, "gangs");
        p("steady_preemptions", f.preemptions as f64, "jobs");
        p("cycle_latency_p50", percentile(&c, 0.5), "ms");
        p("cycle_latency_p99", percentile(&c, 0.99), "ms");
        p("cycle_latency_max", c.last().copied().unwrap_or(0.0), "ms");
        p(
            "pending_examined_per_cycle",
            f.examined as f64 / f.cycle_ms.len().max(1) as f64,
            "jobs",
        );
        p("apply_latency_p50", percentile(&ap, 0.5), "ms");
        if a.time_state_copy {
            let mut cl = f.clone_ms.clone();
            cl.sort_by(f64::total_cmp);
            p("state_clone_p50", percentile(&cl, 0.5), "ms");
            p("state_clone_p99", percentile(&cl, 0.99), "ms");
        }
    }
    if let Some(rss) = peak_rss_mib() {
        println!("peak_rss: {rss:.1} MiB");
    }
    Ok(())
}
