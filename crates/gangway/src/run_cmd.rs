//! `gangway run [FLAGS] -- CMD ARGS...`: Slurm's `srun` for Gangway. It
//! builds a job spec from flags (no YAML), submits it, streams every rank's
//! output prefixed by its rank, and exits with the job's outcome. Ctrl-C
//! once cancels the job with its grace and keeps streaming until it ends;
//! a second Ctrl-C stops waiting and exits at once.

use crate::client::Conn;
use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Exit status when the job was cancelled (by Ctrl-C or by anyone else),
/// as a shell reports a process ended by SIGINT.
pub const EXIT_CANCELLED: u8 = 130;
/// Exit status when the job hit its time limit (as `timeout(1)`).
pub const EXIT_TIMEOUT: u8 = 124;
/// Exit status when the server refused the job (bad spec, quota, queue).
pub const EXIT_REFUSED: u8 = 125;

/// The most a rank's unfinished line is held before it is printed anyway
/// (a rank writing without newlines cannot grow the client's memory).
const MAX_PARTIAL_LINE: usize = 64 * 1024;

/// `gangway run` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// Whole GPUs per replica (per rank).
    #[arg(long, default_value_t = 0)]
    pub gpus: u32,
    /// Replicas (ranks) in the gang.
    #[arg(long, conflicts_with = "nodes")]
    pub replicas: Option<u32>,
    /// Nodes: with `--ranks-per-node N` the gang has nodes × N replicas,
    /// otherwise one replica per node.
    #[arg(long, short = 'N')]
    pub nodes: Option<u32>,
    /// Ranks per node (Slurm's `--ntasks-per-node`): each is one replica
    /// with `--gpus` GPUs (default 1 GPU when `--gpus` is not given).
    #[arg(long)]
    pub ranks_per_node: Option<u32>,
    /// CPU cores per replica (decimals allowed: 0.5).
    #[arg(long)]
    pub cpus: Option<String>,
    /// Memory per replica in MiB.
    #[arg(long)]
    pub mem_mib: Option<u64>,
    /// Queue (default: the only queue the token may use).
    #[arg(long, short = 'q')]
    pub queue: Option<String>,
    /// Required GPU model (e.g. H100).
    #[arg(long)]
    pub gpu_model: Option<String>,
    /// Time limit, Slurm's formats: `MM`, `MM:SS`, `HH:MM:SS`, `D-HH`,
    /// `D-HH:MM`, `D-HH:MM:SS`, or `1h30m`.
    #[arg(long, short = 't')]
    pub time: Option<String>,
    /// Job name (default: the command's basename).
    #[arg(long, short = 'J')]
    pub name: Option<String>,
    /// An environment variable for every rank, `K=V` (repeatable).
    #[arg(long = "env", short = 'e')]
    pub env: Vec<String>,
    /// Container image (the ranks run as plain processes without one).
    #[arg(long)]
    pub image: Option<String>,
    /// A mount, `SRC:DST[:ro]` (repeatable).
    #[arg(long = "mount")]
    pub mounts: Vec<String>,
    /// Restarts after a failure (default 0: a failed rank ends the run).
    #[arg(long, default_value_t = 0)]
    pub restarts: u32,
    /// Print ranks' lines as they are, without the `RANK: ` prefix.
    #[arg(long)]
    pub no_label: bool,
    /// The command every rank runs, after `--`.
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// How `gangway run` ended without success: the process exits with `code`
/// after printing `message` to stderr.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct RunExit {
    /// Exit status (never 0).
    pub code: u8,
    /// Why, for stderr.
    pub message: String,
}

