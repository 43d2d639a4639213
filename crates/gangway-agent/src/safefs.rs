//! File operations the agent does as root on paths a user can influence,
//! done relative to directory descriptors and never through a link.
//!
//! A walk starts from a trusted base (the checkpoint root, the state
//! directory: the admin's paths, opened as given) and opens one component at
//! a time with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_MAGICLINKS)` (or, on kernels without it, `openat(O_NOFOLLOW |
//! O_DIRECTORY)`). Every directory above a job's own one must be a real
//! directory owned by root (the agent's uid) and writable by no one else, so
//! nothing in it can have been planted by a user; the job's own directory may
//! be its account's. Files are created with `O_NOFOLLOW | O_CREAT`, read with
//! `O_NONBLOCK | O_NOFOLLOW` after `fstat` (a regular file, the expected
//! owner, small, one link), and trees are removed by `unlinkat` without ever
//! leaving them.

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, Stat};
use std::ffi::OsStr;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};
use std::sync::atomic::{AtomicBool, Ordering};
use thiserror::Error;

/// Why a root-side file operation was not done.
#[derive(Debug, Error)]
pub enum FsError {
    /// The system call failed.
    #[error("{path}: {source}")]
    Io {
        /// What was opened (relative to its base, or the base).
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// What is on disk breaks a rule (a link, another owner, a FIFO...).
    #[error("{path}: refused: {why}")]
    Refused {
        /// What was refused.
        path: String,
        /// The rule it breaks.
        why: String,
    },
}

impl FsError {
    fn io(path: impl std::fmt::Display, e: rustix::io::Errno) -> Self {
        FsError::Io {
            path: path.to_string(),
            source: e.into(),
        }
    }

    fn refused(path: impl std::fmt::Display, why: impl Into<String>) -> Self {
        FsError::Refused {
            path: path.to_string(),
            why: why.into(),
        }
    }

    /// Whether the file or a directory on the way does not exist.
    pub fn not_found(&self) -> bool {
        matches!(self, FsError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

/// Deepest tree [`remove_tree`] descends into; a deeper one is left in place
/// (and said so) rather than removed in part through an unbounded walk.
pub const MAX_REMOVE_DEPTH: usize = 256;

/// The uid that counts as root: the agent's own (root in production; the
/// test runner's in unit tests run unprivileged).
fn root_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Set once `openat2` answered ENOSYS: the per-component fallback is used.
static NO_OPENAT2: AtomicBool = AtomicBool::new(false);

/// A single path component, checked: not empty, not `.` or `..`, no `/`.
fn component(name: &OsStr) -> Result<&OsStr, FsError> {
    let b = name.as_bytes();
    if b.is_empty() || b == b"." || b == b".." || b.contains(&b'/') || b.contains(&0) {
        return Err(FsError::refused(
            name.to_string_lossy(),
            "not a single path component",
        ));
    }
    Ok(name)
}

/// Opens `name` in `dir` without following a link at any point.
fn open_child(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    flags: OFlags,
    mode: Mode,
) -> rustix::io::Result<OwnedFd> {
    let flags = flags | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY;
    if !NO_OPENAT2.load(Ordering::Relaxed) {
        // No mount point either: a user may mount (FUSE) on a directory of
        // theirs, and a filesystem of the user's can stall whoever enters it.
        let resolve = ResolveFlags::BENEATH
            | ResolveFlags::NO_SYMLINKS
            | ResolveFlags::NO_MAGICLINKS
            | ResolveFlags::NO_XDEV;
        match rustix::fs::openat2(dir, name, flags, mode, resolve) {
            Err(rustix::io::Errno::NOSYS) => NO_OPENAT2.store(true, Ordering::Relaxed),
            Err(rustix::io::Errno::AGAIN) => {
                // openat2 asks for a retry when a rename raced the lookup.
                return rustix::fs::openat2(dir, name, flags, mode, resolve);
            }
            other => return other,
        }
    }
    let fd = rustix::fs::openat(dir, name, flags, mode)?;
    // Without openat2, a mount point is told by its device.
    let (here, there) = (rustix::fs::fstat(dir)?, rustix::fs::fstat(&fd)?);
    if here.st_dev != there.st_dev {
        return Err(rustix::io::Errno::XDEV);
    }
    Ok(fd)
}

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NONBLOCK
}

/// Whether a directory's status lets only its owner write in it.
fn writable_by_others(st: &Stat) -> bool {
    st.st_mode & 0o022 != 0
}

/// Opens a trusted base directory (an admin's path, followed as given): it
/// must be a directory owned by root and writable by no one else.
pub fn open_base(path: &Path) -> Result<OwnedFd, FsError> {
    let fd = rustix::fs::open(path, dir_flags() | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| FsError::io(path.display(), e))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| FsError::io(path.display(), e))?;
    if st.st_uid != root_uid() || writable_by_others(&st) {
        return Err(FsError::refused(
            path.display(),
            format!(
                "a base directory must be owned by uid {} and writable by no one else (it is uid {}, mode {:o})",
                root_uid(),
                st.st_uid,
                st.st_mode & 0o7777
            ),
        ));
    }
    Ok(fd)
}

/// What the last directory of a walk must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Last {
    /// Root's, like those above it (created with `mode` when missing).
    Root {
        /// Mode of a created one.
        mode: u32,
    },
    /// A job's own directory: created for and given to `uid:gid` with
    /// `mode` when missing; an existing one must already be `uid`'s (or
    /// root's and empty: a creation cut short). Another uid's is refused.
    Own {
        /// Account.
        uid: u32,
        /// Its group.
        gid: u32,
        /// Mode it is given.
        mode: u32,
    },
    /// Must exist; whoever owns it (reading what a job left there).
    Any,
}

/// The relative path's components, each checked.
fn components(rel: &Path) -> Result<Vec<&OsStr>, FsError> {
    let mut out = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => out.push(component(n)?),
            _ => {
                return Err(FsError::refused(
                    rel.display(),
                    "must be a relative path without `.` or `..`",
                ))
            }
        }
    }
    Ok(out)
}

