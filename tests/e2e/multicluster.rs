//! Multicluster, for real: every cluster in its own network namespace with
//! its own address, linked to the test's namespace by a veth pair (routed
//! through it). Each cluster runs a control plane, a gateway, demo apps
//! with sidecars, and a client sidecar the test sends requests to. Needs
//! root (CI runs as root); installs iproute2 with apt-get when it is
//! missing.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use crate::support::*;

pub(crate) static NEXT_NET: AtomicU8 = AtomicU8::new(0);
const GRPC: u16 = 8086;
const EXPORT: u16 = 8087;
const GATEWAY: u16 = 4180;
const CLIENT: u16 = 4140;

pub(crate) fn sh(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .expect("running ip");
    assert!(
        out.status.success(),
        "{} failed: {} (these tests need root and iproute2)",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The second octet of a mesh's addresses: distinct per mesh of this test
/// process, and (most likely) from another test process running at once.
fn subnet(net: u8) -> u8 {
    100 + ((std::process::id() % 30) as u8) * 5 + net % 5
}

/// A cluster's network namespace and the veth that links it.
pub(crate) struct NetNs {
    pub(crate) name: String,
    veth: String,
    pub(crate) ip: Ipv4Addr,
}

impl NetNs {
    pub(crate) fn new(net: u8, i: u8) -> Self {
        installed(&["ip"], "iproute2");
        let name = format!("tether-t{}-{net}-{i}", std::process::id() % 100_000);
        let veth = format!("tv{}x{net}x{i}", std::process::id() % 10_000);
        let (outer, inner) = (
            format!("10.{}.{i}.1", subnet(net)),
            format!("10.{}.{i}.2", subnet(net)),
        );
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        sh(&["ip", "netns", "add", &name]);
        let peer = format!("{veth}p");
        sh(&[
            "ip", "link", "add", &veth, "type", "veth", "peer", "name", &peer,
        ]);
        sh(&["ip", "link", "set", &peer, "netns", &name]);
        sh(&["ip", "addr", "add", &format!("{outer}/24"), "dev", &veth]);
        sh(&["ip", "link", "set", &veth, "up"]);
        let exec = |args: &[&str]| {
            let mut v = vec!["ip", "netns", "exec", &name];
            v.extend(args);
            sh(&v);
        };
        exec(&["ip", "addr", "add", &format!("{inner}/24"), "dev", &peer]);
        exec(&["ip", "link", "set", &peer, "up"]);
        exec(&["ip", "link", "set", "lo", "up"]);
        exec(&["ip", "route", "add", "default", "via", &outer]);
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
            .expect("enabling IP forwarding (needs root)");
        Self {
            name,
            veth,
            ip: inner.parse().unwrap(),
        }
    }

    pub(crate) fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(self.ip), port)
    }

    /// Cuts (or restores) the cluster's only link.
    pub(crate) fn set_link(&self, up: bool) {
        sh(&[
            "ip",
            "link",
            "set",
            &self.veth,
            if up { "up" } else { "down" },
        ]);
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
        let _ = Command::new("ip")
            .args(["link", "del", &self.veth])
            .output();
    }
}

pub(crate) struct Replica {
    pub(crate) app: Process,
    pub(crate) sidecar: Process,
}

pub(crate) struct Cluster {
    pub(crate) name: String,
    pub(crate) net: NetNs,
    pub(crate) scratch: Scratch,
    pub(crate) control: Process,
    pub(crate) _gateway: Process,
    pub(crate) client: Process,
    pub(crate) replicas: Vec<Replica>,
    pub(crate) service: (String, String),
}

fn id(account: &str, cluster: &str) -> String {
    format!("{account}.{cluster}.serviceaccount.identity.cluster.local")
}

pub(crate) struct Spec<'a> {
    pub(crate) name: &'a str,
    /// The local service carrying the global id: (name, namespace).
    pub(crate) service: (&'a str, &'a str),
    pub(crate) mode: &'a str,
    pub(crate) replicas: usize,
    pub(crate) latency_ms: u32,
    /// Links: (cluster index, priority).
    pub(crate) links: Vec<(usize, u32)>,
    /// Another trust root than the others'.
    pub(crate) rogue: bool,
}

/// Runs `tether ARGS` inside the namespace.
pub(crate) async fn spawn_in(
    scratch: &Scratch,
    net: &NetNs,
    name: &str,
    args: &[String],
    expect: &[&str],
) -> Process {
    let mut full = vec![
        "netns".to_string(),
        "exec".into(),
        net.name.clone(),
        tether().display().to_string(),
    ];
    full.extend(args.iter().cloned());
    Process::spawn(Path::new("ip"), name, &full, &scratch.log(name), expect)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n--- {name} ---\n{}", scratch.read_log(name)))
}

