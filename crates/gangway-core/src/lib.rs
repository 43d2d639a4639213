//! Gangway's vocabulary: integer resources, nodes with their GPUs and topology,
//! job specs (gangs of replicas), queues with quotas, and job states.
//!
//! This crate does no I/O. Its serde types are the API's types, so the server,
//! the simulator and the CLI all speak the same language.

pub mod agent;
pub mod id;
pub mod job;
pub mod node;
pub mod node_policy;
pub mod queue;
pub mod reason;
pub mod resources;
pub mod span;
pub mod text;
pub mod workflow;

pub use job::{
    check_checkpoint_dir, format_time_span, parse_time_span, signal_number, CheckpointPolicy,
    JobId, JobSpec, JobState, Mount, PriorityClass, ReplicaResources, RestartPolicy, RunSpec,
    SpecError, TimeSpan, TopologyConstraint,
};
pub use node::{
    gpu_fault_cause, gpu_memory_fits, gpu_model_matches, Gpu, NodeSpec, TopologyCosts,
    TopologyLevel,
};
pub use node_policy::{MountPolicy, NodePolicy, PolicyError};
pub use queue::{
    QueueOrdering, QueueSpec, QueueTimeLimits, Quota, ResourceLimits, MAX_MIN_RUN_SECONDS,
    MAX_PREEMPTION_BUDGET,
};
pub use reason::ReasonCode;
pub use resources::{Resource, Resources};
pub use span::{format_span, SpanForm};
pub use workflow::{ArrayTask, BeginAt};

/// Time in whole seconds on the scheduler's clock (wall-clock epoch seconds in
/// the server, trace-relative seconds in the simulator).
pub type Time = u64;
