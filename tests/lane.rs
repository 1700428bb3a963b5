//! The plain lane (src/lane.rs), end to end over real sockets: every response framing a
//! receiver uses arrives whole, request bodies arrive once, pipelined requests are
//! answered in order, an unusual request hands the connection to hyper mid-stream, a
//! kept upstream connection the receiver closed is not reused, and a body cut short
//! is the sender's 400 and pays for the head the receiver saw.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use common::{Upstream, client, read_response, sluice, tokens, wait_for, wait_for_metric};

/// One request as the raw upstream read it.
#[derive(Debug, Clone)]
struct Seen {
    conn: usize,
    path: String,
    body: usize,
    /// The head carried a `Connection` header.
    connection: bool,
    /// The whole request head as it arrived.
    head: String,
}

/// A hand-written HTTP/1.1 upstream: answers by path with framings hyper's test server
/// never uses (chunked with extensions and trailers, close-delimited, interim 103, a
/// close right after a response), and records what it read.
struct RawUpstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    closed: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

const BIG: usize = 1 << 20;

impl RawUpstream {
    async fn start() -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let closed = Arc::new(AtomicUsize::new(0));
        let (s, c) = (Arc::clone(&seen), Arc::clone(&closed));
        let task = tokio::spawn(async move {
            for conn in 0.. {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (s, c) = (Arc::clone(&s), Arc::clone(&c));
                tokio::spawn(async move {
                    raw_serve(stream, conn, s).await;
                    c.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        RawUpstream {
            addr,
            seen,
            closed,
            task,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn raw_serve(mut s: TcpStream, conn: usize, seen: Arc<Mutex<Vec<Seen>>>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let end = loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_string();
        let path = head.split(' ').nth(1).unwrap_or("").to_string();
        if path == "/endless-head" {
            // A response head that does not end (600 KB of one header, more than a
            // head may be), sent while the request's body is still coming.
            let mut head = b"HTTP/1.1 200 OK\r\nX-A: ".to_vec();
            head.extend(std::iter::repeat_n(b'a', 600 << 10));
            let _ = s.write_all(&head).await;
            tokio::time::sleep(Duration::from_secs(10)).await;
            return;
        }
        if path == "/refuse-open" {
            // A receiver that refuses an upload from its head alone, and neither reads
            // the body nor closes (for 10 s).
            let no = b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 8\r\n\r\ntoo big!";
            let _ = s.write_all(no).await;
            tokio::time::sleep(Duration::from_secs(10)).await;
            return;
        }
        if path == "/too-big" {
            // A receiver that refuses an upload from its head alone, and closes
            // without reading the body (the kernel resets what keeps coming).
            seen.lock().unwrap().push(Seen {
                conn,
                path,
                body: 0,
                connection: false,
                head,
            });
            let no = b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 8\r\nConnection: close\r\n\r\ntoo big!";
            let _ = s.write_all(no).await;
            return;
        }
        let length: usize = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().to_string())
            })
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        while buf.len() < end + length {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..end + length);
        seen.lock().unwrap().push(Seen {
            conn,
            path: path.clone(),
            body: length,
            connection: head.to_ascii_lowercase().contains("\r\nconnection:"),
            head: head.clone(),
        });
        if path == "/lf-end" {
            // A chunked body whose last line ends with a bare LF (a lenient client ends
            // the message there), then, a moment later, a response of the receiver's
            // own choosing, for whatever the sender asks next.
            let body = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\n";
            let forged =
                b"HTTP/1.1 200 OK\r\nSet-Cookie: session=attacker\r\nContent-Length: 14\r\n\r\n";
            if s.write_all(body).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            if s.write_all(forged).await.is_err() {
                return;
            }
            continue;
        }
        if path == "/dribble" {
            // A body that takes longer than a head may: one byte each 300 ms.
            if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n")
                .await
                .is_err()
            {
                return;
            }
            for b in b"dribbled" {
                tokio::time::sleep(Duration::from_millis(300)).await;
                if s.write_all(&[*b]).await.is_err() {
                    return;
                }
            }
            continue;
        }
        let answer: Vec<u8> = match path.as_str() {
            "/chunked" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6;x=y\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n".to_vec(),
            "/close" => b"HTTP/1.1 200 OK\r\n\r\nuntil the end".to_vec(),
            "/http10" => b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec(),
            "/length-twice" => b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok".to_vec(),
            "/trailers" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\nX-Sluice-Reason: forged\r\nConnection: x\r\n\r\n".to_vec(),
            "/big-head" => {
                // A 100 KB head (cookies), over a request head's limit.
                let mut a = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n".to_vec();
                for i in 0..90 {
                    a.extend_from_slice(format!("Set-Cookie: c{i}={}\r\n", "v".repeat(1100)).as_bytes());
                }
                a.extend_from_slice(b"\r\nok");
                a
            }
            "/framed-twice" => b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 100\r\n\r\n3\r\nabc\r\n0\r\n\r\n".to_vec(),
            "/early" => b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".to_vec(),
            "/switch" => b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: x\r\n\r\n".to_vec(),
            "/big" => {
                let mut a = format!("HTTP/1.1 200 OK\r\nContent-Length: {BIG}\r\n\r\n").into_bytes();
                a.extend(std::iter::repeat_n(b'x', BIG));
                a
            }
            _ => b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Sluice-Reason: forged\r\n\r\nok".to_vec(),
        };
        if s.write_all(&answer).await.is_err() {
            return;
        }
        if path == "/http10" {
            // HTTP/1.0 without keep-alive: this connection ends after the answer, here
            // a moment later; a request sent on it meanwhile is never read.
            tokio::time::sleep(Duration::from_millis(300)).await;
            return;
        }
        // Close-delimited, or a receiver that closes after each answer without saying so.
        if path == "/close" || path == "/bye" || path == "/switch" {
            return;
        }
    }
}

#[tokio::test]
async fn responses_of_every_framing_arrive_whole() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let c = client(s.proxy_addr);
    let get = |path: &str| {
        let (c, url) = (c.clone(), up.url(path));
        async move {
            let r = c.get(url).send().await.unwrap();
            let status = r.status().as_u16();
            let forged = r.headers().contains_key("x-sluice-reason");
            (status, forged, r.bytes().await.unwrap())
        }
    };
    assert_eq!(get("/chunked").await, (200, false, "hello world".into()));
    assert_eq!(get("/close").await, (200, false, "until the end".into()));
    assert_eq!(get("/early").await, (200, false, "ok".into()));
    let (status, _, big) = get("/big").await;
    assert_eq!((status, big.len()), (200, BIG));
    assert!(big.iter().all(|b| *b == b'x'));
    let (status, forged, body) = get("/plain").await;
    assert_eq!((status, body.as_ref()), (200, &b"ok"[..]));
    assert!(
        !forged,
        "a receiver's X-Sluice-* headers never reach the sender"
    );
    // A receiver that closes after each answer: the next request never goes out on the
    // closed connection (it would fail with a 502).
    for n in 1..=3 {
        let closed_before = up.closed.load(Ordering::SeqCst);
        assert_eq!(get("/bye").await.0, 200, "request {n} after a silent close");
        wait_for("the receiver to close", Duration::from_secs(5), || async {
            up.closed.load(Ordering::SeqCst) > closed_before
        })
        .await;
    }
    let seen = up.seen();
    let paths: Vec<&str> = seen.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/chunked", "/close", "/early", "/big", "/plain", "/bye", "/bye", "/bye"
        ],
        "every request arrived exactly once, in order"
    );
    let byes: Vec<usize> = seen
        .iter()
        .filter(|s| s.path == "/bye")
        .map(|s| s.conn)
        .collect();
    assert!(
        byes[0] != byes[1] && byes[1] != byes[2],
        "each on a new connection: {seen:?}"
    );
    s.stop().await;
}

