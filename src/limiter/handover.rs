//! What the stores tell each other when the one deciding changes, under
//! `on_error = "local"` (see [`super::fallback`]):
//!
//! - shared to local: how far ahead each endpoint's shared bucket is spoken for
//!   ([`Horizons`]: the last reservation's start or a cooldown's end), so a local bucket
//!   taking over starts no earlier;
//! - local to shared: what 429s taught the local store during the outage (cooldowns and
//!   decreases), applied in the shared store before it decides again;
//! - both ways: the slots (leases) this replica's requests hold, adopted by whichever
//!   store takes over, and the shared leases released while the store was away.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::bucket::Ask;
use super::lease::LeaseAsk;
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
    /// Shared leases released while the store was away.
    unreleased: Mutex<Vec<Flying>>,
}

impl Handover {
    /// The horizons a local store starts its buckets after.
    pub fn horizons(&self) -> &Arc<Horizons> {
        &self.horizons
    }

    /// Records that the shared bucket of `endpoint` is spoken for until `at`.
    pub fn spoken_for(&self, endpoint: &str, at: Instant) {
        self.horizons.saw(endpoint, at);
    }

    /// Records that `endpoint` cools down until `until` (it is spoken for as long).
    pub fn cooling(&self, endpoint: &str, until: Instant) {
        self.horizons.saw(endpoint, until);
        self.cooling.saw(endpoint, until);
    }

    /// Whether `endpoint` cools down now, as far as this replica knows: a reservation
    /// made before its cooldown began is void.
    pub fn cools(&self, endpoint: &str) -> bool {
        self.cooling
            .get(endpoint)
            .is_some_and(|t| t > Instant::now())
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

    /// Keeps a lease released while the shared store was away, to release there later.
    pub fn unreleased(&self, f: Flying) {
        lock(&self.unreleased).push(f);
    }

    /// This replica's leases of requests in flight, as they are now.
    pub fn flying(&self) -> Vec<Flying> {
        lock(&self.in_flight).values().cloned().collect()
    }

    /// Hands `shared` what it must know before it decides again: the rest of each
    /// cooldown learned and each decrease whose climb back is not over, the slots this
    /// replica's requests hold (wherever they were taken), and the shared leases released
    /// meanwhile. What fails is kept for the next try.
    pub async fn teach(&self, shared: &dyn BucketStore) -> Result<(), StoreError> {
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
        for f in self.flying() {
            shared.adopt_lease(&f.endpoint, f.ask, f.lease).await?;
        }
        loop {
            let next = lock(&self.unreleased).pop();
            let Some(f) = next else { break };
            if let Err(e) = shared.release_lease(&f.endpoint, f.ask, f.lease.id).await {
                lock(&self.unreleased).push(f);
                return Err(e);
            }
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
    by_endpoint: HashMap<Box<str>, Instant>,
    /// Past times are swept out when the map reaches this size.
    sweep_at: usize,
}

impl Horizons {
    /// Fewest entries before past ones are swept out.
    const SWEEP_FROM: usize = 1024;

    /// Records that the shared bucket of `endpoint` is spoken for until `at`.
    pub(super) fn saw(&self, endpoint: &str, at: Instant) {
        let mut m = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = m.by_endpoint.get_mut(endpoint) {
            *t = (*t).max(at);
            return;
        }
        if m.by_endpoint.len() >= m.sweep_at {
            let now = Instant::now();
            m.by_endpoint.retain(|_, t| *t > now);
            m.sweep_at = (m.by_endpoint.len() * 2).max(Self::SWEEP_FROM);
        }
        m.by_endpoint.insert(endpoint.into(), at);
    }

    /// The start of the last shared reservation of `endpoint` seen, if any.
    pub fn get(&self, endpoint: &str) -> Option<Instant> {
        let m = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        m.by_endpoint.get(endpoint).copied()
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
