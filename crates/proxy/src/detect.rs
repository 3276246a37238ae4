//! Protocol detection on the first bytes of a connection: HTTP/2
//! (connection preface), HTTP/1 (a valid request line), Tether's
//! opaque-transport preface, or something else.
//!
//! "Something else" is never forwarded from here: a port carries opaque
//! TCP only when it is declared opaque, and declared-opaque ports skip
//! detection altogether. On every other port a connection that is not valid
//! HTTP is refused. Forwarding it as raw bytes would let a client smuggle
//! headers the mesh asserts (`tether-client-id`) past the HTTP layer that
//! strips them.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};

/// Sent first by an outbound proxy on an opaque connection to a peer proxy.
pub const OPAQUE_PREFACE: &[u8] = b"tether-opaque/1\r\n";
pub(crate) const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The longest HTTP/1 request line accepted (hyper's own limit on the
/// whole head applies after it).
pub const MAX_REQUEST_LINE: usize = 8 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http,
    /// A peer proxy's opaque connection; the preface has been consumed.
    OpaqueTransport,
    /// Not HTTP, and why.
    Unrecognized(Unrecognized),
    /// The client closed before sending anything.
    Closed,
}

/// Why the first bytes are not HTTP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unrecognized {
    /// A request line longer than [`MAX_REQUEST_LINE`].
    TooLong,
    /// A text line that is not an HTTP/1.0 or HTTP/1.1 request line.
    BadRequestLine,
    /// Bytes no text protocol would send.
    Binary,
    /// Nothing (or too little) sent before the detection timeout.
    Silent,
    /// The client closed in the middle of its first line.
    Truncated,
}

impl Unrecognized {
    /// The label of `tether_proxy_inbound_refused_total{reason}`.
    pub fn reason(self) -> &'static str {
        match self {
            Unrecognized::TooLong => "request_line_too_long",
            Unrecognized::BadRequestLine => "bad_request_line",
            Unrecognized::Binary => "not_http",
            Unrecognized::Silent => "detection_timeout",
            Unrecognized::Truncated => "truncated",
        }
    }

    /// Whether the client is talking HTTP/1 badly, so a 400 response is
    /// something it can read.
    pub fn answer_400(self) -> bool {
        matches!(self, Unrecognized::TooLong | Unrecognized::BadRequestLine)
    }
}

impl std::fmt::Display for Unrecognized {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unrecognized::TooLong => "request line longer than 8 KiB",
            Unrecognized::BadRequestLine => "not an HTTP/1.0 or HTTP/1.1 request line",
            Unrecognized::Binary => "not HTTP",
            Unrecognized::Silent => "no request before the detection timeout",
            Unrecognized::Truncated => "connection closed inside the request line",
        })
    }
}

