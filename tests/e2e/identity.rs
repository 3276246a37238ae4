//! Identity and mutual TLS between proxies.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use linkerd2_proxy_api::identity::{identity_client::IdentityClient, CertifyRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::*;

fn id(name: &str) -> String {
    format!("{name}.test.serviceaccount.identity.cluster.local")
}

/// A TCP relay that records every byte the client sends.
struct Tap {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<u8>>>,
    /// Connections accepted so far.
    connections: Arc<AtomicUsize>,
}

async fn tap(to: SocketAddr) -> Tap {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let connections = Arc::new(AtomicUsize::new(0));
    let (record, accepted) = (seen.clone(), connections.clone());
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            accepted.fetch_add(1, Ordering::SeqCst);
            let record = record.clone();
            tokio::spawn(async move {
                let Ok(mut server) = tokio::net::TcpStream::connect(to).await else {
                    return;
                };
                let (mut cr, mut cw) = client.split();
                let (mut sr, mut sw) = server.split();
                let up = async {
                    let mut buf = [0u8; 8192];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        record.lock().unwrap().extend_from_slice(&buf[..n]);
                        if sw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    let _ = sw.shutdown().await;
                };
                let down = async {
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                    let _ = cw.shutdown().await;
                };
                tokio::join!(up, down);
            });
        }
    });
    Tap {
        addr,
        seen,
        connections,
    }
}

