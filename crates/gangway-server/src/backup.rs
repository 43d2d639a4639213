//! Rollback paths for Gangway itself: the store's schema version, forward
//! migrations taken only after a backup, and whole-store backup and restore.
//!
//! `/meta/schema` holds the layout version of the store. A server whose
//! [`SCHEMA_VERSION`] is newer migrates an older store forward, but only
//! after writing a backup of it (`<data-dir>/backups/`); a server that is
//! older refuses a newer store, naming both versions, so a downgrade never
//! reads data it does not understand. The way back from a bad upgrade is to
//! run the old binary on the backup taken before the migration
//! (`gangway admin restore`).

use crate::control::ControlError;
use gangway_store::{Compare, Op, Store, StoreError};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Key of the store's schema version.
pub const SCHEMA_KEY: &str = "/meta/schema";

/// The layout this server reads and writes. 0 is a store from before schema
/// versions (the same layout as 1); 1 adds `/meta/schema` and `/policy/`.
pub const SCHEMA_VERSION: u64 = 1;

/// The `format` field of a backup file.
pub const BACKUP_FORMAT: &str = "gangway-backup";

/// Keys written per transaction on restore (within etcd's default of 128
/// operations per transaction).
const RESTORE_CHUNK: usize = 100;

/// Why the store cannot be used, backed up or restored.
#[derive(Debug, Error)]
pub enum BackupError {
    /// The store is newer than this server.
    #[error("the store has schema version {found}, newer than this server's {supported}: it was written by a newer Gangway. Run that version, or restore the backup taken before the upgrade into a fresh data dir (gangway admin restore)")]
    Newer {
        /// In the store.
        found: u64,
        /// This server's.
        supported: u64,
    },
    /// A migration needs a place for its backup.
    #[error("the store has schema version {found} and this server migrates it to {to}, which needs a backup first: give the server a --data-dir to write it to")]
    NoBackupDir {
        /// In the store.
        found: u64,
        /// Target.
        to: u64,
    },
    /// Restoring into a store that holds data.
    #[error("restore: the target store is not empty ({0} keys); restore into a fresh data dir")]
    NotEmpty(usize),
    /// Not a backup, or a damaged one.
    #[error("backup file: {0}")]
    BadFile(String),
    /// Store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Files.
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
}

impl From<BackupError> for ControlError {
    fn from(e: BackupError) -> Self {
        match e {
            BackupError::Store(s) => ControlError::Store(s),
            other => ControlError::Conflict(other.to_string()),
        }
    }
}

/// One key and its value: UTF-8 text, else hex.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Key.
    pub key: String,
    /// Value, when it is UTF-8 (every value the server writes is JSON).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// Value in hex otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hex: Option<String>,
}

impl Entry {
    fn of(key: String, bytes: Vec<u8>) -> Self {
        match String::from_utf8(bytes) {
            Ok(s) => Entry {
                key,
                value: Some(s),
                hex: None,
            },
            Err(e) => Entry {
                key,
                value: None,
                hex: Some(e.as_bytes().iter().map(|b| format!("{b:02x}")).collect()),
            },
        }
    }

    fn bytes(&self) -> Result<Vec<u8>, BackupError> {
        match (&self.value, &self.hex) {
            (Some(v), None) => Ok(v.clone().into_bytes()),
            (None, Some(h)) if h.len() % 2 == 0 => (0..h.len())
                .step_by(2)
                .map(|i| {
                    u8::from_str_radix(h.get(i..i + 2).unwrap_or("zz"), 16).map_err(|_| {
                        BackupError::BadFile(format!("{}: hex value is malformed", self.key))
                    })
                })
                .collect(),
            _ => Err(BackupError::BadFile(format!(
                "{}: needs exactly one of value and hex",
                self.key
            ))),
        }
    }
}

/// A whole-store backup.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backup {
    /// Always [`BACKUP_FORMAT`].
    pub format: String,
    /// The store's schema version when it was taken.
    pub schema: u64,
    /// When (seconds since the epoch).
    pub taken_at: u64,
    /// The store's revision then.
    pub revision: u64,
    /// Every key, in key order.
    pub entries: Vec<Entry>,
}

/// The store's schema version (0: from before schema versions, or empty).
pub fn schema_of<S: Store + ?Sized>(store: &S) -> Result<u64, BackupError> {
    match store.get(SCHEMA_KEY)? {
        None => Ok(0),
        Some(kv) => std::str::from_utf8(&kv.value)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| BackupError::BadFile(format!("{SCHEMA_KEY} is not a number"))),
    }
}

/// Every key of the store, read at one revision.
pub fn take<S: Store + ?Sized>(store: &S, now: u64) -> Result<Backup, BackupError> {
    let revision = store.revision()?;
    let entries = store
        .range("/")?
        .into_iter()
        .map(|kv| Entry::of(kv.key, kv.value))
        .collect();
    Ok(Backup {
        format: BACKUP_FORMAT.into(),
        schema: schema_of(store)?,
        taken_at: now,
        revision,
        entries,
    })
}

/// Parses a backup file's text.
pub fn parse(text: &str) -> Result<Backup, BackupError> {
    let b: Backup = serde_json::from_str(text).map_err(|e| BackupError::BadFile(e.to_string()))?;
    if b.format != BACKUP_FORMAT {
        return Err(BackupError::BadFile(format!(
            "format is {:?}, not {BACKUP_FORMAT:?}",
            b.format
        )));
    }
    Ok(b)
}

