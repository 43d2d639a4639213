//! `gangway`: one binary for Gangway's subcommands.

mod admin_cmd;
mod client;
mod gpu_check;
mod human;
mod jobref;
mod local;
mod policy_cmd;
mod queue;
mod reservation;
mod run_cmd;
mod sim;
mod wait;
mod workflow;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// mimalloc instead of glibc's malloc: the server allocates and frees
/// small objects on many threads (requests, records, views), and glibc's
/// arenas took ~22 % of the server's samples under `gangway-bench cluster`
/// (`_int_malloc`, `malloc_consolidate`, `unlink_chunk`, `_int_free`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Gangway: a GPU cluster scheduler for gangs of ranks.
#[derive(Parser)]
#[command(name = "gangway", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    conn: client::Conn,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the control-plane server (API, scheduler loop, metrics).
    Server {
        /// Configuration file (YAML: tokens, users, queues).
        #[arg(long)]
        config: PathBuf,
        /// Where the store lives.
        #[arg(long, default_value = "gangway-data")]
        data_dir: PathBuf,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:7070")]
        listen: String,
        /// etcd endpoints (comma-separated): run as one of several replicas
        /// on etcd instead of on the embedded store in --data-dir.
        #[arg(long, value_delimiter = ',')]
        etcd: Vec<String>,
        /// Key prefix of this cluster in etcd.
        #[arg(long, default_value = "/gangway")]
        etcd_namespace: String,
        /// URL other replicas forward requests to when this one leads
        /// (default: http://<listen address>).
        #[arg(long)]
        advertise: Option<String>,
        /// Log as JSON lines (for log shippers); the filter is $RUST_LOG (default info).
        #[arg(long)]
        log_json: bool,
        /// Also serve /metrics without a token on this address (bind it to
        /// an interface only the monitoring network reaches).
        #[arg(long)]
        metrics_listen: Option<String>,
        /// TLS for the API (and `--ca`, which agents' log endpoints and
        /// other replicas must be signed by).
        #[command(flatten)]
        tls: local::TlsArgs,
        /// Start even though several users run as one Unix account: their
        /// ranks are then not isolated from each other (see docs/SECURITY.md).
        #[arg(long)]
        allow_shared_account: bool,
    },
    /// Runs a node agent: registers the node, runs the ranks the server assigns.
    Agent(Box<local::AgentArgs>),
    /// Starts a local cluster: a server and N agents with declared GPUs.
    Up(Box<local::UpArgs>),
    /// Prints a rank's log (rank 0 unless told otherwise).
    Logs {
        /// Job id, or an array task's `ID_INDEX` (`5_7`).
        id: jobref::JobRef,
        /// Rank.
        #[arg(long, conflicts_with_all = ["failed", "all"])]
        rank: Option<u32>,
        /// The first rank that failed (its attempt and node).
        #[arg(long, conflicts_with = "all")]
        failed: bool,
        /// Every rank, one after another, each under a header.
        #[arg(long, conflicts_with = "follow")]
        all: bool,
        /// Attempt (default: the latest).
        #[arg(long)]
        attempt: Option<u32>,
        /// Keep printing until the job ends.
        #[arg(long, short = 'f')]
        follow: bool,
    },
    /// Runs a command on a gang without a job file and streams every rank's
    /// output (`srun`): `gangway run --gpus 1 -- nvidia-smi -L`.
    Run(Box<run_cmd::RunArgs>),
    /// Submits a job spec (YAML or JSON).
    Submit {
        /// The job file.
        file: PathBuf,
        #[command(flatten)]
        workflow: workflow::SubmitFlags,
        /// Follow the job until it ends (a line at each change: why it
        /// waits, where it runs, how it ended) and exit with its outcome:
        /// 0 when it succeeds, else its failing rank's exit code or 1.
        #[arg(long)]
        wait: bool,
    },
    /// Holds a pending job: it does not start until released.
    Hold {
        /// Job id, or an array task's `ID_INDEX` (`5_7`).
        id: jobref::JobRef,
    },
    /// Releases a held job.
    Release {
        /// Job id, or an array task's `ID_INDEX` (`5_7`).
        id: jobref::JobRef,
    },
    /// Changes a pending job's priority, time limit, queue or name.
    Update(workflow::UpdateArgs),
    /// Lists finished jobs with start, end, nodes, exit code and GPU-hours (`sacct`).
    History(workflow::HistoryArgs),
    /// Prints the API's OpenAPI document (what `/openapi.json` serves).
    Openapi,
    /// Prints a shell completion script: `source <(gangway completions bash)`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Lists the jobs that have not ended (`--all`: every job).
    Queue(queue::QueueArgs),
    /// Shows a job, its events and why it waits.
    Describe {
        /// Job id, or an array task's `ID_INDEX` (`5_7`).
        id: jobref::JobRef,
    },
    /// Says why a job waits.
    Why {
        /// Job id, or an array task's `ID_INDEX` (`5_7`).
        id: jobref::JobRef,
    },
    /// Cancels a job: prints `cancelling` while its ranks get the checkpoint
    /// signal and at most 10 s to stop, `cancelled` once none is left.
    Cancel {
        /// Job id, or an array task's `ID_INDEX` (`5_7`).
        id: jobref::JobRef,
        /// Wait until the job is `cancelled` (no process of it left).
        #[arg(long)]
        wait: bool,
    },
    /// Lists nodes and their GPUs; with an action, changes one (admin).
    Nodes {
        #[command(subcommand)]
        action: Option<NodeAction>,
    },
    /// Prints the audit log: every state-changing call, who made it and its result (admin).
    Audit {
        /// Only entries at or after this time: ISO-8601, a span before now (`2h`) or epoch seconds.
        #[arg(long, value_parser = human::parse_when)]
        since: Option<u64>,
        /// At most this many (the latest).
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Lists queues with usage and quota.
    Queues,
    /// GPU-hours per queue and user over a time range.
    Usage {
        /// Start: ISO-8601, a span before now (`7d`) or epoch seconds.
        #[arg(long, value_parser = human::parse_when)]
        from: Option<u64>,
        /// End: ISO-8601, a span before now or epoch seconds (default: now).
        #[arg(long, value_parser = human::parse_when)]
        to: Option<u64>,
    },
    /// Maintenance reservations: nodes that run nothing in a window (admins
    /// create and delete; anyone lists).
    Reservation {
        #[command(subcommand)]
        action: reservation::Action,
    },
    /// Replays a real cluster trace through the scheduling core and compares policies.
    Sim(sim::SimArgs),
    /// Whole-store backup and restore (rollback paths for Gangway itself).
    Admin {
        #[command(subcommand)]
        cmd: admin_cmd::AdminCmd,
    },
    /// Prints Prometheus alert rules (SLO breach, wait drift after a policy
    /// change, run-time prediction drift) for `rule_files:`.
    Alerts,
    /// The versioned scheduling policy: show, diff, what-if, apply, rollback, log.
    Policy {
        #[command(subcommand)]
        cmd: policy_cmd::PolicyCmd,
    },
}

