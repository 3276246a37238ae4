//! A service's routes as the proxy API's `OutboundPolicy`: what
//! linkerd2-proxy (and Tether's proxy) are told for a service port.
//!
//! Every field a client's conversion requires is set (linkerd2-proxy's
//! `ClientPolicy::try_from` rejects a policy missing metadata, a detection
//! timeout, a distribution, a backend queue or retry conditions, and then
//! fails every request). The routes were validated when the registry read
//! them, so nothing here can fail. `docs/routes.md` says what each route
//! field becomes.

use std::time::Duration;

use linkerd2_proxy_api::destination::{
    self as dst, request_match, response_match, DestinationProfile, HttpStatusRange, RequestMatch,
    ResponseClass, ResponseMatch, WeightedDst,
};
use linkerd2_proxy_api::grpc_route::{GrpcRouteMatch, GrpcRpcMatch};
use linkerd2_proxy_api::http_route::{
    self as hr, header_match, path_match, path_modifier, query_param_match, HeaderMatch,
    HttpRouteMatch, PathModifier, QueryParamMatch,
};
use linkerd2_proxy_api::http_types::{self, headers, http_method, scheme, HttpMethod};
use linkerd2_proxy_api::meta::{metadata, Metadata, Resource};
use linkerd2_proxy_api::outbound::{
    self as api, backend, failure_accrual, grpc_route, http_route, opaque_route, proxy_protocol,
    Backend, FailureAccrual, OutboundPolicy, ProxyProtocol, Queue,
};
use tether_core::authority::ServiceKey;
use tether_core::route::{
    BackendRef, FilterType, GrpcRetryCode, GrpcRule, HeaderModifier, HttpFilter, HttpMatch,
    HttpRule, PathMatchType, PathModifierType, Route, RouteDoc, Timeouts, ValueMatch,
    ValueMatchType,
};

use crate::index::ServiceState;

/// How long a client may wait for the first bytes to detect the protocol.
pub const DETECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Requests a backend holds while it has no ready endpoint, and how long
/// before they fail (linkerd2-proxy's defaults).
pub const QUEUE_CAPACITY: u32 = 100;
pub const QUEUE_FAILFAST: Duration = Duration::from_secs(3);
/// Peak-EWMA parameters, the same as Tether's proxy uses.
pub const EWMA_DEFAULT_RTT: Duration = Duration::from_millis(30);
pub const EWMA_DECAY: Duration = Duration::from_secs(10);
/// Failure accrual: an endpoint that fails this many times in a row sits
/// out, for a backoff between these bounds.
pub const ACCRUAL_MAX_FAILURES: u32 = 7;
pub const ACCRUAL_MIN_BACKOFF: Duration = Duration::from_secs(1);
pub const ACCRUAL_MAX_BACKOFF: Duration = Duration::from_secs(60);
/// The largest request body a client buffers to be able to retry it.
pub const RETRY_MAX_REQUEST_BYTES: u32 = 64 * 1024;

const GATEWAY_GROUP: &str = "gateway.networking.k8s.io";

fn duration(d: Duration) -> Option<prost_types::Duration> {
    prost_types::Duration::try_from(d).ok()
}

/// A non-zero Gateway API duration (zero means none).
fn route_duration(text: Option<&str>) -> Option<Duration> {
    text.and_then(|t| tether_core::route::parse_route_duration(t).ok())
        .filter(|d| !d.is_zero())
}

fn default_meta(name: &str) -> Option<Metadata> {
    Some(Metadata {
        kind: Some(metadata::Kind::Default(name.to_string())),
    })
}

fn service_meta(service: &ServiceKey, port: u16) -> Option<Metadata> {
    Some(Metadata {
        kind: Some(metadata::Kind::Resource(Resource {
            group: "core".into(),
            kind: "Service".into(),
            name: service.name.clone(),
            namespace: service.namespace.clone(),
            section: String::new(),
            port: port.into(),
        })),
    })
}

