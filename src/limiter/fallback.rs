//! The `on_error` policy around a shared store: what happens while Redis fails.
//!
//! `local` decides with an in-process bucket of the same policy, `allow` forwards
//! unlimited, `deny` refuses (503 `store_unavailable`). The degraded state is logged once
//! per transition (warn on entry, info on recovery), metered (`sluice_store_degraded`),
//! and reported by [`BucketStore::health`]. While degraded, calls go to the fallback at
//! once and at most one probe per [`PROBE_EVERY`] tries the primary, so a dead Redis
//! does not add its timeout to every request.
//!
//! Each outage starts with a fresh, *empty* local store: a bucket left over from an
//! earlier outage would have refilled and would add a burst on top of what the shared
//! bucket already let through. Reservations handed out by the local store carry
//! [`LOCAL_GENERATION`] so that their confirmation and refund go back to the store that
//! made them, whichever store is in use by then.
//!
//! The local buckets take this replica's *share* of each limit: while the store answers,
//! every replica registers a heartbeat there ([`heartbeats`]) and learns how many
//! replicas are alive ([`Peers`]); during an outage its local bucket runs at
//! `rate / N` (burst `burst / N`, at least 1), N = the last count seen, never below
//! `store.fallback_min_replicas`. A request holding a shared reservation that leaves
//! during the outage is charged to the local bucket, so the reservations the shared
//! bucket handed out before the outage are not granted a second time locally.
//!
//! The replica registers before the store decides anything for it, at start-up and again
//! when the store answers after a failure ([`Resilient::rejoin`]): an outage longer than
//! [`HEARTBEAT_TTL`] lets its heartbeat lapse, and a replica alone in the store meanwhile
//! would go on taking tokens ahead out of this one's reach (`store.prefetch = "alone"`)
//! until its next heartbeat.
//!
//! The probe interval runs on tokio's clock, like the limiter and the memory store.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::time::Instant;

use super::bucket::{Ask, Outcome, View};
use super::credit;
use super::lease::{LeaseAsk, Leased};
use super::memory::MemoryStore;
use super::redis::RedisStore;
use super::{BucketStore, StoreError, StoreFuture, StoreHealth, StoreStats};
use crate::config::{Adaptive, OnError};

/// How often a degraded store lets one call try the primary again.
pub const PROBE_EVERY: Duration = Duration::from_millis(250);

/// Bit set in the generation of reservations made by the local fallback store.
pub const LOCAL_GENERATION: u64 = 1 << 62;

/// How often a replica registers its heartbeat while the store answers.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);
/// A replica not heard of for this long no longer counts.
pub const HEARTBEAT_TTL: Duration = Duration::from_secs(6);

/// How many replicas share the limits: the last count seen in the store, never below the
/// configured floor.
#[derive(Debug)]
pub struct Peers {
    seen: AtomicUsize,
    min: usize,
}

impl Peers {
    /// No count seen yet; `min` (≥ 1) is `store.fallback_min_replicas`.
    pub fn new(min: usize) -> Peers {
        Peers {
            seen: AtomicUsize::new(0),
            min: min.max(1),
        }
    }

    /// Records a count this replica's own registration returned, logging a change.
    fn heard(&self, n: usize) {
        if n != self.seen.swap(n, Ordering::Relaxed) {
            tracing::info!(replicas = n, "replicas sharing the store");
        }
    }

    /// The number of replicas this one shares each limit with (≥ 1).
    pub fn count(&self) -> usize {
        self.seen.load(Ordering::Relaxed).max(self.min)
    }

    /// This replica's share of `ask`: rate / N, burst / N (at least one token).
    fn share(&self, ask: Ask) -> Ask {
        let n = self.count() as f64;
        Ask {
            rate: ask.rate / n,
            burst: (ask.burst / n).max(1.0),
            ..ask
        }
    }
}

/// Registers this replica in the store once and records the live count in `peers`.
/// Failures are left to the request path to report (the fallback logs and meters them).
pub async fn heartbeat(store: &RedisStore, peers: &Peers) {
    match store.heartbeat(HEARTBEAT_TTL).await {
        Ok(n) => peers.heard(n),
        Err(e) => tracing::debug!(error = %e, "replica heartbeat failed"),
    }
}

/// Registers this replica every [`HEARTBEAT_EVERY`] from now on (the first registration
/// is [`Resilient`]'s, before anything is decided in the store); ends when the store is
/// dropped.
pub async fn heartbeats(store: Weak<RedisStore>, peers: Arc<Peers>) {
    let mut tick = tokio::time::interval_at(
        tokio::time::Instant::now() + HEARTBEAT_EVERY,
        HEARTBEAT_EVERY,
    );
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(store) = store.upgrade() else { return };
        heartbeat(&store, &peers).await;
    }
}

