//! Framing and codings on the wire, on both engines (the plain lane and hyper): what a
//! receiver's chunked answer becomes for the sender, and which request codings sluice
//! forwards.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use common::sluice;

/// `Connection` values that keep a request in the lane, and that hand it to hyper.
const BOTH_PATHS: [&str; 2] = ["keep-alive", "x-hop"];

/// A receiver on 127.0.0.1 that answers every request head with `answer`, then keeps
/// the connection until its peer closes.
async fn raw_receiver(answer: &'static [u8]) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                    if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        got.drain(..end + 4);
                        if s.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, task)
}

/// Sends `GET http://{up}/` with `Connection: connection` and reads until `done` holds
/// for what came, the peer closes, or 5 s pass: what came, and whether `done` held.
async fn exchange(
    proxy: SocketAddr,
    up: SocketAddr,
    connection: &str,
    done: impl Fn(&[u8]) -> bool,
) -> (String, bool) {
    let mut t = TcpStream::connect(proxy).await.unwrap();
    let req =
        format!("GET http://{up}/ HTTP/1.1\r\nHost: {up}\r\nConnection: {connection}\r\n\r\n");
    t.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while !done(&got) {
            match t.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let whole = done(&got);
    (String::from_utf8_lossy(&got).into_owned(), whole)
}

/// The chunk-size lines of a chunked response as the sender read it (the lines after
/// the head that open a chunk).
fn size_lines(response: &str) -> Vec<String> {
    let Some((_, mut body)) = response.split_once("\r\n\r\n") else {
        return Vec::new();
    };
    let mut sizes = Vec::new();
    while let Some((line, rest)) = body.split_once("\r\n") {
        sizes.push(line.to_owned());
        let digits = line.split([';', ' ', '\t']).next().unwrap_or("");
        let Ok(n) = usize::from_str_radix(digits, 16) else {
            break;
        };
        if n == 0 || rest.len() < n + 2 {
            break;
        }
        body = &rest[n + 2..];
    }
    sizes
}

/// A chunk size of more than 16 hex digits (leading zeros included) never reaches the
/// sender: Go's net/http, the usual webhook sender, refuses such a line and fails the
/// request. The lane cuts the answer, as other malformed framing; hyper's path decodes the
/// size and writes it anew (`2`), so its sender reads the whole body.
#[tokio::test]
async fn chunk_sizes_over_16_digits_never_reach_the_sender() {
    let answers: [&'static [u8]; 2] = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n00000000000000002\r\nhi\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n00000000000000000000000000000002\r\nhi\r\n0\r\n\r\n",
    ];
    let s = sluice("").await;
    for answer in answers {
        let (up, _task) = raw_receiver(answer).await;
        for connection in BOTH_PATHS {
            let (r, whole) = exchange(s.proxy_addr, up, connection, |got| {
                got.ends_with(b"0\r\n\r\n")
            })
            .await;
            let sizes = size_lines(&r);
            assert!(
                sizes.iter().all(|l| l.len() <= 16),
                "{connection}: size lines {sizes:?} in {r:?}"
            );
            if connection == "x-hop" {
                assert!(whole, "{connection}: {r:?}");
                assert!(
                    r.ends_with("\r\n2\r\nhi\r\n0\r\n\r\n"),
                    "{connection}: {r:?}"
                );
            }
        }
    }
    // Sixteen digits are still relayed as they came.
    let (up, _task) = raw_receiver(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0000000000000002\r\nhi\r\n0\r\n\r\n",
    )
    .await;
    let (r, whole) = exchange(s.proxy_addr, up, "keep-alive", |got| {
        got.ends_with(b"0\r\n\r\n")
    })
    .await;
    assert!(whole && r.ends_with("hi\r\n0\r\n\r\n"), "{r:?}");
    s.stop().await;
}

/// Sends raw `head` (then `body`) to the proxy on a new connection and reads one answer.
async fn send_raw(proxy: SocketAddr, head: &str, body: &[u8]) -> String {
    let mut t = TcpStream::connect(proxy).await.unwrap();
    t.write_all(head.as_bytes()).await.unwrap();
    // The proxy may answer before reading the body (a refusal from the head alone).
    let _ = t.write_all(body).await;
    common::read_response(&mut t).await
}

/// A request whose transfer codings are anything but a lone `chunked` (RFC 9112 §6.1) is
/// answered `501 not_implemented` before anything is spent or sent, on both engines: sluice
/// cannot forward `gzip` as a transfer coding, and dropping it would hand the receiver
/// compressed bytes as the body.
#[tokio::test]
async fn a_transfer_coding_other_than_chunked_is_501() {
    let up = common::Upstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    for connection in BOTH_PATHS {
        for coding in ["gzip, chunked", "deflate,chunked", "x-custom, chunked"] {
            let head = format!(
                "POST http://{host}/coded HTTP/1.1\r\nHost: {host}\r\nConnection: {connection}\r\n\
                 Transfer-Encoding: {coding}\r\n\r\n"
            );
            let r = send_raw(s.proxy_addr, &head, b"2\r\nhi\r\n0\r\n\r\n").await;
            let lower = r.to_ascii_lowercase();
            assert!(
                lower.starts_with("http/1.1 501"),
                "{connection} {coding}: {r}"
            );
            assert!(
                lower.contains("x-sluice-reason: not_implemented"),
                "{connection} {coding}: {r}"
            );
        }
        // A lone `chunked`, in any case, is forwarded.
        let head = format!(
            "POST http://{host}/chunked HTTP/1.1\r\nHost: {host}\r\nConnection: {connection}\r\n\
             Transfer-Encoding: Chunked\r\n\r\n"
        );
        let r = send_raw(s.proxy_addr, &head, b"2\r\nhi\r\n0\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{connection}: {r}");
    }
    let paths: Vec<String> = up.arrivals().into_iter().map(|a| a.path).collect();
    assert_eq!(paths, ["/chunked", "/chunked"]);
    s.stop().await;
}

/// A chunked body on a GET or HEAD reaches the receiver whole, as Squid forwards it, on
/// both engines.
#[tokio::test]
async fn a_chunked_body_on_get_or_head_is_forwarded() {
    let up = common::Upstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    for connection in BOTH_PATHS {
        for method in ["GET", "HEAD"] {
            let head = format!(
                "{method} http://{host}/{method} HTTP/1.1\r\nHost: {host}\r\nConnection: {connection}\r\n\
                 Transfer-Encoding: chunked\r\n\r\n"
            );
            let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
            t.write_all(head.as_bytes()).await.unwrap();
            t.write_all(b"5\r\nhello\r\n0\r\n\r\n").await.unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            let _ = tokio::time::timeout(Duration::from_secs(5), async {
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match t.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
            })
            .await;
            let r = String::from_utf8_lossy(&got);
            assert!(r.starts_with("HTTP/1.1 200"), "{connection} {method}: {r}");
        }
    }
    let seen: Vec<(String, String)> = up
        .arrivals()
        .into_iter()
        .map(|a| (a.method, String::from_utf8_lossy(&a.body).into_owned()))
        .collect();
    let want: Vec<(String, String)> = ["GET", "HEAD", "GET", "HEAD"]
        .iter()
        .map(|m| (m.to_string(), "hello".to_owned()))
        .collect();
    assert_eq!(seen, want);
    s.stop().await;
}

/// A response head of `len` bytes (`len` past 410 KB), body `ok`, written at once.
fn head_of(len: usize) -> &'static [u8] {
    let mut head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n".to_vec();
    for i in 0..50 {
        head.extend_from_slice(format!("X-Big-{i:02}: {}\r\n", "a".repeat(8192)).as_bytes());
    }
    let rest = len - head.len() - "X-Last: \r\n\r\n".len();
    head.extend_from_slice(format!("X-Last: {}\r\n\r\nok", "b".repeat(rest)).as_bytes());
    assert_eq!(head.len(), len + 2);
    Box::leak(head.into_boxed_slice())
}

