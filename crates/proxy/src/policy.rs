//! A service's outbound policy as the control plane sends it over
//! `OutboundPolicies.Watch` (linkerd2-proxy-api's `OutboundPolicy`), in the
//! form the data path uses: routes (Gateway API `HTTPRoute` / `GRPCRoute`)
//! with their matches, filters, weighted backends, timeouts and retries.
//!
//! Conversion checks everything the data path relies on, so a policy is
//! taken whole or refused whole (the caller keeps the last good one).
//! Matching is shaped like linkerd2-proxy's `linkerd/http/route` crate
//! (every route's best rule match is ranked, the best wins, ties go to the
//! route and rule listed first, a rule without matches matches everything
//! as a `/` prefix), with the ranking in the Gateway API's order of
//! precedence, which is also what the control plane documents
//! (`docs/routes.md`): the best host match first (exact over wildcard, then
//! longer), then an exact path, then the longest path match (a regular
//! expression counts as the whole path), then a method match, then the
//! most header matches, then the most query-parameter matches. linkerd2-proxy
//! ranks method last and exact and prefix by length alone; the Gateway API
//! is the contract users read. gRPC: the longest service, the longest
//! method, then the most header matches.

use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Method, StatusCode};
use linkerd2_proxy_api::{grpc_route as grpc_api, http_route as api, meta, outbound};
use regex::Regex;

/// Largest request body a route's retry keeps, whatever the policy asks.
pub const MAX_RETRY_BODY: u32 = 1 << 20;
/// Most retries a route may ask for.
const MAX_ROUTE_RETRIES: u32 = 10;

/// Why a policy was refused.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PolicyError(String);

fn invalid(what: impl std::fmt::Display) -> PolicyError {
    PolicyError(tether_core::truncate::bounded_message(what))
}

/// A service's routes, per HTTP version of the request.
#[derive(Debug, Default)]
pub struct ClientPolicy {
    /// Routes for HTTP/1 requests; `None`: the policy says the service is
    /// not HTTP (opaque, TLS), so requests take the default path.
    pub http1: Option<Arc<[Route]>>,
    /// Routes for HTTP/2 requests (gRPC included).
    pub http2: Option<Arc<[Route]>>,
}

impl ClientPolicy {
    /// The routes for a request of `version`.
    pub fn routes(&self, version: http::Version) -> Option<&[Route]> {
        if version == http::Version::HTTP_2 {
            self.http2.as_deref()
        } else {
            self.http1.as_deref()
        }
    }

    pub fn from_api(policy: outbound::OutboundPolicy) -> Result<Self, PolicyError> {
        use outbound::proxy_protocol::Kind;
        let kind = policy
            .protocol
            .and_then(|p| p.kind)
            .ok_or_else(|| invalid("no protocol"))?;
        let http = |routes: Vec<outbound::HttpRoute>| -> Result<Option<Arc<[Route]>>, PolicyError> {
            let routes = routes
                .into_iter()
                .map(Route::from_http)
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Some(routes.into()))
        };
        Ok(match kind {
            Kind::Detect(d) => Self {
                http1: http(
                    d.http1
                        .ok_or_else(|| invalid("detect: no http1 policy"))?
                        .routes,
                )?,
                http2: http(
                    d.http2
                        .ok_or_else(|| invalid("detect: no http2 policy"))?
                        .routes,
                )?,
            },
            Kind::Http1(h) => {
                let routes = http(h.routes)?;
                Self {
                    http1: routes.clone(),
                    http2: routes,
                }
            }
            Kind::Http2(h) => {
                let routes = http(h.routes)?;
                Self {
                    http1: routes.clone(),
                    http2: routes,
                }
            }
            Kind::Grpc(g) => {
                let routes: Arc<[Route]> = g
                    .routes
                    .into_iter()
                    .map(Route::from_grpc)
                    .collect::<Result<Vec<_>, _>>()?
                    .into();
                Self {
                    http1: Some(routes.clone()),
                    http2: Some(routes),
                }
            }
            // Not HTTP: requests keep the default path.
            Kind::Opaque(_) | Kind::Tls(_) => Self::default(),
        })
    }
}

/// One route: host matches and rules.
#[derive(Debug)]
pub struct Route {
    /// The route's name, for metrics and logs (empty for the default route
    /// of a service without routes).
    pub name: Arc<str>,
    pub hosts: Vec<HostMatch>,
    pub rules: Vec<Rule>,
}

