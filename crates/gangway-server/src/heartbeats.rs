//! Every node's last heartbeat, with an index by time: the node
//! lifecycle check of each cycle ([`crate::control::Control`]'s
//! `check_nodes`) reads only the nodes the index says may be silent long
//! enough to matter instead of walking every node.
//!
//! The index is lazy, so a heartbeat costs no more than before it (an agent
//! syncs every second, the check's thresholds are ten seconds and more):
//! each name is held at a time no later than its last heartbeat (when it
//! was last looked at), and a heartbeat does not move it. A check pops the
//! names held at or before its cutoff; those heard from since are put back
//! at their last heartbeat, the others are silent. A node that keeps
//! syncing is thus looked at about once per threshold, not once per cycle
//! or per heartbeat.
//!
//! A node that was never heard from since the server opened (it was loaded
//! from the store) counts its silence from [`Heartbeats::opened_at`]: the
//! index holds it at that time until it is looked at again.

use crate::view::LastSeen;
use gangway_core::Time;
use std::collections::{BTreeSet, HashMap};

/// Last heartbeat per node, indexed by time.
#[derive(Clone, Debug)]
pub struct Heartbeats {
    /// Last heartbeat per node (shared with the read view).
    seen: LastSeen,
    /// Every name in `seen`, and every node declared never heard from
    /// ([`Heartbeats::never_heard`]), once, at a time no later than the
    /// one its silence counts from ([`Heartbeats::since`]).
    by_time: BTreeSet<(Time, String)>,
    /// Where each name is held in `by_time`.
    held_at: HashMap<String, Time>,
    /// When the state was loaded.
    opened_at: Time,
    /// The copy the last read view was given.
    published: Published,
}

/// How long read views go on sharing one copy of the heartbeats.
const VIEW_REFRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// The heartbeats the last read view was given, and when (a clone of the
/// heartbeats starts without one).
#[derive(Debug, Default)]
struct Published(std::sync::Mutex<Option<(std::time::Instant, LastSeen)>>);

impl Clone for Published {
    fn clone(&self) -> Self {
        Published::default()
    }
}

impl Heartbeats {
    /// No heartbeat yet; silence counts from `opened_at`.
    pub fn new(opened_at: Time) -> Self {
        Heartbeats {
            seen: LastSeen::default(),
            by_time: BTreeSet::new(),
            held_at: HashMap::new(),
            opened_at,
            published: Published::default(),
        }
    }

    /// Last heartbeat per node for a read view: the previous view's copy
    /// while it is younger than [`VIEW_REFRESH`]. A heartbeat written
    /// while a view shares the map copies its path; with a view published
    /// after every batch of syncs that was a copy per batch, now it is one
    /// per second (heartbeats are whole seconds anyway).
    pub fn for_view(&self) -> LastSeen {
        let mut p = self
            .published
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((at, seen)) = &*p {
            if at.elapsed() < VIEW_REFRESH {
                return seen.clone();
            }
        }
        let seen = self.seen.clone();
        *p = Some((std::time::Instant::now(), seen.clone()));
        seen
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

    /// Holds `name` in the index at `at`, unless it is held already.
    fn hold(&mut self, name: &str, at: Time) {
        if !self.held_at.contains_key(name) {
            self.held_at.insert(name.to_string(), at);
            self.by_time.insert((at, name.to_string()));
        }
    }

    /// A heartbeat from `name` at `at`. A name already in the index stays
    /// where it is (the check moves it when it gets there), unless `at` is
    /// earlier (a clock that went back).
    pub fn heard(&mut self, name: &str, at: Time) {
        // Looked at first: a write copies the map's path if a published
        // view shares it, and most heartbeats of a second change nothing.
        match self.seen.get(name) {
            Some(&t) if t == at => {}
            Some(_) => {
                if let Some(t) = self.seen.get_mut(name) {
                    *t = at;
                }
            }
            None => {
                self.seen.insert(name.into(), at);
            }
        }
        match self.held_at.get(name) {
            Some(&held) if held <= at => {}
            Some(_) => {
                self.unhold(name);
                self.hold(name, at);
            }
            None => self.hold(name, at),
        }
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
            self.hold(name, self.opened_at);
        }
    }

    /// Takes `name` out of the index.
    fn unhold(&mut self, name: &str) {
        if let Some(at) = self.held_at.remove(name) {
            self.by_time.remove(&(at, name.to_string()));
        }
    }

    /// `name` is gone (a deleted node): its heartbeat is forgotten.
    pub fn forget(&mut self, name: &str) {
        self.seen.remove(name);
        self.unhold(name);
    }

