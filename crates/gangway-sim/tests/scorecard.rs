//! The scorecard on small cuts (CI runs these; the full scorecard is a
//! command), cluster scaling and partitions, and quota-tree validation.

use gangway_core::QueueSpec;
use gangway_sim::cluster::ClusterError;
use gangway_sim::policy::SCORECARD;
use gangway_sim::scorecard::{
    contended, markdown, offered_load, run_group, run_groups, Group, Row, Scorecard,
};
use gangway_sim::trace::{parse_chronus, parse_tiresias};
use gangway_sim::{ClusterSpec, Engine, Policy, SimOptions};

const TIRESIAS: &str = include_str!("data/tiresias_60.csv");

#[test]
fn contended_size_brings_the_offered_load_near_ninety_percent() {
    let t = parse_tiresias("60_job.csv", TIRESIAS).expect("trace");
    let c = ClusterSpec::tiresias();
    let before = offered_load(&t, c.gpus(), None);
    assert!(before < 0.85, "the published size is light: {before}");
    let small = contended(&c, &t, None);
    let after = offered_load(&t, small.gpus(), None);
    assert!(
        (0.80..=1.0).contains(&after),
        "{after} on {} GPUs",
        small.gpus()
    );
    assert_eq!(
        small.node_groups[0].gpus, c.node_groups[0].gpus,
        "node shape kept"
    );
    let biggest = t.jobs.iter().map(|j| u64::from(j.gpus)).max().unwrap_or(0);
    assert!(small.gpus() >= biggest);
}

#[test]
fn scorecard_cut_runs_every_policy_on_the_same_jobs() {
    let t = parse_tiresias("60_job.csv", TIRESIAS).expect("trace");
    let c = contended(&ClusterSpec::tiresias(), &t, None);
    let rows = run_group(&t, &c, "contended", &SCORECARD, &SimOptions::default(), 2).expect("runs");
    assert_eq!(rows.len(), SCORECARD.len());
    let order: Vec<&str> = rows.iter().map(|r| r.policy.as_str()).collect();
    let want: Vec<String> = SCORECARD.iter().map(|p| p.to_string()).collect();
    assert_eq!(order, want);
    for r in &rows {
        assert_eq!(r.jobs, t.jobs.len(), "{}", r.policy);
        assert_eq!(r.completed + r.rejected, t.jobs.len(), "{}", r.policy);
        assert!(r.avg_jct > 0.0 && r.p99_jct >= r.p50_jct);
        assert!(r.ratio_to_best_baseline.is_finite());
    }
    // The best non-oracle baseline has ratio 1.
    let best = rows
        .iter()
        .filter(|r| r.policy != "gangway" && r.policy != "srtf")
        .map(|r| r.ratio_to_best_baseline)
        .fold(f64::INFINITY, f64::min);
    assert!((best - 1.0).abs() < 1e-9);
    let sc = Scorecard {
        settings: "test".into(),
        loads: vec![t.report.clone()],
        rows,
        wall_seconds: 0.0,
    };
    let md = markdown(&sc);
    assert!(md.contains("| tiresias-60 | contended |"));
    assert!(md.contains("srtf (oracle)"));
    let svg = std::env::temp_dir().join(format!("gangway-scorecard-{}.svg", std::process::id()));
    gangway_sim::scorecard::plot(&svg, &sc).expect("plots");
    let text = std::fs::read_to_string(&svg).expect("written");
    let _ = std::fs::remove_file(&svg);
    assert!(
        text.contains("<svg") && text.contains("gangway"),
        "{}",
        &text[..text.len().min(200)]
    );
}