/// Parses `--time` in Slurm's formats: a bare number is minutes (`srun -t
/// 30`), `MM:SS`, `HH:MM:SS`, `D-HH[:MM[:SS]]`, or Gangway's `1h30m`.
pub fn parse_slurm_time(text: &str) -> Result<u64, String> {
    let t = text.trim();
    if !t.is_empty() && t.chars().all(|c| c.is_ascii_digit()) {
        let m: u64 = t.parse().map_err(|_| format!("{text:?} is too long"))?;
        if m == 0 {
            return Err("must be more than 0".into());
        }
        return m
            .checked_mul(60)
            .ok_or_else(|| format!("{text:?} is too long"));
    }
    // `D-HH:MM` is days, hours, minutes in Slurm; the shared parser reads
    // `H:M` after a day as hours and minutes too.
    let s = gangway_core::job::parse_time_span(t).map_err(|_| {
        format!("{text:?} is not a time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM:SS or 1h30m)")
    })?;
    if s == 0 {
        return Err("must be more than 0".into());
    }
    Ok(s)
}

/// `--cpus` as thousandths of a core: `2`, `0.5`, `1.25`.
fn parse_cpus(text: &str) -> Result<u64, String> {
    let bad = || format!("{text:?} is not a number of cores (2, 0.5)");
    let (whole, frac) = text.trim().split_once('.').unwrap_or((text.trim(), ""));
    if whole.is_empty() && frac.is_empty()
        || !whole.chars().all(|c| c.is_ascii_digit())
        || !frac.chars().all(|c| c.is_ascii_digit())
        || frac.len() > 3
    {
        return Err(bad());
    }
    let w: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| bad())?
    };
    let f: u64 = if frac.is_empty() {
        0
    } else {
        format!("{frac:0<3}").parse().map_err(|_| bad())?
    };
    let m = w
        .checked_mul(1000)
        .and_then(|x| x.checked_add(f))
        .ok_or_else(bad)?;
    if m == 0 {
        return Err("must be more than 0".into());
    }
    Ok(m)
}

/// `--mount SRC:DST[:ro]` as the spec's mount.
fn parse_mount(text: &str) -> Result<Value, String> {
    let parts: Vec<&str> = text.split(':').collect();
    let (src, dst, ro) = match parts.as_slice() {
        [s, d] => (*s, *d, false),
        [s, d, "ro"] => (*s, *d, true),
        [s, d, "rw"] => (*s, *d, false),
        _ => return Err(format!("{text:?} is not SRC:DST or SRC:DST:ro")),
    };
    if !src.starts_with('/') || !dst.starts_with('/') {
        return Err(format!("{text:?}: both paths must be absolute"));
    }
    Ok(json!({ "source": src, "target": dst, "read_only": ro }))
}

