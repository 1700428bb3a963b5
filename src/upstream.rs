//! Upstream connections the lane keeps alive: the connection ([`Upstream`]), its
//! stream (plain TCP or TLS), whether it may be used again ([`still_open`], [`quiet`]),
//! and the shelf type idle ones wait on between sender connections
//! ([`IdleUpstreams`], held by [`crate::core::App`]).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, Interest};
use tokio::net::TcpStream;

use crate::conn::SendIo;

/// Idle upstream connections by (TLS, authority as the request named it).
pub(crate) type IdleUpstreams = crate::idle::Idle<(bool, Box<str>), Upstream>;

/// A kept-alive upstream connection.
pub(crate) struct Upstream {
    /// The request authority it was opened for, byte for byte.
    pub(crate) authority: Box<str>,
    /// The destination policy generation it was checked under.
    pub(crate) generation: u64,
    pub(crate) stream: UpIo,
    /// Bytes read from it and not yet used.
    pub(crate) buf: BytesMut,
    /// The `Host` its requests carry.
    pub(crate) host: Box<str>,
}

/// Whether a kept upstream connection can carry the next request: nothing came from
/// it since its last response ended (no close, no stray bytes). Looked up in the
/// runtime's readiness for its socket, which tokio forgets when a read drains the
/// socket (a read shorter than the room), so the common case costs no system call.
/// A plain connection that did hear something, or whose last read filled the buffer,
/// is read; a TLS one is not reused then (its bytes cannot be peeked at outside the
/// session), nor when its session holds plaintext nobody read: a read can empty the
/// socket into the session, bytes after the response with it, and they would be the
/// next request's answer.
pub(crate) fn still_open(up: &Upstream) -> bool {
    if let UpIo::Tls(tls) = &up.stream {
        // rustls wants more records only when it holds no plaintext.
        if !tls.get_ref().1.wants_read() {
            return false;
        }
    }
    let tcp = up.stream.tcp();
    let heard = tcp.try_io(Interest::READABLE, || Ok(())).is_ok();
    if !heard {
        return true;
    }
    if matches!(up.stream, UpIo::Tls(_)) {
        return false;
    }
    let mut probe = [0u8; 1];
    matches!(tcp.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
}

/// Whether a kept upstream connection may pass to another sender connection (the idle
/// shelf): [`still_open`], and the kernel holds no byte for it, asked with a peek. The
/// runtime's readiness lags the socket (it is set when the I/O driver next polls), so
/// bytes a receiver wrote after its answer, an extra response of its own, can sit
/// unseen there; they would be the next sender's answer. A system call per sender
/// connection, never per request.
pub(crate) fn quiet(up: &Upstream) -> bool {
    if !still_open(up) {
        return false;
    }
    let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    let peeked = socket2::SockRef::from(up.stream.tcp()).peek(&mut probe);
    matches!(peeked, Err(e) if e.kind() == io::ErrorKind::WouldBlock)
}

/// An upstream connection's stream: plain TCP, or TLS (requests from inside an
/// intercepted tunnel).
pub(crate) enum UpIo {
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<SendIo<TcpStream>>>),
}

impl UpIo {
    /// The TCP connection under it.
    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            UpIo::Tcp(s) => s,
            UpIo::Tls(s) => s.get_ref().0.get_ref(),
        }
    }
}

impl AsyncRead for UpIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpIo::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpIo::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpIo::Tcp(s) => Pin::new(s).poll_flush(cx),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpIo::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            UpIo::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
