//! The plain lane: sluice's own HTTP/1.1 engine for the request a forward proxy sees
//! most — an absolute-form `http://` request, HTTP/1.1, with no body or a
//! `Content-Length` one, on a kept-alive sender connection; and the same request in
//! origin-form inside an intercepted CONNECT tunnel that chose HTTP/1.1
//! ([`serve_tunnel`]), sent to the tunnel's authority over TLS.
//!
//! When a sender connection ends between requests, its clean upstream connection is
//! left on the worker's idle shelf ([`crate::idle`]) for the next sender connection to
//! the same destination, when it carried one request of it; one the sender held (two
//! requests or more in a row) is closed with it, as on hyper's path.
//!
//! Heads are parsed with `httparse` (the parser hyper itself uses); the request goes out
//! on the sender connection's own upstream connection, written and read in the
//! connection's task; the response head is rewritten (hop-by-hop and `X-Sluice-*`
//! headers removed) and its body is copied as it comes, framed by its `Content-Length`,
//! by its chunked framing (scanned, never re-encoded), or by the upstream closing.
//! Admission, 429 feedback, metrics and the decision log are the ones every other form
//! of request goes through (`proxy::admit_plain`, `proxy::answered`).
//! It spends about half the user-space CPU per request of the same hop through hyper's
//! server and client (docs/BENCHMARKS.md).
//!
//! Anything else hands the connection, with the bytes read so far, to hyper
//! ([`crate::conn::serve`]) for the rest of its life, before any of that request is
//! acted on: HTTP/1.0, CONNECT, origin-form (absolute-form inside a tunnel) and
//! `https://` targets, chunked or
//! upgrading requests, `Expect`, a `Connection` that names anything but `close` or
//! `keep-alive`, a second `Content-Length` or
//! `Host`, header bytes hyper's types refuse. So every unusual request gets
//! hyper's handling and answers exactly as before, and the lane only ever sees requests
//! whose framing is unambiguous. A head no HTTP/1.1 server would read (one `httparse`
//! rejects, more than [`MAX_HEADERS`] headers, over [`MAX_HEAD_BYTES`]) is answered
//! here, as hyper would (400 or 431, then the connection closes), but in sluice's own
//! shape: `X-Sluice-Reason: bad_request` and a body saying what was wrong.
//!
//! `SLUICE_PLAIN_LANE=0` in the environment turns the lane off (every connection is
//! hyper's): an operator's escape hatch, and the A/B of `bench/http.sh`.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, EXPECT, HOST, TRANSFER_ENCODING, UPGRADE};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, Version};
use http_body_util::BodyExt;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

use crate::absorb::{IDEMPOTENCY_KEY, REQUEST_ID_HEADER};
use crate::conn::{Activity, InFlight, Quiet, SenderIo, Timeouts, Writes, watched};
use crate::core::App;
use crate::decision::{self, Trace};
use crate::endpoint::COST_HEADER;
use crate::error::ProxyError;
use crate::forward::{ForwardError, content_length, content_length_list, hop_by_hop_index};
use crate::limits::{MAX_HEAD_BYTES, MAX_HEADERS, MAX_RESPONSE_HEAD_BYTES};
use crate::proxy::{self, Conn, Handler, PRIORITY_HEADER, Refused, SENDER_HEADER};
use crate::upload::{self, Progress, Stalled};
use crate::upstream::{UpIo, Upstream, quiet, still_open};

/// Longest a tunnel's TLS session is given to send its close_notify when the lane ends
/// it (a sender that reads nothing more must not hold the task).
const CLOSE_NOTIFY_WAIT: Duration = Duration::from_secs(1);

/// Whether the lane serves plain requests (`SLUICE_PLAIN_LANE=0` turns it off); read
/// once, at start-up.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SLUICE_PLAIN_LANE").map_or(true, |v| v != "0"))
}

/// Serves one sender connection: plain requests in the lane, and the whole connection
/// by hyper from the first request that is not plain.
pub async fn serve(
    app: Arc<App>,
    stream: TcpStream,
    conn: Arc<Conn>,
    timeouts: Timeouts,
    shutdown: watch::Receiver<bool>,
    hyper: impl Handler,
) {
    let (pre, writes) = (Bytes::new(), Writes::Flat);
    serve_on(app, stream, pre, conn, timeouts, shutdown, writes, hyper).await;
}

/// Serves the HTTP/1.1 requests inside a CONNECT tunnel (`conn.tunnel` is set): an
/// intercepted TLS session's, or a tunnel's carrying plain HTTP (`pre` is what was
/// read of it already). Origin-form requests in the lane, sent to the tunnel's
/// authority (over TLS when the tunnel's requests go so), and the whole session by
/// hyper from the first request that is not of that kind.
pub async fn serve_tunnel<S: SenderIo>(
    app: Arc<App>,
    stream: S,
    pre: Bytes,
    conn: Arc<Conn>,
    timeouts: Timeouts,
    shutdown: watch::Receiver<bool>,
    hyper: impl Handler,
) {
    let writes = Writes::Default;
    serve_on(app, stream, pre, conn, timeouts, shutdown, writes, hyper).await;
}

/// Leaves a plain TCP connection to a tunnel's authority, opened for a CONNECT whose
/// tunnel turned out to carry plain HTTP, on the idle shelf: its first request takes
/// it instead of opening another. Checked by the destination policy in force now.
pub(crate) fn shelve_plain(app: &App, conn: &Conn, tcp: TcpStream) {
    let Some(tunnel) = conn.tunnel.as_ref().filter(|t| !t.tls) else {
        return;
    };
    let authority = tunnel.authority.as_str();
    let host: Box<str> = match tunnel.authority.port_u16() {
        Some(80) | None => tunnel.authority.host().into(),
        Some(_) => authority.into(),
    };
    let up = Upstream {
        authority: authority.into(),
        generation: app.forwarder.generation(),
        stream: UpIo::Tcp(tcp),
        buf: BytesMut::with_capacity(8192),
        host,
    };
    app.idle.put((false, authority.into()), up);
}

/// [`serve`] on any sender stream, `pre` read of it already; `writes` is how hyper
/// writes if it takes over, and `hyper` serves each request it then reads.
#[allow(clippy::too_many_arguments)]
async fn serve_on<S: SenderIo>(
    app: Arc<App>,
    stream: S,
    pre: Bytes,
    conn: Arc<Conn>,
    timeouts: Timeouts,
    shutdown: watch::Receiver<bool>,
    writes: Writes,
    hyper: impl Handler,
) {
    let in_tunnel = conn.tunnel.is_some();
    // A TLS session ends with its close_notify.
    let tls_session = conn.tunnel.as_ref().is_some_and(|t| t.tls);
    let activity = Activity::new();
    activity.expect_head();
    let idle = Arc::clone(&activity).watch(timeouts.idle, Some(timeouts.header_read));
    let timer = Box::pin(tokio::time::sleep(Duration::ZERO));
    let mut lane = Lane {
        app,
        conn,
        stream,
        activity,
        inb: {
            let mut inb = BytesMut::with_capacity(8192.max(pre.len()));
            inb.extend_from_slice(&pre);
            inb
        },
        out: Vec::with_capacity(1024),
        up: None,
        held: false,
        timer,
        in_tunnel,
    };
    let closing = AtomicBool::new(false);
    let ended = watched(
        lane.run(&closing),
        |_| closing.store(true, Ordering::Relaxed),
        idle,
        shutdown.clone(),
    )
    .await;
    // A clean upstream connection that carried one request outlives its sender
    // connection; one the sender held (two requests or more in a row) ends with it.
    if let Some(up) = lane.up.take().filter(|_| !lane.held) {
        let tls = matches!(up.stream, UpIo::Tls(_));
        if quiet(&up) {
            lane.app.idle.put((tls, up.authority.clone()), up);
        }
    }
    let pre = match ended {
        Ok(Ok(Some(pre))) => pre,
        Ok(Ok(None)) => {
            if tls_session {
                // A TLS session the lane ends (the sender asked for `close`, or an
                // answer left its body unread) ends with its close_notify, as hyper
                // ends one: the sender's client sees a clean end, not a cut.
                let _ = tokio::time::timeout(CLOSE_NOTIFY_WAIT, lane.stream.shutdown()).await;
            }
            return;
        }
        Ok(Err(e)) => return tracing::debug!(error = %e, "connection ended with an error"),
        Err(Quiet::Idle) => return tracing::debug!("closing idle connection"),
        Err(Quiet::SlowHead) => {
            return tracing::debug!("closing connection: request head not finished in time");
        }
    };
    let Lane {
        app, conn, stream, ..
    } = lane;
    let io = TokioIo::new(stream);
    let svc = service_fn(move |req| {
        let (a, c) = (Arc::clone(&app), Arc::clone(&conn));
        // Boxed: inside a tunnel, hyper's requests can open tunnels of their own.
        async move { Ok::<_, Infallible>(hyper.handle(a, req, c).await) }
    });
    let v = Version::HTTP_11;
    crate::conn::serve(pre, io, svc, v, timeouts, writes, shutdown).await;
}

