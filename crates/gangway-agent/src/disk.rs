//! Disk bounded: a per-job quota on its checkpoint directory (the agent's
//! periodic measurement; filesystems with project quotas can enforce the
//! same figure in the kernel) and a free-space watch on the agent's data and
//! checkpoint filesystems. Below the threshold (default 10 % free, like the
//! kubelet's `nodefs.available`) the node reports DiskPressure, takes no new
//! work, and the job writing most is stopped; the agent's own state keeps a
//! reserve file it gives back under pressure, so it can still write.

use std::path::{Path, PathBuf};
use thiserror::Error;

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
    pressure_of(path, free, total, percent)
}

/// [`pressure`] of a filesystem with `free` of `total` bytes.
fn pressure_of(path: &Path, free: u64, total: u64, percent: u32) -> Option<String> {
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

/// Directories a measurement holds open at once, so also the deepest tree
/// it measures: a deeper one is not measured and counts as over quota. Far
/// below the agent's descriptor limit (1024 by default).
pub const MAX_DEPTH: usize = 256;

/// Why a job's directories could not be measured. A walk that fails or is
/// cut short never passes a quota: the job counts as over it.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum WalkError {
    /// The entry cap was reached.
    #[error("more than {0} entries")]
    TooMany(usize),
    /// The depth cap was reached.
    #[error("more than {0} directories deep")]
    TooDeep(usize),
    /// An entry lies on another filesystem (a mount point): it is neither
    /// entered nor left out silently.
    #[error("a mount point inside it (another filesystem)")]
    OtherFilesystem,
    /// A directory could not be opened, read or looked at.
    #[error("{0}")]
    Io(String),
    /// The walk did not end in time (a filesystem that hangs it).
    #[error("its measurement took longer than {0} s")]
    TooSlow(u64),
}

/// What a measurement found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Usage {
    /// Bytes of disk really used (blocks of files, directories and links).
    Measured(u64),
    /// The walk failed or was cut short: counts as over any quota.
    Failed(WalkError),
}

