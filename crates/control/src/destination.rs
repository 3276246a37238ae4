//! `io.linkerd.proxy.destination.Destination`: endpoint discovery streams.
//!
//! Each `Get` gets its own task. The task reads the latest state of its
//! (service, port) slot and sends the diff between what it last sent and that
//! state ([`SentState::diff`]); while it is blocked sending to a slow client,
//! newer states simply replace older ones in the slot. When it catches up it
//! sends one diff to the current state, never a backlog. The outgoing channel
//! per subscriber is small and bounded.
//!
//! Every live subscription is also registered in [`Subscriptions`], with
//! what it was last sent and from which slot version. The audit
//! ([`Subscriptions::audit`]) compares that with the index: a subscription
//! that is idle, has sent the slot's latest version, and still differs from
//! the index is divergent; so is a slot that differs from the index. Both
//! are repaired (the slot republished, the subscription woken to send the
//! correcting diff) and counted.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt};
use linkerd2_proxy_api::destination::{
    self as api, destination_server::Destination, protocol_hint, tls_identity, update,
    DestinationProfile, GetDestination, ProtocolHint, RetryBudget, TlsIdentity, Update,
    WeightedAddr, WeightedAddrSet,
};
use linkerd2_proxy_api::net::TcpAddress;
use tether_admin::Shutdown;
use tether_core::authority::{parse_service_authority, split_host_port};
use tokio::sync::{mpsc, Notify};
use tonic::{Request, Response, Status};

use crate::index::{EndpointMeta, Index, PortSnapshot, SlotKey, SlotReceiver};
use crate::metrics::{ControlMetrics, ServiceLabels};

/// Updates buffered per subscriber before its task waits (on that
/// subscriber alone).
const SUBSCRIBER_BUFFER: usize = 4;

pub type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[derive(Clone)]
pub struct DestinationService {
    pub index: Index,
    pub cluster_domain: String,
    pub metrics: ControlMetrics,
    pub shutdown: Shutdown,
    pub subscriptions: Subscriptions,
}

// === impl Subscriptions ===

/// One live `Destination.Get` stream, as the audit sees it.
pub struct Subscription {
    pub service: SlotKey,
    pub port: u16,
    state: Mutex<SubState>,
    repair: Notify,
}

#[derive(Default)]
struct SubState {
    sent: SentState,
    /// The slot version `sent` corresponds to.
    version: u64,
    /// Whether updates computed from `version` are still being sent.
    sending: bool,
}

impl Subscription {
    #[cfg(test)]
    pub(crate) fn forget_what_was_sent(&self) {
        self.state.lock().unwrap().sent = SentState::default();
    }
}

/// Every live subscription, for the audit.
#[derive(Clone, Default)]
pub struct Subscriptions {
    live: Arc<Mutex<HashMap<u64, Arc<Subscription>>>>,
    next_id: Arc<AtomicU64>,
}

/// What one audit found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AuditReport {
    pub subscriptions: usize,
    /// Still sending a newer state: not divergent, just not done.
    pub in_flight: usize,
    pub divergent: usize,
    pub stale_slots: usize,
}

impl std::fmt::Display for AuditReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "audited {} subscriptions: {} divergent (repaired), {} catching up, {} stale slots (repaired)",
            self.subscriptions, self.divergent, self.in_flight, self.stale_slots
        )
    }
}

struct Registered {
    subs: Subscriptions,
    id: u64,
    metrics: ControlMetrics,
    labels: ServiceLabels,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.subs.live.lock().unwrap().remove(&self.id);
        self.metrics.subscribers.dec();
        self.metrics
            .subscribers_per_service
            .get_or_create(&self.labels)
            .dec();
    }
}

