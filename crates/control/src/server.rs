//! Wires the control plane: listeners, registry, index, gRPC and admin.
//! Each concern starts from its own module: the registry backend from
//! [`crate::registry::source`], Certify from [`crate::identity`], the
//! export API and links from [`crate::multicluster`]; `run` orders them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use linkerd2_proxy_api::identity::identity_server::IdentityServer;
use linkerd2_proxy_api::inbound::inbound_server_policies_server::InboundServerPoliciesServer;
use linkerd2_proxy_api::outbound::outbound_policies_server::OutboundPoliciesServer;
use tether_admin::{bind, Admin, Readiness, Shutdown};

use tonic::service::interceptor::InterceptedService;

use crate::channel::{Access, ChannelSecurity, Require};
use crate::destination::{AuditReport, DestinationGrpc, DestinationService, Subscriptions};
use crate::identity::{IdentityMetrics, IdentityService, IdentitySource, KubeTokenReview};
use crate::inbound_policy::{InboundDefaults, InboundService};
use crate::index::Index;
use crate::memory::MemoryRelease;
use crate::metrics::ControlMetrics;
use crate::multicluster::{Multicluster, MulticlusterConfig, MulticlusterError};
use crate::policy::{PolicyService, RoutingStreams};
use crate::registry::kubernetes::WatchLag;
use crate::registry::source::{RegistrySource, SourceError};
use crate::registry::LOADED;

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
    /// Where services and endpoints come from.
    pub registry: RegistrySource,
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
    pub multicluster: MulticlusterConfig,
    /// Live `Destination.Get` streams this process serves at most; beyond,
    /// `Get` is refused (RESOURCE_EXHAUSTED) so the proxy tries another
    /// replica.
    pub max_subscriptions: usize,
    /// The identity the gRPC port's certificate names (proxies verify it).
    pub control_identity: String,
    /// Serve plaintext clients too (`--insecure-control-plane`).
    pub insecure_control_plane: bool,
    /// The inbound policy of a port no `Server` selects, in a namespace
    /// without a default (`--default-inbound-policy`).
    pub default_inbound_policy: tether_core::policy::DefaultPolicy,
    /// The `cluster-*` policies' networks (`--cluster-networks`).
    pub cluster_networks: Vec<tether_core::policy::Cidr>,
}

impl ControlConfig {
    /// The shortest audit interval: audits walk every subscription.
    pub const MIN_AUDIT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(10);
    /// The shortest leaf certificate lifetime Certify signs.
    pub const MIN_LEAF_LIFETIME: std::time::Duration = std::time::Duration::from_secs(1);

    /// Checks what flags alone cannot: the cluster name, and the lower
    /// bounds of the audit interval and leaf lifetime.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(cluster) = &self.cluster {
            if !tether_core::authority::is_dns_label(cluster) {
                return Err(ConfigError::ClusterName(
                    tether_core::truncate::for_log(cluster).to_string(),
                ));
            }
        }
        if self.audit_interval < Self::MIN_AUDIT_INTERVAL {
            return Err(ConfigError::AuditInterval);
        }
        if self.leaf_lifetime < Self::MIN_LEAF_LIFETIME {
            return Err(ConfigError::LeafLifetime);
        }
        if self.identity_dir.is_none() && !self.insecure_control_plane {
            return Err(ConfigError::TlsNeedsIdentity);
        }
        Ok(())
    }
}

