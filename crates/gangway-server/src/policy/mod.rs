//! Versioned scheduling policy: the scheduling part of the configuration
//! (queues and quotas, weights, priority classes each queue allows,
//! preemption and backfill settings, and the gates a change must pass) kept
//! in the store as numbered versions, so it changes without a restart, with
//! evidence, and can be rolled back in one command.
//!
//! Keys: `/policy/versions/<n>` (a [`PolicyVersion`], JSON) and
//! `/policy/current` (`{"version": n}`). Version 1 is seeded from the
//! configuration file at the first start; later starts (and a new leader
//! after a failover) load the current version from the store, so the file's
//! queues only matter once. The leader installs a version into its
//! scheduler state in place ([`gangway_sched::ClusterState::replace_queues`]):
//! it takes effect at the next cycle, and no pending or running job is lost.

pub mod watch;
pub mod whatif;

use crate::config::ServerConfig;
pub use crate::config::{check_scheduler, Gates};
use crate::control::{decode, encode, Control, ControlError};
use gangway_core::{QueueSpec, Time};
use gangway_sched::SchedulerConfig;
use gangway_store::{Compare, Op, Store};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use thiserror::Error;

/// Store key of the current version's number.
pub const CURRENT_KEY: &str = "/policy/current";
/// Prefix of the stored versions.
pub const VERSIONS_PREFIX: &str = "/policy/versions/";

/// Most queues a policy may declare.
pub const MAX_QUEUES: usize = 1000;
/// Longest reason accepted with a change, in bytes.
pub const MAX_REASON_BYTES: usize = 2000;

/// Store key of version `n`.
pub fn version_key(n: u64) -> String {
    format!("{VERSIONS_PREFIX}{n}")
}

/// The scheduling policy: what a version holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Queues (parents first): quotas, weights, allowed priority classes,
    /// non-preemptible jobs, time limits, ordering within the queue and the
    /// preemption rules for its jobs. A queue's `node` policy is security
    /// configuration and must match the configuration file's.
    #[serde(default)]
    pub queues: Vec<QueueSpec>,
    /// The scheduling policy by name (`scheduler.policy`) and the
    /// scheduler's settings.
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    /// Targets a change must meet.
    #[serde(default)]
    pub gates: Gates,
}

impl Policy {
    /// The policy the configuration file declares (version 1).
    pub fn from_config(cfg: &ServerConfig) -> Self {
        Policy {
            queues: cfg.queues.clone(),
            scheduler: cfg.scheduler.clone(),
            gates: cfg.gates,
        }
    }

    /// Parses a policy file (YAML or JSON), with the configuration's budgets.
    pub fn from_yaml(text: &str) -> Result<Self, PolicyError> {
        let p: Policy = crate::yaml::from_str(text).map_err(PolicyError::Parse)?;
        Ok(p)
    }

    /// The queue named `name`.
    pub fn queue(&self, name: &str) -> Option<&QueueSpec> {
        self.queues.iter().find(|q| q.name == name)
    }
}

/// What made a version.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Action {
    /// Seeded from the configuration file at the first start.
    Seed,
    /// `policy apply`.
    Apply,
    /// `policy rollback` to an earlier version (its policy copied).
    Rollback {
        /// The version restored.
        to: u64,
    },
    /// `policy apply --pilot`: the candidate's changes to these queues only
    /// (the version's policy); `promote` applies the whole candidate.
    Pilot {
        /// The pilot queues.
        queues: Vec<String>,
        /// The whole candidate.
        candidate: Box<Policy>,
    },
    /// `policy promote`: a pilot's whole candidate.
    Promote {
        /// The pilot version promoted.
        pilot: u64,
    },
}

/// A queue's settings a pilot may change (see [`pilot_policy`]).
pub const PILOTABLE: &str = "allowed_priorities, allow_non_preemptible, time_limit, ordering, min_run_seconds and preemption_budget";

/// Most queues one pilot may name.
pub const MAX_PILOT_QUEUES: usize = 64;

/// The policy of a pilot of `candidate` on `queues`: `current` with the
/// candidate's settings for those queues only. Pilotable are the settings
/// that govern only the queue's own jobs ([`PILOTABLE`]):
/// `allowed_priorities` (which classes order its jobs), `ordering` (the
/// order within the queue), the preemption rules for its jobs
/// (`allow_non_preemptible`, and `min_run_seconds` and `preemption_budget`,
/// which override the scheduler's knobs for its jobs as victims) and
/// `time_limit`. Anything else moves GPUs or order between queues (quotas,
/// weights, the tree, the scheduler's knobs) or judges changes (gates), so a
/// candidate that changes it is refused for a pilot with the setting named;
/// apply it without `--pilot`.
pub fn pilot_policy(
    current: &Policy,
    candidate: &Policy,
    queues: &[String],
) -> Result<Policy, PolicyError> {
    let refuse = |m: String| Err(PolicyError::Invalid(m));
    if queues.is_empty() || queues.len() > MAX_PILOT_QUEUES {
        return refuse(format!("pilot: name 1 to {MAX_PILOT_QUEUES} queues"));
    }
    for q in queues {
        if current.queue(q).is_none() {
            return refuse(format!("pilot: queue {q} does not exist"));
        }
    }
    if current.scheduler != candidate.scheduler {
        return refuse(
            "scheduler: cluster-wide knobs are not pilotable; apply without --pilot".into(),
        );
    }
    if current.gates != candidate.gates {
        return refuse("gates: not pilotable; apply without --pilot".into());
    }
    let names = |p: &Policy| p.queues.iter().map(|q| q.name.clone()).collect::<Vec<_>>();
    if names(current) != names(candidate) {
        return refuse(
            "queues: adding, removing or reordering queues is not pilotable; apply without --pilot"
                .into(),
        );
    }
    let mut out = current.clone();
    for (mine, theirs) in out.queues.iter_mut().zip(&candidate.queues) {
        let mut masked = theirs.clone();
        masked.allowed_priorities = mine.allowed_priorities.clone();
        masked.allow_non_preemptible = mine.allow_non_preemptible;
        masked.time_limit = mine.time_limit.clone();
        masked.ordering = mine.ordering;
        masked.min_run_seconds = mine.min_run_seconds;
        masked.preemption_budget = mine.preemption_budget;
        if masked != *mine {
            return refuse(format!(
                "queues[{}]: only {PILOTABLE} are pilotable (quota, weight and parent move GPUs between queues); apply without --pilot",
                mine.name
            ));
        }
        if queues.contains(&mine.name) {
            *mine = theirs.clone();
        }
    }
    if out == *current {
        return refuse("pilot: the candidate changes nothing in the pilot queues".into());
    }
    Ok(out)
}

