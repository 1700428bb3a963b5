//! One connection's life: serving HTTP/1.1 or HTTP/2 on an I/O stream until it closes,
//! goes idle or shutdown asks it to finish; the [`Lifecycle`] that tracks every
//! connection and tunnel; the [`ConnSlot`] that counts one sender connection (and the
//! tunnel it may become) against `proxy.max_connections`; and the stream wrappers under
//! them ([`Watched`], which records activity, and [`SendIo`]).
//!
//! This module knows nothing of proxying: the accept loops ([`crate::server`]) and the
//! intercepted tunnels ([`crate::proxy`]) both hand it a stream and a service.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Version};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::Service;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, watch};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

/// A sender's stream: a plain TCP connection, or the TLS session inside an intercepted
/// CONNECT tunnel.
pub trait SenderIo: AsyncRead + AsyncWrite + Unpin + Send + 'static {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> SenderIo for T {}

/// How often a watched connection looks at the memory pressure besides its changes (a
/// request that ends while pressed lets its connection go within this).
const PRESSED_LOOK: Duration = Duration::from_millis(250);

/// Tracks connections and tunnels, and carries the shutdown signal.
#[derive(Clone)]
pub struct Lifecycle {
    tx: Arc<watch::Sender<bool>>,
    tracker: TaskTracker,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle::new()
    }
}

impl Lifecycle {
    /// A lifecycle with nothing running.
    pub fn new() -> Lifecycle {
        Lifecycle {
            tx: Arc::new(watch::channel(false).0),
            tracker: TaskTracker::new(),
        }
    }

    /// Runs `fut` as a tracked task (waited for on shutdown).
    pub fn spawn<F>(&self, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.tracker.spawn(fut);
    }

    /// Runs `fut` as a tracked task on the runtime behind `handle` (a worker).
    pub fn spawn_on<F>(&self, fut: F, handle: &tokio::runtime::Handle)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.tracker.spawn_on(fut, handle);
    }

    /// A receiver that changes when shutdown begins.
    pub fn signal(&self) -> watch::Receiver<bool> {
        self.tx.subscribe()
    }

    /// Begins shutdown and waits up to `grace` for tracked tasks to end. True when all ended.
    pub async fn shutdown(&self, grace: Duration) -> bool {
        self.tx.send_replace(true);
        self.tracker.close();
        tokio::time::timeout(grace, self.tracker.wait())
            .await
            .is_ok()
    }
}

/// Resolves once shutdown has begun.
pub async fn until_down(rx: &mut watch::Receiver<bool>) {
    // Dropping the guard here keeps callers' futures Send.
    let _ = rx.wait_for(|down| *down).await;
}

/// One sender connection's place under `proxy.max_connections`, shared by the
/// connection and the CONNECT tunnel it may turn into: the place (and the
/// `sluice_connections_open` count) is given back when the last holder drops it.
pub struct ConnSlot {
    _permit: OwnedSemaphorePermit,
    open: Gauge,
}

impl ConnSlot {
    /// Takes the place `permit` stands for and counts the connection as open.
    pub fn new(permit: OwnedSemaphorePermit, open: Gauge) -> Arc<ConnSlot> {
        open.inc();
        Arc::new(ConnSlot {
            _permit: permit,
            open,
        })
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.open.dec();
    }
}

/// How long a served connection may stay quiet, and how long a request head may take.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// A sender that began a request head must finish it within this of its first byte,
    /// and a new connection its first head within this of opening (HTTP/1.1; at most
    /// half as long again: see [`Activity::watch`]).
    pub header_read: Duration,
    /// Closed after this long with no bytes either way and no request in flight (at
    /// most half as long again: see [`Activity::watch`]).
    pub idle: Duration,
}

/// How HTTP/1.1 answers are written to the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writes {
    /// One flat buffer per write: cheaper than an iovec per piece on plain TCP, where
    /// webhook heads and bodies are small (about 1 µs of CPU per request,
    /// docs/BENCHMARKS.md).
    Flat,
    /// hyper's default (vectored when the stream supports it): under TLS, flat writes
    /// cost intercepted HTTPS a fifth of its throughput in the same A/B.
    Default,
}

