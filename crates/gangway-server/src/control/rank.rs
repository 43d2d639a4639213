//! Ranking in the live server: every cycle, each live job's priority and
//! rank inside its queue are set from its stored record by the scheduling
//! policy the cluster's policy names (`scheduler.policy`, a plugin of
//! [`gangway_sched::policies`], the same code the simulator measures). For
//! the default policy, `gangway`, that is the class plus an
//! attained-service band, and the predicted remaining work with aging
//! ([`gangway_sched::rank`]).
//!
//! A queue whose `ordering` is `fifo` keeps its jobs at their class's top
//! band with rank 0: priority, then submission order
//! ([`gangway_sched::rank::rank_in`]).
//!
//! Running jobs are ranked when their band moves as they run (at the time
//! [`gangway_sched::rank::verdict_moves_after`] says) or their records
//! change; pending ones when they enter the scheduler or start a new
//! attempt, and all of them every [`REFRESH_SECONDS`] (aging, predictions
//! learned since) or when a policy is installed (a queue's ordering may
//! have changed).
//!
//! A running job's rank (its predicted remaining work) also follows the
//! run-time predictor, which learns from every job that ends; between its
//! rankings it is left as it was. That changes no decision: the core reads
//! a job's rank only from the pending index, and a job leaves the GPUs only
//! through [`Control::apply_ending`], which marks it entered (with a new
//! attempt after a requeue or a restart), so it is ranked afresh before any
//! cycle sees it pending. Its priority, which the core does read (victims,
//! preemption), is kept exact.

use super::Control;
use crate::records::JobRecord;
use gangway_core::{BeginAt, JobId, JobState, Time};
use gangway_sched::policy::RankInput;
use gangway_sched::rank::{self, KnownRuntime, RankFacts, Ranked, REFRESH_SECONDS};
use gangway_sched::JobStatus;
use gangway_store::Store;
use std::collections::HashMap;

/// The ranking's view of one stored job at `now`; `running` says whether
/// the scheduler has it running.
#[cfg(test)]
pub(crate) fn facts(rec: &JobRecord, running: bool, runtime: KnownRuntime, now: Time) -> RankFacts {
    facts_started(rec, running.then(|| rec.attempt_started()), runtime, now)
}

/// The ranking's view of one stored job at `now`, with `started` the record's
/// [`JobRecord::attempt_started`] when the scheduler has the job running
/// (`None`: it has not), looked up once by the caller.
fn facts_started(
    rec: &JobRecord,
    started: Option<Option<Time>>,
    runtime: KnownRuntime,
    now: Time,
) -> RankFacts {
    let running_for = started.map(|s| s.map_or(0, |s| now.saturating_sub(s)));
    // Waiting counts from submission, or from the begin time the user asked
    // for, less the time its attempts ran.
    let since = match rec.spec.begin {
        Some(BeginAt::Seconds(b)) => b.max(rec.submitted_at),
        _ => rec.submitted_at,
    };
    let waited = now
        .saturating_sub(since)
        .saturating_sub(rec.run_seconds)
        .saturating_sub(running_for.unwrap_or(0));
    RankFacts {
        class: rec.spec.priority.value(),
        gpus: rec.spec.total_gpus(),
        attained_gpu_seconds: rec.attained_gpu_seconds,
        running_for,
        waited,
        submitted: rec.submitted_at,
        runtime,
    }
}

/// Record states whose jobs hold GPUs: the scheduler may have them running,
/// and a running job's band moves as it runs.
const ON_GPUS: [JobState; 3] = [JobState::Scheduled, JobState::Running, JobState::Preempting];

/// Record states whose jobs are ranked; restarting jobs are out of line
/// until their backoff ends.
const RANKED: [JobState; 6] = [
    JobState::Pending,
    JobState::Admitted,
    JobState::Scheduled,
    JobState::Running,
    JobState::Preempting,
    JobState::Requeued,
];

