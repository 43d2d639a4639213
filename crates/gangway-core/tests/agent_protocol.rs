//! Golden fixtures of the agent protocol, one directory per minor version
//! (`tests/fixtures/agent-protocol/vMAJOR.MINOR/`): the registration body,
//! sync request and answer (each fully populated, and minimal: no optional
//! feature in use) and a log page, as that version's types wrote them.
//!
//! - The current version's files must be exactly what today's types write
//!   (a change to the wire format is a deliberate act: check it against the
//!   RUNBOOK's version-skew rule, then rewrite them with `GANGWAY_BLESS=1`).
//! - Today's parser must read every fixture of every version within the skew
//!   policy (one minor version apart), and today's minimal messages must be
//!   exactly the minimal messages of those versions, so a peer one minor
//!   version older reads what this one sends while no new feature is on.
//!
//! When the version is bumped, the test fails until the new version's
//! directory is written (`GANGWAY_BLESS=1`); the previous one stays.

use gangway_core::agent::{
    check_skew, Assignment, CheckpointCleanup, CheckpointReport, GangNode, GpuHealth,
    HealthCheckReport, HealthCheckResult, LogChunk, RankAssignment, RankFailure, RankRules,
    SyncRequest, SyncResponse, TaskReport, TaskState, Version,
};
use gangway_core::workflow::ArrayTask;
use gangway_core::{JobId, NodeSpec, RunSpec};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/agent-protocol")
}

fn assignment(full: bool) -> Assignment {
    let run: RunSpec = serde_json::from_value(serde_json::json!({
        "command": ["python", "train.py"],
        "image": if full { Value::from("pytorch:24.05") } else { Value::Null },
        "env": { "EPOCHS": "3" },
        "workdir": "/home/alice/run",
        "mounts": if full {
            serde_json::json!([{ "source": "/datasets/x", "target": "/data", "read_only": true }])
        } else {
            serde_json::json!([])
        },
    }))
    .expect("run spec");
    Assignment {
        job: JobId(42),
        attempt: 1,
        name: "train".into(),
        user: "alice".into(),
        run,
        ranks: vec![RankAssignment {
            rank: 0,
            local_rank: 0,
            gpus: vec![0, 1],
        }],
        world_size: 2,
        node_rank: 0,
        nnodes: 1,
        master_addr: "10.0.0.1".into(),
        master_port: 29_400,
        cpu_millis: 4_000,
        memory_mib: 16_384,
        checkpoint_signal: 10,
        grace_seconds: 30,
        stop: full,
        rules: if full {
            let mut r = RankRules {
                run_as: Some("alice".into()),
                queue: "research".into(),
                ..RankRules::default()
            };
            r.policy.allow_root = false;
            r.policy.mounts.allowed = vec!["/datasets".into()];
            r
        } else {
            RankRules::default()
        },
        stop_now: full,
        checkpoint_root: full.then(|| "/shared/ck".into()),
        checkpoint_subdir: "alice/job-42".into(),
        resume_from: full.then(|| "/shared/ck/alice/job-42/step-100".into()),
        max_restarts: u32::from(full) * 3,
        array: full.then_some(ArrayTask {
            job: JobId(40),
            index: 2,
            count: 4,
            limit: Some(2),
        }),
        restart_count: None,
        rendezvous_ports: None,
        nodes: if full {
            vec![
                GangNode {
                    host: "10.0.0.1".into(),
                    slots: 2,
                },
                GangNode {
                    host: "10.0.0.2".into(),
                    slots: 2,
                },
            ]
        } else {
            Vec::new()
        },
    }
}

/// Today's messages, by fixture name.
fn samples() -> Vec<(&'static str, Value)> {
    let mut node = NodeSpec::uniform("gpu-01", "leaf0", "spine0", 2, "H100", 80);
    node.address = "10.0.0.1".into();
    node.agent_url = Some("http://10.0.0.1:9100".into());
    node.labels.insert("zone".into(), "a".into());
    let mut running = TaskReport::new(JobId(42), 1, TaskState::Running);
    running.checkpoint = Some(CheckpointReport {
        step: 100,
        path: "/shared/ck/alice/job-42/step-100".into(),
        written_ms: 1_700_000_000_000,
    });
    let mut failing = TaskReport::new(JobId(43), 2, TaskState::Failing { exit_code: 137 });
    failing.failure = Some(RankFailure {
        rank: 1,
        exit_code: 137,
        signal: Some(9),
        oom_killed: true,
        log_tail: vec!["Killed".into()],
        node_fault: None,
        limit: None,
        unknown_exit: false,
    });
    let mut busy = TaskReport::new(JobId(44), 0, TaskState::Exited { exit_code: 0 });
    busy.port_busy = Some(29_400);
    let full_request = SyncRequest {
        disk_pressure: None,
        health_check: true,
        reads_rendezvous_ports: true,
        reads_gang_nodes: true,
        health_check_run: Some(HealthCheckReport {
            run: 2,
            result: Some(HealthCheckResult {
                exit_code: 1,
                tail: vec!["nccl loopback failed".into()],
            }),
        }),
        gpus: vec![
            GpuHealth {
                index: 0,
                healthy: true,
                reason: None,
            },
            GpuHealth {
                index: 1,
                healthy: false,
                reason: Some("XID 79".into()),
            },
        ],
        tasks: vec![running, failing, busy],
    };
    let minimal_request = SyncRequest {
        disk_pressure: None,
        health_check: false,
        reads_rendezvous_ports: false,
        reads_gang_nodes: false,
        health_check_run: None,
        gpus: vec![GpuHealth {
            index: 0,
            healthy: true,
            reason: None,
        }],
        tasks: vec![TaskReport::new(JobId(42), 1, TaskState::Running)],
    };
    let full_response = SyncResponse {
        assignments: vec![assignment(true)],
        cleanup: vec![CheckpointCleanup {
            job: JobId(7),
            root: Some("/shared/ck".into()),
            subdir: "alice/job-7".into(),
        }],
        health_check: Some(2),
    };
    let minimal_response = SyncResponse {
        assignments: vec![assignment(false)],
        cleanup: Vec::new(),
        health_check: None,
    };
    vec![
        ("register", v(&node)),
        ("sync_request", v(&full_request)),
        ("sync_request_minimal", v(&minimal_request)),
        ("sync_response", v(&full_response)),
        ("sync_response_minimal", v(&minimal_response)),
        (
            "log_chunk",
            v(&LogChunk {
                data: "step 1\n".into(),
                next_offset: 7,
                dropped: 0,
            }),
        ),
    ]
}

