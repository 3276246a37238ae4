//! The trust root and the issuer.
//!
//! `init` creates a self-signed root (the trust anchor every proxy trusts)
//! and an issuer certificate signed by it; the control plane signs leaf
//! certificates with the issuer. All keys are ECDSA P-256. Files in the
//! identity directory:
//!
//! | file | what |
//! | --- | --- |
//! | `ca.crt` | trust root certificate (give this to every proxy) |
//! | `ca.key` | trust root key (keep offline; only needed to make a new issuer) |
//! | `issuer.crt`, `issuer.key` | the issuer the control plane signs with |
//! | `token.key` | the secret behind local bootstrap tokens |

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, CertifiedIssuer,
    DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType,
    PKCS_ECDSA_P256_SHA256,
};
use tether_core::truncate::{bounded_message, for_log};
use time::OffsetDateTime;

use crate::token::{LocalTokens, TOKEN_KEY};

pub const CA_CERT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";
pub const ISSUER_CERT: &str = "issuer.crt";
pub const ISSUER_KEY: &str = "issuer.key";

/// Clock skew tolerated between machines: certificates start this early.
const BACKDATE: Duration = Duration::from_secs(300);

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("{0} already exists; pass --force to replace the trust root and issuer")]
    Exists(PathBuf),
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("generating certificates: {0}")]
    Generate(#[from] rcgen::Error),
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SignError {
    #[error("malformed CSR: {0}")]
    MalformedCsr(String),
    // The names come from the client: shown cut short.
    #[error(
        "CSR asks for {}, but the token allows only {}",
        bounded_message(format_args!("{requested:?}")),
        for_log(allowed)
    )]
    WrongName {
        requested: Vec<String>,
        allowed: String,
    },
    #[error("issuer certificate expired at {0} (unix seconds); run `tether identity init --force` or install a new issuer")]
    IssuerExpired(u64),
    #[error("signing failed: {0}")]
    Signing(String),
}

pub struct InitOptions {
    pub out: PathBuf,
    pub trust_domain: String,
    pub force: bool,
    pub root_lifetime: Duration,
    pub issuer_lifetime: Duration,
}

impl InitOptions {
    pub fn new(out: impl Into<PathBuf>, trust_domain: &str) -> Self {
        Self {
            out: out.into(),
            trust_domain: trust_domain.to_string(),
            force: false,
            root_lifetime: Duration::from_secs(10 * 365 * 24 * 3600),
            issuer_lifetime: Duration::from_secs(365 * 24 * 3600),
        }
    }
}

pub struct InitReport {
    pub files: Vec<PathBuf>,
    pub root_expires: SystemTime,
    pub issuer_expires: SystemTime,
}

pub(crate) fn write(path: &Path, contents: &str, secret: bool) -> Result<(), InitError> {
    let err = |source| InitError::Write {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).map_err(err)?;
    if secret {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    }
    std::fs::rename(&tmp, path).map_err(err)
}

pub(crate) fn ca_params(
    common_name: &str,
    lifetime: Duration,
    constraint: BasicConstraints,
) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(constraint);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let now = SystemTime::now();
    params.not_before = OffsetDateTime::from(now - BACKDATE);
    params.not_after = OffsetDateTime::from(now + lifetime);
    params
}

/// Creates the trust root, issuer and token secret in `opts.out`.
pub fn init(opts: &InitOptions) -> Result<InitReport, InitError> {
    std::fs::create_dir_all(&opts.out).map_err(|source| InitError::Write {
        path: opts.out.clone(),
        source,
    })?;
    let files: Vec<PathBuf> = [CA_CERT, CA_KEY, ISSUER_CERT, ISSUER_KEY, TOKEN_KEY]
        .iter()
        .map(|f| opts.out.join(f))
        .collect();
    if !opts.force {
        if let Some(existing) = files.iter().find(|f| f.exists()) {
            return Err(InitError::Exists(existing.clone()));
        }
    }
    let root_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let root = CertifiedIssuer::self_signed(
        ca_params(
            &format!("root.{}", opts.trust_domain),
            opts.root_lifetime,
            BasicConstraints::Unconstrained,
        ),
        root_key,
    )?;
    let issuer_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let issuer_key_pem = issuer_key.serialize_pem();
    let issuer = CertifiedIssuer::signed_by(
        ca_params(
            &format!("identity.{}", opts.trust_domain),
            opts.issuer_lifetime,
            BasicConstraints::Constrained(0),
        ),
        issuer_key,
        &root,
    )?;
    write(&files[0], &root.pem(), false)?;
    write(&files[1], &root.key().serialize_pem(), true)?;
    write(&files[2], &issuer.pem(), false)?;
    write(&files[3], &issuer_key_pem, true)?;
    write(&files[4], &LocalTokens::new_secret(), true)?;
    let now = SystemTime::now();
    Ok(InitReport {
        files,
        root_expires: now + opts.root_lifetime,
        issuer_expires: now + opts.issuer_lifetime,
    })
}

