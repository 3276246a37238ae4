//! The discovery client: one `Destination.Get` stream per authority,
//! published as a `watch` of the latest [`Resolution`] that every request
//! for that authority reads.
//!
//! The stream reconnects with exponential backoff and jitter, moving to the
//! next control-plane address on each failure. Until a new stream answers,
//! the last known endpoints stay in force; the first answer on a new stream
//! replaces them wholesale (the control plane always starts a stream with the
//! full state).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use linkerd2_proxy_api::destination::{
    destination_client::DestinationClient, protocol_hint, tls_identity, update, GetDestination,
    WeightedAddr,
};
use rand::Rng;
use tokio::sync::watch;
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
}

#[derive(Clone)]
pub struct Discovery {
    channels: Arc<[(String, Channel)]>,
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// How often to re-ask about an authority the control plane called invalid.
const INVALID_RETRY: Duration = Duration::from_secs(30);

impl Discovery {
    pub fn new(addrs: &[String]) -> Result<Self, ProxyStartError> {
        let mut channels = Vec::new();
        for addr in addrs {
            let uri = format!("http://{addr}");
            let endpoint = TonicEndpoint::from_shared(uri)
                .map_err(|_| ProxyStartError::ControlAddr(addr.clone()))?
                .connect_timeout(Duration::from_secs(1))
                .http2_keep_alive_interval(Duration::from_secs(10))
                .keep_alive_timeout(Duration::from_secs(5))
                .keep_alive_while_idle(true);
            channels.push((addr.clone(), endpoint.connect_lazy()));
        }
        Ok(Self {
            channels: channels.into(),
        })
    }

    /// The control-plane channels, for other APIs (identity) to share.
    pub fn channels(&self) -> Vec<(String, Channel)> {
        self.channels.to_vec()
    }

    /// Starts resolving `authority`. The stream lives as long as any
    /// receiver does.
    pub fn resolve(&self, authority: &str) -> watch::Receiver<Resolution> {
        let (tx, rx) = watch::channel(Resolution::default());
        tokio::spawn(resolve_task(
            authority.to_string(),
            self.channels.clone(),
            tx,
        ));
        rx
    }
}

fn jittered(d: Duration) -> Duration {
    d.mul_f64(rand::rng().random_range(0.5..1.0))
}

async fn resolve_task(
    authority: String,
    channels: Arc<[(String, Channel)]>,
    tx: watch::Sender<Resolution>,
) {
    let mut backoff = BACKOFF_MIN;
    let mut next = 0usize;
    loop {
        let (addr, channel) = &channels[next % channels.len()];
        let mut client = DestinationClient::new(channel.clone());
        let req = GetDestination {
            scheme: "k8s".into(),
            path: authority.clone(),
            ..Default::default()
        };
        let mut wait = None;
        let error = tokio::select! {
            res = client.get(req) => match res {
                Ok(rsp) => {
                    let mut stream = rsp.into_inner();
                    let mut fresh = true;
                    loop {
                        let msg = tokio::select! {
                            m = stream.message() => m,
                            _ = tx.closed() => return,
                        };
                        match msg {
                            Ok(Some(up)) => {
                                apply(&tx, up, fresh);
                                fresh = false;
                                backoff = BACKOFF_MIN;
                            }
                            Ok(None) => break format!("control plane {addr} ended the stream"),
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
                    });
                    wait = Some(INVALID_RETRY);
                    format!("control plane {addr} rejected {authority}: {}", status.message())
                }
                Err(status) => format!("control plane {addr} unreachable: {}", status.message()),
            },
            _ = tx.closed() => return,
        };
        tracing::debug!(%authority, %error, "discovery stream lost; reconnecting");
        if wait.is_none() {
            tx.send_modify(|r| r.last_error = Some(error));
            next += 1;
        }
        let pause = wait.unwrap_or_else(|| jittered(backoff));
        backoff = (backoff * 2).min(BACKOFF_MAX);
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
    });
}
