//! The way out: the pooled upstream client (plain HTTP and rustls HTTPS), hop-by-hop
//! header hygiene, and byte tunnels for CONNECT.
//!
//! The client resolves names through [`GuardedResolver`], which applies the destination
//! policy to the addresses DNS returns and hands the connector only those, so sluice
//! connects to exactly what it checked.
//!
//! A sender connection that sends to one destination again and again gets its own
//! kept-alive upstream connection ([`Affinity`]): its requests skip the shared pool's
//! locking and task hand-offs, which is most of a proxy hop's CPU. Everything else (a
//! sender rotating between destinations, concurrent HTTP/2 streams) uses the pool.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::header::HOST;
use http::header::{
    CONNECTION, CONTENT_LENGTH, HeaderName, PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, TE, TRAILER,
    TRANSFER_ENCODING, UPGRADE,
};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, HeaderValue, Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::connect::dns::Name;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpStream;
use tokio::time::Sleep;

use crate::conn::{Activity, SendIo, Watched};
use crate::destination::{DestinationPolicy, ResolveError, normalise_host};
use crate::upload::{self, Stalled, Upload};

/// Why forwarding failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ForwardError {
    /// The destination policy refused the resolved address.
    #[error("{0}")]
    Denied(crate::destination::Denied),
    /// TCP connect or DNS failed.
    #[error("cannot connect upstream: {0}")]
    Connect(String),
    /// The upstream TLS handshake failed (certificate, name, protocol).
    #[error("upstream TLS failed: {0}")]
    Tls(String),
    /// The upstream took none of the request body, or gave no response head, for
    /// `upstream_timeout` ([`crate::upload`]).
    #[error("upstream did not answer within {0:?}")]
    Timeout(Duration),
    /// The sender stopped sending its request body (none of it for `upstream_timeout`,
    /// or under the average [`crate::upload::MIN_UPLOAD_RATE`] allows): the
    /// sender's fault, not the upstream's; no whole request reached the upstream.
    #[error(
        "the sender stopped sending its request body (none of it for {0:?}, or under {rate} bytes/s on average past that)",
        rate = crate::upload::MIN_UPLOAD_RATE
    )]
    SenderStalled(Duration),
    /// The sender's request body was malformed or cut short (bad chunked framing, fewer
    /// bytes than its `Content-Length`): the sender's fault, not the upstream's.
    #[error("the request body from the sender was malformed or incomplete: {0}")]
    SenderBody(String),
    /// The connection failed after the request was sent.
    #[error("upstream connection failed: {0}")]
    Other(String),
}

/// Resolves through the destination policy (shared, swappable on reload).
#[derive(Clone)]
pub struct GuardedResolver {
    policy: Arc<ArcSwap<DestinationPolicy>>,
}

impl tower_service::Service<Name> for GuardedResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = ResolveError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ResolveError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), ResolveError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let policy = self.policy.load_full();
        // The host as the lane resolves it (one trailing dot removed, an IPv4 address in
        // any spelling as itself): both paths reach the same address or refusal.
        let host = normalise_host(name.as_str()).unwrap_or_else(|_| name.as_str().to_owned());
        Box::pin(async move { policy.resolve(&host, 0).await.map(Vec::into_iter) })
    }
}

type Connector = HttpsConnector<HttpConnector<GuardedResolver>>;

type Pool = Client<Connector, Upload>;

/// The pooled upstream client.
pub struct Forwarder {
    client: ArcSwap<Pool>,
    /// Opens the connections [`Affinity`] holds (same resolver, TLS and timeouts as the pool).
    connector: Connector,
    /// Bumped when the destination policy changes: held connections of an older
    /// generation were checked against the old policy and are not reused.
    generation: AtomicU64,
    tls: rustls::ClientConfig,
    /// The same TLS settings offering `http/1.1` by ALPN, for the plain lane's own
    /// connections ([`Forwarder::tls_handshake`]).
    lane_tls: tokio_rustls::TlsConnector,
    timeout: Duration,
    policy: Arc<ArcSwap<DestinationPolicy>>,
}

/// Which upstream connections can carry a request: same scheme, same authority.
#[derive(Clone, Eq, Debug)]
struct Key {
    https: bool,
    authority: Authority,
}

impl PartialEq for Key {
    /// Authorities compare without regard to case; the same bytes (a sender repeating
    /// itself, the common case) are seen equal without lowering each one.
    fn eq(&self, other: &Key) -> bool {
        self.https == other.https
            && (self.authority.as_str() == other.authority.as_str()
                || self.authority == other.authority)
    }
}

