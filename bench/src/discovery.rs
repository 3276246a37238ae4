//! Discovery under churn: N endpoints across S services in the file
//! registry, M subscribers over real gRPC from a separate process
//! (`discovery-load`), and a churn of R registry changes per second (each
//! replaces one endpoint of one service: one Remove and one Add for every
//! subscriber of that service). Prints the latency from registry change to
//! subscriber receipt, the control plane's RSS and CPU, and memory per
//! subscriber.
//!
//! A service's endpoints are written in files of at most
//! `--per-file` (default [`ENDPOINTS_PER_FILE`]; Endpoints documents add up), so a service of
//! 100,000 endpoints is 20 files and a change rewrites one of them.
//!
//! With `--baseline OLD`, the same run is made with the `tether` binary
//! OLD and with the one under test, and the figures are printed side by
//! side with their ratio (new / old): the machine's load shifts between
//! days, a ratio within one run does not. With `--reps N` the pair is run
//! N times, in turn first and second (OLD NEW, NEW OLD, ...: the second
//! of a pair measured up to 3× the first's p99 on a machine losing a
//! quarter of its CPU to steal), and the medians and the spread of the
//! pairs' ratios are printed.
//!
//! Usage: bench/discovery.sh [--endpoints N] [--services S] [--subscribers M]
//!                           [--churn R] [--seconds T] [--settle T] [--per-file N]
//!                           [--baseline OLD-TETHER [--reps N]]

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::io::BufRead;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use tether_core::registry::{Document, PortSpec, ServiceDoc};
use tether_mesh_up::process::Process;
use tether_mesh_up::up::write_document;

struct Args {
    tether: PathBuf,
    baseline: Option<PathBuf>,
    /// How many OLD/NEW pairs to run with `--baseline`.
    reps: usize,
    load: PathBuf,
    endpoints: usize,
    services: usize,
    subscribers: usize,
    churn: f64,
    seconds: f64,
    /// How long subscribers get after the churn ends to converge.
    settle: f64,
    /// The most endpoints one registry file holds: a change rewrites (and
    /// the control plane re-parses) one such file.
    per_file: usize,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        tether: "target/release/tether".into(),
        baseline: None,
        reps: 1,
        load: "target/release/discovery-load".into(),
        endpoints: 10_000,
        services: 100,
        subscribers: 5_000,
        churn: 500.0,
        seconds: 10.0,
        settle: 2.0,
        per_file: ENDPOINTS_PER_FILE,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--tether" => a.tether = v.into(),
            "--baseline" => a.baseline = Some(v.into()),
            "--reps" => a.reps = v.parse()?,
            "--settle" => a.settle = v.parse()?,
            "--per-file" => a.per_file = v.parse()?,
            "--load" => a.load = v.into(),
            "--endpoints" => a.endpoints = v.parse()?,
            "--services" => a.services = v.parse()?,
            "--subscribers" => a.subscribers = v.parse()?,
            "--churn" => a.churn = v.parse()?,
            "--seconds" => a.seconds = v.parse()?,
            other => bail!("unknown flag {other}"),
        }
    }
    anyhow::ensure!(
        (1..=100_000).contains(&a.endpoints),
        "--endpoints must be 1-100000"
    );
    anyhow::ensure!(
        (1..=a.endpoints).contains(&a.services),
        "--services must be 1..endpoints"
    );
    anyhow::ensure!(
        (1..=20_000).contains(&a.subscribers),
        "--subscribers must be 1-20000"
    );
    anyhow::ensure!(
        a.churn > 0.0 && a.churn <= 500.0,
        "--churn must be in (0, 500]"
    );
    anyhow::ensure!(
        a.seconds > 0.0 && a.seconds <= 120.0,
        "--seconds must be in (0, 120]"
    );
    anyhow::ensure!((1..=20).contains(&a.reps), "--reps must be 1-20");
    anyhow::ensure!(
        a.reps == 1 || a.baseline.is_some(),
        "--reps needs --baseline"
    );
    anyhow::ensure!(
        (1..=100_000).contains(&a.per_file),
        "--per-file must be 1-100000"
    );
    anyhow::ensure!(
        a.settle > 0.0 && a.settle <= 120.0,
        "--settle must be in (0, 120]"
    );
    Ok(a)
}

