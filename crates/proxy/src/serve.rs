//! Accept loops and HTTP connections, with the bounds every data-path
//! listener keeps:
//!
//! - **Connections**: one cap shared by every listener of the process
//!   (`--max-connections`, by default derived from the fd limit so that
//!   fds stay for upstream connections, the admin listener and the control
//!   plane). Past it a new connection is closed at once and counted: a
//!   flood of idle clients cannot take `/ready` or discovery down with it.
//! - **Accept errors** (out of fds): exponential backoff and a log line at
//!   a bounded rate, never a hot loop.
//! - **Idle connections** (no request in flight) are closed after
//!   `--idle-timeout`; HTTP/1 headers must arrive within
//!   `--header-read-timeout`.
//! - **Shutdown**: a listener stops accepting, asks its HTTP connections to
//!   finish (HTTP/2 GOAWAY, HTTP/1 close after the current response), and
//!   waits for them up to the drain timeout.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tether_admin::Shutdown;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};

use crate::metrics::ProxyMetrics;

/// Concurrent HTTP/2 streams per client connection.
const MAX_STREAMS: u32 = 100;

/// File descriptors kept out of the connection cap's reach: the admin
/// listener, discovery and identity streams, logs.
const RESERVED_FDS: usize = 64;

/// The operator's settings for the bounds below (flags of `tether proxy`
/// and `tether gateway`).
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Client connections open at once, all listeners together; `None`
    /// derives it from the fd limit.
    pub max_connections: Option<usize>,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            max_connections: None,
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// Bounds shared by every data-path listener of one process.
#[derive(Clone)]
pub struct ServeLimits {
    connections: Arc<Semaphore>,
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub drain_timeout: Duration,
    metrics: ProxyMetrics,
}

impl ServeLimits {
    pub fn new(config: &ServeConfig, drain_timeout: Duration, metrics: ProxyMetrics) -> Self {
        let max_connections = config
            .max_connections
            .unwrap_or_else(default_max_connections);
        tracing::info!(max_connections, "connection cap");
        Self {
            connections: Arc::new(Semaphore::new(max_connections)),
            max_connections,
            header_read_timeout: config.header_read_timeout,
            idle_timeout: config.idle_timeout,
            drain_timeout,
            metrics,
        }
    }
}

/// Half of the fds left after the reserve: a proxied client connection
/// usually needs one upstream fd as well.
fn default_max_connections() -> usize {
    let fds = tether_admin::raise_fd_limit();
    (fds.saturating_sub(RESERVED_FDS) / 2).max(16)
}

/// What one accepted connection carries into its handler: the drain
/// signal and the limits its HTTP server applies. Dropping it releases the
/// connection's place under the cap.
pub struct Conn {
    drain: watch::Receiver<bool>,
    limits: ServeLimits,
    direction: &'static str,
    _permit: OwnedSemaphorePermit,
}

pub async fn accept_loop<H, F>(
    name: &'static str,
    listener: TcpListener,
    shutdown: Shutdown,
    limits: ServeLimits,
    handler: H,
) where
    H: Fn(TcpStream, SocketAddr, Conn) -> F,
    F: Future<Output = ()> + Send + 'static,
{
    let (drain_tx, drain_rx) = watch::channel(false);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = tether_admin::accept(&listener, name) => accepted,
            _ = shutdown.triggered() => break,
        };
        let Ok(permit) = limits.connections.clone().try_acquire_owned() else {
            limits.metrics.close_connection(name, "connection_limit");
            if let Some(suppressed) = LIMIT_LOG.allow() {
                tracing::warn!(
                    listener = name,
                    limit = limits.max_connections,
                    suppressed,
                    "connection refused: the proxy holds --max-connections connections"
                );
            }
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = Conn {
            drain: drain_rx.clone(),
            limits: limits.clone(),
            direction: name,
            _permit: permit,
        };
        tokio::spawn(handler(stream, peer, conn));
    }
    drop(listener);
    drop(drain_rx);
    let _ = drain_tx.send(true);
    tracing::info!(
        listener = name,
        connections = drain_tx.receiver_count(),
        "draining"
    );
    tokio::select! {
        _ = drain_tx.closed() => {}
        _ = tokio::time::sleep(limits.drain_timeout) => {
            tracing::warn!(listener = name, "drain timeout passed; closing remaining connections");
        }
    }
}

static LIMIT_LOG: tether_core::log_limit::LogLimit =
    tether_core::log_limit::LogLimit::new(Duration::from_secs(5));

