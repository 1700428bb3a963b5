//! Pure policy: what an upstream response tells the limiter.
//!
//! A 429 (or a 503 with `Retry-After`) is throttling: a pause and a rate decrease. A
//! response whose quota headers say nothing is left (`X-RateLimit-Remaining: 0`, the
//! IETF `RateLimit` field with `r=0`) is a proactive pause without a decrease. Every
//! parser here accepts arbitrary bytes and never panics.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, StatusCode};

// Quota and retry headers, named once (a `&str` lookup parses the name on every call).
const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const REMAINING: [HeaderName; 2] = [
    HeaderName::from_static("x-ratelimit-remaining"),
    HeaderName::from_static("ratelimit-remaining"),
];
const RESET: [HeaderName; 2] = [
    HeaderName::from_static("x-ratelimit-reset"),
    HeaderName::from_static("ratelimit-reset"),
];

/// Per-endpoint knobs this module needs (built once from config by the caller).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CooldownPolicy {
    /// Cooldown when a throttling response carries no usable Retry-After.
    pub default_cooldown: Duration,
    /// Upper clamp on any pause derived from headers.
    pub max_cooldown: Duration,
}

/// What an upstream response tells the limiter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Feedback {
    /// Nothing may be sent to the endpoint for this long (clamped to `max_cooldown`).
    pub pause: Duration,
    /// True for throttling (429, 503 + Retry-After): the rate is decreased too.
    pub throttled: bool,
}

/// Longest pause any header may ask for before clamping (guards float conversions).
const MAX_SECS: f64 = 365.0 * 86_400.0;

/// The shortest pause a throttling answer makes: `Retry-After: 0`, or a date already past
/// (a receiver whose clock is behind), still empties the bucket, so no burst goes into a
/// receiver that just said stop (guarantee 4).
const MIN_THROTTLED_PAUSE: Duration = Duration::from_millis(1);

/// Whether a response can carry anything for the limiter: a 429, a 503, or a header
/// whose name holds `ratelimit` (every quota header read here does). One pass over the
/// names, no hashing: this runs on every forwarded response.
pub fn worth_reading(status: StatusCode, headers: &HeaderMap) -> bool {
    status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::SERVICE_UNAVAILABLE
        || headers
            .keys()
            .any(|k| k.as_str().as_bytes().windows(9).any(|w| w == b"ratelimit"))
}

/// Reads a response; `None` when it carries nothing for the limiter (the common case:
/// a 2xx without quota headers costs one pass over the header names).
pub fn feedback(
    status: StatusCode,
    headers: &HeaderMap,
    now: SystemTime,
    policy: &CooldownPolicy,
) -> Option<Feedback> {
    if !worth_reading(status, headers) {
        return None;
    }
    let clamp = |d: Duration| {
        d.clamp(
            MIN_THROTTLED_PAUSE,
            policy.max_cooldown.max(MIN_THROTTLED_PAUSE),
        )
    };
    if status == StatusCode::TOO_MANY_REQUESTS {
        let pause = retry_after(headers, now)
            .or_else(|| reset_hint(headers, now))
            .unwrap_or(policy.default_cooldown);
        return Some(Feedback {
            pause: clamp(pause),
            throttled: true,
        });
    }
    if status == StatusCode::SERVICE_UNAVAILABLE {
        // A 503 that says when to come back throttles; one whose `Retry-After` cannot be
        // read (`soon`, `-1`) still asked for a pause: the default one, as a 429's
        // (before, it was ignored, and the whole burst followed it).
        let asked =
            headers.contains_key(http::header::RETRY_AFTER) || headers.contains_key(RETRY_AFTER_MS);
        if asked {
            return Some(Feedback {
                pause: clamp(retry_after(headers, now).unwrap_or(policy.default_cooldown)),
                throttled: true,
            });
        }
        // Without them it is no throttle, but quota headers saying "exhausted" still
        // pause as on any other status.
    }
    exhausted_until(headers, now)
        .filter(|d| !d.is_zero())
        .map(|pause| Feedback {
            pause: clamp(pause),
            throttled: false,
        })
}

/// `Retry-After` (delta-seconds or HTTP-date), then `retry-after-ms`.
fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    headers
        .get_all(http::header::RETRY_AFTER)
        .iter()
        .find_map(|v| parse_retry_after(v.as_bytes(), now))
        .or_else(|| {
            headers
                .get_all(RETRY_AFTER_MS)
                .iter()
                .find_map(|v| parse_number(v.as_bytes()).and_then(|ms| secs(ms / 1000.0)))
        })
}

