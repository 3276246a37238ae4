//! Connections to one endpoint.
//!
//! HTTP/2 endpoints (peer proxies, gRPC apps) get one multiplexed connection,
//! established once however many requests race for it, and re-established
//! when it closes. HTTP/1 endpoints get a pool: a request takes an idle
//! connection or opens one, and the connection returns to the pool (bounded)
//! when its response body is done. Whether a connection is TLS is decided
//! by the [`Connector`].

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::{BoxFuture, FutureExt, Shared};
use http::{Request, Response};
use hyper::body::{Body as _, Incoming};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;

use crate::http::{Body, BodyError, Proto};
use crate::tls::Connector;

/// Idle HTTP/1 connections kept per endpoint.
const MAX_IDLE_H1: usize = 32;
/// HTTP/1 connections open per endpoint, busy or idle. HTTP/1 carries one
/// request at a time, so without a cap one client's HTTP/2 streams (or a
/// slow app) would open a connection — an fd — per request.
pub const MAX_H1: usize = 100;
/// While requests are in flight on an HTTP/2 connection that has read
/// nothing for this long, it is pinged...
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_millis(500);
/// ...and closed if no answer comes within this, failing its requests (the
/// retryable ones are retried elsewhere): a peer or gateway behind a cut
/// link is found dead within about a second, not after TCP's minutes. The
/// cost: one 17-byte PING and its ACK per half second on a connection
/// that waits silently; none on idle or busy ones. An alive but overloaded
/// peer that cannot answer a PING within a second loses its connection.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(1);

mod h2_conn;

/// Why no connection to an endpoint could take a request now.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// Connecting, the handshake or the connection failed.
    #[error("{0}")]
    Failed(String),
    /// Connected, but the peer allows no stream at the moment: a pause it
    /// may lift (RFC 9113 §5.1.2), not a failed endpoint.
    #[error("{}", h2_conn::NO_STREAMS)]
    NoStreams,
}

impl From<String> for ConnectError {
    fn from(reason: String) -> Self {
        Self::Failed(reason)
    }
}

/// An HTTP/2 connection, and whether it is TLS.
type H2 = (h2_conn::H2, bool);
type H1Pool = Arc<Mutex<Vec<(http1::SendRequest<Body>, bool)>>>;
type Connecting = Shared<BoxFuture<'static, Result<H2, String>>>;

enum H2Slot {
    Empty,
    Connecting(Connecting),
    Ready(H2),
}

pub struct EndpointClient {
    addr: SocketAddr,
    /// The identity the endpoint must prove, when TLS is used.
    identity: Option<String>,
    connector: Arc<Connector>,
    h2: Mutex<H2Slot>,
    h1_idle: H1Pool,
    /// Permits for HTTP/1 connections; each is held by its connection task.
    h1_open: Arc<tokio::sync::Semaphore>,
}

enum Kind {
    H1(http1::SendRequest<Body>, H1Pool),
    H2(h2_conn::Sender),
}

/// Why a request sent on a connection failed.
#[derive(Debug)]
pub struct SendError {
    error: BodyError,
    unprocessed: bool,
}

impl SendError {
    /// A failure the peer may have seen the request before.
    pub(crate) fn failed(error: impl Into<BodyError>) -> Self {
        Self {
            error: error.into(),
            unprocessed: false,
        }
    }

    /// The peer never processed the request: it refused the stream
    /// (REFUSED_STREAM, or a GOAWAY whose last stream id is below it), or
    /// the connection had closed before the request was written.
    pub(crate) fn unprocessed(error: impl Into<BodyError>) -> Self {
        Self {
            error: error.into(),
            unprocessed: true,
        }
    }

