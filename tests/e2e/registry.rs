//! Bad registry input is reported by file and field, and loses nothing.

use std::path::Path;
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
            "--insecure-control-plane",
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

/// Resident memory of a process, in bytes.
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kib * 1024
}

/// A 50 MB registry file is refused by its size (not read, not echoed);
/// a smaller one with a 1 MiB value is refused with the value cut short,
/// in the log and in `tether diagnostics`; the last good state is served
/// throughout, and the control plane keeps no big buffers.
#[tokio::test]
async fn huge_registry_values_are_refused_and_never_echoed_whole() {
    let mesh = Mesh::start(&[0]).await;
    let web = authority("web", 8080);
    assert_eq!(get(mesh.outbound(), &web).await.status, 200);
    let admin = mesh.control.addr("admin");
    let pid = mesh.control.pid().unwrap();
    let rss_before = rss_bytes(pid);
    let errors = || async {
        metric_value(
            &metrics(admin).await,
            "tether_registry_reload_errors_total",
            &[],
        )
    };

    let huge = "a".repeat(50 << 20);
    let file = format!(
        "kind: Endpoints\nservice: web\nnamespace: test\nendpoints: [{{address: 127.0.0.1:1, identity: {huge}}}]\n"
    );
    mesh.scratch.write("web-0.yaml", &file);
    assert!(
        eventually(Duration::from_secs(10), || async { errors().await >= 1.0 }).await,
        "the oversized file was not refused"
    );
    let log = mesh.scratch.read_log("control");
    assert!(
        log.contains("web-0.yaml")
            && log.contains(&format!("{} bytes", file.len()))
            && log.contains("over the limit of 4194304 bytes"),
        "{}",
        &log[log.len().saturating_sub(4096)..]
    );

    // Under the limit, with a 1 MiB value: parsed, refused, cut short.
    let value = "b".repeat(1 << 20);
    mesh.scratch.write(
        "web-0.yaml",
        &format!(
            "kind: Endpoints\nservice: web\nnamespace: test\nendpoints: [{{address: 127.0.0.1:1, identity: {value}}}]\n"
        ),
    );
    assert!(
        eventually(Duration::from_secs(10), || async { errors().await >= 2.0 }).await,
        "the file with a huge value was not refused"
    );
    let log = mesh.scratch.read_log("control");
    assert!(
        log.contains("(1048576 bytes)"),
        "{}",
        &log[log.len().saturating_sub(4096)..]
    );
    assert!(log.len() < 64 << 10, "the log holds {} bytes", log.len());

    let registry = mesh.scratch.registry().display().to_string();
    let control = mesh.control.addr("grpc").to_string();
    let (_, out) = run_tether(&[
        "diagnostics",
        "endpoints",
        &web,
        "--control",
        &control,
        "--registry",
        &registry,
    ]);
    assert!(
        out.contains("(1048576 bytes)") && out.len() < 8 << 10,
        "{} bytes: {}",
        out.len(),
        &out[..out.len().min(4096)]
    );

    // The last good state is still served, and nothing big was kept.
    for _ in 0..5 {
        assert_eq!(get(mesh.outbound(), &web).await.status, 200);
    }
    let grown = rss_bytes(pid).saturating_sub(rss_before);
    assert!(grown < 16 << 20, "the control plane grew by {grown} bytes");
}

