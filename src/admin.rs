//! The admin listener: `/metrics`, `/healthz`, `/readyz`, `/endpoints`,
//! `/endpoints/{id}` (one endpoint and its busiest senders), the console page `/ui`, and
//! the [`EndpointView`] rows that `/endpoints`, the console, `sluice status` and
//! `sluice top` share.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use serde::{Deserialize, Serialize};

use crate::config::OnError;
use crate::core::App;
use crate::error::Body;
use crate::limiter::{Ask, StoreHealth};

/// One endpoint as operators see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointView {
    /// Endpoint ID.
    pub id: String,
    /// True when listed in `[[endpoints]]`.
    pub configured: bool,
    /// Configured rate (tokens/s).
    pub configured_rate: f64,
    /// Current effective rate (lower after 429s, climbing back).
    pub rate: f64,
    /// Capacity.
    pub burst: f64,
    /// Tokens now in the store (negative: reservations outstanding, requests sleeping
    /// until their start; the table shows 0 and counts them in `waiting`).
    pub tokens: f64,
    /// `enforce`, or `shadow` (nothing waits or is refused: the bucket only measures).
    /// Absent from older servers' answers: `enforce`.
    #[serde(default = "enforce")]
    pub mode: String,
    /// Cooldown left, milliseconds.
    pub cooldown_ms: u64,
    /// Throttling responses (429s) seen.
    pub throttles: u64,
    /// Whether the rate sits at its adaptive floor.
    pub at_floor: bool,
    /// How long it has sat at the floor, seconds.
    pub at_floor_secs: f64,
    /// Tokens replicas took ahead and may still spend (`store.prefetch`), not in
    /// `tokens` meanwhile. Absent from older servers' answers: 0.
    #[serde(default)]
    pub held_ahead: f64,
    /// Each sliding window (`windows`) and its use. Absent from older servers' answers,
    /// and for an endpoint without windows: empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub windows: Vec<WindowView>,
    /// Requests waiting on this replica: in the endpoint's queue, or holding a reserved
    /// start and sleeping until it. Absent from older servers' answers: 0.
    #[serde(default)]
    pub waiting: u64,
    /// The queued part of `waiting` by priority (`X-Sluice-Priority`); requests
    /// holding a reserved start are not broken down.
    #[serde(default)]
    pub waiting_by_priority: ByPriority,
    /// Requests admitted on this replica and not yet answered (a tunnel relayed as bytes
    /// until it closes).
    #[serde(default)]
    pub in_flight: u64,
    /// How long the longest-waiting request on this replica has waited, milliseconds.
    #[serde(default)]
    pub oldest_wait_ms: u64,
    /// Refusals of pacing (`rate_limited`, `cooldown`, `concurrency_limited`,
    /// `store_unavailable`) on this replica in the last minute.
    #[serde(default)]
    pub refused_1m: u64,
    /// Requests forwarded by this replica since it started (what the console charts as
    /// sent/s).
    #[serde(default)]
    pub sent: u64,
    /// The quota the receiver last published to this replica and the pace it leaves
    /// (`[defaults.adaptive] learn`), while that pace holds.
    #[serde(default)]
    pub learned: Option<crate::learned::LearnedView>,
}

fn enforce() -> String {
    "enforce".into()
}

/// `GET /endpoints/{id}`: one endpoint's view and its busiest senders.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointDetail {
    /// What `/endpoints` says of it.
    #[serde(flatten)]
    pub view: EndpointView,
    /// The minutes `senders` covers (the current one, partly, and those before it).
    pub senders_minutes: u64,
    /// Its busiest senders over those minutes on this replica, busiest first (at most
    /// [`TOP_SENDERS`]); empty for an endpoint past `metrics_max_endpoints`, whose
    /// requests count under `_other`.
    pub senders: Vec<crate::metrics::SenderCount>,
}

/// The most senders `/endpoints/{id}` lists.
pub const TOP_SENDERS: usize = 20;

