//! The discovery client: one `Destination.Get` stream per authority,
//! published as a `watch` of the latest [`Resolution`] that every request
//! for that authority reads.
//!
//! The stream reconnects with exponential backoff and jitter, moving to the
//! next control-plane address on each failure ([`ControlPlanes`]: a list of
//! `host:port`, each resolved through DNS at every attempt, so a name that
//! resolves to several replicas spreads over all of them). Until a new stream
//! answers, the last known endpoints stay in force; the first answer on a new
//! stream replaces them wholesale (the control plane always starts a stream
//! with the full state).
//!
//! A large set may come as several `Add`s in a row; like linkerd2-proxy, the
//! first `Add` of a stream replaces what was known and later ones add to it,
//! and updates that have already arrived are applied together, so a set
//! split across messages is published whole whenever the network delivered
//! it whole.
//!
//! A stream can also be alive but stale: open, silent, while every endpoint
//! it gave refuses connections. The outbound side reports that through a
//! [`Stall`] signal; if no update has arrived for a while, the stream is
//! dropped and discovery re-subscribes (to the next control plane).
//!
//! A replica that accepts connections but never answers (hung, stopped)
//! gets [`Discovery::with_first_answer_timeout`] to send a stream's first
//! update, when there is another replica to try; requests are told
//! `control plane unreachable` meanwhile, and every new stream starts with
//! the replica that answered last.
//!
//! Limits: an update may be at most [`MAX_MESSAGE_BYTES`]; a bigger one is
//! reported as `message too large` (log, metric reason, the error requests
//! get), not as an unreachable control plane.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tether_core::backoff::{jittered, Backoff};

use linkerd2_proxy_api::destination::{
    destination_client::DestinationClient, protocol_hint, tls_identity, update, GetDestination,
    WeightedAddr,
};
use tether_admin::Shutdown;
use tether_identity::control::{status_chain, Auth, ControlTls};
use tokio::sync::{watch, Notify};
use tonic::transport::Channel;

use crate::ProxyStartError;

/// An endpoint as discovery describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub addr: SocketAddr,
    pub weight: u32,
    /// The TLS identity the endpoint must present.
    pub identity: Option<String>,
    /// A peer proxy that takes HTTP/2 (so HTTP/1 is carried over HTTP/2).
    pub meshed: bool,
    pub opaque: bool,
    pub labels: BTreeMap<String, String>,
    /// The authority to send instead of the request's (a gateway's).
    pub authority_override: Option<String>,
}

impl Endpoint {
    fn from_api(wa: WeightedAddr) -> Option<Self> {
        let addr = wa.addr?;
        let ip = std::net::IpAddr::try_from(addr.ip?).ok()?;
        let port = u16::try_from(addr.port).ok()?;
        let identity = wa.tls_identity.and_then(|t| match t.strategy {
            Some(tls_identity::Strategy::DnsLikeIdentity(d)) => Some(d.name),
            _ => None,
        });
        let (meshed, opaque) = match wa
            .protocol_hint
            .and_then(|h| h.protocol.map(|p| (p, h.opaque_transport)))
        {
            Some((protocol_hint::Protocol::H2(_), _)) => (true, false),
            Some((protocol_hint::Protocol::Opaque(_), transport)) => (transport.is_some(), true),
            None => (false, false),
        };
        Some(Self {
            addr: SocketAddr::new(ip, port),
            weight: wa.weight.max(1),
            identity,
            meshed,
            opaque,
            labels: wa.metric_labels.into_iter().collect(),
            authority_override: wa
                .authority_override
                .map(|a| a.authority_override)
                .filter(|a| !a.is_empty()),
        })
    }
}

/// What is known about one authority.
#[derive(Clone, Debug, Default)]
pub struct Resolution {
    /// Whether the control plane has ever answered for this authority.
    pub answered: bool,
    /// Whether the service exists (as of the last answer).
    pub exists: bool,
    pub endpoints: Arc<BTreeMap<SocketAddr, Endpoint>>,
    /// The last stream error, cleared by the next answer.
    pub last_error: Option<StreamError>,
    /// Why the control plane refused the authority outright (not a service
    /// name, a port the service does not declare).
    pub rejected: Option<String>,
    /// When the last update arrived.
    pub last_update: Option<Instant>,
}

/// Why a discovery stream failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamError {
    /// No usable answer: refused, silent, shut down, unresolvable.
    Unreachable(String),
    /// An update over [`MAX_MESSAGE_BYTES`] (or over the control plane's own
    /// sending limit).
    TooLarge(String),
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamError::Unreachable(e) | StreamError::TooLarge(e) => f.write_str(e),
        }
    }
}

/// The largest discovery message the proxy decodes: gRPC's customary 4 MiB.
/// Tether's control plane sends at most a quarter of it per update.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// Whether `status` says a message went over a size limit (tonic's wording
/// on either side: "decoded/encoded message length too large").
fn is_too_large(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
    ) && status.message().contains("message length too large")
}

/// A status message as logs and errors carry it: bounded, whatever the
/// control plane sent.
fn bounded(message: &str) -> String {
    const MAX: usize = 256;
    if message.len() <= MAX {
        return message.to_string();
    }
    let mut end = MAX;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &message[..end], message.len())
}

/// Raised by the outbound side when every endpoint of a service is failing.
pub type Stall = Arc<Notify>;

