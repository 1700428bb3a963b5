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
//! bucket already let through. Nor does a local bucket refill before its endpoint's
//! *horizon*, the start of the last reservation the shared bucket was seen to grant or
//! the end of a cooldown it was seen to hold ([`super::handover`]): until then the slots belong
//! to requests already holding shared reservations, which leave uncharged when they wake
//! (one that wakes later is charged), or to nobody while the receiver cools down.
//!
//! The other way round, a 429 the local store learns from during an outage (a cooldown,
//! a decrease) is handed to the shared store before it decides anything again
//! ([`Resilient::rejoin`]): guarantee 4 holds across both changes. A cooldown another
//! replica started, heard as a notice before the outage
//! ([`BucketStore::cooling_heard`]), holds in the local bucket until its end too.
//!
//! A lease the shared store may hold for nobody (a leased call that went unanswered,
//! its request then answered by the local store or refused; a lease whose release could
//! not reach the store) is owed to it: released there as soon as it answers again,
//! before it decides anything else for this replica ([`Resilient::rejoin`]), whatever
//! `on_error`.
//!
//! Reservations handed out by the local store carry [`LOCAL_GENERATION`] and the number
//! of the outage whose store made them. Confirmed during that outage, they stay local.
//! Once the shared store answers again (or another outage has a new local store), the
//! store deciding never counted them: they ask it afresh, like a new request, rather than
//! leave on top of what it grants. So that no such request leaves unasked, every
//! reservation made before the last change of store is confirmed on waking
//! ([`BucketStore::needs_confirm`]).
//!
//! The local buckets take this replica's *share* of each limit: while the store answers,
//! every replica registers a heartbeat there and learns how many replicas are alive
//! ([`super::peers`]); during an outage its local bucket runs at
//! `rate / N` (burst `burst / N`, at least 1), N = the last count seen, never below
//! `store.fallback_min_replicas`.
//!
//! The replica registers before the store decides anything for it, at start-up and again
//! when the store answers after a failure ([`Resilient::rejoin`]): an outage longer than
//! [`HEARTBEAT_TTL`](super::peers::HEARTBEAT_TTL) lets its heartbeat lapse, and a replica alone in the store meanwhile
//! would go on taking tokens ahead out of this one's reach (`store.prefetch = "alone"`)
//! until its next heartbeat.
//!
//! On `redis-cluster`, one `Resilient` serves each hash slot in use
//! ([`super::cluster_fallback`]): a failing node sends only its own slots' endpoints to
//! the local buckets. Such a one is made with [`Resilient::for_slot`]; it shares the
//! degraded gauge with the others and leaves registering the replica to its owner.
//!
//! The probe interval runs on tokio's clock, like the limiter and the memory store.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::time::Instant;

use super::bucket::{Ask, Outcome, Unused, View};
use super::credit;
use super::handover::Handover;
use super::lease::{LeaseAsk, Leased};
use super::memory::MemoryStore;
use super::peers::Peers;
use super::{BucketStore, StoreError, StoreFuture, StoreHealth, StoreStats};
use crate::config::{Adaptive, OnError};

/// How often a degraded store lets one call try the primary again.
pub const PROBE_EVERY: Duration = Duration::from_millis(250);

/// Most leases kept owed to the shared store (the oldest is dropped past it: that one
/// expires there at its `lease_ttl`). A degraded store sends one call per
/// [`PROBE_EVERY`], so this covers an outage of over 15 minutes of leased probes.
const MAX_OWED: usize = 4096;

/// Bit set in the generation of reservations made by the local fallback store; bits
/// 32–61 hold the outage's number, bits 0–31 the local bucket's generation.
pub const LOCAL_GENERATION: u64 = 1 << 62;
/// The local bucket's own generation in a local reservation's generation.
const LOCAL_BUCKET_GENERATION: u64 = 0xFFFF_FFFF;
/// The outage's number in a local reservation's generation (above the bucket's).
const OUTAGE_NUMBER: u64 = (LOCAL_GENERATION - 1) & !LOCAL_BUCKET_GENERATION;

/// One outage's local store, with the outage's number for the reservations it makes.
struct Local {
    store: MemoryStore,
    outage: u64,
}

impl Local {
    /// Marks an outcome of this store as local and its own.
    fn tag(&self, o: Outcome) -> Outcome {
        match o {
            Outcome::Granted {
                wait_us,
                generation,
                at_us,
            } => Outcome::Granted {
                wait_us,
                at_us,
                generation: LOCAL_GENERATION
                    | (self.outage << 32) & OUTAGE_NUMBER
                    | generation & LOCAL_BUCKET_GENERATION,
            },
            refused => refused,
        }
    }

    /// The local bucket's generation of a reservation this store made; `None` when
    /// another store made it.
    fn own(&self, generation: u64) -> Option<u64> {
        let outage = (generation & OUTAGE_NUMBER) >> 32;
        (is_local(generation) && outage == self.outage & (OUTAGE_NUMBER >> 32))
            .then_some(generation & LOCAL_BUCKET_GENERATION)
    }
}

/// The shared store wrapped with the `on_error` policy.
pub struct Resilient {
    primary: Arc<dyn BucketStore>,
    local: ArcSwap<Local>,
    /// Outages so far: numbers each one's local store.
    outages: AtomicU64,
    /// What the stores tell each other at a change (`on_error = "local"` only).
    handover: Option<Handover>,
    /// When the store deciding last changed (µs since `born`, plus one; 0: never).
    changed: AtomicU64,
    born: Instant,
    on_error: OnError,
    stats: StoreStats,
    degraded: AtomicBool,
    /// Registered in the primary since it last failed: until then nothing is decided
    /// there (see [`Resilient::rejoin`]).
    registered: AtomicBool,
    last_probe: Mutex<Instant>,
    peers: Arc<Peers>,
    /// One rejoin at a time: none declares the replica registered while another is
    /// still handing the shared store what it must know.
    rejoining: tokio::sync::Mutex<()>,
    /// A rejoin has begun reading (or is about to read) what the local buckets have left,
    /// to cap the shared ones with it: set under `local_gate`'s write lock, so no local
    /// decision falls between its check and that read.
    rejoin_under_way: AtomicBool,
    /// Held (read) across every local decision, taken (write) to start a rejoin.
    local_gate: std::sync::RwLock<()>,
    /// What this fallback covers, and the count of degraded ones it shares.
    scope: Scope,
    /// Leases the primary may hold for nobody, released there at the next rejoin.
    owed: Mutex<VecDeque<Owed>>,
}