/// Opens (creating with `create_mode` when given and missing) one directory
/// in `dir` as root's: a real directory owned by root, writable by no one else.
fn root_child(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    shown: &Path,
    create_mode: Option<u32>,
) -> Result<OwnedFd, FsError> {
    let mut created = false;
    let fd = match open_child(dir, name, dir_flags(), Mode::empty()) {
        Err(rustix::io::Errno::NOENT) if create_mode.is_some() => {
            let mode = create_mode.unwrap_or(0o700);
            match rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(mode)) {
                Ok(()) => created = true,
                Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(FsError::io(shown.display(), e)),
            }
            open_child(dir, name, dir_flags(), Mode::empty())
        }
        other => other,
    }
    .map_err(|e| refuse_link(dir, name, shown, e))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| FsError::io(shown.display(), e))?;
    if created {
        // The umask may have narrowed it.
        let mode = create_mode.unwrap_or(0o700);
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode))
            .map_err(|e| FsError::io(shown.display(), e))?;
    } else if st.st_uid != root_uid() || writable_by_others(&st) {
        return Err(FsError::refused(
            shown.display(),
            format!(
                "a directory above a job's own must be root's and writable by no one else (it is uid {}, mode {:o})",
                st.st_uid,
                st.st_mode & 0o7777
            ),
        ));
    }
    Ok(fd)
}

/// Why a no-follow directory open failed: ELOOP and ENOTDIR mean a link or
/// something other than a directory, told apart by a look at it.
fn refuse_link(dir: BorrowedFd<'_>, name: &OsStr, shown: &Path, e: rustix::io::Errno) -> FsError {
    match e {
        rustix::io::Errno::XDEV => {
            FsError::refused(shown.display(), "a mount point (only the base may be one)")
        }
        rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => {
            let kind = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
                .map_or(FileType::Unknown, |st| FileType::from_raw_mode(st.st_mode));
            FsError::refused(
                shown.display(),
                format!("{}, not a directory", kind_name(kind)),
            )
        }
        e => FsError::io(shown.display(), e),
    }
}

/// Whether the directory `fd` has no entry besides `.` and `..`.
fn is_empty_dir(fd: &OwnedFd) -> bool {
    let Ok(d) = rustix::fs::Dir::read_from(fd) else {
        return false;
    };
    for e in d {
        match e {
            Ok(e) if matches!(e.file_name().to_bytes(), b"." | b"..") => {}
            _ => return false,
        }
    }
    true
}

