//! Who may call this proxy's app: the inbound authorization policy.
//!
//! This is the default policy of the proxy (`--default-inbound-policy`),
//! with the semantics Linkerd users know:
//!
//! | policy | allows |
//! | --- | --- |
//! | `all-unauthenticated` | every client |
//! | `all-authenticated` | clients with a verified mesh certificate (mTLS) |
//! | `cluster-unauthenticated` | any client from `--cluster-networks` |
//! | `cluster-authenticated` | mTLS clients from `--cluster-networks` |
//! | `deny` | no client |
//!
//! With `--inbound-policy-audit` a request the policy would deny is let
//! through, logged (at a bounded rate) and counted, for rolling a policy
//! out. Denied HTTP requests get 403 (gRPC `PERMISSION_DENIED`) naming the
//! client and the server; denied TCP connections are closed.
//!
//! With `--workload`, the control plane's policy for the port
//! ([`crate::inbound_policy`]) is followed and combined with the default
//! ([`Authorizer`]).

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use tether_core::log_limit::LogLimit;
use tokio::sync::watch;

use crate::inbound_policy::{Client, Decision, PolicyCounters, ServerState};

/// Would-be denials under audit are logged at most this often.
static AUDIT_LOG: LogLimit = LogLimit::new(Duration::from_secs(5));

/// The route name of a server without routes (every request).
pub const DEFAULT_ROUTE: &str = "default";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DefaultPolicy {
    #[default]
    AllUnauthenticated,
    AllAuthenticated,
    ClusterUnauthenticated,
    ClusterAuthenticated,
    Deny,
}

impl DefaultPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AllUnauthenticated => "all-unauthenticated",
            Self::AllAuthenticated => "all-authenticated",
            Self::ClusterUnauthenticated => "cluster-unauthenticated",
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
            Self::ClusterUnauthenticated,
            Self::ClusterAuthenticated,
            Self::Deny,
        ]
        .into_iter()
        .find(|p| p.as_str() == s)
        .ok_or_else(|| {
            format!(
                "unknown policy {:?}: expected all-unauthenticated, all-authenticated, \
                 cluster-unauthenticated, cluster-authenticated or deny",
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
        Self::new(addr, prefix).ok_or_else(bad)
    }
}

impl Network {
    /// `addr/prefix`; `None` when the prefix is longer than the address.
    pub fn new(addr: IpAddr, prefix: u8) -> Option<Self> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return None;
        }
        // Clients' IPv4-mapped addresses are compared as IPv4, so a network
        // written in mapped form must be too, or it (or an `except` written
        // so) would never hold anyone.
        if let IpAddr::V6(v6) = addr {
            if let (Some(v4), Some(prefix)) = (v6.to_ipv4_mapped(), prefix.checked_sub(96)) {
                return Some(Self {
                    addr: IpAddr::V4(v4),
                    prefix,
                });
            }
        }
        Some(Self { addr, prefix })
    }

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
    /// The networks `cluster-unauthenticated` and `cluster-authenticated`
    /// admit clients from.
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
    /// No route of the server (named) matches the request: 404.
    NoRoute(String),
}

/// Who was (or would have been) refused, and by what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    /// The client: its verified identity, or "unauthenticated client".
    pub client: String,
    /// The server: `default:<policy>` for a default policy, else the
    /// `Server`'s name.
    pub server: String,
    pub route: String,
    /// What decided: `default:<policy>` for a default policy, `none` when
    /// no authorization of a `Server` admits the client, the admitting
    /// authorization under audit.
    pub authz: String,
}

fn client_name(identity: Option<&str>) -> String {
    identity.map_or_else(|| "unauthenticated client".into(), str::to_string)
}

/// A denial, or under audit a denial let through (logged at a bounded
/// rate).
fn refuse(denial: Denial, audit: bool, peer: IpAddr) -> Verdict {
    if audit {
        if let Some(suppressed) = AUDIT_LOG.allow() {
            tracing::info!(client = %denial.client, %peer, server = %denial.server, route = %denial.route, authz = %denial.authz, suppressed, "audit: the inbound policy would deny this");
        }
        Verdict::Audit(denial)
    } else {
        Verdict::Deny(denial)
    }
}