/// One response head limit, exact, on both engines: a receiver's head of 417,792 bytes
/// (hyper's client limit) is relayed; 100 bytes more, even when the read that completes
/// it crosses the limit, is never relayed: the sender gets a 502.
#[tokio::test]
async fn the_response_head_limit_is_exact_on_both_engines() {
    let s = sluice("").await;
    for (len, want) in [(417_792, "HTTP/1.1 200"), (417_792 + 100, "HTTP/1.1 502")] {
        let (up, _task) = raw_receiver(head_of(len)).await;
        for connection in BOTH_PATHS {
            let (got, _) = exchange(s.proxy_addr, up, connection, |b| {
                b.windows(4).any(|w| w == b"\r\n\r\n")
            })
            .await;
            let start = &got[..got.len().min(120)];
            assert!(got.starts_with(want), "{len} bytes, {connection}: {start}");
        }
    }
    s.stop().await;
}

/// One request head limit, exact, whichever engine serves the request: a head of
/// 65,536 bytes is forwarded; one byte more, or 30 KB more arriving in a few reads, is
/// a 431 and reaches no receiver.
#[tokio::test]
async fn the_request_head_limit_is_exact_on_both_engines() {
    let up = common::Upstream::start().await;
    let s = sluice("").await;
    for connection in BOTH_PATHS {
        let over = [(1, "HTTP/1.1 431"), (30_000, "HTTP/1.1 431")];
        for (extra, want) in [(0, "HTTP/1.1 200")].into_iter().chain(over) {
            let start = format!(
                "GET {} HTTP/1.1\r\nHost: {}\r\nConnection: {connection}\r\nX-Pad: ",
                up.url("/pad"),
                up.addr
            );
            let pad = 65_536 + extra - start.len() - "\r\n\r\n".len();
            let req = format!("{start}{}\r\n\r\n", "p".repeat(pad));
            assert_eq!(req.len(), 65_536 + extra);
            let got = common::raw_exchange(s.proxy_addr, req.as_bytes()).await;
            let head = &got[..got.len().min(120)];
            assert!(
                got.starts_with(want),
                "{} bytes, {connection}: {head}",
                req.len()
            );
        }
    }
    assert_eq!(up.count(), 2, "only the heads within the limit arrived");
    s.stop().await;
}