    /// The server itself stalled for `stall` seconds up to `now`: every
    /// node's silence in that time is not counted (each time moves `stall`
    /// later, to `now` at most). Rare, so it rebuilds the index (the shift
    /// keeps every held time at or before the heartbeat it stands for).
    pub fn credit_stall(&mut self, stall: Time, now: Time) {
        let shift = |t: Time| t.saturating_add(stall).min(now);
        for (_, v) in self.seen.iter_mut() {
            *v = shift(*v);
        }
        self.opened_at = shift(self.opened_at);
        for at in self.held_at.values_mut() {
            *at = shift(*at);
        }
        self.by_time = std::mem::take(&mut self.by_time)
            .into_iter()
            .map(|(t, n)| (shift(t), n))
            .collect();
    }

    /// The names silent for at least `seconds` at `now`, with the time
    /// their silence counts from, oldest first: what a walk of every name
    /// comparing `now - since(name) >= seconds` (saturating) would find.
    /// Names waiting for approval are included. Looks at the names held at
    /// or before the cutoff only; those heard from since are held again at
    /// their last heartbeat.
    pub fn silent_for(&mut self, seconds: u64, now: Time) -> Vec<(Time, String)> {
        // Silence is `now - since`, 0 for a time after `now`: at least 0
        // seconds is everyone; more, only times up to `now - seconds`.
        let last = if seconds == 0 {
            Time::MAX
        } else {
            match now.checked_sub(seconds) {
                Some(l) => l,
                None => return Vec::new(),
            }
        };
        // Popped first, held again after: a silent name is held again at or
        // before the cutoff and would be popped once more.
        let mut popped = Vec::new();
        while self.by_time.first().is_some_and(|(t, _)| *t <= last) {
            if let Some((_, name)) = self.by_time.pop_first() {
                popped.push(name);
            }
        }
        let mut silent = Vec::new();
        for name in popped {
            let since = self.since(&name);
            if let Some(at) = self.held_at.get_mut(&name) {
                *at = since;
            }
            self.by_time.insert((since, name.clone()));
            if since <= last {
                silent.push((since, name));
            }
        }
        silent.sort();
        silent
    }

    /// Whether the index holds exactly the heard names and the never-heard
    /// names given, each once, no later than its silence counts from
    /// (tests).
    #[cfg(test)]
    pub(crate) fn index_matches<'a>(&self, never: impl Iterator<Item = &'a str>) -> bool {
        let mut want: BTreeSet<String> = self.seen.keys().map(|k| k.to_string()).collect();
        want.extend(never.map(str::to_string));
        let held: BTreeSet<String> = self.by_time.iter().map(|(_, n)| n.clone()).collect();
        held == want
            && self.by_time.len() == want.len()
            && self.held_at.len() == want.len()
            && self
                .by_time
                .iter()
                .all(|(t, n)| self.held_at.get(n) == Some(t) && *t <= self.since(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Read views share one copy of the heartbeats for up to a second, then
    /// get the latest; a clone of the heartbeats starts with none.
    #[test]
    fn read_views_share_a_copy_of_the_heartbeats_for_a_second_then_see_the_latest() {
        let mut hb = Heartbeats::new(0);
        hb.heard("a", 5);
        assert_eq!(hb.for_view().get("a"), Some(&5));
        hb.heard("a", 6);
        hb.heard("b", 6);
        let shared = hb.for_view();
        assert_eq!((shared.get("a"), shared.get("b")), (Some(&5), None));
        assert_eq!(hb.get("a"), Some(6), "the state itself is current");
        assert_eq!(hb.clone().for_view().get("a"), Some(&6));
        std::thread::sleep(VIEW_REFRESH + std::time::Duration::from_millis(50));
        let fresh = hb.for_view();
        assert_eq!((fresh.get("a"), fresh.get("b")), (Some(&6), Some(&6)));
    }

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
                let got = h.silent_for(secs, now);
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
        // Heard from again: not moved until a check gets there.
        h.heard("b", 300);
        h.heard("c", 310);
        h.heard("old", 320);
        assert!(h.index_matches(std::iter::empty()));
        assert!(h.silent_for(100, 399).is_empty(), "all heard since 299");
        let names = |v: Vec<(Time, String)>| v.into_iter().map(|(_, n)| n).collect::<Vec<_>>();
        assert_eq!(names(h.silent_for(100, 410)), ["b", "c"]);
        assert_eq!(names(h.silent_for(100, 420)), ["b", "c", "old"]);
        // A clock that went back holds the name earlier.
        h.heard("c", 100);
        assert_eq!(names(h.silent_for(100, 300)), ["c"]);
        assert!(h.index_matches(std::iter::empty()));
    }
}
