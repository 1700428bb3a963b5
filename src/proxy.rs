//! One request, top to bottom. Every form a sender uses — an absolute-form HTTP request,
//! a CONNECT tunnel, a request inside an intercepted tunnel (HTTP/1.1 or HTTP/2) — goes
//! through the same admission (`admission`):
//!
//! 1. the target host is validated and normalised (`Target`),
//! 2. the sender is identified (proxy authentication, `identify`),
//! 3. the endpoint is resolved and the user's grant checked,
//! 4. the destination policy is checked (for tunnels, including DNS),
//! 5. the endpoint gets its metric label (only now: nothing unchecked becomes a label),
//! 6. the request waits for its token.
//!
//! Then it is sent (a forwarded request, or a byte tunnel) and its response observed
//! for 429 feedback. Nothing is spent before step 6, and a token whose request never
//! left (the resolved address was refused) is refunded.
//!
//! The hot path (a plain request on a held upstream connection) is awaited in place:
//! hyper keeps each request's future in one slot per connection, so a box per step
//! would only add an allocation and a copy per request (callgrind, docs/BENCHMARKS.md).
//! Cold or rare steps (CONNECT, shadow mode, queued endpoints, authentication, 429
//! feedback, failures) are boxed so their size does not weigh on every request, and a
//! boxed step is bound to a local before it is awaited (`let f = Box::pin(step());
//! f.await`): written as `Box::pin(step()).await`, the unboxed step stays in the
//! caller's future for the whole wait once the release build inlines.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::Either;
use hyper::body::Incoming;

use crate::adapt::{self, CooldownPolicy};
use crate::auth::Identity;
use crate::config::{Adaptive, Mode, Policy};
use crate::conn::ConnSlot;
use crate::core::{App, Runtime};
use crate::decision::{self, Trace};
use crate::destination::normalise_host;
use crate::endpoint::{COST_HEADER, Resolved, proxy_user};
use crate::error::{Body, ProxyError};
use crate::forward::{
    ForwardError, content_length_list, strip_hop_by_hop, strip_hop_by_hop_and, strip_sluice_headers,
};
use crate::limiter::{Ask, Grant, HeldBody, Place, Refusal, Shadow, Slot};
use crate::metrics::{EndpointLabel, EndpointLabels, FORWARDED};
use crate::upload::Upload;

pub use crate::headers::{PRIORITY_HEADER, SENDER_HEADER};

/// The sender connection a request arrived on.
pub struct Conn {
    /// The sender's address.
    pub peer: SocketAddr,
    /// Its place under `proxy.max_connections` (kept by tunnels it turns into).
    pub slot: Arc<ConnSlot>,
    /// Set for connections inside an intercepted CONNECT tunnel.
    pub tunnel: Option<Tunnel>,
    /// Its own upstream connection, when it keeps sending to one destination.
    pub upstream: crate::forward::Affinity,
    /// The endpoint its last request named (by header or by host), resolved and
    /// labelled.
    pub endpoint: LastEndpoint,
    /// The target its last request named, checked.
    pub target: LastTarget,
    /// Inside a non-intercepted tunnel carrying plain HTTP: the CONNECT's admission,
    /// its first request's.
    pub prepaid: Prepaid,
}

/// The target a connection's last request named, parsed and checked: the next request
/// naming the same authority, byte for byte, reuses it instead of parsing and
/// normalising the host again (a sender usually sends to one host for a whole
/// connection). A copy of the text is kept, not a view into the request, which would
/// keep the connection's read buffer shared.
#[derive(Default)]
pub struct LastTarget(std::sync::Mutex<Option<Checked>>);

/// An authority's text and default port, and the target they named.
struct Checked {
    text: Box<str>,
    default_port: u16,
    target: Arc<Target>,
}

impl LastTarget {
    /// The target `authority` names (`default_port` when it names none).
    fn of(&self, authority: &Authority, default_port: u16) -> Result<Arc<Target>, ProxyError> {
        let mut last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = &*last {
            if c.default_port == default_port && *c.text == *authority.as_str() {
                return Ok(Arc::clone(&c.target));
            }
        }
        let target = Arc::new(Target::new(authority, default_port)?);
        *last = Some(Checked {
            text: authority.as_str().into(),
            default_port,
            target: Arc::clone(&target),
        });
        Ok(target)
    }
}

/// The endpoint a connection's last request named, with its metric label: the next
/// request naming the same endpoint the same way under the same configuration skips
/// resolution and the label lookups (a sender usually names one endpoint, or sends to
/// one host, for a whole connection). Kept only when the resolution depends on nothing
/// but what is compared: the header's bytes, or the host when there is no header, no
/// proxy-user endpoint and no rule for that host looks at the path.
#[derive(Default)]
pub struct LastEndpoint(std::sync::Mutex<Option<Remembered>>);

/// What named a request's endpoint, as [`LastEndpoint`] compares it.
enum Named<'a> {
    /// The endpoint header's value.
    Header(&'a http::HeaderValue),
    /// The normalised target host.
    Host(&'a str),
}

impl Named<'_> {
    fn is(&self, kept: &Kept) -> bool {
        match (self, kept) {
            (Named::Header(h), Kept::Header(k)) => *h == k,
            (Named::Host(h), Kept::Host(k)) => *h == &**k,
            _ => false,
        }
    }
}

/// A copy of [`Named`], kept across requests.
enum Kept {
    Header(http::HeaderValue),
    Host(Box<str>),
}

struct Remembered {
    /// The configuration it was resolved under. A weak reference keeps the allocation,
    /// so no later configuration can reuse its address.
    runtime: std::sync::Weak<Runtime>,
    named: Kept,
    ep: Resolved,
    label: EndpointLabel,
}

impl LastEndpoint {
    /// The remembered endpoint when `named` names it again under `rt`.
    fn recall(&self, rt: &Arc<Runtime>, named: &Named<'_>) -> Option<(Resolved, EndpointLabel)> {
        let last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let r = last.as_ref()?;
        (std::ptr::eq(r.runtime.as_ptr(), Arc::as_ptr(rt)) && named.is(&r.named))
            .then(|| (r.ep.clone(), r.label.clone()))
    }

    fn remember(&self, rt: &Arc<Runtime>, named: &Named<'_>, ep: &Resolved, label: &EndpointLabel) {
        // A copy, not a view into the request: kept across requests, a view would keep
        // the connection's read buffer shared, and hyper would allocate a new one for
        // every request (and pin this one for the connection's life).
        let named = match named {
            Named::Header(h) => {
                Kept::Header(http::HeaderValue::from_bytes(h.as_bytes()).unwrap_or((*h).clone()))
            }
            Named::Host(h) => Kept::Host((*h).into()),
        };
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(Remembered {
            runtime: Arc::downgrade(rt),
            named,
            ep: ep.clone(),
            label: label.clone(),
        });
    }
}

/// Context of an intercepted CONNECT tunnel, for the requests inside it.
#[derive(Debug, Clone)]
pub struct Tunnel {
    /// The CONNECT authority (`host:port`).
    pub authority: Authority,
    /// The sender as the CONNECT identified it.
    pub who: Who,
    /// The requests inside go upstream over TLS (an intercepted TLS session) or as
    /// plain HTTP (a tunnel carrying plain HTTP).
    pub tls: bool,
    /// The endpoint the CONNECT named by header: the endpoint of the requests inside
    /// that name none of their own.
    pub endpoint: Option<http::HeaderValue>,
}

