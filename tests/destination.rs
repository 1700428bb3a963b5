//! The destination policy (SSRF) end to end: addresses that stand for a private IPv4
//! address are refused before anything is sent, on both engines.

mod common;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use common::{Upstream, read_response};

/// `Connection` values that keep a request in the lane, and that hand it to hyper.
const BOTH_PATHS: [&str; 2] = ["keep-alive", "x-hop"];

/// A SIIT address (`::ffff:0:a.b.c.d`, RFC 7915) embedding a loopback or private IPv4 is
/// refused like that IPv4 address, `403 destination_denied`, on both engines.
#[tokio::test]
async fn siit_addresses_embedding_private_ipv4_are_refused() {
    let up = Upstream::start().await;
    let mut config = common::config("");
    config.security.allow_private_destinations = false;
    let s = sluice::app::start(config).await.expect("sluice starts");
    let port = up.addr.port();
    for connection in BOTH_PATHS {
        for host in [
            "[::ffff:0:127.0.0.1]",
            "[::ffff:0:a00:1]",
            "[::ffff:0:a9fe:a9fe]",
        ] {
            let mut t = TcpStream::connect(s.proxy_addr).await.unwrap();
            let req = format!(
                "GET http://{host}:{port}/ HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: {connection}\r\n\r\n"
            );
            t.write_all(req.as_bytes()).await.unwrap();
            let r = read_response(&mut t).await.to_ascii_lowercase();
            assert!(r.starts_with("http/1.1 403"), "{connection} {host}: {r}");
            assert!(
                r.contains("x-sluice-reason: destination_denied"),
                "{connection} {host}: {r}"
            );
        }
    }
    assert_eq!(up.count(), 0);
    s.stop().await;
}
