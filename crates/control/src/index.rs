//! The in-memory index: service → port → endpoint set, with one
//! latest-state slot per subscribed (service, port).
//!
//! Multicluster: services sharing a `global_id` form one logical service.
//! A subscriber of any of them gets the union of their local endpoints,
//! plus — by the service's mode and the links' priority tiers — one
//! endpoint per linked cluster that has ready endpoints for that global id:
//! its gateway, weighted by the remote ready count. `<global-id>.global`
//! subscriptions (the gateway's) get the local union only.
//!
//! A slot is a `tokio::sync::watch` channel: writing replaces the value and
//! never waits, readers always see the newest value. That is the whole
//! fan-out contract: the index never blocks on a subscriber, and a slow
//! subscriber skips intermediate states but converges on the latest.
//! The lock is a plain mutex held only for map updates, never across an
//! `.await`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tether_core::authority::ServiceKey;
use tether_core::policy::{Labels, PolicySet, WorkloadKey};
use tether_core::registry::{EndpointSpec, MulticlusterMode, PortSpec};
use tokio::sync::watch;

use crate::endpoints::{EndpointChanges, SetChange};
pub use crate::endpoints::{EndpointList, EndpointSet};
use crate::metrics::{ControlMetrics, ServiceLabels};

/// A whole service as a registry backend sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceState {
    pub ports: Vec<PortSpec>,
    pub global_id: Option<String>,
    pub mode: Option<MulticlusterMode>,
    pub retry_budget: Option<tether_core::registry::RetryBudget>,
    /// Overrides the proxies' response timeout; zero means none.
    pub response_timeout: Option<std::time::Duration>,
    pub cluster_ip: Option<std::net::IpAddr>,
    pub endpoints: EndpointList,
    /// The routes attached to the service (to any of its ports), ordered
    /// by kind, namespace and name; each validated.
    pub routes: Vec<tether_core::route::Route>,
}

impl ServiceState {
    /// A local service on `ports` with no endpoints and no overrides; set
    /// the public fields for the rest.
    pub fn new(ports: Vec<PortSpec>) -> Self {
        Self {
            ports,
            global_id: None,
            mode: None,
            retry_budget: None,
            response_timeout: None,
            cluster_ip: None,
            endpoints: EndpointList::default(),
            routes: Vec::new(),
        }
    }

    pub fn with_endpoints(mut self, endpoints: Vec<EndpointSpec>) -> Self {
        self.endpoints = endpoints.into();
        self
    }
}

/// What a subscriber to one (service, port) is told about an endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointMeta {
    pub weight: u32,
    pub identity: Option<Arc<str>>,
    pub zone: Option<Arc<str>>,
    pub meshed: bool,
    pub opaque: bool,
    pub name: Option<Arc<str>>,
    /// The cluster the endpoint is in (multicluster only).
    pub cluster: Option<String>,
    /// The authority to send instead of the request's (gateways).
    pub authority_override: Option<String>,
    /// The priority tier (multicluster services only): 0 for what the
    /// service uses first, a link's priority for that link's gateway.
    pub tier: Option<u32>,
}

/// The current state of one (service, port): only ready endpoints, of
/// every tier. The endpoints are shared: every subscriber that was sent a
/// state keeps it by reference (what it was sent is what it diffs the next
/// state against), so a subscriber costs no copy of its service.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct PortSnapshot {
    pub exists: bool,
    pub opaque: bool,
    pub endpoints: EndpointSet,
}

impl PortSnapshot {
    /// Only the endpoints of the best tier: what a client that does not
    /// read tiers is sent, and exactly what every client was sent before
    /// tiers existed (`balanced`: local and the best remote tier;
    /// `failover`: local, or while none is ready the best remote tier).
    pub fn best_tier(&self) -> std::borrow::Cow<'_, PortSnapshot> {
        let tier = |m: &EndpointMeta| m.tier.unwrap_or(0);
        let Some(best) = self.endpoints.values().map(tier).min() else {
            return std::borrow::Cow::Borrowed(self);
        };
        if self.endpoints.values().all(|m| tier(m) == best) {
            return std::borrow::Cow::Borrowed(self);
        }
        std::borrow::Cow::Owned(PortSnapshot {
            exists: self.exists,
            opaque: self.opaque,
            endpoints: self
                .endpoints
                .iter()
                .filter(|(_, m)| tier(m) == best)
                .map(|(a, m)| (*a, m.clone()))
                .collect(),
        })
    }
}

/// What a slot holds: the state, which version of the slot it is, and when
/// the registry change behind it was observed (for the change-to-send
/// latency histogram).
#[derive(Clone, Debug)]
pub struct Published {
    pub version: u64,
    pub observed_at: Instant,
    pub snap: PortSnapshot,
    /// `snap`'s best tier when it has several: computed once here rather
    /// than by each subscriber that does not read tiers.
    best_tier: Option<PortSnapshot>,
    /// The updates to this state, encoded once for its subscribers.
    pub(crate) shared: crate::destination::SharedUpdates,
}

impl Published {
    pub fn new(version: u64, observed_at: Instant, snap: PortSnapshot) -> Self {
        let best_tier = match snap.best_tier() {
            std::borrow::Cow::Borrowed(_) => None,
            std::borrow::Cow::Owned(best) => Some(best),
        };
        Self {
            version,
            observed_at,
            snap,
            best_tier,
            shared: Default::default(),
        }
    }

    /// A state whose endpoints are all of one tier (a local service's),
    /// known without looking at each.
    fn one_tier(version: u64, observed_at: Instant, snap: PortSnapshot) -> Self {
        Self {
            version,
            observed_at,
            snap,
            best_tier: None,
            shared: Default::default(),
        }
    }

    /// What a subscriber is sent: every tier, or only the best.
    pub fn view(&self, tiers: bool) -> &PortSnapshot {
        match &self.best_tier {
            Some(best) if !tiers => best,
            _ => &self.snap,
        }
    }
}

pub type SlotReceiver = watch::Receiver<Arc<Published>>;
type Slot = watch::Sender<Arc<Published>>;

/// What a subscription watches.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SlotKey {
    /// A service (merged with its global id's, when it has one).
    Service(ServiceKey),
    /// The local endpoints of every service with this global id.
    Global(String),
    /// One endpoint, by address (an intercepted connection to a pod IP).
    Endpoint(SocketAddr),
}

impl From<ServiceKey> for SlotKey {
    fn from(k: ServiceKey) -> Self {
        SlotKey::Service(k)
    }
}

impl std::fmt::Display for SlotKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotKey::Service(k) => write!(f, "{k}"),
            SlotKey::Global(g) => write!(f, "global/{g}"),
            SlotKey::Endpoint(a) => write!(f, "endpoint/{a}"),
        }
    }
}

/// A linked cluster, as its export stream and gateway probe describe it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteCluster {
    pub priority: u32,
    pub gateway: SocketAddr,
    pub gateway_identity: Option<String>,
    /// Ready endpoints per exported global id.
    pub ready: BTreeMap<String, u32>,
}

