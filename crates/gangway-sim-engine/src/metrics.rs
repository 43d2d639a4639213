//! What a simulation measures: job completion time and queueing delay (also by
//! job size), makespan, GPU allocation and utilisation over time, per-queue
//! share against quota over time, Jain's fairness across queues, starvation,
//! preemptions and GPU-hours lost, fragmentation.

use crate::job::SimJob;
use crate::policy::Policy;
use gangway_core::Time;
use gangway_sched::{ClusterState, Decisions};
use serde::Serialize;
use std::collections::BTreeMap;

/// Summary statistics of a set of durations (seconds).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Stats {
    /// Count.
    pub n: usize,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub median: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Stats {
    /// Of `v` (sorted in place).
    pub fn of(v: &mut [f64]) -> Stats {
        if v.is_empty() {
            return Stats::default();
        }
        v.sort_by(f64::total_cmp);
        let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
        Stats {
            n: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            median: q(0.5),
            p95: q(0.95),
            p99: q(0.99),
            max: v[v.len() - 1],
        }
    }
}

/// Figures for one job-size bucket.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Bucket {
    /// Label, e.g. `2-4 GPUs`.
    pub label: String,
    /// JCT statistics.
    pub jct: Stats,
    /// Queueing-delay statistics.
    pub wait: Stats,
}

/// Figures for one queue: what Jain's index across queues is computed from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct QueueFigures {
    /// Queue name.
    pub queue: String,
    /// Completed jobs.
    pub jobs: usize,
    /// Σ run time ÷ Σ JCT of its completed jobs (1 = nobody waited).
    pub service_ratio: f64,
    /// Mean JCT, seconds.
    pub avg_jct: f64,
    /// Mean queueing delay, seconds.
    pub avg_wait: f64,
    /// Jobs that waited more than 10× their run time (run time ≥ 1 min).
    pub starved_10x: usize,
}

/// Time series sampled in fixed buckets.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Series {
    /// Bucket width, seconds.
    pub bucket_seconds: u64,
    /// Average allocated GPUs per bucket / capacity.
    pub allocation: Vec<f64>,
    /// Per queue: average GPUs held per bucket / its nominal quota (or / capacity without quota).
    pub queue_share: BTreeMap<String, Vec<f64>>,
}

/// Everything measured for one policy.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimResult {
    /// Policy.
    pub policy: String,
    /// Jobs in the trace run.
    pub jobs: usize,
    /// Jobs completed.
    pub completed: usize,
    /// Jobs rejected at validation (impossible on this cluster), with reasons.
    pub rejected: BTreeMap<String, usize>,
    /// Job completion time (finish − submit).
    pub jct: Stats,
    /// Queueing delay (time spent pending, over all attempts).
    pub wait: Stats,
    /// By GPU count.
    pub by_size: Vec<Bucket>,
    /// Last finish − first submit, seconds.
    pub makespan: u64,
    /// Time-averaged allocated GPUs / capacity over the makespan.
    pub allocation_ratio: f64,
    /// Useful GPU-seconds (work not lost) / (capacity × makespan).
    pub utilisation: f64,
    /// Jain's index across queues of x_q = Σ run time / Σ JCT of the queue's jobs.
    pub jain_fairness: f64,
    /// Longest queueing delay, seconds.
    pub max_wait: f64,
    /// Largest queueing delay ÷ run time of any job.
    pub max_wait_over_runtime: f64,
    /// Jobs whose queueing delay exceeded 10× their run time (run time ≥ 1 min).
    pub starved_10x: usize,
    /// Preemptions.
    pub preemptions: u64,
    /// Most preemptions decided at one instant of simulated time.
    pub max_preemptions_per_instant: u64,
    /// Slowdown (JCT ÷ run time) statistics.
    pub slowdown: Stats,
    /// Preemptions by reason (priority, reclaim).
    pub preemptions_by_reason: BTreeMap<String, u64>,
    /// GPU-hours lost to preemption and failures (work since the last checkpoint and grace periods).
    pub gpu_hours_lost: f64,
    /// Node failures injected.
    pub node_failures: u64,
    /// Mean free GPUs that could not host a whole-node job, sampled at cycles with pending work.
    pub mean_fragmented_gpus: f64,
    /// Events processed.
    pub events: u64,
    /// Scheduling cycles run.
    pub cycles: u64,
    /// Per queue, by name: the figures behind Jain's index.
    pub by_queue: Vec<QueueFigures>,
    /// Sorted JCTs (for the CDF plot).
    #[serde(skip)]
    pub jcts: Vec<f64>,
    /// Time series.
    pub series: Series,
}

