//! Failover: a failover-mode service in cluster `east` under constant
//! open-loop load; at `--crash-at` every east replica and its sidecar is
//! killed (SIGKILL), and the registry learns `--detect` seconds later.
//! Measured twice in one run, with retries on and off: failed requests,
//! and the time from the crash until the success rate is back to 100%
//! (the last failed request's send time).
//!
//! Usage: bench/failover.sh [--rps 200] [--crash-at 3] [--detect 0.5] [--seconds 8]

#![forbid(unsafe_code)]

use std::process::Command;

use anyhow::{bail, Context};

fn manifest(rps: f64, crash_at: f64, detect: f64, retries: bool) -> String {
    format!(
        r#"
retries: {retries}
clusters:
  - name: east
    services:
      - name: web
        namespace: shop
        global_id: web-global
        mode: failover
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
events:
  - at: {crash_at}
    crash: east
    detect_after: {detect}
"#
    )
}

fn main() -> anyhow::Result<()> {
    let (mut tether, mut rps, mut crash_at, mut detect, mut seconds) =
        ("target/release/tether".to_string(), 200.0, 3.0, 0.5, 8.0);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--tether" => tether = v,
            "--rps" => rps = v.parse()?,
            "--crash-at" => crash_at = v.parse()?,
            "--detect" => detect = v.parse()?,
            "--seconds" => seconds = v.parse()?,
            other => bail!("unknown flag {other}"),
        }
    }
    anyhow::ensure!(
        crash_at < seconds,
        "--crash-at must come before the end (--seconds)"
    );
    println!("failover benchmark: {rps} req/s, crash of every east replica at {crash_at}s, registry learns {detect}s later");
    let dir = std::env::temp_dir().join(format!("tether-bench-failover-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut rows = Vec::new();
    for retries in [true, false] {
        let path = dir.join(format!("failover-{retries}.yaml"));
        std::fs::write(&path, manifest(rps, crash_at, detect, retries))?;
        let out = Command::new(&tether)
            .args([
                "up",
                path.to_str().unwrap(),
                "--duration",
                &seconds.to_string(),
                "--interval",
                "3600",
                "--json",
            ])
            .output()
            .context("running tether up")?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let json = stdout
            .lines()
            .find_map(|l| l.strip_prefix("summary-json "))
            .with_context(|| {
                format!(
                    "no summary from tether up:\n{stdout}\n{}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })?;
        let r: serde_json::Value = serde_json::from_str(json)?;
        let recovery = r["last_failure_s"]
            .as_f64()
            .map(|last| (last - crash_at).max(0.0));
        rows.push((retries, r, recovery));
    }
    println!(
        "\n{:<12} {:>8} {:>8} {:>10} {:>20} {:>9} {:>9}",
        "retries", "sent", "failed", "failed %", "back to 100% after", "p99 ms", "max ms"
    );
    for (retries, r, recovery) in &rows {
        let sent = r["sent"].as_f64().unwrap_or(0.0);
        let failed = r["failed"].as_f64().unwrap_or(0.0);
        println!(
            "{:<12} {:>8} {:>8} {:>9.2}% {:>20} {:>9.1} {:>9.1}",
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
