//! A sender gone before the answer's head, on hyper's path (HTTP/1.0 senders, odd
//! `Connection` headers, HTTP/2 in intercepted tunnels): the slot stays the receiver's
//! until the body ends, as on the lane. A slot that went at the head would put 4 in
//! flight where `max_in_flight = 2`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;

/// What the receiver saw: each request's path, when it arrived, when its answer ended.
type Seen = Arc<std::sync::Mutex<Vec<(String, Instant, Instant)>>>;

/// The receiver answers a request [`THINK`] after its arrival, then sends the body a
/// byte every tenth of [`HOLD`]: it is at work from the arrival until `THINK + HOLD`.
const THINK: Duration = Duration::from_millis(400);
const HOLD: Duration = Duration::from_millis(1200);

/// Reads one request head on `c` and answers it slowly (see [`THINK`]), logging it.
async fn slow_answer<C: AsyncRead + AsyncWrite + Unpin>(mut c: C, log: Seen) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match c.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let arrived = Instant::now();
    let text = String::from_utf8_lossy(&head).into_owned();
    let path = text.split(' ').nth(1).unwrap_or("").to_owned();
    tokio::time::sleep(THINK).await;
    let start = b"HTTP/1.1 200 OK\r\nContent-Length: 14\r\nConnection: close\r\n\r\nok";
    let mut ok = c.write_all(start).await.is_ok() && c.flush().await.is_ok();
    for _ in 0..10 {
        if !ok {
            break;
        }
        tokio::time::sleep(HOLD / 10).await;
        ok = c.write_all(b"x").await.is_ok() && c.flush().await.is_ok();
    }
    if ok {
        let _ = c.write_all(b"ok").await;
        let _ = c.flush().await;
    }
    log.lock().unwrap().push((path, arrived, Instant::now()));
}

/// A sender that leaves after its request reached the receiver and *before* the
/// response head (an HTTP/2 stream reset, a client timeout, a closed HTTP/1.0 or
/// hyper-path HTTP/1.1 connection) must not free the `max_in_flight` slot while the
/// receiver is still sending the body: SPEC "Concurrency" (a request holds its slot
/// until its response body ends; a sender that leaves before the body ends does not
/// free it). The lane keeps the slot (it drains the body when its write to the gone
/// sender fails); hyper's path dropped the exchange's output when the head arrived, so
/// the slot went at the head and the upstream connection was closed mid-body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_that_leaves_before_the_head_keeps_its_slot_until_the_body_ends() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let log = Arc::clone(&seen);
    let server = tokio::spawn(async move {
        while let Ok((c, _)) = listener.accept().await {
            tokio::spawn(slow_answer(c, Arc::clone(&log)));
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
        // Two senders give up before the answer's head.
        let mut left = Vec::new();
        for i in 0..2 {
            left.push(send(format!("/{connection}/left/{i}")).await);
        }
        // They give up a quarter of the receiver's think time in (a client timeout,
        // as the HTTP/2 test's), before the answer's head.
        tokio::time::sleep(THINK / 4).await;
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
                r.starts_with("HTTP/1.1 200") && r.ends_with("okxxxxxxxxxxok"),
                "{r}"
            );
        }
        // The receiver's handlers of the first two finish and log.
        let done = if connection == "keep-alive" { 4 } else { 8 };
        let log = Arc::clone(&seen);
        common::wait_for("the receiver's four answers", 3 * HOLD, || {
            let n = log.lock().unwrap().len();
            async move { n >= done }
        })
        .await;
    }
    let seen = seen.lock().unwrap().clone();
    eprintln!("{seen:#?}");
    assert_eq!(seen.len(), 8);
    for (path, at, _) in &seen {
        let at_once: Vec<&str> = seen
            .iter()
            .filter(|(_, b, end)| *b <= *at && *at < *end)
            .map(|(p, _, _)| p.as_str())
            .collect();
        assert!(
            at_once.len() <= 2,
            "with {path}, at the receiver at once (each counted until its last write): {at_once:?}"
        );
    }
    server.abort();
    s.stop().await;
}

/// The same over HTTP/2 inside an intercepted tunnel: each stream is reset by its
/// sender (a client timeout) after the request reached the receiver and before the
/// response head. With `max_in_flight = 2`, the next two streams must reach the
/// receiver only once the first two bodies ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_stream_reset_before_the_head_keeps_its_slot_until_the_body_ends() {
    use common::tls::TestPki;
    let dir = tempfile::tempdir().unwrap();
    let files = sluice::tls::generate_ca(&dir.path().join("ca")).unwrap();
    let pki = TestPki::new(&["localhost"]);
    let upstream_ca = pki.write_ca(dir.path());
    let acceptor = pki.acceptor();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Seen = Arc::default();
    let log = Arc::clone(&seen);
    let server = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (log, acceptor) = (Arc::clone(&log), acceptor.clone());
            tokio::spawn(async move {
                if let Ok(c) = acceptor.accept(tcp).await {
                    slow_answer(c, log).await;
                }
            });
        }
    });
    let s = common::sluice(&format!(
        "[defaults]\nrate = 1000.0\nburst = 1000.0\nmax_wait = \"10s\"\nmax_in_flight = 2\n\
         [tls]\nintercept = true\nca_cert = \"{}\"\nca_key = \"{}\"\nupstream_roots = [\"{}\"]\n",
        files.cert.display(),
        dir.path().join("ca/ca.key").display(),
        upstream_ca.display(),
    ))
    .await;
    let pem = std::fs::read(&files.cert).unwrap();
    let client = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
        .proxy(reqwest::Proxy::https(format!("http://{}", s.proxy_addr)).unwrap())
        .build()
        .unwrap();
    let url = |p: &str| format!("https://localhost:{port}{p}");
    // Warm the tunnel (its h2 connection) first.
    let r = client.get(url("/warm")).send().await.unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    let _ = r.bytes().await;
    let log = Arc::clone(&seen);
    common::wait_for("the warm-up's answer", 3 * HOLD, || {
        let n = log.lock().unwrap().len();
        async move { n >= 1 }
    })
    .await;
    // Two streams reset by their sender before the head.
    let mut left = Vec::new();
    for i in 0..2 {
        let req = client.get(url(&format!("/left/{i}"))).timeout(THINK / 4);
        left.push(tokio::spawn(async move { req.send().await.is_err() }));
    }
    for l in left {
        assert!(l.await.unwrap(), "the sender gave up");
    }
    let mut next = Vec::new();
    for i in 0..2 {
        let req = client.get(url(&format!("/next/{i}")));
        next.push(tokio::spawn(async move {
            let r = req.send().await.unwrap();
            r.text().await.unwrap()
        }));
    }
    for n in next {
        assert_eq!(n.await.unwrap(), "okxxxxxxxxxxok");
    }
    let log = Arc::clone(&seen);
    common::wait_for("the receiver's five answers", 3 * HOLD, || {
        let n = log.lock().unwrap().len();
        async move { n >= 5 }
    })
    .await;
    let seen = seen.lock().unwrap().clone();
    eprintln!("{seen:#?}");
    assert_eq!(seen.len(), 5);
    for (path, at, _) in &seen {
        let at_once: Vec<&str> = seen
            .iter()
            .filter(|(_, b, end)| *b <= *at && *at < *end)
            .map(|(p, _, _)| p.as_str())
            .collect();
        assert!(
            at_once.len() <= 2,
            "with {path}, at the receiver at once (each counted until its last write): {at_once:?}"
        );
    }
    server.abort();
    s.stop().await;
}