/// The open flags of every directory a walk enters: never through a final
/// symlink, never anything but a directory (a FIFO or device is never
/// opened), not inherited by ranks.
fn dir_flags() -> rustix::fs::OFlags {
    use rustix::fs::OFlags;
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// Opens directory `name` relative to `at` without following links, with
/// `O_NOATIME` where permitted (root, or the owner).
pub(crate) fn open_dir_at<Fd: std::os::fd::AsFd, P: rustix::path::Arg + Copy>(
    at: Fd,
    name: P,
) -> rustix::io::Result<std::os::fd::OwnedFd> {
    use rustix::fs::{openat, Mode, OFlags};
    match openat(&at, name, dir_flags() | OFlags::NOATIME, Mode::empty()) {
        Err(rustix::io::Errno::PERM) => openat(&at, name, dir_flags(), Mode::empty()),
        r => r,
    }
}

/// A measurement over one or more trees: by directory descriptors (each
/// directory opened relative to its parent's descriptor, so no path is
/// longer than one name and PATH_MAX does not apply), never following a
/// symlink, counting the blocks of files, directories and symlinks and each
/// inode with several links once across every tree of the same walk.
pub struct Walk {
    entries: usize,
    max_entries: usize,
    max_depth: usize,
    seen: std::collections::HashSet<(u64, u64)>,
}

impl Default for Walk {
    fn default() -> Self {
        Walk::with_limits(MAX_ENTRIES, MAX_DEPTH)
    }
}

impl Walk {
    /// A walk stopping (failed) after `max_entries` entries or deeper than
    /// `max_depth` directories.
    pub fn with_limits(max_entries: usize, max_depth: usize) -> Self {
        Walk {
            entries: 0,
            max_entries,
            max_depth: max_depth.max(1),
            seen: std::collections::HashSet::new(),
        }
    }

    /// Bytes of `st` unless its inode was already counted.
    fn count(&mut self, st: &rustix::fs::Stat) -> u64 {
        let is_dir =
            rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory;
        #[allow(clippy::unnecessary_cast)]
        if !is_dir && st.st_nlink > 1 && !self.seen.insert((st.st_dev as u64, st.st_ino as u64)) {
            return 0;
        }
        u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512)
    }

    /// Measures the tree at `dir` (the directory itself is opened without
    /// following a final link). A missing directory holds nothing.
    pub fn tree(&mut self, dir: &Path) -> Result<Tree, WalkError> {
        match open_dir_at(rustix::fs::CWD, dir) {
            Ok(fd) => self.tree_fd(fd),
            Err(rustix::io::Errno::NOENT) => Ok(Tree::default()),
            Err(e) => Err(WalkError::Io(format!("cannot open it: {e}"))),
        }
    }

    /// Measures a job's directory `dir`, opened by descriptor beneath its
    /// parent: the parent must be root's and writable by no one else (the
    /// levels the agent made above every job directory), and the directory
    /// itself is reached without following a link. A missing one holds nothing.
    pub fn job_dir(&mut self, dir: &Path) -> Result<Tree, WalkError> {
        let refused = |e: crate::safefs::FsError| WalkError::Io(format!("cannot open it: {e}"));
        let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
            return Err(WalkError::Io("not a directory's path".into()));
        };
        let base = match crate::safefs::open_base(parent) {
            Ok(b) => b,
            Err(e) if e.not_found() => return Ok(Tree::default()),
            Err(e) => return Err(refused(e)),
        };
        let last = crate::safefs::Last::Any;
        match crate::safefs::open_dir(std::os::fd::AsFd::as_fd(&base), Path::new(name), None, last)
        {
            Ok(fd) => self.tree_fd(fd),
            Err(e) if e.not_found() => Ok(Tree::default()),
            Err(e) => Err(refused(e)),
        }
    }

    /// Measures the tree of an open directory.
    pub fn tree_fd(&mut self, root: std::os::fd::OwnedFd) -> Result<Tree, WalkError> {
        use rustix::fs::{fstat, fstatvfs, statat, AtFlags, Dir, FileType};
        let io = |what: &str, e: rustix::io::Errno| WalkError::Io(format!("{what}: {e}"));
        let st = fstat(&root).map_err(|e| io("cannot look at it", e))?;
        let space = fstatvfs(&root).ok().map(|v| {
            (
                v.f_bavail.saturating_mul(v.f_frsize),
                v.f_blocks.saturating_mul(v.f_frsize),
            )
        });
        #[allow(clippy::unnecessary_cast)]
        let dev = st.st_dev as u64;
        let mut total = self.count(&st);
        let mut stack = vec![Dir::new(root).map_err(|e| io("cannot read it", e))?];
        loop {
            let depth = stack.len();
            let Some(top) = stack.last_mut() else { break };
            let entry = match top.read() {
                None => {
                    stack.pop();
                    continue;
                }
                Some(Err(e)) => return Err(io("cannot read a directory in it", e)),
                Some(Ok(entry)) => entry,
            };
            let name = entry.file_name();
            if name.to_bytes() == b"." || name.to_bytes() == b".." {
                continue;
            }
            self.entries += 1;
            if self.entries > self.max_entries {
                return Err(WalkError::TooMany(self.max_entries));
            }
            let at = top
                .fd()
                .map_err(|e| io("cannot read a directory in it", e))?;
            let st = match statat(at, name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                // Removed since it was listed: it holds nothing now.
                Err(rustix::io::Errno::NOENT) => continue,
                Err(e) => return Err(io("cannot look at an entry in it", e)),
            };
            #[allow(clippy::unnecessary_cast)]
            if st.st_dev as u64 != dev {
                return Err(WalkError::OtherFilesystem);
            }
            if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
                // Files, symlinks, FIFOs, devices and sockets: never opened.
                total = total.saturating_add(self.count(&st));
                continue;
            }
            if depth >= self.max_depth {
                return Err(WalkError::TooDeep(self.max_depth));
            }
            let fd = match open_dir_at(at, name) {
                Ok(fd) => fd,
                Err(rustix::io::Errno::NOENT) => continue,
                Err(e) => return Err(io("cannot open a directory in it", e)),
            };
            // What was opened, not what was listed (it may have been swapped).
            let st = fstat(&fd).map_err(|e| io("cannot look at a directory in it", e))?;
            #[allow(clippy::unnecessary_cast)]
            if st.st_dev as u64 != dev {
                return Err(WalkError::OtherFilesystem);
            }
            total = total.saturating_add(self.count(&st));
            stack.push(Dir::new(fd).map_err(|e| io("cannot read a directory in it", e))?);
        }
        Ok(Tree {
            bytes: total,
            dev,
            space,
        })
    }
}

