//! Prometheus metrics at `/metrics` (admin or metrics token), served from
//! the read view: a scrape reads the job counts the job table
//! keeps by state and queue and the GPU totals of the cluster snapshot, both
//! published with the view ([`Snapshot::of_view`]), sets the gauges
//! ([`Metrics::publish`]) and encodes them with the live counters. It takes
//! no state lock and walks no job, and it shows every change acknowledged
//! before it.

use crate::control::Control;
use crate::view::{LockUse, ReadView};
use gangway_core::gpu_fault_cause;
use gangway_store::Store;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels of the unhealthy-GPU gauge by cause.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabels {
    /// [`gpu_fault_cause`] of the GPU's reason.
    pub cause: String,
}

/// Labels of `gangway_probations_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `passed` or `failed`.
    pub result: String,
}

/// Labels of the per-state job gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JobLabels {
    /// Lifecycle state.
    pub state: String,
    /// Queue.
    pub queue: String,
}

/// Labels of API metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    /// Route template.
    pub route: String,
    /// HTTP status code.
    pub status: u16,
}

/// Labels of decision counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// `bind` or `preempt`.
    pub kind: String,
}

/// Labels of the state lock's figures.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LockLabels {
    /// Who held it ([`crate::view::Holder::name`]).
    pub holder: &'static str,
}

/// A counter of seconds.
type Seconds = Counter<f64, std::sync::atomic::AtomicU64>;

/// What `/metrics`' gauges show: read from the read view
/// ([`Snapshot::of_view`]), or from the locked state ([`Snapshot::gather`]),
/// never by walking the jobs (the job table keeps their counts).
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Jobs by (state, queue).
    pub jobs: Vec<(JobLabels, i64)>,
    /// GPUs bound to jobs.
    pub gpus_allocated: i64,
    /// Healthy free GPUs on schedulable nodes.
    pub gpus_free: i64,
    /// Unhealthy GPUs.
    pub gpus_unhealthy: i64,
    /// Unhealthy GPUs by the class of their reason ([`gpu_fault_cause`]).
    pub gpus_unhealthy_by_cause: Vec<(String, i64)>,
}

/// Unhealthy GPUs of `specs` by cause (only nodes with one are looked at).
fn by_cause<'a>(specs: impl Iterator<Item = &'a gangway_core::NodeSpec>) -> Vec<(String, i64)> {
    let mut out: std::collections::BTreeMap<String, i64> = std::collections::BTreeMap::new();
    for g in specs.flat_map(|s| s.gpus.iter()).filter(|g| !g.healthy) {
        let cause = gpu_fault_cause(g.reason.as_deref().unwrap_or(""));
        *out.entry(cause).or_default() += 1;
    }
    out.into_iter().collect()
}

impl Snapshot {
    /// Reads the job counts and GPU totals a read view published (no lock).
    pub fn of_view(v: &ReadView) -> Self {
        let jobs = crate::records::nonzero_counts(&v.job_counts)
            .map(|(state, queue, n)| {
                (
                    JobLabels {
                        state: format!("{state:?}").to_lowercase(),
                        queue: queue.to_string(),
                    },
                    n,
                )
            })
            .collect();
        let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        Snapshot {
            jobs,
            gpus_allocated: clamp(v.cluster.gpus_allocated),
            gpus_free: clamp(v.cluster.gpus_free),
            gpus_unhealthy: clamp(v.cluster.gpus_unhealthy),
            gpus_unhealthy_by_cause: if v.cluster.gpus_unhealthy == 0 {
                Vec::new()
            } else {
                by_cause(
                    v.cluster
                        .nodes
                        .iter()
                        .filter(|r| r.unhealthy > 0)
                        .map(|r| &r.spec),
                )
            },
        }
    }

