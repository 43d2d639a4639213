//! Node admission, after the kubelet's NodeRestriction model: the join token
//! registers only new node names, and such nodes wait for an admin's
//! approval unless the config says `node_approval: auto`; a node's own token
//! (stored only as a digest) is the one credential that re-registers it, and
//! it changes only that node's own endpoint; the register answer carries the
//! token only the first time. Admins approve, cordon, drain and delete nodes.

use crate::authz::{hash_from_hex, hash_token, to_hex, TokenHash};
use crate::control_error::{decode, ControlError};
use gangway_core::NodeSpec;
use serde::{Deserialize, Serialize};

/// Store prefix of nodes waiting for approval.
pub const PENDING_PREFIX: &str = "/pending_nodes/";

pub(crate) fn pending_key(name: &str) -> String {
    format!("{PENDING_PREFIX}{name}")
}

/// A node's credential as stored: its token's SHA-256 digest (never the
/// token) and the nonce its log key is derived from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeCredential {
    /// Hex SHA-256 of the node token.
    pub token_sha256: String,
    /// Random nonce of the node's log key (see [`log_token`]).
    pub log_nonce: String,
}

impl NodeCredential {
    /// A credential for a fresh token.
    pub fn new(token: &str) -> Self {
        NodeCredential {
            token_sha256: to_hex(&hash_token(token)),
            log_nonce: crate::authz::fresh_token(),
        }
    }

    /// The digest as bytes (all zeros, matching no token, if the stored hex is bad).
    pub fn digest(&self) -> TokenHash {
        hash_from_hex(&self.token_sha256).unwrap_or([0; 32])
    }

    /// Reads a stored credential; a record from before tokens were hashed (a
    /// plain JSON string) is hashed on the way in.
    pub fn decode(key: &str, bytes: &[u8]) -> Result<Self, ControlError> {
        if let Ok(c) = serde_json::from_slice::<NodeCredential>(bytes) {
            return Ok(c);
        }
        let plain: String = decode(key, bytes)?;
        Ok(NodeCredential::new(&plain))
    }
}

/// The key a node's agent accepts from the server when it relays that
/// node's logs: derived from the cluster's join token (which only the
/// server's configuration holds), the node's name and its nonce, so the
/// store holds nothing that reads logs and a node's key opens only its own.
pub fn log_token(join_token: &str, node: &str, nonce: &str) -> String {
    to_hex(&hash_token(&format!(
        "gangway-log\0{join_token}\0{node}\0{nonce}"
    )))
}

/// Who registers a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Registrant {
    /// The cluster's join token: new names only.
    Join,
    /// A node's own token: its own registration only.
    Node(String),
    /// The admin.
    Admin,
}

/// The answer to a registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registered {
    /// The node's token: only on first registration.
    pub token: Option<String>,
    /// The key the agent accepts from the server for log reads.
    pub log_token: String,
    /// Whether the node waits for an admin's approval.
    pub pending: bool,
}

/// Longest node name.
const MAX_NODE_NAME: usize = 253;

/// Rule: a node's name is a hostname-like word, its agent URL is plain
/// `http(s)://ADDRESS:PORT` on the node's own address (the server contacts
/// nothing else), and its lists are bounded.
pub fn check_node_spec(spec: &NodeSpec) -> Result<(), ControlError> {
    let bad = |m: String| Err(ControlError::BadNode(m));
    let n = &spec.name;
    if n.is_empty()
        || n.len() > MAX_NODE_NAME
        || !n
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return bad(format!(
            "name: {:?} must be 1 to {MAX_NODE_NAME} letters, digits, '-', '_' or '.'",
            n.chars().take(64).collect::<String>()
        ));
    }
    if spec.gpus.len() > 64 {
        return bad(format!(
            "gpus: at most 64 per node (got {})",
            spec.gpus.len()
        ));
    }
    if spec.labels.len() > 64
        || spec
            .labels
            .iter()
            .any(|(k, v)| k.len() > MAX_NODE_NAME || v.len() > MAX_NODE_NAME)
    {
        return bad("labels: at most 64, each key and value at most 253 bytes".into());
    }
    for (f, v) in [
        ("leaf", &spec.leaf),
        ("spine", &spec.spine),
        ("address", &spec.address),
    ] {
        if v.len() > MAX_NODE_NAME {
            return bad(format!("{f}: at most {MAX_NODE_NAME} bytes"));
        }
    }
    // Shown in `gangway nodes` and `describe`: no control characters.
    let shown = spec
        .labels
        .iter()
        .flat_map(|(k, v)| [("labels", k), ("labels", v)])
        .chain([
            ("leaf", &spec.leaf),
            ("spine", &spec.spine),
            ("address", &spec.address),
        ])
        .chain(spec.gpus.iter().map(|g| ("gpus.model", &g.model)));
    for (f, v) in shown {
        gangway_core::text::check_printable(f, v).map_err(ControlError::BadNode)?;
    }
    if spec.gpus.iter().any(|g| g.model.len() > MAX_NODE_NAME) {
        return bad("gpus.model: at most 253 bytes".into());
    }
    if let Some(url) = &spec.agent_url {
        check_agent_url(url, &spec.address)?;
    }
    Ok(())
}

