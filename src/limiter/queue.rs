//! The local waiting room in front of an endpoint's store: who asks the store next.
//!
//! Used by endpoints with `max_in_flight` or `shares`, and by endpoints whose senders
//! name priorities (`X-Sluice-Priority`, [`Prioritized`]); the others go straight to
//! the store, whose reservations already serve them in arrival order.
//!
//! Per endpoint, one request at a time is the *head*: only the head asks the store, the
//! rest wait here, ordered by `(priority class, virtual finish time, arrival)`. Without
//! `shares` every finish time is 0, so the order is priority, then arrival (FIFO). With
//! `shares`, this is self-clocked weighted fair queueing: a sender's request gets the
//! finish tag `max(V, its previous tag) + 1/weight`, where `V` is the tag of the request
//! last made head. A sender that stops queueing stops accumulating tags, so its share
//! goes to the others (work-conserving), and a sender that returns starts at `V`, with
//! no credit saved up.
//!
//! The head keeps its place until it holds what makes others wait: a slot (for
//! `max_in_flight`) and, with `shares` or priorities, its token's start time (a start
//! reserved ahead would fix the order before a later `high` request could pass). A head waiting for a
//! slot is woken by a local release ([`Gates::slot_released`]) or retries when the
//! soonest lease may have expired (releases on other replicas are seen then, or by a
//! short backoff poll).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

/// Most endpoints [`Prioritized`] remembers: endpoint IDs can come from senders, and
/// past this many the rest keep plain arrival order.
const MAX_PRIORITIZED: usize = 10_000;

/// The endpoints whose senders named a priority (`high` or `low`): from then on every
/// request of such an endpoint waits in its queue, in priority order and FIFO among
/// equals, holding its place until its token's start. An endpoint nobody names a
/// priority for keeps the cheaper straight path.
#[derive(Debug, Default)]
pub struct Prioritized {
    any: std::sync::atomic::AtomicBool,
    endpoints: std::sync::RwLock<std::collections::HashSet<Arc<str>>>,
}

impl Prioritized {
    /// Remembers that a sender named a priority for `endpoint`.
    pub fn note(&self, endpoint: &Arc<str>) {
        if self.has(endpoint) {
            return;
        }
        let mut set = self
            .endpoints
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if set.len() < MAX_PRIORITIZED {
            set.insert(Arc::clone(endpoint));
            self.any.store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// Whether a sender named a priority for `endpoint` (one load while none did).
    pub fn has(&self, endpoint: &str) -> bool {
        self.any.load(std::sync::atomic::Ordering::Acquire)
            && self
                .endpoints
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(endpoint)
    }
}

/// Where a waiter stands: lower leaves first.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Key {
    class: u8,
    finish: f64,
    seq: u64,
    /// When it arrived (for `/endpoints`' `oldest_wait_ms`; not part of the order).
    at: Instant,
}

impl Eq for Key {}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.class
            .cmp(&other.class)
            .then(self.finish.total_cmp(&other.finish))
            .then(self.seq.cmp(&other.seq))
    }
}

/// One endpoint's waiting room.
#[derive(Default)]
struct Gate {
    /// Someone is head (asking the store or waiting for a slot).
    busy: bool,
    seq: u64,
    waiting: BTreeMap<Key, oneshot::Sender<()>>,
    /// Virtual time: the finish tag of the last request made head.
    vtime: f64,
    /// Each sender's last finish tag (only while it is ahead of `vtime`).
    finish: HashMap<Arc<str>, f64>,
    /// Slots held by this replica's requests.
    in_flight: usize,
    /// Woken when one of this replica's slots is released.
    released: Arc<Notify>,
    /// Why the head waits and for how long (µs), for waiters that give up.
    hint: Hint,
    /// The head's priority class and arrival, and whether it waits for a slot (its
    /// last hint said so): then it is counted as waiting ([`Gates::parked`]).
    head: Option<(u8, Instant)>,
    head_waits: bool,
}

/// What waits in one endpoint's queue on this replica ([`Gates::parked`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Parked {
    /// Waiting requests by priority class (0 high, 1 normal, 2 low), the head waiting
    /// for a slot included.
    pub by_class: [usize; 3],
    /// When the longest-waiting of them arrived.
    pub oldest: Option<Instant>,
}