/// A reset time from the quota headers, whatever the remaining count.
fn reset_hint(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    ietf_items(headers)
        .into_iter()
        .filter_map(|(_, t)| t)
        .max()
        .or_else(|| legacy_reset(headers, now))
}

/// How long until the quota refills, when a quota header says nothing is left.
fn exhausted_until(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let ietf = ietf_items(headers)
        .into_iter()
        .filter(|(r, _)| *r == Some(0))
        .filter_map(|(_, t)| t)
        .max();
    if ietf.is_some() {
        return ietf;
    }
    let remaining = REMAINING
        .iter()
        .find_map(|h| headers.get(h))
        .and_then(|v| parse_number(v.as_bytes()))?;
    if remaining > 0.0 {
        return None;
    }
    legacy_reset(headers, now)
}

fn legacy_reset(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    RESET
        .iter()
        .find_map(|h| headers.get(h))
        .and_then(|v| parse_reset(v.as_bytes(), now))
}

/// Items of the IETF `RateLimit` field: `"default";r=0;t=5, "burst";r=3;t=1` as
/// (remaining, time-to-reset) pairs.
fn ietf_items(headers: &HeaderMap) -> Vec<(Option<u64>, Option<Duration>)> {
    let Some(v) = headers.get(RATELIMIT).and_then(|v| v.to_str().ok()) else {
        return Vec::new();
    };
    parse_ratelimit_field(v)
}

/// Parses the IETF `RateLimit` structured field into (remaining, reset) per item.
pub fn parse_ratelimit_field(value: &str) -> Vec<(Option<u64>, Option<Duration>)> {
    value
        .split(',')
        .map(|item| {
            let mut r = None;
            let mut t = None;
            for param in item.split(';').skip(1) {
                let Some((k, v)) = param.split_once('=') else {
                    continue;
                };
                match k.trim() {
                    "r" => r = v.trim().parse::<u64>().ok(),
                    "t" => t = parse_number(v.trim().as_bytes()).and_then(secs),
                    _ => {}
                }
            }
            (r, t)
        })
        .filter(|(r, t)| r.is_some() || t.is_some())
        .collect()
}

/// Parses a `Retry-After` value: delta-seconds (an integer, or a decimal such as
/// `1.5`) or an HTTP-date; a date in the past gives zero. `None` for garbage.
pub fn parse_retry_after(value: &[u8], now: SystemTime) -> Option<Duration> {
    let text = std::str::from_utf8(value).ok()?.trim();
    if text.is_empty() {
        return None;
    }
    if text.as_bytes()[0].is_ascii_digit() {
        return parse_number(text.as_bytes()).and_then(secs);
    }
    let at = httpdate::parse_http_date(text)
        .ok()
        .or_else(|| httpdate::parse_http_date(&as_imf_date(text)?).ok())?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// An HTTP-date as receivers get it wrong, in RFC 9110's preferred form: the zone as
/// `UTC`, `UT`, `Z` or `+0000` instead of `GMT`, and names in any case
/// (`thu, 28 may 2026 20:27:10 utc`). Reading these as unreadable would give a receiver
/// that asked for minutes only `default_cooldown`. `None` when it is not that shape.
fn as_imf_date(text: &str) -> Option<String> {
    let (rest, zone) = text.rsplit_once(' ')?;
    if !["GMT", "UTC", "UT", "Z", "+0000"]
        .iter()
        .any(|z| zone.eq_ignore_ascii_case(z))
    {
        return None;
    }
    // "Thu, 28 May 2026 20:27:10": names title-cased, the rest as it was.
    let mut out = String::with_capacity(text.len() + 3);
    for (i, word) in rest.split(' ').enumerate() {
        if i > 0 {
            out.push(' ');
        }
        let mut chars = word.chars();
        if let Some(first) = chars.next() {
            out.push(first.to_ascii_uppercase());
            out.extend(chars.map(|c| c.to_ascii_lowercase()));
        }
    }
    out.push_str(" GMT");
    Some(out)
}

/// Parses `X-RateLimit-Reset`-style values: seconds until the reset, or a unix
/// timestamp (guessed by magnitude: > 1e9 is seconds since the epoch, > 1e12
/// milliseconds); a timestamp in the past gives zero. `None` for garbage.
pub fn parse_reset(value: &[u8], now: SystemTime) -> Option<Duration> {
    let n = parse_number(value)?;
    let epoch_secs = if n > 1e12 {
        n / 1000.0
    } else if n > 1e9 {
        n
    } else {
        return secs(n);
    };
    let now_secs = now.duration_since(UNIX_EPOCH).ok()?.as_secs_f64();
    secs((epoch_secs - now_secs).max(0.0))
}

/// A finite, non-negative decimal number.
fn parse_number(value: &[u8]) -> Option<f64> {
    let text = std::str::from_utf8(value).ok()?.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return None;
    }
    let n: f64 = text.parse().ok()?;
    n.is_finite().then_some(n)
}

