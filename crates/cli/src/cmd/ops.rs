//! Operator tools: `check`, `diagnostics`, `install`, `inject`, `init`.

use std::net::SocketAddr;
use std::path::PathBuf;

/// The cluster domain in service names, for tools that build or read them.
#[derive(clap::Args)]
pub struct ClusterDomainArg {
    /// The cluster domain in service names (name.namespace.svc.DOMAIN).
    #[arg(long, default_value = "cluster.local")]
    cluster_domain: String,
}

/// How operator tools reach control planes.
#[derive(clap::Args)]
pub struct ControlAccessArgs {
    /// The identity directory: its trust root verifies control planes, and
    /// its issuer signs this tool a short-lived certificate for mutual TLS
    /// (`tether check` also checks the root's and issuer's expiry).
    #[arg(long)]
    identity: Option<PathBuf>,
    /// The identity control planes must present (default:
    /// tether-control.tether-system.serviceaccount.identity.CLUSTER_DOMAIN).
    #[arg(long)]
    control_identity: Option<String>,
    /// Plaintext gRPC to control planes that allow it.
    #[arg(long)]
    insecure_control_plane: bool,
}

impl ControlAccessArgs {
    fn access(&self, trust_domain: &str) -> tether_ops::control::ControlAccess {
        tether_ops::control::ControlAccess {
            insecure: self.insecure_control_plane,
            identity_dir: self.identity.clone(),
            control_identity: self.control_identity.clone(),
            trust_domain: trust_domain.to_string(),
        }
    }
}

/// Check the mesh: control planes, replicas, certificates, proxies (a hint per failure).
#[derive(clap::Args)]
pub struct CheckArgs {
    /// A control-plane gRPC address (repeatable).
    #[arg(long, default_value = "127.0.0.1:8086")]
    control: Vec<String>,
    /// A proxy's admin address (repeatable).
    #[arg(long)]
    proxy: Vec<SocketAddr>,
    #[command(flatten)]
    access: ControlAccessArgs,
    /// The registry directory, to check replicas serve what it says.
    #[arg(long)]
    registry: Option<PathBuf>,
    #[command(flatten)]
    domain: ClusterDomainArg,
}

impl CheckArgs {
    pub fn into_config(self) -> tether_ops::check::CheckOptions {
        tether_ops::check::CheckOptions {
            controls: self.control,
            proxies: self.proxy,
            identity: self.access.identity.clone(),
            registry: self.registry,
            access: self.access.access(&self.domain.cluster_domain),
            cluster_domain: self.domain.cluster_domain,
        }
    }

    pub async fn run(self) -> anyhow::Result<()> {
        let ok = tether_ops::check::run(&self.into_config()).await?;
        anyhow::ensure!(ok, "some checks failed");
        Ok(())
    }
}

#[derive(clap::Subcommand)]
pub enum DiagnosticsCommand {
    /// Each replica's endpoints for AUTHORITY (address, ready, identity, zone,
    /// weight) and the differences; exits non-zero when views differ.
    Endpoints {
        /// e.g. web.demo.svc.cluster.local:8080
        authority: String,
        /// A control-plane gRPC address (repeatable).
        #[arg(long, default_value = "127.0.0.1:8086")]
        control: Vec<String>,
        /// Also compare with this registry directory.
        #[arg(long)]
        registry: Option<PathBuf>,
        #[command(flatten)]
        domain: ClusterDomainArg,
        #[command(flatten)]
        access: ControlAccessArgs,
    },
    /// Each replica's metrics, headed by replica.
    ControllerMetrics {
        /// A control-plane gRPC address (repeatable).
        #[arg(long, default_value = "127.0.0.1:8086")]
        control: Vec<String>,
        /// Only lines containing this text.
        #[arg(long)]
        filter: Option<String>,
        #[command(flatten)]
        domain: ClusterDomainArg,
        #[command(flatten)]
        access: ControlAccessArgs,
    },
}

impl DiagnosticsCommand {
    pub async fn run(self) -> anyhow::Result<()> {
        match self {
            Self::Endpoints {
                authority,
                control,
                registry,
                domain,
                access,
            } => {
                let agree = tether_ops::diagnostics::endpoints(
                    &access.access(&domain.cluster_domain),
                    &authority,
                    &control,
                    registry.as_ref(),
                    &domain.cluster_domain,
                )
                .await?;
                anyhow::ensure!(agree, "the views differ");
            }
            Self::ControllerMetrics {
                control,
                filter,
                domain,
                access,
            } => {
                let ok = tether_ops::diagnostics::controller_metrics(
                    &access.access(&domain.cluster_domain),
                    &control,
                    filter.as_deref(),
                )
                .await?;
                anyhow::ensure!(ok, "some replicas could not be read");
            }
        }
        Ok(())
    }
}