#[tokio::test]
async fn request_bodies_arrive_once_and_whole() {
    let up = Upstream::start().await;
    let s = sluice("").await;
    let c = client(s.proxy_addr);
    let big: Vec<u8> = (0..BIG).map(|i| (i % 251) as u8).collect();
    for body in [b"{\"event\":1}".to_vec(), big.clone(), Vec::new()] {
        let r = c
            .post(up.url("/hook"))
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let last = up.arrivals().pop().unwrap();
        assert_eq!(last.body.as_ref(), body.as_slice(), "{} bytes", body.len());
    }
    assert_eq!(up.count(), 3, "each arrived once");
    s.stop().await;
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
    let host = up.addr;
    let two = format!(
        "GET http://{host}/a HTTP/1.1\r\nHost: {host}\r\n\r\nPOST http://{host}/b HTTP/1.1\r\nHost: {host}\r\nContent-Length: 3\r\n\r\nxyzGET http://{host}/c HTTP/1.1\r\nHost: {host}\r\n\r\n"
    );
    t.write_all(two.as_bytes()).await.unwrap();
    for _ in 0..3 {
        let r = read_response(&mut t).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    }
    let seen = up.seen();
    let got: Vec<(&str, usize)> = seen.iter().map(|s| (s.path.as_str(), s.body)).collect();
    assert_eq!(got, [("/a", 0), ("/b", 3), ("/c", 0)]);
    s.stop().await;
}

#[tokio::test]
async fn an_unusual_request_hands_the_connection_to_hyper() {
    let up = Upstream::start().await;
    let s = sluice("").await;
    let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
    let host = up.addr;
    let plain = format!("GET http://{host}/one HTTP/1.1\r\nHost: {host}\r\n\r\n");
    t.write_all(plain.as_bytes()).await.unwrap();
    assert!(read_response(&mut t).await.starts_with("HTTP/1.1 200"));
    // Origin-form: not the lane's; hyper answers it on the same connection...
    t.write_all(b"GET /two HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let r = read_response(&mut t).await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    assert!(r.contains("sluice is an HTTP proxy"), "{r}");
    // ...and serves it from then on, chunked uploads included.
    let chunked = format!(
        "POST http://{host}/three HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    );
    t.write_all(chunked.as_bytes()).await.unwrap();
    assert!(read_response(&mut t).await.starts_with("HTTP/1.1 200"));
    let paths: Vec<(String, Vec<u8>)> = up
        .arrivals()
        .into_iter()
        .map(|a| (a.path, a.body.to_vec()))
        .collect();
    assert_eq!(
        paths,
        [("/one".into(), vec![]), ("/three".into(), b"abc".to_vec())]
    );
    s.stop().await;
}

/// A body cut short is the sender's 400 and arrives nowhere whole.
/// Its head reached the receiver, so its token stays spent (it used to come back, and
/// senders that cut their bodies sent heads without limit).
#[tokio::test]
async fn a_body_cut_short_is_a_400_that_pays_for_its_head_and_arrives_nowhere_whole() {
    let up = RawUpstream::start().await;
    let s = sluice("[defaults]\nrate = 0.001\nburst = 3.0\n").await;
    let host = up.addr;
    let first =
        format!("GET http://{host}/warm HTTP/1.1\r\nHost: {host}\r\nX-Endpoint-Id: cut\r\n\r\n");
    let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
    t.write_all(first.as_bytes()).await.unwrap();
    assert!(read_response(&mut t).await.starts_with("HTTP/1.1 200"));
    let before = tokens(s.admin_addr, "cut").await.unwrap();
    let cut = format!(
        "POST http://{host}/cut HTTP/1.1\r\nHost: {host}\r\nX-Endpoint-Id: cut\r\nContent-Length: 100\r\n\r\n0123456789"
    );
    t.write_all(cut.as_bytes()).await.unwrap();
    t.shutdown().await.unwrap();
    let r = read_response(&mut t).await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    let after = tokens(s.admin_addr, "cut").await.unwrap();
    assert!(
        (before - 1.01..before - 0.99).contains(&after),
        "one token paid for the head: {before} before, {after} after"
    );
    assert!(
        up.seen().iter().all(|s| s.path != "/cut"),
        "no whole request arrived: {:?}",
        up.seen()
    );
    s.stop().await;
}

/// A clean upstream connection outlives its sender connection: the next sender
/// connection to the same destination is served on it, while one the receiver closed
/// is never handed on.
#[tokio::test]
async fn an_upstream_connection_outlives_its_sender_connection() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    for path in ["/first", "/second", "/bye", "/after-bye"] {
        let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
        let req = format!("GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n\r\n");
        t.write_all(req.as_bytes()).await.unwrap();
        let r = read_response(&mut t).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{path}: {r}");
        drop(t);
        // The sender connection is gone from sluice's side too before the next one.
        wait_for_metric(s.admin_addr, "sluice_connections_open 0").await;
    }
    let conns: Vec<(String, usize)> = up.seen().into_iter().map(|s| (s.path, s.conn)).collect();
    assert_eq!(
        conns[1].1, conns[0].1,
        "a new sender connection reused it: {conns:?}"
    );
    assert_eq!(conns[2].1, conns[0].1, "{conns:?}");
    assert_ne!(
        conns[3].1, conns[2].1,
        "the receiver closed it after /bye: {conns:?}"
    );
    s.stop().await;
}

/// A receiver that answers an upload before reading its body (a 413 from the head
/// alone) and closes: the sender gets that answer, not a 502, and then the end of its
/// connection (the rest of its body goes nowhere).
#[tokio::test]
async fn an_answer_before_the_body_is_sent_reaches_the_sender() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    let t = TcpStream::connect(s.proxy_addr).await.unwrap();
    let (mut rd, mut wr) = t.into_split();
    const UPLOAD: usize = 64 << 20;
    let head = format!(
        "POST http://{host}/too-big HTTP/1.1\r\nHost: {host}\r\nContent-Length: {UPLOAD}\r\n\r\n"
    );
    // The upload goes on until sluice stops reading it; the answer is read meanwhile.
    let writing = tokio::spawn(async move {
        wr.write_all(head.as_bytes()).await.unwrap();
        let chunk = vec![b'x'; 1 << 16];
        for _ in 0..UPLOAD / chunk.len() {
            if wr.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let mut all = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), rd.read_to_end(&mut all))
        .await
        .expect("sluice answers and closes within 10 s");
    let r = String::from_utf8_lossy(&all);
    assert!(r.starts_with("HTTP/1.1 413"), "the receiver's answer: {r}");
    assert!(r.ends_with("\r\n\r\ntoo big!"), "{r}");
    assert!(
        r.to_ascii_lowercase().contains("\r\nconnection: close\r\n"),
        "{r}"
    );
    writing.abort();
    let paths: Vec<String> = up.seen().into_iter().map(|s| s.path).collect();
    assert_eq!(paths, ["/too-big"]);
    s.stop().await;
}

/// An HTTP/1.0 receiver's connection (no `keep-alive`) ends with its answer: the next
/// request goes on a new connection, never on one the receiver no longer reads.
#[tokio::test]
async fn an_http10_answer_without_keep_alive_is_the_end_of_its_connection() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
    for _ in 0..2 {
        let req = format!("GET http://{host}/http10 HTTP/1.1\r\nHost: {host}\r\n\r\n");
        t.write_all(req.as_bytes()).await.unwrap();
        let r = read_response(&mut t).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(r.ends_with("\r\n\r\nok"), "{r}");
    }
    let conns: Vec<usize> = up.seen().into_iter().map(|s| s.conn).collect();
    assert_eq!(conns.len(), 2);
    assert_ne!(
        conns[0], conns[1],
        "a new connection for the second request"
    );
    s.stop().await;
}

