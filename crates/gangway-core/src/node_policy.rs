//! What a queue lets its jobs do on a node (root ranks, host network, host
//! mounts, loader variables), and the pure checks of a job's run spec against
//! it. The server applies them at submission and the agent again before it
//! starts a rank (then also resolving symlinks, which needs the node's files).
//! The rules follow Kubernetes' restricted Pod Security Standard: no root, no
//! host paths, no host network, unless the admin says so per queue.

use crate::job::{Mount, RunSpec};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Host paths a queue may let its jobs mount (Docker bind mounts).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct MountPolicy {
    /// Source prefixes that may be mounted (read-only unless also in `read_write`).
    pub allowed: Vec<String>,
    /// Source prefixes that may be mounted read-write.
    pub read_write: Vec<String>,
}

/// A queue's rules for its ranks on the nodes. The default is the restricted
/// one: no root, no host network, no host paths, no loader variables.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct NodePolicy {
    /// Ranks may run as root (uid 0).
    pub allow_root: bool,
    /// Containers may use the host's network namespace.
    pub host_network: bool,
    /// `LD_PRELOAD`, `LD_LIBRARY_PATH` and the other loader variables may be
    /// set even though the queue allows root ranks (see
    /// [`NodePolicy::loader_env_allowed`]; without `allow_root` they are).
    pub loader_env: bool,
    /// Containers get a read-only root filesystem.
    pub read_only_rootfs: bool,
    /// Host paths that may be mounted.
    pub mounts: MountPolicy,
    /// Per-rank limits (processes, memory, logs) beyond the defaults. Left
    /// out of the wire form while unset, so a queue without limits sends
    /// what agents of the previous minor version read.
    #[serde(skip_serializing_if = "RankLimitPolicy::is_unset")]
    pub limits: RankLimitPolicy,
}

/// A queue's per-rank limits; each one left out takes the agent's default
/// (4,096 processes; memory: the request, else the node's memory per GPU
/// times the rank's GPUs; logs: 10 MiB per file, 5 files, like the kubelet).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RankLimitPolicy {
    /// Processes (and threads) a rank may have at once.
    pub pids: Option<u64>,
    /// Memory per GPU for ranks that request none, in MiB.
    pub memory_mib_per_gpu: Option<u64>,
    /// Size in bytes at which a rank's log is rotated.
    pub log_max_bytes: Option<u64>,
    /// Log files kept per rank, the current one included.
    pub log_max_files: Option<u32>,
    /// Bytes a job may keep in its checkpoint directory on a node (none:
    /// only the node's free-space watch bounds it).
    pub checkpoint_quota_bytes: Option<u64>,
}

impl RankLimitPolicy {
    /// Whether every limit is left to the agent's default.
    pub fn is_unset(&self) -> bool {
        *self == Self::default()
    }
}

impl NodePolicy {
    /// Whether the job's loader variables reach its ranks. They do by
    /// default: ranks run as the job's own account with no new privileges,
    /// so a loader variable changes only what the user's own processes
    /// load. A queue that allows root ranks refuses them unless it also says
    /// `loader_env: true`: a root rank whose `LD_LIBRARY_PATH` names a
    /// directory another account can write would run that account's code
    /// as root.
    pub fn loader_env_allowed(&self) -> bool {
        self.loader_env || !self.allow_root
    }
}

/// Host paths that are never mounted, whatever a queue allows: each of them,
/// anything under them, and anything above them (mounting `/var` would show
/// `/var/run/docker.sock`).
pub const NEVER_MOUNTED: &[&str] = &[
    "/etc",
    "/proc",
    "/sys",
    "/dev",
    "/run",
    "/var/run",
    "/var/lib/docker",
    "/root",
    "/boot",
];

