//! Identity for Tether: who a workload is, and how that is proven.
//!
//! - [`ca`]: the trust root and the issuer (`tether identity init`), and
//!   signing a workload's CSR into a short-lived leaf certificate.
//! - [`token`]: bootstrap tokens that entitle a workload to one identity,
//!   behind the [`token::TokenValidator`] trait (Kubernetes mode will verify
//!   ServiceAccount tokens behind the same trait).
//! - [`csr`]: a workload's key pair and CSR, made in memory.
//! - [`cert`]: reading identities and expiry out of certificates.
//! - [`control`]: the channel between proxies and the control plane: the
//!   control plane's identity, its TLS configurations, and a tonic channel
//!   that verifies it.
//! - [`own_socket`]: the connections this process opens, marked as its
//!   own in transparent mode (`tether init --mode tproxy`).
//! - [`rotation`]: rotating the issuer and the trust root step by step.
//! - [`trust`]: the trust bundle (one or more roots), re-read in place,
//!   and the verifiers that consult it at every handshake.
//! - [`tls`]: rustls client and server configurations that present the
//!   current certificate (replaced in place on renewal) and verify peers
//!   against the trust root.
//!
//! Identities are DNS-like names:
//! `<account>.<namespace>.serviceaccount.identity.<trust-domain>`.

#![forbid(unsafe_code)]

pub mod ca;
pub mod cert;
pub mod control;
pub mod csr;
pub mod own_socket;
pub mod rotation;
pub mod tls;
pub mod token;
pub mod trust;

/// The identity of a workload's service account.
pub fn identity_name(account: &str, namespace: &str, trust_domain: &str) -> String {
    format!("{account}.{namespace}.serviceaccount.identity.{trust_domain}")
}