/// A sender that gives up while its request waits for a token (it closes its
/// connection): the request never reaches the receiver, and the token it would have
/// spent goes to the next request, as on hyper's path.
#[tokio::test]
async fn a_request_whose_sender_leaves_while_it_waits_never_arrives() {
    let up = RawUpstream::start().await;
    let s = sluice("[defaults]\nrate = 0.5\nburst = 1.0\nmax_wait = \"10s\"\n").await;
    let host = up.addr;
    let ask = |path: &str| {
        format!("GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\nX-Endpoint-Id: leave\r\n\r\n")
    };
    let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
    t.write_all(ask("/first").as_bytes()).await.unwrap();
    assert!(read_response(&mut t).await.starts_with("HTTP/1.1 200"));
    // The bucket is empty: the next request holds a reservation for the token due in
    // 2 s. Its sender leaves before then.
    let mut gone = TcpStream::connect(s.proxy_addr).await.unwrap();
    gone.write_all(ask("/abandoned").as_bytes()).await.unwrap();
    wait_for(
        "the abandoned request to wait",
        Duration::from_secs(5),
        || async {
            tokens(s.admin_addr, "leave")
                .await
                .is_some_and(|t| t < -0.5)
        },
    )
    .await;
    drop(gone);
    // Its reservation is given back at once (the next token is still 2 s away).
    wait_for(
        "the reservation given back",
        Duration::from_secs(1),
        || async {
            tokens(s.admin_addr, "leave")
                .await
                .is_some_and(|t| t > -0.01)
        },
    )
    .await;
    t.write_all(ask("/after").as_bytes()).await.unwrap();
    assert!(read_response(&mut t).await.starts_with("HTTP/1.1 200"));
    let paths: Vec<String> = up.seen().into_iter().map(|s| s.path).collect();
    assert_eq!(
        paths,
        ["/first", "/after"],
        "the abandoned request never arrived"
    );
    s.stop().await;
}

/// A target with userinfo (`http://user:pw@host/`): the receiver's `Host` is the
/// host alone, as on hyper's path, and the credentials reach it nowhere.
#[tokio::test]
async fn userinfo_in_the_target_never_reaches_the_receiver() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
    let req = format!("GET http://user:secret@{host}/creds HTTP/1.1\r\nHost: {host}\r\n\r\n");
    t.write_all(req.as_bytes()).await.unwrap();
    let r = read_response(&mut t).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    let head = seen[0].head.to_ascii_lowercase();
    assert!(head.contains(&format!("\r\nhost: {host}\r\n")), "{head}");
    assert!(!head.contains("secret"), "{head}");
    s.stop().await;
}

/// An answer framed twice (`Transfer-Encoding: chunked` and a `Content-Length`): the
/// chunked framing wins (RFC 9112 §6.3) and the length is not passed on, by the lane
/// and by hyper's path alike (before, hyper's path relayed `content-length: 100` with
/// a 3-byte body, and the sender waited for the rest).
#[tokio::test]
async fn an_answer_framed_twice_reaches_the_sender_framed_once() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    for connection in BOTH_PATHS {
        let target = format!("http://{host}/framed-twice");
        let mut t = send_on(s.proxy_addr, connection, "GET", &target).await;
        let (r, whole) = read_until(&mut t, |got| got.ends_with(b"0\r\n\r\n")).await;
        assert!(whole, "{connection}: the answer never ended: {r}");
        assert!(r.starts_with("HTTP/1.1 200"), "{connection}: {r}");
        assert!(
            !r.to_ascii_lowercase().contains("content-length"),
            "{connection}: {r}"
        );
        assert!(r.contains("\r\nabc\r\n"), "{connection}: {r}");
    }
    s.stop().await;
}

