//! The requests of this replica waiting for a reserved start, per endpoint, so the
//! start of one that leaves moves the ones behind it up.
//!
//! Each reservation starts `1/rate` after the one before it. When a sender waiting for
//! one hangs up, the store can only keep its start for the next sender to *arrive*
//! (`bucket::release`'s holes); the senders already waiting behind it would keep their
//! later starts, and a start nobody arrived for in time would be lost: with senders
//! timing out while they wait, the endpoint would get 0.80–0.95 of its rate. Here, the
//! senders of this
//! replica waiting behind the one that left each move up one start, in their order: the
//! first behind it takes its start, the next the first one's, and so on; only the last
//! one's start goes back to the store, the way the leaver's own would have. So the
//! starts stay the ones the store handed out (never more, never earlier), each used once,
//! and the order of the waiters here is kept.
//!
//! A start is two instants: `due`, from when its call was sent (never later than the
//! store's start: a give-back counted from it is never more than it should be), and
//! `wake`, from when its answer came (never earlier than the store's start: a sender
//! leaving then never leaves early); and, from a store with a clock of its own (Redis),
//! the store's start itself, which a give-back names instead of `due`. A start moves
//! with all three.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio::time::Instant;

/// A reserved start (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Start {
    /// No later than the store's start (from when the call was sent).
    pub due: Instant,
    /// No earlier than the store's start (from when the answer came): when to leave.
    pub wake: Instant,
    /// The store's start on its own clock, where it has one (`Outcome::Granted`'s
    /// `at_us`): right to the µs, where `due` is early by the time the call took to
    /// arrive.
    pub at_us: Option<f64>,
}

/// One waiting request.
struct Entry {
    id: u64,
    /// The bucket generation its reservation belongs to: starts move only between
    /// reservations of one generation (a cooldown voided the others').
    generation: u64,
    /// What it spends (`cost`): starts move only between requests of one cost, so each
    /// start carries what the bucket and the windows counted for it.
    cost: u32,
    start: Start,
    /// When the request began waiting (for `/endpoints`' `oldest_wait_ms`).
    since: Instant,
    /// Woken when its start moved.
    moved: Arc<Notify>,
}

/// The waiting requests of every endpoint on this replica.
#[derive(Default)]
pub(super) struct Waiting {
    endpoints: Mutex<HashMap<Box<str>, Vec<Entry>>>,
    next_id: std::sync::atomic::AtomicU64,
}

/// A request's place among the waiting ones; see [`Waiting::join`].
pub(super) struct Spot {
    id: u64,
    moved: Arc<Notify>,
}

impl Spot {
    /// Resolves when this request's start moved (read it with [`Waiting::start`]).
    pub(super) async fn moved(&self) {
        self.moved.notified().await;
    }
}

impl Waiting {
    fn lock(&self) -> MutexGuard<'_, HashMap<Box<str>, Vec<Entry>>> {
        self.endpoints.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a request of `endpoint` waiting for `start` in `generation`.
    #[cfg(test)]
    pub(super) fn join(&self, endpoint: &str, generation: u64, start: Start) -> Spot {
        self.join_since(endpoint, generation, 1, start, Instant::now())
    }

    /// [`join`](Self::join), for a request waiting since `since`.
    pub(super) fn join_since(
        &self,
        endpoint: &str,
        generation: u64,
        cost: u32,
        start: Start,
        since: Instant,
    ) -> Spot {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let moved = Arc::new(Notify::new());
        let entry = Entry {
            id,
            generation,
            cost,
            start,
            since,
            moved: Arc::clone(&moved),
        };
        let mut map = self.lock();
        match map.get_mut(endpoint) {
            Some(v) => v.push(entry),
            None => {
                map.insert(endpoint.into(), vec![entry]);
            }
        }
        Spot { id, moved }
    }

    /// The start `spot` waits for now (it only ever moves earlier).
    pub(super) fn start(&self, endpoint: &str, spot: &Spot) -> Option<Start> {
        let map = self.lock();
        let v = map.get(endpoint)?;
        v.iter().find(|e| e.id == spot.id).map(|e| e.start)
    }

    /// The request leaves at its start: it is no longer among the waiting ones.
    pub(super) fn went(&self, endpoint: &str, spot: &Spot) {
        let mut map = self.lock();
        Self::remove(&mut map, endpoint, spot.id);
    }

