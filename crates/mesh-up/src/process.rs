//! Child processes for `tether up` (and tests): each one dies with its
//! parent (`PR_SET_PDEATHSIG`), logs to its own file, and announces its
//! listeners on stdout (`listening NAME ADDR`), which is how the parent
//! learns ports the OS chose.

use std::collections::HashMap;
use std::io::{Read as _, Seek as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// For harnesses (tests, benchmarks): a `tether` command line that talks to
/// or serves the control plane gets `--insecure-control-plane` when it has
/// no `--identity` to do TLS with; with one, it keeps the default, TLS.
pub fn plaintext_control_plane_without_identity(args: &mut Vec<String>) {
    let speaks_to_control = matches!(
        args.first().map(String::as_str),
        Some("control" | "proxy" | "gateway" | "check" | "diagnostics")
    );
    let has = |flag: &str| args.iter().any(|a| a == flag);
    if speaks_to_control && !has("--identity") && !has("--insecure-control-plane") {
        args.push("--insecure-control-plane".into());
    }
}

/// What runs a sidecar proxy: the `tether-proxy` binary (the proxy alone,
/// a third of `tether`'s code and a smaller resident set), or `tether proxy`.
/// Both take the same flags.
#[derive(Clone, Debug)]
pub struct ProxyCommand {
    exe: PathBuf,
    /// `tether proxy`: the subcommand word goes before the flags.
    subcommand: bool,
}

impl ProxyCommand {
    /// The proxy-only binary's file name.
    pub const BINARY: &'static str = "tether-proxy";

    /// `tether-proxy` when it sits beside the `tether` binary `tether`
    /// (`cargo build -p tether-proxy-cli`, or a release archive, puts it
    /// there) and is of this release, else `tether proxy`. A `tether-proxy`
    /// left from another release (an upgrade that replaced only `tether`)
    /// may take other flags or behave otherwise: `tether proxy` is this
    /// release's proxy for certain.
    pub fn beside(tether: &Path) -> Self {
        let own = tether.with_file_name(Self::BINARY);
        if own.is_file() && reports_version(&own, env!("CARGO_PKG_VERSION")) {
            Self::proxy_only(own)
        } else {
            Self::subcommand_of(tether.to_path_buf())
        }
    }

    /// `exe FLAGS`: a `tether-proxy` binary.
    pub fn proxy_only(exe: PathBuf) -> Self {
        Self {
            exe,
            subcommand: false,
        }
    }

    /// `exe proxy FLAGS`: a `tether` binary.
    pub fn subcommand_of(exe: PathBuf) -> Self {
        Self {
            exe,
            subcommand: true,
        }
    }

    pub fn exe(&self) -> &Path {
        &self.exe
    }

    /// Whether this is the `tether-proxy` binary (no subcommand word).
    pub fn is_proxy_only(&self) -> bool {
        !self.subcommand
    }

    /// The command line that runs the proxy with `flags`.
    pub fn args(&self, flags: &[String]) -> Vec<String> {
        let word = self.subcommand.then(|| "proxy".to_string());
        word.into_iter().chain(flags.iter().cloned()).collect()
    }

    /// Which binary, for people: `tether-proxy (PATH)` or `tether proxy (PATH)`.
    pub fn describe(&self) -> String {
        let what = if self.subcommand {
            "tether proxy"
        } else {
            Self::BINARY
        };
        format!("{what} ({})", self.exe.display())
    }
}

/// Whether `tether-proxy --version` at `exe` names `version`; `false` for
/// one that fails, or is still running after [`VERSION_PROBE_TIMEOUT`].
fn reports_version(exe: &Path, version: &str) -> bool {
    let child = std::process::Command::new(exe)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let Ok(mut child) = child else {
        return false;
    };
    let deadline = std::time::Instant::now() + VERSION_PROBE_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
        }
    }
    let mut out = String::new();
    let read = child
        .stdout
        .take()
        .map(|mut s| std::io::Read::read_to_string(&mut s, &mut out));
    matches!(read, Some(Ok(_))) && out.trim() == format!("{} {version}", ProxyCommand::BINARY)
}

/// How long `tether-proxy --version` may take before the binary is
/// passed over (it prints and exits at once).
const VERSION_PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The last lines of a child's log, for an error that says why it stopped
/// without sending the reader to a file that may be gone by then (a run's
/// directory is removed on exit). Bounded: a child's output is not ours.
fn log_tail(log: &Path) -> String {
    const MAX_BYTES: u64 = 2048;
    const MAX_LINES: usize = 10;
    let read = || -> std::io::Result<Vec<u8>> {
        let mut f = std::fs::File::open(log)?;
        let len = f.metadata()?.len();
        f.seek(std::io::SeekFrom::Start(len.saturating_sub(MAX_BYTES)))?;
        let mut buf = Vec::new();
        f.take(MAX_BYTES).read_to_end(&mut buf)?;
        Ok(buf)
    };
    match read() {
        Ok(buf) => {
            let text = String::from_utf8_lossy(&buf);
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(MAX_LINES)..].join("\n");
            if tail.trim().is_empty() {
                "(empty)".to_string()
            } else {
                tail
            }
        }
        Err(e) => format!("(unreadable: {e})"),
    }
}

pub struct Process {
    pub name: String,
    pub addrs: HashMap<String, SocketAddr>,
    child: Child,
}