/// What an admin does to a node.
#[derive(Subcommand)]
enum NodeAction {
    /// Lets a node that joined with the join token run work.
    Approve {
        /// Node name.
        name: String,
    },
    /// No new work on the node; what runs keeps running.
    Cordon {
        /// Node name.
        name: String,
    },
    /// Cordons the node so its running gangs finish and nothing new starts.
    Drain {
        /// Node name.
        name: String,
    },
    /// Lets the node take new work again.
    Uncordon {
        /// Node name.
        name: String,
    },
    /// Removes the node: its gangs restart elsewhere and its token stops working.
    Delete {
        /// Node name.
        name: String,
    },
}

/// How a server replica on etcd is set up.
struct Replica {
    etcd: Vec<String>,
    namespace: String,
    advertise: Option<String>,
}

/// Logs through `tracing` to stderr: `$RUST_LOG` filters (default info),
/// `json` writes one JSON object per line.
fn init_server_tracing(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if json {
        b.json().try_init()
    } else {
        b.try_init()
    };
}

fn server(
    config: &std::path::Path,
    data_dir: &std::path::Path,
    listen: &str,
    metrics_listen: Option<&str>,
    ha: Option<Replica>,
    tls: &local::TlsArgs,
    allow_shared_account: bool,
) -> Result<()> {
    let tls = tls.apply()?;
    let text =
        std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let cfg = gangway_server::ServerConfig::from_yaml(&text)
        .with_context(|| format!("in {}", config.display()))?;
    if let Some(why) =
        gangway_server::config::shared_account_refusal(&cfg, "--allow-shared-account")
    {
        if !allow_shared_account {
            anyhow::bail!("in {}: {why}", config.display());
        }
        tracing::warn!("{why} (accepted with --allow-shared-account)");
    }
    // Queues promising their parent more than it has: known now; quotas
    // past the cluster's size are checked once nodes have registered.
    for why in gangway_server::config::quota_overcommit(&cfg, u64::MAX) {
        tracing::warn!("in {}: {why}", config.display());
    }
    let etcd = match &ha {
        Some(r) => Some(
            gangway_store::EtcdStore::connect(&r.etcd, &r.namespace)
                .with_context(|| format!("connecting to etcd at {}", r.etcd.join(",")))?,
        ),
        None => None,
    };
    let app = match &etcd {
        Some(e) => {
            // The store is etcd; the audit log stays in this replica's data dir.
            gangway_server::private_dir(data_dir)?;
            let audit = gangway_server::audit::AuditLog::open(&data_dir.join("audit.log"))?;
            gangway_server::backup::prepare(e, Some(data_dir), gangway_server::clock::now())?;
            let app = gangway_server::open_with_audit(
                cfg,
                std::sync::Arc::new(e.clone()),
                gangway_server::ha::Role::Follower(None),
                audit,
            )?;
            let _ = app.export_dir.set(data_dir.join("history"));
            app
        }
        None => gangway_server::open(cfg, data_dir)?,
    };
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("listening on {listen}"))?;
        let local = listener.local_addr()?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        eprintln!("gangway server listening on {scheme}://{local}");
        tokio::spawn(warn_quota_overcommit(app.clone()));
        tracing::info!("gangway server listening on {scheme}://{local}");
        if let Some(m) = metrics_listen {
            let l = tokio::net::TcpListener::bind(m)
                .await
                .with_context(|| format!("listening on {m} for metrics"))?;
            tracing::info!(
                "metrics without a token on http://{}/metrics",
                l.local_addr()?
            );
            tokio::spawn(gangway_server::serve_metrics(app.clone(), l));
        }
        match (etcd, ha, tls) {
            (Some(e), Some(r), tls) => {
                let advertise = r.advertise.unwrap_or_else(|| format!("{scheme}://{local}"));
                match tls {
                    Some(cfg) => {
                        let l = gangway_agent::tls::TlsListener::new(listener, cfg)?;
                        gangway_server::serve_replica(app, l, e, advertise).await?
                    }
                    None => gangway_server::serve_replica(app, listener, e, advertise).await?,
                }
            }
            (_, _, Some(cfg)) => {
                let l = gangway_agent::tls::TlsListener::new(listener, cfg)?;
                gangway_server::serve_on(app, l).await?
            }
            _ => gangway_server::serve(app, listener).await?,
        }
        Ok(())
    })
}

