//! Step 2, the route layer: the route the service's outbound policy chose
//! for the request (its filters, a backend by weight, its timeouts and
//! retries); then the backend's ready endpoints (or, when the control plane
//! cannot route, the original destination), the retry policy and budget,
//! keeping the body of a retryable request, and waiting for discovery to
//! offer new endpoints when every one failed.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, Version};
use http_body_util::BodyExt;

use super::endpoint::Attempts;
use super::forward::Unavailable;
use super::logical::{Sent, TimeoutSource};
use super::service::Service;
use super::Outbound;
use crate::balance::Endpoints;
use crate::errors::ProxyError;
use crate::http::{strip_hop_by_hop, strip_mesh_asserted, take_orig_proto, Body, ReplyBody};
use crate::metrics::Hop;
use crate::policy::{Filter, HeaderModifier, Selected};
use crate::retry::RetryBudget;

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

/// How a request's attempts may be retried: the logical service's budget
/// (every retry counts against it, whichever backend it goes to) and the
/// route's retry policy, if any.
pub(super) struct RetryPlan<'a> {
    pub budget: Arc<RetryBudget>,
    pub route: Option<&'a crate::policy::Retry>,
}

/// The logical service a routed request was addressed to.
pub(super) struct RouteTarget<'a> {
    pub logical: &'a Arc<Service>,
    /// Its normalised authority.
    pub authority: &'a str,
    /// The authority as the request named it (for redirects).
    pub orig_authority: &'a str,
}

/// How a request may go out again.
enum Resend {
    /// Retryable, its body read and kept: after any failure before the
    /// app answered, and on the route's conditions.
    Retryable(Bytes),
    /// No body: only when a peer refused it unprocessed.
    Unprocessed,
    /// A body streamed as it comes, kept while it is sent: again only when
    /// a peer refused it unprocessed, and all of it read so far was kept.
    Replayable(crate::replay::Replay),
    /// A body streamed as it comes, known to be too large to keep: sent
    /// once.
    Once,
}