/// Who sends, as far as endpoint resolution and grants care.
#[derive(Debug, Clone, Default)]
pub struct Who {
    /// The authenticated user (proxy authentication on).
    pub identity: Option<Identity>,
    /// The endpoint named by the proxy user (`endpoint_from_proxy_user = true`).
    pub endpoint_hint: Option<String>,
}

impl Who {
    /// Whether the users file in force still admits this sender as it was identified:
    /// its user listed with the hash its password was verified against, or no
    /// authentication at all. A sender identified before authentication was switched on
    /// is not admitted.
    fn still_admitted(&self, rt: &Runtime) -> bool {
        match (&rt.users, &self.identity) {
            (Some(users), Some(id)) => users.still_valid(id),
            (Some(_), None) => false,
            (None, _) => true,
        }
    }

    /// Whether this sender may still spend `endpoint`'s budget under `rt`.
    fn may_still_spend(&self, rt: &Runtime, endpoint: &str) -> bool {
        match (&rt.users, &self.identity) {
            (Some(users), Some(id)) => users.still_valid(id) && users.may_spend(&id.user, endpoint),
            _ => self.still_admitted(rt),
        }
    }
}

/// Resolves once a reload takes away `who`'s right to spend `endpoint` (user removed,
/// password changed, grant withdrawn, authentication switched on): what a passthrough
/// tunnel waits on beside its bytes, whose requests sluice cannot see to refuse one by
/// one. `reloads` is subscribed before the identity was checked, so no reload in
/// between goes unseen.
pub(crate) async fn revoked(
    app: &App,
    mut reloads: tokio::sync::watch::Receiver<()>,
    who: &Who,
    endpoint: &str,
) {
    while reloads.changed().await.is_ok() {
        if !who.may_still_spend(&app.runtime.load(), endpoint) {
            return;
        }
    }
    std::future::pending().await
}

/// A validated request target.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// Normalised host (lowercase, no trailing dot, IPv6 without brackets).
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl Target {
    /// The target `authority` names; `default_port` when it names no port.
    pub(crate) fn new(authority: &Authority, default_port: u16) -> Result<Target, ProxyError> {
        let (host, port) = host_and_port(authority, default_port)?;
        let host =
            normalise_host(host).map_err(|e| ProxyError::BadRequest(format!("bad host: {e}")))?;
        Ok(Target { host, port })
    }

    /// `host:port`, the host normalised (an IPv6 address in brackets).
    pub(crate) fn authority(&self) -> Result<Authority, ProxyError> {
        let (host, port) = (&self.host, self.port);
        let text = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        Authority::try_from(text).map_err(|e| ProxyError::BadRequest(e.to_string()))
    }
}

/// The host (an IPv6 literal in its brackets) and the port `authority` names, or
/// `default` when it names none. A port that is not a number in 1..=65535 (`80abc`,
/// `65536`, `0`, nothing after the `:`) is a bad request, never the default:
/// `Authority::port_u16` would quietly answer `None` for all of them. One pass over the
/// text, for every request.
fn host_and_port(authority: &Authority, default: u16) -> Result<(&str, u16), ProxyError> {
    // Byte searches: the `str` pattern searchers cost several times more on text this
    // short, and the separators are ASCII.
    let last = |s: &str, b: u8| s.as_bytes().iter().rposition(|&c| c == b);
    let text = authority.as_str();
    let host_port = last(text, b'@').map_or(text, |i| &text[i + 1..]);
    // An IPv6 literal's colons are inside its brackets.
    let (host, after_host) = match last(host_port, b']') {
        Some(i) if host_port.starts_with('[') => host_port.split_at(i + 1),
        _ => match last(host_port, b':') {
            Some(i) => host_port.split_at(i),
            None => (host_port, ""),
        },
    };
    let Some(port) = last(after_host, b':').map(|i| &after_host[i + 1..]) else {
        return Ok((host, default));
    };
    match port.parse::<u16>() {
        Ok(p) if p != 0 && port.bytes().all(|b| b.is_ascii_digit()) => Ok((host, p)),
        _ => Err(ProxyError::BadRequest(format!(
            "bad port {port:?} in {text}: a port is a number from 1 to 65535"
        ))),
    }
}

/// What admission looks at: the request's facts, whatever its form.
pub(crate) struct Asking<'a> {
    pub(crate) headers: &'a HeaderMap,
    pub(crate) who: &'a Who,
    pub(crate) target: &'a Target,
    pub(crate) path: &'a str,
    /// Resolve and check the addresses now (tunnels connect to exactly these); plain
    /// requests are checked by name here and by address when the pool connects.
    pub(crate) resolve_dns: bool,
    /// The sender's address (the fair-share sender of last resort).
    pub(crate) peer: IpAddr,
    /// The sender connection's last endpoint named by header.
    pub(crate) last: &'a LastEndpoint,
    /// A CONNECT's admission kept for the first request inside its tunnel.
    pub(crate) prepaid: Option<&'a Prepaid>,
    /// Inside a tunnel: the endpoint its CONNECT named by header.
    pub(crate) inherited: Option<&'a http::HeaderValue>,
}

/// A request admitted to leave.
pub(crate) struct Admitted {
    pub(crate) ep: Resolved,
    pub(crate) label: EndpointLabel,
    pub(crate) grant: Grant,
    /// `forwarded`, or in shadow mode what enforcing would have answered.
    pub(crate) outcome: &'static str,
    /// For tunnels: the resolved addresses that passed the destination policy.
    pub(crate) addrs: Vec<SocketAddr>,
    /// The in-flight slot (`max_in_flight`), held until the response body ends.
    pub(crate) slot: Option<Slot>,
    /// Its place in the endpoint's queue (queued endpoints), for a resend's admission.
    turn: Option<Turn>,
    /// When its admission began: a resend waits at most what is left of `max_wait`.
    pub(crate) arrived: tokio::time::Instant,
    /// Counts it in its endpoint's `in_flight` (`/endpoints`) until it is answered.
    pub(crate) _sending: crate::metrics::Sending,
    /// Its sender's label (`sluice_sender_requests_total`).
    pub(crate) sender: Option<crate::metrics::SenderLabel>,
}

/// A refusal, with the label it is counted under (when the endpoint is known).
pub(crate) struct Refused {
    label: Option<EndpointLabel>,
    error: ProxyError,
}

impl From<ProxyError> for Refused {
    fn from(error: ProxyError) -> Refused {
        Refused { label: None, error }
    }
}

/// An HTTP/2 request's `cookie` fields, which senders may split one pair per field, as
/// the one field HTTP/1.1 allows, joined with `; ` (RFC 9113 §8.2.3).
fn join_cookies(headers: &mut HeaderMap) {
    let cookie = http::header::COOKIE;
    if headers.get_all(&cookie).iter().nth(1).is_none() {
        return;
    }
    let mut joined = Vec::new();
    for v in headers.get_all(&cookie) {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(v.as_bytes());
    }
    // Each part was a valid value, and `; ` is too.
    if let Ok(v) = http::HeaderValue::from_bytes(&joined) {
        headers.insert(cookie, v);
    }
}

/// Serves one request by hyper's path: what an engine hands the requests it does not
/// serve itself. [`crate::engine::Hyper`] is the one implementation, given to the lane
/// as a type, so nothing here calls up into the room that chooses engines.
pub trait Handler: Copy + Send + Sync + 'static {
    /// Serves `req`, boxed: requests inside a tunnel recurse into it.
    fn handle(
        self,
        app: Arc<App>,
        req: Request<Incoming>,
        conn: Arc<Conn>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Response<Body>> + Send>>;
}

