//! Per-sender accounting: `sluice_sender_requests_total{endpoint,sender,outcome}` counts
//! each request under its sender (the authenticated proxy user, or a trusted
//! `X-Sluice-Sender`), stays bounded however many senders there are, and
//! `/endpoints/{id}` lists an endpoint's busiest senders.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use common::Upstream;
use futures_util::StreamExt;

/// Cost 4: the minimum bcrypt accepts, so the test stays fast.
fn htpasswd(dir: &Path, users: &[(&str, &str)]) -> PathBuf {
    let p = dir.join("users.htpasswd");
    let text: String = users
        .iter()
        .map(|(u, pw)| format!("{u}:{}\n", bcrypt::hash(pw, 4).unwrap()))
        .collect();
    std::fs::write(&p, text).unwrap();
    p
}

/// A client that authenticates to sluice as `user`.
fn client_as(proxy: std::net::SocketAddr, user: &str, password: &str) -> reqwest::Client {
    let p = reqwest::Proxy::http(format!("http://{proxy}"))
        .unwrap()
        .basic_auth(user, password);
    reqwest::Client::builder().proxy(p).build().unwrap()
}

/// `sluice_sender_requests_total` samples: (endpoint, sender, outcome) → count.
async fn sender_counts(admin: std::net::SocketAddr) -> HashMap<(String, String, String), f64> {
    let text = common::metrics(admin).await;
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).unwrap();
    scrape
        .samples
        .into_iter()
        .filter(|s| s.metric == "sluice_sender_requests_total")
        .map(|s| {
            let v = match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
                ref other => panic!("a counter, not {other:?}"),
            };
            let l = |k: &str| s.labels.get(k).unwrap_or_default().to_owned();
            ((l("endpoint"), l("sender"), l("outcome")), v)
        })
        .collect()
}

fn key(endpoint: &str, sender: &str, outcome: &str) -> (String, String, String) {
    (endpoint.into(), sender.into(), outcome.into())
}

