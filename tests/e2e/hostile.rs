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
    let mut client = IdentityClient::new(certify_channel(control, ca));
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
    wait_ready(server.addr("admin")).await;
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
    let echo_addr = echo_server().await;
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

/// A proxy started by `sh` under `ulimit -n FDS` (soft and hard).
async fn proxy_with_fd_limit(
    scratch: &Scratch,
    name: &str,
    fds: u32,
    args: &[&str],
    expect: &[&str],
) -> Process {
    let mut all = vec![
        "-c".to_string(),
        format!("ulimit -n {fds} && exec \"$0\" \"$@\""),
        tether().display().to_string(),
    ];
    let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tether_mesh_up::process::plaintext_control_plane_without_identity(&mut args);
    all.extend(args);
    Process::spawn(
        std::path::Path::new("/bin/sh"),
        name,
        &all,
        &scratch.log(name),
        expect,
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn a_flood_of_idle_connections_under_a_small_fd_limit_does_not_stop_the_proxy() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let control = scratch.control().await;
    let app = scratch.demo_app("web-0", 0).await;
    let sidecar = scratch
        .proxy(
            "web-proxy",
            control.addr("grpc"),
            Some(app.addr("http")),
            &[],
        )
        .await;
    scratch.endpoint("web-0", "web", sidecar.addr("inbound"), true);
    let grpc = control.addr("grpc").to_string();
    let client = proxy_with_fd_limit(
        &scratch,
        "client",
        256,
        &[
            "proxy",
            "--control",
            &grpc,
            "--outbound",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--idle-timeout",
            "5",
        ],
        &["outbound", "admin"],
    )
    .await;
    let (outbound, admin) = (client.addr("outbound"), client.addr("admin"));
    let web = authority("web", 8080);
    assert!(
        eventually(Duration::from_secs(10), || async {
            get(outbound, &web).await.status == 200
        })
        .await
    );

    // More idle connections than the process has fds.
    let mut idle = Vec::new();
    for _ in 0..300 {
        if let Ok(c) = tokio::net::TcpStream::connect(outbound).await {
            idle.push(c);
        }
    }
    // The admin listener keeps its fds: readiness answers while the flood
    // is held (before the idle timeout could have freed any fd).
    let (status, body) = tokio::time::timeout(Duration::from_secs(4), ready_body(admin))
        .await
        .expect("/ready answers while the data path is saturated");
    assert_eq!(status, 200, "{body}");
    // The proxy recovers by itself (idle connections closed after
    // --idle-timeout), with the flood still held open by the client.
    assert!(
        eventually(Duration::from_secs(30), || async {
            matches!(request(outbound, &web, "/", http::Version::HTTP_11).await, Ok(a) if a.status == 200)
        })
        .await,
        "the proxy never recovered"
    );
    let m = metrics(admin).await;
    assert!(
        metric_value(
            &m,
            "tether_proxy_connections_closed_total",
            &[("direction", "outbound"), ("reason", "connection_limit")]
        ) >= 1.0,
        "{m}"
    );
    assert!(
        metric_value(
            &m,
            "tether_proxy_connections_closed_total",
            &[("direction", "outbound"), ("reason", "idle")]
        ) >= 1.0,
        "{m}"
    );
    drop(idle);
    // Refusals were logged at a bounded rate, not once per connection.
    let log = scratch.read_log("client");
    let lines = log
        .lines()
        .filter(|l| l.contains("connection refused"))
        .count();
    assert!(lines <= 5, "{lines} refusal lines:\n{log}");
}

/// A TCP "app" that reads requests and never answers.
async fn silent_app() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn an_app_that_never_answers_gets_a_504_and_a_slow_stream_is_not_cut() {
    let scratch = Scratch::new();
    scratch.service("silent", 8080, false);
    scratch.service("stream", 8080, false);
    let control = scratch.control().await;
    scratch.endpoint("silent-0", "silent", silent_app().await, false);
    // Headers at once, the body after twice the response timeout.
    let streamer = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let streamer_addr = streamer.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = streamer.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                    .await;
                tokio::time::sleep(Duration::from_secs(2)).await;
                let _ = s.write_all(b"5\r\nhello\r\n0\r\n\r\n").await;
            });
        }
    });
    scratch.endpoint("stream-0", "stream", streamer_addr, false);
    let client = scratch
        .proxy(
            "client",
            control.addr("grpc"),
            None,
            &["--response-timeout", "1"],
        )
        .await;
    let outbound = client.addr("outbound");
    let a = get(outbound, &authority("silent", 8080)).await;
    assert_eq!(a.status, 504, "{}", a.body);
    assert_eq!(a.proxy_error(), Some("response timeout after 1s"));
    let a = get(outbound, &authority("stream", 8080)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.body, "hello");
}

