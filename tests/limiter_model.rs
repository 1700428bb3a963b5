//! A model-based test of the limiter: random sequences of requests (some dropped while
//! they wait, some refunded after their grant, some holding an in-flight slot), 429
//! feedback, time going by, reloads that change an endpoint's rate and burst, and the
//! shared store failing and coming back, run against a [`Limiter`] over each store and
//! checked against a small model of the contract (docs/SPEC.md, "Guarantees"):
//!
//! - **no overdraw**: the requests let go and not refunded, in any window `[a, b]`,
//!   number at most `R·(b − a + late) + B`. `R` and `B` are the highest rate and burst
//!   among the policies in force from `max_wait` before the window to its end (a reload
//!   does not reach reservations already made: docs/operations.md, "What a reload does
//!   not reach"); `late` is how late a clock may serve a start;
//! - **cooldown holds**: no request is let go from the moment a feedback call returned
//!   until its pause ends, including requests already waiting;
//! - **no burst after a cooldown**: from a cooldown's end `e`, at most `R·(t − e + late)`
//!   requests by any `t` (the bucket restarts empty);
//! - **in flight ≤ `max_in_flight`** on the leased endpoint, counting the slots the test
//!   holds (a lower bound of what the store counts);
//! - **FIFO**: in virtual time, of two requests to one endpoint the earlier is let go no
//!   later, unless a cooldown or a store failure came between them (both requeue);
//! - **nothing left behind**: once every request ended, no endpoint has a waiting room.
//!
//! The memory store and the `on_error = "local"` fallback (over a memory store that a
//! switch takes away and brings back) run in virtual time, where every instant is exact.
//! A real Redis runs in real time with short sequences; its failure is a kill and a
//! restart empty (a Redis that lost its state: guarantee 1 covers it, guarantee 4 does not,
//! so cooldowns a restart falls into are not checked there).
//!
//! Five known gaps, where the code falls short of the contract by one request or a
//! fraction of a slot, are allowed for by the tests `.ci/run` runs and checked by the
//! `#[ignore]`d `*_strict_contract` ones (`cargo test --test limiter_model -- --ignored`),
//! which fail until they are closed; `check` and `model` describe each.
//!
//! Each test prints its seed; `PROPTEST_RNG_SEED=<seed>` runs the same cases again, and a
//! failure shows the shrunk sequence of operations. The seeds are fixed per test, so a
//! run is repeatable; `SLUICE_MODEL_EXPLORE=1` draws fresh ones to look for new
//! counterexamples.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{RngSeed, TestCaseError, TestRunner};
use sluice::config::{Adaptive, Backend, OnError, Policy, StoreConfig};
use sluice::limiter::fallback::Resilient;
use sluice::limiter::memory::MemoryStore;
use sluice::limiter::peers::{HEARTBEAT_TTL, Peers};
use sluice::limiter::redis::RedisStore;
use sluice::limiter::{
    Ask, BucketStore, Grant, LeaseAsk, Leased, Limiter, Outcome, Place, StoreError, StoreFuture,
    StoreHealth, StoreStats, Unused, View,
};
use tokio::time::Instant;

/// Endpoints: two plain ones (one adaptive) and one with `max_in_flight`.
const ENDPOINTS: usize = 3;
/// The leased endpoint and its cap.
const LEASED: usize = 2;
const MAX_IN_FLIGHT: u32 = 2;
/// What a reload may set.
const RATES: [f64; 4] = [2.0, 5.0, 10.0, 20.0];
const BURSTS: [f64; 3] = [1.0, 2.0, 4.0];
/// Wait budgets a request may have (ms); the longest bounds how far back a window looks
/// for the policies whose reservations can reach it.
const WAITS: [u16; 4] = [0, 100, 500, 2000];

/// One step of a sequence.
#[derive(Debug, Clone)]
enum Op {
    /// `n` requests to `ep` with a wait budget: each dropped after `cancel_ms` if still
    /// waiting, or refunded `refund_ms` after its grant (its request never left), or
    /// else holding its slot (leased endpoint) for `hold_ms`.
    Send {
        ep: usize,
        n: u8,
        wait_ms: u16,
        cancel_ms: Option<u16>,
        refund_ms: Option<u16>,
        hold_ms: u16,
    },
    /// A receiver's answer that pauses `ep` (a 429 when `throttled`).
    Feedback {
        ep: usize,
        pause_ms: u16,
        throttled: bool,
    },
    /// Time goes by.
    Advance { ms: u16 },
    /// A reload gives `ep` another rate and burst.
    Reload {
        ep: usize,
        rate: usize,
        burst: usize,
    },
    /// The shared store fails.
    Down,
    /// The shared store answers again (a Redis restarted empty).
    Up,
}

