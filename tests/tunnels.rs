//! CONNECT tunnels by what they carry: plain HTTP inside a tunnel is paced request by
//! request (with and without interception, tunnels reused as webhook platforms reuse
//! them), other bytes are relayed as they are (the client's first, or a server that
//! speaks first).

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use common::{Upstream, assert_within_bound, read_head, read_response, sluice};

/// Opens a CONNECT tunnel to `to` through sluice and reads its `200`.
async fn open_tunnel(proxy: SocketAddr, to: SocketAddr) -> TcpStream {
    let mut t = TcpStream::connect(proxy).await.unwrap();
    let connect = format!("CONNECT {to} HTTP/1.1\r\nHost: {to}\r\n\r\n");
    t.write_all(connect.as_bytes()).await.unwrap();
    let head = read_head(&mut t).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    t
}

/// `tunnels` tunnels, each sending `each` plain HTTP requests one after another (the
/// way a platform's worker reuses a pooled tunnel), all at once; every answer must be a
/// 200. Returns the arrival times at the receiver.
async fn send_through_tunnels(
    proxy: SocketAddr,
    up: &Upstream,
    tunnels: usize,
    each: usize,
) -> Vec<Instant> {
    let mut tasks = Vec::new();
    for k in 0..tunnels {
        let to = up.addr;
        tasks.push(tokio::spawn(async move {
            let mut t = open_tunnel(proxy, to).await;
            for i in 0..each {
                let body = format!("{{\"msg\":\"{k}-{i}\"}}");
                let req = format!(
                    "POST /hook/{k}-{i} HTTP/1.1\r\nHost: {to}\r\nX-Endpoint-Id: hook\r\n\
                     Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                t.write_all(req.as_bytes()).await.unwrap();
                let answer = read_response(&mut t).await;
                assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let arrivals = up.arrivals();
    let mut paths: Vec<_> = arrivals.iter().map(|a| a.path.clone()).collect();
    paths.sort();
    paths.dedup();
    assert_eq!(
        paths.len(),
        tunnels * each,
        "every message arrived exactly once"
    );
    assert_eq!(arrivals.len(), tunnels * each, "no message arrived twice");
    arrivals.iter().map(|a| a.at).collect()
}

const HOOK: &str = "[[endpoints]]\nid = \"hook\"\nrate = 5.0\nburst = 2.0\nmax_wait = \"25s\"\n";

/// The rate·W + burst bound holds over the messages of reused tunnels, and the rate is
/// used: 24 messages in 4 tunnels at 5/s, burst 2.
async fn paced_per_request(extra: &str) {
    let up = Upstream::start().await;
    let s = sluice(&format!("{HOOK}{extra}")).await;
    let started = Instant::now();
    let times = send_through_tunnels(s.proxy_addr, &up, 4, 6).await;
    let took = started.elapsed().as_secs_f64();
    // 50 ms of delivery jitter: sluice's send to the receiver's accept, on loopback.
    assert_within_bound(&times, 5.0, 2.0, 0.05);
    // The ideal: (24 - 2) / 5 = 4.4 s.
    eprintln!("24 messages in {took:.2} s (ideal 4.4 s)");
    assert!(took < 4.4 * 1.15, "took {took:.2} s: the rate went unused");
    s.stop().await;
}

#[tokio::test]
async fn plain_http_in_reused_tunnels_is_paced_per_request() {
    paced_per_request("").await;
}

/// The `[tls]` section turning interception on with a CA made in `dir`.
fn interception(dir: &tempfile::TempDir) -> String {
    let files = sluice::tls::generate_ca(&dir.path().join("ca")).unwrap();
    format!(
        "[tls]\nintercept = true\nca_cert = \"{}\"\nca_key = \"{}\"\n",
        files.cert.display(),
        dir.path().join("ca/ca.key").display()
    )
}

#[tokio::test]
async fn plain_http_in_reused_tunnels_is_paced_per_request_with_interception() {
    let dir = tempfile::tempdir().unwrap();
    paced_per_request(&interception(&dir)).await;
}

/// A receiver's 429 inside a tunnel starts the endpoint's cooldown: the tunnel's next
/// request waits it out (the receiver sees nothing during it).
#[tokio::test]
async fn a_429_inside_a_tunnel_cools_the_endpoint_down() {
    use common::Reply;
    use std::sync::Arc;
    let up = Upstream::with(Arc::new(|a: &common::Arrival| {
        if a.path == "/first" {
            Reply::status(429).header("Retry-After", "1")
        } else {
            Reply::ok()
        }
    }))
    .await;
    let cfg = format!("{HOOK}[defaults.adaptive]\nabsorb = \"off\"\n");
    let s = sluice(&cfg).await;
    let mut t = open_tunnel(s.proxy_addr, up.addr).await;
    for path in ["/first", "/second"] {
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\nX-Endpoint-Id: hook\r\n\r\n",
            up.addr
        );
        t.write_all(req.as_bytes()).await.unwrap();
        read_response(&mut t).await;
    }
    let a = up.arrivals();
    assert_eq!(a.len(), 2);
    let gap = a[1].at - a[0].at;
    assert!(
        gap >= Duration::from_secs(1),
        "second request {gap:?} after the 429"
    );
    s.stop().await;
}

/// Bytes that are neither TLS nor HTTP are relayed as they are, and so are the bytes
/// of a server that speaks first.
#[tokio::test]
async fn other_bytes_are_relayed_as_they_are() {
    let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let echo_addr = echo.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = echo.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = c.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    let banner = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let banner_addr = banner.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = banner.accept().await {
            tokio::spawn(async move {
                let _ = c.write_all(b"220 ready\r\n").await;
                let mut b = [0u8; 64];
                let _ = c.read(&mut b).await;
            });
        }
    });
    let dir = tempfile::tempdir().unwrap();
    // With interception the sender speaks first (a TLS handshake is awaited); without,
    // the server may.
    for (extra, server_first) in [("".to_string(), true), (interception(&dir), false)] {
        let s = sluice(&extra).await;
        let mut t = open_tunnel(s.proxy_addr, echo_addr).await;
        t.write_all(b"SSH-2.0-test\r\n").await.unwrap();
        let mut got = [0u8; 14];
        tokio::time::timeout(Duration::from_secs(5), t.read_exact(&mut got))
            .await
            .expect("echo within 5 s")
            .unwrap();
        assert_eq!(&got, b"SSH-2.0-test\r\n");
        if !server_first {
            drop(t);
            s.stop().await;
            continue;
        }
        let mut t = open_tunnel(s.proxy_addr, banner_addr).await;
        let mut got = [0u8; 11];
        tokio::time::timeout(Duration::from_secs(5), t.read_exact(&mut got))
            .await
            .expect("banner within 5 s")
            .unwrap();
        assert_eq!(&got, b"220 ready\r\n");
        drop(t);
        s.stop().await;
    }
}

/// A non-intercepted CONNECT is admitted before its `200`; when its tunnel carries
/// nothing within the grant's time (a pooled tunnel its sender did not use yet), the
/// token goes back for other requests, and the tunnel's first request, when it comes,
/// is admitted on its own.
#[tokio::test]
async fn a_silent_tunnel_gives_its_token_back() {
    let up = Upstream::start().await;
    let s = sluice("[defaults]\nrate = 0.1\nburst = 1.0\nmax_wait = \"0s\"\n").await;
    let mut silent = open_tunnel(s.proxy_addr, up.addr).await;
    let id = up.addr.ip().to_string();
    common::wait_for("the token back", Duration::from_secs(5), || async {
        common::tokens(s.admin_addr, &id)
            .await
            .is_some_and(|t| t > 0.9)
    })
    .await;
    // The token went to another sender's request...
    let r = common::client(s.proxy_addr)
        .get(up.url("/other"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // ...so the tunnel's late first request finds none.
    let req = format!("GET /late HTTP/1.1\r\nHost: {}\r\n\r\n", up.addr);
    silent.write_all(req.as_bytes()).await.unwrap();
    let answer = read_response(&mut silent).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert_eq!(up.count(), 1);
    s.stop().await;
}
