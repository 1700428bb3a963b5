//! One behaviour suite for every bucket store: memory, a single Redis, a 3-master Redis
//! Cluster. Each test function runs unchanged against each store.

#[path = "support/redis.rs"]
#[allow(dead_code)]
mod redis_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice::config::{Backend, Config, OnError, Policy, StoreConfig};
use sluice::limiter::memory::MemoryStore;
use sluice::limiter::redis::RedisStore;
use sluice::limiter::{Ask, BucketStore, Limiter, Outcome, StoreStats};

/// A store under test and whatever keeps its servers alive.
struct Subject {
    store: Arc<dyn BucketStore>,
    single: Option<redis_support::RedisServer>,
    cluster: Option<redis_support::RedisCluster>,
    sentinel: Option<redis_support::SentinelSet>,
}

fn store_config(backend: Backend, urls: Vec<String>) -> StoreConfig {
    StoreConfig {
        backend,
        urls,
        key_prefix: "sluice:".into(),
        timeout: Duration::from_millis(500),
        on_error: OnError::Deny,
        ..StoreConfig::default()
    }
}

async fn memory() -> Subject {
    Subject {
        store: Arc::new(MemoryStore::new()),
        single: None,
        cluster: None,
        sentinel: None,
    }
}

async fn redis() -> Subject {
    let server = redis_support::RedisServer::start();
    let store = RedisStore::connect(
        &store_config(Backend::Redis, vec![server.url()]),
        StoreStats::default(),
    )
    .await
    .unwrap();
    Subject {
        store: Arc::new(store),
        single: Some(server),
        cluster: None,
        sentinel: None,
    }
}

async fn cluster() -> Subject {
    let c = redis_support::RedisCluster::start();
    let store = RedisStore::connect(
        &store_config(Backend::RedisCluster, c.urls()),
        StoreStats::default(),
    )
    .await
    .unwrap();
    Subject {
        store: Arc::new(store),
        single: None,
        cluster: Some(c),
        sentinel: None,
    }
}

async fn sentinel() -> Subject {
    let set = redis_support::SentinelSet::start("behaviour");
    let store = RedisStore::connect(
        &StoreConfig {
            sentinel_master: Some(set.name.clone()),
            ..store_config(Backend::RedisSentinel, set.sentinel_urls())
        },
        StoreStats::default(),
    )
    .await
    .unwrap();
    Subject {
        store: Arc::new(store),
        single: None,
        cluster: None,
        sentinel: Some(set),
    }
}

fn policy(rate: f64, burst: f64, max_wait_ms: u64) -> Policy {
    Policy {
        rate,
        burst,
        max_wait: Duration::from_millis(max_wait_ms),
        adaptive: Config::parse("").unwrap().defaults.adaptive,
    }
}

async fn burst_bound(s: Subject) {
    let p = policy(1.0, 5.0, 0);
    let ask = Ask::new(&p, 0.0, None);
    let mut granted = 0;
    for _ in 0..8 {
        if let Outcome::Granted { wait_us, .. } = s.store.acquire("burst", ask).await.unwrap() {
            assert_eq!(wait_us, 0.0);
            granted += 1;
        }
    }
    assert_eq!(granted, 5, "a fresh bucket grants exactly its burst");
}

async fn refusal_consumes_nothing(s: Subject) {
    let p = policy(1.0, 1.0, 0);
    let ask = Ask::new(&p, 0.0, None);
    assert!(matches!(
        s.store.acquire("refuse", ask).await.unwrap(),
        Outcome::Granted { .. }
    ));
    let before = s
        .store
        .view("refuse", ask, None)
        .await
        .unwrap()
        .unwrap()
        .tokens;
    for _ in 0..20 {
        match s.store.acquire("refuse", ask).await.unwrap() {
            Outcome::Refused { cooldown, retry_us } => {
                assert!(!cooldown);
                assert!(retry_us > 0.0 && retry_us <= 1e6);
            }
            o => panic!("expected a refusal, got {o:?}"),
        }
    }
    let after = s
        .store
        .view("refuse", ask, None)
        .await
        .unwrap()
        .unwrap()
        .tokens;
    // Only refill (≤ 1 token/s over the loop) may have changed the balance.
    assert!(
        after >= before && after - before < 0.5,
        "{before} → {after}"
    );
}