fn route_meta(kind: &str, namespace: &str, name: &str) -> Option<Metadata> {
    Some(Metadata {
        kind: Some(metadata::Kind::Resource(Resource {
            group: GATEWAY_GROUP.into(),
            kind: kind.into(),
            name: name.into(),
            namespace: namespace.into(),
            section: String::new(),
            port: 0,
        })),
    })
}

/// Everything a policy for one service port is built from.
pub struct Target<'a> {
    pub service: &'a ServiceKey,
    pub state: &'a ServiceState,
    pub port: u16,
    pub cluster_domain: &'a str,
}

impl Target<'_> {
    /// A service port as a load-balanced backend, discovered through
    /// `Destination.Get` on its authority.
    fn backend(&self, service: &ServiceKey, port: u16) -> Backend {
        Backend {
            metadata: service_meta(service, port),
            kind: Some(backend::Kind::Balancer(backend::BalanceP2c {
                discovery: Some(backend::EndpointDiscovery {
                    kind: Some(backend::endpoint_discovery::Kind::Dst(
                        backend::endpoint_discovery::DestinationGet {
                            path: format!("{}:{port}", service.fqdn(self.cluster_domain)),
                        },
                    )),
                }),
                load: Some(backend::balance_p2c::Load::PeakEwma(
                    backend::balance_p2c::PeakEwma {
                        default_rtt: duration(EWMA_DEFAULT_RTT),
                        decay: duration(EWMA_DECAY),
                    },
                )),
            })),
            queue: Some(Queue {
                capacity: QUEUE_CAPACITY,
                failfast_timeout: duration(QUEUE_FAILFAST),
            }),
        }
    }

    fn own_backend(&self) -> Backend {
        self.backend(self.service, self.port)
    }

    fn backend_of(&self, namespace: &str, r: &BackendRef) -> Backend {
        self.backend(&r.service(namespace), r.port.unwrap_or(self.port))
    }

    /// The service's own response timeout, for rules that set none.
    fn service_timeouts(&self) -> Option<hr::Timeouts> {
        self.state
            .response_timeout
            .filter(|t| !t.is_zero())
            .map(|t| hr::Timeouts {
                response: duration(t),
                ..Default::default()
            })
    }

    /// A rule's timeouts. `backendRequest` bounds one attempt: with a retry
    /// it is the retry's per-try timeout, and only `request` bounds the
    /// attempts together (a response timeout would end the request when its
    /// first attempt times out, and the retry would never happen).
    fn timeouts(&self, rule: Option<&Timeouts>, retried: bool) -> Option<hr::Timeouts> {
        let Some(t) = rule else {
            return self.service_timeouts();
        };
        Some(hr::Timeouts {
            request: route_duration(t.request.as_deref()).and_then(duration),
            response: if retried {
                None
            } else {
                backend_timeout(Some(t))
            },
            idle: None,
        })
    }

    fn routes<'s, R: 's>(&'s self) -> impl Iterator<Item = &'s RouteDoc<R>> + 's
    where
        Route: AsRoute<R>,
    {
        let (service, port) = (self.service, self.port);
        self.state
            .routes
            .iter()
            .filter(move |r| r.applies_to(service, port))
            .filter_map(AsRoute::<R>::as_route)
    }

    fn is_opaque(&self) -> bool {
        self.state
            .ports
            .iter()
            .any(|p| p.port == self.port && p.opaque)
    }

    /// The ServiceProfile for this service port, for clients that use
    /// `GetProfile` rather than `OutboundPolicies`: what of the routes a
    /// profile can carry (`docs/routes.md`).
    pub fn profile(&self) -> DestinationProfile {
        let opaque = self.is_opaque();
        let mut routes = if opaque {
            vec![]
        } else {
            self.profile_routes()
        };
        // Only a registry override: without it proxies use their own default.
        if let Some(t) = self.state.response_timeout {
            routes.push(default_profile_route(t));
        }
        DestinationProfile {
            fully_qualified_name: self.service.fqdn(self.cluster_domain),
            opaque_protocol: opaque,
            routes,
            retry_budget: self.state.retry_budget.map(|b| dst::RetryBudget {
                retry_ratio: b.ratio,
                min_retries_per_second: b.min_per_second,
                ttl: duration(tether_core::registry::RETRY_BUDGET_WINDOW),
            }),
            dst_overrides: if opaque { vec![] } else { self.dst_overrides() },
            endpoint: None,
            parent_ref: service_meta(self.service, self.port),
            profile_ref: None,
        }
    }

    /// Profile routes, most specific first (a profile's first match wins,
    /// where the Gateway API picks the most specific): exact paths, then
    /// longer prefixes, then regular expressions; method matches before
    /// the same path without one. Matches on headers or query parameters
    /// cannot be expressed in a profile and are left out.
    fn profile_routes(&self) -> Vec<dst::Route> {
        let mut routes: Vec<(Specificity, dst::Route)> = Vec::new();
        let grpc: Vec<&RouteDoc<GrpcRule>> = self.routes::<GrpcRule>().collect();
        if !grpc.is_empty() {
            for r in grpc {
                for rule in &r.rules {
                    let timeout = self.profile_timeout(rule.timeouts.as_ref());
                    let methods: Vec<Option<&tether_core::route::GrpcMethodMatch>> =
                        if rule.matches.is_empty() {
                            vec![None]
                        } else {
                            rule.matches
                                .iter()
                                .filter(|m| m.headers.is_empty())
                                .map(|m| m.method.as_ref())
                                .collect()
                        };
                    for method in methods {
                        let regex = method.map_or("^/.*$".to_string(), |m| {
                            tether_core::route::grpc_path_regex(m)
                        });
                        let rank = match method {
                            Some(m) if m.service.is_some() && m.method.is_some() => 0,
                            Some(_) => 1,
                            None => 2,
                        };
                        routes.push((
                            (rank, std::cmp::Reverse(0), false),
                            profile_route(&r.name, path_condition(regex), timeout, None),
                        ));
                    }
                }
            }
        } else {
            for r in self.routes::<HttpRule>() {
                for rule in &r.rules {
                    let timeout = self.profile_timeout(rule.timeouts.as_ref());
                    let classes = rule.retry.as_ref().map(|retry| {
                        let ranges: Vec<(u16, u16)> = if retry.codes.is_empty() {
                            vec![(500, 599)]
                        } else {
                            retry.codes.iter().map(|c| (*c, *c)).collect()
                        };
                        failure_classes(&ranges)
                    });
                    let matches = if rule.matches.is_empty() {
                        vec![HttpMatch::default()]
                    } else {
                        rule.matches.clone()
                    };
                    for m in matches
                        .iter()
                        .filter(|m| m.headers.is_empty() && m.query_params.is_empty())
                    {
                        let path = m.path.clone().unwrap_or(tether_core::route::PathMatch {
                            kind: PathMatchType::PathPrefix,
                            value: "/".into(),
                        });
                        let rank = match path.kind {
                            PathMatchType::Exact => 0,
                            PathMatchType::PathPrefix => 1,
                            PathMatchType::RegularExpression => 2,
                        };
                        let key = (
                            rank,
                            std::cmp::Reverse(path.value.len()),
                            m.method.is_none(),
                        );
                        let mut condition = path_condition(tether_core::route::path_regex(&path));
                        if let Some(name) = &m.method {
                            condition = RequestMatch {
                                r#match: Some(request_match::Match::All(request_match::Seq {
                                    matches: vec![
                                        condition,
                                        RequestMatch {
                                            r#match: Some(request_match::Match::Method(method(
                                                name,
                                            ))),
                                        },
                                    ],
                                })),
                            };
                        }
                        routes.push((
                            key,
                            profile_route(&r.name, condition, timeout, classes.clone()),
                        ));
                    }
                }
            }
        }
        routes.sort_by_key(|(key, _)| *key);
        routes.into_iter().map(|(_, r)| r).collect()
    }

    /// A rule's request timeout (else its backend timeout, else the
    /// service's response timeout) as a profile route's timeout.
    fn profile_timeout(&self, t: Option<&Timeouts>) -> Option<Duration> {
        t.and_then(|t| {
            route_duration(t.request.as_deref()).or(route_duration(t.backend_request.as_deref()))
        })
        .or(self.state.response_timeout)
    }

    /// A service-level split: the weighted backends of the first rule that
    /// takes every request (no matches, or only `PathPrefix /`).
    fn dst_overrides(&self) -> Vec<WeightedDst> {
        let catch_all = |matches: &[HttpMatch]| {
            matches.is_empty()
                || matches.iter().any(|m| {
                    m.headers.is_empty()
                        && m.query_params.is_empty()
                        && m.method.is_none()
                        && m.path.as_ref().is_none_or(|p| {
                            p.kind == PathMatchType::PathPrefix
                                && p.value.trim_end_matches('/').is_empty()
                        })
                })
        };
        let grpc: Vec<(&str, &[BackendRef])> = self
            .routes::<GrpcRule>()
            .flat_map(|r| {
                r.rules
                    .iter()
                    .filter(|rule| {
                        rule.matches
                            .iter()
                            .all(|m| m.method.is_none() && m.headers.is_empty())
                    })
                    .map(move |rule| (r.namespace.as_str(), rule.backend_refs.as_slice()))
            })
            .collect();
        let candidates: Vec<(&str, &[BackendRef])> = if !grpc.is_empty() {
            grpc
        } else {
            self.routes::<HttpRule>()
                .flat_map(|r| {
                    r.rules
                        .iter()
                        .filter(|rule| catch_all(&rule.matches))
                        .map(move |rule| (r.namespace.as_str(), rule.backend_refs.as_slice()))
                })
                .collect()
        };
        let Some((namespace, refs)) = candidates.into_iter().next() else {
            return vec![];
        };
        refs.iter()
            .map(|b| {
                let service = b.service(namespace);
                let port = b.port.unwrap_or(self.port);
                WeightedDst {
                    authority: format!("{}:{port}", service.fqdn(self.cluster_domain)),
                    weight: b.weight,
                    backend_ref: service_meta(&service, port),
                }
            })
            .collect()
    }

    /// The policy for this service port.
    pub fn policy(&self) -> OutboundPolicy {
        let kind = if self.is_opaque() {
            proxy_protocol::Kind::Opaque(self.opaque())
        } else if let Some(grpc) = self.grpc() {
            proxy_protocol::Kind::Grpc(grpc)
        } else {
            let routes = self.http_routes();
            proxy_protocol::Kind::Detect(proxy_protocol::Detect {
                timeout: duration(DETECT_TIMEOUT),
                opaque: Some(self.opaque()),
                http1: Some(proxy_protocol::Http1 {
                    routes: routes.clone(),
                    failure_accrual: Some(failure_accrual()),
                }),
                http2: Some(proxy_protocol::Http2 {
                    routes,
                    failure_accrual: Some(failure_accrual()),
                }),
            })
        };
        OutboundPolicy {
            protocol: Some(ProxyProtocol { kind: Some(kind) }),
            metadata: service_meta(self.service, self.port),
        }
    }

    fn opaque(&self) -> proxy_protocol::Opaque {
        proxy_protocol::Opaque {
            routes: vec![api::OpaqueRoute {
                metadata: default_meta("opaq"),
                rules: vec![opaque_route::Rule {
                    backends: Some(opaque_route::Distribution {
                        kind: Some(opaque_route::distribution::Kind::FirstAvailable(
                            opaque_route::distribution::FirstAvailable {
                                backends: vec![opaque_route::RouteBackend {
                                    backend: Some(self.own_backend()),
                                    filters: vec![],
                                }],
                            },
                        )),
                    }),
                    filters: vec![],
                }],
            }],
        }
    }

    /// The HTTPRoutes on this port, or the default route: every request to
    /// the service itself, with its response timeout (today's behaviour).
    fn http_routes(&self) -> Vec<api::HttpRoute> {
        let routes: Vec<api::HttpRoute> = self
            .routes::<HttpRule>()
            .map(|r| api::HttpRoute {
                metadata: route_meta("HTTPRoute", &r.namespace, &r.name),
                hosts: vec![],
                rules: if r.rules.is_empty() {
                    vec![self.http_rule(&r.namespace, &HttpRule::default())]
                } else {
                    r.rules
                        .iter()
                        .map(|rule| self.http_rule(&r.namespace, rule))
                        .collect()
                },
            })
            .collect();
        if !routes.is_empty() {
            return routes;
        }
        vec![api::HttpRoute {
            metadata: default_meta("http"),
            hosts: vec![],
            rules: vec![self.http_rule(&self.service.namespace, &HttpRule::default())],
        }]
    }

    #[allow(deprecated)] // request_timeout: the client reads `timeouts` when set
    fn http_rule(&self, namespace: &str, rule: &HttpRule) -> http_route::Rule {
        let matches = if rule.matches.is_empty() {
            vec![http_match(&HttpMatch::default())]
        } else {
            rule.matches.iter().map(http_match).collect()
        };
        let backends = self.distribution(namespace, &rule.backend_refs);
        let backends = Some(match backends {
            Dist::First(b) => http_route::Distribution {
                kind: Some(http_route::distribution::Kind::FirstAvailable(
                    http_route::distribution::FirstAvailable {
                        backends: vec![http_route::RouteBackend {
                            backend: Some(*b),
                            filters: vec![],
                            request_timeout: None,
                        }],
                    },
                )),
            },
            Dist::Random(bs) => http_route::Distribution {
                kind: Some(http_route::distribution::Kind::RandomAvailable(
                    http_route::distribution::RandomAvailable {
                        backends: bs
                            .into_iter()
                            .map(|(b, weight)| http_route::WeightedRouteBackend {
                                backend: Some(http_route::RouteBackend {
                                    backend: Some(b),
                                    filters: vec![],
                                    request_timeout: None,
                                }),
                                weight,
                            })
                            .collect(),
                    },
                )),
            },
        });
        let retry = rule.retry.as_ref().map(|r| http_route::Retry {
            max_retries: r.attempts.unwrap_or(1),
            max_request_bytes: RETRY_MAX_REQUEST_BYTES,
            conditions: Some(http_route::retry::Conditions {
                status_ranges: if r.codes.is_empty() {
                    vec![status_range(500, 599)]
                } else {
                    r.codes.iter().map(|c| status_range(*c, *c)).collect()
                },
            }),
            timeout: backend_timeout(rule.timeouts.as_ref()),
            backoff: retry_backoff(r.backoff.as_deref()),
        });
        http_route::Rule {
            matches,
            filters: rule.filters.iter().map(http_filter).collect(),
            backends,
            request_timeout: None,
            timeouts: self.timeouts(rule.timeouts.as_ref(), retry.is_some()),
            retry,
            allow_l5d_request_headers: false,
        }
    }

    /// Some(Grpc) when GRPCRoutes apply to this port: they take the port
    /// over (HTTPRoutes on it are then not served, as in Linkerd).
    fn grpc(&self) -> Option<proxy_protocol::Grpc> {
        let routes: Vec<api::GrpcRoute> = self
            .routes::<GrpcRule>()
            .map(|r| api::GrpcRoute {
                metadata: route_meta("GRPCRoute", &r.namespace, &r.name),
                hosts: vec![],
                rules: if r.rules.is_empty() {
                    vec![self.grpc_rule(&r.namespace, &GrpcRule::default())]
                } else {
                    r.rules
                        .iter()
                        .map(|rule| self.grpc_rule(&r.namespace, rule))
                        .collect()
                },
            })
            .collect();
        (!routes.is_empty()).then(|| proxy_protocol::Grpc {
            routes,
            failure_accrual: Some(failure_accrual()),
        })
    }

    #[allow(deprecated)]
    fn grpc_rule(&self, namespace: &str, rule: &GrpcRule) -> grpc_route::Rule {
        let matches = if rule.matches.is_empty() {
            vec![GrpcRouteMatch {
                // linkerd2-proxy refuses a match without an RPC match
                rpc: Some(GrpcRpcMatch::default()),
                headers: vec![],
            }]
        } else {
            rule.matches.iter().map(grpc_match).collect()
        };
        let backends = Some(match self.distribution(namespace, &rule.backend_refs) {
            Dist::First(b) => grpc_route::Distribution {
                kind: Some(grpc_route::distribution::Kind::FirstAvailable(
                    grpc_route::distribution::FirstAvailable {
                        backends: vec![grpc_route::RouteBackend {
                            backend: Some(*b),
                            filters: vec![],
                            request_timeout: None,
                        }],
                    },
                )),
            },
            Dist::Random(bs) => grpc_route::Distribution {
                kind: Some(grpc_route::distribution::Kind::RandomAvailable(
                    grpc_route::distribution::RandomAvailable {
                        backends: bs
                            .into_iter()
                            .map(|(b, weight)| grpc_route::WeightedRouteBackend {
                                backend: Some(grpc_route::RouteBackend {
                                    backend: Some(b),
                                    filters: vec![],
                                    request_timeout: None,
                                }),
                                weight,
                            })
                            .collect(),
                    },
                )),
            },
        });
        let retry = rule.retry.as_ref().map(|r| {
            let codes: &[GrpcRetryCode] = if r.codes.is_empty() {
                &[GrpcRetryCode::Unavailable]
            } else {
                &r.codes
            };
            let has = |c| codes.contains(&c);
            grpc_route::Retry {
                max_retries: r.attempts.unwrap_or(1),
                max_request_bytes: RETRY_MAX_REQUEST_BYTES,
                conditions: Some(grpc_route::retry::Conditions {
                    cancelled: has(GrpcRetryCode::Cancelled),
                    deadine_exceeded: has(GrpcRetryCode::DeadlineExceeded),
                    resource_exhausted: has(GrpcRetryCode::ResourceExhausted),
                    internal: has(GrpcRetryCode::Internal),
                    unavailable: has(GrpcRetryCode::Unavailable),
                }),
                timeout: backend_timeout(rule.timeouts.as_ref()),
                backoff: retry_backoff(r.backoff.as_deref()),
            }
        });
        grpc_route::Rule {
            matches,
            filters: rule
                .filters
                .iter()
                .filter_map(|f| f.request_header_modifier.as_ref())
                .map(|m| grpc_route::Filter {
                    kind: Some(grpc_route::filter::Kind::RequestHeaderModifier(
                        hr::RequestHeaderModifier {
                            add: Some(header_list(&m.add)),
                            set: Some(header_list(&m.set)),
                            remove: m.remove.clone(),
                        },
                    )),
                })
                .collect(),
            backends,
            request_timeout: None,
            timeouts: self.timeouts(rule.timeouts.as_ref(), retry.is_some()),
            retry,
            allow_l5d_request_headers: false,
        }
    }

    /// A rule's backends: the service itself when it names none.
    fn distribution(&self, namespace: &str, refs: &[BackendRef]) -> Dist {
        if refs.is_empty() {
            return Dist::First(Box::new(self.own_backend()));
        }
        Dist::Random(
            refs.iter()
                .map(|r| (self.backend_of(namespace, r), r.weight))
                .collect(),
        )
    }
}

