//! Property tests of the scheduler's invariants over random clusters, queue
//! trees and job streams.

mod common;

use common::Driver;
use gangway_core::{
    Gpu, JobSpec, NodeSpec, PriorityClass, QueueSpec, ResourceLimits, Resources, TopologyConstraint,
};
use gangway_sched::{quota, schedule, ClusterState, JobStatus, SchedulerConfig, StateConfig};
use proptest::prelude::*;
use std::collections::BTreeMap;

#[derive(Clone, Debug)]
struct NodeGen {
    gpus: u32,
    islands: bool,
    unhealthy: Option<u32>,
}

#[derive(Clone, Debug)]
struct QueueGen {
    nominal: Option<u64>,
    borrow: Option<u64>,
    lend: Option<u64>,
    weight: u32,
}

#[derive(Clone, Debug)]
struct JobGen {
    queue: usize,
    replicas: u32,
    gpus: u32,
    prio: usize,
    preemptible: Option<bool>,
    runtime: Option<u64>,
    actual: u64,
    arrival: u64,
    elastic: bool,
    topology: usize,
}

fn node_gen() -> impl Strategy<Value = NodeGen> {
    (
        prop::sample::select(vec![2u32, 4, 8]),
        any::<bool>(),
        prop::option::weighted(0.15, 0u32..8),
    )
        .prop_map(|(gpus, islands, unhealthy)| NodeGen {
            gpus,
            islands,
            unhealthy,
        })
}

fn queue_gen() -> impl Strategy<Value = QueueGen> {
    (
        prop::option::weighted(0.8, 0u64..24),
        prop::option::weighted(0.5, 0u64..16),
        prop::option::weighted(0.4, 0u64..16),
        1u32..4,
    )
        .prop_map(|(nominal, borrow, lend, weight)| QueueGen {
            nominal,
            borrow,
            lend,
            weight,
        })
}

fn job_gen(queues: usize) -> impl Strategy<Value = JobGen> {
    (
        0..queues,
        prop::sample::select(vec![1u32, 1, 1, 2, 3, 4]),
        prop::sample::select(vec![1u32, 1, 1, 2, 4, 8]),
        0usize..4,
        prop::option::of(any::<bool>()),
        prop::option::weighted(0.7, 10u64..400),
        10u64..600,
        0u64..15,
        any::<bool>(),
        0usize..4,
    )
        .prop_map(
            |(
                queue,
                replicas,
                gpus,
                prio,
                preemptible,
                runtime,
                actual,
                arrival,
                elastic,
                topology,
            )| JobGen {
                queue,
                replicas,
                gpus,
                prio,
                preemptible,
                runtime,
                actual,
                arrival,
                elastic,
                topology,
            },
        )
}

type World = (Vec<Vec<NodeGen>>, Vec<QueueGen>, Vec<JobGen>);

fn world() -> impl Strategy<Value = World> {
    (
        prop::collection::vec(prop::collection::vec(node_gen(), 1..4), 1..4),
        prop::collection::vec(queue_gen(), 1..4),
    )
        .prop_flat_map(|(leaves, queues)| {
            let n = queues.len();
            (
                Just(leaves),
                Just(queues),
                prop::collection::vec(job_gen(n), 1..60),
            )
        })
}

fn build(leaves: &[Vec<NodeGen>], queues: &[QueueGen]) -> ClusterState {
    let mut s = ClusterState::new(StateConfig {
        unknown_runtime_floor_seconds: 300,
    });
    let mut i = 0;
    for (l, nodes) in leaves.iter().enumerate() {
        for n in nodes {
            let gpus = (0..n.gpus)
                .map(|g| Gpu {
                    index: g,
                    model: "H100".into(),
                    memory_gib: 80,
                    healthy: n.unhealthy != Some(g),
                    island: if n.islands { g / 2 } else { 0 },
                    ..Gpu::default()
                })
                .collect();
            let mut spec = NodeSpec::uniform(
                &format!("n{i}"),
                &format!("leaf{l}"),
                &format!("spine{}", l / 2),
                0,
                "H100",
                80,
            );
            spec.gpus = gpus;
            spec.cpu_millis = 64_000;
            spec.memory_mib = 1 << 20;
            s.add_node(spec).expect("node");
            i += 1;
        }
    }
    // An organisation queue over team queues.
    let total: u64 = queues.iter().filter_map(|q| q.nominal).sum();
    s.add_queue(QueueSpec::gpus("org", None, total))
        .expect("org");
    for (k, q) in queues.iter().enumerate() {
        let mut spec = QueueSpec::unlimited(&format!("team{k}"), Some("org"));
        spec.weight = q.weight;
        spec.quota.nominal.gpus = q.nominal;
        spec.quota.borrowing_limit.gpus = q.borrow;
        spec.quota.lending_limit.gpus = q.lend;
        s.add_queue(spec).expect("team");
    }
    s
}

