//! Loaders for the real GPU-cluster traces in `../shared/traces`.
//!
//! Every loader returns the jobs it could use and a [`LoadReport`] that counts
//! each row it skipped or adjusted, by reason: bad or missing fields are
//! counted, never silently dropped.

use flate2::read::GzDecoder;
use gangway_core::PriorityClass;
pub use gangway_sim_engine::trace::{LoadReport, Trace, TraceError, TraceJob, KNOWN};
use std::io::Read;
use std::path::{Path, PathBuf};

fn report_of(t: &Table<'_>) -> LoadReport {
    LoadReport::of(&t.path, t.rows.len())
}

/// A small excerpt of the Philly trace shipped with the code, so the simulator
/// runs without `../shared` (the first 3,000 jobs in submission order).
pub const PHILLY_EXCERPT: &str = include_str!("../data/philly_excerpt.csv");

fn read_text(path: &Path) -> Result<String, TraceError> {
    let io = |source| TraceError::Io {
        path: path.display().to_string(),
        source,
    };
    let bytes = std::fs::read(path).map_err(io)?;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut s = String::new();
        GzDecoder::new(&bytes[..])
            .read_to_string(&mut s)
            .map_err(io)?;
        Ok(s)
    } else {
        String::from_utf8(bytes)
            .map_err(|e| io(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))
    }
}

/// A CSV table with a header row; fields are split on commas (these traces quote nothing).
struct Table<'a> {
    path: String,
    cols: Vec<&'a str>,
    rows: Vec<Vec<&'a str>>,
}

impl<'a> Table<'a> {
    fn parse(path: &str, text: &'a str) -> Self {
        let mut lines = text.lines().filter(|l| !l.trim().is_empty());
        let cols = lines
            .next()
            .map(|h| h.split(',').map(str::trim).collect())
            .unwrap_or_default();
        let rows = lines
            .map(|l| l.split(',').map(str::trim).collect())
            .collect();
        Table {
            path: path.to_string(),
            cols,
            rows,
        }
    }

    fn col(&self, name: &str) -> Result<usize, TraceError> {
        self.cols
            .iter()
            .position(|c| *c == name)
            .ok_or_else(|| TraceError::MissingColumn {
                path: self.path.clone(),
                column: name.to_string(),
                found: self.cols.join(","),
            })
    }
}

fn field<'a>(row: &[&'a str], i: usize) -> Option<&'a str> {
    row.get(i).copied().filter(|s| !s.is_empty())
}

fn num<T: std::str::FromStr>(row: &[&str], i: usize) -> Option<T> {
    field(row, i)?.parse().ok()
}

/// Seconds since 1970 of `YYYY-MM-DD HH:MM:SS` (UTC).
pub fn parse_timestamp(s: &str) -> Option<i64> {
    let (date, time) = s.trim().split_once(' ')?;
    let mut d = date.split('-');
    let (y, m, day): (i64, i64, i64) = (
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
    );
    let mut t = time.split(':');
    let (hh, mm, ss): (i64, i64, i64) = (
        t.next()?.parse().ok()?,
        t.next()?.parse().ok()?,
        t.next()?.parse().ok()?,
    );
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + hh * 3600 + mm * 60 + ss)
}

fn finish(name: &str, mut jobs: Vec<TraceJob>, mut report: LoadReport) -> Trace {
    jobs.sort_by(|a, b| a.submit.cmp(&b.submit).then_with(|| a.name.cmp(&b.name)));
    if let Some(first) = jobs.first().map(|j| j.submit) {
        for j in &mut jobs {
            j.submit -= first;
        }
    }
    report.loaded = jobs.len();
    Trace {
        name: name.to_string(),
        jobs,
        report,
    }
}

