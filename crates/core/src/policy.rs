//! Authorization policy documents: who may call a workload's port.
//!
//! The resources and their semantics are Linkerd's `policy.linkerd.io`
//! (`docs/policy.md` is the reference):
//!
//! - `Server`: the port(s) of the workloads its `podSelector` selects, with
//!   their protocol and the `accessPolicy` that applies when no
//!   authorization matches.
//! - `AuthorizationPolicy`: a target (a `Server`, an inbound `HTTPRoute` /
//!   `GRPCRoute`, or the whole `Namespace`) and the authentications a client
//!   needs (`MeshTLSAuthentication`, `NetworkAuthentication`,
//!   `ServiceAccount`), all of which must hold.
//! - `MeshTLSAuthentication`: client identities (literal, `*`, `*.suffix`)
//!   or service accounts / namespaces they belong to.
//! - `NetworkAuthentication`: client networks (CIDR with exceptions).
//! - `Namespace`: the namespace's default policy (Kubernetes: the
//!   `config.linkerd.io/default-inbound-policy` annotation).
//!
//! In a registry file each is a document with `kind`, `name`, `namespace`
//! and the resource's `spec` fields beside them (the way `HTTPRoute` is
//! written there); Kubernetes objects are parsed by the same code from
//! their `spec` with `name` and `namespace` added ([`parse_policy`]).

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::authority::is_dns_label;
use crate::route::{check_count, Route, RouteKey};
use crate::truncate::for_log;

/// Linkerd's policy API group.
pub const POLICY_GROUP: &str = "policy.linkerd.io";
/// The Gateway API's group (routes may be targeted under either).
pub const GATEWAY_GROUP: &str = "gateway.networking.k8s.io";

/// Bounds on what one document may list, so a policy stays cheap to serve.
pub const MAX_REFS: usize = 16;
pub const MAX_IDENTITIES: usize = 256;
pub const MAX_NETWORKS: usize = 256;
pub const MAX_SELECTOR_TERMS: usize = 32;
pub const MAX_LABELS: usize = 64;

fn default_namespace() -> String {
    "default".to_string()
}

/// A default (or a `Server`'s access) policy: what applies when no
/// authorization says otherwise.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default,
)]
#[serde(rename_all = "kebab-case")]
pub enum DefaultPolicy {
    #[default]
    AllUnauthenticated,
    AllAuthenticated,
    ClusterUnauthenticated,
    ClusterAuthenticated,
    Deny,
    /// Everything is allowed, and what another policy would deny is
    /// reported (the proxy logs and counts it) — for rolling a policy out.
    Audit,
}

impl DefaultPolicy {
    pub const ALL: [DefaultPolicy; 6] = [
        Self::AllUnauthenticated,
        Self::AllAuthenticated,
        Self::ClusterUnauthenticated,
        Self::ClusterAuthenticated,
        Self::Deny,
        Self::Audit,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::AllUnauthenticated => "all-unauthenticated",
            Self::AllAuthenticated => "all-authenticated",
            Self::ClusterUnauthenticated => "cluster-unauthenticated",
            Self::ClusterAuthenticated => "cluster-authenticated",
            Self::Deny => "deny",
            Self::Audit => "audit",
        }
    }
}

impl std::fmt::Display for DefaultPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DefaultPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown policy {}: expected all-unauthenticated, all-authenticated, \
                     cluster-unauthenticated, cluster-authenticated, deny or audit",
                    for_log(s)
                )
            })
    }
}

/// An IP network, `ADDR/PREFIX` (a bare address is a /32 or /128).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    /// Every address of `addr`'s family.
    pub fn all(addr: IpAddr) -> Self {
        Self { addr, prefix: 0 }
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{} is not a network such as 10.0.0.0/8", for_log(s));
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p.parse::<u8>().ok().filter(|p| *p <= max).ok_or_else(bad)?,
            None => max,
        };
        Ok(Self { addr, prefix })
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl Serialize for Cidr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// The Kubernetes label selector (`matchLabels`, `matchExpressions`); an
/// empty selector selects every workload of the namespace.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LabelSelector {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<LabelRequirement>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LabelRequirement {
    pub key: String,
    pub operator: LabelOperator,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LabelOperator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