/// One sender connection in the lane.
struct Lane<S> {
    app: Arc<App>,
    conn: Arc<Conn>,
    stream: S,
    activity: Arc<Activity>,
    /// Bytes read from the sender and not yet used.
    inb: BytesMut,
    /// The next bytes to write (a head, and the body bytes that came with it).
    out: Vec<u8>,
    /// The connection's own upstream connection, between requests.
    up: Option<Upstream>,
    /// `up` carried more than one of this connection's requests in a row: the sender
    /// holds it, and it is closed, not shelved, when the sender leaves (as hyper's path
    /// closes a connection's [`crate::forward::Affinity`]). A receiver can write bytes
    /// after its answer that arrive only once the next request is sent (its Nagle
    /// delay waits for sluice's ACK), so no look at the socket before a reuse can see
    /// them: on a held connection they reach its own sender, never another.
    held: bool,
    /// The upstream timeout, set again for each request (one timer per connection).
    timer: Pin<Box<Sleep>>,
    /// Inside a tunnel: requests are origin-form, for the tunnel's authority.
    in_tunnel: bool,
}

/// A plain request's head, parsed.
struct Head {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    /// Length of the head in bytes.
    len: usize,
    /// Its `Content-Length` (0 without one).
    body: u64,
    /// The sender asked for the connection to close after the response
    /// (`Connection: close`: one-shot senders, such as Go's `DisableKeepAlives`).
    close: bool,
}

/// What the sender's bytes hold next.
// Not boxed: a head is made for every request, and a box would be one more allocation.
#[allow(clippy::large_enum_variant)]
enum Next {
    Head(Head),
    /// Not the lane's: hyper serves the connection from here.
    Handoff,
    /// A head no server would read: answered, then the connection ends.
    Malformed(ProxyError),
    /// The sender closed, or shutdown began between requests.
    Closed,
}

/// Why an exchange did not complete.
enum Failure {
    /// Answered by sluice (refused, or the upstream failed before its head came);
    /// `clean` when nothing of the request's body was read yet.
    Refused(Refused, bool),
    /// The connection is cut (the response had begun, or the sender is gone).
    Io(io::Error),
}

impl<S: SenderIo> Lane<S> {
    /// Serves requests until the sender closes, shutdown asks the connection to finish,
    /// or a request is not the lane's: then the bytes read of it, for hyper.
    async fn run(&mut self, closing: &AtomicBool) -> io::Result<Option<Bytes>> {
        loop {
            let mut head = match self.next_head(closing).await? {
                Next::Head(h) => h,
                Next::Handoff => return Ok(Some(self.inb.split().freeze())),
                Next::Malformed(e) => {
                    self.malformed(e).await?;
                    return Ok(None);
                }
                Next::Closed => return Ok(None),
            };
            if self.inb.capacity() > crate::budget::FREE_HEAD {
                // A large head's buffer goes once the head is parsed (its claim on the
                // budget went with `next_head`): what follows it moves to a usual one.
                let mut rest = BytesMut::with_capacity(8192.max(self.inb.len() - head.len));
                rest.extend_from_slice(&self.inb[head.len..]);
                self.inb = rest;
                head.len = 0;
            }
            if !self.exchange(head).await? || closing.load(Ordering::Relaxed) {
                return Ok(None);
            }
        }
    }

    /// Reads until a whole head is there (or it is not one the lane serves).
    async fn next_head(&mut self, closing: &AtomicBool) -> io::Result<Next> {
        // A large head's claim on the budget of buffered heads, until it is parsed.
        let mut held = crate::budget::HeadBytes::default();
        loop {
            if !self.inb.is_empty() {
                match parse_request(&self.inb, self.in_tunnel) {
                    Parsed::Partial if self.inb.len() >= MAX_HEAD_BYTES => {
                        return Ok(Next::Malformed(ProxyError::HeadTooLarge));
                    }
                    Parsed::Partial => {}
                    Parsed::Handoff => return Ok(Next::Handoff),
                    Parsed::Malformed(e) => return Ok(Next::Malformed(e)),
                    // A head whose last bytes came in the read that took it past the
                    // limit parses whole: it is over the limit all the same.
                    Parsed::Head(h) if h.len > MAX_HEAD_BYTES => {
                        return Ok(Next::Malformed(ProxyError::HeadTooLarge));
                    }
                    Parsed::Head(h) => return Ok(Next::Head(h)),
                }
            }
            if !held.cover(crate::budget::next_capacity(&self.inb)) {
                return Ok(Next::Malformed(ProxyError::Overloaded));
            }
            let (inb, stream) = (&mut self.inb, &mut self.stream);
            let n = std::future::poll_fn(|cx| {
                if inb.is_empty() && closing.load(Ordering::Relaxed) {
                    return Poll::Ready(Ok(0));
                }
                poll_read(stream, inb, cx)
            })
            .await?;
            if n == 0 {
                return Ok(Next::Closed);
            }
            self.activity.read();
        }
    }

    /// Answers a head no server would read (see the module doc); the connection then
    /// ends, as nothing after such a head can be framed.
    async fn malformed(&mut self, e: ProxyError) -> io::Result<()> {
        let resp = proxy::refuse(&self.app, e.into(), self.conn.peer, "-", &Trace::default());
        self.refusal(resp, None, false).await.map(drop)
    }

    /// One request and its response. Whether the connection can carry another.
    async fn exchange(&mut self, head: Head) -> io::Result<bool> {
        self.inb.advance(head.len);
        let in_flight = InFlight::enter(Arc::clone(&self.activity));
        let mut trace = Trace::default();
        match self.forward(&head, &mut trace, in_flight).await {
            Ok(keep) => {
                let log = &self.app.runtime.load().config.log;
                let (app, peer) = (&self.app, self.conn.peer);
                decision::forwarded(log, &app.sampler, peer, head.method.as_str(), &trace);
                Ok(keep)
            }
            Err(Failure::Refused(r, clean)) => {
                let peer = self.conn.peer;
                let resp = proxy::refuse(&self.app, r, peer, head.method.as_str(), &trace);
                let body = (clean && !head.close).then_some(head.body);
                let bodiless = head.method == Method::HEAD;
                let answering = Box::pin(self.refusal(resp, body, bodiless));
                answering.await
            }
            Err(Failure::Io(e)) => Err(e),
        }
    }

