//! Host mounts of container ranks, checked again on the node: each source is
//! resolved (symlinks followed) and the resolved path must still pass the
//! queue's allow-lists and the fixed rules, with the agent's own state and
//! checkpoint directories protected too. The resolved path is what gets
//! mounted, so a symlink under an allowed prefix cannot lead elsewhere.
//! Docker resolves the path once more when it mounts it, so every directory
//! above the resolved source must be one only root can change (root's and
//! not group/other writable, or sticky with a root-owned entry on the path):
//! otherwise a user could swap a component for a link between the check and
//! the mount.
//! Process ranks have no mounts: they see what their Unix account may see.

use gangway_core::node_policy::{check_mount, PolicyError};
use gangway_core::{Mount, NodePolicy};
use std::path::Path;
use thiserror::Error;

/// Why a mount is refused on the node.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum MountError {
    /// A policy rule (on the spec's path or the resolved one).
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// The source cannot be resolved (missing, unreadable).
    #[error("run.mounts[{index}].source: {path:?} cannot be resolved on node {node}: {msg}")]
    Unresolvable {
        /// Which mount.
        index: usize,
        /// Its source.
        path: String,
        /// Node.
        node: String,
        /// Why.
        msg: String,
    },
    /// A directory above the source can be changed by others than root.
    #[error("run.mounts[{index}].source: {path:?} lies under {dir:?}, which users other than root can write on node {node} (an entry there could be swapped for a link between the check and the mount)")]
    Writable {
        /// Which mount.
        index: usize,
        /// Its resolved source.
        path: String,
        /// The directory others can write.
        dir: String,
        /// Node.
        node: String,
    },
}

/// The first directory above `real` (an absolute, resolved path) whose
/// entries someone other than root can change: not root's, or group/other
/// writable without the sticky bit, or sticky with the entry on the path
/// not root's.
fn writable_above(real: &Path) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let me = rustix::process::geteuid().as_raw();
    let trusted = |uid: u32| uid == 0 || uid == me;
    let mut dir = std::path::PathBuf::from("/");
    let parts: Vec<_> = real.components().skip(1).collect();
    for part in parts {
        let next = dir.join(part);
        let Ok(m) = std::fs::symlink_metadata(&dir) else {
            return Some(dir);
        };
        let open = m.mode() & 0o022 != 0;
        let sticky = m.mode() & 0o1000 != 0;
        let child_trusted = std::fs::symlink_metadata(&next)
            .is_ok_and(|c| trusted(c.uid()) && !c.file_type().is_symlink());
        if !trusted(m.uid()) || (open && !(sticky && child_trusted)) {
            return Some(dir);
        }
        dir = next;
    }
    None
}

