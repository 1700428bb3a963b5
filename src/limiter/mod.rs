//! Admission: the [`Limiter`] decides when a request may leave, over the
//! [`BucketStore`] seam (memory, Redis, Redis Cluster, Redis Sentinel, with a fallback
//! wrapper that also knows how many replicas share the limits).
//!
//! One store call decides: a request either gets a reservation with its exact start
//! time, or a refusal with the exact time until a token. A reserved request sleeps
//! until its start (no polling); if its wait was non-zero it confirms once on waking, so
//! a cooldown that began meanwhile (on any replica) still holds it back — unless the
//! store can tell no cooldown began ([`BucketStore::needs_confirm`]: a single Redis
//! announces cooldowns on pub/sub, see `cooldowns`), which makes a saturated endpoint
//! cost one store call per grant. A request whose sender hangs up while waiting gives
//! its reservation back.
//!
//! In-process time is tokio's ([`tokio::time::Instant`]) throughout: the limiter's
//! sleeps, the memory store's buckets and the fallback's probe interval read one clock,
//! so under `tokio::time::pause()` all of them move only with virtual time.

mod batch;
pub mod bucket;
pub mod cluster_fallback;
mod cooldowns;
mod credit;
pub mod fallback;
pub mod handover;
pub mod lease;
mod mailbox;
pub mod memory;
pub mod peers;
mod per_thread;
pub mod queue;
pub mod redis;
mod sentinel;
pub mod slot;
mod waiting;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

pub use bucket::{Ask, Outcome, Unused, View};
pub use lease::{LeaseAsk, Leased};
pub use queue::{Gates, Hint, Place};
pub use slot::{HeldBody, Slot};

use crate::config::{Adaptive, Policy};
use waiting::{Spot, Start, Waiting};

/// A boxed store future (the seam is object-safe so stores can be chosen at start-up).
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// Why a store call failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The call did not answer within `store.timeout`.
    #[error("store call timed out after {0:?}")]
    Timeout(Duration),
    /// The store could not be reached or dropped the connection.
    #[error("store unreachable: {0}")]
    Unreachable(String),
    /// The store answered with something sluice cannot use.
    #[error("store answered unexpectedly: {0}")]
    Protocol(String),
    /// The memory store holds its most buckets (`store.max_endpoints`), none idle, and
    /// the endpoint has none: it gets no bucket rather than one being forgotten early.
    #[error(
        "sluice holds state for {0} endpoints (store.max_endpoints), none idle: no room for another"
    )]
    Full(usize),
}

impl StoreError {
    /// The refusal a failed call makes.
    fn refusal(&self) -> Refusal {
        match self {
            StoreError::Full(_) => Refusal::EndpointCapacity,
            _ => Refusal::StoreUnavailable,
        }
    }
}

/// Whether the store is serving normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreHealth {
    /// The configured store answers.
    Ok,
    /// The configured store fails and the fallback (`on_error`) is in force.
    Degraded,
}

/// The bucket store seam: one call per decision, same semantics in every store.
pub trait BucketStore: Send + Sync {
    /// Refill, then reserve a token (or confirm `ask.held`) or refuse with the exact wait.
    fn acquire<'a>(&'a self, endpoint: &'a str, ask: Ask) -> StoreFuture<'a, Outcome>;
    /// [`acquire`](Self::acquire) answered in place, for a store that never waits to
    /// decide (the memory store): no boxed future on every request. `None` (the
    /// default) sends the caller to `acquire`.
    fn acquire_at_once(&self, endpoint: &str, ask: Ask) -> Option<Outcome> {
        let _ = (endpoint, ask);
        None
    }
    /// Gives back a reservation whose sender went away (see [`bucket::release`]).
    fn release<'a>(&'a self, endpoint: &'a str, ask: Ask, unused: Unused) -> StoreFuture<'a, ()>;
    /// Applies upstream feedback: a pause and, when `throttled`, a decrease.
    fn feedback<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        adaptive: Adaptive,
        pause: Duration,
        throttled: bool,
    ) -> StoreFuture<'a, ()>;
    /// Lowers `endpoint`'s balance to at most `most` tokens now (see [`bucket::cap`]).
    fn cap<'a>(&'a self, endpoint: &'a str, ask: Ask, most: f64) -> StoreFuture<'a, ()>;
    /// The operator's view of an endpoint; `None` when the store holds no state for it.
    fn view<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        floor: Option<f64>,
    ) -> StoreFuture<'a, Option<View>>;
    /// Checks the store answers (for `/readyz`).
    fn ping(&self) -> StoreFuture<'_, ()>;
    /// Registers this replica as alive in a store that replicas share, and returns how
    /// many are (`None`, the default, for a store of this process alone).
    fn register(&self) -> StoreFuture<'_, Option<usize>> {
        Box::pin(std::future::ready(Ok(None)))
    }
    /// Like [`acquire`](Self::acquire), for endpoints with `max_in_flight`: takes an
    /// in-flight slot (a lease) and the token together, or nothing.
    fn acquire_leased<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, Leased>;
    /// Extends a held lease by its ttl; `false` when it had already expired.
    fn renew_lease<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, bool>;
    /// Counts a lease of a request already in flight that another store granted (the
    /// fallback's local store during an outage, or the shared store before it): renewed
    /// when present, else added, whatever the slots held.
    fn adopt_lease<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, ()>;
    /// Gives a lease back (its request's response ended).
    fn release_lease<'a>(&'a self, endpoint: &'a str, ask: Ask, id: u64) -> StoreFuture<'a, ()>;
    /// Current health; only the fallback wrapper ever reports [`StoreHealth::Degraded`].
    fn health(&self) -> StoreHealth {
        StoreHealth::Ok
    }
    /// Whether a reservation made (sent) at `since` must be confirmed on waking: true
    /// unless the store knows no cooldown of `endpoint` can have started since.
    fn needs_confirm(&self, endpoint: &str, since: Instant) -> bool {
        let _ = (endpoint, since);
        true
    }
    /// The end of a cooldown of `endpoint` this replica heard announced (another
    /// replica's 429), when it is still to come; `None` (the default) when the store
    /// announces none. The fallback holds its local bucket back until then.
    fn cooling_heard(&self, endpoint: &str) -> Option<Instant> {
        let _ = endpoint;
        None
    }
    /// How many replicas share the limits, as the fallback wrapper last learned it
    /// (`None` for stores that are not shared).
    fn replicas(&self) -> Option<usize> {
        None
    }
}

