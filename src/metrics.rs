//! The Prometheus registry and every instrument sluice exports.
//!
//! Endpoint labels are capped: the configured endpoints and the first
//! `proxy.metrics_max_endpoints` other IDs seen get their own label value, the rest are
//! counted under `endpoint="_other"`, so a sender spraying IDs cannot blow up `/metrics`.
//! Sender labels (`sluice_sender_requests_total`) are capped the same way by
//! `proxy.metrics_max_senders`, and each endpoint label keeps its busiest senders of the
//! last minutes ([`TopSenders`]) for `/endpoints/{id}`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use prometheus_client::encoding::{
    EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelValueEncoder, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::limiter::StoreStats;

/// An endpoint label value (cheap to clone), carrying the endpoint's most used series
/// once they exist, so a request does not look them up by label again.
#[derive(Debug, Clone)]
pub struct EndpointLabel(Arc<Labelled>);

#[derive(Debug)]
struct Labelled {
    id: Arc<str>,
    /// `sluice_requests_total{outcome="forwarded"}`.
    forwarded: OnceLock<Counter>,
    /// `sluice_wait_seconds`.
    wait: OnceLock<Histogram>,
    /// `sluice_upstream_responses_total` of the first status code seen (usually the
    /// only one).
    first_code: OnceLock<(u16, Counter)>,
    /// Requests admitted and not yet answered ([`Sending`]).
    in_flight: AtomicU64,
    /// Pacing refusals of the last minute.
    refused: Recent,
    /// Its busiest senders of the last [`TOP_MINUTES`] minutes.
    senders: Mutex<TopSenders>,
}

impl EndpointLabel {
    fn new(id: Arc<str>) -> EndpointLabel {
        EndpointLabel(Arc::new(Labelled {
            id,
            forwarded: OnceLock::new(),
            wait: OnceLock::new(),
            first_code: OnceLock::new(),
            in_flight: AtomicU64::new(0),
            refused: Recent::default(),
            senders: Mutex::default(),
        }))
    }

    /// The label value: the endpoint ID or `_other`.
    pub fn as_str(&self) -> &str {
        &self.0.id
    }

    /// Counts a request admitted under this label as in flight until the guard drops
    /// (its answer's head came, or it failed).
    pub fn sending(&self) -> Sending {
        self.0.in_flight.fetch_add(1, Ordering::Relaxed);
        Sending(self.clone())
    }

    /// Requests admitted under this label and not yet answered.
    pub fn in_flight(&self) -> u64 {
        self.0.in_flight.load(Ordering::Relaxed)
    }

    /// Requests forwarded under this label, ever (`sluice_requests_total{outcome="forwarded"}`).
    pub fn forwarded(&self) -> u64 {
        self.0.forwarded.get().map_or(0, Counter::get)
    }

    /// Pacing refusals (`rate_limited`, `cooldown`, `concurrency_limited`,
    /// `store_unavailable`) under this label in the last minute.
    pub fn refused_last_minute(&self) -> u64 {
        self.0.refused.sum(now_secs())
    }

    /// Its busiest senders of the last [`TOP_MINUTES`] minutes, busiest first, at most
    /// `n` of them.
    pub fn top_senders(&self, n: usize) -> Vec<SenderCount> {
        let top = self.0.senders.lock().unwrap_or_else(|e| e.into_inner());
        top.top(now_secs() / 60, n)
    }
}

/// A request admitted and not yet answered, counted in its label's in-flight count
/// while this lives ([`EndpointLabel::sending`]).
#[derive(Debug)]
pub struct Sending(EndpointLabel);

impl Drop for Sending {
    fn drop(&mut self) {
        self.0.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts of the last [`RECENT_SECS`] seconds, one slot per second: each slot holds
/// the second it counts (high bits) and its count (low [`COUNT_BITS`] bits), updated
/// with one compare-and-swap, so counting takes no lock.
#[derive(Debug)]
struct Recent {
    slots: [AtomicU64; RECENT_SECS as usize],
}

/// The window of [`Recent`], seconds.
const RECENT_SECS: u64 = 60;
/// Bits of a [`Recent`] slot that hold its count (saturating).
const COUNT_BITS: u32 = 24;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

impl Default for Recent {
    fn default() -> Recent {
        Recent {
            slots: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Recent {
    /// Counts one event in second `now`.
    fn add(&self, now: u64) {
        let slot = &self.slots[(now % RECENT_SECS) as usize];
        let _ = slot.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some(if v >> COUNT_BITS == now {
                (v & !COUNT_MASK) | ((v & COUNT_MASK) + 1).min(COUNT_MASK)
            } else {
                (now << COUNT_BITS) | 1
            })
        });
    }

    /// Events in the window ending with second `now`.
    fn sum(&self, now: u64) -> u64 {
        self.slots
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .filter(|v| {
                let at = v >> COUNT_BITS;
                at <= now && at + RECENT_SECS > now
            })
            .map(|v| v & COUNT_MASK)
            .sum()
    }
}

/// Seconds since the process first asked, from 1 (0 marks an empty [`Recent`] slot).
fn now_secs() -> u64 {
    static START: OnceLock<std::time::Instant> = OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs()
        + 1
}

/// A sender label value (cheap to clone): the sender's name, [`ANONYMOUS`] or
/// [`OTHER`] past `proxy.metrics_max_senders`. Interned: one allocation per sender.
#[derive(Debug, Clone)]
pub struct SenderLabel(Arc<str>);

impl SenderLabel {
    /// The label value.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl PartialEq for SenderLabel {
    fn eq(&self, other: &SenderLabel) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

impl Eq for SenderLabel {}

impl std::hash::Hash for SenderLabel {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state);
    }
}

impl EncodeLabelValue for SenderLabel {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, &self.0)
    }
}

