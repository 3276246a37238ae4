//! `tether up` runs the whole demo mesh and reports real traffic.

use crate::support::*;

#[test]
fn headless_demo_reports_successful_traffic() {
    let out = std::process::Command::new(tether())
        .args(["up", "--duration", "4", "--interval", "1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("live traffic"), "{stdout}");
    // The sidecars run the proxy-only binary when it is built beside
    // `tether` (`cargo test --workspace` builds it), and say so.
    let proxies = if tether().with_file_name("tether-proxy").is_file() {
        "proxies:  tether-proxy ("
    } else {
        "proxies:  tether proxy ("
    };
    assert!(stdout.contains(proxies), "{stdout}");
    let total = stdout
        .lines()
        .find(|l| l.contains("total: requests sent"))
        .expect("summary line");
    let succeeded: u64 = total
        .split("succeeded ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .and_then(|s| s.trim().parse().ok())
        .unwrap();
    assert!(succeeded > 50, "{total}");
}

#[test]
fn bad_manifest_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.yaml");
    std::fs::write(&path, "services:\n  - name: web\n    replicas: 0\n").unwrap();
    let out = std::process::Command::new(tether())
        .args(["up", path.to_str().unwrap(), "--duration", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("services[0].replicas"), "{err}");
}

/// Runs `tether up MANIFEST` headless for `seconds`: its stdout and the
/// load generator's JSON summary.
fn run_up(manifest: &str, seconds: &str) -> (String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mesh.yaml");
    std::fs::write(&path, manifest).unwrap();
    let out = std::process::Command::new(tether())
        .args([
            "up",
            path.to_str().unwrap(),
            "--duration",
            seconds,
            "--interval",
            "60",
            "--json",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = stdout
        .lines()
        .find_map(|l| l.strip_prefix("summary-json "))
        .expect("a JSON summary");
    let report = serde_json::from_str(json).unwrap();
    (stdout, report)
}

/// Requests answered by replicas whose name starts with `prefix`.
fn served_by(report: &serde_json::Value, prefix: &str) -> u64 {
    report["replicas"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(_, v)| v.as_u64().unwrap())
        .sum()
}

#[test]
fn multicluster_demo_fails_over_and_back_without_failures() {
    let manifest = tether_mesh_up::manifest::MULTICLUSTER_DEMO
        .replace("at: 4", "at: 2")
        .replace("at: 8", "at: 4");
    let (stdout, report) = run_up(&manifest, "6");
    assert!(
        served_by(&report, "west-") > 0,
        "never failed over to west: {report}"
    );
    assert!(
        served_by(&report, "east-") > 0,
        "east never served: {report}"
    );
    assert_eq!(report["failed"], 0, "{report}");
    assert!(
        stdout.contains(">>> killed every replica of cluster east"),
        "{stdout}"
    );
    assert!(
        stdout.contains(">>> revived every replica of cluster east"),
        "{stdout}"
    );
}

/// The crash path: every east app and sidecar is SIGKILLed at once, and the
/// registry hears of it only `detect_after` later. Requests meanwhile find
/// only dead endpoints; retries wait for discovery to offer west instead of
/// failing.
///
/// At 25 requests a second: at 100, three of these meshes at once (load
/// ~15) answered in 2 s at the median, so about a hundred requests were in
/// flight at the crash, each wanting a retry at once (most likely more
/// than the default budget, a fifth of requests plus ten a second,
/// grants), and up to 119 failed, abandoned on the dead endpoints: the
/// test overloaded its own machine.
#[test]
fn a_crashed_cluster_fails_over_without_a_failed_request() {
    let manifest = r#"
retries: true
clusters:
  - name: east
    services:
      - name: web
        namespace: shop
        global_id: web-global
        mode: failover
        replicas: 2
    links:
      - cluster: west
        priority: 1
  - name: west
    services:
      - name: storefront
        namespace: retail
        global_id: web-global
        replicas: 2
load:
  - cluster: east
    service: web
    rps: 25
events:
  - at: 2
    crash: east
    detect_after: 0.5
"#;
    let (stdout, report) = run_up(manifest, "5");
    assert!(
        stdout.contains(">>> crashed every replica of cluster east"),
        "{stdout}"
    );
    assert!(
        served_by(&report, "east-") > 0,
        "east never served: {report}"
    );
    assert!(
        served_by(&report, "west-") > 0,
        "never failed over to west: {report}"
    );
    assert_eq!(report["failed"], 0, "{report}");
}
