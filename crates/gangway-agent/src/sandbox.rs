//! What a rank gets from its node, and nothing more: its Unix account
//! ([`crate::identity`]), a clean environment (the job's env, without loader
//! variables where its queue allows root ranks, Gangway's contract
//! variables, and a documented minimal base: `PATH`, `HOME` (the account's,
//! or the job's own), `TMPDIR` (the attempt's own), `USER`, `LOGNAME`,
//! `LANG`, plus the agent variables an admin passes with `--pass-env`), its
//! own log file and checkpoint directory, and for containers the checked mounts
//! ([`crate::mounts`]) and a hardened Docker host configuration.

use crate::checkpoint::CkptDir;
use crate::config::AgentConfig;
use crate::identity::{Account, IdentityError};
use crate::mounts::MountError;
use bollard::models::HostConfig;
use gangway_core::agent::Assignment;
use gangway_core::node_policy::{clean_path, is_loader_var, PolicyError};
use gangway_core::Mount;
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use thiserror::Error;

/// `PATH` of a rank unless the admin passes the agent's own (`--pass-env PATH`).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Most processes a container rank may have (fork bombs stop there).
pub const CONTAINER_PIDS_LIMIT: i64 = 32_768;

/// Why a job's ranks may not start on this node.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum SandboxError {
    /// Its account.
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// Its mounts.
    #[error(transparent)]
    Mount(#[from] MountError),
    /// Its run spec.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// Its per-job `HOME` or `TMPDIR` could not be made.
    #[error("cannot prepare the job's HOME and TMPDIR for Unix account {account:?}: {msg}")]
    JobDirs {
        /// Account.
        account: String,
        /// Why.
        msg: String,
    },
    /// Its account and mounts could not be checked in time (a name service
    /// or a mount source's filesystem that does not answer).
    #[error("cannot check the job's account and mounts: {0}")]
    Unchecked(String),
}

/// Everything a rank of one job needs from the node's security rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankSandbox {
    /// The account the rank runs as.
    pub account: Account,
    /// The minimal base environment (under the job's and Gangway's variables).
    pub base_env: BTreeMap<String, String>,
    /// Whether the job's loader variables are kept.
    pub loader_env: bool,
    /// Containers share the host's network.
    pub host_network: bool,
    /// Containers get a read-only root filesystem.
    pub read_only_rootfs: bool,
    /// Container mounts, sources resolved.
    pub mounts: Vec<Mount>,
}

/// Resolves the account and checks the job's run spec on this node.
pub fn prepare(cfg: &AgentConfig, a: &Assignment) -> Result<RankSandbox, SandboxError> {
    let rules = &a.rules;
    let name = rules.run_as.clone().unwrap_or_else(|| a.user.clone());
    let account = crate::identity::resolve(&name, &cfg.node)?;
    crate::identity::check(&account, rules.policy.allow_root, &rules.queue, &cfg.node)?;
    if let Some(w) = &a.run.workdir {
        if clean_path(w).is_none() {
            return Err(PolicyError::Workdir(w.clone()).into());
        }
    }
    let mounts = if a.run.image.is_some() {
        crate::mounts::resolve(
            &a.run.mounts,
            &rules.policy,
            &rules.queue,
            &[&cfg.state_dir, &cfg.checkpoint_root],
            &cfg.node,
        )?
    } else {
        Vec::new()
    };
    Ok(RankSandbox {
        base_env: base_env(&account, &cfg.pass_env),
        account,
        loader_env: rules.policy.loader_env_allowed(),
        host_network: rules.policy.host_network,
        read_only_rootfs: rules.policy.read_only_rootfs,
        mounts,
    })
}

/// The base every process rank starts from: `PATH`, `HOME`, `USER`,
/// `LOGNAME`, `LANG`, then the agent's own values of the `pass_env` names.
pub fn base_env(account: &Account, pass_env: &[String]) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("PATH".into(), DEFAULT_PATH.into());
    env.insert("HOME".into(), account.home.display().to_string());
    env.insert("USER".into(), account.name.clone());
    env.insert("LOGNAME".into(), account.name.clone());
    env.insert("LANG".into(), "C.UTF-8".into());
    for name in pass_env {
        if let Ok(v) = std::env::var(name) {
            env.insert(name.clone(), v);
        }
    }
    env
}

