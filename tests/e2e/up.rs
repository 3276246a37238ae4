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
