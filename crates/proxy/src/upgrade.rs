//! HTTP/1.1 upgrades (WebSocket) through the proxy, as linkerd2-proxy
//! carries them (`linkerd/http/upgrade`): an upgrade request keeps its
//! `Connection: upgrade` and `Upgrade` headers and travels as HTTP/1.1 on
//! every hop, also between proxies, where other HTTP/1 requests ride the
//! shared HTTP/2 connection (HTTP/2 has no upgrades). When the server
//! answers `101 Switching Protocols`, the client's connection and the
//! server's are joined into one tunnel that copies bytes both ways.
//!
//! Bounds: a tunnel keeps the place under `--max-connections` of the
//! connection it came on, and is closed after the listener's idle timeout
//! without a byte either way, or once a write to a client that stopped
//! reading has waited as long (counted as the connection's `write_stall`). `Upgrade: h2c` is never passed on: the proxy
//! would lose sight of the requests inside. `CONNECT` is refused elsewhere
//! (405): a tunnel to wherever the client names is an open proxy.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderMap};
use http::{Request, Response, StatusCode};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use crate::metrics::ClosedLabels;

/// Whether a message's headers offer an upgrade the proxy carries: a
/// `Connection: upgrade` token and an `Upgrade` other than `h2c`.
pub fn wants_upgrade(headers: &HeaderMap) -> bool {
    // Asked of every request, two or three times on its way: most carry
    // neither name, and looking at each name (a small number for a
    // standard one) costs less than hashing for a lookup.
    let (mut connection, mut upgrade) = (false, false);
    for name in headers.keys() {
        connection |= name == header::CONNECTION;
        upgrade |= name == header::UPGRADE;
    }
    connection && upgrade && offers_upgrade(headers)
}

/// [`wants_upgrade`] for headers known to carry both `Connection` and
/// `Upgrade` (`http::strip` has just looked at every name): their values
/// alone.
pub(crate) fn offers_upgrade(headers: &HeaderMap) -> bool {
    let offered = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    offered
        && headers
            .get(header::UPGRADE)
            .is_some_and(|u| !u.as_bytes().eq_ignore_ascii_case(b"h2c"))
}

/// Why a response is refused when it switches protocols for a request
/// that asked for no upgrade the proxy carries: there is no tunnel to
/// join, and a client told its protocol switched would speak into a
/// closed connection (an HTTP/2 hop cannot carry a 101 at all).
pub const UNASKED_SWITCH: &str =
    "answered 101 Switching Protocols to a request that asked for no upgrade";

/// Whether a response switches protocols though the request (`version`;
/// `asked`: whether its headers asked for an upgrade, [`wants_upgrade`])
/// asked for no upgrade the proxy carries.
pub fn switched_unasked(version: http::Version, asked: bool, status: StatusCode) -> bool {
    status == StatusCode::SWITCHING_PROTOCOLS && !(version == http::Version::HTTP_11 && asked)
}

/// What a tunnel keeps from the connection it came on: its place under
/// the connection cap (and its share of the drain), and its idle timeout.
/// The listener puts one in every request's extensions.
#[derive(Clone)]
pub struct ConnSlot {
    pub(crate) _held: Arc<dyn Send + Sync>,
    pub(crate) idle_timeout: Duration,
    /// Where a tunnel cut for a client that stopped reading is counted,
    /// as its connection would have been.
    pub(crate) closed: Family<ClosedLabels, Counter>,
    pub(crate) direction: &'static str,
}

/// The client side of an upgrade request, until the response is known.
pub struct Pending {
    client: OnUpgrade,
    slot: Option<ConnSlot>,
}

/// Takes the client's side of an upgrade from a request the proxy will
/// pass on; `None` for any other request.
pub fn take<B>(req: &mut Request<B>) -> Option<Pending> {
    if req.version() != http::Version::HTTP_11 || !wants_upgrade(req.headers()) {
        return None;
    }
    let slot = req.extensions().get::<ConnSlot>().cloned();
    let client = req.extensions_mut().remove::<OnUpgrade>()?;
    Some(Pending { client, slot })
}

impl Pending {
    /// When the server switched protocols, joins both connections in a
    /// tunnel (spawned; it runs once the response has been written).
    pub fn splice<B>(self, rsp: &mut Response<B>) {
        if rsp.status() != StatusCode::SWITCHING_PROTOCOLS {
            return;
        }
        let Some(server) = rsp.extensions_mut().remove::<OnUpgrade>() else {
            return;
        };
        tokio::spawn(tunnel(self.client, server, self.slot));
    }
}

async fn tunnel(client: OnUpgrade, server: OnUpgrade, slot: Option<ConnSlot>) {
    let (client, server) = match tokio::try_join!(client, server) {
        Ok(both) => both,
        Err(e) => {
            tracing::debug!(error = %e, "HTTP upgrade not completed");
            return;
        }
    };
    join(TokioIo::new(client), TokioIo::new(server), slot).await;
}

