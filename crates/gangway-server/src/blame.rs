//! Node blame: which failures count against a node, and when a node is
//! cordoned for them. A pure state machine (evidence in, decisions out, no
//! I/O), so the server's call sites stay thin.
//!
//! A failure counts against a node only when the node is its likely cause
//! ([`Cause`]): the agent could not start or stop a rank for a reason outside
//! the job, a GPU fault that is not the application's, a GPU lost, or the
//! same gang failing here and then succeeding on other nodes. A job's plain
//! non-zero exit is only remembered: if the job later succeeds elsewhere it
//! becomes evidence against this node, and if it fails everywhere it is the
//! job's own bug and never counts.
//!
//! Auto-cordons are rate-limited (Kubernetes' node eviction rate): at most
//! `max(1, 10 %)` of the nodes per window. When more than half of the nodes
//! qualify at once, the cause is not the nodes (Kubernetes' unhealthy-zone
//! rule): auto-cordoning stops and an alert is raised until the number of
//! qualifying nodes falls back.

use gangway_core::{JobId, Time};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Why a failure is held against a node.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cause {
    /// The agent could not start or stop a rank for a reason outside the job
    /// (its container, log or cgroup could not be made; processes it could
    /// not kill).
    AgentFault(String),
    /// A GPU fault the job did not cause (an XID that is not an application
    /// XID, an ECC error, a failed health check).
    GpuFault {
        /// Device index.
        gpu: u32,
        /// What the agent saw.
        reason: String,
    },
    /// A GPU fell off the bus or vanished from discovery.
    GpuLost {
        /// Device index.
        gpu: u32,
    },
    /// The job's gang failed here and later succeeded on other nodes.
    FailedHereSucceededElsewhere,
}

impl Cause {
    /// Whether one occurrence is enough to blame the node.
    fn direct(&self) -> bool {
        !matches!(self, Cause::FailedHereSucceededElsewhere)
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cause::AgentFault(why) => write!(f, "agent fault: {why}"),
            Cause::GpuFault { gpu, reason } => write!(f, "GPU {gpu} fault: {reason}"),
            Cause::GpuLost { gpu } => write!(f, "GPU {gpu} lost"),
            Cause::FailedHereSucceededElsewhere => {
                write!(f, "failed here, succeeded on other nodes")
            }
        }
    }
}

/// Longest a job may avoid a blamed node (`avoid_node_seconds`): a gang
/// that only that node fits waits at most this long.
pub const MAX_AVOID_SECONDS: u64 = 24 * 3600;

/// NVIDIA's application XIDs: a user's kernel fault, the GPU stays healthy
/// and the node is not blamed.
pub const APPLICATION_XIDS: [u32; 5] = [13, 31, 43, 45, 68];

/// What an agent's "GPU unhealthy" verdict says about the node: a GPU lost
/// (fallen off the bus, XID 79, unreachable), a GPU fault, or nothing for an
/// application XID.
pub fn gpu_cause(gpu: u32, reason: &str) -> Option<Cause> {
    let lower = reason.to_ascii_lowercase();
    let xid = lower.split_once("xid").and_then(|(_, rest)| {
        let digits: String = rest
            .trim_start()
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse::<u32>().ok()
    });
    if xid.is_some_and(|x| APPLICATION_XIDS.contains(&x)) {
        return None;
    }
    if xid == Some(79)
        || lower.contains("fallen off the bus")
        || lower.contains("lost")
        || lower.contains("cannot reach")
    {
        return Some(Cause::GpuLost { gpu });
    }
    Some(Cause::GpuFault {
        gpu,
        reason: reason.to_string(),
    })
}

/// One piece of evidence against a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evidence {
    /// When it was seen.
    pub at: Time,
    /// The job that saw it, if one did.
    pub job: Option<JobId>,
    /// That job's owner.
    pub user: Option<String>,
    /// Why it counts.
    pub cause: Cause,
}

