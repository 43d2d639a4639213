//! The user-facing subcommands: `submit`, `queue`, `describe`/`why`, `cancel`,
//! `nodes`, `queues`, talking to the server's HTTP API.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde_json::Value;

/// How to print.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// A table for people.
    Table,
    /// JSON for scripts.
    Json,
    /// CSV (`gangway history` only).
    Csv,
    /// A wider table: ISO-8601 times and every detail.
    Wide,
}

/// Where the server is and who we are (every client command takes these;
/// `--help` lists them once, under "Connection").
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "Connection")]
pub struct Conn {
    /// Server address, or several replicas comma-separated (flag, then $GANGWAY_ADDR, then the config file, then http://127.0.0.1:7070).
    #[arg(long, global = true, env = "GANGWAY_ADDR")]
    pub addr: Option<String>,
    /// Bearer token (flag, then $GANGWAY_TOKEN, then the config file).
    #[arg(long, global = true, env = "GANGWAY_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// CLI config file with `addr:` and `token:` (default: $GANGWAY_CONFIG or ~/.config/gangway/cli.yaml).
    #[arg(long, global = true)]
    pub cli_config: Option<std::path::PathBuf>,
    /// Output format.
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// CA certificate (PEM) an `https://` server must be signed by (flag, then $GANGWAY_CA, then the config file).
    #[arg(long = "server-ca", global = true, env = "GANGWAY_CA")]
    pub server_ca: Option<std::path::PathBuf>,
}

/// The CLI config in the user's config directory:
/// `$XDG_CONFIG_HOME/gangway/cli.yaml`, else `~/.config/gangway/cli.yaml`.
pub fn default_cli_config() -> Option<std::path::PathBuf> {
    std::env::var_os("XDG_CONFIG_HOME")
        .filter(|x| !x.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".config")))
        .map(|d| d.join("gangway/cli.yaml"))
}

/// A token file others can read is a leaked token: say so (as ssh does).
fn warn_if_shared(p: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(m) = std::fs::metadata(p) {
        if m.permissions().mode() & 0o077 != 0 {
            eprintln!(
                "warning: {} is readable by other users; it holds your token (chmod 600 it)",
                p.display()
            );
        }
    }
}

