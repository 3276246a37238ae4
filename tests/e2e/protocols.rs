//! Requests through outbound proxy → inbound proxy → app, for every
//! protocol the app may speak.

use http::Version;
use tether_mesh_up::demo_grpc;

use crate::support::*;

#[tokio::test]
async fn http1_http2_and_grpc_cross_two_proxies() {
    let mesh = Mesh::start(&[0]).await;
    let web = authority("web", 8080);

    let h1 = request(mesh.outbound(), &web, "/hello?x=1", Version::HTTP_11)
        .await
        .unwrap();
    assert_eq!(h1.status, 200, "{}", h1.body);
    assert_eq!(h1.replica(), "web-0");
    let body: serde_json::Value = serde_json::from_str(&h1.body).unwrap();
    assert_eq!(body["path"], "/hello");
    // Carried over HTTP/2 between proxies, handed to the app as HTTP/1.1.
    assert_eq!(body["version"], "HTTP/1.1");

    let h2 = request(mesh.outbound(), &web, "/", Version::HTTP_2)
        .await
        .unwrap();
    assert_eq!(h2.status, 200, "{}", h2.body);
    assert_eq!(h2.version, Version::HTTP_2);
    let body: serde_json::Value = serde_json::from_str(&h2.body).unwrap();
    assert_eq!(body["version"], "HTTP/2.0");

    let channel = demo_grpc::channel(mesh.outbound(), &web).await.unwrap();
    let reply = demo_grpc::hello(channel.clone(), "mesh").await.unwrap();
    assert_eq!(reply.message, "hello, mesh");
    assert_eq!(reply.replica, "web-0");

    let replies = demo_grpc::count(channel, 5).await.unwrap();
    assert_eq!(
        replies.iter().map(|r| r.seq).collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5]
    );

    // Both proxies counted the requests.
    let client = metrics(mesh.client.addr("admin")).await;
    assert!(
        metric_value(
            &client,
            "tether_proxy_requests_total",
            &[
                ("direction", "outbound"),
                ("authority", &web),
                ("status_class", "2xx")
            ]
        ) >= 4.0,
        "{client}"
    );
    let server = metrics(mesh.sidecars[0].addr("admin")).await;
    assert!(
        metric_value(
            &server,
            "tether_proxy_requests_total",
            &[("direction", "inbound")]
        ) >= 4.0,
        "{server}"
    );
}

#[tokio::test]
async fn absolute_form_uri_names_the_service() {
    let mesh = Mesh::start(&[0]).await;
    let stream = tokio::net::TcpStream::connect(mesh.outbound())
        .await
        .unwrap();
    let (mut s, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get(format!("http://{}/abs", authority("web", 8080)))
        .header(http::header::HOST, "ignored.example:1")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let rsp = s.send_request(req).await.unwrap();
    assert_eq!(rsp.status(), 200);
    assert_eq!(rsp.headers()["tether-demo-replica"], "web-0");
}

#[tokio::test]
async fn opaque_ports_forward_raw_tcp() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let scratch = Scratch::new();
    scratch.service("db", 5432, true);
    let echo_addr = echo_server().await;
    let control = scratch.control().await;
    let server = scratch
        .proxy(
            "db-proxy",
            control.addr("grpc"),
            Some(echo_addr),
            &["--inbound-opaque"],
        )
        .await;
    scratch.endpoint("db-0", "db", server.addr("inbound"), true);
    let upstream = format!("127.0.0.1:0={}", authority("db", 5432));
    let client = scratch
        .spawn(
            "client",
            &[
                "proxy",
                "--control",
                &control.addr("grpc").to_string(),
                "--outbound",
                "127.0.0.1:0",
                "--admin",
                "127.0.0.1:0",
                "--upstream",
                &upstream,
            ],
            &["outbound", "admin", "upstream"],
        )
        .await;
    let mut conn = tokio::net::TcpStream::connect(client.addr("upstream"))
        .await
        .unwrap();
    conn.write_all(b"\x00\x01binary ping\r\n").await.unwrap();
    let mut buf = vec![0u8; 15];
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        conn.read_exact(&mut buf),
    )
    .await
    .expect("echo within 10s")
    .unwrap();
    assert_eq!(&buf, b"\x00\x01binary ping\r\n");
    // Bytes are counted when the connection ends.
    drop(conn);
    let admin = server.addr("admin");
    assert!(
        eventually(std::time::Duration::from_secs(5), || async {
            metric_value(
                &metrics(admin).await,
                "tether_proxy_tcp_bytes_total",
                &[("direction", "inbound")],
            ) >= 30.0
        })
        .await
    );
}

#[tokio::test]
async fn grpc_errors_in_trailers_are_counted_as_failures() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let control = scratch.control().await;
    let app = scratch
        .spawn(
            "web-0",
            &[
                "demo-app",
                "--listen",
                "127.0.0.1:0",
                "--replica",
                "web-0",
                "--error-rate",
                "1",
            ],
            &["http"],
        )
        .await;
    let sidecar = scratch
        .proxy("server", control.addr("grpc"), Some(app.addr("http")), &[])
        .await;
    scratch.endpoint("web-0", "web", sidecar.addr("inbound"), true);
    let client = scratch
        .proxy("client", control.addr("grpc"), None, &[])
        .await;
    let web = authority("web", 8080);
    let channel = demo_grpc::channel(client.addr("outbound"), &web)
        .await
        .unwrap();
    for _ in 0..3 {
        let status = demo_grpc::hello(channel.clone(), "x").await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Internal);
    }
    for (proxy, direction) in [(&client, "outbound"), (&sidecar, "inbound")] {
        let admin = proxy.addr("admin");
        assert!(
            eventually(std::time::Duration::from_secs(5), || async {
                metric_value(
                    &metrics(admin).await,
                    "tether_proxy_requests_total",
                    &[("direction", direction), ("status_class", "grpc_error")],
                ) >= 3.0
            })
            .await,
            "{direction}: gRPC errors not counted as failures:\n{}",
            metrics(admin).await
        );
    }
}
