//! Routes on the Tether proxy: `HTTPRoute` / `GRPCRoute` documents in the
//! file registry, served by `tether control` over OutboundPolicies, applied
//! by the client's outbound. One test per route feature.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tether_mesh_up::demo_grpc;

use crate::support::*;

/// Bounds every wait for a route to come into force: the file registry
/// notices a change within a second, the watch sends it at once.
const POLICY_WAIT: Duration = Duration::from_secs(15);

/// A mesh with services `web` (replica `web-0`) and `web-v2` (replica
/// `v2-0`), each a demo app behind its own sidecar, and a client sidecar.
struct Routed {
    scratch: Scratch,
    _control: Process,
    client: Process,
    _apps: Vec<Process>,
}

impl Routed {
    async fn start(latency_ms: u32) -> Self {
        let scratch = Scratch::new();
        scratch.service("web", 8080, false);
        scratch.service("web-v2", 8080, false);
        let control = scratch.control().await;
        let mut apps = Vec::new();
        for (service, replica) in [("web", "web-0"), ("web-v2", "v2-0")] {
            let app = scratch.demo_app(replica, latency_ms).await;
            let sidecar = scratch
                .proxy(
                    &format!("{replica}-proxy"),
                    control.addr("grpc"),
                    Some(app.addr("http")),
                    &[],
                )
                .await;
            scratch.endpoint(replica, service, sidecar.addr("inbound"), true);
            apps.extend([app, sidecar]);
        }
        let client = scratch
            .proxy("client", control.addr("grpc"), None, &[])
            .await;
        Self {
            scratch,
            _control: control,
            client,
            _apps: apps,
        }
    }

    fn outbound(&self) -> SocketAddr {
        self.client.addr("outbound")
    }

    /// Writes a route document for `web`.
    fn route(&self, yaml: &str) {
        self.scratch.write("web-route.yaml", yaml);
    }

    /// Sends GETs until one is counted under `route` (the policy is in
    /// force on the client).
    async fn until_routed(&self, route: &str) {
        let (outbound, web, admin) = (
            self.outbound(),
            authority("web", 8080),
            self.client.addr("admin"),
        );
        let routed = eventually(POLICY_WAIT, || async {
            let _ = send(outbound, &web, Method::GET, "/", &[], Version::HTTP_11).await;
            metric_value(
                &metrics(admin).await,
                "tether_proxy_requests_total",
                &[("route", route)],
            ) > 0.0
        })
        .await;
        assert!(
            routed,
            "route {route} never came into force\n--- client log ---\n{}",
            self.scratch.read_log("client")
        );
    }
}

/// Repeats `attempt` until `done` says its answer will do, or the policy
/// wait is over; the last answer.
async fn until<T, F, Fut>(mut attempt: F, done: impl Fn(&T) -> bool) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let deadline = std::time::Instant::now() + POLICY_WAIT;
    loop {
        let answer = attempt().await;
        if done(&answer) || std::time::Instant::now() >= deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One request with `method`, `path` and extra headers, over a fresh
/// connection.
async fn send(
    connect: SocketAddr,
    authority: &str,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    version: Version,
) -> anyhow::Result<Answer> {
    let stream = tokio::net::TcpStream::connect(connect).await?;
    let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut req = http::Request::builder()
        .method(method)
        .uri(path)
        .version(version)
        .header(http::header::HOST, authority);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let rsp = s.send_request(req.body(Full::new(Bytes::new()))?).await?;
    let (status, version, headers) = (rsp.status(), rsp.version(), rsp.headers().clone());
    let body = rsp.into_body().collect().await?.to_bytes();
    Ok(Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
        version,
    })
}

/// A request (method, path, headers) and the replica that must answer it.
type Case<'a> = (Method, &'a str, &'a [(&'a str, &'a str)], &'a str);

