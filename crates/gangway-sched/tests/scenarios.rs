//! The scenarios of the field, end to end through `schedule` + `apply`.

mod common;

use common::{cluster, job, queue, Driver};
use gangway_core::{
    Gpu, JobSpec, NodeSpec, PriorityClass, QueueSpec, Quota, ResourceLimits, TopologyConstraint,
    TopologyLevel,
};
use gangway_sched::{
    schedule, ClusterState, FitFailure, PreemptReason, Rejection, SchedulerConfig, StateConfig,
    WaitReason,
};

#[test]
fn gang_of_64_on_60_free_gpus_waits_and_holds_nothing() {
    let mut s = cluster(8, 8, 4);
    queue(&mut s, QueueSpec::unlimited("research", None));
    let mut d = Driver::new(s);
    let small = d.submit(job("research", 1, 4, Some(3600)), None);
    d.cycle();
    assert!(d.is_running(small));
    assert_eq!(d.state.free_gpus(), 60);
    let big = d.submit(job("research", 64, 1, Some(3600)), None);
    let out = d.cycle().clone();
    assert!(out.binds.is_empty(), "no partial gang");
    assert!(!d.is_running(big));
    assert_eq!(d.state.free_gpus(), 60, "a waiting gang holds nothing");
    let e = out
        .pending
        .iter()
        .find(|e| e.job == big)
        .expect("explained");
    // Reserved behind the 4-GPU job with an estimated start when it ends.
    assert_eq!(e.estimated_start, Some(3600));
    assert!(d.reason(big).contains("reserved"), "{}", d.reason(big));
    d.advance(3600);
    d.cycle();
    assert!(d.is_running(big), "starts once the GPUs free up");
}

#[test]
fn eight_ranks_land_on_one_nvlink_node() {
    let mut s = ClusterState::new(StateConfig::default());
    // Two PCIe boxes with two islands of 4, one NVSwitch box.
    for (name, islands) in [("pcie0", 2u32), ("pcie1", 2), ("dgx0", 1)] {
        let gpus = (0..8)
            .map(|i| Gpu {
                index: i,
                model: "A100".into(),
                memory_gib: 80,
                healthy: true,
                island: if islands == 2 { i / 4 } else { 0 },
                ..Gpu::default()
            })
            .collect();
        let mut n = NodeSpec::uniform(name, "leaf0", "spine0", 0, "A100", 80);
        n.gpus = gpus;
        n.cpu_millis = 128_000;
        n.memory_mib = 1 << 20;
        s.add_node(n).expect("node");
    }
    queue(&mut s, QueueSpec::unlimited("train", None));
    let mut d = Driver::new(s);
    let id = d.submit(job("train", 8, 1, None), None);
    let out = d.cycle().clone();
    let b = out.binds.iter().find(|b| b.job == id).expect("bound");
    let nodes = b.placement.nodes();
    assert_eq!(nodes.len(), 1, "all ranks on one node");
    // The pcie boxes are earlier in index order, but only dgx0 has one island of 8.
    assert_eq!(d.state.nodes()[nodes[0] as usize].spec.name, "dgx0");
    assert_eq!(b.placement.level, TopologyLevel::Island);
    assert_eq!(b.placement.cost(&gangway_core::TopologyCosts::default()), 1);
    // Four ranks fit one island of a PCIe box and leave the NVSwitch box whole? dgx0 is taken; a
    // 4-rank job goes into one island.
    let four = d.submit(job("train", 4, 1, None), None);
    let out = d.cycle().clone();
    let b = out.binds.iter().find(|b| b.job == four).expect("bound");
    assert_eq!(b.placement.level, TopologyLevel::Island);
}

#[test]
fn best_fit_keeps_whole_nodes_whole() {
    let mut s = cluster(3, 8, 3);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    let six = d.submit(job("q", 1, 6, None), None);
    d.cycle();
    assert!(d.is_running(six));
    // n00 now has 2 free; n01 and n02 are whole. A 2-GPU job must take n00's last two.
    let two = d.submit(job("q", 1, 2, None), None);
    let out = d.cycle().clone();
    let node = out
        .binds
        .iter()
        .find(|b| b.job == two)
        .expect("bound")
        .placement
        .nodes()[0];
    assert_eq!(node, 0);
    assert_eq!(d.state.fragmented_gpus(8), 0, "two whole nodes stay free");
    assert_eq!(out.stats.fragmented_gpus, 0);
    assert_eq!(out.stats.free_gpus, 16);
    // And a 16-GPU gang takes both whole nodes under the one leaf.
    let big = d.submit(job("q", 2, 8, None), None);
    let out = d.cycle().clone();
    let p = &out
        .binds
        .iter()
        .find(|b| b.job == big)
        .expect("bound")
        .placement;
    assert_eq!(p.nodes(), vec![1, 2]);
    assert_eq!(p.level, TopologyLevel::Leaf);
}

#[test]
fn multi_node_gang_stays_under_one_leaf_switch() {
    // Two leaves of 4 nodes; leaf0 has 3 nodes partly used, leaf1 is whole.
    let mut s = cluster(8, 8, 4);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    for _ in 0..3 {
        d.submit(job("q", 1, 4, None), None);
    }
    d.cycle();
    let gang = d.submit(job("q", 4, 8, None), None);
    let out = d.cycle().clone();
    let p = &out
        .binds
        .iter()
        .find(|b| b.job == gang)
        .expect("bound")
        .placement;
    assert_eq!(p.level, TopologyLevel::Leaf);
    assert!(p
        .nodes()
        .iter()
        .all(|n| d.state.nodes()[*n as usize].leaf == 1));
}

