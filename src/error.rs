//! [`ProxyError`]: every way a request can fail to be forwarded, and the ONE place
//! ([`ProxyError::into_response`]) that turns it into an HTTP response with the status,
//! `X-Sluice-Reason`, `Retry-After` (with `retry-after-ms` and `RateLimit`) and JSON
//! body of SPEC.md's table. Both engines (hyper's path and the plain lane) write it.

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, PROXY_AUTHENTICATE, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::{Either, Full};

use crate::limiter::HeldBody;

/// The body sluice answers with: the upstream's streamed body (holding the request's
/// in-flight slot until it ends), or one of its own.
pub type Body = Either<HeldBody, Full<Bytes>>;

/// Header carrying the reason of sluice's own refusals.
pub const REASON_HEADER: &str = "x-sluice-reason";

/// The exact wait of a refusal, in milliseconds (read by OpenAI's and Azure's SDKs):
/// `Retry-After` holds whole seconds only, and a sender that waits those out loses up
/// to a second per refusal.
pub const RETRY_AFTER_MS_HEADER: &str = "retry-after-ms";

/// The IETF `RateLimit` field (draft-ietf-httpapi-ratelimit-headers) for sluice's own
/// budget of the endpoint, on refusals where that budget is what is spent.
pub const RATELIMIT_HEADER: &str = "ratelimit";

/// The quota policy name sluice's `RateLimit` field carries, so a sender can tell it
/// from a receiver's own `RateLimit` (which reaches it unchanged on forwarded answers).
pub const RATELIMIT_POLICY: &str = "sluice";

/// Why a request was not (fully) served.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProxyError {
    /// Origin-form request: someone talked to sluice as if it were a web server.
    #[error(
        "sluice is an HTTP proxy: send absolute-form requests (e.g. curl -x http://this-host:port http://example.com/)"
    )]
    NotAProxyRequest,
    /// The request is malformed in a way hyper did not catch.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The request uses something sluice cannot forward (a transfer coding other than
    /// `chunked`, RFC 9112 §6.1): answered 501 before anything is spent or sent.
    #[error("not implemented: {0}")]
    NotImplemented(String),
    /// The request head is larger than sluice reads (answered 431).
    #[error(
        "request head too large: sluice reads at most {bytes} bytes and {headers} header lines before the body",
        bytes = crate::limits::MAX_HEAD_BYTES,
        headers = crate::limits::MAX_HEADERS
    )]
    HeadTooLarge,
    /// Proxy authentication is on and the credentials are missing or wrong.
    #[error(
        "proxy authentication required: send Proxy-Authorization: Basic with a user of security.auth_users_file"
    )]
    ProxyAuthRequired,
    /// The authenticated user may not spend this endpoint's budget.
    #[error("user {user} may not use endpoint {endpoint:?} (security.user_endpoints)")]
    EndpointNotAllowed {
        /// The user.
        user: String,
        /// The resolved endpoint.
        endpoint: String,
    },
    /// `security.require_endpoint` and nothing named the request's endpoint.
    #[error(
        "the request names no endpoint (no endpoint header, proxy user or hosts rule) and \
         security.require_endpoint is on: it would have been paced under its host {0:?}"
    )]
    EndpointRequired(String),
    /// `unknown = "reject"` and the endpoint is not configured.
    #[error("endpoint {0:?} is not configured and unknown endpoints are rejected")]
    UnknownEndpoint(String),
    /// The destination policy refuses the target.
    #[error("destination {host} refused: {why}")]
    DestinationDenied {
        /// The requested host.
        host: String,
        /// Which rule refused it.
        why: String,
    },
    /// No token within `max_wait`.
    #[error("endpoint {endpoint} is rate limited")]
    RateLimited {
        /// The endpoint ID.
        endpoint: String,
        /// Time until a token.
        retry_after: Duration,
    },
    /// The endpoint is cooling down after a 429.
    #[error("endpoint {endpoint} is cooling down after the receiver throttled it")]
    Cooldown {
        /// The endpoint ID.
        endpoint: String,
        /// Time left in the cooldown.
        retry_after: Duration,
    },
    /// No in-flight slot (`max_in_flight`) within `max_wait`.
    #[error("endpoint {endpoint} has max_in_flight requests in flight")]
    ConcurrencyLimited {
        /// The endpoint ID.
        endpoint: String,
        /// Time until the soonest slot lease expires.
        retry_after: Duration,
    },
    /// The store failed and `on_error = "deny"`.
    #[error("rate-limit store unavailable for endpoint {endpoint}")]
    StoreUnavailable {
        /// The endpoint ID.
        endpoint: String,
    },
    /// The memory store holds `store.max_endpoints` busy endpoints and this one has no
    /// bucket.
    #[error(
        "sluice holds state for store.max_endpoints endpoints, none idle: endpoint {endpoint} gets none"
    )]
    EndpointCapacity {
        /// The endpoint ID.
        endpoint: String,
    },
    /// Memory is near `proxy.max_memory`: the budget of buffered heads is spent.
    #[error(
        "sluice is near its memory ceiling (proxy.max_memory): no room to buffer this request head"
    )]
    Overloaded,
    /// The upstream failed after the request left (connect, TLS, reset...).
    #[error("upstream error: {0}")]
    Upstream(String),
    /// The upstream did not answer within `upstream_timeout`.
    #[error("upstream did not answer within {0:?}")]
    UpstreamTimeout(Duration),
    /// The sender stopped sending its request body for `upstream_timeout` mid-request.
    #[error(
        "the sender stopped sending its request body (none of it for {0:?}, or under {rate} bytes/s on average past that)",
        rate = crate::upload::MIN_UPLOAD_RATE
    )]
    RequestTimeout(Duration),
}