    /// Admits, sends and relays one request. Whether the connection can carry another.
    async fn forward(
        &mut self,
        head: &Head,
        trace: &mut Trace,
        in_flight: InFlight,
    ) -> Result<bool, Failure> {
        let app = Arc::clone(&self.app);
        let admitting = proxy::admit_plain(&app, &head.uri, &head.headers, &self.conn, trace);
        // A sender that leaves while its request waits takes the request with it.
        let admitted = while_sender_stays(&mut self.stream, &mut self.inb, admitting).await;
        let (rt, uri, target, mut admitted) = admitted
            .map_err(Failure::Io)?
            .map_err(|r| Failure::Refused(r, true))?;
        let limit = app.forwarder.timeout();
        // A request that may be sent again (its receiver's 429 absorbed) is read whole
        // before it leaves, to be written again as it was.
        let mut resend =
            proxy::Resend::plan(&admitted, &head.method, &head.headers, Some(head.body));
        if resend.is_some() && (self.inb.len() as u64) < head.body {
            if let Err(e) = self.read_body(head.body as usize, limit).await {
                return Err(failure(&app, &admitted, e, false).await);
            }
        }
        let authority = uri.authority().map_or("", |a| a.as_str());
        let tls = uri.scheme() == Some(&http::uri::Scheme::HTTPS);
        let generation = app.forwarder.generation();
        let usable = |u: &Upstream| u.generation == generation && still_open(u);
        let mut replay: Option<Vec<u8>> = None;
        let (up, answer, slot, mut watch, held) =
            loop {
                let kept = self
                    .up
                    .take()
                    .filter(|u| *u.authority == *authority && usable(u));
                let held = kept.is_some();
                // Else one another sender connection left, else a new one; bytes it
                // holds now belong to no request of this sender's.
                let shelved = |u: &Upstream| u.generation == generation && quiet(u);
                let kept = kept.or_else(|| app.idle.take((tls, authority.into()), shelved));
                let mut up = match kept {
                    Some(u) => u,
                    None => match Box::pin(open(&app, &target.host, target.port, &uri)).await {
                        Ok(u) => u,
                        Err(e) => {
                            let clean = replay.is_none();
                            return Err(failure(&app, &admitted, e, clean).await);
                        }
                    },
                };
                up.generation = generation;
                let body_left = match &replay {
                    // A resend: the request as first written, body and all.
                    Some(bytes) => {
                        self.out.clear();
                        self.out.extend_from_slice(bytes);
                        0
                    }
                    None => {
                        // The request head, and whatever of its body came with it.
                        let own = [
                            rt.resolver.header(),
                            &SENDER_HEADER,
                            &PRIORITY_HEADER,
                            &COST_HEADER,
                        ];
                        request_head(&mut self.out, head, &uri, &up.host, &own);
                        crate::traces::inject_head(trace, &mut self.out);
                        let with_head = (self.inb.len() as u64).min(head.body) as usize;
                        self.out.extend_from_slice(&self.inb[..with_head]);
                        self.inb.advance(with_head);
                        if resend.is_some() {
                            replay = Some(self.out.clone());
                        }
                        head.body - with_head as u64
                    }
                };

                let sent = Instant::now();
                self.timer.as_mut().reset(sent + limit);
                // Watched only while a body is still to come (`upload`'s rule for the timeout).
                let progress = (body_left > 0).then(Progress::new);
                let sending = send(
                    &mut up,
                    &mut self.out,
                    &mut self.stream,
                    &mut self.inb,
                    body_left,
                    Ask {
                        head_request: head.method == Method::HEAD,
                        close: head.close,
                    },
                    progress.as_ref(),
                );
                let clean = head.body == 0 && replay.is_none();
                let answer =
                    match upload::within(self.timer.as_mut(), progress.as_ref(), limit, sending)
                        .await
                    {
                        Ok(Ok(a)) => a,
                        Ok(Err(e)) => return Err(failure(&app, &admitted, e, clean).await),
                        Err(Stalled::Upstream) => {
                            let e = ForwardError::Timeout(limit);
                            return Err(failure(&app, &admitted, e, clean).await);
                        }
                        Err(Stalled::Sender) => {
                            let e = ForwardError::SenderStalled(limit);
                            return Err(failure(&app, &admitted, e, false).await);
                        }
                    };
                trace.upstream = Some(sent.elapsed());
                let empty = HeaderMap::new();
                let headers = answer.headers.as_ref().unwrap_or(&empty);
                proxy::heeded(&app, &admitted, answer.status, headers).await;
                if let Some(again) = resend.as_mut() {
                    if again
                        .again(&app, &mut admitted, answer.status, headers)
                        .await
                    {
                        // The refusal's body is not read: its connection goes.
                        drop(up);
                        continue;
                    }
                }
                let chunked = matches!(answer.framing, Framing::Chunked(_));
                let watch = proxy::BodyWatch::new(&app, &admitted, answer.status, headers, chunked);
                let slot = proxy::final_answer(&app, admitted, answer.status, trace);
                break (up, answer, slot, watch, held);
            };
        if let Some(n) = resend.as_ref().map(|r| r.retried).filter(|&n| n > 0) {
            trace.retried = n;
            // Before the head's closing empty line.
            let end = self.out.len() - 2;
            let line = format!("{}: {n}\r\n", crate::absorb::RETRIED_HEADER);
            self.out.splice(end..end, line.into_bytes());
        }

        // The response head (in `out`) with the body bytes that came with it, then the
        // rest of the body as it comes.
        // Until the body's end the relay holds the upstream connection and the slot:
        // however this stops before it (a failed write, or this future dropped when the
        // sender's connection is closed at `idle_timeout` because it stopped reading),
        // the rest is drained for the receiver holding the slot.
        let mut relaying = Relaying {
            up: Some(up),
            relay: answer.framing,
            slot,
            limit,
        };
        let (up, relay) = relaying.parts();
        let (now, keep) = relay.take(&up.buf).map_err(Failure::Io)?;
        if let Some(w) = watch.as_mut() {
            w.feed(&up.buf[..keep]);
        }
        self.out.extend_from_slice(&up.buf[..keep]);
        self.out.extend_from_slice(relay.end());
        up.buf.advance(now);
        write_all(&mut self.stream, &self.out)
            .await
            .map_err(Failure::Io)?;
        self.activity.touch();
        // From here the connection is idle when no byte moves (a sender that stops
        // reading the body is closed at `idle_timeout`).
        drop(in_flight);
        while !relay.done() {
            up.buf.clear();
            let n = read(&mut up.stream, &mut up.buf)
                .await
                .map_err(Failure::Io)?;
            if n == 0 {
                relay.closed().map_err(Failure::Io)?;
                break;
            }
            let (n, keep) = relay.take(&up.buf).map_err(Failure::Io)?;
            if let Some(w) = watch.as_mut() {
                w.feed(&up.buf[..keep]);
            }
            let end = relay.end();
            let bytes = if end.is_empty() {
                &up.buf[..keep]
            } else {
                self.out.clear();
                self.out.extend_from_slice(&up.buf[..keep]);
                self.out.extend_from_slice(end);
                &self.out[..]
            };
            let written = write_all(&mut self.stream, bytes).await;
            up.buf.advance(n);
            written.map_err(Failure::Io)?;
            self.activity.touch();
        }
        if let Some(w) = watch {
            w.finish();
        }
        let delimited = relay.delimited();
        let (up, slot) = relaying.done();
        drop(slot);
        if delimited && !answer.close && up.buf.is_empty() {
            self.up = Some(up);
            self.held = held;
        }
        Ok(delimited && !head.close && !answer.early)
    }

    /// Reads from the sender until `inb` holds `len` bytes: a request body kept whole
    /// before it leaves. A sender that sends nothing for `limit` has stalled.
    async fn read_body(&mut self, len: usize, limit: Duration) -> Result<(), ForwardError> {
        while self.inb.len() < len {
            let (inb, stream) = (&mut self.inb, &mut self.stream);
            let reading = std::future::poll_fn(|cx| poll_read(stream, inb, cx));
            match tokio::time::timeout(limit, reading).await {
                Ok(Ok(0)) => {
                    let why = "the sender closed before the end of its body";
                    return Err(ForwardError::SenderBody(why.into()));
                }
                Ok(Ok(_)) => self.activity.read(),
                Ok(Err(e)) => return Err(ForwardError::SenderBody(e.to_string())),
                Err(_) => return Err(ForwardError::SenderStalled(limit)),
            }
        }
        Ok(())
    }

    /// Writes sluice's own answer. `body` is the request's `Content-Length` when none
    /// of it was read yet: skipped when all of it is here, and the connection carries
    /// on; otherwise it closes. An answer to `HEAD` (`head_only`) says its length and
    /// sends no body (RFC 9110 §9.3.2): the sender reads none, and bytes after the head
    /// would be read as the start of its next response.
    async fn refusal(
        &mut self,
        resp: http::Response<crate::error::Body>,
        body: Option<u64>,
        head_only: bool,
    ) -> io::Result<bool> {
        let keep = match body {
            Some(n) if self.inb.len() as u64 >= n => {
                self.inb.advance(n as usize);
                true
            }
            _ => false,
        };
        let (parts, body) = resp.into_parts();
        let bytes = match body {
            http_body_util::Either::Right(full) => match full.collect().await {
                Ok(c) => c.to_bytes(),
                Err(never) => match never {},
            },
            http_body_util::Either::Left(_) => Bytes::new(),
        };
        let out = &mut self.out;
        out.clear();
        let status = parts.status;
        out.extend_from_slice(b"HTTP/1.1 ");
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
        out.extend_from_slice(b"\r\n");
        for (k, v) in &parts.headers {
            header_line(out, k.as_str().as_bytes(), v.as_bytes());
        }
        header_line(out, b"content-length", bytes.len().to_string().as_bytes());
        header_line(out, b"date", &http_date());
        if !keep {
            header_line(out, b"connection", b"close");
        }
        out.extend_from_slice(b"\r\n");
        if !head_only {
            out.extend_from_slice(&bytes);
        }
        write_all(&mut self.stream, &self.out).await?;
        self.activity.touch();
        Ok(keep)
    }
}

/// The refusal answering a send that failed after admission (the token refunded when
/// nothing left); `clean` when nothing of the request's body was read yet.
async fn failure(app: &App, admitted: &proxy::Admitted, e: ForwardError, clean: bool) -> Failure {
    let failing = Box::pin(proxy::after_admission(app, admitted, e));
    Failure::Refused(failing.await, clean)
}

/// What the upstream answered: its head, parsed and rewritten for the sender.
struct Answer {
    status: StatusCode,
    /// The response's headers, only when the limiter reads them (429, 503, quota
    /// headers): most responses are never turned into a map.
    headers: Option<HeaderMap>,
    framing: Framing,
    /// The upstream closes the connection after this response.
    close: bool,
    /// The upstream answered before the request's body was all sent, and stopped
    /// reading it: the sender's connection ends after this response, and the rest of
    /// its body with it.
    early: bool,
}