/// The knobs (from the server config).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlameConfig {
    /// Distinct jobs that failed on a node and then succeeded elsewhere
    /// before the node qualifies (0: never for that cause alone).
    pub jobs_to_qualify: u32,
    /// The rate limit's window in seconds.
    pub window_seconds: u64,
    /// Percent of the nodes that may be auto-cordoned per window (at least one).
    pub rate_percent: u32,
    /// Percent of the nodes qualifying at once above which auto-cordon stops.
    pub halt_percent: u32,
    /// Auto-cordon at all.
    pub enabled: bool,
    /// Seconds a gang restarted after a node fault avoids the blamed nodes
    /// (0: never). Bounded, so a gang those nodes alone can host still runs.
    pub avoid_seconds: u64,
}

impl Default for BlameConfig {
    fn default() -> Self {
        BlameConfig {
            jobs_to_qualify: 3,
            window_seconds: 600,
            rate_percent: 10,
            halt_percent: 50,
            enabled: true,
            avoid_seconds: 600,
        }
    }
}

impl BlameConfig {
    /// Auto-cordons allowed per window on a cluster of `nodes`.
    pub fn per_window(&self, nodes: usize) -> usize {
        (nodes.saturating_mul(self.rate_percent as usize) / 100).max(1)
    }
}

/// What the server should do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Cordon the node; `why` carries the evidence (jobs, users, causes).
    Cordon {
        /// Node.
        node: String,
        /// The evidence, for the node list, `describe node` and the audit log.
        why: String,
    },
    /// Too many nodes qualify at once: auto-cordon stops, raise the alert.
    Halt {
        /// The qualifying nodes.
        nodes: Vec<String>,
    },
    /// Few enough qualify again: auto-cordon resumes.
    Resume,
}

/// The blame state of the cluster.
#[derive(Clone, Debug, Default)]
pub struct Blame {
    cfg: BlameConfig,
    /// Plain failures not judged yet: per job, its owner and the nodes where
    /// its gangs failed.
    failed: BTreeMap<JobId, (String, BTreeSet<String>)>,
    /// Evidence per node (not yet cordoned for it).
    evidence: BTreeMap<String, Vec<Evidence>>,
    /// Auto-cordons in the current window: when and which node.
    recent: VecDeque<(Time, String)>,
    /// Per job, the nodes its next attempt should avoid.
    avoid: BTreeMap<JobId, BTreeSet<String>>,
    /// Auto-cordon is stopped (the alert is raised).
    halted: bool,
}

impl Blame {
    /// A fresh state with these knobs.
    pub fn new(cfg: BlameConfig) -> Self {
        Blame {
            cfg,
            ..Blame::default()
        }
    }

    /// The knobs.
    pub fn config(&self) -> BlameConfig {
        self.cfg
    }

    /// Whether auto-cordon is stopped (the alert is raised).
    pub fn halted(&self) -> bool {
        self.halted
    }

    /// The evidence held against `node`.
    pub fn evidence(&self, node: &str) -> &[Evidence] {
        self.evidence.get(node).map_or(&[], Vec::as_slice)
    }

    /// Nodes the job's next attempt should avoid (node-attributed failures).
    pub fn avoid(&self, job: JobId) -> Option<&BTreeSet<String>> {
        self.avoid.get(&job)
    }

    /// Takes the nodes `job`'s next attempt avoids, with when that lapses
    /// (`from` plus the configured time): the avoidance holds for that one
    /// attempt, later faults start a new set. `None` when it avoids none or
    /// avoidance is off.
    pub fn take_avoid(&mut self, job: JobId, from: Time) -> Option<(BTreeSet<String>, Time)> {
        let nodes = self.avoid.remove(&job).filter(|n| !n.is_empty())?;
        (self.cfg.avoid_seconds > 0).then(|| (nodes, from.saturating_add(self.cfg.avoid_seconds)))
    }

    /// A gang of `job` (owned by `user`) exited non-zero on `node`: the job's
    /// failure until it succeeds elsewhere.
    pub fn job_failed(&mut self, node: &str, job: JobId, user: &str) {
        self.failed
            .entry(job)
            .or_insert_with(|| (user.to_string(), BTreeSet::new()))
            .1
            .insert(node.to_string());
    }