/// How long the registered nodes' GPU count must stay the same before the
/// quotas are checked against it (nodes of a starting cluster join one by one).
const CAPACITY_SETTLE: std::time::Duration = std::time::Duration::from_secs(10);

/// `server`: warns when the configured nominal GPU quotas add up to more
/// than the registered nodes have, once their count has settled and again
/// each time it changes and settles (each distinct warning once).
async fn warn_quota_overcommit(app: std::sync::Arc<gangway_server::http::common::App>) {
    let mut last = (0u64, 0usize);
    let mut since = std::time::Instant::now();
    let mut checked = None;
    let mut warned = std::collections::HashSet::new();
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let view = app.control.view();
        let gpus = view
            .cluster
            .nodes
            .iter()
            .map(|n| n.spec.gpus.len() as u64)
            .fold(0u64, u64::saturating_add);
        let now = (gpus, view.cluster.nodes.len());
        if now != last {
            last = now;
            since = std::time::Instant::now();
            continue;
        }
        if now.1 == 0 || checked == Some(now) || since.elapsed() < CAPACITY_SETTLE {
            continue;
        }
        checked = Some(now);
        for why in gangway_server::config::quota_overcommit(&app.cfg, gpus) {
            if warned.insert(why.clone()) {
                tracing::warn!(
                    "{why} (the {gpus} GPUs of the {} nodes registered so far); guarantees past the cluster's size cannot all be met",
                    now.1
                );
            }
        }
    }
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) if e.downcast_ref::<run_cmd::RunExit>().is_some() => {
            let code = e.downcast_ref::<run_cmd::RunExit>().map_or(1, |o| o.code);
            eprintln!("{e}");
            std::process::ExitCode::from(code)
        }
        Err(e) if e.downcast_ref::<wait::JobOutcome>().is_some() => {
            let code = e.downcast_ref::<wait::JobOutcome>().map_or(1, |o| o.code);
            eprintln!("{e}");
            std::process::ExitCode::from(code)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The commands as a user looks for them, in `--help` order. Every command
/// is in exactly one group (a unit test checks it).
const GROUPS: &[(&str, &[&str])] = &[
    (
        "Jobs",
        &[
            "submit", "run", "queue", "describe", "why", "logs", "cancel", "hold", "release",
            "update", "history",
        ],
    ),
    ("Cluster", &["nodes", "queues", "usage", "reservation"]),
    ("Admin", &["policy", "admin", "audit", "alerts"]),
    ("Daemons", &["server", "agent", "up"]),
    ("Tools", &["sim", "openapi", "completions", "help"]),
];

/// Two examples for each command's `--help` (a unit test checks that every
/// command has them).
const EXAMPLES: &[(&str, [&str; 2])] = &[
    (
        "run",
        [
            "gangway run --gpus 1 -- nvidia-smi -L",
            "gangway run --nodes 2 --ranks-per-node 8 --time 2:00:00 -- torchrun train.py",
        ],
    ),
    (
        "submit",
        [
            "gangway submit examples/job.yaml",
            "gangway submit job.yaml --array 0-99%4 --wait",
        ],
    ),
    (
        "queue",
        ["gangway queue --me", "gangway queue --start -q research"],
    ),
    (
        "describe",
        [
            "gangway describe 12",
            "gangway describe 5_7          # task 7 of array 5",
        ],
    ),
    ("why", ["gangway why 12", "gangway why 5_3"]),
    ("logs", ["gangway logs 12 -f", "gangway logs 5_7 --failed"]),
    (
        "cancel",
        [
            "gangway cancel 5_7          # one task of array 5",
            "gangway cancel 5 --wait     # the whole array",
        ],
    ),
    (
        "hold",
        [
            "gangway hold 12",
            "gangway hold 5               # every pending task of array 5",
        ],
    ),
    ("release", ["gangway release 12", "gangway release 5_3"]),
    (
        "update",
        [
            "gangway update 12 --time-limit 2h",
            "gangway update 12 --queue research --name retry",
        ],
    ),
    (
        "history",
        [
            "gangway history --since 7d",
            "gangway history -o csv > jobs.csv",
        ],
    ),
    ("nodes", ["gangway nodes", "gangway nodes drain gpu-07"]),
    ("queues", ["gangway queues", "gangway queues -o json"]),
    (
        "usage",
        [
            "gangway usage --from 7d",
            "gangway usage --from 2026-12-01T00:00:00Z --to 1d",
        ],
    ),
    (
        "reservation",
        [
            "gangway reservation list",
            "gangway reservation create --name bios --nodes gpu-01 --start now+1h --duration 2h",
        ],
    ),
    (
        "policy",
        [
            "gangway policy show",
            "gangway policy what-if candidate.yaml",
        ],
    ),
    (
        "admin",
        [
            "gangway admin backup store.backup",
            "gangway admin backup store.backup --data-dir /var/lib/gangway",
        ],
    ),
    (
        "audit",
        [
            "gangway audit --since 2h",
            "gangway audit --limit 20 -o json",
        ],
    ),
    (
        "alerts",
        [
            "gangway alerts > gangway-rules.yaml",
            "gangway alerts | promtool check rules /dev/stdin",
        ],
    ),
    (
        "server",
        [
            "gangway server --config examples/server.yaml",
            "gangway server --config server.yaml --listen 0.0.0.0:7070 --data-dir /var/lib/gangway",
        ],
    ),
    (
        "agent",
        [
            "gangway agent --server https://head:7070 --join-token TOKEN --node gpu-01",
            "gangway agent --check",
        ],
    ),
    (
        "up",
        [
            "gangway up",
            "gangway up --nodes 2 --gpus-per-node 8 --config examples/server.yaml",
        ],
    ),
    (
        "sim",
        [
            "gangway sim --trace trace.csv",
            "gangway sim --trace trace.csv --out report",
        ],
    ),
    (
        "openapi",
        [
            "gangway openapi > openapi.json",
            "gangway openapi | jq '.paths | keys'",
        ],
    ),
    (
        "completions",
        [
            "source <(gangway completions bash)",
            "gangway completions zsh > ~/.zfunc/_gangway",
        ],
    ),
];

/// The CLI with its commands listed by [`GROUPS`] in `--help` (clap lists
/// subcommands under one heading only, so the list is written here).
fn cli_command() -> clap::Command {
    use clap::CommandFactory;
    let mut cmd = Cli::command();
    for (name, lines) in EXAMPLES {
        let text = format!("Examples:\n  {}\n  {}", lines[0], lines[1]);
        cmd = cmd.mut_subcommand(*name, |c| c.after_help(text));
    }
    cmd.build();
    let width = GROUPS
        .iter()
        .flat_map(|(_, names)| names.iter().map(|n| n.len()))
        .max()
        .unwrap_or(0);
    let mut list = String::new();
    for (heading, names) in GROUPS {
        list += &format!("{heading}:\n");
        for name in *names {
            let about = cmd
                .find_subcommand(name)
                .and_then(|c| c.get_about())
                .map(|a| a.to_string())
                .unwrap_or_default();
            list += &format!("  {name:width$}  {about}\n");
        }
        list += "\n";
    }
    cmd.help_template(format!(
        "{{about-with-newline}}\n{{usage-heading}} {{usage}}\n\n{list}Options:\n{{options}}{{after-help}}"
    ))
}

/// A client command piped into `head` ends as coreutils do when `head`
/// exits: killed by SIGPIPE (status 141), with no `Broken pipe` error or
/// panic. Rust ignores SIGPIPE by default; the daemons keep that (a closed
/// socket or rank pipe must not kill them). The CLI's own sockets are
/// unaffected: std writes them with `MSG_NOSIGNAL`.
fn quiet_on_closed_pipe() {
    // SAFETY: sets a signal's disposition to the default; no handler runs
    // Rust code, and nothing else in the process changes SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn run() -> Result<()> {
    use clap::FromArgMatches;
    let matches = cli_command().get_matches();
    let cli = Cli::from_arg_matches(&matches)?;
    if !matches!(
        cli.command,
        Command::Up(_) | Command::Server { .. } | Command::Agent(_)
    ) {
        quiet_on_closed_pipe();
    }
    if let Command::Completions { shell } = cli.command {
        let mut cmd = cli_command();
        clap_complete::generate(shell, &mut cmd, "gangway", &mut std::io::stdout());
        return Ok(());
    }
    // A flag accepted and ignored is a surprise: the daemons print logs.
    let daemon = matches!(
        cli.command,
        Command::Up(_) | Command::Server { .. } | Command::Agent(_)
    );
    if daemon && cli.conn.output != client::Output::Table {
        anyhow::bail!(
            "--output is for the client commands; `up`, `server` and `agent` print logs (see --log-json)"
        );
    }
    if daemon {
        // The client's connection flags mean nothing to a daemon: refuse them
        // when typed (the environment may set them for the client commands).
        let sub = matches.subcommand().map(|(_, m)| m);
        for (id, flag) in [
            ("addr", "--addr"),
            ("token", "--token"),
            ("cli_config", "--cli-config"),
            ("server_ca", "--server-ca"),
        ] {
            let typed = [Some(&matches), sub]
                .into_iter()
                .flatten()
                .any(|m| m.value_source(id) == Some(clap::parser::ValueSource::CommandLine));
            if typed {
                anyhow::bail!(
                    "{flag} is for the client commands; `up`, `server` and `agent` take their own flags (see --help)"
                );
            }
        }
    }
    // A daemon trusts only the CA its own flags name (or, for `up`, the CA
    // it creates): never one from the client's environment or config file.
    let conn = if daemon {
        cli.conn.clone()
    } else {
        cli.conn.clone().resolve()?
    };
    let c = &conn;
    match cli.command {
        Command::Server {
            config,
            data_dir,
            listen,
            etcd,
            etcd_namespace,
            advertise,
            log_json,
            metrics_listen,
            tls,
            allow_shared_account,
        } => {
            init_server_tracing(log_json);
            let ha = (!etcd.is_empty()).then_some(Replica {
                etcd,
                namespace: etcd_namespace,
                advertise,
            });
            server(
                &config,
                &data_dir,
                &listen,
                metrics_listen.as_deref(),
                ha,
                &tls,
                allow_shared_account,
            )
        }
        Command::Agent(a) => local::agent(&a),
        Command::Up(a) => local::up(&a),
        Command::Logs {
            id,
            rank,
            failed,
            all,
            attempt,
            follow,
        } => {
            let which = match (failed, all) {
                (true, _) => client::Ranks::Failed,
                (_, true) => client::Ranks::All,
                _ => client::Ranks::One(rank.unwrap_or(0)),
            };
            client::logs_of(c, c.job(id)?.id, which, attempt, follow)
        }
        Command::Hold { id } => workflow::hold(c, c.job(id)?),
        Command::Release { id } => workflow::release(c, c.job(id)?),
        Command::Update(a) => workflow::update(c, &a),
        Command::History(a) => workflow::history(c, &a),
        Command::Submit {
            file,
            workflow,
            wait: false,
        } => client::submit(c, &file, &workflow.fields()),
        Command::Submit {
            file,
            workflow,
            wait: true,
        } => {
            let id = client::submit_id(c, &file, &workflow.fields())?;
            eprintln!("job {id} submitted");
            wait::wait(c, id, std::time::Duration::from_millis(500))
        }
        Command::Run(a) => run_cmd::run(c, &a),
        Command::Completions { .. } => Ok(()),
        Command::Openapi => {
            println!(
                "{}",
                serde_json::to_string_pretty(&gangway_server::http::openapi::document())?
            );
            Ok(())
        }
        Command::Queue(a) => queue::run(c, &a),
        Command::Describe { id } => client::describe(c, c.job(id)?.id, false),
        Command::Why { id } => client::describe(c, c.job(id)?.id, true),
        Command::Cancel { id, wait } => client::cancel(c, c.job(id)?, wait),
        Command::Nodes { action: None } => client::nodes(c),
        Command::Nodes { action: Some(a) } => {
            let (verb, name) = match &a {
                NodeAction::Approve { name } => ("approve", name),
                NodeAction::Cordon { name } => ("cordon", name),
                NodeAction::Drain { name } => ("drain", name),
                NodeAction::Uncordon { name } => ("uncordon", name),
                NodeAction::Delete { name } => ("delete", name),
            };
            client::node_action(c, verb, name)
        }
        Command::Audit { since, limit } => client::audit(c, since, limit),
        Command::Queues => client::queues(c),
        Command::Usage { from, to } => client::usage(c, from, to),
        Command::Sim(a) => sim::run(&a),
        Command::Policy { cmd } => policy_cmd::run(c, cmd),
        Command::Admin { cmd } => admin_cmd::run(c, cmd),
        Command::Alerts => {
            print!("{}", gangway_server::policy::watch::alert_rules());
            Ok(())
        }
        Command::Reservation { action } => reservation::run(c, action),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_has_two_examples_and_the_connection_flags_under_one_heading() {
        let mut cmd = cli_command();
        cmd.build();
        let names: Vec<String> = cmd
            .get_subcommands()
            .filter(|c| !c.is_hide_set() && c.get_name() != "help")
            .map(|c| c.get_name().to_string())
            .collect();
        for name in names {
            let sub = cmd.find_subcommand_mut(&name).expect("subcommand");
            let help = sub.render_help().to_string();
            let examples = help
                .split("Examples:\n")
                .nth(1)
                .unwrap_or_else(|| panic!("{name}: no examples in\n{help}"));
            let lines: Vec<&str> = examples.lines().filter(|l| l.contains("gangway")).collect();
            assert_eq!(lines.len(), 2, "{name}: {help}");
            if !matches!(name.as_str(), "server" | "agent" | "up") {
                let conn = help
                    .split("Connection:\n")
                    .nth(1)
                    .unwrap_or_else(|| panic!("{name}: no Connection heading in\n{help}"));
                for flag in [
                    "--addr",
                    "--token",
                    "--cli-config",
                    "--server-ca",
                    "--output",
                ] {
                    assert!(
                        conn.contains(flag),
                        "{name}: {flag} not under Connection:\n{help}"
                    );
                    let before = help.split("Connection:\n").next().unwrap_or("");
                    assert!(
                        !before.contains(flag),
                        "{name}: {flag} outside Connection:\n{help}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_command_is_in_exactly_one_help_group() {
        let mut cmd = cli_command();
        cmd.build();
        let mut listed: Vec<&str> = GROUPS.iter().flat_map(|(_, n)| n.iter().copied()).collect();
        listed.sort_unstable();
        let before = listed.len();
        listed.dedup();
        assert_eq!(before, listed.len(), "a command is in two groups");
        let mut commands: Vec<String> = cmd
            .get_subcommands()
            .filter(|c| !c.is_hide_set())
            .map(|c| c.get_name().to_string())
            .collect();
        commands.sort_unstable();
        assert_eq!(listed, commands);
        let help = cmd.render_help().to_string();
        let at = |s: &str| {
            help.find(s)
                .unwrap_or_else(|| panic!("{s:?} not in:\n{help}"))
        };
        assert!(at("Jobs:") < at("Cluster:") && at("Cluster:") < at("Admin:"));
        assert!(at("Admin:") < at("Daemons:") && at("Daemons:") < at("Tools:"));
        assert!(at("Tools:") < at("Options:"), "{help}");
        assert!(at("  submit ") < at("  queue ") && at("  queue ") < at("  logs "));
        assert!(
            help.starts_with("Gangway: a GPU cluster scheduler"),
            "{help}"
        );
        assert!(
            !help.contains("(later)") && !help.contains("bench"),
            "{help}"
        );
    }
}
