//! The 429 loop end to end: upstream throttling becomes a cooldown and a lower rate,
//! measured at a real upstream. Each scenario runs on the memory store and on a Redis
//! shared by several replicas. The receivers' refusals reach the senders here
//! (`absorb = "off"`): these scenarios watch the cooldown itself; tests/absorb.rs
//! covers refusals sluice absorbs.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use common::{Reply, Upstream, client};

/// One or more sluice replicas sharing a store.
struct Fleet {
    replicas: Vec<sluice::app::Running>,
    _redis: Option<common::redis::RedisServer>,
}

impl Fleet {
    async fn memory(extra: &str) -> Fleet {
        Fleet {
            replicas: vec![common::sluice(extra).await],
            _redis: None,
        }
    }

    async fn redis(extra: &str, n: usize) -> Fleet {
        let server = common::redis::RedisServer::start();
        let store = format!(
            "[store]\nbackend = \"redis\"\nurls = [\"{}\"]\ntimeout = \"500ms\"\n",
            server.url()
        );
        let mut replicas = Vec::new();
        for _ in 0..n {
            replicas.push(common::sluice(&format!("{store}{extra}")).await);
        }
        Fleet {
            replicas,
            _redis: Some(server),
        }
    }

    fn client(&self, i: usize) -> reqwest::Client {
        client(self.replicas[i % self.replicas.len()].proxy_addr)
    }

    async fn endpoint(&self, id: &str) -> serde_json::Value {
        let admin = self.replicas[0].admin_addr;
        common::endpoint(admin, id)
            .await
            .unwrap_or_else(|| panic!("{id} not in {admin}'s /endpoints"))
    }

    async fn stop(self) {
        for r in self.replicas {
            r.stop().await;
        }
    }
}

/// First request to `/trigger` answers 429 with `retry_after`; everything else 200.
fn throttle_once(retry_after: String) -> common::Responder {
    let fired = Arc::new(AtomicUsize::new(0));
    Arc::new(move |a| {
        if a.path == "/trigger" && fired.fetch_add(1, Ordering::SeqCst) == 0 {
            Reply::status(429).header("retry-after", &retry_after)
        } else {
            Reply::ok()
        }
    })
}

fn arrivals_after(up: &Upstream, path_prefix: &str, t0: Instant) -> Vec<Instant> {
    let mut v: Vec<Instant> = up
        .arrivals()
        .iter()
        .filter(|a| a.path.starts_with(path_prefix) && a.at >= t0)
        .map(|a| a.at)
        .collect();
    v.sort();
    v
}

const POLICY: &str = "[defaults]\nrate = 10.0\nburst = 5.0\nmax_wait = \"15s\"\n\
                      [defaults.adaptive]\nrecovery = \"5m\"\ndefault_cooldown = \"1s\"\nabsorb = \"off\"\n";

/// A 429 with Retry-After on one replica holds every replica, waiting requests included;
/// afterwards the bucket restarts empty at the decreased rate (no burst).
async fn cooldown_holds_everywhere(fleet: Fleet, retry_after: String, min_quiet: Duration) {
    let up = Upstream::with(throttle_once(retry_after)).await;
    let r = fleet
        .client(0)
        .get(up.url("/trigger"))
        .header("x-endpoint-id", "cool")
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        429,
        "the receiver's 429 reaches the sender unchanged"
    );
    assert!(r.headers().get("x-sluice-reason").is_none());
    let t429 = Instant::now();
    let mut waiters = Vec::new();
    for i in 0..24 {
        let (c, url) = (fleet.client(i), up.url(&format!("/w/{i}")));
        waiters.push(tokio::spawn(async move {
            c.get(&url)
                .header("x-endpoint-id", "cool")
                .send()
                .await
                .unwrap()
                .status()
        }));
    }
    for w in waiters {
        assert_eq!(w.await.unwrap(), 200);
    }
    let after = arrivals_after(&up, "/w/", t429);
    assert_eq!(
        after.len(),
        24,
        "every waiting request was served exactly once"
    );
    let quiet = after[0] - t429;
    assert!(
        quiet >= min_quiet,
        "a request arrived {quiet:?} after the 429 (cooldown {min_quiet:?})"
    );
    // No burst at the cooldown's end: the first second holds at most rate/2·1 + 1.
    let first_second = after
        .iter()
        .filter(|t| **t < after[0] + Duration::from_secs(1))
        .count();
    assert!(
        first_second <= 6,
        "{first_second} arrivals in the first second after the cooldown"
    );
    // And the sustained rate is the decreased one (5/s), not the configured 10/s.
    let span = (after[after.len() - 1] - after[0]).as_secs_f64();
    let rate = (after.len() - 1) as f64 / span;
    assert!(
        (4.5..=5.3).contains(&rate),
        "rate after the cooldown: {rate:.2}/s"
    );
    let ep = fleet.endpoint("cool").await;
    assert!((ep["rate"].as_f64().unwrap() - 5.0).abs() < 0.2, "{ep}");
    assert_eq!(ep["throttles"], 1);
    fleet.stop().await;
}