    /// `job` succeeded on `nodes`: each node where it failed before and
    /// which is not among them gets the evidence.
    pub fn job_succeeded(&mut self, job: JobId, nodes: &[String], at: Time) {
        self.avoid.remove(&job);
        let Some((user, failed_on)) = self.failed.remove(&job) else {
            return;
        };
        for node in failed_on {
            if nodes.contains(&node) {
                continue;
            }
            self.add(
                &node,
                Evidence {
                    at,
                    job: Some(job),
                    user: Some(user.clone()),
                    cause: Cause::FailedHereSucceededElsewhere,
                },
            );
        }
    }

    /// `job` ended for good without succeeding: its failures were its own.
    pub fn job_gone(&mut self, job: JobId) {
        self.failed.remove(&job);
        self.avoid.remove(&job);
    }

    /// A failure the node caused, seen by `job` (and its owner) if any; the
    /// job's next attempt avoids the node.
    pub fn node_fault(&mut self, node: &str, job: Option<(JobId, &str)>, cause: Cause, at: Time) {
        if let Some((id, _)) = job {
            self.avoid.entry(id).or_default().insert(node.to_string());
        }
        self.add(
            node,
            Evidence {
                at,
                job: job.map(|(id, _)| id),
                user: job.map(|(_, u)| u.to_string()),
                cause,
            },
        );
    }

    /// The node is back in service (an admin uncordoned it, it passed
    /// probation) or was deleted: its evidence is spent.
    pub fn forget_node(&mut self, node: &str) {
        self.evidence.remove(node);
        for (_, nodes) in self.failed.values_mut() {
            nodes.remove(node);
        }
    }

    fn add(&mut self, node: &str, e: Evidence) {
        let list = self.evidence.entry(node.to_string()).or_default();
        // One job counts once per cause.
        if e.job.is_some() && list.iter().any(|x| x.job == e.job && x.cause == e.cause) {
            return;
        }
        list.push(e);
    }

    /// Whether the node's evidence is enough to blame it.
    fn qualifies(&self, node: &str) -> bool {
        let list = self.evidence(node);
        if list.iter().any(|e| e.cause.direct()) {
            return true;
        }
        let jobs: BTreeSet<JobId> = list.iter().filter_map(|e| e.job).collect();
        self.cfg.jobs_to_qualify > 0 && jobs.len() >= self.cfg.jobs_to_qualify as usize
    }

    /// Nodes whose evidence is enough to blame them and that are not
    /// cordoned yet.
    pub fn qualifying(&self, cordoned: impl Fn(&str) -> bool) -> Vec<String> {
        self.evidence
            .keys()
            .filter(|n| !cordoned(n) && self.qualifies(n))
            .cloned()
            .collect()
    }

    /// What to do now, on a cluster of `nodes` nodes where `cordoned` says
    /// which are cordoned already: cordon qualifying nodes within the rate
    /// limit, or stop (and resume) auto-cordoning.
    pub fn decide(
        &mut self,
        now: Time,
        nodes: usize,
        cordoned: impl Fn(&str) -> bool,
    ) -> Vec<Decision> {
        let window = self.cfg.window_seconds;
        while self
            .recent
            .front()
            .is_some_and(|(t, _)| now.saturating_sub(*t) >= window)
        {
            self.recent.pop_front();
        }
        let mut out = Vec::new();
        if !self.cfg.enabled {
            return out;
        }
        let waiting = self.qualifying(&cordoned);
        // Nodes failing together: those waiting plus those cordoned in the window.
        let together = waiting.len() + self.recent.len();
        let over = together.saturating_mul(100)
            > nodes.saturating_mul(self.cfg.halt_percent as usize)
            && together > 1;
        if over && !self.halted {
            self.halted = true;
            let mut all: Vec<String> = self.recent.iter().map(|(_, n)| n.clone()).collect();
            all.extend(waiting.iter().cloned());
            all.sort();
            all.dedup();
            out.push(Decision::Halt { nodes: all });
        } else if !over && self.halted {
            self.halted = false;
            out.push(Decision::Resume);
        }
        if self.halted {
            return out;
        }
        let allowed = self.cfg.per_window(nodes);
        for node in waiting {
            if self.recent.len() >= allowed {
                break;
            }
            let why = self.describe(&node);
            self.recent.push_back((now, node.clone()));
            self.evidence.remove(&node);
            out.push(Decision::Cordon { node, why });
        }
        out
    }

