//! Inbound authorization: each default policy admits what its name says,
//! to mTLS and plaintext clients; audit lets denials through and counts
//! them; a denied TCP connection is closed.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::*;

const SERVER: &str = "web.test.serviceaccount.identity.cluster.local";
const CLIENT: &str = "client.test.serviceaccount.identity.cluster.local";

/// A sidecar certified as [`SERVER`] in front of `app`, ready.
async fn server(
    scratch: &Scratch,
    name: &str,
    control: SocketAddr,
    ca: &Path,
    app: SocketAddr,
    extra: &[&str],
) -> Process {
    let mut args = scratch.identity_args(ca, SERVER, ca);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = scratch.proxy(name, control, Some(app), &args).await;
    wait_ready(proxy.addr("admin")).await;
    proxy
}

#[tokio::test]
async fn each_default_policy_admits_mtls_and_plaintext_clients_as_named() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    let control = scratch.control_with_identity("control", &ca, "3600").await;
    let app = scratch.demo_app("web-0", 0).await;
    let tls = certified_client_tls(control.addr("grpc"), &ca, CLIENT).await;
    let web = authority("web", 8080);
    let cluster = ["--default-inbound-policy", "cluster-authenticated"];
    // (name, flags, mTLS client admitted, plaintext loopback client admitted)
    let cases: [(&str, Vec<&str>, bool, bool); 5] = [
        ("all-unauthenticated", vec![], true, true),
        (
            "all-authenticated",
            vec!["--default-inbound-policy", "all-authenticated"],
            true,
            false,
        ),
        ("cluster-authenticated", cluster.to_vec(), true, false),
        (
            "cluster-authenticated-loopback",
            [&cluster[..], &["--cluster-networks", "127.0.0.0/8"]].concat(),
            true,
            true,
        ),
        (
            "deny",
            vec!["--default-inbound-policy", "deny"],
            false,
            false,
        ),
    ];
    for (name, flags, mtls_ok, plain_ok) in cases {
        let proxy = server(
            &scratch,
            name,
            control.addr("grpc"),
            &ca,
            app.addr("http"),
            &flags,
        )
        .await;
        let inbound = proxy.addr("inbound");
        let policy = name.trim_end_matches("-loopback");
        let plain = get(inbound, &web).await;
        let mtls = tls_get(inbound, tls.clone(), SERVER, &web).await.unwrap();
        for (who, answer, admitted) in [
            ("unauthenticated client", &plain, plain_ok),
            (CLIENT, &mtls, mtls_ok),
        ] {
            if admitted {
                assert_eq!(
                    answer.status,
                    200,
                    "{name}: {who}: {:?}",
                    answer.proxy_error()
                );
                continue;
            }
            assert_eq!(answer.status, 403, "{name}: {who}");
            assert_eq!(
                answer.proxy_error(),
                Some(format!("unauthorized: {who} may not call default:{policy}/default").as_str()),
                "{name}"
            );
        }
        let m = metrics(proxy.addr("admin")).await;
        let denied = metric_value(&m, "tether_proxy_inbound_denied_total", &[]);
        let expected = [plain_ok, mtls_ok].iter().filter(|ok| !**ok).count() as f64;
        assert_eq!(denied, expected, "{name}: {m}");
        if !mtls_ok {
            let labels = [
                ("server", "default:deny"),
                ("route", "default"),
                ("authz", "default:deny"),
                ("client_id", CLIENT),
            ];
            assert_eq!(
                metric_value(&m, "tether_proxy_inbound_denied_total", &labels),
                1.0,
                "{m}"
            );
        }
    }
}

#[tokio::test]
async fn audit_lets_would_be_denials_through_and_counts_them() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    let control = scratch.control_with_identity("control", &ca, "3600").await;
    let app = scratch.demo_app("web-0", 0).await;
    let proxy = server(
        &scratch,
        "audited",
        control.addr("grpc"),
        &ca,
        app.addr("http"),
        &["--default-inbound-policy", "deny", "--inbound-policy-audit"],
    )
    .await;
    let web = authority("web", 8080);
    for _ in 0..3 {
        assert_eq!(get(proxy.addr("inbound"), &web).await.status, 200);
    }
    let m = metrics(proxy.addr("admin")).await;
    assert_eq!(
        metric_value(
            &m,
            "tether_proxy_inbound_audit_denied_total",
            &[
                ("server", "default:deny"),
                ("client_id", "unauthenticated client")
            ]
        ),
        3.0,
        "{m}"
    );
    assert_eq!(
        metric_value(&m, "tether_proxy_inbound_denied_total", &[]),
        0.0
    );
    assert!(
        scratch
            .read_log("audited")
            .contains("audit: the inbound policy would deny this"),
        "{}",
        scratch.read_log("audited")
    );
}

/// Sends a line to `addr` over TCP; what comes back before the connection
/// closes (bounded by a timeout).
async fn echo(addr: SocketAddr) -> Vec<u8> {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(b"hello\n").await;
    let mut got = vec![0u8; 6];
    match tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got)).await {
        Ok(Ok(_)) => got,
        _ => Vec::new(),
    }
}

