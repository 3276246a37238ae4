//! A workload's key pair and certificate signing request, made in memory:
//! the private key never touches disk.

use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, PKCS_ECDSA_P256_SHA256};

pub struct KeyAndCsr {
    /// PKCS#8 DER of the private key.
    pub key_pkcs8: Vec<u8>,
    /// DER of the CSR, as `Identity.Certify` carries it.
    pub csr_der: Vec<u8>,
}

/// An ECDSA P-256 key and a CSR asking for exactly `identity`.
pub fn generate(identity: &str) -> Result<KeyAndCsr, rcgen::Error> {
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)?;
    let mut params = CertificateParams::new(vec![identity.to_string()])?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, identity);
    params.distinguished_name = dn;
    let csr = params.serialize_request(&key)?;
    Ok(KeyAndCsr {
        key_pkcs8: key.serialize_der(),
        csr_der: csr.der().to_vec(),
    })
}
