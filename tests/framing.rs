//! Answers at the edges of framing, on both engines (the plain lane and hyper's path):
//! a receiver's unsolicited bytes on a kept-alive upstream connection never reach
//! another sender; a malformed chunked request body, an HTTP/2 preface on the plain
//! port and a request from a sender that half-closes after sending each get an answer,
//! not a silent close.
//!
//! In process, `Connection: keep-alive` keeps a request in the lane and a `Connection`
//! naming a header hands it to hyper; HTTP/1.0, origin-form and chunked requests are
//! hyper's in any case. The lane-off engine (`SLUICE_PLAIN_LANE=0`, read once per
//! process) runs as a child process.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use common::process::LoggedChild;
use common::{read_response, sluice, wait_for};

/// `Connection` values that keep a request in the lane, and that hand it to hyper.
const BOTH_PATHS: [&str; 2] = ["keep-alive", "x-hop"];

/// The unsolicited response a lying receiver writes after each real one.
const FORGED: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged";

/// A raw receiver on 127.0.0.1 that answers each request with its path as the body,
/// then, a moment later, writes [`FORGED`] on the same kept-alive connection; the
/// counter says how many it tried to write (the connection may be closed by then).
async fn lying_receiver() -> (SocketAddr, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let forged = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&forged);
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let counter = Arc::clone(&counter);
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let end = loop {
                        if let Some(e) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                            break e + 4;
                        }
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&got[..end]).into_owned();
                    got.drain(..end);
                    let path = head.split(' ').nth(1).unwrap_or("").to_owned();
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{path}",
                        path.len()
                    );
                    if s.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                    // The receiver's behaviour under test, not a synchronisation: its
                    // extra answer comes in a segment of its own, after the real one.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let forged = s.write_all(FORGED).await;
                    counter.fetch_add(1, Ordering::SeqCst);
                    if forged.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, forged, task)
}

/// Sends `GET http://{up}{path}` with `Connection: connection` on `t` and reads one
/// response: its body, or what came when it was not one.
async fn get(t: &mut TcpStream, up: SocketAddr, path: &str, connection: &str) -> String {
    let req =
        format!("GET http://{up}{path} HTTP/1.1\r\nHost: {up}\r\nConnection: {connection}\r\n\r\n");
    if t.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    let r = read_response(t).await;
    match r.split_once("\r\n\r\n") {
        Some((_, body)) => body.to_owned(),
        None => r,
    }
}

/// A sender connection that held an upstream connection (two requests in a row to one
/// receiver) leaves; the receiver then writes an answer nobody asked for on that
/// connection. The next sender to the receiver gets its own answer, never those bytes,
/// on both engines, in every trial.
#[tokio::test]
async fn a_receivers_unsolicited_bytes_never_reach_the_next_sender() {
    const TRIALS: usize = 30;
    let s = sluice("").await;
    let mut report = Vec::new();
    for connection in BOTH_PATHS {
        let mut wrong = Vec::new();
        for trial in 0..TRIALS {
            // A receiver of its own per trial: no connection kept from another trial.
            let (up, forged, _task) = lying_receiver().await;
            let mut a = TcpStream::connect(s.proxy_addr).await.unwrap();
            let first = get(&mut a, up, "/a1", connection).await;
            let second = get(&mut a, up, "/a2", connection).await;
            drop(a);
            // The receiver has written its extra answer after each of A's requests (its
            // Nagle delay may hold it until sluice's next ACK).
            wait_for(
                "the receiver's extra answers",
                Duration::from_secs(5),
                || {
                    let n = forged.load(Ordering::SeqCst);
                    async move { n >= 2 }
                },
            )
            .await;
            let mut b = TcpStream::connect(s.proxy_addr).await.unwrap();
            let own = get(&mut b, up, "/b", connection).await;
            if own != "/b" {
                wrong.push((trial, first, second, own));
            }
        }
        if !wrong.is_empty() {
            report.push(format!(
                "{connection}: {} of {TRIALS} next senders got another answer than their own: {wrong:?}",
                wrong.len()
            ));
        }
    }
    s.stop().await;
    assert!(report.is_empty(), "{report:#?}");
}

