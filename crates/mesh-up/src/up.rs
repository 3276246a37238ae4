//! The orchestrator behind `tether up`.
//!
//! For each cluster of the manifest (one, unnamed, for a plain manifest) it
//! starts, in order: the control plane over a fresh registry directory
//! (with its export API and links when there are several clusters); the
//! gateway (multicluster); for every replica, a demo app and its sidecar,
//! then the registry document that makes the replica an endpoint; and a
//! client sidecar for the load generator. Then it runs the load, prints
//! live traffic read from every proxy's metrics, carries out kill/revive
//! events (scripted in the manifest, or typed on stdin), and on Ctrl-C or
//! after `--duration` stops the load, prints a summary, withdraws every
//! endpoint and stops every process.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use tether_admin::Shutdown;
use tether_core::registry::{Document, EndpointSpec, EndpointsDoc, PortSpec, ServiceDoc};
use tokio::io::AsyncBufReadExt;

use crate::loadgen::{self, LoadReport, LoadSpec};
use crate::manifest::{ClusterSpec, Manifest};
use crate::process::{Process, ProxyCommand};
use crate::stats;
use tether_viz::state::{ClusterState, LinkState, MeshState, ProxyState, Role};

/// Removes the state file if this process wrote it (another `tether up`
/// may have replaced it since).
fn remove_state(path: &Path) {
    if MeshState::load(path).is_ok_and(|s| s.pid == std::process::id()) {
        let _ = std::fs::remove_file(path);
        let _ = std::fs::remove_file(MeshState::targets_path(path));
    }
}

/// Writes the state file and, beside it, Prometheus `file_sd` targets.
fn save_state(state: &MeshState, path: &Path) -> anyhow::Result<()> {
    state.save(path)?;
    let targets = MeshState::targets_path(path);
    let tmp = targets.with_extension("tmp");
    std::fs::write(&tmp, state.prometheus_targets().to_string())?;
    std::fs::rename(&tmp, &targets).with_context(|| format!("writing {}", targets.display()))
}

pub struct UpConfig {
    /// The `tether` binary, to start the pieces.
    pub exe: PathBuf,
    /// What runs the sidecars: `tether-proxy` beside `exe` when there,
    /// else `tether proxy` ([`ProxyCommand::beside`]).
    pub proxy: ProxyCommand,
    pub manifest: Manifest,
    /// Run headless for this long; `None` runs until Ctrl-C.
    pub duration: Option<Duration>,
    /// How often to print live traffic.
    pub interval: Duration,
    /// Print the summary as one JSON line too (for scripts and benchmarks).
    pub json: bool,
    /// Where to write the mesh state file (`tether stat`, `tap`, `dashboard` read it).
    pub state: PathBuf,
}

/// The outcome of a run: the load generator's totals.
pub struct UpOutcome {
    pub report: LoadReport,
}

/// Writes a registry document the safe way: a temporary file, then rename.
pub fn write_document(dir: &Path, file: &str, doc: &Document) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{file}.tmp"));
    std::fs::write(&tmp, doc.to_yaml())?;
    std::fs::rename(tmp, dir.join(file))
}

/// The mesh's trust root and issuer, and the tokens handed to workloads.
struct Identity {
    dir: PathBuf,
    tokens_dir: PathBuf,
    tokens: tether_identity::token::LocalTokens,
}

impl Identity {
    fn create(run_dir: &Path, trust_domain: &str) -> anyhow::Result<Self> {
        let dir = run_dir.join("identity");
        tether_identity::ca::init(&tether_identity::ca::InitOptions::new(&dir, trust_domain))?;
        let tokens = tether_identity::token::LocalTokens::load(&dir)?;
        let tokens_dir = run_dir.join("tokens");
        std::fs::create_dir_all(&tokens_dir)?;
        Ok(Self {
            dir,
            tokens_dir,
            tokens,
        })
    }

