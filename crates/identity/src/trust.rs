//! The trust bundle: the roots a process accepts peers from, swapped in
//! place when its file changes.
//!
//! `ca.crt` may hold several roots (a PEM bundle): during a root rotation
//! it holds the old and the new one, and a peer chaining to either is
//! accepted. rustls configurations are built once, so they verify through
//! [`BundleServerVerifier`] and [`BundleClientVerifier`], which ask the
//! bundle's current roots at every handshake: a re-read bundle applies to
//! new connections at once, and connections already made carry on.
//!
//! Reading is the caller's choice ([`FileStamps`] says when a file has
//! changed and stopped changing); a bundle that does not parse is never
//! installed, so the last good one stays in force.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};

use crate::tls::{provider, TlsError};

/// A short, stable name for a certificate: the first 16 hex digits of the
/// SHA-256 of its DER (what metrics and `tether check` show).
pub fn fingerprint(der: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One version of the bundle, with the verifiers built from it.
pub struct Trust {
    pub roots: Arc<RootCertStore>,
    /// Each root's [`fingerprint`], in file order.
    pub fingerprints: Vec<String>,
    server: Arc<WebPkiServerVerifier>,
    client_required: Arc<dyn ClientCertVerifier>,
    client_optional: Arc<dyn ClientCertVerifier>,
}

impl Trust {
    /// Reads a PEM bundle of one or more roots.
    pub fn read(path: &Path) -> Result<Self, TlsError> {
        let (roots, ders) = crate::tls::read_roots(path)?;
        let fingerprints = ders.iter().map(|d| fingerprint(d)).collect();
        Self::build(roots, fingerprints)
    }

    /// Trust in the roots of `roots` (never re-read).
    pub fn fixed(roots: RootCertStore) -> Result<Self, TlsError> {
        Self::build(roots, Vec::new())
    }

    fn build(roots: RootCertStore, fingerprints: Vec<String>) -> Result<Self, TlsError> {
        let roots = Arc::new(roots);
        let config = |e: rustls::server::VerifierBuilderError| TlsError::Config(e.to_string());
        let server = WebPkiServerVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(config)?;
        let client_required =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
                .build()
                .map_err(config)?;
        let client_optional =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
                .allow_unauthenticated()
                .build()
                .map_err(config)?;
        Ok(Self {
            roots,
            fingerprints,
            server,
            client_required,
            client_optional,
        })
    }

    /// Whether a certificate chain (leaf first) for `identity` chains to
    /// one of these roots now.
    pub fn verifies(&self, chain: &[CertificateDer<'_>], identity: &str) -> Result<(), String> {
        let (leaf, intermediates) = chain.split_first().ok_or("empty chain")?;
        let name = ServerName::try_from(identity.to_string()).map_err(|e| e.to_string())?;
        self.server
            .verify_server_cert(leaf, intermediates, &name, &[], UnixTime::now())
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// The roots in force, replaced whole when a new bundle is installed.
pub struct TrustBundle {
    current: RwLock<Arc<Trust>>,
    changes: tokio::sync::watch::Sender<u64>,
}

impl std::fmt::Debug for TrustBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrustBundle")
            .field("roots", &self.current().fingerprints)
            .finish()
    }
}

impl TrustBundle {
    pub fn new(trust: Trust) -> Arc<Self> {
        Arc::new(Self {
            current: RwLock::new(Arc::new(trust)),
            changes: tokio::sync::watch::channel(0).0,
        })
    }

    /// The bundle in `path`, as [`Trust::read`] reads it.
    pub fn load(path: &Path) -> Result<Arc<Self>, TlsError> {
        Trust::read(path).map(Self::new)
    }

    /// A bundle that is never replaced.
    pub fn fixed(roots: Arc<RootCertStore>) -> Result<Arc<Self>, TlsError> {
        Trust::fixed((*roots).clone()).map(Self::new)
    }

    pub fn current(&self) -> Arc<Trust> {
        self.current.read().unwrap().clone()
    }

    /// Puts `trust` in force for every handshake from now on.
    pub fn install(&self, trust: Trust) {
        *self.current.write().unwrap() = Arc::new(trust);
        self.changes.send_modify(|n| *n += 1);
    }

    /// Fires after every [`TrustBundle::install`].
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

/// Verifies servers against the bundle's current roots.
#[derive(Debug)]
pub struct BundleServerVerifier(pub Arc<TrustBundle>);

impl ServerCertVerifier for BundleServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0.current().server.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .server
            .verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0
            .current()
            .server
            .verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.current().server.supported_verify_schemes()
    }
}

/// Verifies clients against the bundle's current roots; with `optional`,
/// a client without a certificate is let through (the control plane
/// decides per API).
#[derive(Debug)]
pub struct BundleClientVerifier {
    pub bundle: Arc<TrustBundle>,
    pub optional: bool,
}

impl BundleClientVerifier {
    fn inner(&self) -> Arc<dyn ClientCertVerifier> {
        let trust = self.bundle.current();
        if self.optional {
            trust.client_optional.clone()
        } else {
            trust.client_required.clone()
        }
    }
}

impl ClientCertVerifier for BundleClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        !self.optional
    }

    // Hints are optional; Tether's and linkerd2-proxy's clients present
    // their one certificate whatever the hints say.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner().supported_verify_schemes()
    }
}

