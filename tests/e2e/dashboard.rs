//! The dashboard `tether up` starts, loaded in headless Chromium against a
//! running mesh: the topology and the numbers render, and they update.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::*;

const MANIFEST: &str = "
services:
  - name: web
    replicas: 2
load:
  - service: web
    rps: 50
";

/// GET `path` from the dashboard.
fn get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut rsp = String::new();
    s.read_to_string(&mut rsp).unwrap();
    rsp.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

fn attr(dom: &str, name: &str) -> u64 {
    let start = dom
        .find(&format!("{name}=\""))
        .unwrap_or_else(|| panic!("no {name} in {dom}"));
    dom[start + name.len() + 2..]
        .split('"')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn dashboard_renders_and_updates_in_chromium() {
    let chromium = installed(&["chromium", "chromium-browser"], "chromium");
    let mesh = LocalMesh::start(MANIFEST, &[]);
    let url = mesh
        .state
        .dashboard
        .clone()
        .expect("tether up names its dashboard");
    let addr = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    // The first sample of a proxy is its baseline: wait for traffic on an edge.
    let deadline = Instant::now() + Duration::from_secs(30);
    let web = format!("web.demo.svc.{}:8080", mesh.state.cluster_domain);
    loop {
        let state: serde_json::Value = serde_json::from_str(&get(&addr, "/api/state")).unwrap();
        let edges = state["edges"].as_array().cloned().unwrap_or_default();
        if edges.iter().any(|e| e["to"] == web.as_str()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no traffic on the dashboard after 30 s: {state}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let profile = tempfile::tempdir().unwrap();
    let browse = |extra: &str| {
        Command::new(&chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--window-size=1280,1400",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args(["--virtual-time-budget=4000", extra, &url])
            .output()
            .unwrap()
    };
    let out = browse("--dump-dom");
    let dom = String::from_utf8_lossy(&out.stdout);
    // The page polls every second: after 4 s of page time it has rendered
    // several samples, each newer than the last.
    assert!(attr(&dom, "data-updates") >= 2, "{dom}");
    assert!(attr(&dom, "data-samples") >= 2, "{dom}");
    assert!(
        dom.contains(&format!("data-from=\"demo/loadgen\" data-to=\"{web}\"")),
        "{dom}"
    );
    let label = dom
        .split("class=\"edge-label\"")
        .nth(1)
        .and_then(|s| s.split('>').nth(1))
        .and_then(|s| s.split('<').next())
        .unwrap_or_else(|| panic!("no edge label in {dom}"));
    let rps: f64 = label.split(" rps").next().unwrap().parse().unwrap();
    assert!(rps > 0.0 && label.contains("100.0%"), "{label}");
    for shown in ["web-0", "web-1", "ready", "uplot", "demo/web"] {
        assert!(dom.contains(shown), "{shown} not on the page: {dom}");
    }

    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("../dashboard.png");
    let out = browse(&format!("--screenshot={}", shot.display()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(std::fs::metadata(&shot).unwrap().len() > 10_000);
}
