//! The admin listener under pressure: probes are answered however many sockets sit open
//! on it.

mod common;

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// More idle sockets than the admin listener's cap (4,096) do not hold `/healthz` back:
/// the oldest idle connection gives its place up to the new one.
#[tokio::test]
async fn healthz_answers_at_once_past_the_admin_cap_of_idle_sockets() {
    let s = common::sluice("").await;
    let admin = s.admin_addr;
    let mut idle = Vec::new();
    for _ in 0..(sluice::fds::ADMIN_MAX_CONNECTIONS + 100) {
        idle.push(TcpStream::connect(admin).await.unwrap());
    }
    let started = Instant::now();
    let mut probe = TcpStream::connect(admin).await.unwrap();
    probe
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: sluice\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), probe.read_to_end(&mut answer))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    let took = started.elapsed();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The idle sockets would be closed by the admin idle timeout (5 s) at the latest.
    assert!(took < Duration::from_secs(1), "/healthz took {took:?}");
    drop(idle);
    s.stop().await;
}
