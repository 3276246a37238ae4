//! `tether diagnostics` against two replicas, one of which differs.

use crate::support::*;

fn diagnostics(args: &[&str]) -> (bool, String) {
    run_tether(&[&["diagnostics"], args].concat())
}

#[tokio::test]
async fn diagnostics_compare_replicas_and_the_registry() {
    let a = Scratch::new();
    let b = Scratch::new();
    for s in [&a, &b] {
        s.service("web", 80, false);
        s.endpoint("web-0", "web", "127.0.0.1:1001".parse().unwrap(), true);
    }
    // Replica B's registry has one endpoint more.
    b.endpoint("web-1", "web", "127.0.0.1:1002".parse().unwrap(), true);
    let ca = a.control().await;
    let cb = b.control().await;
    let (ga, gb) = (ca.addr("grpc").to_string(), cb.addr("grpc").to_string());
    let registry = a.registry().display().to_string();
    let web = authority("web", 80);

    let (ok, out) = diagnostics(&["endpoints", &web, "--control", &ga, "--registry", &registry]);
    assert!(ok, "{out}");
    assert!(
        out.contains("127.0.0.1:1001") && out.contains("all 2 views agree"),
        "{out}"
    );

    let (ok, out) = diagnostics(&[
        "endpoints",
        &web,
        "--control",
        &ga,
        "--control",
        &gb,
        "--registry",
        &registry,
    ]);
    assert!(!ok, "differing replicas must fail the command:\n{out}");
    assert!(
        out.contains(&format!("127.0.0.1:1002: served by replica {gb}")),
        "the difference is not named:\n{out}"
    );

    let (ok, out) = diagnostics(&["controller-metrics", "--control", &ga, "--control", &gb]);
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!("=== replica {ga}")) && out.contains(&format!("=== replica {gb}")),
        "{out}"
    );
    assert!(out.contains("tether_destination_subscribers"), "{out}");

    let (ok, out) = diagnostics(&["controller-metrics", "--control", "127.0.0.1:1"]);
    assert!(!ok, "{out}");

    // The audit, on demand.
    let (status, body) = tether_mesh_up::stats::http_get(ca.addr("admin"), "/audit")
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert!(body.contains("0 divergent"), "{body}");
    let m = metrics(ca.addr("admin")).await;
    assert_eq!(
        metric_value(&m, "tether_destination_divergent_subscriptions", &[]),
        0.0
    );
    assert!(metric_value(&m, "tether_destination_audits_total", &[]) >= 1.0);
}