/// The result of one gate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GateResult {
    /// Gate name (`max_p95_wait_worse_pct`, ...).
    pub gate: String,
    /// Where it was measured (`overall` or a queue).
    pub scope: String,
    /// The limit.
    pub limit: f64,
    /// What the what-if measured.
    pub value: f64,
    /// Whether it held.
    pub passed: bool,
}

/// Live wait figures of one queue, from jobs that started in a window.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LiveFigures {
    /// Jobs that started in the window.
    pub jobs: usize,
    /// Average wait (start − submit), seconds.
    pub avg_wait: f64,
    /// 95th percentile wait, seconds.
    pub p95_wait: f64,
}

/// Live figures for the day after a change.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct After {
    /// Start of the window (the change).
    pub from: Time,
    /// End of the window (a day later, or now while the day runs).
    pub to: Time,
    /// Whether the day is over (the figures are final).
    pub complete: bool,
    /// Every queue together.
    pub overall: LiveFigures,
    /// Per queue.
    pub queues: BTreeMap<String, LiveFigures>,
}

/// One stored version and its decision record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyVersion {
    /// Its number (1, 2, ...).
    pub version: u64,
    /// The policy.
    pub policy: Policy,
    /// Who made it.
    pub author: String,
    /// When (seconds since the epoch).
    pub at: Time,
    /// Why.
    pub reason: String,
    /// What made it.
    pub action: Action,
    /// The version it replaced.
    pub previous: Option<u64>,
    /// What changed from the previous version, one line per setting.
    pub diff: Vec<String>,
    /// The what-if run against the previous version (the evidence).
    pub evidence: Option<whatif::WhatIf>,
    /// The gates of the previous version, judged on the evidence.
    pub gates: Vec<GateResult>,
    /// Applied although a gate failed (`--force`).
    pub forced: bool,
    /// Live figures of the day after the change (filled in by the leader).
    #[serde(default)]
    pub after: Option<After>,
}

