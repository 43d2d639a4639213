//! `gangway`: one binary for Gangway's subcommands.

mod bench;
mod bench_api;
mod bench_chaos;
mod bench_cluster;
mod bench_dashboard;
mod client;
mod local;
mod sim;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;

/// Gangway: a GPU cluster scheduler for gangs of ranks.
#[derive(Parser)]
#[command(name = "gangway", version, about)]
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
    },
    /// Runs a node agent: registers the node, runs the ranks the server assigns.
    Agent(Box<local::AgentArgs>),
    /// Starts a local cluster: a server and N agents with declared GPUs.
    Up(Box<local::UpArgs>),
    /// Prints a rank's log (rank 0 unless told otherwise).
    Logs {
        /// Job id.
        id: u64,
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
    /// Submits a job spec (YAML or JSON).
    Submit {
        /// The job file.
        file: PathBuf,
    },
    /// Lists jobs.
    Queue {
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Only this state (pending, scheduled, running, ...).
        #[arg(long)]
        state: Option<String>,
        /// Only this user.
        #[arg(long)]
        user: Option<String>,
    },
    /// Shows a job, its events and why it waits.
    Describe {
        /// Job id.
        id: u64,
    },
    /// Says why a job waits.
    Why {
        /// Job id.
        id: u64,
    },
    /// Cancels a job.
    Cancel {
        /// Job id.
        id: u64,
    },
    /// Lists nodes and their GPUs; with an action, changes one (admin).
    Nodes {
        #[command(subcommand)]
        action: Option<NodeAction>,
    },
    /// Prints the audit log: every state-changing call, who made it and its result (admin).
    Audit {
        /// Only entries at or after this time (seconds since the epoch).
        #[arg(long)]
        since: Option<u64>,
        /// At most this many (the latest).
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Lists queues with usage and quota.
    Queues,
    /// GPU-hours per queue and user over a time range.
    Usage {
        /// Start, seconds since the epoch.
        #[arg(long)]
        from: Option<u64>,
        /// End, seconds since the epoch.
        #[arg(long)]
        to: Option<u64>,
    },
    /// Replays a real cluster trace through the scheduling core and compares policies.
    Sim(sim::SimArgs),
    /// Benchmarks that print figures (`metric: value unit`).
    Bench {
        #[command(subcommand)]
        which: bench::Which,
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
) -> Result<()> {
    let tls = tls.apply()?;
    let text =
        std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
    let cfg = gangway_server::ServerConfig::from_yaml(&text)
        .with_context(|| format!("in {}", config.display()))?;
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

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    let conn = cli.conn.clone().resolve()?;
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
            client::logs_of(c, id, which, attempt, follow)
        }
        Command::Submit { file } => client::submit(c, &file),
        Command::Queue { queue, state, user } => {
            client::queue(c, queue.as_deref(), state.as_deref(), user.as_deref())
        }
        Command::Describe { id } => client::describe(c, id, false),
        Command::Why { id } => client::describe(c, id, true),
        Command::Cancel { id } => client::cancel(c, id),
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
        Command::Bench { which } => bench::run(which),
        Command::Sim(a) => sim::run(&a),
    }
}