/// The sender of a request that names none: no authenticated proxy user and no trusted
/// `X-Sluice-Sender` (or refused before it was identified).
pub const ANONYMOUS: &str = "_anonymous";

/// `proxy.metrics_max_senders` by default.
pub const DEFAULT_MAX_SENDERS: usize = crate::config::DEFAULT_MAX_SENDERS;

/// The longest sender name kept (bytes); a longer `X-Sluice-Sender` is cut to it.
pub const MAX_SENDER_LEN: usize = 64;

/// Minutes [`TopSenders`] covers.
pub const TOP_MINUTES: u64 = 5;

/// Senders [`TopSenders`] keeps per minute: past them, the least busy one gives its
/// place to the newcomer (Space-Saving), so a sender busier than a 32nd of the
/// minute's requests is always among them.
const TOP_PER_MINUTE: usize = 32;

/// One sender's requests to one endpoint over the last minutes (`/endpoints/{id}`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SenderCount {
    /// The sender (as labelled in `sluice_sender_requests_total`).
    pub sender: String,
    /// Its requests, whatever their outcome. Past [`TOP_PER_MINUTE`] senders in a
    /// minute, a sender that took a place counts from the count of the one it replaced
    /// (an upper bound).
    pub requests: u64,
    /// Those forwarded.
    pub forwarded: u64,
    /// Those refused by sluice's pacing (`rate_limited`, `cooldown`,
    /// `concurrency_limited`, `store_unavailable`).
    pub refused: u64,
}

/// One minute's senders of one endpoint.
#[derive(Debug, Default)]
struct Minute {
    at: u64,
    senders: Vec<(SenderLabel, Tally)>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    requests: u64,
    forwarded: u64,
    refused: u64,
}

impl Tally {
    fn add(&mut self, outcome: &str) {
        self.requests += 1;
        if outcome == FORWARDED {
            self.forwarded += 1;
        } else if PACING_REFUSALS.contains(&outcome) {
            self.refused += 1;
        }
    }
}

/// An endpoint's busiest senders, by minute over the last [`TOP_MINUTES`]: a ring of
/// minutes, each at most [`TOP_PER_MINUTE`] senders, so its size is bounded whatever
/// the number of senders.
#[derive(Debug, Default)]
pub struct TopSenders {
    minutes: [Minute; TOP_MINUTES as usize],
}

impl TopSenders {
    /// Counts one request of `sender` with `outcome` in minute `now`.
    fn add(&mut self, now: u64, sender: &SenderLabel, outcome: &str) {
        let minute = &mut self.minutes[(now % TOP_MINUTES) as usize];
        if minute.at != now {
            minute.at = now;
            minute.senders.clear();
        }
        if let Some((_, t)) = minute.senders.iter_mut().find(|(s, _)| s == sender) {
            t.add(outcome);
            return;
        }
        if minute.senders.len() < TOP_PER_MINUTE {
            let mut t = Tally::default();
            t.add(outcome);
            minute.senders.push((sender.clone(), t));
            return;
        }
        // Space-Saving: the newcomer takes the least busy place and its count, so no
        // sender's count is ever under its true one.
        if let Some(least) = minute.senders.iter_mut().min_by_key(|(_, t)| t.requests) {
            let mut t = Tally {
                requests: least.1.requests,
                ..Tally::default()
            };
            t.add(outcome);
            *least = (sender.clone(), t);
        }
    }

    /// The `n` busiest senders over the minutes ending with `now`.
    fn top(&self, now: u64, n: usize) -> Vec<SenderCount> {
        let mut sum: HashMap<&str, Tally> = HashMap::new();
        for m in &self.minutes {
            if m.at + TOP_MINUTES <= now || m.at > now {
                continue;
            }
            for (s, t) in &m.senders {
                let e = sum.entry(s.as_str()).or_default();
                e.requests += t.requests;
                e.forwarded += t.forwarded;
                e.refused += t.refused;
            }
        }
        let mut out: Vec<SenderCount> = sum
            .into_iter()
            .map(|(s, t)| SenderCount {
                sender: s.to_owned(),
                requests: t.requests,
                forwarded: t.forwarded,
                refused: t.refused,
            })
            .collect();
        out.sort_by(|a, b| b.requests.cmp(&a.requests).then(a.sender.cmp(&b.sender)));
        out.truncate(n);
        out
    }
}

