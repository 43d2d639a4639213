//! The embedded backend: one redb file. Each transaction is one redb write
//! transaction committed with immediate durability, so an acknowledged write
//! survives `kill -9`; redb's copy-on-write pages make a torn write impossible.
//!
//! A deferred transaction ([`Store::txn_deferred`]) is applied to an
//! in-memory overlay instead: reads, compares and watchers see it at once,
//! and the next immediate commit or [`Store::sync`] writes the whole overlay
//! in one redb transaction with one fsync. A busy cluster's agent reports
//! (thousands a second, each a job record) so cost one write transaction per
//! batch, not one each. Until then the changes live only in
//! memory: callers acknowledge them only after [`Store::sync`].
//!
//! A flush holds the writer lock only to take the overlay: deferred writers
//! go on into a fresh one while redb writes and commits the taken one
//! (readers see both until it lands). The server commits deferred under
//! its state lock, so a flush holding the writer lock throughout held the
//! whole control state still behind redb's commit.

use crate::{Compare, Event, KeyValue, Op, Store, StoreError, TxnResult};
use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, RwLock};

/// key → (mod_revision, value)
const KV: TableDefinition<&str, (u64, &[u8])> = TableDefinition::new("kv");
/// (revision, index in the transaction).
type LogKey = (u64, u32);
/// (key, value or `None` for a delete).
type LogEntry<'a> = (&'a str, Option<&'a [u8]>);
/// "revision" → current revision; "compacted" → the oldest revision a
/// watch may start from; "log_first" and "log_gen" → the oldest and the
/// current generation of the change log.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// The change log watchers replay from, (revision, index) → (key, value),
/// is kept in generations, one table each: `log` (the first, and the whole
/// log of files written before compaction existed), then `log.1`, `log.2`,
/// ... A generation is closed once it holds [`LOG_GENERATION`] entries, or
/// when a compaction finds it partly older than the compacted revision.
/// Compacting deletes the generations wholly older than the compacted
/// revision, one per write transaction: freeing a table walks its pages
/// once (~0.2 s per 100,000 job records in all), where removing entries one
/// by one cost 1.5 s per 100,000 under the writer lock.
fn log_name(generation: u64) -> String {
    if generation == 0 {
        "log".to_string()
    } else {
        format!("log.{generation}")
    }
}

/// The table of a log generation named `name` (see [`log_name`]).
fn log_table(name: &str) -> TableDefinition<'_, LogKey, LogEntry<'static>> {
    TableDefinition::new(name)
}

/// A number kept in the meta table (0 when absent).
fn meta_get(t: &impl ReadableTable<&'static str, u64>, key: &str) -> Result<u64, StoreError> {
    Ok(t.get(key).map_err(backend)?.map_or(0, |v| v.value()))
}

/// The oldest and the current generation of the log, as `meta` holds them.
fn generations(meta: &impl ReadableTable<&'static str, u64>) -> Result<(u64, u64), StoreError> {
    Ok((meta_get(meta, "log_first")?, meta_get(meta, "log_gen")?))
}

/// The watch event of a logged change: `value` set, or `None` for a delete.
fn log_event(key: &str, value: Option<&[u8]>, revision: u64) -> Event {
    match value {
        Some(v) => Event::Put(KeyValue {
            key: key.to_string(),
            value: v.to_vec(),
            mod_revision: revision,
        }),
        None => Event::Delete {
            key: key.to_string(),
            revision,
        },
    }
}

/// Entries in one generation of the change log: deleting one holds the
/// writer lock for 2-3 ms.
const LOG_GENERATION: u64 = 4_096;

/// The pause between two generations' deletions, for the writers waiting.
const COMPACT_PAUSE: std::time::Duration = std::time::Duration::from_millis(5);

/// Past this many logged changes the overlay is written out (without an
/// fsync) even if nobody syncs: its memory stays bounded.
const OVERLAY_MAX_CHANGES: usize = 4096;

/// A key's latest (mod_revision, value) in the overlay, or `None` once
/// deleted.
type Pending = Option<(u64, Vec<u8>)>;

/// One layer's changes under a prefix, with the layer's revision.
type LayerChanges = (Vec<(String, Pending)>, Option<u64>);

/// Deferred changes not yet written to the file.
#[derive(Default)]
struct Overlay {
    /// key → its latest state.
    kv: BTreeMap<String, Pending>,
    /// The changes in revision order, for the file's log and for watchers.
    log: Vec<(LogKey, String, Option<Vec<u8>>)>,
    /// The revision of the last deferred change.
    revision: Option<u64>,
}

impl Overlay {
    fn is_empty(&self) -> bool {
        self.log.is_empty()
    }