enum Dist {
    First(Box<Backend>),
    Random(Vec<(Backend, u32)>),
}

/// Picks one kind of route out of [`Route`].
pub trait AsRoute<R> {
    fn as_route(&self) -> Option<&RouteDoc<R>>;
}

impl AsRoute<HttpRule> for Route {
    fn as_route(&self) -> Option<&RouteDoc<HttpRule>> {
        match self {
            Route::Http(r) => Some(r),
            Route::Grpc(_) => None,
        }
    }
}

impl AsRoute<GrpcRule> for Route {
    fn as_route(&self) -> Option<&RouteDoc<GrpcRule>> {
        match self {
            Route::Grpc(r) => Some(r),
            Route::Http(_) => None,
        }
    }
}

fn failure_accrual() -> FailureAccrual {
    FailureAccrual {
        kind: Some(failure_accrual::Kind::ConsecutiveFailures(
            failure_accrual::ConsecutiveFailures {
                max_failures: ACCRUAL_MAX_FAILURES,
                backoff: Some(api::ExponentialBackoff {
                    min_backoff: duration(ACCRUAL_MIN_BACKOFF),
                    max_backoff: duration(ACCRUAL_MAX_BACKOFF),
                    jitter_ratio: 0.5,
                    respect_retry_after_hint: false,
                }),
            },
        )),
        ejection: None,
    }
}

