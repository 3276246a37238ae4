//! `tether tap` against `tether up`: filters pick exactly the requests
//! asked for, and header values outside the allow-list never leave a proxy.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use crate::support::*;

const MANIFEST: &str = "
services:
  - name: web
  - name: broken
    error_rate: 1.0
  - name: api
load:
  - service: api
    rps: 20
";

/// Starts `tether tap ARGS -o json` and waits until every proxy accepted it.
fn tap(mesh: &LocalMesh, args: &[&str]) -> Child {
    mesh.tool("tap", args, "observing")
}

fn lines(child: Child) -> Vec<serde_json::Value> {
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// One HTTP/1.1 request through the load generator's outbound proxy.
fn send(outbound: SocketAddr, method: &str, authority: &str, path: &str, headers: &[&str]) -> u16 {
    let mut s = std::net::TcpStream::connect(outbound).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: {authority}\r\nconnection: close\r\ncontent-length: 0\r\n");
    for h in headers {
        req.push_str(&format!("{h}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    let mut rsp = String::new();
    s.read_to_string(&mut rsp).unwrap();
    rsp.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn tap_filters_and_redacts() {
    let mesh = LocalMesh::start(MANIFEST, &[]);
    let out = mesh.proxy("loadgen").outbound.unwrap();
    let domain = mesh.state.cluster_domain.clone();
    let web = format!("web.demo.svc.{domain}:8080");
    let broken = format!("broken.demo.svc.{domain}:8080");
    // Each request is seen twice: by the client's outbound and by web-0's inbound.
    let matched = tap(
        &mesh,
        &[
            "--authority",
            &web,
            "--path",
            "/wanted",
            "--method",
            "get",
            "--headers",
            "--max",
            "6",
        ],
    );
    let failed = tap(&mesh, &["--status", "5xx", "--max", "2"]);
    // What the filters must leave out goes first: had it leaked, it would
    // fill the first lines.
    assert_eq!(send(out, "POST", &web, "/wanted", &[]), 200);
    assert_eq!(send(out, "GET", &web, "/other", &[]), 200);
    assert_eq!(send(out, "GET", &broken, "/wanted", &[]), 500);
    for _ in 0..3 {
        let secret = [
            "authorization: Bearer tap-secret-token",
            "user-agent: tap-test-agent",
        ];
        assert_eq!(
            send(out, "GET", &web, "/wanted/x?token=query-secret", &secret),
            200
        );
    }

    let seen = lines(matched);
    assert_eq!(seen.len(), 6, "{seen:?}");
    let text = serde_json::to_string(&seen).unwrap();
    assert!(
        !text.contains("tap-secret-token") && !text.contains("query-secret"),
        "{text}"
    );
    for l in &seen {
        assert_eq!(
            (l["method"].as_str(), l["path"].as_str()),
            (Some("GET"), Some("/wanted/x")),
            "{l}"
        );
        assert_eq!(
            (l["status"].as_u64(), l["class"].as_str()),
            (Some(200), Some("2xx")),
            "{l}"
        );
        assert_eq!(l["tls"], true, "{l}");
        let headers: Vec<(String, String)> = serde_json::from_value(l["headers"].clone()).unwrap();
        let value = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(value("authorization"), Some("[redacted]"), "{l}");
        assert_eq!(value("user-agent"), Some("tap-test-agent"), "{l}");
    }
    let (inbound, outbound): (Vec<_>, Vec<_>) =
        seen.iter().partition(|l| l["direction"] == "inbound");
    assert_eq!((inbound.len(), outbound.len()), (3, 3), "{seen:?}");
    for l in inbound {
        assert_eq!(l["proxy"], "web-0", "{l}");
        assert!(
            l["client_id"]
                .as_str()
                .unwrap()
                .starts_with("loadgen.demo."),
            "{l}"
        );
    }
    for l in outbound {
        assert_eq!(l["proxy"], "loadgen", "{l}");
        assert!(
            l["server_id"].as_str().unwrap().starts_with("web.demo."),
            "{l}"
        );
        assert_eq!(l["endpoint"]["pod"], "web-0", "{l}");
        assert_eq!(
            l["destination"],
            mesh.proxy("web-0").inbound.unwrap().to_string(),
            "{l}"
        );
    }

    let failures = lines(failed);
    assert_eq!(failures.len(), 2, "{failures:?}");
    for l in &failures {
        assert_eq!(l["authority"], broken.as_str(), "{l}");
        assert_eq!(l["status"], 500, "{l}");
    }
}

#[test]
fn tap_names_a_bad_method() {
    let (ok, out) = run_tether(&["tap", "--tap", "127.0.0.1:1", "--method", "GE T"]);
    assert!(!ok);
    assert!(
        out.contains("--method \"GE T\" is not an HTTP method"),
        "{out}"
    );
}

/// This host's address on a non-loopback interface.
fn non_loopback_ip() -> std::net::IpAddr {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    s.connect("203.0.113.1:9")
        .expect("this test needs a non-loopback IPv4 address with a route");
    let ip = s.local_addr().unwrap().ip();
    assert!(!ip.is_loopback() && !ip.is_unspecified(), "{ip}");
    ip
}

#[tokio::test]
async fn tap_admits_loopback_only_without_allowed_identities() {
    let s = Scratch::new();
    let args = [
        "proxy",
        "--control",
        "127.0.0.1:1",
        "--outbound",
        "127.0.0.1:0",
    ];
    let proxy = s
        .spawn(
            "proxy",
            &[&args[..], &["--admin", "127.0.0.1:0", "--tap", "0.0.0.0:0"]].concat(),
            &["outbound", "admin", "tap"],
        )
        .await;
    let port = proxy.addr("tap").port();
    let remote = SocketAddr::new(non_loopback_ip(), port).to_string();
    let (ok, out) = run_tether(&["tap", "--tap", &remote, "--max", "1"]);
    assert!(!ok, "{out}");
    assert!(out.contains(&format!("tap {remote} at {remote}")), "{out}");
    assert!(
        s.read_log("proxy").contains("tap connection refused"),
        "{}",
        s.read_log("proxy")
    );

    let local = SocketAddr::from(([127, 0, 0, 1], port)).to_string();
    let mut admitted = Command::new(tether())
        .args(["tap", "--tap", &local])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(admitted.stderr.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _ = admitted.kill();
    let _ = admitted.wait();
    assert!(line.contains("observing 1 proxies"), "{line}");
}