impl Subscriptions {
    fn register(
        &self,
        service: SlotKey,
        port: u16,
        metrics: &ControlMetrics,
    ) -> (Arc<Subscription>, Registered) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let labels = ServiceLabels {
            service: service.to_string(),
        };
        let sub = Arc::new(Subscription {
            service,
            port,
            state: Mutex::default(),
            repair: Notify::new(),
        });
        self.live.lock().unwrap().insert(id, sub.clone());
        metrics.subscribers.inc();
        metrics.subscribers_per_service.get_or_create(&labels).inc();
        let guard = Registered {
            subs: self.clone(),
            id,
            metrics: metrics.clone(),
            labels,
        };
        (sub, guard)
    }

    pub fn len(&self) -> usize {
        self.live.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Compares every live subscription with the index, repairs what
    /// diverged, and records the result in the metrics.
    pub fn audit(&self, index: &Index, metrics: &ControlMetrics) -> AuditReport {
        let subs: Vec<Arc<Subscription>> = self.live.lock().unwrap().values().cloned().collect();
        let mut report = AuditReport {
            subscriptions: subs.len(),
            ..Default::default()
        };
        let mut checked: HashMap<(SlotKey, u16), (PortSnapshot, u64)> = HashMap::new();
        for sub in subs {
            let (snap, version) = checked
                .entry((sub.service.clone(), sub.port))
                .or_insert_with(|| {
                    let (snap, version, agrees) = index.check_slot(&sub.service, sub.port);
                    if !agrees {
                        report.stale_slots += 1;
                    }
                    (snap, version)
                })
                .clone();
            let state = sub.state.lock().unwrap();
            if state.sending || state.version < version {
                report.in_flight += 1;
            } else if !state.sent.matches(&snap) {
                report.divergent += 1;
                drop(state);
                sub.repair.notify_one();
            }
        }
        metrics.audits.inc();
        metrics
            .divergent_subscriptions
            .set((report.divergent + report.stale_slots) as i64);
        metrics
            .audit_repairs
            .inc_by((report.divergent + report.stale_slots) as u64);
        if report.divergent + report.stale_slots > 0 {
            tracing::warn!(%report, "audit found divergent subscriptions");
        } else {
            tracing::debug!(%report, "audit clean");
        }
        report
    }
}

// === impl SentState ===

/// What one subscriber has been told so far.
#[derive(Default, Debug, Clone, PartialEq)]
pub struct SentState {
    endpoints: BTreeMap<SocketAddr, EndpointMeta>,
    /// `Some(exists)` when the last thing sent was `NoEndpoints`.
    no_endpoints: Option<bool>,
}

impl SentState {
    /// The updates that take this subscriber from what it was sent to
    /// `snap`, and records them as sent.
    pub fn diff(&mut self, snap: &PortSnapshot, service: &SlotKey) -> Vec<Update> {
        let mut out = Vec::new();
        let removed: Vec<SocketAddr> = self
            .endpoints
            .keys()
            .filter(|a| !snap.endpoints.contains_key(a))
            .copied()
            .collect();
        if !removed.is_empty() {
            for a in &removed {
                self.endpoints.remove(a);
            }
            out.push(Update {
                update: Some(update::Update::Remove(api::AddrSet {
                    addrs: removed.into_iter().map(TcpAddress::from).collect(),
                })),
            });
        }
        if snap.endpoints.is_empty() {
            if self.no_endpoints != Some(snap.exists) {
                self.no_endpoints = Some(snap.exists);
                out.push(Update {
                    update: Some(update::Update::NoEndpoints(api::NoEndpoints {
                        exists: snap.exists,
                    })),
                });
            }
            return out;
        }
        self.no_endpoints = None;
        let mut added = Vec::new();
        for (a, m) in &snap.endpoints {
            if self.endpoints.get(a) != Some(m) {
                self.endpoints.insert(*a, m.clone());
                added.push(weighted_addr(*a, m));
            }
        }
        if !added.is_empty() {
            out.push(Update {
                update: Some(update::Update::Add(WeightedAddrSet {
                    addrs: added,
                    metric_labels: match service {
                        SlotKey::Service(k) => HashMap::from([
                            ("service".to_string(), k.name.clone()),
                            ("namespace".to_string(), k.namespace.clone()),
                        ]),
                        SlotKey::Global(g) => HashMap::from([("global_id".to_string(), g.clone())]),
                        SlotKey::Endpoint(_) => HashMap::new(),
                    },
                })),
            });
        }
        out
    }

    /// Whether this subscriber's view equals `snap`.
    pub fn matches(&self, snap: &PortSnapshot) -> bool {
        self.endpoints == snap.endpoints
            && (!snap.endpoints.is_empty() || self.no_endpoints == Some(snap.exists))
    }
}

