//! The scheduling policies of the registry: each sets the switches that
//! define it on top of a site's settings, and ranks as its model says.

use gangway_core::{PriorityClass, QueueOrdering};
use gangway_sched::policies;
use gangway_sched::policy::{QueueUsage, RankInput, Verdict};
use gangway_sched::rank::{KnownRuntime, RankFacts, RankParams};
use gangway_sched::{Backfill, ClusterState, SchedulerConfig, StateConfig};

fn facts(attained: u64, runtime: u64) -> RankFacts {
    RankFacts {
        class: PriorityClass::Normal.value(),
        gpus: 2,
        attained_gpu_seconds: attained,
        running_for: None,
        waited: 0,
        submitted: 100,
        runtime: KnownRuntime::Declared(runtime),
    }
}

fn verdict(name: &str, f: &RankFacts) -> Verdict {
    let state = ClusterState::new(StateConfig::default());
    let params = RankParams::default();
    let usage = QueueUsage::default();
    policies::lookup(name)
        .expect("registered")
        .rank(&RankInput {
            facts: f,
            class: PriorityClass::Normal,
            queue: "q",
            ordering: QueueOrdering::Ranked,
            now: 1_000,
            params: &params,
            state: &state,
            usage: &usage,
        })
}

#[test]
fn each_policy_sets_its_own_switches_and_keeps_the_sites_others() {
    let site = SchedulerConfig {
        plan_depth: 17,
        max_preemptions_per_cycle: 9,
        ..SchedulerConfig::default()
    };
    let want = [
        // name: (backfill, preemption, fair share, strict order)
        ("gangway", (Backfill::Easy, true, true, false)),
        ("fifo", (Backfill::Off, false, false, true)),
        ("priority", (Backfill::Off, true, false, false)),
        ("slurm", (Backfill::Easy, false, false, false)),
        ("capacity", (Backfill::Off, false, true, false)),
        ("tiresias", (Backfill::Off, true, false, false)),
        ("qssf", (Backfill::Off, false, false, false)),
    ];
    assert_eq!(policies::all().len(), want.len());
    for (p, (name, switches)) in policies::all().iter().zip(want) {
        assert_eq!(p.name(), name);
        let c = p.configure(&site);
        assert_eq!(
            (c.backfill, c.preemption, c.fair_share, c.strict_order),
            switches,
            "{name}"
        );
        assert_eq!(
            (c.plan_depth, c.max_preemptions_per_cycle),
            (17, 9),
            "{name}"
        );
    }
    // The site names the policy; `configure` runs its switches.
    let named = SchedulerConfig {
        policy: "fifo".into(),
        ..site
    };
    assert!(policies::configure(&named).strict_order);
    assert_eq!(policies::of(&named).name(), "fifo");
}

#[test]
fn tiresias_ranks_by_attained_service_only_and_gangway_by_remaining_work() {
    let (fresh_long, fresh_short) = (facts(0, 36_000), facts(0, 60));
    // Tiresias: the same band for both (neither has run): same priority.
    assert_eq!(
        verdict("tiresias", &fresh_long),
        verdict("tiresias", &fresh_short)
    );
    // Past the first threshold (3,250 GPU-s): one step lower.
    let (Verdict::Priority(a), Verdict::Priority(b)) = (
        verdict("tiresias", &fresh_long),
        verdict("tiresias", &facts(4_000, 60)),
    ) else {
        panic!("tiresias sets a priority");
    };
    assert_eq!(a - b, 1);
    // Gangway: less remaining work ranks first within the queue.
    let (Verdict::Ranked(l), Verdict::Ranked(s)) = (
        verdict("gangway", &fresh_long),
        verdict("gangway", &fresh_short),
    ) else {
        panic!("gangway ranks");
    };
    assert!(s.rank < l.rank && s.priority == l.priority);
    // QSSF: less predicted GPU-time, higher priority; FIFO keeps the class.
    let (Verdict::Priority(ql), Verdict::Priority(qs)) =
        (verdict("qssf", &fresh_long), verdict("qssf", &fresh_short))
    else {
        panic!("qssf sets a priority");
    };
    assert!(qs > ql);
    assert_eq!(verdict("fifo", &fresh_long), Verdict::Class);
}

#[test]
fn slurm_favours_older_and_smaller_jobs() {
    let state = ClusterState::new(StateConfig::default());
    let params = RankParams::default();
    let usage = QueueUsage::default();
    let p = policies::lookup("slurm").expect("registered");
    let rank = |f: &RankFacts, now| match p.rank(&RankInput {
        facts: f,
        class: PriorityClass::Normal,
        queue: "q",
        ordering: QueueOrdering::Ranked,
        now,
        params: &params,
        state: &state,
        usage: &usage,
    }) {
        Verdict::Priority(x) => x,
        v => panic!("{v:?}"),
    };
    let f = facts(0, 600);
    assert!(rank(&f, 100 + 86_400) > rank(&f, 100), "age counts");
    assert_eq!(
        rank(&f, 100 + 30 * 86_400),
        rank(&f, 100 + 60 * 86_400),
        "age saturates at 7 days"
    );
}
