//! Conformance of the served routes: a real `tether control` with routes in
//! its registry, asked over gRPC like linkerd2-proxy asks, each answer
//! decoded with the `linkerd2-proxy-api` types and run through the checks
//! linkerd2-proxy applies when it converts it (`linkerd/proxy/client-policy`:
//! every `InvalidPolicy`, `InvalidBackend`, `InvalidDistribution`,
//! `InvalidRetry`, … is a field a client rejects, and a rejected policy
//! fails every request; `linkerd/service-profiles/src/proto.rs` for
//! profiles), then checked against what the registry says.

use std::net::SocketAddr;
use std::time::Duration;

use linkerd2_proxy_api::destination::{
    destination_client::DestinationClient, request_match, response_match, update,
    DestinationProfile, GetDestination, RequestMatch, ResponseMatch,
};
use linkerd2_proxy_api::http_route::{self as hr, header_match, path_match, query_param_match};
use linkerd2_proxy_api::meta::{metadata, Metadata};
use linkerd2_proxy_api::outbound::{
    self as api, backend, failure_accrual, grpc_route, http_route, opaque_route,
    outbound_policies_client::OutboundPoliciesClient, proxy_protocol, traffic_spec, Backend,
    OutboundPolicy, TrafficSpec,
};
use tether_core::route::compile_regex;

use crate::support::*;

/// What a client waits for an answer here: generous, since the registry is
/// loaded before the control plane serves at all.
const ANSWER: Duration = Duration::from_secs(10);

const REGISTRY: &str = r#"
kind: Service
name: web
namespace: test
cluster_ip: 10.96.0.10
response_timeout: 3s
retry_budget: {ratio: 0.2, min_per_second: 5}
ports: [{port: 80}]
endpoints: [{address: 127.0.0.1:7001}]
---
kind: Service
name: web-v2
namespace: test
ports: [{port: 80}]
endpoints: [{address: 127.0.0.1:7002}]
---
kind: Service
name: greeter
namespace: test
ports: [{port: 9090}]
---
kind: Service
name: db
namespace: test
cluster_ip: 10.96.0.11
ports: [{port: 5432, opaque: true}]
"#;

const WEB_ROUTE: &str = r#"
kind: HTTPRoute
name: web-canary
namespace: test
parentRefs: [{name: web, port: 80}]
rules:
  - backendRefs: [{name: web, weight: 90}, {name: web-v2, weight: 10}]
  - matches:
      - path: {type: PathPrefix, value: /api}
        method: POST
        headers: [{name: x-canary, value: "1"}, {type: RegularExpression, name: x-user, value: "[a-z]+"}]
        queryParams: [{name: debug, value: "1"}]
      - path: {type: RegularExpression, value: "/v[0-9]+/.*"}
    filters:
      - type: RequestHeaderModifier
        requestHeaderModifier: {set: [{name: x-route, value: api}], add: [{name: x-a, value: b}], remove: [x-internal]}
      - type: ResponseHeaderModifier
        responseHeaderModifier: {add: [{name: x-served-by, value: canary}]}
    backendRefs: [{name: web-v2, port: 80}]
    timeouts: {request: 10s, backendRequest: 2s}
    retry: {codes: [502, 503], attempts: 2, backoff: 100ms}
  - matches: [{path: {type: Exact, value: /old}}]
    filters:
      - type: RequestRedirect
        requestRedirect: {scheme: https, hostname: new.example.com, port: 8443, path: {type: ReplaceFullPath, replaceFullPath: /new}, statusCode: 301}
"#;

const GREETER_ROUTE: &str = r#"
kind: GRPCRoute
name: greeter
namespace: test
parentRefs: [{name: greeter}]
rules:
  - matches: [{method: {service: demo.Greeter, method: SayHello}, headers: [{name: x-canary, value: "1"}]}]
    filters: [{type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: x-route, value: hello}]}}]
    timeouts: {request: 1s}
    retry: {codes: [UNAVAILABLE, RESOURCE_EXHAUSTED], attempts: 3}
  - {}
"#;

// === What linkerd2-proxy checks (client-policy's TryFrom conversions) ===

type Check = Result<(), String>;

fn need<T>(value: Option<T>, what: &str) -> Result<T, String> {
    value.ok_or_else(|| format!("missing {what}"))
}

