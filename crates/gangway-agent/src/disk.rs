//! Disk bounded: a per-job quota on its checkpoint directory (the agent's
//! periodic measurement; filesystems with project quotas can enforce the
//! same figure in the kernel) and a free-space watch on the agent's data and
//! checkpoint filesystems. Below the threshold (default 10 % free, like the
//! kubelet's `nodefs.available`) the node reports DiskPressure, takes no new
//! work, and the job writing most is stopped; the agent's own state keeps a
//! reserve file it gives back under pressure, so it can still write.

use std::path::{Path, PathBuf};

/// Free space below which a filesystem is under pressure, in percent.
pub const DEFAULT_PRESSURE_PERCENT: u32 = 10;
/// Bytes the agent holds back on its state filesystem for its own writes.
pub const RESERVE_BYTES: u64 = 8 << 20;
/// Entries a measurement walks at most (a directory of millions of files
/// is over any sensible quota long before).
const MAX_ENTRIES: usize = 1_000_000;

/// Free and total bytes of the filesystem holding `path`.
pub fn space(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs(3) on a NUL-terminated path into a zeroed struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let frsize = st.f_frsize;
    Some((
        st.f_bavail.saturating_mul(frsize),
        st.f_blocks.saturating_mul(frsize),
    ))
}

/// Whether the filesystem of `path` is under pressure: its free percent and
/// a sentence saying so.
pub fn pressure(path: &Path, percent: u32) -> Option<String> {
    let (free, total) = space(path)?;
    if total == 0 {
        return None;
    }
    let free_pct = free.saturating_mul(100) / total;
    (free_pct < u64::from(percent)).then(|| {
        format!(
            "DiskPressure: {} has {free_pct} % free ({} of {}), below {percent} %",
            path.display(),
            crate::limits::gib(free >> 20),
            crate::limits::gib(total >> 20)
        )
    })
}

/// Bytes of the files under `dir` (not following symlinks).
pub fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0u64;
    let mut stack = vec![dir.to_path_buf()];
    let mut seen = 0usize;
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            seen += 1;
            if seen > MAX_ENTRIES {
                return total;
            }
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() {
                use std::os::unix::fs::MetadataExt;
                // Blocks really used: a sparse file costs what it holds.
                total = total.saturating_add(m.blocks().saturating_mul(512));
            }
        }
    }
    total
}

/// How a quota stop reads: `checkpoint quota 50.0 GiB exceeded (51.2 GiB written)`.
pub fn quota_text(quota: u64, used: u64) -> String {
    format!(
        "checkpoint quota {} exceeded ({} written)",
        bytes(quota),
        bytes(used)
    )
}

fn bytes(b: u64) -> String {
    if b < 1 << 20 {
        format!("{} KiB", b >> 10)
    } else {
        crate::limits::gib(b >> 20)
    }
}

/// The agent's reserve: a file of [`RESERVE_BYTES`] in its state directory,
/// removed under pressure (room for the store and rank records) and made
/// again when the pressure is gone.
pub struct Reserve {
    path: PathBuf,
}

impl Reserve {
    /// The reserve in `state_dir`.
    pub fn new(state_dir: &Path) -> Self {
        Reserve {
            path: state_dir.join(".disk-reserve"),
        }
    }

    /// Holds the reserve (writes it if missing; a full disk leaves it out).
    pub fn hold(&self) {
        if std::fs::metadata(&self.path).is_ok_and(|m| m.len() >= RESERVE_BYTES) {
            return;
        }
        let zeros = vec![0u8; 1 << 20];
        let ok = std::fs::File::create(&self.path).and_then(|mut f| {
            use std::io::Write;
            for _ in 0..(RESERVE_BYTES >> 20) {
                f.write_all(&zeros)?;
            }
            f.sync_all()
        });
        if ok.is_err() {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// Gives the reserve back to the filesystem.
    pub fn release(&self) {
        if std::fs::remove_file(&self.path).is_ok() {
            tracing::warn!(
                "disk pressure: released the agent's {} reserve",
                bytes(RESERVE_BYTES)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_a_directory_and_names_the_quota() {
        let d = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(d.path().join("a/b")).expect("dirs");
        std::fs::write(d.path().join("a/b/x"), vec![1u8; 300_000]).expect("write");
        std::fs::write(d.path().join("y"), vec![1u8; 100_000]).expect("write");
        let n = dir_bytes(d.path());
        assert!((400_000..=420_000).contains(&n), "{n}");
        assert_eq!(
            quota_text(50 << 30, 51 << 30),
            "checkpoint quota 50.0 GiB exceeded (51.0 GiB written)"
        );
        assert!(space(d.path()).is_some_and(|(f, t)| f <= t && t > 0));
        assert!(pressure(d.path(), 0).is_none());
        assert!(pressure(d.path(), 101).is_some_and(|s| s.starts_with("DiskPressure: ")));
    }
}
