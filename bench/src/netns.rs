//! `--netns`: the proxy bench on a node with pods, as issue 14's harness
//! ran it. The root network namespace is the node; each route gets a
//! client pod and a server pod, each a network namespace joined to the node
//! by a veth pair (a /30 each, default route via the node's side), so
//! pod-to-pod traffic crosses pod veth → node (IP forwarding) → pod veth,
//! as on a Kubernetes node. The Tether pods are intercepted by `tether
//! init` (iptables REDIRECT, the proxies run as their own user).
//!
//! Everything is named `tb<pid>…` (namespaces `tb<pid>c<k>` and
//! `tb<pid>s<k>`, whose node-side veths carry the same names, and the
//! service range's link `tb<pid>v`, peer `tb<pid>v0`) and is removed when [`Node`] drops, on
//! Ctrl-C ([`remove_run`] from the signal handler), and at the next run's
//! start if the bench that made it is gone ([`remove_stale`]).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// The proxies' user: `tether init` leaves its traffic alone.
pub const PROXY_UID: &str = "1337";
/// A Tether pod's ports, as a sidecar's (the outbound on the pod's loopback,
/// where the redirect sends outbound connections).
pub const OUTBOUND_PORT: u16 = 4140;
pub const INBOUND_PORT: u16 = 4143;
/// Not redirected (`--skip-inbound-ports`), so the bench reads `/ready` and
/// `/metrics` from the node.
pub const ADMIN_PORT: u16 = 4191;
/// The backend's port in every server pod, and the services' port.
pub const APP_PORT: u16 = 8080;
/// The HAProxy sides' ports (on the pod's IP: no redirect).
pub const HAPROXY_CLIENT_PORT: u16 = 10000;
pub const HAPROXY_SERVER_PORT: u16 = 10001;

/// At most this many routes (a pod pair each): the third octet of the
/// addresses, and the last octet of the cluster IPs.
pub const MAX_PAIRS: usize = 64;

/// Second octets of 10.x.0.0/16 tried in turn for the bench's addresses:
/// high, away from the e2e tests' 10.100-249 and from the usual cluster
/// ranges; the first one the node has no address or route in is taken.
const OCTETS: [u8; 5] = [254, 253, 252, 251, 250];

/// The bench's names and addresses, from its pid and a free 10.x/16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    pub pid: u32,
    pub octet: u8,
}

/// Which pod of a pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

/// A pod's namespace, its address and the node's side of its veth.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pod {
    /// The namespace's name, also the name of the node's side of the veth.
    pub ns: String,
    pub ip: Ipv4Addr,
    pub gateway: Ipv4Addr,
}

impl Pod {
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(self.ip), port)
    }

    /// `ip` arguments that run `program` in the pod (`ip netns exec`
    /// execs it: the pid `ip` started with is the program's).
    pub fn exec(&self, program: &str) -> Vec<String> {
        ["netns", "exec", &self.ns, program]
            .map(String::from)
            .to_vec()
    }

    /// `ip` arguments that run `program` in the pod as the proxy's user
    /// (`setpriv` execs it too); with `net_raw`, keeping the one
    /// capability a transparent proxy needs.
    pub fn exec_as_proxy(&self, program: &str, net_raw: bool) -> Vec<String> {
        let mut v = self.exec("setpriv");
        v.extend([
            format!("--reuid={PROXY_UID}"),
            format!("--regid={PROXY_UID}"),
            "--clear-groups".to_string(),
        ]);
        if net_raw {
            v.extend([
                "--inh-caps=+net_raw".into(),
                "--ambient-caps=+net_raw".into(),
            ]);
        }
        v.push(program.to_string());
        v
    }
}

impl Plan {
    /// Pair `k`'s pod on `side`: the client veth is 10.O.k.0/30 (node .1,
    /// pod .2), the server veth 10.O.k.4/30 (node .5, pod .6).
    pub fn pod(&self, k: usize, side: Side) -> Pod {
        assert!(k < MAX_PAIRS, "at most {MAX_PAIRS} pod pairs");
        let (letter, base) = match side {
            Side::Client => ('c', 0),
            Side::Server => ('s', 4),
        };
        let ip = |host: u8| Ipv4Addr::new(10, self.octet, k as u8, base + host);
        Pod {
            ns: format!("tb{}{letter}{k}", self.pid),
            ip: ip(2),
            gateway: ip(1),
        }
    }