fn spec(j: &JobGen) -> JobSpec {
    let mut s = JobSpec::new("j", &format!("team{}", j.queue), j.replicas, j.gpus);
    s.priority = [
        PriorityClass::Low,
        PriorityClass::Normal,
        PriorityClass::High,
        PriorityClass::Production,
    ][j.prio];
    s.preemptible = j.preemptible;
    s.runtime_seconds = j.runtime;
    s.checkpoint.grace_seconds = 20;
    s.min_replicas = (j.elastic && j.replicas > 1).then_some(1);
    s.topology = [
        TopologyConstraint::Auto,
        TopologyConstraint::Auto,
        TopologyConstraint::Any,
        TopologyConstraint::Leaf,
    ][j.topology];
    s
}

/// Independent recomputation of demand (usage plus children's kept quota) per queue.
fn demand(s: &ClusterState, q: usize, usage: &[Resources]) -> u64 {
    let info = &s.queues()[q];
    let own = usage[q].gpus
        - info
            .children
            .iter()
            .map(|c| usage[*c as usize].gpus)
            .sum::<u64>();
    own + info
        .children
        .iter()
        .map(|&c| demand(s, c as usize, usage).max(s.queues()[c as usize].floor().gpus))
        .sum::<u64>()
}

fn check_quotas(s: &ClusterState) -> Result<(), TestCaseError> {
    let n = s.queues().len();
    let mut usage = vec![Resources::ZERO; n];
    let mut fixed = vec![0u64; n];
    for j in s.jobs_sorted() {
        if let JobStatus::Running(r) = &j.status {
            let u = j.usage(r.placement.replicas.len() as u32);
            for &q in &s.queues()[j.queue as usize].path {
                usage[q as usize] += u;
                if !j.spec.is_preemptible() {
                    fixed[q as usize] += u.gpus;
                }
            }
        }
    }
    for (q, info) in s.queues().iter().enumerate() {
        let quota = &info.spec.quota;
        if let Some(nom) = quota.nominal.gpus {
            prop_assert!(
                fixed[q] <= nom,
                "non-preemptible work borrowed in {}",
                info.spec.name
            );
            if let Some(b) = quota.borrowing_limit.gpus {
                let d = demand(s, q, &usage);
                prop_assert!(
                    d <= nom + b,
                    "queue {} demand {d} > nominal {nom} + borrowing {b}",
                    info.spec.name
                );
            }
        }
    }
    Ok(())
}

fn check_preemptors_fit(d: &Driver) -> Result<(), TestCaseError> {
    let out = &d.last;
    if out.planned.is_empty() {
        return Ok(());
    }
    // Once every victim has exited, every preemptor starts where it was promised.
    let mut trial = d.state.clone();
    for p in &out.planned {
        for v in &p.after {
            if trial
                .job(*v)
                .is_some_and(|j| matches!(j.status, JobStatus::Running(_)))
            {
                trial.requeue(*v).expect("victim was running");
            }
        }
    }
    for p in &out.planned {
        let job = trial.job(p.job).expect("preemptor pending").clone();
        let per = job.per_replica();
        let n = p.placement.replicas.len() as u64;
        let qc = quota::check(
            &trial,
            trial.capacity(),
            job.queue,
            per * n,
            job.spec.is_preemptible(),
        );
        prop_assert!(
            qc.is_ok(),
            "preemptor {} still blocked by quota: {:?} free {} total {:?} root {:?}/{:?}",
            p.job,
            qc,
            trial.free_gpus(),
            trial.total(),
            trial.capacity().root_usage,
            trial.capacity().root_demand
        );
        let r = trial.bind(p.job, p.placement.clone(), d.now);
        prop_assert!(
            r.is_ok(),
            "preemptor {} does not fit after its victims leave: {r:?}",
            p.job
        );
    }
    // And the victims were enough: each preemptor's placement needs only free GPUs or its victims'.
    for p in &out.preemptions {
        prop_assert!(out
            .planned
            .iter()
            .any(|pl| pl.job == p.by && pl.after.contains(&p.job)));
    }
    Ok(())
}

