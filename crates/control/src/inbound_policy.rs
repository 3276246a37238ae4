//! `InboundServerPolicies`: a workload port's policy as linkerd2-proxy
//! (and Tether's proxy) expect it, built from the registry's policy
//! resources (`tether_core::policy`). `docs/policy.md` is the reference.
//!
//! A request names the workload (`PortSpec.workload`: stock Linkerd's JSON
//! `{"ns":"demo","pod":"web-0"}`, or the older `demo:web-0`) and a port.
//! The workload is the registry's named endpoint (namespace + `name`), with
//! its `labels`. The answer is the first `Server` by name in the namespace
//! that selects the workload and the port; without one, the namespace's
//! default policy, else this control plane's `--default-inbound-policy`
//! (labelled `kind: default` as Linkerd's controller does). A workload the
//! registry does not know is answered as one without labels, never with an
//! error: a stock proxy would fail every inbound connection on an error.
//!
//! Every field linkerd2-proxy's conversion (`ServerPolicy::try_from`)
//! checks is set: a protocol, a detection timeout, a `name` label, networks
//! and an authentication on every authorization, metadata on every route.
//! The proxy admits a request when any authorization of its route or of the
//! server matches, in order; the audit authorization (`kind: default`,
//! `name: audit`) is always last, so it only catches what nothing else
//! admits.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use linkerd2_proxy_api::grpc_route::{GrpcRouteMatch, GrpcRpcMatch};
use linkerd2_proxy_api::http_route::{path_match, HttpRouteMatch, PathMatch};
use linkerd2_proxy_api::inbound::{
    self as api, authn, inbound_server_policies_server::InboundServerPolicies, proxy_protocol,
    Authn, Authz, Network, PortSpec, ProxyProtocol, Server,
};
use linkerd2_proxy_api::meta::{metadata, Metadata, Resource};
use linkerd2_proxy_api::net::IpNetwork;
use tether_core::log_limit::LogLimit;
use tether_core::policy::{
    Cidr, DefaultPolicy, Labels, PolicyDoc, PolicyKind, PolicySet, ServerDoc, ServerPort, Target,
    WorkloadKey, GATEWAY_GROUP, POLICY_GROUP,
};
use tether_core::route::{GrpcRule, HttpRule, Route, RouteKey};
use tether_core::truncate::for_log;
use tonic::{Request, Response, Status};

use crate::destination::BoxStream;
use crate::index::{Index, WorkloadState};
use crate::policy::{Followed, RoutingStreams};

/// Linkerd's default cluster networks: the private ranges.
pub const DEFAULT_CLUSTER_NETWORKS: &str =
    "10.0.0.0/8,100.64.0.0/10,172.16.0.0/12,192.168.0.0/16,fd00::/8";

/// The longest `PortSpec.workload` read.
const MAX_WORKLOAD_BYTES: usize = 1024;

static BAD_WORKLOAD_LOG: LogLimit = LogLimit::new(Duration::from_secs(10));

/// What the control plane applies where no resource says otherwise.
#[derive(Clone, Debug)]
pub struct InboundDefaults {
    /// `--default-inbound-policy`: for a port no `Server` selects, in a
    /// namespace without a default of its own.
    pub policy: DefaultPolicy,
    /// `--cluster-networks`: the `cluster-*` policies' networks.
    pub cluster_networks: Vec<Cidr>,
    /// The identities' trust domain (service account names → identities).
    pub trust_domain: String,
    pub detect_timeout: Duration,
}

impl InboundDefaults {
    pub fn new(policy: DefaultPolicy, cluster_networks: Vec<Cidr>, trust_domain: &str) -> Self {
        Self {
            policy,
            cluster_networks,
            trust_domain: trust_domain.to_string(),
            detect_timeout: crate::outbound::DETECT_TIMEOUT,
        }
    }
}

/// Parses the networks of `--cluster-networks` (comma-separated).
pub fn parse_networks(text: &str) -> Result<Vec<Cidr>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect()
}