/// The control planes a proxy may talk to, tried in turn.
pub struct ControlPlanes {
    targets: Vec<String>,
    /// TLS to the control plane; `None` with `--insecure-control-plane`.
    tls: Option<Arc<ControlTls>>,
    channels: Mutex<HashMap<(SocketAddr, Auth), Channel>>,
    /// The replica that answered last: where new streams start, so a hung
    /// replica costs one stream its first-answer timeout, not every stream.
    preferred: Mutex<Option<SocketAddr>>,
}

/// One control plane to try.
pub struct Picked {
    pub addr: SocketAddr,
    pub channel: Channel,
    /// How many addresses the targets resolved to.
    pub of: usize,
}

impl ControlPlanes {
    pub fn new(
        targets: &[String],
        tls: Option<Arc<ControlTls>>,
    ) -> Result<Arc<Self>, ProxyStartError> {
        for t in targets {
            let ok = t.rsplit_once(':').is_some_and(|(host, port)| {
                !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0)
            });
            if !ok {
                return Err(ProxyStartError::ControlAddr(t.clone()));
            }
        }
        Ok(Arc::new(Self {
            targets: targets.to_vec(),
            tls,
            channels: Mutex::default(),
            preferred: Mutex::default(),
        }))
    }

    /// The `attempt`-th control plane, in rotation over every address the
    /// targets resolve to right now, starting at the one that answered last.
    pub async fn pick(&self, attempt: usize) -> Result<(SocketAddr, Channel), String> {
        self.pick_one(attempt).await.map(|p| (p.addr, p.channel))
    }

    /// Records that `addr` answered.
    pub fn answered(&self, addr: SocketAddr) {
        *self.preferred.lock().unwrap() = Some(addr);
    }

    /// As [`ControlPlanes::pick`], for `Identity.Certify`: server-authenticated
    /// TLS, which needs no certificate of this proxy's.
    pub async fn pick_for_certify(&self, attempt: usize) -> Result<(SocketAddr, Channel), String> {
        self.pick_with(attempt, Auth::Server)
            .await
            .map(|p| (p.addr, p.channel))
    }

    /// As [`ControlPlanes::pick`], also saying how many there are.
    pub async fn pick_one(&self, attempt: usize) -> Result<Picked, String> {
        self.pick_with(attempt, Auth::Mutual).await
    }

    async fn pick_with(&self, attempt: usize, auth: Auth) -> Result<Picked, String> {
        let mut addrs = Vec::new();
        for t in &self.targets {
            match tokio::time::timeout(Duration::from_secs(2), tokio::net::lookup_host(t.as_str()))
                .await
            {
                Ok(Ok(found)) => addrs.extend(found),
                Ok(Err(e)) => {
                    tracing::debug!(control = %t, error = %e, "control plane does not resolve")
                }
                Err(_) => tracing::debug!(control = %t, "control plane name lookup timed out"),
            }
        }
        if addrs.is_empty() {
            return Err(format!(
                "no control-plane address resolves ({})",
                self.targets.join(", ")
            ));
        }
        addrs.sort();
        addrs.dedup();
        let preferred = *self.preferred.lock().unwrap();
        let start = preferred
            .and_then(|p| addrs.iter().position(|a| *a == p))
            .unwrap_or(0);
        let addr = addrs[(start + attempt) % addrs.len()];
        let mut channels = self.channels.lock().unwrap();
        let channel = channels
            .entry((addr, auth))
            .or_insert_with(|| {
                tether_identity::control::channel(addr, self.tls.clone().map(|tls| (tls, auth)))
            })
            .clone();
        Ok(Picked {
            addr,
            channel,
            of: addrs.len(),
        })
    }
}

#[derive(Clone)]
pub struct Discovery {
    controls: Arc<ControlPlanes>,
    metrics: crate::metrics::ProxyMetrics,
    first_answer_timeout: Duration,
}

/// How long a control plane may take to send a stream's first update
/// before the next replica is tried (`--discovery-first-answer-timeout`).
pub const DEFAULT_FIRST_ANSWER_TIMEOUT: Duration = Duration::from_secs(1);

/// What discovery may hold and wait for.
#[derive(Clone, Copy, Debug)]
pub struct DiscoverySettings {
    /// See [`Discovery::with_first_answer_timeout`].
    pub first_answer_timeout: Duration,
}

impl Default for DiscoverySettings {
    fn default() -> Self {
        Self {
            first_answer_timeout: DEFAULT_FIRST_ANSWER_TIMEOUT,
        }
    }
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How often to re-ask for the policy of a service the control plane has
/// none for (it may appear; each ask is one call per followed authority).
const NO_POLICY_RETRY: Duration = Duration::from_secs(10);
/// How often to re-ask about an authority the control plane called invalid.
const INVALID_RETRY: Duration = Duration::from_secs(30);

impl Discovery {
    pub fn new(controls: Arc<ControlPlanes>, metrics: crate::metrics::ProxyMetrics) -> Self {
        Self {
            controls,
            metrics,
            first_answer_timeout: DEFAULT_FIRST_ANSWER_TIMEOUT,
        }
    }

    /// Gives a replica `timeout` to send a stream's first update before the
    /// next one is tried (only when there is another to try).
    pub fn with_first_answer_timeout(mut self, timeout: Duration) -> Self {
        self.first_answer_timeout = timeout;
        self
    }