/// The shared store wrapped with the `on_error` policy.
pub struct Resilient {
    primary: Arc<dyn BucketStore>,
    local: ArcSwap<MemoryStore>,
    on_error: OnError,
    stats: StoreStats,
    degraded: AtomicBool,
    /// Registered in the primary since it last failed: until then nothing is decided
    /// there (see [`Resilient::rejoin`]).
    registered: AtomicBool,
    last_probe: Mutex<Instant>,
    peers: Arc<Peers>,
}

impl Resilient {
    /// Wraps `primary` with the `on_error` policy, recording the degraded gauge in `stats`.
    pub fn new(
        primary: Arc<dyn BucketStore>,
        on_error: OnError,
        stats: StoreStats,
        peers: Arc<Peers>,
    ) -> Resilient {
        stats.degraded.set(0);
        Resilient {
            primary,
            local: ArcSwap::from_pointee(MemoryStore::starting_empty()),
            on_error,
            stats,
            degraded: AtomicBool::new(false),
            registered: AtomicBool::new(false),
            last_probe: Mutex::new(Instant::now()),
            peers,
        }
    }

    /// Whether this call should try the primary: always when healthy; when degraded,
    /// only the first call after each probe interval.
    fn try_primary(&self) -> bool {
        if !self.degraded.load(Ordering::Acquire) {
            return true;
        }
        let mut last = self
            .last_probe
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if last.elapsed() >= PROBE_EVERY {
            *last = Instant::now();
            true
        } else {
            false
        }
    }

    fn failed(&self, e: &StoreError) {
        self.registered.store(false, Ordering::Release);
        *self
            .last_probe
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        if self.degraded.load(Ordering::Acquire) {
            return;
        }
        // A fresh, empty fallback for this outage, installed before anyone can use it.
        self.local.store(Arc::new(MemoryStore::starting_empty()));
        if !self.degraded.swap(true, Ordering::AcqRel) {
            self.stats.degraded.set(1);
            let fallback = match self.on_error {
                OnError::Local => "deciding with in-process buckets at this replica's share",
                OnError::Allow => "forwarding without limits",
                OnError::Deny => "refusing requests with 503 store_unavailable",
            };
            tracing::warn!(error = %e, replicas = self.peers.count(), "rate-limit store failed: {fallback} until it answers again");
        }
    }

    /// Registers this replica in the primary before the primary decides anything for it:
    /// first at start-up (the start-up ping), then after each failure, when its heartbeat
    /// may have lapsed. A replica that counted itself alone in the store takes tokens
    /// ahead (`store.prefetch = "alone"`) until the script that hands them out sees this
    /// one. When others are alive, it then waits `credit::HELD_FOR` (10 ms): a replica
    /// spends tokens taken ahead only for `credit::LIFETIME` (5 ms) from sending the call
    /// that took them, then gives back the unspent ones, which Redis gives that long again
    /// to arrive. So once the wait is over, no token taken before the registration can
    /// still be spent, and the unspent ones are normally back in the bucket.
    pub async fn rejoin(&self) -> Result<(), StoreError> {
        if let Some(n) = self.primary.register().await? {
            self.peers.heard(n);
            // Alone, nobody else can hold tokens taken ahead.
            if n > 1 {
                tokio::time::sleep(credit::HELD_FOR).await;
            }
        }
        self.registered.store(true, Ordering::Release);
        Ok(())
    }

    fn recovered(&self) {
        if self.degraded.swap(false, Ordering::AcqRel) {
            self.stats.degraded.set(0);
            tracing::info!("rate-limit store answers again: shared buckets back in use");
        }
    }

    /// Runs `primary` (when allowed); else, or when it fails, applies `on_error`:
    /// `fallback` on the local store, `allow`, or the error.
    async fn run<'a, T>(
        &'a self,
        primary: impl FnOnce(&'a dyn BucketStore) -> StoreFuture<'a, T>,
        fallback: impl FnOnce(&MemoryStore) -> T,
        allow: T,
    ) -> Result<T, StoreError> {
        let err = if self.try_primary() {
            // Registered first (see `rejoin`).
            let rejoined = if !self.registered.load(Ordering::Acquire) {
                self.rejoin().await
            } else {
                Ok(())
            };
            let answer = match rejoined {
                Ok(()) => primary(self.primary.as_ref()).await,
                Err(e) => Err(e),
            };
            match answer {
                Ok(v) => {
                    self.recovered();
                    return Ok(v);
                }
                Err(e) => {
                    self.failed(&e);
                    e
                }
            }
        } else {
            StoreError::Unreachable("store degraded; waiting for the next probe".into())
        };
        match self.on_error {
            OnError::Local => Ok(fallback(&self.local.load())),
            OnError::Allow => Ok(allow),
            OnError::Deny => Err(err),
        }
    }
}

/// Marks an outcome of the local store as local.
fn tag_local(o: Outcome) -> Outcome {
    match o {
        Outcome::Granted {
            wait_us,
            generation,
        } => Outcome::Granted {
            wait_us,
            generation: generation | LOCAL_GENERATION,
        },
        refused => refused,
    }
}

