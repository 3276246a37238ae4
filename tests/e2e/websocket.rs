//! HTTP/1.1 upgrades (WebSocket) through the mesh: app → outbound → mTLS
//! → inbound → app, and through the multicluster gateway; an upgraded
//! connection keeps its place under the connection cap and is closed when
//! idle.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::interop::{id, Mesh};
use crate::support::*;

/// RFC 6455's sample key and the accept value a server derives from it.
const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";
const ACCEPT: &str = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=";

/// A WebSocket echo server (text frames under 126 bytes, which is all the
/// tests send), speaking HTTP/1.1 only.
async fn websocket_echo_app() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let svc = hyper::service::service_fn(
                |mut req: http::Request<hyper::body::Incoming>| async move {
                    let key = req.headers().get("sec-websocket-key").cloned();
                    let upgrade = req.headers().get(http::header::UPGRADE).cloned();
                    if upgrade.as_ref().is_none_or(|u| u != "websocket")
                        || key.as_ref().is_none_or(|k| k != KEY)
                    {
                        let rsp = http::Response::new(Full::new(Bytes::from(
                            "not a WebSocket handshake",
                        )));
                        return Ok::<_, Infallible>(rsp);
                    }
                    let on_upgrade = hyper::upgrade::on(&mut req);
                    tokio::spawn(async move {
                        if let Ok(upgraded) = on_upgrade.await {
                            echo_frames(TokioIo::new(upgraded)).await;
                        }
                    });
                    let rsp = http::Response::builder()
                        .status(101)
                        .header(http::header::UPGRADE, "websocket")
                        .header(http::header::CONNECTION, "Upgrade")
                        .header("sec-websocket-accept", ACCEPT)
                        .body(Full::new(Bytes::new()))
                        .unwrap();
                    Ok(rsp)
                },
            );
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .with_upgrades(),
            );
        }
    });
    addr
}

/// Reads masked client frames and answers each with the same text,
/// unmasked, until the client closes.
async fn echo_frames<T: AsyncRead + AsyncWrite + Unpin>(mut io: T) {
    loop {
        let mut head = [0u8; 2];
        if io.read_exact(&mut head).await.is_err() {
            return;
        }
        let len = (head[1] & 0x7f) as usize;
        let mut mask = [0u8; 4];
        let mut payload = vec![0u8; len];
        if io.read_exact(&mut mask).await.is_err() || io.read_exact(&mut payload).await.is_err() {
            return;
        }
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= mask[i % 4];
        }
        let mut frame = vec![0x81, len as u8];
        frame.extend_from_slice(&payload);
        if io.write_all(&frame).await.is_err() {
            return;
        }
    }
}

/// Sends the opening handshake for `authority` and returns the response
/// head.
async fn handshake<T: AsyncRead + AsyncWrite + Unpin>(io: &mut T, authority: &str) -> String {
    let request = format!(
        "GET /chat HTTP/1.1\r\nhost: {authority}\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
         sec-websocket-key: {KEY}\r\nsec-websocket-version: 13\r\n\r\n"
    );
    io.write_all(request.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let read = tokio::time::timeout(Duration::from_secs(10), io.read(&mut byte))
            .await
            .expect("a handshake answer");
        if read.unwrap() == 0 {
            break;
        }
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).to_lowercase()
}

