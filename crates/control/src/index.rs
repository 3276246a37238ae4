//! The in-memory index: service → port → endpoint set, with one
//! latest-state slot per subscribed (service, port).
//!
//! A slot is a `tokio::sync::watch` channel: writing replaces the value and
//! never waits, readers always see the newest value. That is the whole
//! fan-out contract: the index never blocks on a subscriber, and a slow
//! subscriber skips intermediate states but converges on the latest.
//! The lock is a plain mutex held only for map updates, never across an
//! `.await`.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tether_core::authority::ServiceKey;
use tether_core::registry::{EndpointSpec, MulticlusterMode, PortSpec};
use tokio::sync::watch;

use crate::metrics::{ControlMetrics, ServiceLabels};

/// A whole service as a registry backend sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceState {
    pub ports: Vec<PortSpec>,
    pub global_id: Option<String>,
    pub mode: Option<MulticlusterMode>,
    pub endpoints: Vec<EndpointSpec>,
}

/// What a subscriber to one (service, port) is told about an endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointMeta {
    pub weight: u32,
    pub identity: Option<String>,
    pub zone: Option<String>,
    pub meshed: bool,
    pub opaque: bool,
    pub name: Option<String>,
}

/// The current state of one (service, port): only ready endpoints.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct PortSnapshot {
    pub exists: bool,
    pub opaque: bool,
    pub endpoints: BTreeMap<SocketAddr, EndpointMeta>,
}

/// What a slot holds: the state, which version of the slot it is, and when
/// the registry change behind it was observed (for the change-to-send
/// latency histogram).
#[derive(Clone, Debug)]
pub struct Published {
    pub version: u64,
    pub observed_at: Instant,
    pub snap: PortSnapshot,
}

pub type SlotReceiver = watch::Receiver<Arc<Published>>;
type Slot = watch::Sender<Arc<Published>>;

#[derive(Default)]
struct Inner {
    services: HashMap<ServiceKey, ServiceState>,
    slots: HashMap<ServiceKey, HashMap<u16, Slot>>,
}

#[derive(Clone)]
pub struct Index {
    inner: Arc<Mutex<Inner>>,
    metrics: ControlMetrics,
}

impl Index {
    pub fn new(metrics: ControlMetrics) -> Self {
        Self {
            inner: Arc::default(),
            metrics,
        }
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
        let old_endpoints = inner.services.get(key).map_or(0, |s| s.endpoints.len());
        let new_endpoints = state.as_ref().map_or(0, |s| s.endpoints.len());
        let labels = ServiceLabels {
            service: key.to_string(),
        };
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
        self.metrics
            .registry_endpoints
            .inc_by(new_endpoints as i64 - old_endpoints as i64);
        let Inner { services, slots } = &mut *inner;
        if let Some(ports) = slots.get_mut(key) {
            ports.retain(|port, slot| {
                publish(slot, snapshot_of(services.get(key), *port), observed_at);
                // Forget slots nobody watches; they are rebuilt on demand.
                slot.receiver_count() > 0
            });
            if ports.is_empty() {
                slots.remove(key);
            }
        }
    }

    /// Subscribes to one (service, port); the receiver holds the current
    /// state at once.
    pub fn subscribe(&self, key: &ServiceKey, port: u16) -> SlotReceiver {
        let mut inner = self.inner.lock().unwrap();
        let Inner { services, slots } = &mut *inner;
        let slot = slots
            .entry(key.clone())
            .or_default()
            .entry(port)
            .or_insert_with(|| {
                watch::Sender::new(Arc::new(Published {
                    version: 0,
                    observed_at: Instant::now(),
                    snap: snapshot_of(services.get(key), port),
                }))
            });
        slot.subscribe()
    }

    /// The index's state for (service, port), and the slot's version
    /// and whether the slot agrees with the index. Publishes the index's
    /// state into the slot when it does not (a repair).
    pub fn check_slot(&self, key: &ServiceKey, port: u16) -> (PortSnapshot, u64, bool) {
        let mut inner = self.inner.lock().unwrap();
        let Inner { services, slots } = &mut *inner;
        let snap = snapshot_of(services.get(key), port);
        match slots.get_mut(key).and_then(|p| p.get_mut(&port)) {
            Some(slot) => {
                let agrees = slot.borrow().snap == snap;
                if !agrees {
                    publish(slot, snap.clone(), Instant::now());
                }
                (snap, slot.borrow().version, agrees)
            }
            None => (snap, 0, true),
        }
    }

    pub fn snapshot(&self, key: &ServiceKey, port: u16) -> PortSnapshot {
        snapshot_of(self.inner.lock().unwrap().services.get(key), port)
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
                    return Some((key.clone(), port, meta_of(ep, opaque)));
                }
            }
        }
        None
    }

    /// Drops slots that no subscriber watches any more.
    pub fn collect_garbage(&self) {
        let mut inner = self.inner.lock().unwrap();
        inner.slots.retain(|_, ports| {
            ports.retain(|_, slot| slot.receiver_count() > 0);
            !ports.is_empty()
        });
    }
}

/// Replaces a slot's state if it differs; never waits on readers.
fn publish(slot: &mut Slot, snap: PortSnapshot, observed_at: Instant) {
    slot.send_if_modified(|cur| {
        if cur.snap == snap {
            return false;
        }
        *cur = Arc::new(Published {
            version: cur.version + 1,
            observed_at,
            snap,
        });
        true
    });
}

fn meta_of(ep: &EndpointSpec, opaque: bool) -> EndpointMeta {
    EndpointMeta {
        weight: ep.weight,
        identity: ep.identity.clone(),
        zone: ep.zone.clone(),
        meshed: ep.meshed,
        opaque,
        name: ep.name.clone(),
    }
}

/// What subscribers of (service, port) are told: its ready endpoints.
pub fn snapshot_of(service: Option<&ServiceState>, port: u16) -> PortSnapshot {
    let Some(svc) = service else {
        return PortSnapshot::default();
    };
    let Some(spec) = svc.ports.iter().find(|p| p.port == port) else {
        return PortSnapshot::default();
    };
    let endpoints = svc
        .endpoints
        .iter()
        .filter(|ep| ep.ready && ep.port.is_none_or(|p| p == port))
        .map(|ep| (ep.address, meta_of(ep, spec.opaque)))
        .collect();
    PortSnapshot {
        exists: true,
        opaque: spec.opaque,
        endpoints,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn endpoint(addr: &str, ready: bool) -> EndpointSpec {
        EndpointSpec {
            address: addr.parse().unwrap(),
            port: None,
            ready,
            identity: None,
            zone: None,
            weight: 1,
            meshed: true,
            name: None,
        }
    }

    fn service(endpoints: Vec<EndpointSpec>) -> ServiceState {
        ServiceState {
            ports: vec![PortSpec {
                port: 80,
                opaque: false,
            }],
            global_id: None,
            mode: None,
            endpoints,
        }
    }

    #[test]
    fn slots_follow_the_service() {
        let index = Index::new(ControlMetrics::default());
        let key = ServiceKey::new("web", "demo");
        let mut rx = index.subscribe(&key, 80);
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
        assert!(!index.subscribe(&key, 81).borrow().snap.exists);
    }

    #[test]
    fn unwatched_slots_are_collected() {
        let index = Index::new(ControlMetrics::default());
        let key = ServiceKey::new("web", "demo");
        drop(index.subscribe(&key, 80));
        index.collect_garbage();
        assert!(index.inner.lock().unwrap().slots.is_empty());
    }
}