impl Key {
    fn of(uri: &Uri) -> Option<Key> {
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return None,
        };
        Some(Key {
            https,
            authority: uri.authority()?.clone(),
        })
    }

    /// A copy that shares no bytes with the request it came from. A key parsed from a
    /// request points into the sender connection's read buffer; kept across requests,
    /// it would keep that buffer shared, and hyper would allocate a new 8 KB one for
    /// every request instead of reusing it.
    fn owned(&self) -> Key {
        Key {
            https: self.https,
            authority: Authority::try_from(self.authority.as_str())
                .unwrap_or_else(|_| self.authority.clone()),
        }
    }
}

/// A sender connection's own upstream connection, opened when the connection sends to
/// the same destination twice in a row and kept while it keeps doing so; and the timer
/// that bounds the wait for its responses.
#[derive(Default)]
pub struct Affinity {
    held: Mutex<Held>,
    deadline: Deadline,
}

#[derive(Default)]
enum Held {
    /// Nothing held; the destination of the last request (sent through the pool).
    #[default]
    Nothing,
    Last(Key),
    /// A request is using the held connection (concurrent ones use the pool).
    Busy,
    /// A connection waits for the next request; `last` is the last request's destination.
    Idle {
        key: Key,
        generation: u64,
        sender: SendRequest<Upload>,
        /// The `Host` its requests carry (made once per connection, not per request).
        host: HeaderValue,
        last: Key,
    },
}

/// What one request does with its connection's [`Affinity`].
enum Plan {
    Pool,
    /// The held connection, its `Host`, and its (owned) key to keep it under again.
    Reuse(SendRequest<Upload>, HeaderValue, Key),
    Open,
}

impl Affinity {
    fn plan(&self, key: &Key, generation: u64) -> Plan {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        // The common case first, looked at in place: the held connection, ready, for
        // this destination.
        let reuse = matches!(&*held, Held::Idle { key: k, generation: g, sender, .. }
            if *g == generation && k == key && sender.is_ready());
        if reuse {
            if let Held::Idle {
                sender, host, key, ..
            } = std::mem::replace(&mut *held, Held::Busy)
            {
                return Plan::Reuse(sender, host, key);
            }
        }
        let (plan, next) = match std::mem::take(&mut *held) {
            Held::Busy => (Plan::Pool, Held::Busy),
            Held::Nothing => (Plan::Pool, Held::Last(key.owned())),
            Held::Last(last) if &last == key => (Plan::Open, Held::Busy),
            Held::Last(_) => (Plan::Pool, Held::Last(key.owned())),
            Held::Idle {
                key: k,
                generation: g,
                sender,
                host,
                last,
            } => {
                if &k == key && g == generation && sender.is_ready() {
                    (Plan::Reuse(sender, host, k), Held::Busy)
                } else if &k == key && g == generation && !sender.is_closed() {
                    // Still busy with an earlier response (HTTP/2 streams in a tunnel).
                    let idle = Held::Idle {
                        key: k,
                        generation: g,
                        sender,
                        host,
                        last,
                    };
                    (Plan::Pool, idle)
                } else if &k == key || &last == key {
                    // Closed, from an older policy, or the sender moved on: replace it.
                    (Plan::Open, Held::Busy)
                } else {
                    let idle = Held::Idle {
                        key: k,
                        generation: g,
                        sender,
                        host,
                        last: key.owned(),
                    };
                    (Plan::Pool, idle)
                }
            }
        };
        *held = next;
        plan
    }

    /// Holds `sender` for `key`, which must be owned (see [`Key::owned`]).
    fn keep(&self, key: Key, generation: u64, sender: SendRequest<Upload>, host: HeaderValue) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        *held = Held::Idle {
            last: key.clone(),
            key,
            generation,
            sender,
            host,
        };
    }

    fn clear(&self) {
        *self.held.lock().unwrap_or_else(|e| e.into_inner()) = Held::Nothing;
    }
}

/// The upstream timeout of one sender connection's held sends: one timer, taken by a
/// request and set again for the next, instead of a timer registered with the runtime
/// and removed again for every request. Setting a registered timer later only moves
/// its deadline (tokio extends it in place), so a request costs no timer-wheel work
/// unless the timer fired. A request that finds the timer taken (concurrent HTTP/2
/// streams in a tunnel) makes its own.
#[derive(Default)]
struct Deadline(Mutex<Option<Pin<Box<Sleep>>>>);

