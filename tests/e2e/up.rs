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

#[test]
fn multicluster_demo_fails_over_and_back_without_failures() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mc.yaml");
    let manifest = tether_mesh_up::manifest::MULTICLUSTER_DEMO
        .replace("at: 4", "at: 2")
        .replace("at: 8", "at: 4");
    std::fs::write(&path, manifest).unwrap();
    let out = std::process::Command::new(tether())
        .args([
            "up",
            path.to_str().unwrap(),
            "--duration",
            "6",
            "--interval",
            "60",
            "--json",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json = stdout
        .lines()
        .find_map(|l| l.strip_prefix("summary-json "))
        .expect("a JSON summary");
    let report: serde_json::Value = serde_json::from_str(json).unwrap();
    let replicas = report["replicas"].as_object().unwrap();
    let served_by = |prefix: &str| {
        replicas
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v.as_u64().unwrap())
            .sum::<u64>()
    };
    assert!(
        served_by("west-") > 0,
        "never failed over to west: {report}"
    );
    assert!(served_by("east-") > 0, "east never served: {report}");
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