/// A request with extra headers over HTTP/1.1.
async fn get_with(
    connect: SocketAddr,
    authority: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Answer {
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(connect).await.unwrap();
    let (mut s, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::get(path).header(http::header::HOST, authority);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let rsp = s
        .send_request(
            req.body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap(),
        )
        .await
        .unwrap();
    let (status, version, headers) = (rsp.status(), rsp.version(), rsp.headers().clone());
    let body = rsp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
        version,
    }
}

struct TlsMesh {
    scratch: Scratch,
    ca: std::path::PathBuf,
    control: Process,
    server: Process,
    client: Process,
    _app: Process,
}

/// control (issuing from `ca`), a `web` app behind a sidecar certified as
/// `server_identity`, and a client sidecar certified as `client`.
async fn tls_mesh(server_identity: &str, server_extra: &[&str], leaf_secs: &str) -> TlsMesh {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let ca = scratch.identity_init("ca");
    let control = scratch
        .control_with_identity("control", &ca, leaf_secs)
        .await;
    let app = scratch.demo_app("web-0", 0).await;
    let mut args: Vec<String> = scratch.identity_args(&ca, server_identity, &ca);
    args.extend(server_extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = scratch
        .proxy(
            "server",
            control.addr("grpc"),
            Some(app.addr("http")),
            &args,
        )
        .await;
    let client_args = scratch.identity_args(&ca, &id("client"), &ca);
    let client_args: Vec<&str> = client_args.iter().map(String::as_str).collect();
    let client = scratch
        .proxy("client", control.addr("grpc"), None, &client_args)
        .await;
    wait_ready(server.addr("admin")).await;
    wait_ready(client.addr("admin")).await;
    TlsMesh {
        scratch,
        ca,
        control,
        server,
        client,
        _app: app,
    }
}

fn endpoint_with_identity(scratch: &Scratch, addr: SocketAddr, identity: &str) {
    scratch.write(
        "web-0.yaml",
        &format!(
            "kind: Endpoints\nservice: web\nnamespace: test\nendpoints: [{{address: \"{addr}\", identity: {identity}}}]\n"
        ),
    );
}

#[tokio::test]
async fn proxies_talk_mtls_on_the_wire_and_pass_the_verified_client_identity() {
    let mesh = tls_mesh(&id("web"), &[], "3600").await;
    let Tap { addr, seen, .. } = tap(mesh.server.addr("inbound")).await;
    endpoint_with_identity(&mesh.scratch, addr, &id("web"));
    let web = authority("web", 8080);
    let outbound = mesh.client.addr("outbound");
    assert!(
        eventually(Duration::from_secs(5), || async {
            get(outbound, &web).await.status == 200
        })
        .await
    );

    let a = get_with(
        outbound,
        &web,
        "/secret-path-4711",
        &[("tether-client-id", "evil.forged.identity")],
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    let body: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!(
        body["client_id"],
        id("client"),
        "the app must see the verified identity only"
    );

    let wire = seen.lock().unwrap().clone();
    assert_eq!(
        wire.first(),
        Some(&0x16),
        "the connection does not start with a TLS handshake"
    );
    assert!(
        !wire.windows(16).any(|w| w == b"secret-path-4711"),
        "request path visible on the wire"
    );
    assert!(
        !wire.windows(5).any(|w| w == b"HTTP/"),
        "HTTP visible on the wire"
    );

    let m = metrics(mesh.server.addr("admin")).await;
    let client_id = id("client");
    assert!(
        metric_value(
            &m,
            "tether_proxy_requests_total",
            &[
                ("direction", "inbound"),
                ("tls", "true"),
                ("client_id", client_id.as_str())
            ]
        ) >= 1.0,
        "{m}"
    );

    // Plaintext to the inbound (opportunistic): accepted, and a forged
    // identity header is removed.
    let a = get_with(
        mesh.server.addr("inbound"),
        &web,
        "/",
        &[("tether-client-id", "evil.forged.identity")],
    )
    .await;
    assert_eq!(a.status, 200);
    let body: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    assert!(body["client_id"].is_null(), "{body}");
}

#[tokio::test]
async fn a_server_with_another_identity_is_refused() {
    let mesh = tls_mesh(&id("impostor"), &[], "3600").await;
    endpoint_with_identity(&mesh.scratch, mesh.server.addr("inbound"), &id("web"));
    let web = authority("web", 8080);
    let outbound = mesh.client.addr("outbound");
    let mut err = String::new();
    for _ in 0..50 {
        let a = get(outbound, &web).await;
        err = a.proxy_error().unwrap_or("").to_string();
        if a.status == 502 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        err.contains(&id("impostor")) && err.contains(&id("web")),
        "{err}"
    );
}

#[tokio::test]
async fn a_server_chaining_to_another_root_is_refused() {
    let mesh = tls_mesh(&id("web"), &[], "3600").await;
    // A second mesh, with its own root, certifies a second `web` server.
    let other = Scratch::new();
    let other_ca = other.identity_init("other-ca");
    let other_control = other
        .control_with_identity("other-control", &other_ca, "3600")
        .await;
    let app = other.demo_app("web-x", 0).await;
    let args = other.identity_args(&other_ca, &id("web"), &other_ca);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let foreign = other
        .proxy(
            "foreign",
            other_control.addr("grpc"),
            Some(app.addr("http")),
            &args,
        )
        .await;
    wait_ready(foreign.addr("admin")).await;

    endpoint_with_identity(&mesh.scratch, foreign.addr("inbound"), &id("web"));
    let outbound = mesh.client.addr("outbound");
    let web = authority("web", 8080);
    let mut last = String::new();
    for _ in 0..50 {
        let a = get(outbound, &web).await;
        last = a.proxy_error().unwrap_or("").to_string();
        if a.status == 502 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(last.contains("does not chain to the trust root"), "{last}");
    let _ = &mesh.ca;
}

#[tokio::test]
async fn mandatory_tls_refuses_plaintext() {
    let mesh = tls_mesh(&id("web"), &["--tls", "mandatory"], "3600").await;
    endpoint_with_identity(&mesh.scratch, mesh.server.addr("inbound"), &id("web"));
    let inbound = mesh.server.addr("inbound");
    // Plaintext straight to the inbound: the connection is closed unanswered.
    let stream = tokio::net::TcpStream::connect(inbound).await.unwrap();
    let mut stream = stream;
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut buf))
        .await
        .unwrap();
    assert!(
        n.is_err() || buf.is_empty(),
        "plaintext got an answer: {}",
        String::from_utf8_lossy(&buf)
    );
    let m = metrics(mesh.server.addr("admin")).await;
    assert!(
        metric_value(
            &m,
            "tether_proxy_inbound_refused_total",
            &[("reason", "plaintext")]
        ) >= 1.0,
        "{m}"
    );
    // Through the client proxy, over mTLS: served.
    let web = authority("web", 8080);
    let outbound = mesh.client.addr("outbound");
    assert!(
        eventually(Duration::from_secs(5), || async {
            get(outbound, &web).await.status == 200
        })
        .await
    );
}

#[tokio::test]
async fn mandatory_tls_without_identity_is_refused_at_start() {
    let out = std::process::Command::new(tether())
        .args([
            "proxy",
            "--control",
            "127.0.0.1:1",
            "--tls",
            "mandatory",
            "--outbound",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--tls mandatory needs an identity"), "{err}");
}

#[tokio::test]
async fn certificates_rotate_with_no_failed_request() {
    const LIFETIME: Duration = Duration::from_secs(2);
    let mesh = tls_mesh(&id("web"), &["--tls", "mandatory"], "2").await;
    // Every certificate either proxy holds now was issued before this
    // instant, so all have expired a lifetime later (plus a second: X.509
    // times are whole seconds); a handshake after that needs renewals.
    let first_issued = std::time::Instant::now();
    let expired = LIFETIME + Duration::from_secs(1);
    let web = authority("web", 8080);
    let outbound = mesh.client.addr("outbound");
    // The client keeps one connection per endpoint, so only a new endpoint
    // makes it handshake again: the server moves to a fresh relay address,
    // again and again. Each handshake presents both proxies' current
    // certificates, and each side refuses an expired one.
    //
    // Rotations are counted, not timed: the server moves until both proxies
    // have renewed three times and two handshakes came after the first
    // certificates expired. On a loaded machine each move and renewal
    // takes longer, and a fixed 7 s window saw too few of them; only a
    // rotation that stopped reaches the bound.
    let renewals = |admin| async move {
        metric_value(
            &metrics(admin).await,
            "tether_identity_renewals_total",
            &[("outcome", "ok")],
        )
    };
    let (server_admin, client_admin) = (mesh.server.addr("admin"), mesh.client.addr("admin"));
    let mut relays = Vec::new();
    let mut sent = 0;
    let mut handshakes_after_expiry = 0;
    loop {
        let renewed = [renewals(server_admin).await, renewals(client_admin).await];
        if handshakes_after_expiry >= 2 && renewed.iter().all(|r| *r >= 3.0) {
            break;
        }
        assert!(
            first_issued.elapsed() < 15 * LIFETIME,
            "{handshakes_after_expiry} handshakes after the first certificates expired, \
             renewals (server, client) {renewed:?}, in {:?} with a {LIFETIME:?} lifetime",
            first_issued.elapsed()
        );
        let relay = tap(mesh.server.addr("inbound")).await;
        endpoint_with_identity(&mesh.scratch, relay.addr, &id("web"));
        let moved = std::time::Instant::now();
        while relay.connections.load(Ordering::SeqCst) == 0 {
            assert!(
                moved.elapsed() < Duration::from_secs(10),
                "the client never connected to the new endpoint"
            );
            let a = get(outbound, &web).await;
            assert_eq!(
                a.status,
                200,
                "request {sent} failed during rotation: {:?} {}",
                a.proxy_error(),
                a.body
            );
            sent += 1;
        }
        // One more request, over the connection just made to this relay.
        let a = get(outbound, &web).await;
        assert_eq!(a.status, 200, "{:?} {}", a.proxy_error(), a.body);
        if moved - first_issued > expired {
            handshakes_after_expiry += 1;
        }
        relays.push(relay);
    }
    // A new client, whose first handshake meets the server's rotated certificate.
    let args = mesh.scratch.identity_args(&mesh.ca, &id("late"), &mesh.ca);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let late = mesh
        .scratch
        .proxy("late", mesh.control.addr("grpc"), None, &args)
        .await;
    wait_ready(late.addr("admin")).await;
    assert_eq!(get(late.addr("outbound"), &web).await.status, 200);
}

async fn certify(
    control: SocketAddr,
    ca: &Path,
    identity: &str,
    token: &[u8],
    csr: Vec<u8>,
) -> Result<(), tonic::Status> {
    let mut client = IdentityClient::new(certify_channel(control, ca));
    client
        .certify(CertifyRequest {
            identity: identity.into(),
            token: token.to_vec(),
            certificate_signing_request: csr,
        })
        .await
        .map(|r| {
            let r = r.into_inner();
            assert_eq!(
                tether_identity::cert::dns_names(&r.leaf_certificate),
                vec![identity.to_string()]
            );
            assert_eq!(r.intermediate_certificates.len(), 1);
            assert!(r.valid_until.is_some());
        })
}

fn token_for(ca: &Path, identity: &str) -> Vec<u8> {
    tether_identity::token::LocalTokens::load(ca)
        .unwrap()
        .issue(identity)
        .into_bytes()
}

#[tokio::test]
async fn certify_refuses_bad_tokens_names_and_csrs() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    let control = scratch.control_with_identity("control", &ca, "60").await;
    let grpc = control.addr("grpc");
    let web = id("web");
    let csr = tether_identity::csr::generate(&web).unwrap().csr_der;

    certify(grpc, &ca, &web, &token_for(&ca, &web), csr.clone())
        .await
        .expect("a good request is certified");

    let e = certify(grpc, &ca, &web, b"tether-v1:nope:00", csr.clone())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("token"), "{}", e.message());

    let e = certify(grpc, &ca, &web, &token_for(&ca, &id("db")), csr.clone())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");

    let other_csr = tether_identity::csr::generate(&id("db")).unwrap().csr_der;
    let e = certify(grpc, &ca, &web, &token_for(&ca, &web), other_csr)
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("CSR asks for"), "{}", e.message());

    let e = certify(grpc, &ca, &web, &token_for(&ca, &web), b"garbage".to_vec())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("malformed CSR"), "{}", e.message());

    let m = metrics(control.addr("admin")).await;
    for cause in ["token", "identity", "csr_name", "malformed_csr"] {
        assert_eq!(
            metric_value(
                &m,
                "tether_identity_certify_refusals_total",
                &[("cause", cause)]
            ),
            1.0,
            "{cause}: {m}"
        );
    }
    assert_eq!(
        metric_value(&m, "tether_identity_certificates_issued_total", &[]),
        1.0
    );
}