/// Counts, logs and renders a refusal or failure.
pub(crate) fn refuse(
    app: &App,
    r: Refused,
    peer: SocketAddr,
    method: &str,
    trace: &Trace,
) -> Response<Body> {
    let label = r.label.unwrap_or_else(|| app.metrics.other());
    app.metrics
        .outcome(&label, trace.sender.as_ref(), r.error.reason());
    decision::refused(peer, method, trace, &r.error);
    r.error.into_response()
}

/// Steps 3–6 of the module doc, the same for every form of request.
pub(crate) async fn admission(
    app: &App,
    rt: &Arc<Runtime>,
    ask: Asking<'_>,
    trace: &mut Trace,
) -> Result<Admitted, Refused> {
    let Asking {
        headers,
        who,
        target,
        path,
        resolve_dns,
        peer,
        last,
        prepaid,
        inherited,
    } = ask;
    let arrived = tokio::time::Instant::now();
    let user = who.identity.as_ref().map(|i| &i.user);
    trace.sender = Some(app.metrics.sender(&rt.config.proxy, user, headers));
    // A request inside a tunnel that names no endpoint is under the one its CONNECT
    // named (a clone: a tunnel's requests only).
    let with_inherited;
    let headers = match inherited {
        Some(v) if !headers.contains_key(rt.resolver.header()) => {
            with_inherited = {
                let mut h = headers.clone();
                h.insert(rt.resolver.header().clone(), v.clone());
                h
            };
            &with_inherited
        }
        _ => headers,
    };
    // Two endpoint headers would be two answers to which bucket pays: refused, as a
    // second `Host` is, before a connection's last endpoint is recalled (a name with
    // several values is rare: counting them is cheaper than a lookup).
    if headers.len() != headers.keys_len()
        && headers
            .get_all(rt.resolver.header())
            .iter()
            .nth(1)
            .is_some()
    {
        let name = rt.resolver.header();
        return Err(ProxyError::BadRequest(format!("more than one {name} header")).into());
    }
    let named = match headers.get(rt.resolver.header()) {
        Some(h) => Some(Named::Header(h)),
        None if who.endpoint_hint.is_none() => Some(Named::Host(&target.host)),
        None => None,
    };
    let recalled = named.as_ref().and_then(|n| last.recall(rt, n));
    let remember = named.filter(|n| {
        recalled.is_none()
            && match n {
                Named::Header(_) => true,
                Named::Host(h) => rt.resolver.by_host_alone(h),
            }
    });
    let (ep, known) = match recalled {
        Some(hit) => hit,
        None => {
            let hint = who.endpoint_hint.as_deref();
            let ep = rt
                .resolver
                .resolve(headers, hint, &target.host, target.port, path)?;
            let known = app.metrics.existing_label(&ep.id);
            (ep, known)
        }
    };
    trace.endpoint = Some(Arc::clone(&ep.id));
    if ep.by_host {
        app.metrics.host_fallback.inc();
    }
    if let (Some(users), Some(id)) = (&rt.users, &who.identity) {
        if !users.may_spend(&id.user, &ep.id) {
            return Err(ProxyError::EndpointNotAllowed {
                user: id.user.to_string(),
                endpoint: ep.id.to_string(),
            }
            .into());
        }
    }
    let denied = |error| Refused {
        label: Some(known.clone()),
        error,
    };
    // A cost the sender names (`X-Sluice-Cost`), checked against the configured policy.
    let cost = crate::endpoint::request_cost(headers, &ep.policy).map_err(denied)?;
    app.forwarder
        .policy()
        .check_host(&target.host)
        .map_err(|d| denied(d.into()))?;
    let addrs = if resolve_dns {
        let resolving = Box::pin(app.forwarder.resolve(&target.host, target.port));
        resolving.await.map_err(|e| denied(upstream_error(e)))?
    } else {
        Vec::new()
    };
    let label = if app.metrics.is_other(&known) {
        app.metrics.label(&ep.id)
    } else {
        known
    };
    // Labels are never taken back, so the pair stays right for this configuration.
    if let Some(n) = remember {
        last.remember(rt, &n, &ep, &label);
    }
    // The pace its receiver published lowers the endpoint's policy while it holds.
    let ep = Resolved {
        policy: app.limiter.learned().apply(&ep.id, &ep.policy),
        ..ep
    };
    let ep = match cost {
        Some(cost) if cost != ep.policy.cost => Resolved {
            policy: Arc::new(Policy {
                cost,
                ..(*ep.policy).clone()
            }),
            ..ep
        },
        _ => ep,
    };
    let prepaid = match prepaid.and_then(|p| p.take_for(&ep.id)) {
        Some(Prepaying::Yours(a)) => Some(a),
        Some(Prepaying::Unused(a)) => {
            refund(app, &a).await;
            None
        }
        None => None,
    };
    let mut turn = None;
    let mut slot_wait = None;
    let (grant, outcome, slot) = match (prepaid, ep.mode) {
        (Some(p), _) => {
            turn = p.turn;
            (p.grant, p.outcome, p.slot)
        }
        (None, Mode::Enforce) => {
            turn = Turn::of(app, &ep, headers, who, peer);
            let (grant, slot, waited_slot) = enforce(app, &ep, &label, turn.clone())
                .await
                .map_err(|error| Refused {
                    label: Some(label.clone()),
                    error,
                })?;
            slot_wait = waited_slot;
            (grant, FORWARDED, slot)
        }
        (None, Mode::Shadow) => {
            let shadowing = Box::pin(shadow(app, &ep));
            let (grant, outcome) = shadowing.await;
            (grant, outcome, None)
        }
    };
    trace.waited = grant.waited;
    if ep.mode == Mode::Enforce {
        crate::traces::admitted(trace, grant.waited, slot_wait);
    }
    match ep.mode {
        Mode::Enforce => app.metrics.waited(&label, grant.waited.as_secs_f64()),
        Mode::Shadow => app
            .metrics
            .shadow_wait
            .get_or_create(&EndpointLabels {
                endpoint: label.clone(),
            })
            .observe(grant.waited.as_secs_f64()),
    }
    Ok(Admitted {
        _sending: label.sending(),
        ep,
        label,
        grant,
        outcome,
        addrs,
        slot,
        turn,
        arrived,
        sender: trace.sender.clone(),
    })
}

/// A request's place in its endpoint's queue: its priority class and, for endpoints
/// with `shares`, its sender (the authenticated user, else `X-Sluice-Sender`, else the
/// client address) and that sender's weight. Computed only for queued endpoints.
#[derive(Clone)]
struct Turn {
    class: u8,
    sender: Option<(Arc<str>, f64)>,
}

