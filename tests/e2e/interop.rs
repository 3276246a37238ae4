//! A mesh mixing Tether and linkerd2-proxy, checked on the wire. No stock
//! linkerd2-proxy binary runs here, so each test plays linkerd2-proxy's
//! part by its conventions — `linkerd/proxy/http/src/orig_proto.rs`,
//! `linkerd/transport-header`, `linkerd/app/inbound/src/direct.rs` — as
//! the client of a Tether inbound, and as the inbound a Tether outbound
//! sends to, checking each byte linkerd2-proxy relies on.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http_body_util::{BodyExt, Empty, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::support::*;

pub fn id(name: &str) -> String {
    format!("{name}.test.serviceaccount.identity.cluster.local")
}

/// `transport.l5d.io.Header`, declared from linkerd2-proxy's
/// `linkerd/transport-header/proto/header.proto` (`linkerd2-proxy-api`
/// does not publish it).
#[derive(Clone, PartialEq, Message)]
struct L5dHeader {
    #[prost(int32, tag = "1")]
    port: i32,
    #[prost(string, tag = "2")]
    name: String,
    #[prost(message, optional, tag = "3")]
    session_protocol: Option<L5dSessionProtocol>,
}

#[derive(Clone, PartialEq, Message)]
struct L5dSessionProtocol {
    #[prost(oneof = "L5dSession", tags = "1, 2")]
    kind: Option<L5dSession>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum L5dSession {
    #[prost(message, tag = "1")]
    Http1(L5dEmpty),
    #[prost(message, tag = "2")]
    Http2(L5dEmpty),
}

#[derive(Clone, PartialEq, Message)]
struct L5dEmpty {}

const L5D_ALPN: &[u8] = b"transport.l5d.io/v1";
const L5D_PREFACE: &[u8] = b"transport.l5d.io/v1\r\n\r\n";

/// The bytes linkerd2-proxy writes first on a connection whose ALPN is
/// `transport.l5d.io/v1` (`TransportHeader::encode_prefaced`).
fn l5d_transport_header(port: u16, session: Option<L5dSession>) -> Bytes {
    let header = L5dHeader {
        port: port.into(),
        name: String::new(),
        session_protocol: session.map(|kind| L5dSessionProtocol { kind: Some(kind) }),
    };
    let mut buf = BytesMut::new();
    buf.put_slice(L5D_PREFACE);
    buf.put_u32(header.encoded_len() as u32);
    header.encode(&mut buf).unwrap();
    buf.freeze()
}

/// A control plane issuing certificates (its registry starts empty).
pub struct Mesh {
    pub scratch: Scratch,
    pub ca: PathBuf,
    pub control: Process,
}

impl Mesh {
    pub async fn start() -> Self {
        let scratch = Scratch::new();
        let ca = scratch.identity_init("ca");
        let control = scratch.control_with_identity("control", &ca, "3600").await;
        Self {
            scratch,
            ca,
            control,
        }
    }