/// Why a request may not leave.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Refusal {
    /// No token within the wait budget.
    RateLimited {
        /// Time until a token.
        retry_after: Duration,
    },
    /// The endpoint is cooling down after a 429.
    Cooldown {
        /// Time left in the cooldown.
        retry_after: Duration,
    },
    /// The store failed and `on_error = "deny"`.
    StoreUnavailable,
    /// No in-flight slot (`max_in_flight`) within the wait budget.
    ConcurrencyLimited {
        /// Time until the soonest lease expires (a release may come sooner).
        retry_after: Duration,
    },
    /// The memory store is full of busy endpoints and this one has no bucket
    /// (`store.max_endpoints`).
    EndpointCapacity,
}

/// What waits on one endpoint on this replica ([`Limiter::parked`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Waits {
    /// In the endpoint's queue, by priority class (0 high, 1 normal, 2 low); a head
    /// waiting for an in-flight slot included.
    pub queued: [usize; 3],
    /// Sleeping until the start their token reserved.
    pub reserved: usize,
    /// How long the longest-waiting of them has waited.
    pub oldest: Duration,
}

impl Waits {
    /// Every request waiting.
    pub fn total(&self) -> usize {
        self.queued.iter().sum::<usize>() + self.reserved
    }
}

/// What a queued admission ([`Limiter::admit_queued`]) hands out.
pub struct Admit {
    /// The token.
    pub grant: Grant,
    /// The in-flight slot, for endpoints with `max_in_flight`.
    pub slot: Option<Slot>,
    /// Time spent waiting for the slot (zero without `max_in_flight`).
    pub slot_wait: Duration,
}

/// A head waiting for a slot polls the store at least this often at first...
const POLL_MIN: Duration = Duration::from_millis(5);
/// ...backing off to this (releases on other replicas are only seen by asking).
const POLL_MAX: Duration = Duration::from_millis(100);

/// A request that may leave now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grant {
    /// Time spent waiting for the token.
    pub waited: Duration,
    /// The bucket generation the token came from (for [`Limiter::refund`]).
    pub generation: u64,
    /// When the token was due: the request's start (never later than the store's), so
    /// a refund knows whether reservations were made behind it (for [`Limiter::refund`]).
    pub start: Instant,
    /// The same start on the store's own clock, where the store has one.
    pub at_us: Option<f64>,
}

/// What enforcing would have done to a request in shadow mode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Shadow {
    /// It would have waited this long (`waited`) for its token.
    Wait(Grant),
    /// It would have been refused.
    Refuse(Refusal),
}

/// Decides admission for requests, over a shared store.
#[derive(Clone)]
pub struct Limiter {
    store: Arc<dyn BucketStore>,
    gates: Arc<Gates>,
    next_lease: Arc<AtomicU64>,
    /// Requests waiting for their reserved starts, moved up when one ahead leaves.
    waiting: Arc<Waiting>,
    /// Endpoints whose senders name priorities.
    prioritized: Arc<queue::Prioritized>,
    /// Quotas receivers published, lowering their endpoints' pace.
    learned: Arc<crate::learned::Learned>,
}

impl Limiter {
    /// A limiter over `store`.
    pub fn new(store: Arc<dyn BucketStore>) -> Limiter {
        Limiter {
            store,
            gates: Arc::default(),
            next_lease: Arc::new(AtomicU64::new(1)),
            waiting: Arc::default(),
            prioritized: Arc::default(),
            learned: Arc::default(),
        }
    }

    /// The quotas receivers published (`[defaults.adaptive] learn`).
    pub fn learned(&self) -> &crate::learned::Learned {
        &self.learned
    }

    /// The endpoints whose senders name priorities (their requests are queued).
    pub fn prioritized(&self) -> &queue::Prioritized {
        &self.prioritized
    }

    /// The local waiting rooms (tests check they are cleaned up).
    pub fn gates(&self) -> &Arc<Gates> {
        &self.gates
    }

    /// What waits on this replica, per endpoint with anything waiting: requests in the
    /// endpoint's queue (by priority) and requests holding a reserved start.
    pub fn parked(&self) -> std::collections::HashMap<Arc<str>, Waits> {
        let now = Instant::now();
        let mut out: std::collections::HashMap<Arc<str>, Waits> = std::collections::HashMap::new();
        for (id, p) in self.gates.parked() {
            let w = out.entry(id).or_default();
            w.queued = p.by_class;
            w.oldest = p
                .oldest
                .map_or(Duration::ZERO, |at| now.saturating_duration_since(at));
        }
        for (id, n, since) in self.waiting.parked() {
            let w = out.entry(Arc::from(id)).or_default();
            w.reserved = n;
            w.oldest = w.oldest.max(now.saturating_duration_since(since));
        }
        out
    }

    /// The underlying store (for feedback, views and readiness).
    pub fn store(&self) -> &Arc<dyn BucketStore> {
        &self.store
    }

    /// Waits until `endpoint` may send, or refuses.
    ///
    /// Cancel-safe: dropping the future while it waits gives the reservation back.
    pub async fn admit(&self, endpoint: &str, policy: &Policy) -> Result<Grant, Refusal> {
        let started = Instant::now();
        let ask = Ask::new(policy, micros(policy.max_wait), None);
        let first = self.store.acquire_at_once(endpoint, ask);
        let first = first.map(|o| (started, o));
        self.settle(endpoint, policy, started, first).await
    }

