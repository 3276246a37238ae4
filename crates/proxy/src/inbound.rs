//! The inbound side: connections from peer proxies (or any client) to the
//! local app. Nothing here needs the control plane.
//!
//! The protocol is detected on the first bytes: HTTP is served and
//! forwarded to the app (HTTP/1 when the peer marked the request as
//! originally HTTP/1, HTTP/2 otherwise); Tether's opaque preface and
//! anything unrecognised are forwarded byte for byte.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Request, Response, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tether_admin::Shutdown;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::client::{connect_tcp, EndpointClient, Proto};
use crate::detect::{detect, PrefixedIo, Protocol};
use crate::errors::ProxyError;
use crate::http::{
    error_response, is_grpc, request_authority, rewrite_for_hop, status_class, strip_hop_by_hop,
    Body, ORIG_PROTO,
};
use crate::metrics::ProxyMetrics;
use crate::serve::{accept_loop, serve_http};
use crate::ProxyConfig;

/// How long to wait for a client's first bytes before treating the
/// connection as opaque (server-speaks-first protocols).
const DETECT_TIMEOUT: Duration = Duration::from_secs(10);

pub struct Inbound {
    app: SocketAddr,
    client: EndpointClient,
    metrics: ProxyMetrics,
    connect_timeout: Duration,
}

impl Inbound {
    pub fn new(app: SocketAddr, metrics: ProxyMetrics, config: &ProxyConfig) -> Self {
        Self {
            app,
            client: EndpointClient::new(app, config.connect_timeout),
            metrics,
            connect_timeout: config.connect_timeout,
        }
    }

    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: Shutdown,
        drain: Duration,
    ) {
        accept_loop(
            "inbound",
            listener,
            shutdown,
            drain,
            move |mut stream, peer, watcher| {
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
                    match proto {
                        Protocol::Closed => {}
                        Protocol::Http => {
                            let svc = move |req| {
                                let this = this.clone();
                                async move { this.handle(req).await }
                            };
                            serve_http(PrefixedIo::new(prefix, stream), svc, watcher).await;
                        }
                        Protocol::Opaque | Protocol::OpaqueTransport => {
                            this.forward_tcp(stream, prefix, peer).await;
                        }
                    }
                }
            },
        )
        .await
    }

    async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let start = Instant::now();
        let grpc = is_grpc(req.headers());
        let authority = request_authority(&req).unwrap_or_else(|| self.app.to_string());
        let version = req.version();
        let (mut parts, body) = req.into_parts();
        let downgrade = parts.headers.remove(ORIG_PROTO).is_some();
        strip_hop_by_hop(&mut parts.headers);
        let hop = if downgrade || version != Version::HTTP_2 {
            Proto::Http1
        } else {
            Proto::Http2
        };
        let result = match self.client.connection(hop).await {
            Ok(conn) => conn
                .send(rewrite_for_hop(parts, body.boxed(), &authority, hop, false))
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
        self.metrics.record(
            "inbound",
            &authority,
            status_class(rsp.status()),
            start.elapsed(),
        );
        rsp
    }

    async fn forward_tcp(&self, mut client: TcpStream, prefix: bytes::Bytes, peer: SocketAddr) {
        let mut app = match connect_tcp(self.app, self.connect_timeout).await {
            Ok(s) => s,
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