#[tokio::test]
async fn readiness_waits_for_the_certificate() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    // A control plane that issues no certificates.
    let control = scratch.control().await;
    let args = scratch.identity_args(&ca, &id("web"), &ca);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = scratch
        .proxy("proxy", control.addr("grpc"), None, &args)
        .await;
    let (status, body) = tether_mesh_up::stats::http_get(proxy.addr("admin"), "/ready")
        .await
        .unwrap();
    assert_eq!(status, 503);
    assert!(body.contains("certificate"), "{body}");
    let (status, _) = tether_mesh_up::stats::http_get(proxy.addr("admin"), "/live")
        .await
        .unwrap();
    assert_eq!(status, 200);
}

/// Projected ServiceAccount tokens rotate, so the proxy must read its token
/// file at every certificate request, not once at start.
#[tokio::test]
async fn the_token_file_is_read_at_every_renewal() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    let control = scratch.control_with_identity("control", &ca, "2").await;
    let args = scratch.identity_args(&ca, &id("web"), &ca);
    let token_file = std::path::PathBuf::from(&args[3]);
    let valid = std::fs::read_to_string(&token_file).unwrap();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = scratch
        .proxy("proxy", control.addr("grpc"), None, &args)
        .await;
    let admin = proxy.addr("admin");
    wait_ready(admin).await;
    let renewals = |outcome: &'static str| async move {
        metric_value(
            &metrics(admin).await,
            "tether_identity_renewals_total",
            &[("outcome", outcome)],
        )
    };
    std::fs::write(&token_file, "tether-v1:someone:else").unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            renewals("error").await >= 1.0
        })
        .await,
        "a changed token file was not read"
    );
    std::fs::write(&token_file, valid).unwrap();
    let ok_before = renewals("ok").await;
    assert!(
        eventually(Duration::from_secs(15), || async {
            renewals("ok").await > ok_before
        })
        .await,
        "renewals did not recover with a valid token"
    );
}