impl Turn {
    fn of(app: &App, ep: &Resolved, headers: &HeaderMap, who: &Who, peer: IpAddr) -> Option<Turn> {
        let class = match headers.get(&PRIORITY_HEADER).map(|v| v.as_bytes()) {
            Some(b"high") => 0,
            Some(b"low") => 2,
            _ => 1,
        };
        if ep.policy.max_in_flight.is_none() && ep.policy.shares.is_none() {
            // A priority named once queues the endpoint's requests from then on: a
            // `high` request can only pass others still waiting in a queue.
            let prioritized = app.limiter.prioritized();
            if class != 1 {
                prioritized.note(&ep.id);
            } else if !prioritized.has(&ep.id) {
                return None;
            }
        }
        let sender = ep.policy.shares.as_ref().map(|shares| {
            let name: Arc<str> = match (&who.identity, headers.get(&SENDER_HEADER)) {
                (Some(id), _) => Arc::clone(&id.user),
                (None, Some(v)) => String::from_utf8_lossy(v.as_bytes()).into(),
                (None, None) => peer.to_string().into(),
            };
            let weight = shares.weight(&name);
            (name, weight)
        });
        Some(Turn { class, sender })
    }
}

/// Enforced admission: straight to the store, or through the endpoint's queue (for
/// `max_in_flight` and `shares`), recording the slot metrics.
async fn enforce(
    app: &App,
    ep: &Resolved,
    label: &EndpointLabel,
    turn: Option<Turn>,
) -> Result<(Grant, Option<Slot>, Option<std::time::Duration>), ProxyError> {
    // Held while the request waits: waiters are bounded by the memory ceiling.
    let _waiting = crate::budget::wait().ok_or(ProxyError::Overloaded)?;
    let Some(turn) = turn else {
        return admit(app, ep).await.map(|g| (g, None, None));
    };
    let place = Place {
        class: turn.class,
        sender: turn.sender.as_ref().map(|(n, w)| (n, *w)),
    };
    let labels = EndpointLabels {
        endpoint: label.clone(),
    };
    let queued = Box::pin(app.limiter.admit_queued(&ep.id, &ep.policy, place));
    let admitted = queued.await.map_err(|r| refusal(ep, r))?;
    let mut slot = admitted.slot;
    if let Some(s) = &mut slot {
        s.track(app.metrics.in_flight.get_or_create(&labels).clone());
        app.metrics
            .slot_wait
            .get_or_create(&labels)
            .observe(admitted.slot_wait.as_secs_f64());
    }
    let slot_wait = slot.as_ref().map(|_| admitted.slot_wait);
    Ok((admitted.grant, slot, slot_wait))
}

/// A grant that holds no token (a shadow request enforcing would have refused).
const NO_TOKEN: u64 = u64::MAX;

/// Shadow mode: what enforcing would have done, without waiting or refusing.
async fn shadow(app: &App, ep: &Resolved) -> (Grant, &'static str) {
    match app.limiter.shadow(&ep.id, &ep.policy).await {
        Shadow::Wait(grant) => (grant, FORWARDED),
        Shadow::Refuse(r) => {
            let outcome = match r {
                Refusal::RateLimited { .. } => "shadow_rate_limited",
                Refusal::Cooldown { .. } => "shadow_cooldown",
                Refusal::StoreUnavailable => "shadow_store_unavailable",
                Refusal::ConcurrencyLimited { .. } => "shadow_concurrency_limited",
                Refusal::EndpointCapacity => "shadow_endpoint_capacity",
            };
            let nothing = Grant {
                waited: std::time::Duration::ZERO,
                generation: NO_TOKEN,
                start: tokio::time::Instant::now(),
                at_us: None,
            };
            (nothing, outcome)
        }
    }
}

/// Step 2: who sends. Inside a tunnel, the CONNECT's identity (its user still listed
/// in the users file as it is now, with the same password); otherwise this request's
/// `Proxy-Authorization`.
pub(crate) async fn identify(
    rt: &Runtime,
    headers: &HeaderMap,
    conn: &Conn,
) -> Result<Who, ProxyError> {
    if let Some(t) = &conn.tunnel {
        return if t.who.still_admitted(rt) {
            Ok(t.who.clone())
        } else {
            Err(ProxyError::ProxyAuthRequired)
        };
    }
    let from_user = rt.resolver.uses_proxy_user();
    match &rt.users {
        Some(users) => {
            let checking = Box::pin(users.authenticate(headers, conn.peer.ip()));
            let id = checking.await.map_err(|_| ProxyError::ProxyAuthRequired)?;
            let endpoint_hint = id
                .endpoint
                .as_deref()
                .filter(|_| from_user)
                .map(str::to_owned);
            Ok(Who {
                identity: Some(id),
                endpoint_hint,
            })
        }
        None => Ok(Who {
            identity: None,
            endpoint_hint: from_user.then(|| proxy_user(headers)).flatten(),
        }),
    }
}