/// `METHOD SP request-target SP HTTP/1.x`, with a token method and a
/// visible-ASCII target (RFC 9112 §3).
fn is_request_line(line: &[u8]) -> bool {
    let mut parts = line.split(|b| *b == b' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let tchar = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b);
    !method.is_empty()
        && method.iter().all(tchar)
        && !target.is_empty()
        && target.iter().all(|b| b.is_ascii_graphic())
        && (version == b"HTTP/1.1" || version == b"HTTP/1.0")
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
    let scanned = &buf[..buf.len().min(MAX_REQUEST_LINE + 2)];
    let is_text = |b: &u8| b.is_ascii_graphic() || b" \t\r\n".contains(b);
    match scanned.windows(2).position(|w| w == b"\r\n") {
        Some(end) if is_request_line(&buf[..end]) => Some(Protocol::Http),
        Some(end) if buf[..end].iter().all(is_text) => {
            Some(Protocol::Unrecognized(Unrecognized::BadRequestLine))
        }
        Some(_) => Some(Protocol::Unrecognized(Unrecognized::Binary)),
        None if !scanned.iter().all(is_text) => Some(Protocol::Unrecognized(Unrecognized::Binary)),
        None if buf.len() > MAX_REQUEST_LINE => Some(Protocol::Unrecognized(Unrecognized::TooLong)),
        None => None,
    }
}

/// Reads until the protocol is known (or `timeout` passes) and returns the
/// protocol and the bytes read, which the caller must replay. Reads at most
/// a little more than [`MAX_REQUEST_LINE`] bytes.
/// `read` holds what was already read from `io`.
pub async fn detect<T: AsyncRead + Unpin>(
    io: &mut T,
    read: Bytes,
    timeout: Duration,
) -> io::Result<(Protocol, Bytes)> {
    let mut buf = BytesMut::with_capacity(1024.max(read.len()));
    buf.extend_from_slice(&read);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(proto) = classify(&buf) {
            if proto == Protocol::OpaqueTransport {
                buf.advance(OPAQUE_PREFACE.len());
            }
            return Ok((proto, buf.freeze()));
        }
        if buf.len() > MAX_REQUEST_LINE + H2_PREFACE.len() {
            // classify decides within this many bytes; never read more.
            return Ok((Protocol::Unrecognized(Unrecognized::TooLong), buf.freeze()));
        }
        match tokio::time::timeout_at(deadline, io.read_buf(&mut buf)).await {
            Err(_) => return Ok((Protocol::Unrecognized(Unrecognized::Silent), buf.freeze())),
            Ok(Ok(0)) if buf.is_empty() => return Ok((Protocol::Closed, buf.freeze())),
            Ok(Ok(0)) => {
                return Ok((
                    Protocol::Unrecognized(Unrecognized::Truncated),
                    buf.freeze(),
                ))
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e),
        }
    }
}

/// The first bytes a client sends (one read), or nothing if it sends
/// nothing within `timeout` or closes.
pub async fn first_bytes<T: AsyncRead + Unpin>(io: &mut T, timeout: Duration) -> io::Result<Bytes> {
    let mut buf = BytesMut::with_capacity(1024);
    match tokio::time::timeout(timeout, io.read_buf(&mut buf)).await {
        Err(_) => Ok(Bytes::new()),
        Ok(r) => r.map(|_| buf.freeze()),
    }
}