    /// Takes the first decision (`first`, with when its call was sent, or a fresh
    /// acquire), then sleeps until the reserved start and confirms it, re-reserving if a
    /// cooldown voided it. `started`: when the request began waiting (its budget).
    async fn settle(
        &self,
        endpoint: &str,
        policy: &Policy,
        started: Instant,
        mut first: Option<(Instant, Outcome)>,
    ) -> Result<Grant, Refusal> {
        // Granted at once (the memory store, far from its limit): nothing was waited
        // for, and no clock needs reading.
        if let Some((
            asked,
            Outcome::Granted {
                wait_us,
                generation,
                at_us,
            },
        )) = first
        {
            if wait_us <= 0.0 {
                return Ok(Grant {
                    waited: Duration::ZERO,
                    generation,
                    start: asked,
                    at_us,
                });
            }
        }
        // The reservation being confirmed: its generation and its start.
        let mut held: Option<(u64, Start)> = None;
        loop {
            // When this outcome was asked for: a cooldown notice since then means
            // confirming, and its start is counted from then. (Counting a queued
            // request's first one from `started`, before its wait for the queue and a
            // slot, would put the start a give-back leaves for the next sender seconds
            // early, onto another request's start.)
            let (asked, outcome) = match first.take() {
                Some(first) => first,
                None => {
                    let now = Instant::now();
                    let budget = policy.max_wait.saturating_sub(now - started);
                    let ask = Ask::new(policy, micros(budget), held.map(|(g, _)| g));
                    let outcome = self
                        .store
                        .acquire(endpoint, ask)
                        .await
                        .map_err(|e| e.refusal())?;
                    (now, outcome)
                }
            };
            match outcome {
                Outcome::Refused { cooldown, retry_us } => {
                    let retry_after = from_micros(retry_us);
                    return Err(if cooldown {
                        Refusal::Cooldown { retry_after }
                    } else {
                        Refusal::RateLimited { retry_after }
                    });
                }
                Outcome::Granted {
                    wait_us,
                    generation,
                    at_us,
                } if wait_us <= 0.0 => {
                    // A confirmed reservation's own start is the one it waited for.
                    let (start, at_us) = match held {
                        Some((g, start)) if g == generation => (start.due, start.at_us),
                        _ => (asked, at_us),
                    };
                    return Ok(Grant {
                        waited: started.elapsed(),
                        generation,
                        start,
                        at_us,
                    });
                }
                Outcome::Granted {
                    wait_us,
                    generation,
                    at_us,
                } => {
                    let wait = from_micros(wait_us);
                    let start = Start {
                        // From when the call was sent, not answered: never later
                        // than the store's start, so what comes back is never more.
                        due: asked + wait,
                        wake: Instant::now() + wait,
                        at_us,
                    };
                    let spot =
                        self.waiting
                            .join_since(endpoint, generation, policy.cost, start, started);
                    let mut guard = Reservation {
                        store: Arc::clone(&self.store),
                        endpoint: endpoint.to_owned(),
                        ask: Ask::new(policy, 0.0, None),
                        generation,
                        start,
                        armed: true,
                        waiting: Arc::clone(&self.waiting),
                        spot,
                    };
                    guard.wait().await;
                    // Its start now: a waiter moved up when one ahead of it left.
                    let start = guard.start;
                    guard.disarm();
                    // Re-check on waking — a cooldown started meanwhile voids the
                    // reservation — unless the store heard of none since we asked.
                    if !self.store.needs_confirm(endpoint, asked) {
                        return Ok(Grant {
                            waited: started.elapsed(),
                            generation,
                            start: start.due,
                            at_us: start.at_us,
                        });
                    }
                    held = Some((generation, start));
                }
            }
        }
    }

    /// Admission through the endpoint's local queue, for endpoints with `max_in_flight`
    /// or `shares` (see [`queue`]): waits to be head, takes a slot and a token in one
    /// store call (or only a token), then waits for the token's start like
    /// [`admit`](Self::admit). Cancel-safe like it: a dropped request leaves the queue
    /// and gives back its reservation and slot.
    pub async fn admit_queued(
        &self,
        endpoint: &Arc<str>,
        policy: &Policy,
        place: Place<'_>,
    ) -> Result<Admit, Refusal> {
        let started = Instant::now();
        let deadline = started + policy.max_wait;
        let head = self
            .gates
            .enter(endpoint, place, deadline)
            .await
            .map_err(|h| hint_refusal(h, policy))?;
        let (first, slot) = match policy.max_in_flight {
            Some(max) => self.lease(endpoint, policy, max, deadline).await?,
            None => {
                let asked = Instant::now();
                let ask = Ask::new(policy, micros(deadline - asked), None);
                let o = self.store.acquire(endpoint, ask).await;
                ((asked, o.map_err(|e| e.refusal())?), None)
            }
        };
        let slot_wait = started.elapsed();
        if let (_, Outcome::Granted { wait_us, .. }) = first {
            let hint = Hint {
                slot: false,
                retry_us: wait_us,
            };
            self.gates.hint(endpoint, hint);
        }
        if policy.shares.is_none() && !self.prioritized.has(endpoint) {
            // FIFO only: reservations keep the order, the next may ask now.
            drop(head);
            let grant = self.settle(endpoint, policy, started, Some(first)).await?;
            return Ok(Admit {
                grant,
                slot,
                slot_wait,
            });
        }
        // Fair queue: the head keeps its place until its token's start, so the order
        // of who leaves is decided here, not by earlier reservations.
        let grant = self.settle(endpoint, policy, started, Some(first)).await?;
        drop(head);
        Ok(Admit {
            grant,
            slot,
            slot_wait,
        })
    }

