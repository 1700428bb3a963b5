//! Traces: one OpenTelemetry span tree per forwarded HTTP request, exported over
//! OTLP/HTTP (protobuf) when `[traces] otlp_endpoint` is set. Off, nothing is built:
//! a request's [`Trace`] carries no spans and each hook returns at its first branch.
//!
//! The tree of one request:
//! - `request` (server span): from the request's admission on to the end of sluice's
//!   part of it; a child of the sender's `traceparent` when that is valid (its trace ID
//!   is then the sender's), else the root of a new trace;
//!   - `slot wait` (endpoints with `max_in_flight`): the wait for an in-flight slot;
//!   - `admission wait`: the wait for the token, after the slot wait (without
//!     `max_in_flight`, the figure `sluice_wait_seconds` records);
//!   - `upstream` (client span): from sending to the answer's head (or the failure).
//!     The receiver gets a `traceparent` naming this span as its parent; the
//!     sender's `traceparent` is not passed on (its `tracestate` is, unchanged).
//!
//! Spans go to a batch processor on a thread of its own; its exports are sent by
//! sluice's hyper client ([`Exporting`]) on the runtime sluice started on, so no other
//! HTTP client is built in. A collector that is down costs dropped spans (the batch
//! queue is bounded), never a request's time.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use http_body_util::{BodyExt, Full};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider,
};

use crate::config::TracesConfig;

/// What one request went through, filled in along its path.
#[derive(Debug, Default)]
pub struct Trace {
    /// The authenticated user.
    pub user: Option<std::sync::Arc<str>>,
    /// The sender it is counted under (`sluice_sender_requests_total`), once known.
    pub sender: Option<crate::metrics::SenderLabel>,
    /// Its spans, when traces are exported (`[traces]`): ended with its decision line.
    pub spans: Option<Box<Spans>>,
    /// The resolved endpoint.
    pub endpoint: Option<std::sync::Arc<str>>,
    /// `host:port` of the destination (the request target's authority: cheap to keep).
    pub destination: Option<http::uri::Authority>,
    /// Time spent waiting for the token (or, in shadow mode, that would have been).
    pub waited: std::time::Duration,
    /// The upstream's status.
    pub status: Option<u16>,
    /// Time from sending to the upstream's response head.
    pub upstream: Option<std::time::Duration>,
    /// `forwarded`, a `shadow_*` outcome, or the refusal reason.
    pub outcome: &'static str,
    /// Times sluice sent the request again after its receiver refused it (absorbed
    /// 429s).
    pub retried: u32,
    /// The request left for the receiver (its outcome is set then), and the label its
    /// outcome is counted under (hyper's path: the count of a request whose sender
    /// leaves before the answer).
    pub sent: Option<crate::metrics::EndpointLabel>,
}

/// W3C Trace Context's header.
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// Spans wait this long at most in the batch before they are sent.
const EXPORT_EVERY: Duration = Duration::from_millis(500);
/// Spans queued for export at most; past them new ones are dropped.
const MAX_QUEUED: usize = 8192;
/// The longest one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why traces could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TracesError {
    /// The exporter refused its configuration.
    #[error("traces.otlp_endpoint: {0}")]
    Exporter(String),
    /// The TLS roots for an `https://` endpoint could not be read.
    #[error("traces.otlp_endpoint: {0}")]
    Tls(#[from] crate::tls::upstream::UpstreamTlsError),
}

/// The span exporter of a running sluice: off, or a tracer and its provider.
#[derive(Default)]
pub struct Traces(Option<On>);

struct On {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl std::fmt::Debug for Traces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Traces(on)"
        } else {
            "Traces(off)"
        })
    }
}

impl Traces {
    /// Traces as `config` asks: off without an `otlp_endpoint`. `roots`: extra PEM roots
    /// trusted for an `https://` endpoint (`tls.upstream_roots`). Must be called on the
    /// runtime exports are to be sent from.
    pub fn new(config: &TracesConfig, roots: &[std::path::PathBuf]) -> Result<Traces, TracesError> {
        use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
        let Some(endpoint) = &config.otlp_endpoint else {
            return Ok(Traces(None));
        };
        let tls = crate::tls::upstream::client_config(roots)?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(Exporting::new(tls))
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(endpoint.to_string())
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| TracesError::Exporter(e.to_string()))?;
        let batch = BatchConfigBuilder::default()
            .with_scheduled_delay(EXPORT_EVERY)
            .with_max_queue_size(MAX_QUEUED)
            .build();
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch)
            .build();
        let resource = opentelemetry_sdk::Resource::builder_empty()
            .with_service_name(config.service_name.clone())
            .with_attribute(KeyValue::new("service.version", crate::version::VERSION))
            .build();
        let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(config.sample)));
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(sampler)
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("sluice");
        tracing::info!(endpoint = %endpoint, sample = config.sample, "exporting traces (OTLP/HTTP)");
        Ok(Traces(Some(On { provider, tracer })))
    }

    /// Whether spans are built.
    pub fn enabled(&self) -> bool {
        self.0.is_some()
    }

    /// Starts a request's spans (`None` when off): a child of the sender's
    /// `traceparent` when `headers` carry a valid one.
    pub fn begin(&self, headers: &HeaderMap) -> Option<Box<Spans>> {
        let on = self.0.as_ref()?;
        Some(Box::new(Spans::begin(on, headers)))
    }

    /// Sends the spans still queued and stops the exporter (blocking: call it off the
    /// runtime, as [`Traces::flush`] does).
    fn shutdown_blocking(&self) {
        if let Some(on) = &self.0 {
            if let Err(e) = on.provider.shutdown() {
                tracing::warn!(error = %e, "traces: the last spans could not be sent");
            }
        }
    }

    /// Sends the spans still queued and stops the exporter; the runtime keeps running
    /// meanwhile (the exports run on it).
    pub async fn flush(self: Arc<Self>) {
        if self.enabled() {
            let _ = tokio::task::spawn_blocking(move || self.shutdown_blocking()).await;
        }
    }
}