/// A [`ControlConfig`] the control plane refuses to run with.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("--cluster {0} is not a valid cluster name")]
    ClusterName(String),
    #[error("--audit-interval must be at least 0.01 s")]
    AuditInterval,
    #[error("--identity-leaf-lifetime must be at least 1 second")]
    LeafLifetime,
    #[error("the gRPC port serves TLS with a certificate from --identity DIR; give it, or pass --insecure-control-plane to serve plaintext")]
    TlsNeedsIdentity,
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Bind(#[from] tether_admin::BindError),
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(transparent)]
    Registry(#[from] crate::registry::RegistryError),
    #[error(transparent)]
    Identity(#[from] crate::identity::StartError),
    #[error("multicluster: {0}")]
    Multicluster(#[from] MulticlusterError),
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("TLS for the gRPC port: {0}")]
    ChannelTls(String),
}

/// How long a client may take to send the HTTP/2 preface on the gRPC port.
const PREFACE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);
/// HTTP/2 pings on idle gRPC connections, and how long an answer may take.
/// How long shutdown waits for open streams to end before the control
/// plane exits anyway. Streams that can take an update end at once; one
/// whose client never opens its flow-control window is never polled again,
/// and without this bound it would hold the process until SIGKILL.
pub const SHUTDOWN_DRAIN: std::time::Duration = std::time::Duration::from_secs(5);
const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(20);
const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs the control plane until `shutdown` fires. Subscriber streams end
/// cleanly on shutdown so proxies move to another replica.
///
/// Every configuration error (registry source, identity, multicluster)
/// shows before a listener binds; discovery is answered only after the
/// registry's first full load.
pub async fn run(config: ControlConfig, shutdown: Shutdown) -> Result<(), ControlError> {
    config.validate()?;
    let backend = config.registry.connect().await?;
    let identity_metrics = IdentityMetrics::default();
    let source = match &config.identity_dir {
        Some(dir) => Some(IdentitySource::load(dir, &identity_metrics)?),
        None => None,
    };
    let identity = match &source {
        Some(source) => {
            let token_review = backend.kube_client().map(|client| KubeTokenReview {
                client: client.clone(),
                audience: config.token_audience.clone(),
                trust_domain: config.cluster_domain.clone(),
            });
            Some(IdentityService::load(
                source,
                token_review,
                config.leaf_lifetime,
                identity_metrics.clone(),
            )?)
        }
        None => None,
    };
    let security = channel_security(&config, source.as_ref())?;
    let multicluster = Multicluster::prepare(
        &config.multicluster,
        config.cluster.as_deref(),
        &config.cluster_domain,
        source.as_ref(),
    )?;

    let grpc = bind("grpc", config.grpc_addr).await?;
    let export_listener = match config.multicluster.export_addr {
        Some(addr) => Some(bind("export", addr).await?),
        None => None,
    };
    let admin_listener = bind("admin", config.admin_addr).await?;

    let metrics = ControlMetrics::default();
    let (prometheus, kube_lag) = prometheus_registry(&metrics, &identity_metrics);
    let readiness = Readiness::default();
    readiness.require(LOADED);
    let index = Index::new(metrics.clone());
    if let Some(cluster) = &config.cluster {
        index.set_cluster(cluster);
    }
    let subscriptions = Subscriptions::with_limit(config.max_subscriptions);
    let diagnostics = crate::diagnostics::DiagnosticsServer::new(prometheus.clone());
    tokio::spawn(tether_admin::serve(
        admin_listener,
        Admin {
            readiness: readiness.clone(),
            metrics: prometheus,
            extra: Some(audit_on_demand(&subscriptions, &index, &metrics)),
        },
        shutdown.clone(),
    ));

    if let Some(source) = source {
        tokio::spawn(source.follow(identity_metrics.clone(), shutdown.clone()));
    }
    let (loaded, loaded_rx) = when_loaded(readiness);
    let memory = MemoryRelease::spawn(metrics.memory_releases.clone(), shutdown.clone());
    let mut registry_task = backend.spawn(
        index.clone(),
        loaded,
        &config.cluster_domain,
        metrics.clone(),
        kube_lag,
        memory.clone(),
    );
    // Answer no discovery before the first full load: an empty index would
    // tell proxies that every service is unknown. Clients wait in the
    // listen backlog meanwhile.
    tokio::select! {
        _ = loaded_rx => {}
        res = &mut registry_task => return registry_ended(res),
        _ = shutdown.triggered() => return Ok(()),
    }

    // Policy watches and profiles share one bound.
    let routing = RoutingStreams::new(index.clone(), config.max_subscriptions, shutdown.clone());
    let destination = DestinationService {
        routing: routing.clone(),
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
        memory,
        shutdown.clone(),
    ));
    if let Some(multicluster) = multicluster {
        multicluster.spawn(export_listener, &index, &shutdown);
    }
    let inbound = InboundService::new(
        routing.clone(),
        InboundDefaults::new(
            config.default_inbound_policy,
            config.cluster_networks.clone(),
            &config.cluster_domain,
        ),
    );
    let policy = PolicyService::new(routing, &config.cluster_domain);
    let signal = shutdown.clone();
    let insecure = security.insecure;
    let server = grpc_services(
        destination,
        (policy, inbound),
        identity,
        diagnostics,
        insecure,
    )
    .serve_with_incoming_shutdown(
        crate::channel::incoming(grpc, security, PREFACE_DEADLINE),
        async move { signal.triggered().await },
    );
    let drained = async {
        shutdown.triggered().await;
        tokio::time::sleep(SHUTDOWN_DRAIN).await;
    };
    tokio::select! {
        res = server => res?,
        res = registry_task => registry_ended(res)?,
        () = drained => tracing::warn!(
            "streams still open {}s after shutdown (clients not reading); stopping anyway",
            SHUTDOWN_DRAIN.as_secs()
        ),
    }
    tracing::info!("control plane stopped");
    Ok(())
}