fn v<T: serde::Serialize>(x: &T) -> Value {
    serde_json::to_value(x).expect("serialize")
}

/// Parses `text` as the message `name` is a fixture of, with today's types,
/// and writes it back.
fn parse(name: &str, text: &str) -> Result<Value, String> {
    fn back<T: serde::de::DeserializeOwned + serde::Serialize>(t: &str) -> Result<Value, String> {
        let m: T = serde_json::from_str(t).map_err(|e| e.to_string())?;
        serde_json::to_value(&m).map_err(|e| e.to_string())
    }
    match name.trim_end_matches("_minimal") {
        "register" => back::<NodeSpec>(text),
        "sync_request" => back::<SyncRequest>(text),
        "sync_response" => back::<SyncResponse>(text),
        "log_chunk" => back::<LogChunk>(text),
        other => Err(format!("no message type for fixture {other:?}")),
    }
}

fn dir_of(v: Version) -> PathBuf {
    static BLESSED: std::sync::Once = std::sync::Once::new();
    BLESSED.call_once(|| {
        if std::env::var_os("GANGWAY_BLESS").is_some() {
            let dir = root().join(format!(
                "v{}.{}",
                Version::current().major,
                Version::current().minor
            ));
            std::fs::create_dir_all(&dir).expect("fixture dir");
            for (name, v) in samples() {
                let text = serde_json::to_string_pretty(&v).expect("json") + "\n";
                std::fs::write(dir.join(format!("{name}.json")), text).expect("write");
            }
        }
    });
    root().join(format!("v{}.{}", v.major, v.minor))
}

fn read_json(path: &Path) -> (String, Value) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (write this version's fixtures with GANGWAY_BLESS=1 cargo test -p gangway-core --test agent_protocol)",
            path.display()
        )
    });
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (text, v)
}

#[test]
fn the_current_versions_messages_are_its_golden_fixtures() {
    let dir = dir_of(Version::current());
    for (name, v) in samples() {
        let (_, on_disk) = read_json(&dir.join(format!("{name}.json")));
        assert_eq!(
            on_disk, v,
            "{name}: today's types write another message than this version's fixture; check the change against docs/RUNBOOK.md (Version skew), then GANGWAY_BLESS=1"
        );
    }
}

#[test]
fn todays_parser_reads_every_version_within_the_skew_policy() {
    let current = Version::current();
    let minimal: Vec<(&str, Value)> = samples()
        .into_iter()
        .filter(|(n, _)| n.ends_with("_minimal"))
        .collect();
    let mut versions = 0;
    dir_of(current);
    for entry in std::fs::read_dir(root()).expect("fixtures") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let v: Version = format!("{}.0", name.trim_start_matches('v'))
            .parse()
            .unwrap_or_else(|e| panic!("fixture directory {name}: {e}"));
        if check_skew(current, v).is_err() {
            continue; // Outside the policy: kept as history only.
        }
        versions += 1;
        let mut files = 0;
        for f in std::fs::read_dir(&path).expect("version dir") {
            let f = f.expect("file").path();
            let stem = f.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
            let (text, _) = read_json(&f);
            parse(stem, &text).unwrap_or_else(|e| {
                panic!("{name}/{stem}: today's parser refuses a message of version {v}: {e}")
            });
            files += 1;
        }
        assert!(files >= samples().len(), "{name}: {files} fixtures");
        if v <= current {
            for (stem, today) in &minimal {
                let (_, then) = read_json(&path.join(format!("{stem}.json")));
                assert_eq!(
                    &then, today,
                    "{stem}: with no new feature on, this version must send what {v} sent"
                );
            }
        }
    }
    assert!(versions >= 1, "no fixtures of version {current}");
}

#[test]
fn a_message_the_parser_would_refuse_fails_the_fixture_check() {
    // The agent protocol refuses unknown fields: a field added without the
    // RUNBOOK's care is what these fixtures catch.
    let (_, mut v) = read_json(&dir_of(Version::current()).join("sync_request.json"));
    v["tasks"][0]["checkpoint"]["extra"] = 1.into();
    assert!(parse("sync_request", &v.to_string()).is_err());
    let (_, mut v) = read_json(&dir_of(Version::current()).join("sync_response_minimal.json"));
    v["assignments"][0]["stop"] = "yes".into();
    assert!(parse("sync_response_minimal", &v.to_string()).is_err());
    assert!(parse("mystery", "{}").is_err());
}