impl Deadline {
    /// The timer, set to fire `limit` from now, for one request.
    fn lend(&self, limit: Duration) -> Lent<'_> {
        let taken = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        let sleep = match taken {
            Some(mut sleep) => {
                sleep.as_mut().reset(tokio::time::Instant::now() + limit);
                sleep
            }
            None => Box::pin(tokio::time::sleep(limit)),
        };
        Lent {
            home: &self.0,
            sleep: Some(sleep),
        }
    }
}

pin_project_lite::pin_project! {
    /// `f`, or who the request waits on once it stopped moving for `limit`
    /// ([`upload::within`]'s rule, on a [`Deadline`]'s timer).
    struct Within<'a, 'p, F> {
        #[pin]
        f: F,
        timer: Lent<'a>,
        progress: Option<&'p upload::Progress>,
        limit: Duration,
    }
}

impl<F: Future> Future for Within<'_, '_, F> {
    type Output = Result<F::Output, Stalled>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let me = self.project();
        if let Poll::Ready(out) = me.f.poll(cx) {
            return Poll::Ready(Ok(out));
        }
        let Some(sleep) = me.timer.sleep.as_mut() else {
            return Poll::Ready(Err(Stalled::Upstream));
        };
        // Set again while the body moves; each setting is polled, so it wakes us.
        while sleep.as_mut().poll(cx).is_ready() {
            if let Some(stalled) = upload::fired(sleep.as_mut(), *me.progress, *me.limit) {
                return Poll::Ready(Err(stalled));
            }
        }
        Poll::Pending
    }
}

/// A [`Deadline`]'s timer while a request has it: given back when the request ends
/// (or is dropped), unless another request made one meanwhile.
struct Lent<'a> {
    home: &'a Mutex<Option<Pin<Box<Sleep>>>>,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        let mut home = self.home.lock().unwrap_or_else(|e| e.into_inner());
        if home.is_none() {
            *home = self.sleep.take();
        }
    }
}

impl Forwarder {
    /// Builds the client once, at start-up.
    pub fn new(
        tls: rustls::ClientConfig,
        timeout: Duration,
        policy: Arc<ArcSwap<DestinationPolicy>>,
    ) -> Forwarder {
        // The connector negotiates ALPN itself (http/1.1 only) and refuses presets.
        let mut tls = tls;
        tls.alpn_protocols.clear();
        let client = ArcSwap::from_pointee(pool(&tls, timeout, &policy));
        let mut lane_tls = tls.clone();
        lane_tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        Forwarder {
            client,
            connector: connector(&tls, timeout, &policy),
            generation: AtomicU64::new(0),
            lane_tls: tokio_rustls::TlsConnector::from(Arc::new(lane_tls)),
            tls,
            timeout,
            policy,
        }
    }

    /// Swaps the destination policy (live reload). Pooled upstream connections were
    /// checked against the old policy, so the pool starts over: no kept-alive connection
    /// can carry a request to an address the new policy refuses. Requests in flight
    /// finish on their connections.
    pub fn set_policy(&self, policy: DestinationPolicy) {
        self.policy.store(Arc::new(policy));
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.client
            .store(Arc::new(pool(&self.tls, self.timeout, &self.policy)));
    }

    /// How long a request may wait for its response head (`upstream_timeout`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Bumped by every destination policy change: a connection opened under an older
    /// one is not reused.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Runs the TLS handshake for `host` on `tcp` (opened by
    /// [`Forwarder::connect_tunnel`]), offering only HTTP/1.1, within the upstream
    /// timeout; certificate and handshake failures are [`ForwardError::Tls`], as on the
    /// pooled client.
    pub(crate) async fn tls_handshake(
        &self,
        host: &str,
        tcp: TcpStream,
    ) -> Result<tokio_rustls::client::TlsStream<SendIo<TcpStream>>, ForwardError> {
        let name = rustls::pki_types::ServerName::try_from(host.to_owned())
            .map_err(|e| ForwardError::Connect(format!("{host}: {e}")))?;
        let tcp = SendIo(tcp);
        match tokio::time::timeout(self.timeout, self.lane_tls.connect(name, tcp)).await {
            Ok(Ok(tls)) => Ok(tls),
            Ok(Err(e)) => Err(classify(&e, true)),
            Err(_) => Err(ForwardError::Timeout(self.timeout)),
        }
    }

    /// The destination policy in force.
    pub fn policy(&self) -> Arc<DestinationPolicy> {
        self.policy.load_full()
    }

