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
//! A lane's calls are sent by a task of its own, from its first ask (sent at once) until
//! its queue is empty, so a request that hangs up never strands the ones queued behind
//! it, nor tokens its call took ahead. An ask whose request hung up before its batch
//! left is not sent; one that hung up while its batch was in flight has its reservation
//! given back.
//!
//! A batch's outcomes reach requests waiting on other workers through each worker's
//! [`Mailbox`]: one wake-up per worker and call, not one per request.
//!
//! With `store.prefetch`, a busy endpoint's calls also ask for tokens ahead, and the
//! requests after them spend those without a round trip (see [`super::credit`]) — on a
//! single Redis only while the cooldown notices heard vouch that none started since
//! those tokens were asked for. Arrival order holds with them too: a request spends a
//! held token at once only when nothing of its endpoint is in flight or queued here;
//! otherwise it queues, and the queue is served from held tokens, in order, before any
//! of it goes to Redis.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

use super::StoreError;
use super::bucket::{Ask, Outcome, Unused};
use super::cooldowns::CooldownWatch;
use super::credit::{Credits, Leftover, Taken};
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
    /// Whether held tokens are topped up before they run out (see [`top_up`]).
    top_ups: bool,
}

impl Lanes {
    /// Lanes that ask for tokens ahead when `prefetch` is on, checking `watch` (when
    /// there is one) before spending them.
    pub(super) fn new(prefetch: bool, watch: Option<Arc<CooldownWatch>>) -> Lanes {
        Lanes {
            queues: Mutex::default(),
            ahead: prefetch.then(Credits::default),
            watch,
            top_ups: false,
        }
    }

