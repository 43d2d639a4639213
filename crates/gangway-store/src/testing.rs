//! A throwaway etcd for tests: `etcd` (Debian's etcd-server) on loopback
//! ports with a temporary data dir, killed on drop. Tests call
//! [`EtcdProcess::start`] and skip when it returns `None`; with
//! `GANGWAY_REQUIRE_ETCD` set (CI) a missing etcd is a failure instead.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd.
pub struct EtcdProcess {
    child: Option<Child>,
    /// Data directory (kept across [`EtcdProcess::restart`]).
    dir: tempfile::TempDir,
    /// Client URL.
    pub endpoint: String,
    peer: String,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// Whether CI asked for the tests behind `var` to run, so that a skip is a
/// failure: `var` is set to anything but "" or "0".
pub fn required(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Skips a test because `why`, or fails it when [`required`]`(var)`. The
/// line `skipped: WHY (VAR)` goes to stderr and, when `GANGWAY_SKIP_LOG`
/// names a file, is appended to it: libtest counts a skipped test as passed
/// and hides its output, so CI counts skips from that file.
pub fn skip_or_fail(var: &str, why: &str) {
    assert!(!required(var), "{var} is set but {why}");
    let line = format!("skipped: {why} ({var})");
    eprintln!("{line} (set {var}=1 to make this a failure)");
    if let Some(log) = std::env::var_os("GANGWAY_SKIP_LOG") {
        use std::io::Write;
        let test = std::thread::current().name().unwrap_or("?").to_string();
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .and_then(|mut f| writeln!(f, "{line} [{test}]"));
        assert!(
            appended.is_ok(),
            "cannot append to GANGWAY_SKIP_LOG: {appended:?}"
        );
    }
}

impl EtcdProcess {
    /// Starts etcd, or says why not (and returns `None`) when it is not installed.
    pub fn start() -> Option<EtcdProcess> {
        let bin = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists());
        let Some(_) = bin else {
            skip_or_fail(
                "GANGWAY_REQUIRE_ETCD",
                "etcd is not installed (apt-get install etcd-server)",
            );
            return None;
        };
        let dir = tempfile::tempdir().ok()?;
        let mut e = EtcdProcess {
            child: None,
            dir,
            endpoint: format!("http://127.0.0.1:{}", free_port()),
            peer: format!("http://127.0.0.1:{}", free_port()),
        };
        e.launch();
        Some(e)
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn launch(&mut self) {
        let child = Command::new("etcd")
            .arg("--data-dir")
            .arg(self.data())
            .args(["--name", "gangway-test"])
            .args(["--listen-client-urls", &self.endpoint])
            .args(["--advertise-client-urls", &self.endpoint])
            .args(["--listen-peer-urls", &self.peer])
            .args(["--initial-advertise-peer-urls", &self.peer])
            .args(["--initial-cluster", &format!("gangway-test={}", self.peer)])
            .args(["--log-level", "error"])
            // etcd's default limits (128 operations per transaction, 1.5 MiB
            // per request), as a team's existing etcd runs: Gangway splits
            // its batches to fit.
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn etcd");
        self.child = Some(child);
        let health = format!("{}/health", self.endpoint);
        let deadline = Instant::now() + Duration::from_secs(30);
        while ureq_like_get(&health).is_none() {
            assert!(Instant::now() < deadline, "etcd did not become healthy");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills etcd with SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills etcd and starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }
}

impl Drop for EtcdProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A plain HTTP GET over a TCP socket (no client library needed for one probe).
fn ureq_like_get(url: &str) -> Option<String> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/').map_or((rest, "/"), |(h, p)| (h, p));
    let mut s = std::net::TcpStream::connect(host).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    (out.starts_with("HTTP/1.") && out.contains("\"health\":\"true\"")).then_some(out)
}