    /// Sends a prepared request (absolute URI, hop-by-hop headers and the sender's
    /// `Host` removed: the pool sets it from the URI) and waits for the response head;
    /// the body streams afterwards.
    pub async fn send(&self, req: Request<Upload>) -> Result<Response<Incoming>, ForwardError> {
        let client = self.client.load();
        let progress = req.body().progress();
        let timer = std::pin::pin!(tokio::time::sleep(self.timeout));
        let sending = client.request(req);
        match upload::within(timer, progress.as_deref(), self.timeout, sending).await {
            Err(stalled) => Err(self.stalled(stalled)),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(classify(&e, e.is_connect())),
        }
    }

    /// The error for a request that stopped moving ([`crate::upload`]).
    fn stalled(&self, stalled: Stalled) -> ForwardError {
        match stalled {
            Stalled::Sender => ForwardError::SenderStalled(self.timeout),
            Stalled::Upstream => ForwardError::Timeout(self.timeout),
        }
    }

    /// Sends like [`Forwarder::send`], on the sender connection's own upstream
    /// connection when it has one for this destination (see [`Affinity`]). The request
    /// may still carry the sender's `Host`: it is replaced by the target's.
    pub async fn send_via(
        &self,
        affinity: &Affinity,
        mut req: Request<Upload>,
    ) -> Result<Response<Incoming>, ForwardError> {
        frame_body_of_unknown_length(&mut req);
        let Some(key) = Key::of(req.uri()) else {
            req.headers_mut().remove(HOST);
            return self.send(req).await;
        };
        let generation = self.generation.load(Ordering::SeqCst);
        let (sender, kept) = match affinity.plan(&key, generation) {
            Plan::Pool => {
                req.headers_mut().insert(HOST, host_of(&key)?);
                let pooled = Box::pin(self.send(req));
                return pooled.await;
            }
            Plan::Reuse(sender, host, kept) => (Some((sender, host)), kept),
            Plan::Open => (None, key.owned()),
        };
        // Pinned where it is made, and only referred to by the small `Within`: moved
        // into a wrapper instead, this large future is copied twice per request.
        let progress = req.body().progress();
        let held = std::pin::pin!(self.send_held(&key, sender, req));
        let timed = Within {
            f: held,
            timer: affinity.deadline.lend(self.timeout),
            progress: progress.as_deref(),
            limit: self.timeout,
        }
        .await;
        match timed {
            Ok(Ok((resp, sender, host))) => {
                affinity.keep(kept, generation, sender, host);
                Ok(resp)
            }
            Ok(Err(e)) => {
                affinity.clear();
                Err(e)
            }
            Err(stalled) => {
                affinity.clear();
                Err(self.stalled(stalled))
            }
        }
    }

    /// Sends on `sender`, or on a new connection when there is none or the upstream
    /// closed the idle one before the request left (then it is sent once, afresh).
    async fn send_held(
        &self,
        key: &Key,
        held: Option<(SendRequest<Upload>, HeaderValue)>,
        req: Request<Upload>,
    ) -> Result<(Response<Incoming>, SendRequest<Upload>, HeaderValue), ForwardError> {
        let (sender, host) = match held {
            Some((sender, host)) => (Some(sender), host),
            None => (None, host_of(key)?),
        };
        let req = origin_form(req, host.clone());
        let (mut sender, req) = match sender {
            Some(mut sender) => match sender.try_send_request(req).await {
                Ok(resp) => return Ok((resp, sender, host)),
                Err(mut e) => match e.take_message() {
                    // Never written: the kept-alive connection had closed.
                    Some(req) => {
                        let opening = Box::pin(self.open(key));
                        (opening.await?, req)
                    }
                    None => return Err(classify(e.error(), false)),
                },
            },
            None => {
                let opening = Box::pin(self.open(key));
                (opening.await?, req)
            }
        };
        match sender.send_request(req).await {
            Ok(resp) => Ok((resp, sender, host)),
            Err(e) => Err(classify(&e, false)),
        }
    }

