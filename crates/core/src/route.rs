//! Routes: Gateway API `HTTPRoute` and `GRPCRoute` attached to a service.
//!
//! The documents keep the Gateway API's shape and field names (camelCase:
//! `parentRefs`, `backendRefs`, `queryParams`), so a route written for a
//! Kubernetes cluster reads the same in a registry file, and the
//! Kubernetes registry parses a route's `spec` with these same types.
//! Everything a client will act on is checked here, with errors that start
//! with the failing field's path: the control plane serves only routes that
//! passed, so proxies never see a route they would have to reject.
//! `docs/routes.md` is the reference.

use std::collections::BTreeSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::authority::{is_dns_label, ServiceKey};
use crate::registry::MAX_DURATION;
use crate::truncate::for_log;

/// Bounds (the Gateway API CRDs' own, so anything a cluster accepts fits).
pub const MAX_PARENT_REFS: usize = 32;
pub const MAX_HOSTNAMES: usize = 16;
pub const MAX_RULES: usize = 16;
pub const MAX_MATCHES_PER_RULE: usize = 64;
/// Matches across all rules of one route.
pub const MAX_MATCHES: usize = 128;
pub const MAX_FILTERS: usize = 16;
pub const MAX_BACKEND_REFS: usize = 16;
/// Header and query parameter matches per match; header edits per filter.
pub const MAX_HEADER_ITEMS: usize = 16;
/// The longest path, regular expression or header value a route may hold.
pub const MAX_VALUE_BYTES: usize = 1024;
/// The longest header or query parameter name.
pub const MAX_HEADER_NAME_BYTES: usize = 256;
/// The largest compiled program a route's regular expression may need
/// (`regex::RegexBuilder::size_limit`): a pattern like `(a{100}){100}` is
/// short but compiles to megabytes, in the control plane and every proxy.
pub const MAX_REGEX_PROGRAM_BYTES: usize = 64 * 1024;
/// The most retries a rule may ask for per request.
pub const MAX_RETRY_ATTEMPTS: u32 = 10;
/// The largest backend weight (the Gateway API's).
pub const MAX_WEIGHT: u32 = 1_000_000;

/// Compiles a route's regular expression the way every consumer must: it
/// matches the whole value (anchored), and its compiled size is bounded.
pub fn compile_regex(pattern: &str) -> Result<regex::Regex, String> {
    if pattern.len() > MAX_VALUE_BYTES {
        return Err(format!(
            "regular expression {} is longer than {MAX_VALUE_BYTES} bytes",
            for_log(pattern)
        ));
    }
    regex::RegexBuilder::new(&format!("^(?:{pattern})$"))
        .size_limit(MAX_REGEX_PROGRAM_BYTES)
        .build()
        .map_err(|e| {
            let why = match e {
                regex::Error::CompiledTooBig(_) => {
                    format!("compiles to more than {MAX_REGEX_PROGRAM_BYTES} bytes")
                }
                _ => "is not a valid regular expression".to_string(),
            };
            format!("{} {why}", for_log(pattern))
        })
}

/// A path match as one regular expression over the whole path, for APIs
/// that carry only a regex (ServiceProfile routes). `PathPrefix` matches
/// whole path elements, as the Gateway API says: `/api` matches `/api` and
/// `/api/x`, not `/apix`.
pub fn path_regex(m: &PathMatch) -> String {
    match m.kind {
        PathMatchType::Exact => format!("^{}$", regex::escape(&m.value)),
        PathMatchType::PathPrefix => {
            let prefix = m.value.trim_end_matches('/');
            if prefix.is_empty() {
                "^/.*$".to_string()
            } else {
                format!("^{}(?:/.*)?$", regex::escape(prefix))
            }
        }
        PathMatchType::RegularExpression => format!("^(?:{})$", m.value),
    }
}

/// A gRPC method match as a regular expression over the request path
/// (`/package.Service/Method`).
pub fn grpc_path_regex(m: &GrpcMethodMatch) -> String {
    let part = |name: &Option<String>| name.as_deref().map_or("[^/]*".to_string(), regex::escape);
    format!("^/{}/{}$", part(&m.service), part(&m.method))
}

fn default_namespace() -> String {
    "default".to_string()
}

fn one() -> u32 {
    1
}

/// A route document: `kind: HTTPRoute` (rules [`HttpRule`]) or
/// `kind: GRPCRoute` (rules [`GrpcRule`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RouteDoc<R> {
    pub name: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    pub parent_refs: Vec<ParentRef>,
    /// Accepted for compatibility with routes written for gateways; a
    /// route attached to a service applies whatever the host.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hostnames: Vec<String>,
    #[serde(default)]
    pub rules: Vec<R>,
}

pub type HttpRouteDoc = RouteDoc<HttpRule>;
pub type GrpcRouteDoc = RouteDoc<GrpcRule>;

/// The service (and optionally the one port) a route applies to; or, with
/// `group: policy.linkerd.io` and `kind: Server`, the server an inbound
/// route belongs to (`crate::policy`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ParentRef {
    /// `""` or `core` (a Service); absent means the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// `Service`; absent means the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    /// Absent: the route's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Absent: every port of the service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
}

/// Another service traffic is sent to, with its share.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BackendRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    /// Absent: the route's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Absent: the port the request was addressed to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    #[serde(default = "one")]
    pub weight: u32,
}