/// Writes `text` to `path`, readable and writable by its owner only (0600),
/// creating the parent directory (0700) if needed.
pub fn write_private(path: &std::path::Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    // An existing file keeps its mode on open: set it.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}

/// How the CLI is given the cluster's CA (for certificate errors).
const CA_HOW: &str = "pass the cluster's CA certificate with --server-ca FILE or GANGWAY_CA=FILE, or `ca: FILE` in the CLI config (for `gangway up`: export GANGWAY_CONFIG=<its data dir>/cli.yaml, which names its ca.pem)";

/// The CLI's config file.
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CliFile {
    addr: Option<String>,
    token: Option<String>,
    /// CA certificate of an `https://` server.
    #[serde(default)]
    ca: Option<std::path::PathBuf>,
}

impl Conn {
    /// Fills address and token from the config file where flags and env left them unset.
    pub fn resolve(mut self) -> Result<Self> {
        let path = self
            .cli_config
            .clone()
            .or_else(|| std::env::var_os("GANGWAY_CONFIG").map(Into::into))
            .or_else(default_cli_config);
        let file = match &path {
            Some(p) if p.exists() => {
                warn_if_shared(p);
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading {}", p.display()))?;
                gangway_server::yaml::from_str::<CliFile>(&text)
                    .map_err(anyhow::Error::msg)
                    .with_context(|| format!("parsing {}", p.display()))?
            }
            _ => CliFile::default(),
        };
        self.addr = self
            .addr
            .or(file.addr)
            .or_else(|| Some("http://127.0.0.1:7070".into()));
        self.token = self.token.or(file.token).or_else(|| Some(String::new()));
        self.server_ca = self.server_ca.or(file.ca);
        if let Some(ca) = &self.server_ca {
            gangway_agent::tls::trust_ca(ca)
                .with_context(|| format!("loading the server's CA from {}", ca.display()))?;
        }
        Ok(self)
    }

    /// A connection to a local server (for `gangway up`).
    pub fn local(addr: &str, token: &str) -> Self {
        Conn {
            addr: Some(addr.to_string()),
            token: Some(token.to_string()),
            cli_config: None,
            output: Output::Table,
            server_ca: None,
        }
    }

    fn addr(&self) -> &str {
        self.addr.as_deref().unwrap_or("http://127.0.0.1:7070")
    }

    /// Server replicas: `--addr` may list several, comma-separated.
    fn addrs(&self) -> Vec<&str> {
        self.addr()
            .split(',')
            .map(|a| a.trim().trim_end_matches('/'))
            .filter(|a| !a.is_empty())
            .collect()
    }

    fn bearer(&self) -> String {
        format!("Bearer {}", self.token.as_deref().unwrap_or(""))
    }

    /// Sends to each replica in turn until one answers (a replica that is
    /// down, or has no leader to forward to, is skipped).
    fn send(
        &self,
        call: impl Fn(&str) -> Result<ureq::Response, Box<ureq::Error>>,
    ) -> Result<Value> {
        self.send_paged(call).map(|(v, _)| v)
    }

    /// Like `send`, with the answer's next-page cursor (`X-Next-Cursor`).
    fn send_paged(
        &self,
        call: impl Fn(&str) -> Result<ureq::Response, Box<ureq::Error>>,
    ) -> Result<(Value, Option<String>)> {
        let addrs = self.addrs();
        let mut last = None;
        for a in &addrs {
            match call(a).map_err(|e| *e) {
                Err(ureq::Error::Status(503, _)) | Err(ureq::Error::Transport(_))
                    if addrs.len() > 1 =>
                {
                    last = Some(*a);
                    continue;
                }
                r => return self.handle(r),
            }
        }
        bail!(
            "no server replica answered (last tried {})",
            last.unwrap_or("none")
        )
    }

    fn handle(&self, r: Result<ureq::Response, ureq::Error>) -> Result<(Value, Option<String>)> {
        match r {
            Ok(resp) => {
                let next = resp.header("x-next-cursor").map(str::to_string);
                let v = resp.into_json().context("decoding the server's answer")?;
                Ok((v, next))
            }
            Err(ureq::Error::Status(code, resp)) => {
                let body: Value = resp.into_json().unwrap_or(Value::Null);
                let msg = body
                    .get("error")
                    .and_then(Value::as_str)
                    .unwrap_or("no details");
                // Refusals quote what was sent: escaped, like every table.
                bail!(
                    "server answered {code}: {}",
                    gangway_core::text::printable(msg)
                )
            }
            Err(e) => {
                let hint = gangway_agent::tls::certificate_hint(&e.to_string(), CA_HOW)
                    .map(|h| format!(": {h}"))
                    .unwrap_or_default();
                Err(e).with_context(|| format!("cannot reach the server at {}{hint}", self.addr()))
            }
        }
    }

    /// GET a path.
    pub fn get(&self, path: &str) -> Result<Value> {
        self.send(|a| {
            gangway_agent::tls::http()
                .get(&format!("{a}{path}"))
                .set("Authorization", &self.bearer())
                .call()
                .map_err(Box::new)
        })
    }

    /// GET one page of a paged list: the page and the next page's cursor.
    pub fn get_page(&self, path: &str) -> Result<(Value, Option<String>)> {
        self.send_paged(|a| {
            gangway_agent::tls::http()
                .get(&format!("{a}{path}"))
                .set("Authorization", &self.bearer())
                .call()
                .map_err(Box::new)
        })
    }

    /// POST a body.
    pub fn post(&self, path: &str, content_type: &str, body: &str) -> Result<Value> {
        self.post_with_key(path, content_type, body, None)
    }

    /// POST a body with an idempotency key: retries (here, or to another
    /// replica after a failover) never create a second object.
    pub fn post_with_key(
        &self,
        path: &str,
        content_type: &str,
        body: &str,
        key: Option<&str>,
    ) -> Result<Value> {
        self.send(|a| {
            let mut r = gangway_agent::tls::http()
                .post(&format!("{a}{path}"))
                .set("Authorization", &self.bearer())
                .set("Content-Type", content_type);
            if let Some(k) = key {
                r = r.set("Idempotency-Key", k);
            }
            r.send_string(body).map_err(Box::new)
        })
    }

    /// A job id as typed (`12`, `5_7`) resolved to the job the server knows.
    pub fn job(&self, r: crate::jobref::JobRef) -> Result<crate::jobref::Target> {
        r.resolve_with(|id| self.get(&format!("/v1/jobs/{id}")))
    }

    /// DELETE a path.
    pub fn delete(&self, path: &str) -> Result<Value> {
        self.send(|a| {
            gangway_agent::tls::http()
                .delete(&format!("{a}{path}"))
                .set("Authorization", &self.bearer())
                .call()
                .map_err(Box::new)
        })
    }

    /// Prints `v` as JSON (`-o json`) or through `table`.
    pub fn print(&self, v: &Value, table: impl FnOnce(&Value) -> String) -> Result<()> {
        match self.output {
            Output::Json => println!("{}", serde_json::to_string_pretty(v)?),
            Output::Table | Output::Wide => print!("{}", table(&printable_value(v))),
            Output::Csv => bail!("-o csv is available for `gangway history` only"),
        }
        Ok(())
    }
}

/// `v` with every string in it (object keys too) escaped by
/// [`gangway_core::text::printable`]: what tables, `describe` and progress
/// lines render from, so no name, event message, log tail or reason a user
/// wrote reaches the terminal raw (an old record may hold a name from before
/// such names were refused). `-o json` prints the answer as it came.
pub(crate) fn printable_value(v: &Value) -> Value {
    use gangway_core::text::printable;
    match v {
        Value::String(s) => Value::String(printable(s).into_owned()),
        Value::Array(a) => Value::Array(a.iter().map(printable_value).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, v)| (printable(k).into_owned(), printable_value(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// A field for a table: strings bare, absent or null as `-`.
pub(crate) fn show(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(x)) => x.clone(),
        Some(Value::Null) | None => "-".into(),
        Some(x) => x.to_string(),
    }
}

/// Field `k` of `v`, for a table.
fn s(v: &Value, k: &str) -> String {
    show(v.get(k))
}

/// The value at JSON pointer `ptr` in `v`, for a table.
fn at(v: &Value, ptr: &str) -> String {
    show(v.pointer(ptr))
}

fn gpus(job: &Value) -> u64 {
    let r = job
        .pointer("/spec/replicas")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let g = job
        .pointer("/spec/resources/gpus")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    r * g
}

/// `gangway submit FILE`.
pub fn submit(
    c: &Conn,
    file: &std::path::Path,
    extra: &serde_json::Map<String, Value>,
) -> Result<()> {
    let v = post_spec(c, file, extra)?;
    c.print(&v, |v| format!("job {} submitted\n", s(v, "id")))
}

/// Submits a job file and returns its id.
pub fn submit_id(
    c: &Conn,
    file: &std::path::Path,
    extra: &serde_json::Map<String, Value>,
) -> Result<u64> {
    let v = post_spec(c, file, extra)?;
    v.get("id")
        .and_then(Value::as_u64)
        .context("the server's answer has no job id")
}

fn post_spec(
    c: &Conn,
    file: &std::path::Path,
    extra: &serde_json::Map<String, Value>,
) -> Result<Value> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let body = checked_spec(file, &text)?;
    // `submit --hold/--begin/--dependency/--array` override the spec's fields.
    let (ct, body) = with_fields("application/json", body, extra)?;
    let key = gangway_server::control::fresh_token();
    c.post_with_key("/v1/jobs", ct, &body, Some(&key))
}

/// Parses the job file against the server's own types, so an error names the
/// field and the line and column in the user's file (not in the JSON sent),
/// and returns it as JSON with the submission directory filled in.
pub fn checked_spec(file: &std::path::Path, text: &str) -> Result<String> {
    let parsed = if file.extension().is_some_and(|e| e == "json") {
        gangway_server::spec_parse::job_spec_from_json(text.as_bytes())
    } else {
        gangway_server::spec_parse::job_spec_from_yaml(text)
    };
    let mut spec = parsed.map_err(|e| anyhow::anyhow!(e.in_file(&file.display().to_string())))?;
    fill_submit_dir(&mut spec)?;
    Ok(serde_json::to_string(&spec)?)
}

/// The body with `extra` fields set (as JSON), or unchanged when there are none.
pub fn with_fields(
    content_type: &'static str,
    body: String,
    extra: &serde_json::Map<String, Value>,
) -> Result<(&'static str, String)> {
    if extra.is_empty() {
        return Ok((content_type, body));
    }
    let mut v: Value = if content_type == "application/json" {
        serde_json::from_str(&body).context("parsing the job spec")?
    } else {
        gangway_server::yaml::from_str(&body)
            .map_err(anyhow::Error::msg)
            .context("parsing the job spec")?
    };
    let Some(obj) = v.as_object_mut() else {
        bail!("the job spec is not a mapping");
    };
    for (k, x) in extra {
        obj.insert(k.clone(), x.clone());
    }
    Ok(("application/json", serde_json::to_string(&v)?))
}

/// Like `sbatch`, a job whose ranks run as processes starts in the directory
/// it was submitted from unless its spec names one.
fn fill_submit_dir(spec: &mut gangway_core::JobSpec) -> Result<()> {
    let run = &mut spec.run;
    if run.command.is_empty() || run.workdir.is_some() || run.image.is_some() {
        return Ok(());
    }
    let cwd = std::env::current_dir().context("finding the submission directory")?;
    run.workdir = Some(cwd.display().to_string());
    Ok(())
}

fn self_json(c: &Conn) -> bool {
    c.output == Output::Json
}

/// Which ranks `gangway logs` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ranks {
    /// One rank.
    One(u32),
    /// The first failing rank of the latest failed attempt.
    Failed,
    /// Every rank of the attempt.
    All,
}

/// `gangway logs JOB [--rank N | --failed | --all] [--attempt A] [--follow]`.
pub fn logs_of(c: &Conn, id: u64, which: Ranks, attempt: Option<u32>, follow: bool) -> Result<()> {
    match which {
        Ranks::One(rank) => logs(c, id, rank, attempt, follow),
        Ranks::Failed => {
            let job = c.get(&format!("/v1/jobs/{id}"))?;
            let Some(f) = job.get("failure").filter(|f| !f.is_null()) else {
                anyhow::bail!("job {id} has no failed rank");
            };
            let node = s(f, "node");
            let at = f.get("attempt").and_then(Value::as_u64).unwrap_or(0) as u32;
            let Some(rank) = f.get("rank").and_then(Value::as_u64) else {
                anyhow::bail!(
                    "job {id} attempt {at} failed on {node} (exit code {}), but the node did not say which rank",
                    s(f, "exit_code")
                );
            };
            println!(
                "==> job {id} attempt {} rank {rank} on {node}: exit code {} <==",
                attempt.unwrap_or(at),
                s(f, "exit_code")
            );
            logs(c, id, rank as u32, Some(attempt.unwrap_or(at)), follow)
        }
        Ranks::All => {
            let job = c.get(&format!("/v1/jobs/{id}"))?;
            let nodes: Vec<String> = job
                .get("ran_on")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|n| n.as_str().unwrap_or("").to_string())
                .collect();
            if nodes.is_empty() {
                anyhow::bail!("job {id} has not been placed yet: no logs");
            }
            for (rank, node) in nodes.iter().enumerate() {
                println!("==> rank {rank} on {node} <==");
                if let Err(e) = logs(c, id, rank as u32, attempt, false) {
                    println!("(no log: {e:#})");
                }
            }
            Ok(())
        }
    }
}