#[derive(Debug)]
pub struct Rule {
    /// Any may match; none matches every request.
    pub matches: Vec<RequestMatch>,
    pub filters: Vec<Filter>,
    pub backends: Backends,
    pub timeouts: Timeouts,
    pub retry: Option<Retry>,
    grpc: bool,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// From the request's end to the response's headers (per request, all
    /// attempts together); zero: none.
    pub response: Option<Duration>,
    /// From the request's start to the response's headers; zero: none.
    pub request: Option<Duration>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMatch {
    Exact(String),
    /// `*.example.com` as `["com", "example"]`.
    Suffix(Vec<String>),
}

#[derive(Debug)]
pub enum RequestMatch {
    Http {
        path: Option<PathMatch>,
        headers: Vec<HeaderMatch>,
        query: Vec<QueryMatch>,
        method: Option<Method>,
    },
    Grpc {
        service: Option<String>,
        method: Option<String>,
        headers: Vec<HeaderMatch>,
    },
}

#[derive(Debug)]
pub enum PathMatch {
    Exact(String),
    Prefix(String),
    Regex(Regex),
}

#[derive(Debug)]
pub enum HeaderMatch {
    Exact(HeaderName, Vec<u8>),
    Regex(HeaderName, Regex),
}

#[derive(Debug)]
pub enum QueryMatch {
    Exact(String, String),
    Regex(String, Regex),
}

#[derive(Debug)]
pub enum Filter {
    RequestHeaders(HeaderModifier),
    ResponseHeaders(HeaderModifier),
    Redirect(Redirect),
    Fail(Failure),
}

#[derive(Debug, Default)]
pub struct HeaderModifier {
    add: Vec<(HeaderName, HeaderValue)>,
    set: Vec<(HeaderName, HeaderValue)>,
    remove: Vec<HeaderName>,
}

#[derive(Debug)]
pub struct Redirect {
    scheme: Option<String>,
    host: Option<String>,
    port: Option<u16>,
    path: Option<PathModifier>,
    pub status: StatusCode,
}

#[derive(Debug)]
enum PathModifier {
    Full(String),
    Prefix(String),
}

/// A fixed answer for a share of the requests (failure injection).
#[derive(Debug)]
pub struct Failure {
    pub status: StatusCode,
    /// The gRPC status code (gRPC routes).
    pub grpc_code: Option<u32>,
    pub message: String,
    /// `numerator / denominator` of requests fail.
    ratio: (u32, u32),
}

#[derive(Debug)]
pub struct Backends {
    /// In policy order; a request goes to one, by weight.
    pub list: Vec<Backend>,
    /// Use the first backend with endpoints rather than weights.
    pub first_available: bool,
}

#[derive(Debug)]
pub struct Backend {
    /// The service's authority (`Destination.Get` path), normalised.
    pub authority: String,
    pub weight: u32,
    pub filters: Vec<Filter>,
}

#[derive(Debug)]
pub struct Retry {
    pub max_retries: u32,
    pub max_request_bytes: u32,
    pub on: RetryOn,
    /// Each attempt's own timeout.
    pub timeout: Option<Duration>,
    /// Pause between attempts: (min, max).
    pub backoff: Option<(Duration, Duration)>,
}

#[derive(Debug)]
pub enum RetryOn {
    Status(Vec<RangeInclusive<u16>>),
    GrpcCodes(Vec<u32>),
}

/// The route and rule a request selected, and its path prefix match (for a
/// redirect that replaces the prefix).
#[derive(Debug)]
pub struct Selected<'a> {
    pub route: &'a Route,
    pub rule: &'a Rule,
    pub prefix: Option<&'a str>,
}

// === conversion ===

fn duration(d: Option<prost_types::Duration>, what: &str) -> Result<Option<Duration>, PolicyError> {
    d.map(|d| Duration::try_from(d).map_err(|e| invalid(format_args!("{what}: {e}"))))
        .transpose()
}

/// Compiled as the control plane compiles it (anchored, size-bounded), so
/// both accept the same patterns.
fn regex(source: &str, what: &str) -> Result<Regex, PolicyError> {
    tether_core::route::compile_regex(source).map_err(|e| invalid(format_args!("{what}: {e}")))
}

fn header_name(name: &str, what: &str) -> Result<HeaderName, PolicyError> {
    HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
        invalid(format_args!(
            "{what}: invalid header name {}",
            tether_core::truncate::for_log(name)
        ))
    })
}

/// A route's metric label: its resource's name; empty for a default route
/// (a service without routes), so that service's series stay as they were.
fn route_name(meta: Option<meta::Metadata>) -> Arc<str> {
    let name = match meta.and_then(|m| m.kind) {
        Some(meta::metadata::Kind::Resource(r)) => r.name,
        Some(meta::metadata::Kind::Default(_)) | None => String::new(),
    };
    // Bounded: it becomes a metric label.
    let mut end = name.len().min(128);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    name[..end].into()
}

/// A route's name in logs and errors.
pub fn shown_name(name: &str) -> &str {
    if name.is_empty() {
        "(default)"
    } else {
        name
    }
}

fn hosts(hosts: Vec<api::HostMatch>) -> Result<Vec<HostMatch>, PolicyError> {
    hosts
        .into_iter()
        .map(|h| match h.r#match {
            Some(api::host_match::Match::Exact(h)) => Ok(HostMatch::Exact(h.to_ascii_lowercase())),
            Some(api::host_match::Match::Suffix(s)) => Ok(HostMatch::Suffix(
                s.reverse_labels
                    .into_iter()
                    .map(|l| l.to_ascii_lowercase())
                    .collect(),
            )),
            None => Err(invalid("host match without a match")),
        })
        .collect()
}

fn header_matches(headers: Vec<api::HeaderMatch>) -> Result<Vec<HeaderMatch>, PolicyError> {
    headers
        .into_iter()
        .map(|h| {
            let name = header_name(&h.name, "header match")?;
            match h.value {
                Some(api::header_match::Value::Exact(v)) => Ok(HeaderMatch::Exact(name, v)),
                Some(api::header_match::Value::Regex(r)) => {
                    Ok(HeaderMatch::Regex(name, regex(&r, "header match")?))
                }
                None => Err(invalid("header match without a value")),
            }
        })
        .collect()
}

fn http_match(m: api::HttpRouteMatch) -> Result<RequestMatch, PolicyError> {
    use api::path_match::Kind;
    let path = match m.path.map(|p| p.kind) {
        None => None,
        Some(None) => return Err(invalid("path match without a kind")),
        Some(Some(Kind::Exact(p))) => Some(PathMatch::Exact(p)),
        Some(Some(Kind::Prefix(p))) => Some(PathMatch::Prefix(p)),
        Some(Some(Kind::Regex(r))) => Some(PathMatch::Regex(regex(&r, "path match")?)),
    };
    let query = m
        .query_params
        .into_iter()
        .map(|q| match q.value {
            Some(api::query_param_match::Value::Exact(v)) => Ok(QueryMatch::Exact(q.name, v)),
            Some(api::query_param_match::Value::Regex(r)) => {
                Ok(QueryMatch::Regex(q.name, regex(&r, "query match")?))
            }
            None => Err(invalid("query match without a value")),
        })
        .collect::<Result<_, _>>()?;
    let method = m
        .method
        .map(|m| Method::try_from(m).map_err(|e| invalid(format_args!("method match: {e}"))))
        .transpose()?;
    Ok(RequestMatch::Http {
        path,
        headers: header_matches(m.headers)?,
        query,
        method,
    })
}

fn header_pairs(
    headers: Option<linkerd2_proxy_api::http_types::Headers>,
) -> Result<Vec<(HeaderName, HeaderValue)>, PolicyError> {
    headers
        .map(|h| h.headers)
        .unwrap_or_default()
        .into_iter()
        .map(|h| {
            let name = header_name(&h.name, "header modifier")?;
            let value = HeaderValue::from_bytes(&h.value)
                .map_err(|_| invalid(format_args!("header modifier: invalid value for {name}")))?;
            Ok((name, value))
        })
        .collect()
}