    /// The evidence against a node in one line: causes, jobs and users.
    pub fn describe(&self, node: &str) -> String {
        let list = self.evidence(node);
        let mut causes: Vec<String> = list.iter().map(|e| e.cause.to_string()).collect();
        causes.sort();
        causes.dedup();
        let jobs: BTreeSet<JobId> = list.iter().filter_map(|e| e.job).collect();
        let users: BTreeSet<&str> = list.iter().filter_map(|e| e.user.as_deref()).collect();
        let mut s = format!("causes: {}", causes.join("; "));
        if !jobs.is_empty() {
            let jobs: Vec<String> = jobs.iter().map(|j| j.to_string()).collect();
            s.push_str(&format!("; jobs: {}", jobs.join(", ")));
        }
        if !users.is_empty() {
            let users: Vec<&str> = users.into_iter().collect();
            s.push_str(&format!("; users: {}", users.join(", ")));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("n{i}")).collect()
    }

    #[test]
    fn one_users_jobs_failing_everywhere_blame_no_node() {
        let mut b = Blame::new(BlameConfig::default());
        let nodes = names(4);
        for j in 0..12u64 {
            b.job_failed(&nodes[j as usize % 4], JobId(j), "alice");
            b.job_gone(JobId(j));
        }
        assert!(b.decide(100, 4, |_| false).is_empty());
        assert!(b.qualifying(|_| false).is_empty());
    }

    #[test]
    fn jobs_failing_here_and_succeeding_elsewhere_blame_the_node() {
        let mut b = Blame::new(BlameConfig::default());
        for (j, user) in [(1, "alice"), (2, "bob"), (3, "carol")] {
            b.job_failed("n0", JobId(j), user);
            b.job_succeeded(JobId(j), &["n1".into()], 10);
        }
        let d = b.decide(10, 4, |_| false);
        let [Decision::Cordon { node, why }] = d.as_slice() else {
            panic!("{d:?}");
        };
        assert_eq!(node, "n0");
        assert!(why.contains("users: alice, bob, carol"), "{why}");
        assert!(why.contains("jobs: 1, 2, 3"), "{why}");
        // Two jobs only: not enough.
        let mut b = Blame::new(BlameConfig::default());
        for j in 1..=2 {
            b.job_failed("n0", JobId(j), "alice");
            b.job_succeeded(JobId(j), &["n1".into()], 10);
        }
        assert!(b.decide(10, 4, |_| false).is_empty());
    }

    #[test]
    fn a_gpu_fault_cordons_only_its_node_and_the_job_avoids_it() {
        let mut b = Blame::new(BlameConfig::default());
        b.node_fault("n2", Some((JobId(7), "bob")), Cause::GpuLost { gpu: 1 }, 5);
        assert_eq!(b.avoid(JobId(7)).map(|s| s.len()), Some(1));
        let d = b.decide(5, 4, |_| false);
        assert!(
            matches!(d.as_slice(), [Decision::Cordon { node, why }] if node == "n2" && why.contains("GPU 1 lost") && why.contains("users: bob")),
            "{d:?}"
        );
    }

    #[test]
    fn the_rate_limit_holds_then_frees_after_the_window() {
        let mut b = Blame::new(BlameConfig::default());
        let nodes = names(20);
        b.node_fault(&nodes[0], None, Cause::AgentFault("x".into()), 0);
        b.node_fault(&nodes[1], None, Cause::AgentFault("x".into()), 0);
        b.node_fault(&nodes[2], None, Cause::AgentFault("x".into()), 0);
        // 20 nodes: 2 per window.
        assert_eq!(b.decide(0, 20, |_| false).len(), 2);
        let cordoned = |n: &str| n == "n0" || n == "n1";
        assert!(b.decide(599, 20, cordoned).is_empty());
        assert_eq!(b.decide(600, 20, cordoned).len(), 1);
    }

