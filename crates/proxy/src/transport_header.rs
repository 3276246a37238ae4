//! linkerd2-proxy's opaque transport header (`linkerd/transport-header`):
//! what a client proxy writes first on an mTLS connection to a peer's
//! inbound port once both agreed on the ALPN protocol
//! [`ALPN`] (`transport.l5d.io/v1`), so the peer knows the target port (and
//! whether the bytes that follow are HTTP) without detecting anything.
//!
//! Wire format: the preface `transport.l5d.io/v1\r\n\r\n`, a big-endian
//! `u32` length, then that many bytes of the protobuf message
//! `transport.l5d.io.Header` (`linkerd/transport-header/proto/header.proto`;
//! `linkerd2-proxy-api` does not publish it, so the message is declared
//! here with the same tags).

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt};

/// The ALPN protocol both sides offer when a transport header follows.
pub const ALPN: &[u8] = b"transport.l5d.io/v1";
const PREFACE: &[u8] = b"transport.l5d.io/v1\r\n\r\n";
/// The longest header message accepted. A header is a port and at most a
/// DNS name (253 bytes); linkerd2-proxy never writes more than a few
/// hundred bytes.
pub const MAX_HEADER_LEN: usize = 4 * 1024;

/// `transport.l5d.io.Header`.
#[derive(Clone, PartialEq, Eq, Message)]
pub struct Header {
    /// The target port.
    #[prost(int32, tag = "1")]
    pub port: i32,
    /// A logical name, set only toward a gateway.
    #[prost(string, tag = "2")]
    pub name: String,
    /// What the connection carries; none means opaque TCP.
    #[prost(message, optional, tag = "3")]
    pub session_protocol: Option<SessionProtocol>,
}

/// `transport.l5d.io.SessionProtocol`.
#[derive(Clone, Copy, PartialEq, Eq, Message)]
pub struct SessionProtocol {
    #[prost(oneof = "session_protocol::Kind", tags = "1, 2")]
    pub kind: Option<session_protocol::Kind>,
}

pub mod session_protocol {
    #[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
    pub struct Http1 {}
    #[derive(Clone, Copy, PartialEq, Eq, prost::Message)]
    pub struct Http2 {}
    #[derive(Clone, Copy, PartialEq, Eq, prost::Oneof)]
    pub enum Kind {
        #[prost(message, tag = "1")]
        Http1(Http1),
        #[prost(message, tag = "2")]
        Http2(Http2),
    }
}

/// What a transport header asks for, once checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub port: u16,
    /// A gateway name; an inbound that is not a gateway refuses it.
    pub name: Option<String>,
    /// The connection carries HTTP (either version); otherwise opaque TCP.
    pub http: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error("no transport header before the detection timeout")]
    Timeout,
    #[error("connection closed inside the transport header")]
    Truncated,
    #[error("the transport header preface is missing")]
    NoPreface,
    #[error("transport header of {0} bytes (at most {MAX_HEADER_LEN})")]
    TooLong(usize),
    #[error("transport header is not a valid message: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("transport header names port {0}")]
    BadPort(i32),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl HeaderError {
    /// The label of `tether_proxy_inbound_refused_total{reason}`.
    pub fn reason(&self) -> &'static str {
        match self {
            HeaderError::Timeout => "detection_timeout",
            HeaderError::Truncated | HeaderError::Io(_) => "truncated",
            _ => "bad_transport_header",
        }
    }
}

/// The bytes a client writes: preface, length, message — opaque TCP to
/// `port` (linkerd2-proxy sets a name only toward a gateway, and a session
/// protocol only for HTTP).
pub fn encode(port: u16) -> Bytes {
    let header = Header {
        port: port.into(),
        name: String::new(),
        session_protocol: None,
    };
    let len = header.encoded_len();
    let mut buf = BytesMut::with_capacity(PREFACE.len() + 4 + len);
    buf.put_slice(PREFACE);
    buf.put_u32(len as u32);
    header
        .encode(&mut buf)
        .expect("the buffer was sized for it");
    buf.freeze()
}