/// Writes the request (head, then the rest of its body from the sender) and reads the
/// response head into `out`, rewritten. The upstream's bytes after the head stay in
/// `up.buf`.
///
/// While the body is sent, the upstream is listened to as well: a receiver may answer
/// from the head alone (a 413, a 401) and then neither read the rest nor close, or
/// answer while the sender is slow to upload. Its answer is the sender's then, and the
/// rest of the body is not sent ([`Answer::early`]).
async fn send<S: SenderIo>(
    up: &mut Upstream,
    out: &mut Vec<u8>,
    sender: &mut S,
    inb: &mut BytesMut,
    body_left: u64,
    ask: Ask,
    progress: Option<&Progress>,
) -> Result<Answer, ForwardError> {
    let upstream_write = |e: io::Error| ForwardError::Other(format!("upstream write failed: {e}"));
    up.buf.clear();
    write_all(&mut up.stream, out)
        .await
        .map_err(upstream_write)?;
    if body_left > 0 {
        let mut body = Body {
            left: body_left,
            pending: 0,
            unflushed: false,
            progress,
        };
        match std::future::poll_fn(|cx| body.poll_send(up, sender, inb, out, ask, cx)).await {
            Sent::All => {}
            Sent::Answered(answer) => return Ok(answer),
            Sent::SenderFailed(e) => return Err(ForwardError::SenderBody(e)),
            Sent::Malformed(e) => return Err(e),
            Sent::UpstreamFailed(e) => {
                // The upstream stopped reading or closed: it may have answered first.
                let ask = Ask { close: true, ..ask };
                return match read_answer(up, out, ask).await {
                    Ok(answer) => Ok(early(answer)),
                    Err(_) => Err(upstream_write(e)),
                };
            }
        }
    }
    read_answer(up, out, ask).await
}

/// How much of a response head still arriving the lane holds: less under memory
/// pressure ([`crate::budget`]).
fn response_head_limit() -> usize {
    crate::budget::response_head_limit(MAX_RESPONSE_HEAD_BYTES)
}

/// An upstream response head past [`MAX_RESPONSE_HEAD_BYTES`] without its end.
fn head_too_large() -> ForwardError {
    ForwardError::Other(format!(
        "upstream response head larger than {MAX_RESPONSE_HEAD_BYTES} bytes"
    ))
}

/// An answer that came before the request's body was all sent.
fn early(answer: Answer) -> Answer {
    Answer {
        close: true,
        early: true,
        ..answer
    }
}

/// A request body on its way from the sender to the upstream.
struct Body<'p> {
    /// Bytes of it still to come from the sender.
    left: u64,
    /// Bytes at the front of the sender's buffer read and not yet written upstream.
    pending: usize,
    /// Bytes were written upstream and not yet flushed (a TLS session holds them).
    unflushed: bool,
    /// Told when bytes move and whom the body waits on ([`upload`]).
    progress: Option<&'p Progress>,
}

/// How sending a body ended.
enum Sent {
    /// All of it is with the upstream.
    All,
    /// The upstream answered first (`out` holds the rewritten head).
    Answered(Answer),
    /// The sender failed or closed before it was all sent.
    SenderFailed(String),
    /// Writing to the upstream failed.
    UpstreamFailed(io::Error),
    /// The upstream's answer is not one (malformed, or a head too large).
    Malformed(ForwardError),
}

impl Body<'_> {
    /// Moves the body from the sender to the upstream, watching the upstream for an
    /// answer all the while; bytes after the body stay in `inb`.
    fn poll_send<S: SenderIo>(
        &mut self,
        up: &mut Upstream,
        sender: &mut S,
        inb: &mut BytesMut,
        out: &mut Vec<u8>,
        ask: Ask,
        cx: &mut Context<'_>,
    ) -> Poll<Sent> {
        loop {
            // Has the upstream said something? (Readiness only: no system call unless
            // it has.)
            match poll_read(&mut up.stream, &mut up.buf, cx) {
                Poll::Ready(Ok(n)) if n > 0 => {
                    match parse_response(&up.buf, Ask { close: true, ..ask }, out) {
                        Ok(Some((len, Some(answer)))) => {
                            up.buf.advance(len);
                            return Poll::Ready(Sent::Answered(early(answer)));
                        }
                        // An interim (1xx) response: the body goes on.
                        Ok(Some((len, None))) => up.buf.advance(len),
                        // A head that never ends is refused here as `read_answer`
                        // refuses it, not read until `upstream_timeout`.
                        Ok(None) if up.buf.len() >= response_head_limit() => {
                            return Poll::Ready(Sent::Malformed(head_too_large()));
                        }
                        Ok(None) => {}
                        Err(e) => return Poll::Ready(Sent::Malformed(e)),
                    }
                    continue;
                }
                // Closed or failed: the write that follows fails too, and the answer
                // it may have sent first is read then.
                Poll::Ready(Ok(_)) | Poll::Ready(Err(_)) => {
                    let e = io::Error::new(io::ErrorKind::BrokenPipe, "the upstream closed");
                    return Poll::Ready(Sent::UpstreamFailed(e));
                }
                Poll::Pending => {}
            }
            if self.pending > 0 {
                match Pin::new(&mut up.stream).poll_write(cx, &inb[..self.pending]) {
                    Poll::Ready(Ok(0)) => {
                        let e = io::Error::new(io::ErrorKind::WriteZero, "wrote nothing");
                        return Poll::Ready(Sent::UpstreamFailed(e));
                    }
                    Poll::Ready(Ok(n)) => {
                        inb.advance(n);
                        self.pending -= n;
                        self.unflushed = true;
                        self.moved();
                        continue;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Sent::UpstreamFailed(e)),
                    Poll::Pending => {
                        self.waits_on_sender(false);
                        return Poll::Pending;
                    }
                }
            }
            if self.unflushed {
                match Pin::new(&mut up.stream).poll_flush(cx) {
                    Poll::Ready(Ok(())) => self.unflushed = false,
                    Poll::Ready(Err(e)) => return Poll::Ready(Sent::UpstreamFailed(e)),
                    Poll::Pending => {
                        self.waits_on_sender(false);
                        return Poll::Pending;
                    }
                }
            }
            if self.left == 0 {
                // All with the upstream: its answer is due `upstream_timeout` from now.
                if let Some(p) = self.progress {
                    p.done();
                }
                return Poll::Ready(Sent::All);
            }
            inb.clear();
            match poll_read(sender, inb, cx) {
                Poll::Ready(Ok(0)) => {
                    let left = self.left;
                    return Poll::Ready(Sent::SenderFailed(format!(
                        "the sender closed with {left} bytes of its Content-Length unsent"
                    )));
                }
                Poll::Ready(Ok(n)) => {
                    let take = (n as u64).min(self.left);
                    self.pending = take as usize;
                    self.left -= take;
                    if let Some(p) = self.progress {
                        p.received(take);
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Sent::SenderFailed(e.to_string())),
                Poll::Pending => {
                    self.waits_on_sender(true);
                    return Poll::Pending;
                }
            }
        }
    }
}

impl Body<'_> {
    fn moved(&self) {
        if let Some(p) = self.progress {
            p.moved();
        }
    }

    fn waits_on_sender(&self, yes: bool) {
        if let Some(p) = self.progress {
            p.waits_on_sender(yes);
        }
    }
}

/// Reads the upstream's final response head into `out`, rewritten (interim ones are
/// skipped), after any of it already in `up.buf`. Its bytes after the head stay in
/// `up.buf`.
async fn read_answer(
    up: &mut Upstream,
    out: &mut Vec<u8>,
    ask: Ask,
) -> Result<Answer, ForwardError> {
    // A large head's claim on the budget of buffered heads, until it is read.
    let mut held = crate::budget::HeadBytes::default();
    loop {
        if !up.buf.is_empty() {
            match parse_response(&up.buf, ask, out)? {
                Some((len, Some(answer))) => {
                    up.buf.advance(len);
                    if up.buf.capacity() > crate::budget::FREE_HEAD {
                        // Its buffer goes with its claim: the body's bytes move to one
                        // of the usual size.
                        up.buf = BytesMut::from(&up.buf[..]);
                    }
                    return Ok(answer);
                }
                // An interim (1xx) response: not forwarded, the final one follows.
                Some((len, None)) => {
                    up.buf.advance(len);
                    continue;
                }
                None if up.buf.len() >= response_head_limit() => {
                    return Err(head_too_large());
                }
                None => {}
            }
        }
        if !held.cover(crate::budget::next_capacity(&up.buf)) {
            return Err(ForwardError::Other(format!(
                "upstream response head over {} bytes while the memory budget for \
                 response heads (proxy.max_memory) is spent",
                up.buf.len()
            )));
        }
        let n = read(&mut up.stream, &mut up.buf)
            .await
            .map_err(|e| ForwardError::Other(format!("upstream read failed: {e}")))?;
        if n == 0 {
            return Err(ForwardError::Other(
                "the upstream closed the connection before answering".into(),
            ));
        }
    }
}

/// What a request head parses into.
#[allow(clippy::large_enum_variant)]
enum Parsed {
    Partial,
    Handoff,
    /// No HTTP/1.1 server would read it: answered by the lane, then the connection ends.
    Malformed(ProxyError),
    Head(Head),
}