/// Builds, or updates, a Kubernetes ConfigMap mount in `dir` the way
/// kubelet does: files in a new timestamped directory, `..data` swapped to
/// it atomically, one top-level link per key through `..data`.
fn configmap(dir: &Path, version: u32, files: &[(&str, String)]) {
    use std::os::unix::fs::symlink;
    let stamped = format!("..2026_01_01_00_00_{version:02}.{version}");
    std::fs::create_dir(dir.join(&stamped)).unwrap();
    for (name, text) in files {
        std::fs::write(dir.join(&stamped).join(name), text).unwrap();
    }
    let old = std::fs::read_link(dir.join("..data")).ok();
    symlink(&stamped, dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
    for (name, _) in files {
        if std::fs::symlink_metadata(dir.join(name)).is_err() {
            symlink(format!("..data/{name}"), dir.join(name)).unwrap();
        }
    }
    if let Some(old) = old {
        std::fs::remove_dir_all(dir.join(old)).unwrap();
    }
}

fn web_service(endpoint: &str) -> String {
    format!(
        "kind: Service\nname: web\nnamespace: test\nports: [{{port: 80}}]\nendpoints: [{{address: {endpoint}}}]\n"
    )
}

/// `tether diagnostics endpoints` over both replicas and the registry:
/// whether all agree, and the output.
fn compare(authority: &str, a: &Process, b: Option<&Process>, registry: &Path) -> (bool, String) {
    let (a, b) = (
        a.addr("grpc").to_string(),
        b.map(|b| b.addr("grpc").to_string()),
    );
    let registry = registry.display().to_string();
    let mut args = vec![
        "diagnostics",
        "endpoints",
        authority,
        "--control",
        &a,
        "--registry",
        &registry,
    ];
    if let Some(b) = &b {
        args.extend(["--control", b.as_str()]);
    }
    run_tether(&args)
}

/// Replicas started before and after registry changes made of symlinks
/// (a ConfigMap mount, a link to a file elsewhere) and of duplicate
/// definitions serve the same thing, and what the registry says.
#[tokio::test]
async fn replicas_agree_on_symlinked_and_duplicated_files() {
    let scratch = Scratch::new();
    let registry = scratch.registry();
    configmap(&registry, 1, &[("web.yaml", web_service("127.0.0.1:1001"))]);
    // A later path defining web too: ignored.
    scratch.write("zz-web.yaml", &web_service("127.0.0.1:1002"));
    let a = scratch.control_at("control-a", "127.0.0.1:0", &[]).await;
    let web = authority("web", 80);
    let api = authority("api", 80);

    // While A runs: a link to a file elsewhere, and an earlier path
    // defining web.
    let elsewhere = scratch.dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::write(
        elsewhere.join("api.txt"),
        "kind: Service\nname: api\nnamespace: test\nports: [{port: 80}]\nendpoints: [{address: 127.0.0.1:2001}]\n",
    )
    .unwrap();
    std::os::unix::fs::symlink(elsewhere.join("api.txt"), registry.join("api.yaml")).unwrap();
    scratch.write("aa-web.yaml", &web_service("127.0.0.1:1003"));
    // The rescan interval bounds how late A may see them.
    let settle = Duration::from_secs(2 * 5 + 5);
    assert!(
        eventually(settle, || async {
            let (ok, out) = compare(&web, &a, None, &registry);
            ok && out.contains("127.0.0.1:1003") && !out.contains("127.0.0.1:1001")
        })
        .await,
        "{}",
        compare(&web, &a, None, &registry).1
    );

    let b = scratch.control_at("control-b", "127.0.0.1:0", &[]).await;
    for (authority, endpoint) in [(&web, "127.0.0.1:1003"), (&api, "127.0.0.1:2001")] {
        let (ok, out) = compare(authority, &a, Some(&b), &registry);
        assert!(
            ok && out.contains(endpoint) && out.contains("all 3 views agree"),
            "{out}"
        );
    }
    let (_, out) = compare(&web, &a, Some(&b), &registry);
    assert!(
        out.contains("zz-web.yaml") && out.contains("aa-web.yaml") && out.contains("test/web"),
        "the duplicate is not reported:\n{out}"
    );

    // The winning file goes: the ConfigMap's definition (first of the
    // rest) takes over; then the ConfigMap is updated in place.
    scratch.remove("aa-web.yaml");
    assert!(
        eventually(settle, || async {
            let (ok, out) = compare(&web, &a, Some(&b), &registry);
            ok && out.contains("127.0.0.1:1001")
        })
        .await,
        "{}",
        compare(&web, &a, Some(&b), &registry).1
    );
    configmap(&registry, 2, &[("web.yaml", web_service("127.0.0.1:1004"))]);
    assert!(
        eventually(settle, || async {
            let (ok, out) = compare(&web, &a, Some(&b), &registry);
            ok && out.contains("127.0.0.1:1004")
        })
        .await,
        "{}",
        compare(&web, &a, Some(&b), &registry).1
    );
    let log = scratch.read_log("control-b");
    assert!(!log.contains("rejected: "), "{log}");
}