/// The job spec the flags describe, in `queue` (the caller resolves the
/// default), with `workdir` as the ranks' working directory when they run
/// as processes. Errors name the flag.
pub fn spec_from_flags(a: &RunArgs, queue: &str, workdir: Option<&str>) -> Result<Value> {
    let Some(program) = a.command.first() else {
        bail!("no command: give it after `--` (gangway run -- CMD ARGS...)");
    };
    let replicas = match (a.replicas, a.nodes, a.ranks_per_node) {
        (Some(_), _, Some(_)) => bail!("--ranks-per-node goes with --nodes, not --replicas"),
        (Some(r), None, None) => r,
        (None, n, rpn) => n
            .unwrap_or(1)
            .checked_mul(rpn.unwrap_or(1))
            .context("--nodes × --ranks-per-node is too large")?,
        (Some(_), Some(_), None) => bail!("--replicas and --nodes are exclusive"),
    };
    if replicas == 0 {
        bail!("--replicas/--nodes/--ranks-per-node: must be at least 1");
    }
    let gpus = if a.ranks_per_node.is_some() && a.gpus == 0 {
        1
    } else {
        a.gpus
    };
    let mut resources = Map::new();
    resources.insert("gpus".into(), gpus.into());
    if let Some(m) = &a.gpu_model {
        if m.is_empty() {
            bail!("--gpu-model: must not be empty");
        }
        resources.insert("gpu_model".into(), m.clone().into());
    }
    match &a.cpus {
        Some(c) => {
            let m = parse_cpus(c).map_err(|e| anyhow::anyhow!("--cpus: {e}"))?;
            resources.insert("cpu_millis".into(), m.into());
        }
        // A job needs a GPU or some CPU: a GPU-less run gets one core.
        None if gpus == 0 => {
            resources.insert("cpu_millis".into(), 1000.into());
        }
        None => {}
    }
    if let Some(m) = a.mem_mib {
        resources.insert("memory_mib".into(), m.into());
    }
    let mut env = BTreeMap::new();
    for kv in &a.env {
        let Some((k, v)) = kv.split_once('=') else {
            bail!("--env: {kv:?} is not K=V");
        };
        let ok = k
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            bail!("--env: {k:?} is not a variable name (letters, digits, _)");
        }
        env.insert(k.to_string(), v.to_string());
    }
    let mounts: Vec<Value> = a
        .mounts
        .iter()
        .map(|m| parse_mount(m).map_err(|e| anyhow::anyhow!("--mount: {e}")))
        .collect::<Result<_>>()?;
    let name = match &a.name {
        Some(n) => n.clone(),
        None => std::path::Path::new(program)
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "run".into()),
    };
    let mut run = Map::new();
    run.insert("command".into(), json!(a.command));
    if !env.is_empty() {
        run.insert("env".into(), json!(env));
    }
    if !mounts.is_empty() {
        run.insert("mounts".into(), json!(mounts));
    }
    match &a.image {
        Some(i) => {
            run.insert("image".into(), i.clone().into());
        }
        None => {
            if let Some(w) = workdir {
                run.insert("workdir".into(), w.into());
            }
        }
    }
    let mut spec = json!({
        "name": name,
        "queue": queue,
        "replicas": replicas,
        "resources": resources,
        "restart": { "max_restarts": a.restarts, "backoff_seconds": 0 },
        "run": run,
    });
    if let Some(t) = &a.time {
        let s = parse_slurm_time(t).map_err(|e| anyhow::anyhow!("--time: {e}"))?;
        spec["time_limit"] = s.into();
    }
    Ok(spec)
}

/// The queue to submit to when `--queue` is not given: the only queue the
/// token may use (`/v1/whoami`'s `queues`).
fn default_queue(c: &Conn) -> Result<String> {
    let me = c.get("/v1/whoami")?;
    let queues: Vec<String> = me
        .get("queues")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(str::to_string)
        .collect();
    match queues.as_slice() {
        [q] => Ok(q.clone()),
        [] => bail!("--queue: no queue is open to this token"),
        many => bail!(
            "--queue: this token may use several queues ({}): name one",
            gangway_core::text::printable(&many.join(", "))
        ),
    }
}

/// Number of SIGINTs received since [`install_sigint`].
static SIGINTS: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_sigint(_: libc::c_int) {
    // Only an atomic add: async-signal-safe.
    SIGINTS.fetch_add(1, Ordering::SeqCst);
}

/// Counts Ctrl-C instead of dying on it.
fn install_sigint() {
    // SAFETY: the handler only touches an atomic; installing it replaces
    // the default action for SIGINT in this process.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigint as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        sa.sa_flags = libc::SA_RESTART;
        libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
    }
}

/// One rank's stream: how far it was read and the unfinished line.
#[derive(Default)]
struct RankStream {
    offset: u64,
    partial: Vec<u8>,
}

/// Writes `data` as lines prefixed `RANK: ` (unless `label` is off); an
/// unfinished line waits in `partial` for the next chunk, up to
/// [`MAX_PARTIAL_LINE`] bytes.
fn emit(out: &mut impl Write, rank: u32, st: &mut RankStream, data: &[u8], label: bool) {
    st.partial.extend_from_slice(data);
    while let Some(nl) = st.partial.iter().position(|b| *b == b'\n') {
        let line: Vec<u8> = st.partial.drain(..=nl).collect();
        write_line(out, rank, &line, label);
    }
    if st.partial.len() > MAX_PARTIAL_LINE {
        let mut line = std::mem::take(&mut st.partial);
        line.push(b'\n');
        write_line(out, rank, &line, label);
    }
}