    #[test]
    fn many_nodes_at_once_halt_and_raise_the_alert() {
        let mut b = Blame::new(BlameConfig::default());
        for n in names(3) {
            b.node_fault(&n, None, Cause::GpuLost { gpu: 0 }, 0);
        }
        let d = b.decide(0, 4, |_| false);
        assert!(
            matches!(d.as_slice(), [Decision::Halt { nodes }] if nodes.len() == 3),
            "{d:?}"
        );
        assert!(b.halted());
        assert!(b.decide(1, 4, |_| false).is_empty());
        for n in names(3) {
            b.forget_node(&n);
        }
        assert_eq!(b.decide(2, 4, |_| false), vec![Decision::Resume]);
    }

    #[test]
    fn gpu_verdicts_map_to_causes() {
        assert_eq!(gpu_cause(0, "XID 13: graphics engine exception"), None);
        assert_eq!(gpu_cause(0, "xid 43"), None);
        assert_eq!(
            gpu_cause(2, "XID 79: GPU has fallen off the bus"),
            Some(Cause::GpuLost { gpu: 2 })
        );
        assert_eq!(
            gpu_cause(1, "4 uncorrected ECC errors"),
            Some(Cause::GpuFault {
                gpu: 1,
                reason: "4 uncorrected ECC errors".into()
            })
        );
    }

    #[derive(Clone, Debug)]
    enum Event {
        Failed(usize, u64, u8),
        Succeeded(u64, usize),
        Gone(u64),
        Fault(usize, u8),
        Uncordon(usize),
        Tick(u64),
    }

    fn event(nodes: usize) -> impl Strategy<Value = Event> {
        prop_oneof![
            (0..nodes, 0..30u64, 0..4u8).prop_map(|(n, j, u)| Event::Failed(n, j, u)),
            (0..30u64, 0..nodes).prop_map(|(j, n)| Event::Succeeded(j, n)),
            (0..30u64).prop_map(Event::Gone),
            (0..nodes, 0..3u8).prop_map(|(n, c)| Event::Fault(n, c)),
            (0..nodes).prop_map(Event::Uncordon),
            (0..400u64).prop_map(Event::Tick),
        ]
    }

    proptest! {
        /// Whatever the failure stream, auto-cordons in any window never
        /// exceed max(1, 10 %) of the nodes.
        #[test]
        fn auto_cordons_never_exceed_the_rate_limit(
            nodes in 1usize..40,
            events in prop::collection::vec(event(40), 1..300),
        ) {
            let cfg = BlameConfig::default();
            let mut b = Blame::new(cfg);
            let names = names(nodes);
            let mut cordoned: BTreeSet<String> = BTreeSet::new();
            let mut now: Time = 0;
            let mut log: Vec<Time> = Vec::new();
            for e in events {
                match e {
                    Event::Failed(n, j, u) => b.job_failed(&names[n % nodes], JobId(j), &format!("u{u}")),
                    Event::Succeeded(j, n) => b.job_succeeded(JobId(j), &[names[n % nodes].clone()], now),
                    Event::Gone(j) => b.job_gone(JobId(j)),
                    Event::Fault(n, c) => {
                        let cause = match c {
                            0 => Cause::GpuLost { gpu: 0 },
                            1 => Cause::GpuFault { gpu: 1, reason: "XID 79".into() },
                            _ => Cause::AgentFault("cgroup".into()),
                        };
                        b.node_fault(&names[n % nodes], Some((JobId(1), "u")), cause, now);
                    }
                    Event::Uncordon(n) => {
                        cordoned.remove(&names[n % nodes]);
                        b.forget_node(&names[n % nodes]);
                    }
                    Event::Tick(s) => now += s,
                }
                for d in b.decide(now, nodes, |n| cordoned.contains(n)) {
                    if let Decision::Cordon { node, .. } = d {
                        prop_assert!(cordoned.insert(node));
                        log.push(now);
                    }
                }
                let in_window = log.iter().filter(|t| now - **t < cfg.window_seconds).count();
                prop_assert!(in_window <= cfg.per_window(nodes), "{in_window} cordons in a window of {nodes} nodes");
            }
        }
    }
}