fn is_local(generation: u64) -> bool {
    generation & LOCAL_GENERATION != 0
}

impl BucketStore for Resilient {
    fn acquire<'a>(&'a self, endpoint: &'a str, ask: Ask) -> StoreFuture<'a, Outcome> {
        Box::pin(async move {
            let share = self.peers.share(ask);
            if let Some(g) = ask.held.filter(|g| is_local(*g)) {
                // Confirm a local reservation where it was made.
                let local = Ask {
                    held: Some(g & !LOCAL_GENERATION),
                    ..share
                };
                return Ok(tag_local(self.local.load().acquire_now(endpoint, local)));
            }
            // A shared reservation that cannot be re-checked survives: the shared bucket
            // already paced it, and no cooldown could be learned meanwhile. It is charged
            // to the local bucket, which must not grant its slot a second time.
            let survived = ask.held;
            self.run(
                move |p| p.acquire(endpoint, ask),
                move |l| match survived {
                    Some(generation) => {
                        l.charge_now(
                            endpoint,
                            Ask {
                                held: None,
                                ..share
                            },
                        );
                        Outcome::Granted {
                            wait_us: 0.0,
                            generation,
                        }
                    }
                    None => tag_local(l.acquire_now(endpoint, share)),
                },
                Outcome::Granted {
                    wait_us: 0.0,
                    generation: u64::MAX,
                },
            )
            .await
        })
    }

    fn release<'a>(&'a self, endpoint: &'a str, ask: Ask, generation: u64) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            if is_local(generation) {
                self.local.load().release_now(
                    endpoint,
                    self.peers.share(ask),
                    generation & !LOCAL_GENERATION,
                );
                return Ok(());
            }
            // A shared reservation can only be given back to the shared store.
            self.run(move |p| p.release(endpoint, ask, generation), |_| (), ())
                .await
        })
    }

    fn feedback<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        adaptive: Adaptive,
        pause: Duration,
        throttled: bool,
    ) -> StoreFuture<'a, ()> {
        let n = self.peers.count() as f64;
        let (share, local_adaptive) = (
            self.peers.share(ask),
            Adaptive {
                floor: adaptive.floor / n,
                ..adaptive
            },
        );
        Box::pin(self.run(
            move |p| p.feedback(endpoint, ask, adaptive, pause, throttled),
            move |l| l.feedback_now(endpoint, share, &local_adaptive, pause, throttled),
            (),
        ))
    }

    fn view<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        floor: Option<f64>,
    ) -> StoreFuture<'a, Option<View>> {
        let (share, n) = (self.peers.share(ask), self.peers.count() as f64);
        Box::pin(self.run(
            move |p| p.view(endpoint, ask, floor),
            move |l| l.view_now(endpoint, share, floor.map(|f| f / n)),
            None,
        ))
    }

    /// Always asks the primary (readiness must tell the truth), and lets the answer
    /// end or start a degraded period.
    fn ping(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            let r = match self.primary.ping().await {
                // At start-up and back from an outage: registered before any request is
                // decided there.
                Ok(()) if !self.registered.load(Ordering::Acquire) => self.rejoin().await,
                r => r,
            };
            match &r {
                Ok(()) => self.recovered(),
                Err(e) => self.failed(e),
            }
            r
        })
    }

    fn replicas(&self) -> Option<usize> {
        Some(self.peers.count())
    }

    /// While degraded, always confirm (the local store answers at once anyway).
    fn needs_confirm(&self, endpoint: &str, since: tokio::time::Instant) -> bool {
        self.degraded.load(Ordering::Acquire) || self.primary.needs_confirm(endpoint, since)
    }

    fn acquire_leased<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, Leased> {
        let share = self.peers.share(ask);
        Box::pin(self.run(
            move |p| p.acquire_leased(endpoint, ask, lease),
            move |l| match l.acquire_leased_now(endpoint, share, lease) {
                Leased::Took(o) => Leased::Took(tag_local(o)),
                busy => busy,
            },
            Leased::Took(Outcome::Granted {
                wait_us: 0.0,
                generation: u64::MAX,
            }),
        ))
    }

    fn renew_lease<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, bool> {
        Box::pin(self.run(
            move |p| p.renew_lease(endpoint, ask, lease),
            move |l| l.renew_lease_now(endpoint, self.peers.share(ask), lease),
            true,
        ))
    }

    /// Releases wherever the lease may be: the local store (a no-op when it is not
    /// there) and the shared one.
    fn release_lease<'a>(&'a self, endpoint: &'a str, ask: Ask, id: u64) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.local
                .load()
                .release_lease_now(endpoint, self.peers.share(ask), id);
            self.run(move |p| p.release_lease(endpoint, ask, id), |_| (), ())
                .await
        })
    }

    fn health(&self) -> StoreHealth {
        if self.degraded.load(Ordering::Acquire) {
            StoreHealth::Degraded
        } else {
            StoreHealth::Ok
        }
    }
}
