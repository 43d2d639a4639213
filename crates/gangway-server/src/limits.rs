//! What one user may ask of the control plane: the size and range of every
//! field of a job spec, the queue's priority and preemption rules, and a
//! request rate (token bucket). Each check names the field or the rule.

use crate::authz::Principal;
use crate::config::{ServerConfig, UserLimits};
use gangway_core::{JobSpec, QueueSpec};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

/// Longest name (job, queue, user, GPU model, signal, image).
pub const MAX_NAME: usize = 253;
/// Longest container image reference.
pub const MAX_IMAGE: usize = 1024;
/// Longest path (workdir, mount source and target).
pub const MAX_PATH: usize = 4096;
/// Most program arguments.
pub const MAX_ARGS: usize = 4096;
/// Longest single argument.
pub const MAX_ARG: usize = 64 * 1024;
/// Most bytes of all arguments together.
pub const MAX_ARGS_TOTAL: usize = 256 * 1024;
/// Most environment variables.
pub const MAX_ENV: usize = 1024;
/// Longest environment variable name.
pub const MAX_ENV_KEY: usize = 256;
/// Longest environment variable value.
pub const MAX_ENV_VALUE: usize = 64 * 1024;
/// Most bytes of all environment variables together.
pub const MAX_ENV_TOTAL: usize = 256 * 1024;
/// Most mounts.
pub const MAX_MOUNTS: usize = 64;
/// Most replicas in one gang.
pub const MAX_REPLICAS: u32 = 65_536;
/// Most GPUs one replica may ask for (a node's GPUs are a 64-bit mask).
pub const MAX_GPUS_PER_REPLICA: u32 = 64;
/// Largest CPU (millicores) or memory (MiB) request per replica.
pub const MAX_RESOURCE: u64 = 1 << 40;
/// Longest restart backoff: one day.
pub const MAX_BACKOFF_SECONDS: u64 = 86_400;
/// Most restarts.
pub const MAX_RESTARTS: u32 = 1_000;
/// Longest declared runtime or checkpoint interval: ten years.
pub const MAX_DURATION_SECONDS: u64 = 10 * 365 * 86_400;

/// A spec or request that breaks a limit: the field and the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// A field is too long, too big or out of range (400).
    #[error("{field}: {rule}")]
    Field {
        /// The field, as in the spec (`run.env.KEY`, `checkpoint.grace_seconds`).
        field: String,
        /// What it must be.
        rule: String,
    },
    /// The queue or cluster policy does not allow it (403).
    #[error("{field}: {rule}")]
    Policy {
        /// The field.
        field: String,
        /// The rule that refuses it.
        rule: String,
    },
    /// Too many requests (429).
    #[error(
        "too many requests from {who}: at most {rate}/s (burst {burst}); retry in {retry_after}s"
    )]
    Rate {
        /// Who.
        who: String,
        /// Sustained rate.
        rate: u32,
        /// Bucket size.
        burst: u32,
        /// Seconds until a request fits again.
        retry_after: u64,
    },
}

fn field(field: impl Into<String>, rule: impl Into<String>) -> LimitError {
    LimitError::Field {
        field: field.into(),
        rule: rule.into(),
    }
}

fn policy(f: impl Into<String>, rule: impl Into<String>) -> LimitError {
    LimitError::Policy {
        field: f.into(),
        rule: rule.into(),
    }
}

fn max_len(name: &str, value: &str, max: usize) -> Result<(), LimitError> {
    if value.len() > max {
        return Err(field(
            name,
            format!("at most {max} bytes (got {})", value.len()),
        ));
    }
    if value.contains('\0') {
        return Err(field(name, "must not contain NUL bytes"));
    }
    Ok(())
}

fn at_most(name: &str, value: u64, max: u64) -> Result<(), LimitError> {
    if value > max {
        return Err(field(name, format!("at most {max} (got {value})")));
    }
    Ok(())
}

