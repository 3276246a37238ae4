//! Failover: a multicluster service in cluster `east` under constant
//! open-loop load, through three events, each in a run of its own:
//!
//! - **crash**, mode `failover`: at `--crash-at` every east replica and its
//!   sidecar is killed (SIGKILL), and the registry learns `--detect`
//!   seconds later (each of a comma-separated list, retries on; and the
//!   first, retries off, as the baseline without retries);
//! - **hung gateway**, mode `balanced`: at `--crash-at` west's gateway is
//!   frozen (SIGSTOP) for `--freeze` seconds, then thawed — a link that
//!   black-holes traffic: connections stay open and nothing answers, the
//!   one-machine stand-in for a cut link (requests in flight on it used to
//!   hang until HTTP/2's keepalive gave up).
//!
//! Printed per run: failed requests, the time from the event until the
//! success rate is back to 100% (the last failed request's send time),
//! p99 and worst latency.
//!
//! Usage: bench/failover.sh [--rps 200] [--crash-at 3] [--detect 0.5,2,5]
//! [--freeze 6] [--seconds 10]

#![forbid(unsafe_code)]

use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};

#[derive(Clone, Copy)]
enum Event {
    Crash { detect: f64 },
    FreezeGateway { seconds: f64 },
}

fn manifest(rps: f64, at: f64, event: Event, retries: bool) -> String {
    let (mode, events) = match event {
        Event::Crash { detect } => (
            "failover",
            format!("events:\n  - at: {at}\n    crash: east\n    detect_after: {detect}\n"),
        ),
        Event::FreezeGateway { .. } => ("balanced", String::new()),
    };
    format!(
        r#"
retries: {retries}
clusters:
  - name: east
    services:
      - name: web
        namespace: shop
        global_id: web-global
        mode: {mode}
        replicas: 2
    links:
      - cluster: west
        priority: 1
  - name: west
    services:
      - name: storefront
        namespace: retail
        global_id: web-global
        replicas: 2
load:
  - cluster: east
    service: web
    rps: {rps}
{events}"#
    )
}

/// The pid of west's gateway among `parent`'s children.
fn west_gateway(parent: u32) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Field 4, after the parenthesised command name.
        let ppid: u32 = stat
            .rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).ok()?;
        let args: Vec<&str> = cmdline.split('\0').collect();
        (ppid == parent
            && args.get(1) == Some(&"gateway")
            && args.iter().any(|a| a.starts_with("tether-gateway.west.")))
        .then_some(pid)
    })
}

fn signal(pid: u32, sig: &str) -> anyhow::Result<()> {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()?
        .success();
    anyhow::ensure!(ok, "kill {sig} {pid} failed");
    Ok(())
}

/// Runs `tether up` on the manifest for `seconds`, causing a gateway
/// freeze itself when asked; the load generator's summary.
fn run(
    tether: &str,
    path: &std::path::Path,
    seconds: f64,
    at: f64,
    event: Event,
) -> anyhow::Result<serde_json::Value> {
    let mut child = Command::new(tether)
        .args([
            "up",
            path.to_str().unwrap(),
            "--duration",
            &seconds.to_string(),
            "--interval",
            "3600",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running tether up")?;
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut lines = stdout.lines();
    let mut seen = String::new();
    // The load starts when `tether up` says so; events count from there.
    for line in lines.by_ref() {
        let line = line?;
        seen.push_str(&line);
        seen.push('\n');
        if line.starts_with("running load") {
            break;
        }
    }
    if let Event::FreezeGateway { seconds: frozen } = event {
        std::thread::sleep(Duration::from_secs_f64(at));
        let pid = west_gateway(child.id()).context("west's gateway not found")?;
        signal(pid, "-STOP")?;
        println!("  froze west's gateway (pid {pid}) for {frozen}s");
        std::thread::sleep(Duration::from_secs_f64(frozen));
        signal(pid, "-CONT")?;
    }
    for line in lines {
        let line = line?;
        seen.push_str(&line);
        seen.push('\n');
    }
    let out = child.wait_with_output()?;
    let json = seen
        .lines()
        .find_map(|l| l.strip_prefix("summary-json "))
        .with_context(|| {
            format!(
                "no summary from tether up:\n{seen}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
    Ok(serde_json::from_str(json)?)
}

fn main() -> anyhow::Result<()> {
    let (mut tether, mut rps, mut at, mut detect, mut freeze, mut seconds) = (
        "target/release/tether".to_string(),
        200.0,
        3.0,
        "0.5,2,5".to_string(),
        6.0,
        10.0,
    );
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--tether" => tether = v,
            "--rps" => rps = v.parse()?,
            "--crash-at" => at = v.parse()?,
            "--detect" => detect = v,
            "--freeze" => freeze = v.parse()?,
            "--seconds" => seconds = v.parse()?,
            other => bail!("unknown flag {other}"),
        }
    }
    let detects: Vec<f64> = detect
        .split(',')
        .map(|d| d.trim().parse())
        .collect::<Result<_, _>>()
        .context("--detect: seconds, comma-separated")?;
    anyhow::ensure!(!detects.is_empty(), "--detect needs a value");
    anyhow::ensure!(
        at < seconds && at + freeze < seconds,
        "--crash-at (and the freeze after it) must end before --seconds"
    );
    println!("failover benchmark: {rps} req/s for {seconds}s, events at {at}s");
    let mut cases: Vec<(String, Event, bool)> = detects
        .iter()
        .map(|&d| {
            (
                format!("crash, registry learns after {d}s"),
                Event::Crash { detect: d },
                true,
            )
        })
        .collect();
    cases.push((
        format!("crash, registry learns after {}s", detects[0]),
        Event::Crash { detect: detects[0] },
        false,
    ));
    cases.push((
        format!("balanced, west's gateway hung for {freeze}s"),
        Event::FreezeGateway { seconds: freeze },
        true,
    ));
    let dir = std::env::temp_dir().join(format!("tether-bench-failover-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut rows = Vec::new();
    for (i, (name, event, retries)) in cases.into_iter().enumerate() {
        println!("- {name}, retries {}", if retries { "on" } else { "off" });
        let path = dir.join(format!("failover-{i}.yaml"));
        std::fs::write(&path, manifest(rps, at, event, retries))?;
        let r = run(&tether, &path, seconds, at, event)?;
        let recovery = r["last_failure_s"]
            .as_f64()
            .map(|last| (last - at).max(0.0));
        rows.push((name, retries, r, recovery));
    }
    println!(
        "\n{:<44} {:>7} {:>7} {:>7} {:>9} {:>20} {:>9} {:>9}",
        "event", "retries", "sent", "failed", "failed %", "back to 100% after", "p99 ms", "max ms"
    );
    for (name, retries, r, recovery) in &rows {
        let sent = r["sent"].as_f64().unwrap_or(0.0);
        let failed = r["failed"].as_f64().unwrap_or(0.0);
        println!(
            "{:<44} {:>7} {:>7} {:>7} {:>8.2}% {:>20} {:>9.1} {:>9.1}",
            name,
            if *retries { "on" } else { "off" },
            sent,
            failed,
            100.0 * failed / sent.max(1.0),
            recovery.map_or("never dropped".to_string(), |s| format!(
                "{:.0} ms",
                s * 1000.0
            )),
            r["p99_ms"].as_f64().unwrap_or(f64::NAN),
            r["max_ms"].as_f64().unwrap_or(f64::NAN),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
