//! Who may call this proxy's app: the inbound authorization policy.
//!
//! This is the default policy of the proxy (`--default-inbound-policy`),
//! with the semantics Linkerd users know:
//!
//! | policy | allows |
//! | --- | --- |
//! | `all-unauthenticated` | every client |
//! | `all-authenticated` | clients with a verified mesh certificate (mTLS) |
//! | `cluster-authenticated` | mTLS clients, and any client from `--cluster-networks` |
//! | `deny` | no client |
//!
//! With `--inbound-policy-audit` a request the policy would deny is let
//! through, logged (at a bounded rate) and counted, for rolling a policy
//! out. Denied HTTP requests get 403 (gRPC `PERMISSION_DENIED`) naming the
//! client and the server; denied TCP connections are closed.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use tether_core::log_limit::LogLimit;

/// Would-be denials under audit are logged at most this often.
static AUDIT_LOG: LogLimit = LogLimit::new(Duration::from_secs(5));

/// The route name of a server without routes (every request).
pub const DEFAULT_ROUTE: &str = "default";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DefaultPolicy {
    #[default]
    AllUnauthenticated,
    AllAuthenticated,
    ClusterAuthenticated,
    Deny,
}

impl DefaultPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AllUnauthenticated => "all-unauthenticated",
            Self::AllAuthenticated => "all-authenticated",
            Self::ClusterAuthenticated => "cluster-authenticated",
            Self::Deny => "deny",
        }
    }
}

impl std::str::FromStr for DefaultPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        [
            Self::AllUnauthenticated,
            Self::AllAuthenticated,
            Self::ClusterAuthenticated,
            Self::Deny,
        ]
        .into_iter()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| {
            format!(
                "unknown policy {:?}: expected all-unauthenticated, all-authenticated, \
                 cluster-authenticated or deny",
                tether_core::truncate::for_log(s)
            )
        })
    }
}

/// An IP network, `ADDR/PREFIX`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Network {
    addr: IpAddr,
    prefix: u8,
}

impl std::str::FromStr for Network {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{:?} is not a network ADDR/PREFIX",
                tether_core::truncate::for_log(s)
            )
        };
        let (addr, prefix) = s.split_once('/').ok_or_else(bad)?;
        let addr: IpAddr = addr.parse().map_err(|_| bad())?;
        let prefix: u8 = prefix.parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(bad());
        }
        Ok(Self { addr, prefix })
    }
}

impl Network {
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// Linkerd's default cluster networks: the private ranges.
pub const DEFAULT_CLUSTER_NETWORKS: &str =
    "10.0.0.0/8,100.64.0.0/10,172.16.0.0/12,192.168.0.0/16,fd00::/8";

/// The inbound policy of one proxy.
#[derive(Clone, Debug)]
pub struct InboundPolicy {
    pub default: DefaultPolicy,
    /// Let would-be denials through, logged and counted.
    pub audit: bool,
    /// Where `cluster-authenticated` admits plaintext clients from.
    pub cluster_networks: Vec<Network>,
}

impl Default for InboundPolicy {
    fn default() -> Self {
        Self {
            default: DefaultPolicy::AllUnauthenticated,
            audit: false,
            cluster_networks: DEFAULT_CLUSTER_NETWORKS
                .split(',')
                .map(|n| n.parse().expect("the default networks parse"))
                .collect(),
        }
    }
}

/// What the policy says about one request or connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    /// Denied: answer 403 or close.
    Deny(Denial),
    /// Would be denied, let through under audit.
    Audit(Denial),
}

/// Who was (or would have been) refused, and by what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    /// The client: its verified identity, or "unauthenticated client".
    pub client: String,
    /// The server: `default:<policy>` for a proxy's default policy.
    pub server: String,
    pub route: String,
    /// The authorization that decided: `default:<policy>`.
    pub authz: String,
}

impl InboundPolicy {
    /// The verdict for a client with `identity` (from mTLS) connecting from `peer`.
    pub fn check(&self, identity: Option<&str>, peer: IpAddr) -> Verdict {
        let allowed = match self.default {
            DefaultPolicy::AllUnauthenticated => true,
            DefaultPolicy::AllAuthenticated => identity.is_some(),
            DefaultPolicy::ClusterAuthenticated => {
                identity.is_some() || self.cluster_networks.iter().any(|n| n.contains(peer))
            }
            DefaultPolicy::Deny => false,
        };
        if allowed {
            return Verdict::Allow;
        }
        let name = format!("default:{}", self.default.as_str());
        let denial = Denial {
            client: identity.map_or_else(|| "unauthenticated client".into(), str::to_string),
            server: name.clone(),
            route: DEFAULT_ROUTE.into(),
            authz: name,
        };
        if self.audit {
            if let Some(suppressed) = AUDIT_LOG.allow() {
                tracing::info!(client = %denial.client, %peer, server = %denial.server, suppressed, "audit: the inbound policy would deny this");
            }
            Verdict::Audit(denial)
        } else {
            Verdict::Deny(denial)
        }
    }
}

