//! Connections under pressure: the connection cap and its backlog, idle, header and
//! handshake timeouts, slow and malformed uploads, oversized heads, admin probes past
//! idle sockets, and what a reload does to pooled connections, at a real listener.

mod common;

use std::time::Duration;

use tokio::time::Instant;

use common::{Upstream, raw_head as raw, read_head, wait_for_metric};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// An open tunnel holds its place under `max_connections` and counts in
/// `sluice_connections_open`; an idle tunnel is closed after `tunnel_idle_timeout`.
#[tokio::test]
async fn tunnels_count_against_max_connections_and_close_when_idle() {
    let up = Upstream::start().await;
    let s = common::sluice(
        "[proxy]\nmax_connections = 2\ntunnel_idle_timeout = \"1s\"\n[defaults]\nrate = 1000.0\n",
    )
    .await;
    let connect = format!("CONNECT {0} HTTP/1.1\r\nHost: {0}\r\n\r\n", up.addr);
    let mut tunnels = Vec::new();
    for _ in 0..2 {
        let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
        t.write_all(connect.as_bytes()).await.unwrap();
        let head = read_head(&mut t).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        tunnels.push(t);
    }
    wait_for_metric(s.admin_addr, "sluice_connections_open 2").await;
    // A third sender waits: both places are held by tunnels.
    let mut third = TcpStream::connect(s.proxy_addr).await.unwrap();
    third
        .write_all(format!("GET {} HTTP/1.1\r\nHost: x\r\n\r\n", up.url("/third")).as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let early = tokio::time::timeout(Duration::from_millis(300), third.read(&mut buf)).await;
    assert!(
        early.is_err(),
        "a third connection was served at max_connections = 2"
    );
    // Idle tunnels end after tunnel_idle_timeout: the sender sees the close…
    let started = Instant::now();
    for t in &mut tunnels {
        let n = tokio::time::timeout(Duration::from_secs(10), t.read(&mut buf))
            .await
            .expect("idle tunnel closed within the timeout")
            .unwrap_or(0);
        assert_eq!(n, 0);
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    // …and the waiting sender is served.
    let head = read_head(&mut third).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    s.stop().await;
}

/// A kept-alive sender waiting for its next request is held to `idle_timeout`, not to
/// `header_read_timeout` (hyper's header timer ran from the end of each response, so
/// sluice closed such connections after 30 s although `idle_timeout` is 2 minutes, and
/// a client reusing one a moment later lost its request); a sender that begins a head
/// and trickles it is cut off between `header_read_timeout` and half as long again
/// after its first byte, with nothing forwarded; a new connection that sends nothing
/// owes its first head within the same limit.
#[tokio::test]
async fn kept_alive_senders_wait_for_idle_timeout_and_trickled_heads_are_cut() {
    let up = Upstream::start().await;
    let s = common::sluice(
        "[proxy]\nidle_timeout = \"4s\"\nheader_read_timeout = \"1s\"\n[defaults]\nrate = 1000.0\n",
    )
    .await;
    let get = |path: &str| format!("GET {} HTTP/1.1\r\nHost: {}\r\n\r\n", up.url(path), up.addr);

    let kept = async {
        let mut c = TcpStream::connect(s.proxy_addr).await.unwrap();
        c.write_all(get("/first").as_bytes()).await.unwrap();
        let first = common::read_response(&mut c).await;
        assert!(first.starts_with("HTTP/1.1 200"), "{first}");
        // Longer than the header-read limit and half again, shorter than idle_timeout.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        c.write_all(get("/second").as_bytes()).await.unwrap();
        let second = common::read_response(&mut c).await;
        assert!(
            second.starts_with("HTTP/1.1 200"),
            "a kept-alive connection quiet for 2.5 s (idle_timeout 4 s) was closed: {second:?}"
        );
        // Then idle_timeout closes it: never sooner, at most half as long again (and
        // 2 s for a loaded test machine).
        let after = closed_unanswered(&mut c, Instant::now(), "an idle connection").await;
        assert!(
            after >= Duration::from_secs(4) && after < Duration::from_secs(8),
            "idle connection closed after {after:?}"
        );
    };

    let trickled = async {
        let mut c = TcpStream::connect(s.proxy_addr).await.unwrap();
        let head = get("/trickled");
        let first_line = &head[..head.find("\r\n").unwrap() + 2];
        c.write_all(first_line.as_bytes()).await.unwrap();
        let began = Instant::now();
        let (mut rd, mut wr) = c.into_split();
        // A header line every 100 ms, never the blank line that ends the head (at most
        // 5 s of it).
        let trickle = async {
            for i in 0..50 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if wr
                    .write_all(format!("X-Slow-{i}: 1\r\n").as_bytes())
                    .await
                    .is_err()
                {
                    break;
                }
            }
        };
        let closed = closed_unanswered(&mut rd, began, "a trickled head");
        let (_, after) = tokio::join!(trickle, closed);
        assert!(
            after >= Duration::from_secs(1) && after < Duration::from_millis(3500),
            "trickled head cut after {after:?} (header_read_timeout 1 s)"
        );
    };

    // A sender that connects and says nothing owes its first head all the same.
    let silent = async {
        let mut c = TcpStream::connect(s.proxy_addr).await.unwrap();
        let began = Instant::now();
        let after = closed_unanswered(&mut c, began, "a silent new connection").await;
        assert!(
            after >= Duration::from_secs(1) && after < Duration::from_millis(3500),
            "silent connection closed after {after:?} (header_read_timeout 1 s)"
        );
    };

    tokio::join!(kept, trickled, silent);
    let paths: Vec<String> = up.arrivals().iter().map(|a| a.path.clone()).collect();
    assert_eq!(paths, ["/first", "/second"], "arrivals: {paths:?}");
    s.stop().await;
}

/// Waits (at most 10 s) for sluice to close `r` without sending a byte; returns the time
/// since `since`.
async fn closed_unanswered(
    r: &mut (impl tokio::io::AsyncRead + Unpin),
    since: Instant,
    what: &str,
) -> Duration {
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), r.read(&mut buf))
        .await
        .unwrap_or_else(|_| panic!("{what} was not closed within 10 s"))
        .unwrap_or(0);
    assert_eq!(
        n,
        0,
        "{what} got an answer: {:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    since.elapsed()
}