/// Reads `PortSpec.workload`: `{"ns":"<ns>","pod":"<pod>"}` or `<ns>:<pod>`.
pub fn parse_workload(text: &str) -> Option<WorkloadKey> {
    if text.len() > MAX_WORKLOAD_BYTES {
        return None;
    }
    let (namespace, name) = if text.trim_start().starts_with('{') {
        // JSON is YAML, and the registry reads YAML already.
        let value: serde_yaml::Value = serde_yaml::from_str(text).ok()?;
        (
            value.get("ns")?.as_str()?.to_string(),
            value.get("pod")?.as_str()?.to_string(),
        )
    } else {
        let (ns, pod) = text.split_once(':')?;
        (ns.to_string(), pod.to_string())
    };
    let valid = tether_core::authority::is_dns_label(&namespace)
        && !name.is_empty()
        && name.len() <= tether_core::registry::MAX_NAME_BYTES;
    valid.then_some(WorkloadKey { namespace, name })
}

/// A workload port's policy: everything it depends on.
pub struct InboundTarget<'a> {
    pub set: &'a PolicySet,
    /// `None` when the request named no readable workload.
    pub workload: Option<&'a WorkloadKey>,
    pub labels: Option<&'a Labels>,
    pub port: u16,
    pub defaults: &'a InboundDefaults,
}

