//! HTTPS interception cost, side by side in one run, against a separate sluice process:
//! plain HTTP through sluice | intercepted HTTPS over kept-alive tunnels (HTTP/1.1) |
//! intercepted HTTPS with a fresh tunnel and handshake per request | intercepted HTTPS
//! over kept-alive tunnels whose client offers `h2` (sluice takes it).
//!
//! `cargo build --release --bin sluice --example tls_bench && target/release/examples/tls_bench [SECONDS [ROUNDS]]`
//!
//! Rounds (default 3) are interleaved with the order rotated; each row is its scenario's
//! median round, and the ratio compares medians. The CPU column is the sluice
//! process's own utime + stime per request, from /proc (median round); the load column
//! is this process's (the clients and the upstream, which pay their own TLS ends), so
//! the req/s ratio can be read against where the box's CPU went.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn serve_plain(listener: TcpListener) {
    while let Ok((s, _)) = listener.accept().await {
        tokio::spawn(async move {
            let svc = service_fn(|_r| async {
                Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from_static(b"ok"))))
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(s), svc)
                .await;
        });
    }
}

async fn serve_tls(listener: TcpListener, cfg: Arc<rustls::ServerConfig>) {
    let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
    while let Ok((s, _)) = listener.accept().await {
        let _ = s.set_nodelay(std::env::var("BENCH_UP_NODELAY").is_ok());
        let acceptor = acceptor.clone();
        tokio::spawn(async move {
            let Ok(tls) = acceptor.accept(s).await else {
                return;
            };
            let svc = service_fn(|_r| async {
                Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from_static(b"ok"))))
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(tls), svc)
                .await;
        });
    }
}