/// A sender that opens an intercepted tunnel and never starts TLS is cut off
/// after `tls.handshake_timeout`.
#[tokio::test]
async fn a_silent_intercepted_tunnel_hits_the_handshake_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let files = sluice::tls::generate_ca(&dir.path().join("ca")).unwrap();
    let s = common::sluice(&format!(
        "[tls]\nintercept = true\nhandshake_timeout = \"500ms\"\nca_cert = \"{}\"\nca_key = \"{}\"\n",
        files.cert.display(),
        dir.path().join("ca/ca.key").display()
    ))
    .await;
    let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
    t.write_all(b"CONNECT example.test:443 HTTP/1.1\r\nHost: example.test:443\r\n\r\n")
        .await
        .unwrap();
    let head = read_head(&mut t).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let started = Instant::now();
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(10), t.read(&mut buf))
        .await
        .expect("closed after the handshake timeout")
        .unwrap_or(0);
    assert_eq!(n, 0);
    assert!(started.elapsed() < Duration::from_secs(5));
    wait_for_metric(s.admin_addr, "sluice_connections_open 0").await;
    s.stop().await;
}

/// Hundreds of idle sockets on the admin listener do not starve probes.
#[tokio::test]
async fn admin_probes_are_answered_past_hundreds_of_idle_sockets() {
    let s = common::sluice("").await;
    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(TcpStream::connect(s.admin_addr).await.unwrap());
    }
    let started = Instant::now();
    let head = raw(
        s.admin_addr,
        "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // And the idle ones are let go.
    let mut buf = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_secs(15), idle[0].read(&mut buf))
        .await
        .expect("idle admin socket closed")
        .unwrap_or(0);
    assert_eq!(n, 0);
    s.stop().await;
}