proptest! {
    // 256 cases by default; PROPTEST_CASES=3000 for a longer hunt.
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256), ..ProptestConfig::default() })]

    #[test]
    fn scheduler_invariants_hold((leaves, queues, jobs) in world()) {
        let state = build(&leaves, &queues);
        let mut d = Driver::new(state);
        let mut by_arrival: BTreeMap<u64, Vec<&JobGen>> = BTreeMap::new();
        for j in &jobs {
            by_arrival.entry(j.arrival).or_default().push(j);
        }
        let mut gang_sizes = BTreeMap::new();
        for step in 0..40u64 {
            d.advance(step * 25);
            for j in by_arrival.get(&step).into_iter().flatten() {
                let s = spec(j);
                if d.state.validate(&s).is_ok() {
                    let id = d.submit(s.clone(), Some(j.actual));
                    gang_sizes.insert(id, s);
                }
            }
            // Determinism: the same state gives the same decisions.
            let again = schedule(&d.state, d.now, &d.cfg);
            let out = d.cycle().clone();
            prop_assert_eq!(&again, &out);
            // Gangs all-or-nothing, within their elastic bounds, exact GPUs per replica.
            for b in &out.binds {
                let s = &gang_sizes[&b.job];
                let n = b.placement.replicas.len() as u32;
                prop_assert!(n >= s.min_gang() && n <= s.replicas);
                for r in &b.placement.replicas {
                    prop_assert_eq!(u64::from(r.gpus.count_ones()), u64::from(s.resources.gpus));
                    let node = &d.state.nodes()[r.node as usize];
                    prop_assert_eq!(r.gpus & !node.healthy, 0, "unhealthy GPU assigned");
                }
                if s.topology == TopologyConstraint::Leaf {
                    let leaves: std::collections::BTreeSet<_> =
                        b.placement.nodes().iter().map(|n| d.state.nodes()[*n as usize].leaf).collect();
                    prop_assert_eq!(leaves.len(), 1);
                }
            }
            // Every pending job is explained exactly once.
            prop_assert_eq!(out.pending.len() + out.binds.len(), out.stats.considered);
            check_quotas(&d.state)?;
            check_preemptors_fit(&d)?;
            // Preemption only of preemptible, lower-priority or borrowing work.
            for p in &out.preemptions {
                let v = d.state.job(p.job).expect("victim");
                prop_assert!(v.spec.is_preemptible());
            }
        }
    }

    #[test]
    fn head_gang_is_not_starved(
        nodes in 2usize..6,
        sizes in prop::collection::vec(prop::sample::select(vec![1u32, 1, 2, 4]), 50..200),
        runtimes in prop::collection::vec(20u64..200, 200),
        per_step in 1usize..4,
        gang_at in 2usize..10,
    ) {
        let mut s = ClusterState::new(StateConfig::default());
        for i in 0..nodes {
            s.add_node(NodeSpec::uniform(&format!("n{i}"), "leaf0", "spine0", 4, "A100", 40)).expect("node");
        }
        s.add_queue(QueueSpec::unlimited("q", None)).expect("queue");
        let mut d = Driver::new(s);
        let total = (nodes * 4) as u32;
        let mut next = 0;
        let mut gang = None;
        let mut promised: Option<u64> = None;
        for step in 0..2000u64 {
            d.advance(step * 10);
            for _ in 0..per_step {
                let g = sizes[next % sizes.len()];
                let rt = runtimes[next % runtimes.len()];
                next += 1;
                let mut j = JobSpec::new("small", "q", 1, g);
                j.runtime_seconds = Some(rt);
                d.submit(j, None);
            }
            if step as usize == gang_at {
                let mut j = JobSpec::new("gang", "q", total, 1);
                j.runtime_seconds = Some(100);
                gang = Some(d.submit(j, None));
            }
            let out = d.cycle().clone();
            let Some(g) = gang else { continue };
            if d.is_running(g) {
                if let Some(p) = promised {
                    prop_assert!(d.now <= p + 10, "started at {} after promising {}", d.now, p);
                }
                return Ok(());
            }
            if let Some(r) = out.reservations.iter().find(|r| r.job == g) {
                if let Some(p) = promised {
                    prop_assert!(r.start_at <= p, "reservation slipped from {} to {}", p, r.start_at);
                }
                promised = Some(promised.map_or(r.start_at, |p| p.min(r.start_at)));
            }
        }
        prop_assert!(false, "the whole-cluster gang never started");
    }
}

