//! The outbound side: requests from the local app to mesh services.
//!
//! A request's path: authority (Host, absolute URI or `:authority`) →
//! the [`service::Service`] for that authority (one discovery stream, one
//! balancer, one fail-fast watcher) → its endpoints, waiting in a bounded
//! queue at most the fail-fast timeout → pick by P2C → a pooled connection
//! (HTTP/2, mTLS when possible, to peer proxies) → response. A connection
//! that cannot be established is retried on another endpoint (the request
//! has not been sent, so this is always safe). When discovery cannot route
//! a request, [`forward`] may send it to its original destination.

pub mod forward;
pub mod service;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tether_admin::{Readiness, Shutdown};
use tether_core::log_limit::LogLimit;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use self::forward::{Forwarder, Unavailable};
use self::service::{effective_timeout, Service, ServiceCache};
use crate::balance::{pick, EndpointHandle};
use crate::client::{EndpointClient, Proto};
use crate::detect::{detect, PrefixedIo, Protocol, Unrecognized, OPAQUE_PREFACE};
use crate::discovery::Discovery;
use crate::errors::ProxyError;
use crate::http::{
    error_response, is_grpc, raw_bad_request, request_authority, rewrite_for_hop, strip_hop_by_hop,
    strip_mesh_asserted, Body, ORIG_PROTO, PROXY_ERROR,
};
use crate::metrics::{Hop, ProxyMetrics};
use crate::serve::{accept_loop, serve_http, Conn, ServeLimits};
use crate::tls::Connector;
use crate::ProxyConfig;

/// Endpoints tried per request when connections fail.
const CONNECT_ATTEMPTS: usize = 3;
/// Retries (after a request was sent) per request, whatever the budget.
const MAX_RETRIES: usize = 3;
/// How long an intercepted connection may take to send its first line.
const DETECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Refused connections are counted one by one but logged at most this often.
static REFUSAL_LOG: LogLimit = LogLimit::new(Duration::from_secs(5));

pub struct Outbound {
    discovery: Discovery,
    services: ServiceCache,
    metrics: ProxyMetrics,
    failfast_timeout: Duration,
    max_pending: usize,
    connector: Arc<Connector>,
    unavailable: Unavailable,
    forwarder: Forwarder,
    retry_budget: crate::retry::BudgetSpec,
    response_timeout: Option<Duration>,
}

/// A copy of a request's head (extensions are not carried across hops).
fn clone_parts(parts: &http::request::Parts) -> http::request::Parts {
    let mut req = Request::new(());
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = parts.uri.clone();
    *req.version_mut() = parts.version;
    *req.headers_mut() = parts.headers.clone();
    req.into_parts().0
}

/// Adds the default port and lowercases, so `Web.demo` and `web.demo:80`
/// share one service.
fn normalize(authority: &str) -> Result<String, ProxyError> {
    let (host, port) = tether_core::authority::split_host_port(authority).map_err(|e| {
        ProxyError::InvalidAuthority {
            authority: authority.to_string(),
            reason: e.to_string(),
        }
    })?;
    Ok(format!("{}:{port}", host.to_ascii_lowercase()))
}

