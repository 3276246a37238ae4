//! Step 1, from request to logical service: refuse what is never proxied
//! (`CONNECT`), name the service by the request's authority (or the
//! listener's pinned one), bound the wait for response headers by the
//! service's timeout, and count the response.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Method, Request, Response};
use http_body_util::BodyExt;
use hyper::body::Body as _;
use tokio::sync::{oneshot, watch};

use super::route::{RetryPlan, RouteTarget};
use super::service::effective_timeout;
use super::Outbound;
use crate::errors::ProxyError;
use crate::http::{
    error_response, is_grpc, request_authority, Body, ReplyBody, LEGACY_ORIG_PROTO_HEADER,
    ORIG_PROTO_HEADER,
};
use crate::metrics::{CountedBody, Hop};
use crate::serve::RequestBody;

/// Adds the default port and lowercases, so `Web.demo` and `web.demo:80`
/// share one service. An authority already in that form (the usual case)
/// is borrowed, not copied.
pub(super) fn normalize(authority: &str) -> Result<Cow<'_, str>, ProxyError> {
    let (host, port) = tether_core::authority::split_host_port(authority).map_err(|e| {
        ProxyError::InvalidAuthority {
            authority: authority.to_string(),
            reason: e.to_string(),
        }
    })?;
    // The port as written, when there is one: normal when it is plain
    // digits without a leading zero (what formatting the number gives).
    let written_port = authority.get(host.len() + 1..).unwrap_or("");
    let normal = !host.bytes().any(|b| b.is_ascii_uppercase())
        && !written_port.is_empty()
        && !written_port.starts_with('0')
        && written_port.bytes().all(|b| b.is_ascii_digit());
    if normal {
        return Ok(Cow::Borrowed(authority));
    }
    Ok(Cow::Owned(format!("{}:{port}", host.to_ascii_lowercase())))
}

impl Outbound {
    pub async fn handle(
        &self,
        mut req: Request<RequestBody>,
        pinned: Option<&str>,
    ) -> Response<CountedBody> {
        let start = Instant::now();
        let tapped = self.metrics.tap.request(&req);
        let upgrade = crate::upgrade::take(&mut req);
        let grpc = is_grpc(req.headers());
        if req.method() == Method::CONNECT {
            let rsp = error_response(&ProxyError::ConnectUnsupported, grpc).map(ReplyBody::Made);
            return self.metrics.record_response(
                rsp,
                "outbound",
                Arc::from(""),
                start.elapsed(),
                Hop::default(),
            );
        }
        let absolute = req.uri().scheme().is_some();
        // The service's own copy of its authority names it from here on:
        // nothing per request is copied for it.
        let svc = match pinned.or_else(|| request_authority(&req)) {
            Some(a) => self.service_named(a, start),
            None => Err(ProxyError::NoAuthority),
        };
        let mut route_label = None;
        let mut series = None;
        let (label, result) = match svc {
            Ok(svc) => {
                let authority = &*svc.authority;
                let (req, mut sent) = notify_when_sent(req, start);
                // The steps are boxed: a state machine nested inline is
                // copied whole each time the request's future moves (hyper
                // moves it into its dispatcher or a stream's task), and the
                // route and attempt steps hold several KiB (test below).
                // A policy already in force needs no wait (nor a box for it).
                let policy = match svc.settled_policy() {
                    Some(policy) => Ok(policy),
                    None => {
                        let policy = Box::pin(svc.policy(self.failfast_timeout)).await;
                        // The response timeout runs from when the request
                        // could be sent, not through the wait for a new
                        // service's policy (bounded by the fail-fast timeout).
                        sent.restart();
                        policy
                    }
                };
                let routes = match &policy {
                    Ok(p) => Ok(p.as_deref().and_then(|p| p.routes(route_version(&req)))),
                    Err(e) => Err(e.clone()),
                };
                let result = match routes {
                    Err(e) => Err(e),
                    // No policy (yet), or not HTTP: the default path.
                    Ok(None) => {
                        let profile = TimeoutSource::Profile(svc.response_timeout());
                        let plan = RetryPlan {
                            budget: svc.retry_budget(),
                            route: None,
                        };
                        // The route step is boxed where it is made: boxing
                        // the timeout around it would copy it twice more.
                        let routed = crate::boxed(|| {
                            self.route(svc.clone(), authority, req, absolute, plan)
                        });
                        self.within_response_timeout(routed, profile, sent).await
                    }
                    Ok(Some(routes)) => {
                        let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
                        match crate::policy::select(routes, &req, host) {
                            None => Err(ProxyError::NoRoute(authority.to_string())),
                            Some(selected) => {
                                // An unnamed route is no route in the metrics
                                // (and has no label to keep).
                                let name = &selected.route.name;
                                route_label = (!name.is_empty()).then(|| svc.route_label(name));
                                // As the request named it, for redirects (only
                                // a rule that may redirect needs the copy).
                                let orig_authority = if selected.rule.may_redirect() {
                                    pinned
                                        .or_else(|| request_authority(&req))
                                        .unwrap_or_default()
                                        .to_string()
                                } else {
                                    String::new()
                                };
                                let target = RouteTarget {
                                    logical: &svc,
                                    authority,
                                    orig_authority: &orig_authority,
                                };
                                crate::boxed(|| {
                                    self.follow_route(target, selected, req, sent, absolute)
                                })
                                .await
                            }
                        }
                    }
                };
                // Named routes' series go with their service; the rest's stay.
                if route_label.is_none() {
                    series = Some(svc.series(&self.metrics));
                }
                (svc.authority.clone(), result)
            }
            Err(e) => (Arc::from(""), Err(e)),
        };
        let (mut rsp, hop) = result.unwrap_or_else(|e| {
            tracing::debug!(authority = %label, error = %e, "outbound request failed");
            // Under mandatory TLS no hop is ever plaintext, failed or not.
            let hop = Hop {
                tls: self.connector.is_mandatory(),
                ..Hop::default()
            };
            (error_response(&e, grpc).map(ReplyBody::Made), hop)
        });
        if let Some(upgrade) = upgrade {
            upgrade.splice(&mut rsp);
        }
        if let Some(series) = series {
            return self
                .metrics
                .record_series(rsp, series, start.elapsed(), &hop, tapped);
        }
        self.metrics.record_routed_response(
            rsp,
            "outbound",
            label,
            route_label,
            start.elapsed(),
            hop,
            tapped,
        )
    }

