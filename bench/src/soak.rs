//! Soak: constant open-loop GET load through a small mesh while everything
//! that can go wrong in production happens beside it, over and over:
//!
//! - the two control-plane replicas are SIGKILLed and restarted on the same
//!   address in turn (the proxies know both addresses);
//! - the registry churns (one service's endpoints rewritten several times a
//!   second, a service file created and deleted);
//! - endpoints crash (app and sidecar SIGKILLed), the registry learns half a
//!   second later (write, then rename), and they come back;
//! - certificates rotate (short leaf lifetime; every proxy renews often);
//! - hostile clients (slowloris, garbage bytes, floods of idle connections)
//!   hit the proxies' and control plane's listeners.
//!
//! It prints requests sent / failed / retried, what the audit found, and
//! the RSS growth of every process after warm-up, and ends with PASS/FAIL
//! lines (exit status 1 on FAIL): no failed request (all are idempotent
//! GETs, so retries must absorb every crash), a clean audit with replicas
//! agreeing with the registry, RSS growth under 20%, and every hostile
//! connection closed by the server.
//!
//! Only loopback addresses; every loop is bounded in count and time.
//!
//! Usage: bench/soak.sh [--minutes 2] [--rps 200] [--leaf-lifetime 30]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rand::Rng;
use tether_admin::Shutdown;
use tether_bench::{metric_sum, proc_usage, reserve_ports, wait_ready};
use tether_core::registry::{Document, EndpointSpec, EndpointsDoc, PortSpec, ServiceDoc};
use tether_mesh_up::loadgen::{self, LoadProtocol, LoadReport, LoadSpec};
use tether_mesh_up::process::Process;
use tether_mesh_up::stats::http_get;
use tether_mesh_up::up::write_document;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const NAMESPACE: &str = "soak";
const PORT: u16 = 8080;
const WEB_REPLICAS: usize = 3;
const API_REPLICAS: usize = 2;
/// Proxies' header-read and idle timeouts: short, so hostile connections
/// are cut (and counted) many times within a run.
const HEADER_READ_TIMEOUT: &str = "5";
const IDLE_TIMEOUT: &str = "20";
/// RSS growth allowed between warm-up and the end.
const RSS_GROWTH_LIMIT: f64 = 0.20;

struct Args {
    tether: PathBuf,
    minutes: f64,
    rps: f64,
    leaf_lifetime: u64,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        tether: "target/release/tether".into(),
        minutes: 2.0,
        rps: 200.0,
        leaf_lifetime: 30,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--tether" => a.tether = v.into(),
            "--minutes" => a.minutes = v.parse().context("--minutes")?,
            "--rps" => a.rps = v.parse().context("--rps")?,
            "--leaf-lifetime" => a.leaf_lifetime = v.parse().context("--leaf-lifetime")?,
            other => bail!("unknown flag {other}"),
        }
    }
    anyhow::ensure!(
        a.minutes >= 0.5 && a.minutes <= 24.0 * 60.0,
        "--minutes must be in [0.5, 1440]"
    );
    anyhow::ensure!(a.rps > 0.0 && a.rps <= 2000.0, "--rps must be in (0, 2000]");
    anyhow::ensure!(
        (10..=3600).contains(&a.leaf_lifetime),
        "--leaf-lifetime must be 10-3600 seconds"
    );
    Ok(a)
}

fn s(v: impl ToString) -> String {
    v.to_string()
}

fn identity(account: &str) -> String {
    tether_identity::identity_name(account, NAMESPACE, "cluster.local")
}

fn authority(service: &str) -> String {
    format!("{service}.{NAMESPACE}.svc.cluster.local:{PORT}")
}

// === processes ===

/// One incarnation of a process: its RSS after warm-up and at its last sample.
struct Life {
    pid: u32,
    started: Instant,
    baseline_kib: Option<(Instant, u64)>,
    last_kib: Option<(Instant, u64)>,
}

/// A process the soak runs, restarted on the same addresses after a kill.
struct Slot {
    name: String,
    argv: Vec<String>,
    expect: &'static [&'static str],
    admin: Option<SocketAddr>,
    process: Option<Process>,
    lives: Vec<Life>,
    /// Each killed incarnation's last scrape, so its counters are not lost.
    scrapes: Vec<String>,
}

#[derive(Clone)]
struct Mesh {
    exe: PathBuf,
    logs: PathBuf,
    slots: Arc<Mutex<Vec<Slot>>>,
    /// What happened when, to set failures against.
    timeline: Arc<Mutex<Vec<(Instant, String)>>>,
}

