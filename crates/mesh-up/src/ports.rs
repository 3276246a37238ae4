//! Loopback ports picked before the process that listens on them starts.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};

/// `n` loopback ports free now, for addresses other processes must know
/// before their owner starts (export APIs and gateways of linked clusters,
/// a bench's listeners), or that a process restarted must find free again.
///
/// A port is free only until its owner binds it. Ports the OS hands out for
/// `bind(0)` and outgoing connections come from the ephemeral range, so
/// one of those picked here could be taken in that gap by any socket on the
/// machine (every proxy and load generator of a run makes such sockets). So
/// they are picked outside that range, where only a socket naming the port
/// can take it, and each probe is held until all `n` are found, so no two
/// are the same.
pub fn reserve_ports(n: usize) -> anyhow::Result<Vec<SocketAddr>> {
    let ephemeral = ephemeral_range();
    let candidates = ports_outside(ephemeral);
    let start = rand::random_range(0..candidates.len());
    let mut held = Vec::with_capacity(n);
    for i in 0..candidates.len() {
        if held.len() == n {
            break;
        }
        let port = candidates[(start + i) % candidates.len()];
        if let Ok(l) = TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
            held.push(l);
        }
    }
    anyhow::ensure!(
        held.len() == n,
        "found only {} free loopback ports outside the ephemeral range {}-{}; {n} are needed",
        held.len(),
        ephemeral.0,
        ephemeral.1
    );
    held.iter()
        .map(|l| Ok(l.local_addr()?))
        .collect::<anyhow::Result<_>>()
}

/// The kernel's ephemeral port range, or Linux's default when it cannot
/// be read.
fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| parse_port_range(&s))
        .unwrap_or((32768, 60999))
}

/// `ip_local_port_range`'s "low high".
fn parse_port_range(s: &str) -> Option<(u16, u16)> {
    let mut parts = s.split_whitespace().map(str::parse::<u16>);
    match (parts.next(), parts.next()) {
        (Some(Ok(low)), Some(Ok(high))) if low <= high => Some((low, high)),
        _ => None,
    }
}

/// Unprivileged ports outside the ephemeral range `(low, high)`, from
/// 10000 up: lower ports are where well-known services listen.
fn ports_outside((low, high): (u16, u16)) -> Vec<u16> {
    let below = 10_000..low.max(10_000);
    let above = high.checked_add(1).map(|p| p.max(10_000)..=u16::MAX);
    let mut ports: Vec<u16> = below.chain(above.into_iter().flatten()).collect();
    if ports.is_empty() {
        // The whole range is ephemeral: nothing safer to pick from.
        ports = (10_000..=u16::MAX).collect();
    }
    ports
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_range_is_read_or_refused() {
        assert_eq!(parse_port_range("32768\t60999\n"), Some((32768, 60999)));
        assert_eq!(parse_port_range("60999 32768"), None);
        assert_eq!(parse_port_range("32768"), None);
        assert_eq!(parse_port_range("a b"), None);
    }

    #[test]
    fn reserved_ports_lie_outside_the_ephemeral_range() {
        let ports = ports_outside((32768, 60999));
        assert!(ports
            .iter()
            .all(|p| *p >= 10_000 && !(32768..=60999).contains(p)));
        assert!(ports.contains(&32767) && ports.contains(&61000) && ports.contains(&65535));
        // A range that covers every unprivileged port leaves nothing safer.
        assert_eq!(ports_outside((1024, 65535)).len(), 65536 - 10_000);
    }

    #[test]
    fn reserved_ports_are_distinct_and_free_after_return() {
        let (low, high) = ephemeral_range();
        let ports = reserve_ports(8).unwrap();
        let distinct: std::collections::HashSet<_> = ports.iter().map(|a| a.port()).collect();
        assert_eq!(distinct.len(), 8);
        for a in &ports {
            assert!(!(low..=high).contains(&a.port()), "{a} is ephemeral");
            std::net::TcpListener::bind(a).unwrap();
        }
    }
}
