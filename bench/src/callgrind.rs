//! `--callgrind DIR`: every proxy (Tether's and HAProxy's) runs under
//! valgrind's callgrind, and the first repetition's open-loop runs count
//! the user-space instructions each proxy executes per request.
//!
//! CPU seconds on a shared 2-core machine move by ±10% between runs, more
//! than most single changes to the request path are worth; an instruction
//! count does not move with the machine's load: two pairs of the same
//! build in one run differ by 1% at most (10 s at 200 req/s; what differs
//! is background work, per second rather than per request), so a change of
//! 2% shows, and a smaller one in the dumps' per-function counts.
//! It is not time: cache misses, the kernel's share (system calls, the
//! scheduler) and the instructions' costs are not in it. Use it to compare
//! builds (`--compare`) and to see the user-space gap to HAProxy; decide
//! goals on the CPU figures of a run without it.
//!
//! The counters are zeroed (`callgrind_control -z`) just before a run's
//! load and dumped (`-d`) just after; the dump's total over the requests
//! the load sent is the figure. Under callgrind a proxy runs ~50× slower:
//! rates of a few hundred requests per second at most (`--rates 200`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// `program argv...` as run under callgrind, its dumps in `dir`.
pub fn wrap(dir: &Path, program: &Path, argv: Vec<String>) -> (PathBuf, Vec<String>) {
    let mut wrapped = vec![
        "--tool=callgrind".to_string(),
        format!(
            "--callgrind-out-file={}",
            dir.join("callgrind.%p").display()
        ),
        // Its own messages (start, end) only: they go to the proxy's log.
        "-q".to_string(),
        program.display().to_string(),
    ];
    wrapped.extend(argv);
    (PathBuf::from("valgrind"), wrapped)
}

fn control(command: &str, pid: u32) -> anyhow::Result<()> {
    let out = std::process::Command::new("callgrind_control")
        .args([command, &pid.to_string()])
        .output()
        .context("running callgrind_control")?;
    let said = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !said.contains("OK") {
        bail!(
            "callgrind_control {command} {pid} failed: {}{}",
            said.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Zeroes the counters of the proxies `pids`, just before a load.
pub fn zero(pids: &[u32]) -> anyhow::Result<()> {
    pids.iter().try_for_each(|pid| control("-z", *pid))
}

/// Each proxy's instructions since [`zero`]: dumps its counters and reads
/// the total of the newest dump.
pub fn dump(dir: &Path, pids: &[u32]) -> anyhow::Result<Vec<u64>> {
    pids.iter()
        .map(|pid| {
            control("-d", *pid)?;
            let prefix = format!("callgrind.{pid}.");
            let newest = std::fs::read_dir(dir)?
                .filter_map(|e| {
                    let name = e.ok()?.file_name().into_string().ok()?;
                    let n: u32 = name.strip_prefix(&prefix)?.parse().ok()?;
                    Some((n, name))
                })
                .max()
                .with_context(|| format!("no callgrind dump of {pid} in {}", dir.display()))?;
            let file = dir.join(newest.1);
            let text = std::fs::read_to_string(&file)?;
            total(&text).with_context(|| format!("no total in {}", file.display()))
        })
        .collect()
}

/// The instruction total of a callgrind dump (`summary:`, or `totals:`).
fn total(dump: &str) -> Option<u64> {
    ["summary:", "totals:"].iter().find_map(|key| {
        dump.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_dumps_total_is_its_summary_or_its_totals() {
        let dump = "version: 1\ncmd: x\nevents: Ir\nfn=main\n1 5\nsummary: 1234\ntotals: 1234\n";
        assert_eq!(super::total(dump), Some(1234));
        assert_eq!(super::total("events: Ir\ntotals: 77\n"), Some(77));
        assert_eq!(super::total("events: Ir\n"), None);
        assert_eq!(super::total("summary: many\n"), None);
    }
}
