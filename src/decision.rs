//! The decision log: one structured line per request (target `sluice::decision`), as
//! Envoy's access log or Squid's `access.log` — who sent what where, what sluice
//! decided, how long it waited and what the upstream answered.
//!
//! Forwarded requests are logged when `[log] decisions = true`, sampled by
//! `[log] sample`; refusals and failures are always logged (at `warn` for failures that
//! are not the sender's doing), with the endpoint as a field.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::LogConfig;
use crate::error::ProxyError;

pub use crate::traces::Trace;

/// Deterministic sampling: of every run of requests, exactly `sample` of them are
/// logged, spread evenly (no random numbers on the hot path).
#[derive(Debug, Default)]
pub struct Sampler {
    seen: AtomicU64,
}

impl Sampler {
    /// Whether this request is one of the sampled.
    pub fn take(&self, sample: f64) -> bool {
        if sample >= 1.0 {
            return true;
        }
        if sample <= 0.0 {
            return false;
        }
        let n = self.seen.fetch_add(1, Ordering::Relaxed) as f64;
        ((n + 1.0) * sample).floor() > (n * sample).floor()
    }
}

/// The `endpoint` of a line whose request was refused before it resolved to one (bad
/// proxy credentials, a malformed endpoint header, `require_endpoint`): a space keeps it
/// apart from every endpoint ID (visible ASCII).
pub const UNRESOLVED: &str = "(none resolved)";

/// The endpoint a refusal's line names: the resolved one; else the ID the request
/// named when that is the refusal (`unknown_endpoint` under `unknown = "reject"`);
/// else [`UNRESOLVED`].
fn endpoint_of<'a>(t: &'a Trace, e: &'a ProxyError) -> &'a str {
    match (&t.endpoint, e) {
        (Some(id), _) => id,
        (None, ProxyError::UnknownEndpoint(id)) => id,
        (None, _) => UNRESOLVED,
    }
}

/// One forwarded request's line, with `$message` (a literal, as tracing wants).
macro_rules! request_line {
    ($peer:expr, $method:expr, $t:expr, $message:literal) => {{
        let t: &Trace = $t;
        tracing::info!(
            target: "sluice::decision",
            endpoint = t.endpoint.as_deref().unwrap_or(UNRESOLVED),
            user = t.user.as_deref().unwrap_or("-"),
            peer = %$peer,
            method = $method,
            destination = t.destination.as_ref().map_or("-", |a| a.as_str()),
            outcome = t.outcome,
            waited_ms = t.waited.as_millis() as u64,
            status = t.status.unwrap_or(0),
            upstream_ms = t.upstream.map_or(0, |d| d.as_millis() as u64),
            retried = t.retried,
            $message
        );
    }};
}

/// Logs a forwarded request (subject to the switch and sampling) and ends its spans.
pub fn forwarded(cfg: &LogConfig, sampler: &Sampler, peer: SocketAddr, method: &str, t: &Trace) {
    crate::traces::finish(t, method, t.outcome);
    if !cfg.decisions || !sampler.take(cfg.sample) {
        return;
    }
    request_line!(peer, method, t, "request");
}

/// Logs a request that left for the receiver and whose sender left before the answer
/// (an HTTP/2 stream reset, a closed connection): it reached the receiver, so it is in
/// the log like any forwarded request, with no status (always logged: it is rare, and
/// an operator counting arrivals needs it).
pub fn sender_left(peer: SocketAddr, method: &str, t: &Trace) {
    crate::traces::finish(t, method, t.outcome);
    request_line!(
        peer,
        method,
        t,
        "request; the sender left before the answer"
    );
}

/// Logs a refusal or failure (always) and ends its spans.
pub fn refused(peer: SocketAddr, method: &str, t: &Trace, e: &ProxyError) {
    crate::traces::finish(t, method, e.reason());
    let endpoint = endpoint_of(t, e);
    let user = t.user.as_deref().unwrap_or("-");
    let destination = t.destination.as_ref().map_or("-", |a| a.as_str());
    let waited_ms = t.waited.as_millis() as u64;
    match e {
        ProxyError::Upstream(_)
        | ProxyError::UpstreamTimeout(_)
        | ProxyError::StoreUnavailable { .. } => tracing::warn!(
            target: "sluice::decision",
            endpoint, user, %peer, method, destination, outcome = e.reason(), waited_ms,
            error = e.to_string(), "request failed"
        ),
        _ => tracing::info!(
            target: "sluice::decision",
            endpoint, user, %peer, method, destination, outcome = e.reason(), waited_ms,
            error = e.to_string(), "request refused"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_takes_exactly_its_share() {
        for sample in [0.0, 0.01, 0.25, 0.5, 1.0] {
            let s = Sampler::default();
            let taken = (0..1000).filter(|_| s.take(sample)).count();
            assert_eq!(taken, (1000.0 * sample) as usize, "sample {sample}");
        }
    }
}
