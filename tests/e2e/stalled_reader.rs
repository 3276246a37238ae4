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
use http_body_util::Either;
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

/// The path the app answers at once, to see a route work.
const PROBE: &str = "/probe";

/// An HTTP/1 and HTTP/2 app answering every request but [`PROBE`] with an
/// [`Endless`] body.
async fn endless_app() -> (SocketAddr, Arc<Responses>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let responses = Arc::new(Responses::default());
    let seen = responses.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            let seen = seen.clone();
            let svc = hyper::service::service_fn(move |req: http::Request<_>| {
                let seen = seen.clone();
                async move {
                    let body = if req.uri().path() == PROBE {
                        Either::Left(http_body_util::Full::new(Bytes::from_static(b"ok")))
                    } else {
                        seen.begun.fetch_add(1, Ordering::SeqCst);
                        Either::Right(Endless(seen))
                    };
                    Ok::<_, std::convert::Infallible>(http::Response::new(body))
                }
            });
            tokio::spawn(async move {
                let auto = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                );
                let _ = auto
                    .serve_connection(hyper_util::rt::TokioIo::new(conn), svc)
                    .await;
            });
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

/// An HTTP/2 frame: 9-byte header (length, type, flags, stream), payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

/// An HTTP/2 client that gives the proxy all the window it may (stream and
/// connection) and asks `GET http://web/`, written frame by frame: a
/// client library would read the socket. The proxy is held back by TCP
/// alone.
async fn never_read_h2(mut io: tokio::net::TcpStream) -> tokio::net::TcpStream {
    const MAX_WINDOW: u32 = (1 << 31) - 1;
    let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    // SETTINGS_INITIAL_WINDOW_SIZE.
    let mut settings = vec![0x00, 0x04];
    settings.extend(MAX_WINDOW.to_be_bytes());
    bytes.extend(frame(0x4, 0, 0, &settings));
    // WINDOW_UPDATE of the connection, from its initial 64 KiB - 1.
    bytes.extend(frame(0x8, 0, 0, &(MAX_WINDOW - 65_535).to_be_bytes()));
    // HEADERS, END_STREAM | END_HEADERS: indexed `:method GET`, `:scheme
    // http`, `:path /`, then `:authority web` as a literal.
    let get = [0x82, 0x86, 0x84, 0x01, 0x03, b'w', b'e', b'b'];
    bytes.extend(frame(0x1, 0x5, 1, &get));
    io.write_all(&bytes).await.unwrap();
    io
}

/// The gateway's name for `edge`.
const EDGE: &str = "edge-global.global:8080";

/// A TLS connection to `addr` (verified as `server`) with a small window.
async fn tls_connect(
    addr: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    server: &str,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let name = rustls::pki_types::ServerName::try_from(server.to_string()).unwrap();
    tokio_rustls::TlsConnector::from(tls)
        .connect(name, small_window(addr).await)
        .await
        .expect("mTLS handshake")
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
    let idle_secs = IDLE_TIMEOUT_SECS.to_string();
    let idle_timeout = ["--idle-timeout", &idle_secs];
    let mut args = scratch.identity_args(&ca, &id("web"), &ca);
    args.extend(idle_timeout.map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = scratch
        .proxy("proxy", control.addr("grpc"), Some(app), &args)
        .await;
    wait_ready(proxy.addr("admin")).await;
    let web = authority("web", 8080);
    // The gateway reaches the app over mTLS through the inbound of a
    // second sidecar, one whose idle timeout outlasts the test: a Tether
    // inbound resets an HTTP/2 stream whose reader stalls for its idle
    // timeout, which would let go of the app's response however the
    // gateway fared.
    let mut edge_args = scratch.identity_args(&ca, &id("web"), &ca);
    edge_args.extend(["--idle-timeout".into(), (4 * WAIT.as_secs()).to_string()]);
    let edge_args: Vec<&str> = edge_args.iter().map(String::as_str).collect();
    let edge_proxy = scratch
        .proxy("edge-proxy", control.addr("grpc"), Some(app), &edge_args)
        .await;
    scratch.write(
        "edge.yaml",
        "kind: Service\nname: edge\nnamespace: test\nports: [{port: 8080}]\nglobal_id: edge-global\n",
    );
    scratch.write(
        "edge-0.yaml",
        &format!(
            "kind: Endpoints\nservice: edge\nnamespace: test\nendpoints: [{{address: \"{}\", identity: {}}}]\n",
            edge_proxy.addr("inbound"),
            id("web")
        ),
    );
    let gateway_process = scratch
        .gateway(
            "gateway",
            control.addr("grpc"),
            &ca,
            &id("gateway"),
            "cluster.local",
            &idle_timeout,
        )
        .await;
    let gateway = gateway_process.addr("gateway");
    let tls = certified_client_tls(control.addr("grpc"), &ca, &id("client")).await;
    let routed = || async {
        let answer = tls_get_path(gateway, tls.clone(), &id("gateway"), EDGE, PROBE).await;
        answer.is_ok_and(|a| a.status == 200)
    };
    assert!(
        eventually(WAIT, routed).await,
        "the gateway never routed to edge"
    );

    // One such client per listener that serves HTTP/1: the outbound, the
    // inbound in plaintext and over mTLS, the gateway.
    let outbound = never_read(small_window(proxy.addr("outbound")).await, &web).await;
    let inbound = never_read(small_window(proxy.addr("inbound")).await, "web").await;
    let mtls = tls_connect(proxy.addr("inbound"), tls.clone(), &id("web")).await;
    let mtls = never_read(mtls, "web").await;
    let through_gateway = tls_connect(gateway, tls, &id("gateway")).await;
    let through_gateway = never_read(through_gateway, EDGE).await;
    // HTTP/2 is bounded per stream (a response that gets no window for the
    // idle timeout is reset): the same holds when TCP is what stops it.
    let h2 = never_read_h2(small_window(proxy.addr("inbound")).await).await;
    let clients = 5;

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
    // The proxy says why it closed them (HTTP/2's stream was reset, its
    // connection kept).
    let (admin, gateway_admin) = (proxy.addr("admin"), gateway_process.addr("admin"));
    for (admin, direction, connections) in [
        (admin, "outbound", 1.0),
        (admin, "inbound", 2.0),
        (gateway_admin, "gateway", 1.0),
    ] {
        let labels = [("direction", direction), ("reason", "write_stall")];
        let counted = || async {
            let m = metrics(admin).await;
            metric_value(&m, "tether_proxy_connections_closed_total", &labels) == connections
        };
        assert!(
            eventually(WAIT, counted).await,
            "{direction}: {}",
            metrics(admin).await
        );
    }
    let warned = || async {
        scratch
            .read_log("proxy")
            .contains("its client read none of a response")
    };
    assert!(
        eventually(WAIT, warned).await,
        "{}",
        scratch.read_log("proxy")
    );
    drop((outbound, inbound, mtls, h2, through_gateway));
}
