//! HTTP/2 served with the `h2` crate directly.
//!
//! hyper's HTTP/2 server spawns a task per stream, which polls the
//! request's future (boxed by us, so that the move into the task is
//! cheap) and then pipes the response body; its request bodies go through
//! hyper's own body type. Here each stream's future (the request's
//! handling, then its response body's piping) is polled inside the
//! connection's own task, beside the connection: the runtime has one
//! thread, so nothing runs less in parallel, and a stream costs one
//! allocation (its node in [`FuturesUnordered`]) instead of a box and a
//! task. Only the streams that were woken are polled.
//!
//! Kept from hyper's server, explicitly: its windows, frame size, send
//! buffer and reset limits (hyper 1.x `proto/h2/server.rs`), the bounds
//! the listener configured (concurrent streams, header list size), a
//! client's RST_STREAM (or the connection's loss) dropping the request's
//! future, connection-specific headers stripped from responses, `Date` on
//! responses that lack one, `content-length` from a body of known size.
//! No PING keep-alive: hyper's server had none configured. Extended
//! CONNECT (`:protocol`) stays off, so h2 refuses it; a plain `CONNECT`
//! reaches the service, which refuses it.

use std::future::{poll_fn, Future};
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use bytes::Bytes;
use futures::future::FutureExt;
use futures::stream::{FuturesUnordered, StreamExt};
use futures::task::AtomicWaker;
use http::header::{self, HeaderValue};
use http::{Request, Response};
use hyper::body::Body;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::h2_stream::{bounded, send_body, RecvBody};

// hyper's HTTP/2 server defaults (hyper 1.x `proto/h2/server.rs`), kept
// as they were when hyper served these connections.
const CONN_WINDOW: u32 = 1024 * 1024;
const STREAM_WINDOW: u32 = 1024 * 1024;
const MAX_FRAME_SIZE: u32 = 16 * 1024;
const MAX_SEND_BUFFER: usize = 400 * 1024;
/// Streams the peer may make this side reset for its errors before the
/// connection is closed (a misbehaving peer).
const MAX_LOCAL_ERROR_RESETS: usize = 1024;
/// Passes over the connection's parts (streams, connection) in one poll of
/// its task before it yields: see `serve`.
const MAX_PASSES: u32 = 4;

/// The bounds the listener sets.
pub(super) struct Limits {
    pub max_streams: u32,
    pub max_header_list_size: u32,
}