/// Runs `workers` loops for `secs`; returns (req/s, p50, p99). With `fresh`, every
/// request gets a new client (new CONNECT, new TLS handshake); otherwise each worker
/// keeps one client and its kept-alive connection.
async fn load(
    make: impl Fn() -> reqwest::Client + Send + Sync + 'static,
    url: String,
    workers: usize,
    secs: u64,
    fresh: bool,
) -> (f64, Duration, Duration) {
    let make = Arc::new(make);
    let end = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let (make, url) = (Arc::clone(&make), url.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut client = make();
            while Instant::now() < end {
                if fresh {
                    client = make();
                }
                let t = Instant::now();
                if let Ok(r) = client
                    .get(&url)
                    .header("x-endpoint-id", "bench")
                    .send()
                    .await
                {
                    let _ = r.bytes().await;
                    lat.push(t.elapsed());
                }
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap_or_default());
    }
    all.sort();
    let n = all.len().max(1);
    (
        all.len() as f64 / started.elapsed().as_secs_f64(),
        all[n / 2],
        all[(n * 99) / 100],
    )
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let secs: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let rounds: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(3)
        .max(1);
    let dir = tempfile_dir()?;
    let sluice_ca = sluice::tls::generate_ca(&dir.join("sluice-ca"))?;
    let up_ca = sluice::tls::generate_ca(&dir.join("up-ca"))?;
    let up = sluice::tls::Interceptor::new(
        sluice::tls::CertAuthority::load(&up_ca.cert, &up_ca.key)?,
        4,
        Duration::from_secs(3600),
    );
    let plain = TcpListener::bind("127.0.0.1:0").await?;
    let tls = TcpListener::bind("127.0.0.1:0").await?;
    let (plain_port, tls_port) = (plain.local_addr()?.port(), tls.local_addr()?.port());
    tokio::spawn(serve_plain(plain));
    tokio::spawn(serve_tls(tls, up.server_config("localhost")?));
    let proxy = TcpListener::bind("127.0.0.1:0").await?.local_addr()?;
    let admin = TcpListener::bind("127.0.0.1:0").await?.local_addr()?;
    let cfg = dir.join("sluice.toml");
    std::fs::write(
        &cfg,
        format!(
            "[proxy]\nlisten = \"{proxy}\"\nadmin_listen = \"{admin}\"\n[defaults]\nrate = 1e9\nburst = 1e9\n\
             [tls]\nintercept = true\nca_cert = \"{}\"\nca_key = \"{}\"\nupstream_roots = [\"{}\"]\n\
             [security]\nallow_private_destinations = true\n",
            sluice_ca.cert.display(),
            sluice_ca.key.display(),
            up_ca.cert.display()
        ),
    )?;
    let exe = std::env::current_exe()?
        .parent()
        .and_then(|p| p.parent())
        .map(|p| p.join("sluice"))
        .ok_or("no exe dir")?;
    let mut child = tokio::process::Command::new(exe)
        .args(["run", "--config"])
        .arg(&cfg)
        .env("RUST_LOG", "warn")
        .spawn()?;
    // TLS_BENCH_START_SECS: longer, for a sluice binary run under a profiler.
    let start_secs = std::env::var("TLS_BENCH_START_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let deadline = Instant::now() + Duration::from_secs(start_secs);
    while tokio::net::TcpStream::connect(proxy).await.is_err() {
        if Instant::now() > deadline {
            return Err("sluice did not start".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&sluice_ca.cert)?)?;
    let proxy_url = format!("http://{proxy}");
    let proxy1 = proxy_url.clone();
    let http_client = move || {
        reqwest::Client::builder()
            .proxy(reqwest::Proxy::http(&proxy1).unwrap())
            .build()
            .unwrap()
    };
    let (ca2, proxy2) = (ca.clone(), proxy_url.clone());
    let tls_client = move || {
        reqwest::Client::builder()
            .use_rustls_tls()
            .add_root_certificate(ca2.clone())
            .proxy(reqwest::Proxy::https(&proxy2).unwrap())
            .http1_only()
            .build()
            .unwrap()
    };
    // The same client offering `h2` first in ALPN, as Go's, curl's and browsers' do:
    // sluice's interception takes h2 then, and hyper serves the session.
    let (ca3, proxy3) = (ca.clone(), proxy_url);
    let h2_client = move || {
        reqwest::Client::builder()
            .use_rustls_tls()
            .add_root_certificate(ca3.clone())
            .proxy(reqwest::Proxy::https(&proxy3).unwrap())
            .build()
            .unwrap()
    };
    // Interleaved rounds, the order rotated each round: noise on a shared machine hits
    // every scenario alike; each scenario reports its median round.
    let names = [
        "plain HTTP via sluice (keep-alive)",
        "intercepted HTTPS (keep-alive tunnel)",
        "intercepted HTTPS, fresh tunnel + handshake",
        "intercepted HTTPS over h2 (keep-alive tunnel, ALPN h2)",
    ];
    let plain_url = format!("http://127.0.0.1:{plain_port}/");
    let tls_url = format!("https://localhost:{tls_port}/");
    let mut runs: [Vec<(f64, Duration, Duration)>; 4] = Default::default();
    let mut cpu: [Vec<f64>; 4] = Default::default();
    let mut load_cpu: [Vec<f64>; 4] = Default::default();
    let me = std::process::id();
    let pid = child.id().ok_or("sluice exited")?;
    let tick = clock_ticks_per_second();
    // TLS_BENCH_ONLY=N runs scenario N alone (0 plain, 1 kept-alive HTTPS, 2 fresh
    // tunnels, 3 kept-alive HTTPS over h2), to profile it; the table then shows that
    // row only.
    let only: Option<usize> = std::env::var("TLS_BENCH_ONLY")
        .ok()
        .and_then(|v| v.parse().ok());
    for round in 0..rounds {
        for k in 0..names.len() {
            let i = (k + round) % names.len();
            if only.is_some_and(|o| o != i) {
                continue;
            }
            let (before, load_before) = (cpu_ticks(pid)?, cpu_ticks(me)?);
            let r = match i {
                0 => load(http_client.clone(), plain_url.clone(), 32, secs, false).await,
                1 => load(tls_client.clone(), tls_url.clone(), 32, secs, false).await,
                2 => load(tls_client.clone(), tls_url.clone(), 8, secs, true).await,
                _ => load(h2_client.clone(), tls_url.clone(), 32, secs, false).await,
            };
            // sluice's own CPU (utime + stime) per request answered in this round.
            let used = (cpu_ticks(pid)? - before) as f64 / tick;
            let load_used = (cpu_ticks(me)? - load_before) as f64 / tick;
            let n = (r.0 * secs as f64).max(1.0);
            cpu[i].push(used * 1e6 / n);
            load_cpu[i].push(load_used * 1e6 / n);
            runs[i].push(r);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    // (scenario, its median round, sluice's and the load side's CPU µs per request)
    type Row<'a> = (&'a str, (f64, Duration, Duration), f64, f64);
    let rows: Vec<Row> = names
        .iter()
        .zip(runs)
        .zip(cpu.into_iter().zip(load_cpu))
        .filter(|((_, r), _)| !r.is_empty())
        .map(|((name, mut r), (c, l))| {
            r.sort_by(|a, b| a.0.total_cmp(&b.0));
            (*name, r[r.len() / 2], median(c), median(l))
        })
        .collect();
    let (base, base_cpu) = (rows[0].1.0, rows[0].2);
    println!(
        "| scenario | req/s | p50 | p99 | sluice CPU µs/req | load + upstream CPU µs/req | req/s vs plain HTTP | CPU/req vs plain |\n|---|---|---|---|---|---|---|---|"
    );
    for (name, (rps, p50, p99), cpu, load_cpu) in &rows {
        println!(
            "| {name} | {rps:.0} | {:.2}ms | {:.2}ms | {cpu:.1} | {load_cpu:.1} | {:.2} | {:.2} |",
            p50.as_secs_f64() * 1e3,
            p99.as_secs_f64() * 1e3,
            rps / base,
            cpu / base_cpu
        );
    }
    // The box is saturated (sluice, the clients and the upstreams share its cores), so
    // req/s follows the CPU the whole box spends per request: split what interception
    // adds between sluice and the load side, which pays the sender's and the upstream's
    // own TLS ends on the same cores.
    if let [(_, _, cpu0, load0), (_, _, cpu1, load1), ..] = rows[..] {
        if only.is_none() {
            let plain = cpu0 + load0;
            let cap = plain / (plain + (load1 - load0));
            let budget = plain / 0.95 - plain - (load1 - load0);
            println!(
                "\nbox CPU per request: plain {plain:.1} µs, kept-alive tunnel {:.1} µs \
                 (sluice {:+.1}, load side {:+.1}); with interception free in sluice, the \
                 load side's extra alone would put the tunnel at {cap:.3} of plain; 0.95 \
                 leaves sluice {budget:.1} µs per request for its TLS work",
                cpu1 + load1,
                cpu1 - cpu0,
                load1 - load0
            );
        }
    }
    let _ = child.kill().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// utime + stime of process `pid`, in clock ticks (`/proc/PID/stat`).
fn cpu_ticks(pid: u32) -> Result<u64, BoxError> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces), 1-based from the state.
    let rest = stat.rsplit_once(')').ok_or("bad /proc stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Ok(f[11].parse::<u64>()? + f[12].parse::<u64>()?)
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`; 100 when it cannot say).
fn clock_ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

fn tempfile_dir() -> std::io::Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!("sluice-tls-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