/// A row without its wall clock (the only figure that depends on the run).
fn timeless(rows: &[Row]) -> String {
    rows.iter()
        .map(|r| {
            let mut r = r.clone();
            r.wall_seconds = 0.0;
            format!("{r:?}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_shared_pool_gives_every_group_the_rows_of_a_run_on_one_thread() {
    // Issue 14: every (trace, size, policy) run shares one pool of threads;
    // rows come back per group, in policy order, as one thread makes them.
    let t = parse_tiresias("60_job.csv", TIRESIAS).expect("trace");
    let published = ClusterSpec::tiresias();
    let small = contended(&published, &t, None);
    let groups = [
        Group {
            trace: &t,
            cluster: &small,
            size: "contended",
        },
        Group {
            trace: &t,
            cluster: &published,
            size: "published",
        },
    ];
    let o = SimOptions::default();
    let pooled = run_groups(&groups, &SCORECARD, &o, 3).expect("runs");
    assert_eq!(pooled.len(), groups.len());
    for (g, rows) in groups.iter().zip(&pooled) {
        let alone = run_group(g.trace, g.cluster, g.size, &SCORECARD, &o, 1).expect("runs");
        assert_eq!(timeless(rows), timeless(&alone), "{}", g.size);
        assert!(rows
            .iter()
            .all(|r| r.size == g.size && r.gpus == g.cluster.gpus()));
    }
    assert_ne!(timeless(&pooled[0]), timeless(&pooled[1]), "sizes differ");
}

#[test]
fn partitions_give_each_queue_its_own_nodes() {
    let t = parse_chronus(
        "chronus-mix1",
        "mix1.csv",
        include_str!("data/chronus_mix1.csv"),
    )
    .expect("trace");
    let mut queues: Vec<String> = t.jobs.iter().map(|j| j.queue.clone()).collect();
    queues.sort();
    queues.dedup();
    let p = ClusterSpec::chronus().partitioned(&queues);
    assert_eq!(p.gpus(), 960, "every node goes to some partition");
    let o = SimOptions {
        partition: true,
        ..SimOptions::default()
    };
    let e = Engine::new(&t, &p, Policy::Fifo, o).expect("engine");
    let (r, jobs) = e.run_with_jobs(&mut |_, _| {}).expect("runs");
    assert_eq!(r.completed, t.jobs.len());
    assert!(jobs.iter().all(|j| j.rejected.is_none()));
}

#[test]
fn a_quota_tree_that_promises_too_much_is_refused_with_a_reason() {
    // Issue 14: the built-in Chronus cluster guaranteed 962 GPUs on 960.
    let c = ClusterSpec::chronus();
    let s = c
        .build(&[], Default::default())
        .expect("built-in tree is valid now");
    let vcs: u64 = s
        .queues()
        .iter()
        .filter(|q| q.parent.is_some())
        .filter_map(|q| q.spec.quota.nominal.gpus)
        .sum();
    assert!(vcs <= 960, "{vcs}");
    let mut over = c.clone();
    over.queues
        .push(QueueSpec::gpus("extra", Some("philly"), 64));
    let err = over
        .build(&[], Default::default())
        .expect_err("children > parent");
    assert!(matches!(err, ClusterError::State(..)));
    assert!(
        err.to_string()
            .contains("children's nominal quotas add up to"),
        "{err}"
    );
    let mut root = c.clone();
    root.queues[0] = QueueSpec::gpus("philly", None, 2000);
    let err = root
        .build(&[], Default::default())
        .expect_err("root > cluster");
    assert!(err.to_string().contains("but the cluster has 960"), "{err}");
}

#[test]
fn fgd_fill_is_deterministic_and_reaches_the_requested_load() {
    use gangway_sim::fgd::{fill, Fit};
    let t = gangway_sim::trace::parse_openb("pods.csv", include_str!("data/openb_pods.csv"))
        .expect("pods");
    let c = ClusterSpec::from_node_table("openb", include_str!("data/openb_nodes.csv"), false);
    for fit in [Fit::Gangway, Fit::BestFit, Fit::RandomFit] {
        let a = fill(&t, &c, fit, 7).expect("whole-GPU pods");
        let b = fill(&t, &c, fit, 7).expect("whole-GPU pods");
        assert_eq!(a.allocation_ratio, b.allocation_ratio, "{fit:?}");
        assert!(
            a.arrived_ratio >= 1.0,
            "pods arrive until they ask for every GPU"
        );
        assert!(a.allocation_ratio > 0.0 && a.allocation_ratio <= 1.0);
    }
}

#[test]
fn the_runtime_predictor_persists_as_json() {
    use gangway_sched::predict::{JobKey, RuntimePredictor};
    let mut p = RuntimePredictor::new();
    let key = JobKey {
        user: "alice",
        name: "resnet",
        queue: "vision",
        gpus: 8,
    };
    for s in [3000, 3600, 4200] {
        p.observe(&key, s);
    }
    let json = serde_json::to_string(&p).expect("serialises");
    let back: RuntimePredictor = serde_json::from_str(&json).expect("parses");
    assert_eq!(back, p);
    assert_eq!(back.predict(&key), p.predict(&key));
    assert_eq!(back.samples(), 3);
}
