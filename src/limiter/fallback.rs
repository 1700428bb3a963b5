//! The `on_error` policy around a shared store: what happens while Redis fails.
//!
//! `local` decides with an in-process bucket of the same policy, `allow` forwards
//! unlimited, `deny` refuses (503 `store_unavailable`). The degraded state is logged once
//! per transition, metered (`sluice_store_degraded`), and shown by `/readyz`. While
//! degraded, requests go to the fallback at once and at most one probe per interval
//! tries the primary, so a dead Redis does not add its timeout to every request.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::bucket::{Ask, Outcome, View};
use super::memory::MemoryStore;
use super::{BucketStore, StoreError, StoreFuture, StoreHealth, StoreStats};
use crate::config::{Adaptive, OnError};

/// How often a degraded store lets one call try the primary again.
const PROBE_EVERY: Duration = Duration::from_millis(250);

/// The shared store wrapped with the `on_error` policy.
pub struct Resilient {
    primary: Arc<dyn BucketStore>,
    local: MemoryStore,
    on_error: OnError,
    stats: StoreStats,
    degraded: AtomicBool,
    last_probe: Mutex<Instant>,
}

impl Resilient {
    /// Wraps `primary`.
    pub fn new(primary: Arc<dyn BucketStore>, on_error: OnError, stats: StoreStats) -> Resilient {
        Resilient {
            primary,
            local: MemoryStore::starting_empty(),
            on_error,
            stats,
            degraded: AtomicBool::new(false),
            last_probe: Mutex::new(Instant::now()),
        }
    }

    /// Whether this call should try the primary (always when healthy; one per interval when not).
    fn try_primary(&self) -> bool {
        if !self.degraded.load(Ordering::Relaxed) {
            return true;
        }
        let mut last = self.last_probe.lock().unwrap_or_else(|p| p.into_inner());
        if last.elapsed() >= PROBE_EVERY {
            *last = Instant::now();
            true
        } else {
            false
        }
    }

    fn failed(&self, e: &StoreError) {
        *self.last_probe.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        if !self.degraded.swap(true, Ordering::Relaxed) {
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
        if self.degraded.swap(false, Ordering::Relaxed) {
            self.stats.degraded.set(0);
            tracing::info!("rate-limit store answers again: shared buckets back in use");
        }
    }

    /// Runs `primary` (when allowed), else or on failure `fallback`.
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
            OnError::Local => Ok(fallback(&self.local)),
            OnError::Allow => Ok(allow),
            OnError::Deny => Err(err),
        }
    }
}

impl BucketStore for Resilient {
    fn acquire<'a>(&'a self, endpoint: &'a str, ask: Ask) -> StoreFuture<'a, Outcome> {
        Box::pin(self.run(
            move |p| p.acquire(endpoint, ask),
            move |l| l.acquire_now(endpoint, ask),
            Outcome::Granted {
                wait_us: 0.0,
                generation: u64::MAX,
            },
        ))
    }

    fn release<'a>(&'a self, endpoint: &'a str, ask: Ask, generation: u64) -> StoreFuture<'a, ()> {
        Box::pin(self.run(
            move |p| p.release(endpoint, ask, generation),
            move |l| l.release_now(endpoint, ask, generation),
            (),
        ))
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

    fn health(&self) -> StoreHealth {
        if self.degraded.load(Ordering::Relaxed) {
            StoreHealth::Degraded
        } else {
            StoreHealth::Ok
        }
    }
}
