//! Why a job waits, as data (for the API and dashboard) and as a sentence (for people).

use crate::capacity::NodeIdx;
use crate::placement::{FitFailure, Shortage};
use crate::quota::{QuotaBlock, QuotaLimit};
use crate::state::ClusterState;
use gangway_core::{JobId, ReasonCode, Resource, Time};
use serde::Serialize;

/// The reason a job was left pending this cycle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WaitReason {
    /// Its queue's quota does not admit it.
    Quota(QuotaBlock),
    /// Not enough free GPUs in the shape it needs.
    NoFit(FitFailure),
    /// It holds a backfill reservation and starts when running jobs end.
    Reserved {
        /// Estimated start.
        start_at: Time,
        /// Nodes set aside.
        nodes: u32,
    },
    /// No free GPUs in its shape now; the plan has it start when running jobs
    /// (and the jobs planned before it) end. Later jobs may still backfill
    /// ahead of it: it holds no reservation.
    Planned {
        /// Estimated start.
        start_at: Time,
        /// Nodes planned.
        nodes: u32,
    },
    /// It would fit, but only on GPUs reserved for jobs ahead of it.
    BehindReservation {
        /// The gang holding the reservation.
        holder: JobId,
        /// When that gang is expected to start.
        start_at: Time,
    },
    /// Victims were signalled to checkpoint; it starts when they exit.
    AwaitingPreemption {
        /// Victims still running their grace period.
        victims: u32,
    },
    /// It does not fit now and the plan is full: the first `depth` jobs that
    /// wait are planned first.
    BeyondPlan {
        /// The plan's depth.
        depth: u32,
    },
    /// It does not fit even once every running job ends: the nodes it needs
    /// are cordoned, not ready, unhealthy or reserved for maintenance.
    NeverFits(FitFailure),
    /// It would fit now, but only on nodes of a maintenance window it would
    /// run into (or that is under way).
    Maintenance {
        /// The window's name.
        name: String,
        /// When the window starts.
        start_at: Time,
        /// When it ends.
        end_at: Time,
    },
    /// Strict order: a job ahead of it could not start.
    InOrder {
        /// The first job that could not start.
        behind: JobId,
    },
    /// It would fit now, but only on nodes it avoids after they failed its
    /// last attempt (a node fault); the avoidance lapses at `until`.
    Avoiding {
        /// The nodes it avoids.
        nodes: Vec<NodeIdx>,
        /// When it may run on them again.
        until: Time,
    },
    /// Victims were chosen this cycle.
    Preempting {
        /// Jobs being preempted for it.
        victims: Vec<JobId>,
        /// Longest grace period among them.
        grace_seconds: u64,
    },
}

/// A pending job's explanation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Explanation {
    /// The job.
    pub job: JobId,
    /// Why it waits.
    pub reason: WaitReason,
    /// Estimated start, where the plan or a preemption gives one.
    pub estimated_start: Option<Time>,
}

/// `n` and the noun, plural unless `n` is 1: `plural(1, "GPU")` is `1 GPU`,
/// `plural(2, "node")` is `2 nodes`.
pub fn plural(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

fn node_name(state: &ClusterState, n: NodeIdx) -> &str {
    state
        .nodes()
        .get(n as usize)
        .map_or("?", |n| n.spec.name.as_str())
}

fn queue_name(state: &ClusterState, q: u32) -> &str {
    state
        .queues()
        .get(q as usize)
        .map_or("?", |q| q.spec.name.as_str())
}

fn unit(r: Resource) -> &'static str {
    r.unit()
}

/// Millicores as CPUs: `12`, `0.5`.
fn cpus(millis: u64) -> String {
    if millis.is_multiple_of(1000) {
        (millis / 1000).to_string()
    } else {
        format!("{:.1}", millis as f64 / 1000.0)
    }
}

/// MiB as `512 MiB` or `720 GiB`.
fn mib(m: u64) -> String {
    if m >= 1024 {
        format!("{} GiB", m / 1024)
    } else {
        format!("{m} MiB")
    }
}

/// An estimate's distance from now: `90s`, `16m`, `2h05m`.
fn duration(secs: u64) -> String {
    gangway_core::format_span(secs, gangway_core::SpanForm::Estimate)
}

impl WaitReason {
    /// The stable reason code scripts match (Slurm's names where the meaning
    /// matches): free GPUs lacking is `Resources`, jobs ahead of it in order
    /// or their reservations is `Priority`, quota is `QOSGrpGRES`, nodes that
    /// are unavailable or reserved for maintenance is `ReqNodeNotAvail`,
    /// waiting on victims is `Preemption`.
    pub fn code(&self) -> ReasonCode {
        match self {
            WaitReason::Quota(_) => ReasonCode::QosGrpGres,
            WaitReason::NoFit(_) | WaitReason::Reserved { .. } | WaitReason::Planned { .. } => {
                ReasonCode::Resources
            }
            WaitReason::BehindReservation { .. }
            | WaitReason::BeyondPlan { .. }
            | WaitReason::InOrder { .. } => ReasonCode::Priority,
            WaitReason::NeverFits(_)
            | WaitReason::Maintenance { .. }
            | WaitReason::Avoiding { .. } => ReasonCode::ReqNodeNotAvail,
            WaitReason::AwaitingPreemption { .. } | WaitReason::Preempting { .. } => {
                ReasonCode::Preemption
            }
        }
    }
}

impl Explanation {
    /// The stable reason code (see [`WaitReason::code`]).
    pub fn code(&self) -> ReasonCode {
        self.reason.code()
    }

