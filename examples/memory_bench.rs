//! Decisions per second of the memory store alone (no sockets): `MemoryStore::acquire`
//! over 10 000 endpoints and over one contended endpoint, from several tasks at once.
//!
//! `cargo run --release --example memory_bench -- SECONDS CONCURRENCY`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sluice::config::Policy;
use sluice::limiter::memory::MemoryStore;
use sluice::limiter::{Ask, BucketStore};

/// Runs `concurrency` tasks for `secs`, each acquiring on `endpoints` IDs in turn.
async fn decisions_per_sec(secs: u64, concurrency: usize, endpoints: usize) -> f64 {
    let store = Arc::new(MemoryStore::new());
    let policy = Policy {
        rate: 1e9,
        burst: 1e9,
        max_wait: Duration::ZERO,
        adaptive: None,
        ..Policy::default()
    };
    let ask = Ask::new(&policy, 0.0, None);
    let ids: Arc<Vec<String>> = Arc::new((0..endpoints).map(|i| format!("ep{i}")).collect());
    let done = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..concurrency {
        let (store, done, ids) = (Arc::clone(&store), Arc::clone(&done), Arc::clone(&ids));
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            let mut n = 0u64;
            while Instant::now() < end {
                // 64 decisions between clock reads keep the loop's own cost small.
                for _ in 0..64 {
                    if store.acquire(&ids[i % ids.len()], ask).await.is_ok() {
                        n += 1;
                    }
                    i += concurrency;
                }
            }
            done.fetch_add(n, Ordering::Relaxed);
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let secs: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(3);
    let concurrency: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(2);
    let spread = decisions_per_sec(secs, concurrency, 10_000).await;
    let one = decisions_per_sec(secs, concurrency, 1).await;
    println!("| memory store, 10 000 endpoints, {concurrency} tasks | {spread:.0} |");
    println!("| memory store, 1 endpoint, {concurrency} tasks | {one:.0} |");
}
