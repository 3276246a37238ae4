//! `tether-proxy`, the proxy-only binary: the same proxy as `tether proxy`,
//! started as its own executable.
//!
//! cargo builds it beside `tether` in `cargo test --workspace` (its package,
//! `tether-proxy-cli`, has integration tests, which need it built); a run of
//! this target alone needs `cargo build -p tether-proxy-cli` first.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::support::*;

fn tether_proxy() -> PathBuf {
    let path = tether().with_file_name("tether-proxy");
    assert!(
        path.exists(),
        "{} is missing: `cargo test --workspace` builds it, or `cargo build -p tether-proxy-cli`",
        path.display()
    );
    path
}

fn id(name: &str) -> String {
    format!("{name}.test.serviceaccount.identity.cluster.local")
}

/// The executable a process runs, from /proc.
fn exe_of(p: &Process) -> PathBuf {
    std::fs::read_link(format!("/proc/{}/exe", p.pid().expect("running"))).unwrap()
}

#[tokio::test]
async fn tether_proxy_binary_proxies_a_request_end_to_end_over_mtls() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let ca = scratch.identity_init("ca");
    let control = scratch.control_with_identity("control", &ca, "3600").await;
    let app = scratch.demo_app("web-0", 0).await;
    let sidecar = |name: &'static str, app: Option<SocketAddr>| {
        let flags: Vec<String> = ["--tls".to_string(), "mandatory".to_string()]
            .into_iter()
            .chain(scratch.identity_args(&ca, &id(name), &ca))
            .collect();
        let (scratch, control) = (&scratch, control.addr("grpc"));
        async move {
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            scratch
                .sidecar(&tether_proxy(), &[], name, control, app, &flags)
                .await
        }
    };
    let server = sidecar("web", Some(app.addr("http"))).await;
    let client = sidecar("client", None).await;
    for p in [&server, &client] {
        assert!(
            exe_of(p).ends_with("tether-proxy"),
            "{} runs {}",
            p.name,
            exe_of(p).display()
        );
        // Ready means certified: Certify over the control plane's TLS.
        wait_ready(p.addr("admin")).await;
    }
    scratch.write(
        "web-0.yaml",
        &format!(
            "kind: Endpoints\nservice: web\nnamespace: test\nendpoints: [{{address: \"{}\", identity: {}}}]\n",
            server.addr("inbound"),
            id("web")
        ),
    );

    let web = authority("web", 8080);
    let outbound = client.addr("outbound");
    assert!(
        eventually(Duration::from_secs(10), || async {
            get(outbound, &web).await.status == 200
        })
        .await,
        "no answer through the tether-proxy pair\n--- client ---\n{}\n--- web ---\n{}",
        scratch.read_log("client"),
        scratch.read_log("web")
    );
    let answer = get(outbound, &web).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.replica(), "web-0");
    let body: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(
        body["client_id"],
        id("client"),
        "the app sees the client's identity, verified over mTLS"
    );
    let m = metrics(server.addr("admin")).await;
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
        ) >= 2.0,
        "{m}"
    );
}

/// Both binaries take the proxy's flags from the same definitions.
#[test]
fn tether_proxy_and_tether_proxy_subcommand_take_the_same_flags() {
    let options = |exe: &std::path::Path, args: &[&str]| {
        let out = std::process::Command::new(exe).args(args).output().unwrap();
        assert!(out.status.success());
        let help = String::from_utf8(out.stdout).unwrap();
        let at = help.find("Options:").expect("an Options: section");
        help[at..].to_string()
    };
    let mut subcommand = options(tether(), &["proxy", "--help"]);
    let mut own = options(&tether_proxy(), &["--help"]);
    // Only the proxy binary has --version.
    own = own.replace("  -V, --version\n          Print version\n", "");
    subcommand = subcommand.replace("  -V, --version\n          Print version\n", "");
    assert_eq!(own, subcommand);
}

#[test]
fn tether_proxy_refuses_a_bad_flag_value_by_name() {
    let out = std::process::Command::new(tether_proxy())
        .args(["--control", "127.0.0.1:1", "--tls", "sometimes"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("--tls") && text.contains("sometimes"),
        "{text}"
    );
}