/// `gangway logs JOB [--rank N] [--attempt A] [--follow]`: prints a rank's
/// log; with `--follow`, keeps printing until the job ends.
pub fn logs(c: &Conn, id: u64, rank: u32, attempt: Option<u32>, follow: bool) -> Result<()> {
    use std::io::Write;
    let mut offset = 0u64;
    let mut attempt = attempt;
    loop {
        let job = c.get(&format!("/v1/jobs/{id}"))?;
        let state = s(&job, "state");
        let done = matches!(
            state.as_str(),
            "succeeded" | "failed" | "cancelled" | "timeout"
        );
        let latest = job
            .get("ran_attempt")
            .and_then(Value::as_u64)
            .map(|a| a as u32);
        if follow
            && attempt.is_some()
            && latest.is_some()
            && attempt != latest
            && job
                .get("ran_on")
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty())
        {
            // A new attempt started (restart or resume): follow it from its beginning.
            attempt = latest;
            offset = 0;
            println!("--- attempt {} ---", attempt.unwrap_or(0));
        }
        let mut path = format!("/v1/jobs/{id}/logs?rank={rank}&offset={offset}");
        if let Some(a) = attempt {
            path += &format!("&attempt={a}");
        }
        let chunk = match c.get(&path) {
            Ok(v) => v,
            Err(e) if follow && !done && e.to_string().contains("404") => {
                std::thread::sleep(std::time::Duration::from_millis(500));
                continue;
            }
            Err(e) => return Err(e),
        };
        let data = chunk.get("data").and_then(Value::as_str).unwrap_or("");
        let dropped = chunk.get("dropped").and_then(Value::as_u64).unwrap_or(0);
        if dropped > 0 && !self_json(c) {
            eprintln!(
                "[gangway] {dropped} bytes of older output were dropped by log rotation (the rank's log is capped)"
            );
        }
        if self_json(c) {
            // One JSON object per chunk (JSON lines): data and next_offset.
            if !data.is_empty() || offset == 0 {
                println!("{}", serde_json::to_string(&chunk)?);
            }
        } else {
            print!("{data}");
        }
        std::io::stdout().flush()?;
        offset = chunk
            .get("next_offset")
            .and_then(Value::as_u64)
            .unwrap_or(offset);
        if attempt.is_none() {
            attempt = latest;
        }
        if !follow || (done && data.is_empty()) {
            return Ok(());
        }
        if data.is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(500));
        }
    }
}

