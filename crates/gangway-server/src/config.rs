//! The server's configuration file (YAML): tokens, queues and scheduler knobs.
//!
//! ```yaml
//! admin_token: s3cret-admin
//! agent_token: s3cret-join
//! users:
//!   - name: alice
//!     token: alice-token
//!     queues: [research]
//!     unix_user: alice        # the Unix account her ranks run as (default: name)
//! queues:
//!   - name: lab
//!     quota: { nominal: { gpus: 64 } }
//!   - name: research
//!     parent: lab
//!     quota: { nominal: { gpus: 32 } }
//!     allowed_priorities: [low, normal, high]
//!     allow_non_preemptible: false
//!     node:                   # what its ranks may do on the nodes (default: nothing below)
//!       mounts: { allowed: [/datasets, /scratch/research], read_write: [/scratch/research] }
//!       allow_root: false
//!       host_network: false
//!       loader_env: false
//! node_approval: manual      # or auto: joining nodes schedule at once
//! metrics_token: s3cret-prometheus
//! max_grace_seconds: 600
//! probation_after_seconds: 300   # an auto-cordoned node's health check after (0: off)
//! limits: { max_pending_jobs: 1000, max_gpus_per_job: 512, requests_per_second: 20, burst: 100 }
//! scheduler:                  # seeds policy version 1 (then: gangway policy apply)
//!   policy: gangway           # or fifo, priority, slurm, capacity, tiresias, qssf
//!   backfill: easy            # or conservative, reservations:N, off (see docs/BACKFILL.md)
//!   plan_depth: 200           # pending jobs given a start estimate per cycle
//! retention: { finished_jobs: 7d, idempotency_keys: 24h, store_history: 1m }   # the defaults
//! ```
//!
//! The file is parsed with the same budgets as job specs (see [`crate::yaml`]).

use gangway_core::agent::PortRange;
use gangway_core::{QueueSpec, TimeSpan};
use gangway_sched::SchedulerConfig;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Node lifecycle knobs (from the server config).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeLifecycle {
    /// Seconds without a heartbeat before a node is NotReady.
    pub node_not_ready_seconds: u64,
    /// Seconds without a heartbeat before its gangs are treated as lost.
    pub node_lost_seconds: u64,
    /// Distinct jobs failing on one node and succeeding elsewhere before it
    /// is blamed (0: never auto-cordon; see [`crate::blame`]).
    pub auto_cordon_failures: u32,
}

impl Default for NodeLifecycle {
    fn default() -> Self {
        NodeLifecycle {
            node_not_ready_seconds: 10,
            node_lost_seconds: 30,
            auto_cordon_failures: 3,
        }
    }
}

impl NodeLifecycle {
    /// Whether the check acts on a node silent for `silent` seconds, Ready
    /// or not (`ready`), already treated as lost or not (`lost`): `None`
    /// when it does not; else whether the node is Ready (it becomes
    /// NotReady). Silent for `node_lost_seconds` and not yet lost, or for
    /// `node_not_ready_seconds` and still Ready.
    pub(crate) fn acts_on(&self, silent: u64, ready: bool, lost: bool) -> Option<bool> {
        if silent >= self.node_lost_seconds && !lost {
            Some(ready)
        } else if silent >= self.node_not_ready_seconds && ready {
            Some(true)
        } else {
            None
        }
    }
}

/// The contract's knobs (from the server config).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContractConfig {
    /// Cluster-wide checkpoint root; `None`: each agent's own.
    pub checkpoint_root: Option<String>,
    /// Rendezvous ports.
    pub master_ports: PortRange,
}

/// Range checks of the scheduler settings (a policy's `scheduler`
/// section, the configuration file's), naming the field
/// (`scheduler.plan_depth: ...`), and its `policy` against the registry of
/// scheduling policies (the error lists the known names). The settings the
/// stored form leaves out (`strict_order`, `plan_budget`,
/// `max_victims_examined`) are the core's defaults or the named policy's.
pub fn check_scheduler(s: &SchedulerConfig) -> Result<(), String> {
    gangway_sched::policies::lookup(&s.policy).map_err(|e| format!("scheduler.policy: {e}"))?;
    let range = |field: &str, v: u64, lo: u64, hi: u64| {
        if v < lo || v > hi {
            Err(format!(
                "scheduler.{field}: {v} is out of range ({lo} to {hi})"
            ))
        } else {
            Ok(())
        }
    };
    range(
        "plan_depth",
        s.plan_depth as u64,
        0,
        crate::config::MAX_PLAN_DEPTH as u64,
    )?;
    range(
        "max_preemption_searches",
        s.max_preemption_searches as u64,
        1,
        1024,
    )?;
    range(
        "max_preemptions_per_cycle",
        s.max_preemptions_per_cycle as u64,
        1,
        100_000,
    )?;
    if let Some(b) = s.preemption_budget {
        range(
            "preemption_budget",
            u64::from(b),
            0,
            u64::from(gangway_core::MAX_PREEMPTION_BUDGET),
        )?;
    }
    range(
        "max_pending_examined",
        s.max_pending_examined as u64,
        100,
        10_000_000,
    )?;
    range(
        "min_run_seconds",
        s.min_run_seconds,
        0,
        gangway_core::MAX_MIN_RUN_SECONDS,
    )
}

