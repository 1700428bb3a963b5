//! A receiver's 429 absorbed within the request's wait budget: the request is held
//! behind the cooldown and sent again, so the sender sees one answer; only requests
//! that may be sent twice, with a body kept whole, and only while the budget allows.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::redis::RedisServer;
use common::{Arrival, Reply, Upstream, raw_exchange, sluice};

/// A receiver that refuses the first arrival of each path with a 429 and
/// `Retry-After: retry_after` (seconds), and accepts the rest.
async fn refuses_first(retry_after: &'static str) -> Upstream {
    let seen = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    Upstream::with(Arc::new(move |a: &Arrival| {
        if seen.lock().unwrap().insert(a.path.clone()) {
            Reply::status(429).header("Retry-After", retry_after)
        } else {
            Reply::ok()
        }
    }))
    .await
}

const HOOK: &str = "[[endpoints]]\nid = \"hook\"\nrate = 10.0\nburst = 5.0\nmax_wait = \"5s\"\n";

fn arrivals_of(up: &Upstream, path: &str) -> Vec<Arrival> {
    up.arrivals()
        .into_iter()
        .filter(|a| a.path == path)
        .collect()
}

/// Asserts the path arrived twice, the second time after the first's cooldown.
fn resent_after_cooldown(up: &Upstream, path: &str, cooldown: Duration) {
    let a = arrivals_of(up, path);
    assert_eq!(a.len(), 2, "{path}: refused once, then sent once more");
    let gap = a[1].at - a[0].at;
    assert!(gap >= cooldown, "{path}: resent {gap:?} after the 429");
    assert_eq!(a[0].body, a[1].body, "{path}: the same body both times");
}

#[tokio::test]
async fn a_receivers_429_is_absorbed_within_the_wait_budget() {
    let up = refuses_first("1").await;
    let s = sluice(HOOK).await;
    let c = common::client(s.proxy_addr);
    let r = c
        .get(up.url("/get"))
        .header("X-Endpoint-Id", "hook")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-sluice-retried"], "1");
    resent_after_cooldown(&up, "/get", Duration::from_secs(1));
    // A POST with an idempotency key is absorbed too, its body sent again whole.
    let r = c
        .post(up.url("/keyed"))
        .header("X-Endpoint-Id", "hook")
        .header("Idempotency-Key", "msg_1")
        .body("{\"n\":1}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    resent_after_cooldown(&up, "/keyed", Duration::from_secs(1));
    let metrics = common::metrics(s.admin_addr).await;
    assert!(
        metrics.contains("sluice_absorbed_total{endpoint=\"hook\"} 2"),
        "{metrics}"
    );
    s.stop().await;
}

/// hyper's path (an HTTP/1.0 request is hyper's) absorbs as the lane does.
#[tokio::test]
async fn hypers_path_absorbs_as_the_lane_does() {
    let up = refuses_first("1").await;
    let s = sluice(HOOK).await;
    let req = format!(
        "PUT {} HTTP/1.0\r\nX-Endpoint-Id: hook\r\nContent-Length: 5\r\n\r\nhello",
        up.url("/put")
    );
    let answer = raw_exchange(s.proxy_addr, req.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("x-sluice-retried: 1"),
        "{answer}"
    );
    resent_after_cooldown(&up, "/put", Duration::from_secs(1));
    assert_eq!(&arrivals_of(&up, "/put")[1].body[..], b"hello");
    s.stop().await;
}

/// What is never resent: a POST with no key on an unmarked endpoint, a body over
/// `absorb_max_body`, a cooldown longer than the budget left, and anything with
/// `absorb = "off"`. Each 429 reaches the sender unchanged, the receiver saw one.
#[tokio::test]
async fn a_refusal_that_cannot_be_absorbed_passes_through() {
    let up = refuses_first("1").await;
    let cfg = format!(
        "{HOOK}[[endpoints]]\nid = \"small\"\nmax_wait = \"5s\"\nadaptive = {{ absorb_max_body = 4 }}\n\
         [[endpoints]]\nid = \"short\"\nmax_wait = \"500ms\"\n\
         [[endpoints]]\nid = \"off\"\nmax_wait = \"5s\"\nadaptive = {{ absorb = \"off\" }}\n"
    );
    let s = sluice(&cfg).await;
    let c = common::client(s.proxy_addr);
    let cases = [
        ("hook", "/post", reqwest::Method::POST),
        ("small", "/large", reqwest::Method::PUT),
        ("short", "/short", reqwest::Method::GET),
        ("off", "/off", reqwest::Method::GET),
    ];
    for (endpoint, path, method) in cases {
        let r = c
            .request(method, up.url(path))
            .header("X-Endpoint-Id", endpoint)
            .body("more than four bytes")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 429, "{endpoint}");
        assert!(r.headers().get("x-sluice-retried").is_none());
        assert_eq!(arrivals_of(&up, path).len(), 1, "{path}: sent once");
    }
    s.stop().await;
}

