//! The scheduling policies, one plugin per file, and the registry that
//! names them. The simulator compares them, a cluster's versioned policy
//! names one (`scheduler.policy`), and the what-if replays a cluster's
//! history under any two; all three take them from [`lookup`].
//!
//! | name | file | what it models |
//! |---|---|---|
//! | `gangway` | [`gangway`] | priority classes, attained-service bands, least predicted remaining work with aging, DRF between queues (the default) |
//! | `fifo` | [`fifo`] | first come first served, head-of-line blocking per queue |
//! | `priority` | [`priority`] | strict priority classes with preemption, FIFO within a class |
//! | `slurm` | [`multifactor`] | Slurm's multifactor priority with EASY backfill |
//! | `capacity` | [`capacity`] | DRF capacity queues, FIFO within a queue |
//! | `tiresias` | [`tiresias`] | Tiresias' discretised 2D-LAS |
//! | `qssf` | [`qssf`] | Helios' quasi-shortest-service first |
//!
//! The simulator's SRTF oracle is not here: it ranks by true remaining run
//! times, which no live scheduler knows.

pub mod capacity;
pub mod fifo;
pub mod gangway;
pub mod multifactor;
pub mod priority;
pub mod qssf;
pub mod tiresias;

use crate::policy::SchedulingPolicy;
use crate::SchedulerConfig;
use thiserror::Error;

/// The policy a cluster runs when its policy names none.
pub const DEFAULT: &str = "gangway";

/// Every registered policy, in the simulator's report order.
static ALL: [&dyn SchedulingPolicy; 7] = [
    &gangway::Gangway,
    &fifo::Fifo,
    &priority::Priority,
    &multifactor::Multifactor,
    &capacity::Capacity,
    &tiresias::Tiresias,
    &qssf::Qssf,
];

/// Every registered policy, in the simulator's report order.
pub fn all() -> &'static [&'static dyn SchedulingPolicy] {
    &ALL
}

/// The registered names, comma-separated (for errors and help).
pub fn names() -> String {
    ALL.iter().map(|p| p.name()).collect::<Vec<_>>().join(", ")
}

/// A name no registered policy has.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("unknown scheduling policy {name:?}; known: {known}")]
pub struct UnknownPolicy {
    /// The name asked for (at most 64 characters of it).
    pub name: String,
    /// The registered names.
    pub known: String,
}

/// The policy named `name`.
pub fn lookup(name: &str) -> Result<&'static dyn SchedulingPolicy, UnknownPolicy> {
    let n = name.trim();
    ALL.iter()
        .copied()
        .find(|p| p.name() == n)
        .ok_or_else(|| UnknownPolicy {
            name: name.chars().take(64).collect(),
            known: names(),
        })
}

/// The default policy ([`DEFAULT`]).
pub fn default_policy() -> &'static dyn SchedulingPolicy {
    &gangway::Gangway
}

/// The policy `cfg` names ([`SchedulerConfig::policy`]); the default one
/// for a name the registry does not know (callers check names where they
/// are read: [`lookup`]).
pub fn of(cfg: &SchedulerConfig) -> &'static dyn SchedulingPolicy {
    lookup(&cfg.policy).unwrap_or_else(|_| default_policy())
}

/// The core's configuration a site's `cfg` runs with: the switches of the
/// policy it names on top of it.
pub fn configure(cfg: &SchedulerConfig) -> SchedulerConfig {
    of(cfg).configure(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_is_found_by_its_name_and_unknown_names_list_the_known() {
        for p in all() {
            assert_eq!(lookup(p.name()).map(|q| q.name()), Ok(p.name()));
        }
        assert_eq!(default_policy().name(), DEFAULT);
        let e = lookup("srtf")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(
            e,
            "unknown scheduling policy \"srtf\"; known: gangway, fifo, priority, slurm, capacity, tiresias, qssf"
        );
    }
}
