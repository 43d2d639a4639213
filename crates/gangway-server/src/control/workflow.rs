//! Job workflow on the control state: holds, releases, updates and
//! dependency gates (see [`crate::workflow`] for the rules).

use super::{Control, ControlError};
pub use crate::records::Hold;
use crate::records::{JobEvent, JobRecord};
use crate::workflow::*;
use gangway_core::workflow::{format_utc, parse_array, parse_dependency, AfterKind, Dependency};
use gangway_core::{
    format_time_span, BeginAt, JobId, JobSpec, JobState, ReasonCode, SpecError, Time,
};
use gangway_sched::Rejection;
use gangway_store::Store;
use std::collections::HashMap;

impl<S: Store> Control<S> {
    /// Readies a submitted spec: its begin time resolved to epoch seconds,
    /// its dependencies' jobs checked to exist (422 naming the field).
    pub(crate) fn prepare_workflow(
        &self,
        spec: &mut JobSpec,
        now: Time,
    ) -> Result<(), ControlError> {
        if let Some(b) = &spec.begin {
            let at = b
                .resolve(now)
                .map_err(|e| spec_error(SpecError::BadBegin(e)))?;
            let max = crate::limits::MAX_DURATION_SECONDS;
            if at.saturating_sub(now) > max {
                return Err(spec_error(SpecError::BadBegin(format!(
                    "{} is more than {} days away",
                    format_utc(at),
                    max / 86_400
                ))));
            }
            spec.begin = Some(BeginAt::Seconds(at));
        }
        if let Some(d) = &spec.dependency {
            let deps = parse_dependency(d).map_err(|e| spec_error(SpecError::BadDependency(e)))?;
            for dep in deps {
                if let Dependency::After(_, ids) = dep {
                    if let Some(id) = ids.iter().find(|id| !self.jobs.contains_key(*id)) {
                        return Err(spec_error(SpecError::BadDependency(format!(
                            "job {id} does not exist"
                        ))));
                    }
                }
            }
        }
        if let Some(a) = &spec.array {
            parse_array(a).map_err(|e| spec_error(SpecError::BadArray(e)))?;
        }
        Ok(())
    }

    /// Puts a newly stored (or rebuilt) pending job where it belongs: into
    /// the scheduler, or among the gated jobs to be decided by
    /// [`Control::release_gated`].
    pub(crate) fn enter(&mut self, id: JobId) -> Result<(), ControlError> {
        let Some((rec, _)) = self.jobs.get(&id) else {
            return Err(ControlError::NoSuchJob(id));
        };
        if starts_gated(rec) {
            self.gates
                .waiting
                .insert(id, (ReasonCode::Dependency, "not yet decided".into()));
            return Ok(());
        }
        let (spec, at) = (rec.spec.clone(), rec.submitted_at);
        self.cluster.submit(id, spec, at)?;
        self.apply_avoid(id);
        Ok(())
    }

    /// Whether a pending job may enter the scheduler now (see the module doc).
    pub fn gate(&self, rec: &JobRecord, now: Time) -> Gate {
        self.gate_with(rec, now, &mut HashMap::new())
    }