fn backend_timeout(t: Option<&Timeouts>) -> Option<prost_types::Duration> {
    t.and_then(|t| route_duration(t.backend_request.as_deref()))
        .and_then(duration)
}

/// A fixed wait before each retry (min = max, no jitter), or none.
fn retry_backoff(text: Option<&str>) -> Option<api::ExponentialBackoff> {
    route_duration(text).map(|d| api::ExponentialBackoff {
        min_backoff: duration(d),
        max_backoff: duration(d),
        jitter_ratio: 0.0,
        respect_retry_after_hint: false,
    })
}

fn status_range(start: u16, end: u16) -> http_route::retry::conditions::StatusRange {
    http_route::retry::conditions::StatusRange {
        start: start.into(),
        end: end.into(),
    }
}

/// A route's regular expression as sent: anchored, so a client that
/// searches (rather than matches the whole value) agrees with
/// `tether_core::route::compile_regex`.
pub fn anchored(pattern: &str) -> String {
    format!("^(?:{pattern})$")
}

pub(crate) fn http_match(m: &HttpMatch) -> HttpRouteMatch {
    let path = m
        .path
        .as_ref()
        .map_or(path_match::Kind::Prefix("/".into()), |p| match p.kind {
            PathMatchType::Exact => path_match::Kind::Exact(p.value.clone()),
            PathMatchType::PathPrefix => path_match::Kind::Prefix(p.value.clone()),
            PathMatchType::RegularExpression => path_match::Kind::Regex(anchored(&p.value)),
        });
    HttpRouteMatch {
        path: Some(hr::PathMatch { kind: Some(path) }),
        headers: m.headers.iter().map(header_match).collect(),
        query_params: m
            .query_params
            .iter()
            .map(|q| QueryParamMatch {
                name: q.name.clone(),
                value: Some(match q.kind {
                    ValueMatchType::Exact => query_param_match::Value::Exact(q.value.clone()),
                    ValueMatchType::RegularExpression => {
                        query_param_match::Value::Regex(anchored(&q.value))
                    }
                }),
            })
            .collect(),
        method: m.method.as_deref().map(method),
    }
}

