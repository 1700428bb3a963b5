//! The floor of what interception adds per request: the four TLS record operations of a
//! kept-alive intercepted request (the sender's request opened and the response sealed
//! on the sender's session; the request sealed and the response opened on the
//! upstream's), with no socket, runtime or stream adapter around them.
//!
//! `cargo build --release --example tls_record_cost && target/release/examples/tls_record_cost [ITERATIONS]`
//!
//! Two rows, three rounds each: rustls's buffered connections (a TLS 1.3 client and
//! server handshaken in memory with sluice's own certificate code, AES-128-GCM as both
//! of sluice's TLS sides prefer), and ring's AES-128-GCM alone on records of the same
//! sizes as `tls_bench`'s (76-byte request and 98-byte response records). Compare the
//! per-request figure with the CPU sluice adds per intercepted request in `tls_bench`.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ring::aead::{AES_128_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use rustls::Connection;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// TLS 1.3 record overhead: 5-byte header, 1-byte inner content type, 16-byte tag.
const OVERHEAD: usize = 22;
/// The plaintext sizes of `tls_bench`'s request and response (records of 76 and 98 bytes).
const REQUEST: usize = 76 - OVERHEAD;
const RESPONSE: usize = 98 - OVERHEAD;

/// Moves every record `from` has to send into `to`, and has `to` process them.
fn pump(from: &mut Connection, to: &mut Connection, wire: &mut Vec<u8>) -> Result<(), BoxError> {
    wire.clear();
    while from.wants_write() {
        from.write_tls(wire)?;
    }
    let mut rest = &wire[..];
    while !rest.is_empty() {
        to.read_tls(&mut rest)?;
        to.process_new_packets()?;
    }
    Ok(())
}

/// A client and a server connection with the handshake done.
fn pair(dir: &std::path::Path) -> Result<(Connection, Connection), BoxError> {
    let files = sluice::tls::generate_ca(dir)?;
    let ca = sluice::tls::CertAuthority::load(&files.cert, &files.key)?;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert_der().clone())?;
    let server = sluice::tls::Interceptor::new(ca, 4, Duration::from_secs(3600))
        .server_config("localhost")?;
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let mut c = Connection::Client(rustls::ClientConnection::new(
        Arc::new(client),
        "localhost".try_into()?,
    )?);
    let mut s = Connection::Server(rustls::ServerConnection::new(server)?);
    let mut wire = Vec::new();
    for _ in 0..8 {
        if !c.is_handshaking() && !s.is_handshaking() {
            break;
        }
        pump(&mut c, &mut s, &mut wire)?;
        pump(&mut s, &mut c, &mut wire)?;
    }
    if c.is_handshaking() || s.is_handshaking() {
        return Err("the in-memory handshake did not finish".into());
    }
    // The session tickets the server sent after the handshake.
    pump(&mut s, &mut c, &mut wire)?;
    Ok((c, s))
}

/// One request and its response through rustls: two records sealed, two opened.
fn rustls_round_trip(
    c: &mut Connection,
    s: &mut Connection,
    wire: &mut Vec<u8>,
    out: &mut [u8],
) -> Result<(), BoxError> {
    c.writer().write_all(&[b'q'; REQUEST])?;
    pump(c, s, wire)?;
    if s.reader().read(out)? != REQUEST {
        return Err("the request did not come through whole".into());
    }
    s.writer().write_all(&[b'r'; RESPONSE])?;
    pump(s, c, wire)?;
    if c.reader().read(out)? != RESPONSE {
        return Err("the response did not come through whole".into());
    }
    Ok(())
}

/// The same four records' AEAD work with ring alone: seal and open a record of each size.
fn ring_round_trip(key: &LessSafeKey, seq: u64, record: &mut Vec<u8>) -> Result<(), BoxError> {
    for len in [REQUEST + 1, RESPONSE + 1] {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&seq.to_be_bytes());
        let aad = [23, 3, 3, 0, (len + 16) as u8];
        record.clear();
        record.resize(len, b'p');
        key.seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(aad), record)
            .map_err(|_| "seal failed")?;
        let plain = key
            .open_in_place(Nonce::assume_unique_for_key(nonce), Aad::from(aad), record)
            .map_err(|_| "open failed")?;
        std::hint::black_box(plain);
    }
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000)
        .max(1);
    let dir = std::env::temp_dir().join(format!("sluice-record-cost-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (mut c, mut s) = pair(&dir.join("ca"))?;
    let _ = std::fs::remove_dir_all(&dir);
    let key = LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &[7; 16]).map_err(|_| "key")?);
    let (mut wire, mut out, mut record) = (Vec::new(), vec![0u8; 4096], Vec::new());
    println!(
        "| round | rustls, buffered: ns per request (per record) | ring AES-128-GCM alone: ns per request (per record) |\n|---|---|---|"
    );
    for round in 1..=3 {
        let t = Instant::now();
        for _ in 0..n {
            rustls_round_trip(&mut c, &mut s, &mut wire, &mut out)?;
        }
        let tls = t.elapsed().as_nanos() as f64 / n as f64;
        let t = Instant::now();
        for seq in 0..n {
            ring_round_trip(&key, seq, &mut record)?;
        }
        let aead = t.elapsed().as_nanos() as f64 / n as f64;
        println!(
            "| {round} | {tls:.0} ({:.0}) | {aead:.0} ({:.0}) |",
            tls / 4.0,
            aead / 4.0
        );
    }
    Ok(())
}
