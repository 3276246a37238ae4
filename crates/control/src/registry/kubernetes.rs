//! The Kubernetes registry: Services, EndpointSlices and Pods, watched
//! through `kube`'s runtime watchers (which relist after `410 Gone`, use
//! bookmarks, and resume after dropped watches), turned into the same
//! index the file registry feeds.
//!
//! - A Service gives the ports, the cluster IP, and the mesh settings from
//!   annotations: `tether.io/global-id`, `tether.io/multicluster-mode`
//!   (`balanced`/`failover`), `tether.io/opaque-ports` (`5432,6379`),
//!   `tether.io/retry-budget` (`RATIO` or `RATIO/MIN_PER_SECOND`).
//! - Its EndpointSlices (label `kubernetes.io/service-name`) give the
//!   endpoints: address and target port, readiness from the endpoint
//!   conditions, zone from the endpoint (set from the node) or its hints.
//! - The Pod an endpoint points to gives the identity (its service
//!   account) and whether it is meshed (it runs a `tether-proxy` container).
//!
//! - Gateway API `HTTPRoute`s and `GRPCRoute`s
//!   (`gateway.networking.k8s.io/v1`) whose `parentRefs` name Services
//!   give the routes, checked exactly like routes in a registry file
//!   (`docs/routes.md`); parentRefs to Gateways are not the mesh's and are
//!   skipped. An invalid route is logged and its last valid version kept.
//!   A cluster without the CRDs has no routes: that is logged once and the
//!   registry works without them (the watch keeps retrying, so routes
//!   appear once the CRDs are installed).
//!
//! - Authorization policy (`docs/policy.md`): Linkerd's `policy.linkerd.io`
//!   CRDs — `Server` (v1beta3), `AuthorizationPolicy`,
//!   `MeshTLSAuthentication`, `NetworkAuthentication` (v1alpha1) and its
//!   `HTTPRoute` (v1beta3) — parsed exactly like the registry file's
//!   documents, and each Namespace's `config.linkerd.io/default-inbound-policy`
//!   annotation. Routes of either group whose parentRefs name a `Server`
//!   are the server's. A pod's labels are its endpoints' `labels`. A
//!   missing CRD, or Namespaces the control plane may not list, is logged
//!   once and does not hold up the first load.
//!
//! The registry is loaded once Services, EndpointSlices and Pods have been
//! listed, and each route and policy kind (and Namespaces) listed or found
//! missing.

use std::collections::{hash_map, BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, ResourceExt};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use tether_core::authority::ServiceKey;
use tether_core::log_limit::LogLimit;
use tether_core::policy::{
    parse_policy, DefaultPolicy, NamespaceDoc, PolicyDoc, PolicyKey, PolicyKind, PolicySet,
    POLICY_GROUP,
};
use tether_core::registry::{
    Document, EndpointSpec, MulticlusterMode, PortSpec, RetryBudget, SharedStrings,
};
use tether_core::route::{Route, RouteKey, RouteKind};
use tether_core::truncate::bounded_message;

use super::{Registry, RegistryError};
use facts::{
    facts, LabelSets, PodFacts, ServiceFacts, SliceFacts, Watched, WatchedPod, WatchedSlice,
};

mod facts;
use crate::index::{EndpointList, Index, ServiceState};
use crate::memory::MemoryRelease;
use crate::metrics::ControlMetrics;

static BAD_ANNOTATION_LOG: LogLimit = LogLimit::new(std::time::Duration::from_secs(60));

pub const GLOBAL_ID: &str = "tether.io/global-id";
pub const MODE: &str = "tether.io/multicluster-mode";
pub const OPAQUE_PORTS: &str = "tether.io/opaque-ports";
pub const RETRY_BUDGET: &str = "tether.io/retry-budget";
/// A duration (`30s`, `500ms`, `0` for none); an invalid value is ignored.
pub const RESPONSE_TIMEOUT: &str = "tether.io/response-timeout";
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The container (or native-sidecar init container) that marks a meshed pod.
pub const PROXY_CONTAINER: &str = "tether-proxy";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

pub type WatchLag = Family<KindLabels, Histogram, crate::metrics::LatencyBuckets>;

pub struct KubernetesRegistry {
    client: Client,
    trust_domain: String,
    lag: WatchLag,
    metrics: ControlMetrics,
    memory: MemoryRelease,
}

impl KubernetesRegistry {
    pub fn new(client: Client, trust_domain: &str, metrics: ControlMetrics, lag: WatchLag) -> Self {
        Self {
            client,
            trust_domain: trust_domain.to_string(),
            lag,
            metrics,
            memory: MemoryRelease::default(),
        }
    }

    /// Where to ask for the memory a large full list frees to be returned
    /// (by default, nowhere).
    pub fn with_memory_release(mut self, memory: MemoryRelease) -> Self {
        self.memory = memory;
        self
    }
}

// Events are moved through once, right away; boxing them buys nothing.
#[allow(clippy::large_enum_variant)]
enum Change {
    Service(Event<ServiceFacts>),
    Slice(Event<SliceFacts>),
    Pod(Event<PodFacts>),
    Route(RouteKind, Event<DynamicObject>),
    /// A route kind's CRD is not installed.
    NoCrd(RouteKind),
    Policy(PolicyCrd, Event<DynamicObject>),
    Namespace(Event<Namespace>),
    /// A policy CRD is not installed, or Namespaces may not be listed.
    Missing(Optional),
}

/// The policy kinds watched as `policy.linkerd.io` CRDs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum PolicyCrd {
    Server,
    AuthorizationPolicy,
    MeshTlsAuthentication,
    NetworkAuthentication,
    /// Linkerd's own HTTPRoute (its parentRefs name Servers).
    HttpRoute,
}

impl PolicyCrd {
    const ALL: [PolicyCrd; 5] = [
        Self::Server,
        Self::AuthorizationPolicy,
        Self::MeshTlsAuthentication,
        Self::NetworkAuthentication,
        Self::HttpRoute,
    ];

    fn kind(self) -> &'static str {
        match self {
            Self::Server => "Server",
            Self::AuthorizationPolicy => "AuthorizationPolicy",
            Self::MeshTlsAuthentication => "MeshTLSAuthentication",
            Self::NetworkAuthentication => "NetworkAuthentication",
            Self::HttpRoute => "HTTPRoute",
        }
    }

    pub fn version(self) -> &'static str {
        match self {
            Self::Server | Self::HttpRoute => "v1beta3",
            _ => "v1alpha1",
        }
    }

    fn resource(self) -> ApiResource {
        ApiResource::from_gvk(&GroupVersionKind::gvk(
            POLICY_GROUP,
            self.version(),
            self.kind(),
        ))
    }
}

/// What may be absent without holding up the first load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Optional {
    Policy(PolicyCrd),
    Namespaces,
}

/// The namespace annotation naming the namespace's default policy.
pub const DEFAULT_POLICY_ANNOTATION: &str = "config.linkerd.io/default-inbound-policy";

/// Everything watched, by namespace and name.
#[derive(Default)]
struct World {
    services: HashMap<(String, String), ServiceFacts>,
    slices: HashMap<(String, String), SliceFacts>,
    pods: HashMap<(String, String), PodFacts>,
    /// The Pods' label sets, each held once.
    label_sets: LabelSets,
    http_routes: HashMap<(String, String), DynamicObject>,
    grpc_routes: HashMap<(String, String), DynamicObject>,
    /// The valid routes, by kind, namespace and name.
    routes: HashMap<RouteKey, Route>,
    policy_objects: HashMap<PolicyCrd, HashMap<(String, String), DynamicObject>>,
    /// The valid policy resources; Linkerd's HTTPRoutes apart, so they
    /// never clash with a Gateway API route of the same name.
    policies: BTreeMap<PolicyKey, PolicyDoc>,
    linkerd_routes: BTreeMap<RouteKey, Route>,
    namespaces: HashMap<(String, String), Namespace>,
    /// Derived from `routes` and `slices` (kept by [`World::insert_route`],
    /// [`World::remove_route`] and [`World::reindex_slice`]), so that a
    /// change costs what it touches rather than a scan of the cluster's
    /// routes and slices (at 5,000 services with a route each, a full list
    /// of the slices took 26 s, and every Pod change 11 ms): each
    /// service's routes, each service's slices, each pod's slices, and
    /// what each slice contributed to those.
    routes_of_service: HashMap<ServiceKey, BTreeSet<RouteKey>>,
    slices_of_service: HashMap<ServiceKey, BTreeSet<(String, String)>>,
    /// A pod is in one slice or a few: a short list, not a tree, whose
    /// smallest node is ~0.5 KiB (a set here took 67 MB more at 100,000
    /// pods in `a_large_cluster`).
    slices_of_pod: HashMap<SharedKey, Vec<SharedKey>>,
    slice_refs: HashMap<SharedKey, SliceRefs>,
    /// What each slice gives its service's endpoint list, built once per
    /// version of the slice, of the pods it names and of the service's
    /// ports (the trust domain, the other input, is the registry's for
    /// its life), and shared with the index: a change to one slice of a
    /// service of 100,000 endpoints costs that slice, not the service.
    /// Dropped by [`World::reindex_slice`], [`World::pods_changed`] and
    /// (when the service's ports change) [`World::state`].
    slice_parts: HashMap<(String, String), SlicePart>,
    /// The ports each service's parts were built for.
    parts_ports: HashMap<ServiceKey, Vec<SlicePortKey>>,
    /// How often each service's parts list each (address, service port):
    /// the index can follow a change part by part only while none is
    /// listed twice (as when a pod moves from one slice to another).
    listings: HashMap<ServiceKey, Listings>,
}

/// One slice's endpoints, as its service's list holds them.
struct SlicePart {
    service: ServiceKey,
    endpoints: Arc<[EndpointSpec]>,
}

/// A service port as a slice's port is matched to it: name and number.
type SlicePortKey = (Option<String>, i32);

/// How often a service's parts list each endpoint, and how many listings
/// are repeats.
#[derive(Default)]
struct Listings {
    count: HashMap<(SocketAddr, Option<u16>), u32>,
    repeats: usize,
}

impl Listings {
    fn add(&mut self, endpoints: &[EndpointSpec]) {
        for ep in endpoints {
            let n = self.count.entry((ep.address, ep.port)).or_default();
            *n += 1;
            if *n > 1 {
                self.repeats += 1;
            }
        }
    }

    fn remove(&mut self, endpoints: &[EndpointSpec]) {
        for ep in endpoints {
            let key = (ep.address, ep.port);
            let Some(n) = self.count.get_mut(&key) else {
                debug_assert!(false, "{key:?} removed but never added");
                continue;
            };
            *n -= 1;
            if *n == 0 {
                self.count.remove(&key);
            } else {
                self.repeats -= 1;
            }
        }
    }
}

/// A namespace and name the indexes hold once: a pod's in each slice's
/// list of pods and as its own key, a slice's in each of its pods' lists
/// of slices and as its own key (two strings and a map entry a pod fewer
/// than a copy each).
type SharedKey = Arc<(String, String)>;

/// What one EndpointSlice is indexed under: its service, and the pods its
/// endpoints name (as `state` looks them up: a reference without a
/// namespace is to the slice's own).
struct SliceRefs {
    service: Option<ServiceKey>,
    /// Sorted, each once; the keys of `slices_of_pod`.
    pods: Vec<SharedKey>,
}

impl SliceRefs {
    fn of(slice: &SliceFacts) -> Self {
        let mut pods: Vec<SharedKey> = slice
            .endpoints
            .iter()
            .filter_map(|ep| slice.pod_of(ep))
            .map(Arc::new)
            .collect();
        pods.sort_unstable();
        pods.dedup();
        SliceRefs {
            service: slice.service.clone(),
            pods,
        }
    }
}

/// The Gateway API group routes come from.
pub const GATEWAY_GROUP: &str = "gateway.networking.k8s.io";

fn route_resource(kind: RouteKind) -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(GATEWAY_GROUP, "v1", kind.as_str()))
}

/// A Kubernetes route as the registry's route: its `spec` with the
/// metadata's name and namespace, only the parentRefs naming Services (or
/// Servers). `Ok(None)` for a route that attaches to neither (a Gateway's).
fn route_of(kind: RouteKind, o: &DynamicObject) -> Result<Option<Route>, String> {
    let mut spec = o.data.get("spec").cloned().unwrap_or_default();
    let Some(fields) = spec.as_object_mut() else {
        return Err("no spec".into());
    };
    let service_parent = |p: &serde_json::Value| {
        let group = p
            .get("group")
            .and_then(|g| g.as_str())
            .unwrap_or(GATEWAY_GROUP);
        let kind = p.get("kind").and_then(|k| k.as_str()).unwrap_or("Gateway");
        ((group.is_empty() || group == "core") && kind == "Service")
            || (group == POLICY_GROUP && kind == "Server")
    };
    let parents: Vec<serde_json::Value> = fields
        .get("parentRefs")
        .and_then(|p| p.as_array())
        .map(|p| p.iter().filter(|p| service_parent(p)).cloned().collect())
        .unwrap_or_default();
    if parents.is_empty() {
        return Ok(None);
    }
    fields.insert("parentRefs".into(), parents.into());
    fields.insert("name".into(), o.name_any().into());
    fields.insert("namespace".into(), o.namespace().unwrap_or_default().into());
    let serde_yaml::Value::Mapping(map) = serde_yaml::to_value(&spec).map_err(bounded_message)?
    else {
        return Err("spec is not a mapping".into());
    };
    tether_core::registry::parse_route(kind, map).map(Some)
}

/// A policy object's `spec`, with the metadata's name and namespace, as
/// the registry's document (`Ok(None)` for a Linkerd HTTPRoute attached to
/// no Server).
fn policy_of(crd: PolicyCrd, o: &DynamicObject) -> Result<Option<Document>, String> {
    if crd == PolicyCrd::HttpRoute {
        return Ok(route_of(RouteKind::Http, o)?.map(Document::Route));
    }
    let mut spec = o.data.get("spec").cloned().unwrap_or_default();
    let Some(fields) = spec.as_object_mut() else {
        return Err("no spec".into());
    };
    fields.insert("name".into(), o.name_any().into());
    fields.insert("namespace".into(), o.namespace().unwrap_or_default().into());
    let serde_yaml::Value::Mapping(map) = serde_yaml::to_value(&spec).map_err(bounded_message)?
    else {
        return Err("spec is not a mapping".into());
    };
    let kind = PolicyKind::from_kind(crd.kind()).expect("every policy CRD is a policy kind");
    parse_policy(kind, map).map(|p| Some(Document::Policy(p)))
}

fn key_of<K: Watched>(o: &K) -> (String, String) {
    o.key()
}

fn parse_retry_budget(v: &str) -> Option<RetryBudget> {
    let (ratio, min) = match v.split_once('/') {
        Some((r, m)) => (r.trim().parse().ok()?, m.trim().parse().ok()?),
        None => (v.trim().parse().ok()?, 0),
    };
    Some(RetryBudget {
        ratio,
        min_per_second: min,
    })
}

impl World {
    /// The service as the index takes it; `None` when it is gone or
    /// serves no TCP port (its slices' parts are then let go).
    fn state(&mut self, key: &ServiceKey, trust_domain: &str) -> Option<ServiceState> {
        let state = self.service_state(key, trust_domain);
        if state.is_none() && self.parts_ports.remove(key).is_some() {
            self.drop_parts_of(key);
        }
        state
    }

    fn service_state(&mut self, key: &ServiceKey, trust_domain: &str) -> Option<ServiceState> {
        let svc = self
            .services
            .get(&(key.namespace.clone(), key.name.clone()))?;
        let ann = &svc.annotations;
        let opaque: BTreeSet<u16> = ann
            .get(OPAQUE_PORTS)
            .map(|v| v.split(',').filter_map(|p| p.trim().parse().ok()).collect())
            .unwrap_or_default();
        let ports: Vec<PortSpec> = svc
            .ports
            .iter()
            .filter_map(|(_, port)| u16::try_from(*port).ok())
            .map(|port| PortSpec {
                port,
                opaque: opaque.contains(&port),
            })
            .collect();
        if ports.is_empty() {
            return None;
        }
        // In key order (kind, namespace, name), as the index's set holds them.
        let routes: Vec<Route> = self
            .routes_of_service
            .get(key)
            .into_iter()
            .flatten()
            .filter_map(|k| self.routes.get(k))
            .cloned()
            .collect();
        let port_keys: Vec<SlicePortKey> = svc.ports.clone();
        let mut state = ServiceState {
            ports,
            global_id: ann.get(GLOBAL_ID).cloned(),
            mode: match ann.get(MODE).map(String::as_str) {
                Some("failover") => Some(MulticlusterMode::Failover),
                Some("balanced") => Some(MulticlusterMode::Balanced),
                _ => None,
            },
            retry_budget: ann.get(RETRY_BUDGET).and_then(|v| parse_retry_budget(v)),
            response_timeout: ann
                .get(RESPONSE_TIMEOUT)
                .and_then(|v| tether_core::registry::parse_duration(v).ok()),
            cluster_ip: svc.cluster_ip,
            endpoints: EndpointList::default(),
            routes,
        };
        state.endpoints = self.endpoint_parts(key, port_keys, trust_domain);
        Some(state)
    }

    /// The service's endpoints, a part per slice in slice-name order:
    /// the parts built before, and the ones dropped since built again.
    fn endpoint_parts(
        &mut self,
        key: &ServiceKey,
        ports: Vec<SlicePortKey>,
        trust_domain: &str,
    ) -> EndpointList {
        if self.parts_ports.get(key) != Some(&ports) {
            self.drop_parts_of(key);
            self.parts_ports.insert(key.clone(), ports.clone());
        }
        let mut parts = Vec::new();
        for slice_key in self.slices_of_service.get(key).into_iter().flatten() {
            if let Some(part) = self.slice_parts.get(slice_key) {
                parts.push(part.endpoints.clone());
                continue;
            }
            let Some(slice) = self.slices.get(slice_key) else {
                continue;
            };
            let endpoints: Arc<[EndpointSpec]> =
                self.slice_endpoints(slice, &ports, trust_domain).into();
            self.listings
                .entry(key.clone())
                .or_default()
                .add(&endpoints);
            parts.push(endpoints.clone());
            self.slice_parts.insert(
                slice_key.clone(),
                SlicePart {
                    service: key.clone(),
                    endpoints,
                },
            );
        }
        let distinct = self.listings.get(key).is_none_or(|l| l.repeats == 0);
        EndpointList::parts(parts, distinct)
    }

