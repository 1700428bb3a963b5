//! Traces: with `[traces] otlp_endpoint`, each request's spans reach an OTLP/HTTP
//! receiver (a real HTTP server here, decoding the protobuf export): `request`, a child
//! of the sender's `traceparent`, with `admission wait`, `slot wait` and `upstream`
//! under it; the wait span lasts what the request measurably waited; the receiver of
//! the request gets a `traceparent` whose parent is the `upstream` span. Off, nothing
//! changes: the sender's `traceparent` passes through.

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{Reply, Upstream};
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::time::Instant;

/// An OTLP/HTTP receiver on 127.0.0.1: every span of every export it was sent.
struct Receiver {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Span>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    async fn start() -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&spans);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let kept = Arc::clone(&kept);
                tokio::spawn(async move {
                    let svc = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let kept = Arc::clone(&kept);
                        async move {
                            assert_eq!(req.uri().path(), "/v1/traces");
                            assert_eq!(req.headers()["content-type"], "application/x-protobuf");
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            let export = ExportTraceServiceRequest::decode(body).unwrap();
                            let mut kept = kept.lock().unwrap();
                            for rs in export.resource_spans {
                                for ss in rs.scope_spans {
                                    kept.extend(ss.spans);
                                }
                            }
                            // An empty ExportTraceServiceResponse: full success.
                            let mut resp = http::Response::new(Full::new(Bytes::new()));
                            resp.headers_mut().insert(
                                "content-type",
                                http::HeaderValue::from_static("application/x-protobuf"),
                            );
                            Ok::<_, Infallible>(resp)
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Receiver { addr, spans, task }
    }

    /// The spans of trace `trace_id` (hex), once there are at least `n` (10 s at most).
    async fn trace(&self, trace_id: &str, n: usize) -> Vec<Span> {
        let of_trace = || -> Vec<Span> {
            let spans = self.spans.lock().unwrap();
            spans
                .iter()
                .filter(|s| hex(&s.trace_id) == trace_id)
                .cloned()
                .collect()
        };
        common::wait_for(
            &format!("{n} spans of trace {trace_id}"),
            Duration::from_secs(10),
            || async { of_trace().len() >= n },
        )
        .await;
        of_trace()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn named<'a>(spans: &'a [Span], name: &str) -> &'a Span {
    spans
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no {name:?} span in {spans:#?}"))
}

fn duration(s: &Span) -> Duration {
    Duration::from_nanos(s.end_time_unix_nano - s.start_time_unix_nano)
}

/// `traceparent`'s fields: (trace ID, parent span ID, flags).
fn fields(traceparent: &str) -> (String, String, String) {
    let p: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(p.len(), 4, "{traceparent}");
    assert_eq!(p[0], "00");
    (p[1].into(), p[2].into(), p[3].into())
}

const SENDER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SENDER_SPAN: &str = "00f067aa0ba902b7";

/// A request held 250 ms for its token: its spans reach the receiver, the wait span
/// lasts the wait measured from the sender to the upstream's arrival (within 10 ms),
/// the request span is the sender's span's child, and the upstream's `traceparent`
/// names the `upstream` span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_is_traced_from_the_sender_to_the_receiver() {
    let receiver = Receiver::start().await;
    let up = Upstream::start().await;
    let s = common::sluice(&format!(
        "[traces]\notlp_endpoint = \"http://{}/v1/traces\"\n\
         [[endpoints]]\nid = \"ep\"\nrate = 4.0\nburst = 1.0\nmax_wait = \"5s\"\n",
        receiver.addr
    ))
    .await;
    let c = common::client(s.proxy_addr);
    // The first spends the one token (and is the root of a trace of its own).
    let r = c
        .get(up.url("/first"))
        .header("x-endpoint-id", "ep")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The second waits ~250 ms for the next.
    let sent = Instant::now();
    let r = c
        .get(up.url("/second"))
        .header("x-endpoint-id", "ep")
        .header("traceparent", format!("00-{SENDER_TRACE}-{SENDER_SPAN}-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let arrivals = up.arrivals();
    let second = arrivals.iter().find(|a| a.path == "/second").unwrap();
    let measured = second.at - sent;
    assert!(
        measured >= Duration::from_millis(150),
        "waited only {measured:?}"
    );

    let spans = receiver.trace(SENDER_TRACE, 3).await;
    let request = named(&spans, "request");
    let wait = named(&spans, "admission wait");
    let upstream = named(&spans, "upstream");
    assert_eq!(
        hex(&request.parent_span_id),
        SENDER_SPAN,
        "the sender's span is the parent"
    );
    assert_eq!(hex(&wait.parent_span_id), hex(&request.span_id));
    assert_eq!(hex(&upstream.parent_span_id), hex(&request.span_id));
    assert!(
        spans.iter().all(|s| s.name != "slot wait"),
        "no max_in_flight, no slot wait"
    );
    let waited = duration(wait);
    let off = waited.abs_diff(measured);
    assert!(
        off <= Duration::from_millis(10),
        "wait span {waited:?}, measured {measured:?}"
    );
    assert!(wait.start_time_unix_nano >= request.start_time_unix_nano);
    assert!(upstream.start_time_unix_nano >= wait.end_time_unix_nano);
    assert!(request.end_time_unix_nano >= upstream.end_time_unix_nano);

    // The receiver's parent is sluice's upstream span, in the sender's trace.
    let tp = second.headers["traceparent"].to_str().unwrap();
    let (trace_id, parent, flags) = fields(tp);
    assert_eq!(trace_id, SENDER_TRACE);
    assert_eq!(parent, hex(&upstream.span_id));
    assert_eq!(flags, "01");
    assert_eq!(second.headers.get_all("traceparent").iter().count(), 1);

    // A request without a traceparent starts a trace of its own, passed on as well.
    let first = arrivals.iter().find(|a| a.path == "/first").unwrap();
    let (trace_id, parent, _) = fields(first.headers["traceparent"].to_str().unwrap());
    let spans = receiver.trace(&trace_id, 3).await;
    assert!(
        named(&spans, "request").parent_span_id.is_empty(),
        "a root span"
    );
    assert_eq!(hex(&named(&spans, "upstream").span_id), parent);
    s.stop().await;
}

/// Behind `max_in_flight = 1`, a request waits for the slot the one before holds while
/// its receiver takes 300 ms: a `slot wait` span of that wait, then an `admission wait`
/// of none (the token was there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_wait_has_its_span() {
    let receiver = Receiver::start().await;
    let up = Upstream::with(Arc::new(|a: &common::Arrival| {
        if a.path == "/slow" {
            Reply::ok().delay(Duration::from_millis(300))
        } else {
            Reply::ok()
        }
    }))
    .await;
    let s = common::sluice(&format!(
        "[traces]\notlp_endpoint = \"http://{}/v1/traces\"\n\
         [[endpoints]]\nid = \"ep\"\nrate = 1000.0\nburst = 1000.0\nmax_in_flight = 1\n",
        receiver.addr
    ))
    .await;
    // Two senders, each with its connection (and sluice's upstream one) open before,
    // so that what is measured below is the wait, not a connection's set-up.
    let (a, c) = (common::client(s.proxy_addr), common::client(s.proxy_addr));
    for client in [&a, &c] {
        let r = client
            .get(up.url("/warm"))
            .header("x-endpoint-id", "ep")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let slow = {
        let url = up.url("/slow");
        tokio::spawn(async move { a.get(url).header("x-endpoint-id", "ep").send().await })
    };
    common::wait_for(
        "the slow request upstream",
        Duration::from_secs(5),
        || async { up.count() == 3 },
    )
    .await;
    let sent = Instant::now();
    let r = c
        .get(up.url("/next"))
        .header("x-endpoint-id", "ep")
        .header("traceparent", format!("00-{SENDER_TRACE}-{SENDER_SPAN}-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(slow.await.unwrap().unwrap().status(), 200);
    let next = up
        .arrivals()
        .into_iter()
        .find(|a| a.path == "/next")
        .unwrap();
    let measured = next.at - sent;
    assert!(
        measured >= Duration::from_millis(150),
        "waited only {measured:?}"
    );
    let spans = receiver.trace(SENDER_TRACE, 4).await;
    let request = named(&spans, "request");
    let slot = named(&spans, "slot wait");
    assert_eq!(hex(&slot.parent_span_id), hex(&request.span_id));
    let waited = duration(slot);
    assert!(
        waited.abs_diff(measured) <= Duration::from_millis(10),
        "slot wait span {waited:?}, measured {measured:?}"
    );
    // The token was there once the slot was: the two waits follow each other.
    let token = named(&spans, "admission wait");
    assert!(
        duration(token) < Duration::from_millis(10),
        "{:?}",
        duration(token)
    );
    assert_eq!(token.start_time_unix_nano, slot.end_time_unix_nano);
    s.stop().await;
}

/// Without `[traces]`, the sender's `traceparent` reaches the receiver unchanged and
/// nothing is exported.
#[tokio::test]
async fn off_by_default_the_traceparent_passes_through() {
    let up = Upstream::start().await;
    let s = common::sluice("[[endpoints]]\nid = \"ep\"\nrate = 100.0\nburst = 100.0\n").await;
    assert!(!s.app.traces.enabled());
    let tp = format!("00-{SENDER_TRACE}-{SENDER_SPAN}-01");
    let r = common::client(s.proxy_addr)
        .get(up.url("/"))
        .header("x-endpoint-id", "ep")
        .header("traceparent", &tp)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(up.arrivals()[0].headers["traceparent"], tp.as_str());
    s.stop().await;
}

/// hyper's path (an HTTP/1.0 request, which the lane hands over) passes sluice's
/// `traceparent` on in place of the sender's, as the lane does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hypers_path_passes_its_own_traceparent_too() {
    let receiver = Receiver::start().await;
    let up = Upstream::start().await;
    let s = common::sluice(&format!(
        "[traces]\notlp_endpoint = \"http://{}/v1/traces\"\n\
         [[endpoints]]\nid = \"ep\"\nrate = 100.0\nburst = 100.0\n",
        receiver.addr
    ))
    .await;
    let head = format!(
        "GET {} HTTP/1.0\r\nHost: {}\r\nX-Endpoint-Id: ep\r\n\
         traceparent: 00-{SENDER_TRACE}-{SENDER_SPAN}-01\r\n\r\n",
        up.url("/old"),
        up.addr
    );
    let answer = common::raw_exchange(s.proxy_addr, head.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    let spans = receiver.trace(SENDER_TRACE, 3).await;
    let upstream = named(&spans, "upstream");
    let arrival = &up.arrivals()[0];
    assert_eq!(arrival.headers.get_all("traceparent").iter().count(), 1);
    let (trace_id, parent, _) = fields(arrival.headers["traceparent"].to_str().unwrap());
    assert_eq!(trace_id, SENDER_TRACE);
    assert_eq!(parent, hex(&upstream.span_id));
    assert_eq!(hex(&named(&spans, "request").parent_span_id), SENDER_SPAN);
    s.stop().await;
}
