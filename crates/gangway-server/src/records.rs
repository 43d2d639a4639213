//! What the server stores per job, as JSON under `/jobs/<id>`.

use gangway_core::{JobId, JobSpec, JobState, ReasonCode, Time};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Who holds a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Hold {
    /// Its owner (`--hold`, `gangway hold` by the owner): the owner may release it.
    User,
    /// An administrator: only an administrator may release it.
    Admin,
}

impl Hold {
    /// The reason code a job held so waits with.
    pub fn code(self) -> ReasonCode {
        match self {
            Hold::User => ReasonCode::JobHeldUser,
            Hold::Admin => ReasonCode::JobHeldAdmin,
        }
    }
}

/// One rank group's GPUs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplicaOn {
    /// Node name.
    pub node: String,
    /// GPU device indices (`CUDA_VISIBLE_DEVICES`).
    pub gpus: Vec<u32>,
}

/// Something that happened to a job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobEvent {
    /// When.
    pub at: Time,
    /// `submitted`, `scheduled`, `preempting`, `cancelled`, ...
    pub kind: String,
    /// Details for people.
    pub message: String,
    /// How many times it happened in a row (folded into this one): 1 when
    /// once. `message` is the newest's.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub count: u32,
    /// When it last happened, when folded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_at: Option<Time>,
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

/// Most events a job keeps: the first [`EVENTS_KEPT_FIRST`] and the newest.
/// Whatever repeats, a job record stays small in the store.
pub const MAX_EVENTS: usize = 200;

/// How many of a job's first events are kept when the cap drops some.
pub const EVENTS_KEPT_FIRST: usize = 50;

/// Longest event message kept (longer ones are cut, marked with `…`).
pub const MAX_EVENT_MESSAGE: usize = 2048;

/// A message with its digits masked: events of the same kind that differ
/// only in numbers (a port moved, then moved again) fold into one.
fn shape(message: &str) -> impl Iterator<Item = char> + '_ {
    let mut last_digit = false;
    message.chars().filter_map(move |c| {
        let digit = c.is_ascii_digit();
        let out = match (digit, last_digit) {
            (true, true) => None,
            (true, false) => Some('#'),
            (false, _) => Some(c),
        };
        last_digit = digit;
        out
    })
}

impl JobEvent {
    /// Whether `next` repeats this event: the same kind and the same
    /// message but for its numbers.
    fn repeated_by(&self, next: &JobEvent) -> bool {
        self.kind == next.kind && shape(&self.message).eq(shape(&next.message))
    }

    /// The event for people: its message, with `(×N, last at T)` when folded.
    pub fn text(&self) -> String {
        match (self.count, self.last_at) {
            (n, Some(t)) if n > 1 => format!("{} (×{n}, last at {t})", self.message),
            _ => self.message.clone(),
        }
    }
}

/// Folds repeated events of `events` into the one before them (a count
/// and the last time; the newest message) and caps the list at
/// [`MAX_EVENTS`]: the first [`EVENTS_KEPT_FIRST`] and the newest stay,
/// the ones between are dropped and counted in `dropped`. Messages longer
/// than [`MAX_EVENT_MESSAGE`] are cut. Idempotent: run on every write.
pub fn bound_events(events: &mut Vec<JobEvent>, dropped: &mut u64) {
    let mut out: Vec<JobEvent> = Vec::with_capacity(events.len().min(MAX_EVENTS + 1));
    for mut e in events.drain(..) {
        if e.message.len() > MAX_EVENT_MESSAGE {
            let mut cut = MAX_EVENT_MESSAGE;
            while !e.message.is_char_boundary(cut) {
                cut -= 1;
            }
            e.message.truncate(cut);
            e.message.push('…');
        }
        // Events on either side of the ones dropped were not in a row.
        let across_gap = *dropped > 0 && out.len() == EVENTS_KEPT_FIRST;
        match out.last_mut() {
            Some(prev) if !across_gap && prev.repeated_by(&e) => {
                prev.count = prev.count.saturating_add(e.count.max(1));
                prev.last_at = Some(e.last_at.unwrap_or(e.at));
                prev.message = e.message;
            }
            _ => out.push(e),
        }
    }
    if out.len() > MAX_EVENTS {
        let drop = out.len() - MAX_EVENTS;
        out.drain(EVENTS_KEPT_FIRST..EVENTS_KEPT_FIRST + drop);
        *dropped = dropped.saturating_add(drop as u64);
    }
    *events = out;
}

