//! Discovery at its limits: a service too large for one gRPC message, more
//! authorities than a proxy follows, ports a service does not declare, and a
//! control-plane replica that accepts connections but never answers.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use linkerd2_proxy_api::destination::{
    destination_client::DestinationClient, update, GetDestination,
};
use prost::Message;
use tether_core::registry::{Document, EndpointSpec, EndpointsDoc, PortSpec, ServiceDoc};

use crate::support::*;

fn service_doc(name: &str, ports: &[u16], endpoints: Vec<EndpointSpec>) -> String {
    let ports = ports.iter().map(|&port| PortSpec::http(port)).collect();
    Document::Service(ServiceDoc::new(name, "test", ports).with_endpoints(endpoints)).to_yaml()
}

/// The `i`-th of many distinct loopback addresses (127.16.0.0 upwards), all
/// on `port`: a listener on 0.0.0.0:port answers every one of them.
fn loopback(i: u32, port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::from(0x7f10_0000 + i), port))
}

const LARGE: u32 = 100_000;
/// Endpoints per registry file: each file stays a few MB.
const PER_FILE: u32 = 20_000;

#[tokio::test]
async fn a_service_of_100000_endpoints_is_routed() {
    let scratch = Scratch::new();
    // One app behind all of them: it listens on every local address.
    let app = scratch
        .spawn(
            "app",
            &["demo-app", "--listen", "0.0.0.0:0", "--replica", "big"],
            &["http"],
        )
        .await;
    let port = app.addr("http").port();
    scratch.write("big.yaml", &service_doc("big", &[8080], vec![]));
    for file in 0..LARGE / PER_FILE {
        let endpoints = (file * PER_FILE..(file + 1) * PER_FILE)
            .map(|i| EndpointSpec {
                meshed: false,
                identity: Some("big.test.serviceaccount.identity.cluster.local".into()),
                name: Some(format!("big-6f7d9c8b5-{i:06}").into()),
                ..EndpointSpec::new(loopback(i, port))
            })
            .collect();
        let doc = Document::Endpoints(EndpointsDoc {
            service: "big".into(),
            namespace: "test".into(),
            endpoints,
        });
        scratch.write(&format!("big-{file}.yaml"), &doc.to_yaml());
    }
    let control = scratch.control().await;
    let target = authority("big", 8080);

    // The control plane's side: the whole set, in messages a stock gRPC
    // client accepts (4 MiB by default), none of them near it.
    let mut client = DestinationClient::connect(format!("http://{}", control.addr("grpc")))
        .await
        .unwrap();
    let mut stream = client
        .get(GetDestination {
            path: target.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut seen = std::collections::BTreeSet::new();
    let mut largest = 0;
    while seen.len() < LARGE as usize {
        let up = tokio::time::timeout(Duration::from_secs(30), stream.message())
            .await
            .expect("updates keep coming")
            .unwrap_or_else(|e| panic!("{e}"))
            .expect("stream open");
        largest = largest.max(up.encoded_len());
        let Some(update::Update::Add(set)) = up.update else {
            panic!("{up:?}")
        };
        for wa in set.addrs {
            let addr = wa.addr.unwrap();
            let ip = std::net::IpAddr::try_from(addr.ip.unwrap()).unwrap();
            assert!(seen.insert(SocketAddr::new(ip, addr.port as u16)));
            assert!(wa.tls_identity.is_some());
        }
    }
    assert!(largest <= 1024 * 1024, "an update of {largest} bytes");

    // A real proxy routes through it.
    let target_flag = format!("--require-discovery={target}");
    let proxy = scratch
        .proxy("proxy", control.addr("grpc"), None, &[&target_flag])
        .await;
    let admin = proxy.addr("admin");
    let labels = [("authority", target.as_str())];
    // Its metrics; none while it is too busy with 100 000 endpoints (its
    // once-a-second sweep goes over all of them) to answer a scrape in time.
    let scrape = || async {
        tether_mesh_up::stats::http_get(admin, "/metrics")
            .await
            .ok()
            .map(|(_, text)| text)
    };
    // How many it holds.
    let held = || async {
        metric_sample(
            &scrape().await?,
            "tether_proxy_discovery_endpoints",
            &labels,
        )
    };
    // Taking in 100 000 endpoints takes as long as the machine's load
    // makes it (a debug build at load average 12 held 98 518 after 30 s):
    // wait while the count grows, and fail only when it stops short.
    const STALL: Duration = Duration::from_secs(30);
    let (mut most, mut grew) = (0.0, Instant::now());
    while most < f64::from(LARGE) {
        if let Some(n) = held().await.filter(|n| *n > most) {
            (most, grew) = (n, Instant::now());
        }
        assert!(
            grew.elapsed() < STALL,
            "the proxy stopped at {most} of {LARGE} endpoints for {STALL:?}:\n{}",
            scratch.read_log("proxy")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(most, f64::from(LARGE), "{}", scratch.read_log("proxy"));
    for _ in 0..10 {
        let a = get(proxy.addr("outbound"), &target).await;
        assert_eq!(a.status, 200, "{:?} {}", a.proxy_error(), a.body);
        assert_eq!(a.replica(), "big");
    }
    let answered = Instant::now();
    let m = loop {
        if let Some(m) = scrape().await {
            break m;
        }
        assert!(
            answered.elapsed() < STALL,
            "the proxy's metrics never answered"
        );
    };
    assert_eq!(
        metric_value(&m, "tether_proxy_discovery_reconnects_total", &[]),
        0.0,
        "{m}"
    );
}

/// A backend that accepts connections and answers nothing: requests to it
/// stay in flight until `release` fires, which closes every connection.
async fn never_answers(release: std::sync::Arc<tokio::sync::Notify>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((s, _)) => held.push(s),
                    Err(_) => return,
                },
                _ = release.notified() => held.clear(),
            }
        }
    });
    addr
}