    /// Whether the request may be sent again as it was, whatever its
    /// method (RFC 9113 §8.7), if it still can be: nothing of it reached
    /// the app.
    pub fn is_unprocessed(&self) -> bool {
        self.unprocessed
    }
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

/// A connection ready to carry one request.
pub struct Connection {
    kind: Kind,
    /// Whether the connection is (m)TLS.
    pub tls: bool,
}

impl Connection {
    pub async fn send(self, req: Request<Body>) -> Result<Response<ResponseBody>, SendError> {
        match self.kind {
            Kind::H2(s) => Ok(s.send(req).await?.map(|body| ResponseBody {
                inner: Inner::H2(body),
                release: None,
            })),
            Kind::H1(mut s, pool) => {
                let rsp = s.try_send_request(req).await.map_err(|mut e| {
                    // hyper gives the request back when the connection
                    // closed before any of it was written.
                    if e.take_message().is_some() {
                        SendError::unprocessed(e.into_error())
                    } else {
                        SendError::failed(e.into_error())
                    }
                })?;
                // A connection that switched protocols is the tunnel's now.
                let release =
                    (rsp.status() != http::StatusCode::SWITCHING_PROTOCOLS).then(|| Release {
                        sender: s,
                        pool,
                        tls: self.tls,
                    });
                Ok(rsp.map(|body| ResponseBody {
                    inner: Inner::H1(body),
                    release,
                }))
            }
        }
    }
}

/// An HTTP/1 connection waiting for its response body to end, to go back
/// to its pool.
struct Release {
    sender: http1::SendRequest<Body>,
    pool: H1Pool,
    tls: bool,
}

impl Release {
    /// Back to the pool once the connection can carry the next request.
    /// By the time its body has been read to the end the connection is
    /// almost always ready (its task ran first): it goes back at once,
    /// without the task per request that used to wait for readiness.
    fn release(self) {
        if self.sender.is_ready() {
            return self.park();
        }
        if self.sender.is_closed() {
            return;
        }
        // Not ready yet (say, the request body is still being sent):
        // wait for it off the request's path.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let mut this = self;
            runtime.spawn(async move {
                if this.sender.ready().await.is_ok() {
                    this.park();
                }
            });
        }
    }

    fn park(self) {
        let mut idle = self.pool.lock().unwrap();
        if idle.len() < MAX_IDLE_H1 {
            idle.push((self.sender, self.tls));
        }
    }
}

/// A response body from an endpoint. Over HTTP/1 it hands its connection
/// back to the pool once it has been read to its end; a body dropped
/// before its end leaves the connection to close (hyper does not reuse it).
pub struct ResponseBody {
    inner: Inner,
    release: Option<Release>,
}

enum Inner {
    H1(Incoming),
    H2(h2_conn::H2Body),
}

impl Inner {
    fn is_end_stream(&self) -> bool {
        match self {
            Inner::H1(b) => b.is_end_stream(),
            Inner::H2(b) => b.is_end_stream(),
        }
    }
}