    /// Follows `authority`'s profile and applies its retry budget (the
    /// registry's per-service override) to `budget`, `default` otherwise,
    /// and its response timeout to `response_timeout`.
    pub fn watch_profile(
        &self,
        authority: &str,
        budget: Arc<crate::retry::RetryBudget>,
        default: crate::retry::BudgetSpec,
        response_timeout: watch::Sender<Option<Duration>>,
        stop: Shutdown,
    ) {
        let (controls, authority) = (self.controls.clone(), authority.to_string());
        tokio::spawn(async move {
            let mut attempt = 0usize;
            loop {
                let followed = async {
                    let (_, channel) = controls.pick(attempt).await?;
                    let req = GetDestination {
                        scheme: "k8s".into(),
                        path: authority.clone(),
                        ..Default::default()
                    };
                    let mut stream = client(channel)
                        .get_profile(req)
                        .await
                        .map_err(|s| s.message().to_string())?
                        .into_inner();
                    while let Some(profile) = stream
                        .message()
                        .await
                        .map_err(|s| s.message().to_string())?
                    {
                        let spec = match profile.retry_budget {
                            Some(b) => crate::retry::BudgetSpec {
                                ratio: f64::from(b.retry_ratio).clamp(0.0, 10.0),
                                min_per_second: f64::from(b.min_retries_per_second),
                                ttl: b
                                    .ttl
                                    .and_then(|t| Duration::try_from(t).ok())
                                    .filter(|t| !t.is_zero())
                                    .unwrap_or(default.ttl),
                            },
                            None => default,
                        };
                        budget.set_spec(spec);
                        response_timeout.send_replace(profile_response_timeout(&profile));
                    }
                    Ok::<(), String>(())
                };
                tokio::select! {
                    _ = followed => {}
                    _ = stop.triggered() => return,
                }
                attempt += 1;
                tokio::select! {
                    _ = tokio::time::sleep(jittered(BACKOFF_MAX, rand::random())) => {}
                    _ = stop.triggered() => return,
                }
            }
        });
    }

    /// Follows `authority`'s outbound policy (`OutboundPolicies.Watch`)
    /// into `tx`, until `stop`. A policy that cannot be understood is
    /// refused with a log line and the last good one stays in force; a
    /// control plane without policies for it (`NotFound`, `Unimplemented`)
    /// or none reachable before any policy arrived settles the state to
    /// "no policy", so requests take the default path instead of waiting.
    pub fn watch_policy(&self, authority: &str, tx: watch::Sender<PolicyState>, stop: Shutdown) {
        let (controls, metrics, authority) = (
            self.controls.clone(),
            self.metrics.clone(),
            authority.to_string(),
        );
        let first_answer_timeout = self.first_answer_timeout;
        tokio::spawn(async move {
            let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
            let mut attempt = 0usize;
            loop {
                let followed = follow_policy(
                    &authority,
                    &controls,
                    attempt,
                    &tx,
                    &metrics,
                    first_answer_timeout,
                    &mut backoff,
                );
                let pause = tokio::select! {
                    pause = followed => pause,
                    _ = stop.triggered() => return,
                };
                attempt += 1;
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = stop.triggered() => return,
                }
            }
        });
    }

    /// Follows the control plane's policy for `workload`'s inbound `port`
    /// (`InboundServerPolicies.WatchPort`) until `stop`; see
    /// [`crate::inbound_policy`].
    pub fn follow_inbound_policy(
        &self,
        workload: &crate::inbound_policy::Workload,
        port: u16,
        readiness: tether_admin::Readiness,
        stop: Shutdown,
    ) -> watch::Receiver<crate::inbound_policy::ServerState> {
        crate::inbound_policy::Follow {
            controls: self.controls.clone(),
            spec: linkerd2_proxy_api::inbound::PortSpec {
                workload: workload.spec(),
                port: u32::from(port),
            },
            counters: self.metrics.authz.policies.clone(),
            readiness,
            first_answer_timeout: self.first_answer_timeout,
        }
        .spawn(stop)
    }

    /// Starts resolving `authority`. The stream lives as long as any
    /// receiver does; `stall` asks it to re-subscribe.
    pub fn resolve(&self, authority: &str, stall: Stall) -> watch::Receiver<Resolution> {
        let (tx, rx) = watch::channel(Resolution::default());
        tokio::spawn(resolve_task(
            authority.to_string(),
            self.controls.clone(),
            tx,
            stall,
            self.metrics.clone(),
            self.first_answer_timeout,
        ));
        rx
    }
}

/// A Destination client with the proxy's explicit message limit.
fn client(channel: Channel) -> DestinationClient<Channel> {
    DestinationClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES)
}

/// Updates applied together when they have already arrived, at most.
const COALESCE: usize = 256;

/// How long a stream must have been silent before a stall report makes
/// discovery re-subscribe.
const STALL_QUIET: Duration = Duration::from_secs(1);

/// How one stream attempt ended.
struct Ended {
    error: StreamError,
    reason: EndReason,
}

/// Why a stream attempt ended: the `reason` label of
/// `tether_proxy_discovery_reconnects_total`, and what decides the pause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EndReason {
    /// The control plane ended the stream (a replica shutting down).
    Ended,
    /// Re-subscribing after a stall report.
    Stalled,
    /// No first answer within the first-answer timeout.
    Silent,
    MessageTooLarge,
    /// The control plane refused the authority (a definitive answer).
    Rejected,
    Error,
}

impl EndReason {
    fn as_str(self) -> &'static str {
        match self {
            Self::Ended => "ended",
            Self::Stalled => "stalled",
            Self::Silent => "silent",
            Self::MessageTooLarge => "message_too_large",
            Self::Rejected => "rejected",
            Self::Error => "error",
        }
    }

    /// An orderly end, a stall or a silent replica is retried at once on
    /// the next replica; failures back off.
    fn retries_at_once(self) -> bool {
        matches!(self, Self::Ended | Self::Stalled | Self::Silent)
    }
}