    /// A Tether sidecar holding `identity`, TLS mandatory, ready.
    pub async fn proxy(&self, identity: &str, app: Option<SocketAddr>, extra: &[&str]) -> Process {
        let mut args = self
            .scratch
            .identity_args(&self.ca, &id(identity), &self.ca);
        args.extend(["--tls".into(), "mandatory".into()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let proxy = self
            .scratch
            .proxy(identity, self.control.addr("grpc"), app, &args)
            .await;
        wait_ready(proxy.addr("admin")).await;
        proxy
    }

    /// A TLS client holding a mesh certificate for `identity`, offering
    /// `alpn` (linkerd2-proxy offers none for HTTP, `transport.l5d.io/v1`
    /// for opaque TCP).
    async fn client_tls(&self, identity: &str, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
        let tls = certified_client_tls(self.control.addr("grpc"), &self.ca, &id(identity)).await;
        let mut tls = (*tls).clone();
        tls.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(tls)
    }

    /// A TLS server holding a mesh certificate for `identity`, offering
    /// ALPN `transport.l5d.io/v1` as linkerd2-proxy's inbound port does.
    async fn server_tls(&self, identity: &str) -> Arc<rustls::ServerConfig> {
        let (store, roots) =
            certified_store(self.control.addr("grpc"), &self.ca, &id(identity)).await;
        let tls = tether_identity::tls::server_config(store, roots).unwrap();
        let mut tls = (*tls).clone();
        tls.alpn_protocols = vec![L5D_ALPN.to_vec()];
        Arc::new(tls)
    }

    /// Registers `service` (port, opaque or not) with one meshed endpoint
    /// at `addr` holding `identity`.
    fn service(&self, service: &str, port: u16, opaque: bool, addr: SocketAddr, identity: &str) {
        self.scratch.write(
            &format!("{service}.yaml"),
            &format!(
                "kind: Service\nname: {service}\nnamespace: test\nports: [{{port: {port}, opaque: {opaque}}}]\n\
                 ---\nkind: Endpoints\nservice: {service}\nnamespace: test\n\
                 endpoints: [{{address: \"{addr}\", identity: {}}}]\n",
                id(identity)
            ),
        );
    }
}

/// An app that speaks only HTTP/1 and answers with what it saw: the
/// request's version, its target, and any marker header that reached it.
async fn http1_only_app() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let svc = hyper::service::service_fn(
                |req: http::Request<hyper::body::Incoming>| async move {
                    let markers: Vec<&str> = ["l5d-orig-proto", "tether-orig-proto"]
                        .into_iter()
                        .filter(|m| req.headers().contains_key(*m))
                        .collect();
                    let seen = format!(
                        "{:?} {} markers:{}",
                        req.version(),
                        req.uri(),
                        markers.join(",")
                    );
                    let mut rsp = http::Response::new(Full::new(Bytes::from(seen)));
                    // linkerd2-proxy's identity header, as an app migrated
                    // from Linkerd reads it.
                    if let Some(client_id) = req.headers().get("l5d-client-id") {
                        rsp.headers_mut()
                            .insert("seen-l5d-client-id", client_id.clone());
                    }
                    Ok::<_, Infallible>(rsp)
                },
            );
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc),
            );
        }
    });
    addr
}

/// An HTTP/2 connection over mTLS to `addr`, verified as `server`.
async fn h2_over_tls(
    addr: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    server: &str,
) -> hyper::client::conn::http2::SendRequest<Empty<Bytes>> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from(server.to_string()).unwrap();
    let stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .unwrap();
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    send
}

#[tokio::test]
async fn a_linkerd2_proxy_client_reaches_an_http1_only_app() {
    // linkerd2-proxy carries an HTTP/1 request to a meshed peer over
    // HTTP/2, marked `l5d-orig-proto`; the Tether inbound must hand it to
    // its app as the HTTP/1 request it was, without the marker, and mark
    // its answer as linkerd2-proxy's inbound does.
    let mesh = Mesh::start().await;
    let app = http1_only_app().await;
    let server = mesh.proxy("web", Some(app), &[]).await;
    let tls = mesh.client_tls("linkerd", &[]).await;
    let mut h2 = h2_over_tls(server.addr("inbound"), tls, &id("web")).await;
    let authority = authority("web", 8080);
    let absolute = format!("http://{authority}/path?q");
    for (name, marker, seen, answered) in [
        (
            "l5d-orig-proto",
            "HTTP/1.1",
            "HTTP/1.1 /path?q".to_string(),
            Some("HTTP/1.1"),
        ),
        (
            "l5d-orig-proto",
            "HTTP/1.0",
            "HTTP/1.0 /path?q".to_string(),
            Some("HTTP/1.1"),
        ),
        (
            "l5d-orig-proto",
            "HTTP/1.1; absolute-form",
            format!("HTTP/1.1 {absolute}"),
            Some("HTTP/1.1"),
        ),
        // A Tether proxy from before the change: read, but not answered
        // (it would pass the answer's marker on to its app).
        (
            "tether-orig-proto",
            "HTTP/1.1",
            "HTTP/1.1 /path?q".to_string(),
            None,
        ),
    ] {
        let req = http::Request::get(&absolute)
            .header(name, marker)
            .body(Empty::new())
            .unwrap();
        let rsp = h2.send_request(req).await.unwrap();
        assert_eq!(rsp.status(), 200, "{name}: {marker}");
        assert_eq!(
            rsp.headers()
                .get("l5d-orig-proto")
                .map(|v| v.to_str().unwrap()),
            answered,
            "{name}: {marker}"
        );
        let body = rsp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, format!("{seen} markers:"), "{name}: {marker}");
    }
    // Offering the transport header's ALPN must not turn away a client
    // that offers only the usual ones (TLS refuses a handshake whose ALPN
    // lists do not meet).
    for alpn in [&b"h2"[..], b"http/1.1"] {
        let tls = mesh.client_tls("other", &[alpn]).await;
        let mut h2 = h2_over_tls(server.addr("inbound"), tls, &id("web")).await;
        let req = http::Request::get(&absolute)
            .header("l5d-orig-proto", "HTTP/1.1")
            .body(Empty::new())
            .unwrap();
        let rsp = h2.send_request(req).await.unwrap();
        assert_eq!(rsp.status(), 200, "{}", String::from_utf8_lossy(alpn));
    }
}