#[tokio::test]
async fn a_proxy_follows_a_bounded_number_of_authorities() {
    let scratch = Scratch::new();
    let app = scratch.demo_app("app", 0).await;
    let release = std::sync::Arc::new(tokio::sync::Notify::new());
    let hold = never_answers(release.clone()).await;
    // Ports 9001-9004 lead to a backend that never answers; 9005 to the app.
    let mut endpoints: Vec<EndpointSpec> = (9001..=9004)
        .map(|p| EndpointSpec {
            meshed: false,
            port: Some(p),
            ..EndpointSpec::new(hold)
        })
        .collect();
    endpoints.push(EndpointSpec {
        meshed: false,
        port: Some(9005),
        ..EndpointSpec::new(app.addr("http"))
    });
    scratch.write(
        "many.yaml",
        &service_doc("many", &[9001, 9002, 9003, 9004, 9005], endpoints),
    );
    let control = scratch.control().await;
    let proxy = scratch
        .proxy(
            "proxy",
            control.addr("grpc"),
            None,
            &["--max-discovery-subscriptions", "4"],
        )
        .await;
    let (outbound, admin) = (proxy.addr("outbound"), proxy.addr("admin"));

    // Ports the service does not declare: answered at once, nothing kept.
    for port in 10_000..10_200 {
        let a = get(outbound, &authority("many", port)).await;
        assert_eq!(a.status, 503);
        let e = a.proxy_error().unwrap();
        assert!(
            e.starts_with("unknown service") && e.contains(&format!("has no port {port}")),
            "{e}"
        );
    }
    assert!(
        eventually(Duration::from_secs(10), || async {
            metric_value(
                &metrics(admin).await,
                "tether_proxy_discovery_subscriptions",
                &[],
            ) == 0.0
                && metric_value(
                    &metrics(control.addr("admin")).await,
                    "tether_destination_subscribers",
                    &[],
                ) == 0.0
        })
        .await,
        "subscriptions for undeclared ports were kept"
    );

    // Four requests in flight hold four services: the limit.
    let mut stuck = Vec::new();
    for port in 9001..=9004 {
        stuck.push(tokio::spawn(async move {
            request(
                outbound,
                &authority("many", port),
                "/",
                http::Version::HTTP_11,
            )
            .await
        }));
    }
    assert!(
        eventually(Duration::from_secs(10), || async {
            metric_value(
                &metrics(admin).await,
                "tether_proxy_discovery_subscriptions",
                &[],
            ) == 4.0
        })
        .await
    );
    let a = get(outbound, &authority("many", 9005)).await;
    assert_eq!(a.status, 503);
    let e = a.proxy_error().unwrap();
    assert!(
        e.contains("discovery subscription limit reached") && e.contains("at most 4"),
        "{e}"
    );

    // Once they are done, the least recently used makes room.
    release.notify_one();
    for s in stuck {
        let _ = tokio::time::timeout(Duration::from_secs(10), s).await;
    }
    assert!(
        eventually(Duration::from_secs(10), || async {
            get(outbound, &authority("many", 9005)).await.status == 200
        })
        .await,
        "{}",
        scratch.read_log("proxy")
    );
    let m = metrics(admin).await;
    assert!(metric_value(&m, "tether_proxy_discovery_subscriptions", &[]) <= 4.0);
    assert!(
        metric_value(
            &m,
            "tether_proxy_discovery_evictions_total",
            &[("reason", "lru")]
        ) >= 1.0,
        "{m}"
    );
}

