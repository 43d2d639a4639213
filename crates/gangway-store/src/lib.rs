//! Gangway's store: a small key-value interface with revisions, in the shape
//! of etcd's, so the server can run on the embedded [`RedbStore`] (one file,
//! crash-safe) or on [`EtcdStore`] for high availability.
//!
//! - every write gets the next global *revision*; each key remembers the
//!   revision of its last change (`mod_revision`);
//! - [`Store::txn`] applies a batch of puts and deletes only if every compare
//!   holds (compare-and-swap on revisions, or "key absent") — the way job
//!   state transitions are made exactly once;
//! - a write returns only after it is durably committed;
//! - [`Store::watch`] streams changes under a prefix, from a revision on;
//! - [`Store::compact`] forgets the history before a revision (every write
//!   is otherwise kept forever in the change log).

mod etcd_store;
mod limits;
mod redb_store;
pub mod testing;

pub use etcd_store::EtcdStore;
pub use limits::TxnLimits;
pub use redb_store::RedbStore;

use std::sync::mpsc::Receiver;
use thiserror::Error;

/// A stored value with its revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    /// Key.
    pub key: String,
    /// Value bytes.
    pub value: Vec<u8>,
    /// Revision of the write that last changed this key.
    pub mod_revision: u64,
}

/// A condition of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Compare {
    /// The key does not exist.
    Absent(String),
    /// The key exists and was last changed at exactly this revision.
    Revision(String, u64),
}

/// A change in a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Set a key.
    Put(String, Vec<u8>),
    /// Remove a key (no-op if absent).
    Delete(String),
}

/// What a transaction did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxnResult {
    /// Whether every compare held and the ops were applied.
    pub succeeded: bool,
    /// The store's revision after the transaction.
    pub revision: u64,
}

/// A change seen by a watcher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Key set to a value.
    Put(KeyValue),
    /// Key removed at a revision.
    Delete {
        /// Key.
        key: String,
        /// Revision of the delete.
        revision: u64,
    },
}

impl Event {
    /// The revision of the change.
    pub fn revision(&self) -> u64 {
        match self {
            Event::Put(kv) => kv.mod_revision,
            Event::Delete { revision, .. } => *revision,
        }
    }
}

/// A store failure.
#[derive(Debug, Error)]
pub enum StoreError {
    /// The database could not be opened, read or written.
    #[error("store backend: {0}")]
    Backend(String),
    /// A stored record is not in the expected format (corruption or a foreign file).
    #[error("store record for key {key:?} is malformed")]
    Corrupt {
        /// Key.
        key: String,
    },
    /// This replica's leadership is gone (its fence no longer holds): the
    /// write was not applied, and no write of it will be.
    #[error("this server is no longer the leader; nothing was written")]
    NotLeader,
    /// Watching from a revision older than the kept history.
    #[error(
        "revision {requested} is compacted (its history is gone); read the current state and \
         watch from its revision"
    )]
    Compacted {
        /// Asked for.
        requested: u64,
        /// The oldest revision still watchable, where the backend knows it.
        oldest: Option<u64>,
    },
}

/// The key-value interface the server uses; backends must make every
/// successful write durable before returning, except those of
/// [`Store::txn_deferred`], which are durable once [`Store::sync`] returns.
pub trait Store: Send + Sync {
    /// Reads one key.
    fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError>;
    /// Reads every key starting with `prefix`, in key order.
    fn range(&self, prefix: &str) -> Result<Vec<KeyValue>, StoreError>;
    /// Applies `ops` atomically if all `compares` hold.
    fn txn(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError>;
    /// Current revision.
    fn revision(&self) -> Result<u64, StoreError>;
    /// Changes under `prefix` with revision ≥ `from` (history first, then
    /// live); [`StoreError::Compacted`] when `from` is older than the kept
    /// history.
    fn watch(&self, prefix: &str, from: u64) -> Result<Receiver<Event>, StoreError>;
    /// Forgets the change history before `revision` (what [`Store::watch`]
    /// replays); every key keeps its current value and revision. Without it
    /// the history grows with every write, forever (etcd then refuses writes
    /// at its space quota). Compacting to a revision already compacted, or
    /// beyond what the backend holds, compacts what it can and succeeds.
    /// Required of every backend and wrapper, so none drops it silently.
    fn compact(&self, revision: u64) -> Result<(), StoreError>;

    /// How large one transaction may be; larger batches of independent
    /// writes are split to fit (see [`TxnLimits::split`]).
    fn txn_limits(&self) -> TxnLimits {
        TxnLimits::UNLIMITED
    }

    /// Like [`Store::txn`], but the commit need not be durable before this
    /// returns: it is once a later [`Store::txn`] or [`Store::sync`]
    /// returns. Readers see it at once. For many small writes whose
    /// acknowledgement can wait for one shared flush (agents' reports):
    /// each would otherwise pay an fsync of its own. Backends whose every
    /// commit is durable anyway (etcd) keep this default.
    fn txn_deferred(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError> {
        self.txn(compares, ops)
    }

    /// Several independent [`Store::txn_deferred`]s (their keys disjoint),
    /// answered in order. Backends that pay a round trip per transaction
    /// (etcd) send them all at once, so a batch of the agents' reports
    /// costs one round trip instead of one per chunk; each transaction is
    /// still atomic and fenced on its own, so some may land and others not.
    fn txns_deferred(
        &self,
        txns: &[(Vec<Compare>, Vec<Op>)],
    ) -> Vec<Result<TxnResult, StoreError>> {
        txns.iter().map(|(c, o)| self.txn_deferred(c, o)).collect()
    }

    /// Makes every transaction committed so far durable; callers of
    /// [`Store::txn_deferred`] call it before acknowledging. Concurrent
    /// callers share one flush.
    fn sync(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Sets a key unconditionally; returns the new revision.
    fn put(&self, key: &str, value: &[u8]) -> Result<u64, StoreError> {
        Ok(self
            .txn(&[], &[Op::Put(key.to_string(), value.to_vec())])?
            .revision)
    }

    /// Removes a key; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let existed = self.get(key)?.is_some();
        self.txn(&[], &[Op::Delete(key.to_string())])?;
        Ok(existed)
    }
}

/// A shared store is a store (the server picks a backend at run time).
impl<T: Store + ?Sized> Store for std::sync::Arc<T> {
    fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        (**self).get(key)
    }
    fn range(&self, prefix: &str) -> Result<Vec<KeyValue>, StoreError> {
        (**self).range(prefix)
    }
    fn txn(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError> {
        (**self).txn(compares, ops)
    }
    fn revision(&self) -> Result<u64, StoreError> {
        (**self).revision()
    }
    fn watch(&self, prefix: &str, from: u64) -> Result<Receiver<Event>, StoreError> {
        (**self).watch(prefix, from)
    }
    fn compact(&self, revision: u64) -> Result<(), StoreError> {
        (**self).compact(revision)
    }
    fn txn_limits(&self) -> TxnLimits {
        (**self).txn_limits()
    }
    fn txn_deferred(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError> {
        (**self).txn_deferred(compares, ops)
    }
    fn txns_deferred(
        &self,
        txns: &[(Vec<Compare>, Vec<Op>)],
    ) -> Vec<Result<TxnResult, StoreError>> {
        (**self).txns_deferred(txns)
    }
    fn sync(&self) -> Result<(), StoreError> {
        (**self).sync()
    }
}
