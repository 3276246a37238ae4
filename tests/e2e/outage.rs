//! Control-plane outages: readiness, fail fast, do no harm.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use linkerd2_proxy_api::destination::{
    destination_server::{Destination, DestinationServer},
    update, DestinationProfile, GetDestination, Update, WeightedAddr, WeightedAddrSet,
};

use crate::support::*;

fn id(name: &str) -> String {
    format!("{name}.test.serviceaccount.identity.cluster.local")
}

#[tokio::test]
async fn a_proxy_without_control_plane_says_so_then_recovers_when_it_starts() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let ca = scratch.identity_init("ca");
    let control_addr = free_port();
    let app = scratch.demo_app("web-0", 0).await;
    let server_args = scratch.identity_args(&ca, &id("web"), &ca);
    let server_args: Vec<&str> = server_args.iter().map(String::as_str).collect();
    let server = scratch
        .proxy("server", control_addr, Some(app.addr("http")), &server_args)
        .await;
    let mut client_args = scratch.identity_args(&ca, &id("client"), &ca);
    client_args.extend(["--failfast-timeout".to_string(), "30".to_string()]);
    let client_args: Vec<&str> = client_args.iter().map(String::as_str).collect();
    let client = scratch
        .proxy("client", control_addr, None, &client_args)
        .await;

    let (status, body) = ready_body(client.addr("admin")).await;
    assert_eq!(status, 503);
    assert!(body.contains("certificate"), "{body}");
    let (status, _) = tether_mesh_up::stats::http_get(client.addr("admin"), "/live")
        .await
        .unwrap();
    assert_eq!(status, 200);

    // Answered at once, long before the 30 s fail-fast timeout.
    let web = authority("web", 8080);
    let started = Instant::now();
    let a = get(client.addr("outbound"), &web).await;
    assert_eq!(a.status, 503);
    assert_eq!(a.proxy_error(), Some("control plane unreachable"));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let channel = tether_mesh_up::demo_grpc::channel(client.addr("outbound"), &web)
        .await
        .unwrap();
    let status = tether_mesh_up::demo_grpc::hello(channel, "x")
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert_eq!(status.message(), "control plane unreachable");

    // The control plane arrives: certificates, readiness, traffic.
    let ca_s = ca.display().to_string();
    let control = scratch
        .control_at("control", &control_addr.to_string(), &["--identity", &ca_s])
        .await;
    scratch.write(
        "web-0.yaml",
        &format!(
            "kind: Endpoints\nservice: web\nnamespace: test\nendpoints: [{{address: \"{}\", identity: {}}}]\n",
            server.addr("inbound"),
            id("web")
        ),
    );
    for admin in [client.addr("admin"), server.addr("admin")] {
        assert!(
            eventually(Duration::from_secs(15), || async {
                ready_body(admin).await.0 == 200
            })
            .await,
            "proxy never became ready"
        );
    }
    assert!(
        eventually(Duration::from_secs(10), || async {
            get(client.addr("outbound"), &web).await.status == 200
        })
        .await,
        "traffic never flowed"
    );
    drop(control);
}

