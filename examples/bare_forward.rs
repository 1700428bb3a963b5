//! The floor for the HTTP benchmark: the least a hyper forward proxy can do — parse an
//! absolute-form request, send it on a pooled hyper-util client, stream the answer
//! back. No limiting, no policy, no metrics. `bench/http.sh` runs it beside sluice so
//! the table shows what sluice's own work costs on top of the proxy hop itself.
//!
//! `cargo run --release --example bare_forward -- 127.0.0.1:PORT`

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:18082".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, hyper::body::Incoming> =
        Client::builder(TokioExecutor::new()).build(connector);
    eprintln!("bare forwarder listening on {addr}");
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let client = client.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                let client = client.clone();
                async move {
                    match client.request(req).await {
                        Ok(r) => Ok::<_, hyper::Error>(r.map(http_body_util::Either::Left)),
                        Err(_) => {
                            let mut r = Response::new(http_body_util::Either::Right(
                                http_body_util::Empty::new(),
                            ));
                            *r.status_mut() = StatusCode::BAD_GATEWAY;
                            Ok(r)
                        }
                    }
                }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