    /// Pair `k`'s service's cluster IP, in the service range.
    pub fn cluster_ip(&self, k: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.octet, 255, k as u8 + 1)
    }

    /// The services' range: routed on the node to a link of its own that
    /// leads nowhere (a veth pair with both ends on the node, and no
    /// address behind it), so a connection that escaped the redirect dies
    /// on the node (and the bench's check fails) instead of leaving the
    /// machine by its default route. (No `dummy` device: its kernel module
    /// may be missing, as on this machine.)
    pub fn service_range(&self) -> String {
        format!("10.{}.255.0/24", self.octet)
    }

    /// The service range's link and its peer.
    pub fn nowhere(&self) -> (String, String) {
        (format!("tb{}v", self.pid), format!("tb{}v0", self.pid))
    }
}

/// The pid in a name the bench gave (`tb<pid>` then `c`, `s` or `v`), else
/// `None`.
fn owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("tb")?;
    let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    let (pid, tail) = rest.split_at(digits);
    let kind = tail.chars().next()?;
    let index = &tail[1..];
    let digits = index.chars().all(|c| c.is_ascii_digit());
    let well_formed = match kind {
        'c' | 's' => !index.is_empty() && digits,
        'v' => digits,
        _ => false,
    };
    if well_formed {
        pid.parse().ok()
    } else {
        None
    }
}

/// Runs a command; an error names it and what it printed.
fn run(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args[0]))?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The network namespaces (`ip netns list` prints `NAME` or `NAME (id: N)`).
fn namespaces() -> Vec<String> {
    run(&["ip", "netns", "list"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect()
}

/// The node's links (`ip -o link` prints `N: NAME@PEER: …`).
fn links() -> Vec<String> {
    run(&["ip", "-o", "link", "show"])
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let name = l.split(": ").nth(1)?;
            Some(name.split('@').next()?.to_string())
        })
        .collect()
}

/// `net.ipv4.ip_forward` as it was before the bench set it, if it did.
static FORWARD_WAS: OnceLock<String> = OnceLock::new();
const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// The processes in namespace `ns`.
fn pids_in(ns: &str) -> Vec<String> {
    run(&["ip", "netns", "pids", ns])
        .unwrap_or_default()
        .split_whitespace()
        .map(String::from)
        .collect()
}

/// Removes what the bench of `pid` made: ends every process in its
/// namespaces (SIGTERM, so nginx's master stops its workers; SIGKILL after
/// 5 s), deletes its links and namespaces, and puts `ip_forward` back when
/// `pid` is this process and it changed it.
pub fn remove_run(pid: u32) {
    let own = |name: &String| owner(name) == Some(pid);
    let spaces: Vec<String> = namespaces().into_iter().filter(own).collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    for signal in ["-TERM", "-KILL"] {
        let pids: Vec<String> = spaces.iter().flat_map(|ns| pids_in(ns)).collect();
        if pids.is_empty() {
            break;
        }
        let _ = Command::new("kill").arg(signal).args(&pids).output();
        while Instant::now() < deadline && spaces.iter().any(|ns| !pids_in(ns).is_empty()) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // A veth goes with either end; the node's end first, so no pod's
    // routes outlive it.
    for link in links().into_iter().filter(own) {
        let _ = run(&["ip", "link", "del", &link]);
    }
    for ns in &spaces {
        let _ = run(&["ip", "netns", "del", ns]);
    }
    if pid == std::process::id() {
        if let Some(was) = FORWARD_WAS.get() {
            let _ = std::fs::write(IP_FORWARD, was);
        }
    }
}

/// Removes what earlier benches left when they were killed (their pid is
/// gone): namespaces, links.
pub fn remove_stale() {
    let mut dead: Vec<u32> = namespaces()
        .iter()
        .chain(&links())
        .filter_map(|n| owner(n))
        .filter(|pid| *pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists())
        .collect();
    dead.sort_unstable();
    dead.dedup();
    for pid in dead {
        eprintln!("removing the namespaces and links of an earlier bench (pid {pid}, gone)");
        remove_run(pid);
    }
}

/// Whether this process runs as root (effective uid 0).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1).map(|e| e == "0"))
        .unwrap_or(false)
}

/// The first of [`OCTETS`] that no address or route of the node uses.
fn free_octet() -> anyhow::Result<u8> {
    let used = run(&["ip", "-4", "route", "show", "table", "all"])? + &run(&["ip", "-4", "addr"])?;
    OCTETS
        .into_iter()
        .find(|o| !used.contains(&format!("10.{o}.")))
        .with_context(|| {
            format!(
                "--netns: every candidate range 10.{{{OCTETS:?}}}.0.0/16 is in use on this node"
            )
        })
}