#[tokio::test]
async fn markers_an_app_sends_are_never_passed_on() {
    // The markers are the mesh's to set: an app that sends them to its
    // outbound changes nothing about the hop, and they never reach the
    // app at the other end.
    let mesh = Mesh::start().await;
    let app = http1_only_app().await;
    let server = mesh.proxy("web", Some(app), &[]).await;
    mesh.service("web", 8080, false, server.addr("inbound"), "web");
    let client = mesh.proxy("client", None, &[]).await;
    let mut conn = tokio::net::TcpStream::connect(client.addr("outbound"))
        .await
        .unwrap();
    let request = format!(
        "GET /path HTTP/1.1\r\nhost: {}\r\nl5d-orig-proto: HTTP/1.0; absolute-form\r\n\
         tether-orig-proto: HTTP/1.0\r\nconnection: close\r\n\r\n",
        authority("web", 8080)
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut answer))
        .await
        .expect("an answer")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.ends_with("\r\n\r\nHTTP/1.1 /path markers:"),
        "{answer}"
    );
    assert!(!answer.contains("orig-proto"), "{answer}");
}

#[tokio::test]
async fn linkerds_client_id_header_is_never_forged_and_is_set_as_linkerd2_proxy_sets_it() {
    // An app moved from linkerd2-proxy to Tether still trusts
    // `l5d-client-id`, which linkerd2-proxy's inbound sets from the
    // client's certificate and never passes on from a client: a client
    // naming another identity there must not reach the app with it.
    let mesh = Mesh::start().await;
    let app = http1_only_app().await;
    let server = mesh.proxy("web", Some(app), &[]).await;
    mesh.service("web", 8080, false, server.addr("inbound"), "web");
    let web = authority("web", 8080);
    let forged = id("admin");
    // A certified peer speaking straight to the inbound (linkerd2-proxy's
    // way), in both spellings an app may read.
    let tls = mesh.client_tls("linkerd", &[]).await;
    let mut h2 = h2_over_tls(server.addr("inbound"), tls, &id("web")).await;
    for name in ["l5d-client-id", "l5d_client_id"] {
        let req = http::Request::get(format!("http://{web}/"))
            .header("l5d-orig-proto", "HTTP/1.1")
            .header(name, &forged)
            .body(Empty::new())
            .unwrap();
        let rsp = h2.send_request(req).await.unwrap();
        assert_eq!(rsp.status(), 200, "{name}");
        assert_eq!(
            rsp.headers()["seen-l5d-client-id"],
            id("linkerd").as_str(),
            "{name}: the app must see the verified identity only"
        );
    }
    // An app sending it to its own Tether outbound.
    let client = mesh.proxy("client", None, &[]).await;
    let mut conn = tokio::net::TcpStream::connect(client.addr("outbound"))
        .await
        .unwrap();
    let request = format!(
        "GET / HTTP/1.1\r\nhost: {web}\r\nl5d-client-id: {forged}\r\nconnection: close\r\n\r\n"
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut answer))
        .await
        .expect("an answer")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer).to_lowercase();
    assert!(answer.starts_with("http/1.1 200"), "{answer}");
    assert!(
        answer.contains(&format!("seen-l5d-client-id: {}\r\n", id("client"))),
        "{answer}"
    );
}