/// A POST to an endpoint marked `absorb_post = true` is absorbed; a receiver that keeps
/// refusing gets at most `absorb_attempts` resends, and its last 429 is the sender's.
#[tokio::test]
async fn absorb_post_and_attempts_bound_the_resends() {
    let up = Upstream::with(Arc::new(|a: &Arrival| {
        if a.path == "/always" {
            Reply::status(429).header("Retry-After", "1")
        } else {
            Reply::ok()
        }
    }))
    .await;
    let cfg = "[[endpoints]]\nid = \"hook\"\nmax_wait = \"10s\"\nabsorb_post = true\n\
               adaptive = { absorb_attempts = 2 }\n";
    let s = sluice(cfg).await;
    let c = common::client(s.proxy_addr);
    let r = c
        .post(up.url("/always"))
        .header("X-Endpoint-Id", "hook")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["x-sluice-retried"], "2");
    let a = arrivals_of(&up, "/always");
    assert_eq!(a.len(), 3, "sent once and resent twice");
    for w in a.windows(2) {
        assert!(
            w[1].at - w[0].at >= Duration::from_secs(1),
            "each resend after its cooldown"
        );
    }
    s.stop().await;
}

/// Three replicas on one Redis: a 429 heard through one replica holds every replica's
/// requests until the cooldown ends, the refused request is sent once more after it,
/// and every sender sees a 200; nothing arrives twice but the refused one.
#[tokio::test]
async fn a_429_is_absorbed_once_across_replicas_sharing_redis() {
    let redis = RedisServer::start();
    let store = format!(
        "[store]\nbackend = \"redis\"\nurls = [\"{}\"]\ntimeout = \"500ms\"\n",
        redis.url()
    );
    let cfg = format!("{store}{HOOK}");
    let mut rs = Vec::new();
    for _ in 0..3 {
        rs.push(sluice(&cfg).await);
    }
    let refused = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let up = Upstream::with(Arc::new(move |a: &Arrival| {
        let first = a.path == "/first" && !refused.swap(true, std::sync::atomic::Ordering::SeqCst);
        if first {
            Reply::status(429).header("Retry-After", "1")
        } else {
            Reply::ok()
        }
    }))
    .await;
    let first = {
        let c = common::client(rs[0].proxy_addr);
        let url = up.url("/first");
        tokio::spawn(async move {
            c.get(url)
                .header("X-Endpoint-Id", "hook")
                .send()
                .await
                .unwrap()
        })
    };
    common::wait_for("the 429", Duration::from_secs(10), || async {
        up.count() == 1
    })
    .await;
    let mut others = Vec::new();
    for (i, r) in rs.iter().enumerate().skip(1) {
        for k in 0..2 {
            let c = common::client(r.proxy_addr);
            let url = up.url(&format!("/other/{i}/{k}"));
            others.push(tokio::spawn(async move {
                c.get(url)
                    .header("X-Endpoint-Id", "hook")
                    .send()
                    .await
                    .unwrap()
                    .status()
            }));
        }
    }
    let first = first.await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["x-sluice-retried"], "1");
    for o in others {
        assert_eq!(o.await.unwrap(), 200);
    }
    let all = up.arrivals();
    assert_eq!(all.len(), 6, "four others once, the refused one twice");
    // None reached the receiver during the cooldown, whichever replica it came through.
    let cooled = all[0].at + Duration::from_secs(1);
    for a in &all[1..] {
        assert!(
            a.at >= cooled,
            "{} arrived {:?} into the cooldown",
            a.path,
            a.at - all[0].at
        );
    }
    for r in rs {
        r.stop().await;
    }
}

/// A sender's `X-Sluice-Request-Id` reaches the receiver as `Idempotency-Key` (its own
/// `Idempotency-Key` wins), on both engines, so a request left in doubt by a connection
/// error can be resent and recognised; it also makes a POST safe to absorb.
#[tokio::test]
async fn a_senders_request_id_becomes_the_receivers_idempotency_key() {
    let up = refuses_first("1").await;
    let s = sluice(HOOK).await;
    let c = common::client(s.proxy_addr);
    let r = c
        .post(up.url("/lane"))
        .header("X-Endpoint-Id", "hook")
        .header("X-Sluice-Request-Id", "msg_7")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        200,
        "absorbed: the request ID makes it safe to resend"
    );
    let req = "POST /hyper HTTP/1.0\r\nX-Endpoint-Id: hook\r\nX-Sluice-Request-Id: msg_8\r\n\
               Idempotency-Key: own\r\nContent-Length: 2\r\n\r\n{}";
    let req = req.replace("/hyper", &up.url("/hyper"));
    let answer = raw_exchange(s.proxy_addr, req.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    for (path, key) in [("/lane", "msg_7"), ("/hyper", "own")] {
        for a in arrivals_of(&up, path) {
            assert_eq!(a.headers["idempotency-key"], key, "{path}");
            assert!(a.headers.get("x-sluice-request-id").is_none(), "{path}");
        }
    }
    s.stop().await;
}