/// Opens the directory `rel` beneath the base `base`, creating what is
/// missing when `create_above` is given (directories above the last with
/// that mode, root's), under the rules of [`Last`] for the last one. Every
/// directory above the last must be root's and writable by no one else.
pub fn open_dir(
    base: BorrowedFd<'_>,
    rel: &Path,
    create_above: Option<u32>,
    last: Last,
) -> Result<OwnedFd, FsError> {
    let parts = components(rel)?;
    let Some((name, above)) = parts.split_last() else {
        return Err(FsError::refused(rel.display(), "an empty path"));
    };
    let mut shown = std::path::PathBuf::new();
    let mut cur: Option<OwnedFd> = None;
    for part in above {
        shown.push(part);
        let dir = cur.as_ref().map_or(base, |f| f.as_fd());
        cur = Some(root_child(dir, part, &shown, create_above)?);
    }
    shown.push(name);
    let dir = cur.as_ref().map_or(base, |f| f.as_fd());
    match last {
        Last::Root { mode } => root_child(dir, name, &shown, create_above.map(|_| mode)),
        Last::Any => open_child(dir, name, dir_flags(), Mode::empty())
            .map_err(|e| refuse_link(dir, name, &shown, e)),
        Last::Own { uid, gid, mode } => own_child(dir, name, &shown, uid, gid, mode),
    }
}

/// Creates (or opens) `name` in `dir` as a directory of `uid:gid` with
/// `mode`: a fresh one is given to the account; an existing one must be the
/// account's already (or root's and empty); a link or another's is refused.
pub fn own_dir(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    uid: u32,
    gid: u32,
    mode: u32,
) -> Result<OwnedFd, FsError> {
    own_child(dir, component(name)?, Path::new(name), uid, gid, mode)
}

fn own_child(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    shown: &Path,
    uid: u32,
    gid: u32,
    mode: u32,
) -> Result<OwnedFd, FsError> {
    let created = match rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(0o700)) {
        Ok(()) => true,
        Err(rustix::io::Errno::EXIST) => false,
        Err(e) => return Err(FsError::io(shown.display(), e)),
    };
    let fd = open_child(dir, name, dir_flags(), Mode::empty())
        .map_err(|e| refuse_link(dir, name, shown, e))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| FsError::io(shown.display(), e))?;
    if !created && st.st_uid != uid && !(st.st_uid == root_uid() && is_empty_dir(&fd)) {
        return Err(FsError::refused(
            shown.display(),
            format!(
                "owned by uid {}, not the job's account (uid {uid})",
                st.st_uid
            ),
        ));
    }
    own(&fd, uid, gid, mode).map_err(|e| FsError::Io {
        path: shown.display().to_string(),
        source: e,
    })?;
    Ok(fd)
}

/// Gives what `fd` is open on to `uid:gid` with `mode`.
pub fn own(fd: &impl AsFd, uid: u32, gid: u32, mode: u32) -> std::io::Result<()> {
    let (u, g) = (
        rustix::fs::Uid::from_raw(uid),
        rustix::fs::Gid::from_raw(gid),
    );
    rustix::fs::fchown(fd, Some(u), Some(g))?;
    rustix::fs::fchmod(fd, Mode::from_raw_mode(mode))?;
    Ok(())
}

/// How [`create_file`] opens a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Create {
    /// A new file; an existing one (of any kind) is refused.
    Fresh,
    /// Appending, created when missing.
    Append,
    /// Emptied, created when missing.
    Truncate,
}

/// Checks that `st` is of a single regular file.
fn plain_file(shown: &Path, st: &Stat) -> Result<(), FsError> {
    let kind = FileType::from_raw_mode(st.st_mode);
    if kind != FileType::RegularFile {
        return Err(FsError::refused(
            shown.display(),
            format!("not a regular file ({})", kind_name(kind)),
        ));
    }
    if st.st_nlink != 1 {
        return Err(FsError::refused(
            shown.display(),
            format!("a file with {} hard links", st.st_nlink),
        ));
    }
    Ok(())
}

fn kind_name(k: FileType) -> &'static str {
    match k {
        FileType::RegularFile => "a regular file",
        FileType::Directory => "a directory",
        FileType::Symlink => "a symbolic link",
        FileType::Fifo => "a FIFO",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Unknown => "of an unknown kind",
    }
}

/// Looks at `name` in `dir` without following or opening it: what is there
/// must be a single regular file (missing is `Ok(None)`). Opening a device
/// or a FIFO can itself have effects, so they are refused before the open.
fn look(dir: BorrowedFd<'_>, name: &OsStr, shown: &Path) -> Result<Option<Stat>, FsError> {
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => plain_file(shown, &st).map(|()| Some(st)),
        Err(rustix::io::Errno::NOENT) => Ok(None),
        Err(e) => Err(FsError::io(shown.display(), e)),
    }
}

