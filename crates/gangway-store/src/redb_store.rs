//! The embedded backend: one redb file. Each transaction is one redb write
//! transaction committed with immediate durability, so an acknowledged write
//! survives `kill -9`; redb's copy-on-write pages make a torn write impossible.
//! A deferred transaction ([`Store::txn_deferred`]) is committed without its
//! fsync (redb's `Durability::None`); the next immediate commit makes it
//! durable with everything before it, and [`Store::sync`] makes one (an
//! empty commit) only if no immediate commit has covered it yet, so callers
//! waiting together share one fsync.

use crate::{Compare, Event, KeyValue, Op, Store, StoreError, TxnResult};
use redb::{Database, ReadableTable, TableDefinition};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;

/// key → (mod_revision, value)
const KV: TableDefinition<&str, (u64, &[u8])> = TableDefinition::new("kv");
/// (revision, index in the transaction) → (key, Some(value) for put / None for
/// delete): the change log watchers replay from.
const LOG: TableDefinition<LogKey, LogEntry> = TableDefinition::new("log");
/// (revision, index within the transaction).
type LogKey = (u64, u32);
/// (key, value or `None` for a delete).
type LogEntry<'a> = (&'a str, Option<&'a [u8]>);
/// "revision" → current revision.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

/// A store in one redb file.
pub struct RedbStore {
    db: Database,
    watchers: Mutex<Vec<(String, Sender<Event>)>>,
    /// Serialises writers so watchers see changes in revision order.
    write_lock: Mutex<()>,
    /// Deferred commits made, and how many of them an immediate commit
    /// has since made durable (both changed under `write_lock`).
    deferred: AtomicU64,
    durable: AtomicU64,
}

impl RedbStore {
    /// Opens (or creates) the store at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let db = Database::create(path).map_err(backend)?;
        let w = db.begin_write().map_err(backend)?;
        {
            w.open_table(KV).map_err(backend)?;
            w.open_table(LOG).map_err(backend)?;
            w.open_table(META).map_err(backend)?;
        }
        w.commit().map_err(backend)?;
        Ok(RedbStore {
            db,
            watchers: Mutex::new(Vec::new()),
            write_lock: Mutex::new(()),
            deferred: AtomicU64::new(0),
            durable: AtomicU64::new(0),
        })
    }

    fn notify(&self, events: &[Event]) {
        let Ok(mut ws) = self.watchers.lock() else {
            return;
        };
        ws.retain(|(prefix, tx)| {
            events
                .iter()
                .filter(|e| match e {
                    Event::Put(kv) => kv.key.starts_with(prefix.as_str()),
                    Event::Delete { key, .. } => key.starts_with(prefix.as_str()),
                })
                .all(|e| tx.send(e.clone()).is_ok())
        });
    }
}

impl RedbStore {
    /// One write transaction, committed with an fsync (`durable`) or
    /// without ([`Store::txn_deferred`]).
    fn commit(
        &self,
        compares: &[Compare],
        ops: &[Op],
        durable: bool,
    ) -> Result<TxnResult, StoreError> {
        let _guard = self.write_lock.lock().map_err(backend)?;
        let mut w = self.db.begin_write().map_err(backend)?;
        if !durable {
            w.set_durability(redb::Durability::None);
        }
        let mut events = Vec::new();
        let revision;
        let succeeded;
        {
            let mut kv = w.open_table(KV).map_err(backend)?;
            let mut log = w.open_table(LOG).map_err(backend)?;
            let mut meta = w.open_table(META).map_err(backend)?;
            let current = meta
                .get("revision")
                .map_err(backend)?
                .map_or(0, |v| v.value());
            let holds = |c: &Compare| -> Result<bool, StoreError> {
                Ok(match c {
                    Compare::Absent(k) => kv.get(k.as_str()).map_err(backend)?.is_none(),
                    Compare::Revision(k, r) => kv
                        .get(k.as_str())
                        .map_err(backend)?
                        .is_some_and(|v| v.value().0 == *r),
                })
            };
            let mut ok = true;
            for c in compares {
                if !holds(c)? {
                    ok = false;
                    break;
                }
            }
            succeeded = ok;
            if !ok || ops.is_empty() {
                revision = current;
            } else {
                revision = current + 1;
                for (i, op) in ops.iter().enumerate() {
                    let at = (revision, i as u32);
                    match op {
                        Op::Put(k, v) => {
                            kv.insert(k.as_str(), (revision, v.as_slice()))
                                .map_err(backend)?;
                            log.insert(at, (k.as_str(), Some(v.as_slice())))
                                .map_err(backend)?;
                            events.push(Event::Put(KeyValue {
                                key: k.clone(),
                                value: v.clone(),
                                mod_revision: revision,
                            }));
                        }
                        Op::Delete(k) => {
                            if kv.remove(k.as_str()).map_err(backend)?.is_some() {
                                log.insert(at, (k.as_str(), None)).map_err(backend)?;
                                events.push(Event::Delete {
                                    key: k.clone(),
                                    revision,
                                });
                            }
                        }
                    }
                }
                meta.insert("revision", revision).map_err(backend)?;
            }
        }
        if succeeded && !ops.is_empty() {
            let made = self.deferred.load(Ordering::SeqCst);
            w.commit().map_err(backend)?;
            if durable {
                // Everything committed before is durable with it.
                self.durable.fetch_max(made, Ordering::SeqCst);
            } else {
                self.deferred.fetch_add(1, Ordering::SeqCst);
            }
            self.notify(&events);
        } else {
            w.abort().map_err(backend)?;
        }
        Ok(TxnResult {
            succeeded,
            revision,
        })
    }
}

