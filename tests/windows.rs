//! Sliding windows and request costs, measured at a recording upstream: on the memory
//! store (virtual time) and on three replicas sharing a real Redis (real time).
//!
//! Arrivals are checked against the window over every interval that ends at an
//! arrival. On Redis the interval is shortened by the delivery jitter between sluice
//! letting a request go and the upstream's accept (a loopback hop on a loaded machine,
//! a few ms): two starts exactly `per` apart can arrive a little closer.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use common::{Upstream, client};

/// One or more sluice replicas sharing a store.
struct Fleet {
    replicas: Vec<sluice::app::Running>,
    _redis: Option<common::redis::RedisServer>,
    /// How much closer than their starts two arrivals may be (seconds).
    jitter: f64,
}

impl Fleet {
    async fn memory(extra: &str) -> Fleet {
        Fleet {
            replicas: vec![common::sluice(extra).await],
            _redis: None,
            jitter: 0.001,
        }
    }

    async fn redis(extra: &str, n: usize) -> Fleet {
        let server = common::redis::RedisServer::start();
        let store = format!(
            "[store]\nbackend = \"redis\"\nurls = [\"{}\"]\ntimeout = \"500ms\"\n",
            server.url()
        );
        let mut replicas = Vec::new();
        for _ in 0..n {
            replicas.push(common::sluice(&format!("{store}{extra}")).await);
        }
        Fleet {
            replicas,
            _redis: Some(server),
            jitter: 0.025,
        }
    }

    fn client(&self, i: usize) -> reqwest::Client {
        client(self.replicas[i % self.replicas.len()].proxy_addr)
    }

    async fn endpoint(&self, id: &str) -> serde_json::Value {
        let admin = self.replicas[0].admin_addr;
        common::endpoint(admin, id)
            .await
            .unwrap_or_else(|| panic!("{id} not in {admin}'s /endpoints"))
    }

    async fn stop(self) {
        for r in self.replicas {
            r.stop().await;
        }
    }
}

/// `senders` loops, spread over the replicas, sending to `path` of `up` with `headers`
/// until `for_how_long` is over; what each got back (status).
async fn saturate(
    fleet: &Fleet,
    up: &Upstream,
    path: &str,
    headers: &[(&str, &str)],
    senders: usize,
    for_how_long: Duration,
) -> Vec<u16> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..senders {
        let (c, url, stop) = (fleet.client(i), up.url(path), Arc::clone(&stop));
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let mut r = c.get(&url);
                for (k, v) in &headers {
                    r = r.header(k, v);
                }
                match r.send().await {
                    Ok(r) => got.push(r.status().as_u16()),
                    Err(e) => panic!("request failed: {e}"),
                }
            }
            got
        }));
    }
    tokio::time::sleep(for_how_long).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

/// Seconds from `t0` of each arrival at `path`, with its `weight`.
fn arrivals(up: &Upstream, path: &str, t0: Instant) -> Vec<f64> {
    let mut a: Vec<f64> = up
        .arrivals()
        .iter()
        .filter(|a| a.path == path)
        .map(|a| (a.at - t0).as_secs_f64())
        .collect();
    a.sort_by(f64::total_cmp);
    a
}

/// The most arrivals (each weighing `cost`) in any interval `(t − per + jitter, t]`
/// ending at an arrival, and where it ends.
fn most_in(times: &[f64], per: f64, jitter: f64, cost: f64) -> (f64, f64) {
    let mut worst = (0.0, 0.0);
    for (i, &t) in times.iter().enumerate() {
        let n = times[..=i]
            .iter()
            .filter(|&&s| s > t - per + jitter)
            .count() as f64
            * cost;
        if n > worst.0 {
            worst = (n, t);
        }
    }
    worst
}

const WINDOW: &str = "[defaults]\nrate = 50.0\nburst = 10.0\nmax_wait = \"10s\"\n\
                      windows = [{ limit = 20, per = \"4s\" }]\n\
                      [defaults.adaptive]\nabsorb = \"off\"\n";

