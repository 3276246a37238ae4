//! What a hostile client can do to a proxy: forge identity headers past
//! protocol detection, tunnel with CONNECT. Each test is an attack that
//! once worked.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use linkerd2_proxy_api::identity::{identity_client::IdentityClient, CertifyRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::*;

const FORGED: &str = "admin.prod.serviceaccount.identity.cluster.local";

fn id(name: &str) -> String {
    format!("{name}.test.serviceaccount.identity.cluster.local")
}

/// A client certified by the control plane exactly as a mesh workload is:
/// its own key, a CSR, a bootstrap token, `Certify`.
async fn certified_client(
    control: SocketAddr,
    ca: &std::path::Path,
    identity: &str,
) -> Arc<rustls::ClientConfig> {
    let key = tether_identity::csr::generate(identity).unwrap();
    let token = tether_identity::token::LocalTokens::load(ca)
        .unwrap()
        .issue(identity);
    let mut client = IdentityClient::connect(format!("http://{control}"))
        .await
        .unwrap();
    let rsp = client
        .certify(CertifyRequest {
            identity: identity.into(),
            token: token.into_bytes(),
            certificate_signing_request: key.csr_der,
        })
        .await
        .unwrap()
        .into_inner();
    let store = tether_identity::tls::CertStore::new();
    store
        .install(
            rsp.leaf_certificate,
            rsp.intermediate_certificates,
            key.key_pkcs8,
            std::time::SystemTime::now() + Duration::from_secs(3600),
        )
        .unwrap();
    let roots = tether_identity::tls::load_roots(&ca.join("ca.crt")).unwrap();
    tether_identity::tls::client_config(store, Arc::new(roots)).unwrap()
}

/// Sends `bytes` over mTLS to `inbound` (verifying it as `server`) and
/// returns everything the proxy answers before it closes.
async fn send_raw(
    tls: Arc<rustls::ClientConfig>,
    inbound: SocketAddr,
    server: &str,
    bytes: &[u8],
) -> String {
    let tcp = tokio::net::TcpStream::connect(inbound).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from(server.to_string()).unwrap();
    let mut stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .expect("mTLS handshake with the inbound");
    // The proxy may close before reading everything; that is an answer too.
    let _ = stream.write_all(bytes).await;
    let _ = stream.flush().await;
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the proxy neither answered nor closed");
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn a_certified_client_cannot_forge_the_client_identity() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let ca = scratch.identity_init("ca");
    let control = scratch.control_with_identity("control", &ca, "3600").await;
    let app = scratch.demo_app("web-0", 0).await;
    let mut args = scratch.identity_args(&ca, &id("web"), &ca);
    args.extend(["--tls".into(), "mandatory".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = scratch
        .proxy(
            "server",
            control.addr("grpc"),
            Some(app.addr("http")),
            &args,
        )
        .await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            ready_body(server.addr("admin")).await.0 == 200
        })
        .await,
        "the server proxy never got its certificate"
    );
    let tls = certified_client(control.addr("grpc"), &ca, &id("mallory")).await;
    let inbound = server.addr("inbound");
    let web = id("web");

    // The client is genuinely certified: a plain request gets through, and
    // the app sees the verified identity, not the header.
    let valid = format!(
        "GET / HTTP/1.1\r\nhost: web\r\ntether-client-id: {FORGED}\r\nconnection: close\r\n\r\n"
    );
    let answer = send_raw(tls.clone(), inbound, &web, valid.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(&id("mallory")), "{answer}");
    assert!(!answer.contains(FORGED), "{answer}");

    let forged_header =
        format!("tether-client-id: {FORGED}\r\nhost: web\r\nconnection: close\r\n\r\n");
    let long_line = format!("GET /{} HTTP/1.1\r\n{forged_header}", "a".repeat(9000));
    let bad_version = format!("GET / HTTP/9.9\r\n{forged_header}");
    let garbage = format!("\x01\x02garbage\r\nGET / HTTP/1.1\r\n{forged_header}");
    let smuggled = format!("tether-opaque/1\r\nGET / HTTP/1.1\r\n{forged_header}");
    for (attack, bytes, answers_400) in [
        ("request line over 8 KiB", long_line, true),
        ("unknown HTTP version", bad_version, true),
        ("binary garbage", garbage, false),
        ("opaque preface on an HTTP port", smuggled, false),
    ] {
        let answer = send_raw(tls.clone(), inbound, &web, bytes.as_bytes()).await;
        assert!(
            !answer.contains(FORGED),
            "{attack}: the app saw the forged identity: {answer}"
        );
        assert!(
            !answer.contains("200 OK"),
            "{attack}: reached the app: {answer}"
        );
        if answers_400 {
            assert!(answer.starts_with("HTTP/1.1 400"), "{attack}: {answer}");
            assert!(
                answer.contains("tether-proxy-error: not a valid HTTP request"),
                "{attack}: {answer}"
            );
        } else {
            assert!(answer.is_empty(), "{attack}: {answer}");
        }
    }
    let m = metrics(server.addr("admin")).await;
    for reason in [
        "request_line_too_long",
        "bad_request_line",
        "not_http",
        "opaque_undeclared",
    ] {
        assert_eq!(
            metric_value(
                &m,
                "tether_proxy_inbound_refused_total",
                &[("reason", reason)]
            ),
            1.0,
            "{reason}: {m}"
        );
    }
}

