//! Proxy latency benchmark: the demo app called directly, through an
//! outbound and an inbound proxy in plaintext, and through the same pair
//! over mutual TLS, measured side by side in one run.
//!
//! 1. Open loop at a fixed rate (latency from the intended send time, so
//!    coordinated omission is corrected): p50/p99/p99.9, added latency and
//!    ratios.
//! 2. Closed loop at full speed: maximum throughput and its ratio.
//! 3. The two proxies' peak RSS and CPU seconds per 1,000 requests.
//!
//! Usage: bench/proxy-latency.sh [--rate R] [--seconds S] [--concurrency C]

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use tether_core::registry::{Document, EndpointSpec, EndpointsDoc, PortSpec, ServiceDoc};
use tether_mesh_up::process::Process;
use tether_mesh_up::up::write_document;

struct Args {
    tether: PathBuf,
    rate: f64,
    seconds: f64,
    concurrency: usize,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        tether: PathBuf::from("target/release/tether"),
        rate: 1000.0,
        seconds: 10.0,
        concurrency: 32,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--tether" => args.tether = value.into(),
            "--rate" => args.rate = value.parse().context("--rate")?,
            "--seconds" => args.seconds = value.parse().context("--seconds")?,
            "--concurrency" => args.concurrency = value.parse().context("--concurrency")?,
            other => bail!("unknown flag {other}"),
        }
    }
    if !(args.seconds > 0.0 && args.seconds <= 300.0) {
        bail!("--seconds must be in (0, 300]");
    }
    Ok(args)
}

/// One way to reach the app: a name, where to connect, the authority.
struct Route {
    name: &'static str,
    connect: std::net::SocketAddr,
    authority: String,
    /// The proxies on this route, for CPU and memory.
    pids: Vec<u32>,
}