#[test]
fn cycle_stats_and_config_are_sane() {
    let cfg = SchedulerConfig::default();
    assert!(cfg.backfill.enabled() && cfg.preemption && cfg.fair_share);
    let _ = ResourceLimits::default();
}

/// The same world with no quota anywhere: every queue shares one pool.
fn build_without_quotas(leaves: &[Vec<NodeGen>], queues: &[QueueGen]) -> ClusterState {
    let s = build(leaves, queues);
    let mut out = ClusterState::new(StateConfig {
        unknown_runtime_floor_seconds: 300,
    });
    for n in s.nodes() {
        out.add_node(n.spec.clone()).expect("node");
    }
    for q in s.queues() {
        let mut spec = QueueSpec::unlimited(&q.spec.name, q.spec.parent.as_deref());
        spec.weight = q.spec.weight;
        out.add_queue(spec).expect("queue");
    }
    out
}

/// Submits every job due at `step` that the cluster accepts; all preemptible,
/// with a zero grace period when `grace0`.
fn submit_due(d: &mut Driver, jobs: &[JobGen], step: u64, grace0: bool) {
    for j in jobs.iter().filter(|j| j.arrival == step) {
        let mut s = spec(j);
        if grace0 {
            s.checkpoint.grace_seconds = 0;
            s.preemptible = Some(true);
        }
        if d.state.validate(&s).is_ok() {
            d.submit(s, Some(j.actual));
        }
    }
}