/// Targets a policy change must meet in the what-if before it is applied
/// (unless forced with a reason). The gates of the version in force judge a
/// candidate, so a candidate cannot loosen its own gates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Gates {
    /// No queue's (nor the overall) p95 wait may grow by more than this many
    /// percent (differences under a minute never fail it).
    pub max_p95_wait_worse_pct: Option<f64>,
    /// GPU utilisation may not drop by more than this many percentage points.
    pub max_utilisation_drop_points: Option<f64>,
    /// Jain's fairness index across queues must stay at least this (or not get worse).
    pub min_jain: Option<f64>,
}

// The values are checked finite when read ([`Gates::check`]), so equality is total.
impl Eq for Gates {}

impl Gates {
    /// Whether any gate is set.
    pub fn any(&self) -> bool {
        self.max_p95_wait_worse_pct.is_some()
            || self.max_utilisation_drop_points.is_some()
            || self.min_jain.is_some()
    }

    /// Range checks, naming the field.
    pub fn check(&self) -> Result<(), String> {
        for (field, v, hi) in [
            (
                "max_p95_wait_worse_pct",
                self.max_p95_wait_worse_pct,
                10_000.0,
            ),
            (
                "max_utilisation_drop_points",
                self.max_utilisation_drop_points,
                100.0,
            ),
            ("min_jain", self.min_jain, 1.0),
        ] {
            if let Some(v) = v {
                if !v.is_finite() || !(0.0..=hi).contains(&v) {
                    return Err(format!("gates.{field}: {v} is out of range (0 to {hi})"));
                }
            }
        }
        Ok(())
    }
}

/// How long finished work is kept (config `retention`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Retention {
    /// Finished jobs are removed this long after they ended (default 7d).
    pub finished_jobs: TimeSpan,
    /// Idempotency keys are removed this long after their job was submitted
    /// (default 24h): a retry later than that creates a new job.
    pub idempotency_keys: TimeSpan,
    /// The store's change history is kept this long before it is compacted
    /// (default 1m; 0: never, the operator compacts etcd).
    pub store_history: TimeSpan,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            finished_jobs: TimeSpan::Text("7d".into()),
            idempotency_keys: TimeSpan::Text("24h".into()),
            store_history: TimeSpan::Text("1m".into()),
        }
    }
}

/// Longest horizon accepted: ten years.
const MAX_HORIZON: u64 = 3650 * 86_400;

impl Retention {
    /// Both horizons in seconds (finished jobs, idempotency keys), or the
    /// field that is wrong and why.
    pub fn seconds(&self) -> Result<(u64, u64), String> {
        let check = |name: &str, t: &TimeSpan| -> Result<u64, String> {
            let s = t.seconds().map_err(|e| format!("retention.{name}: {e}"))?;
            if !(60..=MAX_HORIZON).contains(&s) {
                return Err(format!(
                    "retention.{name}: must be between 1 minute and 3650 days"
                ));
            }
            Ok(s)
        };
        Ok((
            check("finished_jobs", &self.finished_jobs)?,
            check("idempotency_keys", &self.idempotency_keys)?,
        ))
    }
}

/// Longest store history accepted: 30 days (the history of a busy cluster
/// is many times its state).
const MAX_STORE_HISTORY: u64 = 30 * 86_400;

impl Retention {
    /// How long the store's history is kept, or `None` for never compacted;
    /// or the field's error.
    pub fn store_history_seconds(&self) -> Result<Option<u64>, String> {
        let s = self
            .store_history
            .seconds()
            .map_err(|e| format!("retention.store_history: {e}"))?;
        match s {
            0 => Ok(None),
            60..=MAX_STORE_HISTORY => Ok(Some(s)),
            _ => Err(
                "retention.store_history: must be 0 (never compact) or between 1 minute \
                      and 30 days"
                    .into(),
            ),
        }
    }
}

/// A user and the queues they may submit to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    /// User name (jobs are owned by it).
    pub name: String,
    /// Bearer token.
    pub token: String,
    /// Queues the user may submit to.
    #[serde(default)]
    pub queues: Vec<String>,
    /// This user's limits where they differ from the cluster's `limits`.
    #[serde(default)]
    pub limits: Option<UserLimits>,
    /// Unix account the user's ranks run as on the nodes (default: `name`).
    #[serde(default)]
    pub unix_user: Option<String>,
}

/// Per-user limits: how much one user may ask of the control plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UserLimits {
    /// Jobs a user may have waiting (pending or restarting) at once.
    pub max_pending_jobs: u32,
    /// GPUs one job may ask for (replicas × GPUs per replica).
    pub max_gpus_per_job: u64,
    /// Sustained API requests per second (token bucket refill rate).
    pub requests_per_second: u32,
    /// Requests allowed in a burst above the rate (token bucket size).
    pub burst: u32,
}

impl Default for UserLimits {
    fn default() -> Self {
        UserLimits {
            max_pending_jobs: 1000,
            max_gpus_per_job: 4096,
            requests_per_second: 50,
            burst: 200,
        }
    }
}

/// Whether nodes that join with the join token may run work at once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeApproval {
    /// New nodes wait until an admin approves them (`gangway nodes approve`).
    #[default]
    Manual,
    /// New nodes are schedulable as soon as they register (local clusters).
    Auto,
}

