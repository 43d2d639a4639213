//! Probation: the way back to service for a node that node blame cordoned
//! (see [`crate::blame`]). A pure state machine (events in, decisions out,
//! no I/O), so the server's call sites stay thin.
//!
//! The server cannot send a node a command to run (a server-config or
//! admin-token holder would then be root on every node); it can only ask
//! the node's agent to run the health check its operator configured there
//! (`gangway agent --health-check`, as Slurm's `HealthCheckProgram`). After
//! `after_seconds`, once the node has no jobs left, its agent is asked (in
//! its sync answer) to run the check once, as a numbered run; the run's
//! result comes back in a later sync. A pass returns the node to service;
//! a failure keeps it cordoned and tries again after a backoff that doubles
//! up to `max_backoff_seconds`.
//!
//! Only blame's cordons are on probation: an admin's cordon (or uncordon)
//! ends it, and a result for any run but the one asked for last is
//! ignored, so no result ever lifts an admin's cordon.

use gangway_core::agent::HealthCheckReport;
use gangway_core::Time;
use std::collections::{BTreeMap, BTreeSet};

/// Longest `probation_after_seconds` the server config accepts (a week).
pub const MAX_AFTER_SECONDS: u64 = 7 * 24 * 3600;

/// The knobs (from the server config).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbationConfig {
    /// Seconds after an auto-cordon before the first health check (0: no
    /// probation; the node stays cordoned until an admin uncordons it).
    pub after_seconds: u64,
    /// The retry backoff doubles after each failure up to this.
    pub max_backoff_seconds: u64,
}

impl Default for ProbationConfig {
    fn default() -> Self {
        ProbationConfig {
            after_seconds: 300,
            max_backoff_seconds: 3600,
        }
    }
}

impl ProbationConfig {
    /// The wait before the next try after `failures` failed ones:
    /// `after_seconds x 2^failures`, at most `max_backoff_seconds` (or
    /// `after_seconds` when that is longer).
    pub fn backoff(&self, failures: u32) -> u64 {
        let cap = self.max_backoff_seconds.max(self.after_seconds);
        self.after_seconds
            .checked_mul(1u64 << failures.min(32))
            .unwrap_or(cap)
            .min(cap)
    }
}

/// Where a node on probation stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The next try is due at this time (once the node has no jobs).
    Due(Time),
    /// Its agent was asked to run the check as `run` at `since`.
    Running {
        /// The run's number.
        run: u64,
        /// When it was asked for.
        since: Time,
    },
}

/// One node on probation.
#[derive(Clone, Debug, PartialEq, Eq)]
struct OnProbation {
    /// Why blame cordoned it.
    reason: String,
    phase: Phase,
    /// Failed tries so far.
    failures: u32,
    /// The last failure: when, and why (`exit N: LAST LINE`).
    last_failure: Option<(Time, String)>,
}

/// What a health check result did, for the audit log and the metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The node passed: it goes back to service.
    Passed {
        /// Node.
        node: String,
        /// The check's last line of output.
        last_line: String,
    },
    /// The node failed: it stays cordoned until the next try.
    Failed {
        /// Node.
        node: String,
        /// `exit N: LAST LINE`.
        why: String,
        /// When it is tried again.
        next_at: Time,
    },
}

/// The probation state of the cluster.
#[derive(Clone, Debug)]
pub struct Probation {
    cfg: ProbationConfig,
    nodes: BTreeMap<String, OnProbation>,
    /// Nodes whose agent says it has a health check.
    checks: BTreeSet<String>,
    /// The last run number handed out.
    last_run: u64,
    /// Run numbers up to this one may be handed out (the server reserves
    /// them in the store, so a later leader numbers its runs above them).
    reserved: u64,
    /// Outcomes since the API last took them.
    log: Vec<Outcome>,
}

/// Longest line of a check's output kept in a reason.
const MAX_LINE: usize = 200;

