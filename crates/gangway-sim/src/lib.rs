//! Gangway's trace-driven simulator: loaders for real GPU-cluster traces
//! ([`trace`]), the engine (re-exported from `gangway-sim-engine`: a cluster
//! description, a discrete-event engine that runs the *same*
//! `gangway-sched` core as the server, the policies of the core's registry
//! and the SRTF oracle, metrics), the scorecard, and reports (JSON, CSV, a
//! table and SVG plots).

pub use gangway_sim_engine::{cluster, engine, job, metrics, policy};
pub mod fgd;
pub mod report;
pub mod scorecard;
pub mod trace;

pub use cluster::ClusterSpec;
pub use engine::{Engine, SimError, SimOptions};
pub use metrics::SimResult;
pub use policy::Policy;
pub use trace::{load, LoadReport, Trace, TraceJob};