/// One sliding window of an endpoint as operators see it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WindowView {
    /// Cost units allowed in any interval of `per_ms`.
    pub limit: u64,
    /// The interval, milliseconds.
    pub per_ms: u64,
    /// Cost units started in the last `per_ms`.
    pub used: f64,
    /// Cost units reserved to start later (requests sleeping until their start).
    pub ahead: f64,
}

impl WindowView {
    /// The window's `per` as config spells it (`"4s"`, `"1h"`): the `per` label of
    /// `sluice_window_used`.
    pub fn per(&self) -> String {
        let ms = self.per_ms;
        match ms {
            _ if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
            _ if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
            _ if ms % 1000 == 0 => format!("{}s", ms / 1000),
            _ => format!("{ms}ms"),
        }
    }
}

/// The windows of `policy` with their use in `view` (none used without a view).
fn window_views(
    policy: &crate::config::Policy,
    view: Option<&crate::limiter::View>,
) -> Vec<WindowView> {
    let list = policy.windows.as_slice();
    list.iter()
        .enumerate()
        .map(|(i, w)| {
            let u = view.map(|v| v.windows[i]).unwrap_or_default();
            WindowView {
                limit: w.limit as u64,
                per_ms: (w.per_us / 1000.0).round() as u64,
                used: u.used,
                ahead: u.ahead,
            }
        })
        .collect()
}

/// Queued requests by priority class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ByPriority {
    /// `X-Sluice-Priority: high`.
    pub high: u64,
    /// No priority named.
    pub normal: u64,
    /// `X-Sluice-Priority: low`.
    pub low: u64,
}

/// Views of every known endpoint: configured ones, then those seen (label-capped, plus
/// those past the cap a receiver throttled).
pub async fn endpoint_views(app: &App) -> Vec<EndpointView> {
    let rt = app.runtime.load_full();
    let mut ids: Vec<(Arc<str>, bool)> = rt
        .resolver
        .configured()
        .map(|(id, _)| (Arc::clone(id), true))
        .collect();
    let mut seen = app.metrics.watched_ids();
    seen.sort();
    for id in seen {
        if !ids.iter().any(|(k, _)| *k == id) {
            ids.push((id, false));
        }
    }
    let parked = app.limiter.parked();
    let mut out = Vec::with_capacity(ids.len());
    for (id, configured) in ids {
        out.push(endpoint_view(app, &rt, &parked, id, configured).await);
    }
    out
}

/// `GET /endpoints/{id}`: `None` when the endpoint is not one `/endpoints` lists.
pub async fn endpoint_detail(app: &App, id: &str) -> Option<EndpointDetail> {
    let rt = app.runtime.load_full();
    let id: Arc<str> = id.into();
    let configured = rt.resolver.configured().any(|(k, _)| *k == id);
    if !configured && !app.metrics.watched_ids().contains(&id) {
        return None;
    }
    let parked = app.limiter.parked();
    let view = endpoint_view(app, &rt, &parked, Arc::clone(&id), configured).await;
    let label = app.metrics.existing_label(&id);
    let senders = if app.metrics.is_other(&label) {
        Vec::new()
    } else {
        label.top_senders(TOP_SENDERS)
    };
    Some(EndpointDetail {
        view,
        senders_minutes: crate::metrics::TOP_MINUTES,
        senders,
    })
}