/// How the gRPC port is secured: TLS with a certificate this control plane
/// issues itself from the identity directory's issuer (renewed in the
/// background), unless `--insecure-control-plane` without an identity.
fn channel_security(
    config: &ControlConfig,
    source: Option<&IdentitySource>,
) -> Result<ChannelSecurity, ControlError> {
    let tls = match source {
        Some(source) => {
            let failed = |e: &dyn std::fmt::Display| ControlError::ChannelTls(e.to_string());
            let store = tether_identity::tls::CertStore::new();
            let certified = crate::multicluster::tls::self_certify(
                source.issuer(),
                config.control_identity.clone(),
                store.clone(),
            );
            match certified {
                Ok(()) => {}
                // Plaintext clients can still be told why Certify fails.
                Err(e) if config.insecure_control_plane => {
                    tracing::error!(error = %e, "no certificate for the gRPC port: serving plaintext only");
                    return Ok(ChannelSecurity {
                        tls: None,
                        insecure: true,
                    });
                }
                Err(e) => return Err(failed(&e)),
            }
            let server = tether_identity::control::server_config(store, source.bundle.clone())
                .map_err(|e| failed(&e))?;
            tracing::info!(identity = %config.control_identity, plaintext_too = config.insecure_control_plane, "gRPC port serves TLS");
            Some(server)
        }
        _ => {
            tracing::warn!("gRPC port serves plaintext (--insecure-control-plane): tokens, CSRs and endpoints travel in clear");
            None
        }
    };
    Ok(ChannelSecurity {
        tls,
        insecure: config.insecure_control_plane,
    })
}

/// The Prometheus registry every metric of the process is in, and the
/// Kubernetes watch-lag family (registered whatever the registry source,
/// so dashboards see the same names).
fn prometheus_registry(
    metrics: &ControlMetrics,
    identity_metrics: &IdentityMetrics,
) -> (Arc<prometheus_client::registry::Registry>, WatchLag) {
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    identity_metrics.register(&mut registry);
    let kube_lag = WatchLag::new_with_constructor(crate::metrics::LatencyBuckets);
    registry.register(
        "tether_kubernetes_watch_lag_seconds",
        "From a Kubernetes object's last change to the control plane seeing it, by kind",
        kube_lag.clone(),
    );
    (Arc::new(registry), kube_lag)
}

