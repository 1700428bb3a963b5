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
                    eprintln!("DEBUG up {:?} answered {path} at {:?}", s.peer_addr(), std::time::Instant::now());
                    // The receiver's behaviour under test, not a synchronisation: its
                    // extra answer comes in a segment of its own, after the real one.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let forged = s.write_all(FORGED).await;
                    counter.fetch_add(1, Ordering::SeqCst);
                    if forged.is_err() {
                        return;
                    }
                    eprintln!("DEBUG up {:?} forged at {:?}", s.peer_addr(), std::time::Instant::now());
                }
            });
        }
    });
    (addr, forged, task)
}

/// Sends `GET http://{up}{path}` with `Connection: connection` on `t` and reads one
/// response: its body, or what came when it was not one.
async fn get(t: &mut TcpStream, up: SocketAddr, path: &str, connection: &str) -> String {
    let req = format!(
        "GET http://{up}{path} HTTP/1.1\r\nHost: {up}\r\nConnection: {connection}\r\n\r\n"
    );
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
            wait_for("the receiver's extra answers", Duration::from_secs(5), || {
                let n = forged.load(Ordering::SeqCst);
                async move { n >= 2 }
            })
            .await;
            eprintln!("DEBUG B at {:?}", std::time::Instant::now());
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