/// Parses a request head, and decides whether the lane serves it (see the module doc):
/// absolute-form `http://` on a sender's connection, origin-form `in_tunnel`.
fn parse_request(buf: &[u8], in_tunnel: bool) -> Parsed {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut slots);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(httparse::Error::TooManyHeaders) => return Parsed::Malformed(ProxyError::HeadTooLarge),
        // HTTP/2 with prior knowledge: told so, not just "malformed".
        Err(_) if crate::conn::is_h2_preface(buf) => {
            return Parsed::Malformed(crate::conn::h2_preface_refused());
        }
        Err(e) => {
            let why = format!("malformed request head ({e})");
            return Parsed::Malformed(ProxyError::BadRequest(why));
        }
    };
    // One limit whichever engine serves it: a head handed to hyper is read already.
    if len > MAX_HEAD_BYTES {
        return Parsed::Malformed(ProxyError::HeadTooLarge);
    }
    let (Some(1), Some(method), Some(path)) = (req.version, req.method, req.path) else {
        return Parsed::Handoff;
    };
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return Parsed::Handoff;
    };
    let form = if in_tunnel {
        path.starts_with('/')
    } else {
        path.starts_with("http://")
    };
    if method == Method::CONNECT || !form {
        return Parsed::Handoff;
    }
    let Ok(uri) = Uri::try_from(path) else {
        return Parsed::Handoff;
    };
    if uri.authority().is_none() != in_tunnel {
        return Parsed::Handoff;
    }
    let mut headers = HeaderMap::with_capacity(req.headers.len());
    let mut body = None;
    let mut hosts = 0;
    let mut close = false;
    for h in req.headers.iter() {
        let Ok(name) = HeaderName::from_bytes(h.name.as_bytes()) else {
            return Parsed::Handoff;
        };
        if name == TRANSFER_ENCODING || name == UPGRADE || name == EXPECT {
            return Parsed::Handoff;
        }
        if name == CONNECTION {
            // `close` and `keep-alive` only: any other token names a header as
            // hop-by-hop, which is hyper's to handle.
            match connection_close(h.value) {
                Some(c) => close |= c,
                None => return Parsed::Handoff,
            }
            continue;
        }
        if name == CONTENT_LENGTH {
            match (body, content_length(h.value)) {
                (None, Some(n)) => body = Some(n),
                _ => return Parsed::Handoff,
            }
        } else if name == HOST {
            hosts += 1;
        }
        let Ok(value) = HeaderValue::from_bytes(h.value) else {
            return Parsed::Handoff;
        };
        headers.append(name, value);
    }
    if hosts > 1 {
        return Parsed::Handoff;
    }
    Parsed::Head(Head {
        method,
        uri,
        headers,
        len,
        body: body.unwrap_or(0),
        close,
    })
}

/// A request's `Connection` value: whether it says `close`, when it holds nothing but
/// `close` and `keep-alive` (any case, comma-separated); `None` otherwise.
fn connection_close(v: &[u8]) -> Option<bool> {
    let mut close = false;
    for token in v.split(|b| *b == b',') {
        let token = token.trim_ascii();
        if token.eq_ignore_ascii_case(b"close") {
            close = true;
        } else if !token.is_empty() && !token.eq_ignore_ascii_case(b"keep-alive") {
            return None;
        }
    }
    Some(close)
}

/// Writes the request head for the upstream into `out`: origin-form, `Host` from the
/// checked target, the sender's headers less hop-by-hop ones, its `Host` and `own`.
fn request_head(out: &mut Vec<u8>, head: &Head, uri: &Uri, host: &str, own: &[&HeaderName]) {
    out.clear();
    out.extend_from_slice(head.method.as_str().as_bytes());
    out.push(b' ');
    // `path()` is `/` when the target has none, also before a query (`http://h?q`).
    out.extend_from_slice(uri.path().as_bytes());
    if let Some(q) = uri.query() {
        out.push(b'?');
        out.extend_from_slice(q.as_bytes());
    }
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\r\n");
    for (k, v) in &head.headers {
        if *k == HOST || hop_by_hop_index(k.as_str()).is_some() || own.contains(&k) {
            continue;
        }
        if *k == REQUEST_ID_HEADER {
            // The sender's request ID goes on as the receiver's idempotency key.
            if !head.headers.contains_key(IDEMPOTENCY_KEY) {
                header_line(out, IDEMPOTENCY_KEY.as_str().as_bytes(), v.as_bytes());
            }
            continue;
        }
        header_line(out, k.as_str().as_bytes(), v.as_bytes());
    }
    out.extend_from_slice(b"\r\n");
}

fn header_line(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// What the response answers: a `HEAD` request (no body), and whether the sender's
/// connection closes after it.
#[derive(Clone, Copy, Default)]
struct Ask {
    head_request: bool,
    close: bool,
}

/// Parses a response head from `buf`; `None` while it is incomplete. On a whole head,
/// its length and, for a final response, the [`Answer`], with the head rewritten for
/// the sender into `out` (saying `connection: close` when the sender's connection ends
/// after it); an interim (1xx) response gives no answer.
fn parse_response(
    buf: &[u8],
    ask: Ask,
    out: &mut Vec<u8>,
) -> Result<Option<(usize, Option<Answer>)>, ForwardError> {
    let bad = |why: String| ForwardError::Other(format!("malformed upstream response: {why}"));
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut slots);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(bad(e.to_string())),
    };
    // Exact: a head whose last bytes came in the read that took it past the limit is
    // as over it as one that never ends.
    if len > MAX_RESPONSE_HEAD_BYTES {
        return Err(head_too_large());
    }
    let code = resp.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|e| bad(e.to_string()))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(bad(
            "101 Switching Protocols to a request that asked for no upgrade".into(),
        ));
    }
    if status.is_informational() {
        return Ok(Some((len, None)));
    }
    // What frames the body, what the upstream says of its connection, and the names
    // its `Connection` lists (they go, like the hop-by-hop ones).
    let mut chunked = None;
    let mut length: Option<u64> = None;
    let mut close = false;
    let mut keep_alive = false;
    let mut listed: Vec<&[u8]> = Vec::new();
    let mut worth_reading = code == 429 || code == 503;
    let mut dated = false;
    for h in resp.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("date") {
            dated = true;
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            let last = h.value.rsplit(|b| *b == b',').next().unwrap_or_default();
            chunked = Some(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name.eq_ignore_ascii_case("content-length") {
            let n =
                content_length_list(h.value).ok_or_else(|| bad("invalid Content-Length".into()))?;
            if length.is_some_and(|l| l != n) {
                return Err(bad("conflicting Content-Length values".into()));
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case("connection") {
            // Token by token, as bytes: one that is not ASCII drops no other.
            for token in h.value.split(|b| *b == b',') {
                let token = token.trim_ascii();
                if token.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if !token.is_empty() {
                    keep_alive |= token.eq_ignore_ascii_case(b"keep-alive");
                    listed.push(token);
                }
            }
        }
        if !worth_reading && contains_ignore_case(name.as_bytes(), b"ratelimit") {
            worth_reading = true;
        }
    }
    // A `Date` the upstream's `Connection` lists is not relayed: one is added instead.
    dated &= !listed.iter().any(|n| n.eq_ignore_ascii_case(b"date"));
    // An HTTP/1.0 connection ends after the response unless it says `keep-alive`
    // (RFC 9112 §9.3).
    if resp.version == Some(0) && !keep_alive {
        close = true;
    }
    // An HTTP/1.0 message has no transfer codings: its framing is faulty (RFC 9112
    // §6.1), as hyper's client also takes it.
    if resp.version == Some(0) && chunked.is_some() {
        return Err(bad("Transfer-Encoding in an HTTP/1.0 response".into()));
    }
    let framing = if ask.head_request || code == 204 || code == 304 {
        Framing::Length(0)
    } else {
        match (chunked, length) {
            (Some(true), _) => Framing::Chunked(Chunks::default()),
            (Some(false), _) | (None, None) => Framing::UntilClose,
            (None, Some(n)) => Framing::Length(n),
        }
    };
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(resp.reason.unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    // A 204 has no body and may say nothing of one (RFC 9110 §8.6, §6.4.1).
    let no_content = code == 204;
    let mut length_sent = false;
    for h in resp.headers.iter() {
        let lower = h.name.to_ascii_lowercase();
        let dropped = match hop_by_hop_index(&lower) {
            // Transfer-Encoding frames the body, which is relayed as it came.
            Some(i) => i != 3 || no_content,
            None if lower == "content-length" => {
                // Once, as one number: a repeated or listed equal value (checked above)
                // is one value.
                if !(chunked.is_some() || no_content || length_sent) {
                    use std::io::Write as _;
                    out.extend_from_slice(h.name.as_bytes());
                    // Into the Vec: no allocation, and writing to one cannot fail.
                    let _ = write!(out, ": {}\r\n", length.unwrap_or_default());
                    length_sent = true;
                }
                true
            }
            None => {
                lower.starts_with("x-sluice-")
                    || listed
                        .iter()
                        .any(|n| n.eq_ignore_ascii_case(lower.as_bytes()))
            }
        };
        if !dropped {
            header_line(out, h.name.as_bytes(), h.value);
        }
    }
    if ask.close || matches!(framing, Framing::UntilClose) {
        header_line(out, b"connection", b"close");
    }
    // A forwarded response without a `Date` gets one (RFC 9110 §6.6.1), as hyper's
    // server adds it.
    if !dated {
        header_line(out, b"date", &http_date());
    }
    out.extend_from_slice(b"\r\n");
    let headers = worth_reading.then(|| {
        let mut map = HeaderMap::with_capacity(resp.headers.len());
        for h in resp.headers.iter() {
            if let (Ok(k), Ok(v)) = (
                HeaderName::from_bytes(h.name.as_bytes()),
                HeaderValue::from_bytes(h.value),
            ) {
                map.append(k, v);
            }
        }
        map
    });
    Ok(Some((
        len,
        Some(Answer {
            status,
            headers,
            framing,
            close,
            early: false,
        }),
    )))
}

/// Now as a `Date` value, formatted at most once a second on each thread.
fn http_date() -> [u8; 29] {
    thread_local! {
        static NOW: std::cell::Cell<(u64, [u8; 29])> = const { std::cell::Cell::new((u64::MAX, [0; 29])) };
    }
    let now = SystemTime::now();
    let secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    NOW.with(|cell| {
        let (at, text) = cell.get();
        if at == secs {
            return text;
        }
        let mut text = [0u8; 29];
        text.copy_from_slice(httpdate::fmt_http_date(now).as_bytes());
        cell.set((secs, text));
        text
    })
}

fn contains_ignore_case(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle))
}

/// How a response body ends.
enum Framing {
    /// After this many more bytes.
    Length(u64),
    /// With its last chunk (and trailers, which are not relayed: the sender's copy
    /// ends with the last chunk and an empty trailer section, as on hyper's path).
    Chunked(Chunks),
    /// When the upstream closes (the sender connection closes after it).
    UntilClose,
}

impl Framing {
    /// How many of `bytes` (the next bytes from the upstream) belong to the body, and
    /// how many of those, from the front, go to the sender (all but a chunked body's
    /// trailer section; [`Framing::end`] then ends the sender's copy).
    fn take(&mut self, bytes: &[u8]) -> io::Result<(usize, usize)> {
        match self {
            Framing::Length(n) => {
                let take = (*n).min(bytes.len() as u64);
                *n -= take;
                Ok((take as usize, take as usize))
            }
            Framing::Chunked(c) => c.scan(bytes),
            Framing::UntilClose => Ok((bytes.len(), bytes.len())),
        }
    }

    /// What ends the sender's copy of the body after the last [`Framing::take`] that
    /// finished it: the empty trailer section of a chunked body.
    fn end(&self) -> &'static [u8] {
        match self {
            Framing::Chunked(c) if c.done() => b"\r\n",
            _ => b"",
        }
    }

    fn done(&self) -> bool {
        match self {
            Framing::Length(n) => *n == 0,
            Framing::Chunked(c) => c.done(),
            Framing::UntilClose => false,
        }
    }

    /// The upstream closed: the end of a close-delimited body, or a body cut short.
    fn closed(&self) -> io::Result<()> {
        match self {
            Framing::UntilClose => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the upstream closed in the middle of a response body",
            )),
        }
    }

    /// Whether the body's end is known without the connection closing.
    fn delimited(&self) -> bool {
        !matches!(self, Framing::UntilClose)
    }
}