/// Seconds since the Unix epoch (the server's clock for estimates).
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `gangway describe ID` / `gangway why ID`.
pub fn describe(c: &Conn, id: u64, why_only: bool) -> Result<()> {
    let v = c.get(&format!("/v1/jobs/{id}"))?;
    c.print(&v, |j| {
        if why_only {
            let start = j
                .get("estimated_start")
                .and_then(Value::as_u64)
                .map(|t| {
                    format!(
                        "  estimated start {}\n",
                        crate::human::both(t, crate::human::now())
                    )
                })
                .unwrap_or_default();
            let code = j
                .get("reason_code")
                .and_then(Value::as_str)
                .map(|c| format!("{c}: "))
                .unwrap_or_default();
            return match j.get("reason").and_then(Value::as_str) {
                Some(r) => format!("job {id} ({}): {code}{r}\n{start}", s(j, "state")),
                None => format!(
                    "job {id} {}\n",
                    gangway_server::workflow::state_phrase(&s(j, "state"))
                ),
            };
        }
        let now = crate::human::now();
        let task = crate::jobref::array_label(j);
        let task = if task.is_empty() {
            task
        } else {
            format!(" (array task {task})")
        };
        let mut out = format!(
            "job {id}: {}{task}\n  queue {}  user {}  state {}  gpus {}\n",
            at(j, "/spec/name"),
            at(j, "/spec/queue"),
            s(j, "user"),
            crate::human::shown_state(j),
            gpus(j)
        );
        if let Some(t) = j.get("submitted_at").and_then(Value::as_u64) {
            out += &format!("  submitted {}\n", crate::human::both(t, now));
        }
        if let Some(r) = j.get("reason").and_then(Value::as_str) {
            let code = j.get("reason_code").and_then(Value::as_str).unwrap_or("-");
            out += &format!("  waiting: [{code}] {r}\n");
        }
        if let Some(t) = j.get("estimated_start").and_then(Value::as_u64) {
            let nodes: Vec<&str> = j
                .get("planned_nodes")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            out += &format!(
                "  estimated start {}{}\n",
                crate::human::both(t, now),
                if nodes.is_empty() {
                    String::new()
                } else {
                    format!(" on {}", nodes.join(","))
                }
            );
        }
        out += &contract_lines(j);
        let placement = j
            .get("placement")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        if !placement.is_empty() {
            out += "  placement:\n";
            for line in crate::human::rank_groups(&placement) {
                out += &format!("    {line}\n");
            }
        }
        out += &event_lines(j, now);
        out
    })
}