    /// Opens a connection to `key` through the guarded connector, and runs it.
    async fn open(&self, key: &Key) -> Result<SendRequest<Upload>, ForwardError> {
        use tower_service::Service;
        let uri = Uri::builder()
            .scheme(if key.https {
                Scheme::HTTPS
            } else {
                Scheme::HTTP
            })
            .authority(key.authority.clone())
            .path_and_query("/")
            .build()
            .map_err(|e| ForwardError::Connect(e.to_string()))?;
        let mut connector = self.connector.clone();
        std::future::poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(|e| classify(&*e, true))?;
        let io = connector.call(uri).await.map_err(|e| classify(&*e, true))?;
        // Flat writes on plain TCP, hyper's default under TLS (see `conn::Writes`).
        let mut builder = hyper::client::conn::http1::Builder::new();
        if !key.https {
            builder.writev(false);
        }
        let (sender, conn) = builder
            .handshake(io)
            .await
            .map_err(|e| classify(&e, true))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream connection ended");
            }
        });
        Ok(sender)
    }

    /// Resolves `host:port` through the destination policy: the addresses that passed.
    pub async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, ForwardError> {
        self.policy()
            .resolve(host, port)
            .await
            .map_err(|e| match e {
                ResolveError::Denied(d) => ForwardError::Denied(d),
                ResolveError::Dns(m) => ForwardError::Connect(m),
            })
    }

    /// Opens a TCP connection for a CONNECT tunnel to the first of `addrs` (which passed
    /// the policy in [`Forwarder::resolve`]) that answers.
    pub async fn connect_tunnel(&self, addrs: Vec<SocketAddr>) -> Result<TcpStream, ForwardError> {
        let mut last = String::from("no address");
        for addr in addrs {
            match tokio::time::timeout(self.timeout, TcpStream::connect(addr)).await {
                Ok(Ok(s)) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Ok(Err(e)) => last = format!("{addr}: {e}"),
                Err(_) => return Err(ForwardError::Timeout(self.timeout)),
            }
        }
        Err(ForwardError::Connect(last))
    }
}

/// The `Host` a connection of its own sends (the pool sets it itself): the target's
/// authority, its port only when not the scheme's default.
fn host_of(key: &Key) -> Result<HeaderValue, ForwardError> {
    let host = match (key.authority.port_u16(), key.https) {
        (Some(443), true) | (Some(80), false) | (None, _) => key.authority.host().to_owned(),
        (Some(port), _) => format!("{}:{port}", key.authority.host()),
    };
    HeaderValue::from_str(&host).map_err(|e| ForwardError::Other(e.to_string()))
}

/// A request as a connection of its own sends it: `host` (from [`host_of`]) and an
/// origin-form request line.
fn origin_form<B>(mut req: Request<B>, host: HeaderValue) -> Request<B> {
    // In place: taking the request apart and back together copies it twice.
    req.headers_mut().insert(HOST, host);
    let path = req
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    *req.uri_mut() = Uri::from(path);
    req
}

/// The connector the pool and [`Affinity`] connections use: names resolve through
/// `policy`.
fn connector(
    tls: &rustls::ClientConfig,
    timeout: Duration,
    policy: &Arc<ArcSwap<DestinationPolicy>>,
) -> Connector {
    let mut http = HttpConnector::new_with_resolver(GuardedResolver {
        policy: Arc::clone(policy),
    });
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(timeout));
    hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls.clone())
        .https_or_http()
        .enable_http1()
        .wrap_connector(http)
}

/// A fresh pool whose connector resolves through `policy`.
fn pool(
    tls: &rustls::ClientConfig,
    timeout: Duration,
    policy: &Arc<ArcSwap<DestinationPolicy>>,
) -> Pool {
    let https = connector(tls, timeout, policy);
    Client::builder(TokioExecutor::new())
        // The idle timeout needs a timer to act on its own (hyper-util): without one,
        // an idle connection went only when its destination was asked for again.
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(256)
        .build(https)
}

fn classify(e: &(dyn std::error::Error + 'static), connecting: bool) -> ForwardError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = src {
        if let Some(ResolveError::Denied(d)) = s.downcast_ref::<ResolveError>() {
            return ForwardError::Denied(d.clone());
        }
        if let Some(ResolveError::Dns(m)) = s.downcast_ref::<ResolveError>() {
            return ForwardError::Connect(m.clone());
        }
        src = s.source();
    }
    if let Some(fault) = sender_body_fault(e) {
        return ForwardError::SenderBody(error_chain(fault));
    }
    if crate::tls::upstream::find_rustls(e).is_some() {
        let reason = crate::tls::upstream::describe_failure(e);
        tracing::warn!(%reason, "upstream TLS handshake failed");
        return ForwardError::Tls(reason);
    }
    let text = error_chain(e);
    if connecting {
        ForwardError::Connect(text)
    } else {
        ForwardError::Other(text)
    }
}