/// Collects figures while the engine runs.
pub struct Recorder {
    capacity: f64,
    node_gpus: u32,
    last: Time,
    start: Time,
    alloc_integral: f64,
    bucket: u64,
    alloc_buckets: Vec<f64>,
    queue_buckets: BTreeMap<String, Vec<f64>>,
    queue_norm: BTreeMap<String, f64>,
    frag_sum: f64,
    frag_samples: u64,
    preemptions: u64,
    instant: Time,
    at_instant: u64,
    max_at_instant: u64,
    by_reason: BTreeMap<String, u64>,
    node_failures: u64,
}

impl Recorder {
    /// Starts recording for a cluster and its jobs.
    pub fn new(state: &ClusterState, jobs: &[SimJob]) -> Self {
        let capacity = state.total().gpus.max(1) as f64;
        let horizon = jobs.iter().map(|j| j.trace.submit).max().unwrap_or(0) + 1;
        let bucket = (horizon / 400).max(600);
        let mut queue_norm = BTreeMap::new();
        for q in state.queues() {
            let norm = q
                .spec
                .quota
                .nominal
                .gpus
                .map_or(capacity, |n| n.max(1) as f64);
            queue_norm.insert(q.spec.name.clone(), norm);
        }
        Recorder {
            capacity,
            node_gpus: state
                .classes()
                .iter()
                .map(|c| c.max_gpus)
                .max()
                .unwrap_or(8),
            last: 0,
            start: jobs.first().map_or(0, |j| j.trace.submit),
            alloc_integral: 0.0,
            bucket,
            alloc_buckets: Vec::new(),
            queue_buckets: BTreeMap::new(),
            queue_norm,
            frag_sum: 0.0,
            frag_samples: 0,
            preemptions: 0,
            instant: 0,
            at_instant: 0,
            max_at_instant: 0,
            by_reason: BTreeMap::new(),
            node_failures: 0,
        }
    }

    fn add(v: &mut Vec<f64>, from: Time, to: Time, bucket: u64, amount: f64) {
        // Spread `amount` (a level held over [from, to)) over buckets.
        let mut t = from;
        while t < to {
            let b = (t / bucket) as usize;
            let end = ((b as u64 + 1) * bucket).min(to);
            if v.len() <= b {
                v.resize(b + 1, 0.0);
            }
            v[b] += amount * (end - t) as f64;
            t = end;
        }
    }

    /// Integrates the allocation held since the last call up to `t`.
    pub fn advance(&mut self, state: &ClusterState, t: Time) {
        if t <= self.last {
            self.last = self.last.max(t);
            return;
        }
        let allocated = state.total().gpus.saturating_sub(state.free_gpus()) as f64;
        let (from, to) = (self.last, t);
        self.alloc_integral += allocated * (to - from) as f64;
        Self::add(&mut self.alloc_buckets, from, to, self.bucket, allocated);
        for (qi, q) in state.queues().iter().enumerate() {
            if !q.children.is_empty() {
                continue;
            }
            let used = state.queue_usage(qi as u32).gpus as f64;
            let v = self.queue_buckets.entry(q.spec.name.clone()).or_default();
            if used > 0.0 {
                Self::add(v, from, to, self.bucket, used);
            }
        }
        self.last = t;
    }

    /// Records a cycle's decisions and fragmentation.
    pub fn cycle(&mut self, state: &ClusterState, d: &Decisions, now: Time) {
        self.preemptions += d.preemptions.len() as u64;
        if now != self.instant {
            self.instant = now;
            self.at_instant = 0;
        }
        self.at_instant += d.preemptions.len() as u64;
        self.max_at_instant = self.max_at_instant.max(self.at_instant);
        for p in &d.preemptions {
            let k = match p.reason {
                gangway_sched::PreemptReason::Priority => "priority",
                gangway_sched::PreemptReason::Reclaim => "reclaim",
            };
            *self.by_reason.entry(k.to_string()).or_default() += 1;
        }
        if !d.pending.is_empty() || d.stats.unexamined > 0 {
            self.frag_sum += state.fragmented_gpus(self.node_gpus) as f64;
            self.frag_samples += 1;
        }
    }

    /// A node failed.
    pub fn node_failed(&mut self) {
        self.node_failures += 1;
    }

