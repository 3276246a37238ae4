//! One watcher per link. It follows the remote control plane's export
//! stream (over mTLS, verifying the remote presents
//! `tether-control.<cluster>…` from the shared trust root) and probes the
//! remote gateway with an mTLS handshake (verifying the gateway identity
//! the export advertises; a bare TCP connect when it advertises none).
//!
//! A linked cluster is judged by what serves its traffic, its gateway:
//! - export and gateway fresh (heard within [`STALE`]): served;
//! - export stale but gateway fresh (the remote control plane is hung or
//!   down, its data plane is not): still served from the last known
//!   export, like a proxy keeps its last known endpoints when its control
//!   plane goes away — logged and exposed as `stale export, gateway
//!   healthy` (`tether_control_linked_cluster{state=...}`);
//! - gateway stale (or no export ever): dropped, and restored when both
//!   are back.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tether_core::backoff::Backoff;

use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tether_admin::Shutdown;
use tokio::net::TcpStream;

use super::export::{watch, ExportState};
use super::links::Link;
use crate::index::{Index, RemoteCluster};
use crate::metrics::{ControlMetrics, LinkLabels};

/// How long a remote may be silent (stream or gateway) before it is dropped.
pub const STALE: Duration = Duration::from_millis(1000);
pub const PROBE_EVERY: Duration = Duration::from_millis(200);
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

#[derive(Default)]
struct Seen {
    export: Option<(Instant, ExportState)>,
    gateway_ok: Option<Instant>,
}

/// Connects tonic to `addr` over mTLS, expecting `server_name`.
#[derive(Clone)]
struct TlsConnector {
    addr: String,
    server_name: ServerName<'static>,
    config: Arc<ClientConfig>,
}

impl tower_service::Service<http::Uri> for TlsConnector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let tcp =
                tokio::time::timeout(PROBE_TIMEOUT * 2, TcpStream::connect(this.addr.as_str()))
                    .await
                    .map_err(|_| {
                        std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out")
                    })??;
            let _ = tcp.set_nodelay(true);
            let expected = this.server_name.to_str().into_owned();
            // Say why a handshake failed (another trust root, another
            // identity), not just that the transport did.
            let tls = tokio_rustls::TlsConnector::from(this.config)
                .connect(this.server_name, tcp)
                .await
                .map_err(|e| std::io::Error::other(tether_identity::tls::explain(&e, &expected)))?;
            Ok(TokioIo::new(tls))
        })
    }
}

/// Runs the watcher for `link` until shutdown.
pub async fn run(
    link: Link,
    local_cluster: String,
    expected_identity: String,
    config: Arc<ClientConfig>,
    index: Index,
    shutdown: Shutdown,
) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    tokio::spawn(follow_export(
        link.clone(),
        local_cluster,
        expected_identity,
        config.clone(),
        seen.clone(),
        shutdown.clone(),
    ));
    let mut tick = tokio::time::interval(PROBE_EVERY);
    let mut was = LinkState::Dropped;
    publish_state(index.metrics(), &link.name, was);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.triggered() => return,
        }
        let (gateway, gateway_identity) = {
            let s = seen.lock().unwrap();
            let advertised = s.export.as_ref().map(|(_, e)| e);
            (
                link.gateway.or_else(|| {
                    advertised.and_then(|e| e.gateway_address.parse::<SocketAddr>().ok())
                }),
                advertised
                    .map(|e| e.gateway_identity.clone())
                    .filter(|id| !id.is_empty()),
            )
        };
        if let Some(gw) = gateway {
            if probe_gateway(gw, gateway_identity, &config).await {
                seen.lock().unwrap().gateway_ok = Some(Instant::now());
            }
        }
        let (state, remote) = {
            let s = seen.lock().unwrap();
            judge(&s, gateway, link.priority)
        };
        if state != was {
            match state {
                LinkState::Serving => {
                    tracing::info!(cluster = %link.name, "linked cluster reachable; its endpoints are served")
                }
                LinkState::StaleExport => tracing::warn!(
                    cluster = %link.name,
                    "stale export, gateway healthy: the linked cluster's control plane is silent but its gateway answers; serving its last known endpoints"
                ),
                LinkState::Dropped => {
                    tracing::warn!(cluster = %link.name, "linked cluster unreachable; dropped from answers")
                }
            }
            publish_state(index.metrics(), &link.name, state);
            was = state;
        }
        index.set_remote(&link.name, remote);
    }
}

/// Where a link stands (`tether_control_linked_cluster{state}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkState {
    Serving,
    /// Its control plane is silent, its gateway answers: last known export.
    StaleExport,
    Dropped,
}

impl LinkState {
    const ALL: [LinkState; 3] = [
        LinkState::Serving,
        LinkState::StaleExport,
        LinkState::Dropped,
    ];

    fn label(self) -> &'static str {
        match self {
            LinkState::Serving => "serving",
            LinkState::StaleExport => "stale_export_gateway_healthy",
            LinkState::Dropped => "dropped",
        }
    }
}