fn modifier(
    add: Option<linkerd2_proxy_api::http_types::Headers>,
    set: Option<linkerd2_proxy_api::http_types::Headers>,
    remove: Vec<String>,
) -> Result<HeaderModifier, PolicyError> {
    Ok(HeaderModifier {
        add: header_pairs(add)?,
        set: header_pairs(set)?,
        remove: remove
            .iter()
            .map(|n| header_name(n, "header modifier"))
            .collect::<Result<_, _>>()?,
    })
}

fn ratio(r: Option<api::Ratio>) -> Result<(u32, u32), PolicyError> {
    match r {
        None => Ok((1, 1)),
        Some(r) if r.denominator == 0 => Err(invalid("failure injector: ratio denominator 0")),
        Some(r) => Ok((r.numerator.min(r.denominator), r.denominator)),
    }
}

fn http_filter(f: outbound::http_route::Filter) -> Result<Filter, PolicyError> {
    use outbound::http_route::filter::Kind;
    Ok(
        match f.kind.ok_or_else(|| invalid("filter without a kind"))? {
            Kind::RequestHeaderModifier(m) => {
                Filter::RequestHeaders(modifier(m.add, m.set, m.remove)?)
            }
            Kind::ResponseHeaderModifier(m) => {
                Filter::ResponseHeaders(modifier(m.add, m.set, m.remove)?)
            }
            Kind::Redirect(r) => Filter::Redirect(redirect(r)?),
            Kind::FailureInjector(f) => Filter::Fail(Failure {
                status: u16::try_from(f.status)
                    .ok()
                    .and_then(|s| StatusCode::from_u16(s).ok())
                    .ok_or_else(|| {
                        invalid(format_args!(
                            "failure injector: invalid status {}",
                            f.status
                        ))
                    })?,
                grpc_code: None,
                ratio: ratio(f.ratio)?,
                message: tether_core::truncate::bounded_message(&f.message),
            }),
        },
    )
}

fn grpc_filter(f: outbound::grpc_route::Filter) -> Result<Filter, PolicyError> {
    use outbound::grpc_route::filter::Kind;
    Ok(
        match f.kind.ok_or_else(|| invalid("filter without a kind"))? {
            Kind::RequestHeaderModifier(m) => {
                Filter::RequestHeaders(modifier(m.add, m.set, m.remove)?)
            }
            Kind::FailureInjector(f) => {
                if f.code > 16 {
                    return Err(invalid(format_args!(
                        "failure injector: invalid gRPC code {}",
                        f.code
                    )));
                }
                Filter::Fail(Failure {
                    status: StatusCode::OK,
                    grpc_code: Some(f.code),
                    ratio: ratio(f.ratio)?,
                    message: tether_core::truncate::bounded_message(&f.message),
                })
            }
        },
    )
}

fn redirect(r: api::RequestRedirect) -> Result<Redirect, PolicyError> {
    use linkerd2_proxy_api::http_types::scheme::{Registered, Type};
    let scheme = match r.scheme.and_then(|s| s.r#type) {
        None => None,
        Some(Type::Registered(n)) => Some(
            match Registered::try_from(n).map_err(|_| invalid("redirect: unknown scheme"))? {
                Registered::Http => "http".to_string(),
                Registered::Https => "https".to_string(),
            },
        ),
        Some(Type::Unregistered(s)) => Some(s),
    };
    let status = match r.status {
        0 => StatusCode::MOVED_PERMANENTLY,
        s => u16::try_from(s)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .filter(StatusCode::is_redirection)
            .ok_or_else(|| invalid(format_args!("redirect: invalid status {s}")))?,
    };
    let port = match r.port {
        0 => None,
        p => Some(
            u16::try_from(p).map_err(|_| invalid(format_args!("redirect: invalid port {p}")))?,
        ),
    };
    Ok(Redirect {
        scheme,
        host: (!r.host.is_empty()).then_some(r.host),
        port,
        path: match r.path.and_then(|p| p.replace) {
            None => None,
            Some(api::path_modifier::Replace::Full(p)) => Some(PathModifier::Full(p)),
            Some(api::path_modifier::Replace::Prefix(p)) => Some(PathModifier::Prefix(p)),
        },
        status,
    })
}

fn backend(
    b: Option<outbound::Backend>,
    weight: u32,
    filters: Vec<Filter>,
) -> Result<Backend, PolicyError> {
    use outbound::backend::{endpoint_discovery, Kind};
    let path = match b.and_then(|b| b.kind) {
        Some(Kind::Balancer(p)) => match p.discovery.and_then(|d| d.kind) {
            Some(endpoint_discovery::Kind::Dst(d)) => d.path,
            None => return Err(invalid("backend: balancer without discovery")),
        },
        Some(Kind::Forward(_)) => {
            return Err(invalid(
                "backend: forward (single address) backends are not supported",
            ))
        }
        None => return Err(invalid("backend without a kind")),
    };
    let (host, port) = tether_core::authority::split_host_port(&path).map_err(|e| {
        invalid(format_args!(
            "backend: invalid authority {}: {e}",
            tether_core::truncate::for_log(&path)
        ))
    })?;
    Ok(Backend {
        authority: format!("{}:{port}", host.to_ascii_lowercase()),
        weight,
        filters,
    })
}

/// A distribution of either route kind, read the same way.
macro_rules! backends {
    ($dist:expr, $module:ident, $filter:ident) => {{
        use outbound::$module::distribution::Kind;
        match $dist.and_then(|d| d.kind) {
            None | Some(Kind::Empty(_)) => Backends {
                list: Vec::new(),
                first_available: false,
            },
            Some(Kind::FirstAvailable(f)) => Backends {
                list: f
                    .backends
                    .into_iter()
                    .map(|b| {
                        let filters = b
                            .filters
                            .into_iter()
                            .map($filter)
                            .collect::<Result<_, _>>()?;
                        backend(b.backend, 1, filters)
                    })
                    .collect::<Result<_, PolicyError>>()?,
                first_available: true,
            },
            Some(Kind::RandomAvailable(r)) => Backends {
                list: r
                    .backends
                    .into_iter()
                    .map(|wb| {
                        let b = wb
                            .backend
                            .ok_or_else(|| invalid("weighted backend without a backend"))?;
                        let filters = b
                            .filters
                            .into_iter()
                            .map($filter)
                            .collect::<Result<_, _>>()?;
                        backend(b.backend, wb.weight, filters)
                    })
                    .collect::<Result<_, PolicyError>>()?,
                first_available: false,
            },
        }
    }};
}

