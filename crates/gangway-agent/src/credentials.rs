//! The node's own token, kept in the state directory (mode 0600) so that a
//! restarted agent re-registers its node with it: the server refuses the
//! join token for a name that is already registered, and never sends a
//! node's token twice.

use std::path::{Path, PathBuf};

fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("node-token")
}

/// The saved node token, if any.
pub fn load(state_dir: &Path) -> Option<String> {
    std::fs::read_to_string(path(state_dir))
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
}

/// Saves the node token readable by the agent's user only.
pub fn save(state_dir: &Path, token: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let p = path(state_dir);
    let tmp = state_dir.join("node-token.tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(token.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, &p)
}

/// Forgets the saved token (the server no longer knows it: the node was
/// deleted or the store is new), so the next registration uses the join token.
pub fn forget(state_dir: &Path) {
    let _ = std::fs::remove_file(path(state_dir));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_token_is_saved_private_and_read_back() {
        let dir = tempfile::tempdir().expect("tmp");
        assert_eq!(load(dir.path()), None);
        save(dir.path(), "abc123").expect("save");
        assert_eq!(load(dir.path()).as_deref(), Some("abc123"));
        let mode = std::fs::metadata(path(dir.path()))
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        save(dir.path(), "def456").expect("overwrite");
        assert_eq!(load(dir.path()).as_deref(), Some("def456"));
        forget(dir.path());
        assert_eq!(load(dir.path()), None);
    }
}
