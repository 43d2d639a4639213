//! Gangway's node agent: it registers its node (GPUs from NVML or a declared
//! inventory), then syncs with the server every few seconds like a kubelet:
//! it reports GPU health and what its ranks are doing, receives the node's
//! desired state, and reconciles — starting ranks that should run (as
//! processes or Docker containers, with `CUDA_VISIBLE_DEVICES` and
//! torchrun-style variables), signalling ranks whose job is being preempted
//! and killing them after the grace period, and killing anything else.
//! Rank logs go to files and are served to the server for `gangway logs`.

pub mod agent;
pub mod binding;
pub mod checkpoint;
pub mod config;
pub mod credentials;
pub mod discovery;
pub mod disk;
pub mod executor;
pub mod gpu_source;
pub mod health;
pub mod identity;
pub mod landlock;
pub mod leftovers;
pub mod limits;
pub mod logpump;
pub mod logs;
pub mod machine;
pub mod mounts;
pub mod probe;
pub mod proctrack;
pub mod reconcile;
pub mod rendezvous;
pub mod safefs;
pub mod sandbox;
pub mod scratch;
pub mod supervisor;
pub mod tls;

pub use agent::{Agent, AgentError};
pub use config::{AgentConfig, ExecutorKind, Inventory};