/// Sequences of up to `most` steps; with store failures when `outages`, with reloads
/// when `reloads`.
fn ops(outages: bool, reloads: bool, most: usize) -> impl Strategy<Value = Vec<Op>> {
    let send = (
        0..ENDPOINTS,
        1u8..=4,
        prop::sample::select(WAITS.to_vec()),
        prop::option::weighted(0.3, 0u16..1500),
        prop::option::weighted(0.2, 0u16..300),
        0u16..500,
    )
        .prop_map(|(ep, n, wait_ms, cancel_ms, refund_ms, hold_ms)| Op::Send {
            ep,
            n,
            wait_ms,
            cancel_ms,
            refund_ms,
            hold_ms,
        });
    let feedback = (
        0..ENDPOINTS,
        prop::sample::select(vec![1u16, 50, 300, 1000]),
        any::<bool>(),
    )
        .prop_map(|(ep, pause_ms, throttled)| Op::Feedback {
            ep,
            pause_ms,
            throttled,
        });
    let advance = (0u16..800).prop_map(|ms| Op::Advance { ms });
    let reload = (0..ENDPOINTS, 0..RATES.len(), 0..BURSTS.len())
        .prop_map(|(ep, rate, burst)| Op::Reload { ep, rate, burst });
    let outage = u32::from(outages);
    let reloaded = u32::from(reloads);
    let op = prop_oneof![
        6 => send,
        1 => feedback,
        4 => advance,
        reloaded => reload,
        outage => Just(Op::Down),
        outage => Just(Op::Up),
    ];
    prop::collection::vec(op, 1..most)
}

/// The policy each endpoint starts with.
fn initial(ep: usize) -> Policy {
    let adaptive = Adaptive {
        recovery: Duration::from_secs(2),
        ..Adaptive::default()
    };
    match ep {
        0 => policy(10.0, 2.0, Some(adaptive)),
        1 => policy(5.0, 1.0, None),
        _ => Policy {
            max_in_flight: Some(MAX_IN_FLIGHT),
            ..policy(10.0, 4.0, Some(adaptive))
        },
    }
}

fn policy(rate: f64, burst: f64, adaptive: Option<Adaptive>) -> Policy {
    Policy {
        rate,
        burst,
        adaptive,
        ..Policy::default()
    }
}

/// Which store the limiter runs over.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Memory,
    Fallback,
    Redis,
}

impl Kind {
    /// How late a start may be served: tokio's 1 ms timer grid in virtual time; that
    /// plus scheduling on a shared machine in real time.
    fn late(self) -> Duration {
        match self {
            Kind::Redis => Duration::from_millis(150),
            _ => Duration::from_millis(1),
        }
    }

    fn virtual_time(self) -> bool {
        self != Kind::Redis
    }
}

/// An instant of the run: a sequence number (the order things happened in, exact on
/// the current-thread runtime the runs use) and the clock.
type Stamp = (u64, Instant);

#[derive(Debug, Default, Clone)]
struct Req {
    ep: usize,
    issued: Option<Stamp>,
    granted: Option<Stamp>,
    /// It took an in-flight slot, given back at `released`.
    slot: bool,
    released: Option<Stamp>,
    refunded: bool,
    /// The fallback decided locally when it was asked for / let go.
    degraded_at_issue: bool,
    degraded_at_grant: bool,
}

#[derive(Debug, Clone)]
struct Pause {
    ep: usize,
    sent: Instant,
    returned: Stamp,
    pause: Duration,
}

#[derive(Debug, Clone)]
struct Epoch {
    at: Instant,
    rate: f64,
    burst: f64,
}

/// What happened in one run.
#[derive(Debug, Default)]
struct Log {
    reqs: Vec<Req>,
    pauses: Vec<Pause>,
    /// Per endpoint, the policies in force from each instant.
    epochs: Vec<Vec<Epoch>>,
    /// Store failures: down, and up again (`None`: still down at the end).
    outages: Vec<(Stamp, Option<Stamp>)>,
    /// Per endpoint, when its rate may rise: a reload raising it, the climb after a 429.
    rises: Vec<(usize, Instant)>,
}

#[derive(Default)]
struct Record {
    seq: AtomicU64,
    log: Mutex<Log>,
}