/// What a walk found in one tree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tree {
    /// Bytes used.
    pub bytes: u64,
    /// Its filesystem's device number (0 for a missing directory).
    pub dev: u64,
    /// Free and total bytes of its filesystem (read through the directory's
    /// descriptor, never by the user's path).
    pub space: Option<(u64, u64)>,
}

/// Bytes used under `dir` (see [`Walk`]).
pub fn dir_bytes(dir: &Path) -> Usage {
    match Walk::default().tree(dir) {
        Ok(t) => Usage::Measured(t.bytes),
        Err(e) => Usage::Failed(e),
    }
}

/// How a quota stop reads: `checkpoint quota 50.0 GiB exceeded (51.2 GiB
/// written: checkpoint directory 51.0 GiB, TMPDIR 204 KiB)`.
pub fn quota_text(quota: u64, parts: &[(DirKind, u64)]) -> String {
    let used = parts.iter().fold(0u64, |a, (_, b)| a.saturating_add(*b));
    let each: Vec<String> = parts
        .iter()
        .map(|(k, b)| format!("{k} {}", bytes(*b)))
        .collect();
    format!(
        "checkpoint quota {} exceeded ({} written: {})",
        bytes(quota),
        bytes(used),
        each.join(", ")
    )
}

/// How a stop for a directory that could not be measured reads.
pub fn unmeasured_text(kind: DirKind, e: &WalkError) -> String {
    format!("{kind} could not be measured ({e}); a job whose disk use cannot be measured counts as over its checkpoint quota")
}

/// The directories of a job the agent measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum DirKind {
    /// Its checkpoint directory (with the per-job home inside it).
    Checkpoint,
    /// Its `TMPDIR` (the rank's `/tmp` where it has a private one).
    Tmpdir,
}

impl std::fmt::Display for DirKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DirKind::Checkpoint => "checkpoint directory",
            DirKind::Tmpdir => "TMPDIR",
        })
    }
}

/// One directory of a job, as measured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirUsage {
    /// Which one.
    pub kind: DirKind,
    /// Its bytes, or why they are unknown.
    pub usage: Usage,
    /// Its filesystem's device number (0 where unknown).
    pub dev: u64,
}

/// What one measurement batch asks: each job's directories and the
/// agent's own filesystems to watch for pressure.
pub struct Batch<K> {
    /// Each job's directories.
    pub jobs: Vec<(K, Vec<(DirKind, PathBuf)>)>,
    /// The agent's state and checkpoint roots.
    pub roots: Vec<PathBuf>,
    /// Free percent below which a filesystem is under pressure (0: never).
    pub percent: u32,
}

/// What a batch found.
pub struct Report<K> {
    /// Which batch of its meter this is.
    pub generation: u64,
    /// Each job's directories.
    pub jobs: Vec<(K, Vec<DirUsage>)>,
    /// The first pressure found, with the device numbers of every
    /// filesystem under pressure.
    pub pressure: Option<(String, std::collections::BTreeSet<u64>)>,
}

/// Measures a batch (blocking: run it off the agent's loop). Each job's
/// directories share one walk, so a file linked into two of them counts
/// once and the entry cap covers them all.
pub fn measure<K: Clone>(b: Batch<K>) -> Report<K> {
    measure_noting(b, None)
}