/// Rule: the agent URL is `http://HOST:PORT` or `https://HOST:PORT` where
/// HOST is the node's own address: no credentials, path, query or fragment.
pub fn check_agent_url(url: &str, address: &str) -> Result<(), ControlError> {
    let bad = |why: &str| {
        Err(ControlError::BadNode(format!(
            "agent_url: {why} (got {:?})",
            url.chars().take(128).collect::<String>()
        )))
    };
    let rest = match url.split_once("://") {
        Some(("http" | "https", rest)) => rest.trim_end_matches('/'),
        _ => return bad("must start with http:// or https://"),
    };
    if rest.contains(['/', '?', '#', '@', '\\']) || rest.chars().any(char::is_whitespace) {
        return bad("must be scheme://host:port with nothing else");
    }
    let (host, port) = match rest.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()) => (h, p),
        _ => return bad("must name a port"),
    };
    if port.parse::<u16>().is_err() {
        return bad("port out of range");
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if address.is_empty() || host != address.trim_start_matches('[').trim_end_matches(']') {
        return bad(&format!(
            "must be on the node's own address {address:?}; the server contacts nodes only there"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::Control;
    use crate::control_error::encode;
    use crate::records::{node_key, token_key};
    use gangway_store::RedbStore;
    use gangway_store::Store;

    fn control() -> (tempfile::TempDir, Control<RedbStore>) {
        let dir = tempfile::tempdir().expect("tmp");
        let store = RedbStore::open(&dir.path().join("s.redb")).expect("store");
        let c = Control::open(store, &[gangway_core::QueueSpec::unlimited("q", None)])
            .expect("control");
        (dir, c)
    }

    #[test]
    fn a_stall_of_the_server_is_not_counted_against_nodes() {
        let (_d, mut c) = control();
        let mut spec = NodeSpec::uniform("n", "l", "s", 1, "H100", 80);
        spec.address = "127.0.0.1".into();
        c.register_node(spec, &Registrant::Join, true, "join", 1000)
            .expect("register");
        c.cycle(1000).expect("cycle");
        // The server itself was stuck for 100 s: the node is not lost.
        c.cycle(1100).expect("cycle");
        assert!(c.nodes.lost.is_empty(), "{:?}", c.nodes.lost);
        assert!(c.cluster.nodes()[0].ready);
        // Real silence, with the loop running, still counts.
        for t in 1101..1140 {
            c.cycle(t).expect("cycle");
        }
        assert!(c.nodes.lost.contains("n"));
    }

    #[test]
    fn control_characters_in_what_a_node_registers_are_refused() {
        let ok = NodeSpec::uniform("n", "l", "s", 1, "H100", 80);
        check_node_spec(&ok).expect("plain");
        let mut s = ok.clone();
        s.labels.insert("zone".into(), "a\x1b[2J".into());
        let e = check_node_spec(&s).expect_err("label").to_string();
        assert!(
            e.contains("labels: control character U+001B is not allowed"),
            "{e}"
        );
        let mut s = ok.clone();
        s.leaf = "leaf\n0".into();
        let e = check_node_spec(&s).expect_err("leaf").to_string();
        assert!(e.contains("leaf: control character U+000A"), "{e}");
        let mut s = ok;
        s.gpus[0].model = "H100\u{202e}".into();
        let e = check_node_spec(&s).expect_err("model").to_string();
        assert!(e.contains("gpus.model: control character U+202E"), "{e}");
        let mut s = NodeSpec::uniform("n\x1b", "l", "s", 1, "H100", 80);
        s.address.clear();
        assert!(check_node_spec(&s).is_err());
    }

    #[test]
    fn agent_urls_must_be_plain_and_on_the_nodes_own_address() {
        assert!(check_agent_url("http://10.0.0.1:8080", "10.0.0.1").is_ok());
        assert!(check_agent_url("https://[::1]:8080/", "::1").is_ok());
        for bad in [
            "http://10.0.0.2:8080",
            "http://10.0.0.1",
            "http://10.0.0.1:8080/x",
            "http://user@10.0.0.1:8080",
            "file://10.0.0.1:1",
            "http://10.0.0.1:99999",
            "http://10.0.0.1:80?x",
        ] {
            assert!(check_agent_url(bad, "10.0.0.1").is_err(), "{bad}");
        }
        assert!(check_agent_url("http://10.0.0.1:1", "").is_err());
    }

    #[test]
    fn a_store_from_before_hashing_is_migrated_on_open() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("s.redb");
        {
            let store = RedbStore::open(&path).expect("store");
            let spec = NodeSpec::uniform("old", "l", "s", 1, "H100", 80);
            store.put(&node_key("old"), &encode(&spec)).expect("node");
            store
                .put(&token_key("old"), b"\"plain-old-token\"")
                .expect("token");
        }
        let store = RedbStore::open(&path).expect("store");
        let c = Control::open(store, &[gangway_core::QueueSpec::unlimited("q", None)])
            .expect("control");
        assert_eq!(c.node_of_token(&hash_token("plain-old-token")), Some("old"));
        let kv = c
            .store
            .get(&token_key("old"))
            .expect("get")
            .expect("present");
        let text = String::from_utf8_lossy(&kv.value).to_string();
        assert!(!text.contains("plain-old-token"), "{text}");
        assert!(text.contains("token_sha256"), "{text}");
    }

    #[test]
    fn legacy_plain_tokens_are_read_as_digests() {
        let c = NodeCredential::decode("k", b"\"abc\"").expect("legacy");
        assert_eq!(c.digest(), hash_token("abc"));
        let fresh = NodeCredential::new("t");
        let back = NodeCredential::decode("k", &serde_json::to_vec(&fresh).expect("json"))
            .expect("decode");
        assert_eq!(back, fresh);
    }
}
