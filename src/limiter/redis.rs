//! The Redis / Redis Cluster bucket store: one `EVALSHA` per decision.
//!
//! The scripts live in `lua/`: `bucket.lua` (state, clock and math shared by all) is
//! prepended at compile time to each of `acquire.lua`, `feedback.lua`, `release.lua`
//! and `view.lua`, and their SHAs are computed once, when the store is built.
//!
//! Single node: a multiplexed [`ConnectionManager`] per thread that calls the store
//! (`PerThread`: concurrent requests of a worker pipeline on its socket, and replies
//! wake no other thread; each reconnects with backoff on its own). Cluster: the async
//! cluster connection, which follows MOVED/ASK and failovers. A NOSCRIPT answer (restarted, failed-over or
//! flushed Redis) loads the script and retries once (`ScriptCall`; in a cluster
//! `SCRIPT LOAD` goes to every node). Every call is bounded by `store.timeout`,
//! latency and failures are recorded in [`StoreStats`], and errors are classified once,
//! in `classify`. Bucket times come from Redis `TIME` (the server clock, shared by
//! every replica); only the call latency is measured on tokio's clock here.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{
    ClientTlsConfig, FromRedisValue, RedisError, RedisResult, Script, TlsCertificates, ToRedisArgs,
    Value,
};
use tokio::time::Instant;

use super::credit::Taken;

use super::batch::{self, Lanes};
use super::bucket::{self, Ask, Outcome, Unused, View};
use super::cooldowns::{CooldownWatch, follow};
use super::credit;
use super::lease::{LeaseAsk, Leased};
use super::peers::HEARTBEAT_TTL;
use super::per_thread::PerThread;
use super::sentinel::SentinelConn;
use super::{BucketStore, StoreError, StoreFuture, StoreStats};
use crate::config::{Adaptive, Backend, Prefetch, StoreConfig, StoreTls, redact};
use crate::window::{self, WindowUse};

macro_rules! bucket_script {
    ($file:literal) => {
        concat!(
            include_str!("../../lua/bucket.lua"),
            include_str!(concat!("../../lua/", $file))
        )
    };
}

/// `lua/bucket.lua` + `lua/acquire.lua`.
const ACQUIRE_LUA: &str = bucket_script!("acquire.lua");
/// `lua/bucket.lua` + `lua/release.lua`.
const RELEASE_LUA: &str = bucket_script!("release.lua");
/// `lua/bucket.lua` + `lua/feedback.lua`.
const FEEDBACK_LUA: &str = bucket_script!("feedback.lua");
/// `lua/bucket.lua` + `lua/view.lua`.
const VIEW_LUA: &str = bucket_script!("view.lua");
/// `lua/replicas.lua` (stand-alone: no bucket state).
const REPLICAS_LUA: &str = include_str!("../../lua/replicas.lua");
/// `lua/bucket.lua` + `lua/lease.lua`.
const LEASE_LUA: &str = bucket_script!("lease.lua");
/// `lua/bucket.lua` + `lua/renew.lua`.
const RENEW_LUA: &str = bucket_script!("renew.lua");
/// `lua/bucket.lua` + `lua/cap.lua`.
const CAP_LUA: &str = bucket_script!("cap.lua");

/// Connections are allowed at least this long even with a tighter call timeout: a TCP
/// handshake plus HELLO must fit, or a reconnect could never succeed.
const MIN_CONNECT_TIMEOUT: Duration = Duration::from_millis(250);

/// A `[store] tls_*` file that cannot be used, named by its key and path.
#[derive(Debug, thiserror::Error)]
#[error("store.{key} = \"{}\": {reason}", path.display())]
pub struct StoreTlsError {
    /// The config key (`tls_ca_file`, `tls_cert_file` or `tls_key_file`).
    pub key: &'static str,
    /// The path it names.
    pub path: PathBuf,
    /// What is wrong with the file.
    pub reason: String,
}

/// Reads and checks the `[store] tls_*` files (used at start and by `sluice check`).
///
/// `None` when no file is configured: `rediss://` then trusts the system roots. With
/// `tls_ca_file`, its certificates are trusted *in addition to* the system roots (redis-rs
/// replaces the roots when given any, so the system ones are appended here).
pub fn tls_certificates(tls: &StoreTls) -> Result<Option<TlsCertificates>, StoreTlsError> {
    if tls.ca_file.is_none() && tls.client.is_none() {
        return Ok(None);
    }
    let root_cert = match &tls.ca_file {
        Some(path) => {
            let mut pem = read_certs(path, "tls_ca_file")?;
            let native = rustls_native_certs::load_native_certs();
            for cert in native.certs {
                pem.extend_from_slice(&pem_block(&cert));
            }
            Some(pem)
        }
        None => None,
    };
    let client_tls = match &tls.client {
        Some(c) => Some(ClientTlsConfig {
            client_cert: read_certs(&c.cert_file, "tls_cert_file")?,
            client_key: read_key(&c.key_file)?,
        }),
        None => None,
    };
    Ok(Some(TlsCertificates {
        client_tls,
        root_cert,
    }))
}

fn read_file(path: &Path, key: &'static str) -> Result<Vec<u8>, StoreTlsError> {
    std::fs::read(path).map_err(|e| StoreTlsError {
        key,
        path: path.to_owned(),
        reason: format!("cannot read it: {e}"),
    })
}

/// A PEM file that must hold at least one certificate.
fn read_certs(path: &Path, key: &'static str) -> Result<Vec<u8>, StoreTlsError> {
    let pem = read_file(path, key)?;
    let bad = |reason: String| StoreTlsError {
        key,
        path: path.to_owned(),
        reason,
    };
    let certs = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not valid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(bad(
            "holds no `-----BEGIN CERTIFICATE-----` block".to_owned()
        ));
    }
    Ok(pem)
}

/// A PEM file that must hold a private key.
fn read_key(path: &Path) -> Result<Vec<u8>, StoreTlsError> {
    let key = "tls_key_file";
    let pem = read_file(path, key)?;
    match rustls_pemfile::private_key(&mut pem.as_slice()) {
        Ok(Some(_)) => Ok(pem),
        Ok(None) => Err(StoreTlsError {
            key,
            path: path.to_owned(),
            reason: "holds no PEM private key (PKCS#8, PKCS#1 or SEC1)".to_owned(),
        }),
        Err(e) => Err(StoreTlsError {
            key,
            path: path.to_owned(),
            reason: format!("not a valid PEM private key: {e}"),
        }),
    }
}

