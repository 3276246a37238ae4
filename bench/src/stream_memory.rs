//! Memory that discovery streams leave behind, in the control plane and in a
//! proxy (issue 10, items 8 and 11).
//!
//! 1. Control plane: RSS when loaded, with N open `Destination.Get` streams
//!    (each for a distinct authority, over a handful of connections), and
//!    after every stream has closed and one audit interval has passed.
//! 2. Proxy: RSS (proxy and control plane) before and after requests for P
//!    distinct `Host` ports of one service (each port a discovery
//!    subscription unless the proxy bounds them).
//!
//! Prints RSS in MiB and the after/before ratios. Usage:
//! bench/stream-memory.sh [--streams N] [--ports P]

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use linkerd2_proxy_api::destination::{destination_client::DestinationClient, GetDestination};
use tether_core::registry::{Document, EndpointSpec, PortSpec, ServiceDoc};
use tether_mesh_up::process::Process;
use tether_mesh_up::up::write_document;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Args {
    tether: PathBuf,
    streams: usize,
    ports: u16,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        tether: "target/release/tether".into(),
        streams: 10_000,
        ports: 3_000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--tether" => a.tether = v.into(),
            "--streams" => a.streams = v.parse()?,
            "--ports" => a.ports = v.parse()?,
            other => bail!("unknown flag {other}"),
        }
    }
    anyhow::ensure!(
        (1..=50_000).contains(&a.streams),
        "--streams must be 1-50000"
    );
    anyhow::ensure!((1..=20_000).contains(&a.ports), "--ports must be 1-20000");
    Ok(a)
}

fn mib(pid: u32) -> f64 {
    tether_bench::proc_usage(pid).rss_kib as f64 / 1024.0
}

/// Streams per gRPC connection: below the control plane's per-connection
/// stream limit.
const STREAMS_PER_CONNECTION: usize = 1_000;

async fn open_streams(
    grpc: SocketAddr,
    n: usize,
) -> anyhow::Result<Vec<tonic::Streaming<linkerd2_proxy_api::destination::Update>>> {
    let mut streams = Vec::with_capacity(n);
    let mut client = None;
    for i in 0..n {
        if i % STREAMS_PER_CONNECTION == 0 {
            client = Some(DestinationClient::connect(format!("http://{grpc}")).await?);
        }
        let req = GetDestination {
            path: format!("svc-{i}.bench.svc.cluster.local:80"),
            ..Default::default()
        };
        let mut s = client.as_mut().unwrap().get(req).await?.into_inner();
        s.message().await?;
        streams.push(s);
    }
    Ok(streams)
}

async fn http_status(outbound: SocketAddr, host: &str) -> anyhow::Result<String> {
    let mut s = tokio::net::TcpStream::connect(outbound).await?;
    s.write_all(format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf);
    Ok(text.lines().next().unwrap_or("").to_string())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let dir = std::env::temp_dir().join(format!("tether-bench-memory-{}", std::process::id()));
    let registry = dir.join("registry");
    std::fs::create_dir_all(&registry)?;
    write_document(
        &registry,
        "web.yaml",
        &Document::Service(
            ServiceDoc::new("web", "bench", vec![PortSpec::http(8080)])
                .with_endpoints(vec![EndpointSpec::new("127.0.0.1:9".parse()?)]),
        ),
    )?;
    let s = |v: &str| v.to_string();
    let control = Process::spawn(
        &args.tether,
        "control",
        &[
            s("control"),
            s("--registry"),
            registry.display().to_string(),
            s("--grpc"),
            s("127.0.0.1:0"),
            s("--admin"),
            s("127.0.0.1:0"),
            s("--audit-interval"),
            s("1"),
            s("--insecure-control-plane"),
        ],
        &dir.join("control.log"),
        &["grpc", "admin"],
    )
    .await?;
    let cpid = control.pid().context("control pid")?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let loaded = mib(cpid);

    let streams = open_streams(control.addr("grpc"), args.streams).await?;
    let open = mib(cpid);
    drop(streams);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let closed = mib(cpid);
    println!("control plane, {} Destination streams:", args.streams);
    println!("  loaded {loaded:.1} MiB, streams open {open:.1} MiB, all closed {closed:.1} MiB");
    println!(
        "  kept after close: {:.1} MiB ({:.2}x loaded)",
        closed - loaded,
        closed / loaded
    );

    let control_addr = control.addr("grpc").to_string();
    let proxy = Process::spawn(
        &args.tether,
        "proxy",
        &[
            s("proxy"),
            s("--control"),
            control_addr,
            s("--outbound"),
            s("127.0.0.1:0"),
            s("--admin"),
            s("127.0.0.1:0"),
            s("--insecure-control-plane"),
        ],
        &dir.join("proxy.log"),
        &["outbound", "admin"],
    )
    .await?;
    let ppid = proxy.pid().context("proxy pid")?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (proxy_before, control_before) = (mib(ppid), mib(cpid));
    let mut statuses = std::collections::BTreeMap::<String, usize>::new();
    for i in 0..args.ports {
        let host = format!("web.bench.svc.cluster.local:{}", 10_000 + i);
        *statuses
            .entry(http_status(proxy.addr("outbound"), &host).await?)
            .or_default() += 1;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (proxy_after, control_after) = (mib(ppid), mib(cpid));
    println!("proxy, requests for {} distinct Host ports:", args.ports);
    println!("  answers: {statuses:?}");
    println!(
        "  proxy {proxy_before:.1} -> {proxy_after:.1} MiB ({:.2}x), control plane {control_before:.1} -> {control_after:.1} MiB ({:.2}x)",
        proxy_after / proxy_before,
        control_after / control_before
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