/// With rate 50/s and 20 per 4 s, saturated by eight senders for 10 s: no interval of
/// 4 s carries more than 20, and the window is used (at least 80% of 20 in each of the
/// first two 4 s spans from the first arrival).
async fn a_window_is_never_overrun_and_is_used(fleet: Fleet) {
    let up = Upstream::start().await;
    let t0 = Instant::now();
    let got = saturate(&fleet, &up, "/w", &[], 8, Duration::from_secs(10)).await;
    let times = arrivals(&up, "/w", t0);
    let (most, at) = most_in(&times, 4.0, fleet.jitter, 1.0);
    eprintln!(
        "{} arrivals, {} answers; at most {most} in 4 s (ending {at:.3} s)",
        times.len(),
        got.len()
    );
    assert!(
        most <= 20.0,
        "{most} arrivals in 4 s ending at {at:.3} s: {times:?}"
    );
    let first = times[0];
    for span in 0..2 {
        let from = first + 4.0 * f64::from(span);
        let n = times
            .iter()
            .filter(|&&t| t >= from && t < from + 4.0)
            .count();
        assert!(
            n >= 16,
            "only {n} of 20 in the 4 s from {from:.3} s: {times:?}"
        );
    }
    // Every answer is the upstream's or a 503 past max_wait (none here: 10 s covers it).
    assert!(got.iter().all(|&s| s == 200), "{got:?}");
    // Operators see the window and its use: /endpoints, `status`'s table, the gauge.
    let ep = fleet.endpoint("127.0.0.1").await;
    let w = &ep["windows"][0];
    assert_eq!(w["limit"], 20, "{ep}");
    assert_eq!(w["per_ms"], 4000, "{ep}");
    let used = w["used"].as_f64().unwrap();
    assert!(used > 0.0 && used <= 20.0, "{ep}");
    let views: Vec<sluice::admin::EndpointView> = vec![serde_json::from_value(ep.clone()).unwrap()];
    let table = sluice::admin::render_table(&views);
    assert!(table.contains(&format!("{used:.0}/20 per 4s")), "{table}");
    let admin = fleet.replicas[0].admin_addr;
    common::wait_for_metric(
        admin,
        "sluice_window_used{endpoint=\"127.0.0.1\",per=\"4s\"}",
    )
    .await;
    fleet.stop().await;
}

/// Every run of arrivals from the i-th to the j-th, each spending `cost`, within the
/// bucket: `cost·(j − i + 1) ≤ rate·(t_j − t_i + jitter) + burst`.
fn assert_bucket_bound(times: &[f64], cost: f64, rate: f64, burst: f64, jitter: f64) {
    for i in 0..times.len() {
        for j in i..times.len() {
            let spent = cost * (j - i + 1) as f64;
            let allowed = rate * (times[j] - times[i] + jitter) + burst;
            assert!(
                spent <= allowed + 1e-9,
                "{spent} spent from {:.3} s to {:.3} s against {allowed}: {times:?}",
                times[i],
                times[j]
            );
        }
    }
}

const TEN: &str = "[defaults]\nrate = 10.0\nburst = 10.0\nmax_wait = \"10s\"\n\
                   [defaults.adaptive]\nabsorb = \"off\"\n";

/// `X-Sluice-Cost: 5` at rate 10, burst 10, saturated for 3 s: each request spends five
/// tokens (at most (rate·W + burst)/5 in any W), and the header never reaches the
/// receiver.
async fn costs_of_five_spend_five(fleet: Fleet) {
    let up = Upstream::start().await;
    let t0 = Instant::now();
    let five = [("x-sluice-cost", "5")];
    let got = saturate(&fleet, &up, "/c", &five, 6, Duration::from_secs(3)).await;
    assert!(got.iter().all(|&s| s == 200), "{got:?}");
    let times = arrivals(&up, "/c", t0);
    eprintln!("{} arrivals of cost 5: {times:?}", times.len());
    assert_bucket_bound(&times, 5.0, 10.0, 10.0, fleet.jitter);
    // Saturated: two at once, then one every half second.
    assert!(times.len() >= 7, "{times:?}");
    assert!(
        up.arrivals()
            .iter()
            .all(|a| !a.headers.contains_key("x-sluice-cost")),
        "the cost header reached the receiver"
    );
    fleet.stop().await;
}

const PRICEY: &str = "[defaults]\nrate = 10.0\nburst = 10.0\nmax_wait = \"10s\"\n\
                      [defaults.adaptive]\nabsorb = \"off\"\n\
                      [[endpoints]]\nid = \"pricey\"\nhosts = [\"127.0.0.1\"]\ncost = 5\n";

