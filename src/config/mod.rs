//! The config file: TOML text → a validated, typed [`Config`].
//!
//! Parsing walks the spanned TOML tree by hand instead of through serde so that *every*
//! problem in a file is reported at once, each with its `line:column` and dotted key.
//! Nothing downstream ever looks a key up by string: durations are [`Duration`], rates
//! are checked finite floats, header names are [`HeaderName`]s, globs are compiled.
//!
//! - this file: the validated types every other room reads, and [`Config`]'s API
//!   (load, parse, `${NAME}` expansion, relative paths, file checks);
//! - `reader.rs`: the generic reader (spans → `line:column`, typed values, suggestions
//!   for typos);
//! - `schema.rs`: one reader per section, naming its keys, defaults and rules;
//! - `profiles.rs`: the webhook platforms `[sender] profile` names, each figure cited
//!   from the platform's source.
//! - `receivers.rs`: the receivers an endpoint's `profile` names (`profiles/*.toml`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use globset::{Glob, GlobSet, GlobSetBuilder};
use http::HeaderName;
use toml::Spanned;
use toml::de::{DeTable, DeValue};

mod profiles;
mod reader;
mod receivers;
mod schema;

pub use profiles::{PROFILES, SenderProfile, profile};
pub use receivers::{
    QuotaHeaders, RECEIVERS, ReceiverHints, ReceiverMeta, ReceiverProfile, receiver,
};

use reader::Reader;

/// One problem found in a config file, located by line, column and key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{line}:{column}: {key}: {message}")]
pub struct ConfigIssue {
    /// 1-based line of the offending key or value.
    pub line: usize,
    /// 1-based column.
    pub column: usize,
    /// Dotted key path, e.g. `defaults.rate` or `endpoints[2].id`.
    pub key: String,
    /// What is wrong and, where it helps, how to fix it.
    pub message: String,
}

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The path given.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file was read but is invalid; every problem is listed.
    #[error("{path}: {} error(s):\n{}", issues.len(), render(issues))]
    Invalid {
        /// The path given (or `<inline>`).
        path: PathBuf,
        /// Every problem found, in file order.
        issues: Vec<ConfigIssue>,
    },
    /// Files the config names are missing or unreadable ([`Config::check_files`]).
    #[error("{path}: {} file(s) cannot be read:\n{}", issues.len(), render(issues))]
    Files {
        /// The config file.
        path: PathBuf,
        /// One per unreadable file, naming its key.
        issues: Vec<FileIssue>,
    },
}

/// A file named by the config that cannot be opened and read.
#[derive(Debug, thiserror::Error)]
#[error("{key}: cannot read {}: {source}", path.display())]
pub struct FileIssue {
    /// Dotted key naming the file, e.g. `tls.ca_key` or `tls.upstream_roots[1]`.
    pub key: String,
    /// The path tried (after [`Config::resolve_paths`]).
    pub path: PathBuf,
    /// Why it cannot be read.
    pub source: std::io::Error,
}

fn render(issues: &[impl std::fmt::Display]) -> String {
    issues
        .iter()
        .map(|i| format!("  {i}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Which bucket store backs the limiter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// In-process buckets (one replica).
    Memory,
    /// One Redis server shared by replicas.
    Redis,
    /// A Redis Cluster; `urls` are seed nodes.
    RedisCluster,
    /// A Redis master found through Redis Sentinel; `urls` are the sentinels and
    /// `sentinel_master` names the master.
    RedisSentinel,
}

/// What to do when the shared store fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// Fall back to an in-process bucket with the same policy.
    Local,
    /// Forward without limiting.
    Allow,
    /// Refuse with 503 `store_unavailable`.
    Deny,
}

/// What happens to endpoint IDs that are not listed in `[[endpoints]]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownEndpoints {
    /// They get the `[defaults]` policy.
    Default,
    /// They are refused with 403 `unknown_endpoint`.
    Reject,
}

/// Whether an endpoint's limit is enforced or only measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Requests wait for their token or are refused.
    #[default]
    Enforce,
    /// Nothing waits and nothing is refused; what would have happened is counted and
    /// logged (for rolling sluice out in front of live traffic).
    Shadow,
}

/// `[log]`: the per-request decision log and where every log line goes.
#[derive(Debug, Clone, PartialEq)]
pub struct LogConfig {
    /// One structured line per request (target `sluice::decision`, level info).
    pub decisions: bool,
    /// Fraction of forwarded requests logged, in [0, 1]; refusals are always logged.
    pub sample: f64,
    /// The file every log line is appended to instead of stderr (read at start).
    pub file: Option<PathBuf>,
    /// Lines queued for the background writer at most; past them lines are dropped and
    /// counted (`sluice_log_dropped_total`) rather than waited for (read at start).
    pub buffer_lines: usize,
}

/// `[traces]`: OpenTelemetry spans of each request, exported over OTLP/HTTP
/// ([`crate::traces`]); off without `otlp_endpoint`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TracesConfig {
    /// Where spans are sent (`http://collector:4318/v1/traces`), as is; `None`: off.
    pub otlp_endpoint: Option<http::Uri>,
    /// `service.name` of the spans.
    pub service_name: String,
    /// Fraction of requests traced that arrive without a sampled `traceparent`, in
    /// [0, 1]; a sender's sampled trace is always followed.
    pub sample: f64,
}

/// Reaction to upstream throttling (`[defaults.adaptive]`, per-endpoint overrides).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adaptive {
    /// The rate never drops below this (tokens/s).
    pub floor: f64,
    /// Multiplier applied to the rate on a throttling response, in (0, 1).
    pub decrease: f64,
    /// Time of the linear climb from the decreased rate back to the configured one.
    pub recovery: Duration,
    /// Cooldown when a 429 carries no usable Retry-After.
    pub default_cooldown: Duration,
    /// Clamp on any cooldown taken from headers.
    pub max_cooldown: Duration,
    /// Warn when an endpoint has stayed at its floor this long.
    pub floor_warn_after: Duration,
    /// Which requests a receiver's 429 (or 503 with `Retry-After`) is absorbed for: held
    /// behind the cooldown and sent again within the wait budget instead of passed on.
    pub absorb: Absorb,
    /// At most this many resends of one request after its receiver's refusals (1–10).
    pub absorb_attempts: u32,
    /// Bodies up to this many bytes are kept for a resend; a larger one is never resent.
    pub absorb_max_body: u64,
    /// `learn`: a quota the receiver publishes in its answers' headers lowers the pace
    /// until its reset (`crate::adapt::learned`).
    pub learn: bool,
}

/// `absorb`: which requests sluice sends again itself when the receiver refuses them
/// with a 429 (or a 503 with `Retry-After`) and the cooldown ends within what is left of
/// the request's wait budget. Every webhook platform counts a refusal passed on as a
/// spent attempt and retries on its own, much later, schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Absorb {
    /// Never: every refusal is passed on to the sender.
    Off,
    /// Requests that are safe to send twice: the methods RFC 9110 calls idempotent,
    /// any request carrying `Idempotency-Key`, and every request to an endpoint with
    /// `absorb_post = true` (a 429 says the request was not processed, and webhook
    /// receivers deduplicate on the message ID).
    #[default]
    Safe,
    /// Every request whose body can be replayed, whatever its method.
    All,
}

/// Default `absorb_attempts`.
pub const DEFAULT_ABSORB_ATTEMPTS: u32 = 2;
/// Most `absorb_attempts` a config may ask for: each resend waits out a cooldown, and
/// more than this is a receiver that does not want the request.
pub const MAX_ABSORB_ATTEMPTS: u32 = 10;
/// Default `absorb_max_body`: 1 MiB, larger than nearly every webhook payload.
pub const DEFAULT_ABSORB_MAX_BODY: u64 = 1 << 20;
/// Largest `absorb_max_body`: a kept body is memory held for the whole wait, per request.
pub const MAX_ABSORB_MAX_BODY: u64 = 64 << 20;

impl Default for Adaptive {
    fn default() -> Self {
        Adaptive {
            floor: 1.0,
            decrease: 0.5,
            recovery: Duration::from_secs(300),
            default_cooldown: Duration::from_secs(1),
            max_cooldown: Duration::from_secs(300),
            floor_warn_after: Duration::from_secs(300),
            absorb: Absorb::Safe,
            absorb_attempts: DEFAULT_ABSORB_ATTEMPTS,
            absorb_max_body: DEFAULT_ABSORB_MAX_BODY,
            learn: true,
        }
    }
}