/// The job's and Gangway's variables without loader variables (unless the
/// queue allows them); the server refuses them at submission, this drops any
/// that reach the node anyway.
pub fn job_env(env: &BTreeMap<String, String>, loader_env: bool) -> BTreeMap<String, String> {
    env.iter()
        .filter(|(k, _)| loader_env || !is_loader_var(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The per-job home directory's name inside the job's checkpoint directory
/// (for accounts without a usable home; kept and cleaned with it).
pub const JOB_HOME: &str = ".home";

/// Whether the account's home directory is one it can use: a directory it
/// owns (`nobody`'s `/nonexistent` and homes never created are not).
pub fn has_home(account: &Account) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(&account.home).is_ok_and(|m| m.is_dir() && m.uid() == account.uid)
}

/// A job attempt's `TMPDIR` on this node: `<state_dir>/tmp/job-ID-ATTEMPT`,
/// removed when the attempt ends here.
pub fn tmp_dir(state_dir: &Path, job: u64, attempt: u32) -> std::path::PathBuf {
    state_dir.join("tmp").join(format!("job-{job}-{attempt}"))
}

/// The error a job's directory made for root gives, as I/O.
fn io(e: crate::safefs::FsError) -> std::io::Error {
    match e {
        crate::safefs::FsError::Io { path, source } => {
            std::io::Error::new(source.kind(), format!("{path}: {source}"))
        }
        e => std::io::Error::new(std::io::ErrorKind::PermissionDenied, e.to_string()),
    }
}

/// Opens (making it when missing) a job attempt's `TMPDIR`,
/// `<state_dir>/tmp/job-ID-ATTEMPT`, by descriptor from the state directory:
/// `tmp/` root's with mode 0711, the attempt's directory the account's 0700.
fn open_tmp(account: &Account, tmp: &Path) -> Result<std::os::fd::OwnedFd, crate::safefs::FsError> {
    use crate::safefs::{open_base, open_dir, FsError, Last};
    let bad = || FsError::Refused {
        path: tmp.display().to_string(),
        why: "not a TMPDIR path".into(),
    };
    let name = tmp.file_name().ok_or_else(bad)?;
    let tmp_root = tmp.parent().ok_or_else(bad)?;
    let state_dir = tmp_root.parent().ok_or_else(bad)?;
    let base = open_base(state_dir)?;
    let rel = Path::new(tmp_root.file_name().ok_or_else(bad)?).join(name);
    open_dir(
        std::os::fd::AsFd::as_fd(&base),
        &rel,
        Some(0o711),
        Last::Own {
            uid: account.uid,
            gid: account.gid,
            mode: 0o700,
        },
    )
}

/// Creates a job attempt's `HOME` (unless the account has one: then that)
/// and `TMPDIR` for its account; returns both variables for the base
/// environment. Both are made by descriptor ([`crate::safefs`]): the
/// checkpoint directory is reached through root's levels only, and a link,
/// file or another account's directory planted as `.home` is refused.
pub fn job_dirs(
    account: &Account,
    checkpoint_dir: &CkptDir,
    tmp: &Path,
) -> std::io::Result<BTreeMap<String, String>> {
    let mut env = BTreeMap::new();
    if !has_home(account) {
        let dir = checkpoint_dir
            .open(Some((account.uid, account.gid)))
            .map_err(io)?;
        crate::safefs::own_dir(
            std::os::fd::AsFd::as_fd(&dir),
            std::ffi::OsStr::new(JOB_HOME),
            account.uid,
            account.gid,
            0o700,
        )
        .map_err(io)?;
        let home = checkpoint_dir.path().join(JOB_HOME);
        env.insert("HOME".into(), home.display().to_string());
    }
    open_tmp(account, tmp).map_err(io)?;
    env.insert("TMPDIR".into(), tmp.display().to_string());
    Ok(env)
}

/// The hostfiles written into a process rank's `TMPDIR`: (file name,
/// variable, format).
pub const HOSTFILES: [(&str, &str, gangway_core::agent::HostfileFormat); 2] = [
    (
        "gangway-hostfile",
        "GANGWAY_HOSTFILE",
        gangway_core::agent::HostfileFormat::OpenMpi,
    ),
    (
        "gangway-hostfile-mpich",
        "GANGWAY_HOSTFILE_MPICH",
        gangway_core::agent::HostfileFormat::Mpich,
    ),
];

/// Writes the gang's hostfiles ([`HOSTFILES`]) into the attempt's `TMPDIR`
/// (made by [`job_dirs`]) and returns their variables. The directory is the
/// account's: it is opened by descriptor from the state directory and each
/// file is created fresh (`O_EXCL | O_NOFOLLOW`) in it, root's and
/// read-only (0444); whatever already has the name (a link, a FIFO, a file
/// the rank left) is unlinked first, never followed or opened. No nodes, a
/// host that is not plain, or a list past the bound: no file, no variable.
pub fn write_hostfiles(
    account: &Account,
    tmp: &Path,
    nodes: &[gangway_core::agent::GangNode],
) -> std::io::Result<BTreeMap<String, String>> {
    use std::io::Write;
    let mut env = BTreeMap::new();
    if nodes.is_empty() {
        return Ok(env);
    }
    let dir = open_tmp(account, tmp).map_err(io)?;
    for (name, var, format) in HOSTFILES {
        let Some(text) = gangway_core::agent::hostfile(nodes, format) else {
            continue;
        };
        let name = std::ffi::OsStr::new(name);
        let fresh = || {
            crate::safefs::create_file(
                std::os::fd::AsFd::as_fd(&dir),
                name,
                0o444,
                crate::safefs::Create::Fresh,
            )
        };
        let mut f = match fresh() {
            Ok(f) => f,
            Err(crate::safefs::FsError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::AlreadyExists =>
            {
                rustix::fs::unlinkat(&dir, name, rustix::fs::AtFlags::empty())?;
                fresh().map_err(io)?
            }
            Err(e) => return Err(io(e)),
        };
        f.write_all(text.as_bytes())?;
        // The umask may have narrowed the mode: every rank of the job reads it.
        rustix::fs::fchmod(&f, rustix::fs::Mode::from_raw_mode(0o444))?;
        env.insert(var.to_string(), tmp.join(name).display().to_string());
    }
    Ok(env)
}

/// Removes a job attempt's `TMPDIR` (absent is fine), by descriptor from the
/// state directory and without ever leaving the tree (a rank's links in it
/// are removed, never followed).
pub fn remove_tmp(tmp: &Path) {
    use crate::safefs::{open_base, open_dir, remove_tree, FsError, Last};
    let r = (|| -> Result<(), FsError> {
        let bad = || FsError::Refused {
            path: tmp.display().to_string(),
            why: "not a TMPDIR path".into(),
        };
        let name = tmp.file_name().ok_or_else(bad)?;
        let tmp_root = tmp.parent().ok_or_else(bad)?;
        let state_dir = tmp_root.parent().ok_or_else(bad)?;
        let base = open_base(state_dir)?;
        let root = open_dir(
            std::os::fd::AsFd::as_fd(&base),
            Path::new(tmp_root.file_name().ok_or_else(bad)?),
            None,
            Last::Root { mode: 0o711 },
        )?;
        remove_tree(std::os::fd::AsFd::as_fd(&root), name)
    })();
    match r {
        Ok(()) => {}
        Err(e) if e.not_found() => {}
        Err(e) => tracing::warn!("cannot remove {}: {e}", tmp.display()),
    }
}

/// Creates the rank's log file (mode 0600) and checkpoint directory (0700),
/// both owned by its account, so it can write them and other accounts
/// cannot read them. The log is made by descriptor in the agent's root-only
/// logs directory and given to the account through that descriptor; the
/// checkpoint directory is reached through root's levels only.
pub fn prepare_files(
    account: &Account,
    log: &Path,
    checkpoint_dir: &CkptDir,
) -> std::io::Result<()> {
    let f = crate::logs::open_append(log).map_err(io)?;
    crate::safefs::own(&f, account.uid, account.gid, 0o600)?;
    checkpoint_dir
        .open(Some((account.uid, account.gid)))
        .map_err(io)?;
    Ok(())
}

/// Longest wait for a job's directories to be made (a filesystem that does
/// not answer, such as a dead NFS mount, fails the rank instead of holding
/// the agent's loop).
pub const DIRS_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs `f` (file work on a job's directories) on a blocking thread and
/// waits at most [`DIRS_WAIT`] for it.
pub async fn off_loop<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    match tokio::time::timeout(DIRS_WAIT, tokio::task::spawn_blocking(f)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(std::io::Error::other(e.to_string())),
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "the filesystem did not answer within {} s",
                DIRS_WAIT.as_secs()
            ),
        )),
    }
}