impl hyper::body::Body for ResponseBody {
    type Data = bytes::Bytes;
    type Error = crate::http::BodyError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, crate::http::BodyError>>>
    {
        let polled = match &mut self.inner {
            Inner::H1(b) => std::pin::Pin::new(b).poll_frame(cx).map_err(Into::into),
            Inner::H2(b) => std::pin::Pin::new(b).poll_frame(cx),
        };
        if let std::task::Poll::Ready(None) = polled {
            if let Some(release) = self.release.take() {
                release.release();
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match &self.inner {
            Inner::H1(b) => b.size_hint(),
            Inner::H2(b) => b.size_hint(),
        }
    }
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        // A server stops polling a body that says it has ended (an empty
        // body is never polled at all): ended is as good as read.
        if self.inner.is_end_stream() {
            if let Some(release) = self.release.take() {
                release.release();
            }
        }
    }
}

impl EndpointClient {
    pub fn new(addr: SocketAddr, identity: Option<String>, connector: Arc<Connector>) -> Self {
        Self {
            addr,
            identity,
            connector,
            h2: Mutex::new(H2Slot::Empty),
            h1_idle: Arc::default(),
            h1_open: Arc::new(tokio::sync::Semaphore::new(MAX_H1)),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Forgets the endpoint's connections, so they close once the requests
    /// still on them are done (or abandoned), and the next request connects
    /// anew (passive health took the endpoint out).
    pub fn close(&self) {
        *self.h2.lock().unwrap() = H2Slot::Empty;
        self.h1_idle.lock().unwrap().clear();
    }

    /// A raw stream to the endpoint (for opaque TCP), TLS as policy says.
    pub async fn connect_stream(&self) -> Result<(crate::tls::BoxedIo, bool), String> {
        self.connector
            .connect(self.addr, self.identity.as_deref())
            .await
    }

    /// A raw stream to a peer proxy for opaque TCP, offering the transport
    /// header's ALPN over mTLS.
    pub async fn connect_opaque(&self) -> Result<crate::tls::Connected, String> {
        self.connector
            .connect_opaque(self.addr, self.identity.as_deref())
            .await
    }

    pub async fn connection(&self, proto: Proto) -> Result<Connection, ConnectError> {
        match proto {
            Proto::Http1 => Ok(self.h1().await?),
            Proto::Http2 => {
                let (h2, tls) = self.h2().await?;
                let sender = match h2.sender().await {
                    Ok(sender) => sender,
                    // It closed, or the peer sent GOAWAY (a drain), since
                    // it was picked: marked closed, it gives way to a fresh
                    // connection, once. Nothing of the request was sent.
                    Err(_) if h2.is_closed() => {
                        let (h2, tls) = self.h2().await?;
                        return h2.sender().await.map(|sender| Connection {
                            kind: Kind::H2(sender),
                            tls,
                        });
                    }
                    Err(e) => return Err(e),
                };
                Ok(Connection {
                    kind: Kind::H2(sender),
                    tls,
                })
            }
        }
    }

    async fn h1(&self) -> Result<Connection, String> {
        loop {
            let Some((mut s, tls)) = self.h1_idle.lock().unwrap().pop() else {
                break;
            };
            if s.is_ready() || (!s.is_closed() && s.ready().await.is_ok()) {
                return Ok(Connection {
                    kind: Kind::H1(s, self.h1_idle.clone()),
                    tls,
                });
            }
        }
        // Wait (as long as a connect may take) for a connection to free up.
        let permit = tokio::time::timeout(
            self.connector.connect_timeout,
            self.h1_open.clone().acquire_owned(),
        )
        .await
        .map_err(|_| format!("{MAX_H1} HTTP/1 connections to {} are all busy", self.addr))?
        .map_err(|e| e.to_string())?;
        // Boxed: a new connection is rare, and inline its connect (TLS
        // included, 1.4 KB) set the size of every request's future that
        // awaits a connection, copied whole when that future is boxed.
        let (io, tls) = Box::pin(self.connect_stream()).await?;
        let (sender, conn) = http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            let _permit = permit;
            // An upgrade (WebSocket) takes the connection over when it
            // switches protocols (`crate::upgrade`).
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(error = %e, "HTTP/1 connection ended");
            }
        });
        Ok(Connection {
            kind: Kind::H1(sender, self.h1_idle.clone()),
            tls,
        })
    }

    async fn h2(&self) -> Result<H2, String> {
        let connecting = {
            let mut slot = self.h2.lock().unwrap();
            match &*slot {
                H2Slot::Ready((s, tls)) if !s.is_closed() => return Ok((s.clone(), *tls)),
                H2Slot::Connecting(f) => f.clone(),
                _ => {
                    let (addr, identity, connector) =
                        (self.addr, self.identity.clone(), self.connector.clone());
                    let f = async move { h2_connect(addr, identity.as_deref(), &connector).await }
                        .boxed()
                        .shared();
                    *slot = H2Slot::Connecting(f.clone());
                    f
                }
            }
        };
        let result = connecting.await;
        let mut slot = self.h2.lock().unwrap();
        match &result {
            Ok(conn) => {
                if matches!(&*slot, H2Slot::Connecting(_)) {
                    *slot = H2Slot::Ready(conn.clone());
                }
            }
            Err(_) => *slot = H2Slot::Empty,
        }
        result
    }
}

