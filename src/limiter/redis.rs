//! The Redis / Redis Cluster bucket store: one `EVALSHA` of `lua/bucket.lua` per decision.
//!
//! Single node: a multiplexed [`ConnectionManager`] (concurrent requests pipeline on one
//! socket; it reconnects with backoff on its own). Cluster: the async cluster connection,
//! which follows MOVED/ASK and failovers. The script's SHA is computed once at start-up;
//! a NOSCRIPT answer (restarted or flushed Redis) reloads it and retries once. Every call
//! is bounded by `store.timeout`, and errors are classified once, in [`classify`].

use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Script, Value};

use super::bucket::{Ask, Outcome, View};
use super::{BucketStore, StoreError, StoreFuture, StoreStats};
use crate::config::{Adaptive, Backend, StoreConfig, redact};

/// The bucket script, compiled in.
const BUCKET_LUA: &str = include_str!("../../lua/bucket.lua");

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// Buckets shared by every replica through Redis.
pub struct RedisStore {
    conn: Conn,
    script: Script,
    prefix: String,
    timeout: Duration,
    stats: StoreStats,
}

/// Decides once whether a Redis error is the store being unreachable or answering badly.
fn classify(e: RedisError) -> StoreError {
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() || e.is_timeout() {
        StoreError::Unreachable(e.to_string())
    } else if e.is_cluster_error() {
        StoreError::Unreachable(format!("cluster: {e}"))
    } else {
        StoreError::Protocol(e.to_string())
    }
}

impl RedisStore {
    /// Connects to a single Redis (lazily: it may come up later) or a Redis Cluster.
    pub async fn connect(cfg: &StoreConfig, stats: StoreStats) -> Result<RedisStore, StoreError> {
        let conn = match cfg.backend {
            Backend::RedisCluster => {
                let client = redis::cluster::ClusterClientBuilder::new(cfg.urls.clone())
                    .connection_timeout(cfg.timeout.max(Duration::from_millis(250)))
                    .response_timeout(cfg.timeout)
                    .retries(2)
                    .build()
                    .map_err(|e| StoreError::Protocol(format!("bad cluster URLs: {e}")))?;
                let conn = client.get_async_connection().await.map_err(|e| {
                    StoreError::Unreachable(format!(
                        "cluster seeds {:?}: {e}",
                        cfg.urls.iter().map(|u| redact(u)).collect::<Vec<_>>()
                    ))
                })?;
                Conn::Cluster(conn)
            }
            _ => {
                let url = cfg.urls.first().cloned().unwrap_or_default();
                let client = redis::Client::open(url.as_str()).map_err(|e| {
                    StoreError::Protocol(format!("bad Redis URL {}: {e}", redact(&url)))
                })?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(cfg.timeout.max(Duration::from_millis(250))))
                    .set_response_timeout(Some(cfg.timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_secs(1));
                let manager =
                    ConnectionManager::new_lazy_with_config(client, config).map_err(classify)?;
                Conn::Single(manager)
            }
        };
        Ok(RedisStore {
            conn,
            script: Script::new(BUCKET_LUA),
            prefix: cfg.key_prefix.clone(),
            timeout: cfg.timeout,
            stats,
        })
    }

    /// The key of an endpoint: `<prefix>{<endpoint>}`, one cluster slot per endpoint.
    pub fn key(&self, endpoint: &str) -> String {
        format!("{}{{{}}}", self.prefix, endpoint)
    }

