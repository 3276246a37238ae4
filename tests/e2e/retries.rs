//! Retries: idempotent requests that the mesh failed before the app saw
//! them go to another endpoint, within a budget that the registry can
//! override per service.

use std::time::Duration;

use crate::support::*;

/// A service with one healthy replica and one whose app is dead (its
/// sidecar answers 502 `app unreachable`).
async fn half_dead(
    extra_client_args: &[&str],
    service_extra: &str,
) -> (Scratch, Vec<Process>, Process) {
    let scratch = Scratch::new();
    scratch.write(
        "web.yaml",
        &format!(
            "kind: Service\nname: web\nnamespace: test\nports: [{{port: 8080}}]\n{service_extra}"
        ),
    );
    let control = scratch.control().await;
    let app = scratch.demo_app("web-0", 0).await;
    let good = scratch
        .proxy("good", control.addr("grpc"), Some(app.addr("http")), &[])
        .await;
    let bad = scratch
        .proxy("bad", control.addr("grpc"), Some(free_port()), &[])
        .await;
    scratch.endpoint("web-0", "web", good.addr("inbound"), true);
    scratch.endpoint("web-1", "web", bad.addr("inbound"), true);
    let client = scratch
        .proxy("client", control.addr("grpc"), None, extra_client_args)
        .await;
    let outbound = client.addr("outbound");
    let web = authority("web", 8080);
    assert!(
        eventually(Duration::from_secs(5), || async {
            get(outbound, &web).await.status == 200
        })
        .await
    );
    (scratch, vec![control, app, good, bad], client)
}

async fn post(connect: std::net::SocketAddr, authority: &str) -> u16 {
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(connect).await.unwrap();
    let (mut s, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::post("/")
        .header(http::header::HOST, authority)
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            b"payload",
        )))
        .unwrap();
    let rsp = s.send_request(req).await.unwrap();
    let status = rsp.status().as_u16();
    let _ = rsp.into_body().collect().await;
    status
}

#[tokio::test]
async fn idempotent_requests_are_retried_on_another_endpoint() {
    let (_scratch, _procs, client) = half_dead(&[], "").await;
    let (outbound, web) = (client.addr("outbound"), authority("web", 8080));
    for i in 0..40 {
        let a = get(outbound, &web).await;
        assert_eq!(a.status, 200, "GET {i} failed: {:?}", a.proxy_error());
        assert_eq!(a.replica(), "web-0");
    }
    let m = metrics(client.addr("admin")).await;
    assert!(
        metric_value(&m, "tether_proxy_retries_total", &[("outcome", "retried")]) >= 1.0,
        "{m}"
    );
    // A POST is not idempotent: never retried, so some fail.
    let mut failed = 0;
    for _ in 0..40 {
        if post(outbound, &web).await != 200 {
            failed += 1;
        }
    }
    assert!(failed > 0, "a POST was retried");
}

#[tokio::test]
async fn a_spent_budget_stops_retries() {
    let (_scratch, _procs, client) = half_dead(
        &[
            "--retry-budget-ratio",
            "0",
            "--retry-budget-min-per-second",
            "0",
        ],
        "",
    )
    .await;
    let (outbound, web) = (client.addr("outbound"), authority("web", 8080));
    let mut failed = 0;
    for _ in 0..40 {
        if get(outbound, &web).await.status != 200 {
            failed += 1;
        }
    }
    assert!(failed > 0, "retries happened with an empty budget");
    let m = metrics(client.addr("admin")).await;
    assert!(
        metric_value(
            &m,
            "tether_proxy_retries_total",
            &[("outcome", "budget_exhausted")]
        ) >= 1.0,
        "{m}"
    );
    assert_eq!(
        metric_value(&m, "tether_proxy_retries_total", &[("outcome", "retried")]),
        0.0,
        "{m}"
    );
}

#[tokio::test]
async fn the_registry_overrides_the_budget_per_service() {
    // Generous proxy default, but the service allows no retries.
    let (_scratch, _procs, client) =
        half_dead(&[], "retry_budget: {ratio: 0, min_per_second: 0}\n").await;
    let (outbound, web) = (client.addr("outbound"), authority("web", 8080));
    let admin = client.addr("admin");
    assert!(
        eventually(Duration::from_secs(10), || async {
            get(outbound, &web).await;
            metric_value(
                &metrics(admin).await,
                "tether_proxy_retries_total",
                &[("outcome", "budget_exhausted")],
            ) >= 1.0
        })
        .await,
        "the per-service budget was not applied"
    );
}
