//! The floors for the HTTP benchmark: the least a hyper forward proxy can do — parse an
//! absolute-form request, send it upstream, stream the answer back. No limiting, no
//! policy, no metrics. `bench/http.sh` runs it beside sluice so the table shows what
//! sluice's own work costs on top of the proxy hop itself. Two shapes:
//!
//! - `pool` (default): a multi-threaded runtime and hyper-util's pooled client, the
//!   stock way to write it;
//! - `held`: sluice's shape under hyper — one single-threaded runtime, and each sender
//!   connection keeps its own upstream connection (hyper's `client::conn::http1`) for
//!   as long as it sends to one destination;
//! - `raw`: no HTTP library at all, one thread — heads parsed with httparse, bytes
//!   written as they came (GETs answered with a `Content-Length` only): the floor of
//!   any engine in Rust, which sluice's own lane (src/lane.rs) sits on.
//!
//! `cargo run --release --example bare_forward -- 127.0.0.1:PORT [pool|held|raw]`

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
        Some("raw") => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(raw(addr)),
        Some(other) => Err(std::io::Error::other(format!(
            "unknown mode {other:?}: pool, held or raw"
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

/// No HTTP library on either side: heads parsed with httparse, bytes written as they
/// came (the floor of any Rust engine; GETs with Content-Length answers only).
async fn raw(addr: String) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    eprintln!("bare forwarder (raw, one thread) listening on {addr}");
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let _ = raw_conn(stream).await;
        });
    }
}

async fn raw_conn(mut s: tokio::net::TcpStream) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut inb = bytes::BytesMut::with_capacity(8192);
    let mut upb = bytes::BytesMut::with_capacity(8192);
    let mut out = Vec::with_capacity(1024);
    let mut up: Option<(String, tokio::net::TcpStream)> = None;
    loop {
        let (at, host) = loop {
            let mut hs = [httparse::EMPTY_HEADER; 64];
            let mut r = httparse::Request::new(&mut hs);
            if let httparse::Status::Complete(at) = r.parse(&inb).map_err(std::io::Error::other)? {
                let path = r.path.unwrap_or("/");
                let rest = path
                    .strip_prefix("http://")
                    .ok_or_else(|| std::io::Error::other("not absolute"))?;
                let slash = rest.find('/').unwrap_or(rest.len());
                let host = rest[..slash].to_owned();
                let base = inb.as_ptr() as usize;
                let ps = rest[slash..].as_ptr() as usize - base;
                let pe = path.as_ptr() as usize - base + path.len();
                let me = r.method.unwrap().len();
                out.clear();
                out.extend_from_slice(&inb[..me + 1]);
                out.extend_from_slice(if ps == pe { b"/" } else { &inb[ps..pe] });
                out.extend_from_slice(b" HTTP/1.1\r\n");
                for h in r.headers.iter() {
                    if h.name.eq_ignore_ascii_case("proxy-connection")
                        || h.name.eq_ignore_ascii_case("connection")
                    {
                        continue;
                    }
                    out.extend_from_slice(h.name.as_bytes());
                    out.extend_from_slice(b": ");
                    out.extend_from_slice(h.value);
                    out.extend_from_slice(b"\r\n");
                }
                out.extend_from_slice(b"\r\n");
                break (at, host);
            }
            if s.read_buf(&mut inb).await? == 0 {
                return Ok(());
            }
        };
        bytes::Buf::advance(&mut inb, at);
        let u = match &mut up {
            Some((h, u)) if *h == host => u,
            _ => {
                let u = tokio::net::TcpStream::connect(host.as_str()).await?;
                u.set_nodelay(true)?;
                &mut up.insert((host, u)).1
            }
        };
        u.write_all(&out).await?;
        upb.clear();
        let (at, len) = loop {
            if u.read_buf(&mut upb).await? == 0 {
                return Err(std::io::Error::other("upstream closed"));
            }
            let mut hs = [httparse::EMPTY_HEADER; 64];
            let mut r = httparse::Response::new(&mut hs);
            if let httparse::Status::Complete(at) = r.parse(&upb).map_err(std::io::Error::other)? {
                let len = r
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                    .and_then(|h| std::str::from_utf8(h.value).ok()?.parse::<usize>().ok())
                    .unwrap_or(0);
                break (at, len);
            }
        };
        while upb.len() < at + len {
            if u.read_buf(&mut upb).await? == 0 {
                return Err(std::io::Error::other("upstream closed"));
            }
        }
        s.write_all(&upb[..at + len]).await?;
    }
}