/// `timeouts`: Gateway API durations (`500ms`, `10s`, `1m30s`); `0s` is
/// no timeout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Timeouts {
    /// The whole request, retries included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    /// Each attempt to a backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_request: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HttpRule {
    /// A name for the rule (Gateway API `sectionName`), used in metrics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Absent or empty: every request (a `PathPrefix /` match).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matches: Vec<HttpMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub filters: Vec<HttpFilter>,
    /// Absent or empty: the parent service itself.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backend_refs: Vec<BackendRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeouts: Option<Timeouts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<HttpRetry>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HttpMatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<ValueMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub query_params: Vec<ValueMatch>,
    /// `GET`, `POST`, … (upper case, as on the wire).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum PathMatchType {
    Exact,
    #[default]
    PathPrefix,
    RegularExpression,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathMatch {
    #[serde(default, rename = "type")]
    pub kind: PathMatchType,
    #[serde(default = "root")]
    pub value: String,
}

fn root() -> String {
    "/".to_string()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum ValueMatchType {
    #[default]
    Exact,
    RegularExpression,
}

/// A header or query parameter match.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ValueMatch {
    #[serde(default, rename = "type")]
    pub kind: ValueMatchType,
    pub name: String,
    pub value: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FilterType {
    RequestHeaderModifier,
    ResponseHeaderModifier,
    RequestRedirect,
}

/// A filter in the Gateway API's shape: `type` names it and the field of
/// that name (and only it) holds its settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HttpFilter {
    #[serde(rename = "type")]
    pub kind: FilterType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_header_modifier: Option<HeaderModifier>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_header_modifier: Option<HeaderModifier>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_redirect: Option<RequestRedirect>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct HeaderModifier {
    /// Replaces the header's values.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub set: Vec<HeaderValue>,
    /// Appends a value.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub add: Vec<HeaderValue>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderValue {
    pub name: String,
    pub value: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RequestRedirect {
    /// `http` or `https`; absent keeps the request's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheme: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathModifier>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// 301, 302 (the default), 303, 307 or 308.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_code: Option<u16>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PathModifierType {
    ReplaceFullPath,
    ReplacePrefixMatch,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PathModifier {
    #[serde(rename = "type")]
    pub kind: PathModifierType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replace_full_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replace_prefix_match: Option<String>,
}

/// Per-rule retries (the Gateway API's `retry`), within the service's
/// retry budget.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct HttpRetry {
    /// Response statuses (400-599) that are retried; absent: 5xx.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub codes: Vec<u16>,
    /// Retries per request (not counting the first attempt); absent: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    /// Wait before a retry; absent: none beyond the proxy's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GrpcRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matches: Vec<GrpcMatch>,
    /// `RequestHeaderModifier` only (what the proxy API carries).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub filters: Vec<HttpFilter>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backend_refs: Vec<BackendRef>,
    /// Not in the Gateway API's GRPCRoute (Linkerd sets these by
    /// annotation); the same meaning as an HTTPRoute rule's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeouts: Option<Timeouts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<GrpcRetry>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct GrpcMatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<GrpcMethodMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<ValueMatch>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct GrpcMethodMatch {
    /// `Exact` (the default and the only one supported: the proxy API
    /// carries exact names).
    #[serde(default, rename = "type")]
    pub kind: ValueMatchType,
    /// The fully qualified service, e.g. `demo.Greeter`; absent: any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// The method, e.g. `SayHello`; absent: any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
}

/// The gRPC statuses a client may retry on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum GrpcRetryCode {
    Cancelled,
    DeadlineExceeded,
    Internal,
    ResourceExhausted,
    Unavailable,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct GrpcRetry {
    /// Statuses that are retried; absent: `UNAVAILABLE`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub codes: Vec<GrpcRetryCode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<String>,
}

/// Which route: kind, namespace and name. Two files naming the same route
/// follow the registry's "first path wins" rule.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouteKey {
    pub kind: RouteKind,
    pub namespace: String,
    pub name: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RouteKind {
    Http,
    Grpc,
}

impl RouteKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteKind::Http => "HTTPRoute",
            RouteKind::Grpc => "GRPCRoute",
        }
    }
}

impl std::fmt::Display for RouteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}/{}", self.kind.as_str(), self.namespace, self.name)
    }
}

/// A validated route of either kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    Http(HttpRouteDoc),
    Grpc(GrpcRouteDoc),
}

impl Route {
    pub fn key(&self) -> RouteKey {
        let (kind, namespace, name) = match self {
            Route::Http(r) => (RouteKind::Http, &r.namespace, &r.name),
            Route::Grpc(r) => (RouteKind::Grpc, &r.namespace, &r.name),
        };
        RouteKey {
            kind,
            namespace: namespace.clone(),
            name: name.clone(),
        }
    }

    pub fn parent_refs(&self) -> &[ParentRef] {
        match self {
            Route::Http(r) => &r.parent_refs,
            Route::Grpc(r) => &r.parent_refs,
        }
    }

    pub fn namespace(&self) -> &str {
        match self {
            Route::Http(r) => &r.namespace,
            Route::Grpc(r) => &r.namespace,
        }
    }

    /// The services this route attaches to.
    pub fn parents(&self) -> BTreeSet<ServiceKey> {
        self.parent_refs()
            .iter()
            .filter(|p| !p.is_server())
            .map(|p| p.service(self.namespace()))
            .collect()
    }

    /// The `Server`s (in the route's namespace) this route belongs to:
    /// an inbound route.
    pub fn servers(&self) -> BTreeSet<&str> {
        self.parent_refs()
            .iter()
            .filter(|p| p.is_server())
            .map(|p| p.name.as_str())
            .collect()
    }