pub(crate) async fn forward_request(
    app: &Arc<App>,
    mut req: Request<Incoming>,
    conn: &Arc<Conn>,
    trace: &mut Trace,
) -> Result<Response<Body>, Refused> {
    // Refused before anything is spent: a coding under `chunked` cannot be forwarded.
    crate::forward::forwardable_codings(req.headers()).map_err(ProxyError::NotImplemented)?;
    // On hyper's path a sender's end of stream while this waits cancels it.
    let waiting = crate::conn::SenderEof::waiting(req.extensions());
    let (rt, uri, _target, admitted) =
        admit_plain(app, req.uri(), req.headers(), conn, trace).await?;
    drop(waiting);
    let own = [
        rt.resolver.header(),
        &SENDER_HEADER,
        &PRIORITY_HEADER,
        &COST_HEADER,
    ];
    strip_hop_by_hop_and(req.headers_mut(), &own);
    crate::traces::inject(trace, req.headers_mut());
    // The sender's request ID goes on as the receiver's idempotency key.
    if let Some(id) = req.headers_mut().remove(crate::absorb::REQUEST_ID_HEADER) {
        let key = crate::absorb::IDEMPOTENCY_KEY;
        if !req.headers().contains_key(&key) {
            req.headers_mut().insert(key, id);
        }
    }
    // The upstream's Host comes from the target we checked, never from the sender:
    // `send_via` replaces it.
    *req.uri_mut() = uri;
    if req.version() == Version::HTTP_2 {
        join_cookies(req.headers_mut());
    }
    *req.version_mut() = Version::HTTP_11;
    // A request that may be sent again (its receiver's 429 absorbed) has its body read
    // whole first; any other's is watched on the way up (`upstream_timeout` counts a
    // request's silence).
    let body_len = {
        use hyper::body::Body as _;
        match req.body().size_hint().exact() {
            _ if req.body().is_end_stream() => Some(0),
            n => n,
        }
    };
    let mut resend = Resend::plan(&admitted, req.method(), req.headers(), body_len);
    let (req, kept) = match resend {
        Some(_) => {
            let keeping = Box::pin(KeptRequest::read(req, app.forwarder.timeout()));
            match keeping.await {
                Ok(k) => (k.request(), Some(k)),
                Err(e) => return Err(after_admission(app, &admitted, e).await),
            }
        }
        None => (req.map(Upload::new), None),
    };
    trace.outcome = admitted.outcome;
    trace.sent = Some(admitted.label.clone());
    let sent = tokio::time::Instant::now();
    // The exchange runs on a task of its own, as the lane keeps it going: when the
    // sender gives up meanwhile (and this future is dropped), the receiver's answer is
    // still heeded (a 429 starts its cooldown) and the in-flight slot, which is the
    // receiver's, is held until that answer. The answer's body takes the slot on that
    // task too, and a refused address gives its token back there, so a sender gone
    // before the answer's head neither frees the slot while the receiver still sends
    // nor loses the refund.
    let (drain, stall) = (app.forwarder.timeout(), rt.config.proxy.idle_timeout);
    let (app_, conn_) = (Arc::clone(app), Arc::clone(conn));
    let exchange = tokio::spawn(async move {
        let mut admitted = admitted;
        let mut req = Some(req);
        loop {
            let Some(this) = req
                .take()
                .or_else(|| kept.as_ref().map(KeptRequest::request))
            else {
                unreachable!("a request is resent only when its body was kept");
            };
            let sent_to = app_.forwarder.send_via(&conn_.upstream, this).await;
            match &sent_to {
                Ok(r) => {
                    // Counted and heeded here, with the answer: also when the sender is
                    // gone by now.
                    heeded(&app_, &admitted, r.status(), r.headers()).await;
                    if let Some(again) = resend.as_mut() {
                        let (status, headers) = (r.status(), r.headers());
                        if again.again(&app_, &mut admitted, status, headers).await {
                            continue;
                        }
                    }
                }
                Err(ForwardError::Denied(_)) => refund(&app_, &admitted).await,
                Err(_) => {}
            }
            let slot = admitted.slot.take();
            let watch = sent_to
                .as_ref()
                .ok()
                .and_then(|r| BodyWatch::new(&app_, &admitted, r.status(), r.headers(), false));
            let sent_to = sent_to.map(|r| {
                r.map(|body| {
                    HeldBody::new(body, slot, drain, stall).teed(watch.map(BodyWatch::into_tee))
                })
            });
            let retried = resend.map_or(0, |r| r.retried);
            return (sent_to, admitted, retried);
        }
    });
    let (sent_to, admitted, retried) = exchange
        .await
        .map_err(|e| ProxyError::Upstream(e.to_string()))?;
    // Requests go upstream without `Upgrade`: a 101 answers nothing asked, and is no
    // response a sender could use (an HTTP/1.0 one may get no 1xx at all), as the lane
    // says too.
    let sent_to = sent_to.and_then(|r| match r.status() {
        StatusCode::SWITCHING_PROTOCOLS => Err(ForwardError::Other(
            "101 Switching Protocols to a request that asked for no upgrade".into(),
        )),
        // One limit on both engines (the lane's, counted in bytes as they came).
        _ if response_head_len(&r) > crate::limits::MAX_RESPONSE_HEAD_BYTES => {
            Err(ForwardError::Other(format!(
                "upstream response head larger than {} bytes",
                crate::limits::MAX_RESPONSE_HEAD_BYTES
            )))
        }
        _ => Ok(r),
    });
    let resp = match sent_to {
        Ok(r) => r,
        // Refunded on the exchange's task when nothing left for the receiver.
        Err(e) => return Err(refused_after(&admitted, e)),
    };
    trace.upstream = Some(sent.elapsed());
    // The slot went with the body, on the exchange's task.
    counted(app, &admitted, resp.status(), trace);
    let mut resp = resp;
    // Framed twice by the upstream: its chunked framing won (hyper decoded it), so its
    // `Content-Length` says nothing true of the body (RFC 9112 §6.3).
    if resp.headers().contains_key(TRANSFER_ENCODING) {
        resp.headers_mut().remove(CONTENT_LENGTH);
    }
    one_content_length(resp.headers_mut());
    strip_hop_by_hop(resp.headers_mut());
    strip_sluice_headers(resp.headers_mut());
    if retried > 0 {
        trace.retried = retried;
        let n = http::HeaderValue::from(retried);
        resp.headers_mut().insert(crate::absorb::RETRIED_HEADER, n);
    }
    Ok(resp.map(Either::Left))
}

/// The length of `r`'s head as a receiver writes it with single spaces: its status line
/// and each field line (hyper keeps no raw bytes; a receiver's extra whitespace is not
/// counted).
fn response_head_len<B>(r: &Response<B>) -> usize {
    let reason = r.status().canonical_reason().map_or(0, str::len);
    let fields: usize = r
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    "HTTP/1.1 200 \r\n".len() + reason + fields + 2
}

/// A request kept whole to be sent again ([`Resend`]): its head as it goes upstream and
/// its body, read before the first send.
struct KeptRequest {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
}

impl KeptRequest {
    /// Reads `req`'s body whole (its length is known and small: [`Resend::plan`]); a
    /// sender silent for `limit` is stalled.
    async fn read(
        req: Request<Incoming>,
        limit: std::time::Duration,
    ) -> Result<KeptRequest, ForwardError> {
        use http_body_util::BodyExt;
        let (parts, body) = req.into_parts();
        let body = match tokio::time::timeout(limit, body.collect()).await {
            Ok(Ok(c)) => c.to_bytes(),
            Ok(Err(e)) => return Err(ForwardError::SenderBody(e.to_string())),
            Err(_) => return Err(ForwardError::SenderStalled(limit)),
        };
        Ok(KeptRequest {
            method: parts.method,
            uri: parts.uri,
            headers: parts.headers,
            body,
        })
    }

    /// The request, to send (again).
    fn request(&self) -> Request<Upload> {
        let mut req = Request::new(Upload::kept(self.body.clone()));
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = self.headers.clone();
        req
    }
}

/// Says the upstream's `Content-Length` once: a repeated or listed equal value is one
/// value (RFC 9110 §8.6), and hyper's server refuses to write the header twice (it
/// drops the connection unanswered). Unequal values (left only on a `HEAD` answer,
/// since hyper's client refuses them with a body) say nothing true: removed.
fn one_content_length(h: &mut HeaderMap) {
    let mut all = h.get_all(CONTENT_LENGTH).iter();
    let Some(first) = all.next() else {
        return;
    };
    if all.next().is_none() && !first.as_bytes().contains(&b',') {
        return;
    }
    let mut one: Option<u64> = None;
    let mut equal = true;
    for value in h.get_all(CONTENT_LENGTH) {
        let n = content_length_list(value.as_bytes());
        equal &= n.is_some() && (one.is_none() || one == n);
        one = one.or(n);
    }
    match one.filter(|_| equal) {
        Some(n) => {
            h.insert(CONTENT_LENGTH, http::HeaderValue::from(n));
        }
        None => {
            h.remove(CONTENT_LENGTH);
        }
    }
}

/// Steps 1–6 of the module doc for a request that is forwarded (not a CONNECT): the
/// target checked, the sender identified, the request admitted. Returns the
/// configuration it was admitted under, the absolute URI to forward to and its checked
/// target. Both HTTP engines (hyper's, and the plain lane of [`crate::lane`]) call it.
pub(crate) async fn admit_plain(
    app: &App,
    uri: &Uri,
    headers: &HeaderMap,
    conn: &Conn,
    trace: &mut Trace,
) -> Result<(Arc<Runtime>, Uri, Arc<Target>, Admitted), Refused> {
    trace.spans = app.traces.begin(headers);
    let rt = app.runtime.load_full();
    let uri = target_uri(uri, conn.tunnel.as_ref())?;
    let default_port = if uri.scheme() == Some(&Scheme::HTTPS) {
        443
    } else {
        80
    };
    let authority = uri
        .authority()
        .ok_or_else(|| ProxyError::BadRequest(format!("no host in {uri}")))?;
    let target = conn.target.of(authority, default_port)?;
    // Userinfo in the target (`http://user:secret@host/`) never reaches the log.
    trace.destination = if authority.as_str().as_bytes().contains(&b'@') {
        target.authority().ok()
    } else {
        Some(authority.clone())
    };
    // Only a name with several values can be a second Host: counting names against
    // values costs nothing, a lookup hashes the name.
    if headers.len() != headers.keys_len() && headers.get_all(HOST).iter().count() > 1 {
        return Err(ProxyError::BadRequest("more than one Host header".into()).into());
    }
    let who = identify(&rt, headers, conn).await?;
    trace.user = who.identity.as_ref().map(|i| Arc::clone(&i.user));
    let ask = Asking {
        headers,
        who: &who,
        target: &target,
        path: uri.path(),
        resolve_dns: false,
        peer: conn.peer.ip(),
        last: &conn.endpoint,
        prepaid: conn.tunnel.as_ref().map(|_| &conn.prepaid),
        inherited: conn.tunnel.as_ref().and_then(|t| t.endpoint.as_ref()),
    };
    let admitted = admission(app, &rt, ask, trace).await?;
    Ok((rt, uri, target, admitted))
}

