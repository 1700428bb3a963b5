//! The config file: TOML text → a validated, typed [`Config`].
//!
//! Parsing walks the spanned TOML tree by hand instead of through serde so that *every*
//! problem in a file is reported at once, each with its `line:column` and dotted key.
//! Nothing downstream ever looks a key up by string: durations are [`Duration`], rates
//! are checked finite floats, header names are [`HeaderName`]s, globs are compiled.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use globset::{Glob, GlobSet, GlobSetBuilder};
use http::HeaderName;
use toml::Spanned;
use toml::de::{DeTable, DeValue};

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

/// `[log]`: the per-request decision log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogConfig {
    /// One structured line per request (target `sluice::decision`, level info).
    pub decisions: bool,
    /// Fraction of forwarded requests logged, in [0, 1]; refusals are always logged.
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
}

impl Default for Adaptive {
    fn default() -> Self {
        Adaptive {
            floor: 1.0,
            decrease: 0.5,
            recovery: Duration::from_secs(300),
            default_cooldown: Duration::from_secs(1),
            max_cooldown: Duration::from_secs(300),
            floor_warn_after: Duration::from_secs(300),
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
    /// Lower-cased destination hosts that map here without the header.
    pub hosts: Vec<String>,
    /// Optional refinement of `hosts`.
    pub path_prefix: Option<String>,
    /// Enforced or shadow.
    pub mode: Mode,
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
    /// Distinct `endpoint` label values in metrics before the rest become `_other`.
    pub metrics_max_endpoints: usize,
    /// Threads serving requests: 0 = one per core; 1 = a single-threaded runtime (no
    /// cross-thread wake-ups: the least CPU per request on small machines).
    pub workers: usize,
    /// A sender connection (also HTTP inside an intercepted tunnel) with no bytes either
    /// way and no request in flight for this long is closed.
    pub idle_timeout: Duration,
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
    /// `[[endpoints]]`, in file order.
    pub endpoints: Vec<EndpointRule>,
    /// `[tls]`.
    pub tls: TlsConfig,
    /// `[security]`.
    pub security: SecurityConfig,
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
            Some(c) if issues.is_empty() => Ok(c),
            _ => Err(issues),
        }
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
        format!(
            "ok: listen {}, admin {}, store {}, {} endpoint(s), defaults {}/s burst {}, tls intercept {}",
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

type Table<'i> = DeTable<'i>;
type Value<'i> = Spanned<DeValue<'i>>;

/// Collects issues while reading the spanned tree.
struct Reader<'s> {
    src: &'s str,
    env: &'s dyn Fn(&str) -> Option<String>,
    issues: Vec<ConfigIssue>,
}

impl Reader<'_> {
    fn issue(&mut self, offset: usize, key: &str, message: String) {
        let before = &self.src[..offset.min(self.src.len())];
        let line = before.matches('\n').count() + 1;
        let column = before
            .rfind('\n')
            .map_or(before.len(), |p| before.len() - p - 1)
            + 1;
        self.issues.push(ConfigIssue {
            line,
            column,
            key: key.to_owned(),
            message,
        });
    }

    /// Flags keys of `table` that are not in `known`.
    fn known_keys(&mut self, table: &Table<'_>, path: &str, known: &[&str]) {
        for (k, _) in table.iter() {
            if !known.contains(&k.get_ref().as_ref()) {
                let key = join(path, k.get_ref());
                let hint = closest(k.get_ref(), known)
                    .map(|c| format!(" (did you mean `{c}`?)"))
                    .unwrap_or_default();
                self.issue(
                    k.span().start,
                    &key,
                    format!("unknown key{hint}; known keys here: {}", known.join(", ")),
                );
            }
        }
    }

    fn sub_table<'t, 'i>(
        &mut self,
        table: &'t Table<'i>,
        path: &str,
        name: &str,
    ) -> Option<&'t Table<'i>> {
        let v = table.get(name)?;
        match v.get_ref() {
            DeValue::Table(t) => Some(t),
            other => {
                self.type_issue(v, &join(path, name), "a table", other.type_str());
                None
            }
        }
    }

    fn type_issue(&mut self, v: &Value<'_>, key: &str, want: &str, got: &str) {
        self.issue(v.span().start, key, format!("expected {want}, found {got}"));
    }

    /// A string value with `${NAME}` expanded; an expansion error is an issue at `at`.
    fn expanded(&mut self, s: &str, at: usize, key: &str) -> Option<(String, usize)> {
        match expand_env(s, self.env) {
            Ok(s) => Some((s, at)),
            Err(e) => {
                self.issue(at, key, e);
                None
            }
        }
    }

    fn string(&mut self, t: &Table<'_>, path: &str, name: &str) -> Option<(String, usize)> {
        let v = t.get(name)?;
        match v.get_ref() {
            DeValue::String(s) => self.expanded(s, v.span().start, &join(path, name)),
            other => {
                self.type_issue(v, &join(path, name), "a string", other.type_str());
                None
            }
        }
    }

    fn boolean(&mut self, t: &Table<'_>, path: &str, name: &str, default: bool) -> bool {
        let Some(v) = t.get(name) else { return default };
        match v.get_ref() {
            DeValue::Boolean(b) => *b,
            other => {
                self.type_issue(v, &join(path, name), "true or false", other.type_str());
                default
            }
        }
    }

    fn number(&mut self, t: &Table<'_>, path: &str, name: &str) -> Option<(f64, usize)> {
        let v = t.get(name)?;
        let at = v.span().start;
        let parsed = match v.get_ref() {
            DeValue::Integer(i) => i64::from_str_radix(&i.as_str().replace('_', ""), i.radix())
                .ok()
                .map(|n| n as f64),
            DeValue::Float(f) => f.as_str().replace('_', "").parse::<f64>().ok(),
            other => {
                self.type_issue(v, &join(path, name), "a number", other.type_str());
                return None;
            }
        };
        match parsed {
            Some(n) if n.is_finite() => Some((n, at)),
            _ => {
                self.issue(at, &join(path, name), "expected a finite number".into());
                None
            }
        }
    }

    /// A number checked by `ok`, or `default` (with an issue) when absent or invalid.
    fn checked(
        &mut self,
        t: &Table<'_>,
        path: &str,
        name: &str,
        default: f64,
        rule: &str,
        ok: impl Fn(f64) -> bool,
    ) -> f64 {
        match self.number(t, path, name) {
            Some((n, _)) if ok(n) => n,
            Some((n, at)) => {
                self.issue(
                    at,
                    &join(path, name),
                    format!("{n} is invalid: must be {rule}"),
                );
                default
            }
            None => default,
        }
    }

    fn count(&mut self, t: &Table<'_>, path: &str, name: &str, default: usize) -> usize {
        match self.number(t, path, name) {
            Some((n, _)) if n >= 1.0 && n.fract() == 0.0 && n <= 1e9 => n as usize,
            Some((n, at)) => {
                self.issue(
                    at,
                    &join(path, name),
                    format!("{n} is invalid: must be a whole number ≥ 1"),
                );
                default
            }
            None => default,
        }
    }

    fn duration(&mut self, t: &Table<'_>, path: &str, name: &str, default: Duration) -> Duration {
        let Some((s, at)) = self.string(t, path, name) else {
            return default;
        };
        match parse_duration(&s) {
            Ok(d) => d,
            Err(e) => {
                self.issue(at, &join(path, name), e);
                default
            }
        }
    }

    fn strings(&mut self, t: &Table<'_>, path: &str, name: &str) -> Vec<(String, usize)> {
        let Some(v) = t.get(name) else {
            return Vec::new();
        };
        let key = join(path, name);
        let DeValue::Array(items) = v.get_ref() else {
            self.type_issue(v, &key, "an array of strings", v.get_ref().type_str());
            return Vec::new();
        };
        let mut out = Vec::new();
        for item in items.iter() {
            match item.get_ref() {
                DeValue::String(s) => {
                    if let Some(e) = self.expanded(s, item.span().start, &key) {
                        out.push(e);
                    }
                }
                other => self.type_issue(item, &key, "a string", other.type_str()),
            }
        }
        out
    }

    fn enumerated<T: Copy>(
        &mut self,
        t: &Table<'_>,
        path: &str,
        name: &str,
        default: T,
        choices: &[(&str, T)],
    ) -> T {
        let Some((s, at)) = self.string(t, path, name) else {
            return default;
        };
        if let Some((_, v)) = choices.iter().find(|(c, _)| *c == s) {
            return *v;
        }
        let names: Vec<String> = choices.iter().map(|(c, _)| format!("\"{c}\"")).collect();
        self.issue(
            at,
            &join(path, name),
            format!("\"{s}\" is not one of {}", names.join(", ")),
        );
        default
    }

    fn addr(&mut self, t: &Table<'_>, path: &str, name: &str, default: &str) -> SocketAddr {
        let fallback: SocketAddr = default
            .parse()
            .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0)));
        let Some((s, at)) = self.string(t, path, name) else {
            return fallback;
        };
        match s.parse() {
            Ok(a) => a,
            Err(_) => {
                self.issue(
                    at,
                    &join(path, name),
                    format!("\"{s}\" is not an address like \"127.0.0.1:8080\""),
                );
                fallback
            }
        }
    }

    fn globs(&mut self, t: &Table<'_>, path: &str, name: &str) -> HostGlobs {
        let mut b = GlobSetBuilder::new();
        let mut len = 0;
        let mut patterns = Vec::new();
        for (g, at) in self.strings(t, path, name) {
            match Glob::new(&g.to_ascii_lowercase()) {
                Ok(glob) => {
                    b.add(glob);
                    len += 1;
                    patterns.push(g.to_ascii_lowercase());
                }
                Err(e) => self.issue(at, &join(path, name), format!("bad glob \"{g}\": {e}")),
            }
        }
        let set = b.build().unwrap_or_else(|_| GlobSet::empty());
        HostGlobs { set, len, patterns }
    }

    fn config(&mut self, root: &Table<'_>) -> Option<Config> {
        self.known_keys(
            root,
            "",
            &[
                "proxy",
                "store",
                "defaults",
                "endpoints",
                "tls",
                "security",
                "log",
            ],
        );
        let empty = Table::default();
        let proxy_t = self.sub_table(root, "", "proxy").unwrap_or(&empty);
        let proxy = self.proxy(proxy_t);
        let store_t = self.sub_table(root, "", "store").unwrap_or(&empty);
        let store = self.store(store_t);
        let defaults_t = self.sub_table(root, "", "defaults").unwrap_or(&empty);
        self.known_keys(
            defaults_t,
            "defaults",
            &[
                "rate",
                "burst",
                "max_wait",
                "unknown",
                "adaptive",
                "mode",
                "max_in_flight",
                "lease_ttl",
                "shares",
            ],
        );
        let default_mode = self.mode(defaults_t, "defaults", Mode::Enforce);
        let log_t = self.sub_table(root, "", "log").unwrap_or(&empty);
        let log = self.log(log_t);
        let defaults = self.policy(defaults_t, "defaults", &Policy::default());
        let unknown = self.enumerated(
            defaults_t,
            "defaults",
            "unknown",
            UnknownEndpoints::Default,
            &[
                ("default", UnknownEndpoints::Default),
                ("reject", UnknownEndpoints::Reject),
            ],
        );
        let endpoints = self.endpoints(root, &defaults, default_mode);
        let tls_t = self.sub_table(root, "", "tls").unwrap_or(&empty);
        let tls = self.tls(tls_t);
        let sec_t = self.sub_table(root, "", "security").unwrap_or(&empty);
        let security = self.security(sec_t);
        Some(Config {
            proxy,
            store,
            defaults: Arc::new(defaults),
            unknown,
            default_mode,
            log,
            endpoints,
            tls,
            security,
        })
    }

    fn proxy(&mut self, t: &Table<'_>) -> ProxyConfig {
        let p = "proxy";
        self.known_keys(
            t,
            p,
            &[
                "listen",
                "admin_listen",
                "endpoint_header",
                "endpoint_from_proxy_user",
                "upstream_timeout",
                "shutdown_grace",
                "max_connections",
                "metrics_max_endpoints",
                "workers",
                "idle_timeout",
                "tunnel_idle_timeout",
                "admin_token_file",
            ],
        );
        let endpoint_header = match self.string(t, p, "endpoint_header") {
            None => HeaderName::from_static("x-endpoint-id"),
            Some((s, at)) => HeaderName::from_bytes(s.as_bytes()).unwrap_or_else(|_| {
                self.issue(
                    at,
                    "proxy.endpoint_header",
                    format!("\"{s}\" is not a valid header name"),
                );
                HeaderName::from_static("x-endpoint-id")
            }),
        };
        let upstream_timeout = self.duration(t, p, "upstream_timeout", Duration::from_secs(30));
        if upstream_timeout.is_zero() {
            self.issue(0, "proxy.upstream_timeout", "must be greater than 0".into());
        }
        ProxyConfig {
            listen: self.addr(t, p, "listen", "127.0.0.1:8080"),
            admin_listen: self.addr(t, p, "admin_listen", "127.0.0.1:9090"),
            endpoint_header,
            endpoint_from_proxy_user: self.boolean(t, p, "endpoint_from_proxy_user", false),
            upstream_timeout,
            shutdown_grace: self.duration(t, p, "shutdown_grace", Duration::from_secs(10)),
            max_connections: self.count(t, p, "max_connections", 10_000),
            metrics_max_endpoints: self.count(t, p, "metrics_max_endpoints", 500),
            workers: match self.number(t, p, "workers") {
                None => 0,
                Some((n, _)) if n >= 0.0 && n.fract() == 0.0 && n <= 1024.0 => n as usize,
                Some((n, at)) => {
                    self.issue(
                        at,
                        "proxy.workers",
                        format!(
                            "{n} is invalid: must be a whole number from 0 (one per core) to 1024"
                        ),
                    );
                    0
                }
            },
            idle_timeout: self.positive(t, p, "idle_timeout", Duration::from_secs(120)),
            tunnel_idle_timeout: self.positive(
                t,
                p,
                "tunnel_idle_timeout",
                Duration::from_secs(600),
            ),
            admin_token_file: self.path(t, p, "admin_token_file"),
        }
    }

    fn store(&mut self, t: &Table<'_>) -> StoreConfig {
        let p = "store";
        self.known_keys(
            t,
            p,
            &[
                "backend",
                "urls",
                "key_prefix",
                "timeout",
                "on_error",
                "tls_ca_file",
                "tls_cert_file",
                "tls_key_file",
                "sentinel_master",
                "fallback_min_replicas",
            ],
        );
        let backend = self.enumerated(
            t,
            p,
            "backend",
            Backend::Memory,
            &[
                ("memory", Backend::Memory),
                ("redis", Backend::Redis),
                ("redis-cluster", Backend::RedisCluster),
                ("redis-sentinel", Backend::RedisSentinel),
            ],
        );
        let listed = self.strings(t, p, "urls");
        for (u, at) in &listed {
            if !(u.starts_with("redis://") || u.starts_with("rediss://")) {
                self.issue(
                    *at,
                    "store.urls",
                    format!("\"{}\" must start with redis:// or rediss://", redact(u)),
                );
            }
        }
        let at = t.get("urls").map_or(0, |v| v.span().start);
        if backend == Backend::Redis && listed.len() > 1 {
            self.issue(
                at,
                "store.urls",
                "backend \"redis\" takes exactly one URL".into(),
            );
        }
        let none_listed = matches!(
            t.get("urls").map(|v| v.get_ref()),
            Some(DeValue::Array(a)) if a.is_empty()
        );
        if backend != Backend::Memory && none_listed {
            self.issue(at, "store.urls", "needs at least one URL".into());
        }
        let mut urls: Vec<String> = listed.into_iter().map(|(u, _)| u).collect();
        if urls.is_empty() {
            urls.push("redis://127.0.0.1:6379/".into());
        }
        let timeout = self.duration(t, p, "timeout", Duration::from_millis(100));
        if timeout.is_zero() {
            self.issue(0, "store.timeout", "must be greater than 0".into());
        }
        let tls = self.store_tls(t, &urls);
        let sentinel_master = self.sentinel_master(t, backend, &tls);
        StoreConfig {
            tls,
            sentinel_master,
            fallback_min_replicas: self.count(t, p, "fallback_min_replicas", 1),
            backend,
            urls,
            key_prefix: self
                .string(t, p, "key_prefix")
                .map_or("sluice:".into(), |(s, _)| s),
            timeout,
            on_error: self.enumerated(
                t,
                p,
                "on_error",
                OnError::Local,
                &[
                    ("local", OnError::Local),
                    ("allow", OnError::Allow),
                    ("deny", OnError::Deny),
                ],
            ),
        }
    }

    /// `sentinel_master`: required with `redis-sentinel`, meaningless elsewhere.
    fn sentinel_master(
        &mut self,
        t: &Table<'_>,
        backend: Backend,
        tls: &StoreTls,
    ) -> Option<String> {
        let key = "store.sentinel_master";
        let name = self.string(t, "store", "sentinel_master");
        match (backend, name) {
            (Backend::RedisSentinel, Some((n, at))) if n.is_empty() => {
                self.issue(
                    at,
                    key,
                    "must name the master (as in `sentinel monitor NAME ...`)".into(),
                );
                None
            }
            (Backend::RedisSentinel, Some((n, _))) => {
                if *tls != StoreTls::default() {
                    let at = t
                        .get("tls_ca_file")
                        .or(t.get("tls_cert_file"))
                        .map_or(0, |v| v.span().start);
                    self.issue(at, "store.tls_ca_file", "TLS files are not supported with backend \"redis-sentinel\" yet: use rediss:// with a publicly trusted certificate".into());
                }
                Some(n)
            }
            (Backend::RedisSentinel, None) => {
                let at = t.get("backend").map_or(0, |v| v.span().start);
                self.issue(at, key, "backend \"redis-sentinel\" needs sentinel_master = \"<name>\" (the name the sentinels monitor)".into());
                None
            }
            (_, Some((_, at))) => {
                self.issue(
                    at,
                    key,
                    "only used with backend = \"redis-sentinel\"".into(),
                );
                None
            }
            (_, None) => None,
        }
    }

    /// `tls_ca_file`, `tls_cert_file`, `tls_key_file`: paths only (their contents are
    /// read by `check` and at start); the client pair is both or neither, and any of them
    /// needs `rediss://` URLs.
    fn store_tls(&mut self, t: &Table<'_>, urls: &[String]) -> StoreTls {
        let p = "store";
        let mut path = |name: &str| {
            self.string(t, p, name).map(|(s, at)| {
                if s.is_empty() {
                    self.issue(at, &join(p, name), "must not be empty".into());
                }
                (PathBuf::from(s), at)
            })
        };
        let ca = path("tls_ca_file");
        let cert = path("tls_cert_file");
        let key = path("tls_key_file");
        let client = match (cert, key) {
            (Some((cert_file, _)), Some((key_file, _))) => Some(ClientCert {
                cert_file,
                key_file,
            }),
            (Some((_, at)), None) => {
                self.issue(
                    at,
                    "store.tls_cert_file",
                    "needs store.tls_key_file too (mutual TLS takes both, or neither)".into(),
                );
                None
            }
            (None, Some((_, at))) => {
                self.issue(
                    at,
                    "store.tls_key_file",
                    "needs store.tls_cert_file too (mutual TLS takes both, or neither)".into(),
                );
                None
            }
            (None, None) => None,
        };
        let first = ["tls_ca_file", "tls_cert_file", "tls_key_file"]
            .into_iter()
            .find_map(|k| t.get(k).map(|v| (k, v.span().start)));
        if let Some((k, at)) = first {
            if let Some(plain) = urls.iter().find(|u| !u.starts_with("rediss://")) {
                self.issue(
                    at,
                    &join(p, k),
                    format!(
                        "TLS files need rediss:// URLs, but store.urls has \"{}\"",
                        redact(plain)
                    ),
                );
            }
        }
        StoreTls {
            ca_file: ca.map(|(f, _)| f),
            client,
        }
    }

    /// Reads rate/burst/max_wait/adaptive from `t`, inheriting from `base`.
    fn policy(&mut self, t: &Table<'_>, path: &str, base: &Policy) -> Policy {
        let rate = self.checked(
            t,
            path,
            "rate",
            base.rate,
            "between 0.000001 and 1e9 tokens per second",
            |n| (MIN_RATE..=MAX_RATE).contains(&n),
        );
        let burst = self.checked(t, path, "burst", base.burst, "between 1 and 1e9", |n| {
            (1.0..=MAX_RATE).contains(&n)
        });
        let max_wait = self.duration(t, path, "max_wait", base.max_wait);
        let base_adaptive = base.adaptive.unwrap_or_default();
        let adaptive_path = join(path, "adaptive");
        let adaptive = match t.get("adaptive") {
            // An inherited floor never exceeds this endpoint's own rate.
            None => base.adaptive.map(|a| Adaptive {
                floor: a.floor.min(rate),
                ..a
            }),
            Some(v) => match v.get_ref() {
                DeValue::Table(a) => self.adaptive(
                    a,
                    &adaptive_path,
                    &base_adaptive,
                    rate,
                    base.adaptive.is_some(),
                ),
                other => {
                    self.type_issue(v, &adaptive_path, "a table", other.type_str());
                    base.adaptive
                }
            },
        };
        if let Some(a) = &adaptive {
            if a.floor > rate {
                let at = t.get("rate").map_or(0, |v| v.span().start);
                self.issue(
                    at,
                    &join(path, "rate"),
                    format!(
                        "rate {rate} is below the adaptive floor {}: lower the floor",
                        a.floor
                    ),
                );
            }
        }
        let max_in_flight = match t.get("max_in_flight") {
            Some(_) => Some(
                self.count(t, path, "max_in_flight", 1)
                    .min(u32::MAX as usize) as u32,
            ),
            None => base.max_in_flight,
        };
        Policy {
            rate,
            burst,
            max_wait,
            adaptive,
            max_in_flight,
            lease_ttl: self.positive(t, path, "lease_ttl", base.lease_ttl),
            shares: self.shares(t, path).or_else(|| base.shares.clone()),
        }
    }

    /// `shares = { name = weight, ... }`: positive weights by sender name.
    fn shares(&mut self, t: &Table<'_>, path: &str) -> Option<Arc<Shares>> {
        let v = t.get("shares")?;
        let key = join(path, "shares");
        let DeValue::Table(items) = v.get_ref() else {
            self.type_issue(v, &key, "a table of weights", v.get_ref().type_str());
            return None;
        };
        let mut weights = std::collections::HashMap::new();
        for (name, _) in items.iter() {
            let w = self.checked(
                items,
                &key,
                name.get_ref(),
                1.0,
                "between 0.001 and 1e6",
                |n| (0.001..=1e6).contains(&n),
            );
            weights.insert(name.get_ref().to_string(), w);
        }
        Some(Arc::new(Shares::new(weights)))
    }

    fn adaptive(
        &mut self,
        t: &Table<'_>,
        p: &str,
        base: &Adaptive,
        rate: f64,
        base_on: bool,
    ) -> Option<Adaptive> {
        self.known_keys(
            t,
            p,
            &[
                "enabled",
                "floor",
                "decrease",
                "recovery",
                "default_cooldown",
                "max_cooldown",
                "floor_warn_after",
            ],
        );
        let enabled = self.boolean(t, p, "enabled", base_on);
        let floor_default = base.floor.min(rate);
        let a = Adaptive {
            floor: self.checked(
                t,
                p,
                "floor",
                floor_default,
                "at least 0.000001 tokens per second",
                |n| n >= MIN_RATE,
            ),
            decrease: self.checked(
                t,
                p,
                "decrease",
                base.decrease,
                "between 0 and 1 (exclusive)",
                |n| n > 0.0 && n < 1.0,
            ),
            recovery: self.duration(t, p, "recovery", base.recovery),
            default_cooldown: self.duration(t, p, "default_cooldown", base.default_cooldown),
            max_cooldown: self.duration(t, p, "max_cooldown", base.max_cooldown),
            floor_warn_after: self.duration(t, p, "floor_warn_after", base.floor_warn_after),
        };
        if a.max_cooldown < a.default_cooldown {
            let at = t
                .get("max_cooldown")
                .or(t.get("default_cooldown"))
                .map_or(0, |v| v.span().start);
            self.issue(
                at,
                &join(p, "max_cooldown"),
                "must be at least default_cooldown".into(),
            );
        }
        if a.recovery.is_zero() {
            let at = t.get("recovery").map_or(0, |v| v.span().start);
            self.issue(at, &join(p, "recovery"), "must be greater than 0".into());
        }
        enabled.then_some(a)
    }

    fn mode(&mut self, t: &Table<'_>, path: &str, default: Mode) -> Mode {
        self.enumerated(
            t,
            path,
            "mode",
            default,
            &[("enforce", Mode::Enforce), ("shadow", Mode::Shadow)],
        )
    }

    fn log(&mut self, t: &Table<'_>) -> LogConfig {
        self.known_keys(t, "log", &["decisions", "sample"]);
        LogConfig {
            decisions: self.boolean(t, "log", "decisions", true),
            sample: self.checked(t, "log", "sample", 1.0, "between 0 and 1", |n| {
                (0.0..=1.0).contains(&n)
            }),
        }
    }

    fn endpoints(
        &mut self,
        root: &Table<'_>,
        defaults: &Policy,
        default_mode: Mode,
    ) -> Vec<EndpointRule> {
        let Some(v) = root.get("endpoints") else {
            return Vec::new();
        };
        let DeValue::Array(items) = v.get_ref() else {
            self.type_issue(
                v,
                "endpoints",
                "an array of tables ([[endpoints]])",
                v.get_ref().type_str(),
            );
            return Vec::new();
        };
        let mut out: Vec<EndpointRule> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            if let Some(rule) = self.endpoint(i, item, &out, defaults, default_mode) {
                out.push(rule);
            }
        }
        out
    }

    /// One `[[endpoints]]` entry; `seen` are the entries before it (for duplicates).
    fn endpoint(
        &mut self,
        i: usize,
        item: &Value<'_>,
        seen: &[EndpointRule],
        defaults: &Policy,
        default_mode: Mode,
    ) -> Option<EndpointRule> {
        let path = format!("endpoints[{i}]");
        let DeValue::Table(t) = item.get_ref() else {
            self.type_issue(item, &path, "a table", item.get_ref().type_str());
            return None;
        };
        self.known_keys(
            t,
            &path,
            &[
                "id",
                "rate",
                "burst",
                "max_wait",
                "hosts",
                "path_prefix",
                "adaptive",
                "mode",
                "max_in_flight",
                "lease_ttl",
                "shares",
            ],
        );
        let id = match self.string(t, &path, "id") {
            Some((id, at)) => {
                if let Err(e) = check_endpoint_id(&id) {
                    self.issue(at, &join(&path, "id"), e);
                } else if seen.iter().any(|r| *r.id == id) {
                    self.issue(
                        at,
                        &join(&path, "id"),
                        format!("duplicate endpoint id \"{id}\""),
                    );
                }
                id
            }
            None => {
                self.issue(
                    item.span().start,
                    &join(&path, "id"),
                    "every [[endpoints]] entry needs an id".into(),
                );
                return None;
            }
        };
        let policy = self.policy(t, &path, defaults);
        let hosts = self
            .strings(t, &path, "hosts")
            .into_iter()
            .map(|(h, _)| {
                let h = h.to_ascii_lowercase();
                h.strip_suffix('.').map(str::to_owned).unwrap_or(h)
            })
            .collect();
        let path_prefix = self.string(t, &path, "path_prefix").map(|(p, at)| {
            if !p.starts_with('/') {
                self.issue(at, &join(&path, "path_prefix"), "must start with /".into());
            }
            p
        });
        let mode = self.mode(t, &path, default_mode);
        Some(EndpointRule {
            id: id.into(),
            policy: Arc::new(policy),
            hosts,
            path_prefix,
            mode,
        })
    }

    fn tls(&mut self, t: &Table<'_>) -> TlsConfig {
        let p = "tls";
        self.known_keys(
            t,
            p,
            &[
                "intercept",
                "ca_cert",
                "ca_key",
                "upstream_roots",
                "passthrough_hosts",
                "leaf_cache_size",
                "handshake_timeout",
            ],
        );
        TlsConfig {
            intercept: self.boolean(t, p, "intercept", false),
            ca_cert: self
                .string(t, p, "ca_cert")
                .map_or("ca/ca.pem".into(), |(s, _)| s.into()),
            ca_key: self
                .string(t, p, "ca_key")
                .map_or("ca/ca.key".into(), |(s, _)| s.into()),
            upstream_roots: self
                .strings(t, p, "upstream_roots")
                .into_iter()
                .map(|(s, _)| s.into())
                .collect(),
            passthrough_hosts: self.globs(t, p, "passthrough_hosts"),
            leaf_cache_size: self.count(t, p, "leaf_cache_size", 1000),
            handshake_timeout: self.positive(t, p, "handshake_timeout", Duration::from_secs(10)),
        }
    }

    fn security(&mut self, t: &Table<'_>) -> SecurityConfig {
        let p = "security";
        self.known_keys(
            t,
            p,
            &[
                "allow_private_destinations",
                "allowed_hosts",
                "auth_users_file",
                "user_endpoints",
            ],
        );
        let auth_users_file = self.path(t, p, "auth_users_file");
        let user_endpoints = self.user_endpoints(t);
        if auth_users_file.is_none() && !user_endpoints.is_empty() {
            let at = t.get("user_endpoints").map_or(0, |v| v.span().start);
            self.issue(
                at,
                "security.user_endpoints",
                "grants need proxy users: set security.auth_users_file".into(),
            );
        }
        SecurityConfig {
            allow_private_destinations: self.boolean(t, p, "allow_private_destinations", false),
            allowed_hosts: self.globs(t, p, "allowed_hosts"),
            auth_users_file,
            user_endpoints,
        }
    }

    /// `[security.user_endpoints]`: `user = ["glob", ...]`.
    fn user_endpoints(&mut self, t: &Table<'_>) -> Vec<UserGrant> {
        let path = "security.user_endpoints";
        let Some(table) = self.sub_table(t, "security", "user_endpoints") else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (user, _) in table.iter() {
            let user = user.get_ref().to_string();
            let mut b = GlobSetBuilder::new();
            for (g, at) in self.strings(table, path, &user) {
                match Glob::new(&g) {
                    Ok(glob) => {
                        b.add(glob);
                    }
                    Err(e) => self.issue(at, &join(path, &user), format!("bad glob \"{g}\": {e}")),
                }
            }
            let endpoints = b.build().unwrap_or_else(|_| GlobSet::empty());
            out.push(UserGrant { user, endpoints });
        }
        out
    }

    /// An optional path; an empty string means unset.
    fn path(&mut self, t: &Table<'_>, path: &str, name: &str) -> Option<PathBuf> {
        self.string(t, path, name)
            .filter(|(s, _)| !s.is_empty())
            .map(|(s, _)| s.into())
    }

    /// A duration that must be greater than zero.
    fn positive(&mut self, t: &Table<'_>, path: &str, name: &str, default: Duration) -> Duration {
        let d = self.duration(t, path, name, default);
        if d.is_zero() {
            let at = t.get(name).map_or(0, |v| v.span().start);
            self.issue(at, &join(path, name), "must be greater than 0".into());
            return default;
        }
        d
    }
}