/// One DER certificate as a PEM block.
fn pem_block(der: &[u8]) -> Vec<u8> {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::with_capacity(b64.len() + b64.len() / 64 + 60);
    out.push_str("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out.into_bytes()
}

/// The connection kinds; each is a cheap clone of shared multiplexed handles.
#[derive(Clone)]
enum Conn {
    Single(Arc<PerThread>),
    Cluster(ClusterConnection),
    Sentinel(Arc<SentinelConn>),
}

/// The scripts, hashed once.
struct Scripts {
    acquire: Script,
    release: Script,
    feedback: Script,
    view: Script,
    replicas: Script,
    lease: Script,
    renew: Script,
    cap: Script,
}

/// What every store call needs: the connection, the scripts, the key prefix, the call
/// timeout and the statistics. Shared with the acquire batcher's tasks.
pub(super) struct Calls {
    conn: Conn,
    scripts: Scripts,
    prefix: String,
    timeout: Duration,
    stats: StoreStats,
    /// `store.prefetch = "alone"` (single Redis, Sentinel): the heartbeat set and this
    /// replica's id in it, which `acquire.lua` checks before handing tokens out ahead.
    alone: Option<Alone>,
    /// Until when each endpoint's bucket is known to stay busy.
    busy: Busy,
    /// When a rebuild was last logged, and how many were not logged since: a Redis
    /// restarted under thousands of busy endpoints logs one warning a second, not one
    /// per endpoint.
    rebuild_log: Mutex<(Option<Instant>, u64)>,
}

/// Until when each endpoint's bucket was last heard to stay busy (full again at the
/// configured rate, a slot past its latest start), and the highest write count heard
/// for its key: `acquire.lua`'s and `release.lua`'s answers say both, and the next
/// acquire sends them. The key outlives that time by more than 1 s, so a key missing
/// before then is a store that lost its state (restarted empty between two calls,
/// evicted) rather than a bucket gone idle, and a key with a lower count went back in
/// time (a failover before the last writes reached the replica, a restart from an older
/// snapshot): the script rebuilds either busy, not full, and the reservations already
/// handed out get no second burst on top of them.
#[derive(Default)]
struct Busy(Mutex<HashMap<Box<str>, Heard>>);

/// What a replica last heard of one bucket.
#[derive(Clone, Copy)]
struct Heard {
    /// Busy until then.
    until: Instant,
    /// The key's write count then.
    writes: u64,
}

impl Busy {
    /// Endpoints remembered at most (past ones are dropped first; a replica deciding for
    /// more than this many endpoints at once forgets them all and starts over).
    const MAX: usize = 100_000;

    /// µs left at `now` of how long `endpoint`'s bucket is known to stay busy, and the
    /// highest write count heard (0 and 0: nothing known). Once that time is over, 0 and
    /// 0: the bucket is full again by then, so an older copy of it is no fuller, and its
    /// key may have expired and been made afresh, counting its writes from 1 (keeping the
    /// count would make the next call after an expiry "rebuild" a bucket nothing happened
    /// to).
    fn known(&self, endpoint: &str, now: Instant) -> (f64, u64) {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match map.get(endpoint) {
            Some(h) if h.until > now => (micros(h.until - now), h.writes),
            _ => (0.0, 0),
        }
    }

    /// Records an answer: the bucket stays busy for `us` µs from `at` (when the answer
    /// came, so what is sent back next is never short of it by the call's latency), at
    /// write count `writes`. An answer of a lower count than one already heard is older
    /// news (answers of concurrent calls arrive in any order) and changes nothing, unless
    /// what was heard before is over: the key may have expired and been made afresh.
    fn heard(&self, endpoint: &str, at: Instant, us: f64, writes: u64) {
        let heard = Heard {
            until: at + Duration::from_micros(us.max(0.0) as u64),
            writes,
        };
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = map.get_mut(endpoint) {
            if writes >= h.writes || h.until <= at {
                *h = heard;
            }
            return;
        }
        if map.len() >= Self::MAX {
            // Half of the endpoints go, the ones idle longest first.
            let mut untils: Vec<Instant> = map.values().map(|h| h.until).collect();
            let mid = untils.len() / 2;
            let (_, cut, _) = untils.select_nth_unstable(mid);
            let cut = *cut;
            map.retain(|_, h| h.until > cut);
        }
        map.insert(endpoint.into(), heard);
    }
}

/// Where `acquire.lua` checks that this replica is the only live one.
struct Alone {
    /// `<prefix>{_replicas}:heartbeats`.
    heartbeats: String,
    /// This replica's member there.
    replica: String,
    /// The last heartbeat counted other live replicas: nothing is asked ahead until one
    /// counts none, so while the store is shared its calls skip the script's check (two
    /// sorted-set look-ups and a key each). The script still checks every call that
    /// asks, so a replica that started since the last heartbeat is never missed.
    others: AtomicBool,
}

/// Buckets shared by every replica through Redis.
pub struct RedisStore {
    calls: Arc<Calls>,
    /// Concurrent acquires of one endpoint, coalesced into one script call.
    lanes: Arc<Lanes>,
    /// `<prefix>cooldowns`: where `feedback.lua` announces cooldowns.
    channel: String,
    /// Cooldown notices heard (single Redis only; elsewhere waiters always confirm).
    watch: Option<Arc<CooldownWatch>>,
    /// This process's random token: lease members are `<replica>:<id>`, unique across
    /// replicas sharing the store.
    replica: String,
}

/// Decides once whether a Redis error means the store is unreachable (transient: a
/// dropped/refused connection, a cluster without a serving master) or that it answered
/// with something sluice cannot use.
fn classify(e: RedisError, timeout: Duration) -> StoreError {
    if e.is_timeout() {
        StoreError::Timeout(timeout)
    } else if connection_lost(&e) {
        StoreError::Unreachable(e.to_string())
    } else if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly) {
        StoreError::Unreachable(format!("a replica answered, not the master: {e}"))
    } else if e.is_cluster_error() || e.kind() == redis::ErrorKind::ClusterConnectionNotFound {
        StoreError::Unreachable(format!("cluster: {e}"))
    } else {
        StoreError::Protocol(e.to_string())
    }
}

/// Whether `e` means the connection itself failed (dropped, refused, broken), rather
/// than Redis answering with an error.
pub(super) fn connection_lost(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
}

