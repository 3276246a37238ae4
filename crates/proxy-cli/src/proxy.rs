//! The sidecar proxy's flags: `tether-proxy FLAGS` and `tether proxy FLAGS`.

use std::net::SocketAddr;
use std::time::Duration;

use tether_admin::Shutdown;

use crate::args::{count, parse_secs, BootstrapArgs, IdentityArgs};

fn parse_upstream(s: &str) -> Result<(SocketAddr, String), String> {
    let (listen, authority) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected LISTEN_ADDR=AUTHORITY, e.g. 127.0.0.1:5432=db.demo.svc.cluster.local:5432"))?;
    let listen = listen
        .parse()
        .map_err(|_| format!("{listen:?} is not an address (ip:port)"))?;
    Ok((listen, authority.to_string()))
}

/// Run the sidecar proxy.
#[derive(clap::Args)]
pub struct ProxyArgs {
    #[command(flatten)]
    bootstrap: BootstrapArgs,
    /// Outbound listener: the app sends requests for mesh services here.
    #[arg(long, default_value = "127.0.0.1:4140")]
    outbound: SocketAddr,
    /// Inbound listener: peer proxies connect here (runs when --app is set).
    #[arg(long, default_value = "0.0.0.0:4143")]
    inbound: SocketAddr,
    /// The outbound and inbound listeners are transparent (IP_TRANSPARENT):
    /// they accept the connections `tether init --mode tproxy` diverts to
    /// them, each with its original destination as its own address. Needs
    /// CAP_NET_RAW (CAP_NET_ADMIN before Linux 5.17; docs/interception.md).
    #[arg(long, env = "TETHER_PROXY_TRANSPARENT")]
    transparent: bool,
    /// The local app's address, where inbound traffic goes.
    #[arg(long)]
    app: Option<SocketAddr>,
    /// The app's port is opaque TCP (a database, a server-speaks-first
    /// protocol): inbound connections are forwarded without detection.
    /// Without it the inbound forwards only HTTP and refuses the rest.
    #[arg(long, requires = "app")]
    inbound_opaque: bool,
    /// Who may call the app: all-unauthenticated, all-authenticated (mTLS
    /// clients only), cluster-unauthenticated (any client from
    /// --cluster-networks), cluster-authenticated (mTLS clients from
    /// --cluster-networks) or deny. Denied requests get 403, denied TCP
    /// connections are closed (docs/policy.md).
    #[arg(long, default_value = "all-unauthenticated")]
    default_inbound_policy: tether_proxy::authz::DefaultPolicy,
    /// Let requests the policy would deny through, logging and counting
    /// them (tether_proxy_inbound_audit_denied_total), for rollouts.
    #[arg(long)]
    inbound_policy_audit: bool,
    /// The networks the cluster-* policies admit clients from.
    #[arg(long, value_delimiter = ',', default_value = tether_proxy::authz::DEFAULT_CLUSTER_NETWORKS)]
    cluster_networks: Vec<tether_proxy::authz::Network>,
    /// The workload this proxy fronts, NAMESPACE/NAME (the registry
    /// endpoint's `name`): the proxy then follows the control plane's
    /// inbound policy for the app's port (docs/policy.md).
    #[arg(long, env = "TETHER_PROXY_WORKLOAD", requires = "app")]
    workload: Option<tether_proxy::inbound_policy::Workload>,
    /// A local listener pinned to one service: LISTEN=AUTHORITY (repeatable).
    /// Opaque TCP when the service port is opaque, HTTP otherwise.
    #[arg(long, value_parser = parse_upstream)]
    upstream: Vec<(SocketAddr, String)>,
    #[command(flatten)]
    identity: IdentityArgs,
    /// opportunistic (accept and send plaintext when TLS is not possible) or mandatory.
    #[arg(long, default_value = "opportunistic")]
    tls: tether_proxy::tls::TlsMode,
    /// When the control plane cannot route a request: fail (503 at once) or
    /// forward it to its original destination (IP authority or absolute URI).
    #[arg(long, default_value = "fail")]
    control_plane_unavailable: tether_proxy::outbound::forward::Unavailable,
    /// Requests that may wait, per service, for an endpoint to appear.
    #[arg(long, default_value = "100")]
    max_pending: usize,
    /// Stay not-ready until the control plane has answered for AUTHORITY (repeatable).
    #[arg(long)]
    require_discovery: Vec<String>,
    /// Retries allowed as a fraction of requests (over 10 s); a service's
    /// `retry_budget` in the registry overrides it.
    #[arg(long, default_value = "0.2")]
    retry_budget_ratio: f64,
    /// Retries always allowed per second, whatever the traffic.
    #[arg(long, default_value = "10")]
    retry_budget_min_per_second: f64,
    /// Authorities (service:port) followed at once, one discovery
    /// subscription each; past it the least recently used idle one is
    /// dropped, and with none idle new authorities get 503.
    #[arg(long, default_value = "1000", value_parser = clap::value_parser!(u64).range(1..))]
    max_discovery_subscriptions: u64,
    /// Seconds a control plane may take to send a discovery stream's first
    /// update before the next --control address is tried.
    #[arg(long, default_value = "1", value_parser = parse_secs)]
    discovery_first_answer_timeout: Duration,
}

impl ProxyArgs {
    /// Worker threads for the runtime (`--threads`, else the CPU quota, else 1).
    pub fn worker_threads(&self) -> usize {
        self.bootstrap.worker_threads()
    }

    pub fn into_config(self) -> anyhow::Result<tether_proxy::ProxyConfig> {
        anyhow::ensure!(
            self.retry_budget_ratio >= 0.0 && self.retry_budget_min_per_second >= 0.0,
            "retry budget settings must not be negative"
        );
        anyhow::ensure!(
            !self.discovery_first_answer_timeout.is_zero(),
            "--discovery-first-answer-timeout must be more than 0"
        );
        let outbound = tether_proxy::outbound::OutboundConfig {
            failfast_timeout: self.bootstrap.failfast_timeout,
            max_pending: self.max_pending,
            control_plane_unavailable: self.control_plane_unavailable,
            retry_budget: tether_proxy::retry::BudgetSpec {
                ratio: self.retry_budget_ratio,
                min_per_second: self.retry_budget_min_per_second,
                ttl: tether_core::registry::RETRY_BUDGET_WINDOW,
            },
            response_timeout: self.bootstrap.serve.response_timeout(),
            max_subscriptions: count(self.max_discovery_subscriptions),
        };
        let discovery = tether_proxy::discovery::DiscoverySettings {
            first_answer_timeout: self.discovery_first_answer_timeout,
        };
        Ok(tether_proxy::ProxyConfig {
            bootstrap: self.bootstrap.into_config(
                self.identity.into_config()?,
                self.tls,
                discovery,
            ),
            outbound_listen: self.outbound,
            transparent: self.transparent,
            upstreams: self.upstream,
            require_discovery: self.require_discovery,
            outbound,
            inbound: self.app.map(|app| tether_proxy::inbound::InboundConfig {
                listen: self.inbound,
                app,
                opaque: self.inbound_opaque,
                policy: tether_proxy::authz::InboundPolicy {
                    default: self.default_inbound_policy,
                    audit: self.inbound_policy_audit,
                    cluster_networks: self.cluster_networks,
                },
                workload: self.workload,
            }),
        })
    }

    pub async fn run(self, shutdown: Shutdown) -> anyhow::Result<()> {
        tether_proxy::run(self.into_config()?, shutdown).await?;
        Ok(())
    }
}