impl InboundTarget<'_> {
    /// The `Server` that selects this workload port: the first by name.
    pub fn server(&self) -> Option<&ServerDoc> {
        let workload = self.workload?;
        let none = Labels::new();
        let labels = self.labels.unwrap_or(&none);
        self.set
            .in_namespace(PolicyKind::Server, &workload.namespace)
            .filter_map(|d| match d {
                PolicyDoc::Server(s) => Some(s),
                _ => None,
            })
            .find(|s| s.port == ServerPort::Number(self.port) && s.pod_selector.matches(labels))
    }

    /// The policy that applies where no `Server` does.
    pub fn default_policy(&self) -> DefaultPolicy {
        self.workload
            .and_then(|w| self.set.namespace_default(&w.namespace))
            .unwrap_or(self.defaults.policy)
    }

    pub fn answer(&self) -> Server {
        match self.server() {
            Some(server) => self.server_answer(server),
            None => self.default_answer(self.default_policy()),
        }
    }

    fn default_answer(&self, policy: DefaultPolicy) -> Server {
        let authorizations = self.default_authzs(policy);
        Server {
            protocol: Some(ProxyProtocol {
                kind: Some(proxy_protocol::Kind::Detect(proxy_protocol::Detect {
                    timeout: prost_types::Duration::try_from(self.defaults.detect_timeout).ok(),
                    http_routes: vec![default_http_route()],
                    http_local_rate_limit: None,
                })),
            }),
            server_ips: vec![],
            authorizations,
            labels: default_labels(policy.as_str()),
        }
    }

    /// The authorizations of a default policy (none for `deny`).
    fn default_authzs(&self, policy: DefaultPolicy) -> Vec<Authz> {
        let all = || all_networks();
        let cluster = || {
            self.defaults
                .cluster_networks
                .iter()
                .map(|c| network(c, &[]))
                .collect()
        };
        let (networks, authn) = match policy {
            DefaultPolicy::Deny => return vec![],
            DefaultPolicy::AllUnauthenticated | DefaultPolicy::Audit => (all(), unauthenticated()),
            DefaultPolicy::AllAuthenticated => (all(), any_identity()),
            DefaultPolicy::ClusterUnauthenticated => (cluster(), unauthenticated()),
            DefaultPolicy::ClusterAuthenticated => (cluster(), any_identity()),
        };
        vec![Authz {
            networks,
            authentication: Some(authn),
            labels: default_labels(policy.as_str()),
            metadata: Some(Metadata {
                kind: Some(metadata::Kind::Default(policy.as_str().to_string())),
            }),
        }]
    }

    fn server_answer(&self, server: &ServerDoc) -> Server {
        let ns = &server.namespace;
        let mut authorizations: Vec<Authz> = self.policies(
            |t| {
                matches!(t, Target::Server(name) if *name == server.name) || *t == Target::Namespace
            },
            ns,
        );
        // The access policy admits what no authorization does; audit last.
        let access = server.access_policy.unwrap_or(DefaultPolicy::Deny);
        authorizations.extend(self.default_authzs(access));
        let kind = match server.proxy_protocol {
            tether_core::policy::ProxyProtocol::Unknown => {
                proxy_protocol::Kind::Detect(proxy_protocol::Detect {
                    timeout: prost_types::Duration::try_from(self.defaults.detect_timeout).ok(),
                    http_routes: self.http_routes(server),
                    http_local_rate_limit: None,
                })
            }
            tether_core::policy::ProxyProtocol::Http1 => {
                proxy_protocol::Kind::Http1(proxy_protocol::Http1 {
                    routes: self.http_routes(server),
                    local_rate_limit: None,
                })
            }
            tether_core::policy::ProxyProtocol::Http2 => {
                proxy_protocol::Kind::Http2(proxy_protocol::Http2 {
                    routes: self.http_routes(server),
                    local_rate_limit: None,
                })
            }
            tether_core::policy::ProxyProtocol::Grpc => {
                proxy_protocol::Kind::Grpc(proxy_protocol::Grpc {
                    routes: self.grpc_routes(server),
                })
            }
            tether_core::policy::ProxyProtocol::Opaque => {
                proxy_protocol::Kind::Opaque(proxy_protocol::Opaque {})
            }
            tether_core::policy::ProxyProtocol::Tls => {
                proxy_protocol::Kind::Tls(proxy_protocol::Tls {})
            }
        };
        Server {
            protocol: Some(ProxyProtocol { kind: Some(kind) }),
            server_ips: vec![],
            authorizations,
            labels: HashMap::from([
                ("group".to_string(), POLICY_GROUP.to_string()),
                ("kind".to_string(), "server".to_string()),
                ("name".to_string(), server.name.clone()),
            ]),
        }
    }

    /// The authorizations of the `AuthorizationPolicy`s in `namespace`
    /// whose target `wanted` accepts, by name. A policy whose
    /// authentications do not (yet) exist admits nobody, so it is left out.
    fn policies(&self, wanted: impl Fn(&Target) -> bool, namespace: &str) -> Vec<Authz> {
        self.set
            .in_namespace(PolicyKind::AuthorizationPolicy, namespace)
            .filter_map(|d| match d {
                PolicyDoc::AuthorizationPolicy(p) if wanted(&p.target()) => self.authz(p),
                _ => None,
            })
            .collect()
    }

    fn authz(&self, policy: &tether_core::policy::AuthorizationPolicyDoc) -> Option<Authz> {
        let req = policy.requirements();
        let networks = match &req.network {
            Some((ns, name)) => match self.set.get(PolicyKind::NetworkAuthentication, ns, name)? {
                PolicyDoc::NetworkAuthentication(n) => n
                    .networks
                    .iter()
                    .map(|n| network(&n.cidr, &n.except))
                    .collect(),
                _ => return None,
            },
            None => all_networks(),
        };
        let domain = &self.defaults.trust_domain;
        let identity_of = |sa: &str, ns: &str| api::Identity {
            name: format!("{sa}.{ns}.serviceaccount.identity.{domain}"),
        };
        let authn = if let Some((ns, name)) = &req.mesh_tls {
            let PolicyDoc::MeshTlsAuthentication(m) =
                self.set.get(PolicyKind::MeshTlsAuthentication, ns, name)?
            else {
                return None;
            };
            let mut identities = Vec::new();
            let mut suffixes = Vec::new();
            for id in &m.identities {
                if id == "*" {
                    suffixes.push(api::IdentitySuffix { parts: vec![] });
                } else if let Some(suffix) = id.strip_prefix("*.") {
                    suffixes.push(api::IdentitySuffix {
                        parts: suffix.split('.').map(str::to_string).collect(),
                    });
                } else {
                    identities.push(api::Identity { name: id.clone() });
                }
            }
            for r in &m.identity_refs {
                if r.kind == "Namespace" {
                    suffixes.push(api::IdentitySuffix {
                        parts: [r.name.as_str(), "serviceaccount", "identity"]
                            .into_iter()
                            .chain(domain.split('.'))
                            .map(str::to_string)
                            .collect(),
                    });
                } else {
                    identities.push(identity_of(&r.name, r.namespace_or(&m.namespace)));
                }
            }
            mesh_tls(identities, suffixes)
        } else if !req.service_accounts.is_empty() {
            let identities = req
                .service_accounts
                .iter()
                .map(|(ns, sa)| identity_of(sa, ns))
                .collect();
            mesh_tls(identities, vec![])
        } else {
            unauthenticated()
        };
        Some(Authz {
            networks,
            authentication: Some(authn),
            labels: HashMap::from([
                ("group".to_string(), POLICY_GROUP.to_string()),
                ("kind".to_string(), "authorizationpolicy".to_string()),
                ("name".to_string(), policy.name.clone()),
            ]),
            metadata: Some(Metadata {
                kind: Some(metadata::Kind::Resource(Resource {
                    group: POLICY_GROUP.into(),
                    kind: "AuthorizationPolicy".into(),
                    name: policy.name.clone(),
                    namespace: policy.namespace.clone(),
                    section: String::new(),
                    port: 0,
                })),
            }),
        })
    }

    /// The routes attached to `server` of one kind, by name.
    fn server_routes<'s>(&'s self, server: &'s ServerDoc) -> impl Iterator<Item = &'s Route> + 's {
        self.set.server_routes.values().filter(move |r| {
            r.namespace() == server.namespace && r.servers().contains(server.name.as_str())
        })
    }

    fn route_authzs(&self, key: RouteKey) -> Vec<Authz> {
        let namespace = key.namespace.clone();
        self.policies(|t| *t == Target::Route(key.clone()), &namespace)
    }

    /// The server's HTTPRoutes, or the default route (every request).
    fn http_routes(&self, server: &ServerDoc) -> Vec<api::HttpRoute> {
        let routes: Vec<api::HttpRoute> = self
            .server_routes(server)
            .filter_map(|r| match r {
                Route::Http(r) => Some(r),
                Route::Grpc(_) => None,
            })
            .map(|r| {
                let rules: &[HttpRule] = &r.rules;
                let default_rule = [HttpRule::default()];
                let rules = if rules.is_empty() {
                    &default_rule[..]
                } else {
                    rules
                };
                api::HttpRoute {
                    metadata: resource_meta(POLICY_GROUP, "HTTPRoute", &r.namespace, &r.name),
                    hosts: vec![],
                    authorizations: self.route_authzs(Route::Http(r.clone()).key()),
                    rules: rules
                        .iter()
                        .map(|rule| api::http_route::Rule {
                            matches: if rule.matches.is_empty() {
                                vec![match_everything()]
                            } else {
                                rule.matches
                                    .iter()
                                    .map(crate::outbound::http_match)
                                    .collect()
                            },
                            filters: rule.filters.iter().filter_map(inbound_filter).collect(),
                        })
                        .collect(),
                }
            })
            .collect();
        if routes.is_empty() {
            vec![default_http_route()]
        } else {
            routes
        }
    }

    /// The server's GRPCRoutes, or the default route (every call).
    fn grpc_routes(&self, server: &ServerDoc) -> Vec<api::GrpcRoute> {
        let routes: Vec<api::GrpcRoute> = self
            .server_routes(server)
            .filter_map(|r| match r {
                Route::Grpc(r) => Some(r),
                Route::Http(_) => None,
            })
            .map(|r| {
                let rules: &[GrpcRule] = &r.rules;
                let default_rule = [GrpcRule::default()];
                let rules = if rules.is_empty() {
                    &default_rule[..]
                } else {
                    rules
                };
                api::GrpcRoute {
                    metadata: resource_meta(GATEWAY_GROUP, "GRPCRoute", &r.namespace, &r.name),
                    hosts: vec![],
                    authorizations: self.route_authzs(Route::Grpc(r.clone()).key()),
                    rules: rules
                        .iter()
                        .map(|rule| api::grpc_route::Rule {
                            matches: if rule.matches.is_empty() {
                                vec![GrpcRouteMatch {
                                    // linkerd2-proxy refuses a match without an RPC match
                                    rpc: Some(GrpcRpcMatch::default()),
                                    headers: vec![],
                                }]
                            } else {
                                rule.matches
                                    .iter()
                                    .map(crate::outbound::grpc_match)
                                    .collect()
                            },
                            filters: vec![],
                        })
                        .collect(),
                }
            })
            .collect();
        if !routes.is_empty() {
            return routes;
        }
        vec![api::GrpcRoute {
            metadata: Some(Metadata {
                kind: Some(metadata::Kind::Default("default".into())),
            }),
            hosts: vec![],
            authorizations: vec![],
            rules: vec![api::grpc_route::Rule {
                matches: vec![GrpcRouteMatch {
                    // linkerd2-proxy refuses a match without an RPC match
                    rpc: Some(GrpcRpcMatch::default()),
                    headers: vec![],
                }],
                filters: vec![],
            }],
        }]
    }
}