impl<S: Store> Control<S> {
    /// Sets every live job's priority and in-queue rank (see the module doc);
    /// returns how many jobs it looked at.
    ///
    /// Between refreshes a pending job's verdict changes only when its
    /// record does or when it enters the scheduler again, and a running
    /// job's priority only when its record does or its band moves, so only
    /// the jobs whose records were written since the last call
    /// ([`crate::records::JobTable::take_changed`]), those that entered the
    /// scheduler without a write ([`crate::parts::RankMemo::entered`]) and the running
    /// jobs whose band has moved by `now` ([`crate::parts::RankMemo::due`]) are looked
    /// at, not the backlog nor every job on GPUs; the priorities and the
    /// pending jobs' ranks are the ones a walk of every job gives (property
    /// tests check it, and that the decisions are those of ranking every
    /// running job every cycle).
    pub(crate) fn rank_jobs(&mut self, now: Time) -> usize {
        let refresh = self
            .ranks
            .refreshed_at
            .is_none_or(|t| now >= t.saturating_add(REFRESH_SECONDS));
        let plugin = gangway_sched::policies::of(&self.policy.sched);
        if refresh && plugin.changes().queue_usage {
            let dt = self.ranks.refreshed_at.map_or(0, |t| now.saturating_sub(t));
            self.ranks.usage.accrue(&self.cluster, dt);
        }
        let changed = self.jobs.take_changed();
        let entered = std::mem::take(&mut self.ranks.entered);
        let went_back = self.ranks.last_at.is_some_and(|t| now < t);
        #[cfg(test)]
        let went_back = went_back || self.ranks.every_running;
        let ids = if refresh {
            // Every running job is ranked below and gets its time anew.
            self.ranks.due.clear();
            self.ranks.due_of.clear();
            self.jobs.ids_in_states(&RANKED)
        } else {
            let mut ids: Vec<JobId> = changed.into_iter().chain(entered).collect();
            if went_back {
                ids.extend(self.jobs.ids_in_states(&ON_GPUS));
            }
            // The running jobs whose band has moved by now.
            while let Some(&(at, id)) = self.ranks.due.first() {
                if at > now {
                    break;
                }
                self.ranks.due.pop_first();
                if self.ranks.due_of.get(&id) == Some(&at) {
                    self.ranks.due_of.remove(&id);
                    ids.push(id);
                }
            }
            ids.retain(|id| {
                self.jobs
                    .get(id)
                    .is_some_and(|(r, _)| RANKED.contains(&r.state))
            });
            ids.sort_unstable();
            ids.dedup();
            ids
        };
        let looked_at = ids.len();
        let mut verdicts = Vec::new();
        // Predictions per job key, for this pass only (the predictor does
        // not change during it): running jobs of one kind share one lookup.
        let mut predicted = HashMap::new();
        let predictor = self.cluster.predictor();
        for id in ids {
            let (Some((rec, _)), Some(job)) = (self.jobs.get(&id), self.cluster.job(id)) else {
                continue;
            };
            let running = matches!(job.status, JobStatus::Running(_));
            if !running && !refresh {
                let current = Ranked {
                    priority: job.priority,
                    rank: job.rank,
                };
                if self.ranks.applied.get(&rec.id) == Some(&(rec.attempt, current)) {
                    continue;
                }
            }
            // As `KnownRuntime::of`, with the lookup shared.
            let runtime = match job.spec.runtime_seconds {
                Some(d) => KnownRuntime::Declared(d),
                None => {
                    let k = job.predict_key();
                    let p = *predicted
                        .entry((k.user, k.name, k.queue, k.gpus))
                        .or_insert_with(|| predictor.predict(&k));
                    p.map_or(KnownRuntime::Unknown, KnownRuntime::Predicted)
                }
            };
            let started = running.then(|| rec.attempt_started());
            let f = facts_started(rec, started, runtime, now);
            let input = self.rank_input(rec, job, &f, now);
            let r = plugin.rank(&input).ranked(f.class);
            // When its band moves. Without a start (placed, not reported
            // running) its running time stays 0 until its record changes.
            let due = match started {
                Some(Some(_)) => plugin.moves_after(&input).map(|dt| now.saturating_add(dt)),
                _ => None,
            };
            verdicts.push((rec.id, rec.attempt, r, due));
        }
        for (id, attempt, r, due) in verdicts {
            if rank::apply(&mut self.cluster, id, r).is_ok() {
                self.ranks.applied.insert(id, (attempt, r));
                match due {
                    Some(at) => {
                        self.ranks.due.insert((at, id));
                        self.ranks.due_of.insert(id, at);
                    }
                    None => {
                        self.ranks.due_of.remove(&id);
                    }
                }
            }
        }
        self.ranks.last_at = Some(now);
        if refresh {
            self.ranks.refreshed_at = Some(now);
            let cluster = &self.cluster;
            self.ranks
                .applied
                .retain(|id, _| cluster.job(*id).is_some());
        }
        looked_at
    }

