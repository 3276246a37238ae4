//! Protocol detection on the first bytes of an inbound connection: HTTP/2
//! (connection preface), HTTP/1 (a request line), Tether's opaque-transport
//! preface, or anything else, which is forwarded as opaque TCP. Protocols
//! where the server speaks first send nothing; they are detected as opaque
//! when the detection timeout passes.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

/// Sent first by an outbound proxy on an opaque connection to a peer proxy.
pub const OPAQUE_PREFACE: &[u8] = b"tether-opaque/1\r\n";
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The longest request line we wait for before calling a stream opaque.
const MAX_PEEK: usize = 8 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http,
    /// A peer proxy's opaque connection; the preface has been consumed.
    OpaqueTransport,
    Opaque,
    /// The client closed before sending anything.
    Closed,
}

/// Classifies what has been read so far, or `None` if more bytes are needed.
pub fn classify(buf: &[u8]) -> Option<Protocol> {
    if buf.is_empty() {
        return None;
    }
    for (preface, proto) in [
        (OPAQUE_PREFACE, Protocol::OpaqueTransport),
        (H2_PREFACE, Protocol::Http),
    ] {
        let n = buf.len().min(preface.len());
        if buf[..n] == preface[..n] {
            return if buf.len() >= preface.len() {
                Some(proto)
            } else {
                None
            };
        }
    }
    match buf.windows(2).position(|w| w == b"\r\n") {
        Some(end) => {
            let line = &buf[..end];
            let is_http1 = (line.ends_with(b" HTTP/1.1") || line.ends_with(b" HTTP/1.0"))
                && line.first().is_some_and(|b| b.is_ascii_uppercase());
            Some(if is_http1 {
                Protocol::Http
            } else {
                Protocol::Opaque
            })
        }
        None if buf.len() >= MAX_PEEK => Some(Protocol::Opaque),
        None if !buf.iter().all(|b| b.is_ascii_graphic() || *b == b' ') => Some(Protocol::Opaque),
        None => None,
    }
}

/// Reads until the protocol is known (or `timeout` passes) and returns the
/// protocol and the bytes read, which the caller must replay.
pub async fn detect<T: AsyncRead + Unpin>(
    io: &mut T,
    timeout: Duration,
) -> io::Result<(Protocol, Bytes)> {
    let mut buf = BytesMut::with_capacity(1024);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(proto) = classify(&buf) {
            if proto == Protocol::OpaqueTransport {
                buf.advance(OPAQUE_PREFACE.len());
            }
            return Ok((proto, buf.freeze()));
        }
        match tokio::time::timeout_at(deadline, io.read_buf(&mut buf)).await {
            Err(_) => return Ok((Protocol::Opaque, buf.freeze())),
            Ok(Ok(0)) if buf.is_empty() => return Ok((Protocol::Closed, buf.freeze())),
            Ok(Ok(0)) => return Ok((Protocol::Opaque, buf.freeze())),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e),
        }
    }
}

/// An I/O that first replays bytes already read from it.
pub struct PrefixedIo<T> {
    prefix: Bytes,
    inner: T,
}

impl<T> PrefixedIo<T> {
    pub fn new(prefix: Bytes, inner: T) -> Self {
        Self { prefix, inner }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for PrefixedIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            let chunk = self.prefix.split_to(n);
            buf.put_slice(&chunk);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for PrefixedIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_first_bytes() {
        assert_eq!(
            classify(b"GET / HTTP/1.1\r\nHost: x\r\n"),
            Some(Protocol::Http)
        );
        assert_eq!(classify(b"GET / HTT"), None);
        assert_eq!(classify(H2_PREFACE), Some(Protocol::Http));
        assert_eq!(classify(&H2_PREFACE[..5]), None);
        assert_eq!(
            classify(b"tether-opaque/1\r\nhello"),
            Some(Protocol::OpaqueTransport)
        );
        assert_eq!(classify(b"tether-"), None);
        assert_eq!(classify(b"\x16\x03\x01\x02\x00"), Some(Protocol::Opaque));
        assert_eq!(classify(b"PING\r\n"), Some(Protocol::Opaque));
    }

    #[tokio::test]
    async fn replays_what_detection_read() {
        let (mut a, mut b) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut a, b"tether-opaque/1\r\nhello")
            .await
            .unwrap();
        drop(a);
        let (proto, prefix) = detect(&mut b, Duration::from_secs(1)).await.unwrap();
        assert_eq!(proto, Protocol::OpaqueTransport);
        let mut io = PrefixedIo::new(prefix, b);
        let mut out = String::new();
        io.read_to_string(&mut out).await.unwrap();
        assert_eq!(out, "hello");
    }
}
