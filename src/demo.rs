//! `sluice demo-receiver`: a tiny webhook receiver for the offline walkthrough and the
//! client examples, so sluice can be tried on a machine with no network.
//!
//! It answers by path and prints one line per request that arrives, with a wall-clock
//! timestamp, the time since it started and the gap since the previous request — the
//! receiver's view of pacing:
//!
//! | path | answer |
//! |---|---|
//! | `/429?retry_after=N` | `429 Too Many Requests`, with `Retry-After: N` when given |
//! | `/slow?ms=N` | `200` after N milliseconds (at most 60 s) |
//! | `/status/NNN?retry_after=N` | status NNN (100–599 refused below 200), optional `Retry-After` |
//! | anything else | `200` |

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// The longest `/slow?ms=` is honoured.
const MAX_SLOW: Duration = Duration::from_secs(60);

/// What the receiver answers to one request, decided from its path and query alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Status code to answer.
    pub status: StatusCode,
    /// `Retry-After` seconds to send, if any.
    pub retry_after: Option<u64>,
    /// Delay before the response head.
    pub delay: Duration,
}

/// Decides the answer for a request target such as `/429?retry_after=2`.
pub fn plan(path: &str, query: Option<&str>) -> Plan {
    let param = |name: &str| -> Option<u64> {
        query?
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == name)
            .and_then(|(_, v)| v.parse().ok())
    };
    let ok = Plan {
        status: StatusCode::OK,
        retry_after: None,
        delay: Duration::ZERO,
    };
    let path = path.trim_end_matches('/');
    if path == "/429" {
        return Plan {
            status: StatusCode::TOO_MANY_REQUESTS,
            retry_after: param("retry_after"),
            ..ok
        };
    }
    if path == "/slow" {
        let ms = param("ms").unwrap_or(1000);
        return Plan {
            delay: Duration::from_millis(ms).min(MAX_SLOW),
            ..ok
        };
    }
    if let Some(code) = path.strip_prefix("/status/") {
        if let Some(status) = code
            .parse::<u16>()
            .ok()
            .filter(|c| *c >= 200)
            .and_then(|c| StatusCode::from_u16(c).ok())
        {
            return Plan {
                status,
                retry_after: param("retry_after"),
                ..ok
            };
        }
    }
    ok
}

/// One request as the receiver saw it; its `Display` is the printed line.
#[derive(Debug, Clone)]
pub struct Received {
    /// 1-based arrival number.
    pub seq: u64,
    /// Wall-clock arrival time.
    pub wall: SystemTime,
    /// Time since the receiver started.
    pub since_start: Duration,
    /// Time since the previous arrival (zero for the first).
    pub gap: Duration,
    /// Request method.
    pub method: String,
    /// Path and query.
    pub target: String,
    /// The `User-Agent`, if any.
    pub user_agent: Option<String>,
    /// The status answered.
    pub status: u16,
    /// The `Retry-After` answered, if any.
    pub retry_after: Option<u64>,
}

impl std::fmt::Display for Received {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} #{} t={:.3}s +{:.3}s {} {} -> {}",
            utc_time_of_day(self.wall),
            self.seq,
            self.since_start.as_secs_f64(),
            self.gap.as_secs_f64(),
            self.method,
            self.target,
            self.status,
        )?;
        if let Some(s) = self.retry_after {
            write!(f, " Retry-After: {s}")?;
        }
        if let Some(ua) = &self.user_agent {
            write!(f, " ({ua})")?;
        }
        Ok(())
    }
}

/// `HH:MM:SS.mmmZ` of a wall-clock time, in UTC.
fn utc_time_of_day(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let s = d.as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:03}Z",
        s / 3600,
        s % 3600 / 60,
        s % 60,
        d.subsec_millis()
    )
}

/// Arrival bookkeeping shared by every connection.
struct Counter {
    started: Instant,
    last: Option<Instant>,
    seq: u64,
}

