//! Rotating the issuer and the trust root of an identity directory, step
//! by step (`tether identity rotate-root`, `rotate-issuer`, `finish`).
//!
//! A root rotation is three steps, each of which needs the one before to
//! have reached every proxy:
//!
//! 1. `rotate-root`: a new root is made (`next-ca.crt`, `next-ca.key`) and
//!    `ca.crt` becomes the bundle old + new. Nothing is signed by the new
//!    root yet, so nothing breaks; wait until every proxy trusts it.
//! 2. `rotate-issuer`: a new issuer signed by the new root. The control
//!    plane signs with it at once; proxies move to it as they renew. Wait
//!    until every proxy holds a certificate from it.
//! 3. `finish`: `ca.crt` holds only the new root, which becomes `ca.key`'s
//!    root; the old root is trusted no more.
//!
//! Outside a root rotation, `rotate-issuer` makes a new issuer from the
//! current root (an issuer rotation, one step). Where a rotation stands is
//! read from the files alone ([`status`]), so each step can check that it
//! comes in order.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{BasicConstraints, CertifiedIssuer, KeyPair, PKCS_ECDSA_P256_SHA256};

use crate::ca::{ca_params, write, InitError, Issuer, CA_CERT, CA_KEY, ISSUER_CERT, ISSUER_KEY};
use crate::trust::{fingerprint, Trust};

/// The new root during a root rotation.
pub const NEXT_CA_CERT: &str = "next-ca.crt";
pub const NEXT_CA_KEY: &str = "next-ca.key";

