//! The multicluster gateway: accepts mTLS from other clusters' proxies,
//! checks that the client's identity belongs to the mesh's trust domain,
//! and forwards each request to the local services of the global id it
//! names (`:authority` `<global-id>.global:<port>`, set by the calling
//! proxy from discovery's authority override), balancing over their
//! endpoints exactly as the outbound proxy does — it *is* an outbound proxy
//! behind a TLS listener. Plaintext, foreign identities and non-global
//! authorities are refused.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Response, StatusCode};
use tether_admin::{bind, Admin, Readiness, Shutdown};

use crate::detect::first_bytes;
use crate::identity::IdentityConfig;
use crate::outbound::Outbound;
use crate::serve::{accept_loop, serve_http, ServeLimits};
use crate::{ProxyConfig, ProxyStartError};

#[derive(Clone, Debug)]
pub struct GatewayConfig {
    pub control: Vec<String>,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub identity: IdentityConfig,
    /// Clients must hold an identity in this trust domain.
    pub trust_domain: String,
    pub failfast_timeout: Duration,
    pub connect_timeout: Duration,
    pub drain_timeout: Duration,
    pub serve: crate::serve::ServeConfig,
    pub response_timeout: Option<Duration>,
}

fn forbidden(msg: String) -> Response<crate::http::Body> {
    let mut rsp = Response::new(crate::http::full(format!("{msg}\n")));
    *rsp.status_mut() = StatusCode::FORBIDDEN;
    if let Ok(v) = http::HeaderValue::from_str(&msg) {
        rsp.headers_mut().insert(crate::http::PROXY_ERROR, v);
    }
    rsp
}

pub async fn run(config: GatewayConfig, shutdown: Shutdown) -> Result<(), ProxyStartError> {
    let proxy_config = ProxyConfig {
        control: config.control.clone(),
        outbound: config.listen,
        inbound: config.listen,
        admin: config.admin,
        app: None,
        inbound_opaque: false,
        upstreams: vec![],
        failfast_timeout: config.failfast_timeout,
        connect_timeout: config.connect_timeout,
        drain_timeout: config.drain_timeout,
        identity: Some(config.identity.clone()),
        tls_mode: crate::tls::TlsMode::Mandatory,
        control_plane_unavailable: crate::outbound::forward::Unavailable::Fail,
        max_pending: 1000,
        require_discovery: vec![],
        retry_budget: crate::retry::BudgetSpec::default(),
        serve: config.serve.clone(),
        response_timeout: config.response_timeout,
        discovery: Default::default(),
    };
    let controls = crate::discovery::ControlPlanes::new(&config.control)?;
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = crate::metrics::ProxyMetrics::default();
    metrics.register(&mut registry);
    let identity_metrics = crate::identity::IdentityMetrics::default();
    identity_metrics.register(&mut registry);
    let discovery = crate::discovery::Discovery::new(controls.clone(), metrics.clone());
    let readiness = Readiness::default();
    readiness.require(crate::identity::CERTIFICATE);
    let store = tether_identity::tls::CertStore::new();
    let (client_tls, server_tls) = crate::tls::TlsClient::for_identity(
        &config.identity.trust_root,
        store.clone(),
        crate::tls::TlsMode::Mandatory,
    )?;
    let connector = Arc::new(crate::tls::Connector {
        connect_timeout: config.connect_timeout,
        tls: Some(client_tls),
    });
    let listener = bind("gateway", config.listen).await?;
    let admin_listener = bind("admin", config.admin).await?;
    tokio::spawn(crate::identity::maintain(
        config.identity.clone(),
        controls,
        store,
        readiness.clone(),
        identity_metrics,
        shutdown.clone(),
    ));
    tokio::spawn(tether_admin::serve(
        admin_listener,
        Admin {
            readiness,
            metrics: Arc::new(registry),
            extra: None,
        },
        shutdown.clone(),
    ));
    let outbound = Arc::new(Outbound::new(
        discovery,
        metrics.clone(),
        &proxy_config,
        connector,
    ));
    tokio::spawn(outbound.clone().maintain(shutdown.clone()));
    let suffix: Arc<str> = format!(".identity.{}", config.trust_domain).into();
    let limits = ServeLimits::new(&config.serve, config.drain_timeout, metrics.clone());
    accept_loop("gateway", listener, shutdown, limits, move |mut stream, peer, conn| {
        let (outbound, metrics, server_tls, suffix) =
            (outbound.clone(), metrics.clone(), server_tls.clone(), suffix.clone());
        async move {
            let _open = metrics.connection("gateway");
            let Ok(prefix) = first_bytes(&mut stream, Duration::from_secs(10)).await else { return };
            if prefix.first() != Some(&0x16) {
                metrics.refuse("plaintext");
                tracing::warn!(%peer, "gateway refused a plaintext connection");
                return;
            }
            let (io, client_id) = match crate::tls::terminate(server_tls, prefix, stream).await {
                Ok(t) => t,
                Err(e) => {
                    metrics.refuse("tls_handshake");
                    tracing::warn!(%peer, error = %e, "gateway TLS handshake failed");
                    return;
                }
            };
            if !client_id.as_deref().is_some_and(|id| id.ends_with(&*suffix)) {
                metrics.refuse("foreign_identity");
                tracing::warn!(%peer, client = ?client_id, "gateway refused a client outside the trust domain");
                return;
            }
            let svc = move |req: http::Request<hyper::body::Incoming>| {
                let outbound = outbound.clone();
                async move {
                    let authority = crate::http::request_authority(&req).unwrap_or_default();
                    let host = authority.rsplit_once(':').map_or(authority.as_str(), |(h, _)| h);
                    if !host.ends_with(".global") {
                        return forbidden(format!("the gateway routes only global ids, not {authority:?}"));
                    }
                    outbound.handle(req, None).await
                }
            };
            serve_http(io, svc, conn).await;
        }
    })
    .await;
    Ok(())
}