    /// Puts `older`'s changes back under this overlay's (a failed flush's,
    /// for the next one).
    fn restore_under(&mut self, older: &Overlay) {
        for (k, v) in &older.kv {
            self.kv.entry(k.clone()).or_insert_with(|| v.clone());
        }
        let newer = std::mem::replace(&mut self.log, older.log.clone());
        self.log.extend(newer);
        self.revision = self.revision.or(older.revision);
    }

    /// Writes every change into `w` (the caller commits it), closing the
    /// log's generation once it holds `generation` entries.
    fn write_into(&self, w: &redb::WriteTransaction, generation: u64) -> Result<(), StoreError> {
        let Some(revision) = self.revision else {
            return Ok(());
        };
        let mut kv = w.open_table(KV).map_err(backend)?;
        let mut meta = w.open_table(META).map_err(backend)?;
        let name = log_name(meta_get(&meta, "log_gen")?);
        let mut log = w.open_table(log_table(&name)).map_err(backend)?;
        for (k, v) in &self.kv {
            match v {
                Some((rev, val)) => {
                    kv.insert(k.as_str(), (*rev, val.as_slice()))
                        .map_err(backend)?;
                }
                None => {
                    kv.remove(k.as_str()).map_err(backend)?;
                }
            }
        }
        for (at, k, v) in &self.log {
            log.insert(*at, (k.as_str(), v.as_deref()))
                .map_err(backend)?;
        }
        meta.insert("revision", revision).map_err(backend)?;
        close_full_generation(&log, &mut meta, generation)
    }
}

/// The deferred changes not in the file: the overlay writers add to, and
/// the one a flush is writing out (until its commit lands).
#[derive(Default)]
struct Layers {
    current: Overlay,
    flushing: Option<Arc<Overlay>>,
}

impl Layers {
    /// The newest deferred state of `key`, with the revision of the layer
    /// holding it (for [`file_holds`]).
    fn find(&self, key: &str) -> Option<(Pending, Option<u64>)> {
        if let Some(p) = self.current.kv.get(key) {
            return Some((p.clone(), self.current.revision));
        }
        let f = self.flushing.as_ref()?;
        f.kv.get(key).map(|p| (p.clone(), f.revision))
    }

    /// The revision of the last deferred change, if any is not in the file.
    fn revision(&self) -> Option<u64> {
        self.current
            .revision
            .or_else(|| self.flushing.as_ref().and_then(|f| f.revision))
    }

    /// The layers, oldest first.
    fn oldest_first(&self) -> impl Iterator<Item = &Overlay> {
        self.flushing.as_deref().into_iter().chain([&self.current])
    }
}

/// Starts the next generation of the log once `log`, the current one,
/// holds `generation` entries.
fn close_full_generation(
    log: &redb::Table<'_, LogKey, LogEntry<'static>>,
    meta: &mut redb::Table<'_, &'static str, u64>,
    generation: u64,
) -> Result<(), StoreError> {
    if log.len().map_err(backend)? >= generation {
        let current = meta_get(meta, "log_gen")?;
        meta.insert("log_gen", current + 1).map_err(backend)?;
    }
    Ok(())
}

/// Whether the file, as `r` reads it, already holds an overlay read just
/// before at `overlay_rev`. The overlay is cleared only after the commit
/// that wrote it (with, perhaps, newer changes), so a read in between finds
/// both; then the file alone is the truth, since its revision is at least
/// the overlay's. Otherwise the file is as it was under the overlay.
fn file_holds(r: &redb::ReadTransaction, overlay_rev: Option<u64>) -> Result<bool, StoreError> {
    let Some(o) = overlay_rev else {
        return Ok(true);
    };
    Ok(revision_in(r)? >= o)
}

