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
    let cluster_any = ["--default-inbound-policy", "cluster-unauthenticated"];
    let loopback = ["--cluster-networks", "127.0.0.0/8"];
    // (name, flags, mTLS client admitted, plaintext loopback client admitted);
    // every client here is on loopback, outside the default cluster networks.
    let cases: [(&str, Vec<&str>, bool, bool); 7] = [
        ("all-unauthenticated", vec![], true, true),
        (
            "all-authenticated",
            vec!["--default-inbound-policy", "all-authenticated"],
            true,
            false,
        ),
        (
            "cluster-unauthenticated",
            cluster_any.to_vec(),
            false,
            false,
        ),
        (
            "cluster-unauthenticated-loopback",
            [&cluster_any[..], &loopback[..]].concat(),
            true,
            true,
        ),
        ("cluster-authenticated", cluster.to_vec(), false, false),
        (
            "cluster-authenticated-loopback",
            [&cluster[..], &loopback[..]].concat(),
            true,
            false,
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
            let default = format!("default:{policy}");
            let labels = [
                ("server", default.as_str()),
                ("route", "default"),
                ("authz", default.as_str()),
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
    // Audit left on lets everything through: it shows before any
    // would-be denial does.
    assert_eq!(
        metric_value(&m, "tether_proxy_inbound_policy_audit", &[]),
        1.0,
        "{m}"
    );
    assert!(
        scratch
            .read_log("audited")
            .contains("inbound policy audit is on"),
        "{}",
        scratch.read_log("audited")
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
/// endpoint of workload `name` (labels `app: <name>`) of service `web`, so
/// client proxies reach it over mTLS.
fn meshed_endpoint(scratch: &Scratch, name: &str, addr: SocketAddr, identity: &str) {
    scratch.write(
        &format!("{name}.yaml"),
        &format!(
            "kind: Endpoints\nservice: web\nnamespace: test\n\
             endpoints: [{{address: \"{addr}\", identity: {identity}, name: {name}, labels: {{app: {name}}}}}]\n"
        ),
    );
}

/// A sidecar without an app, certified as [`CLIENT`], ready.
async fn client_sidecar(scratch: &Scratch, control: &Process, ca: &Path) -> Process {
    let args = scratch.identity_args(ca, CLIENT, ca);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let client = scratch
        .proxy("client", control.addr("grpc"), None, &args)
        .await;
    wait_ready(client.addr("admin")).await;
    client
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
    let client = client_sidecar(&scratch, &control, &ca).await;
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

// === The control plane's policy resources, enforced ===

const OTHER: &str = "batch.jobs.serviceaccount.identity.cluster.local";

/// Registry documents: `Service` `web` in `namespace` with an endpoint
/// for each workload (`name`, labels `app: <name>`). The addresses are
/// never dialled: these tests talk to each sidecar's inbound directly.
fn workloads(namespace: &str, names: &[&str]) -> String {
    let endpoints: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            format!(
                "  - {{address: \"127.0.0.1:{}\", name: {name}, labels: {{app: {name}}}}}\n",
                9000 + i
            )
        })
        .collect();
    format!(
        "kind: Service\nname: web\nnamespace: {namespace}\nports: [{{port: 8080}}]\nendpoints:\n{}",
        endpoints.concat()
    )
}

/// A `Server` for workload `app`'s `port`, and an `AuthorizationPolicy`
/// admitting it to what `authn` (`Kind/name` refs) requires.
fn server_with_policy(name: &str, port: u16, authn: &[(&str, &str)]) -> String {
    let refs: Vec<String> = authn
        .iter()
        .map(|(kind, n)| format!("  - {{group: policy.linkerd.io, kind: {kind}, name: {n}}}\n"))
        .collect();
    format!(
        "kind: Server\nname: {name}\nnamespace: test\npodSelector: {{matchLabels: {{app: {name}}}}}\nport: {port}\n\
         ---\nkind: AuthorizationPolicy\nname: {name}\nnamespace: test\n\
         targetRef: {{group: policy.linkerd.io, kind: Server, name: {name}}}\nrequiredAuthenticationRefs:\n{}",
        refs.concat()
    )
}

/// A control plane with identity whose cluster networks are loopback's
/// (so `cluster-*` policies admit local clients), ready (registry loaded).
async fn policy_control(scratch: &Scratch, ca: &Path) -> Process {
    let control = scratch
        .control_with_identity_and("control", ca, &["--cluster-networks", "127.0.0.0/8"])
        .await;
    wait_ready(control.addr("admin")).await;
    control
}

/// A workload's sidecar, following the control plane's policy for it;
/// ready means the control plane has answered.
async fn workload(
    scratch: &Scratch,
    control: &Process,
    ca: &Path,
    app: SocketAddr,
    namespace: &str,
    name: &str,
) -> Process {
    let id = format!("{namespace}/{name}");
    server(
        scratch,
        &format!("{namespace}-{name}"),
        control.addr("grpc"),
        ca,
        app,
        &["--workload", &id],
    )
    .await
}

/// What a client gets: the status, and the denial message when denied.
async fn outcome(answer: anyhow::Result<Answer>) -> (u16, String) {
    let answer = answer.unwrap();
    (
        answer.status.as_u16(),
        answer.proxy_error().unwrap_or_default().to_string(),
    )
}

struct Clients {
    client: std::sync::Arc<rustls::ClientConfig>,
    other: std::sync::Arc<rustls::ClientConfig>,
}

impl Clients {
    async fn new(control: &Process, ca: &Path) -> Self {
        Self {
            client: certified_client_tls(control.addr("grpc"), ca, CLIENT).await,
            other: certified_client_tls(control.addr("grpc"), ca, OTHER).await,
        }
    }

    /// (plaintext, CLIENT over mTLS, OTHER over mTLS) statuses for `path`.
    async fn statuses(&self, inbound: SocketAddr, path: &str) -> [u16; 3] {
        let web = authority("web", 8080);
        let plain = request(inbound, &web, path, http::Version::HTTP_11).await;
        let client = tls_get_path(inbound, self.client.clone(), SERVER, &web, path).await;
        let other = tls_get_path(inbound, self.other.clone(), SERVER, &web, path).await;
        [
            outcome(plain).await.0,
            outcome(client).await.0,
            outcome(other).await.0,
        ]
    }
}

#[tokio::test]
async fn each_policy_resource_admits_what_it_names() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    let app = scratch.demo_app("web-0", 0).await;
    let port = app.addr("http").port();
    let docs = [
        workloads(
            "test",
            &["by-identity", "by-suffix", "by-network", "routed", "unselected"],
        ),
        "kind: Namespace\nname: test\ndefaultInboundPolicy: deny\n".into(),
        format!("kind: MeshTLSAuthentication\nname: client-only\nnamespace: test\nidentities: [{CLIENT}]\n"),
        "kind: MeshTLSAuthentication\nname: namespace-test\nnamespace: test\n\
         identities: [\"*.test.serviceaccount.identity.cluster.local\"]\n"
            .into(),
        "kind: NetworkAuthentication\nname: loopback-but-2\nnamespace: test\n\
         networks: [{cidr: 127.0.0.0/8, except: [127.0.0.2/32]}]\n"
            .into(),
        "kind: NetworkAuthentication\nname: everywhere\nnamespace: test\n\
         networks: [{cidr: 0.0.0.0/0}, {cidr: \"::/0\"}]\n"
            .into(),
        server_with_policy("by-identity", port, &[("MeshTLSAuthentication", "client-only")]),
        server_with_policy("by-suffix", port, &[("MeshTLSAuthentication", "namespace-test")]),
        server_with_policy("by-network", port, &[("NetworkAuthentication", "loopback-but-2")]),
        // Per route: /admin for CLIENT only, the rest for everyone.
        format!(
            "kind: Server\nname: routed\nnamespace: test\npodSelector: {{matchLabels: {{app: routed}}}}\nport: {port}\n"
        ),
        "kind: HTTPRoute\nname: admin\nnamespace: test\n\
         parentRefs: [{group: policy.linkerd.io, kind: Server, name: routed}]\n\
         rules:\n  - matches: [{path: {type: PathPrefix, value: /admin}}]\n"
            .into(),
        "kind: HTTPRoute\nname: public\nnamespace: test\n\
         parentRefs: [{group: policy.linkerd.io, kind: Server, name: routed}]\n\
         rules:\n  - matches: [{path: {type: PathPrefix, value: /}}]\n"
            .into(),
        "kind: AuthorizationPolicy\nname: admin\nnamespace: test\n\
         targetRef: {group: policy.linkerd.io, kind: HTTPRoute, name: admin}\n\
         requiredAuthenticationRefs: [{group: policy.linkerd.io, kind: MeshTLSAuthentication, name: client-only}]\n"
            .into(),
        "kind: AuthorizationPolicy\nname: public\nnamespace: test\n\
         targetRef: {group: policy.linkerd.io, kind: HTTPRoute, name: public}\n\
         requiredAuthenticationRefs: [{group: policy.linkerd.io, kind: NetworkAuthentication, name: everywhere}]\n"
            .into(),
    ];
    scratch.write("policy.yaml", &docs.join("---\n"));
    let control = policy_control(&scratch, &ca).await;
    let clients = Clients::new(&control, &ca).await;
    let web = authority("web", 8080);
    // (workload, path, [plaintext, CLIENT, OTHER])
    let cases: [(&str, &str, [u16; 3]); 6] = [
        ("by-identity", "/", [403, 200, 403]),
        ("by-suffix", "/", [403, 200, 403]),
        ("by-network", "/", [200, 200, 200]),
        ("routed", "/", [200, 200, 200]),
        ("routed", "/admin/users", [403, 200, 403]),
        // No Server selects it: the namespace's default, deny.
        ("unselected", "/", [403, 403, 403]),
    ];
    let mut proxies = std::collections::HashMap::new();
    for (name, path, expected) in cases {
        if !proxies.contains_key(name) {
            let p = workload(&scratch, &control, &ca, app.addr("http"), "test", name).await;
            proxies.insert(name, p);
        }
        let inbound = proxies[name].addr("inbound");
        assert_eq!(
            clients.statuses(inbound, path).await,
            expected,
            "{name} {path}"
        );
    }
    // The network's exception, from another loopback address.
    let by_network = proxies["by-network"].addr("inbound");
    let excepted = request_from(
        Some([127, 0, 0, 2].into()),
        by_network,
        &web,
        "/",
        http::Version::HTTP_11,
    )
    .await;
    assert_eq!(
        outcome(excepted).await,
        (
            403,
            "unauthorized: unauthenticated client may not call by-network/default".into()
        )
    );
    // Denials name the client, the server and the route, and count.
    let routed = proxies["routed"].addr("inbound");
    let denied = tls_get_path(routed, clients.other.clone(), SERVER, &web, "/admin").await;
    assert_eq!(
        outcome(denied).await.1,
        format!("unauthorized: {OTHER} may not call routed/admin")
    );
    let m = metrics(proxies["routed"].addr("admin")).await;
    assert_eq!(
        metric_value(
            &m,
            "tether_proxy_inbound_denied_total",
            &[
                ("server", "routed"),
                ("route", "admin"),
                ("authz", "none"),
                ("client_id", OTHER)
            ]
        ),
        2.0,
        "{m}"
    );
    // Admissions count by server, route and authorization: by-identity
    // admitted CLIENT once.
    let m = metrics(proxies["by-identity"].addr("admin")).await;
    assert_eq!(
        metric_value(
            &m,
            "tether_proxy_inbound_allowed_total",
            &[
                ("server", "by-identity"),
                ("route", "default"),
                ("authz", "by-identity")
            ]
        ),
        1.0,
        "{m}"
    );
    let unselected = proxies["unselected"].addr("inbound");
    let denied = request(unselected, &web, "/", http::Version::HTTP_11).await;
    assert_eq!(
        outcome(denied).await.1,
        "unauthorized: unauthenticated client may not call default:deny/default"
    );
}

#[tokio::test]
async fn each_namespace_default_admits_what_its_name_says_and_audit_counts() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    let app = scratch.demo_app("web-0", 0).await;
    // (default, [plaintext, CLIENT]); cluster networks are loopback.
    let cases = [
        ("all-unauthenticated", [200, 200]),
        ("all-authenticated", [403, 200]),
        ("cluster-unauthenticated", [200, 200]),
        ("cluster-authenticated", [403, 200]),
        ("deny", [403, 403]),
        ("audit", [200, 200]),
    ];
    let docs: Vec<String> = cases
        .iter()
        .map(|(policy, _)| {
            format!(
                "{}---\nkind: Namespace\nname: {policy}\ndefaultInboundPolicy: {policy}\n",
                workloads(policy, &["web-0"])
            )
        })
        .collect();
    scratch.write("namespaces.yaml", &docs.join("---\n"));
    let control = policy_control(&scratch, &ca).await;
    let clients = Clients::new(&control, &ca).await;
    for (policy, expected) in cases {
        let proxy = workload(&scratch, &control, &ca, app.addr("http"), policy, "web-0").await;
        let [plain, client, _] = clients.statuses(proxy.addr("inbound"), "/").await;
        assert_eq!([plain, client], expected, "{policy}");
        let m = metrics(proxy.addr("admin")).await;
        let audited = metric_value(&m, "tether_proxy_inbound_audit_denied_total", &[]);
        if policy == "audit" {
            // Everything would have been denied: 2 requests, plus OTHER's.
            assert_eq!(audited, 3.0, "{m}");
            assert_eq!(
                metric_value(
                    &m,
                    "tether_proxy_inbound_audit_denied_total",
                    &[("server", "default:audit"), ("authz", "default:audit")]
                ),
                3.0,
                "{m}"
            );
        } else {
            assert_eq!(audited, 0.0, "{policy}: {m}");
        }
    }
}

/// The policy of workload `web-0`'s port: a `Server` and the identities
/// that may call it.
fn callers_policy(port: u16, identities: &[&str]) -> String {
    format!(
        "kind: MeshTLSAuthentication\nname: callers\nnamespace: test\nidentities: [{}]\n---\n{}",
        identities.join(", "),
        server_with_policy("web-0", port, &[("MeshTLSAuthentication", "callers")])
    )
}

#[tokio::test]
async fn a_policy_change_denies_new_requests_without_failing_allowed_ones_under_load() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    let app = scratch.demo_app("web-0", 0).await;
    let port = app.addr("http").port();
    scratch.service("web", 8080, false);
    // Not reachable until its sidecar runs, but already a workload.
    let nowhere: SocketAddr = "127.0.0.1:9".parse().unwrap();
    meshed_endpoint(&scratch, "web-0", nowhere, SERVER);
    scratch.write("policy.yaml", &callers_policy(port, &[CLIENT, OTHER]));
    let control = policy_control(&scratch, &ca).await;
    let web_proxy = workload(&scratch, &control, &ca, app.addr("http"), "test", "web-0").await;
    meshed_endpoint(&scratch, "web-0", web_proxy.addr("inbound"), SERVER);
    let client = client_sidecar(&scratch, &control, &ca).await;
    let web = authority("web", 8080);
    let outbound = client.addr("outbound");
    assert!(
        eventually(Duration::from_secs(10), || async {
            request(outbound, &web, "/", http::Version::HTTP_11)
                .await
                .is_ok_and(|a| a.status == 200 && a.replica() == "web-0")
        })
        .await,
        "the client never reached web-0 through the mesh"
    );
    let other = certified_client_tls(control.addr("grpc"), &ca, OTHER).await;
    let other_status = || async {
        tls_get(web_proxy.addr("inbound"), other.clone(), SERVER, &web)
            .await
            .unwrap()
            .status
    };
    assert_eq!(other_status().await, 200);

    // Open-loop load from the allowed client, across the change.
    let load = std::process::Command::new(tether())
        .args([
            "load",
            "--connect",
            &outbound.to_string(),
            "--authority",
            &web,
        ])
        .args(["--rate", "100", "--duration", "60", "--concurrency", "16"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let served = || async {
        metric_value(
            &metrics(web_proxy.addr("admin")).await,
            "tether_proxy_requests_total",
            &[("direction", "inbound"), ("status_class", "2xx")],
        )
    };
    let before = served().await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            served().await >= before + 50.0
        })
        .await,
        "the load never reached web-0"
    );
    scratch.write("policy.yaml", &callers_policy(port, &[CLIENT]));
    // The registry is re-read on change (and rescanned): OTHER's requests
    // are denied once the proxy has the new policy.
    assert!(
        eventually(Duration::from_secs(10), || async {
            other_status().await == 403
        })
        .await,
        "OTHER was never denied"
    );
    let at_change = served().await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            served().await >= at_change + 50.0
        })
        .await,
        "the load stopped after the change"
    );
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &load.id().to_string()])
        .status();
    let out = load.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["failed"], 0, "{report}");
    assert!(report["succeeded"].as_u64().unwrap() >= 100, "{report}");
    let m = metrics(web_proxy.addr("admin")).await;
    assert_eq!(
        metric_value(
            &m,
            "tether_proxy_inbound_denied_total",
            &[("client_id", CLIENT)]
        ),
        0.0,
        "{m}"
    );
    assert!(
        metric_value(
            &m,
            "tether_proxy_inbound_denied_total",
            &[("server", "web-0"), ("client_id", OTHER)]
        ) >= 1.0,
        "{m}"
    );
}