/// `cost = 5` on an endpoint rule: the sender names nothing, and each request still
/// spends five tokens.
async fn a_rules_cost_spends_without_a_header(fleet: Fleet) {
    let up = Upstream::start().await;
    let t0 = Instant::now();
    let got = saturate(&fleet, &up, "/r", &[], 6, Duration::from_secs(3)).await;
    assert!(got.iter().all(|&s| s == 200), "{got:?}");
    let times = arrivals(&up, "/r", t0);
    assert_bucket_bound(&times, 5.0, 10.0, 10.0, fleet.jitter);
    assert!(times.len() >= 7, "{times:?}");
    fleet.stop().await;
}

const NARROW: &str = "[defaults]\nrate = 1.0\nburst = 10.0\nmax_wait = \"10s\"\n\
                      windows = [{ limit = 8, per = \"10s\" }]\n\
                      [defaults.adaptive]\nabsorb = \"off\"\n";

/// A cost over the burst or a window's limit, or not a whole number ≥ 1, is a 400
/// `bad_request` that spends nothing: the window's eight go at once afterwards.
async fn a_cost_that_never_fits_is_refused_and_spends_nothing(fleet: Fleet) {
    let up = Upstream::start().await;
    let c = fleet.client(0);
    for bad in ["11", "9", "0", "-1", "2.5", "abc", "", "1 1"] {
        let r = c
            .get(up.url("/bad"))
            .header("x-sluice-cost", bad)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "cost {bad:?}");
        assert_eq!(
            r.headers()["x-sluice-reason"],
            "bad_request",
            "cost {bad:?}"
        );
    }
    assert_eq!(up.count(), 0);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (c, url) = (fleet.client(i), up.url("/good"));
        tasks.push(tokio::spawn(async move {
            c.get(url).send().await.unwrap().status()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let times = arrivals(&up, "/good", t0);
    assert_eq!(times.len(), 8);
    assert!(times[7] < 0.5, "the eight waited: {times:?}");
    fleet.stop().await;
}

macro_rules! both_stores {
    ($($name:ident with $cfg:expr;)*) => {
        /// In virtual time: sluice, upstream and clients share one paused runtime.
        mod memory {
            use super::*;
            $(
                #[tokio::test(start_paused = true)]
                async fn $name() {
                    super::$name(Fleet::memory($cfg).await).await
                }
            )*
        }
        /// Three in-process replicas sharing one real redis-server.
        mod redis_three_replicas {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(Fleet::redis($cfg, 3).await).await
                }
            )*
        }
    };
}

both_stores! {
    a_window_is_never_overrun_and_is_used with WINDOW;
    costs_of_five_spend_five with TEN;
    a_rules_cost_spends_without_a_header with PRICEY;
    a_cost_that_never_fits_is_refused_and_spends_nothing with NARROW;
}

/// `windows` and `cost` are checked where they are written: a limit that is not a whole
/// number ≥ 1, a window without `per`, two windows with one `per`, more than four, and a
/// cost over the burst or a window's limit each name their line and key.
#[test]
fn windows_and_cost_are_checked_at_their_lines() {
    let text = "[defaults]\nburst = 5.0\n\
                windows = [{ limit = 0, per = \"1s\" }, { limit = 3 }]\n\
                [[endpoints]]\nid = \"a\"\nwindows = [{ limit = 4, per = \"1s\" }]\ncost = 5\n\
                [[endpoints]]\nid = \"b\"\ncost = 6\n\
                [[endpoints]]\nid = \"c\"\nwindows = [{ limit = 9, per = \"1s\" }, { limit = 8, per = \"1000ms\" }]\n";
    let issues = sluice::config::Config::parse(text).expect_err("rejected");
    let at: Vec<(usize, &str)> = issues.iter().map(|i| (i.line, i.key.as_str())).collect();
    for want in [
        (3, "defaults.windows[0].limit"),
        (3, "defaults.windows[1]"),
        (7, "endpoints[0].cost"),
        (10, "endpoints[1].cost"),
        (13, "endpoints[2].windows[1]"),
    ] {
        assert!(at.contains(&want), "{want:?} not in {issues:#?}");
    }
    let ok = sluice::config::Config::parse(
        "[defaults]\nwindows = [{ limit = 5000, per = \"1h\" }, { limit = 100, per = \"1m\" }]\ncost = 2\n",
    )
    .unwrap();
    assert_eq!(ok.defaults.windows.as_slice().len(), 2);
    assert_eq!(ok.defaults.cost, 2);
}
