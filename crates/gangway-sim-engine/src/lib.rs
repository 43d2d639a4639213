//! The engine of Gangway's trace-driven simulator: a cluster description,
//! a discrete-event engine that runs the *same* `gangway-sched` core as the
//! server under any policy of its registry (and the SRTF oracle), and the
//! metrics of a run. The trace loaders, reports and plots are in
//! `gangway-sim`; the server's what-if uses this crate alone, so the
//! control plane carries no plotting or decompression code.

pub mod cluster;
pub mod engine;
pub mod job;
pub mod metrics;
pub mod policy;
pub mod trace;

pub use cluster::ClusterSpec;
pub use engine::{Engine, SimError, SimOptions};
pub use job::SimJob;
pub use metrics::SimResult;
pub use policy::Policy;
pub use trace::{LoadReport, Trace, TraceJob};