fn timeouts(
    t: Option<api::Timeouts>,
    #[allow(deprecated)] legacy: Option<prost_types::Duration>,
) -> Result<Timeouts, PolicyError> {
    let t = t.unwrap_or_default();
    Ok(Timeouts {
        response: duration(t.response, "response timeout")?,
        request: duration(t.request.or(legacy), "request timeout")?,
    })
}

fn retry_common(
    max_retries: u32,
    max_request_bytes: u32,
    timeout: Option<prost_types::Duration>,
    backoff: Option<outbound::ExponentialBackoff>,
    on: RetryOn,
) -> Result<Retry, PolicyError> {
    if max_retries > MAX_ROUTE_RETRIES {
        return Err(invalid(format_args!(
            "retry: max_retries {max_retries} over {MAX_ROUTE_RETRIES}"
        )));
    }
    let backoff = match backoff {
        None => None,
        Some(b) => {
            let min = duration(b.min_backoff, "retry backoff")?.unwrap_or_default();
            let max = duration(b.max_backoff, "retry backoff")?.unwrap_or(min);
            if max < min {
                return Err(invalid("retry backoff: max below min"));
            }
            Some((min, max))
        }
    };
    Ok(Retry {
        max_retries,
        max_request_bytes: if max_request_bytes == 0 {
            crate::retry::MAX_BODY as u32
        } else {
            max_request_bytes.min(MAX_RETRY_BODY)
        },
        on,
        timeout: duration(timeout, "retry timeout")?.filter(|t| !t.is_zero()),
        backoff,
    })
}

impl Route {
    fn from_http(r: outbound::HttpRoute) -> Result<Self, PolicyError> {
        let name = route_name(r.metadata);
        let in_route = |e: PolicyError| invalid(format_args!("route {}: {e}", shown_name(&name)));
        if r.rules.is_empty() {
            return Err(in_route(invalid("no rules")));
        }
        let rules = r
            .rules
            .into_iter()
            .map(|rule| {
                #[allow(deprecated)]
                let legacy = rule.request_timeout;
                let retry = rule
                    .retry
                    .map(|r| {
                        let ranges = r
                            .conditions
                            .ok_or_else(|| invalid("retry without conditions"))?
                            .status_ranges
                            .into_iter()
                            .map(|s| {
                                let (start, end) = (s.start, s.end);
                                if start == 0 || end == 0 || end > 599 || start > end {
                                    return Err(invalid(format_args!(
                                        "retry: invalid status range {start}-{end}"
                                    )));
                                }
                                Ok(start as u16..=end as u16)
                            })
                            .collect::<Result<_, _>>()?;
                        retry_common(
                            r.max_retries,
                            r.max_request_bytes,
                            r.timeout,
                            r.backoff,
                            RetryOn::Status(ranges),
                        )
                    })
                    .transpose()?;
                Ok(Rule {
                    matches: rule
                        .matches
                        .into_iter()
                        .map(http_match)
                        .collect::<Result<_, _>>()?,
                    filters: rule
                        .filters
                        .into_iter()
                        .map(http_filter)
                        .collect::<Result<_, _>>()?,
                    backends: backends!(rule.backends, http_route, http_filter),
                    timeouts: timeouts(rule.timeouts, legacy)?,
                    retry,
                    grpc: false,
                })
            })
            .collect::<Result<_, PolicyError>>()
            .map_err(in_route)?;
        Ok(Route {
            hosts: hosts(r.hosts).map_err(in_route)?,
            name,
            rules,
        })
    }

    fn from_grpc(r: outbound::GrpcRoute) -> Result<Self, PolicyError> {
        let name = route_name(r.metadata);
        let in_route = |e: PolicyError| invalid(format_args!("route {}: {e}", shown_name(&name)));
        if r.rules.is_empty() {
            return Err(in_route(invalid("no rules")));
        }
        let rules = r
            .rules
            .into_iter()
            .map(|rule| {
                #[allow(deprecated)]
                let legacy = rule.request_timeout;
                let retry = rule
                    .retry
                    .map(|r| {
                        let c = r
                            .conditions
                            .ok_or_else(|| invalid("retry without conditions"))?;
                        let codes = [
                            (c.cancelled, 1),
                            (c.deadine_exceeded, 4),
                            (c.resource_exhausted, 8),
                            (c.internal, 13),
                            (c.unavailable, 14),
                        ]
                        .into_iter()
                        .filter_map(|(on, code)| on.then_some(code))
                        .collect();
                        retry_common(
                            r.max_retries,
                            r.max_request_bytes,
                            r.timeout,
                            r.backoff,
                            RetryOn::GrpcCodes(codes),
                        )
                    })
                    .transpose()?;
                let matches = rule
                    .matches
                    .into_iter()
                    .map(grpc_match)
                    .collect::<Result<_, PolicyError>>()?;
                Ok(Rule {
                    matches,
                    filters: rule
                        .filters
                        .into_iter()
                        .map(grpc_filter)
                        .collect::<Result<_, _>>()?,
                    backends: backends!(rule.backends, grpc_route, grpc_filter),
                    timeouts: timeouts(rule.timeouts, legacy)?,
                    retry,
                    grpc: true,
                })
            })
            .collect::<Result<_, PolicyError>>()
            .map_err(in_route)?;
        Ok(Route {
            hosts: hosts(r.hosts).map_err(in_route)?,
            name,
            rules,
        })
    }

    /// A route of an inbound server (`InboundServerPolicies`), matched as
    /// outbound routes are; it carries no filters, backends, timeouts or
    /// retries (the inbound forwards to its one app). `rules` are each
    /// rule's matches.
    pub fn inbound_http(
        name: Arc<str>,
        hosts_: Vec<api::HostMatch>,
        rules: Vec<Vec<api::HttpRouteMatch>>,
    ) -> Result<Self, PolicyError> {
        Self::inbound(name, hosts_, rules, http_match, false)
    }