/// The limit of one endpoint, shared behind an `Arc` on the hot path.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Sustained tokens per second (> 0).
    pub rate: f64,
    /// Bucket capacity (≥ 1).
    pub burst: f64,
    /// Longest a request may wait for its token; zero never waits.
    pub max_wait: Duration,
    /// Reaction to 429s; `None` when disabled.
    pub adaptive: Option<Adaptive>,
    /// Requests allowed in flight at once (`max_in_flight`), across replicas; `None`
    /// is unlimited (and costs nothing).
    pub max_in_flight: Option<u32>,
    /// Life of an in-flight slot's lease without renewal (`lease_ttl`): the slots of a
    /// replica that died return within this.
    pub lease_ttl: Duration,
    /// Weights of senders (`shares`); `None`: no fair queue, plain arrival order.
    pub shares: Option<Arc<Shares>>,
    /// `absorb_post`: a receiver's refusal of any request to this endpoint, POST
    /// included, may be absorbed under `absorb = "safe"` (its receiver deduplicates).
    pub absorb_post: bool,
    /// `windows = [{ limit, per }]`: sliding windows decided with the bucket (at most
    /// `limit` cost units in any interval of `per`); none by default.
    pub windows: crate::window::Windows,
    /// `cost`: what one request spends of the bucket and of every window, unless it
    /// names its own (`X-Sluice-Cost`); 1 by default, never over `burst` or a window's
    /// `limit`.
    pub cost: u32,
    /// What is known of the receiver's answers (`profile`, `retry_after_json`,
    /// `quota_headers`).
    pub receiver: ReceiverHints,
}

/// `shares = { svix = 3, batch = 1 }`: the weight of each named sender on an endpoint.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Shares {
    weights: std::collections::HashMap<String, f64>,
}

impl Shares {
    /// Weights by sender name.
    pub fn new(weights: std::collections::HashMap<String, f64>) -> Shares {
        Shares { weights }
    }

    /// The weight of `sender`; unlisted senders weigh 1.
    pub fn weight(&self, sender: &str) -> f64 {
        self.weights.get(sender).copied().unwrap_or(1.0)
    }
}

/// Default `lease_ttl`.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);
/// Shortest `lease_ttl`: a slot's lease is renewed every third of it, through a store
/// call; shorter, a lease can lapse between renewals and let one more request in.
pub const MIN_LEASE_TTL: Duration = Duration::from_secs(1);

impl Default for Policy {
    fn default() -> Self {
        Policy {
            rate: 10.0,
            burst: 20.0,
            max_wait: Duration::from_secs(5),
            adaptive: Some(Adaptive::default()),
            max_in_flight: None,
            lease_ttl: DEFAULT_LEASE_TTL,
            shares: None,
            absorb_post: false,
            windows: crate::window::Windows::NONE,
            cost: 1,
            receiver: ReceiverHints::default(),
        }
    }
}

/// One `[[endpoints]]` entry.
#[derive(Debug, Clone)]
pub struct EndpointRule {
    /// The endpoint ID.
    pub id: Arc<str>,
    /// Its limit.
    pub policy: Arc<Policy>,
    /// Destination hosts (each with an optional port) that map here without the header.
    pub hosts: Vec<HostRule>,
    /// Optional refinement of `hosts`.
    pub path_prefix: Option<String>,
    /// Enforced or shadow.
    pub mode: Mode,
    /// `sender_profile`: the platform sending to this endpoint, when it is not the one
    /// `[sender]` names.
    pub sender_profile: Option<&'static SenderProfile>,
}

/// One `hosts` entry of an `[[endpoints]]` rule: a host, and the one port it is kept to
/// when written with one (`hooks.example.com:8443`, `[::1]:8443`), so two receivers on
/// one host can have buckets of their own without a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRule {
    /// The host as a request's host is read ([`crate::host::normalise_host`]):
    /// lowercase, no trailing dot, IPv6 without brackets, IPv4 in dotted decimal.
    pub host: String,
    /// `Some`: only requests to this port; `None`: every port.
    pub port: Option<u16>,
}

impl HostRule {
    /// Whether a request to `host` (normalised) on its effective `port` (80 for
    /// `http://` without one, 443 for `https://`, a tunnel's CONNECT port) matches.
    pub fn matches(&self, host: &str, port: u16) -> bool {
        self.host == host && self.port.is_none_or(|p| p == port)
    }
}

/// `[proxy]`.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Where senders connect.
    pub listen: SocketAddr,
    /// Admin listener (`/metrics` …).
    pub admin_listen: SocketAddr,
    /// Header naming the endpoint; removed before forwarding.
    pub endpoint_header: HeaderName,
    /// Take the endpoint from the `Proxy-Authorization` user name.
    pub endpoint_from_proxy_user: bool,
    /// Limit on waiting for the upstream's response head.
    pub upstream_timeout: Duration,
    /// Grace period for in-flight requests on shutdown.
    pub shutdown_grace: Duration,
    /// Cap on concurrent sender connections.
    pub max_connections: usize,
    /// `max_memory` (bytes; 0: the cgroup's limit, else 1 GiB): the ceiling near which
    /// sluice stops accepting and closes idle connections ([`crate::budget`]).
    pub max_memory: u64,
    /// Distinct `endpoint` label values in metrics before the rest become `_other`.
    pub metrics_max_endpoints: usize,
    /// Distinct `sender` label values in metrics before the rest become `_other`.
    pub metrics_max_senders: usize,
    /// `X-Sluice-Sender` names a request's sender in per-sender metrics when no
    /// authenticated proxy user does.
    pub trust_sender_header: bool,
    /// Threads serving requests: 0 = one per core; 1 = a single-threaded runtime (no
    /// cross-thread wake-ups: the least CPU per request on small machines).
    pub workers: usize,
    /// Bind each worker to a CPU of its own when the process may run on exactly as many
    /// CPUs as there are workers.
    pub pin_workers: bool,
    /// A sender connection (also HTTP inside an intercepted tunnel) with no bytes either
    /// way and no request in flight for this long is closed.
    pub idle_timeout: Duration,
    /// An HTTP/1.1 sender (also inside an intercepted tunnel) that began a request head
    /// must finish it within this, or its connection is closed. The wait for a kept-alive
    /// connection's next request is `idle_timeout`'s, not this.
    pub header_read_timeout: Duration,
    /// A CONNECT tunnel (not intercepted) with no bytes either way for this long is closed.
    pub tunnel_idle_timeout: Duration,
    /// When set, `/metrics` and `/endpoints` need `Authorization: Bearer <file content>`.
    pub admin_token_file: Option<PathBuf>,
}

/// `[store]`.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Which store.
    pub backend: Backend,
    /// Redis URLs (one for `redis`, seeds for `redis-cluster`).
    pub urls: Vec<String>,
    /// Prefix of every Redis key.
    pub key_prefix: String,
    /// Timeout of each store call.
    pub timeout: Duration,
    /// Behaviour when the store fails.
    pub on_error: OnError,
    /// TLS material for `rediss://` URLs.
    pub tls: StoreTls,
    /// `sentinel_master`: the master's name at the sentinels (`redis-sentinel` only).
    pub sentinel_master: Option<String>,
    /// `fallback_min_replicas`: during an outage the local fallback enforces
    /// `rate / N` per replica, N = the replicas last seen alive, at least this many.
    pub fallback_min_replicas: usize,
    /// `prefetch` (Redis stores): when a replica may take a batch's worth of tokens ahead
    /// on an endpoint that is busy and whose bucket is at least half full, and spend them
    /// without a round trip (see `crate::limiter::credit`).
    pub prefetch: Prefetch,
    /// `max_endpoints`: the most endpoints the memory store holds a bucket of; a new one
    /// past them, with none idle to evict, is refused 503 `endpoint_capacity`.
    pub max_endpoints: usize,
}

/// `[store] prefetch`: when a replica takes tokens ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefetch {
    /// `false`: never; every acquire is decided by Redis.
    Off,
    /// `"alone"` (the default): only while this replica is the only one alive in the
    /// store's heartbeat set, checked by the script that hands the tokens out, so held
    /// tokens are never out of another replica's reach. A single Redis or Sentinel only
    /// (on a cluster the heartbeat set is in another slot than the bucket: never).
    Alone,
    /// `true`: whatever other replicas share the store (they may find up to half the
    /// burst held elsewhere until it is spent or given back: about 5 ms, at most 10;
    /// docs/operations.md).
    On,
}

/// `[store] tls_*`: files for TLS to Redis (`rediss://` URLs). Read at start and by
/// `sluice check`, see [`crate::limiter::redis::tls_certificates`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreTls {
    /// `tls_ca_file`: PEM root(s) trusted in addition to the system roots.
    pub ca_file: Option<PathBuf>,
    /// `tls_cert_file` + `tls_key_file`: client certificate chain and key (mutual TLS).
    pub client: Option<ClientCert>,
}

/// A client certificate for mutual TLS, both PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCert {
    /// `tls_cert_file`: the certificate chain.
    pub cert_file: PathBuf,
    /// `tls_key_file`: its private key.
    pub key_file: PathBuf,
}

