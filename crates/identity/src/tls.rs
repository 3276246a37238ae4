//! rustls configurations for mutual TLS between proxies.
//!
//! A [`CertStore`] holds the workload's current certificate and key; both
//! the client and the server configuration read it on every handshake, so a
//! renewal takes effect for new connections at once while existing ones
//! carry on. Peers are verified against the trust root only: the server
//! name a client checks is the identity discovery said the endpoint has,
//! and the server reads the client's identity from its verified certificate.

use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

use rustls::client::ResolvesClientCert;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{pem::PemObject, CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig, SignatureScheme};

use crate::trust::{BundleClientVerifier, BundleServerVerifier, TrustBundle};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading trust root {path}: {reason}")]
    TrustRoot { path: String, reason: String },
    #[error("invalid certificate or key: {0}")]
    Key(String),
    #[error("building TLS configuration: {0}")]
    Config(String),
}

pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The largest trust bundle read: a few hundred roots. The bundle is
/// re-read while the proxy serves, on its only thread.
pub const MAX_TRUST_BUNDLE_BYTES: u64 = 1024 * 1024;

/// Loads the trust anchors from a PEM file (`ca.crt`).
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    read_roots(path).map(|(roots, _)| roots)
}

/// The trust anchors of a PEM file and each one's DER, in file order: the
/// file read once, at most [`MAX_TRUST_BUNDLE_BYTES`] of it.
pub(crate) fn read_roots(path: &Path) -> Result<(RootCertStore, Vec<Vec<u8>>), TlsError> {
    let err = |reason: String| TlsError::TrustRoot {
        path: path.display().to_string(),
        reason,
    };
    let pem = tether_core::file::read_bounded(path, MAX_TRUST_BUNDLE_BYTES)
        .map_err(|e| err(e.to_string()))?;
    let mut roots = RootCertStore::empty();
    let mut ders = Vec::new();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| err(format!("not PEM: {e}")))?;
        ders.push(cert.to_vec());
        roots
            .add(cert)
            .map_err(|e| err(format!("not a usable CA certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(err("no certificate in file".into()));
    }
    Ok((roots, ders))
}

/// The current certificate of this workload, replaced in place on renewal.
#[derive(Debug)]
pub struct CertStore {
    current: RwLock<Option<(Arc<CertifiedKey>, SystemTime)>>,
    provider: Arc<CryptoProvider>,
    /// Whether a certificate was ever installed, for those who wait for one.
    installed: tokio::sync::watch::Sender<bool>,
}

impl CertStore {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            current: RwLock::new(None),
            provider: provider(),
            installed: tokio::sync::watch::channel(false).0,
        })
    }

    /// Installs a leaf (DER), its chain and the key (PKCS#8 DER).
    pub fn install(
        &self,
        leaf: Vec<u8>,
        chain: Vec<Vec<u8>>,
        key_pkcs8: Vec<u8>,
        expires: SystemTime,
    ) -> Result<(), TlsError> {
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key_pkcs8));
        let signing_key = self
            .provider
            .key_provider
            .load_private_key(key)
            .map_err(|e| TlsError::Key(e.to_string()))?;
        let certs = std::iter::once(leaf)
            .chain(chain)
            .map(CertificateDer::from)
            .collect();
        let ck = CertifiedKey::new(certs, signing_key);
        ck.keys_match().map_err(|e| TlsError::Key(e.to_string()))?;
        *self.current.write().unwrap() = Some((Arc::new(ck), expires));
        self.installed.send_replace(true);
        Ok(())
    }

    pub fn current(&self) -> Option<Arc<CertifiedKey>> {
        self.current
            .read()
            .unwrap()
            .as_ref()
            .map(|(c, _)| c.clone())
    }

    /// Whether a certificate is held and has not expired.
    pub fn has_valid(&self) -> bool {
        self.current
            .read()
            .unwrap()
            .as_ref()
            .is_some_and(|(_, exp)| *exp > SystemTime::now())
    }

    /// Returns once a certificate has been installed.
    pub async fn wait_installed(&self) {
        let mut installed = self.installed.subscribe();
        let _ = installed.wait_for(|held| *held).await;
    }

    /// The current certificate's chain, leaf first.
    pub fn chain(&self) -> Option<Vec<CertificateDer<'static>>> {
        self.current().map(|c| c.cert.clone())
    }

    pub fn expires(&self) -> Option<SystemTime> {
        self.current.read().unwrap().as_ref().map(|(_, e)| *e)
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current()
    }
}

impl ResolvesClientCert for CertStore {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        self.current()
    }

    fn has_certs(&self) -> bool {
        self.current.read().unwrap().is_some()
    }
}

/// Server side: present our certificate, require a client certificate
/// chaining to the trust root.
pub fn server_config(
    store: Arc<CertStore>,
    roots: Arc<RootCertStore>,
) -> Result<Arc<ServerConfig>, TlsError> {
    server_config_trusting(store, TrustBundle::fixed(roots)?)
}

/// As [`server_config`], verifying clients against `bundle`'s roots at
/// every handshake (it may be replaced while the configuration lives).
pub fn server_config_trusting(
    store: Arc<CertStore>,
    bundle: Arc<TrustBundle>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let verifier = Arc::new(BundleClientVerifier {
        bundle,
        optional: false,
    });
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(store);
    Ok(Arc::new(config))
}

/// Client side: verify the server against the trust root (and the expected
/// identity, given as the server name), present our certificate.
pub fn client_config(
    store: Arc<CertStore>,
    roots: Arc<RootCertStore>,
) -> Result<Arc<ClientConfig>, TlsError> {
    client_config_trusting(store, TrustBundle::fixed(roots)?)
}

/// As [`client_config`], verifying servers against `bundle`'s roots at
/// every handshake.
pub fn client_config_trusting(
    store: Arc<CertStore>,
    bundle: Arc<TrustBundle>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(BundleServerVerifier(bundle)))
        .with_client_cert_resolver(store);
    Ok(Arc::new(config))
}

/// Explains a handshake failure, naming expected and presented identities
/// when the peer is someone else.
pub fn explain(err: &std::io::Error, expected: &str) -> String {
    let Some(tls) = err
        .get_ref()
        .and_then(|e| e.downcast_ref::<rustls::Error>())
    else {
        return format!("TLS handshake with {expected} failed: {err}");
    };
    match tls {
        rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForNameContext {
            presented,
            ..
        }) => {
            format!(
                "server presented identity {}, expected {expected}",
                presented.join(", ")
            )
        }
        rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName) => {
            format!("server presented another identity, expected {expected}")
        }
        rustls::Error::InvalidCertificate(
            rustls::CertificateError::UnknownIssuer | rustls::CertificateError::BadSignature,
        ) => {
            format!("server certificate for {expected} does not chain to the trust root")
        }
        other => format!("TLS handshake with {expected} failed: {other}"),
    }
}
