//! The backfill plan: a start estimate for every pending job it can plan,
//! reservations per the backfill mode, reason codes and plurals.

mod common;

use common::{cluster, job, queue, Driver};
use gangway_core::{JobId, JobSpec, QueueSpec, ReasonCode, TopologyConstraint};
use gangway_sched::{plural, Backfill, Explanation, SchedulerConfig, WaitReason};
use proptest::prelude::*;
use std::collections::BTreeMap;

fn driver(nodes: usize, gpus: u32, backfill: Backfill) -> Driver {
    let mut s = cluster(nodes, gpus, 4);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    d.cfg.backfill = backfill;
    d.cfg.preemption = false;
    d.cfg.fair_share = false;
    d
}

fn explanation(d: &Driver, id: JobId) -> &Explanation {
    d.last
        .pending
        .iter()
        .find(|e| e.job == id)
        .expect("pending job explained")
}

#[test]
fn later_plans_queue_up_behind_earlier_ones() {
    // Two 8-GPU nodes busy until t=100; three whole-cluster gangs of 100 s.
    let mut d = driver(2, 8, Backfill::Easy);
    for _ in 0..2 {
        d.submit(job("q", 1, 8, Some(100)), None);
    }
    d.cycle();
    let gangs: Vec<JobId> = (0..3)
        .map(|_| d.submit(job("q", 2, 8, Some(100)), None))
        .collect();
    d.advance(10);
    d.cycle();
    let starts: Vec<Option<u64>> = gangs
        .iter()
        .map(|g| explanation(&d, *g).estimated_start)
        .collect();
    assert_eq!(starts, vec![Some(100), Some(200), Some(300)]);
    // EASY: only the first holds a reservation; the others are planned.
    assert_eq!(d.last.reservations.len(), 1);
    assert_eq!(d.last.plan.len(), 3);
    assert_eq!(d.last.plan[2].end_at, 400);
    assert!(matches!(
        explanation(&d, gangs[1]).reason,
        WaitReason::Planned {
            start_at: 200,
            nodes: 2
        }
    ));
    assert_eq!(explanation(&d, gangs[1]).code(), ReasonCode::Resources);
    assert_eq!(
        d.reason(gangs[0]),
        "2 nodes reserved, estimated start at t+90s when running jobs end"
    );
}

#[test]
fn conservative_reserves_for_every_planned_job_and_easy_only_the_first() {
    for mode in [Backfill::Easy, Backfill::Conservative] {
        let mut d = driver(2, 8, mode);
        // One node busy until 100, the other half busy until 300.
        d.submit(job("q", 1, 8, Some(100)), None);
        d.submit(job("q", 1, 4, Some(300)), None);
        d.cycle();
        d.advance(1);
        // Head: a whole node, planned at 100 where the first job ends.
        let head = d.submit(job("q", 1, 8, Some(100)), None);
        // Second: both nodes, planned at 300 (after the head's 100 s).
        let second = d.submit(job("q", 2, 8, Some(50)), None);
        // Third: fits now on the half-free node but runs past 300: it would
        // delay the second, not the head.
        let third = d.submit(job("q", 1, 4, Some(500)), None);
        // Fourth: ends before anyone's reservation.
        let fourth = d.submit(job("q", 1, 4, Some(50)), None);
        d.cycle();
        assert_eq!(explanation(&d, head).estimated_start, Some(100), "{mode}");
        assert_eq!(explanation(&d, second).estimated_start, Some(300), "{mode}");
        let reserved: Vec<JobId> = d.last.reservations.iter().map(|r| r.job).collect();
        if mode == Backfill::Easy {
            assert_eq!(reserved, vec![head]);
            assert!(d.is_running(third), "EASY lets it delay the second job");
            assert!(!d.is_running(fourth));
        } else {
            assert_eq!(reserved, vec![head, second, third], "every planned job");
            assert!(!d.is_running(third), "conservative holds it back");
            let e = explanation(&d, third);
            assert_eq!(e.code(), ReasonCode::Priority);
            assert!(
                matches!(e.reason, WaitReason::BehindReservation { holder, .. } if holder == second || holder == head),
                "{e:?}"
            );
            assert!(
                e.estimated_start.is_some(),
                "a job behind a reservation is planned too"
            );
            assert!(d.is_running(fourth), "a short job still backfills");
        }
    }
}

