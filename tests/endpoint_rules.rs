//! `[[endpoints]]` host rules with a port, over real sockets: two recording receivers on
//! one host (127.0.0.1, two ports) each draw from their own bucket, without a header.

mod common;

use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use common::{Upstream, assert_no_overdraw, client, read_response, sluice};

/// The rules of both tests: receiver `a` on one port, `b` on another, each with its own
/// limit; the host on any other port is its own endpoint under `[defaults]`.
fn rules(a: &Upstream, b: &Upstream, rate: f64, max_wait: &str) -> String {
    format!(
        "[defaults]\nmax_wait = \"{max_wait}\"\n\
         [[endpoints]]\nid = \"a\"\nrate = {rate}\nburst = 1.0\nhosts = [\"127.0.0.1:{}\"]\n\
         [[endpoints]]\nid = \"b\"\nrate = {rate}\nburst = 1.0\nhosts = [\"127.0.0.1:{}\"]\n",
        a.addr.port(),
        b.addr.port()
    )
}

// Virtual time: pacing over real loopback sockets, with no wall-clock wait.
#[tokio::test(start_paused = true)]
async fn two_receivers_on_one_host_are_paced_by_their_own_ports_rules() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let rate = 10.0;
    let s = sluice(&rules(&a, &b, rate, "30s")).await;
    let c = client(s.proxy_addr);
    let per_receiver = 10;
    let mut tasks = Vec::new();
    for up in [&a, &b] {
        for i in 0..per_receiver {
            let (c, url) = (c.clone(), up.url(&format!("/m{i}")));
            tasks.push(tokio::spawn(async move {
                c.get(&url).send().await.unwrap().status().as_u16()
            }));
        }
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200, "every message is held, none refused");
    }
    let times = |up: &Upstream| -> Vec<Instant> { up.arrivals().iter().map(|x| x.at).collect() };
    let (ta, tb) = (times(&a), times(&b));
    assert_eq!(
        (ta.len(), tb.len()),
        (per_receiver, per_receiver),
        "exactly once"
    );
    assert_no_overdraw(&ta, rate, 1.0);
    assert_no_overdraw(&tb, rate, 1.0);
    // One shared bucket would allow at most rate·1 s + burst (+1 of jitter) in any second
    // across both receivers; two buckets let both run at their full rate side by side.
    let mut all = [ta, tb].concat();
    all.sort();
    let first_second = all
        .iter()
        .filter(|t| **t < all[0] + Duration::from_secs(1))
        .count();
    assert!(
        first_second as f64 > rate + 2.0,
        "{first_second} arrivals in the first second: the two ports shared one bucket"
    );
    for id in ["a", "b"] {
        assert!(
            common::endpoint(s.admin_addr, id).await.is_some(),
            "{id} has a bucket"
        );
    }
    assert!(
        common::endpoint(s.admin_addr, "127.0.0.1").await.is_none(),
        "no request fell to the host's own endpoint"
    );
    s.stop().await;
}

/// One sender connection sending to both ports in turn: each request resolves by its own
/// port, never by the endpoint the connection's previous request to that host resolved
/// to (a connection's last endpoint is remembered by host only where no port rule
/// exists). With one token each and no wait, a wrong bucket would show as a 503.
#[tokio::test(start_paused = true)]
async fn one_connection_alternating_ports_draws_from_each_port_s_bucket() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let s = sluice(&rules(&a, &b, 0.01, "0s")).await;
    let mut conn = TcpStream::connect(s.proxy_addr).await.unwrap();
    let mut send = async |port: u16, path: &str| {
        let req =
            format!("GET http://127.0.0.1:{port}{path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n");
        conn.write_all(req.as_bytes()).await.unwrap();
        let resp = read_response(&mut conn).await;
        resp.split(' ').nth(1).unwrap_or_default().to_owned()
    };
    let (pa, pb) = (a.addr.port(), b.addr.port());
    assert_eq!(send(pa, "/1").await, "200", "a's one token");
    assert_eq!(
        send(pb, "/2").await,
        "200",
        "b's one token, not a's empty bucket"
    );
    assert_eq!(send(pa, "/3").await, "503", "a's bucket is empty");
    assert_eq!(send(pb, "/4").await, "503", "so is b's");
    let paths =
        |up: &Upstream| -> Vec<String> { up.arrivals().into_iter().map(|x| x.path).collect() };
    assert_eq!(paths(&a), ["/1"]);
    assert_eq!(paths(&b), ["/2"]);
    s.stop().await;
}