    /// [`Control::gate`] with the tasks in the scheduler counted once per
    /// array (`slots`), so a pass over a large array stays linear.
    fn gate_with(&self, rec: &JobRecord, now: Time, slots: &mut HashMap<JobId, usize>) -> Gate {
        if let Some(h) = rec.held {
            let who = match h {
                Hold::User => "its owner (gangway release)",
                Hold::Admin => "an administrator",
            };
            return Gate::Wait(h.code(), format!("held by {who}"));
        }
        if let Some(BeginAt::Seconds(at)) = rec.spec.begin {
            if at > now {
                return Gate::Wait(
                    ReasonCode::BeginTime,
                    format!(
                        "begins at {} (in {})",
                        format_utc(at),
                        format_time_span(at - now)
                    ),
                );
            }
        }
        if let Some(d) = &rec.spec.dependency {
            let deps = match parse_dependency(d) {
                Ok(d) => d,
                Err(e) => return Gate::Never(format!("dependency: {e}")),
            };
            for dep in deps {
                match dep {
                    Dependency::After(kind, ids) => {
                        for id in ids {
                            if let Some(g) = self.after(kind, id) {
                                return g;
                            }
                        }
                    }
                    Dependency::Singleton => {
                        if let Some(other) = self.singleton_blocker(rec) {
                            return Gate::Wait(
                                ReasonCode::Dependency,
                                format!(
                                    "singleton: job {other} of {} named {:?} has not ended",
                                    rec.user, rec.spec.name
                                ),
                            );
                        }
                    }
                }
            }
        }
        if let Some(t) = &rec.array {
            if let Some(limit) = t.limit {
                let end = JobId(t.job.0.saturating_add(u64::from(t.count)));
                // Gated tasks (this one too) do not count: only those in the scheduler.
                let in_slot = *slots.entry(t.job).or_insert_with(|| {
                    self.jobs
                        .range(t.job..end)
                        .filter(|(id, (r, _))| {
                            **id != rec.id
                                && !r.state.is_terminal()
                                && !self.gates.waiting.contains_key(*id)
                        })
                        .count()
                });
                if in_slot >= limit as usize {
                    return Gate::Wait(
                        ReasonCode::JobArrayTaskLimit,
                        format!(
                            "array {} has {in_slot} tasks in the scheduler; its limit is %{limit}",
                            t.job
                        ),
                    );
                }
            }
        }
        Gate::Open
    }

    /// One `after*` term about job `id`: `None` when it is satisfied.
    fn after(&self, kind: AfterKind, id: JobId) -> Option<Gate> {
        let k = kind.as_str();
        let Some((target, _)) = self.jobs.get(&id) else {
            return Some(Gate::Never(format!(
                "job {id} no longer exists, so {k}:{id} can never be met"
            )));
        };
        // An array's id stands for all of its tasks, as in Slurm.
        let (s, what) = match &target.array {
            Some(t) if t.job == id => {
                let end = JobId(id.0.saturating_add(u64::from(t.count)));
                let states: Vec<JobState> = self
                    .jobs
                    .range(id..end)
                    .map(|(_, (r, _))| r.state)
                    .collect();
                let s = states
                    .iter()
                    .find(|s| !s.is_terminal())
                    .or_else(|| states.iter().find(|s| **s != JobState::Succeeded))
                    .copied()
                    .unwrap_or(JobState::Succeeded);
                (s, format!("array {id}"))
            }
            _ => (target.state, format!("job {id}")),
        };
        if !s.is_terminal() {
            return Some(Gate::Wait(
                ReasonCode::Dependency,
                format!(
                    "waits for {what} to end ({k}:{id}; it is {})",
                    state_name(s)
                ),
            ));
        }
        let ok = s == JobState::Succeeded;
        match kind {
            AfterKind::AfterAny => None,
            AfterKind::AfterOk if ok => None,
            AfterKind::AfterNotOk if !ok => None,
            _ => Some(Gate::Never(format!(
                "{what} ended {}, so {k}:{id} can never be met",
                state_name(s)
            ))),
        }
    }

    /// Another unfinished job of the same user and name that goes first:
    /// one in the scheduler, or a gated one submitted earlier.
    fn singleton_blocker(&self, rec: &JobRecord) -> Option<JobId> {
        self.jobs
            .values()
            .map(|(r, _)| r)
            .find(|r| {
                r.id != rec.id
                    && !r.state.is_terminal()
                    && r.user == rec.user
                    && r.spec.name == rec.spec.name
                    && (r.id < rec.id || !self.gates.waiting.contains_key(&r.id))
            })
            .map(|r| r.id)
    }

