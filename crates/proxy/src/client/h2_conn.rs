//! HTTP/2 to one endpoint, driven with the `h2` crate directly.
//!
//! hyper's HTTP/2 client hands every request to its connection task through
//! a channel, answers through a oneshot, and spawns a task per request to
//! wait for the response. Here a request is sent from its own task and
//! its response awaited there: the connection task only drives the
//! connection (and the keep-alive). A request body that has not ended when
//! the request is sent (a gRPC stream, an upload) is piped by a task of
//! its own, with flow control; most requests have none.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response};
use hyper::body::{Body as _, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;

use super::{ConnectError, SendError, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT};
use crate::h2_stream::{bounded, send_body, RecvBody};
use crate::http::{Body, BodyError};
use crate::wait::ArmedSleep;

// hyper's HTTP/2 client defaults (hyper 1.x `proto/h2/client.rs`), kept
// as they were when hyper drove these connections: the windows let one
// stream run at full speed over a long link, and cost memory only when a
// peer fills them.
const CONN_WINDOW: u32 = 5 * 1024 * 1024;
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const MAX_FRAME_SIZE: u32 = 16 * 1024;
const MAX_SEND_BUFFER: usize = 1024 * 1024;
const MAX_HEADER_LIST_SIZE: u32 = 16 * 1024;
/// Streams opened before the server's SETTINGS say how many it takes.
const INITIAL_MAX_SEND_STREAMS: usize = 100;
/// Streams the peer may make this side reset for its errors before the
/// connection is closed (a misbehaving peer).
const MAX_LOCAL_ERROR_RESETS: usize = 1024;
/// Finished streams a connection keeps until its next request (see
/// [`Shared::finished`]); past these, one is let go at once.
const MAX_FINISHED: usize = 32;

/// What a connection's task and its requests share.
#[derive(Default)]
struct Shared {
    /// Requests waiting for or reading their response: the keep-alive
    /// pings only while there are some.
    in_flight: AtomicUsize,
    /// Reads from the socket that returned bytes: the peer is alive.
    reads: AtomicU64,
    /// The connection ended, or refused a new stream (GOAWAY): the next
    /// request connects anew.
    closed: AtomicBool,
    /// Closed because a PING went unanswered.
    timed_out: AtomicBool,
    /// Streams whose response was read to its end, both ways closed, let
    /// go of when the next request is sent. h2 wakes the connection's task
    /// when the last handle on a closed stream goes (so that a connection
    /// nothing refers to any more can close): once per request, after the
    /// response, for a poll that finds nothing to do (~2.2k instructions,
    /// 3.6% of the client proxy's, measured). Let go of beside a request
    /// the task is woken for anyway, both wake-ups are one. A stream kept
    /// here holds no window and no place among the concurrent streams
    /// (h2 counts those as the stream closes), only its entry in h2's
    /// table, and a reference that keeps h2 from closing the connection:
    /// `None` once every handle is gone (no next request will come), and
    /// a stream that finishes after that is let go of at once.
    finished: Mutex<Option<Vec<h2::RecvStream>>>,
    /// Polls of the connection's task.
    #[cfg(test)]
    polls: AtomicUsize,
}

impl Shared {
    /// Keeps `recv` until the next request, if there is room.
    fn finish(&self, recv: h2::RecvStream) {
        let mut finished = self.finished.lock().unwrap();
        if let Some(finished) = finished.as_mut().filter(|f| f.len() < MAX_FINISHED) {
            finished.push(recv);
        }
    }

    fn let_go_of_finished(&self) {
        if let Some(finished) = self.finished.lock().unwrap().as_mut() {
            finished.clear();
        }
    }

    /// No request will come any more: nothing is kept from now on.
    fn keep_no_finished(&self) {
        self.finished.lock().unwrap().take();
    }
}

/// A handle on one HTTP/2 connection.
#[derive(Clone)]
pub(super) struct H2 {
    send: h2::client::SendRequest<Bytes>,
    shared: Arc<Shared>,
    /// Dropped with the last handle, which wakes the connection task to
    /// close the connection once its streams are done (h2 does not wake
    /// it when the last `SendRequest` goes).
    _handles: Arc<oneshot::Sender<()>>,
}

impl H2 {
    pub(super) fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    /// What one request needs of the connection, once the connection
    /// may open a stream. A connection closed, or told by its peer to go
    /// away (GOAWAY: a drain), is marked closed so the next request
    /// connects anew; nothing of the request has been sent.
    pub(super) async fn sender(&self) -> Result<Sender, ConnectError> {
        let send = self.send.clone().ready().await.map_err(|e| {
            self.shared.closed.store(true, Ordering::Release);
            ConnectError::Failed(bounded(&e))
        })?;
        // h2 would hold the request until a stream frees up, which never
        // happens: its response timeout would be all the client hears.
        // The connection stays (the peer may raise the limit again).
        if send.current_max_send_streams() == 0 {
            return Err(ConnectError::NoStreams);
        }
        Ok(Sender {
            send,
            shared: self.shared.clone(),
        })
    }

    /// Whether h2 opens no more streams here (it read the peer's GOAWAY),
    /// without marking the connection closed.
    #[cfg(test)]
    pub(super) fn refuses_streams(&self) -> bool {
        use futures::FutureExt;
        matches!(self.send.clone().ready().now_or_never(), Some(Err(_)))
    }
}

/// Why a peer that allows no stream at all gets no request.
pub(super) const NO_STREAMS: &str =
    "the peer allows no concurrent streams (its SETTINGS_MAX_CONCURRENT_STREAMS is 0)";

/// Opens HTTP/2 on `io` and spawns the task that drives it.
pub(super) async fn handshake<I>(io: I, addr: std::net::SocketAddr) -> Result<H2, h2::Error>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let shared = Arc::new(Shared {
        finished: Mutex::new(Some(Vec::new())),
        ..Shared::default()
    });
    let io = CountReads {
        io,
        shared: shared.clone(),
    };
    let (send, mut conn) = h2::client::Builder::new()
        .initial_max_send_streams(INITIAL_MAX_SEND_STREAMS)
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONN_WINDOW)
        .max_frame_size(MAX_FRAME_SIZE)
        .max_header_list_size(MAX_HEADER_LIST_SIZE)
        .max_send_buffer_size(MAX_SEND_BUFFER)
        .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
        .enable_push(false)
        .handshake::<_, Bytes>(io)
        .await?;
    let (handles_tx, handles_rx) = oneshot::channel();
    let keep_alive = KeepAlive {
        ping_pong: conn.ping_pong().expect("taken once"),
        state: KeepAliveState::Idle,
        timer: ArmedSleep::new(tokio::time::Instant::now() + KEEPALIVE_INTERVAL),
    };
    let driver = Driver {
        conn,
        keep_alive,
        handles: Some(handles_rx),
        shared: shared.clone(),
    };
    tokio::spawn(async move {
        match driver.await {
            Ok(()) => tracing::debug!(%addr, "HTTP/2 connection ended"),
            Err(e) => tracing::debug!(error = %bounded(&e), %addr, "HTTP/2 connection ended"),
        }
    });
    Ok(H2 {
        send,
        shared,
        _handles: Arc::new(handles_tx),
    })
}

