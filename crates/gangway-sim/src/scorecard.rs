//! The scorecard: every trace, at its published size and at a contended size,
//! under every policy, in one table.
//!
//! The contended size keeps the node shape and shrinks the node count until
//! the trace's offered load (Σ GPUs × run time over GPUs × the submission
//! span) is about 90 % (within 85–95 %); a trace already that loaded keeps its
//! size. Every policy of a row group runs the same jobs on the same cluster
//! with the same quotas and preemption-cost model ([`SimOptions`]); rejected
//! jobs are counted per policy.

use crate::cluster::ClusterSpec;
use crate::engine::{Engine, SimError, SimOptions};
use crate::metrics::SimResult;
use crate::policy::Policy;
use crate::trace::Trace;
use serde::Serialize;
use std::fmt::Write as _;

/// Offered load of `trace` on `gpus` GPUs: GPU-seconds asked for ÷ GPU-seconds
/// available from the first submission until the last job would end if it
/// never waited (a heavy-tailed trace is not "overloaded" by one long job).
pub fn offered_load(trace: &Trace, gpus: u64, limit: Option<usize>) -> f64 {
    let n = limit.unwrap_or(trace.jobs.len()).min(trace.jobs.len());
    let jobs = &trace.jobs[..n];
    let (Some(first), Some(last)) = (jobs.first(), jobs.last()) else {
        return 0.0;
    };
    let end = jobs
        .iter()
        .map(|j| j.submit + j.duration)
        .max()
        .unwrap_or(last.submit);
    let span = end.saturating_sub(first.submit).max(1) as f64;
    let work: f64 = jobs
        .iter()
        .map(|j| f64::from(j.gpus) * j.duration as f64)
        .sum();
    work / (gpus.max(1) as f64 * span)
}

/// The contended size of `cluster` for `trace`: the scale factor (≤ 1) that
/// brings the offered load to 90 %, never below what the largest job needs.
pub fn contended(cluster: &ClusterSpec, trace: &Trace, limit: Option<usize>) -> ClusterSpec {
    let load = offered_load(trace, cluster.gpus(), limit);
    if load >= 0.85 || load <= 0.0 {
        return cluster.clone();
    }
    let n = limit.unwrap_or(trace.jobs.len()).min(trace.jobs.len());
    let biggest = trace.jobs[..n].iter().map(|j| j.gpus).max().unwrap_or(1);
    let floor = f64::from(biggest) / cluster.gpus().max(1) as f64;
    cluster.scaled((load / 0.9).max(floor).min(1.0))
}

/// One policy's line of the scorecard.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Trace.
    pub trace: String,
    /// `published` or `contended`.
    pub size: String,
    /// Cluster name and GPUs.
    pub cluster: String,
    /// GPUs.
    pub gpus: u64,
    /// Offered load on this cluster.
    pub offered_load: f64,
    /// Policy.
    pub policy: String,
    /// Jobs in the run, completed, rejected.
    pub jobs: usize,
    /// Completed jobs.
    pub completed: usize,
    /// Rejected at submission (never fit this cluster).
    pub rejected: usize,
    /// JCT mean, median, p99 (seconds).
    pub avg_jct: f64,
    /// Median JCT.
    pub p50_jct: f64,
    /// 99th percentile JCT.
    pub p99_jct: f64,
    /// Mean queueing delay.
    pub avg_wait: f64,
    /// 99th percentile of JCT ÷ run time.
    pub p99_slowdown: f64,
    /// Jain's index across queues.
    pub jain: f64,
    /// Useful GPU-seconds ÷ capacity over the makespan.
    pub utilisation: f64,
    /// Preemptions per job.
    pub preemptions_per_job: f64,
    /// Jobs that waited more than 10× their run time.
    pub starved_10x: usize,
    /// Avg JCT ÷ the best non-oracle baseline's (Gangway excluded) in the group.
    pub ratio_to_best_baseline: f64,
    /// Avg JCT ÷ SRTF's (the oracle), when SRTF ran.
    pub ratio_to_oracle: Option<f64>,
    /// Wall-clock seconds of the run.
    pub wall_seconds: f64,
}

/// The whole scorecard.
#[derive(Clone, Debug, Serialize)]
pub struct Scorecard {
    /// The settings every run shared.
    pub settings: String,
    /// Loader reports per trace (skips and adjustments).
    pub loads: Vec<crate::trace::LoadReport>,
    /// Rows, grouped by trace and size.
    pub rows: Vec<Row>,
    /// Total wall-clock seconds.
    pub wall_seconds: f64,
}

/// One row group of the scorecard: a trace on one cluster size.
#[derive(Clone, Copy, Debug)]
pub struct Group<'a> {
    /// The trace.
    pub trace: &'a Trace,
    /// The cluster it runs on.
    pub cluster: &'a ClusterSpec,
    /// `published`, `contended`, ….
    pub size: &'a str,
}