impl Mesh {
    fn add(
        &self,
        name: &str,
        argv: Vec<String>,
        expect: &'static [&'static str],
        admin: Option<SocketAddr>,
    ) -> usize {
        let mut slots = self.slots.lock().unwrap();
        slots.push(Slot {
            name: name.into(),
            argv,
            expect,
            admin,
            process: None,
            lives: Vec::new(),
            scrapes: Vec::new(),
        });
        slots.len() - 1
    }

    fn note(&self, what: String) {
        self.timeline.lock().unwrap().push((Instant::now(), what));
    }

    /// Starts slot `i` (again) and waits until it is ready.
    async fn start(&self, i: usize) -> anyhow::Result<()> {
        let (name, argv, expect, admin, life) = {
            let slots = self.slots.lock().unwrap();
            let slot = &slots[i];
            (
                slot.name.clone(),
                slot.argv.clone(),
                slot.expect,
                slot.admin,
                slot.lives.len(),
            )
        };
        let log = self.logs.join(format!("{name}.{life}.log"));
        let mut argv = argv;
        tether_mesh_up::process::plaintext_control_plane_without_identity(&mut argv);
        let process = Process::spawn(&self.exe, &name, &argv, &log, expect).await?;
        let pid = process.pid().context("no pid")?;
        {
            let mut slots = self.slots.lock().unwrap();
            slots[i].process = Some(process);
            slots[i].lives.push(Life {
                pid,
                started: Instant::now(),
                baseline_kib: None,
                last_kib: None,
            });
        }
        if let Some(admin) = admin {
            wait_ready(admin, Duration::from_secs(20))
                .await
                .with_context(|| format!("{name}; see {}", log.display()))?;
        }
        self.note(format!("{name} started (pid {pid})"));
        Ok(())
    }

    /// SIGKILLs slot `i`, keeping its last scrape.
    async fn kill(&self, i: usize) {
        let (process, admin) = {
            let mut slots = self.slots.lock().unwrap();
            (slots[i].process.take(), slots[i].admin)
        };
        let Some(mut process) = process else { return };
        let scrape = match admin {
            Some(admin) => http_get(admin, "/metrics").await.map(|r| r.1).ok(),
            None => None,
        };
        process.kill().await;
        self.note(format!("{} killed", process.name));
        if let Some(scrape) = scrape {
            self.slots.lock().unwrap()[i].scrapes.push(scrape);
        }
    }

    /// SIGKILLs every process.
    async fn stop_all(&self) {
        let processes: Vec<Process> = {
            let mut slots = self.slots.lock().unwrap();
            slots.iter_mut().filter_map(|s| s.process.take()).collect()
        };
        for mut p in processes {
            p.kill().await;
        }
    }

    /// Records every live process's RSS; the first sample at or after
    /// `warm_up` (and `settle` after the process started) is its baseline.
    fn sample_rss(&self, warm_up: Instant, settle: Duration) {
        let now = Instant::now();
        let mut slots = self.slots.lock().unwrap();
        for slot in slots.iter_mut().filter(|s| s.process.is_some()) {
            let Some(life) = slot.lives.last_mut() else {
                continue;
            };
            let rss = proc_usage(life.pid).rss_kib;
            if rss == 0 {
                continue;
            }
            if life.baseline_kib.is_none() && now >= warm_up && now >= life.started + settle {
                life.baseline_kib = Some((now, rss));
            }
            life.last_kib = Some((now, rss));
        }
    }

    /// Every scrape: killed incarnations' and the live processes' now.
    async fn all_scrapes(&self) -> Vec<String> {
        let (mut scrapes, admins): (Vec<String>, Vec<SocketAddr>) = {
            let slots = self.slots.lock().unwrap();
            (
                slots.iter().flat_map(|s| s.scrapes.clone()).collect(),
                slots
                    .iter()
                    .filter(|s| s.process.is_some())
                    .filter_map(|s| s.admin)
                    .collect(),
            )
        };
        for admin in admins {
            if let Ok((_, text)) = http_get(admin, "/metrics").await {
                scrapes.push(text);
            }
        }
        scrapes
    }
}

/// A counter summed over scrapes (of killed incarnations and live processes).
fn total(scrapes: &[String], name: &str, labels: &[(&str, &str)]) -> u64 {
    scrapes
        .iter()
        .map(|s| metric_sum(s, name, labels) as u64)
        .sum()
}

// === the registry ===

struct Registry {
    dir: PathBuf,
}

impl Registry {
    fn service(&self, name: &str) -> anyhow::Result<()> {
        let doc = Document::Service(ServiceDoc::new(name, NAMESPACE, vec![PortSpec::http(PORT)]));
        Ok(write_document(&self.dir, &format!("{name}.yaml"), &doc)?)
    }

    fn endpoints(
        &self,
        file: &str,
        service: &str,
        endpoints: Vec<EndpointSpec>,
    ) -> anyhow::Result<()> {
        let doc = Document::Endpoints(EndpointsDoc {
            service: service.into(),
            namespace: NAMESPACE.into(),
            endpoints,
        });
        Ok(write_document(&self.dir, file, &doc)?)
    }

    /// One replica of `service` behind the sidecar at `inbound`.
    fn replica(
        &self,
        service: &str,
        replica: &str,
        inbound: SocketAddr,
        ready: bool,
    ) -> anyhow::Result<()> {
        let spec = EndpointSpec {
            ready,
            identity: Some(identity(service).into()),
            name: Some(replica.into()),
            ..EndpointSpec::new(inbound)
        };
        self.endpoints(&format!("{replica}.yaml"), service, vec![spec])
    }
}

// === events ===

/// What the chaos did, for the report.
struct Events {
    control_kills: u64,
    endpoint_kills: u64,
    registry_writes: u64,
}

