//! How many replicas share the limits: each registers a heartbeat in the shared store
//! and learns the live count ([`Peers`]), which sets its share of every limit while the
//! store is away (`on_error = "local"`, see [`super::fallback`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::bucket::Ask;
use super::lease::LeaseAsk;
use super::redis::RedisStore;

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
    pub(super) fn heard(&self, n: usize) {
        if n != self.seen.swap(n, Ordering::Relaxed) {
            tracing::info!(replicas = n, "replicas sharing the store");
        }
    }

    /// The number of replicas this one shares each limit with (≥ 1).
    pub fn count(&self) -> usize {
        self.seen.load(Ordering::Relaxed).max(self.min)
    }

    /// This replica's share of `lease`'s slots: max / N, at least one.
    pub(super) fn share_slots(&self, lease: LeaseAsk) -> LeaseAsk {
        LeaseAsk {
            max: (lease.max as usize / self.count()).max(1) as u32,
            ..lease
        }
    }

    /// This replica's share of `ask`: rate / N, burst / N (at least one token).
    pub(super) fn share(&self, ask: Ask) -> Ask {
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
/// is [`Resilient`](super::fallback::Resilient)'s, before anything is decided in the store); ends when the store is
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