/// Copies bytes both ways between the two sides of an upgrade until
/// either closes, or nothing moved for the slot's idle timeout.
async fn join<C, S>(client: C, server: S, slot: Option<ConnSlot>)
where
    C: AsyncRead + AsyncWrite + Unpin,
    S: AsyncRead + AsyncWrite + Unpin,
{
    let activity = Activity::new();
    let mut client = Watched {
        inner: client,
        activity: activity.clone(),
    };
    let mut server = Watched {
        inner: server,
        activity: activity.clone(),
    };
    let idle = slot.as_ref().map(|s| s.idle_timeout);
    tokio::select! {
        copied = tokio::io::copy_bidirectional(&mut client, &mut server) => {
            if let Err(e) = copied {
                match &slot {
                    Some(slot) if crate::serve::write_stall::is_write_stall(&e) => {
                        crate::serve::stalled_writes(&slot.closed, slot.idle_timeout, slot.direction);
                    }
                    _ => tracing::debug!(error = %e, "upgraded connection ended"),
                }
            }
        }
        _ = activity.idle_for(idle) => {
            tracing::debug!("upgraded connection closed: idle");
        }
    }
    drop(slot);
}

/// When bytes last moved through a tunnel.
#[derive(Clone)]
struct Activity {
    start: Instant,
    /// Milliseconds after `start`.
    last: Arc<AtomicU64>,
}

impl Activity {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            last: Arc::default(),
        }
    }

    fn touch(&self) {
        let now = self.start.elapsed().as_millis() as u64;
        self.last.fetch_max(now, Ordering::Relaxed);
    }

    /// Resolves once nothing moved for `timeout` (never without one).
    async fn idle_for(&self, timeout: Option<Duration>) {
        let Some(timeout) = timeout else {
            return std::future::pending().await;
        };
        loop {
            let last = Duration::from_millis(self.last.load(Ordering::Relaxed));
            let due = self.start + last + timeout;
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due).await;
        }
    }
}

/// An I/O that records when bytes move through it.
struct Watched<T> {
    inner: T,
    activity: Activity,
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_upgrades_are_carried() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(*k, http::HeaderValue::from_static(v));
            }
            h
        };
        let ws = [
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "websocket"),
        ];
        assert!(wants_upgrade(&headers(&ws)));
        assert!(!wants_upgrade(&headers(&[("upgrade", "websocket")])));
        // The token in a second `Connection` line, among other names.
        assert!(wants_upgrade(&headers(&[
            ("host", "web.demo"),
            ("connection", "keep-alive"),
            ("accept", "*/*"),
            ("connection", "upgrade"),
            ("upgrade", "websocket"),
        ])));
        assert!(!wants_upgrade(&headers(&[
            ("host", "web.demo"),
            ("accept", "*/*")
        ])));
        assert!(!wants_upgrade(&headers(&[("connection", "upgrade")])));
        assert!(!wants_upgrade(&headers(&[
            ("connection", "Upgrade, HTTP2-Settings"),
            ("upgrade", "h2c")
        ])));
    }

    #[tokio::test(start_paused = true)]
    async fn a_tunnel_cut_because_its_client_stopped_reading_is_counted() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let idle_timeout = Duration::from_secs(60);
        let closed = Family::<ClosedLabels, Counter>::default();
        let slot = ConnSlot {
            _held: Arc::new(()),
            idle_timeout,
            closed: closed.clone(),
            direction: "test",
        };
        let (client, mut client_peer) = tokio::io::duplex(64);
        let client = crate::serve::write_stall::WriteStall::new(client, idle_timeout, None);
        let (server, server_peer) = tokio::io::duplex(64);
        // The app sends without end and takes whatever comes.
        let (mut from_client, mut to_client) = tokio::io::split(server_peer);
        tokio::spawn(async move { while to_client.write_all(&[1; 64]).await.is_ok() {} });
        tokio::spawn(async move {
            let mut buf = [0; 64];
            while from_client.read(&mut buf).await.is_ok_and(|n| n > 0) {}
        });
        // The client keeps talking, so the tunnel is never idle, and reads
        // nothing.
        tokio::spawn(async move {
            while client_peer.write_all(b"ping").await.is_ok() {
                tokio::time::sleep(idle_timeout / 10).await;
            }
        });
        join(client, server, Some(slot)).await;
        let labels = ClosedLabels {
            direction: "test".into(),
            reason: "write_stall".into(),
        };
        assert_eq!(closed.get_or_create(&labels).get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_means_nothing_moved_for_the_whole_timeout() {
        let activity = Activity::new();
        let timeout = Duration::from_secs(60);
        let idle = activity.idle_for(Some(timeout));
        tokio::pin!(idle);
        // Bytes at 50 s push the deadline to 110 s.
        tokio::select! {
            _ = &mut idle => panic!("idle before the timeout"),
            _ = tokio::time::sleep(Duration::from_secs(50)) => activity.touch(),
        }
        let start = Instant::now();
        idle.await;
        assert!(
            start.elapsed() >= Duration::from_secs(59),
            "{:?}",
            start.elapsed()
        );
    }
}