#[test]
fn urgent_production_retrain_preempts_low_priority_experiment() {
    let mut s = cluster(1, 8, 1);
    queue(&mut s, QueueSpec::unlimited("ml", None));
    let mut d = Driver::new(s);
    let mut exp = job("ml", 1, 8, None);
    exp.priority = PriorityClass::Low;
    exp.checkpoint.grace_seconds = 120;
    exp.checkpoint.interval_seconds = Some(600);
    let exp = d.submit(exp, Some(100_000));
    d.cycle();
    assert!(d.is_running(exp));
    d.advance(1000);
    let mut prod = job("ml", 1, 8, Some(3600));
    prod.priority = PriorityClass::Production;
    let prod = d.submit(prod, None);
    let out = d.cycle().clone();
    assert_eq!(out.preemptions.len(), 1);
    let p = &out.preemptions[0];
    assert_eq!(
        (p.job, p.by, p.grace_seconds, p.reason),
        (exp, prod, 120, PreemptReason::Priority)
    );
    // 1000 s since start with a checkpoint every 600 s: 400 s × 8 GPUs lost.
    assert_eq!(p.lost_work_gpu_seconds, 400 * 8);
    assert!(
        d.reason(prod).contains("preempting 1 job"),
        "{}",
        d.reason(prod)
    );
    // During the grace period nothing else is preempted and the victim still runs.
    d.advance(1060);
    let out = d.cycle().clone();
    assert!(out.preemptions.is_empty());
    assert!(d.is_running(exp));
    assert!(
        d.reason(prod).contains("waiting for 1 preempted"),
        "{}",
        d.reason(prod)
    );
    // The victim checkpoints and exits at the end of its grace; it is requeued.
    d.advance(1120);
    let out = d.cycle().clone();
    assert!(d.is_running(prod));
    assert!(
        out.pending.iter().any(|e| e.job == exp),
        "victim requeued and pending"
    );
    assert_eq!(d.state.job(exp).map(|j| j.requeues), Some(1));
    // When production finishes the experiment resumes.
    d.advance(1120 + 3600);
    d.cycle();
    assert!(d.is_running(exp));
}

#[test]
fn preemption_frees_one_placeable_shape_at_least_lost_work() {
    // Two 8-GPU nodes: node 0 runs 8 one-GPU low jobs started long ago (much work lost),
    // node 1 runs 2 four-GPU low jobs that just checkpointed.
    let mut s = cluster(2, 8, 2);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    let low = |g| {
        let mut j = job("q", 1, g, None);
        j.priority = PriorityClass::Low;
        j
    };
    let old: Vec<_> = (0..8).map(|_| d.submit(low(1), Some(1 << 30))).collect();
    d.cycle();
    d.advance(5000);
    let young: Vec<_> = (0..2).map(|_| d.submit(low(4), Some(1 << 30))).collect();
    d.cycle();
    d.advance(5100);
    for &y in &young {
        d.state.record_checkpoint(y, 5090).expect("running");
    }
    let mut urgent = job("q", 8, 1, None);
    urgent.priority = PriorityClass::High;
    let urgent = d.submit(urgent, None);
    let out = d.cycle().clone();
    let mut victims: Vec<_> = out.preemptions.iter().map(|p| p.job).collect();
    victims.sort();
    assert_eq!(
        victims, young,
        "the two young jobs on one node, not eight old ones"
    );
    assert!(old.iter().all(|o| d.is_running(*o)));
    d.advance(5100 + 30);
    d.cycle();
    assert!(d.is_running(urgent));
}

#[test]
fn victim_cap_cuts_a_search_short_and_changes_nothing_within_it() {
    // Node 0: eight one-GPU low jobs from t=0 (much work lost). Node 1, from
    // t=5000: a non-preemptible job and seven cheap one-GPU low jobs, which
    // come first in the search but can never free a whole node.
    let setup = |cap: usize| {
        let mut s = cluster(2, 8, 2);
        queue(&mut s, QueueSpec::unlimited("q", None));
        let mut d = Driver::new(s);
        d.cfg.max_victims_examined = cap;
        let low = || {
            let mut j = job("q", 1, 1, None);
            j.priority = PriorityClass::Low;
            j
        };
        let old: Vec<_> = (0..8).map(|_| d.submit(low(), Some(1 << 30))).collect();
        d.cycle();
        d.advance(5000);
        let mut keep = job("q", 1, 1, None);
        keep.preemptible = Some(false);
        d.submit(keep, Some(1 << 30));
        for _ in 0..7 {
            d.submit(low(), Some(1 << 30));
        }
        d.cycle();
        d.advance(5100);
        let mut urgent = job("q", 1, 8, None);
        urgent.priority = PriorityClass::High;
        d.submit(urgent, None);
        let out = d.cycle().clone();
        let mut victims: Vec<_> = out.preemptions.iter().map(|p| p.job).collect();
        victims.sort();
        (old, victims, out.stats.victims_examined)
    };
    // Unbounded: the seven cheap ones, then the old ones until node 0 is free.
    let (old, victims, examined) = setup(usize::MAX);
    assert_eq!(victims, old);
    assert_eq!(examined, 15);
    // A bound the search fits in changes nothing.
    let (_, victims, examined) = setup(15);
    assert_eq!((victims, examined), (old.clone(), 15));
    // One fewer: the search gives up, nothing is preempted this cycle.
    let (_, victims, examined) = setup(14);
    assert_eq!((victims, examined), (Vec::new(), 14));
}

#[test]
fn never_preempts_when_the_preemptor_still_would_not_fit() {
    let mut s = cluster(2, 8, 2);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    // A non-preemptible job holds node 0's GPUs; a low job holds node 1 partly.
    let mut keep = job("q", 1, 8, None);
    keep.preemptible = Some(false);
    d.submit(keep, None);
    let mut low = job("q", 1, 2, None);
    low.priority = PriorityClass::Low;
    d.submit(low, None);
    d.cycle();
    // 16 GPUs on one leaf needs node 0 too, which cannot be freed.
    let mut hi = job("q", 2, 8, None);
    hi.priority = PriorityClass::High;
    let hi = d.submit(hi, None);
    let out = d.cycle().clone();
    assert!(out.preemptions.is_empty());
    assert!(!d.is_running(hi));
}

