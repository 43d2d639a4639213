//! The etcd backend: the same interface on an etcd cluster, for several
//! server replicas. etcd's revisions are the store's revisions; every key
//! lives under a namespace so one etcd can hold several clusters (and tests).
//!
//! The interface is synchronous; calls run on a small runtime of the store's
//! own, so they work from any thread, async or not.
//!
//! A leader *fences* its writes ([`EtcdStore::fence`]): each transaction also
//! requires that the leader key still has the create revision it had when this
//! replica won. A deposed leader's writes then fail with
//! [`StoreError::NotLeader`] and change nothing.

use crate::{Compare, Event, KeyValue, Op, Store, StoreError, TxnResult};
use etcd_client::{
    Client, CompactionOptions, Compare as ECompare, CompareOp, ConnectOptions, EventType,
    GetOptions, Txn, TxnOp, WatchOptions,
};
use std::future::Future;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A store on etcd.
#[derive(Clone)]
pub struct EtcdStore {
    inner: Arc<Inner>,
}

struct Inner {
    rt: Mutex<Option<tokio::runtime::Runtime>>,
    handle: tokio::runtime::Handle,
    client: Client,
    ns: String,
    /// (leader key, its create revision) while this replica leads.
    fence: Mutex<Option<(String, i64)>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.lock().ok().and_then(|mut g| g.take()) {
            rt.shutdown_background();
        }
    }
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(format!("etcd: {e}"))
}

/// The first key after every key that starts with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

impl EtcdStore {
    /// Connects to `endpoints` (`http://host:2379`, ...), keeping every key
    /// under `namespace` (e.g. `/gangway`).
    pub fn connect(endpoints: &[String], namespace: &str) -> Result<Self, StoreError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("etcd-store")
            .enable_all()
            .build()
            .map_err(backend)?;
        let handle = rt.handle().clone();
        let eps = endpoints.to_vec();
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2));
        let client = run_on(
            &handle,
            async move { Client::connect(eps, Some(opts)).await },
        )
        .map_err(backend)?;
        let store = EtcdStore {
            inner: Arc::new(Inner {
                rt: Mutex::new(Some(rt)),
                handle,
                client,
                ns: namespace.trim_end_matches('/').to_string(),
                fence: Mutex::new(None),
            }),
        };
        // Fail now, with the reason, when etcd is not there.
        store.revision()?;
        Ok(store)
    }

    fn key(&self, k: &str) -> String {
        format!("{}{k}", self.inner.ns)
    }

    fn strip(&self, k: &[u8]) -> String {
        let k = String::from_utf8_lossy(k);
        k.strip_prefix(&self.inner.ns).unwrap_or(&k).to_string()
    }

    fn kv(&self, kv: &etcd_client::KeyValue) -> KeyValue {
        KeyValue {
            key: self.strip(kv.key()),
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision() as u64,
        }
    }

    fn call<T: Send + 'static>(
        &self,
        f: impl Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
    ) -> Result<T, StoreError> {
        run_on(&self.inner.handle, f).map_err(backend)
    }

    /// The raw client (leader election uses leases directly).
    pub fn client(&self) -> Client {
        self.inner.client.clone()
    }

    /// Runs a future on the store's runtime and waits for it.
    pub fn block_on<T: Send + 'static>(&self, f: impl Future<Output = T> + Send + 'static) -> T {
        run_on(&self.inner.handle, f)
    }

    /// The full etcd key of a store key.
    pub fn full_key(&self, k: &str) -> String {
        self.key(k)
    }

    /// From now on every write requires that `leader_key` (a store key) still
    /// has `create_revision`; `None` lifts the fence.
    pub fn fence(&self, leader: Option<(&str, i64)>) {
        if let Ok(mut f) = self.inner.fence.lock() {
            *f = leader.map(|(k, r)| (self.key(k), r));
        }
    }
}