#[tokio::test]
async fn every_match_kind_picks_its_rule() {
    let mesh = Routed::start(0).await;
    let to_v2 = "    backendRefs: [{name: web-v2, port: 8080}]\n";
    mesh.route(&format!(
        "kind: HTTPRoute\nname: web-matches\nnamespace: test\nparentRefs: [{{name: web, port: 8080}}]\nrules:\n\
         \x20 - matches: [{{path: {{type: Exact, value: /exact}}}}]\n{to_v2}\
         \x20 - matches: [{{path: {{type: PathPrefix, value: /prefix}}}}]\n{to_v2}\
         \x20 - matches: [{{path: {{type: RegularExpression, value: \"/re/[0-9]+\"}}}}]\n{to_v2}\
         \x20 - matches: [{{path: {{type: Exact, value: /m}}, method: POST}}]\n{to_v2}\
         \x20 - matches: [{{headers: [{{name: x-canary, value: \"1\"}}]}}]\n{to_v2}\
         \x20 - matches: [{{queryParams: [{{name: v, value: \"2\"}}]}}]\n{to_v2}\
         \x20 - matches: [{{path: {{type: PathPrefix, value: /}}}}]\n    backendRefs: [{{name: web, port: 8080}}]\n"
    ));
    mesh.until_routed("web-matches").await;
    let web = authority("web", 8080);
    let cases: &[Case] = &[
        (Method::GET, "/exact", &[], "v2-0"),
        (Method::GET, "/exact/more", &[], "web-0"),
        (Method::GET, "/prefix/a", &[], "v2-0"),
        (Method::GET, "/prefixes", &[], "web-0"),
        (Method::GET, "/re/123", &[], "v2-0"),
        (Method::GET, "/re/12a", &[], "web-0"),
        (Method::POST, "/m", &[], "v2-0"),
        (Method::GET, "/m", &[], "web-0"),
        (Method::GET, "/", &[("x-canary", "1")], "v2-0"),
        (Method::GET, "/", &[("x-canary", "2")], "web-0"),
        (Method::GET, "/?v=2", &[], "v2-0"),
        (Method::GET, "/?v=3", &[], "web-0"),
    ];
    for (method, path, headers, replica) in cases {
        let a = send(
            mesh.outbound(),
            &web,
            method.clone(),
            path,
            headers,
            Version::HTTP_11,
        )
        .await
        .unwrap();
        assert_eq!(a.status, 200, "{method} {path}: {:?}", a.proxy_error());
        assert_eq!(a.replica(), *replica, "{method} {path} {headers:?}");
    }
}

#[tokio::test]
async fn a_request_no_rule_matches_gets_404() {
    let mesh = Routed::start(0).await;
    mesh.route(
        "kind: HTTPRoute\nname: only-api\nnamespace: test\nparentRefs: [{name: web, port: 8080}]\n\
         rules:\n  - matches: [{path: {type: PathPrefix, value: /}, headers: [{name: x-probe, value: \"1\"}]}]\n  \
         - matches: [{path: {type: PathPrefix, value: /api}}]\n",
    );
    let (outbound, web, admin) = (
        mesh.outbound(),
        authority("web", 8080),
        mesh.client.addr("admin"),
    );
    assert!(
        eventually(POLICY_WAIT, || async {
            send(
                outbound,
                &web,
                Method::GET,
                "/",
                &[("x-probe", "1")],
                Version::HTTP_11,
            )
            .await
            .is_ok()
                && metric_value(
                    &metrics(admin).await,
                    "tether_proxy_requests_total",
                    &[("route", "only-api")],
                ) > 0.0
        })
        .await
    );
    let a = send(outbound, &web, Method::GET, "/api/x", &[], Version::HTTP_11)
        .await
        .unwrap();
    assert_eq!(a.status, 200);
    let a = send(outbound, &web, Method::GET, "/other", &[], Version::HTTP_11)
        .await
        .unwrap();
    assert_eq!(a.status, 404);
    assert!(
        a.proxy_error().unwrap().contains("no route"),
        "{:?}",
        a.proxy_error()
    );
}

/// A server that answers every request 200 with the request's headers as
/// its body, one `name: value` per line.
async fn header_echo() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let text: String = req
                            .headers()
                            .iter()
                            .map(|(k, v)| format!("{k}: {}\n", v.to_str().unwrap_or("?")))
                            .collect();
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::from(text),
                        )))
                    },
                );
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .serve_connection(TokioIo::new(stream), svc)
                .await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn header_filters_edit_the_request_and_the_response() {
    let mesh = Routed::start(0).await;
    mesh.scratch.service("echo", 8080, false);
    mesh.scratch
        .endpoint("echo-0", "echo", header_echo().await, false);
    mesh.scratch.write(
        "echo-route.yaml",
        "kind: HTTPRoute\nname: echo-headers\nnamespace: test\nparentRefs: [{name: echo, port: 8080}]\nrules:\n  \
         - filters:\n      - type: RequestHeaderModifier\n        requestHeaderModifier:\n          \
         set: [{name: x-route, value: api}]\n          add: [{name: x-trace, value: \"1\"}]\n          remove: [x-internal]\n      \
         - type: ResponseHeaderModifier\n        responseHeaderModifier:\n          add: [{name: x-served-by, value: canary}]\n",
    );
    let (outbound, echo) = (mesh.outbound(), authority("echo", 8080));
    let sent = [
        ("x-route", "mine"),
        ("x-trace", "0"),
        ("x-internal", "secret"),
    ];
    let a = until(
        || send(outbound, &echo, Method::GET, "/", &sent, Version::HTTP_11),
        |a| {
            a.as_ref()
                .is_ok_and(|a| a.headers.contains_key("x-served-by"))
        },
    )
    .await
    .unwrap();
    assert!(
        a.headers.contains_key("x-served-by"),
        "the route's filters never applied: {} {}",
        a.status,
        a.body
    );
    assert_eq!(a.status, 200);
    assert_eq!(a.headers["x-served-by"], "canary");
    let lines: Vec<&str> = a.body.lines().collect();
    assert!(lines.contains(&"x-route: api"), "set replaces: {lines:?}");
    assert!(!lines.contains(&"x-route: mine"), "set replaces: {lines:?}");
    assert!(
        lines.contains(&"x-trace: 0") && lines.contains(&"x-trace: 1"),
        "add appends: {lines:?}"
    );
    assert!(
        !lines.iter().any(|l| l.starts_with("x-internal")),
        "remove removes: {lines:?}"
    );
}

