//! Which refusals of a receiver sluice absorbs: the rules, with no I/O.
//!
//! A receiver's 429 (or 503 with `Retry-After`) says it did not process the request.
//! Passed on, it costs the sender an attempt: webhook platforms retry on their own
//! schedule (Svix: 5 s, then 5 min, 30 min, ...), so a message refused once may arrive
//! minutes late. When the receiver's cooldown ends within what is left of the request's
//! `max_wait`, sluice holds the request behind that cooldown and the bucket, as any
//! waiter, and sends it again itself, at most `absorb_attempts` times; the sender sees
//! only the final answer.
//!
//! Only requests that may be sent twice are absorbed (`[defaults.adaptive] absorb`):
//! with `"safe"`, the methods RFC 9110 §9.2.2 calls idempotent, a request carrying
//! `Idempotency-Key`, and any request to an endpoint with `absorb_post = true`; with
//! `"all"`, every request. Its body must be replayable: up to `absorb_max_body` bytes,
//! of a known length, kept until the final answer.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, Method, StatusCode};

use crate::adapt::{self, CooldownPolicy};
use crate::config::{Absorb, Adaptive, Mode, Policy};

/// The header a sender names its request's identity with (IETF
/// draft-ietf-httpapi-idempotency-key-header): a receiver recognises a request sent
/// twice by it.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// A sender's ID for its request, stable across its own retries of one message: it
/// reaches the receiver as `Idempotency-Key` (when the request carries none of its
/// own), so a receiver can recognise a request sent twice, by the sender after a
/// connection error left it in doubt, or by sluice absorbing a refusal.
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-sluice-request-id");

/// On an answer after resends: how many times sluice sent the request again.
pub const RETRIED_HEADER: HeaderName = HeaderName::from_static("x-sluice-retried");

/// How many resends a request may have, or `None` when it is never resent: absorb off
/// (or no adaptive reaction at all), shadow mode, a method not safe to repeat under
/// `"safe"`, or a body that cannot be kept (`body`: its length, `None` when unknown).
pub fn attempts(
    policy: &Policy,
    mode: Mode,
    method: &Method,
    headers: &HeaderMap,
    body: Option<u64>,
) -> Option<u32> {
    let adaptive = policy.adaptive.as_ref()?;
    if mode != Mode::Enforce || body? > adaptive.absorb_max_body {
        return None;
    }
    let repeatable = match adaptive.absorb {
        Absorb::Off => false,
        Absorb::All => true,
        Absorb::Safe => {
            idempotent(method)
                || policy.absorb_post
                || headers.contains_key(&IDEMPOTENCY_KEY)
                || headers.contains_key(&REQUEST_ID_HEADER)
        }
    };
    repeatable.then_some(adaptive.absorb_attempts)
}

/// RFC 9110 §9.2.2: requests whose intended effect is the same sent once or many times.
fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// The cooldown a receiver's answer asks for, when it is a refusal sluice may absorb: a
/// 429, or a 503 that says when to come back. `None` for any other answer.
pub fn refusal_pause(
    status: StatusCode,
    headers: &HeaderMap,
    adaptive: &Adaptive,
    now: SystemTime,
) -> Option<Duration> {
    if status != StatusCode::TOO_MANY_REQUESTS && status != StatusCode::SERVICE_UNAVAILABLE {
        return None;
    }
    let policy = CooldownPolicy {
        default_cooldown: adaptive.default_cooldown,
        max_cooldown: adaptive.max_cooldown,
    };
    adapt::feedback(status, headers, now, &policy)
        .filter(|fb| fb.throttled)
        .map(|fb| fb.pause)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn policy(adaptive: &str, endpoint: &str) -> Policy {
        let text =
            format!("[defaults.adaptive]\n{adaptive}\n[[endpoints]]\nid = \"e\"\n{endpoint}\n");
        let cfg = Config::parse(&text).expect("valid config");
        (*cfg.endpoints[0].policy).clone()
    }

    #[test]
    fn safe_absorbs_idempotent_methods_keyed_requests_and_marked_endpoints() {
        let p = policy("", "");
        let h = HeaderMap::new();
        let mut keyed = HeaderMap::new();
        keyed.insert(IDEMPOTENCY_KEY, "msg_1".parse().unwrap());
        let e = Mode::Enforce;
        assert_eq!(attempts(&p, e, &Method::GET, &h, Some(0)), Some(2));
        assert_eq!(attempts(&p, e, &Method::PUT, &h, Some(10)), Some(2));
        assert_eq!(attempts(&p, e, &Method::POST, &h, Some(10)), None);
        assert_eq!(attempts(&p, e, &Method::PATCH, &h, Some(10)), None);
        assert_eq!(attempts(&p, e, &Method::POST, &keyed, Some(10)), Some(2));
        let marked = policy("", "absorb_post = true");
        assert_eq!(attempts(&marked, e, &Method::POST, &h, Some(10)), Some(2));
    }

    #[test]
    fn off_shadow_unknown_or_large_bodies_are_never_resent() {
        let h = HeaderMap::new();
        let e = Mode::Enforce;
        let off = policy("absorb = \"off\"", "");
        assert_eq!(attempts(&off, e, &Method::GET, &h, Some(0)), None);
        let all = policy("absorb = \"all\"\nabsorb_max_body = 100", "");
        assert_eq!(attempts(&all, e, &Method::POST, &h, Some(100)), Some(2));
        assert_eq!(attempts(&all, e, &Method::POST, &h, Some(101)), None);
        assert_eq!(attempts(&all, e, &Method::POST, &h, None), None);
        assert_eq!(
            attempts(&all, Mode::Shadow, &Method::GET, &h, Some(0)),
            None
        );
        let none = policy("enabled = false", "");
        assert_eq!(attempts(&none, e, &Method::GET, &h, Some(0)), None);
    }

    #[test]
    fn only_a_throttling_refusal_is_absorbed() {
        let p = policy("default_cooldown = \"2s\"", "");
        let a = p.adaptive.unwrap();
        let now = SystemTime::now();
        let mut h = HeaderMap::new();
        let pause =
            |s: u16, h: &HeaderMap| refusal_pause(StatusCode::from_u16(s).unwrap(), h, &a, now);
        assert_eq!(pause(429, &h), Some(Duration::from_secs(2)));
        assert_eq!(pause(503, &h), None);
        assert_eq!(pause(500, &h), None);
        h.insert(http::header::RETRY_AFTER, "3".parse().unwrap());
        assert_eq!(pause(429, &h), Some(Duration::from_secs(3)));
        assert_eq!(pause(503, &h), Some(Duration::from_secs(3)));
        assert_eq!(pause(200, &h), None);
    }
}
