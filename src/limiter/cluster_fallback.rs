//! The `on_error` policy on `redis-cluster`, hash slot by hash slot.
//!
//! A cluster spreads the endpoints' keys over its masters by hash slot
//! (`<prefix>{<endpoint>}`: one slot per endpoint). When one master fails, only the
//! endpoints of its slots lose their shared buckets; the others' keep answering. So
//! [`SlotFallbacks`] gives every hash slot in use its own [`Resilient`]: a call that
//! fails sends that slot's endpoints to the local buckets at this replica's share, and
//! every other endpoint stays on its shared bucket.
//!
//! One fallback for the whole store would send every endpoint of this replica local at
//! the first failed call, while another replica that never asked the failing node kept
//! using the shared bucket of an endpoint on a live node at the whole rate: this
//! replica's share went out on top of it (1.5 times the limit with two replicas).
//!
//! Each slot's fallback keeps its own probe, outage numbers, handover and rejoin; they
//! share the replica count ([`Peers`]) and the degraded gauge (1 while any slot is
//! degraded). The replica registers in the store once, before anything is decided
//! there: by the start-up ping, or, when that failed, by the first slot to reach the
//! store. The heartbeats keep it registered: a failed call or ping does not undo it
//! (registering again would tie every slot to the node of the heartbeat key).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::bucket::{Ask, Outcome, Unused, View};
use super::fallback::{Resilient, Shared, register};
use super::lease::{LeaseAsk, Leased};
use super::peers::Peers;
use super::{BucketStore, StoreFuture, StoreHealth, StoreStats};
use crate::config::{Adaptive, OnError};

/// Hash slots in a Redis Cluster.
const SLOTS: usize = 16_384;

/// A [`Resilient`] per cluster hash slot in use, around one cluster store.
pub struct SlotFallbacks {
    primary: Arc<dyn BucketStore>,
    /// The store's key prefix: an endpoint's key, and so its slot, is
    /// `<prefix>{<endpoint>}`.
    prefix: String,
    /// Whether the prefix holds no `{`, so an endpoint's hash tag is the endpoint.
    plain_prefix: bool,
    on_error: OnError,
    stats: StoreStats,
    peers: Arc<Peers>,
    /// The degraded count and the budget the slots' fallbacks share.
    shared: Arc<Shared>,
    /// A fallback per slot, made on first use: no lock on the way to one.
    slots: Box<[OnceLock<Box<Resilient>>]>,
    /// Whether the last ping was answered (and the replica registered).
    answered: AtomicBool,
    /// Registered in the store once (shared with the slots' fallbacks).
    registered: Arc<AtomicBool>,
    /// One registration at a time.
    registering: tokio::sync::Mutex<()>,
}

impl SlotFallbacks {
    /// Wraps the cluster store `primary` (keys under `prefix`) with the `on_error`
    /// policy per hash slot, recording the degraded gauge in `stats`.
    pub fn new(
        primary: Arc<dyn BucketStore>,
        prefix: &str,
        on_error: OnError,
        stats: StoreStats,
        peers: Arc<Peers>,
    ) -> SlotFallbacks {
        stats.degraded.set(0);
        SlotFallbacks {
            primary,
            prefix: prefix.to_owned(),
            plain_prefix: !prefix.contains('{'),
            on_error,
            stats,
            peers,
            shared: Arc::default(),
            slots: (0..SLOTS).map(|_| OnceLock::new()).collect(),
            answered: AtomicBool::new(false),
            registered: Arc::default(),
            registering: tokio::sync::Mutex::new(()),
        }
    }

