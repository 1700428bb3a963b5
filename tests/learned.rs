//! What sluice learns from its receivers' answers beyond `Retry-After`: the wait a
//! throttling answer names only in its body (`retry_after_json`), on both engines, and
//! the quota a receiver publishes in its headers, spread evenly until its reset
//! (`[defaults.adaptive] learn`), on the memory store and on replicas sharing a Redis.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use common::{Reply, Upstream, read_response, wait_for};

/// `Connection` values that keep a request in the lane, and that hand it to hyper.
const BOTH_PATHS: [&str; 2] = ["keep-alive", "x-hop"];

const GOOGLE_429: &str = r#"{"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "1.5s"}]}}"#;

async fn get(proxy: std::net::SocketAddr, up: &Upstream, path: &str, connection: &str) -> String {
    let mut s = TcpStream::connect(proxy).await.unwrap();
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nX-Endpoint-Id: g\r\nConnection: {connection}\r\n\r\n",
        up.url(path),
        up.addr
    );
    s.write_all(req.as_bytes()).await.unwrap();
    read_response(&mut s).await
}

/// A 429 whose body alone names the wait (`"retryDelay": "1.5s"`, no `Retry-After`)
/// reaches its sender unchanged, and the endpoint's cooldown is the 1.5 s it names, not
/// the 100 ms `default_cooldown`: the next request reaches the receiver 1.5 s after the
/// 429, on the lane and on hyper's path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_named_only_in_the_body_holds_the_endpoint_on_both_engines() {
    for connection in BOTH_PATHS {
        let fired = Arc::new(AtomicUsize::new(0));
        let f = Arc::clone(&fired);
        let up = Upstream::with(Arc::new(move |a| {
            if a.path == "/hint" && f.fetch_add(1, Ordering::SeqCst) == 0 {
                Reply {
                    body: GOOGLE_429.into(),
                    ..Reply::status(429).header("content-type", "application/json")
                }
            } else {
                Reply::ok()
            }
        }))
        .await;
        let sluice = common::sluice(
            "[defaults]\nrate = 100.0\nburst = 10.0\nmax_wait = \"5s\"\n\
             [defaults.adaptive]\ndefault_cooldown = \"100ms\"\nabsorb = \"off\"\n\
             [[endpoints]]\nid = \"g\"\nretry_after_json = \"/error/details/0/retryDelay\"\n",
        )
        .await;
        let answer = get(sluice.proxy_addr, &up, "/hint", connection).await;
        assert!(answer.starts_with("HTTP/1.1 429"), "{connection}: {answer}");
        let body = answer.split_once("\r\n\r\n").unwrap().1;
        assert_eq!(body, GOOGLE_429, "{connection}: the body changed");
        let throttled_at = up.arrivals()[0].at;
        let admin = sluice.admin_addr;
        wait_for(
            "the body's wait as the cooldown",
            Duration::from_secs(5),
            || async {
                common::endpoint(admin, "g")
                    .await
                    .is_some_and(|e| e["cooldown_ms"].as_u64().unwrap_or(0) > 1000)
            },
        )
        .await;
        let next = get(sluice.proxy_addr, &up, "/next", connection).await;
        assert!(next.starts_with("HTTP/1.1 200"), "{connection}: {next}");
        let gap = up.arrivals()[1].at - throttled_at;
        assert!(
            gap >= Duration::from_millis(1490),
            "{connection}: the next request came {gap:?} after the 429"
        );
        sluice.stop().await;
    }
}

/// The quota the test receiver allows: `QUOTA` requests in each fixed window of `WINDOW`.
const QUOTA: u64 = 15;
const WINDOW: Duration = Duration::from_secs(5);

