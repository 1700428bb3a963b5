//! The in-process bucket store: the `bucket` math under sharded locks,
//! on tokio's monotonic clock.
//!
//! The clock is [`tokio::time::Instant`], the one the limiter sleeps on: under
//! `tokio::time::pause()` the buckets refill only as virtual time advances, so bucket,
//! cooldown and recovery behaviour can be tested deterministically. Outside a paused
//! runtime it reads the same monotonic clock as `std::time::Instant`.
//!
//! Idle buckets (full again, no cooldown, no decrease to remember) are evicted by an
//! amortised sweep, the analogue of the Redis key expiry, so a sender spraying endpoint
//! IDs cannot grow memory without bound.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
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
        }
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
        self.shards
            .iter()
            .map(|s| s.lock().map_or(0, |m| m.len()))
            .sum()
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

    /// Runs `f` on the endpoint's entry: bucket and leases (created when absent).
    fn with_entry<T>(&self, endpoint: &str, ask: &Ask, f: impl FnOnce(&mut Entry, f64) -> T) -> T {
        let (hash, idx) = self.locate(endpoint);
        let n = self.calls.fetch_add(1, Ordering::Relaxed);
        if n % SWEEP_EVERY == 0 {
            self.sweep((n / SWEEP_EVERY) as usize % SHARDS);
        }
        let mut shard = self.shards[idx].lock().unwrap_or_else(|p| p.into_inner());
        let now = self.now();
        let (_, entry) = shard
            .entry(
                hash,
                |(k, _)| **k == *endpoint,
                |(k, _)| self.hasher.hash_one(&**k),
            )
            .or_insert_with(|| {
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
        f(entry, now)
    }

    /// Evicts idle buckets of one shard.
    pub fn sweep(&self, idx: usize) {
        let now = self.now();
        if let Ok(mut shard) = self.shards[idx % SHARDS].lock() {
            shard.retain(|(_, e)| {
                lease::prune(&mut e.leases, now);
                !e.leases.is_empty() || !bucket::idle(&e.state, &e.ask, now)
            });
        }
    }

    /// Sweeps every shard.
    pub fn sweep_all(&self) {
        (0..SHARDS).for_each(|i| self.sweep(i));
    }

    /// Acquire without the future wrapper (used by the fallback path too).
    pub fn acquire_now(&self, endpoint: &str, ask: Ask) -> Outcome {
        self.with_bucket(endpoint, &ask, |s, now| bucket::acquire(s, &ask, now))
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
        let shard = self.shards[idx].lock().unwrap_or_else(|p| p.into_inner());
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
        let out = self.acquire_now(endpoint, ask);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn acquire_at_once(&self, endpoint: &str, ask: Ask) -> Option<Outcome> {
        Some(self.acquire_now(endpoint, ask))
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
        let out = self.acquire_leased_now(endpoint, ask, lease);
        Box::pin(std::future::ready(Ok(out)))
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
}