/// The most endpoints one registry file of the bench holds.
const ENDPOINTS_PER_FILE: usize = 5_000;

/// A service's endpoints in files of at most `--per-file`, each
/// oldest first; addresses are never reused.
struct Service {
    name: String,
    files: Vec<VecDeque<(SocketAddr, String)>>,
    changes: usize,
}

impl Service {
    fn endpoints(&self) -> impl Iterator<Item = &SocketAddr> {
        self.files.iter().flatten().map(|(a, _)| a)
    }
}

fn endpoint_addr(n: u32) -> SocketAddr {
    SocketAddr::new(Ipv4Addr::from(0x0a00_0000 + n).into(), 80)
}

/// Writes one file of a service's endpoints (to a hidden name, renamed into
/// place). The YAML is rendered by hand: serde_yaml's emitter cost the
/// writer as much CPU as parsing costs the control plane, and this process
/// shares the cores with it. `writes_what_serde_yaml_reads_back` checks the
/// text means the same document.
fn write_endpoints(dir: &Path, svc: &Service, file: usize) -> anyhow::Result<()> {
    let name = format!("{}.endpoints-{file}.yaml", svc.name);
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, endpoints_yaml(svc, file))?;
    std::fs::rename(tmp, dir.join(name))?;
    Ok(())
}

fn endpoints_yaml(svc: &Service, file: usize) -> String {
    use std::fmt::Write;
    let mut text = String::with_capacity(64 + 64 * svc.files[file].len());
    let _ = write!(
        text,
        "kind: Endpoints\nservice: {}\nnamespace: bench\nendpoints:\n",
        svc.name
    );
    for (address, zone) in &svc.files[file] {
        let _ = write!(text, "- address: {address}\n  zone: {zone}\n");
    }
    text
}

fn now_stamp() -> String {
    format!(
        "t{}",
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos()
    )
}