pub(crate) fn grpc_match(m: &tether_core::route::GrpcMatch) -> GrpcRouteMatch {
    GrpcRouteMatch {
        // Always present (linkerd2-proxy refuses a match without one); an
        // empty one matches every method of every service.
        rpc: Some(
            m.method
                .as_ref()
                .map(|method| GrpcRpcMatch {
                    service: method.service.clone().unwrap_or_default(),
                    method: method.method.clone().unwrap_or_default(),
                })
                .unwrap_or_default(),
        ),
        headers: m.headers.iter().map(header_match).collect(),
    }
}

fn header_match(h: &ValueMatch) -> HeaderMatch {
    HeaderMatch {
        name: h.name.clone(),
        value: Some(match h.kind {
            ValueMatchType::Exact => header_match::Value::Exact(h.value.clone().into_bytes()),
            ValueMatchType::RegularExpression => header_match::Value::Regex(anchored(&h.value)),
        }),
    }
}

fn method(name: &str) -> HttpMethod {
    use http_method::Registered as M;
    let registered = match name {
        "GET" => M::Get,
        "POST" => M::Post,
        "PUT" => M::Put,
        "DELETE" => M::Delete,
        "PATCH" => M::Patch,
        "OPTIONS" => M::Options,
        "CONNECT" => M::Connect,
        "HEAD" => M::Head,
        "TRACE" => M::Trace,
        // Validation allows only the registered methods.
        other => {
            return HttpMethod {
                r#type: Some(http_method::Type::Unregistered(other.to_string())),
            }
        }
    };
    HttpMethod {
        r#type: Some(http_method::Type::Registered(registered.into())),
    }
}