impl ProxyError {
    /// The `X-Sluice-Reason` value (also the `outcome` metric label).
    pub fn reason(&self) -> &'static str {
        match self {
            ProxyError::NotAProxyRequest | ProxyError::BadRequest(_) | ProxyError::HeadTooLarge => {
                "bad_request"
            }
            ProxyError::NotImplemented(_) => "not_implemented",
            ProxyError::EndpointRequired(_) => "endpoint_required",
            ProxyError::ProxyAuthRequired => "proxy_auth_required",
            ProxyError::EndpointNotAllowed { .. } => "endpoint_not_allowed",
            ProxyError::UnknownEndpoint(_) => "unknown_endpoint",
            ProxyError::DestinationDenied { .. } => "destination_denied",
            ProxyError::RateLimited { .. } => "rate_limited",
            ProxyError::Cooldown { .. } => "cooldown",
            ProxyError::ConcurrencyLimited { .. } => "concurrency_limited",
            ProxyError::StoreUnavailable { .. } => "store_unavailable",
            ProxyError::EndpointCapacity { .. } => "endpoint_capacity",
            ProxyError::Overloaded => "overloaded",
            ProxyError::Upstream(_) => "upstream_error",
            ProxyError::UpstreamTimeout(_) => "upstream_timeout",
            ProxyError::RequestTimeout(_) => "request_timeout",
        }
    }

    /// The status sluice answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::NotAProxyRequest
            | ProxyError::BadRequest(_)
            | ProxyError::EndpointRequired(_) => StatusCode::BAD_REQUEST,
            ProxyError::HeadTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ProxyError::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            ProxyError::ProxyAuthRequired => StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            ProxyError::UnknownEndpoint(_)
            | ProxyError::EndpointNotAllowed { .. }
            | ProxyError::DestinationDenied { .. } => StatusCode::FORBIDDEN,
            ProxyError::RateLimited { .. }
            | ProxyError::Cooldown { .. }
            | ProxyError::ConcurrencyLimited { .. }
            | ProxyError::StoreUnavailable { .. }
            | ProxyError::EndpointCapacity { .. }
            | ProxyError::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Upstream(_) => StatusCode::BAD_GATEWAY,
            ProxyError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
        }
    }

    /// `Retry-After` for refusals that have one.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ProxyError::RateLimited { retry_after, .. }
            | ProxyError::Cooldown { retry_after, .. }
            | ProxyError::ConcurrencyLimited { retry_after, .. } => Some(*retry_after),
            ProxyError::StoreUnavailable { .. }
            | ProxyError::EndpointCapacity { .. }
            | ProxyError::Overloaded => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    /// Whether the refusal is about the endpoint's token budget (its bucket or its
    /// cooldown): then sluice knows it holds no quota now and when quota comes back.
    fn spends_the_budget(&self) -> bool {
        matches!(
            self,
            ProxyError::RateLimited { .. } | ProxyError::Cooldown { .. }
        )
    }

    fn endpoint(&self) -> Option<&str> {
        match self {
            ProxyError::RateLimited { endpoint, .. }
            | ProxyError::Cooldown { endpoint, .. }
            | ProxyError::ConcurrencyLimited { endpoint, .. }
            | ProxyError::StoreUnavailable { endpoint }
            | ProxyError::EndpointCapacity { endpoint } => Some(endpoint),
            ProxyError::UnknownEndpoint(e) | ProxyError::EndpointNotAllowed { endpoint: e, .. } => {
                Some(e)
            }
            _ => None,
        }
    }

    /// The response a sender gets. 503s carry the JSON body of SPEC.md; the others a
    /// JSON body with the reason and a human-readable message.
    pub fn into_response(self) -> Response<Body> {
        let retry = self.retry_after();
        let mut body = serde_json::json!({ "reason": self.reason(), "message": self.to_string() });
        if let Some(e) = self.endpoint() {
            body["endpoint"] = e.into();
        }
        if let Some(r) = retry {
            body["retry_after_ms"] = retry_after_ms(r).into();
        }
        let mut resp = Response::new(Either::Right(Full::new(Bytes::from(body.to_string()))));
        *resp.status_mut() = self.status();
        let h = resp.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        h.insert(REASON_HEADER, HeaderValue::from_static(self.reason()));
        if let Some(r) = retry {
            let secs = retry_after_secs(r);
            h.insert(RETRY_AFTER, HeaderValue::from(secs));
            h.insert(RETRY_AFTER_MS_HEADER, HeaderValue::from(retry_after_ms(r)));
            if self.spends_the_budget() {
                // No quota left (r=0) until the token or the cooldown's end (t, whole
                // seconds as Retry-After says).
                let field = format!("\"{RATELIMIT_POLICY}\";r=0;t={secs}");
                h.insert(
                    RATELIMIT_HEADER,
                    HeaderValue::from_str(&field).expect("ASCII"),
                );
            }
        }
        if self.status() == StatusCode::PROXY_AUTHENTICATION_REQUIRED {
            h.insert(
                PROXY_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"sluice\""),
            );
        }
        resp
    }
}