    /// As [`Route::inbound_http`], for a gRPC route.
    pub fn inbound_grpc(
        name: Arc<str>,
        hosts_: Vec<api::HostMatch>,
        rules: Vec<Vec<grpc_api::GrpcRouteMatch>>,
    ) -> Result<Self, PolicyError> {
        Self::inbound(name, hosts_, rules, grpc_match, true)
    }

    fn inbound<M>(
        name: Arc<str>,
        hosts_: Vec<api::HostMatch>,
        rules: Vec<Vec<M>>,
        convert: fn(M) -> Result<RequestMatch, PolicyError>,
        grpc: bool,
    ) -> Result<Self, PolicyError> {
        let in_route = |e: PolicyError| invalid(format_args!("route {}: {e}", shown_name(&name)));
        if rules.is_empty() {
            return Err(in_route(invalid("no rules")));
        }
        let rules = rules
            .into_iter()
            .map(|matches| {
                Ok(Rule {
                    matches: matches.into_iter().map(convert).collect::<Result<_, _>>()?,
                    filters: Vec::new(),
                    backends: Backends {
                        list: Vec::new(),
                        first_available: false,
                    },
                    timeouts: Timeouts::default(),
                    retry: None,
                    grpc,
                })
            })
            .collect::<Result<_, PolicyError>>()
            .map_err(in_route)?;
        Ok(Route {
            hosts: hosts(hosts_).map_err(in_route)?,
            name,
            rules,
        })
    }
}

fn grpc_match(m: grpc_api::GrpcRouteMatch) -> Result<RequestMatch, PolicyError> {
    let rpc = m.rpc.ok_or_else(|| invalid("gRPC match without rpc"))?;
    Ok(RequestMatch::Grpc {
        service: (!rpc.service.is_empty()).then_some(rpc.service),
        method: (!rpc.method.is_empty()).then_some(rpc.method),
        headers: header_matches(m.headers)?,
    })
}

// === matching ===

/// How well a host matched: exact over suffix, then longer.
type HostRank = Option<(u8, usize)>;
/// How well a rule matched (see the module doc); compared as a tuple.
type MatchRank = (usize, usize, usize, usize, usize);

impl HostMatch {
    fn rank(&self, host: &str) -> HostRank {
        let host = host.strip_suffix('.').unwrap_or(host);
        match self {
            HostMatch::Exact(h) => h.eq_ignore_ascii_case(host).then_some((1, h.len())),
            HostMatch::Suffix(labels) => {
                let mut rest = host;
                let mut len = 0;
                for label in labels {
                    let head = rest.len().checked_sub(label.len())?;
                    if !rest.is_char_boundary(head) || !rest[head..].eq_ignore_ascii_case(label) {
                        return None;
                    }
                    rest = rest[..head].strip_suffix('.')?;
                    len += label.len() + 1;
                }
                Some((0, len))
            }
        }
    }
}

fn headers_match(matches: &[HeaderMatch], headers: &HeaderMap) -> bool {
    matches.iter().all(|m| match m {
        HeaderMatch::Exact(name, value) => headers
            .get_all(name)
            .iter()
            .any(|v| v.as_bytes() == value.as_slice()),
        HeaderMatch::Regex(name, re) => headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| re.is_match(v)),
    })
}

/// `%XX` and `+` decoded, as form-urlencoded query strings are written.
fn decode_query_part(s: &str) -> String {
    let hex = |b: u8| (b as char).to_digit(16);
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => match (
                bytes.get(i + 1).and_then(|b| hex(*b)),
                bytes.get(i + 2).and_then(|b| hex(*b)),
            ) {
                (Some(hi), Some(lo)) => {
                    out.push((hi * 16 + lo) as u8);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_matches(matches: &[QueryMatch], query: Option<&str>) -> bool {
    if matches.is_empty() {
        return true;
    }
    let Some(query) = query else {
        return false;
    };
    let pairs: Vec<(String, String)> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode_query_part(k), decode_query_part(v))
        })
        .collect();
    matches.iter().all(|m| {
        pairs.iter().any(|(k, v)| match m {
            QueryMatch::Exact(name, value) => k == name && v == value,
            QueryMatch::Regex(name, re) => k == name && re.is_match(v),
        })
    })
}

impl PathMatch {
    /// Whether the match is exact, and the length matched; `None`: no
    /// match.
    fn rank(&self, path: &str) -> Option<(usize, usize)> {
        match self {
            PathMatch::Exact(p) => (p == path).then_some((1, p.len())),
            PathMatch::Regex(re) => re.is_match(path).then_some((0, path.len())),
            PathMatch::Prefix(p) if p == "/" => Some((0, 1)),
            PathMatch::Prefix(p) => {
                let p = p.trim_end_matches('/');
                let rest = path.trim_end_matches('/').strip_prefix(p)?;
                (rest.is_empty() || rest.starts_with('/')).then_some((0, p.len()))
            }
        }
    }
}

impl RequestMatch {
    fn rank<B>(&self, req: &http::Request<B>) -> Option<MatchRank> {
        match self {
            RequestMatch::Http {
                path,
                headers,
                query,
                method,
            } => {
                let method_rank = match method {
                    Some(m) if m != req.method() => return None,
                    Some(_) => 1,
                    None => 0,
                };
                let (exact, path_len) = match path {
                    Some(p) => p.rank(req.uri().path())?,
                    None => (0, 1),
                };
                if !headers_match(headers, req.headers())
                    || !query_matches(query, req.uri().query())
                {
                    return None;
                }
                Some((exact, path_len, method_rank, headers.len(), query.len()))
            }
            RequestMatch::Grpc {
                service,
                method,
                headers,
            } => {
                if req.method() != Method::POST {
                    return None;
                }
                let mut parts = req.uri().path().split('/');
                if !parts.next()?.is_empty() {
                    return None;
                }
                let (svc, meth) = (parts.next()?, parts.next()?);
                let service_rank = match service {
                    Some(s) if s != svc => return None,
                    Some(s) => s.len(),
                    None => 0,
                };
                let method_rank = match method {
                    Some(m) if m != meth => return None,
                    Some(m) => m.len(),
                    None => 0,
                };
                if !headers_match(headers, req.headers()) {
                    return None;
                }
                Some((service_rank, method_rank, headers.len(), 0, 0))
            }
        }
    }