/// The issuer, loaded by the control plane to sign leaf certificates.
pub struct Issuer {
    issuer: rcgen::Issuer<'static, KeyPair>,
    issuer_der: Vec<u8>,
    not_after: SystemTime,
    fingerprint: String,
}

/// Why an issuer cannot be used with a trust bundle.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IssuerProblem {
    #[error("issuer certificate {fingerprint} expired at {not_after} (unix seconds)")]
    Expired { fingerprint: String, not_after: u64 },
    #[error("issuer certificate {fingerprint} does not chain to any root in the trust bundle ({roots}): {reason}")]
    Unchained {
        fingerprint: String,
        roots: String,
        reason: String,
    },
}

/// Unix seconds, for messages.
pub fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn read(path: &Path) -> Result<String, LoadError> {
    std::fs::read_to_string(path).map_err(|source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// The DER of the first certificate in a PEM file.
pub fn pem_to_der(pem: &str) -> Option<Vec<u8>> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()?
        .ok()
        .map(|c| c.to_vec())
}

impl Issuer {
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let cert_path = dir.join(ISSUER_CERT);
        let key_path = dir.join(ISSUER_KEY);
        let cert_pem = read(&cert_path)?;
        let key_pem = read(&key_path)?;
        let invalid = |path: &Path, reason: String| LoadError::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        let key = KeyPair::from_pem(&key_pem)
            .map_err(|e| invalid(&key_path, format!("not a private key: {e}")))?;
        let issuer_der = pem_to_der(&cert_pem)
            .ok_or_else(|| invalid(&cert_path, "no certificate in file".into()))?;
        let not_after = crate::cert::not_after(&issuer_der)
            .ok_or_else(|| invalid(&cert_path, "unreadable validity period".into()))?;
        if !key_matches(&key, &issuer_der) {
            return Err(invalid(
                &key_path,
                format!("the key does not match the certificate in {ISSUER_CERT} (a new issuer needs both files)"),
            ));
        }
        let issuer = rcgen::Issuer::from_ca_cert_pem(&cert_pem, key).map_err(|e| {
            invalid(
                &cert_path,
                format!("not a CA certificate for this key: {e}"),
            )
        })?;
        // Also check the trust root is there: proxies will need it.
        read(&dir.join(CA_CERT))?;
        Ok(Self {
            issuer,
            fingerprint: crate::trust::fingerprint(&issuer_der),
            issuer_der,
            not_after,
        })
    }

    pub fn not_after(&self) -> SystemTime {
        self.not_after
    }

    /// The issuer certificate's [`crate::trust::fingerprint`].
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Whether this issuer is valid now and chains to a root of `trust`:
    /// it signs a throw-away certificate, which a peer trusting `trust`
    /// must accept.
    pub fn check(&self, trust: &crate::trust::Trust) -> Result<(), IssuerProblem> {
        const PROBE: &str = "issuer-check.tether.invalid";
        if self.not_after <= SystemTime::now() {
            return Err(IssuerProblem::Expired {
                fingerprint: self.fingerprint.clone(),
                not_after: unix_secs(self.not_after),
            });
        }
        let unchained = |reason: String| IssuerProblem::Unchained {
            fingerprint: self.fingerprint.clone(),
            roots: trust.fingerprints.join(", "),
            reason,
        };
        let probe = crate::csr::generate(PROBE).map_err(|e| unchained(e.to_string()))?;
        let issued = self
            .sign(&probe.csr_der, PROBE, Duration::from_secs(60))
            .map_err(|e| unchained(e.to_string()))?;
        let chain: Vec<rustls::pki_types::CertificateDer> = std::iter::once(issued.leaf_der)
            .chain(issued.chain)
            .map(Into::into)
            .collect();
        trust.verifies(&chain, PROBE).map_err(unchained)
    }

    /// Signs `csr_der` into a leaf for `identity` valid for `lifetime`
    /// (capped at the issuer's own expiry). Returns the leaf and the chain
    /// above it (the issuer), DER-encoded, and the leaf's expiry.
    pub fn sign(
        &self,
        csr_der: &[u8],
        identity: &str,
        lifetime: Duration,
    ) -> Result<Issued, SignError> {
        let now = SystemTime::now();
        if self.not_after <= now {
            let secs = self
                .not_after
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            return Err(SignError::IssuerExpired(secs));
        }
        let der = rustls::pki_types::CertificateSigningRequestDer::from(csr_der);
        let mut csr = CertificateSigningRequestParams::from_der(&der)
            .map_err(|e| SignError::MalformedCsr(bounded_message(e)))?;
        let requested: Vec<String> = csr
            .params
            .subject_alt_names
            .iter()
            .map(|san| match san {
                SanType::DnsName(n) => n.as_str().to_string(),
                other => format!("{other:?}"),
            })
            .collect();
        if requested != [identity] {
            return Err(SignError::WrongName {
                requested,
                allowed: identity.to_string(),
            });
        }
        let valid_until = (now + lifetime).min(self.not_after);
        // The CSR chooses only the key and the name; everything else is ours.
        let mut params = CertificateParams::new(vec![identity.to_string()])
            .map_err(|e| SignError::Signing(e.to_string()))?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, identity);
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.not_before = OffsetDateTime::from(now - BACKDATE.min(lifetime));
        params.not_after = OffsetDateTime::from(valid_until);
        params.use_authority_key_identifier_extension = true;
        csr.params = params;
        let leaf = csr
            .signed_by(&self.issuer)
            .map_err(|e| SignError::Signing(e.to_string()))?;
        Ok(Issued {
            leaf_der: leaf.der().to_vec(),
            chain: vec![self.issuer_der.clone()],
            valid_until,
        })
    }
}