/// `sluice_host_fallback_total` as `/metrics` shows it.
async fn host_fallbacks(admin: std::net::SocketAddr) -> u64 {
    let text = common::metrics(admin).await;
    text.lines()
        .find_map(|l| l.strip_prefix("sluice_host_fallback_total "))
        .unwrap_or_else(|| panic!("no sluice_host_fallback_total in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// A request that names no endpoint (no header, no proxy user, no `hosts` rule) is paced
/// under its destination host and counted in `sluice_host_fallback_total`, also when a
/// kept-alive connection's next request reuses the resolution; the others are not
/// counted. With `security.require_endpoint = true` it is refused `400
/// endpoint_required` and never reaches the receiver, so a client that lost its proxy
/// user (one that drops a user without a password) is told, not re-bucketed.
#[tokio::test]
async fn a_request_naming_no_endpoint_is_counted_or_refused() {
    let (up, ruled) = (Upstream::start().await, Upstream::start().await);
    let rules = format!(
        "[proxy]\nendpoint_from_proxy_user = true\n\
         [[endpoints]]\nid = \"ruled\"\nhosts = [\"127.0.0.1:{}\"]\n",
        ruled.addr.port()
    );
    let proxy_user = format!(
        "Proxy-Authorization: Basic {}\r\n",
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD, "ep_42:x")
    );
    let send = |proxy, target: std::net::SocketAddr, extra: &str, times: usize| {
        let head = format!("GET http://{target}/m HTTP/1.1\r\nHost: {target}\r\n{extra}\r\n");
        async move {
            let mut s = TcpStream::connect(proxy).await.unwrap();
            let mut statuses = Vec::new();
            for _ in 0..times {
                s.write_all(head.as_bytes()).await.unwrap();
                let answer = read_response(&mut s).await;
                statuses.push(answer.split(' ').nth(1).unwrap().to_owned());
                if answer.contains("endpoint_required") {
                    assert!(
                        answer
                            .to_ascii_lowercase()
                            .contains("x-sluice-reason: endpoint_required"),
                        "{answer}"
                    );
                }
            }
            statuses
        }
    };

    let s = sluice(&rules).await;
    assert_eq!(send(s.proxy_addr, up.addr, "", 2).await, ["200", "200"]);
    assert_eq!(
        host_fallbacks(s.admin_addr).await,
        2,
        "both, the second recalled"
    );
    assert_eq!(
        send(s.proxy_addr, up.addr, "X-Endpoint-Id: e\r\n", 1).await,
        ["200"]
    );
    assert_eq!(send(s.proxy_addr, up.addr, &proxy_user, 1).await, ["200"]);
    assert_eq!(send(s.proxy_addr, ruled.addr, "", 1).await, ["200"]);
    assert_eq!(
        host_fallbacks(s.admin_addr).await,
        2,
        "named ones are not counted"
    );
    s.stop().await;

    let s = sluice(&format!("{rules}[security]\nrequire_endpoint = true\n")).await;
    let before = up.arrivals().len();
    assert_eq!(send(s.proxy_addr, up.addr, "", 2).await, ["400", "400"]);
    assert_eq!(
        up.arrivals().len(),
        before,
        "a refused request never arrives"
    );
    assert_eq!(
        send(s.proxy_addr, up.addr, "X-Endpoint-Id: e\r\n", 1).await,
        ["200"]
    );
    assert_eq!(send(s.proxy_addr, up.addr, &proxy_user, 1).await, ["200"]);
    assert_eq!(send(s.proxy_addr, ruled.addr, "", 1).await, ["200"]);
    assert_eq!(host_fallbacks(s.admin_addr).await, 0);
    let text = common::metrics(s.admin_addr).await;
    assert!(
        text.contains("outcome=\"endpoint_required\""),
        "counted under its reason:\n{text}"
    );
    s.stop().await;
}