/// Seconds to a Duration, saturating at a year (never panics on huge values).
fn secs(n: f64) -> Option<Duration> {
    (n.is_finite() && n >= 0.0).then(|| Duration::from_secs_f64(n.min(MAX_SECS)))
}

/// A quota a receiver publishes in an answer's headers: how many requests it still
/// takes before its reset, and, where it says so, its whole quota and window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Published {
    /// Requests it still takes before `reset`.
    pub remaining: u64,
    /// Time until the quota refills.
    pub reset: Duration,
    /// The whole quota of a window (`q`, `RateLimit-Limit`, `X-RateLimit-Limit`).
    pub quota: Option<u64>,
    /// The window's length (`w` of a policy).
    pub window: Option<Duration>,
    /// The header it was read from, for operators.
    pub source: &'static str,
}

const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const DRAFT: [HeaderName; 3] = [
    HeaderName::from_static("ratelimit-limit"),
    HeaderName::from_static("ratelimit-remaining"),
    HeaderName::from_static("ratelimit-reset"),
];
const X_RATELIMIT: [HeaderName; 3] = [
    HeaderName::from_static("x-ratelimit-limit"),
    HeaderName::from_static("x-ratelimit-remaining"),
    HeaderName::from_static("x-ratelimit-reset"),
];

/// The quota an answer publishes, in the dialects `dialect` allows (`quota_headers`),
/// the IETF fields first, then the earlier draft's, then `X-RateLimit-*`. `Ok(None)`
/// when it publishes none; `Err(name)` when a quota header is there but cannot be read
/// (the caller warns, rate-limited, and goes on as if it were absent).
pub fn published(
    headers: &HeaderMap,
    now: SystemTime,
    dialect: crate::config::QuotaHeaders,
) -> Result<Option<Published>, &'static str> {
    use crate::config::QuotaHeaders as D;
    if matches!(dialect, D::Auto | D::Ietf) && headers.contains_key(RATELIMIT) {
        return ietf_published(headers).map(Some).ok_or("RateLimit");
    }
    let legacy = |names: &[HeaderName; 3], source: &'static str| {
        if !headers.contains_key(&names[1]) {
            return Ok(None);
        }
        legacy_published(headers, names, now, source)
            .map(Some)
            .ok_or(source)
    };
    if matches!(dialect, D::Auto | D::Draft) {
        if let Some(p) = legacy(&DRAFT, "RateLimit-Remaining")? {
            return Ok(Some(p));
        }
    }
    if matches!(dialect, D::Auto | D::XRateLimit) {
        return legacy(&X_RATELIMIT, "X-RateLimit-Remaining");
    }
    Ok(None)
}

/// The IETF fields: of the `RateLimit` items that say both `r` and `t`, the one that
/// leaves the slowest pace (`r / t`), with its `RateLimit-Policy` item's `q` and `w`.
fn ietf_published(headers: &HeaderMap) -> Option<Published> {
    let field = headers.get(RATELIMIT)?.to_str().ok()?;
    let policies: Vec<(String, Option<u64>, Option<Duration>)> = headers
        .get(RATELIMIT_POLICY)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(',').map(policy_item).collect())
        .unwrap_or_default();
    let mut best: Option<Published> = None;
    for item in field.split(',') {
        let name = item_name(item);
        let (mut r, mut t) = (None, None);
        for param in item.split(';').skip(1) {
            let Some((k, v)) = param.split_once('=') else {
                continue;
            };
            match k.trim() {
                "r" => r = v.trim().parse::<u64>().ok(),
                "t" => t = parse_number(v.trim().as_bytes()).and_then(secs),
                _ => {}
            }
        }
        let (Some(remaining), Some(reset)) = (r, t) else {
            continue;
        };
        let (quota, window) = policies
            .iter()
            .find(|(n, _, _)| *n == name)
            .map_or((None, None), |(_, q, w)| (*q, *w));
        let p = Published {
            remaining,
            reset,
            quota,
            window,
            source: "RateLimit",
        };
        if best.is_none_or(|b| pace(&p) < pace(&b)) {
            best = Some(p);
        }
    }
    best
}