/// Runs every policy on one trace and cluster; returns rows with ratios filled in.
pub fn run_group(
    trace: &Trace,
    cluster: &ClusterSpec,
    size: &str,
    policies: &[Policy],
    opts: &SimOptions,
    threads: usize,
) -> Result<Vec<Row>, SimError> {
    let group = Group {
        trace,
        cluster,
        size,
    };
    Ok(run_groups(&[group], policies, opts, threads)?
        .into_iter()
        .flatten()
        .collect())
}

/// Runs every policy on every group, `threads` runs at a time, and returns
/// each group's rows (in `groups` order, policies in `policies` order) with
/// ratios filled in.
///
/// The (group, policy) runs are independent, so they share one pool: a
/// thread takes the next run as soon as it is free, the biggest runs (most
/// jobs on the fewest GPUs) first, so one slow trace does not leave the
/// other cores idle while it finishes. What runs where changes only the
/// wall clock; every result is the same as a run on one thread.
pub fn run_groups(
    groups: &[Group<'_>],
    policies: &[Policy],
    opts: &SimOptions,
    threads: usize,
) -> Result<Vec<Vec<Row>>, SimError> {
    // Runs, biggest first: jobs per GPU is a rough guide to a run's cost.
    let mut tasks: Vec<(usize, usize)> = (0..groups.len())
        .flat_map(|g| (0..policies.len()).map(move |p| (g, p)))
        .collect();
    let weight = |&(g, _): &(usize, usize)| {
        let gr = &groups[g];
        let n = opts
            .limit
            .unwrap_or(gr.trace.jobs.len())
            .min(gr.trace.jobs.len()) as f64;
        n * n / gr.cluster.gpus().max(1) as f64
    };
    tasks.sort_by(|a, b| weight(b).total_cmp(&weight(a)).then(a.cmp(b)));
    let next = std::sync::atomic::AtomicUsize::new(0);
    type Done = Result<(SimResult, f64), SimError>;
    let results: Vec<((usize, usize), Done)> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads.clamp(1, tasks.len().max(1)))
            .map(|_| {
                sc.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(g, p)) = tasks.get(k) else { break };
                        let gr = &groups[g];
                        let t0 = std::time::Instant::now();
                        let r = Engine::new(gr.trace, gr.cluster, policies[p], opts.clone())
                            .and_then(|e| e.run(&mut |_, _| {}))
                            .map(|r| (r, t0.elapsed().as_secs_f64()));
                        let failed = r.is_err();
                        out.push(((g, p), r));
                        if failed {
                            // Stop taking runs; the error is reported below.
                            next.store(tasks.len(), std::sync::atomic::Ordering::Relaxed);
                            break;
                        }
                    }
                    out
                })
            })
            .collect();
        let mut out = Vec::new();
        for h in handles {
            match h.join() {
                Ok(v) => out.extend(v),
                Err(_) => out.push(((usize::MAX, usize::MAX), Err(SimError::Panicked))),
            }
        }
        out
    });
    let mut slots: Vec<Vec<Option<(SimResult, f64)>>> = groups
        .iter()
        .map(|_| policies.iter().map(|_| None).collect())
        .collect();
    let mut first_err: Option<((usize, usize), SimError)> = None;
    for (at, r) in results {
        match r {
            Ok(v) => slots[at.0][at.1] = Some(v),
            // The first failing run in (group, policy) order, as one thread would report it.
            Err(e) => {
                if !matches!(&first_err, Some((b, _)) if *b < at) {
                    first_err = Some((at, e));
                }
            }
        }
    }
    if let Some((_, e)) = first_err {
        return Err(e);
    }
    groups
        .iter()
        .zip(slots)
        .map(|(gr, slot)| {
            let res: Vec<(SimResult, f64)> = slot
                .into_iter()
                .map(|r| r.ok_or(SimError::Panicked))
                .collect::<Result<_, _>>()?;
            Ok(rows(gr, opts, res))
        })
        .collect()
}

/// A group's rows from its runs (in policy order), ratios filled in.
fn rows(gr: &Group<'_>, opts: &SimOptions, res: Vec<(SimResult, f64)>) -> Vec<Row> {
    let (trace, cluster, size) = (gr.trace, gr.cluster, gr.size);
    let load = offered_load(trace, cluster.gpus(), opts.limit);
    let avg = |p: &str| {
        res.iter()
            .find(|(r, _)| r.policy == p)
            .map(|(r, _)| r.jct.mean)
    };
    let best = res
        .iter()
        .filter(|(r, _)| r.policy != "gangway" && r.policy != "srtf")
        .map(|(r, _)| r.jct.mean)
        .fold(f64::INFINITY, f64::min);
    let oracle = avg("srtf");
    res.iter()
        .map(|(r, wall)| Row {
            trace: trace.name.clone(),
            size: size.to_string(),
            cluster: cluster.name.clone(),
            gpus: cluster.gpus(),
            offered_load: load,
            policy: r.policy.clone(),
            jobs: r.jobs,
            completed: r.completed,
            rejected: r.rejected.values().sum(),
            avg_jct: r.jct.mean,
            p50_jct: r.jct.median,
            p99_jct: r.jct.p99,
            avg_wait: r.wait.mean,
            p99_slowdown: r.slowdown.p99,
            jain: r.jain_fairness,
            utilisation: r.utilisation,
            preemptions_per_job: r.preemptions as f64 / r.jobs.max(1) as f64,
            starved_10x: r.starved_10x,
            ratio_to_best_baseline: if best.is_finite() && best > 0.0 {
                r.jct.mean / best
            } else {
                f64::NAN
            },
            ratio_to_oracle: oracle.filter(|o| *o > 0.0).map(|o| r.jct.mean / o),
            wall_seconds: *wall,
        })
        .collect()
}