/// `GET /audit` on the admin listener: an audit now, its report as text.
fn audit_on_demand(
    subscriptions: &Subscriptions,
    index: &Index,
    metrics: &ControlMetrics,
) -> tether_admin::Extra {
    let (subs, index, metrics) = (subscriptions.clone(), index.clone(), metrics.clone());
    Arc::new(move |_method, path, _query| {
        (path == "/audit").then(|| {
            (
                http::StatusCode::OK,
                format!("{}\n", subs.audit(&index, &metrics)),
            )
        })
    })
}

/// The callback a registry calls after its first full load (it marks
/// `readiness` loaded) and the receiver that learns of it.
fn when_loaded(
    readiness: Readiness,
) -> (Box<dyn FnOnce() + Send>, tokio::sync::oneshot::Receiver<()>) {
    let (loaded_tx, loaded_rx) = tokio::sync::oneshot::channel::<()>();
    let loaded: Box<dyn FnOnce() + Send> = Box::new(move || {
        readiness.set(LOADED, true);
        let _ = loaded_tx.send(());
    });
    (loaded, loaded_rx)
}

/// Every gRPC service of the main listener, each bounded in the messages it
/// reads and sends.
fn grpc_services(
    destination: DestinationService,
    (policy, inbound): (PolicyService, InboundService),
    identity: Option<IdentityService>,
    diagnostics: crate::diagnostics::DiagnosticsServer,
    insecure: bool,
) -> tonic::transport::server::Router {
    let server_tls = Require {
        access: Access::ServerTls,
        insecure,
    };
    let mtls = Require {
        access: Access::MutualTls,
        insecure,
    };
    let identity = identity.map(|service| {
        InterceptedService::new(
            IdentityServer::new(service)
                .max_decoding_message_size(MAX_RECEIVE_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_SEND_MESSAGE_BYTES),
            server_tls,
        )
    });
    tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        // A peer that vanished (or stopped answering) is found and its
        // streams ended, instead of holding a connection forever.
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .add_service(InterceptedService::new(
            DestinationGrpc::new(
                destination,
                MAX_RECEIVE_MESSAGE_BYTES,
                MAX_SEND_MESSAGE_BYTES,
            ),
            mtls,
        ))
        .add_service(InterceptedService::new(
            OutboundPoliciesServer::new(policy)
                .max_decoding_message_size(MAX_RECEIVE_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_SEND_MESSAGE_BYTES),
            mtls,
        ))
        .add_service(InterceptedService::new(
            InboundServerPoliciesServer::new(inbound)
                .max_decoding_message_size(MAX_RECEIVE_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_SEND_MESSAGE_BYTES),
            mtls,
        ))
        .add_optional_service(identity)
        .add_service(InterceptedService::new(diagnostics, mtls))
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
    subscriptions: Subscriptions,
    index: Index,
    metrics: ControlMetrics,
    interval: std::time::Duration,
    memory: MemoryRelease,
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
        let report = subscriptions.audit(&index, &metrics);
        index.collect_garbage();
        if trim.due(Trim::weight(&report)) {
            memory.ask();
        }
    }
}

/// When to hand freed memory back to the operating system. glibc keeps
/// what closed streams freed until asked: 10,000 streams left about 150 MB
/// of RSS that nothing used, and 20 streams of a 100,000-endpoint service
/// ~90 MB (what each held while it sent the service whole). Asking costs a
/// walk of the heap, so it is done only after what the subscriptions
/// follow fell by half and by at least [`Trim::MIN_DROP`] since its peak,
/// weighed in endpoints: a stream counts as [`Trim::PER_SUBSCRIPTION`] of
/// them (~15 KB a stream, ~45 bytes an endpoint it was sent).
#[derive(Default)]
struct Trim {
    peak: usize,
}