impl Default for StoreConfig {
    /// The defaults of the contract: memory store, `redis://127.0.0.1:6379/`, `sluice:`.
    fn default() -> Self {
        StoreConfig {
            backend: Backend::Memory,
            urls: vec!["redis://127.0.0.1:6379/".into()],
            key_prefix: "sluice:".into(),
            timeout: Duration::from_millis(100),
            on_error: OnError::Local,
            tls: StoreTls::default(),
            sentinel_master: None,
            fallback_min_replicas: 1,
            prefetch: Prefetch::Alone,
            max_endpoints: DEFAULT_MAX_ENDPOINTS,
        }
    }
}

/// `[tls]`.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    /// Terminate CONNECT tunnels with minted leaves.
    pub intercept: bool,
    /// CA certificate (PEM).
    pub ca_cert: PathBuf,
    /// CA key (PEM).
    pub ca_key: PathBuf,
    /// Extra PEM roots trusted upstream.
    pub upstream_roots: Vec<PathBuf>,
    /// Hosts tunnelled without interception.
    pub passthrough_hosts: HostGlobs,
    /// Hosts whose leaf certificate is cached.
    pub leaf_cache_size: usize,
    /// A sender must finish the TLS handshake of an intercepted tunnel within this.
    pub handshake_timeout: Duration,
}

/// `[security]`.
#[derive(Debug, Clone)]
pub struct SecurityConfig {
    /// Allow loopback/private/link-local destinations.
    pub allow_private_destinations: bool,
    /// Non-empty: only these destination hosts.
    pub allowed_hosts: HostGlobs,
    /// Proxy auth users file (htpasswd, bcrypt): when set, every request needs
    /// `Proxy-Authorization`.
    pub auth_users_file: Option<PathBuf>,
    /// `[security.user_endpoints]`: the endpoint IDs each listed user may spend.
    pub user_endpoints: Vec<UserGrant>,
    /// The operator's word that a proxy listening beyond loopback with neither proxy
    /// authentication nor `allowed_hosts` is meant: without it `run` refuses to start
    /// ([`Config::open_proxy`]).
    pub allow_anonymous: bool,
    /// Refuse (`400 endpoint_required`) a request that names no endpoint by header,
    /// proxy user or host rule, instead of pacing it under its destination host.
    pub require_endpoint: bool,
}

/// One `[security.user_endpoints]` entry: a user and the endpoint-ID globs it may spend.
#[derive(Debug, Clone)]
pub struct UserGrant {
    /// The proxy user name.
    pub user: String,
    /// Endpoint-ID globs (case-sensitive), compiled.
    pub endpoints: GlobSet,
}

/// A compiled list of case-insensitive host globs.
#[derive(Debug, Clone, Default)]
pub struct HostGlobs {
    set: GlobSet,
    len: usize,
    patterns: Vec<String>,
}

impl PartialEq for HostGlobs {
    fn eq(&self, other: &Self) -> bool {
        self.patterns == other.patterns
    }
}

impl HostGlobs {
    /// True when no glob is configured.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether `host` (any case) matches one of the globs.
    pub fn matches(&self, host: &str) -> bool {
        self.len > 0 && self.set.is_match(host.to_ascii_lowercase())
    }
}

/// The whole validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// `[proxy]`.
    pub proxy: ProxyConfig,
    /// `[store]`.
    pub store: StoreConfig,
    /// `[defaults]` policy.
    pub defaults: Arc<Policy>,
    /// `[defaults] unknown`.
    pub unknown: UnknownEndpoints,
    /// `[defaults] mode`: for endpoints without their own.
    pub default_mode: Mode,
    /// `[log]`.
    pub log: LogConfig,
    /// `[traces]`.
    pub traces: TracesConfig,
    /// `[[endpoints]]`, in file order.
    pub endpoints: Vec<EndpointRule>,
    /// `[tls]`.
    pub tls: TlsConfig,
    /// `[security]`.
    pub security: SecurityConfig,
    /// `[sender] profile`: the webhook platform sending through sluice, whose timeout
    /// the wait budgets must fit ([`SenderProfile`]).
    pub sender: Option<&'static SenderProfile>,
    /// What loads but deserves a word (a wait budget a profile's platform will time out
    /// before), each with its line and key: `check` prints them, `run` logs them at
    /// start and after every reload.
    pub warnings: Vec<ConfigIssue>,
}

impl Config {
    /// Reads and validates a file; relative paths in it are resolved against the file's
    /// folder ([`Config::resolve_paths`]). Does not open those files: see
    /// [`Config::check_files`].
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut config = Config::parse(&text).map_err(|issues| ConfigError::Invalid {
            path: path.to_owned(),
            issues,
        })?;
        let folder = path.parent().filter(|p| !p.as_os_str().is_empty());
        config.resolve_paths(folder.unwrap_or(Path::new(".")));
        Ok(config)
    }

    /// Every file path the config names: its dotted key, the path, and whether this
    /// config will open it (the CA only with `tls.intercept`). A new path key is one line
    /// here; [`Config::resolve_paths`] and [`Config::check_files`] both follow this list.
    fn paths_mut(&mut self) -> Vec<(String, &mut PathBuf, bool)> {
        let intercept = self.tls.intercept;
        let mut paths = vec![
            ("tls.ca_cert".to_owned(), &mut self.tls.ca_cert, intercept),
            ("tls.ca_key".to_owned(), &mut self.tls.ca_key, intercept),
        ];
        for (i, p) in self.tls.upstream_roots.iter_mut().enumerate() {
            paths.push((format!("tls.upstream_roots[{i}]"), p, true));
        }
        if let Some(p) = &mut self.proxy.admin_token_file {
            paths.push(("proxy.admin_token_file".to_owned(), p, true));
        }
        if let Some(p) = &mut self.security.auth_users_file {
            paths.push(("security.auth_users_file".to_owned(), p, true));
        }
        // Appended to (and created) by `sluice run` and `check`, never read.
        if let Some(p) = &mut self.log.file {
            paths.push(("log.file".to_owned(), p, false));
        }
        let shared = self.store.backend != Backend::Memory;
        if let Some(p) = &mut self.store.tls.ca_file {
            paths.push(("store.tls_ca_file".to_owned(), p, shared));
        }
        if let Some(c) = &mut self.store.tls.client {
            paths.push(("store.tls_cert_file".to_owned(), &mut c.cert_file, shared));
            paths.push(("store.tls_key_file".to_owned(), &mut c.key_file, shared));
        }
        paths
    }

    /// Makes every relative path absolute-or-CWD-relative by joining it to `base_dir`,
    /// the folder of the config file, so a config means the same files wherever sluice
    /// is started from.
    pub fn resolve_paths(&mut self, base_dir: &Path) {
        for (_, path, _) in self.paths_mut() {
            if path.is_relative() {
                *path = base_dir.join(&*path);
            }
        }
    }

    /// Opens and reads from every file this config will use; one [`FileIssue`] (naming
    /// the key) per missing or unreadable one. `sluice check` and `sluice run` call it
    /// before binding anything.
    pub fn check_files(&self) -> Result<(), Vec<FileIssue>> {
        // paths_mut needs `&mut`; a copy keeps this a read-only check.
        let mut copy = self.clone();
        let issues: Vec<FileIssue> = copy
            .paths_mut()
            .into_iter()
            .filter(|(_, _, used)| *used)
            .filter_map(|(key, path, _)| {
                readable(path).err().map(|source| FileIssue {
                    key,
                    path: path.clone(),
                    source,
                })
            })
            .collect();
        if issues.is_empty() {
            Ok(())
        } else {
            Err(issues)
        }
    }

    /// Validates TOML text, returning every issue found. `${NAME}` in string values is
    /// replaced by the environment variable `NAME` (see [`expand_env`]).
    pub fn parse(text: &str) -> Result<Config, Vec<ConfigIssue>> {
        Config::parse_with_env(text, &|name| std::env::var(name).ok())
    }

    /// Like [`parse`](Self::parse), looking `${NAME}` references up with `env` instead
    /// of the process environment.
    pub fn parse_with_env(
        text: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, Vec<ConfigIssue>> {
        let mut r = Reader {
            src: text,
            env,
            issues: Vec::new(),
            warnings: Vec::new(),
        };
        let (root, errs) = DeTable::parse_recoverable(text);
        for e in errs {
            let at = e.span().map(|s| s.start).unwrap_or(0);
            r.issue(at, "<syntax>", e.message().trim().to_owned());
        }
        let config = r.config(root.get_ref());
        let mut issues = r.issues;
        issues.sort_by_key(|i| (i.line, i.column));
        match config {
            Some(mut c) if issues.is_empty() => {
                c.warnings = r.warnings;
                c.warnings.sort_by_key(|i| (i.line, i.column));
                Ok(c)
            }
            _ => Err(issues),
        }
    }

    /// When the proxy listens beyond loopback (an address other than 127.0.0.0/8 or
    /// `::1`) with neither proxy authentication (`security.auth_users_file`) nor a
    /// `security.allowed_hosts` that lists hosts (`["*"]` does not), what that means:
    /// any host that reaches the port may use sluice as its egress proxy to any public
    /// host. `run` refuses such a config unless `security.allow_anonymous = true`, and
    /// then warns.
    pub fn open_proxy(&self) -> Option<String> {
        let listen = self.proxy.listen;
        let local = listen.ip().to_canonical().is_loopback();
        // `allowed_hosts = ["*"]` lists hosts in name only: a host nobody would list
        // matching tells.
        let hosts = &self.security.allowed_hosts;
        let any_host = hosts.is_empty() || hosts.matches("any-host.sluice.invalid");
        if local || self.security.auth_users_file.is_some() || !any_host {
            return None;
        }
        Some(format!(
            "proxy.listen = \"{listen}\" is reachable beyond this host, with neither \
             security.auth_users_file nor a security.allowed_hosts naming hosts: anyone \
             who reaches the port can use sluice as an open proxy to any public host"
        ))
    }

    /// A one-line summary for `sluice check`.
    pub fn summary(&self) -> String {
        let backend = match self.store.backend {
            Backend::Memory => "memory".to_owned(),
            other => {
                let name = match other {
                    Backend::RedisCluster => "redis-cluster",
                    Backend::RedisSentinel => "redis-sentinel",
                    _ => "redis",
                };
                let urls: Vec<String> = self.store.urls.iter().map(|u| redact(u)).collect();
                format!("{name} {}", urls.join(" "))
            }
        };
        let sender = self
            .sender
            .map(|p| format!(", sender {}", p.name))
            .unwrap_or_default();
        format!(
            "ok: listen {}, admin {}, store {}, {} endpoint(s), defaults {}/s burst {}, tls intercept {}{sender}",
            self.proxy.listen,
            self.proxy.admin_listen,
            backend,
            self.endpoints.len(),
            self.defaults.rate,
            self.defaults.burst,
            if self.tls.intercept { "on" } else { "off" },
        )
    }
}