    /// Forgets what each slice of the service gave it.
    fn drop_parts_of(&mut self, key: &ServiceKey) {
        let slices: Vec<(String, String)> = self
            .slices_of_service
            .get(key)
            .into_iter()
            .flatten()
            .cloned()
            .collect();
        for slice in &slices {
            self.drop_part(slice);
        }
    }

    /// Forgets what the slice gave its service, to be built again.
    fn drop_part(&mut self, slice: &(String, String)) {
        let Some(part) = self.slice_parts.remove(slice) else {
            return;
        };
        if let Some(listings) = self.listings.get_mut(&part.service) {
            listings.remove(&part.endpoints);
            if listings.count.is_empty() {
                self.listings.remove(&part.service);
            }
        }
    }

    /// One slice's endpoints for its service `key`, whose TCP ports are
    /// `ports`: each address of each endpoint, for each slice port that
    /// serves a service port (by name, or the only one).
    fn slice_endpoints(
        &self,
        slice: &SliceFacts,
        ports: &[SlicePortKey],
        trust_domain: &str,
    ) -> Vec<EndpointSpec> {
        // What each endpoint's listings (one per port) share: whether it is
        // meshed, its identity (one copy for the pods of one account) and
        // labels; looked up at the first port served.
        let mut of_pods = None;
        let look_up_pods = || -> Vec<_> {
            let mut identities = SharedStrings::default();
            slice
                .endpoints
                .iter()
                .map(|ep| {
                    let pod = slice.pod_of(ep).and_then(|k| self.pods.get(&k));
                    let meshed = pod.is_some_and(|p| p.meshed);
                    let identity = pod.filter(|_| meshed).map(|p| {
                        let sa = p.service_account.as_deref().unwrap_or("default");
                        // The pod's account, in the pod's namespace (a slice may
                        // name a pod of another).
                        identities.share(&tether_identity::identity_name(
                            sa,
                            &p.namespace,
                            trust_domain,
                        ))
                    });
                    let labels =
                        pod.map_or_else(tether_core::registry::no_labels, |p| p.labels.clone());
                    (meshed, identity, labels)
                })
                .collect()
        };
        let mut endpoints = Vec::new();
        for sp in &slice.ports {
            let service_port = ports
                .iter()
                .find(|(name, _)| *name == sp.name)
                .or_else(|| (ports.len() == 1).then(|| &ports[0]))
                .and_then(|(_, port)| u16::try_from(*port).ok());
            let Some(service_port) = service_port else {
                continue;
            };
            let of_pods = of_pods.get_or_insert_with(look_up_pods);
            for (ep, (meshed, identity, labels)) in slice.endpoints.iter().zip(of_pods.iter()) {
                for ip in &ep.addresses {
                    endpoints.push(EndpointSpec {
                        address: SocketAddr::new(*ip, sp.port),
                        port: Some(service_port),
                        ready: ep.ready,
                        identity: identity.clone(),
                        zone: ep.zone.clone(),
                        weight: 1,
                        meshed: *meshed,
                        name: ep.name.clone(),
                        labels: labels.clone(),
                    });
                }
            }
        }
        endpoints
    }

    /// Takes up the current version of each touched route object; returns
    /// the services whose routes may have changed (old and new parents).
    fn update_routes(
        &mut self,
        kind: RouteKind,
        touched: &[(String, String)],
        metrics: &ControlMetrics,
    ) -> BTreeSet<ServiceKey> {
        let mut affected = BTreeSet::new();
        for (namespace, name) in touched {
            let key = RouteKey {
                kind,
                namespace: namespace.clone(),
                name: name.clone(),
            };
            let objects = match kind {
                RouteKind::Http => &self.http_routes,
                RouteKind::Grpc => &self.grpc_routes,
            };
            let current = objects
                .get(&(namespace.clone(), name.clone()))
                .map(|o| route_of(kind, o));
            let old = self.remove_route(&key, &mut affected);
            match current {
                None | Some(Ok(None)) => {}
                Some(Ok(Some(route))) => self.insert_route(key, route, &mut affected),
                Some(Err(e)) => {
                    metrics.registry_reload_errors.inc();
                    tracing::error!("{key} rejected: {e}; its last valid version stays in force");
                    if let Some(old) = old {
                        self.insert_route(key, old, &mut affected);
                    }
                }
            }
        }
        affected
    }

    /// Takes up `route`, indexed under its parents, which join `affected`.
    fn insert_route(&mut self, key: RouteKey, route: Route, affected: &mut BTreeSet<ServiceKey>) {
        for parent in route.parents() {
            self.routes_of_service
                .entry(parent.clone())
                .or_default()
                .insert(key.clone());
            affected.insert(parent);
        }
        self.routes.insert(key, route);
    }

    /// Takes the route `key` out, and out of its parents' index, which join
    /// `affected`.
    fn remove_route(
        &mut self,
        key: &RouteKey,
        affected: &mut BTreeSet<ServiceKey>,
    ) -> Option<Route> {
        let route = self.routes.remove(key)?;
        for parent in route.parents() {
            remove_from(&mut self.routes_of_service, &parent, key);
            affected.insert(parent);
        }
        Some(route)
    }

    /// Takes up the current version of each touched policy object (an
    /// invalid one is logged and its last valid version kept).
    fn update_policies(
        &mut self,
        crd: PolicyCrd,
        touched: &[(String, String)],
        metrics: &ControlMetrics,
    ) {
        for (namespace, name) in touched {
            let current = self
                .policy_objects
                .get(&crd)
                .and_then(|objects| objects.get(&(namespace.clone(), name.clone())))
                .map(|o| policy_of(crd, o));
            let what = format!("{POLICY_GROUP} {} {namespace}/{name}", crd.kind());
            let route_key = RouteKey {
                kind: RouteKind::Http,
                namespace: namespace.clone(),
                name: name.clone(),
            };
            let policy_key =
                PolicyKind::from_kind(crd.kind()).map(|k| PolicyKey::new(k, namespace, name));
            match current {
                Some(Err(e)) => {
                    metrics.registry_reload_errors.inc();
                    tracing::error!("{what} rejected: {e}; its last valid version stays in force");
                }
                Some(Ok(Some(Document::Policy(p)))) => {
                    self.policies.insert(p.key(), p);
                }
                Some(Ok(Some(Document::Route(r)))) => {
                    self.linkerd_routes.insert(route_key, r);
                }
                _ => {
                    if let Some(key) = policy_key {
                        self.policies.remove(&key);
                    }
                    if crd == PolicyCrd::HttpRoute {
                        self.linkerd_routes.remove(&route_key);
                    }
                }
            }
        }
    }

    /// Every policy resource, namespace default and server route.
    fn policy_set(&self) -> PolicySet {
        let mut set = PolicySet {
            docs: self.policies.clone(),
            server_routes: self.linkerd_routes.clone(),
        };
        for ((_, name), ns) in &self.namespaces {
            let Some(value) = ns.annotations().get(DEFAULT_POLICY_ANNOTATION) else {
                continue;
            };
            match value.parse::<DefaultPolicy>() {
                Ok(policy) => {
                    let doc = PolicyDoc::Namespace(NamespaceDoc {
                        name: name.clone(),
                        default_inbound_policy: Some(policy),
                    });
                    set.docs.insert(doc.key(), doc);
                }
                Err(e) => {
                    if let Some(suppressed) = BAD_ANNOTATION_LOG.allow() {
                        tracing::warn!(namespace = %name, suppressed, "{DEFAULT_POLICY_ANNOTATION}: {e}; ignored");
                    }
                }
            }
        }
        for (key, route) in &self.routes {
            if !route.servers().is_empty() {
                set.server_routes
                    .entry(key.clone())
                    .or_insert_with(|| route.clone());
            }
        }
        set
    }

    /// Services a pod's endpoints belong to.
    fn services_of_pod(&self, ns: &str, pod: &str) -> BTreeSet<ServiceKey> {
        self.slices_of_pod
            .get(&(ns.to_string(), pod.to_string()))
            .into_iter()
            .flatten()
            .filter_map(|k| self.slice_refs.get(k)?.service.clone())
            .collect()
    }

    /// Applies one Pod event: its labels shared with the equal set held,
    /// the pods it touched counted for the sets' sweep. Whether it
    /// finished a full list, and the services of the pods it changed.
    fn on_pods(
        &mut self,
        relist: &mut Option<HashMap<(String, String), PodFacts>>,
        mut event: Event<PodFacts>,
    ) -> (bool, BTreeSet<ServiceKey>) {
        self.label_sets.share_in(&mut event);
        let mut touched = Vec::new();
        let listed = apply(&mut self.pods, relist, event, &mut touched);
        self.label_sets.counted(touched.len());
        (listed, self.pods_changed(&touched))
    }

    /// Takes up the touched pods' current versions (or their absence):
    /// the parts of the slices naming them are built again; the services
    /// of those slices.
    fn pods_changed(&mut self, touched: &[(String, String)]) -> BTreeSet<ServiceKey> {
        let mut affected = BTreeSet::new();
        for pod in touched {
            for slice in self.slices_of_pod.get(pod).cloned().into_iter().flatten() {
                self.drop_part(&slice);
            }
            affected.extend(self.services_of_pod(&pod.0, &pod.1));
        }
        affected
    }

    /// Takes up the touched slices' current versions (or their absence)
    /// in the indexes; the services they belonged to, before or now.
    fn slices_changed(&mut self, touched: Vec<(String, String)>) -> BTreeSet<ServiceKey> {
        let keys: BTreeSet<(String, String)> = touched.into_iter().collect();
        let mut affected = BTreeSet::new();
        for key in keys {
            affected.extend(self.reindex_slice(key));
        }
        affected
    }

    /// Replaces what the slice `key` was indexed under by what its current
    /// version names; the services of both.
    fn reindex_slice(&mut self, key: (String, String)) -> Vec<ServiceKey> {
        self.drop_part(&key);
        let mut services = Vec::new();
        if let Some(old) = self.slice_refs.remove(&key) {
            if let Some(service) = old.service {
                remove_from(&mut self.slices_of_service, &service, &key);
                services.push(service);
            }
            for pod in &old.pods {
                if let Some(slices) = self.slices_of_pod.get_mut(pod) {
                    slices.retain(|k| **k != key);
                    if slices.is_empty() {
                        self.slices_of_pod.remove(pod);
                    }
                }
            }
        }
        if let Some(slice) = self.slices.get(&key) {
            let mut refs = SliceRefs::of(slice);
            if let Some(service) = &refs.service {
                self.slices_of_service
                    .entry(service.clone())
                    .or_default()
                    .insert(key.clone());
                services.push(service.clone());
            }
            let key = Arc::new(key);
            for pod in &mut refs.pods {
                match self.slices_of_pod.entry(pod.clone()) {
                    hash_map::Entry::Occupied(mut held) => {
                        *pod = held.key().clone();
                        if !held.get().contains(&key) {
                            held.get_mut().push(key.clone());
                        }
                    }
                    hash_map::Entry::Vacant(new) => {
                        new.insert(vec![key.clone()]);
                    }
                }
            }
            self.slice_refs.insert(key, refs);
        }
        services
    }
}

/// Takes `item` out of `map[key]`'s set, and the set out when it empties.
fn remove_from<K: std::hash::Hash + Eq, T: Ord>(
    map: &mut HashMap<K, BTreeSet<T>>,
    key: &K,
    item: &T,
) {
    if let Some(set) = map.get_mut(key) {
        set.remove(item);
        if set.is_empty() {
            map.remove(key);
        }
    }
}

fn watch<K>(client: &Client) -> impl Stream<Item = Result<Event<K>, watcher::Error>> + Send
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
{
    watcher::watcher(Api::<K>::all(client.clone()), watcher::Config::default()).default_backoff()
}

/// Whether a watch's first list failed because the resource is absent (a
/// CRD not installed: 404) or not ours to list (403).
fn absent(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::InitialListFailed(kube::Error::Api(status))
        // The reason is not always set (a bare 404 for an unknown path).
        if status.code == 404 || status.code == 403 || status.is_not_found())
}

/// Watches something the registry can do without: its absence is
/// reported as `missing` (so loading does not wait for it) and retried
/// quietly.
fn watch_optional<K>(
    watch: impl Stream<Item = Result<Event<K>, watcher::Error>> + Send,
    wrap: impl Fn(Event<K>) -> Change + Send + 'static,
    missing: Optional,
) -> impl Stream<Item = Result<Change, watcher::Error>> + Send {
    watch.map(move |e| match e {
        Ok(e) => Ok(wrap(e)),
        Err(e) if absent(&e) => Ok(Change::Missing(missing)),
        Err(e) => Err(e),
    })
}

/// Watches one route kind. A missing CRD (404) is reported as
/// [`Change::NoCrd`] (so loading does not wait for it) and retried quietly.
fn watch_routes(
    client: &Client,
    kind: RouteKind,
) -> impl Stream<Item = Result<Change, watcher::Error>> + Send {
    let resource = route_resource(kind);
    watcher::watcher(
        Api::<DynamicObject>::all_with(client.clone(), &resource),
        watcher::Config::default(),
    )
    .default_backoff()
    .map(move |e| match e {
        Ok(e) => Ok(Change::Route(kind, e)),
        Err(watcher::Error::InitialListFailed(kube::Error::Api(status)))
            // The reason is not always set (a bare 404 for an unknown path).
            if status.code == 404 || status.is_not_found() =>
        {
            Ok(Change::NoCrd(kind))
        }
        Err(e) => Err(e),
    })
}

/// Whether an event is a live change (not part of a (re)list), whose
/// lag is worth measuring.
/// Applies one watch event of one kind to `map` (buffering a full list
/// until it is complete): the keys of the objects it changed join
/// `touched`. Returns whether the kind finished a full list.
///
/// A full list touches only what differs from what was held: after a
/// watch's `410 Gone` most of a cluster's objects come back as they were,
/// and neither their copies nor their services' rebuilds are needed.
fn apply<K: Watched + PartialEq>(
    map: &mut HashMap<(String, String), K>,
    relist: &mut Option<HashMap<(String, String), K>>,
    event: Event<K>,
    touched: &mut Vec<(String, String)>,
) -> bool {
    match event {
        Event::Init => *relist = Some(HashMap::new()),
        Event::InitApply(o) => {
            if let Some(r) = relist.as_mut() {
                r.insert(key_of(&o), o);
            }
        }
        Event::InitDone => {
            if let Some(fresh) = relist.take() {
                map.retain(|k, _| {
                    let listed = fresh.contains_key(k);
                    if !listed {
                        touched.push(k.clone());
                    }
                    listed
                });
                // What did not change stays as held, key and all, as for an
                // update that changes nothing: what was built from it shares
                // its parts (a pod's labels), which a fresh copy would
                // double, and the list's copies, dropped together, leave
                // whole pages free to return.
                for (k, mut listed) in fresh {
                    match map.get_mut(&k) {
                        Some(held) if *held == listed => {}
                        Some(held) => {
                            listed.adopt(held);
                            *held = listed;
                            touched.push(k);
                        }
                        None => {
                            touched.push(k.clone());
                            map.insert(k, listed);
                        }
                    }
                }
                // A list far shorter than what was held (a namespace gone
                // meanwhile) leaves the table as large as it was.
                if map.capacity() > 4 * map.len().max(64) {
                    map.shrink_to_fit();
                }
            }
            return true;
        }
        Event::Apply(mut o) => {
            let key = key_of(&o);
            if let Some(held) = map.get(&key) {
                // A Pod's status update: nothing the registry reads changed.
                if o.changes_nothing(held) {
                    return false;
                }
                o.adopt(held);
            }
            map.insert(key.clone(), o);
            touched.push(key);
        }
        Event::Delete(o) => {
            let key = key_of(&o);
            map.remove(&key);
            touched.push(key);
        }
    }
    false
}

/// A full list over at least this many held objects of one kind frees as
/// many (100,000 Pods: ~60 MiB), which glibc keeps until asked to return
/// them.
const LARGE_RELIST: usize = 10_000;

/// Whether `event` ends a full list that frees [`LARGE_RELIST`] objects or
/// more. Each held object is freed or its fresh copy is: one listed
/// unchanged stays as held, and its copy is dropped.
fn ends_a_large_relist<K>(
    held: &HashMap<(String, String), K>,
    relist: &Option<HashMap<(String, String), K>>,
    event: &Event<K>,
) -> bool {
    matches!(event, Event::InitDone) && relist.is_some() && held.len() >= LARGE_RELIST
}