impl RedisStore {
    /// Warns when the store may evict sluice's keys: a `maxmemory` with any policy but
    /// `noeviction` (ElastiCache's default is `volatile-lru`, and every bucket key has
    /// a TTL) drops buckets when memory runs short, and an evicted bucket is a fresh
    /// full one (a second burst). Managed services that forbid `CONFIG` are left alone.
    pub async fn check_eviction(&self) {
        let get = |name: &'static str| {
            let mut cmd = redis::cmd("CONFIG");
            cmd.arg("GET").arg(name);
            async move {
                match self.calls.query(cmd).await {
                    Ok(Value::Array(v)) => match v.get(1) {
                        Some(Value::BulkString(b)) => Some(String::from_utf8_lossy(b).into_owned()),
                        _ => None,
                    },
                    Ok(Value::Map(v)) => match v.first() {
                        Some((_, Value::BulkString(b))) => {
                            Some(String::from_utf8_lossy(b).into_owned())
                        }
                        _ => None,
                    },
                    Ok(_) => None,
                    Err(e) => {
                        tracing::debug!(error = %e, "could not read the store's {name}");
                        None
                    }
                }
            }
        };
        let Some(policy) = get("maxmemory-policy").await else {
            return;
        };
        let limited = get("maxmemory").await.is_some_and(|m| m != "0");
        if limited && policy != "noeviction" {
            tracing::warn!(
                policy = %policy,
                "the store's maxmemory-policy {policy} lets Redis evict sluice's keys when memory runs short: an evicted bucket comes back full (a second burst) and an evicted lease frees a slot still in use; set maxmemory-policy noeviction (a full Redis then refuses writes, and on_error decides)"
            );
        }
    }

    /// Connects to a single Redis or a Redis Cluster (per `cfg.backend`) and checks it
    /// answers; fails with [`StoreError`] when it is unreachable or the URLs are bad.
    pub async fn connect(cfg: &StoreConfig, stats: StoreStats) -> Result<RedisStore, StoreError> {
        let store = RedisStore::build(cfg, stats, true).await?;
        store.ping().await?;
        Ok(store)
    }

    /// Like [`connect`](Self::connect), but does not wait for the store: connections are
    /// made on first use (and retried on every call), so a process whose `on_error`
    /// fallback can serve may start while Redis is down. Fails only on bad URLs.
    pub async fn connect_lazy(
        cfg: &StoreConfig,
        stats: StoreStats,
    ) -> Result<RedisStore, StoreError> {
        RedisStore::build(cfg, stats, false).await
    }

    async fn build(
        cfg: &StoreConfig,
        stats: StoreStats,
        eager: bool,
    ) -> Result<RedisStore, StoreError> {
        let connect_timeout = cfg.timeout.max(MIN_CONNECT_TIMEOUT);
        let certs = tls_certificates(&cfg.tls).map_err(|e| StoreError::Protocol(e.to_string()))?;
        let channel = format!("{}cooldowns", cfg.key_prefix);
        let mut watch = None;
        let conn = match cfg.backend {
            Backend::RedisCluster => {
                let seeds = || {
                    cfg.urls
                        .iter()
                        .map(|u| redact(u))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                let mut builder = ClusterClient::builder(cfg.urls.clone());
                if let Some(certs) = certs {
                    builder = builder.certs(certs);
                }
                let client = builder
                    .tcp_settings(tcp_settings())
                    .retries(1)
                    .min_retry_wait(10)
                    .max_retry_wait(100)
                    .build()
                    .map_err(|e| {
                        StoreError::Protocol(format!("bad cluster URLs {}: {e}", seeds()))
                    })?;
                let config = ClusterConfig::new()
                    .set_connection_timeout(connect_timeout)
                    .set_response_timeout(cfg.timeout);
                let conn = if eager {
                    tokio::time::timeout(
                        connect_timeout,
                        client.get_async_connection_with_config(config),
                    )
                    .await
                    .map_err(|_| StoreError::Timeout(connect_timeout))?
                    .map_err(|e| {
                        StoreError::Unreachable(format!("cluster seeds {}: {e}", seeds()))
                    })?
                } else {
                    client.get_pending_async_connection_with_config(config)
                };
                Conn::Cluster(conn)
            }
            Backend::RedisSentinel => {
                let name = cfg.sentinel_master.as_deref().unwrap_or_default();
                let conn = SentinelConn::new(
                    &cfg.urls,
                    name,
                    manager_config(cfg.timeout, connect_timeout),
                    connect_timeout,
                )
                .map_err(|e| {
                    let urls: Vec<String> = cfg.urls.iter().map(|u| redact(u)).collect();
                    StoreError::Protocol(format!("bad sentinel URLs {}: {e}", urls.join(", ")))
                })?;
                Conn::Sentinel(Arc::new(conn))
            }
            Backend::Redis | Backend::Memory => {
                let url = cfg.urls.first().cloned().unwrap_or_default();
                let client = redis::IntoConnectionInfo::into_connection_info(url.as_str())
                    .map(|info| info.set_tcp_settings(tcp_settings()))
                    .and_then(|info| match certs {
                        Some(certs) => redis::Client::build_with_tls(info, certs),
                        None => redis::Client::open(info),
                    })
                    .map_err(|e| {
                        StoreError::Protocol(format!("bad Redis URL {}: {e}", redact(&url)))
                    })?;
                let w = Arc::new(CooldownWatch::default());
                tokio::spawn(follow(
                    client.clone(),
                    channel.clone(),
                    Arc::downgrade(&w),
                    stats.notices.clone(),
                ));
                watch = Some(w);
                let config = manager_config(cfg.timeout, connect_timeout);
                Conn::Single(Arc::new(PerThread::new(client, config)))
            }
        };
        let replica = format!(
            "{:016x}",
            std::hash::RandomState::new().hash_one(std::process::id())
        );
        // Tokens ahead where the configuration lets them be taken: "alone" needs the
        // heartbeat set in the script's reach, which a cluster keeps in another slot.
        let (prefetch, alone) = match (cfg.prefetch, &conn) {
            (Prefetch::Off, _) | (Prefetch::Alone, Conn::Cluster(_)) => (false, None),
            (Prefetch::On, _) => (true, None),
            (Prefetch::Alone, _) => (
                true,
                Some(Alone {
                    heartbeats: replicas_key(&cfg.key_prefix),
                    replica: replica.clone(),
                    others: AtomicBool::new(false),
                }),
            ),
        };
        let calls = Calls {
            conn,
            scripts: Scripts {
                acquire: Script::new(ACQUIRE_LUA),
                release: Script::new(RELEASE_LUA),
                feedback: Script::new(FEEDBACK_LUA),
                view: Script::new(VIEW_LUA),
                replicas: Script::new(REPLICAS_LUA),
                lease: Script::new(LEASE_LUA),
                renew: Script::new(RENEW_LUA),
                cap: Script::new(CAP_LUA),
            },
            prefix: cfg.key_prefix.clone(),
            timeout: cfg.timeout,
            stats,
            alone,
            busy: Busy::default(),
            rebuild_log: Mutex::new((None, 0)),
        };
        // Top-ups keep a busy endpoint's held tokens from running out, so some stay
        // held for as long as its traffic lasts: only where no other replica could
        // want them ("alone", checked by the script at every top-up).
        let mut lanes = Lanes::new(prefetch, watch.clone());
        if calls.alone.is_some() {
            lanes = lanes.with_top_ups();
        }
        Ok(RedisStore {
            calls: Arc::new(calls),
            lanes: Arc::new(lanes),
            replica,
            channel,
            watch,
        })
    }

    /// The key of an endpoint: `<prefix>{<endpoint>}`, one cluster slot per endpoint.
    pub fn key(&self, endpoint: &str) -> String {
        self.calls.key(endpoint)
    }

    /// The sorted set of replica heartbeats: `<prefix>{_replicas}:heartbeats` (never one
    /// of an endpoint's keys, `<prefix>{<endpoint>}` and `<prefix>{<endpoint>}:leases`).
    pub fn replicas_key(&self) -> String {
        replicas_key(&self.calls.prefix)
    }

    /// Registers this replica as alive for `ttl` and returns how many replicas are.
    pub async fn heartbeat(&self, ttl: Duration) -> Result<usize, StoreError> {
        let key = self.replicas_key();
        let mut inv = ScriptCall::new(&self.calls.scripts.replicas, &[&key], 2);
        inv.arg(&self.replica).arg(ttl.as_millis() as u64);
        let live = self.calls.run::<usize>(inv).await?;
        if let Some(alone) = &self.calls.alone {
            alone.others.store(live > 1, Ordering::Relaxed);
        }
        Ok(live)
    }

    /// This replica's id in the heartbeat set (random per process).
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// The key of an endpoint's in-flight leases: `<prefix>{<endpoint>}:leases`, in the
    /// same cluster slot as its bucket.
    pub fn leases_key(&self, endpoint: &str) -> String {
        let mut k = self.key(endpoint);
        k.push_str(":leases");
        k
    }

    /// The member of lease `id` in the leases set.
    fn member(&self, id: u64) -> String {
        let mut m = String::with_capacity(self.replica.len() + 21);
        m.push_str(&self.replica);
        m.push(':');
        m.push_str(&id.to_string());
        m
    }
}

