//! Transparent interception, for real, in network namespaces: `tether
//! init` programs iptables, an unmodified `curl` dials a service's cluster
//! IP, and the request reaches the app through both proxies over mTLS. The
//! proxies run as their own user, so their traffic is not looped back.
//! Both modes: `redirect` (NAT, connection tracking) in one namespace, and
//! `tproxy` (no connection tracking) between a client pod and a server pod,
//! both ways intercepted. Needs root; installs iptables, iproute2 and curl
//! with apt-get when they are missing.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering;

use crate::multicluster::{sh, spawn_in, NetNs, NEXT_NET};
use crate::support::*;

const PROXY_UID: &str = "1337";

fn ensure_iptables() {
    installed(&["iptables"], "iptables");
    // The unmodified client the test dials with.
    installed(&["curl"], "curl");
}

/// `ip` arguments running `tether ARGS` inside `ns` as the proxy's user;
/// with `net_raw`, keeping that one capability (`--transparent` needs it).
fn as_proxy(ns: &NetNs, net_raw: bool, args: &[String]) -> Vec<String> {
    let mut full: Vec<String> = vec![
        "netns".into(),
        "exec".into(),
        ns.name.clone(),
        "setpriv".into(),
        format!("--reuid={PROXY_UID}"),
        format!("--regid={PROXY_UID}"),
        "--clear-groups".into(),
    ];
    if net_raw {
        full.extend([
            "--inh-caps=+net_raw".into(),
            "--ambient-caps=+net_raw".into(),
        ]);
    }
    full.push(tether().display().to_string());
    full.extend(args.iter().cloned());
    full
}

/// `tether ARGS` inside `ns`, as the proxy's user.
async fn spawn_as_proxy(
    scratch: &Scratch,
    ns: &NetNs,
    name: &str,
    args: &[String],
    expect: &[&str],
) -> Process {
    let net_raw = args.iter().any(|a| a == "--transparent");
    let full = as_proxy(ns, net_raw, args);
    Process::spawn(Path::new("ip"), name, &full, &scratch.log(name), expect)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n--- {name} ---\n{}", scratch.read_log(name)))
}