    /// Computes the results.
    pub fn finish(
        self,
        policy: Policy,
        jobs: &[SimJob],
        end: Time,
        events: u64,
        cycles: u64,
    ) -> SimResult {
        let done: Vec<&SimJob> = jobs.iter().filter(|j| j.finish.is_some()).collect();
        let jct_of = |j: &SimJob| j.finish.unwrap_or(0).saturating_sub(j.trace.submit) as f64;
        let mut jcts: Vec<f64> = done.iter().map(|j| jct_of(j)).collect();
        let mut waits: Vec<f64> = done.iter().map(|j| j.waited as f64).collect();
        let jct = Stats::of(&mut jcts);
        let mut slow: Vec<f64> = done
            .iter()
            .map(|j| jct_of(j) / j.trace.duration.max(1) as f64)
            .collect();
        let slowdown = Stats::of(&mut slow);
        let wait = Stats::of(&mut waits);
        let buckets: [(&str, u32, u32); 5] = [
            ("1 GPU", 1, 1),
            ("2-4 GPUs", 2, 4),
            ("5-8 GPUs", 5, 8),
            ("9-32 GPUs", 9, 32),
            ("33+ GPUs", 33, u32::MAX),
        ];
        let by_size = buckets
            .iter()
            .map(|(label, lo, hi)| {
                let sel: Vec<&&SimJob> = done
                    .iter()
                    .filter(|j| j.trace.gpus >= *lo && j.trace.gpus <= *hi)
                    .collect();
                Bucket {
                    label: label.to_string(),
                    jct: Stats::of(&mut sel.iter().map(|j| jct_of(j)).collect::<Vec<_>>()),
                    wait: Stats::of(&mut sel.iter().map(|j| j.waited as f64).collect::<Vec<_>>()),
                }
            })
            .filter(|b| b.jct.n > 0)
            .collect();
        let first = self.start;
        let last = done.iter().filter_map(|j| j.finish).max().unwrap_or(end);
        let makespan = last.saturating_sub(first);
        let span = makespan.max(1) as f64;
        let useful: f64 = done
            .iter()
            .map(|j| (u64::from(j.trace.gpus) * j.trace.duration) as f64)
            .sum();
        let ratio = |j: &SimJob| j.waited as f64 / j.trace.duration.max(1) as f64;
        let starving = |j: &SimJob| j.trace.duration >= 60 && ratio(j) > 10.0;
        // Per queue: jobs, Σ run time, Σ JCT, Σ wait, starved.
        let mut per_queue: BTreeMap<&str, (usize, f64, f64, f64, usize)> = BTreeMap::new();
        for j in &done {
            let e = per_queue.entry(j.trace.queue.as_str()).or_default();
            e.0 += 1;
            e.1 += j.trace.duration as f64;
            e.2 += jct_of(j).max(1.0);
            e.3 += j.waited as f64;
            e.4 += usize::from(starving(j));
        }
        let by_queue: Vec<QueueFigures> = per_queue
            .iter()
            .map(|(q, (n, d, t, w, s))| QueueFigures {
                queue: (*q).to_string(),
                jobs: *n,
                service_ratio: d / t,
                avg_jct: t / *n as f64,
                avg_wait: w / *n as f64,
                starved_10x: *s,
            })
            .collect();
        let xs: Vec<f64> = by_queue.iter().map(|q| q.service_ratio).collect();
        let jain = if xs.is_empty() {
            1.0
        } else {
            let s: f64 = xs.iter().sum();
            let s2: f64 = xs.iter().map(|x| x * x).sum();
            s * s / (xs.len() as f64 * s2)
        };
        let max_ratio = done.iter().map(|j| ratio(j)).fold(0.0, f64::max);
        let starved = done.iter().filter(|j| starving(j)).count();
        let mut rejected = BTreeMap::new();
        for j in jobs {
            if let Some(r) = &j.rejected {
                *rejected.entry(r.clone()).or_default() += 1;
            }
        }
        let b = self.bucket as f64;
        let series = Series {
            bucket_seconds: self.bucket,
            allocation: self
                .alloc_buckets
                .iter()
                .map(|v| v / b / self.capacity)
                .collect(),
            queue_share: self
                .queue_buckets
                .iter()
                .map(|(q, v)| {
                    let norm = self.queue_norm.get(q).copied().unwrap_or(self.capacity);
                    (q.clone(), v.iter().map(|x| x / b / norm).collect())
                })
                .collect(),
        };
        SimResult {
            policy: policy.to_string(),
            jobs: jobs.len(),
            completed: done.len(),
            rejected,
            jct,
            wait,
            by_size,
            makespan,
            allocation_ratio: self.alloc_integral / (self.capacity * span),
            utilisation: useful / (self.capacity * span),
            jain_fairness: jain,
            max_wait: done.iter().map(|j| j.waited as f64).fold(0.0, f64::max),
            max_wait_over_runtime: max_ratio,
            starved_10x: starved,
            preemptions: self.preemptions,
            max_preemptions_per_instant: self.max_at_instant,
            slowdown,
            preemptions_by_reason: self.by_reason,
            gpu_hours_lost: jobs.iter().map(|j| j.lost_gpu_seconds as f64).sum::<f64>() / 3600.0,
            node_failures: self.node_failures,
            mean_fragmented_gpus: if self.frag_samples == 0 {
                0.0
            } else {
                self.frag_sum / self.frag_samples as f64
            },
            events,
            cycles,
            by_queue,
            jcts,
            series,
        }
    }
}
