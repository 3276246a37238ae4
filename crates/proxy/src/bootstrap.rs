//! What the sidecar and the gateway both do at start-up: resolve the
//! control-plane list, set up metrics and readiness, build the TLS
//! connector and server config from the identity, bind the admin listener,
//! and — once the process has registered every readiness condition — serve
//! admin and keep the certificate renewed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use rustls::ServerConfig;
use tether_admin::{bind, Admin, Readiness, Shutdown};
use tether_identity::control::ControlTls;
use tether_identity::tls::CertStore;
use tether_identity::trust::{FileStamps, TrustBundle};
use tokio::net::TcpListener;

use crate::discovery::{ControlPlanes, Discovery, DiscoverySettings};
use crate::identity::{IdentityConfig, IdentityMetrics};
use crate::metrics::ProxyMetrics;
use crate::serve::{ServeConfig, ServeLimits};
use crate::tls::{Connector, TlsClient, TlsMode};
use crate::ProxyStartError;

/// Settings both processes share.
#[derive(Clone, Debug)]
pub struct BootstrapConfig {
    /// Control-plane gRPC addresses (`host:port`), tried in turn.
    pub control: Vec<String>,
    pub admin: SocketAddr,
    /// This process's identity; mTLS between proxies needs it.
    pub identity: Option<IdentityConfig>,
    pub tls_mode: TlsMode,
    pub connect_timeout: Duration,
    /// How long in-flight requests may take to finish on shutdown.
    pub drain_timeout: Duration,
    pub discovery: DiscoverySettings,
    pub serve: ServeConfig,
    /// The tap API (`tether tap`); off when `None`.
    pub tap: Option<crate::tap::TapConfig>,
    /// How to reach the control plane: TLS (the default) or plaintext.
    pub control_channel: ControlChannel,
}

/// How the proxy talks to the control plane.
#[derive(Clone, Debug, Default)]
pub struct ControlChannel {
    /// Plaintext gRPC (`--insecure-control-plane`).
    pub insecure: bool,
    /// The identity the control plane must present; by default
    /// `tether-control.tether-system.serviceaccount.identity.<trust domain
    /// of --identity>`.
    pub identity: Option<String>,
}

/// The trust bundle, and how its file looked just before it was read.
type Followed = (Arc<TrustBundle>, FileStamps);

/// The pieces a process builds its listeners from.
pub struct Bootstrap {
    pub discovery: Discovery,
    pub metrics: ProxyMetrics,
    pub readiness: Readiness,
    /// Connections to endpoints: mTLS, plaintext or refused by `tls_mode`.
    pub connector: Arc<Connector>,
    /// Terminates TLS from peers (when identity is on).
    pub server_tls: Option<Arc<ServerConfig>>,
    pub limits: ServeLimits,
    pub background: Background,
}

/// What runs beside the listeners: admin and certificate renewal.
pub struct Background {
    controls: Arc<ControlPlanes>,
    registry: Registry,
    admin: TcpListener,
    identity: Option<(IdentityConfig, Arc<CertStore>, IdentityMetrics, Followed)>,
    tap: Option<(TcpListener, crate::tap::TapConfig, crate::tap::Tap)>,
    server_tls: Option<Arc<ServerConfig>>,
}

