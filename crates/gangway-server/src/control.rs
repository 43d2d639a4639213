//! The control plane's state: the store is the truth; an in-memory
//! [`ClusterState`] mirrors it for the scheduler. Every change is written to
//! the store (compare-and-swap on the record's revision) before it is applied
//! in memory and acknowledged.

mod assign;
mod avoid;
mod contract;
mod nodes;
mod predictor;
mod probation;
mod rank;
mod reservations;
mod view;
mod workflow;

pub use assign::{NodeWork, SyncAnswer};
pub use predictor::{PredictorSave, PREDICTOR_MAX_BYTES};

pub use crate::authz::fresh_token;
pub use crate::config::{ContractConfig, NodeLifecycle};
pub use crate::control_error::ControlError;
pub(crate) use crate::control_error::{decode, encode};
pub use crate::parts::ContractState;
pub(crate) use crate::records::token_key;

use crate::records::{
    auto_cordon_key, job_key, node_key, AutoCordon, JobEvent, JobRecord, ReplicaOn, Stopping,
    JOB_SEQ,
};
use gangway_core::agent::{GpuHealth, SyncRequest, TaskState};
use gangway_core::{JobId, JobSpec, JobState, NodeSpec, Time};
use gangway_sched::{
    apply, schedule, ClusterState, Decisions, Placement, ReplicaPlacement, StateConfig,
};
use gangway_store::{Compare, Op, Store, StoreError};
use std::collections::{BTreeMap, HashMap, HashSet};

/// A submission: owner, spec and the client's idempotency key, if any.
#[derive(Clone, Debug)]
pub struct NewJob {
    /// Owner.
    pub user: String,
    /// Spec.
    pub spec: JobSpec,
    /// Retrying with the same key returns the job the first try created.
    pub key: Option<String>,
}

impl NewJob {
    /// A submission without an idempotency key.
    pub fn new(user: &str, spec: JobSpec) -> Self {
        NewJob {
            user: user.to_string(),
            spec,
            key: None,
        }
    }
}

/// Store key of an idempotency key (its value is the job id).
pub(crate) fn idem_key(key: &str) -> String {
    format!("/idempotency/{key}")
}

pub(crate) use crate::attempt::{ended, AfterEnd, Ending};

/// A node the lifecycle check acts on (see [`Control::silent_nodes`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SilentNode {
    /// Its index in the scheduler's state.
    pub(crate) node: gangway_sched::NodeIdx,
    /// Its name.
    pub(crate) name: String,
    /// Seconds since its last heartbeat (or since the state was loaded).
    pub(crate) silent: u64,
    /// Whether it is Ready (it becomes NotReady).
    pub(crate) ready: bool,
}

/// Everything the server keeps in memory: a coordinator over the store,
/// the scheduler's mirror of it, and the parts that own the rest (each in
/// a module of its own that knows nothing of `Control`, see
/// [`crate::parts`]). Its methods read and write the store, call the parts
/// and keep the mirror in step.
pub struct Control<S: Store> {
    pub(crate) store: S,
    /// Scheduler's mirror of the store (its mutable borrows counted, so the
    /// read view's cluster snapshot is rebuilt only after one).
    pub cluster: crate::view::Tracked<ClusterState>,
    /// Job records with their store revisions (and their counts by state
    /// and queue, see [`crate::records::JobTable`]).
    pub jobs: crate::records::JobTable,
    /// Pending jobs kept out of the scheduler (held, begin, dependency, array limit).
    pub gates: crate::workflow::Gates,
    /// Deferred job writes and the job sequence (see [`Control::deferred`]).
    pub(crate) writes: crate::parts::JobWrites,
    /// Node credentials, approvals, heartbeats, blame and health.
    pub nodes: crate::parts::NodeRegistry,
    /// The job contract's knobs and in-memory state.
    pub contract: crate::parts::Contract,
    /// Gangway's ranking: what was applied, when (see `control/rank.rs`),
    /// and when the run-time predictor was stored.
    pub(crate) ranks: crate::parts::RankMemo,
    /// Maintenance reservations (see [`crate::reservations`]).
    pub reservations: crate::reservations::Reservations,
    /// The scheduler's knobs and queues.
    pub policy: crate::parts::PolicyStore,
    /// What the read view publishes besides the records: explanations,
    /// plan, names and the cluster snapshot's memo.
    pub view: crate::parts::ViewState,
}

/// Where the run-time predictor (learned from this cluster's completed jobs)
/// is kept, so a restarted or new leader keeps what was learned.
pub const PREDICTOR_KEY: &str = "/sched/runtime_predictor";

/// What an agent reports about a job on its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Report {
    /// All its ranks on this node started.
    Running,
    /// A rank's main process exited with this (non-zero) code; processes
    /// of the job still run on the node.
    Failing(i32),
    /// No process of its ranks is left on this node; the first non-zero
    /// exit code, or 0.
    Exited(i32),
}

/// The grace a gang gets when it is stopped by a cancel or a failed rank:
/// the checkpoint signal first, but not the whole preemption grace.
pub const SHORT_GRACE_SECONDS: u64 = 10;

impl<S: Store + Clone> Control<S> {
    /// A handle on the store, to flush deferred writes (see
    /// [`Control::deferred`]) after the state lock is released.
    pub fn store_handle(&self) -> S {
        self.store.clone()
    }
}

impl<S: Store> Control<S> {
    /// Loads the state from the store: queues from the config, then nodes, then jobs.
    pub fn open(store: S, queues: &[gangway_core::QueueSpec]) -> Result<Self, ControlError> {
        Self::open_at(store, queues, crate::clock::now())
    }

    /// [`Control::open`] with the server configuration's node lifecycle,
    /// blame, cycle and job-contract settings: what every replica that
    /// leads (the first one and each that takes over) runs with.
    pub fn open_configured(
        store: S,
        cfg: &crate::config::ServerConfig,
    ) -> Result<Self, ControlError> {
        let now = crate::clock::now();
        let mut control = Self::open_at(store, &cfg.queues, now)?;
        control.nodes.lifecycle = cfg.lifecycle();
        control.nodes.blame = crate::blame::Blame::new(cfg.blame());
        control.load_auto_cordons(cfg.probation(), now)?;
        control.nodes.cycle_seconds = cfg.cycle_seconds;
        control.contract.config = cfg.contract();
        Ok(control)
    }

    /// [`Control::open`] at `now`: nodes not heard from count their silence
    /// from it.
    pub(crate) fn open_at(
        store: S,
        queues: &[gangway_core::QueueSpec],
        now: Time,
    ) -> Result<Self, ControlError> {
        let mut nodes = crate::parts::NodeRegistry::new(now);
        let mut cluster = ClusterState::new(StateConfig::default());
        for q in queues {
            cluster
                .add_queue(q.clone())
                .map_err(|e| ControlError::BadNode(e.to_string()))?;
        }
        for kv in store.range("/nodes/")? {
            let spec: NodeSpec = decode(&kv.key, &kv.value)?;
            nodes.heartbeats.never_heard(&spec.name);
            cluster
                .add_node(spec)
                .map_err(|e| ControlError::BadNode(e.to_string()))?;
        }
        for kv in store.range("/node_tokens/")? {
            let name = &kv.key["/node_tokens/".len()..];
            let cred = crate::nodes::NodeCredential::decode(&kv.key, &kv.value)?;
            if serde_json::from_slice::<crate::nodes::NodeCredential>(&kv.value).is_err() {
                // A plain token from before tokens were hashed: store the
                // digest instead (best effort: a follower may not write).
                if let Err(e) = store.put(&kv.key, &encode(&cred)) {
                    tracing::warn!("{}: cannot replace a plain node token yet: {e}", kv.key);
                }
            }
            nodes.add_credential(name, cred);
        }
        for kv in store.range(crate::nodes::PENDING_PREFIX)? {
            let spec: NodeSpec = decode(&kv.key, &kv.value)?;
            nodes.pending.insert(spec.name.clone(), spec);
        }
        let mut jobs = crate::records::JobTable::default();
        for kv in store.range("/jobs/")? {
            let rec: JobRecord = decode(&kv.key, &kv.value)?;
            jobs.insert(rec.id, (rec, kv.mod_revision));
        }
        let mut c = Control {
            store,
            cluster: crate::view::Tracked::new(cluster),
            jobs,
            gates: Default::default(),
            writes: Default::default(),
            nodes,
            contract: Default::default(),
            ranks: Default::default(),
            reservations: Default::default(),
            policy: crate::parts::PolicyStore::new(queues),
            view: Default::default(),
        };
        if let Some(kv) = c.store.get(PREDICTOR_KEY)? {
            // A predictor this version cannot read is relearned, not fatal.
            match serde_json::from_slice(&kv.value) {
                Ok(p) => c.cluster.set_predictor(p),
                Err(e) => tracing::warn!("{PREDICTOR_KEY}: {e}; run times are learned afresh"),
            }
        }
        c.rebuild()?;
        c.reservations = crate::reservations::Reservations::load(&c.store)?;
        c.load_auto_cordons(Default::default(), now)?;
        Ok(c)
    }