#[tokio::test]
async fn a_redirect_rule_answers_with_its_location() {
    let mesh = Routed::start(0).await;
    mesh.route(
        "kind: HTTPRoute\nname: web-moved\nnamespace: test\nparentRefs: [{name: web, port: 8080}]\nrules:\n  \
         - matches: [{path: {type: Exact, value: /old}}]\n    filters:\n      - type: RequestRedirect\n        \
         requestRedirect:\n          hostname: new.example.com\n          path: {type: ReplaceFullPath, replaceFullPath: /new}\n          \
         statusCode: 301\n  - backendRefs: [{name: web, port: 8080}]\n",
    );
    mesh.until_routed("web-moved").await;
    let a = send(
        mesh.outbound(),
        &authority("web", 8080),
        Method::GET,
        "/old?x=1",
        &[],
        Version::HTTP_11,
    )
    .await
    .unwrap();
    assert_eq!(a.status, 301, "{:?}", a.proxy_error());
    assert_eq!(a.headers["location"], "http://new.example.com:8080/new?x=1");
    assert_eq!(a.replica(), "", "a redirect never reaches the app");
}

#[tokio::test]
async fn a_route_timeout_answers_504_and_grpc_deadline_exceeded() {
    // Every answer takes 3 s; the route allows 300 ms.
    let mesh = Routed::start(3_000).await;
    mesh.route(
        "kind: HTTPRoute\nname: web-slow\nnamespace: test\nparentRefs: [{name: web, port: 8080}]\nrules:\n  \
         - timeouts: {request: 300ms}\n",
    );
    let (outbound, web) = (mesh.outbound(), authority("web", 8080));
    let a = until(
        || send(outbound, &web, Method::GET, "/", &[], Version::HTTP_11),
        |a| a.as_ref().is_ok_and(|a| a.status == 504),
    )
    .await
    .unwrap();
    assert_eq!(a.status, 504);
    let error = a.proxy_error().expect("the proxy says why");
    assert!(error.contains("timeout"), "{error}");

    mesh.scratch.write(
        "grpc-route.yaml",
        "kind: GRPCRoute\nname: web-v2-slow\nnamespace: test\nparentRefs: [{name: web-v2, port: 8080}]\nrules:\n  \
         - matches: [{method: {service: tether.demo.v1.Demo}}]\n    timeouts: {request: 300ms}\n",
    );
    let channel = demo_grpc::channel(outbound, &authority("web-v2", 8080))
        .await
        .unwrap();
    let r = until(
        || demo_grpc::hello(channel.clone(), "slow"),
        |r| matches!(r, Err(s) if s.code() == tonic::Code::DeadlineExceeded),
    )
    .await;
    let status = r.expect_err("the route's timeout never applied");
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("timeout"), "{status:?}");
}

#[tokio::test]
async fn a_route_retries_what_its_conditions_name() {
    // `web` has a replica that always answers 500 beside `web-0`.
    let mesh = Routed::start(0).await;
    let failing = mesh
        .scratch
        .spawn(
            "web-bad",
            &[
                "demo-app",
                "--listen",
                "127.0.0.1:0",
                "--replica",
                "web-bad",
                "--error-rate",
                "1",
            ],
            &["http"],
        )
        .await;
    mesh.scratch
        .endpoint("web-bad", "web", failing.addr("http"), false);
    let (outbound, web, admin) = (
        mesh.outbound(),
        authority("web", 8080),
        mesh.client.addr("admin"),
    );
    let post = || async {
        send(outbound, &web, Method::POST, "/", &[], Version::HTTP_11)
            .await
            .unwrap()
            .status
    };
    // Without a route a POST that reaches the failing replica fails: it is
    // not idempotent, and its 500 came from the app.
    assert!(
        eventually(POLICY_WAIT, || async { post().await == 500 }).await,
        "the failing replica was never picked: the test proves nothing"
    );
    mesh.route(
        "kind: HTTPRoute\nname: web-retry\nnamespace: test\nparentRefs: [{name: web, port: 8080}]\nrules:\n  \
         - retry: {codes: [500], attempts: 3}\n",
    );
    mesh.until_routed("web-retry").await;
    let before = metric_value(
        &metrics(admin).await,
        "tether_proxy_retries_total",
        &[("outcome", "retried")],
    );
    for i in 0..30 {
        assert_eq!(post().await, 200, "POST {i}");
    }
    let after = metric_value(
        &metrics(admin).await,
        "tether_proxy_retries_total",
        &[("outcome", "retried")],
    );
    assert!(
        after > before,
        "no POST needed a retry: the test proves nothing"
    );
}