/// Three proxy users: each one's requests are counted under its name and outcome,
/// the counts add up to `sluice_requests_total`, and `/endpoints/{id}` lists them
/// busiest first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_user_is_counted_under_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let users = htpasswd(
        dir.path(),
        &[("alice", "a-pw"), ("bob", "b-pw"), ("carol", "c-pw")],
    );
    let up = Upstream::start().await;
    let s = common::sluice(&format!(
        "[security]\nauth_users_file = \"{}\"\n\
         [[endpoints]]\nid = \"ep\"\nrate = 1000.0\nburst = 1000.0\n\
         [[endpoints]]\nid = \"tight\"\nrate = 0.001\nburst = 1.0\nmax_wait = \"0s\"\n",
        users.display()
    ))
    .await;
    let sent = [
        ("alice", "a-pw", 6),
        ("bob", "b-pw", 3),
        ("carol", "c-pw", 1),
    ];
    for (user, pw, n) in sent {
        let c = client_as(s.proxy_addr, user, pw);
        for _ in 0..n {
            let r = c
                .get(up.url("/"))
                .header("x-endpoint-id", "ep")
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
    }
    // alice spends `tight`'s one token; her second request and bob's are refused.
    let alice = client_as(s.proxy_addr, "alice", "a-pw");
    let bob = client_as(s.proxy_addr, "bob", "b-pw");
    for (c, want) in [(&alice, 200), (&alice, 503), (&bob, 503)] {
        let r = c
            .get(up.url("/t"))
            .header("x-endpoint-id", "tight")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), want);
    }
    // No credentials: refused before a sender is known, counted as `_anonymous`.
    let r = common::client(s.proxy_addr)
        .get(up.url("/"))
        .header("x-endpoint-id", "ep")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 407);

    let counts = sender_counts(s.admin_addr).await;
    let want = [
        (key("ep", "alice", "forwarded"), 6.0),
        (key("ep", "bob", "forwarded"), 3.0),
        (key("ep", "carol", "forwarded"), 1.0),
        (key("tight", "alice", "forwarded"), 1.0),
        (key("tight", "alice", "rate_limited"), 1.0),
        (key("tight", "bob", "rate_limited"), 1.0),
        (key("_other", "_anonymous", "proxy_auth_required"), 1.0),
    ];
    let got: HashMap<_, _> = counts.into_iter().filter(|(_, v)| *v > 0.0).collect();
    assert_eq!(got, want.into_iter().collect::<HashMap<_, _>>());
    assert_eq!(up.count(), 11);

    // The busiest senders of `ep`, busiest first.
    let detail: serde_json::Value = reqwest::get(format!("http://{}/endpoints/ep", s.admin_addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(detail["id"], "ep");
    let senders: Vec<(String, u64)> = detail["senders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["sender"].as_str().unwrap().to_owned(),
                x["requests"].as_u64().unwrap(),
            )
        })
        .collect();
    let want = [("alice", 6), ("bob", 3), ("carol", 1)].map(|(s, n)| (s.to_owned(), n));
    assert_eq!(senders, want);
    let tight: serde_json::Value = reqwest::get(format!("http://{}/endpoints/tight", s.admin_addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(tight["senders"][0]["sender"], "alice");
    assert_eq!(tight["senders"][0]["refused"], 1);
    assert_eq!(tight["senders"][1]["sender"], "bob");
    let r = reqwest::get(format!("http://{}/endpoints/nobody", s.admin_addr))
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    s.stop().await;
}

/// 10,000 distinct trusted `X-Sluice-Sender`s: at most `metrics_max_senders` + 1
/// (`_other`) sender label values, nothing lost, and the top list stays short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_senders_cannot_blow_up_metrics() {
    const SENDERS: usize = 10_000;
    const CAP: usize = 1000;
    let up = Upstream::start().await;
    let s = common::sluice(
        "[proxy]\ntrust_sender_header = true\n\
         [[endpoints]]\nid = \"ep\"\nrate = 1000000.0\nburst = 1000000.0\n",
    )
    .await;
    let c = common::client(s.proxy_addr);
    let url = up.url("/");
    let sends = futures_util::stream::iter(0..SENDERS)
        .map(|i| {
            let req = c
                .get(&url)
                .header("x-endpoint-id", "ep")
                .header("x-sluice-sender", format!("sender-{i}"));
            async move { req.send().await.unwrap().status() }
        })
        .buffer_unordered(16);
    let statuses: Vec<_> = sends.collect().await;
    assert!(statuses.iter().all(|s| *s == 200));
    assert_eq!(up.count(), SENDERS);
    // The header is sluice's own: never forwarded.
    assert!(
        up.arrivals()
            .iter()
            .all(|a| !a.headers.contains_key("x-sluice-sender"))
    );

    let counts = sender_counts(s.admin_addr).await;
    let senders: HashSet<&str> = counts.keys().map(|(_, s, _)| s.as_str()).collect();
    assert_eq!(counts.len(), CAP + 1, "one series per sender label value");
    assert_eq!(senders.len(), CAP + 1);
    assert!(senders.contains("_other"));
    let total: f64 = counts.values().sum();
    assert_eq!(total, SENDERS as f64);
    assert_eq!(
        counts[&key("ep", "_other", "forwarded")],
        (SENDERS - CAP) as f64
    );

    let detail: serde_json::Value = reqwest::get(format!("http://{}/endpoints/ep", s.admin_addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let top = detail["senders"].as_array().unwrap();
    assert_eq!(top.len(), sluice::admin::TOP_SENDERS);
    assert_eq!(top[0]["sender"], "_other", "{top:?}");
    s.stop().await;
}

/// Without `trust_sender_header`, `X-Sluice-Sender` names nobody: an unauthenticated
/// request is `_anonymous`, whatever it claims.
#[tokio::test]
async fn an_untrusted_sender_header_is_ignored() {
    let up = Upstream::start().await;
    let s = common::sluice("[[endpoints]]\nid = \"ep\"\nrate = 100.0\nburst = 100.0\n").await;
    let c = common::client(s.proxy_addr);
    for _ in 0..2 {
        let r = c
            .get(up.url("/"))
            .header("x-endpoint-id", "ep")
            .header("x-sluice-sender", "boss")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let counts = sender_counts(s.admin_addr).await;
    assert_eq!(
        counts.get(&key("ep", "_anonymous", "forwarded")),
        Some(&2.0)
    );
    assert!(counts.keys().all(|(_, s, _)| s != "boss"), "{counts:?}");
    s.stop().await;
}