/// How a receiver publishes its quota.
#[derive(Debug, Clone, Copy)]
enum Dialect {
    /// `RateLimit-Policy` + `RateLimit` (draft-ietf-httpapi-ratelimit-headers).
    Ietf,
    /// The earlier draft's `RateLimit-Limit`, `-Remaining`, `-Reset` (+ `RateLimit-Policy`).
    Draft,
    /// `X-RateLimit-*`, the reset in seconds.
    XSeconds,
    /// `X-RateLimit-*`, the reset as epoch seconds (GitHub's).
    XEpoch,
}

const DIALECTS: [Dialect; 4] = [
    Dialect::Ietf,
    Dialect::Draft,
    Dialect::XSeconds,
    Dialect::XEpoch,
];

/// A receiver allowing [`QUOTA`] requests per fixed [`WINDOW`] from its start, saying so
/// in `dialect` on every answer (the reset rounded up to whole seconds, as receivers
/// publish it) and answering 429 past it.
fn quota_receiver(dialect: Dialect, start: tokio::time::Instant) -> common::Responder {
    let counts = Arc::new(std::sync::Mutex::new(
        std::collections::HashMap::<u64, u64>::new(),
    ));
    Arc::new(move |a| {
        let since = a.at.duration_since(start);
        let window = (since.as_secs_f64() / WINDOW.as_secs_f64()).floor() as u64;
        let ends = WINDOW * (window as u32 + 1);
        let left = ends - since;
        let used = {
            let mut c = counts.lock().unwrap();
            let n = c.entry(window).or_default();
            *n += 1;
            *n
        };
        let remaining = QUOTA.saturating_sub(used);
        let reset = left.as_secs_f64().ceil() as u64;
        let epoch = (std::time::SystemTime::now() + left)
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
            .ceil() as u64;
        let mut reply = if used > QUOTA {
            Reply::status(429).header("retry-after", &reset.to_string())
        } else {
            Reply::ok()
        };
        let (r, t) = (remaining.to_string(), reset.to_string());
        let q = QUOTA.to_string();
        reply = match dialect {
            Dialect::Ietf => reply
                .header("ratelimit-policy", "\"default\";q=15;w=5")
                .header("ratelimit", &format!("\"default\";r={r};t={t}")),
            Dialect::Draft => reply
                .header("ratelimit-limit", &q)
                .header("ratelimit-policy", "15;w=5")
                .header("ratelimit-remaining", &r)
                .header("ratelimit-reset", &t),
            Dialect::XSeconds => reply
                .header("x-ratelimit-limit", &q)
                .header("x-ratelimit-remaining", &r)
                .header("x-ratelimit-reset", &t),
            Dialect::XEpoch => reply
                .header("x-ratelimit-limit", &q)
                .header("x-ratelimit-remaining", &r)
                .header("x-ratelimit-reset", &epoch.to_string()),
        };
        reply
    })
}

/// How long senders keep the endpoint saturated: the first window (sluice knows
/// nothing yet), then three more.
const RUN: Duration = Duration::from_secs(20);