fn duration(d: Option<&prost_types::Duration>, what: &str) -> Result<Duration, String> {
    Duration::try_from(*need(d, what)?).map_err(|e| format!("invalid {what}: {e}"))
}

fn optional_duration(d: Option<&prost_types::Duration>, what: &str) -> Check {
    if let Some(d) = d {
        Duration::try_from(*d).map_err(|e| format!("invalid {what}: {e}"))?;
    }
    Ok(())
}

/// `TryFrom<meta::Metadata> for Meta`.
fn check_meta(m: Option<&Metadata>, what: &str) -> Check {
    match need(
        m.and_then(|m| m.kind.as_ref()),
        &format!("{what} metadata kind"),
    )? {
        metadata::Kind::Default(_) => Ok(()),
        metadata::Kind::Resource(r) => {
            for (field, value) in [
                ("group", &r.group),
                ("kind", &r.kind),
                ("name", &r.name),
                ("namespace", &r.namespace),
            ] {
                if value.is_empty() {
                    return Err(format!("{what} metadata: {field} must not be empty"));
                }
            }
            Ok(())
        }
    }
}

fn check_backoff(b: Option<&api::ExponentialBackoff>, what: &str) -> Check {
    let b = need(b, what)?;
    let min = duration(b.min_backoff.as_ref(), "min_backoff")?;
    let max = duration(b.max_backoff.as_ref(), "max_backoff")?;
    if min > max || !(0.0..=100.0).contains(&b.jitter_ratio) {
        return Err(format!("invalid {what}: {b:?}"));
    }
    Ok(())
}

/// `TryFrom<outbound::Backend> for Backend`: metadata, a balancer with
/// discovery and load, a queue with a fail-fast timeout. Returns the
/// `Destination.Get` path.
fn check_backend(b: Option<&Backend>) -> Result<String, String> {
    let b = need(b, "backend")?;
    check_meta(b.metadata.as_ref(), "backend")?;
    let queue = need(b.queue.as_ref(), "queue")?;
    duration(queue.failfast_timeout.as_ref(), "queue failfast timeout")?;
    match need(b.kind.as_ref(), "backend dispatcher")? {
        backend::Kind::Balancer(p2c) => {
            let discovery = need(p2c.discovery.as_ref(), "balancer discovery")?;
            let path = match need(discovery.kind.as_ref(), "discovery kind")? {
                backend::endpoint_discovery::Kind::Dst(d) => d.path.clone(),
            };
            match need(p2c.load.as_ref(), "balancer load")? {
                backend::balance_p2c::Load::PeakEwma(e) => {
                    duration(e.default_rtt.as_ref(), "peak EWMA default RTT")?;
                    duration(e.decay.as_ref(), "peak EWMA decay")?;
                }
                backend::balance_p2c::Load::PenaltyPeakEwma(_) => {}
            }
            Ok(path)
        }
        backend::Kind::Forward(_) => Err("a forward backend for a service".into()),
    }
}

fn check_accrual(a: Option<&api::FailureAccrual>) -> Check {
    let Some(a) = a else { return Ok(()) };
    match need(a.kind.as_ref(), "failure accrual kind")? {
        failure_accrual::Kind::ConsecutiveFailures(c) => {
            check_backoff(c.backoff.as_ref(), "consecutive failures backoff")
        }
        failure_accrual::Kind::Unified(u) => check_backoff(u.backoff.as_ref(), "unified backoff"),
    }
}

fn check_header_name(name: &str) -> Check {
    http::HeaderName::from_bytes(name.as_bytes())
        .map(drop)
        .map_err(|e| format!("header name {name:?}: {e}"))
}

fn check_headers(h: Option<&linkerd2_proxy_api::http_types::Headers>) -> Check {
    for h in h.map(|h| h.headers.as_slice()).unwrap_or_default() {
        check_header_name(&h.name)?;
        http::HeaderValue::from_bytes(&h.value).map_err(|e| format!("header value: {e}"))?;
    }
    Ok(())
}

fn check_header_match(m: &hr::HeaderMatch) -> Check {
    check_header_name(&m.name)?;
    match need(m.value.as_ref(), "header match value")? {
        header_match::Value::Exact(v) => {
            http::HeaderValue::from_bytes(v).map_err(|e| format!("header match: {e}"))?;
        }
        header_match::Value::Regex(r) => {
            compile_regex(r)?;
        }
    }
    Ok(())
}

