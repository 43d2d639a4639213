//! Who a rank runs as: the job's Unix account, resolved on the node, and the
//! privilege drop before exec (supplementary groups, gid, uid; then no new
//! privileges), as Slurm's slurmstepd drops to the job owner.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// A Unix account as this node knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Account {
    /// Login name.
    pub name: String,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Every group it belongs to (primary included), as `initgroups` would set.
    pub groups: Vec<u32>,
    /// Home directory.
    pub home: PathBuf,
}

/// Why a rank cannot run as its account on this node.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum IdentityError {
    /// No such account.
    #[error("Unix account {account:?} does not exist on node {node}")]
    NoSuchAccount {
        /// Account.
        account: String,
        /// Node.
        node: String,
    },
    /// The account database could not be read.
    #[error("cannot look up Unix account {account:?} on node {node}: {msg}")]
    Lookup {
        /// Account.
        account: String,
        /// Node.
        node: String,
        /// Error.
        msg: String,
    },
    /// A root account in a queue that does not allow it.
    #[error("Unix account {account:?} is root (uid 0) on node {node} and queue {queue:?} does not allow root ranks (allow_root: true)")]
    Root {
        /// Account.
        account: String,
        /// Node.
        node: String,
        /// Queue.
        queue: String,
    },
    /// An unprivileged agent asked to run ranks as someone else.
    #[error("the agent on node {node} runs as uid {agent_uid} and cannot run ranks as Unix account {account:?} (uid {uid}); run the agent as root")]
    CannotSwitch {
        /// Account.
        account: String,
        /// Its uid.
        uid: u32,
        /// The agent's uid.
        agent_uid: u32,
        /// Node.
        node: String,
    },
}

/// Looks up an account by name (a number is not taken as a uid: accounts are named).
pub fn resolve(name: &str, node: &str) -> Result<Account, IdentityError> {
    let user = nix::unistd::User::from_name(name)
        .map_err(|e| IdentityError::Lookup {
            account: name.into(),
            node: node.into(),
            msg: e.to_string(),
        })?
        .ok_or_else(|| IdentityError::NoSuchAccount {
            account: name.into(),
            node: node.into(),
        })?;
    let groups = CString::new(name)
        .ok()
        .and_then(|c| nix::unistd::getgrouplist(&c, user.gid).ok())
        .map(|g| g.into_iter().map(|g| g.as_raw()).collect())
        .unwrap_or_else(|| vec![user.gid.as_raw()]);
    Ok(Account {
        name: user.name,
        uid: user.uid.as_raw(),
        gid: user.gid.as_raw(),
        groups,
        home: user.dir,
    })
}

/// The account this process runs as (its effective uid), if it has a name.
pub fn current_account() -> Result<Option<Account>, IdentityError> {
    let uid = nix::unistd::geteuid();
    match nix::unistd::User::from_uid(uid) {
        Ok(Some(u)) => resolve(&u.name, "this node").map(Some),
        Ok(None) => Ok(None),
        Err(e) => Err(IdentityError::Lookup {
            account: uid.to_string(),
            node: "this node".into(),
            msg: e.to_string(),
        }),
    }
}

/// Refuses root accounts unless the queue allows them, and accounts an
/// unprivileged agent cannot switch to.
pub fn check(
    account: &Account,
    allow_root: bool,
    queue: &str,
    node: &str,
) -> Result<(), IdentityError> {
    if account.uid == 0 && !allow_root {
        return Err(IdentityError::Root {
            account: account.name.clone(),
            node: node.into(),
            queue: queue.into(),
        });
    }
    let agent_uid = nix::unistd::geteuid().as_raw();
    if agent_uid != 0 && agent_uid != account.uid {
        return Err(IdentityError::CannotSwitch {
            account: account.name.clone(),
            uid: account.uid,
            agent_uid,
            node: node.into(),
        });
    }
    Ok(())
}

/// Who a rank runs as, for messages: `user nobody (uid 65534)`.
pub fn who(account: &Account) -> String {
    format!("user {} (uid {})", account.name, account.uid)
}

/// Makes `cmd`'s child become `account` before exec: supplementary groups,
/// gid, uid (real, effective and saved, so nothing can take root back),
/// then `PR_SET_NO_NEW_PRIVS` (setuid programs gain nothing), then the
/// rank's Landlock ruleset when it has one (`bind_rules`: the TCP ports it
/// may bind, [`crate::landlock`]), then the
/// working directory is entered as the account (`workdir`, else its home
/// when it can enter it, else `/`). When the agent already is the account
/// (an unprivileged `gangway up`) only the last two steps apply.
///
/// Register this after any other `pre_exec` hook that needs root (a cgroup
/// join): hooks run in order and nothing after this one is privileged.
pub fn drop_privileges(
    cmd: &mut tokio::process::Command,
    account: &Account,
    workdir: Option<&Path>,
    bind_rules: Option<std::sync::Arc<crate::landlock::PortRules>>,
) -> std::io::Result<()> {
    use nix::unistd::{Gid, Uid};
    use std::os::unix::ffi::OsStrExt;
    let cstr = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in a path"))
    };
    let dir = match workdir {
        Some(w) => Some(cstr(w)?),
        None => None,
    };
    let home = cstr(&account.home).ok();
    let root = c"/".to_owned();
    let switch = nix::unistd::geteuid().as_raw() != account.uid;
    let groups: Vec<Gid> = account.groups.iter().map(|g| Gid::from_raw(*g)).collect();
    let (uid, gid) = (Uid::from_raw(account.uid), Gid::from_raw(account.gid));
    let hook = move || -> std::io::Result<()> {
        // Only async-signal-safe calls from here on: this runs between fork and exec.
        if switch {
            nix::unistd::setgroups(&groups)?;
            nix::unistd::setgid(gid)?;
            nix::unistd::setuid(uid)?;
            if !uid.is_root() && nix::unistd::setuid(Uid::from_raw(0)).is_ok() {
                return Err(std::io::Error::from_raw_os_error(libc::EPERM));
            }
        }
        // SAFETY: prctl with integer arguments only.
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if let Some(rules) = &bind_rules {
            // SAFETY: one system call on a descriptor the Arc keeps open.
            unsafe { crate::landlock::restrict_self(rules.raw_fd())? };
        }
        match &dir {
            Some(d) => nix::unistd::chdir(d.as_c_str())?,
            None => {
                let entered = home
                    .as_ref()
                    .is_some_and(|h| nix::unistd::chdir(h.as_c_str()).is_ok());
                if !entered {
                    nix::unistd::chdir(root.as_c_str())?;
                }
            }
        }
        Ok(())
    };
    // SAFETY: the hook only makes system calls (no allocation, no locks).
    unsafe {
        cmd.pre_exec(hook);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_resolves_and_is_refused_unless_allowed() {
        let root = resolve("root", "n1").expect("root exists");
        assert_eq!(root.uid, 0);
        let e = check(&root, false, "research", "n1").expect_err("refused");
        assert!(e.to_string().contains("allow_root"), "{e}");
    }

    #[test]
    fn who_names_the_account_and_its_uid() {
        let nobody = Account {
            name: "nobody".into(),
            uid: 65534,
            gid: 65534,
            groups: vec![65534],
            home: "/nonexistent".into(),
        };
        assert_eq!(who(&nobody), "user nobody (uid 65534)");
    }

    #[test]
    fn a_missing_account_is_named_with_the_node() {
        let e = resolve("gangway-no-such-user-x", "node-7").expect_err("missing");
        let msg = e.to_string();
        assert!(
            msg.contains("gangway-no-such-user-x") && msg.contains("node-7"),
            "{msg}"
        );
    }
}
