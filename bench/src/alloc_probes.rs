//! `--allocs`: heap allocations and timers per request, per proxy, counted
//! with uprobes (`perf probe`) during the first repetition's open-loop runs.
//!
//! - allocations: calls to glibc's `malloc`, `calloc`, `realloc` and
//!   `posix_memalign` (Rust's allocator for alignments above 16: tokio's
//!   task cells) — frees are as many and not counted;
//! - timers created: `tokio::time::Sleep::new_timeout` (every `sleep`,
//!   `sleep_until`, `timeout` and hyper's timers through `TokioTimer`),
//!   where the binary has the symbol (a Tether build; HAProxy has none);
//! - timers armed: tokio's `reregister` (a timer entered in, or moved in,
//!   the timer wheel: a `Sleep` polled for the first time or reset).
//!
//! A uprobe costs its process a trap per hit (about a microsecond), so a
//! counted run's CPU and latency figures are inflated; the counts are exact.
//! The probes are removed again when the bench ends.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::Context;

/// The kinds counted, in the order printed.
pub const KINDS: [&str; 3] = ["allocations", "timers created", "timers armed"];

const LIBC_GROUP: &str = "tbench_libc";
const LIBC_ALLOCATORS: [&str; 4] = ["malloc", "calloc", "realloc", "posix_memalign"];

/// Rust symbols probed in a `tether` binary, by a part of their mangled
/// name, and the kind each counts.
const TIMER_SYMBOLS: [(&str, &str, usize); 2] = [
    ("sleep", "5tokio4time5sleep5Sleep11new_timeout17h", 1),
    ("arm", "5tokio7runtime4time", 2),
];

/// The probes this bench defined; removed on drop.
#[derive(Default)]
pub struct Probes {
    groups: Vec<String>,
}

impl Drop for Probes {
    fn drop(&mut self) {
        for group in &self.groups {
            let _ = std::process::Command::new("perf")
                .args(["probe", "-q", "-d", &format!("{group}:*")])
                .stderr(Stdio::null())
                .status();
        }
    }
}

fn event_exists(group: &str, event: &str) -> bool {
    Path::new("/sys/kernel/tracing/events")
        .join(group)
        .join(event)
        .exists()
}

fn add_probe(binary: &Path, group: &str, event: &str, function: &str) -> anyhow::Result<()> {
    if event_exists(group, event) {
        return Ok(());
    }
    let out = std::process::Command::new("perf")
        .args(["probe", "-q", "-x"])
        .arg(binary)
        .arg("-a")
        .arg(format!("{group}:{event}={function}"))
        .output()
        .context("running perf probe")?;
    anyhow::ensure!(
        out.status.success(),
        "perf probe could not add {function} in {}: {}",
        binary.display(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// The mangled name of the function whose name contains `part` (and, for
/// the timer wheel's, `reregister`), from the binary's symbol table.
fn mangled(binary: &Path, part: &str, extra: Option<&str>) -> Option<String> {
    let out = std::process::Command::new("nm")
        .arg(binary)
        .stderr(Stdio::null())
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .find(|s| s.contains(part) && extra.is_none_or(|e| s.contains(e)))
        .map(str::to_string)
}

impl Probes {
    /// The events to count for `pid`, each with the kind it counts
    /// (an index into [`KINDS`]), defining the probes on first use.
    pub fn events_for(&mut self, pid: u32) -> anyhow::Result<Vec<(String, usize)>> {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe"))?;
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
        let libc: PathBuf = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.contains("/libc.so") || p.contains("/libc-"))
            .context("no libc mapped")?
            .into();
        let mut events = Vec::new();
        for f in LIBC_ALLOCATORS {
            add_probe(&libc, LIBC_GROUP, f, f)?;
            events.push((format!("{LIBC_GROUP}:{f}"), 0));
        }
        if !self.groups.iter().any(|g| g == LIBC_GROUP) {
            self.groups.push(LIBC_GROUP.into());
        }
        // One group per binary: builds differ in their symbols' hashes. An
        // event's name must be unique across groups too.
        use std::os::unix::fs::MetadataExt;
        let ino = std::fs::metadata(&exe)?.ino();
        let group = format!("tbench_{ino}");
        for (event, part, kind) in TIMER_SYMBOLS {
            let extra = (event == "arm").then_some("10reregister17h");
            let Some(symbol) = mangled(&exe, part, extra) else {
                continue;
            };
            let event = format!("{event}_{ino}");
            // A binary laid out again by BOLT keeps the symbol but not
            // always what `perf probe` needs to place a probe in it: its
            // timers go uncounted, its allocations still count.
            if let Err(e) = add_probe(&exe, &group, &event, &symbol) {
                eprintln!(
                    "--allocs: {} not counted in this binary: {e:#}",
                    KINDS[kind]
                );
                continue;
            }
            events.push((format!("{group}:{event}"), kind));
            if !self.groups.contains(&group) {
                self.groups.push(group.clone());
            }
        }
        Ok(events)
    }
}

/// `perf stat` counting one process's probe events; [`Count::finish`]
/// stops it and sums the counts by kind.
pub struct Count {
    child: std::process::Child,
    out: PathBuf,
    events: Vec<(String, usize)>,
}

impl Count {
    pub fn start(probes: &mut Probes, pid: u32, out: PathBuf) -> anyhow::Result<Self> {
        let events = probes.events_for(pid)?;
        let list: Vec<&str> = events.iter().map(|(e, _)| e.as_str()).collect();
        let child = std::process::Command::new("perf")
            .args([
                "stat",
                "-x",
                ",",
                "-e",
                &list.join(","),
                "-p",
                &pid.to_string(),
            ])
            .arg("-o")
            .arg(&out)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .context("starting perf stat")?;
        Ok(Self { child, out, events })
    }

    /// Counts by kind (see [`KINDS`]); `None` for a kind not probed.
    pub fn finish(mut self, stop: impl Fn(&mut std::process::Child)) -> [Option<u64>; 3] {
        stop(&mut self.child);
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        let mut counts = [None; 3];
        for line in text.lines() {
            let mut fields = line.split(',');
            let (Some(Ok(n)), Some(event)) = (
                fields.next().map(str::parse::<u64>),
                fields.nth(1).map(str::trim),
            ) else {
                continue;
            };
            if let Some((_, kind)) = self.events.iter().find(|(e, _)| e == event) {
                *counts[*kind].get_or_insert(0) += n;
            }
        }
        counts
    }
}
