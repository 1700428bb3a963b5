//! Concurrency leases (`max_in_flight`) against a real redis-server and a real sluice
//! process: a leased call left without an answer, leases of different `lease_ttl`s,
//! and a lane sender that stops reading.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice::config::{Backend, OnError, Policy, StoreConfig};
use sluice::limiter::redis::RedisStore;
use sluice::limiter::{Ask, BucketStore, LeaseAsk, Leased, Limiter, Outcome, Place, StoreStats};

fn cfg(url: String, timeout: Duration) -> StoreConfig {
    StoreConfig {
        backend: Backend::Redis,
        urls: vec![url],
        key_prefix: "sluice:".into(),
        timeout,
        on_error: OnError::Deny,
        ..StoreConfig::default()
    }
}

fn policy(max: u32, ttl: Duration, max_wait: Duration) -> Policy {
    Policy {
        rate: 1000.0,
        burst: 1000.0,
        max_wait,
        max_in_flight: Some(max),
        lease_ttl: ttl,
        ..Policy::default()
    }
}

fn place() -> Place<'static> {
    Place {
        class: 1,
        sender: None,
    }
}

fn card(redis: &common::redis::RedisServer, key: &str) -> u64 {
    redis
        .cli(&["ZCARD", key])
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0)
}

/// A leased acquire whose reply comes after `store.timeout` (Redis held up: a fork, a
/// slow command, a pause) is refused `store_unavailable`, but the script still runs in
/// Redis and added a lease nobody held, renewed or released: the endpoint's slot was
/// taken for `lease_ttl` with nothing in flight, and with `max_in_flight = 1` every
/// request in that time was refused `concurrency_limited`. The unanswered lease is
/// now released.
#[tokio::test(flavor = "current_thread")]
async fn a_timed_out_leased_acquire_leaves_no_ghost_lease() {
    let redis = common::redis::RedisServer::start();
    let store: Arc<dyn BucketStore> = Arc::new(
        RedisStore::connect(
            &cfg(redis.url(), Duration::from_millis(100)),
            StoreStats::default(),
        )
        .await
        .unwrap(),
    );
    let limiter = Limiter::new(Arc::clone(&store));
    let p = policy(1, Duration::from_secs(5), Duration::from_secs(1));
    let ep: Arc<str> = "ghost".into();
    // This thread's connection to Redis is open (one per thread).
    let warm: Arc<str> = "warm".into();
    drop(limiter.admit_queued(&warm, &p, place()).await.unwrap());
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Redis held up for 400 ms: the call below times out at 100 ms, Redis runs it later.
    redis.cli(&["CLIENT", "PAUSE", "400", "ALL"]).unwrap();
    let first = limiter.admit_queued(&ep, &p, place()).await;
    assert!(
        first.is_err(),
        "the first request was refused (store timeout)"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    let key = "sluice:{ghost}:leases";
    let ghosts = card(&redis, key);
    eprintln!("leases in Redis with nothing in flight: {ghosts}");
    // Nothing is in flight now: the next request must get the slot.
    let started = Instant::now();
    let second = limiter.admit_queued(&ep, &p, place()).await;
    assert!(
        second.is_ok(),
        "a request with nothing in flight was refused after {:?}: {:?} (leases in Redis: {ghosts})",
        started.elapsed(),
        second.err()
    );
}

/// Replicas (or one replica across a reload) with different `lease_ttl`: each leased
/// acquire or renewal set the whole lease set's PEXPIRE to its own ttl + 1 s, so a
/// short ttl cut the life of the leases taken with a long one. Their requests are still
/// in flight and renewing every ttl/3 of the long ttl; once the key expires the slot is
/// free for another request: more than `max_in_flight` at the receiver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_lease_ttl_does_not_expire_a_long_lease_still_held() {
    let redis = common::redis::RedisServer::start();
    let c = cfg(redis.url(), Duration::from_millis(500));
    let a = RedisStore::connect(&c, StoreStats::default())
        .await
        .unwrap();
    let b = RedisStore::connect(&c, StoreStats::default())
        .await
        .unwrap();
    let p = policy(2, Duration::from_secs(30), Duration::ZERO);
    let ask = Ask::new(&p, 0.0, None);
    let long = LeaseAsk {
        id: 1,
        max: 2,
        ttl_us: 30e6,
    };
    let short = LeaseAsk {
        id: 1,
        max: 2,
        ttl_us: 1e6,
    };
    // Replica A (lease_ttl 30 s) holds a slot; replica B (lease_ttl 1 s, after a
    // reload or in a rolling deploy) runs a quick request.
    let got = a.acquire_leased("mixed", ask, long).await.unwrap();
    assert!(
        matches!(got, Leased::Took(Outcome::Granted { .. })),
        "{got:?}"
    );
    let got = b.acquire_leased("mixed", ask, short).await.unwrap();
    assert!(
        matches!(got, Leased::Took(Outcome::Granted { .. })),
        "{got:?}"
    );
    b.release_lease("mixed", ask, short.id).await.unwrap();
    // A's lease is good for 30 s (its next renewal is due at 10 s).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let key = "sluice:{mixed}:leases";
    assert_eq!(
        card(&redis, key),
        1,
        "replica A's 30 s lease, taken 2.5 s ago and still in flight, is gone from Redis"
    );
}

