//! Wiring: builds the [`App`] from a validated config (store, upstream client, TLS
//! interception, metrics), binds the listeners, runs it, and applies live reloads.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::config::{Backend, Config, ConfigError, OnError, UnknownEndpoints};
use crate::conn::Lifecycle;
use crate::core::{App, Runtime, RuntimeError};
use crate::destination::DestinationPolicy;
use crate::forward::Forwarder;
use crate::limiter::cluster_fallback::SlotFallbacks;
use crate::limiter::fallback::Resilient;
use crate::limiter::memory::MemoryStore;
use crate::limiter::peers::{Peers, heartbeats};
use crate::limiter::redis::RedisStore;
use crate::limiter::{BucketStore, Limiter, StoreError};
use crate::metrics::Metrics;
use crate::tls::UpstreamTlsError;
use crate::tls::{CertAuthority, Interceptor, MitmError};
use crate::workers::Workers;

/// How often the observer refreshes gauges and looks for state changes.
const OBSERVE_EVERY: Duration = Duration::from_secs(1);
/// Lifetime of minted leaf certificates.
const LEAF_VALIDITY: Duration = Duration::from_secs(24 * 3600);

/// Why sluice could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The store could not be reached and `on_error = "deny"` (fail-closed).
    #[error(
        "rate-limit store unreachable at start: {0}. store.on_error = \"deny\" refuses to \
         start without it: start Redis, fix store.urls, or set on_error = \"local\" to start degraded"
    )]
    StoreDown(StoreError),
    /// The store client could not be built from `store.urls`.
    #[error("rate-limit store: {0}; check store.urls")]
    StoreConfig(StoreError),
    /// The CA for interception could not be loaded.
    #[error("TLS interception: {0}")]
    Mitm(#[from] MitmError),
    /// Upstream trust roots could not be loaded.
    #[error("upstream TLS roots: {0}")]
    UpstreamTls(#[from] UpstreamTlsError),
    /// The trace exporter could not be set up.
    #[error("{0}")]
    Traces(#[from] crate::traces::TracesError),
    /// A file the config names (users, admin token) cannot be used.
    #[error("{0}")]
    Files(#[from] RuntimeError),
    /// A listener address is taken or not ours.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Builds everything a request needs, once.
pub async fn build(config: Arc<Config>) -> Result<Arc<App>, StartError> {
    let runtime = Runtime::load(Arc::clone(&config))?;
    let metrics = Arc::new(
        Metrics::new(
            config.proxy.metrics_max_endpoints,
            config.endpoints.iter().map(|e| &e.id),
        )
        .with_max_senders(config.proxy.metrics_max_senders),
    );
    let store: Arc<dyn BucketStore> = match config.store.backend {
        Backend::Memory => Arc::new(
            MemoryStore::new().capped(config.store.max_endpoints, metrics.store.endpoints.clone()),
        ),
        Backend::Redis | Backend::RedisCluster | Backend::RedisSentinel => {
            let primary = match config.store.on_error {
                // Fail closed: a dead store would refuse every request, so refuse to start.
                OnError::Deny => RedisStore::connect(&config.store, metrics.store.clone())
                    .await
                    .map_err(StartError::StoreDown)?,
                // A fallback can serve: Redis may come up later.
                OnError::Local | OnError::Allow => {
                    RedisStore::connect_lazy(&config.store, metrics.store.clone())
                        .await
                        .map_err(StartError::StoreConfig)?
                }
            };
            let primary = Arc::new(primary);
            let checked = Arc::clone(&primary);
            tokio::spawn(async move { checked.check_eviction().await });
            let peers = Arc::new(Peers::new(config.store.fallback_min_replicas));
            tokio::spawn(heartbeats(Arc::downgrade(&primary), Arc::clone(&peers)));
            let (on_error, stats) = (config.store.on_error, metrics.store.clone());
            // On a cluster, a failing node sends only its own slots' endpoints to the
            // fallback.
            let store: Arc<dyn BucketStore> = if config.store.backend == Backend::RedisCluster {
                let prefix = &config.store.key_prefix;
                Arc::new(SlotFallbacks::new(primary, prefix, on_error, stats, peers))
            } else {
                Arc::new(Resilient::new(primary, on_error, stats, peers))
            };
            // Learn the store's state now, so /readyz and the log tell it from the start;
            // this also registers the replica before it serves: a replica alone in the
            // store takes tokens ahead (`store.prefetch = "alone"`) only until this one
            // is seen, and the ping returns once those it took before are spent or back.
            if let Err(e) = store.ping().await {
                tracing::warn!(error = %e, "store unreachable at start: serving with the on_error fallback");
            }
            store
        }
    };
    let policy = Arc::new(ArcSwap::from_pointee(DestinationPolicy::new(
        &config.security,
    )));
    let tls = crate::tls::upstream::client_config(&config.tls.upstream_roots)?;
    let forwarder = Forwarder::new(tls, config.proxy.upstream_timeout, policy);
    let interceptor = if config.tls.intercept {
        let ca = CertAuthority::load(&config.tls.ca_cert, &config.tls.ca_key)?;
        Some(Arc::new(Interceptor::new(
            ca,
            config.tls.leaf_cache_size,
            LEAF_VALIDITY,
        )))
    } else {
        None
    };
    Ok(Arc::new(App {
        runtime: ArcSwap::from_pointee(runtime),
        limiter: Limiter::new(store),
        forwarder,
        metrics,
        interceptor,
        lifecycle: Lifecycle::new(),
        sampler: Default::default(),
        traces: Arc::new(crate::traces::Traces::new(
            &config.traces,
            &config.tls.upstream_roots,
        )?),
        idle: Default::default(),
        reloads: tokio::sync::watch::Sender::new(()),
    }))
}

/// A running sluice (used by `main` and by the tests).
pub struct Running {
    /// Where the proxy listens.
    pub proxy_addr: SocketAddr,
    /// Where the admin listener listens.
    pub admin_addr: SocketAddr,
    /// The shared state (for reloads and inspection).
    pub app: Arc<App>,
    stop: Option<oneshot::Sender<()>>,
    join: JoinHandle<()>,
}

impl Running {
    /// Asks for a graceful shutdown and waits for it (bounded by `shutdown_grace`).
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.join).await;
        Arc::clone(&self.app.traces).flush().await;
    }

    /// Waits until the server ends (after a shutdown request).
    pub async fn wait(self) {
        let _ = self.join.await;
        Arc::clone(&self.app.traces).flush().await;
    }

    /// Takes the stop handle (for signal handlers).
    pub fn stop_handle(&mut self) -> Option<oneshot::Sender<()>> {
        self.stop.take()
    }
}

/// Connections the kernel completes and queues for a listener before sluice accepts
/// them (at `proxy.max_connections`, senders wait here). The kernel caps it at
/// `net.core.somaxconn` (4096 by default since Linux 5.4). std's and tokio's `bind`
/// ask for 128, so the 130th sender of a burst at the cap had its SYN dropped and lost
/// a second or more to its TCP retry.
const LISTEN_BACKLOG: u32 = 4096;

fn bind(addr: SocketAddr) -> Result<TcpListener, StartError> {
    let listen = || {
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        // As std's `bind` does on Unix: a restart can listen again at once, beside
        // connections of the previous process still in TIME_WAIT.
        #[cfg(unix)]
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(LISTEN_BACKLOG)
    };
    listen().map_err(|source| StartError::Bind { addr, source })
}

/// Binds the listeners (port 0 allowed) and starts serving sender connections on this
/// runtime (the tests' way: one runtime, pausable time).
pub async fn start(config: Config) -> Result<Running, StartError> {
    start_on(config, None).await
}

/// Drops idle upstream connections past their time now and then, until shutdown, so
/// they go also when no sender comes again.
async fn sweep_idle_upstreams(app: Arc<App>) {
    let mut stop = app.lifecycle.signal();
    let mut tick = tokio::time::interval(crate::idle::IDLE_FOR / 2);
    loop {
        tokio::select! {
            _ = tick.tick() => app.idle.sweep(),
            _ = crate::conn::until_down(&mut stop) => return,
        }
    }
}

/// Binds the listeners and starts serving, sender connections on `workers` when given
/// (`sluice run`).
pub async fn start_on(
    config: Config,
    workers: Option<Arc<Workers>>,
) -> Result<Running, StartError> {
    let config = Arc::new(config);
    let proxy = bind(config.proxy.listen)?;
    let admin = bind(config.proxy.admin_listen)?;
    let app = build(Arc::clone(&config)).await?;
    let proxy_addr = proxy.local_addr().map_err(|source| StartError::Bind {
        addr: config.proxy.listen,
        source,
    })?;
    let admin_addr = admin.local_addr().map_err(|source| StartError::Bind {
        addr: config.proxy.admin_listen,
        source,
    })?;
    let (tx, rx) = oneshot::channel();
    tokio::spawn(crate::observer::run(Arc::clone(&app), OBSERVE_EVERY));
    tokio::spawn(sweep_idle_upstreams(Arc::clone(&app)));
    let (ceiling, source) = crate::budget::ceiling(config.proxy.max_memory);
    tracing::info!(ceiling, ?source, "memory ceiling (proxy.max_memory)");
    crate::budget::set_ceiling(ceiling);
    tokio::spawn(crate::budget::watch_memory(
        ceiling,
        app.metrics.connections.clone(),
        app.metrics.memory_pressed.clone(),
        app.lifecycle.signal(),
    ));
    let join = tokio::spawn(crate::server::run(
        Arc::clone(&app),
        proxy,
        admin,
        workers,
        async move {
            let _ = rx.await;
        },
    ));
    tracing::info!(%proxy_addr, %admin_addr, "sluice listening");
    Ok(Running {
        proxy_addr,
        admin_addr,
        app,
        stop: Some(tx),
        join,
    })
}

/// Why a reload was refused (the running config stays).
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The file is unreadable or invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A file it names (users, admin token) cannot be used.
    #[error(transparent)]
    Files(#[from] RuntimeError),
}

/// Validates `path` and, if good, swaps it in. Endpoint state (tokens, rate, cooldown)
/// lives in the store and survives; in-flight requests keep the policy they started with.
/// The users file and admin token are read again. Settings that need a restart
/// (listeners, connection limits and timeouts, the store, TLS set-up; see
/// [`keep_restart_only`]) keep their running values, and one warning names every one
/// that changed in the file.
pub fn reload(app: &App, path: &Path) -> Result<(), ReloadError> {
    let result = swap_in(app, path);
    if result.is_err() {
        app.metrics.reload_failures.inc();
    }
    result
}

/// [`reload`] but for counting its refusals.
fn swap_in(app: &App, path: &Path) -> Result<(), ReloadError> {
    let mut new = Config::load(path)?;
    let old = app.runtime.load_full();
    let ignored = keep_restart_only(&mut new, &old.config);
    let runtime = Runtime::load(Arc::new(new.clone()))?;
    if !ignored.is_empty() {
        tracing::warn!(
            settings = %ignored.join(", "),
            "changed in the config file but needs a restart: keeping the running values of {}",
            ignored.join(", ")
        );
    }
    let policy = DestinationPolicy::new(&new.security);
    if !app.forwarder.policy().same_as(&policy) {
        app.forwarder.set_policy(policy);
    }
    let changed = what_changed(&old.config, &new);
    app.metrics.configure(new.endpoints.iter().map(|e| &e.id));
    app.runtime.store(Arc::new(runtime));
    app.reloads.send_replace(());
    tracing::info!(path = %path.display(), %changed, "config reloaded");
    Ok(())
}

/// What a reload changes, for its log line: the endpoints added, removed and changed
/// (by ID) and the other sections or keys whose values differ, e.g. `endpoints added:
/// ep_7; endpoints changed: ep_42; changed: defaults, security`; `nothing` when the file
/// changed nothing in force. `new` has the running values of restart-only settings
/// already (they are warned about on their own).
pub fn what_changed(old: &Config, new: &Config) -> String {
    let ids =
        |c: &Config| -> Vec<Arc<str>> { c.endpoints.iter().map(|e| Arc::clone(&e.id)).collect() };
    let (was, now) = (ids(old), ids(new));
    let listed = |v: Vec<&str>| v.join(", ");
    let added = listed(
        now.iter()
            .filter(|id| !was.contains(id))
            .map(|id| &**id)
            .collect(),
    );
    let removed = listed(
        was.iter()
            .filter(|id| !now.contains(id))
            .map(|id| &**id)
            .collect(),
    );
    let changed = listed(
        new.endpoints
            .iter()
            .filter(|e| {
                old.endpoints
                    .iter()
                    .find(|o| o.id == e.id)
                    .is_some_and(|o| format!("{o:?}") != format!("{e:?}"))
            })
            .map(|e| &*e.id)
            .collect(),
    );
    // Whole sections and the top-level keys outside them, compared by their values.
    let differs =
        |a: &dyn std::fmt::Debug, b: &dyn std::fmt::Debug| format!("{a:?}") != format!("{b:?}");
    let mut keys = Vec::new();
    for (name, a, b) in [
        (
            "proxy",
            &old.proxy as &dyn std::fmt::Debug,
            &new.proxy as &dyn std::fmt::Debug,
        ),
        ("store", &old.store, &new.store),
        ("defaults", &old.defaults, &new.defaults),
        ("defaults.unknown", &old.unknown, &new.unknown),
        ("defaults.mode", &old.default_mode, &new.default_mode),
        ("log", &old.log, &new.log),
        ("tls", &old.tls, &new.tls),
        ("security", &old.security, &new.security),
        (
            "sender",
            &old.sender.map(|p| p.name),
            &new.sender.map(|p| p.name),
        ),
    ] {
        if differs(a, b) {
            keys.push(name);
        }
    }
    if was != now && added.is_empty() && removed.is_empty() {
        keys.push("endpoints (their order)");
    }
    let mut parts = Vec::new();
    for (what, list) in [
        ("endpoints added", added),
        ("endpoints removed", removed),
        ("endpoints changed", changed),
        ("changed", keys.join(", ")),
    ] {
        if !list.is_empty() {
            parts.push(format!("{what}: {list}"));
        }
    }
    if parts.is_empty() {
        "nothing".to_owned()
    } else {
        parts.join("; ")
    }
}

/// Puts the running value back into `new` for every setting that is read only at start,
/// and returns the names of those that differed. Everything after a reload then reads
/// the values actually in force (`/readyz` reports the running `store.on_error`).
pub fn keep_restart_only(new: &mut Config, running: &Config) -> Vec<&'static str> {
    let mut changed = Vec::new();
    macro_rules! keep {
        ($($name:literal => $($field:ident).+;)*) => {$(
            if new.$($field).+ != running.$($field).+ {
                changed.push($name);
                new.$($field).+ = running.$($field).+.clone();
            }
        )*};
    }
    keep! {
        "proxy.listen" => proxy.listen;
        "proxy.admin_listen" => proxy.admin_listen;
        "proxy.max_connections" => proxy.max_connections;
        "proxy.max_memory" => proxy.max_memory;
        "proxy.workers" => proxy.workers;
        "proxy.pin_workers" => proxy.pin_workers;
        "proxy.idle_timeout" => proxy.idle_timeout;
        "proxy.header_read_timeout" => proxy.header_read_timeout;
        "proxy.upstream_timeout" => proxy.upstream_timeout;
        "proxy.metrics_max_endpoints" => proxy.metrics_max_endpoints;
        "proxy.metrics_max_senders" => proxy.metrics_max_senders;
        "store.backend" => store.backend;
        "store.urls" => store.urls;
        "store.key_prefix" => store.key_prefix;
        "store.timeout" => store.timeout;
        "store.on_error" => store.on_error;
        "store.tls_*" => store.tls;
        "store.sentinel_master" => store.sentinel_master;
        "store.fallback_min_replicas" => store.fallback_min_replicas;
        "store.prefetch" => store.prefetch;
        "store.max_endpoints" => store.max_endpoints;
        "tls.intercept" => tls.intercept;
        "tls.ca_cert" => tls.ca_cert;
        "tls.ca_key" => tls.ca_key;
        "tls.upstream_roots" => tls.upstream_roots;
        "tls.leaf_cache_size" => tls.leaf_cache_size;
        "proxy.shutdown_grace" => proxy.shutdown_grace;
        "log.file" => log.file;
        "traces" => traces;
        "log.buffer_lines" => log.buffer_lines;
    }
    changed.extend(keep_safeguards(new, running));
    changed
}

/// A reload never switches a safeguard off by leaving its key out (a file cut short
/// while it is written, or emptied, would otherwise open the proxy): proxy
/// authentication, the admin token, `unknown = "reject"`, a non-empty `allowed_hosts`,
/// and each user's grants stay as they run, and are named like the restart-only
/// settings. A reload may still tighten any of them or change them to other values
/// (another users file, other hosts, `user = ["*"]` to lift one user's grants).
fn keep_safeguards(new: &mut Config, running: &Config) -> Vec<&'static str> {
    let mut kept = Vec::new();
    let (sec, was) = (&mut new.security, &running.security);
    if was.auth_users_file.is_some() && sec.auth_users_file.is_none() {
        kept.push("security.auth_users_file (turning proxy authentication off)");
        sec.auth_users_file.clone_from(&was.auth_users_file);
    }
    if !was.allowed_hosts.is_empty() && sec.allowed_hosts.is_empty() {
        kept.push("security.allowed_hosts (emptying it allows every host)");
        sec.allowed_hosts.clone_from(&was.allowed_hosts);
    }
    let dropped: Vec<_> = was
        .user_endpoints
        .iter()
        .filter(|g| !sec.user_endpoints.iter().any(|n| n.user == g.user))
        .cloned()
        .collect();
    if !dropped.is_empty() {
        kept.push("security.user_endpoints (a user's grants left out; lift them with [\"*\"])");
        sec.user_endpoints.extend(dropped);
    }
    if running.proxy.admin_token_file.is_some() && new.proxy.admin_token_file.is_none() {
        kept.push("proxy.admin_token_file (opening /metrics and /endpoints)");
        new.proxy
            .admin_token_file
            .clone_from(&running.proxy.admin_token_file);
    }
    if running.unknown == UnknownEndpoints::Reject && new.unknown != UnknownEndpoints::Reject {
        kept.push("defaults.unknown (from \"reject\")");
        new.unknown = running.unknown;
    }
    kept
}