/// The job's mounts with their sources resolved, each checked before and
/// after resolving; `protected` are this agent's own directories.
pub fn resolve(
    mounts: &[Mount],
    policy: &NodePolicy,
    queue: &str,
    protected: &[&Path],
    node: &str,
) -> Result<Vec<Mount>, MountError> {
    let protected: Vec<String> = protected
        .iter()
        .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()))
        .map(|p| p.display().to_string())
        .collect();
    let mut out = Vec::with_capacity(mounts.len());
    for (i, m) in mounts.iter().enumerate() {
        check_mount(i, m, &m.source, policy, queue, &protected)?;
        let real = std::fs::canonicalize(&m.source).map_err(|e| MountError::Unresolvable {
            index: i,
            path: m.source.clone(),
            node: node.into(),
            msg: e.to_string(),
        })?;
        let real = real.to_str().ok_or_else(|| MountError::Unresolvable {
            index: i,
            path: m.source.clone(),
            node: node.into(),
            msg: "the resolved path is not UTF-8".into(),
        })?;
        check_mount(i, m, real, policy, queue, &protected)?;
        if let Some(dir) = writable_above(Path::new(real)) {
            return Err(MountError::Writable {
                index: i,
                path: real.to_string(),
                dir: dir.display().to_string(),
                node: node.into(),
            });
        }
        out.push(Mount {
            source: real.to_string(),
            target: m.target.clone(),
            read_only: m.read_only,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::MountPolicy;

    #[test]
    fn a_symlink_out_of_an_allowed_prefix_is_refused_after_resolving() {
        let dir = tempfile::tempdir().expect("tmp");
        let base = std::fs::canonicalize(dir.path()).expect("canon");
        let allowed = base.join("datasets");
        std::fs::create_dir_all(allowed.join("real")).expect("dirs");
        std::os::unix::fs::symlink("/etc", allowed.join("evil")).expect("link");
        let state = base.join("state");
        std::fs::create_dir_all(&state).expect("state");
        std::os::unix::fs::symlink(&state, allowed.join("to-state")).expect("link");
        let policy = NodePolicy {
            mounts: MountPolicy {
                allowed: vec![allowed.display().to_string()],
                read_write: vec![],
            },
            ..Default::default()
        };
        let m = |s: &Path| Mount {
            source: s.display().to_string(),
            target: "/data".into(),
            read_only: true,
        };
        let ok = resolve(&[m(&allowed.join("real"))], &policy, "q", &[&state], "n");
        assert_eq!(
            ok.expect("allowed")[0].source,
            allowed.join("real").display().to_string()
        );
        let e = resolve(&[m(&allowed.join("evil"))], &policy, "q", &[&state], "n")
            .expect_err("symlink to /etc");
        assert!(e.to_string().contains("\"/etc\""), "{e}");
        let e = resolve(
            &[m(&allowed.join("to-state"))],
            &policy,
            "q",
            &[&state],
            "n",
        )
        .expect_err("symlink to the agent's state");
        assert!(e.to_string().starts_with("run.mounts[0].source"), "{e}");
        let e = resolve(&[m(&allowed.join("missing"))], &policy, "q", &[&state], "n")
            .expect_err("missing");
        assert!(matches!(e, MountError::Unresolvable { .. }), "{e}");
    }

    #[test]
    fn a_source_under_a_directory_others_can_write_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tmp");
        let base = std::fs::canonicalize(dir.path()).expect("canon");
        let allowed = base.join("datasets");
        std::fs::create_dir_all(allowed.join("open/sub")).expect("dirs");
        std::fs::create_dir_all(allowed.join("sticky/sub")).expect("dirs");
        std::fs::set_permissions(&allowed, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::set_permissions(allowed.join("open"), std::fs::Permissions::from_mode(0o777))
            .expect("chmod");
        std::fs::set_permissions(
            allowed.join("sticky"),
            std::fs::Permissions::from_mode(0o1777),
        )
        .expect("chmod");
        let policy = NodePolicy {
            mounts: MountPolicy {
                allowed: vec![allowed.display().to_string()],
                read_write: vec![],
            },
            ..Default::default()
        };
        let m = |s: &Path| Mount {
            source: s.display().to_string(),
            target: "/data".into(),
            read_only: true,
        };
        let state = base.join("state");
        // The world-writable directory itself may be mounted: its own entry
        // lies in a directory only root changes.
        resolve(&[m(&allowed.join("open"))], &policy, "q", &[&state], "n").expect("open itself");
        let e = resolve(
            &[m(&allowed.join("open/sub"))],
            &policy,
            "q",
            &[&state],
            "n",
        )
        .expect_err("under a world-writable directory");
        assert!(matches!(e, MountError::Writable { .. }), "{e}");
        assert!(e.to_string().contains("/datasets/open\""), "{e}");
        // Sticky with a root-owned entry: no one else can swap it.
        resolve(
            &[m(&allowed.join("sticky/sub"))],
            &policy,
            "q",
            &[&state],
            "n",
        )
        .expect("sticky, root's entry");
        if rustix::process::geteuid().is_root() {
            std::os::unix::fs::chown(allowed.join("sticky/sub"), Some(4242), None).expect("chown");
            std::fs::create_dir(allowed.join("sticky/sub/x")).expect("x");
            let e = resolve(
                &[m(&allowed.join("sticky/sub/x"))],
                &policy,
                "q",
                &[&state],
                "n",
            )
            .expect_err("a user's directory above");
            assert!(matches!(e, MountError::Writable { .. }), "{e}");
        }
    }
}