/// Why a gang on its nodes is being stopped (not by preemption, which is
/// `JobState::Preempting`), and so what it becomes once every node reports
/// none of its processes left: its GPUs stay booked until then.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case", tag = "cause")]
pub enum Stopping {
    /// Cancelled by a user or admin: ends `Cancelled`.
    Cancelled {
        /// Who cancelled it.
        by: String,
    },
    /// A rank failed: the gang restarts (per its policy) or fails.
    Failed {
        /// What failed, for the event.
        message: String,
    },
}

/// The durable record of a job.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobRecord {
    /// Id.
    pub id: JobId,
    /// Owner.
    pub user: String,
    /// Spec as submitted.
    pub spec: JobSpec,
    /// Lifecycle state.
    pub state: JobState,
    /// Submission time.
    pub submitted_at: Time,
    /// Where its replicas run (when scheduled).
    #[serde(default)]
    pub placement: Vec<ReplicaOn>,
    /// History.
    #[serde(default)]
    pub events: Vec<JobEvent>,
    /// Restarts after failures so far.
    #[serde(default)]
    pub restarts: u32,
    /// While restarting: when it may be scheduled again (exponential backoff).
    #[serde(default)]
    pub restart_at: Option<Time>,
    /// While preempting: the job it makes room for.
    #[serde(default)]
    pub preempted_by: Option<JobId>,
    /// Which run this is: every requeue and restart starts a new attempt, and
    /// agents stop ranks of any other attempt.
    #[serde(default)]
    pub attempt: u32,
    /// Nodes whose ranks of this attempt have all started.
    #[serde(default)]
    pub started_on: BTreeSet<String>,
    /// Nodes whose ranks of this attempt have all exited, with the exit code.
    #[serde(default)]
    pub exited_on: BTreeMap<String, i32>,
    /// The node of each rank of the latest attempt that was placed (for logs).
    #[serde(default)]
    pub ran_on: Vec<String>,
    /// That attempt.
    #[serde(default)]
    pub ran_attempt: u32,
    /// The last checkpoint the job's ranks reported (kept across attempts:
    /// a resumed attempt gets its path as `GANGWAY_RESUME_FROM`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointRecord>,
    /// The first rank failure of the latest attempt that failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<FailureRecord>,
    /// The current attempt's rendezvous port on rank 0's node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master_port: Option<u16>,
    /// When the checkpoint signal was decided (preemption or time limit),
    /// milliseconds since the epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal_at_ms: Option<u64>,
    /// The previous attempt failed at start (within
    /// [`gangway_core::job::START_FAILURE_SECONDS`]): its exit code and last
    /// line of output, to tell the same start failure twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_failure: Option<String>,
    /// Attempts started because rank 0's rendezvous port was taken, before
    /// anything ran: not restarts (`TORCHELASTIC_RESTART_COUNT` leaves them out).
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub port_moves: u32,
    /// When the time limit was reached: the attempt ends as `timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_limit_hit: Option<Time>,
    /// While its ranks are being stopped: why, and what it becomes then.
    #[serde(default)]
    pub stopping: Option<Stopping>,
    /// Held (`gangway hold`): kept out of the scheduler until released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<Hold>,
    /// The array task this job is, when it was submitted as an array.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub array: Option<gangway_core::ArrayTask>,
    /// Why it ended without running, when a reason code says it
    /// (`DependencyNeverSatisfied`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_reason: Option<gangway_core::ReasonCode>,
    /// GPU-seconds it held in attempts that have ended (from each attempt's
    /// `scheduled` event to its end): the attained service the ranking
    /// (`gangway_sched::rank`) reads. Older records start at 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attained_gpu_seconds: u64,
    /// Wall-clock seconds its ended attempts ran (time not spent waiting).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub run_seconds: u64,
    /// Nodes its next attempt avoids after they failed the last one (a node
    /// fault), until when; cleared once that attempt runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub avoid: Option<AvoidNodes>,
    /// Events dropped by the cap ([`MAX_EVENTS`]): they were between the
    /// first ones kept and the newest.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub events_dropped: u64,
}

/// Nodes a job's next attempt avoids (see `avoid_node_seconds`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AvoidNodes {
    /// The nodes blamed for the last attempt's failure.
    pub nodes: Vec<String>,
    /// When the avoidance lapses (seconds since the epoch).
    pub until: Time,
    /// Why, when it is not a node fault (the why-pending reason adds it):
    /// `its rendezvous ports 29400, 29401 there were held by other processes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub because: Option<String>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

/// A checkpoint reported through `$GANGWAY_CHECKPOINT_DIR/LATEST`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CheckpointRecord {
    /// Training step.
    pub step: u64,
    /// Where it is.
    pub path: String,
    /// When the rank wrote `LATEST` (ms since the epoch).
    pub written_ms: u64,
    /// Attempt that reported it.
    pub attempt: u32,
    /// Node that reported it.
    pub node: String,
}