/// A request that may be sent again when its receiver refuses it ([`crate::absorb`]).
pub(crate) struct Resend {
    /// Resends still allowed.
    left: u32,
    /// Resends made so far (`X-Sluice-Retried`).
    pub(crate) retried: u32,
}

impl Resend {
    /// The resends `admitted` may have (`body`: its body's length, `None` when
    /// unknown), or `None` when it is never resent.
    pub(crate) fn plan(
        admitted: &Admitted,
        method: &Method,
        headers: &HeaderMap,
        body: Option<u64>,
    ) -> Option<Resend> {
        let ep = &admitted.ep;
        crate::absorb::attempts(&ep.policy, ep.mode, method, headers, body)
            .map(|left| Resend { left, retried: 0 })
    }

    /// After the receiver's answer, already heeded (its cooldown started): whether to
    /// send the request again. True when the answer is a refusal whose cooldown ends
    /// within what is left of the request's `max_wait` and the request was admitted
    /// again within it, behind that cooldown and the bucket as any waiter (`admitted`
    /// then holds the new grant and slot). False: the answer is the sender's.
    pub(crate) async fn again(
        &mut self,
        app: &App,
        admitted: &mut Admitted,
        status: StatusCode,
        headers: &HeaderMap,
    ) -> bool {
        if self.left == 0 {
            return false;
        }
        let policy = &admitted.ep.policy;
        let Some(adaptive) = policy.adaptive.as_ref() else {
            return false;
        };
        let now = SystemTime::now();
        let Some(pause) = crate::absorb::refusal_pause(status, headers, adaptive, now) else {
            return false;
        };
        let budget = policy.max_wait.saturating_sub(admitted.arrived.elapsed());
        if pause > budget {
            return false;
        }
        // The refused attempt's slot goes first: with `max_in_flight = 1` the resend
        // would otherwise wait for itself.
        drop(admitted.slot.take());
        let within = Policy {
            max_wait: budget,
            ..(**policy).clone()
        };
        let ep = Resolved {
            id: Arc::clone(&admitted.ep.id),
            policy: Arc::new(within),
            mode: admitted.ep.mode,
            by_host: admitted.ep.by_host,
        };
        let waiting = Box::pin(enforce(app, &ep, &admitted.label, admitted.turn.clone()));
        match waiting.await {
            Ok((grant, slot, _)) => {
                admitted.grant = grant;
                admitted.slot = slot;
                self.left -= 1;
                self.retried += 1;
                app.metrics
                    .absorbed
                    .get_or_create(&EndpointLabels {
                        endpoint: admitted.label.clone(),
                    })
                    .inc();
                true
            }
            Err(e) => {
                tracing::debug!(
                    endpoint = %admitted.ep.id,
                    reason = e.reason(),
                    "refusal passed on: no token within the wait budget"
                );
                false
            }
        }
    }
}

/// The upstream answered an admitted request: counts the answer's code and feeds it to
/// the endpoint's adaptive state when it carries something (429s, 503 +
/// `Retry-After`, quota headers). A resend may follow ([`Resend::again`]).
pub(crate) async fn heeded(
    app: &App,
    admitted: &Admitted,
    status: StatusCode,
    headers: &HeaderMap,
) {
    heed(app, admitted, status, headers).await;
    app.metrics.upstream_code(&admitted.label, status.as_u16());
}

/// The final answer to an admitted request: counts and traces its outcome. Returns the
/// in-flight slot, to hold until the response body ends.
pub(crate) fn final_answer(
    app: &App,
    admitted: Admitted,
    status: StatusCode,
    trace: &mut Trace,
) -> Option<Slot> {
    counted(app, &admitted, status, trace);
    admitted.slot
}

/// Feeds an answer to the endpoint's adaptive state when it carries something (429s,
/// 503 + `Retry-After`, quota headers).
async fn heed(app: &App, admitted: &Admitted, status: StatusCode, headers: &HeaderMap) {
    let ep = &admitted.ep;
    if let (Some(adaptive), true) = (ep.policy.adaptive, adapt::worth_reading(status, headers)) {
        let label = &admitted.label;
        let observing = Box::pin(observe(app, ep, label, &adaptive, status, headers));
        observing.await;
        if crate::learned::learns(&ep.policy) {
            Box::pin(learn(app, ep, &adaptive, headers)).await;
        }
    }
}

/// Takes in the quota an answer's headers publish (`[defaults.adaptive] learn`); a pace
/// much slower than the one reservations were made at voids them, on every replica,
/// with a 1 ms pause (no decrease). A quota header that cannot be read is ignored, with
/// a warning at most once a minute per endpoint.
async fn learn(app: &App, ep: &Resolved, adaptive: &Adaptive, headers: &http::HeaderMap) {
    let learned = app.limiter.learned();
    let dialect = ep.policy.receiver.quota_headers;
    let published = match adapt::published(headers, SystemTime::now(), dialect) {
        Ok(Some(p)) => p,
        Ok(None) => return,
        Err(header) => {
            if learned.warn_now(&ep.id) {
                tracing::warn!(endpoint = %ep.id, header, "a quota header could not be read: ignored");
            }
            return;
        }
    };
    let Some(change) = learned.learn(&ep.id, &ep.policy, published) else {
        return;
    };
    if !change.void {
        return;
    }
    let lowered = learned.apply(&ep.id, &ep.policy);
    let ask = Ask::new(&lowered, 0.0, None);
    let pause = std::time::Duration::from_millis(1);
    match app
        .limiter
        .store()
        .feedback(&ep.id, ask, *adaptive, pause, false)
        .await
    {
        Ok(()) => tracing::info!(
            endpoint = %ep.id,
            rate = change.rate,
            remaining = published.remaining,
            reset_ms = published.reset.as_millis() as u64,
            source = published.source,
            "receiver published its quota: pace lowered until its reset"
        ),
        Err(e) => {
            tracing::warn!(endpoint = %ep.id, error = %e, "could not record upstream feedback")
        }
    }
}

/// Reads a throttling answer's body for the wait it names (`retry_after_json`) as it
/// passes on to the sender unchanged, then lengthens the endpoint's cooldown to that
/// wait: the answer's head, which named none, started the default one.
pub(crate) struct BodyWatch {
    hint: adapt::BodyHint,
    app: Arc<App>,
    ep: Resolved,
    full: bool,
}