/// Serves one connection until it closes, stays idle longer than `timeouts.idle`, or
/// shutdown asks it to finish its in-flight work: HTTP/1.1 (with CONNECT upgrades) for
/// `Version::HTTP_11`, HTTP/2 for `Version::HTTP_2` (an intercepted tunnel whose sender
/// chose `h2` by ALPN).
///
/// `pre`: bytes already read from `io` (a connection the plain lane hands on,
/// [`crate::lane`]), read again first; empty for a fresh connection.
pub async fn serve<I, S, B>(
    pre: Bytes,
    io: I,
    svc: S,
    protocol: Version,
    timeouts: Timeouts,
    writes: Writes,
    shutdown: watch::Receiver<bool>,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: Service<Request<Incoming>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let activity = Activity::new();
    let h1 = protocol != Version::HTTP_2;
    let io = Watched {
        inner: io,
        activity: Arc::clone(&activity),
        // A fresh HTTP/1.1 connection's first bytes may be an HTTP/2 preface.
        sniff: h1 && pre.is_empty(),
        pre,
        hold_eof: h1,
        eof: false,
        answer: None,
    };
    let svc = Counted {
        inner: svc,
        activity: Arc::clone(&activity),
        hold_eof: h1,
    };
    if protocol == Version::HTTP_2 {
        let idle = activity.watch(timeouts.idle, None);
        let conn = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_header_list_size(crate::limits::MAX_HEAD_BYTES as u32)
            .serve_connection(io, svc);
        drive(conn, |c| c.graceful_shutdown(), idle, shutdown).await;
    } else {
        // The head's deadline is kept by the watcher, not by hyper's header-read timer:
        // hyper's runs from the end of each response, so it also cut kept-alive
        // connections waiting for their next request at that limit instead of
        // `idle`, and it cost a boxed timer per request. A new connection owes its
        // first head from the start, as if its first byte had come: a sender that
        // connects and says nothing holds its place under `max_connections` no longer
        // than one that trickles.
        activity.expect_head();
        let idle = activity.watch(timeouts.idle, Some(timeouts.header_read));
        let mut builder = http1::Builder::new();
        if writes == Writes::Flat {
            builder.writev(false);
        }
        let conn = builder
            .timer(TokioTimer::new())
            .header_read_timeout(None)
            .max_buf_size(crate::limits::MAX_HEAD_BYTES)
            .keep_alive(true)
            .serve_connection(io, svc)
            .with_upgrades();
        drive(conn, |c| c.graceful_shutdown(), idle, shutdown).await;
    }
}

/// Runs a served connection until it ends on its own (sender closed, error), goes idle,
/// or shutdown asks it to finish; logs how it ended.
async fn drive<C: Future<Output = Result<(), hyper::Error>>>(
    conn: C,
    graceful: impl FnOnce(Pin<&mut C>),
    idle: impl Future<Output = Quiet> + Send + 'static,
    shutdown: watch::Receiver<bool>,
) {
    match watched(conn, graceful, idle, shutdown).await {
        Err(Quiet::Idle) => tracing::debug!("closing idle connection"),
        Err(Quiet::SlowHead) => {
            tracing::debug!("closing connection: request head not finished in time")
        }
        Ok(Err(e)) => tracing::debug!(error = %e, "connection ended with an error"),
        Ok(Ok(())) => {}
    }
}

/// Runs `conn` until it ends on its own, goes idle ([`Quiet::Idle`]: it is dropped), or
/// takes too long over a request head ([`Quiet::SlowHead`]: dropped, nothing of it was
/// forwarded, and the connection closes without an answer, as nginx does at
/// `client_header_timeout`). When shutdown begins, `graceful` asks it to finish its
/// in-flight work, and it is awaited.
///
/// Idleness and shutdown are watched by a task of their own, which raises a flag: the
/// connection's task, woken for every read and write, then looks at one atomic instead
/// of polling a timer and a watch channel each time (about 600 instructions per
/// request, docs/BENCHMARKS.md).
pub(crate) async fn watched<C: Future>(
    conn: C,
    graceful: impl FnOnce(Pin<&mut C>),
    idle: impl Future<Output = Quiet> + Send + 'static,
    mut shutdown: watch::Receiver<bool>,
) -> Result<C::Output, Quiet> {
    let stop = Arc::new(Stop::default());
    let watcher = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move {
            let why = tokio::select! {
                quiet = idle => match quiet {
                    Quiet::Idle => Stop::IDLE,
                    Quiet::SlowHead => Stop::SLOW_HEAD,
                },
                _ = until_down(&mut shutdown) => Stop::DOWN,
            };
            stop.raise(why);
        }
    });
    // Aborted however this ends (the connection closed, or this future was dropped).
    let _watcher = AbortOnDrop(watcher);
    tokio::pin!(conn);
    let mut graceful = Some(graceful);
    std::future::poll_fn(|cx| {
        stop.waker.register(cx.waker());
        match stop.flag.load(Ordering::Acquire) {
            Stop::IDLE => return Poll::Ready(Err(Quiet::Idle)),
            Stop::SLOW_HEAD => return Poll::Ready(Err(Quiet::SlowHead)),
            Stop::DOWN => {
                if let Some(g) = graceful.take() {
                    g(conn.as_mut());
                }
            }
            _ => {}
        }
        conn.as_mut().poll(cx).map(Ok)
    })
    .await
}

