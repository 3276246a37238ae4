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
//! - **Clients that stop reading**: an HTTP/2 response given no window,
//!   an HTTP/1 connection whose writes make no progress, for
//!   `--idle-timeout`, is reset or closed, letting go of what feeds it.
//! - **Shutdown**: a listener stops accepting, asks its HTTP connections to
//!   finish (HTTP/2 GOAWAY, HTTP/1 close after the current response), and
//!   waits for them up to the drain timeout.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::Bytes;
use futures::task::AtomicWaker;
use http::{Request, Response};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tether_admin::Shutdown;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::metrics::{ClosedLabels, ProxyMetrics};

mod h2_server;
pub(crate) mod write_stall;

/// Concurrent HTTP/2 streams per client connection.
const MAX_STREAMS: u32 = 100;
/// The largest request head: an HTTP/1 head buffered whole, an HTTP/2
/// header list.
const MAX_HEADER_LIST_SIZE: u32 = 64 * 1024;

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
    /// The accepted socket, owned by the stream handed over with this:
    /// [`write_stall`] reads its send queue.
    socket: Option<std::os::fd::RawFd>,
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
        let conn = Conn {
            drain: drain_rx.clone(),
            limits: limits.clone(),
            direction: name,
            socket: Some(std::os::fd::AsRawFd::as_raw_fd(&stream)),
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
    /// The connection's task, waiting in [`idle_for`]: every `idle_for`
    /// of a connection is polled by its task, one after the other.
    idle: AtomicWaker,
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
            self.0.idle.wake();
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
    let limit = IdleLimit::new(limit);
    tokio::select! {
        biased;
        result = conn => result,
        _ = idle_for(in_flight, &limit) => {
            Err("the client did not finish closing the connection within the drain timeout".into())
        }
    }
}

/// Why a connection's `closing` wait ended.
enum Closing {
    /// No request in flight for the connection's limit.
    Idle,
    /// The proxy drains.
    Drain,
}

/// How long a connection may go without a request in flight: shared
/// with [`idle_for`], and raised once the connection's protocol is known.
struct IdleLimit(AtomicU64);

impl IdleLimit {
    fn new(limit: Duration) -> Self {
        Self(AtomicU64::new(Self::nanos(limit)))
    }

    fn nanos(limit: Duration) -> u64 {
        u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX)
    }

    fn get(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }

    /// Takes effect when the timer set for the old limit ends.
    fn raise(&self, limit: Duration) {
        self.0.fetch_max(Self::nanos(limit), Ordering::Relaxed);
    }
}

/// Resolves once the connection has had no request in flight for
/// `limit`: when the timer ends and requests came meanwhile, it starts
/// again (so a connection closes between one and two limits after its
/// last request).
///
/// It may be polled on every wake-up of its connection's task, several
/// per request. Such a poll reads the count and looks at the timer's
/// state (atomic reads), and while requests are in flight registers the
/// waker for the last one's end; the timer is an [`ArmedSleep`](crate::wait::ArmedSleep),
/// polled only when that may be news, and reset once per limit, not
/// per request.
async fn idle_for(in_flight: &InFlight, limit: &IdleLimit) {
    let mut armed_at = tokio::time::Instant::now();
    let mut timer = crate::wait::ArmedSleep::new(armed_at + limit.get());
    let mut counted_from = in_flight.started.load(Ordering::Acquire);
    let mut busy = false;
    std::future::poll_fn(|cx| {
        if in_flight.count.load(Ordering::Acquire) > 0 {
            // The last request's end wakes the task; the count is read
            // again once registered, in case it ended meanwhile. Only
            // while busy: idle, a request's end is no news (the next
            // wake-up that matters is the timer's), and a connection
            // polled only when this wakes it is then not polled per
            // request.
            busy = true;
            in_flight.idle.register(cx.waker());
            if in_flight.count.load(Ordering::Acquire) > 0 {
                return Poll::Pending;
            }
        }
        loop {
            if !timer.ended(cx) {
                return Poll::Pending;
            }
            // Raised since the timer was set: the rest of the new limit.
            let due = armed_at + limit.get();
            if tokio::time::Instant::now() < due {
                timer.set(due);
                continue;
            }
            let started = in_flight.started.load(Ordering::Acquire);
            if !busy && started == counted_from {
                return Poll::Ready(());
            }
            (busy, counted_from) = (false, started);
            armed_at = tokio::time::Instant::now();
            timer.set(armed_at + limit.get());
        }
    })
    .await
}