/// The replicas' heartbeat set under `prefix`.
fn replicas_key(prefix: &str) -> String {
    format!("{prefix}{{_replicas}}:heartbeats")
}

impl Calls {
    /// The key of an endpoint: `<prefix>{<endpoint>}`, one cluster slot per endpoint.
    pub(super) fn key(&self, endpoint: &str) -> String {
        let mut k = String::with_capacity(self.prefix.len() + endpoint.len() + 2);
        k.push_str(&self.prefix);
        k.push('{');
        k.push_str(endpoint);
        k.push('}');
        k
    }

    /// Runs one script call, bounded by the timeout, recording latency and errors.
    async fn run<T: FromRedisValue>(&self, inv: ScriptCall<'_>) -> Result<T, StoreError> {
        let conn = self.conn.clone();
        self.timed(async move {
            match conn {
                Conn::Single(p) => {
                    let r = inv.invoke_async(&mut p.get()?).await;
                    p.saw(&r);
                    r
                }
                Conn::Cluster(mut c) => inv.invoke_async(&mut c).await,
                Conn::Sentinel(s) => {
                    on_master(&s, |mut c| async move { inv.invoke_async(&mut c).await }).await
                }
            }
        })
        .await
    }

    async fn timed<T>(
        &self,
        fut: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = match tokio::time::timeout(self.timeout, fut).await {
            Err(_) => Err(StoreError::Timeout(self.timeout)),
            Ok(r) => r.map_err(|e| classify(e, self.timeout)),
        };
        self.stats.seconds.observe(started.elapsed().as_secs_f64());
        if result.is_err() {
            self.stats.errors.inc();
        }
        result
    }

