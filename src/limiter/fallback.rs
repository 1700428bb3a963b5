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
//! The probe interval runs on tokio's clock, like the limiter and the memory store.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::time::Instant;

use super::bucket::{Ask, Outcome, View};
use super::lease::{LeaseAsk, Leased};
use super::memory::MemoryStore;
use super::{BucketStore, StoreError, StoreFuture, StoreHealth, StoreStats};
use crate::config::{Adaptive, OnError};

/// How often a degraded store lets one call try the primary again.
pub const PROBE_EVERY: Duration = Duration::from_millis(250);

/// Bit set in the generation of reservations made by the local fallback store.
pub const LOCAL_GENERATION: u64 = 1 << 62;

/// The shared store wrapped with the `on_error` policy.
pub struct Resilient {
    primary: Arc<dyn BucketStore>,
    local: ArcSwap<MemoryStore>,
    on_error: OnError,
    stats: StoreStats,
    degraded: AtomicBool,
    last_probe: Mutex<Instant>,
}

impl Resilient {
    /// Wraps `primary` with the `on_error` policy, recording the degraded gauge in `stats`.
    pub fn new(primary: Arc<dyn BucketStore>, on_error: OnError, stats: StoreStats) -> Resilient {
        stats.degraded.set(0);
        Resilient {
            primary,
            local: ArcSwap::from_pointee(MemoryStore::starting_empty()),
            on_error,
            stats,
            degraded: AtomicBool::new(false),
            last_probe: Mutex::new(Instant::now()),
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
                OnError::Local => "deciding with in-process buckets",
                OnError::Allow => "forwarding without limits",
                OnError::Deny => "refusing requests with 503 store_unavailable",
            };
            tracing::warn!(error = %e, "rate-limit store failed: {fallback} until it answers again");
        }
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
            match primary(self.primary.as_ref()).await {
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
            if let Some(g) = ask.held.filter(|g| is_local(*g)) {
                // Confirm a local reservation where it was made.
                let local = Ask {
                    held: Some(g & !LOCAL_GENERATION),
                    ..ask
                };
                return Ok(tag_local(self.local.load().acquire_now(endpoint, local)));
            }
            // A shared reservation that cannot be re-checked survives: the shared bucket
            // already paced it, and no cooldown could be learned meanwhile.
            let survived = ask.held.map(|generation| Outcome::Granted {
                wait_us: 0.0,
                generation,
            });
            self.run(
                move |p| p.acquire(endpoint, ask),
                move |l| survived.unwrap_or_else(|| tag_local(l.acquire_now(endpoint, ask))),
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
                self.local
                    .load()
                    .release_now(endpoint, ask, generation & !LOCAL_GENERATION);
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
        Box::pin(self.run(
            move |p| p.feedback(endpoint, ask, adaptive, pause, throttled),
            move |l| l.feedback_now(endpoint, ask, &adaptive, pause, throttled),
            (),
        ))
    }

    fn view<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        floor: Option<f64>,
    ) -> StoreFuture<'a, Option<View>> {
        Box::pin(self.run(
            move |p| p.view(endpoint, ask, floor),
            move |l| l.view_now(endpoint, ask, floor),
            None,
        ))
    }

    /// Always asks the primary (readiness must tell the truth), and lets the answer
    /// end or start a degraded period.
    fn ping(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            let r = self.primary.ping().await;
            match &r {
                Ok(()) => self.recovered(),
                Err(e) => self.failed(e),
            }
            r
        })
    }

    fn acquire_leased<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, Leased> {
        Box::pin(self.run(
            move |p| p.acquire_leased(endpoint, ask, lease),
            move |l| match l.acquire_leased_now(endpoint, ask, lease) {
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
            move |l| l.renew_lease_now(endpoint, ask, lease),
            true,
        ))
    }

    /// Releases wherever the lease may be: the local store (a no-op when it is not
    /// there) and the shared one.
    fn release_lease<'a>(&'a self, endpoint: &'a str, ask: Ask, id: u64) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.local.load().release_lease_now(endpoint, ask, id);
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