/// What the head last learned from the store, for refusing waiters that run out of budget.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Hint {
    /// True when the head waits for a slot (else for a token).
    pub slot: bool,
    /// Microseconds until the head expects to proceed.
    pub retry_us: f64,
}

impl Gate {
    fn idle(&self) -> bool {
        !self.busy && self.waiting.is_empty() && self.in_flight == 0
    }
}

/// Every endpoint's waiting room (only endpoints with requests waiting or in flight).
#[derive(Default)]
pub struct Gates {
    map: Mutex<HashMap<Arc<str>, Gate>>,
}

/// A request's place in the queue.
pub struct Place<'a> {
    /// Priority class: 0 high, 1 normal, 2 low.
    pub class: u8,
    /// The sender and its weight, when the endpoint has `shares`.
    pub sender: Option<(&'a Arc<str>, f64)>,
}

/// Being head of an endpoint's queue; dropping it makes the next waiter head.
pub struct Head {
    gates: Arc<Gates>,
    endpoint: Arc<str>,
}

impl Gates {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Gate>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until this request is head of `endpoint`'s queue, or until `deadline`
    /// (then `Err` with what the head last learned). Cancel-safe: a dropped waiter
    /// leaves the queue (or passes on the headship it was just given).
    pub async fn enter(
        self: &Arc<Self>,
        endpoint: &Arc<str>,
        place: Place<'_>,
        deadline: Instant,
    ) -> Result<Head, Hint> {
        let head = || Head {
            gates: Arc::clone(self),
            endpoint: Arc::clone(endpoint),
        };
        let (key, rx) = {
            let mut map = self.lock();
            let gate = map.entry(Arc::clone(endpoint)).or_default();
            let finish = place.sender.map_or(0.0, |(who, weight)| {
                let last = gate.finish.get(who).copied().unwrap_or(0.0);
                let f = gate.vtime.max(last) + 1.0 / weight;
                gate.finish.insert(Arc::clone(who), f);
                f
            });
            if !gate.busy && gate.waiting.is_empty() {
                gate.busy = true;
                gate.vtime = gate.vtime.max(finish);
                gate.head = Some((place.class, Instant::now()));
                drop(map);
                return Ok(head());
            }
            gate.seq += 1;
            let key = Key {
                class: place.class,
                finish,
                seq: gate.seq,
                at: Instant::now(),
            };
            let (tx, rx) = oneshot::channel();
            gate.waiting.insert(key, tx);
            (key, rx)
        };
        // The receiver lives in the waiter: as long as it is there, a head that passes
        // to this waiter succeeds, so a waiter no longer queued was made head.
        let mut waiter = Waiter {
            gates: self,
            endpoint,
            key,
            rx,
            head: false,
        };
        match tokio::time::timeout_at(deadline, &mut waiter.rx).await {
            Ok(Ok(())) => {
                // Made head: no longer queued, nothing for the waiter to undo.
                waiter.head = true;
                Ok(head())
            }
            _ => {
                drop(waiter);
                let map = self.lock();
                Err(map.get(endpoint).map(|g| g.hint).unwrap_or_default())
            }
        }
    }

    /// Makes the next waiter head, or marks the queue free; drops an idle gate.
    fn pass(&self, endpoint: &Arc<str>) {
        let mut map = self.lock();
        let Some(gate) = map.get_mut(endpoint) else {
            return;
        };
        gate.busy = false;
        gate.head = None;
        gate.head_waits = false;
        while let Some((key, tx)) = gate.waiting.pop_first() {
            if tx.send(()).is_ok() {
                gate.busy = true;
                gate.vtime = gate.vtime.max(key.finish);
                gate.head = Some((key.class, key.at));
                break;
            }
        }
        let vtime = gate.vtime;
        gate.finish.retain(|_, f| *f > vtime);
        if gate.idle() {
            map.remove(endpoint);
        }
    }

    /// The head records why it waits (for waiters that give up meanwhile).
    pub fn hint(&self, endpoint: &Arc<str>, hint: Hint) {
        if let Some(g) = self.lock().get_mut(endpoint) {
            g.hint = hint;
            g.head_waits = hint.slot;
        }
    }

    /// What wakes a head waiting for a slot on this replica.
    pub fn released(&self, endpoint: &Arc<str>) -> Arc<Notify> {
        let mut map = self.lock();
        Arc::clone(&map.entry(Arc::clone(endpoint)).or_default().released)
    }

