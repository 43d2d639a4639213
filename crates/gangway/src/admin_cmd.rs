//! `gangway admin backup|restore`: whole-store backups, online through the
//! API (admin token) or offline on a stopped server's data dir.

use crate::client::Conn;
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use gangway_server::backup;
use std::path::{Path, PathBuf};

/// `gangway admin` subcommands.
#[derive(Subcommand)]
pub enum AdminCmd {
    /// Writes the whole store to FILE (mode 0600): through the API (admin
    /// token), or with --data-dir from a stopped server's embedded store.
    Backup {
        /// Where to write the backup (must not exist).
        file: PathBuf,
        /// Offline: the data dir of a stopped server.
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
    /// Restores FILE into a fresh data dir (a stopped server's; the store
    /// must be empty). Start the server on it afterwards: agents re-register
    /// with their node tokens and their running jobs are re-adopted.
    Restore {
        /// The backup.
        file: PathBuf,
        /// The data dir to restore into.
        #[arg(long)]
        data_dir: PathBuf,
    },
}

fn open_store(dir: &Path) -> Result<gangway_store::RedbStore> {
    gangway_server::private_dir(dir)?;
    let path = dir.join("gangway.redb");
    let store = gangway_store::RedbStore::open(&path)
        .with_context(|| format!("opening {} (is a server running on it?)", path.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(store)
}

/// Runs a `gangway admin` subcommand.
pub fn run(c: &Conn, cmd: AdminCmd) -> Result<()> {
    match cmd {
        AdminCmd::Backup { file, data_dir } => {
            if file.exists() {
                bail!("{} exists; choose a new file", file.display());
            }
            let b = match data_dir {
                Some(dir) => {
                    if !dir.join("gangway.redb").exists() {
                        bail!("{}: no store here", dir.display());
                    }
                    let store = open_store(&dir)?;
                    backup::take(&store, gangway_server::clock::now())?
                }
                None => {
                    let v = c.post("/v1/admin/backup", "application/json", "")?;
                    serde_json::from_value(v).context("the server's backup")?
                }
            };
            backup::write_file(&file, &b)?;
            println!(
                "backup of {} keys (schema {}, revision {}) written to {}",
                b.entries.len(),
                b.schema,
                b.revision,
                file.display()
            );
            Ok(())
        }
        AdminCmd::Restore { file, data_dir } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let b = backup::parse(&text)?;
            let store = open_store(&data_dir)?;
            let n = backup::restore(&store, &b)?;
            println!(
                "restored {n} keys (schema {}, taken at revision {}) into {}",
                b.schema,
                b.revision,
                data_dir.display()
            );
            Ok(())
        }
    }
}
