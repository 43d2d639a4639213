//! The audit log: one JSON line per state-changing API call (who, what,
//! which job or node, the result), appended to `audit.log` in the data
//! directory (mode 0600, opened append-only) and readable by admins at
//! `GET /v1/audit` and with `gangway audit`. Agents' heartbeats are not
//! recorded (their effects are, as job events).

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Entries kept in memory for a server without an audit file.
const IN_MEMORY: usize = 10_000;

/// One audited call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AuditEntry {
    /// Seconds since the epoch.
    pub at: u64,
    /// Who: `admin`, a user name, `agent`, `node:NAME`, or why nobody
    /// (`no token`, `unknown token`).
    pub who: String,
    /// What: method and route (`POST /v1/jobs/{id}/cancel`).
    pub action: String,
    /// Which job or node, when the call names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// HTTP status of the answer.
    pub status: u16,
    /// `ok`, `refused` (4xx) or `error` (5xx).
    pub result: String,
}

/// The job or node a handler acted on, for the audit line (set as a
/// response extension when the path does not name it, e.g. a new job's id).
#[derive(Clone, Debug)]
pub struct AuditTarget(pub String);

/// Where audit entries go.
pub struct AuditLog {
    file: Option<Mutex<std::fs::File>>,
    path: Option<PathBuf>,
    recent: Mutex<VecDeque<AuditEntry>>,
}

impl AuditLog {
    /// An audit log appended to `path` (created 0600).
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let mut o = std::fs::OpenOptions::new();
        o.create(true).append(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            o.mode(0o600);
        }
        let f = o.open(path)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        }
        Ok(AuditLog {
            file: Some(Mutex::new(f)),
            path: Some(path.to_path_buf()),
            recent: Mutex::new(VecDeque::new()),
        })
    }

    /// An audit log kept in memory only (the last 10,000 entries).
    pub fn memory() -> Self {
        AuditLog {
            file: None,
            path: None,
            recent: Mutex::new(VecDeque::new()),
        }
    }

    /// Appends an entry; a write failure is logged, never fatal to the call.
    /// Its text is escaped first ([`gangway_core::text::printable`]): a
    /// target or name from a request never reaches a log reader raw.
    pub fn record(&self, mut e: AuditEntry) {
        for s in [&mut e.who, &mut e.action, &mut e.result]
            .into_iter()
            .chain(e.target.as_mut())
        {
            if let std::borrow::Cow::Owned(x) = gangway_core::text::printable(s) {
                *s = x;
            }
        }
        tracing::info!(
            target: "gangway::audit",
            who = %e.who, action = %e.action, target = e.target.as_deref().unwrap_or(""),
            status = e.status, "audit"
        );
        if let Some(f) = &self.file {
            let mut line = serde_json::to_string(&e).unwrap_or_default();
            line.push('\n');
            if let Ok(mut f) = f.lock() {
                if let Err(err) = f.write_all(line.as_bytes()) {
                    tracing::error!("audit log: cannot append: {err}");
                }
            }
            return;
        }
        if let Ok(mut r) = self.recent.lock() {
            if r.len() == IN_MEMORY {
                r.pop_front();
            }
            r.push_back(e);
        }
    }

    /// The last `limit` entries at or after `since`, oldest first.
    pub fn read(&self, since: u64, limit: usize) -> std::io::Result<Vec<AuditEntry>> {
        let mut out: VecDeque<AuditEntry> = VecDeque::new();
        let mut keep = |e: AuditEntry| {
            if e.at >= since {
                if out.len() == limit {
                    out.pop_front();
                }
                out.push_back(e);
            }
        };
        match &self.path {
            Some(p) => {
                let f = std::fs::File::open(p)?;
                for line in std::io::BufReader::new(f).lines() {
                    if let Ok(e) = serde_json::from_str::<AuditEntry>(&line?) {
                        keep(e);
                    }
                }
            }
            None => {
                if let Ok(r) = self.recent.lock() {
                    r.iter().cloned().for_each(keep);
                }
            }
        }
        Ok(out.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(at: u64) -> AuditEntry {
        AuditEntry {
            at,
            who: "admin".into(),
            action: "POST /v1/jobs".into(),
            target: Some(format!("job {at}")),
            status: 201,
            result: "ok".into(),
        }
    }

    #[test]
    fn entry_text_is_escaped_before_it_is_written() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("audit.log");
        let log = AuditLog::open(&path).expect("open");
        let mut e = entry(1);
        e.target = Some("node n\u{1b}]52;c;SGk=\u{7}\u{9b}\u{202e}".into());
        log.record(e);
        let text = std::fs::read(&path).expect("read");
        assert!(
            !text.iter().any(|b| *b == 0x1b || *b == 0x07),
            "{:?}",
            String::from_utf8_lossy(&text)
        );
        let back = log.read(0, 10).expect("read back");
        assert_eq!(
            back[0].target.as_deref(),
            Some("node n\\x1b]52;c;SGk=\\x07\\u{9b}\\u{202e}")
        );
    }

    #[test]
    fn entries_are_appended_to_a_private_file_and_read_back() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = dir.path().join("audit.log");
        let a = AuditLog::open(&p).expect("open");
        for i in 1..=5 {
            a.record(entry(i));
        }
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&p).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let got = a.read(2, 3).expect("read");
        assert_eq!(got, vec![entry(3), entry(4), entry(5)]);
        // A reopened log keeps what was written.
        drop(a);
        let a = AuditLog::open(&p).expect("reopen");
        a.record(entry(6));
        assert_eq!(a.read(0, 100).expect("read").len(), 6);
    }
}