/// One endpoint's view.
async fn endpoint_view(
    app: &App,
    rt: &crate::core::Runtime,
    parked: &std::collections::HashMap<Arc<str>, crate::limiter::Waits>,
    id: Arc<str>,
    configured: bool,
) -> EndpointView {
    let waits = parked.get(&id).copied().unwrap_or_default();
    // Counted per metrics label: an endpoint past the label cap shares `_other`'s.
    let label = Some(app.metrics.existing_label(&id)).filter(|l| !app.metrics.is_other(l));
    let of_label = |f: fn(&crate::metrics::EndpointLabel) -> u64| label.as_ref().map_or(0, f);
    let policy = rt.resolver.policy_of(&id);
    let ask = Ask::new(&policy, 0.0, None);
    let floor = policy.adaptive.map(|a| a.floor);
    let view = app
        .limiter
        .store()
        .view(&id, ask, floor)
        .await
        .ok()
        .flatten();
    EndpointView {
        id: id.to_string(),
        configured,
        configured_rate: policy.rate,
        rate: view.map_or(policy.rate, |v| v.rate),
        burst: policy.burst,
        tokens: view.map_or(policy.burst, |v| v.tokens),
        mode: match rt.resolver.mode_of(&id) {
            crate::config::Mode::Enforce => "enforce",
            crate::config::Mode::Shadow => "shadow",
        }
        .into(),
        cooldown_ms: view.map_or(0, |v| (v.cooldown_us / 1000.0).ceil() as u64),
        throttles: view.map_or(0, |v| v.throttles),
        at_floor: view.is_some_and(|v| v.at_floor),
        at_floor_secs: view.map_or(0.0, |v| v.floor_for_us / 1e6),
        held_ahead: view.map_or(0.0, |v| v.held_ahead),
        windows: window_views(&policy, view.as_ref()),
        waiting: waits.total() as u64,
        waiting_by_priority: ByPriority {
            high: waits.queued[0] as u64,
            normal: waits.queued[1] as u64,
            low: waits.queued[2] as u64,
        },
        in_flight: of_label(crate::metrics::EndpointLabel::in_flight),
        oldest_wait_ms: waits.oldest.as_millis() as u64,
        refused_1m: of_label(crate::metrics::EndpointLabel::refused_last_minute),
        sent: of_label(crate::metrics::EndpointLabel::forwarded),
        learned: app.limiter.learned().view(&id),
    }
}