    fn prefix(&self) -> Option<&str> {
        match self {
            RequestMatch::Http {
                path: Some(PathMatch::Prefix(p)),
                ..
            } => Some(p),
            _ => None,
        }
    }
}

impl Rule {
    /// The rule's best match for `req` (a rule without matches matches
    /// everything, as a `/` prefix would).
    fn rank<B>(&self, req: &http::Request<B>) -> Option<(MatchRank, Option<&str>)> {
        if self.matches.is_empty() {
            let implicit = if self.grpc {
                (0, 0, 0, 0, 0)
            } else {
                (0, 1, 0, 0, 0)
            };
            return Some((implicit, None));
        }
        best(
            self.matches
                .iter()
                .filter_map(|m| m.rank(req).map(|r| (r, m.prefix()))),
        )
    }
}

/// The greatest by the key; the first of equals.
fn best<K: Ord, V>(items: impl Iterator<Item = (K, V)>) -> Option<(K, V)> {
    items.reduce(|a, b| if a.0 >= b.0 { a } else { b })
}

/// The route and rule for `req`, addressed to `host`; `None`: no route
/// matches.
pub fn select<'r, B>(
    routes: &'r [Route],
    req: &http::Request<B>,
    host: &str,
) -> Option<Selected<'r>> {
    let found = best(routes.iter().filter_map(|route| {
        let host_rank: HostRank = if route.hosts.is_empty() {
            None
        } else {
            Some(route.hosts.iter().filter_map(|h| h.rank(host)).max()?)
        };
        let (rank, (rule, prefix)) = best(
            route
                .rules
                .iter()
                .filter_map(|rule| rule.rank(req).map(|(r, p)| (r, (rule, p)))),
        )?;
        Some(((host_rank, rank), (route, rule, prefix)))
    }))?;
    let (_, (route, rule, prefix)) = found;
    Some(Selected {
        route,
        rule,
        prefix,
    })
}

impl Rule {
    /// Whether a filter of the rule or of one of its backends redirects.
    pub fn may_redirect(&self) -> bool {
        self.filters
            .iter()
            .chain(self.backends.list.iter().flat_map(|b| &b.filters))
            .any(|f| matches!(f, Filter::Redirect(_)))
    }
}

// === filters ===

impl HeaderModifier {
    /// Adds, then sets, then removes, as the Gateway API orders them.
    pub fn apply(&self, headers: &mut HeaderMap) {
        for (n, v) in &self.add {
            headers.append(n.clone(), v.clone());
        }
        for (n, v) in &self.set {
            headers.insert(n.clone(), v.clone());
        }
        for n in &self.remove {
            headers.remove(n);
        }
    }
}

impl Failure {
    /// Whether this request is one of those that fail.
    pub fn fires(&self) -> bool {
        let (num, den) = self.ratio;
        num == den || rand::random_range(0..den) < num
    }
}

impl Redirect {
    /// The `Location` for a request for `path_and_query` at `authority`
    /// (`host[:port]`) by `scheme`; `prefix` is the path prefix the rule
    /// matched.
    pub fn location(
        &self,
        scheme: &str,
        authority: &str,
        path_and_query: &str,
        prefix: Option<&str>,
    ) -> Result<String, String> {
        let (path, query) = match path_and_query.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (path_and_query, None),
        };
        let orig: http::uri::Authority = authority
            .parse()
            .map_err(|_| "the request's authority is not valid".to_string())?;
        let scheme = self.scheme.as_deref().unwrap_or(scheme);
        let host = self.host.as_deref().unwrap_or(orig.host());
        let default_port =
            |p: u16| (scheme == "http" && p == 80) || (scheme == "https" && p == 443);
        let port = match self.port {
            Some(p) => Some(p),
            // A changed scheme implies its own default port.
            None if self.scheme.is_some() => None,
            None => orig.port_u16(),
        }
        .filter(|p| !default_port(*p));
        let path = match &self.path {
            None => path.to_string(),
            Some(PathModifier::Full(p)) => p.clone(),
            Some(PathModifier::Prefix(new)) => {
                let Some(matched) = prefix else {
                    return Err("a prefix redirect needs a path prefix match".into());
                };
                let rest = path
                    .strip_prefix(matched.trim_end_matches('/'))
                    .unwrap_or(path);
                let new = new.trim_end_matches('/');
                match (new.is_empty(), rest.is_empty()) {
                    (true, true) => "/".into(),
                    (_, true) => new.to_string(),
                    _ => format!("{new}{rest}"),
                }
            }
        };
        let mut location = match port {
            Some(p) => format!("{scheme}://{host}:{p}{path}"),
            None => format!("{scheme}://{host}{path}"),
        };
        if let Some(q) = query {
            location.push('?');
            location.push_str(q);
        }
        Ok(location)
    }
}

impl Backends {
    /// One backend by weight (zero-weight ones never), or the first with
    /// endpoints when `has_endpoints` says so (first-available); `None`
    /// when there is none to send to.
    pub fn pick(&self, has_endpoints: impl Fn(&str) -> bool) -> Option<&Backend> {
        if self.first_available {
            // One backend is the one whatever `has_endpoints` says: no
            // lookup per request for it.
            if let [only] = &self.list[..] {
                return Some(only);
            }
            return self
                .list
                .iter()
                .find(|b| has_endpoints(&b.authority))
                .or(self.list.first());
        }
        if let [only] = &self.list[..] {
            // No draw needed (nor the thread's random generator).
            return (only.weight > 0).then_some(only);
        }
        let total: u64 = self.list.iter().map(|b| u64::from(b.weight)).sum();
        if total == 0 {
            return None;
        }
        let mut draw = rand::random_range(0..total);
        self.list.iter().find(|b| {
            let w = u64::from(b.weight);
            if draw < w {
                true
            } else {
                draw -= w;
                false
            }
        })
    }
}