/// The outcomes that are sluice's own pacing refusals (`refused_1m` in `/endpoints`).
const PACING_REFUSALS: [&str; 4] = [
    "rate_limited",
    "cooldown",
    "concurrency_limited",
    "store_unavailable",
];

impl PartialEq for EndpointLabel {
    fn eq(&self, other: &EndpointLabel) -> bool {
        self.0.id == other.0.id
    }
}

impl Eq for EndpointLabel {}

impl std::hash::Hash for EndpointLabel {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.id.hash(state);
    }
}

impl EncodeLabelValue for EndpointLabel {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, &self.0.id)
    }
}

/// `{endpoint}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct EndpointLabels {
    /// The endpoint (or `_other`).
    pub endpoint: EndpointLabel,
}

/// `{endpoint, per}`: one sliding window of an endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct WindowLabels {
    /// The endpoint (or `_other`).
    pub endpoint: EndpointLabel,
    /// The window's `per` as config spells it (`4s`, `1h`).
    pub per: String,
}

/// `{endpoint, outcome}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// The endpoint (or `_other`).
    pub endpoint: EndpointLabel,
    /// `forwarded`, or the `X-Sluice-Reason` of a refusal/failure.
    pub outcome: &'static str,
}

/// `{endpoint, sender, outcome}` of `sluice_sender_requests_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct SenderLabels {
    /// The endpoint (or `_other`).
    pub endpoint: EndpointLabel,
    /// The sender (or `_other`, or `_anonymous`).
    pub sender: SenderLabel,
    /// As in `sluice_requests_total`.
    pub outcome: &'static str,
}

/// `{endpoint, code}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CodeLabels {
    /// The endpoint (or `_other`).
    pub endpoint: EndpointLabel,
    /// The upstream status code.
    pub code: u16,
}

/// `{result}` of `sluice_intercepted_tunnels_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct InterceptLabels {
    /// `established`, `handshake_failed` or `handshake_timeout`.
    pub result: &'static str,
}

/// `{version, commit}` of `sluice_build_info`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct BuildLabels {
    /// The crate version.
    pub version: &'static str,
    /// The short git commit (or `unknown`).
    pub commit: &'static str,
}

/// The endpoint label every endpoint past `proxy.metrics_max_endpoints` shares (an
/// endpoint may not have this ID).
pub const OTHER: &str = crate::config::OTHER_ENDPOINT;

/// How many endpoints past `proxy.metrics_max_endpoints` that receivers throttled are
/// still watched (logs, `/endpoints`): a bound on what a sender spraying IDs at
/// throttling receivers can make sluice keep.
pub const MAX_WATCHED_UNLABELLED: usize = 10_000;

/// The outcome of a request that was sent upstream.
pub const FORWARDED: &str = "forwarded";

/// `sluice_log_dropped_total`: log lines dropped because the log writer had fallen
/// behind, read from the writer ([`crate::logging::dropped`]) when scraped.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogDropped;

impl EncodeMetric for LogDropped {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<NoLabelSet, _, u64>(&crate::logging::dropped(), None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Counter
    }
}