/// The first failing rank of an attempt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FailureRecord {
    /// Attempt.
    pub attempt: u32,
    /// Node.
    pub node: String,
    /// Global rank (`None` when the node did not say which).
    pub rank: Option<u32>,
    /// Exit code (128+N for signal N).
    pub exit_code: i32,
    /// The signal that killed it.
    #[serde(default)]
    pub signal: Option<i32>,
    /// Killed by the kernel's OOM killer.
    #[serde(default)]
    pub oom_killed: bool,
    /// Last lines of its log.
    #[serde(default)]
    pub log_tail: Vec<String>,
    /// The limit that stopped it and the value reached, when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
    /// When it was reported.
    pub at: Time,
}

impl JobRecord {
    /// A job just submitted: pending, first attempt, one `submitted` event.
    pub fn submitted(id: JobId, user: &str, spec: JobSpec, now: Time) -> Self {
        let message = format!("submitted by {user} to queue {}", spec.queue);
        JobRecord {
            id,
            user: user.to_string(),
            spec,
            state: JobState::Pending,
            submitted_at: now,
            placement: Vec::new(),
            events: vec![JobEvent {
                at: now,
                kind: "submitted".into(),
                message,
                count: 1,
                last_at: None,
            }],
            restarts: 0,
            restart_at: None,
            preempted_by: None,
            attempt: 0,
            started_on: BTreeSet::new(),
            exited_on: BTreeMap::new(),
            ran_on: Vec::new(),
            ran_attempt: 0,
            checkpoint: None,
            failure: None,
            master_port: None,
            signal_at_ms: None,
            port_moves: 0,
            start_failure: None,
            time_limit_hit: None,
            stopping: None,
            held: None,
            array: None,
            end_reason: None,
            attained_gpu_seconds: 0,
            run_seconds: 0,
            avoid: None,
            events_dropped: 0,
        }
    }

    /// When the current attempt was placed (its last `scheduled` event since
    /// the last requeue or restart), if it was.
    pub fn attempt_started(&self) -> Option<Time> {
        self.events
            .iter()
            .rev()
            .find(|e| matches!(e.kind.as_str(), "scheduled" | "requeued" | "restarting"))
            .filter(|e| e.kind == "scheduled")
            .map(|e| e.at)
    }

    /// The distinct nodes of the current placement, in rank order.
    pub fn nodes(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for r in &self.placement {
            if !out.contains(&r.node.as_str()) {
                out.push(&r.node);
            }
        }
        out
    }
}

/// Store key of a node's token.
pub fn token_key(name: &str) -> String {
    format!("/node_tokens/{name}")
}

/// Store key of a job.
pub fn job_key(id: JobId) -> String {
    format!("/jobs/{:020}", id.0)
}

/// Store key of a node.
pub fn node_key(name: &str) -> String {
    format!("/nodes/{name}")
}

/// Prefix of the automatic cordons' records ([`AutoCordon`]).
pub const AUTO_CORDON_PREFIX: &str = "/node_cordons/";

/// Store key of the record of a node's automatic cordon.
pub fn auto_cordon_key(name: &str) -> String {
    format!("{AUTO_CORDON_PREFIX}{name}")
}

/// Why a node was cordoned automatically, kept beside its spec (which says
/// only `cordoned`) while that cordon lasts, so a restarted or new leader
/// knows the cordon is automatic and puts the node back on probation. A
/// cordoned node without one is an admin's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AutoCordon {
    /// What cordoned it (`blame`).
    pub by: String,
    /// When.
    pub at: Time,
    /// The reason shown with the node (the evidence).
    pub reason: String,
}

/// Key holding the highest probation run number any leader may have handed
/// out: a new leader numbers its runs above it, so no agent's result of an
/// earlier leader's run passes for one of its own.
pub const PROBATION_RUN_KEY: &str = "/meta/probation_runs";

/// Key holding the last job id handed out.
pub const JOB_SEQ: &str = "/meta/job_seq";

/// Job records by id, each with its store revision: a persistent map whose
/// records are shared (`Arc`), so a copy of it (the read view, see
/// [`crate::view`]) costs O(1) and a write after a copy O(log n), never
/// O(jobs).
pub type JobMap = imbl::OrdMap<JobId, (Arc<JobRecord>, u64)>;

/// The jobs by queue and state, shared with the read view (a write after a
/// publication copies this small map: queues times states).
pub type JobCounts =
    Arc<std::collections::HashMap<String, std::collections::HashMap<JobState, i64>>>;