/// The lane (sluice's own HTTP/1.1 engine, on by default): a sender that stops reading
/// a response mid-body while the receiver is still at work. At `idle_timeout` the lane's
/// connection future is dropped, and with it the request's slot was released at once
/// (and its upstream connection closed); the receiver is still working on the request (here: it
/// pauses 3 s mid-body before sending the rest), and the next request was admitted on
/// top of it. On hyper's path the same body is taken from the stalled sender and
/// drained holding the slot (slot.rs `watch_stall`), as SPEC.md's "Concurrency" says:
/// the slot follows the receiver, not the sender.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_sender_that_stops_reading_does_not_free_the_slot_while_the_receiver_works() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const BIG: usize = 16 << 20;
    let now = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = l.local_addr().unwrap();
    let (n, pk) = (Arc::clone(&now), Arc::clone(&peak));
    let server = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let (n, pk) = (Arc::clone(&n), Arc::clone(&pk));
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut b = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut b).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => head.extend_from_slice(&b[..k]),
                    }
                }
                let c = n.fetch_add(1, Ordering::SeqCst) + 1;
                pk.fetch_max(c, Ordering::SeqCst);
                let slow = head.windows(5).any(|w| w == b"/slow");
                let body = if slow { 2 * BIG } else { 2 };
                let _ = s
                    .write_all(
                        format!("HTTP/1.1 200 OK\r\ncontent-length: {body}\r\n\r\n").as_bytes(),
                    )
                    .await;
                if slow {
                    // Half the body, then 3 s of work, then the rest.
                    let chunk = vec![b'x'; 1 << 16];
                    let mut sent = 0;
                    let half = async {
                        while sent < BIG {
                            if s.write_all(&chunk).await.is_err() {
                                break;
                            }
                            sent += chunk.len();
                        }
                    };
                    let _ = tokio::time::timeout(Duration::from_secs(3), half).await;
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    n.fetch_sub(1, Ordering::SeqCst);
                    let _ = s.write_all(&vec![b'x'; 2 * BIG - sent]).await;
                } else {
                    n.fetch_sub(1, Ordering::SeqCst);
                    let _ = s.write_all(b"ok").await;
                }
            });
        }
    });
    let s = common::sluice(
        "[proxy]\nidle_timeout = \"1s\"\n[defaults]\nrate = 1000.0\nburst = 1000.0\nmax_wait = \"10s\"\nmax_in_flight = 1\n",
    )
    .await;
    let mut stalled = tokio::net::TcpStream::connect(s.proxy_addr).await.unwrap();
    stalled
        .write_all(
            format!(
                "GET http://{up}/slow HTTP/1.1\r\nHost: {up}\r\nx-endpoint-id: lane-idle\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let mut b = [0u8; 1024];
    let k = stalled.read(&mut b).await.unwrap();
    assert!(
        b[..k].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&b[..k])
    );
    // The sender reads nothing more (its connection stays open).
    let next = common::client(s.proxy_addr)
        .get(format!("http://{up}/next"))
        .header("x-endpoint-id", "lane-idle")
        .send()
        .await
        .unwrap();
    assert_eq!(next.status(), 200);
    drop(stalled);
    server.abort();
    assert_eq!(
        peak.load(Ordering::SeqCst),
        1,
        "two requests at the receiver at once where max_in_flight = 1"
    );
    s.stop().await;
}