/// Print the Kubernetes manifests of the control plane and gateway (`| kubectl apply -f -`).
#[derive(clap::Args)]
pub struct InstallArgs {
    /// The identity directory from `tether identity init` (its trust root and issuer become Secrets).
    #[arg(long, required_unless_present = "crds")]
    identity: Option<PathBuf>,
    /// Print only the policy.linkerd.io CRDs the control plane watches, for a
    /// cluster without Linkerd's (docs/policy.md).
    #[arg(long, conflicts_with_all = ["identity", "ha"])]
    crds: bool,
    /// The namespace of the control plane and gateway.
    #[arg(long, default_value = "tether-system")]
    namespace: String,
    /// High availability: 3 control-plane replicas, a PodDisruptionBudget, anti-affinity.
    #[arg(long)]
    ha: bool,
    /// The container image holding the tether binary.
    #[arg(long, default_value = concat!("tether:", env!("CARGO_PKG_VERSION")))]
    image: String,
    #[command(flatten)]
    domain: ClusterDomainArg,
}

impl InstallArgs {
    pub fn into_config(self) -> tether_ops::kube::InstallOptions {
        tether_ops::kube::InstallOptions {
            namespace: self.namespace,
            image: self.image,
            ha: self.ha,
            identity_dir: self.identity.unwrap_or_default(),
            cluster_domain: self.domain.cluster_domain,
        }
    }

    pub fn run(self) -> anyhow::Result<()> {
        if self.crds {
            print!("{}", tether_ops::kube::policy_crds());
            return Ok(());
        }
        print!("{}", tether_ops::kube::install(&self.into_config())?);
        Ok(())
    }
}

/// Add the proxy (native sidecar) and `tether init` to workload manifests (FILE, or - for stdin).
#[derive(clap::Args)]
pub struct InjectArgs {
    /// The manifests to edit; - reads stdin.
    #[arg(default_value = "-")]
    file: PathBuf,
    /// The container image holding the tether binary.
    #[arg(long, default_value = concat!("tether:", env!("CARGO_PKG_VERSION")))]
    image: String,
    /// The control plane's namespace.
    #[arg(long, default_value = "tether-system")]
    control_namespace: String,
    #[command(flatten)]
    domain: ClusterDomainArg,
}

impl InjectArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let input = tether_ops::kube::read_input(&self.file)?;
        let options = tether_ops::kube::InjectOptions {
            image: self.image,
            control_namespace: self.control_namespace,
            cluster_domain: self.domain.cluster_domain,
        };
        print!("{}", tether_ops::kube::inject(&input, &options)?);
        Ok(())
    }
}

/// `tether init --mode`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum InterceptionMode {
    Redirect,
    Tproxy,
}

/// Program iptables for transparent interception (what a sidecar's init container does).
#[derive(clap::Args)]
pub struct InitArgs {
    /// The proxy's user id; its own traffic is never redirected.
    #[arg(long, default_value = "1337")]
    proxy_uid: u32,
    /// The proxy's outbound port, where redirected outbound traffic goes.
    #[arg(long, default_value = "4140")]
    outbound_port: u16,
    /// The proxy's inbound port, where redirected inbound traffic goes.
    #[arg(long, default_value = "4143")]
    inbound_port: u16,
    /// Inbound ports not redirected (comma-separated), e.g. the proxy's admin port.
    #[arg(long, value_delimiter = ',', default_value = "4191")]
    skip_inbound_ports: Vec<u16>,
    /// Outbound destination ports not redirected (comma-separated).
    #[arg(long, value_delimiter = ',')]
    skip_outbound_ports: Vec<u16>,
    /// Redirect only outbound traffic.
    #[arg(long)]
    outbound_only: bool,
    /// How connections reach the proxy: redirect (NAT; the kernel tracks
    /// every connection in the pod) or tproxy (TPROXY and a routing rule,
    /// no connection tracking; the proxy must run with --transparent,
    /// which needs CAP_NET_RAW). See docs/interception.md.
    #[arg(long, value_enum, default_value = "redirect")]
    mode: InterceptionMode,
    /// The iptables command to run (e.g. iptables-legacy).
    #[arg(long, default_value = "iptables")]
    iptables: String,
    /// The ip command (iproute2) tproxy mode's routing rule is set with.
    #[arg(long, default_value = "ip")]
    ip: String,
    /// Print the iptables commands without running them.
    #[arg(long)]
    dry_run: bool,
}

impl InitArgs {
    pub fn into_config(self) -> tether_ops::init::InitOptions {
        tether_ops::init::InitOptions {
            iptables: self.iptables,
            ip: self.ip,
            mode: match self.mode {
                InterceptionMode::Redirect => tether_ops::init::Mode::Redirect,
                InterceptionMode::Tproxy => tether_ops::init::Mode::Tproxy,
            },
            proxy_uid: self.proxy_uid,
            outbound_port: self.outbound_port,
            inbound_port: self.inbound_port,
            skip_inbound_ports: self.skip_inbound_ports,
            skip_outbound_ports: self.skip_outbound_ports,
            inbound: !self.outbound_only,
            dry_run: self.dry_run,
        }
    }

    pub fn run(self) -> anyhow::Result<()> {
        tether_ops::init::run(&self.into_config())?;
        Ok(())
    }
}