#[tokio::test]
async fn losing_the_control_plane_keeps_the_last_endpoints() {
    let mut mesh = Mesh::start(&[0, 0]).await;
    let web = authority("web", 8080);
    mesh.scratch.remove("web-1.yaml");
    let outbound = mesh.outbound();
    assert!(
        eventually(Duration::from_secs(5), || async {
            let a = get(outbound, &web).await;
            a.status == 200 && a.replica() == "web-0"
        })
        .await
    );
    let grpc = mesh.control.addr("grpc");
    let status = mesh.control.stop(Duration::from_secs(10)).await.unwrap();
    assert!(status.success(), "control plane exited with {status:?}");

    // Outbound keeps serving from the last known endpoints...
    for i in 0..20 {
        let a = get(outbound, &web).await;
        assert_eq!(
            a.status,
            200,
            "request {i} after the control plane died: {:?}",
            a.proxy_error()
        );
    }
    // ...and inbound needs nothing from the control plane.
    let direct = get(mesh.sidecars[1].addr("inbound"), &web).await;
    assert_eq!(direct.status, 200);
    assert_eq!(direct.replica(), "web-1");

    // The age of the last update is exported and grows while the control
    // plane is silent (the gauge is refreshed every second).
    let admin = mesh.client.addr("admin");
    let age = || async {
        metric_sample(
            &metrics(admin).await,
            "tether_proxy_discovery_update_age_seconds",
            &[("authority", &web)],
        )
    };
    assert!(
        eventually(Duration::from_secs(5), || async {
            age().await.is_some_and(|a| a >= 0.0)
        })
        .await,
        "no update age exported (-1 would mean no update yet, but one arrived)"
    );
    let first = age().await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            age().await.is_some_and(|a| a >= first + 2.0)
        })
        .await,
        "the update age did not grow while the control plane was down"
    );
    let silent = age().await.unwrap();
    // The control plane returns (same address); updates resume.
    let _control = mesh
        .scratch
        .control_at("control-again", &grpc.to_string(), &[])
        .await;
    mesh.scratch
        .endpoint("web-1", "web", mesh.sidecars[1].addr("inbound"), true);
    assert!(
        eventually(Duration::from_secs(15), || async {
            get(outbound, &web).await.replica() == "web-1"
        })
        .await,
        "updates did not resume after the control plane came back"
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            age().await.is_some_and(|a| a < silent)
        })
        .await,
        "the update age did not restart with the update (it was {silent} s before)"
    );
}

#[tokio::test]
async fn a_service_without_endpoints_fails_fast_then_recovers() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let control = scratch.control().await;
    let app = scratch.demo_app("web-0", 0).await;
    let sidecar = scratch
        .proxy("server", control.addr("grpc"), Some(app.addr("http")), &[])
        .await;
    scratch.endpoint("web-0", "web", sidecar.addr("inbound"), true);
    let client = scratch
        .proxy(
            "client",
            control.addr("grpc"),
            None,
            &["--failfast-timeout", "3"],
        )
        .await;
    let (outbound, admin) = (client.addr("outbound"), client.addr("admin"));
    let web = authority("web", 8080);
    assert!(
        eventually(Duration::from_secs(5), || async {
            get(outbound, &web).await.status == 200
        })
        .await
    );

    scratch.remove("web-0.yaml");
    // After the timeout the service is in fail-fast: answered at once.
    assert!(
        eventually(Duration::from_secs(10), || async {
            metric_value(
                &metrics(admin).await,
                "tether_proxy_failfast",
                &[("authority", &web)],
            ) == 1.0
        })
        .await,
        "never entered fail-fast"
    );
    let started = Instant::now();
    let a = get(outbound, &web).await;
    assert_eq!(a.status, 503);
    assert_eq!(a.proxy_error(), Some("service in fail-fast"));
    assert!(
        started.elapsed() < Duration::from_secs(2), // well under the 3 s it would have waited
        "{:?}",
        started.elapsed()
    );

    scratch.endpoint("web-0", "web", sidecar.addr("inbound"), true);
    assert!(
        eventually(Duration::from_secs(5), || async {
            get(outbound, &web).await.status == 200
        })
        .await
    );
    let m = metrics(admin).await;
    assert_eq!(
        metric_value(&m, "tether_proxy_failfast", &[("authority", &web)]),
        0.0
    );
    assert_eq!(
        metric_value(
            &m,
            "tether_proxy_failfast_transitions_total",
            &[("authority", &web), ("to", "failfast")]
        ),
        1.0
    );
    assert_eq!(
        metric_value(
            &m,
            "tether_proxy_failfast_transitions_total",
            &[("authority", &web), ("to", "ready")]
        ),
        1.0
    );
}