/// The `events:` part of `describe`: one line per event, a folded one with
/// its count and last time, and where the cap dropped some, how many.
fn event_lines(j: &Value, now: u64) -> String {
    let mut out = String::from("  events:\n");
    let dropped = j.get("events_dropped").and_then(Value::as_u64).unwrap_or(0);
    let events = j.get("events").and_then(Value::as_array);
    for (i, e) in events.into_iter().flatten().enumerate() {
        let when = e
            .get("at")
            .and_then(Value::as_u64)
            .map_or_else(|| "-".into(), |t| crate::human::both(t, now));
        let folded = match (
            e.get("count").and_then(Value::as_u64),
            e.get("last_at").and_then(Value::as_u64),
        ) {
            (Some(n), Some(last)) if n > 1 => {
                format!(" (×{n}, last at {})", crate::human::both(last, now))
            }
            _ => String::new(),
        };
        out += &format!(
            "    {when} {:<11} {}{folded}\n",
            s(e, "kind"),
            s(e, "message")
        );
        if dropped > 0 && i + 1 == gangway_server::records::EVENTS_KEPT_FIRST {
            out += &format!(
                "    ... {dropped} events dropped (a job keeps its first {} and its newest) ...\n",
                gangway_server::records::EVENTS_KEPT_FIRST
            );
        }
    }
    out
}