/// Reads a transport header from the start of `io` (after `read`, bytes
/// already read from it), within `timeout` and [`MAX_HEADER_LEN`]; returns
/// it and the bytes read past it, which belong to the connection.
pub async fn read<T: AsyncRead + Unpin>(
    io: &mut T,
    read: Bytes,
    timeout: Duration,
) -> Result<(Target, Bytes), HeaderError> {
    tokio::time::timeout(timeout, read_unbounded_in_time(io, read))
        .await
        .map_err(|_| HeaderError::Timeout)?
}

async fn read_unbounded_in_time<T: AsyncRead + Unpin>(
    io: &mut T,
    read: Bytes,
) -> Result<(Target, Bytes), HeaderError> {
    let mut buf = BytesMut::with_capacity(1024.max(read.len()));
    buf.extend_from_slice(&read);
    // Something else than a header is told from its first bytes.
    let is_preface = |buf: &BytesMut| {
        let n = buf.len().min(PREFACE.len());
        buf[..n] == PREFACE[..n]
    };
    while buf.len() < PREFACE.len() + 4 && is_preface(&buf) {
        let want = buf.len() + 1;
        read_to(io, &mut buf, want).await?;
    }
    if !is_preface(&buf) {
        return Err(HeaderError::NoPreface);
    }
    buf.advance(PREFACE.len());
    let len = buf.get_u32() as usize;
    if len > MAX_HEADER_LEN {
        return Err(HeaderError::TooLong(len));
    }
    read_to(io, &mut buf, len).await?;
    let header = Header::decode(buf.split_to(len).freeze())?;
    let port = u16::try_from(header.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or(HeaderError::BadPort(header.port))?;
    let target = Target {
        port,
        name: Some(header.name).filter(|n| !n.is_empty()),
        http: header.session_protocol.and_then(|p| p.kind).is_some(),
    };
    Ok((target, buf.freeze()))
}

/// Reads until `buf` holds at least `want` bytes.
async fn read_to<T: AsyncRead + Unpin>(
    io: &mut T,
    buf: &mut BytesMut,
    want: usize,
) -> Result<(), HeaderError> {
    buf.reserve(want.saturating_sub(buf.len()));
    while buf.len() < want {
        if io.read_buf(buf).await? == 0 {
            return Err(HeaderError::Truncated);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn reads_what_it_writes_and_keeps_what_follows() {
        let mut wire = encode(5432).to_vec();
        wire.extend_from_slice(b"hello");
        // Split across reads, and partly read before.
        let (head, tail) = wire.split_at(7);
        let mut io = tokio_test_reader(tail);
        let (target, rest) = read(
            &mut io,
            Bytes::copy_from_slice(head),
            Duration::from_secs(1),
        )
        .await
        .unwrap();
        assert_eq!(
            target,
            Target {
                port: 5432,
                name: None,
                http: false
            }
        );
        let mut all = rest.to_vec();
        io.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"hello");
    }

    fn tokio_test_reader(bytes: &[u8]) -> impl AsyncRead + Unpin {
        std::io::Cursor::new(bytes.to_vec())
    }

    #[tokio::test]
    async fn refuses_what_is_not_a_bounded_valid_header() {
        let with = |len: u32, msg: &[u8]| {
            let mut v = PREFACE.to_vec();
            v.extend_from_slice(&len.to_be_bytes());
            v.extend_from_slice(msg);
            v
        };
        let port_zero = Header {
            port: 0,
            name: String::new(),
            session_protocol: None,
        }
        .encode_to_vec();
        let port_big = Header {
            port: 70000,
            name: String::new(),
            session_protocol: None,
        }
        .encode_to_vec();
        for (wire, expected) in [
            (b"GET / HTTP/1.1\r\n\r\n".to_vec(), "preface"),
            (with(u32::MAX, b""), "at most"),
            (with(10, b"\x08"), "closed"),
            (with(2, b"\xff\xff"), "valid message"),
            (with(port_zero.len() as u32, &port_zero), "port 0"),
            (with(port_big.len() as u32, &port_big), "port 70000"),
        ] {
            let mut io = tokio_test_reader(&wire);
            let err = read(&mut io, Bytes::new(), Duration::from_secs(1))
                .await
                .unwrap_err();
            assert!(err.to_string().contains(expected), "{err}");
        }
        // A client that stalls inside its header.
        let (mut a, mut b) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut a, &PREFACE[..5])
            .await
            .unwrap();
        let err = read(&mut b, Bytes::new(), Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, HeaderError::Timeout));
    }
}