impl Record {
    fn stamp(&self) -> Stamp {
        (self.seq.fetch_add(1, Ordering::Relaxed), Instant::now())
    }

    fn with<T>(&self, f: impl FnOnce(&mut Log) -> T) -> T {
        f(&mut self.log.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// A memory store behind a switch: every call fails while `down` (a shared store gone).
struct Switched {
    store: MemoryStore,
    down: AtomicBool,
}

impl Switched {
    fn answer<T: Send + 'static>(&self, v: impl FnOnce() -> T) -> StoreFuture<'_, T> {
        let r = if self.down.load(Ordering::Relaxed) {
            Err(StoreError::Unreachable("switched off".into()))
        } else {
            Ok(v())
        };
        Box::pin(std::future::ready(r))
    }
}

impl BucketStore for Switched {
    fn acquire<'a>(&'a self, e: &'a str, ask: Ask) -> StoreFuture<'a, Outcome> {
        self.answer(|| self.store.acquire_now(e, ask))
    }
    fn release<'a>(&'a self, e: &'a str, ask: Ask, u: Unused) -> StoreFuture<'a, ()> {
        self.answer(|| self.store.release_now(e, ask, u))
    }
    fn feedback<'a>(
        &'a self,
        e: &'a str,
        ask: Ask,
        a: Adaptive,
        pause: Duration,
        throttled: bool,
    ) -> StoreFuture<'a, ()> {
        self.answer(|| self.store.feedback_now(e, ask, &a, pause, throttled))
    }
    fn cap<'a>(&'a self, e: &'a str, ask: Ask, most: f64) -> StoreFuture<'a, ()> {
        self.answer(|| self.store.cap_now(e, ask, most))
    }
    fn view<'a>(&'a self, e: &'a str, ask: Ask, f: Option<f64>) -> StoreFuture<'a, Option<View>> {
        self.answer(|| self.store.view_now(e, ask, f))
    }
    fn ping(&self) -> StoreFuture<'_, ()> {
        self.answer(|| ())
    }
    fn acquire_leased<'a>(&'a self, e: &'a str, ask: Ask, l: LeaseAsk) -> StoreFuture<'a, Leased> {
        self.answer(|| self.store.acquire_leased_now(e, ask, l))
    }
    fn renew_lease<'a>(&'a self, e: &'a str, ask: Ask, l: LeaseAsk) -> StoreFuture<'a, bool> {
        self.answer(|| self.store.renew_lease_now(e, ask, l))
    }
    fn adopt_lease<'a>(&'a self, e: &'a str, ask: Ask, l: LeaseAsk) -> StoreFuture<'a, ()> {
        self.answer(|| self.store.adopt_lease_now(e, ask, l))
    }
    fn release_lease<'a>(&'a self, e: &'a str, ask: Ask, id: u64) -> StoreFuture<'a, ()> {
        self.answer(|| self.store.release_lease_now(e, ask, id))
    }
}

/// One run's limiter, endpoints and record.
struct Run {
    limiter: Limiter,
    names: Vec<Arc<str>>,
    record: Record,
}

/// The Redis server of a test, shared by its cases (each on endpoints of its own).
type Server = Arc<Mutex<Option<common::redis::RedisServer>>>;

