//! Every node's last heartbeat, with an index by time (issue 16): the node
//! lifecycle check of each cycle ([`crate::control::Control`]'s
//! `check_nodes`) reads only the nodes silent long enough to matter instead
//! of walking every node, so its cost follows the silent nodes, not the
//! cluster's size.
//!
//! A node that was never heard from since the server opened (it was loaded
//! from the store) counts its silence from [`Heartbeats::opened_at`]: the
//! index holds it at that time until its first heartbeat.

use crate::view::LastSeen;
use gangway_core::Time;
use std::collections::BTreeSet;

/// Last heartbeat per node, indexed by time.
#[derive(Clone, Debug)]
pub struct Heartbeats {
    /// Last heartbeat per node (shared with the read view).
    seen: LastSeen,
    /// Every name in `seen` at its last heartbeat, and every node declared
    /// never heard from ([`Heartbeats::never_heard`]) at `opened_at` until
    /// it is: each name once, at the time its silence counts from.
    by_time: BTreeSet<(Time, String)>,
    /// When the state was loaded.
    opened_at: Time,
}

impl Heartbeats {
    /// No heartbeat yet; silence counts from `opened_at`.
    pub fn new(opened_at: Time) -> Self {
        Heartbeats {
            seen: LastSeen::default(),
            by_time: BTreeSet::new(),
            opened_at,
        }
    }

    /// Last heartbeat per node (a persistent map: copied in O(1)).
    pub fn seen(&self) -> &LastSeen {
        &self.seen
    }

    /// The last heartbeat of `name`, if it was heard from.
    pub fn get(&self, name: &str) -> Option<Time> {
        self.seen.get(name).copied()
    }

    /// When the state was loaded: silence of a node never heard from counts
    /// from it.
    pub fn opened_at(&self) -> Time {
        self.opened_at
    }

    /// The time the silence of `name` counts from: its last heartbeat, else
    /// when the state was loaded.
    pub fn since(&self, name: &str) -> Time {
        self.get(name).unwrap_or(self.opened_at)
    }

    /// A heartbeat from `name` at `at`.
    pub fn heard(&mut self, name: &str, at: Time) {
        let was = self.seen.insert(name.to_string(), at);
        let key = (was.unwrap_or(self.opened_at), name.to_string());
        let mut key = match self.by_time.take(&key) {
            Some(k) => k,
            None => key,
        };
        key.0 = at;
        self.by_time.insert(key);
    }

    /// A heartbeat from `name` at `at` unless it was heard from already.
    pub fn heard_unless_known(&mut self, name: &str, at: Time) {
        if !self.seen.contains_key(name) {
            self.heard(name, at);
        }
    }

    /// `name` is a node of the scheduler loaded from the store: until its
    /// first heartbeat its silence counts from when the state was loaded.
    pub fn never_heard(&mut self, name: &str) {
        if !self.seen.contains_key(name) {
            self.by_time.insert((self.opened_at, name.to_string()));
        }
    }

    /// `name` is gone (a deleted node): its heartbeat is forgotten.
    pub fn forget(&mut self, name: &str) {
        let was = self.seen.remove(name);
        self.by_time
            .remove(&(was.unwrap_or(self.opened_at), name.to_string()));
    }

    /// The server itself stalled for `stall` seconds up to `now`: every
    /// node's silence in that time is not counted (each time moves `stall`
    /// later, to `now` at most). Rare, so it rebuilds the index (the shift
    /// keeps the order, but not every key's distance).
    pub fn credit_stall(&mut self, stall: Time, now: Time) {
        let shift = |t: Time| t.saturating_add(stall).min(now);
        for (_, v) in self.seen.iter_mut() {
            *v = shift(*v);
        }
        self.opened_at = shift(self.opened_at);
        self.by_time = std::mem::take(&mut self.by_time)
            .into_iter()
            .map(|(t, n)| (shift(t), n))
            .collect();
    }

    /// The names silent for at least `seconds` at `now`, with the time
    /// their silence counts from, oldest first: what a walk of every name
    /// comparing `now - since(name) >= seconds` (saturating) would find, in
    /// O(log n + what it returns). Names waiting for approval are included.
    pub fn silent_for(&self, seconds: u64, now: Time) -> impl Iterator<Item = (Time, &str)> + '_ {
        // Silence is `now - since`, 0 for a time after `now`: at least 0
        // seconds is everyone; more, only times up to `now - seconds`.
        let last = if seconds == 0 {
            Some(Time::MAX)
        } else {
            now.checked_sub(seconds)
        };
        self.by_time
            .iter()
            .take_while(move |(t, _)| last.is_some_and(|l| *t <= l))
            .map(|(t, n)| (*t, n.as_str()))
    }

    /// Whether the index holds exactly every heard name at its heartbeat
    /// and the never-heard names given at `opened_at` (tests).
    #[cfg(test)]
    pub(crate) fn index_matches<'a>(&self, never: impl Iterator<Item = &'a str>) -> bool {
        let mut want: BTreeSet<(Time, String)> =
            self.seen.iter().map(|(n, t)| (*t, n.clone())).collect();
        for n in never {
            if !self.seen.contains_key(n) {
                want.insert((self.opened_at, n.to_string()));
            }
        }
        want == self.by_time
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_is_read_from_the_index_as_a_walk_would() {
        let mut h = Heartbeats::new(100);
        h.never_heard("old");
        h.heard("a", 90);
        h.heard("b", 120);
        h.heard("c", 200);
        let walk = |h: &Heartbeats, secs: u64, now: Time| {
            let mut v: Vec<(Time, String)> = ["old", "a", "b", "c"]
                .into_iter()
                .filter(|n| n == &"old" || h.get(n).is_some())
                .map(|n| (h.since(n), n.to_string()))
                .filter(|(t, _)| now.saturating_sub(*t) >= secs)
                .collect();
            v.sort();
            v
        };
        for secs in [0, 1, 10, 30, 80, 110, 500] {
            for now in [0, 50, 100, 130, 150, 199, 200, 230] {
                let got: Vec<(Time, String)> = h
                    .silent_for(secs, now)
                    .map(|(t, n)| (t, n.to_string()))
                    .collect();
                assert_eq!(got, walk(&h, secs, now), "{secs}s at {now}");
            }
        }
        h.heard("old", 150);
        h.forget("a");
        h.credit_stall(40, 180);
        assert_eq!(h.opened_at(), 140);
        assert_eq!(
            (h.get("old"), h.get("b"), h.get("c")),
            (Some(180), Some(160), Some(180))
        );
        assert!(h.index_matches(std::iter::empty()));
    }
}