/// The node: the pod pairs, removed when it drops.
pub struct Node {
    pub plan: Plan,
    pairs: usize,
    /// How long making the pods took.
    took: Duration,
}

/// Checks for root and the tools `--netns` runs (`install` fetches a
/// missing one: program, Debian package), before the bench does anything.
pub fn preflight(install: impl Fn(&str, &str) -> anyhow::Result<()>) -> anyhow::Result<()> {
    if !is_root() {
        bail!(
            "--netns needs root: it creates network namespaces, veths and iptables rules \
             and runs the proxies as uid {PROXY_UID}"
        );
    }
    for (program, package) in [
        ("ip", "iproute2"),
        ("iptables", "iptables"),
        ("setpriv", "util-linux"),
    ] {
        install(program, package)
            .with_context(|| format!("--netns needs `{program}` (Debian package {package})"))?;
    }
    Ok(())
}

impl Node {
    /// Removes stale namespaces, then makes `pairs` pod pairs (after
    /// [`preflight`]).
    pub fn new(pairs: usize) -> anyhow::Result<Self> {
        if pairs > MAX_PAIRS {
            bail!("--netns: {pairs} routes, at most {MAX_PAIRS}");
        }
        remove_stale();
        let started = Instant::now();
        let mut node = Self {
            plan: Plan {
                pid: std::process::id(),
                octet: free_octet()?,
            },
            pairs,
            took: Duration::ZERO,
        };
        // From here on, a failure drops `node`, which removes what was made.
        node.build()?;
        node.took = started.elapsed();
        Ok(node)
    }

    fn build(&self) -> anyhow::Result<()> {
        let forward = std::fs::read_to_string(IP_FORWARD).context("reading ip_forward")?;
        if forward.trim() != "1" {
            let _ = FORWARD_WAS.set(forward);
            std::fs::write(IP_FORWARD, "1").context("enabling IP forwarding on the node")?;
        }
        let (nowhere, peer) = self.plan.nowhere();
        run(&[
            "ip", "link", "add", &nowhere, "type", "veth", "peer", "name", &peer,
        ])?;
        for link in [&nowhere, &peer] {
            run(&["ip", "link", "set", link, "up"])?;
        }
        run(&[
            "ip",
            "route",
            "add",
            &self.plan.service_range(),
            "dev",
            &nowhere,
        ])?;
        for k in 0..self.pairs {
            for side in [Side::Client, Side::Server] {
                add_pod(&self.plan.pod(k, side))?;
            }
        }
        Ok(())
    }

    pub fn client(&self, k: usize) -> Pod {
        self.plan.pod(k, Side::Client)
    }

    pub fn server(&self, k: usize) -> Pod {
        self.plan.pod(k, Side::Server)
    }

    /// Where the control plane listens: the node's side of the first
    /// pod's veth, an address of the node every pod reaches by its default
    /// route (and not an address outside the machine).
    pub fn control_ip(&self) -> Ipv4Addr {
        self.client(0).gateway
    }

    /// For the output: what ran.
    pub fn describe(&self) -> String {
        format!(
            "network namespaces (--netns): per route a client pod and a server pod, each joined to \
             the node (the root namespace, forwarding) by a veth pair in 10.{}.0.0/16; Tether pods \
             intercepted by `tether init` (iptables REDIRECT, proxies as uid {PROXY_UID}), the load \
             dialing the service's cluster IP in {}; direct and HAProxy dialed at pod IPs, no \
             redirect; control plane on the node at {}; {} pods made in {:.1} s",
            self.plan.octet,
            self.plan.service_range(),
            self.control_ip(),
            self.pairs * 2,
            self.took.as_secs_f64()
        )
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        remove_run(self.plan.pid);
    }
}

/// A namespace with a veth to the node: the pod's end is `eth0`, with the
/// default route via the node's end.
fn add_pod(pod: &Pod) -> anyhow::Result<()> {
    let ns = pod.ns.as_str();
    let (ip, gw) = (format!("{}/30", pod.ip), format!("{}/30", pod.gateway));
    run(&["ip", "netns", "add", ns])?;
    run(&[
        "ip", "link", "add", ns, "type", "veth", "peer", "name", "eth0", "netns", ns,
    ])?;
    run(&["ip", "addr", "add", &gw, "dev", ns])?;
    run(&["ip", "link", "set", ns, "up"])?;
    let gateway = pod.gateway.to_string();
    for args in [
        &["ip", "addr", "add", &ip, "dev", "eth0"][..],
        &["ip", "link", "set", "eth0", "up"],
        &["ip", "link", "set", "lo", "up"],
        &["ip", "route", "add", "default", "via", &gateway],
    ] {
        let mut full = vec!["ip", "netns", "exec", ns];
        full.extend(args);
        run(&full)?;
    }
    Ok(())
}

