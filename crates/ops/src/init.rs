//! `tether init`: programs iptables the way a sidecar's init container
//! does. Outbound TCP from the workload is redirected to the proxy's
//! outbound port and inbound TCP to its inbound port; the proxy's own user
//! (so its connections are never looped back), loopback destinations and
//! the configured ports are skipped. Tether's rules live in two chains of
//! the nat table, which are flushed and refilled, and the jumps to them are
//! added only if missing: running it twice gives the same rules.

use std::process::Command;

pub const OUTPUT_CHAIN: &str = "TETHER_OUTPUT";
pub const INBOUND_CHAIN: &str = "TETHER_INBOUND";

#[derive(Clone, Debug)]
pub struct InitOptions {
    pub iptables: String,
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

/// The iptables invocations, in order: (arguments, whether failure is
/// expected and harmless).
pub fn plan(o: &InitOptions) -> Vec<(Vec<String>, bool)> {
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let mut cmds = Vec::new();
    let mut chains = vec![(OUTPUT_CHAIN, "OUTPUT")];
    if o.inbound {
        chains.push((INBOUND_CHAIN, "PREROUTING"));
    }
    for (chain, _) in &chains {
        cmds.push((s(&["-t", "nat", "-N", chain]), true)); // exists already: fine
        cmds.push((s(&["-t", "nat", "-F", chain]), false));
    }
    let uid = o.proxy_uid.to_string();
    cmds.push((
        s(&[
            "-t",
            "nat",
            "-A",
            OUTPUT_CHAIN,
            "-m",
            "owner",
            "--uid-owner",
            &uid,
            "-j",
            "RETURN",
        ]),
        false,
    ));
    cmds.push((
        s(&[
            "-t",
            "nat",
            "-A",
            OUTPUT_CHAIN,
            "-d",
            "127.0.0.1/32",
            "-j",
            "RETURN",
        ]),
        false,
    ));
    for port in &o.skip_outbound_ports {
        let p = port.to_string();
        cmds.push((
            s(&[
                "-t",
                "nat",
                "-A",
                OUTPUT_CHAIN,
                "-p",
                "tcp",
                "--dport",
                &p,
                "-j",
                "RETURN",
            ]),
            false,
        ));
    }
    let out = o.outbound_port.to_string();
    cmds.push((
        s(&[
            "-t",
            "nat",
            "-A",
            OUTPUT_CHAIN,
            "-p",
            "tcp",
            "-j",
            "REDIRECT",
            "--to-ports",
            &out,
        ]),
        false,
    ));
    if o.inbound {
        for port in o.skip_inbound_ports.iter().chain([&o.inbound_port]) {
            let p = port.to_string();
            cmds.push((
                s(&[
                    "-t",
                    "nat",
                    "-A",
                    INBOUND_CHAIN,
                    "-p",
                    "tcp",
                    "--dport",
                    &p,
                    "-j",
                    "RETURN",
                ]),
                false,
            ));
        }
        let inb = o.inbound_port.to_string();
        cmds.push((
            s(&[
                "-t",
                "nat",
                "-A",
                INBOUND_CHAIN,
                "-p",
                "tcp",
                "-j",
                "REDIRECT",
                "--to-ports",
                &inb,
            ]),
            false,
        ));
    }
    for (chain, parent) in &chains {
        // -C fails when the jump is missing; then -A adds it (see `run`).
        cmds.push((
            s(&["-t", "nat", "-C", parent, "-p", "tcp", "-j", chain]),
            true,
        ));
    }
    cmds
}

/// Runs the plan (or prints it with `dry_run`).
pub fn run(o: &InitOptions) -> anyhow::Result<()> {
    for (args, may_fail) in plan(o) {
        println!("{} {}", o.iptables, args.join(" "));
        if o.dry_run {
            continue;
        }
        let out = Command::new(&o.iptables)
            .args(&args)
            .output()
            .map_err(|e| anyhow::anyhow!("running {}: {e} (is iptables installed?)", o.iptables))?;
        if out.status.success() {
            continue;
        }
        if args.get(2).map(String::as_str) == Some("-C") {
            // The jump is missing: add it.
            let mut add = args.clone();
            add[2] = "-A".into();
            println!("{} {}", o.iptables, add.join(" "));
            let out = Command::new(&o.iptables).args(&add).output()?;
            anyhow::ensure!(
                out.status.success(),
                "{} {}: {}",
                o.iptables,
                add.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        } else if !may_fail {
            anyhow::bail!(
                "{} {}: {}",
                o.iptables,
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_skips_the_proxy_and_redirects_the_rest() {
        let plan = plan(&InitOptions {
            iptables: "iptables".into(),
            proxy_uid: 1337,
            outbound_port: 4140,
            inbound_port: 4143,
            skip_inbound_ports: vec![4191],
            skip_outbound_ports: vec![8086],
            inbound: true,
            dry_run: true,
        });
        let lines: Vec<String> = plan.iter().map(|(a, _)| a.join(" ")).collect();
        let owner = lines
            .iter()
            .position(|l| l.contains("--uid-owner 1337 -j RETURN"))
            .unwrap();
        let redirect = lines
            .iter()
            .position(|l| l.contains("--to-ports 4140"))
            .unwrap();
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
    }
}