/// [`prepare`] on a blocking thread, waited for at most [`DIRS_WAIT`]: the
/// account lookup and the mount sources' resolution must not hold the
/// agent's loop.
pub async fn prepare_off_loop(
    cfg: &AgentConfig,
    a: &Assignment,
) -> Result<RankSandbox, SandboxError> {
    let (cfg, a) = (cfg.clone(), a.clone());
    match off_loop(move || Ok(prepare(&cfg, &a))).await {
        Ok(r) => r,
        Err(e) => Err(SandboxError::Unchecked(e.to_string())),
    }
}

/// The agent's own directories: the state directory may be traversed (a
/// checkpoint root inside it must be reachable by ranks) but not listed; its
/// logs directory is the agent's alone (ranks write their logs through the
/// file descriptor they are given).
pub fn protect_state_dir(state_dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(state_dir.join("logs"))?;
    std::fs::set_permissions(state_dir, std::fs::Permissions::from_mode(0o711))?;
    std::fs::set_permissions(
        state_dir.join("logs"),
        std::fs::Permissions::from_mode(0o700),
    )?;
    Ok(())
}

/// The hardened part of a container's host configuration: all capabilities
/// dropped, no new privileges, a pids limit, the account's groups, the
/// checked binds, and the bridge network unless the queue allows the host's.
pub fn host_config(sb: &RankSandbox, checkpoint_dir: &Path) -> HostConfig {
    let ckpt = checkpoint_dir.display().to_string();
    let mut binds: Vec<String> = sb
        .mounts
        .iter()
        .map(|m| {
            format!(
                "{}:{}{}",
                m.source,
                m.target,
                if m.read_only { ":ro" } else { "" }
            )
        })
        .collect();
    binds.push(format!("{ckpt}:{ckpt}"));
    HostConfig {
        binds: Some(binds),
        network_mode: Some(if sb.host_network { "host" } else { "bridge" }.into()),
        cap_drop: Some(vec!["ALL".into()]),
        security_opt: Some(vec!["no-new-privileges".into()]),
        pids_limit: Some(CONTAINER_PIDS_LIMIT),
        readonly_rootfs: Some(sb.read_only_rootfs),
        group_add: Some(sb.account.groups.iter().map(u32::to_string).collect()),
        ..Default::default()
    }
}

