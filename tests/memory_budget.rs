//! The memory ceiling (`proxy.max_memory`): a sluice child process with a 64 MiB
//! ceiling under each memory attack — many unfinished request heads, many idle
//! tunnels, many waiting requests, receivers that stall huge response heads — stays
//! under the ceiling (its VmRSS, sampled every 10 ms), and `/healthz` answers
//! throughout. Each attack alone would take the process well past it (the counts are
//! chosen so; run with `max_memory` far above them to see the figures).

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use common::process::LoggedChild;

/// The ceiling the child runs under.
const CEILING: u64 = 64 << 20;
/// Longest the child may take to start.
const START: Duration = Duration::from_secs(30);
/// Connections opened at once by an attack.
const AT_ONCE: usize = 100;

struct Child {
    run: LoggedChild,
    proxy: SocketAddr,
    admin: SocketAddr,
    _dir: tempfile::TempDir,
}

fn start(extra: &str) -> Child {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sluice.toml");
    std::fs::write(
        &config,
        format!(
            "[proxy]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
             max_memory = {CEILING}\n\
             [security]\nallow_private_destinations = true\n\
             [log]\ndecisions = false\n{extra}"
        ),
    )
    .unwrap();
    let mut run = LoggedChild::spawn(
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["run", "--config"])
            .arg(&config),
    );
    run.wait_log("sluice listening", START);
    let log = run.log();
    let line = log
        .lines()
        .find(|l| l.contains("sluice listening"))
        .unwrap()
        .to_owned();
    let addr = |key: &str| -> SocketAddr {
        let at = line.find(&format!("{key}=")).unwrap() + key.len() + 1;
        line[at..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    Child {
        proxy: addr("proxy_addr"),
        admin: addr("admin_addr"),
        run,
        _dir: dir,
    }
}

/// A process's resident memory (bytes), from `/proc/PID/status`.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Watches the child while an attack runs: the most resident memory seen, and
/// `/healthz` asked every 200 ms (each must answer 200 within 2 s).
struct Watch {
    stop: Arc<AtomicBool>,
    most: Arc<AtomicU64>,
    failures: Arc<AtomicU64>,
    probes: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Watch {
    fn start(pid: u32, admin: SocketAddr) -> Watch {
        let stop = Arc::new(AtomicBool::new(false));
        let most = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(AtomicU64::new(0));
        let probes = Arc::new(AtomicU64::new(0));
        let sampler = {
            let (stop, most) = (Arc::clone(&stop), Arc::clone(&most));
            tokio::task::spawn_blocking(move || {
                while !stop.load(Ordering::Relaxed) {
                    most.fetch_max(rss(pid), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        };
        let prober = {
            let (stop, failures, probes) = (
                Arc::clone(&stop),
                Arc::clone(&failures),
                Arc::clone(&probes),
            );
            tokio::spawn(async move {
                let client = reqwest::Client::builder()
                    .timeout(Duration::from_secs(2))
                    .build()
                    .unwrap();
                while !stop.load(Ordering::Relaxed) {
                    let r = client.get(format!("http://{admin}/healthz")).send().await;
                    probes.fetch_add(1, Ordering::Relaxed);
                    if !r.is_ok_and(|r| r.status() == 200) {
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
        };
        Watch {
            stop,
            most,
            failures,
            probes,
            tasks: vec![sampler, prober],
        }
    }

    /// Stops watching; asserts the ceiling held and every probe was answered.
    async fn check(self, attack: &str, child: &Child) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        let most = self.most.load(Ordering::Relaxed);
        let (failures, probes) = (
            self.failures.load(Ordering::Relaxed),
            self.probes.load(Ordering::Relaxed),
        );
        eprintln!(
            "{attack}: most resident memory {:.1} MiB (ceiling {} MiB); /healthz {failures} \
             of {probes} probes failed",
            most as f64 / (1 << 20) as f64,
            CEILING >> 20
        );
        assert!(
            most < CEILING,
            "{attack}: resident memory reached {most} bytes, over the {CEILING} ceiling\n{}",
            child.run.log()
        );
        assert!(probes > 0 && failures == 0, "{attack}: /healthz failed");
    }
}

/// Opens `n` connections to `addr` (at most [`AT_ONCE`] being set up at a time), each
/// set up by `attack`; keeps those it could set up open and returns them.
async fn open_many<F, Fut>(addr: SocketAddr, n: usize, attack: F) -> Vec<TcpStream>
where
    F: Fn(TcpStream) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Option<TcpStream>> + Send,
{
    let gate = Arc::new(Semaphore::new(AT_ONCE));
    let mut tasks = Vec::new();
    for _ in 0..n {
        let permit = Arc::clone(&gate).acquire_owned().await.unwrap();
        let attack = attack.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let s = tokio::time::timeout(Duration::from_millis(500), TcpStream::connect(addr))
                .await
                .ok()?
                .ok()?;
            tokio::time::timeout(Duration::from_secs(3), attack(s))
                .await
                .ok()
                .flatten()
        }));
    }
    let mut open = Vec::new();
    for t in tasks {
        if let Ok(Some(s)) = t.await {
            open.push(s);
        }
    }
    open
}

impl Watch {
    /// Waits (20 s at most) until resident memory is steady: no new high for a second.
    async fn steady(&self) {
        let (mut last, mut since) = (0, tokio::time::Instant::now());
        common::wait_for(
            "resident memory to be steady",
            Duration::from_secs(20),
            || {
                let most = self.most.load(Ordering::Relaxed);
                if most > last {
                    (last, since) = (most, tokio::time::Instant::now());
                }
                let steady = since.elapsed() >= Duration::from_secs(1);
                async move { steady }
            },
        )
        .await;
    }
}

/// A TCP server that accepts and holds every connection, saying nothing.
async fn silent_server() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    (addr, task)
}

/// A receiver that answers every request with a response head of ~400 KB it never
/// finishes (headers, no blank line), then holds the connection.
async fn stalling_receiver() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let mut head = b"HTTP/1.1 200 OK\r\n".to_vec();
                for i in 0..96 {
                    head.extend_from_slice(
                        format!("x-big-{i}: {}\r\n", "v".repeat(4000)).as_bytes(),
                    );
                }
                let _ = s.write_all(&head).await;
                // Held open, the head unfinished, until the test ends.
                let _ = s.read(&mut buf).await;
                tokio::time::sleep(Duration::from_secs(600)).await;
            });
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_memory_attack_stays_under_the_ceiling_and_healthz_answers() {
    // Unfinished request heads: 2,000 connections, each 60 KiB into a head.
    {
        let child = start("");
        let watch = Watch::start(child.run.guard.id(), child.admin);
        let open = open_many(child.proxy, 2000, |mut s: TcpStream| async move {
            s.write_all(b"GET http://127.0.0.1:9/ HTTP/1.1\r\nHost: 127.0.0.1:9\r\nX-Pad: ")
                .await
                .ok()?;
            for _ in 0..4 {
                s.write_all(&[b'a'; 15 * 1024]).await.ok()?;
            }
            Some(s)
        })
        .await;
        eprintln!("unfinished heads: {} connections set up", open.len());
        watch.steady().await;
        watch.check("unfinished heads", &child).await;
    }
    // Idle tunnels: 2,000 CONNECTs to a receiver that says nothing.
    {
        let (silent, _server) = silent_server().await;
        let child = start("[defaults]\nrate = 100000.0\nburst = 100000.0\n");
        let watch = Watch::start(child.run.guard.id(), child.admin);
        let open = open_many(child.proxy, 2000, move |mut s: TcpStream| async move {
            let req = format!("CONNECT {silent} HTTP/1.1\r\nHost: {silent}\r\n\r\n");
            s.write_all(req.as_bytes()).await.ok()?;
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).await.ok()?;
            String::from_utf8_lossy(&buf[..n])
                .starts_with("HTTP/1.1 200")
                .then_some(s)
        })
        .await;
        eprintln!("idle tunnels: {} tunnels set up", open.len());
        watch.steady().await;
        watch.check("idle tunnels", &child).await;
    }
    // Waiting requests: 5,000 requests held for their tokens (20/s, max_wait 300 s).
    {
        let upstream = common::Upstream::start().await;
        let child =
            start("[[endpoints]]\nid = \"slow\"\nrate = 20.0\nburst = 1.0\nmax_wait = \"300s\"\n");
        let watch = Watch::start(child.run.guard.id(), child.admin);
        let target = upstream.addr;
        let open = open_many(child.proxy, 5000, move |mut s: TcpStream| async move {
            let req = format!(
                "GET http://{target}/ HTTP/1.1\r\nHost: {target}\r\nX-Endpoint-Id: slow\r\n\r\n"
            );
            s.write_all(req.as_bytes()).await.ok()?;
            Some(s)
        })
        .await;
        eprintln!("waiters: {} requests sent", open.len());
        watch.steady().await;
        watch.check("waiters", &child).await;
    }
    // Receivers that stall a ~400 KB response head: 400 requests.
    {
        let (receiver, _server) = stalling_receiver().await;
        let child = start("[defaults]\nrate = 100000.0\nburst = 100000.0\n");
        let watch = Watch::start(child.run.guard.id(), child.admin);
        let open = open_many(child.proxy, 400, move |mut s: TcpStream| async move {
            let req = format!("GET http://{receiver}/ HTTP/1.1\r\nHost: {receiver}\r\n\r\n");
            s.write_all(req.as_bytes()).await.ok()?;
            Some(s)
        })
        .await;
        eprintln!("stalled response heads: {} requests sent", open.len());
        watch.steady().await;
        watch.check("stalled response heads", &child).await;
    }
}
