//! `store.prefetch`: replicas that take tokens ahead on a busy endpoint still keep every
//! window within `rate × W + burst`, give back what they did not spend, and spare Redis
//! most of its script calls while the endpoint is far from its limit.
//!
//! Real Redis servers on free ports, real time; bounds come from the contract, widened
//! only by the longest store call the test itself measured (a grant is decided somewhere
//! inside its call).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice::config::{Backend, Config, OnError, Policy, Prefetch, StoreConfig};
use sluice::limiter::fallback::Resilient;
use sluice::limiter::peers::{HEARTBEAT_TTL, Peers};
use sluice::limiter::redis::RedisStore;
use sluice::limiter::{Ask, BucketStore, Outcome, StoreHealth, StoreStats};
use tokio::time::Instant;

fn config(url: String, prefetch: Prefetch) -> StoreConfig {
    StoreConfig {
        backend: Backend::Redis,
        urls: vec![url],
        timeout: Duration::from_millis(500),
        on_error: OnError::Deny,
        prefetch,
        ..StoreConfig::default()
    }
}

async fn store(server: &common::redis::RedisServer, prefetch: Prefetch) -> Arc<RedisStore> {
    Arc::new(
        RedisStore::connect(&config(server.url(), prefetch), StoreStats::default())
            .await
            .unwrap(),
    )
}

fn policy(rate: f64, burst: f64) -> Policy {
    Policy {
        rate,
        burst,
        adaptive: Config::parse("").unwrap().defaults.adaptive,
        ..Policy::default()
    }
}