/// Serves HTTP/2 on `io` (the client's preface still to be read from it)
/// until the client closes or, once `closing` resolves, the connection
/// has finished its streams after a GOAWAY, or `cut_off` resolves first
/// (a client that never finishes closing). `stream` makes the future of
/// each stream the client opens. A stream whose future panics (a bug in
/// one request's handling) is reset alone, as with a task per stream.
pub(super) async fn serve<I, M, F>(
    io: I,
    limits: Limits,
    mut stream: M,
    closing: impl Future<Output = ()>,
    cut_off: impl Future<Output = ()>,
) -> Result<(), String>
where
    I: AsyncRead + AsyncWrite + Unpin,
    M: FnMut(Request<RecvBody>, h2::server::SendResponse<Bytes>) -> F,
    F: Future<Output = ()>,
{
    let mut closing = pin!(closing);
    let mut cut_off = pin!(cut_off);
    // h2's defaults (h2 0.4) stand for the limits not named here: 20
    // streams reset by the client before they are accepted (rapid reset),
    // CONTINUATION frames bounded by the header list size, small DATA
    // frames by a budget.
    let handshake = h2::server::Builder::new()
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONN_WINDOW)
        .max_frame_size(MAX_FRAME_SIZE)
        .max_send_buffer_size(MAX_SEND_BUFFER)
        .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
        .max_concurrent_streams(limits.max_streams)
        .max_header_list_size(limits.max_header_list_size)
        .handshake::<_, Bytes>(io);
    let mut conn = tokio::select! {
        conn = handshake => conn.map_err(|e| bounded(&e))?,
        // Nothing in flight yet: nothing to finish.
        _ = closing.as_mut() => return Ok(()),
    };
    let mut streams = FuturesUnordered::<futures::future::CatchUnwind<AssertUnwindSafe<F>>>::new();
    let mut closed = false;
    let wakes = Arc::new(Wakes::default());
    // Not polled yet: each is polled on the first pass.
    wakes.closing.store(true, Ordering::SeqCst);
    wakes.connection.store(true, Ordering::SeqCst);
    let waker = |flag| {
        Waker::from(Arc::new(FlagWaker {
            wakes: wakes.clone(),
            flag,
        }))
    };
    let for_streams = waker(Flag::Streams);
    let for_connection = waker(Flag::Connection);
    let for_closing = waker(Flag::Closing);
    poll_fn(|cx| {
        wakes.task.register(cx.waker());
        wakes.polling.store(true, Ordering::SeqCst);
        let mut passes = 0;
        let polled = loop {
            // `closing` (once closed, `cut_off`) only when it woke the
            // task: polled on every pass, its timer and drain signal cost
            // ~2.5k instructions per request.
            if wakes.closing.swap(false, Ordering::SeqCst) {
                let mut closing_cx = Context::from_waker(&for_closing);
                if !closed {
                    if closing.as_mut().poll(&mut closing_cx).is_ready() {
                        conn.graceful_shutdown();
                        closed = true;
                        // The GOAWAY goes out with the connection's poll,
                        // and `cut_off` is polled from now on, first at
                        // once.
                        wakes.connection.store(true, Ordering::SeqCst);
                        wakes.closing.store(true, Ordering::SeqCst);
                        continue;
                    }
                } else if cut_off.as_mut().poll(&mut closing_cx).is_ready() {
                    break Poll::Ready(Err(
                        "the client did not finish closing the connection within the drain timeout"
                            .into(),
                    ));
                }
            }
            // The streams first: what they send goes out with the
            // connection's poll just after.
            if wakes.streams.swap(false, Ordering::SeqCst) {
                let mut streams_cx = Context::from_waker(&for_streams);
                while let Poll::Ready(Some(done)) = streams.poll_next_unpin(&mut streams_cx) {
                    if done.is_err() {
                        // Its reply, dropped while unwinding, resets the
                        // stream; the panic hook has told what happened.
                        tracing::debug!("a request's handling panicked; its stream is reset");
                    }
                }
            }
            // Only when woken: h2 wakes the connection for whatever it
            // must do (bytes to read, or a stream's send: each wakes it),
            // as it does when each stream has a task of its own. Not
            // every h2 call that queues a frame wakes it (capacity that
            // `reserve_capacity` assigns to data already buffered does
            // not): a stream sends only within the capacity it was
            // granted (`send_body`), so it never buffers such data.
            if wakes.connection.swap(false, Ordering::SeqCst) {
                match conn.poll_accept(&mut Context::from_waker(&for_connection)) {
                    Poll::Ready(Some(Ok(accepted))) => {
                        let (req, reply): (Request<h2::RecvStream>, _) = accepted;
                        let (parts, recv) = req.into_parts();
                        let body = RecvBody::new(recv, &parts.headers);
                        let serving = stream(Request::from_parts(parts, body), reply);
                        streams.push(AssertUnwindSafe(serving).catch_unwind());
                        // The new stream is polled, and the connection
                        // again for the next one.
                        wakes.streams.store(true, Ordering::SeqCst);
                        wakes.connection.store(true, Ordering::SeqCst);
                        continue;
                    }
                    Poll::Ready(Some(Err(e))) => break Poll::Ready(Err(bounded(&e))),
                    // Closed, by the client or after the GOAWAY once the
                    // streams were done; a stream still here can send
                    // nothing more.
                    Poll::Ready(None) => break Poll::Ready(Ok(())),
                    Poll::Pending => {}
                }
            }
            // Woken while polling: one part's work wakes another (a
            // stream's send wakes the connection, the connection's
            // flush a stream's send capacity), and `FuturesUnordered`
            // wakes itself whenever one of its futures stays pending
            // after it has polled each once. Another pass costs less than
            // a wake-up of the task (two of them per request, measured);
            // past a few, a part that keeps waking itself yields to the
            // runtime's other tasks.
            passes += 1;
            if passes == MAX_PASSES || !wakes.any() {
                break Poll::Pending;
            }
        };
        wakes.polling.store(false, Ordering::SeqCst);
        // Woken while polling and out of passes, or just after the last
        // check: polled again, after the runtime's other tasks.
        if polled.is_pending() && wakes.any() {
            cx.waker().wake_by_ref();
        }
        polled
    })
    .await
}

