//! `tether init`: programs iptables the way a sidecar's init container
//! does. Outbound TCP from the workload goes to the proxy's outbound port
//! and inbound TCP to its inbound port; the proxy's own traffic (so its
//! connections are never looped back), loopback destinations and the
//! configured ports are skipped. Two modes:
//! - `redirect` (the default): NAT, in two chains of the nat table. Every
//!   connection in the pod is then tracked by the kernel, and the proxy
//!   reads each one's destination back from the tracking
//!   (`SO_ORIGINAL_DST`).
//! - `tproxy`: no NAT and no connection tracking. The app's outbound
//!   packets are marked ([`DIVERT_MARK`]) and routed to the loopback, where
//!   TPROXY hands them to the outbound listener; new inbound connections
//!   (their SYN) are handed to the inbound listener. Each packet is judged
//!   alone, so the proxy's own are told by their mark ([`PROXY_OWN_MARK`],
//!   which outlives a closed socket) and its user. The proxy must run with
//!   `--transparent` (`CAP_NET_RAW`).
//!
//! Rules live in chains of Tether's own, flushed and refilled on each run;
//! jumps to them and the routing rule are added only if missing: running
//! it twice gives the same rules. Redirect mode takes tproxy mode's rules
//! away; tproxy mode never touches the nat table (see [`plan`]).

use std::process::Command;

use tether_core::marks::{DIVERT_MARK, DIVERT_TABLE, PROXY_OWN_MARK};

pub const OUTPUT_CHAIN: &str = "TETHER_OUTPUT";
pub const INBOUND_CHAIN: &str = "TETHER_INBOUND";
/// tproxy mode's chain in the mangle table's PREROUTING.
pub const DIVERT_CHAIN: &str = "TETHER_DIVERT";

/// How connections reach the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// NAT (`REDIRECT`): connection tracking in the pod.
    Redirect,
    /// TPROXY and policy routing: no connection tracking.
    Tproxy,
}

#[derive(Clone, Debug)]
pub struct InitOptions {
    pub iptables: String,
    /// The `ip` command (iproute2), for tproxy mode's routing rule.
    pub ip: String,
    pub mode: Mode,
    pub proxy_uid: u32,
    pub outbound_port: u16,
    pub inbound_port: u16,
    /// Inbound ports left alone (e.g. the proxy's admin port).
    pub skip_inbound_ports: Vec<u16>,
    /// Outbound destination ports left alone.
    pub skip_outbound_ports: Vec<u16>,
    /// Whether to redirect inbound traffic too.
    pub inbound: bool,
    pub dry_run: bool,
}

/// What a step's failure means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFailure {
    /// The run stops with the command's error.
    Stop,
    /// Expected and harmless (a chain that exists already, a rule that is
    /// not there to delete).
    Ignore,
    /// A check (`-C`) found nothing: the step after it adds what was
    /// missing.
    RunNext,
    /// What it adds is there already (`ip rule add`'s `File exists`).
    ExistsIsFine,
}

/// One command of the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub program: String,
    pub args: Vec<String>,
    pub on_failure: OnFailure,
    /// Run only after a `RunNext` check failed.
    pub only_if_missing: bool,
}

impl Step {
    pub fn line(&self) -> String {
        format!("{} {}", self.program, self.args.join(" "))
    }
}

/// A step from its command line, split at spaces (no argument has one).
fn step(program: &str, line: &str, on_failure: OnFailure) -> Step {
    Step {
        program: program.to_string(),
        args: line.split_whitespace().map(String::from).collect(),
        on_failure,
        only_if_missing: false,
    }
}

/// The kernel settings tproxy mode needs in the pod's namespace, as
/// (`/proc/sys` path, value):
/// - a reply the kernel makes on its own (a reset for a closed port, an
///   acknowledgement from TIME_WAIT) and a connection an app's listener
///   accepts then carry the mark of the packet they answer, which
///   PREROUTING sets on everything from outside the pod: so they are not
///   taken for the app's outbound traffic and diverted;
/// - no SYN cookies. Only a new connection's SYN is diverted to the
///   inbound; a listener answering with a cookie keeps no record, so the
///   handshake's last ACK would reach whatever else listens on the port,
///   the app itself, around the proxy and its policy.
pub fn sysctls(o: &InitOptions) -> Vec<(&'static str, &'static str)> {
    match o.mode {
        Mode::Redirect => Vec::new(),
        Mode::Tproxy => vec![
            ("/proc/sys/net/ipv4/fwmark_reflect", "1"),
            ("/proc/sys/net/ipv4/tcp_fwmark_accept", "1"),
            ("/proc/sys/net/ipv4/tcp_syncookies", "0"),
        ],
    }
}