impl InboundPolicy {
    /// The verdict for a client with `identity` (from mTLS) connecting from `peer`.
    pub fn check(&self, identity: Option<&str>, peer: IpAddr) -> Verdict {
        match self.denial(identity, peer) {
            None => Verdict::Allow,
            Some(denial) => refuse(denial, self.audit, peer),
        }
    }

    fn denial(&self, identity: Option<&str>, peer: IpAddr) -> Option<Denial> {
        let allowed = match self.default {
            DefaultPolicy::AllUnauthenticated => true,
            DefaultPolicy::AllAuthenticated => identity.is_some(),
            DefaultPolicy::ClusterUnauthenticated => {
                self.cluster_networks.iter().any(|n| n.contains(peer))
            }
            // Linkerd's meaning (and what the control plane serves): mTLS
            // clients, and only those in the cluster's networks.
            DefaultPolicy::ClusterAuthenticated => {
                identity.is_some() && self.cluster_networks.iter().any(|n| n.contains(peer))
            }
            DefaultPolicy::Deny => false,
        };
        if allowed {
            return None;
        }
        let name = format!("default:{}", self.default.as_str());
        Some(Denial {
            client: client_name(identity),
            server: name.clone(),
            route: DEFAULT_ROUTE.into(),
            authz: name,
        })
    }
}

/// The policy in force for the inbound port: the control plane's answer
/// (`InboundServerPolicies`) when there is one, else the proxy's default
/// policy. A default the control plane answers (no `Server` selects the
/// port) is combined with the proxy's: a client must pass both, so
/// neither default opens what the other closes. `--inbound-policy-audit`
/// turns every denial into audit.
#[derive(Clone)]
pub struct Authorizer {
    flag: InboundPolicy,
    server: watch::Receiver<ServerState>,
    metrics: AuthzMetrics,
    /// Admissions by the proxy's default alone.
    flag_allowed: Arc<OnceLock<Counter>>,
}

/// What is checked: a connection, or a request with its authority.
enum Subject<'r, B> {
    Connection,
    Request(&'r http::Request<B>, &'r str),
}

impl Authorizer {
    /// `server` follows the control plane's answers; a receiver that never
    /// changes (the sender dropped) keeps the default policy alone.
    pub fn new(
        flag: InboundPolicy,
        server: watch::Receiver<ServerState>,
        metrics: AuthzMetrics,
    ) -> Self {
        Self {
            flag,
            server,
            metrics,
            flag_allowed: Arc::default(),
        }
    }

    /// The verdict for a connection that carries no HTTP.
    pub fn check_connection(&self, client: &Client<'_>) -> Verdict {
        self.verdict::<()>(client, Subject::Connection)
    }

    /// The verdict for an HTTP request addressed to `authority`.
    pub fn check_request<B>(
        &self,
        req: &http::Request<B>,
        authority: &str,
        client: &Client<'_>,
    ) -> Verdict {
        self.verdict(client, Subject::Request(req, authority))
    }