/// After a reload that tightens the destination policy, a kept-alive
/// upstream connection cannot carry a request to a now-refused address.
#[tokio::test]
async fn reload_drops_pooled_connections_to_refused_addresses() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let text = |private: bool| {
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[security]\nallow_private_destinations = {private}\n"
        )
    };
    std::fs::write(&path, text(true)).unwrap();
    let s = sluice::app::start(sluice::config::Config::load(&path).unwrap())
        .await
        .unwrap();
    let c = common::client(s.proxy_addr);
    let url = format!("http://localhost:{}/", up.addr.port());
    for _ in 0..3 {
        assert_eq!(c.get(&url).send().await.unwrap().status(), 200);
    }
    std::fs::write(&path, text(false)).unwrap();
    sluice::app::reload(&s.app, &path).unwrap();
    for _ in 0..3 {
        let r = c.get(&url).send().await.unwrap();
        assert_eq!(r.status(), 403, "a pooled connection carried the request");
    }
    assert_eq!(up.count(), 3);
    s.stop().await;
}

/// A sender's malformed body (bad chunked framing, or fewer bytes than its
/// `Content-Length`) is the sender's 400, not the upstream's 502.
/// Its head reached the receiver, so its token stays spent: the receiver sees no more heads
/// than the bound.
#[tokio::test]
async fn a_malformed_request_body_is_a_400_and_its_head_is_paid_for() {
    let up = Upstream::start().await;
    let s = sluice::app::start(common::config(
        "[[endpoints]]\nid = \"ep\"\nrate = 0.001\nburst = 3.0\nmax_wait = \"0\"\n",
    ))
    .await
    .unwrap();
    let target = up.url("/body");
    let host = up.addr;
    let mut answers = Vec::new();
    for _ in 0..5 {
        let chunked = raw(
            s.proxy_addr,
            &format!(
                "POST {target} HTTP/1.1\r\nHost: {host}\r\nX-Endpoint-Id: ep\r\n\
                 Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n"
            ),
        )
        .await;
        answers.push(chunked);

        let mut short = TcpStream::connect(s.proxy_addr).await.unwrap();
        let head = format!(
            "POST {target} HTTP/1.1\r\nHost: {host}\r\nX-Endpoint-Id: ep\r\n\
             Content-Length: 100\r\n\r\nonly this"
        );
        short.write_all(head.as_bytes()).await.unwrap();
        short.shutdown().await.unwrap();
        answers.push(read_head(&mut short).await);
    }
    // Each is the sender's 400 while tokens last, then a refusal before anything left.
    let bad = answers
        .iter()
        .filter(|a| a.starts_with("HTTP/1.1 400") && a.contains("x-sluice-reason: bad_request"))
        .count();
    let refused = answers
        .iter()
        .filter(|a| a.starts_with("HTTP/1.1 503") && a.contains("x-sluice-reason: rate_limited"))
        .count();
    assert_eq!((bad, refused), (3, 7), "{answers:#?}");
    assert!(
        up.count() <= 3,
        "{} heads reached the receiver, burst 3",
        up.count()
    );
    s.stop().await;
}

/// A reload keeps the running value of every setting read only at start,
/// names each that changed (one warning), and `/readyz` reports the `on_error` in force.
#[tokio::test]
async fn reload_keeps_and_names_every_restart_only_setting() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let text = |on_error: &str, timeout: &str, max: u32, cache: u32| {
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             upstream_timeout = \"{timeout}\"\nmax_connections = {max}\n\
             [store]\nbackend = \"memory\"\non_error = \"{on_error}\"\n\
             [tls]\nleaf_cache_size = {cache}\n[defaults]\nrate = 5.0\nburst = 5.0\n"
        )
    };
    std::fs::write(&path, text("deny", "30s", 1000, 100)).unwrap();
    let running = sluice::config::Config::load(&path).unwrap();
    let s = sluice::app::start(running.clone()).await.unwrap();
    let readyz = || async {
        let r = reqwest::get(format!("http://{}/readyz", s.admin_addr))
            .await
            .unwrap();
        r.json::<serde_json::Value>().await.unwrap()
    };
    assert_eq!(readyz().await["on_error"], "deny");

    std::fs::write(&path, text("local", "5s", 10, 7)).unwrap();
    let mut changed = sluice::config::Config::load(&path).unwrap();
    let named = sluice::app::keep_restart_only(&mut changed, &running);
    assert_eq!(
        named,
        [
            "proxy.max_connections",
            "proxy.upstream_timeout",
            "store.on_error",
            "tls.leaf_cache_size"
        ]
    );
    assert_eq!(changed.store.on_error, running.store.on_error);
    assert_eq!(
        changed.proxy.upstream_timeout,
        running.proxy.upstream_timeout
    );

    sluice::app::reload(&s.app, &path).unwrap();
    assert_eq!(
        readyz().await["on_error"],
        "deny",
        "/readyz reported the file's on_error, not the one in force"
    );
    let rt = s.app.runtime.load_full();
    assert_eq!(rt.config.proxy.max_connections, 1000);
    // A reloadable setting in the same file did change.
    std::fs::write(
        &path,
        text("local", "5s", 10, 7).replace("rate = 5.0", "rate = 9.0"),
    )
    .unwrap();
    sluice::app::reload(&s.app, &path).unwrap();
    assert_eq!(s.app.runtime.load_full().config.defaults.rate, 9.0);
    s.stop().await;
}