fn h(secs: f64) -> String {
    if secs >= 3600.0 {
        format!("{:.2} h", secs / 3600.0)
    } else if secs >= 60.0 {
        format!("{:.1} m", secs / 60.0)
    } else {
        format!("{secs:.0} s")
    }
}

/// The scorecard as a Markdown table.
pub fn markdown(s: &Scorecard) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "Settings: {}\n", s.settings);
    let _ = writeln!(
        out,
        "| trace | size | GPUs | load | policy | done/rejected | avg JCT | p50 JCT | p99 JCT | avg wait | p99 slowdown | Jain | util | preempt/job | wait >10× | ÷ best baseline | ÷ SRTF |"
    );
    let _ = writeln!(
        out,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in &s.rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.0} % | {} | {}/{} | {} | {} | {} | {} | {:.1} | {:.3} | {:.1} % | {:.2} | {} | {:.2} | {} |",
            r.trace,
            r.size,
            r.gpus,
            r.offered_load * 100.0,
            if r.policy == "srtf" { "srtf (oracle)".to_string() } else { r.policy.clone() },
            r.completed,
            r.rejected,
            h(r.avg_jct),
            h(r.p50_jct),
            h(r.p99_jct),
            h(r.avg_wait),
            r.p99_slowdown,
            r.jain,
            r.utilisation * 100.0,
            r.preemptions_per_job,
            r.starved_10x,
            r.ratio_to_best_baseline,
            r.ratio_to_oracle.map_or("–".into(), |x| format!("{x:.2}")),
        );
    }
    let _ = writeln!(out, "\nWall clock: {:.1} s.", s.wall_seconds);
    out
}

/// Plots each policy's average JCT ÷ the best non-oracle baseline's, one
/// group of bars per trace and size (`scorecard.svg`): below 1 beats every
/// baseline.
pub fn plot(path: &std::path::Path, s: &Scorecard) -> Result<(), String> {
    use plotters::prelude::*;
    let mut groups: Vec<(String, String)> = Vec::new();
    for r in &s.rows {
        let g = (r.trace.clone(), r.size.clone());
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let mut policies: Vec<String> = Vec::new();
    for r in &s.rows {
        if !policies.contains(&r.policy) {
            policies.push(r.policy.clone());
        }
    }
    let ratio = |r: &Row| {
        if r.ratio_to_best_baseline.is_finite() {
            r.ratio_to_best_baseline
        } else {
            1.0
        }
    };
    let top = s.rows.iter().map(ratio).fold(1.5f64, f64::max).min(8.0);
    let width = 160 + 120 * groups.len() as u32;
    let root = SVGBackend::new(path, (width, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption("avg JCT ÷ best non-oracle baseline", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(60)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0f64..groups.len() as f64, 0.0f64..top)
        .map_err(|e| e.to_string())?;
    let labels = groups.clone();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len().max(1) * 2)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 0.01 && i < labels.len() {
                format!(
                    "{} {}",
                    labels[i].0,
                    labels[i].1.split(' ').next().unwrap_or("")
                )
            } else {
                String::new()
            }
        })
        .y_desc("ratio")
        .draw()
        .map_err(|e| e.to_string())?;
    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    let w = 0.8 / policies.len().max(1) as f64;
    for (k, p) in policies.iter().enumerate() {
        let c = colors[k % colors.len()];
        let bars: Vec<Rectangle<(f64, f64)>> = s
            .rows
            .iter()
            .filter(|r| &r.policy == p)
            .filter_map(|r| {
                let g = groups
                    .iter()
                    .position(|g| g.0 == r.trace && g.1 == r.size)?;
                let x0 = g as f64 + 0.1 + k as f64 * w;
                Some(Rectangle::new(
                    [(x0, 0.0), (x0 + w * 0.9, ratio(r).min(top))],
                    c.filled(),
                ))
            })
            .collect();
        chart
            .draw_series(bars)
            .map_err(|e| e.to_string())?
            .label(p.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], c.filled()));
    }
    chart
        .draw_series(LineSeries::new(
            vec![(0.0, 1.0), (groups.len() as f64, 1.0)],
            BLACK.stroke_width(1),
        ))
        .map_err(|e| e.to_string())?;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}
