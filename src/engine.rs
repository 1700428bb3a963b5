//! Which engine serves a sender's bytes, and CONNECT. A sender connection is served by
//! the plain lane ([`crate::lane`], HTTP/1.1, the default) or by hyper ([`handle`],
//! every request the lane hands over, and HTTP/2); a CONNECT is admitted and opened
//! here ([`connect`]), and its tunnel's first bytes decide what serves it: TLS to
//! interception ([`Intercepted`]) or a relay, plain HTTP/1.x request by request by the
//! same engines (`serve_inside`), anything else relayed. Each request either engine
//! reads goes through [`crate::proxy`]'s one admission, send and observe; nothing
//! below this room calls back up into it (the lane gets [`handle_boxed`] as a
//! function to hand requests to hyper).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, Method, Request, Response, Version};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::conn::{ConnSlot, Timeouts, Writes};
use crate::core::App;
use crate::decision::{self, Trace};
use crate::error::{Body, ProxyError};
use crate::metrics::{EndpointLabels, InterceptLabels};
use crate::proxy::{
    Admitted, Asking, Conn, Handler, LastEndpoint, PREPAID_FOR, Refused, Target, Tunnel, Who,
    admission, after_admission, forward_request, identify, refund, refuse, revoked,
};
use crate::sniff::Opening;

/// Serves one sender connection: in the lane when `lane` (`SLUICE_PLAIN_LANE` is not
/// `0`), which hands hyper whatever it does not serve itself, else by hyper alone.
pub async fn serve(
    app: Arc<App>,
    stream: TcpStream,
    conn: Arc<Conn>,
    timeouts: Timeouts,
    signal: watch::Receiver<bool>,
    lane: bool,
) {
    if lane {
        return crate::lane::serve(app, stream, conn, timeouts, signal, Hyper).await;
    }
    let svc = service_fn(move |req| {
        let (a, c) = (Arc::clone(&app), Arc::clone(&conn));
        async move { Ok::<_, Infallible>(handle(a, req, c).await) }
    });
    let (pre, io) = (Bytes::new(), TokioIo::new(stream));
    crate::conn::serve(
        pre,
        io,
        svc,
        Version::HTTP_11,
        timeouts,
        Writes::Flat,
        signal,
    )
    .await
}

/// hyper's path as the lane's [`Handler`]: the requests it does not serve go to
/// [`handle`].
#[derive(Clone, Copy)]
pub struct Hyper;

impl Handler for Hyper {
    fn handle(
        self,
        app: Arc<App>,
        req: Request<Incoming>,
        conn: Arc<Conn>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Response<Body>> + Send>> {
        handle_boxed(app, req, conn)
    }
}

/// Serves one request from a sender (or from inside an intercepted tunnel).
pub async fn handle(app: Arc<App>, req: Request<Incoming>, conn: Arc<Conn>) -> Response<Body> {
    let method = req.method().clone();
    let mut pending = Unanswered {
        app: &app,
        peer: conn.peer,
        method: &method,
        trace: Trace::default(),
        answered: false,
    };
    let trace = &mut pending.trace;
    let result = if method == Method::CONNECT && conn.tunnel.is_some() {
        // A tunnel inside a tunnel: nothing to forward it to (its receiver is no proxy).
        let e = ProxyError::BadRequest("CONNECT inside a CONNECT tunnel".into());
        Err(e.into())
    } else if method == Method::CONNECT {
        // Boxed: a tunnel's set-up is rare and its future large; every plain request
        // would otherwise carry (and copy) its size.
        let connecting = Box::pin(connect(&app, req, &conn, trace));
        connecting.await
    } else {
        forward_request(&app, req, &conn, trace).await
    };
    pending.answered = true;
    let trace = &pending.trace;
    match result {
        Ok(resp) => {
            let log = &app.runtime.load().config.log;
            decision::forwarded(log, &app.sampler, conn.peer, method.as_str(), trace);
            resp
        }
        Err(r) => refuse(&app, r, conn.peer, method.as_str(), trace),
    }
}

/// A request being served: when its future is dropped after the request left for the
/// receiver and before an answer (the sender reset its HTTP/2 stream or closed its
/// connection), it is still counted under its outcome and leaves its decision line.
struct Unanswered<'a> {
    app: &'a App,
    peer: SocketAddr,
    method: &'a Method,
    trace: Trace,
    answered: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        if let Some(label) = &self.trace.sent {
            let sender = self.trace.sender.as_ref();
            self.app.metrics.outcome(label, sender, self.trace.outcome);
            decision::sender_left(self.peer, self.method.as_str(), &self.trace);
        }
    }
}

