//! How a job's attempt ends: the pure rules that turn an ending (its ranks'
//! exits, a stop, a lost node) into the job's next state: requeued, restarting
//! after its backoff, failed for good (out of restarts, or the same start
//! failure twice) or finished. No store and no scheduler: the coordinator
//! ([`crate::control::Control`]) writes the record and moves the job in the
//! scheduler's state as [`AfterEnd`] says.

use crate::records::{JobEvent, JobRecord, Stopping};
use gangway_core::{JobState, Time};

/// How a job's attempt ends.
pub(crate) enum Ending {
    /// Preempted and stopped: back in line, resumes from its checkpoint.
    Requeued(String),
    /// A rank or node failed: restart per the policy, or fail.
    Failed(String),
    /// Failed with no restart, whatever the policy (the same start failure twice).
    FailedForGood(String),
    /// Every rank exited 0.
    Succeeded(String),
    /// Stopped at its time limit.
    TimedOut(String),
    /// Cancelled, and none of its processes is left.
    Cancelled(String),
}

impl Ending {
    /// How a live attempt ends when the server ends it without its ranks'
    /// word (its node gone, its grace run out), `msg` saying why: as its stop
    /// asked (cancelled; restarted or failed), requeued when it was being
    /// preempted, failed otherwise.
    pub(crate) fn forced(rec: &JobRecord, msg: String) -> Ending {
        match (&rec.stopping, rec.state) {
            (Some(Stopping::Cancelled { by }), _) => {
                Ending::Cancelled(format!("cancelled by {by}; {msg}"))
            }
            (Some(Stopping::Failed { message }), _) => Ending::Failed(format!("{message}; {msg}")),
            (None, JobState::Preempting) => Ending::Requeued(msg),
            (None, _) => Ending::Failed(msg),
        }
    }
}

/// What happens in the scheduler's state after an attempt ends.
#[derive(Clone, Copy)]
pub(crate) enum AfterEnd {
    /// Back in line, keeping its place.
    Requeue,
    /// Out of line until its backoff passes.
    Restart,
    /// Gone for good.
    Finish,
}