/// The non-zero counts of `counts` as (state, queue, count).
pub fn nonzero_counts(counts: &JobCounts) -> impl Iterator<Item = (JobState, &str, i64)> + '_ {
    counts.iter().flat_map(|(q, by)| {
        by.iter()
            .filter(|(_, n)| **n != 0)
            .map(move |(s, n)| (*s, q.as_str(), *n))
    })
}

/// The control state's job records by id, each with its store revision, and
/// a count of them by queue and state kept current on every insert and
/// removal, so `/metrics` reads the counts instead of walking the jobs under
/// the state lock. Reads go through `Deref` to the map; writes only through
/// [`JobTable::insert`] and [`JobTable::remove`], which keep the counts and
/// the indexes below.
///
/// The indexes exist because the table keeps every job until retention
/// removes it (100,000s of records): the cycle's passes over the jobs in
/// some state (time limits, restart backoffs, rendezvous ports) and an agent
/// sync's checkpoint cleanups read them instead of walking every record.
#[derive(Clone, Debug, Default)]
pub struct JobTable {
    map: JobMap,
    counts: JobCounts,
    /// Ids of the jobs in each non-terminal state.
    live: std::collections::HashMap<JobState, BTreeSet<JobId>>,
    /// Live (non-terminal) jobs by checkpoint subdirectory under the root,
    /// with how many use it.
    live_dirs: std::collections::HashMap<String, u32>,
    /// Every job's checkpoint subdirectory, whatever its state (an ended
    /// job's directory may be kept), with the jobs that name it: what the
    /// nesting rule of submissions reads.
    all_dirs: BTreeMap<String, BTreeSet<JobId>>,
    /// Rendezvous ports held by jobs on GPUs (scheduled, running,
    /// preempting), by their rank-0 node, with how many hold each.
    live_ports: std::collections::HashMap<String, BTreeMap<u16, u32>>,
    /// Ids inserted, replaced or removed since [`JobTable::take_changed`]
    /// last drained them: the ranking's work list between cycles.
    changed: std::collections::HashSet<JobId>,
    /// Ids of the jobs on GPUs that a deadline may end (see
    /// [`JobTable::deadline_candidates`]).
    deadlines: BTreeSet<JobId>,
}

/// Whether a deadline checked every cycle may end the job of `r`: a stop's
/// grace (a cancel, a failed rank), a preemption's grace, or a time limit
/// not yet reached on a job on GPUs.
fn under_deadline(r: &JobRecord) -> bool {
    match r.state {
        JobState::Preempting => true,
        JobState::Scheduled | JobState::Running => {
            r.stopping.is_some()
                || (r.time_limit_hit.is_none() && r.spec.time_limit_seconds().is_some())
        }
        _ => false,
    }
}

