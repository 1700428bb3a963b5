//! Coalescing of concurrent acquires of one endpoint into one Redis script call.
//!
//! An endpoint with no acquire in flight sends its acquire at once, alone: an idle
//! endpoint pays nothing extra. While one is in flight, further acquires of that endpoint
//! wait in its *lane*; when the call returns, everything that queued meanwhile goes out
//! as the next call — one `acquire.lua` invocation with one (budget, held) pair per ask,
//! decided in arrival order exactly as back-to-back calls at one instant would be (same
//! refill, same reservations, same refusals). A saturated endpoint thus costs one round
//! trip per batch rather than per request, and keeps its FIFO order: a batch is sent only
//! after the previous call for its endpoint was decided.
//!
//! The first ask of a lane is sent by its own request; the batches after it by a task the
//! lane owns, so a request that hangs up never strands the ones queued behind it. A
//! queued ask whose request hung up before its batch left is not sent; one that hung up
//! while its batch was in flight has its reservation given back.
//!
//! A batch's outcomes reach requests waiting on other workers through each worker's
//! [`Mailbox`]: one wake-up per worker and call, not one per request.
//!
//! With `store.prefetch`, a busy endpoint's calls also ask for tokens ahead, and the
//! requests after them spend those without queueing at all (see [`super::credit`]) —
//! on a single Redis only while the cooldown notices heard vouch that none started
//! since those tokens were asked for.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

use super::StoreError;
use super::bucket::{Ask, Outcome};
use super::cooldowns::CooldownWatch;
use super::credit::{Credits, Leftover};
use super::mailbox::Mailbox;
use super::redis::Calls;

/// At most this many asks go in one script call (the rest in the next).
const MAX_BATCH: usize = 256;

/// Where an outcome goes.
type Reply = oneshot::Sender<Result<Outcome, StoreError>>;

/// One queued ask, where its outcome goes, and the mailbox of the thread its request
/// waits on.
struct Waiter {
    ask: Ask,
    reply: Reply,
    home: Option<Arc<Mailbox<Parcel>>>,
}

/// An outcome on its way to a request on another thread.
struct Parcel {
    reply: Reply,
    outcome: Outcome,
    ask: Ask,
    /// Where a grant goes back when its request hung up meanwhile.
    lane: Arc<(Arc<Calls>, Box<str>)>,
}

impl Parcel {
    /// Hands the outcome on (on the request's own thread, from its mailbox).
    fn deliver(self) {
        if self.reply.send(Ok(self.outcome)).is_err() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let (calls, endpoint) = &*self.lane;
                    give_back(calls, endpoint, &self.ask, self.outcome).await;
                });
            }
        }
    }
}

thread_local! {
    /// This thread's mailbox for batch outcomes, opened on first use.
    static MAILBOX: RefCell<Option<Arc<Mailbox<Parcel>>>> = const { RefCell::new(None) };
}

/// The current thread's open mailbox (a new one when its runtime ended), or `None`
/// outside a runtime.
fn mailbox_here() -> Option<Arc<Mailbox<Parcel>>> {
    MAILBOX.with(|m| {
        let mut m = m.borrow_mut();
        if !m.as_ref().is_some_and(|mb| mb.is_open()) {
            *m = Mailbox::open(Parcel::deliver);
        }
        m.clone()
    })
}

/// Every endpoint with an acquire in flight, and what queued behind it (an endpoint is
/// in the map exactly while a call for it is in flight); with `store.prefetch`, the
/// tokens held ahead.
#[derive(Default)]
pub(super) struct Lanes {
    queues: Mutex<HashMap<Box<str>, Vec<Waiter>>>,
    ahead: Option<Credits>,
    /// Cooldown notices heard (single Redis): held tokens are spent only while they
    /// vouch that no cooldown started since. `None`: spent until their end.
    watch: Option<Arc<CooldownWatch>>,
}