    /// Reads the job counts [`crate::records::JobTable`] keeps and counts
    /// the GPUs of `c` (the caller holds the state lock; no job is walked):
    /// how the scheduler loop refreshed the gauges before they were read
    /// from the view (`gangway-bench dashboard` times both).
    pub fn gather<S: Store>(c: &Control<S>) -> Self {
        let jobs = c
            .jobs
            .counts()
            .map(|(state, queue, n)| {
                (
                    JobLabels {
                        state: format!("{state:?}").to_lowercase(),
                        queue: queue.to_string(),
                    },
                    n,
                )
            })
            .collect();
        Snapshot {
            jobs,
            ..Self::gather_gpus(c)
        }
    }

    fn gather_gpus<S: Store>(c: &Control<S>) -> Self {
        let unhealthy: u64 = c
            .cluster
            .nodes()
            .iter()
            .map(|n| n.spec.gpus.iter().filter(|g| !g.healthy).count() as u64)
            .sum();
        let allocated: u64 = c
            .cluster
            .capacity()
            .alloc
            .iter()
            .map(|m| u64::from(m.count_ones()))
            .sum();
        let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        Snapshot {
            jobs: Vec::new(),
            gpus_allocated: clamp(allocated),
            gpus_free: clamp(c.cluster.free_gpus()),
            gpus_unhealthy: clamp(unhealthy),
            gpus_unhealthy_by_cause: by_cause(c.cluster.nodes().iter().map(|n| &n.spec)),
        }
    }
}