/// Rule: every string and list of a spec has a bounded size and every integer
/// a bounded range, whoever submits it. `max_grace` is the cluster's
/// `max_grace_seconds`.
pub fn check_sizes(spec: &JobSpec, max_grace: u64) -> Result<(), LimitError> {
    max_len("name", &spec.name, MAX_NAME)?;
    max_len("queue", &spec.queue, MAX_NAME)?;
    max_len("user", &spec.user, MAX_NAME)?;
    at_most(
        "replicas",
        u64::from(spec.replicas),
        u64::from(MAX_REPLICAS),
    )?;
    if let Some(m) = spec.min_replicas {
        at_most("min_replicas", u64::from(m), u64::from(spec.replicas))?;
    }
    let r = &spec.resources;
    at_most(
        "resources.gpus",
        u64::from(r.gpus),
        u64::from(MAX_GPUS_PER_REPLICA),
    )?;
    if let Some(m) = &r.gpu_model {
        max_len("resources.gpu_model", m, MAX_NAME)?;
    }
    at_most("resources.cpu_millis", r.cpu_millis, MAX_RESOURCE)?;
    at_most("resources.memory_mib", r.memory_mib, MAX_RESOURCE)?;
    let c = &spec.checkpoint;
    at_most("checkpoint.grace_seconds", c.grace_seconds, max_grace)?;
    if let Some(i) = c.interval_seconds {
        at_most("checkpoint.interval_seconds", i, MAX_DURATION_SECONDS)?;
    }
    max_len("checkpoint.signal", &c.signal, MAX_NAME)?;
    at_most(
        "restart.backoff_seconds",
        spec.restart.backoff_seconds,
        MAX_BACKOFF_SECONDS,
    )?;
    at_most(
        "restart.max_restarts",
        u64::from(spec.restart.max_restarts),
        u64::from(MAX_RESTARTS),
    )?;
    if let Some(t) = spec.runtime_seconds {
        at_most("runtime_seconds", t, MAX_DURATION_SECONDS)?;
    }
    let run = &spec.run;
    if run.command.len() > MAX_ARGS {
        return Err(field(
            "run.command",
            format!("at most {MAX_ARGS} items (got {})", run.command.len()),
        ));
    }
    let mut total = 0usize;
    for (i, a) in run.command.iter().enumerate() {
        max_len(&format!("run.command[{i}]"), a, MAX_ARG)?;
        total = total.saturating_add(a.len());
    }
    if total > MAX_ARGS_TOTAL {
        return Err(field(
            "run.command",
            format!("at most {MAX_ARGS_TOTAL} bytes in all (got {total})"),
        ));
    }
    if let Some(i) = &run.image {
        max_len("run.image", i, MAX_IMAGE)?;
    }
    if let Some(w) = &run.workdir {
        max_len("run.workdir", w, MAX_PATH)?;
    }
    if run.env.len() > MAX_ENV {
        return Err(field(
            "run.env",
            format!("at most {MAX_ENV} variables (got {})", run.env.len()),
        ));
    }
    let mut total = 0usize;
    for (k, v) in &run.env {
        let shown: String = k.chars().take(64).collect();
        max_len(&format!("run.env key {shown:?}"), k, MAX_ENV_KEY)?;
        if k.is_empty() || k.contains('=') {
            return Err(field(
                format!("run.env key {shown:?}"),
                "must be non-empty and contain no '='",
            ));
        }
        max_len(&format!("run.env.{shown}"), v, MAX_ENV_VALUE)?;
        total = total.saturating_add(k.len()).saturating_add(v.len());
    }
    if total > MAX_ENV_TOTAL {
        return Err(field(
            "run.env",
            format!("at most {MAX_ENV_TOTAL} bytes in all (got {total})"),
        ));
    }
    if run.mounts.len() > MAX_MOUNTS {
        return Err(field(
            "run.mounts",
            format!("at most {MAX_MOUNTS} mounts (got {})", run.mounts.len()),
        ));
    }
    for (i, m) in run.mounts.iter().enumerate() {
        max_len(&format!("run.mounts[{i}].source"), &m.source, MAX_PATH)?;
        max_len(&format!("run.mounts[{i}].target"), &m.target, MAX_PATH)?;
    }
    Ok(())
}

/// Rule: a plain user's job asks for at most their GPUs-per-job limit
/// (computed with checked arithmetic: replicas × GPUs per replica).
pub fn check_gpus_per_job(spec: &JobSpec, limits: &UserLimits) -> Result<(), LimitError> {
    let total = u64::from(spec.replicas)
        .checked_mul(u64::from(spec.resources.gpus))
        .ok_or_else(|| field("replicas", "replicas × resources.gpus overflows"))?;
    if total > limits.max_gpus_per_job {
        return Err(policy(
            "resources.gpus",
            format!(
                "the job asks for {total} GPUs; your limit is {} per job",
                limits.max_gpus_per_job
            ),
        ));
    }
    Ok(())
}

/// Rule: a plain user submits only the queue's allowed priority classes
/// (by default every class but `critical`).
pub fn check_priority(spec: &JobSpec, queue: &QueueSpec) -> Result<(), LimitError> {
    if !queue.allows_priority(spec.priority) {
        return Err(policy(
            "priority",
            format!(
                "class {} is not allowed in queue {} (ask an admin)",
                spec.priority, queue.name
            ),
        ));
    }
    Ok(())
}

/// Rule: a plain user's job must be preemptible unless the queue says
/// `allow_non_preemptible: true`.
pub fn check_preemptible(spec: &JobSpec, queue: &QueueSpec) -> Result<(), LimitError> {
    let preemptible = spec
        .preemptible
        .unwrap_or_else(|| spec.priority.preemptible_by_default());
    if !preemptible && !queue.allow_non_preemptible {
        let why = if spec.preemptible == Some(false) {
            "preemptible: false".to_string()
        } else {
            format!("class {} is not preemptible by default", spec.priority)
        };
        return Err(policy(
            "preemptible",
            format!(
                "{why}, and queue {} does not allow jobs that cannot be preempted (set preemptible: true)",
                queue.name
            ),
        ));
    }
    Ok(())
}