/// The record of a job whose attempt ends: requeued (preempted), restarting
/// after a backoff or failed for good (a rank or node failed), or succeeded.
pub(crate) fn ended(mut rec: JobRecord, ending: Ending, now: Time) -> (JobRecord, AfterEnd) {
    let start_failure = start_failure(&rec, &ending, now);
    let ending = match (ending, &start_failure) {
        (Ending::Failed(msg), Some(sig))
            if rec.start_failure.as_ref() == Some(sig)
                && !rec.spec.restart.retry_start_failures =>
        {
            Ending::FailedForGood(format!(
                "same start failure twice: {msg} (set restart.retry_start_failures: true to restart anyway)"
            ))
        }
        (Ending::Failed(msg), _) => match rec
            .failure
            .as_ref()
            .filter(|f| f.attempt == rec.attempt)
            .map(|f| f.exit_code)
            .filter(|c| rec.spec.restart.fail_on_exit_codes.contains(c))
        {
            Some(c) => Ending::FailedForGood(format!(
                "{msg} (exit code {c} is in restart.fail_on_exit_codes: no restart)"
            )),
            None => Ending::Failed(msg),
        },
        (e, _) => e,
    };
    rec.start_failure = start_failure;
    // The attempt's service counts for the ranking (`control/rank.rs`).
    if let Some(start) = rec.attempt_started() {
        let ran = now.saturating_sub(start);
        let per = u64::from(rec.spec.resources.gpus);
        let gpus = match rec.placement.len() {
            0 => rec.spec.total_gpus(),
            n => per.saturating_mul(n as u64),
        };
        rec.run_seconds = rec.run_seconds.saturating_add(ran);
        rec.attained_gpu_seconds = rec
            .attained_gpu_seconds
            .saturating_add(gpus.saturating_mul(ran));
    }
    rec.started_on.clear();
    rec.exited_on.clear();
    rec.preempted_by = None;
    rec.stopping = None;
    let ending = timeout_ending(&rec, ending);
    if !matches!(ending, Ending::TimedOut(_)) {
        // The next attempt gets its own port and signal time.
        rec.master_port = None;
        rec.signal_at_ms = None;
        rec.time_limit_hit = None;
    }
    let after = match ending {
        Ending::TimedOut(msg) => {
            rec.state = JobState::Timeout;
            rec.events.push(JobEvent::new(now, "timeout", msg));
            AfterEnd::Finish
        }
        Ending::Requeued(msg) => {
            rec.state = JobState::Pending;
            rec.placement.clear();
            rec.attempt += 1;
            rec.events.push(JobEvent::new(now, "requeued", msg));
            AfterEnd::Requeue
        }
        Ending::Failed(msg) if rec.restarts < rec.spec.restart.max_restarts => {
            // The whole gang stops and restarts from its checkpoint after a backoff.
            let backoff = rec
                .spec
                .restart
                .backoff_seconds
                .saturating_mul(1 << rec.restarts.min(20));
            rec.restarts += 1;
            rec.attempt += 1;
            rec.state = JobState::Restarting;
            rec.restart_at = Some(now.saturating_add(backoff));
            rec.placement.clear();
            // Attempts count from 0, as `logs --attempt` and `describe` show them.
            let text = format!(
                "{msg}; restart {} of {} in {backoff}s (attempt {} failed; attempt {} next)",
                rec.restarts,
                rec.spec.restart.max_restarts,
                rec.attempt.saturating_sub(1),
                rec.attempt
            );
            rec.events.push(JobEvent::new(now, "restarting", text));
            AfterEnd::Restart
        }
        Ending::Failed(msg) | Ending::FailedForGood(msg) => {
            rec.state = JobState::Failed;
            let text = if rec.restarts == 0 {
                msg
            } else {
                format!("{msg} after {} restarts", rec.restarts)
            };
            rec.events.push(JobEvent::new(now, "failed", text));
            AfterEnd::Finish
        }
        Ending::Succeeded(msg) => {
            rec.state = JobState::Succeeded;
            rec.events.push(JobEvent::new(now, "finished", msg));
            AfterEnd::Finish
        }
        Ending::Cancelled(msg) => {
            rec.state = JobState::Cancelled;
            rec.events.push(JobEvent::new(now, "cancelled", msg));
            AfterEnd::Finish
        }
    };
    (rec, after)
}

/// What identifies an attempt's failure at start (its first failure was
/// reported within [`gangway_core::job::START_FAILURE_SECONDS`] of its
/// placement): the first
/// failing rank's exit code and last line of output. `None` for any other
/// ending, a later failure, or one no node described (no rank named).
pub(crate) fn start_failure(rec: &JobRecord, ending: &Ending, now: Time) -> Option<String> {
    if !matches!(ending, Ending::Failed(_)) {
        return None;
    }
    let started = rec.attempt_started()?;
    // When the failure was reported (the rest of the gang may take its
    // stop grace to end).
    // Only a failure its node described (which rank, its output) compares.
    let f = rec
        .failure
        .as_ref()
        .filter(|f| f.attempt == rec.attempt && f.rank.is_some())?;
    if f.at.min(now).saturating_sub(started) > gangway_core::job::START_FAILURE_SECONDS {
        return None;
    }
    let last = f
        .log_tail
        .iter()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map_or("", |l| l.trim());
    Some(format!("{}|{last}", f.exit_code))
}

/// An attempt of a gang in its time-limit grace ends as a timeout, not a requeue.
fn timeout_ending(rec: &JobRecord, ending: Ending) -> Ending {
    match ending {
        Ending::Requeued(m) if rec.time_limit_hit.is_some() => Ending::TimedOut(m),
        e => e,
    }
}
