//! What a CONNECT tunnel carries, read from its first bytes.
//!
//! Senders tunnel more than TLS: webhook platforms (Svix among them) send every
//! request through a CONNECT tunnel, `http://` ones too, and keep the tunnel for the
//! next requests to the same host. Paced once per tunnel, such a sender is not paced
//! at all. So sluice reads the sender's first bytes after its `200`:
//!
//! - a TLS record (`0x16`, a ClientHello) is TLS: intercepted when interception is on
//!   for the host, else passed through;
//! - an HTTP/1.x request head is plain HTTP: each request in the tunnel is served like
//!   an absolute-form one, admitted and paced on its own;
//! - anything else (a protocol whose server speaks first, an HTTP/2 preface, an
//!   upgrading request such as a WebSocket's) is passed through as bytes.
//!
//! [`Prefixed`] hands the bytes read back to whoever serves the stream next.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

/// Longest request head looked at to tell plain HTTP from an upgrade (the proxy's own
/// head limit).
const MAX_HEAD: usize = crate::limits::MAX_HEAD_BYTES;

/// Longest method token an HTTP request line may start with here (the longest
/// registered methods are under 20 characters).
const MAX_METHOD: usize = 20;

/// What a tunnel's first bytes say it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opening {
    /// A TLS handshake record.
    Tls,
    /// An HTTP/1.x request that asks for no protocol upgrade.
    Http,
    /// Anything else: relayed as bytes.
    Other,
}

/// Reads from `io` into `buf` until its first bytes say what the tunnel carries. For
/// plain HTTP the whole first head is read (up to the proxy's head limit), so that an
/// upgrading request (a WebSocket's) is told apart: after an upgrade the bytes are no
/// longer HTTP. The sender closing first is [`Opening::Other`] with what it sent.
pub async fn sniff<IO: AsyncRead + Unpin>(io: &mut IO, buf: &mut BytesMut) -> io::Result<Opening> {
    loop {
        match classify(buf) {
            Some(o) => return Ok(o),
            None => {
                buf.reserve(4096);
                if io.read_buf(buf).await? == 0 {
                    return Ok(Opening::Other);
                }
            }
        }
    }
}

/// What `bytes` (a tunnel's first bytes) say, or `None` while they cannot tell yet.
pub fn classify(bytes: &[u8]) -> Option<Opening> {
    let first = *bytes.first()?;
    if first == 0x16 {
        return Some(Opening::Tls);
    }
    let method_len = bytes
        .iter()
        .take(MAX_METHOD + 1)
        .position(|&b| !(b.is_ascii_uppercase() || b == b'-' || b == b'_'));
    let Some(n) = method_len else {
        return if bytes.len() <= MAX_METHOD {
            None
        } else {
            Some(Opening::Other)
        };
    };
    // `PRI * HTTP/2.0` is HTTP/2's preface: not an HTTP/1 request to serve.
    if n == 0 || bytes[n] != b' ' || &bytes[..n] == b"PRI" {
        return Some(Opening::Other);
    }
    let mut slots = [httparse::EMPTY_HEADER; crate::limits::MAX_HEADERS];
    let mut req = httparse::Request::new(&mut slots);
    match req.parse(bytes) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) if bytes.len() < MAX_HEAD => return None,
        // A head too large or not well formed: served as HTTP, whose engines answer it
        // (400, 431) as they answer any sender.
        _ => return Some(Opening::Http),
    }
    let upgrades = req
        .headers
        .iter()
        .any(|h| h.name.eq_ignore_ascii_case("upgrade"));
    Some(if upgrades {
        Opening::Other
    } else {
        Opening::Http
    })
}

/// A stream whose first reads return bytes already read from it.
pub struct Prefixed<IO> {
    pre: BytesMut,
    inner: IO,
}

impl<IO> Prefixed<IO> {
    /// `inner`, with `pre` to be read first.
    pub fn new(pre: BytesMut, inner: IO) -> Prefixed<IO> {
        Prefixed { pre, inner }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Prefixed<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.pre.is_empty() {
            let n = this.pre.len().min(buf.remaining());
            buf.put_slice(&this.pre[..n]);
            this.pre.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Prefixed<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tunnel_opening_is_told_from_its_first_bytes() {
        let cases: [(&[u8], Option<Opening>); 12] = [
            (b"", None),
            (b"\x16\x03\x01\x02\x00", Some(Opening::Tls)),
            (b"G", None),
            (b"POST", None),
            (b"POST /", None),
            (b"POST / HTTP/1.1\r\nHost: a\r\n\r\n", Some(Opening::Http)),
            (b"GET /x HTTP/1.0\r\n\r\n", Some(Opening::Http)),
            (b"SSH-2.0-OpenSSH_9.2\r\n", Some(Opening::Other)),
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", Some(Opening::Other)),
            (b"get / HTTP/1.1\r\n\r\n", Some(Opening::Other)),
            (
                b"GET /ws HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
                Some(Opening::Other),
            ),
            (b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", Some(Opening::Other)),
        ];
        for (bytes, want) in cases {
            assert_eq!(
                classify(bytes),
                want,
                "{:?}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn a_malformed_head_is_served_as_http_to_be_answered() {
        assert_eq!(
            classify(b"GET / HTTP/1.1\r\nbad header\r\n\r\n"),
            Some(Opening::Http)
        );
    }

    #[tokio::test]
    async fn the_bytes_read_are_read_again_first() {
        let (mut a, b) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut a, b"GET / HTTP/1.1\r\n\r\nrest")
            .await
            .unwrap();
        drop(a);
        let mut b = b;
        let mut buf = BytesMut::new();
        assert_eq!(sniff(&mut b, &mut buf).await.unwrap(), Opening::Http);
        let mut all = Vec::new();
        Prefixed::new(buf, b).read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"GET / HTTP/1.1\r\n\r\nrest");
    }
}