/// Milliseconds for `retry-after-ms` and the body's `retry_after_ms`: rounded up, so a
/// sender waiting exactly that is never early, and at least 1.
pub fn retry_after_ms(d: Duration) -> u64 {
    let ms = d.as_millis() + u128::from(d.subsec_nanos() % 1_000_000 > 0);
    u64::try_from(ms).unwrap_or(u64::MAX).max(1)
}

/// Whole seconds for `Retry-After`: rounded up, at least 1.
pub fn retry_after_secs(d: Duration) -> u64 {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    s.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(3)), 3);
    }

    #[test]
    fn rate_limited_response_shape() {
        let r = ProxyError::RateLimited {
            endpoint: "ep".into(),
            retry_after: Duration::from_millis(1500),
        }
        .into_response();
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()[REASON_HEADER], "rate_limited");
        assert_eq!(r.headers()[RETRY_AFTER], "2");
        assert_eq!(r.headers()[RETRY_AFTER_MS_HEADER], "1500");
        assert_eq!(r.headers()[RATELIMIT_HEADER], "\"sluice\";r=0;t=2");
    }

    #[test]
    fn retry_after_ms_rounds_up_and_is_at_least_one() {
        assert_eq!(retry_after_ms(Duration::ZERO), 1);
        assert_eq!(retry_after_ms(Duration::from_micros(1)), 1);
        assert_eq!(retry_after_ms(Duration::from_micros(1500)), 2);
        assert_eq!(retry_after_ms(Duration::from_millis(250)), 250);
        assert_eq!(retry_after_ms(Duration::from_secs(3)), 3000);
    }

    /// Every refusal with a `Retry-After` carries the exact wait in `retry-after-ms`
    /// (the same figure as the body's `retry_after_ms`); `RateLimit` only where the
    /// endpoint's token budget is what ran out; none of them elsewhere.
    #[test]
    fn every_retry_after_has_its_millisecond_hint() {
        let wait = Duration::from_millis(2345);
        let cases = [
            (
                ProxyError::RateLimited {
                    endpoint: "ep".into(),
                    retry_after: wait,
                },
                Some("2345"),
                Some("\"sluice\";r=0;t=3"),
            ),
            (
                ProxyError::Cooldown {
                    endpoint: "ep".into(),
                    retry_after: wait,
                },
                Some("2345"),
                Some("\"sluice\";r=0;t=3"),
            ),
            (
                ProxyError::ConcurrencyLimited {
                    endpoint: "ep".into(),
                    retry_after: wait,
                },
                Some("2345"),
                None,
            ),
            (
                ProxyError::StoreUnavailable {
                    endpoint: "ep".into(),
                },
                Some("1000"),
                None,
            ),
            (ProxyError::UnknownEndpoint("ep".into()), None, None),
            (ProxyError::ProxyAuthRequired, None, None),
            (ProxyError::Upstream("reset".into()), None, None),
        ];
        for (e, ms, ratelimit) in cases {
            let reason = e.reason();
            let r = e.into_response();
            let h = r.headers();
            let header = |name: &str| h.get(name).map(|v| v.to_str().unwrap().to_owned());
            assert_eq!(header(RETRY_AFTER_MS_HEADER).as_deref(), ms, "{reason}");
            assert_eq!(header(RATELIMIT_HEADER).as_deref(), ratelimit, "{reason}");
            assert_eq!(h.contains_key(RETRY_AFTER), ms.is_some(), "{reason}");
            let Either::Right(full) = r.into_body() else {
                panic!("{reason}: sluice's own body");
            };
            let bytes =
                futures_util::FutureExt::now_or_never(http_body_util::BodyExt::collect(full))
                    .unwrap()
                    .unwrap()
                    .to_bytes();
            let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            let in_body = body["retry_after_ms"].as_u64().map(|n| n.to_string());
            assert_eq!(in_body.as_deref(), ms, "{reason}: the body says the same");
        }
    }
}
