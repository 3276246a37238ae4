//! The control plane's own mTLS: a certificate it issues itself (it holds
//! the issuer), and an acceptor that turns a TCP listener into a stream of
//! verified TLS connections for tonic to serve.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use rustls::ServerConfig;
use tether_identity::ca::Issuer;
use tether_identity::tls::CertStore;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// How long the control plane's own certificate lives; it is re-issued at
/// half that.
const LIFETIME: Duration = Duration::from_secs(24 * 3600);

/// Why the control plane could not issue its own certificate.
#[derive(Debug, thiserror::Error)]
pub enum SelfCertifyError {
    #[error("generating a key and CSR: {0}")]
    Key(#[from] rcgen::Error),
    #[error(transparent)]
    Sign(#[from] tether_identity::ca::SignError),
    #[error(transparent)]
    Install(#[from] tether_identity::tls::TlsError),
}

/// Issues `identity` a certificate from `issuer` into `store`, and renews
/// it in the background: at half its lifetime, and at once when the
/// issuer is replaced (so this process's certificate moves to a new issuer
/// with it).
pub fn self_certify(
    mut issuer: tokio::sync::watch::Receiver<Arc<Issuer>>,
    identity: String,
    store: Arc<CertStore>,
) -> Result<(), SelfCertifyError> {
    let issue = {
        let (identity, store) = (identity.clone(), store.clone());
        move |issuer: &Issuer| -> Result<(), SelfCertifyError> {
            let kc = tether_identity::csr::generate(&identity)?;
            let issued = issuer.sign(&kc.csr_der, &identity, LIFETIME)?;
            store.install(
                issued.leaf_der,
                issued.chain,
                kc.key_pkcs8,
                issued.valid_until,
            )?;
            Ok(())
        }
    };
    issue(&issuer.borrow_and_update())?;
    tokio::spawn(async move {
        // A fixed issuer (operator tools) has no sender left to change it.
        let mut replaceable = true;
        loop {
            let left = store
                .expires()
                .and_then(|e| e.duration_since(SystemTime::now()).ok())
                .unwrap_or_default();
            let renew = tokio::time::sleep((left / 2).max(Duration::from_secs(1)));
            tokio::select! {
                _ = renew => {}
                changed = issuer.changed(), if replaceable => {
                    if changed.is_err() {
                        replaceable = false;
                        continue;
                    }
                }
            }
            let current = issuer.borrow_and_update().clone();
            match issue(&current) {
                Ok(()) => {
                    tracing::info!(%identity, issuer = %current.fingerprint(), "the control plane's own certificate issued")
                }
                Err(e) => {
                    tracing::warn!(%identity, error = %e, "renewing the control plane's certificate failed")
                }
            }
        }
    });
    Ok(())
}

/// A verified TLS connection, as tonic's server wants it.
pub struct TlsConn(pub tokio_rustls::server::TlsStream<TcpStream>);

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Accepts TCP, completes TLS (client certificates required and verified
/// against the trust root) and yields the connections; handshakes that
/// fail are logged and dropped. The queue of finished handshakes is bounded.
pub fn incoming(
    listener: TcpListener,
    config: Arc<ServerConfig>,
) -> tokio_stream::wrappers::ReceiverStream<Result<TlsConn, io::Error>> {
    let (tx, rx) = mpsc::channel(64);
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tether_admin::accept(&listener, "export").await;
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(Duration::from_secs(5), acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => {
                        let _ = tx.send(Ok(TlsConn(tls))).await;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(%peer, error = %e, "export API: TLS handshake refused")
                    }
                    Err(_) => tracing::warn!(%peer, "export API: TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