    /// The head's wait for a slot: one leased acquire, then on "busy" a wait for a
    /// local release, the soonest expiry or the next poll, until `deadline`. The
    /// outcome comes with when its call was sent.
    async fn lease(
        &self,
        endpoint: &Arc<str>,
        policy: &Policy,
        max: u32,
        deadline: Instant,
    ) -> Result<((Instant, Outcome), Option<Slot>), Refusal> {
        let released = self.gates.released(endpoint);
        let mut poll = POLL_MIN;
        loop {
            let now = Instant::now();
            let ask = Ask::new(
                policy,
                micros(deadline.saturating_duration_since(now)),
                None,
            );
            let lease = LeaseAsk {
                id: self.next_lease.fetch_add(1, Ordering::Relaxed),
                max,
                ttl_us: micros(policy.lease_ttl),
            };
            let pending = PendingLease {
                store: &self.store,
                endpoint,
                ask,
                id: lease.id,
            };
            let leased = self.store.acquire_leased(endpoint, ask, lease).await;
            if leased.is_ok() {
                pending.answered();
            }
            let retry_us = match leased.map_err(|e| e.refusal())? {
                Leased::Took(o @ Outcome::Granted { .. }) => {
                    let (store, gates) = (Arc::clone(&self.store), Arc::clone(&self.gates));
                    let slot = Slot::new(store, gates, Arc::clone(endpoint), ask, lease);
                    return Ok(((now, o), Some(slot)));
                }
                Leased::Took(refused) => return Ok(((now, refused), None)),
                Leased::Busy { retry_us } => retry_us,
            };
            let retry_after = from_micros(retry_us);
            if Instant::now() >= deadline {
                return Err(Refusal::ConcurrencyLimited { retry_after });
            }
            self.gates.hint(
                endpoint,
                Hint {
                    slot: true,
                    retry_us,
                },
            );
            let wake = (Instant::now() + retry_after.min(poll)).min(deadline);
            tokio::select! {
                // A slot of this replica came free: ask at once.
                _ = released.notified() => {}
                // The soonest lease may have expired, another replica may have
                // released one, or the budget ran out (the next turn refuses).
                _ = tokio::time::sleep_until(wake) => {}
            }
            poll = (poll * 2).min(POLL_MAX);
        }
    }

    /// Shadow mode: asks the store what enforcing would do to this request — one call,
    /// no waiting. A would-be wait takes its token exactly as an enforced request would,
    /// so the shadow bucket follows the real traffic; a would-be refusal takes nothing.
    pub async fn shadow(&self, endpoint: &str, policy: &Policy) -> Shadow {
        let ask = Ask::new(policy, micros(policy.max_wait), None);
        let asked = Instant::now();
        match self.store.acquire(endpoint, ask).await {
            Ok(Outcome::Granted {
                wait_us,
                generation,
                at_us,
            }) => Shadow::Wait(Grant {
                waited: from_micros(wait_us),
                generation,
                start: asked + from_micros(wait_us),
                at_us,
            }),
            Ok(Outcome::Refused { cooldown, retry_us }) => {
                let retry_after = from_micros(retry_us);
                Shadow::Refuse(if cooldown {
                    Refusal::Cooldown { retry_after }
                } else {
                    Refusal::RateLimited { retry_after }
                })
            }
            Err(e) => Shadow::Refuse(e.refusal()),
        }
    }

    /// Gives back the token of a grant whose request never left (the destination was
    /// refused after admission), as a reservation given up at its start: the latest
    /// start gives its token back (what the balance has not regained since), one with
    /// reservations made behind it gives nothing (those keep their starts, and a token
    /// back would put a new one beside the last of them).
    pub async fn refund(&self, endpoint: &str, policy: &Policy, grant: Grant) {
        let ask = Ask::new(policy, 0.0, None);
        let now = Instant::now();
        let unused = Unused {
            generation: grant.generation,
            // Named by its own start, not "due now": a start that went by with
            // reservations behind it must not give its token back, or the next request
            // would leave beside the latest of them.
            due_in_us: micros_until(grant.start, now),
            at_us: grant.at_us,
        };
        if let Err(e) = self.store.release(endpoint, ask, unused).await {
            tracing::debug!(endpoint, error = %e, "could not refund a token");
        }
    }
}

/// Microseconds from `now` until `at` (negative: `at` went by).
fn micros_until(at: Instant, now: Instant) -> f64 {
    micros(at.saturating_duration_since(now)) - micros(now.saturating_duration_since(at))
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The refusal of a waiter whose budget ran out while another request was head.
fn hint_refusal(h: Hint, policy: &Policy) -> Refusal {
    let retry_after = from_micros(h.retry_us).max(Duration::from_millis(1));
    if h.slot && policy.max_in_flight.is_some() {
        Refusal::ConcurrencyLimited { retry_after }
    } else {
        Refusal::RateLimited { retry_after }
    }
}

/// Microseconds from the store as a [`Duration`], saturating: negative, NaN and
/// absurdly large values can never panic here (they come from float arithmetic).
pub fn from_micros(us: f64) -> Duration {
    const MAX_SECS: f64 = 86_400.0 * 365.0 * 100.0;
    let secs = us / 1e6;
    if secs.is_nan() || secs <= 0.0 {
        Duration::ZERO
    } else {
        Duration::from_secs_f64(secs.min(MAX_SECS))
    }
}

/// A reservation held by a waiting request; dropped while armed, the ones waiting
/// behind it move up and the start left over is given back.
struct Reservation {
    store: Arc<dyn BucketStore>,
    endpoint: String,
    ask: Ask,
    generation: u64,
    /// When the reservation starts.
    start: Start,
    armed: bool,
    /// This replica's waiting requests, where one ahead that leaves moves it up...
    waiting: Arc<Waiting>,
    /// ...and its place among them.
    spot: Spot,
}

/// A leased acquire whose answer has not come. Dropped so (the call failed, timed out,
/// or the request went away while waiting for it), the script may still run in the
/// store and add the lease, which nothing would renew or release: the slot would stay
/// taken for `lease_ttl` with nothing in flight. Its
/// release is sent from the same thread, so on the thread's own store connection it
/// comes after the call.
struct PendingLease<'a> {
    store: &'a Arc<dyn BucketStore>,
    endpoint: &'a Arc<str>,
    ask: Ask,
    id: u64,
}

