//! How many runtime worker threads a data-path process (`proxy`,
//! `gateway`) runs: what the operator asked for, else the container's CPU
//! quota (cgroup v2 `cpu.max`) rounded up, else one. A sidecar usually gets
//! a fraction of a core; one worker per host core costs it about 20% more
//! CPU at the same load, for wake-ups and work stealing between threads
//! (`docs/performance.md`).

use std::path::Path;

/// Where cgroup v2 exposes the quota of the process's own cgroup (the
/// container's namespace root).
pub const CGROUP_CPU_MAX: &str = "/sys/fs/cgroup/cpu.max";

/// The CPU quota in cores from the contents of a cgroup v2 `cpu.max`
/// (`QUOTA PERIOD` in microseconds, or `max PERIOD` when unlimited).
pub fn parse_cpu_max(contents: &str) -> Option<f64> {
    let mut fields = contents.split_whitespace();
    let quota: f64 = fields.next()?.parse().ok()?;
    let period: f64 = fields.next().unwrap_or("100000").parse().ok()?;
    (quota > 0.0 && period > 0.0).then(|| quota / period)
}

/// The quota of the cgroup file at `path`, if it is set.
pub fn cgroup_cpu_quota(path: &Path) -> Option<f64> {
    parse_cpu_max(&std::fs::read_to_string(path).ok()?)
}

/// Worker threads for a data-path runtime: `requested` when given, else the
/// CPU quota rounded up (a 1.5-core quota gets 2), else 1; never more than
/// the cores the machine has, never 0.
pub fn worker_threads(requested: Option<usize>, quota: Option<f64>, cores: usize) -> usize {
    let cores = cores.max(1);
    match (requested, quota) {
        (Some(n), _) => n.max(1),
        (None, Some(q)) => (q.ceil() as usize).clamp(1, cores),
        (None, None) => 1,
    }
}

/// [`worker_threads`] with this machine's quota and cores.
pub fn data_path_worker_threads(requested: Option<usize>) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    worker_threads(
        requested,
        cgroup_cpu_quota(Path::new(CGROUP_CPU_MAX)),
        cores,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_max_quota_in_cores() {
        assert_eq!(parse_cpu_max("50000 100000\n"), Some(0.5));
        assert_eq!(parse_cpu_max("250000 100000"), Some(2.5));
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(parse_cpu_max(""), None);
        assert_eq!(parse_cpu_max("0 100000"), None);
        assert_eq!(parse_cpu_max("garbage"), None);
    }

    #[test]
    fn requested_wins_then_quota_then_one() {
        assert_eq!(worker_threads(Some(3), Some(0.5), 2), 3);
        assert_eq!(worker_threads(None, Some(0.5), 8), 1);
        assert_eq!(worker_threads(None, Some(1.5), 8), 2);
        assert_eq!(worker_threads(None, Some(16.0), 4), 4);
        assert_eq!(worker_threads(None, None, 16), 1);
        assert_eq!(worker_threads(Some(0), None, 2), 1);
    }

    #[test]
    fn quota_from_a_file() {
        let dir = std::env::temp_dir().join(format!("tether-cpu-max-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("cpu.max");
        std::fs::write(&file, "150000 100000\n").unwrap();
        assert_eq!(cgroup_cpu_quota(&file), Some(1.5));
        assert_eq!(cgroup_cpu_quota(&dir.join("missing")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
