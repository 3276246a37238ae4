//! The Tether sidecar proxy.
//!
//! Outbound (app → mesh) and inbound (mesh → app) are separate trees that
//! share the pieces below them:
//!
//! - [`outbound`]: the outbound listener. Names the target service by the
//!   request's authority, resolves it through [`discovery`], picks an endpoint
//!   with the [`balance`]r and forwards over a pooled [`client`] connection.
//!   Also the `--upstream` listeners, which pin one service per local port.
//! - [`intercept`]: the original destination of connections iptables
//!   redirected to the outbound listener (`tether init`).
//! - [`inbound`]: the inbound listener. [`detect`]s the protocol on the first
//!   bytes, and forwards HTTP or opaque TCP to the local app.
//! - [`discovery`]: one `Destination.Get` stream per authority, shared by
//!   every connection that uses it, reconnecting with backoff across
//!   control-plane replicas, re-subscribing when a stream stalls.
//! - [`gateway`]: the multicluster gateway — an outbound proxy behind an
//!   mTLS listener that admits only the mesh's identities and global ids.
//! - [`failfast`]: how long a service may have no endpoint before its
//!   requests fail at once.
//! - [`balance`]: power of two choices over peak-EWMA latency.
//! - [`client`]: connections to one endpoint: one multiplexed HTTP/2
//!   connection, or a bounded pool of HTTP/1 connections.
//! - [`http`]: what both sides do to HTTP messages (hop-by-hop headers,
//!   protocol upgrade between proxies, error responses).
//! - [`retry`]: retries of idempotent requests on another endpoint, within
//!   a budget.
//! - [`serve`]: accept loops and HTTP connections with their bounds:
//!   connection cap, idle and header-read timeouts, graceful shutdown.
//! - [`identity`]: the proxy's certificate: key and CSR made in memory,
//!   certified by the control plane, renewed before expiry.
//! - [`tls`]: when a connection between proxies is mTLS, plaintext, or
//!   refused (`--tls opportunistic|mandatory`).
//! - [`classify`]: counts a response once its outcome is known (gRPC's
//!   status comes in the trailers).
//! - [`metrics`]: request counts, latency histograms, open connections.

pub mod balance;
pub mod classify;
pub mod client;
pub mod detect;
pub mod discovery;
pub mod errors;
pub mod failfast;
pub mod gateway;
pub mod http;
pub mod identity;
pub mod inbound;
pub mod intercept;
pub mod metrics;
pub mod outbound;
pub mod retry;
pub mod serve;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tether_admin::{bind, Admin, Readiness, Shutdown};

