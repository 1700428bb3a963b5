//! A request's target, read one way on every path: host names and addresses however
//! spelled, ports, the `Host` header, refused destinations and endpoint IDs, each at a
//! real listener with a real upstream, refused or bounded as the contract says.

mod common;

use std::sync::Arc;

use common::{Reply, Upstream, metrics, raw_head as raw};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// Giant and malformed host names are a 400 before anything else, and
/// cannot grow `/metrics`.
#[tokio::test]
async fn hosts_that_are_not_names_are_refused_and_never_become_labels() {
    let up = Upstream::start().await;
    let s = common::sluice("").await;
    let port = up.addr.port();
    let giant = format!("{}.example.com", "a".repeat(60_000));
    let label64 = format!("{}.example.com", "b".repeat(64));
    let long_name = vec!["c".repeat(60); 5].join(".");
    for host in [
        giant.as_str(),
        &label64,
        &long_name,
        "exa%20mple.com",
        "a..b",
    ] {
        for _ in 0..3 {
            let head = raw(
                s.proxy_addr,
                &format!(
                    "GET http://{host}:{port}/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                ),
            )
            .await;
            assert!(
                head.starts_with("HTTP/1.1 400"),
                "{}: {head}",
                &host[..host.len().min(40)]
            );
        }
    }
    // 170 giant names made one scrape 245 MB before: now the scrape stays small.
    for _ in 0..170 {
        let head = raw(
            s.proxy_addr,
            &format!("GET http://{giant}/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    }
    let m = metrics(s.admin_addr).await;
    assert!(m.len() < 64 * 1024, "/metrics is {} bytes", m.len());
    assert!(!m.contains("aaaaaaaaaa") && !m.contains("bbbbbbbbbb"));
    assert_eq!(up.count(), 0, "nothing may reach the upstream");
    s.stop().await;
}

/// Hosts refused by the destination policy never get a label of their own,
/// however many distinct names a sender sprays.
#[tokio::test]
async fn refused_destinations_do_not_become_labels() {
    let s = common::sluice("[security]\nallowed_hosts = [\"allowed.test\"]").await;
    let c = common::client(s.proxy_addr);
    for i in 0..300 {
        let r = c
            .get(format!("http://spray-{i}.{}.test/", "d".repeat(60)))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403);
        assert_eq!(r.headers()["x-sluice-reason"], "destination_denied");
    }
    let m = metrics(s.admin_addr).await;
    assert!(!m.contains("spray-"), "a refused host became a label");
    assert!(
        m.contains("sluice_requests_total{endpoint=\"_other\",outcome=\"destination_denied\"} 300"),
        "refusals are still counted:\n{m}"
    );
    s.stop().await;
}

/// `API.example.com.` is the same host as `api.example.com` for rules.
#[tokio::test]
async fn a_trailing_dot_or_capitals_cannot_escape_a_host_rule() {
    let up = Upstream::start().await;
    let s = common::sluice(
        "[[endpoints]]\nid = \"local\"\nrate = 0.001\nburst = 1.0\nmax_wait = \"0\"\nhosts = [\"localhost\"]\n",
    )
    .await;
    let port = up.addr.port();
    let first = raw(
        s.proxy_addr,
        &format!("GET http://localhost:{port}/1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    for host in ["localhost.", "LOCALHOST", "LocalHost."] {
        let head = raw(
            s.proxy_addr,
            &format!("GET http://{host}:{port}/2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert!(head.starts_with("HTTP/1.1 503"), "{host}: {head}");
        assert!(
            head.to_ascii_lowercase()
                .contains("x-sluice-reason: rate_limited")
        );
    }
    assert_eq!(up.count(), 1);
    s.stop().await;
}

/// An IPv4-mapped IPv6 literal is the IPv4 address it maps: it shares that address's
/// endpoint (a bucket per spelling would pass the limit again), plain and CONNECT
/// alike. A host with a label that starts or ends with '-' is a 400 before anything
/// else, never a 200 and a silent close (no certificate can name it).
#[tokio::test]
async fn ipv4_mapped_ipv6_is_its_ipv4_endpoint_and_hyphen_edged_labels_are_refused() {
    let up = Upstream::start().await;
    let s = common::sluice(
        "[[endpoints]]\nid = \"ip\"\nrate = 0.001\nburst = 2.0\nmax_wait = \"0\"\nhosts = [\"127.0.0.1\"]\n",
    )
    .await;
    let port = up.addr.port();
    let get = |host: &str| {
        format!("GET http://{host}:{port}/m HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    };
    assert!(
        raw(s.proxy_addr, &get("127.0.0.1"))
            .await
            .starts_with("HTTP/1.1 200")
    );
    let mapped = raw(s.proxy_addr, &get("[::ffff:127.0.0.1]")).await;
    assert!(mapped.starts_with("HTTP/1.1 200"), "{mapped}");
    for host in ["[::ffff:7f00:1]", "[0:0:0:0:0:ffff:127.0.0.1]"] {
        let head = raw(s.proxy_addr, &get(host)).await;
        assert!(head.starts_with("HTTP/1.1 503"), "{host}: {head}");
        assert!(head.contains("x-sluice-reason: rate_limited"), "{head}");
    }
    let connect = raw(
        s.proxy_addr,
        &format!("CONNECT [::ffff:127.0.0.1]:{port} HTTP/1.1\r\nHost: x\r\n\r\n"),
    )
    .await;
    assert!(connect.starts_with("HTTP/1.1 503"), "{connect}");
    assert_eq!(up.count(), 2, "the burst of two, once");
    for host in ["-lead.example.com", "trail-.example.com"] {
        let connect = raw(
            s.proxy_addr,
            &format!("CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n"),
        )
        .await;
        assert!(connect.starts_with("HTTP/1.1 400"), "{host}: {connect}");
    }
    s.stop().await;
}

/// An IPv4 address spelled another way (`0x7f.0.0.1`, `127.1`, `2130706433`: every
/// resolver takes them) is that address: it spends the bucket of the endpoint whose
/// `hosts` name the address, on both paths, so a sender cannot multiply its budget for
/// one receiver by spelling its address differently.
#[tokio::test]
async fn an_address_spelled_another_way_spends_the_same_bucket() {
    let up = Upstream::start().await;
    let s = common::sluice(
        "[[endpoints]]\nid = \"loop\"\nrate = 0.001\nburst = 1.0\nmax_wait = \"0s\"\nhosts = [\"127.0.0.1\"]\n",
    )
    .await;
    let port = up.addr.port();
    let first = raw(
        s.proxy_addr,
        &format!("GET http://127.0.0.1:{port}/first HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n"),
    )
    .await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    // `keep-alive` is the lane's; a `Connection` naming a header is hyper's.
    for connection in ["keep-alive", "x-hop"] {
        for spelling in [
            "0x7f.0.0.1",
            "127.1",
            "2130706433",
            "0177.0.0.1",
            "127.0.0.1.",
        ] {
            let head = raw(
                s.proxy_addr,
                &format!(
                    "GET http://{spelling}:{port}/again HTTP/1.1\r\nHost: {spelling}:{port}\r\nConnection: {connection}\r\n\r\n"
                ),
            )
            .await;
            assert!(
                head.starts_with("HTTP/1.1 429") || head.starts_with("HTTP/1.1 503"),
                "{spelling} ({connection}) spends endpoint loop's empty bucket: {head}"
            );
        }
    }
    assert_eq!(up.count(), 1, "only the first request arrived");
    s.stop().await;
}

/// A target host with its trailing dot (`localhost.`) reaches the same address on both
/// paths: neither asks the resolver for `localhost.` nor answers 502 where the other
/// forwards.
#[tokio::test]
async fn a_trailing_dot_host_reaches_the_same_address_on_both_paths() {
    let up = Upstream::start().await;
    let s = common::sluice("").await;
    let port = up.addr.port();
    // `keep-alive` is the lane's; a `Connection` naming a header is hyper's.
    for connection in ["keep-alive", "x-hop"] {
        for host in ["localhost.", "127.0.0.1.", "0x7f.1"] {
            let head = raw(
                s.proxy_addr,
                &format!(
                    "GET http://{host}:{port}/dot HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: {connection}\r\n\r\n"
                ),
            )
            .await;
            assert!(
                head.starts_with("HTTP/1.1 200"),
                "{host} ({connection}): {head}"
            );
        }
    }
    assert_eq!(up.count(), 6);
    s.stop().await;
}

/// A port that is not a number from 1 to 65535 is a 400, never port 80 or
/// 443 by default.
#[tokio::test]
async fn bad_ports_are_refused_never_defaulted() {
    let up = Upstream::start().await;
    let s = common::sluice("").await;
    let port = up.addr.port();
    for authority in [
        format!("127.0.0.1:{port}abc"),
        "127.0.0.1:65536".to_owned(),
        "127.0.0.1:80abc".to_owned(),
        "127.0.0.1:0".to_owned(),
        "127.0.0.1:".to_owned(),
        format!("127.0.0.1:+{port}"),
    ] {
        let plain = raw(
            s.proxy_addr,
            &format!(
                "GET http://{authority}/ HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
            ),
        )
        .await;
        assert!(plain.starts_with("HTTP/1.1 400"), "{authority}: {plain}");
        assert!(plain.contains("x-sluice-reason: bad_request"), "{plain}");
        let connect = raw(
            s.proxy_addr,
            &format!("CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n"),
        )
        .await;
        assert!(
            connect.starts_with("HTTP/1.1 400"),
            "{authority}: {connect}"
        );
    }
    // A good port still works.
    let ok = raw(
        s.proxy_addr,
        &format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            up.url("/ok"),
            up.addr
        ),
    )
    .await;
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert_eq!(up.count(), 1);
    s.stop().await;
}

/// A CONNECT whose target is not `host:port` (a URL, userinfo) or that frames content (RFC
/// 9110 §9.3.6: it has none) is a 400 and opens no tunnel.
#[tokio::test]
async fn a_connect_that_is_not_host_and_port_alone_opens_no_tunnel() {
    let up = Upstream::start().await;
    let s = common::sluice("").await;
    let port = up.addr.port();
    let a = format!("127.0.0.1:{port}");
    for head in [
        format!("CONNECT {a} HTTP/1.1\r\nHost: {a}\r\nContent-Length: 5\r\n\r\nhello"),
        format!("CONNECT {a} HTTP/1.1\r\nHost: {a}\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        format!("CONNECT http://{a}/ HTTP/1.1\r\nHost: {a}\r\n\r\n"),
        format!("CONNECT user:pw@{a} HTTP/1.1\r\nHost: {a}\r\n\r\n"),
        // No port: CONNECT has no default one.
        "CONNECT 127.0.0.1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".to_owned(),
    ] {
        let answer = raw(s.proxy_addr, &head).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{head:?}: {answer}");
    }
    // `host:port` alone, with or without a zero length, opens one.
    for head in [
        format!("CONNECT {a} HTTP/1.1\r\nHost: {a}\r\n\r\n"),
        format!("CONNECT {a} HTTP/1.1\r\nHost: {a}\r\nContent-Length: 0\r\n\r\n"),
    ] {
        let answer = raw(s.proxy_addr, &head).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{head:?}: {answer}");
    }
    s.stop().await;
}

/// The upstream's `Host` is the target's authority, never the sender's
/// header; two `Host` headers are a 400.
#[tokio::test]
async fn the_host_header_comes_from_the_target() {
    let up = Upstream::start().await;
    let s = common::sluice("").await;
    let head = raw(
        s.proxy_addr,
        &format!(
            "GET {} HTTP/1.1\r\nHost: internal.admin.local\r\nConnection: close\r\n\r\n",
            up.url("/vhost")
        ),
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let a = up.arrivals();
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].headers["host"], up.addr.to_string().as_str());
    assert_eq!(a[0].headers.get_all("host").iter().count(), 1);

    let dup = raw(
        s.proxy_addr,
        &format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\nHost: internal.admin.local\r\nConnection: close\r\n\r\n",
            up.url("/dup"),
            up.addr
        ),
    )
    .await;
    assert!(dup.starts_with("HTTP/1.1 400"), "{dup}");
    assert_eq!(
        up.count(),
        1,
        "a request with two Host headers was forwarded"
    );
    s.stop().await;
}

/// A request whose resolved address the policy refuses spends no token
/// (plain HTTP: refunded; CONNECT: resolved before admission).
#[tokio::test]
async fn a_refused_address_spends_nothing() {
    let up = Upstream::start().await;
    let mut cfg =
        common::config("[[endpoints]]\nid = \"ep\"\nrate = 0.001\nburst = 3.0\nmax_wait = \"0\"\n");
    cfg.security.allow_private_destinations = false;
    let s = sluice::app::start(cfg).await.unwrap();
    let c = common::client(s.proxy_addr);
    let port = up.addr.port();
    for _ in 0..5 {
        // "localhost" passes the name check and resolves to loopback: refused on address.
        let r = c
            .get(format!("http://localhost:{port}/"))
            .header("x-endpoint-id", "ep")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403);
        assert_eq!(r.headers()["x-sluice-reason"], "destination_denied");
        let head = raw(
            s.proxy_addr,
            &format!("CONNECT localhost:{port} HTTP/1.1\r\nHost: localhost:{port}\r\nX-Endpoint-Id: ep\r\n\r\n"),
        )
        .await;
        assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    }
    // The refund is asynchronous to nothing: it completed before the 403 was written.
    let left = common::tokens(s.admin_addr, "ep")
        .await
        .expect("ep has a bucket");
    assert!(
        left > 2.99,
        "tokens spent on refused requests: {left} left of 3"
    );
    assert_eq!(up.count(), 0);
    s.stop().await;
}

/// Two endpoint headers with different values are a 400 on both paths, as two `Host`
/// headers are: nothing is sent or spent.
#[tokio::test]
async fn two_endpoint_headers_are_a_bad_request() {
    let up = Upstream::start().await;
    let s = common::sluice("").await;
    let a = up.addr;
    // `keep-alive` is the lane's; a `Connection` naming a header is hyper's.
    // On a kept-alive connection too, whose last request named one of them.
    for connection in ["keep-alive", "x-hop"] {
        let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
        let one = format!(
            "GET http://{a}/one HTTP/1.1\r\nHost: {a}\r\nX-Endpoint-Id: one\r\nConnection: {connection}\r\n\r\n"
        );
        t.write_all(one.as_bytes()).await.unwrap();
        let first = common::read_response(&mut t).await;
        assert!(first.starts_with("HTTP/1.1 200"), "{connection}: {first}");
        let two = format!(
            "GET http://{a}/two HTTP/1.1\r\nHost: {a}\r\nX-Endpoint-Id: one\r\nX-Endpoint-Id: two\r\nConnection: {connection}\r\n\r\n"
        );
        t.write_all(two.as_bytes()).await.unwrap();
        let second = common::read_response(&mut t).await;
        assert!(second.starts_with("HTTP/1.1 400"), "{connection}: {second}");
    }
    let paths: Vec<String> = up.arrivals().into_iter().map(|a| a.path).collect();
    assert_eq!(paths, ["/one", "/one"]);
    s.stop().await;
}

/// An endpoint ID that breaks its Redis
/// Cluster hash tag (`}` first leaves `<prefix>{}}` with an empty tag, and its leases key
/// in another slot) failed every script call for it, and each failure was taken for a
/// store outage: five such requests a second left another endpoint 24 answers in 8 s,
/// the rest `503 store_unavailable`. Braces are now the sender's `400`; the store never
/// sees them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_id_that_breaks_a_cluster_hash_tag_is_the_senders_400() {
    let cluster = common::redis::RedisCluster::start();
    let up = Upstream::start().await;
    let urls: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let s = common::sluice(&format!(
        "[store]\nbackend = \"redis-cluster\"\nurls = [{}]\ntimeout = \"500ms\"\non_error = \"deny\"\n[defaults]\nrate = 1000.0\nburst = 100.0\nmax_in_flight = 4\n",
        urls.join(", ")
    ))
    .await;
    let c = common::client(s.proxy_addr);
    for id in ["}", "}x", "a{b", "_other"] {
        let r = c
            .get(up.url("/bad"))
            .header("x-endpoint-id", id)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{id}");
        assert_eq!(r.headers()["x-sluice-reason"], "bad_request");
    }
    for i in 0..20 {
        let r = c
            .get(up.url(&format!("/good/{i}")))
            .header("x-endpoint-id", "good")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    assert_eq!(up.count(), 20, "only the good requests arrived");
    assert!(
        metrics(s.admin_addr)
            .await
            .contains("sluice_store_errors_total 0\n"),
        "the store never failed"
    );
    s.stop().await;
}

/// A receiver cannot forge sluice's refusal headers.
#[tokio::test]
async fn upstream_sluice_headers_are_removed() {
    let up = Upstream::with(Arc::new(|_| {
        Reply::status(503)
            .header("x-sluice-reason", "rate_limited")
            .header("x-sluice-anything", "forged")
            .header("retry-after", "1")
    }))
    .await;
    let s = common::sluice("[defaults.adaptive]\nenabled = false\n").await;
    let r = common::client(s.proxy_addr)
        .get(up.url("/"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(
        r.headers().get("x-sluice-reason").is_none(),
        "{:?}",
        r.headers()
    );
    assert!(r.headers().get("x-sluice-anything").is_none());
    assert_eq!(r.headers()["retry-after"], "1");
    s.stop().await;
}
