//! Retention: finished jobs leave the store after `retention.finished_jobs`,
//! exported first as history rows; idempotency keys after
//! `retention.idempotency_keys`.

use gangway_core::{JobId, JobSpec, JobState};
use gangway_server::control::NewJob;
use gangway_server::history::HistoryEntry;
use gangway_server::retention::{compact_history, pass, year_month, Compactor, Removed, Retention};
use gangway_server::ServerConfig;

const NOW: u64 = 1_798_000_000;
const DAY: u64 = 86_400;
const CONFIG: &str = "admin_token: retention-admin\nagent_token: retention-join\n\
                      queues:\n  - name: q\n";

fn submit(app: &gangway_server::http::common::App, n: usize) -> Vec<JobId> {
    submit_named(app, n, "")
}

/// `n` jobs of alice's, named and keyed `{tag}j{i}` / `alice:{tag}k{i}`.
fn submit_named(app: &gangway_server::http::common::App, n: usize, tag: &str) -> Vec<JobId> {
    let mut c = app.control.lock().expect("lock");
    if c.cluster.nodes().is_empty() {
        let node = gangway_core::NodeSpec::uniform("n0", "l0", "s0", 8, "H100", 80);
        let by = gangway_server::nodes::Registrant::Admin;
        c.register_node(node, &by, true, "retention-join", NOW)
            .expect("node");
    }
    let batch = (0..n)
        .map(|i| {
            let mut spec = JobSpec::new(&format!("{tag}j{i}"), "q", 1, 1);
            spec.user = "alice".into();
            let mut j = NewJob::new("alice", spec);
            j.key = Some(format!("alice:{tag}k{i}"));
            j
        })
        .collect();
    c.submit_batch(batch, NOW)
        .into_iter()
        .map(|r| r.expect("accepted"))
        .collect()
}

#[test]
fn finished_jobs_are_exported_then_removed_and_keys_expire() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = ServerConfig::from_yaml(CONFIG).expect("config");
    assert_eq!(cfg.retention, Retention::default());
    let app = gangway_server::open(cfg.clone(), dir.path()).expect("open");
    let ids = submit(&app, 3);
    {
        let mut c = app.control.lock().expect("lock");
        c.cancel(ids[0], "alice", NOW + 10).expect("cancel");
        c.cancel(ids[1], "alice", NOW + 20).expect("cancel");
    }
    let export_dir = app.export_dir.get().expect("export dir").clone();
    let r = &cfg.retention;
    // Within a day: nothing goes.
    let n = pass(&app.control, r, Some(&export_dir), NOW + DAY - 1).expect("pass");
    assert_eq!(n, Removed::default());
    // After a day the keys go; the finished jobs stay for 7 days.
    let n = pass(&app.control, r, Some(&export_dir), NOW + DAY + 30).expect("pass");
    assert_eq!(n, Removed { jobs: 0, keys: 3 });
    assert_eq!(app.control.lock().expect("lock").jobs.len(), 3);
    // 7 days after they ended, both finished jobs go; the pending one stays.
    let n = pass(&app.control, r, Some(&export_dir), NOW + 7 * DAY + 20).expect("pass");
    assert_eq!(n, Removed { jobs: 2, keys: 0 });
    {
        let c = app.control.lock().expect("lock");
        assert_eq!(c.jobs.keys().copied().collect::<Vec<_>>(), vec![ids[2]]);
    }
    // Their history rows were written first, to the month they ended.
    let file = export_dir.join(format!("export-{}.jsonl", year_month(NOW)));
    let text = std::fs::read_to_string(&file).expect("export file");
    let rows: Vec<HistoryEntry> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a history row"))
        .collect();
    assert_eq!(
        rows.iter().map(|r| r.id).collect::<Vec<_>>(),
        ids[..2].to_vec()
    );
    assert!(rows.iter().all(|r| r.state == JobState::Cancelled));
    assert_eq!(rows[0].ended_at, Some(NOW + 10));
    // The store agrees after a restart.
    drop(app);
    let app = gangway_server::open(cfg, dir.path()).expect("reopen");
    let c = app.control.lock().expect("lock");
    assert_eq!(c.jobs.keys().copied().collect::<Vec<_>>(), vec![ids[2]]);
}

#[test]
fn without_an_export_directory_finished_jobs_are_kept() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = ServerConfig::from_yaml(CONFIG).expect("config");
    let app = gangway_server::open(cfg.clone(), dir.path()).expect("open");
    let ids = submit(&app, 1);
    app.control
        .lock()
        .expect("lock")
        .cancel(ids[0], "alice", NOW)
        .expect("cancel");
    let n = pass(&app.control, &cfg.retention, None, NOW + 30 * DAY).expect("pass");
    assert_eq!(n, Removed { jobs: 0, keys: 1 });
    assert_eq!(app.control.lock().expect("lock").jobs.len(), 1);
}