#[tokio::test]
async fn queued_requests_are_served_when_an_endpoint_appears() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let control = scratch.control().await;
    let app = scratch.demo_app("web-0", 0).await;
    let sidecar = scratch
        .proxy("server", control.addr("grpc"), Some(app.addr("http")), &[])
        .await;
    let client = scratch
        .proxy(
            "client",
            control.addr("grpc"),
            None,
            &["--failfast-timeout", "10", "--max-pending", "3"],
        )
        .await;
    let outbound = client.addr("outbound");
    let web = authority("web", 8080);
    // Whether each answer came after the endpoint was registered.
    let registered = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let requests: Vec<_> = (0..5)
        .map(|_| {
            let (web, registered, answered) = (web.clone(), registered.clone(), answered.clone());
            tokio::spawn(async move {
                let a = get(outbound, &web).await;
                let after = registered.load(Ordering::SeqCst);
                answered.fetch_add(1, Ordering::SeqCst);
                (a.status, a.proxy_error().map(str::to_string), after)
            })
        })
        .collect();
    // Two beyond --max-pending are refused at once, which means the other
    // three are queued; well within the 10 s fail-fast timeout.
    assert!(
        eventually(Duration::from_secs(5), || async {
            answered.load(Ordering::SeqCst) >= 2
        })
        .await,
        "no request was refused for a full queue"
    );
    registered.store(true, Ordering::SeqCst);
    scratch.endpoint("web-0", "web", sidecar.addr("inbound"), true);
    let mut served = 0;
    let mut refused = 0;
    for r in requests {
        let (status, error, after) = r.await.unwrap();
        match status.as_u16() {
            200 => {
                served += 1;
                assert!(after, "served before the endpoint existed");
            }
            503 => {
                refused += 1;
                assert!(error.unwrap().starts_with("too many requests waiting"));
                assert!(!after, "a refused request waited for the endpoint");
            }
            other => panic!("unexpected status {other}: {error:?}"),
        }
    }
    assert_eq!((served, refused), (3, 2));
}

/// Live `Destination.Get` streams on a control plane.
async fn subscribers(control: &Process) -> f64 {
    metric_value(
        &metrics(control.addr("admin")).await,
        "tether_destination_subscribers",
        &[],
    )
}

