//! The in-process bucket store: the `bucket` math under sharded locks,
//! on tokio's monotonic clock.
//!
//! The clock is [`tokio::time::Instant`], the one the limiter sleeps on: under
//! `tokio::time::pause()` the buckets refill only as virtual time advances, so bucket,
//! cooldown and recovery behaviour can be tested deterministically. Outside a paused
//! runtime it reads the same monotonic clock as `std::time::Instant`.
//!
//! Idle buckets (full again, no cooldown, no decrease to remember) are evicted by an
//! amortised sweep, the analogue of the Redis key expiry. Evicting one is exact: a
//! bucket made afresh is full, as the idle one was. The number of buckets held is capped
//! (`store.max_endpoints`): an acquire for an endpoint the store holds nothing of, when
//! the store is full, first evicts every idle bucket, and when none is idle it is refused
//! ([`StoreError::Full`]) rather than forget a bucket that is not full, in a cooldown or
//! holding leases (forgetting it would let its endpoint overdraw). Calls for state of
//! requests already admitted (give-backs, feedback, leases) are never refused, so the cap
//! can be passed by at most the endpoints such requests hold no bucket of.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hashbrown::HashTable;
use tokio::time::Instant;

use super::bucket::{self, Ask, BucketState, Outcome, Unused, View};
use super::handover::Horizons;
use super::lease::{self, LeaseAsk, Leased, Leases};
use super::{BucketStore, StoreError, StoreFuture};
use crate::config::Adaptive;

const SHARDS: usize = 16;
/// Every this many calls, one shard is swept for idle buckets.
const SWEEP_EVERY: u64 = 1024;
/// After a sweep for room that found no idle bucket, none is tried again for this many
/// times as long as it took (at least 1 ms): a sender naming new endpoints while every
/// bucket is busy costs a scan of the store at most 1/20 of the time.
const FULL_SWEEP_BACKOFF: f64 = 20.0;
/// A shard's table shrinks once it holds under a quarter of its capacity (past this
/// many slots), so memory taken by a spray comes back.
const SHRINK_PAST: usize = 64;

/// The instruments of the endpoint cap.
#[derive(Clone, Default)]
pub struct EndpointStats {
    /// `sluice_endpoints_tracked`: buckets held.
    pub tracked: prometheus_client::metrics::gauge::Gauge,
    /// `sluice_endpoint_state_evicted_total`: idle buckets evicted.
    pub evicted: prometheus_client::metrics::counter::Counter,
}

/// A bucket plus what the sweep needs to judge it idle.
struct Entry {
    state: BucketState,
    ask: Ask,
    /// In-flight leases (only for endpoints with `max_in_flight`).
    leases: Leases,
    /// When the bucket began to refill (µs): its creation, or later for a fallback
    /// bucket taking over from a shared one (see [`MemoryStore::fallback`]).
    start: f64,
}

/// One shard's buckets, by endpoint ID.
type Shard = HashTable<(Box<str>, Entry)>;

/// In-process buckets, one per endpoint ID.
pub struct MemoryStore {
    /// Tables keyed by the ID's hash, which is computed once per call and picks both
    /// the shard and the slot in it (a `HashMap` per shard would hash the ID twice).
    shards: Vec<Mutex<Shard>>,
    hasher: RandomState,
    epoch: Instant,
    calls: AtomicU64,
    start_full: bool,
    /// A fallback store's new buckets start no earlier than the endpoint's horizon.
    horizons: Option<Arc<Horizons>>,
    /// Buckets held.
    held: AtomicUsize,
    /// Most buckets an acquire may make (`store.max_endpoints`).
    max: usize,
    /// No sweep for room before this (µs, as `f64` bits): the last one found none idle.
    room_after: AtomicU64,
    stats: EndpointStats,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// An empty store whose clock starts now; new buckets start full.
    pub fn new() -> MemoryStore {
        MemoryStore::with_fresh_buckets_full(true)
    }