/// A TLS server playing linkerd2-proxy's inbound port: reports each
/// connection's negotiated ALPN, then serves it with `serve`.
async fn linkerd_inbound<F, Fut>(
    tls: Arc<rustls::ServerConfig>,
    serve: F,
) -> (SocketAddr, mpsc::Receiver<Option<Vec<u8>>>)
where
    F: Fn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (alpn_tx, alpn_rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        while let Ok((tcp, _)) = listener.accept().await {
            let Ok(stream) = acceptor.accept(tcp).await else {
                continue;
            };
            let alpn = stream.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
            let _ = alpn_tx.try_send(alpn);
            tokio::spawn(serve(stream));
        }
    });
    (addr, alpn_rx)
}

#[tokio::test]
async fn the_outbound_marks_http1_as_a_linkerd2_proxy_inbound_expects() {
    let mesh = Mesh::start().await;
    // linkerd2-proxy's inbound downgrades a request marked
    // `l5d-orig-proto` and marks its answer the same way; this one
    // answers with the markers it was sent.
    let (addr, mut alpn) = linkerd_inbound(mesh.server_tls("lk").await, |stream| async move {
        let svc =
            hyper::service::service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                let marker = |name| {
                    req.headers()
                        .get(name)
                        .map(|v| v.to_str().unwrap().to_string())
                };
                let seen = format!(
                    "{:?} {:?}",
                    marker("l5d-orig-proto"),
                    marker("tether-orig-proto")
                );
                let rsp = http::Response::builder()
                    .header("l5d-orig-proto", "HTTP/1.1")
                    .body(Full::new(Bytes::from(seen)))
                    .unwrap();
                Ok::<_, Infallible>(rsp)
            });
        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(TokioIo::new(stream), svc)
            .await;
    })
    .await;
    mesh.service("lk", 8080, false, addr, "lk");
    let client = mesh.proxy("client", None, &[]).await;
    let answer = get(client.addr("outbound"), &authority("lk", 8080)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.body, r#"Some("HTTP/1.1") None"#);
    assert!(
        !answer.headers.contains_key("l5d-orig-proto"),
        "the marker reached the app: {:?}",
        answer.headers
    );
    // HTTP between proxies offers no ALPN, as linkerd2-proxy's does.
    assert_eq!(alpn.recv().await.unwrap(), None);
}

#[tokio::test]
async fn a_linkerd2_proxy_client_sends_opaque_tcp_with_a_transport_header() {
    let mesh = Mesh::start().await;
    let echo = echo_server().await;
    let server = mesh.proxy("db", Some(echo), &["--inbound-opaque"]).await;
    let inbound = server.addr("inbound");
    let tls = mesh.client_tls("linkerd", &[L5D_ALPN]).await;
    // The target port as linkerd2-proxy fills it in: the endpoint's port
    // (the inbound's own, with Tether's file registry) or, with the
    // inbound port given apart, the app's port.
    for port in [inbound.port(), echo.port()] {
        let mut stream = tls_connect(inbound, tls.clone(), &id("db")).await;
        assert_eq!(stream.get_ref().1.alpn_protocol(), Some(L5D_ALPN));
        let mut first = l5d_transport_header(port, None).to_vec();
        first.extend_from_slice(b"\x00\x01binary ping");
        stream.write_all(&first).await.unwrap();
        let mut echoed = [0u8; 13];
        tokio::time::timeout(Duration::from_secs(10), stream.read_exact(&mut echoed))
            .await
            .expect("an echo")
            .unwrap();
        assert_eq!(&echoed, b"\x00\x01binary ping", "port {port}");
    }
    // A port this proxy does not front is refused, and said why.
    let mut stream = tls_connect(inbound, tls.clone(), &id("db")).await;
    stream
        .write_all(&l5d_transport_header(1, None))
        .await
        .unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut rest))
        .await
        .expect("closed");
    assert!(rest.is_empty());
    let m = metrics(server.addr("admin")).await;
    assert_eq!(
        metric_value(
            &m,
            "tether_proxy_inbound_refused_total",
            &[("reason", "transport_header_port")]
        ),
        1.0,
        "{m}"
    );
}