    /// These lanes, topping held tokens up before they run out (`store.prefetch =
    /// "alone"`: with `true`, other replicas would find them held for as long as the
    /// traffic lasts, rather than for about 5 ms).
    pub(super) fn with_top_ups(mut self) -> Lanes {
        self.top_ups = self.ahead.is_some();
        self
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

    /// Spends a token `endpoint` holds ahead for `ask`, if the cooldown notices (when
    /// there are any) vouch for it; its generation.
    fn spend(&self, endpoint: &str, ask: &Ask) -> Option<u64> {
        self.spend_then(endpoint, ask, false).map(|(g, _)| g)
    }

    /// [`spend`](Self::spend), and with `top_up` (and top-ups on, and the cooldown
    /// notices able to vouch for more), whether to top the endpoint's held tokens up
    /// now and by how many.
    fn spend_then(&self, endpoint: &str, ask: &Ask, top_up: bool) -> Option<(u64, Option<u32>)> {
        // A token held ahead is one token of the bucket alone: never a costlier
        // request's, nor one the windows must count.
        if !ask.plain() {
            return None;
        }
        let ahead = self.ahead.as_ref()?;
        let quiet = |bucket: &str, since| {
            self.watch
                .as_ref()
                .is_none_or(|w| w.quiet_since(bucket, since))
        };
        let top_up = top_up && self.top_ups && self.watch.as_ref().is_none_or(|w| w.listening());
        ahead.spend_then(endpoint, ask, quiet, top_up)
    }

    /// Admits an ask of `endpoint`: granted from a held token when nothing of the
    /// endpoint is in flight or queued here (none arrived before it and is undecided),
    /// queued behind the call in flight (its outcome to come through `home()`), or made
    /// the lane's opener.
    fn admit(
        &self,
        endpoint: &str,
        ask: Ask,
        home: impl FnOnce() -> Option<Arc<Mailbox<Parcel>>>,
    ) -> Admit {
        let mut map = self.lock();
        match map.get_mut(endpoint) {
            Some(queue) => {
                let (reply, outcome) = oneshot::channel();
                queue.push(Waiter {
                    ask,
                    reply,
                    home: home(),
                });
                Admit::Queued(outcome)
            }
            None => {
                if let Some((generation, top_up)) = self.spend_then(endpoint, &ask, true) {
                    return Admit::Spent(generation, top_up);
                }
                map.insert(endpoint.into(), Vec::new());
                Admit::Open
            }
        }
    }

    /// What queued for `endpoint` while its call was in flight: the front of the queue
    /// granted from held tokens, in order, then the next batch for Redis. `None` (and
    /// the lane closed) when the queue is empty or held tokens served all of it.
    fn next(&self, endpoint: &str) -> Option<Next> {
        let mut lanes = self.lock();
        let queue = lanes.get_mut(endpoint)?;
        queue.retain(|w| !w.reply.is_closed());
        let mut served = Vec::new();
        if self.ahead.is_some() {
            let n = queue
                .iter()
                .map_while(|w| self.spend(endpoint, &w.ask))
                .map(|generation| Outcome::Granted {
                    wait_us: 0.0,
                    generation,
                    at_us: None,
                })
                .take(MAX_BATCH)
                .collect::<Vec<_>>();
            served = queue.drain(..n.len()).zip(n).collect();
        }
        if queue.is_empty() {
            lanes.remove(endpoint);
            return (!served.is_empty()).then_some(Next {
                served,
                batch: Vec::new(),
            });
        }
        // One call shares one policy: a reload between two asks splits the batch.
        let first = queue[0].ask;
        let n = queue
            .iter()
            .take(MAX_BATCH)
            .take_while(|w| same_policy(&w.ask, &first))
            .count();
        Some(Next {
            served,
            batch: queue.drain(..n).collect(),
        })
    }
}

/// How an ask entered its lane.
enum Admit {
    /// Granted from a token held ahead, with its generation, and how many to top
    /// the endpoint's held tokens up by now, if that spend calls for it.
    Spent(u64, Option<u32>),
    /// Queued: its outcome comes with the next batch.
    Queued(oneshot::Receiver<Result<Outcome, StoreError>>),
    /// Nothing was in flight: this request sends its ask itself.
    Open,
}

/// The next turn of a lane: asks granted from held tokens, and the batch for Redis
/// (possibly empty).
struct Next {
    served: Vec<(Waiter, Outcome)>,
    batch: Vec<Waiter>,
}

fn same_policy(a: &Ask, b: &Ask) -> bool {
    a.rate == b.rate
        && a.burst == b.burst
        && a.recovery_us == b.recovery_us
        && a.windows == b.windows
}

/// Decides `ask` for `endpoint`: alone at once when nothing is in flight for it, else in
/// the next batch.
pub(super) async fn acquire(
    calls: &Arc<Calls>,
    lanes: &Arc<Lanes>,
    endpoint: &str,
    ask: Ask,
) -> Result<Outcome, StoreError> {
    match lanes.admit(endpoint, ask, mailbox_here) {
        Admit::Spent(generation, topping) => {
            if let Some(want) = topping {
                tokio::spawn(top_up(
                    Arc::clone(calls),
                    Arc::clone(lanes),
                    endpoint.into(),
                    ask,
                    want,
                ));
            }
            return Ok(Outcome::Granted {
                wait_us: 0.0,
                generation,
                at_us: None,
            });
        }
        Admit::Queued(outcome) => {
            return outcome.await.unwrap_or_else(|_| {
                Err(StoreError::Unreachable(
                    "the batch carrying this acquire was dropped".to_owned(),
                ))
            });
        }
        Admit::Open => {}
    }

    // This request opens the lane: its ask goes out alone, now, from a task of the lane's
    // that then sends whatever queued behind it. A request that hangs up meanwhile thus
    // strands nothing: its grant is given back and the tokens taken ahead are kept.
    let (reply, outcome) = oneshot::channel();
    let first = Next {
        served: Vec::new(),
        batch: vec![Waiter {
            ask,
            reply,
            home: None,
        }],
    };
    tokio::spawn(drain(
        Arc::clone(calls),
        Arc::clone(lanes),
        endpoint.into(),
        first,
    ));
    outcome.await.unwrap_or_else(|_| {
        Err(StoreError::Unreachable(
            "the call carrying this acquire was dropped".to_owned(),
        ))
    })
}

/// One script call for `asks`, asking tokens ahead when the endpoint is busy; keeps the
/// tokens it got and arranges for the unspent ones to be given back at their end.
async fn call(
    calls: &Arc<Calls>,
    lanes: &Arc<Lanes>,
    endpoint: &str,
    asks: &[Ask],
) -> Result<Vec<Outcome>, StoreError> {
    let Some(first) = asks.first() else {
        return Ok(Vec::new());
    };
    let want = lanes.wanted(endpoint, asks.len());
    let sent = tokio::time::Instant::now();
    let (outcomes, taken) = calls.acquire(endpoint, first, asks, want).await?;
    hold(calls, lanes, endpoint, first, taken, sent);
    Ok(outcomes)
}

/// A call asking only for tokens ahead, sent when a request spent one of the last
/// quarter that `endpoint` held: the next ones arrive before these run out, so its
/// requests keep going without waiting for a round trip. No request waits for it,
/// and none queues behind it (arrival order is the lane's, untouched).
async fn top_up(calls: Arc<Calls>, lanes: Arc<Lanes>, endpoint: Box<str>, ask: Ask, want: u32) {
    let sent = tokio::time::Instant::now();
    let got = match calls.acquire(&endpoint, &ask, &[], want).await {
        Ok((_, taken)) => {
            hold(&calls, &lanes, &endpoint, &ask, taken, sent);
            taken.n
        }
        Err(e) => {
            tracing::debug!(endpoint = %endpoint, error = %e, "could not top up tokens held ahead");
            0
        }
    };
    if got == 0 {
        if let Some(ahead) = &lanes.ahead {
            ahead.topped(&endpoint);
        }
    }
}

/// Keeps the tokens `taken` ahead by a call sent at `sent` and arranges for the unspent
/// ones to be given back at their end.
fn hold(
    calls: &Arc<Calls>,
    lanes: &Arc<Lanes>,
    endpoint: &str,
    ask: &Ask,
    taken: Taken,
    sent: tokio::time::Instant,
) {
    let Some(ahead) = lanes.ahead.as_ref().filter(|_| taken.n > 0) else {
        return;
    };
    let (serial, until, stale) = ahead.keep(endpoint, &calls.key(endpoint), ask, taken, sent);
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

/// Tokens taken ahead and never spent: back into the bucket.
async fn give_back_ahead(calls: &Calls, endpoint: &str, ask: &Ask, left: Leftover) {
    if let Err(e) = calls.give_back_ahead(endpoint, ask, left).await {
        tracing::debug!(endpoint, error = %e, "could not give back tokens held ahead");
    }
}

/// Sends batches for `endpoint` until its lane is empty.
async fn drain(calls: Arc<Calls>, lanes: Arc<Lanes>, endpoint: Box<str>, first: Next) {
    let lane = Arc::new((calls, endpoint));
    let (calls, endpoint) = (&lane.0, &*lane.1);
    let mut next = first;
    loop {
        let Next { served, batch } = next;
        if !served.is_empty() {
            let (waiters, outcomes) = served.into_iter().unzip();
            hand_out(&lane, waiters, outcomes).await;
        }
        if batch.is_empty() {
            return;
        }
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
            Some(more) => next = more,
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
    if let Outcome::Granted {
        generation,
        wait_us,
        at_us,
    } = outcome
    {
        // Its start on Redis's clock, where the answer said it (not for a confirmed
        // reservation, whose start came before the call). Else, counted from now, it
        // would be later than Redis's by the time the answer took to come: due now
        // instead, so what comes back is never too much.
        let unused = Unused {
            generation,
            due_in_us: wait_us.min(0.0),
            at_us,
        };
        if let Err(e) = calls.release(endpoint, ask, unused).await {
            tracing::debug!(endpoint, error = %e, "could not give back an abandoned reservation");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` tokens ahead of `generation`, in hold 0.
    fn taken(n: u32, generation: u64) -> Taken {
        Taken {
            n,
            generation,
            hold: 0,
        }
    }

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

    /// Top-ups only where they were asked for ("alone"): a request that spends one of
    /// the last quarter of the held tokens is told to send one.
    #[tokio::test(start_paused = true)]
    async fn held_tokens_are_topped_up_only_where_wanted() {
        let low = |lanes: &Lanes| {
            let ahead = lanes.ahead.as_ref().unwrap();
            let (_, _, _) = ahead.keep(
                "e",
                "k",
                &ask(0.0),
                taken(4, 1),
                tokio::time::Instant::now(),
            );
            for _ in 0..2 {
                ahead.spend("e", &ask(0.0), |_, _| true).unwrap();
            }
        };
        let plain = Lanes::new(true, None);
        low(&plain);
        assert!(
            matches!(plain.admit("e", ask(0.0), || None), Admit::Spent(1, None)),
            "prefetch = true: no top-ups"
        );
        let watch = Arc::new(CooldownWatch::default());
        watch.subscribed(true);
        let alone = Lanes::new(true, Some(watch)).with_top_ups();
        low(&alone);
        assert!(matches!(
            alone.admit("e", ask(0.0), || None),
            Admit::Spent(1, Some(8))
        ));
        assert!(
            matches!(alone.admit("e", ask(0.0), || None), Admit::Spent(1, None)),
            "one in flight"
        );
        let off = Lanes::new(false, None).with_top_ups();
        assert!(matches!(off.admit("e", ask(0.0), || None), Admit::Open));
    }

    /// An ask told apart by its budget.
    fn ask(tag: f64) -> Ask {
        Ask {
            rate: 10.0,
            burst: 100.0,
            budget_us: tag,
            recovery_us: 0.0,
            held: None,
            cost: 1.0,
            windows: crate::window::Windows::NONE,
        }
    }

    fn queued(admit: Admit) -> oneshot::Receiver<Result<Outcome, StoreError>> {
        match admit {
            Admit::Queued(rx) => rx,
            Admit::Spent(..) => panic!("spent a held token"),
            Admit::Open => panic!("opened a second call"),
        }
    }

    /// Held tokens never let a request overtake one that arrived before it: while a
    /// call of the endpoint is in flight, newcomers queue even with tokens held, and the
    /// queue is served from them in arrival order before any of it goes to Redis.
    #[tokio::test(start_paused = true)]
    async fn held_tokens_serve_the_queue_in_arrival_order_before_newcomers() {
        let lanes = Lanes::new(true, None);
        assert!(matches!(lanes.admit("e", ask(1.0), || None), Admit::Open));
        // The opener's call comes back with two tokens ahead...
        let credits = lanes.ahead.as_ref().unwrap();
        credits.keep(
            "e",
            "k",
            &ask(0.0),
            taken(2, 9),
            tokio::time::Instant::now(),
        );
        // ... while three more requests arrived: they queue behind the call in flight.
        let _second = queued(lanes.admit("e", ask(2.0), || None));
        let _third = queued(lanes.admit("e", ask(3.0), || None));
        let _fourth = queued(lanes.admit("e", ask(4.0), || None));
        let next = lanes.next("e").expect("a queue");
        let budgets = |w: &[Waiter]| w.iter().map(|w| w.ask.budget_us).collect::<Vec<_>>();
        let served: Vec<Waiter> = next.served.into_iter().map(|(w, _)| w).collect();
        assert_eq!(
            budgets(&served),
            [2.0, 3.0],
            "the first two, from the held tokens"
        );
        assert_eq!(budgets(&next.batch), [4.0], "the rest goes to Redis");
        // That batch is in flight: a newcomer queues (no token left anyway).
        let _fifth = queued(lanes.admit("e", ask(5.0), || None));
        let next = lanes.next("e").expect("the fifth");
        assert!(next.served.is_empty());
        assert_eq!(budgets(&next.batch), [5.0]);
        // Its call came back with a token ahead and nothing queued behind it: the lane
        // closes, and the next newcomer spends the token at once.
        credits.keep(
            "e",
            "k",
            &ask(0.0),
            taken(1, 9),
            tokio::time::Instant::now(),
        );
        assert!(lanes.next("e").is_none());
        assert!(matches!(
            lanes.admit("e", ask(6.0), || None),
            Admit::Spent(9, _)
        ));
        assert!(matches!(lanes.admit("e", ask(7.0), || None), Admit::Open));
    }
}