async fn sustained_rate_in_arrival_order(s: Subject) {
    let (rate, burst) = (50.0, 5.0);
    let p = Arc::new(policy(rate, burst, 10_000));
    let limiter = Limiter::new(Arc::clone(&s.store));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..60 {
        let (l, p) = (limiter.clone(), Arc::clone(&p));
        tasks.push(tokio::spawn(async move {
            l.admit("steady", &p).await.unwrap();
            (i, Instant::now())
        }));
        // Spaced so that call order is index order.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut grants = Vec::new();
    for t in tasks {
        grants.push(t.await.unwrap());
    }
    let mut by_time = grants.clone();
    by_time.sort_by_key(|(_, t)| *t);
    let order: Vec<usize> = by_time.iter().map(|(i, _)| *i).collect();
    // Grants in the same instant may tie; the order of reservations must hold otherwise.
    let inversions = order.windows(2).filter(|w| w[0] > w[1]).count();
    assert!(inversions <= 5, "served out of order: {order:?}");
    let times: Vec<Instant> = grants.iter().map(|(_, t)| *t).collect();
    for w in [0.25, 0.5, 1.0] {
        let win = Duration::from_secs_f64(w);
        for a in &times {
            let n = times.iter().filter(|b| **b >= *a && **b < *a + win).count() as f64;
            assert!(n <= rate * w + burst + 1.0, "{n} grants in {w}s");
        }
    }
    let span = by_time.last().unwrap().1 - by_time[burst as usize].1;
    let achieved = (60.0 - burst - 1.0) / span.as_secs_f64();
    assert!(achieved >= 0.95 * rate, "sustained {achieved:.1}/s");
    assert!(start.elapsed() < Duration::from_secs(5));
}

async fn cancelled_waiter_gives_its_slot_back(s: Subject) {
    let p = Arc::new(policy(2.0, 1.0, 5_000));
    let limiter = Limiter::new(Arc::clone(&s.store));
    limiter.admit("cancel", &p).await.unwrap();
    // A waiter for the next token (0.5 s away) hangs up after 50 ms.
    let waiting =
        tokio::time::timeout(Duration::from_millis(50), limiter.admit("cancel", &p)).await;
    assert!(
        waiting.is_err(),
        "the waiter should still have been waiting"
    );
    let ask = Ask::new(&p, 0.0, None);
    let deadline = Instant::now() + Duration::from_secs(2);
    while s
        .store
        .view("cancel", ask, None)
        .await
        .unwrap()
        .unwrap()
        .tokens
        < -0.5
    {
        assert!(Instant::now() < deadline, "reservation never given back");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let started = Instant::now();
    limiter.admit("cancel", &p).await.unwrap();
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_millis(500),
        "the refunded slot was not reused: waited {waited:?}"
    );
}

async fn cooldown_then_empty_bucket_at_decreased_rate(s: Subject) {
    let p = policy(10.0, 10.0, 5_000);
    let a = p.adaptive.unwrap();
    let ask = Ask::new(&p, 5e6, None);
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let store = Arc::clone(&s.store);
        tasks.push(tokio::spawn(async move {
            store
                .feedback("cool", ask, a, Duration::from_millis(800), true)
                .await
                .unwrap()
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let v = s
        .store
        .view("cool", ask, Some(a.floor))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(v.throttles, 50);
    assert!(
        (v.rate - 5.0).abs() < 0.01,
        "50 throttles decrease once: rate {}",
        v.rate
    );
    match s
        .store
        .acquire("cool", Ask::new(&p, 0.0, None))
        .await
        .unwrap()
    {
        Outcome::Refused {
            cooldown: true,
            retry_us,
        } => assert!(retry_us > 600_000.0),
        o => panic!("{o:?}"),
    }
    match s.store.acquire("cool", ask).await.unwrap() {
        // Cooldown left + one token at 5/s: the bucket restarted empty.
        Outcome::Granted { wait_us, .. } => assert!(wait_us > 900_000.0, "{wait_us}"),
        o => panic!("{o:?}"),
    }
}

async fn floor_holds(s: Subject) {
    let p = policy(16.0, 1.0, 5_000);
    let mut a = p.adaptive.unwrap();
    a.floor = 3.0;
    a.default_cooldown = Duration::ZERO;
    let ask = Ask::new(&p, 0.0, None);
    for _ in 0..10 {
        s.store
            .feedback("floor", ask, a, Duration::ZERO, true)
            .await
            .unwrap();
    }
    let v = s
        .store
        .view("floor", ask, Some(a.floor))
        .await
        .unwrap()
        .unwrap();
    assert!(v.rate >= 3.0 && v.rate < 3.1, "rate {}", v.rate);
    assert!(v.at_floor);
}

macro_rules! every_store {
    ($($name:ident),* $(,)?) => {
        mod on_memory { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(memory().await).await } )* }
        mod on_redis { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(redis().await).await } )* }
        mod on_cluster { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(cluster().await).await } )* }
        mod on_sentinel { use super::*; $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { super::$name(sentinel().await).await } )* }
    };
}

