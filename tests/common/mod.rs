//! Shared test support, one module for every test file (`mod common;`): a real upstream
//! HTTP server on 127.0.0.1:0 that records arrival times, a sluice started through the
//! library, property checks, waiting for a condition with a deadline ([`wait_for`]),
//! private Redis servers ([`redis`]), HTTPS upstreams ([`tls`]) and child processes that
//! die with the test ([`process`]).
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

pub mod process;
pub mod redis;
pub mod tls;

/// Polls the async condition `ok` every 20 ms until it holds; panics after `deadline`,
/// naming `what`. The way to wait for a state change (never a fixed sleep).
pub async fn wait_for<F, Fut>(what: &str, deadline: Duration, mut ok: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + deadline;
    loop {
        if ok().await {
            return;
        }
        assert!(
            Instant::now() < end,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The `/readyz` body of the replica whose admin listener is `admin`.
pub async fn readyz(admin: SocketAddr) -> serde_json::Value {
    let url = format!("http://{admin}/readyz");
    reqwest::get(&url).await.unwrap().json().await.unwrap()
}

/// Waits (10 s at most) until every replica's `/readyz` counts `n` replicas.
pub async fn until_all_count(rs: &[sluice::app::Running], n: u64) {
    let what = format!("every replica to count {n}");
    wait_for(&what, Duration::from_secs(10), || async {
        for r in rs {
            if readyz(r.admin_addr).await["replicas"].as_u64() != Some(n) {
                return false;
            }
        }
        true
    })
    .await;
}

/// The admin listener's `/metrics` text.
pub async fn metrics(admin: SocketAddr) -> String {
    reqwest::get(format!("http://{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Waits (at most 5 s) until `/metrics` contains `needle`.
pub async fn wait_for_metric(admin: SocketAddr, needle: &str) {
    wait_for(
        &format!("{needle:?} in /metrics"),
        Duration::from_secs(5),
        || async { metrics(admin).await.contains(needle) },
    )
    .await;
}

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub at: Instant,
    /// Which upstream connection carried it (numbered from 0 in accept order).
    pub conn: usize,
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// What the upstream answers.
pub type Responder = Arc<dyn Fn(&Arrival) -> Reply + Send + Sync>;

/// A canned reply (with an optional delay before the head).
#[derive(Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    pub delay: Duration,
}

impl Reply {
    pub fn ok() -> Reply {
        Reply {
            status: 200,
            headers: vec![],
            body: "ok".into(),
            delay: Duration::ZERO,
        }
    }
    pub fn status(status: u16) -> Reply {
        Reply {
            status,
            ..Reply::ok()
        }
    }
    pub fn header(mut self, k: &str, v: &str) -> Reply {
        self.headers.push((k.into(), v.into()));
        self
    }
    pub fn delay(mut self, d: Duration) -> Reply {
        self.delay = d;
        self
    }
}

/// A real HTTP upstream that records every arrival.
pub struct Upstream {
    pub addr: SocketAddr,
    pub arrivals: Arc<Mutex<Vec<Arrival>>>,
    responder: Arc<Mutex<Responder>>,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    pub async fn start() -> Upstream {
        Upstream::with(Arc::new(|_| Reply::ok())).await
    }

    pub async fn with(responder: Responder) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let responder = Arc::new(Mutex::new(responder));
        let (a, r) = (Arc::clone(&arrivals), Arc::clone(&responder));
        let task = tokio::spawn(async move {
            for conn in 0.. {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (a, r) = (Arc::clone(&a), Arc::clone(&r));
                tokio::spawn(async move {
                    let svc =
                        service_fn(move |req| serve(req, conn, Arc::clone(&a), Arc::clone(&r)));
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Upstream {
            addr,
            arrivals,
            responder,
            task,
        }
    }

    /// Serves a TLS upstream instead (for interception tests) on an existing listener.
    pub fn set_responder(&self, responder: Responder) {
        *self.responder.lock().unwrap() = responder;
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn arrivals(&self) -> Vec<Arrival> {
        self.arrivals.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.arrivals.lock().unwrap().len()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn serve(
    req: Request<Incoming>,
    conn: usize,
    arrivals: Arc<Mutex<Vec<Arrival>>>,
    responder: Arc<Mutex<Responder>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let at = Instant::now();
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let arrival = Arrival {
        at,
        conn,
        method: parts.method.to_string(),
        path: parts
            .uri
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default(),
        headers: parts.headers,
        body,
    };
    let reply = {
        let f = responder.lock().unwrap().clone();
        f(&arrival)
    };
    arrivals.lock().unwrap().push(arrival);
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    let mut resp = Response::new(Full::new(Bytes::from(reply.body)));
    *resp.status_mut() = StatusCode::from_u16(reply.status).unwrap();
    for (k, v) in reply.headers {
        resp.headers_mut().insert(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    Ok(resp)
}

/// The config used by tests: `extra` plus ephemeral ports and loopback upstreams allowed.
pub fn config(extra: &str) -> sluice::config::Config {
    let mut c = sluice::config::Config::parse(extra)
        .unwrap_or_else(|e| panic!("test config invalid: {e:?}\n{extra}"));
    c.proxy.listen = "127.0.0.1:0".parse().unwrap();
    c.proxy.admin_listen = "127.0.0.1:0".parse().unwrap();
    c.proxy.shutdown_grace = Duration::from_secs(5);
    c.security.allow_private_destinations = true;
    c
}

pub async fn sluice(extra: &str) -> sluice::app::Running {
    sluice::app::start(config(extra))
        .await
        .expect("sluice starts")
}

/// A reqwest client that uses sluice as its HTTP proxy.
pub fn client(proxy: SocketAddr) -> reqwest::Client {
    reqwest::Client::builder()
        .proxy(reqwest::Proxy::http(format!("http://{proxy}")).unwrap())
        .pool_max_idle_per_host(64)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// Asserts the overdraw bound: in every window of each length, arrivals ≤ rate·W + burst + 1
/// (the +1: one token of delivery jitter between sluice's send and the upstream's accept;
/// a saturated bucket's arrivals sit at rate·W + burst). Prints the most seen against it.
pub fn assert_no_overdraw(times: &[Instant], rate: f64, burst: f64) {
    let mut t: Vec<Instant> = times.to_vec();
    t.sort();
    for w in [0.25, 0.5, 1.0, 2.0] {
        let bound = rate * w + burst + 1.0;
        let (most, start) = most_in_window(&t, w);
        eprintln!(
            "overdraw check: at most {most} in {w} s (bound {bound}: rate {rate}, burst {burst})"
        );
        assert!(
            most as f64 <= bound,
            "{most} arrivals in a {w}s window (bound {bound}: rate {rate}, burst {burst}); \
             it starts at arrival {start}, {:?} after the first; arrivals from the first, \
             by 10 ms: {:?}",
            t[start] - t[0],
            by_10ms(&t)
        );
    }
}

/// Asserts the overdraw bound with no token of slack, for tests with few arrivals far
/// apart: every run of arrivals, from the i-th to the j-th in time, numbers at most
/// `rate·(t_j − t_i + jitter) + burst`, where `jitter` (seconds) is what delivery
/// between sluice's send and the upstream's accept may add to one gap.
pub fn assert_within_bound(times: &[Instant], rate: f64, burst: f64, jitter: f64) {
    let mut t: Vec<Instant> = times.to_vec();
    t.sort();
    for i in 0..t.len() {
        for j in i + 1..t.len() {
            let w = (t[j] - t[i]).as_secs_f64();
            let bound = rate * (w + jitter) + burst;
            assert!(
                (j - i + 1) as f64 <= bound,
                "{} arrivals within {w:.3} s (bound {bound:.2}: rate {rate}, burst {burst}, \
                 {jitter} s of jitter); from the first: {:?}",
                j - i + 1,
                t.iter().map(|x| *x - t[0]).collect::<Vec<_>>()
            );
        }
    }
}

/// The most arrivals in any window of `w` seconds of the sorted `t`, and the index of
/// the first arrival of that window.
fn most_in_window(t: &[Instant], w: f64) -> (usize, usize) {
    let win = Duration::from_secs_f64(w);
    let (mut j, mut most, mut start) = (0, 0, 0);
    for i in 0..t.len() {
        while j < t.len() && t[j] < t[i] + win {
            j += 1;
        }
        if j - i > most {
            (most, start) = (j - i, i);
        }
    }
    (most, start)
}

/// How many of the sorted `t` arrived in each 10 ms from the first, for the first 60.
fn by_10ms(t: &[Instant]) -> Vec<usize> {
    let mut counts = vec![0; 60];
    for &at in t {
        let slot = ((at - t[0]).as_millis() / 10) as usize;
        if let Some(c) = counts.get_mut(slot) {
            *c += 1;
        }
    }
    counts
}

/// Sustained rate after the initial burst: (n - burst) / (last - first).
pub fn sustained_rate(times: &[Instant], burst: usize) -> f64 {
    let mut t: Vec<Instant> = times.to_vec();
    t.sort();
    let n = t.len();
    assert!(n > burst + 1, "too few arrivals: {n}");
    let span = (t[n - 1] - t[0]).as_secs_f64();
    (n - burst) as f64 / span
}

/// What `/endpoints` reports for `id` (`None` while sluice holds no bucket for it).
pub async fn endpoint(admin: SocketAddr, id: &str) -> Option<serde_json::Value> {
    let all: serde_json::Value = reqwest::get(format!("http://{admin}/endpoints"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    all.as_array()
        .unwrap()
        .iter()
        .find(|e| e["id"] == id)
        .cloned()
}

/// The token balance `/endpoints` reports for `id` (`None` while sluice holds no bucket).
pub async fn tokens(admin: SocketAddr, id: &str) -> Option<f64> {
    endpoint(admin, id).await.and_then(|e| e["tokens"].as_f64())
}

/// Waits until `id`'s balance is below `bound`. Refill only ever raises a balance, so a
/// balance below `burst - n + 1` proves at least `n` tokens are taken or reserved: the way
/// to know requests are waiting inside sluice without sleeping.
pub async fn wait_for_tokens_below(admin: SocketAddr, id: &str, bound: f64) {
    wait_for(
        &format!("{id}'s balance below {bound}"),
        Duration::from_secs(5),
        || async { tokens(admin, id).await.is_some_and(|t| t < bound) },
    )
    .await;
}

/// Sends raw bytes to `addr` and returns one whole response: the head, then as many body
/// bytes as its `Content-Length` says (or up to the close). Reading to the end of the
/// connection instead would wait for the keep-alive timeout on every answer.
pub async fn raw_exchange(addr: SocketAddr, bytes: &[u8]) -> String {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The server may answer and close before reading everything (e.g. a 431).
    let _ = s.write_all(bytes).await;
    read_response(&mut s).await
}

/// Reads one whole response from `s` (the head, then its `Content-Length` of body, or up
/// to the close), within 10 s; the connection stays usable for the next request.
pub async fn read_response(s: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let complete = |out: &[u8]| {
        let Some(end) = out.windows(4).position(|w| w == b"\r\n\r\n") else {
            return false;
        };
        let head = String::from_utf8_lossy(&out[..end]).to_ascii_lowercase();
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok());
        length.is_some_and(|n| out.len() >= end + 4 + n)
    };
    let read = async {
        while !complete(&out) {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("a whole response within 10 s");
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends `request` to `addr` and returns what comes back up to the end of the head (or
/// the close), within 10 s.
pub async fn raw_head(addr: SocketAddr, request: &str) -> String {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The server may answer and close before reading everything (e.g. a 431).
    let _ = s.write_all(request.as_bytes()).await;
    read_head(&mut s).await
}

/// Reads `s` byte by byte up to the end of a head (or the close), within 10 s, so
/// nothing after the head is consumed.
pub async fn read_head<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> String {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    let reading = async {
        while !out.ends_with(b"\r\n\r\n") {
            match s.read(&mut b).await {
                Ok(0) | Err(_) => break,
                Ok(_) => out.push(b[0]),
            }
        }
    };
    if tokio::time::timeout(Duration::from_secs(10), reading)
        .await
        .is_err()
    {
        panic!(
            "no head within 10 s; got {:?}",
            String::from_utf8_lossy(&out)
        );
    }
    String::from_utf8_lossy(&out).into_owned()
}