    /// The hash slot of `endpoint`'s keys, as the cluster computes it: CRC16 of the
    /// key's hash tag (what the first `{` and the next `}` enclose, when not empty),
    /// else of the whole key, modulo 16384.
    fn slot_of(&self, endpoint: &str) -> u16 {
        let crc = |b: &[u8]| crc16::State::<crc16::XMODEM>::calculate(b) % SLOTS as u16;
        if self.plain_prefix && !endpoint.is_empty() && !endpoint.contains('}') {
            // The common case, with nothing to allocate: the tag is the endpoint.
            return crc(endpoint.as_bytes());
        }
        let key = format!("{}{{{endpoint}}}", self.prefix);
        let open = key.find('{').unwrap_or_default();
        match key[open + 1..].find('}') {
            Some(len) if len > 0 => crc(&key.as_bytes()[open + 1..open + 1 + len]),
            _ => crc(key.as_bytes()),
        }
    }

    /// The fallback of `endpoint`'s slot, made on first use.
    fn of(&self, endpoint: &str) -> &Resilient {
        let slot = self.slot_of(endpoint);
        self.slots[usize::from(slot)].get_or_init(|| {
            Box::new(Resilient::for_slot(
                Arc::clone(&self.primary),
                self.on_error,
                self.stats.clone(),
                Arc::clone(&self.peers),
                slot,
                Arc::clone(&self.shared),
                Arc::clone(&self.registered),
            ))
        })
    }
}

impl BucketStore for SlotFallbacks {
    fn acquire<'a>(&'a self, endpoint: &'a str, ask: Ask) -> StoreFuture<'a, Outcome> {
        self.of(endpoint).acquire(endpoint, ask)
    }

    fn release<'a>(&'a self, endpoint: &'a str, ask: Ask, unused: Unused) -> StoreFuture<'a, ()> {
        self.of(endpoint).release(endpoint, ask, unused)
    }

