//! The way out: the pooled upstream client (plain HTTP and rustls HTTPS), hop-by-hop
//! header hygiene, and byte tunnels for CONNECT.
//!
//! The client resolves names through [`GuardedResolver`], which applies the destination
//! policy to the addresses DNS returns and hands the connector only those, so sluice
//! connects to exactly what it checked.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::header::{
    CONNECTION, HeaderName, PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, TE, TRAILER,
    TRANSFER_ENCODING, UPGRADE,
};
use http::{HeaderMap, Request, Response};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::connect::dns::Name;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;

use crate::conn::{Activity, Watched};
use crate::destination::{DestinationPolicy, ResolveError};

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
    /// No response head within `upstream_timeout`.
    #[error("upstream did not answer within {0:?}")]
    Timeout(Duration),
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
        Box::pin(async move { policy.resolve(name.as_str(), 0).await.map(Vec::into_iter) })
    }
}

type Connector = HttpsConnector<HttpConnector<GuardedResolver>>;

type Pool = Client<Connector, Incoming>;

/// The pooled upstream client.
pub struct Forwarder {
    client: ArcSwap<Pool>,
    tls: rustls::ClientConfig,
    timeout: Duration,
    policy: Arc<ArcSwap<DestinationPolicy>>,
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
        Forwarder {
            client,
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
        self.client
            .store(Arc::new(pool(&self.tls, self.timeout, &self.policy)));
    }

    /// The destination policy in force.
    pub fn policy(&self) -> Arc<DestinationPolicy> {
        self.policy.load_full()
    }

    /// Sends a prepared request (absolute URI, hop-by-hop headers removed) and waits for
    /// the response head; the body streams afterwards.
    pub async fn send(&self, req: Request<Incoming>) -> Result<Response<Incoming>, ForwardError> {
        let client = self.client.load();
        match tokio::time::timeout(self.timeout, client.request(req)).await {
            Err(_) => Err(ForwardError::Timeout(self.timeout)),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(classify(&e)),
        }
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

/// A fresh pool whose connector resolves through `policy`.
fn pool(
    tls: &rustls::ClientConfig,
    timeout: Duration,
    policy: &Arc<ArcSwap<DestinationPolicy>>,
) -> Pool {
    let mut http = HttpConnector::new_with_resolver(GuardedResolver {
        policy: Arc::clone(policy),
    });
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(timeout));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls.clone())
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(256)
        .build(https)
}

fn classify(e: &hyper_util::client::legacy::Error) -> ForwardError {
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
    if crate::tls::upstream::find_rustls(e).is_some() {
        let reason = crate::tls::upstream::describe_failure(e);
        tracing::warn!(%reason, "upstream TLS handshake failed");
        return ForwardError::Tls(reason);
    }
    let text = error_chain(e);
    if e.is_connect() {
        ForwardError::Connect(text)
    } else {
        ForwardError::Other(text)
    }
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
    let listed: Vec<HeaderName> = h
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|s| s.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in listed {
        h.remove(n);
    }
    for n in [
        CONNECTION,
        TE,
        TRAILER,
        TRANSFER_ENCODING,
        UPGRADE,
        PROXY_AUTHORIZATION,
        PROXY_AUTHENTICATE,
    ] {
        h.remove(n);
    }
    h.remove("keep-alive");
    h.remove("proxy-connection");
}

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
pub async fn tunnel(
    upgraded: hyper::upgrade::Upgraded,
    upstream: TcpStream,
    idle: Duration,
) -> std::io::Result<()> {
    let activity = Activity::new();
    let mut client = Watched::new(TokioIo::new(upgraded), Arc::clone(&activity));
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
    fn forged_sluice_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert("x-sluice-reason", "rate_limited".parse().unwrap());
        h.insert("X-Sluice-Anything", "1".parse().unwrap());
        h.insert("x-sluicey", "kept".parse().unwrap());
        strip_sluice_headers(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
    }
}