/// `fut`, polled only when it woke the task (and on the first poll): a
/// wait polled on every wake-up of its connection's task, several per
/// request, costs an atomic swap and a waker's registration each time
/// instead of its own poll (the closing wait's: ~500 instructions a
/// request in the client proxy). As the HTTP/2 server does for its own.
fn when_woken<F: Future>(mut fut: Pin<&mut F>) -> impl Future<Output = F::Output> + '_ {
    let woken = Arc::new(Woken {
        woken: AtomicBool::new(true),
        task: AtomicWaker::new(),
    });
    let waker = Waker::from(woken.clone());
    std::future::poll_fn(move |cx| {
        // Registered before the flag is read: a wake-up after the read
        // wakes the task.
        woken.task.register(cx.waker());
        if !woken.woken.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        fut.as_mut().poll(&mut Context::from_waker(&waker))
    })
}

struct Woken {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

/// Resolves once the listener drains. Polled on every wake-up of the
/// connection's task like [`idle_for`]: after the first poll, which
/// registers the task, the wait is polled again only once the channel has
/// changed (one atomic read) or the waker is another, not each time (~90
/// instructions).
async fn drained(drain: &mut watch::Receiver<bool>) {
    let probe = drain.clone();
    let wait = drain.wait_for(|d| *d);
    tokio::pin!(wait);
    // The waker the wait was polled with (polled again for another, as
    // the timer in `idle_for`).
    let mut registered: Option<std::task::Waker> = None;
    std::future::poll_fn(|cx| {
        if registered.as_ref().is_some_and(|w| w.will_wake(cx.waker()))
            && matches!(probe.has_changed(), Ok(false))
        {
            return Poll::Pending;
        }
        registered = Some(cx.waker().clone());
        wait.as_mut().poll(cx).map(|_| ())
    })
    .await
}

/// A request's body, as the connection's server gave it: hyper's (HTTP/1)
/// or a stream's read directly from h2 (HTTP/2). Not boxed: a request
/// without a body (most) costs no allocation for it either way.
pub enum RequestBody {
    Http1(Incoming),
    /// An HTTP/1 body still to come when the request started.
    Http1Unread(UnreadBody),
    Http2(crate::h2_stream::RecvBody),
}

impl RequestBody {
    /// hyper's body for a request of the connection `in_flight` counts:
    /// one still to come holds the count until it ends or is dropped.
    /// hyper goes on reading it after the response may have ended (an
    /// upload the app answered early), and a connection reading a body
    /// is not waiting for a head: the idle watchdog, which bounds that
    /// wait, would cut it.
    fn http1(body: Incoming, in_flight: &Arc<InFlight>) -> Self {
        if hyper::body::Body::is_end_stream(&body) {
            return RequestBody::Http1(body);
        }
        RequestBody::Http1Unread(UnreadBody {
            body,
            _held: Some(InFlightGuard::new(in_flight)),
        })
    }
}

/// See [`RequestBody::http1`].
pub struct UnreadBody {
    body: Incoming,
    _held: Option<InFlightGuard>,
}

impl UnreadBody {
    fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, crate::http::BodyError>>> {
        use hyper::body::Body as _;
        let polled = Pin::new(&mut self.body).poll_frame(cx).map_err(Into::into);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_))))
            || self.body.is_end_stream()
        {
            self._held = None;
        }
        polled
    }
}