    /// Decides every gated job again, in id order: eligible ones enter the
    /// scheduler (keeping their place by submission time); with `may_write`,
    /// those whose dependency can never be met are cancelled with
    /// `DependencyNeverSatisfied` and an event naming the job and why.
    /// Returns whether anything changed.
    pub(crate) fn release_gated(
        &mut self,
        now: Time,
        may_write: bool,
    ) -> Result<bool, ControlError> {
        if self.gates.waiting.is_empty() {
            return Ok(false);
        }
        let ids: Vec<JobId> = self.gates.waiting.keys().copied().collect();
        let mut never = Vec::new();
        let mut changed = false;
        let mut slots = HashMap::new();
        for id in ids {
            let rec = match self.jobs.get(&id) {
                Some((r, _)) if r.state == JobState::Pending && r.placement.is_empty() => r,
                _ => {
                    self.gates.waiting.remove(&id);
                    continue;
                }
            };
            match self.gate_with(rec, now, &mut slots) {
                Gate::Open => {
                    if let Some(t) = &rec.array {
                        *slots.entry(t.job).or_insert(0) += 1;
                    }
                    let (spec, at) = (rec.spec.clone(), rec.submitted_at);
                    self.gates.waiting.remove(&id);
                    if let Err(e) = self.cluster.submit(id, spec, at) {
                        // Its queue is gone: recorded, never schedulable.
                        tracing::warn!("job {id} cannot enter the scheduler: {e}");
                    }
                    // Entered without a write of its record: ranked next cycle.
                    self.ranks.entered.push(id);
                    changed = true;
                }
                Gate::Wait(code, msg) => {
                    self.gates.waiting.insert(id, (code, msg));
                }
                Gate::Never(msg) => {
                    if may_write {
                        never.push((JobRecord::clone(rec), msg.clone()));
                    }
                    self.gates
                        .waiting
                        .insert(id, (ReasonCode::DependencyNeverSatisfied, msg));
                }
            }
        }
        if !never.is_empty() {
            let mut recs = Vec::with_capacity(never.len());
            for (mut rec, msg) in never {
                rec.state = JobState::Cancelled;
                rec.end_reason = Some(ReasonCode::DependencyNeverSatisfied);
                rec.events.push(JobEvent {
                    at: now,
                    kind: "cancelled".into(),
                    message: format!("DependencyNeverSatisfied: {msg}"),
                    count: 1,
                    last_at: None,
                });
                recs.push(rec);
            }
            let ids: Vec<JobId> = recs.iter().map(|r| r.id).collect();
            self.write_all(recs)?;
            for id in ids {
                self.gates.waiting.remove(&id);
                self.view.why.remove(&id);
            }
            changed = true;
        }
        Ok(changed)
    }

    /// A pending job's record, or why it cannot be `verb` (404, 409).
    fn pending_record(&self, id: JobId, verb: &'static str) -> Result<JobRecord, ControlError> {
        let (rec, _) = self.jobs.get(&id).ok_or(ControlError::NoSuchJob(id))?;
        if rec.state != JobState::Pending || !rec.placement.is_empty() {
            return Err(WorkflowError::NotPending(id, state_name(rec.state), verb).into());
        }
        Ok(JobRecord::clone(rec))
    }

    /// The pending jobs `id` names: every pending task when `id` is an
    /// array's id (with any pending), else `id` itself if it is pending (404, 409).
    /// With `scope` [`Scope::Task`], only `id` itself (an array's first task).
    fn targets(
        &self,
        id: JobId,
        verb: &'static str,
        scope: Scope,
    ) -> Result<Vec<JobId>, ControlError> {
        let (rec, _) = self.jobs.get(&id).ok_or(ControlError::NoSuchJob(id))?;
        if let Some(t) = rec
            .array
            .as_ref()
            .filter(|t| t.job == id && scope == Scope::Array)
        {
            let end = JobId(id.0.saturating_add(u64::from(t.count)));
            let pending: Vec<JobId> = self
                .jobs
                .range(id..end)
                .filter(|(_, (r, _))| r.state == JobState::Pending && r.placement.is_empty())
                .map(|(i, _)| *i)
                .collect();
            if !pending.is_empty() {
                return Ok(pending);
            }
        }
        self.pending_record(id, verb)?;
        Ok(vec![id])
    }

