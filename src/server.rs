//! The listeners: the proxy's and the admin's accept loops, each with its own connection
//! cap and timeouts, and graceful shutdown with a bounded grace period.
//!
//! Every connection (and every tunnel) runs under the [`crate::conn::Lifecycle`]
//! tracker; on shutdown the accept loops stop, each HTTP connection is told to finish
//! its in-flight request and close, and [`run`] returns once all are done or the grace
//! period ends.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Version;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};

use crate::conn::{ConnSlot, Timeouts, Writes, serve, until_down};
use crate::core::App;
use crate::proxy::Conn;
use crate::workers::Workers;

/// Admin connections are short-lived: a probe or scraper sends its request at once, and
/// one that says nothing for this long is closed, so idle sockets cannot crowd probes out.
const ADMIN_TIMEOUTS: Timeouts = Timeouts {
    header_read: Duration::from_secs(5),
    idle: Duration::from_secs(5),
};

/// Runs the proxy and admin listeners until `shutdown` resolves, then drains within
/// `proxy.shutdown_grace`.
///
/// With `workers`, each sender connection is served on one of them; without, on the
/// caller's runtime.
pub async fn run(
    app: Arc<App>,
    proxy: TcpListener,
    admin: TcpListener,
    workers: Option<Arc<Workers>>,
    shutdown: impl Future<Output = ()>,
) {
    let cfg = app.runtime.load_full().config.clone();
    let stop = app.lifecycle.signal();
    // The workers run the connections being drained: they stop only once the drain
    // is over (the accept loop's handle goes when it does).
    let _running = workers.clone();
    // Caps the descriptor limit can hold, so the admin listener keeps some for probes.
    let budget = crate::fds::fit(cfg.proxy.max_connections);
    let accept_proxy = accept_proxy(&app, proxy, budget.max_connections, workers, stop.clone());
    let accept_admin = accept_admin(&app, admin, budget.admin_connections, stop);
    let accepting = async { tokio::join!(accept_proxy, accept_admin) };
    tokio::select! {
        // Accept loops end only when the shutdown signal fires elsewhere.
        _ = accepting => {}
        // Our caller asked us to stop.
        _ = shutdown => {}
    }
    tracing::info!(
        grace_ms = cfg.proxy.shutdown_grace.as_millis() as u64,
        "shutting down: draining connections"
    );
    if app.lifecycle.shutdown(cfg.proxy.shutdown_grace).await {
        tracing::info!("all connections drained");
    } else {
        tracing::warn!("grace period over: closing remaining connections");
    }
}

/// The proxy listener: `max_connections` senders at once (tunnels included; the
/// configured `proxy.max_connections` unless the descriptor limit is short), each
/// served until idle for `proxy.idle_timeout`.
async fn accept_proxy(
    app: &Arc<App>,
    listener: TcpListener,
    max_connections: usize,
    workers: Option<Arc<Workers>>,
    stop: watch::Receiver<bool>,
) {
    let cfg = app.runtime.load_full().config.clone();
    let memory_cap = crate::budget::connection_cap();
    if memory_cap < max_connections {
        tracing::warn!(
            max_connections,
            serving = memory_cap,
            "proxy.max_memory allows fewer sender connections than proxy.max_connections: \
             serving at most that many at once, the rest wait in the backlog"
        );
    }
    let limit = Arc::new(Semaphore::new(max_connections.min(memory_cap)));
    let timeouts = Timeouts {
        header_read: cfg.proxy.header_read_timeout,
        idle: cfg.proxy.idle_timeout,
    };
    let open = app.metrics.connections.clone();
    let lane = crate::lane::enabled();
    if !lane {
        tracing::info!("SLUICE_PLAIN_LANE=0: every sender connection is served by hyper");
    }
    accept_loop(
        app,
        listener,
        limit,
        open,
        workers,
        stop,
        move |app, stream, slot| {
            let peer = stream
                .peer_addr()
                .unwrap_or_else(|_| ([0, 0, 0, 0], 0).into());
            let conn = Arc::new(Conn {
                peer,
                slot,
                tunnel: None,
                upstream: Default::default(),
                endpoint: Default::default(),
                target: Default::default(),
                prepaid: Default::default(),
            });
            let signal = app.lifecycle.signal();
            crate::engine::serve(app, stream, conn, timeouts, signal, lane)
        },
    )
    .await
}