#[tokio::test]
async fn stopping_the_replica_serving_the_stream_under_load_fails_no_request() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let mut replicas = vec![
        scratch.control_at("control-a", "127.0.0.1:0", &[]).await,
        scratch.control_at("control-b", "127.0.0.1:0", &[]).await,
    ];
    // The sidecars need nothing from a control plane: they only serve inbound.
    let mut sidecars = Vec::new();
    let mut apps = Vec::new();
    for i in 0..2 {
        let app = scratch.demo_app(&format!("web-{i}"), 0).await;
        let s = scratch
            .proxy(
                &format!("web-{i}-proxy"),
                free_port(),
                Some(app.addr("http")),
                &[],
            )
            .await;
        apps.push(app);
        sidecars.push(s);
    }
    scratch.endpoint("web-0", "web", sidecars[0].addr("inbound"), true);
    let controls = format!("{},{}", replicas[0].addr("grpc"), replicas[1].addr("grpc"));
    let client = scratch
        .spawn(
            "client",
            &[
                "proxy",
                "--control",
                &controls,
                "--outbound",
                "127.0.0.1:0",
                "--admin",
                "127.0.0.1:0",
            ],
            &["outbound", "admin"],
        )
        .await;
    let (outbound, admin) = (client.addr("outbound"), client.addr("admin"));
    let web = authority("web", 8080);
    assert!(
        eventually(Duration::from_secs(5), || async {
            get(outbound, &web).await.status == 200
        })
        .await
    );
    // Stop the replica the client's stream is on, whichever it picked.
    let serving = if subscribers(&replicas[0]).await >= 1.0 {
        0
    } else {
        1
    };
    assert_eq!(
        subscribers(&replicas[serving]).await,
        1.0,
        "the client's stream is on neither replica"
    );
    let mut stopped = replicas.remove(serving);
    let survivor = replicas.remove(0);

    let sent = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(tokio::sync::Notify::new());
    let load = tokio::spawn({
        let (web, sent, done) = (web.clone(), sent.clone(), done.clone());
        async move {
            let mut failures = Vec::new();
            let stop = done.notified();
            tokio::pin!(stop);
            loop {
                tokio::select! {
                    _ = &mut stop => break,
                    a = get(outbound, &web) => {
                        if a.status != 200 {
                            failures.push(format!("{} {:?}", a.status, a.proxy_error()));
                        }
                        sent.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
            failures
        }
    });
    let sent_by = |n: usize| {
        let sent = sent.clone();
        async move {
            eventually(Duration::from_secs(10), || async {
                sent.load(Ordering::SeqCst) >= n
            })
            .await
        }
    };
    assert!(sent_by(20).await, "the load did not start");
    let status = stopped.stop(Duration::from_secs(10)).await.unwrap();
    assert!(status.success(), "replica exited with {status:?}");
    let at_stop = sent.load(Ordering::SeqCst);
    // The stream moved: the stopped replica ended it, the survivor has it.
    assert!(
        eventually(Duration::from_secs(10), || async {
            subscribers(&survivor).await == 1.0
        })
        .await,
        "the stream did not move to the surviving replica"
    );
    let m = metrics(admin).await;
    assert!(
        metric_value(
            &m,
            "tether_proxy_discovery_reconnects_total",
            &[("reason", "ended")]
        ) >= 1.0,
        "{m}"
    );
    assert!(sent_by(at_stop + 20).await, "requests stopped flowing");
    done.notify_one();
    let failures = load.await.unwrap();
    let sent = sent.load(Ordering::SeqCst);
    assert!(
        failures.is_empty(),
        "{} of {sent} failed: {failures:?}",
        failures.len()
    );

    // The survivor serves updates.
    scratch.endpoint("web-1", "web", sidecars[1].addr("inbound"), true);
    assert!(
        eventually(Duration::from_secs(10), || async {
            get(outbound, &web).await.replica() == "web-1"
        })
        .await,
        "no updates after one replica stopped\n{}",
        scratch.read_log("client"),
    );
}

#[tokio::test]
async fn forward_mode_reaches_the_original_destination() {
    let scratch = Scratch::new();
    let app = scratch.demo_app("direct", 0).await;
    let closed = free_port();
    let forward = scratch
        .proxy(
            "forward",
            closed,
            None,
            &["--control-plane-unavailable", "forward"],
        )
        .await;
    let fail = scratch.proxy("fail", closed, None, &[]).await;
    let target = app.addr("http").to_string();

    let a = get(forward.addr("outbound"), &target).await;
    assert_eq!(a.status, 200, "{:?}", a.proxy_error());
    assert_eq!(a.replica(), "direct");
    let a = get(fail.addr("outbound"), &target).await;
    assert_eq!(a.status, 503);
    assert_eq!(a.proxy_error(), Some("control plane unreachable"));

    // An absolute-form URI naming a host that resolves.
    let port = app.addr("http").port();
    let a = {
        use http_body_util::BodyExt;
        let stream = tokio::net::TcpStream::connect(forward.addr("outbound"))
            .await
            .unwrap();
        let (mut s, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        let req = http::Request::get(format!("http://localhost:{port}/x"))
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        let rsp = s.send_request(req).await.unwrap();
        let status = rsp.status();
        let _ = rsp.into_body().collect().await;
        status
    };
    assert_eq!(a, 200);
}

#[tokio::test]
async fn forward_mode_with_mandatory_tls_is_refused_at_start() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    let mut args = vec![
        "proxy".to_string(),
        "--control".into(),
        "127.0.0.1:1".into(),
    ];
    args.extend(scratch.identity_args(&ca, &id("x"), &ca));
    args.extend(
        [
            "--tls",
            "mandatory",
            "--control-plane-unavailable",
            "forward",
        ]
        .map(String::from),
    );
    let out = std::process::Command::new(tether())
        .args(&args)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--tls mandatory") && err.contains("forward"),
        "{err}"
    );
}

#[tokio::test]
async fn require_discovery_holds_readiness_until_the_first_answer() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let control_addr = free_port();
    let web = authority("web", 8080);
    let client = scratch
        .proxy("client", control_addr, None, &["--require-discovery", &web])
        .await;
    let (status, body) = ready_body(client.addr("admin")).await;
    assert_eq!(status, 503);
    assert!(
        body.contains("discovery of web.test.svc.cluster.local:8080"),
        "{body}"
    );
    let _control = scratch
        .control_at("control", &control_addr.to_string(), &[])
        .await;
    assert!(
        eventually(Duration::from_secs(15), || async {
            ready_body(client.addr("admin")).await.0 == 200
        })
        .await
    );
}

