//! The proxy's metrics: requests by authority and status class, response
//! latency, open connections.

use std::sync::{Arc, OnceLock};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

// The per-request label sets hold shared and static strings: they are
// built for every response to look its series up, and copying six
// `String`s each time was the point of none of it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub direction: &'static str,
    pub authority: Arc<str>,
    /// The route of the service's outbound policy the request took; empty
    /// without one (inbound, or a service without a policy).
    pub route: Option<Arc<str>>,
    pub status_class: &'static str,
    /// Whether the hop between proxies was (m)TLS.
    pub tls: bool,
    /// The peer's verified identity (inbound, over mTLS); empty without.
    pub client_id: Option<Arc<str>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AuthorityLabels {
    pub authority: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabels {
    pub authority: String,
    /// The state entered: `failfast` or `ready`.
    pub to: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

/// What is known about the hop a request took.
#[derive(Clone, Default)]
pub struct Hop {
    pub tls: bool,
    pub client_id: Option<std::sync::Arc<str>>,
    /// The client (inbound), for tap.
    pub peer: Option<std::net::SocketAddr>,
    /// The endpoint the request went to (outbound), for tap.
    pub endpoint: Option<std::sync::Arc<crate::balance::EndpointHandle>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub direction: &'static str,
    pub authority: Arc<str>,
    /// Empty without a route (see [`RequestLabels::route`]).
    pub route: Option<Arc<str>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DirectionLabels {
    pub direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClosedLabels {
    pub direction: String,
    /// `connection_limit` (closed at accept), `idle` or `write_stall` (an
    /// HTTP/1 client that read nothing for the idle timeout).
    pub reason: String,
}

#[derive(Clone)]
pub struct LatencyBuckets;

impl MetricConstructor<Histogram> for LatencyBuckets {
    fn new_metric(&self) -> Histogram {
        // 0.5 ms to ~6 s in steps of 1.5x.
        Histogram::new(exponential_buckets(0.0005, 1.5, 24))
    }
}

#[derive(Clone)]
pub struct ProxyMetrics {
    pub requests: Family<RequestLabels, Counter>,
    pub latency: Family<RouteLabels, Histogram, LatencyBuckets>,
    pub open_connections: Family<DirectionLabels, Gauge>,
    pub tcp_bytes: Family<DirectionLabels, Counter>,
    pub inbound_refused: Family<ReasonLabels, Counter>,
    pub outbound_refused: Family<ReasonLabels, Counter>,
    pub connections_closed: Family<ClosedLabels, Counter>,
    pub failfast: Family<AuthorityLabels, Gauge>,
    pub failfast_transitions: Family<TransitionLabels, Counter>,
    pub discovery_age: Family<AuthorityLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    pub discovery_reconnects: Family<ReasonLabels, Counter>,
    pub discovery_subscriptions: Gauge,
    pub discovery_endpoints: Family<AuthorityLabels, Gauge>,
    pub discovery_evictions: Family<ReasonLabels, Counter>,
    pub retries: Family<RetryLabels, Counter>,
    pub tap: crate::tap::Tap,
    pub outbound_policy_refused: Counter,
    pub authz: crate::authz::AuthzMetrics,
    /// Passive health (`crate::health`): endpoints per state, ejections.
    pub endpoint_health: Family<EndpointHealthLabels, Gauge>,
    pub endpoint_ejections: crate::balance::Ejections,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointHealthLabels {
    pub authority: String,
    /// `healthy`, `ejected` or `probation`.
    pub state: String,
}

/// Every class [`crate::classify`] gives, so a route's series can be removed.
const CLASSES: [&str; 7] = ["1xx", "2xx", "3xx", "4xx", "5xx", "grpc_error", "error"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabels {
    pub authority: String,
    /// `retried`, `budget_exhausted` when a retry was refused, or
    /// `unprocessed` when a request a peer refused unprocessed went out again.
    pub outcome: String,
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            latency: Family::new_with_constructor(LatencyBuckets),
            open_connections: Family::default(),
            tcp_bytes: Family::default(),
            inbound_refused: Family::default(),
            outbound_refused: Family::default(),
            connections_closed: Family::default(),
            failfast: Family::default(),
            failfast_transitions: Family::default(),
            discovery_age: Family::default(),
            discovery_reconnects: Family::default(),
            discovery_subscriptions: Gauge::default(),
            discovery_endpoints: Family::default(),
            discovery_evictions: Family::default(),
            retries: Family::default(),
            tap: crate::tap::Tap::default(),
            outbound_policy_refused: Counter::default(),
            authz: crate::authz::AuthzMetrics::default(),
            endpoint_health: Family::default(),
            endpoint_ejections: Family::default(),
        }
    }
}

impl ProxyMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "tether_proxy_requests",
            "HTTP requests by direction, authority and outcome (1xx-5xx; grpc_error: non-zero grpc-status; error: the body failed)",
            self.requests.clone(),
        );
        registry.register(
            "tether_proxy_response_latency_seconds",
            "Time from request to response headers",
            self.latency.clone(),
        );
        registry.register(
            "tether_proxy_open_connections",
            "Connections currently open, by direction",
            self.open_connections.clone(),
        );
        registry.register(
            "tether_proxy_tcp_bytes",
            "Bytes forwarded on opaque TCP connections",
            self.tcp_bytes.clone(),
        );
        registry.register(
            "tether_proxy_inbound_refused",
            "Inbound connections refused, by reason (plaintext under mandatory TLS, TLS handshake failure)",
            self.inbound_refused.clone(),
        );
        registry.register(
            "tether_proxy_outbound_refused",
            "Outbound connections refused, by reason (plaintext to a destination outside the mesh under mandatory TLS)",
            self.outbound_refused.clone(),
        );
        registry.register(
            "tether_proxy_connections_closed",
            "Client connections the proxy closed itself, by reason (connection_limit: at accept, past --max-connections; idle: no request for --idle-timeout)",
            self.connections_closed.clone(),
        );
        registry.register(
            "tether_proxy_failfast",
            "1 while a service is in fail-fast (no ready endpoint for the fail-fast timeout)",
            self.failfast.clone(),
        );
        registry.register(
            "tether_proxy_failfast_transitions",
            "Services entering fail-fast (to=failfast) and leaving it (to=ready)",
            self.failfast_transitions.clone(),
        );
        registry.register(
            "tether_proxy_discovery_update_age_seconds",
            "Seconds since the last discovery update for a service (-1: none yet)",
            self.discovery_age.clone(),
        );
        registry.register(
            "tether_proxy_retries",
            "Retries on another endpoint, and retries the budget refused",
            self.retries.clone(),
        );
        registry.register(
            "tether_proxy_outbound_policy_refused",
            "Outbound policies the proxy could not understand and refused (the last good one stayed in force)",
            self.outbound_policy_refused.clone(),
        );
        registry.register(
            "tether_proxy_discovery_reconnects",
            "Discovery streams re-established, by reason (error, ended, stalled, silent, message_too_large)",
            self.discovery_reconnects.clone(),
        );
        registry.register(
            "tether_proxy_discovery_subscriptions",
            "Authorities followed (one discovery subscription each; at most --max-discovery-subscriptions)",
            self.discovery_subscriptions.clone(),
        );
        registry.register(
            "tether_proxy_discovery_endpoints",
            "Endpoints discovery gave for an authority",
            self.discovery_endpoints.clone(),
        );
        registry.register(
            "tether_proxy_discovery_evictions",
            "Subscriptions dropped, by reason (idle, rejected: the control plane refused the authority, lru: room for another past the limit)",
            self.discovery_evictions.clone(),
        );
        self.tap.register(registry);
        self.authz.register(registry);
        registry.register(
            "tether_proxy_endpoint_health",
            "Endpoints of an authority by passive-health state (healthy, ejected: out of the balancer until a probe connects, probation: back, out again at the next failure)",
            self.endpoint_health.clone(),
        );
        registry.register(
            "tether_proxy_endpoint_ejections",
            "Endpoints passive health took out of the balancer, by reason (connect: a connection failed, consecutive_failures)",
            self.endpoint_ejections.clone(),
        );
    }

    pub fn retry(&self, authority: &str, outcome: &str) {
        self.retries
            .get_or_create(&RetryLabels {
                authority: authority.into(),
                outcome: outcome.into(),
            })
            .inc();
    }

    /// Removes the route series of a service no longer followed.
    pub fn forget_routes<'a>(&self, authority: &str, routes: impl Iterator<Item = &'a str>) {
        let authority: Arc<str> = authority.into();
        for route in routes {
            let route: Option<Arc<str>> = Some(route.into());
            self.latency.remove(&RouteLabels {
                direction: "outbound",
                authority: authority.clone(),
                route: route.clone(),
            });
            for (class, tls) in CLASSES.iter().flat_map(|c| [(c, true), (c, false)]) {
                self.requests.remove(&RequestLabels {
                    direction: "outbound",
                    authority: authority.clone(),
                    route: route.clone(),
                    status_class: class,
                    tls,
                    client_id: None,
                });
            }
        }
    }

    pub fn discovery_reconnect(&self, reason: &str) {
        self.discovery_reconnects
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .inc();
    }

    /// Counts an outbound connection the proxy would not make.
    pub fn refuse_outbound(&self, reason: &str) {
        self.outbound_refused
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn close_connection(&self, direction: &str, reason: &str) {
        self.connections_closed
            .get_or_create(&ClosedLabels {
                direction: direction.into(),
                reason: reason.into(),
            })
            .inc();
    }

    pub fn refuse(&self, reason: &str) {
        self.inbound_refused
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .inc();
    }

    /// Observes the latency to response headers now, and counts the
    /// request by class once its outcome is known (see [`crate::classify`]).
    pub fn record_response(
        &self,
        rsp: http::Response<crate::http::ReplyBody>,
        direction: &'static str,
        authority: Arc<str>,
        latency: std::time::Duration,
        hop: Hop,
    ) -> http::Response<CountedBody> {
        self.record_routed_response(rsp, direction, authority, None, latency, hop, None)
    }

    /// [`Self::record_response`] for a request that took `route` of its
    /// service's outbound policy (or none), also reporting a tapped
    /// request.
    #[allow(clippy::too_many_arguments)]
    pub fn record_routed_response(
        &self,
        rsp: http::Response<crate::http::ReplyBody>,
        direction: &'static str,
        authority: Arc<str>,
        route: Option<Arc<str>>,
        latency: std::time::Duration,
        hop: Hop,
        tapped: Option<crate::tap::TapRequest>,
    ) -> http::Response<CountedBody> {
        let tap_end = tapped
            .and_then(|t| t.respond(&self.tap, direction, &authority, rsp.status(), &hop))
            .map(Box::new);
        // A default route has an empty name: it must be the same series as
        // no route, or the exposition would list two series with the same
        // labels (and Prometheus rejects the whole scrape).
        let route_labels = RouteLabels {
            direction,
            authority,
            route: route.filter(|r| !r.is_empty()),
        };
        self.latency
            .get_or_create(&route_labels)
            .observe(latency.as_secs_f64());
        let Hop { tls, client_id, .. } = hop;
        crate::classify::classify(
            rsp,
            CountOnEnd {
                count: Count::Labels {
                    requests: self.requests.clone(),
                    route: route_labels,
                    client_id,
                },
                tls,
                tap_end,
            },
        )
    }

    /// The series of responses labelled `direction`, `authority`, no
    /// route and `client_id`, for [`Self::record_series`].
    pub fn series(
        &self,
        direction: &'static str,
        authority: Arc<str>,
        client_id: Option<Arc<str>>,
    ) -> Series {
        let latency = self
            .latency
            .get_or_create(&RouteLabels {
                direction,
                authority: authority.clone(),
                route: None,
            })
            .clone();
        Series {
            direction,
            authority,
            client_id: client_id.filter(|id| !id.is_empty()),
            latency,
            families: self.requests.clone(),
            requests: Default::default(),
        }
    }

    /// [`Self::record_routed_response`] into series found before: the
    /// same series, without looking them up in the families.
    pub fn record_series(
        &self,
        rsp: http::Response<crate::http::ReplyBody>,
        series: Arc<Series>,
        latency: std::time::Duration,
        hop: &Hop,
        tapped: Option<crate::tap::TapRequest>,
    ) -> http::Response<CountedBody> {
        let tap_end = tapped.and_then(|t| {
            t.respond(
                &self.tap,
                series.direction,
                &series.authority,
                rsp.status(),
                hop,
            )
            .map(Box::new)
        });
        series.latency.observe(latency.as_secs_f64());
        crate::classify::classify(
            rsp,
            CountOnEnd {
                count: Count::Series(series),
                tls: hop.tls,
                tap_end,
            },
        )
    }

    /// Counts a connection as open until the returned guard drops.
    pub fn connection(&self, direction: &str) -> ConnectionGuard {
        let g = self
            .open_connections
            .get_or_create(&DirectionLabels {
                direction: direction.into(),
            })
            .clone();
        g.inc();
        ConnectionGuard(g)
    }
}

/// The body of every response the proxy's HTTP servers send: counted in
/// `tether_proxy_requests_total` once its class is known.
pub type CountedBody = crate::classify::Classified<CountOnEnd>;

/// Counts a response by class (and ends its tap event) when its outcome
/// is known.
pub struct CountOnEnd {
    count: Count,
    tls: bool,
    /// Boxed: a request is rarely tapped, and inline the tap's state (440
    /// bytes) made every response body that size, moved at each step and
    /// held several times in each HTTP/2 stream's future.
    tap_end: Option<Box<crate::tap::TapEnd>>,
}

/// Where [`CountOnEnd`] counts: a series looked up by its labels, or one
/// found before.
enum Count {
    Labels {
        requests: Family<RequestLabels, Counter>,
        route: RouteLabels,
        client_id: Option<Arc<str>>,
    },
    Series(Arc<Series>),
}

/// The series of one stream of responses with the same labels but their
/// class (a service's default route, an inbound connection's authority),
/// looked up in the families once and kept by whoever sees them request
/// after request: hashing a label set costs more than the rest of
/// counting a response. Only for series nobody removes (those without a
/// route): a removed series' handle would go on counting unseen.
pub struct Series {
    direction: &'static str,
    authority: Arc<str>,
    client_id: Option<Arc<str>>,
    latency: Histogram,
    families: Family<RequestLabels, Counter>,
    /// By class (its index in [`CLASSES`]) and TLS, made at the first
    /// response of each, as the family would.
    requests: [[OnceLock<Counter>; 2]; CLASSES.len()],
}

impl Series {
    /// Whether these are the series of `authority`.
    pub fn is_for(&self, authority: &str) -> bool {
        *self.authority == *authority
    }

    fn count(&self, class: &'static str, tls: bool) {
        let labels = || RequestLabels {
            direction: self.direction,
            authority: self.authority.clone(),
            route: None,
            status_class: class,
            tls,
            client_id: self.client_id.clone(),
        };
        match CLASSES.iter().position(|c| *c == class) {
            Some(i) => self.requests[i][usize::from(tls)]
                .get_or_init(|| self.families.get_or_create(&labels()).clone())
                .inc(),
            None => self.families.get_or_create(&labels()).inc(),
        };
    }
}

impl crate::classify::Record for CountOnEnd {
    fn record(self, class: &'static str) {
        match self.count {
            Count::Labels {
                requests,
                route:
                    RouteLabels {
                        direction,
                        authority,
                        route,
                    },
                client_id,
            } => {
                requests
                    .get_or_create(&RequestLabels {
                        direction,
                        authority,
                        route,
                        status_class: class,
                        tls: self.tls,
                        client_id: client_id.filter(|id| !id.is_empty()),
                    })
                    .inc();
            }
            Count::Series(series) => series.count(class, self.tls),
        }
        if let Some(end) = self.tap_end {
            (*end).finish(class);
        }
    }
}

pub struct ConnectionGuard(Gauge);

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn text(metrics: &ProxyMetrics) -> String {
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    #[tokio::test]
    async fn an_unnamed_route_is_the_same_series_as_no_route() {
        let metrics = ProxyMetrics::default();
        for route in [None, Some("".into())] {
            let rsp = metrics.record_routed_response(
                http::Response::new(crate::http::full("ok").into()),
                "outbound",
                "web:80".into(),
                route,
                std::time::Duration::from_millis(1),
                Hop::default(),
                None,
            );
            rsp.into_body().collect().await.unwrap();
        }
        let text = text(&metrics);
        let series: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("tether_proxy_requests_total{"))
            .collect();
        assert_eq!(series.len(), 1, "{text}");
        assert!(series[0].ends_with(" 2"), "{text}");
    }

    /// A kept series counts exactly what looking its labels up counts:
    /// the exposition of both is the same, class by class.
    #[tokio::test]
    async fn a_kept_series_counts_as_its_labels_do() {
        let kept = ProxyMetrics::default();
        let looked_up = ProxyMetrics::default();
        for client_id in [Some("web.demo.serviceaccount.identity"), Some(""), None] {
            let client_id: Option<Arc<str>> = client_id.map(Arc::from);
            let series = Arc::new(kept.series("inbound", "web:80".into(), client_id.clone()));
            for (status, grpc) in [(200, None), (200, None), (503, None), (200, Some("2"))] {
                for tls in [true, false] {
                    let hop = Hop {
                        tls,
                        client_id: client_id.clone(),
                        ..Hop::default()
                    };
                    let rsp = || {
                        let mut rsp = http::Response::new(crate::http::full("ok").into());
                        *rsp.status_mut() = http::StatusCode::from_u16(status).unwrap();
                        if let Some(code) = grpc {
                            let h = rsp.headers_mut();
                            h.insert("content-type", "application/grpc".parse().unwrap());
                            h.insert("grpc-status", code.parse().unwrap());
                        }
                        rsp
                    };
                    let latency = std::time::Duration::from_millis(1);
                    kept.record_series(rsp(), series.clone(), latency, &hop, None)
                        .into_body()
                        .collect()
                        .await
                        .unwrap();
                    looked_up
                        .record_response(rsp(), "inbound", "web:80".into(), latency, hop)
                        .into_body()
                        .collect()
                        .await
                        .unwrap();
                }
            }
        }
        // The same lines; a family lists its series in its map's order.
        let sorted = |text: &str| {
            let mut lines: Vec<String> = text.lines().map(String::from).collect();
            lines.sort();
            lines
        };
        let (kept, looked_up) = (text(&kept), text(&looked_up));
        assert_eq!(sorted(&kept), sorted(&looked_up));
        for class in ["2xx", "5xx", "grpc_error"] {
            assert!(
                kept.contains(&format!(r#"status_class="{class}""#)),
                "{kept}"
            );
        }
    }

    #[tokio::test]
    async fn a_services_route_series_go_with_it() {
        let metrics = ProxyMetrics::default();
        for (authority, route) in [("web:80", "canary"), ("api:80", "canary")] {
            let rsp = http::Response::new(crate::http::full("ok").into());
            let hop = Hop {
                tls: true,
                ..Hop::default()
            };
            let rsp = metrics.record_routed_response(
                rsp,
                "outbound",
                authority.into(),
                Some(route.into()),
                std::time::Duration::from_millis(1),
                hop,
                None,
            );
            rsp.into_body().collect().await.unwrap();
        }
        let before = text(&metrics);
        assert!(
            before.contains(r#"authority="web:80",route="canary",status_class="2xx""#),
            "{before}"
        );
        metrics.forget_routes("web:80", ["canary"].into_iter());
        let after = text(&metrics);
        assert!(
            !after.contains(r#"authority="web:80",route="canary""#),
            "{after}"
        );
        assert!(
            after.contains(r#"authority="api:80",route="canary",status_class="2xx""#),
            "{after}"
        );
    }
}