    /// The flags giving a workload `identity`, writing its token file.
    fn args(&self, identity: &str) -> anyhow::Result<Vec<String>> {
        let token_file = self.tokens_dir.join(format!("{identity}.token"));
        std::fs::write(&token_file, self.tokens.issue(identity))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600))?;
        Ok(vec![
            "--identity".into(),
            identity.into(),
            "--identity-token-file".into(),
            token_file.display().to_string(),
            "--trust-root".into(),
            self.dir.join("ca.crt").display().to_string(),
        ])
    }
}

/// Waits until every proxy reports ready (it holds its certificate).
async fn wait_ready(admins: &[SocketAddr]) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    for admin in admins {
        loop {
            match stats::http_get(*admin, "/ready").await {
                Ok((200, _)) => break,
                Ok((_, body)) if Instant::now() > deadline => {
                    anyhow::bail!(
                        "proxy with admin {admin} not ready after 20s: {}",
                        body.trim()
                    )
                }
                Err(e) if Instant::now() > deadline => {
                    anyhow::bail!("proxy with admin {admin}: {e}")
                }
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
    Ok(())
}

struct Replica {
    name: String,
    service: String,
    namespace: String,
    identity: Option<String>,
    app_args: Vec<String>,
    app_addr: SocketAddr,
    app: Option<Process>,
    /// The sidecar's flags (for [`UpConfig::proxy`]).
    sidecar_args: Vec<String>,
    sidecar: Option<Process>,
    inbound: SocketAddr,
    endpoint_file: String,
}

impl Replica {
    fn document(&self, ready: bool) -> Document {
        Document::Endpoints(EndpointsDoc {
            service: self.service.clone(),
            namespace: self.namespace.clone(),
            endpoints: vec![EndpointSpec {
                ready,
                identity: self.identity.as_deref().map(Into::into),
                name: Some(self.name.as_str().into()),
                ..EndpointSpec::new(self.inbound)
            }],
        })
    }
}

struct Cluster {
    name: String,
    registry: PathBuf,
    replicas: Vec<Replica>,
    client_outbound: SocketAddr,
}

/// Everything running, so it can all be stopped.
struct Mesh {
    processes: Vec<Process>,
    clusters: Vec<Cluster>,
    admins: Vec<SocketAddr>,
    table: Vec<String>,
    /// What runs where, for the state file.
    state: MeshState,
}

impl Mesh {
    /// Records a proxy of the cluster started last.
    fn add_proxy(&mut self, proxy: ProxyState) {
        if let Some(c) = self.state.clusters.last_mut() {
            c.proxies.push(proxy);
        }
    }

    async fn stop(&mut self) {
        // Withdraw endpoints first, so nothing is routed to a stopping replica.
        for c in &self.clusters {
            for r in &c.replicas {
                let _ = std::fs::remove_file(c.registry.join(&r.endpoint_file));
            }
        }
        let mut stops = Vec::new();
        for c in &mut self.clusters {
            for r in &mut c.replicas {
                for p in [r.app.as_mut(), r.sidecar.as_mut()].into_iter().flatten() {
                    stops.push(p.stop(Duration::from_secs(5)));
                }
            }
        }
        for p in self.processes.iter_mut().rev() {
            stops.push(p.stop(Duration::from_secs(5)));
        }
        futures::future::join_all(stops).await;
    }

    /// Marks a cluster's replicas not ready, then stops their apps.
    async fn kill(&mut self, cluster: &str) -> anyhow::Result<()> {
        let c = self.cluster_mut(cluster)?;
        for r in &c.replicas {
            write_document(&c.registry, &r.endpoint_file, &r.document(false))?;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        for r in &mut c.replicas {
            if let Some(mut app) = r.app.take() {
                app.stop(Duration::from_secs(5)).await;
            }
        }
        println!("\n>>> killed every replica of cluster {cluster}");
        Ok(())
    }

    /// Kills a cluster's apps and sidecars at once; the registry learns
    /// after `detect_after`.
    async fn crash(&mut self, cluster: &str, detect_after: Duration) -> anyhow::Result<()> {
        let c = self.cluster_mut(cluster)?;
        for r in &mut c.replicas {
            for p in [r.app.as_mut(), r.sidecar.as_mut()].into_iter().flatten() {
                p.kill().await;
            }
            r.app = None;
            r.sidecar = None;
        }
        println!("\n>>> crashed every replica of cluster {cluster} (the registry learns in {detect_after:?})");
        let (registry, docs): (PathBuf, Vec<(String, Document)>) = (
            c.registry.clone(),
            c.replicas
                .iter()
                .map(|r| (r.endpoint_file.clone(), r.document(false)))
                .collect(),
        );
        tokio::spawn(async move {
            tokio::time::sleep(detect_after).await;
            for (file, doc) in docs {
                let _ = write_document(&registry, &file, &doc);
            }
        });
        Ok(())
    }

    /// Restarts a cluster's apps (and sidecars) on their old addresses, then
    /// marks them ready.
    async fn revive(
        &mut self,
        cluster: &str,
        config: &UpConfig,
        logs: &Path,
    ) -> anyhow::Result<()> {
        let c = self.cluster_mut(cluster)?;
        for r in &mut c.replicas {
            if r.sidecar.is_none() {
                let mut flags = r.sidecar_args.clone();
                if let Some(i) = flags.iter().position(|a| a == "--inbound") {
                    flags[i + 1] = r.inbound.to_string();
                }
                let log = logs.join(format!("{}-proxy.revived.log", r.name));
                let name = format!("{}-proxy", r.name);
                let (exe, args) = (config.proxy.exe(), config.proxy.args(&flags));
                r.sidecar =
                    Some(Process::spawn(exe, &name, &args, &log, &["inbound", "admin"]).await?);
            }
            if r.app.is_none() {
                let mut args = r.app_args.clone();
                if let Some(i) = args.iter().position(|a| a == "--listen") {
                    args[i + 1] = r.app_addr.to_string();
                }
                let log = logs.join(format!("{}.revived.log", r.name));
                r.app = Some(Process::spawn(&config.exe, &r.name, &args, &log, &["http"]).await?);
            }
            write_document(&c.registry, &r.endpoint_file, &r.document(true))?;
        }
        println!("\n>>> revived every replica of cluster {cluster}");
        Ok(())
    }

    fn cluster_mut(&mut self, name: &str) -> anyhow::Result<&mut Cluster> {
        self.clusters
            .iter_mut()
            .find(|c| c.name == name)
            .with_context(|| format!("no cluster named {name:?}"))
    }
}

pub async fn run(config: UpConfig, stop: Shutdown) -> anyhow::Result<UpOutcome> {
    let run_dir = std::env::temp_dir().join(format!("tether-up-{}", std::process::id()));
    let logs = run_dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let mut mesh = Mesh {
        processes: Vec::new(),
        clusters: Vec::new(),
        admins: Vec::new(),
        table: Vec::new(),
        state: MeshState {
            pid: std::process::id(),
            cluster_domain: config.manifest.cluster_domain.clone(),
            ..MeshState::default()
        },
    };
    let result = start_and_run(&config, &mut mesh, &run_dir, &logs, stop).await;
    remove_state(&config.state);
    mesh.stop().await;
    let _ = std::fs::remove_dir_all(&run_dir);
    result
}

/// Addresses fixed before the clusters start: (export API, gateway).
type Reserved = HashMap<String, (SocketAddr, SocketAddr)>;

struct Ctx<'a> {
    config: &'a UpConfig,
    logs: &'a Path,
    run_dir: &'a Path,
    identity: Option<Identity>,
    reserved: Reserved,
}

impl Ctx<'_> {
    fn log(&self, name: &str) -> PathBuf {
        self.logs.join(format!("{name}.log"))
    }

    async fn spawn(&self, name: &str, args: &[String], expect: &[&str]) -> anyhow::Result<Process> {
        Process::spawn(&self.config.exe, name, args, &self.log(name), expect).await
    }

    /// A sidecar proxy with `flags`, run by [`UpConfig::proxy`].
    async fn spawn_proxy(
        &self,
        name: &str,
        flags: &[String],
        expect: &[&str],
    ) -> anyhow::Result<Process> {
        let (exe, args) = (self.config.proxy.exe(), self.config.proxy.args(flags));
        Process::spawn(exe, name, &args, &self.log(name), expect).await
    }
}

async fn start_cluster(ctx: &Ctx<'_>, spec: &ClusterSpec, mesh: &mut Mesh) -> anyhow::Result<()> {
    let m = &ctx.config.manifest;
    let any = "127.0.0.1:0".to_string();
    let multicluster = !spec.name.is_empty();
    let prefix = if multicluster {
        format!("{}-", spec.name)
    } else {
        String::new()
    };
    let registry = ctx.run_dir.join(format!("{prefix}registry"));
    std::fs::create_dir_all(&registry)?;
    for s in &spec.services {
        let doc = Document::Service(ServiceDoc {
            global_id: s.global_id.clone(),
            mode: s.mode,
            ..ServiceDoc::new(&s.name, s.namespace(m), vec![PortSpec::http(s.port)])
        });
        write_document(
            &registry,
            &format!("{}.{}.service.yaml", s.name, s.namespace(m)),
            &doc,
        )?;
    }

    let mut control_args: Vec<String> = vec![
        "control".into(),
        "--registry".into(),
        registry.display().to_string(),
        "--grpc".into(),
        any.clone(),
        "--admin".into(),
        any.clone(),
        "--cluster-domain".into(),
        m.cluster_domain.clone(),
    ];
    match &ctx.identity {
        Some(id) => control_args.extend(["--identity".into(), id.dir.display().to_string()]),
        // No identity, no TLS anywhere: the proxies say the same.
        None => control_args.push("--insecure-control-plane".into()),
    }
    let gateway_identity =
        tether_identity::identity_name("tether-gateway", &spec.name, &m.cluster_domain);
    if multicluster {
        let (export, gateway) = ctx.reserved[&spec.name];
        control_args.extend([
            "--cluster".into(),
            spec.name.clone(),
            "--export".into(),
            export.to_string(),
            "--gateway-address".into(),
            gateway.to_string(),
            "--gateway-identity".into(),
            gateway_identity.clone(),
        ]);
        for link in &spec.links {
            let (export, gateway) = ctx.reserved[&link.cluster];
            control_args.extend([
                "--link".into(),
                format!(
                    "name={},export={export},gateway={gateway},priority={}",
                    link.cluster, link.priority
                ),
            ]);
        }
    }
    let mut expect = vec!["grpc", "admin"];
    if multicluster {
        expect.push("export");
    }
    let control = ctx
        .spawn(&format!("{prefix}control"), &control_args, &expect)
        .await?;
    let control_addr = control.addr("grpc");
    let where_ = if multicluster {
        format!("cluster {}", spec.name)
    } else {
        "control plane".into()
    };
    mesh.table.push(format!(
        "{where_}: grpc {control_addr}, admin http://{}/metrics, registry {}",
        control.addr("admin"),
        registry.display()
    ));
    mesh.state.clusters.push(ClusterState {
        name: spec.name.clone(),
        registry: registry.clone(),
        control_planes: vec![control.addr("admin")],
        links: spec
            .links
            .iter()
            .map(|l| LinkState {
                cluster: l.cluster.clone(),
                priority: l.priority,
            })
            .collect(),
        proxies: Vec::new(),
    });
    mesh.processes.push(control);

    if multicluster {
        let id = ctx
            .identity
            .as_ref()
            .context("multicluster needs identity")?;
        let mut args: Vec<String> = vec![
            "gateway".into(),
            "--control".into(),
            control_addr.to_string(),
            "--listen".into(),
            ctx.reserved[&spec.name].1.to_string(),
            "--admin".into(),
            any.clone(),
            "--trust-domain".into(),
            m.cluster_domain.clone(),
        ];
        args.extend(id.args(&gateway_identity)?);
        let gateway = ctx
            .spawn(&format!("{prefix}gateway"), &args, &["gateway", "admin"])
            .await?;
        mesh.table.push(format!(
            "  gateway {} (admin http://{}/metrics)",
            gateway.addr("gateway"),
            gateway.addr("admin")
        ));
        mesh.admins.push(gateway.addr("admin"));
        mesh.add_proxy(ProxyState {
            identity: Some(gateway_identity.clone()),
            tap: gateway.try_addr("tap"),
            ..ProxyState::new(
                format!("{prefix}gateway"),
                "tether".into(),
                Role::Gateway,
                gateway.addr("admin"),
            )
        });
        mesh.processes.push(gateway);
    }

    let proxy_args = |app: Option<SocketAddr>, identity: &str| -> anyhow::Result<Vec<String>> {
        let mut a: Vec<String> = vec![
            "--control".into(),
            control_addr.to_string(),
            "--outbound".into(),
            any.clone(),
            "--inbound".into(),
            any.clone(),
            "--admin".into(),
            any.clone(),
            "--tap".into(),
            any.clone(),
        ];
        if let Some(app) = app {
            a.extend(["--app".to_string(), app.to_string()]);
        }
        match &ctx.identity {
            Some(id) => {
                a.extend(id.args(identity)?);
                a.extend(["--tls".to_string(), "mandatory".to_string()]);
            }
            None => a.push("--insecure-control-plane".into()),
        }
        if !m.retries {
            a.extend(
                [
                    "--retry-budget-ratio",
                    "0",
                    "--retry-budget-min-per-second",
                    "0",
                ]
                .map(String::from),
            );
        }
        Ok(a)
    };

    let mut replicas = Vec::new();
    for s in &spec.services {
        let ns = s.namespace(m);
        for i in 0..s.replicas {
            let replica = format!("{prefix}{}-{i}", s.name);
            let app_args = vec![
                "demo-app".to_string(),
                "--listen".into(),
                any.clone(),
                "--service".into(),
                s.name.clone(),
                "--replica".into(),
                replica.clone(),
                "--latency-ms".into(),
                s.latency_ms.to_string(),
                "--error-rate".into(),
                s.error_rate.to_string(),
            ];
            let app = ctx.spawn(&replica, &app_args, &["http"]).await?;
            let app_addr = app.addr("http");
            let id_name = tether_identity::identity_name(&s.name, ns, &m.cluster_domain);
            let mut sidecar_args = proxy_args(Some(app_addr), &id_name)?;
            // The control plane answers its inbound policy for this workload.
            sidecar_args.extend(["--workload".into(), format!("{ns}/{replica}")]);
            let proxy = ctx
                .spawn_proxy(
                    &format!("{replica}-proxy"),
                    &sidecar_args,
                    &["outbound", "inbound", "admin", "tap"],
                )
                .await?;
            let inbound = proxy.addr("inbound");
            mesh.admins.push(proxy.addr("admin"));
            mesh.add_proxy(ProxyState {
                service: Some(s.name.clone()),
                outbound: Some(proxy.addr("outbound")),
                inbound: Some(proxy.addr("inbound")),
                tap: proxy.try_addr("tap"),
                identity: ctx.identity.as_ref().map(|_| id_name.clone()),
                ..ProxyState::new(
                    replica.clone(),
                    ns.to_string(),
                    Role::Sidecar,
                    proxy.addr("admin"),
                )
            });
            mesh.table.push(format!(
                "  {:<30} app {:<21} proxy inbound {:<21} admin http://{}/metrics",
                format!("{ns}/{replica}"),
                app_addr.to_string(),
                inbound.to_string(),
                proxy.addr("admin")
            ));
            let r = Replica {
                sidecar_args,
                sidecar: Some(proxy),
                name: replica.clone(),
                service: s.name.clone(),
                namespace: ns.to_string(),
                identity: ctx.identity.as_ref().map(|_| id_name.clone()),
                app_args,
                app_addr,
                app: Some(app),
                inbound,
                endpoint_file: format!("{replica}.{ns}.endpoints.yaml"),
            };
            write_document(&registry, &r.endpoint_file, &r.document(true))?;
            replicas.push(r);
        }
    }
    let client_id = tether_identity::identity_name("loadgen", &m.namespace, &m.cluster_domain);
    let client = ctx
        .spawn_proxy(
            &format!("{prefix}loadgen-proxy"),
            &proxy_args(None, &client_id)?,
            &["outbound", "admin", "tap"],
        )
        .await?;
    mesh.table.push(format!(
        "  {:<30} outbound {} admin http://{}/metrics",
        "loadgen",
        client.addr("outbound"),
        client.addr("admin")
    ));
    mesh.admins.push(client.addr("admin"));
    mesh.add_proxy(ProxyState {
        outbound: Some(client.addr("outbound")),
        tap: client.try_addr("tap"),
        identity: ctx.identity.as_ref().map(|_| client_id.clone()),
        ..ProxyState::new(
            format!("{prefix}loadgen"),
            m.namespace.clone(),
            Role::Client,
            client.addr("admin"),
        )
    });
    let client_outbound = client.addr("outbound");
    mesh.processes.push(client);
    mesh.clusters.push(Cluster {
        name: spec.name.clone(),
        registry,
        replicas,
        client_outbound,
    });
    Ok(())
}

enum Command {
    Kill(String),
    Revive(String),
}

/// Reads `kill CLUSTER` / `revive CLUSTER` lines from stdin.
fn stdin_commands() -> tokio::sync::mpsc::Receiver<Command> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let mut words = line.split_whitespace();
            let cmd = match (words.next(), words.next()) {
                (Some("kill"), Some(c)) => Command::Kill(c.to_string()),
                (Some("revive"), Some(c)) => Command::Revive(c.to_string()),
                (None, _) => continue,
                _ => {
                    println!(">>> commands: `kill CLUSTER`, `revive CLUSTER`");
                    continue;
                }
            };
            if tx.send(cmd).await.is_err() {
                return;
            }
        }
    });
    rx
}