/// A lease the primary may hold although no request of this replica does.
struct Owed {
    endpoint: Box<str>,
    ask: Ask,
    id: u64,
}

/// What one [`Resilient`] covers: the whole store, or one cluster hash slot among
/// others that share the degraded gauge.
struct Scope {
    /// The hash slot (`None`: every endpoint).
    slot: Option<u16>,
    /// The fallbacks that share the gauge.
    shared: Arc<Shared>,
    /// `None`: this one registers the replica in the store before deciding there,
    /// every time. A slot's: whether its owner ([`super::cluster_fallback::SlotFallbacks`])
    /// has registered it once (the heartbeats keep it registered after that); until
    /// then a slot's rejoin registers it.
    registered: Option<Arc<AtomicBool>>,
}

/// What the fallbacks of one store's slots share.
#[derive(Default)]
pub struct Shared {
    /// How many are degraded now: the gauge is 1 while any is. Changed together with
    /// a fallback's own state and the gauge, under this lock.
    degraded: Mutex<usize>,
    /// Endpoints their handovers keep as decided locally, all told (at most
    /// [`Handover::MAX_DECIDED`]).
    decided: Arc<AtomicUsize>,
}

impl Shared {
    /// Whether any of the fallbacks is degraded.
    pub fn any_degraded(&self) -> bool {
        *self.degraded.lock().unwrap_or_else(PoisonError::into_inner) > 0
    }
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
        let scope = Scope {
            slot: None,
            shared: Arc::default(),
            registered: None,
        };
        Resilient::scoped(primary, on_error, stats, peers, scope)
    }

    /// The fallback for the endpoints of one cluster hash slot: degraded only when
    /// their calls fail (or until a ping reaches every node, [`Resilient::resume`]),
    /// counted in `shared` with the other slots' (the gauge in `stats` is 1 while any
    /// is). It registers the replica only while `registered`, its owner's, says it has
    /// not been yet (the start-up ping failed): the heartbeats keep it registered.
    pub fn for_slot(
        primary: Arc<dyn BucketStore>,
        on_error: OnError,
        stats: StoreStats,
        peers: Arc<Peers>,
        slot: u16,
        shared: Arc<Shared>,
        registered: Arc<AtomicBool>,
    ) -> Resilient {
        let scope = Scope {
            slot: Some(slot),
            shared,
            registered: Some(registered),
        };
        Resilient::scoped(primary, on_error, stats, peers, scope)
    }

    fn scoped(
        primary: Arc<dyn BucketStore>,
        on_error: OnError,
        stats: StoreStats,
        peers: Arc<Peers>,
        scope: Scope,
    ) -> Resilient {
        let handover = (on_error == OnError::Local)
            .then(|| Handover::sharing(Arc::clone(&scope.shared.decided)));
        Resilient {
            primary,
            local: ArcSwap::from_pointee(Local {
                store: MemoryStore::fallback(Arc::default()),
                outage: 0,
            }),
            outages: AtomicU64::new(0),
            handover,
            changed: AtomicU64::new(0),
            born: Instant::now(),
            on_error,
            stats,
            degraded: AtomicBool::new(false),
            registered: AtomicBool::new(false),
            last_probe: Mutex::new(Instant::now()),
            rejoining: tokio::sync::Mutex::new(()),
            rejoin_under_way: AtomicBool::new(false),
            local_gate: std::sync::RwLock::new(()),
            peers,
            scope,
            owed: Mutex::new(VecDeque::new()),
        }
    }

    /// Remembers that the primary may hold lease `id` of `endpoint` for nobody.
    fn owe(&self, endpoint: &str, ask: Ask, id: u64) {
        let mut owed = self.owed.lock().unwrap_or_else(PoisonError::into_inner);
        if owed.len() >= MAX_OWED {
            owed.pop_front();
        }
        owed.push_back(Owed {
            endpoint: endpoint.into(),
            ask,
            id,
        });
    }

    /// Releases in the primary every lease owed to it; what fails stays owed.
    async fn settle(&self) -> Result<(), StoreError> {
        loop {
            let next = self
                .owed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop_front();
            let Some(o) = next else { return Ok(()) };
            if let Err(e) = self.primary.release_lease(&o.endpoint, o.ask, o.id).await {
                let mut owed = self.owed.lock().unwrap_or_else(PoisonError::into_inner);
                owed.push_front(o);
                return Err(e);
            }
        }
    }

    /// Brings into the local store a cooldown of `endpoint` the primary heard announced
    /// (another replica's 429) and this replica did not know of yet: no local grant
    /// before its end, shared reservations made before it void, and the bucket empty
    /// after it, as the shared bucket is.
    fn heard(&self, endpoint: &str, ask: Ask, local: &Local) {
        let Some(h) = &self.handover else { return };
        let Some(until) = self.primary.cooling_heard(endpoint) else {
            return;
        };
        if h.cooling_until(endpoint).is_some_and(|t| t >= until) {
            return;
        }
        h.cooling(endpoint, ask, until);
        let pause = until.saturating_duration_since(Instant::now());
        let share = self.peers.share(ask);
        // A pause without a decrease: the adaptive settings go unused.
        let adaptive = Adaptive::default();
        local
            .store
            .feedback_now(endpoint, share, &adaptive, pause, false);
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
        self.peers.store_lost();
        *self
            .last_probe
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        if self.degraded.load(Ordering::Acquire) {
            return;
        }
        // A fresh, empty fallback for this outage, installed before anyone can use it,
        // counting the slots this replica's requests hold.
        let horizons = self.handover.as_ref().map(|h| Arc::clone(h.horizons()));
        let local = Local {
            store: MemoryStore::fallback(horizons.unwrap_or_default()),
            outage: self.outages.fetch_add(1, Ordering::AcqRel) + 1,
        };
        for f in self.handover.iter().flat_map(Handover::flying) {
            let share = self.peers.share(f.ask);
            local.store.adopt_lease_now(&f.endpoint, share, f.lease);
        }
        self.local.store(Arc::new(local));
        if let Some(first) = self.turn(true) {
            self.changed_now();
            let fallback = match self.on_error {
                OnError::Local => "deciding with in-process buckets at this replica's share",
                OnError::Allow => "forwarding without limits",
                OnError::Deny => "refusing requests with 503 store_unavailable",
            };
            // A cluster slot warns when it is the first to fail (one line per outage,
            // not one per slot of a dead node); the others say so at debug level.
            match self.scope.slot {
                None => {
                    tracing::warn!(error = %e, replicas = self.peers.count(), "rate-limit store failed: {fallback} until it answers again")
                }
                Some(slot) if first => {
                    tracing::warn!(error = %e, slot, replicas = self.peers.count(), "rate-limit store failed for the endpoints of a cluster slot (the node serving it; other slots may follow): {fallback} for them until it answers again")
                }
                Some(slot) => {
                    tracing::debug!(error = %e, slot, "rate-limit store failed for the endpoints of another cluster slot: {fallback} for them")
                }
            }
        }
    }

    /// Turns this fallback degraded (`on`) or back, with the count and the gauge it
    /// shares, under one lock. `None` when it already was; else whether it was the
    /// first to turn degraded (`on`) or the last to turn back of those sharing the
    /// gauge.
    fn turn(&self, on: bool) -> Option<bool> {
        let mut n = self
            .scope
            .shared
            .degraded
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if self.degraded.swap(on, Ordering::AcqRel) == on {
            return None;
        }
        let edge = if on {
            *n += 1;
            *n == 1
        } else {
            *n = n.saturating_sub(1);
            *n == 0
        };
        if edge {
            self.stats.degraded.set(i64::from(on));
        }
        if self.scope.slot.is_some() {
            self.stats.degraded_slots.set(*n as i64);
        }
        Some(edge)
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
    ///
    /// Back from an outage, it then hands the shared store the cooldowns and decreases
    /// the local store learned meanwhile, and the slots this replica's requests hold
    /// ([`Handover::teach`]): guarantee 4 and `max_in_flight` hold across the change.
    /// Last, it releases the leases owed to the shared store (see [`Resilient::owe`]):
    /// a leased call Redis ran late (a stall, a network that held the bytes) holds no
    /// slot for nobody past this point.
    pub async fn rejoin(&self) -> Result<(), StoreError> {
        let _one = self.rejoining.lock().await;
        {
            let _no_local = self
                .local_gate
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            self.rejoin_under_way.store(true, Ordering::Release);
        }
        // Lowered however the rejoin ends, a call dropped mid-way included.
        let _under_way = Lowers(&self.rejoin_under_way);
        self.rejoin_now().await
    }

    /// [`Resilient::rejoin`]'s steps, under its lock.
    async fn rejoin_now(&self) -> Result<(), StoreError> {
        match &self.scope.registered {
            None => register(self.primary.as_ref(), &self.peers).await?,
            Some(once) if !once.load(Ordering::Acquire) => {
                register(self.primary.as_ref(), &self.peers).await?;
                once.store(true, Ordering::Release);
            }
            Some(_) => {}
        }
        if let Some(h) = &self.handover {
            let (local, peers) = (self.local.load(), &self.peers);
            let share = |ask| peers.share(ask);
            h.teach(self.primary.as_ref(), &local.store, peers.count(), share)
                .await?;
        }
        self.settle().await?;
        self.registered.store(true, Ordering::Release);
        Ok(())
    }

    /// Records that the store deciding changed now.
    fn changed_now(&self) {
        let us = self.born.elapsed().as_micros() as u64 + 1;
        self.changed.store(us, Ordering::Release);
    }

    /// Whether the store deciding changed at or after `since`.
    fn changed_since(&self, since: Instant) -> bool {
        match self.changed.load(Ordering::Acquire) {
            0 => false,
            at => (since.saturating_duration_since(self.born).as_micros() as u64) < at,
        }
    }

    /// Records how far ahead the shared bucket of `endpoint` is spoken for, as `o` shows
    /// it: a reservation's start, or a cooldown's end. Only `on_error = "local"` keeps it,
    /// and only for a wait, so a limit that never binds records nothing.
    fn saw(&self, endpoint: &str, ask: Ask, o: &Outcome) {
        let Some(h) = &self.handover else { return };
        let at = |us| Instant::now() + super::from_micros(us);
        match *o {
            Outcome::Granted {
                wait_us,
                generation,
                ..
            } if wait_us > 0.0 && !is_local(generation) => h.spoken_for(endpoint, ask, at(wait_us)),
            Outcome::Refused {
                cooldown: true,
                retry_us,
            } => h.cooling(endpoint, ask, at(retry_us)),
            _ => {}
        }
    }

    fn recovered(&self) {
        // Every answered call comes here: the lock only when something changes.
        if !self.degraded.load(Ordering::Acquire) {
            return;
        }
        if let Some(last) = self.turn(false) {
            self.changed_now();
            match self.scope.slot {
                None => {
                    tracing::info!("rate-limit store answers again: shared buckets back in use")
                }
                Some(_) if last => tracing::info!(
                    "rate-limit store answers again for every cluster slot: shared buckets back in use"
                ),
                Some(slot) => tracing::debug!(
                    slot,
                    "rate-limit store answers again for the endpoints of a cluster slot: shared buckets back in use for them"
                ),
            }
        }
    }

    /// Ends a degraded period after the store answered a ping that reached every node
    /// (a cluster's `PING` does): rejoins first, as a call would, so the shared store
    /// learns what the local one did before it decides again. Without this, a slot
    /// whose endpoints get no more requests would read degraded for good.
    pub async fn resume(&self) -> Result<(), StoreError> {
        if !self.degraded.load(Ordering::Acquire) {
            return Ok(());
        }
        self.answered().await
    }

    /// The store answered (a ping): rejoins first when a failure undid the registration
    /// (at start-up and back from an outage: registered before any request is decided
    /// there), then ends a degraded period; a failed rejoin starts one.
    async fn answered(&self) -> Result<(), StoreError> {
        let r = if self.registered.load(Ordering::Acquire) {
            Ok(())
        } else {
            self.rejoin().await
        };
        match &r {
            Ok(()) => self.recovered(),
            Err(e) => self.failed(e),
        }
        r
    }

    /// Runs `primary` (when allowed); else, or when it fails, applies `on_error`:
    /// `fallback` on the local store, `allow`, or the error.
    async fn run<'a, T>(
        &'a self,
        primary: impl FnOnce(&'a dyn BucketStore) -> StoreFuture<'a, T>,
        fallback: impl FnOnce(&Local) -> T,
        allow: T,
    ) -> Result<T, StoreError> {
        let mut primary = Some(primary);
        let err = if self.try_primary() {
            // Registered first (see `rejoin`).
            let rejoined = if !self.registered.load(Ordering::Acquire) {
                self.rejoin().await
            } else {
                Ok(())
            };
            match rejoined {
                Ok(()) => match self.ask_primary(&mut primary).await {
                    Ok(v) => return Ok(v),
                    Err(e) => e,
                },
                Err(e) => {
                    self.failed(&e);
                    e
                }
            }
        } else {
            StoreError::Unreachable("store degraded; waiting for the next probe".into())
        };
        match self.on_error {
            OnError::Local => {
                {
                    let _deciding = self
                        .local_gate
                        .read()
                        .unwrap_or_else(PoisonError::into_inner);
                    let rejoining = self.rejoin_under_way.load(Ordering::Acquire);
                    if !rejoining && !self.registered.load(Ordering::Acquire) {
                        return Ok(fallback(&self.local.load()));
                    }
                }
                // A rejoin is reading, or has read, what the local buckets have left to
                // cap the shared ones: a local decision now would come on top of the cap
                // (10 requests in 9 ms against a burst of 5). Once it ends, the shared store decides, capped, unless it
                // failed meanwhile.
                drop(self.rejoining.lock().await);
                if self.registered.load(Ordering::Acquire) {
                    if let Ok(v) = self.ask_primary(&mut primary).await {
                        return Ok(v);
                    }
                }
                Ok(fallback(&self.local.load()))
            }
            OnError::Allow => Ok(allow),
            OnError::Deny => Err(err),
        }
    }

    /// Runs `primary` once (when not run yet): its answer ends a degraded period, its
    /// failure starts one.
    async fn ask_primary<'a, T>(
        &'a self,
        primary: &mut Option<impl FnOnce(&'a dyn BucketStore) -> StoreFuture<'a, T>>,
    ) -> Result<T, StoreError> {
        let Some(call) = primary.take() else {
            return Err(StoreError::Unreachable("asked already".into()));
        };
        match call(self.primary.as_ref()).await {
            Ok(v) => {
                self.recovered();
                Ok(v)
            }
            Err(e) => {
                self.failed(&e);
                Err(e)
            }
        }
    }
}