/// Creates or opens the file `name` in `dir` for writing with `mode`
/// (`O_NOFOLLOW | O_CREAT`, exclusive for [`Create::Fresh`]); an existing
/// file that is not a single regular file (a link, FIFO, device, hard link)
/// is refused and left as it is.
pub fn create_file(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    mode: u32,
    how: Create,
) -> Result<File, FsError> {
    let name = component(name)?;
    let shown = Path::new(name);
    let mut flags = OFlags::WRONLY | OFlags::CREATE | OFlags::NONBLOCK;
    match how {
        Create::Fresh => flags |= OFlags::EXCL,
        Create::Append => flags |= OFlags::APPEND,
        Create::Truncate => {}
    }
    if how != Create::Fresh {
        look(dir, name, shown)?;
    }
    let fd = open_child(dir, name, flags, Mode::from_raw_mode(mode)).map_err(|e| match e {
        rustix::io::Errno::LOOP => FsError::refused(shown.display(), "a symbolic link"),
        e => FsError::io(shown.display(), e),
    })?;
    let st = rustix::fs::fstat(&fd).map_err(|e| FsError::io(shown.display(), e))?;
    plain_file(shown, &st)?;
    if how == Create::Truncate {
        rustix::fs::ftruncate(&fd, 0).map_err(|e| FsError::io(shown.display(), e))?;
    }
    // Writes to a regular file never wait for a reader: clear O_NONBLOCK anyway.
    let _ = rustix::fs::fcntl_setfl(&fd, flags.intersection(OFlags::APPEND));
    Ok(File::from(fd))
}

/// Reads the small file `name` in `dir`, a user's: opened with `O_NONBLOCK |
/// O_NOFOLLOW | O_NOCTTY` (a FIFO never blocks the open), then `fstat`ed: a
/// regular file owned by one of `owners`, at most `limit` bytes, with one
/// link. Returns its bytes and status.
pub fn read_small(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    owners: &[u32],
    limit: u64,
) -> Result<(Vec<u8>, Stat), FsError> {
    let name = component(name)?;
    let shown = Path::new(name);
    if look(dir, name, shown)?.is_none() {
        return Err(FsError::io(shown.display(), rustix::io::Errno::NOENT));
    }
    let fd = open_child(dir, name, OFlags::RDONLY | OFlags::NONBLOCK, Mode::empty()).map_err(
        |e| match e {
            rustix::io::Errno::LOOP => FsError::refused(shown.display(), "a symbolic link"),
            e => FsError::io(shown.display(), e),
        },
    )?;
    let st = rustix::fs::fstat(&fd).map_err(|e| FsError::io(shown.display(), e))?;
    plain_file(shown, &st)?;
    if !owners.contains(&st.st_uid) {
        return Err(FsError::refused(
            shown.display(),
            format!("owned by uid {}, not the job's account", st.st_uid),
        ));
    }
    let size = u64::try_from(st.st_size).unwrap_or(u64::MAX);
    if size > limit {
        return Err(FsError::refused(
            shown.display(),
            format!("{size} bytes, more than {limit}"),
        ));
    }
    let mut bytes = Vec::new();
    File::from(fd)
        .take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| FsError::Io {
            path: shown.display().to_string(),
            source: e,
        })?;
    if bytes.len() as u64 > limit {
        return Err(FsError::refused(
            shown.display(),
            format!("grew past {limit} bytes while read"),
        ));
    }
    Ok((bytes, st))
}

/// Removes `name` in `dir` and, if it is a directory, everything in it,
/// without ever leaving it: each level is opened with `O_NOFOLLOW |
/// O_DIRECTORY`, links are removed and never followed. Missing is fine. A
/// tree deeper than [`MAX_REMOVE_DEPTH`] fails (what is left stays).
pub fn remove_tree(dir: BorrowedFd<'_>, name: &OsStr) -> Result<(), FsError> {
    let name = component(name)?;
    remove_entry(dir, name, Path::new(name), 0)
}