/// The inbound kinds of an HTTPRoute filter: header modifiers and
/// redirects (an inbound route has no response filters).
fn inbound_filter(f: &tether_core::route::HttpFilter) -> Option<api::http_route::Filter> {
    use linkerd2_proxy_api::outbound::http_route::filter::Kind as Out;
    let kind = match crate::outbound::http_filter(f).kind? {
        Out::RequestHeaderModifier(m) => api::http_route::filter::Kind::RequestHeaderModifier(m),
        Out::Redirect(r) => api::http_route::filter::Kind::Redirect(r),
        _ => return None,
    };
    Some(api::http_route::Filter { kind: Some(kind) })
}

fn match_everything() -> HttpRouteMatch {
    HttpRouteMatch {
        path: Some(PathMatch {
            kind: Some(path_match::Kind::Prefix("/".into())),
        }),
        headers: vec![],
        query_params: vec![],
        method: None,
    }
}

/// Every request, with only the server's authorizations (Linkerd's
/// controller sends the same when a server has no routes).
fn default_http_route() -> api::HttpRoute {
    api::HttpRoute {
        metadata: Some(Metadata {
            kind: Some(metadata::Kind::Default("default".into())),
        }),
        hosts: vec![],
        authorizations: vec![],
        rules: vec![api::http_route::Rule {
            matches: vec![match_everything()],
            filters: vec![],
        }],
    }
}

