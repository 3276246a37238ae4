//! `tether stat` against `tether up`, found through its state file: the
//! counts match what a load generator sent.

use std::process::{Command, Stdio};

use crate::support::*;
use std::net::SocketAddr;

const MANIFEST: &str = "
services:
  - name: web
    replicas: 2
  - name: api
load:
  - service: api
    rps: 20
";

/// Starts `tether stat ARGS -o json` and waits until its window opened.
fn stat_window(mesh: &LocalMesh, args: &[&str]) -> std::process::Child {
    mesh.tool("stat", args, "counting 4 of 4 proxies")
}

fn rows(child: std::process::Child) -> Vec<serde_json::Value> {
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    serde_json::from_slice::<serde_json::Value>(&out.stdout)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn stat_counts_match_the_load_generator() {
    let mesh = LocalMesh::start(MANIFEST, &[]);
    let by_service = stat_window(&mesh, &["--window", "8"]);
    let by_workload = stat_window(&mesh, &["--window", "8", "--by", "workload"]);
    let authority = format!("web.demo.svc.{}:8080", mesh.state.cluster_domain);
    let report = mesh.load(&authority);
    let sent = report["sent"].as_f64().unwrap();
    assert!(sent > 100.0, "{report}");
    assert_eq!(report["failed"], 0, "{report}");
    let mut children = [by_service, by_workload];
    for c in &mut children {
        // Otherwise the window closed before the load ended and counts
        // would be short for a reason that is not stat's.
        assert!(
            c.try_wait().unwrap().is_none(),
            "the load outlasted stat's window"
        );
    }
    let [by_service, by_workload] = children;

    let services = rows(by_service);
    let web = services
        .iter()
        .find(|r| r["name"] == authority.as_str())
        .unwrap_or_else(|| panic!("no row for {authority}: {services:?}"));
    let counted = web["requests"].as_f64().unwrap();
    assert!(
        (counted - sent).abs() <= sent * 0.01,
        "stat {counted}, load {sent}: {web}"
    );
    assert_eq!(web["success_rate"], 1.0, "{web}");
    assert_eq!(web["mtls"], 1.0, "{web}");
    assert!(
        web["p50_ms"].as_f64().unwrap() <= web["p99_ms"].as_f64().unwrap(),
        "{web}"
    );
    assert!(web["rps"].as_f64().unwrap() > 0.0, "{web}");

    let workloads = rows(by_workload);
    let served: f64 = workloads
        .iter()
        .filter(|r| r["name"].as_str().unwrap().starts_with("demo/web-"))
        .map(|r| r["requests"].as_f64().unwrap())
        .sum();
    assert!(
        (served - sent).abs() <= sent * 0.01,
        "replicas served {served}, load sent {sent}: {workloads:?}"
    );
}

#[test]
fn stat_names_a_missing_state_file() {
    let (ok, out) = run_tether(&["stat", "--state", "/nonexistent/tether-up.json"]);
    assert!(!ok);
    assert!(
        out.contains("/nonexistent/tether-up.json") && out.contains("tether up"),
        "{out}"
    );
}

/// A child process killed (and reaped) when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An instant query against Prometheus's HTTP API.
fn promql(addr: SocketAddr, query: &str) -> serde_json::Value {
    use std::io::{Read, Write};
    let encoded: String = query
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET /api/v1/query?query={encoded} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut rsp = String::new();
    s.read_to_string(&mut rsp).unwrap();
    let body = rsp.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or(serde_json::Value::Null)
}

fn scalar(v: &serde_json::Value) -> f64 {
    v["data"]["result"][0]["value"][1]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(-1.0)
}

#[test]
fn stat_asks_a_real_prometheus() {
    let prometheus = installed(&["prometheus"], "prometheus");
    let mesh = LocalMesh::start(MANIFEST, &[]);
    let dir = tempfile::tempdir().unwrap();
    let targets = tether_viz::state::MeshState::targets_path(&mesh.state_path);
    // The shipped configuration, pointed at this mesh's targets file and
    // scraping fast enough for a test.
    let config = include_str!("../../deploy/prometheus/tether-up.yml")
        .replace("/tmp/tether-up.targets.json", targets.to_str().unwrap())
        .replace("scrape_interval: 10s", "scrape_interval: 1s")
        .replace("refresh_interval: 5s", "refresh_interval: 1s");
    let config_path = dir.path().join("prometheus.yml");
    std::fs::write(&config_path, config).unwrap();
    let addr = free_port();
    let server = Command::new(prometheus)
        .arg(format!("--config.file={}", config_path.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Killed however the test ends: a failed assertion left Prometheus
    // running.
    let server = KillOnDrop(server);
    let wait = |what: &str, check: &dyn Fn() -> bool| {
        // Bounded by many scrape intervals (1 s) and file_sd refreshes.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !check() {
            assert!(std::time::Instant::now() < deadline, "Prometheus: {what}");
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    };
    wait("every proxy scraped", &|| {
        std::net::TcpStream::connect(addr).is_ok()
            && scalar(&promql(addr, "sum(up{job=\"tether-proxy\"})")) == 4.0
    });

    let authority = format!("web.demo.svc.{}:8080", mesh.state.cluster_domain);
    let counted = format!(
        "sum(tether_proxy_requests_total{{direction=\"outbound\",authority=\"{authority}\"}})"
    );
    // increase() takes a series' first scrape as its baseline: requests made
    // before it are not counted (CI once saw 274 of 400). A few warm-up
    // requests create the series, and it is scraped for a while before the
    // measured load, so the extrapolation at the window's start stays small.
    let warm_up = mesh.load_at(&authority, 5, 1)["sent"].as_f64().unwrap();
    wait("the warm-up scraped", &|| {
        scalar(&promql(addr, &counted)) == warm_up
    });
    std::thread::sleep(std::time::Duration::from_secs(10));
    let report = mesh.load(&authority);
    let sent = report["sent"].as_f64().unwrap();
    wait("the whole load scraped", &|| {
        scalar(&promql(addr, &counted)) == warm_up + sent
    });

    let url = format!("http://{addr}");
    let (ok, out) = run_tether(&["stat", "--prometheus", &url, "--window", "60", "-o", "json"]);
    drop(server);
    assert!(ok, "{out}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let web = rows
        .iter()
        .find(|r| r["name"] == authority.as_str())
        .unwrap_or_else(|| panic!("no row for {authority}: {out}"));
    // increase() extrapolates at the window's edges: close, not exact.
    let requests = web["requests"].as_f64().unwrap();
    assert!(
        (requests - sent).abs() <= sent * 0.25,
        "Prometheus {requests}, load {sent}: {web}"
    );
    assert_eq!(web["success_rate"], 1.0, "{web}");
    assert_eq!(web["mtls"], 1.0, "{web}");
    assert!(web["p99_ms"].as_f64().is_some(), "{web}");
}