impl Registry for KubernetesRegistry {
    async fn run(
        self,
        index: Index,
        loaded: Box<dyn FnOnce() + Send>,
    ) -> Result<(), RegistryError> {
        let changes = futures::stream::select(
            futures::stream::select(
                watch::<Service>(&self.client)
                    .map(|e| e.map(|e| Change::Service(facts(e, ServiceFacts::of)))),
                watch::<WatchedSlice>(&self.client)
                    .map(|e| e.map(|e| Change::Slice(facts(e, SliceFacts::of)))),
            ),
            futures::stream::select(
                watch::<WatchedPod>(&self.client)
                    .map(|e| e.map(|e| Change::Pod(facts(e, PodFacts::of)))),
                futures::stream::select(
                    watch_routes(&self.client, RouteKind::Http),
                    watch_routes(&self.client, RouteKind::Grpc),
                ),
            ),
        );
        let policy_watches = futures::stream::select_all(PolicyCrd::ALL.map(|crd| {
            let api = Api::<DynamicObject>::all_with(self.client.clone(), &crd.resource());
            watch_optional(
                watcher::watcher(api, watcher::Config::default()).default_backoff(),
                move |e| Change::Policy(crd, e),
                Optional::Policy(crd),
            )
            .boxed()
        }));
        let namespaces = watch_optional(
            watch::<Namespace>(&self.client),
            Change::Namespace,
            Optional::Namespaces,
        );
        let changes = futures::stream::select(
            changes,
            futures::stream::select(policy_watches, namespaces.boxed()),
        );
        let mut changes = std::pin::pin!(changes);
        let (mut policy_relists, mut namespace_relist) = (HashMap::new(), None);
        // Each policy CRD, then Namespaces: listed or found missing.
        let mut policy_synced = [false; 6];
        let mut missing_logged = [false; 6];
        let mut world = World::default();
        let (mut svc_relist, mut slice_relist, mut pod_relist) = (None, None, None);
        let (mut http_relist, mut grpc_relist) = (None, None);
        // Services, slices, pods, HTTPRoutes, GRPCRoutes.
        let mut synced = [false; 5];
        let mut no_crd_logged = [false; 2];
        let mut loaded = Some(loaded);
        while let Some(change) = changes.next().await {
            let change = match change {
                Ok(c) => c,
                Err(e) => {
                    self.metrics.registry_reload_errors.inc();
                    tracing::warn!(error = %e, "Kubernetes watch failed; it is retried with backoff");
                    continue;
                }
            };
            let observed_at = Instant::now();
            let mut affected = BTreeSet::new();
            let mut policies_changed = false;
            let mut freed_much = false;
            match change {
                Change::Policy(crd, e) => {
                    let mut touched = Vec::new();
                    let relist = policy_relists.entry(crd).or_insert(None);
                    let objects = world.policy_objects.entry(crd).or_default();
                    policy_synced[crd as usize] |= apply(objects, relist, e, &mut touched);
                    world.update_policies(crd, &touched, &self.metrics);
                    policies_changed = true;
                }
                Change::Namespace(e) => {
                    let mut touched = Vec::new();
                    policy_synced[5] |= apply(
                        &mut world.namespaces,
                        &mut namespace_relist,
                        e,
                        &mut touched,
                    );
                    policies_changed = true;
                }
                Change::Missing(what) => {
                    let i = match what {
                        Optional::Policy(crd) => crd as usize,
                        Optional::Namespaces => 5,
                    };
                    if !std::mem::replace(&mut missing_logged[i], true) {
                        match what {
                            Optional::Policy(crd) => tracing::warn!(
                                "the {} CRD ({POLICY_GROUP}/{}) is not installed (or may not be listed): \
                                 no {} from Kubernetes until it is (`tether install` prints it)",
                                crd.kind(),
                                crd.version(),
                                crd.kind(),
                            ),
                            Optional::Namespaces => tracing::warn!(
                                "Namespaces may not be listed: no per-namespace default inbound policy \
                                 ({DEFAULT_POLICY_ANNOTATION}) until they may (`tether install` has the RBAC)"
                            ),
                        }
                    }
                    policy_synced[i] = true;
                }
                Change::Service(e) => {
                    self.observe_lag("Service", &e);
                    let mut touched = Vec::new();
                    freed_much = ends_a_large_relist(&world.services, &svc_relist, &e);
                    synced[0] |= apply(&mut world.services, &mut svc_relist, e, &mut touched);
                    affected.extend(
                        touched
                            .into_iter()
                            .map(|(namespace, name)| ServiceKey::new(name, namespace)),
                    );
                }
                Change::Slice(e) => {
                    self.observe_lag("EndpointSlice", &e);
                    let mut touched = Vec::new();
                    freed_much = ends_a_large_relist(&world.slices, &slice_relist, &e);
                    synced[1] |= apply(&mut world.slices, &mut slice_relist, e, &mut touched);
                    affected.extend(world.slices_changed(touched));
                }
                Change::Pod(e) => {
                    self.observe_lag("Pod", &e);
                    freed_much = ends_a_large_relist(&world.pods, &pod_relist, &e);
                    let (listed, services) = world.on_pods(&mut pod_relist, e);
                    // Sweeps of as many label sets as a large list frees
                    // as much.
                    freed_much |= world.label_sets.freed_at_least(LARGE_RELIST);
                    synced[2] |= listed;
                    affected.extend(services);
                }
                Change::Route(kind, e) => {
                    self.observe_lag(kind.as_str(), &e);
                    let mut touched = Vec::new();
                    let (objects, relist, i) = match kind {
                        RouteKind::Http => (&mut world.http_routes, &mut http_relist, 3),
                        RouteKind::Grpc => (&mut world.grpc_routes, &mut grpc_relist, 4),
                    };
                    synced[i] |= apply(objects, relist, e, &mut touched);
                    affected.extend(world.update_routes(kind, &touched, &self.metrics));
                    policies_changed = true;
                }
                Change::NoCrd(kind) => {
                    let i = kind as usize;
                    if !std::mem::replace(&mut no_crd_logged[i], true) {
                        tracing::warn!(
                            "the {} CRD ({GATEWAY_GROUP}/v1) is not installed: no routes from Kubernetes until it is \
                             (install the Gateway API CRDs; `tether install` says how)",
                            kind.as_str()
                        );
                    }
                    synced[3 + i] = true;
                }
            }
            for key in affected {
                index.set_service_observed(
                    &key,
                    world.state(&key, &self.trust_domain),
                    observed_at,
                );
            }
            if policies_changed {
                index.set_policies(world.policy_set());
            }
            if freed_much {
                self.memory.ask();
            }
            if synced.iter().chain(&policy_synced).all(|s| *s) {
                if let Some(cb) = loaded.take() {
                    tracing::info!(
                        services = world.services.len(),
                        "Kubernetes registry synced"
                    );
                    cb();
                }
            }
        }
        Ok(())
    }
}

