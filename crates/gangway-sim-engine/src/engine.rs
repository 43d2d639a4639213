//! The discrete-event engine: arrivals, starts, finishes, preemptions with a
//! checkpoint grace and the work lost since the last checkpoint, requeues and
//! optional node failures. Time jumps from event to event; after each batch of
//! simultaneous events the scheduling core runs one cycle and its decisions
//! are applied — the engine adds no scheduling policy of its own.

use crate::cluster::{ClusterError, ClusterSpec};
pub use crate::job::SimJob;
use crate::metrics::{Recorder, SimResult};
use crate::policy::Policy;
use crate::trace::Trace;
use gangway_core::{JobId, JobSpec, Time, TopologyConstraint};
use gangway_sched::policy::{
    class_tier, QueueUsage, RankChanges, RankInput, SchedulingPolicy, Verdict, TIER_SPAN,
};
use gangway_sched::{apply, schedule, ClusterState, Decisions, StateConfig, StateError};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use thiserror::Error;

/// Gangway's aging bound (see [`gangway_sched::rank::AGING_FACTOR`]).
pub use gangway_sched::rank::AGING_FACTOR;

/// Knobs of a simulation run.
#[derive(Clone, Debug, PartialEq)]
pub struct SimOptions {
    /// Seconds between a job's own checkpoints; work since the last one is lost on preemption.
    pub checkpoint_interval: u64,
    /// Grace period between the checkpoint signal and the kill.
    pub grace_seconds: u64,
    /// Seconds a preempted job spends restoring its checkpoint when it restarts
    /// (GPU time without progress).
    pub restart_overhead_seconds: u64,
    /// Each queue runs on its own nodes (see [`ClusterSpec::partitioned`]); jobs
    /// ask for their queue's partition.
    pub partition: bool,
    /// Whether jobs declare their run time (the trace's) to the scheduler.
    pub declare_runtimes: bool,
    /// Mean time between failures of one node, hours (`None`: nodes never fail).
    pub node_mtbf_hours: Option<f64>,
    /// Seconds a failed node stays down.
    pub node_repair_seconds: u64,
    /// Tiresias' attained-service thresholds in GPU-seconds (queue boundaries).
    pub las_thresholds: Vec<u64>,
    /// Seed for node failures.
    pub seed: u64,
    /// Only the first N jobs of the trace.
    pub limit: Option<usize>,
    /// Backfill mode for every policy of the run (default: each policy's own).
    pub backfill: Option<gangway_sched::Backfill>,
    /// Pending jobs planned per cycle (default: the core's default).
    pub plan_depth: Option<usize>,
    /// Every job preemptible, under every policy of the run (the assumption
    /// of Tiresias' and SRTF's published simulators). Off: a job's priority
    /// class decides, as in the live server (best-effort, low and normal
    /// preemptible; high and above not), for every policy alike.
    pub all_preemptible: bool,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            checkpoint_interval: 300,
            grace_seconds: 30,
            restart_overhead_seconds: 0,
            partition: false,
            declare_runtimes: false,
            node_mtbf_hours: None,
            node_repair_seconds: 3600,
            // Tiresias (NSDI '19) uses two thresholds of attained GPU-seconds.
            las_thresholds: vec![3250, 7200],
            seed: 1,
            limit: None,
            backfill: None,
            plan_depth: None,
            all_preemptible: false,
        }
    }
}

