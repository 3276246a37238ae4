//! One watcher per link. It follows the remote control plane's export
//! stream (over mTLS, verifying the remote presents
//! `tether-control.<cluster>…` from the shared trust root) and probes the
//! remote gateway with a TCP connect. The remote is in the index only while
//! the stream has spoken within [`STALE`] and the gateway answered a probe
//! within [`STALE`]; otherwise it is dropped, and restored when both are
//! back.

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
        config,
        seen.clone(),
        shutdown.clone(),
    ));
    let mut tick = tokio::time::interval(PROBE_EVERY);
    let mut was_up = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.triggered() => return,
        }
        let gateway = {
            let s = seen.lock().unwrap();
            link.gateway.or_else(|| {
                s.export
                    .as_ref()
                    .and_then(|(_, e)| e.gateway_address.parse::<SocketAddr>().ok())
            })
        };
        if let Some(gw) = gateway {
            let ok = matches!(
                tokio::time::timeout(PROBE_TIMEOUT, TcpStream::connect(gw)).await,
                Ok(Ok(_))
            );
            if ok {
                seen.lock().unwrap().gateway_ok = Some(Instant::now());
            }
        }
        let remote = {
            let s = seen.lock().unwrap();
            let fresh = |t: Instant| t.elapsed() < STALE;
            match (&s.export, s.gateway_ok, gateway) {
                (Some((at, state)), Some(gw_at), Some(gw)) if fresh(*at) && fresh(gw_at) => {
                    Some(RemoteCluster {
                        priority: link.priority,
                        gateway: gw,
                        gateway_identity: (!state.gateway_identity.is_empty())
                            .then(|| state.gateway_identity.clone()),
                        ready: state
                            .services
                            .iter()
                            .map(|s| (s.global_id.clone(), s.ready_endpoints))
                            .collect::<BTreeMap<_, _>>(),
                    })
                }
                _ => None,
            }
        };
        let up = remote.is_some();
        if up != was_up {
            if up {
                tracing::info!(cluster = %link.name, "linked cluster reachable; its endpoints are served");
            } else {
                tracing::warn!(cluster = %link.name, "linked cluster unreachable; dropped from answers");
            }
            was_up = up;
        }
        index.set_remote(&link.name, remote);
    }
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