impl Lanes {
    /// Lanes that ask for tokens ahead when `prefetch` is on, checking `watch` (when
    /// there is one) before spending them.
    pub(super) fn new(prefetch: bool, watch: Option<Arc<CooldownWatch>>) -> Lanes {
        Lanes {
            queues: Mutex::default(),
            ahead: prefetch.then(Credits::default),
            watch,
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Box<str>, Vec<Waiter>>> {
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets the tokens `endpoint` holds ahead (it answered 429).
    pub(super) fn throttled(&self, endpoint: &str) {
        if let Some(ahead) = &self.ahead {
            ahead.drop_endpoint(endpoint);
        }
    }

    /// How many tokens to ask ahead: none without prefetch, nor while the cooldown
    /// notices could not vouch for them (they would only come back unspent).
    fn wanted(&self, endpoint: &str, batch: usize) -> u32 {
        if self.watch.as_ref().is_some_and(|w| !w.listening()) {
            return 0;
        }
        self.ahead.as_ref().map_or(0, |a| a.wanted(endpoint, batch))
    }

    /// The next batch for `endpoint`, or `None` (and the lane closed) when none queued.
    fn next(&self, endpoint: &str) -> Option<Vec<Waiter>> {
        let mut lanes = self.lock();
        let queue = lanes.get_mut(endpoint)?;
        queue.retain(|w| !w.reply.is_closed());
        if queue.is_empty() {
            lanes.remove(endpoint);
            return None;
        }
        // One call shares one policy: a reload between two asks splits the batch.
        let first = queue[0].ask;
        let n = queue
            .iter()
            .take(MAX_BATCH)
            .take_while(|w| same_policy(&w.ask, &first))
            .count();
        Some(queue.drain(..n).collect())
    }
}

fn same_policy(a: &Ask, b: &Ask) -> bool {
    a.rate == b.rate && a.burst == b.burst && a.recovery_us == b.recovery_us
}

/// Decides `ask` for `endpoint`: alone at once when nothing is in flight for it, else in
/// the next batch.
pub(super) async fn acquire(
    calls: &Arc<Calls>,
    lanes: &Arc<Lanes>,
    endpoint: &str,
    ask: Ask,
) -> Result<Outcome, StoreError> {
    if let Some(ahead) = &lanes.ahead {
        let quiet = |bucket: &str, since| {
            lanes
                .watch
                .as_ref()
                .is_none_or(|w| w.quiet_since(bucket, since))
        };
        if let Some(generation) = ahead.spend(endpoint, &ask, quiet) {
            return Ok(Outcome::Granted {
                wait_us: 0.0,
                generation,
            });
        }
    }
    let home = mailbox_here();
    let queued = {
        let mut map = lanes.lock();
        match map.get_mut(endpoint) {
            Some(queue) => {
                let (reply, outcome) = oneshot::channel();
                queue.push(Waiter { ask, reply, home });
                Some(outcome)
            }
            None => {
                map.insert(endpoint.into(), Vec::new());
                None
            }
        }
    };
    if let Some(outcome) = queued {
        return outcome.await.unwrap_or_else(|_| {
            Err(StoreError::Unreachable(
                "the batch carrying this acquire was dropped".to_owned(),
            ))
        });
    }
    // This request opens the lane: its call goes alone, and whatever queues behind it
    // is handed on when the call ends (or when this request hangs up).
    let _handover = Handover {
        calls,
        lanes,
        endpoint,
    };
    // Boxed: a queued ask (most of them, on a busy endpoint) then carries a small
    // future, not the whole script call's state, which only the lane's opener needs.
    let asks = [ask];
    let opening = Box::pin(call(calls, lanes, endpoint, &asks));
    let mut outcomes = opening.await?;
    outcomes
        .pop()
        .ok_or_else(|| StoreError::Protocol("acquire answered no outcome".to_owned()))
}

/// One script call for `asks`, asking tokens ahead when the endpoint is busy; keeps the
/// tokens it got and arranges for the unspent ones to be given back at their end.
async fn call(
    calls: &Arc<Calls>,
    lanes: &Arc<Lanes>,
    endpoint: &str,
    asks: &[Ask],
) -> Result<Vec<Outcome>, StoreError> {
    let want = lanes.wanted(endpoint, asks.len());
    let sent = tokio::time::Instant::now();
    let (outcomes, got) = calls.acquire(endpoint, asks, want).await?;
    if let (Some(ahead), Some(ask), Some(Outcome::Granted { generation, .. })) =
        (&lanes.ahead, asks.first(), outcomes.last())
    {
        if got > 0 {
            let (serial, until, stale) =
                ahead.keep(endpoint, &calls.key(endpoint), ask, got, *generation, sent);
            let (calls, lanes, endpoint, ask) = (
                Arc::clone(calls),
                Arc::clone(lanes),
                Box::<str>::from(endpoint),
                *ask,
            );
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    if let Some(stale) = stale {
                        give_back_ahead(&calls, &endpoint, &ask, stale).await;
                    }
                    tokio::time::sleep_until(until).await;
                    let left = lanes
                        .ahead
                        .as_ref()
                        .and_then(|a| a.expire(&endpoint, serial));
                    if let Some(left) = left {
                        give_back_ahead(&calls, &endpoint, &ask, left).await;
                    }
                });
            }
        }
    }
    Ok(outcomes)
}

/// Tokens taken ahead and never spent: back into the bucket.
async fn give_back_ahead(calls: &Calls, endpoint: &str, ask: &Ask, (n, generation): Leftover) {
    if let Err(e) = calls.give_back_ahead(endpoint, ask, generation, n).await {
        tracing::debug!(endpoint, error = %e, "could not give back tokens held ahead");
    }
}