/// Senders that connect while every place under `max_connections` is taken wait in the
/// listen backlog and are served in turn. A fleet opening hundreds of connections at
/// once must not find the backlog full: there the kernel drops their SYNs, and each
/// such sender loses a second or more to its TCP retry (std's listeners kept 128).
#[tokio::test]
async fn hundreds_of_senders_wait_in_the_backlog_at_the_connection_cap() {
    const SENDERS: usize = 300;
    if let Ok(max) = std::fs::read_to_string("/proc/sys/net/core/somaxconn") {
        let max: usize = max.trim().parse().unwrap();
        assert!(
            max > SENDERS,
            "this machine caps listen backlogs at net.core.somaxconn = {max}: \
             raise it above {SENDERS} to run this test"
        );
    }
    let up = Upstream::start().await;
    let s = common::sluice(
        "[proxy]\nmax_connections = 1\n[defaults]\nrate = 100000.0\nburst = 100000.0\n",
    )
    .await;
    // One kept-alive sender holds the only place.
    let mut held = TcpStream::connect(s.proxy_addr).await.unwrap();
    let get = |path: &str, close: bool| {
        format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\n{}\r\n",
            up.url(path),
            up.addr,
            if close { "Connection: close\r\n" } else { "" }
        )
    };
    held.write_all(get("/held", false).as_bytes())
        .await
        .unwrap();
    assert!(read_head(&mut held).await.starts_with("HTTP/1.1 200"));
    // Every other sender connects at once; the kernel completes each handshake into the
    // backlog, or drops the SYN when the backlog is full (a retry 1 s later).
    let connects = (0..SENDERS).map(|_| {
        tokio::time::timeout(Duration::from_millis(700), TcpStream::connect(s.proxy_addr))
    });
    let results = futures_util::future::join_all(connects).await;
    let mut waiting: Vec<TcpStream> = results.into_iter().filter_map(|r| r.ok()?.ok()).collect();
    assert_eq!(
        waiting.len(),
        SENDERS,
        "senders connected within 700 ms while the cap was reached (the kernel dropped the others' SYNs)"
    );
    for (i, w) in waiting.iter_mut().enumerate() {
        w.write_all(get(&format!("/w{i}"), true).as_bytes())
            .await
            .unwrap();
    }
    // The place frees up: every waiting sender is served, one after another.
    drop(held);
    for w in &mut waiting {
        assert!(read_head(w).await.starts_with("HTTP/1.1 200"));
    }
    assert_eq!(up.count(), SENDERS + 1);
    s.stop().await;
}