/// The sender's body error inside a send failure: hyper reports a failing request body
/// as a user error ("error from user's Body stream") whose source is the error reading
/// that body from the sender's connection.
fn sender_body_fault<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a (dyn std::error::Error + 'static)> {
    let mut src: Option<&'a (dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = src {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            let inner = std::error::Error::source(h)?;
            return (h.is_user() && inner.downcast_ref::<hyper::Error>().is_some())
                .then_some(inner);
        }
        src = s.source();
    }
    None
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut src = e.source();
    while let Some(s) = src {
        parts.push(s.to_string());
        src = s.source();
    }
    parts.join(": ")
}

/// Removes hop-by-hop headers (RFC 9110 §7.6.1), the headers `Connection` names, and
/// `Proxy-*` credentials: none of them may cross a proxy.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    strip_hop_by_hop_and(h, &[]);
}

/// [`strip_hop_by_hop`], and the headers `also` names (at most 32), in the same pass.
pub fn strip_hop_by_hop_and(h: &mut HeaderMap, also: &[&HeaderName]) {
    // One pass over the names present marks which listed names occur (usually one or
    // two); only those are removed. Cheaper than a removal, each hashing its name, for
    // every name that could be there, and nothing is allocated.
    debug_assert!(HOP_BY_HOP.len() + also.len() <= 64);
    let mut present = 0u64;
    for k in h.keys() {
        let name = k.as_str();
        if let Some(i) = hop_by_hop_index(name) {
            present |= 1 << i;
        } else if let Some(i) = also.iter().position(|n| n.as_str() == name) {
            present |= 1 << (HOP_BY_HOP.len() + i);
        }
    }
    if present == 0 {
        return;
    }
    // Names listed in `Connection` go too (rare: read only when it is there).
    if present & 1 != 0 {
        let named: Vec<HeaderName> = h
            .get_all(CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|s| s.split(','))
            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
            .collect();
        for n in named {
            h.remove(n);
        }
    }
    while present != 0 {
        let i = present.trailing_zeros() as usize;
        present &= present - 1;
        match HOP_BY_HOP.get(i) {
            Some(n) => h.remove(n),
            None => h.remove(also[i - HOP_BY_HOP.len()]),
        };
    }
}

/// Checks a request's transfer codings: none, or a lone `chunked` (in any case), is
/// what sluice forwards. Any other coding (`gzip, chunked`) is the `Err` naming the
/// codings: hyper decodes the chunked framing only, and the coding under it, dropped
/// as hop-by-hop, would reach the receiver as a body it cannot read (RFC 9112 §6.1:
/// a server answers 501 for a coding it does not understand).
pub(crate) fn forwardable_codings(h: &HeaderMap) -> Result<(), String> {
    let mut codings = h
        .get_all(TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|c| !c.is_empty());
    match (codings.next(), codings.next()) {
        (None, _) => Ok(()),
        (Some(c), None) if c.eq_ignore_ascii_case(b"chunked") => Ok(()),
        _ => {
            let all: Vec<String> = h
                .get_all(TRANSFER_ENCODING)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .collect();
            Err(format!(
                "Transfer-Encoding: {}; sluice forwards chunked alone",
                all.join(", ")
            ))
        }
    }
}

/// hyper's client sends a GET or HEAD whose body has no known length without that body
/// (such methods "almost never have bodies"): a sender's chunked body on one is framed
/// `chunked` here, so it reaches the receiver as Squid forwards it.
fn frame_body_of_unknown_length(req: &mut Request<Upload>) {
    use hyper::body::Body as _;
    let body = req.body();
    let unknown = !body.is_end_stream() && body.size_hint().exact().is_none();
    let dropped = matches!(*req.method(), http::Method::GET | http::Method::HEAD);
    if unknown && dropped && !req.headers().contains_key(CONTENT_LENGTH) {
        req.headers_mut()
            .insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
    }
}

/// A `Content-Length` value: ASCII digits only, no sign, no list, at most 18 of them.
pub(crate) fn content_length(v: &[u8]) -> Option<u64> {
    if v.is_empty() || v.len() > 18 || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(v).ok()?.parse().ok()
}

/// A response's `Content-Length` value: one length, or a list of equal ones (RFC 9110
/// §8.6 lets a recipient take `2, 2` as 2, as hyper's client does; both paths read it so).
pub(crate) fn content_length_list(v: &[u8]) -> Option<u64> {
    let mut lengths = v
        .split(|b| *b == b',')
        .map(|n| content_length(n.trim_ascii()));
    let first = lengths.next()??;
    lengths.all(|n| n == Some(first)).then_some(first)
}