/// Writes `b` into an empty store (a fresh data dir or etcd prefix). A
/// backup newer than this server is refused; an older one is restored as it
/// is and migrated, after a backup, when a server starts on it.
pub fn restore<S: Store + ?Sized>(store: &S, b: &Backup) -> Result<usize, BackupError> {
    if b.schema > SCHEMA_VERSION {
        return Err(BackupError::Newer {
            found: b.schema,
            supported: SCHEMA_VERSION,
        });
    }
    let existing = store.range("/")?.len();
    if existing > 0 {
        return Err(BackupError::NotEmpty(existing));
    }
    for e in &b.entries {
        if !e.key.starts_with('/') || e.key.len() > 4096 {
            return Err(BackupError::BadFile(format!(
                "key {:?} is not a store key",
                e.key
            )));
        }
    }
    for chunk in b.entries.chunks(RESTORE_CHUNK) {
        let ops = chunk
            .iter()
            .map(|e| Ok(Op::Put(e.key.clone(), e.bytes()?)))
            .collect::<Result<Vec<_>, BackupError>>()?;
        let cmps: Vec<Compare> = chunk
            .iter()
            .map(|e| Compare::Absent(e.key.clone()))
            .collect();
        if !store.txn(&cmps, &ops)?.succeeded {
            return Err(BackupError::NotEmpty(1));
        }
    }
    Ok(b.entries.len())
}

/// Writes `b` to `path` (mode 0600: it holds token digests and job specs).
pub fn write_file(path: &Path, b: &Backup) -> Result<(), BackupError> {
    let io = |e| BackupError::Io(path.display().to_string(), e);
    let text = serde_json::to_string(b).map_err(|e| BackupError::BadFile(e.to_string()))?;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    use std::io::Write;
    let mut f = o.open(path).map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)
}

/// At start: refuses a newer store; migrates an older one forward after
/// writing a backup into `backup_dir` (returned); marks a new store.
pub fn prepare<S: Store + ?Sized>(
    store: &S,
    backup_dir: Option<&Path>,
    now: u64,
) -> Result<Option<PathBuf>, BackupError> {
    let found = schema_of(store)?;
    if found == SCHEMA_VERSION {
        return Ok(None);
    }
    if found > SCHEMA_VERSION {
        return Err(BackupError::Newer {
            found,
            supported: SCHEMA_VERSION,
        });
    }
    let empty = store.range("/")?.is_empty();
    let mut written = None;
    if !empty {
        let Some(dir) = backup_dir else {
            return Err(BackupError::NoBackupDir {
                found,
                to: SCHEMA_VERSION,
            });
        };
        let dir = dir.join("backups");
        crate::private_dir(&dir).map_err(|e| BackupError::Io(dir.display().to_string(), e))?;
        let path = dir.join(format!(
            "before-schema-{found}-to-{SCHEMA_VERSION}-{now}.json"
        ));
        write_file(&path, &take(store, now)?)?;
        tracing::warn!(
            "store schema {found} -> {SCHEMA_VERSION}: backup of the old store in {}",
            path.display()
        );
        written = Some(path);
    }
    // Migrations, one step at a time (0 -> 1 changes no existing key).
    store.put(SCHEMA_KEY, SCHEMA_VERSION.to_string().as_bytes())?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_store::RedbStore;

    #[test]
    fn an_old_store_is_backed_up_before_migration_and_a_newer_one_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        // A fresh store is marked, nothing backed up.
        assert_eq!(prepare(&store, None, 1).expect("fresh"), None);
        assert_eq!(schema_of(&store).expect("schema"), SCHEMA_VERSION);
        // A store from before schema versions: backup first, then migrated.
        store.delete(SCHEMA_KEY).expect("delete");
        store.put("/jobs/1", b"{\"id\":1}").expect("put");
        store.put("/raw", &[0xff, 0x00]).expect("put");
        let e = prepare(&store, None, 2).expect_err("no backup dir");
        assert!(e.to_string().contains("needs a backup first"), "{e}");
        assert_eq!(schema_of(&store).expect("schema"), 0, "nothing migrated");
        let path = prepare(&store, Some(dir.path()), 3)
            .expect("migrated")
            .expect("backup written");
        let b = parse(&std::fs::read_to_string(&path).expect("read")).expect("parse");
        assert_eq!(b.schema, 0);
        assert_eq!(b.entries.len(), 2);
        assert_eq!(schema_of(&store).expect("schema"), SCHEMA_VERSION);
        // A newer store is refused with both versions named.
        store.put(SCHEMA_KEY, b"7").expect("put");
        let e = prepare(&store, Some(dir.path()), 4).expect_err("newer");
        assert!(
            e.to_string()
                .contains("schema version 7, newer than this server's 1"),
            "{e}"
        );
        // The backup restores byte for byte into a fresh store, not into a used one.
        let fresh = RedbStore::open(&dir.path().join("t.redb")).expect("store");
        assert_eq!(restore(&fresh, &b).expect("restore"), 2);
        assert_eq!(
            fresh.get("/raw").expect("get").expect("raw").value,
            vec![0xff, 0]
        );
        assert!(matches!(restore(&fresh, &b), Err(BackupError::NotEmpty(2))));
        let mut newer = b.clone();
        newer.schema = 9;
        let other = RedbStore::open(&dir.path().join("u.redb")).expect("store");
        assert!(matches!(
            restore(&other, &newer),
            Err(BackupError::Newer { .. })
        ));
        assert!(parse(
            "{\"format\":\"zip\",\"schema\":1,\"taken_at\":0,\"revision\":0,\"entries\":[]}"
        )
        .is_err());
    }
}