/// Handles CONNECT: intercepted (TLS terminated, each request inside admitted on its
/// own) or tunnelled (admitted once, as one unit).
async fn connect(
    app: &Arc<App>,
    mut req: Request<Incoming>,
    conn: &Arc<Conn>,
    trace: &mut Trace,
) -> Result<Response<Body>, Refused> {
    // A sender's end of stream before the tunnel opens cancels it.
    let _waiting = crate::conn::SenderEof::waiting(req.extensions());
    let uri = req.uri();
    // Authority-form only (RFC 9110 §9.3.6): no scheme, path or userinfo.
    let authority = uri
        .authority()
        .filter(|_| uri.scheme().is_none() && uri.path_and_query().is_none())
        .filter(|a| !a.as_str().contains('@'))
        // No default port (RFC 9110 §9.3.6: the client must send one).
        .filter(|a| a.port().is_some())
        .cloned()
        .ok_or_else(|| ProxyError::BadRequest("CONNECT needs host:port".into()))?;
    // A CONNECT request has no content: bytes after its head are the tunnel's, and a
    // request that frames some as its body would have sluice and the sender disagree
    // on where the tunnel begins.
    let h = req.headers();
    let framed = h.contains_key(TRANSFER_ENCODING)
        || h.get_all(CONTENT_LENGTH)
            .iter()
            .any(|v| v.as_bytes() != b"0");
    if framed {
        return Err(ProxyError::BadRequest("a CONNECT request carries no content".into()).into());
    }
    let target = Target::new(&authority, 443)?;
    // The tunnel's requests go to its host as normalised (`127.1` is `127.0.0.1`): the
    // same name for the TLS handshake and `Host` on every path.
    let authority = target.authority()?;
    trace.destination = Some(authority.clone());
    // Before the runtime the sender is checked against: a reload from here on is seen.
    let reloads = app.reloads.subscribe();
    let rt = app.runtime.load_full();
    let who = identify(&rt, req.headers(), conn).await?;
    trace.user = who.identity.as_ref().map(|i| Arc::clone(&i.user));
    let named = req.headers().get(rt.resolver.header()).cloned();
    let on_upgrade = hyper::upgrade::on(&mut req);
    if let Some(interceptor) = app
        .interceptor
        .clone()
        .filter(|_| !rt.config.tls.passthrough_hosts.matches(&target.host))
    {
        app.forwarder
            .policy()
            .check_host(&target.host)
            .map_err(ProxyError::from)?;
        let session = Intercepted {
            app: Arc::clone(app),
            interceptor,
            peer: conn.peer,
            slot: Arc::clone(&conn.slot),
            headers: req.headers().clone(),
            tunnel: Tunnel {
                authority,
                who,
                tls: true,
                endpoint: named,
            },
            target,
            reloads,
        };
        // Boxed: the session's future is kilobytes, copied on its way into a task.
        app.lifecycle.spawn(Box::pin(session.run(on_upgrade)));
        trace.outcome = "intercepted";
        return Ok(ok_empty());
    }

    // Not intercepted: the tunnel is admitted once, as one unit; when it turns out to
    // carry plain HTTP, that admission is its first request's.
    let ask = Asking {
        headers: req.headers(),
        who: &who,
        target: &target,
        path: "",
        resolve_dns: true,
        peer: conn.peer.ip(),
        last: &conn.endpoint,
        prepaid: None,
        inherited: None,
    };
    let admitted = admission(app, &rt, ask, trace).await?;
    let upstream = match app.forwarder.connect_tunnel(admitted.addrs.clone()).await {
        Ok(s) => s,
        Err(e) => return Err(after_admission(app, &admitted, e).await),
    };
    trace.outcome = admitted.outcome;
    let opened = Opened {
        app: Arc::clone(app),
        peer: conn.peer,
        headers: req.headers().clone(),
        target,
        slot: Arc::clone(&conn.slot),
        tunnel: Tunnel {
            authority,
            who,
            tls: false,
            endpoint: named,
        },
        reloads,
    };
    app.lifecycle
        .spawn(Box::pin(opened.run(on_upgrade, admitted, upstream)));
    Ok(ok_empty())
}

