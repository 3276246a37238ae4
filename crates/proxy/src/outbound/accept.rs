//! Step 0, from connection to request: the outbound listener (HTTP from
//! the app), connections iptables redirected (their original destination
//! names the service; a port declared opaque is forwarded as TCP, anything
//! else must be HTTP), and `--upstream` listeners pinned to one service.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tether_admin::Shutdown;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use super::Outbound;
use crate::detect::{detect, PrefixedIo, Protocol, Unrecognized};
use crate::errors::ProxyError;
use crate::http::raw_bad_request;
use crate::serve::{accept_loop, serve_http, Conn, ServeLimits};

/// How long an intercepted connection may take to send its first line.
const DETECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Refused connections are counted one by one but logged at most this often.
static REFUSAL_LOG: tether_core::log_limit::LogLimit =
    tether_core::log_limit::LogLimit::new(Duration::from_secs(5));

impl Outbound {
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: Shutdown,
        limits: ServeLimits,
    ) {
        // Where a connection's own address differs from it, TPROXY
        // diverted the connection here (see `intercept`).
        let Ok(listening) = listener.local_addr() else {
            tracing::error!("outbound listener has no address; not served");
            return;
        };
        accept_loop(
            "outbound",
            listener,
            shutdown,
            limits,
            move |stream, _, conn| {
                let this = self.clone();
                async move {
                    let _open = this.metrics.connection("outbound");
                    if let Some(dst) = crate::intercept::original_dst(&stream, listening) {
                        return this.serve_intercepted(stream, dst, conn).await;
                    }
                    let svc = move |req| {
                        let this = this.clone();
                        async move { this.handle(req, None).await }
                    };
                    serve_http(stream, svc, conn).await;
                }
            },
        )
        .await
    }

    /// A connection iptables redirected or diverted: it is for whatever `dst` is — a
    /// service's cluster IP, a pod's IP, or something outside the mesh,
    /// which is passed through as opaque TCP (never under mandatory TLS).
    async fn serve_intercepted(
        self: Arc<Self>,
        mut stream: TcpStream,
        dst: std::net::SocketAddr,
        conn: Conn,
    ) {
        let authority: Arc<str> = dst.to_string().into();
        let svc = self.service(&authority);
        let endpoints = match svc.ready_endpoints(self.failfast_timeout).await {
            Ok(eps) => eps,
            Err(ProxyError::UnknownService(_) | ProxyError::ControlPlaneUnreachable) => {
                if self.connector.is_mandatory() {
                    self.metrics
                        .refuse_outbound("mandatory_tls_unknown_destination");
                    tracing::warn!(%dst, "refused: {dst} is not in the mesh and TLS is mandatory, so it cannot be reached in plaintext");
                    return;
                }
                let client = self.forwarder.client(dst);
                let mut server = match client.connect_stream().await {
                    Ok((s, _)) => s,
                    Err(reason) => {
                        tracing::debug!(%dst, %reason, "pass-through connect failed");
                        return;
                    }
                };
                let _ = tokio::io::copy_bidirectional(&mut stream, &mut server).await;
                return;
            }
            Err(e) => {
                tracing::warn!(%dst, error = %e, "intercepted connection closed");
                return;
            }
        };
        if endpoints.iter().any(|h| h.endpoint.opaque) {
            // Declared opaque: no detection (the server may speak first).
            return self
                .forward_tcp(Box::new(stream), &authority, &endpoints)
                .await;
        }
        let (proto, prefix) = match detect(&mut stream, Bytes::new(), DETECT_TIMEOUT).await {
            Ok(d) => d,
            Err(_) => return,
        };
        let why = match proto {
            Protocol::Closed => return,
            Protocol::Http => {
                let io = PrefixedIo::new(prefix, stream);
                let svc = move |req| {
                    let (this, authority) = (self.clone(), authority.clone());
                    async move { this.handle(req, Some(&authority)).await }
                };
                return serve_http(io, svc, conn).await;
            }
            Protocol::OpaqueTransport => Unrecognized::BadRequestLine,
            Protocol::Unrecognized(why) => why,
        };
        // Not HTTP, to a port not declared opaque: refused, never forwarded
        // as bytes (see `detect`).
        self.metrics.refuse_outbound(why.reason());
        if let Some(suppressed) = REFUSAL_LOG.allow() {
            tracing::warn!(%dst, reason = %why, suppressed, "outbound connection refused: not HTTP and the port is not declared opaque");
        }
        if why.answer_400() {
            let _ = stream.write_all(&raw_bad_request(&why.to_string())).await;
            let _ = stream.shutdown().await;
        }
    }

    /// A local listener pinned to one service: opaque TCP when the service
    /// port is opaque, HTTP otherwise (whatever Host the app sends).
    pub async fn serve_upstream(
        self: Arc<Self>,
        listener: TcpListener,
        authority: String,
        shutdown: Shutdown,
        limits: ServeLimits,
    ) {
        let authority: Arc<str> = match super::logical::normalize(&authority) {
            Ok(a) => a.into(),
            Err(e) => {
                tracing::error!(%authority, error = %e, "upstream not served");
                return;
            }
        };
        accept_loop(
            "upstream",
            listener,
            shutdown,
            limits,
            move |stream, _, conn| {
                let this = self.clone();
                let authority = authority.clone();
                async move {
                    let _open = this.metrics.connection("outbound");
                    let svc = this.service(&authority);
                    let endpoints = match svc.ready_endpoints(this.failfast_timeout).await {
                        Ok(eps) => eps,
                        Err(e) => {
                            tracing::warn!(%authority, error = %e, "upstream connection refused");
                            return;
                        }
                    };
                    if endpoints.iter().any(|h| h.endpoint.opaque) {
                        this.forward_tcp(Box::new(stream), &authority, &endpoints)
                            .await;
                    } else {
                        let svc = move |req| {
                            let this = this.clone();
                            let authority = authority.clone();
                            async move { this.handle(req, Some(&authority)).await }
                        };
                        serve_http(stream, svc, conn).await;
                    }
                }
            },
        )
        .await
    }
}