impl Store for RedbStore {
    fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        let r = self.db.begin_read().map_err(backend)?;
        let t = r.open_table(KV).map_err(backend)?;
        Ok(t.get(key).map_err(backend)?.map(|v| {
            let (rev, val) = v.value();
            KeyValue {
                key: key.to_string(),
                value: val.to_vec(),
                mod_revision: rev,
            }
        }))
    }

    fn range(&self, prefix: &str) -> Result<Vec<KeyValue>, StoreError> {
        let r = self.db.begin_read().map_err(backend)?;
        let t = r.open_table(KV).map_err(backend)?;
        let mut out = Vec::new();
        for item in t.range(prefix..).map_err(backend)? {
            let (k, v) = item.map_err(backend)?;
            let key = k.value();
            if !key.starts_with(prefix) {
                break;
            }
            let (rev, val) = v.value();
            out.push(KeyValue {
                key: key.to_string(),
                value: val.to_vec(),
                mod_revision: rev,
            });
        }
        Ok(out)
    }

    fn txn(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError> {
        self.commit(compares, ops, true)
    }

    fn txn_deferred(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError> {
        self.commit(compares, ops, false)
    }

    fn sync(&self) -> Result<(), StoreError> {
        let target = self.deferred.load(Ordering::SeqCst);
        if self.durable.load(Ordering::SeqCst) >= target {
            return Ok(());
        }
        let _guard = self.write_lock.lock().map_err(backend)?;
        // Whoever held the lock before may have flushed for us.
        if self.durable.load(Ordering::SeqCst) >= target {
            return Ok(());
        }
        let made = self.deferred.load(Ordering::SeqCst);
        let w = self.db.begin_write().map_err(backend)?;
        w.commit().map_err(backend)?;
        self.durable.fetch_max(made, Ordering::SeqCst);
        Ok(())
    }

    fn revision(&self) -> Result<u64, StoreError> {
        let r = self.db.begin_read().map_err(backend)?;
        let t = r.open_table(META).map_err(backend)?;
        Ok(t.get("revision").map_err(backend)?.map_or(0, |v| v.value()))
    }

    fn watch(&self, prefix: &str, from: u64) -> Result<Receiver<Event>, StoreError> {
        // Hold the write lock so no change falls between the replay and the subscription.
        let _guard = self.write_lock.lock().map_err(backend)?;
        let (tx, rx) = channel();
        let r = self.db.begin_read().map_err(backend)?;
        let log = r.open_table(LOG).map_err(backend)?;
        for item in log.range((from, 0)..).map_err(backend)? {
            let (at, entry) = item.map_err(backend)?;
            let (rev, _) = at.value();
            let (key, val) = entry.value();
            if !key.starts_with(prefix) {
                continue;
            }
            let e = match val {
                Some(v) => Event::Put(KeyValue {
                    key: key.to_string(),
                    value: v.to_vec(),
                    mod_revision: rev,
                }),
                None => Event::Delete {
                    key: key.to_string(),
                    revision: rev,
                },
            };
            let _ = tx.send(e);
        }
        self.watchers
            .lock()
            .map_err(backend)?
            .push((prefix.to_string(), tx));
        Ok(rx)
    }
}