/// Sleeps until `at`; false when `at` is past `end` (the loop is over).
async fn sleep_until_before(at: Instant, end: Instant) -> bool {
    if at >= end {
        return false;
    }
    tokio::time::sleep_until(at.into()).await;
    true
}

/// Kills the control-plane replicas in turn, restarting each in place.
async fn control_chaos(
    mesh: Mesh,
    controls: Vec<usize>,
    period: Duration,
    end: Instant,
) -> anyhow::Result<u64> {
    let start = Instant::now();
    let mut kills = 0u64;
    while sleep_until_before(start + period * (kills as u32 + 1), end).await {
        let i = controls[kills as usize % controls.len()];
        mesh.kill(i).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        mesh.start(i).await.context("restarting a control plane")?;
        kills += 1;
    }
    Ok(kills)
}

/// One web replica's processes and registry file.
struct WebReplica {
    name: String,
    app: usize,
    sidecar: usize,
    inbound: SocketAddr,
}

/// Crashes web replicas in turn: app and sidecar SIGKILLed, the registry
/// learns after a detection delay, then both restart and are marked ready.
async fn endpoint_chaos(
    mesh: Mesh,
    registry: Arc<Registry>,
    replicas: Vec<WebReplica>,
    period: Duration,
    end: Instant,
) -> anyhow::Result<u64> {
    let start = Instant::now() + period / 2;
    let mut kills = 0u64;
    while sleep_until_before(start + period * kills as u32, end).await {
        let r = &replicas[kills as usize % replicas.len()];
        mesh.kill(r.sidecar).await;
        mesh.kill(r.app).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        registry.replica("web", &r.name, r.inbound, false)?;
        mesh.note(format!("{} marked not ready", r.name));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        mesh.start(r.app).await.context("restarting an app")?;
        mesh.start(r.sidecar)
            .await
            .context("restarting a sidecar")?;
        registry.replica("web", &r.name, r.inbound, true)?;
        mesh.note(format!("{} marked ready", r.name));
        kills += 1;
    }
    Ok(kills)
}

/// Rewrites the `api` service's endpoints every `interval`: its two
/// replicas alone and together, changing weights, and a varying tail of
/// not-ready endpoints; every 10th write also creates or deletes a service.
async fn registry_churn(
    registry: Arc<Registry>,
    api: Vec<SocketAddr>,
    interval: Duration,
    end: Instant,
) -> anyhow::Result<u64> {
    let start = Instant::now();
    let mut writes = 0u64;
    while sleep_until_before(start + interval * writes as u32, end).await {
        let n = writes as usize;
        let live: Vec<SocketAddr> = match n % 3 {
            0 => vec![api[0]],
            1 => api.clone(),
            _ => vec![api[1]],
        };
        let mut endpoints: Vec<EndpointSpec> = live
            .iter()
            .map(|addr| EndpointSpec {
                identity: Some(identity("api").into()),
                weight: 1 + (n % 5) as u32,
                ..EndpointSpec::new(*addr)
            })
            .collect();
        // Never-ready endpoints on loopback ports nothing listens on.
        endpoints.extend((0..n % 40).map(|k| EndpointSpec {
            ready: false,
            ..EndpointSpec::new(SocketAddr::from(([127, 0, 1, 1 + k as u8], 1)))
        }));
        registry.endpoints("api.endpoints.yaml", "api", endpoints)?;
        if n.is_multiple_of(10) {
            let ghost = registry.dir.join("ghost.yaml");
            if ghost.exists() {
                std::fs::remove_file(ghost)?;
            } else {
                registry.service("ghost")?;
            }
        }
        writes += 1;
    }
    Ok(writes)
}

// === hostile clients ===

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Attack {
    /// An HTTP/1 request head one byte per second, its last header endless.
    SlowHttp1,
    /// The HTTP/2 preface, then a large SETTINGS frame, one byte per second.
    SlowHttp2,
    /// A TLS record header announcing 16 KiB, then one byte per second.
    SlowTls,
    /// Random bytes, then waiting to be hung up on.
    Garbage,
    /// Connections that send nothing.
    IdleFlood,
}

impl Attack {
    fn name(self) -> &'static str {
        match self {
            Attack::SlowHttp1 => "slow h1",
            Attack::SlowHttp2 => "slow h2",
            Attack::SlowTls => "slow tls",
            Attack::Garbage => "garbage",
            Attack::IdleFlood => "idle flood",
        }
    }

    /// What a slow attack trickles; empty for the others.
    fn drip(self) -> Vec<u8> {
        let (head, filler): (Vec<u8>, u8) = match self {
            Attack::SlowHttp1 => (
                format!("GET / HTTP/1.1\r\nHost: {}\r\nX-Slow: ", authority("web")).into_bytes(),
                b'a',
            ),
            Attack::SlowHttp2 => {
                let mut head = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
                // A SETTINGS frame of 1,000 settings (6,000 bytes) on stream 0.
                head.extend([0x00, 0x17, 0x70, 0x04, 0x00, 0, 0, 0, 0]);
                (head, 0)
            }
            Attack::SlowTls => (vec![0x16, 0x03, 0x01, 0x40, 0x00], 0),
            Attack::Garbage | Attack::IdleFlood => return Vec::new(),
        };
        head.into_iter()
            .chain(std::iter::repeat_n(filler, ATTACK_LIMIT.as_secs() as usize))
            .collect()
    }
}