    /// The request gives its start up before it came: the requests behind it (of its
    /// generation) each move up one start, and the start left over, the last one's or,
    /// with none behind, its own, is returned for the store. A start already past moves
    /// nobody: a request behind it whose timer lags would leave at once, beside the one
    /// whose start it takes (a timer late by a slot would put two out together).
    pub(super) fn left(&self, endpoint: &str, spot: &Spot) -> Option<Start> {
        let now = Instant::now();
        let mut map = self.lock();
        let (generation, cost, mut free) = Self::remove(&mut map, endpoint, spot.id)?;
        let Some(v) = map.get_mut(endpoint) else {
            return Some(free);
        };
        if free.wake <= now {
            return Some(free);
        }
        let mut behind: Vec<&mut Entry> = v
            .iter_mut()
            .filter(|e| e.generation == generation && e.cost == cost && e.start.wake > free.wake)
            .collect();
        behind.sort_by_key(|e| e.start.wake);
        for e in behind {
            free = std::mem::replace(&mut e.start, free);
            e.moved.notify_one();
        }
        Some(free)
    }

    /// Removes `id` from `endpoint`'s waiting requests (the endpoint with its last):
    /// its generation, cost and start.
    fn remove(
        map: &mut HashMap<Box<str>, Vec<Entry>>,
        endpoint: &str,
        id: u64,
    ) -> Option<(u64, u32, Start)> {
        let v = map.get_mut(endpoint)?;
        let i = v.iter().position(|e| e.id == id)?;
        let e = v.swap_remove(i);
        if v.is_empty() {
            map.remove(endpoint);
        }
        Some((e.generation, e.cost, e.start))
    }

    /// Per endpoint with requests waiting for their starts: how many, and since when
    /// the longest-waiting one waits.
    pub(super) fn parked(&self) -> Vec<(Box<str>, usize, Instant)> {
        let map = self.lock();
        map.iter()
            .filter_map(|(id, v)| {
                let oldest = v.iter().map(|e| e.since).min()?;
                Some((id.clone(), v.len(), oldest))
            })
            .collect()
    }

    /// How many endpoints have requests waiting (tests check none is left behind).
    #[cfg(test)]
    pub(super) fn endpoints(&self) -> usize {
        self.lock().len()
    }

    /// How many requests of `endpoint` wait.
    #[cfg(test)]
    pub(super) fn count(&self, endpoint: &str) -> usize {
        self.lock().get(endpoint).map_or(0, Vec::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(base: Instant, ms: u64) -> Start {
        let t = base + Duration::from_millis(ms);
        Start {
            due: t,
            wake: t,
            at_us: None,
        }
    }

    /// The ones behind a leaver move up one start each, in order; the last start is
    /// what is left for the store; another generation's and the ones ahead stay.
    #[tokio::test(start_paused = true)]
    async fn the_ones_behind_a_leaver_move_up_one_start_each() {
        let w = Waiting::default();
        let t = Instant::now();
        let places: Vec<Spot> = [100, 200, 300, 400]
            .iter()
            .map(|&ms| w.join("e", 1, at(t, ms)))
            .collect();
        let other = w.join("e", 0, at(t, 350));
        let elsewhere = w.join("f", 1, at(t, 500));
        assert_eq!(w.left("e", &places[1]), Some(at(t, 400)));
        let starts: Vec<_> = places
            .iter()
            .map(|p| w.start("e", p).map(|s| s.wake))
            .collect();
        let ms = |m| Some(t + Duration::from_millis(m));
        assert_eq!(starts, [ms(100), None, ms(200), ms(300)]);
        assert_eq!(w.start("e", &other), Some(at(t, 350)));
        assert_eq!(w.start("f", &elsewhere), Some(at(t, 500)));
        // The last one waiting: its own start is left.
        assert_eq!(w.left("e", &places[3]), Some(at(t, 300)));
        // A start already past moves nobody.
        let behind = w.join("e", 1, at(t, 600));
        tokio::time::advance(Duration::from_millis(250)).await;
        assert_eq!(w.left("e", &places[2]), Some(at(t, 200)));
        assert_eq!(w.start("e", &behind), Some(at(t, 600)));
        w.went("e", &behind);
        for p in [&places[0], &other] {
            w.went("e", p);
        }
        w.went("f", &elsewhere);
        assert_eq!(w.endpoints(), 0, "nothing is left behind");
        assert_eq!(w.left("e", &places[0]), None, "a place is left once");
    }
}
