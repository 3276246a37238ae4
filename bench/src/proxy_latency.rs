//! Proxy latency benchmark: the demo app called directly versus through an
//! outbound and an inbound proxy, measured side by side in one run.
//!
//! 1. Open loop at a fixed rate (latency from the intended send time, so
//!    coordinated omission is corrected): p50/p99/p99.9, added latency and
//!    ratios.
//! 2. Closed loop at full speed: maximum throughput and its ratio.
//! 3. The two proxies' peak RSS and CPU seconds per 1,000 requests.
//!
//! Usage: bench/proxy-latency.sh [--rate R] [--seconds S] [--concurrency C]

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

/// CPU seconds (user + system) and peak RSS in KiB of a process.
fn usage(pid: u32) -> (f64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of stat; 11 and 12 after the ')'.
    let cpu = (ticks(11) + ticks(12)) / 100.0;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    (cpu, hwm)
}

fn load(
    args: &Args,
    connect: std::net::SocketAddr,
    rate: Option<f64>,
    seconds: f64,
) -> anyhow::Result<serde_json::Value> {
    let mut cmd = std::process::Command::new(&args.tether);
    cmd.args([
        "load",
        "--connect",
        &connect.to_string(),
        "--authority",
        "web.bench.svc.cluster.local:8080",
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

    write_document(
        &registry,
        "web.yaml",
        &Document::Service(ServiceDoc {
            name: s("web"),
            namespace: s("bench"),
            ports: vec![PortSpec {
                port: 8080,
                opaque: false,
            }],
            global_id: None,
            mode: None,
            endpoints: vec![],
        }),
    )?;
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
        ],
        &log("control"),
        &["grpc", "admin"],
    )
    .await?;
    let proxy = |app: Option<std::net::SocketAddr>| {
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
        a
    };
    let server = Process::spawn(
        &args.tether,
        "server-proxy",
        &proxy(Some(app.addr("http"))),
        &log("server"),
        &["inbound", "admin"],
    )
    .await?;
    let client = Process::spawn(
        &args.tether,
        "client-proxy",
        &proxy(None),
        &log("client"),
        &["outbound", "admin"],
    )
    .await?;
    write_document(
        &registry,
        "web-0.yaml",
        &Document::Endpoints(EndpointsDoc {
            service: s("web"),
            namespace: s("bench"),
            endpoints: vec![EndpointSpec {
                address: server.addr("inbound"),
                port: None,
                ready: true,
                identity: None,
                zone: None,
                weight: 1,
                meshed: true,
                name: None,
            }],
        }),
    )?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let direct = app.addr("http");
    let mesh = client.addr("outbound");
    // Warm up both paths (connections, discovery).
    load(&args, direct, Some(200.0), 1.0)?;
    load(&args, mesh, Some(200.0), 1.0)?;

    let pids = [client.pid().unwrap_or(0), server.pid().unwrap_or(0)];
    let cpu = || pids.iter().map(|p| usage(*p).0).sum::<f64>();

    println!(
        "proxy latency benchmark: {} req/s open loop for {}s, concurrency {}",
        args.rate, args.seconds, args.concurrency
    );
    let d = load(&args, direct, Some(args.rate), args.seconds)?;
    let cpu0 = cpu();
    let m = load(&args, mesh, Some(args.rate), args.seconds)?;
    let cpu_fixed = cpu() - cpu0;
    let mesh_requests = m["sent"].as_f64().unwrap_or(1.0).max(1.0);

    println!(
        "\nlatency from the intended send time (includes the sender's ~1 ms timer granularity; corrects coordinated omission):"
    );
    table(&d, &m, ["p50_ms", "p99_ms", "p999_ms"]);
    println!("\nlatency from the actual send (the network path alone):");
    table(
        &d,
        &m,
        ["service_p50_ms", "service_p99_ms", "service_p999_ms"],
    );

    let max_secs = (args.seconds / 2.0).max(2.0);
    let dmax = load(&args, direct, None, max_secs)?;
    let cpu1 = cpu();
    let mmax = load(&args, mesh, None, max_secs)?;
    let cpu_max = cpu() - cpu1;
    println!(
        "\nmax throughput (closed loop, {} connections' worth of concurrency, {max_secs}s): direct {:.0} rps, mesh {:.0} rps, ratio mesh/direct {:.2}",
        args.concurrency,
        f(&dmax, "rps"),
        f(&mmax, "rps"),
        f(&mmax, "rps") / f(&dmax, "rps")
    );
    let (_, rss_client) = usage(pids[0]);
    let (_, rss_server) = usage(pids[1]);
    println!(
        "proxies (outbound + inbound): CPU {:.3} s per 1,000 requests at fixed rate, {:.3} s per 1,000 at max; peak RSS client {:.1} MiB, server {:.1} MiB",
        cpu_fixed / mesh_requests * 1000.0,
        cpu_max / mmax["sent"].as_f64().unwrap_or(1.0).max(1.0) * 1000.0,
        rss_client as f64 / 1024.0,
        rss_server as f64 / 1024.0
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn table(d: &serde_json::Value, m: &serde_json::Value, keys: [&str; 3]) {
    println!(
        "{:<8} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "", "p50 ms", "p99 ms", "p99.9 ms", "rps", "failed"
    );
    for (name, r) in [("direct", d), ("mesh", m)] {
        println!(
            "{:<8} {:>10.3} {:>10.3} {:>10.3} {:>10.1} {:>8}",
            name,
            f(r, keys[0]),
            f(r, keys[1]),
            f(r, keys[2]),
            f(r, "rps"),
            r["failed"]
        );
    }
    for (q, key) in ["p50", "p99", "p99.9"].into_iter().zip(keys) {
        println!(
            "added latency {q:<5}: {:>8.3} ms   ratio mesh/direct {:>6.2}x",
            f(m, key) - f(d, key),
            f(m, key) / f(d, key)
        );
    }
}

fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("tether-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