fn remove_entry(
    dir: BorrowedFd<'_>,
    name: &OsStr,
    shown: &Path,
    depth: usize,
) -> Result<(), FsError> {
    let st = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(e) => return Err(FsError::io(shown.display(), e)),
    };
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
        return match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
            Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
            Err(e) => Err(FsError::io(shown.display(), e)),
        };
    }
    if depth >= MAX_REMOVE_DEPTH {
        return Err(FsError::refused(
            shown.display(),
            format!("deeper than {MAX_REMOVE_DEPTH} levels; left in place"),
        ));
    }
    let fd = match open_child(dir, name, dir_flags(), Mode::empty()) {
        Ok(fd) => fd,
        // Replaced since the look: a link or file is removed, not followed.
        Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR) => {
            return remove_entry(dir, name, shown, depth)
        }
        Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(e) => return Err(FsError::io(shown.display(), e)),
    };
    // Entries are listed, then removed, until none is left (a listing that
    // changes under its reader may skip some).
    loop {
        let names = list(&fd).map_err(|e| match e {
            FsError::Io { source, .. } => FsError::Io {
                path: shown.display().to_string(),
                source,
            },
            e => e,
        })?;
        if names.is_empty() {
            break;
        }
        for n in names {
            remove_entry(fd.as_fd(), &n, &shown.join(&n), depth + 1)?;
        }
    }
    match rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(e) => Err(FsError::io(shown.display(), e)),
    }
}

/// The names in the directory `fd` (without `.` and `..`).
pub fn list(fd: &OwnedFd) -> Result<Vec<std::ffi::OsString>, FsError> {
    let d = rustix::fs::Dir::read_from(fd).map_err(|e| FsError::io(".", e))?;
    let mut out = Vec::new();
    for e in d {
        let e = e.map_err(|e| FsError::io(".", e))?;
        let n = e.file_name().to_bytes();
        if n != b"." && n != b".." {
            out.push(std::ffi::OsString::from(OsStr::from_bytes(n)));
        }
    }
    Ok(out)
}

/// Splits `path` into its parent (relative to `base`, possibly empty) and
/// last component, when it lies under `base`.
pub fn split_under<'a>(base: &Path, path: &'a Path) -> Option<(&'a Path, &'a OsStr)> {
    let rel = path.strip_prefix(base).ok()?;
    let name = rel.file_name()?;
    Some((rel.parent().unwrap_or(Path::new("")), name))
}