/// Serves the demo receiver on `listener` until `shutdown` completes, calling `report`
/// once per request as it arrives (before any `/slow` delay).
pub async fn serve<F, R>(listener: TcpListener, shutdown: F, report: R)
where
    F: Future<Output = ()>,
    R: Fn(&Received) + Send + Sync + 'static,
{
    let counter = Arc::new(Mutex::new(Counter {
        started: Instant::now(),
        last: None,
        seq: 0,
    }));
    let report = Arc::new(report);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            // Stop accepting; connections already open finish on their own.
            () = &mut shutdown => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // A transient accept error (e.g. out of descriptors) must not end the demo.
                Err(_) => continue,
            },
        };
        let (counter, report) = (Arc::clone(&counter), Arc::clone(&report));
        tokio::spawn(async move {
            let svc = service_fn(move |req| answer(req, Arc::clone(&counter), Arc::clone(&report)));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

async fn answer<R: Fn(&Received)>(
    req: Request<Incoming>,
    counter: Arc<Mutex<Counter>>,
    report: Arc<R>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let now = Instant::now();
    let p = plan(req.uri().path(), req.uri().query());
    let (seq, since_start, gap) = match counter.lock() {
        Ok(mut c) => {
            c.seq += 1;
            let gap = c
                .last
                .map_or(Duration::ZERO, |l| now.saturating_duration_since(l));
            c.last = Some(now);
            (c.seq, now.saturating_duration_since(c.started), gap)
        }
        Err(_) => (0, Duration::ZERO, Duration::ZERO),
    };
    let received = Received {
        seq,
        wall: SystemTime::now(),
        since_start,
        gap,
        method: req.method().to_string(),
        target: req
            .uri()
            .path_and_query()
            .map_or_else(|| "/".to_owned(), |pq| pq.to_string()),
        user_agent: req
            .headers()
            .get(http::header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        status: p.status.as_u16(),
        retry_after: p.retry_after,
    };
    report(&received);
    if !p.delay.is_zero() {
        tokio::time::sleep(p.delay).await;
    }
    let body = format!(
        "demo receiver: #{seq} {} {} -> {}\n",
        received.method, received.target, received.status
    );
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = p.status;
    if let Some(s) = p.retry_after {
        resp.headers_mut()
            .insert(http::header::RETRY_AFTER, http::HeaderValue::from(s));
    }
    Ok(resp)
}

/// Binds `addr` (port 0 picks a free port) and returns the listener and its address.
pub async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_choose_the_answer() {
        assert_eq!(plan("/", None).status, StatusCode::OK);
        assert_eq!(plan("/hooks/order", Some("x=1")).status, StatusCode::OK);
        let p = plan("/429", Some("retry_after=2"));
        assert_eq!(
            (p.status, p.retry_after),
            (StatusCode::TOO_MANY_REQUESTS, Some(2))
        );
        assert_eq!(plan("/429", None).retry_after, None);
        assert_eq!(
            plan("/slow", Some("ms=500")).delay,
            Duration::from_millis(500)
        );
        assert_eq!(plan("/slow", Some("ms=999999999")).delay, MAX_SLOW);
        let p = plan("/status/503", Some("retry_after=4"));
        assert_eq!(
            (p.status, p.retry_after),
            (StatusCode::SERVICE_UNAVAILABLE, Some(4))
        );
        assert_eq!(plan("/status/101", None).status, StatusCode::OK);
        assert_eq!(plan("/status/abc", None).status, StatusCode::OK);
    }

    #[test]
    fn the_line_names_time_sequence_and_answer() {
        let r = Received {
            seq: 3,
            wall: UNIX_EPOCH + Duration::from_millis(3_723_004),
            since_start: Duration::from_millis(1234),
            gap: Duration::from_millis(201),
            method: "POST".into(),
            target: "/429?retry_after=2".into(),
            user_agent: Some("curl/8".into()),
            status: 429,
            retry_after: Some(2),
        };
        assert_eq!(
            r.to_string(),
            "01:02:03.004Z #3 t=1.234s +0.201s POST /429?retry_after=2 -> 429 Retry-After: 2 (curl/8)"
        );
    }
}
