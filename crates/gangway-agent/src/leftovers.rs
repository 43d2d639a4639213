//! A record of the process ranks an agent started, so that after the agent
//! crashes or restarts it finds them again and adopts them instead of
//! killing them. One JSON file per rank, `<state_dir>/ranks/<job>-<attempt>-<rank>`,
//! holding the supervisor's pid and start time (so a recycled pid is never
//! taken for it), the rank's container and its exit-code file; the
//! supervisor writes `<job>-<attempt>-<rank>.exit` when the rank's command ends.

use crate::executor::RankKey;
use crate::proctrack::{proc_info, Container};
use gangway_core::JobId;
use std::path::{Path, PathBuf};

fn dir(state_dir: &Path) -> PathBuf {
    state_dir.join("ranks")
}

fn file(state_dir: &Path, k: RankKey) -> PathBuf {
    dir(state_dir).join(format!("{}-{}-{}", k.job, k.attempt, k.rank))
}

/// Where the supervisor of a rank writes its exit code.
pub fn exit_file(state_dir: &Path, k: RankKey) -> PathBuf {
    dir(state_dir).join(format!("{}-{}-{}.exit", k.job, k.attempt, k.rank))
}

/// What is recorded of a started rank.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RankRecord {
    /// Job.
    pub job: JobId,
    /// Attempt.
    pub attempt: u32,
    /// Rank.
    pub rank: u32,
    /// The supervisor's pid.
    pub pid: i32,
    /// Its start time (clock ticks since boot).
    pub start: u64,
    /// Every process of the rank.
    pub container: Container,
    /// The checkpoint signal of its job.
    pub signal: i32,
    /// Its grace period in seconds.
    pub grace_seconds: u64,
    /// The job's checkpoint directory (where a final checkpoint says the
    /// job finished when the rank's exit code is lost).
    #[serde(default)]
    pub checkpoint_dir: Option<PathBuf>,
    /// The checkpoint root it lies under (reached from there by descriptor).
    #[serde(default)]
    pub checkpoint_base: Option<PathBuf>,
}

impl RankRecord {
    /// The rank's key.
    pub fn key(&self) -> RankKey {
        RankKey {
            job: self.job,
            attempt: self.attempt,
            rank: self.rank,
        }
    }

    /// Its checkpoint directory under its root (`fallback` for records
    /// written before the root was kept).
    pub fn checkpoint(&self, fallback: &Path) -> Option<crate::checkpoint::CkptDir> {
        let path = self.checkpoint_dir.as_deref()?;
        let base = self.checkpoint_base.as_deref().unwrap_or(fallback);
        crate::checkpoint::CkptDir::under(base, path)
    }

    /// Whether the recorded supervisor is still the same live process.
    pub fn supervisor_alive(&self) -> bool {
        self.pid > 1 && proc_info(self.pid).is_some_and(|p| p.start == self.start && !p.zombie)
    }
}

/// Records a started rank (supervisor `pid`).
pub fn record(
    state_dir: &Path,
    k: RankKey,
    pid: i32,
    container: &Container,
    signal: i32,
    grace_seconds: u64,
    checkpoint_dir: &crate::checkpoint::CkptDir,
) {
    let _ = std::fs::create_dir_all(dir(state_dir));
    let rec = RankRecord {
        job: k.job,
        attempt: k.attempt,
        rank: k.rank,
        pid,
        start: proc_info(pid).map_or(0, |p| p.start),
        container: container.clone(),
        signal,
        grace_seconds,
        checkpoint_dir: Some(checkpoint_dir.path()),
        checkpoint_base: Some(checkpoint_dir.base.clone()),
    };
    let path = file(state_dir, k);
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_vec(&rec).unwrap_or_default();
    // The directory is root's; links are still never followed.
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let _ = std::fs::remove_file(&tmp);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?
            .write_all(&text)?;
        std::fs::rename(&tmp, &path)
    };
    if let Err(e) = write() {
        tracing::warn!("cannot record rank {k:?}: {e}");
    }
}

/// When the rank was recorded (started), in milliseconds since the epoch.
pub fn recorded_ms(state_dir: &Path, k: RankKey) -> Option<u64> {
    let t = std::fs::metadata(file(state_dir, k))
        .ok()?
        .modified()
        .ok()?;
    let d = t.duration_since(std::time::UNIX_EPOCH).ok()?;
    u64::try_from(d.as_millis()).ok()
}

/// Forgets a rank none of whose processes is left.
pub fn forget(state_dir: &Path, k: RankKey) {
    let _ = std::fs::remove_file(file(state_dir, k));
    let _ = std::fs::remove_file(exit_file(state_dir, k));
}

fn read_nofollow(p: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut b = Vec::new();
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(p)?
        .take(1 << 20)
        .read_to_end(&mut b)?;
    Ok(b)
}

/// Every rank recorded by an earlier run of the agent.
pub fn recorded(state_dir: &Path) -> Vec<RankRecord> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir(state_dir))
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().to_string();
        if name.contains('.') {
            continue;
        }
        match read_nofollow(&e.path())
            .ok()
            .and_then(|b| serde_json::from_slice::<RankRecord>(&b).ok())
        {
            Some(r) => out.push(r),
            None => {
                tracing::warn!("unreadable rank record {}; ignored", e.path().display());
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    out.sort_by_key(|r| r.key());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_rank_is_found_again_with_its_supervisor_identity() {
        let dir = tempfile::tempdir().expect("tmp");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let k = RankKey {
            job: JobId(3),
            attempt: 1,
            rank: 2,
        };
        let c = Container {
            name: "c".into(),
            cgroups: vec![],
        };
        record(
            dir.path(),
            k,
            child.id() as i32,
            &c,
            15,
            30,
            &crate::checkpoint::CkptDir {
                base: "/ckpt".into(),
                rel: "u/job-3".into(),
            },
        );
        let found = recorded(dir.path());
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].key(), k);
        let c = found[0].checkpoint(Path::new("/elsewhere")).expect("ckpt");
        assert_eq!((c.base, c.rel), ("/ckpt".into(), "u/job-3".into()));
        assert!(found[0].supervisor_alive());
        let _ = child.kill();
        let _ = child.wait();
        assert!(!found[0].supervisor_alive(), "gone once killed");
        // A recycled pid is not the supervisor: its start time differs.
        let me = std::process::id() as i32;
        let my_start = proc_info(me).expect("self").start;
        let mut other = found[0].clone();
        other.pid = me;
        other.start = my_start + 1;
        assert!(!other.supervisor_alive());
        other.start = my_start;
        assert!(other.supervisor_alive(), "the same pid and start time is");
        forget(dir.path(), k);
        assert!(recorded(dir.path()).is_empty(), "records cleared");
    }
}
