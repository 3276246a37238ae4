//! Who may call the control plane's gRPC port, and how.
//!
//! The port speaks TLS with the control plane's own certificate
//! (`--control-identity`, issued from the identity directory's issuer and
//! renewed in the background). Client certificates are optional at the
//! handshake and checked per API afterwards: `Identity.Certify` takes
//! server-authenticated TLS (a proxy's first certificate comes from it),
//! every other API needs mutual TLS, so the control plane knows which
//! workload asks ([`ControlPeer`] is in every request's extensions).
//!
//! With `--insecure-control-plane` plaintext clients are served too. A
//! plaintext client of a TLS-only control plane is still answered, with
//! `UNAUTHENTICATED` saying that the two sides disagree, rather than a
//! closed connection it could not explain; a TLS client of a
//! plaintext-only control plane is closed and logged.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// The first byte of every TLS connection (a handshake record).
const TLS_HANDSHAKE: u8 = 0x16;
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Plaintext refusals and TLS handshake failures are logged at most this often.
static REFUSAL_LOG: tether_core::log_limit::LogLimit =
    tether_core::log_limit::LogLimit::new(Duration::from_secs(5));

/// Who is on the other end of a gRPC connection.
#[derive(Clone, Debug)]
pub struct ControlPeer {
    pub addr: SocketAddr,
    pub tls: bool,
    /// The identity of the client's verified certificate (mutual TLS).
    pub identity: Option<String>,
}

/// How the gRPC port is secured.
#[derive(Clone)]
pub struct ChannelSecurity {
    /// TLS with the control plane's certificate; `None` serves plaintext only.
    pub tls: Option<Arc<ServerConfig>>,
    /// Whether plaintext clients are served (`--insecure-control-plane`).
    pub insecure: bool,
}

trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// A connection that has passed the handshake and sent the HTTP/2 preface.
pub struct ControlConn {
    io: Prefixed<Box<dyn Io>>,
    peer: ControlPeer,
}

impl tonic::transport::server::Connected for ControlConn {
    type ConnectInfo = ControlPeer;
    fn connect_info(&self) -> ControlPeer {
        self.peer.clone()
    }
}

impl AsyncRead for ControlConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for ControlConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io.inner).poll_shutdown(cx)
    }
}

/// A stream whose first bytes were read already (the HTTP/2 preface, to
/// check it arrived in time) and are handed out again first.
struct Prefixed<T> {
    prefix: Vec<u8>,
    read: usize,
    inner: T,
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefixed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.read < self.prefix.len() {
            let n = buf.remaining().min(self.prefix.len() - self.read);
            let start = self.read;
            buf.put_slice(&self.prefix[start..start + n]);
            self.read += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

/// The connections of the gRPC port, each yielded once it has completed
/// TLS (or is plaintext) and sent the HTTP/2 preface, all within
/// `deadline`; the rest are closed. Accepting never waits for a slow client.
pub fn incoming(
    listener: TcpListener,
    security: ChannelSecurity,
    deadline: Duration,
) -> impl futures::Stream<Item = io::Result<ControlConn>> + Send + 'static {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let acceptor = security.tls.clone().map(tokio_rustls::TlsAcceptor::from);
    tokio::spawn(async move {
        loop {
            let (stream, addr) = tokio::select! {
                accepted = tether_admin::accept(&listener, "grpc") => accepted,
                _ = tx.closed() => return,
            };
            let (tx, acceptor, insecure) = (tx.clone(), acceptor.clone(), security.insecure);
            tokio::spawn(async move {
                let admitted = tokio::time::timeout(
                    deadline,
                    admit(stream, addr, acceptor.as_ref(), insecure),
                )
                .await;
                match admitted {
                    Ok(Ok(Some(conn))) => {
                        tracing::debug!(peer = %addr, tls = conn.peer.tls, identity = ?conn.peer.identity, "control-plane client connected");
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Ok(Ok(None)) => {}
                    Ok(Err(e)) => refused(addr, &e.to_string()),
                    Err(_) => {}
                }
            });
        }
    });
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|s| (s, rx)) })
}

fn refused(addr: SocketAddr, why: &str) {
    if let Some(suppressed) = REFUSAL_LOG.allow() {
        tracing::warn!(peer = %addr, error = %tether_core::truncate::for_log(why), suppressed, "gRPC connection refused");
    }
}

/// Handshakes one connection; `None` for a client that is not HTTP/2.
async fn admit(
    stream: TcpStream,
    addr: SocketAddr,
    acceptor: Option<&tokio_rustls::TlsAcceptor>,
    insecure: bool,
) -> io::Result<Option<ControlConn>> {
    let mut first = [0u8; 1];
    if stream.peek(&mut first).await? == 0 {
        return Ok(None);
    }
    let (io, peer): (Box<dyn Io>, ControlPeer) = if first[0] == TLS_HANDSHAKE {
        let Some(acceptor) = acceptor else {
            return Err(io::Error::other(
                "the client speaks TLS, but this control plane serves plaintext only \
                 (--insecure-control-plane without --identity): both sides must agree",
            ));
        };
        let tls = acceptor.accept(stream).await?;
        let identity = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|certs| certs.first())
            .and_then(|cert| tether_identity::cert::identity_of(cert));
        let peer = ControlPeer {
            addr,
            tls: true,
            identity,
        };
        (Box::new(tls), peer)
    } else {
        if !insecure {
            refused(
                addr,
                "plaintext client on the TLS gRPC port; it is told so (UNAUTHENTICATED)",
            );
        }
        let peer = ControlPeer {
            addr,
            tls: false,
            identity: None,
        };
        (Box::new(stream), peer)
    };
    let mut io = io;
    let mut preface = vec![0u8; H2_PREFACE.len()];
    io.read_exact(&mut preface).await?;
    if preface != H2_PREFACE {
        return Ok(None);
    }
    Ok(Some(ControlConn {
        io: Prefixed {
            prefix: preface,
            read: 0,
            inner: io,
        },
        peer,
    }))
}

/// What an API asks of its callers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// TLS; a client certificate is not needed (Certify).
    ServerTls,
    /// TLS with a client certificate from the trust root.
    MutualTls,
}

/// Refuses calls that do not meet an API's [`Access`], with
/// `UNAUTHENTICATED` and a message naming what is missing.
#[derive(Clone, Copy, Debug)]
pub struct Require {
    pub access: Access,
    pub insecure: bool,
}

impl tonic::service::Interceptor for Require {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let Some(peer) = request.extensions().get::<ControlPeer>() else {
            return Err(tonic::Status::internal(
                "connection without peer information",
            ));
        };
        if !peer.tls {
            if self.insecure {
                return Ok(request);
            }
            return Err(tonic::Status::unauthenticated(
                "this control plane requires TLS, but the client connected in plaintext: \
                 --insecure-control-plane must be given to both sides or to neither",
            ));
        }
        if self.access == Access::MutualTls && peer.identity.is_none() {
            return Err(tonic::Status::unauthenticated(
                "this API needs mutual TLS: the client presented no certificate \
                 (only Identity.Certify accepts server-authenticated TLS)",
            ));
        }
        Ok(request)
    }
}