    /// A call of `script` on the endpoint's key (then `also`, another of its keys) with
    /// the common ARGV[1..3]; `more` is a hint of how many arguments follow.
    fn invocation<'s>(
        &self,
        script: &'s Script,
        endpoint: &str,
        also: Option<&str>,
        ask: &Ask,
        more: usize,
    ) -> ScriptCall<'s> {
        let key = self.key(endpoint);
        let mut inv = match also {
            Some(other) => ScriptCall::new(script, &[&key, other], 3 + more),
            None => ScriptCall::new(script, &[&key], 3 + more),
        };
        inv.arg(Num(ask.rate))
            .arg(Num(ask.burst))
            .arg(Num(ask.recovery_us));
        inv
    }

    /// One `acquire.lua` call deciding `asks` in order, as separate calls at one instant
    /// would. They share the first ask's rate, burst and recovery (one endpoint's policy).
    ///
    /// `ahead`: tokens wanted ahead (`store.prefetch`); the second value is what the
    /// script handed out (see `lua/acquire.lua`): how many, the bucket generation they
    /// (and the grants) belong to, and their hold. `policy` gives the rate, burst and
    /// recovery; with no asks, the call only asks ahead (a top-up of tokens held ahead).
    pub(super) async fn acquire(
        &self,
        endpoint: &str,
        policy: &Ask,
        asks: &[Ask],
        ahead: u32,
    ) -> Result<(Vec<Outcome>, Taken), StoreError> {
        let shared = self
            .alone
            .as_ref()
            .is_some_and(|a| a.others.load(Ordering::Relaxed));
        let ahead = if shared { 0 } else { ahead };
        if asks.is_empty() && ahead == 0 {
            return Ok((Vec::new(), Taken::default()));
        }
        let alone = self.alone.as_ref().filter(|_| ahead > 0);
        let mut inv = self.invocation(
            &self.scripts.acquire,
            endpoint,
            alone.map(|a| a.heartbeats.as_str()),
            policy,
            8 + 2 * asks.len(),
        );
        inv.arg(ahead).arg(Num(micros(credit::HELD_FOR)));
        match alone {
            Some(a) => inv.arg(&a.replica).arg(HEARTBEAT_TTL.as_millis() as u64),
            None => inv.arg("").arg(0),
        };
        let (busy_us, writes) = self.busy.known(endpoint, Instant::now());
        inv.arg(Num::whole_micros(busy_us)).arg(writes);
        inv.arg(policy.windows.spec());
        inv.arg(costs(asks));
        for ask in asks {
            inv.arg(Num::whole_micros(ask.budget_us));
            match ask.held {
                Some(g) => inv.arg(g),
                None => inv.arg(""),
            };
        }
        let answer = self.run(inv).await?;
        let Decisions {
            outcomes,
            ahead: got,
            generation,
            hold,
            busy: (busy, writes),
            rebuilt,
        } = decisions(&answer, asks.len())?;
        self.busy.heard(endpoint, Instant::now(), busy, writes);
        if rebuilt {
            self.rebuilt(endpoint, busy);
        }
        let mut outcomes = outcomes;
        for (ask, outcome) in asks.iter().zip(&mut outcomes) {
            if let Outcome::Granted { at_us, .. } = outcome {
                if ask.held == Some(generation) {
                    // A confirmed reservation started before this call's `<now>`: its
                    // own start is not in the answer, so none is named.
                    *at_us = None;
                }
            }
        }
        if !(0.0..=f64::from(ahead)).contains(&got) {
            return Err(StoreError::Protocol(format!(
                "acquire handed out {got} tokens ahead, {ahead} were asked"
            )));
        }
        let taken = Taken {
            n: got as u32,
            generation,
            hold,
        };
        Ok((outcomes, taken))
    }

    /// Records a bucket the store had lost (or kept only from before its latest writes)
    /// and a script rebuilt from what this replica heard: `sluice_store_rebuilds_total`,
    /// and a warning naming the endpoint, as the operator's Redis lost state sluice
    /// relies on (restarted empty, flushed, evicted, or failed over to a replica the
    /// last writes had not reached).
    fn rebuilt(&self, endpoint: &str, busy_us: f64) {
        self.stats.rebuilds.inc();
        let now = Instant::now();
        let unlogged = {
            let mut log = self.rebuild_log.lock().unwrap_or_else(|e| e.into_inner());
            if log.0.is_some_and(|t| now - t < Duration::from_secs(1)) {
                log.1 += 1;
                return;
            }
            log.0 = Some(now);
            std::mem::take(&mut log.1)
        };
        tracing::warn!(
            endpoint,
            busy_for_ms = (busy_us / 1000.0).round(),
            more_since_last_warning = unlogged,
            "the store had lost this endpoint's bucket, or held an older copy (Redis restarted empty, flushed, evicted or failed over): rebuilt it as busy as this replica last heard, so no second burst goes out (sluice_store_rebuilds_total counts every one)"
        );
    }

    /// Runs one plain command (not a script), bounded and recorded like the scripts;
    /// the answer is not needed.
    async fn command(&self, cmd: redis::Cmd) -> Result<(), StoreError> {
        self.query(cmd).await.map(drop)
    }

    /// One command's answer.
    async fn query(&self, cmd: redis::Cmd) -> Result<Value, StoreError> {
        let conn = self.conn.clone();
        self.timed(async move {
            match conn {
                Conn::Single(p) => {
                    let r = cmd.query_async::<Value>(&mut p.get()?).await;
                    p.saw(&r);
                    r
                }
                Conn::Cluster(mut c) => cmd.query_async::<Value>(&mut c).await,
                Conn::Sentinel(s) => {
                    on_master(
                        &s,
                        |mut c| async move { cmd.query_async::<Value>(&mut c).await },
                    )
                    .await
                }
            }
        })
        .await
    }

    /// Gives back a reservation (see `lua/release.lua`).
    pub(super) async fn release(
        &self,
        endpoint: &str,
        ask: &Ask,
        unused: Unused,
    ) -> Result<(), StoreError> {
        let mut inv = self.invocation(&self.scripts.release, endpoint, None, ask, 6);
        // Its cost in tokens, no hold, due at its start on Redis's clock where the grant
        // said it (else this many µs from Redis's now: the replica's own time never
        // reaches the script), and the windows whose logs count it.
        inv.arg(unused.generation)
            .arg(ask.cost as u64)
            .arg("")
            .arg(unused.due_in_us.round() as i64);
        match unused.at_us {
            Some(at) => inv.arg(Num(at)),
            None => inv.arg(""),
        };
        inv.arg(ask.windows.spec());
        self.given_back(endpoint, inv).await
    }

    /// Gives back tokens taken ahead and never spent.
    pub(super) async fn give_back_ahead(
        &self,
        endpoint: &str,
        ask: &Ask,
        left: Taken,
    ) -> Result<(), StoreError> {
        let mut inv = self.invocation(&self.scripts.release, endpoint, None, ask, 3);
        inv.arg(left.generation).arg(left.n).arg(left.hold);
        self.given_back(endpoint, inv).await
    }

    /// Runs a `release.lua` call and records how long the bucket stays busy after it
    /// (a give-back can make that shorter): `"<busy> <n>"`, or -1 (nothing given back,
    /// nothing learnt).
    async fn given_back(&self, endpoint: &str, inv: ScriptCall<'_>) -> Result<(), StoreError> {
        if let Some((busy, writes)) = release_answer(&self.run::<Value>(inv).await?)? {
            self.busy.heard(endpoint, Instant::now(), busy, writes);
        }
        Ok(())
    }
}

/// One `EVALSHA`, its arguments written straight into one command buffer (redis's
/// `ScriptInvocation` first copies each argument into a `Vec` of its own, then all of
/// them into the command). A NOSCRIPT answer (restarted, failed-over or flushed Redis)
/// loads the script and retries once; in a cluster `SCRIPT LOAD` goes to every node.
struct ScriptCall<'s> {
    script: &'s Script,
    cmd: redis::Cmd,
}

impl<'s> ScriptCall<'s> {
    /// A call of `script` on `keys`, with room for about `args` arguments.
    fn new(script: &'s Script, keys: &[&str], args: usize) -> ScriptCall<'s> {
        let data = 50 + keys.iter().map(|k| k.len()).sum::<usize>() + 12 * args;
        let mut cmd = redis::Cmd::with_capacity(3 + keys.len() + args, data);
        cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys.len());
        for k in keys {
            cmd.arg(*k);
        }
        ScriptCall { script, cmd }
    }

    /// Appends an argument (ARGV, in order).
    fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.cmd.arg(arg);
        self
    }

    /// Sends the call on `con`; on NOSCRIPT loads the script there and sends it again.
    async fn invoke_async<T: FromRedisValue>(
        &self,
        con: &mut impl redis::aio::ConnectionLike,
    ) -> RedisResult<T> {
        match self.cmd.query_async(con).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.script.load_async(con).await?;
                self.cmd.query_async(con).await
            }
            r => r,
        }
    }
}

/// Every Redis connection sends each call at once (`TCP_NODELAY`). redis-rs leaves
/// Nagle's algorithm on by default, and with it a call written while an earlier one on
/// the same connection is still unacknowledged waits for that acknowledgement: up to a
/// round trip, or the server's delayed-ACK timer (40 ms on Linux). The calls of
/// different endpoints (and a lane's top-ups and give-backs) share a worker's
/// connection, so they would queue behind each other.
pub(super) fn tcp_settings() -> redis::io::tcp::TcpSettings {
    redis::io::tcp::TcpSettings::default().set_nodelay(true)
}

/// Few, short reconnect attempts per failure: the store timeout bounds each call anyway,
/// and the next call triggers the next reconnect.
fn manager_config(timeout: Duration, connect_timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(connect_timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(10))
        .set_max_delay(Duration::from_millis(250))
}