/// What `describe` says about the job contract: time limit, rendezvous,
/// last checkpoint and the first failing rank with its last log lines.
fn contract_lines(j: &Value) -> String {
    let mut out = String::new();
    if let Some(t) = j.pointer("/spec/time_limit").filter(|t| !t.is_null()) {
        let text = match t {
            Value::Number(n) => n
                .as_u64()
                .map_or_else(|| n.to_string(), gangway_core::format_time_span),
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        out += &format!("  time limit {text}\n");
    }
    if let Some(p) = j.get("master_port").and_then(Value::as_u64) {
        out += &format!("  rendezvous port {p}\n");
    }
    if let Some(c) = j.get("checkpoint").filter(|c| !c.is_null()) {
        out += &format!(
            "  last checkpoint: step {} at {} (attempt {}, reported by {})\n",
            s(c, "step"),
            s(c, "path"),
            s(c, "attempt"),
            s(c, "node")
        );
    }
    if let Some(f) = j.get("failure").filter(|f| !f.is_null()) {
        let rank = f
            .get("rank")
            .and_then(Value::as_u64)
            .map_or_else(|| "a rank".to_string(), |r| format!("rank {r}"));
        let mut how = format!("exit code {}", s(f, "exit_code"));
        if let Some(sig) = f.get("signal").and_then(Value::as_u64) {
            how += &format!(", signal {sig}");
        }
        if f.get("oom_killed") == Some(&Value::Bool(true)) {
            how += ", OOM-killed";
        }
        // The record is the latest failed attempt's; attempts are numbered
        // from 0 as in `logs --attempt` and the restart events.
        out += &format!(
            "  failed in attempt {}: {rank} on {} failed first ({how})\n",
            s(f, "attempt"),
            s(f, "node")
        );
        let tail: Vec<&str> = f
            .get("log_tail")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        if !tail.is_empty() {
            out += "  its last log lines:\n";
            for l in tail {
                out += &format!("    | {l}\n");
            }
        }
    }
    out
}

/// `gangway cancel ID`.
///
/// A job whose ranks run is `cancelling` until every node reports none of
/// its processes left (they get the checkpoint signal and at most 10 s);
/// with `wait`, returns once it is `cancelled` (or ended otherwise).
pub fn cancel(c: &Conn, t: crate::jobref::Target, wait: bool) -> Result<()> {
    let id = t.id;
    let v = c.post(
        &format!("/v1/jobs/{id}/cancel{}", t.query()),
        "application/json",
        "",
    )?;
    // An array's id cancels every task.
    let ids: Vec<u64> = match v.get("jobs").and_then(Value::as_array) {
        Some(a) if !a.is_empty() => a.iter().filter_map(Value::as_u64).collect(),
        _ => vec![id],
    };
    let now_state = |id: u64| -> Result<(String, Value)> {
        let j = c.get(&format!("/v1/jobs/{id}"))?;
        Ok((crate::human::shown_state(&j), j))
    };
    let (state, job) = now_state(id)?;
    c.print(&v, |_| match state.as_str() {
        "cancelling" => {
            let why = job
                .get("events")
                .and_then(Value::as_array)
                .and_then(|e| {
                    e.iter()
                        .rev()
                        .find(|e| e.get("kind").and_then(Value::as_str) == Some("cancelling"))
                })
                .map(|e| format!(" ({})", s(e, "message")))
                .unwrap_or_default();
            format!("job {id} cancelling{why}\n")
        }
        other => format!("job {id} {other}\n"),
    })?;
    if !wait {
        return Ok(());
    }
    let mut left = ids;
    while !left.is_empty() {
        let mut still = Vec::new();
        for id in left {
            let (state, _) = now_state(id)?;
            if matches!(
                state.as_str(),
                "cancelled" | "succeeded" | "failed" | "timeout"
            ) {
                if c.output != Output::Json {
                    println!("job {id} {state}");
                }
            } else {
                still.push(id);
            }
        }
        left = still;
        if !left.is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }
    Ok(())
}

/// `gangway nodes`.
pub fn nodes(c: &Conn) -> Result<()> {
    let v = c.get("/v1/nodes")?;
    c.print(&v, |v| {
        let mut out = format!(
            "{:<16} {:<10} {:>5} {:>5} {:>9}  {:<16} {}\n",
            "NODE", "LEAF", "GPUS", "USED", "UNHEALTHY", "STATUS", "LAST SEEN"
        );
        let now = crate::human::now();
        for n in v.as_array().into_iter().flatten() {
            let g = n
                .get("gpus")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            let used = g
                .iter()
                .filter(|x| x.get("allocated") == Some(&Value::Bool(true)))
                .count();
            let bad = g
                .iter()
                .filter(|x| x.get("healthy") == Some(&Value::Bool(false)))
                .count();
            let status = if n.get("pending_approval") == Some(&Value::Bool(true)) {
                "PendingApproval"
            } else if n.get("ready") == Some(&Value::Bool(false)) {
                "NotReady"
            } else if n.get("cordoned") == Some(&Value::Bool(true)) {
                "Cordoned"
            } else {
                "Ready"
            };
            let seen = n
                .get("last_heartbeat")
                .and_then(Value::as_u64)
                .map_or_else(|| "-".into(), |t| crate::human::relative(t, now));
            out += &format!(
                "{:<16} {:<10} {:>5} {:>5} {:>9}  {status:<16} {seen}\n",
                s(n, "name"),
                s(n, "leaf"),
                g.len(),
                used,
                bad
            );
            if let Some(why) = n.get("cordon_reason").and_then(Value::as_str) {
                // Why, with an auto-cordon's evidence and probation state.
                out += &format!("  Cordoned: {why}\n");
            }
            out += &gpu_lines(&g);
        }
        out
    })
}

/// Under a node's line: its GPUs' full model name and memory, MIG GPUs,
/// and each unhealthy GPU with the reason.
fn gpu_lines(g: &[Value]) -> String {
    let mut out = String::new();
    let mut kinds: Vec<String> = Vec::new();
    for x in g {
        let k = format!(
            "{} {} MiB",
            s(x, "model"),
            x.get("memory_mib")
                .and_then(Value::as_u64)
                .unwrap_or_else(|| x.get("memory_gib").and_then(Value::as_u64).unwrap_or(0) * 1024)
        );
        if !kinds.contains(&k) {
            kinds.push(k);
        }
    }
    if !kinds.is_empty() {
        out += &format!("  GPUs: {}\n", kinds.join("; "));
    }
    let mig: Vec<String> = g
        .iter()
        .filter(|x| x.get("mig") == Some(&Value::Bool(true)))
        .map(|x| x.get("index").map(Value::to_string).unwrap_or_default())
        .collect();
    if !mig.is_empty() {
        out += &format!(
            "  MIG enabled (never assigned whole): GPUs {}\n",
            mig.join(",")
        );
    }
    for x in g {
        if x.get("healthy") == Some(&Value::Bool(false)) {
            let why = x
                .get("reason")
                .and_then(Value::as_str)
                .unwrap_or("no reason recorded");
            out += &format!(
                "  GPU {} unhealthy: {why}\n",
                x.get("index").map(Value::to_string).unwrap_or_default()
            );
        }
    }
    out
}

/// `gangway nodes approve|cordon|drain|uncordon|delete NAME` (admin).
pub fn node_action(c: &Conn, action: &str, name: &str) -> Result<()> {
    let v = c.post(
        &format!("/v1/nodes/{name}/{action}"),
        "application/json",
        "",
    )?;
    let done = match action {
        "approve" => "approved",
        "cordon" => "cordoned",
        "drain" => "drained (cordoned: running gangs finish, nothing new starts)",
        "uncordon" => "uncordoned",
        "delete" => "deleted",
        other => other,
    };
    c.print(&v, |_| format!("node {name} {done}\n"))
}

/// `gangway audit [--since T] [--limit N]` (admin): the audit log.
pub fn audit(c: &Conn, since: Option<u64>, limit: Option<usize>) -> Result<()> {
    let mut q = Vec::new();
    if let Some(s) = since {
        q.push(format!("since={s}"));
    }
    if let Some(l) = limit {
        q.push(format!("limit={l}"));
    }
    let v = c.get(&format!("/v1/audit?{}", q.join("&")))?;
    c.print(&v, |v| {
        let mut out = format!(
            "{:<20} {:<16} {:<40} {:<20} {}\n",
            "AT", "WHO", "ACTION", "TARGET", "RESULT"
        );
        for e in v.as_array().into_iter().flatten() {
            out += &format!(
                "{:<20} {:<16} {:<40} {:<20} {} {}\n",
                e.get("at")
                    .and_then(Value::as_u64)
                    .map_or_else(|| "-".into(), crate::human::iso),
                s(e, "who"),
                s(e, "action"),
                e.get("target").and_then(Value::as_str).unwrap_or("-"),
                at(e, "/status"),
                s(e, "result")
            );
        }
        out
    })
}

/// `gangway queues`.
pub fn queues(c: &Conn) -> Result<()> {
    let v = c.get("/v1/queues")?;
    c.print(&v, |v| {
        let mut out = format!(
            "{:<16} {:<12} {:>8} {:>8} {:>9}\n",
            "QUEUE", "PARENT", "GPUS", "NOMINAL", "BORROW"
        );
        for q in v.as_array().into_iter().flatten() {
            out += &format!(
                "{:<16} {:<12} {:>8} {:>8} {:>9}\n",
                s(q, "name"),
                s(q, "parent"),
                q.pointer("/usage/gpus")
                    .map_or("0".into(), |x| x.to_string()),
                at(q, "/quota/nominal/gpus"),
                at(q, "/quota/borrowing_limit/gpus"),
            );
        }
        out
    })
}

/// `gangway usage`.
pub fn usage(c: &Conn, from: Option<u64>, to: Option<u64>) -> Result<()> {
    let mut q = Vec::new();
    if let Some(f) = from {
        q.push(format!("from={f}"));
    }
    if let Some(t) = to {
        q.push(format!("to={t}"));
    }
    let v = c.get(&format!("/v1/usage?{}", q.join("&")))?;
    c.print(&v, |v| {
        let span = |k: &str| {
            v.get(k)
                .and_then(Value::as_u64)
                .map_or_else(|| "-".into(), crate::human::iso)
        };
        let mut out = format!("from {} to {}\n", span("from"), span("to"));
        out += "GPU-hours by queue:\n";
        for (k, h) in v["gpu_hours_by_queue"].as_object().into_iter().flatten() {
            out += &format!("  {k:<16} {:>10.2}\n", h.as_f64().unwrap_or(0.0));
        }
        out += "GPU-hours by user:\n";
        for (k, h) in v["gpu_hours_by_user"].as_object().into_iter().flatten() {
            out += &format!("  {k:<16} {:>10.2}\n", h.as_f64().unwrap_or(0.0));
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn describe_names_the_attempt_that_failed_as_logs_and_events_number_it() {
        // Attempt 0 failed and restarted; attempt 1 failed too: the record is attempt 1's.
        let j = json!({ "failure": {
            "attempt": 1, "node": "n-a", "rank": 0, "exit_code": 1, "log_tail": []
        }});
        let text = super::contract_lines(&j);
        assert_eq!(
            text,
            "  failed in attempt 1: rank 0 on n-a failed first (exit code 1)\n"
        );
        assert!(!text.contains("first failure"), "{text}");
    }

    #[test]
    fn folded_events_show_their_count_and_dropped_ones_are_counted() {
        let mut events = vec![json!({"at": 100, "kind": "submitted", "message": "submitted"})];
        events.push(json!({
            "at": 110, "kind": "rendezvous", "message": "port 29401 moved",
            "count": 37, "last_at": 200
        }));
        let j = json!({ "events": events.clone() });
        let text = super::event_lines(&j, 300);
        assert!(text.contains("port 29401 moved (×37, last at "), "{text}");
        assert!(!text.contains("dropped"), "{text}");
        let many: Vec<_> = (0..60)
            .map(|i| json!({"at": i, "kind": format!("k{}", i % 2), "message": "x"}))
            .collect();
        let text = super::event_lines(&json!({ "events": many, "events_dropped": 9800 }), 300);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1 + 60 + 1, "{text}");
        assert!(
            lines[1 + gangway_server::records::EVENTS_KEPT_FIRST].contains("9800 events dropped"),
            "{text}"
        );
    }
}
