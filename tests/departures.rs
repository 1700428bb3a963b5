//! Senders that leave the queue: the ones behind them move up into their starts, never
//! out together, and a 429 whose sender already left still starts the cooldown.

mod common;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use common::{Reply, Upstream, wait_for_metric};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Senders that leave while others wait
/// behind them must not let the ones behind out together, nor leave the rate unused.
/// Each sender that hung up gave its token back, and the next request took the start of
/// the last one waiting again: with K senders leaving, K+1 requests reached the receiver
/// at one instant (a burst of 1 allowed one). Keeping their tokens instead left their
/// starts unused while new senders queued behind them (2.2/s of 4/s here).
#[tokio::test]
async fn senders_leaving_the_queue_never_let_the_ones_behind_out_together() {
    let (rate, burst, leavers) = (4.0, 1.0, 5);
    let up = Upstream::start().await;
    let s = common::sluice(&format!(
        "[defaults]\nrate = {rate}\nburst = {burst}\nmax_wait = \"10s\"\n"
    ))
    .await;
    let c = common::client(s.proxy_addr);
    let get = |path: String| {
        let c = c.clone();
        let url = up.url(&path);
        async move {
            c.get(url)
                .header("x-endpoint-id", "leavers")
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(get("/burst".into()).await, 200);
    // Senders that queue, each behind the one before.
    let mut waiting = Vec::new();
    for i in 0..leavers {
        let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
        let req = format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\nX-Endpoint-Id: leavers\r\n\r\n",
            up.url(&format!("/leaver/{i}")),
            up.addr
        );
        t.write_all(req.as_bytes()).await.unwrap();
        common::wait_for_tokens_below(s.admin_addr, "leavers", burst - i as f64 - 0.5).await;
        waiting.push(t);
    }
    // One that stays, then each leaver leaves and another sender comes.
    let mut stayed = vec![tokio::spawn(get("/stays/0".into()))];
    for (i, mut t) in waiting.into_iter().enumerate() {
        // The sender shuts its side; once sluice has closed the connection, the request
        // has left the queue and its reservation is being given back.
        t.shutdown().await.unwrap();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), t.read_to_end(&mut rest)).await;
        assert!(
            closed.is_ok_and(|r| r.is_ok()) && rest.is_empty(),
            "sluice closes, answering nothing"
        );
        stayed.push(tokio::spawn(get(format!("/stays/{}", i + 1))));
    }
    for r in stayed {
        assert_eq!(r.await.unwrap(), 200, "nothing is lost");
    }
    let arrivals = up.arrivals();
    assert!(
        arrivals.iter().all(|a| !a.path.starts_with("/leaver")),
        "a sender that left never arrives"
    );
    assert_eq!(arrivals.len(), 1 + leavers + 1);
    let times: Vec<Instant> = arrivals.iter().map(|a| a.at).collect();
    common::assert_no_overdraw(&times, rate, burst);
    // And the starts the leavers gave up are used: the senders that came after them
    // take those, not the slots after the last one waiting (else the endpoint idles
    // while new senders queue behind starts nobody will use).
    let achieved = common::sustained_rate(&times, burst as usize);
    assert!(achieved >= 0.9 * rate, "{achieved:.2}/s of {rate}/s");
    s.stop().await;
}

/// Senders waiting behind ones that hang
/// up move up into the starts given up, in their order, end to end: after the burst,
/// eight senders queue half a second apart, the first four hang up, and the other four
/// arrive at the first four starts (by 2 s), not at their own (2.5 s to 4 s).
/// A given-up start going only to a sender arriving later would leave the endpoint
/// idle when none comes (0.80–0.95 of the rate with senders timing out while they
/// waited).
#[tokio::test]
async fn senders_behind_ones_that_hang_up_move_up_into_their_starts() {
    let (rate, burst) = (2.0, 1.0);
    let up = Upstream::start().await;
    let s = common::sluice(&format!(
        "[defaults]\nrate = {rate}\nburst = {burst}\nmax_wait = \"10s\"\n"
    ))
    .await;
    let c = common::client(s.proxy_addr);
    let r = c
        .get(up.url("/burst"))
        .header("x-endpoint-id", "movers")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut waiting = Vec::new();
    for i in 0..8 {
        let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
        let req = format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\nX-Endpoint-Id: movers\r\n\r\n",
            up.url(&format!("/waiter/{i}")),
            up.addr
        );
        t.write_all(req.as_bytes()).await.unwrap();
        common::wait_for_tokens_below(s.admin_addr, "movers", burst - i as f64 - 0.5).await;
        waiting.push(t);
    }
    let stay = waiting.split_off(4);
    for mut t in waiting {
        t.shutdown().await.unwrap();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), t.read_to_end(&mut rest)).await;
        assert!(closed.is_ok_and(|r| r.is_ok()) && rest.is_empty());
    }
    for mut t in stay {
        let answer = common::read_response(&mut t).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    let arrivals = up.arrivals();
    let first = arrivals[0].at;
    let paths: Vec<&str> = arrivals.iter().map(|a| a.path.as_str()).collect();
    assert_eq!(
        paths,
        ["/burst", "/waiter/4", "/waiter/5", "/waiter/6", "/waiter/7"],
        "in their order; a sender that hung up never arrives"
    );
    let times: Vec<Instant> = arrivals.iter().map(|a| a.at).collect();
    common::assert_no_overdraw(&times, rate, burst);
    // The fourth start is 2 s after the burst; their own would end at 4 s.
    let last = times[4] - first;
    assert!(
        last < Duration::from_secs(3),
        "the last arrived {last:?} after the burst"
    );
    s.stop().await;
}

/// A 429 whose sender left before it came
/// must still start the cooldown, on both engines. On hyper's path (HTTP/1.0 senders,
/// HTTP/2, requests after a handover) the exchange went with the sender, so a receiver
/// slower than its senders' timeouts never slowed anything down: 80 arrivals in 10 s
/// against one that answered every one with `429` + `Retry-After: 5`.
#[tokio::test]
async fn a_429_starts_the_cooldown_when_its_sender_left_before_it_came() {
    let up = Upstream::with(Arc::new(|_| {
        Reply::status(429)
            .header("retry-after", "10")
            .delay(Duration::from_millis(300))
    }))
    .await;
    let s = common::sluice("[defaults]\nrate = 100.0\nburst = 10.0\n").await;
    for (id, version) in [("hyper-path", "HTTP/1.0"), ("lane", "HTTP/1.1")] {
        let before = up.count();
        let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
        let req = format!(
            "GET {} {version}\r\nHost: {}\r\nX-Endpoint-Id: {id}\r\n\r\n",
            up.url("/slow"),
            up.addr
        );
        t.write_all(req.as_bytes()).await.unwrap();
        common::wait_for(
            &format!("{id}: the request at the receiver"),
            Duration::from_secs(5),
            || async { up.count() > before },
        )
        .await;
        // The sender gives up before the answer.
        drop(t);
        common::wait_for(
            &format!("{id}: the cooldown"),
            Duration::from_secs(5),
            || async {
                common::endpoint(s.admin_addr, id)
                    .await
                    .is_some_and(|e| e["cooldown_ms"].as_u64().is_some_and(|ms| ms > 5_000))
            },
        )
        .await;
        // Counted once, on hyper's path as the lane counts it.
        wait_for_metric(
            s.admin_addr,
            &format!("sluice_upstream_responses_total{{endpoint=\"{id}\",code=\"429\"}} 1\n"),
        )
        .await;
    }
    s.stop().await;
}