fn header_list(items: &[tether_core::route::HeaderValue]) -> http_types::Headers {
    http_types::Headers {
        headers: items
            .iter()
            .map(|h| headers::Header {
                name: h.name.clone(),
                value: h.value.clone().into_bytes(),
            })
            .collect(),
    }
}

pub(crate) fn http_filter(f: &HttpFilter) -> http_route::Filter {
    use http_route::filter::Kind;
    let modifier = |m: &Option<HeaderModifier>| m.clone().unwrap_or_default();
    let kind = match f.kind {
        FilterType::RequestHeaderModifier => {
            let m = modifier(&f.request_header_modifier);
            Kind::RequestHeaderModifier(hr::RequestHeaderModifier {
                add: Some(header_list(&m.add)),
                set: Some(header_list(&m.set)),
                remove: m.remove,
            })
        }
        FilterType::ResponseHeaderModifier => {
            let m = modifier(&f.response_header_modifier);
            Kind::ResponseHeaderModifier(hr::ResponseHeaderModifier {
                add: Some(header_list(&m.add)),
                set: Some(header_list(&m.set)),
                remove: m.remove,
            })
        }
        FilterType::RequestRedirect => {
            let r = f.request_redirect.clone().unwrap_or_default();
            Kind::Redirect(hr::RequestRedirect {
                scheme: r.scheme.as_deref().map(|s| http_types::Scheme {
                    r#type: Some(scheme::Type::Registered(
                        if s == "https" {
                            scheme::Registered::Https
                        } else {
                            scheme::Registered::Http
                        }
                        .into(),
                    )),
                }),
                host: r.hostname.unwrap_or_default(),
                path: r.path.map(|p| PathModifier {
                    replace: Some(match p.kind {
                        PathModifierType::ReplaceFullPath => {
                            path_modifier::Replace::Full(p.replace_full_path.unwrap_or_default())
                        }
                        PathModifierType::ReplacePrefixMatch => path_modifier::Replace::Prefix(
                            p.replace_prefix_match.unwrap_or_default(),
                        ),
                    }),
                }),
                port: r.port.map_or(0, u32::from),
                // The Gateway API's default; the proto's would be 301.
                status: r.status_code.map_or(302, u32::from),
            })
        }
    };
    http_route::Filter { kind: Some(kind) }
}