    /// Whether the route applies to `service`'s `port`.
    pub fn applies_to(&self, service: &ServiceKey, port: u16) -> bool {
        self.parent_refs().iter().any(|p| {
            !p.is_server()
                && p.service(self.namespace()) == *service
                && p.port.is_none_or(|p| p == port)
        })
    }

    /// Validates a route; the message starts with the failing field.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            Route::Http(r) => validate_route(r, validate_http_rule),
            Route::Grpc(r) => validate_route(r, validate_grpc_rule),
        }
    }
}

impl ParentRef {
    /// Whether this names a `Server` (an inbound route's parent).
    pub fn is_server(&self) -> bool {
        self.group.as_deref() == Some(crate::policy::POLICY_GROUP)
            && self.kind.as_deref() == Some("Server")
    }

    pub fn service(&self, route_namespace: &str) -> ServiceKey {
        ServiceKey::new(
            &self.name,
            self.namespace.as_deref().unwrap_or(route_namespace),
        )
    }
}

impl BackendRef {
    pub fn service(&self, route_namespace: &str) -> ServiceKey {
        ServiceKey::new(
            &self.name,
            self.namespace.as_deref().unwrap_or(route_namespace),
        )
    }
}

fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && !s.is_empty() && s.split('.').all(is_dns_label)
}

fn check_service_ref(
    field: &str,
    group: &Option<String>,
    kind: &Option<String>,
    name: &str,
    namespace: &Option<String>,
    port: Option<u16>,
) -> Result<(), String> {
    if let Some(g) = group {
        if !(g.is_empty() || g == "core") {
            return Err(format!(
                "field `{field}.group`: {} is not supported; routes attach to and send to services (group \"\" or core)",
                for_log(g)
            ));
        }
    }
    if let Some(k) = kind {
        if k != "Service" {
            return Err(format!(
                "field `{field}.kind`: {} is not supported; expected Service (or, for a parent, Server in group policy.linkerd.io)",
                for_log(k)
            ));
        }
    }
    if !is_dns_label(name) {
        return Err(format!(
            "field `{field}.name`: {} is not a valid service name",
            for_log(name)
        ));
    }
    if let Some(ns) = namespace {
        if !is_dns_label(ns) {
            return Err(format!(
                "field `{field}.namespace`: {} is not a valid namespace",
                for_log(ns)
            ));
        }
    }
    if port == Some(0) {
        return Err(format!("field `{field}.port`: must be 1-65535"));
    }
    Ok(())
}

/// Refuses a list longer than `max`, naming the field.
pub(crate) fn check_count(field: &str, len: usize, max: usize) -> Result<(), String> {
    if len > max {
        return Err(format!(
            "field `{field}`: {len} items, more than the limit of {max}"
        ));
    }
    Ok(())
}

fn validate_route<R>(
    route: &RouteDoc<R>,
    rule: impl Fn(&str, &R) -> Result<usize, String>,
) -> Result<(), String> {
    if !is_dns_subdomain(&route.name) {
        return Err(format!(
            "field `name`: {} is not a valid name (lowercase DNS labels separated by dots)",
            for_log(&route.name)
        ));
    }
    if !is_dns_label(&route.namespace) {
        return Err(format!(
            "field `namespace`: {} is not a valid namespace",
            for_log(&route.namespace)
        ));
    }
    if route.parent_refs.is_empty() {
        return Err("field `parentRefs`: a route needs at least one parent service".into());
    }
    check_count("parentRefs", route.parent_refs.len(), MAX_PARENT_REFS)?;
    for (i, p) in route.parent_refs.iter().enumerate() {
        if p.is_server() {
            let field = format!("parentRefs[{i}]");
            if p.namespace
                .as_ref()
                .is_some_and(|ns| *ns != route.namespace)
            {
                return Err(format!(
                    "field `{field}.namespace`: a route belongs to Servers of its own namespace"
                ));
            }
            if !is_dns_subdomain(&p.name) || p.port.is_some() {
                return Err(format!(
                    "field `{field}`: a Server parent needs a valid name and no port"
                ));
            }
            continue;
        }
        check_service_ref(
            &format!("parentRefs[{i}]"),
            &p.group,
            &p.kind,
            &p.name,
            &p.namespace,
            p.port,
        )?;
    }
    check_count("hostnames", route.hostnames.len(), MAX_HOSTNAMES)?;
    for (i, h) in route.hostnames.iter().enumerate() {
        let bare = h.strip_prefix("*.").unwrap_or(h);
        if !is_dns_subdomain(bare) {
            return Err(format!(
                "field `hostnames[{i}]`: {} is not a hostname",
                for_log(h)
            ));
        }
    }
    check_count("rules", route.rules.len(), MAX_RULES)?;
    let mut matches = 0;
    for (i, r) in route.rules.iter().enumerate() {
        matches += rule(&format!("rules[{i}]"), r)?;
    }
    if matches > MAX_MATCHES {
        return Err(format!(
            "field `rules`: {matches} matches in all, more than the limit of {MAX_MATCHES}"
        ));
    }
    Ok(())
}

/// An HTTP header name (RFC 9110 token), bounded.
fn check_header_name(field: &str, name: &str) -> Result<(), String> {
    let token = |c: u8| c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c);
    if name.is_empty() || name.len() > MAX_HEADER_NAME_BYTES || !name.bytes().all(token) {
        return Err(format!(
            "field `{field}`: {} is not a header name",
            for_log(name)
        ));
    }
    Ok(())
}

/// A header value: visible ASCII, spaces and tabs, bounded.
fn check_header_value(field: &str, value: &str) -> Result<(), String> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(format!(
            "field `{field}`: {} is longer than {MAX_VALUE_BYTES} bytes",
            for_log(value)
        ));
    }
    if !value
        .bytes()
        .all(|c| c == b'\t' || (b' '..0x7f).contains(&c))
    {
        return Err(format!(
            "field `{field}`: {} holds characters a header value cannot",
            for_log(value)
        ));
    }
    Ok(())
}