/// The Philly trace as preprocessed by Pollux: `timestamp,duration,num_gpus,gpu_time,cluster`.
pub fn parse_philly(path: &str, text: &str) -> Result<Trace, TraceError> {
    let t = Table::parse(path, text);
    let (ts, du, ng, vc) = (
        t.col("timestamp")?,
        t.col("duration")?,
        t.col("num_gpus")?,
        t.col("cluster")?,
    );
    let mut report = report_of(&t);
    let mut raw = Vec::new();
    for (i, row) in t.rows.iter().enumerate() {
        let Some(at) = field(row, ts).and_then(parse_timestamp) else {
            report.skip("bad or missing timestamp");
            continue;
        };
        let Some(d) = num::<f64>(row, du).filter(|d| d.is_finite()) else {
            report.skip("bad or missing duration");
            continue;
        };
        if d < 1.0 {
            report.skip("duration under 1 s");
            continue;
        }
        let Some(g) = num::<u32>(row, ng) else {
            report.skip("bad or missing num_gpus");
            continue;
        };
        if g == 0 {
            report.skip("zero GPUs");
            continue;
        }
        let Some(c) = field(row, vc) else {
            report.skip("missing cluster (VC)");
            continue;
        };
        raw.push((
            at,
            TraceJob {
                name: format!("philly-{i}"),
                submit: 0,
                duration: d.round() as u64,
                gpus: g,
                cpu_millis: 0,
                memory_mib: 0,
                queue: format!("vc_{c}"),
                priority: PriorityClass::Normal,
                gpu_model: None,
                user: String::new(),
                app: None,
                time_limit: None,
            },
        ));
    }
    let first = raw.iter().map(|(a, _)| *a).min().unwrap_or(0);
    let jobs = raw
        .into_iter()
        .map(|(a, mut j)| {
            j.submit = (a - first) as u64;
            j
        })
        .collect();
    Ok(finish("philly", jobs, report))
}

/// Chronus' Philly-derived traces (times in minutes).
pub fn parse_chronus(name: &str, path: &str, text: &str) -> Result<Trace, TraceError> {
    let t = Table::parse(path, text);
    let (id, user, ng, st, du, ty) = (
        t.col("job_id")?,
        t.col("user")?,
        t.col("num_gpu")?,
        t.col("submit_time")?,
        t.col("duration")?,
        t.col("job_type")?,
    );
    let model = t.col("model_name").unwrap_or(usize::MAX);
    let mut report = report_of(&t);
    let mut jobs = Vec::new();
    for row in &t.rows {
        let (Some(g), Some(s), Some(d)) = (
            num::<u32>(row, ng),
            num::<u64>(row, st),
            num::<u64>(row, du),
        ) else {
            report.skip("bad or missing num_gpu, submit_time or duration");
            continue;
        };
        if g == 0 {
            report.skip("CPU-only (0 GPUs)");
            continue;
        }
        if d == 0 {
            report.skip("zero duration");
            continue;
        }
        let priority = match field(row, ty) {
            Some("best") => PriorityClass::BestEffort,
            _ => PriorityClass::Normal,
        };
        jobs.push(TraceJob {
            name: format!("{name}-{}", field(row, id).unwrap_or("?")),
            submit: s * 60,
            duration: d * 60,
            gpus: g,
            cpu_millis: 0,
            memory_mib: 0,
            queue: field(row, user).unwrap_or("default").to_string(),
            priority,
            gpu_model: None,
            user: field(row, user).unwrap_or("").to_string(),
            app: field(row, model).map(str::to_string),
            time_limit: None,
        });
    }
    Ok(finish(name, jobs, report))
}

