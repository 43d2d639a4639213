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
    /// Per rank: its exit code once no process of it is left, `None` while
    /// any runs (its main process may have exited already).
    pub exits: Vec<Option<i32>>,
    /// The first non-zero exit code of a rank's main process, even while
    /// other processes of the rank or the task still run.
    pub failed: Option<i32>,
    /// The checkpoint signal was sent.
    pub stop_sent: bool,
}

impl TaskView {
    /// Whether any process of any rank is left.
    pub fn alive(&self) -> bool {
        self.exits.iter().any(Option::is_none)
    }

    /// What to report. `Exited` only once no process of the task is left
    /// (its GPUs are free then), with the first non-zero code or 0; before
    /// that `Failing` when a rank's main process exited non-zero (the gang
    /// must stop), else `Running`. A rank that ends early never makes the
    /// task look stopped while others still save.
    pub fn state(&self) -> TaskState {
        if self.alive() {
            return match self.failed {
                Some(exit_code) => TaskState::Failing { exit_code },
                None => TaskState::Running,
            };
        }
        let code = self
            .exits
            .iter()
            .flatten()
            .copied()
            .find(|c| *c != 0)
            .or(self.failed)
            .unwrap_or(0);
        TaskState::Exited { exit_code: code }
    }
}

/// One step of reconciliation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Kill every process of a task that must not run at all (another
    /// attempt, a job the server ended or moved elsewhere).
    Kill(TaskKey),
    /// Forget a finished task the server no longer lists.
    Forget(TaskKey),
    /// Send the checkpoint signal to every process of every rank and start
    /// the gang's grace period (preemption, cancel, a failed rank elsewhere).
    Checkpoint {
        /// The task.
        key: TaskKey,
        /// Signal (POSIX number).
        signal: i32,
        /// Seconds until the rest is killed.
        grace_seconds: u64,
    },
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
            Some(t) if a.stop && t.alive() && !t.stop_sent => out.push(Action::Checkpoint {
                key: *k,
                signal: a.checkpoint_signal,
                grace_seconds: a.grace_seconds,
            }),
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
            array: None,
            restart_count: None,
            rendezvous_ports: None,
            nodes: Vec::new(),
        }
    }

    fn view(exits: Vec<Option<i32>>, stop_sent: bool) -> TaskView {
        TaskView {
            exits,
            failed: None,
            stop_sent,
        }
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
                Action::Checkpoint {
                    key: (JobId(1), 0),
                    signal: 15,
                    grace_seconds: 5
                }
            ]
        );
        // After acting on it, re-running the plan changes nothing: signalled once.
        local.insert((JobId(1), 0), view(vec![None, None], true));
        local.remove(&(JobId(2), 0));
        assert!(plan(&[assignment(1, 0, true)], &local).is_empty());
        assert!(plan(&[assignment(1, 0, true)], &local).is_empty());
    }

    #[test]
    fn a_task_is_exited_only_when_no_process_is_left() {
        assert_eq!(view(vec![None, Some(0)], false).state(), TaskState::Running);
        // Rank 1's main process failed; rank 0 still runs: failing, not exited.
        let mut v = view(vec![None, Some(3)], false);
        v.failed = Some(3);
        assert_eq!(v.state(), TaskState::Failing { exit_code: 3 });
        // Main process exited non-zero, but its children live on: failing.
        let mut v = view(vec![None], false);
        v.failed = Some(1);
        assert_eq!(v.state(), TaskState::Failing { exit_code: 1 });
        // During a stop, a rank dying at once on the signal does not end the task.
        let mut v = view(vec![None, Some(143)], true);
        v.failed = Some(143);
        assert_eq!(v.state(), TaskState::Failing { exit_code: 143 });
        assert_eq!(
            view(vec![Some(0), Some(3)], false).state(),
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
