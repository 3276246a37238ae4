//! `io.linkerd.proxy.destination.Destination`: endpoint discovery streams.
//!
//! Each `Get` is a stream that pulls its next update when its client can
//! take one: it reads the latest state of its (service, port) slot and sends
//! the diff between what it last sent and that state ([`SentState::diff`]);
//! while its client is slow, newer states simply replace older ones in the
//! slot, and when it catches up it sends one diff to the current state,
//! never a backlog. Nothing is queued per subscriber: it holds the update
//! being written and a reference to the rest.
//!
//! Updates are encoded once per published state and step, not once per
//! subscriber ([`SharedUpdates`]): subscribers of a slot mostly make the
//! same step (from the previous state, or from nothing when they join), and
//! the bytes depend only on that step and on whether the client reads tiers,
//! never on anything else in its request. [`DestinationGrpc`] passes those
//! bytes to the wire as they are.
//!
//! Every live subscription is also registered in [`Subscriptions`], with
//! what it was last sent and from which slot version. The audit
//! ([`Subscriptions::audit`]) compares that with the index: a subscription
//! that is idle, has sent the slot's latest version, and still differs from
//! the index is divergent; so is a slot that differs from the index. Both
//! are repaired (the slot republished, the subscription woken to send the
//! correcting diff) and counted.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt};
use linkerd2_proxy_api::destination::destination_server::{self, Destination, DestinationServer};
use linkerd2_proxy_api::destination::{
    self as api, protocol_hint, tls_identity, update, DestinationProfile, GetDestination,
    ProtocolHint, TlsIdentity, Update, WeightedAddr, WeightedAddrSet,
};
use linkerd2_proxy_api::net::TcpAddress;
use prost::bytes::Bytes;
use prost::Message;
use tether_admin::Shutdown;
use tether_core::authority::{parse_service_authority, split_host_port, ServiceKey};
use tokio::sync::{mpsc, Notify};
use tonic::{Request, Response, Status};

use crate::endpoints::EndpointSet;
use crate::index::{
    shrink_map, EndpointMeta, Index, PortSnapshot, Published, SlotKey, SlotReceiver,
};
use crate::metrics::{ControlMetrics, ServiceLabels};

/// The most one `Destination.Get` update may take, encoded. A large endpoint
/// set goes out as several `Add`s (and `Remove`s) of at most this size: a
/// stock client (linkerd2-proxy, Tether's proxy) treats the first `Add`
/// after connecting as the whole set and later ones as additions, so
/// several in a row mean the same as one. A quarter of the 4 MiB that gRPC
/// clients accept by default ([`crate::server::MAX_SEND_MESSAGE_BYTES`]).
pub const MAX_UPDATE_BYTES: usize = 1024 * 1024;

pub type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[derive(Clone)]
pub struct DestinationService {
    pub index: Index,
    /// Profile streams (and policy watches): follow a service's routes.
    pub routing: crate::policy::RoutingStreams,
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
    /// Whether the client asked for every tier (its `context_token`).
    pub tiers: bool,
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
#[derive(Clone)]
pub struct Subscriptions {
    live: Arc<Mutex<Live>>,
    next_id: Arc<AtomicU64>,
    limit: usize,
}

impl Default for Subscriptions {
    fn default() -> Self {
        Self::with_limit(usize::MAX)
    }
}

#[derive(Default)]
struct Live {
    by_id: HashMap<u64, Arc<Subscription>>,
    /// Live subscriptions per watched service. Counted here, under the same
    /// lock as `by_id`, so the per-service gauge is removed exactly when
    /// its last subscriber leaves (an attacker's made-up names leave no
    /// label behind).
    per_service: HashMap<SlotKey, usize>,
}

/// What one audit found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AuditReport {
    pub subscriptions: usize,
    /// The endpoints of the states the subscriptions follow, counted once
    /// per subscription.
    pub endpoints_followed: usize,
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

/// Keeps a subscription registered while its task lives.
struct Registered {
    subs: Subscriptions,
    id: u64,
    service: SlotKey,
    metrics: ControlMetrics,
}

fn service_labels(service: &SlotKey) -> ServiceLabels {
    ServiceLabels {
        service: service.to_string(),
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut live = self.subs.live.lock().unwrap();
        live.by_id.remove(&self.id);
        shrink_map(&mut live.by_id);
        let labels = service_labels(&self.service);
        match live.per_service.get_mut(&self.service) {
            Some(n) if *n > 1 => {
                *n -= 1;
                self.metrics
                    .subscribers_per_service
                    .get_or_create(&labels)
                    .set(*n as i64);
            }
            _ => {
                live.per_service.remove(&self.service);
                shrink_map(&mut live.per_service);
                self.metrics.subscribers_per_service.remove(&labels);
            }
        }
        self.metrics.subscribers.dec();
    }
}

impl Subscriptions {
    /// Registers at most `limit` live subscriptions at once.
    pub fn with_limit(limit: usize) -> Self {
        Self {
            live: Arc::default(),
            next_id: Arc::default(),
            limit,
        }
    }