/// `MatchRequest::try_from` (linkerd-http-route).
fn check_http_match(m: &hr::HttpRouteMatch) -> Check {
    if let Some(p) = &m.path {
        match need(p.kind.as_ref(), "path match kind")? {
            path_match::Kind::Exact(p) | path_match::Kind::Prefix(p) => {
                if !p.starts_with('/') {
                    return Err(format!("path {p:?} is not absolute"));
                }
            }
            path_match::Kind::Regex(r) => {
                compile_regex(r)?;
            }
        }
    }
    for h in &m.headers {
        check_header_match(h)?;
    }
    for q in &m.query_params {
        match need(q.value.as_ref(), "query param value")? {
            query_param_match::Value::Exact(_) => {}
            query_param_match::Value::Regex(r) => {
                compile_regex(r)?;
            }
        }
    }
    if let Some(method) = &m.method {
        http::Method::try_from(method.clone()).map_err(|e| format!("method: {e}"))?;
    }
    Ok(())
}

fn check_timeouts(t: Option<&hr::Timeouts>) -> Check {
    if let Some(t) = t {
        optional_duration(t.response.as_ref(), "response timeout")?;
        optional_duration(t.request.as_ref(), "request timeout")?;
        optional_duration(t.idle.as_ref(), "idle timeout")?;
    }
    Ok(())
}

