//! Listeners and lifecycle: the accept loops (proxy and admin), the connection cap, and
//! graceful shutdown with a bounded grace period.
//!
//! Every connection (and every tunnel) runs under the [`Lifecycle`] tracker; on shutdown
//! the accept loops stop, each HTTP connection is told to finish its in-flight request
//! and close, and [`run`] returns once all are done or the grace period ends.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::Version;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::{HttpService, service_fn};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio_util::task::TaskTracker;

use crate::proxy::App;

/// Largest request head accepted; larger heads get 431.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// A sender must finish sending a request head within this.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Tracks connections and tunnels, and carries the shutdown signal.
#[derive(Clone)]
pub struct Lifecycle {
    tx: Arc<watch::Sender<bool>>,
    tracker: TaskTracker,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle::new()
    }
}

impl Lifecycle {
    /// A lifecycle with nothing running.
    pub fn new() -> Lifecycle {
        Lifecycle {
            tx: Arc::new(watch::channel(false).0),
            tracker: TaskTracker::new(),
        }
    }

    /// Runs `fut` as a tracked task (waited for on shutdown).
    pub fn spawn<F>(&self, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.tracker.spawn(fut);
    }

    /// A receiver that changes when shutdown begins.
    pub fn signal(&self) -> watch::Receiver<bool> {
        self.tx.subscribe()
    }

    /// Begins shutdown and waits up to `grace` for tracked tasks to end. True when all ended.
    pub async fn shutdown(&self, grace: Duration) -> bool {
        self.tx.send_replace(true);
        self.tracker.close();
        tokio::time::timeout(grace, self.tracker.wait())
            .await
            .is_ok()
    }
}

/// Resolves once shutdown has begun.
pub async fn until_down(rx: &mut watch::Receiver<bool>) {
    // Dropping the guard here keeps callers' futures Send.
    let _ = rx.wait_for(|down| *down).await;
}

/// Serves one connection until it closes or shutdown asks it to finish its in-flight
/// work: HTTP/1.1 (with CONNECT upgrades) for `Version::HTTP_11`, HTTP/2 for
/// `Version::HTTP_2` (an intercepted tunnel whose sender chose `h2` by ALPN).
pub async fn serve<I, S>(io: I, svc: S, protocol: Version, mut shutdown: watch::Receiver<bool>)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: HttpService<Incoming> + Send,
    S::Future: Send + 'static,
    S::ResBody: Send + 'static,
    <S::ResBody as hyper::body::Body>::Data: Send,
    <S::ResBody as hyper::body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if protocol == Version::HTTP_2 {
        let conn = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_header_list_size(MAX_HEAD_BYTES as u32)
            .serve_connection(io, svc);
        drive(conn, |c| c.graceful_shutdown(), &mut shutdown).await;
    } else {
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .max_buf_size(MAX_HEAD_BYTES)
            .keep_alive(true)
            .serve_connection(io, svc)
            .with_upgrades();
        drive(conn, |c| c.graceful_shutdown(), &mut shutdown).await;
    }
}

/// Runs a served connection until it ends on its own (sender closed, error) or shutdown
/// begins; then `graceful` asks it to finish its in-flight work, and it is awaited.
async fn drive<C: Future<Output = Result<(), hyper::Error>>>(
    conn: C,
    graceful: impl FnOnce(std::pin::Pin<&mut C>),
    shutdown: &mut watch::Receiver<bool>,
) {
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        _ = until_down(shutdown) => {
            graceful(conn.as_mut());
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

/// Runs the proxy and admin listeners until `shutdown` resolves, then drains within
/// `proxy.shutdown_grace`.
pub async fn run(
    app: Arc<App>,
    proxy: TcpListener,
    admin: TcpListener,
    shutdown: impl Future<Output = ()>,
) {
    let cfg = app.runtime.load_full().config.clone();
    let limit = Arc::new(Semaphore::new(cfg.proxy.max_connections));
    let stop = app.lifecycle.signal();
    let accept_proxy = accept_loop(Arc::clone(&app), proxy, limit, stop.clone(), Role::Proxy);
    let accept_admin = accept_loop(
        Arc::clone(&app),
        admin,
        Arc::new(Semaphore::new(256)),
        stop,
        Role::Admin,
    );
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

#[derive(Clone, Copy)]
enum Role {
    Proxy,
    Admin,
}

async fn accept_loop(
    app: Arc<App>,
    listener: TcpListener,
    limit: Arc<Semaphore>,
    mut stop: watch::Receiver<bool>,
    role: Role,
) {
    loop {
        // Hold a permit before accepting: at the cap, new connections wait in the backlog.
        let permit = tokio::select! {
            p = Arc::clone(&limit).acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            _ = until_down(&mut stop) => return,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = until_down(&mut stop) => return,
        };
        let _ = stream.set_nodelay(true);
        let app2 = Arc::clone(&app);
        let signal = app.lifecycle.signal();
        app.lifecycle.spawn(async move {
            let _permit = permit;
            let io = TokioIo::new(stream);
            match role {
                Role::Proxy => {
                    app2.metrics.connections.inc();
                    let a = Arc::clone(&app2);
                    let svc = service_fn(move |req| {
                        let a = Arc::clone(&a);
                        async move { Ok::<_, Infallible>(crate::proxy::handle(a, req, None).await) }
                    });
                    serve(io, svc, Version::HTTP_11, signal).await;
                    app2.metrics.connections.dec();
                }
                Role::Admin => {
                    let a = Arc::clone(&app2);
                    let svc = service_fn(move |req| {
                        let a = Arc::clone(&a);
                        async move { Ok::<_, Infallible>(crate::admin::handle(a, req).await) }
                    });
                    serve(io, svc, Version::HTTP_11, signal).await;
                }
            }
            tracing::trace!(%peer, "connection closed");
        });
    }
}