/// The wake-ups of a connection's task, by what they are for. A stream's
/// send wakes the connection (h2 wakes the task that polls it, which is
/// this one, and the connection is polled right after the streams): a
/// wake-up that arrives while the task is polling only marks what it is
/// for, and that part gets another pass in the same poll; each part is
/// polled only when marked.
#[derive(Default)]
struct Wakes {
    task: AtomicWaker,
    polling: AtomicBool,
    streams: AtomicBool,
    connection: AtomicBool,
    /// `closing`, or `cut_off` once closed.
    closing: AtomicBool,
}

impl Wakes {
    fn any(&self) -> bool {
        self.streams.load(Ordering::SeqCst)
            || self.connection.load(Ordering::SeqCst)
            || self.closing.load(Ordering::SeqCst)
    }
}

/// What a [`FlagWaker`] marks.
#[derive(Clone, Copy)]
enum Flag {
    Streams,
    Connection,
    Closing,
}

struct FlagWaker {
    wakes: Arc<Wakes>,
    flag: Flag,
}

impl Wake for FlagWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let flag = match self.flag {
            Flag::Streams => &self.wakes.streams,
            Flag::Connection => &self.wakes.connection,
            Flag::Closing => &self.wakes.closing,
        };
        // SeqCst with the task's own stores and loads: either the task
        // sees the flag once its poll ends, or this sees it not polling.
        flag.store(true, Ordering::SeqCst);
        if !self.wakes.polling.load(Ordering::SeqCst) {
            self.wakes.task.wake();
        }
    }
}

/// One stream: the response `handling` gives, sent on `reply` with its
/// body. A client that resets the stream first cancels the handling (it
/// is dropped, as hyper drops it); one that gives the body no window for
/// `stall` gets the stream reset.
///
/// Each stream's future is moved three times into the connection's set
/// (`FuturesUnordered::push`): what it keeps while the body is sent is
/// only the body, once, and its stream; the response's head is sent by
/// [`send_head`], whose locals are not part of the future's state.
pub(super) async fn respond<F, B>(
    handling: F,
    mut reply: h2::server::SendResponse<Bytes>,
    stall: std::time::Duration,
) where
    F: Future<Output = Response<B>>,
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    // Scoped, so that the response is not kept beside its body.
    let (mut body, mut send) = {
        let rsp = {
            let mut handling = pin!(handling);
            poll_fn(|cx| {
                if let Poll::Ready(rsp) = handling.as_mut().poll(cx) {
                    return Poll::Ready(Some(rsp));
                }
                reply.poll_reset(cx).map(|_| None)
            })
            .await
        };
        match rsp.and_then(|rsp| send_head(rsp, &mut reply)) {
            Some(sending) => sending,
            None => return,
        }
    };
    // By reference: the body is kept once, here, not again in
    // `send_body`'s state.
    let sent = send_body(&mut body, &mut send, Some(stall)).await;
    drop(body);
    if let Err(Some(reason)) = sent {
        send.send_reset(reason);
    }
}

/// Sends the head of `rsp` on `reply`: its body and the stream to send it
/// on, or `None` when nothing more is to be sent (the body ended with the
/// head, or the head could not be sent and the stream was reset).
fn send_head<B>(
    rsp: Response<B>,
    reply: &mut h2::server::SendResponse<Bytes>,
) -> Option<(B, h2::SendStream<Bytes>)>
where
    B: Body<Data = Bytes>,
{
    let (mut parts, body) = rsp.into_parts();
    // h2 refuses to send any of them. The same pass over the names tells
    // what is there of the rest: no lookups of their own.
    let seen = crate::http::strip_hop_by_hop_http2(&mut parts.headers);
    if !seen.date() {
        parts.headers.insert(header::DATE, date::now());
    }
    let end = body.is_end_stream();
    if !end && !seen.content_length() {
        if let Some(len) = body.size_hint().exact() {
            parts
                .headers
                .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        }
    }
    let send = match reply.send_response(Response::from_parts(parts, ()), end) {
        Ok(send) => send,
        Err(e) => {
            tracing::debug!(error = %bounded(&e), "HTTP/2 response not sent");
            reply.send_reset(h2::Reason::INTERNAL_ERROR);
            return None;
        }
    };
    if end {
        return None;
    }
    Some((body, send))
}