impl Trim {
    const PER_SUBSCRIPTION: usize = 256;
    /// A thousand streams of small services, or one of 256,000 endpoints.
    const MIN_DROP: usize = 1_000 * Self::PER_SUBSCRIPTION;

    fn weight(report: &AuditReport) -> usize {
        report.subscriptions * Self::PER_SUBSCRIPTION + report.endpoints_followed
    }

    fn due(&mut self, live: usize) -> bool {
        self.peak = self.peak.max(live);
        if self.peak - live >= Self::MIN_DROP && live <= self.peak / 2 {
            self.peak = live;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ControlConfig {
        ControlConfig {
            registry: RegistrySource::Directory {
                path: "registry".into(),
                max_file_bytes: 1,
            },
            token_audience: "tether.io".into(),
            grpc_addr: "127.0.0.1:0".parse().unwrap(),
            admin_addr: "127.0.0.1:0".parse().unwrap(),
            cluster_domain: "cluster.local".into(),
            identity_dir: None,
            leaf_lifetime: ControlConfig::MIN_LEAF_LIFETIME,
            audit_interval: ControlConfig::MIN_AUDIT_INTERVAL,
            cluster: Some("east".into()),
            multicluster: MulticlusterConfig::default(),
            max_subscriptions: 1,
            control_identity: "tether-control.tether-system.serviceaccount.identity.cluster.local"
                .into(),
            insecure_control_plane: true,
            default_inbound_policy: Default::default(),
            cluster_networks: vec![],
        }
    }

    #[test]
    fn a_bad_cluster_name_and_too_short_intervals_are_refused() {
        assert_eq!(config().validate(), Ok(()));
        let bad = ControlConfig {
            cluster: Some("East_1".into()),
            ..config()
        };
        assert_eq!(
            bad.validate().unwrap_err().to_string(),
            "--cluster \"East_1\" is not a valid cluster name"
        );
        let bad = ControlConfig {
            audit_interval: std::time::Duration::from_millis(9),
            ..config()
        };
        assert_eq!(bad.validate(), Err(ConfigError::AuditInterval));
        let bad = ControlConfig {
            leaf_lifetime: std::time::Duration::from_millis(999),
            ..config()
        };
        assert_eq!(bad.validate(), Err(ConfigError::LeafLifetime));
        let plaintext_by_accident = ControlConfig {
            insecure_control_plane: false,
            ..config()
        };
        assert_eq!(
            plaintext_by_accident.validate(),
            Err(ConfigError::TlsNeedsIdentity)
        );
    }

    #[test]
    fn memory_is_trimmed_after_a_large_drop_only() {
        let streams = |n: usize| n * Trim::PER_SUBSCRIPTION;
        let mut trim = Trim::default();
        assert!(!trim.due(streams(10_000)));
        assert!(!trim.due(streams(9_000)), "a small drop");
        assert!(!trim.due(streams(5_001)));
        assert!(trim.due(streams(4_000)));
        assert!(!trim.due(streams(4_000)), "once per drop");
        assert!(
            !trim.due(streams(3_500)),
            "less than MIN_DROP below the new peak"
        );
        assert!(trim.due(streams(1_500)));
    }

    /// A few streams of a very large service weigh as much as many of
    /// small ones: each held the service whole while it sent it.
    #[test]
    fn streams_are_weighed_by_the_endpoints_they_follow() {
        let report = |subscriptions: usize, endpoints: usize| AuditReport {
            subscriptions,
            endpoints_followed: subscriptions * endpoints,
            ..AuditReport::default()
        };
        let mut trim = Trim::default();
        assert!(!trim.due(Trim::weight(&report(20, 100_000))));
        assert!(trim.due(Trim::weight(&report(0, 0))), "20 streams closed");
        let mut trim = Trim::default();
        assert!(!trim.due(Trim::weight(&report(20, 10))));
        assert!(!trim.due(Trim::weight(&report(0, 0))), "a small drop");
    }
}
