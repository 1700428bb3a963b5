//! How many replicas share the limits: each registers a heartbeat in the shared store
//! and learns the live count ([`Peers`]), which sets its share of every limit while the
//! store is away (`on_error = "local"`, see [`super::fallback`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::bucket::Ask;
use super::lease::LeaseAsk;
use super::redis::RedisStore;

/// How often a replica registers its heartbeat while the store answers.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);
/// A replica not heard of for this long no longer counts.
pub const HEARTBEAT_TTL: Duration = Duration::from_secs(6);

/// How many replicas share the limits: the highest count seen in the store within the
/// last [`HEARTBEAT_TTL`], never below the configured floor.
#[derive(Debug)]
pub struct Peers {
    seen: AtomicUsize,
    /// The store stopped answering since the last count was heard.
    lost: std::sync::atomic::AtomicBool,
    /// The highest count heard, and when it was last heard.
    high: Mutex<(usize, Instant)>,
    min: usize,
}

impl Peers {
    /// No count seen yet; `min` (≥ 1) is `store.fallback_min_replicas`.
    pub fn new(min: usize) -> Peers {
        Peers {
            seen: AtomicUsize::new(0),
            lost: std::sync::atomic::AtomicBool::new(false),
            high: Mutex::new((0, Instant::now())),
            min: min.max(1),
        }
    }

    /// Records a count this replica's own registration returned, logging a change.
    ///
    /// A lower count takes effect only once the higher one has gone unheard for
    /// [`HEARTBEAT_TTL`]: the replicas it no longer counts may be alive, unregistered
    /// because the store lost its state (restarted empty) just before this replica
    /// registered again. Counting itself alone then, a replica would take the whole rate
    /// during the next outage while the others take their shares (15.6/s against 10).
    ///
    /// Time the store spent not answering does not count towards that: the replicas
    /// counted went unheard because nothing could be heard, so the first replica back
    /// from an outage longer than the ttl does not count itself alone and take the whole
    /// rate if the store fails again soon after.
    pub(super) fn heard(&self, n: usize) {
        let now = Instant::now();
        let counted = {
            let mut high = self.high.lock().unwrap_or_else(PoisonError::into_inner);
            if self.lost.swap(false, Ordering::AcqRel) {
                high.1 = now;
            }
            if n >= high.0 || now.duration_since(high.1) >= HEARTBEAT_TTL {
                *high = (n, now);
            }
            high.0
        };
        if counted != self.seen.swap(counted, Ordering::Relaxed) {
            tracing::info!(replicas = counted, "replicas sharing the store");
        }
    }

    /// The store stopped answering: the count heard before stands until the store has
    /// answered for [`HEARTBEAT_TTL`] again.
    pub(super) fn store_lost(&self) {
        self.lost.store(true, Ordering::Release);
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

    /// This replica's share of `ask`: rate / N, burst / N (at least one token), each
    /// window's limit / N (at least one unit).
    pub(super) fn share(&self, ask: Ask) -> Ask {
        let n = self.count() as f64;
        Ask {
            rate: ask.rate / n,
            burst: (ask.burst / n).max(1.0),
            windows: ask.windows.shared(n),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_count_falls_only_once_the_higher_one_went_unheard_for_the_ttl() {
        let peers = Peers::new(1);
        peers.heard(3);
        assert_eq!(peers.count(), 3);
        // A store restarted empty: this replica registers first and is alone in the set.
        peers.heard(1);
        assert_eq!(peers.count(), 3, "the others may be alive");
        tokio::time::advance(HEARTBEAT_EVERY).await;
        peers.heard(3);
        tokio::time::advance(HEARTBEAT_TTL - Duration::from_millis(1)).await;
        peers.heard(2);
        assert_eq!(peers.count(), 3);
        tokio::time::advance(Duration::from_millis(1)).await;
        // Three unheard for the whole ttl: one replica has gone.
        peers.heard(2);
        assert_eq!(peers.count(), 2);
        peers.heard(4);
        assert_eq!(peers.count(), 4, "a rise counts at once");
    }
}
