//! Failover that never waits for the registry and never strands a request
//! (issue 17), in the network namespaces of `multicluster`: a crash the
//! registry learns of late, a link cut under a request in flight, and a
//! hung remote control plane whose gateway still serves.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::multicluster::*;
use crate::support::*;

fn service_authority(cluster: &Cluster) -> String {
    format!(
        "{}.{}.svc.cluster.local:8080",
        cluster.service.0, cluster.service.1
    )
}

/// Waits until `cluster`'s client proxy follows `n` endpoints for its
/// service (the metric is refreshed every second); a request must have
/// made it follow the service.
async fn until_client_knows(cluster: &Cluster, n: usize) {
    let (admin, authority) = (cluster.client.addr("admin"), service_authority(cluster));
    let known = eventually(Duration::from_secs(20), || async {
        metric_value(
            &metrics(admin).await,
            "tether_proxy_discovery_endpoints",
            &[("authority", &authority)],
        ) == n as f64
    })
    .await;
    assert!(
        known,
        "{}'s client never followed {n} endpoints:\n{}",
        cluster.name,
        metrics(admin).await
    );
}

fn signal(process: &Process, sig: &str) {
    let pid = process.pid().expect("still running").to_string();
    let out = Command::new("kill").args([sig, &pid]).output().unwrap();
    assert!(out.status.success(), "kill {sig} {pid} failed");
}

/// What a load of GET requests saw, by the cluster that answered (or
/// `failed …`), and the slowest answer.
#[derive(Default)]
struct Seen {
    by: BTreeMap<String, usize>,
    worst: Duration,
}

/// Sends GETs through `cluster`'s client, `workers` at a time, until the
/// returned flag is set; the result is in the returned `Seen`.
fn load(
    cluster: &Cluster,
    workers: usize,
) -> (
    Arc<std::sync::atomic::AtomicBool>,
    Arc<Mutex<Seen>>,
    Vec<tokio::task::JoinHandle<()>>,
) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (outbound, authority) = (cluster.client.addr("outbound"), service_authority(cluster));
    let tasks = (0..workers)
        .map(|_| {
            let (stop, seen, authority) = (stop.clone(), seen.clone(), authority.clone());
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let sent = Instant::now();
                    let key = match request(outbound, &authority, "/", http::Version::HTTP_11).await
                    {
                        Ok(a) if a.status == 200 => a
                            .replica()
                            .rsplit_once('-')
                            .map_or("?", |(c, _)| c)
                            .to_string(),
                        Ok(a) => format!("failed {} {:?}", a.status, a.proxy_error()),
                        Err(e) => format!("failed: {e}"),
                    };
                    {
                        let mut s = seen.lock().unwrap();
                        s.worst = s.worst.max(sent.elapsed());
                        *s.by.entry(key).or_default() += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
        })
        .collect();
    (stop, seen, tasks)
}

/// The registry's delay in noticing a crash, as in the scenario.
const REGISTRY_DELAY: Duration = Duration::from_secs(2);

#[tokio::test]
async fn a_crash_the_registry_learns_late_fails_no_idempotent_request() {
    let mut clusters = mesh(vec![
        Spec {
            name: "east",
            service: ("web", "shop"),
            mode: "failover",
            replicas: 2,
            latency_ms: 0,
            links: vec![(1, 1)],
            rogue: false,
        },
        Spec {
            name: "west",
            service: ("frontend", "store"),
            mode: "failover",
            replicas: 1,
            latency_ms: 0,
            links: vec![],
            rogue: false,
        },
    ])
    .await;
    // In failover mode the client knows west's gateway in advance (tier 1)
    // beside its two local replicas, and uses only the local ones.
    assert!(
        control_logged(
            &clusters[0],
            &[REACHABLE, "west"],
            0,
            Duration::from_secs(20)
        )
        .await,
        "the link to west never came up"
    );
    let healthy = spread(&clusters[0], 20).await;
    assert_eq!(healthy.get("east"), Some(&20), "{healthy:?}");
    until_client_knows(&clusters[0], 3).await;

    let (stop, seen, tasks) = load(&clusters[0], 4);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Every east replica crashes; the registry says so only later.
    for replica in &mut clusters[0].replicas {
        replica.app.kill().await;
        replica.sidecar.kill().await;
    }
    tokio::time::sleep(REGISTRY_DELAY).await;
    let east = &clusters[0];
    east.scratch
        .write("endpoints.yaml", &endpoints_doc(east, false));
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for t in tasks {
        t.await.unwrap();
    }
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    eprintln!("crash: {:?}, worst {:?}", seen.by, seen.worst);
    assert!(
        seen.by.keys().all(|k| !k.starts_with("failed")),
        "idempotent requests failed although west was known: {:?}",
        seen.by
    );
    assert!(seen.by.get("west").is_some_and(|n| *n > 0), "{:?}", seen.by);
    // Served by west while the registry still listed the dead replicas,
    // not after it caught up: the answers came before the registry delay.
    assert!(
        seen.worst < REGISTRY_DELAY,
        "a request waited {:?}, as long as the registry took",
        seen.worst
    );
    let text = metrics(east.client.addr("admin")).await;
    assert!(
        // Refused connections, or (the app died first) its proxy's errors.
        metric_value(&text, "tether_proxy_endpoint_ejections_total", &[]) >= 1.0,
        "{text}"
    );
}