pub type Labels = BTreeMap<String, String>;

impl LabelSelector {
    pub fn matches(&self, labels: &Labels) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|e| {
                let value = labels.get(&e.key);
                match e.operator {
                    LabelOperator::In => value.is_some_and(|v| e.values.contains(v)),
                    LabelOperator::NotIn => value.is_none_or(|v| !e.values.contains(v)),
                    LabelOperator::Exists => value.is_some(),
                    LabelOperator::DoesNotExist => value.is_none(),
                }
            })
    }

    fn validate(&self, field: &str) -> Result<(), String> {
        check_labels(&format!("{field}.matchLabels"), &self.match_labels)?;
        check_count(
            &format!("{field}.matchExpressions"),
            self.match_expressions.len(),
            MAX_SELECTOR_TERMS,
        )?;
        for (i, e) in self.match_expressions.iter().enumerate() {
            let f = format!("{field}.matchExpressions[{i}]");
            check_label_part(&format!("{f}.key"), &e.key)?;
            check_count(&format!("{f}.values"), e.values.len(), MAX_SELECTOR_TERMS)?;
            for v in &e.values {
                check_label_part(&format!("{f}.values"), v)?;
            }
            let wants_values = matches!(e.operator, LabelOperator::In | LabelOperator::NotIn);
            if wants_values == e.values.is_empty() {
                return Err(format!(
                    "field `{f}.values`: {:?} {}",
                    e.operator,
                    if wants_values {
                        "needs at least one value"
                    } else {
                        "takes no values"
                    }
                ));
            }
        }
        Ok(())
    }
}

/// Checks a workload's labels (an endpoint's, a selector's): bounded count
/// and lengths.
pub fn check_labels(field: &str, labels: &Labels) -> Result<(), String> {
    check_count(field, labels.len(), MAX_LABELS)?;
    for (k, v) in labels {
        check_label_part(field, k)?;
        check_label_part(field, v)?;
    }
    Ok(())
}

fn check_label_part(field: &str, value: &str) -> Result<(), String> {
    if value.len() > crate::registry::MAX_NAME_BYTES || value.chars().any(char::is_control) {
        return Err(format!(
            "field `{field}`: {} is not a label key or value",
            for_log(value)
        ));
    }
    Ok(())
}

fn check_name(field: &str, value: &str) -> Result<(), String> {
    let ok = value.len() <= 253 && !value.is_empty() && value.split('.').all(is_dns_label);
    if !ok {
        return Err(format!(
            "field `{field}`: {} is not a valid name (lowercase DNS labels separated by dots)",
            for_log(value)
        ));
    }
    Ok(())
}

fn check_namespace(field: &str, value: &str) -> Result<(), String> {
    if !is_dns_label(value) {
        return Err(format!(
            "field `{field}`: {} is not a valid namespace",
            for_log(value)
        ));
    }
    Ok(())
}

/// A `Server`'s port: a number, or a container port's name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ServerPort {
    Number(u16),
    Name(String),
}

/// How the proxy treats a `Server`'s connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ProxyProtocol {
    /// Detected on the first bytes.
    #[default]
    #[serde(rename = "unknown")]
    Unknown,
    #[serde(rename = "HTTP/1")]
    Http1,
    #[serde(rename = "HTTP/2")]
    Http2,
    #[serde(rename = "gRPC")]
    Grpc,
    #[serde(rename = "opaque")]
    Opaque,
    #[serde(rename = "TLS")]
    Tls,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ServerDoc {
    pub name: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    pub pod_selector: LabelSelector,
    pub port: ServerPort,
    #[serde(default)]
    pub proxy_protocol: ProxyProtocol,
    /// What applies to a client no authorization admits; absent: `deny`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_policy: Option<DefaultPolicy>,
}