/// Why a job's run spec breaks its queue's node policy or a fixed rule.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PolicyError {
    /// A mount source that is not a clean absolute path.
    #[error("run.mounts[{index}].source: {path:?} must be an absolute path without '..'")]
    MountNotClean {
        /// Which mount.
        index: usize,
        /// Its source.
        path: String,
    },
    /// A mount target that is not a clean absolute path.
    #[error("run.mounts[{index}].target: {path:?} must be an absolute path without '..'")]
    TargetNotClean {
        /// Which mount.
        index: usize,
        /// Its target.
        path: String,
    },
    /// A host path that is never mounted.
    #[error("run.mounts[{index}].source: {path:?} is never mountable (it is or contains {rule})")]
    MountForbidden {
        /// Which mount.
        index: usize,
        /// Its source (after resolving, on the agent).
        path: String,
        /// The protected path it touches.
        rule: String,
    },
    /// A host path outside the queue's allow-list.
    #[error("run.mounts[{index}].source: {path:?} is not under a path queue {queue} allows (allowed: {allowed:?})")]
    MountNotAllowed {
        /// Which mount.
        index: usize,
        /// Its source.
        path: String,
        /// The queue.
        queue: String,
        /// What it allows.
        allowed: Vec<String>,
    },
    /// A read-write mount outside the queue's read-write list.
    #[error("run.mounts[{index}].read_only: {path:?} may only be mounted read-only in queue {queue} (read-write allowed under {read_write:?})")]
    MountNotWritable {
        /// Which mount.
        index: usize,
        /// Its source.
        path: String,
        /// The queue.
        queue: String,
        /// Its read-write prefixes.
        read_write: Vec<String>,
    },
    /// A loader variable in a queue that does not allow them.
    #[error("run.env.{name}: loader variables are not allowed in queue {queue}: it allows root ranks (allow_root: true), so it needs loader_env: true")]
    LoaderEnv {
        /// Variable.
        name: String,
        /// Queue.
        queue: String,
    },
    /// A working directory that is not a clean absolute path.
    #[error("run.workdir: {0:?} must be an absolute path without '..'")]
    Workdir(String),
    /// Root ranks in a queue that does not allow them.
    #[error("run as: ranks of this job would run as root (account {account:?}) but queue {queue} does not allow root (allow_root: true)")]
    Root {
        /// The account.
        account: String,
        /// The queue.
        queue: String,
    },
}

/// Whether `name` is a dynamic-loader (or similar libc) variable that changes
/// what code a process loads: every `LD_*` and glibc's other unsafe variables.
pub fn is_loader_var(name: &str) -> bool {
    name.starts_with("LD_")
        || matches!(
            name,
            "GCONV_PATH"
                | "GETCONF_DIR"
                | "HOSTALIASES"
                | "LOCALDOMAIN"
                | "LOCPATH"
                | "MALLOC_TRACE"
                | "NIS_PATH"
                | "NLSPATH"
                | "RESOLV_HOST_CONF"
                | "RES_OPTIONS"
        )
}

/// The path with `.` and empty components removed, or `None` when it is not
/// absolute or has a `..` component (rejected rather than resolved: on the
/// node `..` after a symlink means something else than it reads).
pub fn clean_path(p: &str) -> Option<String> {
    if !p.starts_with('/') {
        return None;
    }
    let mut parts = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => return None,
            c => parts.push(c),
        }
    }
    Some(format!("/{}", parts.join("/")))
}

/// Whether clean path `p` is `prefix` or below it (whole components only:
/// `/datasets2` is not under `/datasets`).
pub fn is_under(p: &str, prefix: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    prefix.is_empty() || p == prefix || p.starts_with(&format!("{prefix}/"))
}

/// The protected path a clean source touches (is, is under or is above), if any;
/// `extra` adds the node's own protected paths (the agent's data directory).
pub fn forbidden_by(p: &str, extra: &[String]) -> Option<String> {
    if p == "/" {
        return Some("/".into());
    }
    NEVER_MOUNTED
        .iter()
        .map(|s| s.to_string())
        .chain(extra.iter().filter_map(|e| clean_path(e)))
        .find(|rule| is_under(p, rule) || is_under(rule, p))
}

/// Checks one mount against the fixed rules and the queue's allow-lists;
/// `source` is the path to judge (the spec's, or the resolved one on the agent).
pub fn check_mount(
    index: usize,
    m: &Mount,
    source: &str,
    policy: &NodePolicy,
    queue: &str,
    extra_forbidden: &[String],
) -> Result<(), PolicyError> {
    let Some(src) = clean_path(source) else {
        return Err(PolicyError::MountNotClean {
            index,
            path: source.to_string(),
        });
    };
    if clean_path(&m.target).is_none() {
        return Err(PolicyError::TargetNotClean {
            index,
            path: m.target.clone(),
        });
    }
    if let Some(rule) = forbidden_by(&src, extra_forbidden) {
        return Err(PolicyError::MountForbidden {
            index,
            path: src,
            rule,
        });
    }
    let under_any = |list: &[String]| {
        list.iter()
            .filter_map(|a| clean_path(a))
            .any(|a| a != "/" && is_under(&src, &a))
    };
    if !under_any(&policy.mounts.allowed) && !under_any(&policy.mounts.read_write) {
        return Err(PolicyError::MountNotAllowed {
            index,
            path: src,
            queue: queue.to_string(),
            allowed: policy.mounts.allowed.clone(),
        });
    }
    if !m.read_only && !under_any(&policy.mounts.read_write) {
        return Err(PolicyError::MountNotWritable {
            index,
            path: src,
            queue: queue.to_string(),
            read_write: policy.mounts.read_write.clone(),
        });
    }
    Ok(())
}

