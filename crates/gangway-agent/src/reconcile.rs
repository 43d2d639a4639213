//! The agent's reconciliation, pure: from the desired assignments and what
//! runs locally, what to do — kubelet-style, idempotent and re-runnable.

use gangway_core::agent::{Assignment, TaskState};
use gangway_core::JobId;
use std::collections::BTreeMap;

/// A job attempt on this node.
pub type TaskKey = (JobId, u32);

/// What the agent knows of one local task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskView {
    /// Exit code per rank, `None` while it runs.
    pub exits: Vec<Option<i32>>,
    /// The checkpoint signal was sent.
    pub stop_sent: bool,
}

impl TaskView {
    /// Whether any rank still runs.
    pub fn alive(&self) -> bool {
        self.exits.iter().any(Option::is_none)
    }

    /// What to report: a non-zero exit of any rank at once (the gang must
    /// stop), 0 once every rank exited 0, else running.
    pub fn state(&self) -> TaskState {
        if let Some(code) = self.exits.iter().flatten().find(|c| **c != 0) {
            return TaskState::Exited { exit_code: *code };
        }
        if self.alive() {
            TaskState::Running
        } else {
            TaskState::Exited { exit_code: 0 }
        }
    }
}

/// One step of reconciliation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Kill every rank of a task that must not run (another attempt, a
    /// cancelled or failed gang, a job moved elsewhere).
    Kill(TaskKey),
    /// Forget a finished task the server no longer lists.
    Forget(TaskKey),
    /// Send the checkpoint signal and start the grace period.
    Checkpoint(TaskKey),
    /// Start the ranks of an assignment (or, when it is already being
    /// stopped, record it as stopped without starting it).
    Start(Box<Assignment>),
}

/// The actions that bring the node to `desired`: kills first (their GPUs are
/// about to be reused), then checkpoints, then starts.
pub fn plan(desired: &[Assignment], local: &BTreeMap<TaskKey, TaskView>) -> Vec<Action> {
    let wanted: BTreeMap<TaskKey, &Assignment> =
        desired.iter().map(|a| ((a.job, a.attempt), a)).collect();
    let mut out = Vec::new();
    for (k, t) in local {
        if !wanted.contains_key(k) {
            out.push(if t.alive() {
                Action::Kill(*k)
            } else {
                Action::Forget(*k)
            });
        }
    }
    for (k, a) in &wanted {
        match local.get(k) {
            Some(t) if a.stop && t.alive() && !t.stop_sent => out.push(Action::Checkpoint(*k)),
            Some(_) => {}
            None => out.push(Action::Start(Box::new((*a).clone()))),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::agent::RankAssignment;
    use gangway_core::RunSpec;

    fn assignment(job: u64, attempt: u32, stop: bool) -> Assignment {
        Assignment {
            job: JobId(job),
            attempt,
            name: "j".into(),
            user: "u".into(),
            run: RunSpec::default(),
            ranks: vec![RankAssignment {
                rank: 0,
                local_rank: 0,
                gpus: vec![0],
            }],
            world_size: 1,
            node_rank: 0,
            nnodes: 1,
            master_addr: "n".into(),
            master_port: 20_000,
            cpu_millis: 0,
            memory_mib: 0,
            checkpoint_signal: 15,
            grace_seconds: 5,
            stop,
            rules: Default::default(),
            stop_now: false,
            checkpoint_root: None,
            checkpoint_subdir: "u/job-1".into(),
            resume_from: None,
            max_restarts: 3,
        }
    }

    fn view(exits: Vec<Option<i32>>, stop_sent: bool) -> TaskView {
        TaskView { exits, stop_sent }
    }

    #[test]
    fn a_new_attempt_kills_the_old_one_before_starting() {
        let mut local = BTreeMap::new();
        local.insert((JobId(1), 0), view(vec![None], false));
        let acts = plan(&[assignment(1, 1, false)], &local);
        assert_eq!(acts.len(), 2);
        assert_eq!(acts[0], Action::Kill((JobId(1), 0)));
        assert!(matches!(&acts[1], Action::Start(a) if a.attempt == 1));
    }

    #[test]
    fn preemption_signals_once_and_finished_tasks_are_forgotten() {
        let mut local = BTreeMap::new();
        local.insert((JobId(1), 0), view(vec![None, None], false));
        local.insert((JobId(2), 0), view(vec![Some(0)], false));
        let acts = plan(&[assignment(1, 0, true)], &local);
        assert_eq!(
            acts,
            vec![
                Action::Forget((JobId(2), 0)),
                Action::Checkpoint((JobId(1), 0))
            ]
        );
        // After acting on it, re-running the plan changes nothing: signalled once.
        local.insert((JobId(1), 0), view(vec![None, None], true));
        local.remove(&(JobId(2), 0));
        assert!(plan(&[assignment(1, 0, true)], &local).is_empty());
        assert!(plan(&[assignment(1, 0, true)], &local).is_empty());
    }

    #[test]
    fn reports_fail_fast_and_succeed_only_when_all_ranks_exit_zero() {
        assert_eq!(view(vec![None, Some(0)], false).state(), TaskState::Running);
        assert_eq!(
            view(vec![None, Some(3)], false).state(),
            TaskState::Exited { exit_code: 3 }
        );
        assert_eq!(
            view(vec![Some(0), Some(0)], false).state(),
            TaskState::Exited { exit_code: 0 }
        );
        assert_eq!(
            view(vec![], false).state(),
            TaskState::Exited { exit_code: 0 }
        );
    }
}