/// The Tiresias simulator's 60-job workload (seconds).
pub fn parse_tiresias(path: &str, text: &str) -> Result<Trace, TraceError> {
    let t = Table::parse(path, text);
    let (id, ng, st, du) = (
        t.col("job_id")?,
        t.col("num_gpu")?,
        t.col("submit_time")?,
        t.col("duration")?,
    );
    let mut report = report_of(&t);
    let mut jobs = Vec::new();
    for row in &t.rows {
        let (Some(g), Some(s), Some(d)) = (
            num::<u32>(row, ng),
            num::<u64>(row, st),
            num::<u64>(row, du),
        ) else {
            report.skip("bad or missing num_gpu, submit_time or duration");
            continue;
        };
        if g == 0 || d == 0 {
            report.skip("zero GPUs or duration");
            continue;
        }
        jobs.push(TraceJob {
            name: format!("tiresias-{}", field(row, id).unwrap_or("?")),
            submit: s,
            duration: d,
            gpus: g,
            cpu_millis: 0,
            memory_mib: 0,
            queue: "default".into(),
            priority: PriorityClass::Normal,
            gpu_model: None,
            user: String::new(),
            app: None,
            time_limit: None,
        });
    }
    Ok(finish("tiresias-60", jobs, report))
}

/// Alibaba's 2023 GPU pod list (openb). Pods that share a GPU (fractional
/// `gpu_milli`) are skipped and counted: Gangway allocates whole GPUs. Pods
/// never scheduled have no run time and are skipped.
pub fn parse_openb(path: &str, text: &str) -> Result<Trace, TraceError> {
    let t = Table::parse(path, text);
    let (name, cpu, mem, ng, milli, spec, qos, ct, dt, sc) = (
        t.col("name")?,
        t.col("cpu_milli")?,
        t.col("memory_mib")?,
        t.col("num_gpu")?,
        t.col("gpu_milli")?,
        t.col("gpu_spec")?,
        t.col("qos")?,
        t.col("creation_time")?,
        t.col("deletion_time")?,
        t.col("scheduled_time")?,
    );
    let mut report = report_of(&t);
    let mut jobs = Vec::new();
    for row in &t.rows {
        let (Some(g), Some(created), Some(deleted)) = (
            num::<u32>(row, ng),
            num::<u64>(row, ct),
            num::<u64>(row, dt),
        ) else {
            report.skip("bad or missing num_gpu, creation_time or deletion_time");
            continue;
        };
        let Some(started) = num::<u64>(row, sc) else {
            report.skip("never scheduled (no run time)");
            continue;
        };
        if deleted <= started {
            report.skip("non-positive run time");
            continue;
        }
        let gpus = g;
        if g == 1 && num::<u32>(row, milli).is_some_and(|m| m < 1000) {
            // Gangway allocates whole GPUs; rounding a shared-GPU pod up to a
            // whole one would replay a different workload. Counted, not run.
            report.skip("fractional GPU (shared-GPU pod), not replayed");
            continue;
        }
        let model = match field(row, spec) {
            Some(s) if s.contains('|') => {
                report.adjust("several allowed GPU models relaxed to any");
                None
            }
            Some(s) => Some(s.to_string()),
            None => None,
        };
        let priority = match field(row, qos) {
            Some("LS") | Some("Guaranteed") => PriorityClass::High,
            Some("BE") => PriorityClass::BestEffort,
            _ => PriorityClass::Normal,
        };
        jobs.push(TraceJob {
            name: field(row, name).unwrap_or("?").to_string(),
            submit: created,
            duration: deleted - started,
            gpus,
            cpu_millis: num(row, cpu).unwrap_or(0),
            memory_mib: num(row, mem).unwrap_or(0),
            queue: field(row, qos).unwrap_or("default").to_ascii_lowercase(),
            priority,
            gpu_model: model,
            user: String::new(),
            app: None,
            time_limit: None,
        });
    }
    Ok(finish("openb", jobs, report))
}

