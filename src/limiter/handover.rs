//! What the stores tell each other when the one deciding changes, under
//! `on_error = "local"` (see [`super::fallback`]):
//!
//! - shared to local: how far ahead each endpoint's shared bucket is spoken for
//!   ([`Horizons`]: the last reservation's start or a cooldown's end), so a local bucket
//!   taking over starts no earlier;
//! - local to shared, before the shared store decides again: what 429s taught the local
//!   store during the outage (cooldowns and decreases), and a cap on each bucket (no
//!   more than the local bucket has left, nothing before the last shared reservation
//!   seen: also right when the store lost its state);
//! - both ways: the slots (leases) this replica's requests hold, adopted by whichever
//!   store takes over (the leases that may be in the shared store for nobody are
//!   released there by [`super::fallback`] itself, whatever `on_error`).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::bucket::Ask;
use super::lease::LeaseAsk;
use super::memory::MemoryStore;
use super::{BucketStore, StoreError};
use crate::config::Adaptive;

/// What one store hands the other when the store deciding changes.
#[derive(Default)]
pub struct Handover {
    horizons: Arc<Horizons>,
    /// Per endpoint, the end of the last cooldown this replica started or was told of.
    cooling: Horizons,
    /// Cooldowns and decreases the local store applied during an outage.
    learned: Mutex<HashMap<Box<str>, Learned>>,
    /// This replica's in-flight slots (leases) by id.
    in_flight: Mutex<HashMap<u64, Flying>>,
    /// Endpoints the local store decided for during the outage, with their policies.
    decided: Mutex<HashMap<Box<str>, Ask>>,
    /// How many endpoints this handover and those sharing the budget keep in
    /// `decided`, all told.
    kept: Arc<AtomicUsize>,
}

impl Handover {
    /// Most endpoints kept as decided locally during one outage (by all the handovers
    /// sharing a budget: a cluster's slots).
    pub const MAX_DECIDED: usize = 65_536;

    /// A handover whose endpoints decided locally count against `budget` with those of
    /// the others sharing it.
    pub fn sharing(budget: Arc<AtomicUsize>) -> Handover {
        Handover {
            kept: budget,
            ..Handover::default()
        }
    }

    /// The horizons a local store starts its buckets after.
    pub fn horizons(&self) -> &Arc<Horizons> {
        &self.horizons
    }

    /// Records that the shared bucket of `endpoint` (policy `ask`) is spoken for until
    /// `at`.
    pub fn spoken_for(&self, endpoint: &str, ask: Ask, at: Instant) {
        self.horizons.saw(endpoint, ask, at);
    }

    /// Records that `endpoint` cools down until `until` (it is spoken for as long).
    pub fn cooling(&self, endpoint: &str, ask: Ask, until: Instant) {
        self.horizons.saw(endpoint, ask, until);
        self.cooling.saw(endpoint, ask, until);
    }