/// Runs `call` on the sentinel's current master; a failure that may mean a failover
/// starts a new lookup of the master.
async fn on_master<T, F, Fut>(s: &Arc<SentinelConn>, call: F) -> Result<T, RedisError>
where
    F: FnOnce(ConnectionManager) -> Fut,
    Fut: Future<Output = Result<T, RedisError>>,
{
    let (conn, addr) = s.conn().await?;
    let r = call(conn).await;
    if let Err(e) = &r {
        s.failed(&addr, e);
    }
    r
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// A number as a script argument: a whole one (rates, bursts and µs values mostly are)
/// as integer text, several times cheaper to write than a float's shortest form on every
/// call; any other as a float. Lua reads both alike.
#[derive(Debug, Clone, Copy)]
struct Num(f64);

impl Num {
    /// A wait budget in whole µs, rounded down: never longer than the budget asked.
    fn whole_micros(us: f64) -> Num {
        Num(us.floor())
    }
}

impl redis::ToRedisArgs for Num {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        // Below 2^53 every whole f64 is exact as an i64.
        const EXACT: f64 = 9_007_199_254_740_992.0;
        if self.0.fract() == 0.0 && self.0.abs() < EXACT {
            (self.0 as i64).write_redis_args(out);
        } else {
            self.0.write_redis_args(out);
        }
    }
}

fn num(v: &Value) -> Result<f64, StoreError> {
    let text = match v {
        Value::Int(i) => return Ok(*i as f64),
        Value::BulkString(b) => std::str::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s.as_str()),
        _ => None,
    };
    text.and_then(|s| s.parse().ok())
        .ok_or_else(|| StoreError::Protocol(format!("script answered {v:?}, not a number")))
}

/// What one acquire call decided (`lua/acquire.lua`'s answer, read by [`decisions`]).
#[derive(Debug, PartialEq)]
struct Decisions {
    /// The asks' outcomes, in order.
    outcomes: Vec<Outcome>,
    /// Tokens taken ahead.
    ahead: f64,
    /// The bucket's generation.
    generation: u64,
    /// The hold the tokens ahead joined (0: none).
    hold: u64,
    /// How long (µs) the bucket stays busy, and the key's write count.
    busy: (f64, u64),
    /// The call found the key lost or gone back in time, and rebuilt it.
    rebuilt: bool,
}

/// The answer of `lua/acquire.lua` for `n` asks,
/// `"<generation> <ahead> <hold> <busy> <writes> <now> <rebuilt> <ask>..."` with one
/// word per ask (`G`, `G<µs>`, `R<µs>`, `C<µs>`); a grant starts at `<now>` plus its
/// wait on the store's clock.
fn decisions(v: &Value, n: usize) -> Result<Decisions, StoreError> {
    let bad = || StoreError::Protocol(format!("unexpected acquire reply {v:?}"));
    let Value::BulkString(text) = v else {
        return Err(bad());
    };
    let mut words = text.split(|&b| b == b' ');
    let number = |w: Option<&[u8]>| w.and_then(whole).ok_or_else(bad);
    let generation = number(words.next())? as u64;
    let ahead = number(words.next())?;
    let hold = number(words.next())? as u64;
    let busy = number(words.next())?;
    let writes = number(words.next())? as u64;
    // The store's clock counts from 2023-11-14 (bucket.lua's EPOCH_S): a host set
    // before it answers a negative time, which works as well.
    let now = match words.next() {
        Some([b'-', digits @ ..]) => whole(digits).map(|t| -t),
        w => w.and_then(whole),
    }
    .ok_or_else(bad)?;
    let rebuilt = match words.next() {
        Some(b"0") => false,
        Some(b"1") => true,
        _ => return Err(bad()),
    };
    let mut outcomes = Vec::with_capacity(n);
    // No asks (a top-up): the answer ends with the separator after `<rebuilt>`.
    for word in words.filter(|w| n > 0 || !w.is_empty()) {
        let (&kind, us) = word.split_first().ok_or_else(bad)?;
        let us = match (kind, us) {
            (b'G', []) => 0.0,
            _ => whole(us).ok_or_else(bad)?,
        };
        outcomes.push(match kind {
            b'G' => Outcome::Granted {
                wait_us: us,
                generation,
                at_us: Some(now + us),
            },
            b'R' | b'C' => Outcome::Refused {
                cooldown: kind == b'C',
                retry_us: us,
            },
            _ => return Err(bad()),
        });
    }
    if outcomes.len() != n {
        return Err(bad());
    }
    Ok(Decisions {
        outcomes,
        ahead,
        generation,
        hold,
        busy: (busy, writes),
        rebuilt,
    })
}

/// The answer of `lua/release.lua`: `"<busy> <writes>"` after a give-back, `-1` when
/// nothing was given back (`None`: nothing learnt).
fn release_answer(v: &Value) -> Result<Option<(f64, u64)>, StoreError> {
    if let Value::BulkString(text) = v {
        let mut words = text.split(|&b| b == b' ').map(whole);
        if let (Some(Some(busy)), Some(Some(writes)), None) =
            (words.next(), words.next(), words.next())
        {
            return Ok(Some((busy, writes as u64)));
        }
    }
    match num(v) {
        Ok(-1.0) => Ok(None),
        _ => Err(StoreError::Protocol(format!(
            "unexpected release reply {v:?}"
        ))),
    }
}

/// A whole number as Lua writes one: digits, or an exponent form from 1e14 on.
fn whole(word: &[u8]) -> Option<f64> {
    if !word.is_empty() && word.len() <= 15 && word.iter().all(u8::is_ascii_digit) {
        return Some(
            word.iter()
                .fold(0u64, |acc, &d| acc * 10 + u64::from(d - b'0')) as f64,
        );
    }
    let x: f64 = std::str::from_utf8(word).ok()?.parse().ok()?;
    (x.is_finite() && x >= 0.0).then_some(x)
}

/// The asks' costs as acquire.lua reads them (ARGV[11]): empty when every one is 1.
fn costs(asks: &[Ask]) -> String {
    if asks.iter().all(|a| a.cost == 1.0) {
        return String::new();
    }
    let words: Vec<String> = asks.iter().map(|a| (a.cost as u64).to_string()).collect();
    words.join(" ")
}