/// A user's own trace as CSV, with a header naming the columns (any order):
///
/// | column | meaning |
/// |---|---|
/// | `submit_time` | seconds (any origin) or `YYYY-MM-DD HH:MM:SS` (UTC) |
/// | `run_time` | seconds the job ran |
/// | `gpus` | GPUs of the whole job (0: CPU-only) |
/// | `user` | who submitted it |
/// | `queue` | queue, team or account charged |
/// | `name` (optional) | job or application name (run-time prediction keys on it) |
/// | `time_limit` (optional) | the user's time limit, seconds |
/// | `cpu_millis`, `memory_mib` (optional) | per job |
///
/// Fields may not contain commas (no quoting).
pub fn parse_csv(name: &str, path: &str, text: &str) -> Result<Trace, TraceError> {
    let t = Table::parse(path, text);
    let (st, rt, ng, us, qu) = (
        t.col("submit_time")?,
        t.col("run_time")?,
        t.col("gpus")?,
        t.col("user")?,
        t.col("queue")?,
    );
    let opt = |c: &str| t.col(c).ok();
    let (nm, tl, cpu, mem) = (
        opt("name"),
        opt("time_limit"),
        opt("cpu_millis"),
        opt("memory_mib"),
    );
    let mut report = report_of(&t);
    let mut raw = Vec::new();
    for (i, row) in t.rows.iter().enumerate() {
        let submit = field(row, st).and_then(|v| {
            v.parse::<i64>()
                .ok()
                .or_else(|| parse_timestamp(v))
                .filter(|x| *x >= 0)
        });
        let Some(submit) = submit else {
            report.skip("bad or missing submit_time");
            continue;
        };
        let Some(run) = num::<u64>(row, rt) else {
            report.skip("bad or missing run_time");
            continue;
        };
        if run == 0 {
            report.skip("zero run_time");
            continue;
        }
        let Some(gpus) = num::<u32>(row, ng) else {
            report.skip("bad or missing gpus");
            continue;
        };
        let Some(queue) = field(row, qu) else {
            report.skip("missing queue");
            continue;
        };
        let get = |c: Option<usize>| c.and_then(|c| num::<u64>(row, c));
        raw.push((
            submit,
            TraceJob {
                name: format!("{name}-{i}"),
                submit: 0,
                duration: run,
                gpus,
                cpu_millis: get(cpu).unwrap_or(0),
                memory_mib: get(mem).unwrap_or(0),
                queue: queue.to_string(),
                priority: PriorityClass::Normal,
                gpu_model: None,
                user: field(row, us).unwrap_or("").to_string(),
                app: nm.and_then(|c| field(row, c)).map(str::to_string),
                time_limit: get(tl).filter(|l| *l > 0),
            },
        ));
    }
    let first = raw.iter().map(|(a, _)| *a).min().unwrap_or(0);
    let jobs = raw
        .into_iter()
        .map(|(a, mut j)| {
            j.submit = (a - first) as u64;
            j
        })
        .collect();
    Ok(finish(name, jobs, report))
}

/// The Standard Workload Format of the Parallel Workloads Archive
/// (Feitelson et al., <https://www.cs.huji.ac.il/labs/parallel/workload/swf.html>):
/// 18 whitespace-separated fields per job, `;` comments, -1 for unknown.
/// Allocated processors (field 5, else requested, field 8) divided by
/// `procs_per_gpu` (rounded up) become GPUs; user (12), queue (15),
/// executable (14) and requested time (9) become user, queue, name and time
/// limit. Jobs with no run time (cancelled before starting) are skipped.
pub fn parse_swf(
    name: &str,
    path: &str,
    text: &str,
    procs_per_gpu: u32,
) -> Result<Trace, TraceError> {
    let per = u64::from(procs_per_gpu.max(1));
    let mut report = LoadReport {
        source: path.to_string(),
        ..Default::default()
    };
    let mut jobs = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with(';') {
            continue;
        }
        report.rows += 1;
        let f: Vec<i64> = match line.split_whitespace().map(str::parse::<i64>).collect() {
            Ok(f) => f,
            Err(_) => {
                report.skip("non-numeric field");
                continue;
            }
        };
        if f.len() < 18 {
            report.skip("fewer than 18 fields");
            continue;
        }
        let (submit, run) = (f[1], f[3]);
        if submit < 0 {
            report.skip("unknown submit time");
            continue;
        }
        if run <= 0 {
            report.skip("no run time (cancelled or unknown)");
            continue;
        }
        let procs = if f[4] > 0 { f[4] } else { f[7] };
        if procs <= 0 {
            report.skip("unknown processor count");
            continue;
        }
        let gpus = (procs as u64).div_ceil(per);
        let Ok(gpus) = u32::try_from(gpus) else {
            report.skip("processor count too large");
            continue;
        };
        if f[4] <= 0 {
            report.adjust("requested processors used (allocated unknown)");
        }
        let known = |v: i64, p: &str| (v >= 0).then(|| format!("{p}{v}"));
        jobs.push(TraceJob {
            name: format!("{name}-{}", f[0]),
            submit: submit as u64,
            duration: run as u64,
            gpus,
            cpu_millis: 0,
            memory_mib: 0,
            queue: known(f[14], "q").unwrap_or_else(|| "default".into()),
            priority: PriorityClass::Normal,
            gpu_model: None,
            user: known(f[11], "u").unwrap_or_default(),
            app: known(f[13], "app"),
            time_limit: (f[8] > 0).then_some(f[8] as u64),
        });
    }
    Ok(finish(name, jobs, report))
}

