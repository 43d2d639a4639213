//! Quota admission with borrowing, lending limits and reclaim (Kueue-style
//! cohorts generalised to a tree).
//!
//! Every queue has a *demand* (see [`Capacity::demand`]): its own jobs' usage
//! plus, per child, the larger of the child's demand and the nominal quota the
//! child does not lend. A gang is admitted when, walking from its queue to the
//! root, no queue's demand exceeds `nominal + borrowing_limit` and the root's
//! demand stays within the cluster. Non-preemptible jobs may not borrow: they
//! must fit in nominal at every level, so a guarantee is never broken by a job
//! that cannot be reclaimed.

use crate::capacity::{Capacity, QueueId};
use crate::state::ClusterState;
use gangway_core::{Resource, Resources};
use serde::Serialize;

/// Which limit stopped a gang.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QuotaLimit {
    /// A queue's `nominal + borrowing_limit`.
    BorrowingLimit,
    /// A non-preemptible job would have to borrow.
    NonPreemptibleNominal,
    /// The whole cluster is used or kept by queues' non-lendable quota.
    Cluster,
}

/// Why a gang does not fit its queue's quota right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct QuotaBlock {
    /// The job's own queue.
    pub queue: QueueId,
    /// Its usage of `resource`.
    pub queue_used: u64,
    /// Its nominal quota of `resource`, if managed.
    pub queue_nominal: Option<u64>,
    /// The queue (or `None`: the cluster) whose limit is hit.
    pub at: Option<QueueId>,
    /// Which limit.
    pub limit_kind: QuotaLimit,
    /// Resource.
    pub resource: Resource,
    /// Demand at `at` before the gang.
    pub demand: u64,
    /// The gang's request.
    pub request: u64,
    /// The limit at `at`.
    pub limit: u64,
    /// Whether the gang's queue is within nominal all the way up to `at`, so it
    /// may reclaim quota lent to borrowers.
    pub can_reclaim: bool,
}

impl QuotaBlock {
    /// How much is idle at the blocking level.
    pub fn idle(&self) -> u64 {
        self.limit.saturating_sub(self.demand)
    }
}

fn max_floor(d: u64, f: u64) -> u64 {
    d.max(f)
}

/// Checks whether queue `q` may take `req` more, against `cap`'s usage.
/// A request larger than what is physically free passes the cluster-level
/// check, so that its explanation is about placement, not quota.
pub fn check(
    state: &ClusterState,
    cap: &Capacity,
    q: QueueId,
    req: Resources,
    preemptible: bool,
) -> Result<(), QuotaBlock> {
    check_with(state, cap, q, req, preemptible, true)
}

fn check_with(
    state: &ClusterState,
    cap: &Capacity,
    q: QueueId,
    req: Resources,
    preemptible: bool,
    exempt_physical: bool,
) -> Result<(), QuotaBlock> {
    let queues = state.queues();
    let own = &queues[q as usize];
    let mut within_nominal = true;
    let mut delta = req;
    for &n in &own.path {
        let info = &queues[n as usize];
        let quota = &info.spec.quota;
        let usage = cap.usage[n as usize];
        let demand = cap.demand[n as usize];
        let floor = info.floor();
        let mut next = Resources::ZERO;
        for res in Resource::ALL {
            let d_new = demand.get(res) + delta.get(res);
            let mk = |kind, limit, dem: u64| QuotaBlock {
                queue: q,
                queue_used: cap.usage[q as usize].get(res),
                queue_nominal: own.spec.quota.nominal.get(res),
                at: Some(n),
                limit_kind: kind,
                resource: res,
                demand: dem,
                request: req.get(res),
                limit,
                can_reclaim: false,
            };
            if let Some(nom) = quota.nominal.get(res) {
                let fixed = cap.fixed[n as usize].get(res);
                if req.get(res) > 0 && !preemptible && fixed + req.get(res) > nom {
                    return Err(mk(QuotaLimit::NonPreemptibleNominal, nom, fixed));
                }
                if let Some(b) = quota.borrowing_limit.get(res) {
                    if delta.get(res) > 0 && d_new > nom + b {
                        let mut blk = mk(QuotaLimit::BorrowingLimit, nom + b, demand.get(res));
                        // Reclaim applies when the gang stays within nominal below this level
                        // and it is the children's borrowing that fills this queue.
                        blk.can_reclaim =
                            within_nominal && n != q && usage.get(res) + req.get(res) <= nom + b;
                        return Err(blk);
                    }
                }
                if usage.get(res) + req.get(res) > nom {
                    within_nominal = false;
                }
            }
            let f = floor.get(res);
            *next.get_mut(res) = max_floor(d_new, f) - max_floor(demand.get(res), f);
        }
        delta = next;
    }
    let total = state.total();
    for res in Resource::ALL {
        let d = cap.root_demand.get(res);
        // Only the queues' kept (non-lendable) quota is a quota matter at the root;
        // a gang larger than what is physically free is explained by placement.
        let free = match res {
            Resource::Gpus => cap.free_total,
            _ => total.get(res).saturating_sub(cap.root_usage.get(res)),
        };
        let physical = exempt_physical && req.get(res) > free;
        if delta.get(res) > 0 && d + delta.get(res) > total.get(res) && !physical {
            return Err(QuotaBlock {
                queue: q,
                queue_used: cap.usage[q as usize].get(res),
                queue_nominal: own.spec.quota.nominal.get(res),
                at: None,
                limit_kind: QuotaLimit::Cluster,
                resource: res,
                demand: d,
                request: req.get(res),
                limit: total.get(res),
                can_reclaim: within_nominal,
            });
        }
    }
    Ok(())
}

