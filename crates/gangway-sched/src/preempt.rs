//! Preemption and reclaim: choose victims that free enough GPUs *in one
//! placeable shape* for the preemptor, losing the least work (GPU-seconds since
//! each victim's last checkpoint), then the fewest victims. A preemption is
//! only decided after checking, on a trial copy of the capacity, that the
//! preemptor's quota and placement succeed once the victims are gone.

use crate::capacity::NodeIdx;
use crate::capacity::{Capacity, QueueId};
use crate::explain::WaitReason;
use crate::state::{ClusterState, Gang, Job, JobStatus, Placement};
use crate::{quota, Preempt, PreemptReason, Session};
use gangway_core::Time;
use gangway_core::{QueueSpec, TopologyConstraint};

/// Gives a running job's GPUs and quota back on `cap` (for trial computations).
pub fn release_into(state: &ClusterState, cap: &mut Capacity, job: &Job) {
    if let JobStatus::Running(r) = &job.status {
        release_placement(state, cap, job, &r.placement);
    }
}

/// Gives back the resources of `job` placed at `p` on `cap`.
pub fn release_placement(state: &ClusterState, cap: &mut Capacity, job: &Job, p: &Placement) {
    let per = job.per_replica();
    for rp in &p.replicas {
        cap.give(
            state.nodes(),
            rp.node,
            rp.gpus,
            per.cpu_millis,
            per.memory_mib,
        );
    }
    cap.charge(
        state.queues(),
        job.queue,
        per * p.replicas.len() as u64,
        false,
        !job.spec.is_preemptible(),
    );
}

fn related(state: &ClusterState, a: QueueId, b: QueueId) -> bool {
    let qs = state.queues();
    qs[a as usize].path.contains(&b) || qs[b as usize].path.contains(&a)
}

/// The seconds `job` must run in its current attempt before it may be a
/// victim: its queue's minimum (`queue`), else the scheduler's (`cfg`);
/// with [`crate::SchedulerConfig::min_run_grows`], times one more than the
/// preemptions it has had.
pub fn min_run_of(job: &Job, cfg: &crate::SchedulerConfig, queue: &QueueSpec) -> u64 {
    let base = queue.min_run_seconds.unwrap_or(cfg.min_run_seconds);
    if cfg.min_run_grows {
        base.saturating_mul(u64::from(job.preemptions).saturating_add(1))
    } else {
        base
    }
}

/// Whether a running job may be chosen as a victim at `now`: not evicted
/// already at this instant (progress: no ping-pong at one instant, whatever the
/// grace period), within its preemption budget, and past its minimum run time
/// ([`min_run_of`]).
pub fn may_be_victim(
    job: &Job,
    started: Time,
    now: Time,
    cfg: &crate::SchedulerConfig,
    queue: &QueueSpec,
) -> bool {
    let budget = queue.preemption_budget.or(cfg.preemption_budget);
    job.last_preempted != Some(now)
        && budget.is_none_or(|b| job.preemptions < b)
        && now.saturating_sub(started) >= min_run_of(job, cfg, queue)
}

/// One victim candidate a search examined, flattened for its scans.
struct Entry<'a> {
    job: &'a Job,
    lost: u64,
    /// Range into [`Walk::parts`].
    parts: (u32, u32),
    /// GPUs it holds.
    gpus: u64,
    /// A copy of the job's queue, so scans stay in this array.
    queue: QueueId,
}

/// What a victim frees on one node: node, GPUs (healthy), CPU, memory.
type Part = (NodeIdx, u64, u64, u64);

/// The candidates of one search, drawn in order (least lost work first for
/// priority preemption, lowest priority first for reclaim) from the state's
/// victim index as the search asks for them: a search that finds its victims
/// early never looks at the rest of the running jobs.
struct Walk<'a> {
    stream: crate::victims::Stream<'a>,
    entries: Vec<Entry<'a>>,
    parts: Vec<Part>,
    /// Candidates drawn from the index (including those passed over).
    examined: usize,
    /// Most candidates this search may draw ([`crate::SchedulerConfig::max_victims_examined`]).
    limit: usize,
}

