//! The server's side of the job contract: rendezvous ports, the checkpoint
//! handshake (what a reported checkpoint changes, what events say about it),
//! checkpoint storage and cleanup, naming what failed, time limits and the
//! rule about loopback addresses.

use super::{Control, ControlError};
use crate::attempt::Ending;
use crate::parts::contract::{MAX_PORT_MOVES_PER_NODE, PORT_AVOID_SECONDS};
use crate::records::{AvoidNodes, CheckpointRecord, FailureRecord, JobEvent, JobRecord};
use gangway_core::agent::{checkpoint_subdir, CheckpointCleanup, CheckpointReport, RankFailure};
use gangway_core::{format_time_span, JobId, JobSpec, JobState, SpecError, Time, TimeSpan};
use gangway_sched::Rejection;
use gangway_store::Store;
use std::collections::{HashMap, HashSet};

/// Wall-clock milliseconds since the epoch.
pub fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn is_loopback(addr: &str) -> bool {
    let host = addr.trim();
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn signal_name(n: i32) -> String {
    match n {
        1 => "SIGHUP".into(),
        2 => "SIGINT".into(),
        3 => "SIGQUIT".into(),
        6 => "SIGABRT".into(),
        7 => "SIGBUS".into(),
        9 => "SIGKILL".into(),
        10 => "SIGUSR1".into(),
        11 => "SIGSEGV".into(),
        12 => "SIGUSR2".into(),
        13 => "SIGPIPE".into(),
        15 => "SIGTERM".into(),
        n => format!("signal {n}"),
    }
}

/// "checkpoint at step 340 (12 s before the signal)" or "no checkpoint reported".
pub fn checkpoint_phrase(c: Option<&CheckpointRecord>, signal_at_ms: Option<u64>) -> String {
    let Some(c) = c else {
        return "no checkpoint reported".into();
    };
    match signal_at_ms {
        Some(at) if c.written_ms >= at => format!(
            "checkpoint at step {} ({} s after the signal)",
            c.step,
            (c.written_ms - at) / 1000
        ),
        Some(at) => format!(
            "checkpoint at step {} ({} s before the signal)",
            c.step,
            (at - c.written_ms).div_ceil(1000)
        ),
        None => format!("checkpoint at step {}", c.step),
    }
}

/// How a failure reads in events: "rank 5, killed by SIGKILL, OOM-killed".
pub fn failure_phrase(f: &FailureRecord) -> String {
    let mut parts = Vec::new();
    if let Some(r) = f.rank {
        parts.push(format!("rank {r}"));
    }
    if let Some(s) = f.signal {
        parts.push(format!("killed by {}", signal_name(s)));
    }
    match &f.limit {
        Some(limit) => parts.push(limit.clone()),
        None if f.oom_killed => parts.push("OOM-killed".into()),
        None => {}
    }
    parts.join(", ")
}

/// Whether a job's ranks are launchers that start workers of their own
/// (torchrun, `python -m torch.distributed.run`): then one of Gangway's
/// ranks is a replica holding several of torch's ranks, and events say
/// "replica" so the two numberings are not confused.
pub fn launches_workers(run: &gangway_core::RunSpec) -> bool {
    run.command
        .iter()
        .any(|w| w.contains("torchrun") || w.contains("torch.distributed.run"))
}

/// Longest holder description a node's report may put in an event.
const MAX_HOLDER_CHARS: usize = 200;

/// A node's description of a port's holder, as an event may carry it:
/// control characters replaced, cut at [`MAX_HOLDER_CHARS`].
fn holder_text(h: &str) -> String {
    h.chars()
        .take(MAX_HOLDER_CHARS)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// The rendezvous ports taken per node during one pass that places jobs
/// (a cycle, a port moved): filled per node from the job table's index and
/// the ports found blocked, then updated as ports are handed out.
pub(super) struct PortsInUse {
    /// When the pass runs: blocked ports are avoided for a while after.
    now: Time,
    /// Per rank-0 node looked at so far, the ports taken there.
    used: HashMap<String, HashSet<u16>>,
}

/// The job's checkpoint directory under the root.
pub(super) fn checkpoint_subdir_of(rec: &JobRecord) -> String {
    checkpoint_subdir(&rec.user, rec.id, rec.spec.checkpoint.dir.as_deref())
}

impl<S: Store> Control<S> {
    /// Rendezvous ports held by live jobs, per rank-0 node, plus those found
    /// taken by other processes: read from the job table's port index for
    /// each node when a placement first needs it, not for every live job.
    pub(super) fn ports_in_use(&self, now: Time) -> PortsInUse {
        PortsInUse {
            now,
            used: HashMap::new(),
        }
    }

    /// The ports taken on `node` (see [`Control::ports_in_use`]).
    fn ports_taken_on<'u>(&self, used: &'u mut PortsInUse, node: &str) -> &'u mut HashSet<u16> {
        let now = used.now;
        used.used.entry(node.to_string()).or_insert_with(|| {
            let mut taken: HashSet<u16> = self.jobs.ports_on(node).collect();
            taken.extend(self.contract.blocked_on(node, now));
            taken
        })
    }

    /// Gives a just-placed attempt its rendezvous port: free among the live
    /// jobs on rank 0's node (`used` is updated). `None` when the range is
    /// exhausted there.
    pub(super) fn assign_port(&self, rec: &mut JobRecord, used: &mut PortsInUse) -> Option<u16> {
        let node = rec.placement.first()?.node.clone();
        let taken = self.ports_taken_on(used, &node);
        let port = self
            .contract
            .config
            .master_ports
            .pick(rec.id, rec.attempt, &|p| taken.contains(&p))?;
        taken.insert(port);
        rec.master_port = Some(port);
        Some(port)
    }

    /// The port an assignment carries (records from before ports were
    /// recorded get one derived from the range).
    pub(super) fn port_of(&self, rec: &JobRecord) -> u16 {
        rec.master_port
            .unwrap_or_else(|| self.contract.derived_port(rec.id, rec.attempt))
    }

    /// Checks a report's job, attempt and node; the record when it applies.
    fn reported(&self, node: &str, id: JobId, attempt: u32) -> Result<JobRecord, ControlError> {
        let (rec, _) = self.jobs.get(&id).ok_or(ControlError::NoSuchJob(id))?;
        if attempt != rec.attempt {
            return Err(ControlError::StaleAttempt(id, attempt, rec.attempt));
        }
        if !rec.placement.iter().any(|r| r.node == node) {
            return Err(ControlError::NotOnNode(node.to_string(), id));
        }
        Ok(JobRecord::clone(rec))
    }

    /// Rank 0's node could not bind the rendezvous port (a process outside
    /// Gangway holds it; `holder` names it when the node could tell): the
    /// port is avoided on that node from now on and the gang starts again
    /// as a new attempt on a new port, so no rank waits for a rendezvous
    /// that cannot happen. Moves back off (1 s doubling to a minute; a
    /// report before the wait is over changes nothing and writes nothing),
    /// and after [`MAX_PORT_MOVES_PER_NODE`] moves on the node the job is
    /// requeued to avoid it for a while. Returns whether it changed.
    pub(super) fn port_busy(
        &mut self,
        node: &str,
        id: JobId,
        attempt: u32,
        port: u16,
        holder: Option<&str>,
        now: Time,
    ) -> Result<bool, ControlError> {
        let mut rec = self.reported(node, id, attempt)?;
        let is_master = rec.placement.first().is_some_and(|r| r.node == node);
        if !is_master || rec.state != JobState::Scheduled || self.port_of(&rec) != port {
            return Ok(false);
        }
        if now < self.contract.port_moves(id, node).next_at {
            return Ok(false);
        }
        self.contract.block_port(node, port, now);
        let moves = self.contract.port_moves(id, node);
        moves.moved(port, now);
        let (count, wait) = (moves.moves, moves.next_at.saturating_sub(now));
        let ports: Vec<String> = moves.ports.iter().map(u16::to_string).collect();
        let held = match holder.map(holder_text) {
            Some(h) => format!("is in use on {node}, held by {h}"),
            None => format!("is in use on {node} by another process"),
        };
        // Nothing ran: a port move is not a restart.
        rec.port_moves = rec.port_moves.saturating_add(1);
        if count >= MAX_PORT_MOVES_PER_NODE {
            self.contract.forget_port_moves(id);
            let msg = format!(
                "rendezvous port {port} {held}; ports {} on {node} were all held by other processes: requeued to avoid {node} for {PORT_AVOID_SECONDS}s",
                ports.join(", ")
            );
            tracing::warn!("job {id}: {msg}");
            let (mut rec, after) = crate::attempt::ended(rec, Ending::Requeued(msg), now);
            rec.avoid = Some(AvoidNodes {
                nodes: vec![node.to_string()],
                until: now.saturating_add(PORT_AVOID_SECONDS),
                because: Some(format!(
                    "its rendezvous ports {} there were held by other processes",
                    ports.join(", ")
                )),
            });
            self.write(rec)?;
            self.apply_ending(id, after);
            return Ok(true);
        }
        let mut used = self.ports_in_use(now);
        // This job's own (old) port is blocked already; its record must not
        // hold the new one back.
        rec.master_port = None;
        // A new attempt: the node keys its ranks by attempt, so none of the
        // old port's can start, and the node looks at the new port afresh.
        rec.attempt += 1;
        rec.ran_attempt = rec.attempt;
        rec.started_on.clear();
        rec.exited_on.clear();
        let msg = match self.assign_port(&mut rec, &mut used) {
            Some(p) => format!(
                "rendezvous port {port} {held}; moved to port {p} (not a restart: nothing ran; move {count} of {MAX_PORT_MOVES_PER_NODE} here, the next no sooner than {wait}s)"
            ),
            None => format!(
                "rendezvous port {port} {held} and every port of {}-{} is taken there",
                self.contract.config.master_ports.first, self.contract.config.master_ports.last
            ),
        };
        tracing::warn!("job {id}: {msg}");
        rec.events.push(JobEvent::new(now, "rendezvous", msg));
        self.write(rec)?;
        Ok(true)
    }

    /// A checkpoint announced by a job's ranks: kept as the job's last
    /// checkpoint (and the scheduler's measure of work a preemption loses);
    /// an event only when it is the job's first or ends a stop.
    /// Returns whether it was new.
    pub(super) fn note_checkpoint(
        &mut self,
        node: &str,
        id: JobId,
        attempt: u32,
        c: &CheckpointReport,
        now: Time,
    ) -> Result<bool, ControlError> {
        let mut rec = self.reported(node, id, attempt)?;
        let live = matches!(
            rec.state,
            JobState::Scheduled | JobState::Running | JobState::Preempting
        );
        let same = rec.checkpoint.as_ref().is_some_and(|old| {
            old.step == c.step && old.path == c.path && old.written_ms == c.written_ms
        });
        if !live || same {
            return Ok(false);
        }
        // A LATEST left by an earlier attempt counts only if it is newer.
        if rec
            .checkpoint
            .as_ref()
            .is_some_and(|old| old.written_ms > c.written_ms)
        {
            return Ok(false);
        }
        let record = CheckpointRecord {
            step: c.step,
            path: c.path.clone(),
            written_ms: c.written_ms,
            attempt,
            node: node.to_string(),
        };
        // Every announcement updates the job's last checkpoint; only the
        // job's first and the one that ends a stop are events, so periodic
        // checkpoints do not bury the events that matter.
        let first = rec.checkpoint.is_none();
        let event = if rec.state == JobState::Preempting {
            Some(format!(
                "{}; stopping the gang now",
                checkpoint_phrase(Some(&record), rec.signal_at_ms)
            ))
        } else {
            first.then(|| format!("checkpoint at step {} ({})", c.step, c.path))
        };
        rec.checkpoint = Some(record);
        if let Some(msg) = event {
            rec.events.push(JobEvent::new(now, "checkpoint", msg));
        }
        self.write(rec)?;
        let _ = self.cluster.record_checkpoint(id, c.written_ms / 1000);
        Ok(true)
    }

    /// Warnings a node reported about a job's ranks (a `PATH` entry their
    /// account cannot search): each is an event once per attempt. Returns
    /// whether any was new.
    pub(super) fn note_warnings(
        &mut self,
        node: &str,
        id: JobId,
        attempt: u32,
        warnings: &[String],
        now: Time,
    ) -> Result<bool, ControlError> {
        if warnings.is_empty() {
            return Ok(false);
        }
        let mut rec = self.reported(node, id, attempt)?;
        let since = rec.attempt_started().unwrap_or(0);
        let mut added = false;
        for w in warnings.iter().take(8) {
            let msg = format!("on {node}: {w}");
            let seen = rec
                .events
                .iter()
                .any(|e| e.at >= since && e.kind == "warning" && e.message == msg);
            if !seen {
                rec.events.push(JobEvent::new(now, "warning", msg));
                added = true;
            }
        }
        if added {
            self.write(rec)?;
        }
        Ok(added)
    }

    /// Whether the gang may stop before its grace ends: it is being
    /// stopped and reported a checkpoint written after the signal.
    pub(super) fn stop_now(rec: &JobRecord) -> bool {
        rec.state == JobState::Preempting
            && rec
                .checkpoint
                .as_ref()
                .zip(rec.signal_at_ms)
                .is_some_and(|(c, at)| c.written_ms >= at)
    }

    /// Keeps a node's report of its first failed rank until the exit it
    /// comes with is applied.
    pub(super) fn stash_failure(&mut self, node: &str, id: JobId, attempt: u32, f: &RankFailure) {
        self.contract.stash_failure(node, id, attempt, f);
    }

    /// Drops what nodes reported about failures of a job whose attempt ended.
    pub(super) fn forget_failures(&mut self, id: JobId) {
        self.contract.forget_failures(id);
        self.contract.forget_port_moves(id);
    }

    /// The event text for a failed attempt, naming the first failing rank,
    /// its node, its code or signal and its last output; the failure is
    /// kept in the record for `describe` and `logs --failed`.
    pub(super) fn failure_message(
        &mut self,
        rec: &mut JobRecord,
        node: &str,
        code: i32,
        now: Time,
    ) -> String {
        let f = self.contract.take_failure(rec.id, rec.attempt, node);
        let unknown = f.as_ref().is_some_and(|f| f.unknown_exit);
        let record = FailureRecord {
            attempt: rec.attempt,
            node: node.to_string(),
            rank: f.as_ref().map(|f| f.rank),
            exit_code: f.as_ref().map_or(code, |f| f.exit_code),
            signal: f
                .as_ref()
                .and_then(|f| f.signal)
                .or_else(|| (code > 128 && code < 128 + 65).then(|| code - 128)),
            oom_killed: f.as_ref().is_some_and(|f| f.oom_killed),
            limit: f.as_ref().and_then(|f| f.limit.clone()),
            log_tail: f.map(|f| f.log_tail).unwrap_or_default(),
            at: now,
        };
        let mut msg = if unknown {
            format!("exit code unknown: supervisor lost on {node}")
        } else {
            format!("exited with code {} on {node}", record.exit_code)
        };
        let mut detail = failure_phrase(&record);
        if launches_workers(&rec.spec.run) {
            // torch numbers its workers' ranks itself: Gangway's is the replica.
            if let Some(rest) = detail.strip_prefix("rank ") {
                detail = format!("replica {rest}");
            }
        }
        if !detail.is_empty() {
            msg += &format!(" ({detail})");
        }
        if let Some(last) = record.log_tail.iter().rev().find(|l| !l.trim().is_empty()) {
            msg += &format!("; last output: {:?}", last.trim());
        }
        rec.failure = Some(record);
        msg
    }

    /// The event text when a stopped gang's last node has exited: what was
    /// saved, and where the next attempt resumes.
    pub(super) fn stopped_message(rec: &JobRecord, node: &str, nodes: usize, code: i32) -> String {
        let place = if nodes == 1 {
            node.to_string()
        } else {
            format!("{nodes} nodes")
        };
        let ckpt = checkpoint_phrase(rec.checkpoint.as_ref(), rec.signal_at_ms);
        let next = match (&rec.checkpoint, rec.time_limit_hit) {
            (_, Some(_)) => String::new(),
            (Some(c), None) => format!("; will resume from {}", c.path),
            (None, None) => "; will start again from the beginning".into(),
        };
        let limit = match (rec.time_limit_hit, rec.spec.time_limit_seconds()) {
            (Some(_), Some(l)) => format!("time limit {} reached; ", format_time_span(l)),
            (Some(_), None) => "time limit reached; ".into(),
            _ => String::new(),
        };
        format!("{limit}stopped on {place} (exit code {code}); {ckpt}{next}")
    }

    /// Running gangs past their time limit get their checkpoint signal and
    /// grace (the Preempting path); their attempt then ends as `timeout`.
    pub(super) fn enforce_time_limits(&mut self, now: Time) -> Result<(), ControlError> {
        let mut due = Vec::new();
        // The jobs on GPUs under a deadline (a time limit among them), not
        // every job on GPUs.
        for rec in self.jobs.deadline_candidates() {
            if !matches!(rec.state, JobState::Scheduled | JobState::Running) {
                continue;
            }
            if rec.time_limit_hit.is_some() {
                continue;
            }
            let Some(limit) = rec.spec.time_limit_seconds() else {
                continue;
            };
            let Some(started) = rec
                .events
                .iter()
                .rev()
                .find(|e| e.kind == "scheduled")
                .map(|e| e.at)
            else {
                continue;
            };
            if now >= started.saturating_add(limit) {
                due.push(rec.id);
            }
        }
        for id in due {
            let Some((rec, _)) = self.jobs.get(&id) else {
                continue;
            };
            let mut rec = JobRecord::clone(rec);
            rec.state = JobState::Preempting;
            rec.time_limit_hit = Some(now);
            rec.signal_at_ms = Some(wall_ms());
            let limit = rec.spec.time_limit_seconds().unwrap_or(0);
            rec.events.push(JobEvent::new(
                now,
                "time_limit",
                format!(
                    "time limit {} reached; checkpoint signal sent, grace {}s",
                    format_time_span(limit),
                    rec.spec.checkpoint.grace_seconds
                ),
            ));
            self.write(rec)?;
        }
        Ok(())
    }

    /// Applies the queue's time limits to a submission: its default when the
    /// spec sets none, and its maximum (the smallest along the queue's
    /// ancestors) as a bound.
    pub(crate) fn apply_queue_time_limit(&self, spec: &mut JobSpec) -> Result<(), ControlError> {
        let Some(q) = self.cluster.queue_index(&spec.queue) else {
            return Ok(());
        };
        let queues = self.cluster.queues();
        let mut default = None;
        let mut max: Option<(u64, &str)> = None;
        for &i in &queues[q as usize].path {
            let spec_q = &queues[i as usize].spec;
            let tl = &spec_q.time_limit;
            if default.is_none() {
                default = tl.default.as_ref().and_then(|t| t.seconds().ok());
            }
            if let Some(m) = tl.max.as_ref().and_then(|t| t.seconds().ok()) {
                if max.is_none_or(|(x, _)| m < x) {
                    max = Some((m, &spec_q.name));
                }
            }
        }
        if spec.time_limit.is_none() {
            if let Some(d) = default {
                let d = max.map_or(d, |(m, _)| d.min(m));
                spec.time_limit = Some(TimeSpan::Seconds(d));
            }
        }
        let Some(asked) = spec.time_limit.as_ref() else {
            return Ok(());
        };
        let Ok(asked) = asked.seconds() else {
            // Spec validation names the problem.
            return Ok(());
        };
        if let Some((m, name)) = max {
            if asked > m {
                return Err(ControlError::Rejected(Rejection::Spec(
                    SpecError::BadTimeLimit(format!(
                        "{} exceeds the maximum of queue {name} ({})",
                        format_time_span(asked),
                        format_time_span(m)
                    )),
                )));
            }
        }
        Ok(())
    }

    /// After a success, the job's checkpoint directory is removed (unless
    /// `keep`): by rank 0's node when the root is shared, by every node it
    /// ran on otherwise.
    pub(super) fn queue_cleanup(&mut self, id: JobId) {
        let Some((rec, _)) = self.jobs.get(&id) else {
            return;
        };
        if rec.state != JobState::Succeeded || rec.spec.checkpoint.keep {
            return;
        }
        self.contract
            .queue_cleanup(id, checkpoint_subdir_of(rec), &rec.ran_on);
    }

    /// The cleanups for `node`, once; a directory a live job uses (a
    /// resubmitted job with the same `checkpoint.dir`) is left alone.
    pub(super) fn take_cleanup(&mut self, node: &str) -> Vec<CheckpointCleanup> {
        self.contract
            .take_cleanup(node)
            .into_iter()
            .filter(|c| !self.jobs.checkpoint_dir_in_use(&c.subdir))
            .collect()
    }

    /// A node advertising a loopback address can only be reached from its
    /// own machine: it may join only a cluster whose nodes all advertise
    /// loopback (`gangway up`, one machine), and a routable node may not
    /// join a cluster of loopback ones, so no multi-node gang ever gets a
    /// loopback `MASTER_ADDR` that other nodes cannot reach.
    pub(crate) fn check_address(&self, name: &str, address: &str) -> Result<(), ControlError> {
        let mine = is_loopback(address);
        for info in self.cluster.nodes() {
            if info.spec.name == name || info.spec.address.is_empty() {
                continue;
            }
            if is_loopback(&info.spec.address) != mine {
                return Err(ControlError::BadNode(format!(
                    "address: node {name} advertises {address:?} but node {} advertises {:?}; \
                     nodes of one cluster must reach each other (start the agent with \
                     --address set to an address the other nodes can reach)",
                    info.spec.name, info.spec.address
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::Report;
    use crate::parts::contract::{BLOCKED_PORT_SECONDS, MAX_PORT_MOVES_PER_NODE};
    use gangway_core::agent::PortRange;
    use gangway_core::agent::{SyncRequest, TaskReport, TaskState};
    use gangway_core::{NodeSpec, QueueSpec};
    use gangway_store::RedbStore;

    fn control(dir: &std::path::Path, queues: &[QueueSpec]) -> Control<RedbStore> {
        let store = RedbStore::open(&dir.join("s.redb")).expect("store");
        let mut c = Control::open(store, queues).expect("control");
        c.contract.config.master_ports = PortRange {
            first: 30_000,
            last: 30_009,
        };
        let mut n = NodeSpec::uniform("n", "l", "s", 8, "H100", 80);
        n.cpu_millis = 64_000;
        n.memory_mib = 65_536;
        n.address = "10.0.0.1".into();
        c.register_node(n, &crate::nodes::Registrant::Join, true, "join", 10)
            .expect("node");
        c
    }

    fn sync_one(c: &mut Control<RedbStore>, t: TaskReport, now: Time) -> bool {
        let req = SyncRequest {
            disk_pressure: None,
            gpus: Vec::new(),
            tasks: vec![t],
            ..Default::default()
        };
        c.sync("n", &req, now).expect("sync").1
    }

    #[test]
    fn live_gangs_on_one_node_never_share_a_port_and_a_busy_one_moves() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path(), &[QueueSpec::unlimited("q", None)]);
        let ids: Vec<JobId> = (0..8)
            .map(|i| {
                c.submit("alice", JobSpec::new(&format!("j{i}"), "q", 1, 1), 10)
                    .expect("submit")
            })
            .collect();
        c.cycle(11).expect("cycle");
        let ports: Vec<u16> = ids
            .iter()
            .map(|id| c.jobs[id].0.master_port.expect("a port"))
            .collect();
        let distinct: HashSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), 8, "{ports:?}");
        assert!(ports.iter().all(|p| (30_000..=30_009).contains(p)));
        // The agent found job 0's port taken by someone else.
        let (id, port) = (ids[0], ports[0]);
        let busy = TaskReport {
            port_busy: Some(port),
            ..TaskReport::new(id, 0, TaskState::Exited { exit_code: 0 })
        };
        assert!(sync_one(&mut c, busy.clone(), 12));
        let rec = &c.jobs[&id].0;
        assert_eq!(rec.attempt, 1, "a new attempt");
        assert_eq!((rec.port_moves, rec.restarts), (1, 0), "not a restart");
        let a = c.assignments("n").into_iter().find(|a| a.job == id);
        assert_eq!(a.and_then(|a| a.restart_count), Some(0));
        assert_eq!(
            rec.state,
            JobState::Scheduled,
            "not succeeded by the empty exit"
        );
        let moved = rec.master_port.expect("port");
        assert!(!ports.contains(&moved), "{moved} is another live job's");
        // The report repeated (a lost answer) changes nothing more.
        assert!(!sync_one(&mut c, busy, 13));
        // The blocked port is never handed out again on that node, even
        // though no live job holds it.
        assert!(c.jobs.values().all(|(r, _)| r.master_port != Some(port)));
        let mut used = c.ports_in_use(13);
        assert!(c.ports_taken_on(&mut used, "n").contains(&port));
        let mut used = c.ports_in_use(13 + BLOCKED_PORT_SECONDS);
        assert!(
            !c.ports_taken_on(&mut used, "n").contains(&port),
            "avoided for a while, not forever"
        );
    }

    #[test]
    fn ten_thousand_busy_port_reports_back_off_requeue_and_leave_the_record_small() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path(), &[QueueSpec::unlimited("q", None)]);
        let id = c
            .submit("alice", JobSpec::new("j", "q", 1, 1), 10)
            .expect("submit");
        c.cycle(11).expect("cycle");
        let holder = "process squat (uid 0), pid 4242";
        assert_eq!(holder_text("nc\u{1b}]52;\n"), "nc?]52;?");
        assert_eq!(holder_text(&"x".repeat(1000)).len(), MAX_HOLDER_CHARS);
        let mut move_times = Vec::new();
        let mut requeued_at = None;
        let mut moves_before = 0;
        // An agent that finds every port it is given held, syncing each second.
        for i in 0..10_000u64 {
            let now = 12 + i;
            let (attempt, state, moves) = {
                let r = &c.jobs[&id].0;
                (r.attempt, r.state, r.port_moves)
            };
            if state == JobState::Scheduled {
                let port = c.port_of(&c.jobs[&id].0);
                let busy = TaskReport {
                    port_busy: Some(port),
                    port_holder: Some(holder.into()),
                    ..TaskReport::new(id, attempt, TaskState::Exited { exit_code: 0 })
                };
                sync_one(&mut c, busy, now);
                let r = &c.jobs[&id].0;
                if r.port_moves > moves && requeued_at.is_none() {
                    move_times.push(now);
                    if r.state == JobState::Pending {
                        requeued_at = Some(now);
                        moves_before = r.port_moves;
                        let avoid = r.avoid.as_ref().expect("avoids the node");
                        assert_eq!(avoid.nodes, vec!["n".to_string()]);
                        let because = avoid.because.as_deref().unwrap_or("");
                        assert!(
                            because.starts_with("its rendezvous ports 300")
                                && because.ends_with("held by other processes"),
                            "{because}"
                        );
                    }
                }
            }
            if i % 10 == 0 {
                c.cycle(now).expect("cycle");
            }
        }
        // Moves wait 1 s, 2 s, 4 s ... (a minute at most), and the eighth
        // on the node requeues the job to avoid it.
        let gaps: Vec<u64> = move_times.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(moves_before, MAX_PORT_MOVES_PER_NODE, "{move_times:?}");
        for (k, gap) in gaps.iter().enumerate() {
            let wait = (1u64 << k).min(60);
            assert!(
                *gap >= wait,
                "move {} came {gap}s after the last: {gaps:?}",
                k + 2
            );
        }
        let rec = &c.jobs[&id].0;
        let requeue = rec
            .events
            .iter()
            .find(|e| e.kind == "requeued")
            .expect("requeued");
        assert!(
            requeue
                .message
                .contains("held by process squat (uid 0), pid 4242")
                && requeue.message.contains("requeued to avoid n"),
            "{}",
            requeue.message
        );
        // Each move's event names the holder; the repeats fold; the record stays small.
        let moved = rec
            .events
            .iter()
            .find(|e| e.kind == "rendezvous")
            .expect("moved");
        assert!(moved.message.contains(holder), "{}", moved.message);
        assert!(moved.count > 1, "folded: {moved:?}");
        assert!(
            rec.events.len() <= crate::records::MAX_EVENTS,
            "{}",
            rec.events.len()
        );
        let bytes = crate::control_error::encode(&**rec).len();
        assert!(bytes < 64 * 1024, "the job record is {bytes} bytes");
        assert!(
            rec.port_moves < 200,
            "{} moves in 10,000 s: bounded",
            rec.port_moves
        );
    }

    #[test]
    fn a_reported_checkpoint_feeds_the_scheduler_and_ends_the_grace_early() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path(), &[QueueSpec::unlimited("q", None)]);
        let id = c
            .submit("alice", JobSpec::new("j", "q", 1, 8), 10)
            .expect("submit");
        c.cycle(11).expect("cycle");
        c.report("n", id, Some(0), Report::Running, 12)
            .expect("run");
        let ck = |step, written_ms| TaskReport {
            checkpoint: Some(CheckpointReport {
                step,
                path: format!("/ck/alice/job-1/step-{step}"),
                written_ms,
            }),
            ..TaskReport::new(id, 0, TaskState::Running)
        };
        assert!(sync_one(&mut c, ck(340, 20_000), 30));
        let Some(gangway_sched::JobStatus::Running(run)) =
            c.cluster.job(id).map(|j| j.status.clone())
        else {
            panic!("running");
        };
        assert_eq!(run.last_checkpoint, Some(20), "lost work counts from it");
        // The same LATEST again is not news; an older one is ignored.
        assert!(!sync_one(&mut c, ck(340, 20_000), 31));
        assert!(!sync_one(&mut c, ck(300, 19_000), 31));
        let a = &c.assignments("n")[0];
        assert!(!a.stop_now);
        assert_eq!(a.resume_from.as_deref(), Some("/ck/alice/job-1/step-340"));
        assert_eq!(a.checkpoint_subdir, "alice/job-1");
        // A later periodic checkpoint updates the job's last checkpoint
        // without an event: only the first one (and one ending a stop) is.
        let events = |c: &Control<RedbStore>| {
            c.jobs[&id]
                .0
                .events
                .iter()
                .filter(|e| e.kind == "checkpoint")
                .count()
        };
        assert_eq!(events(&c), 1);
        assert!(sync_one(&mut c, ck(345, 21_000), 31));
        assert_eq!(c.jobs[&id].0.checkpoint.as_ref().map(|k| k.step), Some(345));
        assert_eq!(events(&c), 1, "folded into the last checkpoint");
        // Being stopped, with a checkpoint from after the signal: stop now.
        let mut rec = JobRecord::clone(&c.jobs[&id].0);
        rec.state = JobState::Preempting;
        rec.signal_at_ms = Some(25_000);
        c.write(rec).expect("write");
        assert!(!c.assignments("n")[0].stop_now, "written before the signal");
        assert!(sync_one(&mut c, ck(341, 25_500), 32));
        assert!(c.assignments("n")[0].stop_now);
        let ev = &c.jobs[&id].0.events;
        assert_eq!(
            ev.last().map(|e| e.message.as_str()),
            Some("checkpoint at step 341 (0 s after the signal); stopping the gang now")
        );
    }

    #[test]
    fn queues_give_default_time_limits_and_refuse_more_than_their_maximum() {
        let d = tempfile::tempdir().expect("tmp");
        let mut parent = QueueSpec::unlimited("org", None);
        parent.time_limit.max = Some(TimeSpan::Text("2h".into()));
        let mut team = QueueSpec::unlimited("team", Some("org"));
        team.time_limit.default = Some(TimeSpan::Text("4h".into()));
        team.time_limit.max = Some(TimeSpan::Text("8h".into()));
        let mut c = control(d.path(), &[parent, team]);
        let mut spec = JobSpec::new("j", "team", 1, 1);
        c.apply_queue_time_limit(&mut spec).expect("default");
        assert_eq!(
            spec.time_limit_seconds(),
            Some(7200),
            "the default, bounded by the parent's maximum"
        );
        spec.time_limit = Some(TimeSpan::Text("3h".into()));
        let e = c.apply_queue_time_limit(&mut spec).expect_err("too long");
        assert_eq!(
            e.to_string(),
            "time_limit: 3:00:00 exceeds the maximum of queue org (2:00:00)"
        );
        let err = c.submit("alice", spec, 1).expect_err("refused");
        assert!(err.to_string().starts_with("time_limit:"), "{err}");
        assert!(c.jobs.is_empty(), "nothing stored");
    }

    #[test]
    fn a_checkpoint_dir_inside_or_holding_another_jobs_is_refused_at_submit() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path(), &[QueueSpec::unlimited("q", None)]);
        let named = |dir: Option<&str>| {
            let mut spec = JobSpec::new("j", "q", 1, 1);
            spec.checkpoint.dir = dir.map(String::from);
            spec
        };
        let first = c.submit("alice", named(None), 10).expect("default dir");
        let run = c
            .submit("alice", named(Some("exp/run")), 10)
            .expect("named");
        // Ended jobs' directories count too: they may be kept.
        c.cancel(run, "alice", 11).expect("cancel");
        let refuse = |c: &mut Control<_>, dir: &str| {
            c.submit("alice", named(Some(dir)), 12)
                .expect_err(dir)
                .to_string()
        };
        let e = refuse(&mut c, &format!("job-{first}/link"));
        assert_eq!(
            e,
            format!("checkpoint.dir: \"job-{first}/link\" is inside job {first}'s checkpoint directory (\"job-{first}\")")
        );
        let e = refuse(&mut c, "job-999/link2/sub");
        assert!(e.contains("default checkpoint directory of job 999"), "{e}");
        let e = refuse(&mut c, "exp/run/link");
        assert_eq!(
            e,
            format!("checkpoint.dir: \"exp/run/link\" is inside job {run}'s checkpoint directory (\"exp/run\")")
        );
        let e = refuse(&mut c, "exp");
        assert!(e.contains(&format!("holds job {run}'s")), "{e}");
        // The same directory (a resubmission), a sibling and another
        // user's namespace are fine.
        c.submit("alice", named(Some("exp/run")), 13)
            .expect("same dir");
        c.submit("alice", named(Some("exp/run2")), 13)
            .expect("sibling");
        c.submit("bob", named(Some("exp/run/link")), 13)
            .expect("bob's own");
        c.submit("alice", named(Some("job-x/y")), 13)
            .expect("not a job id");
        // Within one submission too.
        let r = c.submit_batch(
            vec![
                crate::control::NewJob::new("alice", named(Some("b"))),
                crate::control::NewJob::new("alice", named(Some("b/c"))),
            ],
            14,
        );
        assert!(r[0].is_ok(), "{:?}", r[0]);
        let e = r[1].as_ref().expect_err("nested in the batch").to_string();
        assert!(e.contains("another job of this submission"), "{e}");
    }

    #[test]
    fn cleanup_skips_a_directory_a_live_job_uses() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path(), &[QueueSpec::unlimited("q", None)]);
        let mut spec = JobSpec::new("j", "q", 1, 1);
        spec.checkpoint.dir = Some("run".into());
        let a = c.submit("alice", spec.clone(), 10).expect("a");
        c.cycle(11).expect("cycle");
        c.report("n", a, Some(0), Report::Running, 12).expect("run");
        c.report("n", a, Some(0), Report::Exited(0), 13)
            .expect("done");
        assert_eq!(c.jobs[&a].0.state, JobState::Succeeded);
        // Bob's "run" is another directory; alice's new job uses hers.
        let mut bob = spec.clone();
        bob.checkpoint.dir = Some("run".into());
        c.submit("bob", bob, 14).expect("bob");
        let b = c.submit("alice", spec, 14).expect("b");
        assert!(
            c.take_cleanup("n").is_empty(),
            "alice/run is in use by job {b}"
        );
        // Once nobody uses it, the next success cleans it.
        c.cancel(b, "alice", 15).expect("cancel");
        c.queue_cleanup(a);
        let items = c.take_cleanup("n");
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].subdir, "alice/run");
        assert!(c.take_cleanup("n").is_empty(), "handed out once");
    }

    fn ck(step: u64, written_ms: u64) -> CheckpointRecord {
        CheckpointRecord {
            step,
            path: "/c".into(),
            written_ms,
            attempt: 0,
            node: "n".into(),
        }
    }

    #[test]
    fn events_say_when_the_checkpoint_was_written_relative_to_the_signal() {
        assert_eq!(checkpoint_phrase(None, Some(5)), "no checkpoint reported");
        assert_eq!(
            checkpoint_phrase(Some(&ck(340, 88_000)), Some(100_000)),
            "checkpoint at step 340 (12 s before the signal)"
        );
        assert_eq!(
            checkpoint_phrase(Some(&ck(341, 103_400)), Some(100_000)),
            "checkpoint at step 341 (3 s after the signal)"
        );
    }

    #[test]
    fn failures_name_rank_signal_and_oom() {
        let mut f = FailureRecord {
            attempt: 0,
            node: "n".into(),
            rank: Some(5),
            exit_code: 137,
            signal: Some(9),
            oom_killed: true,
            log_tail: vec![],
            limit: None,
            at: 0,
        };
        assert_eq!(failure_phrase(&f), "rank 5, killed by SIGKILL, OOM-killed");
        f.signal = None;
        f.oom_killed = false;
        assert_eq!(failure_phrase(&f), "rank 5");
    }

    #[test]
    fn torchrun_jobs_call_gangway_s_rank_a_replica() {
        let d = tempfile::tempdir().expect("tmp");
        let mut c = control(d.path(), &[QueueSpec::unlimited("q", None)]);
        let mut spec = JobSpec::new("t", "q", 1, 1);
        spec.run.command = vec![
            "sh".into(),
            "-c".into(),
            "exec torchrun --nnodes=1 x.py".into(),
        ];
        assert!(launches_workers(&spec.run));
        let id = c.submit("alice", spec, 10).expect("submit");
        c.cycle(11).expect("cycle");
        let failing = TaskReport {
            failure: Some(RankFailure {
                rank: 0,
                exit_code: 1,
                signal: None,
                oom_killed: false,
                log_tail: vec!["worker 3 failed".into()],
                node_fault: None,
                limit: None,
                unknown_exit: false,
            }),
            ..TaskReport::new(id, 0, TaskState::Exited { exit_code: 1 })
        };
        sync_one(&mut c, failing, 12);
        let ev = &c.jobs[&id].0.events;
        assert!(
            ev.iter()
                .any(|e| e.message.contains("exited with code 1 on n (replica 0)")),
            "{ev:?}"
        );
        assert!(!launches_workers(&gangway_core::RunSpec::default()));
    }

    #[test]
    fn loopback_is_recognised() {
        for a in ["127.0.0.1", "127.3.4.5", "::1", "localhost"] {
            assert!(is_loopback(a), "{a}");
        }
        for a in ["10.0.0.1", "node-a", "192.168.1.2"] {
            assert!(!is_loopback(a), "{a}");
        }
    }
}
