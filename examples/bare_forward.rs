//! The floors for the HTTP benchmark: the least a hyper forward proxy can do — parse an
//! absolute-form request, send it upstream, stream the answer back. No limiting, no
//! policy, no metrics. `bench/http.sh` runs it beside sluice so the table shows what
//! sluice's own work costs on top of the proxy hop itself. Two shapes:
//!
//! - `pool` (default): a multi-threaded runtime and hyper-util's pooled client, the
//!   stock way to write it;
//! - `held`: sluice's shape — one single-threaded runtime, and each sender connection
//!   keeps its own upstream connection (hyper's `client::conn::http1`) for as long as
//!   it sends to one destination.
//!
//! `cargo run --release --example bare_forward -- 127.0.0.1:PORT [pool|held]`

use std::sync::{Arc, Mutex};

use http::uri::Authority;
use http_body_util::{Either, Empty};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

type Answer = Response<Either<Incoming, Empty<bytes::Bytes>>>;

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:18082".into());
    match args.next().as_deref() {
        None | Some("pool") => tokio::runtime::Runtime::new()?.block_on(pooled(addr)),
        Some("held") => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(held(addr)),
        Some(other) => Err(std::io::Error::other(format!(
            "unknown mode {other:?}: pool or held"
        ))),
    }
}

fn bad_gateway() -> Answer {
    let mut r = Response::new(Either::Right(Empty::new()));
    *r.status_mut() = StatusCode::BAD_GATEWAY;
    r
}

async fn pooled(addr: String) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> =
        Client::builder(TokioExecutor::new()).build(connector);
    eprintln!("bare forwarder (pooled client) listening on {addr}");
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let client = client.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let client = client.clone();
                async move {
                    Ok::<_, hyper::Error>(match client.request(req).await {
                        Ok(r) => r.map(Either::Left),
                        Err(_) => bad_gateway(),
                    })
                }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// A sender connection's upstream connection, with the authority it goes to.
type Held = Arc<Mutex<Option<(Authority, SendRequest<Incoming>)>>>;

async fn held(addr: String) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    eprintln!("bare forwarder (held connections, one thread) listening on {addr}");
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let held: Held = Arc::default();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let held = Arc::clone(&held);
                async move { Ok::<_, hyper::Error>(send_held(&held, req).await) }
            });
            let _ = http1::Builder::new()
                .writev(false)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

async fn send_held(held: &Held, mut req: Request<Incoming>) -> Answer {
    let Some(authority) = req.uri().authority().cloned() else {
        return bad_gateway();
    };
    let kept = held.lock().unwrap().take();
    let mut sender = match kept {
        Some((a, s)) if a == authority && s.is_ready() => s,
        _ => match open(&authority).await {
            Ok(s) => s,
            Err(_) => return bad_gateway(),
        },
    };
    let path = req.uri().path_and_query().cloned();
    *req.uri_mut() = path.map_or_else(|| Uri::from_static("/"), Uri::from);
    match sender.send_request(req).await {
        Ok(r) => {
            *held.lock().unwrap() = Some((authority, sender));
            r.map(Either::Left)
        }
        Err(_) => bad_gateway(),
    }
}

async fn open(authority: &Authority) -> std::io::Result<SendRequest<Incoming>> {
    let port = authority.port_u16().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((authority.host(), port)).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::Builder::new()
        .writev(false)
        .handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(conn);
    Ok(sender)
}