impl BodyWatch {
    /// A watch over the body of `admitted`'s answer when it is a 429 or 503 whose headers
    /// name no wait, to an adaptive endpoint with `retry_after_json`; `chunked` when its
    /// bytes come with their chunk framing.
    pub(crate) fn new(
        app: &Arc<App>,
        admitted: &Admitted,
        status: StatusCode,
        headers: &HeaderMap,
        chunked: bool,
    ) -> Option<BodyWatch> {
        let policy = &admitted.ep.policy;
        policy.adaptive?;
        let pointer =
            adapt::body_hint_wanted(status, headers, policy.receiver.retry_after_json.as_ref())?;
        Some(BodyWatch {
            hint: adapt::BodyHint::new(pointer, chunked),
            app: Arc::clone(app),
            ep: admitted.ep.clone(),
            full: false,
        })
    }

    /// Bytes of the body as they pass on.
    pub(crate) fn feed(&mut self, bytes: &[u8]) {
        if !self.full {
            self.full = self.hint.feed(bytes);
        }
    }

    /// The body ended (or its first `adapt::MAX_HINT_BODY` bytes came): the wait it
    /// names, if any, lengthens the cooldown, on a task of its own.
    pub(crate) fn finish(self) {
        let Some(wait) = self.hint.wait() else {
            return;
        };
        let heeding = async move { heed_body_wait(&self.app, &self.ep, wait).await };
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            drop(rt.spawn(heeding));
        }
    }

    /// The watch as a [`crate::limiter::slot::Tee`] for hyper's path.
    pub(crate) fn into_tee(self) -> crate::limiter::slot::Tee {
        let mut watch = Some(self);
        Box::new(move |data| match data {
            Some(bytes) => {
                if let Some(w) = watch.as_mut() {
                    w.feed(bytes);
                }
            }
            None => {
                if let Some(w) = watch.take() {
                    w.finish();
                }
            }
        })
    }
}

/// Lengthens `ep`'s cooldown to `wait`, read from a throttling answer's body: a pause
/// without a decrease (the answer's head already counted as a throttle).
async fn heed_body_wait(app: &App, ep: &Resolved, wait: std::time::Duration) {
    let Some(adaptive) = ep.policy.adaptive else {
        return;
    };
    let least = std::time::Duration::from_millis(1);
    let pause = wait.clamp(least, adaptive.max_cooldown.max(least));
    let ask = Ask::new(&ep.policy, 0.0, None);
    match app
        .limiter
        .store()
        .feedback(&ep.id, ask, adaptive, pause, false)
        .await
    {
        Ok(()) => tracing::info!(
            endpoint = %ep.id,
            pause_ms = pause.as_millis() as u64,
            "receiver's answer body named its wait: cooldown set to it"
        ),
        Err(e) => {
            tracing::warn!(endpoint = %ep.id, error = %e, "could not record upstream feedback")
        }
    }
}

/// Counts the outcome of an answered request and traces it (its status code is
/// counted with the answer, where the exchange ran).
fn counted(app: &App, admitted: &Admitted, status: StatusCode, trace: &mut Trace) {
    trace.status = Some(status.as_u16());
    trace.outcome = admitted.outcome;
    let sender = admitted.sender.as_ref();
    app.metrics
        .outcome(&admitted.label, sender, admitted.outcome);
}

/// A send that failed after admission: when nothing left for the receiver (the resolved
/// address was refused), the token goes back. A request whose head left keeps it spent,
/// whatever then became of its body (malformed, cut short, stalled): a receiver that
/// counts requests as their heads arrive (its own limiter, a WAF) has counted it, and
/// refunding would let a sender that breaks its bodies send heads without limit (before,
/// 30 abandoned uploads reached a receiver in 1 s against a bound of 8).
pub(crate) async fn after_admission(app: &App, a: &Admitted, e: ForwardError) -> Refused {
    if matches!(e, ForwardError::Denied(_)) {
        refund(app, a).await;
    }
    refused_after(a, e)
}

/// Gives back the token of an admitted request that never left (its address was
/// refused).
pub(crate) async fn refund(app: &App, a: &Admitted) {
    if a.grant.generation != NO_TOKEN {
        app.limiter.refund(&a.ep.id, &a.ep.policy, a.grant).await;
    }
}

/// The refusal answering a send that failed after admission (any refund made).
fn refused_after(a: &Admitted, e: ForwardError) -> Refused {
    Refused {
        label: Some(a.label.clone()),
        error: upstream_error(e),
    }
}

/// The absolute URI to forward to: the request's own, or rebuilt from the tunnel's
/// CONNECT authority for requests inside a tunnel (`https://` inside an intercepted TLS
/// session, `http://` inside a tunnel carrying plain HTTP).
fn target_uri(uri: &Uri, tunnel: Option<&Tunnel>) -> Result<Uri, ProxyError> {
    match (uri.authority(), tunnel) {
        (Some(_), None) => match uri.scheme() {
            Some(s) if *s == Scheme::HTTP || *s == Scheme::HTTPS => Ok(uri.clone()),
            _ => Err(ProxyError::BadRequest(format!(
                "unsupported scheme in {uri}"
            ))),
        },
        (None, None) => Err(ProxyError::NotAProxyRequest),
        // `GET host:port` (authority-form) is CONNECT's alone: inside a tunnel it would
        // go out as `/`, another resource than the one named.
        (Some(_), Some(_)) if uri.scheme().is_none() => Err(ProxyError::BadRequest(format!(
            "request target {uri} inside a tunnel is neither a path nor a URL"
        ))),
        // `GET *` (asterisk-form, OPTIONS' alone) went to the receiver as it came; it is
        // refused inside a tunnel as it is outside one.
        (None, Some(_)) if uri.path() == "*" => Err(ProxyError::BadRequest(
            "request target * (asterisk-form) is not forwarded".into(),
        )),
        (_, Some(t)) => {
            let pq = uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/"));
            let scheme = if t.tls { Scheme::HTTPS } else { Scheme::HTTP };
            Uri::builder()
                .scheme(scheme)
                .authority(t.authority.clone())
                .path_and_query(pq)
                .build()
                .map_err(|e| ProxyError::BadRequest(e.to_string()))
        }
    }
}

/// Waits for the endpoint's token, mapping refusals to [`ProxyError`].
async fn admit(app: &App, ep: &Resolved) -> Result<Grant, ProxyError> {
    app.limiter
        .admit(&ep.id, &ep.policy)
        .await
        .map_err(|r| refusal(ep, r))
}

fn refusal(ep: &Resolved, r: Refusal) -> ProxyError {
    let endpoint = ep.id.to_string();
    match r {
        Refusal::RateLimited { retry_after } => ProxyError::RateLimited {
            endpoint,
            retry_after,
        },
        Refusal::Cooldown { retry_after } => ProxyError::Cooldown {
            endpoint,
            retry_after,
        },
        Refusal::ConcurrencyLimited { retry_after } => ProxyError::ConcurrencyLimited {
            endpoint,
            retry_after,
        },
        Refusal::StoreUnavailable => ProxyError::StoreUnavailable { endpoint },
        Refusal::EndpointCapacity => ProxyError::EndpointCapacity { endpoint },
    }
}