/// Lowers its flag when dropped.
struct Lowers<'a>(&'a AtomicBool);

impl Drop for Lowers<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Registers this replica in `primary` and learns how many replicas are alive; when
/// others are, waits until no token one of them took ahead before seeing this one can
/// still be spent (see [`Resilient::rejoin`]).
pub async fn register(primary: &dyn BucketStore, peers: &Peers) -> Result<(), StoreError> {
    if let Some(n) = primary.register().await? {
        peers.heard(n);
        // Alone, nobody else can hold tokens taken ahead.
        if n > 1 {
            tokio::time::sleep(credit::HELD_FOR).await;
        }
    }
    Ok(())
}

fn is_local(generation: u64) -> bool {
    generation & LOCAL_GENERATION != 0
}

impl BucketStore for Resilient {
    fn acquire<'a>(&'a self, endpoint: &'a str, mut ask: Ask) -> StoreFuture<'a, Outcome> {
        Box::pin(async move {
            // What the local store is asked: this replica's share, holding nothing of it.
            let share = Ask {
                held: None,
                ..self.peers.share(ask)
            };
            if let Some(g) = ask.held.filter(|g| is_local(*g)) {
                // Degraded first, then the store: an outage installs its store before
                // it sets `degraded`, so a store loaded after is that outage's own.
                let degraded = self.degraded.load(Ordering::Acquire);
                let local = self.local.load();
                match local.own(g) {
                    // Confirm a reservation of this outage's local store there.
                    Some(own) if degraded => {
                        let ask = Ask {
                            held: Some(own),
                            ..share
                        };
                        return Ok(local.tag(local.store.acquire_now(endpoint, ask)));
                    }
                    // The store deciding now never counted it: ask afresh.
                    _ => ask.held = None,
                }
            }
            // A shared reservation that cannot be re-checked survives: the shared bucket
            // already paced it. The local bucket left it its slot (see `Horizons`); if it
            // wakes past that, it is charged there. Unless this replica knows of a
            // cooldown going on: then it is void, as the shared store would have said.
            let survived = ask.held;
            let outcome = self
                .run(
                    move |p| p.acquire(endpoint, ask),
                    move |l| {
                        if let Some(h) = &self.handover {
                            h.decided_locally(endpoint, ask);
                        }
                        self.heard(endpoint, ask, l);
                        match survived {
                            // Void if a cooldown began since it was made (the cooldown's
                            // end is past it): asked afresh, locally.
                            Some(_)
                                if self.handover.as_ref().is_some_and(|h| h.cools(endpoint)) =>
                            {
                                l.tag(l.store.acquire_now(endpoint, share))
                            }
                            Some(generation) => {
                                l.store.charge_survivor_now(endpoint, share);
                                Outcome::Granted {
                                    wait_us: 0.0,
                                    generation,
                                    at_us: None,
                                }
                            }
                            None => l.tag(l.store.acquire_now(endpoint, share)),
                        }
                    },
                    Outcome::Granted {
                        wait_us: 0.0,
                        generation: u64::MAX,
                        at_us: None,
                    },
                )
                .await?;
            self.saw(endpoint, ask, &outcome);
            Ok(outcome)
        })
    }

