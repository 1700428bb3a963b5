//! The core path over real sockets: plain HTTP and CONNECT through sluice (memory
//! store) to a real upstream that records arrival times.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use common::{Reply, Upstream, assert_no_overdraw, client, sluice, sustained_rate};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

// Virtual time: pacing over real loopback sockets, with no wall-clock wait.
#[tokio::test(start_paused = true)]
async fn sixteen_senders_never_overdraw_and_use_the_rate() {
    let up = Upstream::start().await;
    let (rate, burst) = (100.0, 10.0);
    let s = sluice(&format!(
        "[defaults]\nrate = {rate}\nburst = {burst}\nmax_wait = \"30s\"\n"
    ))
    .await;
    let c = client(s.proxy_addr);
    let mut tasks = Vec::new();
    for sender in 0..16 {
        let (c, url) = (c.clone(), up.url(&format!("/s{sender}")));
        tasks.push(tokio::spawn(async move {
            let mut ok = 0;
            for _ in 0..25 {
                let r = c
                    .get(&url)
                    .header("x-endpoint-id", "ep")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                ok += 1;
            }
            ok
        }));
    }
    let mut granted = 0;
    for t in tasks {
        granted += t.await.unwrap();
    }
    let times: Vec<Instant> = up.arrivals().iter().map(|a| a.at).collect();
    assert_eq!(
        times.len(),
        granted,
        "every granted request arrived exactly once"
    );
    assert_no_overdraw(&times, rate, burst);
    let achieved = sustained_rate(&times, burst as usize);
    eprintln!("utilization: {:.1}% of {rate}/s", achieved / rate * 100.0);
    assert!(
        achieved >= 0.95 * rate,
        "sustained {achieved:.1}/s < 95% of {rate}/s"
    );
    s.stop().await;
}

