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

/// The pooled upstream client.
#[derive(Clone)]
pub struct Forwarder {
    client: Client<Connector, Incoming>,
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
        let mut http = HttpConnector::new_with_resolver(GuardedResolver {
            policy: Arc::clone(&policy),
        });
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(timeout));
        // The connector negotiates ALPN itself (http/1.1 only) and refuses presets.
        let mut tls = tls;
        tls.alpn_protocols.clear();
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(256)
            .build(https);
        Forwarder {
            client,
            timeout,
            policy,
        }
    }

    /// Swaps the destination policy (live reload).
    pub fn set_policy(&self, policy: DestinationPolicy) {
        self.policy.store(Arc::new(policy));
    }

    /// The destination policy in force.
    pub fn policy(&self) -> Arc<DestinationPolicy> {
        self.policy.load_full()
    }

    /// Sends a prepared request (absolute URI, hop-by-hop headers removed) and waits for
    /// the response head; the body streams afterwards.
    pub async fn send(&self, req: Request<Incoming>) -> Result<Response<Incoming>, ForwardError> {
        match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Err(_) => Err(ForwardError::Timeout(self.timeout)),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(classify(&e)),
        }
    }

    /// Opens a TCP connection for a CONNECT tunnel to an address that passed the policy.
    pub async fn connect_tunnel(&self, host: &str, port: u16) -> Result<TcpStream, ForwardError> {
        let addrs = self
            .policy()
            .resolve(host, port)
            .await
            .map_err(|e| match e {
                ResolveError::Denied(d) => ForwardError::Denied(d),
                ResolveError::Dns(m) => ForwardError::Connect(m),
            })?;
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
    if crate::upstream_tls::find_rustls(e).is_some() {
        let reason = crate::upstream_tls::describe_failure(e);
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

/// Copies bytes both ways between a sender's upgraded CONNECT and the upstream socket.
pub async fn tunnel(
    upgraded: hyper::upgrade::Upgraded,
    mut upstream: TcpStream,
) -> std::io::Result<(u64, u64)> {
    let mut client = TokioIo::new(upgraded);
    tokio::io::copy_bidirectional(&mut client, &mut upstream).await
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
}