#[derive(Debug, thiserror::Error)]
pub enum RotationError {
    #[error("step out of order: {0}")]
    OutOfOrder(String),
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error(transparent)]
    Write(#[from] InitError),
    #[error(transparent)]
    Load(#[from] crate::ca::LoadError),
    #[error("generating certificates: {0}")]
    Generate(#[from] rcgen::Error),
}

/// Where a root rotation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// No root rotation under way.
    Steady,
    /// Step 1 done: `ca.crt` holds old and new roots; the issuer is still
    /// from the old one.
    NewRootTrusted,
    /// Step 2 done: the issuer is from the new root; `ca.crt` still holds
    /// the old one too.
    NewIssuer,
}

/// An identity directory as the rotation steps see it.
#[derive(Debug)]
pub struct Status {
    pub step: Step,
    /// Fingerprints of the roots in `ca.crt`.
    pub roots: Vec<String>,
    /// The new root's fingerprint during a root rotation.
    pub next_root: Option<String>,
    pub issuer: String,
    pub issuer_not_after: SystemTime,
}

impl Status {
    /// What the operator does next, and what to wait for first.
    pub fn next(&self) -> String {
        match self.step {
            Step::Steady => "no root rotation under way. To rotate the root: \
                 `tether identity rotate-root --dir DIR`; to replace only the issuer: \
                 `tether identity rotate-issuer --dir DIR`"
                .into(),
            Step::NewRootTrusted => format!(
                "wait until every proxy and control plane trusts the new root {} \
                 (`tether check --identity DIR --proxy ADMIN...` says so per proxy; \
                 proxies re-read their --trust-root file within a second of it changing: \
                 copy the new ca.crt to them first), then run \
                 `tether identity rotate-issuer --dir DIR`",
                self.next_root.as_deref().unwrap_or("?")
            ),
            Step::NewIssuer => format!(
                "wait until every proxy holds a certificate from issuer {} \
                 (`tether check` says so per proxy; proxies renew at 70% of their \
                 certificate's lifetime), then run `tether identity finish --dir DIR`",
                self.issuer
            ),
        }
    }
}

fn read(path: &Path) -> Result<String, RotationError> {
    std::fs::read_to_string(path).map_err(|e| RotationError::Invalid {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

fn trust_of(path: &Path) -> Result<Trust, RotationError> {
    Trust::read(path).map_err(|e| RotationError::Invalid {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// Reads where the rotation of `dir` stands.
pub fn status(dir: &Path) -> Result<Status, RotationError> {
    let bundle = trust_of(&dir.join(CA_CERT))?;
    let issuer = Issuer::load(dir)?;
    let next_path = dir.join(NEXT_CA_CERT);
    let (step, next_root) = if next_path.exists() {
        let next = trust_of(&next_path)?;
        let step = if issuer.check(&next).is_ok() {
            Step::NewIssuer
        } else {
            Step::NewRootTrusted
        };
        (step, next.fingerprints.first().cloned())
    } else {
        (Step::Steady, None)
    };
    Ok(Status {
        step,
        roots: bundle.fingerprints.clone(),
        next_root,
        issuer: issuer.fingerprint().to_string(),
        issuer_not_after: issuer.not_after(),
    })
}

/// The trust domain the directory's certificates are for, from the name
/// of its first root (`root.<domain>` or `root-<n>.<domain>`).
fn trust_domain(ca_pem: &str) -> Option<String> {
    use x509_parser::prelude::FromDer;
    let der = crate::ca::pem_to_der(ca_pem)?;
    let (_, cert) = x509_parser::certificate::X509Certificate::from_der(&der).ok()?;
    let cn = cert.subject().iter_common_name().next()?.as_str().ok()?;
    cn.split_once('.').map(|(_, domain)| domain.to_string())
}

/// Step 1: a new root, and `ca.crt` trusting old and new.
pub fn rotate_root(dir: &Path, lifetime: Duration) -> Result<Status, RotationError> {
    let current = status(dir)?;
    if current.step != Step::Steady {
        return Err(RotationError::OutOfOrder(format!(
            "a root rotation is already under way (new root {}): {}",
            current.next_root.as_deref().unwrap_or("?"),
            current.next()
        )));
    }
    let bundle_pem = read(&dir.join(CA_CERT))?;
    let domain = trust_domain(&bundle_pem).unwrap_or_else(|| "cluster.local".into());
    let serial = crate::ca::unix_secs(SystemTime::now());
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let root = CertifiedIssuer::self_signed(
        ca_params(
            &format!("root-{serial}.{domain}"),
            lifetime,
            BasicConstraints::Unconstrained,
        ),
        key,
    )?;
    // The new root's files first: until ca.crt changes, nothing uses them.
    write(&dir.join(NEXT_CA_KEY), &root.key().serialize_pem(), true)?;
    write(&dir.join(NEXT_CA_CERT), &root.pem(), false)?;
    let mut bundle = bundle_pem.trim_end().to_string();
    bundle.push('\n');
    bundle.push_str(&root.pem());
    write(&dir.join(CA_CERT), &bundle, false)?;
    status(dir)
}

/// Step 2 (or an issuer rotation alone): a new issuer from the new root
/// during a root rotation, else from the current root (`ca.key`).
pub fn rotate_issuer(dir: &Path, lifetime: Duration) -> Result<Status, RotationError> {
    let current = status(dir)?;
    let (cert_file, key_file) = match current.step {
        Step::Steady => (CA_CERT, CA_KEY),
        Step::NewRootTrusted | Step::NewIssuer => (NEXT_CA_CERT, NEXT_CA_KEY),
    };
    let key_path = dir.join(key_file);
    if !key_path.exists() {
        return Err(RotationError::Invalid {
            path: key_path,
            reason: "missing: a new issuer is signed with the root's key \
                     (kept offline? bring it back for this step)"
                .into(),
        });
    }
    let key = KeyPair::from_pem(&read(&key_path)?).map_err(|e| RotationError::Invalid {
        path: key_path.clone(),
        reason: format!("not a private key: {e}"),
    })?;
    // The root of `ca.crt` that is this key's (ca.crt may be a bundle).
    let root_pem =
        root_for_key(&read(&dir.join(cert_file))?, &key).ok_or_else(|| RotationError::Invalid {
            path: dir.join(cert_file),
            reason: format!("no certificate in it matches the key in {key_file}"),
        })?;
    let root =
        rcgen::Issuer::from_ca_cert_pem(&root_pem, key).map_err(|e| RotationError::Invalid {
            path: dir.join(cert_file),
            reason: format!("not a CA certificate: {e}"),
        })?;
    let domain = trust_domain(&root_pem).unwrap_or_else(|| "cluster.local".into());
    let issuer_key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let issuer_key_pem = issuer_key.serialize_pem();
    let issuer = CertifiedIssuer::signed_by(
        ca_params(
            &format!("identity.{domain}"),
            lifetime,
            BasicConstraints::Constrained(0),
        ),
        issuer_key,
        &root,
    )?;
    // Both files are written aside and then renamed one after the other;
    // readers wait for the directory to settle (`trust::FileStamps`), and
    // a control plane that reads a mismatched pair keeps its old issuer.
    write(&dir.join(ISSUER_KEY), &issuer_key_pem, true)?;
    write(&dir.join(ISSUER_CERT), &issuer.pem(), false)?;
    status(dir)
}

fn root_for_key(bundle_pem: &str, key: &KeyPair) -> Option<String> {
    use rcgen::PublicKeyData;
    use x509_parser::prelude::FromDer;
    const END: &str = "-----END CERTIFICATE-----";
    bundle_pem
        .split_inclusive(END)
        .map(|block| block.trim_start().to_string())
        .find(|block| {
            crate::ca::pem_to_der(block).is_some_and(|der| {
                x509_parser::certificate::X509Certificate::from_der(&der).is_ok_and(|(_, c)| {
                    c.public_key().subject_public_key.data.as_ref() == key.der_bytes()
                })
            })
        })
}

/// Step 3: `ca.crt` holds only the new root, whose key becomes `ca.key`.
pub fn finish(dir: &Path) -> Result<Status, RotationError> {
    let current = status(dir)?;
    match current.step {
        Step::Steady => {
            return Err(RotationError::OutOfOrder(
                "no root rotation is under way (there is no next-ca.crt): \
                 start one with `tether identity rotate-root --dir DIR`"
                    .into(),
            ))
        }
        Step::NewRootTrusted => {
            return Err(RotationError::OutOfOrder(format!(
                "the issuer {} is still signed by the old root: dropping that root now \
                 would break every certificate it issued. Run \
                 `tether identity rotate-issuer --dir DIR` first, and wait until every \
                 proxy holds a certificate from the new issuer",
                current.issuer
            )))
        }
        Step::NewIssuer => {}
    }
    let next_pem = read(&dir.join(NEXT_CA_CERT))?;
    // ca.crt first: if this stops half-way, the directory still reads as
    // step 2 and `finish` can run again.
    write(&dir.join(CA_CERT), &next_pem, false)?;
    let next_key = dir.join(NEXT_CA_KEY);
    if next_key.exists() {
        std::fs::rename(&next_key, dir.join(CA_KEY)).map_err(|e| RotationError::Invalid {
            path: next_key.clone(),
            reason: e.to_string(),
        })?;
    }
    let next_cert = dir.join(NEXT_CA_CERT);
    std::fs::remove_file(&next_cert).map_err(|e| RotationError::Invalid {
        path: next_cert,
        reason: e.to_string(),
    })?;
    status(dir)
}

/// The fingerprint of the first certificate in a PEM file, if readable.
pub fn file_fingerprint(path: &Path) -> Option<String> {
    let pem = std::fs::read_to_string(path).ok()?;
    crate::ca::pem_to_der(&pem).map(|der| fingerprint(&der))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::{init, InitOptions};

    const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);

    #[test]
    fn a_root_rotation_goes_step_by_step_and_refuses_steps_out_of_order() {
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path();
        init(&InitOptions::new(dir, "example.org")).unwrap();
        let start = status(dir).unwrap();
        assert_eq!(start.step, Step::Steady);
        assert_eq!(start.roots.len(), 1);
        let err = finish(dir).unwrap_err().to_string();
        assert!(err.contains("no root rotation is under way"), "{err}");

        let one = rotate_root(dir, YEAR).unwrap();
        assert_eq!(one.step, Step::NewRootTrusted);
        assert_eq!(one.roots.len(), 2);
        assert_eq!(one.roots[0], start.roots[0]);
        assert_eq!(one.next_root.as_deref(), Some(one.roots[1].as_str()));
        assert_eq!(one.issuer, start.issuer, "the issuer is untouched");
        let err = rotate_root(dir, YEAR).unwrap_err().to_string();
        assert!(err.contains("already under way"), "{err}");
        let err = finish(dir).unwrap_err().to_string();
        assert!(err.contains("still signed by the old root"), "{err}");

        let two = rotate_issuer(dir, YEAR).unwrap();
        assert_eq!(two.step, Step::NewIssuer);
        assert_ne!(two.issuer, start.issuer);
        assert_eq!(two.roots.len(), 2);
        // Certificates from both issuers are trusted meanwhile.
        let bundle = Trust::read(&dir.join(CA_CERT)).unwrap();
        Issuer::load(dir).unwrap().check(&bundle).unwrap();

        let three = finish(dir).unwrap();
        assert_eq!(three.step, Step::Steady);
        assert_eq!(three.roots, vec![one.next_root.clone().unwrap()]);
        assert!(!dir.join(NEXT_CA_CERT).exists() && !dir.join(NEXT_CA_KEY).exists());
        // The new root signs the next issuer rotation.
        let four = rotate_issuer(dir, YEAR).unwrap();
        assert_eq!(four.roots, three.roots);
        assert_ne!(four.issuer, three.issuer);
    }

    #[test]
    fn a_mismatched_or_foreign_issuer_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        init(&InitOptions::new(dir.path(), "cluster.local")).unwrap();
        init(&InitOptions::new(other.path(), "cluster.local")).unwrap();
        let bundle = Trust::read(&dir.path().join(CA_CERT)).unwrap();
        // Another directory's issuer: a fine issuer, from another root.
        let foreign = Issuer::load(other.path()).unwrap();
        let err = foreign.check(&bundle).unwrap_err().to_string();
        assert!(err.contains("does not chain to any root"), "{err}");
        // A certificate with someone else's key.
        std::fs::copy(other.path().join(ISSUER_KEY), dir.path().join(ISSUER_KEY)).unwrap();
        let err = Issuer::load(dir.path()).err().unwrap().to_string();
        assert!(err.contains("the key does not match"), "{err}");
    }
}