/// Finds where a chunked body ends, without decoding it: sizes, extensions and data
/// are relayed as they came; the trailer section is read and left out.
///
/// Strict (RFC 9112 §7.1): every line ends with CRLF, and a size line holds hex digits,
/// optional blanks, then an extension or nothing; no other control byte anywhere. A
/// body the sender's client could end somewhere else (a bare LF taken as a line end)
/// is an error, and the connection is cut: relayed as it came, it would let a receiver
/// place a response of its own choosing after the body.
#[derive(Debug, Default)]
struct Chunks {
    state: Chunk,
    /// Bytes left of the current chunk's data (or its size, while it is read).
    size: u64,
    /// Digits of the current size, leading zeros included.
    digits: u8,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    #[default]
    Size,
    /// Blanks after a size's digits.
    SizeBlank,
    Extension,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    /// The start of a line of the trailer section (from here on nothing is relayed).
    TrailerStart,
    Trailer,
    TrailerLf,
    EndLf,
    Done,
}

/// Most digits a chunk size may have, leading zeros included: Go's net/http (the usual
/// webhook sender) refuses a longer size line, so relaying one would fail its request;
/// hyper's path decodes the size and writes it anew, and never sends one either.
const MAX_SIZE_DIGITS: u8 = 16;

/// A byte a field value or chunk extension may hold: HTAB, visible ASCII, space and
/// obs-text; never another control byte.
fn field_byte(b: u8) -> bool {
    b == b'\t' || (b' '..=b'~').contains(&b) || b >= 0x80
}

impl Chunks {
    fn done(&self) -> bool {
        self.state == Chunk::Done
    }

    /// Whether the scan is in the trailer section (its bytes are not relayed).
    fn in_trailers(&self) -> bool {
        matches!(
            self.state,
            Chunk::TrailerStart | Chunk::Trailer | Chunk::TrailerLf | Chunk::EndLf | Chunk::Done
        )
    }

    /// How many of `bytes` belong to the body (all of them unless it ends in them), and
    /// how many of those, from the front, to relay (the trailer section is not).
    fn scan(&mut self, bytes: &[u8]) -> io::Result<(usize, usize)> {
        let bad = |what: &str| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("malformed chunked body from the upstream: {what}"),
            )
        };
        let mut relay = if self.in_trailers() { Some(0) } else { None };
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            match self.state {
                Chunk::Size => match (b as char).to_digit(16) {
                    Some(_) if self.digits >= MAX_SIZE_DIGITS => {
                        return Err(bad("chunk size too long"));
                    }
                    Some(_) if self.size > u64::MAX >> 4 => {
                        return Err(bad("chunk size too large"));
                    }
                    Some(d) => {
                        self.size = self.size * 16 + u64::from(d);
                        self.digits += 1;
                    }
                    None if self.digits == 0 => return Err(bad("no chunk size")),
                    None if b == b' ' || b == b'\t' => self.state = Chunk::SizeBlank,
                    None if b == b';' => self.state = Chunk::Extension,
                    None if b == b'\r' => self.state = Chunk::SizeLf,
                    None => return Err(bad("bad byte in a chunk size")),
                },
                Chunk::SizeBlank => match b {
                    b' ' | b'\t' => {}
                    b';' => self.state = Chunk::Extension,
                    b'\r' => self.state = Chunk::SizeLf,
                    _ => return Err(bad("bad byte after a chunk size")),
                },
                Chunk::Extension => match b {
                    b'\r' => self.state = Chunk::SizeLf,
                    b if field_byte(b) => {}
                    _ => return Err(bad("control byte in a chunk extension")),
                },
                Chunk::SizeLf => {
                    if b != b'\n' {
                        return Err(bad("chunk size line not ended by CRLF"));
                    }
                    self.state = if self.size == 0 {
                        relay = Some(i + 1);
                        Chunk::TrailerStart
                    } else {
                        Chunk::Data
                    };
                }
                Chunk::Data => {
                    let take = self.size.min((bytes.len() - i) as u64);
                    self.size -= take;
                    i += take as usize;
                    if self.size == 0 {
                        self.state = Chunk::DataCr;
                    }
                    continue;
                }
                Chunk::DataCr if b == b'\r' => self.state = Chunk::DataLf,
                Chunk::DataLf if b == b'\n' => {
                    self.state = Chunk::Size;
                    self.digits = 0;
                }
                Chunk::DataCr | Chunk::DataLf => return Err(bad("chunk data not ended by CRLF")),
                Chunk::TrailerStart if b == b'\r' => self.state = Chunk::EndLf,
                Chunk::TrailerStart if b != b' ' && b != b'\t' && field_byte(b) && b < 0x80 => {
                    self.state = Chunk::Trailer;
                }
                Chunk::TrailerStart => return Err(bad("bad byte at a trailer line's start")),
                Chunk::Trailer => match b {
                    b'\r' => self.state = Chunk::TrailerLf,
                    b if field_byte(b) => {}
                    _ => return Err(bad("control byte in a trailer field")),
                },
                Chunk::TrailerLf if b == b'\n' => self.state = Chunk::TrailerStart,
                Chunk::TrailerLf => return Err(bad("trailer line not ended by CRLF")),
                Chunk::EndLf if b == b'\n' => {
                    self.state = Chunk::Done;
                    return Ok((i + 1, relay.unwrap_or(i + 1)));
                }
                Chunk::EndLf => return Err(bad("last chunk not ended by CRLF")),
                Chunk::Done => return Ok((i, relay.unwrap_or(i))),
            }
            i += 1;
        }
        Ok((i, relay.unwrap_or(i)))
    }
}