/// The routing rule's priority: before the main table (32766).
pub const DIVERT_RULE_PRIORITY: u32 = 8192;

/// The commands, in order.
pub fn plan(o: &InitOptions) -> Vec<Step> {
    let mut steps = Vec::new();
    let divert_mark = format!("{DIVERT_MARK:#x}/{DIVERT_MARK:#x}");
    // The routing rule: marked packets are delivered locally. First, so
    // that no packet is ever marked without it; added once, by priority.
    let table_id = DIVERT_TABLE;
    let rule = format!("fwmark {divert_mark} lookup {table_id} priority {DIVERT_RULE_PRIORITY}");
    if o.mode == Mode::Tproxy {
        let local = format!("route replace local 0.0.0.0/0 dev lo table {table_id}");
        steps.push(step(&o.ip, &local, OnFailure::Stop));
        steps.push(step(
            &o.ip,
            &format!("rule add {rule}"),
            OnFailure::ExistsIsFine,
        ));
    }
    let (table, other) = match o.mode {
        Mode::Redirect => ("nat", "mangle"),
        Mode::Tproxy => ("mangle", "nat"),
    };
    let mut iptables = |line: String, on_failure| steps.push(step(&o.iptables, &line, on_failure));
    // tproxy mode's rules go, wherever an earlier run left them. Not
    // redirect mode's in tproxy mode: the nat table, once used in a
    // namespace, keeps the kernel tracking its connections (with legacy
    // iptables even a look at it does), so a pod moves from redirect to
    // tproxy mode in a namespace of its own.
    if o.mode == Mode::Redirect {
        for (parent, chain) in [("OUTPUT", OUTPUT_CHAIN), ("PREROUTING", DIVERT_CHAIN)] {
            let jump = format!("-t {other} -D {parent} -p tcp -j {chain}");
            iptables(jump, OnFailure::Ignore);
            iptables(format!("-t {other} -F {chain}"), OnFailure::Ignore);
            iptables(format!("-t {other} -X {chain}"), OnFailure::Ignore);
        }
    }
    let (out, divert) = (OUTPUT_CHAIN, DIVERT_CHAIN);
    let inbound_chain = match o.mode {
        Mode::Redirect => INBOUND_CHAIN,
        Mode::Tproxy => DIVERT_CHAIN,
    };
    // tproxy mode's PREROUTING chain takes the outbound's diverted packets
    // back in, so it is there even without inbound interception.
    let mut chains = vec![(OUTPUT_CHAIN, "OUTPUT")];
    if o.inbound || o.mode == Mode::Tproxy {
        chains.push((inbound_chain, "PREROUTING"));
    }
    for (chain, _) in &chains {
        iptables(format!("-t {table} -N {chain}"), OnFailure::Ignore); // exists already: fine
        iptables(format!("-t {table} -F {chain}"), OnFailure::Stop);
    }
    let own_mark = format!("{PROXY_OWN_MARK:#x}/{PROXY_OWN_MARK:#x}");
    let (uid, to_outbound, to_inbound) = (o.proxy_uid, o.outbound_port, o.inbound_port);
    let add = |rule: &str| format!("-t {table} -A {rule}");
    if o.mode == Mode::Tproxy {
        // The proxy's own sockets, even closed ones with data or a FIN
        // still queued, whose user the kernel has forgotten; and replies
        // the kernel makes to packets from outside the pod.
        iptables(
            add(&format!("{out} -m mark --mark {own_mark} -j RETURN")),
            OnFailure::Stop,
        );
    }
    iptables(
        add(&format!("{out} -m owner --uid-owner {uid} -j RETURN")),
        OnFailure::Stop,
    );
    match o.mode {
        Mode::Redirect => {
            iptables(
                add(&format!("{out} -d 127.0.0.1/32 -j RETURN")),
                OnFailure::Stop,
            );
        }
        Mode::Tproxy => {
            iptables(
                add(&format!("{out} -d 127.0.0.0/8 -j RETURN")),
                OnFailure::Stop,
            );
            // Only the app's connections are diverted: a packet from
            // another address is a diverted connection's answer.
            let rule = format!("{out} -m addrtype ! --src-type LOCAL -j RETURN");
            iptables(add(&rule), OnFailure::Stop);
        }
    }
    for port in &o.skip_outbound_ports {
        iptables(
            add(&format!("{out} -p tcp --dport {port} -j RETURN")),
            OnFailure::Stop,
        );
    }
    match o.mode {
        Mode::Redirect => {
            let rule = format!("{out} -p tcp -j REDIRECT --to-ports {to_outbound}");
            iptables(add(&rule), OnFailure::Stop);
        }
        Mode::Tproxy => {
            // Marked, the packet is routed to the loopback (the routing
            // rule, set first) and comes back in through PREROUTING, where a
            // new connection's SYN is handed to the outbound listener; the
            // rest of its packets find the accepted socket by address.
            iptables(
                add(&format!("{out} -p tcp -j MARK --set-xmark {divert_mark}")),
                OnFailure::Stop,
            );
            let rule = format!(
                "{divert} -i lo -p tcp --syn -m mark --mark {divert_mark} -j TPROXY \
                 --on-ip 127.0.0.1 --on-port {to_outbound} --tproxy-mark {divert_mark}"
            );
            iptables(add(&rule), OnFailure::Stop);
            // From the pod itself: judged on its way out.
            iptables(add(&format!("{divert} -i lo -j RETURN")), OnFailure::Stop);
            // Everything from outside, so that what the kernel answers it
            // with carries the mark too (see `sysctls`).
            iptables(
                add(&format!("{divert} -j MARK --set-xmark {own_mark}")),
                OnFailure::Stop,
            );
        }
    }
    if o.inbound {
        for port in o.skip_inbound_ports.iter().chain([&o.inbound_port]) {
            let rule = format!("{inbound_chain} -p tcp --dport {port} -j RETURN");
            iptables(add(&rule), OnFailure::Stop);
        }
        let rule = match o.mode {
            Mode::Redirect => {
                format!("{inbound_chain} -p tcp -j REDIRECT --to-ports {to_inbound}")
            }
            // A new connection's SYN only: TPROXY would drop any other
            // packet (replies to the proxy's own connections among them)
            // for not reaching a transparent socket. For this namespace
            // only: a SYN it forwards is not its own. The listener is
            // found on the inbound port at the first address of the
            // interface the SYN came in on.
            Mode::Tproxy => format!(
                "{inbound_chain} -p tcp --syn -m addrtype --dst-type LOCAL -j TPROXY \
                 --on-port {to_inbound}"
            ),
        };
        iptables(add(&rule), OnFailure::Stop);
    }
    for (chain, parent) in &chains {
        // -C fails when the jump is missing; then -A adds it.
        iptables(
            format!("-t {table} -C {parent} -p tcp -j {chain}"),
            OnFailure::RunNext,
        );
        iptables(
            format!("-t {table} -A {parent} -p tcp -j {chain}"),
            OnFailure::Stop,
        );
    }
    if o.mode == Mode::Redirect {
        // tproxy mode's routing, after its rules are gone.
        steps.push(step(&o.ip, &format!("rule del {rule}"), OnFailure::Ignore));
        let local = format!("route del local 0.0.0.0/0 dev lo table {table_id}");
        steps.push(step(&o.ip, &local, OnFailure::Ignore));
    }
    // What follows a check runs only when the check found nothing.
    for i in 1..steps.len() {
        if steps[i - 1].on_failure == OnFailure::RunNext {
            steps[i].only_if_missing = true;
        }
    }
    steps
}