/// Requests per second a quota leaves until its reset.
fn pace(p: &Published) -> f64 {
    p.remaining as f64 / p.reset.as_secs_f64().max(1e-3)
}

/// The name of a structured-field list item (`"default"` or a token), unquoted.
fn item_name(item: &str) -> String {
    item.split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .trim_matches('"')
        .to_owned()
}

/// One `RateLimit-Policy` item (`"default";q=100;w=60`), or one of the earlier draft's
/// `100;w=60`: its name (empty for the draft's), `q` and `w`.
fn policy_item(item: &str) -> (String, Option<u64>, Option<Duration>) {
    let mut parts = item.split(';');
    let head = parts.next().unwrap_or_default().trim();
    let (name, mut q) = match head.parse::<u64>() {
        Ok(n) => (String::new(), Some(n)),
        Err(_) => (head.trim_matches('"').to_owned(), None),
    };
    let mut w = None;
    for param in parts {
        let Some((k, v)) = param.split_once('=') else {
            continue;
        };
        match k.trim() {
            "q" => q = v.trim().parse::<u64>().ok(),
            "w" => w = parse_number(v.trim().as_bytes()).and_then(secs),
            _ => {}
        }
    }
    (name, q, w)
}

/// `*-Limit`, `*-Remaining`, `*-Reset` (seconds, or a unix timestamp: [`parse_reset`]),
/// with a window where the limit (or the draft's `RateLimit-Policy`) names one
/// (`100, 100;w=60`).
fn legacy_published(
    headers: &HeaderMap,
    names: &[HeaderName; 3],
    now: SystemTime,
    source: &'static str,
) -> Option<Published> {
    let remaining = headers
        .get(&names[1])
        .and_then(|v| parse_number(v.as_bytes()))?;
    if remaining.fract() != 0.0 {
        return None;
    }
    let reset = headers
        .get(&names[2])
        .and_then(|v| parse_reset(v.as_bytes(), now))?;
    let limit = headers.get(&names[0]).and_then(|v| v.to_str().ok());
    let policy = headers
        .get(RATELIMIT_POLICY)
        .and_then(|v| v.to_str().ok())
        .filter(|_| source == "RateLimit-Remaining");
    let items: Vec<_> = limit
        .into_iter()
        .chain(policy)
        .flat_map(|v| v.split(','))
        .map(policy_item)
        .collect();
    let quota = items.iter().find_map(|(_, q, _)| *q);
    let window = items.iter().find_map(|(_, _, w)| *w);
    Some(Published {
        remaining: remaining as u64,
        reset,
        quota,
        window,
        source,
    })
}

/// The most of a throttling answer's body read for a wait in it (`retry_after_json`):
/// the rest reaches the sender unread.
pub const MAX_HINT_BODY: usize = 64 * 1024;

/// The JSON pointer to read a throttling answer's body with: a 429 or 503 that says
/// nothing of when to come back in its headers (`Retry-After`, `retry-after-ms`), to an
/// endpoint whose `retry_after_json` is set. `None` for every other answer.
pub fn body_hint_wanted(
    status: StatusCode,
    headers: &HeaderMap,
    pointer: Option<&std::sync::Arc<str>>,
) -> Option<std::sync::Arc<str>> {
    let pointer = pointer?;
    let throttling =
        status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE;
    let told =
        headers.contains_key(http::header::RETRY_AFTER) || headers.contains_key(RETRY_AFTER_MS);
    (throttling && !told).then(|| std::sync::Arc::clone(pointer))
}

/// The first [`MAX_HINT_BODY`] bytes of a throttling answer's body, as they pass on to
/// the sender, and the wait they name at `pointer`.
#[derive(Debug)]
pub struct BodyHint {
    pointer: std::sync::Arc<str>,
    /// As relayed on the wire (chunk framing included) rather than decoded.
    chunked: bool,
    buf: Vec<u8>,
}

impl BodyHint {
    /// Watches a body for the wait at `pointer`; `chunked` when its bytes come with
    /// their chunk framing (the lane relays them so).
    pub fn new(pointer: std::sync::Arc<str>, chunked: bool) -> BodyHint {
        BodyHint {
            pointer,
            chunked,
            buf: Vec::new(),
        }
    }

    /// Keeps what fits of `bytes`; true once the body read is as long as it may be.
    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        let room = MAX_HINT_BODY.saturating_sub(self.buf.len());
        self.buf.extend_from_slice(&bytes[..bytes.len().min(room)]);
        self.buf.len() >= MAX_HINT_BODY
    }

    /// The wait the body names, if it does.
    pub fn wait(&self) -> Option<Duration> {
        if self.chunked {
            wait_in_body(&dechunk(&self.buf), &self.pointer)
        } else {
            wait_in_body(&self.buf, &self.pointer)
        }
    }
}