/// Whether queue `q` is above nominal somewhere on its path, counting the
/// GPUs of running jobs and those promised to preemptors (`planned`).
fn borrowing(s: &ClusterState, q: u32, planned: &[gangway_sched::PlannedStart]) -> bool {
    s.queues()[q as usize].path.iter().any(|&n| {
        let Some(nom) = s.queues()[n as usize].spec.quota.nominal.gpus else {
            return false;
        };
        let promised: u64 = planned
            .iter()
            .filter_map(|p| s.job(p.job).map(|j| (j, p.placement.gpus())))
            .filter(|(j, _)| s.queues()[j.queue as usize].path.contains(&n))
            .map(|(_, g)| g)
            .sum();
        s.queue_usage(n).gpus + promised > nom
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(128), ..ProptestConfig::default() })]

    /// With a zero grace period victims exit at the instant they are
    /// signalled, and a ranking that puts every requeued job first (as SRTF
    /// and LAS do) made preemptions ping-pong forever at one instant. Here
    /// every cycle re-ranks adversarially — each pending job above
    /// everything running — and cycles repeat at the same instant until
    /// nothing changes: each job is evicted at most once per instant, and the
    /// per-cycle bound holds.
    #[test]
    fn preemption_makes_progress_at_one_instant_even_with_zero_grace(
        (leaves, queues, jobs) in world(),
        no_quotas in any::<bool>(),
        per_cycle in 1usize..6,
    ) {
        let state = if no_quotas { build_without_quotas(&leaves, &queues) } else { build(&leaves, &queues) };
        let mut d = Driver::new(state);
        d.cfg.max_preemption_searches = 64;
        d.cfg.max_preemptions_per_cycle = per_cycle;
        let mut bump = 10_000i32;
        for step in 0..30u64 {
            d.advance(step * 25);
            submit_due(&mut d, &jobs, step, true);
            let mut at_instant: BTreeMap<gangway_core::JobId, u32> = BTreeMap::new();
            let mut cycles = 0;
            loop {
                // Adversarial re-ranking: whoever waits now outranks every running job.
                let pending: Vec<_> = d.state.jobs_sorted().iter()
                    .filter(|j| j.status == JobStatus::Pending).map(|j| j.id).collect();
                for id in pending {
                    bump += 1;
                    d.state.set_priority(id, bump).expect("known job");
                }
                let out = d.cycle().clone();
                cycles += 1;
                prop_assert!(out.preemptions.len() <= per_cycle, "{} preemptions in one cycle", out.preemptions.len());
                for p in &out.preemptions {
                    let n = at_instant.entry(p.job).or_default();
                    *n += 1;
                    prop_assert!(*n == 1, "job {} evicted twice at t={}", p.job, d.now);
                }
                let before = d.state.pending_count();
                d.advance(d.now); // zero grace: victims exit now
                if out.preemptions.is_empty() && out.binds.is_empty() && d.state.pending_count() == before {
                    break;
                }
                prop_assert!(cycles < 4 * jobs.len() + 8, "no progress at t={} after {cycles} cycles", d.now);
            }
            check_quotas(&d.state)?;
        }
    }

    /// `max_victims_examined` only cuts searches short: whenever an unbounded
    /// cycle's searches examined no more candidates than the bound, the
    /// bounded cycle decides exactly the same; and whatever the bound, a
    /// bounded cycle keeps the invariants (quotas, preemptors placeable once
    /// their victims exit).
    #[test]
    fn victim_cap_only_cuts_searches_short(
        (leaves, queues, jobs) in world(),
        no_quotas in any::<bool>(),
        cap in 0usize..24,
    ) {
        let state = if no_quotas { build_without_quotas(&leaves, &queues) } else { build(&leaves, &queues) };
        let mut d = Driver::new(state);
        d.cfg.max_preemption_searches = 64;
        d.cfg.max_victims_examined = cap;
        let unbounded = SchedulerConfig { max_victims_examined: usize::MAX, ..d.cfg.clone() };
        for step in 0..40u64 {
            d.advance(step * 25);
            submit_due(&mut d, &jobs, step, false);
            let free = schedule(&d.state, d.now, &unbounded);
            let out = d.cycle().clone();
            if free.stats.victims_examined <= cap {
                prop_assert_eq!(&out, &free);
            }
            check_quotas(&d.state)?;
            check_preemptors_fit(&d)?;
        }
    }

    /// `max_pending_examined` bounds a cycle's work and changes nothing
    /// below it: with at most `cap` jobs pending a capped cycle decides
    /// exactly as an uncapped one; above it the cycle examines at most `cap`
    /// jobs (plus preemptors holding GPUs), counts the others as unexamined,
    /// explains each examined job once, and keeps the invariants.
    #[test]
    fn pending_cap_bounds_work_and_keeps_invariants(
        (leaves, queues, jobs) in world(),
        cap in 2usize..12,
    ) {
        let mut d = Driver::new(build(&leaves, &queues));
        d.cfg.max_preemption_searches = 64;
        d.cfg.max_pending_examined = cap;
        let uncapped = SchedulerConfig { max_pending_examined: usize::MAX, ..d.cfg.clone() };
        for step in 0..40u64 {
            d.advance(step * 25);
            submit_due(&mut d, &jobs, step, false);
            let pending = d.state.pending_count();
            let claims = d.state.claims().count();
            let free = schedule(&d.state, d.now, &uncapped);
            let out = d.cycle().clone();
            if pending <= cap {
                prop_assert_eq!(&out, &free);
            } else {
                prop_assert!(out.stats.considered <= cap + claims, "{} examined, cap {cap}", out.stats.considered);
                prop_assert_eq!(out.stats.unexamined, pending - out.stats.considered);
            }
            prop_assert_eq!(out.pending.len() + out.binds.len(), out.stats.considered);
            check_quotas(&d.state)?;
            check_preemptors_fit(&d)?;
        }
    }

    /// No quota, nothing lent, nothing to reclaim. A
    /// reclaim's victim is always in a queue above its nominal quota; without
    /// quotas there is no reclaim at all, and a priority preemption's victim
    /// always has a lower priority than its preemptor.
    #[test]
    fn no_reclaim_without_lent_quota(
        (leaves, queues, jobs) in world(),
        no_quotas in any::<bool>(),
    ) {
        let state = if no_quotas { build_without_quotas(&leaves, &queues) } else { build(&leaves, &queues) };
        let mut d = Driver::new(state);
        d.cfg.max_preemption_searches = 64;
        for step in 0..40u64 {
            d.advance(step * 25);
            submit_due(&mut d, &jobs, step, false);
            let before = d.state.clone();
            let out = d.cycle().clone();
            // Usage as the cycle saw it when choosing victims: with this cycle's
            // binds, victims still running until they exit.
            let after = &d.state;
            for p in &out.preemptions {
                let v = before.job(p.job).expect("victim");
                let by = before.job(p.by).expect("preemptor");
                match p.reason {
                    gangway_sched::PreemptReason::Reclaim => {
                        prop_assert!(!no_quotas, "reclaim of job {} in a cluster without quotas", p.job);
                        prop_assert!(borrowing(after, v.queue, &out.planned), "reclaim of job {} whose queue lent nothing", p.job);
                    }
                    gangway_sched::PreemptReason::Priority => {
                        prop_assert!(v.priority < by.priority || borrowing(after, v.queue, &out.planned),
                            "job {} (priority {}) preempted for {} (priority {})", p.job, v.priority, p.by, by.priority);
                    }
                }
            }
        }
    }
}

