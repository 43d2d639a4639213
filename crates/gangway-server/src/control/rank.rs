//! Gangway's ranking in the live server: every cycle, each live job's
//! priority (class plus attained-service band) and rank inside its queue
//! (predicted remaining work, aging) are set from its stored record by
//! [`gangway_sched::rank`], the same code the simulator measures.
//!
//! A queue whose `ordering` is `fifo` keeps its jobs at their class's top
//! band with rank 0: priority, then submission order
//! ([`gangway_sched::rank::rank_in`]).
//!
//! Running jobs are ranked every cycle (their band moves as they run);
//! pending ones when they enter the scheduler or start a new attempt, and
//! all of them every [`REFRESH_SECONDS`] (aging, predictions learned since)
//! or when a policy is installed (a queue's ordering may have changed).

use super::Control;
use crate::records::JobRecord;
use gangway_core::{BeginAt, JobId, JobState, Time};
use gangway_sched::rank::{self, KnownRuntime, RankFacts, RankParams, Ranked, REFRESH_SECONDS};
use gangway_sched::JobStatus;
use gangway_store::Store;
use std::collections::HashMap;

/// What the server last applied per job, to rank pending jobs only when
/// something changed.
#[derive(Debug, Default)]
pub(crate) struct RankMemo {
    /// Per job: the attempt and verdict last applied.
    applied: HashMap<JobId, (u32, Ranked)>,
    /// When every pending job was last re-ranked (`None`: at the next cycle).
    pub(crate) refreshed_at: Option<Time>,
    /// The ranking's knobs.
    pub(crate) params: RankParams,
    /// Jobs that entered the scheduler since the last ranking without a
    /// write of their records (a gated job released): ranked at the next
    /// cycle with the jobs whose records changed.
    pub(crate) entered: Vec<JobId>,
}

/// The ranking's view of one stored job at `now`; `running` says whether
/// the scheduler has it running.
pub(crate) fn facts(rec: &JobRecord, running: bool, runtime: KnownRuntime, now: Time) -> RankFacts {
    let running_for = running.then(|| rec.attempt_started().map_or(0, |s| now.saturating_sub(s)));
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
    /// record does or when it enters the scheduler again, so only the jobs
    /// on GPUs, those whose records were written since the last call
    /// ([`crate::records::JobTable::take_changed`]) and those that entered
    /// the scheduler without a write ([`RankMemo::entered`]) are looked at,
    /// not the whole backlog; the verdicts are the ones a walk of every job
    /// gives (a property test checks it).
    pub(crate) fn rank_jobs(&mut self, now: Time) -> usize {
        let refresh = self
            .ranks
            .refreshed_at
            .is_none_or(|t| now >= t.saturating_add(REFRESH_SECONDS));
        let changed = self.jobs.take_changed();
        let entered = std::mem::take(&mut self.ranks.entered);
        let ids = if refresh {
            self.jobs.ids_in_states(&RANKED)
        } else {
            let mut ids = self.jobs.ids_in_states(&ON_GPUS);
            ids.extend(changed.into_iter().chain(entered).filter(|id| {
                self.jobs
                    .get(id)
                    .is_some_and(|(r, _)| RANKED.contains(&r.state))
            }));
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
            let ordering = self.cluster.queues()[job.queue as usize].spec.ordering;
            let r = rank::rank_in(
                ordering,
                &self.ranks.params,
                &facts(rec, running, runtime, now),
            );
            verdicts.push((rec.id, rec.attempt, r));
        }
        for (id, attempt, r) in verdicts {
            if rank::apply(&mut self.cluster, id, r).is_ok() {
                self.ranks.applied.insert(id, (attempt, r));
            }
        }
        if refresh {
            self.ranks.refreshed_at = Some(now);
            let cluster = &self.cluster;
            self.ranks
                .applied
                .retain(|id, _| cluster.job(*id).is_some());
        }
        looked_at
    }

    /// The jobs a walk of every ranked job would rank differently now: a
    /// running one whose verdict moved, or a pending one whose applied
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
                let ordering = self.cluster.queues()[job.queue as usize].spec.ordering;
                let r = rank::rank_in(
                    ordering,
                    &self.ranks.params,
                    &facts(rec, running, runtime, now),
                );
                r != current
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
        // One job runs; 199 wait and nothing about them changed.
        assert_eq!(c.rank_jobs(2), 1);
        assert!(c.rank_drift(2).is_empty());
        // A new job is looked at once, with the running one.
        c.submit("bob", whole_node("new", Some(60)), 3)
            .expect("submit");
        assert_eq!(c.rank_jobs(4), 2);
        assert_eq!(c.rank_jobs(5), 1);
        // The refresh still ranks them all.
        assert_eq!(c.rank_jobs(1 + REFRESH_SECONDS), 201);
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
        /// Time passes.
        Wait(u64),
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
            (1u64..700).prop_map(Step::Wait),
            Just(Step::Cycle),
            Just(Step::Cycle),
            (0usize..40).prop_map(Step::Running),
            (0usize..40, prop_oneof![Just(0), Just(1)]).prop_map(|(n, c)| Step::Exited(n, c)),
            (0usize..40).prop_map(Step::Cancel),
        ]
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
                match s {
                    Step::Submit { gpus, declared, begin } => {
                        let mut spec = JobSpec::new(&format!("j{}", ids.len() % 3), "q", 1, gpus);
                        spec.runtime_seconds = declared.then_some(100 * u64::from(gpus));
                        spec.restart.max_restarts = 1;
                        if begin > 0 {
                            spec.begin = Some(BeginAt::Seconds(now + begin));
                        }
                        ids.push(c.submit("alice", spec, now).expect("submit"));
                    }
                    Step::Wait(dt) => now += dt,
                    Step::Cycle => {
                        c.cycle(now).expect("cycle");
                    }
                    Step::Running(n) | Step::Exited(n, _) | Step::Cancel(n) if ids.is_empty() => {
                        let _ = n;
                    }
                    Step::Running(n) => {
                        let id = ids[n % ids.len()];
                        let attempt = c.jobs[&id].0.attempt;
                        let _ = c.report("n", id, Some(attempt), Report::Running, now);
                    }
                    Step::Exited(n, code) => {
                        let id = ids[n % ids.len()];
                        let attempt = c.jobs[&id].0.attempt;
                        let _ = c.report("n", id, Some(attempt), Report::Exited(code), now);
                    }
                    Step::Cancel(n) => {
                        let _ = c.cancel(ids[n % ids.len()], "alice", now);
                    }
                }
                now += 1;
                c.rank_jobs(now);
                let drift = c.rank_drift(now);
                proptest::prop_assert!(drift.is_empty(), "at {}: {:?}", now, drift);
            }
        }
    }
}