/// The whole configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Admin bearer token: may do anything.
    pub admin_token: String,
    /// Token agents join with.
    pub agent_token: String,
    /// Users.
    #[serde(default)]
    pub users: Vec<UserConfig>,
    /// Queues (parents first).
    #[serde(default)]
    pub queues: Vec<QueueSpec>,
    /// Seconds between scheduling cycles when nothing changes.
    #[serde(default = "one")]
    pub cycle_seconds: u64,
    /// Seconds without a heartbeat before a node is NotReady (no new work).
    #[serde(default = "ten")]
    pub node_not_ready_seconds: u64,
    /// Seconds without a heartbeat before a node's gangs are treated as lost
    /// and restarted elsewhere.
    #[serde(default = "thirty")]
    pub node_lost_seconds: u64,
    /// Distinct jobs that failed on one node and then succeeded on others
    /// before the node is blamed for it (0: never auto-cordon at all). Plain
    /// failures of a job that fails everywhere never count (see `blame`).
    #[serde(default = "three")]
    pub auto_cordon_failures: u32,
    /// Seconds a gang restarted after a node fault (a GPU fault, a GPU lost,
    /// an agent fault such as "kill task failed") avoids the blamed node for
    /// its next attempt, at most a day: a gang only that node fits waits at
    /// most this long (0: never avoid).
    #[serde(default = "six_hundred")]
    pub avoid_node_seconds: u64,
    /// Seconds after an auto-cordon before the node's agent is asked to run
    /// its health check (`gangway agent --health-check`); a pass returns the
    /// node to service, a failure is retried after a doubling backoff (up to
    /// an hour). 0: no probation (an admin uncordons). See `probation`.
    #[serde(default = "three_hundred")]
    pub probation_after_seconds: u64,
    /// Whether nodes joining with the join token wait for an admin's approval.
    #[serde(default)]
    pub node_approval: NodeApproval,
    /// A token that may read `/metrics` and nothing else (the admin token may too).
    #[serde(default)]
    pub metrics_token: Option<String>,
    /// Longest checkpoint grace a job may ask for; past its grace plus
    /// `grace_kill_margin_seconds` the server ends a preempted attempt and
    /// frees its GPUs whatever its ranks do.
    #[serde(default = "six_hundred")]
    pub max_grace_seconds: u64,
    /// Seconds the server waits beyond a victim's grace before it takes the
    /// GPUs back (time for the agent's own kill to be reported).
    #[serde(default = "thirty")]
    pub grace_kill_margin_seconds: u64,
    /// Default per-user limits (a user entry may override them).
    #[serde(default)]
    pub limits: UserLimits,
    /// Largest request body accepted, in bytes.
    #[serde(default = "one_mib")]
    pub max_body_bytes: usize,
    /// Unix account for the ranks of jobs whose owner is not a configured
    /// user (jobs the admin submits).
    #[serde(default = "nobody")]
    pub default_unix_user: String,
    /// Cluster-wide checkpoint root (shared storage every node mounts at
    /// this path); jobs checkpoint under `<root>/<user>/<dir>`. Absent: each
    /// agent's `--checkpoint-root` (fine for one machine, not across nodes).
    #[serde(default)]
    pub checkpoint_root: Option<String>,
    /// Rendezvous ports (`MASTER_PORT`), outside the ephemeral range.
    #[serde(default)]
    pub master_ports: gangway_core::agent::PortRange,
    /// The scheduling policy by name and the scheduler's settings
    /// (backfill, preemption, fair share): part of the versioned policy,
    /// seeded from here at the first start.
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    /// Targets a policy change must meet in the what-if (see `gangway policy apply`).
    #[serde(default)]
    pub gates: Gates,
    /// Per queue, the p95 wait it promises (seconds): exported as
    /// `gangway_queue_slo_p95_wait_seconds`, alerted on by `gangway alerts`.
    #[serde(default)]
    pub slo_p95_wait_seconds: std::collections::BTreeMap<String, u64>,
    /// The older spelling of `scheduler.backfill` (read into it when the
    /// file is parsed; like every scheduler knob, it seeds version 1 only).
    #[serde(default, skip_serializing)]
    pub backfill: Option<gangway_sched::Backfill>,
    /// The older spelling of `scheduler.plan_depth` (read into it).
    #[serde(default, skip_serializing)]
    pub plan_depth: Option<usize>,
    /// How long finished jobs and idempotency keys are kept
    /// (`{ finished_jobs: 7d, idempotency_keys: 24h }` by default).
    #[serde(default)]
    pub retention: Retention,
}

/// Most pending jobs `plan_depth` may ask to plan per cycle.
pub const MAX_PLAN_DEPTH: usize = 100_000;

fn three_hundred() -> u64 {
    300
}

fn six_hundred() -> u64 {
    600
}

fn one_mib() -> usize {
    1 << 20
}

fn nobody() -> String {
    "nobody".into()
}

fn one() -> u64 {
    1
}

fn ten() -> u64 {
    10
}

fn thirty() -> u64 {
    30
}

fn three() -> u32 {
    3
}

/// A configuration that cannot be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// YAML.
    #[error("config: {0}")]
    Yaml(String),
    /// Semantics.
    #[error("config: {0}")]
    Invalid(String),
}

