//! Wires the control plane: listeners, registry, index, gRPC and admin.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use linkerd2_proxy_api::destination::destination_server::DestinationServer;
use linkerd2_proxy_api::identity::identity_server::IdentityServer;
use linkerd2_proxy_api::inbound::inbound_server_policies_server::InboundServerPoliciesServer;
use linkerd2_proxy_api::outbound::outbound_policies_server::OutboundPoliciesServer;
use tether_admin::{bind, Admin, Readiness, Shutdown};

use crate::destination::DestinationService;
use crate::index::Index;
use crate::metrics::ControlMetrics;
use crate::policy::PolicyService;
use crate::registry::{file::FileRegistry, Registry, LOADED};

/// The largest gRPC message the control plane sends. Destination updates
/// are batched far below it ([`crate::destination::MAX_UPDATE_BYTES`]); it
/// equals the 4 MiB that gRPC clients (tonic, grpc-go, linkerd2-proxy)
/// accept by default, so a message over it would be refused anyway.
pub const MAX_SEND_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// The largest request the control plane reads: a path, a context token, a
/// CSR and a bootstrap token all fit many times over.
pub const MAX_RECEIVE_MESSAGE_BYTES: usize = 256 * 1024;
/// Concurrent HTTP/2 streams per client connection. A proxy holds two per
/// service it follows (`Destination.Get` and `GetProfile`), at most
/// `--max-discovery-subscriptions` (default 1,000) services: this leaves it
/// room and bounds what one connection can make the control plane hold.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 4_096;

