//! Step 3, the endpoint layer: pick an endpoint not yet tried (P2C over
//! peak-EWMA), connect (moving on to another endpoint when a connection
//! cannot be made; nothing was sent yet), rewrite the request for the hop
//! (HTTP/2 to peer proxies, the authority override a gateway needs) and
//! send it. A retryable request waiting for its answer gives up on the
//! endpoint the moment discovery drops it or passive health takes it out
//! (the route retries it elsewhere), rather than hanging on a dead peer.

use std::net::SocketAddr;
use std::time::Instant;

use http::{HeaderName, Request, Response, Version};

use super::service::Service;
use super::{Outbound, CONNECT_ATTEMPTS};
use crate::balance::{pick, EndpointHandle, Endpoints};
use crate::client::{ConnectError, EndpointClient, SendError};
use crate::errors::ProxyError;
use crate::http::{
    rewrite_for_hop, strip_hop_by_hop, strip_hop_by_hop_response_and, strip_mesh_asserted, Body,
    OrigProto, ReplyBody, ORIG_PROTO_HEADER, PROXY_ERROR_HEADER,
};
use crate::http::{HopAuthority, Proto};
use crate::metrics::Hop;

/// What the attempts of one request share: the service, the endpoints on
/// offer, those already tried, and how the request came.
pub(super) struct Attempts<'a> {
    pub svc: &'a Service,
    pub endpoints: Endpoints,
    /// Held inline: a request tries one endpoint nearly always.
    pub tried: smallvec::SmallVec<[SocketAddr; 4]>,
    /// The logical authority (an endpoint may override it for its hop),
    /// parsed.
    pub authority: &'a HopAuthority,
    /// The request's HTTP version at its origin.
    pub version: Version,
    /// Whether the request may be sent again (its body is kept), so an
    /// attempt may be abandoned for another.
    pub retryable: bool,
}

impl Attempts<'_> {
    /// Whether an endpoint on offer has not been tried yet.
    pub fn untried_left(&self) -> bool {
        self.endpoints
            .iter()
            .any(|h| !self.tried.contains(&h.endpoint.addr))
    }
}