impl ServerConfig {
    /// The node lifecycle knobs.
    pub fn lifecycle(&self) -> NodeLifecycle {
        NodeLifecycle {
            node_not_ready_seconds: self.node_not_ready_seconds,
            node_lost_seconds: self.node_lost_seconds,
            auto_cordon_failures: self.auto_cordon_failures,
        }
    }

    /// The node blame knobs: the rate limit (10 % of the nodes, at least
    /// one, per 10 minutes) and the halt above half the nodes are fixed.
    pub fn blame(&self) -> crate::blame::BlameConfig {
        crate::blame::BlameConfig {
            jobs_to_qualify: self.auto_cordon_failures,
            enabled: self.auto_cordon_failures > 0,
            avoid_seconds: self.avoid_node_seconds,
            ..crate::blame::BlameConfig::default()
        }
    }

    /// The probation knobs: the delay from the config, the backoff's cap
    /// fixed at an hour.
    pub fn probation(&self) -> crate::probation::ProbationConfig {
        crate::probation::ProbationConfig {
            after_seconds: self.probation_after_seconds,
            ..crate::probation::ProbationConfig::default()
        }
    }

    /// A configuration with these tokens and queues and every other knob at
    /// its default (tests and `gangway up`).
    pub fn new(admin_token: &str, agent_token: &str, queues: Vec<QueueSpec>) -> Self {
        ServerConfig {
            admin_token: admin_token.to_string(),
            agent_token: agent_token.to_string(),
            users: Vec::new(),
            queues,
            cycle_seconds: one(),
            node_not_ready_seconds: ten(),
            node_lost_seconds: thirty(),
            auto_cordon_failures: three(),
            avoid_node_seconds: six_hundred(),
            probation_after_seconds: three_hundred(),
            node_approval: NodeApproval::Manual,
            metrics_token: None,
            max_grace_seconds: six_hundred(),
            grace_kill_margin_seconds: thirty(),
            limits: UserLimits::default(),
            max_body_bytes: one_mib(),
            default_unix_user: nobody(),
            checkpoint_root: None,
            master_ports: Default::default(),
            scheduler: Default::default(),
            gates: Default::default(),
            slo_p95_wait_seconds: Default::default(),
            backfill: None,
            plan_depth: None,
            retention: Default::default(),
        }
    }

    /// The limits that apply to `user` (their own, else the cluster's).
    pub fn limits_of(&self, user: &str) -> UserLimits {
        self.users
            .iter()
            .find(|u| u.name == user)
            .and_then(|u| u.limits)
            .unwrap_or(self.limits)
    }

    /// The Unix account the ranks of `owner`'s jobs run as: the user's
    /// `unix_user`, else the user's name; owners that are not configured
    /// users (the admin's jobs) get `default_unix_user`.
    pub fn account_of(&self, owner: &str) -> String {
        match self.users.iter().find(|u| u.name == owner) {
            Some(u) => u.unix_user.clone().unwrap_or_else(|| u.name.clone()),
            None => self.default_unix_user.clone(),
        }
    }

    /// Unix accounts that several users who may submit (a user with at
    /// least one queue) run as, each with those users' names, sorted. Ranks
    /// of one account are one principal on a node, whatever Gangway user
    /// submitted them: see [`shared_account_refusal`].
    pub fn shared_accounts(&self) -> Vec<(String, Vec<String>)> {
        let mut by_account: std::collections::BTreeMap<String, Vec<String>> = Default::default();
        for u in self.users.iter().filter(|u| !u.queues.is_empty()) {
            by_account
                .entry(self.account_of(&u.name))
                .or_default()
                .push(u.name.clone());
        }
        by_account
            .into_iter()
            .filter(|(_, users)| users.len() > 1)
            .collect()
    }

    /// The job-contract knobs.
    pub fn contract(&self) -> ContractConfig {
        ContractConfig {
            checkpoint_root: self.checkpoint_root.clone(),
            master_ports: self.master_ports,
        }
    }

    /// Reads the top-level `backfill` and `plan_depth` (their spelling
    /// before they were versioned policy) into `scheduler`; a file that sets
    /// one both ways is refused.
    fn fold_top_level_knobs(&mut self, text: &str) -> Result<(), ConfigError> {
        if self.backfill.is_none() && self.plan_depth.is_none() {
            return Ok(());
        }
        #[derive(Deserialize)]
        struct Probe {
            #[serde(default)]
            scheduler: Option<serde_json::Map<String, serde_json::Value>>,
        }
        let probe: Probe = crate::yaml::from_str(text).map_err(ConfigError::Yaml)?;
        let set = |k: &str| probe.scheduler.as_ref().is_some_and(|m| m.contains_key(k));
        for (key, given) in [
            ("backfill", self.backfill.is_some()),
            ("plan_depth", self.plan_depth.is_some()),
        ] {
            if given && set(key) {
                return Err(ConfigError::Invalid(format!(
                    "{key}: set both at the top level and as scheduler.{key}; keep scheduler.{key}"
                )));
            }
        }
        if let Some(b) = self.backfill.take() {
            self.scheduler.backfill = b;
        }
        if let Some(d) = self.plan_depth.take() {
            self.scheduler.plan_depth = d;
        }
        Ok(())
    }