/// An answer that repeats an equal `Content-Length` (RFC 9110 §8.6 lets a recipient
/// take it as one) reaches the sender with one, for `GET` and `HEAD`, on both paths
/// (before, hyper's path answered a `HEAD` with nothing: its server refused to write
/// the header twice and dropped the connection).
#[tokio::test]
async fn a_repeated_content_length_reaches_the_sender_once() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    for connection in BOTH_PATHS {
        for method in ["GET", "HEAD"] {
            let target = format!("http://{host}/length-twice");
            let mut t = send_on(s.proxy_addr, connection, method, &target).await;
            let head_read = |got: &[u8]| got.windows(4).any(|w| w == b"\r\n\r\n");
            let r = read_until(&mut t, head_read).await.0.to_ascii_lowercase();
            assert!(
                r.starts_with("http/1.1 200"),
                "{connection} {method}: {r:?}"
            );
            assert_eq!(
                r.matches("content-length: 2\r\n").count(),
                1,
                "{connection} {method}: {r:?}"
            );
        }
    }
    s.stop().await;
}

/// The `Connection` values that send a request down each path: `keep-alive` is the
/// lane's; a `Connection` naming a header is hyper's.
const BOTH_PATHS: [&str; 2] = ["keep-alive", "x-hop"];

/// A new sender connection to `proxy` that has sent `method target` (absolute-form,
/// with its `Host`) and `Connection: connection`.
async fn send_on(proxy: SocketAddr, connection: &str, method: &str, target: &str) -> TcpStream {
    let mut t = TcpStream::connect(proxy).await.unwrap();
    send_again(&mut t, connection, method, target)
        .await
        .unwrap();
    t
}

/// Sends `method target` (absolute-form, with its `Host`) and `Connection: connection`
/// on a sender connection.
async fn send_again(
    t: &mut TcpStream,
    connection: &str,
    method: &str,
    target: &str,
) -> std::io::Result<()> {
    let uri: http::Uri = target.parse().unwrap();
    let host = uri.authority().unwrap();
    let req =
        format!("{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: {connection}\r\n\r\n");
    t.write_all(req.as_bytes()).await
}

/// Reads until `done` holds for what came, the peer closes, or 5 s pass: what came,
/// and whether `done` held.
async fn read_until(t: &mut TcpStream, done: impl Fn(&[u8]) -> bool) -> (String, bool) {
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

/// Reads until the peer closes (within 10 s): everything it sent.
async fn read_until_closed(t: &mut TcpStream) -> String {
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), t.read_to_end(&mut all))
        .await
        .expect("sluice closes the connection within 10 s")
        .unwrap();
    String::from_utf8_lossy(&all).into_owned()
}

/// One-shot senders (`Connection: close`, as Go's `DisableKeepAlives` and Ruby's
/// one-off `Net::HTTP` send it): each gets one whole answer that says
/// `connection: close`, then the end of its connection; the header never reaches the
/// receiver, and one upstream connection serves them all. A refused one-shot request is
/// answered the same way and arrives nowhere.
#[tokio::test]
async fn one_shot_senders_are_answered_then_closed_on_one_upstream_connection() {
    let up = RawUpstream::start().await;
    let s = sluice("[defaults]\nrate = 0.001\nburst = 3.0\nmax_wait = \"0s\"\n").await;
    let host = up.addr;
    for i in 0..4 {
        let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
        let req = format!(
            "POST http://{host}/one-{i} HTTP/1.1\r\nHost: {host}\r\nX-Endpoint-Id: once\r\nConnection: close\r\nContent-Length: 3\r\n\r\nabc"
        );
        t.write_all(req.as_bytes()).await.unwrap();
        let r = read_until_closed(&mut t).await;
        let status = if i < 3 {
            "HTTP/1.1 200"
        } else {
            "HTTP/1.1 503"
        };
        assert!(r.starts_with(status), "request {i}: {r}");
        assert_eq!(
            r.to_ascii_lowercase()
                .matches("\r\nconnection: close\r\n")
                .count(),
            1,
            "request {i}: {r}"
        );
        assert_eq!(r.matches("HTTP/1.1 ").count(), 1, "one answer: {r}");
        if i < 3 {
            assert!(
                r.ends_with("\r\n\r\nok"),
                "the whole body, then the end: {r}"
            );
        }
    }
    let seen = up.seen();
    let paths: Vec<&str> = seen.iter().map(|s| s.path.as_str()).collect();
    assert_eq!(paths, ["/one-0", "/one-1", "/one-2"], "{seen:?}");
    assert!(
        seen.iter().all(|s| s.body == 3 && !s.connection),
        "{seen:?}"
    );
    assert!(
        seen.iter().all(|s| s.conn == seen[0].conn),
        "one upstream connection served every one-shot sender: {seen:?}"
    );
    s.stop().await;
}

/// A sluice intercepting TLS with a CA made for the test in `dir` (returned), trusting
/// `pki`'s CA for the receivers.
async fn intercepting(
    dir: &std::path::Path,
    pki: &common::tls::TestPki,
) -> (sluice::app::Running, sluice::tls::CaFiles) {
    let ca = sluice::tls::generate_ca(&dir.join("ca")).unwrap();
    let up_ca = pki.write_ca(dir);
    let s = sluice(&format!(
        "[tls]\nintercept = true\nca_cert = \"{}\"\nca_key = \"{}\"\nupstream_roots = [\"{}\"]\n",
        ca.cert.display(),
        ca.key.display(),
        up_ca.display()
    ))
    .await;
    (s, ca)
}

/// A one-shot request inside an intercepted tunnel: one whole answer that says
/// `connection: close`, then a clean end of the TLS session (its close_notify, not a
/// cut the sender's client would report as an error).
#[tokio::test]
async fn a_one_shot_request_in_a_tunnel_ends_the_tls_session_cleanly() {
    use common::tls::{TestPki, TlsUpstream};
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(&["localhost"]);
    let up = TlsUpstream::ok(&pki).await;
    let (s, ca) = intercepting(dir.path(), &pki).await;
    let host = format!("localhost:{}", up.addr.port());
    let mut tls = common::tls::tunnel_session(s.proxy_addr, &ca.cert, &host, "localhost").await;
    let req = format!("GET /once HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    tls.write_all(req.as_bytes()).await.unwrap();
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut all))
        .await
        .expect("sluice ends the session within 10 s")
        .expect("a clean end: close_notify, then the end of the connection");
    let r = String::from_utf8_lossy(&all);
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(
        r.to_ascii_lowercase().contains("\r\nconnection: close\r\n"),
        "{r}"
    );
    let arrivals = up.arrivals();
    assert_eq!(arrivals.len(), 1);
    assert!(
        !arrivals[0].headers.contains_key("connection"),
        "hop-by-hop"
    );
    s.stop().await;
}