/// Connections the kernel tracks in `ns` now.
fn tracked(ns: &NetNs) -> u64 {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.name,
            "cat",
            "/proc/sys/net/netfilter/nf_conntrack_count",
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| {
            panic!(
                "no connection count in {}: {}",
                ns.name,
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

fn nat_rules(ns: &NetNs) -> String {
    table_rules(ns, "nat")
}

/// What `command` prints in `ns`.
fn stdout_in(ns: &NetNs, command: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.name])
        .args(command)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn table_rules(ns: &NetNs, table: &str) -> String {
    stdout_in(ns, &["iptables-save", "-t", table])
        .lines()
        .filter(|l| !l.starts_with('#') && !l.starts_with(':'))
        .collect::<Vec<_>>()
        .join("\n")
}

fn curl(ns: &NetNs, url: &str) -> (bool, String) {
    let out = Command::new("ip")
        .args([
            "netns", "exec", &ns.name, "curl", "-s", "-m", "10", "-D", "-", url,
        ])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// A demo app in `ns` on `listen`, answering as `replica`.
async fn demo_app_in(scratch: &Scratch, ns: &NetNs, replica: &str, listen: &str) -> Process {
    let args = ["demo-app", "--listen", listen, "--replica", replica].map(String::from);
    spawn_in(scratch, ns, replica, &args, &["http"]).await
}

/// Lists `address` as the `web` service's one endpoint and waits until
/// both proxies are ready.
async fn serve_web_at(scratch: &Scratch, address: &str, identity: &str, proxies: [&Process; 2]) {
    scratch.write(
        "web-0.yaml",
        &format!("kind: Endpoints\nservice: web\nnamespace: test\nendpoints: [{{address: \"{address}\", identity: {identity}}}]\n"),
    );
    for proxy in proxies {
        let admin = proxy.addr("admin");
        assert!(
            eventually(std::time::Duration::from_secs(15), || async {
                ready_body(admin).await.0 == 200
            })
            .await
        );
    }
}

#[tokio::test]
async fn curl_to_a_cluster_ip_is_intercepted_and_meshed() {
    ensure_iptables();
    let ns = NetNs::new(NEXT_NET.fetch_add(1, Ordering::SeqCst), 0);
    let scratch = Scratch::new();
    std::fs::set_permissions(scratch.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let ca = scratch.identity_init("ca");
    scratch.write(
        "web.yaml",
        "kind: Service\nname: web\nnamespace: test\nports: [{port: 80}]\ncluster_ip: 10.96.0.10\n",
    );
    let ip = ns.ip.to_string();
    let ca_s = ca.display().to_string();
    let control = spawn_in(
        &scratch,
        &ns,
        "control",
        &[
            "control",
            "--registry",
            &scratch.registry().display().to_string(),
            "--grpc",
            &format!("{ip}:8086"),
            "--admin",
            &format!("{ip}:0"),
            "--identity",
            &ca_s,
        ]
        .map(String::from),
        &["grpc", "admin"],
    )
    .await;
    let app = demo_app_in(&scratch, &ns, "web-0", &format!("{ip}:8080")).await;
    let outside = demo_app_in(&scratch, &ns, "outside", &format!("{ip}:9000")).await;

    let proxy = |name: &str, identity: &str, app: Option<&str>| {
        let mut a: Vec<String> = [
            "proxy",
            "--control",
            &format!("{ip}:8086"),
            "--outbound",
            "127.0.0.1:4140",
            "--admin",
            &format!("{ip}:0"),
        ]
        .map(String::from)
        .to_vec();
        if let Some(app) = app {
            a.extend([
                "--app".into(),
                app.to_string(),
                "--inbound".into(),
                format!("{ip}:4143"),
            ]);
            a[4] = "127.0.0.1:0".into();
        }
        a.extend(scratch.identity_args(&ca, identity, &ca));
        let _ = name;
        a
    };
    let server_id = "web.test.serviceaccount.identity.cluster.local";
    let client_id = "client.test.serviceaccount.identity.cluster.local";
    let server = spawn_as_proxy(
        &scratch,
        &ns,
        "server",
        &proxy("server", server_id, Some(&app.addr("http").to_string())),
        &["inbound", "admin"],
    )
    .await;
    let client = spawn_as_proxy(
        &scratch,
        &ns,
        "client",
        &proxy("client", client_id, None),
        &["outbound", "admin"],
    )
    .await;
    serve_web_at(
        &scratch,
        &format!("{ip}:4143"),
        server_id,
        [&client, &server],
    )
    .await;

    // Program the interception, twice: the same rules either way.
    let init = |_: ()| {
        sh(&[
            "ip",
            "netns",
            "exec",
            &ns.name,
            tether().to_str().unwrap(),
            "init",
            "--proxy-uid",
            PROXY_UID,
            "--outbound-port",
            "4140",
            "--outbound-only",
        ]);
        nat_rules(&ns)
    };
    let first = init(());
    let second = init(());
    assert_eq!(first, second, "tether init is not idempotent");
    assert!(
        first.contains("--uid-owner 1337 -j RETURN") && first.contains("--to-ports 4140"),
        "{first}"
    );

    // An unmodified client dials the service's cluster IP.
    let (ok, out) = curl(&ns, "http://10.96.0.10:80/hello");
    assert!(
        ok,
        "curl failed:\n{out}\n--- client ---\n{}",
        scratch.read_log("client")
    );
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(out.contains("tether-demo-replica: web-0"), "{out}");
    // NAT needs the kernel to track connections: what tproxy mode spares.
    assert!(tracked(&ns) > 0, "the redirect tracked no connection");
    // Through both proxies, over mTLS: the app sees the client's verified identity.
    assert!(
        out.contains(&format!("\"client_id\":\"{client_id}\"")),
        "{out}"
    );
    let m = metrics(client.addr("admin")).await;
    assert_eq!(
        metric_value(
            &m,
            "tether_proxy_requests_total",
            &[
                ("direction", "outbound"),
                ("authority", "10.96.0.10:80"),
                ("tls", "true")
            ]
        ),
        1.0,
        "exactly one outbound request (no loop):\n{m}"
    );

    // A pod's own address goes straight to that endpoint, still meshed.
    let (ok, out) = curl(&ns, &format!("http://{ip}:4143/direct"));
    assert!(ok && out.contains("tether-demo-replica: web-0"), "{out}");
    assert!(
        out.contains(&format!("\"client_id\":\"{client_id}\"")),
        "{out}"
    );

    // A destination outside the mesh is passed through as opaque TCP.
    let (ok, out) = curl(&ns, &format!("http://{ip}:9000/"));
    assert!(ok && out.contains("tether-demo-replica: outside"), "{out}");

    // Under mandatory TLS it is refused instead: no plaintext leaves.
    let mut client = client;
    client.stop(std::time::Duration::from_secs(5)).await;
    let mut args = proxy("client", client_id, None);
    args.extend(["--tls".to_string(), "mandatory".to_string()]);
    let strict = spawn_as_proxy(&scratch, &ns, "strict", &args, &["outbound", "admin"]).await;
    assert!(
        eventually(std::time::Duration::from_secs(15), || async {
            ready_body(strict.addr("admin")).await.0 == 200
        })
        .await
    );
    let (ok, out) = curl(&ns, &format!("http://{ip}:9000/"));
    assert!(
        !ok && !out.contains("outside"),
        "mandatory TLS let plaintext out:\n{out}"
    );
    let m = metrics(strict.addr("admin")).await;
    assert_eq!(
        metric_value(
            &m,
            "tether_proxy_outbound_refused_total",
            &[("reason", "mandatory_tls_unknown_destination")]
        ),
        1.0,
        "{m}"
    );
    // The meshed service still works under mandatory TLS.
    let (ok, out) = curl(&ns, "http://10.96.0.10:80/");
    assert!(ok && out.contains("tether-demo-replica: web-0"), "{out}");
    drop((control, outside));
}

/// `tether init ARGS` in `ns`, with what it printed.
fn init_in(ns: &NetNs, args: &[&str]) -> String {
    let mut full = vec![
        "netns",
        "exec",
        &ns.name,
        tether().to_str().unwrap(),
        "init",
    ];
    full.extend(args);
    let out = Command::new("ip").args(&full).output().unwrap();
    assert!(
        out.status.success(),
        "tether init {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn divert_rules(ns: &NetNs) -> String {
    let rules = stdout_in(ns, &["ip", "rule", "list"]);
    format!("{}\n{rules}", table_rules(ns, "mangle"))
}

#[tokio::test]
async fn tproxy_intercepts_both_ways_without_tracking_a_connection() {
    ensure_iptables();
    let net = NEXT_NET.fetch_add(1, Ordering::SeqCst);
    let (client_pod, server_pod) = (NetNs::new(net, 0), NetNs::new(net, 1));
    let scratch = Scratch::new();
    std::fs::set_permissions(scratch.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let ca = scratch.identity_init("ca");
    scratch.write(
        "web.yaml",
        "kind: Service\nname: web\nnamespace: test\nports: [{port: 80}]\ncluster_ip: 10.96.0.10\n",
    );
    let (c, s) = (client_pod.ip.to_string(), server_pod.ip.to_string());
    // The control plane in the server pod, as root (not the proxy's user).
    let control = spawn_in(
        &scratch,
        &server_pod,
        "control",
        &[
            "control",
            "--registry",
            &scratch.registry().display().to_string(),
            "--grpc",
            &format!("{s}:8086"),
            "--admin",
            &format!("{s}:0"),
            "--identity",
            &ca.display().to_string(),
        ]
        .map(String::from),
        &["grpc", "admin"],
    )
    .await;
    let _side = demo_app_in(&scratch, &server_pod, "side", "0.0.0.0:9100").await;
    let _app = demo_app_in(&scratch, &server_pod, "web-0", "0.0.0.0:8080").await;
    // Outside the mesh: on the node.
    let node_ip = format!("{}.1", s.rsplit_once('.').unwrap().0);
    let outside = Process::spawn(
        tether(),
        "outside",
        &[
            "demo-app",
            "--listen",
            &format!("{node_ip}:9000"),
            "--replica",
            "outside",
        ]
        .map(String::from),
        &scratch.log("outside"),
        &["http"],
    )
    .await
    .unwrap();

    // Both pods intercepted both ways, before anything connects (a
    // connection made before would lose its answers); the admin port, the
    // control plane's (served from the server pod) and a port the app
    // serves itself are left alone inbound. Outbound nothing is skipped:
    // the proxies' connections to the control plane are known by their
    // mark. Twice: the same rules either way.
    let args = [
        "--mode",
        "tproxy",
        "--proxy-uid",
        PROXY_UID,
        "--skip-inbound-ports",
        "4191,8086,9100",
    ];
    for pod in [&client_pod, &server_pod] {
        init_in(pod, &args);
        let first = divert_rules(pod);
        init_in(pod, &args);
        assert_eq!(first, divert_rules(pod), "tether init is not idempotent");
        assert_eq!(
            first.matches("fwmark 0x2000/0x2000 lookup 8192").count(),
            1,
            "{first}"
        );
        // Every table there is (`-t nat` would show one that is not).
        let tables = stdout_in(pod, &["iptables-save"]);
        assert!(!tables.contains("*nat"), "tproxy mode used NAT:\n{tables}");
    }

    // Without the capability, --transparent says what it needs.
    let refused = Command::new("ip")
        .args(as_proxy(
            &client_pod,
            false,
            &[
                "proxy",
                "--transparent",
                "--control",
                &format!("{s}:8086"),
                "--insecure-control-plane",
            ]
            .map(String::from),
        ))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("CAP_NET_RAW"),
        "{stderr}"
    );

    let proxy = |pod: &str, identity: &str, app: bool| {
        let mut a: Vec<String> = [
            "proxy",
            "--transparent",
            "--control",
            &format!("{s}:8086"),
            "--outbound",
            "127.0.0.1:4140",
            "--admin",
            &format!("{pod}:4191"),
        ]
        .map(String::from)
        .to_vec();
        if app {
            a.extend(["--app", "127.0.0.1:8080", "--inbound", "0.0.0.0:4143"].map(String::from));
        }
        a.extend(scratch.identity_args(&ca, identity, &ca));
        a
    };
    let server_id = "web.test.serviceaccount.identity.cluster.local";
    let client_id = "client.test.serviceaccount.identity.cluster.local";
    let server = spawn_as_proxy(
        &scratch,
        &server_pod,
        "server",
        &proxy(&s, server_id, true),
        &["inbound", "admin"],
    )
    .await;
    let client = spawn_as_proxy(
        &scratch,
        &client_pod,
        "client",
        &proxy(&c, client_id, false),
        &["outbound", "admin"],
    )
    .await;
    // The endpoint is the app's own port, as a pod's is: the server pod's
    // interception hands it to the inbound.
    serve_web_at(
        &scratch,
        &format!("{s}:8080"),
        server_id,
        [&client, &server],
    )
    .await;

    // An unmodified client dials the service's cluster IP: diverted to the
    // client proxy, and from it to the server pod's app port, diverted to
    // the inbound.
    let (ok, out) = curl(&client_pod, "http://10.96.0.10:80/hello");
    assert!(
        ok,
        "curl failed:\n{out}\n--- client ---\n{}\n--- server ---\n{}",
        scratch.read_log("client"),
        scratch.read_log("server")
    );
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(out.contains("tether-demo-replica: web-0"), "{out}");
    assert!(
        out.contains(&format!("\"client_id\":\"{client_id}\"")),
        "not over mTLS through both proxies:\n{out}"
    );
    for (admin, direction) in [
        (client.addr("admin"), "outbound"),
        (server.addr("admin"), "inbound"),
    ] {
        let m = metrics(admin).await;
        assert_eq!(
            metric_value(
                &m,
                "tether_proxy_requests_total",
                &[("direction", direction), ("tls", "true")]
            ),
            1.0,
            "exactly one {direction} request (no loop, nothing around the proxy):\n{m}"
        );
    }
    // The proxies' connections to the control plane carry the proxy's
    // mark too, which outlives them: their last packets after a close are
    // left alone, as the uid rule leaves them alone while they are open.
    for pod in [&client_pod, &server_pod] {
        let sockets = stdout_in(pod, &["ss", "-tne", "dst", &format!("{s}:8086")]);
        let connections: Vec<&str> = sockets.lines().filter(|l| l.starts_with("ESTAB")).collect();
        assert!(
            !connections.is_empty() && connections.iter().all(|l| l.contains("fwmark:0x1000")),
            "control-plane connections from {} not all marked:\n{sockets}",
            pod.name
        );
    }
    // A destination outside the mesh is passed through as opaque TCP.
    let (ok, out) = curl(&client_pod, &format!("http://{node_ip}:9000/"));
    assert!(ok && out.contains("tether-demo-replica: outside"), "{out}");
    // A port the app serves itself, left alone, is reached from outside
    // the pod, and its answers come back: they carry the mark of what
    // they answer, not taken for the app's outbound traffic.
    let (ok, out) = curl(&client_pod, &format!("http://{s}:9100/"));
    assert!(ok && out.contains("tether-demo-replica: side"), "{out}");
    // And no connection was tracked, in either pod.
    for pod in [&client_pod, &server_pod] {
        assert_eq!(tracked(pod), 0, "connections tracked in {}", pod.name);
    }

    // Another rule makes the kernel track connections after all: the
    // socket's own address still tells the destination (the tracking's
    // answer is then that same address).
    sh(&[
        "ip",
        "netns",
        "exec",
        &client_pod.name,
        "iptables",
        "-A",
        "OUTPUT",
        "-m",
        "conntrack",
        "--ctstate",
        "NEW,ESTABLISHED",
        "-j",
        "ACCEPT",
    ]);
    let (ok, out) = curl(&client_pod, &format!("http://{node_ip}:9000/"));
    assert!(ok && out.contains("tether-demo-replica: outside"), "{out}");
    assert!(tracked(&client_pod) > 0);

    // Switching back to redirect mode leaves none of tproxy mode's rules.
    init_in(
        &client_pod,
        &[
            "--mode",
            "redirect",
            "--proxy-uid",
            PROXY_UID,
            "--outbound-only",
        ],
    );
    let left = divert_rules(&client_pod);
    assert!(
        !left.contains("TETHER_DIVERT") && !left.contains("fwmark 0x2000"),
        "{left}"
    );
    drop((control, outside));
}