    /// Holds a pending job, or every pending task of an array by its id
    /// (Slurm's `scontrol hold`): out of the scheduler until released, in
    /// one write. An admin's hold replaces an owner's; an owner's hold does
    /// not weaken an admin's. Returns how many jobs it names.
    pub fn hold(
        &mut self,
        id: JobId,
        kind: Hold,
        by: &str,
        now: Time,
    ) -> Result<usize, ControlError> {
        self.hold_in(id, Scope::Array, kind, by, now)
    }

    /// [`Self::hold`] with `scope` saying whether an array's id names the
    /// array or only its first task (`5_0`).
    pub fn hold_in(
        &mut self,
        id: JobId,
        scope: Scope,
        kind: Hold,
        by: &str,
        now: Time,
    ) -> Result<usize, ControlError> {
        let ids = self.targets(id, "held", scope)?;
        let mut recs = Vec::new();
        for i in &ids {
            let Some((rec, _)) = self.jobs.get(i) else {
                continue;
            };
            if rec.held == Some(kind) || rec.held == Some(Hold::Admin) {
                continue;
            }
            let mut rec = JobRecord::clone(rec);
            rec.held = Some(kind);
            rec.events.push(JobEvent {
                at: now,
                kind: "held".into(),
                message: format!("held by {by} ({})", kind.code()),
                count: 1,
                last_at: None,
            });
            recs.push(rec);
        }
        let changed: Vec<JobId> = recs.iter().map(|r| r.id).collect();
        self.write_all(recs)?;
        for i in changed {
            let _ = self.cluster.cancel(i);
            self.view.why.remove(&i);
            self.gates
                .waiting
                .insert(i, (kind.code(), format!("held by {by}")));
        }
        Ok(ids.len())
    }

    /// Releases a held pending job, or every held pending task of an array
    /// by its id; an admin's hold only by an admin (403). Returns how many.
    pub fn release(
        &mut self,
        id: JobId,
        by_admin: bool,
        by: &str,
        now: Time,
    ) -> Result<usize, ControlError> {
        self.release_in(id, Scope::Array, by_admin, by, now)
    }

    /// [`Self::release`] with `scope` as in [`Self::hold_in`].
    pub fn release_in(
        &mut self,
        id: JobId,
        scope: Scope,
        by_admin: bool,
        by: &str,
        now: Time,
    ) -> Result<usize, ControlError> {
        let ids = self.targets(id, "released", scope)?;
        let held: Vec<JobRecord> = ids
            .iter()
            .filter_map(|i| self.jobs.get(i).map(|(r, _)| r))
            .filter(|r| r.held.is_some())
            .map(|r| JobRecord::clone(r))
            .collect();
        if held.is_empty() {
            return Err(WorkflowError::NotHeld(id).into());
        }
        if !by_admin && held.iter().any(|r| r.held == Some(Hold::Admin)) {
            return Err(WorkflowError::Forbidden(format!(
                "job {id} is held by an administrator (JobHeldAdmin); only an administrator may release it"
            ))
            .into());
        }
        let n = held.len();
        let recs = held
            .into_iter()
            .map(|mut rec| {
                rec.held = None;
                rec.events.push(JobEvent {
                    at: now,
                    kind: "released".into(),
                    message: format!("released by {by}"),
                    count: 1,
                    last_at: None,
                });
                rec
            })
            .collect();
        self.write_all(recs)?;
        self.release_gated(now, true)?;
        Ok(n)
    }

