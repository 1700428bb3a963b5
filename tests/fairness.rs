//! Fair shares between senders of one saturated endpoint, and priorities, measured at a
//! real upstream.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Upstream, client};

/// Grants to stop at: the measurement window.
const TARGET: usize = 160;
/// Concurrent requests per sender: enough that both always have some waiting.
const WORKERS: usize = 8;

/// Two senders (svix, batch) saturating endpoint `fair` through `proxies` until the
/// upstream has seen `TARGET` requests; returns (svix, batch) arrivals up to that point.
async fn saturate(proxies: &[SocketAddr], up: &Arc<Upstream>) -> (usize, usize) {
    let stop = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut tasks = Vec::new();
    for sender in ["svix", "batch"] {
        for w in 0..WORKERS {
            let c = client(proxies[w % proxies.len()]);
            let (up, stop) = (Arc::clone(up), Arc::clone(&stop));
            let url = up.url(&format!("/{sender}/{w}"));
            tasks.push(tokio::spawn(async move {
                // Bounded in count and in time.
                for _ in 0..200 {
                    if stop.load(Ordering::SeqCst) || Instant::now() > deadline {
                        return;
                    }
                    let r = c
                        .get(&url)
                        .header("x-endpoint-id", "fair")
                        .header("x-sluice-sender", sender)
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200, "{:?}", r.headers().get("x-sluice-reason"));
                    if up.count() >= TARGET {
                        stop.store(true, Ordering::SeqCst);
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let arrivals = up.arrivals();
    let window = &arrivals[..TARGET.min(arrivals.len())];
    let svix = window
        .iter()
        .filter(|a| a.path.starts_with("/svix/"))
        .count();
    let batch = window
        .iter()
        .filter(|a| a.path.starts_with("/batch/"))
        .count();
    (svix, batch)
}

const POLICY: &str = "[defaults]\nrate = 40.0\nburst = 1.0\nmax_wait = \"30s\"\n\
[[endpoints]]\nid = \"fair\"\nshares = { svix = 3, batch = 1 }\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_senders_split_a_saturated_endpoint_3_to_1() {
    let sluice = common::sluice(POLICY).await;
    let up = Arc::new(Upstream::start().await);
    let (svix, batch) = saturate(&[sluice.proxy_addr], &up).await;
    let ratio = svix as f64 / batch.max(1) as f64;
    eprintln!("one replica: svix {svix} / batch {batch} = {ratio:.2} (weights 3:1)");
    assert!((ratio - 3.0).abs() <= 0.3, "ratio {ratio:.2}, want 3 ± 10%");
    sluice.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_senders_across_three_replicas_report() {
    let redis = common::redis::RedisServer::start();
    let cfg = format!(
        "[store]\nbackend = \"redis\"\nurls = [\"{}\"]\ntimeout = \"500ms\"\n{POLICY}",
        redis.url()
    );
    let mut rs = Vec::new();
    for _ in 0..3 {
        rs.push(common::sluice(&cfg).await);
    }
    let proxies: Vec<SocketAddr> = rs.iter().map(|r| r.proxy_addr).collect();
    let up = Arc::new(Upstream::start().await);
    let (svix, batch) = saturate(&proxies, &up).await;
    let ratio = svix as f64 / batch.max(1) as f64;
    // Each replica is fair locally; across replicas the figure is reported, not promised.
    eprintln!("3 replicas / 1 Redis: svix {svix} / batch {batch} = {ratio:.2} (weights 3:1)");
    assert!(
        svix > batch,
        "the heavier sender gets more ({svix} vs {batch})"
    );
    for r in rs {
        r.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_high_priority_request_behind_50_low_ones_leaves_next() {
    high_behind_lows("[[endpoints]]\nid = \"prio\"\nshares = {}\n").await;
}

/// Priorities work on an endpoint with neither `shares` nor `max_in_flight`: from the
/// first request naming one, its requests wait in its queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priorities_work_on_a_plain_endpoint() {
    high_behind_lows("[[endpoints]]\nid = \"prio\"\n").await;
}

async fn high_behind_lows(endpoint: &str) {
    let sluice = common::sluice(&format!(
        "[defaults]\nrate = 10.0\nburst = 1.0\nmax_wait = \"20s\"\n{endpoint}"
    ))
    .await;
    let up = Arc::new(Upstream::start().await);
    let c = client(sluice.proxy_addr);
    let send = |path: String, priority: &'static str| {
        let c = c.clone();
        let url = up.url(&path);
        tokio::spawn(async move {
            c.get(&url)
                .header("x-endpoint-id", "prio")
                .header("x-sluice-priority", priority)
                .send()
                .await
                .map(|r| r.status().as_u16())
        })
    };
    let lows: Vec<_> = (0..50).map(|i| send(format!("/low/{i}"), "low")).collect();
    let gates = Arc::clone(sluice.app.limiter.gates());
    let deadline = Instant::now() + Duration::from_secs(10);
    // All 50 are in: one or two arrived, one is head, the rest wait in the queue.
    while gates.waiting("prio") + up.count() < 49 {
        assert!(Instant::now() < deadline, "the low requests never queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!("waiting {} arrived {}", gates.waiting("prio"), up.count());
    let before = up.count();
    let high = send("/high".into(), "high");
    assert_eq!(high.await.unwrap().unwrap(), 200);
    let order: Vec<String> = up.arrivals().iter().map(|a| a.path.clone()).collect();
    let at = order.iter().position(|p| p == "/high").unwrap();
    eprintln!("high arrived {at}th; {before} lows had arrived when it was sent");
    // Only the low request already at the head (holding its reservation) may go first.
    assert!(
        at <= before + 1,
        "high was {at}th, {before} before it was sent"
    );
    for l in lows {
        l.abort();
    }
    sluice.stop().await;
}

/// On a plain endpoint whose senders name priorities, requests of one class still leave
/// in arrival order (FIFO among equals).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_of_one_priority_leave_in_arrival_order() {
    let sluice = common::sluice(
        "[defaults]\nrate = 4.0\nburst = 1.0\nmax_wait = \"20s\"\n[[endpoints]]\nid = \"prio\"\n",
    )
    .await;
    let up = Arc::new(Upstream::start().await);
    let c = client(sluice.proxy_addr);
    let gates = Arc::clone(sluice.app.limiter.gates());
    let mut sent = Vec::new();
    for i in 0..12 {
        let priority = if i == 0 { "high" } else { "normal" };
        let (c, url) = (c.clone(), up.url(&format!("/n/{i}")));
        sent.push(tokio::spawn(async move {
            c.get(&url)
                .header("x-endpoint-id", "prio")
                .header("x-sluice-priority", priority)
                .send()
                .await
                .map(|r| r.status().as_u16())
        }));
        // The next is sent once this one is in: the first arrived, the second holds a
        // reservation (the bucket goes below zero) as head, the rest wait behind it.
        match i {
            0 => {
                common::wait_for("the first", Duration::from_secs(10), || async {
                    up.count() == 1
                })
                .await
            }
            1 => common::wait_for_tokens_below(sluice.admin_addr, "prio", -0.5).await,
            _ => {
                let deadline = Instant::now() + Duration::from_secs(10);
                while gates.waiting("prio") < i - 1 {
                    assert!(Instant::now() < deadline, "request {i} never queued");
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
        }
    }
    for s in sent {
        assert_eq!(s.await.unwrap().unwrap(), 200);
    }
    let order: Vec<String> = up.arrivals().iter().map(|a| a.path.clone()).collect();
    let want: Vec<String> = (0..12).map(|i| format!("/n/{i}")).collect();
    assert_eq!(order, want);
    sluice.stop().await;
}