#[derive(Clone, Debug)]
pub struct ControlConfig {
    /// A registry directory, or `kubernetes`.
    pub registry_dir: PathBuf,
    /// The largest registry file read (file registry only).
    pub registry_max_file_bytes: u64,
    /// With the Kubernetes registry: the API server's URL (default: in-cluster
    /// configuration or the kubeconfig).
    pub kube_api: Option<String>,
    /// With the Kubernetes registry, Certify accepts ServiceAccount tokens
    /// for this audience (checked through TokenReview).
    pub token_audience: String,
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub cluster_domain: String,
    /// Identity directory (`tether identity init`); serves Certify when set.
    pub identity_dir: Option<PathBuf>,
    pub leaf_lifetime: std::time::Duration,
    /// How often every subscription is compared with the index.
    pub audit_interval: std::time::Duration,
    /// This cluster's name (multicluster).
    pub cluster: Option<String>,
    /// Where to serve the export API (mTLS; needs `identity_dir`).
    pub export_addr: Option<SocketAddr>,
    /// What the export API advertises about this cluster's gateway.
    pub gateway_address: Option<String>,
    pub gateway_identity: Option<String>,
    pub links: Vec<crate::multicluster::links::Link>,
    /// Live `Destination.Get` streams this process serves at most; beyond,
    /// `Get` is refused (RESOURCE_EXHAUSTED) so the proxy tries another
    /// replica.
    pub max_subscriptions: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Bind(#[from] tether_admin::BindError),
    #[error(transparent)]
    Registry(#[from] crate::registry::RegistryError),
    #[error("identity: {0}")]
    Identity(#[from] tether_identity::ca::LoadError),
    #[error("identity: reading bootstrap token secret: {0}")]
    TokenSecret(std::io::Error),
    #[error("multicluster: {0}")]
    Multicluster(String),
    #[error("Kubernetes: {0}")]
    Kubernetes(String),
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
}

/// Runs the control plane until `shutdown` fires. Subscriber streams end
/// cleanly on shutdown so proxies move to another replica.
pub async fn run(config: ControlConfig, shutdown: Shutdown) -> Result<(), ControlError> {
    let kubernetes = config.registry_dir.as_os_str() == "kubernetes";
    if !kubernetes && !config.registry_dir.is_dir() {
        return Err(crate::registry::RegistryError::Directory {
            path: config.registry_dir.display().to_string(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a directory"),
        }
        .into());
    }
    let kube_client = if kubernetes {
        Some(match &config.kube_api {
            Some(url) => {
                let uri = url.parse().map_err(|_| {
                    ControlError::Kubernetes(format!("--kube-api {url:?} is not a URL"))
                })?;
                kube::Client::try_from(kube::Config::new(uri))
                    .map_err(|e| ControlError::Kubernetes(e.to_string()))?
            }
            None => kube::Client::try_default().await.map_err(|e| {
                ControlError::Kubernetes(format!("no in-cluster configuration or kubeconfig: {e}"))
            })?,
        })
    } else {
        None
    };
    let identity_metrics = crate::identity::IdentityMetrics::default();
    let mut issuer_for_links = None;
    let identity = match &config.identity_dir {
        Some(dir) => {
            let issuer = Arc::new(tether_identity::ca::Issuer::load(dir)?);
            issuer_for_links = Some(issuer.clone());
            let tokens = match &kube_client {
                Some(client) => {
                    crate::identity::Tokens::Kubernetes(crate::identity::KubeTokenReview {
                        client: client.clone(),
                        audience: config.token_audience.clone(),
                        trust_domain: config.cluster_domain.clone(),
                    })
                }
                None => crate::identity::Tokens::Local(Arc::new(
                    tether_identity::token::LocalTokens::load(dir)
                        .map_err(ControlError::TokenSecret)?,
                )),
            };
            tracing::info!(dir = %dir.display(), "identity: issuing certificates");
            Some(
                IdentityServer::new(crate::identity::IdentityService {
                    issuer,
                    tokens,
                    leaf_lifetime: config.leaf_lifetime,
                    metrics: identity_metrics.clone(),
                })
                .max_decoding_message_size(MAX_RECEIVE_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_SEND_MESSAGE_BYTES),
            )
        }
        None => None,
    };
    let multicluster = if config.export_addr.is_some() || !config.links.is_empty() {
        let (Some(dir), Some(issuer)) = (&config.identity_dir, issuer_for_links) else {
            return Err(ControlError::Multicluster(
                "--export and --link need --identity (the export API is mTLS)".into(),
            ));
        };
        let Some(cluster) = config.cluster.clone() else {
            return Err(ControlError::Multicluster(
                "--export and --link need --cluster NAME".into(),
            ));
        };
        let store = tether_identity::tls::CertStore::new();
        let me = crate::multicluster::control_identity(&cluster, &config.cluster_domain);
        crate::multicluster::tls::self_certify(issuer, me, store.clone())
            .map_err(ControlError::Multicluster)?;
        Some((dir.clone(), cluster, store))
    } else {
        None
    };
    let grpc = bind("grpc", config.grpc_addr).await?;
    let export_listener = match config.export_addr {
        Some(addr) => Some(bind("export", addr).await?),
        None => None,
    };
    let admin_listener = bind("admin", config.admin_addr).await?;

    let metrics = ControlMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    identity_metrics.register(&mut registry);
    let kube_lag =
        crate::registry::kubernetes::WatchLag::new_with_constructor(crate::metrics::LatencyBuckets);
    registry.register(
        "tether_kubernetes_watch_lag_seconds",
        "From a Kubernetes object's last change to the control plane seeing it, by kind",
        kube_lag.clone(),
    );
    let readiness = Readiness::default();
    readiness.require(LOADED);
    let index = Index::new(metrics.clone());
    if let Some(cluster) = &config.cluster {
        index.set_cluster(cluster);
    }
    let subscriptions = crate::destination::Subscriptions::with_limit(config.max_subscriptions);
    let audit: tether_admin::Extra = {
        let (subs, index, metrics) = (subscriptions.clone(), index.clone(), metrics.clone());
        Arc::new(move |_method, path, _query| {
            (path == "/audit").then(|| {
                (
                    http::StatusCode::OK,
                    format!("{}\n", subs.audit(&index, &metrics)),
                )
            })
        })
    };

    let registry = Arc::new(registry);
    let diagnostics = crate::diagnostics::DiagnosticsServer::new(registry.clone());
    tokio::spawn(tether_admin::serve(
        admin_listener,
        Admin {
            readiness: readiness.clone(),
            metrics: registry,
            extra: Some(audit),
        },
        shutdown.clone(),
    ));

    let ready = readiness.clone();
    let (loaded_tx, loaded_rx) = tokio::sync::oneshot::channel::<()>();
    let loaded: Box<dyn FnOnce() + Send> = Box::new(move || {
        ready.set(LOADED, true);
        let _ = loaded_tx.send(());
    });
    let mut registry_task = if let Some(client) = kube_client {
        let k8s = crate::registry::kubernetes::KubernetesRegistry::new(
            client,
            &config.cluster_domain,
            metrics.clone(),
            kube_lag,
        );
        tokio::spawn(k8s.run(index.clone(), loaded))
    } else {
        tokio::spawn(
            FileRegistry::new(&config.registry_dir, metrics.clone())
                .with_max_file_bytes(config.registry_max_file_bytes)
                .run(index.clone(), loaded),
        )
    };
    // Answer no discovery before the first full load: an empty index would
    // tell proxies that every service is unknown. Clients wait in the
    // listen backlog meanwhile.
    tokio::select! {
        _ = loaded_rx => {}
        res = &mut registry_task => return registry_ended(res),
        _ = shutdown.triggered() => return Ok(()),
    }

    let destination = DestinationService {
        index: index.clone(),
        cluster_domain: config.cluster_domain.clone(),
        metrics: metrics.clone(),
        shutdown: shutdown.clone(),
        subscriptions: subscriptions.clone(),
    };
    tokio::spawn(audit_loop(
        subscriptions,
        index.clone(),
        metrics,
        config.audit_interval,
        shutdown.clone(),
    ));
    if let Some((dir, cluster, store)) = multicluster {
        let own_roots = Arc::new(
            tether_identity::tls::load_roots(&dir.join(tether_identity::ca::CA_CERT))
                .map_err(|e| ControlError::Multicluster(e.to_string()))?,
        );
        if let Some(listener) = export_listener {
            let server_config =
                tether_identity::tls::server_config(store.clone(), own_roots.clone())
                    .map_err(|e| ControlError::Multicluster(e.to_string()))?;
            let export = crate::multicluster::export::ExportServer::new(
                index.clone(),
                crate::multicluster::export::ExportConfig {
                    cluster: cluster.clone(),
                    gateway_address: config.gateway_address.clone().unwrap_or_default(),
                    gateway_identity: config.gateway_identity.clone().unwrap_or_default(),
                },
                shutdown.clone(),
            );
            let signal = shutdown.clone();
            tokio::spawn(async move {
                let served = tonic::transport::Server::builder()
                    .add_service(export)
                    .serve_with_incoming_shutdown(
                        crate::multicluster::tls::incoming(listener, server_config),
                        async move { signal.triggered().await },
                    )
                    .await;
                if let Err(e) = served {
                    tracing::error!(error = %e, "export API stopped");
                }
            });
        }
        for link in &config.links {
            let roots = match &link.trust_root {
                Some(path) => Arc::new(
                    tether_identity::tls::load_roots(path)
                        .map_err(|e| ControlError::Multicluster(e.to_string()))?,
                ),
                None => own_roots.clone(),
            };
            let client_config = tether_identity::tls::client_config(store.clone(), roots)
                .map_err(|e| ControlError::Multicluster(e.to_string()))?;
            let expected =
                crate::multicluster::control_identity(&link.name, &config.cluster_domain);
            tokio::spawn(crate::multicluster::remote::run(
                link.clone(),
                cluster.clone(),
                expected,
                client_config,
                index.clone(),
                shutdown.clone(),
            ));
        }
    }
    let policy = PolicyService {
        shutdown: shutdown.clone(),
    };
    let signal = shutdown.clone();
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .add_service(
            DestinationServer::new(destination)
                .max_decoding_message_size(MAX_RECEIVE_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_SEND_MESSAGE_BYTES),
        )
        .add_service(
            OutboundPoliciesServer::new(policy.clone())
                .max_decoding_message_size(MAX_RECEIVE_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_SEND_MESSAGE_BYTES),
        )
        .add_service(
            InboundServerPoliciesServer::new(policy)
                .max_decoding_message_size(MAX_RECEIVE_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_SEND_MESSAGE_BYTES),
        )
        .add_optional_service(identity)
        .add_service(diagnostics)
        .serve_with_incoming_shutdown(tether_admin::incoming(grpc, "grpc"), async move {
            signal.triggered().await
        });
    tokio::select! {
        res = server => res?,
        res = registry_task => registry_ended(res)?,
    }
    tracing::info!("control plane stopped");
    Ok(())
}

fn registry_ended(
    res: Result<Result<(), crate::registry::RegistryError>, tokio::task::JoinError>,
) -> Result<(), ControlError> {
    match res {
        Ok(Err(e)) => Err(e.into()),
        Ok(Ok(())) => {
            tracing::warn!("registry watch ended");
            Ok(())
        }
        Err(e) => {
            tracing::error!(error = %e, "registry task failed");
            Ok(())
        }
    }
}

/// Audits every subscription periodically; drops unwatched slots.
async fn audit_loop(
    subscriptions: crate::destination::Subscriptions,
    index: Index,
    metrics: ControlMetrics,
    interval: std::time::Duration,
    shutdown: Shutdown,
) {
    let mut tick = tokio::time::interval(interval);
    tick.tick().await;
    let mut trim = Trim::default();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.triggered() => return,
        }
        subscriptions.audit(&index, &metrics);
        index.collect_garbage();
        if trim.due(subscriptions.len()) {
            tokio::task::spawn_blocking(release_free_memory);
        }
    }
}

/// When to hand freed memory back to the operating system. glibc keeps
/// what many closed streams freed (10,000 streams: about 150 MB of RSS that
/// nothing uses) until asked; asking costs a walk of the heap, so it is done
/// only after the number of subscriptions fell by half and by at least
/// [`Trim::MIN_DROP`] since its peak.
#[derive(Default)]
struct Trim {
    peak: usize,
}

impl Trim {
    const MIN_DROP: usize = 1_000;

    fn due(&mut self, live: usize) -> bool {
        self.peak = self.peak.max(live);
        if self.peak - live >= Self::MIN_DROP && live <= self.peak / 2 {
            self.peak = live;
            return true;
        }
        false
    }
}

fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only returns free heap pages to the kernel.
        unsafe { libc::malloc_trim(0) };
        tracing::debug!("returned freed memory to the operating system");
    }
}

#[cfg(test)]
mod tests {
    use super::Trim;

    #[test]
    fn memory_is_trimmed_after_a_large_drop_only() {
        let mut trim = Trim::default();
        assert!(!trim.due(10_000));
        assert!(!trim.due(9_000), "a small drop");
        assert!(!trim.due(5_001));
        assert!(trim.due(4_000));
        assert!(!trim.due(4_000), "once per drop");
        assert!(!trim.due(3_500), "less than MIN_DROP below the new peak");
        assert!(trim.due(1_500));
    }
}