/// Opens an upstream connection to `host:port`, resolved and checked against the
/// destination policy, for `uri`'s authority: TLS for `https://` (inside a tunnel).
async fn open(app: &App, host: &str, port: u16, uri: &Uri) -> Result<Upstream, ForwardError> {
    let authority = uri.authority().map_or("", |a| a.as_str());
    let tls = uri.scheme() == Some(&http::uri::Scheme::HTTPS);
    let addrs = app.forwarder.resolve(host, port).await?;
    let tcp = app.forwarder.connect_tunnel(addrs).await?;
    let stream = if tls {
        UpIo::Tls(Box::new(app.forwarder.tls_handshake(host, tcp).await?))
    } else {
        UpIo::Tcp(tcp)
    };
    // The `Host` a connection of its own sends: the authority's host (no userinfo),
    // and its port, as a number, only when not the scheme's default.
    let default = if tls { 443 } else { 80 };
    let name = uri.host().unwrap_or_default();
    let host: Box<str> = match uri.port_u16() {
        Some(p) if p != default => format!("{name}:{p}").into(),
        _ => name.into(),
    };
    Ok(Upstream {
        authority: authority.into(),
        generation: 0,
        stream,
        buf: BytesMut::with_capacity(8192),
        host,
    })
}

/// Reads what is there into `buf`'s spare room (made when there is little): the
/// number of bytes, 0 at the end of the stream. On TCP, tokio forgets the socket's
/// readiness when a read drains it, so the next read waits for new bytes instead of
/// paying a system call that finds none.
fn poll_read<T: AsyncRead + Unpin>(
    stream: &mut T,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    if buf.capacity() - buf.len() < 1024 {
        buf.reserve(8192);
    }
    tokio_util::io::poll_read_buf(Pin::new(stream), cx, buf)
}

/// Most bytes read ahead from a sender while its request waits (its body, or a
/// pipelined request); past them only the wait is watched.
const READ_AHEAD_WHILE_WAITING: usize = 64 * 1024;

/// `wait` (a request's admission), ended early if the sender closes its connection
/// meanwhile: the wait is dropped then, which gives back what it had reserved, and the
/// request goes nowhere. Bytes the sender sends meanwhile are kept in `inb`, up to
/// [`READ_AHEAD_WHILE_WAITING`]. A request admitted at once never reads the socket.
async fn while_sender_stays<S: AsyncRead + Unpin, F: Future>(
    sender: &mut S,
    inb: &mut BytesMut,
    wait: F,
) -> io::Result<F::Output> {
    let mut wait = std::pin::pin!(wait);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(out) = wait.as_mut().poll(cx) {
            return Poll::Ready(Ok(out));
        }
        while inb.len() < READ_AHEAD_WHILE_WAITING {
            match poll_read(sender, inb, cx) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "the sender closed its connection while its request waited",
                    )));
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => break,
            }
        }
        Poll::Pending
    })
    .await
}

/// Writes all of `bytes`, and flushes them (a TLS session holds what it encrypted
/// until then).
async fn write_all<T: AsyncWrite + Unpin>(stream: &mut T, bytes: &[u8]) -> io::Result<()> {
    stream.write_all(bytes).await?;
    stream.flush().await
}

/// A response body on its way to the sender, with the upstream connection it comes on
/// and the request's slot. Dropped before [`Relaying::done`] (a write to the sender
/// failed, or the lane's future was dropped at `idle_timeout` while a write waited on a
/// sender that stopped reading), the rest of the body is drained, on a task of its own,
/// for the receiver holding the slot, as on hyper's path: releasing it at once would let
/// the next request reach a receiver still at work on this one.
struct Relaying {
    up: Option<Upstream>,
    relay: Framing,
    slot: Option<crate::limiter::Slot>,
    limit: Duration,
}

impl Relaying {
    /// The upstream connection and the body's framing, to relay with.
    fn parts(&mut self) -> (&mut Upstream, &mut Framing) {
        let up = self.up.as_mut().expect("relaying until done");
        (up, &mut self.relay)
    }

    /// The body is through: the upstream connection and the slot, nothing drained.
    fn done(mut self) -> (Upstream, Option<crate::limiter::Slot>) {
        let up = self.up.take().expect("relaying until done");
        (up, self.slot.take())
    }
}

impl Drop for Relaying {
    fn drop(&mut self) {
        if let Some(up) = self.up.take() {
            let relay = std::mem::replace(&mut self.relay, Framing::Length(0));
            drain_for_the_receiver(up, relay, self.slot.take(), self.limit);
        }
    }
}

fn drain_for_the_receiver(
    mut up: Upstream,
    mut relay: Framing,
    slot: Option<crate::limiter::Slot>,
    limit: Duration,
) {
    let Some(slot) = slot else {
        return;
    };
    if relay.done() {
        return;
    }
    tokio::spawn(async move {
        while !relay.done() {
            up.buf.clear();
            match tokio::time::timeout(limit, read(&mut up.stream, &mut up.buf)).await {
                Ok(Ok(n)) if n > 0 && relay.take(&up.buf).is_ok() => {}
                _ => break,
            }
        }
        drop(slot);
    });
}