/// Why a simulation could not run.
#[derive(Debug, Error)]
pub enum SimError {
    /// Cluster.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// A simulation thread panicked (a bug, reported rather than hidden).
    #[error("a simulation thread panicked")]
    Panicked,
    /// A decision the state refused: a bug in the core, reported rather than hidden.
    #[error("at t={at}: decision refused: {source}")]
    State {
        /// Time.
        at: Time,
        /// Cause.
        source: StateError,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// Node repaired.
    NodeUp(u32),
    /// A preempted job's grace ends (job, attempt).
    Exit(usize, u32),
    /// A running job completes (job, attempt).
    Finish(usize, u32),
    /// A running job crosses an attained-service threshold (job, attempt).
    Cross(usize, u32),
    /// Node fails.
    NodeDown(u32),
    /// Job submitted.
    Arrive(usize),
}

/// Shape of a gang of `gpus` GPUs on nodes of at most `max_node` GPUs:
/// one replica when it fits a node, else replicas of the largest divisor that does.
pub fn gang_shape(gpus: u32, max_node: u32) -> (u32, u32) {
    if gpus == 0 {
        return (1, 0);
    }
    if gpus <= max_node {
        return (1, gpus);
    }
    let per = (1..=max_node)
        .rev()
        .find(|d| gpus.is_multiple_of(*d))
        .unwrap_or(1);
    (gpus / per, per)
}

/// Who ranks the jobs of a run.
#[derive(Clone, Copy, Debug)]
enum Ranker {
    /// A plugin of the scheduling core's registry.
    Plugin(&'static dyn SchedulingPolicy),
    /// The SRTF oracle: shortest true remaining run time first (simulator only).
    Srtf,
}

impl Ranker {
    fn changes(self) -> RankChanges {
        match self {
            Ranker::Plugin(p) => p.changes(),
            Ranker::Srtf => RankChanges {
                while_running: true,
                ..RankChanges::default()
            },
        }
    }
}

/// One simulation of one policy on one trace.
pub struct Engine {
    policy: Policy,
    ranker: Ranker,
    opts: SimOptions,
    state: ClusterState,
    jobs: Vec<SimJob>,
    events: BinaryHeap<Reverse<(Time, u64, Ev)>>,
    seq: u64,
    rng: u64,
    now: Time,
    rec: Recorder,
    /// The core's configuration for the policy, fixed for the run.
    cfg: gangway_sched::SchedulerConfig,
    /// `GANGWAY_SIM_WATCH`: a job whose explanation is printed every cycle.
    watch: Option<u64>,
    /// `GANGWAY_SIM_DEBUG`: print every preemption.
    debug: bool,
    /// When ranks that change with time (age, aging) were last refreshed.
    last_refresh: Option<Time>,
    /// The ranking's knobs (Gangway's bands, the run's LAS thresholds).
    rank_params: gangway_sched::rank::RankParams,
    /// Fair-share factors: per queue, decayed GPU-seconds used.
    queue_usage: QueueUsage,
    /// Events processed.
    pub events_processed: u64,
    /// Scheduling cycles run.
    pub cycles: u64,
}

impl Engine {
    /// Prepares a run of `policy` on `trace` over `cluster`.
    pub fn new(
        trace: &Trace,
        cluster: &ClusterSpec,
        policy: Policy,
        opts: SimOptions,
    ) -> Result<Self, SimError> {
        let spec = policy.cluster(cluster);
        let mut queues: Vec<String> = trace.jobs.iter().map(|j| j.queue.clone()).collect();
        queues.sort();
        queues.dedup();
        let state = spec.build(&queues, StateConfig::default())?;
        let cfg = policy.config();
        let ranker = policy.plugin().map_or(Ranker::Srtf, Ranker::Plugin);
        Ok(Self::from_parts(trace, policy, ranker, state, cfg, opts))
    }

    /// Prepares a run of `trace` on a cluster state built by the caller (nodes
    /// and queue tree) with the core configured by `cfg`; jobs are ranked by
    /// `plugin` (Gangway's takes each queue's `ordering`), as on a live
    /// server running it. The policy what-if replays a cluster's own history
    /// this way, once per policy compared.
    pub fn with_state(
        trace: &Trace,
        state: ClusterState,
        plugin: &'static dyn SchedulingPolicy,
        cfg: gangway_sched::SchedulerConfig,
        opts: SimOptions,
    ) -> Self {
        let label = plugin.name().parse().unwrap_or(Policy::Gangway);
        Self::from_parts(trace, label, Ranker::Plugin(plugin), state, cfg, opts)
    }