fn resource_meta(group: &str, kind: &str, namespace: &str, name: &str) -> Option<Metadata> {
    Some(Metadata {
        kind: Some(metadata::Kind::Resource(Resource {
            group: group.into(),
            kind: kind.into(),
            name: name.into(),
            namespace: namespace.into(),
            section: String::new(),
            port: 0,
        })),
    })
}

/// Labels of a default policy. `group` is set empty: linkerd2-proxy reads
/// a missing group as `policy.linkerd.io`, and only `kind: default` with
/// an empty group is a default (the one `name: audit` makes audit).
fn default_labels(name: &str) -> HashMap<String, String> {
    HashMap::from([
        ("group".to_string(), String::new()),
        ("kind".to_string(), "default".to_string()),
        ("name".to_string(), name.to_string()),
    ])
}

fn network(net: &Cidr, except: &[Cidr]) -> Network {
    let ip = |c: &Cidr| IpNetwork::from((c.addr, c.prefix));
    Network {
        net: Some(ip(net)),
        except: except.iter().map(ip).collect(),
    }
}

fn all_networks() -> Vec<Network> {
    [
        IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    ]
    .iter()
    .map(|a| network(&Cidr::all(*a), &[]))
    .collect()
}

fn unauthenticated() -> Authn {
    Authn {
        permit: Some(authn::Permit::Unauthenticated(
            authn::PermitUnauthenticated {},
        )),
    }
}

fn mesh_tls(identities: Vec<api::Identity>, suffixes: Vec<api::IdentitySuffix>) -> Authn {
    Authn {
        permit: Some(authn::Permit::MeshTls(authn::PermitMeshTls {
            clients: Some(authn::permit_mesh_tls::Clients::Identities(
                authn::permit_mesh_tls::PermitClientIdentities {
                    identities,
                    suffixes,
                },
            )),
        })),
    }
}

