//! Gangway's trace-driven simulator: loaders for real GPU-cluster traces, a
//! cluster description, a discrete-event engine that runs the *same*
//! `gangway-sched` core as the server, baseline policies under the same
//! engine, metrics, and reports (JSON, CSV, a table and SVG plots).

pub mod cluster;
pub mod engine;
pub mod fgd;
pub mod metrics;
pub mod policy;
pub mod report;
pub mod scorecard;
pub mod trace;

pub use cluster::ClusterSpec;
pub use engine::{Engine, SimError, SimOptions};
pub use metrics::SimResult;
pub use policy::Policy;
pub use trace::{load, LoadReport, Trace, TraceJob};