    /// Replaces a pending job's spec (see [`updated_spec`] for who may change
    /// what): the queue's time limits apply and the cluster must be able to
    /// run it (422); it keeps its place by submission time.
    pub fn update(
        &mut self,
        id: JobId,
        mut spec: JobSpec,
        by: &str,
        what: &str,
        now: Time,
    ) -> Result<(), ControlError> {
        let mut rec = self.pending_record(id, "updated")?;
        self.apply_queue_time_limit(&mut spec)?;
        self.cluster.validate(&spec)?;
        rec.spec = spec.clone();
        rec.events.push(JobEvent {
            at: now,
            kind: "updated".into(),
            message: format!("updated by {by}: {what}"),
            count: 1,
            last_at: None,
        });
        let at = rec.submitted_at;
        self.write(rec)?;
        self.view.why.remove(&id);
        if !self.gates.waiting.contains_key(&id) {
            let _ = self.cluster.cancel(id);
            self.cluster.submit(id, spec, at)?;
        }
        Ok(())
    }

    /// Cancels a job, or every unfinished task when `id` is an array's id
    /// (the id of its first task). Returns the jobs cancelled.
    pub fn cancel_job_or_array(
        &mut self,
        id: JobId,
        by: &str,
        now: Time,
    ) -> Result<Vec<JobId>, ControlError> {
        self.cancel_in(id, Scope::Array, by, now)
    }

    /// [`Self::cancel_job_or_array`] with `scope` as in [`Self::hold_in`].
    pub fn cancel_in(
        &mut self,
        id: JobId,
        scope: Scope,
        by: &str,
        now: Time,
    ) -> Result<Vec<JobId>, ControlError> {
        let (rec, _) = self.jobs.get(&id).ok_or(ControlError::NoSuchJob(id))?;
        let tasks: Vec<JobId> = match &rec.array {
            Some(t) if t.job == id && scope == Scope::Array => {
                let end = JobId(id.0.saturating_add(u64::from(t.count)));
                self.jobs
                    .range(id..end)
                    .filter(|(_, (r, _))| !r.state.is_terminal())
                    .map(|(i, _)| *i)
                    .collect()
            }
            _ => vec![id],
        };
        if tasks.is_empty() {
            // Every task has ended: say so about the array's own id.
            return self.cancel(id, by, now).map(|_| Vec::new());
        }
        if tasks.len() == 1 {
            self.cancel(tasks[0], by, now)?;
            return Ok(tasks);
        }
        // Tasks on nodes are stopped one by one (signal, grace); the others,
        // possibly thousands, end in one write.
        let mut waiting = Vec::new();
        let mut placed = Vec::new();
        for t in &tasks {
            let Some((rec, _)) = self.jobs.get(t) else {
                continue;
            };
            if rec.placement.is_empty() {
                let mut rec = JobRecord::clone(rec);
                rec.state = JobState::Cancelled;
                rec.events.push(JobEvent {
                    at: now,
                    kind: "cancelled".into(),
                    message: format!("cancelled by {by} (array {id})"),
                    count: 1,
                    last_at: None,
                });
                waiting.push(rec);
            } else {
                placed.push(*t);
            }
        }
        let ended: Vec<JobId> = waiting.iter().map(|r| r.id).collect();
        self.write_all(waiting)?;
        for t in ended {
            let _ = self.cluster.cancel(t);
            self.view.why.remove(&t);
            self.gates.waiting.remove(&t);
        }
        for t in placed {
            self.cancel(t, by, now)?;
        }
        Ok(tasks)
    }

    /// The reason code and sentence of a gated job.
    pub fn gate_reason(&self, id: JobId) -> Option<(ReasonCode, &str)> {
        self.gates.waiting.get(&id).map(|(c, m)| (*c, m.as_str()))
    }
}

fn spec_error(e: SpecError) -> ControlError {
    ControlError::Rejected(Rejection::Spec(e))
}

/// Whether a new record starts outside the scheduler (held, deferred,
/// dependent, or a task of a concurrency-limited array).
fn starts_gated(rec: &JobRecord) -> bool {
    rec.held.is_some()
        || rec.spec.begin.is_some()
        || rec.spec.dependency.is_some()
        || rec.array.as_ref().is_some_and(|a| a.limit.is_some())
}