#[test]
fn reservations_n_bounds_the_reservations_and_depth_bounds_the_plan() {
    let mut d = driver(1, 8, Backfill::Reservations(2));
    d.cfg.plan_depth = 3;
    d.submit(job("q", 1, 8, Some(100)), None);
    d.cycle();
    let waiting: Vec<JobId> = (0..5)
        .map(|_| d.submit(job("q", 1, 8, Some(100)), None))
        .collect();
    d.advance(1);
    d.cycle();
    assert_eq!(d.last.reservations.len(), 2);
    assert_eq!(d.last.plan.len(), 3);
    let codes: Vec<ReasonCode> = waiting.iter().map(|j| explanation(&d, *j).code()).collect();
    use ReasonCode::*;
    assert_eq!(
        codes,
        vec![Resources, Resources, Resources, Priority, Priority]
    );
    assert_eq!(explanation(&d, waiting[3]).estimated_start, None);
    assert_eq!(
        d.reason(waiting[3]),
        "does not fit now; the first 3 jobs waiting ahead of it are planned first"
    );
}

#[test]
fn every_pending_job_of_200_gets_an_estimate_or_a_code() {
    let mut d = driver(4, 8, Backfill::Easy);
    let sizes = [1u32, 1, 2, 4, 8, 1, 16, 1, 2, 32];
    for i in 0..200u64 {
        let g = sizes[i as usize % sizes.len()];
        let (r, per) = if g > 8 { (g / 8, 8) } else { (1, g) };
        let rt = (i % 7 + 1) * 60;
        d.submit(job("q", r, per, Some(rt)), None);
    }
    d.cycle();
    let pending: Vec<&Explanation> = d.last.pending.iter().collect();
    assert!(pending.len() > 150, "most of them wait");
    for e in &pending {
        assert!(e.estimated_start.is_some(), "{e:?} has no estimate");
        assert!(e.estimated_start.unwrap() > d.now);
        let code = e.code();
        assert!(
            matches!(code, ReasonCode::Resources | ReasonCode::Priority),
            "{e:?}"
        );
    }
    // Depth 50: the rest say Priority with no estimate.
    d.cfg.plan_depth = 50;
    d.cycle();
    let (with, without): (Vec<&Explanation>, Vec<&Explanation>) = d
        .last
        .pending
        .iter()
        .partition(|e| e.estimated_start.is_some());
    assert_eq!(with.len(), 50);
    assert!(without.iter().all(|e| e.code() == ReasonCode::Priority));
}

#[test]
fn a_gang_that_fits_nowhere_even_when_all_ends_says_req_node_not_avail() {
    let mut d = driver(2, 8, Backfill::Easy);
    d.submit(job("q", 1, 8, Some(100)), None);
    d.cycle();
    d.state.set_cordoned("n01", true).expect("node exists");
    let gang = d.submit(job("q", 2, 8, Some(100)), None);
    d.cycle();
    let e = explanation(&d, gang);
    assert_eq!(e.code(), ReasonCode::ReqNodeNotAvail, "{e:?}");
    assert_eq!(e.estimated_start, None);
    assert!(d.reason(gang).contains("cordoned"), "{}", d.reason(gang));
}

#[test]
fn an_overrunning_job_gets_a_refreshed_end() {
    // Declared 100 s, still running at 400: expected to run as long again as
    // it has run, at least the unknown-run-time floor (600 s): ends at 1000.
    let mut d = driver(1, 8, Backfill::Easy);
    d.submit(job("q", 1, 8, Some(100)), Some(10_000));
    d.cycle();
    d.advance(400);
    let gang = d.submit(job("q", 1, 8, Some(100)), None);
    d.cycle();
    assert_eq!(explanation(&d, gang).estimated_start, Some(1000));
    d.advance(1200);
    d.cycle();
    assert_eq!(explanation(&d, gang).estimated_start, Some(2400));
}

