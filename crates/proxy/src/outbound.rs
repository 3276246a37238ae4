//! The outbound side: requests from the local app to mesh services.
//!
//! A request's path: authority (Host, absolute URI or `:authority`) →
//! the service for that authority (one discovery stream, one balancer) →
//! wait for a ready endpoint, at most the fail-fast timeout → pick by P2C →
//! a pooled connection (HTTP/2 to peer proxies) → response. A connection
//! that cannot be established is retried on another endpoint (the request
//! has not been sent, so this is always safe).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{Request, Response, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tether_admin::Shutdown;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::balance::{pick, Balancer, EndpointHandle};
use crate::client::Proto;
use crate::detect::OPAQUE_PREFACE;
use crate::discovery::Discovery;
use crate::errors::ProxyError;
use crate::http::{
    error_response, is_grpc, request_authority, rewrite_for_hop, status_class, strip_hop_by_hop,
    Body, ORIG_PROTO,
};
use crate::metrics::{Hop, ProxyMetrics};
use crate::serve::{accept_loop, serve_http};
use crate::tls::Connector;
use crate::ProxyConfig;

/// Endpoints tried per request when connections fail.
const CONNECT_ATTEMPTS: usize = 3;
/// Services unused this long are forgotten (and their discovery stream ended).
const IDLE_SERVICE: Duration = Duration::from_secs(300);

struct Service {
    balancer: Balancer,
    last_used: Mutex<Instant>,
}

pub struct Outbound {
    discovery: Discovery,
    services: Mutex<HashMap<String, Arc<Service>>>,
    metrics: ProxyMetrics,
    failfast_timeout: Duration,
    connector: Arc<Connector>,
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
            services: Mutex::default(),
            metrics,
            failfast_timeout: config.failfast_timeout,
            connector,
        }
    }

    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: Shutdown,
        drain: Duration,
    ) {
        accept_loop(
            "outbound",
            listener,
            shutdown,
            drain,
            move |stream, _, watcher| {
                let this = self.clone();
                async move {
                    let _open = this.metrics.connection("outbound");
                    let svc = move |req| {
                        let this = this.clone();
                        async move { this.handle(req, None).await }
                    };
                    serve_http(stream, svc, watcher).await;
                }
            },
        )
        .await
    }

    /// A local listener pinned to one service: opaque TCP when the service
    /// port is opaque, HTTP otherwise (whatever Host the app sends).
    pub async fn serve_upstream(
        self: Arc<Self>,
        listener: TcpListener,
        authority: String,
        shutdown: Shutdown,
        drain: Duration,
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
            drain,
            move |stream, _, watcher| {
                let this = self.clone();
                let authority = authority.clone();
                async move {
                    let _open = this.metrics.connection("outbound");
                    let svc = this.service(&authority);
                    let endpoints = match this.ready_endpoints(&svc).await {
                        Ok(eps) => eps,
                        Err(e) => {
                            tracing::warn!(%authority, error = %e, "upstream connection refused");
                            return;
                        }
                    };
                    if endpoints.iter().any(|h| h.endpoint.opaque) {
                        this.forward_tcp(stream, &authority, &endpoints).await;
                    } else {
                        let svc = move |req| {
                            let this = this.clone();
                            let authority = authority.clone();
                            async move { this.handle(req, Some(&authority)).await }
                        };
                        serve_http(stream, svc, watcher).await;
                    }
                }
            },
        )
        .await
    }

    fn service(&self, authority: &str) -> Arc<Service> {
        let mut services = self.services.lock().unwrap();
        let svc = services
            .entry(authority.to_string())
            .or_insert_with(|| {
                Arc::new(Service {
                    balancer: Balancer::new(
                        self.discovery.resolve(authority),
                        self.connector.clone(),
                    ),
                    last_used: Mutex::new(Instant::now()),
                })
            })
            .clone();
        *svc.last_used.lock().unwrap() = Instant::now();
        svc
    }

    /// Forgets services nobody has used for a while.
    pub async fn evict_idle(self: Arc<Self>, shutdown: Shutdown) {
        let mut tick = tokio::time::interval(Duration::from_secs(30));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.triggered() => return,
            }
            self.services.lock().unwrap().retain(|_, s| {
                Arc::strong_count(s) > 1 || s.last_used.lock().unwrap().elapsed() < IDLE_SERVICE
            });
        }
    }

    /// Waits (at most the fail-fast timeout) until the service has ready
    /// endpoints; answers at once when the answer is already known to be no.
    async fn ready_endpoints(&self, svc: &Service) -> Result<Vec<Arc<EndpointHandle>>, ProxyError> {
        let deadline = tokio::time::Instant::now() + self.failfast_timeout;
        let mut rx = svc.balancer.watch();
        loop {
            let resolution = rx.borrow_and_update().clone();
            let endpoints = svc.balancer.endpoints();
            if !endpoints.is_empty() {
                return Ok(endpoints);
            }
            if resolution.answered && !resolution.exists {
                return Err(ProxyError::UnknownService(String::new()));
            }
            if !resolution.answered && resolution.last_error.is_some() {
                return Err(ProxyError::ControlPlaneUnreachable);
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => continue,
                Ok(Err(_)) => return Err(ProxyError::ControlPlaneUnreachable),
                Err(_) if resolution.answered => return Err(ProxyError::FailFast),
                Err(_) => return Err(ProxyError::ControlPlaneUnreachable),
            }
        }
    }

    pub async fn handle(&self, req: Request<Incoming>, pinned: Option<&str>) -> Response<Body> {
        let start = Instant::now();
        let grpc = is_grpc(req.headers());
        let authority = match pinned
            .map(str::to_string)
            .or_else(|| request_authority(&req))
        {
            Some(a) => normalize(&a),
            None => Err(ProxyError::NoAuthority),
        };
        let (label, result) = match authority {
            Ok(authority) => {
                let result = self.route(&authority, req).await.map_err(|e| match e {
                    ProxyError::UnknownService(_) => ProxyError::UnknownService(authority.clone()),
                    e => e,
                });
                (authority, result)
            }
            Err(e) => ("".to_string(), Err(e)),
        };
        let (rsp, hop) = result.unwrap_or_else(|e| {
            tracing::debug!(authority = %label, error = %e, "outbound request failed");
            (error_response(&e, grpc), Hop::default())
        });
        self.metrics.record(
            "outbound",
            &label,
            status_class(rsp.status()),
            start.elapsed(),
            &hop,
        );
        rsp
    }

    async fn route(
        &self,
        authority: &str,
        req: Request<Incoming>,
    ) -> Result<(Response<Body>, Hop), ProxyError> {
        let svc = self.service(authority);
        let endpoints = self.ready_endpoints(&svc).await?;
        let version = req.version();
        let (mut parts, body) = req.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(ORIG_PROTO);
        let mut request = Some((parts, body.boxed()));
        let mut tried = Vec::new();
        let mut last_error = ProxyError::FailFast;
        for _ in 0..CONNECT_ATTEMPTS {
            let Some(ep) = pick(&endpoints, &tried) else {
                break;
            };
            let addr = ep.endpoint.addr;
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
                    tried.push(addr);
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
            let req = rewrite_for_hop(parts, body, authority, proto, carry_http1);
            let sent = Instant::now();
            return match conn.send(req).await {
                Ok(rsp) => {
                    in_flight.observe(sent.elapsed());
                    let (mut parts, body) = rsp.into_parts();
                    strip_hop_by_hop(&mut parts.headers);
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
        Err(last_error)
    }

    async fn forward_tcp(
        &self,
        mut client: TcpStream,
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