impl hyper::body::Body for RequestBody {
    type Data = Bytes;
    type Error = crate::http::BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, crate::http::BodyError>>> {
        match self.get_mut() {
            RequestBody::Http1(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
            RequestBody::Http1Unread(body) => body.poll_frame(cx),
            RequestBody::Http2(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Http1(body) => body.is_end_stream(),
            RequestBody::Http1Unread(body) => body.body.is_end_stream(),
            RequestBody::Http2(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Http1(body) => body.size_hint(),
            RequestBody::Http1Unread(body) => body.body.size_hint(),
            RequestBody::Http2(body) => body.size_hint(),
        }
    }
}

/// Serves HTTP/1 (with hyper) or HTTP/2 (with h2, [`h2_server`]), told
/// apart by the HTTP/2 preface, on one connection.
pub async fn serve_http<I, S, Fut, B>(mut io: I, service: S, conn: Conn)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: Fn(Request<RequestBody>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body<Data = Bytes, Error = crate::http::BodyError> + Send + Unpin + 'static,
{
    let Conn {
        mut drain,
        limits,
        direction,
        socket,
        _permit,
    } = conn;
    // An upgraded connection outlives this one and keeps its place.
    let slot = crate::upgrade::ConnSlot {
        _held: Arc::new((_permit, drain.clone())),
        idle_timeout: limits.idle_timeout,
        closed: limits.metrics.connections_closed.clone(),
        direction,
    };
    let in_flight = Arc::new(InFlight::default());
    let tracker = in_flight.clone();
    // What every request goes through, whichever the protocol: its place
    // in the connection's in-flight count, until its response body ends.
    let start = move |mut req: Request<RequestBody>| {
        // Only an HTTP/1.1 request upgrades (`upgrade::take`): an HTTP/2
        // one's headers are not looked up for it.
        if req.version() == http::Version::HTTP_11 && crate::upgrade::wants_upgrade(req.headers()) {
            req.extensions_mut().insert(slot.clone());
        }
        let guard = InFlightGuard::new(&tracker);
        // Boxed (made in its box): each protocol moves the request's
        // future (hyper into its dispatcher; HTTP/2 into the connection's
        // set and again inside `respond` and `tracked`); inline, the state
        // machine of a whole proxied request made those moves up to ~35 KB
        // of copying per request (a uprobe on memmove).
        (crate::boxed(|| service(req)), guard)
    };
    // No request in flight on an HTTP/1 connection means waiting for the
    // next request's head: `--header-read-timeout` bounds that wait (and a
    // slow head), as hyper's header-read timer did, which it made, armed
    // and dropped for every request (~1.0k instructions a request). Until
    // the protocol is known, the shorter limit; HTTP/2 raises it.
    let idle_limit = IdleLimit::new(limits.idle_timeout.min(limits.header_read_timeout));
    let closing = async {
        tokio::select! {
            biased;
            _ = idle_for(&in_flight, &idle_limit) => {
                limits.metrics.close_connection(direction, "idle");
                Closing::Idle
            }
            _ = drained(&mut drain) => Closing::Drain,
        }
    };
    tokio::pin!(closing);
    let (http2, read) = tokio::select! {
        biased;
        read = read_version(&mut io, limits.header_read_timeout) => match read {
            Some(read) => read,
            None => return,
        },
        _ = closing.as_mut() => return,
    };
    let io = crate::detect::PrefixedIo::new(read, io);
    let result = if http2 {
        idle_limit.raise(limits.idle_timeout);
        let h2_limits = h2_server::Limits {
            max_streams: MAX_STREAMS,
            max_header_list_size: MAX_HEADER_LIST_SIZE,
        };
        // A response the client gives no window for as long as a
        // connection may idle is dropped, with what it holds upstream: an
        // app connection from a pool all clients share.
        let stall = limits.idle_timeout;
        let stream = move |req: Request<_>, reply| {
            let (handling, guard) = start(req.map(RequestBody::Http2));
            h2_server::respond(tracked(handling, guard), reply, stall)
        };
        // Once told to close, what `finish` bounds for HTTP/1.
        let drain_limit = IdleLimit::new(limits.drain_timeout);
        let cut_off = idle_for(&in_flight, &drain_limit);
        let lingering = std::sync::Mutex::new(None);
        let closing = async {
            let _ = closing.await;
            *lingering.lock().unwrap_or_else(|e| e.into_inner()) = socket.and_then(hold_socket);
        };
        let served = h2_server::serve(io, h2_limits, stream, closing, cut_off).await;
        let held = lingering.into_inner().unwrap_or_else(|e| e.into_inner());
        if let Some(held) = held {
            linger(held).await;
        }
        served
    } else {
        let reading = in_flight.clone();
        let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
            let (handling, guard) = start(req.map(|body| RequestBody::http1(body, &reading)));
            async move { Ok::<_, Infallible>(tracked(handling, guard).await) }
        });
        // hyper's HTTP/1 server would wait for a client that never reads
        // for good, holding the response and the app connection behind it.
        let io = write_stall::WriteStall::new(io, limits.idle_timeout, socket);
        let conn = hyper::server::conn::http1::Builder::new()
            // `idle_limit` bounds the wait for a head instead (no timer,
            // so no default of hyper's either).
            .header_read_timeout(None)
            .max_buf_size(MAX_HEADER_LIST_SIZE as usize)
            .serve_connection(TokioIo::new(io), svc)
            .with_upgrades();
        tokio::pin!(conn);
        let ended = |e: hyper::Error| {
            if write_stall::is_write_stall(&e) {
                let closed = &limits.metrics.connections_closed;
                stalled_writes(closed, limits.idle_timeout, direction);
            }
            e.to_string()
        };
        tokio::select! {
            biased;
            result = conn.as_mut() => result.map_err(ended),
            closed = when_woken(closing.as_mut()) => match closed {
                // Nothing in flight for the limit: no request to finish
                // (a response's last bytes, handed to hyper that long ago
                // and still unflushed, are a client that does not read;
                // hyper's header-read timer cut it as well), and a head
                // still being read is not waited for.
                Closing::Idle => Ok(()),
                Closing::Drain => {
                    conn.as_mut().graceful_shutdown();
                    let finishing = async { conn.await.map_err(ended) };
                    finish(finishing, &in_flight, limits.drain_timeout).await
                }
            }
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "HTTP connection ended with an error");
    }
}

/// How long a connection closed after its GOAWAY reads what the client
/// still sends before the socket goes.
const LINGER: Duration = Duration::from_secs(1);
/// What it reads at most meanwhile.
const LINGER_BYTES: usize = 256 * 1024;

/// The socket under a connection about to close, held past h2's own
/// close: h2 sends its last GOAWAY (naming the last stream it processed)
/// and closes at once, and requests the client sent meanwhile, still
/// unread, make the kernel answer with a reset, which discards the GOAWAY
/// before the client reads it. The client then cannot tell those requests
/// were never processed (it fails them instead of sending them again).
fn hold_socket(fd: std::os::fd::RawFd) -> Option<tokio::net::TcpStream> {
    // SAFETY: the fd is the accepted socket, owned by the connection's
    // stream, which is alive while the connection is served (this runs
    // from inside it); the duplicate owns itself.
    let owned = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }
        .try_clone_to_owned()
        .ok()?;
    let socket = std::net::TcpStream::from(owned);
    socket.set_nonblocking(true).ok()?;
    tokio::net::TcpStream::from_std(socket).ok()
}

/// Reads (and drops) what the client still sends, until it closes, for
/// at most [`LINGER`] and [`LINGER_BYTES`]: h2 has shut the write side,
/// so the client reads the GOAWAY and then the end.
async fn linger(mut socket: tokio::net::TcpStream) {
    use tokio::io::AsyncReadExt;
    let drain = async {
        let mut buf = [0u8; 4096];
        let mut read = 0;
        while read < LINGER_BYTES {
            match socket.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => read += n,
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
}

static STALL_LOG: tether_core::log_limit::LogLimit =
    tether_core::log_limit::LogLimit::new(Duration::from_secs(5));

/// Counts (and logs, at a bounded rate) an HTTP/1 connection, or a tunnel
/// upgraded from one, cut because its client stopped reading.
pub(crate) fn stalled_writes(
    closed: &Family<ClosedLabels, Counter>,
    idle_timeout: Duration,
    direction: &'static str,
) {
    let labels = ClosedLabels {
        direction: direction.into(),
        reason: "write_stall".into(),
    };
    closed.get_or_create(&labels).inc();
    if let Some(suppressed) = STALL_LOG.allow() {
        tracing::warn!(
            listener = direction,
            ?idle_timeout,
            suppressed,
            "connection closed: its client read none of a response for --idle-timeout"
        );
    }
}

/// The response `handling` gives, its body holding `guard` until it ends.
async fn tracked<F, B>(handling: F, guard: InFlightGuard) -> Response<Tracked<B>>
where
    F: Future<Output = Response<B>>,
{
    let (parts, inner) = handling.await.into_parts();
    let body = Tracked {
        inner,
        _guard: guard,
    };
    Response::from_parts(parts, body)
}

/// Reads as far as needed to tell HTTP/2's preface from anything else
/// (which hyper's HTTP/1 server then reads as a request): whether it is
/// HTTP/2 and the bytes read, to be read again. `None` when the client
/// closed, failed or stayed silent for `timeout`.
async fn read_version<I: AsyncRead + Unpin>(
    io: &mut I,
    timeout: Duration,
) -> Option<(bool, Bytes)> {
    let preface = crate::detect::H2_PREFACE;
    let mut buf = bytes::BytesMut::with_capacity(preface.len());
    let reading = async {
        while buf.len() < preface.len() && preface.starts_with(&buf) {
            match io.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(_) => {}
            }
        }
        true
    };
    match tokio::time::timeout(timeout, reading).await {
        Ok(true) => {}
        Ok(false) | Err(_) => return None,
    }
    Some((buf.starts_with(preface), buf.freeze()))
}

#[cfg(test)]
mod idle_tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::time::{advance, Instant};

    use super::{drained, idle_for, IdleLimit, InFlight, InFlightGuard};

    const TIMEOUT: Duration = Duration::from_secs(10);

    /// Whether `fut` resolves within `wait` of paused time.
    async fn resolves_within(fut: impl std::future::Future<Output = ()>, wait: Duration) -> bool {
        tokio::time::timeout(wait, fut).await.is_ok()
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_between_one_and_two_timeouts_after_its_last_request() {
        let in_flight = Arc::new(InFlight::default());
        let limit = IdleLimit::new(TIMEOUT);
        let idle = idle_for(&in_flight, &limit);
        tokio::pin!(idle);
        // A request in flight for longer than the timeout: never idle.
        let guard = InFlightGuard::new(&in_flight);
        assert!(!resolves_within(idle.as_mut(), TIMEOUT * 3).await);
        // Its end starts the clock; the end is what wakes the wait.
        let ended = Instant::now();
        drop(guard);
        assert!(!resolves_within(idle.as_mut(), TIMEOUT - Duration::from_secs(1)).await);
        // A request that comes and goes restarts the clock.
        drop(InFlightGuard::new(&in_flight));
        let restarted = Instant::now();
        assert!(!resolves_within(idle.as_mut(), TIMEOUT - Duration::from_secs(1)).await);
        assert!(resolves_within(idle.as_mut(), TIMEOUT).await);
        assert!(
            restarted.elapsed() >= TIMEOUT,
            "idle {:?} after the request",
            restarted.elapsed()
        );
        assert!(ended.elapsed() >= TIMEOUT * 2 - Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_without_requests_is_idle_after_the_timeout() {
        let in_flight = InFlight::default();
        let start = Instant::now();
        idle_for(&in_flight, &IdleLimit::new(TIMEOUT)).await;
        assert_eq!(start.elapsed(), TIMEOUT);
    }

    /// What an HTTP/2 connection does: it starts with the header-read
    /// limit while its protocol is unknown, then raises it.
    #[tokio::test(start_paused = true)]
    async fn a_raised_limit_counts_from_when_the_timer_was_set() {
        let in_flight = InFlight::default();
        let limit = IdleLimit::new(TIMEOUT);
        let start = Instant::now();
        let idle = idle_for(&in_flight, &limit);
        tokio::pin!(idle);
        assert!(!resolves_within(idle.as_mut(), Duration::from_secs(1)).await);
        limit.raise(TIMEOUT * 6);
        limit.raise(TIMEOUT); // never lowered
        idle.await;
        assert_eq!(start.elapsed(), TIMEOUT * 6);
    }

    /// A wait behind `when_woken` is polled first, then only after it woke
    /// the task: the task's other wake-ups do not reach it.
    #[tokio::test]
    async fn a_wait_is_polled_again_only_once_it_woke_the_task() {
        use std::future::Future;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::task::Poll;

        let polls = AtomicUsize::new(0);
        let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
        let inner = std::future::poll_fn(|cx| {
            polls.fetch_add(1, Ordering::Relaxed);
            std::pin::Pin::new(&mut rx).poll(cx).map(|_| ())
        });
        tokio::pin!(inner);
        let wait = super::when_woken(inner.as_mut());
        tokio::pin!(wait);
        for _ in 0..3 {
            assert_eq!(futures::poll!(wait.as_mut()), Poll::Pending);
        }
        assert_eq!(polls.load(Ordering::Relaxed), 1);
        tx.send(()).unwrap();
        assert_eq!(futures::poll!(wait.as_mut()), Poll::Ready(()));
        assert_eq!(polls.load(Ordering::Relaxed), 2);
    }

    /// The drain wakes a connection waiting in `drained` even though its
    /// later polls only look at the channel.
    #[tokio::test(start_paused = true)]
    async fn a_drain_is_seen_after_polls_that_only_looked() {
        let (tx, mut rx) = tokio::sync::watch::channel(false);
        let drain = drained(&mut rx);
        tokio::pin!(drain);
        assert!(!resolves_within(drain.as_mut(), Duration::from_secs(1)).await);
        assert!(!resolves_within(drain.as_mut(), Duration::from_secs(1)).await);
        tokio::spawn(async move {
            advance(Duration::from_millis(1)).await;
            tx.send(true).unwrap();
            // Kept open: the end of the channel is not what is waited for.
            std::future::pending::<()>().await;
        });
        assert!(resolves_within(drain.as_mut(), Duration::from_secs(60)).await);
    }
}