/// Hands a lane's queue to a task when the call that opened it ends.
struct Handover<'a> {
    calls: &'a Arc<Calls>,
    lanes: &'a Arc<Lanes>,
    endpoint: &'a str,
}

impl Drop for Handover<'_> {
    fn drop(&mut self) {
        let Some(batch) = self.lanes.next(self.endpoint) else {
            return;
        };
        let (calls, lanes) = (Arc::clone(self.calls), Arc::clone(self.lanes));
        let endpoint: Box<str> = self.endpoint.into();
        // Outside a runtime (only at shutdown) the queued asks are dropped, and their
        // requests see the store as unreachable.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(drain(calls, lanes, endpoint, batch));
        }
    }
}

/// Sends batches for `endpoint` until its lane is empty.
async fn drain(calls: Arc<Calls>, lanes: Arc<Lanes>, endpoint: Box<str>, first: Vec<Waiter>) {
    let lane = Arc::new((calls, endpoint));
    let (calls, endpoint) = (&lane.0, &*lane.1);
    let mut batch = first;
    loop {
        let asks: Vec<Ask> = batch.iter().map(|w| w.ask).collect();
        match call(calls, &lanes, endpoint, &asks).await {
            Ok(outcomes) if outcomes.len() == batch.len() => {
                hand_out(&lane, batch, outcomes).await;
            }
            Ok(_) => {
                let e = StoreError::Protocol("acquire answered a short batch".to_owned());
                fail(batch, &e);
            }
            Err(e) => fail(batch, &e),
        }
        // One turn of the worker's loop before the next batch leaves: requests that
        // became readable with this call's answer join it rather than the one after.
        // About a fifth fewer script calls per request under load (docs/BENCHMARKS.md).
        tokio::task::yield_now().await;
        match lanes.next(endpoint) {
            Some(next) => batch = next,
            None => return,
        }
    }
}

/// Gives each waiter its outcome: those on other threads through their thread's
/// mailbox (one post per thread), the rest here; a grant whose request hung up goes
/// back.
async fn hand_out(lane: &Arc<(Arc<Calls>, Box<str>)>, batch: Vec<Waiter>, outcomes: Vec<Outcome>) {
    let here = mailbox_here();
    let mut away: Vec<(Arc<Mailbox<Parcel>>, Vec<Parcel>)> = Vec::new();
    let mut local = Vec::with_capacity(batch.len());
    for (w, outcome) in batch.into_iter().zip(outcomes) {
        match w.home {
            Some(home) if !here.as_ref().is_some_and(|h| Arc::ptr_eq(h, &home)) => {
                let parcel = Parcel {
                    reply: w.reply,
                    outcome,
                    ask: w.ask,
                    lane: Arc::clone(lane),
                };
                match away.iter_mut().find(|(h, _)| Arc::ptr_eq(h, &home)) {
                    Some((_, parcels)) => parcels.push(parcel),
                    None => away.push((home, vec![parcel])),
                }
            }
            _ => local.push((w.reply, w.ask, outcome)),
        }
    }
    for (home, parcels) in away {
        // A closed mailbox (its runtime ended) hands its parcels back: deliver here.
        if let Err(parcels) = home.post(parcels) {
            local.extend(parcels.into_iter().map(|p| (p.reply, p.ask, p.outcome)));
        }
    }
    let (calls, endpoint) = &**lane;
    for (reply, ask, outcome) in local {
        if reply.send(Ok(outcome)).is_err() {
            give_back(calls, endpoint, &ask, outcome).await;
        }
    }
}

fn fail(batch: Vec<Waiter>, e: &StoreError) {
    for w in batch {
        let _ = w.reply.send(Err(e.clone()));
    }
}

/// A grant whose request hung up while its batch was in flight: give the token back.
async fn give_back(calls: &Calls, endpoint: &str, ask: &Ask, outcome: Outcome) {
    if let Outcome::Granted { generation, .. } = outcome {
        if let Err(e) = calls.release(endpoint, ask, generation).await {
            tracing::debug!(endpoint, error = %e, "could not give back an abandoned reservation");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With prefetch, a batch asks ahead only while cooldown notices can stop what it
    /// takes (a single Redis whose subscription is up), or where there are none to wait
    /// for (cluster, sentinel).
    #[test]
    fn nothing_is_asked_ahead_while_the_notices_are_down() {
        let watch = Arc::new(CooldownWatch::default());
        let lanes = Lanes::new(true, Some(Arc::clone(&watch)));
        assert_eq!(lanes.wanted("e", 10), 0, "not subscribed yet");
        watch.subscribed(true);
        assert_eq!(lanes.wanted("e", 10), 40);
        watch.subscribed(false);
        assert_eq!(lanes.wanted("e", 10), 0, "subscription lost");
        assert_eq!(Lanes::new(true, None).wanted("e", 10), 40);
        assert_eq!(Lanes::new(false, None).wanted("e", 10), 0, "prefetch off");
    }
}