#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Control-plane gRPC addresses (`host:port`), tried in turn.
    pub control: Vec<String>,
    pub outbound: SocketAddr,
    /// Where the inbound listener binds; it runs only when `app` is set.
    pub inbound: SocketAddr,
    pub admin: SocketAddr,
    /// The local app's address, for inbound traffic.
    pub app: Option<SocketAddr>,
    /// The app's port is declared opaque: inbound TCP is forwarded as is.
    /// Otherwise the inbound forwards only HTTP and refuses anything else.
    pub inbound_opaque: bool,
    /// Local listeners pinned to one service each: (listen address, authority).
    pub upstreams: Vec<(SocketAddr, String)>,
    /// How long a request waits for a service to have an endpoint.
    pub failfast_timeout: Duration,
    pub connect_timeout: Duration,
    /// How long in-flight requests may take to finish on shutdown.
    pub drain_timeout: Duration,
    /// This proxy's identity; mTLS between proxies needs it.
    pub identity: Option<identity::IdentityConfig>,
    pub tls_mode: tls::TlsMode,
    /// What to do when the control plane cannot route a request.
    pub control_plane_unavailable: outbound::forward::Unavailable,
    /// Requests that may wait per service for an endpoint.
    pub max_pending: usize,
    /// Authorities the control plane must have answered before ready.
    pub require_discovery: Vec<String>,
    /// The default retry budget (a service's profile may override it).
    pub retry_budget: retry::BudgetSpec,
    /// Connection cap, header-read and idle timeouts of the listeners.
    pub serve: serve::ServeConfig,
    /// How long an outbound request may wait for response headers (all
    /// attempts together); `None` waits as long as the app takes.
    pub response_timeout: Option<Duration>,
    /// What discovery may hold and wait for.
    pub discovery: discovery::DiscoverySettings,
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyStartError {
    #[error(transparent)]
    Bind(#[from] tether_admin::BindError),
    #[error("invalid control-plane address {0:?}: expected host:port")]
    ControlAddr(String),
    #[error("no control-plane address given")]
    NoControl,
    #[error("--tls mandatory needs an identity (--identity, --identity-token-file, --trust-root)")]
    MandatoryWithoutIdentity,
    #[error("--control-plane-unavailable=forward sends plaintext to original destinations, which --tls mandatory forbids; use --tls opportunistic or --control-plane-unavailable=fail")]
    ForwardWithMandatoryTls,
    #[error("identity: {0}")]
    Tls(#[from] tether_identity::tls::TlsError),
}

/// Runs the proxy until `shutdown` fires and in-flight work has drained.
pub async fn run(config: ProxyConfig, shutdown: Shutdown) -> Result<(), ProxyStartError> {
    if config.control.is_empty() {
        return Err(ProxyStartError::NoControl);
    }
    if config.tls_mode == tls::TlsMode::Mandatory {
        if config.identity.is_none() {
            return Err(ProxyStartError::MandatoryWithoutIdentity);
        }
        if config.control_plane_unavailable == outbound::forward::Unavailable::Forward {
            return Err(ProxyStartError::ForwardWithMandatoryTls);
        }
    }
    let controls = discovery::ControlPlanes::new(&config.control)?;
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = metrics::ProxyMetrics::default();
    metrics.register(&mut registry);
    let discovery = discovery::Discovery::new(controls.clone(), metrics.clone())
        .with_first_answer_timeout(config.discovery.first_answer_timeout);
    let identity_metrics = identity::IdentityMetrics::default();
    let readiness = Readiness::default();
    let store = tether_identity::tls::CertStore::new();
    let (client_tls, server_tls) = match &config.identity {
        Some(id) => {
            identity_metrics.register(&mut registry);
            readiness.require(identity::CERTIFICATE);
            let (client, server) =
                tls::TlsClient::for_identity(&id.trust_root, store.clone(), config.tls_mode)?;
            (Some(client), Some(server))
        }
        None => (None, None),
    };
    let connector = Arc::new(tls::Connector {
        connect_timeout: config.connect_timeout,
        tls: client_tls,
    });

    let outbound_listener = bind("outbound", config.outbound).await?;
    let inbound_listener = match config.app {
        Some(_) => Some(bind("inbound", config.inbound).await?),
        None => None,
    };
    let mut upstream_listeners = Vec::new();
    for (addr, authority) in &config.upstreams {
        upstream_listeners.push((bind("upstream", *addr).await?, authority.clone()));
    }
    let admin_listener = bind("admin", config.admin).await?;

    if let Some(id) = &config.identity {
        tokio::spawn(identity::maintain(
            id.clone(),
            controls.clone(),
            store,
            readiness.clone(),
            identity_metrics,
            shutdown.clone(),
        ));
    }
    let outbound = Arc::new(outbound::Outbound::new(
        discovery,
        metrics.clone(),
        &config,
        connector,
    ));
    // Before the admin listener answers: a probe in the first instant must
    // already see the discovery conditions missing.
    let _pinned = outbound.require_discovery(&config.require_discovery, &readiness);
    tokio::spawn(tether_admin::serve(
        admin_listener,
        Admin {
            readiness,
            metrics: Arc::new(registry),
            extra: None,
        },
        shutdown.clone(),
    ));
    let limits = serve::ServeLimits::new(&config.serve, config.drain_timeout, metrics.clone());
    let mut tasks = Vec::new();
    tasks.push(tokio::spawn(outbound.clone().serve(
        outbound_listener,
        shutdown.clone(),
        limits.clone(),
    )));
    for (listener, authority) in upstream_listeners {
        tasks.push(tokio::spawn(outbound.clone().serve_upstream(
            listener,
            authority,
            shutdown.clone(),
            limits.clone(),
        )));
    }
    if let (Some(listener), Some(app)) = (inbound_listener, config.app) {
        let inbound = Arc::new(inbound::Inbound::new(
            app,
            metrics.clone(),
            &config,
            server_tls,
        ));
        tasks.push(tokio::spawn(inbound.serve(
            listener,
            shutdown.clone(),
            limits.clone(),
        )));
    }
    tokio::spawn(outbound.clone().maintain(shutdown.clone()));
    for t in tasks {
        let _ = t.await;
    }
    tracing::info!("proxy stopped");
    Ok(())
}