fn write_line(out: &mut impl Write, rank: u32, line: &[u8], label: bool) {
    if label {
        let _ = write!(out, "{rank}: ");
    }
    let _ = out.write_all(line);
}

/// Prints any unfinished lines (a rank that ended without a newline).
fn flush_partials(out: &mut impl Write, streams: &mut BTreeMap<u32, RankStream>, label: bool) {
    for (rank, st) in streams.iter_mut() {
        if !st.partial.is_empty() {
            let mut line = std::mem::take(&mut st.partial);
            line.push(b'\n');
            write_line(out, *rank, &line, label);
        }
    }
}

fn is_end(state: &str) -> bool {
    matches!(state, "succeeded" | "failed" | "cancelled" | "timeout")
}

/// Reads what each placed rank wrote since the last call; returns whether
/// anything came.
fn pump(
    c: &Conn,
    id: u64,
    job: &Value,
    attempt: u32,
    streams: &mut BTreeMap<u32, RankStream>,
    label: bool,
) -> bool {
    let ranks = job
        .get("ran_on")
        .and_then(Value::as_array)
        .map_or(0, |a| a.len());
    let mut any = false;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for rank in 0..u32::try_from(ranks).unwrap_or(u32::MAX) {
        let st = streams.entry(rank).or_default();
        let path = format!(
            "/v1/jobs/{id}/logs?rank={rank}&offset={}&attempt={attempt}",
            st.offset
        );
        // A rank whose node has not written its log yet answers 404.
        let Ok(chunk) = c.get(&path) else { continue };
        let data = chunk.get("data").and_then(Value::as_str).unwrap_or("");
        if !data.is_empty() {
            any = true;
            emit(&mut out, rank, st, data.as_bytes(), label);
        }
        st.offset = chunk
            .get("next_offset")
            .and_then(Value::as_u64)
            .unwrap_or(st.offset);
    }
    let _ = out.flush();
    any
}

/// `gangway run`.
pub fn run(c: &Conn, a: &RunArgs) -> Result<()> {
    // From here a Ctrl-C is counted, not fatal: one during the submission
    // cancels the job as soon as its id is known.
    install_sigint();
    let queue = match &a.queue {
        Some(q) => q.clone(),
        None => default_queue(c)?,
    };
    let cwd = std::env::current_dir()
        .ok()
        .map(|d| d.display().to_string());
    let spec = spec_from_flags(a, &queue, cwd.as_deref())?;
    let key = gangway_server::control::fresh_token();
    let body = serde_json::to_string(&spec)?;
    let v = c
        .post_with_key("/v1/jobs", "application/json", &body, Some(&key))
        .map_err(|e| {
            // A refusal is the server's 4xx answer; anything else (no
            // server, a 5xx) is an error like any other command's.
            if e.to_string().starts_with("server answered 4") {
                RunExit {
                    code: EXIT_REFUSED,
                    message: format!("gangway run: the job was refused: {e:#}"),
                }
                .into()
            } else {
                e
            }
        })?;
    let id = v
        .get("id")
        .and_then(Value::as_u64)
        .context("the server's answer has no job id")?;
    eprintln!("gangway run: job {id} submitted");
    follow(c, id, !a.no_label)
}