fn upstream_error(e: ForwardError) -> ProxyError {
    match e {
        ForwardError::Denied(d) => d.into(),
        ForwardError::Timeout(t) => ProxyError::UpstreamTimeout(t),
        ForwardError::SenderStalled(t) => ProxyError::RequestTimeout(t),
        e @ ForwardError::SenderBody(_) => ProxyError::BadRequest(e.to_string()),
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
        app.metrics.note_throttled(&ep.id);
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

/// How long the grant a non-intercepted CONNECT took stays its first request's, from
/// the grant: a sender that tunnels plain HTTP sends its request at once. A tunnel
/// silent for longer (a pooled tunnel the sender did not use yet) gives the token
/// back, and its first request, whenever it comes, is admitted on its own: a grant
/// is neither hoarded and spent beside later ones, nor wasted on a tunnel that carries
/// nothing.
pub(crate) const PREPAID_FOR: std::time::Duration = std::time::Duration::from_millis(500);

/// The admission a non-intercepted CONNECT took, kept for the first plain request
/// inside its tunnel (see [`PREPAID_FOR`]).
#[derive(Default)]
pub struct Prepaid(std::sync::Mutex<Option<(Admitted, tokio::time::Instant)>>);

/// What a tunnel's kept admission is to a request inside it.
pub(crate) enum Prepaying {
    /// Its own: the request leaves on it.
    Yours(Admitted),
    /// Another endpoint's, or stale: its token goes back.
    Unused(Admitted),
}

impl Prepaid {
    pub(crate) fn arm(&self, admitted: Admitted, until: tokio::time::Instant) {
        if let Ok(mut kept) = self.0.lock() {
            *kept = Some((admitted, until));
        }
    }

    /// The kept admission, once: the request's own when it is for `endpoint` and still
    /// fresh, else unused.
    pub(crate) fn take_for(&self, endpoint: &str) -> Option<Prepaying> {
        let (admitted, until) = self.0.lock().ok()?.take()?;
        let fresh = tokio::time::Instant::now() <= until;
        Some(if *admitted.ep.id == *endpoint && fresh {
            Prepaying::Yours(admitted)
        } else {
            Prepaying::Unused(admitted)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::metrics::Metrics;

    fn runtime(text: &str) -> Arc<Runtime> {
        Arc::new(Runtime::load(Arc::new(Config::parse(text).unwrap())).unwrap())
    }

    /// The remembered target answers only for the same authority text and default
    /// port; anything else is parsed and checked afresh (and a bad one still refused).
    #[test]
    fn the_last_target_is_reused_only_for_the_same_authority() {
        let last = LastTarget::default();
        let of = |text: &str, port: u16| {
            last.of(&text.parse::<Authority>().unwrap(), port)
                .map(|t| (t.host.clone(), t.port))
        };
        assert_eq!(of("A.Example.", 80).unwrap(), ("a.example".into(), 80));
        assert_eq!(of("A.Example.", 80).unwrap(), ("a.example".into(), 80));
        assert_eq!(of("A.Example.", 443).unwrap(), ("a.example".into(), 443));
        assert_eq!(
            of("b.example:8080", 80).unwrap(),
            ("b.example".into(), 8080)
        );
        assert_eq!(of("[::1]:9", 80).unwrap(), ("::1".into(), 9));
        assert!(
            of("b.example:0", 80).is_err(),
            "a bad port after a good target"
        );
        assert!(of("a..b", 80).is_err(), "an empty label");
        assert_eq!(
            of("b.example:8080", 80).unwrap(),
            ("b.example".into(), 8080)
        );
    }

    /// A remembered endpoint is reused only when it is named the same way (the same
    /// header bytes, or the same host) under the same configuration: a reload (a new
    /// runtime) resolves afresh, with the new policy.
    #[test]
    fn the_last_endpoint_is_reused_only_under_its_configuration() {
        let before = runtime("[[endpoints]]\nid = \"a\"\nrate = 5.0\n");
        let after = runtime("[[endpoints]]\nid = \"a\"\nrate = 7.0\n");
        let metrics = Metrics::new(10, std::iter::empty());
        let mut headers = HeaderMap::new();
        headers.insert("x-endpoint-id", http::HeaderValue::from_static("a"));
        let h = Named::Header(headers.get("x-endpoint-id").unwrap());
        let ep = before
            .resolver
            .resolve(&headers, None, "x.example", 80, "/")
            .unwrap();
        let label = metrics.label(&ep.id);
        let last = LastEndpoint::default();
        assert!(last.recall(&before, &h).is_none(), "nothing remembered yet");
        last.remember(&before, &h, &ep, &label);
        let (again, _) = last.recall(&before, &h).expect("same header, same config");
        assert_eq!((&*again.id, again.policy.rate), ("a", 5.0));
        let other = http::HeaderValue::from_static("b");
        assert!(
            last.recall(&before, &Named::Header(&other)).is_none(),
            "another endpoint"
        );
        assert!(
            last.recall(&before, &Named::Host("a")).is_none(),
            "a host that reads like the header is another way of naming"
        );
        assert!(
            last.recall(&after, &h).is_none(),
            "a reloaded configuration"
        );
        // The old configuration gone: its address cannot come back to match.
        drop(before);
        assert!(last.recall(&after, &h).is_none());

        let host = Named::Host("x.example");
        last.remember(&after, &host, &ep, &label);
        assert!(
            last.recall(&after, &host).is_some(),
            "same host, same config"
        );
        assert!(last.recall(&after, &Named::Host("y.example")).is_none());
        assert!(last.recall(&after, &Named::Header(&other)).is_none());
    }

    #[test]
    fn a_repeated_equal_content_length_is_said_once_and_unequal_ones_not_at_all() {
        let said = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(CONTENT_LENGTH, v.parse().unwrap());
            }
            one_content_length(&mut h);
            let all: Vec<_> = h.get_all(CONTENT_LENGTH).iter().cloned().collect();
            all.iter()
                .map(|v| v.to_str().unwrap().to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(said(&["5"]), ["5"]);
        assert_eq!(said(&["5", "5"]), ["5"]);
        assert_eq!(said(&["5, 5"]), ["5"]);
        assert_eq!(said(&["5", "6"]), Vec::<String>::new());
        assert_eq!(said(&["5, x"]), Vec::<String>::new());
        assert_eq!(said(&[]), Vec::<String>::new());
    }

    #[test]
    fn hosts_and_ports_are_read_from_the_authority() {
        let ok = |a: &str, default: u16| {
            let auth: Authority = a.parse().unwrap();
            host_and_port(&auth, default)
                .map(|(h, p)| (h.to_owned(), p))
                .map_err(|e| e.to_string())
        };
        assert_eq!(ok("a.example", 80), Ok(("a.example".into(), 80)));
        assert_eq!(ok("a.example:8080", 80), Ok(("a.example".into(), 8080)));
        assert_eq!(ok("u:p@a.example:81", 80), Ok(("a.example".into(), 81)));
        assert_eq!(ok("[::1]", 443), Ok(("[::1]".into(), 443)));
        assert_eq!(ok("[::1]:9000", 443), Ok(("[::1]".into(), 9000)));
        assert_eq!(ok("10.0.0.1:1", 80), Ok(("10.0.0.1".into(), 1)));
        for bad in [
            "a.example:0",
            "a.example:65536",
            "a.example:",
            "[::1]:",
            "[::1]:0",
        ] {
            assert!(ok(bad, 80).is_err(), "{bad} must be refused");
        }
        // What the http crate itself calls the host, for every accepted form.
        for a in [
            "a.example",
            "a.example:8080",
            "u:p@a.example:81",
            "[::1]:9000",
            "[::1]",
        ] {
            let auth: Authority = a.parse().unwrap();
            assert_eq!(host_and_port(&auth, 1).unwrap().0, auth.host(), "{a}");
        }
    }
}