/// `upstream_timeout` counts a request's silence, not its length. An upload that keeps
/// moving for three times the timeout is forwarded whole, on both engines (the lane for
/// a `Content-Length` body, hyper for a chunked one), on a fresh upstream connection and
/// on a held one; a sender that stops mid-body gets a 408 `request_timeout` once a
/// timeout passed since its last byte (its token stays spent: its head reached the
/// receiver), not a 504 `upstream_timeout` that blames the receiver.
#[tokio::test]
async fn a_long_upload_is_never_cut_and_a_stalled_one_is_the_senders_408() {
    // 24 pieces of 100 bytes: one every 75 ms keeps above the average an upload must
    // keep (500 B/s past its first timeout).
    const PIECES: usize = 24;
    const LEN: usize = PIECES * 100;
    let up = Upstream::start().await;
    let mut c = common::config("[[endpoints]]\nid = \"ep\"\nrate = 0.001\nburst = 10.0\n");
    let limit = Duration::from_millis(600);
    c.proxy.upstream_timeout = limit;
    let s = sluice::app::start(c).await.unwrap();
    let head = |path: &str, chunked: bool, len: usize| {
        let framing = if chunked {
            "Transfer-Encoding: chunked".to_owned()
        } else {
            format!("Content-Length: {len}")
        };
        format!(
            "POST {} HTTP/1.1\r\nHost: {}\r\nX-Endpoint-Id: ep\r\n{framing}\r\n\r\n",
            up.url(path),
            up.addr
        )
    };
    let byte = |chunked: bool| if chunked { &b"1\r\nx\r\n"[..] } else { b"x" };
    let hundred = [b'x'; 100];
    let chunk = [&b"64\r\n"[..], &hundred, b"\r\n"].concat();
    let piece = |chunked: bool| {
        if chunked {
            chunk.clone()
        } else {
            hundred.to_vec()
        }
    };
    let end = |chunked: bool| if chunked { &b"0\r\n\r\n"[..] } else { b"" };
    // The upstream's "ok" body may come with its head or be read with the next one.
    let ok = |answer: &str| answer.trim_start_matches("ok").starts_with("HTTP/1.1 200");
    for chunked in [false, true] {
        // Twice on one connection: the second goes out on the upstream connection held
        // for it.
        let mut c = TcpStream::connect(s.proxy_addr).await.unwrap();
        for _ in 0..2 {
            c.write_all(head("/long", chunked, LEN).as_bytes())
                .await
                .unwrap();
            // One piece every 75 ms: 1.8 s of upload, three timeouts.
            for _ in 0..PIECES {
                tokio::time::sleep(Duration::from_millis(75)).await;
                c.write_all(&piece(chunked)).await.unwrap();
            }
            c.write_all(end(chunked)).await.unwrap();
            let answer = read_head(&mut c).await;
            assert!(ok(&answer), "chunked {chunked}: {answer}");
        }
    }
    let long: Vec<_> = up
        .arrivals()
        .into_iter()
        .filter(|a| a.path == "/long")
        .collect();
    assert_eq!(long.len(), 4);
    assert!(long.iter().all(|a| a.body == vec![b'x'; LEN]), "{long:?}");

    for chunked in [false, true] {
        let mut c = TcpStream::connect(s.proxy_addr).await.unwrap();
        // A whole one first, so the stalled one goes out on a held connection too.
        c.write_all(head("/quick", chunked, 1).as_bytes())
            .await
            .unwrap();
        c.write_all(byte(chunked)).await.unwrap();
        c.write_all(end(chunked)).await.unwrap();
        assert!(ok(&read_head(&mut c).await));
        c.write_all(head("/stalled", chunked, LEN).as_bytes())
            .await
            .unwrap();
        for _ in 0..5 {
            c.write_all(&piece(chunked)).await.unwrap();
        }
        let last = Instant::now();
        let answer = read_head(&mut c).await;
        let answer = answer.trim_start_matches("ok");
        assert!(
            answer.starts_with("HTTP/1.1 408"),
            "chunked {chunked}: {answer}"
        );
        assert!(
            answer.contains("x-sluice-reason: request_timeout"),
            "{answer}"
        );
        assert!(
            last.elapsed() >= limit,
            "cut {:?} after the last byte",
            last.elapsed()
        );
    }
    // Six whole requests and two stalled ones (their heads reached the receiver) spent
    // eight of ten tokens.
    let left = common::tokens(s.admin_addr, "ep")
        .await
        .expect("ep has a bucket");
    assert!(
        (1.99..2.1).contains(&left),
        "{left} tokens left of 10 after eight heads"
    );
    s.stop().await;
}