impl Outbound {
    pub fn new(
        discovery: Discovery,
        metrics: ProxyMetrics,
        config: &ProxyConfig,
        connector: Arc<Connector>,
    ) -> Self {
        Self {
            discovery,
            services: ServiceCache::new(config.discovery.max_subscriptions),
            metrics,
            failfast_timeout: config.failfast_timeout,
            max_pending: config.max_pending,
            connector,
            unavailable: config.control_plane_unavailable,
            forwarder: Forwarder::new(config.connect_timeout),
            retry_budget: config.retry_budget,
            response_timeout: config.response_timeout,
        }
    }

    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: Shutdown,
        limits: ServeLimits,
    ) {
        accept_loop(
            "outbound",
            listener,
            shutdown,
            limits,
            move |stream, _, conn| {
                let this = self.clone();
                async move {
                    let _open = this.metrics.connection("outbound");
                    if let Some(dst) = crate::intercept::original_dst(&stream) {
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

    /// A connection iptables redirected: it is for whatever `dst` is — a
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
        let authority: Arc<str> = match normalize(&authority) {
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

    fn service(&self, authority: &str) -> Arc<Service> {
        let make = || {
            Service::new(
                authority,
                &self.discovery,
                self.connector.clone(),
                self.failfast_timeout,
                self.max_pending,
                self.retry_budget,
                &self.metrics,
            )
        };
        self.services
            .get(authority, &self.metrics, make)
            .unwrap_or_else(|e| Arc::new(Service::refused(authority, self.connector.clone(), e)))
    }

    /// Resolves `authorities` at start and holds the proxy not-ready until
    /// the control plane has answered for each (`--require-discovery`).
    pub fn require_discovery(
        self: &Arc<Self>,
        authorities: &[String],
        readiness: &Readiness,
    ) -> Vec<Arc<Service>> {
        let mut pinned = Vec::new();
        for authority in authorities {
            let Ok(authority) = normalize(authority) else {
                continue;
            };
            let condition = format!("discovery of {authority}");
            readiness.require(condition.clone());
            let svc = self.service(&authority);
            let mut rx = svc.balancer.watch();
            let readiness = readiness.clone();
            tokio::spawn(async move {
                if rx.wait_for(|r| r.answered).await.is_ok() {
                    readiness.set(&condition, true);
                }
            });
            pinned.push(svc);
        }
        pinned
    }

    /// Forgets services nobody has used for a while; refreshes the age of
    /// each service's last discovery update.
    pub async fn maintain(self: Arc<Self>, shutdown: Shutdown) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.triggered() => return,
            }
            self.services.sweep(&self.metrics);
        }
    }

    pub async fn handle(&self, req: Request<Incoming>, pinned: Option<&str>) -> Response<Body> {
        let start = Instant::now();
        let grpc = is_grpc(req.headers());
        if req.method() == Method::CONNECT {
            let rsp = error_response(&ProxyError::ConnectUnsupported, grpc);
            return self.metrics.record_response(
                rsp,
                "outbound",
                String::new(),
                start.elapsed(),
                Hop::default(),
            );
        }
        let absolute = req.uri().scheme().is_some();
        let authority = match pinned
            .map(str::to_string)
            .or_else(|| request_authority(&req))
        {
            Some(a) => normalize(&a),
            None => Err(ProxyError::NoAuthority),
        };
        let (label, result) = match authority {
            Ok(authority) => {
                let svc = self.service(&authority);
                let profile = svc.response_timeout();
                let routed = self.route(svc, &authority, req, absolute);
                let result = self.within_response_timeout(routed, profile, start).await;
                (authority, result)
            }
            Err(e) => ("".to_string(), Err(e)),
        };
        let (rsp, hop) = result.unwrap_or_else(|e| {
            tracing::debug!(authority = %label, error = %e, "outbound request failed");
            (error_response(&e, grpc), Hop::default())
        });
        self.metrics
            .record_response(rsp, "outbound", label, start.elapsed(), hop)
    }

    /// Bounds the time to response headers, from the request's start, by
    /// the service's timeout — re-read when the profile arrives after the
    /// request started. A body that streams afterwards is never cut.
    async fn within_response_timeout<F>(
        &self,
        routed: F,
        mut profile: watch::Receiver<Option<Duration>>,
        start: Instant,
    ) -> Result<(Response<Body>, Hop), ProxyError>
    where
        F: std::future::Future<Output = Result<(Response<Body>, Hop), ProxyError>>,
    {
        tokio::pin!(routed);
        let mut profile_open = true;
        loop {
            let limit = effective_timeout(*profile.borrow_and_update(), self.response_timeout);
            let expired = async {
                match limit {
                    Some(l) => tokio::time::sleep_until((start + l).into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                result = &mut routed => return result,
                _ = expired => return Err(ProxyError::ResponseTimeout(limit.unwrap_or_default())),
                changed = profile.changed(), if profile_open => profile_open = changed.is_ok(),
            }
        }
    }

    async fn route(
        &self,
        svc: Arc<Service>,
        authority: &str,
        req: Request<Incoming>,
        absolute: bool,
    ) -> Result<(Response<Body>, Hop), ProxyError> {
        let mut endpoints = match svc.ready_endpoints(self.failfast_timeout).await {
            Ok(eps) => eps,
            Err(e @ (ProxyError::ControlPlaneUnreachable | ProxyError::UnknownService(_)))
                if self.unavailable == Unavailable::Forward =>
            {
                let Some(dst) = self.forwarder.destination(authority, absolute).await else {
                    return Err(e);
                };
                tracing::debug!(%authority, %dst, reason = %e, "forwarding to the original destination");
                let client = self.forwarder.client(dst);
                return self
                    .send(&client, req, authority, false)
                    .await
                    .map(|(rsp, _)| (rsp, Hop::default()));
            }
            Err(e) => return Err(e),
        };
        let (mut parts, body) = req.into_parts();
        // A request that reached us over HTTP/2 from another proxy (a
        // gateway's case) may have been HTTP/1 at its origin.
        let version = if parts.headers.contains_key(ORIG_PROTO) {
            Version::HTTP_11
        } else {
            parts.version
        };
        strip_hop_by_hop(&mut parts.headers);
        strip_mesh_asserted(&mut parts.headers);
        parts.headers.remove(ORIG_PROTO);
        let budget = svc.retry_budget();
        budget.deposit();
        // Keep the body of a retryable request, so it can be sent again.
        let retryable = crate::retry::is_retryable(&parts.method, &parts.headers)
            && (hyper::body::Body::is_end_stream(&body)
                || hyper::body::Body::size_hint(&body)
                    .exact()
                    .is_some_and(|n| n <= crate::retry::MAX_BODY));
        let (kept, mut body) = if retryable {
            let bytes = body
                .collect()
                .await
                .map_err(|e| ProxyError::RequestBody(e.to_string()))?
                .to_bytes();
            (Some(bytes), None)
        } else {
            (None, Some(body.boxed()))
        };
        let mut tried = Vec::new();
        let mut retries = 0;
        loop {
            let attempt_body = match (&kept, body.take()) {
                (Some(bytes), _) => crate::http::full(bytes.clone()),
                (None, Some(b)) => b,
                (None, None) => unreachable!("a request that cannot be retried is sent once"),
            };
            let attempt = self
                .attempt(
                    &svc,
                    &endpoints,
                    &mut tried,
                    clone_parts(&parts),
                    attempt_body,
                    authority,
                    version,
                )
                .await;
            let failed_before_app = match &attempt {
                Ok((rsp, _)) => {
                    matches!(rsp.status().as_u16(), 502 | 503)
                        && rsp.headers().contains_key(crate::http::PROXY_ERROR)
                }
                Err(ProxyError::Connect { .. } | ProxyError::Upstream { .. }) => true,
                Err(_) => false,
            };
            if !failed_before_app || kept.is_none() || retries == MAX_RETRIES {
                return attempt;
            }
            retries += 1;
            if !budget.withdraw() {
                self.metrics.retry(authority, "budget_exhausted");
                return attempt;
            }
            if !endpoints.iter().any(|h| !tried.contains(&h.endpoint.addr)) {
                // Every endpoint failed: wait (bounded) for discovery to
                // offer others — e.g. another cluster taking over.
                match self.new_endpoints(&svc, &tried).await {
                    Some(eps) => endpoints = eps,
                    None => return attempt,
                }
            }
            self.metrics.retry(authority, "retried");
            tracing::debug!(%authority, "retrying on another endpoint");
        }
    }

    /// Waits at most the fail-fast timeout for the service to have an
    /// endpoint not in `tried`.
    async fn new_endpoints(
        &self,
        svc: &Service,
        tried: &[std::net::SocketAddr],
    ) -> Option<Vec<Arc<EndpointHandle>>> {
        let deadline = tokio::time::Instant::now() + self.failfast_timeout;
        let mut rx = svc.balancer.watch();
        loop {
            let endpoints = svc.balancer.endpoints();
            if endpoints.iter().any(|h| !tried.contains(&h.endpoint.addr)) {
                return Some(endpoints);
            }
            tokio::select! {
                changed = rx.changed() => if changed.is_err() { return None },
                _ = tokio::time::sleep_until(deadline) => return None,
            }
        }
    }

    /// One try: an endpoint not yet tried (moving on when a connection
    /// cannot be made; nothing was sent), the request, the response.
    #[allow(clippy::too_many_arguments)]
    async fn attempt(
        &self,
        svc: &Service,
        endpoints: &[Arc<EndpointHandle>],
        tried: &mut Vec<std::net::SocketAddr>,
        parts: http::request::Parts,
        body: Body,
        authority: &str,
        version: Version,
    ) -> Result<(Response<Body>, Hop), ProxyError> {
        let mut request = Some((parts, body));
        let mut last_error = ProxyError::FailFast;
        for _ in 0..CONNECT_ATTEMPTS {
            let Some(ep) = pick(endpoints, tried) else {
                break;
            };
            let addr = ep.endpoint.addr;
            tried.push(addr);
            let proto = if ep.endpoint.meshed || version == Version::HTTP_2 {
                Proto::Http2
            } else {
                Proto::Http1
            };
            let in_flight = ep.start();
            let conn = match ep.client.connection(proto).await {
                Ok(c) => c,
                Err(reason) => {
                    tracing::debug!(%addr, %reason, "connect failed; trying another endpoint");
                    ep.mark_failed();
                    last_error = ProxyError::Connect { addr, reason };
                    continue;
                }
            };
            let hop = Hop {
                tls: conn.tls,
                client_id: None,
            };
            let (parts, body) = request.take().expect("request is sent once");
            let carry_http1 = ep.endpoint.meshed && version != Version::HTTP_2;
            let hop_authority = ep
                .endpoint
                .authority_override
                .as_deref()
                .unwrap_or(authority);
            let req = rewrite_for_hop(parts, body, hop_authority, proto, carry_http1);
            let sent = Instant::now();
            return match conn.send(req).await {
                Ok(rsp) => {
                    in_flight.observe(sent.elapsed());
                    let (mut parts, body) = rsp.into_parts();
                    strip_hop_by_hop(&mut parts.headers);
                    if !ep.endpoint.meshed {
                        // Only a peer proxy may say that it, not the app, failed.
                        parts.headers.remove(PROXY_ERROR);
                    }
                    Ok((Response::from_parts(parts, body.boxed()), hop))
                }
                Err(e) => {
                    ep.mark_failed();
                    Err(ProxyError::Upstream {
                        addr,
                        reason: e.to_string(),
                    })
                }
            };
        }
        if endpoints.iter().all(|h| h.is_failing()) {
            svc.report_stall();
        }
        Err(last_error)
    }

    /// Sends `req` to one client (no balancing), as HTTP/1 or HTTP/2 like
    /// the request came.
    async fn send(
        &self,
        client: &EndpointClient,
        req: Request<Incoming>,
        authority: &str,
        carry_http1: bool,
    ) -> Result<(Response<Body>, bool), ProxyError> {
        let addr = client.addr();
        let proto = if req.version() == Version::HTTP_2 {
            Proto::Http2
        } else {
            Proto::Http1
        };
        let (mut parts, body) = req.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        strip_mesh_asserted(&mut parts.headers);
        parts.headers.remove(ORIG_PROTO);
        let conn = client
            .connection(proto)
            .await
            .map_err(|reason| ProxyError::Connect { addr, reason })?;
        let tls = conn.tls;
        let req = rewrite_for_hop(parts, body.boxed(), authority, proto, carry_http1);
        let rsp = conn.send(req).await.map_err(|e| ProxyError::Upstream {
            addr,
            reason: e.to_string(),
        })?;
        let (mut parts, body) = rsp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(PROXY_ERROR);
        Ok((Response::from_parts(parts, body.boxed()), tls))
    }

    async fn forward_tcp(
        &self,
        mut client: crate::tls::BoxedIo,
        authority: &str,
        endpoints: &[Arc<EndpointHandle>],
    ) {
        let mut tried = Vec::new();
        while let Some(ep) = pick(endpoints, &tried) {
            let addr = ep.endpoint.addr;
            let _in_flight = ep.start();
            let mut server = match ep.client.connect_stream().await {
                Ok((s, _tls)) => s,
                Err(reason) => {
                    tracing::debug!(%authority, %addr, %reason, "opaque connect failed");
                    ep.mark_failed();
                    tried.push(addr);
                    if tried.len() >= CONNECT_ATTEMPTS {
                        break;
                    }
                    continue;
                }
            };
            if ep.endpoint.meshed && server.write_all(OPAQUE_PREFACE).await.is_err() {
                return;
            }
            let copied = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            if let Ok((up, down)) = copied {
                self.metrics
                    .tcp_bytes
                    .get_or_create(&crate::metrics::DirectionLabels {
                        direction: "outbound".into(),
                    })
                    .inc_by(up + down);
            }
            return;
        }
        tracing::warn!(%authority, "no endpoint reachable for opaque connection");
    }
}