/// On a declared-opaque port: consumes Tether's opaque preface when a peer
/// proxy sent it, reading no further than needed to tell (the client may
/// expect the server to speak first). `read` holds what was already read
/// from `io`. Returns the bytes to replay.
pub async fn opaque_start<T: AsyncRead + Unpin>(
    io: &mut T,
    read: Bytes,
    timeout: Duration,
) -> io::Result<Bytes> {
    let mut buf = BytesMut::with_capacity(OPAQUE_PREFACE.len().max(read.len()));
    buf.extend_from_slice(&read);
    let deadline = tokio::time::Instant::now() + timeout;
    while buf.len() < OPAQUE_PREFACE.len() && OPAQUE_PREFACE.starts_with(&buf[..]) {
        match tokio::time::timeout_at(deadline, io.read_buf(&mut buf)).await {
            Err(_) | Ok(Ok(0)) => break,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e),
        }
    }
    if buf.starts_with(OPAQUE_PREFACE) {
        buf.advance(OPAQUE_PREFACE.len());
    }
    Ok(buf.freeze())
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
        use Unrecognized::*;
        let not = |why| Some(Protocol::Unrecognized(why));
        assert_eq!(classify(b"\x16\x03\x01\x02\x00"), not(Binary));
        assert_eq!(classify(b"PING\r\n"), not(BadRequestLine));
        assert_eq!(classify(b"GET / HTTP/9.9\r\n"), not(BadRequestLine));
        assert_eq!(classify(b"GET  / HTTP/1.1\r\n"), not(BadRequestLine));
        assert_eq!(classify(b"G(T / HTTP/1.1\r\n"), not(BadRequestLine));
        assert_eq!(classify(b"GET / HTTP/1.1 \r\n"), not(BadRequestLine));
        assert_eq!(classify(b"CONNECT a:1 HTTP/1.1\r\n"), Some(Protocol::Http));
        let long = format!("GET /{} HTTP/1.1\r\n", "a".repeat(MAX_REQUEST_LINE));
        assert_eq!(classify(&long.as_bytes()[..MAX_REQUEST_LINE]), None);
        assert_eq!(classify(long.as_bytes()), not(TooLong));
        let fits = format!("GET /{} HTTP/1.1\r\n", "a".repeat(MAX_REQUEST_LINE - 15));
        assert_eq!(classify(fits.as_bytes()), Some(Protocol::Http));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
        /// Whatever the bytes: no panic, and HTTP only for a valid request
        /// line or the HTTP/2 preface, decided within a bounded prefix.
        #[test]
        fn classify_is_total_and_bounded(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..10_000)) {
            let verdict = classify(&bytes);
            if verdict == Some(Protocol::Http) && !bytes.starts_with(H2_PREFACE) {
                let end = bytes.windows(2).position(|w| w == b"\r\n").unwrap();
                proptest::prop_assert!(is_request_line(&bytes[..end]));
            }
            if bytes.len() > MAX_REQUEST_LINE + H2_PREFACE.len() {
                proptest::prop_assert!(verdict.is_some());
            }
        }

        #[test]
        fn text_lines_are_judged_by_their_first_line(line in "[ -~]{0,200}", rest in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            let mut bytes = line.clone().into_bytes();
            bytes.extend_from_slice(b"\r\n");
            bytes.extend_from_slice(&rest);
            if !OPAQUE_PREFACE.starts_with(line.as_bytes()) && !H2_PREFACE.starts_with(line.as_bytes()) && !line.starts_with("PRI * HTTP/2.0") && !line.starts_with("tether-opaque/1") {
                let expected = if is_request_line(line.as_bytes()) {
                    Protocol::Http
                } else {
                    Protocol::Unrecognized(Unrecognized::BadRequestLine)
                };
                proptest::prop_assert_eq!(classify(&bytes), Some(expected));
            }
        }
    }

    #[tokio::test]
    async fn detection_reads_a_bounded_prefix() {
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        let flood = vec![b'A'; 1 << 20];
        tokio::spawn(async move { tokio::io::AsyncWriteExt::write_all(&mut a, &flood).await });
        let (proto, prefix) = detect(&mut b, Bytes::new(), Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(proto, Protocol::Unrecognized(Unrecognized::TooLong));
        assert!(prefix.len() < 4 * MAX_REQUEST_LINE, "{}", prefix.len());
    }

    #[tokio::test]
    async fn opaque_start_consumes_only_the_preface() {
        for (sent, replay) in [
            (&b"tether-opaque/1\r\nhello"[..], &b"hello"[..]),
            (b"\x00binary", b"\x00binary"),
            (b"tether-", b"tether-"),
        ] {
            let (mut a, mut b) = tokio::io::duplex(64);
            tokio::io::AsyncWriteExt::write_all(&mut a, sent)
                .await
                .unwrap();
            drop(a);
            // What an earlier read took is replayed too.
            let read = first_bytes(&mut b, Duration::from_secs(1)).await.unwrap();
            let (head, _) = read.split_at(read.len().min(3));
            let (head, tail) = (
                Bytes::copy_from_slice(head),
                Bytes::copy_from_slice(&read[head.len()..]),
            );
            let mut rest = PrefixedIo::new(tail, b);
            let prefix = opaque_start(&mut rest, head, Duration::from_secs(1))
                .await
                .unwrap();
            let b = rest;
            let mut io = PrefixedIo::new(prefix, b);
            let mut out = Vec::new();
            io.read_to_end(&mut out).await.unwrap();
            assert_eq!(out, replay);
        }
        // A server-speaks-first client sends nothing: nothing to replay.
        let (_a, mut b) = tokio::io::duplex(64);
        let prefix = first_bytes(&mut b, Duration::from_millis(50))
            .await
            .unwrap();
        assert!(prefix.is_empty());
    }

    #[tokio::test]
    async fn replays_what_detection_read() {
        let (mut a, mut b) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut a, b"tether-opaque/1\r\nhello")
            .await
            .unwrap();
        drop(a);
        let (proto, prefix) = detect(&mut b, Bytes::new(), Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(proto, Protocol::OpaqueTransport);
        let mut io = PrefixedIo::new(prefix, b);
        let mut out = String::new();
        io.read_to_string(&mut out).await.unwrap();
        assert_eq!(out, "hello");
    }
}
