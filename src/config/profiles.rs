//! Sender profiles: what sluice knows of the webhook platforms it names, so a config can
//! say `[sender] profile = "svix"` (or `sender_profile = "svix"` on an endpoint) instead
//! of working out a wait budget that fits the platform.
//!
//! A platform gives up on a delivery after its own request timeout and counts the
//! attempt failed, then retries on its schedule. A request sluice still holds, or has
//! just forwarded, when that timeout passes reaches the receiver anyway, and the retry
//! reaches it again: a duplicate. So the time sluice may take, `max_wait` (holding the
//! request for its token) plus `proxy.upstream_timeout` (waiting for the receiver), must
//! stay under the platform's timeout. A profile sets both, as defaults a config's own
//! keys override, to 90% of the platform's timeout (the rest is for the hops between the
//! platform and sluice: connecting, `CONNECT`, TLS), about two thirds of it waiting.
//!
//! Every figure below is read from the platform's public source, cited with the
//! repository, the commit read, the file and the line. A platform's operator can change
//! most of them; the profile holds the defaults a fresh install runs with.

use std::time::Duration;

/// One webhook platform: its request timeout and retry schedule, and the wait budget
/// and upstream timeout they imply for sluice.
#[derive(Debug, PartialEq, Eq)]
pub struct SenderProfile {
    /// The name `[sender] profile` and `sender_profile` take.
    pub name: &'static str,
    /// The platform's name, for people.
    pub platform: &'static str,
    /// How long the platform waits for one delivery's answer before it gives up, counts
    /// the attempt failed and schedules a retry.
    pub timeout: Duration,
    /// The platform's default delays before each retry, the first retry first (a
    /// schedule that repeats its last delay lists it once more than it is written).
    pub retry_schedule: &'static [Duration],
    /// The `max_wait` this profile supplies where the config sets none.
    pub max_wait: Duration,
    /// The `proxy.upstream_timeout` this profile supplies (from `[sender]` only) where the
    /// config sets none.
    pub upstream_timeout: Duration,
}

impl SenderProfile {
    /// The time sluice may take at most, `max_wait + upstream_timeout`, that keeps a
    /// delivery inside the platform's timeout, margin for the hops included.
    pub fn budget(&self) -> Duration {
        self.timeout * 9 / 10
    }
}

const fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

const fn mins(m: u64) -> Duration {
    Duration::from_secs(m * 60)
}

const fn hours(h: u64) -> Duration {
    Duration::from_secs(h * 3600)
}

/// Svix (svix/svix-webhooks, svix-server; read at commit 4fc0cfb).
///
/// - Timeout 30 s: `worker_request_timeout = 30` in
///   `server/svix-server/config.default.toml:104` ("How long to wait when making a
///   request (in seconds)"), and at most 30: `#[validate(range(min = 1, max = 30))]` on
///   `worker_request_timeout` in `server/svix-server/src/cfg.rs:205`.
/// - Retries: `retry_schedule = [5,300,1800,7200,18000,36000,36000]`
///   (`config.default.toml:57`): 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h. Each delay
///   gets ±20% jitter (`JITTER_DELTA = 0.2`, `src/worker.rs:54`); after a timeout the
///   delay is at least 60 s (`OVERLOAD_PENALTY_SECS`, `src/worker.rs:55`, applied in
///   `calculate_retry_delay`), and a `Retry-After` is clamped to between the delay and
///   twice it (`limit_retry_delay`).
/// - Implied: `max_wait = "20s"`, `upstream_timeout = "7s"` (27 s of 30).
pub const SVIX: SenderProfile = SenderProfile {
    name: "svix",
    platform: "Svix",
    timeout: secs(30),
    retry_schedule: &[
        secs(5),
        mins(5),
        mins(30),
        hours(2),
        hours(5),
        hours(10),
        hours(10),
    ],
    max_wait: secs(20),
    upstream_timeout: secs(7),
};

/// Convoy (frain-dev/convoy; read at commit 2b60cc6).
///
/// - Timeout 10 s: `HTTP_TIMEOUT = 10` (`const.go:17`), used for every delivery unless
///   the endpoint sets its own `http_timeout` and the licence allows it
///   (`worker/task/process_event_delivery.go:327`, `services/create_endpoint.go:160`).
/// - Retries: the project default strategy is `linear`, `Duration: 100`,
///   `RetryCount: 10` (`DefaultStrategyConfig`, `datastore/models.go:321`), and
///   `linear` waits the same interval every time (`retrystrategies/default.go`): ten
///   retries 100 s apart. The `exponential` strategy waits `interval·2^n` plus up to 5 s
///   of jitter, capped at 7200 s (`retrystrategies/exponentialBackoff.go`).
/// - Implied: `max_wait = "6s"`, `upstream_timeout = "3s"` (9 s of 10).
pub const CONVOY: SenderProfile = SenderProfile {
    name: "convoy",
    platform: "Convoy",
    timeout: secs(10),
    retry_schedule: &[secs(100); 10],
    max_wait: secs(6),
    upstream_timeout: secs(3),
};

