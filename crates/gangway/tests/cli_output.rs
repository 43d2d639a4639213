//! What the CLI prints around its answers: nothing before an error, and
//! nothing (no `Broken pipe`, no panic) when its reader goes away early, as
//! `gangway queue | head -1` does.

mod common;

use common::{free_port, ADMIN, BIN};
use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

#[test]
fn no_table_header_is_printed_before_an_error() {
    // Nothing listens there: every command fails before it has an answer.
    let addr = format!("http://127.0.0.1:{}", free_port());
    for args in [
        &["queue"][..],
        &["queue", "-o", "wide"],
        &["queue", "-o", "json"],
        &["nodes"],
        &["queues"],
        &["history"],
        &["audit"],
        &["describe", "5_7"],
    ] {
        let out = Command::new(BIN)
            .args(args)
            .env("GANGWAY_ADDR", &addr)
            .env("GANGWAY_TOKEN", ADMIN)
            .env("GANGWAY_CONFIG", "/nonexistent")
            .output()
            .expect("gangway");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            out.stdout.is_empty(),
            "{args:?} printed before its error: {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(
            stderr.contains("cannot reach the server"),
            "{args:?}: {stderr}"
        );
    }
}

/// Runs `gangway ARGS`, reads one byte of its output and closes the pipe
/// (`| head -c1`): (exit status, stderr).
fn read_one_byte_of(args: &[&str], addr: &str) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .env("GANGWAY_ADDR", addr)
        .env("GANGWAY_TOKEN", ADMIN)
        .env("GANGWAY_CONFIG", "/nonexistent")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("gangway");
    let mut stdout = child.stdout.take().expect("stdout");
    let mut one = [0u8; 1];
    stdout.read_exact(&mut one).expect("a first byte");
    drop(stdout);
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("stderr");
    (child.wait().expect("wait"), err)
}

/// SIGPIPE's number on Linux.
const SIGPIPE: i32 = 13;

#[test]
fn a_closed_pipe_ends_the_cli_quietly_as_coreutils_do() {
    // 190 kB of OpenAPI and a completion script: more than a pipe holds, so
    // a write after the reader left meets the closed pipe. The behaviour is
    // the process's (SIGPIPE's disposition), the same for `queue | head -1`.
    let addr = format!("http://127.0.0.1:{}", free_port());
    for args in [&["openapi"][..], &["completions", "bash"]] {
        let (status, err) = read_one_byte_of(args, &addr);
        assert!(
            !err.contains("Broken pipe") && !err.contains("panicked") && err.is_empty(),
            "{args:?}: {err}"
        );
        // Killed by SIGPIPE (141 in a shell) or done before the pipe closed.
        assert!(
            status.success() || status.signal() == Some(SIGPIPE),
            "{args:?}: {status:?}"
        );
    }
}