/// Whether `key` is the key of the certificate `cert_der`.
fn key_matches(key: &KeyPair, cert_der: &[u8]) -> bool {
    use rcgen::PublicKeyData;
    use x509_parser::prelude::FromDer;
    x509_parser::certificate::X509Certificate::from_der(cert_der)
        .map(|(_, cert)| cert.public_key().subject_public_key.data.as_ref() == key.der_bytes())
        .unwrap_or(false)
}

pub struct Issued {
    pub leaf_der: Vec<u8>,
    pub chain: Vec<Vec<u8>>,
    pub valid_until: SystemTime,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (tempfile::TempDir, Issuer) {
        let dir = tempfile::tempdir().unwrap();
        init(&InitOptions::new(dir.path(), "cluster.local")).unwrap();
        let issuer = Issuer::load(dir.path()).unwrap();
        (dir, issuer)
    }

    #[test]
    fn init_never_overwrites_without_force() {
        let (dir, _) = setup();
        let before = std::fs::read(dir.path().join(CA_CERT)).unwrap();
        let err = init(&InitOptions::new(dir.path(), "cluster.local"))
            .err()
            .unwrap();
        assert!(matches!(err, InitError::Exists(_)), "{err}");
        assert_eq!(std::fs::read(dir.path().join(CA_CERT)).unwrap(), before);
        let mut opts = InitOptions::new(dir.path(), "cluster.local");
        opts.force = true;
        init(&opts).unwrap();
        assert_ne!(std::fs::read(dir.path().join(CA_CERT)).unwrap(), before);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join(ISSUER_KEY))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn signs_exactly_the_allowed_identity() {
        let (_dir, issuer) = setup();
        let id = "web.demo.serviceaccount.identity.cluster.local";
        let kc = crate::csr::generate(id).unwrap();
        let issued = issuer
            .sign(&kc.csr_der, id, Duration::from_secs(60))
            .unwrap();
        assert_eq!(
            crate::cert::dns_names(&issued.leaf_der),
            vec![id.to_string()]
        );
        assert_eq!(issued.chain.len(), 1);
        let left = issued
            .valid_until
            .duration_since(SystemTime::now())
            .unwrap();
        assert!(left <= Duration::from_secs(60) && left > Duration::from_secs(50));

        let err = issuer.sign(
            &kc.csr_der,
            "db.demo.serviceaccount.identity.cluster.local",
            Duration::from_secs(60),
        );
        assert!(
            matches!(err, Err(SignError::WrongName { .. })),
            "{:?}",
            err.err()
        );
        let err = issuer.sign(b"not a csr", id, Duration::from_secs(60));
        assert!(matches!(err, Err(SignError::MalformedCsr(_))));
        // A CSR whose signature does not match its contents.
        let mut tampered = kc.csr_der.clone();
        let n = tampered.len();
        tampered[n - 5] ^= 0xff;
        assert!(matches!(
            issuer.sign(&tampered, id, Duration::from_secs(60)),
            Err(SignError::MalformedCsr(_))
        ));
    }