/// Every submission rule for `spec` from `p` (the queue's existence and the
/// user's right to it are checked by the caller).
pub fn check_submission(
    cfg: &ServerConfig,
    p: &Principal,
    spec: &JobSpec,
) -> Result<(), LimitError> {
    check_sizes(spec, cfg.max_grace_seconds)?;
    if let Principal::User { name, .. } = p {
        check_gpus_per_job(spec, &cfg.limits_of(name))?;
        if let Some(q) = cfg.queues.iter().find(|q| q.name == spec.queue) {
            check_priority(spec, q)?;
            check_preemptible(spec, q)?;
        }
    }
    Ok(())
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Per-principal token buckets: a burst is allowed, the sustained rate is not exceeded.
#[derive(Default)]
pub struct RateLimiter {
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl RateLimiter {
    /// Takes one request from `who`'s bucket, or says how long to wait.
    pub fn take(&self, who: &str, limits: &UserLimits, now: Instant) -> Result<(), LimitError> {
        let rate = f64::from(limits.requests_per_second.max(1));
        let burst = f64::from(limits.burst.max(1));
        let Ok(mut b) = self.buckets.lock() else {
            return Ok(());
        };
        let e = b.entry(who.to_string()).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        let elapsed = now.saturating_duration_since(e.at).as_secs_f64();
        e.tokens = (e.tokens + elapsed * rate).min(burst);
        e.at = now;
        if e.tokens >= 1.0 {
            e.tokens -= 1.0;
            return Ok(());
        }
        let retry_after = ((1.0 - e.tokens) / rate).ceil().max(1.0) as u64;
        Err(LimitError::Rate {
            who: who.to_string(),
            rate: limits.requests_per_second,
            burst: limits.burst,
            retry_after,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::PriorityClass;
    use std::time::Duration;

    #[test]
    fn integers_past_their_range_are_refused_with_the_field_named() {
        let mut s = JobSpec::new("j", "q", 1, 1);
        s.checkpoint.grace_seconds = u64::MAX;
        let e = check_sizes(&s, 600).expect_err("grace");
        assert!(
            e.to_string().starts_with("checkpoint.grace_seconds:"),
            "{e}"
        );
        let mut s = JobSpec::new("j", "q", 1, 1);
        s.restart.backoff_seconds = u64::MAX;
        let e = check_sizes(&s, 600).expect_err("backoff");
        assert!(e.to_string().starts_with("restart.backoff_seconds:"), "{e}");
        let mut s = JobSpec::new("j", "q", u32::MAX, 1);
        s.min_replicas = None;
        assert!(check_sizes(&s, 600)
            .expect_err("replicas")
            .to_string()
            .starts_with("replicas:"));
        let s = JobSpec::new("j", "q", 4096, 64);
        let l = UserLimits {
            max_gpus_per_job: 8,
            ..UserLimits::default()
        };
        assert!(check_gpus_per_job(&s, &l)
            .expect_err("gpus")
            .to_string()
            .contains("asks for 262144 GPUs"));
    }

    #[test]
    fn long_strings_and_lists_are_refused() {
        let mut s = JobSpec::new(&"n".repeat(300), "q", 1, 1);
        assert!(check_sizes(&s, 600)
            .expect_err("name")
            .to_string()
            .starts_with("name:"));
        s.name = "ok".into();
        s.run.env.insert("K".into(), "v".repeat(MAX_ENV_VALUE + 1));
        assert!(check_sizes(&s, 600)
            .expect_err("env")
            .to_string()
            .starts_with("run.env.K:"));
        s.run.env.clear();
        s.run.command = vec!["x".into(); MAX_ARGS + 1];
        assert!(check_sizes(&s, 600)
            .expect_err("args")
            .to_string()
            .starts_with("run.command:"));
    }

    #[test]
    fn queues_decide_priority_classes_and_preemptibility() {
        let mut q = QueueSpec::unlimited("q", None);
        let mut s = JobSpec::new("j", "q", 1, 1);
        s.priority = PriorityClass::Critical;
        assert!(check_priority(&s, &q).is_err());
        s.priority = PriorityClass::Low;
        s.preemptible = Some(false);
        assert!(check_priority(&s, &q).is_ok());
        assert!(check_preemptible(&s, &q).is_err());
        q.allow_non_preemptible = true;
        assert!(check_preemptible(&s, &q).is_ok());
        q.allowed_priorities = vec![PriorityClass::Critical];
        s.priority = PriorityClass::Critical;
        assert!(check_priority(&s, &q).is_ok());
    }

    #[test]
    fn a_bucket_allows_a_burst_then_the_rate() {
        let r = RateLimiter::default();
        let l = UserLimits {
            requests_per_second: 10,
            burst: 3,
            ..UserLimits::default()
        };
        let t = Instant::now();
        for _ in 0..3 {
            r.take("u", &l, t).expect("burst");
        }
        assert!(r.take("u", &l, t).is_err());
        r.take("other", &l, t).expect("buckets are per principal");
        r.take("u", &l, t + Duration::from_millis(150))
            .expect("refilled at 10/s");
    }
}
