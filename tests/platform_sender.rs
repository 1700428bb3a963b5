//! A webhook platform's worker, simulated as self-hosted Svix behaves behind a proxy: it
//! sends every message through a CONNECT tunnel (`http://` endpoints too), keeps its
//! tunnels for the next messages to the same receiver, sends POSTs with the message ID
//! in `svix-id`, gives up on a request after 30 s and counts any non-2xx answer as a
//! spent attempt, retried on its own schedule (5 s, then 5 min, ...).
//!
//! Behind sluice every message must be paced per request inside the reused tunnels (each
//! receiver within `rate·W + burst`), arrive exactly once, never be pushed to the
//! platform's retry while its wait budget allows, and a receiver's 429 must be absorbed
//! (the platform sees one 200). scripts/e2e-svix runs the real Svix the same way.

mod common;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use common::tls::{TestPki, TlsUpstream};
use common::{Arrival, Reply, Upstream, assert_within_bound};

/// Svix's worker gives up on a request after this (`worker_request_timeout`, 30 s).
const PLATFORM_TIMEOUT: Duration = Duration::from_secs(30);

/// One receiver as the platform knows it: where, and over which scheme.
#[derive(Clone)]
struct Receiver {
    /// The CONNECT authority.
    authority: String,
    /// TLS inside the tunnel (an `https://` endpoint), trusting sluice's CA.
    tls: bool,
}

/// What the platform saw.
#[derive(Default)]
struct Ledger {
    /// Message IDs answered 2xx, with the `X-Sluice-Retried` they carried.
    delivered: Mutex<Vec<(String, Option<String>)>>,
    /// Attempts the platform would retry later (non-2xx, timeout, connection error).
    failed: Mutex<Vec<String>>,
    /// CONNECT tunnels the platform opened.
    tunnels: AtomicUsize,
}