/// Why [`Activity::watch`] says a connection should close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quiet {
    /// No bytes either way and no request in flight for the idle limit.
    Idle,
    /// A request head was begun and not finished within the header-read limit.
    SlowHead,
}

/// Why a connection should stop, raised by its watcher task.
#[derive(Default)]
struct Stop {
    flag: std::sync::atomic::AtomicU8,
    waker: futures_util::task::AtomicWaker,
}

impl Stop {
    const IDLE: u8 = 1;
    const DOWN: u8 = 2;
    const SLOW_HEAD: u8 = 3;

    fn raise(&self, why: u8) {
        self.flag.store(why, Ordering::Release);
        self.waker.wake();
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Whether a connection moved a byte lately, how many of its requests are in flight,
/// and whether a request head has begun arriving and not yet been handed on.
///
/// Recording is a few relaxed atomics (no clock read, no timer per request);
/// [`Activity::watch`] looks at them once per quarter of the shorter limit.
pub struct Activity {
    moved: AtomicBool,
    in_flight: AtomicUsize,
    /// Bytes were read while no request was in flight: a head is arriving.
    head: AtomicBool,
    /// Requests handed to the service so far (tells one slow head from several quick ones).
    heads: AtomicU64,
    /// Response bodies being written (hyper's path): bytes read meanwhile are a head
    /// that waits for them, not one arriving slowly.
    responding: AtomicUsize,
    /// Bytes were read while a body was being written and no request was in flight.
    read_while_responding: AtomicBool,
    /// The sender's end of stream, as hyper's path holds it ([`Watched`]).
    eof: Eof,
}

/// A sender's end of stream on hyper's HTTP/1.1 path. A sender may half-close
/// (`shutdown(SHUT_WR)`) after its request and still read the answer; hyper, reading an
/// end of stream while a request is in flight, drops it and closes the connection
/// unanswered. [`Watched`] holds the end back from hyper while the request in flight has
/// no body left to read and none of the connection's requests waits for admission
/// ([`SenderEof::waiting`]): the request is answered, then the connection closes. A
/// request that waits for its token when the end comes (or later) is cancelled, as a
/// sender that closes while its request waits cancels it (hyper drops it, then).
#[derive(Default)]
struct Eof {
    /// An end of stream was read and not yet handed to hyper.
    held: AtomicBool,
    /// Requests waiting for admission.
    waiting: AtomicUsize,
    /// The request in flight has no body (hyper reads nothing more for it).
    bodiless: AtomicBool,
    /// hyper's read, while the end is held.
    waker: futures_util::task::AtomicWaker,
}

impl Activity {
    /// Whether hyper is kept from the sender's end of stream now: a request with no
    /// body is in flight or being answered, and none waits for admission.
    fn holds_eof(&self) -> bool {
        let e = &self.eof;
        (self.in_flight.load(Ordering::Relaxed) > 0 || self.responding.load(Ordering::Relaxed) > 0)
            && e.bodiless.load(Ordering::Relaxed)
            && e.waiting.load(Ordering::Relaxed) == 0
    }

    /// Lets hyper look again at an end of stream it was kept from.
    fn release_eof(&self) {
        if self.eof.held.load(Ordering::Relaxed) {
            self.eof.waker.wake();
        }
    }
}

/// What a request on hyper's HTTP/1.1 path carries in its extensions: the connection's
/// [`Eof`], for [`SenderEof::waiting`].
#[derive(Clone)]
pub struct SenderEof(Arc<Activity>);

impl SenderEof {
    /// Marks the request of `extensions` as waiting for admission until the guard is
    /// dropped: a sender's end of stream meanwhile (or already read) cancels it. `None`
    /// off hyper's HTTP/1.1 path (the lane watches its sender itself).
    pub fn waiting(extensions: &http::Extensions) -> Option<Waiting> {
        let a = Arc::clone(&extensions.get::<SenderEof>()?.0);
        a.eof.waiting.fetch_add(1, Ordering::Relaxed);
        a.release_eof();
        Some(Waiting(a))
    }
}

/// A request waiting for admission ([`SenderEof::waiting`]), until dropped.
pub struct Waiting(Arc<Activity>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.eof.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Activity {
    /// A tracker that saw activity now.
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            moved: AtomicBool::new(true),
            in_flight: AtomicUsize::new(0),
            head: AtomicBool::new(false),
            heads: AtomicU64::new(0),
            responding: AtomicUsize::new(0),
            read_while_responding: AtomicBool::new(false),
            eof: Eof::default(),
        })
    }