    /// The local store decided for `endpoint` (policy `ask`) during an outage. At most
    /// [`Handover::MAX_DECIDED`] endpoints are kept: a sender spraying endpoint IDs
    /// through a long outage cannot grow this without bound (the endpoints past it are
    /// not capped on return).
    pub fn decided_locally(&self, endpoint: &str, ask: Ask) {
        let mut decided = lock(&self.decided);
        if decided.contains_key(endpoint) {
            return;
        }
        let room = self
            .kept
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < Self::MAX_DECIDED).then_some(n + 1)
            })
            .is_ok();
        if room {
            decided.insert(endpoint.into(), ask);
        }
    }

    /// Whether `endpoint` cools down now, as far as this replica knows: a reservation
    /// made before its cooldown began is void.
    pub fn cools(&self, endpoint: &str) -> bool {
        self.cooling
            .get(endpoint)
            .is_some_and(|t| t > Instant::now())
    }

    /// The end of the last cooldown of `endpoint` this replica started or was told of.
    pub fn cooling_until(&self, endpoint: &str) -> Option<Instant> {
        self.cooling.get(endpoint)
    }

    /// Keeps what a 429 taught the local store during an outage (`pause` from now, and
    /// a decrease when `throttled`), with the endpoint's full policy.
    pub fn learn(
        &self,
        endpoint: &str,
        ask: Ask,
        adaptive: Adaptive,
        pause: Duration,
        throttled: bool,
    ) {
        if pause.is_zero() && !throttled {
            return;
        }
        let l = Learned {
            ask,
            adaptive,
            until: Instant::now() + pause,
            throttled,
        };
        l.add_to(&mut lock(&self.learned), endpoint.into());
    }

    /// A request of `endpoint` took `lease` (in either store).
    pub fn took(&self, endpoint: &str, ask: Ask, lease: LeaseAsk) {
        let f = Flying {
            endpoint: endpoint.into(),
            ask,
            lease,
        };
        lock(&self.in_flight).insert(lease.id, f);
    }

    /// The request holding lease `id` ended: its lease, if it was in flight.
    pub fn ended(&self, id: u64) -> Option<Flying> {
        lock(&self.in_flight).remove(&id)
    }

    /// This replica's leases of requests in flight, as they are now.
    pub fn flying(&self) -> Vec<Flying> {
        lock(&self.in_flight).values().cloned().collect()
    }

    /// Hands `shared` what it must know before it decides again: the rest of each
    /// cooldown learned and each decrease whose climb back is not over; how much each
    /// bucket may hold now (no more than the local bucket has left, times the `replicas`
    /// sharing it, and nothing before the last shared reservation this replica saw,
    /// which a Redis that lost its state no longer knows of); and the slots this
    /// replica's requests hold (wherever they were taken). `local` is the outage's
    /// store, deciding at `share` of each policy.
    /// What fails is kept for the next try.
    pub async fn teach(
        &self,
        shared: &dyn BucketStore,
        local: &MemoryStore,
        replicas: usize,
        share: impl Fn(Ask) -> Ask,
    ) -> Result<(), StoreError> {
        let learned = std::mem::take(&mut *lock(&self.learned));
        let mut left = learned.into_iter();
        while let Some((endpoint, l)) = left.next() {
            let now = Instant::now();
            let pause = l.until.saturating_duration_since(now);
            let climbing = l.throttled && l.until + l.adaptive.recovery > now;
            if pause.is_zero() && !climbing {
                continue;
            }
            let taught = shared
                .feedback(&endpoint, l.ask, l.adaptive, pause, climbing)
                .await;
            if let Err(e) = taught {
                let mut learned = lock(&self.learned);
                for (endpoint, l) in std::iter::once((endpoint, l)).chain(left) {
                    l.add_to(&mut learned, endpoint);
                }
                return Err(e);
            }
        }
        let now = Instant::now();
        let mut most: HashMap<Box<str>, (Ask, f64)> = HashMap::new();
        for (endpoint, at, ask) in self.horizons.ahead() {
            let reserved = (at - now).as_secs_f64() * ask.rate;
            most.insert(endpoint, (ask, -reserved));
        }
        let decided = std::mem::take(&mut *lock(&self.decided));
        for (endpoint, ask) in &decided {
            let Some(view) = local.view_now(endpoint, share(*ask), None) else {
                continue;
            };
            // Reservations the local bucket holds ask the shared store afresh: only
            // what it has left counts.
            let left = view.tokens.max(0.0) * replicas as f64;
            let m = most.entry(endpoint.clone()).or_insert((*ask, left));
            m.1 = m.1.min(left);
        }
        for (endpoint, (ask, m)) in &most {
            if let Err(e) = shared.cap(endpoint, *ask, *m).await {
                // Kept for the next try; one decided again meanwhile counts once.
                let mut kept = lock(&self.decided);
                let both = kept.len() + decided.len();
                kept.extend(decided);
                self.kept.fetch_sub(both - kept.len(), Ordering::AcqRel);
                return Err(e);
            }
        }
        self.kept.fetch_sub(decided.len(), Ordering::AcqRel);
        for f in self.flying() {
            shared.adopt_lease(&f.endpoint, f.ask, f.lease).await?;
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Per endpoint, the start of the last reservation the shared store was seen to grant
/// with a wait, or the end of its last cooldown seen: a local bucket taking over for an
/// endpoint starts no earlier (see
/// [`MemoryStore::fallback`](super::memory::MemoryStore::fallback)). Times past are swept out as the map grows.
#[derive(Debug, Default)]
pub struct Horizons {
    inner: Mutex<HorizonMap>,
}

#[derive(Debug, Default)]
struct HorizonMap {
    /// The time, and the endpoint's policy as last seen.
    by_endpoint: HashMap<Box<str>, (Instant, Ask)>,
    /// Past times are swept out when the map reaches this size.
    sweep_at: usize,
}

impl Horizons {
    /// Fewest entries before past ones are swept out.
    const SWEEP_FROM: usize = 1024;

    /// Records that the shared bucket of `endpoint` (policy `ask`) is spoken for until
    /// `at`.
    pub(super) fn saw(&self, endpoint: &str, ask: Ask, at: Instant) {
        let mut m = lock(&self.inner);
        if let Some((t, a)) = m.by_endpoint.get_mut(endpoint) {
            (*t, *a) = ((*t).max(at), ask);
            return;
        }
        if m.by_endpoint.len() >= m.sweep_at {
            let now = Instant::now();
            m.by_endpoint.retain(|_, (t, _)| *t > now);
            m.sweep_at = (m.by_endpoint.len() * 2).max(Self::SWEEP_FROM);
        }
        m.by_endpoint.insert(endpoint.into(), (at, ask));
    }

    /// The start of the last shared reservation of `endpoint` seen, if any.
    pub fn get(&self, endpoint: &str) -> Option<Instant> {
        lock(&self.inner).by_endpoint.get(endpoint).map(|(t, _)| *t)
    }

    /// Every endpoint spoken for past now, until when, and its policy.
    fn ahead(&self) -> Vec<(Box<str>, Instant, Ask)> {
        let now = Instant::now();
        let m = lock(&self.inner);
        let ahead = m.by_endpoint.iter().filter(|(_, (t, _))| *t > now);
        ahead.map(|(e, (t, a))| (e.clone(), *t, *a)).collect()
    }
}

/// A lease of a request in flight.
#[derive(Clone)]
pub struct Flying {
    /// Its endpoint.
    pub endpoint: Box<str>,
    /// The endpoint's policy, as the request was admitted.
    pub ask: Ask,
    /// The lease.
    pub lease: LeaseAsk,
}

/// A 429's lesson learned locally: the cooldown's end and whether to decrease.
struct Learned {
    ask: Ask,
    adaptive: Adaptive,
    until: Instant,
    throttled: bool,
}

impl Learned {
    /// Adds this lesson to what `endpoint` already taught: the later end, any decrease,
    /// the newest policy.
    fn add_to(self, learned: &mut HashMap<Box<str>, Learned>, endpoint: Box<str>) {
        match learned.entry(endpoint) {
            Entry::Vacant(v) => {
                v.insert(self);
            }
            Entry::Occupied(mut o) => {
                let l = o.get_mut();
                (l.ask, l.adaptive) = (self.ask, self.adaptive);
                l.until = l.until.max(self.until);
                l.throttled |= self.throttled;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sender spraying endpoint IDs through an outage grows what is kept for the
    /// return only up to its bound.
    #[test]
    fn endpoints_decided_locally_are_bounded() {
        let h = Handover::default();
        let ask = Ask {
            rate: 1.0,
            burst: 1.0,
            budget_us: 0.0,
            recovery_us: 0.0,
            held: None,
            cost: 1.0,
            windows: crate::window::Windows::NONE,
        };
        for i in 0..Handover::MAX_DECIDED + 10 {
            h.decided_locally(&format!("spray-{i}"), ask);
        }
        assert_eq!(lock(&h.decided).len(), Handover::MAX_DECIDED);
        // The slots of a cluster share one budget.
        let budget = Arc::new(AtomicUsize::new(0));
        let (a, b) = (
            Handover::sharing(Arc::clone(&budget)),
            Handover::sharing(Arc::clone(&budget)),
        );
        for i in 0..Handover::MAX_DECIDED / 2 + 10 {
            a.decided_locally(&format!("a-{i}"), ask);
            b.decided_locally(&format!("b-{i}"), ask);
        }
        let kept = lock(&a.decided).len() + lock(&b.decided).len();
        assert_eq!(kept, Handover::MAX_DECIDED);
    }
}