/// Opens the parent `parent` (relative to `base`; empty: the base itself) as
/// root's, creating it with `mode` when `create` is set.
pub fn open_parent(base: &OwnedFd, parent: &Path, create: Option<u32>) -> Result<OwnedFd, FsError> {
    if parent.as_os_str().is_empty() {
        return base.try_clone().map_err(|e| FsError::Io {
            path: ".".into(),
            source: e,
        });
    }
    open_dir(
        base.as_fd(),
        parent,
        create,
        Last::Root {
            mode: create.unwrap_or(0o711),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::process::Command;

    fn is_root() -> bool {
        root_uid() == 0
    }

    /// A base directory (mode 0755) holding a root-owned decoy directory
    /// with a file, for planted links to aim at.
    struct Fixture {
        dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Fixture {
            let dir = tempfile::tempdir().expect("tmp");
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
                .expect("chmod");
            for d in ["base", "decoy"] {
                std::fs::create_dir(dir.path().join(d)).expect("dir");
                std::fs::set_permissions(
                    dir.path().join(d),
                    std::fs::Permissions::from_mode(0o755),
                )
                .expect("chmod");
            }
            std::fs::write(dir.path().join("decoy/secret"), "root only\n").expect("secret");
            std::fs::set_permissions(
                dir.path().join("decoy/secret"),
                std::fs::Permissions::from_mode(0o600),
            )
            .expect("chmod");
            Fixture { dir }
        }
        fn base(&self) -> std::path::PathBuf {
            self.dir.path().join("base")
        }
        fn decoy(&self) -> std::path::PathBuf {
            self.dir.path().join("decoy")
        }
        fn fd(&self) -> OwnedFd {
            open_base(&self.base()).expect("base")
        }
        /// The decoy's entries with their mode, owner and contents.
        fn decoy_state(&self) -> Vec<(String, u32, u32, Vec<u8>)> {
            let mut v = vec![];
            let m = std::fs::metadata(self.decoy()).expect("decoy");
            v.push((".".into(), m.mode(), m.uid(), vec![]));
            let mut names: Vec<_> = std::fs::read_dir(self.decoy())
                .expect("ls")
                .flatten()
                .map(|e| e.file_name())
                .collect();
            names.sort();
            for n in names {
                let p = self.decoy().join(&n);
                let m = std::fs::symlink_metadata(&p).expect("meta");
                v.push((
                    n.to_string_lossy().into(),
                    m.mode(),
                    m.uid(),
                    std::fs::read(&p).unwrap_or_default(),
                ));
            }
            v
        }
    }

    const UID: u32 = 4242;

    fn mkfifo(p: &Path) {
        rustix::fs::mknodat(
            rustix::fs::CWD,
            p,
            FileType::Fifo,
            Mode::from_raw_mode(0o666),
            0,
        )
        .expect("mkfifo");
    }

    fn mknull(p: &Path) {
        // /dev/null's numbers (1, 3): a character device made in the tempdir.
        rustix::fs::mknodat(
            rustix::fs::CWD,
            p,
            FileType::CharacterDevice,
            Mode::from_raw_mode(0o666),
            rustix::fs::makedev(1, 3),
        )
        .expect("mknod");
    }

    #[test]
    fn a_walk_refuses_final_and_intermediate_links_and_user_directories_above() {
        let f = Fixture::new();
        let before = f.decoy_state();
        let base = f.fd();
        // A job's directory is made under root's levels and given to its account.
        let own = Last::Own {
            uid: UID,
            gid: UID,
            mode: 0o700,
        };
        if is_root() {
            open_dir(base.as_fd(), Path::new("alice/job-1"), Some(0o711), own).expect("job dir");
            let m = std::fs::metadata(f.base().join("alice")).expect("user dir");
            assert_eq!((m.uid(), m.mode() & 0o7777), (0, 0o711));
            let m = std::fs::metadata(f.base().join("alice/job-1")).expect("job dir");
            assert_eq!((m.uid(), m.mode() & 0o7777), (UID, 0o700));
            // The job leaves links in its own directory...
            std::os::unix::fs::symlink(f.decoy(), f.base().join("alice/job-1/link")).expect("ln");
            std::os::unix::fs::symlink(f.decoy(), f.base().join("alice/job-1/link2")).expect("ln");
            // ... which another job then names, finally or on the way.
            for rel in ["alice/job-1/link", "alice/job-1/link2/sub"] {
                let e = open_dir(base.as_fd(), Path::new(rel), Some(0o711), own).expect_err(rel);
                assert!(matches!(e, FsError::Refused { .. }), "{rel}: {e}");
            }
            // A real directory the account made inside its own is refused as
            // a level above another job's directory.
            std::fs::create_dir(f.base().join("alice/job-1/sub")).expect("mkdir");
            std::os::unix::fs::chown(f.base().join("alice/job-1/sub"), Some(UID), Some(UID))
                .expect("chown");
            let e = open_dir(
                base.as_fd(),
                Path::new("alice/job-1/sub/x"),
                Some(0o711),
                own,
            )
            .expect_err("a user's directory above");
            assert!(e.to_string().contains("root's"), "{e}");
            // Another account's directory is not given to this one.
            std::fs::create_dir(f.base().join("alice/bob")).expect("mkdir");
            std::os::unix::fs::chown(f.base().join("alice/bob"), Some(UID + 1), None)
                .expect("chown");
            let e = open_dir(base.as_fd(), Path::new("alice/bob"), Some(0o711), own)
                .expect_err("another uid");
            assert!(e.to_string().contains("not the job's account"), "{e}");
            // A group-writable root directory above is refused.
            std::fs::set_permissions(
                f.base().join("alice"),
                std::fs::Permissions::from_mode(0o775),
            )
            .expect("chmod");
            let e = open_dir(base.as_fd(), Path::new("alice/job-1"), None, own)
                .expect_err("writable above");
            assert!(e.to_string().contains("writable"), "{e}");
        }
        // A link right under the base, final or on the way.
        std::os::unix::fs::symlink(f.decoy(), f.base().join("top")).expect("ln");
        for rel in ["top", "top/x"] {
            let e = open_dir(
                base.as_fd(),
                Path::new(rel),
                Some(0o711),
                Last::Root { mode: 0o711 },
            )
            .expect_err(rel);
            assert!(e.to_string().contains("symbolic link"), "{rel}: {e}");
        }
        // `..`, absolute paths and empty ones never walk.
        for rel in ["../decoy", "/etc", "", "a/./b"] {
            assert!(
                open_dir(base.as_fd(), Path::new(rel), Some(0o711), Last::Any).is_err(),
                "{rel}"
            );
        }
        assert_eq!(f.decoy_state(), before, "the decoy is untouched");
        assert!(!f.decoy().join("x").exists() && !f.decoy().join("sub").exists());
    }

    /// The walk's refusals hold with and without openat2 (the fallback is
    /// forced here for this test's calls; other tests meanwhile use it too,
    /// which is as correct).
    #[test]
    fn the_per_component_fallback_refuses_links_and_mount_points_too() {
        let f = Fixture::new();
        let before = f.decoy_state();
        let base = f.fd();
        std::os::unix::fs::symlink(f.decoy(), f.base().join("top")).expect("ln");
        let mnt = f.base().join("mnt");
        std::fs::create_dir(&mnt).expect("mnt");
        let mounted = is_root()
            && Command::new("mount")
                .args(["-t", "tmpfs", "none"])
                .arg(&mnt)
                .status()
                .is_ok_and(|s| s.success());
        for fallback in [false, true] {
            NO_OPENAT2.store(fallback, Ordering::Relaxed);
            for rel in ["top", "top/x"] {
                let e = open_dir(
                    base.as_fd(),
                    Path::new(rel),
                    Some(0o711),
                    Last::Root { mode: 0o711 },
                )
                .expect_err(rel);
                assert!(
                    e.to_string().contains("symbolic link"),
                    "{fallback} {rel}: {e}"
                );
            }
            if mounted {
                for rel in ["mnt", "mnt/x"] {
                    let e = open_dir(
                        base.as_fd(),
                        Path::new(rel),
                        Some(0o711),
                        Last::Root { mode: 0o711 },
                    )
                    .expect_err(rel);
                    assert!(
                        e.to_string().contains("mount point"),
                        "{fallback} {rel}: {e}"
                    );
                }
            }
        }
        NO_OPENAT2.store(false, Ordering::Relaxed);
        if mounted {
            let _ = Command::new("umount").arg(&mnt).status();
        }
        assert_eq!(f.decoy_state(), before);
    }

    #[test]
    fn a_base_writable_by_others_is_refused() {
        let f = Fixture::new();
        std::fs::set_permissions(f.base(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
        assert!(matches!(open_base(&f.base()), Err(FsError::Refused { .. })));
    }

    #[test]
    fn own_dir_refuses_a_planted_link_fifo_or_file_and_owns_a_fresh_one() {
        if !is_root() {
            return;
        }
        let f = Fixture::new();
        let before = f.decoy_state();
        let base = f.fd();
        std::os::unix::fs::symlink(f.decoy(), f.base().join(".home")).expect("ln");
        mkfifo(&f.base().join("fifo"));
        mknull(&f.base().join("dev"));
        std::fs::write(f.base().join("file"), "x").expect("file");
        for n in [".home", "fifo", "dev", "file"] {
            let e = own_dir(base.as_fd(), OsStr::new(n), UID, UID, 0o700).expect_err(n);
            assert!(matches!(e, FsError::Refused { .. }), "{n}: {e}");
        }
        assert_eq!(f.decoy_state(), before);
        let fd = own_dir(base.as_fd(), OsStr::new("fresh"), UID, UID, 0o700).expect("fresh");
        let st = rustix::fs::fstat(&fd).expect("stat");
        assert_eq!((st.st_uid, st.st_mode & 0o7777), (UID, 0o700));
        // Again: it is the account's already.
        own_dir(base.as_fd(), OsStr::new("fresh"), UID, UID, 0o700).expect("again");
    }

    #[test]
    fn create_file_refuses_links_fifos_devices_and_hard_links() {
        let f = Fixture::new();
        let before = f.decoy_state();
        let base = f.fd();
        std::os::unix::fs::symlink(f.decoy().join("secret"), f.base().join("link")).expect("ln");
        mkfifo(&f.base().join("fifo"));
        let mut names = vec!["link", "fifo"];
        if is_root() {
            mknull(&f.base().join("dev"));
            names.push("dev");
        }
        // A hard link to a file outside (same filesystem: the tempdir).
        std::fs::write(f.dir.path().join("outside"), "keep\n").expect("outside");
        std::fs::hard_link(f.dir.path().join("outside"), f.base().join("hard")).expect("link");
        names.push("hard");
        for how in [Create::Append, Create::Truncate, Create::Fresh] {
            for n in &names {
                let e = create_file(base.as_fd(), OsStr::new(n), 0o600, how)
                    .expect_err(&format!("{n} {how:?}"));
                let _ = e;
            }
        }
        assert_eq!(
            std::fs::read(f.dir.path().join("outside")).expect("o"),
            b"keep\n"
        );
        assert_eq!(f.decoy_state(), before);
        use std::io::Write;
        let mut w =
            create_file(base.as_fd(), OsStr::new("log"), 0o600, Create::Fresh).expect("new");
        w.write_all(b"a").expect("write");
        assert!(create_file(base.as_fd(), OsStr::new("log"), 0o600, Create::Fresh).is_err());
        let mut w =
            create_file(base.as_fd(), OsStr::new("log"), 0o600, Create::Append).expect("ap");
        w.write_all(b"b").expect("write");
        assert_eq!(std::fs::read(f.base().join("log")).expect("log"), b"ab");
        let m = std::fs::metadata(f.base().join("log")).expect("meta");
        assert_eq!(m.mode() & 0o777, 0o600);
    }

    #[test]
    fn read_small_refuses_links_fifos_devices_hard_links_other_owners_and_big_files() {
        let f = Fixture::new();
        let base = f.fd();
        let me = root_uid();
        std::fs::write(f.base().join("ok"), "{}").expect("ok");
        let (b, _) = read_small(base.as_fd(), OsStr::new("ok"), &[me], 100).expect("read");
        assert_eq!(b, b"{}");
        std::os::unix::fs::symlink(f.decoy().join("secret"), f.base().join("link")).expect("ln");
        mkfifo(&f.base().join("fifo"));
        std::fs::write(f.dir.path().join("outside"), "x").expect("outside");
        std::fs::hard_link(f.dir.path().join("outside"), f.base().join("hard")).expect("link");
        std::fs::write(f.base().join("big"), vec![b'x'; 101]).expect("big");
        let mut names = vec!["link", "fifo", "hard", "big"];
        if is_root() {
            mknull(&f.base().join("dev"));
            names.push("dev");
        }
        let started = std::time::Instant::now();
        for n in &names {
            let e = read_small(base.as_fd(), OsStr::new(n), &[me], 100).expect_err(n);
            assert!(matches!(e, FsError::Refused { .. }), "{n}: {e}");
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "a FIFO never blocks"
        );
        // Another owner's file.
        let e = read_small(base.as_fd(), OsStr::new("ok"), &[me + 1], 100).expect_err("owner");
        assert!(e.to_string().contains("owned by"), "{e}");
        assert!(read_small(base.as_fd(), OsStr::new("none"), &[me], 100)
            .expect_err("missing")
            .not_found());
    }

    #[test]
    fn remove_tree_never_leaves_the_tree() {
        let f = Fixture::new();
        let before = f.decoy_state();
        let base = f.fd();
        let t = f.base().join("job");
        std::fs::create_dir_all(t.join("a/b/c")).expect("dirs");
        std::fs::write(t.join("a/b/c/f"), "x").expect("f");
        std::os::unix::fs::symlink(f.decoy(), t.join("link")).expect("ln");
        std::os::unix::fs::symlink(f.decoy(), t.join("a/link2")).expect("ln");
        std::fs::write(f.dir.path().join("outside"), "keep").expect("o");
        std::fs::hard_link(f.dir.path().join("outside"), t.join("hard")).expect("hard");
        mkfifo(&t.join("fifo"));
        if is_root() {
            mknull(&t.join("dev"));
        }
        remove_tree(base.as_fd(), OsStr::new("job")).expect("removed");
        assert!(!t.exists());
        assert_eq!(f.decoy_state(), before, "nothing removed through the links");
        assert_eq!(
            std::fs::read(f.dir.path().join("outside")).expect("o"),
            b"keep"
        );
        // A final link is removed itself, never followed.
        std::os::unix::fs::symlink(f.decoy(), f.base().join("job")).expect("ln");
        remove_tree(base.as_fd(), OsStr::new("job")).expect("link removed");
        assert!(std::fs::symlink_metadata(f.base().join("job")).is_err());
        assert_eq!(f.decoy_state(), before);
        remove_tree(base.as_fd(), OsStr::new("job")).expect("missing is fine");
        // Too deep: refused, the tree stays.
        let mut deep = f.base().join("deep");
        for _ in 0..=MAX_REMOVE_DEPTH {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).expect("deep");
        let e = remove_tree(base.as_fd(), OsStr::new("deep")).expect_err("too deep");
        assert!(e.to_string().contains("deeper than"), "{e}");
        assert!(f.base().join("deep").exists());
    }
}
