//! Memory per waiting request: starts the sluice binary (memory store, one token per
//! 1 000 s, a `max_wait` long enough for all N to wait), parks N requests on one endpoint
//! (one connection each), and reads the process's resident set (`VmRSS`) before and
//! after. It reports only once every request holds its reservation, and fails otherwise.
//!
//! With `idle` as third argument it measures kept-alive senders at rest instead: N
//! connections each send three requests through (so each holds its own upstream
//! connection, as a busy sender does) and then wait for their next request.
//!
//! `cargo build --release --bin sluice --example waiters_rss &&
//!  target/release/examples/waiters_rss target/release/sluice 10000 [idle]`

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

async fn tokens(admin: u16) -> Option<f64> {
    let mut s = TcpStream::connect(("127.0.0.1", admin)).await.ok()?;
    s.write_all(b"GET /endpoints HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut body = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut s, &mut body)
        .await
        .ok()?;
    let text = String::from_utf8_lossy(&body);
    let at = text.find("\"tokens\":")? + 9;
    text[at..]
        .split([',', '\n', '}'])
        .next()?
        .trim()
        .parse()
        .ok()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let bin = args
        .next()
        .unwrap_or_else(|| "target/release/sluice".into());
    let n: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(10_000);
    if args.next().as_deref() == Some("idle") {
        return idle(&bin, n).await;
    }
    let upstream = TcpListener::bind("127.0.0.1:0").await?;
    let up = upstream.local_addr()?;
    let (proxy, admin) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("sluice-waiters-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let cfg = dir.join("sluice.toml");
    let mut f = std::fs::File::create(&cfg)?;
    // The last of N waits N × 1 000 s: every one must fit in max_wait, or it is refused
    // at once and the figure would count refused connections, not waiters.
    let max_wait_h = (n as u64 + 1) * 1000 / 3600 + 1;
    // Room for the N waiters and the first sender (kept alive until the end).
    let max_connections = n + 16;
    write!(
        f,
        "[proxy]\nlisten = \"127.0.0.1:{proxy}\"\nadmin_listen = \"127.0.0.1:{admin}\"\nworkers = 1\nmax_connections = {max_connections}\n\
         [log]\ndecisions = false\n[defaults]\nrate = 0.001\nburst = 1.0\nmax_wait = \"{max_wait_h}h\"\n\
         [defaults.adaptive]\nenabled = false\n[security]\nallow_private_destinations = true\n"
    )?;
    let mut child = start_sluice(&bin, &cfg, proxy).await?;
    let pid = child.id();
    // One request through first: the endpoint exists and the burst token is spent.
    let req = format!("GET http://{up}/ HTTP/1.1\r\nHost: {up}\r\nX-Endpoint-Id: hold\r\n\r\n");
    let mut first = TcpStream::connect(("127.0.0.1", proxy)).await?;
    first.write_all(req.as_bytes()).await?;
    let (mut conn, _) = upstream.accept().await?;
    let _ = conn
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_kib(pid);
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let mut s = TcpStream::connect(("127.0.0.1", proxy)).await?;
        s.write_all(req.as_bytes()).await?;
        held.push(s);
    }
    // Wait until every request holds its reservation (tokens ≈ -n).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let t = tokens(admin).await.unwrap_or(0.0);
        if t <= -(n as f64) + 0.5 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let waiting = -tokens(admin).await.unwrap_or(0.0);
    if waiting < n as f64 - 0.5 {
        let _ = child.kill();
        return Err(format!("only {waiting:.0} of {n} requests are waiting").into());
    }
    report(
        child,
        before,
        n,
        "requests waiting on one endpoint",
        "per waiter (its socket, connection task and reservation)",
    );
    drop(held);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Prints one table row: the RSS sluice grew by since `before`, per each of `n` things;
/// then stops sluice.
fn report(mut child: std::process::Child, before: u64, n: usize, what: &str, per_what: &str) {
    let after = rss_kib(child.id());
    let per = (after.saturating_sub(before)) as f64 * 1024.0 / n as f64;
    println!("| {n} {what} | RSS {before} KiB → {after} KiB | {per:.0} bytes {per_what} |");
    let _ = child.kill();
    let _ = child.wait();
}

/// Answers every request on every connection with a kept-alive `200 ok`.
async fn keep_alive_upstream(listener: TcpListener) {
    while let Ok((mut conn, _)) = listener.accept().await {
        tokio::spawn(async move {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                let Ok(n) = tokio::io::AsyncReadExt::read(&mut conn, &mut chunk).await else {
                    return;
                };
                if n == 0 {
                    return;
                }
                buf.extend_from_slice(&chunk[..n]);
                while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    buf.drain(..end + 4);
                    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    if conn.write_all(ok).await.is_err() {
                        return;
                    }
                }
            }
        });
    }
}

/// Sends one request on `s` and reads its `ok` answer.
async fn exchange(s: &mut TcpStream, req: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
    s.write_all(req).await?;
    let mut got = Vec::new();
    let mut chunk = [0u8; 1024];
    while !got.ends_with(b"ok") {
        let n = tokio::io::AsyncReadExt::read(s, &mut chunk).await?;
        if n == 0 {
            return Err("the proxy closed a kept-alive connection".into());
        }
        got.extend_from_slice(&chunk[..n]);
    }
    Ok(())
}

/// Memory per kept-alive sender connection at rest (see the module doc).
async fn idle(bin: &str, n: usize) -> Result<(), Box<dyn std::error::Error>> {
    let upstream = TcpListener::bind("127.0.0.1:0").await?;
    let up = upstream.local_addr()?;
    tokio::spawn(keep_alive_upstream(upstream));
    let (proxy, admin) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("sluice-idle-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let cfg = dir.join("sluice.toml");
    let max_connections = n + 16;
    std::fs::write(
        &cfg,
        format!(
            "[proxy]\nlisten = \"127.0.0.1:{proxy}\"\nadmin_listen = \"127.0.0.1:{admin}\"\nworkers = 1\n\
             max_connections = {max_connections}\n[log]\ndecisions = false\n\
             [defaults]\nrate = 1000000000.0\nburst = 1000000000.0\n\
             [security]\nallow_private_destinations = true\n"
        ),
    )?;
    let mut child = start_sluice(bin, &cfg, proxy).await?;
    let pid = child.id();
    let req = format!("GET http://{up}/ HTTP/1.1\r\nHost: {up}\r\nX-Endpoint-Id: e\r\n\r\n");
    let before = rss_kib(pid);
    let mut held = Vec::with_capacity(n);
    let started = Instant::now();
    for _ in 0..n {
        let mut s = TcpStream::connect(("127.0.0.1", proxy)).await?;
        for _ in 0..3 {
            if let Err(e) = exchange(&mut s, req.as_bytes()).await {
                let _ = child.kill();
                return Err(e);
            }
        }
        held.push(s);
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            return Err("connections took longer than 2 minutes".into());
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    report(
        child,
        before,
        n,
        "kept-alive sender connections at rest, each with its upstream connection",
        "per connection",
    );
    drop(held);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Starts the sluice binary on `cfg` and waits (at most 10 s) until `proxy` accepts.
async fn start_sluice(
    bin: &str,
    cfg: &std::path::Path,
    proxy: u16,
) -> Result<std::process::Child, Box<dyn std::error::Error>> {
    let mut child = Command::new(bin)
        .args(["run", "--config"])
        .arg(cfg)
        .stderr(Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", proxy)).await.is_err() {
        if Instant::now() > deadline {
            let _ = child.kill();
            return Err("sluice did not start".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(child)
}
