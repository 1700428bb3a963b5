//! An open-loop load generator for latency at a fixed offered rate: requests are due at
//! `start + i / RATE` whatever the proxy does, so a proxy that answers faster does not
//! get more load, and a slow answer does not postpone the next request (no coordinated
//! omission). wrk's closed loop cannot compare two proxies' p99 at the same load: its 32
//! connections send as fast as answers come, so the faster proxy carries more.
//!
//! `paced_load PROXY_ADDR UPSTREAM_ADDR RATE SECONDS [CONNECTIONS]` sends
//! `GET http://UPSTREAM_ADDR/` through the proxy at `PROXY_ADDR` over `CONNECTIONS`
//! (default 64) kept-alive connections, one request at a time on each, and prints
//! `sent|errors|achieved req/s|p50 µs|p99 µs|p99.9 µs|max µs`.
//!
//! A request's latency runs from when it was sent, or from when it was due if every
//! connection was still busy then (the wait for a connection counts). Due times are
//! kept with tokio's millisecond timer: a connection that sleeps until its request is due
//! starts the clock when it wakes, so timer lateness is not counted against the proxy.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Reads one response (head and a `Content-Length` body) from `s`.
async fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<()> {
    buf.clear();
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = std::str::from_utf8(&buf[..end]).map_err(std::io::Error::other)?;
        if !head.starts_with("HTTP/1.1 200") {
            return Err(std::io::Error::other(format!(
                "answer: {}",
                head.lines().next().unwrap_or("")
            )));
        }
        let len = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())
                    .flatten()
            })
            .unwrap_or(0);
        if buf.len() >= end + 4 + len {
            return Ok(());
        }
    }
}

struct Plan {
    start: Instant,
    interval: Duration,
    total: u64,
    next: AtomicU64,
    errors: AtomicU64,
}

/// One connection: takes the next due request whenever it is free.
async fn connection(proxy: String, request: Arc<Vec<u8>>, plan: Arc<Plan>) -> Vec<u32> {
    let mut latencies = Vec::new();
    let Ok(mut s) = TcpStream::connect(&proxy).await else {
        plan.errors.fetch_add(1, Ordering::Relaxed);
        return latencies;
    };
    let _ = s.set_nodelay(true);
    let mut buf = Vec::with_capacity(4096);
    loop {
        let i = plan.next.fetch_add(1, Ordering::Relaxed);
        if i >= plan.total {
            return latencies;
        }
        let due = plan.start + plan.interval * i as u32;
        let from = if Instant::now() >= due {
            // Every connection was busy when it fell due: the wait counts.
            due
        } else {
            tokio::time::sleep_until(due).await;
            Instant::now()
        };
        let answered = async {
            s.write_all(&request).await?;
            read_response(&mut s, &mut buf).await
        };
        match answered.await {
            Ok(()) => latencies.push(from.elapsed().as_micros().min(u32::MAX as u128) as u32),
            Err(e) => {
                plan.errors.fetch_add(1, Ordering::Relaxed);
                eprintln!("paced_load: {e}");
                return latencies;
            }
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        eprintln!("usage: paced_load PROXY_ADDR UPSTREAM_ADDR RATE SECONDS [CONNECTIONS]");
        std::process::exit(2);
    }
    let proxy = args[1].clone();
    let upstream = &args[2];
    let rate: f64 = args[3].parse().expect("RATE: requests per second");
    let seconds: f64 = args[4].parse().expect("SECONDS");
    let conns: usize = args.get(5).map_or(64, |c| c.parse().expect("CONNECTIONS"));
    assert!(rate > 0.0 && seconds > 0.0 && conns > 0);
    let request = Arc::new(
        format!(
            "GET http://{upstream}/ HTTP/1.1\r\nHost: {upstream}\r\nX-Endpoint-Id: bench\r\n\r\n"
        )
        .into_bytes(),
    );
    // One thread, like `wrk -t1`.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (latencies, plan, took) = rt.block_on(async {
        let plan = Arc::new(Plan {
            // Time for every connection to open before the first request is due.
            start: Instant::now() + Duration::from_millis(200),
            interval: Duration::from_secs_f64(1.0 / rate),
            total: (rate * seconds) as u64,
            next: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        });
        let tasks: Vec<_> = (0..conns)
            .map(|_| {
                tokio::spawn(connection(
                    proxy.clone(),
                    Arc::clone(&request),
                    Arc::clone(&plan),
                ))
            })
            .collect();
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.expect("connection task"));
        }
        let took = plan.start.elapsed();
        (all, plan, took)
    });
    let mut sorted = latencies;
    sorted.sort_unstable();
    let at = |q: f64| {
        sorted
            .get(((sorted.len() as f64 * q) as usize).min(sorted.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    println!(
        "{}|{}|{:.0}|{}|{}|{}|{}",
        sorted.len(),
        plan.errors.load(Ordering::Relaxed),
        sorted.len() as f64 / took.as_secs_f64(),
        at(0.50),
        at(0.99),
        at(0.999),
        sorted.last().copied().unwrap_or(0)
    );
}