    /// A sentence a person can act on, e.g.
    /// `queue research is at quota 32/32 GPUs and cannot borrow: cohort lab has 0 idle`.
    pub fn render(&self, state: &ClusterState, now: Time) -> String {
        match &self.reason {
            WaitReason::Quota(b) => {
                let q = queue_name(state, b.queue);
                let u = unit(b.resource);
                let at = b.at.map_or("the cluster", |a| queue_name(state, a));
                match b.limit_kind {
                    QuotaLimit::NonPreemptibleNominal => format!(
                        "queue {} has {}/{} {u} of its nominal quota held by non-preemptible jobs; this job is not preemptible, so it may not borrow (needs {} more)",
                        at, b.demand, b.limit, b.request
                    ),
                    QuotaLimit::BorrowingLimit if b.at == Some(b.queue) => format!(
                        "queue {q} is at its limit {}/{} {u} (nominal + borrowing limit); the job needs {} more",
                        b.demand, b.limit, b.request
                    ),
                    _ => {
                        let kind = if b.at.is_some() { "cohort" } else { "" };
                        let holder = if kind.is_empty() {
                            at.to_string()
                        } else {
                            format!("{kind} {at}")
                        };
                        match b.queue_nominal {
                            Some(nom) if b.queue_used + b.request > nom => format!(
                                "queue {q} is at quota {}/{nom} {u} and cannot borrow: {holder} has {} idle (needs {})",
                                b.queue_used, b.idle(), b.request
                            ),
                            _ => format!(
                                "{holder} is full: {}/{} {u} used or kept for other queues; the job needs {}{}",
                                b.demand,
                                b.limit,
                                b.request,
                                if b.can_reclaim { " (reclaiming lent quota)" } else { "" }
                            ),
                        }
                    }
                }
            }
            WaitReason::NoFit(FitFailure::OneNode {
                need,
                largest_free,
                node,
                short,
            }) => match (node, short) {
                (Some(n), Some(s)) => {
                    let (what, free, needed) = match s {
                        Shortage::Cpu {
                            free_millis,
                            need_millis,
                        } => ("CPUs", cpus(*free_millis), cpus(*need_millis)),
                        Shortage::Memory { free_mib, need_mib } => {
                            ("memory", mib(*free_mib), mib(*need_mib))
                        }
                    };
                    format!(
                        "needs {} and {needed} {what} on one node; node {} has {} free but only {free} {what}",
                        plural(*need, "GPU"),
                        node_name(state, *n),
                        plural(*largest_free, "GPU")
                    )
                }
                (Some(n), None) => format!(
                    "needs {} on one node; largest free block is {largest_free} on node {}",
                    plural(*need, "GPU"),
                    node_name(state, *n)
                ),
                (None, _) => format!(
                    "needs {} on one node; no matching node has a free GPU",
                    plural(*need, "GPU")
                ),
            },
            WaitReason::NoFit(FitFailure::Spread {
                replicas,
                gpus_per_replica,
                hostable,
                one_leaf,
            }) => format!(
                "needs {} × {}{}; free GPUs can host only {hostable}",
                plural(u64::from(*replicas), "replica"),
                plural(*gpus_per_replica, "GPU"),
                if *one_leaf { " under one leaf switch" } else { "" }
            ),
            WaitReason::Reserved { start_at, nodes } => format!(
                "{} reserved, estimated start at t+{} when running jobs end",
                plural(u64::from(*nodes), "node"),
                duration(start_at.saturating_sub(now))
            ),
            WaitReason::Planned { start_at, nodes } => format!(
                "no free GPUs in its shape now; planned on {} at t+{} when running and earlier planned jobs end",
                plural(u64::from(*nodes), "node"),
                duration(start_at.saturating_sub(now))
            ),
            WaitReason::BeyondPlan { depth } => format!(
                "does not fit now; the first {} waiting ahead of it are planned first",
                plural(u64::from(*depth), "job")
            ),
            WaitReason::NeverFits(f) => format!(
                "{}, even once every running job ends: the nodes it needs are cordoned, down or reserved",
                Explanation {
                    job: self.job,
                    reason: WaitReason::NoFit(*f),
                    estimated_start: None,
                }
                .render(state, now)
            ),
            WaitReason::BehindReservation { holder, start_at } => format!(
                "reserved to start at t+{} behind job {holder}; free GPUs are held for it",
                duration(start_at.saturating_sub(now))
            ),
            WaitReason::Maintenance {
                name,
                start_at,
                end_at,
            } => {
                let when = if *start_at <= now {
                    format!("under way until t+{}", duration(end_at.saturating_sub(now)))
                } else {
                    format!(
                        "from t+{} to t+{}",
                        duration(start_at.saturating_sub(now)),
                        duration(end_at.saturating_sub(now))
                    )
                };
                format!(
                    "the free nodes that fit it are reserved for maintenance {name} ({when}) and it would not end before"
                )
            }
            WaitReason::Avoiding { nodes, until } => {
                let names: Vec<&str> = nodes.iter().map(|n| node_name(state, *n)).collect();
                format!(
                    "avoiding node{} {} after its fault until t+{}: only the nodes it avoids fit it now, and it may use them once that lapses",
                    if names.len() == 1 { "" } else { "s" },
                    names.join(", "),
                    duration(until.saturating_sub(now))
                )
            }
            WaitReason::InOrder { behind } => {
                format!("waiting in order behind job {behind} (strict FIFO)")
            }
            WaitReason::AwaitingPreemption { victims } => format!(
                "waiting for {} to checkpoint and exit",
                plural(u64::from(*victims), "preempted job")
            ),
            WaitReason::Preempting {
                victims,
                grace_seconds,
            } => format!(
                "preempting {} ({}); starts after their {}s checkpoint grace",
                plural(victims.len() as u64, "job"),
                victims
                    .iter()
                    .map(|v| v.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                grace_seconds
            ),
        }
    }
}