async fn fifty_concurrent_429s_decrease_once(fleet: Fleet) {
    // The receiver answers slowly, so all fifty are in flight before the first 429 returns.
    let up = Upstream::with(Arc::new(|_| {
        Reply::status(429)
            .header("retry-after", "1")
            .delay(Duration::from_millis(400))
    }))
    .await;
    let mut all = Vec::new();
    for i in 0..50 {
        let (c, url) = (fleet.client(i), up.url("/all"));
        all.push(tokio::spawn(async move {
            c.get(&url)
                .header("x-endpoint-id", "fifty")
                .send()
                .await
                .unwrap()
                .status()
        }));
    }
    for a in all {
        assert_eq!(a.await.unwrap(), 429);
    }
    assert_eq!(up.count(), 50);
    let ep = fleet.endpoint("fifty").await;
    let rate = ep["rate"].as_f64().unwrap();
    assert!(
        (rate - 32.0).abs() < 0.5,
        "rate {rate} after 50 concurrent 429s (64 → 32 expected): {ep}"
    );
    assert_eq!(ep["throttles"], 50);
    fleet.stop().await;
}

async fn endless_429s_stop_at_the_floor(fleet: Fleet) {
    let up = Upstream::with(Arc::new(|_| Reply::status(429))).await;
    let c = fleet.client(0);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut sent = 0;
    while Instant::now() < deadline && sent < 200 {
        let r = c
            .get(up.url("/x"))
            .header("x-endpoint-id", "floor")
            .send()
            .await
            .unwrap();
        assert!(r.status() == 429 || r.status() == 503, "{}", r.status());
        sent += 1;
    }
    let ep = fleet.endpoint("floor").await;
    assert!((ep["rate"].as_f64().unwrap() - 2.0).abs() < 0.05, "{ep}");
    assert_eq!(ep["at_floor"], true, "{ep}");
    // Still trickling: 8 → 4 → 2 → 2 ... with 200 ms cooldowns, at least 6 reached it.
    assert!(
        up.count() >= 6,
        "only {} requests reached the upstream",
        up.count()
    );
    fleet.stop().await;
}