/// The wire form of one endpoint.
pub fn weighted_addr(addr: SocketAddr, meta: &EndpointMeta) -> WeightedAddr {
    let mut labels = HashMap::new();
    if let Some(zone) = &meta.zone {
        labels.insert("zone".to_string(), zone.clone());
    }
    if let Some(name) = &meta.name {
        labels.insert("pod".to_string(), name.clone());
    }
    if let Some(cluster) = &meta.cluster {
        labels.insert("cluster".to_string(), cluster.clone());
    }
    let tls_identity = meta.identity.as_ref().map(|id| TlsIdentity {
        strategy: Some(tls_identity::Strategy::DnsLikeIdentity(
            tls_identity::DnsLikeIdentity { name: id.clone() },
        )),
        server_name: Some(tls_identity::DnsLikeIdentity { name: id.clone() }),
    });
    let protocol_hint = match (meta.meshed, meta.opaque) {
        (true, false) => Some(ProtocolHint {
            protocol: Some(protocol_hint::Protocol::H2(protocol_hint::H2 {})),
            opaque_transport: None,
        }),
        (true, true) => Some(ProtocolHint {
            protocol: Some(protocol_hint::Protocol::Opaque(protocol_hint::Opaque {})),
            opaque_transport: Some(protocol_hint::OpaqueTransport {
                inbound_port: addr.port().into(),
            }),
        }),
        (false, true) => Some(ProtocolHint {
            protocol: Some(protocol_hint::Protocol::Opaque(protocol_hint::Opaque {})),
            opaque_transport: None,
        }),
        (false, false) => None,
    };
    WeightedAddr {
        addr: Some(addr.into()),
        weight: meta.weight,
        metric_labels: labels,
        tls_identity,
        protocol_hint,
        authority_override: meta.authority_override.as_ref().map(|a| {
            linkerd2_proxy_api::destination::AuthorityOverride {
                authority_override: a.clone(),
            }
        }),
        ..Default::default()
    }
}

/// Feeds one subscriber until it goes away or the control plane shuts down.
async fn serve_subscription(
    sub: Arc<Subscription>,
    mut slot: SlotReceiver,
    tx: mpsc::Sender<Result<Update, Status>>,
    metrics: ControlMetrics,
    shutdown: Shutdown,
    _registered: Registered,
) {
    loop {
        let published = slot.borrow_and_update().clone();
        let updates = {
            let mut state = sub.state.lock().unwrap();
            let updates = state.sent.diff(&published.snap, &sub.service);
            state.version = published.version;
            state.sending = !updates.is_empty();
            updates
        };
        for update in updates {
            tokio::select! {
                res = tx.send(Ok(update)) => if res.is_err() { return },
                _ = shutdown.triggered() => return,
            }
            metrics.updates_sent.inc();
            if published.version > 0 {
                metrics
                    .update_latency
                    .observe(published.observed_at.elapsed().as_secs_f64());
            }
        }
        sub.state.lock().unwrap().sending = false;
        tokio::select! {
            changed = slot.changed() => if changed.is_err() { return },
            _ = sub.repair.notified() => {}
            _ = tx.closed() => return,
            _ = shutdown.triggered() => return,
        }
    }
}

/// A stream that yields nothing and ends when the control plane shuts down,
/// so profile and policy streams stay open like a real controller's.
fn until_shutdown<T: Send + 'static>(
    shutdown: Shutdown,
) -> impl Stream<Item = Result<T, Status>> + Send {
    futures::stream::once(async move { shutdown.triggered().await }).filter_map(|_| async { None })
}

/// `<global-id>.global[:port]`: the local endpoints of a global id (what a
/// gateway resolves).
pub fn global_path(path: &str) -> Option<(String, u16)> {
    let (host, port) = split_host_port(path).ok()?;
    let g = host.strip_suffix(".global")?;
    (!g.is_empty()).then(|| (g.to_string(), port))
}

pub fn one_then_hold<T: Send + 'static>(item: T, shutdown: Shutdown) -> BoxStream<T> {
    Box::pin(futures::stream::once(async move { Ok(item) }).chain(until_shutdown(shutdown)))
}

