//! How operator tools reach the control plane's gRPC port.
//!
//! Over TLS, verifying the control plane's identity against the trust root;
//! the tool presents a short-lived certificate for
//! `tether-operator.tether-system.serviceaccount.identity.<domain>` that it
//! signs itself with the identity directory's issuer (whoever holds the
//! issuer key can mint any identity anyway). Plaintext with
//! `--insecure-control-plane`.

use std::path::PathBuf;
use std::sync::Arc;

use tether_identity::control::{Auth, ControlTls};

/// The identity operator tools present.
pub const OPERATOR_ACCOUNT: &str = "tether-operator";

/// How to reach control planes.
#[derive(Clone, Debug, Default)]
pub struct ControlAccess {
    /// Plaintext gRPC.
    pub insecure: bool,
    /// The identity directory (trust root and issuer).
    pub identity_dir: Option<PathBuf>,
    /// The identity control planes must present (default: derived from
    /// `trust_domain`).
    pub control_identity: Option<String>,
    pub trust_domain: String,
}

impl ControlAccess {
    /// A channel to `control` (`host:port`), connected lazily.
    pub async fn channel(&self, control: &str) -> Result<tonic::transport::Channel, String> {
        let addr = tokio::net::lookup_host(control)
            .await
            .map_err(|e| format!("{control:?} does not resolve: {e}"))?
            .next()
            .ok_or_else(|| format!("{control:?} resolves to no address"))?;
        if self.insecure {
            return Ok(tether_identity::control::channel(addr, None));
        }
        let dir = self.identity_dir.as_ref().ok_or(
            "the control plane speaks TLS: give --identity DIR (its trust root and issuer) \
             or --insecure-control-plane",
        )?;
        let issuer = tether_identity::ca::Issuer::load(dir).map_err(|e| e.to_string())?;
        let store = tether_identity::tls::CertStore::new();
        let me = tether_identity::identity_name(
            OPERATOR_ACCOUNT,
            tether_identity::control::DEFAULT_NAMESPACE,
            &self.trust_domain,
        );
        // A fixed issuer: the sender goes, and the certificate is renewed on time only.
        let issuer = tokio::sync::watch::channel(Arc::new(issuer)).1;
        tether_control::multicluster::tls::self_certify(issuer, me, store.clone())
            .map_err(|e| e.to_string())?;
        let roots = tether_identity::tls::load_roots(&dir.join(tether_identity::ca::CA_CERT))
            .map_err(|e| e.to_string())?;
        let expected = self.control_identity.clone().unwrap_or_else(|| {
            tether_identity::control::default_control_identity(&self.trust_domain)
        });
        let tls = ControlTls::new(&expected, store, Arc::new(roots)).map_err(|e| e.to_string())?;
        Ok(tether_identity::control::channel(
            addr,
            Some((tls, Auth::Mutual)),
        ))
    }
}