/// An echo exchange over mTLS to an opaque inbound, as `tls`'s identity:
/// the open stream.
async fn tls_echo(
    inbound: SocketAddr,
    tls: std::sync::Arc<rustls::ClientConfig>,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tcp = tokio::net::TcpStream::connect(inbound).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from(SERVER.to_string()).unwrap();
    let mut stream = tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
        .unwrap();
    stream.write_all(b"hello\n").await.unwrap();
    let mut got = [0u8; 6];
    tokio::time::timeout(Duration::from_secs(10), stream.read_exact(&mut got))
        .await
        .expect("no echo")
        .unwrap();
    assert_eq!(&got, b"hello\n");
    stream
}

/// A policy change closes the open opaque connections of the client it
/// now denies, and keeps the others open.
#[tokio::test]
async fn a_policy_change_closes_the_opaque_connections_it_denies_and_no_others() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    let app = echo_server().await;
    let port = app.port();
    let opaque = |ids: &[&str]| {
        callers_policy(port, ids).replace(
            &format!("port: {port}\n"),
            &format!("port: {port}\nproxyProtocol: opaque\n"),
        )
    };
    scratch.write("web.yaml", &workloads("test", &["web-0"]));
    scratch.write("policy.yaml", &opaque(&[CLIENT, OTHER]));
    let control = policy_control(&scratch, &ca).await;
    let proxy = server(
        &scratch,
        "web-0-proxy",
        control.addr("grpc"),
        &ca,
        app,
        &["--workload", "test/web-0", "--inbound-opaque"],
    )
    .await;
    let inbound = proxy.addr("inbound");
    let clients = Clients::new(&control, &ca).await;
    // Plaintext is no mesh identity: closed at once.
    assert_eq!(echo(inbound).await, b"");
    let mut allowed = tls_echo(inbound, clients.client.clone()).await;
    let mut denied = tls_echo(inbound, clients.other.clone()).await;
    scratch.write("policy.yaml", &opaque(&[CLIENT]));
    let mut buf = [0u8; 16];
    let closed = tokio::time::timeout(Duration::from_secs(10), denied.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "OTHER's connection was not closed: {closed:?}"
    );
    allowed.write_all(b"again\n").await.unwrap();
    let mut got = [0u8; 6];
    tokio::time::timeout(Duration::from_secs(10), allowed.read_exact(&mut got))
        .await
        .expect("the allowed connection stopped echoing")
        .unwrap();
    assert_eq!(&got, b"again\n");
    let m = metrics(proxy.addr("admin")).await;
    assert_eq!(
        metric_value(
            &m,
            "tether_proxy_inbound_denied_total",
            &[("server", "web-0"), ("client_id", OTHER)]
        ),
        1.0,
        "{m}"
    );
}