#[tokio::test]
async fn a_request_in_flight_on_a_cut_link_is_answered_elsewhere() {
    // The app behind west answers only after far longer than the test.
    const SLOW_MS: u32 = 60_000;
    let clusters = mesh(vec![
        Spec {
            name: "east",
            service: ("web", "shop"),
            mode: "failover",
            replicas: 0,
            latency_ms: 0,
            links: vec![(1, 1), (2, 2)],
            rogue: false,
        },
        Spec {
            name: "west",
            service: ("frontend", "store"),
            mode: "failover",
            replicas: 1,
            latency_ms: SLOW_MS,
            links: vec![],
            rogue: false,
        },
        Spec {
            name: "north",
            service: ("web", "north"),
            mode: "failover",
            replicas: 1,
            latency_ms: 0,
            links: vec![],
            rogue: false,
        },
    ])
    .await;
    let east = &clusters[0];
    for remote in ["west", "north"] {
        assert!(
            control_logged(east, &[REACHABLE, remote], 0, Duration::from_secs(20)).await,
            "the link to {remote} never came up"
        );
    }
    let (outbound, authority) = (east.client.addr("outbound"), service_authority(east));
    // A first request starts the client's discovery of the service. It is
    // given up once both remote tiers are known: on a loaded machine the
    // tiers could come after it had been failed fast, and the request
    // below must find them known.
    let first = {
        let authority = authority.clone();
        tokio::spawn(
            async move { request(outbound, &authority, "/", http::Version::HTTP_11).await },
        )
    };
    until_client_knows(east, 2).await;
    first.abort();
    // Both remote tiers known: west (tier 1) has the request, north (tier
    // 2) waits.
    let in_flight = tokio::spawn(async move {
        let a = request(outbound, &authority, "/", http::Version::HTTP_11).await;
        (a, Instant::now())
    });
    // A few local hops: long since at west's app, which holds it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    if in_flight.is_finished() {
        let (answer, _) = in_flight.await.unwrap();
        let answer = answer.map(|a| (a.status, a.proxy_error().map(str::to_string)));
        panic!("answered before the cut, {answer:?}: west's app was not slow");
    }
    let cut = Instant::now();
    clusters[1].net.set_link(false);
    let (answer, at) = tokio::time::timeout(Duration::from_millis(SLOW_MS as u64), in_flight)
        .await
        .expect("the request stayed stranded on the cut link")
        .unwrap();
    let answer = answer.unwrap();
    let after = at - cut;
    eprintln!("answered {after:?} after the cut");
    assert_eq!(answer.status, 200, "{:?}", answer.proxy_error());
    assert!(
        answer.replica().starts_with("north"),
        "{}",
        answer.replica()
    );
    // Before, it hung until HTTP/2's keepalive gave up: a 10 s interval
    // and a 10 s timeout. Now discovery's drop of west (about a second)
    // or the new keepalive (KEEPALIVE_INTERVAL + KEEPALIVE_TIMEOUT) ends
    // it, with room left for a loaded machine.
    assert!(
        after < Duration::from_secs(10),
        "answered {after:?} after the cut: not before the old keepalive would have fired"
    );
    clusters[1].net.set_link(true);
}

#[tokio::test]
async fn a_hung_remote_control_plane_does_not_drop_a_healthy_cluster() {
    let clusters = mesh(vec![
        Spec {
            name: "east",
            service: ("web", "shop"),
            mode: "failover",
            replicas: 0,
            latency_ms: 0,
            links: vec![(1, 1)],
            rogue: false,
        },
        Spec {
            name: "west",
            service: ("frontend", "store"),
            mode: "failover",
            replicas: 1,
            latency_ms: 0,
            links: vec![],
            rogue: false,
        },
    ])
    .await;
    let east = &clusters[0];
    until_all_from(east, "west").await;
    use tether_control::multicluster::remote::{PROBE_EVERY, PROBE_TIMEOUT, STALE};
    let bound = 3 * (STALE + PROBE_TIMEOUT + PROBE_EVERY);
    let drops_before = control_log_lines(east, &[UNREACHABLE, "west"]);
    // West's control plane hangs; its gateway and apps do not.
    signal(&clusters[1].control, "-STOP");
    assert!(
        control_logged(east, &["stale export, gateway healthy", "west"], 0, bound).await,
        "east never noticed west's silent control plane:\n{}",
        east.scratch.read_log("control")
    );
    // Served from the last known export for several times as long as a
    // silent export took to drop a cluster before.
    let until = Instant::now() + 3 * STALE;
    while Instant::now() < until {
        let counts = spread(east, 10).await;
        assert_eq!(counts.get("west"), Some(&10), "{counts:?}");
    }
    assert_eq!(
        control_log_lines(east, &[UNREACHABLE, "west"]),
        drops_before,
        "west was dropped although its gateway kept serving"
    );
    let text = tether_mesh_up::stats::http_get(east.control.addr("admin"), "/metrics")
        .await
        .unwrap()
        .1;
    assert_eq!(
        metric_value(
            &text,
            "tether_control_linked_cluster",
            &[
                ("cluster", "west"),
                ("state", "stale_export_gateway_healthy")
            ]
        ),
        1.0,
        "{text}"
    );
    // The gateway fails too: now west is dropped.
    clusters[1].net.set_link(false);
    assert!(
        control_logged(east, &[UNREACHABLE, "west"], drops_before, bound).await,
        "west was not dropped once its gateway stopped answering"
    );
    clusters[1].net.set_link(true);
    signal(&clusters[1].control, "-CONT");
}