/// Runs `ops` against a limiter over `kind`'s store and checks the record.
async fn run(
    kind: Kind,
    strict: bool,
    ops: Vec<Op>,
    case: u64,
    server: Option<Server>,
) -> Result<(), String> {
    let switch = Arc::new(Switched {
        store: MemoryStore::new(),
        down: AtomicBool::new(false),
    });
    let store: Arc<dyn BucketStore> = match kind {
        Kind::Memory => Arc::new(MemoryStore::new()),
        Kind::Fallback => Arc::new(Resilient::new(
            Arc::clone(&switch) as Arc<dyn BucketStore>,
            OnError::Local,
            StoreStats::default(),
            Arc::new(Peers::new(1)),
        )),
        Kind::Redis => {
            let url = with_server(server.as_ref(), |s| s.url());
            let cfg = StoreConfig {
                backend: Backend::Redis,
                urls: vec![url],
                key_prefix: "sluice:".into(),
                timeout: Duration::from_millis(200),
                on_error: OnError::Deny,
                ..StoreConfig::default()
            };
            let store = RedisStore::connect(&cfg, StoreStats::default())
                .await
                .map_err(|e| format!("connect: {e}"))?;
            store
                .heartbeat(HEARTBEAT_TTL)
                .await
                .map_err(|e| format!("heartbeat: {e}"))?;
            Arc::new(store)
        }
    };
    let run = Arc::new(Run {
        limiter: Limiter::new(store),
        names: (0..ENDPOINTS)
            .map(|ep| Arc::from(format!("model-{case}-{ep}")))
            .collect(),
        record: Record::default(),
    });
    let t0 = Instant::now();
    let mut policies: Vec<Arc<Policy>> = (0..ENDPOINTS).map(|ep| Arc::new(initial(ep))).collect();
    run.record.with(|log| {
        log.epochs = policies
            .iter()
            .map(|p| {
                vec![Epoch {
                    at: t0,
                    rate: p.rate,
                    burst: p.burst,
                }]
            })
            .collect();
    });
    let mut tasks = Vec::new();
    let mut down = false;
    for op in &ops {
        match *op {
            Op::Send {
                ep,
                n,
                wait_ms,
                cancel_ms,
                refund_ms,
                hold_ms,
            } => {
                let policy = Arc::new(Policy {
                    max_wait: ms(wait_ms),
                    ..(*policies[ep]).clone()
                });
                for _ in 0..n {
                    let id = run.record.with(|log| {
                        log.reqs.push(Req {
                            ep,
                            ..Req::default()
                        });
                        log.reqs.len() - 1
                    });
                    let how = How {
                        cancel: cancel_ms.map(ms),
                        refund: refund_ms.map(ms),
                        hold: ms(hold_ms),
                    };
                    let (run, policy) = (Arc::clone(&run), Arc::clone(&policy));
                    tasks.push(tokio::spawn(request(run, id, policy, how)));
                }
            }
            Op::Feedback {
                ep,
                pause_ms,
                throttled,
            } => {
                let p = &policies[ep];
                let ask = Ask::new(p, 0.0, None);
                let adaptive = p.adaptive.unwrap_or_default();
                let sent = Instant::now();
                let answer = run.limiter.store().feedback(
                    &run.names[ep],
                    ask,
                    adaptive,
                    ms(pause_ms),
                    throttled,
                );
                // A feedback that failed (the store away, `on_error = "deny"`) started
                // no cooldown: nothing is promised for it.
                if answer.await.is_ok() {
                    let returned = run.record.stamp();
                    run.record.with(|log| {
                        log.pauses.push(Pause {
                            ep,
                            sent,
                            returned,
                            pause: ms(pause_ms),
                        });
                        if throttled && p.adaptive.is_some() {
                            log.rises.push((ep, returned.1 + ms(pause_ms)));
                        }
                    });
                }
            }
            Op::Advance { ms: d } => tokio::time::sleep(ms(d)).await,
            Op::Reload { ep, rate, burst } => {
                policies[ep] = Arc::new(Policy {
                    rate: RATES[rate],
                    burst: BURSTS[burst],
                    ..(*policies[ep]).clone()
                });
                let at = Instant::now();
                run.record.with(|log| {
                    if log.epochs[ep].last().is_some_and(|e| e.rate < RATES[rate]) {
                        log.rises.push((ep, at));
                    }
                    log.epochs[ep].push(Epoch {
                        at,
                        rate: RATES[rate],
                        burst: BURSTS[burst],
                    })
                });
            }
            Op::Down if !down => {
                down = true;
                fail(kind, &switch, server.as_ref()).await;
                let at = run.record.stamp();
                run.record.with(|log| log.outages.push((at, None)));
            }
            Op::Up if down => {
                down = false;
                recover(kind, &switch, server.as_ref()).await;
                let at = run.record.stamp();
                run.record.with(|log| {
                    if let Some(last) = log.outages.last_mut() {
                        last.1 = Some(at);
                    }
                });
            }
            Op::Down | Op::Up => {}
        }
        // Lets the requests just spawned make their first call before the next step.
        tokio::task::yield_now().await;
    }
    if down {
        recover(kind, &switch, server.as_ref()).await;
    }
    for t in tasks {
        t.await.map_err(|e| format!("a request panicked: {e}"))?;
    }
    // Releases and give-backs are spawned by the drops: let them run.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let left = run.limiter.gates().len();
    let log = run.record.with(std::mem::take);
    check(kind, strict, t0, &log)?;
    if left != 0 {
        return Err(format!(
            "{left} waiting rooms left after every request ended"
        ));
    }
    Ok(())
}