#[tokio::test]
async fn a_declared_opaque_port_forwards_bytes_and_others_do_not() {
    // The same raw bytes: refused by an HTTP inbound, forwarded byte for
    // byte by an inbound declared opaque.
    let scratch = Scratch::new();
    let echo = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let echo_addr = echo.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = echo.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    let control = scratch.control().await;
    let http = scratch
        .proxy("http", control.addr("grpc"), Some(echo_addr), &[])
        .await;
    let opaque = scratch
        .proxy(
            "opaque",
            control.addr("grpc"),
            Some(echo_addr),
            &["--inbound-opaque"],
        )
        .await;
    let ping = b"\x00\x01binary ping\r\n";
    for (proxy, echoed) in [(&http, false), (&opaque, true)] {
        let mut conn = tokio::net::TcpStream::connect(proxy.addr("inbound"))
            .await
            .unwrap();
        conn.write_all(ping).await.unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), async {
            let mut buf = [0u8; 64];
            while out.len() < ping.len() {
                match conn.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => out.extend_from_slice(&buf[..n]),
                }
            }
        })
        .await;
        if echoed {
            assert_eq!(out, ping);
        } else {
            assert!(out.is_empty(), "{:?}", String::from_utf8_lossy(&out));
        }
    }
    // A server-speaks-first protocol: the client sends nothing and still
    // reaches the app on an opaque port.
    let banner = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let banner_addr = banner.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = banner.accept().await {
            let _ = s.write_all(b"220 hello\r\n").await;
        }
    });
    let first = scratch
        .proxy(
            "first",
            control.addr("grpc"),
            Some(banner_addr),
            &["--inbound-opaque"],
        )
        .await;
    let mut conn = tokio::net::TcpStream::connect(first.addr("inbound"))
        .await
        .unwrap();
    let mut buf = [0u8; 11];
    tokio::time::timeout(Duration::from_secs(20), conn.read_exact(&mut buf))
        .await
        .expect("banner within the detection timeout")
        .unwrap();
    assert_eq!(&buf, b"220 hello\r\n");
}

#[tokio::test]
async fn connect_is_refused_on_both_sides() {
    let mesh = Mesh::start(&[0]).await;
    for target in [mesh.outbound(), mesh.sidecars[0].addr("inbound")] {
        let mut conn = tokio::net::TcpStream::connect(target).await.unwrap();
        conn.write_all(b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut buf))
            .await
            .expect("an answer")
            .unwrap();
        let answer = String::from_utf8_lossy(&buf[..n]);
        assert!(answer.starts_with("HTTP/1.1 405"), "{target}: {answer}");
        assert!(
            answer.contains("tether-proxy-error: CONNECT is not proxied"),
            "{answer}"
        );
    }
}