/// Sends `text` in a masked frame and returns the text of the frame that
/// comes back.
async fn echo<T: AsyncRead + AsyncWrite + Unpin>(io: &mut T, text: &str) -> String {
    let mask = [0x37, 0xfa, 0x21, 0x3d];
    let mut frame = vec![0x81, 0x80 | text.len() as u8];
    frame.extend_from_slice(&mask);
    frame.extend(text.bytes().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    io.write_all(&frame).await.unwrap();
    let mut head = [0u8; 2];
    tokio::time::timeout(Duration::from_secs(10), io.read_exact(&mut head))
        .await
        .expect("an echoed frame")
        .unwrap();
    assert_eq!(head[0], 0x81);
    let mut payload = vec![0u8; (head[1] & 0x7f) as usize];
    io.read_exact(&mut payload).await.unwrap();
    String::from_utf8(payload).unwrap()
}

/// A control plane issuing certificates, and `chat` (global id
/// `chat-global`) served by the WebSocket app behind a sidecar with an
/// identity, TLS mandatory.
struct ChatMesh {
    mesh: Mesh,
    server: Process,
}

impl ChatMesh {
    async fn start() -> Self {
        let mesh = Mesh::start().await;
        let app = websocket_echo_app().await;
        let server = mesh.proxy("chat", Some(app), &[]).await;
        mesh.scratch.write(
            "chat.yaml",
            &format!(
                "kind: Service\nname: chat\nnamespace: test\nports: [{{port: 8080}}]\nglobal_id: chat-global\n\
                 ---\nkind: Endpoints\nservice: chat\nnamespace: test\n\
                 endpoints: [{{address: \"{}\", identity: {}}}]\n",
                server.addr("inbound"),
                id("chat")
            ),
        );
        Self { mesh, server }
    }
}

#[tokio::test]
async fn websocket_echo_through_two_proxies_over_mtls() {
    let mesh = ChatMesh::start().await;
    let client = mesh.mesh.proxy("client", None, &[]).await;
    let mut ws = tokio::net::TcpStream::connect(client.addr("outbound"))
        .await
        .unwrap();
    let head = handshake(&mut ws, &authority("chat", 8080)).await;
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(
        head.contains(&format!("sec-websocket-accept: {}", ACCEPT.to_lowercase())),
        "{head}"
    );
    assert!(head.contains("upgrade: websocket"), "{head}");
    for text in ["hello", "through the mesh", "and back again"] {
        assert_eq!(echo(&mut ws, text).await, text);
    }
    // The upgrade crossed the proxies over mTLS, as HTTP/1.1.
    let m = metrics(mesh.server.addr("admin")).await;
    let upgraded = metric_value(
        &m,
        "tether_proxy_requests_total",
        &[
            ("direction", "inbound"),
            ("status_class", "1xx"),
            ("tls", "true"),
            ("client_id", &id("client")),
        ],
    );
    assert_eq!(upgraded, 1.0, "{m}");
}

#[tokio::test]
async fn an_upgraded_connection_keeps_its_place_and_closes_when_idle() {
    let mesh = ChatMesh::start().await;
    let idle = Duration::from_secs(2);
    let client = mesh
        .mesh
        .proxy(
            "client",
            None,
            &["--max-connections", "1", "--idle-timeout", "2"],
        )
        .await;
    let outbound = client.addr("outbound");
    let mut ws = tokio::net::TcpStream::connect(outbound).await.unwrap();
    let head = handshake(&mut ws, &authority("chat", 8080)).await;
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert_eq!(echo(&mut ws, "hold").await, "hold");
    // The tunnel holds the only connection: another is closed at once.
    let mut other = tokio::net::TcpStream::connect(outbound).await.unwrap();
    let _ = other.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await;
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(idle, other.read(&mut buf))
        .await
        .expect("closed at once")
        .unwrap_or(0);
    assert_eq!(n, 0, "{}", String::from_utf8_lossy(&buf[..n]));
    let m = metrics(client.addr("admin")).await;
    assert_eq!(
        metric_value(
            &m,
            "tether_proxy_connections_closed_total",
            &[("reason", "connection_limit")]
        ),
        1.0,
        "{m}"
    );
    // Silent for the idle timeout: closed (well within ten of them).
    let n = tokio::time::timeout(idle * 10, ws.read(&mut buf))
        .await
        .expect("the idle tunnel closed")
        .unwrap_or(0);
    assert_eq!(n, 0);
    // Its place is free again.
    assert!(
        eventually(idle * 5, || async {
            request(
                outbound,
                &authority("chat", 8080),
                "/",
                http::Version::HTTP_11,
            )
            .await
            .is_ok_and(|a| a.body == "not a WebSocket handshake")
        })
        .await,
        "the tunnel's place was not given back"
    );
}

#[tokio::test]
async fn websocket_through_the_gateway() {
    let ChatMesh {
        mesh,
        server: _server,
    } = ChatMesh::start().await;
    let gateway = mesh
        .scratch
        .gateway(
            "gateway",
            mesh.control.addr("grpc"),
            &mesh.ca,
            &id("gateway"),
            "cluster.local",
            &[],
        )
        .await;
    // Another cluster's proxy: mTLS with a mesh certificate, the global id.
    let tls: Arc<rustls::ClientConfig> =
        certified_client_tls(mesh.control.addr("grpc"), &mesh.ca, &id("remote")).await;
    let tcp = tokio::net::TcpStream::connect(gateway.addr("gateway"))
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from(id("gateway")).unwrap();
    let mut ws = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .unwrap();
    let head = handshake(&mut ws, "chat-global.global:8080").await;
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert_eq!(echo(&mut ws, "across clusters").await, "across clusters");
}

/// An HTTP/1.1 app that answers every request `101 Switching Protocols`,
/// upgrade or not, then writes `after`.
async fn always_switching_app() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = stream.read(&mut buf).await;
                let _ = stream
                    .write_all(
                        b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\nafter",
                    )
                    .await;
                let _ = stream.read(&mut buf).await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_101_to_a_request_that_asked_no_upgrade_is_a_bad_gateway() {
    // The client asked for no upgrade, so there is no tunnel to join: the
    // app broke HTTP, and the client must hear so, through a peer's inbound
    // (where HTTP/2 cannot carry a 101) and straight to a plaintext app
    // (where the client was told its protocol switched, then was closed).
    let mesh = Mesh::start().await;
    let app = always_switching_app().await;
    let server = mesh.proxy("chat", Some(app), &[]).await;
    mesh.scratch.write(
        "chat.yaml",
        &format!(
            "kind: Service\nname: chat\nnamespace: test\nports: [{{port: 8080}}]\n\
             ---\nkind: Endpoints\nservice: chat\nnamespace: test\n\
             endpoints: [{{address: \"{}\", identity: {}}}]\n",
            server.addr("inbound"),
            id("chat")
        ),
    );
    // And to the app straight, as an endpoint without a proxy.
    mesh.scratch.write(
        "plain.yaml",
        &format!(
            "kind: Service\nname: plain\nnamespace: test\nports: [{{port: 8080}}]\n\
             ---\nkind: Endpoints\nservice: plain\nnamespace: test\n\
             endpoints: [{{address: \"{app}\", meshed: false}}]\n"
        ),
    );
    // Opportunistic TLS, so that the plaintext endpoint is reached.
    let args = mesh
        .scratch
        .identity_args(&mesh.ca, &id("client"), &mesh.ca);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let client = mesh
        .scratch
        .proxy("client", mesh.control.addr("grpc"), None, &args)
        .await;
    wait_ready(client.addr("admin")).await;
    for service in ["chat", "plain"] {
        let mut conn = tokio::net::TcpStream::connect(client.addr("outbound"))
            .await
            .unwrap();
        let request = format!(
            "GET / HTTP/1.1\r\nhost: {}\r\nconnection: close\r\n\r\n",
            authority(service, 8080)
        );
        conn.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut answer))
            .await
            .expect("an answer")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 502"), "{service}: {answer}");
        assert!(
            answer.contains("asked for no upgrade"),
            "{service}: {answer}"
        );
        assert!(!answer.contains("after"), "{service}: {answer}");
    }
}