/// A request's spans while it is served (kept in its [`Trace`]).
pub struct Spans(Mutex<Open>);

impl std::fmt::Debug for Spans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Spans")
    }
}

struct Open {
    tracer: SdkTracer,
    request: opentelemetry_sdk::trace::Span,
    /// The request span as a parent.
    cx: Context,
    /// The upstream span, once the request was sent, with when it was.
    upstream: Option<(opentelemetry_sdk::trace::Span, SystemTime)>,
}

impl Spans {
    fn begin(on: &On, headers: &HeaderMap) -> Spans {
        let parent = match headers.get(&TRACEPARENT).and_then(parse_traceparent) {
            Some(sc) => Context::new().with_remote_span_context(sc),
            None => Context::new(),
        };
        let request = on
            .tracer
            .span_builder("request")
            .with_kind(SpanKind::Server)
            .start_with_context(&on.tracer, &parent);
        let cx = Context::new().with_remote_span_context(request.span_context().clone());
        Spans(Mutex::new(Open {
            tracer: on.tracer.clone(),
            request,
            cx,
            upstream: None,
        }))
    }

    fn open(&self) -> std::sync::MutexGuard<'_, Open> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Open {
    /// A child of the request span over `[start, end]`, ended at once.
    fn child(&self, name: &'static str, start: SystemTime, end: SystemTime) {
        let mut span = self
            .tracer
            .span_builder(name)
            .with_start_time(start)
            .start_with_context(&self.tracer, &self.cx);
        span.end_with_timestamp(end);
    }
}

/// The request was admitted now: `waited` is its grant's wait, `slot_wait` its wait
/// for an in-flight slot (`max_in_flight`), which came first. A grant's wait counts
/// from the queue's entry when the token had to be waited for (so it holds the slot
/// wait) and is zero when it was there at once: the token's own wait is what is left
/// of it past the slot wait.
pub fn admitted(trace: &Trace, waited: Duration, slot_wait: Option<Duration>) {
    let Some(spans) = &trace.spans else {
        return;
    };
    let open = spans.open();
    let now = SystemTime::now();
    let token = waited.saturating_sub(slot_wait.unwrap_or_default());
    let token_began = now.checked_sub(token).unwrap_or(now);
    if let Some(slot) = slot_wait {
        let began = token_began.checked_sub(slot).unwrap_or(token_began);
        open.child("slot wait", began, token_began);
    }
    open.child("admission wait", token_began, now);
}

/// The request leaves for the receiver now: starts the upstream span and gives `headers`
/// the `traceparent` naming it (in place of the sender's).
pub fn inject(trace: &Trace, headers: &mut HeaderMap) {
    if let Some(value) = sending(trace) {
        headers.insert(TRACEPARENT, value);
    }
}

/// As [`inject`], for a request head already written to `head` (ending in its blank
/// line): the sender's `traceparent` line is taken out and sluice's put in.
pub fn inject_head(trace: &Trace, head: &mut Vec<u8>) {
    let Some(value) = sending(trace) else {
        return;
    };
    let mut out = Vec::with_capacity(head.len() + 72);
    let body = head.strip_suffix(b"\r\n").unwrap_or(head);
    for line in body.split_inclusive(|&b| b == b'\n') {
        let name = line.split(|&b| b == b':').next().unwrap_or_default();
        if !name.eq_ignore_ascii_case(TRACEPARENT.as_str().as_bytes()) {
            out.extend_from_slice(line);
        }
    }
    out.extend_from_slice(b"traceparent: ");
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(b"\r\n\r\n");
    *head = out;
}

/// Starts the upstream span: the `traceparent` value that names it.
fn sending(trace: &Trace) -> Option<HeaderValue> {
    let spans = trace.spans.as_ref()?;
    let mut open = spans.open();
    let now = SystemTime::now();
    let span = open
        .tracer
        .span_builder("upstream")
        .with_kind(SpanKind::Client)
        .with_start_time(now)
        .start_with_context(&open.tracer, &open.cx);
    let value = traceparent(span.span_context());
    open.upstream = Some((span, now));
    HeaderValue::from_str(&value).ok()
}