/// Inside an intercepted tunnel (HTTP/1.1 by ALPN) bodies arrive once and whole both
/// ways, sluice's own headers never reach the receiver, and a TLS connection to the
/// receiver that carried one request outlives its tunnel: the next tunnel is served on
/// it, with no new handshake. One a tunnel held (requests in a row) ends with it.
#[tokio::test]
async fn inside_a_tunnel_bodies_arrive_whole_and_the_upstream_connection_outlives_it() {
    use common::Reply;
    use common::tls::{TestPki, TlsUpstream};
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(&["localhost"]);
    let up = TlsUpstream::start(
        &pki,
        Arc::new(|a| {
            let mut r = Reply::ok().header("x-got", &a.body.len().to_string());
            if a.path == "/big" {
                r.body = "y".repeat(BIG);
            }
            r
        }),
    )
    .await;
    let (s, ca) = intercepting(dir.path(), &pki).await;
    let pem = std::fs::read(&ca.cert).unwrap();
    let tunnel = || {
        reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
            .proxy(reqwest::Proxy::https(format!("http://{}", s.proxy_addr)).unwrap())
            .http1_only()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap()
    };
    let big: Vec<u8> = (0..BIG).map(|i| (i % 251) as u8).collect();
    let c = tunnel();
    for body in [b"{\"event\":1}".to_vec(), big.clone(), Vec::new()] {
        let r = c
            .post(up.url("/hook"))
            .header("x-endpoint-id", "tunnel-ep")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-got"], body.len().to_string().as_str());
        let last = up.arrivals().pop().unwrap();
        assert_eq!(last.body.as_ref(), body.as_slice(), "{} bytes", body.len());
        assert!(!last.headers.contains_key("x-endpoint-id"));
        let host = format!("localhost:{}", up.addr.port());
        assert_eq!(last.headers["host"], host.as_str());
    }
    let r = c.get(up.url("/big")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.bytes().await.unwrap().len(),
        BIG,
        "the response arrived whole"
    );
    drop(c);
    wait_for_metric(s.admin_addr, "sluice_connections_open 0").await;
    // The first tunnel held its connection (four requests in a row): it ended with the
    // tunnel. A tunnel of one request leaves its own for the next.
    for path in ["/second-tunnel", "/third-tunnel"] {
        let r = tunnel().get(up.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        wait_for_metric(s.admin_addr, "sluice_connections_open 0").await;
    }
    let arrivals = up.arrivals();
    assert_eq!(arrivals.len(), 6, "each request arrived once");
    let conns: Vec<usize> = arrivals.iter().map(|a| a.conn).collect();
    assert!(
        conns[..4].iter().all(|c| *c == conns[0]),
        "one TLS connection in the first tunnel: {conns:?}"
    );
    assert_ne!(conns[4], conns[0], "{conns:?}");
    assert_eq!(conns[5], conns[4], "no new handshake: {conns:?}");
    s.stop().await;
}

/// A target with a query and no path (`http://host?q=1`, which RFC 9112 §3.2.1 makes
/// `/?q=1` in origin-form): the receiver reads `/?q=1` on both paths (before, the lane
/// wrote `GET ?q=1`, a request line no receiver can parse).
#[tokio::test]
async fn a_query_without_a_path_reaches_the_receiver_as_origin_form() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    for connection in BOTH_PATHS {
        let mut t = send_on(
            s.proxy_addr,
            connection,
            "GET",
            &format!("http://{host}?q=1"),
        )
        .await;
        let r = read_response(&mut t).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{connection}: {r}");
    }
    let paths: Vec<String> = up.seen().into_iter().map(|s| s.path).collect();
    assert_eq!(paths, ["/?q=1", "/?q=1"]);
    s.stop().await;
}

/// A sender that sends its next request while a slow response body is still arriving
/// (pipelining, or a client that writes ahead) gets the whole body and then the next
/// answer, on both paths: the head deadline (`header_read_timeout`) runs from the end of
/// the response, not from the next head's bytes.
#[tokio::test]
async fn a_head_sent_while_a_slow_body_arrives_waits_for_it_uncut() {
    let up = RawUpstream::start().await;
    let s = sluice("[proxy]\nheader_read_timeout = \"1s\"\n").await;
    let host = up.addr;
    for connection in BOTH_PATHS {
        let mut t = send_on(
            s.proxy_addr,
            connection,
            "GET",
            &format!("http://{host}/dribble"),
        )
        .await;
        // The next head goes once the body has begun arriving.
        let (r, begun) = read_until(&mut t, |got| got.windows(4).any(|w| w == b"\r\n\r\n")).await;
        assert!(begun, "{connection}: no response head: {r:?}");
        send_again(&mut t, connection, "GET", &format!("http://{host}/next"))
            .await
            .unwrap();
        // 8 body bytes at 300 ms each: 2.4 s, past the 1 s deadline and its half.
        let (rest, whole) = read_until(&mut t, |got| got.ends_with(b"\r\n\r\nok")).await;
        assert!(
            whole,
            "{connection}: cut before both answers were whole: {r:?}{rest:?}"
        );
        assert!(
            rest.starts_with("dribbledHTTP/1.1 200"),
            "{connection}: {rest:?}"
        );
    }
    s.stop().await;
}