/// Requests in flight on one connection (a response counts until its body
/// ends), and a wake-up when the count reaches zero.
#[derive(Default)]
struct InFlight {
    count: AtomicUsize,
    /// Requests ever started: tells whether one came and went meanwhile.
    started: AtomicUsize,
    idle: Notify,
}

struct InFlightGuard(Arc<InFlight>);

impl InFlightGuard {
    fn new(in_flight: &Arc<InFlight>) -> Self {
        in_flight.started.fetch_add(1, Ordering::AcqRel);
        in_flight.count.fetch_add(1, Ordering::AcqRel);
        Self(in_flight.clone())
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// A response body that holds its connection's in-flight count until it
/// ends (a long-lived stream is not an idle connection). Not boxed: hyper
/// takes the handler's body type as it is.
struct Tracked<B> {
    inner: B,
    _guard: InFlightGuard,
}

impl<B> hyper::body::Body for Tracked<B>
where
    B: hyper::body::Body<Data = Bytes, Error = crate::http::BodyError> + Unpin,
{
    type Data = Bytes;
    type Error = crate::http::BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, crate::http::BodyError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod hostile_tests;

/// A connection told to close finishes its requests in flight, however
/// long they take (a drain has its own bound); once it has had none for
/// `limit`, it is cut: HTTP/2's graceful GOAWAY waits for the client to
/// answer a PING, and a client that never does (or never reads) would
/// otherwise keep the connection, and its place under the cap, for good.
async fn finish<F, E>(conn: F, in_flight: &InFlight, limit: Duration) -> Result<(), E>
where
    F: Future<Output = Result<(), E>>,
    E: From<&'static str>,
{
    tokio::select! {
        result = conn => result,
        _ = idle_for(in_flight, limit) => {
            Err("the client did not finish closing the connection within the drain timeout".into())
        }
    }
}

/// Resolves once the connection has had no request in flight for `timeout`.
async fn idle_for(in_flight: &InFlight, timeout: Duration) {
    loop {
        let notified = in_flight.idle.notified();
        if in_flight.count.load(Ordering::Acquire) > 0 {
            notified.await;
            continue;
        }
        // Idle now: wait out the timeout; a request that came and went in
        // between restarts the clock.
        let started = in_flight.started.load(Ordering::Acquire);
        tokio::time::sleep(timeout).await;
        if in_flight.started.load(Ordering::Acquire) == started {
            return;
        }
    }
}

/// Serves HTTP/1 or HTTP/2 (detected from the preface) on one connection.
pub async fn serve_http<I, S, Fut, B>(io: I, service: S, conn: Conn)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body<Data = Bytes, Error = crate::http::BodyError> + Send + Unpin + 'static,
{
    let Conn {
        mut drain,
        limits,
        direction,
        _permit,
    } = conn;
    // An upgraded connection outlives this one and keeps its place.
    let slot = crate::upgrade::ConnSlot {
        _held: Arc::new((_permit, drain.clone())),
        idle_timeout: limits.idle_timeout,
    };
    let in_flight = Arc::new(InFlight::default());
    let tracker = in_flight.clone();
    let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        if crate::upgrade::wants_upgrade(req.headers()) {
            req.extensions_mut().insert(slot.clone());
        }
        let guard = InFlightGuard::new(&tracker);
        // Boxed: hyper moves the request's future (into its dispatcher, an
        // HTTP/2 stream's task); a pointer is cheaper to move than the
        // state machine of a whole proxied request.
        let fut = Box::pin(service(req));
        async move {
            let rsp = fut.await;
            let (parts, inner) = rsp.into_parts();
            let body = Tracked {
                inner,
                _guard: guard,
            };
            Ok::<_, Infallible>(Response::from_parts(parts, body))
        }
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(64 * 1024);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS)
        .max_header_list_size(64 * 1024);
    let conn = builder
        .serve_connection_with_upgrades(TokioIo::new(io), svc)
        .into_owned();
    tokio::pin!(conn);
    let draining = async {
        let _ = drain.wait_for(|d| *d).await;
    };
    let result = tokio::select! {
        result = conn.as_mut() => result,
        _ = idle_for(&in_flight, limits.idle_timeout) => {
            limits.metrics.close_connection(direction, "idle");
            conn.as_mut().graceful_shutdown();
            finish(conn, &in_flight, limits.drain_timeout).await
        }
        _ = draining => {
            conn.as_mut().graceful_shutdown();
            finish(conn, &in_flight, limits.drain_timeout).await
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "HTTP connection ended with an error");
    }
}