/// Expands `${NAME}` references in a config string with `env` (the process environment
/// at load and reload). `$${` stands for a literal `${`; a `$` not followed by `{` is kept
/// as is. Names are `[A-Za-z_][A-Za-z0-9_]*`; expanded values are not expanded again.
/// The error (unset variable, bad name, missing `}`) names the variable, never a value.
pub fn expand_env(s: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    if !s.contains('$') {
        return Ok(s.to_owned());
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix("${") {
            out.push_str("${");
            rest = tail;
        } else if let Some(tail) = after.strip_prefix('{') {
            let end = tail.find('}').ok_or_else(|| {
                "unterminated \"${\": write ${NAME}, or $${ for a literal \"${\"".to_owned()
            })?;
            let name = &tail[..end];
            let valid = name
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(format!(
                    "\"${{{name}}}\" is not a valid environment variable reference: names are \
                     letters, digits and _ (write $${{ for a literal \"${{\")"
                ));
            }
            let value = env(name).ok_or_else(|| {
                format!("environment variable {name} is not set (referenced as ${{{name}}})")
            })?;
            out.push_str(&value);
            rest = &tail[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// The endpoint ID every endpoint past `proxy.metrics_max_endpoints` shares as its
/// metrics label, reserved so no endpoint can take it.
pub const OTHER_ENDPOINT: &str = "_other";

/// `store.max_endpoints` by default: at about 400 bytes a bucket, 40 MB at most, a
/// sixth of the shipped 256 MiB limit, and far more receivers than one deployment
/// paces at once (the idle ones are evicted as they go).
pub const DEFAULT_MAX_ENDPOINTS: usize = 100_000;

/// `proxy.metrics_max_senders` by default.
pub const DEFAULT_MAX_SENDERS: usize = 1000;

/// The slowest rate (and floor) a config may ask for: one token in ~11.6 days. Slower
/// rates make waits that no clock or `Duration` can hold.
pub const MIN_RATE: f64 = 1e-6;
/// The largest rate and burst a config may ask for.
pub const MAX_RATE: f64 = 1e9;

/// Opens `path` and reads a byte: a directory or a file without read permission fails
/// here, not at the first request.
fn readable(path: &Path) -> std::io::Result<()> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    f.read(&mut [0u8; 1]).map(|_| ())
}

/// Parses `"250ms"`, `"5s"`, `"1.5s"`, `"5m"`, `"1h"`, `"0"`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("\"{s}\" needs a unit: ms, s, m or h (e.g. \"250ms\", \"5s\")"))?;
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("\"{s}\" is not a duration like \"250ms\", \"5s\", \"5m\""))?;
    let scale = match unit {
        "ms" => 0.001,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => {
            return Err(format!(
                "unknown unit \"{unit}\" in \"{s}\": use ms, s, m or h"
            ));
        }
    };
    let secs = n * scale;
    if !secs.is_finite() || secs > 86_400.0 * 365.0 {
        return Err(format!("\"{s}\" is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Endpoint IDs become metric labels and Redis keys: keep them printable and short.
pub fn check_endpoint_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > 128 {
        return Err("endpoint id must be 1 to 128 characters".into());
    }
    if !id.bytes().all(|b| b.is_ascii_graphic()) {
        // Quoted and escaped: the id is the sender's, and the message reaches logs.
        return Err(format!(
            "endpoint id {id:?} may only contain visible ASCII characters"
        ));
    }
    // The id is a Redis Cluster hash tag (`<prefix>{<id>}`): a brace in it moves the
    // tag, and `}` first leaves it empty, so the endpoint's keys fall in different slots
    // and every script call for it fails (a sender could fail the store for everyone).
    if id.contains(['{', '}']) {
        return Err(format!("endpoint id {id:?} may not contain '{{' or '}}'"));
    }
    // The label everything past `metrics_max_endpoints` shares.
    if id == OTHER_ENDPOINT {
        return Err(format!("endpoint id {id:?} is reserved"));
    }
    Ok(())
}

/// Hides the password of a `redis://user:pass@host` URL; of a string that is no such
/// URL (a mistyped scheme), everything before its last `@`.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.find(':') {
                Some(c) => format!("{}{}:***{}", &url[..s + 3], &creds[..c], &url[at..]),
                None => format!("{}***{}", &url[..s + 3], &url[at..]),
            }
        }
        (_, Some(at)) => format!("***{}", &url[at..]),
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_ids_keep_redis_hash_tags_and_the_overflow_label_intact() {
        // `}` as an id put its two keys in different cluster
        // slots: every call for it failed, and the whole replica fell back.
        for bad in ["}", "a}b", "{x}", "ten{ant", "_other"] {
            assert!(check_endpoint_id(bad).is_err(), "{bad}");
        }
        for good in ["svix", "api.stripe.com", "team_b:42", "a/b", "_others"] {
            assert!(check_endpoint_id(good).is_ok(), "{good}");
        }
    }

    fn issues(text: &str) -> Vec<ConfigIssue> {
        Config::parse(text).expect_err("config should be rejected")
    }

    #[test]
    fn empty_file_gives_spec_defaults() {
        let c = Config::parse("").unwrap();
        assert_eq!(c.proxy.listen, "127.0.0.1:8080".parse().unwrap());
        assert_eq!(c.proxy.admin_listen, "127.0.0.1:9090".parse().unwrap());
        assert_eq!(c.proxy.endpoint_header, "x-endpoint-id");
        assert_eq!(c.proxy.upstream_timeout, Duration::from_secs(30));
        assert_eq!(c.proxy.workers, 0, "one worker per core");
        assert!(
            c.proxy.pin_workers,
            "each worker on a core of its own where that fits"
        );
        assert!(
            !Config::parse("[proxy]\npin_workers = false")
                .unwrap()
                .proxy
                .pin_workers
        );
        assert_eq!(c.store.backend, Backend::Memory);
        assert_eq!(c.store.timeout, Duration::from_millis(100));
        assert_eq!(c.store.on_error, OnError::Local);
        assert_eq!(
            c.store.prefetch,
            Prefetch::Alone,
            "tokens are taken ahead only by a replica alone in the store"
        );
        let prefetch = |text: &str| Config::parse(text).unwrap().store.prefetch;
        assert_eq!(prefetch("[store]\nbackend = \"redis\""), Prefetch::Alone);
        assert_eq!(
            prefetch("[store]\nbackend = \"redis\"\nprefetch = true"),
            Prefetch::On
        );
        assert_eq!(
            prefetch("[store]\nbackend = \"redis\"\nprefetch = false"),
            Prefetch::Off
        );
        assert_eq!(
            prefetch(
                "[store]\nbackend = \"redis-sentinel\"\nsentinel_master = \"m\"\nprefetch = \"alone\""
            ),
            Prefetch::Alone
        );
        assert_eq!(
            prefetch(
                "[store]\nbackend = \"redis-cluster\"\nurls = [\"redis://a/\"]\nprefetch = true"
            ),
            Prefetch::On
        );
        assert_eq!(*c.defaults, Policy::default());
        assert_eq!(c.unknown, UnknownEndpoints::Default);
        assert!(!c.tls.intercept && !c.security.allow_private_destinations);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn unknown_key_is_named_with_line_and_hint() {
        let i = issues("[defaults]\nrate = 5.0\nbrust = 10.0\n");
        assert_eq!(i.len(), 1);
        assert_eq!((i[0].line, i[0].column), (3, 1));
        assert_eq!(i[0].key, "defaults.brust");
        assert!(
            i[0].message.contains("did you mean `burst`"),
            "{}",
            i[0].message
        );
    }

    #[test]
    fn every_error_is_reported() {
        let text = "[proxy]\nlisten = \"nope\"\n[defaults]\nrate = 0\nburst = 0.5\nmax_wait = \"5 years\"\n[store]\nbackend = \"etcd\"\n";
        let i = issues(text);
        let keys: Vec<&str> = i.iter().map(|i| i.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "proxy.listen",
                "defaults.rate",
                "defaults.burst",
                "defaults.max_wait",
                "store.backend"
            ]
        );
        assert_eq!(i[1].line, 4);
    }

    #[test]
    fn rejected_values() {
        let cases = [
            ("[proxy]\npin_workers = \"yes\"", "proxy.pin_workers"),
            ("[defaults]\nrate = -1.0", "defaults.rate"),
            ("[defaults]\nrate = \"fast\"", "defaults.rate"),
            ("[defaults]\nunknown = \"maybe\"", "defaults.unknown"),
            (
                "[defaults.adaptive]\ndecrease = 1.5",
                "defaults.adaptive.decrease",
            ),
            ("[defaults.adaptive]\nfloor = 0", "defaults.adaptive.floor"),
            (
                "[defaults.adaptive]\nrecovery = \"0s\"",
                "defaults.adaptive.recovery",
            ),
            (
                "[defaults.adaptive]\nmax_cooldown = \"1s\"\ndefault_cooldown = \"2s\"",
                "defaults.adaptive.max_cooldown",
            ),
            (
                "[defaults]\nrate = 0.5\n[defaults.adaptive]\nfloor = 1.0",
                "defaults.rate",
            ),
            // The rate inherited (10), the floor above it: the floor is named.
            (
                "[defaults.adaptive]\nfloor = 20.0",
                "defaults.adaptive.floor",
            ),
            (
                "[store]\nbackend = \"redis\"\nurls = [\"redis://a/\", \"redis://b/\"]",
                "store.urls",
            ),
            ("[store]\nurls = [\"http://x/\"]", "store.urls"),
            ("[store]\non_error = \"panic\"", "store.on_error"),
            ("[store]\nprefetch = \"yes\"", "store.prefetch"),
            ("[store]\nprefetch = true", "store.prefetch"),
            ("[store]\nprefetch = \"alone\"", "store.prefetch"),
            (
                "[store]\nbackend = \"redis\"\nprefetch = 1",
                "store.prefetch",
            ),
            (
                "[store]\nfallback_min_replicas = 0",
                "store.fallback_min_replicas",
            ),
            (
                "[proxy]\nendpoint_header = \"bad header\"",
                "proxy.endpoint_header",
            ),
            // Removed before forwarding, these would unframe the
            // request (its body forwarded as a request of its own) or unroute it.
            (
                "[proxy]\nendpoint_header = \"Content-Length\"",
                "proxy.endpoint_header",
            ),
            (
                "[proxy]\nendpoint_header = \"transfer-encoding\"",
                "proxy.endpoint_header",
            ),
            (
                "[proxy]\nendpoint_header = \"Host\"",
                "proxy.endpoint_header",
            ),
            (
                "[proxy]\nendpoint_header = \"X-Sluice-Sender\"",
                "proxy.endpoint_header",
            ),
            // Settings that passed `check` and could never work.
            (
                "[proxy]\nlisten = \"127.0.0.1:8080\"\nadmin_listen = \"127.0.0.1:8080\"",
                "proxy.admin_listen",
            ),
            (
                "[[endpoints]]\nid = \"a\"\nhosts = [\"127.0.0.1:0\"]",
                "endpoints[0].hosts",
            ),
            (
                "[[endpoints]]\nid = \"a\"\nhosts = [\"*.example.com\"]",
                "endpoints[0].hosts",
            ),
            (
                "[[endpoints]]\nid = \"a\"\nhosts = [\"x.example\"]\n\
                 [[endpoints]]\nid = \"b\"\nhosts = [\"X.example.\"]\npath_prefix = \"/v1\"",
                "endpoints[1].hosts",
            ),
            // Shadowed as receivers read the prefixes: /%61pi is /api.
            (
                "[[endpoints]]\nid = \"a\"\nhosts = [\"x\"]\npath_prefix = \"/%61pi\"\n\
                 [[endpoints]]\nid = \"b\"\nhosts = [\"x\"]\npath_prefix = \"/api/v1\"",
                "endpoints[1].hosts",
            ),
            (
                "[[endpoints]]\nid = \"a\"\npath_prefix = \"/api?x=1\"",
                "endpoints[0].path_prefix",
            ),
            ("[proxy]\nmax_connections = 0", "proxy.max_connections"),
            (
                "[proxy]\nmetrics_max_senders = 0",
                "proxy.metrics_max_senders",
            ),
            (
                "[traces]\notlp_endpoint = \"collector:4318\"",
                "traces.otlp_endpoint",
            ),
            ("[traces]\nsample = 1.5", "traces.sample"),
            ("[[endpoints]]\nrate = 5.0", "endpoints[0].id"),
            (
                "[[endpoints]]\nid = \"a\"\n[[endpoints]]\nid = \"a\"",
                "endpoints[1].id",
            ),
            ("[[endpoints]]\nid = \"has space\"", "endpoints[0].id"),
            (
                "[[endpoints]]\nid = \"a\"\npath_prefix = \"x\"",
                "endpoints[0].path_prefix",
            ),
            (
                "[[endpoints]]\nid = \"a\"\ncolour = 1",
                "endpoints[0].colour",
            ),
            (
                "[security]\nallowed_hosts = [\"[\"]",
                "security.allowed_hosts",
            ),
            (
                "[security.user_endpoints]\nalice = [\"a*\"]",
                "security.user_endpoints",
            ),
            ("[defaults]\nrate = 1e-7", "defaults.rate"),
            ("[defaults]\nrate = 5e-20", "defaults.rate"),
            ("[defaults]\nburst = 1e12", "defaults.burst"),
            (
                "[defaults.adaptive]\nfloor = 1e-9",
                "defaults.adaptive.floor",
            ),
            ("[proxy]\nidle_timeout = \"0\"", "proxy.idle_timeout"),
            (
                "[proxy]\nheader_read_timeout = \"0s\"",
                "proxy.header_read_timeout",
            ),
            ("[tls]\nintercept = \"yes\"", "tls.intercept"),
            ("proxy = 3", "proxy"),
        ];
        for (text, key) in cases {
            let i = issues(text);
            assert!(
                i.iter().any(|i| i.key == key),
                "{text:?}: expected an issue for {key}, got {i:?}"
            );
        }
    }

    #[test]
    fn syntax_errors_have_a_line() {
        let i = issues("[proxy]\nlisten = \n");
        assert_eq!(i[0].line, 2);
    }

    /// A `lease_ttl` too short to be renewed in time (a typo for seconds) is refused at
    /// its line, in `[defaults]` and in an endpoint.
    #[test]
    fn a_lease_ttl_under_a_second_is_refused_where_it_is() {
        let i = issues(
            "[defaults]\nlease_ttl = \"10ms\"\n[[endpoints]]\nid = \"a\"\nrate = 1.0\nlease_ttl = \"0.5s\"\n",
        );
        let at: Vec<(usize, &str)> = i.iter().map(|i| (i.line, i.key.as_str())).collect();
        assert_eq!(
            at,
            [(2, "defaults.lease_ttl"), (6, "endpoints[0].lease_ttl")],
            "{i:?}"
        );
        assert!(i[0].message.contains("at least 1s"), "{}", i[0].message);
        let ok = Config::parse("[defaults]\nlease_ttl = \"1s\"\n").unwrap();
        assert_eq!(ok.defaults.lease_ttl, MIN_LEASE_TTL);
    }

    /// A store URL `run` cannot parse is refused
    /// by `check` at its line (it passed), without the password; so is a mistyped
    /// scheme, whose password the message used to print.
    #[test]
    fn a_store_url_redis_cannot_read_is_refused_at_its_line_without_its_password() {
        for url in ["redis://h:notaport/", "redis://:s3cr#tz@h:6379/"] {
            let i = issues(&format!(
                "[store]\nbackend = \"redis\"\nurls = [\"{url}\"]\n"
            ));
            let at: Vec<(usize, &str)> = i.iter().map(|i| (i.line, i.key.as_str())).collect();
            assert_eq!(at, [(3, "store.urls")], "{url}: {i:?}");
            assert!(!i[0].message.contains("s3cr"), "{}", i[0].message);
        }
        let i = issues("[store]\nbackend = \"redis\"\nurls = [\"redis:/:hunter2@h:6379/\"]\n");
        assert_eq!(i.len(), 1, "{i:?}");
        assert!(!i[0].message.contains("hunter2"), "{}", i[0].message);
        let ok = "[store]\nbackend = \"redis\"\nurls = [\"rediss://:p%2Fw@h:6379/0\"]\n";
        assert!(Config::parse(ok).is_ok());
    }

    /// A host glob with a port, a scheme or a
    /// trailing dot can never match (hosts are matched normalised, without them): in
    /// `passthrough_hosts` it let the host be intercepted. Refused at its line.
    #[test]
    fn a_host_glob_that_can_never_match_is_refused() {
        for g in [
            "localhost:18443",
            "https://pay.example.com",
            "login.example.com.",
        ] {
            let text = format!(
                "[tls]\npassthrough_hosts = [\"{g}\"]\n[security]\nallowed_hosts = [\"{g}\"]\n"
            );
            let i = issues(&text);
            let at: Vec<(usize, &str)> = i.iter().map(|i| (i.line, i.key.as_str())).collect();
            assert_eq!(
                at,
                [(2, "tls.passthrough_hosts"), (4, "security.allowed_hosts")],
                "{g}: {i:?}"
            );
        }
        let ok = "[tls]\npassthrough_hosts = [\"*.bank.example\", \"localhost\"]\n";
        assert!(Config::parse(ok).is_ok());
    }

    /// On `redis-cluster` a brace in `key_prefix` would
    /// move every key's hash tag off the endpoint: refused at its line; elsewhere kept.
    #[test]
    fn a_cluster_key_prefix_with_a_brace_is_refused_where_it_is() {
        let cluster = "[store]\nbackend = \"redis-cluster\"\nurls = [\"redis://h:7000/\"]\n";
        let i = issues(&format!("{cluster}key_prefix = \"app{{x}}:\"\n"));
        let at: Vec<(usize, &str)> = i.iter().map(|i| (i.line, i.key.as_str())).collect();
        assert_eq!(at, [(4, "store.key_prefix")], "{i:?}");
        assert!(i[0].message.contains("hash tag"), "{}", i[0].message);
        let single = "[store]\nbackend = \"redis\"\nurls = [\"redis://h:6379/\"]\nkey_prefix = \"app{x}:\"\n";
        assert_eq!(Config::parse(single).unwrap().store.key_prefix, "app{x}:");
        let ok = Config::parse(&format!("{cluster}key_prefix = \"prod:sluice:\"\n")).unwrap();
        assert_eq!(ok.store.key_prefix, "prod:sluice:");
    }

    /// A zero `upstream_timeout` is reported at its own line (it
    /// was at 1:1), and a reserved endpoint header at its.
    #[test]
    fn proxy_value_errors_are_reported_where_they_are() {
        let i = issues("[proxy]\n\nupstream_timeout = \"0s\"\nendpoint_header = \"Connection\"\n");
        let at: Vec<(usize, &str)> = i.iter().map(|i| (i.line, i.key.as_str())).collect();
        assert_eq!(
            at,
            [(3, "proxy.upstream_timeout"), (4, "proxy.endpoint_header")],
            "{i:?}"
        );
    }

    /// Any `Proxy-*` endpoint header is refused
    /// (`Proxy-Status` passed), and a wildcard listener clashes with the other one on
    /// its port.
    #[test]
    fn a_proxy_header_and_a_listener_clash_on_a_wildcard_are_refused() {
        let i = issues("[proxy]\nendpoint_header = \"Proxy-Status\"\n");
        assert_eq!(i.len(), 1, "{i:?}");
        assert_eq!((i[0].line, i[0].key.as_str()), (2, "proxy.endpoint_header"));
        let i = issues("[proxy]\nlisten = \"0.0.0.0:18080\"\nadmin_listen = \"127.0.0.1:18080\"\n");
        assert_eq!(i.len(), 1, "{i:?}");
        assert_eq!((i[0].line, i[0].key.as_str()), (3, "proxy.admin_listen"));
        let ok = "[proxy]\nlisten = \"0.0.0.0:18080\"\nadmin_listen = \"127.0.0.1:18081\"\n";
        assert!(Config::parse(ok).is_ok());
    }

    /// A floor above an inherited rate is reported at the floor's line (before: at
    /// 1:1, under `defaults.rate`, a key the file did not have).
    #[test]
    fn a_floor_above_an_inherited_rate_is_reported_where_it_is() {
        let i = issues("[proxy]\n\n[defaults.adaptive]\n# x\nfloor = 20.0\n");
        assert_eq!(i.len(), 1, "{i:?}");
        assert_eq!(
            (i[0].line, i[0].key.as_str()),
            (5, "defaults.adaptive.floor")
        );
    }

    /// A host rule may name a port (IPv6 in brackets); one that is not a port, or that
    /// an earlier rule always takes first, is refused at its line.
    #[test]
    fn a_host_rule_with_a_port_is_read_and_checked_where_it_is() {
        let c = Config::parse(
            "[[endpoints]]\nid = \"a\"\nhosts = [\"Hooks.Example.com.:8443\", \"[::1]:8443\", \"::1\", \"127.1:80\"]\n\
             [[endpoints]]\nid = \"b\"\nhosts = [\"hooks.example.com:9443\", \"hooks.example.com\"]\n",
        )
        .unwrap();
        let rule = |host: &str, port| HostRule {
            host: host.into(),
            port,
        };
        assert_eq!(
            c.endpoints[0].hosts,
            [
                rule("hooks.example.com", Some(8443)),
                rule("::1", Some(8443)),
                rule("::1", None),
                rule("127.0.0.1", Some(80)),
            ]
        );
        assert_eq!(
            c.endpoints[1].hosts[0],
            rule("hooks.example.com", Some(9443))
        );
        let ep = "[[endpoints]]\nid = \"a\"\nhosts = ";
        for bad in [
            "[\"h.example:0\"]",
            "[\"h.example:65536\"]",
            "[\"h.example:https\"]",
            "[\"h.example:\"]",
            "[\"h.example:+80\"]",
            "[\"[::1]8443\"]",
            "[\"[::1:8443\"]",
            "[\"h.example:80:90\"]",
            "[\"bad_host!:80\"]",
        ] {
            let i = issues(&format!("{ep}{bad}\n"));
            assert_eq!(i.len(), 1, "{bad}: {i:?}");
            assert_eq!(
                (i[0].line, i[0].key.as_str()),
                (3, "endpoints[0].hosts"),
                "{bad}"
            );
        }
        // An earlier rule on every port, or on the same port, shadows a later one; one
        // on another port does not.
        let two = |first: &str, second: &str| {
            format!(
                "[[endpoints]]\nid = \"a\"\nhosts = [\"{first}\"]\n\
                 [[endpoints]]\nid = \"b\"\nhosts = [\"{second}\"]\n"
            )
        };
        for (first, second) in [
            ("x.example", "x.example:8443"),
            ("x.example:8443", "X.example.:8443"),
        ] {
            let i = issues(&two(first, second));
            assert_eq!(
                (i[0].line, i[0].key.as_str()),
                (6, "endpoints[1].hosts"),
                "{first} {second}"
            );
        }
        for (first, second) in [
            ("x.example:8443", "x.example"),
            ("x.example:8443", "x.example:9443"),
        ] {
            assert!(
                Config::parse(&two(first, second)).is_ok(),
                "{first} {second}"
            );
        }
    }

    /// The absorb keys: defaults, inheritance by endpoints and their overrides.
    #[test]
    fn absorb_keys_default_inherit_and_override() {
        let c = Config::parse("").unwrap();
        let a = c.defaults.adaptive.unwrap();
        assert_eq!(
            (a.absorb, a.absorb_attempts, a.absorb_max_body),
            (Absorb::Safe, 2, 1_048_576)
        );
        assert!(!c.defaults.absorb_post);
        let c = Config::parse(
            "[defaults]\nabsorb_post = true\n\
             [defaults.adaptive]\nabsorb = \"all\"\nabsorb_attempts = 3\nabsorb_max_body = 0\n\
             [[endpoints]]\nid = \"inherits\"\n\
             [[endpoints]]\nid = \"own\"\nabsorb_post = false\n\
             adaptive = { absorb = \"off\", absorb_attempts = 10, absorb_max_body = 67_108_864 }\n",
        )
        .unwrap();
        let d = c.defaults.adaptive.unwrap();
        assert_eq!(
            (d.absorb, d.absorb_attempts, d.absorb_max_body),
            (Absorb::All, 3, 0)
        );
        assert!(c.defaults.absorb_post);
        let inherits = &c.endpoints[0].policy;
        assert_eq!(inherits.adaptive, c.defaults.adaptive);
        assert!(inherits.absorb_post);
        let own = &c.endpoints[1].policy;
        let o = own.adaptive.unwrap();
        assert_eq!(
            (o.absorb, o.absorb_attempts, o.absorb_max_body),
            (Absorb::Off, 10, 64 << 20)
        );
        assert!(!own.absorb_post);
    }

    /// Each rejected absorb value is named with its key and line.
    #[test]
    fn absorb_values_are_refused_where_they_are() {
        let cases = [
            ("absorb = \"maybe\"", "absorb", "is not one of"),
            ("absorb = true", "absorb", "expected a string"),
            ("absorb_attempts = 0", "absorb_attempts", "from 1 to 10"),
            ("absorb_attempts = 11", "absorb_attempts", "from 1 to 10"),
            ("absorb_attempts = -1", "absorb_attempts", "from 1 to 10"),
            (
                "absorb_attempts = 2.5",
                "absorb_attempts",
                "expected a whole number",
            ),
            (
                "absorb_attempts = \"2\"",
                "absorb_attempts",
                "expected a whole number",
            ),
            (
                "absorb_max_body = -1",
                "absorb_max_body",
                "from 0 to 67108864",
            ),
            (
                "absorb_max_body = 67108865",
                "absorb_max_body",
                "from 0 to 67108864",
            ),
            (
                "absorb_max_body = \"1MiB\"",
                "absorb_max_body",
                "expected a whole number",
            ),
            (
                "absorb_max_body = 1e6",
                "absorb_max_body",
                "expected a whole number",
            ),
            (
                "absorb_atempts = 1",
                "absorb_atempts",
                "did you mean `absorb_attempts`",
            ),
        ];
        for (line, key, says) in cases {
            let i = issues(&format!("[proxy]\n[defaults.adaptive]\n{line}\n"));
            assert_eq!(i.len(), 1, "{line}: {i:?}");
            assert_eq!(
                (i[0].line, i[0].key.as_str()),
                (3, format!("defaults.adaptive.{key}").as_str()),
                "{line}"
            );
            assert!(i[0].message.contains(says), "{line}: {}", i[0].message);
            let i = issues(&format!(
                "[[endpoints]]\nid = \"e\"\nadaptive = {{ {line} }}\n"
            ));
            assert_eq!(
                (i[0].line, i[0].key.as_str()),
                (3, format!("endpoints[0].adaptive.{key}").as_str()),
                "{line}"
            );
        }
        for (text, at, key) in [
            (
                "[defaults]\nabsorb_post = \"yes\"\n",
                2,
                "defaults.absorb_post",
            ),
            (
                "[[endpoints]]\nid = \"e\"\nabsorb_post = 1\n",
                3,
                "endpoints[0].absorb_post",
            ),
        ] {
            let i = issues(text);
            assert_eq!(i.len(), 1, "{text}: {i:?}");
            assert_eq!((i[0].line, i[0].key.as_str()), (at, key), "{text}");
        }
    }

    /// A sender profile supplies `max_wait` and `proxy.upstream_timeout` where the config
    /// sets none (an endpoint's own profile its own `max_wait`); keys set win.
    #[test]
    fn a_sender_profile_supplies_the_defaults_the_config_leaves_out() {
        let c = Config::parse(
            "[sender]\nprofile = \"svix\"\n\
             [[endpoints]]\nid = \"inherits\"\n\
             [[endpoints]]\nid = \"own\"\nmax_wait = \"3s\"\n",
        )
        .unwrap();
        assert_eq!(c.sender, Some(&profiles::SVIX));
        assert_eq!(c.proxy.upstream_timeout, Duration::from_secs(7));
        assert_eq!(c.defaults.max_wait, Duration::from_secs(20));
        let waits: Vec<Duration> = c.endpoints.iter().map(|e| e.policy.max_wait).collect();
        assert_eq!(waits, [Duration::from_secs(20), Duration::from_secs(3)]);
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        assert!(c.summary().ends_with(", sender svix"), "{}", c.summary());
        let set = Config::parse(
            "[sender]\nprofile = \"outpost\"\n[proxy]\nupstream_timeout = \"1s\"\n\
             [defaults]\nmax_wait = \"3s\"\n",
        )
        .unwrap();
        assert_eq!(set.proxy.upstream_timeout, Duration::from_secs(1));
        assert_eq!(set.defaults.max_wait, Duration::from_secs(3));
        // An endpoint's own platform: its max_wait, under [sender]'s upstream timeout.
        let own = Config::parse(
            "[sender]\nprofile = \"svix\"\n[proxy]\nupstream_timeout = \"4s\"\n\
             [[endpoints]]\nid = \"h\"\nsender_profile = \"hook0\"\n",
        )
        .unwrap();
        let h = &own.endpoints[0];
        assert_eq!(h.sender_profile, Some(&profiles::HOOK0));
        assert_eq!(h.policy.max_wait, Duration::from_secs(9));
        assert!(
            own.warnings.is_empty(),
            "9s + 4s is under 15s: {:?}",
            own.warnings
        );
        let none = Config::parse("").unwrap();
        assert_eq!(none.sender, None);
        assert_eq!(none.proxy.upstream_timeout, Duration::from_secs(30));
    }

    /// A profile sluice does not know is refused at its line, in `[sender]` and on an
    /// endpoint, and so is an unknown `[sender]` key.
    #[test]
    fn an_unknown_sender_profile_is_refused_where_it_is() {
        for (text, at, key) in [
            ("[sender]\nprofile = \"hookdeck\"\n", 2, "sender.profile"),
            ("[sender]\nprofile = 1\n", 2, "sender.profile"),
            ("[sender]\nprofiel = \"svix\"\n", 2, "sender.profiel"),
            ("sender = \"svix\"\n", 1, "sender"),
            (
                "[[endpoints]]\nid = \"e\"\nsender_profile = \"Svix\"\n",
                3,
                "endpoints[0].sender_profile",
            ),
        ] {
            let i = issues(text);
            assert_eq!(i.len(), 1, "{text}: {i:?}");
            assert_eq!((i[0].line, i[0].key.as_str()), (at, key), "{text}");
        }
        let i = issues("[sender]\nprofile = \"hookdeck\"\n");
        assert!(
            i[0].message
                .contains("\"svix\", \"convoy\", \"outpost\", \"hook0\""),
            "{}",
            i[0].message
        );
    }

    /// A wait budget plus the upstream timeout that reaches the platform's timeout is a
    /// warning naming the endpoint, the figures and the line; the config still loads.
    #[test]
    fn a_budget_the_platform_times_out_before_is_a_warning() {
        let c = Config::parse(
            "[sender]\nprofile = \"svix\"\n\
             [proxy]\nupstream_timeout = \"10s\"\n\
             [defaults]\nmax_wait = \"25s\"\n\
             [[endpoints]]\nid = \"fits\"\nmax_wait = \"15s\"\n\
             [[endpoints]]\nid = \"acme\"\nrate = 5.0\nmax_wait = \"40s\"\n\
             [[endpoints]]\nid = \"outpost_one\"\nsender_profile = \"outpost\"\n",
        )
        .unwrap();
        let w: Vec<(usize, &str)> = c
            .warnings
            .iter()
            .map(|w| (w.line, w.key.as_str()))
            .collect();
        assert_eq!(
            w,
            [
                (6, "defaults.max_wait"),
                (13, "endpoints[1].max_wait"),
                (16, "endpoints[2].max_wait")
            ]
        );
        let acme = &c.warnings[1].message;
        for says in [
            "endpoint \"acme\"",
            "40s",
            "10s",
            "50s",
            "Svix",
            "30s",
            "duplicate",
        ] {
            assert!(acme.contains(says), "{says}: {acme}");
        }
        let outpost = &c.warnings[2].message;
        assert!(
            outpost.contains("2.5s") && outpost.contains("Hookdeck Outpost"),
            "{outpost}"
        );
        // No profile, no platform timeout to fit; unknown = "reject" leaves [defaults] unused.
        assert!(
            Config::parse("[defaults]\nmax_wait = \"5m\"\n")
                .unwrap()
                .warnings
                .is_empty()
        );
        let reject =
            "[sender]\nprofile = \"convoy\"\n[defaults]\nunknown = \"reject\"\nmax_wait = \"1m\"\n";
        assert!(Config::parse(reject).unwrap().warnings.is_empty());
    }

    #[test]
    fn endpoints_inherit_defaults_and_override() {
        let c = Config::parse(
            "[defaults]\nrate = 4.0\nburst = 8.0\n[defaults.adaptive]\nfloor = 2.0\n\
             [[endpoints]]\nid = \"ep\"\nrate = 100.0\nhosts = [\"Hooks.Example.com\"]\nadaptive = { floor = 5.0 }\n\
             [[endpoints]]\nid = \"quiet\"\nadaptive = { enabled = false }\n",
        )
        .unwrap();
        let ep = &c.endpoints[0];
        assert_eq!(ep.policy.rate, 100.0);
        assert_eq!(ep.policy.burst, 8.0);
        assert_eq!(
            ep.hosts,
            [HostRule {
                host: "hooks.example.com".into(),
                port: None
            }]
        );
        assert_eq!(ep.policy.adaptive.unwrap().floor, 5.0);
        assert_eq!(c.endpoints[1].policy.adaptive, None);
        assert_eq!(c.defaults.adaptive.unwrap().floor, 2.0);
    }

    #[test]
    fn low_rate_endpoint_gets_floor_capped_by_default() {
        let c = Config::parse("[[endpoints]]\nid = \"slow\"\nrate = 0.5\n").unwrap();
        assert_eq!(c.endpoints[0].policy.adaptive.unwrap().floor, 0.5);
    }

    #[test]
    fn relative_paths_resolve_against_the_base_dir() {
        let mut c = Config::parse(
            "[proxy]\nadmin_token_file = \"token\"\n[tls]\nca_cert = \"/abs/ca.pem\"\n\
             upstream_roots = [\"roots/a.pem\"]\n",
        )
        .unwrap();
        c.resolve_paths(Path::new("/etc/sluice"));
        assert_eq!(c.tls.ca_cert, Path::new("/abs/ca.pem"));
        let mut r = Config::parse(
            "[store]\nbackend = \"redis\"\nurls = [\"rediss://h/\"]\ntls_ca_file = \"redis/ca.pem\"\n",
        )
        .unwrap();
        r.resolve_paths(Path::new("/etc/sluice"));
        assert_eq!(
            r.store.tls.ca_file.as_deref(),
            Some(Path::new("/etc/sluice/redis/ca.pem"))
        );
        assert_eq!(c.tls.ca_key, Path::new("/etc/sluice/ca/ca.key"));
        assert_eq!(c.tls.upstream_roots, [Path::new("/etc/sluice/roots/a.pem")]);
        assert_eq!(
            c.proxy.admin_token_file.as_deref(),
            Some(Path::new("/etc/sluice/token"))
        );
    }

    #[test]
    fn redaction_hides_passwords() {
        assert_eq!(redact("redis://:hunter2@h:6379/"), "redis://:***@h:6379/");
        assert_eq!(redact("redis://u:hunter2@h/"), "redis://u:***@h/");
        assert_eq!(redact("redis://h:6379/"), "redis://h:6379/");
    }

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn env_references_expand_and_escape() {
        let e = env(&[("PW", "s3cr$t"), ("HOST", "r.example"), ("EMPTY", "")]);
        assert_eq!(expand_env("plain", &e).unwrap(), "plain");
        assert_eq!(
            expand_env("rediss://:${PW}@${HOST}:6380/", &e).unwrap(),
            "rediss://:s3cr$t@r.example:6380/"
        );
        // Values are not expanded again; `$${` is a literal `${`; a lone `$` stays.
        assert_eq!(expand_env("$${PW} costs $5", &e).unwrap(), "${PW} costs $5");
        assert_eq!(expand_env("a${EMPTY}b", &e).unwrap(), "ab");
        let unset = expand_env("x${NOPE}", &e).unwrap_err();
        assert!(
            unset.contains("NOPE") && unset.contains("not set"),
            "{unset}"
        );
        assert!(expand_env("${PW", &e).unwrap_err().contains("unterminated"));
        assert!(expand_env("${1X}", &e).unwrap_err().contains("not a valid"));
        assert!(expand_env("${}", &e).is_err());
    }

    #[test]
    fn an_unset_variable_is_an_issue_naming_key_and_variable() {
        let text =
            "[store]\nbackend = \"redis\"\nurls = [\"rediss://:${SLUICE_REDIS_PASSWORD}@h/\"]\n";
        let i = Config::parse_with_env(text, &env(&[])).expect_err("unset variable");
        assert_eq!(i.len(), 1, "{i:?}");
        assert_eq!(
            (i[0].line, i[0].column, i[0].key.as_str()),
            (3, 9, "store.urls")
        );
        assert!(
            i[0].message.contains("SLUICE_REDIS_PASSWORD"),
            "{}",
            i[0].message
        );
        let i = Config::parse_with_env("[store]\nkey_prefix = \"${P}:\"\n", &env(&[]))
            .expect_err("unset variable");
        assert_eq!(i[0].key, "store.key_prefix");
    }

    #[test]
    fn the_expanded_password_reaches_the_store_but_not_the_summary() {
        let text = "[store]\nbackend = \"redis\"\nurls = [\"rediss://:${PW}@h:6380/\"]\n\
                    key_prefix = \"${ENV}:sluice:\"\n";
        let c = Config::parse_with_env(text, &env(&[("PW", "hunter2"), ("ENV", "prod")])).unwrap();
        assert_eq!(c.store.urls, ["rediss://:hunter2@h:6380/"]);
        assert_eq!(c.store.key_prefix, "prod:sluice:");
        let summary = c.summary();
        assert!(!summary.contains("hunter2"), "{summary}");
        assert!(summary.contains("rediss://:***@h:6380/"), "{summary}");
    }

    #[test]
    fn sentinel_backend_needs_a_master_name() {
        let c = Config::parse(
            "[store]\nbackend = \"redis-sentinel\"\nurls = [\"redis://s1:26379/\", \"redis://s2:26379/\"]\n\
             sentinel_master = \"sluice\"\n",
        )
        .unwrap();
        assert_eq!(c.store.backend, Backend::RedisSentinel);
        assert_eq!(c.store.sentinel_master.as_deref(), Some("sluice"));
        assert_eq!(c.store.urls.len(), 2);
        for (text, says) in [
            (
                "[store]\nbackend = \"redis-sentinel\"\n",
                "needs sentinel_master",
            ),
            (
                "[store]\nbackend = \"redis-sentinel\"\nsentinel_master = \"\"\n",
                "must name",
            ),
            (
                "[store]\nbackend = \"redis\"\nsentinel_master = \"m\"\n",
                "only used",
            ),
        ] {
            let i = issues(text);
            assert!(
                i.iter()
                    .any(|i| i.key == "store.sentinel_master" && i.message.contains(says)),
                "{text:?}: {i:?}"
            );
        }
    }

    #[test]
    fn store_tls_files() {
        let c = Config::parse(
            "[store]\nbackend = \"redis\"\nurls = [\"rediss://h/\"]\ntls_ca_file = \"ca.pem\"\n\
             tls_cert_file = \"c.pem\"\ntls_key_file = \"c.key\"\n",
        )
        .unwrap();
        assert_eq!(c.store.tls.ca_file, Some(PathBuf::from("ca.pem")));
        let client = c.store.tls.client.unwrap();
        assert_eq!(
            (client.cert_file, client.key_file),
            ("c.pem".into(), "c.key".into())
        );
        let cases = [
            (
                "[store]\nurls = [\"rediss://h/\"]\ntls_cert_file = \"c.pem\"",
                "store.tls_cert_file",
                "tls_key_file",
            ),
            (
                "[store]\nurls = [\"rediss://h/\"]\ntls_key_file = \"c.key\"",
                "store.tls_key_file",
                "tls_cert_file",
            ),
            (
                "[store]\nurls = [\"redis://h/\"]\ntls_ca_file = \"ca.pem\"",
                "store.tls_ca_file",
                "rediss://",
            ),
            (
                "[store]\nurls = [\"rediss://h/\"]\ntls_ca_file = \"\"",
                "store.tls_ca_file",
                "empty",
            ),
        ];
        for (text, key, says) in cases {
            let i = issues(text);
            assert!(
                i.iter().any(|i| i.key == key && i.message.contains(says)),
                "{text:?}: expected {key} saying {says}, got {i:?}"
            );
        }
    }
}