#[derive(Default)]
struct Inner {
    /// This cluster's name (empty when not multicluster).
    cluster: String,
    services: HashMap<ServiceKey, ServiceState>,
    by_global: HashMap<String, BTreeSet<ServiceKey>>,
    remotes: BTreeMap<String, RemoteCluster>,
    slots: HashMap<SlotKey, HashMap<u16, Slot>>,
    /// One slot per service that a policy or profile stream follows: the
    /// service without its endpoints (what routing depends on), or `None`
    /// while it does not exist.
    routing: HashMap<ServiceKey, watch::Sender<RoutingState>>,
    /// Each named workload's labels, per service that lists it (so one
    /// service's change updates only its own share).
    workloads: HashMap<WorkloadKey, Shares>,
    /// One slot per workload an inbound policy stream follows: its labels,
    /// or `None` while no service lists it.
    workload_slots: HashMap<WorkloadKey, watch::Sender<WorkloadState>>,
    /// How many snapshots were built, for tests of what costs O(endpoints).
    #[cfg(test)]
    snapshots_built: std::sync::atomic::AtomicUsize,
}

/// A workload as inbound policy sees it: its labels, once a service lists
/// it.
pub type WorkloadState = Option<Labels>;

/// What one service gives a workload it lists: the labels of the name's
/// first listing, and how often the service lists the name.
#[derive(Debug, Clone, PartialEq)]
struct Share {
    /// Shared with the endpoints (and the registry's record of the pod).
    labels: Arc<Labels>,
    listings: u32,
}

/// Each listing service's share of one workload, in service order: a
/// sorted list, as a workload is listed by one service or a few (a map's
/// smallest node is ~1 KiB, a workload's largest cost in the index before).
#[derive(Debug, Default)]
struct Shares(Vec<(ServiceKey, Share)>);

impl Shares {
    fn get(&self, service: &ServiceKey) -> Option<&Share> {
        let i = self.0.binary_search_by(|(k, _)| k.cmp(service)).ok()?;
        Some(&self.0[i].1)
    }

    fn insert(&mut self, service: ServiceKey, share: Share) {
        match self.0.binary_search_by(|(k, _)| k.cmp(&service)) {
            Ok(i) => self.0[i].1 = share,
            Err(i) => {
                self.0.reserve_exact(1);
                self.0.insert(i, (service, share));
            }
        }
    }

    fn remove(&mut self, service: &ServiceKey) {
        if let Ok(i) = self.0.binary_search_by(|(k, _)| k.cmp(service)) {
            self.0.remove(i);
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn iter(&self) -> impl Iterator<Item = (&ServiceKey, &Share)> {
        self.0.iter().map(|(k, s)| (k, s))
    }
}

/// The named endpoints of a service: each name's labels (the first listing
/// of a name wins, as for addresses) and how often it is listed.
fn named_listings(state: Option<&ServiceState>) -> BTreeMap<&str, (&Arc<Labels>, u32)> {
    let mut named = BTreeMap::new();
    for ep in state.into_iter().flat_map(|s| &s.endpoints) {
        if let Some(name) = &ep.name {
            named.entry(&**name).or_insert((&ep.labels, 0)).1 += 1;
        }
    }
    named
}

/// The labels of each of `wanted`'s first listing in `endpoints`, looking
/// no further than the last one found.
fn first_listings<'a>(
    endpoints: impl Iterator<Item = &'a EndpointSpec>,
    wanted: &HashSet<&str>,
) -> HashMap<&'a str, &'a Arc<Labels>> {
    let mut first = HashMap::with_capacity(wanted.len());
    for ep in endpoints {
        if first.len() == wanted.len() {
            break;
        }
        if let Some(name) = ep.name.as_deref().filter(|n| wanted.contains(n)) {
            first.entry(name).or_insert(&ep.labels);
        }
    }
    first
}

/// A service as routing sees it: its state without endpoints.
pub type RoutingState = Option<Arc<ServiceState>>;
pub type RoutingReceiver = watch::Receiver<RoutingState>;

fn routing_state(state: Option<&ServiceState>) -> RoutingState {
    state.map(|s| {
        Arc::new(ServiceState {
            endpoints: EndpointList::default(),
            ..s.clone()
        })
    })
}

#[derive(Clone)]
pub struct Index {
    inner: Arc<Mutex<Inner>>,
    /// The registry's policy resources, replaced whole on each change.
    policies: Arc<watch::Sender<Arc<PolicySet>>>,
    metrics: ControlMetrics,
}

impl Index {
    pub fn new(metrics: ControlMetrics) -> Self {
        Self {
            inner: Arc::default(),
            policies: Arc::new(watch::Sender::new(Arc::default())),
            metrics,
        }
    }

    /// Replaces the policy resources (a no-op when nothing changed, so
    /// inbound streams wake only for real changes).
    pub fn set_policies(&self, set: PolicySet) {
        self.policies.send_if_modified(|cur| {
            let changed = **cur != set;
            if changed {
                *cur = Arc::new(set);
            }
            changed
        });
    }

    pub fn policies(&self) -> Arc<PolicySet> {
        self.policies.borrow().clone()
    }

    pub fn watch_policies(&self) -> watch::Receiver<Arc<PolicySet>> {
        self.policies.subscribe()
    }

    /// Follows a workload's labels: the receiver holds them at once
    /// (`None` while no service lists the workload).
    pub fn watch_workload(&self, key: &WorkloadKey) -> watch::Receiver<WorkloadState> {
        let mut inner = self.inner.lock().unwrap();
        let current = inner.workload_labels(key);
        inner
            .workload_slots
            .entry(key.clone())
            .or_insert_with(|| watch::Sender::new(current))
            .subscribe()
    }

    /// A workload's labels, `None` while no service lists it.
    pub fn workload(&self, key: &WorkloadKey) -> WorkloadState {
        self.inner.lock().unwrap().workload_labels(key)
    }

    /// Drops a workload slot nobody follows any more.
    pub fn release_workload(&self, key: &WorkloadKey) {
        let mut inner = self.inner.lock().unwrap();
        if inner
            .workload_slots
            .get(key)
            .is_some_and(|s| s.receiver_count() == 0)
        {
            inner.workload_slots.remove(key);
            shrink_map(&mut inner.workload_slots);
        }
    }

    pub fn metrics(&self) -> &ControlMetrics {
        &self.metrics
    }

    /// Names this cluster (labels local endpoints when multicluster).
    pub fn set_cluster(&self, name: &str) {
        self.inner.lock().unwrap().cluster = name.to_string();
    }

    /// Replaces (or, with `None`, removes) a service and publishes the new
    /// state to the slots of that service whose view changed.
    pub fn set_service(&self, key: &ServiceKey, state: Option<ServiceState>) {
        self.set_service_observed(key, state, Instant::now());
    }