/// The `Date` header of responses that come without one (a proxy that
/// forwards such a response adds it, RFC 9110 §6.6.1), made once a
/// second per thread, as hyper does.
mod date {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};

    use http::HeaderValue;

    thread_local! {
        static CACHED: RefCell<Option<(u64, HeaderValue)>> = const { RefCell::new(None) };
    }

    pub(super) fn now() -> HeaderValue {
        let now = SystemTime::now();
        let second = now
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        CACHED.with(|cached| {
            let mut cached = cached.borrow_mut();
            match &*cached {
                Some((at, value)) if *at == second => value.clone(),
                _ => {
                    let mut value = HeaderValue::from_maybe_shared(bytes::Bytes::from(
                        httpdate::fmt_http_date(now),
                    ))
                    .expect("an HTTP date is a valid header value");
                    // As the app's is: see `crate::http::strip_hop_by_hop_http2`.
                    value.set_sensitive(true);
                    *cached = Some((second, value.clone()));
                    value
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::{oneshot, watch, Notify};

    use super::super::{serve_http, Conn, RequestBody, ServeConfig, ServeLimits};
    use super::*;
    use crate::http::BodyError;
    use crate::metrics::ProxyMetrics;

    /// Bounds every wait on the server: far past anything a loaded machine
    /// takes, only reached when the awaited event never comes.
    const WAIT: Duration = Duration::from_secs(20);

    async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
        tokio::time::timeout(WAIT, f)
            .await
            .unwrap_or_else(|_| panic!("{what}: not within {WAIT:?}"))
    }

    /// A listener serving `svc` as the proxy's listeners do; the sender
    /// drains its connections.
    async fn listen<S, Fut, B>(svc: S) -> (SocketAddr, watch::Sender<bool>)
    where
        S: Fn(Request<RequestBody>) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Response<B>> + Send + 'static,
        B: Body<Data = Bytes, Error = BodyError> + Send + Unpin + 'static,
    {
        listen_counting(svc, Arc::default()).await
    }

    /// [`listen`], counting in `polls` how often its connections' tasks
    /// are polled.
    async fn listen_counting<S, Fut, B>(
        svc: S,
        polls: Arc<AtomicUsize>,
    ) -> (SocketAddr, watch::Sender<bool>)
    where
        S: Fn(Request<RequestBody>) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Response<B>> + Send + 'static,
        B: Body<Data = Bytes, Error = BodyError> + Send + Unpin + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (drain_tx, drain) = watch::channel(false);
        let config = ServeConfig {
            max_connections: Some(16),
            ..ServeConfig::default()
        };
        let limits = ServeLimits::new(&config, WAIT, ProxyMetrics::default());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let conn = Conn {
                    drain: drain.clone(),
                    _permit: limits.connections.clone().try_acquire_owned().unwrap(),
                    limits: limits.clone(),
                    direction: "test",
                    socket: None,
                };
                let mut serving = Box::pin(serve_http(stream, svc.clone(), conn));
                let polls = polls.clone();
                tokio::spawn(poll_fn(move |cx| {
                    polls.fetch_add(1, Ordering::Relaxed);
                    serving.as_mut().poll(cx)
                }));
            }
        });
        (addr, drain_tx)
    }

    /// An HTTP/2 client connection, and its end.
    async fn connect(
        addr: SocketAddr,
    ) -> (
        h2::client::SendRequest<Bytes>,
        tokio::task::JoinHandle<Result<(), h2::Error>>,
    ) {
        let io = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, conn) = h2::client::handshake(io).await.unwrap();
        (send, tokio::spawn(conn))
    }

    fn get() -> Request<()> {
        Request::get("http://test.example/").body(()).unwrap()
    }

    /// A request body bigger than both windows, with trailers, echoed as
    /// it is read: each side's flow control must give the window back for
    /// the other to finish, and trailers cross both ways.
    #[tokio::test]
    async fn bodies_past_the_window_and_trailers_cross_both_ways() {
        let (addr, _drain) = listen(|req: Request<RequestBody>| async move {
            assert!(matches!(req.body(), RequestBody::Http2(_)));
            Response::new(req.into_body())
        })
        .await;
        let (send, _conn) = connect(addr).await;
        let mut send = within("ready", send.ready()).await.unwrap();
        let (rsp, mut stream) = send.send_request(get(), false).unwrap();
        let data = Bytes::from((0..3 * STREAM_WINDOW).map(|i| i as u8).collect::<Vec<_>>());
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let frames = [
            Ok::<_, BodyError>(Frame::data(data.clone())),
            Ok(Frame::trailers(trailers.clone())),
        ];
        let body = StreamBody::new(futures::stream::iter(frames));
        let sending = tokio::spawn(async move { send_body(body, &mut stream, None).await.is_ok() });
        let rsp = within("response", rsp).await.unwrap();
        let (parts, recv) = rsp.into_parts();
        let echoed = within("echo", RecvBody::new(recv, &parts.headers).collect())
            .await
            .unwrap();
        assert!(sending.await.unwrap(), "request body sent");
        assert_eq!(echoed.trailers(), Some(&trailers));
        assert!(echoed.to_bytes() == data, "the body came back whole");
    }

    /// A request whose HEADERS ended the stream reaches the service with
    /// a body already at its end; a response known empty goes out as
    /// HEADERS with END_STREAM, with a `Date`.
    #[tokio::test]
    async fn no_body_either_way_is_headers_with_end_stream() {
        let (addr, _drain) = listen(|req: Request<RequestBody>| async move {
            let ended = req.body().is_end_stream();
            let mut rsp = Response::new(crate::http::empty());
            *rsp.status_mut() = if ended {
                http::StatusCode::NO_CONTENT
            } else {
                http::StatusCode::IM_A_TEAPOT
            };
            rsp
        })
        .await;
        let (send, _conn) = connect(addr).await;
        let mut send = within("ready", send.ready()).await.unwrap();
        let (rsp, _) = send.send_request(get(), true).unwrap();
        let rsp = within("response", rsp).await.unwrap();
        assert_eq!(rsp.status(), http::StatusCode::NO_CONTENT);
        assert!(rsp.body().is_end_stream(), "END_STREAM on the HEADERS");
        assert!(rsp.headers().contains_key(header::DATE));
    }

    /// A request whose response comes from another task (as a proxied
    /// one's does, from the connection to the app) costs the connection's
    /// task two polls: the request's arrival and the response's. Wake-ups
    /// it gave itself (`FuturesUnordered`'s after each pending poll of a
    /// stream; a finished stream's send capacity) cost it two more.
    #[tokio::test]
    async fn a_request_wakes_the_connection_task_twice() {
        const REQUESTS: usize = 20;
        let polls = Arc::new(AtomicUsize::new(0));
        let (addr, _drain) = listen_counting(
            |_req: Request<RequestBody>| async move {
                let answer = tokio::spawn(async { crate::http::full("hello") });
                Response::new(answer.await.unwrap())
            },
            polls.clone(),
        )
        .await;
        let (send, _conn) = connect(addr).await;
        let mut send = within("ready", send.ready()).await.unwrap();
        // The handshake's polls are not the requests'.
        let (rsp, _) = send.send_request(get(), true).unwrap();
        within("response", rsp).await.unwrap();
        let before = polls.load(Ordering::Relaxed);
        for _ in 0..REQUESTS {
            let (rsp, _) = send.send_request(get(), true).unwrap();
            let rsp = within("response", rsp).await.unwrap();
            let mut body = rsp.into_body();
            let data = within("body", body.data()).await.unwrap().unwrap();
            assert_eq!(data, "hello");
        }
        let polled = polls.load(Ordering::Relaxed) - before;
        // A margin for a frame that arrives on its own (a window update).
        assert!(
            polled <= REQUESTS * 2 + REQUESTS / 2,
            "{polled} polls of the connection's task for {REQUESTS} requests"
        );
    }

    /// A stream whose handling wakes itself on every poll gets a few
    /// passes per poll of the connection's task, then the task yields:
    /// the runtime's other tasks run, and the connection's other streams
    /// are answered meanwhile.
    #[tokio::test]
    async fn a_stream_that_keeps_waking_itself_starves_nothing() {
        let (addr, _drain) = listen(|req: Request<RequestBody>| async move {
            if req.uri().path() == "/spin" {
                // Forever ready to run, never done.
                poll_fn(|cx: &mut Context<'_>| {
                    cx.waker().wake_by_ref();
                    Poll::<()>::Pending
                })
                .await;
            }
            Response::new(crate::http::full("hello"))
        })
        .await;
        let (send, _conn) = connect(addr).await;
        let mut send = within("ready", send.ready()).await.unwrap();
        let spin = Request::get("http://test.example/spin").body(()).unwrap();
        let (_spinning, _) = send.send_request(spin, true).unwrap();
        // Another task of the runtime gets its turns.
        let ticks = tokio::spawn(async {
            for _ in 0..100 {
                tokio::task::yield_now().await;
            }
        });
        within("the other task's turns", ticks).await.unwrap();
        // And the connection answers its other streams.
        let (rsp, _) = send.send_request(get(), true).unwrap();
        let rsp = within("the other stream's response", rsp).await.unwrap();
        assert_eq!(rsp.status(), http::StatusCode::OK);
    }

    /// A client that resets its stream cancels the request: the service's
    /// future is dropped (the proxied request with it), not left running.
    #[tokio::test]
    async fn a_client_reset_drops_the_request() {
        struct OnDrop(Option<oneshot::Sender<()>>);
        impl Drop for OnDrop {
            fn drop(&mut self) {
                let _ = self.0.take().unwrap().send(());
            }
        }
        let (started_tx, started) = tokio::sync::mpsc::unbounded_channel();
        let (addr, _drain) = listen(move |_req: Request<RequestBody>| {
            let (dropped_tx, dropped) = oneshot::channel();
            let _ = started_tx.send(dropped);
            let guard = OnDrop(Some(dropped_tx));
            async move {
                let _guard = guard;
                std::future::pending::<Response<crate::http::Body>>().await
            }
        })
        .await;
        let mut started = started;
        let (send, _conn) = connect(addr).await;
        let mut send = within("ready", send.ready()).await.unwrap();
        let (_rsp, mut stream) = send.send_request(get(), false).unwrap();
        let dropped = within("request served", started.recv()).await.unwrap();
        stream.send_reset(h2::Reason::CANCEL);
        within("the request dropped", dropped).await.unwrap();
    }

    /// Draining: the client is told to go (GOAWAY), the request in flight
    /// is answered in full, then the connection closes.
    #[tokio::test]
    async fn a_drained_connection_finishes_its_requests_then_closes() {
        let release = Arc::new(Notify::new());
        let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel();
        let (addr, drain) = listen({
            let release = release.clone();
            move |_req: Request<RequestBody>| {
                let release = release.clone();
                let _ = started_tx.send(());
                async move {
                    release.notified().await;
                    Response::new(crate::http::full("done"))
                }
            }
        })
        .await;
        let io = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, mut conn) = h2::client::handshake(io).await.unwrap();
        let mut ping_pong = conn.ping_pong().unwrap();
        let conn = tokio::spawn(conn);
        let mut send = within("ready", send.ready()).await.unwrap();
        let (rsp, _) = send.send_request(get(), true).unwrap();
        within("request served", started.recv()).await.unwrap();
        drain.send(true).unwrap();
        // The GOAWAY reaches the client while the request is in flight
        // (after it, the client opens no stream); each PING answered is
        // a round trip in which it could have come.
        let told_to_go = async {
            while send.clone().ready().await.is_ok() {
                ping_pong.ping(h2::Ping::opaque()).await.unwrap();
            }
        };
        within("GOAWAY", told_to_go).await;
        release.notify_one();
        let rsp = within("response", rsp).await.unwrap();
        let (parts, recv) = rsp.into_parts();
        let body = within("body", RecvBody::new(recv, &parts.headers).collect())
            .await
            .unwrap();
        assert_eq!(body.to_bytes(), "done");
        // Closed by the server: this side still holds it.
        let _ = within("connection closed", conn).await.unwrap();
        drop(send);
    }

    /// A header list past the limit is refused without reaching the
    /// service, and the connection serves on; a header block that does
    /// not decode closes the connection with an error.
    #[tokio::test]
    async fn oversized_and_garbage_header_blocks_are_refused() {
        let served = Arc::new(AtomicUsize::new(0));
        let (addr, _drain) = listen({
            let served = served.clone();
            move |_req: Request<RequestBody>| {
                served.fetch_add(1, Ordering::Relaxed);
                async { Response::new(crate::http::empty()) }
            }
        })
        .await;
        let (send, _conn) = connect(addr).await;
        let mut send = within("ready", send.ready()).await.unwrap();
        let mut big = get();
        let value = "x".repeat(MAX_HEADER_LIST_SIZE_FOR_TEST + 1);
        big.headers_mut()
            .insert("x-big", HeaderValue::from_str(&value).unwrap());
        let (rsp, _) = send.send_request(big, true).unwrap();
        match within("oversized answered", rsp).await {
            Ok(rsp) => assert_eq!(rsp.status(), 431),
            Err(e) => assert_eq!(e.reason(), Some(h2::Reason::REFUSED_STREAM), "{e}"),
        }
        let mut send = within("ready", send.ready()).await.unwrap();
        let (rsp, _) = send.send_request(get(), true).unwrap();
        assert_eq!(within("next", rsp).await.unwrap().status(), 200);
        assert_eq!(served.load(Ordering::Relaxed), 1);

        let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
        raw.write_all(crate::detect::H2_PREFACE).await.unwrap();
        raw.write_all(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]).await.unwrap();
        // HEADERS, END_HEADERS | END_STREAM, stream 1: an index past
        // every table.
        raw.write_all(&[0, 0, 4, 0x1, 0x5, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0x7f])
            .await
            .unwrap();
        let goaway = within("GOAWAY", async {
            loop {
                let (kind, _, payload) = read_frame(&mut raw).await;
                if kind == 0x7 {
                    return payload;
                }
            }
        })
        .await;
        let code = u32::from_be_bytes(goaway[4..8].try_into().unwrap());
        assert_ne!(h2::Reason::from(code), h2::Reason::NO_ERROR);
        assert_eq!(served.load(Ordering::Relaxed), 1);
    }

    /// A `Date`, the app's or the one the server adds, goes out as a
    /// never-indexed literal (RFC 7541 §6.2.3: `0001` and the static
    /// table's index of `date`, 33, as 15 + 18): in the dynamic table, a
    /// value new each second would push out the entries worth keeping and
    /// make h2's encoder walk every older one per response.
    #[tokio::test]
    async fn a_date_is_never_indexed() {
        let (addr, _drain) = listen(|req: Request<RequestBody>| async move {
            let mut rsp = Response::new(crate::http::empty());
            if req.uri().path() == "/own" {
                rsp.headers_mut().insert(
                    header::DATE,
                    HeaderValue::from_static("Tue, 01 Dec 2026 12:00:00 GMT"),
                );
            }
            rsp
        })
        .await;
        let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
        raw.write_all(crate::detect::H2_PREFACE).await.unwrap();
        raw.write_all(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]).await.unwrap();
        // GET http://test.example{path}: `:method GET`, `:scheme http`
        // and `:authority` by index and literal, `:path` as a literal.
        let request = |stream: u8, path: &str| {
            let mut block = vec![0x82, 0x86, 0x41, 12];
            block.extend_from_slice(b"test.example");
            block.extend_from_slice(&[0x04, path.len() as u8]);
            block.extend_from_slice(path.as_bytes());
            let mut frame = vec![0, 0, block.len() as u8, 0x1, 0x5, 0, 0, 0, stream];
            frame.extend_from_slice(&block);
            frame
        };
        for (stream, path) in [(1, "/own"), (3, "/own"), (5, "/none"), (7, "/none")] {
            raw.write_all(&request(stream, path)).await.unwrap();
        }
        let blocks = within("four responses", async {
            let mut blocks = Vec::new();
            while blocks.len() < 4 {
                let (kind, stream, payload) = read_frame(&mut raw).await;
                if kind == 0x1 {
                    blocks.push((stream, payload));
                }
            }
            blocks
        })
        .await;
        for (stream, block) in blocks {
            // `:status 200` by index, then the `Date`.
            assert_eq!(
                block[..3],
                [0x88, 0x1f, 0x12],
                "stream {stream}: {block:02x?}"
            );
            assert!(
                block.len() > 20,
                "stream {stream}: the value is there: {block:02x?}"
            );
        }
    }

    /// The next frame a raw connection reads: its type, stream and
    /// payload.
    async fn read_frame(raw: &mut tokio::net::TcpStream) -> (u8, u32, Vec<u8>) {
        let mut head = [0; 9];
        raw.read_exact(&mut head).await.unwrap();
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]);
        let mut payload = vec![0; len];
        raw.read_exact(&mut payload).await.unwrap();
        (head[3], stream, payload)
    }

    const MAX_HEADER_LIST_SIZE_FOR_TEST: usize = super::super::MAX_HEADER_LIST_SIZE as usize;
}
