//! The registry document model: what a registry file says about services and
//! their endpoints, and the checks every document must pass.
//!
//! A registry file holds one or more YAML documents, each either a
//! `kind: Service` (the service, its ports and optionally its endpoints) or a
//! `kind: Endpoints` (more endpoints of a service defined elsewhere, the way a
//! Kubernetes EndpointSlice adds to a Service). Errors name the document and
//! the field, so an operator can fix the file without guessing.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::authority::{is_dns_label, ServiceKey};
use crate::policy::{PolicyDoc, PolicyKind};
use crate::route::{GrpcRouteDoc, HttpRouteDoc, Route, RouteKind};
use crate::truncate::{bounded_message, for_log};

mod fast;

/// How a service with a global id uses other clusters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum MulticlusterMode {
    #[default]
    Balanced,
    Failover,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortSpec {
    pub port: u16,
    /// Opaque ports carry raw TCP: no protocol detection, no HTTP routing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub opaque: bool,
}

impl PortSpec {
    /// A port carrying HTTP (or gRPC): detected and routed per request.
    pub fn http(port: u16) -> Self {
        Self {
            port,
            opaque: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointSpec {
    /// Where traffic for this endpoint goes: the workload's proxy inbound
    /// address when meshed, the workload itself otherwise.
    pub address: SocketAddr,
    /// The service port this endpoint serves; absent means every port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    #[serde(default = "yes")]
    pub ready: bool,
    /// The workload's TLS identity, e.g.
    /// `web.demo.serviceaccount.identity.cluster.local`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<std::sync::Arc<str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<std::sync::Arc<str>>,
    #[serde(default = "one")]
    pub weight: u32,
    /// Whether a Tether (or Linkerd) proxy fronts this endpoint; meshed
    /// endpoints are reached over HTTP/2 between proxies.
    #[serde(default = "yes")]
    pub meshed: bool,
    /// A name for the workload (pod), used as a metric label; also what
    /// a proxy names itself by when it asks for its inbound policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<std::sync::Arc<str>>,
    /// The workload's labels, which a `Server`'s `podSelector` selects
    /// (the pod's labels in Kubernetes). Only named endpoints have a use
    /// for them. Shared: a pod's endpoints (one per port), the registry's
    /// record of the pod and the index's of the workload hold one copy.
    #[serde(default = "no_labels", skip_serializing_if = "has_no_labels")]
    pub labels: std::sync::Arc<crate::policy::Labels>,
}

fn has_no_labels(labels: &crate::policy::Labels) -> bool {
    labels.is_empty()
}

/// No labels, shared: most endpoints of a registry file have none.
pub fn no_labels() -> std::sync::Arc<crate::policy::Labels> {
    static NONE: std::sync::OnceLock<std::sync::Arc<crate::policy::Labels>> =
        std::sync::OnceLock::new();
    NONE.get_or_init(Default::default).clone()
}

/// Strings that repeat across a list of endpoints (identities, zones),
/// held once: each endpoint of a service usually has the same identity,
/// and a cluster has a few zones. Bounded, so a list of all-distinct
/// values costs a short scan per value, never a growing table.
#[derive(Default)]
pub struct SharedStrings {
    held: Vec<std::sync::Arc<str>>,
}

impl SharedStrings {
    /// Distinct values remembered; later ones are held each on its own.
    const HELD: usize = 16;

    /// `text` as an `Arc<str>`, the one already held when equal.
    pub fn share(&mut self, text: &str) -> std::sync::Arc<str> {
        if let Some(held) = self.held.iter().find(|h| ***h == *text) {
            return held.clone();
        }
        let new: std::sync::Arc<str> = text.into();
        if self.held.len() < Self::HELD {
            self.held.push(new.clone());
        }
        new
    }
}

impl EndpointSpec {
    /// An endpoint at `address` with a document's defaults: ready, meshed,
    /// weight 1, serving every port, no identity, zone or name.
    pub fn new(address: SocketAddr) -> Self {
        Self {
            address,
            port: None,
            ready: yes(),
            identity: None,
            zone: None,
            weight: one(),
            meshed: yes(),
            name: None,
            labels: no_labels(),
        }
    }
}

fn yes() -> bool {
    true
}

fn one() -> u32 {
    1
}

fn default_namespace() -> String {
    "default".to_string()
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceDoc {
    pub name: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    pub ports: Vec<PortSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<MulticlusterMode>,
    /// The service's virtual IP: connections to `cluster_ip:port` that a
    /// proxy intercepts resolve to this service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_ip: Option<std::net::IpAddr>,
    /// Overrides the proxies' retry budget for this service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_budget: Option<RetryBudget>,
    /// Overrides the proxies' `--response-timeout` for this service: a
    /// duration such as `500ms`, `30s`, `5m`; `0` waits as long as the app
    /// takes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_timeout: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub endpoints: Vec<EndpointSpec>,
}

impl ServiceDoc {
    /// A service with a document's defaults: no global id, mode, cluster
    /// IP, retry budget, response timeout or endpoints of its own. Set the
    /// public fields for the rest, so adding a field changes this one place.
    pub fn new(
        name: impl Into<String>,
        namespace: impl Into<String>,
        ports: Vec<PortSpec>,
    ) -> Self {
        Self {
            name: name.into(),
            namespace: namespace.into(),
            ports,
            global_id: None,
            mode: None,
            cluster_ip: None,
            retry_budget: None,
            response_timeout: None,
            endpoints: Vec::new(),
        }
    }

    pub fn with_endpoints(mut self, endpoints: Vec<EndpointSpec>) -> Self {
        self.endpoints = endpoints;
        self
    }
}

/// The window over which a retry budget counts requests and retries. A
/// registry sets only the ratio and the floor; the control plane sends this
/// window with them, and proxies use it for their own default budget.
pub const RETRY_BUDGET_WINDOW: Duration = Duration::from_secs(10);

/// The `metric_labels` key of a discovered endpoint's priority tier: `0`
/// for what a service uses first (its local endpoints, and in `balanced`
/// mode the best remote tier), a link's priority for that link's gateway.
/// A proxy uses the best tier that has a healthy endpoint.
pub const TIER_LABEL: &str = "tier";

/// What a client puts in `GetDestination.context_token` (JSON, beside any
/// keys of its own) to be sent every tier of a multicluster service, not
/// only the tier in use: `{"tether": {"tiers": true}}`. Clients that do not
/// ask (linkerd2-proxy) get only the endpoints of the best tier.
pub const TIERS_CONTEXT_TOKEN: &str = r#"{"tether":{"tiers":true}}"#;

/// Whether a `context_token` asks for every tier (see
/// [`TIERS_CONTEXT_TOKEN`]); anything unparsable, or longer than 4 KiB,
/// does not. (JSON is YAML, and this crate already reads YAML.)
pub fn wants_tiers(context_token: &str) -> bool {
    if context_token.len() > 4096 || !context_token.contains("tiers") {
        return false;
    }
    serde_yaml::from_str::<serde_yaml::Value>(context_token)
        .ok()
        .and_then(|v| v.get("tether")?.get("tiers")?.as_bool())
        .unwrap_or(false)
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryBudget {
    /// Retries allowed as a fraction of requests.
    pub ratio: f32,
    /// Retries always allowed per second.
    #[serde(default)]
    pub min_per_second: u32,
}

impl Eq for RetryBudget {}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointsDoc {
    /// The name of the service these endpoints belong to.
    pub service: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    pub endpoints: Vec<EndpointSpec>,
}

/// One registry document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Document {
    Service(ServiceDoc),
    Endpoints(EndpointsDoc),
    /// A route attached to one or more services (`kind: HTTPRoute` or
    /// `kind: GRPCRoute`), or to a `Server` (an inbound route).
    Route(Route),
    /// An authorization policy resource (`crate::policy`).
    Policy(PolicyDoc),
}

impl Document {
    /// The service a `Service` or `Endpoints` document is about; `None`
    /// for a route, which may attach to several ([`Document::mentions`]).
    pub fn service_key(&self) -> Option<ServiceKey> {
        match self {
            Document::Service(s) => Some(ServiceKey::new(&s.name, &s.namespace)),
            Document::Endpoints(e) => Some(ServiceKey::new(&e.service, &e.namespace)),
            Document::Route(_) | Document::Policy(_) => None,
        }
    }

    /// Every service the document says something about: its own, or a
    /// route's parents.
    pub fn mentions(&self) -> BTreeSet<ServiceKey> {
        match self {
            Document::Route(r) => r.parents(),
            _ => self.service_key().into_iter().collect(),
        }
    }

    pub fn endpoints(&self) -> &[EndpointSpec] {
        match self {
            Document::Service(s) => &s.endpoints,
            Document::Endpoints(e) => &e.endpoints,
            Document::Route(_) | Document::Policy(_) => &[],
        }
    }

    /// Renders the document as YAML, `kind` first.
    pub fn to_yaml(&self) -> String {
        let (kind, body) = match self {
            Document::Service(s) => ("Service", serde_yaml::to_string(s)),
            Document::Endpoints(e) => ("Endpoints", serde_yaml::to_string(e)),
            Document::Route(Route::Http(r)) => ("HTTPRoute", serde_yaml::to_string(r)),
            Document::Route(Route::Grpc(r)) => ("GRPCRoute", serde_yaml::to_string(r)),
            Document::Policy(p) => (p.kind().as_str(), p.body_yaml()),
        };
        format!(
            "kind: {kind}\n{}",
            body.expect("registry documents always serialize")
        )
    }
}

/// The longest identity, endpoint name, zone or global id a document may
/// carry: a DNS name's limit, so nothing longer reaches proxies or logs.
pub const MAX_NAME_BYTES: usize = 253;

/// Why a document was rejected. `document` counts from 1 within its file.
/// `message` is bounded ([`bounded_message`]): values it quotes are cut.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("document {document}: {message}")]
pub struct DocumentError {
    pub document: usize,
    pub message: String,
}

/// The document kinds a registry file may hold.
const KINDS: &str = "Service, Endpoints, HTTPRoute, GRPCRoute, Server, AuthorizationPolicy, \
    MeshTLSAuthentication, NetworkAuthentication or Namespace";

/// Parses every YAML document of one registry file, rejecting the file as a
/// whole if any document is invalid (a half-valid file is never served).
pub fn parse_documents(text: &str) -> Result<Vec<Document>, DocumentError> {
    crate::yaml::refuse_anchors(text).map_err(|message| DocumentError {
        document: 1,
        message,
    })?;
    if let Some(docs) = fast::endpoints_documents(text) {
        return Ok(docs);
    }
    parse_documents_generally(text)
}

/// [`parse_documents`] for any document: each read into a `Value` first,
/// then into its kind's type (errors name the field).
fn parse_documents_generally(text: &str) -> Result<Vec<Document>, DocumentError> {
    let mut docs = Vec::new();
    for (i, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let document = i + 1;
        let err = |message: String| DocumentError {
            document,
            message: bounded_message(message),
        };
        let value = serde_yaml::Value::deserialize(de).map_err(|e| DocumentError {
            document,
            message: bounded_message(e),
        })?;
        if value.is_null() {
            continue; // an empty document, e.g. a trailing `---`
        }
        let mut map = match value {
            serde_yaml::Value::Mapping(m) => m,
            _ => return Err(err("expected a mapping with a `kind` field".into())),
        };
        let kind = map
            .remove("kind")
            .ok_or_else(|| err(format!("missing field `kind` ({KINDS})")))?;
        let doc = match kind.as_str() {
            Some("Service") => from_mapping::<ServiceDoc>(map)
                .map(Document::Service)
                .map_err(|e| err(format!("Service: {e}")))?,
            Some("Endpoints") => from_mapping::<EndpointsDoc>(map)
                .map(Document::Endpoints)
                .map_err(|e| err(format!("Endpoints: {e}")))?,
            Some("HTTPRoute") => from_mapping::<HttpRouteDoc>(map)
                .map(|r| Document::Route(Route::Http(r)))
                .map_err(|e| err(format!("HTTPRoute: {e}")))?,
            Some("GRPCRoute") => from_mapping::<GrpcRouteDoc>(map)
                .map(|r| Document::Route(Route::Grpc(r)))
                .map_err(|e| err(format!("GRPCRoute: {e}")))?,
            Some(policy) if PolicyKind::from_kind(policy).is_some() => {
                let kind = PolicyKind::from_kind(policy).expect("checked");
                crate::policy::deserialize_policy(kind, map)
                    .map(Document::Policy)
                    .map_err(|e| err(format!("{policy}: {e}")))?
            }
            Some(other) => {
                return Err(err(format!(
                    "field `kind`: expected {KINDS}, got {}",
                    for_log(other)
                )))
            }
            None => {
                return Err(err(format!(
                    "field `kind`: expected {KINDS}, got a non-string"
                )))
            }
        };
        validate(&doc).map_err(err)?;
        docs.push(doc);
    }
    Ok(docs)
}

/// Parses and validates one route given as a mapping of its fields (a
/// Kubernetes route's `spec` with `name` and `namespace` added): the same
/// checks, and the same errors, as a route document in a registry file.
pub fn parse_route(kind: RouteKind, map: serde_yaml::Mapping) -> Result<Route, String> {
    let route = match kind {
        RouteKind::Http => from_mapping::<HttpRouteDoc>(map).map(Route::Http),
        RouteKind::Grpc => from_mapping::<GrpcRouteDoc>(map).map(Route::Grpc),
    }?;
    route.validate().map_err(bounded_message)?;
    Ok(route)
}

/// Deserializes a document body; errors start with the failing field's path
/// (`field `endpoints[2].address`: …`).
pub(crate) fn from_mapping<T: serde::de::DeserializeOwned>(
    map: serde_yaml::Mapping,
) -> Result<T, String> {
    serde_path_to_error::deserialize(serde_yaml::Value::Mapping(map)).map_err(|e| {
        // The path names keys of the input, which may be huge too.
        let path = bounded_message(e.path());
        let inner = e.into_inner();
        if path == "." {
            bounded_message(inner)
        } else {
            bounded_message(format_args!("field `{path}`: {inner}"))
        }
    })
}

/// Checks a free-form name (identity, endpoint name, zone) is not absurdly long.
fn check_length(field: &str, value: &str) -> Result<(), String> {
    if value.len() > MAX_NAME_BYTES {
        return Err(format!(
            "field `{field}`: {} is longer than {MAX_NAME_BYTES} bytes",
            for_log(value)
        ));
    }
    Ok(())
}

/// Checks what serde cannot: names, ports, weights. Messages start with the
/// field's path.
pub fn validate(doc: &Document) -> Result<(), String> {
    let (name_field, name, namespace) = match doc {
        Document::Service(s) => ("name", &s.name, &s.namespace),
        Document::Endpoints(e) => ("service", &e.service, &e.namespace),
        Document::Route(r) => return r.validate(),
        Document::Policy(p) => return p.validate(),
    };
    if !is_dns_label(name) {
        return Err(format!(
            "field `{name_field}`: {} is not a valid name (lowercase letters, digits and '-', at most 63)",
            for_log(name)
        ));
    }
    if !is_dns_label(namespace) {
        return Err(format!(
            "field `namespace`: {} is not a valid namespace",
            for_log(namespace)
        ));
    }
    if let Document::Service(s) = doc {
        if s.ports.is_empty() {
            return Err("field `ports`: a service needs at least one port".into());
        }
        let mut seen = BTreeSet::new();
        for (i, p) in s.ports.iter().enumerate() {
            if p.port == 0 {
                return Err(format!("field `ports[{i}].port`: must be 1-65535"));
            }
            if !seen.insert(p.port) {
                return Err(format!(
                    "field `ports[{i}].port`: port {} is listed twice",
                    p.port
                ));
            }
        }
        if let Some(g) = &s.global_id {
            check_length("global_id", g)?;
            if g.is_empty() || !g.split('.').all(is_dns_label) {
                return Err(format!(
                    "field `global_id`: {} is not a valid global id (lowercase DNS labels separated by dots)",
                    for_log(g)
                ));
            }
        }
        if let Some(b) = &s.retry_budget {
            if !(0.0..=10.0).contains(&b.ratio) {
                return Err("field `retry_budget.ratio`: must be between 0 and 10".into());
            }
        }
        if let Some(t) = &s.response_timeout {
            parse_duration(t).map_err(|e| format!("field `response_timeout`: {e}"))?;
        }
        for (i, ep) in s.endpoints.iter().enumerate() {
            if let Some(port) = ep.port {
                if !seen.contains(&port) {
                    return Err(format!(
                        "field `endpoints[{i}].port`: {port} is not one of the service's ports"
                    ));
                }
            }
        }
    }
    for (i, ep) in doc.endpoints().iter().enumerate() {
        if ep.address.port() == 0 {
            return Err(format!(
                "field `endpoints[{i}].address`: port must not be 0"
            ));
        }
        if ep.weight == 0 {
            return Err(format!("field `endpoints[{i}].weight`: must be at least 1"));
        }
        if ep.port == Some(0) {
            return Err(format!("field `endpoints[{i}].port`: must be 1-65535"));
        }
        if let Some(id) = &ep.identity {
            check_length(&format!("endpoints[{i}].identity"), id)?;
            if id.is_empty() || !id.split('.').all(|l| !l.is_empty()) {
                return Err(format!(
                    "field `endpoints[{i}].identity`: {} is not a DNS-like name",
                    for_log(id)
                ));
            }
        }
        for (field, value) in [("zone", &ep.zone), ("name", &ep.name)] {
            if let Some(value) = value {
                check_length(&format!("endpoints[{i}].{field}"), value)?;
            }
        }
        crate::policy::check_labels(&format!("endpoints[{i}].labels"), &ep.labels)?;
    }
    Ok(())
}

/// The longest duration a registry setting may name.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// A duration as operators write it: a number and a unit (`500ms`, `1.5s`,
/// `30s`, `5m`, `1h`), or `0`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("{} has no unit (ms, s, m, h)", for_log(text)))?;
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{} is not a duration such as 500ms or 30s", for_log(text)))?;
    let scale = match unit {
        "ms" => 0.001,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => {
            return Err(format!(
                "{} has an unknown unit (ms, s, m, h)",
                for_log(text)
            ))
        }
    };
    let secs = value * scale;
    if !(0.0..=MAX_DURATION.as_secs_f64()).contains(&secs) {
        return Err(format!("{} is longer than 24h", for_log(text)));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An endpoint's labels absent, empty, null or set read alike on the
    /// fast path and the general one, and render as they read (none when
    /// empty). (From a review of the labels made shared.)
    #[test]
    fn labels_read_alike_on_both_parsers_and_render_as_read() {
        for labels in [
            "",
            "\n    labels: {}",
            "\n    labels: null",
            "\n    labels: {app: web}",
            "\n    labels:\n      app: web",
        ] {
            let text = format!(
                "kind: Endpoints\nservice: web\nendpoints:\n  - address: 10.0.0.1:80\n    name: web-0{labels}\n"
            );
            let general = parse_documents_generally(&text);
            if let Some(fast) = fast::endpoints_documents(&text) {
                assert_eq!(Some(&fast), general.as_ref().ok(), "{labels:?}");
            }
            let Ok(docs) = general else {
                assert_eq!(labels, "\n    labels: null", "only null may be refused");
                continue;
            };
            let yaml = docs[0].to_yaml();
            assert_eq!(yaml.contains("labels"), labels.contains("app"), "{yaml}");
            assert_eq!(parse_documents(&yaml).unwrap(), docs, "{labels:?}");
        }
    }

    #[test]
    fn only_a_token_that_asks_gets_every_tier() {
        assert!(wants_tiers(TIERS_CONTEXT_TOKEN));
        assert!(wants_tiers(r#"{"ns":"shop","tether":{"tiers":true}}"#));
        // linkerd2-proxy's token, nothing, garbage.
        assert!(!wants_tiers(
            r#"{"ns":"shop","nodeName":"n1","pod":"web-0"}"#
        ));
        assert!(!wants_tiers(""));
        assert!(!wants_tiers("tiers: [[["));
        assert!(!wants_tiers(r#"{"tether":{"tiers":"yes"}}"#));
    }

    const GOOD: &str = r#"
kind: Service
name: web
namespace: demo
ports:
  - port: 8080
  - port: 5432
    opaque: true
endpoints:
  - address: 127.0.0.1:4143
    identity: web.demo.serviceaccount.identity.cluster.local
    zone: a
---
kind: Endpoints
service: web
namespace: demo
endpoints:
  - address: 127.0.0.2:4143
    ready: false
    port: 8080
"#;

    #[test]
    fn parses_services_and_endpoints() {
        let docs = parse_documents(GOOD).unwrap();
        assert_eq!(docs.len(), 2);
        let Document::Service(s) = &docs[0] else {
            panic!()
        };
        assert!(s.ports[1].opaque);
        assert_eq!(s.endpoints[0].weight, 1);
        assert!(s.endpoints[0].ready && s.endpoints[0].meshed);
        assert_eq!(docs[1].service_key(), Some(ServiceKey::new("web", "demo")));
        assert!(!docs[1].endpoints()[0].ready);
    }

    #[test]
    fn round_trips_through_yaml() {
        for doc in parse_documents(GOOD).unwrap() {
            assert_eq!(parse_documents(&doc.to_yaml()).unwrap(), vec![doc]);
        }
    }

    fn error_of(text: &str) -> String {
        parse_documents(text).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_field() {
        let e = error_of("kind: Service\nnamespace: demo\nports: [{port: 80}]\n");
        assert!(e.contains("missing field `name`"), "{e}");
        let e = error_of(
            "kind: Service\nname: web\nports: [{port: 80}]\nendpoints: [{adress: 1.2.3.4:80}]\n",
        );
        assert!(
            e.contains("unknown field `adress`") && e.contains("endpoints[0]"),
            "{e}"
        );
        let e = error_of(
            "kind: Service\nname: web\nports: [{port: 80}]\nendpoints: [{address: nope}]\n",
        );
        assert!(e.contains("field `endpoints[0].address`"), "{e}");
        let e = error_of("kind: Service\nname: Web\nports: [{port: 80}]\n");
        assert!(e.contains("field `name`"), "{e}");
        let e = error_of("kind: Service\nname: web\nports: []\n");
        assert!(e.contains("field `ports`"), "{e}");
        let e = error_of("kind: Service\nname: web\nports: [{port: 80}, {port: 80}]\n");
        assert!(e.contains("field `ports[1].port`"), "{e}");
        let e = error_of(
            "kind: Endpoints\nservice: web\nendpoints: [{address: 1.2.3.4:80, weight: 0}]\n",
        );
        assert!(e.contains("field `endpoints[0].weight`"), "{e}");
        let e = error_of("kind: Pod\nname: x\n");
        assert!(e.contains("field `kind`"), "{e}");
        let e = error_of("name: x\n");
        assert!(e.contains("missing field `kind`"), "{e}");
        let e = error_of(
            "kind: Service\nname: web\nports: [{port: 80}]\n---\nkind: Service\nname: [\n",
        );
        assert!(e.starts_with("document 2"), "{e}");
    }

    /// An endpoint's identity, zone and name, `Option<Arc<str>>`, read,
    /// fail and are written exactly as the `Option<String>` they replaced,
    /// on the general path (the error naming the field) and straight from
    /// text. (From the hostile review.)
    #[test]
    fn endpoint_strings_read_fail_and_write_as_strings_did() {
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Old {
            address: SocketAddr,
            #[serde(default, skip_serializing_if = "Option::is_none")]
            port: Option<u16>,
            #[serde(default = "yes")]
            ready: bool,
            #[serde(default, skip_serializing_if = "Option::is_none")]
            identity: Option<String>,
            #[serde(default, skip_serializing_if = "Option::is_none")]
            zone: Option<String>,
            #[serde(default = "one")]
            weight: u32,
            #[serde(default = "yes")]
            meshed: bool,
            #[serde(default, skip_serializing_if = "Option::is_none")]
            name: Option<String>,
            #[serde(default = "no_labels", skip_serializing_if = "has_no_labels")]
            labels: std::sync::Arc<crate::policy::Labels>,
        }
        let old_of = |e: EndpointSpec| Old {
            address: e.address,
            port: e.port,
            ready: e.ready,
            identity: e.identity.as_deref().map(String::from),
            zone: e.zone.as_deref().map(String::from),
            weight: e.weight,
            meshed: e.meshed,
            name: e.name.as_deref().map(String::from),
            labels: e.labels,
        };
        let values = [
            "web",
            "\"web\"",
            "80",
            "-1",
            "1.5",
            "true",
            "~",
            "null",
            "\"\"",
            "[a]",
            "{a: b}",
            "!t a",
            "!!str 80",
            "!!int 80",
            "'~'",
            "|\n  ab",
            "\"\\u0041\"",
            "\"\\xff\"",
        ];
        let mut checked = 0;
        for field in ["identity", "zone", "name"] {
            for v in values {
                let text = format!("address: 10.0.0.1:80\n{field}: {v}\n");
                let Ok(yaml) = serde_yaml::from_str::<serde_yaml::Value>(&text) else {
                    continue;
                };
                let serde_yaml::Value::Mapping(map) = yaml else {
                    panic!()
                };
                let new = from_mapping::<EndpointSpec>(map.clone()).map(old_of);
                let old = from_mapping::<Old>(map);
                assert_eq!(new, old, "{text}");
                // Straight from text, as serde_yaml reads it.
                let new = serde_yaml::from_str::<EndpointSpec>(&text)
                    .map(old_of)
                    .map_err(|e| e.to_string());
                let old = serde_yaml::from_str::<Old>(&text).map_err(|e| e.to_string());
                assert_eq!(new, old, "{text}");
                checked += 1;
            }
        }
        // Written alike.
        for text in [
            "address: 10.0.0.1:80\nidentity: a.b\nzone: z\nname: \"80\"\n",
            "address: 10.0.0.1:80\nzone: \"\"\nname: \"a: b\"\n",
        ] {
            let new: EndpointSpec = serde_yaml::from_str(text).unwrap();
            let old: Old = serde_yaml::from_str(text).unwrap();
            assert_eq!(
                serde_yaml::to_string(&new).unwrap(),
                serde_yaml::to_string(&old).unwrap()
            );
            assert_eq!(format!("{:?}", new.zone), format!("{:?}", old.zone));
        }
        assert!(checked > 30, "{checked}");
    }

    /// The longest error a document may produce, whatever it holds.
    const MAX_ERROR_BYTES: usize = 1024;

    #[test]
    fn huge_values_are_not_echoed_whole() {
        let huge = "a".repeat(1 << 20);
        for text in [
            format!("kind: Service\nname: {huge}\nports: [{{port: 80}}]\n"),
            format!("kind: {huge}\n"),
            format!("kind: Service\nname: web\nports: [{{port: 80}}]\n{huge}: 1\n"),
            format!("kind: Endpoints\nservice: web\nendpoints: [{{address: \"{huge}\"}}]\n"),
            format!("kind: Endpoints\nservice: web\nendpoints: [{{address: 1.2.3.4:80, identity: {huge}}}]\n"),
            format!("kind: Service\nname: web\nports: [{{port: 80}}]\nglobal_id: {huge}\n"),
            format!("kind: Service\nname: [{huge}\n"),
        ] {
            let e = error_of(&text);
            assert!(e.len() < MAX_ERROR_BYTES, "{} bytes: {}", e.len(), &e[..2000.min(e.len())]);
        }
        let e = error_of(&format!(
            "kind: Service\nname: {huge}\nports: [{{port: 80}}]\n"
        ));
        assert!(e.contains("aaaa…\" (1048576 bytes)"), "{e}");
    }

    #[test]
    fn names_are_bounded() {
        let long = format!("{}.b", "a".repeat(MAX_NAME_BYTES));
        let e = error_of(&format!(
            "kind: Endpoints\nservice: web\nendpoints: [{{address: 1.2.3.4:80, identity: {long}}}]\n"
        ));
        assert!(
            e.contains("field `endpoints[0].identity`") && e.contains("longer than 253"),
            "{e}"
        );
        let e = error_of(&format!(
            "kind: Endpoints\nservice: web\nendpoints: [{{address: 1.2.3.4:80, zone: {long}}}]\n"
        ));
        assert!(e.contains("field `endpoints[0].zone`"), "{e}");
    }

    /// The Endpoints fast path is taken for what writers produce, and
    /// gives what the general path gives.
    #[test]
    fn endpoints_documents_take_the_fast_path() {
        let doc = Document::Endpoints(EndpointsDoc {
            service: "web".into(),
            namespace: "demo".into(),
            endpoints: vec![
                EndpointSpec {
                    port: Some(8080),
                    ready: false,
                    identity: Some("web.demo.serviceaccount.identity.cluster.local".into()),
                    zone: Some("t1764489600000000000".into()),
                    weight: 7,
                    meshed: false,
                    name: Some("web-0".into()),
                    labels: std::sync::Arc::new([("app".to_string(), "web".to_string())].into()),
                    ..EndpointSpec::new("10.0.0.1:4143".parse().unwrap())
                },
                EndpointSpec::new("[::1]:80".parse().unwrap()),
            ],
        });
        let text = format!("{}---\n{}", doc.to_yaml(), doc.to_yaml());
        let fast = fast::endpoints_documents(&text).expect("the fast path reads it");
        assert_eq!(fast, vec![doc.clone(), doc]);
        assert_eq!(parse_documents_generally(&text).unwrap(), fast);
        let flow = "kind: Endpoints\nservice: web\nendpoints: [{address: 10.0.0.1:80}]\n";
        assert!(fast::endpoints_documents(flow).is_some());
        assert_eq!(
            parse_documents(flow).unwrap(),
            parse_documents_generally(flow).unwrap()
        );
    }

    /// The fast path holds an identity or zone its list repeats once; a
    /// list of more distinct values than are remembered still reads them
    /// all, each its own.
    #[test]
    fn an_endpoint_list_s_repeated_strings_are_held_once() {
        let endpoint = |i: usize, zone: String| EndpointSpec {
            identity: Some("web.demo.serviceaccount.identity.cluster.local".into()),
            zone: Some(zone.into()),
            name: Some(format!("web-{i}").into()),
            ..EndpointSpec::new(SocketAddr::from(([10, 0, 0, i as u8], 80)))
        };
        let endpoints = (0..40)
            .map(|i| endpoint(i, format!("zone-{}", if i < 20 { i % 2 } else { i })))
            .collect();
        let doc = Document::Endpoints(EndpointsDoc {
            service: "web".into(),
            namespace: "demo".into(),
            endpoints,
        });
        let read = fast::endpoints_documents(&doc.to_yaml()).expect("the fast path reads it");
        assert_eq!(read, vec![doc]);
        let Document::Endpoints(read) = &read[0] else {
            unreachable!()
        };
        let eps = &read.endpoints;
        let same = |a: &Option<std::sync::Arc<str>>, b: &Option<std::sync::Arc<str>>| {
            std::sync::Arc::ptr_eq(a.as_ref().unwrap(), b.as_ref().unwrap())
        };
        assert!(eps.iter().all(|e| same(&e.identity, &eps[0].identity)));
        assert!(same(&eps[0].zone, &eps[18].zone) && same(&eps[1].zone, &eps[19].zone));
        assert!(!same(&eps[0].zone, &eps[1].zone));
        assert_eq!(eps[39].zone.as_deref(), Some("zone-39"));
    }

    #[test]
    fn shared_strings_remember_a_bounded_number_of_values() {
        let mut shared = SharedStrings::default();
        let firsts: Vec<_> = (0..SharedStrings::HELD)
            .map(|i| shared.share(&format!("v{i}")))
            .collect();
        let late = shared.share("late");
        assert!(
            !std::sync::Arc::ptr_eq(&late, &shared.share("late")),
            "not held"
        );
        assert_eq!(&*late, "late");
        for (i, first) in firsts.iter().enumerate() {
            assert!(std::sync::Arc::ptr_eq(
                first,
                &shared.share(&format!("v{i}"))
            ));
        }
    }

    /// What the general path rejects, or reads differently from a direct
    /// reading (a plain `123` is a number to it, not a zone name), the fast
    /// path leaves to it: the same errors as before.
    #[test]
    fn the_fast_path_leaves_what_it_cannot_read_exactly_to_the_general_path() {
        let doc = |endpoint: &str| {
            format!("kind: Endpoints\nservice: web\nendpoints:\n  - address: 10.0.0.1:80\n    {endpoint}\n")
        };
        for text in [
            doc("zone: 123"),
            doc("name: true"),
            doc("port: \"80\""),
            doc("port: ~"),
            doc("weight: 1.5"),
            doc("weight: 0"),
            doc("ready: \"true\""),
            doc("zone: !custom a"),
            doc("labels: {app: web, app: db}"),
            doc("labels: {app: 1}"),
            doc("address: 10.0.0.1:81"),
            doc("adress: 10.0.0.1:81"),
            "kind: Endpoints\nservice: 1\nendpoints: []\n".to_string(),
            "kind: Endpoints\nservice: web\nservice: db\nendpoints: []\n".to_string(),
            "kind: Endpoints\nservice: web\nendpoints: ~\n".to_string(),
            "kind: Endpoints\nservice: web\n".to_string(),
            "kind: Service\nname: web\nports: [{port: 80}]\n".to_string(),
            "---\n".to_string(),
        ] {
            assert!(fast::endpoints_documents(&text).is_none(), "{text}");
            assert_eq!(
                parse_documents(&text),
                parse_documents_generally(&text),
                "{text}"
            );
        }
        // A plain number where a name goes is an error, as it always was.
        let e = error_of(&doc("zone: 123"));
        assert!(e.contains("endpoints[0].zone"), "{e}");
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        /// Fragments of registry documents, so random input reaches past the
        /// YAML parser into the field checks, plus raw noise.
        fn registry_text() -> impl Strategy<Value = String> {
            let fragment = prop_oneof![
                Just("kind: Service\n".to_string()),
                Just("kind: Endpoints\n".to_string()),
                Just("kind: HTTPRoute\n".to_string()),
                Just("kind: GRPCRoute\n".to_string()),
                Just("kind: Server\npodSelector: {matchLabels: {app: web}}\nport: 80\n".to_string()),
                Just("kind: AuthorizationPolicy\ntargetRef: {group: policy.linkerd.io, kind: Server, name: s}\n".to_string()),
                Just("requiredAuthenticationRefs: [{kind: ServiceAccount, name: a}]\n".to_string()),
                Just("kind: MeshTLSAuthentication\nidentities: [\"*\"]\n".to_string()),
                Just("kind: NetworkAuthentication\nnetworks: [{cidr: 10.0.0.0/8}]\n".to_string()),
                Just("kind: Namespace\ndefaultInboundPolicy: deny\n".to_string()),
                Just("parentRefs: [{name: web}]\n".to_string()),
                Just(
                    "rules:\n  - matches: [{path: {type: RegularExpression, value: \"(a+)+\"}}]\n"
                        .to_string()
                ),
                Just("    backendRefs: [{name: web, weight: 5}]\n".to_string()),
                Just("---\n".to_string()),
                Just("name: web\n".to_string()),
                Just("service: web\n".to_string()),
                Just("ports: [{port: 80}]\n".to_string()),
                Just("endpoints:\n  - address: 127.0.0.1:80\n".to_string()),
                Just("    identity: ".to_string()),
                Just("    weight: 0\n".to_string()),
                "[a-z_]{1,8}: [a-z0-9.:\\[\\]{}\"-]{0,12}\n",
                any::<String>(),
                // One long value where an echo would show: a field's value.
                (
                    prop::sample::select(vec![
                        "kind",
                        "name",
                        "namespace",
                        "global_id",
                        "    identity",
                        "    zone",
                        "  - address",
                        "    adress"
                    ]),
                    0usize..20_000,
                    prop_oneof![Just('a'), Just('.'), any::<char>()],
                )
                    .prop_map(|(key, n, c)| {
                        format!("{key}: {}\n", std::iter::repeat_n(c, n).collect::<String>())
                    }),
            ];
            proptest::collection::vec(fragment, 0..12).prop_map(|v| v.concat())
        }

        /// Endpoints documents whose fields take every form a scalar may
        /// take (quoted, plain, numeric, boolean, null, tagged, repeated).
        fn endpoints_text() -> impl Strategy<Value = String> {
            let value = prop::sample::select(vec![
                "web",
                "\"web\"",
                "'web'",
                "80",
                "\"80\"",
                "0x50",
                "-1",
                "70000",
                "4294967296",
                "1.5",
                "true",
                "false",
                "yes",
                "~",
                "null",
                "\"\"",
                "!t a",
                "a b",
                "[a]",
                "{a: b}",
                "10.0.0.1:80",
                "\"10.0.0.1:80\"",
                "\"[::1]:80\"",
                "web.demo.cluster.local",
                "{app: web}",
                "{app: web, app: db}",
                "{app: 1}",
                "{}",
                // Core-schema tags, other integer forms, block scalars and
                // what YAML 1.1 (not serde_yaml) reads as dates or times:
                // the same events, resolved the same way on both paths.
                "!!str 80",
                "!!int 80",
                "!!bool true",
                "+5",
                "0o7",
                "'~'",
                "|\n      ab",
                ">-\n      ab",
                "2001-12-14",
                "12:30",
                "\"\\u0041\"",
            ]);
            let key = prop::sample::select(vec![
                "address", "port", "ready", "identity", "zone", "weight", "meshed", "name",
                "labels", "adress", "\"zone\"",
            ]);
            let endpoint = (
                prop::sample::select(vec!["10.0.0.1:80", "10.0.0.2:80", "\"10.0.0.3:80\"", "80"]),
                proptest::collection::vec((key, value.clone()), 0..5),
            )
                .prop_map(|(address, fields)| {
                    let mut text = format!("  - address: {address}\n");
                    for (k, v) in fields {
                        text.push_str(&format!("    {k}: {v}\n"));
                    }
                    text
                });
            let header = prop::sample::select(vec![
                "kind: Endpoints\nservice: web\n",
                "kind: Endpoints\nservice: web\nnamespace: demo\n",
                "service: web\nkind: Endpoints\n",
                "kind: Endpoints\nservice: 80\n",
                "kind: Endpoints\nservice: web\nkind: Endpoints\n",
                "kind: \"Endpoints\"\nservice: \"web\"\n",
                "kind: !!str Endpoints\nservice: web\n",
                "kind: Service\nname: web\nports: [{port: 80}]\n",
            ]);
            let document = (header, proptest::collection::vec(endpoint, 0..4)).prop_map(
                |(header, endpoints)| format!("{header}endpoints:\n{}", endpoints.concat()),
            );
            proptest::collection::vec(document, 1..3).prop_map(|docs| docs.join("---\n"))
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            #[test]
            fn parsing_never_panics_and_errors_are_bounded(text in registry_text()) {
                if let Err(e) = parse_documents(&text) {
                    let e = e.to_string();
                    prop_assert!(e.len() < super::MAX_ERROR_BYTES, "{} bytes", e.len());
                }
            }

            #[test]
            fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
                let text = String::from_utf8_lossy(&bytes);
                if let Err(e) = parse_documents(&text) {
                    prop_assert!(e.to_string().len() < super::MAX_ERROR_BYTES);
                }
            }

            /// Whatever Endpoints text the fast path accepts, the general
            /// path reads the same.
            #[test]
            fn the_fast_path_reads_what_the_general_path_reads(text in endpoints_text()) {
                if let Some(fast) = fast::endpoints_documents(&text) {
                    prop_assert_eq!(Ok(fast), parse_documents_generally(&text), "{}", text);
                }
            }

            #[test]
            fn accepted_documents_round_trip(text in registry_text()) {
                if let Ok(docs) = parse_documents(&text) {
                    for doc in docs {
                        prop_assert_eq!(parse_documents(&doc.to_yaml()).unwrap(), vec![doc]);
                    }
                }
            }
        }
    }

    #[test]
    fn empty_file_is_no_documents() {
        assert_eq!(parse_documents("").unwrap(), vec![]);
        assert_eq!(parse_documents("---\n").unwrap(), vec![]);
    }

    #[test]
    fn durations_as_operators_write_them() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        for bad in ["", "5", "5d", "-1s", "1e9s", "25h", "s", "1..2s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        let long = "9".repeat(10_000) + "s";
        assert!(parse_duration(&long).unwrap_err().len() < 200);
    }
}