    /// Records activity now.
    pub fn touch(&self) {
        self.moved.store(true, Ordering::Relaxed);
    }

    /// Counts a head as arriving from now (a new connection owes its first head from
    /// the start, as if its first byte had come).
    pub(crate) fn expect_head(&self) {
        self.head.store(true, Ordering::Relaxed);
    }

    /// Records bytes read from the sender: activity, and the start of a head when no
    /// request is in flight and no response body is being written (a head read during
    /// one begins when the body ends: hyper reads ahead, but serves the next request
    /// only then).
    pub(crate) fn read(&self) {
        self.touch();
        if self.in_flight.load(Ordering::Relaxed) != 0 || self.head.load(Ordering::Relaxed) {
            return;
        }
        if self.responding.load(Ordering::Relaxed) != 0 {
            self.read_while_responding.store(true, Ordering::Relaxed);
        } else {
            self.head.store(true, Ordering::Relaxed);
        }
    }

    /// Resolves once nothing moved for `limit` and no request is in flight: never
    /// sooner than `limit` after the last byte, and at most half a `limit` later.
    pub async fn idle_for(self: Arc<Self>, limit: Duration) {
        self.watch(limit, None).await;
    }

    /// Resolves when the connection should close:
    /// - [`Quiet::Idle`] once nothing moved for `idle` and no request is in flight:
    ///   never sooner than `idle` after the last byte, at most half an `idle` later;
    /// - with `head`, [`Quiet::SlowHead`] once a request head has been arriving for
    ///   `head` without being finished: never sooner than `head` after its first byte
    ///   (for a new connection's first head: after the watch began), at most half a
    ///   `head` later. A kept-alive connection waiting for its next request is not
    ///   arriving a head.
    ///
    /// The connection is looked at every quarter of the shorter limit.
    ///
    /// Under memory pressure ([`crate::budget`]) it resolves to [`Quiet::Idle`] as soon
    /// as no request is in flight.
    pub async fn watch(self: Arc<Self>, idle: Duration, head: Option<Duration>) -> Quiet {
        let step = head.map_or(idle, |h| h.min(idle)) / 4;
        let mut quiet_since = Instant::now();
        // When this look first saw the current head, and how many heads were done then.
        let mut head_since: Option<(Instant, u64)> = None;
        let mut pressure = crate::budget::subscribe();
        let mut next_look = Instant::now() + step;
        loop {
            // While pressed, a look every PRESSED_LOOK too (a request that ends lets its
            // connection go); otherwise only the idle and head rules' own looks.
            let wake = if crate::budget::pressed() {
                next_look.min(Instant::now() + PRESSED_LOOK)
            } else {
                next_look
            };
            tokio::select! {
                () = tokio::time::sleep_until(wake) => {}
                // Pressed (or relieved) now: look at once (the channel is static: it
                // never closes).
                _ = pressure.changed() => {}
            }
            let now = Instant::now();
            let in_flight = self.in_flight.load(Ordering::Relaxed) > 0;
            if crate::budget::pressed() && !in_flight {
                return Quiet::Idle;
            }
            if now < next_look {
                continue;
            }
            next_look = now + step;
            if self.moved.swap(false, Ordering::Relaxed) || in_flight {
                // Something moved during the last step: quiet from no earlier than now.
                quiet_since = now;
            } else if now >= quiet_since + idle {
                return Quiet::Idle;
            }
            let Some(limit) = head else { continue };
            let done = self.heads.load(Ordering::Relaxed);
            if in_flight || !self.head.load(Ordering::Relaxed) {
                head_since = None;
                continue;
            }
            match head_since {
                // The same head as at the last look, begun no later than then.
                Some((since, n)) if n == done => {
                    if now >= since + limit {
                        return Quiet::SlowHead;
                    }
                }
                _ => head_since = Some((now, done)),
            }
        }
    }
}