    /// As [`Index::set_service`], for a change the registry observed at
    /// `observed_at`.
    pub fn set_service_observed(
        &self,
        key: &ServiceKey,
        state: Option<ServiceState>,
        observed_at: Instant,
    ) {
        let mut inner = self.inner.lock().unwrap();
        let changes = inner
            .services
            .get(key)
            .zip(state.as_ref())
            .and_then(|(old, new)| endpoint_changes(old, new));
        let old_endpoints = inner.services.get(key).map_or(0, |s| s.endpoints.len());
        let new_endpoints = state.as_ref().map_or(0, |s| s.endpoints.len());
        let labels = ServiceLabels {
            service: key.to_string(),
        };
        if let Some(slot) = inner.routing.get(key) {
            let routing = routing_state(state.as_ref());
            slot.send_if_modified(|cur| {
                let changed = *cur != routing;
                if changed {
                    *cur = routing;
                }
                changed
            });
        }
        match &changes {
            None => inner.update_workloads(key, state.as_ref()),
            Some(changes) if !changes.names.is_empty() => {
                inner.update_workload_names(key, state.as_ref(), changes)
            }
            Some(_) => {}
        }
        let old_global = inner.services.get(key).and_then(|s| s.global_id.clone());
        let new_global = state.as_ref().and_then(|s| s.global_id.clone());
        match state {
            Some(s) => {
                if inner.services.insert(key.clone(), s).is_none() {
                    self.metrics.registry_services.inc();
                }
                self.metrics
                    .endpoints_per_service
                    .get_or_create(&labels)
                    .set(new_endpoints as i64);
            }
            None => {
                if inner.services.remove(key).is_some() {
                    self.metrics.registry_services.dec();
                }
                self.metrics.endpoints_per_service.remove(&labels);
            }
        }
        if let Some(g) = &old_global {
            if let Some(members) = inner.by_global.get_mut(g) {
                members.remove(key);
                if members.is_empty() {
                    inner.by_global.remove(g);
                }
            }
        }
        if let Some(g) = &new_global {
            inner
                .by_global
                .entry(g.clone())
                .or_default()
                .insert(key.clone());
        }
        self.metrics
            .registry_endpoints
            .inc_by(new_endpoints as i64 - old_endpoints as i64);
        let mut affected = Vec::new();
        match &changes {
            Some(changes) => inner.republish_changes(key, changes, observed_at),
            None => affected.push(SlotKey::Service(key.clone())),
        }
        // Endpoint slots are few (intercepted pod-IP connections): refresh all.
        affected.extend(
            inner
                .slots
                .keys()
                .filter(|k| matches!(k, SlotKey::Endpoint(_)))
                .cloned(),
        );
        for g in old_global.iter().chain(new_global.iter()) {
            affected.push(SlotKey::Global(g.clone()));
            if let Some(members) = inner.by_global.get(g) {
                affected.extend(members.iter().cloned().map(SlotKey::Service));
            }
        }
        inner.republish(&affected, observed_at);
    }

    /// Replaces (or removes) a linked cluster's state, republishing every
    /// service with a global id.
    pub fn set_remote(&self, name: &str, remote: Option<RemoteCluster>) {
        let mut inner = self.inner.lock().unwrap();
        let changed = match remote {
            Some(r) => inner.remotes.insert(name.to_string(), r.clone()).as_ref() != Some(&r),
            None => inner.remotes.remove(name).is_some(),
        };
        if !changed {
            return;
        }
        let affected: Vec<SlotKey> = inner
            .by_global
            .values()
            .flatten()
            .cloned()
            .map(SlotKey::Service)
            .collect();
        inner.republish(&affected, Instant::now());
    }

    /// What an intercepted `ip:port` is: the service whose cluster IP it
    /// is, or else that one endpoint.
    pub fn resolve_ip(&self, addr: SocketAddr) -> SlotKey {
        // The first service by name, as `service_by_ip` picks it: the
        // services map's order differs between replicas.
        self.service_by_ip(addr)
            .map(SlotKey::Service)
            .unwrap_or(SlotKey::Endpoint(addr))
    }

    /// The service whose cluster IP and port `addr` is; the first by name
    /// if several claim it, so replicas agree.
    pub fn service_by_ip(&self, addr: SocketAddr) -> Option<ServiceKey> {
        let inner = self.inner.lock().unwrap();
        inner
            .services
            .iter()
            .filter(|(_, s)| {
                s.cluster_ip == Some(addr.ip()) && s.ports.iter().any(|p| p.port == addr.port())
            })
            .map(|(k, _)| k)
            .min()
            .cloned()
    }

    /// Follows a service's routing state (everything but its endpoints):
    /// the receiver holds the current state at once, and changes only when
    /// that state does, not on endpoint churn.
    pub fn watch_routing(&self, key: &ServiceKey) -> RoutingReceiver {
        let mut inner = self.inner.lock().unwrap();
        let current = routing_state(inner.services.get(key));
        inner
            .routing
            .entry(key.clone())
            .or_insert_with(|| watch::Sender::new(current))
            .subscribe()
    }

    /// Drops a routing slot nobody follows any more.
    pub fn release_routing(&self, key: &ServiceKey) {
        let mut inner = self.inner.lock().unwrap();
        if inner
            .routing
            .get(key)
            .is_some_and(|s| s.receiver_count() == 0)
        {
            inner.routing.remove(key);
            shrink_map(&mut inner.routing);
        }
    }

    /// Ready local endpoints per global id, for the export API.
    pub fn exported(&self) -> BTreeMap<String, u32> {
        let inner = self.inner.lock().unwrap();
        inner
            .by_global
            .keys()
            .map(|g| {
                let ready: BTreeSet<SocketAddr> = inner
                    .local_members(g)
                    .flat_map(|s| s.endpoints.iter().filter(|e| e.ready).map(|e| e.address))
                    .collect();
                (g.clone(), ready.len() as u32)
            })
            .collect()
    }

    /// Subscribes to one (service, port); the receiver holds the current
    /// state at once.
    pub fn subscribe(&self, key: &SlotKey, port: u16) -> SlotReceiver {
        let mut inner = self.inner.lock().unwrap();
        // A slot that exists holds the state already: building it again is
        // O(endpoints) per subscriber (100,000 endpoints: 20 subscribers
        // took 9 s), under the index's lock.
        if let Some(slot) = inner.slots.get(key).and_then(|p| p.get(&port)) {
            return slot.subscribe();
        }
        let snap = inner.snapshot(key, port);
        let slot = inner
            .slots
            .entry(key.clone())
            .or_default()
            .entry(port)
            .or_insert_with(|| {
                watch::Sender::new(Arc::new(Published::new(0, Instant::now(), snap)))
            });
        slot.subscribe()
    }

    /// The slot's published state for (key, port) once it agrees with the
    /// index, and whether it did: a slot that does not is repaired by
    /// publishing the index's state. Without a slot, the index's state as
    /// version 0.
    pub fn check_slot(&self, key: &SlotKey, port: u16) -> (Arc<Published>, bool) {
        let mut inner = self.inner.lock().unwrap();
        let snap = inner.snapshot(key, port);
        match inner.slots.get_mut(key).and_then(|p| p.get_mut(&port)) {
            Some(slot) => {
                let agrees = slot.borrow().snap == snap;
                if !agrees {
                    publish(slot, snap, Instant::now());
                }
                let published = slot.borrow().clone();
                (published, agrees)
            }
            None => (Arc::new(Published::new(0, Instant::now(), snap)), true),
        }
    }

    pub fn snapshot(&self, key: &SlotKey, port: u16) -> PortSnapshot {
        self.inner.lock().unwrap().snapshot(key, port)
    }

    pub fn service(&self, key: &ServiceKey) -> Option<ServiceState> {
        self.inner.lock().unwrap().services.get(key).cloned()
    }

