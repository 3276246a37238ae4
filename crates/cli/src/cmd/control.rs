//! `tether control`: the control plane.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use tether_admin::Shutdown;
use tether_control::multicluster::links::Link;
use tether_control::multicluster::MulticlusterConfig;
use tether_control::{ControlConfig, RegistrySource};

use super::args::{count, parse_secs};

fn parse_link(s: &str) -> Result<Link, String> {
    tether_control::multicluster::links::parse_flag(s).map_err(|e| e.message)
}

/// Run the control plane (Destination, policy) over a registry.
#[derive(clap::Args)]
pub struct ControlArgs {
    /// Directory of registry YAML documents (watched for changes), or
    /// `kubernetes` to watch Services, EndpointSlices and Pods.
    #[arg(long)]
    registry: PathBuf,
    /// The largest registry file read; a larger one is refused with an
    /// error naming it (docs/registry.md).
    #[arg(long, default_value_t = tether_control::registry::file::MAX_FILE_BYTES)]
    registry_max_file_bytes: u64,
    /// With --registry kubernetes: the API server URL (default: in-cluster
    /// configuration, else the kubeconfig).
    #[arg(long)]
    kube_api: Option<String>,
    /// With --registry kubernetes: the audience of the projected
    /// ServiceAccount tokens Certify accepts (checked through TokenReview).
    #[arg(long, default_value = "tether.io")]
    token_audience: String,
    /// gRPC listen address (Destination and policy APIs).
    #[arg(long, default_value = "127.0.0.1:8086")]
    grpc: SocketAddr,
    /// Admin listen address (/live, /ready, /metrics).
    #[arg(long, default_value = "127.0.0.1:9990")]
    admin: SocketAddr,
    /// The cluster domain in service names (name.namespace.svc.DOMAIN).
    #[arg(long, default_value = "cluster.local")]
    cluster_domain: String,
    /// Identity directory from `tether identity init`: serve Identity.Certify.
    #[arg(long)]
    identity: Option<PathBuf>,
    /// Lifetime of the leaf certificates Certify signs, in seconds.
    #[arg(long, default_value = "86400", value_parser = parse_secs)]
    identity_leaf_lifetime: Duration,
    /// Seconds between audits of every subscription against the index
    /// (also on demand: GET /audit on the admin listener).
    #[arg(long, default_value = "10", value_parser = parse_secs)]
    audit_interval: Duration,
    /// This cluster's name (multicluster; labels endpoints `cluster`).
    #[arg(long)]
    cluster: Option<String>,
    /// Serve the multicluster export API here (mTLS; needs --identity and --cluster).
    #[arg(long)]
    export: Option<SocketAddr>,
    /// The gateway address the export API advertises.
    #[arg(long)]
    gateway_address: Option<String>,
    /// The gateway identity the export API advertises.
    #[arg(long)]
    gateway_identity: Option<String>,
    /// A linked cluster: name=N,export=HOST:PORT[,gateway=IP:PORT][,priority=P][,trust-root=PATH] (repeatable).
    #[arg(long, value_parser = parse_link)]
    link: Vec<Link>,
    /// A YAML file of links (docs/multicluster.md).
    #[arg(long)]
    links: Option<PathBuf>,
    /// Live Destination.Get streams served at most; beyond, Get is refused
    /// (RESOURCE_EXHAUSTED) and proxies try another replica.
    #[arg(long, default_value = "100000", value_parser = clap::value_parser!(u64).range(1..))]
    max_subscriptions: u64,
    /// The identity the gRPC port's TLS certificate names (issued from
    /// --identity); proxies verify it (default:
    /// tether-control.tether-system.serviceaccount.identity.CLUSTER_DOMAIN).
    #[arg(long)]
    control_identity: Option<String>,
    /// Also serve plaintext gRPC clients (tokens, CSRs and endpoints in
    /// clear); without --identity, serve plaintext only.
    #[arg(long)]
    insecure_control_plane: bool,
    /// The inbound policy served for a workload port no Server selects, in
    /// a namespace without a default of its own (docs/policy.md):
    /// all-unauthenticated, all-authenticated, cluster-unauthenticated,
    /// cluster-authenticated, deny or audit.
    #[arg(long, default_value = "all-unauthenticated")]
    default_inbound_policy: tether_core::policy::DefaultPolicy,
    /// The networks of the cluster-* policies (comma-separated CIDRs).
    #[arg(long, value_delimiter = ',', default_value = tether_control::inbound_policy::DEFAULT_CLUSTER_NETWORKS,
          value_parser = |s: &str| s.trim().parse::<tether_core::policy::Cidr>())]
    cluster_networks: Vec<tether_core::policy::Cidr>,
}

impl ControlArgs {
    /// The control plane's configuration; reads the --links file.
    pub fn into_config(self) -> anyhow::Result<ControlConfig> {
        let mut links = self.link;
        if let Some(path) = &self.links {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            links.extend(tether_control::multicluster::links::parse_file(
                &text,
                &path.display().to_string(),
            )?);
        }
        let config = ControlConfig {
            registry: RegistrySource::from_flag(
                &self.registry,
                self.registry_max_file_bytes,
                self.kube_api,
            ),
            token_audience: self.token_audience,
            grpc_addr: self.grpc,
            admin_addr: self.admin,
            cluster_domain: self.cluster_domain.clone(),
            identity_dir: self.identity,
            leaf_lifetime: self.identity_leaf_lifetime,
            audit_interval: self.audit_interval,
            cluster: self.cluster,
            multicluster: MulticlusterConfig {
                export_addr: self.export,
                gateway_address: self.gateway_address,
                gateway_identity: self.gateway_identity,
                links,
            },
            max_subscriptions: count(self.max_subscriptions),
            control_identity: self.control_identity.unwrap_or_else(|| {
                tether_identity::control::default_control_identity(&self.cluster_domain)
            }),
            insecure_control_plane: self.insecure_control_plane,
            default_inbound_policy: self.default_inbound_policy,
            cluster_networks: self.cluster_networks,
        };
        config.validate()?;
        Ok(config)
    }

    pub async fn run(self, shutdown: Shutdown) -> anyhow::Result<()> {
        tether_control::run(self.into_config()?, shutdown).await?;
        Ok(())
    }
}