impl<'a> Walk<'a> {
    /// The next candidate that may be a victim now (an index into
    /// `entries`), or `None` once the candidates or the limit run out.
    fn next(&mut self, s: &Session<'a>) -> Option<u32> {
        let state = s.state;
        loop {
            if self.examined >= self.limit {
                return None;
            }
            let (id, lost) = self.stream.next()?;
            self.examined += 1;
            let Some(job) = state.job(id) else { continue };
            let JobStatus::Running(r) = &job.status else {
                continue;
            };
            let queue = &state.queues()[job.queue as usize].spec;
            if s.victims.contains(&id)
                || state.preempting.contains_key(&id)
                || !may_be_victim(job, r.started, s.now, s.cfg, queue)
            {
                continue;
            }
            let per = job.per_replica();
            let start = self.parts.len() as u32;
            for rp in &r.placement.replicas {
                let healthy = state.nodes()[rp.node as usize].healthy;
                self.parts.push((
                    rp.node,
                    u64::from((rp.gpus & healthy).count_ones()),
                    per.cpu_millis,
                    per.memory_mib,
                ));
            }
            let i = self.entries.len() as u32;
            self.entries.push(Entry {
                job,
                lost,
                parts: (start, self.parts.len() as u32),
                gpus: r.placement.gpus(),
                queue: job.queue,
            });
            return Some(i);
        }
    }

    fn parts_of(&self, i: u32) -> &[Part] {
        let e = &self.entries[i as usize];
        &self.parts[e.parts.0 as usize..e.parts.1 as usize]
    }
}

/// Per quota-holding queue, GPUs above nominal that reclaim may take.
pub(crate) struct Budgets {
    /// Per queue: the queue whose nominal governs its borrowing.
    holder: Vec<Option<QueueId>>,
    /// Per queue: GPUs above nominal (for quota holders).
    left: Vec<u64>,
}

fn reclaim_budgets(state: &ClusterState, cap: &Capacity) -> Budgets {
    let qs = state.queues();
    let holder = qs
        .iter()
        .map(|q| {
            q.path
                .iter()
                .copied()
                .find(|&n| qs[n as usize].spec.quota.nominal.gpus.is_some())
        })
        .collect();
    let left = qs
        .iter()
        .enumerate()
        .map(|(n, q)| {
            q.spec
                .quota
                .nominal
                .gpus
                .map_or(u64::MAX, |nom| cap.usage[n].gpus.saturating_sub(nom))
        })
        .collect();
    Budgets { holder, left }
}

impl Budgets {
    fn allows(&self, q: QueueId, gpus: u64) -> bool {
        match self.holder.get(q as usize).copied().flatten() {
            None => true,
            Some(h) => self.left[h as usize] >= gpus,
        }
    }