/// Why a policy operation failed.
#[derive(Debug, Error)]
pub enum PolicyError {
    /// The policy file does not parse.
    #[error("policy: {0}")]
    Parse(String),
    /// The policy is not valid here (the problem is named).
    #[error("policy: {0}")]
    Invalid(String),
    /// No such version.
    #[error("policy version {0} does not exist")]
    NoSuchVersion(u64),
    /// A gate failed (the table is in the message).
    #[error("policy refused by its gates (use --force with --reason to apply anyway):\n{0}")]
    GateFailed(String),
    /// Someone else changed the policy first.
    #[error("the policy changed meanwhile (now version {0}); retry")]
    Conflict(u64),
    /// Store or state.
    #[error(transparent)]
    Control(#[from] ControlError),
}

impl From<gangway_store::StoreError> for PolicyError {
    fn from(e: gangway_store::StoreError) -> Self {
        PolicyError::Control(ControlError::Store(e))
    }
}

/// The configuration as the live policy shapes it: the file's, with the
/// current version's queues and knobs (what submissions are checked against).
#[derive(Debug)]
pub struct Live(RwLock<Arc<ServerConfig>>);

impl Live {
    /// Starts with the file's configuration.
    pub fn new(cfg: &ServerConfig) -> Self {
        Live(RwLock::new(Arc::new(cfg.clone())))
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<ServerConfig> {
        match self.0.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Puts `policy` in force for submissions.
    pub fn set(&self, policy: &Policy) {
        let mut cfg = (*self.config()).clone();
        cfg.queues = policy.queues.clone();
        cfg.scheduler = policy.scheduler.clone();
        cfg.gates = policy.gates;
        let next = Arc::new(cfg);
        match self.0.write() {
            Ok(mut g) => *g = next,
            Err(p) => *p.into_inner() = next,
        }
    }
}

/// The current version's number, with the key's revision (0 when absent).
pub fn current_number<S: Store>(store: &S) -> Result<Option<(u64, u64)>, PolicyError> {
    let Some(kv) = store.get(CURRENT_KEY)? else {
        return Ok(None);
    };
    #[derive(Deserialize)]
    struct Cur {
        version: u64,
    }
    let c: Cur = decode(&kv.key, &kv.value)?;
    Ok(Some((c.version, kv.mod_revision)))
}

/// Version `n`.
pub fn load_version<S: Store>(store: &S, n: u64) -> Result<PolicyVersion, PolicyError> {
    let key = version_key(n);
    let kv = store.get(&key)?.ok_or(PolicyError::NoSuchVersion(n))?;
    Ok(decode(&key, &kv.value)?)
}

/// Every version, oldest first.
pub fn all_versions<S: Store>(store: &S) -> Result<Vec<PolicyVersion>, PolicyError> {
    let mut v: Vec<PolicyVersion> = store
        .range(VERSIONS_PREFIX)?
        .iter()
        .map(|kv| decode(&kv.key, &kv.value))
        .collect::<Result<_, _>>()?;
    v.sort_by_key(|x| x.version);
    Ok(v)
}

/// The version in force.
pub fn current<S: Store>(store: &S) -> Result<Option<PolicyVersion>, PolicyError> {
    match current_number(store)? {
        Some((n, _)) => load_version(store, n).map(Some),
        None => Ok(None),
    }
}

/// Writes `v` as the next version, if the current version is still
/// `expected` (compare-and-swap on `/policy/current`).
pub fn commit<S: Store>(
    store: &S,
    v: &PolicyVersion,
    expected: Option<(u64, u64)>,
) -> Result<(), PolicyError> {
    let cmp = match expected {
        Some((_, rev)) => Compare::Revision(CURRENT_KEY.into(), rev),
        None => Compare::Absent(CURRENT_KEY.into()),
    };
    let ops = [
        Op::Put(version_key(v.version), encode(v)),
        Op::Put(
            CURRENT_KEY.into(),
            encode(&serde_json::json!({ "version": v.version })),
        ),
    ];
    let r = store.txn(&[cmp, Compare::Absent(version_key(v.version))], &ops)?;
    if !r.succeeded {
        let now = current_number(store)?.map_or(0, |(n, _)| n);
        return Err(PolicyError::Conflict(now));
    }
    Ok(())
}

/// Overwrites a stored version's record (the leader filling in `after`).
pub fn store_version<S: Store>(store: &S, v: &PolicyVersion) -> Result<(), PolicyError> {
    store.put(&version_key(v.version), &encode(v))?;
    Ok(())
}

/// Checks `candidate` against the configuration file and the live state:
/// the queue tree (names, parents before children, weights, children's
/// nominal quotas within their parent's, top-level quotas within the
/// registered GPUs), no queue holding a pending or running job removed, each
/// queue's node policy as the file sets it, knobs and gates in range.
pub fn check<S: Store>(
    candidate: &Policy,
    cfg: &ServerConfig,
    c: &Control<S>,
) -> Result<(), PolicyError> {
    let gpus: u64 = c
        .cluster
        .nodes()
        .iter()
        .map(|n| n.spec.gpus.len() as u64)
        .sum();
    check_against(candidate, cfg, gpus, &c.jobs)
}

/// [`check`] against the read view (no state lock): its registered GPUs
/// and jobs. A what-if reads it; installing a version checks again under
/// the lock.
pub fn check_view(
    candidate: &Policy,
    cfg: &ServerConfig,
    view: &crate::view::ReadView,
) -> Result<(), PolicyError> {
    let gpus: u64 = view
        .cluster
        .nodes
        .iter()
        .map(|n| n.spec.gpus.len() as u64)
        .sum();
    check_against(candidate, cfg, gpus, &view.jobs)
}

/// [`check`] with the cluster's registered GPUs and its jobs.
fn check_against(
    candidate: &Policy,
    cfg: &ServerConfig,
    gpus: u64,
    jobs: &crate::records::JobMap,
) -> Result<(), PolicyError> {
    let bad = |m: String| Err(PolicyError::Invalid(m));
    check_scheduler(&candidate.scheduler).map_err(PolicyError::Invalid)?;
    candidate.gates.check().map_err(PolicyError::Invalid)?;
    if candidate.queues.len() > MAX_QUEUES {
        return bad(format!("queues: at most {MAX_QUEUES}"));
    }
    let mut fresh = gangway_sched::ClusterState::default();
    for (i, q) in candidate.queues.iter().enumerate() {
        if q.name.len() > 253 {
            return bad("queues: a name is longer than 253 bytes".into());
        }
        for (f, v) in
            std::iter::once(("name", &q.name)).chain(q.parent.iter().map(|p| ("parent", p)))
        {
            gangway_core::text::check_printable(&format!("queues[{i}].{f}"), v)
                .map_err(PolicyError::Invalid)?;
        }
        fresh
            .add_queue(q.clone())
            .map_err(|e| PolicyError::Invalid(format!("queues: {e}")))?;
        let file = cfg
            .queues
            .iter()
            .find(|f| f.name == q.name)
            .map(|f| f.node.clone())
            .unwrap_or_default();
        if q.node != file {
            return bad(format!(
                "queues[{}].node: a queue's node policy (mounts, root, host network) is security configuration; change it in the server's configuration file",
                q.name
            ));
        }
        q.check_preemption_rules()
            .map_err(|e| PolicyError::Invalid(format!("queues[{}].{e}", q.name)))?;
        for (what, t) in [
            ("default", &q.time_limit.default),
            ("max", &q.time_limit.max),
        ] {
            if let Some(t) = t {
                let secs = t.seconds().map_err(|e| {
                    PolicyError::Invalid(format!("queues[{}].time_limit.{what}: {e}", q.name))
                })?;
                if secs == 0 || secs > gangway_core::job::MAX_TIME_LIMIT_SECONDS {
                    return bad(format!(
                        "queues[{}].time_limit.{what}: must be between 1 second and 366 days",
                        q.name
                    ));
                }
            }
        }
    }
    for info in fresh.queues() {
        for res in gangway_core::Resource::ALL {
            let Some(nom) = info.spec.quota.nominal.get(res) else {
                continue;
            };
            let kids: u64 = info
                .children
                .iter()
                .filter_map(|k| fresh.queues()[*k as usize].spec.quota.nominal.get(res))
                .fold(0u64, u64::saturating_add);
            if kids > nom {
                return bad(format!(
                    "queues[{}].quota.nominal: its children's nominal quotas add up to {kids} {res} but its own is {nom}",
                    info.spec.name
                ));
            }
        }
    }
    if gpus > 0 {
        let top: u64 = fresh
            .queues()
            .iter()
            .filter(|q| q.parent.is_none())
            .filter_map(|q| q.spec.quota.nominal.gpus)
            .fold(0u64, u64::saturating_add);
        if top > gpus {
            return bad(format!(
                "queues: top-level nominal quotas add up to {top} GPUs but the cluster's nodes have {gpus}"
            ));
        }
    }
    let mut busy: BTreeMap<&str, (usize, gangway_core::JobId)> = BTreeMap::new();
    for (r, _) in jobs.values() {
        if !r.state.is_terminal() {
            let e = busy.entry(r.spec.queue.as_str()).or_insert((0, r.id));
            e.0 += 1;
        }
    }
    for (q, (n, first)) in busy {
        if fresh.queue_index(q).is_none() {
            return bad(format!(
                "queues: queue {q} cannot be removed: {n} of its jobs are pending or running (job {first} first)"
            ));
        }
    }
    Ok(())
}

/// Puts `policy` in force in the scheduler's state (queues in place, jobs
/// kept) and knobs; the next cycle uses it. Changes nothing on error.
pub fn install<S: Store>(c: &mut Control<S>, policy: &Policy) -> Result<(), PolicyError> {
    c.cluster
        .replace_queues(&policy.queues)
        .map_err(|e| PolicyError::Invalid(format!("queues: {e}")))?;
    c.policy.queues = policy.queues.clone();
    c.policy.sched = gangway_sched::policies::configure(&policy.scheduler);
    // A queue's ordering or the scheduling policy may have changed: re-rank
    // every job at the next cycle.
    c.ranks.refreshed_at = None;
    Ok(())
}

/// At start (and when a replica becomes leader): loads the current version
/// and installs it, or seeds version 1 from the configuration file when the
/// store has none. A current version that cannot be installed is an error
/// naming it: the server does not schedule under a policy other than the
/// one the store says is in force.
pub fn load_or_seed<S: Store>(
    c: &mut Control<S>,
    cfg: &ServerConfig,
    now: Time,
) -> Result<Policy, PolicyError> {
    match current(&c.store)? {
        Some(v) => {
            let policy = upgrade_knobs(c, &v, cfg, now)?;
            install(c, &policy).map_err(|e| {
                PolicyError::Invalid(format!(
                    "the policy version in force ({}) cannot be installed: {e}",
                    v.version
                ))
            })?;
            if Policy::from_config(cfg) != policy {
                tracing::info!(
                    "policy: the configuration file's queues, scheduler or gates differ from policy version {} in force; the file seeds version 1 only (change the policy with gangway policy apply)",
                    v.version
                );
            }
            Ok(policy)
        }
        None => {
            let policy = Policy::from_config(cfg);
            let v = PolicyVersion {
                version: 1,
                policy: policy.clone(),
                author: "config".into(),
                at: now,
                reason: "seeded from the configuration file".into(),
                action: Action::Seed,
                previous: None,
                diff: Vec::new(),
                evidence: None,
                gates: Vec::new(),
                forced: false,
                after: None,
            };
            // A follower cannot write: the leader seeds it.
            if let Err(e) = commit(&c.store, &v, None) {
                tracing::warn!("policy: version 1 not stored yet ({e})");
            }
            install(c, &policy)?;
            Ok(policy)
        }
    }
}

/// Whether stored version `v` predates `backfill` and `plan_depth` in the
/// versioned policy (they were top-level configuration keys then).
fn predates_backfill_knobs<S: Store>(store: &S, v: u64) -> Result<bool, PolicyError> {
    let key = version_key(v);
    let Some(kv) = store.get(&key)? else {
        return Ok(false);
    };
    let raw: Value = decode(&key, &kv.value)?;
    Ok(raw.pointer("/policy/scheduler/backfill").is_none())
}

/// The policy to install for stored version `v`. A version stored before
/// backfill settings were versioned policy ran with the configuration
/// file's `backfill` and `plan_depth`: they are kept, and where they differ
/// from the defaults the leader records them as the next version (so the
/// decision log says so, and a rollback returns to them).
fn upgrade_knobs<S: Store>(
    c: &Control<S>,
    v: &PolicyVersion,
    cfg: &ServerConfig,
    now: Time,
) -> Result<Policy, PolicyError> {
    if !predates_backfill_knobs(&c.store, v.version)? {
        return Ok(v.policy.clone());
    }
    let mut policy = v.policy.clone();
    policy.scheduler.backfill = cfg.scheduler.backfill;
    policy.scheduler.plan_depth = cfg.scheduler.plan_depth;
    if policy == v.policy {
        return Ok(policy);
    }
    let next = PolicyVersion {
        version: v.version + 1,
        policy: policy.clone(),
        author: "config".into(),
        at: now,
        reason: "backfill and plan_depth are versioned policy now: kept as the configuration file set them".into(),
        action: Action::Apply,
        previous: Some(v.version),
        diff: diff(&v.policy, &policy),
        evidence: None,
        gates: Vec::new(),
        forced: false,
        after: None,
    };
    // A follower cannot write: the leader records it.
    match current_number(&c.store)? {
        Some(cur) if cur.0 == v.version => {
            if let Err(e) = commit(&c.store, &next, Some(cur)) {
                tracing::warn!("policy: version {} not stored yet ({e})", next.version);
            }
        }
        _ => {}
    }
    Ok(policy)
}

fn flatten(prefix: &str, v: &Value, out: &mut BTreeMap<String, String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&p, x, out);
            }
        }
        Value::Null => {}
        other => {
            out.insert(prefix.to_string(), other.to_string());
        }
    }
}

