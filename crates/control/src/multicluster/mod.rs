//! Multicluster: links to other clusters and the export API between them.
//!
//! - [`links`]: what a link names (a remote cluster's export address,
//!   gateway, priority tier and trust root), from a file or flags.
//! - [`export`]: `tether.multicluster.v1.Export`, served over mTLS: for each
//!   exported global id, this cluster's ready-endpoint count, with its
//!   gateway's address and identity, re-sent every 250 ms (the heartbeat).
//! - [`remote`]: one watcher per link, which follows the remote's export
//!   stream and probes its gateway, and puts the remote into the index
//!   only while both are reachable (dropped within about a second).
//! - [`tls`]: the control plane's own certificate, for the export API, and
//!   a TLS acceptor that tonic can serve from.

pub mod export;
pub mod links;
pub mod remote;
pub mod tls;

/// The identity a cluster's control plane presents on the export API.
pub fn control_identity(cluster: &str, trust_domain: &str) -> String {
    tether_identity::identity_name("tether-control", cluster, trust_domain)
}

/// The multicluster side of a control plane's configuration.
#[derive(Clone, Debug, Default)]
pub struct MulticlusterConfig {
    /// Where to serve the export API (mTLS; needs an identity directory
    /// and a cluster name).
    pub export_addr: Option<std::net::SocketAddr>,
    /// What the export API advertises about this cluster's gateway.
    pub gateway_address: Option<String>,
    pub gateway_identity: Option<String>,
    pub links: Vec<links::Link>,
}

/// Why the multicluster side cannot start.
#[derive(Debug, thiserror::Error)]
pub enum MulticlusterError {
    #[error("--export and --link need --identity (the export API is mTLS)")]
    NeedsIdentity,
    #[error("--export and --link need --cluster NAME")]
    NeedsCluster,
    #[error(transparent)]
    SelfCertify(#[from] tls::SelfCertifyError),
    #[error(transparent)]
    Tls(#[from] tether_identity::tls::TlsError),
}

/// The export API's server and one watcher per link, with their TLS
/// configurations built and this control plane's certificate issued, so
/// that every configuration error shows before any listener binds.
pub struct Multicluster {
    cluster: String,
    cluster_domain: String,
    export: Option<(export::ExportConfig, std::sync::Arc<rustls::ServerConfig>)>,
    links: Vec<(links::Link, std::sync::Arc<rustls::ClientConfig>)>,
}

impl Multicluster {
    /// `None` when this control plane neither exports nor links. `identity`
    /// is the identity directory and its issuer, which certifies this
    /// control plane and whose trust root verifies links without their own.
    pub fn prepare(
        config: &MulticlusterConfig,
        cluster: Option<&str>,
        cluster_domain: &str,
        identity: Option<&crate::identity::IdentitySource>,
    ) -> Result<Option<Self>, MulticlusterError> {
        use std::sync::Arc;
        use tether_identity::tls::{
            client_config, client_config_trusting, load_roots, server_config_trusting, CertStore,
        };

        if config.export_addr.is_none() && config.links.is_empty() {
            return Ok(None);
        }
        let identity = identity.ok_or(MulticlusterError::NeedsIdentity)?;
        let cluster = cluster.ok_or(MulticlusterError::NeedsCluster)?;
        let store = CertStore::new();
        tls::self_certify(
            identity.issuer(),
            control_identity(cluster, cluster_domain),
            store.clone(),
        )?;
        let export = match config.export_addr {
            Some(_) => Some((
                export::ExportConfig {
                    cluster: cluster.to_string(),
                    gateway_address: config.gateway_address.clone().unwrap_or_default(),
                    gateway_identity: config.gateway_identity.clone().unwrap_or_default(),
                },
                server_config_trusting(store.clone(), identity.bundle.clone())?,
            )),
            None => None,
        };
        let mut links = Vec::with_capacity(config.links.len());
        for link in &config.links {
            // A link's own root is fixed; this cluster's follows its bundle.
            let config = match &link.trust_root {
                Some(path) => client_config(store.clone(), Arc::new(load_roots(path)?))?,
                None => client_config_trusting(store.clone(), identity.bundle.clone())?,
            };
            links.push((link.clone(), config));
        }
        Ok(Some(Self {
            cluster: cluster.to_string(),
            cluster_domain: cluster_domain.to_string(),
            export,
            links,
        }))
    }

    /// Serves the export API on `export_listener` (bound from
    /// [`MulticlusterConfig::export_addr`]) and follows every link into
    /// `index`, until `shutdown`.
    pub fn spawn(
        self,
        export_listener: Option<tokio::net::TcpListener>,
        index: &crate::index::Index,
        shutdown: &tether_admin::Shutdown,
    ) {
        if let (Some((config, server_config)), Some(listener)) = (self.export, export_listener) {
            let export = export::ExportServer::new(index.clone(), config, shutdown.clone());
            let signal = shutdown.clone();
            tokio::spawn(async move {
                let served = tonic::transport::Server::builder()
                    .add_service(export)
                    .serve_with_incoming_shutdown(
                        tls::incoming(listener, server_config),
                        async move { signal.triggered().await },
                    )
                    .await;
                if let Err(e) = served {
                    tracing::error!(error = %e, "export API stopped");
                }
            });
        }
        for (link, client_config) in self.links {
            let expected = control_identity(&link.name, &self.cluster_domain);
            tokio::spawn(remote::run(
                link,
                self.cluster.clone(),
                expected,
                client_config,
                index.clone(),
                shutdown.clone(),
            ));
        }
    }
}
