//! Persisting the run-time predictor without holding the state.
//!
//! The predictor grows with the cluster's distinct job names: at 100,000
//! jobs of distinct names it encoded to 10 MB, and storing it under the
//! state lock stalled every sync, submission and cycle for ~350 ms each
//! minute (it set the agents' sync p99 in the steady state). The copy
//! to store is taken under the lock at no cost (the predictor is shared),
//! then encoded, trimmed and written by [`PredictorSave::write`] after the
//! lock is released. What is stored is bounded: at most
//! [`PREDICTOR_MAX_BYTES`], keeping the groups with the most history.

use super::{encode, Control, PREDICTOR_KEY};
use gangway_core::Time;
use gangway_sched::predict::RuntimePredictor;
use gangway_store::{Op, Store};
use std::sync::Arc;

/// The most bytes of predictor stored, whatever the store allows: etcd's
/// default request size, so a store of it is short on every backend.
pub const PREDICTOR_MAX_BYTES: usize = 1024 * 1024;

/// A predictor to store, taken under the state lock.
pub struct PredictorSave {
    predictor: Arc<RuntimePredictor>,
    budget: usize,
}

impl PredictorSave {
    /// Encodes the predictor within the budget (the groups with the least
    /// history are left out, halving until it fits) and stores it. A
    /// failure is logged: the predictor only informs estimates and is
    /// relearned after a restart, so it never stops anything.
    pub fn write(self, store: &impl Store) {
        let p = &*self.predictor;
        let mut value = encode(p);
        let mut keep = p.widest_basis();
        while value.len() > self.budget && keep > 0 {
            keep /= 2;
            value = encode(&p.keep_largest(keep));
        }
        if let Err(e) = store.txn(&[], &[Op::Put(PREDICTOR_KEY.into(), value)]) {
            tracing::warn!("run-time predictor not stored: {e}");
        }
    }
}

impl<S: Store> Control<S> {
    /// The predictor to store, when it changed and the last store is at
    /// least [`crate::parts::ranking::PREDICTOR_SAVE_SECONDS`] old; write it to this store after
    /// releasing the lock.
    pub fn predictor_save(&mut self, now: Time) -> Option<PredictorSave> {
        if !self.ranks.predictor_due(now) {
            return None;
        }
        // One value must fit one transaction of the store.
        let budget = self
            .store
            .txn_limits()
            .max_bytes
            .saturating_sub(4096)
            .min(PREDICTOR_MAX_BYTES);
        Some(PredictorSave {
            predictor: self.cluster.predictor_shared(),
            budget,
        })
    }
}
