//! Requests the proxy cannot route get a clear error at once, not a hang.

use std::time::{Duration, Instant};

use crate::support::*;

#[tokio::test]
async fn unknown_authority_is_answered_at_once() {
    let mesh = Mesh::start(&[0]).await;
    let started = Instant::now();
    let a = get(mesh.outbound(), &authority("nope", 80)).await;
    assert_eq!(a.status, 503);
    assert_eq!(
        a.proxy_error(),
        Some("unknown service nope.test.svc.cluster.local:80")
    );
    // Well before the 3 s fail-fast timeout: the control plane said no.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );

    let a = get(mesh.outbound(), "localhost:9").await;
    assert_eq!(a.status, 503);
    assert!(
        a.proxy_error().unwrap().starts_with("unknown service"),
        "{:?}",
        a.proxy_error()
    );

    // gRPC callers get a gRPC status.
    let channel = tether_mesh_up::demo_grpc::channel(mesh.outbound(), &authority("nope", 80))
        .await
        .unwrap();
    let status = tether_mesh_up::demo_grpc::hello(channel, "x")
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(
        status.message().contains("unknown service"),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn unreachable_control_plane_is_named() {
    let scratch = Scratch::new();
    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let client = scratch
        .proxy("client", closed, None, &["--failfast-timeout", "30"])
        .await;
    let started = Instant::now();
    let a = get(client.addr("outbound"), &authority("web", 80)).await;
    assert_eq!(a.status, 503);
    assert_eq!(a.proxy_error(), Some("control plane unreachable"));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn service_without_endpoints_fails_fast_after_timeout() {
    let scratch = Scratch::new();
    scratch.service("web", 80, false);
    let control = scratch.control().await;
    let client = scratch
        .proxy(
            "client",
            control.addr("grpc"),
            None,
            &["--failfast-timeout", "0.5"],
        )
        .await;
    let a = get(client.addr("outbound"), &authority("web", 80)).await;
    assert_eq!(a.status, 503);
    assert_eq!(a.proxy_error(), Some("service in fail-fast"));
}