async fn start_and_run(
    config: &UpConfig,
    mesh: &mut Mesh,
    run_dir: &Path,
    logs: &Path,
    stop: Shutdown,
) -> anyhow::Result<UpOutcome> {
    let m = &config.manifest;
    let specs = m.cluster_specs();
    let mut reserved = Reserved::new();
    let named: Vec<_> = specs.iter().filter(|s| !s.name.is_empty()).collect();
    let ports = crate::ports::reserve_ports(2 * named.len())?;
    for (s, pair) in named.iter().zip(ports.chunks_exact(2)) {
        reserved.insert(s.name.clone(), (pair[0], pair[1]));
    }
    let identity = if m.identity {
        Some(Identity::create(run_dir, &m.cluster_domain)?)
    } else {
        None
    };
    let ctx = Ctx {
        config,
        logs,
        run_dir,
        identity,
        reserved,
    };
    for spec in &specs {
        start_cluster(&ctx, spec, mesh).await?;
    }
    wait_ready(&mesh.admins).await?;

    println!("tether up: mesh running");
    match &ctx.identity {
        Some(id) => println!(
            "  identity: mTLS between every pair of proxies (--tls mandatory), trust root {}",
            id.dir.join("ca.crt").display()
        ),
        None => println!("  identity: off (plaintext between proxies)"),
    }
    println!("  logs:     {}", logs.display());
    println!("  proxies:  {}", config.proxy.describe());
    // The dashboard reads the state file at every sample: it may start first.
    let state_arg = config.state.display().to_string();
    let dashboard = ctx
        .spawn(
            "dashboard",
            &[
                "dashboard",
                "--state",
                &state_arg,
                "--listen",
                "127.0.0.1:0",
            ]
            .map(String::from),
            &["dashboard"],
        )
        .await?;
    let url = format!("http://{}/", dashboard.addr("dashboard"));
    mesh.processes.push(dashboard);
    mesh.state.dashboard = Some(url.clone());
    save_state(&mesh.state, &config.state)?;
    println!("  dashboard: {url}");
    println!(
        "  state:    {} (read by `tether stat`, `tether tap`, `tether dashboard`)",
        config.state.display()
    );
    for line in &mesh.table {
        println!("  {line}");
    }
    let multicluster = !m.clusters.is_empty();
    if multicluster {
        println!("  type `kill CLUSTER` or `revive CLUSTER` and Enter to kill or revive a cluster's replicas");
    }
    match config.duration {
        Some(d) => println!("running load for {}s (headless)", d.as_secs_f64()),
        None => println!("running load; press Ctrl-C to stop"),
    }

    let duration = config
        .duration
        .unwrap_or(Duration::from_secs(365 * 24 * 3600));
    let mut loads = Vec::new();
    for l in &m.load {
        let cluster = mesh
            .clusters
            .iter()
            .find(|c| c.name == l.cluster.clone().unwrap_or_default())
            .expect("validated");
        let spec = specs
            .iter()
            .find(|s| s.name == cluster.name)
            .expect("validated");
        let svc = spec
            .services
            .iter()
            .find(|s| s.name == l.service)
            .expect("validated");
        let load = LoadSpec {
            connect: cluster.client_outbound,
            authority: format!(
                "{}.{}.svc.{}:{}",
                svc.name,
                svc.namespace(m),
                m.cluster_domain,
                svc.port
            ),
            path: "/".into(),
            protocol: l.protocol,
            rate: Some(l.rps),
            duration,
            concurrency: 256,
            request_ids: false,
        };
        loads.push(tokio::spawn(loadgen::run(load, stop.clone())));
    }

    let mut commands = stdin_commands();
    let mut events: Vec<_> = m.events.clone();
    events.sort_by(|a, b| a.at.total_cmp(&b.at));
    let mut events = events.into_iter().peekable();
    let started = Instant::now();
    let mut before = stats::scrape(&mesh.admins).await;
    let mut at = Instant::now();
    let mut tick = tokio::time::interval(config.interval);
    tick.tick().await;
    while !loads.iter().all(|l| l.is_finished()) {
        let due = events
            .peek()
            .is_some_and(|e| started.elapsed().as_secs_f64() >= e.at);
        if due {
            let e = events.next().expect("peeked");
            match (&e.kill, &e.crash, &e.revive) {
                (Some(c), _, _) => mesh.kill(c).await?,
                (_, Some(c), _) => {
                    mesh.crash(c, Duration::from_secs_f64(e.detect_after))
                        .await?
                }
                (_, _, Some(c)) => mesh.revive(c, config, logs).await?,
                _ => {}
            }
            continue;
        }
        tokio::select! {
            _ = tick.tick() => {
                let after = stats::scrape(&mesh.admins).await;
                let now = Instant::now();
                println!("\n[{:>5.0}s] live traffic (from proxy metrics)", started.elapsed().as_secs_f64());
                print!("{}", stats::render(&stats::rows(&before, &after, now - at)));
                before = after;
                at = now;
            }
            Some(cmd) = commands.recv() => {
                let done = match cmd {
                    Command::Kill(c) => mesh.kill(&c).await,
                    Command::Revive(c) => mesh.revive(&c, config, logs).await,
                };
                if let Err(e) = done {
                    println!(">>> {e}");
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    let mut total = LoadReport::default();
    println!("\nsummary (load generator's view):");
    for (l, h) in m.load.iter().zip(loads) {
        let report = h.await??;
        println!(
            "  {:<10} {:<6} sent {:>7}  succeeded {:>7}  failed {:>5}  p50 {:>7.2}ms  p99 {:>7.2}ms  replicas {:?}",
            l.service,
            format!("{:?}", l.protocol).to_lowercase(),
            report.sent,
            report.succeeded,
            report.failed,
            report.quantile_ms(0.5),
            report.quantile_ms(0.99),
            report.replicas
        );
        for (e, n) in &report.errors {
            println!("      {n} × {e}");
        }
        total.merge(&report);
    }
    println!(
        "  total: requests sent {}, succeeded {}, failed {}, p50 {:.2}ms, p99 {:.2}ms",
        total.sent,
        total.succeeded,
        total.failed,
        total.quantile_ms(0.5),
        total.quantile_ms(0.99)
    );
    if config.json {
        println!("summary-json {}", total.to_json());
    }
    Ok(UpOutcome { report: total })
}
