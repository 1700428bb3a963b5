//! The config schema: one reader per section (`[proxy]`, `[store]`, `[defaults]`,
//! `[[endpoints]]`, `[tls]`, `[security]`, `[log]`, `[sender]`), each naming its keys,
//! their types, defaults and the rules between them. Built on the generic reads of
//! [`super::reader`].

use super::reader::{Reader, Table, Value, join};
use super::*;
use crate::window::{MAX_WINDOWS, Window, Windows};

impl Reader<'_> {
    pub(super) fn config(&mut self, root: &Table<'_>) -> Option<Config> {
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
                "traces",
                "sender",
            ],
        );
        let empty = Table::default();
        // First: the sender's profile supplies defaults to the sections below.
        let sender_t = self.sub_table(root, "", "sender").unwrap_or(&empty);
        self.known_keys(sender_t, "sender", &["profile"]);
        let sender = self.sender_profile(sender_t, "sender", "profile");
        let proxy_t = self.sub_table(root, "", "proxy").unwrap_or(&empty);
        let proxy = self.proxy(proxy_t, sender);
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
                "absorb_post",
                "windows",
                "cost",
                "retry_after_json",
                "quota_headers",
            ],
        );
        let default_mode = self.mode(defaults_t, "defaults", Mode::Enforce);
        let log_t = self.sub_table(root, "", "log").unwrap_or(&empty);
        let log = self.log(log_t);
        let traces_t = self.sub_table(root, "", "traces").unwrap_or(&empty);
        let traces = self.traces(traces_t);
        let base = Policy {
            max_wait: sender.map_or(Policy::default().max_wait, |p| p.max_wait),
            ..Policy::default()
        };
        let defaults = self.policy(defaults_t, "defaults", &base);
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
        let config = Config {
            proxy,
            store,
            defaults: Arc::new(defaults),
            unknown,
            default_mode,
            log,
            traces,
            endpoints,
            tls,
            security,
            sender,
            warnings: Vec::new(),
        };
        self.duplicates_waiting(root, &config);
        Some(config)
    }

    /// A profile's name (`[sender] profile`, an endpoint's `sender_profile`): one of
    /// [`super::PROFILES`], or an issue at its line.
    fn sender_profile(
        &mut self,
        t: &Table<'_>,
        path: &str,
        name: &str,
    ) -> Option<&'static SenderProfile> {
        let choices: Vec<(&str, Option<&'static SenderProfile>)> =
            PROFILES.iter().map(|p| (p.name, Some(*p))).collect();
        self.enumerated(t, path, name, None, &choices)
    }

    /// Warns, naming the endpoint and the figures, where a wait budget plus
    /// `proxy.upstream_timeout` is not under the request timeout of the platform sending
    /// to it: the platform gives up and retries while sluice may still send the request,
    /// and the receiver gets it twice.
    fn duplicates_waiting(&mut self, root: &Table<'_>, c: &Config) {
        let upstream = c.proxy.upstream_timeout;
        let span =
            |t: Option<&Table<'_>>, key: &str| t.and_then(|t| t.get(key)).map(|v| v.span().start);
        let sections = |name: &str| match root.get(name).map(|v| v.get_ref()) {
            Some(DeValue::Table(t)) => Some(t),
            _ => None,
        };
        let (defaults_t, sender_t) = (sections("defaults"), sections("sender"));
        let items: Vec<Option<&Table<'_>>> = match root.get("endpoints").map(|v| v.get_ref()) {
            Some(DeValue::Array(items)) => items
                .iter()
                .map(|i| match i.get_ref() {
                    DeValue::Table(t) => Some(t),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        if let (Some(p), UnknownEndpoints::Default) = (c.sender, c.unknown) {
            let at = span(defaults_t, "max_wait").or(span(sender_t, "profile"));
            let what = "[defaults] (endpoints not listed)".to_owned();
            self.duplicate_waiting(
                at,
                "defaults.max_wait",
                what,
                c.defaults.max_wait,
                upstream,
                p,
            );
        }
        for (i, rule) in c.endpoints.iter().enumerate() {
            let Some(p) = rule.sender_profile.or(c.sender) else {
                continue;
            };
            let t = items.get(i).copied().flatten();
            let at = span(t, "max_wait")
                .or(span(t, "sender_profile"))
                .or(span(t, "id"));
            let key = format!("endpoints[{i}].max_wait");
            let what = format!("endpoint \"{}\"", rule.id);
            self.duplicate_waiting(at, &key, what, rule.policy.max_wait, upstream, p);
        }
    }

    /// One check of [`Self::duplicates_waiting`].
    fn duplicate_waiting(
        &mut self,
        at: Option<usize>,
        key: &str,
        what: String,
        max_wait: Duration,
        upstream: Duration,
        p: &SenderProfile,
    ) {
        let taken = max_wait + upstream;
        if taken < p.timeout {
            return;
        }
        self.warn(
            at.unwrap_or(0),
            key,
            format!(
                "{what}: max_wait {max_wait:?} + proxy.upstream_timeout {upstream:?} = \
                 {taken:?}, not under {}'s request timeout of {:?}: a duplicate waiting to \
                 happen ({} gives up and retries while sluice may still send the request); \
                 keep the two under {:?}, as the \"{}\" profile's {:?} + {:?} are",
                p.platform,
                p.timeout,
                p.platform,
                p.budget(),
                p.name,
                p.max_wait,
                p.upstream_timeout,
            ),
        );
    }

    /// `[proxy]`; `sender`'s profile supplies the default `upstream_timeout`.
    pub(super) fn proxy(
        &mut self,
        t: &Table<'_>,
        sender: Option<&'static SenderProfile>,
    ) -> ProxyConfig {
        /// Headers that cannot be the endpoint header (it is removed before forwarding):
        /// the request's framing and routing (removing `Content-Length` would send the
        /// body as the next request), hop-by-hop and proxy headers, and sluice's own.
        const RESERVED_HEADERS: [&str; 15] = [
            "content-length",
            "transfer-encoding",
            "host",
            "connection",
            "keep-alive",
            "te",
            "trailer",
            "upgrade",
            "expect",
            "proxy-authorization",
            "proxy-authenticate",
            "proxy-connection",
            "x-sluice-sender",
            "x-sluice-priority",
            "x-sluice-cost",
        ];
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
                "max_memory",
                "metrics_max_endpoints",
                "metrics_max_senders",
                "trust_sender_header",
                "workers",
                "pin_workers",
                "idle_timeout",
                "header_read_timeout",
                "tunnel_idle_timeout",
                "admin_token_file",
            ],
        );
        let endpoint_header = match self.string(t, p, "endpoint_header") {
            None => HeaderName::from_static("x-endpoint-id"),
            Some((s, at)) => match HeaderName::from_bytes(s.as_bytes()) {
                // Every `Proxy-*` header, as SPEC says: a
                // listed three used to be all.
                Ok(h)
                    if RESERVED_HEADERS.contains(&h.as_str())
                        || h.as_str().starts_with("proxy-") =>
                {
                    self.issue(
                        at,
                        "proxy.endpoint_header",
                        format!(
                            "\"{s}\" cannot name endpoints: sluice removes the endpoint header \
                             before forwarding, and this one frames the request, routes it or \
                             is sluice's own; choose another name such as X-Endpoint-Id"
                        ),
                    );
                    HeaderName::from_static("x-endpoint-id")
                }
                Ok(h) => h,
                Err(_) => {
                    self.issue(
                        at,
                        "proxy.endpoint_header",
                        format!("\"{s}\" is not a valid header name"),
                    );
                    HeaderName::from_static("x-endpoint-id")
                }
            },
        };
        let upstream_timeout = self.duration(
            t,
            p,
            "upstream_timeout",
            sender.map_or(Duration::from_secs(30), |s| s.upstream_timeout),
        );
        if upstream_timeout.is_zero() {
            let at = t.get("upstream_timeout").map_or(0, |v| v.span().start);
            self.issue(
                at,
                "proxy.upstream_timeout",
                "must be greater than 0".into(),
            );
        }
        let listen = self.addr(t, p, "listen", "127.0.0.1:8080");
        let admin_listen = self.addr(t, p, "admin_listen", "127.0.0.1:9090");
        // Port 0 picks a free port for each: only a fixed address can be taken twice.
        // A wildcard address takes its port on every address: `0.0.0.0:8080` beside
        // `127.0.0.1:8080` is a clash `run` could not listen through.
        let clash = listen.port() == admin_listen.port()
            && (listen.ip() == admin_listen.ip()
                || listen.ip().is_unspecified()
                || admin_listen.ip().is_unspecified());
        if clash && listen.port() != 0 {
            let at = t.get("admin_listen").map_or(0, |v| v.span().start);
            self.issue(
                at,
                "proxy.admin_listen",
                format!(
                    "{admin_listen} is proxy.listen too: the two listeners need their own addresses"
                ),
            );
        }
        ProxyConfig {
            listen,
            admin_listen,
            endpoint_header,
            endpoint_from_proxy_user: self.boolean(t, p, "endpoint_from_proxy_user", false),
            upstream_timeout,
            shutdown_grace: self.duration(t, p, "shutdown_grace", Duration::from_secs(10)),
            max_connections: self.count(t, p, "max_connections", 10_000),
            max_memory: self.whole(t, p, "max_memory", 0, 0..=1 << 50),
            metrics_max_endpoints: self.count(t, p, "metrics_max_endpoints", 500),
            metrics_max_senders: self.count(
                t,
                p,
                "metrics_max_senders",
                super::DEFAULT_MAX_SENDERS,
            ),
            trust_sender_header: self.boolean(t, p, "trust_sender_header", false),
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
            pin_workers: self.boolean(t, p, "pin_workers", true),
            idle_timeout: self.positive(t, p, "idle_timeout", Duration::from_secs(120)),
            header_read_timeout: self.positive(
                t,
                p,
                "header_read_timeout",
                Duration::from_secs(30),
            ),
            tunnel_idle_timeout: self.positive(
                t,
                p,
                "tunnel_idle_timeout",
                Duration::from_secs(600),
            ),
            admin_token_file: self.path(t, p, "admin_token_file"),
        }
    }

    pub(super) fn store(&mut self, t: &Table<'_>) -> StoreConfig {
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
                "prefetch",
                "max_endpoints",
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
            } else if let Err(e) = redis::IntoConnectionInfo::into_connection_info(u.as_str()) {
                // Parsed here as the store will parse it, so nothing passes `check` and
                // fails `run`, after `${ENV}`: a password holding `/`, `#`, `?` or `@`
                // must be percent-encoded.
                self.issue(
                    *at,
                    "store.urls",
                    format!(
                        "\"{}\" is not a Redis URL ({}); percent-encode a password's `/`, `#`, `?` and `@`",
                        redact(u),
                        e.category()
                    ),
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
            prefetch: self.prefetch(t, backend),
            max_endpoints: self.count(t, p, "max_endpoints", super::DEFAULT_MAX_ENDPOINTS),
            backend,
            urls,
            key_prefix: self.key_prefix(t, backend),
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
    pub(super) fn sentinel_master(
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

    /// `prefetch`: `false`, `true` or `"alone"` (the default); set explicitly, Redis
    /// backends only (the memory store has no round trip to spare).
    fn prefetch(&mut self, t: &Table<'_>, backend: Backend) -> Prefetch {
        let Some(v) = t.get("prefetch") else {
            return Prefetch::Alone;
        };
        let mode = match v.get_ref() {
            DeValue::Boolean(true) => Prefetch::On,
            DeValue::Boolean(false) => Prefetch::Off,
            DeValue::String(s) if s.as_ref() == "alone" => Prefetch::Alone,
            DeValue::String(s) => {
                self.issue(
                    v.span().start,
                    "store.prefetch",
                    format!("\"{s}\" is not one of true, false, \"alone\""),
                );
                return Prefetch::Alone;
            }
            other => {
                self.type_issue(
                    v,
                    "store.prefetch",
                    "true, false or \"alone\"",
                    other.type_str(),
                );
                return Prefetch::Alone;
            }
        };
        if mode != Prefetch::Off && backend == Backend::Memory {
            self.issue(
                v.span().start,
                "store.prefetch",
                "only used with a Redis backend (\"redis\", \"redis-cluster\", \"redis-sentinel\")"
                    .into(),
            );
        }
        mode
    }

    /// `key_prefix`; on `redis-cluster` without braces: an endpoint's keys are
    /// `<prefix>{<endpoint>}` and `<prefix>{<endpoint>}:leases`, one hash slot because
    /// the endpoint is their hash tag, and a brace in the prefix would move the tag
    /// (every endpoint on one slot, or the two keys apart and every leased call refused
    /// by the cluster).
    fn key_prefix(&mut self, t: &Table<'_>, backend: Backend) -> String {
        let Some((prefix, at)) = self.string(t, "store", "key_prefix") else {
            return "sluice:".into();
        };
        if backend == Backend::RedisCluster && prefix.contains(['{', '}']) {
            self.issue(
                at,
                "store.key_prefix",
                format!("{prefix:?} may not contain '{{' or '}}' with backend \"redis-cluster\": the endpoint is each key's hash tag"),
            );
        }
        prefix
    }

    /// `tls_ca_file`, `tls_cert_file`, `tls_key_file`: paths only (their contents are
    /// read by `check` and at start); the client pair is both or neither, and any of them
    /// needs `rediss://` URLs.
    pub(super) fn store_tls(&mut self, t: &Table<'_>, urls: &[String]) -> StoreTls {
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
    pub(super) fn policy(&mut self, t: &Table<'_>, path: &str, base: &Policy) -> Policy {
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
                // At the rate when this table sets it, else at the floor that does.
                let floor_at = || match t.get("adaptive").map(|a| a.get_ref()) {
                    Some(DeValue::Table(a)) => a.get("floor").map(|f| f.span().start),
                    _ => None,
                };
                let (at, key) = match t.get("rate") {
                    Some(v) => (v.span().start, join(path, "rate")),
                    None => (floor_at().unwrap_or(0), join(&adaptive_path, "floor")),
                };
                self.issue(
                    at,
                    &key,
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
        let windows = self.windows(t, path).unwrap_or(base.windows);
        let cost = self.cost(t, path, base.cost, burst, &windows);
        Policy {
            rate,
            burst,
            max_wait,
            adaptive,
            max_in_flight,
            lease_ttl: self.lease_ttl(t, path, base.lease_ttl),
            shares: self.shares(t, path).or_else(|| base.shares.clone()),
            absorb_post: self.boolean(t, path, "absorb_post", base.absorb_post),
            windows,
            cost,
            receiver: self.receiver_hints(t, path, &base.receiver),
        }
    }

    /// `windows = [{ limit = 5000, per = "1h" }, ...]`: at most `MAX_WINDOWS` sliding
    /// windows, each a whole-number `limit` ≥ 1 over a `per` of at least 1 ms (and at
    /// most a year); `None` when absent (inherited) or wrong (an issue).
    fn windows(&mut self, t: &Table<'_>, path: &str) -> Option<Windows> {
        let v = t.get("windows")?;
        let key = join(path, "windows");
        let DeValue::Array(items) = v.get_ref() else {
            let want = "an array of { limit, per } tables";
            self.type_issue(v, &key, want, v.get_ref().type_str());
            return None;
        };
        let mut list = Vec::new();
        let mut ok = true;
        for (i, item) in items.iter().enumerate() {
            let at = format!("{key}[{i}]");
            let DeValue::Table(w) = item.get_ref() else {
                let got = item.get_ref().type_str();
                self.type_issue(item, &at, "a { limit, per } table", got);
                ok = false;
                continue;
            };
            self.known_keys(w, &at, &["limit", "per"]);
            let limit = self.whole(w, &at, "limit", 0, 1..=1_000_000_000);
            let per = self.duration(w, &at, "per", Duration::ZERO);
            if !w.contains_key("limit") || !w.contains_key("per") {
                let why = "a window needs both `limit` and `per`".to_owned();
                self.issue(item.span().start, &at, why);
                ok = false;
                continue;
            }
            if per < Duration::from_millis(1) || per > Duration::from_secs(366 * 86_400) {
                let at_per = w.get("per").map_or(item.span().start, |p| p.span().start);
                let why = "must be between 1ms and 366d".to_owned();
                self.issue(at_per, &join(&at, "per"), why);
                ok = false;
                continue;
            }
            if limit == 0 {
                ok = false;
                continue;
            }
            let per_us = per.as_micros() as f64;
            if list.iter().any(|x: &Window| x.per_us == per_us) {
                let why = "two windows with the same `per`: keep the lower limit".to_owned();
                self.issue(item.span().start, &at, why);
                ok = false;
                continue;
            }
            list.push(Window {
                limit: limit as f64,
                per_us,
            });
        }
        let windows = Windows::new(&list);
        if windows.is_none() {
            let why = format!("at most {MAX_WINDOWS} windows per endpoint");
            self.issue(v.span().start, &key, why);
        }
        windows.filter(|_| ok)
    }

    /// `cost`: a whole number ≥ 1 that fits the bucket (`burst`) and every window.
    fn cost(&mut self, t: &Table<'_>, path: &str, base: u32, burst: f64, ws: &Windows) -> u32 {
        let cost = self.whole(t, path, "cost", u64::from(base), 1..=1_000_000_000) as u32;
        let fits = crate::window::cost_fits(f64::from(cost), burst, ws);
        if let Err(why) = fits {
            let at = t
                .get("cost")
                .or_else(|| t.get("burst"))
                .or_else(|| t.get("windows"))
                .map_or(0, |v| v.span().start);
            self.issue(at, &join(path, "cost"), why);
            return 1;
        }
        cost
    }

    /// `lease_ttl`: at least [`MIN_LEASE_TTL`], so a typo (`"10ms"` for `"10s"`) cannot
    /// quietly let leases lapse and `max_in_flight` with them.
    fn lease_ttl(&mut self, t: &Table<'_>, path: &str, base: Duration) -> Duration {
        let d = self.duration(t, path, "lease_ttl", base);
        if d < MIN_LEASE_TTL {
            let at = t.get("lease_ttl").map_or(0, |v| v.span().start);
            let why = "must be at least 1s: a slot's lease is renewed every third of it, and a \
                       shorter one can lapse between renewals, letting more than \
                       max_in_flight requests in";
            self.issue(at, &join(path, "lease_ttl"), why.into());
            return base;
        }
        d
    }

    /// `shares = { name = weight, ... }`: positive weights by sender name.
    pub(super) fn shares(&mut self, t: &Table<'_>, path: &str) -> Option<Arc<Shares>> {
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

    pub(super) fn adaptive(
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
                "absorb",
                "absorb_attempts",
                "absorb_max_body",
                "learn",
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
            absorb: self.enumerated(
                t,
                p,
                "absorb",
                base.absorb,
                &[
                    ("off", Absorb::Off),
                    ("safe", Absorb::Safe),
                    ("all", Absorb::All),
                ],
            ),
            absorb_attempts: self.whole(
                t,
                p,
                "absorb_attempts",
                base.absorb_attempts.into(),
                1..=MAX_ABSORB_ATTEMPTS.into(),
            ) as u32,
            absorb_max_body: self.whole(
                t,
                p,
                "absorb_max_body",
                base.absorb_max_body,
                0..=MAX_ABSORB_MAX_BODY,
            ),
            learn: self.boolean(t, p, "learn", base.learn),
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

    pub(super) fn mode(&mut self, t: &Table<'_>, path: &str, default: Mode) -> Mode {
        self.enumerated(
            t,
            path,
            "mode",
            default,
            &[("enforce", Mode::Enforce), ("shadow", Mode::Shadow)],
        )
    }

    pub(super) fn log(&mut self, t: &Table<'_>) -> LogConfig {
        self.known_keys(t, "log", &["decisions", "sample", "file", "buffer_lines"]);
        LogConfig {
            decisions: self.boolean(t, "log", "decisions", true),
            sample: self.checked(t, "log", "sample", 1.0, "between 0 and 1", |n| {
                (0.0..=1.0).contains(&n)
            }),
            file: self.path(t, "log", "file"),
            buffer_lines: self.whole(t, "log", "buffer_lines", 128_000, 1..=16_000_000) as usize,
        }
    }

    /// `[traces]`: an `otlp_endpoint` is an absolute `http://` or `https://` URL
    /// (empty: off).
    fn traces(&mut self, t: &Table<'_>) -> TracesConfig {
        let p = "traces";
        self.known_keys(t, p, &["otlp_endpoint", "service_name", "sample"]);
        let otlp_endpoint = match self.string(t, p, "otlp_endpoint") {
            Some((url, _)) if url.is_empty() => None,
            Some((url, at)) => match url.parse::<http::Uri>() {
                Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) && u.host().is_some() => {
                    Some(u)
                }
                _ => {
                    let why = format!(
                        "{url:?} is not an http:// or https:// URL \
                         (e.g. \"http://127.0.0.1:4318/v1/traces\")"
                    );
                    self.issue(at, "traces.otlp_endpoint", why);
                    None
                }
            },
            None => None,
        };
        TracesConfig {
            otlp_endpoint,
            service_name: self
                .string(t, p, "service_name")
                .map_or_else(|| "sluice".to_owned(), |(s, _)| s),
            sample: self.checked(t, p, "sample", 1.0, "between 0 and 1", |n| {
                (0.0..=1.0).contains(&n)
            }),
        }
    }

    pub(super) fn endpoints(
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
    pub(super) fn endpoint(
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
        // A receiver profile's keys, under the endpoint's own.
        let merged = self.with_receiver_profile(t, &path);
        let t = merged.as_ref().map_or(t, |(m, _)| m);
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
                "absorb_post",
                "sender_profile",
                "windows",
                "cost",
                "profile",
                "retry_after_json",
                "quota_headers",
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
        // An endpoint's own platform supplies its wait budget, unless it sets one.
        let sender_profile = self.sender_profile(t, &path, "sender_profile");
        let base = match sender_profile {
            Some(p) => &Policy {
                max_wait: p.max_wait,
                ..defaults.clone()
            },
            None => defaults,
        };
        let mut policy = self.policy(t, &path, base);
        policy.receiver.profile = merged.as_ref().map(|(_, name)| *name);
        // Kept as receivers read it (`/%61pi` is `/api`), the form requests are matched
        // in; a query or fragment can never start a path.
        let path_prefix = self.string(t, &path, "path_prefix").map(|(p, at)| {
            if !p.starts_with('/') {
                self.issue(at, &join(&path, "path_prefix"), "must start with /".into());
            } else if p.contains(['?', '#']) {
                self.issue(
                    at,
                    &join(&path, "path_prefix"),
                    format!(
                        "\"{p}\" has a query or fragment: a path prefix matches the path alone"
                    ),
                );
            }
            crate::host::path_as_read(&p).into_owned()
        });
        // Each host as a request's host is read (`API.example.com.` is
        // `api.example.com`, `127.1` is `127.0.0.1`), so a rule matches every spelling;
        // one that can never match a request is an error where it is written.
        let mut hosts = Vec::new();
        for (h, at) in self.strings(t, &path, "hosts") {
            let key = join(&path, "hosts");
            let rule = match host_rule(&h) {
                Ok(rule) => rule,
                Err(why) => {
                    self.issue(
                        at,
                        &key,
                        format!(
                            "\"{h}\" is not a host name or IP address with an optional port \
                             ({why}): hosts are matched exactly, without wildcards; write an \
                             IPv6 address with a port as [::1]:8443"
                        ),
                    );
                    continue;
                }
            };
            // An earlier rule takes every request this one would when it names the host
            // on every port or on this one, and its prefix covers this one's.
            let prefix = path_prefix.as_deref().unwrap_or("");
            let earlier = seen.iter().position(|r| {
                r.hosts
                    .iter()
                    .any(|e| e.host == rule.host && (e.port.is_none() || e.port == rule.port))
                    && prefix.starts_with(r.path_prefix.as_deref().unwrap_or(""))
            });
            if let Some(j) = earlier {
                self.issue(
                    at,
                    &key,
                    format!(
                        "\"{h}\" never resolves here: endpoints[{j}], listed first, takes every \
                         request to it this rule's path_prefix would"
                    ),
                );
            }
            hosts.push(rule);
        }
        let mode = self.mode(t, &path, default_mode);
        Some(EndpointRule {
            id: id.into(),
            policy: Arc::new(policy),
            hosts,
            path_prefix,
            mode,
            sender_profile,
        })
    }

    pub(super) fn tls(&mut self, t: &Table<'_>) -> TlsConfig {
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

    pub(super) fn security(&mut self, t: &Table<'_>) -> SecurityConfig {
        let p = "security";
        self.known_keys(
            t,
            p,
            &[
                "allow_private_destinations",
                "allowed_hosts",
                "auth_users_file",
                "user_endpoints",
                "allow_anonymous",
                "require_endpoint",
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
            allow_anonymous: self.boolean(t, p, "allow_anonymous", false),
            require_endpoint: self.boolean(t, p, "require_endpoint", false),
        }
    }

    /// `[security.user_endpoints]`: `user = ["glob", ...]`.
    pub(super) fn user_endpoints(&mut self, t: &Table<'_>) -> Vec<UserGrant> {
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
}

/// One `hosts` entry read as a [`HostRule`]: `hooks.example.com`, `hooks.example.com:8443`,
/// `[::1]:8443`; a bare IPv6 address (`::1`) names no port, as its colons are its own.
/// The host is normalised as a request's host is, so a rule matches every spelling.
fn host_rule(raw: &str) -> Result<HostRule, String> {
    let (host, port) = if raw.starts_with('[') {
        match raw.find(']') {
            Some(i) if i + 1 == raw.len() => (raw, None),
            Some(i) => match raw[i + 1..].strip_prefix(':') {
                Some(port) => (&raw[..=i], Some(port)),
                None => return Err("text after ']' that is not a port".into()),
            },
            None => return Err("unclosed '['".into()),
        }
    } else {
        match raw.split_once(':') {
            Some((host, port)) if !port.contains(':') => (host, Some(port)),
            _ => (raw, None),
        }
    };
    let port = match port {
        None => None,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n != 0 && p.bytes().all(|b| b.is_ascii_digit()) => Some(n),
            _ => return Err(format!("port {p:?} is not a number from 1 to 65535")),
        },
    };
    let host = crate::host::normalise_host(host).map_err(|e| e.0.to_owned())?;
    Ok(HostRule { host, port })
}