    /// Finds the service port an endpoint address serves, for profile
    /// lookups by IP.
    pub fn find_endpoint(&self, addr: SocketAddr) -> Option<(ServiceKey, u16, EndpointMeta)> {
        let inner = self.inner.lock().unwrap();
        for (key, svc) in &inner.services {
            for ep in &svc.endpoints {
                if ep.address == addr {
                    let port = ep.port.unwrap_or(svc.ports[0].port);
                    let opaque = svc.ports.iter().any(|p| p.port == port && p.opaque);
                    return Some((key.clone(), port, meta_of(ep, opaque, &inner.cluster)));
                }
            }
        }
        None
    }

    /// Drops (key, port)'s slot if nobody watches it any more: called when
    /// a subscription ends, so unsubscribed slots do not wait for the next
    /// garbage collection (a client cycling through made-up names would
    /// otherwise pile them up).
    pub fn release(&self, key: &SlotKey, port: u16) {
        let mut inner = self.inner.lock().unwrap();
        let Some(ports) = inner.slots.get_mut(key) else {
            return;
        };
        if ports.get(&port).is_some_and(|s| s.receiver_count() == 0) {
            ports.remove(&port);
            if ports.is_empty() {
                inner.slots.remove(key);
                shrink_map(&mut inner.slots);
            }
        }
    }

    /// How many (key, port) slots exist.
    pub fn slot_count(&self) -> usize {
        self.inner
            .lock()
            .unwrap()
            .slots
            .values()
            .map(HashMap::len)
            .sum()
    }