/// Where `name` is in [`HOP_BY_HOP`]: a `match` on the text, half the instructions of
/// comparing `HeaderName`s one by one.
pub(crate) fn hop_by_hop_index(name: &str) -> Option<usize> {
    Some(match name {
        "connection" => 0,
        "te" => 1,
        "trailer" => 2,
        "transfer-encoding" => 3,
        "upgrade" => 4,
        "proxy-authorization" => 5,
        "proxy-authenticate" => 6,
        "keep-alive" => 7,
        "proxy-connection" => 8,
        _ => return None,
    })
}

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Headers that never cross a proxy (RFC 9110 §7.6.1, and `Proxy-*` credentials);
/// `Connection` first.
static HOP_BY_HOP: [HeaderName; 9] = [
    CONNECTION,
    TE,
    TRAILER,
    TRANSFER_ENCODING,
    UPGRADE,
    PROXY_AUTHORIZATION,
    PROXY_AUTHENTICATE,
    KEEP_ALIVE,
    PROXY_CONNECTION,
];

/// Removes `X-Sluice-*` headers from an upstream response: only sluice's own answers
/// carry them, so a receiver cannot forge a refusal a sender would requeue on.
pub fn strip_sluice_headers(h: &mut HeaderMap) {
    let forged: Vec<HeaderName> = h
        .keys()
        .filter(|k| k.as_str().starts_with("x-sluice-"))
        .cloned()
        .collect();
    for k in forged {
        h.remove(k);
    }
}