impl PendingLease<'_> {
    /// Answered: the lease is held (its `Slot` releases it) or was not taken.
    fn answered(self) {
        std::mem::forget(self);
    }
}

impl Drop for PendingLease<'_> {
    fn drop(&mut self) {
        let (store, endpoint) = (Arc::clone(self.store), Arc::clone(self.endpoint));
        let (ask, id) = (self.ask, self.id);
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(e) = store.release_lease(&endpoint, ask, id).await {
                    tracing::debug!(endpoint = %endpoint, error = %e, "could not release an unanswered lease");
                }
            });
        }
    }
}

impl Reservation {
    /// Sleeps until the start, following it when it moves up.
    async fn wait(&mut self) {
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(self.start.wake) => return,
                () = self.spot.moved() => {
                    if let Some(start) = self.waiting.start(&self.endpoint, &self.spot) {
                        self.start = start;
                    }
                }
            }
        }
    }

    /// The request leaves on this reservation: nothing is given back.
    fn disarm(mut self) {
        self.waiting.went(&self.endpoint, &self.spot);
        self.armed = false;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // The ones waiting behind move up; what is left goes back.
        let free = self
            .waiting
            .left(&self.endpoint, &self.spot)
            .unwrap_or(self.start);
        let store = Arc::clone(&self.store);
        let endpoint = std::mem::take(&mut self.endpoint);
        let unused = Unused {
            generation: self.generation,
            due_in_us: micros_until(free.due, Instant::now()),
            at_us: free.at_us,
        };
        let ask = self.ask;
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(e) = store.release(&endpoint, ask, unused).await {
                    tracing::debug!(endpoint, error = %e, "could not give back a reservation");
                }
            });
        }
    }
}

/// Instruments every store records into (registered by [`crate::metrics`]).
#[derive(Clone)]
pub struct StoreStats {
    /// `sluice_store_errors_total`: failed store calls.
    pub errors: prometheus_client::metrics::counter::Counter,
    /// `sluice_store_seconds`: latency of store calls.
    pub seconds: prometheus_client::metrics::histogram::Histogram,
    /// `sluice_store_degraded`: 1 while the `on_error` fallback is in force.
    pub degraded: prometheus_client::metrics::gauge::Gauge,
    /// `sluice_store_cooldown_notices_total`: cooldown notices this replica heard over
    /// Redis pub/sub (single Redis; its own 429s' included).
    pub notices: prometheus_client::metrics::counter::Counter,
    /// `sluice_store_rebuilds_total`: buckets the store had lost (or held only an older
    /// copy of) that a script of this replica rebuilt from what it heard.
    pub rebuilds: prometheus_client::metrics::counter::Counter,
    /// `sluice_store_degraded_slots`: on `redis-cluster`, the hash slots whose endpoints
    /// the `on_error` fallback decides now (0 on other stores).
    pub degraded_slots: prometheus_client::metrics::gauge::Gauge,
    /// `sluice_endpoints_tracked` and `sluice_endpoint_state_evicted_total`: the memory
    /// store's buckets (`store.max_endpoints`).
    pub endpoints: memory::EndpointStats,
}

impl Default for StoreStats {
    fn default() -> Self {
        StoreStats {
            errors: Default::default(),
            seconds: prometheus_client::metrics::histogram::Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.0001, 2.0, 16),
            ),
            degraded: Default::default(),
            notices: Default::default(),
            rebuilds: Default::default(),
            degraded_slots: Default::default(),
            endpoints: Default::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{MAX_RATE, MIN_RATE};
    use crate::limiter::memory::MemoryStore;
    use proptest::prelude::*;

    proptest! {
        /// No config `check` accepts can make the hot path panic: every wait and
        /// retry the bucket math hands out converts to a `Duration`, at any rate,
        /// burst, budget, cooldown and clock.
        #[test]
        fn bucket_math_never_panics_on_accepted_configs(
            rate in MIN_RATE..=MAX_RATE,
            burst in 1.0..=MAX_RATE,
            wait_s in 0.0..=86_400.0 * 365.0,
            recovery_s in 0.001..=86_400.0 * 365.0,
            floor_frac in 0.0..=1.0f64,
            pause_s in 0.0..=86_400.0 * 365.0,
            steps in proptest::collection::vec((0.0..1e13f64, 0u8..4), 1..40),
        ) {
            let adaptive = Adaptive {
                floor: (rate * floor_frac).max(MIN_RATE).min(rate),
                recovery: Duration::from_secs_f64(recovery_s),
                ..Adaptive::default()
            };
            let policy = Policy {
                rate,
                burst,
                max_wait: Duration::from_secs_f64(wait_s),
                adaptive: Some(adaptive),
                ..Policy::default()
            };
            let mut s = bucket::fresh(burst, 0.0);
            let mut now = 0.0;
            for (dt, op) in steps {
                now += dt;
                let ask = Ask::new(&policy, micros(policy.max_wait), None);
                match op {
                    0 | 1 => match bucket::acquire(&mut s, &ask, now) {
                        Outcome::Granted { wait_us, .. } => { from_micros(wait_us); }
                        Outcome::Refused { retry_us, .. } => { from_micros(retry_us); }
                    },
                    2 => {
                        let unused = Unused { generation: s.generation, due_in_us: 0.0, at_us: None };
                        bucket::release(&mut s, &ask, unused, now)
                    }
                    _ => bucket::feedback(&mut s, &ask, &adaptive, pause_s * 1e6, true, now),
                }
                let v = bucket::view(&s, &ask, Some(adaptive.floor), now);
                prop_assert!(v.rate.is_finite() && v.tokens.is_finite());
            }
        }
    }