/// Longest a hostile connection may stay open before the harness gives up
/// and counts it against the server: above every timeout the servers
/// should apply (header read 5 s, TLS handshake 10 s, idle 20 s).
const ATTACK_LIMIT: Duration = Duration::from_secs(30);
const FLOOD_CONNECTIONS: usize = 32;
/// Attacks open at once on one target, at most.
const MAX_ATTACKS_PER_TARGET: usize = 2;

#[derive(Clone, Copy)]
struct Target {
    name: &'static str,
    addr: SocketAddr,
    attacks: &'static [Attack],
}

/// A plaintext listener detecting HTTP/1 and HTTP/2.
const HTTP: &[Attack] = &[
    Attack::SlowHttp1,
    Attack::SlowHttp2,
    Attack::Garbage,
    Attack::IdleFlood,
];
const GRPC: &[Attack] = &[Attack::SlowHttp2, Attack::Garbage, Attack::IdleFlood];
const TLS: &[Attack] = &[Attack::SlowTls, Attack::Garbage, Attack::IdleFlood];
/// Admin listeners hold 32 connections: a flood would only lock out the harness.
const ADMIN: &[Attack] = &[Attack::SlowHttp1, Attack::Garbage];

#[derive(Clone, Copy, Default)]
struct AttackStats {
    connections: u64,
    /// Connect failed (the target was down: a restart in progress).
    refused: u64,
    closed_by_server: u64,
    /// Still open at ATTACK_LIMIT: the server never hung up.
    outlived: u64,
    max_open: Duration,
}

type HostileStats = Arc<Mutex<BTreeMap<(&'static str, Attack), AttackStats>>>;

enum Fate {
    Refused,
    Closed(Duration),
    Outlived,
}

/// Connects, writes `first` at once and `drip` one byte per second, and
/// reads until the server hangs up or ATTACK_LIMIT passes.
async fn until_hung_up(addr: SocketAddr, first: &[u8], drip: &[u8]) -> Fate {
    let connected = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr)).await;
    let Ok(Ok(mut conn)) = connected else {
        return Fate::Refused;
    };
    let opened = Instant::now();
    if conn.write_all(first).await.is_err() {
        return Fate::Closed(opened.elapsed());
    }
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut buf = [0u8; 1024];
    let mut next = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if opened.elapsed() >= ATTACK_LIMIT {
                    return Fate::Outlived;
                }
                if let Some(b) = drip.get(next) {
                    next += 1;
                    if conn.write_all(&[*b]).await.is_err() {
                        return Fate::Closed(opened.elapsed());
                    }
                }
            }
            r = conn.read(&mut buf) => {
                if matches!(r, Ok(0) | Err(_)) {
                    return Fate::Closed(opened.elapsed());
                }
            }
        }
    }
}

async fn attack(addr: SocketAddr, kind: Attack) -> Vec<Fate> {
    match kind {
        Attack::IdleFlood => {
            futures::future::join_all((0..FLOOD_CONNECTIONS).map(|_| until_hung_up(addr, &[], &[])))
                .await
        }
        Attack::Garbage => {
            let bytes: Vec<u8> = {
                let mut rng = rand::rng();
                let len = rng.random_range(1..=8192);
                (0..len).map(|_| rng.random()).collect()
            };
            vec![until_hung_up(addr, &bytes, &[]).await]
        }
        slow => vec![until_hung_up(addr, &[], &slow.drip()).await],
    }
}

/// Launches one attack per target every `interval`, rotating through the
/// target's attacks, with at most MAX_ATTACKS_PER_TARGET open on each.
async fn hostile(targets: Vec<Target>, stats: HostileStats, interval: Duration, end: Instant) {
    let permits: Vec<_> = targets
        .iter()
        .map(|_| Arc::new(tokio::sync::Semaphore::new(MAX_ATTACKS_PER_TARGET)))
        .collect();
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let mut launched = vec![0usize; targets.len()];
    let mut round = 0u32;
    while sleep_until_before(start + interval * round, end).await {
        for ((target, launched), permits) in targets.iter().zip(&mut launched).zip(&permits) {
            let Ok(permit) = permits.clone().try_acquire_owned() else {
                continue;
            };
            let kind = target.attacks[*launched % target.attacks.len()];
            *launched += 1;
            let (target, stats) = (*target, stats.clone());
            tasks.spawn(async move {
                let fates = attack(target.addr, kind).await;
                let mut stats = stats.lock().unwrap();
                let entry = stats.entry((target.name, kind)).or_default();
                for fate in fates {
                    entry.connections += 1;
                    match fate {
                        Fate::Refused => entry.refused += 1,
                        Fate::Closed(after) => {
                            entry.closed_by_server += 1;
                            entry.max_open = entry.max_open.max(after);
                        }
                        Fate::Outlived => entry.outlived += 1,
                    }
                }
                drop(permit);
            });
        }
        while tasks.try_join_next().is_some() {}
        round += 1;
    }
    // Each attack ends by itself within ATTACK_LIMIT.
    while tasks.join_next().await.is_some() {}
}