/// The body of a retryable request, read and kept so it can be sent again;
/// any other body, as it is, to be sent once (a request without one may be
/// sent again when a peer refused it unprocessed). A route's retry policy
/// makes any method retryable, with its own body limit.
async fn keep_if_retryable(
    parts: &http::request::Parts,
    body: Body,
    route: Option<&crate::policy::Retry>,
) -> Result<(Resend, Option<Body>), ProxyError> {
    let (method_ok, limit) = match route {
        Some(r) => (true, u64::from(r.max_request_bytes)),
        None => (
            crate::retry::is_retryable(&parts.method, &parts.headers),
            crate::retry::MAX_BODY,
        ),
    };
    let ended = hyper::body::Body::is_end_stream(&body);
    let retryable = method_ok
        && (ended
            || hyper::body::Body::size_hint(&body)
                .exact()
                .is_some_and(|n| n <= limit));
    if !retryable {
        let cap = crate::retry::MAX_BODY;
        return Ok(if ended {
            (Resend::Unprocessed, Some(body))
        } else if hyper::body::Body::size_hint(&body).lower() > cap {
            (Resend::Once, Some(body))
        } else {
            let (body, replay) = crate::replay::replayable(body, cap as usize);
            (Resend::Replayable(replay), Some(body))
        });
    }
    let bytes = body
        .collect()
        .await
        .map_err(|e| ProxyError::RequestBody(e.to_string()))?
        .to_bytes();
    Ok((Resend::Retryable(bytes), None))
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
    ) -> Result<(Response<ReplyBody>, Hop), ProxyError> {
        let Some(dst) = self.forwarder.destination(authority, absolute).await else {
            return Err(why);
        };
        tracing::debug!(%authority, %dst, reason = %why, "forwarding to the original destination");
        let client = self.forwarder.client(dst);
        self.send(&client, req, authority, false)
            .await
            .map(|(rsp, _)| (rsp, Hop::default()))
    }

    /// A request through the route `selected`: its filters (request
    /// headers, redirect, failure injection; response headers on the way
    /// back), one backend by weight, the rule's timeouts and retries.
    pub(super) async fn follow_route(
        &self,
        target: RouteTarget<'_>,
        selected: Selected<'_>,
        req: Request<Body>,
        sent: Sent,
        absolute: bool,
    ) -> Result<(Response<ReplyBody>, Hop), ProxyError> {
        let Selected {
            route,
            rule,
            prefix,
        } = selected;
        let (mut parts, body) = req.into_parts();
        let mut on_response = Vec::new();
        let filtered = |filters, parts: &mut _, on_response: &mut Vec<_>| {
            apply_filters(
                filters,
                parts,
                on_response,
                &route.name,
                target.orig_authority,
                prefix,
            )
        };
        if let Some(rsp) = filtered(&rule.filters, &mut parts, &mut on_response)? {
            return Ok((rsp, Hop::default()));
        }
        let backend = rule
            .backends
            .pick(|authority| !self.service(authority).balancer.endpoints().is_empty())
            .ok_or_else(|| ProxyError::Route {
                route: crate::policy::shown_name(&route.name).to_string(),
                reason: "no backend to send to".into(),
            })?;
        if let Some(rsp) = filtered(&backend.filters, &mut parts, &mut on_response)? {
            return Ok((rsp, Hop::default()));
        }
        let svc = if backend.authority == target.authority {
            target.logical.clone()
        } else {
            self.service(&backend.authority)
        };
        let plan = RetryPlan {
            budget: target.logical.retry_budget(),
            route: rule.retry.as_ref(),
        };
        let routed = crate::boxed(|| {
            self.route(
                svc,
                target.authority,
                Request::from_parts(parts, body),
                absolute,
                plan,
            )
        });
        // The route's timeout is the service's one source of truth while a
        // policy is in force (the default route carries the profile's).
        let response_timeout = TimeoutSource::Route(rule.timeouts.response);
        let bounded = self.within_response_timeout(routed, response_timeout, sent);
        let result = match super::service::effective_timeout(rule.timeouts.request, None) {
            Some(limit) => tokio::time::timeout(limit, bounded)
                .await
                .unwrap_or(Err(ProxyError::ResponseTimeout(limit))),
            None => bounded.await,
        };
        result.map(|(mut rsp, hop)| {
            for m in on_response {
                m.apply(rsp.headers_mut());
            }
            (rsp, hop)
        })
    }

    pub(super) async fn route(
        &self,
        svc: Arc<Service>,
        authority: &str,
        req: Request<Body>,
        absolute: bool,
        plan: RetryPlan<'_>,
    ) -> Result<(Response<ReplyBody>, Hop), ProxyError> {
        let endpoints = match svc.ready_endpoints(self.failfast_timeout).await {
            Ok(eps) => eps,
            Err(e @ (ProxyError::ControlPlaneUnreachable | ProxyError::UnknownService(_)))
                if self.unavailable == Unavailable::Forward =>
            {
                // Boxed: the rare path would otherwise set the size of
                // every request's route step (4.4 KiB with it inline, 2.4
                // without: copied into its box once per request).
                return Box::pin(self.forward(authority, req, absolute, e)).await;
            }
            Err(e) => return Err(e),
        };
        let (mut parts, body) = req.into_parts();
        let version = head_for_mesh(&mut parts);
        let RetryPlan {
            budget,
            route: route_retry,
        } = plan;
        budget.deposit();
        let (resend, mut body) = keep_if_retryable(&parts, body, route_retry).await?;
        let retryable = matches!(resend, Resend::Retryable(_));
        let max_retries = route_retry.map_or(MAX_RETRIES, |r| r.max_retries as usize);
        // The service's own parse when the request names it (the backend
        // of a route may be another service).
        let named;
        let hop_authority = if *svc.authority == *authority {
            &svc.hop_authority
        } else {
            named = crate::http::HopAuthority::new(authority);
            &named
        };
        let mut ctx = Attempts {
            svc: &svc,
            endpoints,
            tried: Default::default(),
            authority: hop_authority,
            version,
            retryable,
        };
        let mut retries = 0;
        let mut replayed = false;
        let mut parts = Some(parts);
        loop {
            // A request sent once is sent as it is; only one that may be
            // sent again keeps its head for that.
            let (attempt_parts, attempt_body) = match (&resend, body.take(), &mut parts) {
                (Resend::Retryable(bytes), _, Some(parts)) => {
                    (clone_parts(parts), crate::http::full(bytes.clone()))
                }
                (Resend::Unprocessed, _, Some(parts)) => (clone_parts(parts), crate::http::empty()),
                (Resend::Replayable(_), Some(b), Some(parts)) => (clone_parts(parts), b),
                (Resend::Once, Some(b), parts @ Some(_)) => {
                    (parts.take().expect("matched as Some"), b)
                }
                _ => unreachable!("a request that cannot be sent again is sent once"),
            };
            let attempt = crate::boxed(|| self.attempt(&mut ctx, attempt_parts, attempt_body));
            let attempt = match route_retry.and_then(|r| r.timeout) {
                Some(limit) => tokio::time::timeout(limit, attempt)
                    .await
                    .unwrap_or(Err(ProxyError::ResponseTimeout(limit))),
                None => attempt.await,
            };
            // A peer that refused the request unprocessed (draining, say)
            // never saw it: it goes out again whatever its method, once,
            // outside the budget, when it still can (a streamed body only
            // if all of it read so far was kept). Another endpoint is
            // preferred; the same one will do on a fresh connection.
            if let Err(ProxyError::Unprocessed { addr, .. }) = &attempt {
                let can_go_again = !replayed
                    && match &resend {
                        Resend::Once => false,
                        Resend::Replayable(replay) => {
                            body = replay.again();
                            body.is_some()
                        }
                        Resend::Retryable(_) | Resend::Unprocessed => true,
                    };
                if can_go_again {
                    replayed = true;
                    if !ctx.untried_left() {
                        let refused = *addr;
                        ctx.tried.retain(|tried| *tried != refused);
                    }
                    self.metrics.retry(authority, "unprocessed");
                    tracing::debug!(%authority, "sending a request refused unprocessed again");
                    continue;
                }
            }
            let failed_before_app = match &attempt {
                Ok((rsp, _)) => {
                    matches!(rsp.status().as_u16(), 502 | 503)
                        && rsp.headers().contains_key(crate::http::PROXY_ERROR_HEADER)
                }
                Err(
                    ProxyError::Connect { .. }
                    | ProxyError::Upstream { .. }
                    | ProxyError::Unprocessed { .. },
                ) => true,
                Err(_) => false,
            };
            // The route's conditions: the app's answer, or an attempt that
            // outlived the route's per-try timeout.
            let route_condition = !failed_before_app
                && match (&attempt, route_retry) {
                    (Ok((rsp, _)), Some(r)) => r.on_response(rsp),
                    (Err(ProxyError::ResponseTimeout(_)), Some(_)) => true,
                    _ => false,
                };
            if !(failed_before_app || route_condition) || !retryable || retries == max_retries {
                return attempt;
            }
            retries += 1;
            if !budget.withdraw() {
                self.metrics.retry(authority, "budget_exhausted");
                return attempt;
            }
            if route_condition {
                // The endpoints work (the app answered): they may be tried
                // again.
                if !ctx.untried_left() {
                    ctx.tried.clear();
                }
                drop(attempt);
                let pause =
                    route_retry.map_or(std::time::Duration::ZERO, |r| r.pause(retries as u32));
                if !pause.is_zero() {
                    tokio::time::sleep(pause).await;
                }
            } else if !ctx.untried_left() {
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
    ) -> Option<Endpoints> {
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

/// Applies `filters` to a request's head, in order; response header
/// modifiers are kept in `on_response` for the answer. A redirect or a
/// failure that fires is the answer itself.
fn apply_filters<'f>(
    filters: &'f [Filter],
    parts: &mut http::request::Parts,
    on_response: &mut Vec<&'f HeaderModifier>,
    route: &str,
    orig_authority: &str,
    prefix: Option<&str>,
) -> Result<Option<Response<ReplyBody>>, ProxyError> {
    for filter in filters {
        match filter {
            Filter::RequestHeaders(m) => m.apply(&mut parts.headers),
            Filter::ResponseHeaders(m) => on_response.push(m),
            Filter::Fail(f) => {
                if f.fires() {
                    return Err(ProxyError::Injected {
                        status: f.status,
                        grpc_code: f.grpc_code.unwrap_or(2),
                        message: f.message.clone(),
                    });
                }
            }
            Filter::Redirect(r) => {
                let scheme = parts.uri.scheme_str().unwrap_or("http");
                let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                let location =
                    r.location(scheme, orig_authority, pq, prefix)
                        .map_err(|reason| ProxyError::Route {
                            route: route.to_string(),
                            reason,
                        })?;
                let mut rsp = Response::new(crate::http::empty().into());
                *rsp.status_mut() = r.status;
                let location =
                    http::HeaderValue::from_str(&location).map_err(|_| ProxyError::Route {
                        route: route.to_string(),
                        reason: "the redirect's location is not a valid header value".into(),
                    })?;
                rsp.headers_mut().insert(http::header::LOCATION, location);
                return Ok(Some(rsp));
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(method: http::Method) -> http::request::Parts {
        let mut req = Request::new(());
        *req.method_mut() = method;
        req.into_parts().0
    }

    /// A request a peer refused unprocessed may go out again only if it
    /// still can: without a body, with one kept for retries, or with one
    /// streamed as it comes and kept while it is sent; a body known to be
    /// larger than can be kept is sent once.
    #[tokio::test]
    async fn only_a_request_whose_body_can_be_had_again_may_go_out_again() {
        let post = head(http::Method::POST);
        let (resend, _) = keep_if_retryable(&post, crate::http::empty(), None)
            .await
            .unwrap();
        assert!(matches!(resend, Resend::Unprocessed));
        let streamed = {
            let chunks = futures::stream::iter([Ok::<_, crate::http::BodyError>(
                hyper::body::Frame::data(Bytes::from_static(b"order")),
            )]);
            http_body_util::StreamBody::new(chunks).boxed()
        };
        let (resend, body) = keep_if_retryable(&post, streamed, None).await.unwrap();
        assert!(matches!(resend, Resend::Replayable(_)) && body.is_some());
        let too_large = crate::http::full(vec![0u8; crate::retry::MAX_BODY as usize + 1]);
        let (resend, body) = keep_if_retryable(&post, too_large, None).await.unwrap();
        assert!(matches!(resend, Resend::Once) && body.is_some());
        let get = head(http::Method::GET);
        let (resend, _) = keep_if_retryable(&get, crate::http::empty(), None)
            .await
            .unwrap();
        assert!(matches!(resend, Resend::Retryable(_)));
    }
}
