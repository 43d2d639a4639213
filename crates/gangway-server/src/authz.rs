//! Who a bearer token belongs to, and the rules of who may do what.
//!
//! Tokens are compared as SHA-256 digests in constant time, so neither the
//! comparison's duration nor the stored form (node tokens are kept hashed)
//! gives a token away. Each rule is one small function named after it, in the
//! spirit of Kubernetes' admission plugins; every refusal has a test.

use sha2::{Digest, Sha256};

/// The SHA-256 digest of a token: the only form in which node tokens are stored.
pub type TokenHash = [u8; 32];

/// The digest of `token`.
pub fn hash_token(token: &str) -> TokenHash {
    Sha256::digest(token.as_bytes()).into()
}

/// Lower-case hex of bytes.
pub fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Bytes of lower- or upper-case hex, `None` when it is not 64 hex digits.
pub fn hash_from_hex(s: &str) -> Option<TokenHash> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Whether two digests are equal, in time independent of where they differ.
pub fn ct_eq(a: &TokenHash, b: &TokenHash) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b.iter()) {
        diff |= x ^ y;
    }
    diff == 0
}

/// Who is calling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Principal {
    /// The admin token.
    Admin,
    /// A user token.
    User {
        /// Name.
        name: String,
        /// Queues they may use.
        queues: Vec<String>,
    },
    /// The agents' join token: may register new nodes and nothing else.
    Agent,
    /// A node's own token: may act for that node only.
    Node(String),
    /// The metrics token: may read `/metrics` only.
    Metrics,
}

impl Principal {
    /// The name the audit log and job events use (`admin`, `agent`,
    /// `metrics`, `node:NAME`, or the user's name).
    pub fn name(&self) -> String {
        match self {
            Principal::Admin => "admin".into(),
            Principal::User { name, .. } => name.clone(),
            Principal::Agent => "agent".into(),
            Principal::Node(n) => format!("node:{n}"),
            Principal::Metrics => "metrics".into(),
        }
    }

    /// Whether this is the admin.
    pub fn is_admin(&self) -> bool {
        *self == Principal::Admin
    }
}

/// The tokens of the configuration (admin, join, metrics, users) as digests.
#[derive(Clone, Debug, Default)]
pub struct ConfigTokens {
    entries: Vec<(TokenHash, Principal)>,
}

impl ConfigTokens {
    /// Digests of every token in `cfg`.
    pub fn new(cfg: &crate::ServerConfig) -> Self {
        let mut entries = vec![
            (hash_token(&cfg.admin_token), Principal::Admin),
            (hash_token(&cfg.agent_token), Principal::Agent),
        ];
        if let Some(t) = &cfg.metrics_token {
            entries.push((hash_token(t), Principal::Metrics));
        }
        for u in &cfg.users {
            entries.push((
                hash_token(&u.token),
                Principal::User {
                    name: u.name.clone(),
                    queues: u.queues.clone(),
                },
            ));
        }
        ConfigTokens { entries }
    }

    /// The principal whose token has digest `h`: every entry is compared,
    /// whichever matches, so the time taken says nothing about which.
    pub fn find(&self, h: &TokenHash) -> Option<Principal> {
        let mut found = None;
        for (e, p) in &self.entries {
            if ct_eq(e, h) && found.is_none() {
                found = Some(p.clone());
            }
        }
        found
    }
}

/// What a principal may see of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobAccess {
    /// Everything: the owner and admins.
    Full,
    /// The spec with environment values redacted, no logs: other users.
    Redacted,
}

/// Rule: a job's environment values and logs are its owner's and the admins'.
/// Other users see the job with env values redacted; tokens that are not a
/// person's (join, node, metrics) see nothing of jobs (`None`).
pub fn job_access(p: &Principal, owner: &str) -> Option<JobAccess> {
    match p {
        Principal::Admin => Some(JobAccess::Full),
        Principal::User { name, .. } if name == owner => Some(JobAccess::Full),
        Principal::User { .. } => Some(JobAccess::Redacted),
        Principal::Agent | Principal::Node(_) | Principal::Metrics => None,
    }
}

/// The value shown in place of a redacted environment value.
pub const REDACTED: &str = "<redacted>";

/// Rule: only people (admins and users) read the cluster's jobs, queues,
/// nodes and usage.
pub fn is_person(p: &Principal) -> bool {
    matches!(p, Principal::Admin | Principal::User { .. })
}

/// A random 256-bit token in hex (node tokens; `gangway up`'s tokens).
pub fn fresh_token() -> String {
    use std::io::Read;
    let mut b = [0u8; 32];
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok();
    if !ok {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let x = (t ^ u128::from(std::process::id())).to_le_bytes();
        b[..16].copy_from_slice(&x);
        b[16..].copy_from_slice(&x);
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_compare_equal_only_when_equal_and_hex_round_trips() {
        let a = hash_token("alpha-token");
        assert!(ct_eq(&a, &hash_token("alpha-token")));
        assert!(!ct_eq(&a, &hash_token("alpha-tokeN")));
        assert_eq!(hash_from_hex(&to_hex(&a)), Some(a));
        assert_eq!(hash_from_hex("zz"), None);
        assert_eq!(hash_from_hex(&"é".repeat(32)), None);
    }

    #[test]
    fn only_owners_and_admins_see_everything_and_machines_see_nothing() {
        let alice = Principal::User {
            name: "alice".into(),
            queues: vec![],
        };
        assert_eq!(job_access(&alice, "alice"), Some(JobAccess::Full));
        assert_eq!(job_access(&alice, "bob"), Some(JobAccess::Redacted));
        assert_eq!(job_access(&Principal::Admin, "bob"), Some(JobAccess::Full));
        assert_eq!(job_access(&Principal::Agent, "bob"), None);
        assert_eq!(job_access(&Principal::Node("n".into()), "bob"), None);
        assert_eq!(job_access(&Principal::Metrics, "bob"), None);
    }
}