#[tokio::test]
async fn a_silent_control_plane_replica_costs_one_short_wait() {
    let scratch = Scratch::new();
    let app = scratch.demo_app("app", 0).await;
    scratch.write(
        "web.yaml",
        &service_doc(
            "web",
            &[8080],
            vec![EndpointSpec {
                meshed: false,
                ..EndpointSpec::new(app.addr("http"))
            }],
        ),
    );
    scratch.write(
        "api.yaml",
        &service_doc(
            "api",
            &[8080],
            vec![EndpointSpec {
                meshed: false,
                ..EndpointSpec::new(app.addr("http"))
            }],
        ),
    );
    // Accepts connections (the kernel completes them) and never answers,
    // like a stopped replica. 127.0.0.1 sorts before the live replica's
    // 127.0.0.3, so every stream tries it first.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let live = scratch.control_at("control", "127.0.0.3:0", &[]).await;
    let controls = format!("{},{}", silent.local_addr().unwrap(), live.addr("grpc"));
    let failfast = Duration::from_secs(30);
    let proxy = scratch
        .spawn(
            "proxy",
            &[
                "proxy",
                "--control",
                &controls,
                "--outbound",
                "127.0.0.1:0",
                "--admin",
                "127.0.0.1:0",
                "--failfast-timeout",
                "30",
                "--discovery-first-answer-timeout",
                "0.5",
            ],
            &["outbound", "admin"],
        )
        .await;
    let outbound = proxy.addr("outbound");

    let started = Instant::now();
    let a = get(outbound, &authority("web", 8080)).await;
    let waited = started.elapsed();
    assert!(
        a.status == 200 || a.proxy_error() == Some("control plane unreachable"),
        "{} {:?}",
        a.status,
        a.proxy_error()
    );
    // Without a first-answer deadline the request waits out the whole
    // fail-fast timeout (or the keepalive, 15 s) on the silent replica.
    assert!(waited < failfast / 3, "the first request waited {waited:?}");
    assert!(
        eventually(Duration::from_secs(10), || async {
            get(outbound, &authority("web", 8080)).await.status == 200
        })
        .await
    );
    // A new stream starts with the replica that answered.
    let a = get(outbound, &authority("api", 8080)).await;
    assert_eq!(a.status, 200, "{:?}", a.proxy_error());
    let m = metrics(proxy.addr("admin")).await;
    assert!(
        metric_value(
            &m,
            "tether_proxy_discovery_reconnects_total",
            &[("reason", "silent")]
        ) >= 1.0,
        "{m}"
    );
    drop(silent);
}

/// A subscriber whose client never opens its flow-control window cannot be
/// told the stream is over; shutdown waits for it only a bounded time, and
/// the control plane still exits cleanly (before, it hung until SIGKILL).
#[tokio::test]
async fn a_subscriber_that_never_reads_does_not_hold_up_shutdown() {
    let scratch = Scratch::new();
    scratch.write(
        "web.yaml",
        &service_doc(
            "web",
            &[8080],
            (0..50)
                .map(|i| EndpointSpec::new(loopback(i, 8080)))
                .collect(),
        ),
    );
    let mut control = scratch.control().await;
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", control.addr("grpc")))
            .unwrap()
            .initial_stream_window_size(Some(0))
            .connect()
            .await
            .unwrap();
    let stalled = DestinationClient::new(channel)
        .get(GetDestination {
            path: authority("web", 8080),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();

    let grace = tether_control::server::SHUTDOWN_DRAIN * 6;
    let status = control.stop(grace).await.unwrap();
    assert!(
        status.success(),
        "control plane exited with {status:?} (SIGKILLed after {grace:?}?)\n{}",
        scratch.read_log("control")
    );
    drop(stalled);
}