async fn resolve_task(
    authority: String,
    controls: Arc<ControlPlanes>,
    tx: watch::Sender<Resolution>,
    stall: Stall,
    metrics: crate::metrics::ProxyMetrics,
    first_answer_timeout: Duration,
) {
    let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
    let mut next = 0usize;
    loop {
        let ended = tokio::select! {
            ended = follow(&authority, &controls, next, &tx, &stall, first_answer_timeout, &mut backoff) => ended,
            _ = tx.closed() => return,
        };
        if ended.reason == EndReason::Rejected {
            // A definitive answer: this authority is not served. Ask again
            // later (the outbound side drops it as soon as it is idle).
            tracing::debug!(%authority, error = %ended.error, "control plane rejected the authority");
            tokio::select! {
                _ = tokio::time::sleep(INVALID_RETRY) => {}
                _ = tx.closed() => return,
            }
            continue;
        }
        match &ended.error {
            StreamError::TooLarge(_) => {
                tracing::warn!(%authority, error = %ended.error, "discovery stream lost: message too large; reconnecting")
            }
            StreamError::Unreachable(_) => {
                tracing::info!(%authority, error = %ended.error, "discovery stream lost; reconnecting")
            }
        }
        metrics.discovery_reconnect(ended.reason.as_str());
        tx.send_modify(|r| r.last_error = Some(ended.error));
        next += 1;
        let pause = if ended.reason.retries_at_once() {
            jittered(BACKOFF_MIN, rand::random())
        } else {
            backoff.next_pause(rand::random())
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = tx.closed() => return,
        }
    }
}

/// Follows one stream from the `attempt`-th control plane until it ends.
async fn follow(
    authority: &str,
    controls: &ControlPlanes,
    attempt: usize,
    tx: &watch::Sender<Resolution>,
    stall: &Stall,
    first_answer_timeout: Duration,
    backoff: &mut Backoff,
) -> Ended {
    let unreachable = |e: String| Ended {
        error: StreamError::Unreachable(e),
        reason: EndReason::Error,
    };
    let failed = |addr: SocketAddr, status: tonic::Status| {
        let message = bounded(&status_chain(&status));
        if is_too_large(&status) {
            Ended {
                error: StreamError::TooLarge(format!(
                    "control plane {addr}: message too large: {message}"
                )),
                reason: EndReason::MessageTooLarge,
            }
        } else {
            unreachable(format!("control plane {addr} unreachable: {message}"))
        }
    };
    let picked = match controls.pick_one(attempt).await {
        Ok(p) => p,
        Err(e) => return unreachable(e),
    };
    let addr = picked.addr;
    let req = GetDestination {
        scheme: "k8s".into(),
        path: authority.to_string(),
        // Every priority tier, so the balancer can fail over by itself.
        context_token: tether_core::registry::TIERS_CONTEXT_TOKEN.into(),
    };
    let mut client = client(picked.channel);
    // When another replica could answer instead: the call's response
    // headers within the first-answer timeout (a hung replica never sends
    // them), and the first update within ten times that — a large first
    // set may take a while to arrive in batches, and is not a hung replica.
    let first = async {
        let call = client.get(req);
        let mut stream = if picked.of > 1 {
            tokio::time::timeout(first_answer_timeout, call)
                .await
                .map_err(|_| tonic::Status::deadline_exceeded("no response headers"))?
        } else {
            call.await
        }?
        .into_inner();
        let first = stream.message().await?;
        Ok::<_, tonic::Status>((stream, first))
    };
    let answer = if picked.of > 1 {
        match tokio::time::timeout(first_answer_timeout * 10, first).await {
            Ok(Err(status)) if status.code() == tonic::Code::DeadlineExceeded => Err(()),
            Ok(result) => Ok(result),
            Err(_) => Err(()),
        }
    } else {
        Ok(first.await)
    };
    let (mut stream, first) = match answer {
        Err(()) => {
            return Ended {
                error: StreamError::Unreachable(format!(
                    "control plane {addr} unreachable: no answer within {first_answer_timeout:?}; trying another replica"
                )),
                reason: EndReason::Silent,
            }
        }
        Ok(Err(status)) if status.code() == tonic::Code::InvalidArgument => {
            let reason = bounded(status.message());
            tx.send_modify(|r| {
                r.answered = true;
                r.exists = false;
                r.endpoints = Arc::default();
                r.last_error = None;
                r.rejected = Some(reason.clone());
                r.last_update = Some(Instant::now());
            });
            controls.answered(addr);
            return Ended {
                error: StreamError::Unreachable(format!(
                    "control plane {addr} rejected {authority}: {reason}"
                )),
                reason: EndReason::Rejected,
            };
        }
        Ok(Err(status)) => return failed(addr, status),
        Ok(Ok((_, None))) => {
            return Ended {
                error: StreamError::Unreachable(format!("control plane {addr} ended the stream")),
                reason: EndReason::Ended,
            }
        }
        Ok(Ok((stream, Some(first)))) => (stream, first),
    };
    controls.answered(addr);
    let mut pending = vec![first];
    let mut fresh = true;
    loop {
        // Whatever else has already arrived goes in the same publication.
        let mut end = None;
        while pending.len() < COALESCE {
            match futures::FutureExt::now_or_never(stream.message()) {
                Some(Ok(Some(up))) => pending.push(up),
                Some(other) => {
                    end = Some(other);
                    break;
                }
                None => break,
            }
        }
        apply(tx, std::mem::take(&mut pending), fresh);
        fresh = false;
        backoff.reset();
        let last = Instant::now();
        let msg = if let Some(end) = end {
            end
        } else {
            loop {
                tokio::select! {
                    m = stream.message() => break m,
                    _ = stall.notified() => {
                        if last.elapsed() >= STALL_QUIET {
                            return Ended {
                                error: StreamError::Unreachable(format!(
                                    "stream from {addr} stalled: every endpoint is failing and no update came"
                                )),
                                reason: EndReason::Stalled,
                            };
                        }
                    }
                }
            }
        };
        match msg {
            Ok(Some(up)) => pending.push(up),
            Ok(None) => {
                return Ended {
                    error: StreamError::Unreachable(format!(
                        "control plane {addr} ended the stream"
                    )),
                    reason: EndReason::Ended,
                }
            }
            Err(status) => return failed(addr, status),
        }
    }
}

