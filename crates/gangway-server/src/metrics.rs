//! Prometheus metrics at `/metrics` (admin or metrics token), served from
//! a snapshot the scheduler loop refreshes at most once a second.

use crate::control::Control;
use gangway_store::Store;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

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

/// All metrics.
pub struct Metrics {
    registry: Registry,
    jobs: Family<JobLabels, Gauge>,
    gpus_allocated: Gauge,
    gpus_free: Gauge,
    gpus_unhealthy: Gauge,
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
            cycle_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            decisions: Family::default(),
            api_requests: Family::default(),
            api_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            store_txns: Counter::default(),
            store_ops: Counter::default(),
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
        Metrics { registry, ..m }
    }

    /// Updates the gauges from the control state (the scheduler loop does
    /// this periodically, so a scrape never walks the jobs under the lock).
    pub fn refresh<S: Store>(&self, c: &Control<S>) {
        self.jobs.clear();
        for (rec, _) in c.jobs.values() {
            self.jobs
                .get_or_create(&JobLabels {
                    state: format!("{:?}", rec.state).to_lowercase(),
                    queue: rec.spec.queue.clone(),
                })
                .inc();
        }
        let unhealthy: u64 = c
            .cluster
            .nodes()
            .iter()
            .map(|n| (n.spec.gpus.len() as u32 - n.healthy.count_ones()) as u64)
            .sum();
        let allocated: u64 = c
            .cluster
            .capacity()
            .alloc
            .iter()
            .map(|m| u64::from(m.count_ones()))
            .sum();
        self.gpus_allocated.set(allocated as i64);
        self.gpus_free.set(c.cluster.free_gpus() as i64);
        self.gpus_unhealthy.set(unhealthy as i64);
    }

    /// The text format of the last snapshot and the live counters.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}