    /// The fallback for a failed shared store. Its new buckets start empty, and begin to
    /// refill no earlier than the endpoint's horizon, the start of the last reservation
    /// the shared bucket was seen to grant or the end of its cooldown: the reservations
    /// the shared bucket already handed out fill the time until then (or the receiver
    /// cools down), and the local one must not add a burst or a second claim on it.
    pub fn fallback(horizons: Arc<Horizons>) -> MemoryStore {
        MemoryStore {
            horizons: Some(horizons),
            ..MemoryStore::with_fresh_buckets_full(false)
        }
    }

    fn with_fresh_buckets_full(start_full: bool) -> MemoryStore {
        MemoryStore {
            start_full,
            horizons: None,
            shards: (0..SHARDS).map(|_| Mutex::new(HashTable::new())).collect(),
            hasher: RandomState::new(),
            epoch: Instant::now(),
            calls: AtomicU64::new(0),
            held: AtomicUsize::new(0),
            max: usize::MAX,
            room_after: AtomicU64::new(0),
            stats: EndpointStats::default(),
        }
    }

    /// The same store holding at most `max` buckets made by acquires (see the module
    /// docs), counting into `stats`.
    pub fn capped(self, max: usize, stats: EndpointStats) -> MemoryStore {
        MemoryStore {
            max: max.max(1),
            stats,
            ..self
        }
    }

    fn shard(&self, idx: usize) -> std::sync::MutexGuard<'_, Shard> {
        self.shards[idx % SHARDS]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Counts `n` buckets more (negative: fewer) and shows the count.
    fn count(&self, n: isize) {
        let held = if n >= 0 {
            self.held.fetch_add(n.unsigned_abs(), Ordering::AcqRel) + n.unsigned_abs()
        } else {
            self.held.fetch_sub(n.unsigned_abs(), Ordering::AcqRel) - n.unsigned_abs()
        };
        self.stats
            .tracked
            .set(i64::try_from(held).unwrap_or(i64::MAX));
    }

