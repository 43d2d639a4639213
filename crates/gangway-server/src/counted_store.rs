//! A store wrapper that counts write transactions and their operations for
//! `/metrics` (`gangway_store_txns_total`, `gangway_store_ops_total`), so the
//! store's write rate is visible whatever the backend (redb or etcd).

use gangway_store::{Compare, Event, KeyValue, Op, Store, StoreError, TxnResult};
use prometheus_client::metrics::counter::Counter;
use std::sync::mpsc::Receiver;

/// `S` with every transaction counted.
pub struct CountedStore<S> {
    inner: S,
    txns: Counter,
    ops: Counter,
}

impl<S> CountedStore<S> {
    /// Counts `inner`'s transactions in `txns` and their operations in `ops`.
    pub fn new(inner: S, txns: Counter, ops: Counter) -> Self {
        CountedStore { inner, txns, ops }
    }
}

impl<S> CountedStore<S> {
    fn count(&self, r: &Result<TxnResult, StoreError>, ops: &[Op]) {
        if r.is_ok() && !ops.is_empty() {
            self.txns.inc();
            self.ops.inc_by(ops.len() as u64);
        }
    }
}

impl<S: Store> Store for CountedStore<S> {
    fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        self.inner.get(key)
    }
    fn range(&self, prefix: &str) -> Result<Vec<KeyValue>, StoreError> {
        self.inner.range(prefix)
    }
    fn txn(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError> {
        let r = self.inner.txn(compares, ops);
        self.count(&r, ops);
        r
    }
    fn txn_deferred(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError> {
        let r = self.inner.txn_deferred(compares, ops);
        self.count(&r, ops);
        r
    }
    fn txns_deferred(
        &self,
        txns: &[(Vec<Compare>, Vec<Op>)],
    ) -> Vec<Result<TxnResult, StoreError>> {
        let rs = self.inner.txns_deferred(txns);
        for (r, (_, ops)) in rs.iter().zip(txns) {
            self.count(r, ops);
        }
        rs
    }
    fn sync(&self) -> Result<(), StoreError> {
        self.inner.sync()
    }
    fn revision(&self) -> Result<u64, StoreError> {
        self.inner.revision()
    }
    fn watch(&self, prefix: &str, from: u64) -> Result<Receiver<Event>, StoreError> {
        self.inner.watch(prefix, from)
    }
    fn compact(&self, revision: u64) -> Result<(), StoreError> {
        self.inner.compact(revision)
    }
    fn txn_limits(&self) -> gangway_store::TxnLimits {
        self.inner.txn_limits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_store::RedbStore;

    #[test]
    fn counts_writes_not_reads() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("open");
        let (txns, ops) = (Counter::default(), Counter::default());
        let s = CountedStore::new(store, txns.clone(), ops.clone());
        s.txn(
            &[],
            &[
                Op::Put("a".into(), b"1".to_vec()),
                Op::Put("b".into(), b"2".to_vec()),
            ],
        )
        .expect("txn");
        s.put("c", b"3").expect("put");
        assert_eq!(
            s.get("a").expect("get").map(|kv| kv.value),
            Some(b"1".to_vec())
        );
        s.range("").expect("range");
        assert_eq!((txns.get(), ops.get()), (2, 3));
    }
}