/// An I/O stream that records its activity.
pub struct Watched<I> {
    inner: I,
    activity: Arc<Activity>,
    /// Bytes already read from `inner`, read again first (through hyper's `Read`).
    pre: Bytes,
    /// The first read is looked at for an HTTP/2 preface (a fresh HTTP/1.1 connection).
    sniff: bool,
    /// The sender's end of stream is held from hyper while [`Activity::holds_eof`].
    hold_eof: bool,
    /// The end of stream was read.
    eof: bool,
    /// sluice's own answer being written before the end (to an HTTP/2 preface), and
    /// how much of it is written.
    answer: Option<(Vec<u8>, usize)>,
}

impl<I> Watched<I> {
    /// Wraps `inner`, recording into `activity`.
    pub fn new(inner: I, activity: Arc<Activity>) -> Watched<I> {
        Watched {
            inner,
            activity,
            pre: Bytes::new(),
            sniff: false,
            hold_eof: false,
            eof: false,
            answer: None,
        }
    }
}

/// Whether `bytes` begin an HTTP/2 connection preface (`PRI * HTTP/2.0`).
pub(crate) fn is_h2_preface(bytes: &[u8]) -> bool {
    bytes.starts_with(b"PRI * HTTP/2")
}

/// The answer to an HTTP/2 preface on a port that speaks HTTP/1.1 only (no
/// prior-knowledge h2c): a 400, on both engines.
pub(crate) fn h2_preface_refused() -> crate::error::ProxyError {
    crate::error::ProxyError::BadRequest(
        "an HTTP/2 connection preface (h2c, prior knowledge) on a port that speaks \
         HTTP/1.1 only; HTTP/2 is offered by TLS ALPN inside intercepted CONNECT tunnels"
            .into(),
    )
}