/// Serves one admin request.
pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Response<Body> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n", "text/plain");
        // RFC 9110 §15.5.6: a 405 says which methods are allowed.
        r.headers_mut()
            .insert(http::header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    let path = req.uri().path();
    let guarded =
        matches!(path, "/metrics" | "/endpoints" | "/ui") || path.starts_with("/endpoints/");
    if guarded && !authorised(&app, req.headers()) {
        let mut r = text(
            StatusCode::UNAUTHORIZED,
            "send Authorization: Bearer <the token in proxy.admin_token_file> (or Basic \
             with the token as password)\n",
            "text/plain",
        );
        // A browser asks for a Basic password, and sends it on with the page's polls.
        let challenge = if path == "/ui" {
            "Basic realm=\"sluice-admin\", charset=\"UTF-8\""
        } else {
            "Bearer realm=\"sluice-admin\""
        };
        r.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static(challenge),
        );
        return r;
    }
    match path {
        "/ui" => console(),
        "/" => {
            let mut r = text(StatusCode::SEE_OTHER, "see /ui\n", "text/plain");
            r.headers_mut()
                .insert(http::header::LOCATION, HeaderValue::from_static("/ui"));
            r
        }
        "/metrics" => text(
            StatusCode::OK,
            app.metrics.render(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
        "/healthz" => text(StatusCode::OK, "ok\n", "text/plain"),
        "/readyz" => readyz(&app).await,
        "/endpoints" => {
            let views = endpoint_views(&app).await;
            let body = serde_json::to_string_pretty(&views).unwrap_or_else(|_| "[]".into());
            text(StatusCode::OK, body, "application/json")
        }
        _ => match path.strip_prefix("/endpoints/").map(percent_decoded) {
            Some(Some(id)) => match endpoint_detail(&app, &id).await {
                Some(detail) => {
                    let body =
                        serde_json::to_string_pretty(&detail).unwrap_or_else(|_| "{}".into());
                    text(StatusCode::OK, body, "application/json")
                }
                None => text(
                    StatusCode::NOT_FOUND,
                    format!("no endpoint {id:?} known: see /endpoints\n"),
                    "text/plain",
                ),
            },
            _ => text(
                StatusCode::NOT_FOUND,
                "not found: try /ui /metrics /healthz /readyz /endpoints /endpoints/{id}\n",
                "text/plain",
            ),
        },
    }
}

/// A path segment with its `%XX` escapes decoded; `None` when they are not valid
/// UTF-8 or the segment is empty.
fn percent_decoded(segment: &str) -> Option<String> {
    let b = segment.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok().filter(|s| !s.is_empty())
}

/// Whether the request may read `/metrics`, `/endpoints` and `/ui`: always when no
/// admin token is configured; otherwise only with `Authorization: Bearer <token>`, or
/// `Basic` with the token as password (any user name: what a browser sends once asked),
/// compared in constant time. `/healthz` and `/readyz` stay open for probes.
fn authorised(app: &App, headers: &http::HeaderMap) -> bool {
    let rt = app.runtime.load();
    let Some(token) = &rt.admin_token else {
        return true;
    };
    // The scheme's case is the client's (RFC 9110 §11.1): `bearer` is `Bearer`.
    let (scheme, given) = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .unwrap_or_default();
    let given = given.trim();
    let given = if scheme.eq_ignore_ascii_case("bearer") {
        given.to_owned()
    } else if scheme.eq_ignore_ascii_case("basic") {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD
            .decode(given)
            .ok()
            .and_then(|raw| String::from_utf8(raw).ok())
            .and_then(|pair| {
                pair.split_once(':')
                    .map(|(_, password)| password.to_owned())
            })
            .unwrap_or_default()
    } else {
        String::new()
    };
    crate::auth::constant_time_eq(given.as_bytes(), token.as_bytes())
}

/// The console page (`src/console.html`): self-contained, polling `/endpoints`.
const CONSOLE: &str = include_str!("console.html");

/// `GET /ui`: the console page, allowed to load nothing from anywhere else.
fn console() -> Response<Body> {
    let mut r = text(StatusCode::OK, CONSOLE, "text/html; charset=utf-8");
    let h = r.headers_mut();
    h.insert(
        http::header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
             connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
             frame-ancestors 'none'",
        ),
    );
    h.insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    h.insert(
        http::header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

/// 200 when the store answers; while it fails, 200 "degraded" if a fallback serves
/// (`on_error` = local/allow) and 503 when requests are being refused (`deny`).
async fn readyz(app: &App) -> Response<Body> {
    let rt = app.runtime.load_full();
    let store = app.limiter.store();
    let answers = store.ping().await.is_ok() && store.health() == StoreHealth::Ok;
    let on_error = match rt.config.store.on_error {
        OnError::Local => "local",
        OnError::Allow => "allow",
        OnError::Deny => "deny",
    };
    let (status, state) = match (answers, rt.config.store.on_error) {
        (true, _) => (StatusCode::OK, "ok"),
        (false, OnError::Deny) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        (false, _) => (StatusCode::OK, "degraded"),
    };
    let mut body = serde_json::json!({ "store": state, "on_error": on_error });
    if let Some(n) = store.replicas() {
        // The share the local fallback would enforce: rate / replicas.
        body["replicas"] = n.into();
    }
    let body = body.to_string();
    text(status, body, "application/json")
}

fn text(status: StatusCode, body: impl Into<Bytes>, content_type: &'static str) -> Response<Body> {
    let mut r = Response::new(Either::Right(Full::new(body.into())));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// Fetches `/endpoints` from a running sluice's admin listener (`http://host:port`), with
/// `Authorization: Bearer token` when given (`proxy.admin_token_file`).
pub async fn fetch_endpoints(admin: &str, token: Option<&str>) -> Result<String, String> {
    let base = admin.trim_end_matches('/');
    let uri: http::Uri = format!("{base}/endpoints")
        .parse()
        .map_err(|e| format!("bad admin URL {admin:?}: {e}"))?;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<Bytes>>();
    let mut req = http::Request::get(uri);
    if let Some(token) = token {
        req = req.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let req = req
        .body(http_body_util::Empty::<Bytes>::new())
        .map_err(|e| format!("bad admin token: {e}"))?;
    let fetch = async {
        let resp = client.request(req).await.map_err(|e| {
            format!("cannot reach sluice admin at {admin}: {e} (is sluice running? see --admin)")
        })?;
        let status = resp.status();
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .map_err(|e| format!("reading {admin}/endpoints: {e}"))?
            .to_bytes();
        if status == http::StatusCode::UNAUTHORIZED {
            let hint = if token.is_some() {
                "the admin token was refused (is it the file proxy.admin_token_file names?)"
            } else {
                "the admin listener wants a token: pass --admin-token-file (or \
                 SLUICE_ADMIN_TOKEN_FILE) with the file proxy.admin_token_file names"
            };
            return Err(format!("{admin}/endpoints answered {status}: {hint}"));
        }
        if !status.is_success() {
            return Err(format!("{admin}/endpoints answered {status}"));
        }
        String::from_utf8(body.to_vec()).map_err(|_| "endpoints JSON is not UTF-8".to_string())
    };
    tokio::time::timeout(std::time::Duration::from_secs(5), fetch)
        .await
        .map_err(|_| format!("{admin} did not answer within 5s"))?
}

/// Renders endpoint views as an aligned table for people.
pub fn render_table(views: &[EndpointView]) -> String {
    let header = [
        "ENDPOINT",
        "MODE",
        "RATE/S",
        "CONFIGURED",
        "BURST",
        "TOKENS",
        "COOLDOWN",
        "429S",
        "AT FLOOR",
        "WAITING",
        "IN FLIGHT",
        "OLDEST",
        "REFUSED/1M",
    ];
    let rows: Vec<[String; 13]> = views
        .iter()
        .map(|v| {
            [
                v.id.clone(),
                v.mode.clone(),
                format!("{:.2}", v.rate),
                format!("{:.2}", v.configured_rate),
                format!("{:.0}", v.burst),
                // Below 0 the store counts reservations: requests sleeping until their
                // start, which WAITING shows (a shadow bucket's are requests that went
                // on at once).
                format!("{:.1}", v.tokens.max(0.0)),
                if v.cooldown_ms > 0 {
                    format!("{:.1}s", v.cooldown_ms as f64 / 1000.0)
                } else {
                    "-".into()
                },
                v.throttles.to_string(),
                if v.at_floor {
                    format!("yes ({:.0}s)", v.at_floor_secs)
                } else {
                    "no".into()
                },
                v.waiting.to_string(),
                v.in_flight.to_string(),
                if v.waiting > 0 {
                    format!("{:.1}s", v.oldest_wait_ms as f64 / 1000.0)
                } else {
                    "-".into()
                },
                v.refused_1m.to_string(),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ");
        s.truncate(s.trim_end().len());
        s.push('\n');
        s
    };
    let mut out = line(header.to_vec());
    for r in &rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    if rows.is_empty() {
        out.push_str("(no endpoints yet)\n");
    }
    let windowed: Vec<&EndpointView> = views.iter().filter(|v| !v.windows.is_empty()).collect();
    if !windowed.is_empty() {
        out.push_str("\nWINDOWS (used / limit per interval, reserved ahead)\n");
        let width = windowed.iter().map(|v| v.id.len()).max().unwrap_or(0);
        for v in windowed {
            let cells: Vec<String> = v
                .windows
                .iter()
                .map(|w| {
                    let (used, limit, ahead) = (w.used, w.limit, w.ahead);
                    format!("{used:.0}/{limit} per {} (+{ahead:.0})", w.per())
                })
                .collect();
            out.push_str(&format!("{:<width$}  {}\n", v.id, cells.join("  ")));
        }
    }
    out
}
