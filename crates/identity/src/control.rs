//! The channel between proxies (or operator tools) and the control plane.
//!
//! The control plane serves every API on one gRPC port, over TLS with a
//! certificate for its own identity
//! (`tether-control.<namespace>.serviceaccount.identity.<trust-domain>`)
//! issued from the workloads' trust root. `Identity.Certify` needs only
//! server-authenticated TLS (a proxy asking for its first certificate has
//! none); every other API needs mutual TLS, so the control plane knows
//! which workload asks. Plaintext is for `--insecure-control-plane` only.
//!
//! Like linkerd2-proxy, a client sends the expected identity as SNI and
//! checks the server's certificate names it; the server offers ALPN `h2`
//! (gRPC clients that insist on ALPN get it; linkerd2-proxy sends none).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::tls::{explain, provider, CertStore, TlsError};
use crate::trust::{BundleClientVerifier, BundleServerVerifier, TrustBundle};

/// The service account the control plane runs as.
pub const CONTROL_ACCOUNT: &str = "tether-control";
/// The namespace the control plane runs in unless told otherwise (the
/// namespace `tether install` uses by default).
pub const DEFAULT_NAMESPACE: &str = "tether-system";
/// ALPN both sides offer on the control-plane channel.
pub const ALPN_H2: &[u8] = b"h2";

/// How long a TCP connect to the control plane may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a mutual-TLS connection waits for this process's first
/// certificate before it gives up (and its caller retries).
const CERTIFICATE_WAIT: Duration = Duration::from_secs(5);

/// The control plane's identity in `namespace`.
pub fn control_identity(namespace: &str, trust_domain: &str) -> String {
    crate::identity_name(CONTROL_ACCOUNT, namespace, trust_domain)
}

/// The identity a proxy expects of the control plane when not told:
/// [`CONTROL_ACCOUNT`] in [`DEFAULT_NAMESPACE`] of its own trust domain.
pub fn default_control_identity(trust_domain: &str) -> String {
    control_identity(DEFAULT_NAMESPACE, trust_domain)
}

/// The trust domain of a DNS-like identity
/// (`<account>.<namespace>.serviceaccount.identity.<trust-domain>`).
pub fn trust_domain_of(identity: &str) -> Option<&str> {
    identity
        .split_once(".serviceaccount.identity.")
        .map(|(_, domain)| domain)
        .filter(|domain| !domain.is_empty())
}

/// The control plane's server configuration: its own certificate, client
/// certificates optional but verified against the trust root when given
/// (whether one is required is decided per API, after the handshake).
pub fn server_config(
    store: Arc<CertStore>,
    bundle: Arc<TrustBundle>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let verifier = Arc::new(BundleClientVerifier {
        bundle,
        optional: true,
    });
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(store);
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    // A resumed session carries the client authentication of the session
    // it resumes: a Certify connection made before the proxy had a
    // certificate would make its later connections anonymous.
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}

/// How a client reaches the control plane over TLS.
pub struct ControlTls {
    config: Arc<ClientConfig>,
    server_name: ServerName<'static>,
    expected: String,
    store: Arc<CertStore>,
}

impl ControlTls {
    /// Verifies the control plane as `expected` against `roots`; presents
    /// the certificate in `store` whenever one is held.
    pub fn new(
        expected: &str,
        store: Arc<CertStore>,
        roots: Arc<RootCertStore>,
    ) -> Result<Arc<Self>, TlsError> {
        Self::trusting(expected, store, TrustBundle::fixed(roots)?)
    }

    /// As [`ControlTls::new`], verifying against `bundle`'s roots at every
    /// handshake (a re-read bundle applies to the next connection).
    pub fn trusting(
        expected: &str,
        store: Arc<CertStore>,
        bundle: Arc<TrustBundle>,
    ) -> Result<Arc<Self>, TlsError> {
        let server_name = ServerName::try_from(expected.to_string()).map_err(|_| {
            TlsError::Config(format!(
                "control-plane identity {} is not a DNS-like name",
                tether_core::truncate::for_log(expected)
            ))
        })?;
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(BundleServerVerifier(bundle)))
            .with_client_cert_resolver(store.clone());
        config.alpn_protocols = vec![ALPN_H2.to_vec()];
        // See `server_config`: never resume a session made without a certificate.
        config.resumption = rustls::client::Resumption::disabled();
        Ok(Arc::new(Self {
            config: Arc::new(config),
            server_name,
            expected: expected.to_string(),
            store,
        }))
    }

    pub fn expected(&self) -> &str {
        &self.expected
    }
}