#[test]
fn codes_cover_every_wait_reason() {
    use gangway_sched::FitFailure;
    let fit = FitFailure::OneNode {
        need: 8,
        largest_free: 0,
        node: None,
        short: None,
    };
    let cases = [
        (WaitReason::NoFit(fit), ReasonCode::Resources),
        (
            WaitReason::Reserved {
                start_at: 1,
                nodes: 1,
            },
            ReasonCode::Resources,
        ),
        (
            WaitReason::Planned {
                start_at: 1,
                nodes: 1,
            },
            ReasonCode::Resources,
        ),
        (
            WaitReason::BehindReservation {
                holder: JobId(1),
                start_at: 1,
            },
            ReasonCode::Priority,
        ),
        (WaitReason::BeyondPlan { depth: 1 }, ReasonCode::Priority),
        (
            WaitReason::InOrder { behind: JobId(1) },
            ReasonCode::Priority,
        ),
        (WaitReason::NeverFits(fit), ReasonCode::ReqNodeNotAvail),
        (
            WaitReason::AwaitingPreemption { victims: 1 },
            ReasonCode::Preemption,
        ),
        (
            WaitReason::Preempting {
                victims: vec![JobId(2)],
                grace_seconds: 30,
            },
            ReasonCode::Preemption,
        ),
    ];
    for (r, c) in cases {
        assert_eq!(r.code(), c, "{r:?}");
    }
}

#[test]
fn sentences_use_singular_for_one() {
    assert_eq!(plural(1, "GPU"), "1 GPU");
    assert_eq!(plural(0, "GPU"), "0 GPUs");
    assert_eq!(plural(16, "node"), "16 nodes");
    let d = driver(1, 8, Backfill::Easy);
    let say = |reason: WaitReason| {
        Explanation {
            job: JobId(9),
            reason,
            estimated_start: None,
        }
        .render(&d.state, 0)
    };
    use gangway_sched::FitFailure;
    assert_eq!(
        say(WaitReason::NoFit(FitFailure::OneNode {
            need: 1,
            largest_free: 0,
            node: None,
            short: None,
        })),
        "needs 1 GPU on one node; no matching node has a free GPU"
    );
    assert_eq!(
        say(WaitReason::NoFit(FitFailure::Spread {
            replicas: 1,
            gpus_per_replica: 1,
            hostable: 0,
            one_leaf: false
        })),
        "needs 1 replica × 1 GPU; free GPUs can host only 0"
    );
    assert_eq!(
        say(WaitReason::NoFit(FitFailure::Spread {
            replicas: 2,
            gpus_per_replica: 8,
            hostable: 1,
            one_leaf: true
        })),
        "needs 2 replicas × 8 GPUs under one leaf switch; free GPUs can host only 1"
    );
    assert_eq!(
        say(WaitReason::Reserved {
            start_at: 60,
            nodes: 1
        }),
        "1 node reserved, estimated start at t+60s when running jobs end"
    );
    assert_eq!(
        say(WaitReason::AwaitingPreemption { victims: 1 }),
        "waiting for 1 preempted job to checkpoint and exit"
    );
    assert_eq!(
        say(WaitReason::Preempting {
            victims: vec![JobId(4)],
            grace_seconds: 30
        }),
        "preempting 1 job (4); starts after their 30s checkpoint grace"
    );
    assert_eq!(
        say(WaitReason::BeyondPlan { depth: 1 }),
        "does not fit now; the first 1 job waiting ahead of it are planned first"
    );
}

#[derive(Clone, Debug)]
struct Gen {
    replicas: u32,
    gpus: u32,
    runtime: u64,
    any: bool,
}

