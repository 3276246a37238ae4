//! `tether check`: a healthy mesh passes; each broken piece fails with a hint.

use crate::support::*;

fn check(args: &[&str]) -> (bool, String) {
    run_tether(&[&["check"], args].concat())
}

#[tokio::test]
async fn check_passes_a_healthy_mesh_and_names_what_is_broken() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    scratch.service("web", 8080, false);
    let ca_s = ca.display().to_string();
    let control = scratch.control_with_identity("control", &ca, "3600").await;
    let app = scratch.demo_app("web-0", 0).await;
    let args = scratch.identity_args(&ca, "web.test.serviceaccount.identity.cluster.local", &ca);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let sidecar = scratch
        .proxy(
            "server",
            control.addr("grpc"),
            Some(app.addr("http")),
            &args,
        )
        .await;
    scratch.endpoint("web-0", "web", sidecar.addr("inbound"), true);
    let admin = sidecar.addr("admin");
    assert!(
        eventually(std::time::Duration::from_secs(10), || async {
            ready_body(admin).await.0 == 200
        })
        .await
    );
    let (grpc, registry, admin) = (
        control.addr("grpc").to_string(),
        scratch.registry().display().to_string(),
        admin.to_string(),
    );

    let (ok, out) = check(&[
        "--control",
        &grpc,
        "--proxy",
        &admin,
        "--identity",
        &ca_s,
        "--registry",
        &registry,
    ]);
    assert!(ok, "{out}");
    for expected in [
        "✔ control plane",
        "every replica serves what the registry says",
        "✔ trust root (ca.crt): valid",
        "✔ issuer (issuer.crt): valid",
        &format!("✔ proxy {admin} is ready"),
        "certificate valid for",
        "0 failed",
    ] {
        assert!(out.contains(expected), "missing {expected:?} in:\n{out}");
    }

    // A second replica over another registry disagrees.
    let other = Scratch::new();
    other.service("web", 8080, false);
    let other_control = other.control_with_identity("control", &ca, "3600").await;
    let other_grpc = other_control.addr("grpc").to_string();
    let (ok, out) = check(&[
        "--control",
        &grpc,
        "--control",
        &other_grpc,
        "--identity",
        &ca_s,
    ]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("✘ replicas disagree") && out.contains("hint: compare them"),
        "{out}"
    );

    // An unreachable control plane and a proxy that is not ready.
    let lonely = scratch.proxy("lonely", free_port(), None, &args).await;
    let (ok, out) = check(&[
        "--control",
        &free_port().to_string(),
        "--proxy",
        &lonely.addr("admin").to_string(),
    ]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("✘ control plane") && out.contains("hint: is `tether control` running"),
        "{out}"
    );
    assert!(
        out.contains("is not ready: not ready: waiting for certificate"),
        "{out}"
    );
}
