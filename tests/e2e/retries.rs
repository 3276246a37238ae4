//! Retries: idempotent requests that the mesh failed before the app saw
//! them go to another endpoint, within a budget that the registry can
//! override per service.

use std::time::{Duration, Instant};

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
        eventually(Duration::from_secs(10), || async {
            get(outbound, &web).await.status == 200
        })
        .await
    );
    // Both replicas in the client's balancer before a test counts what
    // happened: under load the failing one may arrive after a first
    // request already succeeded, and until it does nothing needs a retry.
    assert!(
        follows(client.addr("admin"), &web, 2, Duration::from_secs(10)).await,
        "the client never followed both replicas"
    );
    (scratch, vec![control, app, good, bad], client)
}

/// The failing replica gets requests when it is new and at each
/// probation, which passive health grants at most [`MAX_BACKOFF`] after
/// taking it out (one probe's connection may take the connect timeout
/// too): how long a test may wait for it to be tried again.
///
/// [`MAX_BACKOFF`]: tether_proxy::health::MAX_BACKOFF
fn until_probation(probations: u32) -> Instant {
    let per_probation = tether_proxy::health::MAX_BACKOFF + Duration::from_secs(1);
    Instant::now() + per_probation * probations
}

async fn post(connect: std::net::SocketAddr, authority: &str) -> u16 {
    post_with(connect, authority, b"payload".to_vec(), &[])
        .await
        .status
        .as_u16()
}

