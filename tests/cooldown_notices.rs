//! Cooldown notices over a subscription that dies without a word: when its TCP flow
//! goes silently dead (a NAT, firewall or load balancer dropping the long-idle
//! subscriber flow, a partition, a host gone without a reset) while the command
//! connections keep working, nothing ends the subscription, and if it went on vouching
//! for every waiter a cooldown (even this replica's own 429) would never hold back
//! requests already waiting (guarantee 4). So it is pinged through itself, and vouches
//! for nobody once a ping goes unanswered.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sluice::config::{Adaptive, Backend, OnError, Policy, StoreConfig};
use sluice::limiter::redis::RedisStore;
use sluice::limiter::{Ask, BucketStore, Limiter, StoreStats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A TCP relay to Redis that, once `drop_subscriber` is set, silently swallows what
/// Redis sends on the connection that issued SUBSCRIBE (a flow a middlebox dropped):
/// nothing is closed, nothing arrives.
async fn relay(to: u16, drop_subscriber: Arc<AtomicBool>) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (c, _) = l.accept().await.unwrap();
            let s = TcpStream::connect(("127.0.0.1", to)).await.unwrap();
            let (mut cr, mut cw) = c.into_split();
            let (mut sr, mut sw) = s.into_split();
            let subscriber = Arc::new(AtomicBool::new(false));
            let sub = Arc::clone(&subscriber);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                loop {
                    let n = match cr.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if buf[..n]
                        .windows(9)
                        .any(|w| w.eq_ignore_ascii_case(b"SUBSCRIBE"))
                    {
                        sub.store(true, Ordering::SeqCst);
                    }
                    if sw.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
            let drop_it = Arc::clone(&drop_subscriber);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                loop {
                    let n = match sr.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if subscriber.load(Ordering::SeqCst) && drop_it.load(Ordering::SeqCst) {
                        continue; // lost on the way
                    }
                    if cw.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

#[tokio::test(flavor = "current_thread")]
async fn a_silently_dead_notice_subscription_holds_waiters_back_in_a_cooldown() {
    run(true).await;
}

/// Control: the same with the subscription alive passes (the waiter is refused).
#[tokio::test(flavor = "current_thread")]
async fn control_with_the_subscription_alive() {
    run(false).await;
}

async fn run(kill_flow: bool) {
    let redis = common::redis::RedisServer::start();
    let dead = Arc::new(AtomicBool::new(false));
    let port = relay(redis.port(), Arc::clone(&dead)).await;
    let cfg = StoreConfig {
        backend: Backend::Redis,
        urls: vec![format!("redis://127.0.0.1:{port}/")],
        key_prefix: "sluice:".into(),
        timeout: Duration::from_millis(500),
        on_error: OnError::Deny,
        ..StoreConfig::default()
    };
    let store: Arc<dyn BucketStore> = Arc::new(
        RedisStore::connect(&cfg, StoreStats::default())
            .await
            .unwrap(),
    );
    // Wait for the notice subscription.
    for _ in 0..100 {
        if !store.needs_confirm("x", tokio::time::Instant::now()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !store.needs_confirm("x", tokio::time::Instant::now()),
        "subscribed"
    );

    let limiter = Limiter::new(Arc::clone(&store));
    let policy = Policy {
        rate: 1.0,
        burst: 1.0,
        max_wait: Duration::from_secs(3),
        adaptive: Some(Adaptive::default()),
        ..Policy::default()
    };
    limiter.admit("e", &policy).await.expect("the burst");
    let l2 = limiter.clone();
    let p2 = policy.clone();
    let waiter = tokio::spawn(async move { l2.admit("e", &p2).await });
    tokio::time::sleep(Duration::from_millis(100)).await;

    // The subscriber's flow goes silently dead; command connections are unaffected.
    dead.store(kill_flow, Ordering::SeqCst);
    // The request granted before the cooldown comes back 429, Retry-After: 10.
    store
        .feedback(
            "e",
            Ask::new(&policy, 0.0, None),
            Adaptive::default(),
            Duration::from_secs(10),
            true,
        )
        .await
        .expect("feedback recorded in Redis");
    let cu = redis.cli(&["HGET", "sluice:{e}", "cu"]).unwrap();
    assert!(!cu.is_empty(), "Redis holds the cooldown: cu={cu}");

    let outcome = waiter.await.unwrap();
    // The waiter's reservation was voided by the cooldown, and with 3 s of budget
    // against a 10 s cooldown it is refused `cooldown`, never sent at 1 s, 9 s into a
    // cooldown the receiver asked for.
    assert!(
        outcome.is_err(),
        "a request already waiting left during the cooldown: {outcome:?}"
    );
}

/// `sluice_store_cooldown_notices_total` of the replica at `admin`.
async fn notices_heard(admin: std::net::SocketAddr) -> u64 {
    let m = common::metrics(admin).await;
    m.lines()
        .find_map(|l| l.strip_prefix("sluice_store_cooldown_notices_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Three replicas on one Redis (`on_error = "local"`). Replica A's request comes back
/// 429 with `Retry-After: 5`; replicas B and C hear the cooldown's notice, and then
/// Redis dies. B's requests waiting on shared reservations wake during the cooldown,
/// and C takes new requests with its local bucket: the notice heard before the cut
/// holds both back until the cooldown ends (guarantee 4), although neither replica
/// ever had an answer of the store showing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cooldown_notice_heard_before_a_cut_holds_the_local_bucket() {
    const RETRY_AFTER: Duration = Duration::from_secs(5);
    const ANSWER_AFTER: Duration = Duration::from_millis(500);
    let mut redis = common::redis::RedisServer::start();
    let conf = format!(
        "[store]\nbackend = \"redis\"\nurls = [\"{}\"]\ntimeout = \"100ms\"\non_error = \"local\"\n\
         [defaults]\nrate = 1.0\nburst = 1.0\nmax_wait = \"20s\"\n\
         [defaults.adaptive]\nabsorb = \"off\"\n",
        redis.url()
    );
    let mut rs = Vec::new();
    for _ in 0..3 {
        rs.push(common::sluice(&conf).await);
    }
    common::until_all_count(&rs, 3).await;
    let up = common::Upstream::with(Arc::new(|a: &common::Arrival| {
        if a.path.starts_with("/cool/throttle") {
            common::Reply::status(429)
                .header("retry-after", &RETRY_AFTER.as_secs().to_string())
                .delay(ANSWER_AFTER)
        } else {
            common::Reply::ok()
        }
    }))
    .await;
    let send = |r: &sluice::app::Running, path: &str| {
        let (c, url) = (common::client(r.proxy_addr), up.url(path));
        tokio::spawn(async move {
            let r = c.get(&url).header("x-endpoint-id", "cool").send().await;
            r.map(|r| r.status().as_u16())
        })
    };
    // A's request takes the bucket's one token; its 429 comes 0.5 s later.
    let throttled = send(&rs[0], "/cool/throttle");
    common::wait_for(
        "the request to be throttled",
        Duration::from_secs(5),
        || std::future::ready(up.count() == 1),
    )
    .await;
    let sent_at = up.arrivals()[0].at;
    // Meanwhile B's requests reserve the next tokens, 1, 2 and 3 s on.
    let waiting: Vec<_> = (0..3)
        .map(|i| send(&rs[1], &format!("/cool/b/{i}")))
        .collect();
    assert_eq!(throttled.await.unwrap().unwrap(), 429);
    common::wait_for(
        "B and C to hear the notice",
        Duration::from_secs(5),
        || async {
            notices_heard(rs[1].admin_addr).await >= 1 && notices_heard(rs[2].admin_addr).await >= 1
        },
    )
    .await;
    redis.kill();
    assert!(
        tokio::time::Instant::now() < sent_at + Duration::from_secs(1),
        "Redis died after B's first waiter woke: nothing tested"
    );
    let fresh: Vec<_> = (0..3)
        .map(|i| send(&rs[2], &format!("/cool/c/{i}")))
        .collect();
    // The cooldown runs RETRY_AFTER from the 429, sent ANSWER_AFTER after its arrival.
    let ends = sent_at + ANSWER_AFTER + RETRY_AFTER;
    tokio::time::sleep_until(ends).await;
    let early: Vec<(String, Duration)> = up
        .arrivals()
        .iter()
        .filter(|a| a.at > sent_at && a.at < ends)
        .map(|a| (a.path.clone(), a.at - sent_at))
        .collect();
    eprintln!("arrivals during the cooldown: {}", early.len());
    assert!(
        early.is_empty(),
        "arrived during the cooldown a notice announced before the cut: {early:?}"
    );
    for t in waiting.into_iter().chain(fresh) {
        t.abort();
    }
    for r in rs {
        r.stop().await;
    }
}

/// A Redis user allowed only the channel `<prefix>cooldowns` (as the operations guide's
/// ACL allows) is not allowed the channel the cooldowns' ends are announced on: the
/// feedback still saves the cooldown and announces it on the channel it may use, and
/// waiters still hear it.
#[tokio::test(flavor = "current_thread")]
async fn a_user_allowed_only_the_notice_channel_still_saves_and_hears_cooldowns() {
    let redis = common::redis::RedisServer::start();
    let acl = [
        "ACL",
        "SETUSER",
        "narrow",
        "on",
        ">narrow-pass",
        "~sluice:*",
        "resetchannels",
        "&sluice:cooldowns",
        "+@all",
    ];
    redis.cli(&acl).expect("ACL SETUSER");
    let cfg = StoreConfig {
        backend: Backend::Redis,
        urls: vec![format!(
            "redis://narrow:narrow-pass@127.0.0.1:{}/",
            redis.port()
        )],
        key_prefix: "sluice:".into(),
        timeout: Duration::from_millis(500),
        on_error: OnError::Deny,
        ..StoreConfig::default()
    };
    let store = RedisStore::connect(&cfg, StoreStats::default())
        .await
        .unwrap();
    common::wait_for("the notice subscription", Duration::from_secs(5), || {
        std::future::ready(!store.needs_confirm("e", tokio::time::Instant::now()))
    })
    .await;
    let policy = Policy {
        rate: 1.0,
        burst: 1.0,
        adaptive: Some(Adaptive::default()),
        ..Policy::default()
    };
    let before = tokio::time::Instant::now();
    store
        .feedback(
            "e",
            Ask::new(&policy, 0.0, None),
            Adaptive::default(),
            Duration::from_secs(10),
            true,
        )
        .await
        .expect("the cooldown saved");
    let cu = redis.cli(&["HGET", "sluice:{e}", "cu"]).unwrap();
    assert!(!cu.is_empty(), "Redis holds the cooldown: cu={cu:?}");
    common::wait_for("the notice", Duration::from_secs(5), || {
        std::future::ready(store.needs_confirm("e", before))
    })
    .await;
}

/// The ACL example in docs/operations.md is enough for every script sluice runs: a
/// sluice whose Redis user has exactly those rights (and `on_error = "deny"`, so a
/// refused command would show as a 503) paces, leases, saves a 429's cooldown and
/// serves every request.
#[tokio::test]
async fn the_documented_acl_user_runs_every_script() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let line = doc
        .split('`')
        .find(|s| s.starts_with("ACL SETUSER sluice "))
        .expect("docs/operations.md shows an ACL SETUSER example");
    let redis = common::redis::RedisServer::start();
    let args: Vec<&str> = line
        .split_whitespace()
        .map(|a| if a == ">..." { ">acl-pass" } else { a })
        .collect();
    redis.cli(&args).expect("the documented ACL SETUSER runs");
    let s = common::sluice(&format!(
        "[store]\nbackend = \"redis\"\nurls = [\"redis://sluice:acl-pass@127.0.0.1:{}/\"]\n\
         timeout = \"500ms\"\non_error = \"deny\"\n\
         [defaults]\nrate = 10.0\nburst = 2.0\nmax_wait = \"20s\"\nmax_in_flight = 2\n",
        redis.port()
    ))
    .await;
    let refused = Arc::new(AtomicBool::new(false));
    let up = common::Upstream::with(Arc::new(move |_: &common::Arrival| {
        if !refused.swap(true, Ordering::SeqCst) {
            common::Reply::status(429).header("Retry-After", "1")
        } else {
            common::Reply::ok()
        }
    }))
    .await;
    let mut sends = Vec::new();
    for i in 0..8 {
        let c = common::client(s.proxy_addr);
        let url = up.url(&format!("/{i}"));
        sends.push(tokio::spawn(async move {
            c.get(url)
                .header("X-Endpoint-Id", "acl")
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }));
    }
    for send in sends {
        assert_eq!(
            send.await.unwrap(),
            200,
            "every request served through the ACL user"
        );
    }
    let cu = redis.cli(&["HGET", "sluice:{acl}", "cu"]).unwrap();
    assert!(
        !cu.is_empty(),
        "the 429's cooldown saved in Redis: cu={cu:?}"
    );
    s.stop().await;
}