/// The admin listener: its own cap and short timeouts, so probes are always answered.
/// `max_connections` of them at once ([`crate::fds::ADMIN_MAX_CONNECTIONS`] unless the
/// descriptor limit is short). At the cap a new connection is not left in the backlog
/// behind idle sockets: the oldest admin connection gives its place up (gracefully: an
/// answer under way is finished first), so a probe is answered however many sockets
/// sit open.
async fn accept_admin(
    app: &Arc<App>,
    listener: TcpListener,
    max_connections: usize,
    mut stop: watch::Receiver<bool>,
) {
    let limit = Arc::new(Semaphore::new(max_connections));
    let open = Arc::new(AdminConns::default());
    loop {
        let stream = tokio::select! {
            s = accept(&listener) => match s { Some(s) => s, None => continue },
            _ = until_down(&mut stop) => return,
        };
        let permit = match Arc::clone(&limit).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                open.close_oldest();
                let waiting = Arc::clone(&limit).acquire_owned();
                match tokio::time::timeout(ADMIN_TIMEOUTS.idle, waiting).await {
                    Ok(Ok(p)) => p,
                    _ => continue,
                }
            }
        };
        let _ = stream.set_nodelay(true);
        let slot = ConnSlot::new(permit, Gauge::default());
        let (id, closing) = open.enter();
        let app = Arc::clone(app);
        let open = Arc::clone(&open);
        app.lifecycle.clone().spawn(Box::pin(async move {
            // The admin connection holds its place until it ends.
            let _slot = slot;
            let mut life = app.lifecycle.signal();
            let own = closing.subscribe();
            let a = Arc::clone(&app);
            let svc = service_fn(move |req| {
                let a = Arc::clone(&a);
                async move { Ok::<_, Infallible>(crate::admin::handle(a, req).await) }
            });
            let io = TokioIo::new(stream);
            let serving = serve(
                Bytes::new(),
                io,
                svc,
                Version::HTTP_11,
                ADMIN_TIMEOUTS,
                Writes::Flat,
                own,
            );
            tokio::pin!(serving);
            // Shutdown reaches the connection through its own signal too.
            tokio::select! {
                () = &mut serving => {}
                _ = until_down(&mut life) => {
                    let _ = closing.send(true);
                    serving.await;
                }
            }
            open.leave(id);
        }));
    }
}

/// The next connection, or `None` after a failed accept (EMFILE and friends), backing
/// off instead of spinning.
async fn accept(listener: &TcpListener) -> Option<TcpStream> {
    match listener.accept().await {
        Ok((s, _)) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "accept failed");
            tokio::time::sleep(Duration::from_millis(50)).await;
            None
        }
    }
}

/// The open admin connections, oldest first, each with the signal that asks it to close.
#[derive(Default)]
struct AdminConns {
    next: std::sync::atomic::AtomicU64,
    open: std::sync::Mutex<std::collections::BTreeMap<u64, Arc<watch::Sender<bool>>>>,
}

impl AdminConns {
    /// A new connection: its id and its closing signal.
    fn enter(&self) -> (u64, Arc<watch::Sender<bool>>) {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, _) = watch::channel(false);
        let tx = Arc::new(tx);
        self.lock().insert(id, Arc::clone(&tx));
        (id, tx)
    }

    fn leave(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// Asks the oldest connection to close.
    fn close_oldest(&self) {
        if let Some((_, tx)) = self.lock().pop_first() {
            let _ = tx.send(true);
        }
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<u64, Arc<watch::Sender<bool>>>> {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Accepts connections while a place under `limit` is free (at the cap, new ones wait
/// in the backlog), and runs `serve_one` for each as a tracked task: on the next of
/// `workers`, or here.
async fn accept_loop<F, Fut>(
    app: &Arc<App>,
    listener: TcpListener,
    limit: Arc<Semaphore>,
    open: Gauge,
    workers: Option<Arc<Workers>>,
    mut stop: watch::Receiver<bool>,
    serve_one: F,
) where
    F: Fn(Arc<App>, TcpStream, Arc<ConnSlot>) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    loop {
        // Hold a permit before accepting: at the cap, new connections wait in the backlog.
        let permit = tokio::select! {
            p = Arc::clone(&limit).acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            _ = until_down(&mut stop) => return,
        };
        // Under memory pressure, new connections wait in the backlog too.
        tokio::select! {
            () = crate::budget::until_accepting(&open) => {}
            _ = until_down(&mut stop) => return,
        }
        let stream = tokio::select! {
            s = accept(&listener) => match s { Some(s) => s, None => continue },
            _ = until_down(&mut stop) => return,
        };
        let _ = stream.set_nodelay(true);
        let slot = ConnSlot::new(permit, open.clone());
        let Some(workers) = &workers else {
            app.lifecycle
                .spawn(Box::pin(serve_one(Arc::clone(app), stream, slot)));
            continue;
        };
        // The socket moves to the worker's own I/O driver, so its readiness wakes that
        // thread alone.
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot hand a connection to a worker");
                continue;
            }
        };
        let lifecycle = app.lifecycle.clone();
        let (app, serve_one) = (Arc::clone(app), serve_one.clone());
        let serve = async move {
            match TcpStream::from_std(stream) {
                // Boxed: a connection's future is kilobytes (the lane, hyper's
                // connection), and the task would copy it several times on its way in.
                Ok(stream) => Box::pin(serve_one(app, stream, slot)).await,
                Err(e) => tracing::warn!(error = %e, "cannot register a connection on a worker"),
            }
        };
        lifecycle.spawn_on(serve, workers.next());
    }
}