impl KubernetesRegistry {
    /// The lag of a live change (not a list's): from the object's last
    /// change, as its managed fields or creation time say, to now.
    fn observe_lag<K: Watched>(&self, kind: &str, e: &Event<K>) {
        let (Event::Apply(o) | Event::Delete(o)) = e else {
            return;
        };
        if let Some(at) = o.changed_at() {
            let lag = k8s_openapi::jiff::Timestamp::now()
                .duration_since(at)
                .as_secs_f64();
            self.lag
                .get_or_create(&KindLabels { kind: kind.into() })
                .observe(lag.max(0.0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        Container, ObjectReference, Pod, PodSpec, ServicePort, ServiceSpec,
    };
    use k8s_openapi::api::discovery::v1::{
        Endpoint, EndpointConditions, EndpointPort, EndpointSlice,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use proptest::prelude::*;

    /// An object as the watch reads it: as JSON, read back as watched.
    fn read_as_watched<W: serde::de::DeserializeOwned>(object: &impl serde::Serialize) -> W {
        let json = serde_json::to_vec(object).expect("an object as JSON");
        serde_json::from_slice(&json).expect("an object read as watched")
    }

    /// A Pod's facts as the watch reads them.
    fn pod_facts(pod: Pod) -> PodFacts {
        PodFacts::of(read_as_watched(&pod))
    }

    /// A slice's facts as the watch reads them.
    fn slice_facts(slice: EndpointSlice) -> SliceFacts {
        SliceFacts::of(read_as_watched(&slice))
    }

    fn meta(ns: &str, name: String, labels: &[(&str, String)]) -> ObjectMeta {
        ObjectMeta {
            name: Some(name),
            namespace: Some(ns.into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.clone()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        }
    }

    fn service(ns: &str, name: String) -> Service {
        Service {
            metadata: meta(ns, name, &[]),
            spec: Some(ServiceSpec {
                ports: Some(vec![ServicePort {
                    name: Some("http".into()),
                    port: 80,
                    protocol: Some("TCP".into()),
                    ..ServicePort::default()
                }]),
                ..ServiceSpec::default()
            }),
            ..Service::default()
        }
    }

    /// An endpoint at `n`'s address, naming a target by kind, namespace
    /// (none: the slice's) and name.
    fn endpoint(n: usize, ready: bool, target: Option<(&str, Option<&str>, String)>) -> Endpoint {
        Endpoint {
            addresses: vec![format!("10.{}.{}.{}", n >> 16 & 255, n >> 8 & 255, n & 255)],
            conditions: Some(EndpointConditions {
                ready: Some(ready),
                ..EndpointConditions::default()
            }),
            target_ref: target.map(|(kind, ns, name)| ObjectReference {
                kind: Some(kind.into()),
                namespace: ns.map(Into::into),
                name: Some(name),
                ..ObjectReference::default()
            }),
            ..Endpoint::default()
        }
    }

    fn slice(
        ns: &str,
        name: String,
        service: Option<String>,
        endpoints: Vec<Endpoint>,
    ) -> EndpointSlice {
        let labels: Vec<(&str, String)> = service
            .map(|s| (SERVICE_NAME_LABEL, s))
            .into_iter()
            .collect();
        EndpointSlice {
            metadata: meta(ns, name, &labels),
            address_type: "IPv4".into(),
            ports: Some(vec![EndpointPort {
                name: Some("http".into()),
                port: Some(8080),
                ..EndpointPort::default()
            }]),
            endpoints: Some(endpoints),
        }
    }

    fn pod(ns: &str, name: String, generation: usize) -> Pod {
        Pod {
            metadata: meta(ns, name, &[("generation", generation.to_string())]),
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: PROXY_CONTAINER.into(),
                    ..Container::default()
                }],
                service_account_name: Some("app".into()),
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }

    /// What the run loop does with one slice event: the services it
    /// touches, with the endpoints each has now.
    fn on_slices(
        world: &mut World,
        relist: &mut Option<HashMap<(String, String), SliceFacts>>,
        e: Event<EndpointSlice>,
    ) -> BTreeMap<ServiceKey, usize> {
        on_slice_facts(world, relist, facts(e, slice_facts))
    }

    /// As [`on_slices`], for an event of facts.
    fn on_slice_facts(
        world: &mut World,
        relist: &mut Option<HashMap<(String, String), SliceFacts>>,
        e: Event<SliceFacts>,
    ) -> BTreeMap<ServiceKey, usize> {
        let mut touched = Vec::new();
        apply(&mut world.slices, relist, e, &mut touched);
        world
            .slices_changed(touched)
            .into_iter()
            .map(|k| {
                let n = world
                    .state(&k, "cluster.local")
                    .map_or(0, |s| s.endpoints.len());
                (k, n)
            })
            .collect()
    }

    /// A slice of the proptests: its namespace (`b` or `a`), its name, its
    /// service (in its namespace), and its endpoints' targets (pod, the
    /// reference's namespace: none, `b` or `a`, whether it is a Pod).
    type SliceSpec = (bool, usize, Option<usize>, Vec<(usize, Option<bool>, bool)>);

    fn ns(b: bool) -> &'static str {
        if b {
            "b"
        } else {
            "a"
        }
    }

    fn build(spec: &SliceSpec) -> EndpointSlice {
        let (in_b, name, service, targets) = spec;
        let endpoints = targets
            .iter()
            .enumerate()
            .map(|(i, (pod, ref_ns, is_pod))| {
                let kind = if *is_pod { "Pod" } else { "Node" };
                // A pod's address: a pod in two slices (as while it moves
                // from one to another), or twice in one, is listed twice.
                let n = usize::from(*in_b) * 8 + pod;
                endpoint(
                    n,
                    (i + name) % 2 == 0,
                    Some((kind, ref_ns.map(ns), format!("p{pod}"))),
                )
            })
            .collect();
        slice(
            ns(*in_b),
            format!("s{name}"),
            service.map(|s| format!("svc{s}")),
            endpoints,
        )
    }

    #[derive(Clone, Debug)]
    enum SliceEvent {
        Apply(SliceSpec),
        /// Deletes the slice of this spec's namespace and name, sending
        /// the stored object, or (`true`) this spec's other version of it.
        Delete(SliceSpec, bool),
        /// A full list; with a second, it was restarted before it ended.
        Relist(Vec<SliceSpec>, Option<Vec<SliceSpec>>),
        /// A full list of exactly the slices held, as after a `410 Gone`
        /// when nothing changed meanwhile.
        RelistHeld,
        /// Pod `p` (in `b` or `a`) of this generation (its labels), or gone.
        Pod(usize, bool, Option<usize>),
        /// Service `s` (in `b` or `a`) with the ports of this variant.
        Ports(usize, bool, usize),
    }

    /// Service `name`'s ports, by variant: `http` 80; `http` 81; `http`
    /// 80 and `admin` 9000; a UDP port only (no service for the index);
    /// 80 unnamed; `admin` 80; `http` 80 over TCP and 81 over UDP.
    fn service_with_ports(ns: &str, name: String, variant: usize) -> Service {
        let port = |name: Option<&str>, port: i32, protocol: &str| ServicePort {
            name: name.map(Into::into),
            port,
            protocol: Some(protocol.into()),
            ..ServicePort::default()
        };
        let mut svc = service(ns, name);
        svc.spec.as_mut().expect("a spec").ports = Some(match variant {
            0 => vec![port(Some("http"), 80, "TCP")],
            1 => vec![port(Some("http"), 81, "TCP")],
            2 => vec![
                port(Some("http"), 80, "TCP"),
                port(Some("admin"), 9000, "TCP"),
            ],
            3 => vec![port(Some("dns"), 53, "UDP")],
            4 => vec![port(None, 80, "TCP")],
            5 => vec![port(Some("admin"), 80, "TCP")],
            _ => vec![port(Some("http"), 80, "TCP"), port(Some("http"), 81, "UDP")],
        });
        svc
    }

    fn slice_spec() -> impl Strategy<Value = SliceSpec> {
        (
            any::<bool>(),
            0usize..4,
            proptest::option::of(0usize..4),
            proptest::collection::vec(
                (
                    0usize..5,
                    proptest::option::of(any::<bool>()),
                    any::<bool>(),
                ),
                0..4,
            ),
        )
    }

    fn slice_event() -> impl Strategy<Value = SliceEvent> {
        let list = || proptest::collection::vec(slice_spec(), 0..5);
        prop_oneof![
            4 => slice_spec().prop_map(SliceEvent::Apply),
            2 => (slice_spec(), any::<bool>()).prop_map(|(s, other)| SliceEvent::Delete(s, other)),
            1 => (list(), proptest::option::of(list())).prop_map(|(a, b)| SliceEvent::Relist(a, b)),
            2 => (0usize..5, any::<bool>(), proptest::option::of(0usize..3))
                .prop_map(|(p, b, g)| SliceEvent::Pod(p, b, g)),
            1 => (0usize..4, any::<bool>(), 0usize..7).prop_map(|(s, b, v)| SliceEvent::Ports(s, b, v)),
            1 => Just(SliceEvent::RelistHeld),
        ]
    }

    fn service_keys() -> Vec<ServiceKey> {
        (0..4)
            .flat_map(|s| ["a", "b"].map(|n| ServiceKey::new(format!("svc{s}"), n.to_string())))
            .collect()
    }

    /// The services whose slices name the pod `(ns, name)`, found by
    /// looking at every slice and resolving each reference as `state` does
    /// (a Pod; no namespace is the slice's): what the index must answer.
    fn services_of_pod_by_scan(world: &World, ns: &str, name: &str) -> BTreeSet<ServiceKey> {
        world
            .slices
            .values()
            .filter(|s| {
                s.endpoints.iter().any(|e| {
                    let pod_ns = match &e.pod {
                        facts::PodRef::None => return false,
                        facts::PodRef::Own => &s.namespace,
                        facts::PodRef::In(pod_ns) => pod_ns,
                    };
                    e.name.as_deref() == Some(name) && pod_ns == ns
                })
            })
            .filter_map(|s| s.service.clone())
            .collect()
    }

    /// Every set (or list) in `map` has members, each once, and each
    /// satisfies `exists`.
    fn no_empty_or_stale<K, C, T>(
        map: &HashMap<K, C>,
        exists: impl Fn(&K, &T) -> bool,
    ) -> Result<(), TestCaseError>
    where
        K: std::fmt::Debug,
        T: std::fmt::Debug + Ord + 'static,
        for<'a> &'a C: IntoIterator<Item = &'a T>,
    {
        for (k, set) in map {
            let members: Vec<&T> = set.into_iter().collect();
            prop_assert!(!members.is_empty(), "an empty set left under {k:?}");
            let distinct: BTreeSet<&T> = members.iter().copied().collect();
            prop_assert_eq!(
                distinct.len(),
                members.len(),
                "a member twice under {:?}",
                k
            );
            for t in members {
                prop_assert!(exists(k, t), "{t:?} under {k:?} is stale");
            }
        }
        Ok(())
    }

    /// What a Delete event sends for `sent`'s key, if an object is held
    /// under it: the stored object, or (`other`) another version of it.
    fn deleted<K: Clone + Watched>(
        map: &HashMap<(String, String), K>,
        sent: K,
        other: bool,
    ) -> Option<K> {
        let stored = map.get(&key_of(&sent)).cloned()?;
        Some(if other { sent } else { stored })
    }

    /// The service's state computed from scratch: a world of the same
    /// objects with nothing built yet.
    fn fresh_state(world: &World, key: &ServiceKey) -> Option<ServiceState> {
        let mut fresh = World {
            services: world.services.clone(),
            pods: world.pods.clone(),
            ..World::default()
        };
        for (k, slice) in &world.slices {
            fresh.slices.insert(k.clone(), slice.clone());
            fresh.reindex_slice(k.clone());
        }
        fresh.state(key, "cluster.local")
    }

    /// The indexed answers against a scan of every slice, and the indexes
    /// against the slices they are derived from.
    fn check_slices(world: &mut World) -> Result<(), TestCaseError> {
        for key in service_keys() {
            let state = world.state(&key, "cluster.local");
            let by_scan: BTreeSet<String> = world
                .slices
                .values()
                .filter(|sl| sl.service.as_ref() == Some(&key) && state.is_some())
                .flat_map(|sl| sl.endpoints.iter())
                .map(|e| format!("{}:8080", e.addresses[0]))
                .collect();
            let indexed: BTreeSet<String> = state
                .as_ref()
                .map(|st| st.endpoints.iter().map(|e| e.address.to_string()).collect())
                .unwrap_or_default();
            prop_assert_eq!(indexed, by_scan, "endpoints of {}", key);
            // Every endpoint as built from scratch, in order; and the list
            // says it is distinct exactly when no endpoint is listed twice.
            let fresh = fresh_state(world, &key);
            prop_assert_eq!(&state, &fresh, "the state of {}", key);
            if let Some(state) = &state {
                let listed: Vec<_> = state
                    .endpoints
                    .iter()
                    .map(|e| (e.address, e.port))
                    .collect();
                let distinct: BTreeSet<_> = listed.iter().collect();
                prop_assert_eq!(
                    state.endpoints.is_distinct(),
                    distinct.len() == listed.len(),
                    "{:?}",
                    listed
                );
            }
        }
        for (slice, part) in &world.slice_parts {
            prop_assert_eq!(
                world.slice_refs.get(slice).and_then(|r| r.service.as_ref()),
                Some(&part.service)
            );
        }
        for n in ["a", "b"] {
            for p in 0..5 {
                let name = format!("p{p}");
                prop_assert_eq!(
                    world.services_of_pod(n, &name),
                    services_of_pod_by_scan(world, n, &name),
                    "services of pod {}/{}",
                    n,
                    name
                );
            }
        }
        no_empty_or_stale(&world.slices_of_service, |svc, k| {
            world.slices.get(k).and_then(|s| s.service.as_ref()) == Some(svc)
        })?;
        no_empty_or_stale(&world.slices_of_pod, |pod, k| {
            world
                .slice_refs
                .get(k)
                .is_some_and(|r| r.pods.contains(pod))
        })?;
        prop_assert_eq!(
            world
                .slice_refs
                .keys()
                .map(|k| &**k)
                .collect::<BTreeSet<_>>(),
            world.slices.keys().collect::<BTreeSet<_>>()
        );
        check_shared_keys(world)
    }

    /// Each slice's refs are what its current version names, the two
    /// indexes are each other's inverse, and each key is one Arc: the pod
    /// keys in the slices' lists are the map's keys, the slice keys in the
    /// pods' lists are `slice_refs`' keys, and nothing else holds them.
    /// (From the hostile review.)
    fn check_shared_keys(world: &World) -> Result<(), TestCaseError> {
        let mut slices_naming: HashMap<&(String, String), usize> = HashMap::new();
        for (key, refs) in &world.slice_refs {
            let slice = world.slices.get(&**key).expect("refs of a held slice");
            let fresh = SliceRefs::of(slice);
            prop_assert_eq!(&refs.pods, &fresh.pods, "refs of {:?}", key);
            prop_assert_eq!(&refs.service, &fresh.service, "service of {:?}", key);
            for pod in &refs.pods {
                *slices_naming.entry(&**pod).or_default() += 1;
                let (held, slices) = world
                    .slices_of_pod
                    .get_key_value(pod)
                    .ok_or_else(|| TestCaseError::fail(format!("{pod:?} of {key:?} unindexed")))?;
                prop_assert!(
                    Arc::ptr_eq(held, pod),
                    "{:?} of {:?} a second Arc",
                    pod,
                    key
                );
                prop_assert!(
                    slices.iter().any(|s| Arc::ptr_eq(s, key)),
                    "{:?} not under {:?} (as the same Arc)",
                    key,
                    pod
                );
            }
            prop_assert_eq!(
                Arc::strong_count(key),
                1 + refs.pods.len(),
                "holders of slice key {:?}",
                key
            );
        }
        for (pod, slices) in &world.slices_of_pod {
            prop_assert_eq!(
                slices.len(),
                slices_naming.get(&**pod).copied().unwrap_or(0)
            );
            prop_assert_eq!(
                Arc::strong_count(pod),
                1 + slices.len(),
                "holders of pod key {:?}",
                pod
            );
        }
        Ok(())
    }

    fn http_route_object(name: usize, parents: &[usize], valid: bool) -> DynamicObject {
        let parent_refs: Vec<serde_json::Value> = parents
            .iter()
            .map(|p| serde_json::json!({"group": "", "kind": "Service", "name": format!("svc{p}"), "port": 80}))
            .collect();
        let rules = if valid {
            serde_json::json!([{"backendRefs": [{"group": "", "kind": "Service", "name": "svc0", "port": 80}]}])
        } else {
            serde_json::json!(7)
        };
        serde_json::from_value(serde_json::json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": format!("r{name}"), "namespace": "a"},
            "spec": {"parentRefs": parent_refs, "rules": rules},
        }))
        .expect("an HTTPRoute object")
    }

    #[derive(Clone, Debug)]
    enum RouteEvent {
        /// A version of route `name` with these parents, valid or not.
        Apply(usize, Vec<usize>, bool),
        Delete(usize),
    }

    fn route_event() -> impl Strategy<Value = RouteEvent> {
        prop_oneof![
            4 => (0usize..4, proptest::collection::vec(0usize..4, 0..3), proptest::bool::weighted(0.8))
                .prop_map(|(n, p, v)| RouteEvent::Apply(n, p, v)),
            1 => (0usize..4).prop_map(RouteEvent::Delete),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        /// Whatever the order of applies, deletes (sending the stored
        /// object or another version of it) and full lists (restarted or
        /// not), the indexes answer what a scan of every slice answers —
        /// each service's endpoints, each pod's services, also halfway
        /// through a full list — and an event names every service a
        /// touched slice belonged to, before it or after.
        #[test]
        fn the_slice_indexes_answer_as_a_scan_does(
            events in proptest::collection::vec(slice_event(), 1..20),
        ) {
            let mut world = World::default();
            for key in service_keys() {
                let svc = service(&key.namespace, key.name.clone());
                world.services.insert(key_of(&svc), ServiceFacts::of(svc));
            }
            let mut relist = None;
            for event in events {
                let before = world.slices.clone();
                let (touched_keys, affected): (Vec<(String, String)>, _) = match event {
                    SliceEvent::Pod(p, in_b, generation) => {
                        let p = pod(ns(in_b), format!("p{p}"), generation.unwrap_or(0));
                        let key = key_of(&p);
                        let services = world.services_of_pod(&key.0, &key.1);
                        match generation {
                            Some(_) => world.pods.insert(key, pod_facts(p.clone())),
                            None => world.pods.remove(&key),
                        };
                        prop_assert_eq!(world.pods_changed(&[key_of(&p)]), services);
                        check_slices(&mut world)?;
                        continue;
                    }
                    SliceEvent::RelistHeld => {
                        on_slices(&mut world, &mut relist, Event::Init);
                        for slice in before.values() {
                            on_slice_facts(&mut world, &mut relist, Event::InitApply(slice.clone()));
                        }
                        let named = on_slices(&mut world, &mut relist, Event::InitDone);
                        prop_assert!(named.is_empty(), "a relist of what is held named {named:?}");
                        check_slices(&mut world)?;
                        continue;
                    }
                    SliceEvent::Ports(s, in_b, variant) => {
                        let svc = service_with_ports(ns(in_b), format!("svc{s}"), variant);
                        world.services.insert(key_of(&svc), ServiceFacts::of(svc));
                        check_slices(&mut world)?;
                        continue;
                    }
                    SliceEvent::Apply(spec) => {
                        let s = build(&spec);
                        (vec![key_of(&s)], on_slices(&mut world, &mut relist, Event::Apply(s)))
                    }
                    SliceEvent::Delete(spec, other) => {
                        let Some(sent) = deleted(&world.slices, slice_facts(build(&spec)), other) else {
                            continue;
                        };
                        (vec![key_of(&sent)], on_slice_facts(&mut world, &mut relist, Event::Delete(sent)))
                    }
                    SliceEvent::Relist(first, restarted) => {
                        let mut last = &first;
                        on_slices(&mut world, &mut relist, Event::Init);
                        for spec in &first {
                            on_slices(&mut world, &mut relist, Event::InitApply(build(spec)));
                        }
                        check_slices(&mut world)?;
                        if let Some(again) = &restarted {
                            on_slices(&mut world, &mut relist, Event::Init);
                            for spec in again {
                                on_slices(&mut world, &mut relist, Event::InitApply(build(spec)));
                            }
                            last = again;
                        }
                        let keys = before.keys().cloned().chain(last.iter().map(|s| key_of(&build(s)))).collect();
                        (keys, on_slices(&mut world, &mut relist, Event::InitDone))
                    }
                };
                for key in &touched_keys {
                    if before.get(key) == world.slices.get(key) {
                        continue; // listed again as it was: nothing to name
                    }
                    let was = before.get(key).and_then(|s| s.service.clone());
                    let now = world.slices.get(key).and_then(|s| s.service.clone());
                    for service in was.iter().chain(now.iter()) {
                        prop_assert!(affected.contains_key(service), "{service} not named after touching {key:?}");
                    }
                }
                check_slices(&mut world)?;
            }
        }

        /// Routes applied (with parents that change, repeat or go),
        /// rejected (the last valid version stays) and deleted: each
        /// service's routes are what a scan of every route finds, and an
        /// event names every service a touched route had as a parent,
        /// before it or after.
        #[test]
        fn the_route_index_answers_as_a_scan_does(
            events in proptest::collection::vec(route_event(), 1..24),
        ) {
            let metrics = ControlMetrics::default();
            let mut world = World::default();
            for s in 0..4 {
                let svc = service("a", format!("svc{s}"));
                world.services.insert(key_of(&svc), ServiceFacts::of(svc));
            }
            for event in events {
                let (object, present) = match event {
                    RouteEvent::Apply(name, parents, valid) => (http_route_object(name, &parents, valid), true),
                    RouteEvent::Delete(name) => (http_route_object(name, &[], true), false),
                };
                let key = key_of(&object);
                let route_key = RouteKey { kind: RouteKind::Http, namespace: key.0.clone(), name: key.1.clone() };
                let was: BTreeSet<ServiceKey> = world.routes.get(&route_key).map(Route::parents).unwrap_or_default();
                if present {
                    world.http_routes.insert(key, object.clone());
                } else {
                    world.http_routes.remove(&key);
                }
                let affected = world.update_routes(RouteKind::Http, &[key_of(&object)], &metrics);
                let now: BTreeSet<ServiceKey> = world.routes.get(&route_key).map(Route::parents).unwrap_or_default();
                for service in was.iter().chain(&now) {
                    prop_assert!(affected.contains(service), "{service} not named after {route_key}");
                }
                for s in 0..4 {
                    let svc = ServiceKey::new(format!("svc{s}"), "a".to_string());
                    let mut by_scan: Vec<Route> = world.routes.values().filter(|r| r.parents().contains(&svc)).cloned().collect();
                    by_scan.sort_by_key(Route::key);
                    let indexed = world.state(&svc, "cluster.local").map(|st| st.routes).unwrap_or_default();
                    prop_assert_eq!(indexed, by_scan, "routes of {}", svc);
                }
                no_empty_or_stale(&world.routes_of_service, |svc, k| {
                    world.routes.get(k).is_some_and(|r| r.parents().contains(svc))
                })?;
            }
        }
    }

    /// A service in 20 slices of 100 endpoints: a change to one slice
    /// builds that slice's part only, and the index follows it from the
    /// change (no snapshot of the service built). A pod listed in two
    /// slices (as while it moves) makes the index rebuild the service,
    /// and it stays right; once the pod is listed once, changes are
    /// followed slice by slice again.
    #[test]
    fn a_change_to_one_slice_of_a_large_service_costs_that_slice() {
        let mut world = World::default();
        let svc = service("a", "web".into());
        world.services.insert(key_of(&svc), ServiceFacts::of(svc));
        let key = ServiceKey::new("web", "a");
        let index = Index::new(ControlMetrics::default());
        let mut relist = None;
        let mut apply_slice = |world: &mut World, e: Event<EndpointSlice>| {
            for k in on_slices(world, &mut relist, e).into_keys() {
                index.set_service(&k, world.state(&k, "cluster.local"));
            }
        };
        let web_slice = |k: usize, first: usize| {
            let endpoints = (first..100)
                .map(|e| endpoint(k * 100 + e, true, None))
                .collect();
            slice("a", format!("web-{k:02}"), Some("web".into()), endpoints)
        };
        for k in 0..20 {
            apply_slice(&mut world, Event::Apply(web_slice(k, 0)));
        }
        let slot = crate::index::SlotKey::Service(key.clone());
        let _watching = index.subscribe(&slot, 80);
        let endpoints = |index: &Index| index.snapshot(&slot, 80).endpoints.len();
        assert_eq!(endpoints(&index), 2_000);
        let parts_built = |world: &World| world.slice_parts.len();

        let built = index.snapshots_built();
        apply_slice(&mut world, Event::Apply(web_slice(19, 1)));
        assert_eq!(index.snapshots_built(), built, "snapshots built");
        assert_eq!(parts_built(&world), 20);
        assert_eq!(endpoints(&index), 1_999);
        assert!(index.check_slot(&slot, 80).1);

        let moving = slice(
            "a",
            "web-20".into(),
            Some("web".into()),
            vec![endpoint(0, false, None)],
        );
        apply_slice(&mut world, Event::Apply(moving.clone()));
        assert!(
            index.snapshots_built() > built,
            "a repeated listing is rebuilt"
        );
        assert!(!index.service(&key).expect("web").endpoints.is_distinct());
        assert_eq!(endpoints(&index), 1_999);
        assert!(index.check_slot(&slot, 80).1);

        apply_slice(&mut world, Event::Delete(moving));
        apply_slice(&mut world, Event::Apply(web_slice(0, 1)));
        let built = index.snapshots_built();
        apply_slice(&mut world, Event::Apply(web_slice(0, 0)));
        assert_eq!(index.snapshots_built(), built, "snapshots built");
        assert_eq!(endpoints(&index), 1_999);
        assert!(index.check_slot(&slot, 80).1);
    }

    /// A Pod as an API server sends it for a Deployment's replica with the
    /// proxy injected: full spec, status and managed fields.
    fn pod_as_sent(ns: &str, name: &str) -> Pod {
        let env = |n: usize| -> Vec<serde_json::Value> {
            (0..n)
                .map(|i| serde_json::json!({"name": format!("SETTING_{i}"), "value": format!("value-{i}-of-some-length")}))
                .collect()
        };
        let fields = serde_json::json!({"f:metadata": {"f:labels": {".": {}, "f:app": {}, "f:pod-template-hash": {}}, "f:ownerReferences": {".": {}, "k:{\"uid\":\"0b1d\"}": {}}}, "f:spec": {"f:containers": {"k:{\"name\":\"app\"}": {".": {}, "f:env": {}, "f:image": {}, "f:ports": {}, "f:resources": {}}, "k:{\"name\":\"tether-proxy\"}": {".": {}, "f:args": {}, "f:env": {}}}}});
        let status_fields = serde_json::json!({"f:status": {"f:conditions": {"k:{\"type\":\"Ready\"}": {".": {}, "f:lastTransitionTime": {}, "f:status": {}, "f:type": {}}}, "f:containerStatuses": {}, "f:hostIP": {}, "f:phase": {}, "f:podIP": {}, "f:podIPs": {}, "f:startTime": {}}});
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name, "generateName": "web-5d8f7c9b4-", "namespace": ns,
                "uid": "6f1c2d3e-4b5a-6978-8a9b-0c1d2e3f4a5b", "resourceVersion": "123456789",
                "creationTimestamp": "2026-12-01T10:00:00Z",
                "labels": {"app": "web", "pod-template-hash": "5d8f7c9b4", "version": "v2", "team": "payments"},
                "annotations": {"tether.io/inject": "enabled", "kubectl.kubernetes.io/restartedAt": "2026-12-01T09:59:00Z", "prometheus.io/scrape": "true"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d8f7c9b4", "uid": "0b1d", "controller": true, "blockOwnerDeletion": true}],
                "managedFields": [
                    {"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1", "time": "2026-12-01T10:00:00Z", "fieldsType": "FieldsV1", "fieldsV1": fields},
                    {"manager": "kubelet", "operation": "Update", "apiVersion": "v1", "time": "2026-12-01T10:00:07Z", "fieldsType": "FieldsV1", "fieldsV1": status_fields, "subresource": "status"},
                ],
            },
            "spec": {
                "serviceAccountName": "web", "nodeName": "node-17", "dnsPolicy": "ClusterFirst", "restartPolicy": "Always",
                "containers": [
                    {"name": "app", "image": "registry.example.com/payments/web:2.14.3", "ports": [{"containerPort": 8080, "protocol": "TCP", "name": "http"}],
                     "env": env(8), "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
                     "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080}, "periodSeconds": 5},
                     "volumeMounts": [{"name": "config", "mountPath": "/etc/web"}, {"name": "kube-api-access-x7k2p", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}]},
                    {"name": "tether-proxy", "image": "tether:latest", "args": ["proxy", "--control", "tether-control.tether-system.svc:8086", "--outbound", "127.0.0.1:4140", "--inbound", "0.0.0.0:4143", "--admin", "0.0.0.0:4191", "--app", "127.0.0.1:8080"],
                     "env": env(6), "ports": [{"containerPort": 4143, "name": "inbound"}, {"containerPort": 4191, "name": "admin"}],
                     "securityContext": {"runAsUser": 1337, "readOnlyRootFilesystem": true}},
                ],
                "initContainers": [{"name": "tether-init", "image": "tether:latest", "args": ["init", "--proxy-uid", "1337"], "securityContext": {"capabilities": {"add": ["NET_ADMIN", "NET_RAW"]}}}],
                "volumes": [{"name": "config", "configMap": {"name": "web-config"}}, {"name": "kube-api-access-x7k2p", "projected": {"sources": [{"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}]}}],
                "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}],
            },
            "status": {
                "phase": "Running", "hostIP": "10.0.3.17", "podIP": "10.244.3.45", "podIPs": [{"ip": "10.244.3.45"}], "startTime": "2026-12-01T10:00:00Z", "qosClass": "Burstable",
                "conditions": [
                    {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-12-01T10:00:02Z"},
                    {"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-01T10:00:07Z"},
                    {"type": "ContainersReady", "status": "True", "lastTransitionTime": "2026-12-01T10:00:07Z"},
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-12-01T10:00:00Z"},
                ],
                "containerStatuses": [
                    {"name": "app", "ready": true, "restartCount": 0, "image": "registry.example.com/payments/web:2.14.3", "imageID": "registry.example.com/payments/web@sha256:4f5e6d7c8b9a0f1e2d3c4b5a69788796a5b4c3d2e1f00112233445566778899", "containerID": "containerd://a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9", "started": true, "state": {"running": {"startedAt": "2026-12-01T10:00:03Z"}}},
                    {"name": "tether-proxy", "ready": true, "restartCount": 0, "image": "tether:latest", "imageID": "docker.io/library/tether@sha256:00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff", "containerID": "containerd://0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0", "started": true, "state": {"running": {"startedAt": "2026-12-01T10:00:03Z"}}},
                ],
            },
        }))
        .expect("a Pod")
    }

    /// A skipped status update, then a Delete naming the newer version, a
    /// Pod created again with the same facts, and full lists that see a new
    /// time only, new labels, or no Pod: each touches what it should. A
    /// whole object is never skipped. (From a hostile review of the facts.)
    #[test]
    fn pod_updates_deletes_and_lists_over_facts() {
        let facts = |g: usize, at: &str| {
            let mut p = pod("a", "web-1".into(), g);
            let at = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at.parse().unwrap());
            p.metadata.creation_timestamp = Some(at);
            pod_facts(p)
        };
        let key = ("a".to_string(), "web-1".to_string());
        let just_it = vec![key.clone()];
        let (mut pods, mut relist) = (HashMap::new(), None);
        let run = |pods: &mut HashMap<_, _>, relist: &mut Option<_>, e| {
            let mut touched = Vec::new();
            apply(pods, relist, e, &mut touched);
            touched
        };
        let created = Event::Apply(facts(0, "2026-12-01T10:00:00Z"));
        assert_eq!(run(&mut pods, &mut relist, created), just_it);
        // A status update: skipped, the held time is the old one.
        let update = Event::Apply(facts(0, "2026-12-01T10:05:00Z"));
        assert!(run(&mut pods, &mut relist, update).is_empty());
        let held = pods[&key].changed_at.0.unwrap().to_string();
        assert_eq!(held, "2026-12-01T10:00:00Z");
        // Deleted after the skipped update (the Delete names the newer one).
        let deleted = Event::Delete(facts(0, "2026-12-01T10:05:00Z"));
        assert_eq!(run(&mut pods, &mut relist, deleted), just_it);
        assert!(pods.is_empty());
        // Created again, same name, same facts: taken up.
        let again = Event::Apply(facts(0, "2026-12-01T10:06:00Z"));
        assert_eq!(run(&mut pods, &mut relist, again), just_it);
        for (listed, want) in [
            (Some(facts(0, "2026-12-01T11:00:00Z")), vec![]),
            (Some(facts(1, "2026-12-01T11:00:00Z")), vec![key.clone()]),
            (None, vec![key.clone()]),
        ] {
            let mut touched = run(&mut pods, &mut relist, Event::Init);
            if let Some(f) = listed {
                touched.extend(run(&mut pods, &mut relist, Event::InitApply(f)));
            }
            let held = pods
                .get_key_value(&key)
                .map(|(k, p)| (k.1.as_ptr(), p.labels.clone(), p.changed_at.0));
            touched.extend(run(&mut pods, &mut relist, Event::InitDone));
            assert_eq!(touched, want);
            // Listed as held: the held version stays, and with it the
            // labels its endpoints share, and its key: the list's copies
            // are all dropped, so whole pages of them can be returned.
            if let (Some((name, labels, at)), true) = (held, want.is_empty()) {
                let (k, p) = pods.get_key_value(&key).expect("held");
                assert_eq!(k.1.as_ptr(), name);
                assert!(Arc::ptr_eq(&p.labels, &labels));
                assert_eq!(p.changed_at.0, at);
            }
        }
        assert!(pods.is_empty());
        let svc = service("a", "web".into());
        let mut services = HashMap::from([(key_of(&svc), svc.clone())]);
        let mut touched = Vec::new();
        apply(&mut services, &mut None, Event::Apply(svc), &mut touched);
        assert_eq!(touched.len(), 1);
    }

    /// A mass deletion's sets freed over several sweeps (status reports
    /// come in between) ask once for the memory to be returned, as a
    /// large full list does. (From the hostile review.)
    #[test]
    fn sets_freed_over_several_sweeps_ask_for_the_memory_back() {
        let template = pod_facts(pod("a", "db-0".into(), 0));
        let with = |i: usize| {
            let mut facts = template.clone();
            facts.labels = Arc::new([("pod".to_string(), format!("db-{i}"))].into());
            facts.name = format!("db-{i}");
            facts
        };
        let (mut world, mut relist) = (World::default(), None);
        let n = 30_000;
        for i in 0..n {
            world.on_pods(&mut relist, Event::Apply(with(i)));
        }
        let (mut asks, mut sweeps_freeing) = (0, 0);
        let mut step = |world: &mut World, relist: &mut Option<_>, e| {
            let before = world.label_sets.len();
            world.on_pods(relist, e);
            sweeps_freeing += usize::from(world.label_sets.len() < before);
            asks += usize::from(world.label_sets.freed_at_least(LARGE_RELIST));
        };
        let live = with(n - 1);
        for i in 0..n / 2 {
            step(&mut world, &mut relist, Event::Delete(with(i)));
            step(&mut world, &mut relist, Event::Apply(live.clone()));
        }
        for _ in 0..n {
            step(&mut world, &mut relist, Event::Apply(live.clone()));
        }
        assert_eq!(world.label_sets.len(), n / 2, "every gone pod's set freed");
        assert!(sweeps_freeing > 1, "{sweeps_freeing} sweeps freed them");
        assert_eq!(asks, 1);
    }

    /// The label sets of pods gone are not held on until as many new sets
    /// come: the Pod events after half as many events as sets held sweep
    /// them, whether the pods were deleted (a StatefulSet's, each pod a
    /// set of its own), replaced by a full list (a batch's pods, changed
    /// while the watch was down: no fewer pods, all sets new), or still
    /// carried by a subscriber's snapshot at the first sweep. (From the
    /// hostile reviews.)
    #[test]
    fn the_label_sets_of_gone_pods_are_not_held_on() {
        let template = pod_facts(pod("a", "db-0".into(), 0));
        let with_labels = |name: String, label: &str| {
            let mut facts = template.clone();
            facts.labels = Arc::new([(label.to_string(), name.clone())].into());
            facts.name = name;
            facts
        };
        let pod_name = "statefulset.kubernetes.io/pod-name";
        let (mut world, mut relist) = (World::default(), None);
        let n = 20_000;
        for i in 0..n {
            world.on_pods(
                &mut relist,
                Event::Apply(with_labels(format!("db-{i}"), pod_name)),
            );
        }
        assert_eq!(world.label_sets.len(), n);
        // A status report of a live pod, as a cluster sends all the time.
        let report = |world: &mut World, relist: &mut Option<_>| {
            let live = world.pods.values().next().expect("a pod").clone();
            world.on_pods(relist, Event::Apply(live));
        };
        let held_alone = |world: &World| {
            let live: std::collections::HashSet<_> = world
                .pods
                .values()
                .map(|p| Arc::as_ptr(&p.labels))
                .collect();
            world.label_sets.len() - live.len()
        };

        // Deleted, one event each; a subscriber's snapshot still holds
        // their labels at the first sweep, and lets go after it.
        let snapshot: Vec<_> = world.pods.values().map(|p| p.labels.clone()).collect();
        for i in 0..n / 2 {
            world.on_pods(
                &mut relist,
                Event::Delete(with_labels(format!("db-{i}"), pod_name)),
            );
        }
        report(&mut world, &mut relist);
        assert_eq!(held_alone(&world), n / 2, "still held: none swept");
        drop(snapshot);
        for _ in 0..n / 2 {
            report(&mut world, &mut relist);
        }
        assert_eq!(world.pods.len(), n / 2);
        assert!(
            held_alone(&world) == 0 && world.label_sets.take_freed() == n / 2,
            "{} sets held for {} pods",
            world.label_sets.len(),
            world.pods.len()
        );

        // Every pod replaced by a full list: the count stays, every set is new.
        world.on_pods(&mut relist, Event::Init);
        for i in 0..n / 2 {
            let listed = with_labels(format!("job-{i}"), "batch.kubernetes.io/job-name");
            world.on_pods(&mut relist, Event::InitApply(listed));
        }
        world.on_pods(&mut relist, Event::InitDone);
        assert_eq!(world.pods.len(), n / 2);
        report(&mut world, &mut relist);
        assert_eq!(held_alone(&world), 0, "the replaced pods' sets swept");
        assert_eq!(world.label_sets.take_freed(), n / 2);
        assert!(world.label_sets.len() <= n / 2 + 1);

        // Sets still carried stay shared across a sweep.
        let first = world.pods.values().next().unwrap().clone();
        let mut again = first.clone();
        again.name = "job-again".into();
        again.labels = Arc::new((*first.labels).clone());
        world.on_pods(&mut relist, Event::Apply(again.clone()));
        let key = (again.namespace.clone(), again.name.clone());
        assert!(Arc::ptr_eq(&first.labels, &world.pods[&key].labels));
    }

    /// A full list far shorter than what was held leaves a table its size,
    /// not the held one's. (From the hostile review.)
    #[test]
    fn a_short_full_list_leaves_a_table_its_size() {
        let template = pod_facts(pod("a", "web-0".into(), 0));
        let named = |i: usize| {
            let mut facts = template.clone();
            facts.name = format!("web-{i}");
            facts
        };
        let (mut pods, mut relist, mut touched) = (HashMap::new(), None, Vec::new());
        for i in 0..10_000 {
            apply(&mut pods, &mut relist, Event::Apply(named(i)), &mut touched);
        }
        apply(&mut pods, &mut relist, Event::Init, &mut touched);
        for i in 0..100 {
            apply(
                &mut pods,
                &mut relist,
                Event::InitApply(named(i)),
                &mut touched,
            );
        }
        apply(&mut pods, &mut relist, Event::InitDone, &mut touched);
        assert_eq!(pods.len(), 100);
        assert!(pods.capacity() <= 4 * 100, "{} slots", pods.capacity());
    }

    /// Equal label sets are held once, whichever pods carry them (a
    /// Deployment's replicas), and a set nothing holds any more is not
    /// held past the next sweep.
    #[test]
    fn equal_label_sets_are_held_once() {
        let mut sets = LabelSets::default();
        let shared = |sets: &mut LabelSets, name: &str, generation: usize| {
            let mut e = Event::Apply(pod_facts(pod("a", name.into(), generation)));
            sets.share_in(&mut e);
            let Event::Apply(p) = e else { unreachable!() };
            p.labels
        };
        let one = shared(&mut sets, "web-1", 1);
        assert!(Arc::ptr_eq(&one, &shared(&mut sets, "web-2", 1)));
        let other = shared(&mut sets, "web-3", 2);
        assert!(!Arc::ptr_eq(&one, &other));
        assert_eq!(sets.len(), 2);
        let mut listed = Event::InitApply(pod_facts(pod("a", "web-4".into(), 1)));
        sets.share_in(&mut listed);
        let Event::InitApply(listed) = listed else {
            unreachable!()
        };
        assert!(Arc::ptr_eq(&one, &listed.labels));
        let mut bare = pod("a", "web-5".into(), 0);
        bare.metadata.labels = Some(BTreeMap::new());
        let mut bare = Event::Apply(pod_facts(bare));
        sets.share_in(&mut bare);
        let Event::Apply(bare) = bare else {
            unreachable!()
        };
        assert!(Arc::ptr_eq(
            &bare.labels,
            &tether_core::registry::no_labels()
        ));
        assert_eq!(sets.len(), 2);
        // A rollout's churn: each new set dropped at once. The sets held
        // stay bounded, and the ones still carried stay shared.
        drop(other);
        for generation in 10..5_000 {
            shared(&mut sets, "web-churn", generation);
            assert!(sets.len() <= 1_024, "{} sets held", sets.len());
        }
        assert!(Arc::ptr_eq(&one, &shared(&mut sets, "web-6", 1)));
        let again = shared(&mut sets, "web-7", 2);
        assert_eq!(
            Arc::strong_count(&again),
            2,
            "the set of generation 2 was swept"
        );
    }

    /// A pod's labels are held once: by its facts, its endpoints and the
    /// index's share of its workload, also after a change to its other
    /// facts that keeps them, by an update or a full list. (From a hostile
    /// review: the new facts' equal labels were a second copy, kept by the
    /// endpoints while the index kept the first.)
    #[test]
    fn a_pod_s_labels_stay_shared_when_other_facts_change() {
        let mut world = World::default();
        let svc = service("a", "web".into());
        world.services.insert(key_of(&svc), ServiceFacts::of(svc));
        let p = pod("a", "web-1".into(), 0);
        let f = pod_facts(p.clone());
        world.pods.insert(key_of(&f), f);
        let target = Some(("Pod", None, "web-1".to_string()));
        let s = slice(
            "a",
            "web-x".into(),
            Some("web".into()),
            vec![endpoint(1, true, target)],
        );
        on_slices(&mut world, &mut None, Event::Apply(s));
        let index = Index::new(ControlMetrics::default());
        let key = ServiceKey::new("web", "a");
        index.set_service(&key, world.state(&key, "cluster.local"));
        let pk = ("a".to_string(), "web-1".to_string());
        // The pod's facts, its one endpoint (held by the registry's part,
        // shared with the index's state) and the index's share.
        assert_eq!(Arc::strong_count(&world.pods[&pk].labels), 3);
        let mut relist = None;
        for (account, listed) in [("other", false), ("again", true)] {
            let mut changed = p.clone();
            changed.spec.as_mut().unwrap().service_account_name = Some(account.into());
            let changed = pod_facts(changed);
            let mut touched = Vec::new();
            if listed {
                apply(&mut world.pods, &mut relist, Event::Init, &mut touched);
                let e = Event::InitApply(changed);
                apply(&mut world.pods, &mut relist, e, &mut touched);
                apply(&mut world.pods, &mut relist, Event::InitDone, &mut touched);
            } else {
                apply(
                    &mut world.pods,
                    &mut relist,
                    Event::Apply(changed),
                    &mut touched,
                );
            }
            assert_eq!(touched, std::slice::from_ref(&pk));
            world.pods_changed(&touched);
            index.set_service(&key, world.state(&key, "cluster.local"));
            assert_eq!(
                Arc::strong_count(&world.pods[&pk].labels),
                3,
                "{account}: one copy of the labels"
            );
        }
    }

    /// The strings an endpoint repeats are held once: its name by its
    /// listings (one per port), a zone by the slice's endpoints in it, an
    /// identity by the pods of one account; the index's snapshots hold the
    /// same copies.
    #[test]
    fn an_endpoint_s_strings_are_held_once() {
        let pods: Vec<_> = (1..=4).map(|n| (format!("web-{n}"), n)).collect();
        let slice = slice_facts(slice_as_sent("a", "web", "web-x7k2p", &pods));
        let mut world = World::default();
        let svc = service_as_sent("a", "web");
        world.services.insert(key_of(&svc), ServiceFacts::of(svc));
        for (name, _) in &pods {
            let pod = pod_facts(pod_as_sent("a", name));
            world.pods.insert(key_of(&pod), pod);
        }
        world.slices.insert(key_of(&slice), slice.clone());
        world.slices_changed(vec![key_of(&slice)]);
        let key = ServiceKey::new("web", "a");
        let state = world.state(&key, "cluster.local").expect("a service");
        let eps: Vec<_> = state.endpoints.iter().collect();
        assert_eq!(eps.len(), 8, "four pods, two ports");
        let same = |a: &Option<Arc<str>>, b: &Option<Arc<str>>| match (a, b) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        for (first, second) in eps[..4].iter().zip(&eps[4..]) {
            assert_eq!(first.name, second.name);
            assert!(
                same(&first.name, &second.name),
                "{:?}: one name",
                first.name
            );
            assert!(same(&first.identity, &second.identity));
            assert!(same(&first.zone, &second.zone));
        }
        // web-1 and web-4 are both in zone b; all four are of one account.
        assert_eq!(eps[0].zone.as_deref(), Some("eu-west-1b"));
        assert!(same(&eps[0].zone, &eps[3].zone), "one copy of a zone");
        assert!(!same(&eps[0].zone, &eps[1].zone));
        assert!(eps.iter().all(|e| same(&e.identity, &eps[0].identity)));
        assert_eq!(
            eps[0].identity.as_deref(),
            Some("web.a.serviceaccount.identity.cluster.local")
        );

        let index = Index::new(ControlMetrics::default());
        index.set_service(&key, Some(state.clone()));
        let slot = crate::index::SlotKey::Service(key);
        let watch = index.subscribe(&slot, 80);
        let published = watch.borrow().clone();
        let (_, meta) = published
            .snap
            .endpoints
            .iter()
            .find(|(addr, _)| addr.ip() == eps[0].address.ip())
            .expect("web-1 published");
        assert!(same(&meta.name, &eps[0].name), "the snapshot shares it");
        assert!(same(&meta.identity, &eps[0].identity));
    }

    /// An EndpointSlice's facts give the endpoints the slice as sent says
    /// (address per port, readiness, zone, name, the pod named and its
    /// identity) and the time of its last change; an update of what is
    /// not read (`serving`, `terminating`, the node, the resource version)
    /// touches nothing, and one of what is read touches the slice.
    #[test]
    fn a_slice_keeps_what_the_registry_reads() {
        let pods = [("web-0".to_string(), 1), ("web-1".to_string(), 2)];
        let sent = slice_as_sent("a", "web", "web-x7k2p", &pods);
        let facts = slice_facts(sent.clone());
        assert_eq!(key_of(&facts), key_of(&sent));
        assert_eq!(facts.service, Some(ServiceKey::new("web", "a")));
        assert_eq!(
            facts.changed_at.0.map(|t| t.to_string()),
            Some("2026-12-01T10:00:07Z".into())
        );
        let mut world = World::default();
        let svc = service_as_sent("a", "web");
        world.services.insert(key_of(&svc), ServiceFacts::of(svc));
        let pod = pod_facts(pod_as_sent("a", "web-1"));
        world.pods.insert(key_of(&pod), pod.clone());
        world.slices.insert(key_of(&facts), facts.clone());
        world.slices_changed(vec![key_of(&facts)]);
        assert_eq!(world.services_of_pod("a", "web-1").len(), 1);
        let state = world
            .state(&ServiceKey::new("web", "a"), "cluster.local")
            .expect("a service");
        let listed: Vec<_> = state
            .endpoints
            .iter()
            .map(|e| {
                (
                    e.address.to_string(),
                    e.port,
                    e.ready,
                    e.zone.clone(),
                    e.name.clone(),
                )
            })
            .collect();
        let zone = |z: &str| Some(Arc::<str>::from(format!("eu-west-1{z}")));
        let name = |n: &str| Some(Arc::<str>::from(n));
        assert_eq!(
            listed,
            [
                (
                    "10.244.0.1:8080".into(),
                    Some(80),
                    true,
                    zone("b"),
                    name("web-0")
                ),
                (
                    "10.244.0.2:8080".into(),
                    Some(80),
                    true,
                    zone("c"),
                    name("web-1")
                ),
                (
                    "10.244.0.1:9000".into(),
                    Some(9000),
                    true,
                    zone("b"),
                    name("web-0")
                ),
                (
                    "10.244.0.2:9000".into(),
                    Some(9000),
                    true,
                    zone("c"),
                    name("web-1")
                ),
            ]
        );
        let web_1 = &state.endpoints.iter().nth(1).unwrap();
        assert!(web_1.meshed);
        assert_eq!(
            web_1.identity.as_deref(),
            Some("web.a.serviceaccount.identity.cluster.local")
        );
        assert_eq!(web_1.labels, pod.labels);
        let web_0 = &state.endpoints.iter().next().unwrap();
        assert!(!web_0.meshed && web_0.identity.is_none(), "no such pod");

        let touches = |changed: EndpointSlice| {
            let mut slices = HashMap::from([(key_of(&facts), facts.clone())]);
            let mut touched = Vec::new();
            apply(
                &mut slices,
                &mut None,
                Event::Apply(slice_facts(changed)),
                &mut touched,
            );
            !touched.is_empty()
        };
        let changed = |change: &dyn Fn(&mut Endpoint)| {
            let mut s = sent.clone();
            change(&mut s.endpoints.as_mut().unwrap()[1]);
            s.metadata.resource_version = Some("987654401".into());
            s
        };
        let terminating = changed(&|e| {
            let c = e.conditions.as_mut().unwrap();
            (c.serving, c.terminating) = (Some(false), Some(true));
            e.node_name = Some("node-3".into());
        });
        assert!(!touches(terminating), "nothing read changed");
        assert!(touches(changed(&|e| {
            e.conditions.as_mut().unwrap().ready = Some(false)
        })));
        assert!(touches(changed(
            &|e| e.addresses = vec!["10.244.0.9".into()]
        )));
        assert!(touches(changed(&|e| e.zone = None)));
        assert!(touches(changed(&|e| e.target_ref = None)));
        let mut renumbered = sent.clone();
        renumbered.ports.as_mut().unwrap()[1].port = Some(9001);
        assert!(touches(renumbered));

        // What is read of odd endpoints and ports: the zone from a hint
        // when there is none; a reference to a Node names no pod; one to a
        // Pod without a name, or without a namespace, is to none, or to
        // the slice's; an address that is not one and a port without a
        // number or beyond 65535 are skipped; `ready` unset is ready.
        let mut odd = sent.clone();
        let eps = odd.endpoints.as_mut().unwrap();
        eps[0].zone = None;
        eps[0].hints = Some(k8s_openapi::api::discovery::v1::EndpointHints {
            for_zones: Some(vec![k8s_openapi::api::discovery::v1::ForZone {
                name: "eu-west-1c".into(),
            }]),
            ..Default::default()
        });
        eps[0].target_ref.as_mut().unwrap().kind = Some("Node".into());
        eps[0].addresses.insert(0, "not-an-ip".into());
        eps[0].conditions = None;
        let mut nameless = eps[1].clone();
        nameless.target_ref.as_mut().unwrap().name = None;
        let mut elsewhere = eps[1].clone();
        elsewhere.target_ref.as_mut().unwrap().namespace = Some("b".into());
        let mut own = eps[1].clone();
        own.target_ref.as_mut().unwrap().namespace = None;
        eps.extend([nameless, elsewhere, own]);
        let ports = odd.ports.as_mut().unwrap();
        ports.push(EndpointPort {
            name: Some("unnumbered".into()),
            ..EndpointPort::default()
        });
        ports.push(EndpointPort {
            name: Some("huge".into()),
            port: Some(70_000),
            ..EndpointPort::default()
        });
        let odd = slice_facts(odd);
        let ports: Vec<_> = odd
            .ports
            .iter()
            .map(|p| (p.name.as_deref(), p.port))
            .collect();
        assert_eq!(ports, [(Some("http"), 8080), (Some("admin"), 9000)]);
        let first = &odd.endpoints[0];
        let ip: std::net::IpAddr = "10.244.0.1".parse().unwrap();
        assert_eq!(*first.addresses, [ip]);
        assert!(first.ready);
        assert_eq!(first.zone.as_deref(), Some("eu-west-1c"));
        assert_eq!(first.name.as_deref(), Some("web-0"));
        let pods_named: Vec<_> = odd.endpoints.iter().map(|e| odd.pod_of(e)).collect();
        let in_ns = |ns: &str| Some((ns.to_string(), "web-1".to_string()));
        assert_eq!(pods_named, [None, in_ns("a"), None, in_ns("b"), in_ns("a")]);
    }

    /// A Service's facts give what the Service as sent says (its TCP
    /// ports, cluster IP and the mesh's annotations); a status update, or
    /// an annotation the mesh does not read, touches nothing.
    #[test]
    fn a_service_keeps_what_the_registry_reads() {
        let mut sent = service_as_sent("a", "web");
        let spec = sent.spec.as_mut().unwrap();
        spec.ports.as_mut().unwrap().push(ServicePort {
            name: Some("dns".into()),
            port: 53,
            protocol: Some("UDP".into()),
            ..ServicePort::default()
        });
        let facts = ServiceFacts::of(sent.clone());
        assert_eq!(key_of(&facts), key_of(&sent));
        assert_eq!(
            facts.ports,
            [
                (Some("http".to_string()), 80),
                (Some("admin".to_string()), 9000)
            ]
        );
        assert_eq!(facts.cluster_ip, Some("10.96.14.27".parse().unwrap()));
        assert_eq!(
            facts.annotations,
            BTreeMap::from([(RETRY_BUDGET.to_string(), "0.2/10".to_string())])
        );
        assert_eq!(
            facts.changed_at.0.map(|t| t.to_string()),
            Some("2026-11-02T08:00:00Z".into())
        );
        let mut headless = sent.clone();
        headless.spec.as_mut().unwrap().cluster_ip = Some("None".into());
        assert_eq!(ServiceFacts::of(headless).cluster_ip, None);

        let touches = |changed: Service| {
            let mut services = HashMap::from([(key_of(&facts), facts.clone())]);
            let mut touched = Vec::new();
            let e = Event::Apply(ServiceFacts::of(changed));
            apply(&mut services, &mut None, e, &mut touched);
            !touched.is_empty()
        };
        let mut status = sent.clone();
        status.metadata.resource_version = Some("987654322".into());
        let annotations = status.metadata.annotations.as_mut().unwrap();
        annotations.insert("deployment.kubernetes.io/revision".into(), "4".into());
        status.status = Some(Default::default());
        assert!(!touches(status));
        let mut opaque = sent.clone();
        let annotations = opaque.metadata.annotations.as_mut().unwrap();
        annotations.insert(OPAQUE_PORTS.into(), "9000".into());
        assert!(touches(opaque));
        let mut renumbered = sent.clone();
        renumbered.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 81;
        assert!(touches(renumbered));
    }

    /// A Pod's facts give the endpoints the Pod as sent says (identity,
    /// meshed, labels, name) and the time of its last change; a status
    /// update changes nothing the registry keeps, and touches nothing.
    #[test]
    fn a_pod_keeps_what_the_registry_reads() {
        // The endpoints of a slice of web in `a` naming `pod` (its
        // reference's namespace `pod_ns`, or none: the slice's).
        let endpoints_naming = |pod: PodFacts, pod_ns: Option<&str>| {
            let mut world = World::default();
            let svc = service("a", "web".into());
            world.services.insert(key_of(&svc), ServiceFacts::of(svc));
            world.pods.insert(key_of(&pod), pod);
            let target = Some(("Pod", pod_ns, "web-1".to_string()));
            let s = slice(
                "a",
                "web-x".into(),
                Some("web".into()),
                vec![endpoint(1, true, target)],
            );
            world.slices.insert(key_of(&s), slice_facts(s.clone()));
            world.slices_changed(vec![key_of(&s)]);
            let key = ServiceKey::new("web", "a");
            world
                .state(&key, "cluster.local")
                .expect("a service")
                .endpoints
        };
        let sent = pod_as_sent("a", "web-1");
        let facts = pod_facts(sent.clone());
        assert_eq!(key_of(&facts), key_of(&sent));
        assert_eq!(facts.changed_at.0, sent.changed_at());
        assert_eq!(
            facts.changed_at.0.map(|t| t.to_string()),
            Some("2026-12-01T10:00:07Z".into())
        );
        let from_facts = endpoints_naming(facts.clone(), None);
        let ep = &from_facts[0];
        assert!(ep.meshed, "{ep:?}");
        assert_eq!(
            ep.identity.as_deref(),
            Some("web.a.serviceaccount.identity.cluster.local")
        );
        assert_eq!(ep.name.as_deref(), Some("web-1"));
        assert_eq!(*ep.labels, sent.metadata.labels.clone().unwrap());

        // The kubelet reports the pod unready: a new time and status, the
        // same facts.
        let mut reported = sent.clone();
        reported.status.as_mut().unwrap().phase = Some("Failed".into());
        let kubelet = &mut reported.metadata.managed_fields.as_mut().unwrap()[1];
        kubelet.time = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            "2026-12-01T10:05:00Z".parse().unwrap(),
        ));
        reported.metadata.resource_version = Some("123456790".into());
        let later = pod_facts(reported);
        assert_eq!(later, facts);
        assert_ne!(later.changed_at.0, facts.changed_at.0);
        let mut pods = HashMap::from([(key_of(&facts), facts.clone())]);
        let mut touched = Vec::new();
        apply(&mut pods, &mut None, Event::Apply(later), &mut touched);
        assert!(touched.is_empty(), "{touched:?}");
        // A label, the service account or the proxy changing is a change.
        let mut relabelled = sent.clone();
        let labels = relabelled.metadata.labels.as_mut().unwrap();
        labels.insert("version".into(), "v3".into());
        let mut other_account = sent.clone();
        other_account.spec.as_mut().unwrap().service_account_name = Some("api".into());
        let mut plain = sent.clone();
        let spec = plain.spec.as_mut().unwrap();
        spec.containers.retain(|c| c.name != PROXY_CONTAINER);
        for pod in [relabelled, other_account, plain.clone()] {
            let mut touched = Vec::new();
            apply(
                &mut pods,
                &mut None,
                Event::Apply(pod_facts(pod)),
                &mut touched,
            );
            assert_eq!(touched, [key_of(&facts)]);
        }
        // Without the proxy's container: not meshed, no identity.
        let ep = &endpoints_naming(pod_facts(plain), None)[0];
        assert!(!ep.meshed && ep.identity.is_none(), "{ep:?}");

        // A slice naming a pod of another namespace: the identity is that
        // pod's account in its own namespace.
        let elsewhere = pod_facts(pod_as_sent("b", "web-1"));
        let ep = &endpoints_naming(elsewhere, Some("b"))[0];
        assert_eq!(
            ep.identity.as_deref(),
            Some("web.b.serviceaccount.identity.cluster.local")
        );
    }

    /// A Pod is read off the wire as what its facts need, whatever else it
    /// carries: the Pod as sent, one without a spec, one with the proxy as
    /// a native sidecar, labels null; the watch asks for Pods; what is not
    /// a Pod is refused with the field that is wrong.
    #[test]
    fn a_pod_is_read_off_the_wire_as_its_facts_need() {
        let sent = pod_as_sent("a", "web-1");
        let read: WatchedPod =
            serde_json::from_value(serde_json::to_value(&sent).unwrap()).unwrap();
        let meta = kube::Resource::meta(&read);
        assert_eq!(meta.name.as_deref(), Some("web-1"));
        assert_eq!(meta.namespace.as_deref(), Some("a"));
        assert_eq!(meta.resource_version.as_deref(), Some("123456789"));
        assert_eq!(meta.labels, sent.metadata.labels);
        assert_eq!(read.changed_at(), sent.changed_at());
        let facts = PodFacts::of(read);
        assert!(facts.meshed);
        assert_eq!(facts.service_account.as_deref(), Some("web"));

        let read = |json: serde_json::Value| serde_json::from_value::<WatchedPod>(json);
        let bare = PodFacts::of(read(serde_json::json!({"metadata": {"name": "x"}})).unwrap());
        assert!(!bare.meshed && bare.service_account.is_none() && bare.labels.is_empty());
        let sidecar = read(serde_json::json!({
            "metadata": {"name": "x", "namespace": "a", "labels": null, "extra": {"any": [1, 2]}},
            "spec": {"initContainers": [{"name": PROXY_CONTAINER, "restartPolicy": "Always"}]},
            "status": {"phase": "Running"},
        }));
        let sidecar = PodFacts::of(sidecar.unwrap());
        assert!(sidecar.meshed && sidecar.labels.is_empty());
        assert_eq!(
            <WatchedPod as kube::Resource>::url_path(&(), Some("a")),
            <Pod as kube::Resource>::url_path(&(), Some("a"))
        );
        let wrong = read(serde_json::json!({"metadata": {"name": 7}})).unwrap_err();
        assert!(wrong.to_string().contains("invalid type"), "{wrong}");
    }

    /// What k8s-openapi's `Pod` read as empty (a null, a field left out),
    /// a Pod read as watched reads as empty too, alone or in a list (one
    /// refused would fail the whole list). (From a hostile review.)
    #[test]
    fn what_a_pod_read_as_empty_is_read_as_empty() {
        use serde_json::json;
        let meta = json!({"name": "p", "namespace": "a", "resourceVersion": "1"});
        for (what, pod) in [
            (
                "metadata null",
                json!({"metadata": null, "spec": {"containers": [{"name": "app"}]}}),
            ),
            (
                "containers null",
                json!({"metadata": meta, "spec": {"containers": null}}),
            ),
            ("spec null", json!({"metadata": meta, "spec": null})),
            (
                "a container without a name",
                json!({"metadata": meta, "spec": {"containers": [{"image": "i"}]}}),
            ),
            (
                "a container's name null",
                json!({"metadata": meta, "spec": {"containers": [{"name": null}]}}),
            ),
            (
                "labels and managed fields null",
                json!({"metadata": {"name": "p", "labels": null, "managedFields": [{"time": null}]}}),
            ),
        ] {
            let whole: Pod = serde_json::from_value(pod.clone()).expect(what);
            let watched: WatchedPod =
                serde_json::from_value(pod.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(PodFacts::of(watched), pod_facts(whole), "{what}");
            let list =
                json!({"metadata": {"resourceVersion": "9"}, "items": [{"metadata": meta}, pod]});
            let list: kube::core::ObjectList<WatchedPod> =
                serde_json::from_value(list).unwrap_or_else(|e| panic!("{what} in a list: {e}"));
            assert_eq!(list.items.len(), 2);
        }
    }

    /// What the watcher reads of each event of watched Pods: the resource
    /// version of an added, modified or deleted Pod (its type before or
    /// after the object), a bookmark, a `410 Gone`, and a list's metadata.
    /// (From a hostile review.)
    #[test]
    fn the_watcher_reads_what_it_needs_of_watched_pods() {
        use kube::core::{ObjectList, WatchEvent};
        use serde_json::json;
        let pod = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "a", "resourceVersion": "7", "uid": "u", "deletionTimestamp": "2026-12-01T10:06:00Z"},
            "spec": {"containers": [{"name": PROXY_CONTAINER}]}});
        for ty in ["ADDED", "MODIFIED", "DELETED"] {
            for line in [
                format!(r#"{{"type":"{ty}","object":{pod}}}"#),
                format!(r#"{{"object":{pod},"type":"{ty}"}}"#),
            ] {
                let e: WatchEvent<WatchedPod> = serde_json::from_str(&line).unwrap();
                let (WatchEvent::Added(p) | WatchEvent::Modified(p) | WatchEvent::Deleted(p)) = e
                else {
                    panic!("{line}")
                };
                assert_eq!(p.resource_version().as_deref(), Some("7"));
                assert!(PodFacts::of(p).meshed);
            }
        }
        let bookmark = r#"{"type":"BOOKMARK","object":{"kind":"Pod","apiVersion":"v1","metadata":{"resourceVersion":"12","annotations":{"k8s.io/initial-events-end":"true"}}}}"#;
        let e = serde_json::from_str::<WatchEvent<WatchedPod>>(bookmark).unwrap();
        let WatchEvent::Bookmark(b) = e else {
            panic!("{e:?}")
        };
        assert_eq!(b.metadata.resource_version, "12");
        let gone = r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","status":"Failure","message":"too old","reason":"Expired","code":410}}"#;
        let e = serde_json::from_str::<WatchEvent<WatchedPod>>(gone).unwrap();
        let WatchEvent::Error(s) = e else {
            panic!("{e:?}")
        };
        assert_eq!(s.code, 410);
        let list = json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "9", "continue": "c"}, "items": [pod]});
        let l: ObjectList<WatchedPod> = serde_json::from_value(list).unwrap();
        assert_eq!(l.metadata.resource_version.as_deref(), Some("9"));
        assert_eq!(l.metadata.continue_.as_deref(), Some("c"));
        let empty = json!({"metadata": {"resourceVersion": "9"}, "items": null});
        let l: ObjectList<WatchedPod> = serde_json::from_value(empty).unwrap();
        assert!(l.items.is_empty());
    }

    /// A slice is read off the wire as its facts need: the watch asks for
    /// EndpointSlices, and what k8s-openapi's `EndpointSlice` read as
    /// empty (a null, a field left out) is read as empty, alone or in a
    /// list (one refused would fail the whole list).
    #[test]
    fn a_slice_is_read_off_the_wire_as_its_facts_need() {
        use serde_json::json;
        assert_eq!(
            <WatchedSlice as kube::Resource>::url_path(&(), Some("a")),
            <EndpointSlice as kube::Resource>::url_path(&(), Some("a"))
        );
        let meta = json!({"name": "s", "namespace": "a", "resourceVersion": "1",
            "labels": {SERVICE_NAME_LABEL: "web"}});
        let endpoint = |ep: serde_json::Value| {
            json!({"metadata": meta, "addressType": "IPv4", "endpoints": [ep],
                "ports": [{"name": "http", "port": 8080}]})
        };
        let cases = [
            (
                "metadata null",
                json!({"metadata": null, "addressType": "IPv4", "endpoints": []}),
                0,
            ),
            (
                "endpoints and ports null",
                json!({"metadata": meta, "addressType": "IPv4", "endpoints": null, "ports": null}),
                0,
            ),
            ("addresses null", endpoint(json!({"addresses": null})), 1),
            (
                "conditions, hints and reference null",
                endpoint(
                    json!({"addresses": ["10.0.0.1"], "conditions": null, "hints": null, "targetRef": null}),
                ),
                1,
            ),
            (
                "a zone hint's name null",
                endpoint(
                    json!({"addresses": ["10.0.0.1"], "hints": {"forZones": [{"name": null}]}}),
                ),
                1,
            ),
            (
                "unread fields of any shape",
                endpoint(
                    json!({"addresses": ["10.0.0.1"], "nodeName": 7, "conditions": {"serving": "yes"}, "extra": [null]}),
                ),
                1,
            ),
        ];
        for (what, slice, endpoints) in cases {
            let watched: WatchedSlice =
                serde_json::from_value(slice.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
            let facts = SliceFacts::of(watched);
            assert_eq!(facts.endpoints.len(), endpoints, "{what}");
            if what != "unread fields of any shape" {
                let whole: EndpointSlice = serde_json::from_value(slice.clone()).expect(what);
                assert_eq!(facts, slice_facts(whole), "{what}");
            }
            let list = json!({"metadata": {"resourceVersion": "9"}, "items": [slice, slice]});
            let list: kube::core::ObjectList<WatchedSlice> =
                serde_json::from_value(list).unwrap_or_else(|e| panic!("{what} in a list: {e}"));
            assert_eq!(list.items.len(), 2);
        }
        let hinted = serde_json::from_value::<WatchedSlice>(endpoint(
            json!({"addresses": ["10.0.0.1"], "hints": {"forZones": [{"name": "eu-west-1a"}]}}),
        ));
        let hinted = SliceFacts::of(hinted.unwrap());
        assert_eq!(hinted.endpoints[0].zone.as_deref(), Some("eu-west-1a"));
        assert_eq!(hinted.service, Some(ServiceKey::new("web", "a")));
        assert!(hinted.endpoints[0].ready);
        let wrong = serde_json::from_value::<WatchedSlice>(
            json!({"endpoints": [{"addresses": "10.0.0.1"}]}),
        );
        assert!(wrong.unwrap_err().to_string().contains("invalid type"));
    }

    /// What reading `json` off the wire costs `n` times: as the object
    /// `Whole` (k8s-openapi's), as `Watched` with its facts taken by
    /// `facts`, and skipped whole; printed for `what`.
    fn reading_cost<Whole, Watched, Facts>(
        what: &str,
        json: &[u8],
        n: u32,
        mut facts: impl FnMut(Watched) -> Facts,
    ) where
        Whole: serde::de::DeserializeOwned,
        Watched: serde::de::DeserializeOwned,
    {
        let started = Instant::now();
        for _ in 0..n {
            std::hint::black_box(serde_json::from_slice::<Whole>(json).unwrap());
        }
        let whole = started.elapsed() / n;
        let started = Instant::now();
        for _ in 0..n {
            let watched: Watched = serde_json::from_slice(json).unwrap();
            std::hint::black_box(facts(watched));
        }
        let watched = started.elapsed() / n;
        let started = Instant::now();
        for _ in 0..n {
            let skipped: serde::de::IgnoredAny = serde_json::from_slice(json).unwrap();
            std::hint::black_box(skipped);
        }
        eprintln!(
            "{what}, {} bytes of JSON: read whole {whole:?}, as watched (and its facts) \
             {watched:?}, skipped whole {:?}",
            json.len(),
            started.elapsed() / n
        );
    }

    /// What reading a slice of 100 endpoints off the wire costs, as
    /// k8s-openapi's `EndpointSlice` and as watched; a measurement, run by
    /// hand: `cargo test --release -p tether-control --lib -- --ignored
    /// --nocapture slice_reading_cost`.
    #[test]
    #[ignore]
    fn slice_reading_cost() {
        let pods: Vec<_> = (0..100).map(|e| (format!("web-{e}"), e)).collect();
        let json = serde_json::to_vec(&slice_as_sent("big", "web", "web-x", &pods)).unwrap();
        let what = "a slice of 100 endpoints";
        reading_cost::<EndpointSlice, WatchedSlice, _>(what, &json, 2_000, SliceFacts::of);
    }

    /// What reading a Pod off the wire costs, as k8s-openapi's `Pod` and
    /// as watched; a measurement, run by hand: `cargo test --release -p
    /// tether-control --lib -- --ignored --nocapture pod_reading_cost`.
    #[test]
    #[ignore]
    fn pod_reading_cost() {
        let json = serde_json::to_vec(&pod_as_sent("big", "web-1")).unwrap();
        let mut label_sets = LabelSets::default();
        // Its labels shared with the equal set held, as the run loop does.
        let facts = |pod| {
            let mut event = Event::Apply(PodFacts::of(pod));
            label_sets.share_in(&mut event);
            event
        };
        reading_cost::<Pod, WatchedPod, _>("a Pod", &json, 20_000, facts);
        reading_cost::<Pod, WatchedPod, _>(
            "a Pod (labels not shared)",
            &json,
            20_000,
            PodFacts::of,
        );
    }

    /// What 20,000 Pods cost held as sent, and as the registry keeps them:
    /// run each alone (a process of its own), by hand:
    /// `cargo test --release -p tether-control --lib -- --ignored
    /// --nocapture --exact registry::kubernetes::tests::pods_as_sent` (and
    /// `pods_as_kept`).
    fn pods_held<T>(slim: bool, keep: impl Fn(Pod) -> T) {
        let n = 20_000;
        let before = resident_kib();
        let mut pods = HashMap::new();
        for i in 0..n {
            let pod = pod_as_sent("big", &format!("web-{i}"));
            pods.insert(key_of(&pod), keep(pod));
        }
        let grown = resident_kib().saturating_sub(before);
        assert_eq!(pods.len(), n);
        eprintln!(
            "{n} Pods held {}: {} MiB more resident, {:.1} KiB a Pod",
            if slim { "as kept" } else { "as sent" },
            grown / 1024,
            grown as f64 / n as f64
        );
    }

    /// This process's resident memory (`VmRSS`), in KiB; 0 if unread.
    fn resident_kib() -> u64 {
        status_kib("VmRSS:")
    }

    /// This process's peak resident memory (`VmHWM`), in KiB.
    fn peak_resident_kib() -> u64 {
        status_kib("VmHWM:")
    }

    fn status_kib(field: &str) -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|st| {
                st.lines()
                    .find_map(|l| l.strip_prefix(field))
                    .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            })
            .unwrap_or(0)
    }

    #[test]
    #[ignore]
    fn pods_as_sent() {
        pods_held(false, |pod| pod);
    }

    #[test]
    #[ignore]
    fn pods_as_kept() {
        pods_held(true, pod_facts);
    }

    /// A Service as the API server sends one applied with `kubectl apply`:
    /// the applied configuration in an annotation, managed fields, status.
    fn service_as_sent(ns: &str, name: &str) -> Service {
        let applied = serde_json::json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns, "labels": {"app": name, "team": "payments"},
                "annotations": {"tether.io/retry-budget": "0.2/10"}},
            "spec": {"selector": {"app": name}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}, {"name": "admin", "port": 9000, "targetPort": 9000}]}});
        let fields = serde_json::json!({"f:metadata": {"f:annotations": {".": {}, "f:kubectl.kubernetes.io/last-applied-configuration": {}, "f:tether.io/retry-budget": {}}, "f:labels": {".": {}, "f:app": {}, "f:team": {}}},
            "f:spec": {"f:internalTrafficPolicy": {}, "f:ports": {".": {}, "k:{\"port\":80,\"protocol\":\"TCP\"}": {".": {}, "f:name": {}, "f:port": {}, "f:protocol": {}, "f:targetPort": {}}, "k:{\"port\":9000,\"protocol\":\"TCP\"}": {".": {}, "f:name": {}, "f:port": {}, "f:protocol": {}, "f:targetPort": {}}}, "f:selector": {}, "f:sessionAffinity": {}, "f:type": {}}});
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name, "namespace": ns, "uid": "9a8b7c6d-5e4f-3a2b-1c0d-e9f8a7b6c5d4", "resourceVersion": "987654321",
                "creationTimestamp": "2026-11-02T08:00:00Z",
                "labels": {"app": name, "team": "payments"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": applied.to_string(), "tether.io/retry-budget": "0.2/10"},
                "managedFields": [{"manager": "kubectl-client-side-apply", "operation": "Update", "apiVersion": "v1", "time": "2026-11-02T08:00:00Z", "fieldsType": "FieldsV1", "fieldsV1": fields}],
            },
            "spec": {
                "type": "ClusterIP", "clusterIP": "10.96.14.27", "clusterIPs": ["10.96.14.27"], "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
                "internalTrafficPolicy": "Cluster", "sessionAffinity": "None", "selector": {"app": name},
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}, {"name": "admin", "port": 9000, "protocol": "TCP", "targetPort": 9000}],
            },
            "status": {"loadBalancer": {}},
        }))
        .expect("a Service")
    }

    /// An EndpointSlice as the EndpointSlice controller writes one for
    /// `service`: an endpoint per pod (its address, conditions, node,
    /// zone and reference), managed fields.
    fn slice_as_sent(
        ns: &str,
        service: &str,
        name: &str,
        pods: &[(String, usize)],
    ) -> EndpointSlice {
        let endpoints: Vec<serde_json::Value> = pods
            .iter()
            .map(|(pod, n)| serde_json::json!({
                "addresses": [format!("10.{}.{}.{}", 244 + (n >> 16 & 7), n >> 8 & 255, n & 255)],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": format!("node-{}", n % 50), "zone": format!("eu-west-1{}", ["a", "b", "c"][n % 3]),
                "targetRef": {"kind": "Pod", "name": pod, "namespace": ns, "uid": format!("6f1c2d3e-4b5a-6978-8a9b-{n:012x}")},
            }))
            .collect();
        let fields = serde_json::json!({"f:addressType": {}, "f:endpoints": {}, "f:metadata": {"f:annotations": {".": {}, "f:endpoints.kubernetes.io/last-change-trigger-time": {}},
            "f:generateName": {}, "f:labels": {".": {}, "f:app": {}, "f:endpointslice.kubernetes.io/managed-by": {}, "f:kubernetes.io/service-name": {}},
            "f:ownerReferences": {".": {}, "k:{\"uid\":\"9a8b7c6d-5e4f-3a2b-1c0d-e9f8a7b6c5d4\"}": {}}}, "f:ports": {}});
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name, "generateName": format!("{service}-"), "namespace": ns, "uid": "1c2d3e4f-5a6b-7c8d-9e0f-a1b2c3d4e5f6",
                "resourceVersion": "987654400", "generation": 57, "creationTimestamp": "2026-11-02T08:00:01Z",
                "labels": {"app": service, "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io", "kubernetes.io/service-name": service},
                "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-12-01T10:00:07Z"},
                "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": service, "uid": "9a8b7c6d-5e4f-3a2b-1c0d-e9f8a7b6c5d4", "controller": true, "blockOwnerDeletion": true}],
                "managedFields": [{"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "discovery.k8s.io/v1", "time": "2026-12-01T10:00:07Z", "fieldsType": "FieldsV1", "fieldsV1": fields}],
            },
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "admin", "port": 9000, "protocol": "TCP"}],
        }))
        .expect("an EndpointSlice")
    }

    /// What a cluster costs the registry and the index in memory, by what
    /// holds it: 20,000 realistic Pods (as `pods_as_kept`), in 200
    /// Services of 100 endpoints (one EndpointSlice each, two ports), as
    /// the API server sends them. A measurement, run by hand (a process of
    /// its own): `cargo test --release -p tether-control --lib --
    /// --ignored --nocapture --exact
    /// registry::kubernetes::tests::a_cluster_s_memory`.
    #[test]
    #[ignore]
    fn a_cluster_s_memory() {
        let (services, per_service) = (200, 100);
        let pods = services * per_service;
        let mut world = World::default();
        let step = |what: &str, before: &mut u64| {
            let now = resident_kib();
            eprintln!(
                "{what}: {} MiB more resident, {:.2} KiB a pod",
                now.saturating_sub(*before) / 1024,
                now.saturating_sub(*before) as f64 / pods as f64
            );
            *before = now;
        };
        let start = resident_kib();
        let mut at = start;
        for s in 0..services {
            for e in 0..per_service {
                // Each service's pods are a Deployment's replicas: the
                // same labels, their own.
                let mut pod = pod_as_sent("big", &format!("web-{s}-{e}"));
                let labels = pod.metadata.labels.get_or_insert_default();
                labels.insert("app".into(), format!("web-{s}"));
                labels.insert("pod-template-hash".into(), format!("5d8f{s:05}"));
                let mut listed = Event::InitApply(pod_facts(pod));
                world.label_sets.share_in(&mut listed);
                let Event::InitApply(facts) = listed else {
                    unreachable!()
                };
                world.pods.insert(key_of(&facts), facts);
            }
        }
        step("the Pods", &mut at);
        let mut slices = Vec::new();
        for s in 0..services {
            let names: Vec<(String, usize)> = (0..per_service)
                .map(|e| (format!("web-{s}-{e}"), s * per_service + e))
                .collect();
            let sl = slice_as_sent(
                "big",
                &format!("svc-{s}"),
                &format!("svc-{s}-x7k2p"),
                &names,
            );
            slices.push(key_of(&sl));
            world.slices.insert(key_of(&sl), slice_facts(sl));
        }
        step("the EndpointSlices", &mut at);
        world.slices_changed(slices);
        step(
            "their indexes (each slice's pods, each pod's slices)",
            &mut at,
        );
        let keys: Vec<ServiceKey> = (0..services)
            .map(|s| {
                let svc = service_as_sent("big", &format!("svc-{s}"));
                world.services.insert(key_of(&svc), ServiceFacts::of(svc));
                ServiceKey::new(format!("svc-{s}"), "big".to_string())
            })
            .collect();
        step("the Services", &mut at);
        let states: Vec<_> = keys
            .iter()
            .map(|k| world.state(k, "cluster.local").expect("a service"))
            .collect();
        assert!(states.iter().all(|s| s.endpoints.len() == 2 * per_service));
        step("each service's endpoints, built", &mut at);
        let index = Index::new(ControlMetrics::default());
        for (k, state) in keys.iter().zip(states) {
            index.set_service(k, Some(state));
        }
        step("the index (workloads included)", &mut at);
        // Every service's two ports followed, as by the proxies calling it.
        let _watching: Vec<_> = keys
            .iter()
            .flat_map(|k| {
                let slot = crate::index::SlotKey::Service(k.clone());
                [80, 9000].map(|port| index.subscribe(&slot, port))
            })
            .collect();
        step(
            "a subscriber to each service's ports (their snapshots)",
            &mut at,
        );
        eprintln!(
            "{pods} pods in {services} services: {} MiB in all, {:.2} KiB a pod",
            at.saturating_sub(start) / 1024,
            at.saturating_sub(start) as f64 / pods as f64
        );
    }

    /// An HTTPRoute in `ns` attached to service `s`, sending to it.
    fn http_route(ns: &str, s: usize) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": format!("route-{s}"), "namespace": ns},
            "spec": {
                "parentRefs": [{"group": "", "kind": "Service", "name": format!("svc-{s}"), "port": 80}],
                "rules": [{"backendRefs": [{"group": "", "kind": "Service", "name": format!("svc-{s}"), "port": 80}]}],
            },
        }))
        .expect("an HTTPRoute")
    }

    /// A full list over many held objects asks for what it freed to be
    /// returned; the first list, a small one, or another event does not.
    #[test]
    fn a_large_relist_returns_what_it_freed() {
        let held = |n: usize| -> HashMap<(String, String), u8> {
            (0..n)
                .map(|i| (("big".into(), format!("pod-{i}")), 0))
                .collect()
        };
        let (large, done) = (held(LARGE_RELIST), Event::InitDone);
        assert!(ends_a_large_relist(
            &large,
            &Some(held(LARGE_RELIST)),
            &done
        ));
        // The held objects are freed though few come back (a namespace gone).
        assert!(ends_a_large_relist(&large, &Some(held(3)), &done));
        // The first list frees nothing held.
        assert!(!ends_a_large_relist(
            &HashMap::new(),
            &Some(held(LARGE_RELIST)),
            &done
        ));
        assert!(!ends_a_large_relist(
            &held(LARGE_RELIST - 1),
            &Some(large.clone()),
            &done
        ));
        // Not a list's end, or an end without a list.
        assert!(!ends_a_large_relist(
            &large,
            &Some(held(LARGE_RELIST)),
            &Event::Init
        ));
        assert!(!ends_a_large_relist(
            &large,
            &Some(held(1)),
            &Event::Apply(0)
        ));
        assert!(!ends_a_large_relist(&large, &None, &done));
    }

    /// What a large cluster costs the registry: a full list of its
    /// EndpointSlices, and single EndpointSlice and Pod changes. A
    /// measurement, run by hand (docs/benchmarks.md): `cargo test
    /// --release -p tether-control --lib -- --ignored --nocapture
    /// a_large_cluster`.
    #[test]
    #[ignore]
    fn a_large_cluster() {
        let (services, slices, per_slice) = (5_000, 2, 10);
        let pod_name = |s: usize, k: usize, e: usize| format!("svc-{s}-{k}-{e}");
        let big_slice = |s: usize, k: usize, ready: bool| {
            let endpoints = (0..per_slice)
                .map(|e| {
                    let target = ("Pod", Some("big"), pod_name(s, k, e));
                    endpoint((s * 64 + k) * per_slice + e, ready || e > 0, Some(target))
                })
                .collect();
            slice(
                "big",
                format!("svc-{s}-{k}"),
                Some(format!("svc-{s}")),
                endpoints,
            )
        };
        let mut world = World::default();
        for s in 0..services {
            let svc = service("big", format!("svc-{s}"));
            world.services.insert(key_of(&svc), ServiceFacts::of(svc));
            for k in 0..slices {
                for e in 0..per_slice {
                    let p = pod("big", pod_name(s, k, e), 0);
                    world.pods.insert(key_of(&p), pod_facts(p));
                }
            }
        }
        // One HTTPRoute per service, as a cluster that splits traffic with
        // the Gateway API has.
        let routes: Vec<DynamicObject> = (0..services).map(|s| http_route("big", s)).collect();
        world.http_routes = routes.iter().map(|o| (key_of(o), o.clone())).collect();
        let started = Instant::now();
        let metrics = ControlMetrics::default();
        let route_keys: Vec<_> = routes.iter().map(key_of).collect();
        let with_routes = world.update_routes(RouteKind::Http, &route_keys, &metrics);
        let routes_time = started.elapsed();
        assert_eq!(with_routes.len(), services);
        // Every slice listed, as a watch lists them at start-up and after a
        // 410 Gone: the services named, and the time it took.
        let full_list = |world: &mut World, relist: &mut Option<_>| {
            let started = Instant::now();
            on_slices(world, relist, Event::Init);
            for s in 0..services {
                for k in 0..slices {
                    on_slices(world, relist, Event::InitApply(big_slice(s, k, true)));
                }
            }
            let listed = on_slices(world, relist, Event::InitDone);
            (listed, started.elapsed())
        };
        let mut relist = None;
        let (listed, list_time) = full_list(&mut world, &mut relist);
        assert_eq!(
            listed.values().sum::<usize>(),
            services * slices * per_slice
        );
        for s in [0, services / 2, services - 1] {
            let key = ServiceKey::new(format!("svc-{s}"), "big".to_string());
            let state = world.state(&key, "cluster.local").expect("a service");
            assert_eq!(state.routes.len(), 1, "{key}");
        }

        let changes = 200;
        let started = Instant::now();
        for i in 0..changes {
            let s = i * 7 % services;
            let affected = on_slices(
                &mut world,
                &mut relist,
                // An endpoint unready: a change (one that changes nothing
                // read touches nothing).
                Event::Apply(big_slice(s, 0, false)),
            );
            assert_eq!(
                affected.into_values().collect::<Vec<_>>(),
                [slices * per_slice]
            );
        }
        let per_slice_change = started.elapsed() / changes as u32;

        let started = Instant::now();
        for i in 0..changes {
            let s = i * 11 % services;
            let p = pod("big", pod_name(s, 1, 3), i + 1);
            world.pods.insert(key_of(&p), pod_facts(p.clone()));
            let affected = world.pods_changed(&[key_of(&p)]);
            assert_eq!(affected.len(), 1);
            for k in &affected {
                let state = world.state(k, "cluster.local").expect("a service");
                let name = pod_name(s, 1, 3);
                let generation = state
                    .endpoints
                    .iter()
                    .find(|e| e.name.as_deref() == Some(name.as_str()))
                    .and_then(|e| e.labels.get("generation"));
                assert_eq!(generation, Some(&(i + 1).to_string()));
            }
        }
        let per_pod_change = started.elapsed() / changes as u32;

        // The kubelet's status updates (the most frequent Pod events): a
        // new time, nothing the registry reads changed.
        let started = Instant::now();
        for i in 0..changes {
            let s = i * 13 % services;
            let mut update = world.pods[&("big".to_string(), pod_name(s, 1, 2))].clone();
            update.changed_at.0 = Some(k8s_openapi::jiff::Timestamp::now());
            let mut touched = Vec::new();
            apply(
                &mut world.pods,
                &mut None,
                Event::Apply(update),
                &mut touched,
            );
            assert!(world.pods_changed(&touched).is_empty());
        }
        let per_status_update = started.elapsed() / changes as u32;

        // The list again over the full world, as after a watch's 410 Gone:
        // the slices the changes above left unready differ from the list.
        let (relisted, relist_time) = full_list(&mut world, &mut relist);
        let rss_mib = resident_kib() / 1024;
        eprintln!(
            "{services} services, {} slices, {} endpoints, {services} HTTPRoutes: the routes taken up \
             {routes_time:?}; a full list of the slices {list_time:?}, again over them {relist_time:?} \
             ({} services named); a slice change {per_slice_change:?}; a pod change {per_pod_change:?}, \
             a pod's status update {per_status_update:?}; this process resident: {rss_mib} MiB",
            services * slices,
            services * slices * per_slice,
            relisted.len(),
        );

        // The Pods listed again, as after their watch's 410 Gone: what the
        // list itself costs in time and in memory at its peak (the
        // buffered list, and whatever the objects touched hold).
        let _ = std::fs::write("/proc/self/clear_refs", "5"); // resets VmHWM
        let (resident, started) = (resident_kib(), Instant::now());
        let mut pod_relist = None;
        let mut touched = Vec::new();
        apply(&mut world.pods, &mut pod_relist, Event::Init, &mut touched);
        for s in 0..services {
            for k in 0..slices {
                for e in 0..per_slice {
                    let p = pod("big", pod_name(s, k, e), 0);
                    apply(
                        &mut world.pods,
                        &mut pod_relist,
                        Event::InitApply(pod_facts(p)),
                        &mut touched,
                    );
                }
            }
        }
        assert!(ends_a_large_relist(
            &world.pods,
            &pod_relist,
            &Event::InitDone
        ));
        apply(
            &mut world.pods,
            &mut pod_relist,
            Event::InitDone,
            &mut touched,
        );
        let (took, peak, after) = (started.elapsed(), peak_resident_kib(), resident_kib());
        let started = Instant::now();
        crate::memory::release_free_memory();
        eprintln!(
            "{} Pods listed again: {took:?}, {} touched, {} MiB more resident at the peak ({} MiB), \
             {} MiB after, {} MiB once what it freed is returned (in {:?})",
            world.pods.len(),
            touched.len(),
            peak.saturating_sub(resident) / 1024,
            peak / 1024,
            after / 1024,
            resident_kib() / 1024,
            started.elapsed(),
        );
        drop(touched);

        // One service of 100,000 endpoints in 1,000 slices, with a
        // subscriber: a change to one slice, through the registry and the
        // index.
        let (huge, huge_slices) = (services, 1_000);
        let svc = service("big", format!("svc-{huge}"));
        world.services.insert(key_of(&svc), ServiceFacts::of(svc));
        // Each endpoint names its pod, as the EndpointSlice controller's
        // do (the pods themselves are not in this world: names, no labels).
        // `replaced`: its first pod replaced that often (a new name, a new
        // address), as in a rollout.
        let huge_slice_of = |k: usize, ready: bool, replaced: usize| {
            let endpoints = (0..100)
                .map(|e| {
                    let (name, address) = match (e, replaced) {
                        (0, r) if r > 0 => (format!("huge-{k}-0-{r}"), (2 << 22) | (r * 1000 + k)),
                        _ => (format!("huge-{k}-{e}"), (1 << 22) | (k * 100 + e)),
                    };
                    endpoint(address, ready || e > 0, Some(("Pod", None, name)))
                })
                .collect();
            slice(
                "big",
                format!("huge-{k}"),
                Some(format!("svc-{huge}")),
                endpoints,
            )
        };
        let huge_slice = |k: usize, ready: bool| huge_slice_of(k, ready, 0);
        for k in 0..huge_slices {
            on_slices(&mut world, &mut relist, Event::Apply(huge_slice(k, true)));
        }
        let index = Index::new(ControlMetrics::default());
        let huge_key = ServiceKey::new(format!("svc-{huge}"), "big".to_string());
        index.set_service(&huge_key, world.state(&huge_key, "cluster.local"));
        let slot = crate::index::SlotKey::Service(huge_key.clone());
        let _watching = index.subscribe(&slot, 80);
        let changes = 20;
        let started = Instant::now();
        for i in 0..changes {
            let affected = on_slices(&mut world, &mut relist, Event::Apply(huge_slice(i, false)));
            assert_eq!(affected.into_values().sum::<usize>(), huge_slices * 100);
        }
        let registry_only = started.elapsed() / changes as u32;
        let started = Instant::now();
        for i in 0..changes {
            let e = Event::Apply(huge_slice(i, true));
            for k in on_slices(&mut world, &mut relist, e).into_keys() {
                index.set_service(&k, world.state(&k, "cluster.local"));
            }
        }
        let with_index = started.elapsed() / changes as u32;
        assert_eq!(index.snapshot(&slot, 80).endpoints.len(), huge_slices * 100);
        // A rollout: one pod of a slice replaced, late in the list (its
        // old name is listed nowhere else).
        let started = Instant::now();
        for i in 0..changes {
            let e = Event::Apply(huge_slice_of(huge_slices - 1 - i, true, 1));
            for k in on_slices(&mut world, &mut relist, e).into_keys() {
                index.set_service(&k, world.state(&k, "cluster.local"));
            }
        }
        let replaced = started.elapsed() / changes as u32;
        assert_eq!(index.snapshot(&slot, 80).endpoints.len(), huge_slices * 100);
        let gone = tether_core::policy::WorkloadKey {
            namespace: "big".into(),
            name: format!("huge-{}-0", huge_slices - 1),
        };
        assert_eq!(index.workload(&gone), None);
        eprintln!(
            "a service of {} endpoints in {huge_slices} slices: a slice change {registry_only:?} \
             in the registry, {with_index:?} with the index and a subscriber; a pod replaced \
             {replaced:?} with the index",
            huge_slices * 100,
        );
    }

    /// The registry and the index together, as the run loop drives them
    /// (written as a hostile review of the per-slice parts).
    mod run_loop {
        use super::*;

        const TD: &str = "cluster.local";

        // A slice: ns, name, service label, port config, endpoints (pod, ref ns, is_pod, two addresses, ready)
        type Ep = (usize, Option<bool>, bool, bool, bool);
        type SSpec = (bool, usize, Option<usize>, usize, Vec<Ep>);

        #[derive(Clone, Debug)]
        enum Ev {
            SvcApply(usize, bool, usize),
            SvcDelete(usize, bool, usize),
            SvcInit,
            SvcInitApply(usize, bool, usize),
            SvcInitDone,
            SlApply(SSpec),
            SlDelete(SSpec, bool),
            SlInit,
            SlInitApply(SSpec),
            SlInitDone,
            PodApply(usize, bool, usize),
            PodDelete(usize, bool, usize),
            PodInit,
            PodInitApply(usize, bool, usize),
            PodInitDone,
        }

        fn svc_obj(s: usize, b: bool, v: usize) -> ServiceFacts {
            ServiceFacts::of(service_with_ports(ns(b), format!("svc{s}"), v))
        }

        fn pod_obj(p: usize, b: bool, g: usize) -> PodFacts {
            let mut pd = pod(ns(b), format!("p{p}"), g);
            let spec = pd.spec.as_mut().unwrap();
            spec.service_account_name = Some(format!("sa{}", g % 2));
            if g % 3 == 2 {
                spec.containers[0].name = "app".into();
            }
            // Every event a new version (a status update when its facts
            // are those held), so the skip runs with times that differ.
            let mut facts = pod_facts(pd);
            facts.changed_at.0 = Some(k8s_openapi::jiff::Timestamp::now());
            facts
        }

        fn sl_obj(spec: &SSpec) -> SliceFacts {
            let (b, name, svc, ports, eps) = spec;
            let endpoints = eps
                .iter()
                .map(|(p, ref_ns, is_pod, two, ready)| {
                    let kind = if *is_pod { "Pod" } else { "Node" };
                    let n = usize::from(*b) * 8 + p;
                    let mut e = endpoint(n, *ready, Some((kind, ref_ns.map(ns), format!("p{p}"))));
                    if *two {
                        e.addresses.push(format!("10.9.9.{}", n));
                    }
                    e
                })
                .collect();
            let mut sl = slice(
                ns(*b),
                format!("s{name}"),
                svc.map(|s| format!("svc{s}")),
                endpoints,
            );
            let port = |name: Option<&str>, port: i32| EndpointPort {
                name: name.map(Into::into),
                port: Some(port),
                ..EndpointPort::default()
            };
            sl.ports = Some(match ports {
                0 => vec![port(Some("http"), 8080)],
                1 => vec![port(None, 8080)],
                2 => vec![port(Some("http"), 8080), port(Some("admin"), 9090)],
                3 => vec![port(Some("other"), 7070)],
                _ => vec![port(Some("http"), 8080), port(Some("x"), 8080)],
            });
            slice_facts(sl)
        }

        fn sspec() -> impl Strategy<Value = SSpec> {
            (
                any::<bool>(),
                0usize..4,
                proptest::option::of(0usize..3),
                0usize..5,
                proptest::collection::vec(
                    (
                        0usize..5,
                        proptest::option::of(any::<bool>()),
                        any::<bool>(),
                        any::<bool>(),
                        any::<bool>(),
                    ),
                    0..4,
                ),
            )
        }

        fn ev() -> impl Strategy<Value = Ev> {
            let svc = || (0usize..3, any::<bool>(), 0usize..7);
            let pd = || (0usize..5, any::<bool>(), 0usize..4);
            prop_oneof![
                2 => svc().prop_map(|(s, b, v)| Ev::SvcApply(s, b, v)),
                1 => svc().prop_map(|(s, b, v)| Ev::SvcDelete(s, b, v)),
                1 => Just(Ev::SvcInit),
                2 => svc().prop_map(|(s, b, v)| Ev::SvcInitApply(s, b, v)),
                1 => Just(Ev::SvcInitDone),
                4 => sspec().prop_map(Ev::SlApply),
                2 => (sspec(), any::<bool>()).prop_map(|(s, o)| Ev::SlDelete(s, o)),
                1 => Just(Ev::SlInit),
                2 => sspec().prop_map(Ev::SlInitApply),
                1 => Just(Ev::SlInitDone),
                3 => pd().prop_map(|(p, b, g)| Ev::PodApply(p, b, g)),
                1 => pd().prop_map(|(p, b, g)| Ev::PodDelete(p, b, g)),
                1 => Just(Ev::PodInit),
                2 => pd().prop_map(|(p, b, g)| Ev::PodInitApply(p, b, g)),
                1 => Just(Ev::PodInitDone),
            ]
        }

        fn keys() -> Vec<ServiceKey> {
            (0..3)
                .flat_map(|s| ["a", "b"].map(|n| ServiceKey::new(format!("svc{s}"), n.to_string())))
                .collect()
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]
            /// The run loop's steps (each Service, EndpointSlice and Pod
            /// event applied, then each affected service's state given to
            /// the index), in any order, lists interleaved and restarted:
            /// after every event the index holds and publishes what a
            /// fresh computation from the same objects gives (services,
            /// slots, workloads' labels), a list said to be distinct
            /// repeats nothing, and nothing is kept for what is gone.
            #[test]
            fn the_run_loop_publishes_what_a_fresh_computation_gives(
                events in proptest::collection::vec(ev(), 1..40),
            ) {
                let mut world = World::default();
                let index = Index::new(ControlMetrics::default());
                let mut subs = Vec::new();
                for k in keys() {
                    for port in [80u16, 81, 9000] {
                        let slot = crate::index::SlotKey::Service(k.clone());
                        subs.push((slot.clone(), port, index.subscribe(&slot, port)));
                    }
                }
                let mut wsubs = Vec::new();
                for n in ["a", "b"] { for p in 0..5 {
                    let wk = tether_core::policy::WorkloadKey { namespace: n.into(), name: format!("p{p}") };
                    wsubs.push((wk.clone(), index.watch_workload(&wk)));
                }}
                let (mut sv_r, mut sl_r, mut pd_r) = (None, None, None);
                for e in events {
                    let mut affected = BTreeSet::new();
                    match e {
                        Ev::SvcApply(..) | Ev::SvcDelete(..) | Ev::SvcInit | Ev::SvcInitApply(..) | Ev::SvcInitDone => {
                            let ev = match e {
                                Ev::SvcApply(s, b, v) => Event::Apply(svc_obj(s, b, v)),
                                Ev::SvcDelete(s, b, v) => match deleted(&world.services, svc_obj(s, b, v), v % 2 == 0) { Some(o) => Event::Delete(o), None => continue },
                                Ev::SvcInit => Event::Init,
                                Ev::SvcInitApply(s, b, v) => Event::InitApply(svc_obj(s, b, v)),
                                _ => Event::InitDone,
                            };
                            let mut touched = Vec::new();
                            apply(&mut world.services, &mut sv_r, ev, &mut touched);
                            affected.extend(touched.into_iter().map(|(ns, name)| ServiceKey::new(name, ns)));
                        }
                        Ev::SlApply(..) | Ev::SlDelete(..) | Ev::SlInit | Ev::SlInitApply(..) | Ev::SlInitDone => {
                            let ev = match e {
                                Ev::SlApply(s) => Event::Apply(sl_obj(&s)),
                                Ev::SlDelete(s, o) => match deleted(&world.slices, sl_obj(&s), o) { Some(o) => Event::Delete(o), None => continue },
                                Ev::SlInit => Event::Init,
                                Ev::SlInitApply(s) => Event::InitApply(sl_obj(&s)),
                                _ => Event::InitDone,
                            };
                            let mut touched = Vec::new();
                            apply(&mut world.slices, &mut sl_r, ev, &mut touched);
                            affected.extend(world.slices_changed(touched));
                        }
                        _ => {
                            let ev = match e {
                                Ev::PodApply(p, b, g) => Event::Apply(pod_obj(p, b, g)),
                                Ev::PodDelete(p, b, g) => match deleted(&world.pods, pod_obj(p, b, g), g % 2 == 0) { Some(o) => Event::Delete(o), None => continue },
                                Ev::PodInit => Event::Init,
                                Ev::PodInitApply(p, b, g) => Event::InitApply(pod_obj(p, b, g)),
                                _ => Event::InitDone,
                            };
                            affected.extend(world.on_pods(&mut pd_r, ev).1);
                        }
                    }
                    for k in &affected {
                        index.set_service(k, world.state(k, TD));
                    }
                    // What the index holds, against a fresh computation, for every service.
                    for k in keys() {
                        let held = index.service(&k);
                        let fresh = fresh_state(&world, &k);
                        prop_assert_eq!(&held, &fresh, "{}", k);
                        if let Some(held) = &held {
                            let listed: Vec<_> = held.endpoints.iter().map(|e| (e.address, e.port)).collect();
                            let set: BTreeSet<_> = listed.iter().collect();
                            if held.endpoints.is_distinct() {
                                prop_assert_eq!(set.len(), listed.len(), "distinct but repeated: {:?}", listed);
                            }
                        }
                    }
                    let fresh_index = Index::new(ControlMetrics::default());
                    for k in keys() { fresh_index.set_service(&k, fresh_state(&world, &k)); }
                    for n in ["a", "b"] { for p in 0..5 {
                        let wk = tether_core::policy::WorkloadKey { namespace: n.into(), name: format!("p{p}") };
                        prop_assert_eq!(index.workload(&wk), fresh_index.workload(&wk), "workload {:?}", wk);
                    }}
                    for (w, rx) in &wsubs {
                        prop_assert_eq!(&*rx.borrow(), &fresh_index.workload(w), "workload watch {:?}", w);
                    }
                    prop_assert_eq!(index.workload_shares(), fresh_index.workload_shares());
                    for (slot, port, _) in &subs {
                        prop_assert!(index.check_slot(slot, *port).1, "slot {:?}:{} disagrees", slot, port);
                    }
                    // Memory: nothing kept for what is gone.
                    for (sk, part) in &world.slice_parts {
                        prop_assert!(world.slices.contains_key(sk), "part of a gone slice {:?}", sk);
                        prop_assert!(world.parts_ports.contains_key(&part.service), "part without ports {:?}", sk);
                    }
                    for k in world.parts_ports.keys() {
                        prop_assert!(fresh_state(&world, k).is_some(), "ports kept for gone {}", k);
                    }
                    let mut recount: HashMap<ServiceKey, Listings> = HashMap::new();
                    for part in world.slice_parts.values() {
                        recount.entry(part.service.clone()).or_default().add(&part.endpoints);
                    }
                    for (k, l) in &world.listings {
                        let r = recount.remove(k).unwrap_or_default();
                        prop_assert_eq!(&l.count, &r.count, "listings of {}", k);
                        prop_assert_eq!(l.repeats, r.repeats, "repeats of {}", k);
                    }
                    for (k, r) in recount {
                        prop_assert!(r.count.is_empty(), "listings missing for {}", k);
                    }
                    // Equal label sets are held once, by the pods, the
                    // endpoints built from them and the index alike.
                    let held: Vec<_> = world.pods.values().chain(pd_r.iter().flat_map(|r| r.values())).map(|p| &p.labels).collect();
                    for (a, b) in held.iter().flat_map(|a| held.iter().map(move |b| (a, b))) {
                        prop_assert_eq!(a == b, Arc::ptr_eq(a, b), "{:?} and {:?}", a, b);
                    }
                    for state in keys().iter().filter_map(|k| index.service(k)) {
                        for e in state.endpoints.iter() {
                            prop_assert!(held.iter().any(|l| Arc::ptr_eq(l, &e.labels)) || e.labels.is_empty(), "{:?} a copy", e.labels);
                        }
                    }
                }
            }
        }
    }
}
