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

#[tokio::test]
async fn a_request_without_host_is_a_bad_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let scratch = Scratch::new();
    let control = scratch.control().await;
    let client = scratch
        .proxy("client", control.addr("grpc"), None, &[])
        .await;
    let mut conn = tokio::net::TcpStream::connect(client.addr("outbound"))
        .await
        .unwrap();
    // HTTP/1.0 has no mandatory Host; the origin-form URI names no target.
    conn.write_all(b"GET /x HTTP/1.0\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        conn.read_to_end(&mut answer),
    )
    .await
    .expect("no answer")
    .unwrap();
    let answer = String::from_utf8_lossy(&answer).to_lowercase();
    assert!(answer.starts_with("http/1.0 400"), "{answer}");
    assert!(
        answer.contains("tether-proxy-error: request names no target"),
        "{answer}"
    );
}