/// A gRPC server's routes: a `GRPCRoute` authorized for [`CLIENT`] only,
/// no route for the rest.
#[tokio::test]
async fn a_grpc_route_admits_its_callers_and_unrouted_methods_are_unimplemented() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    let app = scratch.demo_app("web-0", 0).await;
    let port = app.addr("http").port();
    scratch.service("web", 8080, false);
    let nowhere: SocketAddr = "127.0.0.1:9".parse().unwrap();
    meshed_endpoint(&scratch, "web-0", nowhere, SERVER);
    scratch.write(
        "policy.yaml",
        &format!(
            "kind: Server\nname: web-grpc\nnamespace: test\npodSelector: {{matchLabels: {{app: web-0}}}}\n\
             port: {port}\nproxyProtocol: gRPC\n---\n\
             kind: GRPCRoute\nname: hello\nnamespace: test\n\
             parentRefs: [{{group: policy.linkerd.io, kind: Server, name: web-grpc}}]\n\
             rules:\n  - matches: [{{method: {{service: tether.demo.v1.Demo, method: Hello}}}}]\n---\n\
             kind: MeshTLSAuthentication\nname: client-only\nnamespace: test\nidentities: [{CLIENT}]\n---\n\
             kind: AuthorizationPolicy\nname: hello\nnamespace: test\n\
             targetRef: {{group: gateway.networking.k8s.io, kind: GRPCRoute, name: hello}}\n\
             requiredAuthenticationRefs: [{{group: policy.linkerd.io, kind: MeshTLSAuthentication, name: client-only}}]\n"
        ),
    );
    let control = policy_control(&scratch, &ca).await;
    let web_proxy = workload(&scratch, &control, &ca, app.addr("http"), "test", "web-0").await;
    meshed_endpoint(&scratch, "web-0", web_proxy.addr("inbound"), SERVER);
    let client = client_sidecar(&scratch, &control, &ca).await;
    let web = authority("web", 8080);
    let meshed = tether_mesh_up::demo_grpc::channel(client.addr("outbound"), &web)
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            tether_mesh_up::demo_grpc::hello(meshed.clone(), "mesh")
                .await
                .is_ok()
        })
        .await,
        "CLIENT's call never went through"
    );
    let unrouted = tether_mesh_up::demo_grpc::count(meshed, 1)
        .await
        .unwrap_err();
    assert_eq!(unrouted.code(), tonic::Code::Unimplemented, "{unrouted:?}");
    assert_eq!(
        unrouted.message(),
        "no route of web-grpc matches the request"
    );
    let direct = tether_mesh_up::demo_grpc::channel(web_proxy.addr("inbound"), &web)
        .await
        .unwrap();
    let denied = tether_mesh_up::demo_grpc::hello(direct, "plain")
        .await
        .unwrap_err();
    assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied:?}");
    assert_eq!(
        denied.message(),
        "unauthorized: unauthenticated client may not call web-grpc/hello"
    );
}