fn lab() -> ClusterState {
    // 48 GPUs; cohort "lab" with three teams of 16 nominal each.
    let mut s = cluster(6, 8, 6);
    queue(&mut s, QueueSpec::gpus("lab", None, 48));
    for t in ["vision", "nlp", "speech"] {
        queue(&mut s, QueueSpec::gpus(t, Some("lab"), 16));
    }
    s
}

#[test]
fn fair_quotas_keep_one_team_from_taking_every_gpu() {
    let mut d = Driver::new(lab());
    // vision floods the cluster while the others are idle: it may borrow.
    let flood: Vec<_> = (0..60)
        .map(|_| d.submit(job("vision", 1, 1, None), None))
        .collect();
    d.cycle();
    assert_eq!(flood.iter().filter(|j| d.is_running(**j)).count(), 48);
    // nlp and speech arrive: their nominal quota is reclaimed from vision's borrowing.
    d.advance(10);
    let nlp: Vec<_> = (0..16)
        .map(|_| d.submit(job("nlp", 1, 1, None), None))
        .collect();
    let speech: Vec<_> = (0..10)
        .map(|_| d.submit(job("speech", 1, 1, None), None))
        .collect();
    let mut preemptions = Vec::new();
    for round in 0..12 {
        preemptions.extend(d.cycle().preemptions.clone());
        d.advance(40 + round * 30);
    }
    d.cycle();
    assert_eq!(
        preemptions.len(),
        26,
        "exactly the borrowed GPUs the owners need"
    );
    assert!(preemptions
        .iter()
        .all(|p| p.reason == PreemptReason::Reclaim));
    assert!(preemptions.iter().all(|p| flood.contains(&p.job)));
    assert!(nlp.iter().chain(&speech).all(|j| d.is_running(*j)));
    let usage = |q: &str| {
        d.state
            .queue_usage(d.state.queue_index(q).expect("queue"))
            .gpus
    };
    assert_eq!(
        (usage("vision"), usage("nlp"), usage("speech")),
        (22, 16, 10)
    );
    // The requeued vision jobs say why they wait.
    let waiting = flood
        .iter()
        .find(|j| !d.is_running(**j))
        .expect("some vision job waits");
    let why = d.reason(*waiting);
    assert!(
        why.contains(
            "queue vision is at quota 22/16 GPUs and cannot borrow: cohort lab has 0 idle"
        ),
        "{why}"
    );
}

#[test]
fn quota_explanation_reads_like_the_issue() {
    let mut s = cluster(8, 8, 8);
    queue(&mut s, QueueSpec::gpus("lab", None, 32));
    let mut research = QueueSpec::gpus("research", Some("lab"), 32);
    research.quota.borrowing_limit = ResourceLimits::gpus(0);
    queue(&mut s, research);
    let mut d = Driver::new(s);
    for _ in 0..5 {
        d.submit(job("research", 1, 8, None), None);
    }
    d.cycle();
    let waiting = d.last.pending[0].job;
    assert_eq!(
        d.reason(waiting),
        "queue research is at its limit 32/32 GPUs (nominal + borrowing limit); the job needs 8 more"
    );
    let mut s = cluster(8, 8, 8);
    queue(&mut s, QueueSpec::gpus("lab", None, 32));
    let mut lab = s.queues()[0].spec.clone();
    lab.quota.borrowing_limit = ResourceLimits::gpus(0);
    let _ = lab;
    let mut s2 = cluster(8, 8, 8);
    let mut lab = QueueSpec::gpus("lab", None, 32);
    lab.quota.borrowing_limit = ResourceLimits::gpus(0);
    queue(&mut s2, lab);
    queue(&mut s2, QueueSpec::gpus("research", Some("lab"), 16));
    queue(&mut s2, QueueSpec::gpus("infra", Some("lab"), 16));
    let mut d = Driver::new(s2);
    for _ in 0..5 {
        d.submit(job("research", 1, 8, None), None);
    }
    d.cycle();
    // research borrowed infra's idle 16; a fifth job finds the cohort full.
    let waiting = d.last.pending[0].job;
    assert_eq!(
        d.reason(waiting),
        "queue research is at quota 32/16 GPUs and cannot borrow: cohort lab has 0 idle (needs 8)"
    );
    drop(s);
}

#[test]
fn lending_limit_keeps_part_of_an_idle_quota() {
    let mut s = cluster(4, 8, 4);
    queue(&mut s, QueueSpec::gpus("org", None, 32));
    let mut a = QueueSpec::gpus("a", Some("org"), 16);
    a.quota.lending_limit = ResourceLimits::gpus(8);
    queue(&mut s, a);
    queue(&mut s, QueueSpec::gpus("b", Some("org"), 16));
    let mut d = Driver::new(s);
    for _ in 0..32 {
        d.submit(job("b", 1, 1, None), None);
    }
    d.cycle();
    // b may borrow only the 8 GPUs a lends; 8 stay free for a.
    let b = d
        .state
        .queue_usage(d.state.queue_index("b").expect("b"))
        .gpus;
    assert_eq!(b, 24);
    assert_eq!(d.state.free_gpus(), 8);
}

#[test]
fn non_preemptible_jobs_do_not_borrow() {
    let mut s = cluster(2, 8, 2);
    queue(&mut s, QueueSpec::gpus("org", None, 16));
    queue(&mut s, QueueSpec::gpus("a", Some("org"), 8));
    queue(&mut s, QueueSpec::gpus("b", Some("org"), 8));
    let mut d = Driver::new(s);
    let mut spec = job("a", 1, 8, None);
    spec.preemptible = Some(false);
    let first = d.submit(spec.clone(), None);
    let second = d.submit(spec, None);
    d.cycle();
    assert!(d.is_running(first));
    assert!(!d.is_running(second));
    assert!(
        d.reason(second).contains("not preemptible"),
        "{}",
        d.reason(second)
    );
}