#[tokio::test]
async fn a_grpc_call_to_an_app_that_never_answers_gets_deadline_exceeded() {
    let scratch = Scratch::new();
    scratch.service("silent", 8080, false);
    let control = scratch.control().await;
    scratch.endpoint("silent-0", "silent", silent_app().await, false);
    let client = scratch
        .proxy(
            "client",
            control.addr("grpc"),
            None,
            &["--response-timeout", "1"],
        )
        .await;
    let stream = tokio::net::TcpStream::connect(client.addr("outbound"))
        .await
        .unwrap();
    let (mut s, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = http::Request::post(format!(
        "http://{}/demo.Demo/Echo",
        authority("silent", 8080)
    ))
    .header("content-type", "application/grpc")
    .body(http_body_util::Full::new(bytes::Bytes::from_static(
        b"\0\0\0\0\0",
    )))
    .unwrap();
    let rsp = s.send_request(req).await.unwrap();
    assert_eq!(rsp.status(), 200);
    assert_eq!(rsp.headers()["grpc-status"], "4", "{:?}", rsp.headers());
}

/// A client proxy with `args`, its control plane and their directory
/// (each stops when dropped).
async fn client_proxy(args: &[&str]) -> (Process, Process, Scratch) {
    let scratch = Scratch::new();
    let control = scratch.control().await;
    let client = scratch
        .proxy("client", control.addr("grpc"), None, args)
        .await;
    (client, control, scratch)
}

#[tokio::test]
async fn a_slowloris_client_is_closed_after_the_header_read_timeout() {
    let (client, _control, _scratch) = client_proxy(&["--header-read-timeout", "1"]).await;
    let mut conn = tokio::net::TcpStream::connect(client.addr("outbound"))
        .await
        .unwrap();
    conn.write_all(b"GET / HTTP/1.1\r\nhost: web\r\nx-slow: ")
        .await
        .unwrap();
    // One byte every 200 ms for up to 20 header-read timeouts: the proxy
    // must close the connection long before the header ends.
    let closed = async {
        for _ in 0..100 {
            if conn.write_all(b"a").await.is_err() {
                return true;
            }
            let mut buf = [0u8; 1024];
            match tokio::time::timeout(Duration::from_millis(200), conn.read(&mut buf)).await {
                Ok(Ok(_)) | Ok(Err(_)) => return true,
                Err(_) => {}
            }
        }
        false
    };
    assert!(closed.await, "a slow header kept the connection open");
}

/// The header-read timeout bounds an HTTP/1 connection's wait for a head,
/// and so its idle time; an HTTP/2 connection, once told apart, has the
/// idle timeout.
#[tokio::test]
async fn an_idle_http2_connection_is_not_held_to_the_header_read_timeout() {
    let (client, _control, _scratch) =
        client_proxy(&["--header-read-timeout", "1", "--idle-timeout", "60"]).await;
    let stream = tokio::net::TcpStream::connect(client.addr("outbound"))
        .await
        .unwrap();
    let (_send, conn) =
        hyper::client::conn::http2::handshake::<_, _, http_body_util::Empty<bytes::Bytes>>(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .unwrap();
    let http2 = tokio::spawn(conn);
    // A head that stops after the bytes that tell HTTP/1 apart.
    let mut http1 = tokio::net::TcpStream::connect(client.addr("outbound"))
        .await
        .unwrap();
    http1
        .write_all(b"GET / HTTP/1.1\r\nhost: web\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(Duration::from_secs(20), http1.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0) | Err(_))),
        "the HTTP/1 connection was not closed: {closed:?}"
    );
    // Closing the HTTP/1 one took at least one header-read timeout; one
    // more, and the HTTP/2 one, as idle, is still open.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!http2.is_finished(), "an idle HTTP/2 connection was closed");
}

#[tokio::test]
async fn a_service_sets_its_own_response_timeout() {
    let scratch = Scratch::new();
    scratch.write(
        "silent.yaml",
        &format!(
            "kind: Service\nname: silent\nnamespace: test\nports: [{{port: 8080}}]\nresponse_timeout: 500ms\nendpoints: [{{address: \"{}\", meshed: false}}]\n",
            silent_app().await
        ),
    );
    let control = scratch.control().await;
    let client = scratch
        .proxy(
            "client",
            control.addr("grpc"),
            None,
            &["--response-timeout", "60"],
        )
        .await;
    let a = get(client.addr("outbound"), &authority("silent", 8080)).await;
    assert_eq!(a.status, 504, "{}", a.body);
    assert_eq!(a.proxy_error(), Some("response timeout after 500ms"));
}

#[tokio::test]
async fn http2_streams_to_a_slow_app_cannot_take_the_fds_of_readiness() {
    // One client connection, many concurrent streams, each asking to reach
    // the app as HTTP/1 (one app connection per request in flight).
    let scratch = Scratch::new();
    let control = scratch.control().await;
    let app = scratch.demo_app("slow-0", 5_000).await;
    let grpc = control.addr("grpc").to_string();
    let app_addr = app.addr("http").to_string();
    let server = proxy_with_fd_limit(
        &scratch,
        "server",
        256,
        &[
            "proxy",
            "--control",
            &grpc,
            "--outbound",
            "127.0.0.1:0",
            "--inbound",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--app",
            &app_addr,
        ],
        &["outbound", "inbound", "admin"],
    )
    .await;
    let mut held = Vec::new();
    for _ in 0..2 {
        let stream = tokio::net::TcpStream::connect(server.addr("inbound"))
            .await
            .unwrap();
        let (s, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .unwrap();
        tokio::spawn(conn);
        for _ in 0..190 {
            let mut s = s.clone();
            held.push(tokio::spawn(async move {
                let req = http::Request::get("http://web/")
                    .header("tether-orig-proto", "HTTP/1.1")
                    .body(http_body_util::Empty::<bytes::Bytes>::new())
                    .unwrap();
                let _ = s.send_request(req).await;
            }));
        }
    }
    // While those wait on the slow app, readiness still answers.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, body) =
        tokio::time::timeout(Duration::from_secs(4), ready_body(server.addr("admin")))
            .await
            .expect("/ready answers while streams hold the app connections");
    assert_eq!(status, 200, "{body}");
    for h in held {
        h.abort();
    }
}

#[tokio::test]
async fn the_response_timeout_starts_when_the_request_has_been_sent() {
    // An app that answers once it has read the whole body; the client
    // takes three response timeouts to upload it.
    let scratch = Scratch::new();
    scratch.service("upload", 8080, false);
    let app = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_addr = app.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = app.accept().await {
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = [0u8; 1024];
                // Headers, then 10 bytes of body.
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    if let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                        if seen.len() >= end + 4 + 10 {
                            break;
                        }
                    }
                }
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
            });
        }
    });
    scratch.endpoint("upload-0", "upload", app_addr, false);
    let control = scratch.control().await;
    let client = scratch
        .proxy(
            "client",
            control.addr("grpc"),
            None,
            &["--response-timeout", "1"],
        )
        .await;
    let mut conn = tokio::net::TcpStream::connect(client.addr("outbound"))
        .await
        .unwrap();
    conn.write_all(
        format!(
            "POST / HTTP/1.1\r\nhost: {}\r\ncontent-length: 10\r\n\r\n",
            authority("upload", 8080)
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        conn.write_all(b"x").await.unwrap();
    }
    let mut answer = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut answer))
        .await
        .expect("an answer")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// The response timeout runs from when a request could be sent: a