/// What is known about a service's outbound policy.
#[derive(Clone, Debug, Default)]
pub enum PolicyState {
    /// No answer yet.
    #[default]
    Pending,
    /// The policy in force; `None`: none (the default path).
    Settled(Option<Arc<crate::policy::ClientPolicy>>),
}

/// Follows one `OutboundPolicies.Watch` stream until it ends; says how long
/// to pause before the next.
async fn follow_policy(
    authority: &str,
    controls: &ControlPlanes,
    attempt: usize,
    tx: &watch::Sender<PolicyState>,
    metrics: &crate::metrics::ProxyMetrics,
    first_answer_timeout: Duration,
    backoff: &mut Backoff,
) -> Duration {
    use linkerd2_proxy_api::outbound::{
        outbound_policies_client::OutboundPoliciesClient, traffic_spec, TrafficSpec,
    };
    // Before any policy arrived, a failure means "no policy": requests go
    // the default way rather than wait. After, the last good one stays.
    let settle_none = || {
        tx.send_if_modified(|s| {
            matches!(s, PolicyState::Pending)
                .then(|| *s = PolicyState::Settled(None))
                .is_some()
        });
    };
    let picked = match controls.pick_one(attempt).await {
        Ok(p) => p,
        Err(e) => {
            tracing::debug!(%authority, error = %e, "outbound policy: no control plane");
            settle_none();
            return backoff.next_pause(rand::random());
        }
    };
    let addr = picked.addr;
    let mut client =
        OutboundPoliciesClient::new(picked.channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let spec = TrafficSpec {
        source_workload: String::new(),
        target: Some(traffic_spec::Target::Authority(authority.to_string())),
    };
    let first = async {
        let mut stream = client.watch(spec).await?.into_inner();
        let first = stream.message().await?;
        Ok::<_, tonic::Status>((stream, first))
    };
    let answer = if picked.of > 1 {
        tokio::time::timeout(first_answer_timeout, first)
            .await
            .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no first answer")))
    } else {
        first.await
    };
    let (mut stream, first) = match answer {
        Ok((stream, Some(first))) => (stream, first),
        Ok((_, None)) => return jittered(BACKOFF_MIN, rand::random()),
        Err(status)
            if matches!(
                status.code(),
                tonic::Code::NotFound | tonic::Code::Unimplemented | tonic::Code::InvalidArgument
            ) =>
        {
            // The control plane has no policy for this authority (or does
            // not serve policies): today's behaviour, and ask again later
            // in case a service or a newer replica appears.
            tracing::debug!(%authority, control = %addr, code = ?status.code(), "no outbound policy");
            controls.answered(addr);
            tx.send_if_modified(|s| {
                let changed = !matches!(s, PolicyState::Settled(None));
                *s = PolicyState::Settled(None);
                changed
            });
            backoff.reset();
            return jittered(
                if status.code() == tonic::Code::NotFound {
                    NO_POLICY_RETRY
                } else {
                    INVALID_RETRY
                },
                rand::random(),
            );
        }
        Err(status) => {
            tracing::debug!(%authority, control = %addr, error = %bounded(status.message()), "outbound policy stream failed");
            settle_none();
            return backoff.next_pause(rand::random());
        }
    };
    controls.answered(addr);
    backoff.reset();
    let mut next = Some(first);
    let mut last_refusal_log: Option<Instant> = None;
    loop {
        if let Some(policy) = next.take() {
            match crate::policy::ClientPolicy::from_api(policy) {
                Ok(p) => {
                    tx.send_replace(PolicyState::Settled(Some(Arc::new(p))));
                }
                Err(e) => {
                    metrics.outbound_policy_refused.inc();
                    settle_none();
                    // At most one line per 10 s per stream, however fast
                    // bad policies come.
                    if last_refusal_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                        last_refusal_log = Some(Instant::now());
                        tracing::warn!(%authority, control = %addr, error = %e, "outbound policy refused; the last good one stays in force");
                    }
                }
            }
        }
        match stream.message().await {
            Ok(Some(p)) => next = Some(p),
            Ok(None) => return jittered(BACKOFF_MIN, rand::random()),
            Err(status) => {
                tracing::debug!(%authority, control = %addr, error = %bounded(status.message()), "outbound policy stream lost");
                return backoff.next_pause(rand::random());
            }
        }
    }
}