impl std::ops::Deref for JobTable {
    type Target = JobMap;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl JobTable {
    /// Inserts or replaces a record (owned or shared); the replaced one, if any.
    pub fn insert(
        &mut self,
        id: JobId,
        v: (impl Into<Arc<JobRecord>>, u64),
    ) -> Option<(Arc<JobRecord>, u64)> {
        let v = (v.0.into(), v.1);
        self.count(&v.0, 1);
        let old = self.map.insert(id, v.clone());
        if let Some((rec, _)) = &old {
            self.count(rec, -1);
        }
        self.index(old.as_ref().map(|(r, _)| r.as_ref()), Some(&v.0));
        self.changed.insert(id);
        old
    }

    /// Sets the stored revision of a record already here (its record and
    /// every index unchanged): after a deferred write lands.
    pub fn set_revision(&mut self, id: &JobId, revision: u64) {
        if let Some(entry) = self.map.get_mut(id) {
            entry.1 = revision;
        }
    }

    /// Removes a record; the removed one, if any.
    pub fn remove(&mut self, id: &JobId) -> Option<(Arc<JobRecord>, u64)> {
        let old = self.map.remove(id);
        if let Some((rec, _)) = &old {
            self.count(rec, -1);
            self.index(Some(rec), None);
            self.changed.insert(*id);
        }
        old
    }

    /// The ids of the jobs inserted, replaced or removed since the last call
    /// (all of them at the first), emptying the list: what the cycle's
    /// ranking looks at instead of every pending job. One consumer only.
    pub fn take_changed(&mut self) -> std::collections::HashSet<JobId> {
        std::mem::take(&mut self.changed)
    }

    /// The ids of the jobs in any of `states`, in id order, without their
    /// records (see [`JobTable::in_states`]).
    pub fn ids_in_states(&self, states: &[JobState]) -> Vec<JobId> {
        let mut ids: Vec<JobId> = states
            .iter()
            .filter_map(|s| self.live.get(s))
            .flatten()
            .copied()
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The records of the jobs on GPUs that a deadline checked every cycle
    /// may end, in id order: preempting, stopping (cancelled, a rank
    /// failed), or scheduled or running under a time limit not yet reached.
    /// The grace expiry and the time-limit check read these instead of every
    /// job on GPUs; each still applies its own test to them.
    pub fn deadline_candidates(&self) -> Vec<&Arc<JobRecord>> {
        self.deadlines
            .iter()
            .filter_map(|id| self.map.get(id).map(|(r, _)| r))
            .collect()
    }

    /// The records of the jobs in any of `states` (non-terminal ones), in id
    /// order; terminal states have no index and yield nothing.
    pub fn in_states(&self, states: &[JobState]) -> Vec<&Arc<JobRecord>> {
        self.ids_in_states(states)
            .iter()
            .filter_map(|id| self.map.get(id).map(|(r, _)| r))
            .collect()
    }

    /// Whether a live (non-terminal) job keeps its checkpoints in `subdir`
    /// (see [`gangway_core::agent::checkpoint_subdir`]).
    pub fn checkpoint_dir_in_use(&self, subdir: &str) -> bool {
        self.live_dirs.get(subdir).is_some_and(|n| *n > 0)
    }

    /// A job whose checkpoint directory (a subdirectory under the root, as
    /// [`gangway_core::agent::checkpoint_subdir`] builds it) holds `subdir`
    /// strictly inside it (`true`) or lies strictly inside `subdir`
    /// (`false`), with that directory; whatever the job's state.
    pub fn nested_checkpoint_dir(&self, subdir: &str) -> Option<(JobId, &str, bool)> {
        for (i, _) in subdir.match_indices('/') {
            if let Some((d, ids)) = self.all_dirs.get_key_value(&subdir[..i]) {
                if let Some(id) = ids.first() {
                    return Some((*id, d.as_str(), true));
                }
            }
        }
        let below = format!("{subdir}/");
        self.all_dirs
            .range(below.clone()..)
            .take_while(|(d, _)| d.starts_with(&below))
            .find_map(|(d, ids)| ids.first().map(|id| (*id, d.as_str(), false)))
    }

    /// The rendezvous ports held by jobs on GPUs whose rank 0 is on `node`.
    pub fn ports_on(&self, node: &str) -> impl Iterator<Item = u16> + '_ {
        self.live_ports
            .get(node)
            .into_iter()
            .flat_map(|ports| ports.keys().copied())
    }

    /// Moves a job's entries in the state, checkpoint and port indexes from
    /// its `old` record to its `new` one.
    fn index(&mut self, old: Option<&JobRecord>, new: Option<&JobRecord>) {
        fn held(r: &JobRecord) -> Option<(&str, u16)> {
            match (r.state, r.master_port, r.placement.first()) {
                (
                    JobState::Scheduled | JobState::Running | JobState::Preempting,
                    Some(p),
                    Some(r0),
                ) => Some((r0.node.as_str(), p)),
                _ => None,
            }
        }
        let (old_port, new_port) = (old.and_then(held), new.and_then(held));
        if old_port != new_port {
            if let Some((node, p)) = old_port {
                if let Some(ports) = self.live_ports.get_mut(node) {
                    if let Some(n) = ports.get_mut(&p) {
                        *n = n.saturating_sub(1);
                        if *n == 0 {
                            ports.remove(&p);
                        }
                    }
                    if ports.is_empty() {
                        self.live_ports.remove(node);
                    }
                }
            }
            if let Some((node, p)) = new_port {
                let ports = match self.live_ports.get_mut(node) {
                    Some(ports) => ports,
                    None => self.live_ports.entry(node.to_string()).or_default(),
                };
                *ports.entry(p).or_insert(0) += 1;
            }
        }
        let (was, is) = (
            old.is_some_and(under_deadline),
            new.is_some_and(under_deadline),
        );
        if was && !is {
            if let Some(o) = old {
                self.deadlines.remove(&o.id);
            }
        }
        if is && !was {
            if let Some(n) = new {
                self.deadlines.insert(n.id);
            }
        }
        let all = |r: &JobRecord| {
            let d = gangway_core::agent::checkpoint_subdir(
                &r.user,
                r.id,
                r.spec.checkpoint.dir.as_deref(),
            );
            (d, r.id)
        };
        let (was_at, is_at) = (old.map(all), new.map(all));
        if was_at != is_at {
            if let Some((d, id)) = was_at {
                if let Some(ids) = self.all_dirs.get_mut(&d) {
                    ids.remove(&id);
                    if ids.is_empty() {
                        self.all_dirs.remove(&d);
                    }
                }
            }
            if let Some((d, id)) = is_at {
                self.all_dirs.entry(d).or_default().insert(id);
            }
        }
        let live = |r: &&JobRecord| !r.state.is_terminal();
        let (old, new) = (old.filter(live), new.filter(live));
        let same_state = matches!((old, new), (Some(o), Some(n)) if o.state == n.state);
        if !same_state {
            if let Some(o) = old {
                if let Some(set) = self.live.get_mut(&o.state) {
                    set.remove(&o.id);
                }
            }
            if let Some(n) = new {
                self.live.entry(n.state).or_default().insert(n.id);
            }
        }
        let dir = |r: &JobRecord| {
            gangway_core::agent::checkpoint_subdir(&r.user, r.id, r.spec.checkpoint.dir.as_deref())
        };
        let same_dir = matches!((old, new), (Some(o), Some(n))
            if o.user == n.user && o.id == n.id && o.spec.checkpoint.dir == n.spec.checkpoint.dir);
        if same_dir {
            return;
        }
        if let Some(o) = old {
            let d = dir(o);
            if let Some(n) = self.live_dirs.get_mut(&d) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.live_dirs.remove(&d);
                }
            }
        }
        if let Some(n) = new {
            *self.live_dirs.entry(dir(n)).or_insert(0) += 1;
        }
    }

    /// A copy of the map that shares every record and node with this table
    /// (O(1)): what the read view publishes.
    pub fn snapshot(&self) -> JobMap {
        self.map.clone()
    }

    /// The jobs by (state, queue), non-zero counts only.
    pub fn counts(&self) -> impl Iterator<Item = (JobState, &str, i64)> + '_ {
        nonzero_counts(&self.counts)
    }

    /// The counts, shared (O(1)): what the read view publishes.
    pub fn counts_shared(&self) -> JobCounts {
        self.counts.clone()
    }

    fn count(&mut self, rec: &JobRecord, d: i64) {
        let counts = Arc::make_mut(&mut self.counts);
        let by = match counts.get_mut(rec.spec.queue.as_str()) {
            Some(by) => by,
            None => counts.entry(rec.spec.queue.clone()).or_default(),
        };
        *by.entry(rec.state).or_insert(0) += d;
    }
}