    /// Parses and checks a YAML configuration.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let mut c: ServerConfig = crate::yaml::from_str(text).map_err(ConfigError::Yaml)?;
        c.fold_top_level_knobs(text)?;
        if c.admin_token.len() < 8 || c.agent_token.len() < 8 {
            return Err(ConfigError::Invalid(
                "tokens must be at least 8 characters".into(),
            ));
        }
        if c.metrics_token.as_ref().is_some_and(|t| t.len() < 8) {
            return Err(ConfigError::Invalid(
                "metrics_token: must be at least 8 characters".into(),
            ));
        }
        check_scheduler(&c.scheduler).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        c.retention.seconds().map_err(ConfigError::Invalid)?;
        c.retention
            .store_history_seconds()
            .map_err(ConfigError::Invalid)?;
        if c.max_body_bytes < 1024 {
            return Err(ConfigError::Invalid(
                "max_body_bytes: must be at least 1024".into(),
            ));
        }
        let printable = |field: String, v: &str| {
            gangway_core::text::check_printable(&field, v).map_err(ConfigError::Invalid)
        };
        printable("default_unix_user".into(), &c.default_unix_user)?;
        for (i, u) in c.users.iter().enumerate() {
            printable(format!("users[{i}].name"), &u.name)?;
            if let Some(account) = &u.unix_user {
                printable(format!("users[{i}].unix_user"), account)?;
            }
            for q in &u.queues {
                printable(format!("users[{i}].queues"), q)?;
            }
        }
        let defaults: Vec<&str> = c
            .queues
            .iter()
            .filter(|q| q.default)
            .map(|q| q.name.as_str())
            .collect();
        if defaults.len() > 1 {
            return Err(ConfigError::Invalid(format!(
                "queues: at most one queue may be `default: true` (marked: {})",
                defaults.join(", ")
            )));
        }
        for (i, q) in c.queues.iter().enumerate() {
            printable(format!("queues[{i}].name"), &q.name)?;
            if let Some(p) = &q.parent {
                printable(format!("queues[{i}].parent"), p)?;
            }
        }
        for q in c.slo_p95_wait_seconds.keys() {
            printable("slo_p95_wait_seconds".into(), q)?;
        }
        for u in &c.users {
            if u.token.len() < 8 {
                return Err(ConfigError::Invalid(format!(
                    "users[{}].token: must be at least 8 characters",
                    u.name
                )));
            }
            if matches!(u.name.as_str(), "admin" | "agent" | "metrics")
                || u.name.starts_with("node:")
            {
                return Err(ConfigError::Invalid(format!(
                    "users: the name {:?} is reserved",
                    u.name
                )));
            }
        }
        if c.node_lost_seconds < c.node_not_ready_seconds {
            return Err(ConfigError::Invalid(
                "node_lost_seconds must not be less than node_not_ready_seconds".into(),
            ));
        }
        if c.avoid_node_seconds > crate::blame::MAX_AVOID_SECONDS {
            return Err(ConfigError::Invalid(format!(
                "avoid_node_seconds: {} is more than a day ({} s); 0 turns avoidance off",
                c.avoid_node_seconds,
                crate::blame::MAX_AVOID_SECONDS
            )));
        }
        if c.probation_after_seconds > crate::probation::MAX_AFTER_SECONDS {
            return Err(ConfigError::Invalid(format!(
                "probation_after_seconds: {} is more than a week ({} s); 0 turns probation off",
                c.probation_after_seconds,
                crate::probation::MAX_AFTER_SECONDS
            )));
        }
        if c.master_ports.is_empty() || c.master_ports.first < 1024 {
            return Err(ConfigError::Invalid(
                "master_ports: first must be at least 1024 and not above last".into(),
            ));
        }
        for q in &c.queues {
            q.check_preemption_rules()
                .map_err(|e| ConfigError::Invalid(format!("queue {}: {e}", q.name)))?;
            for (what, t) in [
                ("default", &q.time_limit.default),
                ("max", &q.time_limit.max),
            ] {
                if let Some(t) = t {
                    let secs = t.seconds().map_err(|e| {
                        ConfigError::Invalid(format!("queue {}: time_limit.{what}: {e}", q.name))
                    })?;
                    if secs == 0 || secs > gangway_core::job::MAX_TIME_LIMIT_SECONDS {
                        return Err(ConfigError::Invalid(format!(
                            "queue {}: time_limit.{what}: must be between 1 second and 366 days",
                            q.name
                        )));
                    }
                }
            }
        }
        c.gates
            .check()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        for (q, t) in &c.slo_p95_wait_seconds {
            if q.is_empty() || q.len() > 253 {
                return Err(ConfigError::Invalid(
                    "slo_p95_wait_seconds: queue names are 1 to 253 bytes".into(),
                ));
            }
            if *t == 0 || *t > gangway_core::job::MAX_TIME_LIMIT_SECONDS {
                return Err(ConfigError::Invalid(format!(
                    "slo_p95_wait_seconds.{q}: must be between 1 second and 366 days"
                )));
            }
        }
        if let Some(root) = &c.checkpoint_root {
            if !root.starts_with('/') {
                return Err(ConfigError::Invalid(
                    "checkpoint_root: must be an absolute path".into(),
                ));
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for t in std::iter::once(&c.admin_token)
            .chain(std::iter::once(&c.agent_token))
            .chain(c.metrics_token.iter())
            .chain(c.users.iter().map(|u| &u.token))
        {
            if !seen.insert(t) {
                return Err(ConfigError::Invalid("tokens must be distinct".into()));
            }
        }
        Ok(c)
    }
}

/// The refusal of a configuration whose users share Unix accounts (see
/// [`ServerConfig::shared_accounts`]), saying what sharing means and how
/// to fix it, or `None` when every user has an account of their own.
/// `flag` is the command-line flag that accepts sharing.
pub fn shared_account_refusal(cfg: &ServerConfig, flag: &str) -> Option<String> {
    let shared = cfg.shared_accounts();
    if shared.is_empty() {
        return None;
    }
    let list = shared
        .iter()
        .map(|(account, users)| format!("{} run as Unix account {account:?}", users.join(", ")))
        .collect::<Vec<_>>()
        .join("; ");
    Some(format!(
        "users share a Unix account: {list}. Ranks of one account are one user to the \
         node: each of these users' ranks can read the others' environment (secrets \
         in run.env, via /proc), read and replace their checkpoints, read their \
         TMPDIR and home, read their logs and signal (kill) their ranks. Give each \
         user an account of their own (`unix_user:` in the user's entry), or start \
         with {flag} to accept that these users are not isolated from each other"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_mapped_to_one_account_are_named_with_what_sharing_means() {
        let c = ServerConfig::from_yaml(
            "admin_token: admin-token-1\nagent_token: agent-token-1\nusers:\n  - { name: alice, token: alice-token-1, queues: [q], unix_user: lab }\n  - { name: bob, token: bob-token-11, queues: [q], unix_user: lab }\n  - { name: carol, token: carol-token-1, queues: [q] }\n  - { name: dave, token: dave-token-11, queues: [], unix_user: carol }\nqueues:\n  - name: q\n",
        )
        .expect("config");
        // dave may submit nowhere: his account runs nothing.
        assert_eq!(
            c.shared_accounts(),
            vec![(
                "lab".to_string(),
                vec!["alice".to_string(), "bob".to_string()]
            )]
        );
        let why = shared_account_refusal(&c, "--allow-shared-account").expect("refused");
        for part in [
            "alice, bob run as Unix account \"lab\"",
            "environment",
            "checkpoints",
            "TMPDIR",
            "logs",
            "signal",
            "unix_user:",
            "--allow-shared-account",
        ] {
            assert!(why.contains(part), "{part}: {why}");
        }
        // A user's name is the default account: distinct names, distinct accounts.
        let own = ServerConfig::from_yaml(
            "admin_token: admin-token-1\nagent_token: agent-token-1\nusers:\n  - { name: alice, token: alice-token-1, queues: [q] }\n  - { name: bob, token: bob-token-11, queues: [q] }\nqueues:\n  - name: q\n",
        )
        .expect("config");
        assert!(own.shared_accounts().is_empty());
        assert_eq!(shared_account_refusal(&own, "--x"), None);
    }

    #[test]
    fn control_characters_in_user_and_queue_names_are_refused() {
        let base = "admin_token: admin-token-1\nagent_token: agent-token-1\n";
        for (yaml, want) in [
            (
                "users:\n  - { name: \"al\\u001bice\", token: alice-token-1, queues: [q] }\nqueues:\n  - name: q\n",
                "users[0].name: control character U+001B is not allowed",
            ),
            (
                "users:\n  - { name: alice, token: alice-token-1, queues: [q], unix_user: \"a\\nb\" }\nqueues:\n  - name: q\n",
                "users[0].unix_user: control character U+000A is not allowed",
            ),
            (
                "queues:\n  - name: \"q\\u202e\"\n",
                "queues[0].name: control character U+202E is not allowed",
            ),
        ] {
            let e = ServerConfig::from_yaml(&format!("{base}{yaml}")).expect_err(yaml);
            assert!(e.to_string().contains(want), "{e}");
        }
    }

    #[test]
    fn the_example_config_parses_with_its_security_settings() {
        let c = ServerConfig::from_yaml(include_str!("../../../examples/server.yaml"))
            .expect("examples/server.yaml");
        assert_eq!(c.node_approval, NodeApproval::Manual);
        assert_eq!(c.max_grace_seconds, 600);
        assert_eq!(c.limits_of("bob").max_pending_jobs, 5000);
        assert_eq!(c.limits_of("alice").max_pending_jobs, 1000);
        let prod = c.queues.iter().find(|q| q.name == "prod").expect("prod");
        assert!(prod.allow_non_preemptible);
        // A fresh cluster's policy changes are gated out of the box.
        assert_eq!(c.gates.max_p95_wait_worse_pct, Some(10.0));
        assert_eq!(c.gates.max_utilisation_drop_points, Some(2.0));
        assert_eq!(c.gates.min_jain, Some(0.9));
    }

    #[test]
    fn weak_duplicate_and_reserved_settings_are_refused() {
        let base = "admin_token: admin-secret\nagent_token: agent-secret\n";
        assert!(ServerConfig::from_yaml(base).is_ok());
        for bad in [
            "metrics_token: short\n",
            "metrics_token: admin-secret\n",
            "users: [{ name: agent, token: user-token-1 }]\n",
            "users: [{ name: u, token: short }]\n",
            "max_body_bytes: 10\n",
            "gates: { min_jain: 2 }\n",
            "gates: { max_p95_wait_worse_pct: -1 }\n",
            "slo_p95_wait_seconds: { research: 0 }\n",
            "scheduler: { backfil: true }\n",
        ] {
            assert!(
                ServerConfig::from_yaml(&format!("{base}{bad}")).is_err(),
                "{bad}"
            );
        }
        let deep = format!("{base}x: {}{}", "[".repeat(10_000), "]".repeat(10_000));
        assert!(ServerConfig::from_yaml(&deep).is_err());
    }

    const BASE: &str = "admin_token: admin-secret\nagent_token: agent-secret\n";

    #[test]
    fn probation_delay_defaults_to_five_minutes_and_is_bounded() {
        let c = ServerConfig::from_yaml(BASE).expect("base");
        assert_eq!(c.probation().after_seconds, 300);
        assert_eq!(c.probation().max_backoff_seconds, 3600);
        let off =
            ServerConfig::from_yaml(&format!("{BASE}probation_after_seconds: 0\n")).expect("off");
        assert_eq!(off.probation().after_seconds, 0);
        let week = ServerConfig::from_yaml(&format!("{BASE}probation_after_seconds: 604800\n"));
        assert!(week.is_ok());
        let e = ServerConfig::from_yaml(&format!("{BASE}probation_after_seconds: 604801\n"))
            .expect_err("over a week")
            .to_string();
        assert!(
            e.contains("probation_after_seconds: 604801 is more than a week"),
            "{e}"
        );
        assert!(ServerConfig::from_yaml(&format!("{BASE}probation_after_seconds: -1\n")).is_err());
    }

    /// A gang that only its blamed node fits waits out the avoidance, so
    /// it is bounded.
    #[test]
    fn avoid_node_seconds_is_bounded_to_a_day() {
        let c = ServerConfig::from_yaml(BASE).expect("base");
        assert_eq!(c.blame().avoid_seconds, 600);
        let day = ServerConfig::from_yaml(&format!("{BASE}avoid_node_seconds: 86400\n"));
        assert_eq!(day.expect("a day").blame().avoid_seconds, 86_400);
        let e = ServerConfig::from_yaml(&format!("{BASE}avoid_node_seconds: 86401\n"))
            .expect_err("over a day")
            .to_string();
        assert!(
            e.contains("avoid_node_seconds: 86401 is more than a day"),
            "{e}"
        );
    }

    #[test]
    fn backfill_settings_are_scheduler_knobs_and_the_top_level_spelling_still_reads() {
        use gangway_sched::Backfill;
        let d = ServerConfig::from_yaml(BASE).expect("defaults");
        assert_eq!(d.scheduler.backfill, Backfill::Easy);
        assert_eq!(d.scheduler.plan_depth, gangway_sched::DEFAULT_PLAN_DEPTH);
        let c = ServerConfig::from_yaml(&format!(
            "{BASE}scheduler: {{ backfill: \"reservations:3\", plan_depth: 50 }}\n"
        ))
        .expect("knobs");
        assert_eq!(c.scheduler.backfill, Backfill::Reservations(3));
        assert_eq!(c.scheduler.plan_depth, 50);
        assert_eq!(
            gangway_sched::policies::configure(&c.scheduler).backfill,
            Backfill::Reservations(3)
        );
        // The older top-level keys seed the same knobs.
        let old = ServerConfig::from_yaml(&format!(
            "{BASE}scheduler: {{ fair_share: false }}\nbackfill: conservative\nplan_depth: 7\n"
        ))
        .expect("top level");
        assert_eq!(old.scheduler.backfill, Backfill::Conservative);
        assert_eq!(old.scheduler.plan_depth, 7);
        assert!(!old.scheduler.fair_share);
        for (bad, words) in [
            (
                "backfill: off\nscheduler: { backfill: easy }\n",
                "backfill: set both at the top level and as scheduler.backfill",
            ),
            (
                "plan_depth: 3\nscheduler: { plan_depth: 4 }\n",
                "plan_depth: set both",
            ),
            (
                "scheduler: { plan_depth: 100001 }\n",
                "scheduler.plan_depth",
            ),
            ("plan_depth: 100001\n", "scheduler.plan_depth"),
            (
                "scheduler: { backfill: sometimes }\n",
                "backfill: expected off",
            ),
        ] {
            let e = ServerConfig::from_yaml(&format!("{BASE}{bad}"))
                .expect_err(bad)
                .to_string();
            assert!(e.contains(words), "{words:?} not in {e}");
        }
    }

    #[test]
    fn contract_settings_are_checked() {
        let ok = format!(
            "{BASE}checkpoint_root: /shared/ck\nmaster_ports: {{ first: 29400, last: 29500 }}\nqueues:\n  - name: q\n    time_limit: {{ default: \"1h\", max: 86400 }}\n"
        );
        let c = ServerConfig::from_yaml(&ok).expect("valid");
        assert_eq!(c.master_ports.last, 29_500);
        assert_eq!(
            c.queues[0].time_limit.max,
            Some(gangway_core::TimeSpan::Seconds(86_400))
        );
        let defaults = ServerConfig::from_yaml(BASE).expect("valid");
        assert_eq!(
            defaults.master_ports,
            gangway_core::agent::PortRange::default()
        );
        assert_eq!(defaults.checkpoint_root, None);
        for (bad, why) in [
            ("checkpoint_root: relative/path\n", "checkpoint_root"),
            (
                "master_ports: { first: 30000, last: 29999 }\n",
                "master_ports",
            ),
            ("master_ports: { first: 80, last: 90 }\n", "master_ports"),
            (
                "queues:\n  - name: q\n    time_limit: { max: soon }\n",
                "queue q: time_limit.max",
            ),
            (
                "queues:\n  - name: q\n    time_limit: { default: 0 }\n",
                "queue q: time_limit.default",
            ),
            (
                "queues:\n  - name: q\n    min_run_seconds: 604801\n",
                "queue q: min_run_seconds: 604801 is out of range",
            ),
            (
                "queues:\n  - name: q\n    preemption_budget: 1001\n",
                "queue q: preemption_budget: 1001 is out of range",
            ),
            ("queues:\n  - name: q\n    ordering: lottery\n", "lottery"),
        ] {
            let e = ServerConfig::from_yaml(&format!("{BASE}{bad}")).expect_err(bad);
            assert!(e.to_string().contains(why), "{bad}: {e}");
        }
    }
}

/// What the configured nominal GPU quotas promise beyond `cluster_gpus`
/// (the GPUs the cluster has) or beyond a parent queue's own nominal
/// quota, one sentence per problem naming the queues and the sums: a
/// guarantee the cluster cannot give, which leaves a queue waiting at
/// "quota 0/N" with nothing to reclaim. Empty when every promise fits.
pub fn quota_overcommit(cfg: &ServerConfig, cluster_gpus: u64) -> Vec<String> {
    let nominal = |q: &gangway_core::QueueSpec| q.quota.nominal.gpus;
    let sum_of = |qs: &[&gangway_core::QueueSpec]| -> (u64, String) {
        let total = qs
            .iter()
            .filter_map(|q| nominal(q))
            .fold(0u64, u64::saturating_add);
        let parts: Vec<String> = qs
            .iter()
            .filter_map(|q| nominal(q).map(|g| format!("{} {g}", q.name)))
            .collect();
        (total, parts.join(" + "))
    };
    let mut out = Vec::new();
    let top: Vec<&gangway_core::QueueSpec> =
        cfg.queues.iter().filter(|q| q.parent.is_none()).collect();
    let leaves: Vec<&gangway_core::QueueSpec> = cfg
        .queues
        .iter()
        .filter(|q| {
            !cfg.queues
                .iter()
                .any(|c| c.parent.as_deref() == Some(&q.name))
        })
        .collect();
    let (top_sum, top_parts) = sum_of(&top);
    let (leaf_sum, leaf_parts) = sum_of(&leaves);
    if top_sum > cluster_gpus {
        out.push(format!(
            "the nominal GPU quotas of the top-level queues ({top_parts}) add up to {top_sum} GPUs, but the cluster has {cluster_gpus}"
        ));
    } else if leaf_sum > cluster_gpus {
        out.push(format!(
            "the nominal GPU quotas of the leaf queues ({leaf_parts}) add up to {leaf_sum} GPUs, but the cluster has {cluster_gpus}"
        ));
    }
    for parent in &cfg.queues {
        let Some(own) = nominal(parent) else {
            continue;
        };
        let children: Vec<&gangway_core::QueueSpec> = cfg
            .queues
            .iter()
            .filter(|c| c.parent.as_deref() == Some(&parent.name))
            .collect();
        let (sum, parts) = sum_of(&children);
        if sum > own {
            out.push(format!(
                "the nominal GPU quotas of the queues under {} ({parts}) add up to {sum} GPUs, more than {}'s own {own}",
                parent.name, parent.name
            ));
        }
    }
    out
}

#[cfg(test)]
mod overcommit_tests {
    use super::*;

    fn example() -> ServerConfig {
        ServerConfig::from_yaml(include_str!("../../../examples/server.yaml")).expect("example")
    }

    #[test]
    fn the_example_config_fits_the_default_up() {
        // `gangway up --config examples/server.yaml`: 4 nodes x 8 GPUs.
        assert_eq!(quota_overcommit(&example(), 32), Vec::<String>::new());
    }

    #[test]
    fn quotas_past_the_cluster_are_named_with_their_sums() {
        let w = quota_overcommit(&example(), 16);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("top-level queues (lab 32) add up to 32 GPUs, but the cluster has 16"),
            "{w:?}"
        );
        let mut cfg = example();
        for q in &mut cfg.queues {
            if q.name == "research" {
                q.quota.nominal.gpus = Some(40);
            }
        }
        let w = quota_overcommit(&cfg, 32);
        assert!(
            w.iter().any(|l| {
                l.contains(
                "queues under lab (research 40 + prod 16) add up to 56 GPUs, more than lab's own 32"
            )
            }),
            "{w:?}"
        );
        // Leaves past the cluster where the top level sets no quota.
        for q in &mut cfg.queues {
            if q.name == "lab" {
                q.quota.nominal.gpus = None;
            }
        }
        let w = quota_overcommit(&cfg, 32);
        assert_eq!(
            w,
            vec!["the nominal GPU quotas of the leaf queues (research 40 + prod 16) add up to 56 GPUs, but the cluster has 32".to_string()]
        );
    }
}