#[test]
fn drf_alternates_between_queues_without_quota() {
    let mut s = cluster(1, 8, 1);
    queue(&mut s, QueueSpec::unlimited("a", None));
    queue(&mut s, QueueSpec::unlimited("b", None));
    let mut d = Driver::new(s);
    // a submitted everything first; fair share still splits the node.
    let a: Vec<_> = (0..8)
        .map(|_| d.submit(job("a", 1, 1, None), None))
        .collect();
    d.advance(1);
    let b: Vec<_> = (0..8)
        .map(|_| d.submit(job("b", 1, 1, None), None))
        .collect();
    d.cycle();
    let ra = a.iter().filter(|j| d.is_running(**j)).count();
    let rb = b.iter().filter(|j| d.is_running(**j)).count();
    assert_eq!((ra, rb), (4, 4));
    // With fair share off it is first come, first served.
    let mut s = cluster(1, 8, 1);
    queue(&mut s, QueueSpec::unlimited("a", None));
    queue(&mut s, QueueSpec::unlimited("b", None));
    let mut d = Driver::new(s);
    d.cfg.fair_share = false;
    let a: Vec<_> = (0..8)
        .map(|_| d.submit(job("a", 1, 1, None), None))
        .collect();
    d.advance(1);
    (0..8).for_each(|_| {
        d.submit(job("b", 1, 1, None), None);
    });
    d.cycle();
    assert!(a.iter().all(|j| d.is_running(*j)));
}

#[test]
fn weights_scale_fair_shares() {
    let mut s = cluster(3, 4, 3);
    let mut heavy = QueueSpec::unlimited("heavy", None);
    heavy.weight = 2;
    queue(&mut s, heavy);
    queue(&mut s, QueueSpec::unlimited("light", None));
    let mut d = Driver::new(s);
    let h: Vec<_> = (0..12)
        .map(|_| d.submit(job("heavy", 1, 1, None), None))
        .collect();
    let l: Vec<_> = (0..12)
        .map(|_| d.submit(job("light", 1, 1, None), None))
        .collect();
    d.cycle();
    let rh = h.iter().filter(|j| d.is_running(**j)).count();
    let rl = l.iter().filter(|j| d.is_running(**j)).count();
    assert_eq!((rh, rl), (8, 4));
}

#[test]
fn priority_class_goes_first() {
    let mut s = cluster(1, 8, 1);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    d.submit(job("q", 1, 8, None), None);
    d.advance(5);
    let mut hi = job("q", 1, 8, None);
    hi.priority = PriorityClass::High;
    let hi = d.submit(hi, None);
    d.cycle();
    assert!(d.is_running(hi));
}

#[test]
fn backfill_uses_idle_gpus_without_delaying_the_head_gang() {
    let mut s = cluster(2, 8, 2);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    // 12 GPUs busy until t=1000 (8 on n00, 4 on n01), 4 idle on n01.
    d.submit(job("q", 1, 8, Some(1000)), None);
    d.submit(job("q", 1, 4, Some(1000)), None);
    d.cycle();
    let head = d.submit(job("q", 2, 8, Some(5000)), None);
    d.advance(1);
    let long = d.submit(job("q", 1, 4, Some(5000)), None); // would delay the head
    let short = d.submit(job("q", 1, 4, Some(500)), None); // ends before t=1000
    let mut scav = job("q", 1, 4, None); // unknown runtime but preemptible at lower priority
    scav.priority = PriorityClass::BestEffort;
    let out = d.cycle().clone();
    assert_eq!(out.reservations.len(), 1);
    assert_eq!(out.reservations[0].job, head);
    assert_eq!(out.reservations[0].start_at, 1000);
    assert!(!d.is_running(long));
    assert!(
        d.reason(long)
            .starts_with("reserved to start at t+16m behind job"),
        "{}",
        d.reason(long)
    );
    assert!(d.is_running(short), "short job backfills");
    assert!(out.binds.iter().any(|b| b.job == short && b.backfilled));
    // The short job ends; a best-effort job may take its GPUs: the gang can preempt it.
    d.advance(501);
    let scav = d.submit(scav, None);
    d.cycle();
    assert!(
        d.is_running(scav),
        "a best-effort job may use reserved GPUs: the gang can preempt it"
    );
    d.advance(1000);
    let out = d.cycle().clone();
    assert!(out
        .preemptions
        .iter()
        .any(|p| p.job == scav && p.by == head));
    d.advance(1030);
    d.cycle();
    assert!(
        d.is_running(head),
        "head starts when its reservation comes due"
    );
}

#[test]
fn an_enforced_time_limit_is_the_run_time_bound_for_backfill() {
    let mut s = cluster(2, 8, 2);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    // Busy until t=1000, known only through the time limit.
    let mut busy = job("q", 1, 8, None);
    busy.time_limit = Some(gangway_core::TimeSpan::Text("1000s".into()));
    d.submit(busy, Some(1000));
    let mut busy2 = job("q", 1, 4, None);
    busy2.time_limit = Some(gangway_core::TimeSpan::Seconds(1000));
    d.submit(busy2, Some(1000));
    d.cycle();
    let head = d.submit(job("q", 2, 8, None), None);
    d.advance(1);
    // Declares no runtime, but cannot run past its 500 s limit: backfills.
    let mut limited = job("q", 1, 4, None);
    limited.time_limit = Some(gangway_core::TimeSpan::Text("00:08:20".into()));
    let limited = d.submit(limited, Some(400));
    // No runtime and no limit: it could delay the head, so it waits.
    let open = d.submit(job("q", 1, 4, None), None);
    let out = d.cycle().clone();
    assert_eq!(out.reservations.len(), 1);
    assert_eq!(out.reservations[0].job, head);
    assert_eq!(out.reservations[0].start_at, 1000, "from the time limits");
    assert!(d.is_running(limited), "{}", d.reason(limited));
    assert!(!d.is_running(open));
}

