//! The server's configuration file (YAML): tokens, queues and scheduler knobs.
//!
//! ```yaml
//! admin_token: s3cret-admin
//! agent_token: s3cret-join
//! users:
//!   - name: alice
//!     token: alice-token
//!     queues: [research]
//! queues:
//!   - name: lab
//!     quota: { nominal: { gpus: 64 } }
//!   - name: research
//!     parent: lab
//!     quota: { nominal: { gpus: 32 } }
//! ```

use crate::control::NodeLifecycle;
use gangway_core::QueueSpec;
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A user and the queues they may submit to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    /// User name (jobs are owned by it).
    pub name: String,
    /// Bearer token.
    pub token: String,
    /// Queues the user may submit to.
    #[serde(default)]
    pub queues: Vec<String>,
}

/// The whole configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Admin bearer token: may do anything.
    pub admin_token: String,
    /// Token agents join with.
    pub agent_token: String,
    /// Users.
    #[serde(default)]
    pub users: Vec<UserConfig>,
    /// Queues (parents first).
    #[serde(default)]
    pub queues: Vec<QueueSpec>,
    /// Seconds between scheduling cycles when nothing changes.
    #[serde(default = "one")]
    pub cycle_seconds: u64,
    /// Seconds without a heartbeat before a node is NotReady (no new work).
    #[serde(default = "ten")]
    pub node_not_ready_seconds: u64,
    /// Seconds without a heartbeat before a node's gangs are treated as lost
    /// and restarted elsewhere.
    #[serde(default = "thirty")]
    pub node_lost_seconds: u64,
    /// Different jobs failing in a row on one node before it is cordoned (0: never).
    #[serde(default = "three")]
    pub auto_cordon_failures: u32,
    /// Cluster-wide checkpoint root (shared storage every node mounts at
    /// this path); jobs checkpoint under `<root>/<user>/<dir>`. Absent: each
    /// agent's `--checkpoint-root` (fine for one machine, not across nodes).
    #[serde(default)]
    pub checkpoint_root: Option<String>,
    /// Rendezvous ports (`MASTER_PORT`), outside the ephemeral range.
    #[serde(default)]
    pub master_ports: gangway_core::agent::PortRange,
}

fn one() -> u64 {
    1
}

fn ten() -> u64 {
    10
}

fn thirty() -> u64 {
    30
}

fn three() -> u32 {
    3
}

/// A configuration that cannot be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// YAML.
    #[error("config: {0}")]
    Yaml(#[from] serde_yaml::Error),
    /// Semantics.
    #[error("config: {0}")]
    Invalid(String),
}

impl ServerConfig {
    /// The node lifecycle knobs.
    pub fn lifecycle(&self) -> NodeLifecycle {
        NodeLifecycle {
            node_not_ready_seconds: self.node_not_ready_seconds,
            node_lost_seconds: self.node_lost_seconds,
            auto_cordon_failures: self.auto_cordon_failures,
        }
    }

    /// The job-contract knobs.
    pub fn contract(&self) -> crate::control::ContractConfig {
        crate::control::ContractConfig {
            checkpoint_root: self.checkpoint_root.clone(),
            master_ports: self.master_ports,
        }
    }

    /// Parses and checks a YAML configuration.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        let c: ServerConfig = serde_yaml::from_str(text)?;
        if c.admin_token.len() < 8 || c.agent_token.len() < 8 {
            return Err(ConfigError::Invalid(
                "tokens must be at least 8 characters".into(),
            ));
        }
        if c.node_lost_seconds < c.node_not_ready_seconds {
            return Err(ConfigError::Invalid(
                "node_lost_seconds must not be less than node_not_ready_seconds".into(),
            ));
        }
        if c.master_ports.is_empty() || c.master_ports.first < 1024 {
            return Err(ConfigError::Invalid(
                "master_ports: first must be at least 1024 and not above last".into(),
            ));
        }
        for q in &c.queues {
            for (what, t) in [
                ("default", &q.time_limit.default),
                ("max", &q.time_limit.max),
            ] {
                if let Some(t) = t {
                    let secs = t.seconds().map_err(|e| {
                        ConfigError::Invalid(format!("queue {}: time_limit.{what}: {e}", q.name))
                    })?;
                    if secs == 0 || secs > gangway_core::job::MAX_TIME_LIMIT_SECONDS {
                        return Err(ConfigError::Invalid(format!(
                            "queue {}: time_limit.{what}: must be between 1 second and 366 days",
                            q.name
                        )));
                    }
                }
            }
        }
        if let Some(root) = &c.checkpoint_root {
            if !root.starts_with('/') {
                return Err(ConfigError::Invalid(
                    "checkpoint_root: must be an absolute path".into(),
                ));
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for t in std::iter::once(&c.admin_token)
            .chain(std::iter::once(&c.agent_token))
            .chain(c.users.iter().map(|u| &u.token))
        {
            if !seen.insert(t) {
                return Err(ConfigError::Invalid("tokens must be distinct".into()));
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "admin_token: admin-secret\nagent_token: agent-secret\n";

    #[test]
    fn contract_settings_are_checked() {
        let ok = format!(
            "{BASE}checkpoint_root: /shared/ck\nmaster_ports: {{ first: 29400, last: 29500 }}\nqueues:\n  - name: q\n    time_limit: {{ default: \"1h\", max: 86400 }}\n"
        );
        let c = ServerConfig::from_yaml(&ok).expect("valid");
        assert_eq!(c.master_ports.last, 29_500);
        assert_eq!(
            c.queues[0].time_limit.max,
            Some(gangway_core::TimeSpan::Seconds(86_400))
        );
        let defaults = ServerConfig::from_yaml(BASE).expect("valid");
        assert_eq!(
            defaults.master_ports,
            gangway_core::agent::PortRange::default()
        );
        assert_eq!(defaults.checkpoint_root, None);
        for (bad, why) in [
            ("checkpoint_root: relative/path\n", "checkpoint_root"),
            (
                "master_ports: { first: 30000, last: 29999 }\n",
                "master_ports",
            ),
            ("master_ports: { first: 80, last: 90 }\n", "master_ports"),
            (
                "queues:\n  - name: q\n    time_limit: { max: soon }\n",
                "queue q: time_limit.max",
            ),
            (
                "queues:\n  - name: q\n    time_limit: { default: 0 }\n",
                "queue q: time_limit.default",
            ),
        ] {
            let e = ServerConfig::from_yaml(&format!("{BASE}{bad}")).expect_err(bad);
            assert!(e.to_string().contains(why), "{bad}: {e}");
        }
    }
}
