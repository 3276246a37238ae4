//! Transparent interception, for real, in a network namespace: `tether
//! init` programs iptables, an unmodified `curl` dials a service's cluster
//! IP, and the request reaches the app through both proxies over mTLS. The
//! proxies run as their own user, so their traffic is not looped back.
//! Needs root; installs iptables and curl with apt-get when they are
//! missing.

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

/// `tether ARGS` inside `ns`, as the proxy's user.
async fn spawn_as_proxy(
    scratch: &Scratch,
    ns: &NetNs,
    name: &str,
    args: &[String],
    expect: &[&str],
) -> Process {
    let mut full: Vec<String> = vec![
        "netns".into(),
        "exec".into(),
        ns.name.clone(),
        "setpriv".into(),
        format!("--reuid={PROXY_UID}"),
        format!("--regid={PROXY_UID}"),
        "--clear-groups".into(),
        tether().display().to_string(),
    ];
    full.extend(args.iter().cloned());
    Process::spawn(Path::new("ip"), name, &full, &scratch.log(name), expect)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n--- {name} ---\n{}", scratch.read_log(name)))
}

fn nat_rules(ns: &NetNs) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.name, "iptables-save", "-t", "nat"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
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
    let app = spawn_in(
        &scratch,
        &ns,
        "web-0",
        &[
            "demo-app",
            "--listen",
            &format!("{ip}:8080"),
            "--replica",
            "web-0",
        ]
        .map(String::from),
        &["http"],
    )
    .await;
    let outside = spawn_in(
        &scratch,
        &ns,
        "outside",
        &[
            "demo-app",
            "--listen",
            &format!("{ip}:9000"),
            "--replica",
            "outside",
        ]
        .map(String::from),
        &["http"],
    )
    .await;

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
    scratch.write(
        "web-0.yaml",
        &format!("kind: Endpoints\nservice: web\nnamespace: test\nendpoints: [{{address: \"{ip}:4143\", identity: {server_id}}}]\n"),
    );
    for admin in [client.addr("admin"), server.addr("admin")] {
        assert!(
            eventually(std::time::Duration::from_secs(15), || async {
                ready_body(admin).await.0 == 200
            })
            .await
        );
    }

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
