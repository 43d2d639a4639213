//! Loader tests on excerpts of each real trace (copied from shared/traces),
//! with a few malformed rows added to check that skips are counted by reason.

use gangway_core::PriorityClass;
use gangway_sim::trace::{
    parse_chronus, parse_csv, parse_openb, parse_philly, parse_swf, parse_timestamp, parse_tiresias,
};
use gangway_sim::ClusterSpec;

const PHILLY: &str = include_str!("data/philly.csv");
const CHRONUS: &str = include_str!("data/chronus_mix1.csv");
const TIRESIAS: &str = include_str!("data/tiresias_60.csv");
const OPENB_PODS: &str = include_str!("data/openb_pods.csv");
const OPENB_NODES: &str = include_str!("data/openb_nodes.csv");
const PAI: &str = include_str!("data/pai_machines.csv");

#[test]
fn philly_rows_are_loaded_and_bad_ones_counted() {
    let t = parse_philly("philly.csv", PHILLY).expect("parses");
    assert_eq!(t.report.rows, 23);
    assert_eq!(t.report.loaded, 20);
    assert_eq!(t.report.skipped["bad or missing timestamp"], 1);
    assert_eq!(t.report.skipped["bad or missing duration"], 1);
    assert_eq!(t.report.skipped["zero GPUs"], 1);
    // Sorted by submission, relative to the first; VC becomes the queue.
    assert_eq!(t.jobs[0].submit, 0);
    assert!(t.jobs.windows(2).all(|w| w[0].submit <= w[1].submit));
    let first = t.jobs.iter().find(|j| j.name == "philly-0").expect("row 0");
    assert_eq!(
        (first.duration, first.gpus, first.queue.as_str()),
        (66, 1, "vc_11cb48")
    );
    // 2017-10-09 07:01:55 (row 0) is 48m52s after 2017-10-09 06:13:03 (row 1).
    let second = t.jobs.iter().find(|j| j.name == "philly-1").expect("row 1");
    assert_eq!(first.submit - second.submit, 2932);
}

#[test]
fn timestamps_parse_as_utc_seconds() {
    assert_eq!(parse_timestamp("1970-01-01 00:00:00"), Some(0));
    assert_eq!(parse_timestamp("2017-10-09 07:01:55"), Some(1_507_532_515));
    assert_eq!(parse_timestamp("2017-13-09 07:01:55"), None);
    assert_eq!(parse_timestamp("yesterday"), None);
}

#[test]
fn chronus_minutes_become_seconds_and_cpu_jobs_are_skipped() {
    let t = parse_chronus("chronus-mix1", "mix1.csv", CHRONUS).expect("parses");
    assert_eq!(t.report.rows, 31);
    assert_eq!(t.report.loaded, 29);
    assert_eq!(t.report.skipped["CPU-only (0 GPUs)"], 2);
    let j0 = t
        .jobs
        .iter()
        .find(|j| j.name == "chronus-mix1-0")
        .expect("job 0");
    assert_eq!((j0.duration, j0.queue.as_str()), (747 * 60, "vc_6214e9"));
    assert_eq!(
        t.jobs
            .iter()
            .filter(|j| j.priority == PriorityClass::BestEffort)
            .count(),
        9
    );
}

#[test]
fn tiresias_workload_loads_whole() {
    let t = parse_tiresias("60_job.csv", TIRESIAS).expect("parses");
    assert_eq!(
        (t.report.rows, t.report.loaded, t.report.skipped_total()),
        (20, 20, 0)
    );
    let j1 = t
        .jobs
        .iter()
        .find(|j| j.name == "tiresias-1")
        .expect("job 1");
    assert_eq!((j1.gpus, j1.submit, j1.duration), (8, 30, 147));
}

#[test]
fn openb_pods_skip_shared_gpus_and_unscheduled_with_counts() {
    // Issue 14, defect 6: shared-GPU pods were rounded up to whole GPUs; now
    // they are skipped and counted, never silently changed.
    let t = parse_openb("pods.csv", OPENB_PODS).expect("parses");
    assert_eq!(t.report.rows, 31);
    assert_eq!(t.report.skipped["never scheduled (no run time)"], 2);
    assert_eq!(
        t.report.skipped["fractional GPU (shared-GPU pod), not replayed"],
        10
    );
    assert!(t.report.adjusted.is_empty());
    assert_eq!(t.report.loaded, 19);
    assert!(
        t.jobs.iter().all(|j| j.name != "openb-pod-0001"),
        "460 milli-GPU pod skipped"
    );
    let p0 = t
        .jobs
        .iter()
        .find(|j| j.name == "openb-pod-0000")
        .expect("pod 0");
    assert_eq!(
        (p0.gpus, p0.cpu_millis, p0.duration, p0.priority),
        (1, 12_000, 12_537_496, PriorityClass::High)
    );
}