/// [`measure`], noting in `current` which job's directory is being walked.
fn measure_noting<K: Clone>(
    b: Batch<K>,
    current: Option<&std::sync::Mutex<Option<(K, DirKind)>>>,
) -> Report<K> {
    use std::os::unix::fs::MetadataExt;
    let note = |what: Option<(K, DirKind)>| {
        if let Some(c) = current {
            *c.lock().unwrap_or_else(|e| e.into_inner()) = what;
        }
    };
    let mut jobs = Vec::with_capacity(b.jobs.len());
    // (path for the message, device, free, total) of each filesystem seen.
    let mut seen: Vec<(PathBuf, u64, u64, u64)> = Vec::new();
    // The agent's own roots by path (root's), before any job's.
    for p in &b.roots {
        if let (Some((free, total)), Ok(m)) = (space(p), std::fs::metadata(p)) {
            seen.push((p.clone(), m.dev(), free, total));
        }
    }
    for (k, dirs) in b.jobs {
        let mut walk = Walk::default();
        let mut out = Vec::with_capacity(dirs.len());
        for (kind, dir) in dirs {
            note(Some((k.clone(), kind)));
            let (usage, dev) = match walk.job_dir(&dir) {
                Ok(t) => {
                    if let Some((free, total)) = t.space {
                        seen.push((dir.clone(), t.dev, free, total));
                    }
                    (Usage::Measured(t.bytes), t.dev)
                }
                Err(e) => (Usage::Failed(e), 0),
            };
            out.push(DirUsage { kind, usage, dev });
        }
        jobs.push((k, out));
    }
    note(None);
    let mut pressure: Option<(String, std::collections::BTreeSet<u64>)> = None;
    if b.percent > 0 {
        for (p, dev, free, total) in &seen {
            let Some(why) = pressure_of(p, *free, *total, b.percent) else {
                continue;
            };
            match &mut pressure {
                Some((_, devs)) => {
                    devs.insert(*dev);
                }
                None => pressure = Some((why, [*dev].into())),
            }
        }
    }
    Report {
        generation: 0,
        jobs,
        pressure,
    }
}

/// Runs measurement batches on a thread of their own, one at a time, so a
/// huge or hostile tree never delays the agent's loop (its heartbeats). The
/// loop hands a batch over with [`Meter::start`] and takes the report from
/// [`Meter::results`] when it comes.
pub struct Meter<K> {
    tx: tokio::sync::mpsc::UnboundedSender<Report<K>>,
    /// Reports of finished batches.
    pub results: tokio::sync::mpsc::UnboundedReceiver<Report<K>>,
    /// When the running batch started.
    since: Option<std::time::Instant>,
    /// The running batch's number (a report of an abandoned one is stale).
    generation: u64,
    /// The job directory the running batch is walking.
    current: std::sync::Arc<std::sync::Mutex<Option<(K, DirKind)>>>,
    reserve: std::sync::Arc<Reserve>,
}