/// Hookdeck Outpost (hookdeck/outpost; read at commit f67ae01).
///
/// - Timeout 5 s: `c.DeliveryTimeoutSeconds = 5` (`internal/config/config.go:175`),
///   "Timeout in seconds for HTTP requests made during event delivery to webhook
///   destinations" (`DELIVERY_TIMEOUT_SECONDS`, `config.go:89`).
/// - Retries: exponential, `RetryIntervalSeconds = 30`, `RetryMaxLimit = 10`
///   (`config.go:170`–`171`), base 2 (`config.go:611`), `Interval · 2^retries`
///   (`internal/backoff/backoff.go`): 30 s, 1, 2, 4, 8, 16, 32, 64, 128 and 256 min.
///   `RETRY_SCHEDULE` replaces it with explicit delays.
/// - Implied: `max_wait = "2.5s"`, `upstream_timeout = "2s"` (4.5 s of 5).
pub const OUTPOST: SenderProfile = SenderProfile {
    name: "outpost",
    platform: "Hookdeck Outpost",
    timeout: secs(5),
    retry_schedule: &[
        secs(30),
        mins(1),
        mins(2),
        mins(4),
        mins(8),
        mins(16),
        mins(32),
        mins(64),
        mins(128),
        mins(256),
    ],
    max_wait: Duration::from_millis(2500),
    upstream_timeout: secs(2),
};

/// Hook0 (hook0/hook0, output-worker; read at commit 86a9d66).
///
/// - Timeout 15 s: `timeout`, "Timeout for obtaining a HTTP response from the target,
///   including connect phase", `default_value = "15s"` (`output-worker/src/main.rs:241`).
/// - Retries: `RetryPolicy::base_delay` (`output-worker/src/main.rs:1007`): 3 s, 10 s,
///   3 min, 30 min, 1 h, 3 h, 5 h, then 10 h for every further retry, up to
///   `max_retries = 24` (`main.rs:209`) within `max_retry_window = 8d` (`main.rs:213`);
///   each delay gets up to 10% of jitter, at least 2 s (`retry_jitter_ratio`,
///   `JITTER_MIN_SPREAD`). Only a 429's `Retry-After` is honoured, and only to push a
///   retry later (`retry_after_hint`, `next_delay_honouring`).
/// - Implied: `max_wait = "9s"`, `upstream_timeout = "4.5s"` (13.5 s of 15).
pub const HOOK0: SenderProfile = SenderProfile {
    name: "hook0",
    platform: "Hook0",
    timeout: secs(15),
    retry_schedule: &[
        secs(3),
        secs(10),
        mins(3),
        mins(30),
        hours(1),
        hours(3),
        hours(5),
        hours(10),
    ],
    max_wait: secs(9),
    upstream_timeout: Duration::from_millis(4500),
};

/// Every profile, by the name a config gives it.
pub const PROFILES: [&SenderProfile; 4] = [&SVIX, &CONVOY, &OUTPOST, &HOOK0];

/// The profile named `name`, if sluice knows it.
pub fn profile(name: &str) -> Option<&'static SenderProfile> {
    PROFILES.into_iter().find(|p| p.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each profile's defaults fit its platform's timeout with the hops' margin, and
    /// wait for at least half of it: a short budget is a refusal, and a refusal is a
    /// spent attempt pushed to the platform's next retry.
    #[test]
    fn every_profile_fits_its_platform_s_timeout() {
        for p in PROFILES {
            let taken = p.max_wait + p.upstream_timeout;
            assert!(taken <= p.budget(), "{}: {taken:?}", p.name);
            assert!(p.max_wait >= p.budget() / 2, "{}", p.name);
            assert!(!p.retry_schedule.is_empty(), "{}", p.name);
            assert_eq!(profile(p.name), Some(p));
        }
        assert_eq!(profile("svix").map(|p| p.timeout), Some(secs(30)));
        assert_eq!(SVIX.retry_schedule[..2], [secs(5), mins(5)]);
        assert!(profile("Svix").is_none(), "names are exact");
    }
}