#[test]
fn a_big_gang_is_not_starved_by_a_stream_of_small_jobs() {
    let mut s = cluster(4, 8, 4);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    let mut big = None;
    let mut promised: Option<u64> = None;
    for t in 0..2000u64 {
        d.advance(t * 10);
        // A steady stream of 1-GPU jobs that would keep every GPU busy forever.
        for _ in 0..3 {
            d.submit(job("q", 1, 1, Some(100 + (t % 7) * 10)), None);
        }
        if t == 20 {
            big = Some(d.submit(job("q", 32, 1, Some(200)), None));
        }
        let out = d.cycle().clone();
        let Some(b) = big else { continue };
        if d.is_running(b) {
            // It started no later than the first start time it was promised.
            let p = promised.expect("it held a reservation first");
            assert!(d.now <= p, "started at {} but was promised {p}", d.now);
            return;
        }
        if let Some(r) = out.reservations.iter().find(|r| r.job == b) {
            // Once promised, the start never slips.
            assert!(
                promised.is_none_or(|p| r.start_at <= p),
                "reservation slipped"
            );
            promised = Some(promised.map_or(r.start_at, |p| p.min(r.start_at)));
        }
    }
    panic!("the 32-GPU gang never started");
}

#[test]
fn elastic_gang_starts_with_fewer_replicas() {
    let mut s = cluster(2, 8, 2);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    d.submit(job("q", 1, 8, None), None);
    d.cycle();
    let mut el = job("q", 4, 4, None);
    el.min_replicas = Some(2);
    el.topology = TopologyConstraint::Any;
    let el = d.submit(el, None);
    let out = d.cycle().clone();
    let b = out
        .binds
        .iter()
        .find(|b| b.job == el)
        .expect("elastic gang starts");
    assert_eq!(b.placement.replicas.len(), 2);
}

#[test]
fn unhealthy_and_cordoned_capacity_is_never_assigned() {
    let mut s = cluster(2, 8, 2);
    queue(&mut s, QueueSpec::unlimited("q", None));
    s.set_gpu_health("n00", 3, false).expect("gpu");
    s.set_cordoned("n01", true).expect("node");
    let mut d = Driver::new(s);
    let eight = d.submit(job("q", 1, 8, None), None);
    let seven = d.submit(job("q", 1, 7, None), None);
    d.cycle();
    assert!(!d.is_running(eight));
    assert!(
        d.reason(eight)
            .contains("largest free block is 7 on node n00"),
        "{}",
        d.reason(eight)
    );
    assert!(d.is_running(seven));
    let JobStatus::Running(r) = &d.state.job(seven).expect("job").status else {
        panic!()
    };
    assert_eq!(
        r.placement.replicas[0].gpus & (1 << 3),
        0,
        "GPU 3 is unhealthy"
    );
    use gangway_sched::JobStatus;
}

#[test]
fn impossible_requests_are_rejected_with_clear_errors() {
    let mut s = cluster(4, 8, 2);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut capped = QueueSpec::gpus("small", None, 8);
    capped.quota.borrowing_limit = ResourceLimits::gpus(0);
    queue(&mut s, capped);
    let err = |spec: JobSpec| s.validate(&spec).expect_err("rejected").to_string();
    assert_eq!(
        err(job("q", 1, 16, None)),
        "resources.gpus: 16 GPUs per replica but no matching node has more than 8"
    );
    let mut m = job("q", 1, 1, None);
    m.resources.gpu_model = Some("V100".into());
    assert_eq!(
        err(m),
        "resources.gpu_model: no node has V100 GPUs (cluster has: H100)"
    );
    let mut mem = job("q", 1, 1, None);
    mem.resources.min_gpu_memory_gib = Some(141);
    assert!(err(mem).contains("141 GiB requested but the largest matching GPU has 81920 MiB"));
    assert_eq!(
        err(job("nope", 1, 1, None)),
        "queue: unknown queue \"nope\""
    );
    assert_eq!(
        err(job("q", 8, 8, None)),
        "the gang needs 64 GPUs but the cluster has only 32 matching GPUs"
    );
    let mut node = job("q", 2, 8, None);
    node.topology = TopologyConstraint::Node;
    assert!(err(node).starts_with("topology: the gang needs 16 GPUs on one node"));
    let mut leaf = job("q", 3, 8, None);
    leaf.topology = TopologyConstraint::Leaf;
    assert!(err(leaf).contains("under one leaf switch but no leaf has more than 16"));
    assert!(err(job("small", 2, 8, None)).contains(
        "queue small: the gang needs 16 gpus but nominal + borrowing limit allows at most 8"
    ));
    let mut cpu = job("q", 1, 1, None);
    cpu.resources.cpu_millis = 10_000_000;
    assert!(err(cpu).starts_with("resources.cpu"));
    assert!(matches!(
        s.validate(&job("q", 0, 1, None)),
        Err(Rejection::Spec(_))
    ));
    // Nothing was accepted by the failed validations.
    assert_eq!(s.pending_count(), 0);
    // Before any GPU node joins, the reason says so.
    let mut empty = ClusterState::new(StateConfig::default());
    queue(&mut empty, QueueSpec::unlimited("q", None));
    assert_eq!(
        empty
            .validate(&job("q", 1, 8, None))
            .expect_err("rejected")
            .to_string(),
        "resources.gpus: 8 GPUs per replica requested but no node with GPUs has joined the cluster"
    );
}

#[test]
fn decisions_are_deterministic() {
    let build = || {
        let mut s = cluster(16, 8, 4);
        queue(&mut s, QueueSpec::gpus("org", None, 128));
        queue(&mut s, QueueSpec::gpus("a", Some("org"), 64));
        queue(&mut s, QueueSpec::gpus("b", Some("org"), 64));
        for i in 0..200u64 {
            let q = if i % 3 == 0 { "a" } else { "b" };
            let g = [1, 1, 2, 4, 8][(i % 5) as usize];
            let r = if i % 17 == 0 { 4 } else { 1 };
            s.submit(
                gangway_core::JobId(i),
                job(q, r, g, Some(100 * (i % 9 + 1))),
                i / 10,
            )
            .expect("valid");
        }
        s
    };
    let (a, b) = (build(), build());
    let cfg = SchedulerConfig::default();
    assert_eq!(schedule(&a, 50, &cfg), schedule(&b, 50, &cfg));
    assert_eq!(schedule(&a, 50, &cfg), schedule(&a, 50, &cfg));
}