    /// Whether a whole set of victims (indices into `entries`) stays within the budgets.
    fn allows_set(&self, entries: &[Entry<'_>], set: &[u32]) -> bool {
        let mut used: rustc_hash::FxHashMap<QueueId, u64> = Default::default();
        for &i in set {
            let e = &entries[i as usize];
            if let Some(h) = self.holder.get(e.queue as usize).copied().flatten() {
                *used.entry(h).or_default() += e.gpus;
            }
        }
        used.iter().all(|(h, u)| self.left[*h as usize] >= *u)
    }
}

/// Whether a set of victims is allowed: always for priority preemption;
/// within the borrowed budgets for reclaim.
fn within(budgets: Option<&Budgets>, entries: &[Entry<'_>], set: &[u32]) -> bool {
    budgets.is_none_or(|b| b.allows_set(entries, set))
}

fn feasible(s: &Session<'_>, job: &Gang, min: u32, victims: &[&Job]) -> Option<Placement> {
    let mut trial = s.trial();
    for v in victims {
        release_into(s.state, &mut trial, v);
    }
    quota::check(
        s.state,
        &trial,
        job.queue,
        job.per * u64::from(min),
        job.preemptible,
    )
    .ok()?;
    // Never onto nodes of a maintenance window it would run into.
    let exclude = s.preempt_maint.and_then(|k| s.excl_sets.get(&k));
    s.place_elastic(&trial, job, min, min, exclude).ok()
}

/// Tries to make room for `job` (with `min` replicas) by preempting. On success
/// records the preemptions, gives the preemptor the freed GPUs for the rest of
/// the cycle and returns the reason to show.
pub(crate) fn try_preempt(
    s: &mut Session<'_>,
    job: &Gang,
    min: u32,
    reason: PreemptReason,
) -> Option<WaitReason> {
    if s.preempt_searches >= s.cfg.max_preemption_searches
        || s.decisions.preemptions.len() >= s.cfg.max_preemptions_per_cycle
    {
        return None;
    }
    let state = s.state;
    // A job avoiding nodes fails for itself, not for its shape.
    let avoid = s.avoid_key(job);
    let fail_key = (
        s.shape(job, min, min, avoid),
        reason,
        job.priority,
        job.queue,
    );
    if s.preempt_fail.contains(&fail_key) {
        return None;
    }
    if reason == PreemptReason::Priority
        && state
            .preemptible_prios
            .range(..job.priority)
            .next()
            .is_none()
    {
        return None;
    }
    // Which queues may lose work to this job.
    let queue_ok: Vec<bool> = (0..state.queues().len() as QueueId)
        .map(|q| {
            if state.preemptible_by_queue[q as usize].is_empty() {
                return false;
            }
            let b = quota::is_borrowing(state, &s.cap, q);
            match reason {
                // A queue without any quota on its path has no guarantee to
                // protect: higher-priority work anywhere may preempt it.
                PreemptReason::Priority => q == job.queue || b || !quota::guaranteed(state, q),
                // Reclaim takes back only lent quota: no quota, nothing lent.
                PreemptReason::Reclaim => b && !related(state, q, job.queue),
            }
        })
        .collect();
    if !queue_ok.iter().any(|x| *x) {
        return None;
    }
    s.preempt_searches += 1;
    let mp = s.maint_prefix(job);
    s.preempt_maint = s.exclusion_key(job, 0, mp);
    // Reclaim takes back only what was borrowed: a victim's queue must not fall
    // below its nominal quota, or it would reclaim in turn and the cluster would
    // churn. Budget per quota-holding queue: usage above nominal.
    let budgets: Option<Budgets> =
        (reason == PreemptReason::Reclaim).then(|| reclaim_budgets(state, &s.cap));
    // Whole classes of candidates are passed over without being examined:
    // queues that may not lose work to this job, priorities it may not
    // preempt, borrowers whose budget the victim's GPUs would exceed, and jobs
    // past their preemption budget.
    let cfg = s.cfg;
    let stream = state.victims.stream(s.now, reason, |c| {
        let spec = &state.queues()[c.queue as usize].spec;
        let budget = spec.preemption_budget.or(cfg.preemption_budget);
        queue_ok[c.queue as usize]
            && budget.is_none_or(|b| c.preemptions < b)
            && (reason == PreemptReason::Priority && c.priority < job.priority
                || budgets.as_ref().is_some_and(|b| b.allows(c.queue, c.gpus)))
    });
    let mut walk = Walk {
        stream,
        entries: Vec::new(),
        parts: Vec::new(),
        examined: 0,
        limit: cfg.max_victims_examined,
    };
    let per = job.per;
    let need = per.gpus * u64::from(min);
    let single = need <= state.max_node_gpus(job.class_mask)
        && matches!(
            job.topology,
            TopologyConstraint::Auto | TopologyConstraint::Node
        );
    let chosen = if single && per.gpus > 0 {
        per_node_search(s, &mut walk, job, min, budgets.as_ref())
    } else {
        greedy_search(s, &mut walk, job, min, budgets.as_ref())
    };
    s.decisions.stats.victims_examined += walk.examined;
    let Some((victims, placement)) = chosen else {
        s.preempt_fail.insert(fail_key);
        return None;
    };
    if s.decisions.preemptions.len() + victims.len() > s.cfg.max_preemptions_per_cycle {
        return None;
    }
    let mut grace = 0;
    let mut ids = Vec::with_capacity(victims.len());
    let mut vjobs: Vec<&Job> = Vec::with_capacity(victims.len());
    for &i in &victims {
        let e = &walk.entries[i as usize];
        let v = e.job;
        grace = grace.max(v.spec.checkpoint.grace_seconds);
        ids.push(v.id);
        vjobs.push(v);
        s.decisions.preemptions.push(Preempt {
            job: v.id,
            by: job.id,
            grace_seconds: v.spec.checkpoint.grace_seconds,
            reason,
            lost_work_gpu_seconds: e.lost,
        });
    }
    for id in &ids {
        s.victims.insert(*id);
    }
    s.claim(job, &vjobs, &placement);
    Some(WaitReason::Preempting {
        victims: ids,
        grace_seconds: grace,
    })
}

type Choice = (Vec<u32>, Placement);

/// For gangs that fit on one node: walking victims cheapest first, the first
/// nodes on which they free enough room; then the option whose victims lose
/// the least work (and are fewest) that really makes the gang placeable.
fn per_node_search<'a>(
    s: &Session<'a>,
    walk: &mut Walk<'a>,
    job: &Gang,
    min: u32,
    budgets: Option<&Budgets>,
) -> Option<Choice> {
    let state = s.state;
    let per = job.per;
    let mask = job.class_mask;
    let r = u64::from(min);
    let (need_g, need_c, need_m) = (per.gpus * r, per.cpu_millis * r, per.memory_mib * r);
    // Per touched node: freed so far (gpus, cpu, mem, lost) and its victims.
    let mut acc: rustc_hash::FxHashMap<NodeIdx, (u64, u64, u64, u64, Vec<u32>)> =
        Default::default();
    let mut options: Vec<((u64, usize, NodeIdx), Vec<u32>)> = Vec::new();
    while let Some(i) = walk.next(s) {
        let lost = walk.entries[i as usize].lost;
        for &(n, g, c, m) in walk.parts_of(i) {
            let info = &state.nodes()[n as usize];
            if !info.schedulable() || info.class.is_none_or(|cl| mask & (1 << cl) == 0) {
                continue;
            }
            let ni = n as usize;
            let a = acc.entry(n).or_insert_with(|| {
                (
                    u64::from(s.cap.free[ni].count_ones()),
                    s.cap.free_cpu[ni],
                    s.cap.free_mem[ni],
                    0,
                    Vec::new(),
                )
            });
            if a.0 >= need_g && a.1 >= need_c && a.2 >= need_m {
                continue; // already an option
            }
            a.0 += g;
            a.1 += c;
            a.2 += m;
            if !a.4.contains(&i) {
                a.3 += lost;
                a.4.push(i);
            }
            if a.0 >= need_g && a.1 >= need_c && a.2 >= need_m {
                options.push(((a.3, a.4.len(), n), a.4.clone()));
            }
        }
        if options.len() >= 8 {
            break;
        }
    }
    options.sort();
    for (_, set) in options {
        if !within(budgets, &walk.entries, &set) {
            continue;
        }
        let victims: Vec<&Job> = set.iter().map(|&i| walk.entries[i as usize].job).collect();
        if let Some(p) = feasible(s, job, min, &victims) {
            return Some((set, p));
        }
    }
    None
}

/// For multi-node gangs: add victims cheapest first until the gang fits, then
/// drop every victim (most expensive first) whose removal is not needed.
fn greedy_search<'a>(
    s: &Session<'a>,
    walk: &mut Walk<'a>,
    job: &Gang,
    min: u32,
    budgets: Option<&Budgets>,
) -> Option<Choice> {
    let need = job.per.gpus * u64::from(min);
    let mut chosen: Vec<u32> = Vec::new();
    let mut freed = 0u64;
    let mut next_try = need.saturating_sub(s.cap.free_total);
    let mut tries = 0;
    let mut found = None;
    while let Some(i) = walk.next(s) {
        chosen.push(i);
        if !within(budgets, &walk.entries, &chosen) {
            chosen.pop();
            continue;
        }
        freed += walk.parts_of(i).iter().map(|p| p.1).sum::<u64>();
        if freed >= next_try {
            tries += 1;
            let victims: Vec<&Job> = chosen
                .iter()
                .map(|&i| walk.entries[i as usize].job)
                .collect();
            if let Some(p) = feasible(s, job, min, &victims) {
                found = Some(p);
                break;
            }
            if tries >= 16 {
                return None;
            }
            next_try = freed + (need / 4).max(1);
        }
    }
    let jobs =
        |set: &[u32]| -> Vec<&Job> { set.iter().map(|&i| walk.entries[i as usize].job).collect() };
    let mut placement = found?;
    let mut k = chosen.len();
    let mut prunes = 0;
    while k > 0 && prunes < 32 {
        k -= 1;
        prunes += 1;
        let without: Vec<u32> = chosen
            .iter()
            .enumerate()
            .filter(|(x, _)| *x != k)
            .map(|(_, c)| *c)
            .collect();
        if let Some(p) = feasible(s, job, min, &jobs(&without)) {
            chosen = without;
            placement = p;
        }
    }
    Some((chosen, placement))
}