impl Retry {
    /// Whether the route retries a response like `rsp`.
    pub fn on_response<B>(&self, rsp: &http::Response<B>) -> bool {
        match &self.on {
            RetryOn::Status(ranges) => {
                let s = rsp.status().as_u16();
                ranges.iter().any(|r| r.contains(&s))
            }
            // Only a trailers-only answer says its status in the headers;
            // one that streams a body says it at its end, too late.
            RetryOn::GrpcCodes(codes) => {
                crate::classify::grpc_status(rsp.headers()).is_some_and(|c| codes.contains(&c))
            }
        }
    }

    /// The pause before retry number `n` (from 1).
    pub fn pause(&self, n: u32) -> Duration {
        let Some((min, max)) = self.backoff else {
            return Duration::ZERO;
        };
        let step = min
            .saturating_mul(1 << n.saturating_sub(1).min(16))
            .min(max);
        tether_core::backoff::jittered(step, rand::random())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use linkerd2_proxy_api::http_route::{path_match, HttpRouteMatch};
    use outbound::{http_route as hr, proxy_protocol};

    pub(crate) fn backend_to(path: &str, weight: u32) -> hr::WeightedRouteBackend {
        use outbound::backend::{endpoint_discovery, BalanceP2c, EndpointDiscovery};
        hr::WeightedRouteBackend {
            weight,
            backend: Some(hr::RouteBackend {
                backend: Some(outbound::Backend {
                    kind: Some(outbound::backend::Kind::Balancer(BalanceP2c {
                        discovery: Some(EndpointDiscovery {
                            kind: Some(endpoint_discovery::Kind::Dst(
                                endpoint_discovery::DestinationGet { path: path.into() },
                            )),
                        }),
                        load: None,
                    })),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        }
    }

    pub(crate) fn rule(matches: Vec<HttpRouteMatch>, backends: &[(&str, u32)]) -> hr::Rule {
        hr::Rule {
            matches,
            backends: Some(hr::Distribution {
                kind: Some(hr::distribution::Kind::RandomAvailable(
                    hr::distribution::RandomAvailable {
                        backends: backends.iter().map(|(p, w)| backend_to(p, *w)).collect(),
                    },
                )),
            }),
            ..Default::default()
        }
    }

    pub(crate) fn route(name: &str, rules: Vec<hr::Rule>) -> outbound::HttpRoute {
        outbound::HttpRoute {
            metadata: Some(meta::Metadata {
                kind: Some(meta::metadata::Kind::Resource(meta::Resource {
                    name: name.into(),
                    kind: "HTTPRoute".into(),
                    ..Default::default()
                })),
            }),
            hosts: vec![],
            rules,
        }
    }

    pub(crate) fn detect(routes: Vec<outbound::HttpRoute>) -> outbound::OutboundPolicy {
        outbound::OutboundPolicy {
            protocol: Some(outbound::ProxyProtocol {
                kind: Some(proxy_protocol::Kind::Detect(proxy_protocol::Detect {
                    timeout: None,
                    opaque: None,
                    http1: Some(proxy_protocol::Http1 {
                        routes: routes.clone(),
                        failure_accrual: None,
                    }),
                    http2: Some(proxy_protocol::Http2 {
                        routes,
                        failure_accrual: None,
                    }),
                })),
            }),
            metadata: None,
        }
    }

    fn path(kind: path_match::Kind) -> HttpRouteMatch {
        HttpRouteMatch {
            path: Some(api::PathMatch { kind: Some(kind) }),
            ..Default::default()
        }
    }

    fn req(method: &str, uri: &str, headers: &[(&str, &str)]) -> http::Request<()> {
        let mut b = http::Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap()
    }

    fn chosen(policy: &ClientPolicy, r: &http::Request<()>) -> Option<String> {
        let routes = policy.routes(http::Version::HTTP_11).unwrap();
        select(routes, r, "web.demo.svc.cluster.local")
            .map(|s| s.rule.backends.list[0].authority.clone())
    }

    #[test]
    fn precedence_follows_the_gateway_api() {
        use path_match::Kind::*;
        let header = |n: &str, v: &str| api::HeaderMatch {
            name: n.into(),
            value: Some(api::header_match::Value::Exact(v.as_bytes().to_vec())),
        };
        let routes = vec![
            route(
                "paths",
                vec![
                    rule(vec![path(Prefix("/api".into()))], &[("prefix:80", 1)]),
                    rule(vec![path(Prefix("/api/v2".into()))], &[("longer:80", 1)]),
                    rule(vec![path(Regex(r"/api/v\d/[a-z]+".into()))], &[("regex:80", 1)]),
                    rule(vec![path(Exact("/api/v2/x".into()))], &[("exact:80", 1)]),
                ],
            ),
            route(
                "others",
                vec![
                    rule(
                        vec![HttpRouteMatch {
                            path: Some(api::PathMatch {
                                kind: Some(Prefix("/api".into())),
                            }),
                            headers: vec![header("x-canary", "1")],
                            ..Default::default()
                        }],
                        &[("header:80", 1)],
                    ),
                    rule(
                        vec![HttpRouteMatch {
                            path: Some(api::PathMatch {
                                kind: Some(Prefix("/api".into())),
                            }),
                            query_params: vec![api::QueryParamMatch {
                                name: "v".into(),
                                value: Some(api::query_param_match::Value::Exact("a b".into())),
                            }],
                            ..Default::default()
                        }],
                        &[("query:80", 1)],
                    ),
                    rule(
                        vec![HttpRouteMatch {
                            path: Some(api::PathMatch {
                                kind: Some(Prefix("/api".into())),
                            }),
                            method: Some(linkerd2_proxy_api::http_types::HttpMethod {
                                r#type: Some(
                                    linkerd2_proxy_api::http_types::http_method::Type::Registered(
                                        linkerd2_proxy_api::http_types::http_method::Registered::Post
                                            as i32,
                                    ),
                                ),
                            }),
                            ..Default::default()
                        }],
                        &[("method:80", 1)],
                    ),
                ],
            ),
        ];
        let p = ClientPolicy::from_api(detect(routes)).unwrap();
        let pick = |m, u, h: &[(&str, &str)]| chosen(&p, &req(m, u, h));
        assert_eq!(pick("GET", "/api/x", &[]).as_deref(), Some("prefix:80"));
        assert_eq!(
            pick("GET", "/apix", &[]),
            None,
            "a prefix matches whole segments"
        );
        assert_eq!(pick("GET", "/api/v2/1", &[]).as_deref(), Some("longer:80"));
        // An exact match beats the regex's whole-path match of the same
        // length; where only the regex matches, its length beats the prefix.
        assert_eq!(pick("GET", "/api/v2/x", &[]).as_deref(), Some("exact:80"));
        assert_eq!(pick("GET", "/api/v2/xyz", &[]).as_deref(), Some("regex:80"));
        assert_eq!(
            pick("GET", "/api/v2/x1", &[]).as_deref(),
            Some("longer:80"),
            "regex is anchored"
        );
        // Same path length: a method match beats header matches, which
        // beat query matches, which beat none.
        assert_eq!(
            pick("POST", "/api/z?v=a+b", &[("x-canary", "1")]).as_deref(),
            Some("method:80")
        );
        assert_eq!(
            pick("GET", "/api/z?v=a+b", &[("x-canary", "1")]).as_deref(),
            Some("header:80")
        );
        assert_eq!(
            pick("GET", "/api/z?v=a%20b", &[]).as_deref(),
            Some("query:80")
        );
        assert_eq!(pick("GET", "/api/z?v=c", &[]).as_deref(), Some("prefix:80"));
    }

    #[test]
    fn host_matches_rank_before_rules() {
        let mut specific = route("specific", vec![rule(vec![], &[("host:80", 1)])]);
        specific.hosts = vec![api::HostMatch {
            r#match: Some(api::host_match::Match::Suffix(api::host_match::Suffix {
                reverse_labels: vec!["local".into(), "cluster".into(), "svc".into()],
            })),
        }];
        let other = route(
            "any",
            vec![rule(
                vec![path(path_match::Kind::Exact("/x".into()))],
                &[("any:80", 1)],
            )],
        );
        let p = ClientPolicy::from_api(detect(vec![other, specific])).unwrap();
        assert_eq!(
            chosen(&p, &req("GET", "/x", &[])).as_deref(),
            Some("host:80")
        );
    }

    #[test]
    fn what_cannot_be_understood_is_refused_with_its_reason() {
        let bad_regex = route(
            "broken",
            vec![rule(
                vec![path(path_match::Kind::Regex("(".into()))],
                &[("a:80", 1)],
            )],
        );
        let e = ClientPolicy::from_api(detect(vec![bad_regex])).unwrap_err();
        assert!(e.to_string().contains("route broken"), "{e}");
        assert!(
            e.to_string().contains("not a valid regular expression"),
            "{e}"
        );
        let huge = route(
            "huge",
            vec![rule(
                vec![path(path_match::Kind::Regex("a{1000}{1000}".into()))],
                &[("a:80", 1)],
            )],
        );
        assert!(ClientPolicy::from_api(detect(vec![huge])).is_err());
        let no_rules = route("empty", vec![]);
        assert!(ClientPolicy::from_api(detect(vec![no_rules])).is_err());
        assert!(ClientPolicy::from_api(outbound::OutboundPolicy::default()).is_err());
    }

    #[test]
    fn weights_split_and_zero_never_wins() {
        let r = route(
            "split",
            vec![rule(vec![], &[("a:80", 9), ("b:80", 1), ("never:80", 0)])],
        );
        let p = ClientPolicy::from_api(detect(vec![r])).unwrap();
        let routes = p.routes(http::Version::HTTP_11).unwrap();
        let backends = &routes[0].rules[0].backends;
        let picks: Vec<&str> = (0..1000)
            .map(|_| backends.pick(|_| true).unwrap().authority.as_str())
            .collect();
        let b = picks.iter().filter(|a| **a == "b:80").count();
        assert!(!picks.contains(&"never:80"));
        // 1000 draws at p = 0.1: sd 9.5; ±50 is over 5 sd.
        assert!((50..=150).contains(&b), "{b}");
    }

    #[test]
    fn first_available_takes_the_first_with_endpoints_and_one_backend_unasked() {
        let backend = |authority: &str| Backend {
            authority: authority.to_string(),
            weight: 0,
            filters: Vec::new(),
        };
        let two = Backends {
            list: vec![backend("a:80"), backend("b:80")],
            first_available: true,
        };
        let pick = |has: &[&str]| two.pick(|a| has.contains(&a)).unwrap().authority.clone();
        assert_eq!(pick(&["a:80", "b:80"]), "a:80");
        assert_eq!(pick(&["b:80"]), "b:80");
        assert_eq!(pick(&[]), "a:80", "none has endpoints: the first");
        let one = Backends {
            list: vec![backend("only:80")],
            first_available: true,
        };
        let asked = std::cell::Cell::new(0);
        let only = one.pick(|_| {
            asked.set(asked.get() + 1);
            false
        });
        assert_eq!(only.unwrap().authority, "only:80");
        assert_eq!(asked.get(), 0, "one backend needs no lookup");
    }

    #[test]
    fn redirect_locations() {
        let r = |scheme: Option<&str>, host: Option<&str>, port, path| Redirect {
            scheme: scheme.map(str::to_string),
            host: host.map(str::to_string),
            port,
            path,
            status: StatusCode::FOUND,
        };
        let plain = r(None, Some("new.demo"), None, None);
        assert_eq!(
            plain
                .location("http", "web.demo:8080", "/a?b=1", None)
                .unwrap(),
            "http://new.demo:8080/a?b=1"
        );
        let https = r(
            Some("https"),
            None,
            None,
            Some(PathModifier::Full("/x".into())),
        );
        assert_eq!(
            https.location("http", "web.demo:8080", "/a", None).unwrap(),
            "https://web.demo/x"
        );
        let prefix = r(
            None,
            None,
            Some(80),
            Some(PathModifier::Prefix("/v2".into())),
        );
        assert_eq!(
            prefix
                .location("http", "web.demo:8080", "/v1/users", Some("/v1"))
                .unwrap(),
            "http://web.demo/v2/users"
        );
        assert!(prefix.location("http", "web.demo", "/v1", None).is_err());
    }
}