    /// Runs the script with `args` on the endpoint's key, bounded by the timeout.
    async fn call(
        &self,
        endpoint: &str,
        args: impl FnOnce(&mut redis::ScriptInvocation<'_>),
    ) -> Result<Value, StoreError> {
        let mut inv = self.script.key(self.key(endpoint));
        args(&mut inv);
        let started = Instant::now();
        let fut = async {
            match self.conn.clone() {
                Conn::Single(mut c) => inv.invoke_async::<Value>(&mut c).await,
                Conn::Cluster(mut c) => inv.invoke_async::<Value>(&mut c).await,
            }
        };
        let result = match tokio::time::timeout(self.timeout, fut).await {
            Err(_) => Err(StoreError::Timeout(self.timeout)),
            Ok(r) => r.map_err(classify),
        };
        self.stats.seconds.observe(started.elapsed().as_secs_f64());
        if result.is_err() {
            self.stats.errors.inc();
        }
        result
    }
}

fn num(v: &Value) -> Result<f64, StoreError> {
    match v {
        Value::Int(i) => Ok(*i as f64),
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| StoreError::Protocol(format!("not a number: {b:?}"))),
        Value::SimpleString(s) => s
            .parse()
            .map_err(|_| StoreError::Protocol(format!("not a number: {s}"))),
        other => Err(StoreError::Protocol(format!("unexpected reply {other:?}"))),
    }
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
        Box::pin(async move {
            let held = ask.held.map(|g| g.to_string()).unwrap_or_default();
            let v = self
                .call(endpoint, |i| {
                    i.arg("acquire")
                        .arg(ask.rate)
                        .arg(ask.burst)
                        .arg(ask.recovery_us)
                        .arg(ask.budget_us)
                        .arg(held);
                })
                .await?;
            let f = fields(v, 3)?;
            Ok(if f[0] == 1.0 {
                Outcome::Granted {
                    wait_us: f[1],
                    generation: f[2] as u64,
                }
            } else {
                Outcome::Refused {
                    cooldown: f[2] == 1.0,
                    retry_us: f[1],
                }
            })
        })
    }

    fn release<'a>(&'a self, endpoint: &'a str, ask: Ask, generation: u64) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.call(endpoint, |i| {
                i.arg("release")
                    .arg(ask.rate)
                    .arg(ask.burst)
                    .arg(ask.recovery_us)
                    .arg(generation);
            })
            .await
            .map(drop)
        })
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
            let micros = |d: Duration| d.as_secs_f64() * 1e6;
            self.call(endpoint, |i| {
                i.arg("feedback")
                    .arg(ask.rate)
                    .arg(ask.burst)
                    .arg(ask.recovery_us)
                    .arg(adaptive.floor)
                    .arg(adaptive.decrease)
                    .arg(micros(adaptive.default_cooldown))
                    .arg(micros(pause))
                    .arg(u8::from(throttled));
            })
            .await
            .map(drop)
        })
    }

    fn view<'a>(
        &'a self,
        endpoint: &'a str,
        ask: Ask,
        floor: Option<f64>,
    ) -> StoreFuture<'a, Option<View>> {
        Box::pin(async move {
            let floor = floor.map(|f| f.to_string()).unwrap_or_default();
            let v = self
                .call(endpoint, |i| {
                    i.arg("view")
                        .arg(ask.rate)
                        .arg(ask.burst)
                        .arg(ask.recovery_us)
                        .arg(floor);
                })
                .await?;
            if matches!(v, Value::Nil) {
                return Ok(None);
            }
            let f = fields(v, 6)?;
            Ok(Some(View {
                tokens: f[0],
                rate: f[1],
                cooldown_us: f[2],
                throttles: f[3] as u64,
                at_floor: f[4] == 1.0,
                floor_for_us: f[5],
            }))
        })
    }

    fn ping(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            let fut = async {
                match self.conn.clone() {
                    Conn::Single(mut c) => redis::cmd("PING").query_async::<String>(&mut c).await,
                    Conn::Cluster(mut c) => redis::cmd("PING").query_async::<String>(&mut c).await,
                }
            };
            match tokio::time::timeout(self.timeout, fut).await {
                Err(_) => Err(StoreError::Timeout(self.timeout)),
                Ok(r) => r.map(drop).map_err(classify),
            }
        })
    }
}