/// The exit code of a rank refused before it started (the shell's "cannot execute").
pub const REFUSED_EXIT: i32 = 126;

/// Records why a rank may not start: the reason goes to its log (read with
/// `gangway logs`, naming the account or mount and the node). The caller then
/// announces the rank's exit with [`REFUSED_EXIT`], so the job's restart policy applies.
pub fn refuse(log: &Path, why: &SandboxError) {
    match crate::logs::open_append(log) {
        Ok(mut f) => {
            use std::io::Write;
            let _ = writeln!(f, "[gangway] refused: {why}");
        }
        Err(e) => tracing::warn!("cannot write the refusal to {}: {e}", log.display()),
    }
}

/// The `--user` of a container rank.
pub fn container_user(sb: &RankSandbox) -> String {
    format!("{}:{}", sb.account.uid, sb.account.gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account() -> Account {
        Account {
            name: "alice".into(),
            uid: 1234,
            gid: 1234,
            groups: vec![1234, 99],
            home: "/home/alice".into(),
        }
    }

    #[test]
    fn hostfiles_are_written_fresh_and_never_through_what_a_rank_planted() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let me = Account {
            name: "me".into(),
            uid: rustix::process::getuid().as_raw(),
            gid: rustix::process::getgid().as_raw(),
            groups: vec![],
            home: "/nonexistent".into(),
        };
        let d = tempfile::tempdir().expect("tmp");
        let tmp = tmp_dir(d.path(), 7, 0);
        let nodes = vec![
            gangway_core::agent::GangNode {
                host: "10.0.0.1".into(),
                slots: 2,
            },
            gangway_core::agent::GangNode {
                host: "node-b".into(),
                slots: 1,
            },
        ];
        assert!(write_hostfiles(&me, &tmp, &[]).expect("none").is_empty());
        let env = write_hostfiles(&me, &tmp, &nodes).expect("written");
        let read = |v: &str| std::fs::read_to_string(&env[v]).expect("hostfile");
        assert_eq!(
            read("GANGWAY_HOSTFILE"),
            "10.0.0.1 slots=2\nnode-b slots=1\n"
        );
        assert_eq!(read("GANGWAY_HOSTFILE_MPICH"), "10.0.0.1:2\nnode-b:1\n");
        let meta = std::fs::metadata(&env["GANGWAY_HOSTFILE"]).expect("meta");
        assert_eq!(meta.permissions().mode() & 0o777, 0o444);
        // A rank replaces them with a link to a file it may not write and
        // a FIFO: the next write unlinks both, follows and opens neither.
        let victim = d.path().join("victim");
        std::fs::write(&victim, "keep").expect("victim");
        std::fs::remove_file(&env["GANGWAY_HOSTFILE"]).expect("rm");
        std::os::unix::fs::symlink(&victim, &env["GANGWAY_HOSTFILE"]).expect("link");
        std::fs::remove_file(&env["GANGWAY_HOSTFILE_MPICH"]).expect("rm");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            env["GANGWAY_HOSTFILE_MPICH"].as_str(),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o666),
            0,
        )
        .expect("fifo");
        let again = write_hostfiles(&me, &tmp, &nodes).expect("rewritten");
        assert_eq!(again, env);
        assert_eq!(std::fs::read_to_string(&victim).expect("victim"), "keep");
        assert_eq!(read("GANGWAY_HOSTFILE_MPICH"), "10.0.0.1:2\nnode-b:1\n");
        let meta = std::fs::symlink_metadata(&env["GANGWAY_HOSTFILE"]).expect("meta");
        assert!(meta.is_file() && meta.nlink() == 1);
        // A directory in its place is refused, not emptied.
        std::fs::remove_file(&env["GANGWAY_HOSTFILE"]).expect("rm");
        std::fs::create_dir(&env["GANGWAY_HOSTFILE"]).expect("dir");
        std::fs::write(Path::new(&env["GANGWAY_HOSTFILE"]).join("x"), "x").expect("x");
        assert!(write_hostfiles(&me, &tmp, &nodes).is_err());
        assert!(Path::new(&env["GANGWAY_HOSTFILE"]).join("x").exists());
        // A host that would add a line: no file, no variable.
        let bad = vec![gangway_core::agent::GangNode {
            host: "a\nb slots=64".into(),
            slots: 1,
        }];
        let t2 = tmp_dir(d.path(), 8, 0);
        assert!(write_hostfiles(&me, &t2, &bad).expect("none").is_empty());
        assert!(!t2.join("gangway-hostfile").exists());
    }

    #[test]
    fn the_base_is_minimal_and_loader_variables_are_dropped() {
        std::env::set_var("GANGWAY_TEST_PASSED", "yes");
        let base = base_env(&account(), &["GANGWAY_TEST_PASSED".into()]);
        let keys: Vec<&str> = base.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "GANGWAY_TEST_PASSED",
                "HOME",
                "LANG",
                "LOGNAME",
                "PATH",
                "USER"
            ]
        );
        assert_eq!(base["HOME"], "/home/alice");
        let mut env = BTreeMap::new();
        env.insert("LD_PRELOAD".to_string(), "/x.so".to_string());
        env.insert("RANK".to_string(), "0".to_string());
        assert_eq!(job_env(&env, false).keys().collect::<Vec<_>>(), ["RANK"]);
        assert_eq!(job_env(&env, true).len(), 2);
    }

    #[test]
    fn containers_drop_everything_by_default() {
        let sb = RankSandbox {
            account: account(),
            base_env: BTreeMap::new(),
            loader_env: false,
            host_network: false,
            read_only_rootfs: false,
            mounts: vec![Mount {
                source: "/datasets/a".into(),
                target: "/data".into(),
                read_only: true,
            }],
        };
        let h = host_config(&sb, Path::new("/ckpt/job-1"));
        assert_eq!(h.network_mode.as_deref(), Some("bridge"));
        assert_eq!(h.cap_drop, Some(vec!["ALL".to_string()]));
        assert_eq!(h.security_opt, Some(vec!["no-new-privileges".to_string()]));
        assert_eq!(
            h.binds,
            Some(vec![
                "/datasets/a:/data:ro".to_string(),
                "/ckpt/job-1:/ckpt/job-1".to_string()
            ])
        );
        assert_eq!(container_user(&sb), "1234:1234");
    }
}