    /// The longest refusal a Certify caller can provoke.
    const MAX_ERROR_BYTES: usize = 1024;

    /// A CSR naming many long identities is refused with its names cut
    /// short (they go back to the caller and into the log).
    #[test]
    fn wrong_names_are_not_echoed_whole() {
        let (_dir, issuer) = setup();
        let names: Vec<String> = (0..2000)
            .map(|i| format!("{i}.{}", "n".repeat(200)))
            .collect();
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let csr = CertificateParams::new(names)
            .unwrap()
            .serialize_request(&key)
            .unwrap();
        let Err(err) = issuer.sign(csr.der(), "a.b", Duration::from_secs(60)) else {
            panic!("signed a CSR for the wrong names");
        };
        assert!(matches!(err, SignError::WrongName { .. }));
        let shown = err.to_string();
        assert!(shown.len() < MAX_ERROR_BYTES, "{} bytes", shown.len());
    }

    /// Whatever bytes arrive as a CSR (noise, or a valid CSR cut, extended
    /// or with bytes changed), signing never panics, refusals are short,
    /// and a certificate is only ever issued for the allowed identity.
    #[test]
    fn arbitrary_csr_bytes() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, TestRunner};
        let (_dir, issuer) = setup();
        let id = "web.demo.serviceaccount.identity.cluster.local";
        let valid = crate::csr::generate(id).unwrap().csr_der;
        let len = valid.len();
        let noise = proptest::collection::vec(any::<u8>(), 0..1024);
        let mutated = (
            proptest::collection::vec((0..len, any::<u8>()), 0..4),
            0..=len,
            proptest::collection::vec(any::<u8>(), 0..8),
        )
            .prop_map(move |(changes, cut, tail)| {
                let mut bytes = valid.clone();
                for (at, byte) in changes {
                    bytes[at] = byte;
                }
                bytes.truncate(cut);
                bytes.extend(tail);
                bytes
            });
        let mut runner = TestRunner::new(Config::with_cases(256));
        runner
            .run(&prop_oneof![noise, mutated], |bytes| {
                match issuer.sign(&bytes, id, Duration::from_secs(60)) {
                    Ok(issued) => prop_assert_eq!(
                        crate::cert::dns_names(&issued.leaf_der),
                        vec![id.to_string()]
                    ),
                    Err(e) => prop_assert!(e.to_string().len() < MAX_ERROR_BYTES),
                }
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn an_expired_issuer_signs_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = InitOptions::new(dir.path(), "cluster.local");
        opts.issuer_lifetime = Duration::from_secs(1);
        init(&opts).unwrap();
        std::thread::sleep(Duration::from_millis(2100));
        let issuer = Issuer::load(dir.path()).unwrap();
        let kc = crate::csr::generate("a.b").unwrap();
        assert!(matches!(
            issuer.sign(&kc.csr_der, "a.b", Duration::from_secs(60)),
            Err(SignError::IssuerExpired(_))
        ));
    }
}