/// Streams job `id`'s ranks until it ends and turns its end into the exit.
fn follow(c: &Conn, id: u64, label: bool) -> Result<()> {
    let mut streams: BTreeMap<u32, RankStream> = BTreeMap::new();
    let mut attempt: Option<u32> = None;
    let mut cancelled_by_us = false;
    let mut last_line = String::new();
    loop {
        match SIGINTS.load(Ordering::SeqCst) {
            0 => {}
            1 if !cancelled_by_us => {
                cancelled_by_us = true;
                eprintln!(
                    "gangway run: cancelling job {id} (its ranks get their grace; Ctrl-C again to stop waiting)"
                );
                if let Err(e) = c.post(&format!("/v1/jobs/{id}/cancel"), "application/json", "")
                {
                    eprintln!("gangway run: cancel failed: {e:#}");
                }
            }
            1 => {}
            _ => {
                return Err(RunExit {
                    code: EXIT_CANCELLED,
                    message: format!(
                        "gangway run: stopped waiting; job {id} is cancelling (`gangway describe {id}`)"
                    ),
                }
                .into())
            }
        }
        let job = c.get(&format!("/v1/jobs/{id}"))?;
        let state = job
            .get("state")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let line = crate::wait::progress(&crate::client::printable_value(&job));
        if line != last_line && !state.starts_with("running") && !is_end(&state) {
            eprintln!("gangway run: {line}");
        }
        last_line = line;
        let latest = job
            .get("ran_attempt")
            .and_then(Value::as_u64)
            .and_then(|a| u32::try_from(a).ok());
        if latest.is_some() && latest != attempt {
            if attempt.is_some() {
                let stdout = std::io::stdout();
                flush_partials(&mut stdout.lock(), &mut streams, label);
                eprintln!("gangway run: attempt {} started", latest.unwrap_or(0));
            }
            attempt = latest;
            streams.clear();
        }
        let got = match attempt {
            Some(at) => pump(c, id, &job, at, &mut streams, label),
            None => false,
        };
        if is_end(&state) {
            // Drain what the ranks wrote before the end was seen.
            if let Some(at) = attempt {
                while pump(c, id, &job, at, &mut streams, label) {}
            }
            let stdout = std::io::stdout();
            flush_partials(&mut stdout.lock(), &mut streams, label);
            return outcome(id, &state, &job);
        }
        if !got {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// The exit for a job that ended in `state`.
fn outcome(id: u64, state: &str, job: &Value) -> Result<()> {
    let why = job
        .get("events")
        .and_then(Value::as_array)
        .and_then(|e| e.last())
        .and_then(|e| e.get("message"))
        .and_then(Value::as_str)
        .map(gangway_core::text::printable)
        .unwrap_or_default();
    let code = match state {
        "succeeded" => return Ok(()),
        "cancelled" => EXIT_CANCELLED,
        "timeout" => EXIT_TIMEOUT,
        _ => crate::wait::exit_code(job),
    };
    Err(RunExit {
        code,
        message: format!("gangway run: job {id} {state}: {why}"),
    }
    .into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: RunArgs,
    }

    fn args(v: &[&str]) -> RunArgs {
        let mut all = vec!["run"];
        all.extend_from_slice(v);
        T::try_parse_from(all).expect("parse").a
    }

    #[test]
    fn slurm_times_parse() {
        assert_eq!(parse_slurm_time("30"), Ok(1800));
        assert_eq!(parse_slurm_time("5:30"), Ok(330));
        assert_eq!(parse_slurm_time("01:02:03"), Ok(3723));
        assert_eq!(parse_slurm_time("2-12"), Ok(2 * 86_400 + 12 * 3600));
        assert_eq!(parse_slurm_time("1-00:30:00"), Ok(86_400 + 1800));
        assert_eq!(parse_slurm_time("1h30m"), Ok(5400));
        for bad in ["", "0", "abc", "1:60", "1-25", "-3", "99999999999999999999"] {
            assert!(parse_slurm_time(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn flags_make_the_spec() {
        let a = args(&[
            "--gpus",
            "2",
            "--replicas",
            "3",
            "--gpu-model",
            "H100",
            "--time",
            "10",
            "--env",
            "A=b=c",
            "--mount",
            "/data:/d:ro",
            "--",
            "/usr/bin/python3",
            "-c",
            "print(1)",
        ]);
        let s = spec_from_flags(&a, "q1", Some("/home/u")).expect("spec");
        assert_eq!(s["name"], "python3");
        assert_eq!(s["queue"], "q1");
        assert_eq!(s["replicas"], 3);
        assert_eq!(s["resources"]["gpus"], 2);
        assert_eq!(s["resources"]["gpu_model"], "H100");
        assert_eq!(s["time_limit"], 600);
        assert_eq!(s["run"]["env"]["A"], "b=c");
        assert_eq!(s["run"]["mounts"][0]["read_only"], true);
        assert_eq!(s["run"]["workdir"], "/home/u");
        assert_eq!(s["restart"]["max_restarts"], 0);
        assert_eq!(
            s["run"]["command"],
            json!(["/usr/bin/python3", "-c", "print(1)"])
        );
        // The spec is one the core accepts.
        let _: gangway_core::job::JobSpec = serde_json::from_value(s).expect("a JobSpec");
    }

    #[test]
    fn ranks_per_node_is_one_replica_per_gpu() {
        let a = args(&["--nodes", "2", "--ranks-per-node", "4", "--", "true"]);
        let s = spec_from_flags(&a, "q", None).expect("spec");
        assert_eq!(s["replicas"], 8);
        assert_eq!(s["resources"]["gpus"], 1);
        let a = args(&["--nodes", "2", "--", "true"]);
        let s = spec_from_flags(&a, "q", None).expect("spec");
        assert_eq!(s["replicas"], 2);
        // No GPU: one core, so the spec asks for something.
        assert_eq!(s["resources"]["cpu_millis"], 1000);
        let a = args(&["--image", "busybox", "--", "true"]);
        let s = spec_from_flags(&a, "q", Some("/x")).expect("spec");
        assert!(s["run"].get("workdir").is_none());
        assert_eq!(s["run"]["image"], "busybox");
    }

    #[test]
    fn bad_flag_values_name_the_flag() {
        let cases: &[(&[&str], &str)] = &[
            (&["--time", "soon"], "--time"),
            (&["--env", "NOEQUALS"], "--env"),
            (&["--env", "1X=2"], "--env"),
            (&["--mount", "/a"], "--mount"),
            (&["--mount", "rel:/b"], "--mount"),
            (&["--cpus", "x"], "--cpus"),
            (&["--cpus", "0"], "--cpus"),
            (&["--replicas", "0"], "--replicas"),
            (
                &["--nodes", "65536", "--ranks-per-node", "65536"],
                "--nodes",
            ),
            (
                &["--replicas", "2", "--ranks-per-node", "2"],
                "--ranks-per-node",
            ),
        ];
        for (flags, name) in cases {
            let mut v: Vec<&str> = flags.to_vec();
            v.extend(["--", "true"]);
            let e = spec_from_flags(&args(&v), "q", None).expect_err("refused");
            assert!(e.to_string().contains(name), "{flags:?}: {e}");
        }
    }

    #[test]
    fn cpus_parse_as_millis() {
        assert_eq!(parse_cpus("2"), Ok(2000));
        assert_eq!(parse_cpus("0.5"), Ok(500));
        assert_eq!(parse_cpus("1.25"), Ok(1250));
        assert!(parse_cpus("1.2345").is_err());
        assert!(parse_cpus(".").is_err());
    }

    #[test]
    fn lines_are_labelled_and_partial_lines_wait() {
        let mut out = Vec::new();
        let mut st = RankStream::default();
        emit(&mut out, 1, &mut st, b"a\nb", true);
        assert_eq!(out, b"1: a\n");
        emit(&mut out, 1, &mut st, b"c\n", true);
        assert_eq!(out, b"1: a\n1: bc\n");
        let mut m = BTreeMap::new();
        let mut st = RankStream::default();
        emit(&mut out, 0, &mut st, b"tail", false);
        m.insert(0, st);
        flush_partials(&mut out, &mut m, false);
        assert_eq!(out, b"1: a\n1: bc\ntail\n");
        // A line without an end is cut at the bound.
        let mut out = Vec::new();
        let mut st = RankStream::default();
        emit(
            &mut out,
            0,
            &mut st,
            &vec![b'x'; MAX_PARTIAL_LINE + 1],
            true,
        );
        assert_eq!(out.len(), 3 + MAX_PARTIAL_LINE + 1 + 1);
        assert!(st.partial.is_empty());
    }
}