/// Splits view.lua's last field, each window's use (`"<used>:<ahead> ..."`), off its
/// answer.
fn window_uses(
    v: Value,
    ask: &Ask,
) -> Result<(Value, [WindowUse; window::MAX_WINDOWS]), StoreError> {
    let Value::Array(mut items) = v else {
        return Ok((v, Default::default()));
    };
    let last = match items.pop() {
        Some(Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
        Some(Value::SimpleString(s)) => s,
        other => {
            return Err(StoreError::Protocol(format!(
                "unexpected window uses {other:?}"
            )));
        }
    };
    let mut uses = Vec::new();
    for (w, word) in ask.windows.as_slice().iter().zip(last.split_whitespace()) {
        let (used, ahead) = word.split_once(':').unwrap_or((word, "0"));
        uses.push(WindowUse {
            window: *w,
            used: used.parse().unwrap_or(0.0),
            ahead: ahead.parse().unwrap_or(0.0),
        });
    }
    Ok((Value::Array(items), bucket::window_uses(&uses)))
}

fn fields(v: Value, n: usize) -> Result<Vec<f64>, StoreError> {
    match v {
        Value::Array(items) if items.len() == n => items.iter().map(num).collect(),
        other => Err(StoreError::Protocol(format!(
            "unexpected script reply {other:?}"
        ))),
    }
}

impl BucketStore for RedisStore {
    fn acquire<'a>(&'a self, endpoint: &'a str, ask: Ask) -> StoreFuture<'a, Outcome> {
        Box::pin(batch::acquire(&self.calls, &self.lanes, endpoint, ask))
    }

    fn release<'a>(&'a self, endpoint: &'a str, ask: Ask, unused: Unused) -> StoreFuture<'a, ()> {
        Box::pin(async move { self.calls.release(endpoint, &ask, unused).await })
    }

    fn feedback<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        adaptive: Adaptive,
        pause: Duration,
        throttled: bool,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            if throttled {
                self.lanes.throttled(endpoint);
            }
            let mut inv =
                self.calls
                    .invocation(&self.calls.scripts.feedback, endpoint, None, &ask, 6);
            inv.arg(adaptive.floor)
                .arg(adaptive.decrease)
                .arg(micros(adaptive.default_cooldown))
                .arg(micros(pause))
                .arg(u8::from(throttled))
                .arg(&self.channel);
            self.calls.run::<Value>(inv).await.map(drop)
        })
    }

    fn cap<'a>(&'a self, endpoint: &'a str, ask: Ask, most: f64) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let mut inv = self
                .calls
                .invocation(&self.calls.scripts.cap, endpoint, None, &ask, 1);
            inv.arg(Num(most));
            self.calls.run::<Value>(inv).await.map(drop)
        })
    }

    fn view<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        floor: Option<f64>,
    ) -> StoreFuture<'a, Option<View>> {
        Box::pin(async move {
            let mut inv = self
                .calls
                .invocation(&self.calls.scripts.view, endpoint, None, &ask, 2);
            match floor {
                Some(f) => inv.arg(f),
                None => inv.arg(""),
            };
            inv.arg(ask.windows.spec());
            let v: Value = self.calls.run(inv).await?;
            if matches!(v, Value::Nil) {
                return Ok(None);
            }
            let (v, uses) = window_uses(v, &ask)?;
            let f = fields(v, 7)?;
            Ok(Some(View {
                tokens: f[0],
                rate: f[1],
                cooldown_us: f[2],
                throttles: f[3] as u64,
                at_floor: f[4] == 1.0,
                floor_for_us: f[5],
                held_ahead: f[6],
                windows: uses,
            }))
        })
    }

    fn needs_confirm(&self, endpoint: &str, since: tokio::time::Instant) -> bool {
        self.watch
            .as_ref()
            .is_none_or(|w| !w.quiet_since(&self.key(endpoint), since))
    }

    fn cooling_heard(&self, endpoint: &str) -> Option<tokio::time::Instant> {
        self.watch.as_ref()?.cooling_until(&self.key(endpoint))
    }

    fn acquire_leased<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, Leased> {
        Box::pin(async move {
            let leases = self.leases_key(endpoint);
            let mut inv =
                self.calls
                    .invocation(&self.calls.scripts.lease, endpoint, Some(&leases), &ask, 8);
            let (busy_us, writes) = self.calls.busy.known(endpoint, Instant::now());
            inv.arg(Num::whole_micros(ask.budget_us))
                .arg(lease.max)
                .arg(lease.ttl_us)
                .arg(self.member(lease.id))
                .arg(Num::whole_micros(busy_us))
                .arg(writes)
                .arg(ask.windows.spec())
                .arg(ask.cost as u64);
            let f = fields(self.calls.run(inv).await?, 8)?;
            if f[4] >= 0.0 {
                self.calls
                    .busy
                    .heard(endpoint, Instant::now(), f[4], f[5] as u64);
            }
            if f[7] == 1.0 {
                self.calls.rebuilt(endpoint, f[4]);
            }
            let generation = f[2] as u64;
            Ok(match f[0] as u8 {
                1 => Leased::Took(Outcome::Granted {
                    wait_us: f[1],
                    generation,
                    at_us: Some(f[6]),
                }),
                2 => Leased::Busy { retry_us: f[1] },
                _ => Leased::Took(Outcome::Refused {
                    cooldown: f[3] == 1.0,
                    retry_us: f[1],
                }),
            })
        })
    }

    fn renew_lease<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let leases = self.leases_key(endpoint);
            let mut inv =
                self.calls
                    .invocation(&self.calls.scripts.renew, endpoint, Some(&leases), &ask, 3);
            inv.arg(lease.ttl_us).arg(self.member(lease.id)).arg(0);
            Ok(num(&self.calls.run::<Value>(inv).await?)? == 1.0)
        })
    }

    fn adopt_lease<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        lease: LeaseAsk,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let leases = self.leases_key(endpoint);
            let mut inv =
                self.calls
                    .invocation(&self.calls.scripts.renew, endpoint, Some(&leases), &ask, 3);
            inv.arg(lease.ttl_us).arg(self.member(lease.id)).arg(1);
            num(&self.calls.run::<Value>(inv).await?).map(drop)
        })
    }

    fn release_lease<'a>(&'a self, endpoint: &'a str, _ask: Ask, id: u64) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let mut cmd = redis::cmd("ZREM");
            cmd.arg(self.leases_key(endpoint)).arg(self.member(id));
            self.calls.command(cmd).await
        })
    }

    fn ping(&self) -> StoreFuture<'_, ()> {
        Box::pin(self.calls.command(redis::cmd("PING")))
    }

    fn register(&self) -> StoreFuture<'_, Option<usize>> {
        Box::pin(async move { self.heartbeat(HEARTBEAT_TTL).await.map(Some) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::ToRedisArgs;

    /// The one-string answer of `acquire.lua`: every kind of word, Lua's exponent
    /// form, a grant's start on the store's clock, a rebuild, and malformed answers
    /// refused.
    #[test]
    fn acquire_answers_are_read_in_order_and_checked() {
        let v = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let d = decisions(
            &v("7 3 95012345678901 2500000 42 95012345678999 1 G G1500 R20 C1e+15"),
            4,
        )
        .unwrap();
        assert_eq!(d.generation, 7);
        assert_eq!(d.ahead, 3.0);
        assert_eq!(d.hold, 95_012_345_678_901);
        assert_eq!(d.busy, (2_500_000.0, 42));
        assert!(d.rebuilt);
        assert_eq!(
            d.outcomes,
            vec![
                Outcome::Granted {
                    wait_us: 0.0,
                    generation: 7,
                    at_us: Some(95_012_345_678_999.0),
                },
                Outcome::Granted {
                    wait_us: 1500.0,
                    generation: 7,
                    at_us: Some(95_012_345_680_499.0),
                },
                Outcome::Refused {
                    cooldown: false,
                    retry_us: 20.0
                },
                Outcome::Refused {
                    cooldown: true,
                    retry_us: 1e15
                },
            ]
        );
        for bad in [
            "7 0 0 0 1 9 0 G",
            "7 0 0 0 1 9 0 G G G",
            "7 0 0 0 1 9 0 X1 G",
            "7 0 0 0 1 9 0 R G",
            "7 0 0 0 1 9 0 G  G",
            "7 0 0 0 1 9 0 G -5",
            "7 0 0 0 1 9 0 Gx G",
            "x 0 0 0 1 9 0 G G",
            "7 0 0 0 1 0 G G",
            "7 0 0 0 1 x 0 G G",
            "7 0 0 0 1 9 2 G G",
            "7 0 0 0 1 9 G G",
            "7 0 0 -1 1 9 0 G G",
            "7",
            "",
        ] {
            assert!(decisions(&v(bad), 2).is_err(), "{bad:?} accepted");
        }
        assert!(decisions(&Value::Array(vec![Value::Int(1)]), 1).is_err());
        // A top-up (no asks): the generation, the tokens ahead, their hold, how long the
        // bucket stays busy, the key's write count, the store's time and no rebuild,
        // nothing else.
        assert_eq!(
            decisions(&v("9 40 12 300 5 77 0 "), 0).unwrap(),
            Decisions {
                outcomes: Vec::new(),
                ahead: 40.0,
                generation: 9,
                hold: 12,
                busy: (300.0, 5),
                rebuilt: false,
            }
        );
        assert!(decisions(&v("9 40 12 300 5 77 0 G"), 0).is_err());
        // A store whose clock is before its epoch: a negative time, a start after it.
        let d = decisions(&v("1 0 0 0 1 -5000 0 G2000"), 1).unwrap();
        assert_eq!(
            d.outcomes,
            [Outcome::Granted {
                wait_us: 2000.0,
                generation: 1,
                at_us: Some(-3000.0),
            }]
        );
        assert!(decisions(&v("1 0 0 0 1 --5 0 G"), 1).is_err());
    }

    /// What a replica sends of a bucket: what it heard while that lasts, nothing once
    /// it is over; and a key made afresh after that (writes counted from 1 again) is
    /// heard again, where an older answer of a busy one is not.
    #[test]
    fn a_bucket_heard_busy_is_known_until_then_and_a_key_made_afresh_is_heard_again() {
        let busy = Busy::default();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(busy.known("e", t0), (0.0, 0));
        busy.heard("e", t0, 500_000.0, 7);
        assert_eq!(busy.known("e", t0 + ms(100)), (400_000.0, 7));
        // An older answer (a lower count) while it lasts changes nothing.
        busy.heard("e", t0 + ms(100), 100_000.0, 6);
        assert_eq!(busy.known("e", t0 + ms(200)), (300_000.0, 7));
        // Over: nothing known, so a key that expired is no loss to rebuild.
        assert_eq!(busy.known("e", t0 + ms(500)), (0.0, 0));
        // The key, made afresh, counts from 1: heard.
        busy.heard("e", t0 + ms(600), 200_000.0, 1);
        assert_eq!(busy.known("e", t0 + ms(700)), (100_000.0, 1));
    }

    /// `release.lua`'s answer: how long the bucket stays busy and its write count, or
    /// -1 (nothing given back); anything else refused.
    #[test]
    fn release_answers_are_read_and_checked() {
        let v = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        assert_eq!(release_answer(&v("1500000 7")).unwrap(), Some((1.5e6, 7)));
        assert_eq!(release_answer(&Value::Int(-1)).unwrap(), None);
        for bad in ["1500000", "1500000 7 8", "x 7", "-5 7", ""] {
            assert!(release_answer(&v(bad)).is_err(), "{bad:?} accepted");
        }
        assert!(release_answer(&Value::Int(1)).is_err());
    }

    /// Whole numbers go as integers, others keep every digit a float has.
    #[test]
    fn numbers_are_written_as_lua_reads_them() {
        let text = |n: Num| String::from_utf8(n.to_redis_args().remove(0)).unwrap();
        assert_eq!(text(Num(1_000_000_000.0)), "1000000000");
        assert_eq!(text(Num(5000.0)), "5000");
        assert_eq!(text(Num(0.0)), "0");
        assert_eq!(text(Num(-3.0)), "-3");
        assert_eq!(text(Num(0.5)), "0.5");
        // Beyond 2^53 a whole number is written as a float, read back exactly.
        assert_eq!(text(Num(2.5e20)).parse::<f64>().unwrap(), 2.5e20);
        assert_eq!(text(Num::whole_micros(29_999_871.9)), "29999871");
        for x in [0.1, 12.345, 1e-7, 123456.789] {
            assert_eq!(text(Num(x)).parse::<f64>().unwrap(), x);
        }
    }

    #[test]
    fn every_script_opens_with_the_shared_prelude_and_its_contract() {
        for (name, lua) in [
            ("acquire", ACQUIRE_LUA),
            ("release", RELEASE_LUA),
            ("feedback", FEEDBACK_LUA),
            ("view", VIEW_LUA),
            ("lease", LEASE_LUA),
            ("renew", RENEW_LUA),
            ("cap", CAP_LUA),
        ] {
            assert!(lua.starts_with("-- sluice bucket prelude"), "{name}");
            assert!(lua.contains(&format!("-- {name}:")), "{name}");
            assert!(lua.contains("KEYS[1]") && lua.contains("Returns"), "{name}");
        }
        // View is read-only.
        let view_body = VIEW_LUA.split("-- view:").nth(1).unwrap_or_default();
        assert!(!view_body.contains("save("));
    }

    #[test]
    fn timeouts_are_classified_as_timeouts() {
        let io = std::io::Error::new(std::io::ErrorKind::TimedOut, "t");
        let e = classify(RedisError::from(io), Duration::from_millis(7));
        assert!(matches!(e, StoreError::Timeout(d) if d == Duration::from_millis(7)));
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "r");
        assert!(matches!(
            classify(RedisError::from(refused), Duration::ZERO),
            StoreError::Unreachable(_)
        ));
    }
}
