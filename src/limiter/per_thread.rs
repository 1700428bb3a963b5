//! One multiplexed Redis connection per thread that calls the store (single-node
//! backend).
//!
//! A connection's reader and writer run as a task on the runtime that opened it. Shared
//! by every worker, that task would sit on one thread, and each script call would cross
//! threads twice (the request's worker wakes the connection's thread to send, the reply
//! wakes the worker back). Opened by each worker for itself, a worker's calls and their
//! replies stay on its own thread: the reply is one more socket in the worker's own
//! event loop. Each connection still pipelines every concurrent call of its thread.
//!
//! A connection failure seen on any thread retires every thread's connection: after an
//! outage (or a restart of Redis) each thread's next call opens a fresh connection
//! instead of first failing on its stale one, which would tell the fallback the store
//! is still down.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::ThreadId;

use redis::RedisError;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::redis::connection_lost;

/// A [`ConnectionManager`] per calling thread, opened lazily on that thread (so its
/// task runs there) and reconnecting on its own like any manager.
pub(super) struct PerThread {
    client: redis::Client,
    config: ConnectionManagerConfig,
    /// Bumped by every connection failure; connections opened before it are replaced.
    generation: AtomicU64,
    conns: Mutex<HashMap<ThreadId, (u64, ConnectionManager)>>,
}

impl PerThread {
    /// Connections to `client`'s server, none opened yet.
    pub(super) fn new(client: redis::Client, config: ConnectionManagerConfig) -> PerThread {
        PerThread {
            client,
            config,
            generation: AtomicU64::new(0),
            conns: Mutex::default(),
        }
    }

    /// The calling thread's connection (a cheap handle). Must be called on a tokio
    /// runtime: a new connection's task is spawned on it.
    pub(super) fn get(&self) -> Result<ConnectionManager, RedisError> {
        let id = std::thread::current().id();
        let generation = self.generation.load(Ordering::Acquire);
        let mut conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((g, c)) = conns.get(&id) {
            if *g == generation {
                return Ok(c.clone());
            }
        }
        let c = ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone())?;
        conns.insert(id, (generation, c.clone()));
        Ok(c)
    }

    /// Notes a call's result: a failure of the connection itself retires every
    /// thread's connection.
    pub(super) fn saw<T>(&self, result: &Result<T, RedisError>) {
        if matches!(result, Err(e) if connection_lost(e)) {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }
}
