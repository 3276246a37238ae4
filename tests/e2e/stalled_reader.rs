//! A client that sends requests and never reads the responses: each
//! listener that serves HTTP/1 lets go of the response, and the app
//! connection behind it, once its writes to that client have made no
//! progress for `--idle-timeout`.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::Frame;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use crate::support::*;

/// The proxy's `--idle-timeout`, in seconds: small, so a release comes
/// soon after the buffers between app and client fill.
const IDLE_TIMEOUT_SECS: u64 = 1;

/// Bounds every wait: many idle timeouts, for a loaded machine; reached
/// only when the proxy holds on for good.
const WAIT: Duration = Duration::from_secs(30 * IDLE_TIMEOUT_SECS);

/// The app's side of the test: how many responses it has begun, and how
/// many of them it has seen let go.
#[derive(Default)]
struct Responses {
    begun: AtomicUsize,
    released: AtomicUsize,
}

/// A response body that never ends (no buffer between app and client can
/// hold it), counting itself released when dropped: when the proxy lets go
/// of the app connection that carries it.
struct Endless(Arc<Responses>);

const CHUNK: &[u8] = &[b'x'; 64 * 1024];

impl hyper::body::Body for Endless {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(CHUNK)))))
    }
}

impl Drop for Endless {
    fn drop(&mut self) {
        self.0.released.fetch_add(1, Ordering::SeqCst);
    }
}

/// An HTTP/1 app answering every request with an [`Endless`] body.
async fn endless_app() -> (SocketAddr, Arc<Responses>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let responses = Arc::new(Responses::default());
    let seen = responses.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            let seen = seen.clone();
            let svc = hyper::service::service_fn(move |_req| {
                let seen = seen.clone();
                async move {
                    seen.begun.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, std::convert::Infallible>(http::Response::new(Endless(seen)))
                }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(conn), svc),
            );
        }
    });
    (addr, responses)
}

/// A TCP connection that takes in little before the client reads it.
async fn small_window(addr: SocketAddr) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.connect(addr).await.unwrap()
}

/// Sends one request on `io` and never reads: the connection is returned
/// to be held open.
async fn never_read<I: AsyncRead + AsyncWrite + Unpin>(mut io: I, authority: &str) -> I {
    let request = format!("GET / HTTP/1.1\r\nhost: {authority}\r\n\r\n");
    io.write_all(request.as_bytes()).await.unwrap();
    io.flush().await.unwrap();
    io
}

fn id(name: &str) -> String {
    format!("{name}.test.serviceaccount.identity.cluster.local")
}

#[tokio::test]
async fn a_client_that_never_reads_its_responses_holds_no_app_connection_past_the_idle_timeout() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let ca = scratch.identity_init("ca");
    let control = scratch.control_with_identity("control", &ca, "3600").await;
    let (app, responses) = endless_app().await;
    // The outbound reaches the app directly; the inbound fronts it.
    scratch.endpoint("web-0", "web", app, false);
    let mut args = scratch.identity_args(&ca, &id("web"), &ca);
    args.extend(["--idle-timeout".into(), IDLE_TIMEOUT_SECS.to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = scratch
        .proxy("proxy", control.addr("grpc"), Some(app), &args)
        .await;
    wait_ready(proxy.addr("admin")).await;
    let web = authority("web", 8080);

    // One such client per listener that serves HTTP/1: the outbound, the
    // inbound in plaintext and over mTLS.
    let outbound = never_read(small_window(proxy.addr("outbound")).await, &web).await;
    let inbound = never_read(small_window(proxy.addr("inbound")).await, "web").await;
    let tls = certified_client_tls(control.addr("grpc"), &ca, &id("mallory")).await;
    let name = rustls::pki_types::ServerName::try_from(id("web")).unwrap();
    let tcp = small_window(proxy.addr("inbound")).await;
    let mtls = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .expect("mTLS handshake with the inbound");
    let mtls = never_read(mtls, "web").await;
    let clients = 3;

    assert!(
        eventually(WAIT, || async {
            responses.begun.load(Ordering::SeqCst) == clients
        })
        .await,
        "{} of {clients} requests reached the app",
        responses.begun.load(Ordering::SeqCst)
    );
    assert!(
        eventually(WAIT, || async {
            responses.released.load(Ordering::SeqCst) == clients
        })
        .await,
        "the proxy still holds {} of {clients} responses its clients never read, \
         past --idle-timeout {IDLE_TIMEOUT_SECS} s",
        clients - responses.released.load(Ordering::SeqCst)
    );
    // The proxy says why it closed them.
    let admin = proxy.addr("admin");
    let closed = |direction: &'static str, expected: f64| async move {
        eventually(WAIT, || async {
            let m = metrics(admin).await;
            let labels = [("direction", direction), ("reason", "write_stall")];
            metric_value(&m, "tether_proxy_connections_closed_total", &labels) == expected
        })
        .await
    };
    assert!(closed("outbound", 1.0).await, "{}", metrics(admin).await);
    assert!(closed("inbound", 2.0).await, "{}", metrics(admin).await);
    assert!(
        scratch
            .read_log("proxy")
            .contains("its client read none of a response"),
        "{}",
        scratch.read_log("proxy")
    );
    drop((outbound, inbound, mtls));
}
