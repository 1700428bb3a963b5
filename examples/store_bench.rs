//! Decisions per second through sluice's Redis store API (many endpoints, high
//! concurrency), for comparison with `redis-benchmark`'s EVALSHA ceiling.
//!
//! `cargo run --release --example store_bench -- redis://127.0.0.1:PORT/ SECONDS CONCURRENCY [ENDPOINTS [prefetch]]`
//!
//! With one endpoint every caller contends for one bucket, and the store sends the asks
//! that queue behind an in-flight call together (one script call per batch).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sluice::config::{Backend, OnError, Policy, Prefetch, StoreConfig};
use sluice::limiter::redis::RedisStore;
use sluice::limiter::{Ask, BucketStore, StoreStats};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "redis://127.0.0.1:6379/".into());
    let secs: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(5);
    let concurrency: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(64);
    let endpoints: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(10_000);
    // The store alone registers no heartbeat, so "alone" would never take any ahead.
    let prefetch = if args.next().as_deref() == Some("prefetch") {
        Prefetch::On
    } else {
        Prefetch::Off
    };
    let cfg = StoreConfig {
        backend: Backend::Redis,
        urls: vec![url],
        key_prefix: "bench:".into(),
        timeout: Duration::from_secs(2),
        on_error: OnError::Deny,
        prefetch,
        ..StoreConfig::default()
    };
    let store = Arc::new(RedisStore::connect(&cfg, StoreStats::default()).await?);
    let policy = Policy {
        rate: 1e9,
        burst: 1e9,
        max_wait: Duration::ZERO,
        adaptive: None,
        ..Policy::default()
    };
    let ask = Ask::new(&policy, 0.0, None);
    store.acquire("warmup", ask).await?;
    let done = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..concurrency {
        let (store, done) = (Arc::clone(&store), Arc::clone(&done));
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            while Instant::now() < end {
                let ep = format!("ep{}", i % endpoints);
                if store.acquire(&ep, ask).await.is_ok() {
                    done.fetch_add(1, Ordering::Relaxed);
                }
                i += concurrency;
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let rate = done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    println!("{rate:.0}");
    Ok(())
}