fn gen() -> impl Strategy<Value = Gen> {
    (
        prop::sample::select(vec![1u32, 1, 1, 2, 3]),
        prop::sample::select(vec![1u32, 1, 2, 4, 8]),
        1u64..40,
        any::<bool>(),
    )
        .prop_map(|(replicas, gpus, rt, any)| Gen {
            replicas,
            gpus,
            runtime: rt * 10,
            any,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Conservative backfill: no job started in a cycle touches the nodes of
    /// a reservation made for a job ahead of it during that reservation's
    /// window (so a planned start never slips because of a backfilled lower
    /// job), and every waiting job that lacks GPUs has an estimate.
    #[test]
    fn conservative_backfill_delays_no_reservation(
        nodes in 3usize..6,
        jobs in prop::collection::vec(gen(), 1..30),
    ) {
        let mut d = driver(nodes, 8, Backfill::Conservative);
        let mut runtime: BTreeMap<JobId, u64> = BTreeMap::new();
        let mut cycles = 0;
        for (k, j) in jobs.iter().enumerate() {
            let mut s: JobSpec = job("q", j.replicas, j.gpus, Some(j.runtime));
            if j.any {
                s.topology = TopologyConstraint::Any;
            }
            runtime.insert(d.submit(s, None), j.runtime);
            // Arrivals in a few waves, cycles in between.
            if k % 7 != 6 {
                continue;
            }
            d.cycle();
            cycles += 1;
            check_cycle(&d, &runtime)?;
            let Some((next, _)) = d.state.running_by_end().next() else { continue };
            d.advance(next);
        }
        while cycles < 200 {
            d.cycle();
            cycles += 1;
            check_cycle(&d, &runtime)?;
            let Some((next, _)) = d.state.running_by_end().next() else { break };
            d.advance(next);
        }
        prop_assert_eq!(d.state.pending_count(), 0, "every job ran");
    }
}

fn check_cycle(d: &Driver, runtime: &BTreeMap<JobId, u64>) -> Result<(), TestCaseError> {
    for r in &d.last.reservations {
        for b in d.last.binds.iter().filter(|b| b.job > r.job) {
            let overlaps = b.placement.nodes().iter().any(|n| r.nodes.contains(n));
            let ends = d.now + runtime[&b.job];
            prop_assert!(
                !overlaps || ends <= r.start_at,
                "job {} (ends {}) took nodes of job {}'s reservation at {}",
                b.job,
                ends,
                r.job,
                r.start_at
            );
        }
    }
    for e in &d.last.pending {
        prop_assert!(
            e.estimated_start.is_some() || e.code() != ReasonCode::Resources,
            "{:?} waits for resources without an estimate",
            e
        );
    }
    Ok(())
}

#[test]
fn backfill_modes_parse_and_print() {
    for (s, b) in [
        ("off", Backfill::Off),
        ("easy", Backfill::Easy),
        ("conservative", Backfill::Conservative),
        ("reservations:4", Backfill::Reservations(4)),
    ] {
        assert_eq!(s.parse::<Backfill>().unwrap(), b);
        assert_eq!(b.to_string(), s);
    }
    for bad in [
        "",
        "EASY",
        "reservations:",
        "reservations:-1",
        "reservations:100001",
        "x",
    ] {
        let e = bad.parse::<Backfill>().unwrap_err().to_string();
        assert!(e.starts_with("backfill: expected"), "{e}");
    }
    assert_eq!(Backfill::Conservative.reservations(), usize::MAX);
    assert_eq!(SchedulerConfig::default().backfill, Backfill::Easy);
}

#[test]
fn a_spent_plan_budget_leaves_later_jobs_unplanned_but_keeps_the_reservation() {
    for budget in [0usize, usize::MAX] {
        let mut d = driver(2, 8, Backfill::Easy);
        d.cfg.plan_budget = budget;
        for _ in 0..2 {
            d.submit(job("q", 1, 8, Some(100)), None);
        }
        d.cycle();
        let gangs: Vec<JobId> = (0..3)
            .map(|_| d.submit(job("q", 2, 8, Some(100)), None))
            .collect();
        d.advance(10);
        d.cycle();
        // The reservation decides what may start: it is planned whatever the budget.
        assert_eq!(d.last.reservations.len(), 1, "budget {budget}");
        assert_eq!(explanation(&d, gangs[0]).estimated_start, Some(100));
        if budget == 0 {
            assert_eq!(d.last.plan.len(), 1);
            for g in &gangs[1..] {
                let e = explanation(&d, *g);
                assert_eq!(e.reason, WaitReason::BeyondPlan { depth: 1 });
                assert_eq!(e.estimated_start, None);
                assert_eq!(e.code(), ReasonCode::Priority);
            }
        } else {
            assert_eq!(d.last.plan.len(), 3);
            assert_eq!(explanation(&d, gangs[2]).estimated_start, Some(300));
            assert!(d.last.stats.plan_releases > 0);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// The plan's walk budget only drops estimates: under EASY backfill a
    /// cluster driven with no budget at all binds, reserves and preempts
    /// exactly as one with an unlimited budget, cycle after cycle.
    #[test]
    fn the_plan_budget_never_changes_what_starts(
        nodes in 3usize..6,
        jobs in prop::collection::vec(gen(), 1..30),
    ) {
        let mut a = driver(nodes, 8, Backfill::Easy);
        let mut b = driver(nodes, 8, Backfill::Easy);
        a.cfg.plan_budget = usize::MAX;
        b.cfg.plan_budget = 0;
        for (k, j) in jobs.iter().enumerate() {
            for d in [&mut a, &mut b] {
                let mut s: JobSpec = job("q", j.replicas, j.gpus, Some(j.runtime));
                if j.any {
                    s.topology = TopologyConstraint::Any;
                }
                d.submit(s, None);
            }
            if k % 5 != 4 {
                continue;
            }
            a.cycle();
            b.cycle();
            prop_assert_eq!(&a.last.binds, &b.last.binds);
            prop_assert_eq!(&a.last.reservations, &b.last.reservations);
            prop_assert!(b.last.plan.len() <= a.last.plan.len());
            let Some((next, _)) = a.state.running_by_end().next() else { continue };
            a.advance(next);
            b.advance(next);
        }
        for _ in 0..100 {
            a.cycle();
            b.cycle();
            prop_assert_eq!(&a.last.binds, &b.last.binds);
            prop_assert_eq!(&a.last.reservations, &b.last.reservations);
            let Some((next, _)) = a.state.running_by_end().next() else { break };
            a.advance(next);
            b.advance(next);
        }
        prop_assert_eq!(a.state.pending_count(), 0, "every job ran");
    }
}

#[test]
fn a_gang_short_of_cpu_or_memory_is_told_so_not_that_gpus_are_missing() {
    // One node: 8 GPUs, 128 CPUs, 1 TiB. A CPU-only job takes most of one
    // resource; an 8-GPU job then finds its GPUs free but not the rest.
    for (cpu_only, gpu_job, said) in [
        (
            (120_000, 1024),
            (16_000, 1024),
            "needs 8 GPUs and 16 CPUs on one node; node n00 has 8 GPUs free but only 8 CPUs",
        ),
        (
            (1_000, 1_000 * 1024),
            (1_000, 64 * 1024),
            "needs 8 GPUs and 64 GiB memory on one node; node n00 has 8 GPUs free but only 24 GiB memory",
        ),
    ] {
        let mut d = driver(1, 8, Backfill::Off);
        let mut prep = job("q", 1, 0, Some(1000));
        prep.resources.cpu_millis = cpu_only.0;
        prep.resources.memory_mib = cpu_only.1;
        d.submit(prep, None);
        d.cycle();
        let mut train = job("q", 1, 8, Some(100));
        train.resources.cpu_millis = gpu_job.0;
        train.resources.memory_mib = gpu_job.1;
        let id = d.submit(train, None);
        d.advance(1);
        d.cycle();
        assert_eq!(d.reason(id), said);
        assert!(matches!(
            explanation(&d, id).reason,
            WaitReason::NoFit(gangway_sched::FitFailure::OneNode {
                short: Some(_),
                ..
            })
        ));
    }
}
