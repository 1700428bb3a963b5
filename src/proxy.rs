//! One request, top to bottom: classify → resolve endpoint → check destination →
//! admit (wait for the token) → forward → observe the response (429 feedback).
//!
//! Plain absolute-form requests and the requests inside an intercepted CONNECT take the
//! same path ([`handle`]); a CONNECT that is not intercepted is paced once and becomes a
//! byte tunnel ([`connect`]).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use crate::adapt::{self, CooldownPolicy};
use crate::config::{Adaptive, Config, Policy};
use crate::endpoint::{Resolved, Resolver, proxy_user};
use crate::error::{Body, ProxyError};
use crate::forward::{ForwardError, Forwarder, strip_hop_by_hop};
use crate::limiter::{Ask, Limiter, Refusal};
use crate::metrics::{CodeLabels, EndpointLabel, EndpointLabels, Metrics};
use crate::mitm::Interceptor;
use crate::server::Lifecycle;

/// What may change on a live reload, swapped as one `Arc`.
pub struct Runtime {
    /// The validated config in force.
    pub config: Arc<Config>,
    /// Endpoint resolution compiled from it.
    pub resolver: Resolver,
}

impl Runtime {
    /// Compiles a config.
    pub fn new(config: Arc<Config>) -> Runtime {
        Runtime {
            resolver: Resolver::new(&config),
            config,
        }
    }
}

/// Everything a request needs, built once at start-up.
pub struct App {
    /// Reloadable rules.
    pub runtime: ArcSwap<Runtime>,
    /// Admission over the bucket store.
    pub limiter: Limiter,
    /// The upstream client.
    pub forwarder: Forwarder,
    /// Instruments.
    pub metrics: Arc<Metrics>,
    /// TLS interception, when `tls.intercept = true`.
    pub interceptor: Option<Arc<Interceptor>>,
    /// Connection tracking and shutdown signal.
    pub lifecycle: Lifecycle,
}

/// Context of an intercepted CONNECT tunnel, for the requests inside it.
#[derive(Debug, Clone)]
pub struct Tunnel {
    /// The CONNECT authority (`host:port`).
    pub authority: Authority,
    /// The user name of the CONNECT's `Proxy-Authorization`.
    pub proxy_user: Option<String>,
}

/// Serves one request from a sender (or from inside an intercepted tunnel).
pub async fn handle(
    app: Arc<App>,
    req: Request<Incoming>,
    tunnel: Option<Arc<Tunnel>>,
) -> Response<Body> {
    if req.method() == Method::CONNECT && tunnel.is_none() {
        return connect(app, req).await;
    }
    let mut label = None;
    match forward_request(&app, req, tunnel.as_deref(), &mut label).await {
        Ok(resp) => resp,
        Err(e) => refuse(&app, label.as_ref(), e),
    }
}