/// `resp` (one of sluice's own answers, whole) as bytes on the wire, saying the
/// connection closes.
fn rendered(resp: Response<crate::error::Body>) -> Vec<u8> {
    use hyper::body::Body as _;
    let (parts, body) = resp.into_parts();
    let mut data = Vec::new();
    if let http_body_util::Either::Right(mut full) = body {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        while let Poll::Ready(Some(Ok(frame))) = Pin::new(&mut full).poll_frame(&mut cx) {
            if let Ok(d) = frame.into_data() {
                data.extend_from_slice(&d);
            }
        }
    }
    let status = parts.status;
    let mut out = format!(
        "HTTP/1.1 {} {}\r\n",
        status.as_str(),
        status.canonical_reason().unwrap_or("")
    )
    .into_bytes();
    for (k, v) in &parts.headers {
        out.extend_from_slice(k.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(v.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let date = httpdate::fmt_http_date(std::time::SystemTime::now());
    let tail = format!(
        "content-length: {}\r\ndate: {date}\r\nconnection: close\r\n\r\n",
        data.len()
    );
    out.extend_from_slice(tail.as_bytes());
    out.extend_from_slice(&data);
    out
}

impl<I: hyper::rt::Write + Unpin> Watched<I> {
    /// Writes [`Watched::answer`] out: ready when it is all written and flushed.
    fn poll_answer(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Some((bytes, written)) = self.answer.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        while *written < bytes.len() {
            match std::task::ready!(Pin::new(&mut self.inner).poll_write(cx, &bytes[*written..])) {
                Ok(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Ok(n) => *written += n,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        std::task::ready!(Pin::new(&mut self.inner).poll_flush(cx))?;
        self.answer = None;
        self.activity.touch();
        Poll::Ready(Ok(()))
    }
}

impl<I: hyper::rt::Read + hyper::rt::Write + Unpin> hyper::rt::Read for Watched<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let me = &mut *self;
        if me.answer.is_some() {
            // Answered: then the end, which hyper closes on.
            std::task::ready!(me.poll_answer(cx))?;
            return Poll::Ready(Ok(()));
        }
        if me.sniff {
            // The first bytes of a fresh connection, read here to be looked at, then
            // handed on as if read already.
            let mut first = [std::mem::MaybeUninit::<u8>::uninit(); 1024];
            let mut rb = hyper::rt::ReadBuf::uninit(&mut first);
            std::task::ready!(Pin::new(&mut me.inner).poll_read(cx, rb.unfilled()))?;
            me.sniff = false;
            if is_h2_preface(rb.filled()) {
                me.activity.read();
                me.answer = Some((rendered(h2_preface_refused().into_response()), 0));
                me.eof = true;
                std::task::ready!(me.poll_answer(cx))?;
                return Poll::Ready(Ok(()));
            }
            me.pre = Bytes::copy_from_slice(rb.filled());
            if me.pre.is_empty() {
                me.eof = true;
            }
        }
        if !me.pre.is_empty() {
            let n = me.pre.len().min(buf.remaining());
            buf.put_slice(&me.pre[..n]);
            bytes::Buf::advance(&mut me.pre, n);
            me.activity.read();
            return Poll::Ready(Ok(()));
        }
        if !me.eof {
            if !(me.hold_eof && me.activity.holds_eof()) {
                let r = Pin::new(&mut me.inner).poll_read(cx, buf);
                if matches!(r, Poll::Ready(Ok(()))) {
                    // An end of stream counts too: hyper then closes the connection.
                    me.activity.read();
                }
                return r;
            }
            // A bodiless request is in flight: hyper only looks for the end of stream
            // (or a pipelined head), read here to tell the one from the other.
            let mut bytes = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
            let mut rb = hyper::rt::ReadBuf::uninit(&mut bytes);
            std::task::ready!(Pin::new(&mut me.inner).poll_read(cx, rb.unfilled()))?;
            me.activity.read();
            let got = rb.filled();
            if !got.is_empty() {
                let n = got.len().min(buf.remaining());
                buf.put_slice(&got[..n]);
                me.pre = Bytes::copy_from_slice(&got[n..]);
                return Poll::Ready(Ok(()));
            }
            me.eof = true;
        }
        // The end of stream: held while a bodiless request is in flight and none waits
        // for admission, then hyper's.
        if me.hold_eof {
            let a = &me.activity;
            a.eof.held.store(true, Ordering::Relaxed);
            a.eof.waker.register(cx.waker());
            if a.holds_eof() {
                return Poll::Pending;
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<I: hyper::rt::Write + Unpin> hyper::rt::Write for Watched<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if let Some(one) = only_slice(bufs) {
            return hyper::rt::Write::poll_write(self, cx, one);
        }
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) {
            self.activity.touch();
        }
        r
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The one non-empty slice of `bufs`, when there is exactly one.
///
/// A vectored write of a single slice is better made as a plain write: on Linux a
/// `send` skips what `writev` adds on a socket (importing the iovec, the generic file
/// write checks), about 0.2 µs a call on the benchmark machine. rustls writes every
/// TLS record through `write_vectored`, and a request's or response's records are
/// nearly always one slice.
pub fn only_slice<'a>(bufs: &'a [io::IoSlice<'_>]) -> Option<&'a [u8]> {
    let mut found = None;
    for buf in bufs.iter().filter(|b| !b.is_empty()) {
        if found.is_some() {
            return None;
        }
        found = Some(&**buf);
    }
    found
}

/// A stream whose vectored writes of one slice go out as plain writes ([`only_slice`]);
/// everything else passes through. Used under the TLS sessions sluice opens upstream.
#[derive(Debug)]
pub struct SendIo<I>(pub I);

impl<I> SendIo<I> {
    /// The stream under it.
    pub fn get_ref(&self) -> &I {
        &self.0
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for SendIo<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for SendIo<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match only_slice(bufs) {
            Some(one) => Pin::new(&mut self.0).poll_write(cx, one),
            None => Pin::new(&mut self.0).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// A service that counts its requests in flight (until the response head is ready;
/// the body's bytes then count as activity, and its writing as [`Responding`]).
struct Counted<S> {
    inner: S,
    activity: Arc<Activity>,
    /// Requests carry a [`SenderEof`] (hyper's HTTP/1.1 path).
    hold_eof: bool,
}

impl<S, B> Service<Request<Incoming>> for Counted<S>
where
    S: Service<Request<Incoming>, Response = Response<B>>,
{
    type Response = Response<Responding<B>>;
    type Error = S::Error;
    type Future = CountedFuture<S::Future>;

    fn call(&self, mut req: Request<Incoming>) -> Self::Future {
        if self.hold_eof {
            use hyper::body::Body as _;
            let bodiless = req.body().is_end_stream();
            self.activity
                .eof
                .bodiless
                .store(bodiless, Ordering::Relaxed);
            req.extensions_mut()
                .insert(SenderEof(Arc::clone(&self.activity)));
        }
        let guard = InFlight::enter(Arc::clone(&self.activity));
        CountedFuture {
            inner: self.inner.call(req),
            _guard: guard,
        }
    }
}

pin_project_lite::pin_project! {
    /// A request's future that counts as in flight until it is done or dropped (not
    /// boxed: hyper keeps it in its own slot, one allocation per connection).
    pub struct CountedFuture<F> {
        #[pin]
        inner: F,
        _guard: InFlight,
    }
}

impl<F, B, E> Future for CountedFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<Responding<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let resp = std::task::ready!(this.inner.poll(cx))?;
        // Counted as being written before the request stops counting as in flight.
        let activity = Arc::clone(&this._guard.0);
        activity.responding.fetch_add(1, Ordering::Relaxed);
        Poll::Ready(Ok(resp.map(|inner| Responding {
            inner,
            _guard: Writing(activity),
        })))
    }
}

pin_project_lite::pin_project! {
    /// A response body that counts as being written until it ends or is dropped
    /// (hyper drops it at its end), so that the next request's head, read meanwhile,
    /// starts its `header_read_timeout` only then.
    pub struct Responding<B> {
        #[pin]
        inner: B,
        _guard: Writing,
    }
}

impl<B: hyper::body::Body> hyper::body::Body for Responding<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<B::Data>, B::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// One response body being written on a connection (until dropped): a head read
/// meanwhile begins when the last one ends.
pub struct Writing(Arc<Activity>);

impl Drop for Writing {
    fn drop(&mut self) {
        let a = &self.0;
        if a.responding.fetch_sub(1, Ordering::Relaxed) == 1
            && a.read_while_responding.swap(false, Ordering::Relaxed)
            && a.in_flight.load(Ordering::Relaxed) == 0
        {
            a.head.store(true, Ordering::Relaxed);
        }
        a.touch();
        a.release_eof();
    }
}

/// One request in flight on a connection (until dropped).
pub struct InFlight(Arc<Activity>);

impl InFlight {
    /// Counts a request whose head is whole as in flight on `a`'s connection.
    pub(crate) fn enter(a: Arc<Activity>) -> InFlight {
        a.in_flight.fetch_add(1, Ordering::Relaxed);
        // The head is whole: it reached the service.
        a.heads.fetch_add(1, Ordering::Relaxed);
        a.head.store(false, Ordering::Relaxed);
        a.read_while_responding.store(false, Ordering::Relaxed);
        InFlight(a)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.0.touch();
        self.0.release_eof();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a write of exactly one non-empty slice is singled out.
    #[test]
    fn only_a_single_non_empty_slice_is_singled_out() {
        let s = |parts: &[&'static [u8]]| -> Vec<io::IoSlice<'static>> {
            parts.iter().map(|p| io::IoSlice::new(p)).collect()
        };
        assert_eq!(only_slice(&s(&[])), None);
        assert_eq!(only_slice(&s(&[b""])), None);
        assert_eq!(only_slice(&s(&[b"one"])), Some(&b"one"[..]));
        assert_eq!(only_slice(&s(&[b"", b"one", b""])), Some(&b"one"[..]));
        assert_eq!(only_slice(&s(&[b"one", b"two"])), None);
    }

    /// Over a real socket, vectored writes through [`SendIo`] arrive whole and in
    /// order, whether they go out as one plain write or as a vectored one.
    #[tokio::test]
    async fn send_io_delivers_every_slice_of_a_vectored_write_in_order() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (out, accepted) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let mut out = SendIo(out.unwrap());
        let (mut inp, _) = accepted.unwrap();
        let writes: [&[&[u8]]; 4] = [&[b"a"], &[b"", b"bc", b""], &[b"de", b"f", b"g"], &[b"h"]];
        for parts in writes {
            let bufs: Vec<io::IoSlice<'_>> = parts.iter().map(|p| io::IoSlice::new(p)).collect();
            let want: usize = parts.iter().map(|p| p.len()).sum();
            assert_eq!(out.write_vectored(&bufs).await.unwrap(), want);
        }
        out.shutdown().await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), inp.read_to_end(&mut got))
            .await
            .expect("the bytes arrive")
            .unwrap();
        assert_eq!(got, b"abcdefgh");
    }

    /// Idle is declared no sooner than `limit` after the last byte and at most half a
    /// `limit` later, wherever the byte falls between two looks; a request in flight
    /// holds it off however long it takes.
    #[tokio::test(start_paused = true)]
    async fn idle_comes_between_the_limit_and_half_again_after_the_last_byte() {
        let limit = Duration::from_secs(8);
        for offset_ms in [0u64, 1, 500, 1999, 2000, 2001, 3999] {
            let a = Activity::new();
            let idle = tokio::spawn(Arc::clone(&a).idle_for(limit));
            tokio::time::sleep(Duration::from_millis(4000 + offset_ms)).await;
            a.touch();
            let last = Instant::now();
            idle.await.unwrap();
            let quiet = Instant::now() - last;
            assert!(
                quiet >= limit && quiet <= limit + limit / 2,
                "byte at +{offset_ms} ms: idle after {quiet:?}"
            );
        }
        let a = Activity::new();
        a.in_flight.fetch_add(1, Ordering::Relaxed);
        let idle = tokio::spawn(Arc::clone(&a).idle_for(limit));
        tokio::time::sleep(limit * 10).await;
        assert!(!idle.is_finished(), "idle while a request was in flight");
        a.in_flight.fetch_sub(1, Ordering::Relaxed);
        let done = Instant::now();
        idle.await.unwrap();
        assert!(Instant::now() - done >= limit - limit / 4);
    }

    /// A head begun and not finished is cut no sooner than the limit after its first
    /// byte and at most half a limit later, however its bytes trickle in; waiting for
    /// a head (no byte yet), a request in flight, and heads that each finish in time
    /// are never cut by it.
    #[tokio::test(start_paused = true)]
    async fn a_slow_head_is_cut_between_the_limit_and_half_again_after_its_first_byte() {
        let (idle, head) = (Duration::from_secs(120), Duration::from_secs(8));
        for offset_ms in [0u64, 1, 500, 1999, 2000, 2001, 3999] {
            let a = Activity::new();
            let watch = tokio::spawn(Arc::clone(&a).watch(idle, Some(head)));
            // Long before the head: nothing but waiting, which is idle's business.
            tokio::time::sleep(Duration::from_millis(60_000 + offset_ms)).await;
            assert!(!watch.is_finished(), "cut while waiting for a head");
            let first = Instant::now();
            let trickle = tokio::spawn({
                let a = Arc::clone(&a);
                async move {
                    loop {
                        a.read();
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                }
            });
            assert_eq!(watch.await.unwrap(), Quiet::SlowHead);
            trickle.abort();
            let took = Instant::now() - first;
            assert!(
                took >= head && took <= head + head / 2,
                "first byte at +{offset_ms} ms: cut after {took:?}"
            );
        }
        // Heads that each finish within the limit, back to back for ten limits, and a
        // request in flight for ten more: never cut.
        let a = Activity::new();
        let watch = tokio::spawn(Arc::clone(&a).watch(idle, Some(head)));
        for _ in 0..40 {
            a.read();
            tokio::time::sleep(head / 2).await;
            drop(InFlight::enter(Arc::clone(&a)));
            tokio::time::sleep(head / 4).await;
        }
        let held = InFlight::enter(Arc::clone(&a));
        a.read();
        tokio::time::sleep(head * 10).await;
        assert!(
            !watch.is_finished(),
            "cut though every head finished in time"
        );
        drop(held);
        assert_eq!(watch.await.unwrap(), Quiet::Idle);
    }
}