    /// What the scheduling policy reads to rank `job` (stored as `rec`).
    fn rank_input<'a>(
        &'a self,
        rec: &'a JobRecord,
        job: &'a gangway_sched::Job,
        facts: &'a RankFacts,
        now: Time,
    ) -> RankInput<'a> {
        let queue = &self.cluster.queues()[job.queue as usize].spec;
        RankInput {
            facts,
            class: rec.spec.priority,
            queue: &queue.name,
            ordering: queue.ordering,
            now,
            params: &self.ranks.params,
            state: &self.cluster,
            usage: &self.ranks.usage,
        }
    }

    /// The jobs a walk of every ranked job would rank differently now: a
    /// running one whose priority moved (its rank is read only once it is
    /// pending again: see the module doc), or a pending one whose applied
    /// verdict is not the one remembered for its attempt (what the old walk
    /// re-ranked). Empty right after [`Control::rank_jobs`] at `now`.
    #[cfg(test)]
    pub(crate) fn rank_drift(&self, now: Time) -> Vec<JobId> {
        let mut out = Vec::new();
        for rec in self.jobs.in_states(&RANKED) {
            let Some(job) = self.cluster.job(rec.id) else {
                continue;
            };
            let running = matches!(job.status, JobStatus::Running(_));
            let current = Ranked {
                priority: job.priority,
                rank: job.rank,
            };
            let stale = if running {
                let runtime = KnownRuntime::of(job, self.cluster.predictor());
                let plugin = gangway_sched::policies::of(&self.policy.sched);
                let f = facts(rec, running, runtime, now);
                let r = plugin
                    .rank(&self.rank_input(rec, job, &f, now))
                    .ranked(f.class);
                r.priority != current.priority
            } else {
                self.ranks.applied.get(&rec.id) != Some(&(rec.attempt, current))
            };
            if stale {
                out.push(rec.id);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::Report;
    use super::*;
    use gangway_core::{JobSpec, NodeSpec, PriorityClass, QueueSpec};
    use gangway_store::RedbStore;

    /// A server with one 4-GPU node and one queue.
    fn server() -> (tempfile::TempDir, Control<RedbStore>) {
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let mut c = Control::open(store, &[QueueSpec::unlimited("q", None)]).expect("control");
        c.register_node(
            NodeSpec::uniform("n", "leaf0", "spine0", 4, "H100", 80),
            &crate::nodes::Registrant::Join,
            true,
            "join",
            0,
        )
        .expect("node");
        (dir, c)
    }

    /// A job of the whole node (4 GPUs), with a declared run time.
    fn whole_node(name: &str, runtime: Option<u64>) -> JobSpec {
        let mut s = JobSpec::new(name, "q", 1, 4);
        s.runtime_seconds = runtime;
        s
    }

    /// Reports the job's current attempt running at `at` and exited (0) at `end`.
    fn run_to_end(c: &mut Control<RedbStore>, id: JobId, at: Time, end: Time) {
        let attempt = c.jobs[&id].0.attempt;
        c.report("n", id, Some(attempt), Report::Running, at)
            .expect("running");
        c.report("n", id, Some(attempt), Report::Exited(0), end)
            .expect("exited");
    }

    fn state(c: &Control<RedbStore>, id: JobId) -> JobState {
        c.jobs[&id].0.state
    }

    #[test]
    fn the_job_with_less_declared_remaining_work_starts_first() {
        let (_d, mut c) = server();
        let blocker = c.submit("alice", whole_node("b", None), 0).expect("submit");
        c.cycle(1).expect("cycle");
        let long = c
            .submit("alice", whole_node("long", Some(7200)), 2)
            .expect("submit");
        let short = c
            .submit("alice", whole_node("short", Some(600)), 3)
            .expect("submit");
        c.cycle(4).expect("cycle");
        run_to_end(&mut c, blocker, 5, 100);
        let d = c.cycle(101).expect("cycle");
        assert_eq!(d.binds.len(), 1);
        assert_eq!(
            state(&c, short),
            JobState::Scheduled,
            "submitted later, shorter"
        );
        assert_eq!(state(&c, long), JobState::Pending);
    }

    #[test]
    fn the_job_with_less_predicted_remaining_work_starts_first() {
        let (_d, mut c) = server();
        // This cluster's history: "eval" jobs take 5 minutes, "train" ones 5 hours.
        for _ in 0..10 {
            c.cluster.learn_runtime(&whole_node("eval", None), 300);
            c.cluster.learn_runtime(&whole_node("train", None), 18_000);
        }
        let blocker = c.submit("alice", whole_node("b", None), 0).expect("submit");
        c.cycle(1).expect("cycle");
        let train = c
            .submit("alice", whole_node("train", None), 2)
            .expect("submit");
        let eval = c
            .submit("alice", whole_node("eval", None), 3)
            .expect("submit");
        c.cycle(4).expect("cycle");
        let (p_train, p_eval) = (c.cluster.job(train), c.cluster.job(eval));
        let (p_train, p_eval) = (p_train.expect("in").rank, p_eval.expect("in").rank);
        assert!(p_eval < p_train, "ranks {p_eval} < {p_train}");
        run_to_end(&mut c, blocker, 5, 100);
        c.cycle(101).expect("cycle");
        assert_eq!(state(&c, eval), JobState::Scheduled);
        assert_eq!(state(&c, train), JobState::Pending);
    }

    #[test]
    fn attained_service_is_kept_across_attempts_and_the_job_with_less_goes_first() {
        let (_d, mut c) = server();
        let old = c
            .submit("alice", whole_node("old", None), 0)
            .expect("submit");
        c.cycle(1).expect("cycle");
        c.report("n", old, Some(0), Report::Running, 2)
            .expect("running");
        // A higher class preempts it after 1000 s on 4 GPUs.
        let mut urgent = whole_node("urgent", None);
        urgent.priority = PriorityClass::High;
        let urgent = c.submit("bob", urgent, 1000).expect("submit");
        let d = c.cycle(1001).expect("cycle");
        assert_eq!(d.preemptions.len(), 1);
        c.report("n", old, Some(0), Report::Exited(0), 1002)
            .expect("exited");
        let rec = &c.jobs[&old].0;
        assert_eq!(rec.state, JobState::Pending);
        assert_eq!(
            (rec.attained_gpu_seconds, rec.run_seconds),
            (4 * 1001, 1001),
            "from its placement at t=1 to its end at t=1002"
        );
        c.cycle(1003).expect("cycle");
        assert_eq!(state(&c, urgent), JobState::Scheduled);
        // A fresh job of the same class arrives; both wait for the urgent one.
        let fresh = c
            .submit("alice", whole_node("fresh", None), 1004)
            .expect("submit");
        c.cycle(1005).expect("cycle");
        let prio = |c: &Control<RedbStore>, id| c.cluster.job(id).expect("in").priority;
        assert_eq!(
            prio(&c, old),
            1004,
            "two bands down: 4004 GPU-s attained (past 1800 and 3600)"
        );
        assert_eq!(prio(&c, fresh), 1006);
        run_to_end(&mut c, urgent, 1006, 1100);
        c.cycle(1101).expect("cycle");
        assert_eq!(
            state(&c, fresh),
            JobState::Scheduled,
            "less attained service"
        );
        assert_eq!(state(&c, old), JobState::Pending);
    }

    #[test]
    fn a_job_past_the_aging_bound_goes_first() {
        let (_d, mut c) = server();
        let blocker = c.submit("alice", whole_node("b", None), 0).expect("submit");
        c.cycle(1).expect("cycle");
        // Expected 200 s: past 3 × 200 s of waiting it goes first.
        let aged = c
            .submit("alice", whole_node("aged", Some(200)), 2)
            .expect("submit");
        let short = c
            .submit("alice", whole_node("short", Some(60)), 350)
            .expect("submit");
        c.cycle(351).expect("cycle");
        let rank = |c: &Control<RedbStore>, id| c.cluster.job(id).expect("in").rank;
        assert!(
            rank(&c, aged) > rank(&c, short),
            "not aged yet: shorter first"
        );
        run_to_end(&mut c, blocker, 5, 700);
        c.cycle(701).expect("cycle");
        assert_eq!(state(&c, aged), JobState::Scheduled, "waited 699 s > 600 s");
        assert_eq!(state(&c, short), JobState::Pending);
    }

    #[test]
    fn old_records_without_attained_service_read_as_zero() {
        let rec = JobRecord::submitted(JobId(1), "alice", whole_node("j", None), 0);
        let mut v = serde_json::to_value(&rec).expect("json");
        let obj = v.as_object_mut().expect("object");
        assert!(!obj.contains_key("attained_gpu_seconds"));
        let back: JobRecord = serde_json::from_value(v).expect("decode");
        assert_eq!((back.attained_gpu_seconds, back.run_seconds), (0, 0));
    }

    #[test]
    fn a_cycle_with_nothing_new_looks_at_the_running_jobs_only() {
        let (_d, mut c) = server();
        for i in 0..200 {
            c.submit("alice", whole_node(&format!("j{i}"), Some(600)), 0)
                .expect("submit");
        }
        c.cycle(1).expect("cycle");
        // One job was placed (its record changed); 199 wait and nothing
        // about them changed.
        assert_eq!(c.rank_jobs(2), 1);
        assert!(c.rank_drift(2).is_empty());
        // A new job is looked at once; the running one is not looked at
        // while its band stays.
        c.submit("bob", whole_node("new", Some(60)), 3)
            .expect("submit");
        assert_eq!(c.rank_jobs(4), 1);
        assert_eq!(c.rank_jobs(5), 0);
        assert!(c.rank_drift(5).is_empty());
        // The refresh still ranks them all.
        assert_eq!(c.rank_jobs(1 + REFRESH_SECONDS), 201);
        // Placed at t=1 on 4 GPUs, the running job reaches the first band
        // threshold (1800 GPU-s) at t=451: looked at then, not before.
        let running = c.jobs.ids_in_states(&ON_GPUS);
        assert_eq!(running.len(), 1);
        let prio = |c: &Control<RedbStore>| c.cluster.job(running[0]).expect("in").priority;
        let before = prio(&c);
        assert_eq!(c.rank_jobs(450), 0);
        assert!(c.rank_drift(450).is_empty());
        assert!(!c.rank_drift(451).is_empty(), "its band moved at 451");
        assert_eq!(c.rank_jobs(451), 1);
        assert!(c.rank_drift(451).is_empty());
        assert_eq!(prio(&c), before - 1, "one band down");
        // The next threshold (3600 GPU-s) comes at t=901, after the next
        // refresh (t=601).
        assert_eq!(c.rank_jobs(600), 0);
        assert!(c.rank_drift(600).is_empty());
    }

    #[test]
    fn a_job_released_at_its_begin_time_is_ranked_when_it_enters() {
        let (_d, mut c) = server();
        let blocker = c
            .submit("alice", whole_node("b", Some(600)), 0)
            .expect("submit");
        let mut later = whole_node("later", Some(60));
        later.begin = Some(BeginAt::Seconds(50));
        let later = c.submit("alice", later, 1).expect("submit");
        c.cycle(2).expect("cycle");
        assert!(c.cluster.job(later).is_none(), "gated until t=50");
        // Released by the cycle without a write of its record.
        c.cycle(51).expect("cycle");
        assert!(c.cluster.job(later).is_some());
        assert_eq!(state(&c, blocker), JobState::Scheduled);
        c.rank_jobs(52);
        assert!(c.rank_drift(52).is_empty(), "{:?}", c.rank_drift(52));
    }

    /// One step of the property test below.
    #[derive(Clone, Debug)]
    enum Step {
        /// A job of `gpus` GPUs, declared run time or not, begin time
        /// `begin` seconds ahead (0: none).
        Submit {
            gpus: u32,
            declared: bool,
            begin: u64,
        },
        /// Time passes; the node is heard from (its heartbeat).
        Wait(u64),
        /// Time passes without a word from the node: past
        /// `node_lost_seconds` its gangs end at the next cycle.
        Silence(u64),
        /// A scheduling cycle.
        Cycle,
        /// The `n`-th job's node reports it running.
        Running(usize),
        /// The `n`-th job's node reports it exited with `code`.
        Exited(usize, i32),
        /// The `n`-th job is cancelled.
        Cancel(usize),
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            (1u32..=4, any::<bool>(), prop_oneof![Just(0u64), 1u64..400]).prop_map(
                |(gpus, declared, begin)| Step::Submit {
                    gpus,
                    declared,
                    begin
                }
            ),
            // Mostly short waits, so that rankings fall between a band
            // threshold and the next refresh; sometimes long ones.
            prop_oneof![3 => 1u64..60, 1 => 1u64..700].prop_map(Step::Wait),
            (1u64..60).prop_map(Step::Silence),
            Just(Step::Cycle),
            Just(Step::Cycle),
            (0usize..40).prop_map(Step::Running),
            (0usize..40, prop_oneof![Just(0), Just(1)]).prop_map(|(n, c)| Step::Exited(n, c)),
            (0usize..40).prop_map(Step::Cancel),
        ]
    }

    /// Plays one step on `c` at `now` (`ids`: the jobs submitted so far);
    /// a cycle's decisions are returned.
    fn play(
        c: &mut Control<RedbStore>,
        ids: &mut Vec<JobId>,
        now: &mut Time,
        s: &Step,
    ) -> Option<gangway_sched::Decisions> {
        // The node's heartbeat, but in a silence: jobs run for long enough
        // to move through the bands unless the node is lost.
        if !matches!(s, Step::Silence(_)) {
            c.nodes.heartbeats.heard("n", *now);
        }
        match *s {
            Step::Submit {
                gpus,
                declared,
                begin,
            } => {
                let mut spec = JobSpec::new(&format!("j{}", ids.len() % 3), "q", 1, gpus);
                spec.runtime_seconds = declared.then_some(100 * u64::from(gpus));
                spec.restart.max_restarts = 1;
                if begin > 0 {
                    spec.begin = Some(BeginAt::Seconds(*now + begin));
                }
                ids.push(c.submit("alice", spec, *now).expect("submit"));
            }
            Step::Wait(dt) => {
                *now += dt;
                c.nodes.heartbeats.heard("n", *now);
            }
            Step::Silence(dt) => *now += dt,
            Step::Cycle => return Some(c.cycle(*now).expect("cycle")),
            Step::Running(_) | Step::Exited(..) | Step::Cancel(_) if ids.is_empty() => {}
            Step::Running(n) => {
                let id = ids[n % ids.len()];
                let attempt = c.jobs[&id].0.attempt;
                let _ = c.report("n", id, Some(attempt), Report::Running, *now);
            }
            Step::Exited(n, code) => {
                let id = ids[n % ids.len()];
                let attempt = c.jobs[&id].0.attempt;
                let _ = c.report("n", id, Some(attempt), Report::Exited(code), *now);
            }
            Step::Cancel(n) => {
                let _ = c.cancel(ids[n % ids.len()], "alice", *now);
            }
        }
        None
    }

    /// What the core reads of the ranking: every job's priority, and the
    /// rank of each pending one (a running job's rank is read only once it
    /// is pending again).
    fn ranking_read(c: &Control<RedbStore>) -> Vec<(JobId, i32, Option<i64>)> {
        c.jobs
            .ids_in_states(&RANKED)
            .into_iter()
            .filter_map(|id| {
                let job = c.cluster.job(id)?;
                let running = matches!(job.status, JobStatus::Running(_));
                Some((id, job.priority, (!running).then_some(job.rank)))
            })
            .collect()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
        /// Whatever happens between cycles (submissions, gated jobs entering,
        /// runs, exits, failures with restarts, cancels, time passing bands
        /// and refreshes), the incremental ranking leaves nothing that a walk
        /// of every job would rank differently.
        #[test]
        fn ranking_what_changed_ranks_as_a_walk_of_every_job_does(
            steps in proptest::collection::vec(step(), 1..60)
        ) {
            let (_d, mut c) = server();
            let mut now: Time = 10;
            let mut ids: Vec<JobId> = Vec::new();
            for s in steps {
                play(&mut c, &mut ids, &mut now, &s);
                now += 1;
                c.rank_jobs(now);
                let drift = c.rank_drift(now);
                proptest::prop_assert!(drift.is_empty(), "at {}: {:?}", now, drift);
            }
        }

        /// The same histories on two servers, one ranking every running job
        /// every cycle (as the server did before running jobs were ranked
        /// only when their band moves) and one as it does now: every cycle
        /// decides the same (binds, preemptions, plan, explanations), and
        /// after every step the core would read the same priorities and
        /// pending ranks.
        #[test]
        fn ranking_running_jobs_when_their_band_moves_decides_as_every_cycle_did(
            steps in proptest::collection::vec(step(), 1..80)
        ) {
            let (_d1, mut every) = server();
            every.ranks.every_running = true;
            let (_d2, mut lazy) = server();
            let (mut now_e, mut now_l): (Time, Time) = (10, 10);
            let (mut ids_e, mut ids_l) = (Vec::new(), Vec::new());
            for s in steps {
                let de = play(&mut every, &mut ids_e, &mut now_e, &s);
                let dl = play(&mut lazy, &mut ids_l, &mut now_l, &s);
                if let (Some(de), Some(dl)) = (de, dl) {
                    proptest::prop_assert_eq!(&de.binds, &dl.binds, "at {}", now_l);
                    proptest::prop_assert_eq!(&de.preemptions, &dl.preemptions, "at {}", now_l);
                    proptest::prop_assert_eq!(&de.plan, &dl.plan, "at {}", now_l);
                    proptest::prop_assert_eq!(&de.planned, &dl.planned, "at {}", now_l);
                    proptest::prop_assert_eq!(&de.pending, &dl.pending, "at {}", now_l);
                }
                now_e += 1;
                now_l += 1;
                // Rankings between cycles too, as more cycles would make.
                every.rank_jobs(now_e);
                lazy.rank_jobs(now_l);
                proptest::prop_assert_eq!(ranking_read(&every), ranking_read(&lazy), "at {}", now_l);
            }
        }
    }
}