fn paths(p: &Policy) -> BTreeMap<String, String> {
    let mut v = serde_json::to_value(p).unwrap_or(Value::Null);
    if let Some(Value::Array(qs)) = v.get_mut("queues").map(std::mem::take) {
        let mut by_name = serde_json::Map::new();
        for (i, q) in qs.into_iter().enumerate() {
            let name = q
                .get("name")
                .and_then(Value::as_str)
                .map_or_else(|| i.to_string(), str::to_string);
            by_name.insert(name, q);
        }
        v["queues"] = Value::Object(by_name);
    }
    let mut out = BTreeMap::new();
    flatten("", &v, &mut out);
    out
}

/// What changed from `a` to `b`, one line per setting (`queues.vision.quota.nominal.gpus: 16 -> 8`).
pub fn diff(a: &Policy, b: &Policy) -> Vec<String> {
    let (pa, pb) = (paths(a), paths(b));
    let mut out = Vec::new();
    for (k, va) in &pa {
        match pb.get(k) {
            Some(vb) if vb == va => {}
            Some(vb) => out.push(format!("{k}: {va} -> {vb}")),
            None => out.push(format!("{k}: {va} -> (unset)")),
        }
    }
    for (k, vb) in &pb {
        if !pa.contains_key(k) {
            out.push(format!("{k}: (unset) -> {vb}"));
        }
    }
    out
}

