//! Host mounts of container ranks, checked again on the node: each source is
//! resolved (symlinks followed) and the resolved path must still pass the
//! queue's allow-lists and the fixed rules, with the agent's own state and
//! checkpoint directories protected too. The resolved path is what gets
//! mounted, so a symlink under an allowed prefix cannot lead elsewhere.
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
}