/// Two replicas, sixteen busy senders each, on one endpoint: first far from the limit
/// (tokens taken ahead), then saturated. Every window of start times holds at most
/// `rate × (W + longest call) + burst`, and the whole run at most `rate × T + burst`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_taking_tokens_ahead_never_exceed_rate_and_burst() {
    let server = common::redis::RedisServer::start();
    let replicas = [
        store(&server, Prefetch::On).await,
        store(&server, Prefetch::On).await,
    ];
    let (rate, burst) = (400.0, 100.0);
    let ask = Ask::new(&policy(rate, burst), 50_000.0, None);
    let starts = Arc::new(Mutex::new(Vec::new()));
    let longest = Arc::new(Mutex::new(Duration::ZERO));
    let t0 = Instant::now();
    let run = Duration::from_millis(1500);
    let mut tasks = Vec::new();
    for r in &replicas {
        for _ in 0..16 {
            let (store, starts, longest) = (Arc::clone(r), starts.clone(), longest.clone());
            tasks.push(tokio::spawn(async move {
                // Bounded: at most 2 000 asks per sender, and the run's end.
                for _ in 0..2_000 {
                    if t0.elapsed() >= run {
                        break;
                    }
                    let asked = Instant::now();
                    let outcome = store.acquire("ahead", ask).await.unwrap();
                    let answered = Instant::now();
                    {
                        let mut l = longest.lock().unwrap();
                        *l = (*l).max(answered - asked);
                    }
                    match outcome {
                        Outcome::Granted { wait_us, .. } => {
                            let start = answered + Duration::from_secs_f64(wait_us / 1e6);
                            starts.lock().unwrap().push(start);
                            tokio::time::sleep_until(start).await;
                        }
                        Outcome::Refused { retry_us, .. } => {
                            tokio::time::sleep(Duration::from_secs_f64(retry_us / 1e6)).await;
                        }
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut starts = starts.lock().unwrap().clone();
    starts.sort();
    let lag = longest.lock().unwrap().as_secs_f64();
    let span = starts.last().unwrap().duration_since(t0).as_secs_f64();
    let n = starts.len() as f64;
    println!(
        "{n} starts over {span:.3} s; longest store call {:.1} ms",
        lag * 1e3
    );
    // The whole run: everything the bucket had and made, and no more.
    assert!(
        n <= rate * (span + lag) + burst,
        "{n} starts in {span:.3} s: more than rate × T + burst"
    );
    // Utilization: a saturated endpoint gets what the rate gives (half of it at least,
    // whatever the machine's load: the bound that matters is the upper one).
    assert!(
        n >= burst + rate * span * 0.5,
        "only {n} starts in {span:.3} s"
    );
    for w_ms in [50u64, 200, 500] {
        let w = Duration::from_millis(w_ms);
        let most = rate * (w.as_secs_f64() + lag) + burst;
        let mut j = 0;
        for i in 0..starts.len() {
            while starts[j] + w < starts[i] {
                j += 1;
            }
            let inside = (i - j + 1) as f64;
            assert!(
                inside <= most,
                "{inside} starts within {w_ms} ms (at most {most:.1})"
            );
        }
    }
}

/// Tokens taken ahead and never spent go back into the bucket at their end: a burst
/// that stops loses nothing, and while Redis counts them as held they are never in
/// neither the bucket nor the hold (the bucket's view checked back to back until they
/// are back). The replica gives them back from a timer 5 ms after it asked; the script
/// counts them held for 10 ms. A timer later than that on a loaded machine leaves them
/// in neither until it fires: fewer tokens for a moment, never more. (So the test does
/// not assert the first view within those 5 ms, nor the hold through a late timer:
/// under CI-like load either fails some runs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unspent_tokens_held_ahead_come_back() {
    let server = common::redis::RedisServer::start();
    let s = store(&server, Prefetch::On).await;
    // 1 token/s: refill during the test is a few tokens at most.
    let p = policy(1.0, 1_000.0);
    let ask = Ask::new(&p, 0.0, None);
    let monitor = server.monitor();
    let t0 = Instant::now();
    let n = 40;
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let s = Arc::clone(&s);
            tokio::spawn(async move { s.acquire("back", ask).await.unwrap() })
        })
        .collect();
    for t in tasks {
        assert!(matches!(t.await.unwrap(), Outcome::Granted { .. }));
    }
    let expected = 1_000.0 - f64::from(n);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let view = s.view("back", ask, None).await.unwrap().unwrap();
        let left = view.tokens;
        let refill = t0.elapsed().as_secs_f64();
        assert!(
            left <= expected + refill + 1e-6,
            "{left} tokens: more than given"
        );
        // The script began the hold after t0, so it lasts at least until then.
        if t0.elapsed() < Duration::from_millis(10) {
            assert!(
                left + view.held_ahead >= expected - 1e-6,
                "{left} tokens + {} held ahead: some are in neither",
                view.held_ahead
            );
        }
        if left >= expected - 1e-6 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{left} tokens, expected {expected}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Tokens were taken ahead, and it is those that came back.
    let back = common::redis::given_back_ahead(&server.monitor_log(monitor));
    assert!(back >= 1, "{n} concurrent acquires took nothing ahead");
}

/// How many of `n` = 32 × 100 concurrent acquires of a busy endpoint far from its limit
/// `store` left to Redis to decide (the rest it granted from tokens held ahead).
async fn decided_by_redis(
    server: &common::redis::RedisServer,
    s: &Arc<RedisStore>,
    endpoint: &str,
) -> usize {
    let ask = Ask::new(&policy(1e6, 1e6), 0.0, None);
    // Load the script first (a cold Redis answers NOSCRIPT to concurrent calls).
    s.acquire("warm", ask).await.unwrap();
    let before = common::redis::evalsha_calls(server);
    let monitor = server.monitor();
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (s, e) = (Arc::clone(s), endpoint.to_owned());
            tokio::spawn(async move {
                for _ in 0..100 {
                    let o = s.acquire(&e, ask).await.unwrap();
                    assert!(matches!(o, Outcome::Granted { wait_us: 0.0, .. }));
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let calls = common::redis::evalsha_calls(server) - before;
    let (reserved, confirmed, _) = common::redis::acquires(&server.monitor_log(monitor));
    let asks = reserved + confirmed;
    println!("{endpoint}: {calls} script calls, {asks} asks decided by Redis");
    asks
}

/// A busy endpoint far from its limit: with prefetch, part of the acquires are answered
/// from tokens held ahead and never reach Redis; without, every one does. (How many
/// calls that spares depends on the machine's load against the 5 ms lifetime: about
/// fourfold on a quiet machine, docs/BENCHMARKS.md; not asserted here.)
/// The default, `"alone"`, takes tokens ahead only while this replica is the one live
/// replica in the heartbeat set: never before it registered, and no more once another did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_spares_script_calls_far_from_the_limit() {
    let server = common::redis::RedisServer::start();
    let n = 32 * 100;
    let off = store(&server, Prefetch::Off).await;
    assert_eq!(
        decided_by_redis(&server, &off, "off").await,
        n,
        "without prefetch Redis decides every acquire"
    );
    let on = store(&server, Prefetch::On).await;
    assert!(
        decided_by_redis(&server, &on, "on").await < n,
        "with prefetch no acquire was answered from tokens held ahead"
    );
    let alone = store(&server, StoreConfig::default().prefetch).await;
    assert_eq!(
        decided_by_redis(&server, &alone, "unregistered").await,
        n,
        "a replica not (yet) in the heartbeat set took tokens ahead"
    );
    assert_eq!(alone.heartbeat(HEARTBEAT_TTL).await.unwrap(), 1);
    assert!(
        decided_by_redis(&server, &alone, "alone").await < n,
        "a replica alone in the store took no token ahead"
    );
    let other = store(&server, Prefetch::Off).await;
    assert_eq!(other.heartbeat(HEARTBEAT_TTL).await.unwrap(), 2);
    assert_eq!(
        decided_by_redis(&server, &alone, "shared").await,
        n,
        "a replica took tokens ahead while another was alive"
    );
}

/// A replica that starts while another is alone in the store and busy serves only once
/// the tokens the other took ahead before seeing it can no longer be spent: its start-up
/// ping (what `sluice run` does before it serves) registers it, then waits them out
/// (10 ms). The busy replica's acquires right after it are all decided by Redis (counted
/// in a MONITOR log from the new replica's registration on); before that wait, tokens
/// taken ahead just before were still spent after the new replica could serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_replica_serves_once_tokens_taken_ahead_before_it_have_ended() {
    let server = common::redis::RedisServer::start();
    let a = store(&server, Prefetch::Alone).await;
    let b_store = RedisStore::connect(
        &config(server.url(), Prefetch::Alone),
        StoreStats::default(),
    )
    .await
    .unwrap();
    let b_id = b_store.replica().to_owned();
    let peers = Arc::new(Peers::new(1));
    let b = Resilient::new(
        Arc::new(b_store),
        OnError::Deny,
        StoreStats::default(),
        Arc::clone(&peers),
    );
    assert_eq!(a.heartbeat(HEARTBEAT_TTL).await.unwrap(), 1);
    let ask = Ask::new(&policy(1e6, 1e6), 0.0, None);
    // Load the script first (a cold Redis answers NOSCRIPT to concurrent calls).
    a.acquire("warm", ask).await.unwrap();
    let burst = || {
        let tasks: Vec<_> = (0..32)
            .map(|_| {
                let a = Arc::clone(&a);
                tokio::spawn(async move {
                    for _ in 0..100 {
                        a.acquire("busy", ask).await.unwrap();
                    }
                })
            })
            .collect();
        async move {
            for t in tasks {
                t.await.unwrap();
            }
        }
    };
    let monitor = server.monitor();
    burst().await;
    b.ping().await.unwrap();
    assert_eq!(peers.count(), 2);
    burst().await;
    let log = server.monitor_log(monitor);
    let at = log
        .find(&b_id)
        .expect("the new replica's registration in the MONITOR log");
    let (before, after) = log.split_at(at);
    let decided = |part: &str| {
        let (reserved, confirmed, _) = common::redis::acquires(part);
        reserved + confirmed
    };
    let n = 32 * 100;
    println!(
        "asks decided by Redis: {} of {n} alone, {} of {n} after the new replica joined",
        decided(before),
        decided(after)
    );
    assert!(
        decided(before) < n,
        "a replica alone in the store took no token ahead"
    );
    assert_eq!(
        decided(after),
        n,
        "tokens taken ahead before the new replica registered were spent after it could serve"
    );
}

/// A replica whose heartbeat lapsed during an outage registers again before Redis decides
/// anything for it. Until then, a replica that found itself alone in the store meanwhile
/// would go on taking tokens ahead (`"alone"`) that the returning one cannot reach, for up
/// to a heartbeat interval. Replica B loses the store (its Redis user is denied every
/// command), its heartbeat lapses, and A counts itself alone; once B's requests are
/// decided by Redis again, A takes no token ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_back_from_an_outage_registers_before_redis_decides_for_it() {
    let server = common::redis::RedisServer::start();
    server
        .cli(&[
            "ACL",
            "SETUSER",
            "bee",
            "on",
            ">bee-pass",
            "~*",
            "&*",
            "+@all",
        ])
        .expect("ACL SETUSER");
    let a = store(&server, Prefetch::Alone).await;
    assert_eq!(a.heartbeat(HEARTBEAT_TTL).await.unwrap(), 1);
    let b_store = RedisStore::connect(
        &StoreConfig {
            on_error: OnError::Local,
            ..config(
                format!("redis://bee:bee-pass@127.0.0.1:{}/", server.port()),
                Prefetch::Alone,
            )
        },
        StoreStats::default(),
    )
    .await
    .unwrap();
    // Registered before it serves, as `sluice run` does.
    assert_eq!(b_store.heartbeat(HEARTBEAT_TTL).await.unwrap(), 2);
    let b = Resilient::new(
        Arc::new(b_store),
        OnError::Local,
        StoreStats::default(),
        Arc::new(Peers::new(1)),
    );
    let ask = Ask::new(&policy(1e6, 1e6), 0.0, None);
    b.acquire("b", ask).await.unwrap();
    assert_eq!(b.health(), StoreHealth::Ok);

    // Twice: back through a request's probe, then through `/readyz`'s ping.
    for (round, via) in ["a request", "the readiness probe"].into_iter().enumerate() {
        // B loses the store: it decides locally, and its heartbeat lapses.
        server
            .cli(&["ACL", "SETUSER", "bee", "-@all"])
            .expect("ACL SETUSER");
        common::wait_for("B to lose the store", Duration::from_secs(5), || async {
            b.acquire("b", ask).await.unwrap();
            b.health() == StoreHealth::Degraded
        })
        .await;
        common::wait_for(
            "B's heartbeat to lapse",
            HEARTBEAT_TTL + Duration::from_secs(5),
            || async { a.heartbeat(HEARTBEAT_TTL).await.unwrap() == 1 },
        )
        .await;

        // The store answers B again, and B goes back to the shared buckets.
        server
            .cli(&["ACL", "SETUSER", "bee", "+@all"])
            .expect("ACL SETUSER");
        common::wait_for(
            &format!("B back through {via}"),
            Duration::from_secs(5),
            || async {
                if round == 0 {
                    b.acquire("b", ask).await.unwrap();
                } else {
                    let _ = b.ping().await;
                }
                b.health() == StoreHealth::Ok
            },
        )
        .await;
        assert_eq!(
            decided_by_redis(&server, &a, &format!("b-returned-{round}")).await,
            32 * 100,
            "back through {via}: a replica took tokens ahead while another decided \
             through the same store"
        );
    }
}

/// An endpoint that answered 429 spends no token it held ahead: the feedback drops them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_endpoint_spends_no_token_held_ahead() {
    let server = common::redis::RedisServer::start();
    let s = store(&server, Prefetch::On).await;
    let p = policy(1.0, 1_000.0);
    let ask = Ask::new(&p, 0.0, None);
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let s = Arc::clone(&s);
            tokio::spawn(async move { s.acquire("429", ask).await.unwrap() })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let adaptive = p.adaptive.expect("adaptive by default");
    s.feedback("429", ask, adaptive, Duration::from_secs(2), true)
        .await
        .unwrap();
    match s.acquire("429", ask).await.unwrap() {
        Outcome::Refused { cooldown, .. } => assert!(cooldown),
        o => panic!("a token held ahead was spent during the cooldown: {o:?}"),
    }
}

/// While replicas hold tokens ahead, the bucket refills only up to the burst minus what
/// they hold; once their time is over, up to the burst again. The state is written
/// straight into Redis, on its own clock, so the check does not depend on timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bucket_and_the_tokens_held_ahead_never_exceed_the_burst() {
    let server = common::redis::RedisServer::start();
    let s = store(&server, Prefetch::On).await;
    let p = policy(1_000.0, 100.0);
    let ask = Ask::new(&p, 0.0, None);
    // Redis' clock in the scripts' unit: µs since 2023-11-14 (lua/bucket.lua).
    let now_us = || {
        let t = server.cli(&["TIME"]).unwrap();
        let mut parts = t.lines().map(|l| l.trim().parse::<f64>().unwrap());
        let (secs, micros) = (parts.next().unwrap(), parts.next().unwrap());
        (secs - 1_700_000_000.0) * 1e6 + micros
    };
    let set = |held_until: f64| {
        let now = now_us();
        // 50 tokens a second ago at 1 000/s: a full refill is due; 40 held ahead.
        let fields = [
            ("tk", 50.0),
            ("ts", now - 1e6),
            ("dr", 0.0),
            ("da", 0.0),
            ("du", 0.0),
            ("cu", 0.0),
            ("g", 0.0),
            ("th", 0.0),
            ("fs", 0.0),
            ("cr", 40.0),
            ("ce", held_until),
        ];
        let mut args = vec!["HSET".to_owned(), "sluice:{held}".to_owned()];
        for (k, v) in fields {
            args.push(k.to_owned());
            args.push(format!("{v}"));
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        server.cli(&args).unwrap();
        now
    };
    let tokens = || async { s.view("held", ask, None).await.unwrap().unwrap().tokens };
    let held = || async { s.view("held", ask, None).await.unwrap().unwrap().held_ahead };
    let now = set(0.0);
    set(now + 60e6);
    assert_eq!(tokens().await, 60.0, "refilled past burst − held ahead");
    assert_eq!(held().await, 40.0, "operators see what is held ahead");
    // Their time over: the cap is the burst again.
    set(now_us() - 1.0);
    assert_eq!(tokens().await, 100.0);
    assert_eq!(held().await, 0.0);
}

/// Guarantee 4 across replicas with tokens held ahead: once a replica has heard another
/// replica's cooldown notice, it spends none of the tokens it took ahead before it. (Held
/// tokens live 5 ms: a round that took longer than that from taking them to the check
/// would be refused anyway, so each round also reports whether it was quick enough to
/// tell; on a quiet machine nearly all are.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cooldown_heard_from_another_replica_stops_tokens_held_ahead() {
    let server = common::redis::RedisServer::start();
    let stats = StoreStats::default();
    let heard = stats.notices.clone();
    let holder = Arc::new(
        RedisStore::connect(&config(server.url(), Prefetch::On), stats)
            .await
            .unwrap(),
    );
    let other = store(&server, Prefetch::Off).await;
    let p = policy(1.0, 1_000.0);
    let ask = Ask::new(&p, 0.0, None);
    let adaptive = p.adaptive.expect("adaptive by default");
    let wait_heard = |n: u64| {
        let heard = heard.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            let spin_until = Instant::now() + Duration::from_millis(2);
            while heard.get() < n {
                assert!(Instant::now() < deadline, "notice {n} never heard");
                // Briefly by turns (a notice usually arrives within a millisecond),
                // then by short sleeps.
                if Instant::now() < spin_until {
                    tokio::task::yield_now().await;
                } else {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    };
    // The holder's subscription is up once it hears a first notice. A notice published
    // before it subscribed is lost, so the probe is repeated until one is heard.
    let deadline = Instant::now() + Duration::from_secs(10);
    while heard.get() == 0 {
        assert!(Instant::now() < deadline, "no cooldown notice ever heard");
        other
            .feedback("probe", ask, adaptive, Duration::from_secs(1), true)
            .await
            .unwrap();
        let asked = Instant::now();
        while heard.get() == 0 && asked.elapsed() < Duration::from_millis(500) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let (mut rounds, mut quick) = (0, 0);
    let t0 = Instant::now();
    // Bounded: 30 rounds, 10 s.
    while rounds < 30 && t0.elapsed() < Duration::from_secs(10) {
        let endpoint = format!("cool-{rounds}");
        rounds += 1;
        let taking = Instant::now();
        let tasks: Vec<_> = (0..20)
            .map(|_| {
                let (s, e) = (Arc::clone(&holder), endpoint.clone());
                tokio::spawn(async move { s.acquire(&e, ask).await.unwrap() })
            })
            .collect();
        for t in tasks {
            assert!(matches!(t.await.unwrap(), Outcome::Granted { .. }));
        }
        let before = heard.get();
        other
            .feedback(&endpoint, ask, adaptive, Duration::from_secs(2), true)
            .await
            .unwrap();
        wait_heard(before + 1).await;
        match holder.acquire(&endpoint, ask).await.unwrap() {
            Outcome::Refused { cooldown, .. } => assert!(cooldown),
            o => panic!("round {rounds}: a token held ahead was spent after the notice: {o:?}"),
        }
        if taking.elapsed() < Duration::from_millis(5) {
            quick += 1;
        }
    }
    println!("{rounds} rounds, {quick} quick enough for held tokens to be still live");
}

/// Why `store.prefetch` is not on whatever the replicas: with the configuration's
/// defaults, a burst that fits the endpoint's burst passes at once even when split across
/// replicas and nothing may wait (`max_wait = 0`). The default, `"alone"`, takes no token
/// ahead while another replica is alive. With `prefetch = true`, tokens one replica took
/// ahead are out of the other's reach until spent or given back, so part of the same
/// demand can be refused (printed, not asserted: it depends on the first replica's calls
/// forming a batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_burst_split_across_replicas_passes_at_once() {
    let server = common::redis::RedisServer::start();
    let text = format!(
        "[store]\nbackend = \"redis\"\nurls = [\"{}\"]\n",
        server.url()
    );
    let defaults = Config::parse(&text).unwrap().store;
    assert_eq!(defaults.prefetch, Prefetch::Alone);
    let burst = 20.0;
    // 1 token a second: no refill worth counting during the test.
    let ask = Ask::new(&policy(1.0, burst), 0.0, None);
    for (round, prefetch) in [(0, Prefetch::Alone), (1, Prefetch::On)] {
        let cfg = StoreConfig {
            prefetch,
            ..defaults.clone()
        };
        // Each registered, as `sluice run` does before it serves.
        let connect = || async {
            let s = RedisStore::connect(&cfg, StoreStats::default())
                .await
                .unwrap();
            s.heartbeat(HEARTBEAT_TTL).await.unwrap();
            Arc::new(s)
        };
        let (a, b) = (connect().await, connect().await);
        let endpoint = format!("split-{round}");
        let burst_of = |s: &Arc<RedisStore>, n: usize| {
            let tasks: Vec<_> = (0..n)
                .map(|_| {
                    let (s, e) = (Arc::clone(s), endpoint.clone());
                    tokio::spawn(async move { s.acquire(&e, ask).await.unwrap() })
                })
                .collect();
            async move {
                let mut granted = 0;
                for t in tasks {
                    if matches!(t.await.unwrap(), Outcome::Granted { .. }) {
                        granted += 1;
                    }
                }
                granted
            }
        };
        // Three on one replica (its first call goes alone, the other two as a batch,
        // which may take tokens ahead), then the other seventeen of the burst elsewhere.
        let first = burst_of(&a, 3).await;
        let second = burst_of(&b, 17).await;
        println!("prefetch {prefetch:?}: {first} + {second} of 20 granted at once");
        assert_eq!(first, 3);
        if prefetch == Prefetch::Alone {
            assert_eq!(second, 17, "a burst within the burst was refused");
        }
    }
}

/// A top-up is an `acquire.lua` call with no asks: it takes tokens ahead under the same
/// rule as any call, never below half the burst, and its answer names the generation
/// they belong to.
#[tokio::test]
async fn a_call_with_no_asks_takes_tokens_ahead_down_to_half_the_burst() {
    let server = common::redis::RedisServer::start();
    let mut conn = common::redis::connection(&server).await;
    let script = common::redis::acquire_script();
    // rate 1/s, burst 100: under a token of refill between the calls.
    let mut top_up = async |ahead: u32| -> String {
        common::redis::AcquireArgs {
            rate: 1.0,
            burst: 100.0,
            ahead,
            held_for_us: 10_000,
            known_us: 0,
            seen: 0,
        }
        .call(&script, "t{e}")
        .invoke_async(&mut conn)
        .await
        .unwrap()
    };
    // "<generation> <ahead> <hold> <busy> <writes> <now> <rebuilt> " (no asks): how
    // long the bucket stays busy, its write count and the store's time aside, which
    // change from call to call; nothing was rebuilt.
    let without_busy = |reply: String| -> String {
        let mut words: Vec<&str> = reply.split(' ').collect();
        let busy: f64 = words.remove(3).parse().unwrap();
        let _writes: u64 = words.remove(3).parse().unwrap();
        let _now: f64 = words.remove(3).parse().unwrap();
        assert_eq!(words.remove(3), "0", "nothing rebuilt: {reply}");
        assert!(busy > 0.0, "busy while tokens are held: {reply}");
        words.join(" ")
    };
    let first = without_busy(top_up(20).await);
    let words: Vec<&str> = first.split(' ').collect();
    let (generation, hold) = (words[0], words[2]);
    assert_eq!(
        first,
        format!("{generation} 20 {hold} "),
        "as many as asked"
    );
    assert_ne!(hold, "0", "a hold is named");
    assert_eq!(
        without_busy(top_up(100).await),
        format!("{generation} 30 {hold} "),
        "down to half the burst, in the same hold"
    );
    assert_eq!(
        without_busy(top_up(100).await),
        format!("{generation} 0 0 "),
        "no further"
    );
}

/// A give-back that reaches Redis after its hold ended (a late timer on a busy replica),
/// when a later call has begun another hold, lowers nothing of the later hold's count:
/// the bucket still refills only up to the burst minus the tokens the replica holds
/// now. (Lowering it by the tokens given back would let the bucket refill past that, and
/// bucket plus held tokens exceed the burst by as many: 653 arrivals in a window bounded
/// by 651.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_give_back_lowers_no_later_hold() {
    let server = common::redis::RedisServer::start();
    let s = store(&server, Prefetch::On).await;
    let mut conn = common::redis::connection(&server).await;
    let acquire = common::redis::acquire_script();
    let release = common::redis::release_script();
    // 1 000 tokens/s, burst 100: a full refill within a tenth of a second.
    let (rate, burst) = (1_000.0, 100.0);
    let ask = Ask::new(&policy(rate, burst), 0.0, None);
    let key = "sluice:{late}";
    // Only tokens ahead (no asks), counted as held for `held_us`: "<g> <n> <hold> ".
    let mut take = async |n: u32, held_us: u64| -> (String, u32, String) {
        let reply: String = acquire
            .key(key)
            .arg(rate)
            .arg(burst)
            .arg(0)
            .arg(n)
            .arg(held_us)
            .arg("")
            .arg(0)
            .arg(0)
            .arg(0)
            .invoke_async(&mut conn)
            .await
            .unwrap();
        let words: Vec<&str> = reply.split(' ').collect();
        (
            words[0].to_owned(),
            words[1].parse().unwrap(),
            words[2].to_owned(),
        )
    };
    let (generation, first, first_hold) = take(20, 2_000).await;
    assert_eq!(first, 20);
    // Wait until Redis has ended the first hold (its 2 ms are over on its clock).
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.view("late", ask, None).await.unwrap().unwrap().held_ahead > 0.0 {
        assert!(Instant::now() < deadline, "the first hold never ended");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // A later call: a new hold, for a minute.
    let (_, second, second_hold) = take(10, 60_000_000).await;
    assert_eq!(second, 10);
    assert_ne!(first_hold, second_hold, "a new hold");
    // The first call's 20, never spent, given back late, naming their hold.
    let mut conn = common::redis::connection(&server).await;
    let refunded: redis::Value = release
        .key(key)
        .arg(rate)
        .arg(burst)
        .arg(0)
        .arg(&generation)
        .arg(first)
        .arg(&first_hold)
        .invoke_async(&mut conn)
        .await
        .unwrap();
    // How long the bucket stays busy after the give-back and its write count (-1:
    // nothing given back).
    assert!(
        matches!(refunded, redis::Value::BulkString(_)),
        "unspent tokens go back to the bucket: {refunded:?}"
    );
    // Let the bucket refill as far as it may.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let view = s.view("late", ask, None).await.unwrap().unwrap();
        assert_eq!(view.held_ahead, 10.0, "the second hold's tokens are held");
        assert!(
            view.tokens + view.held_ahead <= burst,
            "{} tokens in the bucket and {} held: over the burst",
            view.tokens,
            view.held_ahead
        );
        if view.tokens >= burst - 10.0 {
            break;
        }
        assert!(Instant::now() < deadline, "{} tokens", view.tokens);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Tokens a replica took ahead may be spent until their hold ends, which can be after
/// the bucket is full again; if what the replica heard of the bucket ended with that, a
/// store that lost its state then would give a fresh burst beside the held tokens. So a
/// replica hears the bucket busy until the hold ends and the held tokens would have
/// refilled. Here (direct script calls, a hold stretched to 10 s so that the moment is
/// not a matter of milliseconds) the failure is a fresh bucket of 20 beside 9 held: 29
/// at once against a burst of 20.
#[tokio::test]
async fn a_lost_bucket_leaves_room_for_the_tokens_held_ahead() {
    let server = common::redis::RedisServer::start();
    let mut conn = common::redis::connection(&server).await;
    let script = common::redis::acquire_script();
    let (rate, burst) = (100.0, 20.0);
    let key = "t{held}";
    // One ask (budget `budget_us`), `ahead` tokens wanted ahead and held for 10 s,
    // and what the replica heard: busy for `known` µs, `seen` writes.
    let mut call = async |ahead: u32, known: u64, seen: u64, budget_us: u64| -> Vec<String> {
        let reply: String = common::redis::AcquireArgs {
            rate,
            burst,
            ahead,
            held_for_us: 10_000_000,
            known_us: known,
            seen,
        }
        .call(&script, key)
        .arg(budget_us)
        .arg("")
        .invoke_async(&mut conn)
        .await
        .unwrap();
        reply.split(' ').map(str::to_owned).collect()
    };
    // "<generation> <ahead> <hold> <busy> <writes> <now> <rebuilt> <ask>"
    let first = call(10, 0, 0, 1_000_000).await;
    let asked = Instant::now();
    let held: f64 = first[1].parse().unwrap();
    assert_eq!(held, 9.0, "down to half the burst: {first:?}");
    let busy: f64 = first[3].parse().unwrap();
    let writes: u64 = first[4].parse().unwrap();
    // The bucket is full again (but for the held tokens) after 0.1 s; the hold lasts.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let known = (busy - asked.elapsed().as_secs_f64() * 1e6).max(0.0) as u64;
    assert_eq!(
        server.cli(&["DEL", key]).as_deref(),
        Some("1"),
        "the store loses the key"
    );
    let after = call(0, known, writes, 0).await;
    let tokens: f64 = server
        .cli(&["HGET", key, "tk"])
        .and_then(|t| t.parse().ok())
        .unwrap();
    let granted = f64::from(after[7].starts_with('G'));
    assert!(
        tokens + granted + held <= burst,
        "{tokens} tokens left and {granted} granted beside {held} held ahead, against a \
         burst of {burst} (answers {first:?}, then {after:?})"
    );
}
