//! `max_in_flight`: concurrency leases measured at a real upstream that counts the
//! requests it is serving at once, on one replica (memory) and on three replicas sharing
//! a real Redis; a crashed holder's leases come back within `lease_ttl`.

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use common::client;

/// An upstream that holds each request `delay` and records the peak number served at once.
struct Counting {
    addr: SocketAddr,
    peak: Arc<AtomicUsize>,
    served: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Counting {
    async fn start(delay: Duration) -> Counting {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let now = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let served = Arc::new(AtomicUsize::new(0));
        let (n, p, s) = (now.clone(), peak.clone(), served.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (n, p, s) = (n.clone(), p.clone(), s.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |_req| {
                        let (n, p, s) = (n.clone(), p.clone(), s.clone());
                        async move {
                            let c = n.fetch_add(1, Ordering::SeqCst) + 1;
                            p.fetch_max(c, Ordering::SeqCst);
                            tokio::time::sleep(delay).await;
                            // Counted out before the response leaves: the proxy's slot is
                            // released only after the body reached it, so the upstream
                            // can only under-count sluice's holders, never over-count.
                            n.fetch_sub(1, Ordering::SeqCst);
                            s.fetch_add(1, Ordering::SeqCst);
                            Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from("ok"))))
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Counting {
            addr,
            peak,
            served,
            task,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }
}

impl Drop for Counting {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `senders` concurrent senders spread over `proxies`, `each` requests apiece; returns
/// the statuses and `X-Sluice-Reason`s seen (bounded: every request has a 30 s timeout).
async fn load(
    proxies: &[SocketAddr],
    up: &Counting,
    ep: &str,
    senders: usize,
    each: usize,
) -> Vec<(u16, String)> {
    let mut tasks = Vec::new();
    for i in 0..senders {
        let c = client(proxies[i % proxies.len()]);
        let (url, ep) = (up.url(&format!("/{i}")), ep.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for _ in 0..each {
                let r = c
                    .get(&url)
                    .header("x-endpoint-id", &ep)
                    .send()
                    .await
                    .unwrap();
                let reason = r
                    .headers()
                    .get("x-sluice-reason")
                    .map(|v| v.to_str().unwrap().to_owned())
                    .unwrap_or_default();
                out.push((r.status().as_u16(), reason));
                r.bytes().await.unwrap();
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

const POLICY: &str =
    "[defaults]\nrate = 1000.0\nburst = 1000.0\nmax_wait = \"30s\"\nmax_in_flight = 3\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_never_exceeds_max_in_flight() {
    let sluice = common::sluice(POLICY).await;
    let up = Counting::start(Duration::from_millis(40)).await;
    let results = load(&[sluice.proxy_addr], &up, "c1", 24, 5).await;
    assert!(results.iter().all(|(s, _)| *s == 200), "{results:?}");
    assert_eq!(up.served.load(Ordering::SeqCst), 24 * 5);
    eprintln!("one replica: peak in flight {} (limit 3)", up.peak());
    assert!(up.peak() <= 3, "peak {} in flight", up.peak());
    assert_eq!(up.peak(), 3, "slots are used (work-conserving)");
    // Every slot is given back: the waiting room and the gauge empty out.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !sluice.app.limiter.gates().is_empty() {
        assert!(Instant::now() < deadline, "slots never released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sluice.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_on_one_redis_never_exceed_max_in_flight() {
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
    let up = Counting::start(Duration::from_millis(40)).await;
    let started = Instant::now();
    let results = load(&proxies, &up, "c3", 24, 5).await;
    let took = started.elapsed();
    assert!(results.iter().all(|(s, _)| *s == 200), "{results:?}");
    assert_eq!(up.served.load(Ordering::SeqCst), 24 * 5);
    eprintln!(
        "3 replicas / 1 Redis: peak in flight {} (limit 3), 120 requests of 40 ms in {:.2}s (ideal {:.2}s)",
        up.peak(),
        took.as_secs_f64(),
        120.0 * 0.040 / 3.0
    );
    assert!(up.peak() <= 3, "peak {} in flight", up.peak());
    // Leases are all given back.
    let key = "sluice:{c3}:leases";
    common::redis::wait_until("leases released", Duration::from_secs(5), || {
        redis.cli(&["ZCARD", key]).as_deref() == Some("0")
    });
    for r in rs {
        r.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_wait_past_max_wait_is_refused_as_concurrency_limited() {
    let sluice = common::sluice(
        "[defaults]\nrate = 1000.0\nburst = 1000.0\nmax_wait = \"200ms\"\nmax_in_flight = 1\n",
    )
    .await;
    let up = Counting::start(Duration::from_millis(1500)).await;
    let results = load(&[sluice.proxy_addr], &up, "c4", 2, 1).await;
    let refused: Vec<_> = results.iter().filter(|(s, _)| *s == 503).collect();
    assert_eq!(refused.len(), 1, "{results:?}");
    assert_eq!(refused[0].1, "concurrency_limited");
    assert_eq!(up.served.load(Ordering::SeqCst), 1);
    sluice.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_renewed_while_a_request_runs() {
    // Each request takes 2.2 s, over twice the 1 s lease (the shortest `check` takes):
    // only renewal keeps it held.
    let sluice = common::sluice(
        "[defaults]\nrate = 1000.0\nburst = 1000.0\nmax_wait = \"10s\"\nmax_in_flight = 1\nlease_ttl = \"1s\"\n",
    )
    .await;
    let up = Counting::start(Duration::from_millis(2200)).await;
    let results = load(&[sluice.proxy_addr], &up, "c5", 2, 1).await;
    assert!(results.iter().all(|(s, _)| *s == 200), "{results:?}");
    assert_eq!(up.peak(), 1, "a renewed lease is never taken over");
    sluice.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_replicas_slots_return_within_the_lease_ttl() {
    use sluice::config::{Backend, OnError, Policy, StoreConfig};
    use sluice::limiter::redis::RedisStore;
    use sluice::limiter::{Ask, BucketStore, LeaseAsk, Leased, Outcome, StoreStats};

    let redis = common::redis::RedisServer::start();
    let ttl = Duration::from_secs(1);
    // The "crashed" replica: its store takes both slots, then it is gone — no release,
    // no renewal (exactly what a killed process leaves behind).
    {
        let cfg = StoreConfig {
            backend: Backend::Redis,
            urls: vec![redis.url()],
            key_prefix: "sluice:".into(),
            timeout: Duration::from_millis(500),
            on_error: OnError::Deny,
            ..StoreConfig::default()
        };
        let crashed = RedisStore::connect(&cfg, StoreStats::default())
            .await
            .unwrap();
        let p = Policy {
            rate: 1000.0,
            burst: 1000.0,
            ..Policy::default()
        };
        for id in 0..2 {
            let lease = LeaseAsk {
                id,
                max: 2,
                ttl_us: ttl.as_secs_f64() * 1e6,
            };
            let got = crashed
                .acquire_leased("crash", Ask::new(&p, 0.0, None), lease)
                .await
                .unwrap();
            assert!(
                matches!(got, Leased::Took(Outcome::Granted { .. })),
                "{got:?}"
            );
        }
    }
    let crashed_at = Instant::now();
    let sluice = common::sluice(&format!(
        "[store]\nbackend = \"redis\"\nurls = [\"{}\"]\n[defaults]\nrate = 1000.0\nburst = 1000.0\nmax_wait = \"5s\"\nmax_in_flight = 2\nlease_ttl = \"1s\"\n",
        redis.url()
    ))
    .await;
    let up = Counting::start(Duration::ZERO).await;
    let results = load(&[sluice.proxy_addr], &up, "crash", 1, 1).await;
    let back = crashed_at.elapsed();
    assert_eq!(results[0].0, 200, "{results:?}");
    eprintln!(
        "crashed replica's slots back after {:.0} ms (lease_ttl 1 s)",
        back.as_secs_f64() * 1e3
    );
    // Not before the leases expire, and within the ttl plus one poll (100 ms) and slack.
    assert!(back >= ttl - Duration::from_millis(50), "{back:?}");
    assert!(back <= ttl + Duration::from_millis(400), "{back:?}");
    sluice.stop().await;
}

/// A sender that gives up while its request is at the receiver (a client timeout, the
/// common webhook pattern) does not free the request's slot: the receiver is still
/// working on it. A slot that went with the sender's connection would let each round
/// of senders timing out put `max_in_flight` more requests on the receiver at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_that_gives_up_keeps_its_slot_until_the_receiver_answers() {
    use tokio::io::AsyncWriteExt;
    const HOLD: Duration = Duration::from_millis(1500);
    let up = common::Upstream::with(Arc::new(|_: &common::Arrival| {
        common::Reply::ok().delay(HOLD)
    }))
    .await;
    let s = common::sluice(
        "[defaults]\nrate = 1000.0\nburst = 1000.0\nmax_wait = \"10s\"\nmax_in_flight = 2\n",
    )
    .await;
    // `keep-alive` is the lane's; a `Connection` naming a header is hyper's.
    for connection in ["keep-alive", "x-hop"] {
        let mut gone = Vec::new();
        for i in 0..2 {
            let mut t = tokio::net::TcpStream::connect(s.proxy_addr).await.unwrap();
            let head = format!(
                "GET http://{a}/{connection}/left/{i} HTTP/1.1\r\nHost: {a}\r\nConnection: {connection}\r\n\r\n",
                a = up.addr
            );
            t.write_all(head.as_bytes()).await.unwrap();
            gone.push(t);
        }
        let left = format!("/{connection}/left/");
        common::wait_for(
            "both requests at the receiver",
            Duration::from_secs(5),
            || {
                let n = up
                    .arrivals()
                    .iter()
                    .filter(|a| a.path.starts_with(&left))
                    .count();
                std::future::ready(n == 2)
            },
        )
        .await;
        // Their senders give up.
        drop(gone);
        let next: Vec<_> = (0..2)
            .map(|i| {
                let (c, url) = (
                    client(s.proxy_addr),
                    up.url(&format!("/{connection}/next/{i}")),
                );
                tokio::spawn(async move { c.get(&url).send().await.unwrap().status().as_u16() })
            })
            .collect();
        for n in next {
            assert_eq!(n.await.unwrap(), 200);
        }
    }
    // The receiver holds each request HOLD from its arrival.
    let arrivals = up.arrivals();
    for a in &arrivals {
        let at_once: Vec<&str> = arrivals
            .iter()
            .filter(|b| b.at <= a.at && a.at < b.at + HOLD)
            .map(|b| b.path.as_str())
            .collect();
        assert!(at_once.len() <= 2, "at the receiver at once: {at_once:?}");
    }
    s.stop().await;
}

/// A sender that leaves after the response head (an HTTP/2 stream reset, a client that
/// reads the status and hangs up) does not free the slot while the receiver is still
/// sending the body: sluice reads the rest and throws it away, holding the slot. A slot
/// that went with the sender would let a sender resetting each stream after its head
/// put 12 requests at a receiver whose `max_in_flight` is 2 on hyper's path; on the
/// lane, a first failed write that closed the upstream connection and freed the slot
/// would put 5 there at once. Each request occupies
/// this receiver from its arrival until its body's last byte is written, `HOLD` later,
/// a byte every tenth of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_that_leaves_after_the_head_keeps_its_slot_until_the_body_ends() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const HOLD: Duration = Duration::from_millis(1200);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Arc<std::sync::Mutex<Vec<(String, Instant)>>> = Arc::default();
    let log = Arc::clone(&seen);
    let server = tokio::spawn(async move {
        while let Ok((mut c, _)) = listener.accept().await {
            let log = Arc::clone(&log);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&head).into_owned();
                let path = text.split(' ').nth(1).unwrap_or("").to_owned();
                log.lock().unwrap().push((path, Instant::now()));
                // The head and "ok" at once, then a byte every 100 ms, then "ok".
                let start = b"HTTP/1.1 200 OK\r\nContent-Length: 16\r\nConnection: close\r\n\r\nok";
                if c.write_all(start).await.is_err() {
                    return;
                }
                for _ in 0..12 {
                    tokio::time::sleep(HOLD / 12).await;
                    if c.write_all(b"x").await.is_err() {
                        return;
                    }
                }
                let _ = c.write_all(b"ok").await;
            });
        }
    });
    let s = common::sluice(
        "[defaults]\nrate = 1000.0\nburst = 1000.0\nmax_wait = \"10s\"\nmax_in_flight = 2\n",
    )
    .await;
    // `keep-alive` is the lane's; a `Connection` naming a header is hyper's.
    for connection in ["keep-alive", "x-hop"] {
        let send = |path: String| {
            let proxy = s.proxy_addr;
            async move {
                let mut t = tokio::net::TcpStream::connect(proxy).await.unwrap();
                let head = format!(
                    "GET http://{addr}{path} HTTP/1.1\r\nHost: {addr}\r\nConnection: {connection}\r\n\r\n"
                );
                t.write_all(head.as_bytes()).await.unwrap();
                t
            }
        };
        // Two senders read the head, then leave.
        let mut left = Vec::new();
        for i in 0..2 {
            let mut t = send(format!("/{connection}/left/{i}")).await;
            let mut buf = [0u8; 256];
            let n = tokio::time::timeout(Duration::from_secs(5), t.read(&mut buf))
                .await
                .expect("a head")
                .unwrap();
            assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
            left.push(t);
        }
        drop(left);
        // Two more, read whole.
        let mut next = Vec::new();
        for i in 0..2 {
            let mut t = send(format!("/{connection}/next/{i}")).await;
            next.push(tokio::spawn(async move {
                let mut all = Vec::new();
                let mut buf = [0u8; 256];
                let reading = async {
                    while !all.ends_with(b"xok") {
                        match t.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => all.extend_from_slice(&buf[..n]),
                        }
                    }
                };
                let _ = tokio::time::timeout(Duration::from_secs(10), reading).await;
                String::from_utf8_lossy(&all).into_owned()
            }));
        }
        for n in next {
            let r = n.await.unwrap();
            assert!(
                r.starts_with("HTTP/1.1 200") && r.ends_with("okxxxxxxxxxxxxok"),
                "{r}"
            );
        }
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 8);
    for (path, at) in &seen {
        let at_once: Vec<&str> = seen
            .iter()
            .filter(|(_, b)| *b <= *at && *at < *b + HOLD)
            .map(|(p, _)| p.as_str())
            .collect();
        assert!(
            at_once.len() <= 2,
            "with {path}, at the receiver at once: {at_once:?}"
        );
    }
    server.abort();
    s.stop().await;
}

/// A lease that vanishes from Redis while its request runs (evicted, deleted, lost with
/// a restart) is counted again at its next renewal. A renewal that only warned would let
/// the endpoint see one request more than `max_in_flight` for as long as the request
/// ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_gone_from_redis_is_counted_again_at_its_renewal() {
    let redis = common::redis::RedisServer::start();
    let sluice = common::sluice(&format!(
        "[store]\nbackend = \"redis\"\nurls = [\"{}\"]\n[defaults]\nrate = 1000.0\nburst = 1000.0\nmax_wait = \"10s\"\nmax_in_flight = 2\nlease_ttl = \"1s\"\n",
        redis.url()
    ))
    .await;
    let up = Counting::start(Duration::from_secs(4)).await;
    let proxy = sluice.proxy_addr;
    let long = tokio::spawn({
        let url = up.url("/long");
        async move {
            let c = client(proxy);
            let send = |i: usize| {
                c.get(format!("{url}/{i}"))
                    .header("x-endpoint-id", "gone")
                    .send()
            };
            let (a, b) = tokio::join!(send(0), send(1));
            (a.unwrap().status().as_u16(), b.unwrap().status().as_u16())
        }
    });
    let key = "sluice:{gone}:leases";
    let card = |r: &common::redis::RedisServer| {
        r.cli(&["ZCARD", key])
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    common::wait_for("both leases taken", Duration::from_secs(5), || async {
        card(&redis) == 2
    })
    .await;
    redis.cli(&["DEL", key]).unwrap();
    // Renewed every lease_ttl/3: both come back.
    common::wait_for(
        "both leases counted again",
        Duration::from_secs(5),
        || async { card(&redis) == 2 },
    )
    .await;
    // A third sender waits for a slot: it gets one when a long request ends, not now.
    let r = client(proxy)
        .get(up.url("/third"))
        .header("x-endpoint-id", "gone")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(long.await.unwrap(), (200, 200));
    assert_eq!(
        up.peak(),
        2,
        "never more than max_in_flight at the receiver"
    );
    sluice.stop().await;
}

/// `max_in_flight` on a Redis Cluster with one master dead: a replica whose calls for
/// an endpoint on that node failed keeps the shared lease set of an endpoint on a live
/// node, so two replicas saturating it hold at most `max_in_flight` there between them.
/// A whole-store fallback would have the first replica take that endpoint's slots
/// locally too (its share, 1 of 2) beside the 2 the other takes in the shared set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_cluster_master_leaves_the_live_endpoints_leases_shared() {
    let mut cluster = common::redis::RedisCluster::start_partial();
    let seeds: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let cfg = format!(
        "[store]\nbackend = \"redis-cluster\"\nurls = [{}]\ntimeout = \"200ms\"\non_error = \"local\"\n\
         [defaults]\nrate = 1000.0\nburst = 1000.0\nmax_wait = \"30s\"\nmax_in_flight = 2\n",
        seeds.join(", ")
    );
    let rs = [common::sluice(&cfg).await, common::sluice(&cfg).await];
    let dead = cluster.nodes[0].port();
    let (on_dead, on_live) = (cluster.endpoint(dead, true), cluster.endpoint(dead, false));
    // Both replicas count two (each local share would be 1 slot).
    common::until_all_count(&rs, 2).await;
    cluster.nodes[0].kill();
    // The first replica asks the dead node (and falls back for that endpoint).
    let other = Counting::start(Duration::from_millis(1)).await;
    let r = load(&[rs[0].proxy_addr], &other, &on_dead, 1, 1).await;
    assert_eq!(r, [(200, String::new())], "served by the local fallback");
    let up = Counting::start(Duration::from_millis(60)).await;
    let proxies: Vec<SocketAddr> = rs.iter().map(|r| r.proxy_addr).collect();
    let results = load(&proxies, &up, &on_live, 12, 5).await;
    assert!(results.iter().all(|(s, _)| *s == 200), "{results:?}");
    eprintln!(
        "one master dead: peak in flight on a live endpoint {} (limit 2)",
        up.peak()
    );
    assert!(up.peak() <= 2, "peak {} in flight", up.peak());
    for r in rs {
        r.stop().await;
    }
}