/// Endpoint IDs become metric labels and Redis keys: keep them printable and short.
pub fn check_endpoint_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > 128 {
        return Err("endpoint id must be 1 to 128 characters".into());
    }
    if !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "endpoint id \"{id}\" may only contain visible ASCII characters"
        ));
    }
    Ok(())
}

/// Hides the password of a `redis://user:pass@host` URL.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.find(':') {
                Some(c) => format!("{}{}:***{}", &url[..s + 3], &creds[..c], &url[at..]),
                None => format!("{}***{}", &url[..s + 3], &url[at..]),
            }
        }
        _ => url.to_owned(),
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// The known key nearest to a typo (by edit distance ≤ 2).
fn closest<'a>(typo: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (edit_distance(typo, k), *k))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(c.store.backend, Backend::Memory);
        assert_eq!(c.store.timeout, Duration::from_millis(100));
        assert_eq!(c.store.on_error, OnError::Local);
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
            (
                "[store]\nbackend = \"redis\"\nurls = [\"redis://a/\", \"redis://b/\"]",
                "store.urls",
            ),
            ("[store]\nurls = [\"http://x/\"]", "store.urls"),
            ("[store]\non_error = \"panic\"", "store.on_error"),
            (
                "[store]\nfallback_min_replicas = 0",
                "store.fallback_min_replicas",
            ),
            (
                "[proxy]\nendpoint_header = \"bad header\"",
                "proxy.endpoint_header",
            ),
            ("[proxy]\nmax_connections = 0", "proxy.max_connections"),
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
        assert_eq!(ep.hosts, ["hooks.example.com"]);
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