/// A sluice child process with the lane off (`SLUICE_PLAIN_LANE=0`: every connection is
/// hyper's) and `extra` in its config: the child and its proxy address.
fn lane_off(dir: &std::path::Path, extra: &str) -> (LoggedChild, SocketAddr) {
    let path = dir.join("lane-off.toml");
    std::fs::write(
        &path,
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             [security]\nallow_private_destinations = true\n{extra}"
        ),
    )
    .unwrap();
    let mut run = LoggedChild::spawn(
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["run", "--config"])
            .arg(&path)
            .env("SLUICE_PLAIN_LANE", "0"),
    );
    run.wait_log("sluice listening", Duration::from_secs(20));
    let log = run.log();
    let line = log
        .lines()
        .find(|l| l.contains("sluice listening"))
        .unwrap();
    let (at, skip) = match line.find("proxy_addr=") {
        Some(at) => (at, "proxy_addr=".len()),
        None => (
            line.find("\"proxy_addr\":\"").unwrap(),
            "\"proxy_addr\":\"".len(),
        ),
    };
    let addr = line[at + skip..]
        .split(|c: char| c.is_whitespace() || c == '"')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    (run, addr)
}

/// Writes `parts` to the proxy at `proxy` (each part in a write of its own, the next
/// one only once the receiver holds the request's head when `wait` says so), then
/// half-closes when `half_close`, and reads until the proxy closes (10 s at most).
async fn send_parts(proxy: SocketAddr, parts: &[&[u8]], half_close: bool) -> String {
    let mut t = TcpStream::connect(proxy).await.unwrap();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            // Not a synchronisation: a later read, as a sender writing its body after
            // its head.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if t.write_all(part).await.is_err() {
            break;
        }
    }
    if half_close {
        let _ = t.shutdown().await;
    }
    let mut all = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        loop {
            match t.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => all.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    String::from_utf8_lossy(&all).into_owned()
}

/// Malformed chunked request bodies.
const BAD_BODIES: [&[u8]; 10] = [
    b"zz\r\nhello\r\n0\r\n\r\n",
    b"5\r\nhelloXX\r\n0\r\n\r\n",
    b"2\nhi\r\n0\r\n\r\n",
    b"fffffffffffffffff\r\nhi\r\n0\r\n\r\n",
    b"2\r\nhi\r\n0\r\nx-t: \x01\r\n\r\n",
    b"2\r\nhi\r\n0\r\n folded\r\n\r\n",
    b"2\r\nhi\r\n0\r\n\r\r",
    b"-2\r\nhi\r\n0\r\n\r\n",
    b"2 junk\r\nhi\r\n0\r\n\r\n",
    b"\r\n2\r\nhi\r\n0\r\n\r\n",
];

/// A malformed chunked request body is a 400 `bad_request`, whether it arrives in the
/// same read as the request head or in a later one, on both engines.
#[tokio::test]
async fn a_malformed_chunked_body_is_answered_however_it_arrives() {
    let up = common::Upstream::start().await;
    let s = sluice("").await;
    let host = up.addr;
    let mut silent = Vec::new();
    for connection in BOTH_PATHS {
        for body in BAD_BODIES {
            let head = format!(
                "POST http://{host}/bad HTTP/1.1\r\nHost: {host}\r\nConnection: {connection}\r\n\
                 Transfer-Encoding: chunked\r\n\r\n"
            );
            let together = [head.as_bytes(), body].concat();
            for (how, parts) in [
                ("same read", vec![&together[..]]),
                ("later read", vec![head.as_bytes(), body]),
            ] {
                let r = send_parts(s.proxy_addr, &parts, false).await;
                let lower = r.to_ascii_lowercase();
                if !(lower.starts_with("http/1.1 400")
                    && lower.contains("x-sluice-reason: bad_request"))
                {
                    silent.push(format!(
                        "{connection}, {how}, {:?}: {r:?}",
                        String::from_utf8_lossy(body)
                    ));
                }
            }
        }
    }
    s.stop().await;
    assert!(silent.is_empty(), "{silent:#?}");
}

/// The HTTP/2 connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// Whether `r` is sluice's 400 for an HTTP/2 preface on the plain port: it says the
/// port speaks HTTP/1.1.
fn answers_the_preface(r: &str) -> bool {
    let lower = r.to_ascii_lowercase();
    lower.starts_with("http/1.1 400")
        && lower.contains("x-sluice-reason: bad_request")
        && lower.contains("http/1.1")
        && lower.contains("http/2")
}