// === the run ===

struct Layout {
    controls: Vec<usize>,
    control_grpc: Vec<SocketAddr>,
    control_admin: Vec<SocketAddr>,
    web: Vec<WebReplica>,
    api_inbound: Vec<SocketAddr>,
    client_outbound: SocketAddr,
    client_admin: SocketAddr,
}

/// Builds and starts the mesh: two control-plane replicas sharing the
/// registry, `web` (3 replicas) and `api` (2), each an app behind an mTLS
/// sidecar, and a client sidecar the load goes through.
async fn start_mesh(
    args: &Args,
    mesh: &Mesh,
    registry: &Registry,
    dir: &Path,
) -> anyhow::Result<Layout> {
    let ca = dir.join("identity");
    tether_identity::ca::init(&tether_identity::ca::InitOptions::new(&ca, "cluster.local"))?;
    let tokens = tether_identity::token::LocalTokens::load(&ca)?;
    registry.service("web")?;
    registry.service("api")?;

    let mut ports = reserve_ports(2 * 2 + (WEB_REPLICAS + API_REPLICAS) * 3 + 2)?.into_iter();
    let mut port = || ports.next().expect("reserved enough ports");
    let control_grpc: Vec<SocketAddr> = (0..2).map(|_| port()).collect();
    let control_admin: Vec<SocketAddr> = (0..2).map(|_| port()).collect();
    let mut controls = Vec::new();
    for (c, (grpc, admin)) in control_grpc.iter().zip(&control_admin).enumerate() {
        let argv = vec![
            s("control"),
            s("--registry"),
            s(registry.dir.display()),
            s("--grpc"),
            s(grpc),
            s("--admin"),
            s(admin),
            s("--identity"),
            s(ca.display()),
            s("--identity-leaf-lifetime"),
            s(args.leaf_lifetime),
            s("--audit-interval"),
            s(1),
        ];
        let i = mesh.add(
            &format!("control-{c}"),
            argv,
            &["grpc", "admin"],
            Some(*admin),
        );
        mesh.start(i).await?;
        controls.push(i);
    }
    let control_list = control_grpc.iter().map(s).collect::<Vec<_>>().join(",");
    let proxy_argv =
        |account: &str, outbound: String, admin: SocketAddr| -> anyhow::Result<Vec<String>> {
            let id = identity(account);
            let token = dir.join(format!("{account}.token"));
            std::fs::write(&token, tokens.issue(&id))?;
            Ok(vec![
                s("proxy"),
                s("--control"),
                control_list.clone(),
                s("--outbound"),
                outbound,
                s("--admin"),
                s(admin),
                s("--identity"),
                id,
                s("--identity-token-file"),
                s(token.display()),
                s("--trust-root"),
                s(ca.join("ca.crt").display()),
                s("--tls"),
                s("mandatory"),
                s("--header-read-timeout"),
                s(HEADER_READ_TIMEOUT),
                s("--idle-timeout"),
                s(IDLE_TIMEOUT),
            ])
        };
    let mut web = Vec::new();
    let mut api_inbound = Vec::new();
    // App latency keeps requests in flight on a replica when it crashes:
    // those are the ones retries must save.
    for (service, replicas, latency_ms) in [("web", WEB_REPLICAS, 20), ("api", API_REPLICAS, 5)] {
        for r in 0..replicas {
            let name = format!("{service}-{r}");
            let (listen, inbound, admin) = (port(), port(), port());
            let app = mesh.add(
                &name,
                vec![
                    s("demo-app"),
                    s("--listen"),
                    s(listen),
                    s("--service"),
                    s(service),
                    s("--replica"),
                    name.clone(),
                    s("--latency-ms"),
                    s(latency_ms),
                ],
                &["http"],
                None,
            );
            mesh.start(app).await?;
            let mut argv = proxy_argv(service, s("127.0.0.1:0"), admin)?;
            argv.extend([s("--inbound"), s(inbound), s("--app"), s(listen)]);
            let sidecar = mesh.add(
                &format!("{name}-proxy"),
                argv,
                &["inbound", "admin"],
                Some(admin),
            );
            mesh.start(sidecar).await?;
            if service == "web" {
                registry.replica(service, &name, inbound, true)?;
                web.push(WebReplica {
                    name,
                    app,
                    sidecar,
                    inbound,
                });
            } else {
                api_inbound.push(inbound);
            }
        }
    }
    registry.endpoints(
        "api.endpoints.yaml",
        "api",
        api_inbound
            .iter()
            .map(|a| EndpointSpec {
                identity: Some(identity("api").into()),
                ..EndpointSpec::new(*a)
            })
            .collect(),
    )?;
    let (client_outbound, client_admin) = (port(), port());
    let client = mesh.add(
        "client-proxy",
        proxy_argv("client", s(client_outbound), client_admin)?,
        &["outbound", "admin"],
        Some(client_admin),
    );
    mesh.start(client).await?;
    for service in ["web", "api"] {
        let mut ok = false;
        for _ in 0..200 {
            let spec = load_spec(
                client_outbound,
                service,
                LoadProtocol::Http1,
                50.0,
                Duration::from_millis(100),
            );
            let r = loadgen::run(spec, Shutdown::default()).await?;
            if r.sent > 0 && r.failed == 0 {
                ok = true;
                break;
            }
        }
        anyhow::ensure!(
            ok,
            "{service} never answered through the client proxy; logs in {}",
            dir.display()
        );
    }
    Ok(Layout {
        controls,
        control_grpc,
        control_admin,
        web,
        api_inbound,
        client_outbound,
        client_admin,
    })
}