    #[test]
    fn from_micros_saturates() {
        assert_eq!(from_micros(f64::NAN), Duration::ZERO);
        assert_eq!(from_micros(-5.0), Duration::ZERO);
        assert!(from_micros(f64::INFINITY) > Duration::from_secs(86_400 * 365));
        assert!(from_micros(1e300) > Duration::from_secs(86_400 * 365));
    }

    /// 4 tokens a second, a burst of 1, waits of up to 10 s, no adaptation.
    fn a_quarter_second_apart() -> Policy {
        Policy {
            rate: 4.0,
            burst: 1.0,
            max_wait: Duration::from_secs(10),
            adaptive: None,
            ..Policy::default()
        }
    }

    /// Sleeps and bucket refill share tokio's clock: in virtual time the waits are exact.
    #[tokio::test(start_paused = true)]
    async fn waits_are_exact_in_virtual_time() {
        let limiter = Limiter::new(Arc::new(MemoryStore::new()));
        let policy = a_quarter_second_apart();
        let mut waits = Vec::new();
        for _ in 0..3 {
            waits.push(limiter.admit("v", &policy).await.map(|g| g.waited));
        }
        let quarter = Duration::from_millis(250);
        assert_eq!(waits, [Ok(Duration::ZERO), Ok(quarter), Ok(quarter)]);
    }