#[tokio::test]
async fn an_attempt_past_backend_request_is_retried_within_the_request_timeout() {
    // Each attempt may take 300 ms, the whole request 10 s. backendRequest
    // once bounded all attempts together, so the retry it asked for never
    // happened and requests that met a slow replica got 504.
    let mesh = Routed::start(0).await;
    let b = mesh.scratch.demo_app("web-b", 0).await;
    mesh.scratch.endpoint("web-b", "web", b.addr("http"), false);
    let (outbound, web, admin) = (
        mesh.outbound(),
        authority("web", 8080),
        mesh.client.addr("admin"),
    );
    mesh.route(
        "kind: HTTPRoute\nname: web-per-try\nnamespace: test\nparentRefs: [{name: web, port: 8080}]\nrules:\n  \
         - retry: {codes: [504], attempts: 2}\n    timeouts: {request: 10s, backendRequest: 300ms}\n",
    );
    mesh.until_routed("web-per-try").await;
    let get = || async {
        send(outbound, &web, Method::GET, "/", &[], Version::HTTP_11)
            .await
            .unwrap()
    };
    // Both replicas serve (the balancer has seen both fast) before web-b
    // turns slow: it is then picked again before its latency is known.
    let a = until(get, |a| a.replica() == "web-b").await;
    assert_eq!(a.replica(), "web-b", "web-b never served");
    let slow = send(
        b.addr("http"),
        "web-b",
        Method::GET,
        "/admin/config?latency_ms=10000",
        &[],
        Version::HTTP_11,
    )
    .await
    .unwrap();
    assert_eq!(slow.status, 200, "web-b did not take its new latency");
    let retried = || async {
        metric_value(
            &metrics(admin).await,
            "tether_proxy_retries_total",
            &[("outcome", "retried")],
        )
    };
    let before = retried().await;
    let mut sent = 0;
    while retried().await == before {
        sent += 1;
        assert!(
            sent <= 200,
            "web-b was never picked again: the test proves nothing"
        );
        let a = get().await;
        assert_eq!(a.status, 200, "GET {sent}: {:?}", a.proxy_error());
    }
}

#[tokio::test]
async fn a_90_10_canary_split_lands_within_3_points_over_2000_requests() {
    let mesh = Routed::start(0).await;
    mesh.route(
        "kind: HTTPRoute\nname: web-canary\nnamespace: test\nparentRefs: [{name: web, port: 8080}]\nrules:\n  \
         - backendRefs: [{name: web, port: 8080, weight: 90}, {name: web-v2, port: 8080, weight: 10}]\n",
    );
    mesh.until_routed("web-canary").await;
    // One connection, 2,000 requests in turn.
    let stream = tokio::net::TcpStream::connect(mesh.outbound())
        .await
        .unwrap();
    let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let web = authority("web", 8080);
    let mut canary = 0;
    const N: usize = 2_000;
    for i in 0..N {
        let req = http::Request::get("/")
            .header(http::header::HOST, &web)
            .body(Full::new(Bytes::new()))
            .unwrap();
        let rsp = s.send_request(req).await.unwrap();
        assert_eq!(rsp.status(), 200, "request {i}");
        let replica = rsp.headers().get("tether-demo-replica").cloned();
        rsp.into_body().collect().await.unwrap();
        match replica.as_ref().and_then(|v| v.to_str().ok()) {
            Some("v2-0") => canary += 1,
            Some("web-0") => {}
            other => panic!("request {i} answered by {other:?}"),
        }
    }
    let share = canary as f64 / N as f64;
    // 2,000 draws at p = 0.1 have a standard deviation of 0.67 points.
    assert!((0.07..=0.13).contains(&share), "canary share {share}");
    let m = metrics(mesh.client.addr("admin")).await;
    assert!(
        metric_value(
            &m,
            "tether_proxy_requests_total",
            &[("route", "web-canary"), ("status_class", "2xx")]
        ) >= N as f64,
        "{m}"
    );
}