/// A figure of the comparison table: its name, and how to read it.
type Figure = (&'static str, fn(&Outcome) -> f64);

/// What one run measured.
#[derive(Default)]
struct Outcome {
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    server_p99_ms: f64,
    subscribe_s: f64,
    converged: u64,
    cpu_per_change_ms: f64,
    load_cpu_s: f64,
    cpu_wait_s: f64,
    rss_subscribed_mib: f64,
    rss_closed_mib: f64,
    rss_peak_mib: f64,
    per_subscriber_bytes: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    println!(
        "discovery benchmark: {} endpoints in {} services, {} subscribers, {} changes/s for {}s",
        (args.endpoints / args.services).max(1) * args.services,
        args.services,
        args.subscribers,
        args.churn,
        args.seconds
    );
    let Some(baseline) = args.baseline.clone() else {
        run(&args, &args.tether).await?;
        return Ok(());
    };
    let (mut old, mut new) = (Vec::new(), Vec::new());
    for rep in 0..args.reps {
        // Each binary in turn first and second: the second of a pair runs
        // on a machine the first has just loaded.
        for old_now in [rep % 2 == 0, rep % 2 == 1] {
            let (label, binary) = match old_now {
                true => ("OLD", &baseline),
                false => ("NEW", &args.tether),
            };
            println!(
                "\n=== {label} (pair {} of {}): {}",
                rep + 1,
                args.reps,
                binary.display()
            );
            let outcome = run(&args, binary).await?;
            match old_now {
                true => old.push(outcome),
                false => new.push(outcome),
            }
        }
    }
    println!(
        "\nsame run, NEW / OLD (below 1 is better, except converged){}:",
        match args.reps {
            1 => String::new(),
            n => format!(
                "; medians of {n} pairs, each binary first in turn, and the pairs' ratios' range"
            ),
        }
    );
    let rows: [Figure; 13] = [
        ("p50 ms", |o| o.p50_ms),
        ("p99 ms", |o| o.p99_ms),
        ("max ms", |o| o.max_ms),
        ("in control plane p99 ms", |o| o.server_p99_ms),
        ("subscribe s", |o| o.subscribe_s),
        ("converged subscribers", |o| o.converged as f64),
        ("control-plane CPU ms per change", |o| o.cpu_per_change_ms),
        ("subscriber-process CPU s", |o| o.load_cpu_s),
        ("control plane waiting for a CPU s", |o| o.cpu_wait_s),
        ("RSS with subscribers MiB", |o| o.rss_subscribed_mib),
        ("RSS after streams closed MiB", |o| o.rss_closed_mib),
        ("peak RSS MiB", |o| o.rss_peak_mib),
        ("bytes per subscriber", |o| o.per_subscriber_bytes),
    ];
    if args.reps == 1 {
        println!("| figure | OLD | NEW | NEW/OLD |\n| --- | --- | --- | --- |");
    } else {
        println!(
            "| figure | OLD | NEW | NEW/OLD | pairs' NEW/OLD |\n| --- | --- | --- | --- | --- |"
        );
    }
    for (name, f) in rows {
        let median_of = |runs: &[Outcome]| tether_bench::median(runs.iter().map(f).collect());
        let (o, n) = (median_of(&old), median_of(&new));
        let ratios: Vec<f64> = old.iter().zip(&new).map(|(o, n)| f(n) / f(o)).collect();
        let spread = match ratios.len() {
            1 => String::new(),
            _ => {
                let (lo, hi) = ratios
                    .iter()
                    .fold((f64::MAX, f64::MIN), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
                format!(" {lo:.2}-{hi:.2} |")
            }
        };
        println!("| {name} | {o:.2} | {n:.2} | {:.2} |{spread}", n / o);
    }
    Ok(())
}

async fn run(args: &Args, tether: &Path) -> anyhow::Result<Outcome> {
    let dir = std::env::temp_dir().join(format!(
        "tether-bench-discovery-{}-{}",
        std::process::id(),
        now_stamp()
    ));
    let registry = dir.join("registry");
    std::fs::create_dir_all(&registry)?;
    let per_service = args.endpoints / args.services;
    let mut next_addr = 1u32;
    let mut services = Vec::new();
    for i in 0..args.services {
        let name = format!("svc-{i}");
        write_document(
            &registry,
            &format!("{name}.yaml"),
            &Document::Service(ServiceDoc::new(&name, "bench", vec![PortSpec::http(80)])),
        )?;
        let endpoints: Vec<_> = (0..per_service.max(1))
            .map(|_| {
                next_addr += 1;
                (endpoint_addr(next_addr), "init".to_string())
            })
            .collect();
        let svc = Service {
            name,
            files: endpoints
                .chunks(args.per_file)
                .map(|c| c.iter().cloned().collect())
                .collect(),
            changes: 0,
        };
        for file in 0..svc.files.len() {
            write_endpoints(&registry, &svc, file)?;
        }
        services.push(svc);
    }
    let s = |v: &str| v.to_string();
    let control = Process::spawn(
        tether,
        "control",
        &[
            s("control"),
            s("--registry"),
            registry.display().to_string(),
            s("--grpc"),
            s("127.0.0.1:0"),
            s("--admin"),
            s("127.0.0.1:0"),
            s("--insecure-control-plane"),
        ],
        &dir.join("control.log"),
        &["grpc", "admin"],
    )
    .await?;
    let pid = control.pid().context("control pid")?;
    tether_bench::wait_ready(control.addr("admin"), Duration::from_secs(60)).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_loaded = tether_bench::proc_usage(pid).rss_kib;

    let authorities: Vec<String> = services
        .iter()
        .map(|svc| format!("{}.bench.svc.cluster.local:80", svc.name))
        .collect();
    let subscribe_started = Instant::now();
    let mut load = Command::new(&args.load)
        .arg(control.addr("grpc").to_string())
        .arg(args.subscribers.to_string())
        .arg((args.seconds + args.settle).to_string())
        .args(&authorities)
        .stdout(Stdio::piped())
        .spawn()
        .context("starting discovery-load")?;
    let load_pid = load.id();
    let stdout = load.stdout.take().context("load stdout")?;
    let (line_tx, line_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if line_tx.send(line).is_err() {
                break;
            }
        }
    });
    let first = line_rx
        .recv_timeout(Duration::from_secs(120))
        .context("subscribers never all answered")?;
    anyhow::ensure!(
        first == "subscribed",
        "unexpected output from discovery-load: {first}"
    );
    let subscribe_time = subscribe_started.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let subscribed = tether_bench::proc_usage(pid);
    let (cpu_before, rss_subscribed) = (subscribed.cpu_seconds, subscribed.rss_kib);
    let load_cpu_before = tether_bench::proc_usage(load_pid).cpu_seconds;
    // This process writes the registry files: its CPU shares the cores too.
    let writer_cpu_before = tether_bench::proc_usage(std::process::id()).cpu_seconds;
    let waited_before = tether_bench::sched(pid).waited_s;

    // Churn: each change replaces one endpoint of one service.
    let interval = Duration::from_secs_f64(1.0 / args.churn);
    let started = Instant::now();
    let mut changes = 0usize;
    let mut write_time = Duration::ZERO;
    while started.elapsed() < Duration::from_secs_f64(args.seconds) {
        let due = started + interval * changes as u32;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
        let svc = &mut services[changes % args.services];
        let file = svc.changes % svc.files.len();
        svc.changes += 1;
        svc.files[file].pop_front();
        next_addr += 1;
        svc.files[file].push_back((endpoint_addr(next_addr), now_stamp()));
        let t = Instant::now();
        write_endpoints(&registry, svc, file)?;
        write_time += t.elapsed();
        changes += 1;
    }
    let churn_elapsed = started.elapsed();
    // Without coalescing, every change is one Remove and one Add to each
    // subscriber of its service (subscriber i follows service i mod S).
    let subscribers_of = |svc: usize| {
        args.subscribers / args.services + usize::from(svc < args.subscribers % args.services)
    };
    let expected_updates: usize = (0..changes)
        .map(|c| 2 * subscribers_of(c % args.services))
        .sum();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let end = tether_bench::proc_usage(pid);
    let (cpu_after, rss_end) = (end.cpu_seconds, end.rss_kib);
    let load_cpu_after = tether_bench::proc_usage(load_pid).cpu_seconds;
    let writer_cpu = tether_bench::proc_usage(std::process::id()).cpu_seconds - writer_cpu_before;
    let waited = tether_bench::sched(pid).waited_s - waited_before;
    let summary = line_rx
        .recv_timeout(Duration::from_secs_f64(args.settle + 60.0))
        .context("no summary from discovery-load")?;
    let _ = load.wait();
    // Every stream is closed now: what the control plane gives back, once
    // its next audit (every 10 s by default) has returned freed memory.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let closed = tether_bench::proc_usage(pid);
    let report: serde_json::Value = serde_json::from_str(&summary)?;
    let server_side = tether_mesh_up::stats::http_get(control.addr("admin"), "/metrics")
        .await?
        .1;
    let buckets: Vec<(f64, f64)> = tether_core::prom::parse(&server_side)
        .into_iter()
        .filter(|s| s.name == "tether_destination_update_latency_seconds_bucket")
        .filter_map(|s| {
            let le = match s.label("le")? {
                "+Inf" => f64::INFINITY,
                v => v.parse().ok()?,
            };
            Some((le, s.value))
        })
        .collect();
    let server_q =
        |q| tether_core::prom::histogram_quantile(q, &buckets).map_or(f64::NAN, |v| v * 1000.0);

    let f = |k: &str| report[k].as_f64().unwrap_or(f64::NAN);
    println!(
        "changes written: {changes} in {:.1}s ({:.0}/s)",
        churn_elapsed.as_secs_f64(),
        changes as f64 / churn_elapsed.as_secs_f64()
    );
    let received = report["updates_received"].as_u64().unwrap_or(0) as i64;
    println!(
        "updates received by subscribers: {received} of {expected_updates} without coalescing ({:+}; fewer means coalesced, more means repeated) ({} adds timed)",
        received - expected_updates as i64,
        report["adds_timed"]
    );
    // None lost: every subscriber's final view is the registry's final state.
    let mut converged = 0u64;
    for (svc, authority) in services.iter().zip(&authorities) {
        let want = format!("{:016x}", tether_bench::endpoints_digest(svc.endpoints()));
        converged += report["final_views"][authority][&want]
            .as_u64()
            .unwrap_or(0);
    }
    println!(
        "subscribers whose final view matches the registry {:.0}s after the churn: {converged} of {} ({} diverged)",
        args.settle,
        args.subscribers,
        args.subscribers as u64 - converged
    );
    println!(
        "latency registry write → subscriber receipt: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        f("p50_ms"),
        f("p99_ms"),
        f("max_ms")
    );
    println!(
        "  of which inside the control plane (change observed → update taken by the stream): p50 {:.2} ms, p99 {:.2} ms",
        server_q(0.5),
        server_q(0.99)
    );
    println!(
        "subscribing {} streams took {:.2}s",
        args.subscribers,
        subscribe_time.as_secs_f64()
    );
    let mib = |kib: u64| kib as f64 / 1024.0;
    println!(
        "control plane RSS: {:.1} MiB after loading the registry, {:.1} MiB with subscribers, {:.1} MiB at the end, {:.1} MiB after the streams closed, peak {:.1} MiB",
        mib(rss_loaded),
        mib(rss_subscribed),
        mib(rss_end),
        mib(closed.rss_kib),
        mib(closed.peak_rss_kib)
    );
    let per_subscriber =
        (rss_subscribed.saturating_sub(rss_loaded) as f64 * 1024.0) / args.subscribers as f64;
    println!("memory per subscriber: {per_subscriber:.0} bytes");
    let cpu_per_change = (cpu_after - cpu_before) * 1000.0 / changes.max(1) as f64;
    println!(
        "control plane CPU during churn: {:.2} s over {:.1} s ({cpu_per_change:.2} ms per change); the subscriber process used {:.2} s; the writer (this process) {writer_cpu:.2} s of CPU, {:.2} s writing files",
        cpu_after - cpu_before,
        churn_elapsed.as_secs_f64(),
        load_cpu_after - load_cpu_before,
        write_time.as_secs_f64()
    );
    println!(
        "control plane threads waited {waited:.2} s in all for a CPU (runnable, not running) during the churn and the second after; machine load average {}",
        tether_bench::loadavg()
    );
    drop(control);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Outcome {
        p50_ms: f("p50_ms"),
        p99_ms: f("p99_ms"),
        max_ms: f("max_ms"),
        server_p99_ms: server_q(0.99),
        subscribe_s: subscribe_time.as_secs_f64(),
        converged,
        cpu_per_change_ms: cpu_per_change,
        load_cpu_s: load_cpu_after - load_cpu_before,
        cpu_wait_s: waited,
        rss_subscribed_mib: mib(rss_subscribed),
        rss_closed_mib: mib(closed.rss_kib),
        rss_peak_mib: mib(closed.peak_rss_kib),
        per_subscriber_bytes: per_subscriber,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use tether_core::registry::{parse_documents, EndpointSpec, EndpointsDoc};

    #[test]
    fn writes_what_serde_yaml_reads_back() {
        let files = vec![VecDeque::from([
            (endpoint_addr(1), "init".to_string()),
            (endpoint_addr(2), now_stamp()),
        ])];
        let svc = Service {
            name: "svc-7".into(),
            files,
            changes: 0,
        };
        let want = Document::Endpoints(EndpointsDoc {
            service: "svc-7".into(),
            namespace: "bench".into(),
            endpoints: svc.files[0]
                .iter()
                .map(|(a, zone)| EndpointSpec {
                    zone: Some(zone.as_str().into()),
                    ..EndpointSpec::new(*a)
                })
                .collect(),
        });
        assert_eq!(
            parse_documents(&endpoints_yaml(&svc, 0)).unwrap(),
            vec![want]
        );
    }
}
