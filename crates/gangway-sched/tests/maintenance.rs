//! Maintenance windows: their nodes run nothing during the window, and no job
//! is placed on them that would run into it.

mod common;

use common::{cluster, job, queue, Driver};
use gangway_core::{JobId, PriorityClass, QueueSpec, ReasonCode};
use gangway_sched::{StateError, WaitReason};
use proptest::prelude::*;
use std::collections::BTreeMap;

fn driver(nodes: usize) -> Driver {
    let mut s = cluster(nodes, 8, 4);
    queue(&mut s, QueueSpec::unlimited("q", None));
    Driver::new(s)
}

#[test]
fn jobs_that_would_run_into_a_window_go_elsewhere_or_wait() {
    let mut d = driver(2);
    d.state
        .set_maintenance("maint1", &["n01".into()], 100, 200)
        .expect("window");
    // 150 s: would run into the window on n01, so it takes n00.
    let long = d.submit(job("q", 1, 8, Some(150)), None);
    // 50 s: ends before the window, n01 is fine.
    let short = d.submit(job("q", 1, 8, Some(50)), None);
    // Another 150 s: n00 is busy, n01 would run into the window.
    let waits = d.submit(job("q", 1, 8, Some(150)), None);
    d.cycle();
    let node = |d: &Driver, id: JobId| {
        d.last
            .binds
            .iter()
            .find(|b| b.job == id)
            .map(|b| b.placement.nodes())
    };
    assert_eq!(node(&d, long), Some(vec![0]));
    assert_eq!(node(&d, short), Some(vec![1]));
    let e = d
        .last
        .pending
        .iter()
        .find(|e| e.job == waits)
        .expect("waits");
    // It starts when the long job ends on n00 (150), not on n01 at 50.
    assert_eq!(e.estimated_start, Some(150), "{e:?}");
    // Inside the window n01 gets nothing, even a job that fits it.
    d.advance(100);
    let inside = d.submit(job("q", 1, 1, Some(10)), None);
    d.cycle();
    assert!(!d.is_running(inside));
    let e = d
        .last
        .pending
        .iter()
        .find(|e| e.job == inside)
        .expect("waits");
    assert_eq!(e.code(), ReasonCode::ReqNodeNotAvail, "{e:?}");
    assert!(matches!(&e.reason, WaitReason::Maintenance { name, .. } if name == "maint1"));
    assert!(
        d.reason(inside)
            .contains("maintenance maint1 (under way until t+100s)"),
        "{}",
        d.reason(inside)
    );
    // After the window (and once dropped), n01 takes work again.
    d.advance(200);
    assert_eq!(
        d.state.drop_expired_maintenance(200),
        vec!["maint1".to_string()]
    );
    d.cycle();
    assert!(d.is_running(inside));
}

#[test]
fn a_window_refuses_unknown_nodes_and_empty_spans() {
    let mut d = driver(1);
    assert!(matches!(
        d.state.set_maintenance("m", &["nope".into()], 10, 20),
        Err(StateError::UnknownNode(_))
    ));
    assert!(matches!(
        d.state.set_maintenance("m", &["n00".into()], 20, 20),
        Err(StateError::BadMaintenance(_))
    ));
    d.state
        .set_maintenance("m", &["n00".into()], 10, 20)
        .expect("window");
    assert_eq!(d.state.maintenance().count(), 1);
    assert!(d.state.remove_maintenance("m"));
    assert!(!d.state.remove_maintenance("m"));
}

#[derive(Clone, Debug)]
struct Gen {
    gpus: u32,
    replicas: u32,
    runtime: u64,
    high: bool,
    arrival: u64,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Whatever the jobs, windows and preemptions: no job is ever bound on a
    /// node whose window overlaps its estimated run.
    #[test]
    fn no_job_is_bound_into_a_window(
        nodes in 2usize..5,
        windows in prop::collection::vec((0usize..5, 0u64..300, 10u64..200), 1..4),
        jobs in prop::collection::vec(
            (prop::sample::select(vec![1u32, 2, 4, 8]), 1u32..3, 1u64..30, any::<bool>(), 0u64..300)
                .prop_map(|(gpus, replicas, rt, high, arrival)| Gen { gpus, replicas, runtime: rt * 10, high, arrival }),
            1..40,
        ),
    ) {
        let mut d = driver(nodes);
        let mut spans: Vec<(u32, u64, u64)> = Vec::new();
        for (k, (n, start, len)) in windows.iter().enumerate() {
            let n = n % nodes;
            d.state
                .set_maintenance(&format!("m{k}"), &[format!("n{n:02}")], *start, start + len)
                .expect("window");
            spans.push((n as u32, *start, start + len));
        }
        let mut runtime: BTreeMap<JobId, u64> = BTreeMap::new();
        let mut by_arrival = jobs.clone();
        by_arrival.sort_by_key(|j| j.arrival);
        let mut next = 0;
        let mut t = 0;
        while t < 2000 {
            while next < by_arrival.len() && by_arrival[next].arrival <= t {
                let j = &by_arrival[next];
                let mut s = job("q", j.replicas, j.gpus, Some(j.runtime));
                if j.high {
                    s.priority = PriorityClass::High;
                }
                runtime.insert(d.submit(s, None), j.runtime);
                next += 1;
            }
            d.cycle();
            for b in &d.last.binds {
                let end = d.now + runtime[&b.job];
                for n in b.placement.nodes() {
                    for (wn, ws, we) in &spans {
                        prop_assert!(
                            n != *wn || end <= *ws || d.now >= *we,
                            "job {} bound on node {} for [{}, {}) into window [{}, {})",
                            b.job, n, d.now, end, ws, we
                        );
                    }
                }
            }
            t += 10;
            d.advance(t);
        }
    }
}