    fn register(
        &self,
        service: SlotKey,
        port: u16,
        tiers: bool,
        metrics: &ControlMetrics,
    ) -> Result<(Arc<Subscription>, Registered), Status> {
        let mut live = self.live.lock().unwrap();
        if live.by_id.len() >= self.limit {
            return Err(Status::resource_exhausted(format!(
                "this control plane serves at most {} Destination subscriptions (--max-subscriptions); try another replica",
                self.limit
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let sub = Arc::new(Subscription {
            service: service.clone(),
            port,
            tiers,
            state: Mutex::default(),
            repair: Notify::new(),
        });
        live.by_id.insert(id, sub.clone());
        let n = live.per_service.entry(service.clone()).or_default();
        *n += 1;
        metrics
            .subscribers_per_service
            .get_or_create(&service_labels(&service))
            .set(*n as i64);
        metrics.subscribers.inc();
        let guard = Registered {
            subs: self.clone(),
            id,
            service,
            metrics: metrics.clone(),
        };
        Ok((sub, guard))
    }

    pub fn len(&self) -> usize {
        self.live.lock().unwrap().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Services with at least one live subscription.
    pub fn services(&self) -> usize {
        self.live.lock().unwrap().per_service.len()
    }

    /// Compares every live subscription with the index, repairs what
    /// diverged, and records the result in the metrics.
    pub fn audit(&self, index: &Index, metrics: &ControlMetrics) -> AuditReport {
        let subs: Vec<Arc<Subscription>> =
            self.live.lock().unwrap().by_id.values().cloned().collect();
        let mut report = AuditReport {
            subscriptions: subs.len(),
            ..Default::default()
        };
        // Each slot is compared with the index once; subscribers are compared
        // with the slot's published state, which they share when they are up
        // to date (a pointer comparison, not one of every endpoint).
        let mut checked: HashMap<(SlotKey, u16), Arc<Published>> = HashMap::new();
        for sub in subs {
            let published = checked
                .entry((sub.service.clone(), sub.port))
                .or_insert_with(|| {
                    let (published, agrees) = index.check_slot(&sub.service, sub.port);
                    if !agrees {
                        report.stale_slots += 1;
                    }
                    published
                })
                .clone();
            report.endpoints_followed += published.view(sub.tiers).endpoints.len();
            let state = sub.state.lock().unwrap();
            if state.sending || state.version < published.version {
                report.in_flight += 1;
            } else if !state.sent.matches(published.view(sub.tiers)) {
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

/// What one subscriber has been told so far: the endpoints of the state it
/// was last sent, shared with the slot that published it (and with every
/// other subscriber sent the same state), so it holds no copy of its own.
#[derive(Default, Debug, Clone, PartialEq)]
pub struct SentState {
    endpoints: EndpointSet,
    /// `Some(exists)` when the last thing sent was `NoEndpoints`.
    no_endpoints: Option<bool>,
}

/// The updates that take one subscriber to a new state, built one at a
/// time as they are sent: a subscriber that joins a service of 100,000
/// endpoints holds one `Add` of at most [`MAX_UPDATE_BYTES`] at a time, not
/// the whole set at once. `Add`s come first, then `Remove`s, then
/// `NoEndpoints`.
pub struct Updates {
    endpoints: EndpointSet,
    added: std::iter::Peekable<std::vec::IntoIter<SocketAddr>>,
    metric_labels: HashMap<String, String>,
    /// Room for addresses in one `Add`.
    budget: usize,
    removes: std::vec::IntoIter<Update>,
    no_endpoints: Option<Update>,
    service: SlotKey,
    oversized: usize,
    first_oversized: Option<SocketAddr>,
}

impl Updates {
    /// Whether there is anything to send.
    pub fn is_empty(&self) -> bool {
        self.added.len() == 0 && self.removes.len() == 0 && self.no_endpoints.is_none()
    }

    fn next_add(&mut self) -> Option<Update> {
        let mut batch = Vec::new();
        let mut bytes = 0;
        while let Some(&a) = self.added.peek() {
            let meta = &self.endpoints[&a];
            let wa = weighted_addr(a, meta);
            let len = prost::encoding::message::encoded_len(1, &wa);
            if len > self.budget {
                // Recorded as sent all the same: re-sending would fail the
                // same way.
                self.oversized += 1;
                self.first_oversized.get_or_insert(a);
                self.added.next();
                continue;
            }
            if bytes + len > self.budget {
                break;
            }
            bytes += len;
            batch.push(wa);
            self.added.next();
        }
        if batch.is_empty() {
            return None;
        }
        Some(Update {
            update: Some(update::Update::Add(WeightedAddrSet {
                addrs: batch,
                metric_labels: self.metric_labels.clone(),
            })),
        })
    }
}

impl Iterator for Updates {
    type Item = Update;

    fn next(&mut self) -> Option<Update> {
        if let Some(add) = self.next_add() {
            return Some(add);
        }
        if let Some(first) = self.first_oversized.take() {
            tracing::warn!(
                service = %self.service,
                endpoints = self.oversized,
                ?first,
                limit = MAX_UPDATE_BYTES,
                "endpoints left out of discovery: each one's description alone exceeds the update size limit"
            );
        }
        self.removes.next().or_else(|| self.no_endpoints.take())
    }
}

impl SentState {
    /// The updates that take this subscriber from what it was sent to
    /// `snap`, and records them as sent. Large sets are split into several
    /// `Remove`s and `Add`s, each at most [`MAX_UPDATE_BYTES`] encoded.
    pub fn updates(&mut self, snap: &PortSnapshot, service: &SlotKey) -> Updates {
        let (removed, mut added) = snap.endpoints.changes_from(&self.endpoints);
        self.endpoints = snap.endpoints.clone();
        let removed = removed.into_iter().map(TcpAddress::from).collect();
        let (removes, _) = batched(removed, |addrs| {
            update::Update::Remove(api::AddrSet { addrs })
        });
        let mut no_endpoints = None;
        if snap.endpoints.is_empty() {
            added.clear();
            if self.no_endpoints != Some(snap.exists) {
                self.no_endpoints = Some(snap.exists);
                no_endpoints = Some(Update {
                    update: Some(update::Update::NoEndpoints(api::NoEndpoints {
                        exists: snap.exists,
                    })),
                });
            }
        } else {
            self.no_endpoints = None;
        }
        let metric_labels = match service {
            SlotKey::Service(k) => HashMap::from([
                ("service".to_string(), k.name.clone()),
                ("namespace".to_string(), k.namespace.clone()),
            ]),
            SlotKey::Global(g) => HashMap::from([("global_id".to_string(), g.clone())]),
            SlotKey::Endpoint(_) => HashMap::new(),
        };
        let budget = update_budget(update::Update::Add(WeightedAddrSet {
            addrs: Vec::new(),
            metric_labels: metric_labels.clone(),
        }));
        Updates {
            endpoints: snap.endpoints.clone(),
            added: added.into_iter().peekable(),
            metric_labels,
            budget,
            removes: removes.into_iter(),
            no_endpoints,
            service: service.clone(),
            oversized: 0,
            first_oversized: None,
        }
    }

    /// [`SentState::updates`], all at once.
    #[cfg(test)]
    pub fn diff(&mut self, snap: &PortSnapshot, service: &SlotKey) -> Vec<Update> {
        self.updates(snap, service).collect()
    }

    /// Whether this subscriber's view equals `snap`.
    pub fn matches(&self, snap: &PortSnapshot) -> bool {
        self.endpoints == snap.endpoints
            && (!snap.endpoints.is_empty() || self.no_endpoints == Some(snap.exists))
    }
}

/// Splits `items` into updates made by `wrap` (which puts them in the
/// repeated field 1 of its set), each within [`MAX_UPDATE_BYTES`] encoded;
/// sizes come from prost's own accounting. Items too large to fit even
/// alone are returned apart.
fn batched<M: prost::Message>(
    items: Vec<M>,
    wrap: impl Fn(Vec<M>) -> update::Update,
) -> (Vec<Update>, Vec<M>) {
    let budget = update_budget(wrap(Vec::new()));
    let (mut out, mut oversized) = (Vec::new(), Vec::new());
    let (mut batch, mut bytes) = (Vec::new(), 0);
    for item in items {
        let len = prost::encoding::message::encoded_len(1, &item);
        if len > budget {
            oversized.push(item);
            continue;
        }
        if bytes + len > budget {
            out.push(std::mem::take(&mut batch));
            bytes = 0;
        }
        bytes += len;
        batch.push(item);
    }
    if !batch.is_empty() {
        out.push(batch);
    }
    let updates = out
        .into_iter()
        .map(|b| Update {
            update: Some(wrap(b)),
        })
        .collect();
    (updates, oversized)
}

/// The room for items in an update whose empty form is `empty`: the limit
/// less the update around an empty set and the room its length prefixes
/// may grow by once the set is full.
fn update_budget(empty: update::Update) -> usize {
    let overhead = prost::Message::encoded_len(&Update {
        update: Some(empty),
    }) + 2 * (prost::length_delimiter_len(MAX_UPDATE_BYTES) - 1);
    MAX_UPDATE_BYTES.saturating_sub(overhead)
}

/// The wire form of one endpoint.
pub fn weighted_addr(addr: SocketAddr, meta: &EndpointMeta) -> WeightedAddr {
    let mut labels = HashMap::new();
    if let Some(zone) = &meta.zone {
        labels.insert("zone".to_string(), zone.to_string());
    }
    if let Some(name) = &meta.name {
        labels.insert("pod".to_string(), name.to_string());
    }
    if let Some(cluster) = &meta.cluster {
        labels.insert("cluster".to_string(), cluster.clone());
    }
    if let Some(tier) = meta.tier {
        labels.insert(
            tether_core::registry::TIER_LABEL.to_string(),
            tier.to_string(),
        );
    }
    let tls_identity = meta.identity.as_ref().map(|id| TlsIdentity {
        strategy: Some(tls_identity::Strategy::DnsLikeIdentity(
            tls_identity::DnsLikeIdentity {
                name: id.to_string(),
            },
        )),
        server_name: Some(tls_identity::DnsLikeIdentity {
            name: id.to_string(),
        }),
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

// === impl SharedUpdates ===

/// The encoded updates that take a subscriber from one sent state to a
/// published one.
pub struct Step {
    from: SentState,
    /// Whether the step is to every tier of the state (not only its best).
    all_tiers: bool,
    to: SentState,
    updates: Vec<Bytes>,
}

/// The steps already encoded towards one published state, shared by every
/// subscriber that makes the same one: at most [`SHARED_STEPS`], the most
/// recent, since nearly every subscriber of a slot steps from the previous
/// state (or from nothing, when it joins).
#[derive(Default)]
pub struct SharedUpdates {
    steps: Mutex<VecDeque<Arc<Step>>>,
}

const SHARED_STEPS: usize = 4;

impl Clone for SharedUpdates {
    /// A copy of a published state starts with no steps of its own.
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for SharedUpdates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let steps = self.steps.lock().unwrap().len();
        f.debug_struct("SharedUpdates")
            .field("steps", &steps)
            .finish()
    }
}

impl SentState {
    /// Whether a subscriber told `self` was told exactly `other`: the same
    /// shared endpoint set (or both none), the same `NoEndpoints`.
    fn same_as(&self, other: &SentState) -> bool {
        self.no_endpoints == other.no_endpoints
            && (self.endpoints.ptr_eq(&other.endpoints)
                || (self.endpoints.is_empty() && other.endpoints.is_empty()))
    }
}

/// The step from `from` to what `published` shows a subscriber (every tier
/// or the best), encoded once: taken from the steps other subscribers
/// already made, or encoded and kept for the next ones. Encoded outside the
/// lock, so a large first step holds up nobody (two subscribers may then
/// both encode it; both results are the same).
fn step_to(published: &Published, from: &SentState, tiers: bool, service: &SlotKey) -> Arc<Step> {
    let view = published.view(tiers);
    let all_tiers = std::ptr::eq(view, &published.snap);
    let shared = &published.shared.steps;
    let found = shared
        .lock()
        .unwrap()
        .iter()
        .find(|s| s.all_tiers == all_tiers && s.from.same_as(from))
        .cloned();
    if let Some(step) = found {
        return step;
    }
    let mut to = from.clone();
    let updates = to
        .updates(view, service)
        .map(|u| Bytes::from(u.encode_to_vec()))
        .collect();
    let step = Arc::new(Step {
        from: from.clone(),
        all_tiers,
        to,
        updates,
    });
    let mut steps = shared.lock().unwrap();
    if steps.len() == SHARED_STEPS {
        steps.pop_front();
    }
    steps.push_back(step.clone());
    step
}

/// One subscriber's stream: it takes its next update when its client can
/// take one. On the way out (client gone, or the control plane shutting
/// down) it gives back everything the subscription held: its slot, when it
/// was the slot's last watcher, then its registry entry.
struct Feed {
    sub: Arc<Subscription>,
    slot: Option<SlotReceiver>,
    index: Index,
    metrics: ControlMetrics,
    shutdown: Shutdown,
    /// The step being sent, and how many of its updates went out.
    step: Option<(Arc<Published>, Arc<Step>, usize)>,
    /// Whether the subscriber's first state went out: only what follows
    /// answers a registry change while it watched. A subscriber joining a
    /// slot last changed an hour ago is not an update an hour late.
    joined: bool,
    _registered: Registered,
}

impl Drop for Feed {
    fn drop(&mut self) {
        drop(self.slot.take());
        self.index.release(&self.sub.service, self.sub.port);
    }
}

impl Feed {
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            if self.shutdown.is_triggered() {
                return None;
            }
            if let Some((published, step, sent)) = &mut self.step {
                if let Some(update) = step.updates.get(*sent) {
                    *sent += 1;
                    self.metrics.updates_sent.inc();
                    if self.joined && published.version > 0 {
                        self.metrics
                            .update_latency
                            .observe(published.observed_at.elapsed().as_secs_f64());
                    }
                    return Some(update.clone());
                }
                self.step = None;
                self.joined = true;
                self.sub.state.lock().unwrap().sending = false;
                let slot = self.slot.as_mut()?;
                tokio::select! {
                    changed = slot.changed() => if changed.is_err() { return None },
                    _ = self.sub.repair.notified() => {}
                    _ = self.shutdown.triggered() => return None,
                }
            }
            let published = self.slot.as_mut()?.borrow_and_update().clone();
            let from = self.sub.state.lock().unwrap().sent.clone();
            let step = step_to(&published, &from, self.sub.tiers, &self.sub.service);
            {
                let mut state = self.sub.state.lock().unwrap();
                state.sent = step.to.clone();
                state.version = published.version;
                state.sending = !step.updates.is_empty();
            }
            self.step = Some((published, step, 0));
        }
    }

    fn into_stream(self) -> BoxStream<Bytes> {
        Box::pin(futures::stream::unfold(self, |mut feed| async move {
            let update = feed.next().await?;
            Some((Ok(update), feed))
        }))
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
    /// Subscribes in process (tests, tools): updates arrive decoded on the
    /// receiver (or, past the subscription limit, the refusal does).
    pub fn subscribe(
        &self,
        service: impl Into<SlotKey>,
        port: u16,
    ) -> mpsc::Receiver<Result<Update, Status>> {
        self.try_subscribe(service.into(), port)
            .unwrap_or_else(|refused| {
                let (tx, rx) = mpsc::channel(1);
                let _ = tx.try_send(Err(refused));
                rx
            })
    }

    /// As [`DestinationService::subscribe`], refusing past the limit.
    pub fn try_subscribe(
        &self,
        service: SlotKey,
        port: u16,
    ) -> Result<mpsc::Receiver<Result<Update, Status>>, Status> {
        let mut updates = self.open(service, port, false)?.map(decoded);
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    update = updates.next() => match update {
                        Some(update) => if tx.send(update).await.is_err() { return },
                        None => return,
                    },
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(rx)
    }

    /// Opens a subscription: its stream of encoded updates. With `tiers`,
    /// the subscriber is sent every priority tier, labelled, not only the
    /// best. Registered at once, so the limit counts it before its first
    /// update.
    pub fn open(
        &self,
        service: SlotKey,
        port: u16,
        tiers: bool,
    ) -> Result<BoxStream<Bytes>, Status> {
        let (sub, registered) =
            self.subscriptions
                .register(service.clone(), port, tiers, &self.metrics)?;
        let slot = self.index.subscribe(&service, port);
        Ok(Feed {
            sub,
            slot: Some(slot),
            index: self.index.clone(),
            metrics: self.metrics.clone(),
            shutdown: self.shutdown.clone(),
            step: None,
            joined: false,
            _registered: registered,
        }
        .into_stream())
    }

    /// A `Get` request's stream of encoded updates.
    fn open_request(&self, req: GetDestination) -> Result<BoxStream<Bytes>, Status> {
        if self.shutdown.is_triggered() {
            return Err(Status::unavailable("control plane is shutting down"));
        }
        let tiers = tether_core::registry::wants_tiers(&req.context_token);
        let path = req.path;
        tracing::debug!(%path, tiers, "Destination.Get");
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
                self.check_port(&auth.service, auth.port)?;
                (SlotKey::Service(auth.service), auth.port)
            }
        };
        self.open(key, port, tiers)
    }

    /// Refuses a port the service does not declare (INVALID_ARGUMENT, like
    /// a name that is not a service): it has no endpoints and cannot get
    /// any until the registry changes, so holding a stream open for it only
    /// costs memory. Clients ask again later (Tether's proxy within a
    /// second of the next request, linkerd2-proxy treats it as "not a mesh
    /// destination").
    fn check_port(&self, service: &ServiceKey, port: u16) -> Result<(), Status> {
        let Some(declared) = self.index.service(service).map(|s| s.ports) else {
            return Ok(());
        };
        if declared.iter().any(|p| p.port == port) {
            return Ok(());
        }
        let mut ports: Vec<String> = declared
            .iter()
            .take(8)
            .map(|p| p.port.to_string())
            .collect();
        if declared.len() > 8 {
            ports.push(format!("… ({} in all)", declared.len()));
        }
        Err(Status::invalid_argument(format!(
            "service {service} has no port {port} (it declares {})",
            ports.join(", ")
        )))
    }

    /// What a `GetProfile` path names: a service port (whose profile
    /// follows its routes), or a fixed answer (an endpoint, an unknown
    /// address, a global name).
    fn profile_for(&self, path: &str) -> Result<ProfileTarget, Status> {
        let (host, port) =
            split_host_port(path).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let ip = host.trim_start_matches('[').trim_end_matches(']');
        if let Ok(ip) = ip.parse::<std::net::IpAddr>() {
            let addr = SocketAddr::new(ip, port);
            if let Some(service) = self.index.service_by_ip(addr) {
                return Ok(ProfileTarget::Service(service, port));
            }
            return Ok(ProfileTarget::Fixed(Box::new(
                match self.index.find_endpoint(addr) {
                    Some((_, _, meta)) => DestinationProfile {
                        opaque_protocol: meta.opaque,
                        endpoint: Some(weighted_addr(addr, &meta)),
                        ..Default::default()
                    },
                    // Neither a service nor an endpoint: no name, so the client
                    // sends to the address as it is.
                    None => DestinationProfile::default(),
                },
            )));
        }
        if let Some((global, _)) = global_path(path) {
            return Ok(ProfileTarget::Fixed(Box::new(DestinationProfile {
                fully_qualified_name: format!("{global}.global"),
                ..Default::default()
            })));
        }
        let auth = parse_service_authority(path, &self.cluster_domain)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        self.check_port(&auth.service, auth.port)?;
        if self.index.service(&auth.service).is_none() {
            // A name would make the client treat it as a mesh service and
            // wait for endpoints that never come (its fail-fast timeout);
            // INVALID_ARGUMENT is what linkerd2-proxy reads as "not a mesh
            // destination" and acts on at once.
            return Err(Status::invalid_argument(format!(
                "service {} does not exist",
                auth.service
            )));
        }
        Ok(ProfileTarget::Service(auth.service, auth.port))
    }
}

/// What a `GetProfile` answers.
enum ProfileTarget {
    Service(ServiceKey, u16),
    Fixed(Box<DestinationProfile>),
}

#[tonic::async_trait]
impl Destination for DestinationService {
    type GetStream = BoxStream<Update>;
    type GetProfileStream = BoxStream<DestinationProfile>;

    /// The same stream [`DestinationGrpc`] serves, decoded.
    async fn get(&self, req: Request<GetDestination>) -> Result<Response<Self::GetStream>, Status> {
        let updates = self.open_request(req.into_inner())?;
        Ok(Response::new(Box::pin(updates.map(decoded))))
    }

    async fn get_profile(
        &self,
        req: Request<GetDestination>,
    ) -> Result<Response<Self::GetProfileStream>, Status> {
        match self.profile_for(&req.into_inner().path)? {
            ProfileTarget::Fixed(profile) => Ok(Response::new(one_then_hold(
                *profile,
                self.shutdown.clone(),
            ))),
            ProfileTarget::Service(service, port) => {
                let (key, domain) = (service.clone(), self.cluster_domain.clone());
                let stream = self.routing.follow(service, move |state| {
                    crate::outbound::Target {
                        service: &key,
                        state,
                        port,
                        cluster_domain: &domain,
                    }
                    .profile()
                })?;
                Ok(Response::new(stream))
            }
        }
    }
}

fn decoded(update: Result<Bytes, Status>) -> Result<Update, Status> {
    Update::decode(update?).map_err(|e| Status::internal(format!("decoding an update: {e}")))
}

/// The `Destination` gRPC service: `Get` streams the shared, already
/// encoded updates as they are ([`PreEncoded`]); `GetProfile` is the
/// generated server's.
#[derive(Clone)]
pub struct DestinationGrpc {
    destination: Arc<DestinationService>,
    profiles: DestinationServer<DestinationService>,
    max_decoding: usize,
    max_encoding: usize,
}

const GET_PATH: &str = "/io.linkerd.proxy.destination.Destination/Get";

impl DestinationGrpc {
    pub fn new(destination: DestinationService, max_decoding: usize, max_encoding: usize) -> Self {
        let destination = Arc::new(destination);
        Self {
            profiles: DestinationServer::from_arc(destination.clone())
                .max_decoding_message_size(max_decoding)
                .max_encoding_message_size(max_encoding),
            destination,
            max_decoding,
            max_encoding,
        }
    }
}

impl tonic::server::NamedService for DestinationGrpc {
    const NAME: &'static str = destination_server::SERVICE_NAME;
}

impl tower_service::Service<http::Request<tonic::body::Body>> for DestinationGrpc {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = tonic::codegen::BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        if req.uri().path() != GET_PATH {
            return self.profiles.call(req);
        }
        let destination = self.destination.clone();
        let (max_decoding, max_encoding) = (self.max_decoding, self.max_encoding);
        Box::pin(async move {
            let decoder = tonic_prost::ProstDecoder::<GetDestination>::new(
                tonic::codec::BufferSettings::new(REQUEST_BUFFER, REQUEST_BUFFER),
            );
            let mut request = tonic::codec::Streaming::new_request(
                decoder,
                req.into_body(),
                None,
                Some(max_decoding),
            );
            let get = match request.message().await {
                Ok(Some(get)) => get,
                Ok(None) => return Ok(Status::internal("Missing request message.").into_http()),
                Err(status) => return Ok(status.into_http()),
            };
            let updates = match destination.open_request(get) {
                Ok(updates) => updates,
                Err(status) => return Ok(status.into_http()),
            };
            let mut rsp = http::Response::new(tonic::body::Body::new(FramedUpdates {
                updates: Some(updates),
                payload: None,
                max_encoding,
            }));
            rsp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/grpc"),
            );
            Ok(rsp)
        })
    }
}

/// The read buffer a `Get` request starts with (it grows for a larger one,
/// up to the receive limit): a `GetDestination` is a path and a token, a
/// few hundred bytes; tonic's default 8 KiB per request, multiplied by a
/// burst of thousands of subscriptions, is heap glibc keeps.
const REQUEST_BUFFER: usize = 1024;

/// Updates up to this size go out in one frame with their gRPC prefix, a
/// copy HTTP/2 frees once written; a larger one goes out as its shared
/// bytes themselves, after a frame of its own prefix.
const COPIED_UPDATE: usize = 16 * 1024;

/// A `Get` stream's response body: each update framed as gRPC frames it
/// (a 5-byte prefix: not compressed, length), then `grpc-status` in the
/// trailers. tonic's encoder would copy every update into a buffer of the
/// stream's own, which keeps the size of the largest update it carried for
/// the stream's life; here a large update is handed to HTTP/2 as the
/// bytes every subscriber making the same step shares, and the stream
/// holds nothing between updates.
struct FramedUpdates {
    updates: Option<BoxStream<Bytes>>,
    /// A large update whose prefix just went out.
    payload: Option<Bytes>,
    max_encoding: usize,
}

impl http_body::Body for FramedUpdates {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        use prost::bytes::BufMut;
        use std::task::Poll;
        let this = &mut *self;
        if let Some(payload) = this.payload.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(payload))));
        }
        let Some(updates) = this.updates.as_mut() else {
            return Poll::Ready(None);
        };
        let status = match std::task::ready!(updates.poll_next_unpin(cx)) {
            Some(Ok(update)) if update.len() <= this.max_encoding => {
                let mut prefix = [0u8; 5];
                prefix[1..].copy_from_slice(&(update.len() as u32).to_be_bytes());
                if update.len() <= COPIED_UPDATE {
                    let mut frame = prost::bytes::BytesMut::with_capacity(5 + update.len());
                    frame.put_slice(&prefix);
                    frame.put_slice(&update);
                    return Poll::Ready(Some(Ok(http_body::Frame::data(frame.freeze()))));
                }
                this.payload = Some(update);
                return Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::copy_from_slice(
                    &prefix,
                )))));
            }
            Some(Ok(update)) => Status::out_of_range(format!(
                "an update of {} bytes exceeds the send limit of {} bytes",
                update.len(),
                this.max_encoding
            )),
            Some(Err(status)) => status,
            None => Status::ok(""),
        };
        this.updates = None;
        let mut trailers = http::HeaderMap::new();
        if status.add_header(&mut trailers).is_err() {
            let _ = Status::internal("").add_header(&mut trailers);
        }
        Poll::Ready(Some(Ok(http_body::Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.updates.is_none() && self.payload.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::SetChange;
    use crate::index::EndpointMeta;
    use std::collections::{BTreeMap, BTreeSet};

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
            tier: None,
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

    /// What a client knows once it has applied every update it read; an
    /// update that cannot follow what it was sent before is an error.
    #[derive(Default)]
    struct Client {
        endpoints: BTreeMap<SocketAddr, WeightedAddr>,
        no_endpoints: Option<bool>,
    }

    impl Client {
        fn apply(&mut self, update: Update) -> Result<(), String> {
            match update.update.unwrap() {
                update::Update::Add(set) => {
                    self.no_endpoints = None;
                    for wa in set.addrs {
                        let addr = SocketAddr::try_from(wa.addr.unwrap()).unwrap();
                        if self.endpoints.get(&addr) == Some(&wa) {
                            return Err(format!("{addr} added again, unchanged"));
                        }
                        self.endpoints.insert(addr, wa);
                    }
                }
                update::Update::Remove(set) => {
                    for a in set.addrs {
                        let addr = SocketAddr::try_from(a).unwrap();
                        if self.endpoints.remove(&addr).is_none() {
                            return Err(format!("{addr} removed, never added"));
                        }
                    }
                }
                update::Update::NoEndpoints(n) => {
                    if !self.endpoints.is_empty() {
                        return Err("NoEndpoints while endpoints are known".into());
                    }
                    self.no_endpoints = Some(n.exists);
                }
            }
            Ok(())
        }

        /// Reads what its stream has ready (an encoded step is there at
        /// once), or at most `limit` updates.
        fn read(&mut self, stream: &mut BoxStream<Bytes>, limit: usize) -> Result<(), String> {
            use futures::FutureExt;
            for _ in 0..limit {
                match stream.next().now_or_never() {
                    Some(Some(update)) => self.apply(Update::decode(update.unwrap()).unwrap())?,
                    Some(None) => return Err("the stream ended".into()),
                    None => break,
                }
            }
            Ok(())
        }
    }

    /// A `Get` over the gRPC service as a client sends it.
    async fn grpc_get(grpc: &mut DestinationGrpc, path: &str) -> http::Response<tonic::body::Body> {
        let msg = GetDestination {
            path: path.into(),
            ..Default::default()
        }
        .encode_to_vec();
        let mut framed = vec![0u8];
        framed.extend((msg.len() as u32).to_be_bytes());
        framed.extend(msg);
        let req = http::Request::builder()
            .method("POST")
            .uri(format!("http://control{GET_PATH}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(tonic::body::Body::new(http_body_util::Full::new(
                Bytes::from(framed),
            )))
            .unwrap();
        tower_service::Service::call(grpc, req).await.unwrap()
    }

    /// Reads `body` until it has carried `endpoints` added endpoints:
    /// the updates, decoded, and the largest data frame.
    async fn read_adds(body: &mut tonic::body::Body, endpoints: usize) -> (Vec<Update>, Bytes) {
        use http_body_util::BodyExt;
        let (mut updates, mut pending, mut largest) = (Vec::new(), Vec::new(), Bytes::new());
        let mut added = 0;
        while added < endpoints {
            let frame = body.frame().await.unwrap().unwrap();
            let data = frame.into_data().unwrap();
            if data.len() > largest.len() {
                largest = data.clone();
            }
            pending.extend_from_slice(&data);
            while pending.len() >= 5 {
                let len = u32::from_be_bytes(pending[1..5].try_into().unwrap()) as usize;
                if pending.len() < 5 + len {
                    break;
                }
                let update = Update::decode(&pending[5..5 + len]).unwrap();
                if let Some(update::Update::Add(set)) = &update.update {
                    added += set.addrs.len();
                }
                updates.push(update);
                pending.drain(..5 + len);
            }
        }
        (updates, largest)
    }

    /// The bytes of an update shared by its subscribers go to each stream
    /// as they are, not copied into a buffer per stream: a copy a stuck
    /// client holds (HTTP/2 queues it while the window is closed), and a
    /// buffer tonic's encoder keeps at its largest size for the stream's
    /// life (about 0.7 MB per subscriber of a 20,000-endpoint service).
    #[tokio::test]
    async fn streams_hand_out_the_shared_bytes_of_a_large_update() {
        let dst = service_with(Subscriptions::default());
        dst.index
            .set_service(&ServiceKey::new("web", "demo"), Some(large_service(30_000)));
        let mut grpc = DestinationGrpc::new(dst, 1 << 20, 4 << 20);
        let path = "web.demo.svc.cluster.local:80";
        let mut a = grpc_get(&mut grpc, path).await.into_body();
        let mut b = grpc_get(&mut grpc, path).await.into_body();
        let (updates_a, largest_a) = read_adds(&mut a, 30_000).await;
        let (updates_b, largest_b) = read_adds(&mut b, 30_000).await;
        assert_eq!(kinds(&updates_a), kinds(&updates_b));
        assert!(kinds(&updates_a).len() >= 2, "{:?}", kinds(&updates_a));
        assert!(largest_a.len() > 512 * 1024, "{}", largest_a.len());
        assert_eq!(
            largest_a.as_ptr(),
            largest_b.as_ptr(),
            "each stream was handed its own copy"
        );
    }

    /// A subscriber already told `NoEndpoints` steps to a new empty state
    /// (the port turned opaque) with nothing to send; one joining then must
    /// still be told `NoEndpoints`, not given the other's empty step.
    #[tokio::test]
    async fn a_subscriber_joining_an_empty_slot_is_told_so() {
        use tether_core::registry::PortSpec;
        let dst = service_with(Subscriptions::default());
        let key = ServiceKey::new("web", "demo");
        let empty = |opaque| crate::index::ServiceState::new(vec![PortSpec { port: 80, opaque }]);
        dst.index.set_service(&key, Some(empty(false)));
        let web = || SlotKey::Service(key.clone());
        let mut first = (dst.open(web(), 80, false).unwrap(), Client::default());
        first.1.read(&mut first.0, usize::MAX).unwrap();
        assert_eq!(first.1.no_endpoints, Some(true));
        dst.index.set_service(&key, Some(empty(true)));
        first.1.read(&mut first.0, usize::MAX).unwrap();
        let mut joiner = (dst.open(web(), 80, false).unwrap(), Client::default());
        joiner.1.read(&mut joiner.0, usize::MAX).unwrap();
        assert_eq!(joiner.1.no_endpoints, Some(true));
    }

    /// Subscribers of one slot read at different paces (every update, one
    /// update now and then, in the middle of a several-update step, after
    /// joining late, every tier or only the best) while the endpoints
    /// churn; they share encoded steps where they make the same one. Each
    /// must end knowing exactly the final state, with no update that
    /// contradicts what it was sent before.
    #[tokio::test]
    async fn subscribers_at_every_pace_converge_on_the_final_state() {
        use tether_core::registry::{EndpointSpec, MulticlusterMode, PortSpec};
        let dst = service_with(Subscriptions::default());
        let key = ServiceKey::new("web", "demo");
        // 4,500 endpoints with long zone names are two `Add`s: a step of
        // several updates.
        let state = |round: u32| {
            let endpoints: Vec<_> = (0..4_500u32)
                // Each round drops a different fifth and renames a tenth.
                .filter(|i| !(i + round).is_multiple_of(5))
                .map(|i| EndpointSpec {
                    name: Some(
                        format!(
                            "web-{}-{i:05}",
                            if i % 10 == round % 10 { round } else { 0 }
                        )
                        .into(),
                    ),
                    zone: Some(format!("{:-<400}", "eu-west-1a").into()),
                    ..EndpointSpec::new(SocketAddr::from(([10, 0, (i >> 8) as u8, i as u8], 8080)))
                })
                .collect();
            crate::index::ServiceState {
                global_id: Some("web-global".into()),
                mode: Some(MulticlusterMode::Failover),
                ..crate::index::ServiceState::new(vec![PortSpec::http(80)])
                    .with_endpoints(endpoints)
            }
        };
        dst.index.set_service(&key, Some(state(0)));
        // A linked cluster: a client that reads tiers is also sent its
        // gateway, one that does not is not.
        let west = || {
            Some(crate::index::RemoteCluster {
                priority: 1,
                gateway: SocketAddr::from(([10, 9, 9, 9], 4001)),
                gateway_identity: Some("gateway.west".into()),
                ready: BTreeMap::from([("web-global".to_string(), 3)]),
            })
        };
        dst.index.set_remote("west", west());
        let web = || SlotKey::Service(key.clone());
        // (tiers, updates read per round, round it joins in)
        let paces = [
            (false, usize::MAX, 0),
            (false, usize::MAX, 0),
            (true, usize::MAX, 0),
            (false, 1, 0),
            (true, 1, 0),
            (false, 3, 0),
            (false, usize::MAX, 4),
            (true, 1, 7),
            (false, 0, 0),
        ];
        let mut subscribers: Vec<(BoxStream<Bytes>, Client, usize, bool)> = Vec::new();
        for round in 0..12u32 {
            for &(tiers, pace, joins) in &paces {
                if joins == round as usize {
                    let stream = dst.open(web(), 80, tiers).unwrap();
                    subscribers.push((stream, Client::default(), pace, tiers));
                }
            }
            for (stream, client, pace, _) in &mut subscribers {
                client.read(stream, *pace).unwrap();
            }
            if round == 0 {
                let (everything, one) = (&subscribers[0].1, &subscribers[3].1);
                assert!(
                    one.endpoints.len() < everything.endpoints.len(),
                    "a step of several updates"
                );
            }
            if round == 9 {
                // Nothing anywhere for a while (`NoEndpoints`), then back.
                dst.index.set_remote("west", None);
                dst.index
                    .set_service(&key, Some(state(round).with_endpoints(Vec::new())));
                for (stream, client, pace, _) in &mut subscribers {
                    client.read(stream, *pace).unwrap();
                }
                // Told whether it was sent endpoints before or joins now.
                let mut joiner = (dst.open(web(), 80, false).unwrap(), Client::default());
                joiner.1.read(&mut joiner.0, usize::MAX).unwrap();
                assert_eq!(joiner.1.no_endpoints, Some(true), "the joiner");
                assert_eq!(subscribers[0].1.no_endpoints, Some(true));
                dst.index.set_remote("west", west());
            }
            dst.index.set_service(&key, Some(state(round + 1)));
        }
        let snap = dst.index.snapshot(&web(), 80);
        let expected = |tiers: bool| -> BTreeMap<SocketAddr, WeightedAddr> {
            let view = if tiers {
                snap.clone()
            } else {
                snap.best_tier().into_owned()
            };
            view.endpoints
                .iter()
                .map(|(a, m)| (*a, weighted_addr(*a, m)))
                .collect()
        };
        assert_ne!(expected(true), expected(false), "the tiers differ");
        assert_eq!(subscribers.len(), paces.len());
        for (i, (stream, client, _, tiers)) in subscribers.iter_mut().enumerate() {
            client.read(stream, usize::MAX).unwrap();
            assert!(
                client.endpoints == expected(*tiers),
                "subscriber {i} (tiers: {tiers}) knows {} endpoints, {} expected",
                client.endpoints.len(),
                expected(*tiers).len()
            );
        }
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
        // Skipping states (a slow subscriber) still lands on the latest one;
        // what is added goes out before what is removed, so a client never
        // holds an emptied set in between.
        assert_eq!(
            kinds(&sent.diff(&snap(true, &[3, 4]), &key)),
            ["add1", "remove2"]
        );
        assert!(sent.matches(&snap(true, &[3, 4])));
        assert_eq!(
            kinds(&sent.diff(&snap(true, &[]), &key)),
            ["remove2", "none:true"]
        );
        assert!(sent.matches(&snap(true, &[])));
    }

    /// 30,000 endpoints with identities and names make about 4 MB: more
    /// than a gRPC client takes in one message by default.
    fn large(n: u32) -> PortSnapshot {
        PortSnapshot {
            exists: true,
            opaque: false,
            endpoints: (0..n)
                .map(|i| {
                    let addr =
                        SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 8080));
                    let m = EndpointMeta {
                        name: Some(format!("web-7d9c8f6b5-{i:05}").into()),
                        zone: Some("eu-west-1a".into()),
                        ..meta()
                    };
                    (addr, m)
                })
                .collect::<BTreeMap<_, _>>()
                .into(),
        }
    }

    fn addrs_of(updates: &[Update]) -> (BTreeSet<SocketAddr>, BTreeSet<SocketAddr>) {
        let (mut added, mut removed) = (BTreeSet::new(), BTreeSet::new());
        let sock = |a: &TcpAddress| {
            let ip = std::net::IpAddr::try_from(a.ip.unwrap()).unwrap();
            SocketAddr::new(ip, a.port as u16)
        };
        for u in updates {
            match u.update.as_ref().unwrap() {
                update::Update::Add(s) => {
                    for wa in &s.addrs {
                        assert!(added.insert(sock(wa.addr.as_ref().unwrap())));
                    }
                    assert_eq!(s.metric_labels["service"], "web");
                }
                update::Update::Remove(s) => {
                    for a in &s.addrs {
                        assert!(removed.insert(sock(a)));
                    }
                }
                update::Update::NoEndpoints(_) => {}
            }
        }
        (added, removed)
    }

    #[test]
    fn large_sets_go_out_in_updates_under_the_message_limit() {
        use prost::Message;
        let key = SlotKey::Service(ServiceKey::new("web", "demo"));
        let big = large(30_000);
        let mut sent = SentState::default();
        let updates = sent.diff(&big, &key);
        let whole: usize = updates.iter().map(|u| u.encoded_len()).sum();
        assert!(whole > 4 * 1024 * 1024, "the set is {whole} bytes");
        for u in &updates {
            assert!(u.encoded_len() <= MAX_UPDATE_BYTES, "{}", u.encoded_len());
        }
        // Batches are full, not one endpoint each.
        assert!(
            updates.len() <= whole / (MAX_UPDATE_BYTES * 9 / 10) + 1,
            "{}",
            updates.len()
        );
        let (added, removed) = addrs_of(&updates);
        assert_eq!(added.len(), 30_000);
        assert!(removed.is_empty());
        assert!(sent.matches(&big));

        // Removing everything is batched too.
        let none = snap(true, &[]);
        let updates = sent.diff(&none, &key);
        for u in &updates {
            assert!(u.encoded_len() <= MAX_UPDATE_BYTES, "{}", u.encoded_len());
        }
        let (_, removed) = addrs_of(&updates);
        assert_eq!(removed.len(), 30_000);
        assert_eq!(kinds(&updates).last().unwrap(), "none:true");
        assert!(sent.matches(&none));
    }

    #[test]
    fn changes_are_what_a_set_comparison_finds() {
        // Pseudo-random sets over a small address space, so they overlap
        // and share entries whose metadata differs.
        let mut next = crate::test_rng(0x2545_f491_4f6c_dd1d);
        let set = |next: &mut dyn FnMut(u64) -> u64| {
            let n = next(40);
            let map: BTreeMap<SocketAddr, EndpointMeta> = (0..n)
                .map(|_| {
                    let port = next(64) as u16 + 1;
                    let meta = EndpointMeta {
                        weight: next(2) as u32 + 1,
                        ..meta()
                    };
                    (SocketAddr::from(([127, 0, 0, 1], port)), meta)
                })
                .collect();
            map
        };
        for _ in 0..500 {
            let (old, new) = (set(&mut next), set(&mut next));
            let (removed, added) =
                EndpointSet::from(new.clone()).changes_from(&EndpointSet::from(old.clone()));
            let (want_removed, want_added) = crate::endpoints::expected_changes(&old, &new);
            assert_eq!(removed, want_removed, "{old:?} -> {new:?}");
            assert_eq!(added, want_added, "{old:?} -> {new:?}");
        }
    }

    #[test]
    fn a_subscriber_keeps_the_state_it_was_sent_by_reference() {
        let key = SlotKey::Service(ServiceKey::new("web", "demo"));
        let s = snap(true, &[1, 2, 3]);
        let mut sent = SentState::default();
        assert!(!sent.diff(&s, &key).is_empty());
        assert!(sent.endpoints.ptr_eq(&s.endpoints));
        assert!(sent.diff(&s.clone(), &key).is_empty());
    }

    #[test]
    fn an_endpoint_too_large_for_any_update_is_left_out_and_not_resent() {
        let key = SlotKey::Service(ServiceKey::new("web", "demo"));
        let mut s = snap(true, &[1, 2]);
        let big = EndpointMeta {
            name: Some("x".repeat(MAX_UPDATE_BYTES).into()),
            ..meta()
        };
        s.endpoints = s.endpoints.with_changes(vec![SetChange::Insert(
            SocketAddr::from(([127, 0, 0, 1], 2)),
            big,
        )]);
        let mut sent = SentState::default();
        let updates = sent.diff(&s, &key);
        assert_eq!(kinds(&updates), ["add1"]);
        assert!(sent.matches(&s));
        assert!(sent.diff(&s, &key).is_empty());
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
            Some(
                ServiceState::new(vec![PortSpec::http(80)])
                    .with_endpoints(vec![EndpointSpec::new("127.0.0.1:1".parse().unwrap())]),
            ),
        );
        let subscriptions = Subscriptions::default();
        let dst = DestinationService {
            routing: crate::policy::RoutingStreams::new(index.clone(), 100, Shutdown::default()),
            index: index.clone(),
            cluster_domain: "cluster.local".into(),
            metrics: metrics.clone(),
            shutdown: Shutdown::default(),
            subscriptions: subscriptions.clone(),
        };
        let mut rx = dst.subscribe(key.clone(), 80);
        assert_eq!(kinds(&[rx.recv().await.unwrap().unwrap()]), ["add1"]);
        let clean = subscriptions.audit(&index, &metrics);
        assert_eq!(
            (
                clean.divergent,
                clean.subscriptions,
                clean.endpoints_followed
            ),
            (0, 1, 1),
            "{clean}"
        );

        // Simulate a lost update: the sender no longer knows what it sent.
        let sub = subscriptions
            .live
            .lock()
            .unwrap()
            .by_id
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

    fn web_service() -> crate::index::ServiceState {
        crate::index::ServiceState::new(vec![tether_core::registry::PortSpec::http(80)])
            .with_endpoints(vec![tether_core::registry::EndpointSpec::new(
                "127.0.0.1:1".parse().unwrap(),
            )])
    }

    fn service_with(subscriptions: Subscriptions) -> DestinationService {
        let metrics = ControlMetrics::default();
        let index = Index::new(metrics.clone());
        index.set_service(&ServiceKey::new("web", "demo"), Some(web_service()));
        DestinationService {
            routing: crate::policy::RoutingStreams::new(index.clone(), 100, Shutdown::default()),
            index,
            cluster_domain: "cluster.local".into(),
            metrics,
            shutdown: Shutdown::default(),
            subscriptions,
        }
    }

    async fn until(mut done: impl FnMut() -> bool) -> bool {
        for _ in 0..200 {
            if done() {
                return true;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        done()
    }

    /// A service of `n` endpoints with names and zones (about 130 bytes
    /// each on the wire).
    fn large_service(n: u32) -> crate::index::ServiceState {
        use tether_core::registry::{EndpointSpec, PortSpec};
        crate::index::ServiceState::new(vec![PortSpec::http(80)]).with_endpoints(
            (0..n)
                .map(|i| EndpointSpec {
                    name: Some(format!("web-7d9c8f6b5-{i:05}").into()),
                    zone: Some("eu-west-1a".into()),
                    ..EndpointSpec::new(SocketAddr::from((
                        [10, (i >> 16) as u8, (i >> 8) as u8, i as u8],
                        8080,
                    )))
                })
                .collect::<Vec<_>>(),
        )
    }

    #[tokio::test]
    async fn a_stream_takes_updates_only_as_its_client_reads() {
        // 30,000 endpoints: two 1 MiB `Add`s. A client that has read one
        // has made the control plane hand out one, not a buffer's worth
        // ahead of it.
        let dst = service_with(Subscriptions::default());
        dst.index
            .set_service(&ServiceKey::new("web", "demo"), Some(large_service(30_000)));
        let web = SlotKey::Service(ServiceKey::new("web", "demo"));
        let mut stream = dst.open(web, 80, false).unwrap();
        let first = Update::decode(stream.next().await.unwrap().unwrap()).unwrap();
        assert!(kinds(&[first])[0].starts_with("add"));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(dst.metrics.updates_sent.get(), 1);
        // The rest was encoded with the first (once, for every subscriber
        // making the same step): it is there at once.
        let mut rest = 0;
        while let Ok(Some(update)) =
            tokio::time::timeout(std::time::Duration::from_secs(1), stream.next()).await
        {
            update.unwrap();
            rest += 1;
        }
        assert!(rest >= 1, "{rest} more updates");
        assert_eq!(dst.metrics.updates_sent.get(), 1 + rest);
    }

    #[tokio::test]
    async fn subscribers_making_the_same_step_share_its_encoding() {
        let dst = service_with(Subscriptions::default());
        let key = ServiceKey::new("web", "demo");
        dst.index.set_service(&key, Some(large_service(3)));
        let web = || SlotKey::Service(key.clone());
        let mut streams: Vec<_> = (0..3)
            .map(|_| dst.open(web(), 80, false).unwrap())
            .collect();
        let mut first = Vec::new();
        for s in &mut streams {
            first.push(s.next().await.unwrap().unwrap());
        }
        // The same bytes, not equal copies: encoded once.
        assert!(
            first.iter().all(|b| b.as_ptr() == first[0].as_ptr()),
            "{first:?}"
        );
        dst.index.set_service(&key, Some(large_service(4)));
        let mut next = Vec::new();
        for s in &mut streams {
            next.push(s.next().await.unwrap().unwrap());
        }
        assert_eq!(kinds(&[Update::decode(next[0].clone()).unwrap()]), ["add1"]);
        assert!(
            next.iter().all(|b| b.as_ptr() == next[0].as_ptr()),
            "{next:?}"
        );
        // A client that reads tiers makes its own step, the same bytes here
        // (a service without tiers looks the same to both).
        let mut tiers = dst.open(web(), 80, true).unwrap();
        let all = Update::decode(tiers.next().await.unwrap().unwrap()).unwrap();
        assert_eq!(kinds(&[all]), ["add4"]);
    }

    #[tokio::test]
    async fn nothing_of_a_subscription_outlives_its_stream() {
        let dst = service_with(Subscriptions::default());
        let mut streams = Vec::new();
        for i in 0..500 {
            // Made-up names as well as a real service, as a client could.
            let key = ServiceKey::new(format!("made-up-{i}"), "demo");
            let mut rx = dst.subscribe(key, 80);
            rx.recv().await.unwrap().unwrap();
            streams.push(rx);
            let mut rx = dst.subscribe(ServiceKey::new("web", "demo"), 80);
            rx.recv().await.unwrap().unwrap();
            streams.push(rx);
        }
        assert_eq!(dst.subscriptions.len(), 1000);
        assert_eq!(dst.subscriptions.services(), 501);
        assert_eq!(dst.index.slot_count(), 501);
        assert_eq!(dst.metrics.subscribers.get(), 1000);
        drop(streams);
        // No garbage collection runs here: ending the streams is enough.
        let (subs, index) = (dst.subscriptions.clone(), dst.index.clone());
        assert!(
            until(|| subs.is_empty() && subs.services() == 0 && index.slot_count() == 0).await,
            "left behind: {} subscriptions of {} services, {} slots",
            subs.len(),
            subs.services(),
            index.slot_count()
        );
        assert_eq!(dst.metrics.subscribers.get(), 0);
        let mut registry = prometheus_client::registry::Registry::default();
        dst.metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            !text.contains("made-up-"),
            "per-service labels of ended streams stayed:\n{text}"
        );
    }

    /// How many updates `tether_destination_update_latency_seconds` counted.
    fn latencies_observed(metrics: &ControlMetrics) -> u64 {
        let mut registry = prometheus_client::registry::Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let line = text
            .lines()
            .find(|l| l.starts_with("tether_destination_update_latency_seconds_count "))
            .unwrap_or_else(|| panic!("no update latency count in:\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    /// The update latency counts registry changes reaching the subscribers
    /// that watched them; a subscriber joining a slot changed long ago gets
    /// its first state at once, which is not an update that late.
    #[tokio::test]
    async fn joining_a_changed_slot_counts_no_update_latency() {
        let dst = service_with(Subscriptions::default());
        let key = ServiceKey::new("web", "demo");
        let mut watching = dst.subscribe(key.clone(), 80);
        watching.recv().await.unwrap().unwrap();
        assert_eq!(latencies_observed(&dst.metrics), 0, "a first state");
        let mut more = web_service();
        more.endpoints = more
            .endpoints
            .iter()
            .cloned()
            .chain([tether_core::registry::EndpointSpec::new(
                "127.0.0.1:9".parse().unwrap(),
            )])
            .collect();
        dst.index.set_service(&key, Some(more));
        watching.recv().await.unwrap().unwrap();
        assert_eq!(latencies_observed(&dst.metrics), 1, "the change's update");
        let mut joining = dst.subscribe(key, 80);
        joining.recv().await.unwrap().unwrap();
        assert_eq!(latencies_observed(&dst.metrics), 1, "a first state");
    }

    #[tokio::test]
    async fn a_dropped_grpc_stream_gives_back_its_subscription_at_once() {
        // What the gRPC server does when a client goes away: it drops the
        // stream, whether idle or in the middle of a step.
        let dst = service_with(Subscriptions::default());
        let web = || SlotKey::Service(ServiceKey::new("web", "demo"));
        let mut idle = dst.open(web(), 80, false).unwrap();
        idle.next().await.unwrap().unwrap();
        let unread = dst.open(SlotKey::Service(ServiceKey::new("nope", "demo")), 80, false);
        assert_eq!(dst.subscriptions.len(), 2);
        assert_eq!(dst.index.slot_count(), 2);
        drop(idle);
        drop(unread);
        assert!(dst.subscriptions.is_empty());
        assert_eq!(dst.subscriptions.services(), 0);
        assert_eq!(dst.index.slot_count(), 0);
        assert_eq!(dst.metrics.subscribers.get(), 0);
    }

    #[tokio::test]
    async fn subscriptions_past_the_limit_are_refused() {
        let dst = service_with(Subscriptions::with_limit(2));
        let web = || SlotKey::Service(ServiceKey::new("web", "demo"));
        let a = dst.try_subscribe(web(), 80).unwrap();
        let _b = dst.try_subscribe(web(), 80).unwrap();
        let refused = dst.try_subscribe(web(), 80).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(refused.message().contains("at most 2"), "{refused:?}");
        drop(a);
        let subs = dst.subscriptions.clone();
        assert!(until(|| subs.len() == 1).await);
        assert!(dst.try_subscribe(web(), 80).is_ok());
    }

    #[tokio::test]
    async fn an_undeclared_port_is_refused_at_once() {
        let dst = service_with(Subscriptions::default());
        let get = |path: &str| {
            Request::new(GetDestination {
                path: path.into(),
                ..Default::default()
            })
        };
        let Err(refused) = dst.get(get("web.demo.svc.cluster.local:81")).await else {
            panic!("a stream for an undeclared port")
        };
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(
            refused
                .message()
                .contains("has no port 81 (it declares 80)"),
            "{refused:?}"
        );
        assert!(dst.subscriptions.is_empty());
        let Err(refused) = dst.get_profile(get("web.demo.svc.cluster.local:81")).await else {
            panic!("a profile for an undeclared port")
        };
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        // Declared ports and unknown services still get streams.
        assert!(dst.get(get("web.demo.svc.cluster.local:80")).await.is_ok());
        assert!(dst.get(get("nope.demo.svc.cluster.local:81")).await.is_ok());
    }

    /// The first profile `GetProfile` would send for `path`.
    fn profile_of(dst: &DestinationService, path: &str) -> DestinationProfile {
        match dst.profile_for(path).unwrap() {
            ProfileTarget::Fixed(p) => *p,
            ProfileTarget::Service(key, port) => crate::outbound::Target {
                service: &key,
                state: &dst.index.service(&key).unwrap(),
                port,
                cluster_domain: &dst.cluster_domain,
            }
            .profile(),
        }
    }

    fn get_request(path: &str) -> Request<GetDestination> {
        Request::new(GetDestination {
            path: path.into(),
            ..Default::default()
        })
    }

    #[tokio::test]
    async fn an_unknown_service_has_no_profile_at_once() {
        let dst = service_with(Subscriptions::default());
        let Err(refused) = dst
            .get_profile(get_request("nope.demo.svc.cluster.local:80"))
            .await
        else {
            panic!("a profile for a service that does not exist")
        };
        assert_eq!(refused.code(), tonic::Code::InvalidArgument);
        assert!(refused.message().contains("does not exist"), "{refused:?}");
        // An address that is neither a service nor an endpoint: no name.
        let p = profile_of(&dst, "10.1.2.3:80");
        assert!(p.fully_qualified_name.is_empty() && p.endpoint.is_none());
    }

    const ROUTES: &str = "kind: HTTPRoute\nname: split\nnamespace: demo\nparentRefs: [{name: web, port: 80}]\n\
        rules:\n\
        \x20 - backendRefs: [{name: web, weight: 9}, {name: web-v2, weight: 1}]\n\
        \x20 - matches: [{path: {type: PathPrefix, value: /api}, method: POST}, {path: {type: Exact, value: /login}}, {headers: [{name: x, value: y}]}]\n\
        \x20   timeouts: {request: 2s}\n\
        \x20   retry: {codes: [503]}\n";

    fn with_routes(state: &mut crate::index::ServiceState, text: &str) {
        state.routes = tether_core::registry::parse_documents(text)
            .unwrap()
            .into_iter()
            .filter_map(|d| match d {
                tether_core::registry::Document::Route(r) => Some(r),
                _ => None,
            })
            .collect();
    }

    #[test]
    fn routes_travel_in_profiles_by_name_and_by_cluster_ip() {
        let dst = service_with(Subscriptions::default());
        let mut web = web_service();
        web.cluster_ip = Some("10.96.0.10".parse().unwrap());
        with_routes(&mut web, ROUTES);
        dst.index
            .set_service(&ServiceKey::new("web", "demo"), Some(web));
        for path in ["web.demo.svc.cluster.local:80", "10.96.0.10:80"] {
            let p = profile_of(&dst, path);
            assert_eq!(
                p.fully_qualified_name, "web.demo.svc.cluster.local",
                "{path}"
            );
            // Most specific first; the header match cannot be expressed.
            let regexes: Vec<String> = p
                .routes
                .iter()
                .map(|r| format!("{:?}", r.condition.as_ref().unwrap()))
                .collect();
            assert_eq!(p.routes.len(), 3, "{regexes:#?}");
            assert!(regexes[0].contains("^/login$"), "{regexes:#?}");
            assert!(regexes[1].contains("^/api(?:/.*)?$"), "{regexes:#?}");
            assert!(regexes[2].contains("^/.*$"), "{regexes:#?}");
            let login = &p.routes[0];
            assert!(login.is_retryable);
            assert_eq!(login.metrics_labels["route"], "split");
            assert_eq!(
                login.timeout,
                Some(prost_types::Duration {
                    seconds: 2,
                    nanos: 0
                })
            );
            assert!(!p.routes[2].is_retryable);
            // The catch-all rule's split is the service-level split.
            let split: Vec<(String, u32)> = p
                .dst_overrides
                .iter()
                .map(|d| (d.authority.clone(), d.weight))
                .collect();
            assert_eq!(
                split,
                vec![
                    ("web.demo.svc.cluster.local:80".to_string(), 9),
                    ("web-v2.demo.svc.cluster.local:80".to_string(), 1)
                ]
            );
        }
    }

    #[tokio::test]
    async fn a_profile_follows_its_routes() {
        let dst = service_with(Subscriptions::default());
        let mut stream = dst
            .get_profile(get_request("web.demo.svc.cluster.local:80"))
            .await
            .unwrap()
            .into_inner();
        let first = stream.next().await.unwrap().unwrap();
        assert!(first.routes.is_empty() && first.dst_overrides.is_empty());
        let mut web = web_service();
        with_routes(&mut web, ROUTES);
        dst.index
            .set_service(&ServiceKey::new("web", "demo"), Some(web));
        let next = tokio::time::timeout(std::time::Duration::from_secs(5), stream.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(next.routes.len(), 3);
        assert_eq!(next.dst_overrides.len(), 2);
        drop(stream);
        assert!(until(|| dst.routing.live() == 0).await);
    }

    #[test]
    fn a_response_timeout_travels_as_a_route_for_every_path() {
        let dst = service_with(Subscriptions::default());
        let profile = profile_of(&dst, "web.demo.svc.cluster.local:80");
        assert!(profile.routes.is_empty(), "no override, no route");
        let mut web = web_service();
        web.response_timeout = Some(std::time::Duration::from_millis(1500));
        dst.index
            .set_service(&ServiceKey::new("web", "demo"), Some(web));
        let profile = profile_of(&dst, "web.demo.svc.cluster.local:80");
        let [route] = &profile.routes[..] else {
            panic!("{:?}", profile.routes)
        };
        assert_eq!(
            route.condition,
            Some(api::RequestMatch {
                r#match: Some(api::request_match::Match::Path(api::PathMatch {
                    regex: ".*".into()
                }))
            })
        );
        assert_eq!(
            route.timeout,
            Some(prost_types::Duration {
                seconds: 1,
                nanos: 500_000_000
            })
        );
        assert_eq!(route.metrics_labels["route"], "default");
        assert!(!route.is_retryable && route.response_classes.is_empty());
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