#[tokio::test]
async fn certify_with_an_expired_issuer_is_a_failed_precondition() {
    let scratch = Scratch::new();
    let ca = scratch.dir.path().join("expired-ca");
    let mut opts = tether_identity::ca::InitOptions::new(&ca, "cluster.local");
    opts.issuer_lifetime = Duration::ZERO;
    tether_identity::ca::init(&opts).unwrap();
    // Over TLS the control plane cannot start: it has no valid certificate
    // of its own to present.
    let ca_s = ca.display().to_string();
    let (ok, out) = run_tether(&[
        "control",
        "--registry",
        scratch.registry().to_str().unwrap(),
        "--grpc",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--identity",
        &ca_s,
    ]);
    assert!(!ok, "{out}");
    assert!(out.contains("issuer certificate expired"), "{out}");
    // In plaintext it starts, and Certify says why it cannot sign.
    let control = scratch
        .control_at(
            "control",
            "127.0.0.1:0",
            &["--identity", &ca_s, "--insecure-control-plane"],
        )
        .await;
    let web = id("web");
    let csr = tether_identity::csr::generate(&web).unwrap().csr_der;
    let channel = tether_identity::control::channel(control.addr("grpc"), None);
    let e = IdentityClient::new(channel)
        .certify(CertifyRequest {
            identity: web.clone(),
            token: token_for(&ca, &web),
            certificate_signing_request: csr,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("issuer certificate expired"),
        "{}",
        e.message()
    );
    let m = metrics(control.addr("admin")).await;
    assert_eq!(
        metric_value(
            &m,
            "tether_identity_certify_refusals_total",
            &[("cause", "issuer_expired")]
        ),
        1.0,
        "{m}"
    );
}

/// A client sidecar under `--tls mandatory`, asking `control` for its
/// certificate.
async fn strict_client(
    scratch: &Scratch,
    ca: &Path,
    control: SocketAddr,
    extra: &[&str],
) -> Process {
    let mut args = scratch.identity_args(ca, &id("strict"), ca);
    args.extend(["--tls".to_string(), "mandatory".to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    scratch.proxy("strict", control, None, &args).await
}

#[tokio::test]
async fn mandatory_tls_refuses_an_endpoint_without_identity() {
    let mesh = tls_mesh(&id("web"), &[], "3600").await;
    let strict = strict_client(&mesh.scratch, &mesh.ca, mesh.control.addr("grpc"), &[]).await;
    wait_ready(strict.addr("admin")).await;
    // The endpoint is meshed but discovery gives it no identity.
    mesh.scratch
        .endpoint("web-0", "web", mesh.server.addr("inbound"), true);
    let web = authority("web", 8080);
    let a = get(strict.addr("outbound"), &web).await;
    assert_eq!(a.status, 502, "{:?} {}", a.proxy_error(), a.body);
    let error = a.proxy_error().unwrap_or("");
    assert!(
        error.contains("endpoint has no TLS identity; mandatory TLS refuses plaintext"),
        "{error}"
    );
    // The opportunistic client reaches the same endpoint in plaintext.
    assert_eq!(get(mesh.client.addr("outbound"), &web).await.status, 200);
}

#[tokio::test]
async fn mandatory_tls_refuses_to_send_before_the_first_certificate() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let ca = scratch.identity_init("ca");
    // A control plane that serves discovery but issues no certificates.
    let control = scratch.control().await;
    let app = scratch.demo_app("web-0", 0).await;
    let server = scratch
        .proxy("server", control.addr("grpc"), Some(app.addr("http")), &[])
        .await;
    endpoint_with_identity(&scratch, server.addr("inbound"), &id("web"));
    // Plaintext to it: TLS would need the control plane's own certificate.
    let strict = strict_client(
        &scratch,
        &ca,
        control.addr("grpc"),
        &["--insecure-control-plane"],
    )
    .await;
    let web = authority("web", 8080);
    let a = get(strict.addr("outbound"), &web).await;
    assert_eq!(a.status, 502, "{:?} {}", a.proxy_error(), a.body);
    let error = a.proxy_error().unwrap_or("");
    assert!(
        error.contains("this proxy holds no certificate yet; mandatory TLS refuses plaintext"),
        "{error}"
    );
    let (status, body) = ready_body(strict.addr("admin")).await;
    assert_eq!(status, 503);
    assert!(body.contains("certificate"), "{body}");
}