/// A receiver that answers from the head alone and then neither reads the body nor closes:
/// its answer reaches the sender at once, on both paths, whether the sender uploads fast
/// (sluice's writes to the receiver stall) or has stopped uploading (sluice waits for the
/// sender).
#[tokio::test]
async fn an_answer_before_the_body_reaches_the_sender_while_the_receiver_stays_open() {
    let up = RawUpstream::start().await;
    let s = sluice("[proxy]\nupstream_timeout = \"30s\"\n").await;
    let host = up.addr;
    for connection in BOTH_PATHS {
        for stalled in [false, true] {
            let t = TcpStream::connect(s.proxy_addr).await.unwrap();
            let (mut rd, mut wr) = t.into_split();
            const UPLOAD: usize = 64 << 20;
            let head = format!(
                "POST http://{host}/refuse-open HTTP/1.1\r\nHost: {host}\r\nConnection: {connection}\r\nContent-Length: {UPLOAD}\r\n\r\n"
            );
            let writing = tokio::spawn(async move {
                wr.write_all(head.as_bytes()).await.unwrap();
                let chunk = vec![b'x'; 1 << 16];
                let chunks = if stalled { 1 } else { UPLOAD / chunk.len() };
                for _ in 0..chunks {
                    if wr.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
                // A stalled sender keeps its connection open meanwhile.
                tokio::time::sleep(Duration::from_secs(20)).await;
            });
            let (r, whole) = read_until_half(&mut rd, |got| got.ends_with(b"too big!")).await;
            let case = format!("{connection}, stalled {stalled}");
            assert!(whole, "{case}: the receiver's answer did not come: {r:?}");
            assert!(r.starts_with("HTTP/1.1 413"), "{case}: {r:?}");
            writing.abort();
        }
    }
    s.stop().await;
}

/// [`read_until`] on a read half.
async fn read_until_half(
    t: &mut tokio::net::tcp::OwnedReadHalf,
    done: impl Fn(&[u8]) -> bool,
) -> (String, bool) {
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

/// A chunked body whose end a sender's client could read somewhere else than sluice does (a
/// bare LF ending the last line) is cut, on both paths, and the response the receiver
/// placed after it reaches no request.
#[tokio::test]
async fn a_receiver_cannot_place_a_response_after_an_ambiguous_chunked_body() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    for connection in BOTH_PATHS {
        let mut t = send_on(
            s.proxy_addr,
            connection,
            "GET",
            &format!("http://{host}/lf-end"),
        )
        .await;
        let (first, _) = read_until(&mut t, |got| got.ends_with(b"0\r\n\r\n")).await;
        // Whatever came of the first answer, the next request (when the connection is
        // still open) gets its own.
        let (second, _) =
            match send_again(&mut t, connection, "GET", &format!("http://{host}/plain")).await {
                Ok(()) => read_until(&mut t, |got| got.ends_with(b"\r\n\r\nok")).await,
                Err(_) => (String::new(), false),
            };
        let all = first + &second;
        assert!(!all.contains("attacker"), "{connection}: {all:?}");
        if !second.is_empty() {
            assert!(
                second.starts_with("HTTP/1.1 200"),
                "{connection}: {second:?}"
            );
            assert!(second.ends_with("\r\n\r\nok"), "{connection}: {second:?}");
        }
    }
    s.stop().await;
}

/// A chunked body's trailer fields stay behind, on both paths: the sender's copy ends
/// with the last chunk and an empty trailer section, so a receiver's `X-Sluice-*` or
/// `Connection` trailer reaches no sender.
#[tokio::test]
async fn trailer_fields_stay_behind() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    for connection in BOTH_PATHS {
        let mut t = send_on(
            s.proxy_addr,
            connection,
            "GET",
            &format!("http://{host}/trailers"),
        )
        .await;
        let (r, whole) = read_until(&mut t, |got| got.ends_with(b"\r\n0\r\n\r\n")).await;
        assert!(whole, "{connection}: {r:?}");
        assert!(
            r.ends_with("\r\n\r\n2\r\nhi\r\n0\r\n\r\n"),
            "{connection}: {r:?}"
        );
        // And the connection carries the next request.
        send_again(&mut t, connection, "GET", &format!("http://{host}/plain"))
            .await
            .unwrap();
        let (r, whole) = read_until(&mut t, |got| got.ends_with(b"\r\n\r\nok")).await;
        assert!(whole, "{connection}: {r:?}");
    }
    s.stop().await;
}

/// A port written with leading zeros (`http://127.0.0.1:080/`) reaches the receiver's
/// `Host` as a number, on both paths (before, the lane copied `:080` as it came, where
/// hyper's path sends the port as a number, and none for the scheme's default).
#[tokio::test]
async fn the_receiver_host_carries_the_port_as_a_number() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let port = up.addr.port();
    for connection in BOTH_PATHS {
        let target = format!("http://127.0.0.1:00{port}/padded");
        let mut t = send_on(s.proxy_addr, connection, "GET", &target).await;
        let r = read_response(&mut t).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{connection}: {r}");
    }
    let seen = up.seen();
    assert_eq!(seen.len(), 2);
    for s in seen {
        let head = s.head.to_ascii_lowercase();
        assert!(
            head.contains(&format!("\r\nhost: 127.0.0.1:{port}\r\n")),
            "{head}"
        );
    }
    s.stop().await;
}

/// A response head larger than a request head may be (about 100 KB of cookies in 90
/// fields) reaches the sender on both paths (before, the lane answered 502 over
/// 64 KB, where hyper's client takes about 400 KB).
#[tokio::test]
async fn a_large_response_head_reaches_the_sender_on_both_paths() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    for connection in BOTH_PATHS {
        let mut t = send_on(
            s.proxy_addr,
            connection,
            "GET",
            &format!("http://{host}/big-head"),
        )
        .await;
        let (r, whole) = read_until(&mut t, |got| got.ends_with(b"\r\n\r\nok")).await;
        assert!(whole, "{connection}: {}", &r[..r.len().min(200)]);
        assert!(r.starts_with("HTTP/1.1 200"), "{connection}");
        assert_eq!(
            r.matches("set-cookie: c").count() + r.matches("Set-Cookie: c").count(),
            90,
            "{connection}"
        );
    }
    s.stop().await;
}

/// A 101 to a request that asked for no upgrade (sluice sends none)
/// is a 502 on both paths, also to an HTTP/1.0 sender, which may get no 1xx at all.
#[tokio::test]
async fn an_unasked_101_is_a_502_on_both_paths() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    for connection in BOTH_PATHS {
        let mut t = send_on(
            s.proxy_addr,
            connection,
            "GET",
            &format!("http://{host}/switch"),
        )
        .await;
        let (r, _) = read_until(&mut t, |got| got.windows(4).any(|w| w == b"\r\n\r\n")).await;
        assert!(r.starts_with("HTTP/1.1 502"), "{connection}: {r}");
    }
    s.stop().await;
}

/// An intercepted TLS session through `proxy` to `authority` (CONNECT, then a handshake
/// trusting sluice's CA and naming `server_name`), offering HTTP/1.1.
async fn open_tunnel(
    proxy: SocketAddr,
    ca: &sluice::tls::CaFiles,
    authority: &str,
    server_name: &str,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    common::tls::tunnel_session(proxy, &ca.cert, authority, server_name).await
}