/// Counts the reads that returned bytes, for the keep-alive.
struct CountReads<I> {
    io: I,
    shared: Arc<Shared>,
}

impl<I: AsyncRead + Unpin> AsyncRead for CountReads<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.shared.reads.fetch_add(1, Ordering::Relaxed);
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for CountReads<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The connection's task: drives h2's connection and the keep-alive.
/// Dropping the connection (a PING unanswered) fails its streams.
struct Driver<I> {
    conn: h2::client::Connection<CountReads<I>, Bytes>,
    keep_alive: KeepAlive,
    handles: Option<oneshot::Receiver<()>>,
    shared: Arc<Shared>,
}

impl<I: AsyncRead + AsyncWrite + Unpin> Future for Driver<I> {
    type Output = Result<(), h2::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        #[cfg(test)]
        this.shared.polls.fetch_add(1, Ordering::Relaxed);
        if let Some(handles) = &mut this.handles {
            // Every handle is gone: polling the connection again lets it
            // see that nothing refers to it any more (the finished streams
            // kept for the next request are let go of: none will come).
            if Pin::new(handles).poll(cx).is_ready() {
                this.handles = None;
                this.shared.keep_no_finished();
            }
        }
        // Marked closed before the connection is dropped, which is what
        // fails its streams: a request that fails sees the mark.
        if let Poll::Ready(result) = Pin::new(&mut this.conn).poll(cx) {
            this.shared.closed.store(true, Ordering::Release);
            return Poll::Ready(result);
        }
        if this.keep_alive.poll(cx, &this.shared).is_ready() {
            this.shared.timed_out.store(true, Ordering::Release);
            this.shared.closed.store(true, Ordering::Release);
            tracing::debug!("HTTP/2 keep-alive: no answer to a PING; closing the connection");
            return Poll::Ready(Ok(()));
        }
        Poll::Pending
    }
}

