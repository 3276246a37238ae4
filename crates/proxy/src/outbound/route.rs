//! Step 2, the route layer: the service's ready endpoints (or, when the
//! control plane cannot route, the original destination), the retry policy
//! and budget, keeping the body of a retryable request, and waiting for
//! discovery to offer new endpoints when every one failed.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, Version};
use http_body_util::BodyExt;

use super::endpoint::Attempts;
use super::forward::Unavailable;
use super::service::Service;
use super::Outbound;
use crate::balance::EndpointHandle;
use crate::errors::ProxyError;
use crate::http::{strip_hop_by_hop, strip_mesh_asserted, take_orig_proto, Body};
use crate::metrics::Hop;

/// Retries (after a request was sent) per request, whatever the budget.
const MAX_RETRIES: usize = 3;

/// A copy of a request's head (extensions are not carried across hops).
fn clone_parts(parts: &http::request::Parts) -> http::request::Parts {
    let mut req = Request::new(());
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = parts.uri.clone();
    *req.version_mut() = parts.version;
    *req.headers_mut() = parts.headers.clone();
    req.into_parts().0
}

/// Cleans a request's head for the mesh and says which HTTP version it
/// had at its origin: a request that reached us over HTTP/2 from another
/// proxy (a gateway's case) may have been HTTP/1.
fn head_for_mesh(parts: &mut http::request::Parts) -> Version {
    // Only HTTP/2 carries a marked HTTP/1 request; on HTTP/1 the marker
    // is an app's, and it changes nothing (strip_mesh_asserted drops it).
    let marked = (parts.version == Version::HTTP_2)
        .then(|| take_orig_proto(&mut parts.headers))
        .flatten();
    let version = match marked {
        Some(orig) => orig.version,
        None => parts.version,
    };
    strip_hop_by_hop(&mut parts.headers);
    strip_mesh_asserted(&mut parts.headers);
    version
}

/// The body of a retryable request, read and kept so it can be sent again;
/// any other body, as it is, to be sent once.
async fn keep_if_retryable(
    parts: &http::request::Parts,
    body: Body,
) -> Result<(Option<Bytes>, Option<Body>), ProxyError> {
    let retryable = crate::retry::is_retryable(&parts.method, &parts.headers)
        && (hyper::body::Body::is_end_stream(&body)
            || hyper::body::Body::size_hint(&body)
                .exact()
                .is_some_and(|n| n <= crate::retry::MAX_BODY));
    if !retryable {
        return Ok((None, Some(body)));
    }
    let bytes = body
        .collect()
        .await
        .map_err(|e| ProxyError::RequestBody(e.to_string()))?
        .to_bytes();
    Ok((Some(bytes), None))
}

impl Outbound {
    /// `--control-plane-unavailable=forward`: the request goes to its
    /// original destination when discovery cannot route it (`why`).
    async fn forward(
        &self,
        authority: &str,
        req: Request<Body>,
        absolute: bool,
        why: ProxyError,
    ) -> Result<(Response<Body>, Hop), ProxyError> {
        let Some(dst) = self.forwarder.destination(authority, absolute).await else {
            return Err(why);
        };
        tracing::debug!(%authority, %dst, reason = %why, "forwarding to the original destination");
        let client = self.forwarder.client(dst);
        self.send(&client, req, authority, false)
            .await
            .map(|(rsp, _)| (rsp, Hop::default()))
    }

    pub(super) async fn route(
        &self,
        svc: Arc<Service>,
        authority: &str,
        req: Request<Body>,
        absolute: bool,
    ) -> Result<(Response<Body>, Hop), ProxyError> {
        let endpoints = match svc.ready_endpoints(self.failfast_timeout).await {
            Ok(eps) => eps,
            Err(e @ (ProxyError::ControlPlaneUnreachable | ProxyError::UnknownService(_)))
                if self.unavailable == Unavailable::Forward =>
            {
                return self.forward(authority, req, absolute, e).await;
            }
            Err(e) => return Err(e),
        };
        let (mut parts, body) = req.into_parts();
        let version = head_for_mesh(&mut parts);
        let budget = svc.retry_budget();
        budget.deposit();
        let (kept, mut body) = keep_if_retryable(&parts, body).await?;
        let mut ctx = Attempts {
            svc: &svc,
            endpoints,
            tried: Vec::new(),
            authority,
            version,
        };
        let mut retries = 0;
        loop {
            let attempt_body = match (&kept, body.take()) {
                (Some(bytes), _) => crate::http::full(bytes.clone()),
                (None, Some(b)) => b,
                (None, None) => unreachable!("a request that cannot be retried is sent once"),
            };
            let attempt = self
                .attempt(&mut ctx, clone_parts(&parts), attempt_body)
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
            if !ctx.untried_left() {
                // Every endpoint failed: wait (bounded) for discovery to
                // offer others — e.g. another cluster taking over.
                match self.new_endpoints(&svc, &ctx.tried).await {
                    Some(eps) => ctx.endpoints = eps,
                    None => {
                        budget.refund();
                        return attempt;
                    }
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
}