/// Redis stalls (SIGSTOP) for longer than `lease_ttl` while requests hold and ask for
/// all `max_in_flight = 3` slots (`on_error = "local"`). Each leased call the queue's
/// head sent as a probe during the stall timed out, and the local store answered
/// "busy"; Redis runs those calls when it resumes and adds their leases, which nobody
/// holds, renews or releases. They are released when Redis answers again, before it
/// decides anything else for this replica: within `lease_ttl` of the stall's end the
/// receiver has its three requests in flight again (12/s with each held 250 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_left_unanswered_in_a_redis_stall_hold_no_slot_after_it() {
    use std::sync::atomic::{AtomicBool, Ordering};
    const HOLD: Duration = Duration::from_millis(250);
    const STALL: Duration = Duration::from_secs(5);
    const TTL: Duration = Duration::from_secs(4);
    let redis = common::redis::RedisServer::start();
    let s = common::sluice(&format!(
        "[store]\nbackend = \"redis\"\nurls = [\"{}\"]\ntimeout = \"100ms\"\non_error = \"local\"\n\
         [defaults]\nrate = 100.0\nburst = 10.0\nmax_wait = \"60s\"\nmax_in_flight = 3\n\
         lease_ttl = \"{}s\"\n",
        redis.url(),
        TTL.as_secs()
    ))
    .await;
    let up = common::Upstream::with(Arc::new(|_: &common::Arrival| {
        common::Reply::ok().delay(HOLD)
    }))
    .await;
    let stop = Arc::new(AtomicBool::new(false));
    let senders: Vec<_> = (0..8)
        .map(|i| {
            let (c, url, stop) = (
                common::client(s.proxy_addr),
                up.url(&format!("/stall/{i}")),
                Arc::clone(&stop),
            );
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let r = c.get(&url).header("x-endpoint-id", "stall").send().await;
                    assert_eq!(r.unwrap().status(), 200);
                }
            })
        })
        .collect();
    common::wait_for("arrivals on Redis", Duration::from_secs(10), || {
        std::future::ready(up.count() >= 12)
    })
    .await;
    redis.stop();
    let state = |want: &'static str| {
        let admin = s.admin_addr;
        move || async move { common::readyz(admin).await["store"] == want }
    };
    common::wait_for(
        "the store degraded",
        Duration::from_secs(5),
        state("degraded"),
    )
    .await;
    // The stall is the fault under test: it outlasts lease_ttl.
    tokio::time::sleep(STALL).await;
    redis.cont();
    common::wait_for("the store back", Duration::from_secs(5), state("ok")).await;
    let back = tokio::time::Instant::now();
    let (from, to) = (
        back + Duration::from_millis(500),
        back + TTL - Duration::from_millis(500),
    );
    tokio::time::sleep_until(to).await;
    let served = up
        .arrivals()
        .iter()
        .filter(|a| a.at >= from && a.at < to)
        .count();
    let per_s = served as f64 / (to - from).as_secs_f64();
    let leases = card(&redis, "sluice:{stall}:leases");
    eprintln!("after the stall: {per_s:.1} requests/s at the receiver; leases in Redis: {leases}");
    stop.store(true, Ordering::SeqCst);
    for t in senders {
        t.await.unwrap();
    }
    // Three slots, each turning over every HOLD plus the hand-over: 12/s at most.
    let full = 3.0 / HOLD.as_secs_f64();
    assert!(
        per_s >= 0.8 * full,
        "{per_s:.1} requests/s after the stall where 3 slots give {full:.0}/s: slots held by leases nobody owns"
    );
    s.stop().await;
}