/// Applies updates that arrived together; with `fresh` (a new stream's
/// first), the first `Add` or `NoEndpoints` replaces what was known.
fn apply(
    tx: &watch::Sender<Resolution>,
    updates: Vec<linkerd2_proxy_api::destination::Update>,
    mut fresh: bool,
) {
    tx.send_modify(|r| {
        // Cloned only when a balancer still holds the previous set.
        let endpoints = Arc::make_mut(&mut r.endpoints);
        for up in updates {
            if fresh {
                endpoints.clear();
                fresh = false;
            }
            match up.update {
                Some(update::Update::Add(set)) => {
                    for ep in set.addrs.into_iter().filter_map(Endpoint::from_api) {
                        endpoints.insert(ep.addr, ep);
                    }
                    r.exists = true;
                }
                Some(update::Update::Remove(set)) => {
                    for a in set.addrs {
                        if let (Some(ip), Ok(port)) = (a.ip, u16::try_from(a.port)) {
                            if let Ok(ip) = std::net::IpAddr::try_from(ip) {
                                endpoints.remove(&SocketAddr::new(ip, port));
                            }
                        }
                    }
                }
                Some(update::Update::NoEndpoints(ne)) => {
                    endpoints.clear();
                    r.exists = ne.exists;
                }
                None => {}
            }
        }
        r.answered = true;
        r.last_error = None;
        r.rejected = None;
        r.last_update = Some(Instant::now());
    });
}