// Virtual time: pacing over real loopback sockets, with no wall-clock wait.
#[tokio::test(start_paused = true)]
async fn waiting_requests_are_served_in_arrival_order() {
    // The first answer says the quota is spent for 1 s: a pause without a decrease, which
    // also stops refill, so each waiter's reservation shows as exactly one token less.
    let up = Upstream::with(Arc::new(|a| {
        if a.path == "/quota" {
            Reply::ok()
                .header("x-ratelimit-remaining", "0")
                .header("x-ratelimit-reset", "1")
        } else {
            Reply::ok()
        }
    }))
    .await;
    let s = sluice("[defaults]\nrate = 20.0\nburst = 1.0\nmax_wait = \"10s\"\n").await;
    let c = client(s.proxy_addr);
    let r = c
        .get(up.url("/quota"))
        .header("x-endpoint-id", "fifo")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut tasks = Vec::new();
    for i in 0..12 {
        let (c, url) = (c.clone(), up.url(&format!("/seq/{i}")));
        tasks.push(tokio::spawn(async move {
            c.get(&url)
                .header("x-endpoint-id", "fifo")
                .send()
                .await
                .unwrap()
                .status()
        }));
        // The next sender starts only once this one holds its reservation.
        common::wait_for_tokens_below(s.admin_addr, "fifo", -(i as f64)).await;
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let order: Vec<String> = up
        .arrivals()
        .iter()
        .map(|a| a.path.clone())
        .filter(|p| p.starts_with("/seq/"))
        .collect();
    let expected: Vec<String> = (0..12).map(|i| format!("/seq/{i}")).collect();
    assert_eq!(order, expected);
    s.stop().await;
}

// Virtual time: pacing over real loopback sockets, with no wall-clock wait.
#[tokio::test(start_paused = true)]
async fn refusal_is_503_with_retry_after_and_consumes_nothing() {
    let up = Upstream::start().await;
    let s = sluice("[defaults]\nrate = 2.0\nburst = 1.0\nmax_wait = \"0s\"\n").await;
    let c = client(s.proxy_addr);
    let first = c
        .get(up.url("/a"))
        .header("x-endpoint-id", "r")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    let mut last_retry_ms = 0;
    for _ in 0..5 {
        let r = c
            .get(up.url("/refused"))
            .header("x-endpoint-id", "r")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()["x-sluice-reason"], "rate_limited");
        let retry: u64 = r.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(retry >= 1);
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["reason"], "rate_limited");
        assert_eq!(body["endpoint"], "r");
        let ms = body["retry_after_ms"].as_u64().unwrap();
        assert!(ms > 0 && ms <= 500, "{ms}");
        last_retry_ms = ms;
    }
    // The refusals took nothing: one token is back when the last refusal said it would.
    // (Waiting out Retry-After is what a sender is told to do, not a readiness guess.)
    tokio::time::sleep(Duration::from_millis(last_retry_ms)).await;
    let again = c
        .get(up.url("/b"))
        .header("x-endpoint-id", "r")
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    let paths: Vec<String> = up.arrivals().iter().map(|a| a.path.clone()).collect();
    assert_eq!(
        paths,
        ["/a", "/b"],
        "refused requests never reach the upstream"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturating_one_endpoint_adds_no_wait_to_another() {
    let up = Upstream::start().await;
    let s = sluice("[defaults]\nrate = 5.0\nburst = 1.0\nmax_wait = \"20s\"\n").await;
    let c = client(s.proxy_addr);
    let mut hogs = Vec::new();
    for _ in 0..20 {
        let (c, url) = (c.clone(), up.url("/hog"));
        hogs.push(tokio::spawn(async move {
            c.get(&url)
                .header("x-endpoint-id", "busy")
                .send()
                .await
                .map(|r| r.status())
        }));
    }
    // Hogs are queued inside sluice (at least ten reservations beyond the burst).
    common::wait_for_tokens_below(s.admin_addr, "busy", -9.0).await;
    for i in 0..5 {
        let started = Instant::now();
        let r = c
            .get(up.url("/quiet"))
            .header("x-endpoint-id", format!("quiet{i}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert!(
            started.elapsed() < Duration::from_millis(250),
            "quiet endpoint waited {:?}",
            started.elapsed()
        );
    }
    for h in hogs {
        h.abort();
    }
    s.stop().await;
}

#[tokio::test]
async fn hop_by_hop_and_proxy_headers_never_reach_the_upstream() {
    let up = Upstream::start().await;
    let s = sluice("").await;
    let c = client(s.proxy_addr);
    let r = c
        .post(up.url("/h"))
        .header("x-endpoint-id", "hyg")
        .header("proxy-authorization", "Basic dTpw")
        .header("connection", "x-drop-me")
        .header("x-drop-me", "1")
        .header("keep-alive", "timeout=5")
        .header("proxy-connection", "keep-alive")
        .header("te", "trailers")
        .header("x-keep", "yes")
        .body("payload")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let a = &up.arrivals()[0];
    for h in [
        "x-endpoint-id",
        "proxy-authorization",
        "x-drop-me",
        "keep-alive",
        "proxy-connection",
        "te",
    ] {
        assert!(!a.headers.contains_key(h), "{h} reached the upstream");
    }
    assert_eq!(a.headers["x-keep"], "yes");
    assert_eq!(a.body, "payload");
    s.stop().await;
}

async fn raw(addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    common::raw_exchange(addr, bytes).await
}

#[tokio::test]
async fn bad_input_gets_4xx_and_the_proxy_keeps_serving() {
    let up = Upstream::start().await;
    let s = sluice("").await;
    let garbage = raw(s.proxy_addr, b"\x16\x03\x01\x00\xff garbage\r\n\r\n").await;
    assert!(garbage.starts_with("HTTP/1.1 400"), "{garbage}");
    let big = format!(
        "GET {} HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        up.url("/"),
        "a".repeat(200 * 1024)
    );
    let big = raw(s.proxy_addr, big.as_bytes()).await;
    assert!(big.starts_with("HTTP/1.1 431"), "{big}");
    let origin = raw(
        s.proxy_addr,
        b"GET /index.html HTTP/1.1\r\nHost: sluice\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(origin.starts_with("HTTP/1.1 400"), "{origin}");
    assert!(origin.contains("proxy"), "{origin}");
    assert_eq!(up.count(), 0);
    let ok = client(s.proxy_addr)
        .get(up.url("/after"))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    s.stop().await;
}

/// Plain HTTP inside a CONNECT tunnel is paced request by request: the CONNECT's token
/// is its first request's, the next one waits for a token of its own (here refused at
/// once, inside the tunnel, which stays open), and the tunnel's requests are under the
/// endpoint the CONNECT named.
#[tokio::test]
async fn plain_http_in_a_connect_tunnel_is_paced_per_request() {
    let up = Upstream::start().await;
    let s = sluice("[defaults]\nrate = 1.0\nburst = 1.0\nmax_wait = \"0s\"\n").await;
    let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
    let connect = format!(
        "CONNECT {0} HTTP/1.1\r\nHost: {0}\r\nX-Endpoint-Id: tun\r\n\r\n",
        up.addr
    );
    t.write_all(connect.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = t.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let mut answers = Vec::new();
    for i in 0..2 {
        let req = format!("GET /in-tunnel/{i} HTTP/1.1\r\nHost: {}\r\n\r\n", up.addr);
        t.write_all(req.as_bytes()).await.unwrap();
        answers.push(common::read_response(&mut t).await);
    }
    assert!(answers[0].starts_with("HTTP/1.1 200"), "{}", answers[0]);
    assert!(answers[1].starts_with("HTTP/1.1 503"), "{}", answers[1]);
    let refusal = answers[1].to_ascii_lowercase();
    assert!(
        refusal.contains("x-sluice-reason: rate_limited"),
        "{refusal}"
    );
    assert!(refusal.contains("\"endpoint\":\"tun\""), "{refusal}");
    // A second CONNECT on the same endpoint is refused: no token left.
    let second = raw(s.proxy_addr, connect.as_bytes()).await;
    assert!(second.starts_with("HTTP/1.1 503"), "{second}");
    assert_eq!(up.count(), 1);
    assert_eq!(up.arrivals()[0].path, "/in-tunnel/0");
    // Close the tunnel: shutdown would otherwise wait its grace period for it.
    drop(t);
    s.stop().await;
}

#[tokio::test]
async fn upstream_failures_map_to_502_and_504() {
    let slow = Upstream::with(Arc::new(|_| Reply::ok().delay(Duration::from_secs(3)))).await;
    let s = sluice_with_timeout().await;
    let c = client(s.proxy_addr);
    let r = c.get(slow.url("/slow")).send().await.unwrap();
    assert_eq!(r.status(), 504);
    assert_eq!(r.headers()["x-sluice-reason"], "upstream_timeout");
    // Nothing listens on this port any more.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let r = c.get(format!("http://{dead}/")).send().await.unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(r.headers()["x-sluice-reason"], "upstream_error");
    s.stop().await;
}

/// A kept-alive sender's own upstream connection (from its second request on) has its
/// wait for each response bounded afresh: a quiet pause longer than the timeout does
/// not count against the next request, a slow answer is cut at the timeout (not
/// before), and the connection keeps serving afterwards.
#[tokio::test]
async fn each_held_request_gets_the_whole_upstream_timeout() {
    let up = Upstream::with(Arc::new(|a: &common::Arrival| {
        if a.path == "/slow" {
            Reply::ok().delay(Duration::from_secs(3))
        } else {
            Reply::ok()
        }
    }))
    .await;
    let s = sluice_with_timeout().await; // upstream_timeout = 300ms
    let c = client(s.proxy_addr);
    let get = |path: &'static str| {
        let (c, url) = (c.clone(), up.url(path));
        async move {
            let r = c.get(url).send().await.unwrap();
            (
                r.status().as_u16(),
                r.headers().get("x-sluice-reason").cloned(),
            )
        }
    };
    assert_eq!(get("/1").await.0, 200, "through the pool");
    assert_eq!(get("/2").await.0, 200, "opens the held connection");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(get("/3").await.0, 200, "a quiet pause is not waited for");
    let started = std::time::Instant::now();
    let (status, reason) = get("/slow").await;
    let took = started.elapsed();
    assert_eq!(status, 504);
    assert_eq!(reason.unwrap(), "upstream_timeout");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(2500),
        "cut after {took:?}"
    );
    assert_eq!(get("/4").await.0, 200, "still serving");
    assert_eq!(get("/5").await.0, 200);
    let paths: Vec<String> = up.arrivals().iter().map(|a| a.path.clone()).collect();
    assert_eq!(paths, ["/1", "/2", "/3", "/slow", "/4", "/5"], "each once");
    s.stop().await;
}

async fn sluice_with_timeout() -> sluice::app::Running {
    let text = "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nupstream_timeout = \"300ms\"\n\
                [security]\nallow_private_destinations = true\n";
    sluice::app::start(sluice::config::Config::parse(text).unwrap())
        .await
        .unwrap()
}

#[tokio::test]
async fn destination_policy_refuses_before_sending() {
    let up = Upstream::start().await;
    let text = "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n";
    let s = sluice::app::start(sluice::config::Config::parse(text).unwrap())
        .await
        .unwrap();
    let c = client(s.proxy_addr);
    let r = c.get(up.url("/private")).send().await.unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(r.headers()["x-sluice-reason"], "destination_denied");
    let r = c
        .get(format!("http://localhost:{}/by-name", up.addr.port()))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        403,
        "a name resolving to loopback is refused after resolution"
    );
    let tunnel = raw(
        s.proxy_addr,
        format!("CONNECT {0} HTTP/1.1\r\nHost: {0}\r\n\r\n", up.addr).as_bytes(),
    )
    .await;
    assert!(tunnel.starts_with("HTTP/1.1 403"), "{tunnel}");
    assert_eq!(up.count(), 0);
    s.stop().await;

    let text = "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
                [security]\nallow_private_destinations = true\nallowed_hosts = [\"allowed.test\"]\n";
    let s = sluice::app::start(sluice::config::Config::parse(text).unwrap())
        .await
        .unwrap();
    let r = client(s.proxy_addr)
        .get(up.url("/not-listed"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(up.count(), 0);
    s.stop().await;
}

#[tokio::test]
async fn unknown_endpoints_rejected_when_configured() {
    let up = Upstream::start().await;
    let s = sluice("[defaults]\nunknown = \"reject\"\n[[endpoints]]\nid = \"known\"\n").await;
    let c = client(s.proxy_addr);
    let r = c
        .get(up.url("/"))
        .header("x-endpoint-id", "stranger")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    assert_eq!(r.headers()["x-sluice-reason"], "unknown_endpoint");
    let r = c
        .get(up.url("/"))
        .header("x-endpoint-id", "known")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(up.count(), 1);
    s.stop().await;
}

#[tokio::test]
async fn shutdown_lets_waiting_requests_finish() {
    let up = Upstream::start().await;
    let s = sluice("[defaults]\nrate = 2.0\nburst = 1.0\nmax_wait = \"5s\"\n").await;
    let c = client(s.proxy_addr);
    let get = |c: &reqwest::Client, path: &str| {
        c.get(up.url(path)).header("x-endpoint-id", "shut").send()
    };
    assert_eq!(get(&c, "/1").await.unwrap().status(), 200);
    let waiting = tokio::spawn(get(&c, "/2"));
    // The second request holds a reservation (the balance went below 0) before shutdown.
    common::wait_for_tokens_below(s.admin_addr, "shut", 0.0).await;
    s.stop().await;
    assert_eq!(
        waiting.await.unwrap().unwrap().status(),
        200,
        "the waiting request was served before exit"
    );
    let paths: HashSet<String> = up.arrivals().iter().map(|a| a.path.clone()).collect();
    assert!(paths.contains("/2"));
}

#[tokio::test]
async fn admin_endpoints_and_metrics() {
    let up = Upstream::start().await;
    let s = sluice("[[endpoints]]\nid = \"listed\"\nrate = 7.0\nburst = 3.0\n").await;
    let c = client(s.proxy_addr);
    c.get(up.url("/"))
        .header("x-endpoint-id", "listed")
        .send()
        .await
        .unwrap();
    let admin = reqwest::Client::new();
    let base = format!("http://{}", s.admin_addr);
    assert_eq!(
        admin
            .get(format!("{base}/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        admin
            .get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let eps: serde_json::Value = admin
        .get(format!("{base}/endpoints"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let listed = eps
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["id"] == "listed")
        .unwrap();
    assert_eq!(listed["configured_rate"], 7.0);
    assert_eq!(listed["burst"], 3.0);
    assert!((listed["tokens"].as_f64().unwrap() - 2.0).abs() < 0.2);
    assert_eq!(
        listed["held_ahead"], 0.0,
        "the memory store takes nothing ahead"
    );
    let metrics = admin
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("sluice_requests_total{endpoint=\"listed\",outcome=\"forwarded\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("sluice_wait_seconds_bucket{"), "{metrics}");
    s.stop().await;
}

/// Shadow mode: nothing waits and nothing is refused, but what enforcing would have
/// done is counted.
#[tokio::test]
async fn shadow_mode_forwards_everything_and_counts_what_would_have_been_refused() {
    let up = Upstream::start().await;
    let s = common::sluice(
        "[[endpoints]]\nid = \"shadowed\"\nmode = \"shadow\"\nrate = 0.01\nburst = 2.0\nmax_wait = \"0\"\n\
         [[endpoints]]\nid = \"enforced\"\nrate = 0.01\nburst = 2.0\nmax_wait = \"0\"\n",
    )
    .await;
    let c = common::client(s.proxy_addr);
    for id in ["shadowed", "enforced"] {
        for i in 0..6 {
            let r = c
                .get(up.url(&format!("/{id}/{i}")))
                .header("x-endpoint-id", id)
                .send()
                .await
                .unwrap();
            let want = if id == "shadowed" || i < 2 { 200 } else { 503 };
            assert_eq!(r.status(), want, "{id} #{i}");
        }
    }
    assert_eq!(up.count(), 6 + 2);
    let m = reqwest::get(format!("http://{}/metrics", s.admin_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "sluice_requests_total{endpoint=\"shadowed\",outcome=\"forwarded\"} 2",
        "sluice_requests_total{endpoint=\"shadowed\",outcome=\"shadow_rate_limited\"} 4",
        "sluice_requests_total{endpoint=\"enforced\",outcome=\"rate_limited\"} 4",
        "sluice_shadow_wait_seconds_count{endpoint=\"shadowed\"} 6",
    ] {
        assert!(m.contains(line), "missing {line}:\n{m}");
    }
    s.stop().await;
}

/// A sender connection that keeps sending to one destination rides its own kept-alive
/// upstream connection: every request arrives once, in origin form, with `Host` from
/// the target, and the upstream sees one or two connections, not one per request.
#[tokio::test]
async fn a_kept_alive_sender_reuses_one_upstream_connection() {
    let up = Upstream::start().await;
    let s = sluice("").await;
    let c = client(s.proxy_addr);
    for i in 0..20 {
        let r = c
            .get(up.url(&format!("/n/{i}?q={i}")))
            .header("host", "forged.example")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let arrivals = up.arrivals();
    let paths: Vec<String> = arrivals.iter().map(|a| a.path.clone()).collect();
    let expected: Vec<String> = (0..20).map(|i| format!("/n/{i}?q={i}")).collect();
    assert_eq!(paths, expected, "each request exactly once, in order");
    for a in &arrivals {
        assert_eq!(a.headers["host"], up.addr.to_string().as_str());
        assert_eq!(a.headers.get_all("host").iter().count(), 1);
    }
    let conns: HashSet<usize> = arrivals.iter().map(|a| a.conn).collect();
    assert!(
        conns.len() <= 2,
        "20 requests used {} upstream connections",
        conns.len()
    );
    s.stop().await;
}

/// A sender alternating between two receivers: each request reaches the right one
/// once, over kept-alive connections.
#[tokio::test]
async fn a_sender_alternating_destinations_reaches_each_once() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let s = sluice("").await;
    let c = client(s.proxy_addr);
    for i in 0..10 {
        let up = if i % 3 == 0 { &a } else { &b };
        let r = c.get(up.url(&format!("/{i}"))).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    let to_a: Vec<String> = a.arrivals().iter().map(|x| x.path.clone()).collect();
    let to_b: Vec<String> = b.arrivals().iter().map(|x| x.path.clone()).collect();
    assert_eq!(to_a, ["/0", "/3", "/6", "/9"]);
    assert_eq!(to_b, ["/1", "/2", "/4", "/5", "/7", "/8"]);
    for (up, arrivals) in [(&a, a.arrivals()), (&b, b.arrivals())] {
        for x in &arrivals {
            assert_eq!(x.headers["host"], up.addr.to_string().as_str());
        }
        let conns: HashSet<usize> = arrivals.iter().map(|x| x.conn).collect();
        assert!(
            conns.len() <= 3,
            "{} connections for {} requests",
            conns.len(),
            arrivals.len()
        );
    }
    s.stop().await;
}

/// One kept-alive sender, one host, two endpoints told apart by path: every request
/// is paced by the endpoint its own path maps to, whatever the one before it named
/// (a connection remembers the endpoint of its last request, but never for a host
/// whose rules look at the path). A host without such rules is remembered, and still
/// paced as its own endpoint.
#[tokio::test]
async fn a_kept_alive_sender_is_paced_by_each_requests_own_path() {
    let up = Upstream::start().await;
    let s = sluice(
        "[defaults]\nrate = 0.001\nburst = 2.0\nmax_wait = \"0s\"\n\
         [[endpoints]]\nid = \"slow\"\nhosts = [\"127.0.0.1\"]\npath_prefix = \"/slow\"\n\
         rate = 0.001\nburst = 1.0\nmax_wait = \"0s\"\n",
    )
    .await;
    let c = client(s.proxy_addr);
    let status = |path: &'static str| {
        let (c, url) = (c.clone(), up.url(path));
        async move { c.get(url).send().await.unwrap().status().as_u16() }
    };
    // "127.0.0.1" (the defaults: burst 2) and "slow" (burst 1), interleaved.
    let got = [
        ("/fast/1", status("/fast/1").await),
        ("/slow/1", status("/slow/1").await),
        ("/fast/2", status("/fast/2").await),
        ("/slow/2", status("/slow/2").await),
        ("/fast/3", status("/fast/3").await),
    ];
    assert_eq!(
        got,
        [
            ("/fast/1", 200),
            ("/slow/1", 200),
            ("/fast/2", 200),
            ("/slow/2", 503),
            ("/fast/3", 503),
        ]
    );
    let arrived: Vec<String> = up.arrivals().iter().map(|a| a.path.clone()).collect();
    assert_eq!(arrived, ["/fast/1", "/slow/1", "/fast/2"]);

    // A host with no path rules: repeated requests keep to its own bucket.
    let other = Upstream::start().await;
    let to_other = other.url("/x").replace("127.0.0.1", "localhost");
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.push(c.get(&to_other).send().await.unwrap().status().as_u16());
    }
    assert_eq!(
        codes,
        [200, 200, 503],
        "burst 2 of the defaults, then refused"
    );
    assert_eq!(other.count(), 2);
    s.stop().await;
}

/// An upstream that closes its connection after every answer: the held connection is
/// replaced, and nothing is lost or sent twice.
#[tokio::test]
async fn an_upstream_closing_after_each_answer_loses_nothing() {
    let up = Upstream::with(Arc::new(|_| Reply::ok().header("connection", "close"))).await;
    let s = sluice("").await;
    let c = client(s.proxy_addr);
    for i in 0..10 {
        let r = c
            .post(up.url(&format!("/{i}")))
            .body(format!("body {i}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let arrivals = up.arrivals();
    let bodies: Vec<String> = arrivals
        .iter()
        .map(|a| String::from_utf8_lossy(&a.body).into_owned())
        .collect();
    let expected: Vec<String> = (0..10).map(|i| format!("body {i}")).collect();
    assert_eq!(bodies, expected);
    let conns: HashSet<usize> = arrivals.iter().map(|a| a.conn).collect();
    assert_eq!(conns.len(), 10, "every answer closed its connection");
    s.stop().await;
}