/// [`handle`] behind a box: requests inside a tunnel recurse into it.
fn handle_boxed(
    app: Arc<App>,
    req: Request<Incoming>,
    tunnel: Option<Arc<Tunnel>>,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Response<Body>> + Send>> {
    Box::pin(handle(app, req, tunnel))
}

/// Counts, logs and renders a refusal or failure.
fn refuse(app: &App, label: Option<&EndpointLabel>, e: ProxyError) -> Response<Body> {
    if let Some(l) = label {
        app.metrics.outcome(l, e.reason());
    }
    match &e {
        ProxyError::Upstream(_)
        | ProxyError::UpstreamTimeout(_)
        | ProxyError::StoreUnavailable { .. } => {
            tracing::warn!(reason = e.reason(), error = %e, "request failed")
        }
        _ => tracing::info!(reason = e.reason(), error = %e, "request refused"),
    }
    e.into_response()
}

async fn forward_request(
    app: &App,
    req: Request<Incoming>,
    tunnel: Option<&Tunnel>,
    label: &mut Option<EndpointLabel>,
) -> Result<Response<Body>, ProxyError> {
    let rt = app.runtime.load();
    let (mut parts, body) = req.into_parts();
    let uri = target_uri(&parts.uri, tunnel)?;
    let host = uri.host().unwrap_or_default();
    let user = match tunnel {
        Some(t) => t.proxy_user.clone(),
        None if rt.resolver.uses_proxy_user() => proxy_user(&parts.headers),
        None => None,
    };
    let ep = rt
        .resolver
        .resolve(&parts.headers, user.as_deref(), host, uri.path())?;
    let l = app.metrics.label(&ep.id);
    *label = Some(l.clone());
    app.forwarder
        .policy()
        .check_host(host)
        .map_err(|d| ProxyError::DestinationDenied {
            host: d.host,
            why: d.why,
        })?;

    let waited = admit(app, &ep).await?;
    app.metrics
        .wait
        .get_or_create(&EndpointLabels {
            endpoint: l.clone(),
        })
        .observe(waited.as_secs_f64());

    strip_hop_by_hop(&mut parts.headers);
    parts.headers.remove(rt.resolver.header());
    parts.uri = uri;
    parts.version = Version::HTTP_11;
    let resp = app
        .forwarder
        .send(Request::from_parts(parts, body))
        .await
        .map_err(upstream_error)?;

    app.metrics
        .upstream
        .get_or_create(&CodeLabels {
            endpoint: l.clone(),
            code: resp.status().as_u16(),
        })
        .inc();
    app.metrics.outcome(&l, "forwarded");
    if let Some(adaptive) = ep.policy.adaptive {
        observe(app, &ep, &l, &adaptive, resp.status(), resp.headers()).await;
    }
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Ok(Response::from_parts(parts, Either::Left(body)))
}

/// The absolute URI to forward to: the request's own, or rebuilt from the tunnel's
/// CONNECT authority for requests inside an intercepted tunnel.
fn target_uri(uri: &Uri, tunnel: Option<&Tunnel>) -> Result<Uri, ProxyError> {
    match (uri.authority(), tunnel) {
        (Some(_), None) => match uri.scheme() {
            Some(s) if *s == Scheme::HTTP || *s == Scheme::HTTPS => Ok(uri.clone()),
            _ => Err(ProxyError::BadRequest(format!(
                "unsupported scheme in {uri}"
            ))),
        },
        (None, None) => Err(ProxyError::NotAProxyRequest),
        (_, Some(t)) => {
            let pq = uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/"));
            Uri::builder()
                .scheme(Scheme::HTTPS)
                .authority(t.authority.clone())
                .path_and_query(pq)
                .build()
                .map_err(|e| ProxyError::BadRequest(e.to_string()))
        }
    }
}

/// Waits for the endpoint's token, mapping refusals to [`ProxyError`].
async fn admit(app: &App, ep: &Resolved) -> Result<Duration, ProxyError> {
    let endpoint = || ep.id.to_string();
    app.limiter
        .admit(&ep.id, &ep.policy)
        .await
        .map_err(|r| match r {
            Refusal::RateLimited { retry_after } => ProxyError::RateLimited {
                endpoint: endpoint(),
                retry_after,
            },
            Refusal::Cooldown { retry_after } => ProxyError::Cooldown {
                endpoint: endpoint(),
                retry_after,
            },
            Refusal::StoreUnavailable => ProxyError::StoreUnavailable {
                endpoint: endpoint(),
            },
        })
}

fn upstream_error(e: ForwardError) -> ProxyError {
    match e {
        ForwardError::Denied(d) => ProxyError::DestinationDenied {
            host: d.host,
            why: d.why,
        },
        ForwardError::Timeout(t) => ProxyError::UpstreamTimeout(t),
        other => ProxyError::Upstream(other.to_string()),
    }
}

/// Feeds the response into the endpoint's adaptive state (one store call, only for
/// responses that carry something: 429s, 503 + Retry-After, exhausted quotas).
async fn observe(
    app: &App,
    ep: &Resolved,
    label: &EndpointLabel,
    adaptive: &Adaptive,
    status: StatusCode,
    headers: &http::HeaderMap,
) {
    let policy = CooldownPolicy {
        default_cooldown: adaptive.default_cooldown,
        max_cooldown: adaptive.max_cooldown,
    };
    let Some(fb) = adapt::feedback(status, headers, SystemTime::now(), &policy) else {
        return;
    };
    if fb.throttled {
        app.metrics
            .throttles
            .get_or_create(&EndpointLabels {
                endpoint: label.clone(),
            })
            .inc();
    }
    let ask = Ask::new(&ep.policy, 0.0, None);
    match app
        .limiter
        .store()
        .feedback(&ep.id, ask, *adaptive, fb.pause, fb.throttled)
        .await
    {
        Ok(()) => tracing::info!(
            endpoint = %ep.id,
            status = status.as_u16(),
            pause_ms = fb.pause.as_millis() as u64,
            throttled = fb.throttled,
            "receiver asked to slow down: cooldown started"
        ),
        Err(e) => {
            tracing::warn!(endpoint = %ep.id, error = %e, "could not record upstream feedback")
        }
    }
}

/// Handles CONNECT: intercepted (TLS terminated, each request paced) or tunnelled
/// (paced once per CONNECT).
pub async fn connect(app: Arc<App>, mut req: Request<Incoming>) -> Response<Body> {
    let Some(authority) = req.uri().authority().cloned() else {
        return ProxyError::BadRequest("CONNECT needs host:port".into()).into_response();
    };
    let rt = app.runtime.load_full();
    let host = authority.host().to_owned();
    let user = proxy_user(req.headers());
    if let Err(d) = app.forwarder.policy().check_host(&host) {
        return refuse(
            &app,
            None,
            ProxyError::DestinationDenied {
                host: d.host,
                why: d.why,
            },
        );
    }
    let on_upgrade = hyper::upgrade::on(&mut req);
    if let Some(interceptor) = app
        .interceptor
        .clone()
        .filter(|_| !rt.config.tls.passthrough_hosts.matches(&host))
    {
        let tunnel = Arc::new(Tunnel {
            authority,
            proxy_user: user,
        });
        let app2 = Arc::clone(&app);
        app.lifecycle.spawn(async move {
            let upgraded = match on_upgrade.await {
                Ok(u) => u,
                Err(e) => return tracing::debug!(error = %e, "CONNECT upgrade failed"),
            };
            let (tls, _sni) = match interceptor.accept(TokioIo::new(upgraded), &host).await {
                Ok(t) => t,
                Err(e) => return tracing::warn!("{e}"),
            };
            let app3 = Arc::clone(&app2);
            let svc = hyper::service::service_fn(move |req| {
                let (app, tunnel) = (Arc::clone(&app3), Arc::clone(&tunnel));
                async move {
                    Ok::<_, std::convert::Infallible>(handle_boxed(app, req, Some(tunnel)).await)
                }
            });
            let stop = app2.lifecycle.signal();
            let protocol = if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
                Version::HTTP_2
            } else {
                Version::HTTP_11
            };
            crate::server::serve(TokioIo::new(tls), svc, protocol, stop).await;
        });
        return ok_empty();
    }

    // Not intercepted: the tunnel is one unit, paced once.
    let user_ref = rt
        .resolver
        .uses_proxy_user()
        .then_some(user.as_deref())
        .flatten();
    let ep = match rt.resolver.resolve(req.headers(), user_ref, &host, "") {
        Ok(ep) => ep,
        Err(e) => return refuse(&app, None, e),
    };
    let label = app.metrics.label(&ep.id);
    let waited = match admit(&app, &ep).await {
        Ok(w) => w,
        Err(e) => return refuse(&app, Some(&label), e),
    };
    app.metrics
        .wait
        .get_or_create(&EndpointLabels {
            endpoint: label.clone(),
        })
        .observe(waited.as_secs_f64());
    let port = authority.port_u16().unwrap_or(443);
    let upstream = match app.forwarder.connect_tunnel(&host, port).await {
        Ok(s) => s,
        Err(e) => return refuse(&app, Some(&label), upstream_error(e)),
    };
    app.metrics.outcome(&label, "forwarded");
    app.metrics
        .tunnels
        .get_or_create(&EndpointLabels { endpoint: label })
        .inc();
    app.lifecycle.spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => {
                if let Err(e) = crate::forward::tunnel(upgraded, upstream).await {
                    tracing::debug!(error = %e, "tunnel closed with an error");
                }
            }
            Err(e) => tracing::debug!(error = %e, "CONNECT upgrade failed"),
        }
    });
    ok_empty()
}

fn ok_empty() -> Response<Body> {
    Response::new(Either::Right(Full::new(bytes::Bytes::new())))
}

/// The policy of an endpoint ID as the current config sees it (for views).
pub fn policy_of(app: &App, id: &str) -> Arc<Policy> {
    app.runtime.load().resolver.policy_of(id)
}