/// While requests are in flight on a connection that has read nothing for
/// [`KEEPALIVE_INTERVAL`], a PING;
/// no answer within [`KEEPALIVE_TIMEOUT`] closes the connection. Polled
/// whenever the connection's task is (a new request wakes it), so an idle
/// connection has no timer running.
///
/// Polled several times per request: the timer is an [`ArmedSleep`],
/// polled only when that may be news, and a request that finds it
/// running keeps it rather than resetting it (~170 instructions): when
/// it ends too soon for that request, it is set again for the rest.
struct KeepAlive {
    ping_pong: h2::PingPong,
    state: KeepAliveState,
    timer: ArmedSleep,
}

enum KeepAliveState {
    /// Nothing in flight.
    Idle,
    /// Requests in flight; `reads` when watching started, `since` then.
    Watching {
        reads: u64,
        since: tokio::time::Instant,
    },
    PingSent,
}

impl KeepAlive {
    /// Ready when the peer did not answer a PING in time.
    fn poll(&mut self, cx: &mut Context<'_>, shared: &Shared) -> Poll<()> {
        loop {
            let busy = shared.in_flight.load(Ordering::Acquire) > 0;
            let reads = shared.reads.load(Ordering::Relaxed);
            match self.state {
                KeepAliveState::Idle => {
                    if !busy {
                        return Poll::Pending;
                    }
                    let since = tokio::time::Instant::now();
                    // Not running: the timer is set; running, it is kept.
                    if !self.timer.running() {
                        self.timer.set(since + KEEPALIVE_INTERVAL);
                    }
                    self.state = KeepAliveState::Watching { reads, since };
                }
                KeepAliveState::Watching { reads: then, since } => {
                    if !self.timer.ended(cx) {
                        return Poll::Pending;
                    }
                    if !busy {
                        self.state = KeepAliveState::Idle;
                        return Poll::Pending;
                    }
                    let now = tokio::time::Instant::now();
                    if reads != then {
                        self.timer.set(now + KEEPALIVE_INTERVAL);
                        self.state = KeepAliveState::Watching { reads, since: now };
                        continue;
                    }
                    if now < since + KEEPALIVE_INTERVAL {
                        // A timer kept from an earlier request.
                        self.timer.set(since + KEEPALIVE_INTERVAL);
                        continue;
                    }
                    if self.ping_pong.send_ping(h2::Ping::opaque()).is_err() {
                        // The connection is failing on its own.
                        self.state = KeepAliveState::Idle;
                        return Poll::Pending;
                    }
                    self.state = KeepAliveState::PingSent;
                    self.timer.set(now + KEEPALIVE_TIMEOUT);
                }
                KeepAliveState::PingSent => {
                    if let Poll::Ready(answered) = self.ping_pong.poll_pong(cx) {
                        if answered.is_err() {
                            self.state = KeepAliveState::Idle;
                            return Poll::Pending;
                        }
                        let now = tokio::time::Instant::now();
                        self.timer.set(now + KEEPALIVE_INTERVAL);
                        self.state = KeepAliveState::Watching { reads, since: now };
                        continue;
                    }
                    if self.timer.ended(cx) {
                        return Poll::Ready(());
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

/// Counts one request in flight until dropped (with its response body).
struct InFlight(Arc<Shared>);

impl InFlight {
    fn enter(shared: &Arc<Shared>) -> Self {
        shared.in_flight.fetch_add(1, Ordering::AcqRel);
        Self(shared.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One request's share of a connection.
pub(super) struct Sender {
    send: h2::client::SendRequest<Bytes>,
    shared: Arc<Shared>,
}

impl Sender {
    pub(super) async fn send(self, req: Request<Body>) -> Result<Response<H2Body>, SendError> {
        let Sender { send, shared } = self;
        let (mut parts, body) = req.into_parts();
        crate::http::strip_hop_by_hop_http2(&mut parts.headers);
        if let Some(len) = body.size_hint().exact() {
            if len != 0 || has_payload_semantics(&parts.method) {
                parts
                    .headers
                    .entry(header::CONTENT_LENGTH)
                    .or_insert_with(|| HeaderValue::from(len));
            }
        }
        // h2 refuses it with an error that reads as the connection's (and
        // would close it): an HTTP/2 request names a scheme or authority.
        // The inbound keeps the URI a client sent when the Host it named
        // is no valid authority.
        if parts.version == http::Version::HTTP_2
            && parts.uri.scheme().is_none()
            && parts.uri.authority().is_none()
        {
            return Err(SendError::failed(
                "an HTTP/2 request needs a valid authority",
            ));
        }
        let end_of_stream = body.is_end_stream();
        // Counted before the connection's task hears of the stream, so the
        // keep-alive sees it in flight.
        let in_flight = InFlight::enter(&shared);
        let mut send = send;
        let (response, stream) = send
            .send_request(Request::from_parts(parts, ()), end_of_stream)
            .map_err(|e| not_sent(&shared, e))?;
        drop(send);
        // After the send, which woke the connection's task: the wake-up
        // each of these gives is that one.
        shared.let_go_of_finished();
        let pipe = (!end_of_stream).then(|| pipe(body, stream));
        let rsp = response.await.map_err(|e| {
            if shared.timed_out.load(Ordering::Acquire) {
                return SendError::failed("HTTP/2 keep-alive: the peer did not answer a PING");
            }
            if e.is_go_away() {
                shared.closed.store(true, Ordering::Release);
            }
            if refused(&e) {
                SendError::unprocessed(bounded(&e))
            } else {
                SendError::failed(bounded(&e))
            }
        })?;
        let (parts, recv) = rsp.into_parts();
        let body = H2Body {
            body: Some(RecvBody::new(recv, &parts.headers)),
            in_flight,
            pipe,
        };
        Ok(Response::from_parts(parts, body))
    }
}

/// A request h2 did not send. A connection that cannot open a stream
/// (closed, or gone away since it was found ready) takes no more; a
/// request h2 refuses for what it is (its headers) leaves it be.
fn not_sent(shared: &Shared, e: h2::Error) -> SendError {
    if e.is_go_away() || e.is_io() {
        shared.closed.store(true, Ordering::Release);
        return SendError::unprocessed(bounded(&e));
    }
    SendError::failed(bounded(&e))
}

/// Whether the peer says it did not process the stream: reset with
/// REFUSED_STREAM, or failed by a GOAWAY whose last stream id is below it
/// (h2 fails with the peer's GOAWAY only the streams above that id; those
/// below it that the connection's end cuts fail with an I/O error).
fn refused(e: &h2::Error) -> bool {
    e.is_remote()
        && (e.is_go_away() || (e.is_reset() && e.reason() == Some(h2::Reason::REFUSED_STREAM)))
}

fn has_payload_semantics(method: &Method) -> bool {
    !matches!(
        *method,
        Method::GET | Method::HEAD | Method::DELETE | Method::CONNECT
    )
}

/// Resets the stream when the request is given up before its response
/// came (a timeout, a failover), so the peer stops too, or when the
/// response is over (read, or dropped: its client is gone) while the body
/// is still being sent: nobody waits for it any more, and a peer that
/// gives it no window would keep the pipe, the body and a stream forever
/// (the pipe does not see its client go while it waits for a window).
struct CancelOnDrop(Option<oneshot::Sender<()>>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// Sends `body` on `stream` from a task of its own.
fn pipe(body: Body, mut stream: h2::SendStream<Bytes>) -> CancelOnDrop {
    let (cancel_tx, cancel_rx) = oneshot::channel();
    tokio::spawn(async move {
        let reset = tokio::select! {
            biased;
            sent = send_body(body, &mut stream, None) => sent.err().flatten(),
            Ok(()) = cancel_rx => Some(h2::Reason::CANCEL),
        };
        if let Some(reason) = reset {
            stream.send_reset(reason);
        }
    });
    CancelOnDrop(Some(cancel_tx))
}

/// A response body read from h2, holding its request's place in flight
/// (and the request body's pipe) until it is dropped.
pub struct H2Body {
    /// Taken only when dropped.
    body: Option<RecvBody>,
    in_flight: InFlight,
    /// The request body's pipe, when it had one.
    pipe: Option<CancelOnDrop>,
}

impl hyper::body::Body for H2Body {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match &mut self.body {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.as_ref().is_none_or(|body| body.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.body
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), |body| body.size_hint())
    }
}

impl Drop for H2Body {
    fn drop(&mut self) {
        // Only a stream closed both ways: one whose response was not read
        // to its end, or whose request body is still being sent, is reset
        // (or its window given back) as its handle goes, at once.
        if let Some(body) = self.body.take() {
            if self.pipe.is_none() && body.is_end_stream() {
                self.in_flight.0.finish(body.into_stream());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
        let mut frame = len[1..].to_vec();
        frame.extend([kind, flags]);
        frame.extend(stream.to_be_bytes());
        frame.extend(payload);
        frame
    }

    /// A frame as the peer read it: type, stream, payload.
    type Read = (u8, u32, Vec<u8>);

    /// A peer, in raw HTTP/2 frames, that answers the first request's
    /// HEADERS with `answer`, and tells every frame it reads.
    async fn raw_peer(
        answer: Vec<u8>,
    ) -> (
        std::net::SocketAddr,
        tokio::sync::mpsc::UnboundedReceiver<Read>,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let (mut io, _) = listener.accept().await.unwrap();
            let mut preface = [0; 24];
            io.read_exact(&mut preface).await.unwrap();
            io.write_all(&frame(0x4, 0, 0, &[])).await.unwrap();
            let mut answered = false;
            loop {
                let mut head = [0; 9];
                if io.read_exact(&mut head).await.is_err() {
                    return;
                }
                let len = u32::from_be_bytes([0, head[0], head[1], head[2]]);
                let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]);
                let mut payload = vec![0; len as usize];
                io.read_exact(&mut payload).await.unwrap();
                let _ = tx.send((head[3], stream, payload));
                if head[3] == 0x1 && !answered {
                    answered = true;
                    io.write_all(&answer).await.unwrap();
                }
            }
        });
        (addr, rx)
    }

    async fn connect(addr: std::net::SocketAddr) -> H2 {
        let io = tokio::net::TcpStream::connect(addr).await.unwrap();
        handshake(io, addr).await.unwrap()
    }

    /// A request without a body, on `h2`.
    async fn send_empty(h2: &H2) -> Result<Response<H2Body>, SendError> {
        let sender = h2.sender().await.expect("the connection is open");
        sender.send(Request::new(crate::http::empty())).await
    }

    /// Waits (bounded) for the peer to read a frame of type `kind`.
    async fn read_by_peer(
        frames: &mut tokio::sync::mpsc::UnboundedReceiver<Read>,
        kind: u8,
    ) -> Read {
        let wait = async {
            loop {
                let read = frames.recv().await.expect("the peer reads on");
                if read.0 == kind {
                    return read;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .expect("the peer reads the frame")
    }

    /// A request's `Date` and id go out never indexed: two identical
    /// requests make identical HEADERS blocks (indexed, the second would
    /// refer to the first's entries), with the `Date` as RFC 7541 §6.2.3
    /// spells it: `0001` and the static index of `date`, 33, as 15 + 18.
    #[tokio::test]
    async fn a_requests_date_and_id_are_never_indexed() {
        let (addr, mut frames) = raw_peer(frame(0x1, 0x5, 1, &[0x88])).await;
        let h2 = connect(addr).await;
        let request = || {
            let mut req = Request::new(crate::http::empty());
            let headers = req.headers_mut();
            headers.insert(
                header::DATE,
                HeaderValue::from_static("Tue, 01 Dec 2026 12:00:00 GMT"),
            );
            headers.insert(
                "x-request-id",
                HeaderValue::from_static("6f1c2e0a-93b4-4c1d-8e2f-0a1b2c3d4e5f"),
            );
            req
        };
        let sender = h2.sender().await.expect("the connection is open");
        assert!(sender.send(request()).await.is_ok(), "answered");
        let (_, _, first) = read_by_peer(&mut frames, 0x1).await;
        // The peer answers only the first: the second need only be sent.
        let sender = h2.sender().await.expect("the connection is open");
        let second = tokio::spawn(sender.send(request()));
        let (_, stream, again) = read_by_peer(&mut frames, 0x1).await;
        second.abort();
        assert_eq!(stream, 3);
        assert_eq!(
            first, again,
            "the second request refers to no entry of the first"
        );
        assert!(
            first.windows(2).any(|w| w == [0x1f, 0x12]),
            "a never-indexed `Date`: {first:02x?}"
        );
    }

    /// A request costs the connection's task two polls: the request's
    /// send and the response's arrival. The wake-up h2 gives when the
    /// finished stream's last handle goes comes with the next request's
    /// (it cost a third poll). A response not read to its end still has
    /// its stream let go of at once.
    #[tokio::test]
    async fn a_request_wakes_the_connection_task_twice() {
        const REQUESTS: usize = 20;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (io, _) = listener.accept().await.unwrap();
            let mut conn = h2::server::handshake(io).await.unwrap();
            while let Some(Ok((_req, mut reply))) = conn.accept().await {
                let mut send = reply.send_response(Response::new(()), false).unwrap();
                send.send_data(Bytes::from_static(b"hello"), true).unwrap();
            }
        });
        let h2 = connect(addr).await;
        let read_to_end = |rsp: Response<H2Body>| async move {
            use http_body_util::BodyExt;
            rsp.into_body().collect().await.unwrap().to_bytes()
        };
        // The handshake's polls are not the requests'.
        read_to_end(send_empty(&h2).await.unwrap()).await;
        let before = h2.shared.polls.load(Ordering::Relaxed);
        for _ in 0..REQUESTS {
            let body = read_to_end(send_empty(&h2).await.unwrap()).await;
            assert_eq!(body, "hello");
            // The next request comes later, as a client's does: the
            // connection's task runs meanwhile if it was woken.
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
        }
        let polled = h2.shared.polls.load(Ordering::Relaxed) - before;
        // A margin for a frame that arrives on its own (a window update).
        assert!(
            polled <= REQUESTS * 2 + REQUESTS / 2,
            "{polled} polls of the connection's task for {REQUESTS} requests"
        );
        let kept = || h2.shared.finished.lock().unwrap().as_ref().map(Vec::len);
        assert_eq!(kept(), Some(1));
        // Not read to its end: not kept.
        let rsp = send_empty(&h2).await.unwrap();
        assert_eq!(kept(), Some(0));
        drop(rsp);
        assert_eq!(kept(), Some(0));
    }

    /// A request given up before its response (the response timeout, a
    /// client gone) resets its stream with CANCEL, so the peer stops
    /// working on it, and is no longer counted in flight (the keep-alive
    /// would ping for it forever): with a body still streaming (its pipe
    /// task ends) and without.
    #[tokio::test]
    async fn a_request_given_up_resets_its_stream_and_leaves_nothing_in_flight() {
        let streaming = || {
            use http_body_util::BodyExt;
            let never_ends = futures::stream::pending::<Result<Frame<Bytes>, BodyError>>();
            http_body_util::StreamBody::new(never_ends).boxed()
        };
        for body in [crate::http::empty(), streaming()] {
            let (addr, mut frames) = raw_peer(Vec::new()).await;
            let h2 = connect(addr).await;
            let sending = h2.sender().await.unwrap().send(Request::new(body));
            tokio::select! {
                _ = sending => panic!("the peer never answers"),
                _ = read_by_peer(&mut frames, 0x1) => {}
            }
            assert_eq!(h2.shared.in_flight.load(Ordering::Acquire), 0);
            let (_, stream, code) = read_by_peer(&mut frames, 0x3).await;
            assert_eq!(stream, 1);
            assert_eq!(code, u32::from(h2::Reason::CANCEL).to_be_bytes());
        }
    }

    /// A request body still being sent when its response is over (read or
    /// dropped: the client is gone) is given up and its stream reset, even
    /// while the peer gives it no flow-control window: the pipe does not
    /// wait for a window forever, holding the body and a stream.
    #[tokio::test]
    async fn a_request_body_stuck_on_flow_control_is_reset_when_its_response_goes() {
        // Response headers (`:status: 200`, HPACK's static entry 8), and
        // never a WINDOW_UPDATE.
        let (addr, mut frames) = raw_peer(frame(0x1, 0x4, 1, &[0x88])).await;
        let h2 = connect(addr).await;
        // More than the default window, then a body that never ends.
        let first = Ok(Frame::data(Bytes::from(vec![0; 100_000])));
        let chunks =
            futures::StreamExt::chain(futures::stream::iter([first]), futures::stream::pending());
        let body = {
            use http_body_util::BodyExt;
            http_body_util::StreamBody::new(chunks).boxed()
        };
        let rsp = h2
            .sender()
            .await
            .unwrap()
            .send(Request::new(body))
            .await
            .unwrap();
        assert_eq!(rsp.status(), 200);
        drop(rsp);
        let (_, stream, code) = read_by_peer(&mut frames, 0x3).await;
        assert_eq!(stream, 1);
        assert_eq!(code, u32::from(h2::Reason::CANCEL).to_be_bytes());
        assert_eq!(h2.shared.in_flight.load(Ordering::Acquire), 0);
    }

    /// A connection nothing refers to any more (the endpoint's client
    /// forgot it, its requests are done) is closed: its task does not
    /// stay behind, holding the socket.
    #[tokio::test]
    async fn a_connection_is_closed_once_its_handles_and_requests_are_gone() {
        // A whole response: `:status: 200`, END_STREAM and END_HEADERS.
        let (addr, mut frames) = raw_peer(frame(0x1, 0x5, 1, &[0x88])).await;
        let h2 = connect(addr).await;
        let rsp = send_empty(&h2).await;
        assert!(rsp.is_ok(), "answered");
        drop(rsp);
        // Its endpoint's client still has it: it stays open.
        tokio::task::yield_now().await;
        while let Ok((kind, _, _)) = frames.try_recv() {
            assert_ne!(kind, 0x7, "closed while it may still be used");
        }
        drop(h2);
        read_by_peer(&mut frames, 0x7).await;
    }

    /// The same when the last handle goes before the last response is
    /// read: its stream, finished afterwards, is not kept for a next
    /// request that cannot come (h2 would not close a connection a stream
    /// handle still refers to).
    #[tokio::test]
    async fn a_connection_is_closed_when_its_last_response_ends_after_its_handles() {
        let (addr, mut frames) = raw_peer(frame(0x1, 0x5, 1, &[0x88])).await;
        let h2 = connect(addr).await;
        let rsp = send_empty(&h2).await.expect("answered");
        drop(h2);
        tokio::task::yield_now().await;
        while let Ok((kind, _, _)) = frames.try_recv() {
            assert_ne!(kind, 0x7, "closed while a response is being read");
        }
        assert!(rsp.body().is_end_stream());
        drop(rsp);
        read_by_peer(&mut frames, 0x7).await;
    }

    /// A request h2 refuses for what it is (an HTTP/2 request whose URI
    /// names neither scheme nor authority: the inbound keeps a client's
    /// URI when the Host it named is not a valid authority) fails alone:
    /// the connection stays, or any client could make the proxy reconnect
    /// to the endpoint per request.
    #[tokio::test]
    async fn a_request_h2_refuses_does_not_close_its_connection() {
        let (addr, _frames) = raw_peer(frame(0x1, 0x5, 1, &[0x88])).await;
        let h2 = connect(addr).await;
        let mut unnamed = Request::new(crate::http::empty());
        *unnamed.version_mut() = http::Version::HTTP_2;
        assert!(h2.sender().await.unwrap().send(unnamed).await.is_err());
        assert!(!h2.is_closed());
        let rsp = send_empty(&h2).await;
        assert_eq!(rsp.ok().map(|r| r.status()), Some(http::StatusCode::OK));
    }

    /// GOAWAY from a peer (NO_ERROR: a drain) whose last stream id is
    /// below the request's stream, as h2 servers answer a stream that
    /// arrives after their GOAWAY: the request was not processed, with or
    /// without a body (one already streamed cannot be sent again: the
    /// route decides), and the connection takes no more requests.
    #[tokio::test]
    async fn a_stream_above_a_goaways_last_stream_id_is_unprocessed() {
        let mut goaway = 0u32.to_be_bytes().to_vec();
        goaway.extend(u32::from(h2::Reason::NO_ERROR).to_be_bytes());
        let streaming = || {
            use http_body_util::BodyExt;
            let first = Ok(Frame::data(Bytes::from_static(b"part")));
            let chunks = futures::StreamExt::chain(
                futures::stream::iter([first]),
                futures::stream::pending(),
            );
            http_body_util::StreamBody::new(chunks).boxed()
        };
        for body in [crate::http::empty(), streaming()] {
            let (addr, _frames) = raw_peer(frame(0x7, 0, 0, &goaway)).await;
            let h2 = connect(addr).await;
            let sent = h2.sender().await.unwrap().send(Request::new(body)).await;
            let error = sent.err().expect("refused");
            assert!(error.is_unprocessed(), "{error}");
            assert!(h2.is_closed());
        }
    }

    /// RST_STREAM with REFUSED_STREAM: that request was not processed, and
    /// the connection goes on (the peer refused a stream, not all). A
    /// stream reset for another reason may have been processed.
    #[tokio::test]
    async fn only_a_stream_reset_as_refused_is_unprocessed() {
        for (reason, unprocessed) in [
            (h2::Reason::REFUSED_STREAM, true),
            (h2::Reason::INTERNAL_ERROR, false),
        ] {
            let code = u32::from(reason).to_be_bytes();
            let (addr, _frames) = raw_peer(frame(0x3, 0, 1, &code)).await;
            let h2 = connect(addr).await;
            let sent = send_empty(&h2).await;
            let error = sent.err().expect("reset");
            assert_eq!(error.is_unprocessed(), unprocessed, "{reason:?}: {error}");
            assert!(!h2.is_closed());
        }
    }

    /// A GOAWAY's debug data is the peer's text, as long as a frame: the
    /// error that fails the request (shown to the client, logged) keeps a
    /// bounded prefix of it.
    #[tokio::test]
    async fn a_peers_goaway_text_is_not_echoed_whole() {
        let mut goaway = 0u32.to_be_bytes().to_vec();
        goaway.extend(u32::from(h2::Reason::PROTOCOL_ERROR).to_be_bytes());
        goaway.extend([0x01; 16_000]);
        let (addr, _frames) = raw_peer(frame(0x7, 0, 0, &goaway)).await;
        let h2 = connect(addr).await;
        let sent = send_empty(&h2).await;
        let error = sent.err().expect("the request fails").to_string();
        assert!(error.starts_with("connection error received"), "{error}");
        assert!(
            error.len() <= 2 * tether_core::truncate::MESSAGE_PREFIX_BYTES,
            "{} bytes: {}…",
            error.len(),
            &error[..80]
        );
    }
}