impl DestinationService {
    /// Starts a subscription's sender task; updates arrive on the receiver.
    pub fn subscribe(
        &self,
        service: impl Into<SlotKey>,
        port: u16,
    ) -> mpsc::Receiver<Result<Update, Status>> {
        let service = service.into();
        let slot = self.index.subscribe(&service, port);
        let (sub, registered) = self.subscriptions.register(service, port, &self.metrics);
        let (tx, rx) = mpsc::channel(SUBSCRIBER_BUFFER);
        tokio::spawn(serve_subscription(
            sub,
            slot,
            tx,
            self.metrics.clone(),
            self.shutdown.clone(),
            registered,
        ));
        rx
    }

    fn profile_for(&self, path: &str) -> Result<DestinationProfile, Status> {
        let (host, port) =
            split_host_port(path).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let ip = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = ip.parse::<std::net::IpAddr>() {
            let addr = SocketAddr::new(ip, port);
            return Ok(match self.index.find_endpoint(addr) {
                Some((_, _, meta)) => DestinationProfile {
                    opaque_protocol: meta.opaque,
                    endpoint: Some(weighted_addr(addr, &meta)),
                    ..Default::default()
                },
                None => DestinationProfile::default(),
            });
        }
        if let Some((global, _)) = global_path(path) {
            return Ok(DestinationProfile {
                fully_qualified_name: format!("{global}.global"),
                ..Default::default()
            });
        }
        let auth = parse_service_authority(path, &self.cluster_domain)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok(DestinationProfile {
            fully_qualified_name: auth.service.fqdn(&self.cluster_domain),
            opaque_protocol: self
                .index
                .snapshot(&SlotKey::Service(auth.service.clone()), auth.port)
                .opaque,
            // Only a registry override: without it proxies use their own default.
            retry_budget: self
                .index
                .service(&auth.service)
                .and_then(|s| s.retry_budget)
                .map(|b| RetryBudget {
                    retry_ratio: b.ratio,
                    min_retries_per_second: b.min_per_second,
                    ttl: Some(prost_types::Duration {
                        seconds: 10,
                        nanos: 0,
                    }),
                }),
            ..Default::default()
        })
    }
}

#[tonic::async_trait]
impl Destination for DestinationService {
    type GetStream = BoxStream<Update>;
    type GetProfileStream = BoxStream<DestinationProfile>;