fn check_regex(field: &str, pattern: &str) -> Result<(), String> {
    compile_regex(pattern)
        .map(drop)
        .map_err(|e| format!("field `{field}`: {e}"))
}

fn check_value_matches(field: &str, items: &[ValueMatch], header: bool) -> Result<(), String> {
    check_count(field, items.len(), MAX_HEADER_ITEMS)?;
    let mut names = BTreeSet::new();
    for (i, m) in items.iter().enumerate() {
        let f = format!("{field}[{i}]");
        if header {
            check_header_name(&format!("{f}.name"), &m.name)?;
        } else if m.name.is_empty() || m.name.len() > MAX_HEADER_NAME_BYTES {
            return Err(format!(
                "field `{f}.name`: {} is not a query parameter name (1-{MAX_HEADER_NAME_BYTES} bytes)",
                for_log(&m.name)
            ));
        }
        // The Gateway API: a name listed twice is a conflict.
        if !names.insert(if header {
            m.name.to_ascii_lowercase()
        } else {
            m.name.clone()
        }) {
            return Err(format!(
                "field `{f}.name`: {} is matched twice",
                for_log(&m.name)
            ));
        }
        match m.kind {
            ValueMatchType::Exact => check_header_value(&format!("{f}.value"), &m.value)?,
            ValueMatchType::RegularExpression => check_regex(&format!("{f}.value"), &m.value)?,
        }
    }
    Ok(())
}

const METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
];

fn check_path(field: &str, path: &str) -> Result<(), String> {
    if !path.starts_with('/') || path.len() > MAX_VALUE_BYTES {
        return Err(format!(
            "field `{field}`: {} is not an absolute path of at most {MAX_VALUE_BYTES} bytes",
            for_log(path)
        ));
    }
    if !path.bytes().all(|c| (b'!'..0x7f).contains(&c)) || path.contains('?') || path.contains('#')
    {
        return Err(format!(
            "field `{field}`: {} holds characters a path cannot (spaces, controls, ? or #)",
            for_log(path)
        ));
    }
    Ok(())
}

fn check_timeouts(field: &str, timeouts: &Option<Timeouts>) -> Result<(), String> {
    let Some(t) = timeouts else { return Ok(()) };
    let request = t
        .request
        .as_deref()
        .map(|d| parse_route_duration(d).map_err(|e| format!("field `{field}.request`: {e}")))
        .transpose()?;
    let backend = t
        .backend_request
        .as_deref()
        .map(|d| {
            parse_route_duration(d).map_err(|e| format!("field `{field}.backendRequest`: {e}"))
        })
        .transpose()?;
    if let (Some(r), Some(b)) = (request, backend) {
        if !r.is_zero() && (b.is_zero() || b > r) {
            return Err(format!(
                "field `{field}.backendRequest`: must not be longer than `request` ({r:?})"
            ));
        }
    }
    Ok(())
}

fn check_retry_common(
    field: &str,
    attempts: Option<u32>,
    backoff: &Option<String>,
) -> Result<(), String> {
    if let Some(a) = attempts {
        if a > MAX_RETRY_ATTEMPTS {
            return Err(format!(
                "field `{field}.attempts`: {a} is more than the limit of {MAX_RETRY_ATTEMPTS}"
            ));
        }
    }
    if let Some(b) = backoff {
        parse_route_duration(b).map_err(|e| format!("field `{field}.backoff`: {e}"))?;
    }
    Ok(())
}

fn check_backend_refs(field: &str, refs: &[BackendRef]) -> Result<(), String> {
    check_count(field, refs.len(), MAX_BACKEND_REFS)?;
    for (i, b) in refs.iter().enumerate() {
        let f = format!("{field}[{i}]");
        check_service_ref(&f, &b.group, &b.kind, &b.name, &b.namespace, b.port)?;
        if b.weight > MAX_WEIGHT {
            return Err(format!(
                "field `{f}.weight`: {} is more than {MAX_WEIGHT}",
                b.weight
            ));
        }
    }
    if !refs.is_empty() && refs.iter().all(|b| b.weight == 0) {
        return Err(format!(
            "field `{field}`: every backend has weight 0; at least one needs a positive weight"
        ));
    }
    Ok(())
}

/// Why a route may not modify header `name`, if it may not: apps trust
/// the mesh's own headers (`tether-client-id`, `l5d-client-id`) because
/// only the mesh sets them, and hop-by-hop and framing headers describe one
/// connection — a route that set `content-length` could desynchronise the
/// next hop. The proxies would drop most of these silently; refusing them
/// here tells the operator.
fn reserved_header(name: &str) -> Option<&'static str> {
    let name = name.to_ascii_lowercase().replace('_', "-");
    if name.starts_with("tether-") || name.starts_with("l5d-") {
        return Some("the mesh sets it");
    }
    match name.as_str() {
        "connection" | "keep-alive" | "proxy-connection" | "transfer-encoding" | "te"
        | "trailer" | "upgrade" | "content-length" => {
            Some("it describes the connection, not the request")
        }
        _ => None,
    }
}

fn check_modifiable_header(field: &str, name: &str) -> Result<(), String> {
    check_header_name(field, name)?;
    match reserved_header(name) {
        Some(why) => Err(format!(
            "field `{field}`: {} may not be modified by a route: {why}",
            for_log(name)
        )),
        None => Ok(()),
    }
}