/// The request (`method`) is done with `outcome` (answered, refused, or its sender
/// gone): ends its spans with what `trace` says of it. The upstream span ends when the
/// answer's head came. Called with its decision line ([`crate::decision`]).
pub fn finish(trace: &Trace, method: &str, outcome: &'static str) {
    let Some(spans) = &trace.spans else {
        return;
    };
    let mut open = spans.open();
    let now = SystemTime::now();
    let status = trace.status;
    if let Some((mut up, sent)) = open.upstream.take() {
        match status {
            Some(code) => up.set_attribute(KeyValue::new("http.response.status_code", code as i64)),
            None => up.set_status(Status::error(outcome)),
        }
        let end = trace.upstream.map_or(now, |d| (sent + d).min(now));
        up.end_with_timestamp(end);
    }
    let mut attributes = vec![
        KeyValue::new("http.request.method", method.to_owned()),
        KeyValue::new("sluice.outcome", outcome),
    ];
    if let Some(ep) = &trace.endpoint {
        attributes.push(KeyValue::new("sluice.endpoint", ep.to_string()));
    }
    if let Some(s) = &trace.sender {
        attributes.push(KeyValue::new("sluice.sender", s.as_str().to_owned()));
    }
    if let Some(d) = &trace.destination {
        attributes.push(KeyValue::new("server.address", d.as_str().to_owned()));
    }
    if let Some(code) = status {
        attributes.push(KeyValue::new("http.response.status_code", code as i64));
    }
    open.request.set_attributes(attributes);
    if outcome != crate::metrics::FORWARDED {
        open.request.set_status(Status::error(outcome));
    }
    open.request.end_with_timestamp(now);
}

/// A `traceparent` value (version 00).
fn traceparent(sc: &SpanContext) -> String {
    format!(
        "00-{:032x}-{:016x}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags()
    )
}

/// A `traceparent` value's span context, `None` unless it is valid (W3C Trace Context
/// §3.2: `00-<32 hex>-<16 hex>-<2 hex>`, IDs not all zero; a later version is read by
/// its first four fields).
fn parse_traceparent(v: &HeaderValue) -> Option<SpanContext> {
    let s = v.to_str().ok()?.trim();
    let mut parts = s.split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| {
        s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    if !hex(version, 2) || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    if !hex(trace, 32) || !hex(span, 16) || !hex(flags, 2) {
        return None;
    }
    let trace = TraceId::from(u128::from_str_radix(trace, 16).ok()?);
    let span = SpanId::from(u64::from_str_radix(span, 16).ok()?);
    let flags = TraceFlags::new(u8::from_str_radix(flags, 16).ok()? & 1);
    let sc = SpanContext::new(trace, span, flags, true, TraceState::default());
    sc.is_valid().then_some(sc)
}

/// Sends OTLP exports with hyper on the runtime sluice started on: the batch
/// processor's thread has no runtime of its own and waits for the answer.
struct Exporting {
    client: hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        Full<Bytes>,
    >,
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for Exporting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Exporting")
    }
}

impl Exporting {
    fn new(mut tls: rustls::ClientConfig) -> Exporting {
        // The connector sets ALPN itself (HTTP/1.1 here).
        tls.alpn_protocols.clear();
        let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
        http.enforce_http(false);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build(https);
        Exporting {
            client,
            runtime: tokio::runtime::Handle::current(),
        }
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Exporting {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, opentelemetry_http::HttpError> {
        let client = self.client.clone();
        let sending = async move {
            let resp = client.request(request.map(Full::new)).await?;
            let (parts, body) = resp.into_parts();
            // An answer says little (partial success at most): 1 MiB is plenty.
            let body = http_body_util::Limited::new(body, 1 << 20)
                .collect()
                .await?
                .to_bytes();
            Ok::<_, opentelemetry_http::HttpError>(http::Response::from_parts(parts, body))
        };
        // The timer is the runtime's: built on it, not on the exporter's thread.
        let timed = async move { tokio::time::timeout(EXPORT_TIMEOUT, sending).await };
        match self.runtime.spawn(timed).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err("the OTLP endpoint did not answer in time".into()),
            Err(e) => Err(Box::new(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_is_read_as_w3c_says() {
        let ok = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let sc = parse_traceparent(&HeaderValue::from_static(ok)).unwrap();
        assert_eq!(traceparent(&sc), ok);
        assert!(sc.is_sampled() && sc.is_remote());
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "garbage",
        ] {
            assert!(
                parse_traceparent(&HeaderValue::from_static(bad)).is_none(),
                "{bad}"
            );
        }
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-more";
        let sc = parse_traceparent(&HeaderValue::from_static(later)).unwrap();
        assert!(!sc.is_sampled());
    }
}