    /// Bounds the time to response headers by the service's timeout,
    /// counted from when the request's body has been sent (an upload or a
    /// client stream takes what it takes) — re-read when the profile
    /// arrives after the request started. A response body that streams
    /// afterwards is never cut.
    pub(super) async fn within_response_timeout<F>(
        &self,
        routed: F,
        mut timeout: TimeoutSource,
        sent: Sent,
    ) -> Result<(Response<ReplyBody>, Hop), ProxyError>
    where
        F: std::future::Future<Output = Result<(Response<ReplyBody>, Hop), ProxyError>>,
    {
        tokio::pin!(routed);
        let mut profile_open = matches!(timeout, TimeoutSource::Profile(_));
        let (mut sent_at, mut sent) = match sent {
            Sent::Already(at) => (Some(at), None),
            Sent::When(rx) => (None, Some(rx)),
        };
        loop {
            let set = match &mut timeout {
                TimeoutSource::Profile(profile) => *profile.borrow_and_update(),
                TimeoutSource::Route(set) => *set,
            };
            let limit = effective_timeout(set, self.response_timeout);
            let expired = async {
                match (limit, sent_at) {
                    (Some(l), Some(t)) => tokio::time::sleep_until((t + l).into()).await,
                    _ => std::future::pending().await,
                }
            };
            // `biased` (here and on the data path's other selects): the
            // branches in order, without the random first branch tokio
            // draws on every poll (~55 instructions; a request's polls
            // of selects come to a dozen).
            tokio::select! {
                biased;
                result = &mut routed => return result,
                _ = expired => return Err(ProxyError::ResponseTimeout(limit.unwrap_or_default())),
                changed = timeout.changed(), if profile_open => profile_open = changed.is_ok(),
                // Sent, or dropped unsent: either way the clock runs now.
                _ = async { if let Some(rx) = &mut sent { let _ = rx.await; } }, if sent_at.is_none() => {
                    sent_at = Some(Instant::now());
                }
            }
        }
    }
}

/// Where a request's response timeout comes from.
pub(super) enum TimeoutSource {
    /// The service's profile, which may arrive or change meanwhile.
    Profile(watch::Receiver<Option<Duration>>),
    /// The route's, fixed for the request (a policy's route carries the
    /// profile's).
    Route(Option<Duration>),
}

impl TimeoutSource {
    async fn changed(&mut self) -> Result<(), watch::error::RecvError> {
        match self {
            TimeoutSource::Profile(profile) => profile.changed().await,
            TimeoutSource::Route(_) => std::future::pending().await,
        }
    }
}

/// Whether a request's body has been sent: the response timeout runs
/// from then.
pub(super) enum Sent {
    /// It had ended when the request came (no body, or all of it read),
    /// at the request's start.
    Already(Instant),
    /// Told (or dropped) when its end has been read.
    When(oneshot::Receiver<()>),
}

impl Sent {
    /// A request already sent counts as sent from now.
    fn restart(&mut self) {
        if let Sent::Already(at) = self {
            *at = Instant::now();
        }
    }
}

/// The HTTP version whose routes apply: a request carried over HTTP/2 from
/// another proxy (a gateway's case) was HTTP/1 at its origin.
fn route_version<B>(req: &Request<B>) -> http::Version {
    let marked = || {
        req.headers().contains_key(ORIG_PROTO_HEADER)
            || req.headers().contains_key(LEGACY_ORIG_PROTO_HEADER)
    };
    if req.version() == http::Version::HTTP_2 && !marked() {
        http::Version::HTTP_2
    } else {
        http::Version::HTTP_11
    }
}