impl Bootstrap {
    pub async fn new(config: &BootstrapConfig) -> Result<Self, ProxyStartError> {
        if config.control.is_empty() {
            return Err(ProxyStartError::NoControl);
        }
        if config.tls_mode == TlsMode::Mandatory && config.identity.is_none() {
            return Err(ProxyStartError::MandatoryWithoutIdentity);
        }
        let store = CertStore::new();
        // One bundle for every TLS this process does, re-read in place.
        let bundle = match &config.identity {
            Some(id) => {
                let stamps = FileStamps::new(vec![id.trust_root.clone()]);
                Some((TrustBundle::load(&id.trust_root)?, stamps))
            }
            None => None,
        };
        let control_tls = control_tls(config, &store, bundle.as_ref().map(|(b, _)| b))?;
        let controls = ControlPlanes::new(&config.control, control_tls)?;
        let mut registry = Registry::default();
        let metrics = ProxyMetrics::default();
        metrics.register(&mut registry);
        let discovery = Discovery::new(controls.clone(), metrics.clone())
            .with_first_answer_timeout(config.discovery.first_answer_timeout);
        let readiness = Readiness::default();
        let (client_tls, server_tls, identity) = match (&config.identity, bundle) {
            (Some(id), Some((bundle, stamps))) => {
                let identity_metrics = IdentityMetrics::default();
                identity_metrics.register(&mut registry);
                identity_metrics.trusting(&bundle.current());
                readiness.require(crate::identity::CERTIFICATE);
                let (client, server) =
                    TlsClient::for_identity(bundle.clone(), store.clone(), config.tls_mode)?;
                (
                    Some(client),
                    Some(server),
                    Some((id.clone(), store, identity_metrics, (bundle, stamps))),
                )
            }
            _ => (None, None, None),
        };
        let connector = Arc::new(Connector {
            connect_timeout: config.connect_timeout,
            tls: client_tls,
        });
        let limits = ServeLimits::new(&config.serve, config.drain_timeout, metrics.clone());
        let tap = match &config.tap {
            Some(tap) => Some((
                bind("tap", tap.listen).await?,
                tap.clone(),
                metrics.tap.clone(),
            )),
            None => None,
        };
        let admin = bind("admin", config.admin).await?;
        Ok(Self {
            discovery,
            metrics,
            readiness,
            connector,
            server_tls: server_tls.clone(),
            limits,
            background: Background {
                controls,
                registry,
                admin,
                identity,
                tap,
                server_tls,
            },
        })
    }
}

/// TLS to the control plane, verifying it as the configured (or default)
/// control-plane identity against this proxy's trust root; `None` when
/// plaintext was asked for.
fn control_tls(
    config: &BootstrapConfig,
    store: &Arc<CertStore>,
    bundle: Option<&Arc<TrustBundle>>,
) -> Result<Option<Arc<ControlTls>>, ProxyStartError> {
    if config.control_channel.insecure {
        return Ok(None);
    }
    let identity = config
        .identity
        .as_ref()
        .ok_or(ProxyStartError::ControlTlsWithoutIdentity)?;
    let expected = match &config.control_channel.identity {
        Some(expected) => expected.clone(),
        None => tether_identity::control::trust_domain_of(&identity.name)
            .map(tether_identity::control::default_control_identity)
            .ok_or_else(|| ProxyStartError::ControlIdentity(identity.name.clone()))?,
    };
    let bundle = bundle.ok_or(ProxyStartError::ControlTlsWithoutIdentity)?;
    Ok(Some(ControlTls::trusting(
        &expected,
        store.clone(),
        bundle.clone(),
    )?))
}

impl Background {
    /// Serves admin and renews the certificate until `shutdown`. Call it
    /// after every readiness condition is registered: a probe in the first
    /// instant must already see them missing.
    pub fn start(self, readiness: Readiness, shutdown: Shutdown) {
        if let Some((config, store, metrics, (bundle, stamps))) = self.identity {
            let renew_now = Arc::new(tokio::sync::Notify::new());
            tokio::spawn(crate::identity::follow_bundle(
                stamps,
                config.clone(),
                bundle,
                store.clone(),
                renew_now.clone(),
                metrics.clone(),
                shutdown.clone(),
            ));
            tokio::spawn(crate::identity::maintain(
                config,
                self.controls,
                store,
                readiness.clone(),
                metrics,
                renew_now,
                shutdown.clone(),
            ));
        }
        if let Some((listener, config, tap)) = self.tap {
            tokio::spawn(crate::tap::serve(
                listener,
                tap,
                config,
                self.server_tls,
                shutdown.clone(),
            ));
        }
        tokio::spawn(tether_admin::serve(
            self.admin,
            Admin {
                readiness,
                metrics: Arc::new(self.registry),
                extra: None,
            },
            shutdown,
        ));
    }
}