/// Checks a run spec against its queue's node policy: mounts, loader
/// variables and the working directory (no I/O; the agent checks again).
pub fn check_run(run: &RunSpec, policy: &NodePolicy, queue: &str) -> Result<(), PolicyError> {
    for (i, m) in run.mounts.iter().enumerate() {
        check_mount(i, m, &m.source, policy, queue, &[])?;
    }
    if !policy.loader_env_allowed() {
        if let Some(name) = run.env.keys().find(|k| is_loader_var(k)) {
            return Err(PolicyError::LoaderEnv {
                name: name.clone(),
                queue: queue.to_string(),
            });
        }
    }
    if let Some(w) = &run.workdir {
        if clean_path(w).is_none() {
            return Err(PolicyError::Workdir(w.clone()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(source: &str, read_only: bool) -> Mount {
        Mount {
            source: source.into(),
            target: "/data".into(),
            read_only,
        }
    }

    fn research() -> NodePolicy {
        NodePolicy {
            mounts: MountPolicy {
                allowed: vec!["/datasets".into(), "/scratch/research".into()],
                read_write: vec!["/scratch/research".into()],
            },
            ..Default::default()
        }
    }

    #[test]
    fn paths_are_cleaned_and_dot_dot_is_refused() {
        assert_eq!(clean_path("/a//b/./c/").as_deref(), Some("/a/b/c"));
        assert_eq!(clean_path("/").as_deref(), Some("/"));
        assert_eq!(clean_path("/data/../root"), None);
        assert_eq!(clean_path("data"), None);
        assert!(is_under("/datasets/x", "/datasets"));
        assert!(!is_under("/datasets2", "/datasets"));
    }

    #[test]
    fn mounts_follow_the_allow_lists_and_the_fixed_rules() {
        let p = research();
        let ok = |s: &str, ro: bool| check_mount(0, &mount(s, ro), s, &p, "research", &[]);
        assert_eq!(ok("/datasets/imagenet", true), Ok(()));
        assert_eq!(ok("/scratch/research/run1", false), Ok(()));
        assert!(matches!(
            ok("/datasets/imagenet", false),
            Err(PolicyError::MountNotWritable { .. })
        ));
        assert!(matches!(
            ok("/home/bob", true),
            Err(PolicyError::MountNotAllowed { .. })
        ));
        assert!(matches!(
            ok("/data/../root", true),
            Err(PolicyError::MountNotClean { .. })
        ));
        for bad in [
            "/",
            "/etc",
            "/etc/ssl",
            "/var/run/docker.sock",
            "/var",
            "/proc/1",
        ] {
            let err = ok(bad, true).expect_err(bad);
            assert!(
                matches!(err, PolicyError::MountForbidden { .. }),
                "{bad}: {err}"
            );
            assert!(err.to_string().starts_with("run.mounts[0].source"), "{err}");
        }
        // Even a queue that allows everything under / cannot mount these.
        let mut all = research();
        all.mounts.allowed = vec!["/".into()];
        all.mounts.read_write = vec!["/".into()];
        assert!(check_mount(0, &mount("/etc", false), "/etc", &all, "q", &[]).is_err());
        assert!(matches!(
            check_mount(0, &mount("/srv/x", true), "/srv/x", &all, "q", &[]),
            Err(PolicyError::MountNotAllowed { .. })
        ));
        // The agent adds its own data directory.
        let extra = vec!["/datasets/agent-state".to_string()];
        assert!(matches!(
            check_mount(0, &mount("/datasets", true), "/datasets", &p, "q", &extra),
            Err(PolicyError::MountForbidden { .. })
        ));
    }

    #[test]
    fn loader_variables_are_refused_where_root_is_allowed_and_bad_workdirs_always() {
        let mut run = RunSpec::default();
        run.env
            .insert("LD_LIBRARY_PATH".into(), "/opt/cuda/lib64".into());
        // Ranks of the default queue never run as root: allowed.
        assert_eq!(check_run(&run, &NodePolicy::default(), "q"), Ok(()));
        let rooty = NodePolicy {
            allow_root: true,
            ..Default::default()
        };
        let err = check_run(&run, &rooty, "q").expect_err("refused");
        assert!(
            err.to_string()
                .starts_with("run.env.LD_LIBRARY_PATH: loader variables are not allowed in queue q: it allows root ranks"),
            "{err}"
        );
        let allowing = NodePolicy {
            loader_env: true,
            ..rooty
        };
        assert_eq!(check_run(&run, &allowing, "q"), Ok(()));
        run.env.clear();
        run.workdir = Some("/home/a/../../root".into());
        assert!(matches!(
            check_run(&run, &NodePolicy::default(), "q"),
            Err(PolicyError::Workdir(_))
        ));
        run.workdir = Some("relative".into());
        assert!(check_run(&run, &NodePolicy::default(), "q").is_err());
    }
}
