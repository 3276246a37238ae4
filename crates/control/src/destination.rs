//! `io.linkerd.proxy.destination.Destination`: endpoint discovery streams.
//!
//! Each `Get` gets its own task. The task reads the latest state of its
//! (service, port) slot and sends the diff between what it last sent and that
//! state ([`SentState::diff`]); while it is blocked sending to a slow client,
//! newer states simply replace older ones in the slot. When it catches up it
//! sends one diff to the current state, never a backlog. The outgoing channel
//! per subscriber is small and bounded.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use linkerd2_proxy_api::destination::{
    self as api, destination_server::Destination, protocol_hint, tls_identity, update,
    DestinationProfile, GetDestination, ProtocolHint, RetryBudget, TlsIdentity, Update,
    WeightedAddr, WeightedAddrSet,
};
use linkerd2_proxy_api::net::TcpAddress;
use tether_admin::Shutdown;
use tether_core::authority::{parse_service_authority, split_host_port, ServiceKey};
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status};

use crate::index::{EndpointMeta, Index, PortSnapshot};
use crate::metrics::ControlMetrics;

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
    pub fn diff(&mut self, snap: &PortSnapshot, service: &ServiceKey) -> Vec<Update> {
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
                    metric_labels: HashMap::from([
                        ("service".to_string(), service.name.clone()),
                        ("namespace".to_string(), service.namespace.clone()),
                    ]),
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
        ..Default::default()
    }
}

/// Feeds one subscriber until it goes away or the control plane shuts down.
async fn serve_subscription(
    service: ServiceKey,
    mut slot: watch::Receiver<Arc<PortSnapshot>>,
    tx: mpsc::Sender<Result<Update, Status>>,
    metrics: ControlMetrics,
    shutdown: Shutdown,
) {
    metrics.subscribers.inc();
    let _gauge = scopeguard(metrics.subscribers.clone());
    let mut sent = SentState::default();
    loop {
        let snap = slot.borrow_and_update().clone();
        for update in sent.diff(&snap, &service) {
            tokio::select! {
                res = tx.send(Ok(update)) => if res.is_err() { return },
                _ = shutdown.triggered() => return,
            }
            metrics.updates_sent.inc();
        }
        tokio::select! {
            changed = slot.changed() => if changed.is_err() { return },
            _ = tx.closed() => return,
            _ = shutdown.triggered() => return,
        }
    }
}

/// Decrements a gauge when dropped.
fn scopeguard(gauge: prometheus_client::metrics::gauge::Gauge) -> impl Drop {
    struct Dec(prometheus_client::metrics::gauge::Gauge);
    impl Drop for Dec {
        fn drop(&mut self) {
            self.0.dec();
        }
    }
    Dec(gauge)
}

/// A stream that yields nothing and ends when the control plane shuts down,
/// so profile and policy streams stay open like a real controller's.
fn until_shutdown<T: Send + 'static>(
    shutdown: Shutdown,
) -> impl Stream<Item = Result<T, Status>> + Send {
    futures::stream::once(async move { shutdown.triggered().await }).filter_map(|_| async { None })
}

pub fn one_then_hold<T: Send + 'static>(item: T, shutdown: Shutdown) -> BoxStream<T> {
    Box::pin(futures::stream::once(async move { Ok(item) }).chain(until_shutdown(shutdown)))
}

impl DestinationService {
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
        let auth = parse_service_authority(path, &self.cluster_domain)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        Ok(DestinationProfile {
            fully_qualified_name: auth.service.fqdn(&self.cluster_domain),
            opaque_protocol: self.index.snapshot(&auth.service, auth.port).opaque,
            retry_budget: Some(RetryBudget {
                retry_ratio: 0.2,
                min_retries_per_second: 10,
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
        let auth = parse_service_authority(&path, &self.cluster_domain)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        tracing::debug!(%path, "Destination.Get");
        let slot = self.index.subscribe(&auth.service, auth.port);
        let (tx, rx) = mpsc::channel(SUBSCRIBER_BUFFER);
        tokio::spawn(serve_subscription(
            auth.service,
            slot,
            tx,
            self.metrics.clone(),
            self.shutdown.clone(),
        ));
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

    fn meta() -> EndpointMeta {
        EndpointMeta {
            weight: 1,
            identity: Some("web.demo.serviceaccount.identity.cluster.local".into()),
            zone: None,
            meshed: true,
            opaque: false,
            name: None,
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
        let key = ServiceKey::new("web", "demo");
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