fn publish_state(metrics: &ControlMetrics, cluster: &str, now: LinkState) {
    for state in LinkState::ALL {
        metrics
            .links
            .get_or_create(&LinkLabels {
                cluster: cluster.to_string(),
                state: state.label().to_string(),
            })
            .set(i64::from(state == now));
    }
}

/// The link's state and what goes into the index, from what was seen: the
/// gateway decides whether the cluster is served, the export (however
/// old, once the gateway vouches for the cluster) what it serves.
fn judge(
    seen: &Seen,
    gateway: Option<SocketAddr>,
    priority: u32,
) -> (LinkState, Option<RemoteCluster>) {
    let fresh = |t: Instant| t.elapsed() < STALE;
    let (Some((at, state)), Some(gw_at), Some(gw)) = (&seen.export, seen.gateway_ok, gateway)
    else {
        return (LinkState::Dropped, None);
    };
    if !fresh(gw_at) {
        return (LinkState::Dropped, None);
    }
    let remote = RemoteCluster {
        priority,
        gateway: gw,
        gateway_identity: (!state.gateway_identity.is_empty())
            .then(|| state.gateway_identity.clone()),
        ready: state
            .services
            .iter()
            .map(|s| (s.global_id.clone(), s.ready_endpoints))
            .collect::<BTreeMap<_, _>>(),
    };
    let link_state = if fresh(*at) {
        LinkState::Serving
    } else {
        LinkState::StaleExport
    };
    (link_state, Some(remote))
}

/// Whether the gateway answers within [`PROBE_TIMEOUT`]: an mTLS handshake
/// in which it proves `identity` (the handshake the gateway expects, so it
/// has nothing to complain about), or, with no identity to check, a TCP
/// connect.
async fn probe_gateway(
    gw: SocketAddr,
    identity: Option<String>,
    config: &Arc<ClientConfig>,
) -> bool {
    let probe = async {
        let tcp = TcpStream::connect(gw).await.ok()?;
        let Some(name) = identity.and_then(|id| ServerName::try_from(id).ok()) else {
            return Some(());
        };
        let mut tls = tokio_rustls::TlsConnector::from(config.clone())
            .connect(name, tcp)
            .await
            .ok()?;
        // close_notify, so the gateway sees a clean end, not a broken one.
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut tls).await;
        Some(())
    };
    matches!(
        tokio::time::timeout(PROBE_TIMEOUT, probe).await,
        Ok(Some(()))
    )
}

async fn follow_export(
    link: Link,
    local_cluster: String,
    expected_identity: String,
    config: Arc<ClientConfig>,
    seen: Arc<Mutex<Seen>>,
    shutdown: Shutdown,
) {
    let Ok(server_name) = ServerName::try_from(expected_identity.clone()) else {
        tracing::error!(identity = %expected_identity, "not a valid TLS name; link disabled");
        return;
    };
    let connector = TlsConnector {
        addr: link.export.clone(),
        server_name,
        config,
    };
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut last_error: Option<String> = None;
    loop {
        let spoke = std::sync::atomic::AtomicBool::new(false);
        let attempt = async {
            let channel = tonic::transport::Endpoint::from_static("http://export.remote")
                .connect_timeout(PROBE_TIMEOUT * 2)
                .connect_with_connector(connector.clone())
                .await
                .map_err(|e| format!("connecting: {}", with_causes(&e)))?;
            let mut stream = watch(channel, &local_cluster)
                .await
                .map_err(|s| format!("Watch: {}", s.message()))?;
            loop {
                match tokio::time::timeout(STALE * 2, stream.message()).await {
                    Ok(Ok(Some(state))) => {
                        spoke.store(true, std::sync::atomic::Ordering::Relaxed);
                        seen.lock().unwrap().export = Some((Instant::now(), state));
                    }
                    Ok(Ok(None)) => return Err("stream ended".to_string()),
                    Ok(Err(s)) => return Err(format!("stream failed: {}", s.message())),
                    Err(_) => return Err("stream silent".to_string()),
                }
            }
        };
        let error: Result<(), String> = tokio::select! {
            e = attempt => e,
            _ = shutdown.triggered() => return,
        };
        if spoke.into_inner() {
            last_error = None;
        }
        match error {
            // A new reason is worth a warning; the same one again, at every
            // reconnect, is not.
            Err(e) if last_error.as_ref() != Some(&e) => {
                tracing::warn!(cluster = %link.name, error = %e, "export stream lost; reconnecting");
                last_error = Some(e);
            }
            Err(e) => {
                tracing::debug!(cluster = %link.name, error = %e, "export stream lost; reconnecting")
            }
            Ok(()) => last_error = None,
        }
        let pause = backoff.next_pause(rand::random());
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = shutdown.triggered() => return,
        }
    }
}

/// An error and its causes, outermost first ("transport error" alone says
/// nothing).
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        // Wrappers often display their cause again; say it once.
        let text = c.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}