    /// Waits until the policy in force changes (forever when it cannot).
    pub async fn changed(&mut self) {
        if self.server.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    fn verdict<B>(&self, client: &Client<'_>, subject: Subject<'_, B>) -> Verdict {
        // Cloned out so the watch's lock is not held while deciding.
        let server = self.server.borrow().clone();
        let Some(server) = server else {
            let verdict = self.flag.check(client.identity, client.ip);
            if verdict == Verdict::Allow {
                self.flag_allowed
                    .get_or_init(|| {
                        let name = format!("default:{}", self.flag.default.as_str());
                        self.metrics.allowed_counter(&name, DEFAULT_ROUTE, &name)
                    })
                    .inc();
            }
            return verdict;
        };
        if server.is_default {
            if let Some(denial) = self.flag.denial(client.identity, client.ip) {
                return refuse(denial, self.flag.audit, client.ip);
            }
        }
        let decision = match subject {
            Subject::Connection => server.check_connection(client),
            Subject::Request(req, authority) => server.check_request(req, authority, client),
        };
        match decision {
            Decision::Allowed {
                audit: false,
                route,
                authz,
                counter,
            } => {
                counter
                    .get_or_init(|| self.metrics.allowed_counter(&server.name, route, authz))
                    .inc();
                Verdict::Allow
            }
            Decision::Allowed {
                audit: true,
                route,
                authz,
                ..
            } => refuse(
                Denial {
                    client: client_name(client.identity),
                    server: server.name.clone(),
                    route: route.into(),
                    authz: authz.into(),
                },
                true,
                client.ip,
            ),
            Decision::Denied { route } => refuse(
                Denial {
                    client: client_name(client.identity),
                    server: server.name.clone(),
                    route: route.into(),
                    authz: if server.is_default {
                        server.name.clone()
                    } else {
                        "none".into()
                    },
                },
                self.flag.audit,
                client.ip,
            ),
            Decision::NoRoute => Verdict::NoRoute(server.name.clone()),
        }
    }
}

/// Distinct `client_id` label values kept; later clients count as `other`,
/// so a stream of new identities cannot grow the metrics without bound.
pub const MAX_CLIENT_LABELS: usize = 100;

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct AllowedLabels {
    pub server: String,
    pub route: String,
    pub authz: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct DeniedLabels {
    pub server: String,
    pub route: String,
    pub authz: String,
    pub client_id: String,
}

/// `tether_proxy_inbound_denied_total`, under audit
/// `tether_proxy_inbound_audit_denied_total`, and the control plane's
/// answers applied and refused.
#[derive(Clone, Default)]
pub struct AuthzMetrics {
    allowed: Family<AllowedLabels, Counter>,
    denied: Family<DeniedLabels, Counter>,
    audited: Family<DeniedLabels, Counter>,
    clients: Arc<Mutex<HashSet<String>>>,
    pub policies: PolicyCounters,
    /// 1 while `--inbound-policy-audit` lets every denial through: a flag
    /// left on after a rollout shows before any would-be denial does.
    pub audit: prometheus_client::metrics::gauge::Gauge,
}

impl AuthzMetrics {
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "tether_proxy_inbound_policy_audit",
            "1 while --inbound-policy-audit lets every denial through",
            self.audit.clone(),
        );
        registry.register(
            "tether_proxy_inbound_allowed",
            "Inbound requests and connections the authorization policy admitted, by server, route and authorization",
            self.allowed.clone(),
        );
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
        registry.register(
            "tether_proxy_inbound_policy_updates",
            "Inbound policies (InboundServerPolicies answers) applied",
            self.policies.applied.clone(),
        );
        registry.register(
            "tether_proxy_inbound_policy_refused",
            "Inbound policies the proxy could not understand and refused (the last good one stayed in force)",
            self.policies.refused.clone(),
        );
    }

    /// The admissions counter of an authorization on a server's route
    /// (kept by the caller: one lookup, then atomic increments). The
    /// labels are bounded by the policies the control plane serves.
    pub fn allowed_counter(&self, server: &str, route: &str, authz: &str) -> Counter {
        self.allowed
            .get_or_create(&AllowedLabels {
                server: server.into(),
                route: route.into(),
                authz: authz.into(),
            })
            .clone()
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
        // (policy, mTLS in cluster, mTLS outside, plaintext in cluster,
        // plaintext outside)
        for (p, mtls_pod, mtls_outside, plain_pod, plain_outside) in [
            (AllUnauthenticated, true, true, true, true),
            (AllAuthenticated, true, true, false, false),
            (ClusterUnauthenticated, true, false, true, false),
            (ClusterAuthenticated, true, false, false, false),
            (Deny, false, false, false, false),
        ] {
            let cases = [
                (id, pod, mtls_pod, "mTLS in cluster"),
                (id, outside, mtls_outside, "mTLS outside"),
                (None, pod, plain_pod, "plaintext in cluster"),
                (None, outside, plain_outside, "plaintext outside"),
            ];
            for (id, ip, want, what) in cases {
                assert_eq!(allowed(p, id, ip), want, "{p:?} {what}");
            }
        }
        let audited = InboundPolicy {
            audit: true,
            ..policy(Deny)
        };
        assert!(matches!(audited.check(id, pod), Verdict::Audit(d) if d.server == "default:deny"));
    }

