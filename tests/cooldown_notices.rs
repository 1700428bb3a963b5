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