async fn h2_connect(
    addr: SocketAddr,
    identity: Option<&str>,
    connector: &Connector,
) -> Result<H2, String> {
    let (io, tls) = connector.connect(addr, identity).await?;
    let h2 = h2_conn::handshake(io, addr)
        .await
        .map_err(|e| e.to_string())?;
    Ok((h2, tls))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Serves HTTP/2 on `listener`, counting the connections it accepts.
    async fn serve_h2(listener: tokio::net::TcpListener, accepted: Arc<AtomicUsize>) {
        while let Ok((stream, _)) = listener.accept().await {
            accepted.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(crate::http::full("ok")))
                });
                let _ =
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
            });
        }
    }

    async fn h2_server() -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        tokio::spawn(serve_h2(listener, accepted.clone()));
        (addr, accepted)
    }

    #[tokio::test]
    async fn concurrent_callers_share_one_http2_connect() {
        let (addr, accepted) = h2_server().await;
        let client = Arc::new(EndpointClient::new(
            addr,
            None,
            Connector::plain(Duration::from_secs(5)),
        ));
        let callers: Vec<_> = (0..32)
            .map(|_| {
                let client = client.clone();
                tokio::spawn(async move { client.connection(Proto::Http2).await })
            })
            .collect();
        for caller in callers {
            let conn = caller.await.unwrap().unwrap();
            let rsp = conn
                .send(http::Request::new(crate::http::full("")))
                .await
                .unwrap();
            assert_eq!(rsp.status(), 200);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection for all");
    }

    /// Serves HTTP/1 on a fresh listener, counting accepted connections.
    async fn h1_server() -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(|_req| async {
                        Ok::<_, std::convert::Infallible>(http::Response::new(crate::http::full(
                            "hello",
                        )))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        (addr, accepted)
    }

    #[tokio::test]
    async fn an_http1_connection_is_reused_once_its_body_is_read() {
        use http_body_util::BodyExt;
        let (addr, accepted) = h1_server().await;
        let client = EndpointClient::new(addr, None, Connector::plain(Duration::from_secs(5)));
        for _ in 0..3 {
            let conn = client.connection(Proto::Http1).await.unwrap();
            let rsp = conn
                .send(http::Request::new(crate::http::full("")))
                .await
                .unwrap();
            let body = rsp.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"hello");
            // Back in the pool (at once, or by the task that waits for a
            // connection not ready yet), bounded by the connect timeout.
            tokio::time::timeout(Duration::from_secs(5), async {
                while client.h1_idle.lock().unwrap().is_empty() {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
            .await
            .expect("the connection returns to the pool");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection for all");
    }

    #[tokio::test]
    async fn a_failed_connect_is_not_cached() {
        // Nothing listens here (bound, then closed).
        let addr = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        let client = EndpointClient::new(addr, None, Connector::plain(Duration::from_secs(1)));
        assert!(client.connection(Proto::Http2).await.is_err());
        assert!(matches!(*client.h2.lock().unwrap(), H2Slot::Empty));
        // The next caller tries again (and succeeds once a server is there).
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        tokio::spawn(serve_h2(listener, Arc::default()));
        assert!(client.connection(Proto::Http2).await.is_ok());
    }

    /// Serves HTTP/2 with `svc` on a fresh listener, with the smallest
    /// flow-control windows HTTP/2 allows.
    async fn h2_server_with<F, Fut>(svc: F) -> SocketAddr
    where
        F: Fn(http::Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
        Fut: std::future::Future<Output = http::Response<Body>> + Send + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let svc = svc.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let rsp = svc(req);
                        async move { Ok::<_, std::convert::Infallible>(rsp.await) }
                    });
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .initial_stream_window_size(65_535)
                    .initial_connection_window_size(65_535)
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
                });
            }
        });
        addr
    }

    async fn h2_send(addr: SocketAddr, req: http::Request<Body>) -> Response<ResponseBody> {
        let client = EndpointClient::new(addr, None, Connector::plain(Duration::from_secs(5)));
        let conn = client.connection(Proto::Http2).await.unwrap();
        conn.send(req).await.unwrap()
    }

    #[tokio::test]
    async fn http2_response_trailers_pass_through() {
        use http_body_util::BodyExt;
        let addr = h2_server_with(|_req| async {
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("7"));
            let frames = vec![
                Ok::<_, BodyError>(hyper::body::Frame::data(bytes::Bytes::from_static(b"msg"))),
                Ok(hyper::body::Frame::trailers(trailers)),
            ];
            http::Response::new(
                http_body_util::StreamBody::new(futures::stream::iter(frames)).boxed(),
            )
        })
        .await;
        let rsp = h2_send(addr, http::Request::new(crate::http::empty())).await;
        let collected = rsp.into_body().collect().await.unwrap();
        assert_eq!(collected.trailers().unwrap()["grpc-status"], "7");
        assert_eq!(&collected.to_bytes()[..], b"msg");
    }

    /// Whether the request's HEADERS frame ended its stream, and how long
    /// its body was, as the server saw them.
    async fn describe_request(req: http::Request<Incoming>) -> http::Response<Body> {
        use http_body_util::BodyExt;
        let ended_at_headers = req.body().is_end_stream();
        let length = req.headers().get(http::header::CONTENT_LENGTH).cloned();
        let body = req.into_body().collect().await.unwrap().to_bytes();
        let mut rsp = http::Response::new(crate::http::full(body));
        rsp.headers_mut().insert(
            "x-ended-at-headers",
            ended_at_headers.to_string().parse().unwrap(),
        );
        if let Some(length) = length {
            rsp.headers_mut().insert("x-content-length", length);
        }
        rsp
    }

    #[tokio::test]
    async fn an_ended_http2_request_is_sent_in_one_frame_with_its_length() {
        use http_body_util::BodyExt;
        let addr = h2_server_with(describe_request).await;
        let rsp = h2_send(addr, http::Request::new(crate::http::empty())).await;
        assert_eq!(rsp.headers()["x-ended-at-headers"], "true");
        assert!(
            !rsp.headers().contains_key("x-content-length"),
            "a GET has none"
        );
        let mut post = http::Request::new(crate::http::full("abc"));
        *post.method_mut() = http::Method::POST;
        let rsp = h2_send(addr, post).await;
        assert_eq!(rsp.headers()["x-ended-at-headers"], "false");
        assert_eq!(rsp.headers()["x-content-length"], "3");
        assert_eq!(
            &rsp.into_body().collect().await.unwrap().to_bytes()[..],
            b"abc"
        );
    }

    #[tokio::test]
    async fn a_streamed_http2_request_body_larger_than_the_window_arrives_whole() {
        use http_body_util::BodyExt;
        let addr = h2_server_with(describe_request).await;
        // 1 MiB in chunks of 64 KiB, against windows of 64 KiB: sent only
        // as the server's reads open them.
        let sent: Vec<u8> = (0..1024 * 1024).map(|i| (i % 251) as u8).collect();
        let chunks: Vec<Result<hyper::body::Frame<bytes::Bytes>, BodyError>> = sent
            .chunks(64 * 1024)
            .map(|c| Ok(hyper::body::Frame::data(bytes::Bytes::copy_from_slice(c))))
            .collect();
        let mut req = http::Request::new(
            http_body_util::StreamBody::new(futures::stream::iter(chunks)).boxed(),
        );
        *req.method_mut() = http::Method::POST;
        let rsp = h2_send(addr, req).await;
        assert_eq!(rsp.headers()["x-ended-at-headers"], "false");
        let echoed = rsp.into_body().collect().await.unwrap().to_bytes();
        assert!(
            echoed[..] == sent[..],
            "{} bytes back of {}",
            echoed.len(),
            sent.len()
        );
    }

    /// A body that ends the way a peer's HTTP/2 stream often does: its
    /// last frame is empty, and after it the body says it has ended.
    struct EndsWithEmptyFrame(Vec<bytes::Bytes>);

    impl hyper::body::Body for EndsWithEmptyFrame {
        type Data = bytes::Bytes;
        type Error = BodyError;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, BodyError>>> {
            let next = (!self.0.is_empty()).then(|| self.0.remove(0));
            std::task::Poll::Ready(next.map(|data| Ok(hyper::body::Frame::data(data))))
        }

        fn is_end_stream(&self) -> bool {
            self.0.is_empty()
        }
    }

    #[tokio::test]
    async fn a_request_body_ending_with_an_empty_frame_ends_its_stream() {
        use http_body_util::BodyExt;
        let addr = h2_server_with(describe_request).await;
        let body = EndsWithEmptyFrame(vec![bytes::Bytes::from_static(b"abc"), bytes::Bytes::new()]);
        let mut req = http::Request::new(body.boxed());
        *req.method_mut() = http::Method::POST;
        // The server answers once the request's stream has ended.
        let rsp = tokio::time::timeout(Duration::from_secs(30), h2_send(addr, req))
            .await
            .expect("the request's stream ended");
        assert_eq!(
            &rsp.into_body().collect().await.unwrap().to_bytes()[..],
            b"abc"
        );
    }

    /// A peer draining (rolling restart, scale-down) sends GOAWAY: a
    /// request that finds its connection gone away (the GOAWAY read,
    /// nothing sent yet) goes out on a fresh one instead of failing.
    #[tokio::test]
    async fn a_request_finding_its_connection_gone_away_goes_out_on_a_fresh_one() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(1));
        let later = accepted.clone();
        tokio::spawn(async move {
            // The first connection answers one request, holds a second
            // (so it stays open), then drains as h2 does: GOAWAY, a PING's
            // round trip, GOAWAY again.
            let (stream, _) = listener.accept().await.unwrap();
            let mut conn = h2::server::handshake(stream).await.unwrap();
            let (_req, mut respond) = conn.accept().await.unwrap().unwrap();
            respond
                .send_response(http::Response::new(()), true)
                .unwrap();
            let (_req, held) = conn.accept().await.unwrap().unwrap();
            conn.graceful_shutdown();
            tokio::spawn(async move {
                let _held = held;
                while conn.accept().await.is_some() {}
            });
            serve_h2(listener, later).await;
        });
        let client = EndpointClient::new(addr, None, Connector::plain(Duration::from_secs(5)));
        let conn = client.connection(Proto::Http2).await.unwrap();
        let rsp = conn.send(http::Request::new(crate::http::empty())).await;
        assert_eq!(rsp.unwrap().status(), 200);
        let conn = client.connection(Proto::Http2).await.unwrap();
        let _held = tokio::spawn(conn.send(http::Request::new(crate::http::empty())));
        // Until the client has read the GOAWAY (bounded by a connect's
        // time, with room for a loaded machine).
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let H2Slot::Ready((h2, _)) = &*client.h2.lock().unwrap() {
                    if h2.refuses_streams() {
                        return;
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the client reads the GOAWAY");
        let conn = client.connection(Proto::Http2).await.unwrap();
        let rsp = conn.send(http::Request::new(crate::http::empty())).await;
        assert_eq!(rsp.map(|r| r.status()).ok(), Some(http::StatusCode::OK));
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "a fresh connection");
    }

    /// A peer that allows no stream at all (SETTINGS_MAX_CONCURRENT_STREAMS
    /// 0) gets no request, which would wait for its response timeout: it
    /// fails at once, naming the setting.
    #[tokio::test]
    async fn a_peer_allowing_no_streams_fails_fast_naming_it() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let mut conn = h2::server::Builder::new()
                .max_concurrent_streams(0)
                .handshake::<_, bytes::Bytes>(stream)
                .await
                .unwrap();
            while conn.accept().await.is_some() {}
        });
        let client = EndpointClient::new(addr, None, Connector::plain(Duration::from_secs(5)));
        // Until the client has read the peer's SETTINGS, bounded; nothing
        // is sent meanwhile.
        let error = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match client.connection(Proto::Http2).await {
                    Err(e) => return e,
                    Ok(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
        })
        .await
        .expect("the peer's SETTINGS are read");
        assert!(
            matches!(error, ConnectError::NoStreams)
                && error
                    .to_string()
                    .contains("SETTINGS_MAX_CONCURRENT_STREAMS is 0"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn keep_alive_closes_a_connection_whose_peer_stops_answering() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // A peer that sends its SETTINGS, then reads on and never answers
        // anything (a PING included): a peer behind a cut link.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            stream
                .write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0])
                .await
                .unwrap();
            let mut sink = [0u8; 4096];
            while stream.read(&mut sink).await.is_ok_and(|n| n > 0) {}
        });
        let client = EndpointClient::new(addr, None, Connector::plain(Duration::from_secs(5)));
        let conn = client.connection(Proto::Http2).await.unwrap();
        // Bounded by the keep-alive's own figures, with room for a loaded
        // machine; without the keep-alive it would wait forever.
        let bound = 10 * (2 * KEEPALIVE_INTERVAL + KEEPALIVE_TIMEOUT);
        let failed =
            tokio::time::timeout(bound, conn.send(http::Request::new(crate::http::empty())))
                .await
                .expect("the keep-alive fails the request")
                .err()
                .expect("no answer came");
        assert!(failed.to_string().contains("keep-alive"), "{failed}");
        let H2Slot::Ready((h2, _)) = &*client.h2.lock().unwrap() else {
            panic!("the connection was kept");
        };
        assert!(h2.is_closed(), "the next request connects anew");
    }
}