/// Saturates endpoint `id` through `proxies` (senders spread over them) for [`RUN`].
async fn saturate(proxies: &[std::net::SocketAddr], up: &Upstream, id: &str) {
    let end = tokio::time::Instant::now() + RUN;
    let mut senders = Vec::new();
    for i in 0..8 {
        let client = common::client(proxies[i % proxies.len()]);
        let (url, id) = (up.url("/q"), id.to_owned());
        senders.push(tokio::spawn(async move {
            while tokio::time::Instant::now() < end {
                let r = client.get(&url).header("x-endpoint-id", &id).send().await;
                // sluice's own refusals (past max_wait) reach no receiver: try again
                // a little later.
                if !r.is_ok_and(|r| r.status().is_success()) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }));
    }
    for s in senders {
        s.await.unwrap();
    }
}

/// Checks what the receiver saw after the first window: nothing past its quota (no
/// window over `QUOTA`, no 429), at most twice its even share (3/s) in any second, and
/// the quota used (each whole window at least half of it).
fn assert_kept(up: &Upstream, start: tokio::time::Instant, what: &str) {
    let arrivals: Vec<Duration> = up.arrivals().iter().map(|a| a.at - start).collect();
    let after: Vec<Duration> = arrivals.iter().copied().filter(|t| *t >= WINDOW).collect();
    let windows = (RUN.as_secs_f64() / WINDOW.as_secs_f64()) as u64;
    let mut per_window = Vec::new();
    for w in 1..windows {
        let (lo, hi) = (WINDOW * w as u32, WINDOW * (w as u32 + 1));
        per_window.push(after.iter().filter(|t| **t >= lo && **t < hi).count() as u64);
    }
    let mut worst_second = 0;
    for (i, t) in after.iter().enumerate() {
        let n = after[i..]
            .iter()
            .take_while(|u| **u < *t + Duration::from_secs(1))
            .count();
        worst_second = worst_second.max(n);
    }
    eprintln!("{what}: per window after the first {per_window:?}, most in 1 s {worst_second}");
    assert!(
        per_window.iter().all(|n| *n <= QUOTA),
        "{what}: past the quota once known: {per_window:?}"
    );
    assert!(
        worst_second <= 6,
        "{what}: {worst_second} requests in one second (even share 3/s)"
    );
    let full: Vec<_> = per_window[..per_window.len() - 1].to_vec();
    assert!(
        full.iter().all(|n| *n >= QUOTA / 2),
        "{what}: the quota went unused: {full:?}"
    );
}

const SATURATED: &str = "[defaults]\nrate = 50.0\nburst = 20.0\nmax_wait = \"2s\"\n\
                         [defaults.adaptive]\nabsorb = \"off\"\n";

/// A receiver publishing 15 requests per 5 s, in each of four dialects, under
/// saturation through one sluice: once its quota is known, no window gets more than
/// 15, and no second more than 6 (twice the even share).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_quota_is_spread_until_its_reset_on_the_memory_store() {
    let sluice = common::sluice(SATURATED).await;
    let mut runs = Vec::new();
    for (i, d) in DIALECTS.into_iter().enumerate() {
        let proxy = sluice.proxy_addr;
        runs.push(tokio::spawn(async move {
            let start = tokio::time::Instant::now();
            let up = Upstream::with(quota_receiver(d, start)).await;
            saturate(&[proxy], &up, &format!("q{i}")).await;
            assert_kept(&up, start, &format!("{d:?}"));
        }));
    }
    for r in runs {
        r.await.unwrap();
    }
    let view = common::endpoint(sluice.admin_addr, "q0").await.unwrap();
    let learned = &view["learned"];
    assert_eq!(learned["source"], "RateLimit", "{view}");
    assert!(
        learned["remaining"].as_u64().is_some_and(|r| r <= QUOTA),
        "{view}"
    );
    assert!(learned["reset_in_ms"].as_u64().is_some(), "{view}");
    sluice.stop().await;
}

/// The same through three replicas sharing one Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_quota_is_spread_until_its_reset_across_three_replicas() {
    let server = common::redis::RedisServer::start();
    let store = format!(
        "[store]\nbackend = \"redis\"\nurls = [\"{}\"]\ntimeout = \"500ms\"\n",
        server.url()
    );
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(common::sluice(&format!("{store}{SATURATED}")).await);
    }
    let proxies: Vec<_> = replicas.iter().map(|r| r.proxy_addr).collect();
    let mut runs = Vec::new();
    for (i, d) in DIALECTS.into_iter().enumerate() {
        let proxies = proxies.clone();
        runs.push(tokio::spawn(async move {
            let start = tokio::time::Instant::now();
            let up = Upstream::with(quota_receiver(d, start)).await;
            saturate(&proxies, &up, &format!("q{i}")).await;
            assert_kept(&up, start, &format!("{d:?} on 3 replicas"));
        }));
    }
    for r in runs {
        r.await.unwrap();
    }
    for r in replicas {
        r.stop().await;
    }
}