/// All metrics.
pub struct Metrics {
    registry: Registry,
    jobs: Family<JobLabels, Gauge>,
    gpus_allocated: Gauge,
    gpus_free: Gauge,
    gpus_unhealthy: Gauge,
    gpus_unhealthy_by_cause: Family<CauseLabels, Gauge>,
    /// The causes the family last showed.
    causes_shown: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Scheduling cycle duration.
    pub cycle_seconds: Histogram,
    /// Decisions made.
    pub decisions: Family<DecisionLabels, Counter>,
    /// API requests.
    pub api_requests: Family<ApiLabels, Counter>,
    /// API latency.
    pub api_seconds: Histogram,
    /// Store write transactions committed.
    pub store_txns: Counter,
    /// Operations in those transactions (puts and deletes).
    pub store_ops: Counter,
    /// Compactions of the store's history (see `retention`).
    pub store_compactions: Counter,
    /// The revision the store's history was last compacted to.
    pub store_compacted_revision: Gauge,
    /// Nodes cordoned automatically for what they did (see `blame`).
    pub node_auto_cordons: Counter,
    /// 1 while auto-cordon is stopped because many nodes qualified at once.
    pub auto_cordon_halted: Gauge,
    /// Health checks of auto-cordoned nodes, by result (see `probation`).
    probations: Family<ResultLabels, Counter>,
    /// The (state, queue) pairs the job gauge last showed.
    job_labels: std::sync::Mutex<std::collections::HashSet<JobLabels>>,
    /// Times each holder took the state lock.
    lock_taken: Family<LockLabels, Counter>,
    /// Seconds each holder waited for it.
    lock_waited: Family<LockLabels, Seconds>,
    /// Seconds each holder held it.
    lock_held: Family<LockLabels, Seconds>,
    /// The lock's figures as last published (the counters add the rest).
    lock_shown: std::sync::Mutex<Vec<LockUse>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers everything.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gangway");
        let m = Metrics {
            jobs: Family::default(),
            gpus_allocated: Gauge::default(),
            gpus_free: Gauge::default(),
            gpus_unhealthy: Gauge::default(),
            gpus_unhealthy_by_cause: Family::default(),
            causes_shown: Default::default(),
            node_auto_cordons: Counter::default(),
            auto_cordon_halted: Gauge::default(),
            probations: Family::default(),
            cycle_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            decisions: Family::default(),
            api_requests: Family::default(),
            api_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            store_txns: Counter::default(),
            store_ops: Counter::default(),
            store_compactions: Counter::default(),
            store_compacted_revision: Gauge::default(),
            job_labels: Default::default(),
            lock_taken: Family::default(),
            lock_waited: Family::default(),
            lock_held: Family::default(),
            lock_shown: Default::default(),
            registry: Registry::default(),
        };
        registry.register("jobs", "Jobs by state and queue", m.jobs.clone());
        registry.register(
            "gpus_allocated",
            "GPUs bound to jobs",
            m.gpus_allocated.clone(),
        );
        registry.register(
            "gpus_free",
            "Healthy free GPUs on schedulable nodes",
            m.gpus_free.clone(),
        );
        registry.register("gpus_unhealthy", "Unhealthy GPUs", m.gpus_unhealthy.clone());
        registry.register(
            "gpus_unhealthy_by_cause",
            "Unhealthy GPUs by cause: xid_N, xid_unknown, gpu_lost, ecc_uncorrected, row_remapping_failed, row_remapping_pending, other",
            m.gpus_unhealthy_by_cause.clone(),
        );
        registry.register(
            "node_auto_cordons",
            "Nodes cordoned automatically for node-caused failures",
            m.node_auto_cordons.clone(),
        );
        registry.register(
            "auto_cordon_halted",
            "1 while auto-cordon is stopped: more than half the nodes qualified at once",
            m.auto_cordon_halted.clone(),
        );
        registry.register(
            "probations",
            "Health checks of auto-cordoned nodes, by result (passed: back in service)",
            m.probations.clone(),
        );
        registry.register(
            "scheduling_cycle_seconds",
            "Scheduling cycle duration",
            m.cycle_seconds.clone(),
        );
        registry.register("decisions", "Scheduling decisions", m.decisions.clone());
        registry.register(
            "api_requests",
            "API requests by route and status",
            m.api_requests.clone(),
        );
        registry.register(
            "api_request_seconds",
            "API request latency",
            m.api_seconds.clone(),
        );
        registry.register(
            "store_txns",
            "Store write transactions committed",
            m.store_txns.clone(),
        );
        registry.register(
            "store_ops",
            "Puts and deletes in committed store transactions",
            m.store_ops.clone(),
        );
        registry.register(
            "store_compactions",
            "Compactions of the store's change history",
            m.store_compactions.clone(),
        );
        registry.register(
            "store_compacted_revision",
            "The revision the store's history was last compacted to",
            m.store_compacted_revision.clone(),
        );
        registry.register(
            "state_lock_acquisitions",
            "Times the control state's lock was taken, by holder",
            m.lock_taken.clone(),
        );
        registry.register(
            "state_lock_wait_seconds",
            "Seconds spent waiting for the control state's lock, by holder",
            m.lock_waited.clone(),
        );
        registry.register(
            "state_lock_held_seconds",
            "Seconds the control state's lock was held (its read view published), by holder",
            m.lock_held.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Counts one health check of an auto-cordoned node (`passed` or
    /// `failed`).
    pub fn probation(&self, result: &str) {
        self.probations
            .get_or_create(&ResultLabels {
                result: result.to_string(),
            })
            .inc();
    }

    /// Brings the lock's counters up to `now` ([`StateLock::lock_use`],
    /// read without the lock): each adds what was used since the last call.
    ///
    /// [`StateLock::lock_use`]: crate::lock::StateLock::lock_use
    pub fn publish_lock(&self, now: &[LockUse]) {
        let mut shown = self
            .lock_shown
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for u in now {
            let before = shown.iter().find(|s| s.holder == u.holder);
            let (taken, waited, held) =
                before.map_or((0, 0.0, 0.0), |b| (b.taken, b.waited, b.held));
            let l = LockLabels {
                holder: u.holder.name(),
            };
            self.lock_taken
                .get_or_create(&l)
                .inc_by(u.taken.saturating_sub(taken));
            self.lock_waited
                .get_or_create(&l)
                .inc_by((u.waited - waited).max(0.0));
            self.lock_held
                .get_or_create(&l)
                .inc_by((u.held - held).max(0.0));
        }
        *shown = now.to_vec();
    }

    /// Updates the gauges from the control state: [`Snapshot::gather`] then
    /// [`Metrics::publish`]. The scheduler loop calls the two apart, so that
    /// only the gathering holds the state lock.
    pub fn refresh<S: Store>(&self, c: &Control<S>) {
        self.publish(Snapshot::gather(c));
    }

    /// Sets the gauges to `snap` (no state lock needed). Each gauge is set in
    /// place, never cleared, so a scrape meanwhile never sees the job family
    /// empty; a (state, queue) pair no longer present reads 0.
    pub fn publish(&self, snap: Snapshot) {
        let mut shown = self
            .job_labels
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now: std::collections::HashSet<JobLabels> =
            snap.jobs.iter().map(|(l, _)| l.clone()).collect();
        for gone in shown.difference(&now) {
            self.jobs.get_or_create(gone).set(0);
        }
        for (l, n) in &snap.jobs {
            self.jobs.get_or_create(l).set(*n);
        }
        *shown = now;
        self.gpus_allocated.set(snap.gpus_allocated);
        self.gpus_free.set(snap.gpus_free);
        self.gpus_unhealthy.set(snap.gpus_unhealthy);
        self.show_causes(&snap.gpus_unhealthy_by_cause);
    }

    /// Sets the by-cause gauge, zeroing causes that are gone.
    fn show_causes(&self, causes: &[(String, i64)]) {
        let mut shown = self
            .causes_shown
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now: std::collections::HashSet<String> =
            causes.iter().map(|(c, _)| c.clone()).collect();
        for gone in shown.difference(&now) {
            self.gpus_unhealthy_by_cause
                .get_or_create(&CauseLabels {
                    cause: gone.clone(),
                })
                .set(0);
        }
        for (c, n) in causes {
            self.gpus_unhealthy_by_cause
                .get_or_create(&CauseLabels { cause: c.clone() })
                .set(*n);
        }
        *shown = now;
    }

    /// The refresh as it was before [`Snapshot`]: every job's labels built
    /// and looked up in the gauge family while the caller holds the state
    /// lock. Kept only as the baseline `gangway-bench dashboard` measures
    /// the snapshot against.
    pub fn refresh_walking_baseline<S: Store>(&self, c: &Control<S>) {
        self.jobs.clear();
        for (rec, _) in c.jobs.values() {
            self.jobs
                .get_or_create(&JobLabels {
                    state: format!("{:?}", rec.state).to_lowercase(),
                    queue: rec.spec.queue.clone(),
                })
                .inc();
        }
        let s = Snapshot::gather_gpus(c);
        self.gpus_allocated.set(s.gpus_allocated);
        self.gpus_free.set(s.gpus_free);
        self.gpus_unhealthy.set(s.gpus_unhealthy);
    }

    /// The OpenMetrics text of the last snapshot and the live counters.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// The snapshot in the format a scrape asked for.
    pub fn render_as(&self, f: Format) -> String {
        match f {
            Format::OpenMetrics => self.render(),
            Format::Text => openmetrics_to_text(&self.render()),
        }
    }
}

/// The exposition formats `/metrics` speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4 (the default).
    Text,
    /// OpenMetrics 1.0.0 (when the Accept header prefers it).
    OpenMetrics,
}

impl Format {
    /// The Content-Type of an answer in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }

    /// Content negotiation: OpenMetrics when the Accept header rates it at
    /// least as high as the text format (Prometheus asks so), else the text
    /// format; no header, `*/*` or anything unknown get the text format.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let (mut om, mut text) = (0.0f32, 0.0f32);
        for range in accept.unwrap_or("").split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.strip_prefix("q="))
                .find_map(|q| q.parse::<f32>().ok())
                .unwrap_or(1.0)
                .clamp(0.0, 1.0);
            match media.as_str() {
                "application/openmetrics-text" => om = om.max(q),
                "text/plain" | "text/*" | "*/*" => text = text.max(q),
                _ => {}
            }
        }
        if om > 0.0 && om >= text {
            Format::OpenMetrics
        } else {
            Format::Text
        }
    }
}

/// Rewrites OpenMetrics text as Prometheus text format 0.0.4: counters'
/// HELP and TYPE name the `_total` series (the family name alone leaves
/// `_total` without help text, as promtool says), `unknown` is `untyped`,
/// and the `# UNIT` and `# EOF` lines go.
pub fn openmetrics_to_text(om: &str) -> String {
    let counters: std::collections::HashSet<&str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .filter(|(_, t)| t.trim() == "counter")
        .map(|(n, _)| n)
        .collect();
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((p, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let tail = if p == "# TYPE " && tail.trim() == "unknown" {
                    "untyped"
                } else {
                    tail
                };
                if counters.contains(name) {
                    out += &format!("{p}{name}_total {tail}\n");
                } else {
                    out += &format!("{p}{name} {tail}\n");
                }
            }
            None => {
                // A counter's `_created` series is OpenMetrics-only.
                let series = line.split(['{', ' ']).next().unwrap_or("");
                let created = series
                    .strip_suffix("_created")
                    .is_some_and(|f| counters.contains(f));
                if !created {
                    out += line;
                    out.push('\n');
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_headers_choose_the_format() {
        assert_eq!(Format::negotiate(None), Format::Text);
        assert_eq!(Format::negotiate(Some("*/*")), Format::Text);
        assert_eq!(Format::negotiate(Some("text/plain")), Format::Text);
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text; version=1.0.0")),
            Format::OpenMetrics
        );
        // What Prometheus sends: OpenMetrics preferred.
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")),
            Format::OpenMetrics
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;q=0.2, text/plain;q=0.9")),
            Format::Text
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;q=0")),
            Format::Text
        );
    }

    #[test]
    fn a_published_snapshot_replaces_the_last_and_gone_pairs_read_zero() {
        let m = Metrics::new();
        let l = |state: &str| JobLabels {
            state: state.into(),
            queue: "q".into(),
        };
        m.publish(Snapshot {
            jobs: vec![(l("pending"), 2)],
            gpus_allocated: 0,
            gpus_free: 8,
            gpus_unhealthy: 1,
            gpus_unhealthy_by_cause: vec![("xid_79".into(), 1)],
        });
        let text = m.render();
        assert!(
            text.contains("gangway_gpus_unhealthy_by_cause{cause=\"xid_79\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("gangway_jobs{state=\"pending\",queue=\"q\"} 2"),
            "{text}"
        );
        m.publish(Snapshot {
            jobs: vec![(l("running"), 2)],
            gpus_allocated: 8,
            gpus_free: 0,
            gpus_unhealthy: 0,
            gpus_unhealthy_by_cause: Vec::new(),
        });
        let text = m.render();
        assert!(
            text.contains("gangway_gpus_unhealthy_by_cause{cause=\"xid_79\"} 0"),
            "a cause that is gone shows 0: {text}"
        );
        assert!(
            text.contains("gangway_jobs{state=\"pending\",queue=\"q\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("gangway_jobs{state=\"running\",queue=\"q\"} 2"),
            "{text}"
        );
        assert!(text.contains("gangway_gpus_allocated 8"), "{text}");
        assert!(text.contains("gangway_gpus_free 0"), "{text}");
    }

    #[test]
    fn the_text_format_names_counters_by_their_total_series() {
        let om = "# HELP x_d Decisions.\n# TYPE x_d counter\nx_d_total{k=\"a\"} 1\nx_d_created 5\n# HELP x_g G.\n# TYPE x_g gauge\n# UNIT x_g seconds\nx_g 2\n# EOF\n";
        assert_eq!(
            openmetrics_to_text(om),
            "# HELP x_d_total Decisions.\n# TYPE x_d_total counter\nx_d_total{k=\"a\"} 1\n# HELP x_g G.\n# TYPE x_g gauge\nx_g 2\n"
        );
    }
}