/// A POST with `body` (its length known) and extra headers.
async fn post_with(
    connect: std::net::SocketAddr,
    authority: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> Answer {
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(connect).await.unwrap();
    let (mut s, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::post("/").header(http::header::HOST, authority);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let rsp = s.send_request(req).await.unwrap();
    let (status, version, headers) = (rsp.status(), rsp.version(), rsp.headers().clone());
    let body = rsp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
        version,
    }
}

fn retried(m: &str) -> f64 {
    metric_value(m, "tether_proxy_retries_total", &[("outcome", "retried")])
}

#[tokio::test]
async fn idempotent_requests_are_retried_on_another_endpoint() {
    let (_scratch, _procs, client) = half_dead(&[], "").await;
    let (outbound, web, admin) = (
        client.addr("outbound"),
        authority("web", 8080),
        client.addr("admin"),
    );
    // Every GET succeeds; at least 40, and until one needed a retry (else
    // the test proves nothing).
    let (mut sent, mut deadline) = (0, None);
    while sent < 40 || retried(&metrics(admin).await) < 1.0 {
        if sent >= 40 {
            let deadline = *deadline.get_or_insert_with(|| until_probation(2));
            assert!(
                Instant::now() < deadline,
                "none of {sent} GETs needed a retry: {}",
                metrics(admin).await
            );
        }
        let a = get(outbound, &web).await;
        assert_eq!(a.status, 200, "GET {sent} failed: {:?}", a.proxy_error());
        assert_eq!(a.replica(), "web-0");
        sent += 1;
    }
    // A POST is not idempotent: never retried, so one fails when the
    // failing endpoint is back on probation.
    let mut failed = 0;
    let deadline = until_probation(2);
    while failed == 0 && Instant::now() < deadline {
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

/// `tether-retryable: true` makes a POST retryable when its body is at most
/// 64 KiB (the proxy keeps it to send again); a larger one is not retried.
#[tokio::test]
async fn marked_requests_are_retried_with_their_body_up_to_64_kib() {
    let (_scratch, _procs, client) = half_dead(&[], "").await;
    let (outbound, web, admin) = (
        client.addr("outbound"),
        authority("web", 8080),
        client.addr("admin"),
    );
    let marked = [("tether-retryable", "true")];
    const MAX: usize = 64 * 1024;
    // At least 40, and until one needed a retry (else the test proves
    // nothing).
    let (mut sent, mut deadline) = (0, None);
    while sent < 40 || retried(&metrics(admin).await) < 1.0 {
        if sent >= 40 {
            let deadline = *deadline.get_or_insert_with(|| until_probation(2));
            assert!(
                Instant::now() < deadline,
                "none of {sent} POSTs needed a retry: {}",
                metrics(admin).await
            );
        }
        let a = post_with(outbound, &web, vec![b'x'; MAX], &marked).await;
        assert_eq!(a.status, 200, "POST {sent} failed: {:?}", a.proxy_error());
        let body: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        assert_eq!(
            body["received_bytes"], MAX,
            "POST {sent}: the body was not replayed whole"
        );
        sent += 1;
    }
    let before = retried(&metrics(admin).await);

    // One byte more: not kept, so not retried; failures reach the client.
    // Passive health keeps the failing endpoint out between probes, which
    // come at a doubling backoff: a failure reaches the client at each
    // probation.
    let mut failed = 0;
    let deadline = until_probation(4);
    while Instant::now() < deadline {
        if post_with(outbound, &web, vec![b'x'; MAX + 1], &marked)
            .await
            .status
            != 200
        {
            failed += 1;
            if failed == 3 {
                break;
            }
        }
    }
    assert_eq!(failed, 3, "a POST over 64 KiB was retried");
    assert_eq!(retried(&metrics(admin).await), before);
}

/// A 5xx the app itself answered reached the app: never retried, even for
/// an idempotent request.
#[tokio::test]
async fn an_apps_own_5xx_is_never_retried() {
    // The healthy replica answers after a second, the failing one at once,
    // so the balancer sends nearly every request to the failing one; had
    // its 500s been retried, the healthy one would have answered them.
    // With both fast, the failing replica's first answer (a new connection
    // on each hop) was slower than the healthy one's later ones under load,
    // and peak-EWMA kept it out for seconds: one 500 in 200 requests.
    const HEALTHY_MS: u32 = 1000;
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let control = scratch.control().await;
    let good = scratch.demo_app("web-0", HEALTHY_MS).await;
    let failing = scratch
        .spawn(
            "web-1",
            &[
                "demo-app",
                "--listen",
                "127.0.0.1:0",
                "--replica",
                "web-1",
                "--error-rate",
                "1",
            ],
            &["http"],
        )
        .await;
    let mut sidecars = Vec::new();
    for (name, app) in [("web-0", &good), ("web-1", &failing)] {
        let sidecar = scratch
            .proxy(
                &format!("{name}-proxy"),
                control.addr("grpc"),
                Some(app.addr("http")),
                &[],
            )
            .await;
        scratch.endpoint(name, "web", sidecar.addr("inbound"), true);
        sidecars.push(sidecar);
    }
    let client = scratch
        .proxy("client", control.addr("grpc"), None, &[])
        .await;
    let (outbound, web, admin) = (
        client.addr("outbound"),
        authority("web", 8080),
        client.addr("admin"),
    );
    // Both replicas in the balancer before counting: until then every
    // request may go to the healthy one.
    get(outbound, &web).await;
    assert!(
        follows(admin, &web, 2, Duration::from_secs(10)).await,
        "the client never followed both replicas"
    );
    // The healthy replica gets a request while the failing one's estimate
    // is still its starting one (and one each time that ties); more mean
    // the 500s went there as retries.
    const HEALTHY_ANSWERS: usize = 5;
    let (mut app_errors, mut healthy) = (0, 0);
    while app_errors < 3 {
        let a = get(outbound, &web).await;
        if a.status == 500 {
            assert_eq!(a.replica(), "web-1");
            assert_eq!(a.proxy_error(), None, "the app's answer, not the proxy's");
            app_errors += 1;
        } else {
            assert_eq!(a.status, 200, "{:?}", a.proxy_error());
            healthy += 1;
            assert!(
                healthy <= HEALTHY_ANSWERS,
                "the app's 500s were retried away: {healthy} answers from web-0, {app_errors} 500s"
            );
        }
    }
    assert_eq!(retried(&metrics(admin).await), 0.0);
}

#[tokio::test]
async fn the_default_budget_is_a_fifth_of_requests_plus_ten_a_second() {
    // Every replica's app is dead: each request fails before an app sees
    // it, and could be retried twice (on the two other replicas). The
    // default budget (ratio 0.2, 10/s over 10 s) allows 0.2 × requests +
    // 100 retries in the window; a retry with nowhere to go costs nothing.
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let control = scratch.control().await;
    let mut sidecars = Vec::new();
    for i in 0..3 {
        let dead = scratch
            .proxy(
                &format!("dead-{i}"),
                control.addr("grpc"),
                Some(free_port()),
                &[],
            )
            .await;
        scratch.endpoint(&format!("web-{i}"), "web", dead.addr("inbound"), true);
        sidecars.push(dead);
    }
    // A short fail-fast timeout: a request whose retries are spent on every
    // endpoint waits that long for discovery to offer another.
    let client = scratch
        .proxy(
            "client",
            control.addr("grpc"),
            None,
            &["--failfast-timeout", "0.05"],
        )
        .await;
    let (outbound, web) = (client.addr("outbound"), authority("web", 8080));
    // The window starts with the first request the budget counts, which
    // may be one of these: time is measured from before them.
    let started = Instant::now();
    // Until discovery has answered, requests fail fast (0.05 s) without
    // reaching the balancer, so the budget never counts them, though the
    // request metric does: counted, they put the allowance off by a fifth
    // of them.
    let mut uncounted = 0.0;
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no request ever reached a dead app"
        );
        let a = get(outbound, &web).await;
        if a.proxy_error()
            .is_some_and(|e| e.contains("app unreachable"))
        {
            break;
        }
        uncounted += 1.0;
    }
    let before = retried(&metrics(client.addr("admin")).await);
    let requests = 100;
    for _ in 0..requests {
        assert_eq!(get(outbound, &web).await.status, 502);
    }
    let elapsed = started.elapsed();
    let m = metrics(client.addr("admin")).await;
    let total = metric_value(
        &m,
        "tether_proxy_requests_total",
        &[("direction", "outbound")],
    );
    let allowance = (0.2 * (total - uncounted) + 100.0).floor();
    let retried_now = retried(&m);
    if elapsed < Duration::from_secs(9) {
        // Every request is still inside the 10 s window.
        assert_eq!(
            retried_now, allowance,
            "retried {retried_now} of {total} requests ({uncounted} before discovery, {before} retries before the run): {m}"
        );
    } else {
        // A slow machine: part of the window expired, which frees budget.
        assert!(
            retried_now >= allowance,
            "{retried_now} < {allowance} in {elapsed:?}"
        );
    }
    assert!(
        metric_value(
            &m,
            "tether_proxy_retries_total",
            &[("outcome", "budget_exhausted")]
        ) >= (requests as f64) - allowance,
        "{m}"
    );
}

/// A peer speaking HTTP/2 that refuses every request unprocessed
/// (REFUSED_STREAM), as a broken or hostile peer can, counting them.
async fn refusing_everything(
    streams: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let streams = streams.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(stream).await else {
                    return;
                };
                while let Some(Ok((_req, mut respond))) = conn.accept().await {
                    streams.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    respond.send_reset(h2::Reason::REFUSED_STREAM);
                }
            });
        }
    });
    addr
}

/// Peers that refuse everything unprocessed get a request sent again once,
/// on another of them, and no more: no loop between them, and what a
/// refusal can cost (an amplification a hostile peer could cause) is one
/// more stream per request.
#[tokio::test]
async fn peers_refusing_everything_see_each_request_at_most_twice() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let control = scratch.control().await;
    let streams = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for name in ["web-0", "web-1"] {
        let peer = refusing_everything(streams.clone()).await;
        scratch.endpoint(name, "web", peer, true);
    }
    let client = scratch
        .proxy("client", control.addr("grpc"), None, &[])
        .await;
    let (outbound, web) = (client.addr("outbound"), authority("web", 8080));
    for sent in 1..=3 {
        let answer = crate::drain::post(outbound, &web, "/orders", false).await;
        assert_eq!(answer.status, 502);
        let error = answer.proxy_error().unwrap_or_default();
        assert!(error.contains("refused the request unprocessed"), "{error}");
        assert_eq!(
            streams.load(std::sync::atomic::Ordering::SeqCst),
            2 * sent,
            "streams the peers saw after {sent} requests"
        );
    }
}