/// Copies bytes both ways between a sender's upgraded CONNECT and the upstream socket,
/// until either side closes or no byte moved either way for `idle`.
pub async fn tunnel<C>(client: C, upstream: TcpStream, idle: Duration) -> std::io::Result<()>
where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let activity = Activity::new();
    let mut client = Watched::new(client, Arc::clone(&activity));
    let mut upstream = Watched::new(upstream, Arc::clone(&activity));
    tokio::select! {
        r = tokio::io::copy_bidirectional(&mut client, &mut upstream) => r.map(|_| ()),
        // Nobody spoke for `idle`: a forgotten tunnel must not hold a connection slot.
        _ = activity.idle_for(idle) => {
            tracing::debug!(idle_ms = idle.as_millis() as u64, "closing idle tunnel");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No transfer coding, or a lone `chunked` in any case, is forwarded; any other
    /// list is refused, naming what came.
    #[test]
    fn only_a_lone_chunked_coding_is_forwardable() {
        let with = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(TRANSFER_ENCODING, HeaderValue::from_str(v).unwrap());
            }
            forwardable_codings(&h)
        };
        assert!(with(&[]).is_ok());
        assert!(with(&["chunked"]).is_ok());
        assert!(with(&[" CHUNKED "]).is_ok());
        for bad in [
            &["gzip, chunked"][..],
            &["gzip", "chunked"],
            &["chunked, chunked"],
            &["x-custom,chunked"],
        ] {
            let e = with(bad).unwrap_err();
            assert!(e.contains(bad[0]), "{bad:?}: {e}");
        }
    }

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, x-secret"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
            ("te", "trailers"),
            ("trailer", "x"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("proxy-authorization", "Basic eA=="),
            ("proxy-authenticate", "Basic"),
            ("x-secret", "1"),
            ("x-keep", "1"),
        ] {
            h.append(k, v.parse().unwrap());
        }
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-keep"));
    }

    #[test]
    fn the_hop_by_hop_index_matches_the_list() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop_index(name.as_str()), Some(i), "{name}");
        }
        assert_eq!(hop_by_hop_index("host"), None);
    }

    #[test]
    fn listed_headers_go_with_the_hop_by_hop_ones() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("host", "sender.example"),
            ("x-endpoint-id", "a"),
            ("te", "trailers"),
            ("x-keep", "1"),
        ] {
            h.append(k, v.parse().unwrap());
        }
        h.append("x-endpoint-id", "b".parse().unwrap());
        let id = HeaderName::from_static("x-endpoint-id");
        let absent = HeaderName::from_static("x-sluice-sender");
        strip_hop_by_hop_and(&mut h, &[&id, &absent, &HOST]);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-keep"));
        // Nothing listed present: nothing changes.
        strip_hop_by_hop_and(&mut h, &[&id]);
        assert_eq!(h.len(), 1);
    }

    fn key(uri: &str) -> Key {
        Key::of(&uri.parse().unwrap()).unwrap()
    }

    #[test]
    fn held_connections_send_origin_form_with_host_from_the_target() {
        for (target, host, path) in [
            ("http://a.example/x?y=1", "a.example", "/x?y=1"),
            ("http://a.example:80/", "a.example", "/"),
            ("http://a.example:8080/p", "a.example:8080", "/p"),
            ("https://a.example:443/p", "a.example", "/p"),
            ("https://a.example:80/p", "a.example:80", "/p"),
            ("http://[::1]:9000/v6", "[::1]:9000", "/v6"),
        ] {
            let mut req = Request::new(());
            *req.uri_mut() = target.parse().unwrap();
            req.headers_mut().insert(HOST, "forged".parse().unwrap());
            let req = origin_form(req, host_of(&key(target)).unwrap());
            assert_eq!(req.headers()[HOST], host, "{target}");
            assert_eq!(req.uri().to_string(), path, "{target}");
        }
        assert!(Key::of(&"/relative".parse().unwrap()).is_none());
        assert!(Key::of(&"ftp://a.example/".parse().unwrap()).is_none());
    }

    #[test]
    fn keys_match_by_scheme_and_authority_whatever_its_case() {
        assert!(key("http://a.example:81/x") == key("http://a.example:81/y"));
        assert!(key("http://A.Example:81/") == key("http://a.example:81/"));
        assert!(key("http://a.example:81/") != key("https://a.example:81/"));
        assert!(key("http://a.example:81/") != key("http://a.example:82/"));
        assert!(key("http://a.example/") != key("http://b.example/"));
    }

    /// A real connection to a listener that accepts and does nothing: enough for hyper
    /// to hand out a `SendRequest` that is ready.
    async fn ready_sender() -> (SendRequest<Upload>, tokio::net::TcpListener) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let s = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(s))
                .await
                .unwrap();
        tokio::spawn(conn);
        sender.ready().await.unwrap();
        (sender, listener)
    }

    #[tokio::test]
    async fn a_connection_is_held_from_the_second_request_to_one_destination() {
        let (a, b) = (key("http://a.example/"), key("http://b.example/"));
        let aff = Affinity::default();
        // First request to a destination: the pool.
        assert!(matches!(aff.plan(&a, 0), Plan::Pool));
        // Second in a row: open one of its own.
        assert!(matches!(aff.plan(&a, 0), Plan::Open));
        // While it is in use, concurrent requests go to the pool.
        assert!(matches!(aff.plan(&a, 0), Plan::Pool));
        let (sender, _l) = ready_sender().await;
        aff.keep(a.clone(), 0, sender, HeaderValue::from_static("a.example"));
        let Plan::Reuse(sender, host, _) = aff.plan(&a, 0) else {
            panic!("the held connection is reused")
        };
        assert_eq!(host, "a.example");
        aff.keep(a.clone(), 0, sender, host);
        // One request elsewhere goes to the pool and keeps the held connection...
        assert!(matches!(aff.plan(&b, 0), Plan::Pool));
        let Plan::Reuse(sender, host, _) = aff.plan(&a, 0) else {
            panic!("still held after one request elsewhere")
        };
        aff.keep(a.clone(), 0, sender, host);
        // ...two in a row replace it.
        assert!(matches!(aff.plan(&b, 0), Plan::Pool));
        assert!(matches!(aff.plan(&b, 0), Plan::Open));
    }

    /// A key kept across requests owns its bytes: one pointing into a request would
    /// keep the sender connection's read buffer shared, and hyper would allocate a new
    /// one for every request.
    #[test]
    fn kept_keys_share_no_bytes_with_the_request() {
        let uri: Uri = "http://a.example:8080/x".parse().unwrap();
        let from_request = Key::of(&uri).unwrap();
        let kept = from_request.owned();
        assert_eq!(kept, from_request);
        let span = |k: &Key| {
            let p = k.authority.as_str().as_ptr() as usize;
            p..p + k.authority.as_str().len()
        };
        let (a, b) = (span(&from_request), span(&kept));
        assert!(
            b.end <= a.start || a.end <= b.start,
            "{a:?} and {b:?} overlap"
        );
    }

    #[tokio::test]
    async fn a_policy_change_retires_held_connections() {
        let a = key("http://a.example/");
        let aff = Affinity::default();
        let (sender, _l) = ready_sender().await;
        aff.keep(a.clone(), 0, sender, HeaderValue::from_static("a.example"));
        // Generation 1: checked against an older policy, so never reused.
        assert!(matches!(aff.plan(&a, 1), Plan::Open));
    }

    #[test]
    fn forged_sluice_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert("x-sluice-reason", "rate_limited".parse().unwrap());
        h.insert("X-Sluice-Anything", "1".parse().unwrap());
        h.insert("x-sluicey", "kept".parse().unwrap());
        strip_sluice_headers(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
    }
}
