//! Redis behind Sentinel: which master to talk to, and following it through failovers.
//!
//! The master is looked up through the sentinels (redis-rs' [`Sentinel`], which asks each
//! sentinel in turn and checks with `ROLE` that the address it got really is a master),
//! then used through a multiplexed [`ConnectionManager`] like a single Redis. When a call
//! to it fails as unreachable, times out, or answers `READONLY` (it was demoted), a
//! background task looks the master up again; the failing call itself returns at once, so
//! the `on_error` fallback serves meanwhile and the next call (the fallback's probe) uses
//! the new master. Lookups run in their own task so a caller's timeout never cancels one
//! half-way, and at most one runs at a time.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use redis::{ErrorKind, RedisError, ServerErrorKind, TlsMode};

use super::redis::tcp_settings;

/// The master in use and its address (`host:port`).
struct Master {
    addr: String,
    conn: ConnectionManager,
}

/// A connection that follows the master a set of sentinels names.
pub(crate) struct SentinelConn {
    sentinel: tokio::sync::Mutex<Sentinel>,
    name: String,
    node: SentinelNodeConnectionInfo,
    config: ConnectionManagerConfig,
    lookup_timeout: Duration,
    master: ArcSwapOption<Master>,
    looking: AtomicBool,
}

impl SentinelConn {
    /// Sentinels at `urls` (their user/password, if any, is used for the master too;
    /// `rediss://` sentinels mean a TLS master), master `name`.
    pub(crate) fn new(
        urls: &[String],
        name: &str,
        config: ConnectionManagerConfig,
        lookup_timeout: Duration,
    ) -> Result<SentinelConn, RedisError> {
        let infos = urls
            .iter()
            .map(|u| redis::IntoConnectionInfo::into_connection_info(u.as_str()))
            .collect::<Result<Vec<_>, _>>()?;
        let mut node = SentinelNodeConnectionInfo::default().set_tcp_settings(tcp_settings());
        if let Some(first) = infos.first() {
            node = node.set_redis_connection_info(first.redis_settings().clone());
            if matches!(first.addr(), redis::ConnectionAddr::TcpTls { .. }) {
                node = node.set_tls_mode(TlsMode::Secure);
            }
        }
        Ok(SentinelConn {
            sentinel: tokio::sync::Mutex::new(Sentinel::build(infos)?),
            name: name.to_owned(),
            node,
            config,
            lookup_timeout,
            master: ArcSwapOption::empty(),
            looking: AtomicBool::new(false),
        })
    }

    /// The current master's connection; the first call looks it up.
    pub(crate) async fn conn(self: &Arc<Self>) -> Result<(ConnectionManager, String), RedisError> {
        if let Some(m) = self.master.load_full() {
            return Ok((m.conn.clone(), m.addr.clone()));
        }
        match self.look_up().await {
            Some(r) => r,
            None => Err(no_master("a lookup is already running")),
        }
    }

    /// After a failed call to `addr`: when the error says the master may have moved, start
    /// a background lookup (unless one is running).
    pub(crate) fn failed(self: &Arc<Self>, addr: &str, e: &RedisError) {
        let moved = e.is_io_error()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || e.is_timeout()
            || e.is_unrecoverable_error()
            || e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly);
        let current = self.master.load();
        if moved && current.as_ref().is_some_and(|m| m.addr == addr) {
            let this = Arc::clone(self);
            tokio::spawn(async move { this.look_up().await });
        }
    }

    /// Runs one lookup in its own task (so a caller's timeout cannot cancel it) and
    /// installs a new master when the address changed. `None` when one already runs.
    async fn look_up(self: &Arc<Self>) -> Option<Result<(ConnectionManager, String), RedisError>> {
        if self.looking.swap(true, Ordering::AcqRel) {
            return None;
        }
        let this = Arc::clone(self);
        let task = tokio::spawn(async move {
            let r = this.resolve().await;
            this.looking.store(false, Ordering::Release);
            r
        });
        Some(
            task.await
                .unwrap_or_else(|e| Err(no_master(&format!("lookup task failed: {e}")))),
        )
    }

    async fn resolve(&self) -> Result<(ConnectionManager, String), RedisError> {
        let mut sentinel = self.sentinel.lock().await;
        let client = tokio::time::timeout(
            self.lookup_timeout,
            sentinel.async_master_for(&self.name, Some(&self.node)),
        )
        .await
        .map_err(|_| no_master("the sentinels did not answer in time"))??;
        let addr = client.get_connection_info().addr().to_string();
        if let Some(m) = self.master.load_full() {
            if m.addr == addr {
                return Ok((m.conn.clone(), addr));
            }
        }
        let conn = ConnectionManager::new_lazy_with_config(client, self.config.clone())?;
        match self.master.load_full() {
            Some(old) => tracing::warn!(
                master = %self.name, from = %old.addr, to = %addr,
                "Redis Sentinel failover: following the new master"
            ),
            None => tracing::info!(master = %self.name, %addr, "Redis Sentinel: master found"),
        }
        self.master.store(Some(Arc::new(Master {
            addr: addr.clone(),
            conn: conn.clone(),
        })));
        Ok((conn, addr))
    }
}

fn no_master(why: &str) -> RedisError {
    RedisError::from((
        ErrorKind::Io,
        "no Redis master known through the sentinels",
        why.to_owned(),
    ))
}