/// A non-intercepted CONNECT, admitted and connected, whose `200` is on its way.
struct Opened {
    app: Arc<App>,
    peer: SocketAddr,
    /// The CONNECT's own head and target, to admit the tunnel again.
    headers: HeaderMap,
    target: Target,
    slot: Arc<ConnSlot>,
    tunnel: Tunnel,
    reloads: tokio::sync::watch::Receiver<()>,
}

impl Opened {
    async fn run(
        self,
        on_upgrade: hyper::upgrade::OnUpgrade,
        admitted: Admitted,
        upstream: tokio::net::TcpStream,
    ) {
        let mut client = match on_upgrade.await {
            Ok(u) => TokioIo::new(u),
            Err(e) => return tracing::debug!(error = %e, "CONNECT upgrade failed"),
        };
        let cfg = Arc::clone(&self.app.runtime.load().config);
        let idle = cfg.proxy.tunnel_idle_timeout;
        let until = tokio::time::Instant::now().max(admitted.grant.start) + PREPAID_FOR;
        let mut held = Some(admitted);
        let mut pre = bytes::BytesMut::new();
        let mut sniffing = Box::pin(crate::sniff::sniff(&mut client, &mut pre));
        let mut spoken = Box::pin(upstream.readable());
        let mut expiry = Box::pin(tokio::time::sleep_until(until));
        let mut idling = Box::pin(tokio::time::sleep(idle));
        let opening = loop {
            tokio::select! {
                o = &mut sniffing => break o,
                // The receiver speaks first (SMTP, a database): bytes, not requests.
                r = &mut spoken => break r.map(|()| Opening::Other),
                // Silent past the grant's time: the token goes back.
                () = &mut expiry, if held.is_some() => {
                    if let Some(a) = held.take() {
                        refund(&self.app, &a).await;
                    }
                }
                // Nobody spoke: the tunnel idles out as a byte tunnel would.
                () = &mut idling => return,
            }
        };
        drop((sniffing, spoken));
        match opening {
            Ok(Opening::Http) => {
                let conn = tunnel_conn(self.peer, self.slot, self.tunnel);
                if let Some(a) = held {
                    conn.prepaid.arm(a, until);
                }
                crate::lane::shelve_plain(&self.app, &conn, upstream);
                serve_inside(self.app, client, pre.freeze(), conn, Version::HTTP_11).await;
            }
            Ok(_) => {
                // A tunnel whose token went back is admitted again now: a refusal can
                // only close it.
                let admitted = match held {
                    Some(a) => a,
                    None => match self.readmit().await {
                        Some(a) => a,
                        None => return,
                    },
                };
                let relay = Relay {
                    app: self.app,
                    slot: self.slot,
                    who: self.tunnel.who,
                    reloads: self.reloads,
                    idle,
                };
                relay.run(admitted, client, pre, upstream).await;
            }
            Err(e) => {
                if let Some(a) = held {
                    refund(&self.app, &a).await;
                }
                tracing::debug!(error = %e, "tunnel closed before its first bytes");
            }
        }
    }

    /// Admits the tunnel again, as its CONNECT was (already connected: no resolution).
    async fn readmit(&self) -> Option<Admitted> {
        let tunnel = (&self.headers, &self.tunnel, &self.target, self.peer);
        admit_after_ok(&self.app, tunnel, false)
            .await
            .map(|(a, _)| a)
    }
}

/// A tunnel relayed as bytes: admitted once, as one unit, holding its in-flight slot
/// and its connection's place until it closes, idles out or a reload no longer admits
/// its sender.
struct Relay {
    app: Arc<App>,
    slot: Arc<ConnSlot>,
    who: Who,
    reloads: tokio::sync::watch::Receiver<()>,
    idle: std::time::Duration,
}