/// Live figures of jobs that started in `[from, to)`, per queue and overall.
pub fn live_figures<S: Store>(c: &Control<S>, from: Time, to: Time) -> After {
    live_figures_of(&c.jobs, from, to)
}

/// [`live_figures`] of a job map (the read view's: no state lock).
pub fn live_figures_of(jobs: &crate::records::JobMap, from: Time, to: Time) -> After {
    let mut per: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut all = Vec::new();
    for (r, _) in jobs.values() {
        let started = r
            .events
            .iter()
            .find(|e| e.kind == "scheduled")
            .map(|e| e.at);
        let Some(s) = started else { continue };
        if s < from || s >= to {
            continue;
        }
        let w = s.saturating_sub(r.submitted_at) as f64;
        per.entry(r.spec.queue.clone()).or_default().push(w);
        all.push(w);
    }
    let fig = |v: &mut Vec<f64>| {
        let s = gangway_sim_engine::metrics::Stats::of(v);
        LiveFigures {
            jobs: s.n,
            avg_wait: s.mean,
            p95_wait: s.p95,
        }
    };
    After {
        from,
        to,
        complete: false,
        overall: fig(&mut all),
        queues: per.iter_mut().map(|(k, v)| (k.clone(), fig(v))).collect(),
    }
}

/// Seconds after a change whose live figures the decision log keeps.
pub const AFTER_SECONDS: Time = 86_400;

/// Seconds between two looks at the decision log's live figures.
const TICK_SECONDS: Time = 60;
static LAST_TICK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Called by the leader after each cycle: at most once a minute, fills in
/// the live figures of versions whose day after is over ([`fill_in_after`]).
pub fn tick<S: Store>(c: &Control<S>, now: Time) {
    use std::sync::atomic::Ordering;
    let last = LAST_TICK.load(Ordering::Relaxed);
    if now < last.saturating_add(TICK_SECONDS) {
        return;
    }
    LAST_TICK.store(now, Ordering::Relaxed);
    if let Err(e) = fill_in_after(c, now) {
        tracing::warn!("policy: live figures not stored: {e}");
    }
}