fn load_spec(
    connect: SocketAddr,
    service: &str,
    protocol: LoadProtocol,
    rps: f64,
    duration: Duration,
) -> LoadSpec {
    LoadSpec {
        connect,
        authority: authority(service),
        path: "/".into(),
        protocol,
        rate: Some(rps),
        duration,
        concurrency: 512,
        request_ids: false,
    }
}

/// Runs `tether diagnostics endpoints` for `service` against both replicas
/// and the registry: whether they all agree, and what it said otherwise.
fn replicas_agree(
    exe: &Path,
    service: &str,
    controls: &[SocketAddr],
    registry: &Path,
) -> (bool, String) {
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["diagnostics", "endpoints", &authority(service)]);
    for c in controls {
        cmd.args(["--control", &c.to_string()]);
    }
    cmd.args(["--registry", &registry.display().to_string()]);
    match cmd.output() {
        Ok(out) => (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        ),
        Err(e) => (false, format!("running tether diagnostics: {e}")),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    let args = parse_args()?;
    let run = Duration::from_secs_f64(args.minutes * 60.0);
    let dir = std::env::temp_dir().join(format!("tether-bench-soak-{}", std::process::id()));
    let registry = Arc::new(Registry {
        dir: dir.join("registry"),
    });
    std::fs::create_dir_all(&registry.dir)?;
    let mesh = Mesh {
        exe: args.tether.clone(),
        logs: dir.join("logs"),
        slots: Arc::default(),
        timeline: Arc::default(),
    };
    std::fs::create_dir_all(&mesh.logs)?;
    let Layout {
        controls,
        control_grpc,
        control_admin,
        web,
        api_inbound,
        client_outbound,
        client_admin,
    } = start_mesh(&args, &mesh, &registry, &dir).await?;
    println!(
        "soak: {:.1} min, {} req/s GET to web + {} req/s to api through a client proxy; logs in {}",
        args.minutes,
        args.rps,
        args.rps / 4.0,
        dir.display()
    );

    let started = Instant::now();
    let warm_up = started + run / 5;
    // Chaos ends a little before the load, so the last restarts finish under load.
    let chaos_end = started + run.saturating_sub(Duration::from_secs(10));
    let loads = [
        ("web", LoadProtocol::Http1, args.rps),
        ("api", LoadProtocol::Http2, args.rps / 4.0),
    ]
    .map(|(service, protocol, rps)| {
        let spec = load_spec(client_outbound, service, protocol, rps, run);
        tokio::spawn(loadgen::run(spec, Shutdown::default()))
    });
    let control_kills = tokio::spawn(control_chaos(
        mesh.clone(),
        controls,
        Duration::from_secs(20),
        chaos_end,
    ));
    let web_targets: Vec<SocketAddr> = web.iter().map(|r| r.inbound).collect();
    let endpoint_kills = tokio::spawn(endpoint_chaos(
        mesh.clone(),
        registry.clone(),
        web,
        Duration::from_secs(15),
        chaos_end,
    ));
    let registry_writes = tokio::spawn(registry_churn(
        registry.clone(),
        api_inbound.clone(),
        Duration::from_millis(200),
        chaos_end,
    ));
    let hostile_stats = HostileStats::default();
    let targets = vec![
        Target {
            name: "client outbound",
            addr: client_outbound,
            attacks: HTTP,
        },
        Target {
            name: "web-0 inbound (mTLS)",
            addr: web_targets[0],
            attacks: TLS,
        },
        Target {
            name: "api-0 inbound (mTLS)",
            addr: api_inbound[0],
            attacks: TLS,
        },
        Target {
            name: "control-0 gRPC",
            addr: control_grpc[0],
            attacks: GRPC,
        },
        Target {
            name: "client admin",
            addr: client_admin,
            attacks: ADMIN,
        },
    ];
    let hostile_task = tokio::spawn(hostile(
        targets,
        hostile_stats.clone(),
        Duration::from_secs(2),
        chaos_end,
    ));
    let sampler = {
        let mesh = mesh.clone();
        let settle = (run / 5).min(Duration::from_secs(20));
        tokio::spawn(async move {
            while Instant::now() < started + run {
                mesh.sample_rss(warm_up, settle);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };

    let events = Events {
        control_kills: control_kills.await??,
        endpoint_kills: endpoint_kills.await??,
        registry_writes: registry_writes.await??,
    };
    let mut report = Vec::new();
    for (load, service) in loads.into_iter().zip(["web", "api"]) {
        report.push((service, load.await??));
    }
    sampler.await?;
    mesh.sample_rss(warm_up, Duration::ZERO);
    hostile_task.await?;

    // One more audit on each replica, now that everything is quiet.
    for admin in &control_admin {
        let _ = http_get(*admin, "/audit").await;
    }
    let scrapes = mesh.all_scrapes().await;
    let divergent_now: u64 = {
        let mut sum = 0;
        for admin in &control_admin {
            if let Ok((_, text)) = http_get(*admin, "/metrics").await {
                sum += metric_sum(&text, "tether_destination_divergent_subscriptions", &[]) as u64;
            }
        }
        sum
    };
    let agreement: Vec<(&str, bool, String)> = ["web", "api"]
        .into_iter()
        .map(|svc| {
            let (ok, text) = replicas_agree(&args.tether, svc, &control_grpc, &registry.dir);
            (svc, ok, text)
        })
        .collect();

    let timeline: Vec<(f64, String)> = mesh
        .timeline
        .lock()
        .unwrap()
        .iter()
        .map(|(at, what)| {
            // Set-up events come before the load started: negative times.
            let since = at.saturating_duration_since(started).as_secs_f64();
            let before = started.saturating_duration_since(*at).as_secs_f64();
            (since - before, what.clone())
        })
        .collect();
    let lines: Vec<String> = timeline
        .iter()
        .map(|(t, w)| format!("{t:9.3} s  {w}"))
        .collect();
    std::fs::write(mesh.logs.join("timeline.log"), lines.join("\n") + "\n")?;
    let hostile = hostile_stats.lock().unwrap().clone();
    let verdict = print_report(
        &args,
        &Outcome {
            run,
            loads: report,
            events,
            scrapes,
            divergent_now,
            agreement,
            hostile,
            timeline,
        },
        &mesh,
    );
    mesh.stop_all().await;
    if verdict {
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            eprintln!("removing {}: {e}", dir.display());
        }
        Ok(ExitCode::SUCCESS)
    } else {
        println!("logs kept in {}", dir.display());
        Ok(ExitCode::FAILURE)
    }
}

/// What a run measured.
struct Outcome {
    run: Duration,
    loads: Vec<(&'static str, LoadReport)>,
    events: Events,
    /// Every incarnation's last scrape.
    scrapes: Vec<String>,
    /// Divergent subscriptions at the last audit of each live replica.
    divergent_now: u64,
    /// Per service: whether `tether diagnostics` found replicas and registry
    /// agreeing, and what it printed.
    agreement: Vec<(&'static str, bool, String)>,
    hostile: BTreeMap<(&'static str, Attack), AttackStats>,
    /// Seconds since the load started, and what happened.
    timeline: Vec<(f64, String)>,
}

/// Prints the figures and the PASS/FAIL lines; whether everything passed.
fn print_report(args: &Args, o: &Outcome, mesh: &Mesh) -> bool {
    let Outcome {
        run,
        loads,
        events,
        scrapes,
        divergent_now,
        agreement,
        hostile,
        timeline,
    } = o;
    let (run, divergent_now) = (*run, *divergent_now);
    println!(
        "\nevents in {:.0} s: {} control-plane kills, {} endpoint crashes, {} registry writes, certificates renewed {} times (leaf lifetime {} s; {} attempts failed and were retried)",
        run.as_secs_f64(),
        events.control_kills,
        events.endpoint_kills,
        events.registry_writes,
        total(scrapes, "tether_identity_renewals_total", &[("outcome", "ok")]),
        args.leaf_lifetime,
        total(scrapes, "tether_identity_renewals_total", &[("outcome", "error")]),
    );

    println!(
        "\n{:<6} {:>5} {:>9} {:>7} {:>9} {:>8} {:>8} {:>8}",
        "load", "proto", "sent", "failed", "retried", "p50 ms", "p99 ms", "max ms"
    );
    let mut failed = 0;
    for ((service, r), proto) in loads.iter().zip(["h1", "h2"]) {
        failed += r.failed;
        let retried = total(
            scrapes,
            "tether_proxy_retries_total",
            &[("authority", &authority(service)), ("outcome", "retried")],
        );
        println!(
            "{:<6} {:>5} {:>9} {:>7} {:>9} {:>8.1} {:>8.1} {:>8.1}",
            service,
            proto,
            r.sent,
            r.failed,
            retried,
            r.quantile_ms(0.5),
            r.quantile_ms(0.99),
            r.latency.max() as f64 / 1000.0
        );
        for (error, n) in &r.errors {
            println!("         {n} × {error}");
        }
        if let Some((first, last)) = r.failures_between {
            let (first, last) = (first.as_secs_f64(), last.as_secs_f64());
            println!("         sent between {first:.3} s and {last:.3} s; around then:");
            for (at, what) in timeline
                .iter()
                .filter(|(at, _)| *at > first - 3.0 && *at < last + 3.0)
            {
                println!("           {at:9.3} s  {what}");
            }
        }
    }
    let budget_refused = total(
        scrapes,
        "tether_proxy_retries_total",
        &[("outcome", "budget_exhausted")],
    );
    if budget_refused > 0 {
        println!("retries the budget refused: {budget_refused}");
    }

    let audits = total(scrapes, "tether_destination_audits_total", &[]);
    let repairs = total(scrapes, "tether_destination_audit_repairs_total", &[]);
    println!(
        "\naudit: {audits} audits over every replica incarnation, {repairs} stale subscriptions repaired, {divergent_now} divergent at the end"
    );
    for (svc, ok, text) in agreement {
        let verdict = if *ok { "agree" } else { "DIFFER" };
        println!("replicas and registry for {svc}: {verdict}");
        if !ok {
            println!("{text}");
        }
    }

    println!(
        "\nhostile clients (closed: by the server; outlived: still open after {} s):",
        ATTACK_LIMIT.as_secs()
    );
    println!(
        "{:<22} {:<10} {:>6} {:>8} {:>7} {:>9} {:>14}",
        "target", "attack", "conns", "refused", "closed", "outlived", "longest open s"
    );
    let mut outlived = Vec::new();
    for ((target, kind), st) in hostile {
        if st.outlived > 0 {
            outlived.push(format!("{target} {} ×{}", kind.name(), st.outlived));
        }
        println!(
            "{:<22} {:<10} {:>6} {:>8} {:>7} {:>9} {:>14.1}",
            target,
            kind.name(),
            st.connections,
            st.refused,
            st.closed_by_server,
            st.outlived,
            st.max_open.as_secs_f64()
        );
    }
    for (metric, label) in [
        ("tether_proxy_inbound_refused_total", "reason"),
        ("tether_proxy_outbound_refused_total", "reason"),
        ("tether_proxy_connections_closed_total", "reason"),
    ] {
        let mut by: BTreeMap<String, u64> = BTreeMap::new();
        for s in scrapes.iter().flat_map(|s| tether_core::prom::parse(s)) {
            if s.name == metric {
                *by.entry(s.label(label).unwrap_or("").to_string())
                    .or_default() += s.value as u64;
            }
        }
        if !by.is_empty() {
            let parts: Vec<String> = by.iter().map(|(k, v)| format!("{k} {v}")).collect();
            println!("{metric}: {}", parts.join(", "));
        }
    }

    // RSS: an incarnation counts when it was measured over at least a tenth of the run.
    let min_span = (run / 10).max(Duration::from_secs(10));
    println!(
        "\nRSS after warm-up → at the end (or just before a kill); lives measured over ≥ {:.0} s count:",
        min_span.as_secs_f64()
    );
    println!(
        "{:<14} {:>6} {:>9} {:>9} {:>8} {:>7} {:>9}",
        "process", "lives", "warm MiB", "end MiB", "growth", "span s", "log KiB"
    );
    let mut rss_ok = true;
    for slot in mesh.slots.lock().unwrap().iter() {
        let measured = slot.lives.iter().filter_map(|l| {
            let ((t0, base), (t1, last)) = (l.baseline_kib?, l.last_kib?);
            (t1 - t0 >= min_span).then_some((base, last, t1 - t0))
        });
        let worst =
            measured.max_by(|a, b| (a.1 as f64 / a.0 as f64).total_cmp(&(b.1 as f64 / b.0 as f64)));
        // Every incarnation's log: a process that logs without bound shows here.
        let log_kib: u64 = (0..slot.lives.len())
            .filter_map(|n| {
                std::fs::metadata(mesh.logs.join(format!("{}.{n}.log", slot.name))).ok()
            })
            .map(|m| m.len() / 1024)
            .sum();
        let (warm, end, growth, span) = match worst {
            Some((base, last, span)) => {
                let growth = last as f64 / base as f64 - 1.0;
                rss_ok &= growth < RSS_GROWTH_LIMIT;
                (
                    format!("{:.1}", base as f64 / 1024.0),
                    format!("{:.1}", last as f64 / 1024.0),
                    format!("{:.1}%", growth * 100.0),
                    format!("{:.0}", span.as_secs_f64()),
                )
            }
            None => ("-".into(), "-".into(), "-".into(), "short".into()),
        };
        println!(
            "{:<14} {:>6} {warm:>9} {end:>9} {growth:>8} {span:>7} {log_kib:>9}",
            slot.name,
            slot.lives.len(),
        );
    }

    let audit_ok = repairs == 0 && divergent_now == 0 && agreement.iter().all(|a| a.1);
    let checks = [
        (failed == 0, format!("0 failed idempotent requests ({failed} failed)")),
        (audit_ok, format!("audit clean ({repairs} repairs, {divergent_now} divergent, replicas agree with the registry: {})", agreement.iter().all(|a| a.1))),
        (rss_ok, format!("RSS growth under {:.0}% after warm-up", RSS_GROWTH_LIMIT * 100.0)),
        (
            outlived.is_empty(),
            format!(
                "every hostile connection closed by the server within {} s{}",
                ATTACK_LIMIT.as_secs(),
                if outlived.is_empty() {
                    String::new()
                } else {
                    format!(" (still open: {})", outlived.join(", "))
                }
            ),
        ),
    ];
    println!();
    for (ok, what) in &checks {
        println!("{} {what}", if *ok { "PASS" } else { "FAIL" });
    }
    checks.iter().all(|c| c.0)
}