/// Reads what is there into `buf`: the number of bytes, 0 at the end of the stream.
async fn read<T: AsyncRead + Unpin>(stream: &mut T, buf: &mut BytesMut) -> io::Result<usize> {
    std::future::poll_fn(|cx| poll_read(stream, buf, cx)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every split of a chunked body into two reads finds the same end.
    #[test]
    fn a_chunked_body_ends_where_its_last_chunk_and_trailers_end() {
        let body: &[u8] =
            b"5;ext=1\r\nhello\r\n1A \t\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nx-t: 1\r\nx-u: \xff\r\n\r\n";
        // What the sender gets: the same, less the trailer fields.
        let relayed: &[u8] =
            b"5;ext=1\r\nhello\r\n1A \t\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\n\r\n";
        let next = b"HTTP/1.1 200 OK\r\n";
        let all = [body, next.as_slice()].concat();
        for cut in 0..=all.len() {
            let mut framing = Framing::Chunked(Chunks::default());
            let mut sent = Vec::new();
            let mut used = 0;
            for part in [&all[..cut], &all[cut..]] {
                if framing.done() {
                    break;
                }
                let (n, keep) = framing.take(part).unwrap();
                assert!(keep <= n, "cut at {cut}");
                sent.extend_from_slice(&part[..keep]);
                sent.extend_from_slice(framing.end());
                used += n;
            }
            assert!(framing.done(), "cut at {cut}");
            assert_eq!(used, body.len(), "cut at {cut}");
            assert_eq!(sent, relayed, "cut at {cut}");
        }
        let mut c = Chunks::default();
        assert_eq!(c.scan(b"0\r\n\r\n").unwrap(), (5, 3));
        assert!(c.done());
        // Leading zeros are digits like any other.
        let mut c = Chunks::default();
        assert_eq!(
            c.scan(b"0000000000000002\r\nhi\r\n0\r\n\r\n").unwrap(),
            (27, 25)
        );
        assert!(c.done());
    }

    /// Bytes a client could read as a line end somewhere else (a bare LF), or any other
    /// control byte, are errors, wherever they come: the receiver cannot place a
    /// response of its own after a body its chunked framing ends differently for
    /// sluice and for the sender.
    #[test]
    fn malformed_chunked_bodies_are_errors() {
        for bad in [
            &b"x\r\n"[..],
            b"5\r\nhelloXX",
            b"\r\n",
            b"0\r\nab\rX",
            b"fffffffffffffffff\r\n",
            b"00000000000000001\r\n",
            b"000000000000000000000000000000001\r\n",
            b"2 junk\r\n",
            b"2\n",
            b"49;a\n",
            b"2;a\x00\r\n",
            b"2\r\nhi\n",
            b"2\r\nhi\r\n0\r\n\n",
            b"0\r\nx-t: 1\n\r\n",
            b"0\r\nx-t: \x01\r\n",
            b"0\r\n folded\r\n",
            b"0\r\n\r\r",
        ] {
            let mut c = Chunks::default();
            assert!(c.scan(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    fn head(text: &str) -> Option<Head> {
        match parse_request(text.as_bytes(), false) {
            Parsed::Head(h) => Some(h),
            _ => None,
        }
    }

    #[test]
    fn the_lane_takes_plain_requests_and_hands_everything_else_on() {
        let text = "POST http://a.example:8080/x?y=1 HTTP/1.1\r\nHost: a.example:8080\r\nContent-Length: 5\r\n\r\nhello";
        let h = head(text).unwrap();
        assert_eq!(h.body, 5);
        assert_eq!(h.uri.path_and_query().unwrap().as_str(), "/x?y=1");
        assert_eq!(h.len, text.len() - "hello".len());
        assert!(!h.close);
        // A one-shot sender's `Connection: close` (with `keep-alive`, in any case) is
        // the lane's: the connection ends after the answer.
        for (connection, close) in [
            ("close", true),
            ("Close", true),
            ("keep-alive", false),
            ("Keep-Alive, close", true),
            (" close ,", true),
        ] {
            let text = format!("GET http://a/ HTTP/1.1\r\nConnection: {connection}\r\n\r\n");
            let h = head(&text).unwrap_or_else(|| panic!("{connection:?} is the lane's"));
            assert_eq!(h.close, close, "{connection:?}");
            assert!(h.headers.get(CONNECTION).is_none(), "hop-by-hop: not kept");
        }
        for other in [
            "GET http://a/ HTTP/1.0\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\n\r\n",
            "CONNECT a:443 HTTP/1.1\r\n\r\n",
            "GET https://a/ HTTP/1.1\r\n\r\n",
            "POST http://a/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST http://a/ HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
            "POST http://a/ HTTP/1.1\r\nContent-Length: +1\r\n\r\n",
            "POST http://a/ HTTP/1.1\r\nContent-Length: 1, 1\r\n\r\n",
            "GET http://a/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            "GET http://a/ HTTP/1.1\r\nConnection: close, X-Drop\r\n\r\n",
            "GET http://a/ HTTP/1.1\r\nConnection: upgrade\r\n\r\n",
            "GET http://a/ HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
            "POST http://a/ HTTP/1.1\r\nExpect: 100-continue\r\n\r\n",
        ] {
            assert!(
                matches!(parse_request(other.as_bytes(), false), Parsed::Handoff),
                "{other:?}"
            );
        }
        // Heads no server would read are answered here (400, 431), not handed on.
        for malformed in [
            "GET http://a/ HTTP/1.1\r\nBad Name: x\r\n\r\n",
            "GARBAGE\r\n\r\n",
        ] {
            assert!(
                matches!(
                    parse_request(malformed.as_bytes(), false),
                    Parsed::Malformed(ProxyError::BadRequest(_))
                ),
                "{malformed:?}"
            );
        }
        let many = format!(
            "GET http://a/ HTTP/1.1\r\n{}\r\n",
            "x: 1\r\n".repeat(MAX_HEADERS + 1)
        );
        assert!(matches!(
            parse_request(many.as_bytes(), false),
            Parsed::Malformed(ProxyError::HeadTooLarge)
        ));
        assert!(matches!(
            parse_request(b"GET http://a/ HTTP/1.1\r\nHost: a\r\n", false),
            Parsed::Partial
        ));
    }

    /// Inside an intercepted tunnel the lane takes origin-form requests only: the
    /// tunnel names the destination, so an absolute-form one goes to hyper.
    #[test]
    fn inside_a_tunnel_the_lane_takes_origin_form_only() {
        let ok = "POST /x?y=1 HTTP/1.1\r\nHost: a.example\r\nContent-Length: 2\r\n\r\nhi";
        let Parsed::Head(h) = parse_request(ok.as_bytes(), true) else {
            panic!("origin-form in a tunnel is the lane's");
        };
        assert_eq!(
            (h.body, h.uri.path_and_query().unwrap().as_str()),
            (2, "/x?y=1")
        );
        for other in [
            "GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET https://a/ HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET * HTTP/1.1\r\nHost: a\r\n\r\n",
            "CONNECT a:443 HTTP/1.1\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        ] {
            assert!(
                matches!(parse_request(other.as_bytes(), true), Parsed::Handoff),
                "{other:?}"
            );
        }
    }

    #[test]
    fn responses_lose_hop_by_hop_and_sluice_headers_and_keep_their_framing() {
        let mut out = Vec::new();
        let text = "HTTP/1.1 200 Fine\r\nConnection: keep-alive, X-Drop\r\nX-Drop: 1\r\nKeep-Alive: timeout=5\r\nX-Sluice-Reason: forged\r\nTransfer-Encoding: chunked\r\nContent-Length: 9\r\nX-Keep: 2\r\nDate: D\r\n\r\n";
        let (len, answer) = parse_response(text.as_bytes(), Ask::default(), &mut out)
            .unwrap()
            .unwrap();
        let answer = answer.unwrap();
        assert_eq!(len, text.len());
        assert!(matches!(answer.framing, Framing::Chunked(_)));
        assert!(answer.headers.is_none());
        assert_eq!(
            String::from_utf8(out.clone()).unwrap(),
            "HTTP/1.1 200 Fine\r\nTransfer-Encoding: chunked\r\nX-Keep: 2\r\nDate: D\r\n\r\n"
        );
        let (_, answer) = parse_response(b"HTTP/1.1 200 OK\r\n\r\n", Ask::default(), &mut out)
            .unwrap()
            .unwrap();
        assert!(matches!(answer.unwrap().framing, Framing::UntilClose));
        assert!(String::from_utf8_lossy(&out).contains("connection: close"));
        let (_, answer) = parse_response(b"HTTP/1.1 429 Slow\r\nRetry-After: 3\r\nContent-Length: 2\r\nConnection: close\r\n\r\n", Ask::default(), &mut out).unwrap().unwrap();
        let answer = answer.unwrap();
        assert!(answer.close);
        assert_eq!(answer.headers.unwrap()["retry-after"], "3");
        let (_, answer) = parse_response(
            b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n",
            Ask {
                head_request: true,
                close: false,
            },
            &mut out,
        )
        .unwrap()
        .unwrap();
        assert!(
            answer.unwrap().framing.done(),
            "a HEAD response has no body"
        );
        // A 204 says nothing of a body; a repeated equal Content-Length goes out once.
        let text = b"HTTP/1.1 204 No Content\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\nX-K: 1\r\nDate: D\r\n\r\n";
        let (_, answer) = parse_response(text, Ask::default(), &mut out)
            .unwrap()
            .unwrap();
        assert!(answer.unwrap().framing.done(), "no body");
        let head = String::from_utf8(out.clone()).unwrap();
        assert_eq!(head, "HTTP/1.1 204 No Content\r\nX-K: 1\r\nDate: D\r\n\r\n");
        // A `Connection` token that is not ASCII drops no other.
        let text = b"HTTP/1.1 200 OK\r\nConnection: X-Drop, \xff\r\nX-Drop: 1\r\nContent-Length: 0\r\nDate: D\r\n\r\n";
        parse_response(text, Ask::default(), &mut out).unwrap();
        let head = String::from_utf8(out.clone()).unwrap();
        assert_eq!(
            head,
            "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nDate: D\r\n\r\n"
        );
        // A `Date` the `Connection` lists goes, and a fresh one comes.
        let text = b"HTTP/1.1 200 OK\r\nConnection: date\r\nDate: D\r\nContent-Length: 0\r\n\r\n";
        parse_response(text, Ask::default(), &mut out).unwrap();
        let head = String::from_utf8(out.clone()).unwrap();
        assert!(!head.contains("Date: D"), "{head:?}");
        assert!(head.contains("\r\ndate: "), "{head:?}");
        // A repeated or listed equal Content-Length goes out once, as one number.
        for text in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\ncontent-length: 2\r\nDate: D\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nDate: D\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 2,2\r\ncontent-length: 2\r\nDate: D\r\n\r\n",
        ] {
            let (_, answer) = parse_response(text, Ask::default(), &mut out)
                .unwrap()
                .unwrap();
            assert!(matches!(answer.unwrap().framing, Framing::Length(2)));
            let head = String::from_utf8(out.clone()).unwrap();
            assert_eq!(
                head,
                "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nDate: D\r\n\r\n"
            );
        }
        for bad in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: 2,\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
            // HTTP/1.0 has no transfer codings.
            b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        ] {
            let parsed = parse_response(bad, Ask::default(), &mut out);
            assert!(parsed.is_err(), "{}", String::from_utf8_lossy(bad));
        }
        // Without a `Date`, the sender's copy gets one.
        let (_, answer) = parse_response(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n",
            Ask::default(),
            &mut out,
        )
        .unwrap()
        .unwrap();
        assert!(answer.is_some());
        let head = String::from_utf8(out.clone()).unwrap();
        let date = head
            .strip_prefix("HTTP/1.1 200 OK\r\nContent-Length: 2\r\ndate: ")
            .and_then(|d| d.strip_suffix(" GMT\r\n\r\n"))
            .unwrap_or_else(|| panic!("{head:?}"));
        assert!(
            httpdate::parse_http_date(&format!("{date} GMT")).is_ok(),
            "{head:?}"
        );
        // HTTP/1.0: the connection ends with the response unless it says keep-alive.
        for (text, close) in [
            (&b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n"[..], true),
            (
                b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: Keep-Alive\r\n\r\n",
                false,
            ),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", false),
        ] {
            let (_, answer) = parse_response(text, Ask::default(), &mut out)
                .unwrap()
                .unwrap();
            assert_eq!(
                answer.unwrap().close,
                close,
                "{}",
                String::from_utf8_lossy(text)
            );
        }
        // The sender asked for its connection to close: the answer says so, once.
        let ask = Ask {
            head_request: false,
            close: true,
        };
        let text =
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\nDate: D\r\n\r\n";
        let (_, answer) = parse_response(text, ask, &mut out).unwrap().unwrap();
        assert!(!answer.unwrap().close, "the upstream connection stays");
        assert_eq!(
            String::from_utf8(out.clone()).unwrap(),
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nDate: D\r\nconnection: close\r\n\r\n"
        );
        let (_, interim) = parse_response(
            b"HTTP/1.1 103 Early Hints\r\n\r\n",
            Ask::default(),
            &mut out,
        )
        .unwrap()
        .unwrap();
        assert!(interim.is_none());
        for bad in [
            &b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
            b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        ] {
            assert!(parse_response(bad, Ask::default(), &mut out).is_err());
        }
    }
}