fn check_header_modifier(field: &str, m: &HeaderModifier) -> Result<(), String> {
    let mut names = BTreeSet::new();
    for (list, items) in [("set", &m.set), ("add", &m.add)] {
        check_count(&format!("{field}.{list}"), items.len(), MAX_HEADER_ITEMS)?;
        for (i, h) in items.iter().enumerate() {
            let f = format!("{field}.{list}[{i}]");
            check_modifiable_header(&format!("{f}.name"), &h.name)?;
            check_header_value(&format!("{f}.value"), &h.value)?;
            if !names.insert(h.name.to_ascii_lowercase()) {
                return Err(format!(
                    "field `{f}.name`: {} is modified twice",
                    for_log(&h.name)
                ));
            }
        }
    }
    check_count(&format!("{field}.remove"), m.remove.len(), MAX_HEADER_ITEMS)?;
    for (i, name) in m.remove.iter().enumerate() {
        let f = format!("{field}.remove[{i}]");
        check_modifiable_header(&f, name)?;
        if !names.insert(name.to_ascii_lowercase()) {
            return Err(format!("field `{f}`: {} is modified twice", for_log(name)));
        }
    }
    Ok(())
}

/// Checks one filter; `redirect_prefix` tells whether the rule's matches
/// allow `ReplacePrefixMatch` (each must be a `PathPrefix`).
fn check_filter(
    field: &str,
    filter: &HttpFilter,
    allow_redirect: bool,
    redirect_prefix: bool,
) -> Result<(), String> {
    let set = [
        (
            FilterType::RequestHeaderModifier,
            "requestHeaderModifier",
            filter.request_header_modifier.is_some(),
        ),
        (
            FilterType::ResponseHeaderModifier,
            "responseHeaderModifier",
            filter.response_header_modifier.is_some(),
        ),
        (
            FilterType::RequestRedirect,
            "requestRedirect",
            filter.request_redirect.is_some(),
        ),
    ];
    for (kind, name, present) in set {
        if (kind == filter.kind) != present {
            return Err(if present {
                format!(
                    "field `{field}.{name}`: set, but the filter's type is {:?}",
                    filter.kind
                )
            } else {
                format!("field `{field}.{name}`: missing; a {kind:?} filter needs it")
            });
        }
    }
    match filter.kind {
        FilterType::RequestHeaderModifier => check_header_modifier(
            &format!("{field}.requestHeaderModifier"),
            filter.request_header_modifier.as_ref().expect("checked"),
        ),
        FilterType::ResponseHeaderModifier => check_header_modifier(
            &format!("{field}.responseHeaderModifier"),
            filter.response_header_modifier.as_ref().expect("checked"),
        ),
        FilterType::RequestRedirect if !allow_redirect => Err(format!(
            "field `{field}.type`: RequestRedirect is not supported in a GRPCRoute"
        )),
        FilterType::RequestRedirect => {
            let f = format!("{field}.requestRedirect");
            let r = filter.request_redirect.as_ref().expect("checked");
            if let Some(s) = &r.scheme {
                if s != "http" && s != "https" {
                    return Err(format!(
                        "field `{f}.scheme`: {} is not http or https",
                        for_log(s)
                    ));
                }
            }
            if let Some(h) = &r.hostname {
                if !is_dns_subdomain(h) {
                    return Err(format!(
                        "field `{f}.hostname`: {} is not a hostname",
                        for_log(h)
                    ));
                }
            }
            if r.port == Some(0) {
                return Err(format!("field `{f}.port`: must be 1-65535"));
            }
            if let Some(code) = r.status_code {
                if ![301, 302, 303, 307, 308].contains(&code) {
                    return Err(format!(
                        "field `{f}.statusCode`: {code} is not a redirect status (301, 302, 303, 307, 308)"
                    ));
                }
            }
            if let Some(p) = &r.path {
                let (want, value, other) = match p.kind {
                    PathModifierType::ReplaceFullPath => (
                        "replaceFullPath",
                        &p.replace_full_path,
                        &p.replace_prefix_match,
                    ),
                    PathModifierType::ReplacePrefixMatch => (
                        "replacePrefixMatch",
                        &p.replace_prefix_match,
                        &p.replace_full_path,
                    ),
                };
                let Some(value) = value else {
                    return Err(format!(
                        "field `{f}.path.{want}`: missing; a {:?} path needs it",
                        p.kind
                    ));
                };
                if other.is_some() {
                    return Err(format!(
                        "field `{f}.path`: only `{want}` may be set for a {:?} path",
                        p.kind
                    ));
                }
                check_path(&format!("{f}.path.{want}"), value)?;
                if p.kind == PathModifierType::ReplacePrefixMatch && !redirect_prefix {
                    return Err(format!(
                        "field `{f}.path`: ReplacePrefixMatch needs every match of the rule to be a PathPrefix path match"
                    ));
                }
            }
            Ok(())
        }
    }
}

fn check_filters(
    field: &str,
    filters: &[HttpFilter],
    allow_redirect: bool,
    redirect_prefix: bool,
) -> Result<(), String> {
    check_count(field, filters.len(), MAX_FILTERS)?;
    let mut seen = BTreeSet::new();
    for (i, filter) in filters.iter().enumerate() {
        let f = format!("{field}[{i}]");
        check_filter(&f, filter, allow_redirect, redirect_prefix)?;
        // The Gateway API allows each of these once per rule.
        if !seen.insert(filter.kind as u8) {
            return Err(format!(
                "field `{f}.type`: a rule may have one {:?} filter",
                filter.kind
            ));
        }
    }
    Ok(())
}

