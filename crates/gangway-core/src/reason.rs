//! Why a job is not running, as a stable code scripts can match.

use serde::{Deserialize, Serialize};

/// A pending job's reason code, shown beside the sentence. The names are
/// Slurm's where the meaning matches (`squeue -o %r`), so scripts written for
/// Slurm keep working; the serialized form is the variant name, and a code once
/// published is never renamed.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
pub enum ReasonCode {
    /// Waiting for GPUs (or CPU, memory) held by running jobs to be freed.
    Resources,
    /// Jobs ahead of it in order (higher priority, fair share, or a
    /// reservation made for them) go first.
    Priority,
    /// Its queue is at its quota and cannot borrow (Slurm's group GRES limit).
    #[serde(rename = "QOSGrpGRES")]
    QosGrpGres,
    /// A per-user limit holds it (GPUs, jobs).
    #[serde(rename = "QOSMaxGRESPerUser")]
    QosMaxGresPerUser,
    /// Waiting for the jobs it depends on.
    Dependency,
    /// A dependency can never be met (it is then cancelled).
    DependencyNeverSatisfied,
    /// Its begin time (`--begin`) or restart backoff has not come.
    BeginTime,
    /// Held by its owner.
    JobHeldUser,
    /// Held by an administrator.
    JobHeldAdmin,
    /// Its job array already runs as many tasks as its `%N` limit allows.
    JobArrayTaskLimit,
    /// The nodes it could use are reserved (maintenance) or unavailable.
    ReqNodeNotAvail,
    /// Victims were signalled to checkpoint; it starts when they exit.
    Preemption,
    /// Its request can never fit this cluster (shape, model, size).
    BadConstraints,
}

impl ReasonCode {
    /// The code as serialized (e.g. `QOSGrpGRES`).
    pub fn as_str(self) -> &'static str {
        match self {
            ReasonCode::Resources => "Resources",
            ReasonCode::Priority => "Priority",
            ReasonCode::QosGrpGres => "QOSGrpGRES",
            ReasonCode::QosMaxGresPerUser => "QOSMaxGRESPerUser",
            ReasonCode::Dependency => "Dependency",
            ReasonCode::DependencyNeverSatisfied => "DependencyNeverSatisfied",
            ReasonCode::BeginTime => "BeginTime",
            ReasonCode::JobHeldUser => "JobHeldUser",
            ReasonCode::JobHeldAdmin => "JobHeldAdmin",
            ReasonCode::JobArrayTaskLimit => "JobArrayTaskLimit",
            ReasonCode::ReqNodeNotAvail => "ReqNodeNotAvail",
            ReasonCode::Preemption => "Preemption",
            ReasonCode::BadConstraints => "BadConstraints",
        }
    }
}

impl std::fmt::Display for ReasonCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialized_names_are_the_published_codes() {
        for c in [
            ReasonCode::Resources,
            ReasonCode::QosGrpGres,
            ReasonCode::QosMaxGresPerUser,
            ReasonCode::DependencyNeverSatisfied,
            ReasonCode::BadConstraints,
        ] {
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(json, format!("\"{}\"", c.as_str()));
            let back: ReasonCode = serde_json::from_str(&json).unwrap();
            assert_eq!(back, c);
        }
    }
}