/// How a profile route sorts: match kind (exact, prefix, regex), longer
/// values first, method matches first.
type Specificity = (u8, std::cmp::Reverse<usize>, bool);

fn path_condition(regex: String) -> RequestMatch {
    RequestMatch {
        r#match: Some(request_match::Match::Path(dst::PathMatch { regex })),
    }
}

/// Responses with these statuses are failures (and so retried on a
/// retryable route).
fn failure_classes(ranges: &[(u16, u16)]) -> Vec<ResponseClass> {
    vec![ResponseClass {
        condition: Some(ResponseMatch {
            r#match: Some(response_match::Match::Any(response_match::Seq {
                matches: ranges
                    .iter()
                    .map(|(min, max)| ResponseMatch {
                        r#match: Some(response_match::Match::Status(HttpStatusRange {
                            min: (*min).into(),
                            max: (*max).into(),
                        })),
                    })
                    .collect(),
            })),
        }),
        is_failure: true,
    }]
}

fn profile_route(
    name: &str,
    condition: RequestMatch,
    timeout: Option<Duration>,
    retry_classes: Option<Vec<ResponseClass>>,
) -> dst::Route {
    dst::Route {
        condition: Some(condition),
        is_retryable: retry_classes.is_some(),
        response_classes: retry_classes.unwrap_or_default(),
        metrics_labels: [("route".to_string(), name.to_string())].into(),
        timeout: timeout.and_then(duration),
    }
}

/// The route a service's `response_timeout` travels in: every path, with
/// the timeout (zero: none, for Tether's proxy), labelled `route=default`.
/// Last, so the routes before it take precedence.
pub fn default_profile_route(timeout: Duration) -> dst::Route {
    profile_route("default", path_condition(".*".into()), Some(timeout), None)
}