/// An upload must keep moving on average too: a byte every half
/// timeout never trips the silence rule, and held a connection and a `max_in_flight`
/// slot for as long as the sender liked (14 s, seven timeouts). It is
/// cut with the sender's 408 once `upstream_timeout` plus a second per 500 bytes has
/// passed, on both engines, and its slot goes to the next sender.
#[tokio::test]
async fn a_trickled_upload_is_cut_at_its_average_and_frees_its_slot() {
    let up = Upstream::start().await;
    let mut c = common::config(
        "[[endpoints]]\nid = \"ep\"\nrate = 1000.0\nburst = 10.0\nmax_in_flight = 1\nmax_wait = \"10s\"\n",
    );
    let limit = Duration::from_millis(600);
    c.proxy.upstream_timeout = limit;
    let s = sluice::app::start(c).await.unwrap();
    for chunked in [false, true] {
        let framing = if chunked {
            "Transfer-Encoding: chunked"
        } else {
            "Content-Length: 1000"
        };
        let head = format!(
            "POST {} HTTP/1.1\r\nHost: {}\r\nX-Endpoint-Id: ep\r\n{framing}\r\n\r\n",
            up.url("/trickle"),
            up.addr
        );
        let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
        t.write_all(head.as_bytes()).await.unwrap();
        let started = Instant::now();
        // A byte every 300 ms (half the timeout), for at most 5 s, until answered.
        let mut answer = String::new();
        let mut buf = [0u8; 1024];
        while started.elapsed() < Duration::from_secs(5) {
            let byte: &[u8] = if chunked { b"1\r\nx\r\n" } else { b"x" };
            if t.write_all(byte).await.is_err() {
                break;
            }
            match tokio::time::timeout(Duration::from_millis(300), t.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => {
                    answer = String::from_utf8_lossy(&buf[..n]).into_owned();
                    break;
                }
                Ok(_) => break,
                Err(_) => {}
            }
        }
        let cut = started.elapsed();
        assert!(
            answer.starts_with("HTTP/1.1 408"),
            "chunked {chunked}: {answer:?} after {cut:?}"
        );
        assert!(
            cut < Duration::from_secs(2),
            "chunked {chunked}: cut after {cut:?}"
        );
        // The slot is free: the next sender is served at once.
        let c = common::client(s.proxy_addr);
        let r = c
            .get(up.url("/next"))
            .header("x-endpoint-id", "ep")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    s.stop().await;
}

/// A request head no HTTP/1.1 server would read gets sluice's own answer, like every other
/// refusal: `X-Sluice-Reason: bad_request` and a JSON body saying what was wrong, then the
/// connection closes.
#[tokio::test]
async fn a_malformed_or_oversized_head_gets_a_clear_refusal() {
    let up = Upstream::start().await;
    let s = common::sluice("").await;
    let target = up.url("/x");
    let cases = [
        ("garbage", "GARBAGE\r\n\r\n".to_string(), "400", "malformed"),
        (
            "a space in a header name",
            format!("GET {target} HTTP/1.1\r\nHo st: x\r\n\r\n"),
            "400",
            "malformed",
        ),
        (
            "an obsolete folded header",
            format!("GET {target} HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n"),
            "400",
            "malformed",
        ),
        (
            "a head over 64 KiB",
            format!(
                "GET {target} HTTP/1.1\r\nX-Big: {}\r\n\r\n",
                "a".repeat(70_000)
            ),
            "431",
            "too large",
        ),
        (
            "101 headers",
            format!(
                "GET {target} HTTP/1.1\r\n{}\r\n",
                (0..101)
                    .map(|i| format!("X-{i}: v\r\n"))
                    .collect::<String>()
            ),
            "431",
            "too large",
        ),
    ];
    for (what, request, status, says) in cases {
        let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
        t.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), t.read_to_end(&mut answer));
        assert!(read.await.is_ok(), "{what}: the connection did not close");
        let answer = String::from_utf8_lossy(&answer).to_lowercase();
        assert!(
            answer.starts_with(&format!("http/1.1 {status} ")),
            "{what}: {answer}"
        );
        assert!(
            answer.contains("x-sluice-reason: bad_request"),
            "{what}: {answer}"
        );
        assert!(answer.contains("connection: close"), "{what}: {answer}");
        let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
        assert!(
            body.contains("\"reason\":\"bad_request\"") && body.contains(says),
            "{what}: {body}"
        );
    }
    assert!(up.arrivals().is_empty(), "nothing reached the receiver");
    s.stop().await;
}
