//! What the benchmarks share: reading a process's CPU time and memory, and
//! a digest of an endpoint set that two processes compute alike.

#![forbid(unsafe_code)]

/// A process's CPU time (user + system) and memory, from `/proc`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcUsage {
    pub cpu_seconds: f64,
    /// The user-space part of `cpu_seconds` (the rest is the kernel's).
    pub user_seconds: f64,
    pub rss_kib: u64,
    pub peak_rss_kib: u64,
}

/// The machine's load average (1, 5, 15 min), printed beside figures so a
/// reader knows how busy the shared machine was.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The machine a run's figures come from: which CPU, which kernel, and what
/// a system call and a clock read cost on it, measured now. The ratio of a
/// Tether pair to an HAProxy pair depends on these: HAProxy's pair makes
/// ~1.7× the system calls per request (docs/performance.md, "System
/// calls") and a Tether pair more work in user space, so a machine where
/// system calls are dear favours Tether and one where they are cheap
/// favours HAProxy (thirteenth pass).
#[derive(Debug, Clone, PartialEq)]
pub struct Machine {
    pub cpu: String,
    pub kernel: String,
    pub syscall_ns: f64,
    pub clock_read_ns: f64,
}

impl Machine {
    pub fn measure() -> Machine {
        Machine {
            cpu: cpu_model(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default()),
            kernel: bounded_line(
                &std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default(),
            ),
            // getppid: a system call that does next to nothing, and that
            // glibc never answers from a cache.
            syscall_ns: fastest_ns(|| {
                std::hint::black_box(std::os::unix::process::parent_id());
            }),
            clock_read_ns: fastest_ns(|| {
                std::hint::black_box(std::time::Instant::now());
            }),
        }
    }
}

impl std::fmt::Display for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}, kernel {}; a system call {:.0} ns, a clock read {:.0} ns",
            self.cpu, self.kernel, self.syscall_ns, self.clock_read_ns
        )
    }
}

/// The first `model name` of /proc/cpuinfo, bounded.
fn cpu_model(cpuinfo: &str) -> String {
    cpuinfo
        .lines()
        .find_map(|l| {
            let (key, value) = l.split_once(':')?;
            (key.trim() == "model name").then(|| bounded_line(value))
        })
        .unwrap_or_else(|| "CPU model unknown".to_string())
}

/// `text`'s first line, trimmed, at most 80 characters.
fn bounded_line(text: &str) -> String {
    text.lines()
        .next()
        .unwrap_or_default()
        .trim()
        .chars()
        .take(80)
        .collect()
}

/// Nanoseconds per call of `op`: the fastest of 5 batches of 20,000 calls
/// (~20 ms in all where a call costs 200 ns), so a burst of load from other
/// processes during one batch does not count.
fn fastest_ns(mut op: impl FnMut()) -> f64 {
    const CALLS: u32 = 20_000;
    (0..5)
        .map(|_| {
            let start = std::time::Instant::now();
            for _ in 0..CALLS {
                op();
            }
            start.elapsed().as_nanos() as f64 / f64::from(CALLS)
        })
        .fold(f64::INFINITY, f64::min)
}

/// Reads `pid`'s usage; zeros for a process that is gone.
pub fn proc_usage(pid: u32) -> ProcUsage {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command name's ')', utime and stime (fields 14 and 15) are 11 and 12.
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
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    ProcUsage {
        cpu_seconds: (ticks(11) + ticks(12)) / 100.0,
        user_seconds: ticks(11) / 100.0,
        rss_kib: kib("VmRSS:"),
        peak_rss_kib: kib("VmHWM:"),
    }
}

/// The CPU time a process's threads have run so far, thread by thread,
/// in nanoseconds (`/proc/PID/task/*/schedstat`), and the process's total
/// in 10 ms ticks (`/proc/PID/stat`, which counts threads that have
/// exited too). A proxy pair at 1k req/s for 5 s runs ~15 ticks each on a
/// fast machine, so a tick is ~6% of the figure; the nanosecond count is
/// exact.
#[derive(Clone, Debug, Default)]
pub struct CpuClock {
    by_thread: std::collections::BTreeMap<u32, u64>,
    ticks_s: f64,
}

/// Reads `pid`'s CPU clock; empty for a process that is gone.
pub fn cpu_clock(pid: u32) -> CpuClock {
    let mut by_thread = std::collections::BTreeMap::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            let tid = task.file_name().to_string_lossy().parse::<u32>();
            let ran = std::fs::read_to_string(task.path().join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
            if let (Ok(tid), Some(ran)) = (tid, ran) {
                by_thread.insert(tid, ran);
            }
        }
    }
    CpuClock {
        by_thread,
        ticks_s: proc_usage(pid).cpu_seconds,
    }
}

