//! The sidecar: an outbound listener (plus `--upstream` listeners) for the
//! app's requests to the mesh, and, when `--app` is set, an inbound
//! listener for the mesh's requests to the app, over one [`Bootstrap`].

use std::net::SocketAddr;
use std::sync::Arc;

use tether_admin::{bind, Shutdown};

use crate::authz::Authorizer;
use crate::bootstrap::{Bootstrap, BootstrapConfig};
use crate::inbound::{Inbound, InboundConfig};
use crate::outbound::forward::Unavailable;
use crate::outbound::{Outbound, OutboundConfig};
use crate::tls::TlsMode;
use crate::ProxyStartError;

#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub bootstrap: BootstrapConfig,
    /// Where the outbound listener binds.
    pub outbound_listen: SocketAddr,
    /// The outbound and inbound listeners are transparent (`IP_TRANSPARENT`),
    /// for `tether init --mode tproxy`.
    pub transparent: bool,
    /// Local listeners pinned to one service each: (listen address, authority).
    pub upstreams: Vec<(SocketAddr, String)>,
    /// Authorities the control plane must have answered before ready.
    pub require_discovery: Vec<String>,
    pub outbound: OutboundConfig,
    /// The inbound side; none without an app.
    pub inbound: Option<InboundConfig>,
}

/// Runs the sidecar until `shutdown` fires and in-flight work has drained.
pub async fn run(config: ProxyConfig, shutdown: Shutdown) -> Result<(), ProxyStartError> {
    if config.bootstrap.tls_mode == TlsMode::Mandatory
        && config.outbound.control_plane_unavailable == Unavailable::Forward
    {
        return Err(ProxyStartError::ForwardWithMandatoryTls);
    }
    if config.transparent {
        tether_identity::own_socket::mark_own_sockets();
    }
    let listen = |what, addr| async move {
        if config.transparent {
            crate::intercept::bind_transparent(what, addr).await
        } else {
            bind(what, addr).await
        }
    };
    let outbound_listener = listen("outbound", config.outbound_listen).await?;
    let inbound_listener = match &config.inbound {
        Some(inbound) => Some(listen("inbound", inbound.listen).await?),
        None => None,
    };
    let mut upstream_listeners = Vec::new();
    for (addr, authority) in &config.upstreams {
        upstream_listeners.push((bind("upstream", *addr).await?, authority.clone()));
    }
    let boot = Bootstrap::new(&config.bootstrap).await?;
    // Before the readiness conditions are complete (`background.start`).
    let authz = config.inbound.as_ref().map(|inbound| {
        let server = match &inbound.workload {
            Some(workload) => boot.discovery.follow_inbound_policy(
                workload,
                inbound.app.port(),
                boot.readiness.clone(),
                shutdown.clone(),
            ),
            None => tokio::sync::watch::channel(None).1,
        };
        Authorizer::new(inbound.policy.clone(), server, boot.metrics.authz.clone())
    });
    let outbound = Arc::new(Outbound::new(
        boot.discovery,
        boot.metrics.clone(),
        &config.outbound,
        boot.connector,
    ));
    let _pinned = outbound.require_discovery(&config.require_discovery, &boot.readiness);
    boot.background.start(boot.readiness, shutdown.clone());

    let limits = boot.limits;
    let mut tasks = vec![tokio::spawn(outbound.clone().serve(
        outbound_listener,
        shutdown.clone(),
        limits.clone(),
    ))];
    for (listener, authority) in upstream_listeners {
        tasks.push(tokio::spawn(outbound.clone().serve_upstream(
            listener,
            authority,
            shutdown.clone(),
            limits.clone(),
        )));
    }
    if let (Some(listener), Some(inbound), Some(authz)) = (inbound_listener, &config.inbound, authz)
    {
        let inbound = Arc::new(Inbound::new(
            inbound,
            boot.metrics.clone(),
            config.bootstrap.connect_timeout,
            boot.server_tls,
            config.bootstrap.tls_mode,
            authz,
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