/// The revision the file holds, as `r` reads it.
fn revision_in(r: &redb::ReadTransaction) -> Result<u64, StoreError> {
    meta_get(&r.open_table(META).map_err(backend)?, "revision")
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

/// A store in one redb file.
pub struct RedbStore {
    db: Database,
    watchers: Mutex<Vec<(String, Sender<Event>)>>,
    /// Serialises writers so watchers see changes in revision order.
    write_lock: Mutex<()>,
    /// Serialises redb's write transactions that do not hold `write_lock`
    /// throughout (flushes), with those that do: taken before it.
    flush_lock: Mutex<()>,
    /// Deferred changes not yet in the file (the current layer changed
    /// under `write_lock`, the flushing one under `flush_lock`).
    layers: RwLock<Layers>,
    /// Deferred commits made (changed under `write_lock`), and how many of
    /// them a durable commit or flush has since made durable (under
    /// `flush_lock`).
    deferred: AtomicU64,
    durable: AtomicU64,
    /// Entries per log generation ([`LOG_GENERATION`]; smaller in tests).
    generation: u64,
}

impl RedbStore {
    /// Opens (or creates) the store at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let db = Database::create(path).map_err(backend)?;
        let w = db.begin_write().map_err(backend)?;
        {
            w.open_table(KV).map_err(backend)?;
            w.open_table(META).map_err(backend)?;
        }
        w.commit().map_err(backend)?;
        Ok(RedbStore {
            db,
            watchers: Mutex::new(Vec::new()),
            write_lock: Mutex::new(()),
            flush_lock: Mutex::new(()),
            layers: RwLock::new(Layers::default()),
            deferred: AtomicU64::new(0),
            durable: AtomicU64::new(0),
            generation: LOG_GENERATION,
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
    fn layers(&self) -> std::sync::RwLockReadGuard<'_, Layers> {
        self.layers.read().unwrap_or_else(|p| p.into_inner())
    }

    fn layers_mut(&self) -> std::sync::RwLockWriteGuard<'_, Layers> {
        self.layers.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The file's copy of `key`, ignoring the overlay.
    fn get_file(&self, key: &str) -> Result<Option<(u64, Vec<u8>)>, StoreError> {
        let r = self.db.begin_read().map_err(backend)?;
        let t = r.open_table(KV).map_err(backend)?;
        Ok(t.get(key).map_err(backend)?.map(|v| {
            let (rev, val) = v.value();
            (rev, val.to_vec())
        }))
    }

    /// The file's revision, ignoring the overlay.
    fn revision_file(&self) -> Result<u64, StoreError> {
        revision_in(&self.db.begin_read().map_err(backend)?)
    }

    /// The oldest revision a watch may start from.
    fn compacted(&self) -> Result<u64, StoreError> {
        let r = self.db.begin_read().map_err(backend)?;
        meta_get(&r.open_table(META).map_err(backend)?, "compacted")
    }

    /// Marks `below` as the oldest watchable revision and deletes the
    /// oldest log generation if all of it is older (closing it first if it
    /// is the current one; the current one, if only partly older, is closed
    /// for the next compaction), in one write transaction (the caller holds
    /// `flush_lock` and `write_lock`). Whether one was deleted: more may
    /// follow.
    fn compact_step(&self, below: u64) -> Result<bool, StoreError> {
        let mut w = self.db.begin_write().map_err(backend)?;
        // Nothing is lost if a crash undoes it: the next pass redoes it.
        w.set_durability(redb::Durability::None);
        let deleted;
        {
            let mut meta = w.open_table(META).map_err(backend)?;
            if meta_get(&meta, "compacted")? < below {
                meta.insert("compacted", below).map_err(backend)?;
            }
            let (first, current) = generations(&meta)?;
            let name = log_name(first);
            let (oldest, newest) = {
                let t = w.open_table(log_table(&name)).map_err(backend)?;
                let first = t.first().map_err(backend)?;
                let last = t.last().map_err(backend)?;
                (
                    first.map(|(k, _)| k.value().0),
                    last.map(|(k, _)| k.value().0),
                )
            };
            let old = match newest {
                Some(r) => r < below,
                // An empty generation goes unless it is the one written to.
                None => first < current,
            };
            // The one written to, wholly or partly compacted, is closed: a
            // wholly old one to be deleted now, a partly old one so that the
            // next compaction can delete it however few it holds.
            if first == current && oldest.is_some_and(|r| r < below) {
                meta.insert("log_gen", current + 1).map_err(backend)?;
            }
            if old {
                w.delete_table(log_table(&name)).map_err(backend)?;
                meta.insert("log_first", first + 1).map_err(backend)?;
            }
            deleted = old;
        }
        w.commit().map_err(backend)?;
        Ok(deleted)
    }

    /// A deferred transaction: applied to the overlay (the caller holds
    /// `write_lock`). Also whether the overlay is full (the caller writes
    /// it out once it has released `write_lock`).
    fn commit_deferred(
        &self,
        compares: &[Compare],
        ops: &[Op],
    ) -> Result<(TxnResult, bool), StoreError> {
        let mut layers = self.layers_mut();
        let current = match layers.revision() {
            Some(r) => r,
            None => self.revision_file()?,
        };
        // The latest revision of a key: the layers first, then the file
        // (which a flush landing meanwhile changes only in keys the
        // flushing layer holds).
        let rev_of = |l: &Layers, k: &str| -> Result<Option<u64>, StoreError> {
            match l.find(k) {
                Some((v, _)) => Ok(v.as_ref().map(|(r, _)| *r)),
                None => Ok(self.get_file(k)?.map(|(r, _)| r)),
            }
        };
        for c in compares {
            let holds = match c {
                Compare::Absent(k) => rev_of(&layers, k)?.is_none(),
                Compare::Revision(k, r) => rev_of(&layers, k)? == Some(*r),
            };
            if !holds {
                let r = TxnResult {
                    succeeded: false,
                    revision: current,
                };
                return Ok((r, false));
            }
        }
        if ops.is_empty() {
            let r = TxnResult {
                succeeded: true,
                revision: current,
            };
            return Ok((r, false));
        }
        let revision = current + 1;
        let mut events = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let at = (revision, i as u32);
            match op {
                Op::Put(k, v) => {
                    let ov = &mut layers.current;
                    ov.kv.insert(k.clone(), Some((revision, v.clone())));
                    ov.log.push((at, k.clone(), Some(v.clone())));
                    events.push(Event::Put(KeyValue {
                        key: k.clone(),
                        value: v.clone(),
                        mod_revision: revision,
                    }));
                }
                Op::Delete(k) => {
                    if rev_of(&layers, k)?.is_some() {
                        let ov = &mut layers.current;
                        ov.kv.insert(k.clone(), None);
                        ov.log.push((at, k.clone(), None));
                        events.push(Event::Delete {
                            key: k.clone(),
                            revision,
                        });
                    }
                }
            }
        }
        layers.current.revision = Some(revision);
        let full = layers.current.log.len() >= OVERLAY_MAX_CHANGES;
        drop(layers);
        self.deferred.fetch_add(1, Ordering::SeqCst);
        self.notify(&events);
        let r = TxnResult {
            succeeded: true,
            revision,
        };
        Ok((r, full))
    }

    /// Writes the overlay to the file in one transaction, with an fsync if
    /// `durable` (the caller holds `flush_lock`, not `write_lock`). The
    /// writer lock is held only to take the overlay, which readers still
    /// see as the flushing layer until the commit lands; a failed flush
    /// puts it back under the changes made meanwhile.
    fn flush(&self, durable: bool) -> Result<(), StoreError> {
        let (made, mut w, taken) = {
            let _guard = self.write_lock.lock().map_err(backend)?;
            let made = self.deferred.load(Ordering::SeqCst);
            // Never waits: every other redb writer holds `write_lock` or
            // `flush_lock` throughout.
            let w = self.db.begin_write().map_err(backend)?;
            let mut layers = self.layers_mut();
            let taken = Arc::new(std::mem::take(&mut layers.current));
            layers.flushing = Some(taken.clone());
            (made, w, taken)
        };
        if !durable {
            w.set_durability(redb::Durability::None);
        }
        let written = taken
            .write_into(&w, self.generation)
            .and_then(|()| w.commit().map_err(backend));
        let mut layers = self.layers_mut();
        layers.flushing = None;
        if let Err(e) = written {
            layers.current.restore_under(&taken);
            return Err(e);
        }
        drop(layers);
        if durable {
            self.durable.fetch_max(made, Ordering::SeqCst);
        }
        Ok(())
    }

    /// One write transaction committed with an fsync, carrying the overlay
    /// before it.
    fn commit(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError> {
        let w = self.db.begin_write().map_err(backend)?;
        // No flush is in flight (the caller holds `flush_lock`).
        let had_overlay = {
            let layers = self.layers();
            layers.current.write_into(&w, self.generation)?;
            !layers.current.is_empty()
        };
        let mut events = Vec::new();
        let revision;
        let succeeded;
        {
            let mut kv = w.open_table(KV).map_err(backend)?;
            let mut meta = w.open_table(META).map_err(backend)?;
            let current = meta_get(&meta, "revision")?;
            let name = log_name(meta_get(&meta, "log_gen")?);
            let mut log = w.open_table(log_table(&name)).map_err(backend)?;
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
                close_full_generation(&log, &mut meta, self.generation)?;
            }
        }
        if (succeeded && !ops.is_empty()) || had_overlay {
            let made = self.deferred.load(Ordering::SeqCst);
            w.commit().map_err(backend)?;
            // Everything committed before is durable with it.
            self.durable.fetch_max(made, Ordering::SeqCst);
            self.layers_mut().current = Overlay::default();
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
        let pending = self.layers().find(key);
        let r = self.db.begin_read().map_err(backend)?;
        let found = match pending {
            Some((p, layer_rev)) if !file_holds(&r, layer_rev)? => p,
            _ => {
                let t = r.open_table(KV).map_err(backend)?;
                let v = t.get(key).map_err(backend)?;
                v.map(|v| {
                    let (rev, val) = v.value();
                    (rev, val.to_vec())
                })
            }
        };
        Ok(found.map(|(mod_revision, value)| KeyValue {
            key: key.to_string(),
            value,
            mod_revision,
        }))
    }

    fn range(&self, prefix: &str) -> Result<Vec<KeyValue>, StoreError> {
        // Each layer's changes under the prefix, oldest layer first.
        let layers: Vec<LayerChanges> = self
            .layers()
            .oldest_first()
            .map(|ov| {
                let p = ov
                    .kv
                    .range(prefix.to_string()..)
                    .take_while(|(k, _)| k.starts_with(prefix))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                (p, ov.revision)
            })
            .collect();
        let r = self.db.begin_read().map_err(backend)?;
        let mut pending = Vec::new();
        for (p, layer_rev) in layers {
            if !file_holds(&r, layer_rev)? {
                pending.extend(p);
            }
        }
        let t = r.open_table(KV).map_err(backend)?;
        let mut out = BTreeMap::new();
        for item in t.range(prefix..).map_err(backend)? {
            let (k, v) = item.map_err(backend)?;
            let key = k.value();
            if !key.starts_with(prefix) {
                break;
            }
            let (rev, val) = v.value();
            out.insert(key.to_string(), (rev, val.to_vec()));
        }
        for (k, v) in pending {
            match v {
                Some(v) => out.insert(k, v),
                None => out.remove(&k),
            };
        }
        Ok(out
            .into_iter()
            .map(|(key, (mod_revision, value))| KeyValue {
                key,
                value,
                mod_revision,
            })
            .collect())
    }

    fn txn(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError> {
        let _flushes = self.flush_lock.lock().map_err(backend)?;
        let _guard = self.write_lock.lock().map_err(backend)?;
        self.commit(compares, ops)
    }

    fn txn_deferred(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError> {
        let (r, full) = {
            let _guard = self.write_lock.lock().map_err(backend)?;
            self.commit_deferred(compares, ops)?
        };
        if full {
            // Written out without an fsync: still deferred until a sync.
            let _flushes = self.flush_lock.lock().map_err(backend)?;
            self.flush(false)?;
        }
        Ok(r)
    }

    fn sync(&self) -> Result<(), StoreError> {
        let target = self.deferred.load(Ordering::SeqCst);
        if self.durable.load(Ordering::SeqCst) >= target {
            return Ok(());
        }
        let _flushes = self.flush_lock.lock().map_err(backend)?;
        // Whoever flushed before may have flushed for us.
        if self.durable.load(Ordering::SeqCst) >= target {
            return Ok(());
        }
        self.flush(true)
    }

    fn revision(&self) -> Result<u64, StoreError> {
        // The layers' first: a commit carrying them may land in between,
        // and then the file's is at least as new.
        let overlay_rev = self.layers().revision();
        Ok(self.revision_file()?.max(overlay_rev.unwrap_or(0)))
    }

    /// Deletes the file's log generations older than `revision`, one per
    /// hold of the writer lock; the overlay's changes (newer than anything
    /// in the file) stay until written out and compacted by a later call.
    /// Entries older than `revision` in a generation that also holds newer
    /// ones stay until a later compaction; no watch can reach them.
    fn compact(&self, revision: u64) -> Result<(), StoreError> {
        loop {
            {
                let _flushes = self.flush_lock.lock().map_err(backend)?;
                let _guard = self.write_lock.lock().map_err(backend)?;
                let below = revision.min(self.revision_file()?.saturating_add(1));
                if below == 0 || !self.compact_step(below)? {
                    return Ok(());
                }
            }
            // The lock is not fair: without a pause this loop would take it
            // back before a waiting writer wakes, and hold it throughout.
            std::thread::sleep(COMPACT_PAUSE);
        }
    }

    fn watch(&self, prefix: &str, from: u64) -> Result<Receiver<Event>, StoreError> {
        // Hold the write lock so no change falls between the replay and the subscription.
        let _guard = self.write_lock.lock().map_err(backend)?;
        let oldest = self.compacted()?;
        if from < oldest {
            return Err(StoreError::Compacted {
                requested: from,
                oldest: Some(oldest),
            });
        }
        let (tx, rx) = channel();
        // The flushing layer before the file: one landing in between is
        // then in the file read next, and replayed from there alone. (The
        // current layer cannot change, nor be taken by a flush: this holds
        // the writer lock.)
        let flushing = self.layers().flushing.clone();
        let r = self.db.begin_read().map_err(backend)?;
        let (first, current) = generations(&r.open_table(META).map_err(backend)?)?;
        for generation in first..=current {
            let name = log_name(generation);
            let log = match r.open_table(log_table(&name)) {
                Ok(t) => t,
                // Made on its first write.
                Err(redb::TableError::TableDoesNotExist(_)) => continue,
                Err(e) => return Err(backend(e)),
            };
            for item in log.range((from, 0)..).map_err(backend)? {
                let (at, entry) = item.map_err(backend)?;
                let (rev, _) = at.value();
                let (key, val) = entry.value();
                if key.starts_with(prefix) {
                    let _ = tx.send(log_event(key, val, rev));
                }
            }
        }
        // Then the deferred changes not yet in the file's log.
        let flushing = match flushing {
            Some(f) if !file_holds(&r, f.revision)? => Some(f),
            _ => None,
        };
        let layers = self.layers();
        let logs = flushing.as_deref().into_iter().chain([&layers.current]);
        for ((rev, _), key, val) in logs.flat_map(|ov| &ov.log) {
            if *rev >= from && key.starts_with(prefix) {
                let _ = tx.send(log_event(key, val.as_deref(), *rev));
            }
        }
        drop(layers);
        self.watchers
            .lock()
            .map_err(backend)?
            .push((prefix.to_string(), tx));
        Ok(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_run_of_deferred_writes_is_written_out_before_the_overlay_grows_past_its_bound() {
        let dir = tempfile::tempdir().expect("tmp");
        let s = RedbStore::open(&dir.path().join("s.redb")).expect("open");
        let n = OVERLAY_MAX_CHANGES * 2 + 10;
        for i in 0..n {
            let key = format!("/k/{i:06}");
            s.txn_deferred(&[], &[Op::Put(key, vec![1])]).expect("txn");
            assert!(s.layers().current.log.len() < OVERLAY_MAX_CHANGES);
        }
        // Written out but not yet durable: a sync still has work to do.
        assert!(s.durable.load(Ordering::SeqCst) < s.deferred.load(Ordering::SeqCst));
        assert_eq!(s.range("/k/").expect("range").len(), n);
        assert_eq!(s.revision().expect("rev"), n as u64);
        s.sync().expect("sync");
        assert!(s.layers().current.is_empty());
        assert_eq!(
            s.durable.load(Ordering::SeqCst),
            s.deferred.load(Ordering::SeqCst)
        );
        drop(s);
        let s = RedbStore::open(&dir.path().join("s.redb")).expect("reopen");
        assert_eq!(s.range("/k/").expect("range").len(), n);
    }

    /// A read that falls between a durable commit carrying the overlay
    /// (with a newer write of the same key) and the overlay's clearing
    /// sees the newer write, not the overlay's older one.
    #[test]
    fn a_read_between_the_commit_and_the_overlay_clearing_sees_the_newer_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let s = RedbStore::open(&dir.path().join("s.redb")).expect("open");
        s.txn_deferred(&[], &[Op::Put("/k".into(), b"old".to_vec())])
            .expect("deferred");
        // What `commit` does before it clears the overlay: the overlay and
        // a newer write of the key in one committed transaction.
        let w = s.db.begin_write().expect("write");
        s.layers()
            .current
            .write_into(&w, s.generation)
            .expect("overlay");
        {
            let mut kv = w.open_table(KV).expect("kv");
            kv.insert("/k", (2, b"new".as_slice())).expect("put");
            let mut meta = w.open_table(META).expect("meta");
            meta.insert("revision", 2).expect("rev");
        }
        w.commit().expect("commit");
        assert!(
            !s.layers().current.is_empty(),
            "the overlay is not cleared yet"
        );
        let got = s.get("/k").expect("get").expect("present");
        assert_eq!(
            (got.value.as_slice(), got.mod_revision),
            (b"new".as_slice(), 2)
        );
        let range = s.range("/").expect("range");
        assert_eq!(range.len(), 1);
        assert_eq!(
            (range[0].value.as_slice(), range[0].mod_revision),
            (b"new".as_slice(), 2)
        );
        assert_eq!(s.revision().expect("revision"), 2);
    }

    /// Takes the overlay as a flush does, without writing it yet: what
    /// readers and writers meet while a flush is in flight.
    fn take_for_flush(s: &RedbStore) -> Arc<Overlay> {
        let mut l = s.layers_mut();
        let taken = Arc::new(std::mem::take(&mut l.current));
        l.flushing = Some(taken.clone());
        taken
    }

    /// While a flush is in flight, reads, compares and watches see its
    /// changes and the newer ones made meanwhile; once it lands, the file
    /// holds its changes and the newer ones stay deferred until a sync.
    #[test]
    fn reads_writes_and_watches_go_on_while_a_flush_is_in_flight() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("s.redb");
        let s = RedbStore::open(&path).expect("open");
        s.txn(&[], &[Op::Put("/k/a".into(), b"a0".to_vec())])
            .expect("durable");
        let r1 = s
            .txn_deferred(&[], &[Op::Put("/k/a".into(), b"a1".to_vec())])
            .expect("deferred")
            .revision;
        s.txn_deferred(&[], &[Op::Put("/k/b".into(), b"b1".to_vec())])
            .expect("deferred");
        let taken = take_for_flush(&s);
        // A compare on the flushing layer's revision holds; the write goes
        // into a fresh overlay over it.
        let r3 = s
            .txn_deferred(
                &[Compare::Revision("/k/a".into(), r1)],
                &[
                    Op::Put("/k/a".into(), b"a2".to_vec()),
                    Op::Delete("/k/b".into()),
                ],
            )
            .expect("deferred over a flush");
        assert!(r3.succeeded);
        let seen = |s: &RedbStore| {
            let rows: Vec<(String, Vec<u8>)> = s
                .range("/k/")
                .expect("range")
                .into_iter()
                .map(|kv| (kv.key, kv.value))
                .collect();
            assert_eq!(rows, vec![("/k/a".to_string(), b"a2".to_vec())]);
            assert_eq!(s.get("/k/b").expect("get"), None);
            assert_eq!(s.revision().expect("rev"), r3.revision);
            let rx = s.watch("/k/", r1).expect("watch");
            let revs: Vec<u64> = rx.try_iter().map(|e| e.revision()).collect();
            assert_eq!(revs, vec![r1, r1 + 1, r3.revision, r3.revision]);
        };
        seen(&s);
        // The flush lands: the file holds its changes, the layer goes.
        let w = s.db.begin_write().expect("write");
        taken.write_into(&w, s.generation).expect("write");
        w.commit().expect("commit");
        seen(&s);
        s.layers_mut().flushing = None;
        seen(&s);
        s.sync().expect("sync");
        drop(s);
        let s = RedbStore::open(&path).expect("reopen");
        seen(&s);
    }

    /// A flush that fails puts its changes back under the ones made since:
    /// the next sync writes them all, the newer winning.
    #[test]
    fn a_failed_flush_puts_its_changes_back_under_the_newer_ones() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("s.redb");
        let s = RedbStore::open(&path).expect("open");
        s.txn_deferred(&[], &[Op::Put("/k/a".into(), b"a1".to_vec())])
            .expect("deferred");
        s.txn_deferred(&[], &[Op::Put("/k/b".into(), b"b1".to_vec())])
            .expect("deferred");
        let taken = take_for_flush(&s);
        s.txn_deferred(&[], &[Op::Put("/k/a".into(), b"a2".to_vec())])
            .expect("deferred");
        // What `flush` does when its commit fails.
        {
            let mut l = s.layers_mut();
            l.flushing = None;
            l.current.restore_under(&taken);
        }
        let revs: Vec<u64> = s.layers().current.log.iter().map(|(at, ..)| at.0).collect();
        assert_eq!(revs, vec![1, 2, 3], "older changes first");
        s.sync().expect("sync");
        drop(s);
        let s = RedbStore::open(&path).expect("reopen");
        let rows: Vec<(String, Vec<u8>, u64)> = s
            .range("/k/")
            .expect("range")
            .into_iter()
            .map(|kv| (kv.key, kv.value, kv.mod_revision))
            .collect();
        assert_eq!(
            rows,
            vec![
                ("/k/a".to_string(), b"a2".to_vec(), 3),
                ("/k/b".to_string(), b"b1".to_vec(), 2)
            ]
        );
        let replayed = s.watch("/k/", 1).expect("watch").try_iter().count();
        assert_eq!(replayed, 3);
    }

    /// Writers incrementing counters by compare-and-swap, deferred, while
    /// others sync and read: no increment is lost or applied twice, a
    /// counter never reads lower than before, and what the last sync made
    /// durable survives a reopen.
    #[test]
    fn concurrent_deferred_writers_syncs_and_readers_agree() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("s.redb");
        let s = Arc::new(RedbStore::open(&path).expect("open"));
        const WRITERS: usize = 4;
        const INCREMENTS: u64 = 300;
        let key = |w: usize| format!("/c/{w}");
        let value = |s: &RedbStore, k: &str| -> (u64, Option<u64>) {
            match s.get(k).expect("get") {
                Some(kv) => {
                    let n = u64::from_le_bytes(kv.value.try_into().expect("8 bytes"));
                    (n, Some(kv.mod_revision))
                }
                None => (0, None),
            }
        };
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let s = s.clone();
                std::thread::spawn(move || {
                    let k = key(w);
                    let mut done = 0;
                    while done < INCREMENTS {
                        let (n, rev) = value(&s, &k);
                        let cmp = match rev {
                            Some(r) => Compare::Revision(k.clone(), r),
                            None => Compare::Absent(k.clone()),
                        };
                        let put = Op::Put(k.clone(), (n + 1).to_le_bytes().to_vec());
                        if s.txn_deferred(&[cmp], &[put]).expect("txn").succeeded {
                            done += 1;
                        }
                        if done % 7 == 0 {
                            s.sync().expect("sync");
                        }
                    }
                })
            })
            .collect();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (s, stop) = (s.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut last = [0u64; WRITERS];
                    while !stop.load(Ordering::SeqCst) {
                        for (w, seen) in last.iter_mut().enumerate() {
                            let (n, _) = value(&s, &key(w));
                            assert!(n >= *seen, "counter {w} went back from {seen} to {n}");
                            *seen = n;
                        }
                        let all = s.range("/c/").expect("range").len();
                        assert!(all <= WRITERS);
                        s.sync().expect("sync");
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().expect("writer");
        }
        stop.store(true, Ordering::SeqCst);
        for r in readers {
            r.join().expect("reader");
        }
        s.sync().expect("sync");
        let revision = s.revision().expect("rev");
        assert_eq!(revision, WRITERS as u64 * INCREMENTS);
        drop(s);
        let s = RedbStore::open(&path).expect("reopen");
        for w in 0..WRITERS {
            assert_eq!(value(&s, &key(w)).0, INCREMENTS);
        }
        assert_eq!(s.revision().expect("rev"), revision);
        let replayed = s.watch("/c/", 1).expect("watch").try_iter().count() as u64;
        assert_eq!(replayed, revision);
    }

    /// Entries in every log generation of the file.
    fn log_len(s: &RedbStore) -> u64 {
        let r = s.db.begin_read().expect("read");
        let (first, current) =
            generations(&r.open_table(META).expect("meta")).expect("generations");
        (first..=current)
            .filter_map(|g| r.open_table(log_table(&log_name(g))).ok())
            .map(|t| t.len().expect("len"))
            .sum()
    }

    /// Compaction deletes the log generations wholly older than the
    /// revision, keeps one that also holds newer changes (a watch still
    /// cannot start before the revision) until a later compaction, leaves
    /// the overlay's changes to replay, and is remembered across a reopen.
    #[test]
    fn compaction_drops_whole_log_generations_and_survives_a_reopen() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("s.redb");
        let mut s = RedbStore::open(&path).expect("open");
        s.generation = 600;
        let s = s;
        let write = |n: usize| {
            let ops: Vec<Op> = (0..n)
                .map(|i| Op::Put(format!("/k/{}", i % 300), vec![1; 64]))
                .collect();
            for batch in ops.chunks(100) {
                s.txn(&[], batch).expect("txn");
            }
            s.revision().expect("rev")
        };
        let head = write(1000);
        s.txn_deferred(&[], &[Op::Put("/k/new".into(), vec![2])])
            .expect("deferred");
        assert_eq!(log_len(&s), 1000);
        // Past the head: the file's log goes, the overlay's change stays.
        s.compact(u64::MAX).expect("compact");
        assert_eq!(log_len(&s), 0);
        assert_eq!(s.compacted().expect("marker"), head + 1);
        let rx = s.watch("/k/", head + 1).expect("watch the overlay");
        let e = rx.try_recv().expect("the deferred change replays");
        assert_eq!(e.revision(), head + 1);
        assert_eq!(s.range("/k/").expect("range").len(), 301);
        drop(rx);
        s.sync().expect("sync");
        // A generation holding revisions on both sides of the compacted one
        // stays whole; a watch from it replays from the revision on.
        let a_head = write(1000);
        s.compact(a_head - 4).expect("compact");
        assert_eq!(log_len(&s), 1001);
        assert!(matches!(
            s.watch("/k/", a_head - 5),
            Err(StoreError::Compacted { .. })
        ));
        let rx = s.watch("/k/", a_head - 4).expect("watch");
        let first = rx.try_recv().expect("replay").revision();
        assert_eq!(first, a_head - 4);
        assert_eq!(rx.try_iter().count(), 5 * 100 - 1);
        drop(rx);
        // Once a later compaction passes it, it goes whole; the next one,
        // closed at 600 entries, holds the compacted revision and stays.
        let b_head = write(500);
        s.compact(a_head + 1).expect("compact");
        assert_eq!(log_len(&s), 900);
        drop(s);
        let s = RedbStore::open(&path).expect("reopen");
        assert_eq!(s.range("/k/").expect("range").len(), 301);
        assert_eq!(log_len(&s), 900);
        assert!(matches!(
            s.watch("/k/", a_head),
            Err(StoreError::Compacted {
                oldest: Some(o),
                ..
            }) if o == a_head + 1
        ));
        let rx = s.watch("/k/", a_head + 1).expect("watch");
        assert_eq!(rx.try_iter().last().map(|e| e.revision()), Some(b_head));
    }
}