    async fn get(&self, req: Request<GetDestination>) -> Result<Response<Self::GetStream>, Status> {
        if self.shutdown.is_triggered() {
            return Err(Status::unavailable("control plane is shutting down"));
        }
        let path = req.into_inner().path;
        tracing::debug!(%path, "Destination.Get");
        let ip_literal = split_host_port(&path).ok().and_then(|(host, port)| {
            let ip = host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse::<std::net::IpAddr>()
                .ok()?;
            Some(SocketAddr::new(ip, port))
        });
        let (key, port) = match (global_path(&path), ip_literal) {
            (Some((g, port)), _) => (SlotKey::Global(g), port),
            (None, Some(addr)) => (self.index.resolve_ip(addr), addr.port()),
            (None, None) => {
                let auth = parse_service_authority(&path, &self.cluster_domain)
                    .map_err(|e| Status::invalid_argument(e.to_string()))?;
                (SlotKey::Service(auth.service), auth.port)
            }
        };
        let rx = self.subscribe(key, port);
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_profile(
        &self,
        req: Request<GetDestination>,
    ) -> Result<Response<Self::GetProfileStream>, Status> {
        let profile = self.profile_for(&req.into_inner().path)?;
        Ok(Response::new(one_then_hold(profile, self.shutdown.clone())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::EndpointMeta;
    use tether_core::authority::ServiceKey;

    fn meta() -> EndpointMeta {
        EndpointMeta {
            weight: 1,
            identity: Some("web.demo.serviceaccount.identity.cluster.local".into()),
            zone: None,
            meshed: true,
            opaque: false,
            name: None,
            cluster: None,
            authority_override: None,
        }
    }

    fn snap(exists: bool, ports: &[u16]) -> PortSnapshot {
        PortSnapshot {
            exists,
            opaque: false,
            endpoints: ports
                .iter()
                .map(|p| (SocketAddr::from(([127, 0, 0, 1], *p)), meta()))
                .collect(),
        }
    }

    fn kinds(updates: &[Update]) -> Vec<String> {
        updates
            .iter()
            .map(|u| match u.update.as_ref().unwrap() {
                update::Update::Add(s) => format!("add{}", s.addrs.len()),
                update::Update::Remove(s) => format!("remove{}", s.addrs.len()),
                update::Update::NoEndpoints(n) => format!("none:{}", n.exists),
            })
            .collect()
    }

    #[test]
    fn diffs_converge_whatever_was_skipped() {
        let key = SlotKey::Service(ServiceKey::new("web", "demo"));
        let mut sent = SentState::default();
        assert_eq!(kinds(&sent.diff(&snap(false, &[]), &key)), ["none:false"]);
        assert_eq!(
            kinds(&sent.diff(&snap(false, &[]), &key)),
            Vec::<String>::new()
        );
        assert_eq!(kinds(&sent.diff(&snap(true, &[]), &key)), ["none:true"]);
        assert_eq!(kinds(&sent.diff(&snap(true, &[1, 2, 3]), &key)), ["add3"]);
        // Skipping states (a slow subscriber) still lands on the latest one.
        assert_eq!(
            kinds(&sent.diff(&snap(true, &[3, 4]), &key)),
            ["remove2", "add1"]
        );
        assert!(sent.matches(&snap(true, &[3, 4])));
        assert_eq!(
            kinds(&sent.diff(&snap(true, &[]), &key)),
            ["remove2", "none:true"]
        );
        assert!(sent.matches(&snap(true, &[])));
    }

    #[tokio::test]
    async fn the_audit_finds_and_repairs_a_divergent_subscription() {
        use crate::index::ServiceState;
        use tether_core::registry::{EndpointSpec, PortSpec};
        let metrics = ControlMetrics::default();
        let index = Index::new(metrics.clone());
        let key = ServiceKey::new("web", "demo");
        index.set_service(
            &key,
            Some(ServiceState {
                ports: vec![PortSpec {
                    port: 80,
                    opaque: false,
                }],
                global_id: None,
                mode: None,
                retry_budget: None,
                cluster_ip: None,
                endpoints: vec![EndpointSpec::new("127.0.0.1:1".parse().unwrap())],
            }),
        );
        let subscriptions = Subscriptions::default();
        let dst = DestinationService {
            index: index.clone(),
            cluster_domain: "cluster.local".into(),
            metrics: metrics.clone(),
            shutdown: Shutdown::default(),
            subscriptions: subscriptions.clone(),
        };
        let mut rx = dst.subscribe(key.clone(), 80);
        assert_eq!(kinds(&[rx.recv().await.unwrap().unwrap()]), ["add1"]);
        assert_eq!(subscriptions.audit(&index, &metrics).divergent, 0);

        // Simulate a lost update: the sender no longer knows what it sent.
        let sub = subscriptions
            .live
            .lock()
            .unwrap()
            .values()
            .next()
            .unwrap()
            .clone();
        sub.forget_what_was_sent();
        let report = subscriptions.audit(&index, &metrics);
        assert_eq!(report.divergent, 1, "{report}");
        assert_eq!(metrics.divergent_subscriptions.get(), 1);
        assert_eq!(metrics.audit_repairs.get(), 1);
        // The repair re-sends the correcting diff…
        let repaired = tokio::time::timeout(std::time::Duration::from_secs(2), rx.recv())
            .await
            .unwrap();
        assert_eq!(kinds(&[repaired.unwrap().unwrap()]), ["add1"]);
        // …and the next audit is clean.
        tokio::task::yield_now().await;
        assert_eq!(subscriptions.audit(&index, &metrics).divergent, 0);
        assert_eq!(metrics.divergent_subscriptions.get(), 0);
    }

    #[test]
    fn endpoints_carry_identity_and_protocol() {
        let addr: SocketAddr = "127.0.0.1:4143".parse().unwrap();
        let wa = weighted_addr(addr, &meta());
        assert!(matches!(
            wa.protocol_hint.unwrap().protocol,
            Some(protocol_hint::Protocol::H2(_))
        ));
        assert!(wa.tls_identity.is_some());
        let mut m = meta();
        m.opaque = true;
        let hint = weighted_addr(addr, &m).protocol_hint.unwrap();
        assert_eq!(hint.opaque_transport.unwrap().inbound_port, 4143);
    }
}