impl<R: Into<Arc<JobRecord>>> FromIterator<(JobId, (R, u64))> for JobTable {
    fn from_iter<I: IntoIterator<Item = (JobId, (R, u64))>>(it: I) -> Self {
        let mut t = JobTable::default();
        for (id, v) in it {
            t.insert(id, v);
        }
        t
    }
}

impl JobEvent {
    /// An event of `kind` at `at`.
    pub(crate) fn new(at: Time, kind: &str, message: String) -> Self {
        JobEvent {
            at,
            kind: kind.into(),
            message,
            count: 1,
            last_at: None,
        }
    }
}

#[cfg(test)]
mod event_tests {
    use super::*;

    fn ev(at: Time, kind: &str, message: &str) -> JobEvent {
        JobEvent::new(at, kind, message.to_string())
    }

    #[test]
    fn repeated_events_fold_into_one_with_a_count_and_the_last_time() {
        let mut events = vec![ev(1, "submitted", "submitted by alice")];
        for i in 0..37u64 {
            events.push(ev(
                10 + i,
                "rendezvous",
                &format!(
                    "rendezvous port {} is in use on n; moved to port {}",
                    29_400 + i,
                    29_401 + i
                ),
            ));
            let mut dropped = 0;
            bound_events(&mut events, &mut dropped);
            assert_eq!(dropped, 0);
        }
        events.push(ev(50, "rendezvous", "something else"));
        events.push(ev(51, "running", "rank 0 started"));
        events.push(ev(52, "running", "rank 0 started"));
        let mut dropped = 0;
        bound_events(&mut events, &mut dropped);
        assert_eq!(events.len(), 4, "{events:?}");
        let moved = &events[1];
        assert_eq!((moved.at, moved.count, moved.last_at), (10, 37, Some(46)));
        assert!(
            moved.message.contains("29436"),
            "the newest message: {}",
            moved.message
        );
        assert!(
            moved.text().ends_with("(×37, last at 46)"),
            "{}",
            moved.text()
        );
        assert_eq!(events[2].count, 1, "another shape is another event");
        assert_eq!((events[3].count, events[3].last_at), (2, Some(52)));
        assert_eq!(events[2].text(), "something else");
        // Idempotent.
        let again = events.clone();
        bound_events(&mut events, &mut dropped);
        assert_eq!(events, again);
    }