/// Any identity of the trust root (an empty suffix matches every name).
fn any_identity() -> Authn {
    mesh_tls(vec![], vec![api::IdentitySuffix { parts: vec![] }])
}

/// The inbound policy API, over the index's policy set and workloads.
#[derive(Clone)]
pub struct InboundService {
    index: Index,
    streams: RoutingStreams,
    defaults: std::sync::Arc<InboundDefaults>,
}

impl InboundService {
    pub fn new(streams: RoutingStreams, defaults: InboundDefaults) -> Self {
        Self {
            index: streams.index.clone(),
            streams,
            defaults: std::sync::Arc::new(defaults),
        }
    }

    fn request(&self, req: PortSpec) -> Result<(Option<WorkloadKey>, u16), Status> {
        let port = u16::try_from(req.port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| Status::invalid_argument(format!("port {} is not 1-65535", req.port)))?;
        let workload = parse_workload(&req.workload);
        if workload.is_none() {
            if let Some(suppressed) = BAD_WORKLOAD_LOG.allow() {
                tracing::warn!(
                    workload = %for_log(&req.workload),
                    suppressed,
                    "InboundServerPolicies: unreadable workload (expected {{\"ns\":..,\"pod\":..}} or ns:pod); answering the default policy"
                );
            }
        }
        Ok((workload, port))
    }
}

/// A workload's labels and the policy set, followed together.
struct InboundSource {
    policies: tokio::sync::watch::Receiver<std::sync::Arc<PolicySet>>,
    workload: Option<(
        WorkloadKey,
        Option<tokio::sync::watch::Receiver<WorkloadState>>,
    )>,
    index: Index,
}

impl Followed for InboundSource {
    type State = (std::sync::Arc<PolicySet>, WorkloadState);

    fn current(&mut self) -> Self::State {
        let set = self.policies.borrow_and_update().clone();
        let labels = self
            .workload
            .as_mut()
            .and_then(|(_, rx)| rx.as_mut())
            .and_then(|rx| rx.borrow_and_update().clone());
        (set, labels)
    }

    async fn changed(&mut self) -> bool {
        match self.workload.as_mut().and_then(|(_, rx)| rx.as_mut()) {
            Some(workload) => tokio::select! {
                p = self.policies.changed() => p.is_ok(),
                w = workload.changed() => w.is_ok(),
            },
            None => self.policies.changed().await.is_ok(),
        }
    }
}

impl Drop for InboundSource {
    fn drop(&mut self) {
        if let Some((key, rx)) = &mut self.workload {
            // The receiver goes first, so the slot is seen unwatched.
            *rx = None;
            self.index.release_workload(key);
        }
    }
}

#[tonic::async_trait]
impl InboundServerPolicies for InboundService {
    type WatchPortStream = BoxStream<Server>;

    async fn get_port(&self, req: Request<PortSpec>) -> Result<Response<Server>, Status> {
        let (workload, port) = self.request(req.into_inner())?;
        let set = self.index.policies();
        let labels = workload.as_ref().and_then(|w| self.index.workload(w));
        Ok(Response::new(
            InboundTarget {
                set: &set,
                workload: workload.as_ref(),
                labels: labels.as_ref(),
                port,
                defaults: &self.defaults,
            }
            .answer(),
        ))
    }