fn check_http_filter(f: &http_route::Filter) -> Check {
    use http_route::filter::Kind;
    match need(f.kind.as_ref(), "filter kind")? {
        Kind::RequestHeaderModifier(m) => {
            check_headers(m.add.as_ref())?;
            check_headers(m.set.as_ref())?;
            m.remove.iter().try_for_each(|n| check_header_name(n))
        }
        Kind::ResponseHeaderModifier(m) => {
            check_headers(m.add.as_ref())?;
            check_headers(m.set.as_ref())?;
            m.remove.iter().try_for_each(|n| check_header_name(n))
        }
        Kind::Redirect(r) => {
            if r.status != 0 && !(300..400).contains(&r.status) {
                return Err(format!("redirect status {}", r.status));
            }
            if let Some(s) = &r.scheme {
                let scheme: Result<std::borrow::Cow<'static, str>, _> =
                    need(s.r#type.as_ref(), "scheme type")?.try_into();
                scheme.map_err(|e| format!("redirect scheme: {e}"))?;
            }
            if let Some(p) = &r.path {
                need(p.replace.as_ref(), "redirect path replacement")?;
            }
            u16::try_from(r.port).map_err(|_| "redirect port".to_string())?;
            Ok(())
        }
        Kind::FailureInjector(_) => Err("Tether never sends failure injectors".into()),
    }
}

/// A distribution's backends (Dst paths with weights); empty is refused.
fn check_distribution<B>(
    kind: Option<&B>,
    backends: impl FnOnce(&B) -> Result<Vec<(Option<&Backend>, u32)>, String>,
) -> Result<Vec<(String, u32)>, String> {
    let listed = backends(need(kind, "distribution kind")?)?;
    listed
        .into_iter()
        .map(|(b, w)| Ok((check_backend(b)?, w)))
        .collect()
}

fn http_backends(d: Option<&http_route::Distribution>) -> Result<Vec<(String, u32)>, String> {
    use http_route::distribution::Kind;
    check_distribution(need(d, "distribution")?.kind.as_ref(), |k| match k {
        Kind::Empty(_) => Ok(vec![]),
        Kind::FirstAvailable(f) if f.backends.is_empty() => {
            Err("a FirstAvailable distribution may not be empty".into())
        }
        Kind::FirstAvailable(f) => Ok(f.backends.iter().map(|b| (b.backend.as_ref(), 1)).collect()),
        Kind::RandomAvailable(r) if r.backends.is_empty() => {
            Err("a RandomAvailable distribution may not be empty".into())
        }
        Kind::RandomAvailable(r) => r
            .backends
            .iter()
            .map(|w| {
                let rb = need(w.backend.as_ref(), "weighted backend")?;
                Ok((rb.backend.as_ref(), w.weight))
            })
            .collect(),
    })
}

fn grpc_backends(d: Option<&grpc_route::Distribution>) -> Result<Vec<(String, u32)>, String> {
    use grpc_route::distribution::Kind;
    check_distribution(need(d, "distribution")?.kind.as_ref(), |k| match k {
        Kind::Empty(_) => Ok(vec![]),
        Kind::FirstAvailable(f) if f.backends.is_empty() => Err("empty FirstAvailable".into()),
        Kind::FirstAvailable(f) => Ok(f.backends.iter().map(|b| (b.backend.as_ref(), 1)).collect()),
        Kind::RandomAvailable(r) if r.backends.is_empty() => Err("empty RandomAvailable".into()),
        Kind::RandomAvailable(r) => r
            .backends
            .iter()
            .map(|w| {
                let rb = need(w.backend.as_ref(), "weighted backend")?;
                Ok((rb.backend.as_ref(), w.weight))
            })
            .collect(),
    })
}

fn opaque_backends(d: Option<&opaque_route::Distribution>) -> Result<Vec<(String, u32)>, String> {
    use opaque_route::distribution::Kind;
    check_distribution(need(d, "distribution")?.kind.as_ref(), |k| match k {
        Kind::Empty(_) => Ok(vec![]),
        Kind::FirstAvailable(f) if f.backends.is_empty() => Err("empty FirstAvailable".into()),
        Kind::FirstAvailable(f) => Ok(f.backends.iter().map(|b| (b.backend.as_ref(), 1)).collect()),
        Kind::RandomAvailable(r) if r.backends.is_empty() => Err("empty RandomAvailable".into()),
        Kind::RandomAvailable(r) => r
            .backends
            .iter()
            .map(|w| {
                let rb = need(w.backend.as_ref(), "weighted backend")?;
                Ok((rb.backend.as_ref(), w.weight))
            })
            .collect(),
    })
}

fn check_http_retry(r: Option<&http_route::Retry>) -> Check {
    let Some(r) = r else { return Ok(()) };
    let conditions = need(r.conditions.as_ref(), "retry conditions")?;
    for range in &conditions.status_ranges {
        if range.start == 0 || range.end == 0 || range.end > 599 || range.start > range.end {
            return Err(format!("retry status range {range:?}"));
        }
    }
    u16::try_from(r.max_retries).map_err(|_| "max retries".to_string())?;
    if r.backoff.is_some() {
        check_backoff(r.backoff.as_ref(), "retry backoff")?;
    }
    optional_duration(r.timeout.as_ref(), "retry timeout")
}

/// Every check a client makes on a policy; returns every backend's
/// `Destination.Get` path (with its weight) in order.
fn check_policy(p: &OutboundPolicy) -> Result<Vec<(String, u32)>, String> {
    check_meta(p.metadata.as_ref(), "policy")?;
    let protocol = need(p.protocol.as_ref(), "protocol")?;
    let mut backends = Vec::new();
    let mut http = |routes: &[api::HttpRoute], accrual| -> Check {
        check_accrual(accrual)?;
        for route in routes {
            check_meta(route.metadata.as_ref(), "route")?;
            if route.rules.is_empty() {
                return Err("a route must have at least one rule".into());
            }
            for rule in &route.rules {
                rule.matches.iter().try_for_each(check_http_match)?;
                rule.filters.iter().try_for_each(check_http_filter)?;
                backends.extend(http_backends(rule.backends.as_ref())?);
                check_timeouts(rule.timeouts.as_ref())?;
                check_http_retry(rule.retry.as_ref())?;
            }
        }
        Ok(())
    };
    match need(protocol.kind.as_ref(), "protocol kind")? {
        proxy_protocol::Kind::Detect(d) => {
            duration(d.timeout.as_ref(), "detect timeout")?;
            let h1 = need(d.http1.as_ref(), "Detect HTTP/1 configuration")?;
            let h2 = need(d.http2.as_ref(), "Detect HTTP/2 configuration")?;
            http(&h1.routes, h1.failure_accrual.as_ref())?;
            http(&h2.routes, h2.failure_accrual.as_ref())?;
            let opaque = need(d.opaque.as_ref(), "Detect opaque configuration")?;
            for r in &opaque.routes {
                check_meta(r.metadata.as_ref(), "opaque route")?;
                for rule in &r.rules {
                    backends.extend(opaque_backends(rule.backends.as_ref())?);
                }
            }
        }
        proxy_protocol::Kind::Opaque(o) => {
            for r in &o.routes {
                check_meta(r.metadata.as_ref(), "opaque route")?;
                for rule in &r.rules {
                    backends.extend(opaque_backends(rule.backends.as_ref())?);
                }
            }
        }
        proxy_protocol::Kind::Grpc(g) => {
            check_accrual(g.failure_accrual.as_ref())?;
            for route in &g.routes {
                check_meta(route.metadata.as_ref(), "route")?;
                if route.rules.is_empty() {
                    return Err("a route must have at least one rule".into());
                }
                for rule in &route.rules {
                    for m in &rule.matches {
                        // `pb.rpc.ok_or(InvalidRouteMatch::MissingRpc)`
                        need(m.rpc.as_ref(), "RPC match")?;
                        m.headers.iter().try_for_each(check_header_match)?;
                    }
                    for f in &rule.filters {
                        match need(f.kind.as_ref(), "filter kind")? {
                            grpc_route::filter::Kind::RequestHeaderModifier(m) => {
                                check_headers(m.add.as_ref())?;
                                check_headers(m.set.as_ref())?;
                            }
                            grpc_route::filter::Kind::FailureInjector(_) => {
                                return Err("Tether never sends failure injectors".into())
                            }
                        }
                    }
                    backends.extend(grpc_backends(rule.backends.as_ref())?);
                    check_timeouts(rule.timeouts.as_ref())?;
                    if let Some(r) = &rule.retry {
                        need(r.conditions.as_ref(), "retry conditions")?;
                        u16::try_from(r.max_retries).map_err(|_| "max retries".to_string())?;
                    }
                }
            }
        }
        other => return Err(format!("Tether never sends {other:?}")),
    }
    Ok(backends)
}

fn check_request_match(m: &RequestMatch) -> Check {
    match need(m.r#match.as_ref(), "request match")? {
        request_match::Match::All(s) | request_match::Match::Any(s) => {
            s.matches.iter().try_for_each(check_request_match)
        }
        request_match::Match::Not(m) => check_request_match(m),
        request_match::Match::Path(p) => compile_regex(&p.regex).map(drop),
        request_match::Match::Method(m) => http::Method::try_from(m.clone())
            .map(drop)
            .map_err(|e| e.to_string()),
    }
}

fn check_response_match(m: &ResponseMatch) -> Check {
    match need(m.r#match.as_ref(), "response match")? {
        response_match::Match::All(s) | response_match::Match::Any(s) => {
            s.matches.iter().try_for_each(check_response_match)
        }
        response_match::Match::Not(m) => check_response_match(m),
        response_match::Match::Status(r) => {
            if r.min > r.max || r.max > 599 || r.min < 100 {
                return Err(format!("status range {r:?}"));
            }
            Ok(())
        }
    }
}

/// What `service-profiles/src/proto.rs` converts: routes (a condition
/// each), response classes, durations, `dst_overrides` as `name:port`.
fn check_profile(p: &DestinationProfile) -> Check {
    for r in &p.routes {
        check_request_match(need(r.condition.as_ref(), "route condition")?)?;
        for class in &r.response_classes {
            check_response_match(need(class.condition.as_ref(), "response class condition")?)?;
        }
        optional_duration(r.timeout.as_ref(), "route timeout")?;
    }
    if let Some(b) = &p.retry_budget {
        duration(b.ttl.as_ref(), "retry budget ttl")?;
    }
    for d in &p.dst_overrides {
        let (host, port) = d
            .authority
            .rsplit_once(':')
            .ok_or("override without port")?;
        port.parse::<u16>().map_err(|e| e.to_string())?;
        if host.is_empty() {
            return Err("override without host".into());
        }
    }
    Ok(())
}

// === The tests ===

async fn control_with_routes(scratch: &Scratch) -> (Process, String) {
    scratch.write("services.yaml", REGISTRY);
    scratch.write("web-route.yaml", WEB_ROUTE);
    scratch.write("greeter-route.yaml", GREETER_ROUTE);
    let control = scratch.control().await;
    let url = format!("http://{}", control.addr("grpc"));
    (control, url)
}

fn by_authority(authority: String) -> TrafficSpec {
    TrafficSpec {
        source_workload: "test-client".into(),
        target: Some(traffic_spec::Target::Authority(authority)),
    }
}

fn by_addr(addr: &str) -> TrafficSpec {
    TrafficSpec {
        source_workload: "test-client".into(),
        target: Some(traffic_spec::Target::Addr(
            addr.parse::<SocketAddr>().unwrap().into(),
        )),
    }
}

async fn first_policy(
    client: &mut OutboundPoliciesClient<tonic::transport::Channel>,
    spec: TrafficSpec,
) -> (OutboundPolicy, tonic::Streaming<OutboundPolicy>) {
    let mut stream = tokio::time::timeout(ANSWER, client.watch(spec.clone()))
        .await
        .expect("an answer")
        .unwrap_or_else(|s| panic!("{spec:?}: {s:?}"))
        .into_inner();
    let policy = tokio::time::timeout(ANSWER, stream.message())
        .await
        .expect("a first policy")
        .unwrap()
        .unwrap();
    (policy, stream)
}

fn resource_name(m: Option<&Metadata>) -> String {
    match m.and_then(|m| m.kind.as_ref()) {
        Some(metadata::Kind::Resource(r)) => format!("{}/{}/{}", r.kind, r.namespace, r.name),
        Some(metadata::Kind::Default(d)) => format!("default/{d}"),
        None => "none".into(),
    }
}

fn detect(p: &mut OutboundPolicy) -> &mut proxy_protocol::Detect {
    match p.protocol.as_mut().unwrap().kind.as_mut().unwrap() {
        proxy_protocol::Kind::Detect(d) => d,
        other => panic!("expected Detect, got {other:?}"),
    }
}

/// The HTTP/1 route's rule with a retry (the `/api` one).
fn first_rule(p: &mut OutboundPolicy) -> &mut http_route::Rule {
    detect(p).http1.as_mut().unwrap().routes[0]
        .rules
        .iter_mut()
        .find(|r| r.retry.is_some())
        .unwrap()
}

fn http1_routes(p: &OutboundPolicy) -> &[api::HttpRoute] {
    match p.protocol.as_ref().unwrap().kind.as_ref().unwrap() {
        proxy_protocol::Kind::Detect(d) => &d.http1.as_ref().unwrap().routes,
        other => panic!("expected Detect, got {other:?}"),
    }
}

#[tokio::test]
async fn every_policy_is_one_linkerd2_proxy_accepts_and_says_what_the_registry_says() {
    let scratch = Scratch::new();
    let (_control, url) = control_with_routes(&scratch).await;
    let mut client = OutboundPoliciesClient::connect(url.clone()).await.unwrap();
    let mut dst = DestinationClient::connect(url).await.unwrap();

    let targets = [
        by_authority(authority("web", 80)),
        by_addr("10.96.0.10:80"),
        by_authority(authority("web-v2", 80)),
        by_authority(authority("greeter", 9090)),
        by_authority(authority("db", 5432)),
        by_addr("10.96.0.11:5432"),
    ];
    let mut paths = std::collections::BTreeSet::new();
    for spec in targets {
        let (policy, _) = first_policy(&mut client, spec.clone()).await;
        let backends = check_policy(&policy)
            .unwrap_or_else(|e| panic!("{spec:?}: linkerd2-proxy would reject it: {e}"));
        paths.extend(backends.into_iter().map(|(p, _)| p));
    }

    // The HTTPRoute, by name and by cluster IP alike.
    for spec in [by_authority(authority("web", 80)), by_addr("10.96.0.10:80")] {
        let (policy, _) = first_policy(&mut client, spec).await;
        assert_eq!(resource_name(policy.metadata.as_ref()), "Service/test/web");
        let routes = http1_routes(&policy);
        assert_eq!(routes.len(), 1);
        assert_eq!(
            resource_name(routes[0].metadata.as_ref()),
            "HTTPRoute/test/web-canary"
        );
        let rules = &routes[0].rules;
        assert_eq!(rules.len(), 3);
        assert_eq!(
            http_backends(rules[0].backends.as_ref()).unwrap(),
            vec![(authority("web", 80), 90), (authority("web-v2", 80), 10)]
        );
        let api = &rules[1];
        assert_eq!(api.matches.len(), 2);
        assert_eq!(api.matches[0].headers.len(), 2);
        assert_eq!(api.matches[0].query_params.len(), 1);
        assert!(api.matches[0].method.is_some());
        assert_eq!(api.filters.len(), 2);
        let timeouts = api.timeouts.as_ref().unwrap();
        assert_eq!(
            timeouts.request,
            Some(prost_types::Duration {
                seconds: 10,
                nanos: 0
            })
        );
        // The rule retries: backendRequest bounds each attempt (the retry's
        // timeout, checked below), not the attempts together.
        assert_eq!(timeouts.response, None);
        let retry = api.retry.as_ref().unwrap();
        assert_eq!(retry.max_retries, 2);
        let codes: Vec<(u32, u32)> = retry
            .conditions
            .as_ref()
            .unwrap()
            .status_ranges
            .iter()
            .map(|r| (r.start, r.end))
            .collect();
        assert_eq!(codes, vec![(502, 502), (503, 503)]);
        assert_eq!(
            retry.timeout,
            Some(prost_types::Duration {
                seconds: 2,
                nanos: 0
            })
        );
        let Some(http_route::filter::Kind::Redirect(redirect)) = rules[2].filters[0].kind.as_ref()
        else {
            panic!("not a redirect: {:?}", rules[2].filters)
        };
        assert_eq!((redirect.status, redirect.port), (301, 8443));
        assert_eq!(redirect.host, "new.example.com");
    }

    // The checks can fail: what linkerd2-proxy rejects, they reject too.
    let (policy, _) = first_policy(&mut client, by_authority(authority("web", 80))).await;
    let broken: [fn(&mut OutboundPolicy); 4] = [
        |p| p.metadata = None,
        |p| detect(p).timeout = None,
        |p| first_rule(p).retry.as_mut().unwrap().conditions = None,
        |p| first_rule(p).backends = None,
    ];
    for (i, breaking) in broken.iter().enumerate() {
        let mut p = policy.clone();
        breaking(&mut p);
        assert!(check_policy(&p).is_err(), "broken policy {i} passed");
    }

    // No route: today's behaviour, one route to the service itself.
    let (policy, _) = first_policy(&mut client, by_authority(authority("web-v2", 80))).await;
    let routes = http1_routes(&policy);
    assert_eq!(resource_name(routes[0].metadata.as_ref()), "default/http");
    assert_eq!(
        http_backends(routes[0].rules[0].backends.as_ref()).unwrap(),
        vec![(authority("web-v2", 80), 1)]
    );

    // GRPCRoute: the port is gRPC.
    let (policy, _) = first_policy(&mut client, by_authority(authority("greeter", 9090))).await;
    let Some(proxy_protocol::Kind::Grpc(grpc)) = policy.protocol.unwrap().kind else {
        panic!("greeter is not served as gRPC")
    };
    let rpc = grpc.routes[0].rules[0].matches[0].rpc.as_ref().unwrap();
    assert_eq!(
        (rpc.service.as_str(), rpc.method.as_str()),
        ("demo.Greeter", "SayHello")
    );
    let conditions = grpc.routes[0].rules[0]
        .retry
        .as_ref()
        .unwrap()
        .conditions
        .unwrap();
    assert!(conditions.unavailable && conditions.resource_exhausted && !conditions.internal);

    // Opaque, by name and by cluster IP.
    for spec in [
        by_authority(authority("db", 5432)),
        by_addr("10.96.0.11:5432"),
    ] {
        let (policy, _) = first_policy(&mut client, spec).await;
        assert!(matches!(
            policy.protocol.unwrap().kind,
            Some(proxy_protocol::Kind::Opaque(_))
        ));
    }

    // Every backend's discovery is a Destination.Get this control plane
    // answers, naming a service that exists.
    for path in paths {
        let mut s = dst
            .get(GetDestination {
                path: path.clone(),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("{path}: {e:?}"))
            .into_inner();
        let u = tokio::time::timeout(ANSWER, s.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let exists = match u.update.unwrap() {
            update::Update::Add(_) => true,
            update::Update::NoEndpoints(n) => n.exists,
            update::Update::Remove(_) => false,
        };
        assert!(exists, "{path} names no service");
    }
}

#[tokio::test]
async fn what_is_not_a_mesh_service_is_answered_at_once() {
    let scratch = Scratch::new();
    let (_control, url) = control_with_routes(&scratch).await;
    let mut client = OutboundPoliciesClient::connect(url.clone()).await.unwrap();
    let mut dst = DestinationClient::connect(url).await.unwrap();
    for spec in [
        by_authority(authority("nope", 80)),
        by_authority(authority("web", 81)),
        by_authority("example.com:443".into()),
        by_addr("10.96.0.10:81"),
        by_addr("192.0.2.1:80"),
    ] {
        let status = tokio::time::timeout(ANSWER, client.watch(spec.clone()))
            .await
            .expect("an answer at once")
            .err()
            .unwrap_or_else(|| panic!("{spec:?} got a policy"));
        // linkerd2-proxy: NotFound means "no policy", go direct.
        assert_eq!(status.code(), tonic::Code::NotFound, "{spec:?}");
    }
    // GetProfile: INVALID_ARGUMENT is "not a mesh destination", no retry.
    let status = tokio::time::timeout(
        ANSWER,
        dst.get_profile(GetDestination {
            path: authority("nope", 80),
            ..Default::default()
        }),
    )
    .await
    .expect("an answer at once")
    .expect_err("no profile for a service that does not exist");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn profiles_are_ones_linkerd2_proxy_accepts_by_name_and_by_cluster_ip() {
    let scratch = Scratch::new();
    let (_control, url) = control_with_routes(&scratch).await;
    let mut dst = DestinationClient::connect(url).await.unwrap();
    for path in [authority("web", 80), "10.96.0.10:80".to_string()] {
        let mut s = dst
            .get_profile(GetDestination {
                path: path.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let p = tokio::time::timeout(ANSWER, s.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        check_profile(&p).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(
            p.fully_qualified_name, "web.test.svc.cluster.local",
            "{path}"
        );
        let budget = p.retry_budget.as_ref().unwrap();
        assert_eq!(budget.min_retries_per_second, 5);
        let split: Vec<(String, u32)> = p
            .dst_overrides
            .iter()
            .map(|d| (d.authority.clone(), d.weight))
            .collect();
        assert_eq!(
            split,
            vec![(authority("web", 80), 90), (authority("web-v2", 80), 10)]
        );
        // Regex path, `/old`, the catch-all rule and the default route
        // (the match with headers cannot be expressed in a profile).
        assert_eq!(p.routes.len(), 4, "{:#?}", p.routes);
        assert!(p.routes.iter().any(|r| r.is_retryable));
        assert_eq!(p.routes.last().unwrap().metrics_labels["route"], "default");
    }
    let mut s = dst
        .get_profile(GetDestination {
            path: authority("db", 5432),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let p = s.message().await.unwrap().unwrap();
    assert!(
        p.opaque_protocol
            && p.routes
                .iter()
                .all(|r| r.metrics_labels["route"] == "default")
    );
}

#[tokio::test]
async fn a_watch_follows_route_changes() {
    let scratch = Scratch::new();
    let (_control, url) = control_with_routes(&scratch).await;
    let mut client = OutboundPoliciesClient::connect(url).await.unwrap();
    let (first, mut stream) = first_policy(&mut client, by_authority(authority("web", 80))).await;
    assert_eq!(http1_routes(&first).len(), 1);
    scratch.write(
        "web-route.yaml",
        &WEB_ROUTE
            .replace("weight: 90}", "weight: 50}")
            .replace("weight: 10}", "weight: 50}"),
    );
    // The registry's rescan interval bounds how late a change can be seen.
    let next = tokio::time::timeout(ANSWER, stream.message())
        .await
        .expect("a new policy after the route changed")
        .unwrap()
        .unwrap();
    check_policy(&next).unwrap();
    assert_eq!(
        http_backends(http1_routes(&next)[0].rules[0].backends.as_ref()).unwrap(),
        vec![(authority("web", 80), 50), (authority("web-v2", 80), 50)]
    );
    // The route goes: back to the default route.
    scratch.remove("web-route.yaml");
    let next = tokio::time::timeout(ANSWER, stream.message())
        .await
        .expect("a new policy after the route went")
        .unwrap()
        .unwrap();
    assert_eq!(
        resource_name(http1_routes(&next)[0].metadata.as_ref()),
        "default/http"
    );
}