/// An HTTP/2 connection preface (prior knowledge, h2c) on the plain proxy port gets a
/// 400 saying the port speaks HTTP/1.1, on both engines.
#[tokio::test]
async fn an_http2_preface_on_the_plain_port_is_answered() {
    let s = sluice("").await;
    let r = send_parts(s.proxy_addr, &[PREFACE], false).await;
    s.stop().await;
    let dir = tempfile::tempdir().unwrap();
    let (_child, proxy) = lane_off(dir.path(), "");
    let off = send_parts(proxy, &[PREFACE], false).await;
    assert!(
        answers_the_preface(&r) && answers_the_preface(&off),
        "lane: {r:?}\nlane off: {off:?}"
    );
}

/// A sender that half-closes (`shutdown(SHUT_WR)`) right after its request still gets
/// the answer, on both engines: an HTTP/1.0 request and an absolute-form HTTP/1.1 one
/// are forwarded and answered, an origin-form one is refused 400. One whose request
/// waits for a token, though, has left: the request is never forwarded.
#[tokio::test]
async fn a_sender_that_half_closes_after_its_request_is_answered() {
    let up = common::Upstream::start().await;
    let host = up.addr;
    let requests = [
        (
            format!("GET http://{host}/ten HTTP/1.0\r\nHost: {host}\r\n\r\n"),
            "200",
        ),
        (
            format!(
                "GET http://{host}/eleven HTTP/1.1\r\nHost: {host}\r\nConnection: x-hop\r\n\r\n"
            ),
            "200",
        ),
        (
            format!("GET http://{host}/lane HTTP/1.1\r\nHost: {host}\r\n\r\n"),
            "200",
        ),
        (format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n"), "400"),
        ("GET / HTTP/1.0\r\n\r\n".to_owned(), "400"),
    ];
    let s = sluice("").await;
    let dir = tempfile::tempdir().unwrap();
    let (_child, off) = lane_off(dir.path(), "");
    let mut unanswered = Vec::new();
    for (engine, proxy) in [("lane", s.proxy_addr), ("lane off", off)] {
        for (req, status) in &requests {
            let r = send_parts(proxy, &[req.as_bytes()], true).await;
            let line = r.lines().next().unwrap_or("");
            if !(line.starts_with("HTTP/1.") && line.split(' ').nth(1) == Some(status)) {
                unanswered.push(format!("{engine}: {req:?}: {r:?}"));
            }
        }
    }
    s.stop().await;
    assert!(unanswered.is_empty(), "{unanswered:#?}");
}

/// On hyper's path as in the lane, a sender that half-closes while its request waits for
/// a token has left: sluice closes, answering nothing, and the request never arrives.
#[tokio::test]
async fn a_sender_that_half_closes_while_its_request_waits_has_left_on_hyper_s_path() {
    let up = common::Upstream::start().await;
    let s = sluice("[defaults]\nrate = 0.1\nburst = 1.0\nmax_wait = \"30s\"\n").await;
    let host = up.addr;
    let first =
        format!("GET http://{host}/first HTTP/1.1\r\nHost: {host}\r\nX-Endpoint-Id: ep\r\n\r\n");
    let r = common::raw_exchange(s.proxy_addr, first.as_bytes()).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    for connection in BOTH_PATHS {
        let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
        let req = format!(
            "GET http://{host}/waits HTTP/1.1\r\nHost: {host}\r\nX-Endpoint-Id: ep\r\n\
             Connection: {connection}\r\n\r\n"
        );
        t.write_all(req.as_bytes()).await.unwrap();
        let waiting = |n: u64| {
            let admin = s.admin_addr;
            async move {
                common::endpoint(admin, "ep")
                    .await
                    .is_some_and(|e| e["waiting"].as_u64() == Some(n))
            }
        };
        wait_for("the request waiting", Duration::from_secs(5), || waiting(1)).await;
        t.shutdown().await.unwrap();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), t.read_to_end(&mut rest)).await;
        assert!(
            closed.is_ok() && rest.is_empty(),
            "{connection}: sluice closes, answering nothing: {:?}",
            String::from_utf8_lossy(&rest)
        );
        wait_for("the wait over", Duration::from_secs(5), || waiting(0)).await;
    }
    assert_eq!(up.count(), 1, "a sender that left never arrives");
    s.stop().await;
}
