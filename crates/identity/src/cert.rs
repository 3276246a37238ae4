//! Reading what a certificate says: its identity and its expiry.

use std::time::{Duration, SystemTime};

use x509_parser::extensions::GeneralName;
use x509_parser::prelude::FromDer;

/// The DNS names a certificate is valid for.
pub fn dns_names(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = x509_parser::certificate::X509Certificate::from_der(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::DNSName(d) => Some(d.to_string()),
            _ => None,
        })
        .collect()
}

/// The identity a (verified) peer certificate names: its first DNS name.
pub fn identity_of(der: &[u8]) -> Option<String> {
    dns_names(der).into_iter().next()
}

/// When the certificate stops being valid.
pub fn not_after(der: &[u8]) -> Option<SystemTime> {
    let (_, cert) = x509_parser::certificate::X509Certificate::from_der(der).ok()?;
    let secs = cert.validity().not_after.timestamp();
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).ok()?))
}