every_store!(
    burst_bound,
    refusal_consumes_nothing,
    sustained_rate_in_arrival_order,
    cancelled_waiter_gives_its_slot_back,
    cooldown_then_empty_bucket_at_decreased_rate,
    floor_holds,
);

#[tokio::test]
async fn redis_keys_expire_on_their_own_and_scripts_reload() {
    let s = redis().await;
    let server = s.single.as_ref().unwrap();
    let p = policy(10.0, 5.0, 0);
    let ask = Ask::new(&p, 0.0, None);
    s.store.acquire("ttl", ask).await.unwrap();
    let pttl: i64 = server
        .cli(&["PTTL", "sluice:{ttl}"])
        .unwrap()
        .parse()
        .unwrap();
    // One token short at 10/s refills in 100 ms; the key lives that plus a 1 s margin.
    assert!(pttl > 0 && pttl <= 1_100 + 50, "PTTL {pttl}");
    server.cli(&["SCRIPT", "FLUSH"]).unwrap();
    assert!(
        matches!(
            s.store.acquire("ttl", ask).await.unwrap(),
            Outcome::Granted { .. }
        ),
        "NOSCRIPT recovered"
    );
}

#[tokio::test]
async fn cluster_keys_use_the_endpoint_hash_tag_and_spread_over_masters() {
    let s = cluster().await;
    let c = s.cluster.as_ref().unwrap();
    let p = policy(10.0, 5.0, 0);
    let ask = Ask::new(&p, 0.0, None);
    let mut ports = std::collections::HashSet::new();
    for i in 0..12 {
        let ep = format!("ep_{i}");
        assert!(matches!(
            s.store.acquire(&ep, ask).await.unwrap(),
            Outcome::Granted { .. }
        ));
        let key = format!("sluice:{{{ep}}}");
        let node = c.node_for(&key);
        assert_eq!(
            node.cli(&["EXISTS", &key]).as_deref(),
            Some("1"),
            "{key} not on its slot's master"
        );
        ports.insert(node.port());
    }
    assert!(ports.len() >= 2, "all endpoints landed on one master");
    for n in &c.nodes {
        n.cli(&["SCRIPT", "FLUSH"]).unwrap();
    }
    assert!(
        matches!(
            s.store.acquire("ep_0", ask).await.unwrap(),
            Outcome::Granted { .. }
        ),
        "NOSCRIPT recovered"
    );
}

#[tokio::test]
async fn sentinel_decides_on_the_master_and_scripts_reload() {
    let s = sentinel().await;
    let set = s.sentinel.as_ref().unwrap();
    let p = policy(10.0, 5.0, 0);
    let ask = Ask::new(&p, 0.0, None);
    s.store.acquire("sent", ask).await.unwrap();
    assert_eq!(
        set.master.cli(&["EXISTS", "sluice:{sent}"]).as_deref(),
        Some("1")
    );
    set.master.cli(&["SCRIPT", "FLUSH"]).unwrap();
    assert!(
        matches!(
            s.store.acquire("sent", ask).await.unwrap(),
            Outcome::Granted { .. }
        ),
        "NOSCRIPT recovered"
    );
}
