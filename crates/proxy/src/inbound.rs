//! The inbound side: connections from peer proxies (or any client) to the
//! local app. Nothing here needs the control plane (once a certificate is
//! held, when identity is on).
//!
//! Per connection: read the first bytes. A TLS ClientHello is terminated
//! with our certificate, the client's certificate is verified against the
//! trust root, and its identity is kept for the connection; then the
//! protocol inside is detected again. Under mandatory TLS anything else is
//! refused. HTTP is served and forwarded to the app (HTTP/1 when the peer
//! marked the request as originally HTTP/1, HTTP/2 otherwise), with the
//! client's verified identity in `tether-client-id` (a value sent by the
//! client itself is always removed). Tether's opaque preface and anything
//! unrecognised are forwarded byte for byte.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderValue, Request, Response, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use rustls::ServerConfig;
use tether_admin::Shutdown;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

use crate::client::{EndpointClient, Proto};
use crate::detect::{detect, PrefixedIo, Protocol};
use crate::errors::ProxyError;
use crate::http::{
    error_response, is_grpc, request_authority, rewrite_for_hop, strip_hop_by_hop, Body, ORIG_PROTO,
};
use crate::metrics::{Hop, ProxyMetrics};
use crate::serve::{accept_loop, serve_http};
use crate::tls::{BoxedIo, Connector, TlsMode};
use crate::ProxyConfig;

/// How long to wait for a client's first bytes before treating the
/// connection as opaque (server-speaks-first protocols).
const DETECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The header carrying the client's verified identity to the app.
pub const CLIENT_ID: &str = "tether-client-id";
/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

pub struct Inbound {
    app: SocketAddr,
    client: EndpointClient,
    connector: Arc<Connector>,
    metrics: ProxyMetrics,
    tls: Option<Arc<ServerConfig>>,
    mode: TlsMode,
}

impl Inbound {
    pub fn new(
        app: SocketAddr,
        metrics: ProxyMetrics,
        config: &ProxyConfig,
        tls: Option<Arc<ServerConfig>>,
    ) -> Self {
        let connector = Connector::plain(config.connect_timeout);
        Self {
            app,
            client: EndpointClient::new(app, None, connector.clone()),
            connector,
            metrics,
            tls,
            mode: config.tls_mode,
        }
    }

    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: Shutdown,
        drain: Duration,
    ) {
        accept_loop("inbound", listener, shutdown, drain, move |mut stream, peer, watcher| {
            let this = self.clone();
            async move {
                let _open = this.metrics.connection("inbound");
                let (proto, prefix) = match detect(&mut stream, DETECT_TIMEOUT).await {
                    Ok(d) => d,
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "inbound detection failed");
                        return;
                    }
                };
                let is_tls = prefix.first() == Some(&TLS_HANDSHAKE);
                let (io, proto, prefix, hop): (BoxedIo, _, _, _) = match (&this.tls, is_tls) {
                    (Some(config), true) => {
                        let (mut tls, client_id) = match crate::tls::terminate(config.clone(), prefix, stream).await {
                            Ok(t) => t,
                            Err(e) => {
                                this.metrics.refuse("tls_handshake");
                                tracing::warn!(%peer, error = %e, "inbound TLS handshake failed");
                                return;
                            }
                        };
                        let (proto, prefix) = match detect(&mut tls, DETECT_TIMEOUT).await {
                            Ok(d) => d,
                            Err(e) => {
                                tracing::debug!(%peer, error = %e, "inbound detection failed");
                                return;
                            }
                        };
                        (tls, proto, prefix, Hop { tls: true, client_id })
                    }
                    _ if this.mode == TlsMode::Mandatory => {
                        this.metrics.refuse("plaintext");
                        tracing::warn!(%peer, "plaintext connection refused: TLS is mandatory");
                        return;
                    }
                    _ => (Box::new(stream), proto, prefix, Hop::default()),
                };
                match proto {
                    Protocol::Closed => {}
                    Protocol::Http => {
                        let hop = Arc::new(hop);
                        let svc = move |req| {
                            let (this, hop) = (this.clone(), hop.clone());
                            async move { this.handle(req, &hop).await }
                        };
                        serve_http(PrefixedIo::new(prefix, io), svc, watcher).await;
                    }
                    Protocol::Opaque | Protocol::OpaqueTransport => {
                        this.forward_tcp(io, prefix, peer).await;
                    }
                }
            }
        })
        .await
    }

    async fn handle(&self, req: Request<Incoming>, hop: &Hop) -> Response<Body> {
        let start = Instant::now();
        let grpc = is_grpc(req.headers());
        let authority = request_authority(&req).unwrap_or_else(|| self.app.to_string());
        let version = req.version();
        let (mut parts, body) = req.into_parts();
        let downgrade = parts.headers.remove(ORIG_PROTO).is_some();
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(CLIENT_ID);
        if let Some(id) = hop
            .client_id
            .as_deref()
            .and_then(|id| HeaderValue::from_str(id).ok())
        {
            parts.headers.insert(CLIENT_ID, id);
        }
        let proto = if downgrade || version != Version::HTTP_2 {
            Proto::Http1
        } else {
            Proto::Http2
        };
        let result = match self.client.connection(proto).await {
            Ok(conn) => conn
                .send(rewrite_for_hop(
                    parts,
                    body.boxed(),
                    &authority,
                    proto,
                    false,
                ))
                .await
                .map_err(|e| ProxyError::App {
                    addr: self.app,
                    reason: e.to_string(),
                }),
            Err(reason) => Err(ProxyError::App {
                addr: self.app,
                reason,
            }),
        };
        let rsp = match result {
            Ok(rsp) => {
                let (mut parts, body) = rsp.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                Response::from_parts(parts, body.boxed())
            }
            Err(e) => {
                tracing::warn!(error = %e, "inbound request failed");
                error_response(&e, grpc)
            }
        };
        self.metrics
            .record_response(rsp, "inbound", authority, start.elapsed(), hop.clone())
    }

    async fn forward_tcp(&self, mut client: BoxedIo, prefix: bytes::Bytes, peer: SocketAddr) {
        let mut app = match self.connector.connect(self.app, None).await {
            Ok((s, _)) => s,
            Err(reason) => {
                tracing::warn!(%peer, app = %self.app, %reason, "app unreachable for opaque connection");
                return;
            }
        };
        if !prefix.is_empty() && app.write_all(&prefix).await.is_err() {
            return;
        }
        if let Ok((up, down)) = tokio::io::copy_bidirectional(&mut client, &mut app).await {
            self.metrics
                .tcp_bytes
                .get_or_create(&crate::metrics::DirectionLabels {
                    direction: "inbound".into(),
                })
                .inc_by(up + down + prefix.len() as u64);
        }
    }
}