/// The request with a body that says when it has been read to its end.
/// A body that has ended already (most requests have none) is replaced by
/// an empty one: nothing to wait for, nothing allocated.
fn notify_when_sent(req: Request<RequestBody>, start: Instant) -> (Request<Body>, Sent) {
    if req.body().is_end_stream() {
        return (req.map(|_| crate::http::empty()), Sent::Already(start));
    }
    let (tx, rx) = oneshot::channel();
    let req = req.map(|inner| {
        let mut body = NotifyEnd {
            inner,
            sent: Some(tx),
        };
        body.check_end();
        body.boxed()
    });
    (req, Sent::When(rx))
}

struct NotifyEnd {
    inner: RequestBody,
    sent: Option<oneshot::Sender<()>>,
}

impl NotifyEnd {
    fn check_end(&mut self) {
        if self.inner.is_end_stream() {
            if let Some(tx) = self.sent.take() {
                let _ = tx.send(());
            }
        }
    }
}

impl hyper::body::Body for NotifyEnd {
    type Data = bytes::Bytes;
    type Error = crate::http::BodyError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, crate::http::BodyError>>>
    {
        let polled = std::pin::Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(None | Some(Err(_))) => {
                if let Some(tx) = self.sent.take() {
                    let _ = tx.send(());
                }
            }
            std::task::Poll::Ready(Some(Ok(_))) => self.check_end(),
            std::task::Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::TokioIo;

    use super::super::{Outbound, OutboundConfig};
    use crate::discovery::{ControlPlanes, Discovery};
    use crate::metrics::ProxyMetrics;
    use crate::tls::Connector;

    /// hyper moves a request's future (into its dispatcher, into an HTTP/2
    /// stream's task) and every move copies it whole; the steps behind
    /// `handle` are boxed so that what moves stays small. Measured on a
    /// real request: hyper's `Incoming` body only comes from a connection.
    #[tokio::test]
    async fn the_outbound_request_future_stays_small() {
        // Nothing is asked of it: the future is measured, never polled.
        let outbound = Arc::new(outbound());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let svc = hyper::service::service_fn(move |req: http::Request<_>| {
                let req = req.map(crate::serve::RequestBody::Http1);
                let size = std::mem::size_of_val(&outbound.handle(req, None));
                async move {
                    Ok::<_, std::convert::Infallible>(http::Response::new(crate::http::full(
                        size.to_string(),
                    )))
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let req = http::Request::builder()
            .uri("/")
            .header(http::header::HOST, "web.demo:80")
            .body(Empty::<bytes::Bytes>::new())
            .unwrap();
        let rsp = sender.send_request(req).await.unwrap();
        let body = rsp.into_body().collect().await.unwrap().to_bytes();
        let size: usize = std::str::from_utf8(&body).unwrap().parse().unwrap();
        eprintln!("Outbound::handle's future: {size} bytes");
        assert!(
            size <= MAX_HANDLE_FUTURE,
            "Outbound::handle's future is {size} bytes (at most {MAX_HANDLE_FUTURE}): \
             box the step that grew it"
        );
        server.abort();
    }

    fn outbound() -> Outbound {
        let metrics = ProxyMetrics::default();
        let controls = ControlPlanes::new(&["127.0.0.1:9".to_string()], None).unwrap();
        Outbound::new(
            Discovery::new(controls, metrics.clone()),
            metrics,
            &OutboundConfig::default(),
            Connector::plain(Duration::from_secs(1)),
        )
    }

    /// A request's authority is looked up as written before it is
    /// normalised: however it is spelled, one service answers, and what
    /// is not an authority is refused, never followed.
    #[tokio::test]
    async fn every_spelling_of_an_authority_names_one_service() {
        let outbound = outbound();
        let now = std::time::Instant::now();
        let first = outbound.service_named("Web.Demo", now).unwrap();
        assert_eq!(&*first.authority, "web.demo:80");
        for spelling in ["web.demo:80", "WEB.demo:80", "web.demo:080", "web.demo"] {
            let again = outbound.service_named(spelling, now).unwrap();
            assert!(
                Arc::ptr_eq(&first, &again),
                "{spelling} named another service"
            );
        }
        let other = outbound.service_named("web.demo:8080", now).unwrap();
        assert!(!Arc::ptr_eq(&first, &other));
        for bad in ["", "web.demo:", "web.demo:http", "web.demo:0", ":80"] {
            assert!(
                outbound.service_named(bad, now).is_err(),
                "{bad:?} was followed"
            );
        }
    }

    /// What `handle` keeps inline besides its boxed steps (the request,
    /// its labels, the tap, the response timeout around the boxed route):
    /// 1.8 KiB in a debug build; 10 KiB before the
    /// steps were boxed.
    const MAX_HANDLE_FUTURE: usize = 2048;
}