/// A reference to another resource (`targetRef`, `requiredAuthenticationRefs`,
/// `identityRefs`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PolicyRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    pub kind: String,
    pub name: String,
    /// Absent: the referring document's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

impl PolicyRef {
    fn group(&self) -> &str {
        self.group.as_deref().unwrap_or("")
    }

    /// Whether the reference is to `kind` in one of `groups` (`""` also
    /// accepting `core`).
    fn is(&self, kind: &str, groups: &[&str]) -> bool {
        let group = match self.group() {
            "core" => "",
            g => g,
        };
        self.kind == kind && groups.contains(&group)
    }

    pub fn namespace_or<'a>(&'a self, own: &'a str) -> &'a str {
        self.namespace.as_deref().unwrap_or(own)
    }
}

/// What an `AuthorizationPolicy` applies to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    Server(String),
    Route(RouteKey),
    Namespace,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AuthorizationPolicyDoc {
    pub name: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    pub target_ref: PolicyRef,
    pub required_authentication_refs: Vec<PolicyRef>,
}

/// What an `AuthorizationPolicy` requires, its references resolved by kind.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Requirements {
    /// A `MeshTLSAuthentication` (namespace, name).
    pub mesh_tls: Option<(String, String)>,
    /// `ServiceAccount`s (namespace, name) whose identities are admitted.
    pub service_accounts: Vec<(String, String)>,
    /// A `NetworkAuthentication` (namespace, name).
    pub network: Option<(String, String)>,
}

impl AuthorizationPolicyDoc {
    pub fn target(&self) -> Target {
        let r = &self.target_ref;
        if r.is("Server", &[POLICY_GROUP]) {
            Target::Server(r.name.clone())
        } else if r.is("Namespace", &[""]) {
            Target::Namespace
        } else {
            let kind = if r.kind == "GRPCRoute" {
                crate::route::RouteKind::Grpc
            } else {
                crate::route::RouteKind::Http
            };
            Target::Route(RouteKey {
                kind,
                namespace: self.namespace.clone(),
                name: r.name.clone(),
            })
        }
    }

    pub fn requirements(&self) -> Requirements {
        let mut req = Requirements::default();
        for r in &self.required_authentication_refs {
            let key = (r.namespace_or(&self.namespace).to_string(), r.name.clone());
            if r.kind == "MeshTLSAuthentication" {
                req.mesh_tls = Some(key);
            } else if r.kind == "NetworkAuthentication" {
                req.network = Some(key);
            } else {
                req.service_accounts.push(key);
            }
        }
        req
    }