/// `tether init` in `pod`: outbound to the proxy's outbound port, inbound
/// to its inbound port, the admin port and `control_port` (when given)
/// skipped.
/// `tproxy` picks `tether init --mode tproxy` (no connection tracking).
pub fn intercept(
    tether: &Path,
    pod: &Pod,
    control_port: Option<u16>,
    tproxy: bool,
) -> anyhow::Result<()> {
    let mut args: Vec<String> = vec!["ip".into()];
    args.extend(pod.exec(&tether.display().to_string()));
    args.extend(init_args(control_port));
    if tproxy {
        args.extend(["--mode".into(), "tproxy".into()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run(&args).map(|_| ())
}

fn init_args(control_port: Option<u16>) -> Vec<String> {
    let mut args = [
        "init",
        "--proxy-uid",
        PROXY_UID,
        "--outbound-port",
        &OUTBOUND_PORT.to_string(),
        "--inbound-port",
        &INBOUND_PORT.to_string(),
        "--skip-inbound-ports",
        &ADMIN_PORT.to_string(),
    ]
    .map(String::from)
    .to_vec();
    if let Some(port) = control_port {
        args.extend(["--skip-outbound-ports".to_string(), port.to_string()]);
    }
    args
}

/// Waits until the process `pid` runs `exe` and a TCP socket listens on
/// `addr` in its network namespace (`/proc/PID/net/tcp`): for what the
/// bench, on the node, cannot dial, such as a pod's loopback. The program
/// first, since `/proc/PID/net` is the namespace the pid is in now, and
/// until `ip netns exec` has switched and exec'd that is the node's.
pub async fn wait_listening(
    pid: u32,
    exe: &Path,
    addr: SocketAddr,
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        // The program first: a table read before the exec is the node's.
        let runs = check_runs(pid, exe).is_ok();
        let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp"))
            .with_context(|| format!("pid {pid} is gone"))?;
        if runs && listens_on(&table, addr) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("pid {pid} was not listening on {addr} within {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether a `/proc/net/tcp` table has a socket in LISTEN on `addr` (or on
/// the wildcard address at its port).
fn listens_on(table: &str, addr: SocketAddr) -> bool {
    let IpAddr::V4(ip) = addr.ip() else {
        return false;
    };
    // The kernel prints the address as the u32 it holds (network order) in
    // hex, so on a little-endian machine 127.0.0.1 reads 0100007F.
    let hex = |ip: Ipv4Addr| format!("{:08X}", u32::from_ne_bytes(ip.octets()));
    let wanted = [
        format!("{}:{:04X}", hex(ip), addr.port()),
        format!("{}:{:04X}", hex(Ipv4Addr::UNSPECIFIED), addr.port()),
    ];
    table.lines().skip(1).any(|line| {
        // "sl local_address rem_address st …": the second field, then the fourth.
        let mut fields = line.split_whitespace();
        let (local, state) = (fields.nth(1), fields.nth(1));
        state == Some("0A") && local.is_some_and(|l| wanted.iter().any(|w| w == l))
    })
}

/// Fails unless `pid` runs `exe` (the measured process, not `ip` or
/// `setpriv`, which exec it).
pub fn check_runs(pid: u32, exe: &Path) -> anyhow::Result<()> {
    let running = std::fs::read_link(format!("/proc/{pid}/exe"))
        .with_context(|| format!("pid {pid} is gone"))?;
    let want = exe.canonicalize().unwrap_or_else(|_| exe.to_path_buf());
    if running.file_name() != want.file_name() {
        bail!(
            "pid {pid} runs {}, not {}: the bench would measure the wrong process",
            running.display(),
            want.display()
        );
    }
    Ok(())
}

/// Sum of `tether_proxy_requests_total` in `direction` in a `/metrics` text.
pub fn requests(metrics: &str, direction: &str) -> f64 {
    let label = format!("direction=\"{direction}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with("tether_proxy_requests_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_get_disjoint_30s_and_names_that_fit_an_interface() {
        let plan = Plan {
            pid: 4_194_304, // the largest pid Linux hands out
            octet: 254,
        };
        let mut seen = std::collections::HashSet::new();
        for k in [0, 1, MAX_PAIRS - 1] {
            for side in [Side::Client, Side::Server] {
                let pod = plan.pod(k, side);
                assert!(pod.ns.len() <= 15, "{} is too long for a link name", pod.ns);
                assert_eq!(owner(&pod.ns), Some(plan.pid));
                // Node and pod ends in one /30, not its network or broadcast address.
                let (g, p) = (u32::from(pod.gateway), u32::from(pod.ip));
                assert_eq!(g >> 2, p >> 2, "{pod:?}");
                assert!(![0, 3].contains(&(g & 3)) && ![0, 3].contains(&(p & 3)));
                assert!(seen.insert(g >> 2), "{pod:?} shares a /30");
                assert!(!plan.service_range().starts_with(&format!(
                    "{}.",
                    pod.ip.to_string().rsplit_once('.').unwrap().0
                )));
            }
            let cip = plan.cluster_ip(k);
            assert_eq!(cip.octets()[..3], [10, 254, 255]);
            assert_ne!(cip.octets()[3], 0);
        }
        assert_eq!(plan.pod(1, Side::Server).ip, Ipv4Addr::new(10, 254, 1, 6));
        let (nowhere, peer) = plan.nowhere();
        assert_eq!(owner(&nowhere), Some(plan.pid));
        assert_eq!(owner(&peer), Some(plan.pid));
        assert!(peer.len() <= 15);
        assert_eq!(
            plan.pod(0, Side::Client).exec("x")[..3],
            ["netns", "exec", "tb4194304c0"]
        );
    }

    #[test]
    fn only_the_benchs_own_names_are_taken_for_its_leftovers() {
        assert_eq!(owner("tb123c0"), Some(123));
        assert_eq!(owner("tb123s12"), Some(123));
        assert_eq!(owner("tb123v"), Some(123));
        assert_eq!(owner("tb123v0"), Some(123));
        for other in [
            "tb123",
            "tb123c",
            "tb123x0",
            "tbc0",
            "tb123vx",
            "tether-t1-0-0",
            "eth0",
        ] {
            assert_eq!(owner(other), None, "{other}");
        }
    }

    #[test]
    fn interception_skips_the_admin_and_control_ports() {
        let a = init_args(Some(39_001)).join(" ");
        assert!(a.contains("--proxy-uid 1337"), "{a}");
        assert!(
            a.contains("--outbound-port 4140 --inbound-port 4143"),
            "{a}"
        );
        assert!(a.contains("--skip-inbound-ports 4191"), "{a}");
        assert!(a.contains("--skip-outbound-ports 39001"), "{a}");
        let a = init_args(None).join(" ");
        assert!(!a.contains("--skip-outbound-ports"), "{a}");
    }

    #[test]
    #[cfg(target_endian = "little")]
    fn a_listening_socket_is_found_by_address_and_state() {
        // From /proc/net/tcp: 127.0.0.1:4140 listening, 10.254.1.6:4143
        // listening, 10.254.1.6:8080 established.
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             0: 0100007F:102C 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1337        0 1 1\n\
             1: 0601FE0A:102F 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1337        0 2 1\n\
             2: 0601FE0A:1F90 0201FE0A:9C40 01 00000000:00000000 00:00000000 00000000     0        0 3 1\n";
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(listens_on(table, at("127.0.0.1:4140")));
        assert!(listens_on(table, at("10.254.1.6:4143")));
        // Established, not listening.
        assert!(!listens_on(table, at("10.254.1.6:8080")));
        assert!(!listens_on(table, at("127.0.0.1:4143")));
        // The wildcard address listens on every address.
        let any = "header\n 0: 00000000:102C 00000000:0000 0A 0 0 0 0 0 0 0\n";
        assert!(listens_on(any, at("127.0.0.1:4140")));
    }

    #[test]
    fn requests_are_summed_by_direction() {
        let m = "# TYPE tether_proxy_requests_total counter\n\
                 tether_proxy_requests_total{direction=\"outbound\",authority=\"a\",class=\"success\"} 7\n\
                 tether_proxy_requests_total{direction=\"outbound\",authority=\"b\",class=\"failure\"} 2\n\
                 tether_proxy_requests_total{direction=\"inbound\",authority=\"a\"} 5\n\
                 tether_proxy_request_duration_seconds_count{direction=\"outbound\"} 100\n";
        assert_eq!(requests(m, "outbound"), 9.0);
        assert_eq!(requests(m, "inbound"), 5.0);
    }
}
