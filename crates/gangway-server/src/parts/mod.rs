//! The parts of the control state that [`Control`](crate::control::Control)
//! coordinates. Each owns one kind of state and the rules that touch only
//! it; none knows of `Control` (nor of HTTP): `Control`'s methods read and
//! write the store, call the parts and keep the scheduler's mirror in step.
//! The server's layers test (`tests/layers.rs`) fails when a module here
//! names `crate::control`.
//!
//! The job table ([`crate::records::JobTable`]), the gates
//! ([`crate::workflow::Gates`]) and the reservations
//! ([`crate::reservations::Reservations`]) are parts too, in their own
//! modules.

pub mod contract;
pub mod job_writes;
pub mod node_registry;
pub mod policy_store;
pub mod ranking;
pub mod view_state;

pub use contract::{Contract, ContractState};
pub use job_writes::JobWrites;
pub use node_registry::NodeRegistry;
pub use policy_store::PolicyStore;
pub use ranking::RankMemo;
pub use view_state::ViewState;