fn load(
    args: &Args,
    route: &Route,
    rate: Option<f64>,
    seconds: f64,
) -> anyhow::Result<serde_json::Value> {
    let connect = route.connect;
    let mut cmd = std::process::Command::new(&args.tether);
    cmd.args([
        "load",
        "--connect",
        &connect.to_string(),
        "--authority",
        &route.authority,
        "--duration",
        &seconds.to_string(),
        "--concurrency",
        &args.concurrency.to_string(),
    ]);
    if let Some(r) = rate {
        cmd.args(["--rate", &r.to_string()]);
    }
    let out = cmd.output().context("running tether load")?;
    if !out.status.success() {
        bail!(
            "tether load failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    if report["failed"].as_u64().unwrap_or(0) > 0 {
        eprintln!(
            "warning: {} requests failed: {}",
            report["failed"], report["errors"]
        );
    }
    Ok(report)
}

fn f(v: &serde_json::Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let dir = tempfile_dir()?;
    let registry = dir.join("registry");
    std::fs::create_dir_all(&registry)?;
    let log = |n: &str| dir.join(format!("{n}.log"));
    let s = |v: &str| v.to_string();
    let any = "127.0.0.1:0";

    let ca = dir.join("identity");
    tether_identity::ca::init(&tether_identity::ca::InitOptions::new(&ca, "cluster.local"))?;
    let tokens = tether_identity::token::LocalTokens::load(&ca)?;
    for name in ["web", "web-tls"] {
        write_document(
            &registry,
            &format!("{name}.yaml"),
            &Document::Service(ServiceDoc::new(name, "bench", vec![PortSpec::http(8080)])),
        )?;
    }
    let app = Process::spawn(
        &args.tether,
        "app",
        &[s("demo-app"), s("--listen"), s(any)],
        &log("app"),
        &["http"],
    )
    .await?;
    let control = Process::spawn(
        &args.tether,
        "control",
        &[
            s("control"),
            s("--registry"),
            registry.display().to_string(),
            s("--grpc"),
            s(any),
            s("--admin"),
            s(any),
            s("--identity"),
            ca.display().to_string(),
            // The plaintext mesh's proxies have no identity to do TLS with.
            s("--insecure-control-plane"),
        ],
        &log("control"),
        &["grpc", "admin"],
    )
    .await?;
    let proxy = |app: Option<std::net::SocketAddr>,
                 identity: Option<&str>|
     -> anyhow::Result<Vec<String>> {
        let mut a = vec![
            s("proxy"),
            s("--control"),
            control.addr("grpc").to_string(),
            s("--outbound"),
            s(any),
            s("--inbound"),
            s(any),
            s("--admin"),
            s(any),
        ];
        if let Some(app) = app {
            a.extend([s("--app"), app.to_string()]);
        }
        if let Some(id) = identity {
            let token = dir.join(format!("{id}.token"));
            std::fs::write(&token, tokens.issue(id))?;
            a.extend([
                s("--identity"),
                s(id),
                s("--identity-token-file"),
                token.display().to_string(),
                s("--trust-root"),
                ca.join("ca.crt").display().to_string(),
                s("--tls"),
                s("mandatory"),
            ]);
        }
        Ok(a)
    };
    let server_id = tether_identity::identity_name("web", "bench", "cluster.local");
    let client_id = tether_identity::identity_name("client", "bench", "cluster.local");
    let app_addr = Some(app.addr("http"));
    let spawn = |name: &'static str, argv: Vec<String>, expect: &'static [&'static str]| {
        let log = log(name);
        let tether = args.tether.clone();
        let mut argv = argv;
        tether_mesh_up::process::plaintext_control_plane_without_identity(&mut argv);
        async move { Process::spawn(&tether, name, &argv, &log, expect).await }
    };
    let server = spawn("server", proxy(app_addr, None)?, &["inbound", "admin"]).await?;
    let client = spawn("client", proxy(None, None)?, &["outbound", "admin"]).await?;
    let server_tls = spawn(
        "server-tls",
        proxy(app_addr, Some(&server_id))?,
        &["inbound", "admin"],
    )
    .await?;
    let client_tls = spawn(
        "client-tls",
        proxy(None, Some(&client_id))?,
        &["outbound", "admin"],
    )
    .await?;
    for (file, service, proxy, identity) in [
        ("web-0.yaml", "web", &server, None),
        (
            "web-tls-0.yaml",
            "web-tls",
            &server_tls,
            Some(server_id.clone()),
        ),
    ] {
        write_document(
            &registry,
            file,
            &Document::Endpoints(EndpointsDoc {
                service: s(service),
                namespace: s("bench"),
                endpoints: vec![EndpointSpec {
                    identity,
                    ..EndpointSpec::new(proxy.addr("inbound"))
                }],
            }),
        )?;
    }
    for p in [&server_tls, &client_tls] {
        tether_bench::wait_ready(p.addr("admin"), Duration::from_secs(10)).await?;
    }
    let pid = |p: &Process| p.pid().unwrap_or(0);
    let routes = [
        Route {
            name: "direct",
            connect: app.addr("http"),
            authority: s("web.bench.svc.cluster.local:8080"),
            pids: vec![],
        },
        Route {
            name: "mesh",
            connect: client.addr("outbound"),
            authority: s("web.bench.svc.cluster.local:8080"),
            pids: vec![pid(&client), pid(&server)],
        },
        Route {
            name: "mesh+mTLS",
            connect: client_tls.addr("outbound"),
            authority: s("web-tls.bench.svc.cluster.local:8080"),
            pids: vec![pid(&client_tls), pid(&server_tls)],
        },
    ];
    // Warm up every path (connections, discovery, handshakes).
    for r in &routes {
        load(&args, r, Some(200.0), 1.0)?;
    }
    let cpu = |r: &Route| {
        r.pids
            .iter()
            .map(|p| tether_bench::proc_usage(*p).cpu_seconds)
            .sum::<f64>()
    };

    println!(
        "proxy latency benchmark: {} req/s open loop for {}s, concurrency {}",
        args.rate, args.seconds, args.concurrency
    );
    let mut fixed = Vec::new();
    for r in &routes {
        let before = cpu(r);
        let report = load(&args, r, Some(args.rate), args.seconds)?;
        fixed.push((report, cpu(r) - before));
    }
    println!(
        "\nlatency from the intended send time (includes the sender's ~1 ms timer granularity; corrects coordinated omission):"
    );
    table(&routes, &fixed, ["p50_ms", "p99_ms", "p999_ms"]);
    println!("\nlatency from the actual send (the network path alone):");
    table(
        &routes,
        &fixed,
        ["service_p50_ms", "service_p99_ms", "service_p999_ms"],
    );

    let max_secs = (args.seconds / 2.0).max(2.0);
    println!(
        "\nmax throughput (closed loop, concurrency {}, {max_secs}s):",
        args.concurrency
    );
    let mut direct_max = f64::NAN;
    for (r, (fixed_report, fixed_cpu)) in routes.iter().zip(&fixed) {
        let before = cpu(r);
        let report = load(&args, r, None, max_secs)?;
        let max_cpu = cpu(r) - before;
        let rps = f(&report, "rps");
        if r.name == "direct" {
            direct_max = rps;
        }
        print!(
            "  {:<10} {:>9.0} req/s  ratio to direct {:>5.2}",
            r.name,
            rps,
            rps / direct_max
        );
        if !r.pids.is_empty() {
            let per_k = |cpu: f64, rep: &serde_json::Value| {
                cpu / rep["sent"].as_f64().unwrap_or(1.0).max(1.0) * 1000.0
            };
            let rss: Vec<String> = r
                .pids
                .iter()
                .map(|p| {
                    format!(
                        "{:.1}",
                        tether_bench::proc_usage(*p).peak_rss_kib as f64 / 1024.0
                    )
                })
                .collect();
            print!(
                "   proxies: {:.3} CPU-s/1k req at fixed rate, {:.3} at max; peak RSS (client, server) {} MiB",
                per_k(*fixed_cpu, fixed_report),
                per_k(max_cpu, &report),
                rss.join(", ")
            );
        }
        println!();
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn table(routes: &[Route], reports: &[(serde_json::Value, f64)], keys: [&str; 3]) {
    println!(
        "{:<10} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "", "p50 ms", "p99 ms", "p99.9 ms", "rps", "failed"
    );
    for (r, (rep, _)) in routes.iter().zip(reports) {
        println!(
            "{:<10} {:>10.3} {:>10.3} {:>10.3} {:>10.1} {:>8}",
            r.name,
            f(rep, keys[0]),
            f(rep, keys[1]),
            f(rep, keys[2]),
            f(rep, "rps"),
            rep["failed"]
        );
    }
    let direct = &reports[0].0;
    for (r, (rep, _)) in routes.iter().zip(reports).skip(1) {
        for (q, key) in ["p50", "p99", "p99.9"].into_iter().zip(keys) {
            println!(
                "  {:<10} added {q:<5} {:>8.3} ms   ratio to direct {:>6.2}x",
                r.name,
                f(rep, key) - f(direct, key),
                f(rep, key) / f(direct, key)
            );
        }
    }
}

fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("tether-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
