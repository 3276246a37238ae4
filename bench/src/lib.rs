//! What the benchmarks share: reading a process's CPU time and memory, and
//! a digest of an endpoint set that two processes compute alike.

#![forbid(unsafe_code)]

/// A process's CPU time (user + system) and memory, from `/proc`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcUsage {
    pub cpu_seconds: f64,
    pub rss_kib: u64,
    pub peak_rss_kib: u64,
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
        rss_kib: kib("VmRSS:"),
        peak_rss_kib: kib("VmHWM:"),
    }
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