/// Reads one whole response from an intercepted session (head, then its
/// `Content-Length` of body), within 10 s.
async fn tls_response(tls: &mut tokio_rustls::client::TlsStream<TcpStream>) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let whole = |got: &[u8]| {
        let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
            return false;
        };
        let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        got.len() >= end + 4 + length
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        while !whole(&got) {
            match tls.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .expect("a response within 10 s");
    String::from_utf8_lossy(&got).into_owned()
}

/// Inside an intercepted tunnel, a CONNECT (a tunnel in the tunnel), a request whose target
/// is `host:port` or a bare word (authority-form, CONNECT's alone) and one whose target is
/// `*` (asterisk-form, refused outside tunnels too) are 400s: nothing reaches the receiver.
#[tokio::test]
async fn inside_a_tunnel_a_connect_or_a_target_that_is_no_path_is_refused() {
    use common::tls::{TestPki, TlsUpstream};
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(&["localhost"]);
    let up = TlsUpstream::ok(&pki).await;
    let (s, ca) = intercepting(dir.path(), &pki).await;
    let authority = format!("localhost:{}", up.addr.port());
    for head in [
        "CONNECT other.example:443 HTTP/1.1\r\nHost: other.example:443\r\n\r\n".to_string(),
        format!("DELETE users HTTP/1.1\r\nHost: {authority}\r\n\r\n"),
        format!("GET evil.example:443 HTTP/1.1\r\nHost: {authority}\r\n\r\n"),
        format!("GET a@b HTTP/1.1\r\nHost: {authority}\r\n\r\n"),
        // asterisk-form went to the receiver as `GET *`.
        format!("GET * HTTP/1.1\r\nHost: {authority}\r\n\r\n"),
        format!("OPTIONS * HTTP/1.1\r\nHost: {authority}\r\n\r\n"),
    ] {
        let mut tls = open_tunnel(s.proxy_addr, &ca, &authority, "localhost").await;
        tls.write_all(head.as_bytes()).await.unwrap();
        let r = tls_response(&mut tls).await;
        assert!(r.starts_with("HTTP/1.1 400"), "{head:?}: {r}");
    }
    assert_eq!(up.arrivals().len(), 0, "nothing reached the receiver");
    s.stop().await;
}

/// A CONNECT to an IPv4 address spelled another way (`127.1`) reaches that address on
/// both paths inside the tunnel, with one name for the TLS handshake and `Host`: the
/// address.
#[tokio::test]
async fn a_tunnel_to_an_address_spelled_another_way_reaches_it_on_both_paths() {
    use common::tls::{TestPki, TlsUpstream};
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(&["127.0.0.1"]);
    let up = TlsUpstream::ok(&pki).await;
    let (s, ca) = intercepting(dir.path(), &pki).await;
    let port = up.addr.port();
    let mut tls = open_tunnel(s.proxy_addr, &ca, &format!("127.1:{port}"), "127.0.0.1").await;
    for connection in BOTH_PATHS {
        let req = format!(
            "GET /{connection} HTTP/1.1\r\nHost: 127.1:{port}\r\nConnection: {connection}\r\n\r\n"
        );
        tls.write_all(req.as_bytes()).await.unwrap();
        let r = tls_response(&mut tls).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{connection}: {r}");
    }
    let arrivals = up.arrivals();
    assert_eq!(arrivals.len(), 2);
    for a in arrivals {
        assert_eq!(
            a.headers["host"],
            format!("127.0.0.1:{port}").as_str(),
            "{}",
            a.path
        );
    }
    s.stop().await;
}

/// An h2 sender's `cookie` fields (browsers and h2 clients split them, one pair each) reach
/// the HTTP/1.1 receiver as one `cookie` joined with `; ` (RFC 9113 §8.2.3).
#[tokio::test]
async fn an_h2_senders_split_cookies_reach_the_receiver_as_one() {
    use common::tls::{TestPki, TlsUpstream};
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(&["localhost"]);
    let up = TlsUpstream::ok(&pki).await;
    let (s, ca) = intercepting(dir.path(), &pki).await;
    let pem = std::fs::read(&ca.cert).unwrap();
    let c = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
        .proxy(reqwest::Proxy::https(format!("http://{}", s.proxy_addr)).unwrap())
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut cookies = reqwest::header::HeaderMap::new();
    for pair in ["a=1", "b=2", "c=3"] {
        cookies.append(reqwest::header::COOKIE, pair.parse().unwrap());
    }
    let r = c.get(up.url("/c")).headers(cookies).send().await.unwrap();
    assert_eq!(
        r.version(),
        reqwest::Version::HTTP_2,
        "the tunnel carries h2"
    );
    assert_eq!(r.status(), 200);
    let a = up.arrivals().pop().unwrap();
    let got: Vec<_> = a.headers.get_all("cookie").iter().collect();
    assert_eq!(got, ["a=1; b=2; c=3"]);
    s.stop().await;
}

/// A response head that does not end, sent while the request's body is still coming
/// (a slow upload), is refused at the head's limit, as it is after a whole body: a 502
/// at once, on both paths, never kept until `upstream_timeout` (gigabytes, and a core
/// re-parsing them).
#[tokio::test]
async fn a_head_without_end_during_an_upload_is_refused_at_the_limit() {
    let up = RawUpstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    for connection in BOTH_PATHS {
        let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
        let head = format!(
            "POST http://{host}/endless-head HTTP/1.1\r\nHost: {host}\r\nConnection: {connection}\r\nContent-Length: 100\r\n\r\nx"
        );
        t.write_all(head.as_bytes()).await.unwrap();
        // The rest of the body never comes.
        let (r, answered) =
            read_until(&mut t, |got| got.windows(4).any(|w| w == b"\r\n\r\n")).await;
        assert!(answered, "{connection}: no answer: {r:?}");
        assert!(r.starts_with("HTTP/1.1 502"), "{connection}: {r}");
    }
    s.stop().await;
}