    async fn watch_port(
        &self,
        req: Request<PortSpec>,
    ) -> Result<Response<Self::WatchPortStream>, Status> {
        let (workload, port) = self.request(req.into_inner())?;
        let permit = self.streams.acquire()?;
        let source = InboundSource {
            policies: self.index.watch_policies(),
            workload: workload.map(|w| {
                let rx = self.index.watch_workload(&w);
                (w, Some(rx))
            }),
            index: self.index.clone(),
        };
        let workload = source.workload.as_ref().map(|(w, _)| w.clone());
        let defaults = self.defaults.clone();
        let stream = self.streams.spawn(permit, source, move |(set, labels)| {
            Some(
                InboundTarget {
                    set: &set,
                    workload: workload.as_ref(),
                    labels: labels.as_ref(),
                    port,
                    defaults: &defaults,
                }
                .answer(),
            )
        });
        Ok(Response::new(stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_core::registry::{parse_documents, Document};

    fn set(text: &str) -> PolicySet {
        let mut set = PolicySet::default();
        for doc in parse_documents(text).unwrap() {
            match doc {
                Document::Policy(p) => {
                    set.docs.insert(p.key(), p);
                }
                Document::Route(r) => {
                    set.server_routes.insert(r.key(), r);
                }
                _ => {}
            }
        }
        set
    }

    fn defaults() -> InboundDefaults {
        InboundDefaults::new(
            DefaultPolicy::AllUnauthenticated,
            parse_networks("10.0.0.0/8").unwrap(),
            "cluster.local",
        )
    }

    fn answer(set: &PolicySet, workload: &str, labels: Option<&Labels>, port: u16) -> Server {
        let w = parse_workload(workload);
        InboundTarget {
            set,
            workload: w.as_ref(),
            labels,
            port,
            defaults: &defaults(),
        }
        .answer()
    }

    #[test]
    fn workloads_are_read_in_both_forms_and_garbage_is_none() {
        let web0 = Some(WorkloadKey {
            namespace: "demo".into(),
            name: "web-0".into(),
        });
        assert_eq!(parse_workload(r#"{"ns":"demo","pod":"web-0"}"#), web0);
        assert_eq!(
            parse_workload(r#"{"pod": "web-0", "ns": "demo", "x": 1}"#),
            web0
        );
        assert_eq!(parse_workload("demo:web-0"), web0);
        for bad in [
            "",
            "web-0",
            "Demo:web-0",
            "demo:",
            r#"{"ns":"demo"}"#,
            r#"{"ns":["demo"],"pod":"a"}"#,
            "{{{{",
            &format!("demo:{}", "a".repeat(2000)),
        ] {
            assert_eq!(parse_workload(bad), None, "{bad:.40}");
        }
    }

    #[test]
    fn the_first_server_by_name_selecting_the_port_wins() {
        let s = set("kind: Server\nname: b\nnamespace: demo\npodSelector: {}\nport: 80\nproxyProtocol: opaque\n---\n\
             kind: Server\nname: a\nnamespace: demo\npodSelector: {matchLabels: {app: web}}\nport: 80\n");
        let web = Labels::from([("app".to_string(), "web".to_string())]);
        let name = |s: &Server| s.labels["name"].clone();
        assert_eq!(name(&answer(&s, "demo:web-0", Some(&web), 80)), "a");
        // Not selected by `a`: the next by name; unknown workloads have no labels.
        assert_eq!(
            name(&answer(&s, "demo:db-0", Some(&Labels::new()), 80)),
            "b"
        );
        assert_eq!(name(&answer(&s, "demo:unknown", None, 80)), "b");
        // No server on the port, another namespace, unreadable workload:
        // the default.
        for (w, port) in [("demo:web-0", 81), ("other:web-0", 80), ("garbage", 80)] {
            let a = answer(&s, w, Some(&web), port);
            assert_eq!(a.labels["kind"], "default", "{w} {port}");
            assert_eq!(a.labels["name"], "all-unauthenticated");
            assert_eq!(a.labels["group"], "");
        }
    }

    #[test]
    fn a_namespace_default_wins_over_the_control_planes_and_deny_admits_nobody() {
        let s = set(
            "kind: Namespace\nname: demo\ndefaultInboundPolicy: deny\n---\n\
             kind: Namespace\nname: lab\ndefaultInboundPolicy: cluster-authenticated\n",
        );
        let deny = answer(&s, "demo:web-0", None, 80);
        assert_eq!(deny.labels["name"], "deny");
        assert!(deny.authorizations.is_empty());
        let cluster = answer(&s, "lab:web-0", None, 80);
        let authz = &cluster.authorizations[0];
        assert_eq!(
            authz.networks[0].net,
            Some(IpNetwork::from((
                "10.0.0.0".parse::<IpAddr>().unwrap(),
                8u8
            )))
        );
        assert_eq!(authz.authentication, Some(any_identity()));
    }
}
