//! Node-side admission: who a job's ranks run as, and whether its run spec
//! keeps to its queue's node policy (mounts, loader variables, working
//! directory, root). Checked at submission, with the field named in the
//! refusal; the same rules travel to the agent in each assignment
//! ([`stamp`]), which checks them again on the node.

use crate::config::ServerConfig;
use gangway_core::agent::{Assignment, RankRules};
use gangway_core::node_policy::{check_run, PolicyError};
use gangway_core::{JobSpec, NodePolicy};

/// The Unix account the ranks of `owner`'s jobs run as: the user's
/// `unix_user`, else the user's name; owners that are not configured users
/// (the admin's jobs) get `default_unix_user`.
pub fn run_as(cfg: &ServerConfig, owner: &str) -> String {
    cfg.account_of(owner)
}

/// The node policy of a queue (the restricted default for unknown queues,
/// which the scheduler rejects anyway).
pub fn queue_policy(cfg: &ServerConfig, queue: &str) -> NodePolicy {
    cfg.queues
        .iter()
        .find(|q| q.name == queue)
        .map(|q| q.node.clone())
        .unwrap_or_default()
}

/// Checks a submitted spec (its `user` already set to the owner) against its
/// queue's node policy. Root is judged by account name here (`root`); the
/// agent judges it by uid.
pub fn admit(cfg: &ServerConfig, spec: &JobSpec) -> Result<(), PolicyError> {
    let policy = queue_policy(cfg, &spec.queue);
    check_run(&spec.run, &policy, &spec.queue)?;
    let account = run_as(cfg, &spec.user);
    if !policy.allow_root && (account == "root" || account == "0") {
        return Err(PolicyError::Root {
            account,
            queue: spec.queue.clone(),
        });
    }
    Ok(())
}

/// The queues a submitter may use: a plain user's own (`Some`), or every
/// configured queue for an admin (`None`).
fn usable<'a>(cfg: &'a ServerConfig, allowed: Option<&'a [String]>) -> Vec<&'a str> {
    match allowed {
        Some(qs) => qs.iter().map(String::as_str).collect(),
        None => cfg.queues.iter().map(|q| q.name.as_str()).collect(),
    }
}

/// What to tell a submitter whose queue is missing or wrong: the queues they
/// may use, or where queues are configured when there are none.
pub fn queue_hint(cfg: &ServerConfig, allowed: Option<&[String]>) -> String {
    let qs = usable(cfg, allowed);
    if qs.is_empty() {
        if cfg.queues.is_empty() {
            "this cluster has no queues: name them in the server's config \
             (`gangway up --config FILE` or `gangway server --config FILE`)"
                .into()
        } else {
            "you may submit to no queue; ask an admin to add one to your user".into()
        }
    } else {
        format!("you may submit to: {}", qs.join(", "))
    }
}

/// The queue of a spec that names none: the queue marked `default: true`
/// when the submitter may use it, else the only queue they may use.
pub fn default_queue(cfg: &ServerConfig, allowed: Option<&[String]>) -> Result<String, String> {
    let qs = usable(cfg, allowed);
    if let Some(d) = cfg
        .queues
        .iter()
        .find(|q| q.default && qs.contains(&q.name.as_str()))
    {
        return Ok(d.name.clone());
    }
    match qs.as_slice() {
        [only] => Ok((*only).to_string()),
        _ => Err(format!(
            "queue: missing, and there is no default queue; {}",
            queue_hint(cfg, allowed)
        )),
    }
}

/// Fills each assignment's [`RankRules`] (whose `queue` the control state
/// set): the account and the queue's policy.
pub fn stamp(cfg: &ServerConfig, assignments: &mut [Assignment]) {
    for a in assignments {
        let queue = std::mem::take(&mut a.rules.queue);
        a.rules = RankRules {
            run_as: Some(run_as(cfg, &a.user)),
            policy: queue_policy(cfg, &queue),
            queue,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ServerConfig {
        ServerConfig::from_yaml(
            "admin_token: admin-token-1\nagent_token: agent-token-1\nusers:\n  - name: alice\n    token: alice-token-1\n    queues: [research]\n    unix_user: asmith\n  - name: bob\n    token: bob-token-11\n    queues: [research, ops]\n  - name: carol\n    token: carol-token-1\n    queues: [ops]\n    unix_user: root\nqueues:\n  - name: research\n    node:\n      mounts: { allowed: [/datasets], read_write: [/scratch] }\n  - name: ops\n    node: { allow_root: true }\n",
        )
        .expect("config")
    }

    #[test]
    fn accounts_come_from_the_user_config() {
        let c = cfg();
        assert_eq!(run_as(&c, "alice"), "asmith");
        assert_eq!(run_as(&c, "bob"), "bob");
        assert_eq!(run_as(&c, "admin"), "nobody");
    }

    #[test]
    fn root_and_unlisted_mounts_are_refused_with_the_field_named() {
        let c = cfg();
        let mut s = JobSpec::new("j", "research", 1, 1);
        s.user = "alice".into();
        assert_eq!(admit(&c, &s), Ok(()));
        s.run.mounts.push(gangway_core::Mount {
            source: "/etc".into(),
            target: "/x".into(),
            read_only: true,
        });
        let e = admit(&c, &s).expect_err("/etc");
        assert!(e.to_string().starts_with("run.mounts[0].source"), "{e}");
        s.run.mounts.clear();
        s.user = "carol".into();
        let e = admit(&c, &s).expect_err("root in research");
        assert!(e.to_string().contains("allow_root"), "{e}");
        s.queue = "ops".into();
        assert_eq!(admit(&c, &s), Ok(()));
    }
}