async fn recovery_reaches_the_configured_rate(fleet: Fleet) {
    let up = Upstream::with(throttle_once("1".into())).await;
    let c = fleet.client(0);
    // Before the 429 is sent, so before sluice hears it.
    let t429 = Instant::now();
    assert_eq!(
        c.get(up.url("/trigger"))
            .header("x-endpoint-id", "rec")
            .send()
            .await
            .unwrap()
            .status(),
        429
    );
    let ep = fleet.endpoint("rec").await;
    assert!((ep["rate"].as_f64().unwrap() - 5.0).abs() < 0.1, "{ep}");
    // Cooldown 1 s + recovery 2 s: back at the configured rate, and not before.
    common::wait_for(
        "the configured rate again",
        Duration::from_secs(6),
        || async { fleet.endpoint("rec").await["rate"].as_f64() == Some(10.0) },
    )
    .await;
    assert!(
        t429.elapsed() >= Duration::from_secs(3),
        "recovered after {:?}, the climb takes 3 s",
        t429.elapsed()
    );
    // Measured at the upstream: saturate for a while after the burst.
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..30 {
        let (c, url) = (fleet.client(i), up.url(&format!("/r/{i}")));
        tasks.push(tokio::spawn(async move {
            c.get(&url)
                .header("x-endpoint-id", "rec")
                .send()
                .await
                .unwrap()
                .status()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let times = arrivals_after(&up, "/r/", t0);
    let rate = common::sustained_rate(&times, 5);
    assert!(
        (9.5..=10.5).contains(&rate),
        "recovered rate measured at the upstream: {rate:.2}/s"
    );
    fleet.stop().await;
}

async fn remaining_zero_pauses_until_reset(fleet: Fleet) {
    let fired = Arc::new(AtomicUsize::new(0));
    let up = Upstream::with(Arc::new(move |a| {
        if a.path == "/quota" && fired.fetch_add(1, Ordering::SeqCst) == 0 {
            Reply::ok()
                .header("x-ratelimit-remaining", "0")
                .header("x-ratelimit-reset", "2")
        } else {
            Reply::ok()
        }
    }))
    .await;
    let c = fleet.client(0);
    assert_eq!(
        c.get(up.url("/quota"))
            .header("x-endpoint-id", "quota")
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let t0 = Instant::now();
    let r = fleet
        .client(1)
        .get(up.url("/next"))
        .header("x-endpoint-id", "quota")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let next = arrivals_after(&up, "/next", t0);
    assert!(
        next[0] - t0 >= Duration::from_millis(1950),
        "sent {:?} after a 2 s reset",
        next[0] - t0
    );
    let ep = fleet.endpoint("quota").await;
    assert_eq!(
        ep["rate"].as_f64().unwrap(),
        10.0,
        "a proactive pause does not lower the rate: {ep}"
    );
    assert_eq!(ep["throttles"], 0);
    fleet.stop().await;
}

fn http_date_in(secs: u64) -> String {
    httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(secs))
}

fn http_date_ago(secs: u64) -> String {
    httpdate::fmt_http_date(SystemTime::now() - Duration::from_secs(secs))
}

const FIFTY: &str = "[defaults]\nrate = 64.0\nburst = 64.0\nmax_wait = \"5s\"\n\
                     [defaults.adaptive]\nabsorb = \"off\"\n";
const FLOOR: &str = "[defaults]\nrate = 8.0\nburst = 1.0\nmax_wait = \"10s\"\n\
                     [defaults.adaptive]\nfloor = 2.0\ndefault_cooldown = \"200ms\"\nabsorb = \"off\"\n";
const RECOVER: &str = "[defaults]\nrate = 10.0\nburst = 5.0\nmax_wait = \"10s\"\n\
                       [defaults.adaptive]\nrecovery = \"2s\"\nabsorb = \"off\"\n";

macro_rules! both_stores {
    ($($name:ident => |$fleet:ident| $body:expr, with $cfg:expr;)*) => {
        /// In virtual time: sluice, upstream and clients share one paused runtime over
        /// loopback sockets, so cooldowns and climbs take no wall time.
        mod memory {
            use super::*;
            $(
                #[tokio::test(start_paused = true)]
                async fn $name() {
                    let $fleet = Fleet::memory($cfg).await;
                    $body.await
                }
            )*
        }
        mod redis_three_replicas {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let $fleet = Fleet::redis($cfg, 3).await;
                    $body.await
                }
            )*
        }
    };
}

both_stores! {
    cooldown_from_delta_seconds => |f| cooldown_holds_everywhere(f, "2".into(), Duration::from_millis(1990)), with POLICY;
    cooldown_from_http_date => |f| cooldown_holds_everywhere(f, http_date_in(3), Duration::from_millis(1900)), with POLICY;
    // "Retry now", or a date a receiver's slow clock already left
    // behind: no pause, but the bucket still restarts empty at the decreased rate.
    no_burst_after_retry_after_zero => |f| cooldown_holds_everywhere(f, "0".into(), Duration::ZERO), with POLICY;
    no_burst_after_a_past_date => |f| cooldown_holds_everywhere(f, http_date_ago(3600), Duration::ZERO), with POLICY;
    fifty_429s_decrease_once => |f| fifty_concurrent_429s_decrease_once(f), with FIFTY;
    floor_holds => |f| endless_429s_stop_at_the_floor(f), with FLOOR;
    recovery => |f| recovery_reaches_the_configured_rate(f), with RECOVER;
    ratelimit_remaining_zero => |f| remaining_zero_pauses_until_reset(f), with POLICY;
}