impl Relay {
    async fn run<C>(
        self,
        admitted: Admitted,
        client: C,
        pre: bytes::BytesMut,
        mut upstream: tokio::net::TcpStream,
    ) where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let Relay {
            app,
            slot,
            who,
            reloads,
            idle,
        } = self;
        let _slot = slot;
        let Admitted {
            ep,
            label,
            slot: held,
            outcome,
            sender,
            ..
        } = admitted;
        let _held = held;
        app.metrics.outcome(&label, sender.as_ref(), outcome);
        app.metrics
            .tunnels
            .get_or_create(&EndpointLabels { endpoint: label })
            .inc();
        let bytes = async {
            if !pre.is_empty() {
                if let Err(e) = tokio::io::AsyncWriteExt::write_all(&mut upstream, &pre).await {
                    return tracing::debug!(error = %e, "tunnel closed with an error");
                }
            }
            if let Err(e) = crate::forward::tunnel(client, upstream, idle).await {
                tracing::debug!(error = %e, "tunnel closed with an error");
            }
        };
        tokio::select! {
            () = bytes => {}
            () = revoked(&app, reloads, &who, &ep.id) => tracing::info!(
                endpoint = %ep.id,
                user = who.identity.as_ref().map(|i| &*i.user),
                "closing a tunnel: a reload no longer admits its sender"
            ),
        }
    }
}

/// The connection the requests inside a tunnel arrive on.
fn tunnel_conn(peer: SocketAddr, slot: Arc<ConnSlot>, tunnel: Tunnel) -> Arc<Conn> {
    Arc::new(Conn {
        peer,
        slot,
        tunnel: Some(tunnel),
        upstream: Default::default(),
        endpoint: Default::default(),
        target: Default::default(),
        prepaid: Default::default(),
    })
}

/// Serves the requests inside a tunnel (plain HTTP, or the TLS session of an
/// intercepted one): HTTP/1.1 in the lane (when on), else, and HTTP/2, by hyper.
/// `pre` is what was read of the stream already.
async fn serve_inside<S: crate::conn::SenderIo>(
    app: Arc<App>,
    stream: S,
    pre: Bytes,
    conn: Arc<Conn>,
    protocol: Version,
) {
    let cfg = Arc::clone(&app.runtime.load().config);
    let timeouts = Timeouts {
        header_read: cfg.proxy.header_read_timeout,
        idle: cfg.proxy.idle_timeout,
    };
    let stop = app.lifecycle.signal();
    if protocol == Version::HTTP_11 && crate::lane::enabled() {
        let hyper = Hyper;
        return crate::lane::serve_tunnel(app, stream, pre, conn, timeouts, stop, hyper).await;
    }
    let svc = hyper::service::service_fn(move |req| {
        let (app, conn) = (Arc::clone(&app), Arc::clone(&conn));
        async move { Ok::<_, std::convert::Infallible>(handle_boxed(app, req, conn).await) }
    });
    let writes = crate::conn::Writes::Default;
    let io = TokioIo::new(stream);
    crate::conn::serve(pre, io, svc, protocol, timeouts, writes, stop).await;
}

/// An intercepted CONNECT: its first bytes read, then TLS terminated with a minted leaf
/// and every request inside served by [`handle`] like any other; plain HTTP is served
/// the same way without TLS, and other bytes are relayed (admitted once).
struct Intercepted {
    app: Arc<App>,
    interceptor: Arc<crate::tls::Interceptor>,
    peer: SocketAddr,
    slot: Arc<ConnSlot>,
    /// The CONNECT's own head, for the admission of a tunnel relayed as bytes.
    headers: HeaderMap,
    tunnel: Tunnel,
    target: Target,
    reloads: tokio::sync::watch::Receiver<()>,
}

impl Intercepted {
    async fn run(self, on_upgrade: hyper::upgrade::OnUpgrade) {
        let mut client = match on_upgrade.await {
            Ok(u) => TokioIo::new(u),
            Err(e) => return tracing::debug!(error = %e, "CONNECT upgrade failed"),
        };
        let cfg = Arc::clone(&self.app.runtime.load().config);
        let mut pre = bytes::BytesMut::new();
        let sniffing = crate::sniff::sniff(&mut client, &mut pre);
        let opening = match tokio::time::timeout(cfg.tls.handshake_timeout, sniffing).await {
            Ok(Ok(o)) => o,
            Ok(Err(e)) => {
                return tracing::debug!(error = %e, "tunnel closed before its first bytes");
            }
            Err(_) => {
                self.count("handshake_timeout");
                return tracing::info!(
                    host = %self.target.host,
                    timeout_ms = cfg.tls.handshake_timeout.as_millis() as u64,
                    "intercepted tunnel sent nothing in time"
                );
            }
        };
        match opening {
            Opening::Tls => {
                let client = crate::sniff::Prefixed::new(pre, client);
                self.terminate(client, cfg.tls.handshake_timeout).await;
            }
            Opening::Http => {
                let conn = tunnel_conn(self.peer, self.slot, plain(self.tunnel));
                serve_inside(self.app, client, pre.freeze(), conn, Version::HTTP_11).await;
            }
            Opening::Other => self.relay(client, pre).await,
        }
    }