fn wait_histogram() -> Histogram {
    // 1 ms .. ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// All instruments.
pub struct Metrics {
    registry: Registry,
    /// `sluice_requests_total{endpoint,outcome}`.
    pub requests: Family<OutcomeLabels, Counter>,
    /// `sluice_sender_requests_total{endpoint,sender,outcome}`: the same counts by sender.
    pub sender_requests: Family<SenderLabels, Counter>,
    /// `sluice_wait_seconds{endpoint}`: time held before forwarding.
    pub wait: Family<EndpointLabels, Histogram, fn() -> Histogram>,
    /// `sluice_shadow_wait_seconds{endpoint}`: the wait shadow-mode requests would have had.
    pub shadow_wait: Family<EndpointLabels, Histogram, fn() -> Histogram>,
    /// `sluice_upstream_responses_total{endpoint,code}`.
    pub upstream: Family<CodeLabels, Counter>,
    /// `sluice_upstream_throttles_total{endpoint}`: 429s (and 503 + Retry-After) seen.
    pub throttles: Family<EndpointLabels, Counter>,
    /// `sluice_absorbed_total{endpoint}`: receivers' refusals sluice absorbed, each a
    /// request held behind the cooldown and sent again instead of passed on.
    pub absorbed: Family<EndpointLabels, Counter>,
    /// `sluice_endpoint_rate{endpoint}`: current effective rate.
    pub rate: Family<EndpointLabels, Gauge<f64, AtomicU64>>,
    /// `sluice_endpoint_at_floor{endpoint}`.
    pub at_floor: Family<EndpointLabels, Gauge>,
    /// `sluice_endpoint_cooldown_seconds{endpoint}`: cooldown left.
    pub cooldown: Family<EndpointLabels, Gauge<f64, AtomicU64>>,
    /// `sluice_window_used{endpoint,per}`: cost units started in the window's last `per`.
    pub window_used: Family<WindowLabels, Gauge<f64, AtomicU64>>,
    /// `sluice_tunnels_total{endpoint}`: CONNECT tunnels opened without interception.
    pub tunnels: Family<EndpointLabels, Counter>,
    /// `sluice_intercepted_tunnels_total{result}`: intercepted CONNECTs by how their TLS
    /// handshake with the sender ended (a sender that does not trust sluice's CA shows
    /// here as `handshake_failed`).
    pub intercepted: Family<InterceptLabels, Counter>,
    /// `sluice_connections_open`.
    pub connections: Gauge,
    /// `sluice_in_flight{endpoint}`: slots (`max_in_flight`) this replica holds.
    pub in_flight: Family<EndpointLabels, Gauge>,
    /// `sluice_slot_wait_seconds{endpoint}`: time requests waited for an in-flight slot.
    pub slot_wait: Family<EndpointLabels, Histogram, fn() -> Histogram>,
    /// `sluice_waiting{endpoint}`: requests waiting on this replica (queued or for their
    /// reserved start), as the observer last looked.
    pub waiting: Family<EndpointLabels, Gauge>,
    /// `sluice_oldest_wait_seconds{endpoint}`: how long the longest-waiting of them has
    /// waited, as the observer last looked.
    pub oldest_wait: Family<EndpointLabels, Gauge<f64, AtomicU64>>,
    /// Store instruments.
    pub store: StoreStats,
    /// `sluice_build_info{version,commit}`: always 1.
    pub build_info: Family<BuildLabels, Gauge>,
    /// `sluice_host_fallback_total`: requests that named no endpoint (header, proxy
    /// user, `hosts` rule) and were paced under their destination host.
    pub host_fallback: Counter,
    /// `sluice_reload_failures_total`: reloads refused (the running config kept).
    pub reload_failures: Counter,
    /// `sluice_memory_pressed`: 1 while resident memory is near `proxy.max_memory`.
    pub memory_pressed: Gauge,
    labelled: RwLock<HashMap<Arc<str>, EndpointLabel>>,
    /// Endpoints past the label cap that a receiver throttled: still watched by the
    /// observer and listed by `/endpoints` (at most [`MAX_WATCHED_UNLABELLED`]).
    throttled: RwLock<HashSet<Arc<str>>>,
    max_labels: usize,
    other: EndpointLabel,
    /// Sender label values given out (at most `max_senders`).
    senders: RwLock<HashMap<Arc<str>, SenderLabel>>,
    max_senders: usize,
    other_sender: SenderLabel,
    anonymous: SenderLabel,
}

impl Metrics {
    /// Registers everything; `configured` endpoints always get their own label.
    pub fn new<'a>(max_labels: usize, configured: impl Iterator<Item = &'a Arc<str>>) -> Metrics {
        let mut registry = Registry::with_prefix("sluice");
        let m = Metrics {
            requests: Family::default(),
            sender_requests: Family::default(),
            wait: Family::new_with_constructor(wait_histogram as fn() -> Histogram),
            shadow_wait: Family::new_with_constructor(wait_histogram as fn() -> Histogram),
            upstream: Family::default(),
            throttles: Family::default(),
            absorbed: Family::default(),
            rate: Family::default(),
            at_floor: Family::default(),
            cooldown: Family::default(),
            window_used: Family::default(),
            tunnels: Family::default(),
            intercepted: Family::default(),
            connections: Gauge::default(),
            in_flight: Family::default(),
            slot_wait: Family::new_with_constructor(wait_histogram as fn() -> Histogram),
            waiting: Family::default(),
            oldest_wait: Family::default(),
            store: StoreStats::default(),
            build_info: Family::default(),
            host_fallback: Counter::default(),
            reload_failures: Counter::default(),
            memory_pressed: Gauge::default(),
            labelled: RwLock::default(),
            throttled: RwLock::default(),
            max_labels,
            other: EndpointLabel::new(OTHER.into()),
            senders: RwLock::default(),
            max_senders: DEFAULT_MAX_SENDERS,
            other_sender: SenderLabel(OTHER.into()),
            anonymous: SenderLabel(ANONYMOUS.into()),
            registry: Registry::default(),
        };
        m.build_info
            .get_or_create(&BuildLabels {
                version: crate::version::VERSION,
                commit: crate::version::COMMIT,
            })
            .set(1);
        m.configure(configured);
        m.register(&mut registry);
        Metrics { registry, ..m }
    }

    /// Caps sender label values at `max` (`proxy.metrics_max_senders`): past them,
    /// senders count under `sender="_other"`.
    pub fn with_max_senders(mut self, max: usize) -> Metrics {
        self.max_senders = max;
        self
    }

    /// Gives each configured endpoint its own label (whatever the cap) and its request
    /// series at 0 (`sluice_requests_total` for `forwarded` and each pacing refusal,
    /// `sluice_wait_seconds`, `sluice_upstream_throttles_total`), so dashboards and
    /// `rate()` see a configured endpoint from the start, or from the reload that adds
    /// it, not from its first request.
    pub fn configure<'a>(&self, configured: impl Iterator<Item = &'a Arc<str>>) {
        for id in configured {
            // `_other` is no endpoint ID (the config refuses it).
            if &**id == OTHER {
                continue;
            }
            let Ok(mut set) = self.labelled.write() else {
                return;
            };
            let label = set
                .entry(Arc::clone(id))
                .or_insert_with(|| EndpointLabel::new(Arc::clone(id)))
                .clone();
            drop(set);
            let of = |outcome| OutcomeLabels {
                endpoint: label.clone(),
                outcome,
            };
            label
                .0
                .forwarded
                .get_or_init(|| self.requests.get_or_create(&of(FORWARDED)).clone());
            for outcome in PACING_REFUSALS {
                drop(self.requests.get_or_create(&of(outcome)));
            }
            let labels = EndpointLabels {
                endpoint: label.clone(),
            };
            label
                .0
                .wait
                .get_or_init(|| self.wait.get_or_create(&labels).clone());
            drop(self.throttles.get_or_create(&labels));
        }
    }

    /// Registers every instrument under the `sluice_` prefix.
    fn register(&self, registry: &mut Registry) {
        let m = self;
        registry.register(
            "requests",
            "Requests by endpoint and outcome",
            m.requests.clone(),
        );
        registry.register(
            "sender_requests",
            "Requests by endpoint, sender and outcome",
            m.sender_requests.clone(),
        );
        registry.register(
            "wait_seconds",
            "Time requests waited for their token",
            m.wait.clone(),
        );
        registry.register(
            "shadow_wait_seconds",
            "Shadow mode: the time requests would have waited for their token",
            m.shadow_wait.clone(),
        );
        registry.register(
            "upstream_responses",
            "Upstream responses by status code",
            m.upstream.clone(),
        );
        registry.register(
            "upstream_throttles",
            "Throttling responses (429, 503 with Retry-After)",
            m.throttles.clone(),
        );
        registry.register(
            "absorbed",
            "Receivers' refusals absorbed: the request held behind the cooldown and sent again",
            m.absorbed.clone(),
        );
        registry.register(
            "endpoint_rate",
            "Current effective rate (tokens/s)",
            m.rate.clone(),
        );
        registry.register(
            "endpoint_at_floor",
            "1 while the endpoint's rate sits at its adaptive floor",
            m.at_floor.clone(),
        );
        registry.register(
            "endpoint_cooldown_seconds",
            "Cooldown left",
            m.cooldown.clone(),
        );
        registry.register(
            "window_used",
            "Cost units started in a sliding window's last interval (windows)",
            m.window_used.clone(),
        );
        registry.register(
            "tunnels",
            "CONNECT tunnels paced as one unit (not intercepted)",
            m.tunnels.clone(),
        );
        registry.register(
            "intercepted_tunnels",
            "Intercepted CONNECT tunnels by how the sender's TLS handshake ended",
            m.intercepted.clone(),
        );
        registry.register(
            "connections_open",
            "Open sender connections",
            m.connections.clone(),
        );
        registry.register(
            "in_flight",
            "Requests holding an in-flight slot (max_in_flight) on this replica",
            m.in_flight.clone(),
        );
        registry.register(
            "slot_wait_seconds",
            "Time requests waited for an in-flight slot",
            m.slot_wait.clone(),
        );
        registry.register(
            "waiting",
            "Requests waiting on this replica: in the endpoint's queue or for their reserved start",
            m.waiting.clone(),
        );
        registry.register(
            "oldest_wait_seconds",
            "How long the longest-waiting request on this replica has waited",
            m.oldest_wait.clone(),
        );
        registry.register("store_errors", "Failed store calls", m.store.errors.clone());
        registry.register(
            "store_seconds",
            "Latency of store calls",
            m.store.seconds.clone(),
        );
        registry.register(
            "store_degraded",
            "1 while the on_error fallback is in force",
            m.store.degraded.clone(),
        );
        registry.register(
            "store_degraded_slots",
            "Redis Cluster hash slots whose endpoints the on_error fallback decides now",
            m.store.degraded_slots.clone(),
        );
        registry.register(
            "store_cooldown_notices",
            "Cooldown notices heard from the store (single Redis pub/sub)",
            m.store.notices.clone(),
        );
        registry.register(
            "host_fallback",
            "Requests that named no endpoint and were paced under their destination host",
            m.host_fallback.clone(),
        );
        registry.register(
            "reload_failures",
            "Reloads refused: the running config was kept",
            m.reload_failures.clone(),
        );
        registry.register(
            "store_rebuilds",
            "Buckets the store had lost or rolled back, rebuilt from what this replica heard",
            m.store.rebuilds.clone(),
        );
        registry.register(
            "memory_pressed",
            "1 while resident memory is near proxy.max_memory: not accepting, idle connections closed",
            m.memory_pressed.clone(),
        );
        registry.register(
            "endpoints_tracked",
            "Endpoints the memory store holds a bucket of (at most store.max_endpoints)",
            m.store.endpoints.tracked.clone(),
        );
        registry.register(
            "endpoint_state_evicted",
            "Idle endpoint buckets the memory store evicted (full again: nothing lost)",
            m.store.endpoints.evicted.clone(),
        );
        registry.register(
            "log_dropped",
            "Log lines dropped because the log writer had fallen behind",
            LogDropped,
        );
        registry.register(
            "build_info",
            "The running build: version and git commit; always 1",
            m.build_info.clone(),
        );
    }

    /// The label for an endpoint: its ID while under the cap, else `_other`.
    pub fn label(&self, id: &Arc<str>) -> EndpointLabel {
        if let Ok(set) = self.labelled.read() {
            if let Some(label) = set.get(id) {
                return label.clone();
            }
            // A host-derived ID may be `_other` (no header check reaches it): it is the
            // overflow label's, never a label of its own beside it.
            if set.len() >= self.max_labels || &**id == OTHER {
                return self.other.clone();
            }
        }
        match self.labelled.write() {
            Ok(mut set)
                if (set.len() < self.max_labels || set.contains_key(id)) && &**id != OTHER =>
            {
                set.entry(Arc::clone(id))
                    .or_insert_with(|| EndpointLabel::new(Arc::clone(id)))
                    .clone()
            }
            _ => self.other.clone(),
        }
    }

    /// The label an endpoint already has (configured or seen before), else `_other`:
    /// for refusals counted before a request earned a label of its own.
    pub fn existing_label(&self, id: &Arc<str>) -> EndpointLabel {
        match self.labelled.read() {
            Ok(set) => set.get(id).cloned().unwrap_or_else(|| self.other.clone()),
            _ => self.other.clone(),
        }
    }

    /// The `_other` label.
    pub fn other(&self) -> EndpointLabel {
        self.other.clone()
    }

    /// Whether `label` is `_other`.
    pub fn is_other(&self, label: &EndpointLabel) -> bool {
        Arc::ptr_eq(&label.0, &self.other.0)
    }

    /// Endpoint IDs that have their own label (configured, then first seen).
    pub fn labelled_ids(&self) -> Vec<Arc<str>> {
        self.labelled
            .read()
            .map(|s| s.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Every endpoint the views watch: those with a label, and those past the cap a
    /// receiver throttled (their cooldowns, decreases and floors are logged and listed
    /// although their series are `_other`'s).
    pub fn watched_ids(&self) -> Vec<Arc<str>> {
        let mut ids = self.labelled_ids();
        if let Ok(t) = self.throttled.read() {
            ids.extend(t.iter().cloned());
        }
        ids
    }

    /// Notes that a receiver throttled `id`: an endpoint past the label cap is watched
    /// from now on (up to [`MAX_WATCHED_UNLABELLED`] of them).
    pub fn note_throttled(&self, id: &Arc<str>) {
        if self.labelled.read().is_ok_and(|l| l.contains_key(id)) {
            return;
        }
        if let Ok(mut t) = self.throttled.write() {
            if t.len() < MAX_WATCHED_UNLABELLED {
                t.insert(Arc::clone(id));
            }
        }
    }

    /// The sender label of a request: its authenticated proxy `user`, else (with
    /// `proxy.trust_sender_header`) its `X-Sluice-Sender` (cut to [`MAX_SENDER_LEN`]
    /// bytes), else [`ANONYMOUS`]; [`OTHER`] once `proxy.metrics_max_senders` names
    /// have their own.
    pub fn sender(
        &self,
        proxy: &crate::config::ProxyConfig,
        user: Option<&Arc<str>>,
        headers: &http::HeaderMap,
    ) -> SenderLabel {
        let named = headers
            .get(&crate::headers::SENDER_HEADER)
            .filter(|_| proxy.trust_sender_header && user.is_none());
        match (user, named) {
            (Some(user), _) => self.sender_label(user),
            (None, Some(v)) => {
                let raw = &v.as_bytes()[..v.len().min(MAX_SENDER_LEN)];
                let name = String::from_utf8_lossy(raw);
                match name.trim_end_matches('\u{fffd}') {
                    "" => self.sender_label(ANONYMOUS),
                    name => self.sender_label(name),
                }
            }
            (None, None) => self.sender_label(ANONYMOUS),
        }
    }

    /// The label of sender `name`: its own while under the cap, else `_other`.
    fn sender_label(&self, name: &str) -> SenderLabel {
        if let Ok(set) = self.senders.read() {
            if let Some(label) = set.get(name) {
                return label.clone();
            }
            if set.len() >= self.max_senders || name == OTHER {
                return self.other_sender.clone();
            }
        }
        match self.senders.write() {
            Ok(mut set)
                if (set.len() < self.max_senders || set.contains_key(name)) && name != OTHER =>
            {
                let label = set.get(name).cloned().unwrap_or_else(|| {
                    if name == ANONYMOUS {
                        self.anonymous.clone()
                    } else {
                        SenderLabel(name.into())
                    }
                });
                set.insert(Arc::clone(&label.0), label.clone());
                label
            }
            _ => self.other_sender.clone(),
        }
    }

    /// Counts one request outcome, under its sender (`None`: [`ANONYMOUS`], a request
    /// refused before its sender was known).
    pub fn outcome(
        &self,
        endpoint: &EndpointLabel,
        sender: Option<&SenderLabel>,
        outcome: &'static str,
    ) {
        let sender = match sender {
            Some(s) => s.clone(),
            None => self.sender_label(ANONYMOUS),
        };
        endpoint
            .0
            .senders
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(now_secs() / 60, &sender, outcome);
        self.sender_requests
            .get_or_create(&SenderLabels {
                endpoint: endpoint.clone(),
                sender,
                outcome,
            })
            .inc();
        let series = |outcome| {
            self.requests
                .get_or_create(&OutcomeLabels {
                    endpoint: endpoint.clone(),
                    outcome,
                })
                .clone()
        };
        if outcome == FORWARDED {
            endpoint.0.forwarded.get_or_init(|| series(FORWARDED)).inc();
        } else {
            if PACING_REFUSALS.contains(&outcome) {
                endpoint.0.refused.add(now_secs());
            }
            series(outcome).inc();
        }
    }

    /// Records how long an enforced request waited for its token.
    pub fn waited(&self, endpoint: &EndpointLabel, seconds: f64) {
        endpoint
            .0
            .wait
            .get_or_init(|| {
                self.wait
                    .get_or_create(&EndpointLabels {
                        endpoint: endpoint.clone(),
                    })
                    .clone()
            })
            .observe(seconds);
    }

    /// Counts one upstream response by status code.
    pub fn upstream_code(&self, endpoint: &EndpointLabel, code: u16) {
        let series = || {
            self.upstream
                .get_or_create(&CodeLabels {
                    endpoint: endpoint.clone(),
                    code,
                })
                .clone()
        };
        let (first, counter) = endpoint.0.first_code.get_or_init(|| (code, series()));
        if *first == code {
            counter.inc();
        } else {
            series().inc();
        }
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_named_like_the_overflow_label_is_that_label() {
        // A host-derived ID `_other` (from `http://_other/`) is the overflow label, not
        // a label of its own beside it.
        let m = Metrics::new(10, std::iter::empty());
        let l = m.label(&Arc::from(OTHER));
        assert!(l == m.other());
        assert!(m.labelled_ids().is_empty());
    }

    #[test]
    fn label_cap_holds() {
        let configured: Vec<Arc<str>> = vec!["configured".into()];
        let m = Metrics::new(10, configured.iter());
        for i in 0..1000 {
            let l = m.label(&Arc::from(format!("ep{i}")));
            m.outcome(&l, None, "forwarded");
        }
        assert_eq!(m.label(&Arc::from("configured")).as_str(), "configured");
        assert_eq!(m.label(&Arc::from("ep999")).as_str(), "_other");
        let text = m.render();
        let endpoints: HashSet<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("sluice_requests_total{endpoint=\""))
            .filter_map(|l| l.split('"').next())
            .collect();
        assert!(endpoints.len() <= 11, "{} endpoints", endpoints.len());
    }

    /// The series a label carries render exactly as looked-up ones would, and a second
    /// status code gets its own series.
    #[test]
    fn carried_series_count_like_looked_up_ones() {
        let m = Metrics::new(10, std::iter::empty());
        let l = m.label(&Arc::from("ep"));
        for _ in 0..3 {
            m.outcome(&l, None, FORWARDED);
        }
        m.outcome(&m.label(&Arc::from("ep")), None, "rate_limited");
        m.upstream_code(&l, 200);
        m.upstream_code(&m.existing_label(&Arc::from("ep")), 200);
        m.upstream_code(&l, 429);
        m.waited(&l, 0.5);
        m.waited(&m.label(&Arc::from("ep")), 0.5);
        let text = m.render();
        for want in [
            "sluice_requests_total{endpoint=\"ep\",outcome=\"forwarded\"} 3",
            "sluice_requests_total{endpoint=\"ep\",outcome=\"rate_limited\"} 1",
            "sluice_upstream_responses_total{endpoint=\"ep\",code=\"200\"} 2",
            "sluice_upstream_responses_total{endpoint=\"ep\",code=\"429\"} 1",
            "sluice_wait_seconds_count{endpoint=\"ep\"} 2",
        ] {
            assert!(text.contains(want), "no {want} in\n{text}");
        }
    }

    /// The last minute's refusals: counted per second, summed over the 60 seconds
    /// ending now, older seconds' slots reused.
    #[test]
    fn recent_counts_cover_the_last_minute() {
        let r = Recent::default();
        for s in [1, 1, 2, 30] {
            r.add(s);
        }
        assert_eq!(r.sum(30), 4);
        assert_eq!(r.sum(61), 2, "second 1 is out of the minute ending at 61");
        r.add(61);
        assert_eq!(r.sum(61), 3);
        assert_eq!(r.sum(89), 2, "30 and 61");
        r.add(121);
        assert_eq!(r.sum(121), 1, "61's slot went to 121");
        assert_eq!(r.sum(200), 0);
    }

    /// In flight while the guard lives; refusals of pacing counted, others not.
    #[test]
    fn a_label_counts_in_flight_and_recent_refusals() {
        let m = Metrics::new(10, std::iter::empty());
        let l = m.label(&Arc::from("ep"));
        let a = l.sending();
        let b = m.label(&Arc::from("ep")).sending();
        assert_eq!(l.in_flight(), 2);
        drop(a);
        drop(b);
        assert_eq!(l.in_flight(), 0);
        m.outcome(&l, None, "rate_limited");
        m.outcome(&l, None, "cooldown");
        m.outcome(&l, None, "upstream_error");
        m.outcome(&l, None, FORWARDED);
        assert_eq!(l.refused_last_minute(), 2);
        assert_eq!(l.forwarded(), 1);
    }

    /// Senders past the cap share `_other`; a sender's counts add up by outcome.
    #[test]
    fn sender_labels_are_capped() {
        let m = Metrics::new(10, std::iter::empty()).with_max_senders(3);
        let l = m.label(&Arc::from("ep"));
        for i in 0..50 {
            let s = m.sender_label(&format!("s{i}"));
            m.outcome(&l, Some(&s), FORWARDED);
        }
        assert_eq!(m.sender_label("s0").as_str(), "s0");
        assert_eq!(m.sender_label("s2").as_str(), "s2");
        assert_eq!(m.sender_label("s3").as_str(), OTHER);
        let text = m.render();
        let n = text
            .lines()
            .filter(|l| l.starts_with("sluice_sender_requests_total{"))
            .count();
        assert_eq!(n, 4, "{text}");
        assert!(
            text.contains(
                "sluice_sender_requests_total{endpoint=\"ep\",sender=\"_other\",outcome=\"forwarded\"} 47"
            ),
            "{text}"
        );
    }

    /// The busiest senders of the last minutes, summed over minutes; a minute past its
    /// places keeps the busy senders (Space-Saving), and old minutes drop out.
    #[test]
    fn top_senders_keep_the_busiest() {
        let m = Metrics::new(10, std::iter::empty());
        let (a, b) = (m.sender_label("a"), m.sender_label("b"));
        let mut top = TopSenders::default();
        for _ in 0..100 {
            top.add(1, &a, FORWARDED);
        }
        for _ in 0..40 {
            top.add(2, &b, "rate_limited");
        }
        for i in 0..1000 {
            top.add(2, &m.sender_label(&format!("x{i}")), FORWARDED);
        }
        for _ in 0..10 {
            top.add(2, &a, FORWARDED);
        }
        let t = top.top(2, 2);
        assert_eq!(t[0].sender, "a");
        assert!(t[0].requests >= 110, "{t:?}");
        assert_eq!(t[1].sender, "b");
        assert_eq!((t[1].requests, t[1].refused, t[1].forwarded), (40, 40, 0));
        let later = top.top(1 + TOP_MINUTES, 5);
        assert!(
            later.iter().all(|c| c.sender != "a" || c.requests < 100),
            "{later:?}"
        );
        assert!(top.top(2 + TOP_MINUTES, 5).is_empty());
        assert!(
            top.minutes
                .iter()
                .all(|m| m.senders.len() <= TOP_PER_MINUTE)
        );
    }

    #[test]
    fn build_info_names_version_and_commit() {
        let m = Metrics::new(10, std::iter::empty());
        let text = m.render();
        let want = format!(
            "sluice_build_info{{version=\"{}\",commit=\"{}\"}} 1",
            crate::version::VERSION,
            crate::version::COMMIT
        );
        assert!(text.contains(&want), "{text}");
    }
}
