//! Slurm's everyday workflow on the control plane: hold and release, update
//! of pending jobs, deferred start (`begin`), dependencies and job arrays.
//!
//! One rule decides whether a pending job is *eligible*, i.e. in the
//! scheduler's [`ClusterState`](gangway_sched::ClusterState): not held, its
//! begin time passed, its dependencies satisfied and a slot of its array
//! free ([`Control::gate`]). Jobs that are not stay `Pending` in the store and
//! wait in [`Gates`] with their reason code; every cycle re-decides them in id
//! order ([`Control::release_gated`]), and `Control::open` rebuilds the same
//! from the records alone.

use crate::authz::Principal;
use crate::config::ServerConfig;
pub use crate::control_error::{state_name, state_phrase, WorkflowError};
pub use crate::records::Hold;
use crate::records::JobRecord;
use gangway_core::workflow::parse_array;
use gangway_core::{
    format_time_span, ArrayTask, JobId, JobSpec, PriorityClass, ReasonCode, Time, TimeSpan,
};
use serde::{Deserialize, Serialize};

/// What an array's id names in hold, release and cancel: the whole array
/// (Slurm's `scancel 5`) or only its first task (`scancel 5_0`). Other ids
/// name one job either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Scope {
    /// Every task of the array.
    #[default]
    Array,
    /// The one task with this id.
    Task,
}

/// Pending jobs kept out of the scheduler's state, each with its reason code
/// and sentence (derived from the records; never stored).
#[derive(Default, Debug)]
pub struct Gates {
    /// Why each waits.
    /// (A persistent map: the read view shares it.)
    pub waiting: crate::view::GateMap,
}

/// What the gate says of a pending job.
#[derive(Debug, PartialEq, Eq)]
pub enum Gate {
    /// Eligible: it goes into the scheduler.
    Open,
    /// It waits, with this code and sentence.
    Wait(ReasonCode, String),
    /// A dependency can never be met: it is cancelled (`DependencyNeverSatisfied`).
    Never(String),
}

/// Tasks an array spec expands to (1 for a plain job), for the pending-jobs limit.
pub fn task_count(spec: &JobSpec) -> u64 {
    spec.array
        .as_deref()
        .and_then(|a| parse_array(a).ok())
        .map_or(1, |a| a.indexes.len() as u64)
}

/// The records of one submission: one job, or one per array index with the
/// consecutive ids `first ..`, each knowing its array and index.
pub fn expand(first: JobId, user: &str, spec: &JobSpec, now: Time) -> Vec<JobRecord> {
    let held = spec.hold.then_some(Hold::User);
    let Some(array) = spec.array.as_deref().and_then(|a| parse_array(a).ok()) else {
        let mut rec = JobRecord::submitted(first, user, spec.clone(), now);
        rec.held = held;
        return vec![rec];
    };
    let count = u32::try_from(array.indexes.len()).unwrap_or(u32::MAX);
    array
        .indexes
        .iter()
        .enumerate()
        .map(|(k, &index)| {
            let id = JobId(first.0.saturating_add(k as u64));
            let mut rec = JobRecord::submitted(id, user, spec.clone(), now);
            if let Some(e) = rec.events.first_mut() {
                e.message = format!("{}, task {index} of array {first}", e.message);
            }
            rec.held = held;
            rec.array = Some(ArrayTask {
                job: first,
                index,
                count,
                limit: array.limit,
            });
            rec
        })
        .collect()
}

/// Fields `gangway update` may change on a pending job.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JobUpdate {
    /// New priority class.
    #[serde(default)]
    pub priority: Option<PriorityClass>,
    /// New time limit.
    #[serde(default)]
    pub time_limit: Option<TimeSpan>,
    /// New queue.
    #[serde(default)]
    pub queue: Option<String>,
    /// New name.
    #[serde(default)]
    pub name: Option<String>,
}