/// Nodes a job avoids, drawn from a world's node count: a bit mask of the
/// first 12 nodes and how long the avoidance lasts.
type AvoidGen = Option<(u16, u64)>;

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256), ..ProptestConfig::default() })]

    /// Whatever the cluster and job stream, a job is never bound, claimed
    /// for a preemption or planned to start (before its avoidance lapses) on
    /// a node it avoids, including jobs that avoid every node, and jobs
    /// preempted and requeued that then avoid their old nodes, as the
    /// server sets after a node fault. Once the avoidance lapses the job
    /// may go anywhere, so nothing waits forever for it.
    #[test]
    fn a_job_never_lands_on_a_node_it_avoids(
        (leaves, queues, jobs) in world(),
        avoids in prop::collection::vec(prop::option::weighted(0.5, (any::<u16>(), 1u64..600)), 60),
        reservations in 0usize..3,
    ) {
        let state = build(&leaves, &queues);
        let nodes = state.nodes().len();
        let mut d = Driver::new(state);
        d.cfg.backfill = if reservations == 0 {
            gangway_sched::Backfill::Easy
        } else {
            gangway_sched::Backfill::Reservations(reservations as u32)
        };
        let mut by_arrival: BTreeMap<u64, Vec<(usize, &JobGen)>> = BTreeMap::new();
        for (i, j) in jobs.iter().enumerate() {
            by_arrival.entry(j.arrival).or_default().push((i, j));
        }
        // The avoidance each job holds now (as set), and where each last ran.
        let mut held: BTreeMap<gangway_core::JobId, gangway_sched::Avoid> = BTreeMap::new();
        let mut ran_on: BTreeMap<gangway_core::JobId, Vec<u32>> = BTreeMap::new();
        for step in 0..40u64 {
            d.advance(step * 25);
            for (i, j) in by_arrival.get(&step).into_iter().flatten() {
                let s = spec(j);
                if d.state.validate(&s).is_err() {
                    continue;
                }
                let id = d.submit(s, Some(j.actual));
                let g: AvoidGen = avoids[*i % avoids.len()];
                if let Some((mask, secs)) = g {
                    let a = gangway_sched::Avoid {
                        nodes: (0..nodes.min(16) as u32).filter(|n| mask & (1 << n) != 0).collect(),
                        until: d.now + secs,
                    };
                    d.state.set_avoid(id, Some(a)).expect("pending job");
                    if let Some(a) = d.state.job(id).and_then(|j| j.avoid.clone()) {
                        held.insert(id, a);
                    }
                }
            }
            // Requeued victims avoid the nodes they ran on, as after a node fault.
            let requeued: Vec<gangway_core::JobId> = ran_on
                .keys()
                .filter(|id| d.state.job(**id).is_some_and(|j| j.status == JobStatus::Pending))
                .copied()
                .collect();
            for id in requeued {
                let nodes = ran_on.remove(&id).unwrap_or_default();
                let a = gangway_sched::Avoid { nodes, until: d.now + 100 };
                d.state.set_avoid(id, Some(a.clone())).expect("pending job");
                held.insert(id, a);
            }
            let out = d.cycle().clone();
            fn avoided(
                held: &BTreeMap<gangway_core::JobId, gangway_sched::Avoid>,
                id: &gangway_core::JobId,
                at: u64,
                on: &[u32],
            ) -> bool {
                held.get(id).is_some_and(|a| at < a.until && on.iter().any(|n| a.nodes.contains(n)))
            }
            for b in &out.binds {
                let on = b.placement.nodes();
                prop_assert!(!avoided(&held, &b.job, d.now, &on), "job {} bound on {:?} avoiding {:?}", b.job, on, held.get(&b.job));
                prop_assert!(d.state.job(b.job).is_some_and(|j| j.avoid.is_none() && !j.gang.avoids), "binding clears it");
                held.remove(&b.job);
                ran_on.insert(b.job, on);
            }
            for p in &out.planned {
                let on = p.placement.nodes();
                prop_assert!(!avoided(&held, &p.job, d.now, &on), "preemptor {} claims {:?} avoiding {:?}", p.job, on, held.get(&p.job));
            }
            for r in &out.plan {
                prop_assert!(!avoided(&held, &r.job, r.start_at, &r.nodes), "job {} planned at {} on {:?} avoiding {:?}", r.job, r.start_at, r.nodes, held.get(&r.job));
            }
            // Jobs still pending that ran before keep their old nodes in view.
            ran_on.retain(|id, _| d.state.job(*id).is_some());
        }
    }
}