#[tokio::test]
async fn a_denied_tcp_connection_is_closed() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    let control = scratch.control_with_identity("control", &ca, "3600").await;
    let app = echo_server().await;
    let open = server(
        &scratch,
        "open",
        control.addr("grpc"),
        &ca,
        app,
        &["--inbound-opaque"],
    )
    .await;
    assert_eq!(echo(open.addr("inbound")).await, b"hello\n");
    let closed = server(
        &scratch,
        "closed",
        control.addr("grpc"),
        &ca,
        app,
        &[
            "--inbound-opaque",
            "--default-inbound-policy",
            "all-authenticated",
        ],
    )
    .await;
    assert_eq!(echo(closed.addr("inbound")).await, b"");
    let m = metrics(closed.addr("admin")).await;
    assert_eq!(
        metric_value(
            &m,
            "tether_proxy_inbound_denied_total",
            &[("server", "default:all-authenticated")]
        ),
        1.0,
        "{m}"
    );
}

/// With `--workload` the proxy follows the control plane's answer for its
/// port; a default answer (no `Server` selects the port) combines with the
/// proxy's own default, so a permissive control plane opens nothing the
/// flag closes.
#[tokio::test]
async fn a_workload_follows_the_control_planes_default_and_its_flag_still_applies() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    let control = scratch.control_with_identity("control", &ca, "3600").await;
    let app = scratch.demo_app("web-0", 0).await;
    let web = authority("web", 8080);
    let workload = ["--workload", "test/web-0"];
    let open = server(
        &scratch,
        "open",
        control.addr("grpc"),
        &ca,
        app.addr("http"),
        &workload,
    )
    .await;
    let closed = server(
        &scratch,
        "closed",
        control.addr("grpc"),
        &ca,
        app.addr("http"),
        &[&workload[..], &["--default-inbound-policy", "deny"]].concat(),
    )
    .await;
    for (proxy, status) in [(&open, 200), (&closed, 403)] {
        // Ready means the control plane has answered for the port.
        let m = metrics(proxy.addr("admin")).await;
        assert_eq!(
            metric_value(&m, "tether_proxy_inbound_policy_updates_total", &[]),
            1.0,
            "{m}"
        );
        assert_eq!(get(proxy.addr("inbound"), &web).await.status, status);
    }
}

/// Makes `addr` (a sidecar's inbound, certified as `identity`) the
/// endpoint `name` of service `web`, so client proxies reach it over mTLS.
fn meshed_endpoint(scratch: &Scratch, name: &str, addr: SocketAddr, identity: &str) {
    scratch.write(
        &format!("{name}.yaml"),
        &format!(
            "kind: Endpoints\nservice: web\nnamespace: test\nendpoints: [{{address: \"{addr}\", identity: {identity}, name: {name}}}]\n"
        ),
    );
}

/// A gRPC client through its own sidecar (mTLS between the proxies) gets
/// PERMISSION_DENIED naming itself and the server, not an HTTP 403.
#[tokio::test]
async fn a_denied_grpc_call_gets_permission_denied_through_the_mesh() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    scratch.service("web", 8080, false);
    let control = scratch.control_with_identity("control", &ca, "3600").await;
    let app = scratch.demo_app("web-0", 0).await;
    let web_proxy = server(
        &scratch,
        "web-0-proxy",
        control.addr("grpc"),
        &ca,
        app.addr("http"),
        &["--default-inbound-policy", "all-authenticated"],
    )
    .await;
    meshed_endpoint(&scratch, "web-0", web_proxy.addr("inbound"), SERVER);
    let client_args = scratch.identity_args(&ca, CLIENT, &ca);
    let client_args: Vec<&str> = client_args.iter().map(String::as_str).collect();
    let client = scratch
        .proxy("client", control.addr("grpc"), None, &client_args)
        .await;
    wait_ready(client.addr("admin")).await;
    let web = authority("web", 8080);
    // Allowed through the mesh (mTLS), denied when sent in plaintext
    // straight to the inbound: the same gRPC call, two clients.
    let meshed = tether_mesh_up::demo_grpc::channel(client.addr("outbound"), &web)
        .await
        .unwrap();
    let reply = tether_mesh_up::demo_grpc::hello(meshed, "mesh")
        .await
        .unwrap();
    assert_eq!(reply.message, "hello, mesh");
    let direct = tether_mesh_up::demo_grpc::channel(web_proxy.addr("inbound"), &web)
        .await
        .unwrap();
    let denied = tether_mesh_up::demo_grpc::hello(direct, "plain")
        .await
        .unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
    assert_eq!(
        denied.message(),
        "unauthorized: unauthenticated client may not call default:all-authenticated/default"
    );
    let m = metrics(web_proxy.addr("admin")).await;
    assert_eq!(
        metric_value(&m, "tether_proxy_inbound_denied_total", &[]),
        1.0,
        "{m}"
    );
}