fn ms(ms: u16) -> Duration {
    Duration::from_millis(u64::from(ms))
}

fn with_server<T>(
    server: Option<&Server>,
    f: impl FnOnce(&mut common::redis::RedisServer) -> T,
) -> T {
    let server = server.expect("a Redis run has a server");
    let mut guard = server.lock().unwrap_or_else(PoisonError::into_inner);
    f(guard.as_mut().expect("the server is in place"))
}

/// Takes the shared store away.
async fn fail(kind: Kind, switch: &Switched, server: Option<&Server>) {
    match kind {
        Kind::Memory => {}
        Kind::Fallback => switch.down.store(true, Ordering::Relaxed),
        Kind::Redis => with_server(server, |s| s.kill()),
    }
}

/// Brings the shared store back (a Redis restarted empty, on the same port).
async fn recover(kind: Kind, switch: &Switched, server: Option<&Server>) {
    match kind {
        Kind::Memory => {}
        Kind::Fallback => switch.down.store(false, Ordering::Relaxed),
        Kind::Redis => {
            let server = Arc::clone(server.expect("a Redis run has a server"));
            // Off the runtime: starting redis-server blocks until it answers.
            tokio::task::spawn_blocking(move || {
                let mut guard = server.lock().unwrap_or_else(PoisonError::into_inner);
                guard.as_mut().expect("the server is in place").restart();
            })
            .await
            .expect("redis-server restarted");
        }
    }
}

/// What becomes of one request.
struct How {
    cancel: Option<Duration>,
    refund: Option<Duration>,
    hold: Duration,
}

async fn request(run: Arc<Run>, id: usize, policy: Arc<Policy>, how: How) {
    let issued = run.record.stamp();
    let degraded = run.limiter.store().health() == StoreHealth::Degraded;
    run.record.with(|log| {
        log.reqs[id].issued = Some(issued);
        log.reqs[id].degraded_at_issue = degraded;
    });
    let ep = run.record.with(|log| log.reqs[id].ep);
    let name = &run.names[ep];
    let admit = async {
        if policy.max_in_flight.is_some() {
            let place = Place {
                class: 1,
                sender: None,
            };
            let a = run.limiter.admit_queued(name, &policy, place).await?;
            Ok::<(Grant, _), sluice::limiter::Refusal>((a.grant, a.slot))
        } else {
            Ok((run.limiter.admit(name, &policy).await?, None))
        }
    };
    let outcome = match how.cancel {
        // Dropped while it waits: the sender hung up.
        Some(after) => match tokio::time::timeout(after, admit).await {
            Ok(outcome) => outcome,
            Err(_) => return,
        },
        None => admit.await,
    };
    let Ok((grant, slot)) = outcome else {
        return;
    };
    let granted = run.record.stamp();
    let degraded = run.limiter.store().health() == StoreHealth::Degraded;
    run.record.with(|log| {
        let r = &mut log.reqs[id];
        r.granted = Some(granted);
        r.degraded_at_grant = degraded;
        r.slot = slot.is_some();
    });
    match how.refund {
        Some(after) => {
            // Its request never left (a destination refused after admission).
            tokio::time::sleep(after).await;
            let at = run.record.stamp();
            run.record.with(|log| {
                let r = &mut log.reqs[id];
                r.refunded = true;
                r.released = Some(at);
            });
            drop(slot);
            run.limiter.refund(name, &policy, grant).await;
        }
        None => {
            tokio::time::sleep(how.hold).await;
            // Counted out before the store hears it: the test's count never exceeds it.
            let at = run.record.stamp();
            run.record.with(|log| log.reqs[id].released = Some(at));
            drop(slot);
        }
    }
}

/// Seconds from `t0`, for messages.
fn secs(t0: Instant, t: Instant) -> f64 {
    t.saturating_duration_since(t0).as_secs_f64()
}