/// Opens a CONNECT tunnel to `to` through the proxy, TLS inside when asked, and an
/// HTTP/1.1 client connection over it.
async fn open(proxy: SocketAddr, to: &Receiver, ca: &std::path::Path) -> SendRequest<Full<Bytes>> {
    let mut tcp = TcpStream::connect(proxy).await.unwrap();
    let connect = format!("CONNECT {0} HTTP/1.1\r\nHost: {0}\r\n\r\n", to.authority);
    tcp.write_all(connect.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        assert_eq!(tcp.read(&mut b).await.unwrap(), 1, "{head:?}");
        head.push(b[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&head)
    );
    if !to.tls {
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .unwrap();
        tokio::spawn(conn);
        return send;
    }
    let cfg = common::tls::http11_client(ca);
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(name, tcp)
        .await
        .unwrap();
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    send
}

/// One worker: takes messages off the shared queue and sends each through its tunnel to
/// that receiver (opened once, reused), the way the platform's worker does.
async fn worker(
    proxy: SocketAddr,
    ca: Arc<std::path::PathBuf>,
    queue: Arc<Mutex<Vec<(String, Receiver)>>>,
    ledger: Arc<Ledger>,
) {
    let mut tunnels: HashMap<String, SendRequest<Full<Bytes>>> = HashMap::new();
    loop {
        let Some((id, to)) = queue.lock().unwrap().pop() else {
            return;
        };
        let usable = tunnels.get(&to.authority).is_some_and(|s| !s.is_closed());
        if !usable {
            tunnels.insert(to.authority.clone(), open(proxy, &to, &ca).await);
            ledger.tunnels.fetch_add(1, Ordering::Relaxed);
        }
        let send = tunnels.get_mut(&to.authority).unwrap();
        let body = format!("{{\"type\":\"invoice.paid\",\"id\":\"{id}\"}}");
        let req = Request::post("/webhook")
            .header("host", &to.authority)
            .header("content-type", "application/json")
            .header("svix-id", &id)
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let sending = async {
            send.ready().await?;
            let resp = send.send_request(req).await?;
            let retried = resp
                .headers()
                .get("x-sluice-retried")
                .map(|v| v.to_str().unwrap().to_owned());
            let status = resp.status();
            resp.into_body().collect().await?;
            Ok::<_, hyper::Error>((status, retried))
        };
        match tokio::time::timeout(PLATFORM_TIMEOUT, sending).await {
            Ok(Ok((status, retried))) if status.is_success() => {
                ledger.delivered.lock().unwrap().push((id, retried));
            }
            _ => {
                ledger.failed.lock().unwrap().push(id);
                tunnels.remove(&to.authority);
            }
        }
    }
}

/// Arrival times of `arrivals`, and the message IDs that arrived more than once.
fn times_and_twice(arrivals: &[Arrival]) -> (Vec<Instant>, Vec<String>) {
    let mut seen = HashSet::new();
    let mut twice = Vec::new();
    for a in arrivals {
        let id = a.headers["svix-id"].to_str().unwrap().to_owned();
        if !seen.insert(id.clone()) {
            twice.push(id);
        }
    }
    (arrivals.iter().map(|a| a.at).collect(), twice)
}

#[tokio::test]
async fn a_platform_worker_behind_sluice_is_paced_per_message() {
    // A: http://, 5/s. B: http://, 10/s, answers its 10th request 429 + Retry-After: 1.
    // C: https://, 5/s. 20 messages each, all sent at once by 16 workers.
    let a = Upstream::start().await;
    let b_seen = Arc::new(AtomicUsize::new(0));
    let b = {
        let seen = Arc::clone(&b_seen);
        Upstream::with(Arc::new(move |_: &Arrival| {
            if seen.fetch_add(1, Ordering::SeqCst) == 9 {
                Reply::status(429).header("Retry-After", "1")
            } else {
                Reply::ok()
            }
        }))
        .await
    };
    let pki = TestPki::new(&["localhost"]);
    let c = TlsUpstream::ok(&pki).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = sluice::tls::generate_ca(&dir.path().join("ca")).unwrap();
    let upstream_ca = pki.write_ca(dir.path());
    let cfg = format!(
        "[tls]\nintercept = true\nca_cert = \"{}\"\nca_key = \"{}\"\nupstream_roots = [\"{}\"]\n\
         [defaults]\nmax_wait = \"20s\"\n\
         [[endpoints]]\nid = \"a\"\nrate = 5.0\nburst = 2.0\nmax_wait = \"20s\"\nabsorb_post = true\nhosts = [\"127.0.0.1:{}\"]\n\
         [[endpoints]]\nid = \"b\"\nrate = 10.0\nburst = 2.0\nmax_wait = \"20s\"\nabsorb_post = true\nhosts = [\"127.0.0.1:{}\"]\n\
         [[endpoints]]\nid = \"c\"\nrate = 5.0\nburst = 2.0\nmax_wait = \"20s\"\nabsorb_post = true\nhosts = [\"localhost:{}\"]\n",
        ca.cert.display(),
        dir.path().join("ca/ca.key").display(),
        upstream_ca.display(),
        a.addr.port(),
        b.addr.port(),
        c.addr.port(),
    );
    let s = common::sluice(&cfg).await;
    let receivers = [
        Receiver {
            authority: a.addr.to_string(),
            tls: false,
        },
        Receiver {
            authority: b.addr.to_string(),
            tls: false,
        },
        Receiver {
            authority: format!("localhost:{}", c.addr.port()),
            tls: true,
        },
    ];
    let mut messages = Vec::new();
    for i in 0..20 {
        for (r, to) in receivers.iter().enumerate() {
            messages.push((format!("msg_{r}_{i}"), to.clone()));
        }
    }
    messages.reverse();
    let queue = Arc::new(Mutex::new(messages));
    let ledger = Arc::new(Ledger::default());
    let ca_path = Arc::new(ca.cert.clone());
    let started = Instant::now();
    let workers: Vec<_> = (0..16)
        .map(|_| {
            let (q, l, ca) = (
                Arc::clone(&queue),
                Arc::clone(&ledger),
                Arc::clone(&ca_path),
            );
            tokio::spawn(worker(s.proxy_addr, ca, q, l))
        })
        .collect();
    for w in workers {
        tokio::time::timeout(Duration::from_secs(60), w)
            .await
            .expect("every message answered within 60 s")
            .unwrap();
    }
    let took = started.elapsed().as_secs_f64();
    let failed = ledger.failed.lock().unwrap().clone();
    assert!(
        failed.is_empty(),
        "pushed to the platform's retry: {failed:?}"
    );
    let delivered = ledger.delivered.lock().unwrap().clone();
    assert_eq!(delivered.len(), 60);
    let absorbed: Vec<_> = delivered.iter().filter(|(_, r)| r.is_some()).collect();
    assert_eq!(absorbed.len(), 1, "the one 429, absorbed: {absorbed:?}");
    let tunnels = ledger.tunnels.load(Ordering::Relaxed);
    assert!(
        tunnels < 60,
        "{tunnels} tunnels for 60 messages: tunnels are reused"
    );

    let (times_a, twice_a) = times_and_twice(&a.arrivals());
    let (times_b, twice_b) = times_and_twice(&b.arrivals());
    let (times_c, twice_c) = times_and_twice(&c.arrivals());
    assert!(
        twice_a.is_empty() && twice_c.is_empty(),
        "{twice_a:?} {twice_c:?}"
    );
    assert_eq!(
        twice_b,
        vec![absorbed[0].0.clone()],
        "only the refused message came twice"
    );
    assert_eq!((times_a.len(), times_b.len(), times_c.len()), (20, 21, 20));
    // 50 ms of delivery jitter on loopback (TLS adds a record's worth on C).
    assert_within_bound(&times_a, 5.0, 2.0, 0.05);
    assert_within_bound(&times_b, 10.0, 2.0, 0.05);
    assert_within_bound(&times_c, 5.0, 2.0, 0.05);
    // The ideal is A's and C's (20 - 2) / 5 = 3.6 s.
    eprintln!("60 messages in {took:.2} s through {tunnels} tunnels (ideal 3.6 s)");
    assert!(
        took < 3.6 * 1.25,
        "took {took:.2} s: the allowed rate went unused"
    );
    s.stop().await;
}