#[test]
fn waiting_reasons_name_the_shape() {
    let mut s = cluster(4, 8, 2);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    d.cfg.backfill = gangway_sched::Backfill::Off;
    for _ in 0..4 {
        d.submit(job("q", 1, 6, None), None);
    }
    d.cycle();
    let spread = d.submit(job("q", 4, 8, None), None);
    let mut leaf = job("q", 2, 4, None);
    leaf.topology = TopologyConstraint::Leaf;
    let leaf = d.submit(leaf, None);
    let out = d.cycle().clone();
    let e = out
        .pending
        .iter()
        .find(|e| e.job == spread)
        .expect("pending");
    assert!(matches!(
        e.reason,
        WaitReason::NoFit(FitFailure::Spread { hostable: 0, .. })
    ));
    assert_eq!(
        d.reason(spread),
        "needs 4 replicas × 8 GPUs; free GPUs can host only 0"
    );
    assert_eq!(
        d.reason(leaf),
        "needs 2 replicas × 4 GPUs under one leaf switch; free GPUs can host only 0"
    );
    let _ = Quota::default();
}

/// A CPU-only job (`resources.gpus: 0`, data preparation or evaluation).
fn cpu_job(queue: &str, replicas: u32, cpu_millis: u64) -> JobSpec {
    let mut j = JobSpec::new("prep", queue, replicas, 0);
    j.resources.cpu_millis = cpu_millis;
    j.runtime_seconds = Some(600);
    j
}

#[test]
fn cpu_only_jobs_run_on_gpu_nodes_without_taking_gpus() {
    // Issue 14, defect 5: a 0-GPU job waited forever on an idle cluster of GPU nodes.
    let mut s = cluster(2, 2, 2);
    queue(&mut s, QueueSpec::unlimited("data", None));
    let mut d = Driver::new(s);
    let prep = d.submit(cpu_job("data", 2, 4000), None);
    let out = d.cycle().clone();
    assert!(d.is_running(prep), "{}", d.reason(prep));
    let b = out.binds.iter().find(|b| b.job == prep).expect("bound");
    assert_eq!(b.placement.gpus(), 0);
    assert_eq!(d.state.free_gpus(), 4, "a CPU-only job takes no GPU");
    // GPU work still gets every GPU beside it.
    let train = d.submit(job("data", 2, 2, Some(600)), None);
    d.cycle();
    assert!(d.is_running(train), "{}", d.reason(train));
    assert_eq!(d.state.free_gpus(), 0);
}

#[test]
fn cpu_only_jobs_prefer_nodes_without_gpus_and_wait_for_cpu() {
    let mut s = cluster(1, 4, 1);
    let mut cpu = NodeSpec::uniform("cpu0", "leaf0", "spine0", 0, "none", 0);
    cpu.cpu_millis = 8000;
    s.add_node(cpu).expect("cpu node");
    queue(&mut s, QueueSpec::unlimited("data", None));
    let mut d = Driver::new(s);
    let a = d.submit(cpu_job("data", 1, 8000), None);
    let out = d.cycle().clone();
    let b = out.binds.iter().find(|b| b.job == a).expect("bound");
    let cpu_node = d.state.node_index("cpu0").expect("cpu0");
    assert_eq!(
        b.placement.nodes(),
        vec![cpu_node],
        "the GPU-less node first"
    );
    // The CPU node is full: the next one goes on the GPU node (64 cores there).
    let b2 = d.submit(cpu_job("data", 1, 60_000), None);
    d.cycle();
    assert!(d.is_running(b2), "{}", d.reason(b2));
    // More CPU than any node has free waits, explained, and starts when CPU frees up.
    let c = d.submit(cpu_job("data", 1, 8000), None);
    d.cycle();
    assert!(!d.is_running(c));
    d.advance(600);
    d.cycle();
    assert!(d.is_running(c), "{}", d.reason(c));
}

#[test]
fn predicted_run_times_open_backfill_windows_only_with_history() {
    // Issue 14, defect 3: no fixed 4 h guess. A job without a declared run time
    // backfills around a reservation only when completed jobs like it predict
    // that it ends in time.
    let run = |history: bool| -> bool {
        let mut s = cluster(1, 4, 1);
        queue(&mut s, QueueSpec::unlimited("q", None));
        let mut like = JobSpec::new("train", "q", 1, 1);
        like.user = "alice".into();
        if history {
            for _ in 0..5 {
                s.learn_runtime(&like, 100);
            }
        }
        let mut d = Driver::new(s);
        let a = d.submit(job("q", 1, 2, Some(1000)), None);
        d.cycle();
        assert!(d.is_running(a));
        let b = d.submit(job("q", 1, 4, Some(100)), None);
        let out = d.cycle().clone();
        assert!(out
            .reservations
            .iter()
            .any(|r| r.job == b && r.start_at == 1000));
        let c = d.submit(like.clone(), Some(100));
        let pred = d.state.job(c).and_then(|j| j.prediction);
        assert_eq!(pred.is_some(), history);
        if let Some(p) = pred {
            assert_eq!(p.median(), 100);
            assert!(p.quantile(0.9) > 100 && p.quantile(0.9) < 1000);
        }
        d.cycle();
        d.is_running(c)
    };
    assert!(
        run(true),
        "predicted to end before the reservation: backfilled"
    );
    assert!(
        !run(false),
        "unknown run time: may not take the reserved GPUs"
    );
}

#[test]
fn a_job_past_its_estimate_is_not_expected_to_end_now() {
    // The reservation behind an overrunning job starts later than now: the
    // overrun job is expected to run as long again (Lindy) when nothing else is known.
    let mut s = cluster(1, 4, 1);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    let a = d.submit(job("q", 1, 4, Some(100)), Some(10_000));
    d.cycle();
    d.advance(1000);
    let b = d.submit(job("q", 1, 4, Some(100)), None);
    let out = d.cycle().clone();
    let r = out
        .reservations
        .iter()
        .find(|r| r.job == b)
        .expect("reserved");
    assert!(d.is_running(a));
    assert!(r.start_at >= 1900, "reservation at {}", r.start_at);
}