/// A `HEAD` that sluice refuses on a
/// kept-alive connection: the answer to a HEAD has no body (RFC 9110 §9.3.2), so the
/// next bytes on the connection are the next response. The lane wrote its JSON body
/// after the head and kept the connection, so the sender read `{"endpoint":...` where
/// the next status line should be. hyper's path (the same requests with `Connection:
/// x-hop`) is checked alike.
#[tokio::test]
async fn a_refused_head_request_gets_no_body_on_a_kept_connection() {
    let up = Upstream::start().await;
    let s = sluice("[defaults]\nrate = 0.001\nburst = 1.0\nmax_wait = \"0s\"\n").await;
    let host = up.addr;
    for (i, connection) in ["x-hop", "keep-alive"].into_iter().enumerate() {
        let ep = format!("head-{i}");
        let req = |method: &str, path: &str, ep: &str| {
            format!(
                "{method} http://{host}{path} HTTP/1.1\r\nHost: {host}\r\nConnection: {connection}\r\nX-Endpoint-Id: {ep}\r\n\r\n"
            )
        };
        let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
        // Spends the endpoint's only token.
        t.write_all(req("GET", "/warm", &ep).as_bytes())
            .await
            .unwrap();
        let r = read_response(&mut t).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{connection}: {r}");
        // A HEAD refused (no token), then a GET on another endpoint (granted).
        let two = req("HEAD", "/h", &ep) + &req("GET", "/next", &format!("{ep}-other"));
        t.write_all(two.as_bytes()).await.unwrap();
        // Done once a second head and a body of its length are in.
        let (got, _) = read_until(&mut t, |b| {
            let text = String::from_utf8_lossy(b);
            text.matches("\r\n\r\n").count() >= 2 && text.ends_with("ok")
        })
        .await;
        let end = got.find("\r\n\r\n").expect("a head") + 4;
        assert!(got.starts_with("HTTP/1.1 503"), "{connection}: {got}");
        assert!(
            got[end..].starts_with("HTTP/1.1 200"),
            "{connection}: after the HEAD's answer, the next response follows at once; got {:?}",
            &got[end..]
        );
    }
    s.stop().await;
}

/// A request head over 64 KiB is a 431
/// (docs/SPEC.md's table). The lane checked the limit only while the head was
/// incomplete: a head whose last piece took it past 64 KiB in one read was complete at
/// its first parse past the limit, and was forwarded.
#[tokio::test]
async fn a_request_head_over_64_kib_is_a_431_however_it_arrives() {
    let up = Upstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
    let start = format!("GET http://{host}/big HTTP/1.1\r\nHost: {host}\r\nX-Big: ");
    let mut first = start.into_bytes();
    first.resize(65_000, b'a');
    t.write_all(&first).await.unwrap();
    // Not a synchronisation: the answer must be a 431 however the bytes arrive; the
    // pause makes the lane read the first 65,000 bytes before the rest, as reported.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut rest = vec![b'a'; 1_000];
    rest.extend_from_slice(b"\r\n\r\n");
    t.write_all(&rest).await.unwrap();
    let r = read_response(&mut t).await;
    let head_len = first.len() + rest.len();
    assert!(head_len > 64 * 1024);
    assert!(
        r.starts_with("HTTP/1.1 431"),
        "a {head_len}-byte head: {}; the receiver saw {} request(s)",
        &r[..r.len().min(200)],
        up.count()
    );
    assert_eq!(up.count(), 0, "nothing reached the receiver");
    s.stop().await;
}

/// A TLS receiver whose first answer is exactly 8192 bytes (the lane's read buffer)
/// and is followed, in the same TLS record, by bytes no request asked for. The lane
/// reads 8192 bytes of plaintext, the response ends there, `up.buf` is empty, and
/// `still_open` looks only at the TCP socket's readiness (drained by rustls), so the
/// upstream connection was kept although rustls held the stray bytes: the next
/// request on it was answered with them, before it was even sent.
#[tokio::test]
async fn a_tls_upstream_connection_holding_stray_bytes_is_not_reused() {
    use common::tls::TestPki;
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(&["localhost"]);
    // The raw TLS receiver.
    let acceptor = pki.acceptor();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up_addr = listener.local_addr().unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen2 = Arc::clone(&seen);
    let server = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let Ok(mut tls) = acceptor.accept(tcp).await else {
                continue;
            };
            let seen = Arc::clone(&seen2);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let end = loop {
                        if let Some(e) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break e + 4;
                        }
                        match tls.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_string();
                    buf.drain(..end);
                    let path = head.split(' ').nth(1).unwrap_or("").to_string();
                    let first = seen.lock().unwrap().is_empty();
                    seen.lock().unwrap().push(path);
                    let answer = if first {
                        let n = 8192 - "HTTP/1.1 200 OK\r\nContent-Length: 8151\r\n\r\n".len();
                        assert_eq!(n, 8151);
                        let mut a =
                            format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n\r\n").into_bytes();
                        a.extend(std::iter::repeat_n(b'x', n));
                        assert_eq!(a.len(), 8192);
                        a.extend_from_slice(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nstray!");
                        a
                    } else {
                        b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nreal".to_vec()
                    };
                    if tls.write_all(&answer).await.is_err() || tls.flush().await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let ca = sluice::tls::generate_ca(&dir.path().join("ca")).unwrap();
    let up_ca = pki.write_ca(dir.path());
    let s = sluice(&format!(
        "[tls]\nintercept = true\nca_cert = \"{}\"\nca_key = \"{}\"\nupstream_roots = [\"{}\"]\n",
        ca.cert.display(),
        ca.key.display(),
        up_ca.display()
    ))
    .await;
    let host = format!("localhost:{}", up_addr.port());
    let mut t = common::tls::tunnel_session(s.proxy_addr, &ca.cert, &host, "localhost").await;
    // Reads one response framed by its Content-Length.
    async fn one<S: tokio::io::AsyncRead + Unpin>(t: &mut S) -> String {
        let mut got = Vec::new();
        let mut b = [0u8; 4096];
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                if let Some(e) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&got[..e]).to_ascii_lowercase();
                    let n: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map(|v| v.trim().parse().unwrap())
                        .unwrap_or(0);
                    if got.len() >= e + 4 + n {
                        break;
                    }
                }
                let n = t.read(&mut b).await.unwrap();
                assert!(n > 0, "closed");
                got.extend_from_slice(&b[..n]);
            }
        })
        .await
        .expect("a response within 5 s");
        String::from_utf8_lossy(&got).into_owned()
    }
    t.write_all(format!("GET /one HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let r1 = one(&mut t).await;
    assert!(r1.starts_with("HTTP/1.1 200"), "{r1}");
    // Not a synchronisation: the answer must be right however soon /two follows;
    // the pause lets the stray bytes reach sluice first, as they did in the report.
    tokio::time::sleep(Duration::from_millis(200)).await;
    t.write_all(format!("GET /two HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let r2 = one(&mut t).await;
    assert!(
        r2.ends_with("real"),
        "the answer to /two must be the receiver's answer to /two; got {r2:?} (receiver saw {:?})",
        seen.lock().unwrap()
    );
    server.abort();
    s.stop().await;
}