    fn from_parts(
        trace: &Trace,
        policy: Policy,
        ranker: Ranker,
        state: ClusterState,
        cfg: gangway_sched::SchedulerConfig,
        opts: SimOptions,
    ) -> Self {
        let n = opts.limit.unwrap_or(trace.jobs.len()).min(trace.jobs.len());
        let jobs: Vec<SimJob> = trace.jobs[..n]
            .iter()
            .map(|t| SimJob {
                trace: t.clone(),
                done: 0,
                run_start: None,
                attempt: 0,
                first_start: None,
                finish: None,
                waited: 0,
                pending_since: t.submit,
                preemptions: 0,
                lost_gpu_seconds: 0,
                attained: 0,
                signalled: None,
                rejected: None,
                overhead: 0,
            })
            .collect();
        let rec = Recorder::new(&state, &jobs);
        let mut cfg = cfg;
        if let Some(b) = opts.backfill {
            cfg.backfill = b;
        }
        if let Some(k) = opts.plan_depth {
            cfg.plan_depth = k;
        }
        // Gangway's own bands, as the live server's; `las_thresholds` are
        // the Tiresias baseline's.
        let rank_params = gangway_sched::rank::RankParams {
            aging_factor: AGING_FACTOR,
            las_thresholds: opts.las_thresholds.clone(),
            ..gangway_sched::rank::RankParams::default()
        };
        let mut e = Engine {
            policy,
            ranker,
            opts,
            state,
            jobs,
            events: BinaryHeap::new(),
            seq: 0,
            rng: 0,
            now: 0,
            rec,
            cfg,
            watch: std::env::var("GANGWAY_SIM_WATCH")
                .ok()
                .and_then(|w| w.parse().ok()),
            debug: std::env::var_os("GANGWAY_SIM_DEBUG").is_some(),
            last_refresh: None,
            rank_params,
            queue_usage: Default::default(),
            events_processed: 0,
            cycles: 0,
        };
        e.rng = e.opts.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for i in 0..e.jobs.len() {
            let t = e.jobs[i].trace.submit;
            e.push(t, Ev::Arrive(i));
        }
        if e.opts.node_mtbf_hours.is_some() {
            let t = e.next_failure_gap();
            e.push(t, Ev::NodeDown(0));
        }
        e
    }

    fn push(&mut self, t: Time, ev: Ev) {
        self.seq += 1;
        self.events.push(Reverse((t, self.seq, ev)));
    }

    fn rand(&mut self) -> f64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Seconds to the next node failure anywhere (exponential).
    fn next_failure_gap(&mut self) -> Time {
        let mtbf = self.opts.node_mtbf_hours.unwrap_or(f64::INFINITY) * 3600.0;
        let rate = self.state.nodes().len() as f64 / mtbf;
        let u = self.rand().max(1e-12);
        self.now + (-u.ln() / rate).ceil() as Time
    }

    fn id(i: usize) -> JobId {
        JobId(i as u64 + 1)
    }

    fn spec_for(&self, i: usize) -> JobSpec {
        let t = &self.jobs[i].trace;
        let max_node = self
            .state
            .classes()
            .iter()
            .map(|c| c.max_gpus)
            .max()
            .unwrap_or(1);
        let (replicas, per) = gang_shape(t.gpus, max_node);
        let name = t.app.as_deref().unwrap_or("job");
        let mut s = JobSpec::new(name, &t.queue, replicas, per);
        s.user = t.user.clone();
        s.resources.cpu_millis = t.cpu_millis / u64::from(replicas);
        s.resources.memory_mib = t.memory_mib / u64::from(replicas);
        if t.gpus == 0 && s.resources.cpu_millis == 0 {
            s.resources.cpu_millis = 1000;
        }
        s.resources.gpu_model = if self.opts.partition {
            Some(crate::cluster::partition_model(&t.queue))
        } else {
            t.gpu_model.clone()
        };
        s.priority = t.priority;
        if self.opts.all_preemptible {
            s.preemptible = Some(true);
        }
        s.checkpoint.grace_seconds = self.opts.grace_seconds;
        s.checkpoint.interval_seconds = Some(self.opts.checkpoint_interval);
        if self.opts.declare_runtimes {
            s.runtime_seconds = Some(self.jobs[i].remaining().max(1));
        } else if let Some(limit) = t.time_limit {
            // A user's time limit is what every scheduler sees (Slurm's --time).
            s.runtime_seconds = Some(limit.max(1));
        }
        s.topology = TopologyConstraint::Auto;
        s
    }