/// Whether a production job preempts a low one of queue `q` (set up by
/// `rules`) that started at 0, at `at`, under the scheduler's `cfg`.
fn preempted_at(rules: impl Fn(&mut QueueSpec), cfg: SchedulerConfig, at: u64) -> bool {
    let mut s = cluster(1, 8, 1);
    let mut q = QueueSpec::unlimited("q", None);
    rules(&mut q);
    queue(&mut s, q);
    let mut d = Driver::new(s);
    d.cfg = cfg;
    let mut low = job("q", 1, 8, None);
    low.priority = PriorityClass::Low;
    let low = d.submit(low, Some(100_000));
    d.cycle();
    assert!(d.is_running(low));
    d.advance(at);
    let mut prod = job("q", 1, 8, Some(3600));
    prod.priority = PriorityClass::Production;
    d.submit(prod, None);
    let out = d.cycle().clone();
    out.preemptions.iter().any(|p| p.job == low)
}

#[test]
fn a_queues_preemption_rules_override_the_schedulers_either_way() {
    let global = |min_run: u64, budget: Option<u32>| SchedulerConfig {
        min_run_seconds: min_run,
        preemption_budget: budget,
        ..SchedulerConfig::default()
    };
    // Minimum run time: the queue's protects a victim the scheduler's would not...
    assert!(preempted_at(|_| {}, global(0, None), 100));
    assert!(!preempted_at(
        |q| q.min_run_seconds = Some(3600),
        global(0, None),
        100
    ));
    assert!(preempted_at(
        |q| q.min_run_seconds = Some(3600),
        global(0, None),
        3600
    ));
    // ...and allows one the scheduler's protects.
    assert!(!preempted_at(|_| {}, global(600, None), 100));
    assert!(preempted_at(
        |q| q.min_run_seconds = Some(0),
        global(600, None),
        100
    ));
    // Preemption budget, both ways.
    assert!(!preempted_at(
        |q| q.preemption_budget = Some(0),
        global(0, None),
        100
    ));
    assert!(!preempted_at(|_| {}, global(0, Some(0)), 100));
    assert!(preempted_at(
        |q| q.preemption_budget = Some(1),
        global(0, Some(0)),
        100
    ));
}

/// Whether a low job, preempted once at 600 s of its first run and
/// restarted, is preempted again `after` seconds into its second run, with
/// a 600 s minimum run that grows with preemptions (`grows`) or not.
fn preempted_again_after(grows: bool, after: u64) -> bool {
    let mut s = cluster(1, 8, 1);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    d.cfg = SchedulerConfig {
        min_run_seconds: 600,
        min_run_grows: grows,
        ..SchedulerConfig::default()
    };
    let prod = |d: &mut Driver| {
        let mut p = job("q", 1, 8, Some(100));
        p.priority = PriorityClass::Production;
        d.submit(p, Some(100))
    };
    let mut low = job("q", 1, 8, None);
    low.priority = PriorityClass::Low;
    let low = d.submit(low, Some(100_000));
    d.cycle();
    d.advance(599);
    prod(&mut d);
    assert!(d.cycle().preemptions.is_empty(), "599 s < 600 s minimum");
    d.advance(600);
    assert!(d.cycle().preemptions.iter().any(|p| p.job == low));
    // The victim leaves after its grace, the production job runs and ends,
    // and the low job starts again.
    d.advance(700);
    d.cycle();
    d.advance(900);
    d.cycle();
    assert!(d.is_running(low), "{}", d.reason(low));
    let restarted = d.started_attempt(low);
    d.advance(restarted + after);
    prod(&mut d);
    d.cycle().preemptions.iter().any(|p| p.job == low)
}

#[test]
fn a_growing_minimum_run_protects_a_victim_longer_after_each_preemption() {
    // A fixed minimum: 600 s into the second run, it is a victim again.
    assert!(!preempted_again_after(false, 599));
    assert!(preempted_again_after(false, 600));
    // Growing: once preempted, it must run (1 + 1) × 600 s first.
    assert!(!preempted_again_after(true, 600));
    assert!(!preempted_again_after(true, 1199));
    assert!(preempted_again_after(true, 1200));
}

#[test]
fn a_refused_node_changes_nothing_and_the_check_agrees_with_adding() {
    // The server checks a registration, stores it, then adds it: every
    // refusal must come from the check, before any index changes.
    let mut s = cluster(2, 8, 2);
    let before = s.nodes().len();
    let total = s.total();
    let refused = [
        NodeSpec::uniform("n00", "leaf0", "spine0", 8, "H100", 80), // duplicate
        NodeSpec::uniform("n09", "leaf0", "spine1", 8, "H100", 80), // leaf under another spine
        NodeSpec::uniform("n10", "leaf0", "spine0", 65, "H100", 80), // too many GPUs
    ];
    for spec in refused {
        let checked = s.check_new_node(&spec);
        assert!(checked.is_err(), "{}", spec.name);
        let added = s.add_node(spec.clone());
        assert_eq!(
            added.err().map(|e| e.to_string()),
            checked.err().map(|e| e.to_string()),
            "{}",
            spec.name
        );
        assert_eq!(s.nodes().len(), before);
        assert_eq!(s.total(), total);
    }
    // A new spine with a new leaf, and a new GPU model, are fine.
    let ok = NodeSpec::uniform("n11", "leaf9", "spine1", 4, "A100", 40);
    assert!(s.check_new_node(&ok).is_ok());
    s.add_node(ok).expect("valid");
    assert_eq!(s.nodes().len(), 3);
    s.check_invariants().expect("consistent");
}