/// What HTTP and gRPC rules check alike: the optional name and how many
/// matches the rule has.
fn check_rule_name_and_match_count(
    field: &str,
    name: Option<&str>,
    matches: usize,
) -> Result<(), String> {
    if let Some(name) = name {
        if !is_dns_subdomain(name) {
            return Err(format!(
                "field `{field}.name`: {} is not a valid name",
                for_log(name)
            ));
        }
    }
    check_count(&format!("{field}.matches"), matches, MAX_MATCHES_PER_RULE)
}

/// Checks an HTTP rule; returns its number of matches.
fn validate_http_rule(field: &str, rule: &HttpRule) -> Result<usize, String> {
    check_rule_name_and_match_count(field, rule.name.as_deref(), rule.matches.len())?;
    for (i, m) in rule.matches.iter().enumerate() {
        let f = format!("{field}.matches[{i}]");
        if let Some(p) = &m.path {
            match p.kind {
                PathMatchType::Exact | PathMatchType::PathPrefix => {
                    check_path(&format!("{f}.path.value"), &p.value)?
                }
                PathMatchType::RegularExpression => {
                    check_regex(&format!("{f}.path.value"), &p.value)?
                }
            }
        }
        check_value_matches(&format!("{f}.headers"), &m.headers, true)?;
        check_value_matches(&format!("{f}.queryParams"), &m.query_params, false)?;
        if let Some(method) = &m.method {
            if !METHODS.contains(&method.as_str()) {
                return Err(format!(
                    "field `{f}.method`: {} is not one of {}",
                    for_log(method),
                    METHODS.join(", ")
                ));
            }
        }
    }
    let prefix_only = rule.matches.iter().all(|m| {
        m.path
            .as_ref()
            .is_none_or(|p| p.kind == PathMatchType::PathPrefix)
    });
    check_filters(
        &format!("{field}.filters"),
        &rule.filters,
        true,
        prefix_only,
    )?;
    let redirects = rule
        .filters
        .iter()
        .any(|f| f.kind == FilterType::RequestRedirect);
    if redirects && !rule.backend_refs.is_empty() {
        return Err(format!(
            "field `{field}.backendRefs`: a rule that redirects sends to no backend"
        ));
    }
    check_backend_refs(&format!("{field}.backendRefs"), &rule.backend_refs)?;
    check_timeouts(&format!("{field}.timeouts"), &rule.timeouts)?;
    if let Some(r) = &rule.retry {
        let f = format!("{field}.retry");
        for (i, code) in r.codes.iter().enumerate() {
            if !(400..=599).contains(code) {
                return Err(format!(
                    "field `{f}.codes[{i}]`: {code} is not an error status (400-599)"
                ));
            }
        }
        check_retry_common(&f, r.attempts, &r.backoff)?;
    }
    Ok(rule.matches.len())
}

fn check_grpc_name(field: &str, name: &str) -> Result<(), String> {
    let ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.';
    if name.is_empty() || name.len() > MAX_VALUE_BYTES || !name.chars().all(ok) {
        return Err(format!(
            "field `{field}`: {} is not a gRPC name (letters, digits, '_' and '.')",
            for_log(name)
        ));
    }
    Ok(())
}

fn validate_grpc_rule(field: &str, rule: &GrpcRule) -> Result<usize, String> {
    check_rule_name_and_match_count(field, rule.name.as_deref(), rule.matches.len())?;
    for (i, m) in rule.matches.iter().enumerate() {
        let f = format!("{field}.matches[{i}]");
        if let Some(method) = &m.method {
            if method.kind == ValueMatchType::RegularExpression {
                // linkerd2-proxy-api's GrpcRpcMatch carries exact names only.
                return Err(format!(
                    "field `{f}.method.type`: RegularExpression is not supported for gRPC methods (the proxy API matches exact names); match a header instead"
                ));
            }
            if method.service.is_none() && method.method.is_none() {
                return Err(format!(
                    "field `{f}.method`: needs `service`, `method` or both"
                ));
            }
            if let Some(s) = &method.service {
                check_grpc_name(&format!("{f}.method.service"), s)?;
            }
            if let Some(m) = &method.method {
                check_grpc_name(&format!("{f}.method.method"), m)?;
            }
        }
        check_value_matches(&format!("{f}.headers"), &m.headers, true)?;
    }
    for (i, filter) in rule.filters.iter().enumerate() {
        // linkerd2-proxy-api's GrpcRoute filters: header modification of
        // requests (and fault injection) only.
        if filter.kind != FilterType::RequestHeaderModifier {
            return Err(format!(
                "field `{field}.filters[{i}].type`: {:?} is not supported in a GRPCRoute (only RequestHeaderModifier)",
                filter.kind
            ));
        }
    }
    check_filters(&format!("{field}.filters"), &rule.filters, false, false)?;
    check_backend_refs(&format!("{field}.backendRefs"), &rule.backend_refs)?;
    check_timeouts(&format!("{field}.timeouts"), &rule.timeouts)?;
    if let Some(r) = &rule.retry {
        check_retry_common(&format!("{field}.retry"), r.attempts, &r.backoff)?;
    }
    Ok(rule.matches.len())
}