/// The spec `p` turns `rec`'s into with `u`, and a description of the change,
/// or why not. Plain users (owners) keep to the queues they may submit to,
/// the priority classes the target queue allows, its node policy, and may
/// only lower a time limit; admins may change anything the cluster can run.
pub fn updated_spec(
    cfg: &ServerConfig,
    p: &Principal,
    rec: &JobRecord,
    u: &JobUpdate,
) -> Result<(JobSpec, String), WorkflowError> {
    let mut spec = rec.spec.clone();
    let mut what = Vec::new();
    if let Some(pr) = u.priority {
        spec.priority = pr;
        what.push(format!("priority {pr}"));
    }
    if let Some(t) = &u.time_limit {
        let secs = t
            .seconds()
            .map_err(|e| WorkflowError::Field(format!("time_limit: {e}")))?;
        if let Principal::User { .. } = p {
            if let Some(now) = rec.spec.time_limit_seconds() {
                if secs > now {
                    return Err(WorkflowError::Forbidden(format!(
                            "time_limit: users may only lower a time limit ({} now, {} asked); ask an admin",
                            format_time_span(now),
                            format_time_span(secs)
                        )));
                }
            }
        }
        spec.time_limit = Some(TimeSpan::Seconds(secs));
        what.push(format!("time limit {}", format_time_span(secs)));
    }
    if let Some(q) = &u.queue {
        if let Principal::User { name, queues } = p {
            if !queues.contains(q) {
                return Err(WorkflowError::Forbidden(format!(
                    "queue: user {name} may not submit to queue {}",
                    q.chars().take(253).collect::<String>()
                )));
            }
        }
        spec.queue = q.clone();
        what.push(format!("queue {q}"));
    }
    if let Some(n) = &u.name {
        spec.name = n.clone();
        what.push(format!("name {n:?}"));
    }
    if what.is_empty() {
        return Err(WorkflowError::Malformed(
            "update: give at least one of priority, time_limit, queue, name".into(),
        ));
    }
    crate::limits::check_submission(cfg, p, &spec)?;
    spec.check_printable()
        .and_then(|_| spec.validate())
        .map_err(|e| WorkflowError::Field(e.to_string()))?;
    crate::admission::admit(cfg, &spec).map_err(|e| WorkflowError::Field(e.to_string()))?;
    Ok((spec, what.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{Control, ControlError};
    use gangway_core::BeginAt;
    use gangway_core::JobState;
    use gangway_core::{NodeSpec, QueueSpec};
    use gangway_store::RedbStore;

    fn control() -> (tempfile::TempDir, Control<RedbStore>) {
        control_at(0)
    }

    /// A control state with one 4-GPU node registered at `t`.
    fn control_at(t: Time) -> (tempfile::TempDir, Control<RedbStore>) {
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let mut c = Control::open(store, &[QueueSpec::unlimited("q", None)]).expect("control");
        c.register_node(
            NodeSpec::uniform("n", "leaf0", "spine0", 4, "H100", 80),
            &crate::nodes::Registrant::Join,
            true,
            "join",
            t,
        )
        .expect("node");
        (dir, c)
    }

    fn reopen(dir: &tempfile::TempDir) -> Control<RedbStore> {
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        Control::open(store, &[QueueSpec::unlimited("q", None)]).expect("reopen")
    }

    fn in_scheduler(c: &Control<RedbStore>, id: JobId) -> bool {
        c.cluster.job(id).is_some()
    }

    #[test]
    fn gated_jobs_stay_gated_across_a_restart_and_enter_when_free() {
        // Real times: `Control::open` decides gated jobs at the wall clock.
        let t0 = crate::clock::now();
        let (dir, mut c) = control_at(t0);
        let mut held = JobSpec::new("h", "q", 1, 1);
        held.hold = true;
        let held = c.submit("alice", held, t0).expect("held");
        let mut later = JobSpec::new("b", "q", 1, 1);
        later.begin = Some(BeginAt::Text("+1h".into()));
        let later = c.submit("alice", later, t0).expect("begin");
        let first = c
            .submit("alice", JobSpec::new("a", "q", 1, 1), t0)
            .expect("a");
        let mut dep = JobSpec::new("d", "q", 1, 1);
        dep.dependency = Some(format!("afterok:{first}"));
        let dep = c.submit("alice", dep, t0).expect("dep");
        let mut arr = JobSpec::new("arr", "q", 1, 1);
        arr.array = Some("0-5%2".into());
        let arr = c.submit("alice", arr, t0).expect("array");
        let tasks: Vec<JobId> = (0..6).map(|k| JobId(arr.0 + k)).collect();
        assert_eq!(c.jobs[&tasks[5]].0.array.as_ref().map(|a| a.index), Some(5));
        let check = |c: &Control<RedbStore>| {
            assert_eq!(
                c.gate_reason(held).map(|r| r.0),
                Some(ReasonCode::JobHeldUser)
            );
            assert_eq!(
                c.gate_reason(later).map(|r| r.0),
                Some(ReasonCode::BeginTime)
            );
            assert_eq!(
                c.gate_reason(dep).map(|r| r.0),
                Some(ReasonCode::Dependency)
            );
            assert!(in_scheduler(c, first));
            assert_eq!(tasks.iter().filter(|t| in_scheduler(c, **t)).count(), 2);
            assert_eq!(
                c.gate_reason(tasks[5]).map(|r| r.0),
                Some(ReasonCode::JobArrayTaskLimit)
            );
        };
        check(&c);
        c.cycle(t0 + 1).expect("cycle");
        assert_eq!(c.jobs[&first].0.state, JobState::Scheduled);
        drop(c);
        let mut c = reopen(&dir);
        check(&c);
        // The dependency succeeds: the dependant enters at the next cycle.
        c.report("n", first, None, crate::control::Report::Exited(0), t0 + 2)
            .expect("exited");
        assert_eq!(c.jobs[&first].0.state, JobState::Succeeded);
        c.cycle(t0 + 3).expect("cycle");
        assert!(c.gate_reason(dep).is_none());
        assert!(c.gate_reason(later).is_some());
        // The begin time passes.
        c.cycle(t0 + 3600).expect("cycle");
        assert!(c.gate_reason(later).is_none());
        assert!(c.gate_reason(held).is_some(), "held until released");
    }

    #[test]
    fn a_dependency_that_can_never_be_met_cancels_the_dependant() {
        let (_d, mut c) = control();
        let a = c
            .submit("alice", JobSpec::new("a", "q", 1, 1), 1)
            .expect("a");
        let mut ok = JobSpec::new("ok", "q", 1, 1);
        ok.dependency = Some(format!("afterok:{a}"));
        let ok = c.submit("alice", ok, 1).expect("ok");
        let mut notok = JobSpec::new("notok", "q", 1, 1);
        notok.dependency = Some(format!("afternotok:{a}"));
        let notok = c.submit("alice", notok, 1).expect("notok");
        c.cancel(a, "alice", 2).expect("cancel");
        c.cycle(3).expect("cycle");
        let rec = &c.jobs[&ok].0;
        assert_eq!(rec.state, JobState::Cancelled);
        assert_eq!(rec.end_reason, Some(ReasonCode::DependencyNeverSatisfied));
        let last = rec.events.last().expect("event");
        assert!(
            last.message.contains(&format!("job {a} ended cancelled")),
            "{}",
            last.message
        );
        assert_eq!(
            c.jobs[&notok].0.state,
            JobState::Scheduled,
            "afternotok on a cancelled job is met"
        );
        let mut bad = JobSpec::new("x", "q", 1, 1);
        bad.dependency = Some("afterok:999".into());
        let e = c.submit("alice", bad, 4).expect_err("unknown id");
        assert!(e.to_string().starts_with("dependency:"), "{e}");
    }

    #[test]
    fn a_dependency_on_an_array_id_waits_for_every_task() {
        let (_d, mut c) = control();
        let mut arr = JobSpec::new("arr", "q", 1, 1);
        arr.array = Some("0-2".into());
        let arr = c.submit("alice", arr, 1).expect("array");
        let mut after = JobSpec::new("after", "q", 1, 1);
        after.dependency = Some(format!("afterok:{arr}"));
        let after = c.submit("alice", after, 1).expect("after");
        c.cycle(2).expect("cycle");
        for k in 0..2 {
            c.report(
                "n",
                JobId(arr.0 + k),
                None,
                crate::control::Report::Exited(0),
                3,
            )
            .expect("exit");
        }
        c.cycle(4).expect("cycle");
        let (code, msg) = c.gate_reason(after).expect("still waits for task 2");
        assert_eq!(code, ReasonCode::Dependency);
        assert!(msg.contains(&format!("array {arr}")), "{msg}");
        c.report(
            "n",
            JobId(arr.0 + 2),
            None,
            crate::control::Report::Exited(0),
            5,
        )
        .expect("exit");
        c.cycle(6).expect("cycle");
        assert!(c.gate_reason(after).is_none());
        assert_eq!(c.jobs[&after].0.state, JobState::Scheduled);
    }

    #[test]
    fn an_arrays_id_holds_and_releases_every_pending_task() {
        let (_d, mut c) = control();
        let mut arr = JobSpec::new("arr", "q", 1, 4);
        arr.array = Some("0-2".into());
        let arr = c.submit("alice", arr, 1).expect("array");
        c.cycle(2).expect("cycle");
        assert_eq!(c.jobs[&arr].0.state, JobState::Scheduled, "one fits");
        assert_eq!(c.hold(arr, Hold::User, "alice", 3).expect("hold"), 2);
        for k in 1..3 {
            assert_eq!(
                c.gate_reason(JobId(arr.0 + k)).map(|r| r.0),
                Some(ReasonCode::JobHeldUser)
            );
        }
        assert_eq!(c.release(arr, false, "alice", 4).expect("release"), 2);
        assert!(in_scheduler(&c, JobId(arr.0 + 2)));
        let e = c.release(arr, false, "alice", 5).expect_err("none held");
        assert!(matches!(
            e,
            ControlError::Workflow(WorkflowError::NotHeld(_))
        ));
    }

    #[test]
    fn an_arrays_id_in_task_scope_names_its_first_task_only() {
        let (_d, mut c) = control();
        let mut arr = JobSpec::new("arr", "q", 1, 4);
        arr.array = Some("0-2".into());
        let arr = c.submit("alice", arr, 1).expect("array");
        // Nothing placed yet: every task pending.
        assert_eq!(
            c.hold_in(arr, Scope::Task, Hold::User, "alice", 2)
                .expect("hold 0"),
            1
        );
        assert_eq!(c.jobs[&arr].0.held, Some(Hold::User));
        assert_eq!(c.jobs[&JobId(arr.0 + 1)].0.held, None);
        assert_eq!(
            c.release_in(arr, Scope::Task, false, "alice", 3)
                .expect("release 0"),
            1
        );
        let gone = c.cancel_in(arr, Scope::Task, "alice", 4).expect("cancel 0");
        assert_eq!(gone, vec![arr]);
        assert_eq!(c.jobs[&arr].0.state, JobState::Cancelled);
        for k in 1..3 {
            assert_ne!(c.jobs[&JobId(arr.0 + k)].0.state, JobState::Cancelled);
        }
        // The array's scope still reaches every task left.
        let gone = c
            .cancel_in(arr, Scope::Array, "alice", 5)
            .expect("cancel all");
        assert_eq!(gone, vec![JobId(arr.0 + 1), JobId(arr.0 + 2)]);
    }

    #[test]
    fn the_largest_array_is_one_commit_and_keeps_its_limit() {
        let (_d, mut c) = control();
        let mut arr = JobSpec::new("big", "q", 1, 1);
        arr.array = Some("0-9999%10".into());
        let arr = c.submit("alice", arr, 1).expect("array");
        assert_eq!(c.jobs.len(), 10_000);
        let t = std::time::Instant::now();
        c.cycle(2).expect("cycle");
        c.cycle(3).expect("cycle");
        eprintln!("two cycles over 10,000 gated tasks: {:?}", t.elapsed());
        let live = (0..10_000)
            .filter(|k| c.gate_reason(JobId(arr.0 + k)).is_none())
            .count();
        assert_eq!(live, 10);
        assert_eq!(
            c.cancel_job_or_array(arr, "alice", 4)
                .expect("cancel")
                .len(),
            10_000
        );
    }

    #[test]
    fn an_update_keeps_to_the_queues_maximum_time_limit() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let mut q = QueueSpec::unlimited("q", None);
        q.time_limit.max = Some(TimeSpan::Text("2h".into()));
        let mut c = Control::open(store, &[q]).expect("control");
        c.register_node(
            NodeSpec::uniform("n", "leaf0", "spine0", 4, "H100", 80),
            &crate::nodes::Registrant::Join,
            true,
            "join",
            0,
        )
        .expect("node");
        let mut spec = JobSpec::new("j", "q", 1, 1);
        spec.hold = true;
        let id = c.submit("alice", spec, 1).expect("submit");
        let mut longer = c.jobs[&id].0.spec.clone();
        longer.time_limit = Some(TimeSpan::Text("3h".into()));
        let e = c.update(id, longer, "admin", "time limit 3:00:00", 2);
        let e = e.expect_err("past the queue's maximum");
        assert!(e.to_string().starts_with("time_limit:"), "{e}");
        let mut shorter = c.jobs[&id].0.spec.clone();
        shorter.time_limit = Some(TimeSpan::Text("90m".into()));
        c.update(id, shorter, "admin", "time limit 1:30:00", 3)
            .expect("within it");
        assert_eq!(c.jobs[&id].0.spec.time_limit_seconds(), Some(5400));
        assert_eq!(
            c.gate_reason(id).map(|r| r.0),
            Some(ReasonCode::JobHeldUser)
        );
    }

    #[test]
    fn singleton_lets_one_job_per_user_and_name_in_at_a_time() {
        let (_d, mut c) = control();
        let mut s = JobSpec::new("nightly", "q", 1, 1);
        s.dependency = Some("singleton".into());
        let a = c.submit("alice", s.clone(), 1).expect("a");
        let b = c.submit("alice", s.clone(), 1).expect("b");
        let other = c.submit("bob", s, 1).expect("bob's");
        assert!(in_scheduler(&c, a));
        assert_eq!(c.gate_reason(b).map(|r| r.0), Some(ReasonCode::Dependency));
        assert!(in_scheduler(&c, other), "another user's job of that name");
        c.cancel(a, "alice", 2).expect("cancel");
        c.cycle(3).expect("cycle");
        assert!(c.gate_reason(b).is_none());
    }

    #[test]
    fn hold_release_and_update_only_pending_jobs() {
        let (_d, mut c) = control();
        let run = c
            .submit("alice", JobSpec::new("r", "q", 1, 4), 1)
            .expect("r");
        let wait = c
            .submit("alice", JobSpec::new("w", "q", 1, 4), 1)
            .expect("w");
        c.cycle(2).expect("cycle");
        assert_eq!(c.jobs[&run].0.state, JobState::Scheduled);
        let e = c.hold(run, Hold::User, "alice", 3).expect_err("scheduled");
        assert!(e.to_string().contains("is scheduled; only pending"), "{e}");
        c.hold(wait, Hold::Admin, "admin", 3).expect("hold");
        assert!(!in_scheduler(&c, wait));
        let e = c.release(wait, false, "alice", 4).expect_err("admin hold");
        assert!(matches!(
            e,
            ControlError::Workflow(WorkflowError::Forbidden(_))
        ));
        c.release(wait, true, "admin", 4).expect("release");
        assert!(in_scheduler(&c, wait));
        let e = c.release(wait, true, "admin", 4).expect_err("not held");
        assert!(matches!(
            e,
            ControlError::Workflow(WorkflowError::NotHeld(_))
        ));
        let mut spec = c.jobs[&wait].0.spec.clone();
        spec.name = "renamed".into();
        c.update(wait, spec, "alice", "name", 5).expect("update");
        assert_eq!(c.jobs[&wait].0.spec.name, "renamed");
        assert!(in_scheduler(&c, wait));
    }
}
