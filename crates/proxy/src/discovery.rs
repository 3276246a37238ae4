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
//! A stream can also be alive but stale: open, silent, while every endpoint
//! it gave refuses connections. The outbound side reports that through a
//! [`Stall`] signal; if no update has arrived for a while, the stream is
//! dropped and discovery re-subscribes (to the next control plane).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use linkerd2_proxy_api::destination::{
    destination_client::DestinationClient, protocol_hint, tls_identity, update, GetDestination,
    WeightedAddr,
};
use rand::Rng;
use tether_admin::Shutdown;
use tokio::sync::{watch, Notify};
use tonic::transport::{Channel, Endpoint as TonicEndpoint};

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
    pub last_error: Option<String>,
    /// When the last update arrived.
    pub last_update: Option<Instant>,
}

/// Raised by the outbound side when every endpoint of a service is failing.
pub type Stall = Arc<Notify>;

/// The control planes a proxy may talk to, tried in turn.
pub struct ControlPlanes {
    targets: Vec<String>,
    channels: Mutex<HashMap<SocketAddr, Channel>>,
}

impl ControlPlanes {
    pub fn new(targets: &[String]) -> Result<Arc<Self>, ProxyStartError> {
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
            channels: Mutex::default(),
        }))
    }

    /// The `attempt`-th control plane, in rotation over every address the
    /// targets resolve to right now.
    pub async fn pick(&self, attempt: usize) -> Result<(SocketAddr, Channel), String> {
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
        let addr = addrs[attempt % addrs.len()];
        let mut channels = self.channels.lock().unwrap();
        let channel = channels
            .entry(addr)
            .or_insert_with(|| {
                TonicEndpoint::from_shared(format!("http://{addr}"))
                    .expect("a socket address is a valid URI")
                    .connect_timeout(Duration::from_secs(1))
                    .http2_keep_alive_interval(Duration::from_secs(10))
                    .keep_alive_timeout(Duration::from_secs(5))
                    .keep_alive_while_idle(true)
                    .connect_lazy()
            })
            .clone();
        Ok((addr, channel))
    }
}

#[derive(Clone)]
pub struct Discovery {
    controls: Arc<ControlPlanes>,
    metrics: crate::metrics::ProxyMetrics,
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How often to re-ask about an authority the control plane called invalid.
const INVALID_RETRY: Duration = Duration::from_secs(30);

impl Discovery {
    pub fn new(controls: Arc<ControlPlanes>, metrics: crate::metrics::ProxyMetrics) -> Self {
        Self { controls, metrics }
    }

    /// Follows `authority`'s profile and applies its retry budget (the
    /// registry's per-service override) to `budget`; `default` otherwise.
    pub fn watch_profile(
        &self,
        authority: &str,
        budget: Arc<crate::retry::RetryBudget>,
        default: crate::retry::BudgetSpec,
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
                    let mut stream = DestinationClient::new(channel)
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
                    }
                    Ok::<(), String>(())
                };
                tokio::select! {
                    _ = followed => {}
                    _ = stop.triggered() => return,
                }
                attempt += 1;
                tokio::select! {
                    _ = tokio::time::sleep(jittered(BACKOFF_MAX)) => {}
                    _ = stop.triggered() => return,
                }
            }
        });
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
        ));
        rx
    }
}

fn jittered(d: Duration) -> Duration {
    d.mul_f64(rand::rng().random_range(0.5..1.0))
}

/// How long a stream must have been silent before a stall report makes
/// discovery re-subscribe.
const STALL_QUIET: Duration = Duration::from_secs(1);

async fn resolve_task(
    authority: String,
    controls: Arc<ControlPlanes>,
    tx: watch::Sender<Resolution>,
    stall: Stall,
    metrics: crate::metrics::ProxyMetrics,
) {
    let mut backoff = BACKOFF_MIN;
    let mut next = 0usize;
    loop {
        let mut wait = None;
        let mut reason = "error";
        let error = match controls.pick(next).await {
            Err(e) => e,
            Ok((addr, channel)) => {
                let mut client = DestinationClient::new(channel);
                let req = GetDestination {
                    scheme: "k8s".into(),
                    path: authority.clone(),
                    ..Default::default()
                };
                tokio::select! {
                    res = client.get(req) => match res {
                        Ok(rsp) => {
                            let mut stream = rsp.into_inner();
                            let mut fresh = true;
                            let mut last = Instant::now();
                            loop {
                                let msg = tokio::select! {
                                    m = stream.message() => m,
                                    _ = stall.notified() => {
                                        if last.elapsed() >= STALL_QUIET {
                                            reason = "stalled";
                                            break format!("stream from {addr} stalled: every endpoint is failing and no update came");
                                        }
                                        continue;
                                    }
                                    _ = tx.closed() => return,
                                };
                                match msg {
                                    Ok(Some(up)) => {
                                        apply(&tx, up, fresh);
                                        fresh = false;
                                        last = Instant::now();
                                        backoff = BACKOFF_MIN;
                                    }
                                    Ok(None) => {
                                        reason = "ended";
                                        break format!("control plane {addr} ended the stream");
                                    }
                                    Err(status) => break format!("control plane {addr}: {}", status.message()),
                                }
                            }
                        }
                        Err(status) if status.code() == tonic::Code::InvalidArgument => {
                            // A definitive answer: this is not a service name.
                            tx.send_modify(|r| {
                                r.answered = true;
                                r.exists = false;
                                r.endpoints = Arc::default();
                                r.last_error = None;
                                r.last_update = Some(Instant::now());
                            });
                            wait = Some(INVALID_RETRY);
                            format!("control plane {addr} rejected {authority}: {}", status.message())
                        }
                        Err(status) => format!("control plane {addr} unreachable: {}", status.message()),
                    },
                    _ = tx.closed() => return,
                }
            }
        };
        if wait.is_none() {
            tracing::info!(%authority, %error, "discovery stream lost; reconnecting");
            metrics.discovery_reconnect(reason);
            tx.send_modify(|r| r.last_error = Some(error));
            next += 1;
        }
        // An orderly end (a replica shutting down) or a stall is retried at
        // once on the next replica; failures back off.
        let pause = match (wait, reason) {
            (Some(w), _) => w,
            (None, "ended" | "stalled") => jittered(BACKOFF_MIN),
            _ => {
                let p = jittered(backoff);
                backoff = (backoff * 2).min(BACKOFF_MAX);
                p
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = tx.closed() => return,
        }
    }
}

fn apply(tx: &watch::Sender<Resolution>, up: linkerd2_proxy_api::destination::Update, fresh: bool) {
    tx.send_modify(|r| {
        let mut endpoints = if fresh {
            BTreeMap::new()
        } else {
            (*r.endpoints).clone()
        };
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
        r.endpoints = Arc::new(endpoints);
        r.answered = true;
        r.last_error = None;
        r.last_update = Some(Instant::now());
    });
}