impl Outbound {
    /// One try: an endpoint not yet tried (moving on when a connection
    /// cannot be made; nothing was sent), the request, the response.
    pub(super) async fn attempt(
        &self,
        ctx: &mut Attempts<'_>,
        parts: http::request::Parts,
        body: Body,
    ) -> Result<(Response<ReplyBody>, Hop), ProxyError> {
        let Attempts {
            svc,
            ref endpoints,
            ref mut tried,
            authority,
            version,
            retryable,
        } = *ctx;
        // HTTP/2 has no upgrades: an upgrade stays HTTP/1.1 to peers too.
        let upgrade = crate::upgrade::wants_upgrade(&parts.headers);
        let mut request = Some((parts, body));
        let mut last_error = ProxyError::FailFast;
        for _ in 0..CONNECT_ATTEMPTS {
            let Some(ep) = pick(endpoints, tried) else {
                break;
            };
            let addr = ep.endpoint.addr;
            tried.push(addr);
            let proto = if !upgrade && (ep.endpoint.meshed || version == Version::HTTP_2) {
                Proto::Http2
            } else {
                Proto::Http1
            };
            let in_flight = ep.start();
            let conn = match ep.client.connection(proto).await {
                Ok(c) => c,
                // Paused, not failed: another endpoint gets the request,
                // this one stays in the balancer (nothing was sent).
                Err(ConnectError::NoStreams) => {
                    last_error = ProxyError::Connect {
                        addr,
                        reason: ConnectError::NoStreams.to_string(),
                    };
                    continue;
                }
                Err(ConnectError::Failed(reason)) => {
                    tracing::debug!(%addr, %reason, "connect failed; trying another endpoint");
                    ep.mark_failed();
                    last_error = ProxyError::Connect { addr, reason };
                    continue;
                }
            };
            let hop = Hop {
                tls: conn.tls,
                endpoint: Some(ep.clone()),
                ..Hop::default()
            };
            let (parts, body) = request.take().expect("request is sent once");
            let orig = (proto == Proto::Http2 && version != Version::HTTP_2)
                .then(|| OrigProto::of(version, &parts.uri));
            let overridden;
            let hop_authority = match ep.endpoint.authority_override.as_deref() {
                Some(other) => {
                    overridden = HopAuthority::new(other);
                    &overridden
                }
                None => authority,
            };
            let req = rewrite_for_hop(parts, body, hop_authority, proto, orig);
            let sent = Instant::now();
            let answer = if retryable {
                let gone = gone(&ep, svc.balancer.watch());
                tokio::select! {
                    biased;
                    answer = conn.send(req) => answer,
                    why = gone => Err(SendError::failed(why)),
                }
            } else {
                conn.send(req).await
            };
            return match answer {
                Ok(rsp) if crate::upgrade::switched_unasked(version, upgrade, rsp.status()) => {
                    Err(ProxyError::Upstream {
                        addr,
                        reason: crate::upgrade::UNASKED_SWITCH.into(),
                    })
                }
                Ok(rsp) => {
                    let peer_failed = ep.endpoint.meshed
                        && matches!(rsp.status().as_u16(), 502 | 503)
                        && rsp.headers().contains_key(PROXY_ERROR_HEADER);
                    if peer_failed {
                        // Its proxy answered that it could not serve: a
                        // failure, and not a latency sample (a fast error
                        // would attract traffic).
                        ep.request_failed();
                    } else {
                        in_flight.observe(sent);
                    }
                    let (mut parts, body) = rsp.into_parts();
                    // linkerd2-proxy's inbound marks its answer to a marked
                    // request; the marker is for this hop only. Only a peer
                    // proxy may say that it, not the app, failed. Both are
                    // found in strip's one pass over the names.
                    let also: &[HeaderName] = if ep.endpoint.meshed {
                        &[ORIG_PROTO_HEADER]
                    } else {
                        &[ORIG_PROTO_HEADER, PROXY_ERROR_HEADER]
                    };
                    strip_hop_by_hop_response_and(parts.status, &mut parts.headers, also);
                    Ok((Response::from_parts(parts, ReplyBody::Upstream(body)), hop))
                }
                // Refused, not failed: a draining peer is not unhealthy.
                Err(e) if e.is_unprocessed() => Err(ProxyError::Unprocessed {
                    addr,
                    reason: e.to_string(),
                }),
                Err(e) => {
                    ep.request_failed();
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
    pub(super) async fn send(
        &self,
        client: &EndpointClient,
        req: Request<Body>,
        authority: &str,
        carry_http1: bool,
    ) -> Result<(Response<ReplyBody>, bool), ProxyError> {
        let addr = client.addr();
        let proto = if req.version() == Version::HTTP_2 {
            Proto::Http2
        } else {
            Proto::Http1
        };
        let (mut parts, body) = req.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        strip_mesh_asserted(&mut parts.headers);
        let orig = carry_http1.then(|| OrigProto::of(parts.version, &parts.uri));
        let (version, asked) = (parts.version, crate::upgrade::wants_upgrade(&parts.headers));
        let conn = client
            .connection(proto)
            .await
            .map_err(|e| ProxyError::Connect {
                addr,
                reason: e.to_string(),
            })?;
        let tls = conn.tls;
        let req = rewrite_for_hop(parts, body, &HopAuthority::new(authority), proto, orig);
        let rsp = conn.send(req).await.map_err(|e| ProxyError::Upstream {
            addr,
            reason: e.to_string(),
        })?;
        if crate::upgrade::switched_unasked(version, asked, rsp.status()) {
            return Err(ProxyError::Upstream {
                addr,
                reason: crate::upgrade::UNASKED_SWITCH.into(),
            });
        }
        let (mut parts, body) = rsp.into_parts();
        strip_hop_by_hop_response_and(parts.status, &mut parts.headers, &[PROXY_ERROR_HEADER]);
        Ok((Response::from_parts(parts, ReplyBody::Upstream(body)), tls))
    }
}

/// Resolves, with the reason, when the request in flight on `ep` should be
/// given up: passive health took the endpoint out, or discovery (`rx`, the
/// service's endpoints) no longer lists it — a cluster unlinked, a pod
/// gone. Created before the request is sent, so nothing in between is
/// missed.
fn gone(
    ep: &EndpointHandle,
    mut rx: tokio::sync::watch::Receiver<crate::discovery::Resolution>,
) -> impl std::future::Future<Output = &'static str> + Send + 'static {
    let taken_out = ep.health.aborted();
    let addr = ep.endpoint.addr;
    let dropped = async move {
        loop {
            if !rx.borrow_and_update().endpoints.contains_key(&addr) {
                return;
            }
            if rx.changed().await.is_err() {
                // The service is gone; the request's own timeout bounds it.
                std::future::pending::<()>().await;
            }
        }
    };
    async move {
        tokio::select! {
            biased;
            _ = taken_out => "abandoned: the endpoint was taken out by passive health",
            _ = dropped => "abandoned: discovery dropped the endpoint",
        }
    }
}