    /// How many snapshots were built from scratch, for tests of what a
    /// change costs.
    #[cfg(test)]
    pub(crate) fn snapshots_built(&self) -> usize {
        self.inner
            .lock()
            .unwrap()
            .snapshots_built
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every workload's share of every service that lists it (labels, and
    /// how often it is listed), for tests of the incremental updates.
    #[cfg(test)]
    pub(crate) fn workload_shares(&self) -> BTreeMap<(String, String), (Labels, u32)> {
        let inner = self.inner.lock().unwrap();
        let mut all = BTreeMap::new();
        for (workload, shares) in &inner.workloads {
            for (service, share) in shares.iter() {
                let key = (
                    format!("{}/{}", workload.namespace, workload.name),
                    service.to_string(),
                );
                all.insert(key, ((*share.labels).clone(), share.listings));
            }
        }
        all
    }

    /// Drops slots that no subscriber watches any more.
    pub fn collect_garbage(&self) {
        let mut inner = self.inner.lock().unwrap();
        inner.slots.retain(|_, ports| {
            ports.retain(|_, slot| slot.receiver_count() > 0);
            !ports.is_empty()
        });
        inner.routing.retain(|_, slot| slot.receiver_count() > 0);
        inner
            .workload_slots
            .retain(|_, slot| slot.receiver_count() > 0);
    }
}

impl Inner {
    /// A workload's labels: every listing service's share merged, the first
    /// service (by name) winning a key both set.
    fn workload_labels(&self, key: &WorkloadKey) -> WorkloadState {
        let shares = self.workloads.get(key)?;
        let mut labels = Labels::new();
        for (_, share) in shares.iter() {
            for (k, v) in share.labels.iter() {
                labels.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        Some(labels)
    }

    /// Records what `service`'s new state says about its named workloads
    /// (called before the state replaces the old one) and republishes the
    /// workloads whose labels changed. Endpoint churn that keeps names,
    /// labels and how often each name is listed costs one comparison.
    fn update_workloads(&mut self, service: &ServiceKey, state: Option<&ServiceState>) {
        let old = named_listings(self.services.get(service));
        let new = named_listings(state);
        if old == new {
            return;
        }
        let key = |name: &str| WorkloadKey {
            namespace: service.namespace.clone(),
            name: name.to_string(),
        };
        let shares: Vec<(WorkloadKey, Option<Share>)> = old
            .keys()
            .filter(|name| !new.contains_key(*name))
            .map(|name| (key(name), None))
            .chain(
                new.iter()
                    .filter(|(name, share)| old.get(*name) != Some(*share))
                    .map(|(name, (labels, listings))| {
                        let share = Share {
                            labels: Arc::clone(labels),
                            listings: *listings,
                        };
                        (key(name), Some(share))
                    }),
            )
            .collect();
        self.set_workload_shares(service, shares);
    }

    /// As [`Inner::update_workloads`], when the new state differs from the
    /// old by `changes` alone: only the names the changed parts list can
    /// have changed. How often the service lists each (kept with its
    /// share) tells which are gone without a look at the list, and which
    /// the new parts alone list; the others' first listing is looked up in
    /// the whole list. A pod replaced in one slice of a service of 100,000
    /// named endpoints costs that slice.
    fn update_workload_names(
        &mut self,
        service: &ServiceKey,
        state: Option<&ServiceState>,
        changes: &EndpointChanges,
    ) {
        let mut listings: Vec<(WorkloadKey, u32)> = Vec::with_capacity(changes.names.len());
        let (mut in_new_parts, mut anywhere) = (HashSet::new(), HashSet::new());
        for (name, listed) in &changes.names {
            let key = WorkloadKey {
                namespace: service.namespace.clone(),
                name: name.to_string(),
            };
            let had = self
                .workloads
                .get(&key)
                .and_then(|s| s.get(service))
                .map_or(0, |s| s.listings);
            debug_assert!(had >= listed.gone, "{name}: {had} listings, {listed:?}");
            let now = (had + listed.new).saturating_sub(listed.gone);
            // None left: gone, nothing to look up.
            if now > 0 && now == listed.new {
                in_new_parts.insert(&**name);
            } else if now > 0 {
                anywhere.insert(&**name);
            }
            listings.push((key, now));
        }
        let first = match state {
            None => HashMap::new(),
            // Once any name is looked for in the whole list, look for all.
            Some(state) if anywhere.is_empty() => first_listings(
                state.endpoints.endpoints_of_parts(&changes.new_parts),
                &in_new_parts,
            ),
            Some(state) => {
                anywhere.extend(in_new_parts);
                first_listings(state.endpoints.iter(), &anywhere)
            }
        };
        // Only the shares that changed are written (and their labels
        // copied): most names a changed part lists keep theirs.
        let shares = listings
            .into_iter()
            .filter_map(|(key, listings)| {
                let labels = first.get(key.name.as_str()).copied();
                let held = self.workloads.get(&key).and_then(|s| s.get(service));
                let same = match (held, labels) {
                    (Some(held), Some(labels)) => {
                        held.listings == listings && held.labels == *labels
                    }
                    (held, labels) => held.is_none() && labels.is_none(),
                };
                let share = |labels: &Arc<Labels>| Share {
                    labels: Arc::clone(labels),
                    listings,
                };
                (!same).then(|| (key, labels.map(share)))
            })
            .collect();
        self.set_workload_shares(service, shares);
    }

    /// Sets what `service` gives each named workload (its share, or nothing)
    /// and republishes those whose labels changed.
    fn set_workload_shares(
        &mut self,
        service: &ServiceKey,
        shares: Vec<(WorkloadKey, Option<Share>)>,
    ) {
        for (key, share) in shares {
            let old = self.workloads.get(&key).and_then(|s| s.get(service));
            let relabelled = old.map(|s| &s.labels) != share.as_ref().map(|s| &s.labels);
            match share {
                Some(share) => {
                    self.workloads
                        .entry(key.clone())
                        .or_default()
                        .insert(service.clone(), share);
                }
                None => {
                    if let Some(shares) = self.workloads.get_mut(&key) {
                        shares.remove(service);
                        if shares.is_empty() {
                            self.workloads.remove(&key);
                            shrink_map(&mut self.workloads);
                        }
                    }
                }
            }
            if !relabelled {
                continue;
            }
            if let Some(slot) = self.workload_slots.get(&key) {
                let current = self.workload_labels(&key);
                slot.send_if_modified(|cur| {
                    let changed = *cur != current;
                    if changed {
                        *cur = current;
                    }
                    changed
                });
            }
        }
    }

    fn local_members<'a>(&'a self, global: &str) -> impl Iterator<Item = &'a ServiceState> + 'a {
        self.by_global
            .get(global)
            .into_iter()
            .flatten()
            .filter_map(|k| self.services.get(k))
    }

    /// Ready local endpoints of every service with `global` serving `port`.
    fn local_union(&self, global: &str, port: u16) -> BTreeMap<SocketAddr, EndpointMeta> {
        let mut out = BTreeMap::new();
        for svc in self.local_members(global) {
            out.extend(ready_endpoints(svc, port, &self.cluster));
        }
        out
    }

    fn snapshot(&self, key: &SlotKey, port: u16) -> PortSnapshot {
        #[cfg(test)]
        self.snapshots_built
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match key {
            SlotKey::Global(g) => PortSnapshot {
                exists: self.by_global.contains_key(g),
                opaque: false,
                endpoints: self.local_union(g, port).into(),
            },
            SlotKey::Endpoint(addr) => {
                let found = self.services.values().find_map(|svc| {
                    let ep = svc
                        .endpoints
                        .iter()
                        .find(|e| e.address == *addr && e.ready)?;
                    let port = ep.port.unwrap_or(svc.ports[0].port);
                    let opaque = svc.ports.iter().any(|p| p.port == port && p.opaque);
                    Some(meta_of(ep, opaque, &self.cluster))
                });
                match found {
                    Some(meta) => PortSnapshot {
                        exists: true,
                        opaque: meta.opaque,
                        endpoints: BTreeMap::from([(*addr, meta)]).into(),
                    },
                    None => PortSnapshot::default(),
                }
            }
            SlotKey::Service(k) => {
                let Some(svc) = self.services.get(k) else {
                    return PortSnapshot::default();
                };
                let Some(spec) = svc.ports.iter().find(|p| p.port == port) else {
                    return PortSnapshot::default();
                };
                let Some(global) = &svc.global_id else {
                    return PortSnapshot {
                        exists: true,
                        opaque: spec.opaque,
                        endpoints: ready_endpoints(svc, port, &self.cluster).into(),
                    };
                };
                let mut endpoints = self.local_union(global, port);
                for meta in endpoints.values_mut() {
                    meta.tier = Some(0);
                }
                let balanced = svc.mode.unwrap_or_default() == MulticlusterMode::Balanced;
                endpoints.extend(self.remote_tiers(global, port, balanced));
                PortSnapshot {
                    exists: true,
                    opaque: spec.opaque,
                    endpoints: endpoints.into(),
                }
            }
        }
    }

    /// The gateways of every linked cluster that has ready endpoints for
    /// `global`, each in its link's priority tier — except that `balanced`
    /// blends the best of them into tier 0, with the local endpoints.
    fn remote_tiers(
        &self,
        global: &str,
        port: u16,
        balanced: bool,
    ) -> BTreeMap<SocketAddr, EndpointMeta> {
        let ready = |r: &RemoteCluster| r.ready.get(global).copied().unwrap_or(0);
        let best = self
            .remotes
            .values()
            .filter(|r| ready(r) > 0)
            .map(|r| r.priority)
            .min();
        self.remotes
            .iter()
            .filter(|(_, r)| ready(r) > 0)
            .map(|(name, r)| {
                let tier = if balanced && Some(r.priority) == best {
                    0
                } else {
                    r.priority
                };
                (
                    r.gateway,
                    EndpointMeta {
                        weight: ready(r),
                        identity: r.gateway_identity.as_deref().map(Into::into),
                        zone: None,
                        meshed: true,
                        opaque: false,
                        name: Some(format!("gateway.{name}").into()),
                        cluster: Some(name.clone()),
                        authority_override: Some(format!("{global}.global:{port}")),
                        tier: Some(tier),
                    },
                )
            })
            .collect()
    }

    /// Publishes a local service's change to its slots from what changed,
    /// each slot's new state made from its previous one: a change to a few
    /// endpoints of a large service costs those endpoints.
    fn republish_changes(
        &mut self,
        key: &ServiceKey,
        changes: &EndpointChanges,
        observed_at: Instant,
    ) {
        let slot_key = SlotKey::Service(key.clone());
        let Some(state) = self.services.get(key) else {
            return;
        };
        let Some(ports) = self.slots.get_mut(&slot_key) else {
            return;
        };
        for (port, slot) in ports.iter_mut() {
            let Some(spec) = state.ports.iter().find(|p| p.port == *port) else {
                continue; // a port it does not have, before and after
            };
            let serves = |ep: &&EndpointSpec| ep.ready && ep.port.is_none_or(|p| p == *port);
            let set_changes: Vec<SetChange> = changes
                .removed
                .iter()
                .filter(serves)
                .map(|ep| SetChange::Remove(ep.address))
                .chain(changes.added.iter().filter(serves).map(|ep| {
                    SetChange::Insert(ep.address, meta_of(ep, spec.opaque, &self.cluster))
                }))
                .collect();
            if set_changes.is_empty() {
                continue;
            }
            let snap = {
                let current = &slot.borrow().snap;
                PortSnapshot {
                    endpoints: current.endpoints.with_changes(set_changes),
                    ..current.clone()
                }
            };
            // A local service's endpoints have no tiers.
            publish_as(slot, snap, observed_at, Published::one_tier);
        }
        ports.retain(|_, slot| slot.receiver_count() > 0);
        if ports.is_empty() {
            self.slots.remove(&slot_key);
        }
    }

    fn republish(&mut self, keys: &[SlotKey], observed_at: Instant) {
        for key in keys {
            let Some(ports) = self.slots.get(key) else {
                continue;
            };
            let ports: Vec<u16> = ports.keys().copied().collect();
            for port in ports {
                let snap = self.snapshot(key, port);
                if let Some(slot) = self.slots.get_mut(key).and_then(|p| p.get_mut(&port)) {
                    publish(slot, snap, observed_at);
                }
            }
            // Forget slots nobody watches; they are rebuilt on demand.
            if let Some(p) = self.slots.get_mut(key) {
                p.retain(|_, slot| slot.receiver_count() > 0);
                if p.is_empty() {
                    self.slots.remove(key);
                }
            }
        }
    }
}

/// Gives back the memory of a map that shrank to a quarter of its capacity
/// (after a burst of subscriptions, say), at an amortised constant cost.
pub(crate) fn shrink_map<K: Eq + std::hash::Hash, V>(map: &mut HashMap<K, V>) {
    if map.capacity() > 64 && map.len() * 4 < map.capacity() {
        map.shrink_to(map.len() * 2);
    }
}

/// Replaces a slot's state if it differs; never waits on readers.
fn publish(slot: &mut Slot, snap: PortSnapshot, observed_at: Instant) {
    publish_as(slot, snap, observed_at, Published::new);
}

/// [`publish`], the new state made by `make`.
fn publish_as(
    slot: &mut Slot,
    snap: PortSnapshot,
    observed_at: Instant,
    make: fn(u64, Instant, PortSnapshot) -> Published,
) {
    slot.send_if_modified(|cur| {
        if cur.snap == snap {
            return false;
        }
        *cur = Arc::new(make(cur.version + 1, observed_at, snap));
        true
    });
}

fn meta_of(ep: &EndpointSpec, opaque: bool, cluster: &str) -> EndpointMeta {
    EndpointMeta {
        weight: ep.weight,
        identity: ep.identity.clone(),
        zone: ep.zone.clone(),
        meshed: ep.meshed,
        opaque,
        name: ep.name.clone(),
        cluster: (!cluster.is_empty()).then(|| cluster.to_string()),
        authority_override: None,
        tier: None,
    }
}

/// What changed in a local service's endpoints, when nothing else its
/// slots show changed, so they can be updated from it; `None` when they
/// must be rebuilt.
fn endpoint_changes(old: &ServiceState, new: &ServiceState) -> Option<EndpointChanges> {
    if old.global_id.is_some() || new.global_id.is_some() || old.ports != new.ports {
        return None;
    }
    new.endpoints.changes_from(&old.endpoints)
}

/// A service's ready endpoints serving `port`.
fn ready_endpoints(
    svc: &ServiceState,
    port: u16,
    cluster: &str,
) -> BTreeMap<SocketAddr, EndpointMeta> {
    let Some(spec) = svc.ports.iter().find(|p| p.port == port) else {
        return BTreeMap::new();
    };
    svc.endpoints
        .iter()
        .filter(|ep| ep.ready && ep.port.is_none_or(|p| p == port))
        .map(|ep| (ep.address, meta_of(ep, spec.opaque, cluster)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn endpoint(addr: &str, ready: bool) -> EndpointSpec {
        EndpointSpec {
            ready,
            ..EndpointSpec::new(addr.parse().unwrap())
        }
    }

    fn service(endpoints: Vec<EndpointSpec>) -> ServiceState {
        ServiceState::new(vec![PortSpec::http(80)]).with_endpoints(endpoints)
    }

    /// Random lists of shared parts (parts kept, dropped, swapped or
    /// inserted; endpoints moving unchanged between parts; distinct or
    /// not; with a global id or not; services removed) given to the index
    /// for two services: after every step each workload, looked up and
    /// watched, is what a fresh index gives. Written as a hostile review
    /// of the index's workload updates from the changed parts' names.
    #[test]
    fn incremental_workloads_match_a_fresh_index() {
        type Part = Arc<[EndpointSpec]>;
        for seed in 1..800u64 {
            let mut next = crate::test_rng(0x1234_5678 ^ (seed * 0x9e37_79b9));
            let keys = [
                ServiceKey::new("web", "demo"),
                ServiceKey::new("api", "demo"),
            ];
            let names = ["p0", "p1", "p2"];
            let index = Index::new(ControlMetrics::default());
            let watches: Vec<_> = names
                .iter()
                .map(|n| {
                    index.watch_workload(&WorkloadKey {
                        namespace: "demo".into(),
                        name: n.to_string(),
                    })
                })
                .collect();
            let mut current: Vec<Option<(Vec<Part>, bool, bool)>> = vec![None, None];
            let mut log = Vec::new();
            for step in 0..40 {
                let s = next(2) as usize;
                let new = if next(8) == 0 {
                    None
                } else {
                    let old_parts = current[s].as_ref().map(|c| c.0.clone()).unwrap_or_default();
                    let mut parts: Vec<Part> =
                        old_parts.iter().filter(|_| next(3) != 0).cloned().collect();
                    if next(6) == 0 && parts.len() > 1 {
                        parts.swap(0, 1);
                    }
                    let dropped: Vec<EndpointSpec> = old_parts
                        .iter()
                        .filter(|p| !parts.iter().any(|q| Arc::ptr_eq(p, q)))
                        .flat_map(|p| p.iter().cloned())
                        .collect();
                    let mut used: HashSet<SocketAddr> = parts
                        .iter()
                        .flat_map(|p| p.iter().map(|e| e.address))
                        .collect();
                    let kept: usize = parts.iter().map(|p| p.len()).sum();
                    let distinct = next(6) != 0 && used.len() == kept;
                    for _ in 0..next(3) {
                        let mut eps = Vec::new();
                        for _ in 0..next(4) {
                            let ep = if !dropped.is_empty() && next(2) == 0 {
                                dropped[next(dropped.len() as u64) as usize].clone()
                            } else {
                                EndpointSpec {
                                    name: (next(4) != 0).then(|| names[next(3) as usize].into()),
                                    labels: Arc::new(
                                        [(
                                            "v".to_string(),
                                            ["a", "b", "c"][next(3) as usize].to_string(),
                                        )]
                                        .into(),
                                    ),
                                    ..endpoint(&format!("10.0.0.{}:80", 1 + next(10)), true)
                                }
                            };
                            if distinct && !used.insert(ep.address) {
                                continue;
                            }
                            eps.push(ep);
                        }
                        let at = next(parts.len() as u64 + 1) as usize;
                        parts.insert(at, eps.into());
                    }
                    let global = next(10) == 0;
                    Some((parts, distinct, global))
                };
                let to_state = |c: &(Vec<Part>, bool, bool)| ServiceState {
                    endpoints: EndpointList::parts(c.0.clone(), c.1),
                    global_id: c.2.then(|| "g".to_string()),
                    ..ServiceState::new(vec![PortSpec::http(80)])
                };
                log.push((s, new.as_ref().map(|c| (c.0.clone(), c.1, c.2))));
                index.set_service(&keys[s], new.as_ref().map(to_state));
                current[s] = new;
                let fresh = Index::new(ControlMetrics::default());
                for (k, c) in keys.iter().zip(&current) {
                    fresh.set_service(k, c.as_ref().map(to_state));
                }
                for (n, w) in names.iter().zip(&watches) {
                    let key = WorkloadKey {
                        namespace: "demo".into(),
                        name: n.to_string(),
                    };
                    let want = fresh.workload(&key);
                    assert_eq!(
                        index.workload(&key),
                        want,
                        "seed {seed} step {step} {n}: {log:?}"
                    );
                    assert_eq!(*w.borrow(), want, "watched: seed {seed} step {step} {n}");
                }
                assert_eq!(
                    index.workload_shares(),
                    fresh.workload_shares(),
                    "shares: seed {seed} step {step}: {log:?}"
                );
            }
        }
    }

    /// A name's workload takes the labels of its first listing. An
    /// endpoint that moves, unchanged, from a part before another listing
    /// of its name to a part after it is in no list of endpoints removed
    /// or added, yet moves the first listing: the index must look at
    /// every name the changed parts list.
    #[test]
    fn a_name_whose_first_listing_moves_takes_that_listings_labels() {
        let index = Index::new(ControlMetrics::default());
        let key = ServiceKey::new("web", "demo");
        let named = |addr: &str, version: &str| EndpointSpec {
            name: Some("pod-1".into()),
            labels: Arc::new([("version".to_string(), version.to_string())].into()),
            ..endpoint(addr, true)
        };
        let part = |eps: Vec<EndpointSpec>| -> Arc<[EndpointSpec]> { eps.into() };
        let state = |parts| ServiceState {
            endpoints: EndpointList::distinct_parts(parts),
            ..ServiceState::new(vec![PortSpec::http(80)])
        };
        let (first, other) = (
            part(vec![named("10.0.0.1:80", "a")]),
            part(vec![named("10.0.0.2:80", "b")]),
        );
        let moved = part(vec![named("10.0.0.1:80", "a")]);
        let workload = WorkloadKey {
            namespace: "demo".into(),
            name: "pod-1".into(),
        };
        let version = |index: &Index| index.workload(&workload)?.get("version").cloned();
        let watching = index.watch_workload(&workload);
        index.set_service(&key, Some(state(vec![first, other.clone()])));
        assert_eq!(version(&index).as_deref(), Some("a"));
        index.set_service(&key, Some(state(vec![other, moved])));
        assert_eq!(version(&index).as_deref(), Some("b"));
        let watched = watching
            .borrow()
            .as_ref()
            .and_then(|l| l.get("version").cloned());
        assert_eq!(watched.as_deref(), Some("b"));
    }

    /// Joining a slot that exists costs no snapshot: its state is there
    /// (each subscriber of a 100,000-endpoint service once rebuilt it).
    #[test]
    fn subscribers_of_an_existing_slot_share_its_state() {
        let index = Index::new(ControlMetrics::default());
        let key = ServiceKey::new("web", "demo");
        index.set_service(&key, Some(service(vec![endpoint("127.0.0.1:1", true)])));
        let slot = SlotKey::Service(key.clone());
        let first = index.subscribe(&slot, 80);
        let before = index.snapshots_built();
        let others: Vec<_> = (0..3).map(|_| index.subscribe(&slot, 80)).collect();
        assert_eq!(index.snapshots_built(), before);
        for other in &others {
            assert!(Arc::ptr_eq(&other.borrow(), &first.borrow()));
        }
    }

    /// A service in parts, the way the file registry hands it over: a
    /// change to one part is published from what changed (no snapshot
    /// built), and every slot ends where a full rebuild would put it,
    /// over a seeded random sequence of changes — endpoints in and out,
    /// weights, readiness, per-port listings, names and labels, parts
    /// added and removed, and now and then a port change, which rebuilds.
    #[test]
    fn slots_updated_from_changes_match_a_full_rebuild() {
        let index = Index::new(ControlMetrics::default());
        let key = ServiceKey::new("web", "demo");
        let mut next = crate::test_rng(0x853c_49e6_748f_ea9b);
        let mut serial = 0u32;
        // Only the first two parts name their endpoints: a change to the
        // others leaves the service's workloads as they were.
        let mut fresh = |next: &mut dyn FnMut(u64) -> u64, part: usize| {
            serial += 1;
            EndpointSpec {
                port: [None, Some(80), Some(81)][next(3) as usize],
                ready: next(5) != 0,
                weight: 1 + next(3) as u32,
                name: (part < 2 && next(4) == 0).then(|| format!("pod-{}", next(20)).into()),
                labels: Arc::new([("v".to_string(), next(3).to_string())].into()),
                ..EndpointSpec::new(SocketAddr::from((
                    [10, 0, (serial >> 8) as u8, serial as u8],
                    8080,
                )))
            }
        };
        let mut parts: Vec<Vec<EndpointSpec>> = (0..6)
            .map(|part| (0..next(700)).map(|_| fresh(&mut next, part)).collect())
            .collect();
        let mut shared: Vec<Arc<[EndpointSpec]>> = parts.iter().map(|p| p.clone().into()).collect();
        let ports = |two: bool| {
            let mut ports = vec![PortSpec::http(80)];
            if two {
                ports.push(PortSpec::http(81));
            }
            ports
        };
        let mut two_ports = true;
        let state = |shared: &[Arc<[EndpointSpec]>], two: bool| ServiceState {
            endpoints: EndpointList::distinct_parts(shared.to_vec()),
            ..ServiceState::new(ports(two))
        };
        index.set_service(&key, Some(state(&shared, two_ports)));
        let slot = SlotKey::Service(key.clone());
        let watchers = [index.subscribe(&slot, 80), index.subscribe(&slot, 81)];
        let workload = WorkloadKey {
            namespace: "demo".into(),
            name: "pod-7".into(),
        };
        let labels = index.watch_workload(&workload);
        let mut incremental = 0;
        for round in 0..300 {
            let i = next(parts.len() as u64) as usize;
            let port_change = next(40) == 0;
            match next(8) {
                0 => parts[i].clear(),
                1 => parts[i].extend((0..next(300)).map(|_| fresh(&mut next, i))),
                _ => {
                    for _ in 0..1 + next(3) {
                        if parts[i].is_empty() {
                            break;
                        }
                        let at = next(parts[i].len() as u64) as usize;
                        match next(4) {
                            0 => {
                                parts[i].remove(at);
                            }
                            1 => parts[i][at].weight += 1,
                            2 => parts[i][at].ready = !parts[i][at].ready,
                            _ => {
                                let ep = fresh(&mut next, i);
                                parts[i].push(ep)
                            }
                        }
                    }
                }
            }
            shared[i] = parts[i].clone().into();
            two_ports ^= port_change;
            let before = index.snapshots_built();
            index.set_service(&key, Some(state(&shared, two_ports)));
            if !port_change {
                assert_eq!(
                    index.snapshots_built(),
                    before,
                    "round {round}: a snapshot was built"
                );
                incremental += 1;
            }
            for port in [80, 81] {
                let (_, agrees) = index.check_slot(&slot, port);
                assert!(
                    agrees,
                    "round {round}, port {port}: the slot differs from a rebuild"
                );
            }
            let first_listed = parts
                .iter()
                .flatten()
                .find(|ep| ep.name.as_deref() == Some("pod-7"))
                .map(|ep| (*ep.labels).clone());
            assert_eq!(*labels.borrow(), first_listed, "round {round}");
        }
        assert!(incremental > 250);
        drop(watchers);
    }

    #[test]
    fn slots_follow_the_service() {
        let index = Index::new(ControlMetrics::default());
        let key = ServiceKey::new("web", "demo");
        let mut rx = index.subscribe(&SlotKey::Service(key.clone()), 80);
        assert!(!rx.borrow_and_update().snap.exists);

        index.set_service(
            &key,
            Some(service(vec![
                endpoint("127.0.0.1:1", true),
                endpoint("127.0.0.1:2", false),
            ])),
        );
        assert!(rx.has_changed().unwrap());
        let published = rx.borrow_and_update().clone();
        assert_eq!(published.version, 1);
        let snap = &published.snap;
        assert!(snap.exists);
        assert_eq!(
            snap.endpoints.keys().map(|a| a.port()).collect::<Vec<_>>(),
            vec![1]
        );

        // The same state again is not a change.
        index.set_service(
            &key,
            Some(service(vec![
                endpoint("127.0.0.1:1", true),
                endpoint("127.0.0.1:2", false),
            ])),
        );
        assert!(!rx.has_changed().unwrap());

        index.set_service(&key, None);
        assert!(!rx.borrow_and_update().snap.exists);
        // A port the service does not declare does not exist.
        index.set_service(&key, Some(service(vec![])));
        assert!(
            !index
                .subscribe(&SlotKey::Service(key.clone()), 81)
                .borrow()
                .snap
                .exists
        );
    }

    fn global(mode: MulticlusterMode, endpoints: Vec<EndpointSpec>) -> ServiceState {
        ServiceState {
            global_id: Some("web-global".into()),
            mode: Some(mode),
            ..service(endpoints)
        }
    }

    fn remote(priority: u32, port: u16, ready: u32) -> RemoteCluster {
        RemoteCluster {
            priority,
            gateway: SocketAddr::from(([10, 9, 9, 9], port)),
            gateway_identity: Some("gateway.x".into()),
            ready: BTreeMap::from([("web-global".to_string(), ready)]),
        }
    }

    /// Two services claiming one cluster IP (a registry mid-update, a
    /// misconfiguration): every replica resolves it to the same one, the
    /// first by name, whatever its map's order.
    #[test]
    fn a_cluster_ip_two_services_claim_resolves_the_same_on_every_replica() {
        let addr: SocketAddr = "10.96.0.10:80".parse().unwrap();
        let claiming = || ServiceState {
            cluster_ip: Some(addr.ip()),
            ..service(Vec::new())
        };
        for _ in 0..32 {
            let index = Index::new(ControlMetrics::default());
            index.set_service(&ServiceKey::new("web", "b"), Some(claiming()));
            index.set_service(&ServiceKey::new("web", "a"), Some(claiming()));
            assert_eq!(
                index.resolve_ip(addr),
                SlotKey::Service(ServiceKey::new("web", "a"))
            );
        }
    }

    /// What a client that does not read tiers is sent.
    fn ports_of(index: &Index, key: &ServiceKey) -> Vec<u16> {
        index
            .snapshot(&SlotKey::Service(key.clone()), 80)
            .best_tier()
            .endpoints
            .keys()
            .map(|a| a.port())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect()
    }

    /// (port, tier) of everything a client that reads tiers is sent.
    fn tiers_of(index: &Index, key: &ServiceKey) -> Vec<(u16, u32)> {
        let mut out: Vec<(u16, u32)> = index
            .snapshot(&SlotKey::Service(key.clone()), 80)
            .endpoints
            .iter()
            .map(|(a, m)| (a.port(), m.tier.unwrap()))
            .collect();
        out.sort();
        out
    }

    #[test]
    fn global_ids_join_services_and_modes_pick_remotes() {
        let index = Index::new(ControlMetrics::default());
        let a = ServiceKey::new("web", "east");
        let b = ServiceKey::new("frontend", "shop");
        index.set_service(
            &a,
            Some(global(
                MulticlusterMode::Failover,
                vec![endpoint("127.0.0.1:1", true)],
            )),
        );
        index.set_service(
            &b,
            Some(global(
                MulticlusterMode::Balanced,
                vec![endpoint("127.0.0.1:2", true)],
            )),
        );
        // Different names and namespaces, one logical service.
        assert_eq!(ports_of(&index, &a), vec![1, 2]);
        assert_eq!(index.exported()["web-global"], 2);

        index.set_remote("west", Some(remote(1, 4001, 3)));
        index.set_remote("north", Some(remote(2, 4002, 5)));
        // Failover: local is healthy, nothing remote.
        assert_eq!(ports_of(&index, &a), vec![1, 2]);
        // ...though a client that reads tiers knows both remotes in advance.
        assert_eq!(
            tiers_of(&index, &a),
            vec![(1, 0), (2, 0), (4001, 1), (4002, 2)]
        );
        // Balanced: local plus the best remote tier, weighted by ready count.
        assert_eq!(
            tiers_of(&index, &b),
            vec![(1, 0), (2, 0), (4001, 0), (4002, 2)]
        );
        let full = index.snapshot(&SlotKey::Service(b.clone()), 80);
        let snap = full.best_tier();
        let mut ports: Vec<u16> = snap.endpoints.keys().map(|a| a.port()).collect();
        ports.sort();
        assert_eq!(ports, vec![1, 2, 4001]);
        let gw = &snap.endpoints[&SocketAddr::from(([10, 9, 9, 9], 4001))];
        assert_eq!(gw.weight, 3);
        assert_eq!(gw.cluster.as_deref(), Some("west"));
        assert_eq!(
            gw.authority_override.as_deref(),
            Some("web-global.global:80")
        );

        // Every local replica gone: failover goes to the best tier...
        index.set_service(
            &a,
            Some(global(
                MulticlusterMode::Failover,
                vec![endpoint("127.0.0.1:1", false)],
            )),
        );
        index.set_service(&b, None);
        assert_eq!(ports_of(&index, &a), vec![4001]);
        // ...and to the next tier when the best has nothing ready.
        index.set_remote("west", Some(remote(1, 4001, 0)));
        assert_eq!(ports_of(&index, &a), vec![4002]);
        index.set_remote("north", None);
        assert!(ports_of(&index, &a).is_empty());
        // The gateway's view is local only.
        index.set_service(
            &a,
            Some(global(
                MulticlusterMode::Failover,
                vec![endpoint("127.0.0.1:1", true)],
            )),
        );
        index.set_remote("west", Some(remote(1, 4001, 3)));
        let local = index.snapshot(&SlotKey::Global("web-global".into()), 80);
        assert_eq!(
            local.endpoints.keys().map(|a| a.port()).collect::<Vec<_>>(),
            vec![1]
        );
    }

    #[test]
    fn unwatched_slots_are_collected() {
        let index = Index::new(ControlMetrics::default());
        let key = ServiceKey::new("web", "demo");
        drop(index.subscribe(&SlotKey::Service(key), 80));
        index.collect_garbage();
        assert!(index.inner.lock().unwrap().slots.is_empty());
    }

    /// `Shares` answers as the map it replaced, over random inserts,
    /// replacements and removals, in service order (the merge's first
    /// service wins). (From a hostile review.)
    #[test]
    fn shares_answer_as_a_map_does() {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let names = ["a", "b", "web", "web-2", "z", ""];
        for _ in 0..200 {
            let (mut shares, mut map) = (Shares::default(), BTreeMap::new());
            for _ in 0..60 {
                let key =
                    ServiceKey::new(names[next(6) as usize], ["ns", "ns2", ""][next(3) as usize]);
                if next(3) == 0 {
                    shares.remove(&key);
                    map.remove(&key);
                } else {
                    let labels = [
                        ("k".to_string(), next(4).to_string()),
                        (next(3).to_string(), "v".into()),
                    ];
                    let share = Share {
                        labels: Arc::new(labels.into()),
                        listings: next(5) as u32,
                    };
                    shares.insert(key.clone(), share.clone());
                    map.insert(key.clone(), share);
                }
                let listed: Vec<_> = shares.iter().collect();
                let want: Vec<_> = map.iter().collect();
                assert_eq!(listed, want);
                assert_eq!(shares.is_empty(), map.is_empty());
                for k in map.keys() {
                    assert_eq!(shares.get(k), map.get(k));
                }
            }
        }
    }
}