impl CpuClock {
    /// Seconds run since `before`: to the nanosecond while every thread
    /// `before` saw is still there (new ones count whole); in ticks when
    /// one has exited, since what it ran after `before` is gone with it.
    pub fn seconds_since(&self, before: &CpuClock) -> f64 {
        let all_there = before
            .by_thread
            .keys()
            .all(|t| self.by_thread.contains_key(t));
        if !all_there || self.by_thread.is_empty() {
            return self.ticks_s - before.ticks_s;
        }
        let ns: u64 = self
            .by_thread
            .iter()
            .map(|(t, ran)| ran.saturating_sub(before.by_thread.get(t).copied().unwrap_or(0)))
            .sum();
        ns as f64 / 1e9
    }
}

/// How the scheduler ran a process's threads (`/proc/PID/task/*/schedstat`).
#[derive(Clone, Copy, Debug, Default)]
pub struct Sched {
    /// Seconds spent runnable but waiting for a CPU: on a shared machine,
    /// how much of a latency is the cores being busy with something else.
    pub waited_s: f64,
    /// Times a thread was put on a CPU (wake-ups, and returns after
    /// preemption).
    pub timeslices: u64,
    /// Times a thread was taken off a CPU while it could still run
    /// (`nonvoluntary_ctxt_switches`): preempted, for instance by a process
    /// it had just woken on the same CPU. Each costs a switch out and one
    /// back.
    pub preempted: u64,
}

/// Reads `pid`'s scheduling figures; NaN wait for a process that is gone.
pub fn sched(pid: u32) -> Sched {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Sched {
            waited_s: f64::NAN,
            ..Sched::default()
        };
    };
    let mut out = Sched::default();
    for task in tasks.flatten() {
        if let Ok(stat) = std::fs::read_to_string(task.path().join("schedstat")) {
            let mut fields = stat.split_whitespace().skip(1);
            let mut next = || {
                fields
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
            };
            out.waited_s += next() as f64 / 1e9;
            out.timeslices += next();
        }
        if let Ok(status) = std::fs::read_to_string(task.path().join("status")) {
            out.preempted += preempted(&status);
        }
    }
    out
}

/// TCP segments sent so far in the network namespaces `pids` run in, each
/// namespace counted once (`Tcp: OutSegs` of `/proc/PID/net/snmp`): with
/// each pod in a namespace of its own, every hop of a request and its
/// acknowledgements. None when a process is gone or shares this process's
/// namespace, where the count would be the whole machine's.
pub fn tcp_segments_sent(pids: &[u32]) -> Option<u64> {
    let namespace = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/net")).ok();
    let own = namespace("self")?;
    let mut seen = Vec::new();
    let mut sent = 0;
    for pid in pids {
        let ns = namespace(&pid.to_string())?;
        if ns == own {
            return None;
        }
        if seen.contains(&ns) {
            continue;
        }
        let snmp = std::fs::read_to_string(format!("/proc/{pid}/net/snmp")).ok()?;
        sent += out_segments(&snmp)?;
        seen.push(ns);
    }
    Some(sent)
}

/// `OutSegs` of `/proc/net/snmp`'s two `Tcp:` lines (names, then values).
fn out_segments(snmp: &str) -> Option<u64> {
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let (names, values) = (tcp.next()?, tcp.next()?);
    let at = names.split_whitespace().position(|n| n == "OutSegs")?;
    values.split_whitespace().nth(at)?.parse().ok()
}