    /// A queued request's start is counted from the call that reserved it, not from
    /// before its wait for a slot: when it leaves with others behind it, the start it
    /// leaves for the next sender is its own. Counted from before the wait, X (0.4 s
    /// waiting for a slot, given the start at 1.05 s) would leave another one: the next
    /// sender would start at 0.999 s, 0.05 s after another request's start (at 10/s,
    /// two within half a slot).
    #[tokio::test(start_paused = true)]
    async fn a_queued_request_leaving_leaves_its_own_start() {
        let limiter = Limiter::new(Arc::new(MemoryStore::new()));
        let policy = Policy {
            rate: 10.0,
            burst: 1.0,
            max_wait: Duration::from_secs(10),
            adaptive: None,
            max_in_flight: Some(1),
            ..Policy::default()
        };
        let ep: Arc<str> = Arc::from("q");
        let place = || queue::Place {
            class: 1,
            sender: None,
        };
        let t0 = Instant::now();
        // A holds the one slot until 0.4 s.
        let a = limiter.admit_queued(&ep, &policy, place()).await.unwrap();
        let x = {
            let (limiter, policy, ep) = (limiter.clone(), policy.clone(), Arc::clone(&ep));
            tokio::spawn(async move { limiter.admit_queued(&ep, &policy, place()).await })
        };
        // Others (another replica's, say) take starts at 0.35 s to 0.95 s.
        tokio::time::advance(Duration::from_millis(350)).await;
        let direct = Ask::new(&policy, 10e6, None);
        for _ in 0..7 {
            limiter.store.acquire("q", direct).await.unwrap();
        }
        tokio::time::advance(Duration::from_millis(50)).await;
        drop(a);
        // X takes the slot, and the start at 1.05 s.
        while limiter.waiting.count("q") == 0 {
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        // One more start behind X's (1.15 s), then X leaves at 0.5 s.
        limiter.store.acquire("q", direct).await.unwrap();
        tokio::time::sleep_until(t0 + Duration::from_millis(500)).await;
        x.abort();
        assert!(x.await.is_err_and(|e| e.is_cancelled()));
        // The give-back runs on its own task.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        // The next sender gets X's start.
        let next = limiter.store.acquire("q", direct).await.unwrap();
        let Outcome::Granted { wait_us, .. } = next else {
            panic!("{next:?}");
        };
        let at = (Instant::now() - t0).as_secs_f64() + wait_us / 1e6;
        assert!(
            (at - 1.05).abs() < 0.005,
            "the next sender starts at {at:.3} s"
        );
    }

    /// Senders waiting behind ones that leave move up a start each, in their order, and
    /// the starts left over go back: four of eight waiters hang up, the other four leave
    /// at the first four starts (a quarter second apart), and a sender arriving then
    /// comes after them. Were the four to keep their starts (1.25 s to 2 s), with the
    /// given-up ones only for senders arriving later, the endpoint would idle for a
    /// second when none arrives.
    #[tokio::test(start_paused = true)]
    async fn senders_behind_ones_that_leave_move_up_in_their_order() {
        let limiter = Limiter::new(Arc::new(MemoryStore::new()));
        let policy = a_quarter_second_apart();
        let t0 = Instant::now();
        let admit = |limiter: &Limiter| {
            let (limiter, policy) = (limiter.clone(), policy.clone());
            tokio::spawn(async move {
                limiter.admit("m", &policy).await.unwrap();
                Instant::now() - t0
            })
        };
        assert_eq!(admit(&limiter).await.unwrap(), Duration::ZERO, "the burst");
        let mut waiters = Vec::new();
        for i in 1..=8 {
            waiters.push(admit(&limiter));
            while limiter.waiting.count("m") < i {
                tokio::task::yield_now().await;
            }
        }
        tokio::time::advance(Duration::from_millis(100)).await;
        for w in waiters.drain(..4) {
            w.abort();
            assert!(w.await.unwrap_err().is_cancelled());
        }
        let late = admit(&limiter);
        let ms = |m| Duration::from_millis(m);
        let mut left = Vec::new();
        for w in waiters {
            left.push(w.await.unwrap());
        }
        let near = |d: Duration, m: u64| d.abs_diff(ms(m)) < ms(1);
        assert!(
            left.iter()
                .zip([250, 500, 750, 1000])
                .all(|(&d, m)| near(d, m)),
            "{left:?}"
        );
        let late = late.await.unwrap();
        assert!(near(late, 1250), "{late:?}: after the four, not among them");
        assert_eq!(limiter.waiting.endpoints(), 0, "nobody is left waiting");
    }

    fn at(rate: f64) -> Policy {
        Policy {
            rate,
            burst: 1.0,
            max_wait: Duration::from_secs(5),
            adaptive: None,
            ..Policy::default()
        }
    }

    /// The most arrivals (seconds) in any window of `w`, against `rate·w + burst`.
    fn worst_excess(arrivals: &mut [f64], rate: f64, burst: f64) -> f64 {
        arrivals.sort_by(f64::total_cmp);
        let mut worst = f64::MIN;
        for (i, a) in arrivals.iter().enumerate() {
            for (j, b) in arrivals.iter().enumerate().skip(i) {
                worst = worst.max((j - i + 1) as f64 - (rate * (b - a) + burst));
            }
        }
        worst
    }

    /// Admits a request in a task of its own; records when it was let go (seconds
    /// from `t0`) when `counted`.
    fn sender(
        limiter: &Limiter,
        policy: &Policy,
        t0: Instant,
        arrivals: &Arc<std::sync::Mutex<Vec<f64>>>,
        counted: bool,
    ) -> tokio::task::JoinHandle<Option<Grant>> {
        let (limiter, policy, arrivals) = (limiter.clone(), policy.clone(), Arc::clone(arrivals));
        tokio::spawn(async move {
            let grant = limiter.admit("e", &policy).await.ok();
            if grant.is_some() && counted {
                arrivals
                    .lock()
                    .unwrap()
                    .push((Instant::now() - t0).as_secs_f64());
            }
            grant
        })
    }

    async fn until_waiting(limiter: &Limiter, n: usize) {
        while limiter.waiting.count("e") < n {
            tokio::task::yield_now().await;
        }
    }

    /// A refund (the address was refused after admission) counts from the grant's
    /// start, not from when the refund comes: at 1/s, A leaves at 0 s, B reserves 1.0 s,
    /// and A's refund at 0.99 s must not give back 0.99 of a token (C would leave at
    /// 1.01 s, 10 ms after B). A start already past gives back only what the balance has
    /// not regained since, and nothing with B behind it.
    #[tokio::test(start_paused = true)]
    async fn a_refund_after_the_start_went_by_gives_nothing_with_a_reservation_behind_it() {
        let limiter = Limiter::new(Arc::new(MemoryStore::new()));
        let p = at(1.0);
        let t0 = Instant::now();
        let arrivals = Arc::default();
        let a = limiter.admit("e", &p).await.unwrap();
        let b = sender(&limiter, &p, t0, &arrivals, true);
        until_waiting(&limiter, 1).await;
        tokio::time::advance(Duration::from_millis(990)).await;
        limiter.refund("e", &p, a).await;
        let c = sender(&limiter, &p, t0, &arrivals, true);
        b.await.unwrap().unwrap();
        c.await.unwrap().unwrap();
        let mut arrivals = arrivals.lock().unwrap().clone();
        assert!(
            worst_excess(&mut arrivals, 1.0, 1.0) <= 1e-6,
            "B and C at {arrivals:?} (1/s, burst 1)"
        );
    }

    /// A reload raises the rate from 2/s to 10/s while ten requests wait for starts
    /// 0.5 s apart; new requests go after them. The first waiter's address is refused
    /// and refunded just after its start: a refund that lowered the latest start would
    /// let the 40 requests after it leave among the old reservations (9 over the
    /// bound).
    #[tokio::test(start_paused = true)]
    async fn a_refund_after_a_rate_raise_keeps_new_requests_after_the_old_reservations() {
        let limiter = Limiter::new(Arc::new(MemoryStore::new()));
        let (old, new) = (at(2.0), at(10.0));
        let t0 = Instant::now();
        let arrivals = Arc::default();
        let mut tasks = vec![sender(&limiter, &old, t0, &arrivals, true)];
        let first = sender(&limiter, &old, t0, &arrivals, false);
        until_waiting(&limiter, 1).await;
        for i in 2..=10 {
            tasks.push(sender(&limiter, &old, t0, &arrivals, true));
            until_waiting(&limiter, i).await;
        }
        tokio::time::advance(Duration::from_millis(200)).await;
        tasks.push(sender(&limiter, &new, t0, &arrivals, true));
        let grant = first
            .await
            .unwrap()
            .expect("the first waiter leaves at 0.5 s");
        tokio::time::advance(Duration::from_millis(50)).await;
        limiter.refund("e", &old, grant).await;
        for _ in 0..40 {
            tasks.push(sender(&limiter, &new, t0, &arrivals, true));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let mut arrivals = arrivals.lock().unwrap().clone();
        // The ten old requests left (the refunded one not counted), and new ones within
        // their 5 s `max_wait`.
        assert!(arrivals.len() > 11, "{} left", arrivals.len());
        let excess = worst_excess(&mut arrivals, 10.0, 1.0);
        assert!(excess <= 1e-6, "{excess} arrivals over 10·W + 1");
    }

    /// The memory store's sweep keeps a bucket whose balance has refilled at a raised
    /// rate while starts made at the old one are still ahead: evicting it would meet new
    /// requests with a fresh bucket beside them (4 over the bound).
    #[tokio::test(start_paused = true)]
    async fn a_sweep_after_a_rate_raise_keeps_the_starts_still_ahead() {
        let store = Arc::new(MemoryStore::new());
        let limiter = Limiter::new(Arc::clone(&store) as Arc<dyn BucketStore>);
        let (old, new) = (at(1.0), at(10.0));
        let t0 = Instant::now();
        let arrivals = Arc::default();
        let mut tasks = Vec::new();
        for i in 0..6 {
            tasks.push(sender(&limiter, &old, t0, &arrivals, true));
            until_waiting(&limiter, i).await;
        }
        tokio::time::advance(Duration::from_millis(200)).await;
        tasks.push(sender(&limiter, &new, t0, &arrivals, true));
        until_waiting(&limiter, 6).await;
        tokio::time::advance(Duration::from_millis(700)).await;
        store.sweep_all();
        assert!(
            !store.is_empty(),
            "the bucket is kept while its starts are ahead"
        );
        for _ in 0..40 {
            tasks.push(sender(&limiter, &new, t0, &arrivals, true));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let mut arrivals = arrivals.lock().unwrap().clone();
        let excess = worst_excess(&mut arrivals, 10.0, 1.0);
        assert!(excess <= 1e-6, "{excess} arrivals over 10·W + 1");
    }

    /// A waiter moved up to the start of one that hung up leaves at that start, and its
    /// refund names that start, not its own original one, which went back to the store
    /// (or to the waiter behind it) when it moved. A refund (the address was refused
    /// after admission) naming the original would give that start back a second time:
    /// at 1/s, A (1 s), B (2 s), C (3 s) wait; A hangs up, B moves to 1 s, C to 2 s, 3 s
    /// goes back. B's refund at 1 s would name 2 s, C's start, and the next sender D be
    /// given 2 s, beside C.
    #[tokio::test(start_paused = true)]
    async fn a_moved_up_grant_refunds_the_start_it_took() {
        let limiter = Limiter::new(Arc::new(MemoryStore::new()));
        let p = at(1.0);
        let t0 = Instant::now();
        let arrivals: Arc<std::sync::Mutex<Vec<f64>>> = Arc::default();
        let _r0 = limiter.admit("e", &p).await.unwrap();
        arrivals.lock().unwrap().push(0.0);
        let a = sender(&limiter, &p, t0, &arrivals, false);
        until_waiting(&limiter, 1).await;
        let b = sender(&limiter, &p, t0, &arrivals, false);
        until_waiting(&limiter, 2).await;
        let c = sender(&limiter, &p, t0, &arrivals, true);
        until_waiting(&limiter, 3).await;
        tokio::time::advance(Duration::from_millis(100)).await;
        a.abort();
        assert!(a.await.unwrap_err().is_cancelled());
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let grant = b.await.unwrap().expect("B leaves");
        let left_at = (Instant::now() - t0).as_secs_f64();
        assert!((left_at - 1.0).abs() < 0.01, "B left at {left_at}");
        // B's address is refused: its token goes back.
        limiter.refund("e", &p, grant).await;
        let d = sender(&limiter, &p, t0, &arrivals, true);
        c.await.unwrap().unwrap();
        d.await.unwrap().unwrap();
        let mut arrivals = arrivals.lock().unwrap().clone();
        assert!(
            worst_excess(&mut arrivals, 1.0, 1.0) <= 1e-6,
            "arrivals at {arrivals:?} (1/s, burst 1); B's grant named start {:?} s",
            grant.start - t0
        );
    }

    /// A cooldown voids the reservations of generation 0 and empties the bucket
    /// (`last` = 0), so the bucket is idle again soon after it ends, while voided starts
    /// can still be ahead. The bucket is kept until they are past: were it to go (the
    /// memory store's sweep; in Redis its key expires) and the next one be made afresh,
    /// at generation 0 again, a voided reservation of generation 0 would be confirmed,
    /// taking nothing, beside a fresh burst. The failure this guards against, at 1/s,
    /// burst 1: W4 and W5 wait for 4 s and 5 s; a quota answer pauses
    /// the endpoint 1 ms at 0.1 s; the senders of the starts between (on another replica)
    /// hang up; N1 takes
    /// 1.1 s. By 3.5 s the bucket is idle and swept; N2 leaves at 3.5 s, W4 confirms and
    /// leaves at 4 s, N3 at 4.5 s, W5 at 5 s, N4 at 5.5 s: 5 in 2 s against 3.
    #[tokio::test(start_paused = true)]
    async fn a_voided_reservation_is_never_confirmed_by_a_bucket_made_afresh() {
        let store = Arc::new(MemoryStore::new());
        let limiter = Limiter::new(Arc::clone(&store) as Arc<dyn BucketStore>);
        let p = Policy {
            max_wait: Duration::from_secs(10),
            ..at(1.0)
        };
        let t0 = Instant::now();
        let arrivals: Arc<std::sync::Mutex<Vec<f64>>> = Arc::default();
        limiter.admit("e", &p).await.unwrap();
        arrivals.lock().unwrap().push(0.0);
        // W1 to W3 wait on another replica (sharing the bucket), W4 and W5 on this one.
        let other = Limiter::new(Arc::clone(&store) as Arc<dyn BucketStore>);
        let mut gone = Vec::new();
        let mut kept = Vec::new();
        for i in 1..=3 {
            gone.push(sender(&other, &p, t0, &arrivals, false));
            until_waiting(&other, i).await;
        }
        for i in 1..=2 {
            kept.push(sender(&limiter, &p, t0, &arrivals, true));
            until_waiting(&limiter, i).await;
        }
        tokio::time::advance(Duration::from_millis(100)).await;
        // A quota answer (`RateLimit: "q";r=0;t=0`, not a 429): a 1 ms pause, no decrease.
        let ask = Ask::new(&p, 0.0, None);
        limiter
            .store
            .feedback(
                "e",
                ask,
                Adaptive::default(),
                Duration::from_millis(1),
                false,
            )
            .await
            .unwrap();
        for w in gone {
            w.abort();
            assert!(w.await.unwrap_err().is_cancelled());
        }
        tokio::time::advance(Duration::from_millis(100)).await;
        kept.push(sender(&limiter, &p, t0, &arrivals, true));
        until_waiting(&limiter, 3).await;
        assert_eq!(other.waiting.count("e"), 0);
        tokio::time::sleep_until(t0 + Duration::from_millis(3500)).await;
        store.sweep_all();
        for _ in 0..3 {
            kept.push(sender(&limiter, &p, t0, &arrivals, true));
            for _ in 0..5 {
                tokio::task::yield_now().await;
            }
        }
        for t in kept {
            t.await.unwrap().unwrap();
        }
        let mut arrivals = arrivals.lock().unwrap().clone();
        let excess = worst_excess(&mut arrivals, 1.0, 1.0);
        assert!(
            excess <= 1e-6,
            "arrivals at {arrivals:?}: {excess} over 1·W + 1"
        );
    }
}