    /// Takes a place for one new bucket under the cap; false when the store is full.
    fn reserve(&self) -> bool {
        let took = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            });
        if let Ok(before) = took {
            self.stats
                .tracked
                .set(i64::try_from(before + 1).unwrap_or(i64::MAX));
        }
        took.is_ok()
    }

    /// Evicts every idle bucket, unless the last try found none and its back-off has
    /// not passed; true when one went.
    fn make_room(&self) -> bool {
        let now = self.now();
        if now < f64::from_bits(self.room_after.load(Ordering::Acquire)) {
            return false;
        }
        let began = std::time::Instant::now();
        let freed: usize = (0..SHARDS).map(|i| self.sweep(i)).sum();
        if freed == 0 {
            let took = began.elapsed().as_secs_f64() * 1e6;
            let after = now + (took * FULL_SWEEP_BACKOFF).max(1000.0);
            self.room_after.store(after.to_bits(), Ordering::Release);
        }
        freed > 0
    }

    /// The ID's hash and its shard. The shard comes from middle bits: the table inside
    /// uses the low ones for the slot and the top seven as tags.
    fn locate(&self, endpoint: &str) -> (u64, usize) {
        let hash = self.hasher.hash_one(endpoint);
        (hash, (hash >> 32) as usize % SHARDS)
    }

    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1e6
    }

    /// When a new bucket of `endpoint` starts (µs): now, or its horizon when later.
    fn start_of(&self, endpoint: &str, now: f64) -> f64 {
        let horizon = self.horizons.as_ref().and_then(|h| h.get(endpoint));
        horizon.map_or(now, |at| {
            let at = at.saturating_duration_since(self.epoch).as_secs_f64() * 1e6;
            at.max(now)
        })
    }

    /// Number of buckets held (tests check eviction).
    pub fn len(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// True when no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Runs `f` on the endpoint's bucket (created full when absent).
    pub fn with_bucket<T>(
        &self,
        endpoint: &str,
        ask: &Ask,
        f: impl FnOnce(&mut BucketState, f64) -> T,
    ) -> T {
        self.with_entry(endpoint, ask, |e, now| f(&mut e.state, now))
    }

    /// Runs `f` on the endpoint's entry: bucket and leases (created when absent,
    /// whatever the cap: for state of requests already admitted).
    fn with_entry<T>(&self, endpoint: &str, ask: &Ask, f: impl FnOnce(&mut Entry, f64) -> T) -> T {
        let (hash, idx) = self.locate(endpoint);
        self.tick();
        let mut shard = self.shard(idx);
        let now = self.now();
        f(self.place(&mut shard, hash, endpoint, ask, now, false), now)
    }

    /// Like [`with_entry`](Self::with_entry) for an acquire: a bucket is made only under
    /// the cap, after evicting idle ones when the store is full; else [`StoreError::Full`].
    fn with_new_entry<T>(
        &self,
        endpoint: &str,
        ask: &Ask,
        f: impl FnOnce(&mut Entry, f64) -> T,
    ) -> Result<T, StoreError> {
        let (hash, idx) = self.locate(endpoint);
        self.tick();
        let held = |shard: &Shard| shard.find(hash, |(k, _)| **k == *endpoint).is_some();
        let mut shard = self.shard(idx);
        let mut reserved = false;
        if !held(&shard) {
            reserved = self.reserve();
            if !reserved {
                drop(shard);
                self.make_room();
                shard = self.shard(idx);
                // Another call may have made it meanwhile.
                if !held(&shard) {
                    reserved = self.reserve();
                    if !reserved {
                        return Err(StoreError::Full(self.max));
                    }
                }
            }
        }
        let now = self.now();
        Ok(f(
            self.place(&mut shard, hash, endpoint, ask, now, reserved),
            now,
        ))
    }

    /// Every [`SWEEP_EVERY`] calls, sweeps the next shard.
    fn tick(&self) {
        let n = self.calls.fetch_add(1, Ordering::Relaxed);
        if n % SWEEP_EVERY == 0 {
            self.sweep((n / SWEEP_EVERY) as usize % SHARDS);
        }
    }

    /// The endpoint's entry in its (locked) shard, made when absent; `reserved`: its
    /// place under the cap is taken already.
    fn place<'s>(
        &self,
        shard: &'s mut Shard,
        hash: u64,
        endpoint: &str,
        ask: &Ask,
        now: f64,
        reserved: bool,
    ) -> &'s mut Entry {
        let (_, entry) = shard
            .entry(
                hash,
                |(k, _)| **k == *endpoint,
                |(k, _)| self.hasher.hash_one(&**k),
            )
            .or_insert_with(|| {
                if !reserved {
                    self.count(1);
                }
                let start = self.start_of(endpoint, now);
                let fresh = Entry {
                    state: bucket::fresh(if self.start_full { ask.burst } else { 0.0 }, start),
                    ask: *ask,
                    leases: Leases::new(),
                    start,
                };
                (endpoint.into(), fresh)
            })
            .into_mut();
        entry.ask = *ask;
        entry
    }

    /// Evicts idle buckets of one shard (and gives back the table's spare room once it
    /// is mostly empty); how many went.
    pub fn sweep(&self, idx: usize) -> usize {
        let now = self.now();
        let mut shard = self.shard(idx);
        let before = shard.len();
        shard.retain(|(_, e)| {
            lease::prune(&mut e.leases, now);
            !e.leases.is_empty() || !bucket::idle(&e.state, &e.ask, now)
        });
        let gone = before - shard.len();
        if shard.capacity() > SHRINK_PAST && shard.len() < shard.capacity() / 4 {
            let keep = shard.len() * 2;
            shard.shrink_to(keep, |(k, _)| self.hasher.hash_one(&**k));
        }
        drop(shard);
        if gone > 0 {
            self.count(-(gone as isize));
            self.stats.evicted.inc_by(gone as u64);
        }
        gone
    }

    /// Sweeps every shard.
    pub fn sweep_all(&self) {
        (0..SHARDS).for_each(|i| {
            self.sweep(i);
        });
    }

    /// Acquire without the future wrapper (used by the fallback path too).
    pub fn acquire_now(&self, endpoint: &str, ask: Ask) -> Outcome {
        self.with_bucket(endpoint, &ask, |s, now| bucket::acquire(s, &ask, now))
    }

    /// [`acquire_now`](Self::acquire_now) under the cap: a new endpoint's bucket is made
    /// only when there is room (see the module docs).
    pub fn acquire_capped(&self, endpoint: &str, ask: Ask) -> Result<Outcome, StoreError> {
        self.with_new_entry(endpoint, &ask, |e, now| {
            bucket::acquire(&mut e.state, &ask, now)
        })
    }

    /// [`acquire_leased_now`](Self::acquire_leased_now) under the cap.
    pub fn acquire_leased_capped(
        &self,
        endpoint: &str,
        ask: Ask,
        l: LeaseAsk,
    ) -> Result<Leased, StoreError> {
        self.with_new_entry(endpoint, &ask, |e, now| {
            lease::acquire(&mut e.state, &mut e.leases, &ask, &l, now)
        })
    }

    /// Feedback without the future wrapper.
    pub fn feedback_now(
        &self,
        endpoint: &str,
        ask: Ask,
        adaptive: &Adaptive,
        pause: Duration,
        throttled: bool,
    ) {
        let pause_us = pause.as_secs_f64() * 1e6;
        self.with_bucket(endpoint, &ask, |s, now| {
            bucket::feedback(s, &ask, adaptive, pause_us, throttled, now)
        });
    }

    /// Cap without the future wrapper.
    pub fn cap_now(&self, endpoint: &str, ask: Ask, most: f64) {
        self.with_bucket(endpoint, &ask, |s, now| bucket::cap(s, &ask, most, now));
    }

    /// View without the future wrapper.
    pub fn view_now(&self, endpoint: &str, ask: Ask, floor: Option<f64>) -> Option<View> {
        let (hash, idx) = self.locate(endpoint);
        let shard = self.shard(idx);
        let now = self.now();
        shard
            .find(hash, |(k, _)| **k == *endpoint)
            .map(|(_, e)| bucket::view(&e.state, &ask, floor, now))
    }

    /// Counts a request the shared bucket paced before this fallback store took over
    /// (see [`bucket::charge`]), unless it leaves before the endpoint's bucket here
    /// started: that time was left to the shared bucket's reservations.
    pub fn charge_survivor_now(&self, endpoint: &str, ask: Ask) {
        self.with_entry(endpoint, &ask, |e, now| {
            if now > e.start {
                bucket::charge(&mut e.state, &ask, now);
            }
        });
    }

    /// Leased acquire without the future wrapper: a slot and a token together.
    pub fn acquire_leased_now(&self, endpoint: &str, ask: Ask, l: LeaseAsk) -> Leased {
        self.with_entry(endpoint, &ask, |e, now| {
            lease::acquire(&mut e.state, &mut e.leases, &ask, &l, now)
        })
    }

    /// Lease renewal without the future wrapper.
    pub fn renew_lease_now(&self, endpoint: &str, ask: Ask, l: LeaseAsk) -> bool {
        self.with_entry(endpoint, &ask, |e, now| {
            lease::renew(&mut e.leases, &l, now)
        })
    }

    /// Lease adoption without the future wrapper (see [`lease::adopt`]).
    pub fn adopt_lease_now(&self, endpoint: &str, ask: Ask, l: LeaseAsk) {
        self.with_entry(endpoint, &ask, |e, now| {
            lease::adopt(&mut e.leases, &l, now)
        });
    }

    /// Lease release without the future wrapper.
    pub fn release_lease_now(&self, endpoint: &str, ask: Ask, id: u64) {
        self.with_entry(endpoint, &ask, |e, _| e.leases.remove(&id));
    }

    /// Release without the future wrapper.
    pub fn release_now(&self, endpoint: &str, ask: Ask, unused: Unused) {
        self.with_bucket(endpoint, &ask, |s, now| {
            bucket::release(s, &ask, unused, now)
        });
    }
}