    fn feedback<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        adaptive: Adaptive,
        pause: Duration,
        throttled: bool,
    ) -> StoreFuture<'a, ()> {
        self.of(endpoint)
            .feedback(endpoint, ask, adaptive, pause, throttled)
    }

    fn cap<'a>(&'a self, endpoint: &'a str, ask: Ask, most: f64) -> StoreFuture<'a, ()> {
        self.of(endpoint).cap(endpoint, ask, most)
    }

    fn view<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        floor: Option<f64>,
    ) -> StoreFuture<'a, Option<View>> {
        self.of(endpoint).view(endpoint, ask, floor)
    }

    /// Asks the store (readiness must tell the truth); at start-up, registers the
    /// replica before answering (see the module doc). A failed ping sends no slot to
    /// the local buckets: only an endpoint's own failed calls do that.
    fn ping(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            let mut r = self.primary.ping().await;
            if r.is_ok() && !self.registered.load(Ordering::Acquire) {
                let _one = self.registering.lock().await;
                r = register(self.primary.as_ref(), &self.peers).await;
                if r.is_ok() {
                    self.registered.store(true, Ordering::Release);
                }
            }
            if r.is_ok() {
                // The ping reached every master: a slot still degraded resumes, though
                // its endpoints may have had no request since (a failure stays).
                for slot in self.slots.iter().filter_map(OnceLock::get) {
                    if slot.health() == StoreHealth::Degraded {
                        let _ = slot.resume().await;
                    }
                }
            }
            self.answered.store(r.is_ok(), Ordering::Release);
            r
        })
    }

    fn acquire_leased<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, Leased> {
        self.of(endpoint).acquire_leased(endpoint, ask, lease)
    }

    fn renew_lease<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, bool> {
        self.of(endpoint).renew_lease(endpoint, ask, lease)
    }

    fn adopt_lease<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, ()> {
        self.of(endpoint).adopt_lease(endpoint, ask, lease)
    }

    fn release_lease<'a>(&'a self, endpoint: &'a str, ask: Ask, id: u64) -> StoreFuture<'a, ()> {
        self.of(endpoint).release_lease(endpoint, ask, id)
    }

    /// Degraded while the last ping failed or any slot's endpoints are decided by the
    /// fallback.
    fn health(&self) -> StoreHealth {
        if !self.answered.load(Ordering::Acquire) || self.shared.any_degraded() {
            StoreHealth::Degraded
        } else {
            StoreHealth::Ok
        }
    }

    fn needs_confirm(&self, endpoint: &str, since: tokio::time::Instant) -> bool {
        self.of(endpoint).needs_confirm(endpoint, since)
    }

    fn replicas(&self) -> Option<usize> {
        Some(self.peers.count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Policy;
    use crate::limiter::Limiter;
    use crate::limiter::fallback::PROBE_EVERY;
    use crate::limiter::fallback::tests::Switched;
    use crate::limiter::memory::MemoryStore;
    use tokio::time::Instant;

    /// How long after `from` each of `n` requests for `endpoint` is let go.
    async fn waits(limiter: &Limiter, endpoint: &'static str, n: usize) -> Vec<Duration> {
        let policy = Arc::new(Policy {
            rate: 10.0,
            burst: 4.0,
            max_wait: Duration::from_secs(10),
            adaptive: None,
            ..Policy::default()
        });
        let from = Instant::now();
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let (limiter, policy) = (limiter.clone(), Arc::clone(&policy));
                tokio::spawn(async move {
                    limiter.admit(endpoint, &policy).await.expect("admitted");
                    from.elapsed()
                })
            })
            .collect();
        let mut v = Vec::new();
        for t in tasks {
            v.push(t.await.unwrap());
        }
        v.sort();
        v
    }

    /// Slot fallbacks around a switched memory store that fails only the calls of
    /// `down_endpoint` (its slot's node is down), and their degraded gauge.
    fn one_slot_down(
        down_endpoint: &'static str,
        on_error: OnError,
    ) -> (Arc<Switched>, Arc<SlotFallbacks>, StoreStats) {
        let primary = Arc::new(Switched {
            store: MemoryStore::new(),
            down: AtomicBool::new(true),
            only: Some(down_endpoint),
        });
        let stats = StoreStats::default();
        let store = Arc::new(SlotFallbacks::new(
            Arc::clone(&primary) as Arc<dyn BucketStore>,
            "sluice:",
            on_error,
            stats.clone(),
            Arc::new(Peers::new(2)),
        ));
        (primary, store, stats)
    }

    /// An endpoint's slot is the one Redis gives its bucket's key (`<prefix>{<endpoint>}`)
    /// with any prefix and any endpoint, and the `:leases` key beside it too with those
    /// the config accepts.
    #[test]
    fn an_endpoint_s_slot_is_the_one_redis_gives_its_keys() {
        use redis::cluster_routing::Slot;
        for prefix in ["sluice:", "", "a{b}:", "x{", "{}", "p}"] {
            let (_, store, _) = one_slot_down("none", OnError::Local);
            let store = SlotFallbacks::new(
                Arc::clone(&store.primary),
                prefix,
                OnError::Local,
                StoreStats::default(),
                Arc::new(Peers::new(1)),
            );
            for endpoint in ["api.example.com", "ep1", "", "a}b", "{x}", "über"] {
                let key = format!("{prefix}{{{endpoint}}}");
                let slot = Slot::new(store.slot_of(endpoint));
                assert_eq!(slot, Some(Slot::for_key(&key)), "{key}");
                // Where the config allows them (an ID of 1 to 128 characters, no brace
                // in the ID nor, on a cluster, in the prefix), its leases' key too.
                let valid = |s: &str| !s.contains(['{', '}']);
                if !endpoint.is_empty() && valid(endpoint) && valid(prefix) {
                    assert_eq!(slot, Some(Slot::for_key(format!("{key}:leases"))), "{key}");
                }
            }
        }
    }

    /// A slot whose endpoints get no more requests resumes once a ping reaches every
    /// node and the shared store takes what the local one learned; until then it
    /// stays degraded (and `/readyz` says so).
    #[tokio::test(start_paused = true)]
    async fn a_quiet_slot_resumes_when_a_ping_reaches_every_node() {
        let (primary, store, stats) = one_slot_down("on-dead-node", OnError::Local);
        store.ping().await.expect("the store answers pings");
        let limiter = Limiter::new(Arc::clone(&store) as Arc<dyn BucketStore>);
        waits(&limiter, "on-dead-node", 1).await;
        assert_eq!(store.health(), StoreHealth::Degraded);
        // The rejoin's cap for the endpoint still fails: still degraded.
        store.ping().await.expect("the other nodes answer");
        assert_eq!(store.health(), StoreHealth::Degraded);
        primary.down.store(false, Ordering::Relaxed);
        store.ping().await.expect("every node answers");
        assert_eq!(store.health(), StoreHealth::Ok);
        assert_eq!(stats.degraded.get(), 0);
    }

    /// With `on_error = "deny"`, a failing node's endpoints are refused
    /// (`store_unavailable`) and every other endpoint is served, by the shared bucket.
    #[tokio::test(start_paused = true)]
    async fn deny_refuses_only_the_endpoints_of_the_failing_slot() {
        let (_primary, store, stats) = one_slot_down("on-dead-node", OnError::Deny);
        store.ping().await.expect("the store answers pings");
        let limiter = Limiter::new(Arc::clone(&store) as Arc<dyn BucketStore>);
        let policy = Policy {
            rate: 10.0,
            burst: 4.0,
            ..Policy::default()
        };
        assert!(matches!(
            limiter.admit("on-dead-node", &policy).await,
            Err(crate::limiter::Refusal::StoreUnavailable)
        ));
        for _ in 0..4 {
            limiter
                .admit("on-live-node", &policy)
                .await
                .expect("served by the shared bucket");
        }
        assert_eq!(store.health(), StoreHealth::Degraded);
        assert_eq!(stats.degraded.get(), 1);
    }

    /// The store fails only one endpoint's calls (its slot's node is down): that
    /// endpoint is decided by a fresh, empty local bucket at this replica's share (of
    /// two), every other endpoint by the shared bucket, whole burst and all; the store
    /// reads degraded until the failing one is back on the shared bucket.
    #[tokio::test(start_paused = true)]
    async fn a_failing_slot_sends_only_its_own_endpoints_to_the_local_buckets() {
        let (primary, store, stats) = one_slot_down("on-dead-node", OnError::Local);
        assert_ne!(store.slot_of("on-dead-node"), store.slot_of("on-live-node"));
        store.ping().await.expect("the store answers pings");
        assert_eq!(store.health(), StoreHealth::Ok);
        let limiter = Limiter::new(Arc::clone(&store) as Arc<dyn BucketStore>);

        let live = waits(&limiter, "on-live-node", 4).await;
        assert_eq!(
            live,
            vec![Duration::ZERO; 4],
            "the shared bucket's whole burst"
        );
        let dead = waits(&limiter, "on-dead-node", 2).await;
        // An empty local bucket at 5/s (10/s shared by two): 0.2 s apart.
        assert_eq!(
            dead,
            vec![Duration::from_millis(200), Duration::from_millis(400)]
        );
        assert_eq!(store.health(), StoreHealth::Degraded);
        assert_eq!(stats.degraded.get(), 1);
        assert_eq!(stats.degraded_slots.get(), 1);
        // The live endpoint stays on its shared bucket meanwhile, refilled by now: its
        // whole burst, then the whole rate.
        let live = waits(&limiter, "on-live-node", 5).await;
        assert_eq!(live[3..], [Duration::ZERO, Duration::from_millis(100)]);

        primary.down.store(false, Ordering::Relaxed);
        tokio::time::sleep(PROBE_EVERY).await;
        waits(&limiter, "on-dead-node", 1).await;
        assert_eq!(store.health(), StoreHealth::Ok);
        assert_eq!(stats.degraded.get(), 0);
        assert_eq!(stats.degraded_slots.get(), 0);
    }
}
