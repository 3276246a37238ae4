//! Bad registry input is reported by file and field, and loses nothing.

use std::time::Duration;

use crate::support::*;

#[tokio::test]
async fn invalid_file_keeps_last_good_state() {
    let mesh = Mesh::start(&[0]).await;
    let web = authority("web", 8080);
    assert_eq!(get(mesh.outbound(), &web).await.status, 200);

    // Break the endpoint file: a typo in a field name.
    mesh.scratch.write(
        "web-0.yaml",
        "kind: Endpoints\nservice: web\nnamespace: test\nendpoints: [{adress: 127.0.0.1:1}]\n",
    );
    let admin = mesh.control.addr("admin");
    assert!(
        eventually(Duration::from_secs(10), || async {
            metric_value(
                &metrics(admin).await,
                "tether_registry_reload_errors_total",
                &[],
            ) >= 1.0
        })
        .await,
        "rejection was not counted"
    );
    let log = mesh.scratch.read_log("control");
    assert!(
        log.contains("web-0.yaml") && log.contains("unknown field `adress`"),
        "{log}"
    );
    // The last good state is still served.
    for _ in 0..5 {
        assert_eq!(get(mesh.outbound(), &web).await.status, 200);
    }
    let ready = tether_mesh_up::stats::http_get(admin, "/ready")
        .await
        .unwrap();
    assert_eq!(ready.0, 200);
}

#[tokio::test]
async fn control_plane_refuses_a_missing_registry_directory() {
    let scratch = Scratch::new();
    let missing = scratch.dir.path().join("nope").display().to_string();
    let out = std::process::Command::new(tether())
        .args([
            "control",
            "--registry",
            &missing,
            "--grpc",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("registry directory") && err.contains("nope"),
        "{err}"
    );
}