/// The wait at `pointer` (RFC 6901) in a JSON body: a number of seconds (`17`, `1.5`),
/// or a string of one with a unit (`"17s"`, `"1.5s"`, `"250ms"`, `"2m"`) or without
/// (`"17"`). `None` when the body is not JSON, the pointer finds nothing, or the value
/// is none of those.
pub fn wait_in_body(body: &[u8], pointer: &str) -> Option<Duration> {
    let json: serde_json::Value = serde_json::from_slice(body).ok()?;
    match json.pointer(pointer)? {
        serde_json::Value::Number(n) => n.as_f64().and_then(secs),
        serde_json::Value::String(s) => {
            let s = s.trim();
            let (num, scale) = if let Some(n) = s.strip_suffix("ms") {
                (n, 0.001)
            } else if let Some(n) = s.strip_suffix('s') {
                (n, 1.0)
            } else if let Some(n) = s.strip_suffix('m') {
                (n, 60.0)
            } else {
                (s, 1.0)
            };
            parse_number(num.trim().as_bytes()).and_then(|n| secs(n * scale))
        }
        _ => None,
    }
}

/// The data of a chunked body as far as it came (chunk sizes, extensions and trailers
/// dropped); what does not parse ends it.
fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len());
    loop {
        let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_text = raw[..eol].split(|b| *b == b';').next().unwrap_or_default();
        let Some(size) = std::str::from_utf8(size_text)
            .ok()
            .and_then(|t| usize::from_str_radix(t.trim(), 16).ok())
        else {
            return out;
        };
        raw = &raw[eol + 2..];
        if size == 0 {
            return out;
        }
        let take = size.min(raw.len());
        out.extend_from_slice(&raw[..take]);
        if take < size || raw.len() < size + 2 {
            return out;
        }
        raw = &raw[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    const POLICY: CooldownPolicy = CooldownPolicy {
        default_cooldown: Duration::from_secs(1),
        max_cooldown: Duration::from_secs(300),
    };

    fn now() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_780_000_000)
    }

    /// A 503 without `Retry-After` is no
    /// throttle, but its quota headers saying "exhausted" pause as on a 500: they were
    /// dropped.
    #[test]
    fn a_503_saying_the_quota_is_exhausted_pauses_like_a_500_does() {
        let mut h = HeaderMap::new();
        h.insert(
            "ratelimit",
            HeaderValue::from_static("\"default\";r=0;t=30"),
        );
        let paused = |status| feedback(status, &h, now(), &POLICY);
        let expected = Some(Feedback {
            pause: Duration::from_secs(30),
            throttled: false,
        });
        assert_eq!(paused(StatusCode::INTERNAL_SERVER_ERROR), expected);
        assert_eq!(paused(StatusCode::SERVICE_UNAVAILABLE), expected);
        assert_eq!(
            feedback(
                StatusCode::SERVICE_UNAVAILABLE,
                &HeaderMap::new(),
                now(),
                &POLICY
            ),
            None
        );
    }

    /// The quick check in front of `feedback` never hides a header `feedback` reads.
    #[test]
    fn every_quota_header_is_worth_reading() {
        let ok = StatusCode::OK;
        let mut plain = HeaderMap::new();
        plain.insert("content-type", HeaderValue::from_static("text/plain"));
        plain.insert("x-rate", HeaderValue::from_static("1"));
        assert!(!worth_reading(ok, &plain));
        assert!(worth_reading(StatusCode::TOO_MANY_REQUESTS, &plain));
        assert!(worth_reading(StatusCode::SERVICE_UNAVAILABLE, &plain));
        for name in REMAINING.iter().chain(RESET.iter()).chain([&RATELIMIT]) {
            let mut h = plain.clone();
            h.insert(name.clone(), HeaderValue::from_static("0"));
            assert!(worth_reading(ok, &h), "{name}");
        }
        let mut h = HeaderMap::new();
        h.insert("x-ratelimit-remaining", HeaderValue::from_static("0"));
        h.insert("x-ratelimit-reset", HeaderValue::from_static("7"));
        assert!(feedback(ok, &h, now(), &POLICY).is_some());
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn fb(status: u16, pairs: &[(&str, &str)]) -> Option<Feedback> {
        feedback(
            StatusCode::from_u16(status).unwrap(),
            &headers(pairs),
            now(),
            &POLICY,
        )
    }

    fn pause(secs: f64, throttled: bool) -> Option<Feedback> {
        Some(Feedback {
            pause: Duration::from_secs_f64(secs),
            throttled,
        })
    }

    /// A throttling answer always pauses: a 429 or 503 whose
    /// `Retry-After` is `0`, a past date or unreadable gets at least the 1 ms pause that
    /// empties the bucket (a 503's unreadable one, the default cooldown); a 503 that
    /// says nothing of coming back is no throttle.
    #[test]
    fn a_throttling_answer_always_pauses() {
        let ms = |n: u64| {
            Some(Feedback {
                pause: Duration::from_millis(n),
                throttled: true,
            })
        };
        assert_eq!(fb(429, &[("retry-after", "0")]), ms(1));
        assert_eq!(
            fb(429, &[("retry-after", "Thu, 01 Jan 2015 00:00:00 GMT")]),
            ms(1)
        );
        assert_eq!(fb(503, &[("retry-after", "0")]), ms(1));
        assert_eq!(fb(503, &[("retry-after", "soon")]), pause(1.0, true));
        assert_eq!(fb(503, &[("retry-after", "-1")]), pause(1.0, true));
        assert_eq!(fb(503, &[]), None);
    }

    #[test]
    fn retry_after_forms() {
        assert_eq!(
            parse_retry_after(b"120", now()),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after(b" 1.5 ", now()),
            Some(Duration::from_millis(1500))
        );
        let later = now() + Duration::from_secs(30);
        let imf = httpdate::fmt_http_date(later);
        assert_eq!(
            parse_retry_after(imf.as_bytes(), now()),
            Some(Duration::from_secs(30))
        );
        // RFC 850 and asctime forms.
        let base = httpdate::parse_http_date("Thu, 28 May 2026 20:27:10 GMT").unwrap();
        let earlier = base - Duration::from_secs(10);
        assert_eq!(
            parse_retry_after(b"Thursday, 28-May-26 20:27:10 GMT", earlier),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            parse_retry_after(b"Thu May 28 20:27:10 2026", earlier),
            Some(Duration::from_secs(10))
        );
        // The zone or the names as receivers get them
        // wrong: read as the date they mean, not as garbage (a 1 s default cooldown
        // instead of the minutes asked for).
        for odd in [
            "Thu, 28 May 2026 20:27:20 UTC",
            "thu, 28 may 2026 20:27:20 gmt",
            "THU, 28 MAY 2026 20:27:20 +0000",
            "Thu, 28 May 2026 20:27:20 Z",
        ] {
            assert_eq!(
                parse_retry_after(odd.as_bytes(), earlier),
                Some(Duration::from_secs(20)),
                "{odd}"
            );
        }
        for garbage in ["Thu, 28 May 2026 20:27:20 CET", "soon UTC", "UTC"] {
            assert_eq!(
                parse_retry_after(garbage.as_bytes(), earlier),
                None,
                "{garbage}"
            );
        }
        assert_eq!(
            parse_retry_after(b"Thu, 01 Jan 2015 00:00:00 GMT", now()),
            Some(Duration::ZERO)
        );
        for bad in [&b""[..], b"soon", b"-5", b"1e3", b"\xff\xfe", b"12abc"] {
            assert_eq!(parse_retry_after(bad, now()), None, "{bad:?}");
        }
    }

    #[test]
    fn reset_forms() {
        assert_eq!(parse_reset(b"5", now()), Some(Duration::from_secs(5)));
        assert_eq!(
            parse_reset(b"1780000042", now()),
            Some(Duration::from_secs(42))
        );
        assert_eq!(
            parse_reset(b"1780000042000", now()),
            Some(Duration::from_secs(42))
        );
        assert_eq!(parse_reset(b"1700000000", now()), Some(Duration::ZERO));
        assert_eq!(parse_reset(b"x", now()), None);
    }

    #[test]
    fn throttling_responses() {
        assert_eq!(fb(429, &[("retry-after", "7")]), pause(7.0, true));
        assert_eq!(fb(429, &[]), pause(1.0, true), "default cooldown");
        assert_eq!(fb(429, &[("retry-after", "garbage")]), pause(1.0, true));
        assert_eq!(
            fb(429, &[("retry-after", "99999")]),
            pause(300.0, true),
            "clamped"
        );
        assert_eq!(fb(429, &[("retry-after-ms", "250")]), pause(0.25, true));
        assert_eq!(fb(429, &[("x-ratelimit-reset", "4")]), pause(4.0, true));
        assert_eq!(
            fb(429, &[("ratelimit", "\"default\";r=0;t=9")]),
            pause(9.0, true)
        );
        assert_eq!(
            fb(429, &[("retry-after", "bad"), ("retry-after", "3")]),
            pause(3.0, true)
        );
        assert_eq!(fb(503, &[("retry-after", "2")]), pause(2.0, true));
        assert_eq!(fb(503, &[]), None);
    }

    #[test]
    fn proactive_hints() {
        assert_eq!(
            fb(
                200,
                &[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "3")]
            ),
            pause(3.0, false)
        );
        assert_eq!(
            fb(
                200,
                &[("x-ratelimit-remaining", "5"), ("x-ratelimit-reset", "3")]
            ),
            None
        );
        assert_eq!(
            fb(
                200,
                &[("ratelimit-remaining", "0"), ("ratelimit-reset", "2")]
            ),
            pause(2.0, false)
        );
        assert_eq!(
            fb(
                200,
                &[
                    ("ratelimit", "\"a\";r=0;t=5, \"b\";r=0;t=8, \"c\";r=4;t=60"),
                    ("ratelimit-policy", "\"a\";q=100;w=60")
                ]
            ),
            pause(8.0, false)
        );
        assert_eq!(fb(200, &[("ratelimit", "\"a\";r=3;t=5")]), None);
        assert_eq!(
            fb(
                200,
                &[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "0")]
            ),
            None
        );
        assert_eq!(fb(200, &[]), None);
        assert_eq!(fb(500, &[]), None);
    }

    #[test]
    fn waits_in_bodies() {
        let google =
            br#"{"error": {"code": 429, "details": [{"@type": "x", "retryDelay": "17s"}]}}"#;
        let p = "/error/details/0/retryDelay";
        assert_eq!(wait_in_body(google, p), Some(Duration::from_secs(17)));
        let at = |v: &str| wait_in_body(format!(r#"{{"w": {v}}}"#).as_bytes(), "/w");
        assert_eq!(at("17"), Some(Duration::from_secs(17)));
        assert_eq!(at("1.5"), Some(Duration::from_millis(1500)));
        assert_eq!(at(r#""1.5s""#), Some(Duration::from_millis(1500)));
        assert_eq!(at(r#""250ms""#), Some(Duration::from_millis(250)));
        assert_eq!(at(r#""2m""#), Some(Duration::from_secs(120)));
        assert_eq!(at(r#"" 17 ""#), Some(Duration::from_secs(17)));
        for bad in [r#""soon""#, "-3", "null", "[1]", r#""1e3s""#, "true"] {
            assert_eq!(at(bad), None, "{bad}");
        }
        assert_eq!(wait_in_body(b"not json", "/w"), None);
        assert_eq!(wait_in_body(br#"{"w": 3}"#, "/x"), None);
    }

    #[test]
    fn a_chunked_body_is_read_through_its_framing() {
        let mut h = BodyHint::new("/retry_after".into(), true);
        h.feed(b"5\r\n{\"ret\r\n");
        h.feed(b"10\r\nry_after\": 2.5}\r\n0\r\n\r\n");
        assert_eq!(h.wait(), Some(Duration::from_millis(2500)));
        // Bounded: past MAX_HINT_BODY nothing more is kept.
        let mut big = BodyHint::new("/w".into(), false);
        assert!(!big.feed(&[b' '; MAX_HINT_BODY - 1]));
        assert!(big.feed(b"  {}"));
        assert_eq!(big.buf.len(), MAX_HINT_BODY);
    }

    #[test]
    fn only_a_throttling_answer_without_a_wait_in_its_headers_is_read() {
        let p: std::sync::Arc<str> = "/w".into();
        let none = HeaderMap::new();
        assert!(body_hint_wanted(StatusCode::TOO_MANY_REQUESTS, &none, Some(&p)).is_some());
        assert!(body_hint_wanted(StatusCode::SERVICE_UNAVAILABLE, &none, Some(&p)).is_some());
        assert!(body_hint_wanted(StatusCode::OK, &none, Some(&p)).is_none());
        assert!(body_hint_wanted(StatusCode::TOO_MANY_REQUESTS, &none, None).is_none());
        let told = headers(&[("retry-after", "3")]);
        assert!(body_hint_wanted(StatusCode::TOO_MANY_REQUESTS, &told, Some(&p)).is_none());
    }

    #[test]
    fn quotas_in_four_dialects() {
        use crate::config::QuotaHeaders as D;
        let read = |pairs: &[(&str, &str)]| published(&headers(pairs), now(), D::Auto);
        let p = |remaining, reset: f64, quota, window: Option<u64>, source| {
            Ok(Some(Published {
                remaining,
                reset: Duration::from_secs_f64(reset),
                quota,
                window: window.map(Duration::from_secs),
                source,
            }))
        };
        assert_eq!(
            read(&[
                (
                    "ratelimit-policy",
                    "\"burst\";q=10;w=1, \"default\";q=100;w=60"
                ),
                ("ratelimit", "\"burst\";r=9;t=1, \"default\";r=50;t=30"),
            ]),
            p(50, 30.0, Some(100), Some(60), "RateLimit"),
            "the slower pace of the two binds"
        );
        assert_eq!(
            read(&[
                ("ratelimit-limit", "15, 15;w=5"),
                ("ratelimit-remaining", "7"),
                ("ratelimit-reset", "3"),
            ]),
            p(7, 3.0, Some(15), Some(5), "RateLimit-Remaining")
        );
        assert_eq!(
            read(&[
                ("ratelimit-limit", "15"),
                ("ratelimit-policy", "15;w=5"),
                ("ratelimit-remaining", "7"),
                ("ratelimit-reset", "3"),
            ]),
            p(7, 3.0, Some(15), Some(5), "RateLimit-Remaining")
        );
        assert_eq!(
            read(&[
                ("x-ratelimit-limit", "5000"),
                ("x-ratelimit-remaining", "4999"),
                ("x-ratelimit-reset", "1780003600"),
            ]),
            p(4999, 3600.0, Some(5000), None, "X-RateLimit-Remaining"),
            "GitHub: the reset as epoch seconds"
        );
        assert_eq!(
            read(&[("x-ratelimit-remaining", "3"), ("x-ratelimit-reset", "2")]),
            p(3, 2.0, None, None, "X-RateLimit-Remaining")
        );
        assert_eq!(read(&[("content-type", "x")]), Ok(None));
        assert_eq!(
            read(&[
                ("x-ratelimit-remaining", "lots"),
                ("x-ratelimit-reset", "2")
            ]),
            Err("X-RateLimit-Remaining")
        );
        assert_eq!(
            read(&[("x-ratelimit-remaining", "3")]),
            Err("X-RateLimit-Remaining")
        );
        assert_eq!(read(&[("ratelimit", "garbage")]), Err("RateLimit"));
        // A dialect named reads that one only.
        let x = headers(&[("x-ratelimit-remaining", "3"), ("x-ratelimit-reset", "2")]);
        assert_eq!(published(&x, now(), D::Ietf), Ok(None));
        assert_eq!(published(&x, now(), D::None), Ok(None));
        assert!(published(&x, now(), D::XRateLimit).unwrap().is_some());
    }

    proptest! {
        #[test]
        fn parsers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = parse_retry_after(&bytes, now());
            let _ = parse_reset(&bytes, now());
            if let Ok(v) = HeaderValue::from_bytes(&bytes) {
                for name in ["ratelimit", "ratelimit-policy", "ratelimit-limit", "x-ratelimit-reset", "x-ratelimit-remaining"] {
                    let mut h = HeaderMap::new();
                    h.insert(name, v.clone());
                    h.insert("ratelimit-remaining", HeaderValue::from_static("4"));
                    h.insert("x-ratelimit-remaining", HeaderValue::from_static("4"));
                    let _ = published(&h, now(), crate::config::QuotaHeaders::Auto);
                }
                for name in ["retry-after", "retry-after-ms", "x-ratelimit-reset", "ratelimit", "x-ratelimit-remaining"] {
                    let mut h = HeaderMap::new();
                    h.insert(name, v.clone());
                    h.insert("x-ratelimit-remaining", HeaderValue::from_static("0"));
                    for status in [200u16, 429, 503] {
                        if let Some(f) = feedback(StatusCode::from_u16(status).unwrap(), &h, now(), &POLICY) {
                            prop_assert!(f.pause <= POLICY.max_cooldown);
                        }
                    }
                }
            }
        }

        #[test]
        fn delta_seconds_round_trip(d in 0u32..31_536_000) {
            prop_assert_eq!(parse_retry_after(d.to_string().as_bytes(), now()), Some(Duration::from_secs(d as u64)));
        }

        #[test]
        fn http_dates_round_trip(at in 0u64..7_258_118_400, ahead in 0u64..1_000_000) {
            let date = UNIX_EPOCH + Duration::from_secs(at);
            let text = httpdate::fmt_http_date(date);
            let before = date - Duration::from_secs(ahead.min(at));
            prop_assert_eq!(parse_retry_after(text.as_bytes(), before), Some(Duration::from_secs(ahead.min(at))));
        }
    }
}