/// The leader's bookkeeping, called now and then: fills in the live figures
/// of the day after each recent change, and stores them once the day is over.
pub fn fill_in_after<S: Store>(c: &Control<S>, now: Time) -> Result<(), PolicyError> {
    for mut v in all_versions(&c.store)? {
        if v.after.as_ref().is_some_and(|a| a.complete) {
            continue;
        }
        let end = v.at.saturating_add(AFTER_SECONDS);
        if now < end {
            continue;
        }
        let mut a = live_figures(c, v.at, end);
        a.complete = true;
        v.after = Some(a);
        store_version(&c.store, &v)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{JobEvent, JobRecord};
    use gangway_core::{JobId, JobSpec, JobState};
    use gangway_store::RedbStore;

    fn cfg() -> ServerConfig {
        ServerConfig::from_yaml(
            "admin_token: admin-secret\nagent_token: agent-secret\nqueues:\n  - name: lab\n    quota: { nominal: { gpus: 16 } }\n  - name: a\n    parent: lab\n    quota: { nominal: { gpus: 8 } }\n    node: { allow_root: true }\ngates: { max_p95_wait_worse_pct: 10 }\n",
        )
        .expect("config")
    }

    #[test]
    fn the_first_start_seeds_version_one_and_later_starts_load_the_current_version() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("s.redb");
        let cfg = cfg();
        {
            let store = RedbStore::open(&path).expect("store");
            let mut c = Control::open(store, &cfg.queues).expect("control");
            let p = load_or_seed(&mut c, &cfg, 100).expect("seed");
            assert_eq!(p, Policy::from_config(&cfg));
            let v = current(&c.store).expect("read").expect("v1");
            assert_eq!((v.version, v.action, v.at), (1, Action::Seed, 100));
            // Version 2 halves queue a.
            let mut next = p.clone();
            next.queues[1].quota.nominal.gpus = Some(4);
            let v2 = PolicyVersion {
                version: 2,
                policy: next.clone(),
                author: "admin".into(),
                at: 200,
                reason: "r".into(),
                action: Action::Apply,
                previous: Some(1),
                diff: diff(&p, &next),
                evidence: None,
                gates: Vec::new(),
                forced: false,
                after: None,
            };
            assert_eq!(v2.diff, vec!["queues.a.quota.nominal.gpus: 8 -> 4"]);
            check(&next, &cfg, &c).expect("valid");
            commit(&c.store, &v2, current_number(&c.store).expect("n")).expect("commit");
            // A second writer that read version 1 loses.
            let stale = PolicyVersion {
                version: 2,
                ..v2.clone()
            };
            assert!(matches!(
                commit(&c.store, &stale, Some((1, 1))),
                Err(PolicyError::Conflict(2))
            ));
        }
        // A restart (or a new leader) installs version 2, not the file's queues.
        let store = RedbStore::open(&path).expect("store");
        let mut c = Control::open(store, &cfg.queues).expect("control");
        let p = load_or_seed(&mut c, &cfg, 300).expect("load");
        assert_eq!(p.queues[1].quota.nominal.gpus, Some(4));
        let a = c.cluster.queue_index("a").expect("a");
        assert_eq!(
            c.cluster.queues()[a as usize].spec.quota.nominal.gpus,
            Some(4)
        );
        assert_eq!(all_versions(&c.store).expect("all").len(), 2);
    }

    #[test]
    fn invalid_candidates_are_refused_with_the_problem_named() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let cfg = cfg();
        let mut c = Control::open(store, &cfg.queues).expect("control");
        let base = load_or_seed(&mut c, &cfg, 1).expect("seed");
        let r = JobRecord::submitted(JobId(1), "alice", JobSpec::new("j", "a", 1, 1), 5);
        c.jobs.insert(r.id, (r, 0));
        let refuse = |p: &Policy, words: &str| {
            let e = check(p, &cfg, &c).expect_err(words).to_string();
            assert!(e.contains(words), "{words:?} not in {e}");
        };
        let mut p = base.clone();
        p.queues[1].quota.nominal.gpus = Some(32);
        refuse(
            &p,
            "queues[lab].quota.nominal: its children's nominal quotas add up to 32 gpus",
        );
        let mut p = base.clone();
        p.queues.truncate(1);
        refuse(
            &p,
            "queue a cannot be removed: 1 of its jobs are pending or running",
        );
        let mut p = base.clone();
        p.queues[1].node.allow_root = false;
        refuse(&p, "queues[a].node");
        let mut p = base.clone();
        p.queues[1].parent = Some("nowhere".into());
        refuse(&p, "nowhere");
        let mut p = base.clone();
        p.queues[1].weight = 0;
        refuse(&p, "weight must be at least 1");
        let mut p = base.clone();
        p.scheduler.min_run_seconds = 100 * 86_400;
        refuse(&p, "scheduler.min_run_seconds");
        p.scheduler.min_run_seconds = 0;
        p.scheduler.max_pending_examined = 10;
        refuse(&p, "scheduler.max_pending_examined");
        let mut p = base.clone();
        p.queues[1].min_run_seconds = Some(8 * 86_400);
        refuse(
            &p,
            "queues[a].min_run_seconds: 691200 is out of range (0 to 604800)",
        );
        let mut p = base.clone();
        p.queues[1].preemption_budget = Some(5000);
        refuse(&p, "queues[a].preemption_budget: 5000 is out of range");
        let mut p = base.clone();
        p.gates.min_jain = Some(1.5);
        refuse(&p, "gates.min_jain");
        let mut p = base.clone();
        p.queues.push(gangway_core::QueueSpec::unlimited(
            "b\u{1b}]52;c;eA==\u{7}",
            Some("lab"),
        ));
        refuse(
            &p,
            "queues[2].name: control character U+001B is not allowed",
        );
        let e = Policy::from_yaml("queues: [{ name: x, allowed_priorities: [urgent] }]")
            .expect_err("unknown class");
        assert!(e.to_string().contains("urgent"), "{e}");
        assert!(Policy::from_yaml("schedular: {}").is_err());
    }

    #[test]
    fn backfill_settings_are_versioned_diffed_installed_and_checked() {
        use gangway_sched::Backfill;
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let cfg = cfg();
        let mut c = Control::open(store, &cfg.queues).expect("control");
        let base = load_or_seed(&mut c, &cfg, 1).expect("seed");
        assert_eq!(c.policy.sched.backfill, Backfill::Easy);
        let p = Policy::from_yaml(
            "queues: [{ name: lab, quota: { nominal: { gpus: 16 } } }, { name: a, parent: lab, quota: { nominal: { gpus: 8 } }, node: { allow_root: true } }]\nscheduler: { backfill: \"off\", plan_depth: 10 }\ngates: { max_p95_wait_worse_pct: 10 }\n",
        )
        .expect("policy");
        assert_eq!(
            diff(&base, &p),
            vec![
                "scheduler.backfill: \"easy\" -> \"off\"",
                "scheduler.plan_depth: 200 -> 10"
            ]
        );
        check(&p, &cfg, &c).expect("valid");
        install(&mut c, &p).expect("install");
        assert_eq!(
            (c.policy.sched.backfill, c.policy.sched.plan_depth),
            (Backfill::Off, 10)
        );
        install(&mut c, &base).expect("back");
        assert_eq!(
            (c.policy.sched.backfill, c.policy.sched.plan_depth),
            (Backfill::Easy, 200)
        );
        let mut deep = base.clone();
        deep.scheduler.plan_depth = 1_000_000;
        let e = check(&deep, &cfg, &c).expect_err("deep").to_string();
        assert!(
            e.contains("scheduler.plan_depth: 1000000 is out of range"),
            "{e}"
        );
        // The growing minimum run reaches the installed configuration.
        let grows = Policy::from_yaml(
            "queues: [{ name: lab, quota: { nominal: { gpus: 16 } } }, { name: a, parent: lab, quota: { nominal: { gpus: 8 } }, node: { allow_root: true } }]\nscheduler: { min_run_seconds: 1200, min_run_grows: true }\ngates: { max_p95_wait_worse_pct: 10 }\n",
        )
        .expect("policy");
        assert_eq!(
            diff(&base, &grows),
            vec![
                "scheduler.min_run_grows: false -> true",
                "scheduler.min_run_seconds: 0 -> 1200"
            ]
        );
        install(&mut c, &grows).expect("install");
        assert!(c.policy.sched.min_run_grows && c.policy.sched.min_run_seconds == 1200);
        install(&mut c, &base).expect("back");
        assert!(!c.policy.sched.min_run_grows);
        let e = Policy::from_yaml("scheduler: { backfill: sometimes }").expect_err("mode");
        assert!(
            e.to_string().contains("backfill: expected off, easy"),
            "{e}"
        );
    }

    #[test]
    fn a_version_stored_before_backfill_was_policy_keeps_the_files_settings() {
        use gangway_sched::Backfill;
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let old_cfg = ServerConfig::from_yaml(
            "admin_token: admin-secret\nagent_token: agent-secret\nbackfill: conservative\n",
        )
        .expect("config");
        // Version 1 as an older server stored it: no backfill in its knobs.
        let mut v1 = serde_json::to_value(PolicyVersion {
            version: 1,
            policy: Policy::from_config(&old_cfg),
            author: "config".into(),
            at: 5,
            reason: "seeded".into(),
            action: Action::Seed,
            previous: None,
            diff: Vec::new(),
            evidence: None,
            gates: Vec::new(),
            forced: false,
            after: None,
        })
        .expect("json");
        let knobs = v1["policy"]["scheduler"].as_object_mut().expect("knobs");
        knobs.remove("backfill");
        knobs.remove("plan_depth");
        store
            .put(&version_key(1), v1.to_string().as_bytes())
            .expect("put");
        store.put(CURRENT_KEY, br#"{"version":1}"#).expect("put");
        let mut c = Control::open(store, &old_cfg.queues).expect("control");
        let p = load_or_seed(&mut c, &old_cfg, 10).expect("load");
        assert_eq!(p.scheduler.backfill, Backfill::Conservative);
        assert_eq!(c.policy.sched.backfill, Backfill::Conservative);
        let v2 = current(&c.store).expect("read").expect("v2");
        assert_eq!(v2.version, 2);
        assert_eq!(
            v2.diff,
            vec!["scheduler.backfill: \"easy\" -> \"conservative\""]
        );
        // Loaded again: nothing more to record.
        load_or_seed(&mut c, &old_cfg, 20).expect("load");
        assert_eq!(all_versions(&c.store).expect("all").len(), 2);
    }

    #[test]
    fn a_version_stored_with_the_knobs_of_before_loads_and_runs_the_default_policy() {
        // Version 1 exactly as the server stored it when the scheduler
        // section was a separate knob struct: no `policy` field.
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let v1 = r#"{"version":1,"policy":{"queues":[{"name":"default"}],"scheduler":{"backfill":"conservative","plan_depth":50,"preemption":true,"fair_share":false,"max_preemption_searches":8,"max_preemptions_per_cycle":256,"preemption_budget":3,"min_run_seconds":600,"min_run_grows":true,"max_pending_examined":20000},"gates":{"max_p95_wait_worse_pct":null,"max_utilisation_drop_points":null,"min_jain":null}},"author":"config","at":5,"reason":"seeded","action":{"kind":"seed"},"previous":null,"diff":[],"evidence":null,"gates":[],"forced":false,"after":null}"#;
        store.put(&version_key(1), v1.as_bytes()).expect("put");
        store.put(CURRENT_KEY, br#"{"version":1}"#).expect("put");
        let v = load_version(&store, 1).expect("an old version still loads");
        let s = &v.policy.scheduler;
        assert_eq!(s.policy, "gangway");
        assert_eq!(s.backfill, gangway_sched::Backfill::Conservative);
        assert_eq!(
            (s.plan_depth, s.fair_share, s.max_preemption_searches),
            (50, false, 8)
        );
        assert_eq!(
            (s.preemption_budget, s.min_run_seconds, s.min_run_grows),
            (Some(3), 600, true)
        );
        // The fields the stored form leaves out are the core's defaults.
        let d = SchedulerConfig::default();
        assert_eq!(
            (s.strict_order, s.plan_budget, s.max_victims_examined),
            (d.strict_order, d.plan_budget, d.max_victims_examined)
        );
        let cfg = ServerConfig::from_yaml("admin_token: admin-secret\nagent_token: agent-secret\n")
            .expect("config");
        let mut c = Control::open(store, &v.policy.queues).expect("control");
        let p = load_or_seed(&mut c, &cfg, 10).expect("installs");
        assert_eq!(p, v.policy);
        assert_eq!(c.policy.sched, v.policy.scheduler);
        assert_eq!(
            all_versions(&c.store).expect("all").len(),
            1,
            "nothing to upgrade"
        );
    }

    #[test]
    fn a_policy_names_a_registered_scheduling_policy_whose_switches_it_runs() {
        let mut p = Policy::from_config(&cfg());
        assert_eq!(p.scheduler.policy, "gangway");
        p.scheduler.policy = "lottery".into();
        let e = check_scheduler(&p.scheduler)
            .expect_err("unknown")
            .to_string();
        assert!(
            e.contains("scheduler.policy: unknown scheduling policy \"lottery\"; known: gangway, fifo, priority, slurm, capacity, tiresias, qssf"),
            "{e}"
        );
        let p = Policy::from_yaml("scheduler: { policy: fifo, preemption: true }").expect("reads");
        check_scheduler(&p.scheduler).expect("fifo is known");
        // FIFO's switches win over the site's: no preemption, strict order.
        let core = gangway_sched::policies::configure(&p.scheduler);
        assert_eq!((core.preemption, core.strict_order), (false, true));
        assert_eq!(core.policy, "fifo");
        let e = Policy::from_yaml("scheduler: { strict_order: true }").expect_err("not a field");
        assert!(e.to_string().contains("strict_order"), "{e}");
    }

    #[test]
    fn a_pilot_takes_only_the_pilot_queues_own_rules() {
        let base = Policy::from_config(&cfg());
        let mut cand = base.clone();
        for q in &mut cand.queues {
            q.allow_non_preemptible = true;
        }
        let p = pilot_policy(&base, &cand, &["a".into()]).expect("pilotable");
        assert!(p.queue("a").expect("a").allow_non_preemptible);
        assert!(!p.queue("lab").expect("lab").allow_non_preemptible);
        let mut quota = cand.clone();
        quota.queues[0].quota.nominal.gpus = Some(8);
        let e = pilot_policy(&base, &quota, &["a".into()]).expect_err("quota");
        assert!(
            e.to_string()
                .contains("queues[lab]: only allowed_priorities"),
            "{e}"
        );
        let mut knob = cand.clone();
        knob.scheduler.fair_share = !knob.scheduler.fair_share;
        assert!(pilot_policy(&base, &knob, &["a".into()])
            .expect_err("knob")
            .to_string()
            .contains("scheduler"));
        assert!(pilot_policy(&base, &cand, &["zzz".into()]).is_err());
        assert!(pilot_policy(&base, &cand, &[]).is_err());
        assert!(pilot_policy(&base, &base, &["a".into()])
            .expect_err("no change")
            .to_string()
            .contains("changes nothing"));
    }

    #[test]
    fn a_fifo_pilot_orders_only_its_queue_by_submission_and_min_run_is_pilotable() {
        use crate::control::Report;
        let cfg = ServerConfig::from_yaml(
            "admin_token: admin-secret\nagent_token: agent-secret\nqueues:\n  - name: a\n  - name: b\n  - name: c\n",
        )
        .expect("config");
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let mut c = Control::open(store, &cfg.queues).expect("control");
        let base = load_or_seed(&mut c, &cfg, 0).expect("seed");
        c.register_node(
            gangway_core::NodeSpec::uniform("n", "leaf0", "spine0", 4, "H100", 80),
            &crate::nodes::Registrant::Join,
            true,
            "join",
            0,
        )
        .expect("node");
        let whole = |q: &str, runtime: u64| {
            let mut s = JobSpec::new("j", q, 1, 4);
            s.runtime_seconds = Some(runtime);
            s
        };
        let blocker = c.submit("alice", whole("c", 60), 0).expect("submit");
        c.cycle(1).expect("cycle");
        // In each queue a long job, then a short one.
        let a_long = c.submit("alice", whole("a", 7200), 2).expect("submit");
        let a_short = c.submit("alice", whole("a", 600), 3).expect("submit");
        let b_long = c.submit("alice", whole("b", 7200), 2).expect("submit");
        let b_short = c.submit("alice", whole("b", 600), 3).expect("submit");
        c.cycle(4).expect("cycle");
        let rank = |c: &Control<RedbStore>, id| c.cluster.job(id).expect("in").rank;
        assert!(
            rank(&c, a_short) < rank(&c, a_long),
            "ranked before the pilot"
        );

        // Pilot `ordering: fifo` on a (the candidate orders both queues so).
        let mut cand = base.clone();
        for q in &mut cand.queues {
            q.ordering = gangway_core::QueueOrdering::Fifo;
        }
        check(&cand, &cfg, &c).expect("valid");
        let pilot = pilot_policy(&base, &cand, &["a".into()]).expect("pilotable");
        assert_eq!(
            diff(&base, &pilot),
            vec!["queues.a.ordering: (unset) -> \"fifo\""]
        );
        install(&mut c, &pilot).expect("install");
        // Re-ranked at the next cycle, not at the next periodic refresh.
        c.cycle(6).expect("cycle");
        assert_eq!((rank(&c, a_long), rank(&c, a_short)), (0, 0));
        assert!(rank(&c, b_short) < rank(&c, b_long), "b still ranks");

        // The node frees one job at a time: record the order they start in
        // (no agent sends heartbeats here: the node stays Ready meanwhile).
        c.nodes.lifecycle.node_not_ready_seconds = 3600;
        c.nodes.lifecycle.node_lost_seconds = 7200;
        let mut order = Vec::new();
        let (mut running, mut t) = (blocker, 10);
        loop {
            let attempt = c.jobs[&running].0.attempt;
            c.report("n", running, Some(attempt), Report::Running, t)
                .expect("running");
            c.report("n", running, Some(attempt), Report::Exited(0), t + 1)
                .expect("exited");
            let d = c.cycle(t + 2).expect("cycle");
            let Some(b) = d.binds.first() else { break };
            running = b.job;
            order.push(running);
            t += 10;
        }
        assert_eq!(order.len(), 4, "{order:?}");
        let at = |id| order.iter().position(|j| *j == id).expect("started");
        assert!(
            at(a_long) < at(a_short),
            "fifo: submit order in a {order:?}"
        );
        assert!(
            at(b_short) < at(b_long),
            "ranked: shorter first in b {order:?}"
        );

        // A queue's minimum run time before preemption is pilotable too...
        let mut min_run = base.clone();
        for q in &mut min_run.queues {
            q.min_run_seconds = Some(600);
        }
        let p = pilot_policy(&base, &min_run, &["b".into()]).expect("pilotable");
        assert_eq!(p.queue("b").expect("b").min_run_seconds, Some(600));
        assert_eq!(p.queue("a").expect("a").min_run_seconds, None);
        // ...a quota still is not.
        let mut quota = min_run.clone();
        quota.queues[1].quota.nominal.gpus = Some(2);
        let e = pilot_policy(&base, &quota, &["b".into()]).expect_err("quota");
        assert!(
            e.to_string().contains(
                "queues[b]: only allowed_priorities, allow_non_preemptible, time_limit, ordering, min_run_seconds and preemption_budget are pilotable"
            ),
            "{e}"
        );
    }

    #[test]
    fn the_day_after_a_change_is_measured_and_stored_once_over() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let cfg = cfg();
        let mut c = Control::open(store, &cfg.queues).expect("control");
        load_or_seed(&mut c, &cfg, 1_000).expect("seed");
        for (id, submit, start) in [(1, 900, 1_100), (2, 1_000, 1_600), (3, 90_000, 90_010)] {
            let mut r =
                JobRecord::submitted(JobId(id), "alice", JobSpec::new("j", "a", 1, 1), submit);
            r.state = JobState::Succeeded;
            r.events.push(JobEvent {
                at: start,
                kind: "scheduled".into(),
                message: String::new(),
                count: 1,
                last_at: None,
            });
            c.jobs.insert(r.id, (r, 0));
        }
        // Not a day yet: nothing stored.
        fill_in_after(&c, 50_000).expect("tick");
        assert_eq!(current(&c.store).expect("v").expect("v").after, None);
        fill_in_after(&c, 1_000 + AFTER_SECONDS).expect("tick");
        let a = current(&c.store)
            .expect("v")
            .expect("v")
            .after
            .expect("after");
        assert!(a.complete);
        assert_eq!(a.overall.jobs, 2, "job 3 started after the day");
        assert_eq!(a.queues["a"].avg_wait, 400.0);
    }
}