/// A queue deeper than `max_pending_examined`: each cycle examines the head
/// of the order and a rotating share of the rest, so every waiting job is
/// examined (and explained) within one rotation, the head every cycle; and a
/// deep job that fits starts within that rotation (backfill reaches it).
#[test]
fn a_capped_cycle_examines_the_head_and_rotates_through_the_rest() {
    let mut s = cluster(1, 8, 1);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    d.cfg.max_pending_examined = 10;
    let blocker = d.submit(job("q", 1, 7, Some(1_000_000)), None);
    d.cycle();
    assert!(d.is_running(blocker));
    // 100 jobs of 2 GPUs cannot start on the one free GPU.
    let waiting: Vec<_> = (0..100)
        .map(|_| d.submit(job("q", 1, 2, Some(600)), None))
        .collect();
    // Head 5 of 100 pending; a window of 5 moves over the other 95: 19 cycles.
    let mut seen = std::collections::BTreeMap::new();
    for c in 0..19u64 {
        d.advance(10 * (c + 1));
        let out = d.cycle().clone();
        assert!(out.binds.is_empty());
        assert!(
            out.stats.considered <= 10,
            "cycle {c} examined {}",
            out.stats.considered
        );
        assert_eq!(out.stats.unexamined, 100 - out.stats.considered);
        assert_eq!(out.pending.len(), out.stats.considered);
        for head in &waiting[..5] {
            assert!(
                out.pending.iter().any(|e| e.job == *head),
                "head job {head:?} not examined in cycle {c}"
            );
        }
        for e in &out.pending {
            *seen.entry(e.job).or_insert(0u32) += 1;
        }
    }
    let missed: Vec<_> = waiting.iter().filter(|j| !seen.contains_key(j)).collect();
    assert!(
        missed.is_empty(),
        "never examined in a rotation: {missed:?}"
    );
    // Past the head, each job is examined once per rotation, not more.
    assert!(waiting[5..].iter().all(|j| seen[j] == 1), "{seen:?}");

    // A 1-GPU job submitted last fits the free GPU: the rotation reaches it.
    let small = d.submit(job("q", 1, 1, Some(600)), None);
    let started = (0..20u64).any(|c| {
        d.advance(1_000 + 10 * c);
        d.cycle();
        d.is_running(small)
    });
    assert!(started, "the deep job that fits never started");
}

/// A restarted gang avoids the node blamed for its failure: it goes to
/// another node while one fits it; where only the avoided node fits it
/// waits, says why and until when, and then runs there (the avoidance is
/// bounded, so a one-node cluster never strands it); the plan starts it no
/// earlier than the avoidance lapses; binding clears it.
#[test]
fn a_job_avoids_its_blamed_node_for_a_bounded_time() {
    use gangway_sched::Avoid;
    // Two free nodes: it goes to the one it does not avoid.
    let mut s = cluster(2, 8, 2);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    let id = d.submit(job("q", 1, 8, Some(600)), None);
    let avoid = |until| {
        Some(Avoid {
            nodes: vec![0],
            until,
        })
    };
    d.state.set_avoid(id, avoid(600)).expect("pending");
    d.cycle();
    assert!(d.is_running(id));
    let on = match &d.state.job(id).map(|j| &j.status) {
        Some(gangway_sched::JobStatus::Running(r)) => r.placement.nodes(),
        other => panic!("{other:?}"),
    };
    assert_eq!(on, vec![1], "not the avoided node n00");
    assert!(
        d.state.job(id).is_some_and(|j| j.avoid.is_none()),
        "cleared once bound"
    );

    // One node only: it waits, naming the node and the time, then runs there.
    let mut s = cluster(1, 8, 1);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    let id = d.submit(job("q", 1, 8, Some(600)), None);
    d.state.set_avoid(id, avoid(600)).expect("pending");
    let out = d.cycle().clone();
    assert!(out.binds.is_empty());
    let e = out.pending.iter().find(|e| e.job == id).expect("explained");
    assert!(
        matches!(&e.reason, WaitReason::Avoiding { nodes, until: 600 } if nodes == &vec![0]),
        "{:?}",
        e.reason
    );
    assert_eq!(e.estimated_start, Some(600));
    assert_eq!(e.code(), gangway_core::ReasonCode::ReqNodeNotAvail);
    assert_eq!(
        d.reason(id),
        "avoiding node n00 after its fault until t+10m: only the nodes it avoids fit it now, and it may use them once that lapses"
    );
    d.advance(599);
    d.cycle();
    assert!(!d.is_running(id), "still avoiding at t=599");
    d.advance(600);
    d.cycle();
    assert!(d.is_running(id), "the avoidance lapsed at t=600");

    // Busy other node, avoided node busy too: the plan starts it once both
    // its avoidance lapsed and a node is free, never on n00 before then.
    let mut s = cluster(2, 8, 2);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    d.cfg.backfill = gangway_sched::Backfill::Easy;
    let a = d.submit(job("q", 1, 8, Some(100)), None);
    let b = d.submit(job("q", 1, 8, Some(5000)), None);
    d.cycle();
    assert!(d.is_running(a) && d.is_running(b));
    let id = d.submit(job("q", 1, 8, Some(600)), None);
    d.state.set_avoid(id, avoid(300)).expect("pending");
    let out = d.cycle().clone();
    let on_n00 = |r: &gangway_sched::Reservation| r.nodes == vec![0];
    let r = out.plan.iter().find(|r| r.job == id).expect("planned");
    if on_n00(r) {
        assert!(
            r.start_at >= 300,
            "planned on n00 at {} before the avoidance lapses",
            r.start_at
        );
    }
    let e = out.pending.iter().find(|e| e.job == id).expect("explained");
    assert!(e.estimated_start.is_some_and(|t| t >= 300), "{e:?}");

    // Clearing it (no nodes) puts the job back on every node.
    let mut s = cluster(1, 8, 1);
    queue(&mut s, QueueSpec::unlimited("q", None));
    let mut d = Driver::new(s);
    let id = d.submit(job("q", 1, 8, Some(600)), None);
    d.state.set_avoid(id, avoid(600)).expect("pending");
    d.state
        .set_avoid(
            id,
            Some(Avoid {
                nodes: vec![9],
                until: 600,
            }),
        )
        .expect("pending");
    assert!(
        d.state.job(id).is_some_and(|j| j.avoid.is_none()),
        "unknown nodes are dropped"
    );
    d.cycle();
    assert!(d.is_running(id));
}