/// Loads a user's trace file: `.swf` (optionally `.swf.gz`) as SWF, anything
/// else as the documented CSV ([`parse_csv`]).
pub fn load_file(path: &Path, procs_per_gpu: u32) -> Result<Trace, TraceError> {
    let text = read_text(path)?;
    let p = path.display().to_string();
    let stem = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("trace")
        .split('.')
        .next()
        .unwrap_or("trace")
        .to_string();
    if p.ends_with(".swf") || p.ends_with(".swf.gz") {
        parse_swf(&stem, &p, &text, procs_per_gpu)
    } else {
        parse_csv(&stem, &p, &text)
    }
}

/// Where a named trace lives under the traces folder.
pub fn trace_path(traces: &Path, name: &str) -> Result<PathBuf, TraceError> {
    let rel = match name {
        "philly" => "philly-pollux/philly_jobs.csv.gz",
        "chronus-mix1" => "philly-chronus/trace_job_Philly_MIX1.csv.gz",
        "chronus-mix2" => "philly-chronus/trace_job_Philly_MIX2.csv.gz",
        "chronus-slo" => "philly-chronus/trace_job_Philly_SLO.csv.gz",
        "tiresias-60" => "tiresias-sim/60_job.csv",
        "openb" => "alibaba-openb-2023/openb_pod_list_default.csv",
        "pai" => {
            return Err(TraceError::NoJobs(
                name.into(),
                "only the machine table of Alibaba PAI 2020 is available; use it as a cluster with --cluster pai",
            ))
        }
        "pollux" | "sia" => {
            return Err(TraceError::NoJobs(
                name.into(),
                "Pollux/Sia workloads carry no run times; they need Pollux's throughput profiles",
            ))
        }
        _ => return Err(TraceError::Unknown(name.into())),
    };
    Ok(traces.join(rel))
}

/// Loads a trace by name from `traces` (the `shared/traces` folder).
/// `philly-excerpt` needs no folder: it is embedded.
pub fn load(traces: &Path, name: &str) -> Result<Trace, TraceError> {
    if name == "philly-excerpt" {
        let mut t = parse_philly("embedded philly excerpt", PHILLY_EXCERPT)?;
        t.name = name.into();
        return Ok(t);
    }
    let path = trace_path(traces, name)?;
    let text = read_text(&path)?;
    let p = path.display().to_string();
    match name {
        "philly" => parse_philly(&p, &text),
        "tiresias-60" => parse_tiresias(&p, &text),
        "openb" => parse_openb(&p, &text),
        n if n.starts_with("chronus") => parse_chronus(n, &p, &text),
        _ => Err(TraceError::Unknown(name.into())),
    }
}

/// Reads a file of the traces folder as text (gzip handled).
pub fn read(path: &Path) -> Result<String, TraceError> {
    read_text(path)
}
