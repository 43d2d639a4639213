//! Why a control-plane operation failed ([`ControlError`], with the
//! workflow's [`WorkflowError`]), and the JSON
//! codec every part of the control state stores its records with. It sits
//! under the parts (nodes, reservations) and the control state that owns
//! them, so they all return it without importing the control state.

use gangway_core::{JobId, JobState};
use gangway_sched::Rejection;
use gangway_store::StoreError;
use thiserror::Error;

/// Why a control-plane operation failed.
#[derive(Debug, Error)]
pub enum ControlError {
    /// Store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The job can never run here, or the spec is wrong.
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// Unknown job.
    #[error("job {0} does not exist")]
    NoSuchJob(JobId),
    /// Unknown node.
    #[error("node {0:?} does not exist")]
    NoSuchNode(String),
    /// Bad node.
    #[error("{0}")]
    BadNode(String),
    /// Wrong state for the operation.
    #[error("job {id} {phrase}", id = .0, phrase = already(*.1))]
    Finished(JobId, JobState),
    /// A node reported about a job that is not placed on it.
    #[error("job {1} does not run on node {0:?}")]
    NotOnNode(String, JobId),
    /// A report that does not fit the job's state.
    #[error(
        "job {id} {phrase}; cannot report {what}",
        id = .0,
        phrase = state_phrase(&state_name(*.1)),
        what = .2
    )]
    BadReport(JobId, JobState, &'static str),
    /// A stored record could not be decoded.
    #[error("stored record {0} is corrupt: {1}")]
    Corrupt(String, String),
    /// Someone else changed the record first.
    #[error("conflicting update of {0}; retry")]
    Conflict(String),
    /// A known caller that may not do this (a node acting for another).
    #[error("{0}")]
    Forbidden(String),
    /// A report about an attempt that is over.
    #[error("job {0} attempt {1} is over (the current attempt is {2})")]
    StaleAttempt(JobId, u32, u32),
    /// A hold, release or update refused (see [`crate::workflow`]).
    #[error(transparent)]
    Workflow(#[from] WorkflowError),
}

/// Why a hold, release or update was refused.
#[derive(Debug, thiserror::Error)]
pub enum WorkflowError {
    /// Only pending jobs can be held, released or updated (409).
    #[error(
        "job {id} {phrase}; only pending jobs can be {verb}",
        id = .0,
        phrase = state_phrase(.1),
        verb = .2
    )]
    NotPending(JobId, String, &'static str),
    /// Release of a job that is not held (409).
    #[error("job {0} is not held")]
    NotHeld(JobId),
    /// The caller may not do this (403).
    #[error("{0}")]
    Forbidden(String),
    /// A field the request got wrong (422).
    #[error("{0}")]
    Field(String),
    /// A malformed request, e.g. an update that changes nothing (400).
    #[error("{0}")]
    Malformed(String),
    /// A submission rule of the cluster's limits (status by rule).
    #[error(transparent)]
    Limit(#[from] crate::limits::LimitError),
}

/// Decodes a stored JSON record; a record that does not decode is corrupt.
pub(crate) fn decode<T: serde::de::DeserializeOwned>(
    key: &str,
    bytes: &[u8],
) -> Result<T, ControlError> {
    serde_json::from_slice(bytes).map_err(|e| ControlError::Corrupt(key.to_string(), e.to_string()))
}

/// Encodes a record as JSON.
pub(crate) fn encode<T: serde::Serialize>(v: &T) -> Vec<u8> {
    // Serialising our own plain data types cannot fail.
    serde_json::to_vec(v).unwrap_or_default()
}

/// `has already succeeded`, `was already cancelled`: an ended job's state
/// as the rest of a sentence.
fn already(s: JobState) -> String {
    match state_name(s).as_str() {
        "succeeded" => "has already succeeded".into(),
        "failed" => "has already failed".into(),
        "cancelled" => "was already cancelled".into(),
        "timeout" => "has already timed out".into(),
        other => format!("is already {other}"),
    }
}

/// A state as the API spells it (`running`).
pub fn state_name(s: JobState) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{s:?}"))
}

/// A job's state as the rest of a sentence after `job 12`: `is pending`,
/// `succeeded`, `was cancelled`, `timed out` (never `is succeeded`).
pub fn state_phrase(state: &str) -> String {
    match state {
        "succeeded" | "failed" => state.to_string(),
        "cancelled" => "was cancelled".into(),
        "timeout" => "timed out".into(),
        other => format!("is {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_read_as_sentences() {
        assert_eq!(super::state_phrase("running"), "is running");
        assert_eq!(super::state_phrase("succeeded"), "succeeded");
        assert_eq!(super::state_phrase("timeout"), "timed out");
        let e = ControlError::Finished(JobId(12), JobState::Succeeded).to_string();
        assert_eq!(e, "job 12 has already succeeded");
        let e = ControlError::Finished(JobId(12), JobState::Cancelled).to_string();
        assert_eq!(e, "job 12 was already cancelled");
        let e = WorkflowError::NotPending(JobId(3), "failed".into(), "held").to_string();
        assert_eq!(e, "job 3 failed; only pending jobs can be held");
    }
}