    fn answer(kind: &str, name: &str, everyone: bool) -> ServerState {
        use linkerd2_proxy_api::inbound as api;
        let labels = std::collections::HashMap::from([
            ("kind".to_string(), kind.to_string()),
            ("name".to_string(), name.to_string()),
        ]);
        let authz = api::Authz {
            networks: vec![api::Network {
                net: Some((IpAddr::from([0, 0, 0, 0]), 0u8).into()),
                except: vec![],
            }],
            authentication: Some(api::Authn {
                permit: Some(api::authn::Permit::Unauthenticated(
                    api::authn::PermitUnauthenticated {},
                )),
            }),
            labels: labels.clone(),
            metadata: None,
        };
        let server = api::Server {
            protocol: Some(api::ProxyProtocol {
                kind: Some(api::proxy_protocol::Kind::Opaque(
                    api::proxy_protocol::Opaque {},
                )),
            }),
            server_ips: vec![],
            authorizations: if everyone { vec![authz] } else { vec![] },
            labels,
        };
        Some(Arc::new(
            crate::inbound_policy::ServerPolicy::from_api(server).unwrap(),
        ))
    }

    #[test]
    fn a_control_plane_default_combines_with_the_proxys_and_a_server_decides_alone() {
        let pod: IpAddr = "10.1.2.3".parse().unwrap();
        let plain = Client {
            identity: None,
            tls: false,
            ip: pod,
        };
        let verdict = |flag: DefaultPolicy, server: ServerState| {
            let (_tx, rx) = watch::channel(server);
            Authorizer::new(policy(flag), rx, AuthzMetrics::default()).check_connection(&plain)
        };
        use DefaultPolicy::*;
        // No answer: the proxy's default alone.
        assert_eq!(verdict(AllUnauthenticated, None), Verdict::Allow);
        assert!(matches!(verdict(Deny, None), Verdict::Deny(d) if d.server == "default:deny"));
        // A default answer: both must admit.
        let open = || answer("default", "all-unauthenticated", true);
        assert_eq!(verdict(AllUnauthenticated, open()), Verdict::Allow);
        assert!(matches!(verdict(Deny, open()), Verdict::Deny(d) if d.authz == "default:deny"));
        let closed = || answer("default", "deny", false);
        assert!(
            matches!(verdict(AllUnauthenticated, closed()), Verdict::Deny(d) if d.server == "default:deny" && d.authz == "default:deny")
        );
        // A Server: its authorizations alone.
        assert_eq!(verdict(Deny, answer("server", "web", true)), Verdict::Allow);
        assert!(
            matches!(verdict(AllUnauthenticated, answer("server", "web", false)), Verdict::Deny(d) if d.server == "web" && d.authz == "none" && d.route == "default")
        );
        // Admissions count per server, route and authorization.
        let metrics = AuthzMetrics::default();
        let (_tx, rx) = watch::channel(answer("server", "web", true));
        let authorizer = Authorizer::new(policy(AllUnauthenticated), rx, metrics.clone());
        for _ in 0..3 {
            assert_eq!(authorizer.check_connection(&plain), Verdict::Allow);
        }
        let mut registry = prometheus_client::registry::Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(
                "tether_proxy_inbound_allowed_total{server=\"web\",route=\"default\",authz=\"web\"} 3"
            ),
            "{text}"
        );
        // The audit flag lets any denial through.
        let (_tx, rx) = watch::channel(answer("server", "web", false));
        let audited = InboundPolicy {
            audit: true,
            ..policy(AllUnauthenticated)
        };
        assert!(matches!(
            Authorizer::new(audited, rx, AuthzMetrics::default()).check_connection(&plain),
            Verdict::Audit(_)
        ));
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
        // A network written in IPv4-mapped form holds the IPv4 clients it
        // names (clients' mapped addresses are read as IPv4).
        let mapped: Network = "::ffff:10.9.0.0/112".parse().unwrap();
        assert!(mapped.contains("10.9.1.2".parse().unwrap()));
        assert!(mapped.contains("::ffff:10.9.1.2".parse().unwrap()));
        assert!(!mapped.contains("10.8.1.2".parse().unwrap()));
        let mapped = Network::new("::ffff:10.9.0.0".parse().unwrap(), 112).unwrap();
        assert!(mapped.contains("10.9.1.2".parse().unwrap()));
        assert!("10.0.0.0/33".parse::<Network>().is_err());
        assert!("10.0.0.0".parse::<Network>().is_err());
        assert!("deny".parse::<DefaultPolicy>().is_ok());
        assert!("allow".parse::<DefaultPolicy>().is_err());
    }
}
