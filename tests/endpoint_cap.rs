//! The memory store holds at most `store.max_endpoints` buckets: a sender naming ever
//! new endpoint IDs cannot grow sluice's state past it, idle buckets make room, and a
//! busy endpoint's bucket is never forgotten to make room (its receiver still sees at
//! most rate·W + burst in every window).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;

use common::{Upstream, assert_no_overdraw, client, metrics, sluice};

/// The value of an unlabelled metric in `/metrics` text.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sprayed_endpoint_ids_stay_under_the_cap_and_busy_buckets_are_kept() {
    const CAP: f64 = 1000.0;
    const SPRAYED: usize = 50_000;
    let upstream = Upstream::start().await;
    let s = sluice(
        r#"
[store]
max_endpoints = 1000

[defaults]
rate = 1.0
burst = 2.0
max_wait = "0s"

[[endpoints]]
id = "hot"
rate = 4.0
burst = 4.0
max_wait = "0s"
"#,
    )
    .await;
    let (proxy, admin) = (s.proxy_addr, s.admin_addr);

    // One sender keeps "hot" saturated throughout: its bucket is never full again, so
    // making room must never take it (a fresh bucket would add a second burst).
    let spraying = Arc::new(AtomicBool::new(true));
    let hot = {
        let (spraying, url) = (Arc::clone(&spraying), upstream.url("/hot"));
        let c = client(proxy);
        tokio::spawn(async move {
            while spraying.load(Ordering::Relaxed) {
                let _ = c.get(&url).header("X-Endpoint-Id", "hot").send().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // The tracked gauge, watched while the spray runs.
    let most = Arc::new(AtomicU64::new(0));
    let watch = {
        let (spraying, most) = (Arc::clone(&spraying), Arc::clone(&most));
        tokio::spawn(async move {
            while spraying.load(Ordering::Relaxed) {
                if let Some(n) = metric(&metrics(admin).await, "sluice_endpoints_tracked") {
                    most.fetch_max(n as u64, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    let c = client(proxy);
    let url = upstream.url("/spray");
    let answers: Vec<(u16, String)> = futures_util::stream::iter(0..SPRAYED)
        .map(|i| {
            let (c, url) = (c.clone(), url.clone());
            async move {
                let r = c
                    .get(&url)
                    .header("X-Endpoint-Id", format!("spray-{i}"))
                    .send()
                    .await
                    .unwrap();
                let reason = r
                    .headers()
                    .get("x-sluice-reason")
                    .map(|v| v.to_str().unwrap().to_owned())
                    .unwrap_or_default();
                (r.status().as_u16(), reason)
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    spraying.store(false, Ordering::Relaxed);
    hot.await.unwrap();
    watch.await.unwrap();

    let sent = answers.iter().filter(|(s, _)| *s == 200).count();
    let full = answers
        .iter()
        .filter(|(s, r)| *s == 503 && r == "endpoint_capacity")
        .count();
    let text = metrics(admin).await;
    let tracked = metric(&text, "sluice_endpoints_tracked").unwrap();
    let evicted = metric(&text, "sluice_endpoint_state_evicted_total").unwrap();
    eprintln!(
        "{SPRAYED} IDs: {sent} sent, {full} refused endpoint_capacity; tracked at most {} \
         while spraying, {tracked} after; {evicted} idle buckets evicted",
        most.load(Ordering::Relaxed)
    );
    assert_eq!(
        sent + full,
        SPRAYED,
        "every answer is 200 or 503 endpoint_capacity"
    );
    assert!(full > 0, "a busy store refuses new IDs");
    assert!(
        most.load(Ordering::Relaxed) as f64 <= CAP && tracked <= CAP,
        "tracked endpoints stay within max_endpoints"
    );
    assert!(evicted > 0.0, "idle buckets make room");
    assert!(sent > 1000, "room is made as buckets go idle: {sent} sent");

    let hot: Vec<_> = upstream
        .arrivals()
        .iter()
        .filter(|a| a.path == "/hot")
        .map(|a| a.at)
        .collect();
    assert!(hot.len() > 8, "hot was served throughout: {}", hot.len());
    assert_no_overdraw(&hot, 4.0, 4.0);
}

#[tokio::test]
async fn a_refusal_for_capacity_has_the_one_error_shape() {
    let upstream = Upstream::start().await;
    let s = sluice(
        r#"
[store]
max_endpoints = 1

[defaults]
rate = 0.1
burst = 1.0
max_wait = "0s"
"#,
    )
    .await;
    let c = client(s.proxy_addr);
    let first = c
        .get(upstream.url("/a"))
        .header("X-Endpoint-Id", "a")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    let r = c
        .get(upstream.url("/b"))
        .header("X-Endpoint-Id", "b")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["x-sluice-reason"], "endpoint_capacity");
    assert_eq!(r.headers()["retry-after"], "1");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["reason"], "endpoint_capacity");
    assert_eq!(body["endpoint"], "b");
    assert_eq!(upstream.count(), 1, "the refused request never left");
}