    #[test]
    fn a_jobs_events_are_capped_keeping_the_first_and_the_newest() {
        let mut events = Vec::new();
        let mut dropped = 0;
        for i in 0..10_000u64 {
            // Distinct kinds in turn: nothing folds.
            let kind = ["a", "b", "c"][(i % 3) as usize];
            events.push(ev(i, kind, "x"));
            bound_events(&mut events, &mut dropped);
            assert!(events.len() <= MAX_EVENTS);
        }
        assert_eq!(events.len(), MAX_EVENTS);
        assert_eq!(dropped, 10_000 - MAX_EVENTS as u64);
        assert_eq!(events[0].at, 0, "the first kept");
        assert_eq!(
            events[EVENTS_KEPT_FIRST - 1].at,
            EVENTS_KEPT_FIRST as u64 - 1
        );
        assert_eq!(events.last().map(|e| e.at), Some(9_999), "the newest kept");
        // A huge message is cut.
        let mut big = vec![ev(1, "warning", &"é".repeat(MAX_EVENT_MESSAGE))];
        bound_events(&mut big, &mut dropped);
        assert!(big[0].message.len() <= MAX_EVENT_MESSAGE + '…'.len_utf8());
        assert!(big[0].message.ends_with('…'));
    }
}

#[cfg(test)]
mod table_tests {
    use super::*;

    /// The counts a walk of the table gives, as the table's counts are read.
    fn walked(t: &JobTable) -> BTreeMap<(String, String), i64> {
        let mut m = BTreeMap::new();
        for (rec, _) in t.values() {
            *m.entry((format!("{:?}", rec.state), rec.spec.queue.clone()))
                .or_insert(0) += 1;
        }
        m
    }

    fn counted(t: &JobTable) -> BTreeMap<(String, String), i64> {
        t.counts()
            .map(|(s, q, n)| ((format!("{s:?}"), q.to_string()), n))
            .collect()
    }

    #[test]
    fn the_counts_follow_inserts_replacements_and_removals() {
        let mut t = JobTable::default();
        for i in 1..=6u64 {
            let q = if i % 2 == 0 { "a" } else { "b" };
            let r = JobRecord::submitted(JobId(i), "alice", JobSpec::new("j", q, 1, 1), 5);
            t.insert(r.id, (r, i));
        }
        assert_eq!(counted(&t), walked(&t));
        assert_eq!(counted(&t).get(&("Pending".into(), "a".into())), Some(&3));
        // A state change replaces the record: it moves from one count to another.
        let mut r = JobRecord::clone(&t[&JobId(2)].0);
        r.state = JobState::Running;
        t.insert(r.id, (r, 9));
        // A queue change too.
        let mut r = JobRecord::clone(&t[&JobId(3)].0);
        r.spec.queue = "c".into();
        t.insert(r.id, (r, 9));
        assert!(t.remove(&JobId(5)).is_some());
        assert!(t.remove(&JobId(5)).is_none());
        assert_eq!(counted(&t), walked(&t));
        assert_eq!(counted(&t).get(&("Running".into(), "a".into())), Some(&1));
        assert_eq!(counted(&t).get(&("Pending".into(), "b".into())), Some(&1));
        assert_eq!(counted(&t).get(&("Pending".into(), "c".into())), Some(&1));
        // A count that reaches zero is not reported.
        t.remove(&JobId(1));
        assert_eq!(counted(&t).get(&("Pending".into(), "b".into())), None);
        assert_eq!(counted(&t), walked(&t));
        let rebuilt: JobTable = t.iter().map(|(k, v)| (*k, v.clone())).collect();
        assert_eq!(counted(&rebuilt), walked(&t));
    }

    const STATES: [JobState; 11] = [
        JobState::Pending,
        JobState::Admitted,
        JobState::Scheduled,
        JobState::Running,
        JobState::Preempting,
        JobState::Requeued,
        JobState::Restarting,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
        JobState::Timeout,
    ];