#[tokio::test]
async fn a_transport_header_with_a_session_protocol_carries_http() {
    // linkerd2-proxy names the session protocol in the header when it
    // sends HTTP over a connection it tagged; the inbound serves HTTP
    // without detecting it.
    let mesh = Mesh::start().await;
    let app = http1_only_app().await;
    let server = mesh.proxy("web", Some(app), &[]).await;
    let inbound = server.addr("inbound");
    let tls = mesh.client_tls("linkerd", &[L5D_ALPN]).await;
    let mut stream = tls_connect(inbound, tls, &id("web")).await;
    let mut first =
        l5d_transport_header(inbound.port(), Some(L5dSession::Http1(L5dEmpty {}))).to_vec();
    first.extend_from_slice(b"GET /x HTTP/1.1\r\nhost: web\r\nconnection: close\r\n\r\n");
    stream.write_all(&first).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("an answer")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("HTTP/1.1 /x markers:"), "{answer}");
}

async fn tls_connect(
    addr: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    server: &str,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from(server.to_string()).unwrap();
    tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .expect("mTLS handshake")
}

#[tokio::test]
async fn the_outbound_sends_opaque_tcp_as_a_linkerd2_proxy_inbound_expects() {
    let mesh = Mesh::start().await;
    // linkerd2-proxy's inbound port (`direct.rs`): ALPN
    // `transport.l5d.io/v1`, then the header, then the client's bytes.
    let (headers_tx, mut headers) = mpsc::channel(4);
    let (addr, mut alpn) = linkerd_inbound(mesh.server_tls("db").await, move |mut stream| {
        let headers_tx = headers_tx.clone();
        async move {
            let mut preface = [0u8; 23];
            if stream.read_exact(&mut preface).await.is_err() || preface != L5D_PREFACE {
                let _ = headers_tx
                    .send(Err(String::from_utf8_lossy(&preface).into_owned()))
                    .await;
                return;
            }
            let len = stream.read_u32().await.unwrap() as usize;
            let mut msg = vec![0u8; len];
            stream.read_exact(&mut msg).await.unwrap();
            let _ = headers_tx
                .send(Ok(L5dHeader::decode(&msg[..]).unwrap()))
                .await;
            let (mut r, mut w) = tokio::io::split(stream);
            let _ = tokio::io::copy(&mut r, &mut w).await;
        }
    })
    .await;
    mesh.service("db", 5432, true, addr, "db");
    let upstream = format!("127.0.0.1:0={}", authority("db", 5432));
    let control = mesh.control.addr("grpc").to_string();
    let mut args: Vec<String> = [
        "proxy",
        "--control",
        &control,
        "--outbound",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--tls",
        "mandatory",
        "--upstream",
        &upstream,
    ]
    .map(String::from)
    .to_vec();
    args.extend(
        mesh.scratch
            .identity_args(&mesh.ca, &id("client"), &mesh.ca),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let client = mesh
        .scratch
        .spawn("client", &args, &["outbound", "admin", "upstream"])
        .await;
    wait_ready(client.addr("admin")).await;
    let mut conn = tokio::net::TcpStream::connect(client.addr("upstream"))
        .await
        .unwrap();
    conn.write_all(b"\x00\x01binary ping").await.unwrap();
    let mut echoed = [0u8; 13];
    tokio::time::timeout(Duration::from_secs(10), conn.read_exact(&mut echoed))
        .await
        .expect("an echo")
        .unwrap();
    assert_eq!(&echoed, b"\x00\x01binary ping");
    assert_eq!(alpn.recv().await.unwrap().as_deref(), Some(L5D_ALPN));
    let header = headers.recv().await.unwrap().expect("a transport header");
    assert_eq!(
        header,
        L5dHeader {
            port: addr.port().into(),
            name: String::new(),
            session_protocol: None,
        }
    );
}