impl<K: Clone + Send + 'static> Meter<K> {
    /// A meter keeping the agent's `reserve` (held or released with each
    /// batch's pressure).
    pub fn new(reserve: Reserve) -> Self {
        let (tx, results) = tokio::sync::mpsc::unbounded_channel();
        Meter {
            tx,
            results,
            since: None,
            generation: 0,
            current: Default::default(),
            reserve: std::sync::Arc::new(reserve),
        }
    }

    /// Whether a batch is being measured.
    pub fn busy(&self) -> bool {
        self.since.is_some()
    }

    /// Starts measuring `b` unless a batch is still running; returns
    /// whether it started.
    pub fn start(&mut self, b: Batch<K>) -> bool {
        if self.busy() {
            return false;
        }
        self.generation = self.generation.wrapping_add(1);
        let generation = self.generation;
        let tx = self.tx.clone();
        let reserve = self.reserve.clone();
        let current = self.current.clone();
        let spawned = std::thread::Builder::new()
            .name("gangway-disk".into())
            .spawn(move || {
                let mut r = measure_noting(b, Some(&current));
                r.generation = generation;
                if r.pressure.is_some() {
                    reserve.release();
                } else {
                    reserve.hold();
                }
                let _ = tx.send(r);
            });
        match spawned {
            Ok(_) => {
                self.since = Some(std::time::Instant::now());
                true
            }
            Err(e) => {
                tracing::warn!("cannot start a disk measurement: {e}");
                false
            }
        }
    }

    /// Takes `r` as the running batch's report: false for a stale one (of
    /// a batch given up by [`Meter::stuck`]), which must be ignored.
    pub fn take(&mut self, r: &Report<K>) -> bool {
        if self.since.is_none() || r.generation != self.generation {
            return false;
        }
        self.since = None;
        true
    }

    /// Gives up a batch running longer than `limit` (its thread is left to
    /// end by itself; its report will be stale) so the next can start; the
    /// job directory it was stuck in, if it was in one.
    pub fn stuck(&mut self, limit: std::time::Duration) -> Option<Option<(K, DirKind)>> {
        if self.since.is_none_or(|t| t.elapsed() <= limit) {
            return None;
        }
        self.since = None;
        let at = self
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        Some(at)
    }
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
    use std::os::unix::fs::MetadataExt;

    fn measured(dir: &Path) -> u64 {
        match dir_bytes(dir) {
            Usage::Measured(b) => b,
            Usage::Failed(e) => panic!("{}: {e}", dir.display()),
        }
    }

    /// Blocks of `p` itself in bytes, as `du` counts them.
    fn blocks(p: &Path) -> u64 {
        std::fs::symlink_metadata(p).expect("stat").blocks() * 512
    }

    #[test]
    fn measures_files_and_directories_and_names_the_quota() {
        let d = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(d.path().join("a/b")).expect("dirs");
        std::fs::write(d.path().join("a/b/x"), vec![1u8; 300_000]).expect("write");
        std::fs::write(d.path().join("y"), vec![1u8; 100_000]).expect("write");
        let want = [".", "a", "a/b", "a/b/x", "y"]
            .iter()
            .map(|p| blocks(&d.path().join(p)))
            .sum::<u64>();
        assert_eq!(measured(d.path()), want, "files and directories alike");
        assert!(want >= 400_000);
        assert_eq!(
            quota_text(
                50 << 30,
                &[(DirKind::Checkpoint, 51 << 30), (DirKind::Tmpdir, 200 << 10)]
            ),
            "checkpoint quota 50.0 GiB exceeded (51.0 GiB written: checkpoint directory 51.0 GiB, TMPDIR 200 KiB)"
        );
        assert_eq!(measured(&d.path().join("missing")), 0);
        assert!(space(d.path()).is_some_and(|(f, t)| f <= t && t > 0));
        assert!(pressure(d.path(), 0).is_none());
        assert!(pressure(d.path(), 101).is_some_and(|s| s.starts_with("DiskPressure: ")));
    }

    #[test]
    fn a_tree_deeper_than_path_max_is_counted() {
        use rustix::fs::{mkdirat, openat, Mode, OFlags};
        let d = tempfile::tempdir().expect("tmp");
        let name = "d".repeat(200);
        let mut fd = open_dir_at(rustix::fs::CWD, d.path()).expect("open");
        let mut depth = 0;
        // 30 levels of 200-byte names: 6,000 bytes of path, past PATH_MAX.
        for _ in 0..30 {
            mkdirat(&fd, name.as_str(), Mode::from_raw_mode(0o700)).expect("mkdirat");
            fd = open_dir_at(&fd, name.as_str()).expect("open");
            depth += 1;
        }
        let f = openat(
            &fd,
            "big",
            OFlags::WRONLY | OFlags::CREATE | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .expect("create");
        rustix::io::write(&f, &vec![7u8; 2 << 20]).expect("write");
        drop(f);
        let deep: PathBuf = std::iter::repeat_n(name.as_str(), depth).collect();
        let e = std::fs::metadata(d.path().join(&deep).join("big")).expect_err("past PATH_MAX");
        assert_eq!(e.raw_os_error(), Some(libc::ENAMETOOLONG), "{e}");
        let n = measured(d.path());
        assert!(n >= 2 << 20, "the deep file is counted: {n}");
    }

    #[test]
    fn hard_links_count_once_and_symlinks_are_not_followed() {
        let d = tempfile::tempdir().expect("tmp");
        let outside = tempfile::tempdir().expect("tmp");
        std::fs::write(outside.path().join("big"), vec![1u8; 4 << 20]).expect("write");
        std::fs::create_dir(d.path().join("sub")).expect("dir");
        std::fs::write(d.path().join("f"), vec![1u8; 1 << 20]).expect("write");
        for i in 0..5 {
            std::fs::hard_link(d.path().join("f"), d.path().join(format!("sub/l{i}")))
                .expect("link");
        }
        std::os::unix::fs::symlink(outside.path().join("big"), d.path().join("to-big"))
            .expect("symlink");
        std::os::unix::fs::symlink(outside.path(), d.path().join("to-dir")).expect("symlink");
        let want = [".", "sub", "f", "to-big", "to-dir"]
            .iter()
            .map(|p| blocks(&d.path().join(p)))
            .sum::<u64>();
        let n = measured(d.path());
        assert_eq!(
            n, want,
            "six names of one file count once; links are their own size"
        );
        assert!(n < 2 << 20, "{n}");
        // Across the trees of one walk, a file linked into both counts once.
        let t = tempfile::tempdir().expect("tmp");
        std::fs::hard_link(d.path().join("f"), t.path().join("again")).expect("link");
        let mut w = Walk::default();
        let a = w.tree(d.path()).expect("walk").bytes;
        let b = w.tree(t.path()).expect("walk").bytes;
        assert_eq!((a, b), (n, blocks(t.path())));
    }

    #[test]
    fn fifos_and_devices_count_nothing_and_are_never_opened() {
        let d = tempfile::tempdir().expect("tmp");
        nix::unistd::mkfifo(&d.path().join("fifo"), nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
        let dev = d.path().join("null");
        let c = std::ffi::CString::new(dev.as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: mknod(2) on a NUL-terminated path; root only (skipped otherwise).
        let made =
            unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) } == 0;
        let dir = d.path().to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(dir_bytes(&dir));
        });
        // Opening the FIFO would block the walk for ever.
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("the walk opened the FIFO and hung");
        assert_eq!(
            got,
            Usage::Measured(blocks(d.path())),
            "device made: {made}"
        );
    }

    #[test]
    fn a_walk_cut_short_fails() {
        let d = tempfile::tempdir().expect("tmp");
        for i in 0..150 {
            std::fs::write(d.path().join(format!("f{i}")), b"x").expect("write");
        }
        assert_eq!(
            Walk::with_limits(100, MAX_DEPTH).tree(d.path()),
            Err(WalkError::TooMany(100))
        );
        assert!(Walk::with_limits(150, MAX_DEPTH).tree(d.path()).is_ok());
        std::fs::create_dir_all(d.path().join("a/b/c/d")).expect("dirs");
        assert_eq!(
            Walk::with_limits(1000, 4).tree(d.path()),
            Err(WalkError::TooDeep(4))
        );
        assert!(Walk::with_limits(1000, 5).tree(d.path()).is_ok());
        assert_eq!(
            unmeasured_text(DirKind::Checkpoint, &WalkError::TooMany(MAX_ENTRIES)),
            "checkpoint directory could not be measured (more than 1000000 entries); a job whose disk use cannot be measured counts as over its checkpoint quota"
        );
    }

    #[test]
    fn a_mount_point_inside_fails_the_walk() {
        let d = tempfile::tempdir().expect("tmp");
        let m = d.path().join("m");
        std::fs::create_dir(&m).expect("dir");
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
            .arg(&m)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("skipped: cannot mount a tmpfs here (not root?)");
            return;
        }
        let r = dir_bytes(d.path());
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&m)
            .status();
        assert_eq!(r, Usage::Failed(WalkError::OtherFilesystem));
    }

    #[test]
    fn measuring_never_blocks_the_caller_and_never_piles_up() {
        // A job's directory lies under a root-owned level, as on a node.
        let level = tempfile::tempdir().expect("tmp");
        let d = level.path().join("job");
        std::fs::create_dir(&d).expect("job dir");
        for i in 0..30_000 {
            std::fs::File::create(d.join(format!("f{i}"))).expect("create");
        }
        let state = tempfile::tempdir().expect("tmp");
        let batch = || Batch {
            jobs: vec![(1u32, vec![(DirKind::Tmpdir, d.clone())])],
            roots: vec![state.path().to_path_buf()],
            percent: 0,
        };
        let t = std::time::Instant::now();
        let direct = measure(batch());
        let walk = t.elapsed();
        let mut m = Meter::new(Reserve::new(state.path()));
        let t = std::time::Instant::now();
        assert!(m.start(batch()));
        let handed_over = t.elapsed();
        assert!(m.busy());
        assert!(!m.start(batch()), "one batch at a time");
        assert!(
            handed_over * 4 < walk,
            "start took {handed_over:?}, the walk itself {walk:?}"
        );
        let r = m.results.blocking_recv().expect("report");
        assert!(m.take(&r));
        assert_eq!(r.jobs[0].1, direct.jobs[0].1);
        assert!(matches!(r.jobs[0].1[0].usage, Usage::Measured(_)));
        assert!(r.pressure.is_none());
        assert!(
            state.path().join(".disk-reserve").exists(),
            "the reserve is held"
        );
        assert!(
            m.start(batch()),
            "the next batch starts once the last is done"
        );
    }

    #[test]
    fn pressure_names_every_filesystem_under_it_by_device() {
        let level = tempfile::tempdir().expect("tmp");
        let d = level.path().join("job");
        std::fs::create_dir(&d).expect("job dir");
        let dev = std::fs::metadata(&d).expect("stat").dev();
        let b = |percent| Batch {
            jobs: vec![(1u32, vec![(DirKind::Checkpoint, d.clone())])],
            roots: Vec::new(),
            percent,
        };
        let r = measure(b(101));
        let (why, devs) = r.pressure.expect("under 101 % free");
        assert!(why.starts_with("DiskPressure: "), "{why}");
        assert_eq!(devs, [dev].into());
        assert_eq!(r.jobs[0].1[0].dev, dev);
        assert!(measure(b(0)).pressure.is_none(), "0: never");
    }

    #[test]
    fn a_batch_that_hangs_is_given_up_and_its_late_report_ignored() {
        let d = tempfile::tempdir().expect("tmp");
        for i in 0..5_000 {
            std::fs::File::create(d.path().join(format!("f{i}"))).expect("create");
        }
        let state = tempfile::tempdir().expect("tmp");
        let batch = || Batch {
            jobs: vec![(1u32, vec![(DirKind::Tmpdir, d.path().to_path_buf())])],
            roots: Vec::new(),
            percent: 0,
        };
        let mut m = Meter::new(Reserve::new(state.path()));
        assert!(m.start(batch()));
        assert_eq!(m.stuck(std::time::Duration::from_secs(3600)), None);
        assert!(m.stuck(std::time::Duration::ZERO).is_some(), "given up");
        assert!(!m.busy());
        let late = m.results.blocking_recv().expect("report");
        assert!(!m.take(&late), "the given-up batch's report is stale");
        assert!(m.start(batch()));
        let next = m.results.blocking_recv().expect("report");
        assert!(m.take(&next));
    }

    #[test]
    fn a_job_directory_is_opened_beneath_a_root_level_and_never_through_a_link() {
        let d = tempfile::tempdir().expect("tmp");
        let level = d.path().join("user");
        std::fs::create_dir(&level).expect("level");
        std::fs::create_dir(level.join("job")).expect("job");
        std::fs::write(level.join("job/x"), vec![1u8; 100_000]).expect("write");
        let decoy = d.path().join("decoy");
        std::fs::create_dir(&decoy).expect("decoy");
        std::fs::write(decoy.join("big"), vec![1u8; 300_000]).expect("write");
        std::os::unix::fs::symlink(&decoy, level.join("link")).expect("link");
        let n = Walk::default()
            .job_dir(&level.join("job"))
            .expect("walk")
            .bytes;
        assert!((100_000..200_000).contains(&n), "{n}");
        assert!(
            Walk::default().job_dir(&level.join("link")).is_err(),
            "a link as the job's directory is refused, not followed"
        );
        assert_eq!(
            Walk::default()
                .job_dir(&level.join("none"))
                .expect("walk")
                .bytes,
            0
        );
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&level, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        assert!(
            Walk::default().job_dir(&level.join("job")).is_err(),
            "a level others can write is not trusted"
        );
    }
}