/// `nonvoluntary_ctxt_switches` of a task's `/proc/.../status`, 0 when absent.
fn preempted(status: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix("nonvoluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A digest of a set of endpoint addresses (FNV-1a over the sorted
/// addresses), the same in every process: the discovery bench compares each
/// subscriber's final view with the registry's without shipping the sets.
pub fn endpoints_digest<'a>(addrs: impl IntoIterator<Item = &'a std::net::SocketAddr>) -> u64 {
    let mut sorted: Vec<&std::net::SocketAddr> = addrs.into_iter().collect();
    sorted.sort();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for a in sorted {
        for b in format!("{a},").bytes() {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// Waits until the admin listener at `admin` answers `/ready` with 200.
pub async fn wait_ready(
    admin: std::net::SocketAddr,
    timeout: std::time::Duration,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Ok((200, _)) = tether_mesh_up::stats::http_get(admin, "/ready").await {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            anyhow::bail!("{admin} was not ready within {timeout:?}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// The sum of every sample of `name` in a scrape whose labels include `labels`.
pub fn metric_sum(scrape: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    tether_core::prom::parse(scrape)
        .iter()
        .filter(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(*v)))
        .map(|s| s.value)
        .sum()
}

pub use tether_mesh_up::ports::reserve_ports;

/// The median of `v`, NaNs left out (the mean of the middle two for an
/// even count; NaN for none).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| !x.is_nan());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_the_middle_value_or_the_middle_two_s_mean() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![7.0, f64::NAN]), 7.0);
        assert!(median(Vec::new()).is_nan());
    }

    #[test]
    fn the_cpu_model_is_the_first_model_name_bounded() {
        let cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n\
                       processor\t: 1\nmodel name\t: Other\n";
        assert_eq!(cpu_model(cpuinfo), "AMD EPYC 9R14");
        assert_eq!(cpu_model("processor\t: 0\n"), "CPU model unknown");
        let long = format!("model name\t: {}\n", "x".repeat(500));
        assert_eq!(cpu_model(&long).len(), 80);
    }

    #[test]
    fn preemptions_are_read_from_a_tasks_status() {
        let status = "Name:\tx\nvoluntary_ctxt_switches:\t1700\n\
                      nonvoluntary_ctxt_switches:\t  905\n";
        assert_eq!(preempted(status), 905);
        assert_eq!(preempted("voluntary_ctxt_switches:\t3\n"), 0);
        assert_eq!(preempted("nonvoluntary_ctxt_switches:\tmany\n"), 0);
        // This process's own figures are read; a process that is gone has none.
        let me = sched(std::process::id());
        assert!(me.timeslices > 0, "{me:?}");
        assert!(sched(u32::MAX).waited_s.is_nan());
    }

    #[test]
    fn cpu_time_is_counted_to_the_nanosecond_unless_a_thread_has_gone() {
        let clock = |threads: &[(u32, u64)], ticks_s: f64| CpuClock {
            by_thread: threads.iter().copied().collect(),
            ticks_s,
        };
        let before = clock(&[(1, 1_000), (2, 5_000)], 0.10);
        // Threads still there count their difference, a new one whole.
        let after = clock(&[(1, 3_500), (2, 5_000), (3, 700)], 0.10);
        assert!((after.seconds_since(&before) - 3_200e-9).abs() < 1e-15);
        // A thread that exited took what it ran since with it: ticks.
        let after = clock(&[(1, 3_500)], 0.12);
        assert!((after.seconds_since(&before) - 0.02).abs() < 1e-12);
        // A busy process of one thread (not this one, whose other test
        // threads come and go) is read to well under a tick.
        let mut busy = std::process::Command::new("yes")
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let start = cpu_clock(busy.id());
        let t = std::time::Instant::now();
        let mut ran = 0.0;
        while ran == 0.0 && t.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(2));
            ran = cpu_clock(busy.id()).seconds_since(&start);
        }
        let _ = busy.kill();
        let _ = busy.wait();
        assert!(ran > 0.0 && ran < 1.0, "{ran}");
        assert_eq!(cpu_clock(u32::MAX).seconds_since(&cpu_clock(u32::MAX)), 0.0);
    }

    #[test]
    fn out_segments_are_read_by_their_column() {
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\n\
                    Tcp: RtoAlgorithm ActiveOpens InSegs OutSegs RetransSegs\n\
                    Tcp: 1 7 1200 1187 3\nUdp: InDatagrams\nUdp: 5\n";
        assert_eq!(out_segments(snmp), Some(1187));
        assert_eq!(out_segments("Tcp: RtoAlgorithm OutSegs\n"), None);
        assert_eq!(out_segments("Tcp: InSegs\nTcp: 4\n"), None);
        assert_eq!(tcp_segments_sent(&[std::process::id()]), None);
    }

    #[test]
    fn the_machine_is_measured_and_described() {
        let m = Machine::measure();
        assert!(m.syscall_ns.is_finite() && m.syscall_ns > 0.0, "{m:?}");
        assert!(
            m.clock_read_ns.is_finite() && m.clock_read_ns > 0.0,
            "{m:?}"
        );
        let text = m.to_string();
        assert!(
            text.contains("a system call") && text.contains(&m.kernel),
            "{text}"
        );
    }
}
