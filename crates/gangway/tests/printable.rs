//! Names and messages reach an admin's terminal escaped: a record stored
//! before control characters were refused in names (ESC, CR, LF, an OSC 52
//! clipboard write, a bidi override), with such an event message, still
//! loads, and `gangway queue`, `describe`, `why` and `history` print it with
//! those characters escaped.

mod common;

use common::{server_config, Cluster, ADMIN, BIN};
use gangway_core::{JobId, JobSpec, JobState};
use gangway_server::records::{job_key, JobEvent, JobRecord, JOB_SEQ};
use gangway_store::{RedbStore, Store};
use std::path::Path;
use std::process::Command;

/// The name: clears the screen, writes the clipboard, forges a line.
const NAME: &str = "train\u{1b}[2J\u{1b}]52;c;cm0gLXJmIH4=\u{7}\r\njob 9: succeeded\u{202e}";

fn record(data: &Path) {
    std::fs::create_dir_all(data).expect("data dir");
    let store = RedbStore::open(&data.join("gangway.redb")).expect("store");
    let mut rec = JobRecord::submitted(JobId(1), "alice", JobSpec::new(NAME, "default", 1, 1), 1);
    rec.state = JobState::Pending;
    rec.events.push(JobEvent {
        at: 2,
        kind: "note".into(),
        message: "rank 0 said \u{1b}[31mboom\u{1b}[0m\nforged event line\u{9b}".into(),
        count: 1,
        last_at: None,
    });
    store
        .put(&job_key(JobId(1)), &serde_json::to_vec(&rec).expect("json"))
        .expect("put");
    store.put(JOB_SEQ, b"1").expect("seq");
}

fn cli(c: &Cluster, args: &[&str]) -> Vec<u8> {
    let out = Command::new(BIN)
        .args(args)
        .env("GANGWAY_ADDR", &c.addr)
        .env("GANGWAY_TOKEN", ADMIN)
        .output()
        .expect("cli");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// No byte of a terminal control (ESC, BEL, CR, the C1 CSI, the override)
/// and the name's text shown escaped.
fn assert_escaped(what: &str, out: &[u8]) {
    let text = String::from_utf8_lossy(out);
    assert!(
        !out.iter().any(|b| matches!(b, 0x1b | 0x07 | b'\r')),
        "{what} printed a control byte: {text:?}"
    );
    assert!(
        !text.contains('\u{202e}') && !text.contains('\u{9b}'),
        "{what}: {text:?}"
    );
    assert!(
        !text.lines().any(|l| l.starts_with("job 9: succeeded")),
        "{what} printed a forged line: {text}"
    );
}

#[test]
fn a_stored_name_with_escapes_prints_escaped_in_queue_and_describe() {
    let dir = tempfile::tempdir().expect("tmp");
    record(&dir.path().join("data"));
    let c = Cluster::start_in(dir, "127.0.0.1", &server_config(""));
    let queue = cli(&c, &["queue"]);
    assert_escaped("queue", &queue);
    let shown = String::from_utf8_lossy(&queue);
    assert!(shown.contains("train\\x1b[2J"), "{shown}");
    let wide = cli(&c, &["queue", "-o", "wide"]);
    assert_escaped("queue -o wide", &wide);
    let describe = cli(&c, &["describe", "1"]);
    assert_escaped("describe", &describe);
    let text = String::from_utf8_lossy(&describe);
    assert!(
        text.contains(
            "job 1: train\\x1b[2J\\x1b]52;c;cm0gLXJmIH4=\\x07\\r\\njob 9: succeeded\\u{202e}"
        ),
        "{text}"
    );
    assert!(
        text.contains("rank 0 said \\x1b[31mboom\\x1b[0m\\nforged event line\\u{9b}"),
        "{text}"
    );
    assert!(
        !text.lines().any(|l| l.starts_with("forged event line")),
        "{text}"
    );
    assert_escaped("why", &cli(&c, &["why", "1"]));
    // `-o json` is for programs: the answer as sent, JSON-escaped.
    let json = cli(&c, &["describe", "1", "-o", "json"]);
    assert!(!json.contains(&0x1b), "JSON escapes controls itself");
    let v: serde_json::Value = serde_json::from_slice(&json).expect("json");
    assert_eq!(v["spec"]["name"], NAME);
}