fn clip(s: &str) -> String {
    let s = s.trim();
    if s.len() <= MAX_LINE {
        return s.to_string();
    }
    let mut end = MAX_LINE;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

impl Default for Probation {
    fn default() -> Self {
        Probation::new(ProbationConfig::default())
    }
}

impl Probation {
    /// A fresh state with these knobs, its run numbers unreserved (no
    /// earlier leader to collide with).
    pub fn new(cfg: ProbationConfig) -> Self {
        Probation {
            cfg,
            nodes: BTreeMap::new(),
            checks: BTreeSet::new(),
            last_run: 0,
            reserved: u64::MAX,
            log: Vec::new(),
        }
    }

    /// A new leader's state: its run numbers go above `last`, the highest
    /// an earlier leader may have handed out, and none is handed out until
    /// [`Probation::reserve`] allows it.
    pub fn runs_above(&mut self, last: u64) {
        self.last_run = last;
        self.reserved = last;
    }

    /// Whether every reserved run number is spent (the server reserves
    /// more before a run can start).
    pub fn runs_spent(&self) -> bool {
        self.last_run >= self.reserved
    }

    /// The last run number handed out.
    pub fn last_run(&self) -> u64 {
        self.last_run
    }

    /// Run numbers up to `upto` are reserved (stored) and may be handed out.
    pub fn reserve(&mut self, upto: u64) {
        self.reserved = upto;
    }

    /// New knobs, right after the state was loaded: each node on probation
    /// is tried `after_seconds` from `now` (none is on probation when
    /// probation is off).
    pub fn reconfigure(&mut self, cfg: ProbationConfig, now: Time) {
        self.cfg = cfg;
        if cfg.after_seconds == 0 {
            self.nodes.clear();
        }
        for p in self.nodes.values_mut() {
            p.phase = Phase::Due(now.saturating_add(cfg.after_seconds));
        }
    }

    /// The knobs.
    pub fn config(&self) -> ProbationConfig {
        self.cfg
    }

    /// Blame cordoned `node` for `reason` at `now`: its probation starts
    /// (unless probation is off).
    pub fn start(&mut self, node: &str, reason: &str, now: Time) {
        if self.cfg.after_seconds == 0 {
            return;
        }
        self.nodes.insert(
            node.to_string(),
            OnProbation {
                reason: reason.to_string(),
                phase: Phase::Due(now.saturating_add(self.cfg.after_seconds)),
                failures: 0,
                last_failure: None,
            },
        );
    }

    /// An admin cordoned or uncordoned the node, or it was deleted: its
    /// probation ends. Returns the blame reason when it was on probation.
    pub fn end(&mut self, node: &str) -> Option<String> {
        self.nodes.remove(node).map(|p| p.reason)
    }

    /// Where the node stands, when it is on probation.
    pub fn phase(&self, node: &str) -> Option<&Phase> {
        self.nodes.get(node).map(|p| &p.phase)
    }

    /// The node's agent says whether it has a health check; returns
    /// whether that changed what a node on probation shows.
    pub fn agent_check(&mut self, node: &str, has: bool) -> bool {
        if has == self.checks.contains(node) {
            return false;
        }
        if has {
            self.checks.insert(node.to_string());
        } else {
            self.checks.remove(node);
        }
        self.nodes.contains_key(node)
    }

    /// The run the node's sync answer asks for, if any, and whether a new
    /// run started (what the node shows changed). A run is started when the
    /// node's try is due, its agent has a check and no job is left on it
    /// (`idle`); a started run is asked for until its result comes.
    pub fn ask(&mut self, node: &str, now: Time, idle: bool) -> (Option<u64>, bool) {
        let has = self.checks.contains(node);
        let Some(p) = self.nodes.get_mut(node) else {
            return (None, false);
        };
        match p.phase {
            Phase::Running { since, .. } if !has => {
                // The agent lost its check (restarted without it).
                p.phase = Phase::Due(since);
                (None, true)
            }
            Phase::Running { run, .. } => (Some(run), false),
            Phase::Due(at) if has && idle && at <= now && self.last_run < self.reserved => {
                self.last_run += 1;
                let run = self.last_run;
                p.phase = Phase::Running { run, since: now };
                (Some(run), true)
            }
            Phase::Due(_) => (None, false),
        }
    }

    /// The agent's report of a run: the outcome when it is the result of
    /// the run asked for last (any other run, or one still going, is
    /// ignored). A pass ends the probation (the caller uncordons the node);
    /// a failure schedules the next try.
    pub fn report(&mut self, node: &str, r: &HealthCheckReport, now: Time) -> Option<Outcome> {
        let p = self.nodes.get_mut(node)?;
        match p.phase {
            Phase::Running { run, .. } if run == r.run => {}
            _ => return None,
        }
        let result = r.result.as_ref()?;
        let last_line = clip(result.last_line());
        let outcome = if result.passed() {
            self.nodes.remove(node);
            Outcome::Passed {
                node: node.to_string(),
                last_line,
            }
        } else {
            p.failures = p.failures.saturating_add(1);
            let next_at = now.saturating_add(self.cfg.backoff(p.failures));
            let why = format!("exit {}: {last_line}", result.exit_code);
            p.last_failure = Some((now, why.clone()));
            p.phase = Phase::Due(next_at);
            Outcome::Failed {
                node: node.to_string(),
                why,
                next_at,
            }
        };
        self.log.push(outcome.clone());
        Some(outcome)
    }

    /// The outcomes since the last call (for the audit log and metrics).
    pub fn take_log(&mut self) -> Vec<Outcome> {
        std::mem::take(&mut self.log)
    }

    /// The cordon reason of a node on probation: blame's reason and where
    /// the probation stands (`nodes`, `describe node`).
    pub fn reason(&self, node: &str) -> Option<String> {
        let p = self.nodes.get(node)?;
        let mut s = p.reason.clone();
        if let Some((at, why)) = &p.last_failure {
            s.push_str(&format!(
                "; health check failed: {why} (at {at}, {} failed so far)",
                p.failures
            ));
        }
        if !self.checks.contains(node) {
            s.push_str(
                "; no health check configured on its agent: stays cordoned until an admin uncordons it",
            );
            return Some(s);
        }
        match p.phase {
            Phase::Due(at) if p.failures == 0 => s.push_str(&format!(
                "; probation: health check due at {at} (once no job runs on it)"
            )),
            Phase::Due(at) => s.push_str(&format!("; next try at {at}")),
            Phase::Running { run, since } => s.push_str(&format!(
                "; probation: health check run {run} running since {since}"
            )),
        }
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::agent::HealthCheckResult;
    use proptest::prelude::*;

    fn done(run: u64, exit_code: i32, line: &str) -> HealthCheckReport {
        HealthCheckReport {
            run,
            result: Some(HealthCheckResult {
                exit_code,
                tail: vec![line.to_string(), String::new()],
            }),
        }
    }

    fn cfg() -> ProbationConfig {
        ProbationConfig {
            after_seconds: 60,
            max_backoff_seconds: 3600,
        }
    }

    #[test]
    fn a_passing_check_after_the_delay_returns_the_node() {
        let mut p = Probation::new(cfg());
        p.start(
            "n0",
            "cordoned automatically at 100: causes: GPU 1 lost",
            100,
        );
        p.agent_check("n0", true);
        assert_eq!(p.ask("n0", 159, true), (None, false), "not due yet");
        assert_eq!(p.ask("n0", 160, false), (None, false), "a job still runs");
        assert_eq!(p.ask("n0", 160, true), (Some(1), true));
        assert!(p
            .reason("n0")
            .expect("reason")
            .contains("running since 160"));
        // Asked again until its result comes; still running is no result.
        assert_eq!(p.ask("n0", 161, true), (Some(1), false));
        let running = HealthCheckReport {
            run: 1,
            result: None,
        };
        assert_eq!(p.report("n0", &running, 161), None);
        let out = p.report("n0", &done(1, 0, "all 8 GPUs ok"), 170);
        assert_eq!(
            out,
            Some(Outcome::Passed {
                node: "n0".into(),
                last_line: "all 8 GPUs ok".into()
            })
        );
        assert_eq!(p.phase("n0"), None);
        assert_eq!(p.ask("n0", 171, true), (None, false));
        assert_eq!(p.take_log().len(), 1);
        assert!(p.take_log().is_empty());
    }

    #[test]
    fn a_failing_check_keeps_the_node_and_retries_with_a_doubling_capped_backoff() {
        let mut p = Probation::new(cfg());
        p.start("n0", "blamed", 0);
        p.agent_check("n0", true);
        let mut now = 60;
        let mut waits = Vec::new();
        for _ in 0..8 {
            let (Some(run), _) = p.ask("n0", now, true) else {
                panic!("due at {now}: {:?}", p.phase("n0"));
            };
            let Some(Outcome::Failed { why, next_at, .. }) =
                p.report("n0", &done(run, 1, "nccl loopback failed"), now)
            else {
                panic!("failed");
            };
            assert_eq!(why, "exit 1: nccl loopback failed");
            waits.push(next_at - now);
            assert_eq!(p.ask("n0", next_at - 1, true), (None, false));
            now = next_at;
        }
        assert_eq!(waits, [120, 240, 480, 960, 1920, 3600, 3600, 3600]);
        let r = p.reason("n0").expect("reason");
        assert!(
            r.starts_with("blamed; health check failed: exit 1: nccl loopback failed"),
            "{r}"
        );
        assert!(r.contains("next try at"), "{r}");
        assert_eq!(ProbationConfig::default().backoff(u32::MAX), 3600);
        let long = ProbationConfig {
            after_seconds: u64::MAX,
            max_backoff_seconds: 10,
        };
        assert_eq!(long.backoff(3), u64::MAX, "never below the first wait");
    }

    #[test]
    fn an_admin_cordon_ends_probation_and_a_late_result_lifts_nothing() {
        let mut p = Probation::new(cfg());
        p.start("n0", "blamed", 0);
        p.agent_check("n0", true);
        assert_eq!(p.ask("n0", 60, true), (Some(1), true));
        assert_eq!(p.end("n0").as_deref(), Some("blamed"));
        assert_eq!(p.report("n0", &done(1, 0, "ok"), 61), None);
        // Blamed again later: the old run's pass does not count either.
        p.start("n0", "blamed again", 100);
        assert_eq!(p.ask("n0", 160, true), (Some(2), true));
        assert_eq!(p.report("n0", &done(1, 0, "ok"), 161), None);
        assert!(p.report("n0", &done(2, 0, "ok"), 161).is_some());
    }

    /// A node's agent may report only what it was asked: a pass it sends
    /// unasked (before its run is due, for a run number it guessed, for
    /// another node's run, or while not on probation at all) lifts nothing.
    #[test]
    fn an_unasked_pass_lifts_nothing() {
        let mut p = Probation::new(cfg());
        assert_eq!(
            p.report("n0", &done(1, 0, "ok"), 10),
            None,
            "not on probation"
        );
        p.start("n0", "blamed", 0);
        p.start("n1", "blamed", 0);
        p.agent_check("n0", true);
        p.agent_check("n1", true);
        for run in [0, 1, 2, u64::MAX] {
            assert_eq!(
                p.report("n0", &done(run, 0, "ok"), 30),
                None,
                "not asked yet"
            );
        }
        assert_eq!(p.ask("n1", 60, true), (Some(1), true));
        assert_eq!(p.report("n0", &done(1, 0, "ok"), 61), None, "n1's run");
        assert_eq!(p.ask("n0", 61, true), (Some(2), true));
        assert_eq!(p.report("n0", &done(3, 0, "ok"), 62), None, "a later run");
        assert!(p.phase("n0").is_some(), "still on probation");
        assert!(p.report("n0", &done(2, 0, "ok"), 62).is_some());
    }

    #[test]
    fn without_a_check_the_node_says_so_and_is_never_asked() {
        let mut p = Probation::new(cfg());
        p.start("n0", "blamed", 0);
        assert_eq!(p.ask("n0", 1000, true), (None, false));
        let r = p.reason("n0").expect("reason");
        assert!(r.contains("no health check configured on its agent"), "{r}");
        // The agent restarts with a check: it is asked now; without it
        // again, the run is forgotten.
        assert!(p.agent_check("n0", true));
        assert_eq!(p.ask("n0", 1000, true), (Some(1), true));
        assert!(p.agent_check("n0", false));
        assert_eq!(p.ask("n0", 1001, true), (None, true));
        assert!(!p.agent_check("n1", false), "not on probation");
    }

    #[test]
    fn probation_off_starts_nothing() {
        let mut p = Probation::new(ProbationConfig {
            after_seconds: 0,
            ..cfg()
        });
        p.start("n0", "blamed", 0);
        p.agent_check("n0", true);
        assert_eq!(p.ask("n0", 10_000, true), (None, false));
        assert_eq!(p.reason("n0"), None);
    }

    #[test]
    fn long_output_lines_are_clipped_in_the_reason() {
        let mut p = Probation::new(cfg());
        p.start("n0", "blamed", 0);
        p.agent_check("n0", true);
        p.ask("n0", 60, true);
        let line = "é".repeat(500);
        let Some(Outcome::Failed { why, .. }) = p.report("n0", &done(1, 3, &line), 60) else {
            panic!("failed");
        };
        assert!(why.len() < 220, "{}", why.len());
        assert!(why.ends_with("..."));
    }

    #[test]
    fn a_new_leaders_runs_wait_for_their_reservation_and_number_above_the_old_ones() {
        let mut p = Probation::new(cfg());
        p.runs_above(41);
        p.start("n0", "blamed", 0);
        p.agent_check("n0", true);
        assert!(p.runs_spent());
        assert_eq!(p.ask("n0", 60, true), (None, false), "none reserved yet");
        p.reserve(42);
        assert_eq!(p.ask("n0", 60, true), (Some(42), true));
        assert!(p.runs_spent());
        assert_eq!(p.last_run(), 42);
        // The earlier leader's run 41 passing lifts nothing.
        assert_eq!(p.report("n0", &done(41, 0, "ok"), 61), None);
        assert!(p.report("n0", &done(42, 0, "ok"), 61).is_some());
    }

    #[test]
    fn reconfigured_knobs_count_the_delay_from_the_load() {
        let mut p = Probation::new(cfg());
        p.start("n0", "blamed", 0);
        assert_eq!(p.phase("n0"), Some(&Phase::Due(60)));
        let later = ProbationConfig {
            after_seconds: 500,
            max_backoff_seconds: 3600,
        };
        p.reconfigure(later, 1000);
        assert_eq!(p.phase("n0"), Some(&Phase::Due(1500)));
        assert_eq!(p.config(), later);
        p.reconfigure(
            ProbationConfig {
                after_seconds: 0,
                ..later
            },
            1000,
        );
        assert_eq!(p.phase("n0"), None, "probation off");
    }

    #[derive(Clone, Debug)]
    enum Event {
        Blame(usize),
        AdminCordon(usize),
        AdminUncordon(usize),
        Check(usize, bool),
        Sync(usize, bool),
        Report(usize, u64, bool),
        Tick(u64),
    }

    fn event(nodes: usize) -> impl Strategy<Value = Event> {
        prop_oneof![
            (0..nodes).prop_map(Event::Blame),
            (0..nodes).prop_map(Event::AdminCordon),
            (0..nodes).prop_map(Event::AdminUncordon),
            (0..nodes, any::<bool>()).prop_map(|(n, b)| Event::Check(n, b)),
            (0..nodes, any::<bool>()).prop_map(|(n, b)| Event::Sync(n, b)),
            (0..nodes, 0..12u64, any::<bool>()).prop_map(|(n, r, ok)| Event::Report(n, r, ok)),
            (0..200u64).prop_map(Event::Tick),
        ]
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Cordon {
        Auto,
        Admin,
    }

    proptest! {
        /// Whatever the event stream (results of any run, late or early,
        /// cordons and uncordons in any order), a probation result never
        /// lifts an admin's cordon, only a node blame cordoned and whose
        /// last asked-for run passed, and never before its delay.
        #[test]
        fn an_admin_cordon_is_never_lifted_by_a_probation_result(
            events in prop::collection::vec(event(4), 1..300),
        ) {
            let mut p = Probation::new(cfg());
            let mut cordons: BTreeMap<usize, (Cordon, Time)> = BTreeMap::new();
            let mut asked: BTreeMap<usize, u64> = BTreeMap::new();
            let mut now: Time = 0;
            let name = |n: usize| format!("n{n}");
            for e in events {
                match e {
                    Event::Blame(n) => {
                        if cordons.contains_key(&n) {
                            continue; // Blame never cordons a cordoned node.
                        }
                        cordons.insert(n, (Cordon::Auto, now));
                        p.start(&name(n), "blamed", now);
                    }
                    Event::AdminCordon(n) => {
                        cordons.insert(n, (Cordon::Admin, now));
                        p.end(&name(n));
                    }
                    Event::AdminUncordon(n) => {
                        cordons.remove(&n);
                        p.end(&name(n));
                    }
                    Event::Check(n, b) => {
                        p.agent_check(&name(n), b);
                    }
                    Event::Sync(n, idle) => {
                        if let (Some(run), _) = p.ask(&name(n), now, idle) {
                            prop_assert!(matches!(cordons.get(&n), Some((Cordon::Auto, _))));
                            asked.insert(n, run);
                        }
                    }
                    Event::Report(n, back, ok) => {
                        // A result of the last run asked for, or an older one.
                        let run = asked.get(&n).copied().unwrap_or(0).saturating_sub(back % 3);
                        let r = done(run, if ok { 0 } else { 1 }, "x");
                        if let Some(Outcome::Passed { .. }) = p.report(&name(n), &r, now) {
                            let c = cordons.remove(&n);
                            prop_assert!(
                                matches!(c, Some((Cordon::Auto, at)) if now >= at + cfg().after_seconds),
                                "{n}: a pass lifted {c:?} at {now}"
                            );
                            prop_assert_eq!(Some(&run), asked.get(&n));
                        }
                    }
                    Event::Tick(s) => now += s,
                }
                for (n, (c, _)) in &cordons {
                    if *c == Cordon::Admin {
                        prop_assert!(p.phase(&name(*n)).is_none(), "admin cordon of n{n} on probation");
                    }
                }
            }
        }
    }
}