/// Distinct `client_id` label values kept; later clients count as `other`,
/// so a stream of new identities cannot grow the metrics without bound.
pub const MAX_CLIENT_LABELS: usize = 100;

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct DeniedLabels {
    pub server: String,
    pub route: String,
    pub authz: String,
    pub client_id: String,
}

/// `tether_proxy_inbound_denied_total` and, under audit,
/// `tether_proxy_inbound_audit_denied_total`.
#[derive(Clone, Default)]
pub struct AuthzMetrics {
    denied: Family<DeniedLabels, Counter>,
    audited: Family<DeniedLabels, Counter>,
    clients: Arc<Mutex<HashSet<String>>>,
}

impl AuthzMetrics {
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "tether_proxy_inbound_denied",
            "Inbound requests and connections the authorization policy denied",
            self.denied.clone(),
        );
        registry.register(
            "tether_proxy_inbound_audit_denied",
            "Inbound requests and connections the policy would deny, let through under audit",
            self.audited.clone(),
        );
    }

    /// Counts a denial (`audit`: one let through).
    pub fn count(&self, denial: &Denial, audit: bool) {
        let client_id = {
            let mut clients = self.clients.lock().unwrap();
            if clients.contains(&denial.client) || clients.len() < MAX_CLIENT_LABELS {
                clients.insert(denial.client.clone());
                denial.client.clone()
            } else {
                "other".to_string()
            }
        };
        let labels = DeniedLabels {
            server: denial.server.clone(),
            route: denial.route.clone(),
            authz: denial.authz.clone(),
            client_id,
        };
        let family = if audit { &self.audited } else { &self.denied };
        family.get_or_create(&labels).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(default: DefaultPolicy) -> InboundPolicy {
        InboundPolicy {
            default,
            ..InboundPolicy::default()
        }
    }

    #[test]
    fn each_default_policy_admits_what_its_name_says() {
        let id = Some("web.test.serviceaccount.identity.cluster.local");
        let pod: IpAddr = "10.1.2.3".parse().unwrap();
        let outside: IpAddr = "203.0.113.9".parse().unwrap();
        let allowed = |p: DefaultPolicy, id: Option<&str>, ip: IpAddr| {
            policy(p).check(id, ip) == Verdict::Allow
        };
        use DefaultPolicy::*;
        for (p, mtls, plain_pod, plain_outside) in [
            (AllUnauthenticated, true, true, true),
            (AllAuthenticated, true, false, false),
            (ClusterAuthenticated, true, true, false),
            (Deny, false, false, false),
        ] {
            assert_eq!(allowed(p, id, outside), mtls, "{p:?} mTLS");
            assert_eq!(
                allowed(p, None, pod),
                plain_pod,
                "{p:?} plaintext in cluster"
            );
            assert_eq!(
                allowed(p, None, outside),
                plain_outside,
                "{p:?} plaintext outside"
            );
        }
        let audited = InboundPolicy {
            audit: true,
            ..policy(Deny)
        };
        assert!(matches!(audited.check(id, pod), Verdict::Audit(d) if d.server == "default:deny"));
    }

    #[test]
    fn client_labels_are_bounded() {
        let metrics = AuthzMetrics::default();
        for i in 0..MAX_CLIENT_LABELS + 10 {
            let denial = Denial {
                client: format!("c{i}"),
                server: "default:deny".into(),
                route: DEFAULT_ROUTE.into(),
                authz: "default:deny".into(),
            };
            metrics.count(&denial, false);
        }
        let mut registry = prometheus_client::registry::Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let series = text.matches("tether_proxy_inbound_denied_total{").count();
        assert_eq!(series, MAX_CLIENT_LABELS + 1, "{text}");
        assert!(text.contains("client_id=\"other\"} 10"), "{text}");
    }

    #[test]
    fn networks_parse_and_match() {
        let n: Network = "10.0.0.0/8".parse().unwrap();
        assert!(n.contains("10.255.0.1".parse().unwrap()));
        assert!(n.contains("::ffff:10.0.0.1".parse().unwrap()));
        assert!(!n.contains("11.0.0.1".parse().unwrap()));
        let all: Network = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("192.0.2.1".parse().unwrap()));
        let v6: Network = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()));
        assert!("10.0.0.0/33".parse::<Network>().is_err());
        assert!("10.0.0.0".parse::<Network>().is_err());
        assert!("deny".parse::<DefaultPolicy>().is_ok());
        assert!("allow".parse::<DefaultPolicy>().is_err());
    }
}
