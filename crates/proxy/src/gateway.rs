//! The multicluster gateway: accepts mTLS from other clusters' proxies,
//! checks that the client's identity belongs to the mesh's trust domain,
//! and forwards each request to the local services of the global id it
//! names (`:authority` `<global-id>.global:<port>`, set by the calling
//! proxy from discovery's authority override), balancing over their
//! endpoints exactly as the outbound proxy does — it *is* an outbound proxy
//! behind a TLS listener. Plaintext, foreign identities and non-global
//! authorities are refused.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Response, StatusCode};
use tether_admin::{bind, Shutdown};
use tether_core::log_limit::LogLimit;
use tether_core::truncate::for_log;

use crate::bootstrap::{Bootstrap, BootstrapConfig};
use crate::detect::first_bytes;
use crate::outbound::{Outbound, OutboundConfig};
use crate::serve::{accept_loop, serve_http, Conn};
use crate::tls::TlsMode;
use crate::ProxyStartError;

#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// TLS is always mandatory at a gateway, and an identity required.
    pub bootstrap: BootstrapConfig,
    /// Where other clusters' proxies connect.
    pub listen: SocketAddr,
    /// Clients must hold an identity in this trust domain.
    pub trust_domain: String,
    pub outbound: OutboundConfig,
}

/// Refusals are counted one by one but logged at most this often.
static REFUSAL_LOG: LogLimit = LogLimit::new(Duration::from_secs(5));

fn forbidden(msg: String) -> Response<crate::http::Body> {
    let mut rsp = Response::new(crate::http::full(format!("{msg}\n")));
    *rsp.status_mut() = StatusCode::FORBIDDEN;
    if let Ok(v) = http::HeaderValue::from_str(&msg) {
        rsp.headers_mut().insert(crate::http::PROXY_ERROR, v);
    }
    rsp
}

pub async fn run(config: GatewayConfig, shutdown: Shutdown) -> Result<(), ProxyStartError> {
    let mut bootstrap = config.bootstrap.clone();
    bootstrap.tls_mode = TlsMode::Mandatory;
    let listener = bind("gateway", config.listen).await?;
    let boot = Bootstrap::new(&bootstrap).await?;
    let server_tls = boot
        .server_tls
        .clone()
        .ok_or(ProxyStartError::MandatoryWithoutIdentity)?;
    let metrics = boot.metrics.clone();
    let outbound = Arc::new(Outbound::new(
        boot.discovery,
        metrics.clone(),
        &config.outbound,
        boot.connector,
    ));
    boot.background.start(boot.readiness, shutdown.clone());
    tokio::spawn(outbound.clone().maintain(shutdown.clone()));
    let suffix: Arc<str> = format!(".identity.{}", config.trust_domain).into();
    accept_loop("gateway", listener, shutdown, boot.limits, move |mut stream, peer, conn| {
        let (outbound, metrics, server_tls, suffix) =
            (outbound.clone(), metrics.clone(), server_tls.clone(), suffix.clone());
        async move {
            let _open = metrics.connection("gateway");
            let Ok(prefix) = first_bytes(&mut stream, Duration::from_secs(10)).await else { return };
            if prefix.first() != Some(&0x16) {
                metrics.refuse("plaintext");
                if let Some(suppressed) = REFUSAL_LOG.allow() {
                    tracing::warn!(%peer, suppressed, "gateway refused a plaintext connection");
                }
                return;
            }
            let (io, client_id) = match crate::tls::terminate(server_tls, prefix, stream).await {
                Ok(t) => t,
                Err(e) => {
                    metrics.refuse("tls_handshake");
                    if let Some(suppressed) = REFUSAL_LOG.allow() {
                        tracing::warn!(%peer, error = %e, suppressed, "gateway TLS handshake failed");
                    }
                    return;
                }
            };
            if !client_id.as_deref().is_some_and(|id| id.ends_with(&*suffix)) {
                metrics.refuse("foreign_identity");
                if let Some(suppressed) = REFUSAL_LOG.allow() {
                    tracing::warn!(%peer, client = ?client_id, suppressed, "gateway refused a client outside the trust domain");
                }
                return;
            }
            serve_global(io, outbound, conn).await;
        }
    })
    .await;
    Ok(())
}

/// Serves HTTP on a gateway connection, routing global ids only. A plain
/// function that names its future `Send`: inferred inside the accept
/// loop's async block, the check trips over the boxed body error's
/// lifetime (rust-lang/rust#64552).
fn serve_global<I>(io: I, outbound: Arc<Outbound>, conn: Conn) -> impl Future<Output = ()> + Send
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = move |req: http::Request<crate::serve::RequestBody>| {
        let outbound = outbound.clone();
        async move {
            let authority = crate::http::request_authority(&req).unwrap_or_default();
            let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
            if !host.ends_with(".global") {
                return forbidden(format!(
                    "the gateway routes only global ids, not {}",
                    for_log(authority)
                ));
            }
            // Boxed, so the gateway's own refusal above is the same type.
            outbound
                .handle(req, None)
                .await
                .map(http_body_util::BodyExt::boxed)
        }
    };
    serve_http(io, svc, conn)
}