    fn validate(&self) -> Result<(), String> {
        let t = &self.target_ref;
        let target_ok = t.is("Server", &[POLICY_GROUP])
            || t.is("HTTPRoute", &[POLICY_GROUP, GATEWAY_GROUP])
            || t.is("GRPCRoute", &[GATEWAY_GROUP])
            || t.is("Namespace", &[""]);
        if !target_ok {
            return Err(format!(
                "field `targetRef`: {}/{} is not a target; expected a Server or HTTPRoute \
                 (group policy.linkerd.io), an HTTPRoute or GRPCRoute (group gateway.networking.k8s.io) \
                 or a Namespace (group \"\")",
                for_log(t.group()),
                for_log(&t.kind)
            ));
        }
        if t.namespace
            .as_deref()
            .is_some_and(|ns| ns != self.namespace)
        {
            return Err(
                "field `targetRef.namespace`: a policy targets resources of its own namespace"
                    .into(),
            );
        }
        if t.kind == "Namespace" {
            check_namespace("targetRef.name", &t.name)?;
            if t.name != self.namespace {
                return Err(format!(
                    "field `targetRef.name`: a policy may target only its own namespace ({})",
                    for_log(&self.namespace)
                ));
            }
        } else {
            check_name("targetRef.name", &t.name)?;
        }
        let refs = &self.required_authentication_refs;
        if refs.is_empty() {
            return Err(
                "field `requiredAuthenticationRefs`: at least one authentication is required \
                 (a NetworkAuthentication of 0.0.0.0/0 and ::/0 admits everyone)"
                    .into(),
            );
        }
        check_count("requiredAuthenticationRefs", refs.len(), MAX_REFS)?;
        let (mut mesh_tls, mut accounts, mut networks) = (0, 0, 0);
        for (i, r) in refs.iter().enumerate() {
            let f = format!("requiredAuthenticationRefs[{i}]");
            if r.is("MeshTLSAuthentication", &[POLICY_GROUP]) {
                mesh_tls += 1;
            } else if r.is("NetworkAuthentication", &[POLICY_GROUP]) {
                networks += 1;
            } else if r.is("ServiceAccount", &[""]) {
                accounts += 1;
            } else {
                return Err(format!(
                    "field `{f}`: {}/{} is not an authentication; expected MeshTLSAuthentication or \
                     NetworkAuthentication (group policy.linkerd.io) or ServiceAccount (group \"\")",
                    for_log(r.group()),
                    for_log(&r.kind)
                ));
            }
            check_name(&format!("{f}.name"), &r.name)?;
            if let Some(ns) = &r.namespace {
                check_namespace(&format!("{f}.namespace"), ns)?;
            }
        }
        if mesh_tls > 1 || networks > 1 || (mesh_tls == 1 && accounts > 0) {
            return Err(
                "field `requiredAuthenticationRefs`: at most one MeshTLSAuthentication \
                 (or ServiceAccounts instead of it) and at most one NetworkAuthentication"
                    .into(),
            );
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MeshTlsAuthenticationDoc {
    pub name: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Identities: literal, `*` (every identity of the trust root), or
    /// `*.suffix`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub identities: Vec<String>,
    /// `ServiceAccount`s, or `Namespace`s (every account in them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub identity_refs: Vec<PolicyRef>,
}

impl MeshTlsAuthenticationDoc {
    fn validate(&self) -> Result<(), String> {
        if self.identities.is_empty() == self.identity_refs.is_empty() {
            return Err("field `identities`: give either identities or identityRefs".into());
        }
        check_count("identities", self.identities.len(), MAX_IDENTITIES)?;
        for (i, id) in self.identities.iter().enumerate() {
            let name = id.strip_prefix("*.").unwrap_or(id);
            let ok = id == "*"
                || (id.len() <= crate::registry::MAX_NAME_BYTES
                    && name
                        .split('.')
                        .all(|l| !l.is_empty() && l.len() <= 63 && !l.contains(['*', ' '])));
            if !ok {
                return Err(format!(
                    "field `identities[{i}]`: {} is not an identity (a DNS-like name, `*`, or `*.suffix`)",
                    for_log(id)
                ));
            }
        }
        check_count("identityRefs", self.identity_refs.len(), MAX_REFS)?;
        for (i, r) in self.identity_refs.iter().enumerate() {
            let f = format!("identityRefs[{i}]");
            if r.is("ServiceAccount", &[""]) {
                check_name(&format!("{f}.name"), &r.name)?;
            } else if r.is("Namespace", &[""]) {
                check_namespace(&format!("{f}.name"), &r.name)?;
            } else {
                return Err(format!(
                    "field `{f}.kind`: {} is not supported; expected ServiceAccount or Namespace",
                    for_log(&r.kind)
                ));
            }
            if let Some(ns) = &r.namespace {
                check_namespace(&format!("{f}.namespace"), ns)?;
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NetworkAuthenticationDoc {
    pub name: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    pub networks: Vec<NetworkSpec>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NetworkSpec {
    pub cidr: Cidr,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub except: Vec<Cidr>,
}

/// A namespace's policy settings (Kubernetes: its annotations).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NamespaceDoc {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_inbound_policy: Option<DefaultPolicy>,
}

/// One policy document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PolicyDoc {
    Server(ServerDoc),
    AuthorizationPolicy(AuthorizationPolicyDoc),
    MeshTlsAuthentication(MeshTlsAuthenticationDoc),
    NetworkAuthentication(NetworkAuthenticationDoc),
    Namespace(NamespaceDoc),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PolicyKind {
    Server,
    AuthorizationPolicy,
    MeshTlsAuthentication,
    NetworkAuthentication,
    Namespace,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 5] = [
        Self::Server,
        Self::AuthorizationPolicy,
        Self::MeshTlsAuthentication,
        Self::NetworkAuthentication,
        Self::Namespace,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Server => "Server",
            Self::AuthorizationPolicy => "AuthorizationPolicy",
            Self::MeshTlsAuthentication => "MeshTLSAuthentication",
            Self::NetworkAuthentication => "NetworkAuthentication",
            Self::Namespace => "Namespace",
        }
    }

    pub fn from_kind(kind: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == kind)
    }
}

/// Which policy document: kind, namespace (empty for a `Namespace`) and
/// name. Two files naming the same one follow "first path wins".
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKey {
    pub kind: PolicyKind,
    pub namespace: String,
    pub name: String,
}

impl PolicyKey {
    pub fn new(kind: PolicyKind, namespace: &str, name: &str) -> Self {
        Self {
            kind,
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }
}

impl std::fmt::Display for PolicyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.kind == PolicyKind::Namespace {
            write!(f, "Namespace {}", self.name)
        } else {
            write!(f, "{} {}/{}", self.kind.as_str(), self.namespace, self.name)
        }
    }
}

impl PolicyDoc {
    pub fn kind(&self) -> PolicyKind {
        match self {
            Self::Server(_) => PolicyKind::Server,
            Self::AuthorizationPolicy(_) => PolicyKind::AuthorizationPolicy,
            Self::MeshTlsAuthentication(_) => PolicyKind::MeshTlsAuthentication,
            Self::NetworkAuthentication(_) => PolicyKind::NetworkAuthentication,
            Self::Namespace(_) => PolicyKind::Namespace,
        }
    }

    pub fn key(&self) -> PolicyKey {
        let (namespace, name) = match self {
            Self::Server(d) => (d.namespace.as_str(), &d.name),
            Self::AuthorizationPolicy(d) => (d.namespace.as_str(), &d.name),
            Self::MeshTlsAuthentication(d) => (d.namespace.as_str(), &d.name),
            Self::NetworkAuthentication(d) => (d.namespace.as_str(), &d.name),
            Self::Namespace(d) => ("", &d.name),
        };
        PolicyKey::new(self.kind(), namespace, name)
    }

    /// The document's fields as YAML (without `kind`).
    pub fn body_yaml(&self) -> Result<String, serde_yaml::Error> {
        match self {
            Self::Server(d) => serde_yaml::to_string(d),
            Self::AuthorizationPolicy(d) => serde_yaml::to_string(d),
            Self::MeshTlsAuthentication(d) => serde_yaml::to_string(d),
            Self::NetworkAuthentication(d) => serde_yaml::to_string(d),
            Self::Namespace(d) => serde_yaml::to_string(d),
        }
    }

    /// Checks what serde cannot; the message starts with the field.
    pub fn validate(&self) -> Result<(), String> {
        let key = self.key();
        if self.kind() == PolicyKind::Namespace {
            check_namespace("name", &key.name)?;
        } else {
            check_name("name", &key.name)?;
            check_namespace("namespace", &key.namespace)?;
        }
        match self {
            Self::Server(d) => {
                d.pod_selector.validate("podSelector")?;
                match &d.port {
                    ServerPort::Number(0) => Err("field `port`: must be 1-65535".into()),
                    ServerPort::Name(n) if !is_dns_label(n) || n.len() > 15 => Err(format!(
                        "field `port`: {} is neither a port number nor a port name",
                        for_log(n)
                    )),
                    // A Server that matched no port would leave the port to
                    // the default policy: fail open, silently.
                    ServerPort::Name(n) => Err(format!(
                        "field `port`: named ports ({n}) are not resolved yet: use the port number"
                    )),
                    _ => Ok(()),
                }
            }
            Self::AuthorizationPolicy(d) => d.validate(),
            Self::MeshTlsAuthentication(d) => d.validate(),
            Self::NetworkAuthentication(d) => {
                if d.networks.is_empty() {
                    return Err("field `networks`: at least one network is required".into());
                }
                check_count("networks", d.networks.len(), MAX_NETWORKS)?;
                for (i, n) in d.networks.iter().enumerate() {
                    check_count(
                        &format!("networks[{i}].except"),
                        n.except.len(),
                        MAX_NETWORKS,
                    )?;
                }
                Ok(())
            }
            Self::Namespace(_) => Ok(()),
        }
    }
}

/// Parses one policy resource from its fields (a registry document without
/// `kind`, or a Kubernetes object's `spec` with `name` and `namespace`
/// added), validated. Errors start with the failing field.
pub fn parse_policy(kind: PolicyKind, map: serde_yaml::Mapping) -> Result<PolicyDoc, String> {
    let doc = deserialize_policy(kind, map)?;
    doc.validate().map_err(crate::truncate::bounded_message)?;
    Ok(doc)
}

/// Deserializes a policy document's fields, unvalidated.
pub(crate) fn deserialize_policy(
    kind: PolicyKind,
    map: serde_yaml::Mapping,
) -> Result<PolicyDoc, String> {
    use crate::registry::from_mapping;
    match kind {
        PolicyKind::Server => from_mapping(map).map(PolicyDoc::Server),
        PolicyKind::AuthorizationPolicy => from_mapping(map).map(PolicyDoc::AuthorizationPolicy),
        PolicyKind::MeshTlsAuthentication => {
            from_mapping(map).map(PolicyDoc::MeshTlsAuthentication)
        }
        PolicyKind::NetworkAuthentication => {
            from_mapping(map).map(PolicyDoc::NetworkAuthentication)
        }
        PolicyKind::Namespace => from_mapping(map).map(PolicyDoc::Namespace),
    }
}

/// A workload (pod): its namespace and name, as a proxy names itself in
/// `InboundServerPolicies` requests and the registry names an endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkloadKey {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for WorkloadKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Every policy resource of a registry, plus the routes attached to
/// servers: what inbound policies are built from. Replicas given the same
/// documents hold the same set.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct PolicySet {
    pub docs: BTreeMap<PolicyKey, PolicyDoc>,
    /// Routes whose `parentRefs` name a `Server`.
    pub server_routes: BTreeMap<RouteKey, Route>,
}

impl PolicySet {
    pub fn get(&self, kind: PolicyKind, namespace: &str, name: &str) -> Option<&PolicyDoc> {
        self.docs.get(&PolicyKey::new(kind, namespace, name))
    }

    /// The documents of one kind in one namespace, by name.
    pub fn in_namespace<'a>(
        &'a self,
        kind: PolicyKind,
        namespace: &'a str,
    ) -> impl Iterator<Item = &'a PolicyDoc> + 'a {
        let start = PolicyKey::new(kind, namespace, "");
        self.docs
            .range(start..)
            .take_while(move |(k, _)| k.kind == kind && k.namespace == namespace)
            .map(|(_, d)| d)
    }

    /// A namespace's default policy, if it sets one.
    pub fn namespace_default(&self, namespace: &str) -> Option<DefaultPolicy> {
        match self.get(PolicyKind::Namespace, "", namespace) {
            Some(PolicyDoc::Namespace(n)) => n.default_inbound_policy,
            _ => None,
        }
    }

    /// The names of every kind of resource, for logs.
    pub fn len(&self) -> usize {
        self.docs.len() + self.server_routes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{parse_documents, Document};

    fn policy(text: &str) -> Result<PolicyDoc, String> {
        let docs = parse_documents(text).map_err(|e| e.to_string())?;
        match docs.into_iter().next() {
            Some(Document::Policy(p)) => Ok(p),
            other => panic!("not a policy: {other:?}"),
        }
    }

    const ALL: &str = r#"
kind: Server
name: web-http
namespace: demo
podSelector:
  matchLabels: {app: web}
  matchExpressions: [{key: tier, operator: In, values: [front]}]
port: 8080
proxyProtocol: HTTP/1
accessPolicy: audit
---
kind: AuthorizationPolicy
name: web-from-gw
namespace: demo
targetRef: {group: policy.linkerd.io, kind: Server, name: web-http}
requiredAuthenticationRefs:
  - {group: policy.linkerd.io, kind: MeshTLSAuthentication, name: gw}
  - {group: policy.linkerd.io, kind: NetworkAuthentication, name: cluster}
---
kind: MeshTLSAuthentication
name: gw
namespace: demo
identities: ["gw.demo.serviceaccount.identity.cluster.local", "*.ops.serviceaccount.identity.cluster.local", "*"]
---
kind: NetworkAuthentication
name: cluster
namespace: demo
networks: [{cidr: 10.0.0.0/8, except: [10.1.0.0/16]}, {cidr: "::/0"}]
---
kind: Namespace
name: demo
defaultInboundPolicy: all-authenticated
"#;

    #[test]
    fn parses_every_kind_and_round_trips() {
        let docs = parse_documents(ALL).unwrap();
        assert_eq!(docs.len(), 5);
        let Document::Policy(PolicyDoc::Server(s)) = &docs[0] else {
            panic!()
        };
        assert_eq!(s.proxy_protocol, ProxyProtocol::Http1);
        assert_eq!(s.access_policy, Some(DefaultPolicy::Audit));
        assert_eq!(s.port, ServerPort::Number(8080));
        let Document::Policy(PolicyDoc::AuthorizationPolicy(a)) = &docs[1] else {
            panic!()
        };
        assert_eq!(a.target(), Target::Server("web-http".into()));
        assert_eq!(
            a.requirements().mesh_tls,
            Some(("demo".into(), "gw".into()))
        );
        let Document::Policy(PolicyDoc::NetworkAuthentication(n)) = &docs[3] else {
            panic!()
        };
        assert_eq!(n.networks[0].except[0].to_string(), "10.1.0.0/16");
        assert_eq!(n.networks[1].cidr.to_string(), "::/0");
        for doc in docs {
            assert_eq!(parse_documents(&doc.to_yaml()).unwrap(), vec![doc]);
        }
    }

    #[test]
    fn selectors_match_like_kubernetes() {
        let sel: LabelSelector = serde_yaml::from_str(
            "matchLabels: {app: web}\nmatchExpressions: [{key: tier, operator: NotIn, values: [db]}, {key: canary, operator: DoesNotExist}]",
        )
        .unwrap();
        let labels = |pairs: &[(&str, &str)]| -> Labels {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert!(sel.matches(&labels(&[("app", "web")])));
        assert!(sel.matches(&labels(&[("app", "web"), ("tier", "front")])));
        assert!(!sel.matches(&labels(&[("app", "web"), ("tier", "db")])));
        assert!(!sel.matches(&labels(&[("app", "web"), ("canary", "1")])));
        assert!(!sel.matches(&labels(&[("app", "api")])));
        assert!(LabelSelector::default().matches(&labels(&[])));
    }

    #[test]
    fn errors_name_the_field() {
        for (text, field) in [
            ("kind: Server\nname: s\npodSelector: {}\nport: 0\n", "field `port`"),
            ("kind: Server\nname: s\npodSelector: {}\nport: 80\nproxyProtocol: HTTP/3\n", "proxyProtocol"),
            ("kind: Server\nname: s\npodSelector: {}\nport: 80\naccessPolicy: maybe\n", "accessPolicy"),
            ("kind: Server\nname: s\npodSelector: {matchLabel: {}}\nport: 80\n", "unknown field `matchLabel`"),
            ("kind: Server\nname: s\npodSelector: {matchExpressions: [{key: a, operator: In}]}\nport: 80\n", "matchExpressions[0].values"),
            ("kind: Server\nname: s\nport: 80\n", "missing field `podSelector`"),
            ("kind: Server\nname: S\npodSelector: {}\nport: 80\n", "field `name`"),
            ("kind: Server\nname: s\npodSelector: {}\nport: 80\nextra: 1\n", "unknown field `extra`"),
            ("kind: AuthorizationPolicy\nname: a\ntargetRef: {kind: Pod, name: x}\nrequiredAuthenticationRefs: [{kind: ServiceAccount, name: x}]\n", "field `targetRef`"),
            ("kind: AuthorizationPolicy\nname: a\ntargetRef: {kind: Namespace, name: other}\nrequiredAuthenticationRefs: [{kind: ServiceAccount, name: x}]\n", "targetRef.name"),
            ("kind: AuthorizationPolicy\nname: a\ntargetRef: {group: policy.linkerd.io, kind: Server, name: s}\nrequiredAuthenticationRefs: []\n", "requiredAuthenticationRefs"),
            ("kind: AuthorizationPolicy\nname: a\ntargetRef: {group: policy.linkerd.io, kind: Server, name: s}\nrequiredAuthenticationRefs: [{kind: Secret, name: x}]\n", "requiredAuthenticationRefs[0]"),
            ("kind: AuthorizationPolicy\nname: a\ntargetRef: {group: policy.linkerd.io, kind: Server, name: s}\nrequiredAuthenticationRefs: [{group: policy.linkerd.io, kind: NetworkAuthentication, name: a}, {group: policy.linkerd.io, kind: NetworkAuthentication, name: b}]\n", "at most one"),
            ("kind: MeshTLSAuthentication\nname: m\n", "either identities or identityRefs"),
            ("kind: MeshTLSAuthentication\nname: m\nidentities: [\"a.*.b\"]\n", "identities[0]"),
            ("kind: MeshTLSAuthentication\nname: m\nidentityRefs: [{kind: Pod, name: x}]\n", "identityRefs[0].kind"),
            ("kind: NetworkAuthentication\nname: n\nnetworks: []\n", "field `networks`"),
            ("kind: NetworkAuthentication\nname: n\nnetworks: [{cidr: 10.0.0.0/33}]\n", "networks[0].cidr"),
            ("kind: NetworkAuthentication\nname: n\nnetworks: [{cidr: nope}]\n", "networks[0].cidr"),
            ("kind: Namespace\nname: demo\ndefaultInboundPolicy: allow\n", "defaultInboundPolicy"),
            ("kind: Server\nname: s\npodSelector: {}\nport: http\n", "named ports (http) are not resolved yet"),
        ] {
            let e = policy(text).unwrap_err();
            assert!(e.contains(field), "{text}: {e}");
        }
    }

    #[test]
    fn oversized_lists_and_values_are_refused_briefly() {
        let many = (0..=MAX_IDENTITIES)
            .map(|i| format!("\"a{i}.b\""))
            .collect::<Vec<_>>()
            .join(",");
        let e = policy(&format!(
            "kind: MeshTLSAuthentication\nname: m\nidentities: [{many}]\n"
        ))
        .unwrap_err();
        assert!(e.contains("more than the limit"), "{e}");
        let huge = "a".repeat(1 << 20);
        for text in [
            format!("kind: MeshTLSAuthentication\nname: m\nidentities: [{huge}]\n"),
            format!(
                "kind: Server\nname: s\npodSelector: {{matchLabels: {{app: {huge}}}}}\nport: 80\n"
            ),
            format!("kind: NetworkAuthentication\nname: n\nnetworks: [{{cidr: {huge}}}]\n"),
            format!("kind: Server\nname: s\npodSelector: {{}}\nport: {huge}\n"),
        ] {
            let e = policy(&text).unwrap_err();
            assert!(e.len() < 1024, "{} bytes", e.len());
        }
    }

    #[test]
    fn default_policies_parse_by_name() {
        for p in DefaultPolicy::ALL {
            assert_eq!(p.as_str().parse::<DefaultPolicy>(), Ok(p));
        }
        assert!("allow".parse::<DefaultPolicy>().is_err());
    }
}