fn token_file(scratch: &Scratch, ca: &Path, identity: &str) -> String {
    let token = tether_identity::token::LocalTokens::load(ca)
        .unwrap()
        .issue(identity);
    let path = scratch.dir.path().join(format!("{identity}.token"));
    std::fs::write(&path, token).unwrap();
    path.display().to_string()
}

pub(crate) fn endpoints_doc(cluster: &Cluster, ready: bool) -> String {
    let eps: Vec<String> = cluster
        .replicas
        .iter()
        .map(|r| {
            format!(
                "{{address: \"{}\", ready: {ready}, identity: {}}}",
                r.sidecar.addr("inbound"),
                id("web", &cluster.name)
            )
        })
        .collect();
    format!(
        "kind: Endpoints\nservice: {}\nnamespace: {}\nendpoints: [{}]\n",
        cluster.service.0,
        cluster.service.1,
        eps.join(", ")
    )
}

pub(crate) async fn mesh(specs: Vec<Spec<'_>>) -> Vec<Cluster> {
    let net = NEXT_NET.fetch_add(1, Ordering::SeqCst);
    let shared = Scratch::new();
    let ca = shared.identity_init("ca");
    let nets: Vec<NetNs> = (0..specs.len()).map(|i| NetNs::new(net, i as u8)).collect();
    let mut clusters = Vec::new();
    for (spec, ns) in specs.iter().zip(nets) {
        let scratch = Scratch::new();
        let ca = if spec.rogue {
            scratch.identity_init("rogue-ca")
        } else {
            ca.clone()
        };
        let ca_s = ca.display().to_string();
        let (svc, svc_ns) = spec.service;
        scratch.write(
            "service.yaml",
            &format!(
                "kind: Service\nname: {svc}\nnamespace: {svc_ns}\nports: [{{port: 8080}}]\nglobal_id: web-global\nmode: {}\n",
                spec.mode
            ),
        );
        let mut args: Vec<String> = [
            "control",
            "--registry",
            &scratch.registry().display().to_string(),
            "--grpc",
            &ns.addr(GRPC).to_string(),
            "--admin",
            &ns.addr(0).to_string(),
            "--cluster",
            spec.name,
            "--identity",
            &ca_s,
            "--export",
            &ns.addr(EXPORT).to_string(),
            "--gateway-address",
            &ns.addr(GATEWAY).to_string(),
            "--gateway-identity",
            &id("tether-gateway", spec.name),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for (other, priority) in &spec.links {
            let other_ip = Ipv4Addr::new(10, subnet(net), *other as u8, 2);
            args.push("--link".into());
            args.push(format!(
                "name={},export={other_ip}:{EXPORT},gateway={other_ip}:{GATEWAY},priority={priority}",
                specs[*other].name
            ));
        }
        let control = spawn_in(
            &scratch,
            &ns,
            "control",
            &args,
            &["grpc", "admin", "export"],
        )
        .await;
        let control_addr = ns.addr(GRPC).to_string();
        let gw_id = id("tether-gateway", spec.name);
        let gateway = spawn_in(
            &scratch,
            &ns,
            "gateway",
            &[
                "gateway".to_string(),
                "--control".into(),
                control_addr.clone(),
                "--listen".into(),
                ns.addr(GATEWAY).to_string(),
                "--admin".into(),
                ns.addr(0).to_string(),
                "--identity".into(),
                gw_id.clone(),
                "--identity-token-file".into(),
                token_file(&scratch, &ca, &gw_id),
                "--trust-root".into(),
                format!("{ca_s}/ca.crt"),
            ],
            &["gateway", "admin"],
        )
        .await;
        let proxy_args = |identity: &str, app: Option<SocketAddr>| -> Vec<String> {
            let mut a: Vec<String> = vec![
                "proxy".into(),
                "--control".into(),
                control_addr.clone(),
                "--outbound".into(),
                ns.addr(if app.is_none() { CLIENT } else { 0 }).to_string(),
                "--inbound".into(),
                ns.addr(0).to_string(),
                "--admin".into(),
                ns.addr(0).to_string(),
                "--identity".into(),
                identity.to_string(),
                "--identity-token-file".into(),
                token_file(&scratch, &ca, identity),
                "--trust-root".into(),
                format!("{ca_s}/ca.crt"),
                "--tls".into(),
                "mandatory".into(),
            ];
            if let Some(app) = app {
                a.extend(["--app".to_string(), app.to_string()]);
            }
            a
        };
        let mut replicas = Vec::new();
        for r in 0..spec.replicas {
            let replica = format!("{}-{r}", spec.name);
            let app = spawn_in(
                &scratch,
                &ns,
                &replica,
                &[
                    "demo-app".to_string(),
                    "--listen".into(),
                    ns.addr(0).to_string(),
                    "--replica".into(),
                    replica.clone(),
                    "--latency-ms".into(),
                    spec.latency_ms.to_string(),
                ],
                &["http"],
            )
            .await;
            let sidecar = spawn_in(
                &scratch,
                &ns,
                &format!("{replica}-proxy"),
                &proxy_args(&id("web", spec.name), Some(app.addr("http"))),
                &["outbound", "inbound", "admin"],
            )
            .await;
            replicas.push(Replica { app, sidecar });
        }
        let client = spawn_in(
            &scratch,
            &ns,
            "client",
            &proxy_args(&id("client", spec.name), None),
            &["outbound", "admin"],
        )
        .await;
        let cluster = Cluster {
            name: spec.name.to_string(),
            net: ns,
            scratch,
            control,
            _gateway: gateway,
            client,
            replicas,
            service: (svc.to_string(), svc_ns.to_string()),
        };
        if !cluster.replicas.is_empty() {
            cluster
                .scratch
                .write("endpoints.yaml", &endpoints_doc(&cluster, true));
        }
        clusters.push(cluster);
    }
    for c in &clusters {
        let admin = c.client.addr("admin");
        assert!(
            eventually(Duration::from_secs(20), || async {
                ready_body(admin).await.0 == 200
            })
            .await,
            "{} client never ready",
            c.name
        );
    }
    clusters
}

/// Sends `n` requests through `cluster`'s client sidecar; counts answers
/// by the cluster that served them (`failed` for errors).
pub(crate) async fn spread(cluster: &Cluster, n: usize) -> BTreeMap<String, usize> {
    let authority = format!(
        "{}.{}.svc.cluster.local:8080",
        cluster.service.0, cluster.service.1
    );
    let mut out = BTreeMap::new();
    for _ in 0..n {
        let a = get(cluster.client.addr("outbound"), &authority).await;
        let key = if a.status == 200 {
            a.replica()
                .rsplit_once('-')
                .map_or("?", |(c, _)| c)
                .to_string()
        } else {
            format!("failed {} {:?}", a.status, a.proxy_error())
        };
        *out.entry(key).or_default() += 1;
    }
    out
}

/// Waits until a whole batch of requests is served by `cluster` alone.
pub(crate) async fn until_all_from(client: &Cluster, from: &str) -> BTreeMap<String, usize> {
    let mut last = BTreeMap::new();
    for _ in 0..100 {
        last = spread(client, 20).await;
        if last.len() == 1 && last.contains_key(from) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = client.scratch.read_log("control");
    let tail: Vec<&str> = log.lines().rev().take(15).collect();
    panic!("traffic never moved entirely to {from}: last batch {last:?}\n--- {} control (last lines) ---\n{}", client.name, tail.join("\n"));
}

/// Lines of `cluster`'s control-plane log that contain every one of `words`.
pub(crate) fn control_log_lines(cluster: &Cluster, words: &[&str]) -> usize {
    cluster
        .scratch
        .read_log("control")
        .lines()
        .filter(|l| words.iter().all(|w| l.contains(w)))
        .count()
}

/// Waits until `cluster`'s control plane has logged more than `before`
/// lines containing every one of `words`; false after `timeout`.
pub(crate) async fn control_logged(
    cluster: &Cluster,
    words: &[&str],
    before: usize,
    timeout: Duration,
) -> bool {
    eventually(timeout, || async {
        control_log_lines(cluster, words) > before
    })
    .await
}

pub(crate) const REACHABLE: &str = "linked cluster reachable";
pub(crate) const UNREACHABLE: &str = "linked cluster unreachable; dropped from answers";

#[tokio::test]
async fn balanced_mode_spreads_but_prefers_local_and_joins_names() {
    let clusters = mesh(vec![
        Spec {
            name: "east",
            service: ("web", "shop"),
            mode: "balanced",
            replicas: 1,
            latency_ms: 0,
            links: vec![(1, 1)],
            rogue: false,
        },
        Spec {
            name: "west",
            service: ("frontend", "store"),
            mode: "balanced",
            replicas: 1,
            latency_ms: 20,
            links: vec![(0, 1)],
            rogue: false,
        },
    ])
    .await;
    let east = &clusters[0];
    // Wait for the remote to be linked in, then measure.
    let mut seen = BTreeMap::new();
    for _ in 0..50 {
        seen = spread(east, 50).await;
        if seen.contains_key("west") {
            break;
        }
    }
    let counts = spread(east, 200).await;
    let local = counts.get("east").copied().unwrap_or(0);
    let remote = seen.get("west").copied().unwrap_or(0) + counts.get("west").copied().unwrap_or(0);
    assert!(
        remote > 0,
        "balanced mode sent nothing remote: {seen:?} {counts:?}"
    );
    assert!(
        local > 150,
        "balanced mode did not prefer local: {counts:?}"
    );
    assert_eq!(
        counts.keys().filter(|k| k.starts_with("failed")).count(),
        0,
        "{counts:?}"
    );
}

#[tokio::test]
async fn failover_mode_goes_remote_only_when_local_is_gone_and_comes_back() {
    let clusters = mesh(vec![
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
    let east = &clusters[0];
    // Once the link is up: nothing remote while local is healthy.
    assert!(
        control_logged(east, &[REACHABLE, "west"], 0, Duration::from_secs(20)).await,
        "the link to west never came up"
    );
    let healthy = spread(east, 100).await;
    assert_eq!(healthy.get("east"), Some(&100), "{healthy:?}");

    // Every local replica dies (its readiness goes false).
    east.scratch
        .write("endpoints.yaml", &endpoints_doc(east, false));
    until_all_from(east, "west").await;
    // Back again.
    east.scratch
        .write("endpoints.yaml", &endpoints_doc(east, true));
    until_all_from(east, "east").await;
}

#[tokio::test]
async fn priority_tiers_and_cut_links() {
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
            latency_ms: 0,
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
    // Tier 1 (west) is used; tier 2 (north) only when tier 1 has nothing.
    until_all_from(east, "west").await;
    let again = spread(east, 50).await;
    assert_eq!(again.get("west"), Some(&50), "{again:?}");

    // Cut west off: it leaves the answers within about a second (a silent
    // export or gateway is stale after STALE; probes run every PROBE_EVERY
    // and give up after PROBE_TIMEOUT), and traffic shifts to north. The
    // bound is loose for a loaded machine, and far below any TCP timeout.
    use tether_control::multicluster::remote::{PROBE_EVERY, PROBE_TIMEOUT, STALE};
    let drops_before = control_log_lines(east, &[UNREACHABLE, "west"]);
    let cut = std::time::Instant::now();
    clusters[1].net.set_link(false);
    let bound = 3 * (STALE + PROBE_TIMEOUT + PROBE_EVERY);
    assert!(
        control_logged(east, &[UNREACHABLE, "west"], drops_before, bound).await,
        "west was not dropped within {bound:?} of the cut"
    );
    eprintln!("west dropped {:?} after the cut", cut.elapsed());
    until_all_from(east, "north").await;
    clusters[1].net.set_link(true);
    until_all_from(east, "west").await;
}

#[tokio::test]
async fn a_cluster_with_another_trust_root_is_refused() {
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
            name: "rogue",
            service: ("web", "shop"),
            mode: "failover",
            replicas: 1,
            latency_ms: 0,
            links: vec![],
            rogue: true,
        },
    ])
    .await;
    let east = &clusters[0];
    // Reachable, but refused for its certificate: the handshake error says so.
    assert!(
        control_logged(
            east,
            &["does not chain to the trust root", "rogue"],
            0,
            Duration::from_secs(20)
        )
        .await,
        "no trust refusal logged:\n{}",
        east.scratch.read_log("control")
    );
    let counts = spread(east, 10).await;
    assert!(
        !counts.contains_key("rogue"),
        "traffic reached a cluster of another trust root: {counts:?}"
    );
    assert_eq!(counts.values().sum::<usize>(), 10);
    assert!(
        counts.keys().all(|k| k.starts_with("failed 503")),
        "{counts:?}"
    );
    // Counted as what they would have been under mandatory TLS: mTLS.
    let text = metrics(east.client.addr("admin")).await;
    let failed = |tls: &str| {
        metric_value(
            &text,
            "tether_proxy_requests_total",
            &[
                ("direction", "outbound"),
                ("status_class", "5xx"),
                ("tls", tls),
            ],
        )
    };
    assert_eq!((failed("true"), failed("false")), (10.0, 0.0), "{text}");
    let log = east.scratch.read_log("control");
    assert!(!log.contains("linked cluster reachable"), "{log}");
}