    fn release<'a>(&'a self, endpoint: &'a str, ask: Ask, unused: Unused) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            if is_local(unused.generation) {
                // Back to the local store that made it; one no longer in use counted
                // it nowhere else.
                let local = self.local.load();
                if let Some(own) = local.own(unused.generation) {
                    let share = self.peers.share(ask);
                    let unused = Unused {
                        generation: own,
                        ..unused
                    };
                    local.store.release_now(endpoint, share, unused);
                }
                return Ok(());
            }
            // A shared reservation can only be given back to the shared store.
            self.run(move |p| p.release(endpoint, ask, unused), |_| (), ())
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
        if let Some(h) = self.handover.as_ref().filter(|_| !pause.is_zero()) {
            // A local bucket taking over keeps the cooldown too, and shared reservations
            // made before it are void.
            h.cooling(endpoint, ask, Instant::now() + pause);
        }
        Box::pin(self.run(
            move |p| p.feedback(endpoint, ask, adaptive, pause, throttled),
            move |l| {
                l.store
                    .feedback_now(endpoint, share, &local_adaptive, pause, throttled);
                if let Some(h) = &self.handover {
                    h.learn(endpoint, ask, adaptive, pause, throttled);
                }
            },
            (),
        ))
    }

    fn cap<'a>(&'a self, endpoint: &'a str, ask: Ask, most: f64) -> StoreFuture<'a, ()> {
        let (share, n) = (self.peers.share(ask), self.peers.count() as f64);
        Box::pin(self.run(
            move |p| p.cap(endpoint, ask, most),
            move |l| l.store.cap_now(endpoint, share, most / n),
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
            move |l| l.store.view_now(endpoint, share, floor.map(|f| f / n)),
            None,
        ))
    }

    /// Always asks the primary (readiness must tell the truth), and lets the answer
    /// end or start a degraded period.
    fn ping(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            match self.primary.ping().await {
                Ok(()) => self.answered().await,
                Err(e) => {
                    self.failed(&e);
                    Err(e)
                }
            }
        })
    }

    fn replicas(&self) -> Option<usize> {
        Some(self.peers.count())
    }

    /// While degraded, always confirm (the local store answers at once anyway), and so
    /// does a reservation made before the store deciding last changed.
    fn needs_confirm(&self, endpoint: &str, since: tokio::time::Instant) -> bool {
        self.degraded.load(Ordering::Acquire)
            || self.changed_since(since)
            || self.primary.needs_confirm(endpoint, since)
    }

    /// Asks the primary when it may; when its answer does not come, the lease may
    /// still be added there (the call ran late), so unless this replica holds the slot
    /// (granted locally under the same id, released when its request ends) it is owed.
    fn acquire_leased<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, Leased> {
        let (share, slots) = (self.peers.share(ask), self.peers.share_slots(lease));
        Box::pin(async move {
            let sent = AtomicBool::new(false);
            let answer = self
                .run(
                    |p| {
                        sent.store(true, Ordering::Relaxed);
                        let call = p.acquire_leased(endpoint, ask, lease);
                        Box::pin(async move { call.await.map(|l| (l, true)) })
                    },
                    move |l| {
                        if let Some(h) = &self.handover {
                            h.decided_locally(endpoint, ask);
                        }
                        self.heard(endpoint, ask, l);
                        let leased = match l.store.acquire_leased_now(endpoint, share, slots) {
                            Leased::Took(o) => Leased::Took(l.tag(o)),
                            busy => busy,
                        };
                        (leased, false)
                    },
                    (
                        Leased::Took(Outcome::Granted {
                            wait_us: 0.0,
                            generation: u64::MAX,
                            at_us: None,
                        }),
                        false,
                    ),
                )
                .await;
            let unanswered = sent.load(Ordering::Relaxed)
                && !matches!(answer, Ok((_, true)))
                && !matches!(answer, Ok((Leased::Took(Outcome::Granted { .. }), _)));
            if unanswered {
                self.owe(endpoint, ask, lease.id);
            }
            let (leased, _) = answer?;
            if let Leased::Took(o) = &leased {
                self.saw(endpoint, ask, o);
                if let Some(h) = self.handover.as_ref() {
                    if matches!(o, Outcome::Granted { .. }) {
                        h.took(endpoint, ask, lease);
                    }
                }
            }
            Ok(leased)
        })
    }

    fn renew_lease<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, bool> {
        Box::pin(self.run(
            move |p| p.renew_lease(endpoint, ask, lease),
            move |l| {
                l.store
                    .renew_lease_now(endpoint, self.peers.share(ask), lease)
            },
            true,
        ))
    }

    /// Releases wherever the lease may be: the local store (a no-op when it is not
    /// there) and the shared one, now or, while it is away, when it is back (owed).
    fn release_lease<'a>(&'a self, endpoint: &'a str, ask: Ask, id: u64) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            if let Some(h) = &self.handover {
                h.ended(id);
            }
            self.local
                .load()
                .store
                .release_lease_now(endpoint, self.peers.share(ask), id);
            let released = self
                .run(
                    move |p| {
                        let call = p.release_lease(endpoint, ask, id);
                        Box::pin(async move { call.await.map(|()| true) })
                    },
                    |_| false,
                    false,
                )
                .await;
            if !matches!(released, Ok(true)) {
                self.owe(endpoint, ask, id);
            }
            released.map(drop)
        })
    }

    /// Adopts where decisions are made now (the local store while the shared one is
    /// away).
    fn adopt_lease<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, ()> {
        Box::pin(self.run(
            move |p| p.adopt_lease(endpoint, ask, lease),
            move |l| {
                l.store
                    .adopt_lease_now(endpoint, self.peers.share(ask), lease)
            },
            (),
        ))
    }

    fn health(&self) -> StoreHealth {
        if self.degraded.load(Ordering::Acquire) {
            StoreHealth::Degraded
        } else {
            StoreHealth::Ok
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::config::Policy;
    use crate::limiter::Limiter;

    /// A real memory store behind a switch that makes every call fail while it is off:
    /// a shared store going away and coming back, in virtual time. With `only`, the
    /// switch fails only that endpoint's calls (a cluster node serving its slot).
    pub(in crate::limiter) struct Switched {
        pub(in crate::limiter) store: MemoryStore,
        pub(in crate::limiter) down: AtomicBool,
        pub(in crate::limiter) only: Option<&'static str>,
    }

    impl Switched {
        fn check(&self, endpoint: Option<&str>) -> Result<(), StoreError> {
            let hit = match (self.only, endpoint) {
                (None, _) => true,
                (Some(only), Some(e)) => only == e,
                (Some(_), None) => false,
            };
            if hit && self.down.load(Ordering::Relaxed) {
                Err(StoreError::Unreachable("switched off".into()))
            } else {
                Ok(())
            }
        }

        fn answer<T: Send + 'static>(
            &self,
            endpoint: Option<&str>,
            v: impl FnOnce() -> T,
        ) -> StoreFuture<'_, T> {
            let r = self.check(endpoint).map(|()| v());
            Box::pin(std::future::ready(r))
        }
    }

    impl BucketStore for Switched {
        fn acquire<'a>(&'a self, endpoint: &'a str, ask: Ask) -> StoreFuture<'a, Outcome> {
            self.answer(Some(endpoint), || self.store.acquire_now(endpoint, ask))
        }
        fn release<'a>(&'a self, e: &'a str, ask: Ask, u: Unused) -> StoreFuture<'a, ()> {
            self.answer(Some(e), || self.store.release_now(e, ask, u))
        }
        fn feedback<'a>(
            &'a self,
            e: &'a str,
            ask: Ask,
            a: Adaptive,
            pause: Duration,
            throttled: bool,
        ) -> StoreFuture<'a, ()> {
            self.answer(Some(e), || {
                self.store.feedback_now(e, ask, &a, pause, throttled)
            })
        }
        fn view<'a>(
            &'a self,
            e: &'a str,
            ask: Ask,
            f: Option<f64>,
        ) -> StoreFuture<'a, Option<View>> {
            self.answer(Some(e), || self.store.view_now(e, ask, f))
        }
        fn ping(&self) -> StoreFuture<'_, ()> {
            self.answer(None, || ())
        }
        fn cap<'a>(&'a self, e: &'a str, ask: Ask, most: f64) -> StoreFuture<'a, ()> {
            self.answer(Some(e), || self.store.cap_now(e, ask, most))
        }
        fn acquire_leased<'a>(
            &'a self,
            e: &'a str,
            ask: Ask,
            l: LeaseAsk,
        ) -> StoreFuture<'a, Leased> {
            self.answer(Some(e), || self.store.acquire_leased_now(e, ask, l))
        }
        fn renew_lease<'a>(&'a self, e: &'a str, ask: Ask, l: LeaseAsk) -> StoreFuture<'a, bool> {
            self.answer(Some(e), || self.store.renew_lease_now(e, ask, l))
        }
        fn adopt_lease<'a>(&'a self, e: &'a str, ask: Ask, l: LeaseAsk) -> StoreFuture<'a, ()> {
            self.answer(Some(e), || self.store.adopt_lease_now(e, ask, l))
        }
        fn release_lease<'a>(&'a self, e: &'a str, ask: Ask, id: u64) -> StoreFuture<'a, ()> {
            self.answer(Some(e), || self.store.release_lease_now(e, ask, id))
        }
    }

    /// A limiter over the fallback around a switched memory store (`down` at first),
    /// `on_error = "local"`, one replica; an endpoint policy at 10/s with `burst`.
    fn switched(down: bool, burst: f64) -> (Arc<Switched>, Limiter, Arc<Policy>) {
        let primary = Arc::new(Switched {
            store: MemoryStore::new(),
            down: AtomicBool::new(down),
            only: None,
        });
        let store = Resilient::new(
            Arc::clone(&primary) as Arc<dyn BucketStore>,
            OnError::Local,
            StoreStats::default(),
            Arc::new(Peers::new(1)),
        );
        let policy = Policy {
            rate: 10.0,
            burst,
            max_wait: Duration::from_secs(10),
            adaptive: None,
            ..Policy::default()
        };
        (primary, Limiter::new(Arc::new(store)), Arc::new(policy))
    }

    /// Requests admitted from `at` on, each recording when it was let go.
    fn admit_from(
        limiter: &Limiter,
        policy: &Arc<Policy>,
        n: usize,
    ) -> Vec<tokio::task::JoinHandle<Instant>> {
        (0..n)
            .map(|_| {
                let (limiter, policy) = (limiter.clone(), Arc::clone(policy));
                tokio::spawn(async move {
                    limiter.admit("ep", &policy).await.expect("admitted");
                    Instant::now()
                })
            })
            .collect()
    }

    /// The bound in virtual time, exact: in every window [t, t + w), at most
    /// rate·w + burst departures.
    fn assert_bound(mut left: Vec<Instant>, rate: f64, burst: f64) {
        left.sort();
        for w in [0.5, 1.0, 2.0, 4.0] {
            let win = Duration::from_secs_f64(w);
            for (i, t) in left.iter().enumerate() {
                let n = left[i..].iter().take_while(|u| **u < *t + win).count();
                let ms: Vec<u128> = left.iter().map(|u| (*u - left[0]).as_millis()).collect();
                assert!(
                    n as f64 <= rate * w + burst,
                    "{n} left in {w} s from {:?}; ms after the first: {ms:?}",
                    *t - left[0]
                );
            }
        }
    }

    /// The shared store goes away while it holds reservations up to 2.9 s ahead and comes
    /// back while the local store holds its own: the local bucket leaves the shared
    /// reservations their slots, and the local reservations ask the shared bucket again
    /// instead of leaving on top of what it grants newcomers.
    #[tokio::test(start_paused = true)]
    async fn an_outage_and_its_end_keep_the_bound_across_both_stores() {
        let (primary, limiter, policy) = switched(false, 1.0);
        let t0 = Instant::now();
        // 30 shared reservations: 0, 0.1, ..., 2.9 s.
        let mut tasks = admit_from(&limiter, &policy, 30);
        tokio::time::sleep_until(t0 + Duration::from_millis(550)).await;
        primary.down.store(true, Ordering::Relaxed);
        // 10 asked of the local store while the shared one is away.
        tasks.extend(admit_from(&limiter, &policy, 10));
        tokio::time::sleep_until(t0 + Duration::from_millis(1550)).await;
        primary.down.store(false, Ordering::Relaxed);
        // The next waking request's probe finds the shared store back.
        tokio::time::sleep_until(t0 + Duration::from_millis(1850)).await;
        assert_eq!(limiter.store().health(), StoreHealth::Ok);
        // 10 newcomers asking the shared store.
        tasks.extend(admit_from(&limiter, &policy, 10));
        let mut left = Vec::new();
        for t in tasks {
            left.push(t.await.unwrap());
        }
        assert_eq!(left.len(), 50);
        assert_bound(left.clone(), 10.0, 1.0);
        // Nothing was wasted either: 50 at 10/s, the first at once.
        let last = *left.iter().max().unwrap() - t0;
        assert!(
            last <= Duration::from_millis(4950),
            "the last left at {last:?}"
        );
    }

    /// A long outage lets the local bucket refill, and its burst leaves; meanwhile the
    /// shared bucket refilled too. When the shared store answers again it must not add
    /// its own burst on top: it is told how much the local bucket has left.
    #[tokio::test(start_paused = true)]
    async fn the_shared_bucket_adds_no_burst_on_top_of_the_local_ones_after_an_outage() {
        let (primary, limiter, policy) = switched(true, 5.0);
        let t0 = Instant::now();
        // The store is away from the start; one request finds it so.
        let mut tasks = admit_from(&limiter, &policy, 1);
        // Ten idle seconds: the local bucket refills to its burst.
        tokio::time::sleep_until(t0 + Duration::from_secs(10)).await;
        tasks.extend(admit_from(&limiter, &policy, 12));
        tokio::time::sleep_until(t0 + Duration::from_millis(10_050)).await;
        primary.down.store(false, Ordering::Relaxed);
        tokio::time::sleep_until(t0 + Duration::from_millis(10_150)).await;
        tasks.extend(admit_from(&limiter, &policy, 4));
        // The next probe finds the store back (waking local reservations do not probe).
        tokio::time::sleep_until(t0 + Duration::from_millis(10_500)).await;
        tasks.extend(admit_from(&limiter, &policy, 8));
        let mut left = Vec::new();
        for t in tasks {
            left.push(t.await.unwrap());
        }
        assert_eq!(limiter.store().health(), StoreHealth::Ok);
        assert_bound(left, 10.0, 5.0);
    }

    /// A store that answers after `delay` (a Redis round trip), forwarding to `inner`.
    struct Delayed {
        inner: Arc<Switched>,
        delay: Duration,
        /// What a registration answers (0: the default, no count).
        replicas: AtomicUsize,
    }

    impl Delayed {
        fn later<'a, T: Send + 'a>(&'a self, f: StoreFuture<'a, T>) -> StoreFuture<'a, T> {
            Box::pin(async move {
                tokio::time::sleep(self.delay).await;
                f.await
            })
        }
    }

    impl BucketStore for Delayed {
        fn acquire<'a>(&'a self, e: &'a str, ask: Ask) -> StoreFuture<'a, Outcome> {
            self.later(self.inner.acquire(e, ask))
        }
        fn release<'a>(&'a self, e: &'a str, ask: Ask, u: Unused) -> StoreFuture<'a, ()> {
            self.later(self.inner.release(e, ask, u))
        }
        fn feedback<'a>(
            &'a self,
            e: &'a str,
            ask: Ask,
            a: Adaptive,
            pause: Duration,
            throttled: bool,
        ) -> StoreFuture<'a, ()> {
            self.later(self.inner.feedback(e, ask, a, pause, throttled))
        }
        fn view<'a>(
            &'a self,
            e: &'a str,
            ask: Ask,
            f: Option<f64>,
        ) -> StoreFuture<'a, Option<View>> {
            self.later(self.inner.view(e, ask, f))
        }
        fn ping(&self) -> StoreFuture<'_, ()> {
            self.later(self.inner.ping())
        }
        fn register(&self) -> StoreFuture<'_, Option<usize>> {
            let n = self.replicas.load(Ordering::Relaxed);
            let answer = self.inner.answer(None, || (n > 0).then_some(n));
            self.later(answer)
        }
        fn cap<'a>(&'a self, e: &'a str, ask: Ask, most: f64) -> StoreFuture<'a, ()> {
            self.later(self.inner.cap(e, ask, most))
        }
        fn acquire_leased<'a>(
            &'a self,
            e: &'a str,
            ask: Ask,
            l: LeaseAsk,
        ) -> StoreFuture<'a, Leased> {
            self.later(self.inner.acquire_leased(e, ask, l))
        }
        fn renew_lease<'a>(&'a self, e: &'a str, ask: Ask, l: LeaseAsk) -> StoreFuture<'a, bool> {
            self.later(self.inner.renew_lease(e, ask, l))
        }
        fn adopt_lease<'a>(&'a self, e: &'a str, ask: Ask, l: LeaseAsk) -> StoreFuture<'a, ()> {
            self.later(self.inner.adopt_lease(e, ask, l))
        }
        fn release_lease<'a>(&'a self, e: &'a str, ask: Ask, id: u64) -> StoreFuture<'a, ()> {
            self.later(self.inner.release_lease(e, ask, id))
        }
    }

    /// The rejoin reads what the local bucket has left, then caps the shared bucket with
    /// it over a round trip, then the probing request's own call takes another:
    /// meanwhile the replica is still degraded, and a local bucket that went on granting
    /// would hand out what the cap already handed the shared bucket, both bursts leaving
    /// within a few milliseconds.
    #[tokio::test(start_paused = true)]
    async fn local_grants_during_the_rejoin_are_not_on_top_of_the_shared_cap() {
        let switched = Arc::new(Switched {
            store: MemoryStore::new(),
            down: AtomicBool::new(true),
            only: None,
        });
        let primary = Arc::new(Delayed {
            inner: Arc::clone(&switched),
            delay: Duration::from_millis(2),
            replicas: AtomicUsize::new(0),
        });
        let store = Resilient::new(
            primary as Arc<dyn BucketStore>,
            OnError::Local,
            StoreStats::default(),
            Arc::new(Peers::new(1)),
        );
        let limiter = Limiter::new(Arc::new(store));
        let policy = Arc::new(Policy {
            rate: 10.0,
            burst: 5.0,
            max_wait: Duration::from_secs(10),
            adaptive: None,
            ..Policy::default()
        });
        let t0 = Instant::now();
        // The store is away: one request finds it so; then ten idle seconds fill the
        // local bucket (5 tokens).
        let mut tasks = admit_from(&limiter, &policy, 1);
        tokio::time::sleep_until(t0 + Duration::from_secs(10)).await;
        switched.down.store(false, Ordering::Relaxed);
        // The probe: rejoins (reads 5 left locally, caps the shared bucket at 5).
        tasks.extend(admit_from(&limiter, &policy, 1));
        // Its registration takes a round trip (2 ms), then it reads the local bucket
        // and sends the cap. While the cap and its own call are on their way, five
        // more arrive.
        tokio::time::sleep_until(t0 + Duration::from_millis(10_003)).await;
        tasks.extend(admit_from(&limiter, &policy, 5));
        // Back on the shared bucket: ten more.
        tokio::time::sleep_until(t0 + Duration::from_millis(10_010)).await;
        assert_eq!(limiter.store().health(), StoreHealth::Ok);
        tasks.extend(admit_from(&limiter, &policy, 10));
        let mut left = Vec::new();
        for t in tasks {
            left.push(t.await.unwrap());
        }
        let mut ms: Vec<u128> = left.iter().map(|u| (*u - t0).as_millis()).collect();
        ms.sort();
        let early = ms.iter().filter(|m| (10_000..10_020).contains(*m)).count();
        // rate·0.02 s + burst = 5.2
        assert!(
            early <= 5,
            "{early} left within 20 ms of the store's return (burst 5); ms: {ms:?}"
        );
        assert_bound(left, 10.0, 5.0);
    }

    /// Three replicas share the store; it goes away for longer than the
    /// heartbeat ttl (a Sentinel failover takes ~30 s). This replica is the first back:
    /// its registration finds it alone (the others' heartbeats lapsed during the
    /// outage, they register on their own next probe). The store fails again before
    /// its next heartbeat: it must not take the whole rate locally while the other two
    /// take their thirds (5/3 of the limit for as long as the second outage lasts).
    #[tokio::test(start_paused = true)]
    async fn a_replica_first_back_from_a_long_outage_keeps_counting_the_others() {
        let switched = Arc::new(Switched {
            store: MemoryStore::new(),
            down: AtomicBool::new(false),
            only: None,
        });
        let primary = Arc::new(Delayed {
            inner: Arc::clone(&switched),
            delay: Duration::from_millis(1),
            replicas: AtomicUsize::new(3),
        });
        let peers = Arc::new(Peers::new(1));
        let store = Resilient::new(
            primary.clone() as Arc<dyn BucketStore>,
            OnError::Local,
            StoreStats::default(),
            Arc::clone(&peers),
        );
        let limiter = Limiter::new(Arc::new(store));
        let policy = Arc::new(Policy {
            rate: 30.0,
            burst: 3.0,
            max_wait: Duration::from_secs(30),
            adaptive: None,
            ..Policy::default()
        });
        let t0 = Instant::now();
        // Start-up: registered among three.
        limiter.store().ping().await.expect("up");
        assert_eq!(peers.count(), 3);
        // A 10 s outage.
        switched.down.store(true, Ordering::Relaxed);
        admit_from(&limiter, &policy, 1);
        tokio::time::sleep_until(t0 + Duration::from_secs(10)).await;
        // Back: the others' heartbeats lapsed meanwhile; this one registers first.
        primary.replicas.store(1, Ordering::Relaxed);
        switched.down.store(false, Ordering::Relaxed);
        for t in admit_from(&limiter, &policy, 1) {
            t.await.unwrap();
        }
        assert_eq!(limiter.store().health(), StoreHealth::Ok);
        // Half a second later (before its next heartbeat) the store fails again.
        tokio::time::sleep_until(t0 + Duration::from_millis(10_500)).await;
        switched.down.store(true, Ordering::Relaxed);
        let from = Instant::now();
        let left: Vec<Instant> = {
            let mut v = Vec::new();
            for t in admit_from(&limiter, &policy, 20) {
                v.push(t.await.unwrap());
            }
            v
        };
        let last = *left.iter().max().unwrap() - from;
        // At its share (10/s, a third of 30/s), 20 from an empty bucket take 2 s.
        assert!(
            last >= Duration::from_millis(1900),
            "20 left within {last:?} (N = {}): the whole rate, on top of the others' shares",
            peers.count()
        );
    }

    /// During an outage each replica takes its share of an endpoint's slots, as of its
    /// tokens: max / N, at least one.
    #[test]
    fn each_replica_takes_its_share_of_the_slots() {
        let lease = |max| LeaseAsk {
            id: 1,
            max,
            ttl_us: 1e6,
        };
        let peers = Peers::new(3);
        let shares: Vec<u32> = [9, 8, 3, 2].map(|m| peers.share_slots(lease(m)).max).into();
        assert_eq!(shares, [3, 2, 1, 1]);
        assert_eq!(Peers::new(1).share_slots(lease(8)).max, 8);
    }

    /// A local reservation belongs to the outage whose store made it: a later outage's
    /// store does not take it as its own.
    #[test]
    fn local_reservations_carry_their_outage() {
        let local = |outage| Local {
            store: MemoryStore::fallback(Arc::default()),
            outage,
        };
        let granted = Outcome::Granted {
            wait_us: 5.0,
            generation: 3,
            at_us: None,
        };
        let Outcome::Granted { generation, .. } = local(1).tag(granted) else {
            panic!()
        };
        assert!(is_local(generation));
        assert_eq!(local(1).own(generation), Some(3));
        assert_eq!(local(2).own(generation), None);
        assert_eq!(
            local(1).own(3),
            None,
            "a shared reservation is no local one"
        );
    }
}