#[test]
fn bad_horizons_are_refused_naming_the_field() {
    for (yaml, field) in [
        (
            "retention: { finished_jobs: 10 }",
            "retention.finished_jobs",
        ),
        (
            "retention: { idempotency_keys: soon }",
            "retention.idempotency_keys",
        ),
        (
            "retention: { finished_jobs: 4000d }",
            "retention.finished_jobs",
        ),
        (
            "retention: { store_history: 10 }",
            "retention.store_history",
        ),
    ] {
        let err = ServerConfig::from_yaml(&format!("{CONFIG}{yaml}\n")).expect_err(yaml);
        assert!(err.to_string().contains(field), "{yaml}: {err}");
    }
    let ok = ServerConfig::from_yaml(&format!(
        "{CONFIG}retention: {{ finished_jobs: 30d, idempotency_keys: 2h }}\n"
    ))
    .expect("config");
    assert_eq!(ok.retention.seconds(), Ok((30 * DAY, 7200)));
}

#[test]
fn a_finished_job_named_by_a_waiting_dependency_is_kept() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = ServerConfig::from_yaml(CONFIG).expect("config");
    let app = gangway_server::open(cfg.clone(), dir.path()).expect("open");
    let ids = submit(&app, 3);
    let (a, b, other) = (ids[0], ids[1], ids[2]);
    let dependant = {
        let mut c = app.control.lock().expect("lock");
        let mut spec = JobSpec::new("after", "q", 1, 1);
        spec.dependency = Some(format!("afterany:{a}:{b}"));
        let d = c.submit("alice", spec, NOW).expect("dependant");
        // `a` ends; `b` is held, so the dependant keeps waiting on it.
        c.cancel(a, "alice", NOW + 10).expect("cancel a");
        c.cancel(other, "alice", NOW + 10).expect("cancel other");
        c.hold(b, gangway_server::workflow::Hold::User, "alice", NOW + 10)
            .expect("hold b");
        d
    };
    let export_dir = app.export_dir.get().expect("export dir").clone();
    let n = pass(
        &app.control,
        &cfg.retention,
        Some(&export_dir),
        NOW + 8 * DAY,
    )
    .expect("pass");
    // `other` goes; `a` stays because the dependant names it.
    assert_eq!(n.jobs, 1);
    let mut c = app.control.lock().expect("lock");
    assert!(c.jobs.contains_key(&a), "the named job was removed");
    assert!(!c.jobs.contains_key(&other));
    c.cycle(NOW + 8 * DAY + 1).expect("cycle");
    let rec = &c.jobs[&dependant].0;
    assert_eq!(rec.state, JobState::Pending, "{:?}", rec.events.last());
}

/// Jobs come and go (submitted, cancelled, exported and removed) round
/// after round; with the store's history compacted each pass, the redb
/// file stops growing (without it, every record's every version stays in
/// the log), the job still pending is intact across a restart, and a watch
/// from the compacted past is refused.
#[test]
fn compacting_the_store_history_keeps_the_file_bounded_under_churn() {
    let dir = tempfile::tempdir().expect("tmp");
    let cfg = ServerConfig::from_yaml(CONFIG).expect("config");
    let app = gangway_server::open(cfg.clone(), dir.path()).expect("open");
    let kept = submit_named(&app, 1, "kept")[0];
    let export_dir = app.export_dir.get().expect("export dir").clone();
    let file = dir.path().join("gangway.redb");
    let r = &cfg.retention;
    let mut compactor = Compactor::default();
    let mut sizes = Vec::new();
    let mut compacted = Vec::new();
    let mut t = NOW;
    for round in 0..10 {
        let ids = submit_named(&app, 300, &format!("r{round}"));
        {
            let mut c = app.control.lock().expect("lock");
            for id in ids {
                c.cancel(id, "alice", t).expect("cancel");
            }
        }
        t += 8 * DAY;
        let n = pass(&app.control, r, Some(&export_dir), t).expect("pass");
        assert_eq!(n.jobs, 300);
        compacted.push(compact_history(&*app.store, r, &mut compactor, t).expect("compact"));
        sizes.push(std::fs::metadata(&file).expect("file").len());
    }
    // The first pass only marks; every later one compacts to the mark
    // before it.
    assert_eq!(compacted[0], None);
    assert!(compacted[1..].iter().all(Option::is_some), "{compacted:?}");
    let grown = sizes[9] as f64 / sizes[3] as f64;
    assert!(
        grown < 1.25,
        "the file grew {grown:.2}x from round 3 to 9: {sizes:?}"
    );
    assert!(matches!(
        app.store.watch("/", 1),
        Err(gangway_store::StoreError::Compacted { .. })
    ));
    drop(app);
    let app = gangway_server::open(cfg, dir.path()).expect("reopen");
    let c = app.control.lock().expect("lock");
    assert_eq!(c.jobs.keys().copied().collect::<Vec<_>>(), vec![kept]);
    assert_eq!(c.jobs[&kept].0.state, JobState::Pending);
}