    /// One of this replica's slots was taken.
    pub fn slot_taken(&self, endpoint: &Arc<str>) {
        self.lock()
            .entry(Arc::clone(endpoint))
            .or_default()
            .in_flight += 1;
    }

    /// One of this replica's slots was released: wake the head waiting for one.
    pub fn slot_released(&self, endpoint: &Arc<str>) {
        let mut map = self.lock();
        let Some(gate) = map.get_mut(endpoint) else {
            return;
        };
        gate.in_flight = gate.in_flight.saturating_sub(1);
        gate.released.notify_one();
        if gate.idle() {
            map.remove(endpoint);
        }
    }

    /// Requests waiting (not counting the head) in `endpoint`'s queue.
    pub fn waiting(&self, endpoint: &str) -> usize {
        self.lock().get(endpoint).map_or(0, |g| g.waiting.len())
    }

    /// What waits in every endpoint's queue: the waiters, and a head waiting for a slot
    /// (a head holding a reserved start is the limiter's to count). Endpoints with
    /// nothing waiting are left out.
    pub fn parked(&self) -> Vec<(Arc<str>, Parked)> {
        let map = self.lock();
        let mut out = Vec::new();
        for (id, gate) in map.iter() {
            let mut p = Parked::default();
            for key in gate.waiting.keys() {
                p.by_class[usize::from(key.class.min(2))] += 1;
                p.oldest = Some(p.oldest.map_or(key.at, |o| o.min(key.at)));
            }
            if let (true, Some((class, at))) = (gate.head_waits, gate.head) {
                p.by_class[usize::from(class.min(2))] += 1;
                p.oldest = Some(p.oldest.map_or(at, |o| o.min(at)));
            }
            if p.oldest.is_some() {
                out.push((Arc::clone(id), p));
            }
        }
        out
    }

    /// Endpoints with a queue (tests check nothing is left behind).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when no endpoint has a queue.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Head {
    fn drop(&mut self) {
        self.gates.pass(&self.endpoint);
    }
}

/// A waiter in the queue; dropped while still queued, it leaves.
struct Waiter<'a> {
    gates: &'a Arc<Gates>,
    endpoint: &'a Arc<str>,
    key: Key,
    /// Told when this waiter is made head.
    rx: oneshot::Receiver<()>,
    /// Made head and returned as such: nothing to undo.
    head: bool,
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        if self.head {
            return;
        }
        let removed = {
            let mut map = self.gates.lock();
            map.get_mut(self.endpoint)
                .is_some_and(|g| g.waiting.remove(&self.key).is_some())
        };
        if !removed {
            // Made head just as it gave up (its receiver was still here, so the head that
            // took it out of the queue passed to it): pass the headship on.
            self.gates.pass(self.endpoint);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// One head at a time, also while waiters give up (their budget runs out) at the
    /// moment the head passes on: a waiter that gave up is never counted as having
    /// passed the headship on: a waiter whose receiver was gone when the head passed,
    /// and who then finds itself out of the queue, must not pass it again (two heads).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_head_at_a_time_while_waiters_give_up() {
        let gates = Arc::new(Gates::default());
        let endpoint: Arc<str> = "e".into();
        let heads = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let (gates, endpoint) = (Arc::clone(&gates), Arc::clone(&endpoint));
                let (heads, most) = (Arc::clone(&heads), Arc::clone(&most));
                tokio::spawn(async move {
                    for n in 0..3000u64 {
                        let place = Place {
                            class: 1,
                            sender: None,
                        };
                        // Budgets around how long a head stays: many run out just as
                        // the head passes on.
                        let budget = Duration::from_micros((n * 7 + i * 13) % 60);
                        let deadline = Instant::now() + budget;
                        if let Ok(head) = gates.enter(&endpoint, place, deadline).await {
                            let now = heads.fetch_add(1, Ordering::SeqCst) + 1;
                            most.fetch_max(now, Ordering::SeqCst);
                            tokio::task::yield_now().await;
                            heads.fetch_sub(1, Ordering::SeqCst);
                            drop(head);
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 1, "two heads at once");
        assert!(gates.is_empty(), "a queue was left behind");
    }
}