    proptest::proptest! {
        /// Whatever the inserts, replacements and removals, the state index
        /// and the checkpoint-directory index answer as a walk of every
        /// record does, and the changed list names every id written since
        /// it was last drained.
        #[test]
        fn the_indexes_answer_as_a_walk_does(
            ops in proptest::collection::vec(
                ((1u64..12, 0usize..12, 0usize..3, 0usize..3, 0usize..4), (0usize..3, 0usize..3, proptest::prelude::any::<bool>())), 1..80)
        ) {
            let mut t = JobTable::default();
            let mut touched = std::collections::HashSet::new();
            for ((id, state, user, dir, port), (stopping, limit, hit)) in ops {
                if state == STATES.len() {
                    if t.remove(&JobId(id)).is_some() {
                        touched.insert(JobId(id));
                    }
                    continue;
                }
                // Now and then the ranking drains what changed.
                if id == 7 && dir == 2 {
                    proptest::prop_assert_eq!(t.take_changed(), std::mem::take(&mut touched));
                }
                touched.insert(JobId(id));
                let mut r = JobRecord::submitted(
                    JobId(id),
                    ["alice", "bob", "carol"][user],
                    JobSpec::new("j", "q", 1, 1),
                    5,
                );
                r.spec.checkpoint.dir = [None, Some("run".to_string()), Some("job-3".to_string())][dir].clone();
                r.state = STATES[state];
                r.stopping = [
                    None,
                    Some(Stopping::Cancelled { by: "bob".into() }),
                    Some(Stopping::Failed { message: "rank 1".into() }),
                ][stopping]
                    .clone();
                // No time limit, one in seconds, or one as text that does
                // not parse (no limit).
                r.spec.time_limit = [
                    None,
                    Some(gangway_core::TimeSpan::Seconds(60)),
                    Some(gangway_core::TimeSpan::Text("soon".into())),
                ][limit]
                    .clone();
                r.time_limit_hit = hit.then_some(9);
                // A port on rank 0's node "a" or "b" (or none), with the rank
                // on another node or none.
                if port > 0 {
                    r.master_port = Some(7000 + (port as u16 % 2));
                    for node in [["a", "b"][port % 2], "b"].into_iter().take(port.min(2)) {
                        r.placement.push(ReplicaOn { node: node.into(), gpus: vec![0] });
                    }
                }
                t.insert(r.id, (r, id));
            }
            for s in STATES {
                let walked: Vec<JobId> = t.values().filter(|(r, _)| r.state == s && !s.is_terminal()).map(|(r, _)| r.id).collect();
                let indexed: Vec<JobId> = t.in_states(&[s]).iter().map(|r| r.id).collect();
                proptest::prop_assert_eq!(walked, indexed, "state {:?}", s);
            }
            proptest::prop_assert_eq!(t.take_changed(), touched);
            proptest::prop_assert!(t.take_changed().is_empty());
            for node in ["a", "b", "c"] {
                let mut walked: Vec<u16> = t.values()
                    .filter(|(r, _)| matches!(r.state, JobState::Scheduled | JobState::Running | JobState::Preempting))
                    .filter(|(r, _)| r.placement.first().is_some_and(|r0| r0.node == node))
                    .filter_map(|(r, _)| r.master_port)
                    .collect();
                walked.sort_unstable();
                walked.dedup();
                let indexed: Vec<u16> = t.ports_on(node).collect();
                proptest::prop_assert_eq!(walked, indexed, "ports on {}", node);
            }
            // What the grace expiry and the time-limit check look at.
            let walked: Vec<JobId> = t.values()
                .filter(|(r, _)| matches!(r.state, JobState::Scheduled | JobState::Running | JobState::Preempting))
                .filter(|(r, _)| r.state == JobState::Preempting
                    || r.stopping.is_some()
                    || (r.time_limit_hit.is_none() && r.spec.time_limit_seconds().is_some()))
                .map(|(r, _)| r.id)
                .collect();
            let indexed: Vec<JobId> = t.deadline_candidates().iter().map(|r| r.id).collect();
            proptest::prop_assert_eq!(walked, indexed, "deadline candidates");
            let two = [JobState::Running, JobState::Pending];
            let walked: Vec<JobId> = t.values().filter(|(r, _)| two.contains(&r.state)).map(|(r, _)| r.id).collect();
            let indexed: Vec<JobId> = t.in_states(&two).iter().map(|r| r.id).collect();
            proptest::prop_assert_eq!(walked, indexed);
            for user in ["alice", "bob", "carol"] {
                for dir in [None, Some("run"), Some("job-3"), Some("job-5")] {
                    for id in 1u64..12 {
                        let d = gangway_core::agent::checkpoint_subdir(user, JobId(id), dir);
                        let walked = t.values().any(|(r, _)| !r.state.is_terminal()
                            && gangway_core::agent::checkpoint_subdir(&r.user, r.id, r.spec.checkpoint.dir.as_deref()) == d);
                        proptest::prop_assert_eq!(walked, t.checkpoint_dir_in_use(&d), "{}", d);
                    }
                }
            }
        }
    }
}