    /// Puts every live job back into the scheduler's state.
    pub(crate) fn rebuild(&mut self) -> Result<(), ControlError> {
        let live: Vec<std::sync::Arc<JobRecord>> = self
            .jobs
            .values()
            .map(|(r, _)| r.clone())
            .filter(|r| !r.state.is_terminal() && r.state != JobState::Restarting)
            .collect();
        self.gates.waiting.clear();
        // Every job enters the scheduler again: all are ranked at the next cycle.
        self.ranks.refreshed_at = None;
        for r in live {
            // Held, deferred, dependent and array-limited jobs are decided
            // again below, from their records alone.
            if r.state == JobState::Pending && r.placement.is_empty() {
                // A queue may have gone since: such jobs stay recorded but unschedulable.
                let _ = self.enter(r.id);
                continue;
            }
            // A queue or node may have gone since: such jobs stay recorded but unschedulable.
            if self
                .cluster
                .submit(r.id, r.spec.clone(), r.submitted_at)
                .is_err()
            {
                continue;
            }
            self.apply_avoid(r.id);
            if !r.placement.is_empty() {
                if let Some(p) = self.placement_from(&r.placement) {
                    let _ = self.cluster.bind(r.id, p, r.submitted_at);
                }
                // The scheduler's measure of lost work survives a restart.
                if let Some(c) = &r.checkpoint {
                    let _ = self.cluster.record_checkpoint(r.id, c.written_ms / 1000);
                }
            }
            // A victim in its grace period stays one: nobody preempts it twice.
            if let (JobState::Preempting, Some(by)) = (r.state, r.preempted_by) {
                let _ = self.cluster.mark_preempting(r.id, by, r.submitted_at);
            }
        }
        self.release_gated(crate::clock::now(), false)?;
        Ok(())
    }

    fn placement_from(&self, on: &[ReplicaOn]) -> Option<Placement> {
        let mut replicas = Vec::new();
        for r in on {
            let n = self.cluster.node_index(&r.node)?;
            let info = &self.cluster.nodes()[n as usize];
            let mut mask = 0u64;
            for g in &r.gpus {
                let pos = info.spec.gpus.iter().position(|x| x.index == *g)?;
                mask |= 1 << pos;
            }
            replicas.push(ReplicaPlacement {
                node: n,
                gpus: mask,
            });
        }
        let level = gangway_sched::placement::span_level(&self.cluster, &replicas);
        Some(Placement { replicas, level })
    }

    fn placement_to(&self, p: &Placement) -> Vec<ReplicaOn> {
        p.replicas
            .iter()
            .map(|r| {
                let info = &self.cluster.nodes()[r.node as usize];
                ReplicaOn {
                    node: info.spec.name.clone(),
                    gpus: info.device_indices(r.gpus),
                }
            })
            .collect()
    }

    /// Accepts a job: validated against the cluster, durably stored with a
    /// fresh id, then queued. Nothing changes when it is rejected.
    pub fn submit(&mut self, user: &str, spec: JobSpec, now: Time) -> Result<JobId, ControlError> {
        self.submit_batch(vec![NewJob::new(user, spec)], now)
            .pop()
            .unwrap_or_else(|| Err(ControlError::Conflict(JOB_SEQ.into())))
    }