impl BucketStore for MemoryStore {
    fn acquire<'a>(&'a self, endpoint: &'a str, ask: Ask) -> StoreFuture<'a, Outcome> {
        Box::pin(std::future::ready(self.acquire_capped(endpoint, ask)))
    }

    fn acquire_at_once(&self, endpoint: &str, ask: Ask) -> Option<Outcome> {
        self.acquire_capped(endpoint, ask).ok()
    }

    fn release<'a>(&'a self, endpoint: &'a str, ask: Ask, unused: Unused) -> StoreFuture<'a, ()> {
        self.release_now(endpoint, ask, unused);
        Box::pin(std::future::ready(Ok(())))
    }

    fn feedback<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        adaptive: Adaptive,
        pause: Duration,
        throttled: bool,
    ) -> StoreFuture<'a, ()> {
        self.feedback_now(endpoint, ask, &adaptive, pause, throttled);
        Box::pin(std::future::ready(Ok(())))
    }

    fn cap<'a>(&'a self, endpoint: &'a str, ask: Ask, most: f64) -> StoreFuture<'a, ()> {
        self.cap_now(endpoint, ask, most);
        Box::pin(std::future::ready(Ok(())))
    }

    fn view<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        floor: Option<f64>,
    ) -> StoreFuture<'a, Option<View>> {
        Box::pin(std::future::ready(Ok(self.view_now(endpoint, ask, floor))))
    }

    fn ping(&self) -> StoreFuture<'_, ()> {
        Box::pin(std::future::ready(Ok::<(), StoreError>(())))
    }

    fn acquire_leased<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, Leased> {
        Box::pin(std::future::ready(
            self.acquire_leased_capped(endpoint, ask, lease),
        ))
    }

    fn renew_lease<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, bool> {
        let out = self.renew_lease_now(endpoint, ask, lease);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn adopt_lease<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, ()> {
        self.adopt_lease_now(endpoint, ask, lease);
        Box::pin(std::future::ready(Ok(())))
    }

    fn release_lease<'a>(&'a self, endpoint: &'a str, ask: Ask, id: u64) -> StoreFuture<'a, ()> {
        self.release_lease_now(endpoint, ask, id);
        Box::pin(std::future::ready(Ok(())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Policy;

    #[tokio::test(start_paused = true)]
    async fn idle_buckets_are_evicted() {
        let store = MemoryStore::new();
        let p = Policy {
            rate: 1000.0,
            burst: 1.0,
            max_wait: Duration::ZERO,
            adaptive: None,
            ..Policy::default()
        };
        let ask = Ask::new(&p, 0.0, None);
        for i in 0..5000 {
            store.acquire_now(&format!("spray-{i}"), ask);
        }
        assert!(!store.is_empty(), "buckets one token short are kept");
        // One token at 1000/s refills in 1 ms: after that every bucket is idle again.
        tokio::time::advance(Duration::from_millis(1)).await;
        store.sweep_all();
        assert_eq!(store.len(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_store_evicts_idle_buckets_and_refuses_while_none_is() {
        let stats = EndpointStats::default();
        let store = MemoryStore::new().capped(100, stats.clone());
        let p = Policy {
            rate: 1.0,
            burst: 2.0,
            max_wait: Duration::ZERO,
            adaptive: None,
            ..Policy::default()
        };
        let ask = Ask::new(&p, 0.0, None);
        let granted = |o| matches!(o, Ok(Outcome::Granted { .. }));
        for i in 0..100 {
            assert!(granted(store.acquire_capped(&format!("busy-{i}"), ask)));
        }
        // Every bucket is a token short for a second: none may go, the new one is refused.
        assert!(matches!(
            store.acquire_capped("new", ask),
            Err(StoreError::Full(100))
        ));
        assert_eq!(store.len(), 100);
        assert_eq!(stats.tracked.get(), 100);
        // A held endpoint is still served from its own bucket (its second token).
        assert!(granted(store.acquire_capped("busy-7", ask)));
        assert!(matches!(
            store.acquire_capped("busy-7", ask),
            Ok(Outcome::Refused { .. })
        ));
        // Once full again the others are idle: evicted to make room, busy-7 kept.
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert!(granted(store.acquire_capped("new", ask)));
        assert_eq!(store.len(), 2);
        assert_eq!(stats.evicted.get(), 99);
        // busy-7 kept its balance (1 token refilled), not a fresh bucket's 2.
        assert!(granted(store.acquire_capped("busy-7", ask)));
        assert!(matches!(
            store.acquire_capped("busy-7", ask),
            Ok(Outcome::Refused { .. })
        ));
        // Give-backs and feedback are never refused, full or not.
        for i in 0..200 {
            store.release_now(
                &format!("late-{i}"),
                ask,
                Unused {
                    generation: 0,
                    due_in_us: 0.0,
                    at_us: None,
                },
            );
        }
        assert_eq!(store.len(), 202);
    }
}