/// Checks the contract on what happened.
fn check(kind: Kind, strict: bool, t0: Instant, log: &Log) -> Result<(), String> {
    let late = kind.late().as_secs_f64();
    let look_back = Duration::from_millis(u64::from(*WAITS.iter().max().unwrap_or(&0)));
    let recovery = initial(0).adaptive.map_or(Duration::ZERO, |a| a.recovery);
    for ep in 0..ENDPOINTS {
        // Known gap 1 (not checked unless `strict`): once the rate has risen, a
        // reservation made at the lower rate can leave with the balance already refilled
        // at the higher one, and a newcomer asking at or after its start goes beside it:
        // one request over the bound, until the reservations made at the lower rate
        // have left.
        let rising = |a: Instant, b: Instant| {
            !strict
                && log.rises.iter().any(|&(e, at)| {
                    e == ep && at <= b && a <= at + recovery + look_back + look_back
                })
        };
        // Known gap 2 (the fallback; not checked unless `strict`): a shared reservation
        // a cooldown voided, waking during an outage after that cooldown ended, leaves at
        // its old start, charged to the local bucket, where the shared store would have
        // booked it afresh after the cooldown: one request over the bound each.
        let survivor = |r: &Req| {
            !strict
                && kind == Kind::Fallback
                && r.degraded_at_grant
                && log.pauses.iter().any(|p| {
                    p.ep == ep
                        && r.issued.is_some_and(|i| i.0 < p.returned.0)
                        && r.granted.is_some_and(|g| g.1 >= p.sent + p.pause)
                })
        };
        let epochs = &log.epochs[ep];
        // The highest rate and burst in force at any time in [from, to].
        let highest = |from: Instant, to: Instant| -> (f64, f64) {
            let mut most = (0.0f64, 0.0f64);
            for (i, e) in epochs.iter().enumerate() {
                let end = epochs.get(i + 1).map(|n| n.at);
                if e.at <= to && end.is_none_or(|end| end >= from) {
                    most = (most.0.max(e.rate), most.1.max(e.burst));
                }
            }
            most
        };
        let reqs: Vec<&Req> = log.reqs.iter().filter(|r| r.ep == ep).collect();
        let mut sent: Vec<(Instant, bool)> = reqs
            .iter()
            .filter(|r| !r.refunded)
            .filter_map(|r| r.granted.map(|g| (g.1, survivor(r))))
            .collect();
        sent.sort_by_key(|s| s.0);
        let survivors = |from: usize, to: usize| sent[from..=to].iter().filter(|s| s.1).count();

        // No overdraw: every window between two requests sent.
        for i in 0..sent.len() {
            let mut j = i;
            while j < sent.len() {
                // Every request at the window's end is in it.
                while j + 1 < sent.len() && sent[j + 1].0 == sent[j].0 {
                    j += 1;
                }
                let (a, b) = (sent[i].0, sent[j].0);
                let (rate, burst) = highest(a.checked_sub(look_back).unwrap_or(t0), b);
                let w = (b - a).as_secs_f64();
                let count = j - i + 1;
                let gaps = survivors(i, j) + usize::from(rising(a, b));
                let bound = rate * (w + late) + burst + gaps as f64;
                if count as f64 > bound + 1e-9 {
                    let shown: Vec<String> = sent[i..=j]
                        .iter()
                        .map(|t| format!("{:.4}", secs(t0, t.0)))
                        .collect();
                    return Err(format!(
                        "overdraw on endpoint {ep}: {count} requests sent in [{:.4} s, {:.4} s], \
                         at most {bound:.3} (rate {rate}, burst {burst}, window {w:.4} s + \
                         {late} s late); sent at {shown:?}",
                        secs(t0, a),
                        secs(t0, b),
                    ));
                }
                j += 1;
            }
        }

        // Known gap 3 (the fallback; not checked unless `strict`): a pause shorter than
        // a cooldown known before an outage, applied to the local bucket during it,
        // ends that cooldown early there (the local bucket's clock moves back to the
        // shorter pause's end).
        let first_down = log.outages.first().map_or(u64::MAX, |o| o.0.0);
        let cut_short = |p: &Pause| {
            !strict
                && kind == Kind::Fallback
                && log.pauses.iter().any(|q| {
                    q.ep == ep
                        && q.returned.0 > p.returned.0
                        && q.returned.0 > first_down
                        && q.sent + q.pause < p.sent + p.pause
                })
        };
        // Cooldowns: nothing let go while one holds, no burst after it.
        for p in log.pauses.iter().filter(|p| p.ep == ep && !cut_short(p)) {
            let end = p.sent + p.pause;
            if kind == Kind::Redis && restarted_within(log, p.returned.1, end) {
                // A Redis restarted empty forgets its cooldowns (not covered).
                continue;
            }
            for (k, r) in reqs.iter().enumerate() {
                let (Some(issued), Some(granted)) = (r.issued, r.granted) else {
                    continue;
                };
                // In real time a request that waited may have been decided before the
                // feedback and answered after it: only later requests are certain.
                let certain = kind.virtual_time() || issued.0 > p.returned.0;
                if certain && granted.0 > p.returned.0 && granted.1 < end {
                    return Err(format!(
                        "request {k} on endpoint {ep} let go at {:.4} s, during the cooldown \
                         from {:.4} s to {:.4} s (feedback returned at {:.4} s)",
                        secs(t0, granted.1),
                        secs(t0, p.sent),
                        secs(t0, end),
                        secs(t0, p.returned.1),
                    ));
                }
            }
            // Known gap 4 (the fallback; not checked unless `strict`): a cooldown learned
            // during an outage that ended before the store answers again leaves the
            // shared bucket as it was (only a cooldown's rest is handed over), so it does
            // not restart empty there.
            let learned_in_outage = !strict && kind == Kind::Fallback && p.returned.0 > first_down;
            if !kind.virtual_time() || learned_in_outage {
                continue;
            }
            // A later pause that ends later takes over: the bucket restarts at its end.
            let overtaken = log.pauses.iter().any(|q| {
                q.ep == ep
                    && q.returned.0 > p.returned.0
                    && q.returned.1 <= end
                    && q.sent + q.pause > end
            });
            if overtaken {
                continue;
            }
            let after: Vec<(Instant, bool)> = sent.iter().copied().filter(|t| t.0 >= end).collect();
            let mut gaps = 0;
            for (n, &(t, survived)) in after.iter().enumerate() {
                gaps += usize::from(survived);
                let (rate, _) = highest(end.checked_sub(look_back).unwrap_or(t0), t);
                let bound = rate * ((t - end).as_secs_f64() + late)
                    + (gaps + usize::from(rising(end, t))) as f64;
                if (n + 1) as f64 > bound + 1e-9 {
                    return Err(format!(
                        "burst after the cooldown of endpoint {ep} ending at {:.4} s: {} \
                         requests by {:.4} s, at most {bound:.3} (rate {rate})",
                        secs(t0, end),
                        n + 1,
                        secs(t0, t),
                    ));
                }
            }
        }

        // In flight ≤ max_in_flight. A Redis restarted empty forgets the leases held
        // until their next renewal (SPEC, "Concurrency"): only slots taken since the
        // last restart count.
        if ep == LEASED {
            let restarts: Vec<u64> = match kind {
                Kind::Redis => log
                    .outages
                    .iter()
                    .filter_map(|o| o.1.map(|u| u.0))
                    .collect(),
                _ => Vec::new(),
            };
            let restarted_before = |seq: u64| restarts.iter().filter(|u| **u < seq).max().copied();
            let mut changes: Vec<(u64, i32)> = Vec::new();
            for r in reqs.iter().filter(|r| r.slot) {
                let Some(g) = r.granted else { continue };
                if let Some(rel) = r.released {
                    if restarted_before(rel.0) != restarted_before(g.0) {
                        // Taken before a restart and still held after it.
                        let restart = restarted_before(rel.0).unwrap_or(0);
                        changes.push((g.0, 1));
                        changes.push((restart, -1));
                        continue;
                    }
                }
                changes.push((g.0, 1));
                if let Some(rel) = r.released {
                    changes.push((rel.0, -1));
                }
            }
            changes.sort();
            let mut held = 0;
            for (seq, d) in changes {
                held += d;
                if held > MAX_IN_FLIGHT as i32 {
                    return Err(format!(
                        "{held} requests in flight on endpoint {ep} (max_in_flight \
                         {MAX_IN_FLIGHT}), at step {seq}"
                    ));
                }
            }
        }

        // FIFO, in virtual time.
        if kind.virtual_time() {
            let granted: Vec<(usize, Stamp, Stamp)> = reqs
                .iter()
                .enumerate()
                .filter_map(|(k, r)| Some((k, r.issued?, r.granted?)))
                .collect();
            let degraded: Vec<bool> = reqs.iter().map(|r| r.degraded_at_issue).collect();
            for (x, &(ka, ia, ga)) in granted.iter().enumerate() {
                for &(kb, ib, gb) in &granted[x + 1..] {
                    let (first, second) = if ia.0 < ib.0 {
                        ((ka, ia, ga), (kb, gb))
                    } else {
                        ((kb, ib, gb), (ka, ga))
                    };
                    let ((k1, i1, g1), (k2, g2)) = (first, second);
                    if g1.1 <= g2.1 {
                        continue;
                    }
                    let (from, to) = (i1.0, g1.0.max(g2.0));
                    let paused = log
                        .pauses
                        .iter()
                        .any(|p| p.ep == ep && p.returned.0 > from && p.returned.0 < to);
                    let failed = log.outages.iter().any(|(d, u)| {
                        (d.0 > from && d.0 < to) || u.is_some_and(|u| u.0 > from && u.0 < to)
                    });
                    // A request booked locally asks the shared store afresh once it is
                    // back (SPEC, guarantee 1): the deciding store changed between them.
                    let switched = degraded[k1] != degraded[k2]
                        || (kind == Kind::Fallback && i1.0 > first_down);
                    if !paused && !failed && !switched {
                        return Err(format!(
                            "endpoint {ep}: request {k2} asked after request {k1} but was let \
                             go first ({:.4} s before {:.4} s)",
                            secs(t0, g2.1),
                            secs(t0, g1.1),
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Whether the store was restarted (came back up) within `[from, to]`.
fn restarted_within(log: &Log, from: Instant, to: Instant) -> bool {
    log.outages
        .iter()
        .any(|(down, up)| down.1 <= to && up.is_none_or(|u| u.1 >= from))
}

/// The seed for this test's cases: `PROPTEST_RNG_SEED` when set; a fresh one with
/// `SLUICE_MODEL_EXPLORE=1` (to look for new counterexamples); else one fixed per test,
/// so a run of `.ci/run` is repeatable and fails only on a change of the code.
fn seed(test: &str) -> u64 {
    let fixed = || {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        test.hash(&mut h);
        h.finish()
    };
    let explore = std::env::var("SLUICE_MODEL_EXPLORE").is_ok_and(|v| v == "1");
    let seed = std::env::var("PROPTEST_RNG_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| if explore { rand_seed() } else { fixed() });
    eprintln!("{test}: seed {seed} (PROPTEST_RNG_SEED={seed} runs the same cases)");
    seed
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

/// How many cases of at most how many steps, and how hard to shrink a failure.
struct Size {
    cases: u32,
    most: usize,
    shrink: u32,
}

/// Runs random sequences against `kind`; `strict` checks the known gaps too.
fn model(test: &str, kind: Kind, strict: bool, size: Size, server: Option<Server>) {
    let seed = seed(test);
    let config = ProptestConfig {
        cases: size.cases,
        max_shrink_iters: size.shrink,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(seed),
        ..ProptestConfig::default()
    };
    let case = AtomicU64::new(0);
    let mut runner = TestRunner::new(config);
    // Known gap 5 (not checked unless `strict`): a reload during an outage; the
    // fallback hands the shared store a cap computed with the policy it last saw, which
    // can refill the shared bucket to the old burst at the instant the new policy asks.
    let reloads = strict || kind != Kind::Fallback;
    let result = runner.run(&ops(kind != Kind::Memory, reloads, size.most), |ops| {
        let n = case.fetch_add(1, Ordering::Relaxed);
        let mut rt = tokio::runtime::Builder::new_current_thread();
        rt.enable_all();
        if kind.virtual_time() {
            rt.start_paused(true);
        }
        let rt = rt.build().expect("a runtime");
        rt.block_on(run(kind, strict, ops, n, server.clone()))
            .map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{test} failed with seed {seed} (PROPTEST_RNG_SEED={seed}): {e}");
    }
}

const VIRTUAL: Size = Size {
    cases: 128,
    most: 40,
    shrink: 4096,
};

#[test]
fn the_memory_store_keeps_the_contract() {
    model("memory", Kind::Memory, false, VIRTUAL, None);
}

#[test]
fn the_local_fallback_keeps_the_contract_across_store_failures() {
    model("fallback", Kind::Fallback, false, VIRTUAL, None);
}

#[test]
fn a_redis_store_keeps_the_contract_across_restarts() {
    let server = Arc::new(Mutex::new(Some(common::redis::RedisServer::start())));
    let size = Size {
        cases: 4,
        most: 14,
        shrink: 8,
    };
    model("redis", Kind::Redis, false, size, Some(server));
}

/// The contract without the known gaps (see `check`): fails until they are closed.
#[test]
#[ignore = "known gaps: one request over the bound after a rise, fallback survivors"]
fn the_memory_store_keeps_the_strict_contract() {
    model("memory strict", Kind::Memory, true, VIRTUAL, None);
}

#[test]
#[ignore = "known gaps: one request over the bound after a rise, fallback survivors"]
fn the_local_fallback_keeps_the_strict_contract() {
    model("fallback strict", Kind::Fallback, true, VIRTUAL, None);
}