impl Process {
    /// Starts `exe args…` and waits (at most 20 s) until it has announced
    /// every listener in `expect`.
    pub async fn spawn(
        exe: &Path,
        name: &str,
        args: &[String],
        log: &Path,
        expect: &[&str],
    ) -> anyhow::Result<Self> {
        let log_file =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .kill_on_drop(true);
        // SAFETY: the closure runs in the forked child before exec, where
        // only async-signal-safe calls are allowed: prctl is one, and the
        // closure neither allocates nor takes locks.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut lines = BufReader::new(stdout).lines();
        let mut addrs = HashMap::new();
        let wait = async {
            while expect.iter().any(|e| !addrs.contains_key(*e)) {
                let Some(line) = lines.next_line().await? else {
                    bail!(
                        "{name} exited before it was ready; the end of {}:\n{}",
                        log.display(),
                        log_tail(log)
                    );
                };
                let mut parts = line.split_whitespace();
                if let (Some("listening"), Some(what), Some(addr)) =
                    (parts.next(), parts.next(), parts.next())
                {
                    addrs.insert(what.to_string(), addr.parse::<SocketAddr>()?);
                }
            }
            Ok(())
        };
        tokio::time::timeout(Duration::from_secs(20), wait)
            .await
            .map_err(|_| anyhow!("{name} did not start within 20s; see {}", log.display()))??;
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self {
            name: name.to_string(),
            addrs,
            child,
        })
    }

    pub fn addr(&self, what: &str) -> SocketAddr {
        self.addrs[what]
    }

    /// A listener the process may or may not have announced.
    pub fn try_addr(&self, what: &str) -> Option<SocketAddr> {
        self.addrs.get(what).copied()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// SIGKILL at once: a crash.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub async fn stop(&mut self, grace: Duration) -> Option<std::process::ExitStatus> {
        if let Some(pid) = self.child.id() {
            // SAFETY: kill(2) touches no memory of ours; `id()` is Some only
            // while the child is not yet reaped, so the pid is still ours.
            unsafe {
                libc::kill(pid as i32, libc::SIGTERM);
            }
        }
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => status.ok(),
            Err(_) => {
                let _ = self.child.kill().await;
                self.child.wait().await.ok()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_tail_is_its_last_lines_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("x.log");
        let mut text: String = (0..100).map(|i| format!("line {i}\n")).collect();
        text.push_str("Error: binding 127.0.0.1:1: Address already in use\n");
        std::fs::write(&log, &text).unwrap();
        let tail = log_tail(&log);
        assert!(tail.ends_with("Address already in use"), "{tail}");
        assert_eq!(tail.lines().count(), 10);
        assert!(tail.starts_with("line 91"), "{tail}");

        std::fs::write(&log, "x".repeat(1 << 20)).unwrap();
        assert_eq!(log_tail(&log).len(), 2048);
        std::fs::write(&log, "").unwrap();
        assert_eq!(log_tail(&log), "(empty)");
        assert!(log_tail(&dir.path().join("missing")).starts_with("(unreadable: "));
    }

    #[test]
    fn the_proxy_only_binary_beside_tether_runs_the_sidecars() {
        let dir = tempfile::tempdir().unwrap();
        let tether = dir.path().join("tether");
        std::fs::write(&tether, "").unwrap();
        let flags = ["--control".to_string(), "127.0.0.1:8086".to_string()];

        let without = ProxyCommand::beside(&tether);
        assert_eq!(without.exe(), tether);
        assert_eq!(
            without.args(&flags),
            ["proxy", "--control", "127.0.0.1:8086"]
        );
        assert!(without.describe().starts_with("tether proxy ("));

        let own = dir.path().join("tether-proxy");
        fake_proxy(&own, env!("CARGO_PKG_VERSION"));
        // Another test's child, forked while the script was open for
        // writing, holds it open until it execs (ETXTBSY): ask again then.
        let mut with = ProxyCommand::beside(&tether);
        for _ in 0..100 {
            if with.exe() == own {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
            with = ProxyCommand::beside(&tether);
        }
        assert_eq!(with.exe(), own);
        assert_eq!(with.args(&flags), flags);
        assert!(with.describe().starts_with("tether-proxy ("));
    }

    /// A `tether-proxy` that prints `version` for `--version`.
    fn fake_proxy(path: &Path, version: &str) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(path, format!("#!/bin/sh\necho 'tether-proxy {version}'\n")).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A `tether-proxy` of another release beside `tether` (an upgrade
    /// that replaced only `tether`), or one that does not run, is passed
    /// over: `tether proxy` is this release's proxy.
    #[test]
    fn a_tether_proxy_of_another_release_is_passed_over() {
        let dir = tempfile::tempdir().unwrap();
        let tether = dir.path().join("tether");
        std::fs::write(&tether, "").unwrap();
        let own = dir.path().join("tether-proxy");
        fake_proxy(&own, "0.0.1-older");
        let chosen = ProxyCommand::beside(&tether);
        assert_eq!(chosen.exe(), tether, "{}", chosen.describe());
        assert_eq!(chosen.args(&[]), ["proxy"]);
        std::fs::write(&own, "not a program").unwrap();
        assert_eq!(ProxyCommand::beside(&tether).exe(), tether);
    }
}