/// What a file looked like: enough to notice a rewrite, a rename over it,
/// or a symlink swap (Kubernetes' `..data`), following links.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<std::time::SystemTime>,
    inode: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some(Stamp {
        len: meta.len(),
        modified: meta.modified().ok(),
        inode: meta.ino(),
    })
}

/// Says when a set of files has changed and then stayed unchanged for one
/// look: a writer caught between two files (a new issuer's key and its
/// certificate) or in the middle of one is not read.
pub struct FileStamps {
    paths: Vec<PathBuf>,
    seen: Vec<Option<Stamp>>,
    read: Vec<Option<Stamp>>,
    looks: Option<tokio::time::Interval>,
}

impl FileStamps {
    /// Starts from the files as they are now (what the caller just read).
    pub fn new(paths: Vec<PathBuf>) -> Self {
        let now: Vec<_> = paths.iter().map(|p| stamp(p)).collect();
        Self {
            paths,
            seen: now.clone(),
            read: now,
            looks: None,
        }
    }

    /// Looks every `every` and returns once [`FileStamps::changed`] says
    /// the files should be read again.
    pub async fn next_change(&mut self, every: std::time::Duration) {
        loop {
            self.looks
                .get_or_insert_with(|| {
                    let mut looks = tokio::time::interval(every);
                    looks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    looks
                })
                .tick()
                .await;
            if self.changed() {
                return;
            }
        }
    }

    /// Whether the files should be read again: they differ from what was
    /// last read and are as they were at the previous look.
    pub fn changed(&mut self) -> bool {
        let now: Vec<_> = self.paths.iter().map(|p| stamp(p)).collect();
        let settled = now == self.seen;
        self.seen = now;
        if settled && self.seen != self.read {
            self.read = self.seen.clone();
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_is_reported_once_it_has_settled() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ca.crt");
        std::fs::write(&file, "one").unwrap();
        let mut stamps = FileStamps::new(vec![file.clone()]);
        assert!(!stamps.changed());
        std::fs::write(&file, "two!").unwrap();
        assert!(!stamps.changed(), "still being written, perhaps");
        assert!(stamps.changed());
        assert!(!stamps.changed(), "reported once");
        std::fs::remove_file(&file).unwrap();
        assert!(!stamps.changed());
        assert!(stamps.changed(), "a removal is a change too");
    }

    #[test]
    fn a_bundle_over_the_size_limit_is_refused_by_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ca.crt");
        let huge = std::fs::File::create(&file).unwrap();
        huge.set_len(crate::tls::MAX_TRUST_BUNDLE_BYTES + 1)
            .unwrap();
        let err = Trust::read(&file).err().expect("refused").to_string();
        let size = (crate::tls::MAX_TRUST_BUNDLE_BYTES + 1).to_string();
        assert!(
            err.contains(&size) && err.contains("over the limit"),
            "{err}"
        );
    }

    #[test]
    fn a_bundle_of_two_roots_names_both_in_file_order() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        for d in [&a, &b] {
            crate::ca::init(&crate::ca::InitOptions::new(d, "cluster.local")).unwrap();
        }
        let pem =
            |d: &std::path::Path| std::fs::read_to_string(d.join(crate::ca::CA_CERT)).unwrap();
        let bundle = dir.path().join("bundle.crt");
        std::fs::write(&bundle, pem(&a) + &pem(&b)).unwrap();
        let trust = Trust::read(&bundle).unwrap();
        let one = |d: &std::path::Path| {
            Trust::read(&d.join(crate::ca::CA_CERT))
                .unwrap()
                .fingerprints
        };
        assert_eq!(trust.fingerprints, [one(&a), one(&b)].concat());
    }
}