/// Whether queue `q` is borrowing: above nominal at itself or an ancestor.
/// A queue with no nominal quota on its path borrows nothing: no quota was
/// lent to it, so there is nothing to reclaim from it.
pub fn is_borrowing(state: &ClusterState, cap: &Capacity, q: QueueId) -> bool {
    let queues = state.queues();
    queues[q as usize]
        .path
        .iter()
        .any(|&n| queues[n as usize].over_nominal(&cap.usage[n as usize]))
}

/// Whether queue `q` or an ancestor has a nominal quota (a guarantee).
pub fn guaranteed(state: &ClusterState, q: QueueId) -> bool {
    let queues = state.queues();
    queues[q as usize]
        .path
        .iter()
        .any(|&n| queues[n as usize].has_nominal())
}

/// The largest replica count in `min..=max` the quota admits now, if any.
pub fn max_admissible(
    state: &ClusterState,
    cap: &Capacity,
    q: QueueId,
    per: Resources,
    min: u32,
    max: u32,
    preemptible: bool,
) -> Result<u32, QuotaBlock> {
    check(state, cap, q, per * u64::from(min), preemptible)?;
    // Larger elastic sizes must really fit the cluster-level quota: placement
    // may place fewer replicas than the size admitted here, and the physical
    // exemption of a size larger than what is free would not hold for those
    // (nor keep the check monotone in the size).
    let (mut lo, mut hi) = (min, max);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if check_with(state, cap, q, per * u64::from(mid), preemptible, false).is_ok() {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Ok(lo)
}

/// Whether `req` more keeps queue `q` within the nominal quota of the first
/// queue on its path that has one: such a gang claims guaranteed quota and may
/// reclaim what borrowers took from it.
pub fn within_nominal(state: &ClusterState, cap: &Capacity, q: QueueId, req: Resources) -> bool {
    let queues = state.queues();
    for &n in &queues[q as usize].path {
        let info = &queues[n as usize];
        if !info.has_nominal() {
            continue;
        }
        return Resource::ALL.iter().all(|res| {
            info.spec.quota.nominal.get(*res).is_none_or(|nom| {
                req.get(*res) == 0 || cap.usage[n as usize].get(*res) + req.get(*res) <= nom
            })
        });
    }
    false
}

/// For a gang that does not fit and would have to borrow (its queue would go
/// above nominal): the quota view of why it waits, when the cohort it borrows
/// from has less idle than it needs. Borrowers wait for idle quota; they do not
/// reclaim and do not hold reservations.
pub fn borrow_block(
    state: &ClusterState,
    cap: &Capacity,
    q: QueueId,
    req: Resources,
) -> Option<QuotaBlock> {
    let queues = state.queues();
    let path = &queues[q as usize].path;
    let first = path
        .iter()
        .position(|&n| queues[n as usize].has_nominal())?;
    let n = path[first];
    let nominal = queues[n as usize].spec.quota.nominal;
    let res = Resource::ALL.into_iter().find(|r| {
        req.get(*r) > 0
            && nominal
                .get(*r)
                .is_some_and(|nom| cap.usage[n as usize].get(*r) + req.get(*r) > nom)
    })?;
    // The cohort: the next ancestor with a nominal quota for `res`, else the cluster.
    let cohort = path[first + 1..]
        .iter()
        .copied()
        .find(|&a| queues[a as usize].spec.quota.nominal.get(res).is_some());
    let (used, limit) = match cohort {
        Some(c) => (
            cap.usage[c as usize].get(res),
            queues[c as usize].spec.quota.nominal.get(res).unwrap_or(0),
        ),
        None => (cap.root_usage.get(res), state.total().get(res)),
    };
    if limit.saturating_sub(used) >= req.get(res) {
        return None;
    }
    Some(QuotaBlock {
        queue: q,
        queue_used: cap.usage[q as usize].get(res),
        queue_nominal: queues[q as usize].spec.quota.nominal.get(res),
        at: cohort,
        limit_kind: if cohort.is_some() {
            QuotaLimit::BorrowingLimit
        } else {
            QuotaLimit::Cluster
        },
        resource: res,
        demand: used,
        request: req.get(res),
        limit,
        can_reclaim: false,
    })
}