/// request to a service whose policy the control plane is slow to give
/// waits for it under the fail-fast timeout, not the response timeout
/// (which once started at the request's arrival and fired the moment the
/// policy came).
#[tokio::test]
async fn the_wait_for_a_new_services_policy_is_not_counted_in_the_response_timeout() {
    const RESPONSE_TIMEOUT_S: u64 = 3;
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let control = scratch.control().await;
    let app = scratch.demo_app("web-0", 0).await;
    scratch.endpoint("web-0", "web", app.addr("http"), false);
    // The proxy's way to the control plane: connections wait in the
    // listener's backlog, unanswered, until the request below has waited
    // twice the response timeout; then each is relayed.
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_addr = relay.local_addr().unwrap();
    let (opened_tx, opened_rx) = tokio::sync::oneshot::channel::<()>();
    let upstream = control.addr("grpc");
    tokio::spawn(async move {
        let _ = opened_rx.await;
        while let Ok((mut proxy_side, _)) = relay.accept().await {
            tokio::spawn(async move {
                if let Ok(mut control_side) = tokio::net::TcpStream::connect(upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut proxy_side, &mut control_side).await;
                }
            });
        }
    });
    let timeout = RESPONSE_TIMEOUT_S.to_string();
    let client = scratch
        .proxy(
            "client",
            relay_addr,
            None,
            &["--response-timeout", &timeout, "--failfast-timeout", "120"],
        )
        .await;
    let outbound = client.addr("outbound");
    let asked = tokio::spawn(async move { get(outbound, &authority("web", 8080)).await });
    tokio::time::sleep(Duration::from_secs(2 * RESPONSE_TIMEOUT_S)).await;
    opened_tx.send(()).unwrap();
    let a = asked.await.unwrap();
    assert_eq!(a.status, 200, "{:?}: {}", a.proxy_error(), a.body);
}
