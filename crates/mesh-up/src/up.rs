//! The orchestrator behind `tether up`.
//!
//! It starts, in order: the control plane over a fresh registry directory;
//! for every replica, a demo app and its sidecar proxy, then the registry
//! document that makes the replica an endpoint; a client sidecar for the
//! load generator. Then it runs the load, prints live per-service traffic
//! read from the proxies' metrics, and on Ctrl-C (or after `--duration`)
//! stops the load, prints a summary, removes each replica from the registry
//! and stops every process.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use tether_admin::Shutdown;
use tether_core::registry::{Document, EndpointSpec, EndpointsDoc, PortSpec, ServiceDoc};

use crate::loadgen::{self, LoadReport, LoadSpec};
use crate::manifest::Manifest;
use crate::process::Process;
use crate::stats;

pub struct UpConfig {
    /// The `tether` binary, to start the pieces.
    pub exe: PathBuf,
    pub manifest: Manifest,
    /// Run headless for this long; `None` runs until Ctrl-C.
    pub duration: Option<Duration>,
    /// How often to print live traffic.
    pub interval: Duration,
}

/// The outcome of a run: the load generator's totals.
pub struct UpOutcome {
    pub report: LoadReport,
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

    /// The proxy flags for one workload, writing its token file.
    fn proxy_args(&self, identity: &str) -> anyhow::Result<Vec<String>> {
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
            "--tls".into(),
            "mandatory".into(),
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

/// Writes a registry document the safe way: a temporary file, then rename.
pub fn write_document(dir: &Path, file: &str, doc: &Document) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{file}.tmp"));
    std::fs::write(&tmp, doc.to_yaml())?;
    std::fs::rename(tmp, dir.join(file))
}

struct Mesh {
    processes: Vec<Process>,
    registry: PathBuf,
    endpoint_files: Vec<PathBuf>,
}

impl Mesh {
    async fn stop(&mut self) {
        // Withdraw endpoints first, so nothing is routed to a stopping replica.
        for f in &self.endpoint_files {
            let _ = std::fs::remove_file(f);
        }
        let stops = self
            .processes
            .iter_mut()
            .rev()
            .map(|p| p.stop(Duration::from_secs(5)));
        futures::future::join_all(stops).await;
    }
}

pub async fn run(config: UpConfig, stop: Shutdown) -> anyhow::Result<UpOutcome> {
    let run_dir = std::env::temp_dir().join(format!("tether-up-{}", std::process::id()));
    let registry = run_dir.join("registry");
    let logs = run_dir.join("logs");
    std::fs::create_dir_all(&registry)
        .with_context(|| format!("creating {}", registry.display()))?;
    std::fs::create_dir_all(&logs)?;
    let mut mesh = Mesh {
        processes: Vec::new(),
        registry: registry.clone(),
        endpoint_files: Vec::new(),
    };
    let result = start_and_run(&config, &mut mesh, &logs, stop).await;
    mesh.stop().await;
    let _ = std::fs::remove_dir_all(&run_dir);
    result
}

async fn start_and_run(
    config: &UpConfig,
    mesh: &mut Mesh,
    logs: &Path,
    stop: Shutdown,
) -> anyhow::Result<UpOutcome> {
    let m = &config.manifest;
    let exe = &config.exe;
    let any = "127.0.0.1:0".to_string();
    let log = |name: &str| logs.join(format!("{name}.log"));
    let identity = if m.identity {
        Some(Identity::create(
            logs.parent().expect("run dir"),
            &m.cluster_domain,
        )?)
    } else {
        None
    };

    for s in &m.services {
        let doc = Document::Service(ServiceDoc {
            name: s.name.clone(),
            namespace: s.namespace(m).to_string(),
            ports: vec![PortSpec {
                port: s.port,
                opaque: false,
            }],
            global_id: None,
            mode: None,
            retry_budget: None,
            endpoints: vec![],
        });
        write_document(
            &mesh.registry,
            &format!("{}.{}.service.yaml", s.name, s.namespace(m)),
            &doc,
        )?;
    }

    let control_args = vec![
        "control".to_string(),
        "--registry".into(),
        mesh.registry.display().to_string(),
        "--grpc".into(),
        any.clone(),
        "--admin".into(),
        any.clone(),
        "--cluster-domain".into(),
        m.cluster_domain.clone(),
    ];
    let mut control_args = control_args;
    if let Some(id) = &identity {
        control_args.extend(["--identity".to_string(), id.dir.display().to_string()]);
    }
    let control = Process::spawn(
        exe,
        "control",
        &control_args,
        &log("control"),
        &["grpc", "admin"],
    )
    .await?;
    let control_addr = control.addr("grpc");
    let control_admin = control.addr("admin");
    mesh.processes.push(control);

    let proxy_args = |app: Option<SocketAddr>, name: &str| -> anyhow::Result<Vec<String>> {
        let mut a = vec![
            "proxy".to_string(),
            "--control".into(),
            control_addr.to_string(),
            "--outbound".into(),
            any.clone(),
            "--inbound".into(),
            any.clone(),
            "--admin".into(),
            any.clone(),
        ];
        if let Some(app) = app {
            a.extend(["--app".to_string(), app.to_string()]);
        }
        if let Some(id) = &identity {
            a.extend(id.proxy_args(name)?);
        }
        Ok(a)
    };

    let mut table = vec![format!(
        "{:<24} {:<22} {:<22} {:<22}",
        "WORKLOAD", "APP", "PROXY INBOUND", "PROXY ADMIN"
    )];
    let mut admins = Vec::new();
    for s in &m.services {
        let ns = s.namespace(m);
        for i in 0..s.replicas {
            let replica = format!("{}-{}", s.name, i);
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
            let app = Process::spawn(exe, &replica, &app_args, &log(&replica), &["http"]).await?;
            let app_addr = app.addr("http");
            mesh.processes.push(app);
            let proxy_name = format!("{replica}-proxy");
            let id_name = tether_identity::identity_name(&s.name, ns, &m.cluster_domain);
            let proxy = Process::spawn(
                exe,
                &proxy_name,
                &proxy_args(Some(app_addr), &id_name)?,
                &log(&proxy_name),
                &["outbound", "inbound", "admin"],
            )
            .await?;
            let inbound = proxy.addr("inbound");
            admins.push(proxy.addr("admin"));
            table.push(format!(
                "{:<24} {:<22} {:<22} {:<22}",
                format!("{ns}/{replica}"),
                app_addr.to_string(),
                inbound.to_string(),
                format!("http://{}/metrics", proxy.addr("admin"))
            ));
            mesh.processes.push(proxy);
            let file = format!("{replica}.{ns}.endpoints.yaml");
            let doc = Document::Endpoints(EndpointsDoc {
                service: s.name.clone(),
                namespace: ns.to_string(),
                endpoints: vec![EndpointSpec {
                    address: inbound,
                    port: None,
                    ready: true,
                    identity: identity.as_ref().map(|_| id_name.clone()),
                    zone: None,
                    weight: 1,
                    meshed: true,
                    name: Some(replica.clone()),
                }],
            });
            write_document(&mesh.registry, &file, &doc)?;
            mesh.endpoint_files.push(mesh.registry.join(file));
        }
    }
    let client_id = tether_identity::identity_name("loadgen", &m.namespace, &m.cluster_domain);
    let client = Process::spawn(
        exe,
        "loadgen-proxy",
        &proxy_args(None, &client_id)?,
        &log("loadgen-proxy"),
        &["outbound", "admin"],
    )
    .await?;
    let client_outbound = client.addr("outbound");
    admins.push(client.addr("admin"));
    table.push(format!(
        "{:<24} {:<22} {:<22} {:<22}",
        "loadgen",
        "-",
        format!("outbound {client_outbound}"),
        format!("http://{}/metrics", client.addr("admin"))
    ));
    mesh.processes.push(client);

    wait_ready(&admins).await?;
    println!("tether up: mesh running");
    match &identity {
        Some(id) => println!(
            "  identity:      mTLS between every pair of proxies (--tls mandatory), trust root {}",
            id.dir.join("ca.crt").display()
        ),
        None => println!("  identity:      off (plaintext between proxies)"),
    }
    println!("  control plane: grpc {control_addr}, admin http://{control_admin}/metrics");
    println!("  registry:      {}", mesh.registry.display());
    println!("  logs:          {}", logs.display());
    for line in &table {
        println!("  {line}");
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
        let svc = m
            .services
            .iter()
            .find(|s| s.name == l.service)
            .expect("validated");
        let spec = LoadSpec {
            connect: client_outbound,
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
        };
        loads.push(tokio::spawn(loadgen::run(spec, stop.clone())));
    }

    // Live view until the load ends.
    let started = Instant::now();
    let mut before = stats::scrape(&admins).await;
    let mut at = Instant::now();
    let mut tick = tokio::time::interval(config.interval);
    tick.tick().await;
    while !loads.iter().all(|l| l.is_finished()) {
        tokio::select! {
            _ = tick.tick() => {
                let after = stats::scrape(&admins).await;
                let now = Instant::now();
                println!("\n[{:>5.0}s] live traffic (from proxy metrics)", started.elapsed().as_secs_f64());
                print!("{}", stats::render(&stats::rows(&before, &after, now - at)));
                before = after;
                at = now;
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
    Ok(UpOutcome { report: total })
}
