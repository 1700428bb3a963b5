//! Seeing the queue: `/endpoints`' waiting, in-flight and refusal counts (and their
//! metrics and `sluice status` columns), the console page at `/ui` in a real headless
//! Chromium, and `sluice top` in a terminal (tmux).

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::process::output_within;
use common::{Reply, Upstream, client};

/// `/endpoints` of the admin listener at `admin`.
async fn endpoints(admin: std::net::SocketAddr) -> Vec<sluice::admin::EndpointView> {
    reqwest::get(format!("http://{admin}/endpoints"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn view<'a>(views: &'a [sluice::admin::EndpointView], id: &str) -> &'a sluice::admin::EndpointView {
    views.iter().find(|v| v.id == id).unwrap()
}

/// Sends a GET for `path` through sluice on `endpoint`, in a task of its own.
fn send(
    c: &reqwest::Client,
    up: &Upstream,
    path: &str,
    endpoint: &str,
    priority: Option<&str>,
) -> tokio::task::JoinHandle<u16> {
    let mut req = c.get(up.url(path)).header("x-endpoint-id", endpoint);
    if let Some(p) = priority {
        req = req.header("x-sluice-priority", p);
    }
    tokio::spawn(async move { req.send().await.map_or(0, |r| r.status().as_u16()) })
}

/// With one request at a slow receiver and four waiting for their starts (5 s apart), the
/// endpoint shows 4 waiting, 1 in flight and how long the first has waited; a queued
/// endpoint breaks its waiting down by priority; refusals of the last minute are
/// counted; `sluice_waiting` and `sluice_oldest_wait_seconds` follow, and `sluice
/// status` prints the columns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_show_who_waits_what_is_in_flight_and_what_was_refused() {
    let up = Upstream::with(Arc::new(|a| {
        if a.path == "/slow" {
            Reply::ok().delay(Duration::from_secs(8))
        } else {
            Reply::ok()
        }
    }))
    .await;
    let s = common::sluice(
        "[[endpoints]]\nid = \"w\"\nrate = 0.2\nburst = 1.0\nmax_wait = \"60s\"\n\
         [[endpoints]]\nid = \"p\"\nrate = 0.2\nburst = 1.0\nmax_wait = \"60s\"\n\
         [[endpoints]]\nid = \"r\"\nrate = 1.0\nburst = 1.0\nmax_wait = \"0s\"\n",
    )
    .await;
    let c = client(s.proxy_addr);
    let mut tasks = vec![send(&c, &up, "/slow", "w", None)];
    common::wait_for(
        "the first request in flight",
        Duration::from_secs(5),
        || async { view(&endpoints(s.admin_addr).await, "w").in_flight == 1 },
    )
    .await;
    for _ in 0..4 {
        tasks.push(send(&c, &up, "/", "w", None));
    }
    // A priority named once queues the endpoint: the first (`low`) leaves at once, the
    // next holds the head until its start, the two after it wait in the queue.
    assert_eq!(send(&c, &up, "/", "p", Some("low")).await.unwrap(), 200);
    for _ in 0..3 {
        tasks.push(send(&c, &up, "/", "p", Some("high")));
    }
    for _ in 0..3 {
        let r = c.get(up.url("/")).header("x-endpoint-id", "r").send().await;
        r.unwrap();
    }
    common::wait_for("4 waiting on w, 3 on p", Duration::from_secs(5), || async {
        let views = endpoints(s.admin_addr).await;
        view(&views, "w").waiting == 4 && view(&views, "p").waiting == 3
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let views = endpoints(s.admin_addr).await;
    let (w, p, r) = (view(&views, "w"), view(&views, "p"), view(&views, "r"));
    assert_eq!(w.in_flight, 1, "{w:?}");
    assert!(w.oldest_wait_ms >= 100, "{w:?}");
    assert_eq!(w.waiting_by_priority, sluice::admin::ByPriority::default());
    assert_eq!(p.waiting_by_priority.high, 2, "{p:?}");
    assert_eq!(r.refused_1m, 2, "{r:?}");
    assert_eq!(r.sent, 1, "{r:?}");
    common::wait_for_metric(s.admin_addr, "sluice_waiting{endpoint=\"w\"} 4").await;
    let text = common::metrics(s.admin_addr).await;
    assert!(
        text.contains("# TYPE sluice_waiting gauge")
            && text.contains("# TYPE sluice_oldest_wait_seconds gauge")
            && text.contains("sluice_oldest_wait_seconds{endpoint=\"w\"}"),
        "{text}"
    );
    let admin = format!("http://{}", s.admin_addr);
    let out = tokio::task::spawn_blocking(move || {
        output_within(
            Command::new(env!("CARGO_BIN_EXE_sluice")).args(["status", "--admin", &admin]),
            Duration::from_secs(10),
        )
    })
    .await
    .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{table}");
    let header = table.lines().next().unwrap();
    for col in ["WAITING", "IN FLIGHT", "OLDEST", "REFUSED/1M"] {
        assert!(header.contains(col), "no {col}:\n{table}");
    }
    let row: Vec<&str> = table
        .lines()
        .find(|l| l.starts_with("w "))
        .unwrap()
        .split_whitespace()
        .collect();
    let at = |name: &str| {
        let i = header
            .split("  ")
            .filter(|c| !c.trim().is_empty())
            .position(|c| c.trim() == name)
            .unwrap();
        row[i]
    };
    assert_eq!(at("WAITING"), "4", "{table}");
    assert_eq!(at("IN FLIGHT"), "1", "{table}");
    // Senders that give up leave nothing counted behind.
    for t in &tasks[1..] {
        t.abort();
    }
    assert_eq!(
        tasks.remove(0).await.unwrap(),
        200,
        "the slow one is answered"
    );
    common::wait_for("nothing left waiting", Duration::from_secs(5), || async {
        let views = endpoints(s.admin_addr).await;
        let (w, p) = (view(&views, "w"), view(&views, "p"));
        w.waiting + w.in_flight + p.waiting + p.in_flight == 0
    })
    .await;
    s.stop().await;
}