/// Runs the plan (or prints it with `dry_run`).
pub fn run(o: &InitOptions) -> anyhow::Result<()> {
    for (path, value) in sysctls(o) {
        println!("echo {value} > {path}");
        let now = std::fs::read_to_string(path).unwrap_or_default();
        if !o.dry_run && now.trim() != value {
            std::fs::write(path, value).map_err(|e| {
                anyhow::anyhow!("writing {value} to {path}: {e} (tproxy mode needs it in the pod's network namespace)")
            })?;
        }
    }
    let mut missing = false;
    for step in plan(o) {
        if step.only_if_missing && !std::mem::take(&mut missing) {
            continue;
        }
        println!("{}", step.line());
        if o.dry_run {
            // Shown as if the check found nothing: every command there is.
            missing = step.on_failure == OnFailure::RunNext;
            continue;
        }
        let out = Command::new(&step.program).args(&step.args).output();
        let out = match (out, step.on_failure) {
            (Ok(out), _) => out,
            // Cleaning up another mode's rules needs no tool that mode
            // does not use.
            (Err(_), OnFailure::Ignore) => continue,
            (Err(e), _) => anyhow::bail!(
                "running {}: {e} (is {} installed?)",
                step.program,
                if step.program == o.ip {
                    "iproute2"
                } else {
                    "iptables"
                }
            ),
        };
        if out.status.success() {
            continue;
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        match step.on_failure {
            OnFailure::Ignore => {}
            OnFailure::RunNext => missing = true,
            OnFailure::ExistsIsFine if stderr.contains("File exists") => {}
            OnFailure::Stop | OnFailure::ExistsIsFine => {
                anyhow::bail!("{}: {}", step.line(), stderr.trim())
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(mode: Mode) -> InitOptions {
        InitOptions {
            iptables: "iptables".into(),
            ip: "ip".into(),
            mode,
            proxy_uid: 1337,
            outbound_port: 4140,
            inbound_port: 4143,
            skip_inbound_ports: vec![4191],
            skip_outbound_ports: vec![8086],
            inbound: true,
            dry_run: true,
        }
    }

    fn lines(o: &InitOptions) -> Vec<String> {
        plan(o).iter().map(|s| s.args.join(" ")).collect()
    }

    fn position(lines: &[String], part: &str) -> usize {
        lines
            .iter()
            .position(|l| l.contains(part))
            .unwrap_or_else(|| panic!("no {part:?} in {lines:#?}"))
    }

    #[test]
    fn the_plan_skips_the_proxy_and_redirects_the_rest() {
        let lines = lines(&options(Mode::Redirect));
        let owner = position(
            &lines,
            "-t nat -A TETHER_OUTPUT -m owner --uid-owner 1337 -j RETURN",
        );
        let redirect = position(&lines, "--to-ports 4140");
        assert!(
            owner < redirect,
            "the proxy's own traffic must be skipped first"
        );
        assert!(lines.iter().any(|l| l.contains("--dport 8086 -j RETURN")));
        assert!(lines
            .iter()
            .any(|l| l.contains("TETHER_INBOUND -p tcp --dport 4191 -j RETURN")));
        assert!(lines.iter().any(|l| l.ends_with("--to-ports 4143")));
        assert!(lines
            .iter()
            .any(|l| l == "-t nat -C OUTPUT -p tcp -j TETHER_OUTPUT"));
        // Nothing of tproxy mode is added, and what it left is taken away.
        assert!(
            !lines.iter().any(|l| l.contains("-t mangle -A")),
            "{lines:#?}"
        );
        assert!(lines
            .iter()
            .any(|l| l == "-t mangle -D PREROUTING -p tcp -j TETHER_DIVERT"));
        assert!(lines
            .iter()
            .any(|l| l == "rule del fwmark 0x2000/0x2000 lookup 8192 priority 8192"));
    }

    #[test]
    fn the_tproxy_plan_marks_diverts_and_tracks_nothing() {
        let lines = lines(&options(Mode::Tproxy));
        // No NAT, no state: nothing that would make the kernel track
        // connections in the pod.
        for l in &lines {
            let adds = l.contains(" -A ") || l.contains(" -I ");
            let tracks = l.contains("-t nat")
                || l.contains("conntrack")
                || l.contains("state")
                || l.contains(" CT ");
            assert!(!(adds && tracks), "{l}");
        }
        let out = |rule: &str| position(&lines, &format!("-t mangle -A TETHER_OUTPUT {rule}"));
        let own_mark = out("-m mark --mark 0x1000/0x1000 -j RETURN");
        let owner = out("-m owner --uid-owner 1337 -j RETURN");
        let loopback = out("-d 127.0.0.0/8 -j RETURN");
        let answers = out("-m addrtype ! --src-type LOCAL -j RETURN");
        let skip = out("-p tcp --dport 8086 -j RETURN");
        let mark = out("-p tcp -j MARK --set-xmark 0x2000/0x2000");
        for before in [own_mark, owner, loopback, answers, skip] {
            assert!(before < mark, "{lines:#?}");
        }
        let divert = |rule: &str| position(&lines, &format!("-t mangle -A TETHER_DIVERT {rule}"));
        // Back in through the loopback: a new connection's SYN goes to the
        // outbound listener.
        let outbound = divert(
            "-i lo -p tcp --syn -m mark --mark 0x2000/0x2000 -j TPROXY --on-ip 127.0.0.1 \
             --on-port 4140 --tproxy-mark 0x2000/0x2000",
        );
        // Inbound: only a new connection's SYN, never from the pod itself
        // and never for the skipped ports; everything from outside is
        // marked first, skipped ports included, so the kernel's answers
        // to it are not diverted.
        let from_pod = divert("-i lo -j RETURN");
        let outside = divert("-j MARK --set-xmark 0x1000/0x1000");
        let admin = divert("-p tcp --dport 4191 -j RETURN");
        let itself = divert("-p tcp --dport 4143 -j RETURN");
        let inbound = divert("-p tcp --syn -m addrtype --dst-type LOCAL -j TPROXY --on-port 4143");
        assert!(outbound < from_pod && from_pod < outside, "{lines:#?}");
        assert!(
            outside < admin && admin < inbound && itself < inbound,
            "{lines:#?}"
        );
        position(&lines, "-t mangle -C OUTPUT -p tcp -j TETHER_OUTPUT");
        position(&lines, "-t mangle -C PREROUTING -p tcp -j TETHER_DIVERT");
        // The routing first: no packet is marked without it.
        let route = position(&lines, "route replace local 0.0.0.0/0 dev lo table 8192");
        let rule = position(
            &lines,
            "rule add fwmark 0x2000/0x2000 lookup 8192 priority 8192",
        );
        assert!(route < rule && rule < own_mark, "{lines:#?}");
        assert!(
            !lines.iter().any(|l| l.starts_with("rule del")),
            "{lines:#?}"
        );
        // The nat table is not touched: with legacy iptables, even a look
        // at it would make the kernel track connections.
        assert!(!lines.iter().any(|l| l.contains("-t nat")), "{lines:#?}");
        assert_eq!(
            sysctls(&options(Mode::Tproxy)),
            [
                ("/proc/sys/net/ipv4/fwmark_reflect", "1"),
                ("/proc/sys/net/ipv4/tcp_fwmark_accept", "1"),
                ("/proc/sys/net/ipv4/tcp_syncookies", "0")
            ]
        );
        assert!(sysctls(&options(Mode::Redirect)).is_empty());
    }

    #[test]
    fn outbound_only_tproxy_still_diverts_the_outbound() {
        let mut o = options(Mode::Tproxy);
        o.inbound = false;
        let lines = lines(&o);
        position(&lines, "-j TPROXY --on-ip 127.0.0.1 --on-port 4140");
        position(&lines, "-t mangle -C PREROUTING -p tcp -j TETHER_DIVERT");
        assert!(
            !lines.iter().any(|l| l.contains("--on-port 4143")),
            "{lines:#?}"
        );
    }

    #[test]
    fn a_missing_jump_is_added_and_a_present_one_is_not() {
        let steps = plan(&options(Mode::Tproxy));
        let check = steps
            .iter()
            .position(|s| s.on_failure == OnFailure::RunNext)
            .unwrap();
        assert!(steps[check + 1].only_if_missing);
        assert_eq!(steps[check + 1].args[2], "-A");
        assert!(steps
            .iter()
            .filter(|s| s.only_if_missing)
            .all(|s| s.args[2] == "-A"));
    }
}