/// A service's response timeout, as the control plane sends it: the
/// timeout of a route matching every path (`.*`). Zero means none.
fn profile_response_timeout(
    profile: &linkerd2_proxy_api::destination::DestinationProfile,
) -> Option<Duration> {
    use linkerd2_proxy_api::destination::request_match::Match;
    profile.routes.iter().find_map(|route| {
        let everything = matches!(
            route.condition.as_ref().and_then(|c| c.r#match.as_ref()),
            Some(Match::Path(p)) if p.regex == ".*"
        );
        route
            .timeout
            .filter(|_| everything)
            .and_then(|t| Duration::try_from(t).ok())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use linkerd2_proxy_api::destination::{
        destination_server::{Destination, DestinationServer},
        DestinationProfile, Update, WeightedAddrSet,
    };
    use linkerd2_proxy_api::net::TcpAddress;
    use std::pin::Pin;

    type Updates = Pin<Box<dyn futures::Stream<Item = Result<Update, tonic::Status>> + Send>>;
    type Profiles =
        Pin<Box<dyn futures::Stream<Item = Result<DestinationProfile, tonic::Status>> + Send>>;

    /// A control plane that answers every `Get` with `endpoints` endpoints
    /// in one `Add`, then holds the stream open.
    #[derive(Clone)]
    struct OneAdd {
        endpoints: u32,
    }

    fn add(n: u32) -> Update {
        let addrs = (0..n)
            .map(|i| WeightedAddr {
                addr: Some(TcpAddress::from(SocketAddr::from((
                    [10, (i >> 16) as u8, (i >> 8) as u8, i as u8],
                    8080,
                )))),
                weight: 1,
                // About 110 bytes each, like an endpoint with a pod name
                // and an identity.
                metric_labels: HashMap::from([(
                    "pod".into(),
                    format!("web-{i:08}.{}", "x".repeat(80)),
                )]),
                ..Default::default()
            })
            .collect();
        Update {
            update: Some(update::Update::Add(WeightedAddrSet {
                addrs,
                metric_labels: HashMap::new(),
            })),
        }
    }

    #[tonic::async_trait]
    impl Destination for OneAdd {
        type GetStream = Updates;
        type GetProfileStream = Profiles;

        async fn get(
            &self,
            _: tonic::Request<GetDestination>,
        ) -> Result<tonic::Response<Updates>, tonic::Status> {
            let first = futures::stream::iter([Ok(add(self.endpoints))]);
            Ok(tonic::Response::new(Box::pin(futures::StreamExt::chain(
                first,
                futures::stream::pending(),
            ))))
        }

        async fn get_profile(
            &self,
            _: tonic::Request<GetDestination>,
        ) -> Result<tonic::Response<Profiles>, tonic::Status> {
            Ok(tonic::Response::new(Box::pin(futures::stream::pending())))
        }
    }

    /// Serves `dst` on a loopback `ip`, without any sending limit.
    async fn serve(ip: [u8; 4], dst: OneAdd) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind(SocketAddr::from((ip, 0)))
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let incoming = futures::stream::unfold(listener, |l| async move {
            let conn = l.accept().await.map(|(s, _)| s);
            Some((conn, l))
        });
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DestinationServer::new(dst).max_encoding_message_size(usize::MAX))
                .serve_with_incoming(incoming),
        );
        addr
    }

    fn discovery(controls: &[SocketAddr], first_answer: Duration) -> Discovery {
        let targets: Vec<String> = controls.iter().map(|a| a.to_string()).collect();
        Discovery::new(
            ControlPlanes::new(&targets, None).unwrap(),
            crate::metrics::ProxyMetrics::default(),
        )
        .with_first_answer_timeout(first_answer)
    }

    async fn wait_for(
        rx: &mut watch::Receiver<Resolution>,
        what: impl FnMut(&Resolution) -> bool,
    ) -> Resolution {
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(what))
            .await
            .expect("within 10 s")
            .unwrap()
            .clone()
    }

    #[tokio::test]
    async fn an_update_over_the_limit_is_named_as_such() {
        // 40,000 endpoints: about 4.4 MB in one message.
        let control = serve([127, 0, 0, 1], OneAdd { endpoints: 40_000 }).await;
        let d = discovery(&[control], DEFAULT_FIRST_ANSWER_TIMEOUT);
        let mut rx = d.resolve("web.demo.svc.cluster.local:8080", Stall::default());
        let r = wait_for(&mut rx, |r| r.last_error.is_some()).await;
        let Some(StreamError::TooLarge(e)) = &r.last_error else {
            panic!("{:?}", r.last_error)
        };
        assert!(e.contains("message too large"), "{e}");
        assert!(e.contains("decoded message length too large"), "{e}");
        assert!(!r.answered);
        let text = {
            let mut registry = prometheus_client::registry::Registry::default();
            d.metrics.register(&mut registry);
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
            text
        };
        assert!(
            text.contains(r#"tether_proxy_discovery_reconnects_total{reason="message_too_large"}"#),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_silent_replica_gets_the_first_answer_timeout_then_the_next_answers() {
        // Accepts connections (the kernel does) and never answers, like a
        // stopped replica. It sorts first, so it is tried first.
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let live = serve([127, 0, 0, 2], OneAdd { endpoints: 3 }).await;
        let first_answer = Duration::from_millis(200);
        let d = discovery(&[silent.local_addr().unwrap(), live], first_answer);
        let mut rx = d.resolve("web.demo.svc.cluster.local:8080", Stall::default());
        let r = wait_for(&mut rx, |r| r.last_error.is_some() || r.answered).await;
        let Some(StreamError::Unreachable(e)) = &r.last_error else {
            panic!("the silent replica answered? {r:?}")
        };
        assert!(e.contains("no answer within 200ms"), "{e}");
        let r = wait_for(&mut rx, |r| r.answered).await;
        assert_eq!(r.endpoints.len(), 3);
        assert!(r.last_error.is_none());

        // New streams start with the replica that answered.
        let mut other = d.resolve("api.demo.svc.cluster.local:8080", Stall::default());
        let r = wait_for(&mut other, |r| r.last_error.is_some() || r.answered).await;
        assert!(r.answered && r.last_error.is_none(), "{r:?}");
    }

    #[tokio::test]
    async fn updates_that_arrived_together_are_published_together() {
        let (tx, mut rx) = watch::channel(Resolution::default());
        let mut published = 0;
        let batch = |from: u32| {
            let mut u = add(from + 2);
            if let Some(update::Update::Add(set)) = &mut u.update {
                set.addrs.drain(..from as usize);
            }
            u
        };
        apply(&tx, vec![batch(0), batch(2), batch(4)], true);
        if rx.has_changed().unwrap() {
            published += 1;
        }
        assert_eq!(rx.borrow_and_update().endpoints.len(), 6);
        assert_eq!(published, 1);
        // A fresh stream's first Add replaces; later ones add.
        apply(&tx, vec![batch(10)], true);
        assert_eq!(rx.borrow().endpoints.len(), 2);
        apply(&tx, vec![batch(20)], false);
        assert_eq!(rx.borrow().endpoints.len(), 4);
    }

    fn remove(addrs: &[SocketAddr]) -> Update {
        Update {
            update: Some(update::Update::Remove(
                linkerd2_proxy_api::destination::AddrSet {
                    addrs: addrs.iter().map(|a| TcpAddress::from(*a)).collect(),
                },
            )),
        }
    }

    fn no_endpoints(exists: bool) -> Update {
        Update {
            update: Some(update::Update::NoEndpoints(
                linkerd2_proxy_api::destination::NoEndpoints { exists },
            )),
        }
    }

    fn addrs(tx: &watch::Sender<Resolution>) -> Vec<SocketAddr> {
        tx.borrow().endpoints.keys().copied().collect()
    }

    #[test]
    fn apply_follows_the_protocol() {
        let tx = watch::Sender::new(Resolution::default());
        let ep = |i: u8| SocketAddr::from(([10, 0, 0, i], 8080));
        // A new stream's first Add replaces whatever was known.
        apply(&tx, vec![add(3)], true);
        assert_eq!(addrs(&tx), [ep(0), ep(1), ep(2)]);
        assert!(tx.borrow().answered && tx.borrow().exists);
        // Later Adds add, Removes remove, in the order they came.
        apply(&tx, vec![remove(&[ep(1)]), add(1)], false);
        assert_eq!(addrs(&tx), [ep(0), ep(2)]);
        apply(&tx, vec![add(2)], false);
        assert_eq!(addrs(&tx), [ep(0), ep(1), ep(2)]);
        // A reconnect's first answer starts over: nothing stale survives.
        apply(&tx, vec![add(1)], true);
        assert_eq!(addrs(&tx), [ep(0)]);
        // NoEndpoints clears and says whether the service exists.
        apply(&tx, vec![no_endpoints(false)], false);
        assert!(addrs(&tx).is_empty());
        assert!(!tx.borrow().exists);
        apply(&tx, vec![no_endpoints(true)], true);
        assert!(tx.borrow().exists && tx.borrow().last_error.is_none());
    }

    /// A control plane whose `OutboundPolicies.Watch` streams what the test
    /// sends, or answers `NotFound` when told so.
    #[derive(Clone)]
    struct Policies {
        streams: Arc<Mutex<Vec<tokio::sync::mpsc::Receiver<PolicyItem>>>>,
    }

    type PolicyItem = Result<linkerd2_proxy_api::outbound::OutboundPolicy, tonic::Status>;

    type PolicyStream = Pin<
        Box<
            dyn futures::Stream<
                    Item = Result<linkerd2_proxy_api::outbound::OutboundPolicy, tonic::Status>,
                > + Send,
        >,
    >;

    #[tonic::async_trait]
    impl linkerd2_proxy_api::outbound::outbound_policies_server::OutboundPolicies for Policies {
        type WatchStream = PolicyStream;

        async fn get(
            &self,
            _: tonic::Request<linkerd2_proxy_api::outbound::TrafficSpec>,
        ) -> Result<tonic::Response<linkerd2_proxy_api::outbound::OutboundPolicy>, tonic::Status>
        {
            Err(tonic::Status::unimplemented("watch only"))
        }

        async fn watch(
            &self,
            _: tonic::Request<linkerd2_proxy_api::outbound::TrafficSpec>,
        ) -> Result<tonic::Response<PolicyStream>, tonic::Status> {
            let next = self.streams.lock().unwrap().pop();
            match next {
                Some(rx) => Ok(tonic::Response::new(Box::pin(tokio_stream_from(rx)))),
                None => Err(tonic::Status::not_found("no such service")),
            }
        }
    }

    fn tokio_stream_from<T: Send + 'static>(
        rx: tokio::sync::mpsc::Receiver<T>,
    ) -> impl futures::Stream<Item = T> + Send {
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|t| (t, rx)) })
    }

    async fn serve_policies(policies: Policies) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let incoming = futures::stream::unfold(listener, |l| async move {
            let conn = l.accept().await.map(|(s, _)| s);
            Some((conn, l))
        });
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(
                    linkerd2_proxy_api::outbound::outbound_policies_server::OutboundPoliciesServer::new(
                        policies,
                    ),
                )
                .serve_with_incoming(incoming),
        );
        addr
    }

    async fn policy_where(
        rx: &mut watch::Receiver<PolicyState>,
        what: impl FnMut(&PolicyState) -> bool,
    ) -> PolicyState {
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(what))
            .await
            .expect("within 10 s")
            .unwrap()
            .clone()
    }

    fn backends_of(state: &PolicyState) -> Vec<String> {
        let PolicyState::Settled(Some(p)) = state else {
            return Vec::new();
        };
        p.routes(http::Version::HTTP_11).unwrap()[0].rules[0]
            .backends
            .list
            .iter()
            .map(|b| b.authority.clone())
            .collect()
    }

    #[tokio::test]
    async fn a_refused_policy_leaves_the_last_good_one_in_force() {
        use crate::policy::tests::{detect, route, rule};
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let control = serve_policies(Policies {
            streams: Arc::new(Mutex::new(vec![rx])),
        })
        .await;
        let d = discovery(&[control], DEFAULT_FIRST_ANSWER_TIMEOUT);
        let (state, mut watched) = watch::channel(PolicyState::Pending);
        let stop = Shutdown::default();
        d.watch_policy("web.demo.svc.cluster.local:8080", state, stop.clone());

        let good = detect(vec![route(
            "split",
            vec![rule(vec![], &[("Web-V2.demo:8080", 1)])],
        )]);
        tx.send(Ok(good)).await.unwrap();
        let s = policy_where(&mut watched, |s| matches!(s, PolicyState::Settled(Some(_)))).await;
        assert_eq!(backends_of(&s), ["web-v2.demo:8080"]);

        // An invalid regex: refused, counted, and the last good one stays.
        let bad = detect(vec![route(
            "broken",
            vec![rule(
                vec![linkerd2_proxy_api::http_route::HttpRouteMatch {
                    path: Some(linkerd2_proxy_api::http_route::PathMatch {
                        kind: Some(linkerd2_proxy_api::http_route::path_match::Kind::Regex(
                            "(".into(),
                        )),
                    }),
                    ..Default::default()
                }],
                &[("other.demo:8080", 1)],
            )],
        )]);
        tx.send(Ok(bad)).await.unwrap();
        let newer = detect(vec![route(
            "next",
            vec![rule(vec![], &[("web-v3.demo:8080", 1)])],
        )]);
        tx.send(Ok(newer)).await.unwrap();
        let s = policy_where(&mut watched, |s| backends_of(s) != ["web-v2.demo:8080"]).await;
        assert_eq!(
            backends_of(&s),
            ["web-v3.demo:8080"],
            "the bad policy was never in force"
        );
        assert_eq!(d.metrics.outbound_policy_refused.get(), 1);

        // The stream ends and the service is gone: NotFound means no policy.
        drop(tx);
        policy_where(&mut watched, |s| matches!(s, PolicyState::Settled(None))).await;
        stop.trigger();
    }

    #[tokio::test]
    async fn no_policy_and_no_control_plane_settle_at_once() {
        let control = serve_policies(Policies {
            streams: Arc::default(),
        })
        .await;
        let d = discovery(&[control], DEFAULT_FIRST_ANSWER_TIMEOUT);
        let (state, mut watched) = watch::channel(PolicyState::Pending);
        d.watch_policy(
            "web.demo.svc.cluster.local:8080",
            state,
            Shutdown::default(),
        );
        policy_where(&mut watched, |s| matches!(s, PolicyState::Settled(None))).await;

        // Nothing listens: a closed port answers at once.
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let d = discovery(&[closed], DEFAULT_FIRST_ANSWER_TIMEOUT);
        let (state, mut watched) = watch::channel(PolicyState::Pending);
        d.watch_policy(
            "web.demo.svc.cluster.local:8080",
            state,
            Shutdown::default(),
        );
        policy_where(&mut watched, |s| matches!(s, PolicyState::Settled(None))).await;
    }
}
