//! Reports: `summary.json`, `summary.csv`, a table for people, and SVG plots
//! (JCT CDF per policy, cluster allocation over time, per-queue share over time).

use crate::metrics::SimResult;
use crate::trace::LoadReport;
use plotters::prelude::*;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::Path;
use thiserror::Error;

/// Writing a report failed.
#[derive(Debug, Error)]
pub enum ReportError {
    /// I/O.
    #[error("writing {path}: {source}")]
    Io {
        /// File.
        path: String,
        /// Cause.
        source: std::io::Error,
    },
    /// Plotting.
    #[error("plotting {path}: {message}")]
    Plot {
        /// File.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// JSON.
    #[error("encoding summary: {0}")]
    Json(#[from] serde_json::Error),
}

/// Everything about one `gangway sim` run.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Trace name.
    pub trace: String,
    /// Cluster name.
    pub cluster: String,
    /// GPUs in the cluster.
    pub cluster_gpus: u64,
    /// What the loader kept, skipped and adjusted.
    pub load: LoadReport,
    /// Results per policy.
    pub results: Vec<SimResult>,
    /// Wall-clock seconds per policy.
    pub wall_seconds: Vec<f64>,
}

fn h(secs: f64) -> String {
    if secs >= 3600.0 {
        format!("{:.1}h", secs / 3600.0)
    } else if secs >= 60.0 {
        format!("{:.1}m", secs / 60.0)
    } else {
        format!("{secs:.0}s")
    }
}

/// The table printed on stdout.
pub fn table(s: &Summary) -> String {
    let mut out = String::new();
    let l = &s.load;
    let _ = writeln!(
        out,
        "trace {}: {} rows, {} jobs loaded, {} skipped{}",
        s.trace,
        l.rows,
        l.loaded,
        l.skipped_total(),
        if l.skipped.is_empty() && l.adjusted.is_empty() {
            String::new()
        } else {
            format!(
                " ({})",
                l.skipped
                    .iter()
                    .map(|(k, v)| format!("{k}: {v}"))
                    .chain(
                        l.adjusted
                            .iter()
                            .map(|(k, v)| format!("adjusted, {k}: {v}"))
                    )
                    .collect::<Vec<_>>()
                    .join("; ")
            )
        }
    );
    let _ = writeln!(out, "cluster {}: {} GPUs", s.cluster, s.cluster_gpus);
    let _ = writeln!(
        out,
        "{:<9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>6} {:>6} {:>9} {:>8} {:>8}",
        "policy",
        "done",
        "avg JCT",
        "med JCT",
        "p95 JCT",
        "avg wait",
        "max wait",
        "wait/rt",
        "alloc",
        "jain",
        "preempt",
        "GPUh lost",
        "events/s"
    );
    for (r, wall) in s.results.iter().zip(&s.wall_seconds) {
        let _ = writeln!(
            out,
            "{:<9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7.1} {:>5.1}% {:>6.3} {:>9} {:>8.0} {:>8.0}",
            r.policy,
            r.completed,
            h(r.jct.mean),
            h(r.jct.median),
            h(r.jct.p95),
            h(r.wait.mean),
            h(r.max_wait),
            r.max_wait_over_runtime,
            r.allocation_ratio * 100.0,
            r.jain_fairness,
            r.preemptions,
            r.gpu_hours_lost,
            r.events as f64 / wall.max(1e-9)
        );
    }
    out
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ReportError + '_ {
    move |source| ReportError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Writes `summary.json`, `summary.csv` and the plots into `dir`.
pub fn write(dir: &Path, s: &Summary) -> Result<Vec<String>, ReportError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut written = Vec::new();
    let p = dir.join("summary.json");
    std::fs::write(&p, serde_json::to_string_pretty(s)?).map_err(io(&p))?;
    written.push(p.display().to_string());
    let mut csv = String::from(
        "policy,jobs,completed,avg_jct_s,median_jct_s,p95_jct_s,avg_wait_s,median_wait_s,p95_wait_s,makespan_s,allocation_ratio,utilisation,jain_fairness,max_wait_s,max_wait_over_runtime,starved_10x,preemptions,gpu_hours_lost,mean_fragmented_gpus,events,cycles,wall_s\n",
    );
    for (r, w) in s.results.iter().zip(&s.wall_seconds) {
        let _ = writeln!(
            csv,
            "{},{},{},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{},{:.4},{:.4},{:.4},{:.1},{:.2},{},{},{:.2},{:.2},{},{},{:.3}",
            r.policy,
            r.jobs,
            r.completed,
            r.jct.mean,
            r.jct.median,
            r.jct.p95,
            r.wait.mean,
            r.wait.median,
            r.wait.p95,
            r.makespan,
            r.allocation_ratio,
            r.utilisation,
            r.jain_fairness,
            r.max_wait,
            r.max_wait_over_runtime,
            r.starved_10x,
            r.preemptions,
            r.gpu_hours_lost,
            r.mean_fragmented_gpus,
            r.events,
            r.cycles,
            w
        );
    }
    let p = dir.join("summary.csv");
    std::fs::write(&p, csv).map_err(io(&p))?;
    written.push(p.display().to_string());
    for (name, f) in [
        (
            "jct_cdf.svg",
            plot_cdf as fn(&Path, &Summary) -> Result<(), String>,
        ),
        ("allocation.svg", plot_allocation),
        ("queue_share.svg", plot_queue_share),
    ] {
        let p = dir.join(name);
        f(&p, s).map_err(|message| ReportError::Plot {
            path: p.display().to_string(),
            message,
        })?;
        written.push(p.display().to_string());
    }
    Ok(written)
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn plot_cdf(path: &Path, s: &Summary) -> Result<(), String> {
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let max = s
        .results
        .iter()
        .filter_map(|r| r.jcts.last().copied())
        .fold(10.0f64, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("JCT CDF — {}", s.trace), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((1.0f64..max).log_scale(), 0.0f64..1.0)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("job completion time (s, log)")
        .y_desc("fraction of jobs")
        .draw()
        .map_err(|e| e.to_string())?;
    for (k, r) in s.results.iter().enumerate() {
        let n = r.jcts.len().max(1) as f64;
        let step = (r.jcts.len() / 400).max(1);
        let pts: Vec<(f64, f64)> = r
            .jcts
            .iter()
            .enumerate()
            .step_by(step)
            .map(|(i, v)| (v.max(1.0), (i + 1) as f64 / n))
            .collect();
        let c = COLORS[k % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(r.policy.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

fn plot_allocation(path: &Path, s: &Summary) -> Result<(), String> {
    let root = SVGBackend::new(path, (900, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let hours =
        |r: &SimResult| r.series.allocation.len() as f64 * r.series.bucket_seconds as f64 / 3600.0;
    let xmax = s.results.iter().map(hours).fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("GPU allocation over time — {}", s.trace),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0f64..xmax, 0.0f64..1.05)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("hours")
        .y_desc("allocated / capacity")
        .draw()
        .map_err(|e| e.to_string())?;
    for (k, r) in s.results.iter().enumerate() {
        let b = r.series.bucket_seconds as f64 / 3600.0;
        let pts: Vec<(f64, f64)> = r
            .series
            .allocation
            .iter()
            .enumerate()
            .map(|(i, v)| (i as f64 * b, *v))
            .collect();
        let c = COLORS[k % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(1)))
            .map_err(|e| e.to_string())?
            .label(r.policy.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

fn plot_queue_share(path: &Path, s: &Summary) -> Result<(), String> {
    // One panel per policy: each queue's GPUs held / its nominal quota.
    let n = s.results.len().max(1);
    let root = SVGBackend::new(path, (900, 300 * n as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let panels = root.split_evenly((n, 1));
    for (r, area) in s.results.iter().zip(panels.iter()) {
        let b = r.series.bucket_seconds as f64 / 3600.0;
        let len = r
            .series
            .queue_share
            .values()
            .map(Vec::len)
            .max()
            .unwrap_or(1);
        let ymax = r
            .series
            .queue_share
            .values()
            .flat_map(|v| v.iter().copied())
            .fold(1.0f64, f64::max)
            .min(20.0);
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{}: queue GPUs ÷ nominal quota", r.policy),
                ("sans-serif", 18),
            )
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(45)
            .build_cartesian_2d(0.0f64..(len as f64 * b).max(1.0), 0.0f64..ymax * 1.05)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("hours")
            .draw()
            .map_err(|e| e.to_string())?;
        for (k, (q, v)) in r.series.queue_share.iter().enumerate() {
            let c = COLORS[k % COLORS.len()];
            let pts: Vec<(f64, f64)> = v
                .iter()
                .enumerate()
                .map(|(i, x)| (i as f64 * b, x.min(ymax)))
                .collect();
            chart
                .draw_series(LineSeries::new(pts, c.stroke_width(1)))
                .map_err(|e| e.to_string())?
                .label(q.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 10))
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}