impl EtcdStore {
    /// The etcd transaction for `compares` and `ops` under this replica's
    /// fence, and the fence it carries.
    fn prepare(&self, compares: &[Compare], ops: &[Op]) -> (Txn, Option<(String, i64)>) {
        let mut when: Vec<ECompare> = Vec::new();
        for c in compares {
            match c {
                Compare::Absent(k) => {
                    when.push(ECompare::create_revision(self.key(k), CompareOp::Equal, 0))
                }
                Compare::Revision(k, r) => {
                    when.push(ECompare::mod_revision(
                        self.key(k),
                        CompareOp::Equal,
                        *r as i64,
                    ));
                    if *r == 0 {
                        // etcd sees a missing key at revision 0; ours requires the key.
                        when.push(ECompare::create_revision(
                            self.key(k),
                            CompareOp::Greater,
                            0,
                        ));
                    }
                }
            }
        }
        let fence = self.inner.fence.lock().ok().and_then(|f| f.clone());
        if let Some((k, r)) = &fence {
            when.push(ECompare::create_revision(k.clone(), CompareOp::Equal, *r));
        }
        let then: Vec<TxnOp> = ops
            .iter()
            .map(|o| match o {
                Op::Put(k, v) => TxnOp::put(self.key(k), v.clone(), None),
                Op::Delete(k) => TxnOp::delete(self.key(k), None),
            })
            .collect();
        // On failure read the leader key, to tell a lost leadership from a conflict.
        let mut otherwise = Vec::new();
        if let Some((k, _)) = &fence {
            otherwise.push(TxnOp::get(k.clone(), None));
        }
        (
            Txn::new().when(when).and_then(then).or_else(otherwise),
            fence,
        )
    }
}

/// What etcd's answer to a transaction of `n_ops` operations, sent under
/// `fence`, means for the caller.
fn answer(
    r: Result<etcd_client::TxnResponse, etcd_client::Error>,
    n_ops: usize,
    fence: Option<(String, i64)>,
) -> Result<TxnResult, StoreError> {
    let r = r.map_err(|e| {
        let msg = e.to_string();
        if msg.contains("too many operations") || msg.contains("request is too large") {
            StoreError::Backend(format!(
                "etcd refused a transaction of {n_ops} operations ({msg}): Gangway splits \
                 its batches to fit etcd's default limits (128 operations, 1.5 MiB); \
                 was --max-txn-ops or --max-request-bytes set below them?"
            ))
        } else {
            backend(msg)
        }
    })?;
    let revision = r.header().map_or(0, |h| h.revision()) as u64;
    if !r.succeeded() {
        if let Some((_, want)) = &fence {
            let now = r.op_responses().into_iter().find_map(|op| match op {
                etcd_client::TxnOpResponse::Get(g) => {
                    Some(g.kvs().first().map_or(0, |kv| kv.create_revision()))
                }
                _ => None,
            });
            if now != Some(*want) {
                return Err(StoreError::NotLeader);
            }
        }
    }
    Ok(TxnResult {
        succeeded: r.succeeded(),
        revision,
    })
}

/// Whether etcd refused because the revision is compacted.
fn is_compacted(e: &etcd_client::Error) -> bool {
    e.to_string()
        .contains("required revision has been compacted")
}

fn run_on<T: Send + 'static>(
    handle: &tokio::runtime::Handle,
    f: impl Future<Output = T> + Send + 'static,
) -> T {
    let (tx, rx) = channel();
    handle.spawn(async move {
        let _ = tx.send(f.await);
    });
    // The runtime outlives every store handle, so the answer always comes.
    match rx.recv() {
        Ok(v) => v,
        Err(_) => panic!("the etcd store's runtime stopped"),
    }
}

impl Store for EtcdStore {
    fn txn_limits(&self) -> crate::TxnLimits {
        crate::TxnLimits::ETCD_DEFAULT
    }

    fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        let mut c = self.inner.client.clone();
        let k = self.key(key);
        let r = self.call(async move { c.get(k, None).await })?;
        Ok(r.kvs().first().map(|kv| self.kv(kv)))
    }

    fn range(&self, prefix: &str) -> Result<Vec<KeyValue>, StoreError> {
        const PAGE: i64 = 1000;
        let full = self.key(prefix).into_bytes();
        let end = prefix_end(&full);
        let mut start = full.clone();
        let mut rev = 0i64;
        let mut out = Vec::new();
        loop {
            let mut c = self.inner.client.clone();
            let (s, e) = (start.clone(), end.clone());
            // Later pages read at the first page's revision: one consistent snapshot.
            let mut opts = GetOptions::new().with_range(e).with_limit(PAGE);
            if rev > 0 {
                opts = opts.with_revision(rev);
            }
            let r = self.call(async move { c.get(s, Some(opts)).await })?;
            if rev == 0 {
                rev = r.header().map_or(0, |h| h.revision());
            }
            let kvs = r.kvs();
            out.extend(kvs.iter().map(|kv| self.kv(kv)));
            match kvs.last() {
                Some(last) if r.more() => {
                    start = last.key().to_vec();
                    start.push(0);
                }
                _ => return Ok(out),
            }
        }
    }

    fn txn(&self, compares: &[Compare], ops: &[Op]) -> Result<TxnResult, StoreError> {
        let (txn, fence) = self.prepare(compares, ops);
        let n_ops = ops.len();
        let mut c = self.inner.client.clone();
        let r = run_on(&self.inner.handle, async move { c.txn(txn).await });
        answer(r, n_ops, fence)
    }

    /// Sends every transaction at once (etcd commits concurrent requests
    /// together), then reads each answer in order.
    fn txns_deferred(
        &self,
        txns: &[(Vec<Compare>, Vec<Op>)],
    ) -> Vec<Result<TxnResult, StoreError>> {
        let prepared: Vec<_> = txns
            .iter()
            .map(|(c, o)| {
                let (txn, fence) = self.prepare(c, o);
                (txn, fence, o.len())
            })
            .collect();
        let client = self.inner.client.clone();
        run_on(&self.inner.handle, async move {
            let sent: Vec<_> = prepared
                .into_iter()
                .map(|(txn, fence, n_ops)| {
                    let mut c = client.clone();
                    (tokio::spawn(async move { c.txn(txn).await }), fence, n_ops)
                })
                .collect();
            let mut out = Vec::with_capacity(sent.len());
            for (h, fence, n_ops) in sent {
                out.push(match h.await {
                    Ok(r) => answer(r, n_ops, fence),
                    Err(e) => Err(backend(e)),
                });
            }
            out
        })
    }

    fn revision(&self) -> Result<u64, StoreError> {
        let mut c = self.inner.client.clone();
        let k = self.key("/");
        let r =
            self.call(async move { c.get(k, Some(GetOptions::new().with_count_only())).await })?;
        Ok(r.header().map_or(0, |h| h.revision()) as u64)
    }

    /// etcd's compaction is of the whole etcd (every namespace on it), as
    /// kube-apiserver's is; it is logical (etcd frees the space in the
    /// background and reuses it; `etcdctl defrag` returns it to the disk).
    /// etcd compacted at R also drops the deletions made at R itself, so a
    /// watch from R would miss them: history before `revision` is
    /// forgotten by compacting etcd at `revision - 1` (found by the store
    /// model test: a key deleted at the compacted revision came back in
    /// the replay).
    fn compact(&self, revision: u64) -> Result<(), StoreError> {
        let current = self.revision()?;
        let to = revision.saturating_sub(1).min(current);
        if to == 0 {
            return Ok(());
        }
        let mut c = self.inner.client.clone();
        let r = run_on(&self.inner.handle, async move {
            c.compact(to as i64, Some(CompactionOptions::new())).await
        });
        match r {
            Ok(_) => Ok(()),
            // Already compacted there or later (by another replica, or by
            // etcd's own --auto-compaction): nothing older is left.
            Err(e) if is_compacted(&e) => Ok(()),
            Err(e) => Err(backend(e)),
        }
    }

    fn watch(&self, prefix: &str, from: u64) -> Result<Receiver<Event>, StoreError> {
        // etcd answers a watch from a compacted revision by cancelling it
        // later, on the stream; a read says so now. Compacted at R - 1 (see
        // `compact`), etcd still reads at R - 1: a watch from R is whole,
        // one from R - 1 is not and is refused by the read before it.
        if from > 0 {
            let mut c = self.inner.client.clone();
            let k = self.key(prefix);
            let opts = GetOptions::new()
                .with_revision(from.saturating_sub(1).max(1) as i64)
                .with_count_only();
            let r = run_on(
                &self.inner.handle,
                async move { c.get(k, Some(opts)).await },
            );
            match r {
                Err(e) if is_compacted(&e) => {
                    return Err(StoreError::Compacted {
                        requested: from,
                        oldest: None,
                    })
                }
                // A revision not yet written is fine for a watch.
                Err(e) if e.to_string().contains("future revision") => {}
                Err(e) => return Err(backend(e)),
                Ok(_) => {}
            }
        }
        let (tx, rx) = channel();
        let mut c = self.inner.client.clone();
        let k = self.key(prefix);
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(from as i64);
        let mut stream = self.call(async move { c.watch(k, Some(opts)).await })?;
        let me = self.clone();
        self.inner.handle.spawn(async move {
            while let Ok(Some(resp)) = stream.message().await {
                if resp.canceled() {
                    return;
                }
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let e = match ev.event_type() {
                        EventType::Put => Event::Put(me.kv(kv)),
                        EventType::Delete => Event::Delete {
                            key: me.strip(kv.key()),
                            revision: kv.mod_revision() as u64,
                        },
                    };
                    if tx.send(e).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn prefix_end_is_the_next_key_after_the_prefix() {
        assert_eq!(prefix_end(b"/jobs/"), b"/jobs0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }
}
