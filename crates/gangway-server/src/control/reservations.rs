//! Maintenance reservations as the control state applies them: create,
//! delete, and the cycle's view of them (see [`crate::reservations`]).

use super::{encode, Control, ControlError};
use crate::reservations::*;
use gangway_core::Time;
use gangway_store::{Op, Store};

impl<S: Store> Control<S> {
    /// Validates and stores a reservation made by `by` at `now`.
    pub fn create_reservation(
        &mut self,
        req: CreateReservation,
        by: &str,
        now: Time,
    ) -> Result<MaintenanceReservation, ReservationError> {
        check_name(&req.name)?;
        if req.nodes.is_empty() || req.nodes.len() > MAX_NODES {
            return Err(bad(format!("nodes: 1 to {MAX_NODES} node names")));
        }
        if req.duration_seconds == 0 || req.duration_seconds > MAX_DURATION_SECONDS {
            return Err(bad(format!(
                "duration_seconds: 1 to {MAX_DURATION_SECONDS} (30 days)"
            )));
        }
        if req.start.saturating_add(PAST_TOLERANCE_SECONDS) < now {
            return Err(bad(format!(
                "start: {} is in the past (now is {now}); at most {PAST_TOLERANCE_SECONDS} s earlier is accepted",
                req.start
            )));
        }
        if req.start > now.saturating_add(MAX_START_AHEAD_SECONDS) {
            return Err(bad("start: at most a year ahead"));
        }
        let mut nodes = req.nodes.clone();
        nodes.sort();
        nodes.dedup();
        for n in &nodes {
            if self.cluster.node_index(n).is_none() {
                return Err(ReservationError::NoSuchNode(format!(
                    "nodes: no node named {:?}",
                    n.chars().take(64).collect::<String>()
                )));
            }
        }
        if self.reservations.0.contains_key(&req.name) {
            return Err(ReservationError::Exists(format!(
                "reservation {} already exists",
                req.name
            )));
        }
        if self.reservations.0.len() >= MAX_RESERVATIONS {
            return Err(ReservationError::TooMany(format!(
                "at most {MAX_RESERVATIONS} reservations at once"
            )));
        }
        let start = req.start.max(now.saturating_sub(PAST_TOLERANCE_SECONDS));
        let r = MaintenanceReservation {
            name: req.name.clone(),
            nodes,
            start,
            end: start + req.duration_seconds,
            created_by: by.to_string(),
        };
        self.store
            .txn(&[], &[Op::Put(format!("{PREFIX}{}", r.name), encode(&r))])
            .map_err(ControlError::from)?;
        self.reservations.0.insert(r.name.clone(), r.clone());
        self.sync_reservations(now)?;
        Ok(r)
    }

    /// Deletes a reservation; whether it existed.
    pub fn delete_reservation(&mut self, name: &str, now: Time) -> Result<bool, ControlError> {
        if !self.reservations.0.contains_key(name) {
            return Ok(false);
        }
        self.store
            .txn(&[], &[Op::Delete(format!("{PREFIX}{name}"))])?;
        self.reservations.0.remove(name);
        self.cluster.remove_maintenance(name);
        self.sync_reservations(now)?;
        Ok(true)
    }

    /// Drops ended reservations (from the store too) and copies the others
    /// into the scheduler's state; nodes that no longer exist are skipped.
    /// Run at every cycle, so a rebuilt scheduler state gets them back.
    pub fn sync_reservations(&mut self, now: Time) -> Result<(), ControlError> {
        let ended: Vec<String> = self
            .reservations
            .0
            .values()
            .filter(|r| r.end <= now)
            .map(|r| r.name.clone())
            .collect();
        if !ended.is_empty() {
            let ops: Vec<Op> = ended
                .iter()
                .map(|n| Op::Delete(format!("{PREFIX}{n}")))
                .collect();
            self.store.txn(&[], &ops)?;
            for n in &ended {
                self.reservations.0.remove(n);
            }
        }
        let known: Vec<String> = self.cluster.maintenance().map(|m| m.name.clone()).collect();
        for n in known {
            if !self.reservations.0.contains_key(&n) {
                self.cluster.remove_maintenance(&n);
            }
        }
        for r in self.reservations.0.values() {
            let nodes: Vec<String> = r
                .nodes
                .iter()
                .filter(|n| self.cluster.node_index(n).is_some())
                .cloned()
                .collect();
            // Cannot fail: the nodes exist and the window is not empty.
            let _ = self
                .cluster
                .set_maintenance(&r.name, &nodes, r.start, r.end);
        }
        Ok(())
    }
}