#[test]
fn node_tables_become_clusters() {
    let openb = ClusterSpec::from_node_table("openb", OPENB_NODES, false);
    let nodes: usize = openb.node_groups.iter().map(|g| g.count).sum();
    assert_eq!(nodes, 39);
    let pai = ClusterSpec::from_node_table("pai", PAI, true);
    assert_eq!(pai.node_groups.iter().map(|g| g.count).sum::<usize>(), 20);
    let state = openb.build(&[], Default::default()).expect("builds");
    assert_eq!(state.nodes().len(), 39);
}

#[test]
fn cluster_yaml_round_trips_and_rejects_unknown_fields() {
    let yaml = r#"
name: small
node_groups:
  - count: 4
    gpus: 8
    gpu_model: H100
    gpu_memory_gib: 80
    nodes_per_leaf: 2
queues:
  - name: org
    quota: { nominal: { gpus: 32 } }
  - name: team
    parent: org
    quota: { nominal: { gpus: 16 }, borrowing_limit: { gpus: 8 } }
"#;
    let c = ClusterSpec::from_yaml("small.yaml", yaml).expect("valid");
    assert_eq!(c.gpus(), 32);
    let s = c
        .build(&["other".to_string()], Default::default())
        .expect("builds");
    assert_eq!(s.leaves().len(), 2);
    assert!(
        s.queue_index("other").is_some(),
        "undeclared queues are created without quota"
    );
    let bad = yaml.replace("nodes_per_leaf", "nodes_per_rack");
    let err = ClusterSpec::from_yaml("bad.yaml", &bad).expect_err("unknown field");
    assert!(err.to_string().contains("nodes_per_rack"), "{err}");
}

#[test]
fn a_users_csv_trace_is_read_with_bad_rows_counted() {
    let text = "\
queue,user,submit_time,run_time,gpus,name,time_limit
vision,alice,2024-03-01 10:00:00,3600,8,resnet,7200
vision,bob,2024-03-01 09:00:00,60,0,prep,
nlp,carol,2024-03-01 11:00:00,0,1,bert,
nlp,carol,yesterday,10,1,bert,
nlp,dave,2024-03-01 12:00:00,600,x,bert,
";
    let t = parse_csv("mine", "mine.csv", text).expect("parses");
    assert_eq!(t.report.rows, 5);
    assert_eq!(t.report.loaded, 2);
    assert_eq!(t.report.skipped["zero run_time"], 1);
    assert_eq!(t.report.skipped["bad or missing submit_time"], 1);
    assert_eq!(t.report.skipped["bad or missing gpus"], 1);
    // Sorted by submission, times relative to the first; CPU-only kept.
    assert_eq!(t.jobs[0].user, "bob");
    assert_eq!((t.jobs[0].gpus, t.jobs[0].submit), (0, 0));
    let a = &t.jobs[1];
    assert_eq!(
        (
            a.submit,
            a.duration,
            a.gpus,
            a.queue.as_str(),
            a.app.as_deref(),
            a.time_limit
        ),
        (3600, 3600, 8, "vision", Some("resnet"), Some(7200))
    );
    // Missing required columns are named.
    let err = parse_csv("x", "x.csv", "submit_time,gpus\n1,1\n").expect_err("no run_time");
    assert!(err.to_string().contains("run_time"), "{err}");
}

#[test]
fn swf_jobs_become_gpu_jobs() {
    // Fields: job submit wait run alloc cpu mem req_procs req_time req_mem status uid gid exe queue part prev think.
    let text = "\
; Version: 2.2
; MaxProcs: 64
1 0 10 3600 8 -1 -1 8 7200 -1 1 3 1 12 2 1 -1 -1
2 30 0 -1 4 -1 -1 4 600 -1 5 4 1 7 1 1 -1 -1
3 60 5 120 -1 -1 -1 6 -1 -1 1 3 1 12 2 1 -1 -1
4 90 0 100 16
";
    let t = parse_swf("pwa", "log.swf", text, 4).expect("parses");
    assert_eq!(t.report.rows, 4);
    assert_eq!(t.report.loaded, 2);
    assert_eq!(t.report.skipped["no run time (cancelled or unknown)"], 1);
    assert_eq!(t.report.skipped["fewer than 18 fields"], 1);
    assert_eq!(
        t.report.adjusted["requested processors used (allocated unknown)"],
        1
    );
    let j1 = &t.jobs[0];
    assert_eq!(
        (
            j1.gpus,
            j1.duration,
            j1.user.as_str(),
            j1.queue.as_str(),
            j1.app.as_deref(),
            j1.time_limit
        ),
        (2, 3600, "u3", "q2", Some("app12"), Some(7200))
    );
    // 6 processors at 4 per GPU round up to 2 GPUs.
    assert_eq!((t.jobs[1].gpus, t.jobs[1].submit), (2, 60));
}