// === a control plane that stalls ===

/// Answers the first Get with `first` and then stays silent forever;
/// later Gets get `then`.
struct StallingControl {
    calls: Arc<AtomicUsize>,
    first: SocketAddr,
    then: SocketAddr,
}

type Stream<T> = std::pin::Pin<Box<dyn futures::Stream<Item = Result<T, tonic::Status>> + Send>>;

fn add(addr: SocketAddr) -> Update {
    Update {
        update: Some(update::Update::Add(WeightedAddrSet {
            addrs: vec![WeightedAddr {
                addr: Some(addr.into()),
                weight: 1,
                protocol_hint: Some(linkerd2_proxy_api::destination::ProtocolHint {
                    protocol: Some(
                        linkerd2_proxy_api::destination::protocol_hint::Protocol::H2(
                            linkerd2_proxy_api::destination::protocol_hint::H2 {},
                        ),
                    ),
                    opaque_transport: None,
                }),
                ..Default::default()
            }],
            metric_labels: Default::default(),
        })),
    }
}

#[tonic::async_trait]
impl Destination for StallingControl {
    type GetStream = Stream<Update>;
    type GetProfileStream = Stream<DestinationProfile>;

    async fn get(
        &self,
        _req: tonic::Request<GetDestination>,
    ) -> Result<tonic::Response<Self::GetStream>, tonic::Status> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        let addr = if n == 0 { self.first } else { self.then };
        let stream = futures::StreamExt::chain(
            futures::stream::once(async move { Ok(add(addr)) }),
            futures::stream::pending(),
        );
        Ok(tonic::Response::new(Box::pin(stream)))
    }

    async fn get_profile(
        &self,
        _req: tonic::Request<GetDestination>,
    ) -> Result<tonic::Response<Self::GetProfileStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("no profiles"))
    }
}

#[tokio::test]
async fn a_stalled_stream_is_replaced() {
    let scratch = Scratch::new();
    let app = scratch.demo_app("web-0", 0).await;
    // The good endpoint: a sidecar in front of the app (its control plane is irrelevant).
    let sidecar = scratch
        .proxy("server", free_port(), Some(app.addr("http")), &[])
        .await;
    let calls = Arc::new(AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fake = listener.local_addr().unwrap();
    let server = StallingControl {
        calls: calls.clone(),
        first: free_port(), // gone: nothing listens there
        then: sidecar.addr("inbound"),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DestinationServer::new(server))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let client = scratch.proxy("client", fake, None, &[]).await;
    let web = authority("web", 8080);
    assert!(
        eventually(Duration::from_secs(15), || async {
            get(client.addr("outbound"), &web).await.status == 200
        })
        .await,
        "never recovered from the stalled stream"
    );
    assert!(calls.load(Ordering::SeqCst) >= 2);
    let m = metrics(client.addr("admin")).await;
    assert!(
        metric_value(
            &m,
            "tether_proxy_discovery_reconnects_total",
            &[("reason", "stalled")]
        ) >= 1.0,
        "{m}"
    );
}
