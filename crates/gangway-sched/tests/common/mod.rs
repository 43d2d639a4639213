//! Helpers shared by the scheduling-core tests: cluster builders and a tiny
//! event driver (jobs end after their runtime; preempted jobs exit after grace).

#![allow(dead_code)]

use gangway_core::{JobId, JobSpec, NodeSpec, QueueSpec, Time};
use gangway_sched::{
    apply, schedule, ClusterState, Decisions, JobStatus, SchedulerConfig, StateConfig,
};
use std::collections::BTreeMap;

/// `nodes` nodes of `gpus` GPUs, `per_leaf` nodes per leaf switch, one spine.
pub fn cluster(nodes: usize, gpus: u32, per_leaf: usize) -> ClusterState {
    let mut s = ClusterState::new(StateConfig::default());
    for i in 0..nodes {
        let leaf = format!("leaf{}", i / per_leaf.max(1));
        s.add_node(NodeSpec::uniform(
            &format!("n{i:02}"),
            &leaf,
            "spine0",
            gpus,
            "H100",
            80,
        ))
        .expect("valid node");
    }
    s
}

/// Adds a queue.
pub fn queue(s: &mut ClusterState, q: QueueSpec) {
    s.add_queue(q).expect("valid queue");
}

/// A job spec of `replicas` × `gpus` in `queue` with a runtime.
pub fn job(queue: &str, replicas: u32, gpus: u32, runtime: Option<u64>) -> JobSpec {
    let mut j = JobSpec::new("job", queue, replicas, gpus);
    j.runtime_seconds = runtime;
    j
}

/// Drives a state through time: the same loop the simulator runs, minus metrics.
pub struct Driver {
    pub state: ClusterState,
    pub cfg: SchedulerConfig,
    pub now: Time,
    next_id: u64,
    /// Actual runtimes (may differ from declared estimates).
    pub runtime: BTreeMap<JobId, u64>,
    /// When each running job ends.
    ends: BTreeMap<JobId, Time>,
    /// When each preempting job exits.
    exits: BTreeMap<JobId, Time>,
    pub started: BTreeMap<JobId, Time>,
    pub finished: BTreeMap<JobId, Time>,
    pub preempted: Vec<JobId>,
    pub last: Decisions,
}

impl Driver {
    pub fn new(state: ClusterState) -> Self {
        Driver {
            state,
            cfg: SchedulerConfig::default(),
            now: 0,
            next_id: 1,
            runtime: BTreeMap::new(),
            ends: BTreeMap::new(),
            exits: BTreeMap::new(),
            started: BTreeMap::new(),
            finished: BTreeMap::new(),
            preempted: Vec::new(),
            last: Decisions::default(),
        }
    }

    /// Submits a job that really runs for `actual` seconds (default: its declared runtime, else 1h).
    pub fn submit(&mut self, spec: JobSpec, actual: Option<u64>) -> JobId {
        let id = JobId(self.next_id);
        self.next_id += 1;
        let rt = actual.or(spec.runtime_seconds).unwrap_or(3600);
        self.state.submit(id, spec, self.now).expect("valid job");
        self.runtime.insert(id, rt);
        id
    }

    /// Runs one cycle at the current time and applies it.
    pub fn cycle(&mut self) -> &Decisions {
        let d = schedule(&self.state, self.now, &self.cfg);
        apply(&mut self.state, &d, self.now).expect("decisions apply cleanly");
        self.state.check_invariants().expect("indexes consistent");
        for b in &d.binds {
            self.started.entry(b.job).or_insert(self.now);
            self.ends.insert(b.job, self.now + self.runtime[&b.job]);
        }
        for p in &d.preemptions {
            self.exits.insert(p.job, self.now + p.grace_seconds);
            self.preempted.push(p.job);
        }
        self.last = d;
        &self.last
    }

    /// Advances time to `t`, ending and requeueing jobs due by then.
    pub fn advance(&mut self, t: Time) {
        self.now = t;
        let due: Vec<JobId> = self
            .exits
            .iter()
            .filter(|(_, e)| **e <= t)
            .map(|(j, _)| *j)
            .collect();
        for j in due {
            self.exits.remove(&j);
            self.ends.remove(&j);
            self.state.requeue(j).expect("preempted job requeues");
        }
        let done: Vec<JobId> = self
            .ends
            .iter()
            .filter(|(_, e)| **e <= t)
            .map(|(j, _)| *j)
            .collect();
        for j in done {
            self.ends.remove(&j);
            self.exits.remove(&j);
            self.state.finish(j).expect("running job finishes");
            self.finished.insert(j, t);
        }
    }

    /// When the current attempt of running job `id` started.
    pub fn started_attempt(&self, id: JobId) -> Time {
        match self.state.job(id).map(|j| &j.status) {
            Some(JobStatus::Running(r)) => r.started,
            other => panic!("{id:?} is not running: {other:?}"),
        }
    }

    pub fn is_running(&self, id: JobId) -> bool {
        matches!(
            self.state.job(id).map(|j| &j.status),
            Some(JobStatus::Running(_))
        )
    }

    pub fn reason(&self, id: JobId) -> String {
        self.last
            .pending
            .iter()
            .find(|e| e.job == id)
            .map(|e| e.render(&self.state, self.now))
            .unwrap_or_default()
    }
}