/// Whether a connection must present this process's certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Auth {
    /// Server-authenticated TLS (Certify): no certificate needed.
    Server,
    /// Mutual TLS: wait for this process's certificate before connecting.
    Mutual,
}

/// A lazily connecting gRPC channel to the control plane at `addr`: over
/// TLS as `tls` says, or plaintext when `tls` is `None`.
pub fn channel(
    addr: SocketAddr,
    tls: Option<(Arc<ControlTls>, Auth)>,
) -> tonic::transport::Channel {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("a socket address is a valid URI")
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true);
    endpoint.connect_with_connector_lazy(Connector { addr, tls })
}

/// Any stream the channel may run over.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

#[derive(Clone)]
struct Connector {
    addr: SocketAddr,
    tls: Option<(Arc<ControlTls>, Auth)>,
}

impl tonic::codegen::Service<tonic::codegen::http::Uri> for Connector {
    type Response = TokioIo<Box<dyn Io>>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: tonic::codegen::http::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { this.connect().await.map(TokioIo::new) })
    }
}

impl Connector {
    async fn connect(self) -> std::io::Result<Box<dyn Io>> {
        let addr = self.addr;
        let fail = |kind: std::io::ErrorKind, why: String| {
            std::io::Error::new(kind, format!("control plane {addr}: {why}"))
        };
        // Marked in transparent mode like the data path's connections: with
        // no connection tracking, a closed connection's last packets are
        // known as the proxy's by their mark alone.
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, crate::own_socket::connect(addr))
            .await
            .map_err(|_| fail(std::io::ErrorKind::TimedOut, "connect timed out".into()))?
            .map_err(|e| fail(e.kind(), e.to_string()))?;
        let _ = tcp.set_nodelay(true);
        let Some((tls, auth)) = self.tls else {
            return Ok(Box::new(tcp));
        };
        // After the TCP connect, so that a control plane that is down is
        // reported at once, not after the wait.
        if auth == Auth::Mutual
            && tls.store.current().is_none()
            && tokio::time::timeout(CERTIFICATE_WAIT, tls.store.wait_installed())
                .await
                .is_err()
        {
            return Err(fail(
                std::io::ErrorKind::NotConnected,
                "no certificate yet: this API needs mutual TLS with this proxy's certificate"
                    .into(),
            ));
        }
        let handshake = tokio_rustls::TlsConnector::from(tls.config.clone())
            .connect(tls.server_name.clone(), tcp);
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
            Ok(Ok(stream)) => Ok(Box::new(stream)),
            Ok(Err(e)) => Err(fail(
                std::io::ErrorKind::PermissionDenied,
                explain_control(&e, &tls.expected),
            )),
            Err(_) => Err(fail(
                std::io::ErrorKind::TimedOut,
                "TLS handshake timed out".into(),
            )),
        }
    }
}

/// Says why a TLS handshake with the control plane failed: another
/// identity, another trust root, or a control plane that does not speak
/// TLS at all.
pub fn explain_control(err: &std::io::Error, expected: &str) -> String {
    let plaintext = "it does not speak TLS (is it running with --insecure-control-plane? \
                     both sides must agree)";
    if matches!(
        err.kind(),
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
    ) {
        return format!("closed the TLS handshake: {plaintext}");
    }
    match err
        .get_ref()
        .and_then(|e| e.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. }) => {
            format!("answered the TLS handshake with something else: {plaintext}")
        }
        Some(rustls::Error::InvalidCertificate(_)) => format!(
            "impostor refused: {} (check --control-identity and --trust-root)",
            explain(err, expected)
        ),
        _ => explain(err, expected),
    }
}

/// The error chain of a gRPC status as one line: tonic keeps the
/// transport's reason (the handshake failure) in the source chain.
pub fn status_chain(status: &tonic::Status) -> String {
    let mut text = status.message().to_string();
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        let part = e.to_string();
        if !text.contains(&part) {
            text = format!("{text}: {part}");
        }
        source = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_control_identity_follows_the_trust_domain() {
        assert_eq!(
            trust_domain_of("web.demo.serviceaccount.identity.example.org"),
            Some("example.org")
        );
        assert_eq!(trust_domain_of("web.demo"), None);
        assert_eq!(
            default_control_identity("example.org"),
            "tether-control.tether-system.serviceaccount.identity.example.org"
        );
    }
}