    /// Runs to the end; `progress(finished_or_rejected, total)` is called now and then.
    pub fn run(self, progress: &mut dyn FnMut(usize, usize)) -> Result<SimResult, SimError> {
        self.run_with_jobs(progress).map(|(r, _)| r)
    }

    /// Like [`Self::run`], also returning every job's history.
    pub fn run_with_jobs(
        mut self,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(SimResult, Vec<SimJob>), SimError> {
        let total = self.jobs.len();
        let mut settled = 0usize;
        let mut last_report = 0usize;
        while let Some(Reverse((t, _, _))) = self.events.peek().copied() {
            self.rec.advance(&self.state, t);
            self.now = t;
            let mut changed = false;
            while let Some(Reverse((t2, _, ev))) = self.events.peek().copied() {
                if t2 != t {
                    break;
                }
                self.events.pop();
                self.events_processed += 1;
                changed |= self.handle(ev, &mut settled)?;
            }
            if changed && self.state.pending_count() > 0 {
                self.cycle()?;
            }
            if settled >= last_report + 1000 || settled == total {
                progress(settled, total);
                last_report = settled;
            }
            if settled == total && self.opts.node_mtbf_hours.is_some() {
                break;
            }
        }
        progress(settled, total);
        self.rec.advance(&self.state, self.now);
        let r = self.rec.finish(
            self.policy,
            &self.jobs,
            self.now,
            self.events_processed,
            self.cycles,
        );
        Ok((r, self.jobs))
    }

    fn handle(&mut self, ev: Ev, settled: &mut usize) -> Result<bool, SimError> {
        let now = self.now;
        let err = |source| SimError::State { at: now, source };
        match ev {
            Ev::Arrive(i) => {
                let spec = self.spec_for(i);
                if let Err(e) = self.state.submit(Self::id(i), spec, now) {
                    self.jobs[i].rejected = Some(e.to_string());
                    *settled += 1;
                    return Ok(false);
                }
                self.jobs[i].pending_since = now;
                self.rerank(i);
                Ok(true)
            }
            Ev::Finish(i, a) => {
                if self.jobs[i].attempt != a || self.jobs[i].run_start.is_none() {
                    return Ok(false);
                }
                let j = &mut self.jobs[i];
                let start = j.run_start.take().unwrap_or(now);
                j.attained += u64::from(j.trace.gpus) * (now - start);
                j.done = j.trace.duration;
                j.finish = Some(now);
                let duration = j.trace.duration;
                let done = self.state.finish(Self::id(i)).map_err(err)?;
                // Causal: only jobs completed by now inform later predictions.
                self.state.learn_runtime(&done.spec, duration);
                *settled += 1;
                Ok(true)
            }
            Ev::Exit(i, a) => {
                if self.jobs[i].attempt != a || self.jobs[i].run_start.is_none() {
                    return Ok(false);
                }
                self.stop_run(i, false)?;
                Ok(true)
            }
            Ev::Cross(i, a) => Ok(self.jobs[i].attempt == a && self.jobs[i].run_start.is_some()),
            Ev::NodeDown(_) => {
                let n = (self.rand() * self.state.nodes().len() as f64) as usize
                    % self.state.nodes().len().max(1);
                let name = self.state.nodes()[n].spec.name.clone();
                let victims: Vec<JobId> = self.state.jobs_on(n as u32).to_vec();
                for v in victims {
                    let i = (v.0 - 1) as usize;
                    self.stop_run(i, true)?;
                }
                self.state.set_ready(&name, false).map_err(err)?;
                self.rec.node_failed();
                self.push(now + self.opts.node_repair_seconds, Ev::NodeUp(n as u32));
                let gap = self.next_failure_gap();
                self.push(gap, Ev::NodeDown(0));
                Ok(true)
            }
            Ev::NodeUp(n) => {
                let name = self.state.nodes()[n as usize].spec.name.clone();
                self.state.set_ready(&name, true).map_err(err)?;
                Ok(true)
            }
        }
    }

    /// Ends the current run of job `i` (preempted or its node failed) and requeues it.
    /// Work since the last periodic checkpoint is lost; so is the grace period.
    fn stop_run(&mut self, i: usize, failed: bool) -> Result<(), SimError> {
        let now = self.now;
        let interval = self.opts.checkpoint_interval.max(1);
        let j = &mut self.jobs[i];
        let Some(start) = j.run_start.take() else {
            return Ok(());
        };
        let signal = if failed {
            now
        } else {
            j.signalled.unwrap_or(now)
        };
        let ran = signal.saturating_sub(start).saturating_sub(j.overhead);
        let saved = (ran / interval) * interval;
        let gpus = u64::from(j.trace.gpus);
        j.done = (j.done + saved).min(j.trace.duration);
        j.lost_gpu_seconds += gpus * (now - start - saved);
        j.attained += gpus * (now - start);
        j.preemptions += u32::from(!failed);
        j.overhead = self.opts.restart_overhead_seconds;
        j.signalled = None;
        j.pending_since = now;
        j.attempt += 1;
        self.state
            .requeue(Self::id(i))
            .map_err(|source| SimError::State { at: now, source })?;
        self.rerank(i);
        Ok(())
    }

    /// Sets job `i`'s priority and in-queue rank by the run's policy.
    fn rerank(&mut self, i: usize) {
        let id = Self::id(i);
        let now = self.now;
        let j = &self.jobs[i];
        let plugin = match self.ranker {
            Ranker::Srtf => {
                // Every policy honours the jobs' priority classes: SRTF's
                // order applies within a class.
                let ran = j.run_start.map_or(0, |s| now - s);
                let left = j.remaining().saturating_sub(ran);
                let prio = class_tier(j.trace.priority) + TIER_SPAN
                    - 1
                    - (left / 60).min(TIER_SPAN as u64 - 1) as i32;
                let _ = self.state.set_priority(id, prio);
                return;
            }
            Ranker::Plugin(p) => p,
        };
        let Some(job) = self.state.job(id) else {
            return;
        };
        let facts = gangway_sched::rank::RankFacts {
            class: j.trace.priority.value(),
            gpus: u64::from(j.trace.gpus),
            attained_gpu_seconds: j.attained,
            running_for: j.run_start.map(|s| now - s),
            waited: j.waited + now.saturating_sub(j.pending_since),
            submitted: j.trace.submit,
            runtime: gangway_sched::rank::KnownRuntime::of(job, self.state.predictor()),
        };
        let verdict = plugin.rank(&RankInput {
            facts: &facts,
            class: j.trace.priority,
            queue: &j.trace.queue,
            ordering: self.state.queues()[job.queue as usize].spec.ordering,
            now,
            params: &self.rank_params,
            state: &self.state,
            usage: &self.queue_usage,
        });
        match verdict {
            Verdict::Class => {}
            Verdict::Priority(p) => {
                let _ = self.state.set_priority(id, p);
            }
            Verdict::Ranked(r) => {
                let _ = gangway_sched::rank::apply(&mut self.state, id, r);
            }
        }
    }

    /// Refreshes ranks that change with time alone (age, aging, predictions),
    /// every 5 simulated minutes, like Slurm's PriorityCalcPeriod.
    fn refresh_ranks(&mut self) {
        const PERIOD: Time = gangway_sched::rank::REFRESH_SECONDS;
        let changes = self.ranker.changes();
        if !changes.with_time {
            return;
        }
        let now = self.now;
        let dt = match self.last_refresh {
            Some(t) if now < t + PERIOD => return,
            Some(t) => now - t,
            None => 0,
        };
        self.last_refresh = Some(now);
        if changes.queue_usage {
            self.queue_usage.accrue(&self.state, dt);
        }
        let pending: Vec<usize> = self
            .state
            .jobs_sorted()
            .iter()
            .filter(|j| j.status == gangway_sched::JobStatus::Pending)
            .map(|j| (j.id.0 - 1) as usize)
            .collect();
        for i in pending {
            self.rerank(i);
        }
    }

    fn cycle(&mut self) -> Result<(), SimError> {
        let now = self.now;
        self.refresh_ranks();
        let changes = self.ranker.changes();
        if changes.while_running {
            let running: Vec<usize> = self
                .state
                .running_by_end()
                .map(|(_, id)| (id.0 - 1) as usize)
                .collect();
            for i in running {
                self.rerank(i);
            }
        }
        let d: Decisions = schedule(&self.state, now, &self.cfg);
        self.cycles += 1;
        apply(&mut self.state, &d, now).map_err(|source| SimError::State { at: now, source })?;
        for b in &d.binds {
            let i = (b.job.0 - 1) as usize;
            let j = &mut self.jobs[i];
            j.attempt += 1;
            j.run_start = Some(now);
            j.first_start.get_or_insert(now);
            j.waited += now - j.pending_since;
            let (a, left) = (j.attempt, j.remaining() + j.overhead);
            let attained = j.attained;
            let gpus = u64::from(j.trace.gpus).max(1);
            self.push(now + left.max(1), Ev::Finish(i, a));
            // Its minimum run time (its queue's, else the scheduler's; grown
            // with its preemptions where the policy says so).
            let min_run = self
                .state
                .job(b.job)
                .map_or(self.cfg.min_run_seconds, |job| {
                    gangway_sched::preempt::min_run_of(
                        job,
                        &self.cfg,
                        &self.state.queues()[job.queue as usize].spec,
                    )
                });
            if min_run > 0 && self.cfg.preemption && min_run < left {
                // It becomes a possible victim then: the core must look again.
                self.push(now + min_run, Ev::Cross(i, a));
            }
            // A running job whose band moves is ranked again then.
            let next = changes
                .bands
                .of(&self.rank_params)
                .and_then(|thresholds| gangway_sched::rank::next_threshold(thresholds, attained));
            if let Some(t) = next {
                let dt = (t - attained).div_ceil(gpus);
                if dt < left {
                    self.push(now + dt, Ev::Cross(i, a));
                }
            }
        }
        if let Some(w) = self.watch {
            if let Some(e) = d.pending.iter().find(|e| e.job.0 == w) {
                eprintln!("t={now} watch {w}: {}", e.render(&self.state, now));
            }
            if d.binds.iter().any(|b| b.job.0 == w) {
                eprintln!("t={now} watch {w}: bound");
            }
        }
        if self.debug {
            for p in &d.preemptions {
                let v = &self.jobs[(p.job.0 - 1) as usize].trace;
                let b = &self.jobs[(p.by.0 - 1) as usize].trace;
                eprintln!(
                    "t={now} {:?} victim {} {} {}g by {} {} {}g",
                    p.reason, p.job, v.queue, v.gpus, p.by, b.queue, b.gpus
                );
            }
        }
        for p in &d.preemptions {
            let i = (p.job.0 - 1) as usize;
            let a = self.jobs[i].attempt;
            self.jobs[i].signalled = Some(now);
            self.push(now + p.grace_seconds, Ev::Exit(i, a));
        }
        self.rec.cycle(&self.state, &d, now);
        Ok(())
    }
}