/// A Gateway API duration: one or more number-unit pairs (`1h30m`,
/// `500ms`, `1.5s`), or `0`; at most 24h in all.
pub fn parse_route_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    if t.is_empty() || t.len() > 32 {
        return Err(format!(
            "{} is not a duration such as 500ms, 10s or 1m30s",
            for_log(text)
        ));
    }
    let mut total = Duration::ZERO;
    let mut rest = t;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let unit_len = rest[digits..]
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len() - digits);
        let segment = &rest[..digits + unit_len];
        total += crate::registry::parse_duration(segment).map_err(|_| {
            format!(
                "{} is not a duration such as 500ms, 10s or 1m30s",
                for_log(text)
            )
        })?;
        rest = &rest[digits + unit_len..];
    }
    if total > MAX_DURATION {
        return Err(format!("{} is longer than 24h", for_log(text)));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{parse_documents, Document};

    const HTTP: &str = r#"
kind: HTTPRoute
name: web-canary
namespace: demo
parentRefs:
  - name: web
    port: 80
rules:
  - name: api
    matches:
      - path: {type: PathPrefix, value: /api}
        method: GET
        headers:
          - {name: x-canary, value: "1"}
          - {type: RegularExpression, name: x-user, value: "[a-z]+"}
        queryParams:
          - {name: debug, value: "1"}
    filters:
      - type: RequestHeaderModifier
        requestHeaderModifier:
          set: [{name: x-route, value: api}]
          remove: [x-internal]
      - type: ResponseHeaderModifier
        responseHeaderModifier:
          add: [{name: x-served-by, value: canary}]
    backendRefs:
      - {name: web, port: 80, weight: 90}
      - {name: web-v2, port: 80, weight: 10}
    timeouts: {request: 10s, backendRequest: 2s}
    retry: {codes: [503], attempts: 2, backoff: 100ms}
  - matches:
      - path: {type: Exact, value: /old}
    filters:
      - type: RequestRedirect
        requestRedirect:
          path: {type: ReplaceFullPath, replaceFullPath: /new}
          statusCode: 301
"#;

    const GRPC: &str = r#"
kind: GRPCRoute
name: greeter
namespace: demo
parentRefs: [{name: greeter, port: 9090}]
rules:
  - matches:
      - method: {service: demo.Greeter, method: SayHello}
        headers: [{name: x-canary, value: "1"}]
    backendRefs: [{name: greeter-v2}]
    timeouts: {request: 1s}
    retry: {codes: [UNAVAILABLE, RESOURCE_EXHAUSTED], attempts: 3}
"#;

    fn route_of(text: &str) -> Route {
        let mut docs = parse_documents(text).unwrap();
        assert_eq!(docs.len(), 1);
        let Some(Document::Route(r)) = docs.pop() else {
            panic!("not a route")
        };
        r
    }

    fn error_of(text: &str) -> String {
        parse_documents(text).unwrap_err().to_string()
    }

    #[test]
    fn parses_http_and_grpc_routes() {
        let Route::Http(r) = route_of(HTTP) else {
            panic!()
        };
        assert_eq!(r.rules.len(), 2);
        assert_eq!(r.rules[0].backend_refs[1].weight, 10);
        assert_eq!(r.rules[0].matches[0].headers[0].kind, ValueMatchType::Exact);
        let route = Route::Http(r);
        assert_eq!(
            route.parents().into_iter().collect::<Vec<_>>(),
            vec![ServiceKey::new("web", "demo")]
        );
        assert!(route.applies_to(&ServiceKey::new("web", "demo"), 80));
        assert!(!route.applies_to(&ServiceKey::new("web", "demo"), 81));
        let Route::Grpc(g) = route_of(GRPC) else {
            panic!()
        };
        assert_eq!(
            g.rules[0].retry.as_ref().unwrap().codes,
            vec![GrpcRetryCode::Unavailable, GrpcRetryCode::ResourceExhausted]
        );
    }

    #[test]
    fn routes_round_trip_through_yaml() {
        for text in [HTTP, GRPC] {
            let doc = Document::Route(route_of(text));
            assert_eq!(parse_documents(&doc.to_yaml()).unwrap(), vec![doc]);
        }
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            ("rules:\n  - matches: [{path: {type: Exact, value: api}}]", "rules[0].matches[0].path.value"),
            ("rules:\n  - matches: [{path: {type: RegularExpression, value: \"(\"}}]", "rules[0].matches[0].path.value"),
            ("rules:\n  - matches: [{path: {type: RegularExpression, value: \"(a{100}){100}\"}}]", "compiles to more than"),
            ("rules:\n  - matches: [{method: FETCH}]", "rules[0].matches[0].method"),
            ("rules:\n  - matches: [{headers: [{name: \"a b\", value: x}]}]", "rules[0].matches[0].headers[0].name"),
            ("rules:\n  - matches: [{pth: /}]", "unknown field `pth`"),
            ("rules:\n  - backendRefs: [{name: web, weight: 0}]", "rules[0].backendRefs"),
            ("rules:\n  - backendRefs: [{name: Web}]", "rules[0].backendRefs[0].name"),
            ("rules:\n  - backendRefs: [{name: web, kind: Pod}]", "rules[0].backendRefs[0].kind"),
            ("rules:\n  - timeouts: {request: 1s, backendRequest: 2s}", "rules[0].timeouts.backendRequest"),
            ("rules:\n  - timeouts: {request: soon}", "rules[0].timeouts.request"),
            ("rules:\n  - retry: {codes: [200]}", "rules[0].retry.codes[0]"),
            ("rules:\n  - retry: {attempts: 1000}", "rules[0].retry.attempts"),
            ("rules:\n  - filters: [{type: RequestHeaderModifier}]", "rules[0].filters[0].requestHeaderModifier"),
            ("rules:\n  - filters: [{type: RequestRedirect, requestRedirect: {statusCode: 200}}]", "rules[0].filters[0].requestRedirect.statusCode"),
            ("rules:\n  - filters: [{type: URLRewrite}]", "rules[0].filters[0].type"),
            ("rules:\n  - filters: [{type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: Tether-Client-Id, value: admin}]}}]", "rules[0].filters[0].requestHeaderModifier.set[0].name"),
            ("rules:\n  - filters: [{type: RequestHeaderModifier, requestHeaderModifier: {add: [{name: l5d_client_id, value: admin}]}}]", "the mesh sets it"),
            ("rules:\n  - filters: [{type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: content-length, value: \"0\"}]}}]", "describes the connection"),
            ("rules:\n  - filters: [{type: ResponseHeaderModifier, responseHeaderModifier: {remove: [tether-proxy-error]}}]", "rules[0].filters[0].responseHeaderModifier.remove[0]"),
            ("rules:\n  - matches: [{path: {type: Exact, value: /a}}]\n    filters: [{type: RequestRedirect, requestRedirect: {path: {type: ReplacePrefixMatch, replacePrefixMatch: /b}}}]", "ReplacePrefixMatch needs"),
        ];
        for (rules, want) in cases {
            let text = format!("kind: HTTPRoute\nname: r\nparentRefs: [{{name: web}}]\n{rules}\n");
            let e = error_of(&text);
            assert!(e.contains(want), "{rules}: {e}");
        }
        let e = error_of("kind: HTTPRoute\nname: r\nparentRefs: []\n");
        assert!(e.contains("field `parentRefs`"), "{e}");
        let e = error_of("kind: HTTPRoute\nname: r\n");
        assert!(e.contains("missing field `parentRefs`"), "{e}");
        let e = error_of("kind: GRPCRoute\nname: r\nparentRefs: [{name: web}]\nrules: [{filters: [{type: RequestRedirect, requestRedirect: {}}]}]\n");
        assert!(e.contains("not supported in a GRPCRoute"), "{e}");
        let e = error_of("kind: GRPCRoute\nname: r\nparentRefs: [{name: web}]\nrules: [{filters: [{type: ResponseHeaderModifier, responseHeaderModifier: {}}]}]\n");
        assert!(e.contains("rules[0].filters[0].type"), "{e}");
        let e = error_of("kind: GRPCRoute\nname: r\nparentRefs: [{name: web}]\nrules: [{retry: {codes: [NOT_FOUND]}}]\n");
        assert!(e.contains("rules[0].retry.codes[0]"), "{e}");
        let e = error_of("kind: GRPCRoute\nname: r\nparentRefs: [{name: web}]\nrules: [{matches: [{method: {type: RegularExpression, service: a.*}}]}]\n");
        assert!(e.contains("rules[0].matches[0].method.type"), "{e}");
        let e = error_of("kind: GRPCRoute\nname: r\nparentRefs: [{name: web}]\nrules: [{matches: [{method: {}}]}]\n");
        assert!(e.contains("rules[0].matches[0].method"), "{e}");
    }

    #[test]
    fn counts_are_bounded() {
        let rule = "  - matches: [{path: {value: /a}}]\n";
        let text = format!(
            "kind: HTTPRoute\nname: r\nparentRefs: [{{name: web}}]\nrules:\n{}",
            rule.repeat(MAX_RULES + 1)
        );
        assert!(error_of(&text).contains("more than the limit of 16"));
        let matches = "{path: {value: /a}},".repeat(MAX_MATCHES_PER_RULE);
        let text = format!(
            "kind: HTTPRoute\nname: r\nparentRefs: [{{name: web}}]\nrules:\n{}",
            format!("  - matches: [{matches}]\n").repeat(3)
        );
        let e = error_of(&text);
        assert!(e.contains("matches in all"), "{e}");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_route_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(
            parse_route_duration("500ms"),
            Ok(Duration::from_millis(500))
        );
        assert_eq!(parse_route_duration("0s"), Ok(Duration::ZERO));
        for bad in [
            "",
            "1",
            "1x",
            "s",
            "25h",
            "1h1h1h1h1h1h1h1h1h1h1h1h1h1h1h1h1h1h1h1h",
        ] {
            assert!(parse_route_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn path_matches_as_one_regex() {
        let re = |kind, value: &str| {
            compile_regex(&path_regex(&PathMatch {
                kind,
                value: value.into(),
            }))
            .unwrap()
        };
        let prefix = re(PathMatchType::PathPrefix, "/api");
        assert!(prefix.is_match("/api") && prefix.is_match("/api/v1"));
        assert!(!prefix.is_match("/apix") && !prefix.is_match("/x/api"));
        assert!(re(PathMatchType::PathPrefix, "/").is_match("/anything"));
        let exact = re(PathMatchType::Exact, "/a.b");
        assert!(exact.is_match("/a.b") && !exact.is_match("/axb"));
        assert!(re(PathMatchType::RegularExpression, "/v[0-9]").is_match("/v2"));
        let grpc = compile_regex(&grpc_path_regex(&GrpcMethodMatch {
            kind: ValueMatchType::Exact,
            service: Some("demo.Greeter".into()),
            method: None,
        }))
        .unwrap();
        assert!(grpc.is_match("/demo.Greeter/SayHello"));
        assert!(!grpc.is_match("/demoxGreeter/SayHello"));
    }

    #[test]
    fn regexes_are_anchored_and_bounded() {
        let re = compile_regex("/api/v[0-9]+").unwrap();
        assert!(re.is_match("/api/v2"));
        assert!(!re.is_match("/x/api/v2/y"));
        let e = compile_regex("(a{100}){100}").unwrap_err();
        assert!(e.contains("compiles to more than"), "{e}");
        assert!(compile_regex("(").unwrap_err().contains("not a valid"));
    }
}