    /// Accepts several jobs in one durable store transaction (group commit):
    /// each is validated on its own; the valid ones get consecutive ids. A
    /// submission whose idempotency key was seen before gets the job it
    /// created then, so a client retrying after a lost answer (a failover)
    /// never creates a second job.
    pub fn submit_batch(
        &mut self,
        mut batch: Vec<NewJob>,
        now: Time,
    ) -> Vec<Result<JobId, ControlError>> {
        // The queue's time limits: its default filled in, its maximum enforced.
        let mut limit_errors: Vec<Option<ControlError>> = batch
            .iter_mut()
            .map(|job| {
                self.apply_queue_time_limit(&mut job.spec)
                    .and_then(|_| self.prepare_workflow(&mut job.spec, now))
                    .and_then(|_| {
                        job.spec
                            .check_printable()
                            .map_err(|e| ControlError::Rejected(gangway_sched::Rejection::Spec(e)))
                    })
                    .err()
            })
            .collect();
        let mut results: Vec<Option<Result<JobId, ControlError>>> = Vec::with_capacity(batch.len());
        let mut valid = Vec::new();
        // First occurrence in this batch of each new key.
        let mut first_of: HashMap<&str, usize> = HashMap::new();
        let mut same_as: Vec<(usize, usize)> = Vec::new();
        let mut batch_dirs: Vec<String> = Vec::new();
        for (i, job) in batch.iter().enumerate() {
            if let Some(key) = job.key.as_deref() {
                match self.store.get(&idem_key(key)) {
                    Ok(Some(kv)) => {
                        results.push(Some(decode::<JobId>(&kv.key, &kv.value)));
                        continue;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        results.push(Some(Err(e.into())));
                        continue;
                    }
                }
                if let Some(&f) = first_of.get(key) {
                    results.push(None);
                    same_as.push((i, f));
                    continue;
                }
                first_of.insert(key, i);
            }
            if let Some(e) = limit_errors[i].take() {
                results.push(Some(Err(e)));
                continue;
            }
            if let Err(e) = self.checkpoint_dir_apart(&job.user, &job.spec) {
                results.push(Some(Err(e)));
                continue;
            }
            // The batch's own named directories are not indexed yet.
            let named = job
                .spec
                .checkpoint
                .dir
                .as_deref()
                .map(|d| gangway_core::agent::checkpoint_subdir(&job.user, JobId(0), Some(d)));
            if let Some(mine) = &named {
                let nested = |a: &str, b: &str| {
                    a.len() > b.len() && a.starts_with(b) && a.as_bytes()[b.len()] == b'/'
                };
                if batch_dirs
                    .iter()
                    .any(|d: &String| nested(mine, d) || nested(d, mine))
                {
                    results.push(Some(Err(ControlError::Workflow(
                        crate::control_error::WorkflowError::Field(format!(
                            "checkpoint.dir: {:?} is inside or holds the checkpoint directory of another job of this submission",
                            job.spec.checkpoint.dir.as_deref().unwrap_or_default()
                        )),
                    ))));
                    continue;
                }
            }
            match self.cluster.validate(&job.spec) {
                Ok(_) => {
                    results.push(None);
                    valid.push(i);
                    batch_dirs.extend(named);
                }
                Err(e) => results.push(Some(Err(e.into()))),
            }
        }
        if !valid.is_empty() {
            // Chunks that landed are jobs, acknowledged or not; a failed
            // chunk and the ones after it are refused (retried with the same
            // idempotency key, a landed job is found again).
            let (groups, failed) = self.store_batch(&batch, &valid, now);
            let landed = groups.len();
            let gated_before = self.gates.waiting.len();
            // One record per job, or per task of an array.
            for (i, group) in valid.iter().zip(groups) {
                let first = group.first().map(|(r, _)| r.id);
                let mut r = first.ok_or_else(|| ControlError::Conflict(JOB_SEQ.into()));
                for (rec, rev) in group {
                    let id = rec.id;
                    self.jobs.insert(id, (rec, rev));
                    if let Err(e) = self.enter(id) {
                        r = Err(e);
                    }
                }
                results[*i] = Some(r);
            }
            // Gated submissions are decided at once (only then: a pass walks
            // every gated job).
            if self.gates.waiting.len() > gated_before {
                if let Err(e) = self.release_gated(now, true) {
                    tracing::warn!("deciding gated jobs after a submission: {e}");
                }
            }
            if let Some(e) = failed {
                let not_leader = matches!(e, ControlError::Store(StoreError::NotLeader));
                let msg = e.to_string();
                for i in &valid[landed..] {
                    results[*i] = Some(Err(if not_leader {
                        ControlError::Store(StoreError::NotLeader)
                    } else {
                        ControlError::Conflict(msg.clone())
                    }));
                }
            }
        }
        for (i, f) in same_as {
            let r = match &results[f] {
                Some(Ok(id)) => Ok(*id),
                _ => Err(ControlError::Conflict(
                    "an earlier submission with the same idempotency key failed".into(),
                )),
            };
            results[i] = Some(r);
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(ControlError::Conflict(JOB_SEQ.into()))))
            .collect()
    }

    /// A named `checkpoint.dir` must not lie inside another job's checkpoint
    /// directory of the same user, nor hold one, whatever that job's state
    /// (an ended job's directory may be kept, with what its ranks left in
    /// it: a link there would lead the agent elsewhere). `job-<n>` as the
    /// first part of a longer name is every job `<n>`'s default directory,
    /// taken or not. The same directory as another job's stays allowed (a
    /// resubmission resumes from it).
    fn checkpoint_dir_apart(&self, user: &str, spec: &JobSpec) -> Result<(), ControlError> {
        let Some(dir) = spec.checkpoint.dir.as_deref() else {
            return Ok(());
        };
        let field =
            |msg: String| ControlError::Workflow(crate::control_error::WorkflowError::Field(msg));
        let subdir = gangway_core::agent::checkpoint_subdir(user, JobId(0), Some(dir));
        if let Some((other, at, inside)) = self.jobs.nested_checkpoint_dir(&subdir) {
            let user_part = subdir.len() - dir.len();
            let theirs = at.get(user_part..).unwrap_or(at);
            return Err(field(if inside {
                format!("checkpoint.dir: {dir:?} is inside job {other}'s checkpoint directory ({theirs:?})")
            } else {
                format!(
                    "checkpoint.dir: {dir:?} holds job {other}'s checkpoint directory ({theirs:?})"
                )
            }));
        }
        if let Some((first, _)) = dir.split_once('/') {
            let n = first.strip_prefix("job-").unwrap_or("");
            if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) {
                return Err(field(format!(
                    "checkpoint.dir: {dir:?} is inside {first:?}, the default checkpoint directory of job {n}"
                )));
            }
        }
        Ok(())
    }

    /// [`Control::submit_batch`] with the new jobs committed as deferred
    /// transactions ([`Store::txn_deferred`]): the caller must call
    /// [`Store::sync`] on [`Control::store_handle`] after releasing the
    /// state lock and before acknowledging any of them. For the group
    /// commit: on redb the fsync (a few ms) then no longer holds the lock
    /// that cycles and the agents' batches wait for. Until the sync the
    /// jobs are in memory and in the store's overlay; any durable commit
    /// meanwhile (a cycle binding one of them) writes them first, so
    /// nothing on disk ever refers to a job that is not.
    pub fn submit_batch_deferred(
        &mut self,
        batch: Vec<NewJob>,
        now: Time,
    ) -> Vec<Result<JobId, ControlError>> {
        self.writes.defer_submissions = true;
        let out = self.submit_batch(batch, now);
        self.writes.defer_submissions = false;
        out
    }

    /// Writes new jobs in as few transactions as the store's limits allow,
    /// each of whole jobs (a job with its idempotency key) and its own step
    /// of the job sequence. Returns the records that landed, in order, and
    /// the error that stopped the rest.
    fn store_batch(
        &mut self,
        batch: &[NewJob],
        valid: &[usize],
        now: Time,
    ) -> (Vec<Vec<(JobRecord, u64)>>, Option<ControlError>) {
        let mut out = Vec::with_capacity(valid.len());
        let mut rest = valid;
        while !rest.is_empty() {
            match self.store_chunk(batch, rest, now) {
                Ok(groups) => {
                    rest = &rest[groups.len().min(rest.len())..];
                    out.extend(groups);
                }
                Err(e) => return (out, Some(e)),
            }
        }
        (out, None)
    }

    /// Writes the first submissions of `valid` that fit in one transaction
    /// (at least one; an array's tasks always go together, so an array
    /// larger than the store's transaction limit is refused by the store).
    fn store_chunk(
        &mut self,
        batch: &[NewJob],
        valid: &[usize],
        now: Time,
    ) -> Result<Vec<Vec<(JobRecord, u64)>>, ControlError> {
        let limits = self.store.txn_limits();
        loop {
            // The counter as this leader last wrote it, else as stored (a
            // stale copy only fails the compare and is read again).
            let (last, cmp) = match self.writes.take_job_seq() {
                Some(known) => known,
                None => match self.store.get(JOB_SEQ)? {
                    Some(kv) => {
                        let n: u64 = decode(&kv.key, &kv.value)?;
                        (n, Compare::Revision(JOB_SEQ.into(), kv.mod_revision))
                    }
                    None => (0, Compare::Absent(JOB_SEQ.into())),
                },
            };
            let mut compares = vec![cmp];
            let mut ops = Vec::new();
            let mut groups = Vec::new();
            let mut next = last.saturating_add(1);
            // The sequence counter's key and value.
            let mut bytes = JOB_SEQ.len() + 20;
            for (k, &i) in valid.iter().enumerate() {
                let NewJob { user, spec, key } = &batch[i];
                let id = JobId(next);
                // An array's tasks get consecutive ids, the first being the array's.
                let group = crate::workflow::expand(id, user, spec, now);
                let values: Vec<Vec<u8>> = group.iter().map(encode).collect();
                let keyed = usize::from(key.is_some());
                let size = group
                    .iter()
                    .zip(&values)
                    .map(|(rec, v)| 2 * job_key(rec.id).len() + v.len())
                    .sum::<usize>()
                    + key.as_ref().map_or(0, |k| 2 * idem_key(k).len() + 20);
                // One more put: the sequence counter.
                let fits = compares.len() + group.len() + keyed <= limits.max_compares
                    && ops.len() + group.len() + 1 + keyed <= limits.max_ops
                    && bytes + size <= limits.max_bytes;
                if k > 0 && !fits {
                    break;
                }
                bytes += size;
                next = next.saturating_add(group.len() as u64);
                for (rec, v) in group.iter().zip(values) {
                    compares.push(Compare::Absent(job_key(rec.id)));
                    ops.push(Op::Put(job_key(rec.id), v));
                }
                if let Some(key) = key {
                    compares.push(Compare::Absent(idem_key(key)));
                    ops.push(Op::Put(idem_key(key), encode(&id)));
                }
                groups.push(group);
            }
            ops.push(Op::Put(JOB_SEQ.into(), encode(&(next - 1))));
            let r = if self.writes.defer_submissions {
                self.store.txn_deferred(&compares, &ops)?
            } else {
                self.store.txn(&compares, &ops)?
            };
            if r.succeeded {
                self.writes
                    .wrote_job_seq(next - 1, Compare::Revision(JOB_SEQ.into(), r.revision));
                return Ok(groups
                    .into_iter()
                    .map(|g| g.into_iter().map(|rec| (rec, r.revision)).collect())
                    .collect());
            }
        }
    }

    /// Writes changed records, each compared on its revision: all land or
    /// none do when they fit in one transaction; otherwise see
    /// [`Control::write_chunks`], of which this returns only the error.
    #[allow(dead_code)] // for features that change several records at once
    pub(crate) fn write_all(&mut self, recs: Vec<JobRecord>) -> Result<(), ControlError> {
        self.write_chunks(recs).1
    }

    /// Writes changed records in transactions within the store's limits
    /// (every one fenced by the store, each record compared on its
    /// revision), in order, stopping at the first that fails. Returns how
    /// many records landed (a prefix of `recs`, now in `self.jobs`) and
    /// whether all did. Callers apply exactly the landed prefix, so memory
    /// and store agree whatever happens between two transactions.
    pub(crate) fn write_chunks(
        &mut self,
        mut recs: Vec<JobRecord>,
    ) -> (usize, Result<(), ControlError>) {
        for rec in &mut recs {
            crate::records::bound_events(&mut rec.events, &mut rec.events_dropped);
        }
        let limits = self.store.txn_limits();
        let encoded: Vec<Vec<u8>> = recs.iter().map(encode).collect();
        let ranges = limits.split(
            (0, 0, 0),
            recs.iter()
                .zip(&encoded)
                .map(|(r, v)| (1, 1, 2 * job_key(r.id).len() + v.len())),
        );
        let mut encoded = encoded.into_iter();
        let mut landed = 0;
        for range in ranges {
            let chunk = &recs[range.clone()];
            let mut compares = Vec::with_capacity(chunk.len());
            let mut ops = Vec::with_capacity(chunk.len());
            for rec in chunk {
                let Some((_, rev)) = self.jobs.get(&rec.id) else {
                    return (landed, Err(ControlError::NoSuchJob(rec.id)));
                };
                compares.push(Compare::Revision(job_key(rec.id), *rev));
                ops.push(Op::Put(job_key(rec.id), encoded.next().unwrap_or_default()));
            }
            let r = if self.writes.defer_decisions {
                self.store.txn_deferred(&compares, &ops)
            } else {
                self.store.txn(&compares, &ops)
            };
            let r = match r {
                Ok(r) => r,
                Err(e) => return (landed, Err(e.into())),
            };
            if !r.succeeded {
                return (
                    landed,
                    Err(ControlError::Conflict(format!(
                        "{} job records",
                        chunk.len()
                    ))),
                );
            }
            for rec in chunk {
                self.jobs.insert(rec.id, (rec.clone(), r.revision));
            }
            landed = range.end;
        }
        (landed, Ok(()))
    }

    /// Writes a changed record with compare-and-swap on its revision.
    pub(crate) fn write(&mut self, mut rec: JobRecord) -> Result<(), ControlError> {
        crate::records::bound_events(&mut rec.events, &mut rec.events_dropped);
        let id = rec.id;
        let rev = self
            .jobs
            .get(&id)
            .map(|(_, r)| *r)
            .ok_or(ControlError::NoSuchJob(id))?;
        if self.writes.defer_writes {
            // Kept in memory under its stored revision; written out with
            // the rest of the batch by `flush_deferred`.
            self.jobs.insert(id, (rec, rev));
            self.writes.changed(id);
            return Ok(());
        }
        let cmp = [Compare::Revision(job_key(id), rev)];
        let put = [Op::Put(job_key(id), encode(&rec))];
        let r = self.store.txn(&cmp, &put)?;
        if !r.succeeded {
            return Err(ControlError::Conflict(job_key(id)));
        }
        self.jobs.insert(id, (rec, r.revision));
        self.writes.stored(id);
        Ok(())
    }

    /// Writes the records that deferred writes changed since the last
    /// flush: each once (however often it changed), compared on its stored
    /// revision, in transactions within the store's limits sent together
    /// ([`Store::txns_deferred`]). Durable once [`Store::sync`] returns.
    /// The combiner calls it once per batch of agents' changes, before it
    /// releases the state lock: on etcd each report used to be a round
    /// trip and an fsync of its own under the lock. Records whose
    /// transaction failed stay unflushed, retried by the next flush; the
    /// error is returned so the batch's callers are not acknowledged.
    pub fn flush_deferred(&mut self) -> Result<(), ControlError> {
        if self.writes.nothing_to_flush() {
            return Ok(());
        }
        let ids = self.writes.take_unflushed();
        let encoded: Vec<(JobId, u64, Vec<u8>)> = ids
            .iter()
            .filter_map(|id| {
                self.jobs
                    .get(id)
                    .map(|(r, rev)| (*id, *rev, encode(r.as_ref())))
            })
            .collect();
        let ranges = self.store.txn_limits().split(
            (0, 0, 0),
            encoded
                .iter()
                .map(|(id, _, v)| (1, 1, 2 * job_key(*id).len() + v.len())),
        );
        let mut encoded = encoded.into_iter();
        let mut chunks: Vec<Vec<(JobId, u64)>> = Vec::new();
        let mut txns = Vec::new();
        for range in ranges {
            let mut compares = Vec::with_capacity(range.len());
            let mut ops = Vec::with_capacity(range.len());
            let mut chunk = Vec::with_capacity(range.len());
            for (id, rev, v) in encoded.by_ref().take(range.len()) {
                compares.push(Compare::Revision(job_key(id), rev));
                ops.push(Op::Put(job_key(id), v));
                chunk.push((id, rev));
            }
            chunks.push(chunk);
            txns.push((compares, ops));
        }
        let answers = self.store.txns_deferred(&txns);
        let mut first_error = None;
        for (chunk, answer) in chunks.into_iter().zip(answers) {
            let failed = match answer {
                Ok(r) if r.succeeded => {
                    for (id, _) in &chunk {
                        self.jobs.set_revision(id, r.revision);
                    }
                    continue;
                }
                Ok(_) => ControlError::Conflict(format!("{} job records", chunk.len())),
                Err(e) => e.into(),
            };
            self.writes.retry(chunk.iter().map(|(id, _)| *id));
            first_error.get_or_insert(failed);
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Runs `f` with its job writes kept in memory (under their stored
    /// revisions) until [`Control::flush_deferred`] writes them with
    /// [`Store::txns_deferred`]; the caller must then call [`Store::sync`]
    /// on [`Control::store_handle`] before acknowledging what `f` did. For
    /// the agents' syncs and reports: each report used to be a commit of
    /// its own under the state lock (an fsync on redb, ~4 ms on the
    /// development machine; a round trip and an fsync on etcd), so a busy
    /// cluster's reports held the lock most of the time; now a batch of
    /// them costs one flush and one fsync, after the lock is released.
    /// Until then the change is in memory and in the read view; were the
    /// server to die first, the agent, never acknowledged, reports again.
    pub fn deferred<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> T {
        self.writes.defer_writes = true;
        let out = f(self);
        self.writes.defer_writes = false;
        out
    }

    /// Cancels a job (pending or running).
    pub fn cancel(&mut self, id: JobId, by: &str, now: Time) -> Result<(), ControlError> {
        let (rec, _) = self.jobs.get(&id).ok_or(ControlError::NoSuchJob(id))?;
        if rec.state.is_terminal() {
            return Err(ControlError::Finished(id, rec.state));
        }
        let mut rec = JobRecord::clone(rec);
        let on_nodes = matches!(
            rec.state,
            JobState::Scheduled | JobState::Running | JobState::Preempting
        ) && !rec.placement.is_empty();
        if on_nodes {
            // Its ranks get the checkpoint signal and a short grace; the
            // GPUs stay booked until every node reports them gone.
            if matches!(rec.stopping, Some(Stopping::Cancelled { .. })) {
                return Ok(());
            }
            let grace = rec.spec.checkpoint.grace_seconds.min(SHORT_GRACE_SECONDS);
            rec.stopping = Some(Stopping::Cancelled { by: by.to_string() });
            rec.events.push(JobEvent::new(
                now,
                "cancelling",
                format!(
                    "cancel requested by {by}: ranks get signal {} and {grace}s to stop",
                    rec.spec.checkpoint.signal
                ),
            ));
            self.write(rec)?;
            return Ok(());
        }
        rec.state = JobState::Cancelled;
        rec.events.push(JobEvent {
            at: now,
            kind: "cancelled".into(),
            message: format!("cancelled by {by}"),
            count: 1,
            last_at: None,
        });
        self.write(rec)?;
        let _ = self.cluster.cancel(id);
        self.view.why.remove(&id);
        self.gates.waiting.remove(&id);
        Ok(())
    }

    /// Applies an agent's report about a job on its node. `attempt` (when
    /// given) must be the job's current one: reports about an earlier run are
    /// refused, so a late exit can never end a fresh attempt.
    ///
    /// A node's ranks running makes Scheduled → Running once every node of the
    /// gang has said so. Any non-zero exit stops the whole gang (restart or
    /// fail); a gang succeeds when every node's ranks exited 0; a preempted
    /// gang is requeued (to resume from its checkpoint) once every node's ranks
    /// have stopped.
    pub fn report(
        &mut self,
        node: &str,
        id: JobId,
        attempt: Option<u32>,
        report: Report,
        now: Time,
    ) -> Result<JobState, ControlError> {
        let (rec, _) = self.jobs.get(&id).ok_or(ControlError::NoSuchJob(id))?;
        if let Some(a) = attempt {
            if a != rec.attempt {
                return Err(ControlError::StaleAttempt(id, a, rec.attempt));
            }
        }
        if !rec.placement.iter().any(|r| r.node == node) {
            return Err(ControlError::NotOnNode(node.to_string(), id));
        }
        let state = rec.state;
        let live = matches!(
            state,
            JobState::Scheduled | JobState::Running | JobState::Preempting
        );
        // Being stopped already: a preemption, a cancel or a failed rank.
        let stopping = rec.stopping.is_some() || state == JobState::Preempting;
        // Reports that change nothing (every sync repeats its running
        // tasks) are answered from the shared record, without copying it.
        match report {
            Report::Running if state == JobState::Scheduled && rec.started_on.contains(node) => {
                return Ok(state)
            }
            Report::Running if state == JobState::Scheduled => {}
            Report::Running if live => return Ok(state),
            Report::Running => return Err(ControlError::BadReport(id, state, "running")),
            Report::Failing(_) | Report::Exited(_) if !live => {
                return Err(ControlError::BadReport(id, state, "an exit"))
            }
            Report::Failing(_) if stopping => return Ok(state),
            Report::Failing(_) | Report::Exited(_) => {}
        }
        let mut rec = JobRecord::clone(rec);
        let nodes = rec.nodes().len();
        match report {
            Report::Running => {
                if rec.started_on.insert(node.to_string()) {
                    if rec.started_on.len() == nodes {
                        rec.state = JobState::Running;
                        // The attempt that avoided nodes runs: that was its one.
                        rec.avoid = None;
                        let message = if nodes == 1 {
                            format!("ranks started on {node}")
                        } else {
                            format!("all ranks started on {nodes} nodes")
                        };
                        rec.events.push(JobEvent::new(now, "running", message));
                    }
                    self.write(rec)?;
                }
            }
            Report::Failing(code) => {
                // The whole gang stops together (signal, short grace); the
                // outcome is decided once no process of it is left anywhere.
                self.nodes.blame.job_failed(node, id, &rec.spec.user);
                self.begin_failed_stop(&mut rec, code, node, now);
                self.write(rec)?;
            }
            Report::Exited(code) => {
                if !stopping && code != 0 {
                    self.nodes.blame.job_failed(node, id, &rec.spec.user);
                    self.begin_failed_stop(&mut rec, code, node, now);
                }
                rec.exited_on.insert(node.to_string(), code);
                if rec.exited_on.len() < nodes {
                    self.write(rec)?;
                } else {
                    let where_ = if nodes == 1 {
                        node.to_string()
                    } else {
                        format!("{nodes} nodes")
                    };
                    let ending = match (&rec.stopping, rec.state) {
                        (Some(Stopping::Cancelled { by }), _) => Ending::Cancelled(format!(
                            "cancelled by {by}; no process left on {where_}"
                        )),
                        (Some(Stopping::Failed { message }), _) => Ending::Failed(message.clone()),
                        (None, JobState::Preempting) => {
                            Ending::Requeued(Self::stopped_message(&rec, node, nodes, code))
                        }
                        (None, _) if nodes == 1 => {
                            Ending::Succeeded(format!("exited with code {code} on {node}"))
                        }
                        (None, _) => Ending::Succeeded(format!(
                            "all ranks exited with code 0 on {nodes} nodes"
                        )),
                    };
                    self.end_attempt(rec, ending, now)?;
                }
            }
        }
        Ok(self
            .jobs
            .get(&id)
            .map_or(JobState::Pending, |(r, _)| r.state))
    }

    /// A rank failed: every node of the gang is told to stop it (checkpoint
    /// signal, short grace); its GPUs stay booked until all processes are gone.
    fn begin_failed_stop(&mut self, rec: &mut JobRecord, code: i32, node: &str, now: Time) {
        // Names the failing rank, its signal and last output where the node said.
        let message = self.failure_message(rec, node, code, now);
        let grace = rec.spec.checkpoint.grace_seconds.min(SHORT_GRACE_SECONDS);
        rec.events.push(JobEvent::new(
            now,
            "stopping",
            format!(
                "{message}: the gang gets signal {} and {grace}s to stop",
                rec.spec.checkpoint.signal
            ),
        ));
        rec.stopping = Some(Stopping::Failed { message });
    }

    /// Ends the job's current attempt: requeue (preempted), restart after a
    /// backoff or fail for good (a rank or node failed), or succeed.
    pub(crate) fn end_attempt(
        &mut self,
        rec: JobRecord,
        ending: Ending,
        now: Time,
    ) -> Result<(), ControlError> {
        let succeeded = matches!(ending, Ending::Succeeded(_));
        if succeeded {
            self.learn_runtime(&rec, now);
            let nodes: Vec<String> = rec.placement.iter().map(|r| r.node.clone()).collect();
            self.nodes.blame.job_succeeded(rec.id, &nodes, now);
        }
        let (rec, after) = self.ended_avoiding(rec, ending, now);
        if !succeeded && matches!(after, AfterEnd::Finish) {
            self.nodes.blame.job_gone(rec.id);
        }
        let id = rec.id;
        self.write(rec)?;
        self.apply_ending(id, after);
        Ok(())
    }

    /// Learns the run time of a job that succeeded in one uninterrupted
    /// attempt (from its last "running" event), so estimates and backfill
    /// windows of similar jobs use this cluster's history, not a guess.
    fn learn_runtime(&mut self, rec: &JobRecord, now: Time) {
        if rec.attempt != 0 {
            return; // Preempted or restarted: the last attempt ran only part of it.
        }
        let Some(started) = rec.events.iter().rev().find(|e| e.kind == "running") else {
            return;
        };
        let seconds = now.saturating_sub(started.at);
        if seconds > 0 {
            self.cluster.learn_runtime(&rec.spec, seconds);
            self.ranks.predictor_learned();
        }
    }

    /// What the scheduler's state does when an attempt ends.
    pub(crate) fn apply_ending(&mut self, id: JobId, after: AfterEnd) {
        if matches!(after, AfterEnd::Finish) {
            self.queue_cleanup(id);
        }
        self.forget_failures(id);
        // Its record was written, but the scheduler's state is what changes here.
        self.ranks.entered.push(id);
        let _ = match after {
            AfterEnd::Requeue => self.cluster.requeue(id),
            AfterEnd::Restart => self.cluster.cancel(id).map(|_| ()),
            AfterEnd::Finish => self.cluster.finish(id).map(|_| ()),
        };
        if matches!(after, AfterEnd::Requeue) {
            self.apply_avoid(id);
        }
    }

    /// A node under DiskPressure takes no new work: it is cordoned while
    /// the pressure lasts (unless it was already), with the agent's figures
    /// as the reason, and uncordoned when its agent reports the pressure gone.
    fn apply_disk_pressure(&mut self, node: &str, why: Option<&str>) -> Result<bool, ControlError> {
        let Some(n) = self.cluster.node_index(node) else {
            return Ok(false);
        };
        let bad = |e: gangway_sched::StateError| ControlError::BadNode(e.to_string());
        match why {
            Some(why) if !self.nodes.disk_pressure.contains_key(node) => {
                let ours = !self.cluster.nodes()[n as usize].spec.cordoned;
                if ours {
                    self.cluster.set_cordoned(node, true).map_err(bad)?;
                }
                tracing::error!("node {node}: {why}");
                self.nodes.disk_pressure_on(node, why, ours);
                self.view.cluster.urge();
                Ok(true)
            }
            None => match self.nodes.disk_pressure_off(node) {
                Some(ours) => {
                    if ours {
                        self.cluster.set_cordoned(node, false).map_err(bad)?;
                    }
                    tracing::info!("node {node}: disk pressure gone");
                    self.view.cluster.urge();
                    Ok(true)
                }
                None => Ok(false),
            },
            Some(_) => Ok(false),
        }
    }

    /// A rank of `job` on `node` failed for a reason outside the job.
    fn blame_node_fault(&mut self, node: &str, job: JobId, cause: crate::blame::Cause, now: Time) {
        let user = self.jobs.get(&job).map(|(r, _)| r.spec.user.clone());
        let job = user.as_deref().map(|u| (job, u));
        self.nodes.blame.node_fault(node, job, cause, now);
    }

    /// The agent found GPU `gpu` of `node` unhealthy: evidence against the
    /// node when a job ran on it (the fault cost that job); a fault on an
    /// idle GPU only takes that GPU out of service.
    fn blame_gpu(&mut self, node: &str, gpu: u32, reason: &str, now: Time) {
        let Some(cause) = crate::blame::gpu_cause(gpu, reason) else {
            return;
        };
        let Some(n) = self.cluster.node_index(node) else {
            return;
        };
        let hit: Vec<JobId> = self
            .cluster
            .jobs_on(n)
            .iter()
            .filter(|id| {
                self.jobs.get(*id).is_some_and(|(r, _)| {
                    r.placement
                        .iter()
                        .any(|p| p.node == node && p.gpus.contains(&gpu))
                })
            })
            .copied()
            .collect();
        for id in hit {
            self.blame_node_fault(node, id, cause.clone(), now);
        }
    }

    /// Applies what node blame decides now: cordons the nodes it blames
    /// (with their evidence as the reason), within its rate limit, or stops
    /// auto-cordoning when too many nodes qualify at once. Each decision is
    /// kept for the audit log and metrics ([`crate::parts::NodeRegistry::blame_log`]).
    pub(crate) fn apply_blame(&mut self, now: Time) -> Result<bool, ControlError> {
        let nodes = self.cluster.nodes();
        let cordoned: HashSet<&str> = nodes
            .iter()
            .filter(|n| n.spec.cordoned)
            .map(|n| n.spec.name.as_str())
            .collect();
        let decisions = self
            .nodes
            .blame
            .decide(now, nodes.len(), |n| cordoned.contains(n));
        let mut changed = false;
        for d in decisions {
            match &d {
                crate::blame::Decision::Cordon { node, why } => {
                    let why = format!("cordoned automatically at {now}: {why}");
                    let auto = AutoCordon {
                        by: "blame".into(),
                        at: now,
                        reason: why.clone(),
                    };
                    self.cordon_as(node, true, Some(&auto))?;
                    tracing::warn!("node {node} {why}");
                    self.start_probation(node, why, now);
                    changed = true;
                }
                crate::blame::Decision::Halt { nodes } => tracing::error!(
                    "auto-cordon stopped: {} nodes qualify at once ({}); the cause is likely not the nodes",
                    nodes.len(),
                    nodes.join(", ")
                ),
                crate::blame::Decision::Resume => tracing::warn!("auto-cordon resumed"),
            }
            self.nodes.blame_log.push(d);
        }
        Ok(changed)
    }

    /// An agent's sync: records the heartbeat (a NotReady node is Ready
    /// again), applies GPU health changes and task reports, and answers with
    /// everything that should run on the node (built by
    /// [`SyncAnswer::into_response`], once the lock is released), and
    /// whether anything the scheduler cares about changed (then it should
    /// run a cycle).
    pub fn sync(
        &mut self,
        node: &str,
        req: &SyncRequest,
        now: Time,
    ) -> Result<(SyncAnswer, bool), ControlError> {
        let n = self
            .cluster
            .node_index(node)
            .ok_or_else(|| ControlError::NoSuchNode(node.into()))?;
        self.nodes.heard(node, now);
        let mut changed = false;
        if !self.cluster.nodes()[n as usize].ready {
            tracing::info!("node {node} is Ready again");
            self.cluster
                .set_ready(node, true)
                .map_err(|e| ControlError::BadNode(e.to_string()))?;
            changed = true;
        }
        changed |= self.apply_gpu_health(node, &req.gpus, now)?;
        changed |= self.apply_disk_pressure(node, req.disk_pressure.as_deref())?;
        for t in &req.tasks {
            // The contract's parts of the report first: a busy rendezvous
            // port replaces the report; a checkpoint and a failure go with it.
            let contract = match t.port_busy {
                Some(port) => {
                    self.port_busy(node, t.job, t.attempt, port, t.port_holder.as_deref(), now)
                }
                None => match &t.checkpoint {
                    Some(c) => self.note_checkpoint(node, t.job, t.attempt, c, now),
                    None => Ok(false),
                },
            };
            match contract {
                Ok(c) => changed |= c,
                Err(
                    ControlError::StaleAttempt(..)
                    | ControlError::NotOnNode(..)
                    | ControlError::NoSuchJob(_),
                ) => continue,
                Err(e) => return Err(e),
            }
            if t.port_busy.is_some() {
                continue;
            }
            match self.note_warnings(node, t.job, t.attempt, &t.warnings, now) {
                Ok(w) => changed |= w,
                Err(ControlError::StaleAttempt(..) | ControlError::NotOnNode(..)) => {}
                Err(e) => return Err(e),
            }
            if let Some(f) = &t.failure {
                self.stash_failure(node, t.job, t.attempt, f);
                if let Some(why) = &f.node_fault {
                    self.blame_node_fault(
                        node,
                        t.job,
                        crate::blame::Cause::AgentFault(why.clone()),
                        now,
                    );
                }
            }
            let report = match t.state {
                TaskState::Running => Report::Running,
                TaskState::Failing { exit_code } => Report::Failing(exit_code),
                TaskState::Exited { exit_code } => Report::Exited(exit_code),
            };
            let before = self.jobs.get(&t.job).map(|(r, _)| r.state);
            match self.report(node, t.job, Some(t.attempt), report, now) {
                Ok(after) => changed |= before != Some(after),
                // Stale attempts and jobs gone elsewhere: the answer below no
                // longer lists them, so the agent stops them.
                Err(
                    ControlError::StaleAttempt(..)
                    | ControlError::NotOnNode(..)
                    | ControlError::NoSuchJob(_)
                    | ControlError::BadReport(..),
                ) => {}
                Err(e) => return Err(e),
            }
        }
        changed |= self.apply_blame(now)?;
        let (health_check, c) = self.probation_sync(node, req, now)?;
        changed |= c;
        let answer = SyncAnswer {
            work: self.node_work_for(node, req.reads_rendezvous_ports, req.reads_gang_nodes),
            cleanup: self.take_cleanup(node),
            health_check,
        };
        Ok((answer, changed))
    }

    /// GPU health as reported by the agent: a change of the agent's verdict
    /// is applied (and stored); an admin's clearing stands until the agent's
    /// verdict changes again. Returns whether any GPU changed.
    ///
    /// A gang using a GPU that turns unhealthy is ended like a gang on a
    /// lost node (a GPU fallen off the bus takes its ranks with it): it
    /// restarts elsewhere per its restart policy, away from that GPU.
    fn apply_gpu_health(
        &mut self,
        node: &str,
        gpus: &[GpuHealth],
        now: Time,
    ) -> Result<bool, ControlError> {
        let Some(n) = self.cluster.node_index(node) else {
            return Ok(false);
        };
        let mut changed = false;
        let mut broken: BTreeMap<JobId, String> = BTreeMap::new();
        let mut faulted = Vec::new();
        // Looked up by name: a heartbeat with no news allocates nothing here.
        let seen = match self.nodes.reported_health.get_mut(node) {
            Some(m) => m,
            None => self
                .nodes
                .reported_health
                .entry(node.to_string())
                .or_default(),
        };
        for g in gpus {
            if seen.insert(g.index, g.healthy) == Some(g.healthy) {
                continue;
            }
            let spec = &self.cluster.nodes()[n as usize].spec;
            let Some(pos) = spec.gpus.iter().position(|x| x.index == g.index) else {
                continue;
            };
            if spec.gpus[pos].healthy != g.healthy {
                if !g.healthy {
                    faulted.push((g.index, g.reason.clone().unwrap_or_default()));
                    tracing::warn!(
                        "node {node} GPU {} unhealthy: {}",
                        g.index,
                        g.reason.as_deref().unwrap_or("reported by its agent")
                    );
                }
                self.cluster
                    .set_gpu_health(node, pos, g.healthy)
                    .map_err(|e| ControlError::BadNode(e.to_string()))?;
                if !g.healthy {
                    let reason = g
                        .reason
                        .clone()
                        .unwrap_or_else(|| "reported by its agent".into());
                    for id in self.cluster.jobs_on(n) {
                        let uses = self.jobs.get(id).is_some_and(|(rec, _)| {
                            rec.placement
                                .iter()
                                .any(|p| p.node == node && p.gpus.contains(&g.index))
                        });
                        if uses {
                            broken.entry(*id).or_insert_with(|| {
                                format!("GPU {} on node {node} unhealthy: {reason}", g.index)
                            });
                        }
                    }
                    self.cluster
                        .set_gpu_reason(node, pos, Some(reason))
                        .map_err(|e| ControlError::BadNode(e.to_string()))?;
                }
                changed = true;
            }
        }
        for (gpu, reason) in faulted {
            self.blame_gpu(node, gpu, &reason, now);
        }
        if changed {
            self.store_node(n)?;
        }
        if !broken.is_empty() {
            self.end_gangs_of_gone_nodes(broken, now)?;
        }
        Ok(changed)
    }

    /// Marks a GPU healthy or unhealthy by admin decision, durably.
    pub fn set_gpu_health(
        &mut self,
        node: &str,
        index: u32,
        healthy: bool,
    ) -> Result<(), ControlError> {
        self.view.cluster.urge();
        let n = self
            .cluster
            .node_index(node)
            .ok_or_else(|| ControlError::NoSuchNode(node.into()))?;
        let pos = self.cluster.nodes()[n as usize]
            .spec
            .gpus
            .iter()
            .position(|g| g.index == index)
            .ok_or_else(|| ControlError::BadNode(format!("node {node} has no GPU {index}")))?;
        self.cluster
            .set_gpu_health(node, pos, healthy)
            .map_err(|e| ControlError::BadNode(e.to_string()))?;
        self.store_node(n)
    }

    pub(crate) fn store_node(&mut self, n: gangway_sched::NodeIdx) -> Result<(), ControlError> {
        let mut spec = self.cluster.nodes()[n as usize].spec.clone();
        // DiskPressure's own cordon is not stored: the agent reports the
        // pressure again at its next sync to a restarted server.
        if self
            .nodes
            .disk_pressure
            .get(&spec.name)
            .is_some_and(|p| p.1)
        {
            spec.cordoned = false;
        }
        self.store.put(&node_key(&spec.name), &encode(&spec))?;
        Ok(())
    }

    /// The nodes the lifecycle check acts on at `now`, in node order: those
    /// silent for `node_lost_seconds` and not yet lost, and those silent for
    /// `node_not_ready_seconds` and still Ready. Read from the heartbeat
    /// index: only the nodes it holds at or before the smaller of the two
    /// are looked at (the silent ones, and those heard from since they were
    /// last looked at, about once per threshold each: a walk of
    /// every node was O(nodes) each cycle).
    pub(crate) fn silent_nodes(&mut self, now: Time) -> Vec<SilentNode> {
        let lc = self.nodes.lifecycle;
        let least = lc.node_not_ready_seconds.min(lc.node_lost_seconds);
        let mut out = Vec::new();
        for (since, name) in self.nodes.heartbeats.silent_for(least, now) {
            // A node waiting for approval is not the scheduler's.
            let Some(n) = self.cluster.node_index(&name) else {
                continue;
            };
            let info = &self.cluster.nodes()[n as usize];
            let silent = now.saturating_sub(since);
            let Some(ready) = lc.acts_on(silent, info.ready, self.nodes.lost.contains(&name))
            else {
                continue;
            };
            out.push(SilentNode {
                node: n,
                name,
                silent,
                ready,
            });
        }
        // The order a walk of the nodes had: the first lost node of a job
        // names it in the job's ending.
        out.sort_unstable_by_key(|s| s.node);
        out
    }

    /// Node lifecycle, run each cycle: a node silent for
    /// `node_not_ready_seconds` is NotReady (no new work); silent for
    /// `node_lost_seconds`, its gangs are lost: preempted ones are requeued,
    /// the others restart elsewhere per their restart policy.
    fn check_nodes(&mut self, now: Time) -> Result<(), ControlError> {
        let lc = self.nodes.lifecycle;
        let silent_nodes = self.silent_nodes(now);
        let mut lost_jobs: BTreeMap<JobId, String> = BTreeMap::new();
        for SilentNode {
            name,
            silent,
            ready,
            ..
        } in silent_nodes
        {
            if ready {
                tracing::warn!("node {name} is NotReady: no heartbeat for {silent}s");
                self.cluster
                    .set_ready(&name, false)
                    .map_err(|e| ControlError::BadNode(e.to_string()))?;
            }
            if silent < lc.node_lost_seconds {
                continue;
            }
            self.nodes.lost.insert(name.clone());
            tracing::error!("node {name} is lost: no heartbeat for {silent}s; its gangs end");
            let Some(n) = self.cluster.node_index(&name) else {
                continue;
            };
            for id in self.cluster.jobs_on(n) {
                // A job on several lost nodes (or with several replicas on one)
                // is ended once, for the first of them.
                lost_jobs
                    .entry(*id)
                    .or_insert_with(|| format!("node {name} lost (no heartbeat for {silent}s)"));
            }
        }
        // Every gang on every lost node ends in one transaction: a rack
        // failing is one write, not one per job.
        self.end_gangs_of_gone_nodes(lost_jobs, now)
    }

    /// Ends the gangs that ran on nodes that are gone (lost or deleted), with
    /// the reason for each, in one write: a gang being stopped ends as its
    /// stop said (cancelled, failed), a preempted one is requeued, the
    /// others fail and restart elsewhere per their restart policy.
    pub(crate) fn end_gangs_of_gone_nodes(
        &mut self,
        gone: BTreeMap<JobId, String>,
        now: Time,
    ) -> Result<(), ControlError> {
        let mut recs = Vec::new();
        let mut afters = Vec::new();
        for (id, msg) in gone {
            let Some((rec, _)) = self.jobs.get(&id) else {
                continue;
            };
            if !matches!(
                rec.state,
                JobState::Scheduled | JobState::Running | JobState::Preempting
            ) {
                continue;
            }
            let ending = Ending::forced(rec, msg);
            let (rec, after) = self.ended_avoiding(JobRecord::clone(rec), ending, now);
            afters.push((id, after));
            recs.push(rec);
        }
        // Chunked on etcd: the endings that landed are applied even when a
        // later chunk fails.
        let (landed, written) = self.write_chunks(recs);
        for (id, after) in afters.into_iter().take(landed) {
            self.apply_ending(id, after);
        }
        written
    }

    /// Cordons or uncordons a node, durably, as an admin (or a passed
    /// health check) does: the cordon is nobody else's from now on.
    pub fn cordon(&mut self, name: &str, cordoned: bool) -> Result<(), ControlError> {
        self.cordon_as(name, cordoned, None)
    }

    /// [`Control::cordon`]; `auto`: the cordon is automatic, and its record
    /// is stored with it (else any such record is deleted with it).
    pub(crate) fn cordon_as(
        &mut self,
        name: &str,
        cordoned: bool,
        auto: Option<&AutoCordon>,
    ) -> Result<(), ControlError> {
        // The node list shows it to whoever is told it was done.
        self.view.cluster.urge();
        let n = self
            .cluster
            .node_index(name)
            .ok_or_else(|| ControlError::NoSuchNode(name.into()))?;
        let mut spec = self.cluster.nodes()[n as usize].spec.clone();
        spec.cordoned = cordoned;
        let record = match auto {
            Some(a) => Op::Put(auto_cordon_key(name), encode(a)),
            None => Op::Delete(auto_cordon_key(name)),
        };
        self.store
            .txn(&[], &[Op::Put(node_key(name), encode(&spec)), record])?;
        if let Some(p) = self.nodes.disk_pressure.get_mut(name) {
            // The pressure's end lifts no cordon it did not make.
            p.1 = false;
        }
        if !cordoned {
            // Back in service: the evidence that cordoned it is spent, and
            // jobs that avoided it for that evidence may use it again.
            self.nodes.uncordoned(name);
            self.forgive_node(name, crate::clock::now())?;
        }
        self.end_probation(name, cordoned);
        self.cluster
            .set_cordoned(name, cordoned)
            .map_err(|e| ControlError::BadNode(e.to_string()))?;
        Ok(())
    }

    /// Restarting jobs whose backoff has passed go back in line (keeping their place).
    fn resume_restarts(&mut self, now: Time) -> Result<(), ControlError> {
        let due: Vec<JobRecord> = self
            .jobs
            .in_states(&[JobState::Restarting])
            .into_iter()
            .filter(|r| r.restart_at.is_some_and(|t| t <= now))
            .map(|r| JobRecord::clone(r))
            .collect();
        for mut rec in due {
            rec.state = JobState::Pending;
            rec.restart_at = None;
            rec.events.push(JobEvent {
                at: now,
                kind: "requeued".into(),
                message: format!(
                    "back in line after restart backoff (restart {})",
                    rec.restarts
                ),
                count: 1,
                last_at: None,
            });
            let (id, spec, at) = (rec.id, rec.spec.clone(), rec.submitted_at);
            self.write(rec)?;
            let _ = self.cluster.submit(id, spec, at);
            self.apply_avoid(id);
        }
        Ok(())
    }

    /// One scheduling cycle whose decisions are durable when it returns.
    pub fn cycle(&mut self, now: Time) -> Result<Decisions, ControlError> {
        let d = self.cycle_deferred(now);
        // Synced either way: a failed cycle may follow decisions that landed.
        let synced = self.store.sync();
        let d = d?;
        synced?;
        Ok(d)
    }

    /// One scheduling cycle whose decisions are committed deferred
    /// ([`Store::txn_deferred`]): the caller calls [`Store::sync`] once it
    /// has released the state lock, so agents' batches and submissions are
    /// not held off while redb writes the cycle's records (on a busy
    /// cluster this was half of a cycle's time under the lock). Nothing
    /// leaves the server unsynced: an agent hears of a bind only in a
    /// combined batch's answer, sent after that batch's sync, which makes
    /// everything committed before it durable. Decisions are written to
    /// the store first, then applied; the caller syncs even when this
    /// fails, since the chunks that landed before the failure are applied.
    pub fn cycle_deferred(&mut self, now: Time) -> Result<Decisions, ControlError> {
        self.writes.defer_decisions = true;
        let d = self.cycle_inner(now);
        self.writes.defer_decisions = false;
        d
    }

    fn cycle_inner(&mut self, now: Time) -> Result<Decisions, ControlError> {
        /// One record of the cycle's writes: which decision it carries.
        enum Decided<'a> {
            Bind(&'a gangway_sched::Bind),
            Preempt(&'a gangway_sched::Preempt),
        }
        // The node list and the GPU totals show a cycle's binds at once.
        self.view.cluster.urge();
        self.credit_own_stall(now);
        self.check_nodes(now)?;
        self.resume_restarts(now)?;
        self.release_gated(now, true)?;
        self.enforce_time_limits(now)?;
        self.sync_reservations(now)?;
        self.rank_jobs(now);
        let d = schedule(&self.cluster, now, &self.policy.sched);
        let mut ports = self.ports_in_use(now);
        // Only what `apply` reads; the explanations are not copied.
        let mut applied = Decisions::default();
        // The cycle's decisions, written in as few transactions as the
        // store allows (one on redb; chunks within etcd's limits, each
        // fenced). Every record is compared on its revision, so a concurrent
        // change (a cancel) voids its chunk and the ones after it, which the
        // next cycle recomputes. Decisions of one cycle never overlap in
        // GPUs and a preemptor is bound only once its victims are gone, so
        // any prefix of them is a consistent state: what lands is applied,
        // in memory as on recovery. Stops go first, before any bind.
        let mut updates: Vec<JobRecord> = Vec::new();
        let mut decided: Vec<Decided<'_>> = Vec::new();
        for p in &d.preemptions {
            let Some((rec, _)) = self.jobs.get(&p.job) else {
                continue;
            };
            // Already being stopped (cancel, failed rank): its GPUs come free
            // when its processes are gone; the preemptor waits for that.
            if rec.stopping.is_some() {
                continue;
            }
            let mut rec = JobRecord::clone(rec);
            rec.state = JobState::Preempting;
            rec.preempted_by = Some(p.by);
            rec.signal_at_ms = Some(contract::wall_ms());
            rec.events.push(JobEvent {
                at: now,
                kind: "preempting".into(),
                message: format!(
                    "preempted by job {} ({:?}), grace {}s",
                    p.by, p.reason, p.grace_seconds
                ),
                count: 1,
                last_at: None,
            });
            updates.push(rec);
            decided.push(Decided::Preempt(p));
        }
        for b in &d.binds {
            let Some((rec, _)) = self.jobs.get(&b.job) else {
                continue;
            };
            let mut rec = JobRecord::clone(rec);
            rec.state = JobState::Scheduled;
            rec.placement = self.placement_to(&b.placement);
            rec.ran_on = rec.placement.iter().map(|r| r.node.clone()).collect();
            rec.ran_attempt = rec.attempt;
            rec.started_on.clear();
            rec.exited_on.clear();
            if self.assign_port(&mut rec, &mut ports).is_none() {
                tracing::warn!("job {}: no free rendezvous port on its rank 0 node", rec.id);
            }
            rec.events.push(JobEvent {
                at: now,
                kind: "scheduled".into(),
                message: format!(
                    "placed on {}",
                    rec.placement
                        .iter()
                        .map(|r| format!("{}:{:?}", r.node, r.gpus))
                        .collect::<Vec<_>>()
                        .join(" ")
                ),
                count: 1,
                last_at: None,
            });
            updates.push(rec);
            decided.push(Decided::Bind(b));
        }
        let (landed, written) = self.write_chunks(updates);
        for dec in decided.into_iter().take(landed) {
            match dec {
                Decided::Bind(b) => applied.binds.push(b.clone()),
                Decided::Preempt(p) => applied.preemptions.push(p.clone()),
            }
        }
        if let Err(e) = written {
            if landed > 0 {
                apply(&mut self.cluster, &applied, now)
                    .map_err(|e| ControlError::BadNode(e.to_string()))?;
            }
            return Err(match e {
                ControlError::Conflict(_) => {
                    ControlError::Conflict("a job changed during the cycle".into())
                }
                e => e,
            });
        }
        applied.planned = d.planned.clone();
        applied.dropped_claims = d.dropped_claims.clone();
        // A capped cycle moves the rotation of the jobs past its head.
        applied.next_rotation = d.next_rotation;
        apply(&mut self.cluster, &applied, now)
            .map_err(|e| ControlError::BadNode(e.to_string()))?;
        // Published with the cycle in the read view (shared, not copied).
        self.view.publish(&d, now, &self.cluster);
        Ok(d)
    }
}

#[cfg(test)]
mod tests;