    /// Counts how an intercepted tunnel's handshake ended.
    fn count(&self, result: &'static str) {
        self.app
            .metrics
            .intercepted
            .get_or_create(&InterceptLabels { result })
            .inc();
    }

    /// Terminates the sender's TLS and serves the requests inside.
    async fn terminate<C>(self, client: C, timeout: std::time::Duration)
    where
        C: crate::conn::SenderIo,
    {
        let handshake = self.interceptor.accept(client, &self.target.host);
        let ended = tokio::time::timeout(timeout, handshake).await;
        self.count(match &ended {
            Ok(Ok(_)) => "established",
            Ok(Err(_)) => "handshake_failed",
            Err(_) => "handshake_timeout",
        });
        let tls = match ended {
            Ok(Ok((tls, _sni))) => tls,
            Ok(Err(e)) => return tracing::warn!("{e}"),
            Err(_) => {
                return tracing::info!(
                    host = %self.target.host,
                    timeout_ms = timeout.as_millis() as u64,
                    "intercepted TLS handshake timed out"
                );
            }
        };
        let protocol = if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };
        let conn = tunnel_conn(self.peer, self.slot, self.tunnel);
        serve_inside(self.app, tls, Bytes::new(), conn, protocol).await;
    }

    /// Neither TLS nor plain HTTP: the tunnel is admitted once and relayed as bytes.
    /// Its `200` is sent, so a refusal can only close it.
    async fn relay<C>(self, client: C, pre: bytes::BytesMut)
    where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let app = &self.app;
        let tunnel = (&self.headers, &self.tunnel, &self.target, self.peer);
        let Some((admitted, trace)) = admit_after_ok(app, tunnel, true).await else {
            return;
        };
        let rt = app.runtime.load_full();
        let upstream = match app.forwarder.connect_tunnel(admitted.addrs.clone()).await {
            Ok(s) => s,
            Err(e) => {
                let r = after_admission(app, &admitted, e).await;
                drop(refuse(app, r, self.peer, "CONNECT", &trace));
                return;
            }
        };
        let relay = Relay {
            app: Arc::clone(app),
            slot: self.slot,
            who: self.tunnel.who,
            reloads: self.reloads,
            idle: rt.config.proxy.tunnel_idle_timeout,
        };
        relay.run(admitted, client, pre, upstream).await;
    }
}

/// Admits a tunnel whose `200` is sent already (its CONNECT's head, context, target
/// and sender): a refusal is counted and logged, and can only close the tunnel.
/// `resolve_dns`: resolve and check the addresses to connect to (none connected yet).
async fn admit_after_ok(
    app: &App,
    (headers, tunnel, target, peer): (&HeaderMap, &Tunnel, &Target, SocketAddr),
    resolve_dns: bool,
) -> Option<(Admitted, Trace)> {
    let rt = app.runtime.load_full();
    let last = LastEndpoint::default();
    let ask = Asking {
        headers,
        who: &tunnel.who,
        target,
        path: "",
        resolve_dns,
        peer: peer.ip(),
        last: &last,
        prepaid: None,
        inherited: None,
    };
    let mut trace = Trace {
        destination: Some(tunnel.authority.clone()),
        ..Trace::default()
    };
    match admission(app, &rt, ask, &mut trace).await {
        Ok(a) => Some((a, trace)),
        Err(r) => {
            drop(refuse(app, r, peer, "CONNECT", &trace));
            None
        }
    }
}

/// A tunnel's context for the plain HTTP inside it.
fn plain(tunnel: Tunnel) -> Tunnel {
    Tunnel {
        tls: false,
        ..tunnel
    }
}

/// [`handle`] behind a box: requests inside a tunnel recurse into it.
pub(crate) fn handle_boxed(
    app: Arc<App>,
    req: Request<Incoming>,
    conn: Arc<Conn>,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Response<Body>> + Send>> {
    Box::pin(handle(app, req, conn))
}

fn ok_empty() -> Response<Body> {
    Response::new(Either::Right(Full::new(bytes::Bytes::new())))
}
