//! Replacing the queue tree of a live [`ClusterState`] (a scheduling policy
//! change): jobs, placements and claims are kept, only the queues change.

use super::{ClusterState, PendingLevel, StateError};
use crate::capacity::QueueId;
use crate::state::JobStatus;
use gangway_core::{QueueSpec, Resources};
use std::collections::{BTreeSet, HashMap};

impl ClusterState {
    /// Replaces every queue with `specs` (parents first), keeping every job
    /// where it is: pending jobs keep their place in line, running jobs their
    /// GPUs, and usage is recounted against the new tree.
    ///
    /// Fails, changing nothing, when the new tree is malformed (what
    /// [`ClusterState::add_queue`] refuses) or when a queue that holds a
    /// pending or running job is missing from it (the queue is named).
    pub fn replace_queues(&mut self, specs: &[QueueSpec]) -> Result<(), StateError> {
        let mut fresh = ClusterState::default();
        for s in specs {
            fresh.add_queue(s.clone())?;
        }
        let mut map: HashMap<QueueId, QueueId> = HashMap::new();
        for (old, info) in self.queues.iter().enumerate() {
            if let Some(new) = fresh.queue_index(&info.spec.name) {
                map.insert(old as QueueId, new);
            }
        }
        let mut ids: Vec<_> = self.jobs.keys().copied().collect();
        ids.sort_unstable();
        for id in &ids {
            let q = self.jobs[id].queue;
            if !map.contains_key(&q) {
                return Err(StateError::BadQueue {
                    queue: self.queues[q as usize].spec.name.clone(),
                    problem: format!("cannot be removed: job {id} is pending or running in it"),
                });
            }
        }
        // Nothing can fail from here on.
        let n = fresh.queues.len();
        for job in self.jobs.values_mut() {
            job.queue = map[&job.queue];
            job.gang.queue = job.queue;
        }
        for level in self.pending.values_mut() {
            let old = std::mem::take(level);
            let mut new = PendingLevel::new();
            for (q, mut gangs) in old {
                for g in gangs.values_mut() {
                    g.queue = map[&q];
                }
                new.insert(map[&q], gangs);
            }
            *level = new;
        }
        let mut preemptible = vec![BTreeSet::new(); n];
        for (old, set) in std::mem::take(&mut self.preemptible_by_queue)
            .into_iter()
            .enumerate()
        {
            if let Some(new) = map.get(&(old as QueueId)) {
                preemptible[*new as usize] = set;
            }
        }
        self.preemptible_by_queue = preemptible;
        // Queue numbers changed: the victim classes are rebuilt.
        self.victims = crate::victims::VictimClasses::of(self.jobs.values());
        self.queues = fresh.queues;
        self.queue_by_name = fresh.queue_by_name;
        self.names_version = super::NamesVersion::fresh();
        self.capacity.usage = vec![Resources::ZERO; n];
        self.capacity.fixed = vec![Resources::ZERO; n];
        self.capacity.demand = vec![Resources::ZERO; n];
        self.capacity.root_usage = Resources::ZERO;
        self.capacity.root_demand = Resources::ZERO;
        for id in ids {
            let job = &self.jobs[&id];
            if let JobStatus::Running(r) = &job.status {
                let usage = job.usage(r.placement.replicas.len() as u32);
                let fixed = !job.spec.is_preemptible();
                self.capacity
                    .charge(&self.queues, job.queue, usage, true, fixed);
            }
        }
        self.capacity.recompute_demand(&self.queues);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::StateConfig;
    use gangway_core::{JobId, JobSpec, NodeSpec};

    fn state() -> ClusterState {
        let mut s = ClusterState::new(StateConfig::default());
        for i in 0..2 {
            s.add_node(NodeSpec::uniform(
                &format!("n{i}"),
                "l0",
                "s0",
                8,
                "H100",
                80,
            ))
            .expect("node");
        }
        s.add_queue(QueueSpec::gpus("lab", None, 16)).expect("q");
        s.add_queue(QueueSpec::gpus("a", Some("lab"), 8))
            .expect("q");
        s.add_queue(QueueSpec::gpus("b", Some("lab"), 8))
            .expect("q");
        s.add_queue(QueueSpec::gpus("idle", None, 0)).expect("q");
        s
    }

    #[test]
    fn replacing_queues_keeps_pending_and_running_jobs_and_recounts_usage() {
        let mut s = state();
        s.submit(JobId(1), JobSpec::new("r", "b", 1, 4), 10)
            .expect("submit");
        let replicas = vec![crate::state::ReplicaPlacement {
            node: 0,
            gpus: 0b1111,
        }];
        let level = crate::placement::span_level(&s, &replicas);
        let place = crate::state::Placement { replicas, level };
        s.bind(JobId(1), place, 11).expect("bind");
        s.submit(JobId(2), JobSpec::new("p", "a", 1, 2), 12)
            .expect("submit");
        // New order (b before a), a halved quota, the idle queue dropped, a new one added.
        let specs = vec![
            QueueSpec::gpus("lab", None, 16),
            QueueSpec::gpus("b", Some("lab"), 8),
            QueueSpec::gpus("a", Some("lab"), 4),
            QueueSpec::gpus("new", None, 0),
        ];
        s.replace_queues(&specs).expect("replace");
        s.check_invariants().expect("invariants");
        let b = s.queue_index("b").expect("b");
        let a = s.queue_index("a").expect("a");
        assert_eq!(s.job(JobId(1)).expect("running").queue, b);
        assert_eq!(s.queue_usage(b).gpus, 4);
        assert_eq!(s.queue_usage(s.queue_index("lab").expect("lab")).gpus, 4);
        assert_eq!(s.queue_usage(a).gpus, 0);
        assert_eq!(s.queues()[a as usize].spec.quota.nominal.gpus, Some(4));
        assert_eq!(s.pending_count(), 1);
        assert!(s.queue_index("idle").is_none());
        let pending: Vec<_> = s
            .pending
            .values()
            .flat_map(|l| {
                l.iter()
                    .flat_map(|(q, g)| g.values().map(move |g| (*q, g.id, g.queue)))
            })
            .collect();
        assert_eq!(pending, vec![(a, JobId(2), a)]);
        assert!(s.preemptible_by_queue[b as usize].contains(&JobId(1)));
    }

    #[test]
    fn a_queue_with_jobs_cannot_be_removed_and_nothing_changes() {
        let mut s = state();
        s.submit(JobId(7), JobSpec::new("p", "a", 1, 2), 1)
            .expect("submit");
        let before: Vec<String> = s.queues().iter().map(|q| q.spec.name.clone()).collect();
        let e = s
            .replace_queues(&[
                QueueSpec::gpus("lab", None, 16),
                QueueSpec::gpus("b", Some("lab"), 8),
            ])
            .expect_err("a has a job");
        assert!(
            e.to_string().contains("\"a\"") && e.to_string().contains("job 7"),
            "{e}"
        );
        let e = s
            .replace_queues(&[QueueSpec::gpus("a", Some("nope"), 8)])
            .expect_err("bad parent");
        assert!(e.to_string().contains("nope"), "{e}");
        let after: Vec<String> = s.queues().iter().map(|q| q.spec.name.clone()).collect();
        assert_eq!(before, after);
        assert_eq!(
            s.job(JobId(7)).expect("kept").queue,
            s.queue_index("a").expect("a")
        );
    }

    /// The names version moves with every change of the queue or node
    /// names (and only then), and no two states share one unless one is a
    /// copy of the other: a state rebuilt with as many names as before
    /// still has a new version.
    #[test]
    fn the_names_version_moves_exactly_when_names_change() {
        let mut s = state();
        let v = s.names_version();
        assert_eq!(s.clone().names_version(), v, "a copy has the same names");
        s.set_ready("n0", false).expect("ready");
        s.set_cordoned("n1", true).expect("cordon");
        s.submit(JobId(1), JobSpec::new("p", "a", 1, 2), 1)
            .expect("submit");
        assert_eq!(s.names_version(), v, "no name changed");
        s.add_node(NodeSpec::uniform("n2", "l0", "s0", 8, "H100", 80))
            .expect("node");
        let v2 = s.names_version();
        assert_ne!(v2, v, "a node added");
        s.add_queue(QueueSpec::gpus("c", None, 0)).expect("q");
        let v3 = s.names_version();
        assert_ne!(v3, v2, "a queue added");
        let _ = s.replace_queues(&[QueueSpec::gpus("x", Some("nope"), 8)]);
        assert_eq!(
            s.names_version(),
            v3,
            "a refused replacement changes nothing"
        );
        let specs: Vec<QueueSpec> = s.queues().iter().map(|q| q.spec.clone()).collect();
        s.replace_queues(&specs).expect("replace");
        assert_ne!(s.names_version(), v3, "the queues replaced");
        assert_ne!(
            state().names_version(),
            state().names_version(),
            "two states built alike are told apart"
        );
    }
}
